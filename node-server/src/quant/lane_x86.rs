//! The AVX2 and AVX-512 kernels of [`super::lane`]: a Q4_K row's nibbles widened to 16 bits and
//! times their sub-block's 6-bit scale, `madd` (or `vpdpwssd`) against the 16-bit activations
//! into eight i32 lanes (sixteen, folded to eight), and the lanes combined in f32 as the portable
//! kernel combines them.
//!
//! `unsafe` is allowed here for loads from fixed-size array references and for calling the
//! `#[target_feature]` kernels once the caller has checked the CPU.
#![allow(unsafe_code)]

use std::arch::x86_64::*;

use super::lane::{BLOCK, Q16Row};
use super::simd_x86::{arr, to_array};
use super::{q4k, sum_lanes};

/// [`super::lane::dot_q4k`] on the widest kernel the CPU has (AVX-512 BW + VNNI, else AVX2;
/// the same bits); the caller has checked the shape and that the CPU has AVX2, FMA and F16C.
pub(super) fn dot_q4k(row: &[u8], x: &Q16Row) -> f32 {
    debug_assert!(super::cpu_features().simd_supported());
    if wide() {
        // SAFETY: `wide` reported avx512f, avx512bw and avx512vnni, the caller avx2, fma, f16c.
        return unsafe { q4k_kernel_wide(row, x) };
    }
    dot_q4k_avx2(row, x)
}

/// The AVX2 kernel alone; the caller has checked the shape and the CPU.
pub(super) fn dot_q4k_avx2(row: &[u8], x: &Q16Row) -> f32 {
    debug_assert!(super::cpu_features().simd_supported());
    // SAFETY: the callers get here only after runtime detection reported avx2, fma and f16c.
    unsafe { q4k_kernel(row, x) }
}

/// The AVX-512 kernel alone, `None` where the CPU lacks it; the caller has checked the shape
/// and that the CPU has AVX2, FMA and F16C.
pub(super) fn dot_q4k_wide(row: &[u8], x: &Q16Row) -> Option<f32> {
    // SAFETY: as in `dot_q4k`.
    wide().then(|| unsafe { q4k_kernel_wide(row, x) })
}

/// The kernel [`dot_q4k`] takes on this CPU.
pub(super) fn kernel_name() -> &'static str {
    if wide() { "avx512-vnni" } else { "avx2" }
}

/// Whether the CPU has the AVX-512 kernel's features (F, BW and VNNI).
fn wide() -> bool {
    static WIDE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WIDE.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vnni")
    })
}

/// Rows ahead the kernels prefetch. A matrix's rows follow each other, but the hardware's
/// stream prefetchers do not carry a stream across a 4 KiB page, and a row (2,304 bytes at
/// 4,096 values) crosses one every second row: without this the lane ran at about half the
/// speed (BENCHMARKS "Session 23"; one and two rows ahead measured alike, two leaves more
/// room for the latency of a loaded memory system).
const PREFETCH_ROWS: usize = 2;

/// Prefetches block `blk`'s bytes `ahead` bytes on. Prefetches never fault: past the
/// matrix's end they only waste a slot.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn prefetch_block(blk: &[u8; q4k::BLOCK_BYTES], ahead: usize) {
    let p = blk.as_ptr().wrapping_add(ahead).cast::<i8>();
    _mm_prefetch::<_MM_HINT_T0>(p);
    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(64));
    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(128));
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
    let ahead = PREFETCH_ROWS * row.len();
    for (b, blk) in row.chunks_exact(q4k::BLOCK_BYTES).enumerate() {
        let blk: &[u8; q4k::BLOCK_BYTES] = arr(blk);
        prefetch_block(blk, ahead);
        let xq = &x.q[BLOCK * b..BLOCK * (b + 1)];
        let (sc, m) = scales_and_mins(blk);
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
        acc = _mm256_add_ps(acc, combine(blk, sum, m, x, b));
    }
    sum_lanes(to_array(acc))
}

