//! GGML Q4_K: super-blocks of 256 values, 144 bytes each:
//!
//! | bytes    | content                                                    |
//! |----------|------------------------------------------------------------|
//! | 0..2     | f16 `d` (scale of the sub-block scales), little-endian    |
//! | 2..4     | f16 `dmin` (scale of the sub-block mins), little-endian   |
//! | 4..16    | eight 6-bit scales `sc` and eight 6-bit mins `m`, packed  |
//! | 16..144  | 256 4-bit quants                                           |
//!
//! Sub-block `j` (values `32j..32j+32`) decodes as
//! `value = (d * sc[j]) * q - (dmin * m[j])`.
//!
//! Scale packing (GGML's `get_scale_min_k4`): for `j < 4`, byte `j` holds
//! `sc[j]` in its low 6 bits and byte `j + 4` holds `m[j]`; for `j >= 4`, the
//! low 4 bits of `sc[j]` / `m[j]` are the low / high nibble of byte `j + 4`
//! and their top 2 bits sit in the top 2 bits of byte `j - 4` / byte `j`.
//!
//! Quant order: each 64-value chunk `c` uses bytes `32c..32c+32` of the quant
//! area; their low nibbles are values `64c..64c+32` (sub-block `2c`) and their
//! high nibbles values `64c+32..64c+64` (sub-block `2c+1`).

use half::f16;

use super::float::f16_at;
use super::sum_lanes;

pub(super) const BLOCK_VALUES: usize = 256;
pub(super) const BLOCK_BYTES: usize = 144;
const SUB: usize = 32;
const NSUB: usize = 8;
const QMAX: f32 = 15.0;
const SCALE_MAX: f32 = 63.0;

