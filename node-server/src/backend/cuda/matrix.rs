//! Dense weight matrices on the GPU, in their own format; products through
//! [`Cuda::matmul`] (the `matvec` kernel for few tokens, cuBLAS SGEMM for many), or for an
//! EXL3 layer [`Cuda::exl3_matmul`] (its GEMV, or its weights decoded for cuBLAS).

use super::{Cuda, CudaError, Exl3Weights};
use crate::backend::cpu::{DeviceWeights, Matrix, Placer};
use crate::quant::Format;
use cudarc::driver::CudaSlice;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// A weight matrix on one GPU, in its own format: the model's device copy of a [`Matrix`]
/// (through [`DeviceWeights`], products of host rows) and the GPU forward's weight (products
/// of device rows, [`CudaMatrix::apply`]). Cloning shares the device bytes.
#[derive(Clone)]
pub struct CudaMatrix {
    cuda: Arc<Cuda>,
    weights: DeviceData,
    rows: usize,
    cols: usize,
}

#[derive(Clone)]
enum DeviceData {
    /// Rows in one format.
    Rows {
        w: Arc<CudaSlice<u8>>,
        format: Format,
    },
    /// An EXL3 layer (`cols` inputs, `rows` outputs).
    Exl3(Arc<Exl3Weights>),
}

impl CudaMatrix {
    pub fn upload(cuda: &Arc<Cuda>, m: &Matrix) -> Result<CudaMatrix, CudaError> {
        let weights = match (m.exl3(), m.format(), m.as_bytes()) {
            (Some(lin), _, _) => DeviceData::Exl3(Arc::new(Exl3Weights::upload(cuda, lin)?)),
            (None, Some(format), Some(bytes)) => DeviceData::Rows {
                w: Arc::new(cuda.upload(&bytes)?),
                format,
            },
            _ => return Err(CudaError::Invalid(format!("{m:?}: no device form"))),
        };
        Ok(CudaMatrix {
            cuda: cuda.clone(),
            weights,
            rows: m.rows(),
            cols: m.cols(),
        })
    }

    /// `m` on `cuda`: the device copy it carries there (shared), else an upload of its bytes.
    pub fn of(cuda: &Arc<Cuda>, m: &Matrix) -> Result<CudaMatrix, CudaError> {
        match CudaMatrix::placed(m) {
            Some(placed) if Arc::ptr_eq(&placed.cuda, cuda) => Ok(placed.clone()),
            _ => CudaMatrix::upload(cuda, m),
        }
    }

    /// The device copy `m` carries, when it is on a GPU.
    pub fn placed(m: &Matrix) -> Option<&CudaMatrix> {
        m.device()?.as_any().downcast_ref::<CudaMatrix>()
    }

    /// Output values per token row.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Inputs per token row.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The weights as rows (`[rows, cols]`) with their format, unless they are an EXL3 layer.
    pub fn row_weights(&self) -> Option<(&CudaSlice<u8>, Format)> {
        match &self.weights {
            DeviceData::Rows { w, format } => Some((w, *format)),
            DeviceData::Exl3(_) => None,
        }
    }

    /// The device the copy lives on.
    pub fn cuda(&self) -> &Arc<Cuda> {
        &self.cuda
    }

    /// `W x` for each of `n` token rows of `x` (`[n, cols]`, on this device): `[n, rows]`.
    pub fn apply(&self, x: &CudaSlice<f32>, n: usize) -> Result<CudaSlice<f32>, CudaError> {
        self.apply_on(&self.cuda, x, n)
    }

    /// [`CudaMatrix::apply`] queued on `cuda`, a queue of the device the weights are on (its
    /// own or a [`Cuda::side`] of it).
    pub fn apply_on(
        &self,
        cuda: &Cuda,
        x: &CudaSlice<f32>,
        n: usize,
    ) -> Result<CudaSlice<f32>, CudaError> {
        let mut y = cuda.alloc_f32(n * self.rows)?;
        match &self.weights {
            DeviceData::Rows { w, format } => {
                cuda.matmul(w, *format, self.rows, self.cols, x, n, &mut y)?
            }
            DeviceData::Exl3(w) => cuda.exl3_matmul(w, x, n, &mut y)?,
        }
        Ok(y)
    }

    fn product(&self, x: &[f32], n: usize) -> Result<Vec<f32>, CudaError> {
        let dx = self.cuda.upload(x)?;
        let mut y = self.cuda.download(&self.apply(&dx, n)?)?;
        y.truncate(n * self.rows);
        Ok(y)
    }
}

impl DeviceWeights for CudaMatrix {
    fn matmul_into(&self, x: &[f32], n: usize, y: &mut [f32]) -> anyhow::Result<()> {
        let got = self.product(x, n)?;
        y.copy_from_slice(&got);
        Ok(())
    }

    fn bytes(&self) -> usize {
        match &self.weights {
            DeviceData::Rows { w, .. } => w.len(),
            DeviceData::Exl3(w) => w.bytes(),
        }
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Puts every dense matrix of at least `min_values` values on the GPU.
pub struct CudaPlacer {
    cuda: Arc<Cuda>,
    min_values: usize,
    placed_bytes: AtomicUsize,
    failed: Mutex<Option<String>>,
}

impl CudaPlacer {
    pub fn new(cuda: Arc<Cuda>, min_values: usize) -> Result<CudaPlacer, CudaError> {
        Ok(CudaPlacer {
            cuda,
            min_values,
            placed_bytes: AtomicUsize::new(0),
            failed: Mutex::new(None),
        })
    }

    /// Device bytes of every matrix placed so far.
    pub fn placed_bytes(&self) -> usize {
        self.placed_bytes.load(Ordering::Relaxed)
    }

    /// The first upload failure, if any (the matrix then stayed on the CPU).
    pub fn failure(&self) -> Option<String> {
        self.failed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl Placer for CudaPlacer {
    fn place(&self, m: &Matrix) -> Option<Arc<dyn DeviceWeights>> {
        if m.rows() * m.cols() < self.min_values {
            return None;
        }
        match CudaMatrix::upload(&self.cuda, m) {
            Ok(d) => {
                self.placed_bytes.fetch_add(d.bytes(), Ordering::Relaxed);
                Some(Arc::new(d))
            }
            Err(e) => {
                self.failed
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get_or_insert_with(|| format!("{m:?}: {e}"));
                None
            }
        }
    }
}
