//! Decoding one 16x16 tile of a trellis: which bits make each position's 16-bit state, the
//! three codebooks that turn a state into a weight, and where each position sits in the tile.
//!
//! A tile is `8 * bits` u32 words (its int16 words read as little-endian u32). Its bit stream
//! reads each word from bit 31 down to bit 0. Position `p` owns the next `d(p)` bits of the
//! stream (`d = bits`, or for half-integer rates `floor(bits)` on even and `floor(bits) + 1`
//! on odd positions) and its state is the 16 bits ending where its own bits end, wrapping
//! around the tile (the trellis is tail-biting). Every state is decoded on its own, so any
//! position can be decoded without the others.

use std::sync::OnceLock;

use super::{Codebook, Rate};

/// Values in one tile.
pub(super) const TILE_VALUES: usize = 256;

/// `(row, column)` offsets of the eight positions `8t + j` of a group `t`, from the group's
/// corner `(2 (t mod 4), t div 4)`: the order of an mma.m16n8k16 B fragment.
pub(super) const GROUP_OFFSETS: [(usize, usize); 8] = [
    (0, 0),
    (1, 0),
    (8, 0),
    (9, 0),
    (0, 8),
    (1, 8),
    (8, 8),
    (9, 8),
];

/// Row (along K) and column (along N) of tile position `p`.
#[inline]
pub(super) fn position(p: usize) -> (usize, usize) {
    let (t, j) = (p / 8, p % 8);
    let (dr, dc) = GROUP_OFFSETS[j];
    (2 * (t % 4) + dr, t / 4 + dc)
}

/// Where each position's 16-bit state lies in a tile of one rate: the word holding its first
/// bit, the word after it (wrapping), and the first bit's offset from that word's top.
pub(super) struct RatePlan {
    pub(super) first: [i32; TILE_VALUES],
    pub(super) second: [i32; TILE_VALUES],
    pub(super) shift: [i32; TILE_VALUES],
}

impl RatePlan {
    fn new(rate: Rate) -> RatePlan {
        let ring = 32 * rate.tile_words();
        let low = rate.low_bits();
        let mut plan = RatePlan {
            first: [0; TILE_VALUES],
            second: [0; TILE_VALUES],
            shift: [0; TILE_VALUES],
        };
        let mut end = 0;
        for p in 0..TILE_VALUES {
            end += low + usize::from(rate.is_half() && p % 2 == 1);
            let start = (end + ring - 16) % ring;
            let word = start / 32;
            plan.first[p] = word as i32;
            plan.second[p] = ((word + 1) % rate.tile_words()) as i32;
            plan.shift[p] = (start % 32) as i32;
        }
        debug_assert_eq!(end, ring, "the positions use every bit of the tile");
        plan
    }

    /// The plan of `rate`, built once per rate.
    pub(super) fn of(rate: Rate) -> &'static RatePlan {
        static PLANS: [OnceLock<RatePlan>; 17] = [const { OnceLock::new() }; 17];
        PLANS[usize::from(rate.halves())].get_or_init(|| RatePlan::new(rate))
    }

    /// The 16-bit state of position `p` in the tile `words`.
    #[inline]
    pub(super) fn state(&self, words: &[u32], p: usize) -> u32 {
        let hi = u64::from(words[self.first[p] as usize]);
        let lo = u64::from(words[self.second[p] as usize]);
        (((hi << 32) | lo) >> (48 - self.shift[p])) as u32 & 0xFFFF
    }
}

/// Multiplier of the 3INST codebook's linear congruential step.
pub(super) const INST3_MUL: u32 = 89_226_354;
/// Increment of the 3INST step.
pub(super) const INST3_ADD: u32 = 64_248_484;
/// Multiplier of the MCG codebook (no increment).
pub(super) const MCG_MUL: u32 = 0xCBAC_1FED;
/// Multiplier of the MUL1 codebook.
pub(super) const MUL1_MUL: u32 = 0x83DC_D12D;
/// 3INST and MCG keep these bits of the hashed state: both halves' signs, the low two exponent
/// bits and the mantissas ...
pub(super) const HALVES_MASK: u32 = 0x8FFF_8FFF;
/// ... then flip these, which puts both halves' exponents in 12..=15: two f16 values in
/// [1/8, 2), whose sum is exact in f32.
pub(super) const HALVES_XOR: u32 = 0x3B60_3B60;
/// MUL1's value is `(MUL1_SCALE * byte_sum - MUL1_OFFSET) / 2^18`, exact in f32.
pub(super) const MUL1_SCALE: i32 = 1774;
pub(super) const MUL1_OFFSET: i32 = 905_216;
pub(super) const MUL1_DIVISOR: f32 = 262_144.0;

/// Rounds to the nearest f16 (ties to even) and back.
#[inline]
fn round_f16(v: f32) -> f32 {
    half::f16::from_f32(v).to_f32()
}

/// The weight codebook `cb` gives the 16-bit `state`, exactly as exllamav3 computes it.
pub(super) fn decode_state(cb: Codebook, state: u32) -> f32 {
    match cb {
        Codebook::Mul1 => {
            let y = state.wrapping_mul(MUL1_MUL);
            let sum: i32 = y.to_le_bytes().iter().map(|&b| i32::from(b)).sum();
            round_f16((MUL1_SCALE * sum - MUL1_OFFSET) as f32 / MUL1_DIVISOR)
        }
        Codebook::Inst3 | Codebook::Mcg => {
            let y = if cb == Codebook::Mcg {
                state.wrapping_mul(MCG_MUL)
            } else {
                state.wrapping_mul(INST3_MUL).wrapping_add(INST3_ADD)
            };
            let y = (y & HALVES_MASK) ^ HALVES_XOR;
            let lo = half::f16::from_bits(y as u16).to_f32();
            let hi = half::f16::from_bits((y >> 16) as u16).to_f32();
            round_f16(lo + hi)
        }
    }
}

/// Every state's value under one codebook (the portable decoder's lookup table).
pub(super) fn table(cb: Codebook) -> &'static [f32] {
    static TABLES: [OnceLock<Vec<f32>>; 3] = [const { OnceLock::new() }; 3];
    TABLES[cb as usize].get_or_init(|| (0..=u16::MAX).map(|s| decode_state(cb, s.into())).collect())
}

/// Decodes the tile `words` into `out[row * 16 + column]` (row along K, column along N).
pub(super) fn decode_tile(rate: Rate, cb: Codebook, words: &[u32], out: &mut [f32; TILE_VALUES]) {
    let plan = RatePlan::of(rate);
    let values = table(cb);
    for p in 0..TILE_VALUES {
        let (r, c) = position(p);
        out[r * 16 + c] = values[plan.state(words, p) as usize];
    }
}
