//! The AVX2 + FMA + F16C product kernel: eight tile positions per vector, from their states (one
//! 16-byte load into both halves, a byte shuffle and a variable shift) through the codebook
//! (integer ops, then one f16 rounding with F16C) straight into FMAs, without storing the tile. The
//! same code is compiled a second time with AVX-512 VL + VNNI enabled (still 256-bit vectors: 32
//! registers, fused logic, a one-instruction byte sum), chosen when the CPU has them.
//!
//! The eight positions of group `t` lie in rows `2q, 2q+1, 2q+8, 2q+9` (`q = t mod 4`) of
//! columns `t div 4` and `t div 4 + 8`, so each group multiplies a fixed lane pattern of the
//! input ([`arrange`] lays it out once per product) and accumulates into the lanes of one of
//! eight vectors per row; the lanes are summed per column at the end of the strip.
//!
//! `unsafe` is allowed here for unaligned loads inside a tile whose length is checked once,
//! and for calling the `#[target_feature]` kernels once the caller has checked the CPU.
#![allow(unsafe_code)]

use std::arch::x86_64::*;

use super::trellis::{
    GROUP_OFFSETS, HALVES_MASK, HALVES_XOR, INST3_ADD, INST3_MUL, MCG_MUL, MUL1_DIVISOR, MUL1_MUL,
    MUL1_OFFSET, MUL1_SCALE, RatePlan,
};
use super::{Codebook, Rate, TileColumn};

/// Rows one pass over a strip's tiles serves.
const ROW_BLOCK: usize = 4;
/// mul1's values come out of [`values`] multiplied by `MUL1_DIVISOR / 16 = 2^14` (every
/// rounded value is then a normal f16 below 65,504, and no multiply is needed per value);
/// the strip's sums are scaled back by this, exactly.
const MUL1_VALUE_SCALE: f32 = 16.0 / MUL1_DIVISOR;
/// Floats of the arranged input per 16 inputs: four groups of eight lanes.
const ARRANGED: usize = 32;

/// Which of a group's eight positions (`GROUP_OFFSETS` order) each lane of [`values`] holds:
/// mul1's in order; the half-sum codebooks' in the order their pairwise sum of the two f16
/// halves (`hadd` within each 128-bit half) leaves them.
pub(super) fn lane_positions(cb: Codebook) -> [usize; 8] {
    if cb == Codebook::Mul1 {
        [0, 1, 2, 3, 4, 5, 6, 7]
    } else {
        [0, 1, 4, 5, 2, 3, 6, 7]
    }
}

/// Lanes of a group whose positions lie in its first column (`c0`), then those in its second
/// (`c0 + 8`), each in lane order.
fn column_lanes(cb: Codebook) -> [[usize; 4]; 2] {
    let lanes = lane_positions(cb);
    let mut out = [[0; 4]; 2];
    let mut filled = [0; 2];
    for (lane, &j) in lanes.iter().enumerate() {
        let side = GROUP_OFFSETS[j].1 / 8;
        out[side][filled[side]] = lane;
        filled[side] += 1;
    }
    out
}

/// The rotated input `xr` (`[rows, K]`) laid out for [`strip`] with codebook `cb`: per row
/// and 16-input block, four groups of eight lanes, group `q`'s lanes holding the inputs of the
/// tile rows their positions lie in (`2q, 2q+1, 2q+8, 2q+9`, each twice, in the lane order of
/// [`lane_positions`]).
pub(super) fn arrange(xr: &[f32], rows: usize, cb: Codebook) -> Vec<f32> {
    let k = xr.len() / rows;
    let lanes = lane_positions(cb);
    let mut out = Vec::with_capacity(rows * k / 16 * ARRANGED);
    for block in xr.chunks_exact(16) {
        for q in 0..4 {
            out.extend(lanes.iter().map(|&j| block[2 * q + GROUP_OFFSETS[j].0]));
        }
    }
    out
}

