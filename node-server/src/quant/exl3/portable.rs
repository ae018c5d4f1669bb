//! The portable product kernel: each tile decoded through the codebook's lookup table into
//! its natural 16x16 order, then multiplied into every row's 16 partial sums.

use super::trellis::{TILE_VALUES, decode_tile};
use super::{Codebook, Rate, TileColumn};

/// `out[row, c] = sum over tiles kt, r of xr[row, 16 kt + r] * tile_kt[r, c]` for one strip of
/// 16 output columns; `xr` is `[rows, K]`, `out` `[rows, 16]`.
pub(super) fn strip(
    rate: Rate,
    cb: Codebook,
    tiles: TileColumn,
    xr: &[f32],
    rows: usize,
    out: &mut [f32],
) {
    out.fill(0.0);
    let k = xr.len() / rows;
    let mut tile = [0f32; TILE_VALUES];
    for kt in 0..tiles.tiles {
        decode_tile(rate, cb, tiles.tile(kt), &mut tile);
        for (x, acc) in xr.chunks_exact(k).zip(out.chunks_exact_mut(16)) {
            for (xv, w) in x[16 * kt..16 * kt + 16].iter().zip(tile.chunks_exact(16)) {
                for (a, wv) in acc.iter_mut().zip(w) {
                    *a += xv * wv;
                }
            }
        }
    }
}
