//! What one record holds: an expert's gate, up and down as bytes of a [`PartFormat`], built
//! from the checkpoint the same way by `pack-store` and by `verify-store`'s comparison.
//!
//! Row formats come from the loaded expert (`Matrix::to_bytes`, converted first when
//! `--format` asks for another row format). EXL3 weights are never decoded here: their
//! trellis, `suh` and `svh` tensors are copied from the checkpoint byte for byte.

use super::StoreError;
use super::manifest::PartFormat;
use crate::backend::cpu::Matrix;
use crate::model::checkpoint::DType;
use crate::model::config::Config;
use crate::model::loader::Loader;
use crate::model::mlp::SwiGlu;
use crate::model::moe::load_expert;
use crate::quant::Format;
use crate::quant::exl3::Rate;

/// The records' weight format `pack-store` is asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordFormat {
    /// A row format, converting the checkpoint's experts to it when they are in another.
    Rows(Format),
    /// An EXL3 checkpoint's experts as they are (trellis, `suh`, `svh`).
    Exl3,
}

impl RecordFormat {
    /// `exl3` or a row format's name (`q4_k`, `q8_0`, `bf16`, `f16`, `f32`).
    pub fn parse(s: &str) -> Result<RecordFormat, String> {
        if s.eq_ignore_ascii_case("exl3") {
            return Ok(RecordFormat::Exl3);
        }
        Format::from_name(s)
            .map(RecordFormat::Rows)
            .map_err(|e| format!("{e}, or exl3"))
    }

    pub fn name(self) -> &'static str {
        match self {
            RecordFormat::Rows(f) => f.name(),
            RecordFormat::Exl3 => "exl3",
        }
    }
}

/// One weight of a record: its format, shape (`rows` outputs x `cols` inputs) and bytes.
pub(super) struct Weight {
    pub format: PartFormat,
    pub rows: usize,
    pub cols: usize,
    pub bytes: Vec<u8>,
}

/// The format records of `experts` (`...layers.L.mlp.experts`) get when `asked` is the
/// `--format`: `None` keeps the checkpoint's, which for EXL3 experts is `exl3`.
pub(super) fn resolve_format(
    cfg: &Config,
    experts: Loader,
    asked: Option<RecordFormat>,
) -> Result<Option<RecordFormat>, StoreError> {
    let is_exl3 = experts
        .pp("0")
        .exl3_tensors(
            "gate_proj.weight",
            cfg.moe_intermediate_size,
            cfg.hidden_size,
        )?
        .is_some();
    match asked {
        None if is_exl3 => Ok(Some(RecordFormat::Exl3)),
        Some(RecordFormat::Exl3) if !is_exl3 => Err(StoreError::Other(
            "--format exl3 keeps an EXL3 checkpoint's experts as they are, but this \
             checkpoint's experts are not EXL3 (glmflash does not quantize to EXL3: convert \
             the checkpoint with exllamav3, or pick q4_k, q8_0 or bf16)"
                .into(),
        )),
        other => Ok(other),
    }
}

/// Expert `e`'s gate, up and down in `format` (see the module doc).
pub(super) fn expert_weights(
    cfg: &Config,
    experts: Loader,
    e: usize,
    format: Option<RecordFormat>,
) -> Result<[Weight; 3], StoreError> {
    match format {
        Some(RecordFormat::Exl3) => exl3_weights(cfg, experts, e),
        Some(RecordFormat::Rows(f)) => row_weights(in_format(load_expert(cfg, experts, e)?, f)?),
        None => row_weights(load_expert(cfg, experts, e)?),
    }
}

fn row_weights(x: SwiGlu) -> Result<[Weight; 3], StoreError> {
    let weight = |m: &Matrix| {
        let (format, bytes) = stored_rows(m)?;
        Ok::<_, StoreError>(Weight {
            format: PartFormat::Rows(format),
            rows: m.rows(),
            cols: m.cols(),
            bytes,
        })
    };
    Ok([weight(&x.gate)?, weight(&x.up)?, weight(&x.down)?])
}

fn exl3_weights(cfg: &Config, experts: Loader, e: usize) -> Result<[Weight; 3], StoreError> {
    let (d, i) = (cfg.hidden_size, cfg.moe_intermediate_size);
    let expert = experts.pp(&e.to_string());
    let weight = |name: &str, rows: usize, cols: usize| {
        let key = expert.name(name);
        let t = expert.exl3_tensors(name, rows, cols)?.ok_or_else(|| {
            StoreError::Other(format!(
                "`{key}` is not an EXL3 layer, but the first expert's gate was: every routed \
                 expert of an EXL3 record store must be EXL3"
            ))
        })?;
        let bad = |why: String| StoreError::Other(format!("`{key}`: {why}"));
        if t.bias.is_some() {
            return Err(bad("an EXL3 expert with a bias has no record layout".into()));
        }
        for (what, dtype) in [("suh", t.suh.dtype), ("svh", t.svh.dtype)] {
            if dtype != DType::F16 {
                return Err(bad(format!(
                    "EXL3 {what} is {}, records keep it as exllamav3 writes it (F16)",
                    dtype.name()
                )));
            }
        }
        let rate = Rate::from_tile_len(t.trellis.shape[2]).map_err(|err| bad(err.to_string()))?;
        let mut bytes = Vec::with_capacity(t.trellis.bytes.len() + 2 * (rows + cols));
        for part in [t.trellis.bytes, t.suh.bytes, t.svh.bytes] {
            bytes.extend_from_slice(part);
        }
        Ok(Weight {
            format: PartFormat::Exl3 {
                rate,
                codebook: t.codebook,
            },
            rows,
            cols,
            bytes,
        })
    };
    Ok([
        weight("gate_proj.weight", i, d)?,
        weight("up_proj.weight", i, d)?,
        weight("down_proj.weight", d, i)?,
    ])
}

/// The expert with every weight in `format` (unchanged where it already is).
fn in_format(x: SwiGlu, format: Format) -> Result<SwiGlu, StoreError> {
    let convert = |m: Matrix, what: &str| {
        if m.format() == Some(format) {
            return Ok(m);
        }
        m.convert(format).map_err(|e| {
            StoreError::Other(format!(
                "converting an expert's {what} ({}x{}) to {}: {e}",
                m.rows(),
                m.cols(),
                format.name()
            ))
        })
    };
    Ok(SwiGlu {
        gate: convert(x.gate, "gate")?,
        up: convert(x.up, "up")?,
        down: convert(x.down, "down")?,
        limit: x.limit,
    })
}

/// The row format and bytes of an expert's matrix; an EXL3 matrix has none (it is packed
/// as `exl3` or converted by a row `--format`).
fn stored_rows(m: &Matrix) -> Result<(Format, Vec<u8>), StoreError> {
    m.format().zip(m.to_bytes()).ok_or_else(|| {
        StoreError::Other(format!(
            "{m:?}: an EXL3 matrix has no row bytes; pack it with --format exl3 or a row format"
        ))
    })
}