/// The instruction sets the strip is compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Isa {
    /// AVX2 + FMA + F16C.
    Avx2,
    /// The same kernel with AVX-512 VL and VNNI as well: 32 vector registers, three-input
    /// logic, mul1's byte sum in one `vpdpbusd`. 256-bit vectors still.
    Avx512Vnni,
}

impl Isa {
    pub(super) fn supported(self) -> bool {
        let avx2 = crate::quant::cpu_features().simd_supported();
        match self {
            Isa::Avx2 => avx2,
            Isa::Avx512Vnni => {
                static WIDE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
                avx2 && *WIDE.get_or_init(|| {
                    std::arch::is_x86_feature_detected!("avx512f")
                        && std::arch::is_x86_feature_detected!("avx512vl")
                        && std::arch::is_x86_feature_detected!("avx512vnni")
                })
            }
        }
    }

    /// The widest supported.
    pub(super) fn best() -> Isa {
        if Isa::Avx512Vnni.supported() {
            Isa::Avx512Vnni
        } else {
            Isa::Avx2
        }
    }
}

/// As `portable::strip`, from the [`arrange`]d input, on the given instruction set, which
/// the CPU must have.
pub(super) fn strip(
    isa: Isa,
    rate: Rate,
    cb: Codebook,
    tiles: TileColumn,
    xa: &[f32],
    rows: usize,
    out: &mut [f32],
) {
    assert!(isa.supported(), "{isa:?} on this CPU");
    let plan = RatePlan::of(rate);
    let per_row = xa.len() / rows;
    for r0 in (0..rows).step_by(ROW_BLOCK) {
        let n = (rows - r0).min(ROW_BLOCK);
        let x = &xa[r0 * per_row..(r0 + n) * per_row];
        let o = &mut out[16 * r0..16 * (r0 + n)];
        // SAFETY: asserted above that the CPU has the instruction set's features.
        unsafe {
            match isa {
                Isa::Avx2 => avx2::rows(cb, n, plan, tiles, x, o),
                Isa::Avx512Vnni => avx512::rows(cb, n, plan, tiles, x, o),
            }
        }
    }
}

