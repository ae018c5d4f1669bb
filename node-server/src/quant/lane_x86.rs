//! The AVX2 kernel of [`super::lane`]: a Q4_K row's nibbles widened to 16 bits and times their
//! sub-block's 6-bit scale, `madd` against the 16-bit activations into eight i32 lanes, and the
//! lanes combined in f32 as the portable kernel combines them.
//!
//! `unsafe` is allowed here for loads from fixed-size array references and for calling the
//! `#[target_feature]` kernels once the caller has checked the CPU.
#![allow(unsafe_code)]

use std::arch::x86_64::*;

use super::lane::{BLOCK, Q16Row};
use super::simd_x86::{arr, to_array};
use super::{q4k, sum_lanes};

/// [`super::lane::dot_q4k`] on AVX2; the caller has checked the shape and the CPU.
pub(super) fn dot_q4k(row: &[u8], x: &Q16Row) -> f32 {
    debug_assert!(super::cpu_features().simd_supported());
    // SAFETY: the callers get here only after runtime detection reported avx2, fma and f16c.
    unsafe { q4k_kernel(row, x) }
}

/// 32 bytes of `v` (`N` values of `T`) into a vector.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn load<T, const N: usize>(v: &[T; N]) -> __m256i {
    const { assert!(N * std::mem::size_of::<T>() == 32) };
    // SAFETY: `v` is 32 readable bytes (asserted above); loadu has no alignment requirement.
    unsafe { _mm256_loadu_si256(v.as_ptr().cast()) }
}

/// Shuffle masks spreading 16-bit word `j` of each 128-bit half over the half.
const fn word_splat(j: u8) -> [u8; 32] {
    let mut m = [0u8; 32];
    let mut i = 0;
    while i < 32 {
        m[i] = 2 * j + (i % 2) as u8;
        i += 1;
    }
    m
}

const SPLAT: [[u8; 32]; 8] = [
    word_splat(0),
    word_splat(1),
    word_splat(2),
    word_splat(3),
    word_splat(4),
    word_splat(5),
    word_splat(6),
    word_splat(7),
];

/// `madd` of 32 weights (two vectors of 16, already 16-bit) against activations `x`, added
/// to `sum`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn madd32(sum: __m256i, w: [__m256i; 2], x: &[i16]) -> __m256i {
    let a = _mm256_madd_epi16(w[0], load(arr::<16, i16>(&x[..16])));
    let b = _mm256_madd_epi16(w[1], load(arr::<16, i16>(&x[16..32])));
    _mm256_add_epi32(sum, _mm256_add_epi32(a, b))
}

/// The 32 bytes of `v` widened to two vectors of 16-bit values.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn widen(v: __m256i) -> [__m256i; 2] {
    let (lo, hi) = (_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    [_mm256_cvtepu8_epi16(lo), _mm256_cvtepu8_epi16(hi)]
}

/// Q4_K: per 64-value chunk `c`, the low nibbles (sub-block `2c`) and the high ones (`2c+1`),
/// each times its sub-block's 6-bit scale (at most 945: still 16-bit), against the activations;
/// the mins against the activations' per-32 sums.
#[target_feature(enable = "avx2,fma,f16c")]
fn q4k_kernel(row: &[u8], x: &Q16Row) -> f32 {
    let low = _mm256_set1_epi8(0x0F);
    let mut acc = _mm256_setzero_ps();
    for (b, blk) in row.chunks_exact(q4k::BLOCK_BYTES).enumerate() {
        let blk: &[u8; q4k::BLOCK_BYTES] = arr(blk);
        let xq = &x.q[BLOCK * b..BLOCK * (b + 1)];
        // The eight 6-bit scales and mins, four to a u32 word (as `q4k::unpack_scales`).
        let word = |i: usize| u32::from_le_bytes([blk[i], blk[i + 1], blk[i + 2], blk[i + 3]]);
        let (s0, s1, s2) = (word(4), word(8), word(12));
        let sc_hi = (s2 & 0x0f0f_0f0f) | (((s0 >> 6) & 0x0303_0303) << 4);
        let m_hi = ((s2 >> 4) & 0x0f0f_0f0f) | (((s1 >> 6) & 0x0303_0303) << 4);
        let sc = (u64::from(sc_hi) << 32) | u64::from(s0 & 0x3f3f_3f3f);
        let m = (u64::from(m_hi) << 32) | u64::from(s1 & 0x3f3f_3f3f);
        let scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
        let mut sum = _mm256_setzero_si256();
        for c in 0..4 {
            let w = load(arr::<32, u8>(&blk[16 + 32 * c..48 + 32 * c]));
            let slo = _mm256_shuffle_epi8(scales, load(&SPLAT[2 * c]));
            let shi = _mm256_shuffle_epi8(scales, load(&SPLAT[2 * c + 1]));
            let [a, b] = widen(_mm256_and_si256(w, low));
            let lo = [_mm256_mullo_epi16(a, slo), _mm256_mullo_epi16(b, slo)];
            let [a, b] = widen(_mm256_and_si256(_mm256_srli_epi16::<4>(w), low));
            let hi = [_mm256_mullo_epi16(a, shi), _mm256_mullo_epi16(b, shi)];
            sum = madd32(sum, lo, &xq[64 * c..64 * c + 32]);
            sum = madd32(sum, hi, &xq[64 * c + 32..64 * c + 64]);
        }
        let mins = _mm256_mullo_epi32(
            _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(m as i64)),
            load(arr::<8, i32>(&x.sums[8 * b..8 * b + 8])),
        );
        // The multiplies, subtraction and add of the portable kernel, per lane; `d` and `dmin`
        // widened by F16C (exact, as the portable kernel's conversion, and far cheaper).
        let dd = _mm_cvtph_ps(_mm_cvtsi32_si128(word(0) as i32));
        let (d, dmin) = (
            _mm_cvtss_f32(dd) * x.scales[b],
            _mm_cvtss_f32(_mm_movehdup_ps(dd)) * x.scales[b],
        );
        let t = _mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(d));
        let u = _mm256_mul_ps(_mm256_cvtepi32_ps(mins), _mm256_set1_ps(dmin));
        acc = _mm256_add_ps(acc, _mm256_sub_ps(t, u));
    }
    sum_lanes(to_array(acc))
}
