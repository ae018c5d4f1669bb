//! Dense weight matrices on the GPU: decode-sized products through the `matvec` kernel (any
//! weight format), many-token f32 products through cuBLAS SGEMM (full f32, no TF32).
#![allow(unsafe_code)] // cuBLAS calls; the block says why it holds

use super::{Cuda, CudaError};
use crate::backend::cpu::{DeviceWeights, Matrix, Placer};
use crate::quant::Format;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys::cublasOperation_t};
use cudarc::driver::CudaSlice;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Above this many tokens an f32 matrix's product goes through cuBLAS.
const GEMM_MIN_TOKENS: usize = 9;

pub struct CudaMatrix {
    cuda: Arc<Cuda>,
    blas: Arc<Mutex<CudaBlas>>,
    w: CudaSlice<u8>,
    /// The same weights typed for cuBLAS (f32 matrices only).
    w32: Option<CudaSlice<f32>>,
    format: Format,
    rows: usize,
    cols: usize,
}

impl CudaMatrix {
    pub fn upload(
        cuda: &Arc<Cuda>,
        blas: &Arc<Mutex<CudaBlas>>,
        m: &Matrix,
    ) -> Result<CudaMatrix, CudaError> {
        let bytes = m.to_bytes();
        let w32 = if m.format() == Format::F32 {
            let values: Vec<f32> = bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            Some(cuda.upload(&values)?)
        } else {
            None
        };
        Ok(CudaMatrix {
            cuda: cuda.clone(),
            blas: blas.clone(),
            w: cuda.upload(&bytes)?,
            w32,
            format: m.format(),
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
        match &self.w32 {
            Some(w32) if n >= GEMM_MIN_TOKENS => {
                // Row-major y[n, rows] = x[n, cols] W^T is, column-major, y^T = W x^T:
                // W's row-major bytes are W^T column-major (lda = cols), so op(A) = T.
                let cfg = GemmConfig {
                    transa: cublasOperation_t::CUBLAS_OP_T,
                    transb: cublasOperation_t::CUBLAS_OP_N,
                    m: self.rows as i32,
                    n: n as i32,
                    k: self.cols as i32,
                    alpha: 1.0f32,
                    lda: self.cols as i32,
                    ldb: self.cols as i32,
                    beta: 0.0f32,
                    ldc: self.rows as i32,
                };
                let blas = self.blas.lock().unwrap_or_else(|e| e.into_inner());
                // SAFETY: w32 is rows x cols, dx n x cols, dy n x rows, as cfg says.
                unsafe { blas.gemm(cfg, w32, &dx, &mut dy) }
                    .map_err(|e| CudaError::Invalid(format!("cuBLAS SGEMM: {e:?}")))?;
            }
            _ => self
                .cuda
                .matvec(&self.w, self.format, self.rows, self.cols, &dx, n, &mut dy)?,
        }
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
        self.w.len() + self.w32.as_ref().map_or(0, |w| w.len() * 4)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Puts every dense matrix of at least `min_values` values on the GPU.
pub struct CudaPlacer {
    cuda: Arc<Cuda>,
    blas: Arc<Mutex<CudaBlas>>,
    min_values: usize,
    placed_bytes: AtomicUsize,
    failed: Mutex<Option<String>>,
}

impl CudaPlacer {
    pub fn new(cuda: Arc<Cuda>, min_values: usize) -> Result<CudaPlacer, CudaError> {
        let blas = CudaBlas::new(cuda.stream().clone())
            .map_err(|e| CudaError::Unavailable(format!("cuBLAS could not start: {e:?}")))?;
        Ok(CudaPlacer {
            cuda,
            blas: Arc::new(Mutex::new(blas)),
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
        match CudaMatrix::upload(&self.cuda, &self.blas, m) {
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
