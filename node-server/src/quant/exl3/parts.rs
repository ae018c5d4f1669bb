//! An EXL3 layer checked before its trellis is laid out, so the trellis can be laid out in
//! memory of the caller's (a slot of the RAM tier's pinned arena) instead of a buffer of its own.

use super::*;

/// An EXL3 layer checked, with its scales, but not yet its trellis as laid out here: lay it
/// out into memory of the caller's ([`Exl3Parts::lay_out`], e.g. a slot of the RAM tier's
/// pinned arena), then [`Exl3Parts::with_stream`].
pub struct Exl3Parts {
    pub(super) k: usize,
    pub(super) n: usize,
    pub(super) rate: Rate,
    pub(super) codebook: Codebook,
    pub(super) suh: Vec<f32>,
    pub(super) svh: Vec<f32>,
}

impl Exl3Parts {
    /// Checks a layer of trellis `shape` (`[K/16, N/16, 16 * bits]`, `trellis_len` bytes) with
    /// its scales `suh` (`K`) and `svh` (`N`).
    pub fn checked(
        shape: &[usize],
        trellis_len: usize,
        suh: Vec<f32>,
        svh: Vec<f32>,
        codebook: Codebook,
    ) -> Result<Exl3Parts, Exl3Error> {
        let shape_err = |reason: String| Exl3Error::Shape {
            shape: shape.to_vec(),
            reason,
        };
        let &[kt, nt, len] = shape else {
            return Err(shape_err(
                "expected 3 dimensions [K/16, N/16, 16*bits]".into(),
            ));
        };
        let rate = Rate::from_tile_len(len)?;
        if rate.is_half() && codebook != Codebook::Mul1 {
            return Err(Exl3Error::HalfRateCodebook { rate, codebook });
        }
        let block_tiles = hadamard::BLOCK / 16;
        if kt == 0 || nt == 0 || !kt.is_multiple_of(block_tiles) || !nt.is_multiple_of(block_tiles)
        {
            return Err(shape_err(format!(
                "K = {} and N = {} must be positive multiples of {}",
                16 * kt,
                16 * nt,
                hadamard::BLOCK
            )));
        }
        let values = kt
            .checked_mul(nt)
            .and_then(|t| t.checked_mul(len))
            .ok_or_else(|| shape_err("too large".into()))?;
        if trellis_len != 2 * values {
            return Err(Exl3Error::Length {
                what: "trellis",
                unit: "bytes",
                expected: 2 * values,
                got: trellis_len,
            });
        }
        let (k, n) = (16 * kt, 16 * nt);
        for (what, got, expected) in [("suh", suh.len(), k), ("svh", svh.len(), n)] {
            if got != expected {
                return Err(Exl3Error::Length {
                    what,
                    unit: "values",
                    expected,
                    got,
                });
            }
        }
        Ok(Exl3Parts {
            k,
            n,
            rate,
            codebook,
            suh,
            svh,
        })
    }

    /// The layer in `bytes` as a checkpoint stores it (see [`Exl3Linear::from_stored`]),
    /// checked, and its trellis's bytes.
    pub fn stored(
        k: usize,
        n: usize,
        rate: Rate,
        codebook: Codebook,
        bytes: &[u8],
    ) -> Result<(Exl3Parts, &[u8]), Exl3Error> {
        let trellis = rate.trellis_bytes(k, n);
        let expected = Exl3Linear::stored_len(k, n, rate);
        if bytes.len() != expected {
            return Err(Exl3Error::Length {
                what: "stored layer",
                unit: "bytes",
                expected,
                got: bytes.len(),
            });
        }
        let f16s = |b: &[u8]| {
            let mut v = vec![0f32; b.len() / 2];
            crate::quant::dequantize_row(crate::quant::Format::F16, b, &mut v)
                .expect("two bytes a value");
            v
        };
        let (trellis, scales) = bytes.split_at(trellis);
        let (suh, svh) = scales.split_at(2 * k);
        let shape = [k / 16, n / 16, rate.tile_words()];
        let parts = Exl3Parts::checked(&shape, trellis.len(), f16s(suh), f16s(svh), codebook)?;
        Ok((parts, trellis))
    }

    /// Bytes of the trellis as laid out here ([`Exl3Linear::stream_len`]).
    pub fn stream_len(&self) -> usize {
        Exl3Linear::stream_len(self.k, self.n, self.rate)
    }

    /// Writes the checked trellis (as the checkpoint stores it) into `out`
    /// ([`Exl3Parts::stream_len`] bytes), laid out strip by strip.
    pub fn lay_out(&self, trellis: &[u8], out: &mut [u8]) {
        let (kt, nt, len) = (self.k / 16, self.n / 16, self.rate.tile_words());
        assert_eq!(out.len(), self.stream_len(), "lay_out: the stream's length");
        let tile_bytes = self.rate.tile_bytes();
        // Written in order, each strip's tiles read a row of tiles apart.
        let (tiles, tail) = out.split_at_mut(kt * nt * tile_bytes);
        for (i, o) in tiles.chunks_exact_mut(tile_bytes).enumerate() {
            let at = ((i % kt) * nt + i / kt) * 2 * len;
            trellis::store_tile(&trellis[at..at + 2 * len], o);
        }
        tail.fill(0);
    }

    /// The layer, its trellis laid out in `stream` ([`Exl3Parts::lay_out`]).
    pub fn with_stream(self, stream: crate::quant::Bytes) -> Exl3Linear {
        assert_eq!(
            stream.len(),
            self.stream_len(),
            "with_stream: the stream's length"
        );
        Exl3Linear {
            k: self.k,
            n: self.n,
            rate: self.rate,
            codebook: self.codebook,
            stream,
            suh: self.suh,
            svh: self.svh,
            bias: None,
        }
    }
}
