//! CPU backend: weight matrices in any [`Format`], products through the `gemm` crate or
//! SIMD row dots, and the small elementwise ops of the model.

mod gemm;
pub mod ops;

use crate::quant::{self, Format};
use rayon::prelude::*;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// A copy of a matrix's weights on an accelerator, which computes its products there.
pub trait DeviceWeights: Send + Sync {
    /// `y[t] = W x[t]` for `n` token rows, as [`Matrix::matmul_into`].
    fn matmul_into(&self, x: &[f32], n: usize, y: &mut [f32]) -> anyhow::Result<()>;
    /// Device bytes the copy occupies.
    fn bytes(&self) -> usize;
    /// The concrete copy, for a backend that chains its own kernels on it.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// Decides which weight matrices get a device copy as a model loads.
pub trait Placer: Send + Sync {
    fn place(&self, m: &Matrix) -> Option<Arc<dyn DeviceWeights>>;
}

/// Row count of the f32 tile a block-format matrix is expanded into for a many-token product.
const DEQUANT_TILE_ROWS: usize = 64;
/// At or below this many tokens a block-format product uses row dots instead of a GEMM.
const ROW_DOT_MAX_TOKENS: usize = 2;

#[derive(Clone)]
enum Data {
    F32(Vec<f32>),
    Packed(Vec<u8>),
}

/// A `rows x cols` weight matrix (`y = W x`), rows stored in one [`Format`].
#[derive(Clone)]
pub struct Matrix {
    rows: usize,
    cols: usize,
    format: Format,
    data: Data,
    /// When set, products run there (the host bytes stay for row reads and as the fallback).
    device: Option<Arc<dyn DeviceWeights>>,
}

impl std::fmt::Debug for Matrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Matrix({}x{} {})",
            self.rows,
            self.cols,
            self.format.name()
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum MatrixError {
    #[error("matrix {rows}x{cols} in {format} needs {expected} bytes, got {found}")]
    Size {
        rows: usize,
        cols: usize,
        format: &'static str,
        expected: usize,
        found: usize,
    },
    #[error(transparent)]
    Quant(#[from] quant::QuantError),
}

impl Matrix {
    pub fn from_f32(rows: usize, cols: usize, values: Vec<f32>) -> Matrix {
        assert_eq!(values.len(), rows * cols, "matrix {rows}x{cols}");
        Matrix {
            rows,
            cols,
            format: Format::F32,
            data: Data::F32(values),
            device: None,
        }
    }

    /// Rows already encoded in `format` (little-endian floats or quantized blocks).
    pub fn from_bytes(
        rows: usize,
        cols: usize,
        format: Format,
        bytes: Vec<u8>,
    ) -> Result<Matrix, MatrixError> {
        let expected = rows * format.row_bytes(cols)?;
        if bytes.len() != expected {
            return Err(MatrixError::Size {
                rows,
                cols,
                format: format.name(),
                expected,
                found: bytes.len(),
            });
        }
        if format == Format::F32 {
            let values = bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            return Ok(Matrix::from_f32(rows, cols, values));
        }
        Ok(Matrix {
            rows,
            cols,
            format,
            data: Data::Packed(bytes),
            device: None,
        })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn format(&self) -> Format {
        self.format
    }

    /// Products of this matrix run on `device` from now on.
    pub fn set_device(&mut self, device: Option<Arc<dyn DeviceWeights>>) {
        self.device = device;
    }

    /// The device copy products run on, if any.
    pub fn device(&self) -> Option<&Arc<dyn DeviceWeights>> {
        self.device.as_ref()
    }

    /// Device bytes of this matrix's device copy (0 when it has none).
    pub fn device_bytes(&self) -> usize {
        self.device.as_ref().map_or(0, |d| d.bytes())
    }

    /// Start and length of the bytes the weights occupy (for pinning them in RAM).
    pub fn storage_span(&self) -> (*const u8, usize) {
        match &self.data {
            Data::F32(v) => (v.as_ptr().cast(), v.len() * 4),
            Data::Packed(b) => (b.as_ptr(), b.len()),
        }
    }

    /// Bytes the weights occupy.
    pub fn storage_bytes(&self) -> usize {
        match &self.data {
            Data::F32(v) => v.len() * 4,
            Data::Packed(b) => b.len(),
        }
    }

    /// As [`Matrix::to_bytes`], borrowing the storage where it already is those bytes (every
    /// format but f32), so a copy to the GPU reads the resident (possibly registered) pages.
    pub fn as_bytes(&self) -> std::borrow::Cow<'_, [u8]> {
        match &self.data {
            Data::F32(_) => std::borrow::Cow::Owned(self.to_bytes()),
            Data::Packed(b) => std::borrow::Cow::Borrowed(b),
        }
    }

    /// The rows encoded in this matrix's format, concatenated.
    pub fn to_bytes(&self) -> Vec<u8> {
        match &self.data {
            Data::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Data::Packed(b) => b.clone(),
        }
    }

    /// Row `r` as f32.
    pub fn row_f32(&self, r: usize) -> Vec<f32> {
        let mut out = vec![0.0; self.cols];
        self.dequantize_rows(r, r + 1, &mut out);
        out
    }

    /// The matrix in another format (quantizing or widening every row).
    pub fn convert(&self, format: Format) -> Result<Matrix, MatrixError> {
        let row_bytes = format.row_bytes(self.cols)?;
        let mut bytes = vec![0u8; self.rows * row_bytes];
        let mut row = vec![0f32; self.cols];
        for r in 0..self.rows {
            self.dequantize_rows(r, r + 1, &mut row);
            quant::quantize_row(format, &row, &mut bytes[r * row_bytes..(r + 1) * row_bytes])?;
        }
        Matrix::from_bytes(self.rows, self.cols, format, bytes)
    }

    fn dequantize_rows(&self, r0: usize, r1: usize, out: &mut [f32]) {
        let c = self.cols;
        match &self.data {
            Data::F32(v) => out[..(r1 - r0) * c].copy_from_slice(&v[r0 * c..r1 * c]),
            Data::Packed(b) => {
                let rb = self.format.row_bytes(c).expect("validated at construction");
                for r in r0..r1 {
                    let start = r * rb;
                    quant::dequantize_row(
                        self.format,
                        &b[start..start + rb],
                        &mut out[(r - r0) * c..(r - r0 + 1) * c],
                    )
                    .expect("validated at construction");
                }
            }
        }
    }

    /// `y[t] = W x[t]` for `n` token rows of `x` (`n x cols`, row-major); returns `n x rows`.
    pub fn matmul(&self, x: &[f32], n: usize) -> Vec<f32> {
        let mut y = vec![0f32; n * self.rows];
        self.matmul_into(x, n, &mut y);
        y
    }

    /// As [`Matrix::matmul`], writing into `y` (`n x rows`).
    pub fn matmul_into(&self, x: &[f32], n: usize, y: &mut [f32]) {
        let (rows, cols) = (self.rows, self.cols);
        assert_eq!(
            x.len(),
            n * cols,
            "matmul input of {n} rows for a {rows}x{cols} matrix"
        );
        assert_eq!(
            y.len(),
            n * rows,
            "matmul output of {n} rows for a {rows}x{cols} matrix"
        );
        if n == 0 || rows == 0 {
            return;
        }
        if let Some(device) = &self.device {
            match device.matmul_into(x, n, y) {
                Ok(()) => return,
                Err(e) => {
                    static WARNED: AtomicBool = AtomicBool::new(false);
                    if !WARNED.swap(true, Ordering::Relaxed) {
                        tracing::error!(error = %e, "device product failed; this and later failures run on the CPU");
                    }
                }
            }
        }
        match &self.data {
            Data::F32(w) => gemm::gemm_xwt(x, n, w, rows, cols, y, 0),
            Data::Packed(b) if n <= ROW_DOT_MAX_TOKENS => {
                let rb = self
                    .format
                    .row_bytes(cols)
                    .expect("validated at construction");
                let fmt = self.format;
                // Parallel over output rows; each row's dot is one SIMD pass over its bytes.
                let mut yt = vec![0f32; rows * n];
                yt.par_chunks_mut(n).enumerate().for_each(|(r, out)| {
                    let row = &b[r * rb..(r + 1) * rb];
                    for (t, o) in out.iter_mut().enumerate() {
                        *o = quant::dot_row(fmt, row, &x[t * cols..(t + 1) * cols]);
                    }
                });
                for t in 0..n {
                    for r in 0..rows {
                        y[t * rows + r] = yt[r * n + t];
                    }
                }
            }
            Data::Packed(_) => {
                let tiles: Vec<(usize, Vec<f32>)> = (0..rows.div_ceil(DEQUANT_TILE_ROWS))
                    .into_par_iter()
                    .map(|tile| {
                        let r0 = tile * DEQUANT_TILE_ROWS;
                        let r1 = (r0 + DEQUANT_TILE_ROWS).min(rows);
                        let mut w = vec![0f32; (r1 - r0) * cols];
                        self.dequantize_rows(r0, r1, &mut w);
                        let mut part = vec![0f32; n * (r1 - r0)];
                        gemm::gemm_xwt(x, n, &w, r1 - r0, cols, &mut part, usize::MAX);
                        (r0, part)
                    })
                    .collect();
                for (r0, part) in tiles {
                    let width = part.len() / n;
                    for t in 0..n {
                        y[t * rows + r0..t * rows + r0 + width]
                            .copy_from_slice(&part[t * width..(t + 1) * width]);
                    }
                }
            }
        }
    }
}