/// Block `blk`'s eight 6-bit scales and eight mins, a byte each, sub-block k in byte k (as
/// `q4k::unpack_scales`, from the three u32 words that hold them).
#[inline]
fn scales_and_mins(blk: &[u8; q4k::BLOCK_BYTES]) -> (u64, u64) {
    let word = |i: usize| u32::from_le_bytes([blk[i], blk[i + 1], blk[i + 2], blk[i + 3]]);
    let (s0, s1, s2) = (word(4), word(8), word(12));
    let sc_hi = (s2 & 0x0f0f_0f0f) | (((s0 >> 6) & 0x0303_0303) << 4);
    let m_hi = ((s2 >> 4) & 0x0f0f_0f0f) | (((s1 >> 6) & 0x0303_0303) << 4);
    (
        (u64::from(sc_hi) << 32) | u64::from(s0 & 0x3f3f_3f3f),
        (u64::from(m_hi) << 32) | u64::from(s1 & 0x3f3f_3f3f),
    )
}

/// Block `b`'s share in f32 per lane from its integer lane sums `sum` and mins `m`: the
/// multiplies, subtraction and add of the portable kernel; `d` and `dmin` widened by F16C
/// (exact, as the portable kernel's conversion, and far cheaper).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn combine(blk: &[u8; q4k::BLOCK_BYTES], sum: __m256i, m: u64, x: &Q16Row, b: usize) -> __m256 {
    let mins = _mm256_mullo_epi32(
        _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(m as i64)),
        load(arr::<8, i32>(&x.sums[8 * b..8 * b + 8])),
    );
    let dd = _mm_cvtph_ps(_mm_cvtsi32_si128(
        u32::from_le_bytes([blk[0], blk[1], blk[2], blk[3]]) as i32,
    ));
    let (d, dmin) = (
        _mm_cvtss_f32(dd) * x.scales[b],
        _mm_cvtss_f32(_mm_movehdup_ps(dd)) * x.scales[b],
    );
    let t = _mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(d));
    let u = _mm256_mul_ps(_mm256_cvtepi32_ps(mins), _mm256_set1_ps(dmin));
    _mm256_sub_ps(t, u)
}

/// [`q4k_kernel`] on 512-bit vectors: a 64-value chunk's low and high nibbles widened to 32
/// 16-bit values each, times the sub-block's scale, and `vpdpwssd` against the activations
/// into 16 i32 lanes. Folding lane j + 8 onto lane j gives each of the eight lanes the values
/// [`q4k_kernel`]'s lane sums (2j, 2j + 1, 16 + 2j, 17 + 2j of every 32), and integer sums do
/// not depend on their order, so the float combination that follows sees the same integers.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
fn q4k_kernel_wide(row: &[u8], x: &Q16Row) -> f32 {
    let low = _mm256_set1_epi8(0x0F);
    let mut acc = _mm256_setzero_ps();
    let ahead = PREFETCH_ROWS * row.len();
    for (b, blk) in row.chunks_exact(q4k::BLOCK_BYTES).enumerate() {
        let blk: &[u8; q4k::BLOCK_BYTES] = arr(blk);
        prefetch_block(blk, ahead);
        let xq: &[i16; BLOCK] = arr(&x.q[BLOCK * b..BLOCK * (b + 1)]);
        let (sc, m) = scales_and_mins(blk);
        let mut sum = _mm512_setzero_si512();
        for c in 0..4 {
            let w = load(arr::<32, u8>(&blk[16 + 32 * c..48 + 32 * c]));
            let lo = _mm512_cvtepu8_epi16(_mm256_and_si256(w, low));
            let hi = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16::<4>(w), low));
            let slo = _mm512_set1_epi16(((sc >> (16 * c)) & 0xff) as i16);
            let shi = _mm512_set1_epi16(((sc >> (16 * c + 8)) & 0xff) as i16);
            // SAFETY: 32 values (64 bytes) from 64 c and from 64 c + 32 lie inside the block's
            // 256; loadu has no alignment requirement.
            let (xlo, xhi) = unsafe {
                (
                    _mm512_loadu_si512(xq[64 * c..].as_ptr().cast()),
                    _mm512_loadu_si512(xq[64 * c + 32..].as_ptr().cast()),
                )
            };
            sum = _mm512_dpwssd_epi32(sum, _mm512_mullo_epi16(lo, slo), xlo);
            sum = _mm512_dpwssd_epi32(sum, _mm512_mullo_epi16(hi, shi), xhi);
        }
        let sum = _mm256_add_epi32(
            _mm512_castsi512_si256(sum),
            _mm512_extracti64x4_epi64::<1>(sum),
        );
        acc = _mm256_add_ps(acc, combine(blk, sum, m, x, b));
    }
    sum_lanes(to_array(acc))
}
