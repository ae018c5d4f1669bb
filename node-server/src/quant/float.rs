//! Plain float rows stored as little-endian bytes. Lengths are checked by the
//! callers in `mod.rs`.

use half::{bf16, f16};

use super::sum_lanes;

pub(super) fn encode_f32(src: &[f32], dst: &mut [u8]) {
    for (v, out) in src.iter().zip(dst.chunks_exact_mut(4)) {
        out.copy_from_slice(&v.to_le_bytes());
    }
}

pub(super) fn encode_f16(src: &[f32], dst: &mut [u8]) {
    for (v, out) in src.iter().zip(dst.chunks_exact_mut(2)) {
        out.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
    }
}

pub(super) fn encode_bf16(src: &[f32], dst: &mut [u8]) {
    for (v, out) in src.iter().zip(dst.chunks_exact_mut(2)) {
        out.copy_from_slice(&bf16::from_f32(*v).to_le_bytes());
    }
}

#[inline]
fn f32_at(b: &[u8]) -> f32 {
    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

#[inline]
pub(super) fn f16_at(b: &[u8]) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[0], b[1]]))
}

/// Exact f16 -> f32 widening without branches on the value (so loops over it
/// vectorise, unlike `half`'s runtime-dispatched conversion): shifting the
/// exponent and mantissa into f32 position and multiplying by 2^112 rebiases
/// the exponent (15 -> 127) and normalises subnormals exactly; inf/NaN keep
/// an all-ones exponent.
#[inline]
pub(super) fn f16_to_f32(h: u16) -> f32 {
    const TWO_POW_112: f32 = f32::from_bits((127 + 112) << 23);
    let sign = u32::from(h & 0x8000) << 16;
    let em = u32::from(h & 0x7fff);
    let mag = if em >= 0x7c00 {
        f32::from_bits(0x7f80_0000 | ((em & 0x03ff) << 13))
    } else {
        f32::from_bits(em << 13) * TWO_POW_112
    };
    f32::from_bits(mag.to_bits() | sign)
}

#[inline]
fn bf16_at(b: &[u8]) -> f32 {
    // bf16 is the top half of an f32: widening is exact.
    f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16)
}

pub(super) fn decode_f32(src: &[u8], dst: &mut [f32]) {
    for (b, out) in src.chunks_exact(4).zip(dst.iter_mut()) {
        *out = f32_at(b);
    }
}

pub(super) fn decode_f16(src: &[u8], dst: &mut [f32]) {
    for (b, out) in src.chunks_exact(2).zip(dst.iter_mut()) {
        *out = f16_at(b);
    }
}

pub(super) fn decode_bf16(src: &[u8], dst: &mut [f32]) {
    for (b, out) in src.chunks_exact(2).zip(dst.iter_mut()) {
        *out = bf16_at(b);
    }
}

/// Dot product over `width`-byte elements decoded by `get`, with eight
/// independent partial sums (lane `i % 8`) so the loop can vectorise.
#[inline]
fn dot_generic(row: &[u8], x: &[f32], width: usize, get: impl Fn(&[u8]) -> f32) -> f32 {
    let mut acc = [0.0f32; 8];
    let full = x.len() / 8 * 8;
    for (rb, xb) in row.chunks_exact(8 * width).zip(x[..full].chunks_exact(8)) {
        for lane in 0..8 {
            acc[lane] += get(&rb[lane * width..]) * xb[lane];
        }
    }
    let mut sum = sum_lanes(acc);
    for (i, xv) in x.iter().enumerate().skip(full) {
        sum += get(&row[i * width..]) * xv;
    }
    sum
}

pub(super) fn dot_f32(row: &[u8], x: &[f32]) -> f32 {
    dot_generic(row, x, 4, f32_at)
}

pub(super) fn dot_f16(row: &[u8], x: &[f32]) -> f32 {
    dot_generic(row, x, 2, f16_at)
}

pub(super) fn dot_bf16(row: &[u8], x: &[f32]) -> f32 {
    dot_generic(row, x, 2, bf16_at)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_widening_matches_half_for_all_bit_patterns() {
        for bits in 0..=u16::MAX {
            let ours = f16_to_f32(bits);
            let theirs = f16::from_bits(bits).to_f32();
            if theirs.is_nan() {
                assert!(ours.is_nan(), "{bits:#06x}");
            } else {
                assert_eq!(ours.to_bits(), theirs.to_bits(), "{bits:#06x}");
            }
        }
    }
}