/// Unpacks the 12 scale bytes into (scales, mins), each eight 6-bit values.
#[inline]
pub(super) fn unpack_scales(s: &[u8]) -> ([u8; NSUB], [u8; NSUB]) {
    let mut sc = [0u8; NSUB];
    let mut m = [0u8; NSUB];
    for j in 0..4 {
        sc[j] = s[j] & 63;
        m[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
        m[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
    (sc, m)
}

/// Inverse of [`unpack_scales`]; inputs must be < 64.
fn pack_scales(sc: &[u8; NSUB], m: &[u8; NSUB]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..4 {
        s[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        s[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
        s[j + 8] = (sc[j + 4] & 0x0F) | ((m[j + 4] & 0x0F) << 4);
    }
    s
}

/// Per-sub-block effective scale `d * sc[j]` and offset `dmin * m[j]`, each
/// rounded to f32 exactly as GGML does.
#[inline]
pub(super) fn sub_scales(blk: &[u8]) -> ([f32; NSUB], [f32; NSUB]) {
    let d = f16_at(&blk[0..2]);
    let dmin = f16_at(&blk[2..4]);
    let (sc, m) = unpack_scales(&blk[4..16]);
    let mut ds = [0.0f32; NSUB];
    let mut dm = [0.0f32; NSUB];
    for j in 0..NSUB {
        ds[j] = d * f32::from(sc[j]);
        dm[j] = dmin * f32::from(m[j]);
    }
    (ds, dm)
}

pub(super) fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (blk, out) in src
        .chunks_exact(BLOCK_BYTES)
        .zip(dst.chunks_exact_mut(BLOCK_VALUES))
    {
        let (ds, dm) = sub_scales(blk);
        let qs = &blk[16..];
        for c in 0..4 {
            let bytes = &qs[32 * c..32 * c + 32];
            let (lo, hi) = out[64 * c..64 * c + 64].split_at_mut(32);
            for l in 0..32 {
                // `ds * q` and `d * sc`, `dmin * m` are exact in f32 (at most
                // 11 + 6 + 4 significant bits), so only the subtraction rounds:
                // bit-identical to GGML, fused or not.
                lo[l] = ds[2 * c] * f32::from(bytes[l] & 0x0F) - dm[2 * c];
                hi[l] = ds[2 * c + 1] * f32::from(bytes[l] >> 4) - dm[2 * c + 1];
            }
        }
    }
}

/// Per sub-block `sum_i (ds*q_i - dm)*x_i = ds*sum_i q_i*x_i - dm*sum_i x_i`
/// (the same factorisation as the SIMD kernel), in eight lanes.
pub(super) fn dot(row: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (blk, xs) in row
        .chunks_exact(BLOCK_BYTES)
        .zip(x.chunks_exact(BLOCK_VALUES))
    {
        let (ds, dm) = sub_scales(blk);
        let qs = &blk[16..];
        for c in 0..4 {
            let bytes = &qs[32 * c..32 * c + 32];
            let xlo = &xs[64 * c..64 * c + 32];
            let xhi = &xs[64 * c + 32..64 * c + 64];
            let mut qx = [[0.0f32; 8]; 2];
            let mut sx = [[0.0f32; 8]; 2];
            for g in 0..4 {
                for lane in 0..8 {
                    let l = 8 * g + lane;
                    qx[0][lane] += f32::from(bytes[l] & 0x0F) * xlo[l];
                    qx[1][lane] += f32::from(bytes[l] >> 4) * xhi[l];
                    sx[0][lane] += xlo[l];
                    sx[1][lane] += xhi[l];
                }
            }
            for h in 0..2 {
                for lane in 0..8 {
                    acc[lane] += ds[2 * c + h] * qx[h][lane] - dm[2 * c + h] * sx[h][lane];
                }
            }
        }
    }
    sum_lanes(acc)
}

/// Sums over one sub-block needed for a least-squares fit, for quants
/// assigned on the grid `offset + scale * q`.
struct Sums {
    q: f32,
    qq: f32,
    qx: f32,
}

const ROUNDER: f32 = 12_582_912.0;

/// Assigns quants on the grid `offset + scale * q` (q in 0..=15, nearest
/// level) and returns their sums; eight lanes so the loop vectorises.
fn assign_sums(x: &[f32], scale: f32, offset: f32) -> Sums {
    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    let (mut q, mut qq, mut qx) = ([0.0f32; 8], [0.0f32; 8], [0.0f32; 8]);
    for xs in x.chunks_exact(8) {
        for lane in 0..8 {
            let v = xs[lane];
            // Adding and subtracting 1.5 * 2^23 rounds to the nearest integer
            // (ties to even) in pure float ops, so this loop vectorises.
            let qf = (((v - offset) * inv).clamp(0.0, QMAX) + ROUNDER) - ROUNDER;
            q[lane] += qf;
            qq[lane] += qf * qf;
            qx[lane] += qf * v;
        }
    }
    Sums {
        q: sum_lanes(q),
        qq: sum_lanes(qq),
        qx: sum_lanes(qx),
    }
}

/// Least-squares `(scale, offset <= 0)` for fixed quants (given by their
/// sums), minimising `sum (scale * q + offset - x)^2`; returns it with that
/// squared error (computed from the sums in f64).
fn fit(n: f32, sx: f32, sxx: f32, s: &Sums) -> (f32, f32, f64) {
    let det = n * s.qq - s.q * s.q;
    let (mut scale, mut offset) = if det > 0.0 {
        let a = (n * s.qx - s.q * sx) / det;
        (a, (sx - a * s.q) / n)
    } else {
        (0.0, sx / n)
    };
    if offset > 0.0 || scale < 0.0 {
        // Offset must be <= 0 (it is stored as `-dmin * m` with m >= 0).
        offset = 0.0;
        scale = if s.qq > 0.0 {
            (s.qx / s.qq).max(0.0)
        } else {
            0.0
        };
    }
    let (a, b) = (f64::from(scale), f64::from(offset));
    let err = f64::from(sxx) - 2.0 * a * f64::from(s.qx) - 2.0 * b * f64::from(sx)
        + a * a * f64::from(s.qq)
        + 2.0 * a * b * f64::from(s.q)
        + f64::from(n) * b * b;
    (scale, offset, err)
}

fn assign(x: &[f32], scale: f32, offset: f32, q: &mut [u8; SUB]) {
    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    for (qi, v) in q.iter_mut().zip(x) {
        // Non-negative after the clamp, so `+ 0.5` and truncation round half
        // up (f32::round is a libm call on baseline x86_64). NaN casts to 0.
        *qi = (((v - offset) * inv).clamp(0.0, QMAX) + 0.5) as u8;
    }
}

/// Chooses `(scale >= 0, offset <= 0)` for one 32-value sub-block: a small
/// search over the grid step around `(max - min) / 15`, each candidate
/// assigned then refit by least squares, keeping the lowest squared error.
fn fit_subblock(x: &[f32]) -> (f32, f32) {
    let lo = x.iter().fold(0.0f32, |m, &v| m.min(v));
    let hi = x.iter().fold(f32::MIN, |m, &v| m.max(v));
    let range = hi - lo;
    if range <= 0.0 {
        return (0.0, lo);
    }
    let n = x.len() as f32;
    let sx: f32 = x.iter().sum();
    let sxx: f32 = x.iter().map(|v| v * v).sum();
    let mut best = (range / QMAX, lo, f64::INFINITY);
    for step in STEPS {
        // Candidate grids slightly finer / coarser than min-max, anchored at lo.
        let mut scale = range / (QMAX + step);
        let mut offset = lo;
        for _ in 0..2 {
            let (s, o, err) = fit(n, sx, sxx, &assign_sums(x, scale, offset));
            if err < best.2 {
                best = (s, o, err);
            }
            (scale, offset) = (s, o);
        }
    }
    (best.0, best.1)
}

/// Offsets of the candidate number of grid steps from 15.
const STEPS: [f32; 9] = [-0.5, -0.25, 0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0];

/// `src` is finite and `dst` has the right length (checked by the caller).
pub(super) fn quantize(src: &[f32], dst: &mut [u8]) {
    for (xs, out) in src
        .chunks_exact(BLOCK_VALUES)
        .zip(dst.chunks_exact_mut(BLOCK_BYTES))
    {
        quantize_block(xs, out);
    }
}

fn to_f16_finite(v: f32) -> f16 {
    let h = f16::from_f32(v);
    if h.is_infinite() { f16::MAX } else { h }
}

fn quantize_block(xs: &[f32], out: &mut [u8]) {
    let mut scales = [0.0f32; NSUB];
    let mut mins = [0.0f32; NSUB];
    for j in 0..NSUB {
        let (s, o) = fit_subblock(&xs[SUB * j..SUB * (j + 1)]);
        scales[j] = s;
        mins[j] = -o;
    }
    let max_scale = scales.iter().fold(0.0f32, |m, &v| m.max(v));
    let max_min = mins.iter().fold(0.0f32, |m, &v| m.max(v));
    let d = to_f16_finite(max_scale / SCALE_MAX);
    let dmin = to_f16_finite(max_min / SCALE_MAX);
    let (df, dminf) = (d.to_f32(), dmin.to_f32());
    let q6 = |v: f32, unit: f32| -> u8 {
        if unit > 0.0 {
            ((v / unit).clamp(0.0, SCALE_MAX) + 0.5) as u8
        } else {
            0
        }
    };
    let mut sc = [0u8; NSUB];
    let mut m = [0u8; NSUB];
    for j in 0..NSUB {
        sc[j] = q6(scales[j], df);
        m[j] = q6(mins[j], dminf);
    }
    out[0..2].copy_from_slice(&d.to_le_bytes());
    out[2..4].copy_from_slice(&dmin.to_le_bytes());
    out[4..16].copy_from_slice(&pack_scales(&sc, &m));

    // Final quants against the scales exactly as they will be decoded.
    let mut q = [[0u8; SUB]; NSUB];
    for j in 0..NSUB {
        let ds = df * f32::from(sc[j]);
        let dm = dminf * f32::from(m[j]);
        assign(&xs[SUB * j..SUB * (j + 1)], ds, -dm, &mut q[j]);
    }
    let qs = &mut out[16..BLOCK_BYTES];
    for c in 0..4 {
        for l in 0..32 {
            qs[32 * c + l] = q[2 * c][l] | (q[2 * c + 1][l] << 4);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_packing_round_trips_all_values() {
        for a in 0..64u8 {
            let sc = [a, 63 - a, a / 2, 1, a, 63 - a, a.wrapping_mul(7) % 64, 63];
            let m = [
                63 - a,
                a,
                0,
                a.wrapping_mul(5) % 64,
                a / 3,
                a,
                62,
                a.wrapping_mul(11) % 64,
            ];
            let packed = pack_scales(&sc, &m);
            assert_eq!(unpack_scales(&packed), (sc, m), "a={a}");
        }
    }
}
