//! Integer dots for the CPU lane of the near-exact modes (`fast`, `nvme`): the activation row is
//! rounded once to 16-bit integers in blocks of 256 values ([`Q16Row`]: one f32 scale per block
//! and the sum of every 32 values), and each Q4_K weight row is multiplied by it in integers
//! (AVX2 `madd`: sixteen 16-bit products an instruction, summed in pairs; AVX-512 `vpdpwssd`:
//! thirty-two, added in the same instruction), where the f32 kernel
//! of [`super::dot_row`] widens, converts and multiplies every weight in floats. GGML's q8_K
//! does the same with 8-bit activations; 16 bits keep the lane's products within about 1e-4 of
//! the exact kernels' instead of about 1e-2. (Q8_0 rows stay on the f32 kernel: it widens
//! their bytes in one step, and the integer form measured 0.7x of it, BENCHMARKS "Session 16".)
//!
//! The integer sums are exact. Their float combination follows the AVX2 kernel's vector lanes
//! with a multiply and an add, no FMA, so the portable kernel gives the same bits. What differs
//! from the exact kernels is the activations' rounding, at most half a step of
//! `max|x| / 32767` in each block of 256 (the near-exact modes report their KL divergence
//! against `exact`).

use super::Format;
use super::float::f16_at;
use super::{q4k, sum_lanes};

/// Activation values per scale.
pub const BLOCK: usize = 256;
/// Values per partial sum (a Q4_K sub-block).
const SUM: usize = 32;
/// The largest quantized magnitude.
const QMAX: f32 = 32767.0;

/// One activation row rounded for the integer dots: `x[i] ~ scale[i / 256] * q[i]`.
#[derive(Clone, Debug, Default)]
pub struct Q16Row {
    pub(super) scales: Vec<f32>,
    pub(super) q: Vec<i16>,
    /// `sum(q[32 s .. 32 s + 32])` for every `s`.
    pub(super) sums: Vec<i32>,
}

impl Q16Row {
    /// `x` quantized; `None` when its length is not a multiple of [`BLOCK`] or a value is not
    /// finite (then the caller uses the f32 kernels).
    pub fn quantize(x: &[f32]) -> Option<Q16Row> {
        if !x.len().is_multiple_of(BLOCK) || !x.iter().all(|v| v.is_finite()) {
            return None;
        }
        let mut row = Q16Row {
            scales: Vec::with_capacity(x.len() / BLOCK),
            q: Vec::with_capacity(x.len()),
            sums: Vec::with_capacity(x.len() / SUM),
        };
        for block in x.chunks_exact(BLOCK) {
            let start = row.q.len();
            row.scales.push(round_i16(block, &mut row.q));
            for part in row.q[start..].chunks_exact(SUM) {
                row.sums.push(part.iter().map(|&q| i32::from(q)).sum());
            }
        }
        Some(row)
    }

    /// Values in the row.
    pub fn len(&self) -> usize {
        self.q.len()
    }

    pub fn is_empty(&self) -> bool {
        self.q.is_empty()
    }

    /// The values the row stands for (`scale * q`).
    pub fn dequantize(&self) -> Vec<f32> {
        self.q
            .iter()
            .enumerate()
            .map(|(i, &q)| self.scales[i / BLOCK] * f32::from(q))
            .collect()
    }
}

/// Rounds `block` to 16-bit integers at one scale, `max|v| / 32767` (returned), pushing them
/// onto `out`: the nearest integer, halves away from zero. The values must be finite.
pub(crate) fn round_i16(block: &[f32], out: &mut Vec<i16>) -> f32 {
    let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
    let inv = if amax > 0.0 { QMAX / amax } else { 0.0 };
    out.extend(block.iter().map(|v| {
        // A truncating cast after adding a half (`f32::round` is a libm call on baseline
        // x86_64); `|v| * inv` may exceed the top by an ulp.
        let t = (v.abs() * inv + 0.5).min(QMAX) as i16;
        if *v < 0.0 { -t } else { t }
    }));
    amax / QMAX
}

/// The kernel [`dot_q4k`] runs here: `avx512-vnni`, `avx2` or `portable`.
pub fn kernel_name() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    if super::cpu_features().simd_active() {
        return super::lane_x86::kernel_name();
    }
    "portable"
}

/// Whether [`dot_q4k`] takes rows of `format` with `cols` values.
pub fn supported(format: Format, cols: usize) -> bool {
    format == Format::Q4K && cols.is_multiple_of(BLOCK)
}

