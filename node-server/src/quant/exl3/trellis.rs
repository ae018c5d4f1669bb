//! Decoding one 16x16 tile of a trellis: which bits make each position's 16-bit state, the
//! three codebooks that turn a state into a weight, and where each position sits in the tile.
//!
//! A tile is `16 * bits` int16 words; read as little-endian u32 words, its bit stream reads
//! each word from bit 31 down to bit 0. Position `p` owns the next `d(p)` bits of the stream
//! (`d = bits`, or for half-integer rates `floor(bits)` on even and `floor(bits) + 1` on odd
//! positions) and its state is the 16 bits ending where its own bits end, wrapping around the
//! tile (the trellis is tail-biting). Every state is decoded on its own.
//!
//! Tiles are stored here as their stream's bytes in reading order (each word big-endian),
//! after a copy of the stream's last [`WRAP`] bytes: then the state of a position whose bits
//! end at stream bit `e` is the contiguous window of stored bits `[e, e + 16)`, read from the
//! four bytes at `e / 8` shifted by `e mod 8`, with no wrapping.

use std::sync::OnceLock;

use super::{Codebook, Rate};

/// Values in one tile.
pub(super) const TILE_VALUES: usize = 256;
/// Bytes of a tile's stream end copied in front of it (16 bits: one state's reach back).
pub(super) const WRAP: usize = 2;
/// Padding after the last tile, so a 16-byte read from any state's first byte stays inside
/// the buffer.
pub(super) const TAIL: usize = 16;

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

/// Writes one tile (its int16 words as little-endian bytes) into `out` (`WRAP` bytes more
/// than the tile) as stored here.
pub(super) fn store_tile(tile: &[u8], out: &mut [u8]) {
    let (wrap, stream) = out.split_at_mut(WRAP);
    for (w, o) in tile.chunks_exact(4).zip(stream.chunks_exact_mut(4)) {
        o.copy_from_slice(&u32::from_le_bytes([w[0], w[1], w[2], w[3]]).to_be_bytes());
    }
    wrap.copy_from_slice(&stream[stream.len() - WRAP..]);
}

/// Where each position's state lies in a stored tile of one rate.
pub(super) struct RatePlan {
    /// Per position: the stored byte holding its state's first bit, and that bit's offset
    /// from the byte's top.
    pub(super) byte: [u16; TILE_VALUES],
    pub(super) bit: [u8; TILE_VALUES],
    /// Per group of eight positions (the SIMD decoder reads all eight states with one
    /// 16-byte load into both halves of a vector): the load's first byte, ...
    pub(super) group_start: [u16; TILE_VALUES / 8],
    /// ... the byte shuffle that puts each position's four bytes into its 32-bit lane as a
    /// big-endian number, ...
    pub(super) shuffle: [[u8; 32]; TILE_VALUES / 8],
    /// ... and each lane's shift left to bring the state's first bit to the top, ...
    pub(super) shift: [[i32; 8]; TILE_VALUES / 8],
    /// ... or right to bring its last bit to the bottom (16 less the first bit's offset).
    pub(super) rshift: [[i32; 8]; TILE_VALUES / 8],
    /// Bytes from a stored tile's start that those loads reach (at most the tile and its
    /// [`TAIL`]).
    pub(super) reach: usize,
}

impl RatePlan {
    fn new(rate: Rate) -> RatePlan {
        let low = rate.low_bits();
        let mut plan = RatePlan {
            byte: [0; TILE_VALUES],
            bit: [0; TILE_VALUES],
            group_start: [0; TILE_VALUES / 8],
            shuffle: [[0; 32]; TILE_VALUES / 8],
            shift: [[0; 8]; TILE_VALUES / 8],
            rshift: [[0; 8]; TILE_VALUES / 8],
            reach: 0,
        };
        let mut end = 0;
        for p in 0..TILE_VALUES {
            end += low + usize::from(rate.is_half() && p % 2 == 1);
            // Stored bits are the stream's shifted by WRAP bytes, so the window ending at
            // stream bit `end` starts at stored bit `end`.
            plan.byte[p] = (end / 8) as u16;
            plan.bit[p] = (end % 8) as u8;
        }
        debug_assert_eq!(end, 8 * rate.stream_bytes(), "the positions use every bit");
        for t in 0..TILE_VALUES / 8 {
            let start = plan.byte[8 * t];
            plan.group_start[t] = start;
            plan.reach = plan.reach.max(usize::from(start) + 16);
            for j in 0..8 {
                let rel = plan.byte[8 * t + j] - start;
                // 7 positions of at most 8.5 bits, then a 4-byte window: 12 bytes at most.
                assert!(rel + 3 < 16, "a group's states lie in 16 bytes");
                for i in 0..4 {
                    // Lanes 0-3 shuffle the low copy of the load, 4-7 the high one: the same
                    // offsets within each 16-byte half.
                    plan.shuffle[t][4 * j + i] = (rel + 3 - i as u16) as u8;
                }
                plan.shift[t][j] = i32::from(plan.bit[8 * t + j]);
                plan.rshift[t][j] = 16 - plan.shift[t][j];
            }
        }
        assert!(
            plan.reach <= rate.tile_bytes() + TAIL,
            "a tile's loads stay in the tile and its tail"
        );
        plan
    }

    /// The plan of `rate`, built once per rate.
    pub(super) fn of(rate: Rate) -> &'static RatePlan {
        static PLANS: [OnceLock<RatePlan>; 17] = [const { OnceLock::new() }; 17];
        PLANS[usize::from(rate.halves())].get_or_init(|| RatePlan::new(rate))
    }

    /// The 16-bit state of position `p` in the stored `tile`.
    #[inline]
    pub(super) fn state(&self, tile: &[u8], p: usize) -> u32 {
        let at = usize::from(self.byte[p]);
        let window = u32::from_be_bytes([tile[at], tile[at + 1], tile[at + 2], tile[at + 3]]);
        (window << self.bit[p]) >> 16
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

/// Decodes the stored `tile` into `out[row * 16 + column]` (row along K, column along N).
pub(super) fn decode_tile(rate: Rate, cb: Codebook, tile: &[u8], out: &mut [f32; TILE_VALUES]) {
    let plan = RatePlan::of(rate);
    let values = table(cb);
    for p in 0..TILE_VALUES {
        let (r, c) = position(p);
        out[r * 16 + c] = values[plan.state(tile, p) as usize];
    }
}