/// The kernel's functions, compiled for the target features `$features`; `$byte_sum` sums
/// each lane's four bytes, `$madd_add` adds the pairwise products of 16-bit lanes.
macro_rules! kernel {
    ($isa:ident, $features:literal, $byte_sum:ident, $madd_add:ident) => {
        mod $isa {
            use super::*;

            /// One block of `n` rows (1 to [`ROW_BLOCK`]) of a strip.
            ///
            /// # Safety
            /// The CPU must have the module's target features.
            #[target_feature(enable = $features)]
            pub(super) fn rows(
                cb: Codebook,
                n: usize,
                plan: &RatePlan,
                tiles: TileColumn,
                x: &[f32],
                o: &mut [f32],
            ) {
                match (cb, n) {
                    (Codebook::Inst3, 1) => rows_block::<0, 1>(cb, plan, tiles, x, o),
                    (Codebook::Inst3, 2) => rows_block::<0, 2>(cb, plan, tiles, x, o),
                    (Codebook::Inst3, 3) => rows_block::<0, 3>(cb, plan, tiles, x, o),
                    (Codebook::Inst3, _) => rows_block::<0, 4>(cb, plan, tiles, x, o),
                    (Codebook::Mcg, 1) => rows_block::<1, 1>(cb, plan, tiles, x, o),
                    (Codebook::Mcg, 2) => rows_block::<1, 2>(cb, plan, tiles, x, o),
                    (Codebook::Mcg, 3) => rows_block::<1, 3>(cb, plan, tiles, x, o),
                    (Codebook::Mcg, _) => rows_block::<1, 4>(cb, plan, tiles, x, o),
                    (Codebook::Mul1, 1) => rows_block::<2, 1>(cb, plan, tiles, x, o),
                    (Codebook::Mul1, 2) => rows_block::<2, 2>(cb, plan, tiles, x, o),
                    (Codebook::Mul1, 3) => rows_block::<2, 3>(cb, plan, tiles, x, o),
                    (Codebook::Mul1, _) => rows_block::<2, 4>(cb, plan, tiles, x, o),
                }
            }

            /// One strip for `R` rows of codebook `cb` (`CB` is `cb as u8`). The tile's 32
            /// groups are unrolled (`column::<C0>` for each of the eight column pairs), so the
            /// accumulators stay in registers; the tile and input reads are bounds-checked once
            /// per tile, not per group.
            #[target_feature(enable = $features)]
            pub(super) fn rows_block<const CB: u8, const R: usize>(
                cb: Codebook,
                plan: &RatePlan,
                tiles: TileColumn,
                x: &[f32],
                out: &mut [f32],
            ) {
                let per_row = x.len() / R;
                assert!(
                    per_row >= tiles.tiles * ARRANGED,
                    "the arranged input covers the strip"
                );
                // Opaque to the compiler, so it keeps them (in registers or on the stack)
                // instead of broadcasting them again for every group.
                let c = std::hint::black_box(Consts::of(cb));
                let mut acc = [[_mm256_setzero_ps(); 8]; R];
                for kt in 0..tiles.tiles {
                    let tile = tiles.tile(kt);
                    assert!(
                        tile.len() >= plan.reach,
                        "every group's loads lie in the tile"
                    );
                    let t = tile.as_ptr();
                    let xs: [*const f32; R] = std::array::from_fn(|r| {
                        x[r * per_row + kt * ARRANGED..][..ARRANGED].as_ptr()
                    });
                    // SAFETY: the loads `column` makes read 16 bytes at `plan.group_start` offsets
                    // of `t`, all below `plan.reach` (asserted above), and `ARRANGED` floats at
                    // each `xs[r]`.
                    unsafe {
                        column::<CB, R, 0>(plan, &c, t, xs, &mut acc);
                        column::<CB, R, 1>(plan, &c, t, xs, &mut acc);
                        column::<CB, R, 2>(plan, &c, t, xs, &mut acc);
                        column::<CB, R, 3>(plan, &c, t, xs, &mut acc);
                        column::<CB, R, 4>(plan, &c, t, xs, &mut acc);
                        column::<CB, R, 5>(plan, &c, t, xs, &mut acc);
                        column::<CB, R, 6>(plan, &c, t, xs, &mut acc);
                        column::<CB, R, 7>(plan, &c, t, xs, &mut acc);
                    }
                }
                // The codebook's values were computed at a power-of-two scale (see `values`): undo
                // it once per output. Exact, so the sums are bit for bit those of the unscaled
                // values.
                let scale = if cb == Codebook::Mul1 {
                    MUL1_VALUE_SCALE
                } else {
                    1.0
                };
                let sides = column_lanes(cb);
                for (r, acc) in acc.iter().enumerate() {
                    for (c0, v) in acc.iter().enumerate() {
                        let l = to_array(*v);
                        for (side, [a, b, c, d]) in sides.into_iter().enumerate() {
                            out[16 * r + c0 + 8 * side] = ((l[a] + l[b]) + (l[c] + l[d])) * scale;
                        }
                    }
                }
            }

            /// Groups `4 C0 .. 4 C0 + 4` of one tile (columns `C0` and `C0 + 8`) into `acc[r][C0]`.
            ///
            /// # Safety
            /// `tile` must be readable up to `plan.reach` bytes and each `x[r]` for `ARRANGED`
            /// floats.
            #[target_feature(enable = $features)]
            #[inline]
            pub(super) unsafe fn column<const CB: u8, const R: usize, const C0: usize>(
                plan: &RatePlan,
                c: &Consts,
                tile: *const u8,
                x: [*const f32; R],
                acc: &mut [[__m256; 8]; R],
            ) {
                for q in 0..4 {
                    // SAFETY: as the caller promised.
                    let v = values::<CB>(unsafe { states(plan, tile, 4 * C0 + q) }, c);
                    for r in 0..R {
                        // SAFETY: `8 q + 8 <= ARRANGED` floats at `x[r]`.
                        let xv = unsafe { _mm256_loadu_ps(x[r].add(8 * q)) };
                        acc[r][C0] = _mm256_fmadd_ps(v, xv, acc[r][C0]);
                    }
                }
            }

            /// One strip of the CPU lane's mul1 product ([`super::super::lane`]) from its
            /// [`LaneInput::arranged`](super::super::lane::LaneInput::arranged) input `xa`: per
            /// Hadamard block, the states' byte-pair sums against the input into eight i32
            /// vectors (one per column pair), then into the f64 totals.
            #[target_feature(enable = $features)]
            pub(super) fn lane_strip(
                plan: &RatePlan,
                tiles: TileColumn,
                xa: &[i16],
                scales: &[f32],
                input_sum: f64,
                out: &mut [f32],
            ) {
                assert!(
                    tiles.tiles.is_multiple_of(8)
                        && xa.len() >= 64 * tiles.tiles
                        && scales.len() >= tiles.tiles / 8,
                    "the input covers the strip in whole Hadamard blocks"
                );
                // Opaque to the compiler, as in `rows_block`.
                let c = std::hint::black_box(Consts::of(Codebook::Mul1));
                let mut totals = [[0f64; 8]; 8];
                for b in 0..tiles.tiles / 8 {
                    let mut acc = [_mm256_setzero_si256(); 8];
                    for kt in 8 * b..8 * b + 8 {
                        let tile = tiles.tile(kt);
                        assert!(
                            tile.len() >= plan.reach,
                            "every group's loads lie in the tile"
                        );
                        let (t, x) = (tile.as_ptr(), xa[64 * kt..][..64].as_ptr());
                        // SAFETY: `lane_column` reads 16 bytes at `plan.group_start` offsets of
                        // `t`, all below `plan.reach` (asserted above), and 64 values at `x`.
                        unsafe {
                            lane_column::<0>(plan, &c, t, x, &mut acc);
                            lane_column::<1>(plan, &c, t, x, &mut acc);
                            lane_column::<2>(plan, &c, t, x, &mut acc);
                            lane_column::<3>(plan, &c, t, x, &mut acc);
                            lane_column::<4>(plan, &c, t, x, &mut acc);
                            lane_column::<5>(plan, &c, t, x, &mut acc);
                            lane_column::<6>(plan, &c, t, x, &mut acc);
                            lane_column::<7>(plan, &c, t, x, &mut acc);
                        }
                    }
                    let mut lanes = [[0i32; 8]; 8];
                    for (l, a) in lanes.iter_mut().zip(acc) {
                        // SAFETY: `l` is 32 writable bytes; storeu has no alignment requirement.
                        unsafe { _mm256_storeu_si256(l.as_mut_ptr().cast(), a) };
                    }
                    super::super::lane::flush(&mut totals, &lanes, scales[b]);
                }
                super::super::lane::columns(&totals, input_sum, out);
            }

            /// Groups `4 C0 .. 4 C0 + 4` of one tile into `acc[C0]`: each state hashed, its
            /// byte pairs summed, and those times the input (both halves of a lane hold it).
            ///
            /// # Safety
            /// `tile` must be readable up to `plan.reach` bytes and `x` for 64 values.
            #[target_feature(enable = $features)]
            #[inline]
            pub(super) unsafe fn lane_column<const C0: usize>(
                plan: &RatePlan,
                c: &Consts,
                tile: *const u8,
                x: *const i16,
                acc: &mut [__m256i; 8],
            ) {
                for q in 0..4 {
                    // SAFETY: as the caller promised.
                    let y =
                        _mm256_mullo_epi32(unsafe { states_low(plan, tile, 4 * C0 + q) }, c.mul);
                    let pairs = _mm256_maddubs_epi16(y, c.ones8);
                    // SAFETY: `16 q + 16 <= 64` values at `x`.
                    let xv = unsafe { _mm256_loadu_si256(x.add(16 * q).cast()) };
                    acc[C0] = $madd_add(acc[C0], pairs, xv);
                }
            }

            #[target_feature(enable = $features)]
            #[inline]
            pub(super) fn load8i(v: &[i32; 8]) -> __m256i {
                // SAFETY: `v` is 32 readable bytes; loadu has no alignment requirement.
                unsafe { _mm256_loadu_si256(v.as_ptr().cast()) }
            }

            #[target_feature(enable = $features)]
            #[inline]
            pub(super) fn load32(v: &[u8; 32]) -> __m256i {
                // SAFETY: `v` is 32 readable bytes; loadu has no alignment requirement.
                unsafe { _mm256_loadu_si256(v.as_ptr().cast()) }
            }

            #[target_feature(enable = $features)]
            #[inline]
            pub(super) fn to_array(v: __m256) -> [f32; 8] {
                let mut out = [0.0f32; 8];
                // SAFETY: `out` is 32 writable bytes; storeu has no alignment requirement.
                unsafe { _mm256_storeu_ps(out.as_mut_ptr(), v) };
                out
            }

            /// Group `t`'s eight positions in the stored tile at `tile` as big-endian 32-bit
            /// windows, each holding its state: one 16-byte load into both halves, a byte
            /// shuffle.
            ///
            /// # Safety
            /// `tile` must be readable up to `plan.reach` bytes.
            #[target_feature(enable = $features)]
            #[inline]
            pub(super) unsafe fn windows(plan: &RatePlan, tile: *const u8, t: usize) -> __m256i {
                let start = usize::from(plan.group_start[t]);
                // SAFETY: `start + 16` is at most `plan.reach`.
                let bytes =
                    unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(tile.add(start).cast())) };
                _mm256_shuffle_epi8(bytes, load32(&plan.shuffle[t]))
            }

            /// The 16-bit states of group `t`'s eight positions: the [`windows`] shifted left
            /// per lane, then right by 16.
            ///
            /// # Safety
            /// `tile` must be readable up to `plan.reach` bytes.
            #[target_feature(enable = $features)]
            #[inline]
            pub(super) unsafe fn states(plan: &RatePlan, tile: *const u8, t: usize) -> __m256i {
                // SAFETY: as the caller promised.
                let windows = unsafe { windows(plan, tile, t) };
                // The shifts are below 8; saying they are below 32 lets the compiler drop the
                // out-of-range select the intrinsic otherwise carries.
                let shift = _mm256_and_si256(load8i(&plan.shift[t]), _mm256_set1_epi32(31));
                _mm256_srli_epi32::<16>(_mm256_sllv_epi32(windows, shift))
            }

            /// [`states`] for the lane: the windows shifted right per lane, then masked, so
            /// that one of a group's ops can issue on the port the lane's shifts, multiply and
            /// madds leave free (the lane 1.12x as fast on an Intel Xeon; the exact decoder,
            /// whose conversions use that port, 5% slower with it).
            ///
            /// # Safety
            /// `tile` must be readable up to `plan.reach` bytes.
            #[target_feature(enable = $features)]
            #[inline]
            pub(super) unsafe fn states_low(plan: &RatePlan, tile: *const u8, t: usize) -> __m256i {
                // SAFETY: as the caller promised.
                let windows = unsafe { windows(plan, tile, t) };
                // 9 to 16, said to be below 32 as in `states`.
                let shift = _mm256_and_si256(load8i(&plan.rshift[t]), _mm256_set1_epi32(31));
                _mm256_and_si256(_mm256_srlv_epi32(windows, shift), _mm256_set1_epi32(0xFFFF))
            }

            /// The codebook `CB`'s weights of eight states, as `trellis::decode_state` computes
            /// them; mul1's divided by [`MUL1_VALUE_SCALE`].
            #[target_feature(enable = $features)]
            #[inline]
            pub(super) fn values<const CB: u8>(state: __m256i, c: &Consts) -> __m256 {
                let exact = if CB == Codebook::Mul1 as u8 {
                    let y = _mm256_mullo_epi32(state, c.mul);
                    let sum = _mm256_cvtepi32_ps($byte_sum(y, c));
                    // (MUL1_SCALE * sum - MUL1_OFFSET) / 16 in one exact FMA: the value
                    // over MUL1_VALUE_SCALE, still a normal f16 after rounding, so the
                    // rounding below is the value's own scaled by a power of two.
                    _mm256_fmadd_ps(sum, c.scale, c.offset)
                } else {
                    let y = _mm256_mullo_epi32(state, c.mul);
                    let y = if CB == Codebook::Mcg as u8 {
                        y
                    } else {
                        _mm256_add_epi32(y, c.add)
                    };
                    let y = _mm256_xor_si256(_mm256_and_si256(y, c.mask), c.flip);
                    // Both halves of each lane to f32 (lanes 0-3, then 4-7, each as a
                    // (low, high) pair), the pairs summed exactly: lanes in the order of
                    // `lane_positions`.
                    let first = _mm256_cvtph_ps(_mm256_castsi256_si128(y));
                    let second = _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(y));
                    _mm256_hadd_ps(first, second)
                };
                _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(exact))
            }

            /// The values of eight states (in their order), scaled back (for the tests).
            #[cfg(test)]
            #[target_feature(enable = $features)]
            pub(super) fn decode_states(cb: Codebook, states: &[u32; 8]) -> [f32; 8] {
                // SAFETY: `states` is 32 readable bytes; loadu has no alignment requirement.
                let v = unsafe { _mm256_loadu_si256(states.as_ptr().cast()) };
                let c = Consts::of(cb);
                let (v, scale) = match cb {
                    Codebook::Inst3 => (values::<0>(v, &c), 1.0),
                    Codebook::Mcg => (values::<1>(v, &c), 1.0),
                    Codebook::Mul1 => (values::<2>(v, &c), MUL1_VALUE_SCALE),
                };
                let lanes = to_array(v);
                let mut out = [0f32; 8];
                for (lane, j) in lane_positions(cb).into_iter().enumerate() {
                    out[j] = lanes[lane] * scale;
                }
                out
            }

            /// Group `t`'s eight states in the stored `tile` (for the tests).
            #[cfg(test)]
            #[target_feature(enable = $features)]
            pub(super) fn group_states(plan: &RatePlan, tile: &[u8], t: usize) -> [u32; 8] {
                assert!(tile.len() >= plan.reach);
                // SAFETY: asserted that `tile` reaches `plan.reach`.
                let v = unsafe { states(plan, tile.as_ptr(), t) };
                let mut out = [0u32; 8];
                // SAFETY: `out` is 32 writable bytes; storeu has no alignment requirement.
                unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), v) };
                out
            }
        }
    };
}