/// `sum_i w_i * x_i` for the Q4_K weight row `row` and the rounded activations `x`: AVX-512
/// or AVX2 where the CPU has it (and [`super::set_force_portable`] allows), else portable;
/// all give the same bits.
///
/// # Panics
/// When `row` does not hold `x.len()` values.
pub fn dot_q4k(row: &[u8], x: &Q16Row) -> f32 {
    check(row, x);
    #[cfg(target_arch = "x86_64")]
    if super::cpu_features().simd_active() {
        return super::lane_x86::dot_q4k(row, x);
    }
    portable(row, x)
}

/// The portable kernel of [`dot_q4k`], whatever the CPU supports. Same panics.
pub fn dot_q4k_portable(row: &[u8], x: &Q16Row) -> f32 {
    check(row, x);
    portable(row, x)
}

/// The AVX2 kernel of [`dot_q4k`], ignoring [`super::set_force_portable`]; `None` when the CPU
/// lacks AVX2, FMA or F16C. Same panics.
pub fn dot_q4k_simd(row: &[u8], x: &Q16Row) -> Option<f32> {
    check(row, x);
    #[cfg(target_arch = "x86_64")]
    if super::cpu_features().simd_supported() {
        return Some(super::lane_x86::dot_q4k_avx2(row, x));
    }
    None
}

/// The AVX-512 (BW + VNNI) kernel of [`dot_q4k`], which it takes where the CPU has it;
/// `None` when the CPU lacks it (or AVX2, FMA, F16C). Same panics.
pub fn dot_q4k_wide(row: &[u8], x: &Q16Row) -> Option<f32> {
    check(row, x);
    #[cfg(target_arch = "x86_64")]
    if super::cpu_features().simd_supported() {
        return super::lane_x86::dot_q4k_wide(row, x);
    }
    None
}

fn portable(row: &[u8], x: &Q16Row) -> f32 {
    let mut acc = [0f32; 8];
    for (b, blk) in row.chunks_exact(q4k::BLOCK_BYTES).enumerate() {
        let (sc, m) = q4k::unpack_scales(&blk[4..16]);
        let xq = &x.q[BLOCK * b..BLOCK * (b + 1)];
        let mut lanes = [0i32; 8];
        for c in 0..4 {
            let bytes = &blk[16 + 32 * c..16 + 32 * c + 32];
            for (l, lane) in lanes.iter_mut().enumerate() {
                for i in lane_values(l) {
                    *lane += i32::from(sc[2 * c])
                        * i32::from(bytes[i] & 0x0F)
                        * i32::from(xq[64 * c + i])
                        + i32::from(sc[2 * c + 1])
                            * i32::from(bytes[i] >> 4)
                            * i32::from(xq[64 * c + 32 + i]);
                }
            }
        }
        let mins = std::array::from_fn(|j| i32::from(m[j]) * x.sums[8 * b + j]);
        q4k_accumulate(&mut acc, blk, &lanes, &mins, x.scales[b]);
    }
    sum_lanes(acc)
}

/// Which of 32 consecutive values vector lane `l` sums: `madd` pairs values `2l, 2l + 1` of the
/// first 16 (widened to 16 bits) and of the second 16.
fn lane_values(l: usize) -> [usize; 4] {
    [2 * l, 2 * l + 1, 16 + 2 * l, 17 + 2 * l]
}

/// Adds Q4_K block `blk`'s share to the lanes: `lanes[l]` its scaled integer sums over lane
/// `l`'s bytes, `mins[j]` sub-block `j`'s min times the activations' sum over it.
#[inline]
fn q4k_accumulate(acc: &mut [f32; 8], blk: &[u8], lanes: &[i32; 8], mins: &[i32; 8], scale: f32) {
    let (d, dmin) = q4k_scales(blk, scale);
    for ((a, &s), &m) in acc.iter_mut().zip(lanes).zip(mins) {
        *a += s as f32 * d - m as f32 * dmin;
    }
}

/// Q4_K block `blk`'s `d` and `dmin` times the activations' scale.
#[inline]
fn q4k_scales(blk: &[u8], scale: f32) -> (f32, f32) {
    (f16_at(&blk[0..2]) * scale, f16_at(&blk[2..4]) * scale)
}

fn check(row: &[u8], x: &Q16Row) {
    if let Err(e) = super::check_bytes(Format::Q4K, "row", x.len(), row.len()) {
        panic!("dot_q4k: {e}");
    }
}

#[cfg(test)]
#[path = "lane_tests.rs"]
mod tests;
