//! Weight row formats: plain floats (f32/f16/bf16) and GGML-compatible block
//! quantization (Q8_0, Q4_K); and, apart from the row formats, EXL3 trellis-coded linear
//! layers ([`exl3`]), which are decoded and multiplied as whole matrices.
//!
//! Every format is stored as little-endian bytes with exactly GGML's block
//! layout, so GGUF tensors can be used as-is and independent decoders (the
//! Python `gguf` package, see `e2e/quant_reference.py`) can check us.
//!
//! * [`quantize_row`] / [`dequantize_row`] convert one row between `f32` and
//!   bytes.
//! * [`dot_row`] computes `sum_i w_i * x_i` straight from the bytes. It uses
//!   AVX2+FMA+F16C kernels when the CPU has them (detected once) and a portable
//!   kernel otherwise. The activation `x` stays `f32` on both paths, so they
//!   agree up to floating-point summation order.
//! * [`lane`]: the CPU lane's integer dots (near-exact modes): activations rounded to 16-bit
//!   integers per 256 values, Q4_K rows multiplied in integers.
//! * [`set_force_portable`] or `GLMFLASH_FORCE_PORTABLE=1` (read once) disable
//!   the SIMD path, e.g. to compare both paths in tests and benchmarks.

pub mod bytes;
pub mod exl3;
mod float;
pub mod lane;
#[cfg(target_arch = "x86_64")]
mod lane_x86;
mod q4k;
mod q8_0;
#[cfg(target_arch = "x86_64")]
mod simd_x86;

pub use bytes::{Backing, Bytes};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, Ordering};

/// Storage format of a weight row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    F32,
    F16,
    Bf16,
    Q8_0,
    Q4K,
}

impl Format {
    /// All formats, in a fixed order.
    pub const ALL: [Format; 5] = [
        Format::F32,
        Format::F16,
        Format::Bf16,
        Format::Q8_0,
        Format::Q4K,
    ];

    /// Number of values per block: 1 for floats, 32 for Q8_0, 256 for Q4_K.
    pub fn block_values(self) -> usize {
        match self {
            Format::F32 | Format::F16 | Format::Bf16 => 1,
            Format::Q8_0 => q8_0::BLOCK_VALUES,
            Format::Q4K => q4k::BLOCK_VALUES,
        }
    }

    /// Number of bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Format::F32 => 4,
            Format::F16 | Format::Bf16 => 2,
            Format::Q8_0 => q8_0::BLOCK_BYTES,
            Format::Q4K => q4k::BLOCK_BYTES,
        }
    }

    /// Bytes needed for a row of `cols` values; `cols` must be a multiple of
    /// [`Format::block_values`].
    pub fn row_bytes(self, cols: usize) -> Result<usize, QuantError> {
        let block = self.block_values();
        if !cols.is_multiple_of(block) {
            return Err(QuantError::NotBlockMultiple {
                format: self,
                cols,
                block,
            });
        }
        (cols / block)
            .checked_mul(self.block_bytes())
            .ok_or(QuantError::Overflow { format: self, cols })
    }

    /// Lower-case GGML-style name: "f32", "f16", "bf16", "q8_0", "q4_k".
    pub fn name(self) -> &'static str {
        match self {
            Format::F32 => "f32",
            Format::F16 => "f16",
            Format::Bf16 => "bf16",
            Format::Q8_0 => "q8_0",
            Format::Q4K => "q4_k",
        }
    }

    /// Inverse of [`Format::name`] (case-insensitive).
    pub fn from_name(s: &str) -> Result<Format, QuantError> {
        Format::ALL
            .into_iter()
            .find(|f| f.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| QuantError::UnknownFormat { name: s.to_owned() })
    }
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Errors of the quantization API.
#[derive(Debug, thiserror::Error)]
pub enum QuantError {
    #[error("unknown weight format {name:?} (expected one of f32, f16, bf16, q8_0, q4_k)")]
    UnknownFormat { name: String },
    #[error("{format}: {cols} values is not a multiple of the block size {block}")]
    NotBlockMultiple {
        format: Format,
        cols: usize,
        block: usize,
    },
    #[error("{format}: row of {cols} values overflows usize bytes")]
    Overflow { format: Format, cols: usize },
    #[error("{format}: {what} has {got} bytes but {values} values need {expected} bytes")]
    ByteLength {
        format: Format,
        what: &'static str,
        values: usize,
        expected: usize,
        got: usize,
    },
    #[error("{format}: cannot quantize non-finite value {value} at index {index}")]
    NonFinite {
        format: Format,
        index: usize,
        value: f32,
    },
}

/// Encodes `src` into `dst`, which must be exactly `format.row_bytes(src.len())`
/// bytes. Floats are written little-endian (f16/bf16 rounded to nearest even);
/// Q8_0 and Q4_K use GGML's block layout. Quantized formats reject NaN/inf.
pub fn quantize_row(format: Format, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    check_bytes(format, "destination", src.len(), dst.len())?;
    if matches!(format, Format::Q8_0 | Format::Q4K)
        && let Some(index) = src.iter().position(|v| !v.is_finite())
    {
        return Err(QuantError::NonFinite {
            format,
            index,
            value: src[index],
        });
    }
    match format {
        Format::F32 => float::encode_f32(src, dst),
        Format::F16 => float::encode_f16(src, dst),
        Format::Bf16 => float::encode_bf16(src, dst),
        Format::Q8_0 => q8_0::quantize(src, dst),
        Format::Q4K => q4k::quantize(src, dst),
    }
    Ok(())
}

