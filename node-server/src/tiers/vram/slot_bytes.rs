//! An expert's bytes as a VRAM slot holds them ([`MoeLayout::pieces`]), and the expert rebuilt
//! from those bytes: what copying a device victim down to RAM needs, so that the RAM tier
//! need not keep a host copy of every device resident (issue 17, item 4).

use super::layout_of;
use crate::backend::cpu::Matrix;
use crate::backend::cuda::{Exl3Form, MoeLayout, SlotFormat};
use crate::model::mlp::SwiGlu;
use crate::quant::exl3::Exl3Linear;
use anyhow::{Context, bail};
use std::borrow::Cow;

/// The pieces [`crate::backend::cuda::SlotArena::write`] takes for `expert`, in
/// [`MoeLayout::pieces`] order: gate, up and down as their rows; or per EXL3 matrix its trellis
/// in the checkpoint's order (the CPU keeps its own), then `suh` and `svh` as f32.
pub fn slot_pieces(expert: &SwiGlu) -> anyhow::Result<Vec<Cow<'_, [u8]>>> {
    let matrices = [&expert.gate, &expert.up, &expert.down];
    if let SlotFormat::Exl3 { .. } = layout_of(expert)?.format {
        let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        return Ok(matrices
            .iter()
            .filter_map(|m| m.exl3())
            .flat_map(|lin| [lin.checkpoint_trellis(), f32s(lin.suh()), f32s(lin.svh())])
            .map(Cow::Owned)
            .collect());
    }
    matrices
        .iter()
        .map(|m| {
            m.as_bytes()
                .with_context(|| format!("{m:?} has no row bytes"))
        })
        .collect()
}

/// The expert whose slot (laid out as `layout`) holds `slot`: the same matrices, bit for bit,
/// as the expert [`slot_pieces`] took them from.
pub fn expert_from_slot(layout: &MoeLayout, slot: &[u8], limit: f32) -> anyhow::Result<SwiGlu> {
    let pieces = layout.pieces();
    let end = pieces.iter().map(|(o, l)| o + l).max().unwrap_or(0);
    if slot.len() < end {
        bail!(
            "a slot of {} bytes; its layout reaches byte {end}",
            slot.len()
        );
    }
    let piece = |i: usize| {
        let (offset, len) = pieces[i];
        &slot[offset..offset + len]
    };
    let (h, i) = (layout.hidden, layout.inter);
    // (rows, cols) of gate, up and down (`y = W x`).
    let shapes = [(i, h), (i, h), (h, i)];
    let matrices: Vec<Matrix> = match layout.format {
        SlotFormat::Rows { gate_up, down } => shapes
            .iter()
            .zip([gate_up, gate_up, down])
            .enumerate()
            .map(|(m, (&(rows, cols), format))| {
                Ok(Matrix::from_bytes(
                    rows,
                    cols,
                    format,
                    super::super::source::page_padded(piece(m)),
                )?)
            })
            .collect::<anyhow::Result<_>>()?,
        SlotFormat::Exl3 { gate_up, down } => shapes
            .iter()
            .zip([gate_up, gate_up, down])
            .enumerate()
            .map(|(m, (&(rows, cols), form))| {
                let lin = exl3_from_pieces(
                    [piece(3 * m), piece(3 * m + 1), piece(3 * m + 2)],
                    cols,
                    rows,
                    form,
                )
                .with_context(|| format!("matrix {m} of the slot"))?;
                Ok(Matrix::from_exl3(lin))
            })
            .collect::<anyhow::Result<_>>()?,
    };
    let [gate, up, down]: [Matrix; 3] = matrices.try_into().expect("three matrices");
    Ok(SwiGlu {
        gate,
        up,
        down,
        limit,
    })
}

