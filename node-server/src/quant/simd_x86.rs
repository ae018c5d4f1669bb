//! AVX2 + FMA + F16C dot-product kernels.
//!
//! `unsafe` is allowed here (and only here in the quant module) because SIMD
//! loads through raw pointers and calling `#[target_feature]` functions from
//! code compiled without those features cannot be expressed in safe Rust.
//! Each unsafe block is a single load from a fixed-size array reference, or
//! the one dispatch call guarded by runtime CPU detection.
//!
//! The activation `x` stays f32 (no activation quantization). Weights are
//! dequantized in registers with the same per-block scales as the portable
//! path and the same factorisation (Q8_0: `d * sum q*x`; Q4_K:
//! `ds * sum q*x - dm * sum x` per sub-block), so the two paths differ only in
//! summation order / FMA rounding.
#![allow(unsafe_code)]

use std::arch::x86_64::*;

use super::{Format, q4k, q8_0};

/// Dispatches to the kernel for `format`. The caller has checked the shape
/// (`row.len() == format.row_bytes(x.len())`) and that the CPU has AVX2, FMA
/// and F16C (`CpuFeatures::simd_supported`).
pub(super) fn dot(format: Format, row: &[u8], x: &[f32]) -> f32 {
    debug_assert!(super::cpu_features().simd_supported());
    // SAFETY: the callers (`dot_row`, `dot_row_simd`) only get here after
    // runtime detection reported avx2, fma and f16c on this CPU.
    unsafe {
        match format {
            Format::F32 => dot_f32(row, x),
            Format::F16 => dot_f16(row, x),
            Format::Bf16 => dot_bf16(row, x),
            Format::Q8_0 => dot_q8_0(row, x),
            Format::Q4K => dot_q4k(row, x),
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn load_ps(v: &[f32; 8]) -> __m256 {
    // SAFETY: `v` is 32 readable bytes; loadu has no alignment requirement.
    unsafe { _mm256_loadu_ps(v.as_ptr()) }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn load_ps_bytes(v: &[u8; 32]) -> __m256 {
    // SAFETY: `v` is 32 readable bytes; loadu has no alignment requirement.
    unsafe { _mm256_loadu_ps(v.as_ptr().cast::<f32>()) }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn load_128(v: &[u8; 16]) -> __m128i {
    // SAFETY: `v` is 16 readable bytes; loadu has no alignment requirement.
    unsafe { _mm_loadu_si128(v.as_ptr().cast::<__m128i>()) }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn load_64(v: &[u8; 8]) -> __m128i {
    // Reading through an integer avoids a raw-pointer load altogether.
    _mm_cvtsi64_si128(i64::from_le_bytes(*v))
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Decodes the f16 at `b[0..2]` with F16C.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn f16_scalar(b: &[u8]) -> f32 {
    let bits = i32::from(u16::from_le_bytes([b[0], b[1]]));
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)))
}

pub(super) fn arr<const N: usize, T>(s: &[T]) -> &[T; N] {
    s.try_into().expect("slice length checked by caller")
}

/// How far ahead the row kernels prefetch: matrices' rows follow each other, and the hardware's
/// stream prefetchers stop at every 4 KiB page (see the lane's `PREFETCH_ROWS`). Prefetches
/// never fault; past a matrix's end they only waste a slot.
const PREFETCH_BYTES: usize = 4096;

/// Shared loop for float rows: `width` bytes per value, `load8` widens 8
/// values to f32 lanes; the tail (< 32 values) is done by the portable code.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn dot_float<const W: usize>(
    row: &[u8],
    x: &[f32],
    load8: impl Fn(&[u8]) -> __m256,
    tail: fn(&[u8], &[f32]) -> f32,
) -> f32 {
    let mut acc = [_mm256_setzero_ps(); 4];
    let full = x.len() / 32 * 32;
    for (rb, xb) in row.chunks_exact(32 * W).zip(x[..full].chunks_exact(32)) {
        for line in (0..32 * W).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(rb.as_ptr().wrapping_add(PREFETCH_BYTES + line).cast());
        }
        for k in 0..4 {
            let w = load8(&rb[8 * W * k..8 * W * (k + 1)]);
            let xv = load_ps(arr(&xb[8 * k..8 * k + 8]));
            acc[k] = _mm256_fmadd_ps(w, xv, acc[k]);
        }
    }
    let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    hsum(sum) + tail(&row[full * W..], &x[full..])
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_f32(row: &[u8], x: &[f32]) -> f32 {
    dot_float::<4>(row, x, |b| load_ps_bytes(arr(b)), super::float::dot_f32)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_f16(row: &[u8], x: &[f32]) -> f32 {
    dot_float::<2>(
        row,
        x,
        |b| _mm256_cvtph_ps(load_128(arr(b))),
        super::float::dot_f16,
    )
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_bf16(row: &[u8], x: &[f32]) -> f32 {
    dot_float::<2>(
        row,
        x,
        |b| {
            let wide = _mm256_cvtepu16_epi32(load_128(arr(b)));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wide))
        },
        super::float::dot_bf16,
    )
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q8_0(row: &[u8], x: &[f32]) -> f32 {
    let mut tot = [_mm256_setzero_ps(); 2];
    for (i, (blk, xs)) in row
        .chunks_exact(q8_0::BLOCK_BYTES)
        .zip(x.chunks_exact(q8_0::BLOCK_VALUES))
        .enumerate()
    {
        let blk: &[u8; q8_0::BLOCK_BYTES] = arr(blk);
        _mm_prefetch::<_MM_HINT_T0>(blk.as_ptr().wrapping_add(PREFETCH_BYTES).cast());
        let xs: &[f32; q8_0::BLOCK_VALUES] = arr(xs);
        let d = _mm256_set1_ps(f16_scalar(&blk[..2]));
        let mut part = [_mm256_setzero_ps(); 2];
        for g in 0..4 {
            let q = _mm256_cvtepi8_epi32(load_64(arr(&blk[2 + 8 * g..10 + 8 * g])));
            let xv = load_ps(arr(&xs[8 * g..8 * g + 8]));
            part[g & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), xv, part[g & 1]);
        }
        tot[i & 1] = _mm256_fmadd_ps(d, _mm256_add_ps(part[0], part[1]), tot[i & 1]);
    }
    hsum(_mm256_add_ps(tot[0], tot[1]))
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn to_array(v: __m256) -> [f32; 8] {
    let mut out = [0.0f32; 8];
    // SAFETY: `out` is 32 writable bytes; storeu has no alignment requirement.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), v) };
    out
}

/// Q4_K per-sub-block `d * sc[j]` and `dmin * m[j]` (same values as
/// `q4k::sub_scales`), unpacking the 6-bit fields four at a time in u32 words
/// (byte lane `j` of each word is sub-block `j` / `j + 4`) and scaling all
/// eight with one vector multiply.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn q4k_scales(blk: &[u8; q4k::BLOCK_BYTES]) -> ([f32; 8], [f32; 8]) {
    let word = |i: usize| u32::from_le_bytes([blk[i], blk[i + 1], blk[i + 2], blk[i + 3]]);
    let (s0, s1, s2) = (word(4), word(8), word(12));
    let sc_lo = s0 & 0x3f3f_3f3f;
    let m_lo = s1 & 0x3f3f_3f3f;
    let sc_hi = (s2 & 0x0f0f_0f0f) | (((s0 >> 6) & 0x0303_0303) << 4);
    let m_hi = ((s2 >> 4) & 0x0f0f_0f0f) | (((s1 >> 6) & 0x0303_0303) << 4);
    let widen = |lo: u32, hi: u32| {
        let bytes = (u64::from(hi) << 32) | u64::from(lo);
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes as i64)))
    };
    // Lanes 0 and 1: d and dmin.
    let dd = _mm_cvtph_ps(_mm_cvtsi32_si128(word(0) as i32));
    let d = _mm256_broadcastss_ps(dd);
    let dmin = _mm256_broadcastss_ps(_mm_movehdup_ps(dd));
    (
        to_array(_mm256_mul_ps(d, widen(sc_lo, sc_hi))),
        to_array(_mm256_mul_ps(dmin, widen(m_lo, m_hi))),
    )
}