/// Decodes `src` (exactly `format.row_bytes(dst.len())` bytes) into `dst`.
///
/// Results are bit-identical to GGML / `gguf.quants.dequantize`: Q8_0 is
/// `d * q`, Q4_K is `(d * sc) * q - (dmin * m)` in f32. All products there
/// are exact (an f16 mantissa times 6- and 4-bit integers fits in 24 bits), so
/// the only rounding is the final subtraction and the result is unambiguous.
pub fn dequantize_row(format: Format, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    check_bytes(format, "source", dst.len(), src.len())?;
    match format {
        Format::F32 => float::decode_f32(src, dst),
        Format::F16 => float::decode_f16(src, dst),
        Format::Bf16 => float::decode_bf16(src, dst),
        Format::Q8_0 => q8_0::dequantize(src, dst),
        Format::Q4K => q4k::dequantize(src, dst),
    }
    Ok(())
}

fn check_bytes(
    format: Format,
    what: &'static str,
    values: usize,
    got: usize,
) -> Result<(), QuantError> {
    let expected = format.row_bytes(values)?;
    if got != expected {
        return Err(QuantError::ByteLength {
            format,
            what,
            values,
            expected,
            got,
        });
    }
    Ok(())
}

/// Panics with a descriptive message when `row` does not hold `x.len()` values.
fn assert_dot_shape(format: Format, row: &[u8], x: &[f32]) {
    if let Err(e) = check_bytes(format, "row", x.len(), row.len()) {
        panic!("dot_row: {e}");
    }
}

/// `sum_i w_i * x_i` where `w` is the dequantized `row` (bytes in `format`).
///
/// Uses the AVX2+FMA+F16C kernels when available and not disabled (see
/// [`cpu_features`]), else the portable kernel.
///
/// # Panics
/// When `row.len() != format.row_bytes(x.len())` (including `x.len()` not a
/// multiple of the block size).
pub fn dot_row(format: Format, row: &[u8], x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if cpu_features().simd_active() {
        assert_dot_shape(format, row, x);
        return simd_x86::dot(format, row, x);
    }
    dot_row_portable(format, row, x)
}

/// The portable (scalar / auto-vectorised) kernel of [`dot_row`], whatever the
/// CPU supports. Same panics as [`dot_row`].
pub fn dot_row_portable(format: Format, row: &[u8], x: &[f32]) -> f32 {
    assert_dot_shape(format, row, x);
    match format {
        Format::F32 => float::dot_f32(row, x),
        Format::F16 => float::dot_f16(row, x),
        Format::Bf16 => float::dot_bf16(row, x),
        Format::Q8_0 => q8_0::dot(row, x),
        Format::Q4K => q4k::dot(row, x),
    }
}

/// The SIMD kernel of [`dot_row`], ignoring [`set_force_portable`]; `None` when
/// the CPU lacks AVX2, FMA or F16C (or on non-x86_64 targets). Same panics as
/// [`dot_row`].
pub fn dot_row_simd(format: Format, row: &[u8], x: &[f32]) -> Option<f32> {
    #[cfg(target_arch = "x86_64")]
    if cpu_features().simd_supported() {
        assert_dot_shape(format, row, x);
        return Some(simd_x86::dot(format, row, x));
    }
    let _ = (format, row, x);
    None
}

/// CPU features relevant to the dot kernels, detected once per process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuFeatures {
    pub avx2: bool,
    pub fma: bool,
    pub f16c: bool,
}

impl CpuFeatures {
    /// The CPU can run the SIMD kernels (needs all of AVX2, FMA and F16C).
    pub fn simd_supported(self) -> bool {
        self.avx2 && self.fma && self.f16c
    }

    /// [`dot_row`] currently uses the SIMD kernels: supported and not forced
    /// portable by [`set_force_portable`] or `GLMFLASH_FORCE_PORTABLE=1`.
    pub fn simd_active(self) -> bool {
        self.simd_supported() && !force_portable()
    }
}

/// Detected CPU features (cached in a `OnceLock`).
pub fn cpu_features() -> CpuFeatures {
    static FEATURES: OnceLock<CpuFeatures> = OnceLock::new();
    *FEATURES.get_or_init(detect_features)
}

#[cfg(target_arch = "x86_64")]
fn detect_features() -> CpuFeatures {
    CpuFeatures {
        avx2: std::arch::is_x86_feature_detected!("avx2"),
        fma: std::arch::is_x86_feature_detected!("fma"),
        f16c: std::arch::is_x86_feature_detected!("f16c"),
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect_features() -> CpuFeatures {
    CpuFeatures {
        avx2: false,
        fma: false,
        f16c: false,
    }
}

/// 0: follow `GLMFLASH_FORCE_PORTABLE`; 1: forced portable; 2: SIMD allowed.
static FORCE_OVERRIDE: AtomicU8 = AtomicU8::new(0);

/// Forces [`dot_row`] onto the portable kernel (`true`) or lets it use SIMD
/// again (`false`), overriding `GLMFLASH_FORCE_PORTABLE`. Process-wide.
pub fn set_force_portable(force: bool) {
    FORCE_OVERRIDE.store(if force { 1 } else { 2 }, Ordering::Relaxed);
}

fn force_portable() -> bool {
    match FORCE_OVERRIDE.load(Ordering::Relaxed) {
        1 => true,
        2 => false,
        _ => env_force_portable(),
    }
}

fn env_force_portable() -> bool {
    static ENV: OnceLock<bool> = OnceLock::new();
    *ENV.get_or_init(|| {
        std::env::var("GLMFLASH_FORCE_PORTABLE")
            .map(|v| {
                let v = v.trim();
                !(v.is_empty() || v == "0" || v.eq_ignore_ascii_case("false"))
            })
            .unwrap_or(false)
    })
}

/// Sum of eight lanes, pairwise (the same order the portable kernels use).
#[inline]
fn sum_lanes(a: [f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]))
}

#[cfg(test)]
mod tests;
