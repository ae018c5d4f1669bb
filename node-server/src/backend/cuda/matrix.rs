//! Dense weight matrices on the GPU, in their own format; products through
//! [`Cuda::matmul`] (the `matvec` kernel for few tokens, cuBLAS SGEMM for many).

use super::{Cuda, CudaError};
use crate::backend::cpu::{DeviceWeights, Matrix, Placer};
use crate::quant::Format;
use cudarc::driver::CudaSlice;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

pub struct CudaMatrix {
    cuda: Arc<Cuda>,
    w: CudaSlice<u8>,
    format: Format,
    rows: usize,
    cols: usize,
}

impl CudaMatrix {
    pub fn upload(cuda: &Arc<Cuda>, m: &Matrix) -> Result<CudaMatrix, CudaError> {
        let (Some(format), Some(bytes)) = (m.format(), m.as_bytes()) else {
            return Err(CudaError::Invalid(format!(
                "{m:?}: EXL3 weights have no CUDA kernels"
            )));
        };
        Ok(CudaMatrix {
            cuda: cuda.clone(),
            w: cuda.upload(&bytes)?,
            format,
            rows: m.rows(),
            cols: m.cols(),
        })
    }

    /// Whether the copy lives on `cuda` (the same context, so its buffers can be passed to
    /// that device's kernels).
    pub(crate) fn is_on(&self, cuda: &Arc<Cuda>) -> bool {
        Arc::ptr_eq(&self.cuda, cuda)
    }

    /// The device the copy lives on.
    pub(crate) fn cuda(&self) -> &Arc<Cuda> {
        &self.cuda
    }

    /// The weight bytes in the matrix's own format (what `Cuda::matvec` takes).
    pub(crate) fn weights(&self) -> &CudaSlice<u8> {
        &self.w
    }

    fn product(&self, x: &[f32], n: usize) -> Result<Vec<f32>, CudaError> {
        let dx = self.cuda.upload(x)?;
        let mut dy = self.cuda.alloc_f32(n * self.rows)?;
        self.cuda
            .matmul(&self.w, self.format, self.rows, self.cols, &dx, n, &mut dy)?;
        let mut y = self.cuda.download(&dy)?;
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
        self.w.len()
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
        // EXL3 matrices have no CUDA kernels: their products stay on the CPU.
        if m.rows() * m.cols() < self.min_values || m.format().is_none() {
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