kernel!(avx2, "avx2,fma,f16c", byte_sum_avx2, madd_add_avx2);
// The lane's multiply-add stays `madd` + `add` here too: `vpdpwssd` would fuse them, but no
// machine this was built on has AVX-512 VNNI to prove it on.
kernel!(
    avx512,
    "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
    byte_sum_vnni,
    madd_add_avx2
);

/// `acc + madd(a, b)`: each i32 lane plus its two 16-bit pairs' products.
#[target_feature(enable = "avx2")]
#[inline]
fn madd_add_avx2(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
    _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
}

/// One strip of the CPU lane's mul1 product on the given instruction set, which the CPU must
/// have (see [`super::lane`]).
pub(super) fn lane_strip(
    isa: Isa,
    rate: Rate,
    tiles: TileColumn,
    input: &super::lane::LaneInput,
    xa: &[i16],
    out: &mut [f32],
) {
    assert!(isa.supported(), "{isa:?} on this CPU");
    let plan = RatePlan::of(rate);
    // SAFETY: asserted above that the CPU has the instruction set's features.
    unsafe {
        match isa {
            Isa::Avx2 => avx2::lane_strip(plan, tiles, xa, &input.scales, input.sum, out),
            Isa::Avx512Vnni => avx512::lane_strip(plan, tiles, xa, &input.scales, input.sum, out),
        }
    }
}

