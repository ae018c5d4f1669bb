//! CPU backend: weight matrices in any [`Format`] or as EXL3 trellises, products through the
//! `gemm` crate, SIMD row dots or the EXL3 kernels, and the small elementwise ops of the model.

mod gemm;
pub mod ops;

use crate::quant::exl3::Exl3Linear;
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
/// At or below this many tokens an EXL3 product decodes its tiles inside the product (once
/// per four tokens); above, it decodes [`EXL3_STRIP_COLUMNS`] outputs at a time to f32 for
/// a GEMM.
const EXL3_FUSED_MAX_TOKENS: usize = 16;
/// Output columns an EXL3 matrix expands to f32 at a time for a many-token product.
const EXL3_STRIP_COLUMNS: usize = 64;

#[derive(Clone)]
enum Data {
    F32(Vec<f32>),
    /// Rows in a block or 16-bit float format.
    Packed(Format, quant::Bytes),
    /// `W^T` of the EXL3 layer (`cols` inputs, `rows` outputs).
    Exl3(Box<Exl3Linear>),
    /// The host bytes were given back once the device copy held them
    /// ([`Matrix::release_host`]): products run on the device only.
    Released {
        /// The row format the matrix had (`None`: an EXL3 trellis).
        format: Option<Format>,
    },
}

/// A `rows x cols` weight matrix (`y = W x`): rows stored in one [`Format`], or an EXL3
/// trellis (which has no row format).
#[derive(Clone)]
pub struct Matrix {
    rows: usize,
    cols: usize,
    data: Data,
    /// When set, products run there (the host bytes stay for row reads and as the fallback).
    device: Option<Arc<dyn DeviceWeights>>,
}

