//! GGML Q8_0: blocks of 32 values = f16 scale `d` (little-endian) followed by
//! 32 signed bytes `q`; value = `d * q`.

use half::f16;

use super::float::f16_at;
use super::sum_lanes;

pub(super) const BLOCK_VALUES: usize = 32;
pub(super) const BLOCK_BYTES: usize = 2 + BLOCK_VALUES;

/// `src` is finite and `dst` has the right length (checked by the caller).
pub(super) fn quantize(src: &[f32], dst: &mut [u8]) {
    for (xs, out) in src
        .chunks_exact(BLOCK_VALUES)
        .zip(dst.chunks_exact_mut(BLOCK_BYTES))
    {
        let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        // Saturate instead of overflowing to an infinite f16 scale.
        let mut d = f16::from_f32(amax / 127.0);
        if d.is_infinite() {
            d = f16::MAX;
        }
        let df = d.to_f32();
        // Quantize against the scale as stored, so rounding of `d` to f16 is
        // compensated; clamp because that rounding may push |q| above 127.
        let inv = if df > 0.0 { 1.0 / df } else { 0.0 };
        out[..2].copy_from_slice(&d.to_le_bytes());
        for (q, v) in out[2..].iter_mut().zip(xs) {
            // Round half away from zero like C's roundf, via a truncating
            // cast (f32::round is a libm call on baseline x86_64).
            let t = (v * inv).clamp(-127.0, 127.0);
            let r = (t.abs() + 0.5) as i8;
            *q = (if t < 0.0 { -r } else { r }) as u8;
        }
    }
}

pub(super) fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (blk, out) in src
        .chunks_exact(BLOCK_BYTES)
        .zip(dst.chunks_exact_mut(BLOCK_VALUES))
    {
        let d = f16_at(blk);
        for (o, q) in out.iter_mut().zip(&blk[2..]) {
            *o = f32::from(*q as i8) * d;
        }
    }
}

pub(super) fn dot(row: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (blk, xs) in row
        .chunks_exact(BLOCK_BYTES)
        .zip(x.chunks_exact(BLOCK_VALUES))
    {
        let d = f16_at(blk);
        let qs = &blk[2..];
        let mut part = [0.0f32; 8];
        for (qc, xc) in qs.chunks_exact(8).zip(xs.chunks_exact(8)) {
            for lane in 0..8 {
                part[lane] += f32::from(qc[lane] as i8) * xc[lane];
            }
        }
        for lane in 0..8 {
            acc[lane] += d * part[lane];
        }
    }
    sum_lanes(acc)
}
