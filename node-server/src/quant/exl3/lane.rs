//! The CPU lane's EXL3 product for the near-exact modes (`fast`, `nvme`), mul1 codebook, one
//! token row: the rotated input rounded to 16-bit integers per 128 values ([`LaneInput`]), and
//! each weight taken as mul1's affine map of its state's byte sum, `w = (1774 s - 905216) /
//! 2^18`, before the f16 rounding the exact decoder applies. Then a position costs a multiply,
//! a byte-pair sum and one integer multiply-add with its input (`sum s a` is exact in i32 over
//! a Hadamard block), where the exact kernel also converts, rounds to f16 and back, and FMAs;
//! the offset's share `905216 sum a` is the same for every output and is taken once.
//!
//! Each 128-input block's integer sums go into f64 lanes (the affine map's two terms nearly
//! cancel: f64 keeps the difference exact to far below the f16 rounding it stands in for),
//! in the AVX2 kernel's lane order, so the portable kernel here gives the same bits. The lane
//! differs from the exact kernels by the f16 rounding of each weight (half an f16 ulp, about
//! 2.4e-4 of it) and the 16-bit rounding of the input (half of `max|x| / 32767` per block).

use super::hadamard;
use super::trellis::{GROUP_OFFSETS, MUL1_DIVISOR, MUL1_MUL, MUL1_OFFSET, MUL1_SCALE, RatePlan};
use super::{Rate, TileColumn};

/// Inputs per scale: one Hadamard block (its integer sums stay within i32: 8 tiles of four
/// products a lane, each at most 1020 * 32767).
pub(super) const BLOCK: usize = hadamard::BLOCK;

/// One rotated input row rounded for the lane: `xr[i] ~ scales[i / 128] * q[i]`.
pub(super) struct LaneInput {
    pub(super) q: Vec<i16>,
    pub(super) scales: Vec<f32>,
    /// `sum_i scales[i / 128] * q[i]`, the offset term's input.
    pub(super) sum: f64,
}

impl LaneInput {
    /// `xr` (a multiple of 128 values) rounded; `None` when a value is not finite.
    pub(super) fn new(xr: &[f32]) -> Option<LaneInput> {
        if !xr.iter().all(|v| v.is_finite()) {
            return None;
        }
        let mut input = LaneInput {
            q: Vec::with_capacity(xr.len()),
            scales: Vec::with_capacity(xr.len() / BLOCK),
            sum: 0.0,
        };
        for block in xr.chunks_exact(BLOCK) {
            let start = input.q.len();
            let scale = crate::quant::lane::round_i16(block, &mut input.q);
            let sum: i64 = input.q[start..].iter().map(|&q| i64::from(q)).sum();
            input.scales.push(scale);
            input.sum += sum as f64 * f64::from(scale);
        }
        Some(input)
    }

    /// The input laid out for the AVX2 kernel: per 16-input block, four groups of eight lanes
    /// (group `q`'s lane `j` the input of tile row `2q + GROUP_OFFSETS[j].0`, mul1's lane
    /// order), each value twice (both 16-bit halves of the lane, against the two byte-pair sums
    /// of the lane's state).
    pub(super) fn arranged(&self) -> Vec<i16> {
        let mut out = Vec::with_capacity(4 * self.q.len());
        for block in self.q.chunks_exact(16) {
            for q in 0..4 {
                for (dr, _) in GROUP_OFFSETS {
                    let v = block[2 * q + dr];
                    out.extend([v, v]);
                }
            }
        }
        out
    }
}

/// The byte sum `s` of mul1's hashed `state` (the weight is `(1774 s - 905216) / 2^18` before
/// its f16 rounding).
#[inline]
fn byte_sum(state: u32) -> i32 {
    state
        .wrapping_mul(MUL1_MUL)
        .to_le_bytes()
        .iter()
        .map(|&b| i32::from(b))
        .sum()
}

/// Adds one block's integer lanes (`[column pair][lane]`) to the f64 totals at `scale`.
#[inline]
pub(super) fn flush(totals: &mut [[f64; 8]; 8], lanes: &[[i32; 8]; 8], scale: f32) {
    let scale = f64::from(scale);
    for (t, l) in totals.iter_mut().zip(lanes) {
        for (t, &l) in t.iter_mut().zip(l) {
            *t += f64::from(l) * scale;
        }
    }
}

/// The strip's 16 outputs of `xr What` from the totals: column `c0` sums lanes 0-3 of pair
/// `c0`, column `c0 + 8` lanes 4-7 (mul1's lane order), then the affine map with the input's
/// sum.
pub(super) fn columns(totals: &[[f64; 8]; 8], input_sum: f64, out: &mut [f32]) {
    let (scale, offset) = (f64::from(MUL1_SCALE), f64::from(MUL1_OFFSET) * input_sum);
    for (c0, t) in totals.iter().enumerate() {
        for side in 0..2 {
            let l = &t[4 * side..4 * side + 4];
            let s = (l[0] + l[1]) + (l[2] + l[3]);
            out[c0 + 8 * side] = ((scale * s - offset) / f64::from(MUL1_DIVISOR)) as f32;
        }
    }
}

/// The portable kernel: one strip of 16 outputs (`out`) of the lane's product.
pub(super) fn strip(rate: Rate, tiles: TileColumn, input: &LaneInput, out: &mut [f32]) {
    let plan = RatePlan::of(rate);
    let mut totals = [[0f64; 8]; 8];
    for b in 0..tiles.tiles / 8 {
        let mut lanes = [[0i32; 8]; 8];
        for kt in 8 * b..8 * b + 8 {
            let tile = tiles.tile(kt);
            let x = &input.q[16 * kt..16 * kt + 16];
            for p in 0..256 {
                let (t, j) = (p / 8, p % 8);
                let a = i32::from(x[2 * (t % 4) + GROUP_OFFSETS[j].0]);
                lanes[t / 4][j] += byte_sum(plan.state(tile, p)) * a;
            }
        }
        flush(&mut totals, &lanes, input.scales[b]);
    }
    columns(&totals, input.sum, out);
}