impl std::fmt::Debug for Matrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.data {
            Data::Exl3(lin) => write!(
                f,
                "Matrix({}x{} exl3 {} bpw {})",
                self.rows,
                self.cols,
                lin.rate(),
                lin.codebook()
            ),
            Data::Released { format } => write!(
                f,
                "Matrix({}x{} {}, host copy released)",
                self.rows,
                self.cols,
                format.map_or("exl3", Format::name)
            ),
            _ => write!(
                f,
                "Matrix({}x{} {})",
                self.rows,
                self.cols,
                self.format().map_or("?", Format::name)
            ),
        }
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
            data: Data::F32(values),
            device: None,
        }
    }

    /// The EXL3 layer `y = x W` as the matrix `W^T` (`out_features x in_features`).
    pub fn from_exl3(linear: Exl3Linear) -> Matrix {
        Matrix {
            rows: linear.out_features(),
            cols: linear.in_features(),
            data: Data::Exl3(Box::new(linear)),
            device: None,
        }
    }

    /// Rows already encoded in `format` (little-endian floats or quantized blocks).
    pub fn from_bytes(
        rows: usize,
        cols: usize,
        format: Format,
        bytes: impl Into<quant::Bytes>,
    ) -> Result<Matrix, MatrixError> {
        let bytes = bytes.into();
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
            data: Data::Packed(format, bytes),
            device: None,
        })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The row format; `None` for an EXL3 matrix, whose trellis no row kernel (nor the GPU,
    /// nor the expert store) reads: [`Matrix::convert`] makes rows of it.
    pub fn format(&self) -> Option<Format> {
        match &self.data {
            Data::F32(_) => Some(Format::F32),
            Data::Packed(format, _) => Some(*format),
            Data::Exl3(_) => None,
            Data::Released { format } => *format,
        }
    }

    /// The EXL3 layer, for an EXL3 matrix.
    pub fn exl3(&self) -> Option<&Exl3Linear> {
        match &self.data {
            Data::Exl3(lin) => Some(lin),
            _ => None,
        }
    }

    /// Products of this matrix run on `device` from now on.
    pub fn set_device(&mut self, device: Option<Arc<dyn DeviceWeights>>) {
        self.device = device;
    }

    /// The device copy products run on, if any.
    pub fn device(&self) -> Option<&Arc<dyn DeviceWeights>> {
        self.device.as_ref()
    }

    /// Gives the host bytes back when a device copy holds the weights (every product runs
    /// there from now on, with no CPU fallback); returns the bytes freed (0 without a device
    /// copy, or when already released).
    pub fn release_host(&mut self) -> usize {
        if self.device.is_none() {
            return 0;
        }
        let freed = self.storage_bytes();
        let format = self.format();
        self.data = Data::Released { format };
        freed
    }

    /// Whether the host bytes were given back ([`Matrix::release_host`]).
    pub fn host_released(&self) -> bool {
        matches!(self.data, Data::Released { .. })
    }

    /// Device bytes of this matrix's device copy (0 when it has none).
    pub fn device_bytes(&self) -> usize {
        self.device.as_ref().map_or(0, |d| d.bytes())
    }

    /// Start and length of the bytes the weights occupy (for pinning them in RAM).
    pub fn storage_span(&self) -> (*const u8, usize) {
        match &self.data {
            Data::F32(v) => (v.as_ptr().cast(), v.len() * 4),
            Data::Packed(_, b) => (b.as_ptr(), b.len()),
            Data::Exl3(lin) => lin.trellis_span(),
            Data::Released { .. } => (std::ptr::null(), 0),
        }
    }

    /// The bytes the weights are kept in, where they are bytes: a row format's rows or an
    /// EXL3 trellis as laid out here (`None` for f32 values and released weights).
    pub fn storage(&self) -> Option<&quant::Bytes> {
        match &self.data {
            Data::Packed(_, b) => Some(b),
            Data::Exl3(lin) => Some(lin.stream()),
            Data::F32(_) | Data::Released { .. } => None,
        }
    }

    /// This matrix with its weights kept in `bytes`: the same bytes [`Matrix::storage`]
    /// gives, in other memory (a slot of the RAM tier's pinned arena); the old buffer is not
    /// copied. Panics for a matrix without byte storage or for bytes of another length.
    pub fn with_storage(&self, bytes: quant::Bytes) -> Matrix {
        let data = match &self.data {
            Data::Packed(format, b) => {
                assert_eq!(bytes.len(), b.len(), "with_storage: other bytes");
                debug_assert!(bytes[..] == b[..], "with_storage: other bytes");
                Data::Packed(*format, bytes)
            }
            Data::Exl3(lin) => Data::Exl3(Box::new(lin.with_stream(bytes))),
            Data::F32(_) | Data::Released { .. } => panic!("with_storage: {self:?} has no bytes"),
        };
        Matrix {
            rows: self.rows,
            cols: self.cols,
            data,
            device: self.device.clone(),
        }
    }

    /// Bytes the weights occupy (an EXL3 matrix: as stored in its checkpoint).
    pub fn storage_bytes(&self) -> usize {
        match &self.data {
            Data::F32(v) => v.len() * 4,
            Data::Packed(_, b) => b.len(),
            Data::Exl3(lin) => lin.stored_bytes(),
            Data::Released { .. } => 0,
        }
    }

    /// As [`Matrix::to_bytes`], borrowing the storage where it already is those bytes (every
    /// format but f32), so a copy to the GPU reads the resident (possibly registered) pages.
    pub fn as_bytes(&self) -> Option<std::borrow::Cow<'_, [u8]>> {
        match &self.data {
            Data::F32(_) => self.to_bytes().map(std::borrow::Cow::Owned),
            Data::Packed(_, b) => Some(std::borrow::Cow::Borrowed(b)),
            Data::Exl3(_) | Data::Released { .. } => None,
        }
    }

    /// The rows encoded in [`Matrix::format`], concatenated; `None` for an EXL3 matrix.
    pub fn to_bytes(&self) -> Option<Vec<u8>> {
        match &self.data {
            Data::F32(v) => Some(v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            Data::Packed(_, b) => Some(b.to_vec()),
            Data::Exl3(_) | Data::Released { .. } => None,
        }
    }

    /// Row `r` as f32.
    pub fn row_f32(&self, r: usize) -> Vec<f32> {
        let mut out = vec![0.0; self.cols];
        self.dequantize_rows(r, r + 1, &mut out);
        out
    }

    /// Rows `ids` as f32, in order, into `out` (`ids.len() x cols`): a prompt's embedding
    /// rows. Many rows are widened on several threads (8,192 rows of 4,096 bf16 values took
    /// 57 ms on one core of the development VM).
    pub fn gather_rows_f32(&self, ids: &[usize], out: &mut [f32]) {
        let c = self.cols;
        assert_eq!(out.len(), ids.len() * c, "gather_rows_f32: output size");
        const ROWS_A_THREAD: usize = 512;
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(8)
            .min(ids.len().div_ceil(ROWS_A_THREAD))
            .max(1);
        let gather = |ids: &[usize], out: &mut [f32]| {
            for (&r, row) in ids.iter().zip(out.chunks_exact_mut(c)) {
                self.dequantize_rows(r, r + 1, row);
            }
        };
        if threads == 1 {
            return gather(ids, out);
        }
        let per = ids.len().div_ceil(threads);
        std::thread::scope(|s| {
            for (ids, out) in ids.chunks(per).zip(out.chunks_mut(per * c)) {
                s.spawn(move || gather(ids, out));
            }
        });
    }

    /// The matrix in another format (quantizing or widening every row).
    pub fn convert(&self, format: Format) -> Result<Matrix, MatrixError> {
        Matrix::from_bytes(self.rows, self.cols, format, self.encode(format)?)
    }

    /// Every row quantized or widened to `format` from its f32 values, concatenated (what
    /// [`Matrix::convert`] stores).
    pub fn encode(&self, format: Format) -> Result<Vec<u8>, MatrixError> {
        let row_bytes = format.row_bytes(self.cols)?;
        let mut bytes = vec![0u8; self.rows * row_bytes];
        // An EXL3 matrix decodes 128 outputs at a time (one Hadamard block).
        let chunk = 128;
        let mut rows = vec![0f32; chunk * self.cols];
        for r0 in (0..self.rows).step_by(chunk) {
            let r1 = (r0 + chunk).min(self.rows);
            self.dequantize_rows(r0, r1, &mut rows[..(r1 - r0) * self.cols]);
            for (r, row) in (r0..r1).zip(rows.chunks_exact(self.cols)) {
                quant::quantize_row(format, row, &mut bytes[r * row_bytes..(r + 1) * row_bytes])?;
            }
        }
        Ok(bytes)
    }

    fn dequantize_rows(&self, r0: usize, r1: usize, out: &mut [f32]) {
        let c = self.cols;
        match &self.data {
            Data::F32(v) => out[..(r1 - r0) * c].copy_from_slice(&v[r0 * c..r1 * c]),
            Data::Exl3(lin) => lin.dequantize_rows(r0, r1, &mut out[..(r1 - r0) * c]),
            Data::Released { .. } => released(self, "its rows were read on the CPU"),
            Data::Packed(format, b) => {
                let rb = format.row_bytes(c).expect("validated at construction");
                for r in r0..r1 {
                    let start = r * rb;
                    quant::dequantize_row(
                        *format,
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

    /// Whether [`Matrix::matvec_lane`] multiplies this matrix in integers: rows in a format
    /// [`quant::lane`] takes, or a mul1 EXL3 trellis (`quant::exl3`'s lane), with no device copy.
    pub fn lane_integer(&self) -> bool {
        self.device.is_none()
            && match &self.data {
                Data::Packed(format, _) => quant::lane::supported(*format, self.cols),
                Data::Exl3(lin) => lin.lane_integer(),
                Data::F32(_) | Data::Released { .. } => false,
            }
    }

    /// `W x` for one row `x` as the CPU lane of the near-exact modes computes it where
    /// [`Matrix::lane_integer`]: row formats by integer dots against `xq` (`x` as
    /// [`quant::lane::Q16Row::quantize`] rounds it; without it, as [`Matrix::matmul`]), EXL3
    /// by its own lane product; other matrices as [`Matrix::matmul`].
    pub fn matvec_lane(&self, x: &[f32], xq: Option<&quant::lane::Q16Row>) -> Vec<f32> {
        if !self.lane_integer() {
            return self.matmul(x, 1);
        }
        match (&self.data, xq) {
            (Data::Packed(format, b), Some(xq)) => {
                assert_eq!(
                    xq.len(),
                    self.cols,
                    "lane input for a {}x{} matrix",
                    self.rows,
                    self.cols
                );
                let rb = format
                    .row_bytes(self.cols)
                    .expect("validated at construction");
                b.par_chunks_exact(rb)
                    .map(|row| quant::lane::dot_q4k(row, xq))
                    .collect()
            }
            (Data::Exl3(lin), _) => {
                let mut y = vec![0f32; self.rows];
                lin.forward_lane(x, &mut y);
                y
            }
            _ => self.matmul(x, 1),
        }
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
            Data::Released { .. } => released(self, "its device product failed"),
            Data::F32(w) => gemm::gemm_xwt(x, n, w, rows, cols, y, 0),
            Data::Exl3(lin) if n <= EXL3_FUSED_MAX_TOKENS => lin.forward(x, n, y),
            Data::Exl3(lin) => exl3_by_strips(lin, x, n, y),
            Data::Packed(format, b) if n <= ROW_DOT_MAX_TOKENS => {
                let rb = format.row_bytes(cols).expect("validated at construction");
                let fmt = *format;
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
            Data::Packed(..) => {
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

/// What a CPU read of a released matrix meets (`why`: a failed device product, whose error
/// was logged, or a row read): there are no host bytes to fall back on.
#[cold]
fn released(m: &Matrix, why: &str) -> ! {
    panic!("{m:?}: {why}, but its host copy was given back at load (--vram-host-copies keeps it)")
}

/// `y = x W` of an EXL3 layer for many tokens: the input rotated once, then per strip of
/// [`EXL3_STRIP_COLUMNS`] outputs `What`'s columns decoded to f32 and multiplied by a GEMM,
/// then the output rotated.
fn exl3_by_strips(lin: &Exl3Linear, x: &[f32], n: usize, y: &mut [f32]) {
    let (k, outs) = (lin.in_features(), lin.out_features());
    let xr = lin.rotate_input(x, n);
    let strips: Vec<(usize, Vec<f32>)> = (0..outs.div_ceil(EXL3_STRIP_COLUMNS))
        .into_par_iter()
        .map(|s| {
            let c0 = s * EXL3_STRIP_COLUMNS;
            let c1 = (c0 + EXL3_STRIP_COLUMNS).min(outs);
            let mut what_t = vec![0f32; (c1 - c0) * k];
            lin.reconstruct_columns_t(c0, c1, &mut what_t);
            let mut part = vec![0f32; n * (c1 - c0)];
            gemm::gemm_xwt(&xr, n, &what_t, c1 - c0, k, &mut part, usize::MAX);
            (c0, part)
        })
        .collect();
    for (c0, part) in strips {
        let width = part.len() / n;
        for t in 0..n {
            y[t * outs + c0..t * outs + c0 + width]
                .copy_from_slice(&part[t * width..(t + 1) * width]);
        }
    }
    lin.rotate_output(y, n);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Many rows (several threads) and few (one), each format: the rows `row_f32` gives, in
    /// order, repeats included.
    #[test]
    fn gathered_rows_are_the_rows() {
        let (rows, cols) = (300, 256);
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37) % 101) as f32 - 50.0)
            .collect();
        for format in [Format::F32, Format::Bf16, Format::Q8_0, Format::Q4K] {
            let m = Matrix::from_f32(rows, cols, values.clone())
                .convert(format)
                .expect("converts");
            for count in [3usize, 2000] {
                let ids: Vec<usize> = (0..count).map(|i| (i * 7919) % rows).collect();
                let mut got = vec![f32::NAN; count * cols];
                m.gather_rows_f32(&ids, &mut got);
                let want: Vec<f32> = ids.iter().flat_map(|&r| m.row_f32(r)).collect();
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{format:?}, {count} rows"
                );
            }
        }
    }
}