/// The codebook's constants as vectors.
#[derive(Clone, Copy)]
struct Consts {
    mul: __m256i,
    add: __m256i,
    mask: __m256i,
    flip: __m256i,
    ones8: __m256i,
    ones16: __m256i,
    scale: __m256,
    offset: __m256,
}

impl Consts {
    /// For codebook `cb`.
    #[target_feature(enable = "avx2")]
    fn of(cb: Codebook) -> Consts {
        let mul = match cb {
            Codebook::Mul1 => MUL1_MUL,
            Codebook::Mcg => MCG_MUL,
            Codebook::Inst3 => INST3_MUL,
        };
        Consts {
            mul: _mm256_set1_epi32(mul as i32),
            add: _mm256_set1_epi32(INST3_ADD as i32),
            mask: _mm256_set1_epi32(HALVES_MASK as i32),
            flip: _mm256_set1_epi32(HALVES_XOR as i32),
            ones8: _mm256_set1_epi8(1),
            ones16: _mm256_set1_epi16(1),
            scale: _mm256_set1_ps(MUL1_SCALE as f32 / 16.0),
            offset: _mm256_set1_ps(-(MUL1_OFFSET as f32) / 16.0),
        }
    }
}

/// The sum of each 32-bit lane's four bytes: byte pairs to i16, then i16 pairs to i32.
#[target_feature(enable = "avx2")]
#[inline]
fn byte_sum_avx2(y: __m256i, c: &Consts) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(y, c.ones8), c.ones16)
}