/// Q4_K: per sub-block `sum_i (ds*q_i - dm)*x_i` is evaluated as
/// `ds * sum_i q_i*x_i - dm * sum_i x_i`, i.e. one FMA plus one add per eight
/// values instead of two FMAs (adds run on more ports than FMAs on recent
/// Intel cores), then two FMAs per 32-value sub-block.
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q4k(row: &[u8], x: &[f32]) -> f32 {
    let mask = _mm256_set1_epi32(0x0F);
    let mut acc = [_mm256_setzero_ps(); 2];
    for (blk, xs) in row
        .chunks_exact(q4k::BLOCK_BYTES)
        .zip(x.chunks_exact(q4k::BLOCK_VALUES))
    {
        let blk: &[u8; q4k::BLOCK_BYTES] = arr(blk);
        for line in [0, 64, 128] {
            _mm_prefetch::<_MM_HINT_T0>(blk.as_ptr().wrapping_add(PREFETCH_BYTES + line).cast());
        }
        let xs: &[f32; q4k::BLOCK_VALUES] = arr(xs);
        let (ds, dm) = q4k_scales(blk);
        for c in 0..4 {
            let base = 16 + 32 * c;
            // [low-nibble sub-block 2c, high-nibble sub-block 2c+1]
            let mut qx = [_mm256_setzero_ps(); 2];
            let mut sx = [_mm256_setzero_ps(); 2];
            for g in 0..4 {
                // 8 quant bytes -> 8 low nibbles (sub-block 2c) and 8 high
                // nibbles (sub-block 2c+1), widened to i32 lanes.
                let b = _mm256_cvtepu8_epi32(load_64(arr(&blk[base + 8 * g..base + 8 * g + 8])));
                let lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, mask));
                let hi = _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(b));
                let xlo = load_ps(arr(&xs[64 * c + 8 * g..64 * c + 8 * g + 8]));
                let xhi = load_ps(arr(&xs[64 * c + 32 + 8 * g..64 * c + 40 + 8 * g]));
                qx[0] = _mm256_fmadd_ps(lo, xlo, qx[0]);
                qx[1] = _mm256_fmadd_ps(hi, xhi, qx[1]);
                sx[0] = _mm256_add_ps(xlo, sx[0]);
                sx[1] = _mm256_add_ps(xhi, sx[1]);
            }
            for h in 0..2 {
                let j = 2 * c + h;
                acc[h] = _mm256_fmadd_ps(_mm256_set1_ps(ds[j]), qx[h], acc[h]);
                acc[h] = _mm256_fnmadd_ps(_mm256_set1_ps(dm[j]), sx[h], acc[h]);
            }
        }
    }
    hsum(_mm256_add_ps(acc[0], acc[1]))
}