/// An EXL3 linear of `k` inputs and `n` outputs from its slot pieces (trellis, then `suh` and
/// `svh` as f32), through its stored form (trellis, f16 `suh`, f16 `svh`): the scales came
/// from f16, so each f32 is an f16 value exactly (checked).
fn exl3_from_pieces(
    [trellis, suh, svh]: [&[u8]; 3],
    k: usize,
    n: usize,
    form: Exl3Form,
) -> anyhow::Result<Exl3Linear> {
    let mut stored = Vec::with_capacity(trellis.len() + suh.len() / 2 + svh.len() / 2);
    stored.extend_from_slice(trellis);
    for scales in [suh, svh] {
        for v in scales.chunks_exact(4) {
            let v = f32::from_le_bytes(v.try_into().expect("four bytes"));
            let h = half::f16::from_f32(v);
            if h.to_f32().to_bits() != v.to_bits() {
                bail!("a scale {v} is not an f16 value: the slot does not hold an EXL3 expert");
            }
            stored.extend_from_slice(&h.to_le_bytes());
        }
    }
    Ok(Exl3Linear::from_stored(
        k,
        n,
        form.rate,
        form.codebook,
        &stored,
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::Format;
    use crate::quant::exl3::{Codebook, Rate};
    use crate::store::{PartFormat, random_record, record_parts};

    /// A random expert of `format` (hidden 256, width 256), as the store's records build it.
    fn expert(format: PartFormat, seed: u64) -> SwiGlu {
        let parts = record_parts(256, 256, format).unwrap();
        let mut bytes = vec![0u8; parts.length()];
        random_record(&parts, seed, 3, &mut bytes);
        crate::tiers::source::expert_from_bytes(&parts, &bytes, 7.0).unwrap()
    }

    /// The slot's bytes as the arena lays them out (zeros between the pieces).
    fn slot_of(e: &SwiGlu) -> (MoeLayout, Vec<u8>) {
        let layout = layout_of(e).unwrap();
        let mut slot = vec![0u8; layout.slot_bytes];
        for ((offset, len), piece) in layout.pieces().into_iter().zip(slot_pieces(e).unwrap()) {
            assert_eq!(piece.len(), len);
            slot[offset..offset + len].copy_from_slice(&piece);
        }
        (layout, slot)
    }

    /// Every row format and EXL3 rate/codebook tried: the expert rebuilt from its slot has the
    /// same bytes in every matrix and the same products, bit for bit.
    #[test]
    fn an_expert_comes_back_from_its_slot_bit_for_bit() {
        let mut formats: Vec<PartFormat> = [Format::Q4K, Format::Q8_0, Format::Bf16, Format::F32]
            .into_iter()
            .map(PartFormat::Rows)
            .collect();
        for (bits, codebook) in [
            (3.0, Codebook::Mul1),
            (2.5, Codebook::Mul1),
            (4.0, Codebook::Mcg),
            (2.0, Codebook::Inst3),
        ] {
            let rate = Rate::from_bits(bits).unwrap();
            formats.push(PartFormat::Exl3 { rate, codebook });
        }
        let x: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0)
            .collect();
        for (n, format) in formats.into_iter().enumerate() {
            let e = expert(format, 11 + n as u64);
            let (layout, slot) = slot_of(&e);
            let back = expert_from_slot(&layout, &slot, e.limit).unwrap();
            assert_eq!(layout_of(&back).unwrap(), layout, "{format:?}");
            let again: Vec<Vec<u8>> = slot_pieces(&back)
                .unwrap()
                .into_iter()
                .map(Cow::into_owned)
                .collect();
            let first: Vec<Vec<u8>> = slot_pieces(&e)
                .unwrap()
                .into_iter()
                .map(Cow::into_owned)
                .collect();
            assert_eq!(again, first, "{format:?}: the slot's pieces");
            assert_eq!(
                back.forward(&x, 1),
                e.forward(&x, 1),
                "{format:?}: products"
            );
            assert_eq!(
                back.forward_lane(&x),
                e.forward_lane(&x),
                "{format:?}: the lane"
            );
        }
    }

    /// A slot too short for its layout, or holding scales that are not f16 values, is refused.
    #[test]
    fn a_slot_that_is_not_an_expert_is_refused() {
        let rate = Rate::from_bits(3.0).unwrap();
        let e = expert(
            PartFormat::Exl3 {
                rate,
                codebook: Codebook::Mul1,
            },
            5,
        );
        let (layout, mut slot) = slot_of(&e);
        let err = expert_from_slot(&layout, &slot[..100], e.limit)
            .err()
            .expect("refused");
        assert!(err.to_string().contains("reaches byte"), "{err}");
        let (suh, _) = layout.pieces()[1];
        slot[suh..suh + 4].copy_from_slice(&1.0e-9f32.to_le_bytes());
        let err = expert_from_slot(&layout, &slot, e.limit)
            .err()
            .expect("refused");
        let err = format!("{err:#}");
        assert!(err.contains("not an f16 value"), "{err}");
    }
}