/// As [`byte_sum_avx2`], in one dot-product instruction.
#[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
#[inline]
fn byte_sum_vnni(y: __m256i, c: &Consts) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), y, c.ones8)
}

/// The stored `tile` decoded into `[row * 16 + column]` order by this kernel's decoder (the
/// tests hold it to the portable decoder bit for bit).
/// [`decode_states`] on the given instruction set.
#[cfg(test)]
pub(super) fn decode_states(isa: Isa, cb: Codebook, states: &[u32; 8]) -> [f32; 8] {
    assert!(isa.supported(), "{isa:?} on this CPU");
    // SAFETY: asserted above that the CPU has the instruction set's features.
    unsafe {
        match isa {
            Isa::Avx2 => avx2::decode_states(cb, states),
            Isa::Avx512Vnni => avx512::decode_states(cb, states),
        }
    }
}

#[cfg(test)]
pub(super) fn decode_tile(isa: Isa, rate: Rate, cb: Codebook, tile: &[u8]) -> [f32; 256] {
    assert!(isa.supported(), "{isa:?} on this CPU");
    let plan = RatePlan::of(rate);
    let mut out = [0f32; 256];
    for t in 0..32 {
        // SAFETY: asserted above that the CPU has the instruction set's features.
        let states = unsafe {
            match isa {
                Isa::Avx2 => avx2::group_states(plan, tile, t),
                Isa::Avx512Vnni => avx512::group_states(plan, tile, t),
            }
        };
        let v = decode_states(isa, cb, &states);
        for (j, (dr, dc)) in GROUP_OFFSETS.into_iter().enumerate() {
            out[(2 * (t % 4) + dr) * 16 + t / 4 + dc] = v[j];
        }
    }
    out
}
