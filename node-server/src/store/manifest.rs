//! `experts.json`: what `experts.bin` holds, and the fingerprints binding it to a model.
//!
//! Two fingerprints, both lowercase hex sha256:
//! * `fingerprint` (full): over the tag `glmflash-model-fingerprint-v1`, the bytes of
//!   `config.json`, then for every tensor in sorted key order its key, dtype, shape and the
//!   sha256 of its bytes. `pack-store` computes it within its one pass over the source:
//!   expert tensors are hashed as their records are packed (the bytes are hot then), the
//!   other tensors up front, on all cores.
//!   `verify-store --model` recomputes it (one read of the model, hashed on all cores).
//! * `quick_fingerprint`: the same walk, but only non-expert tensors contribute content
//!   hashes (expert tensors contribute key, dtype and shape). It costs a read of the
//!   non-expert weights only (a few percent of an MoE model), so `pack-store` reruns use it
//!   to recognise their own partial or complete store before writing anything.

use super::StoreError;
use crate::model::checkpoint::{Checkpoint, TensorView};
use crate::model::config::{Config, MlpKind};
use crate::quant::Format;
use crate::quant::exl3::{Codebook, Exl3Linear, Rate};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::Path;

pub const FORMAT_VERSION: u32 = 1;
pub const MANIFEST: &str = "experts.json";
pub const DATA: &str = "experts.bin";
pub const JOURNAL: &str = "experts.json.partial";

/// How one weight of a record is encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PartFormat {
    /// `rows` rows in a row format, concatenated (`Matrix::to_bytes`).
    Rows(Format),
    /// An EXL3 linear of `cols` inputs and `rows` outputs exactly as its checkpoint stores
    /// it: the trellis (int16 `[cols/16, rows/16, 16 * bits]`), then the f16 `suh` (`cols`)
    /// and `svh` (`rows`). The codebook marker tensors are empty: the manifest names the
    /// codebook, the rate follows from the length.
    Exl3 { rate: Rate, codebook: Codebook },
}

impl PartFormat {
    /// `q4_k`, ..., or `exl3` followed by its rate and codebook (`exl3 3 bpw mul1`).
    pub fn describe(self) -> String {
        match self {
            PartFormat::Rows(f) => f.name().to_string(),
            PartFormat::Exl3 { rate, codebook } => format!("exl3 {rate} bpw {codebook}"),
        }
    }
}

/// Where one weight sits inside a record. In the manifest: `"format"` is a row format's
/// name or `"exl3"`, which adds `"bits"` and `"codebook"`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "PartJson", into = "PartJson")]
pub struct Part {
    pub format: PartFormat,
    pub rows: usize,
    pub cols: usize,
    /// Byte offset inside the record.
    pub offset: usize,
    pub length: usize,
}

#[derive(Serialize, Deserialize)]
struct PartJson {
    format: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    bits: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    codebook: Option<String>,
    rows: usize,
    cols: usize,
    offset: usize,
    length: usize,
}

impl TryFrom<PartJson> for Part {
    type Error = String;

    fn try_from(j: PartJson) -> Result<Part, String> {
        let format = if j.format == "exl3" {
            let (Some(bits), Some(codebook)) = (j.bits, j.codebook) else {
                return Err("an exl3 part needs `bits` and `codebook`".into());
            };
            PartFormat::Exl3 {
                rate: Rate::from_bits(bits).map_err(|e| e.to_string())?,
                codebook: Codebook::from_name(&codebook).map_err(|e| e.to_string())?,
            }
        } else {
            PartFormat::Rows(Format::from_name(&j.format).map_err(|e| e.to_string())?)
        };
        Ok(Part {
            format,
            rows: j.rows,
            cols: j.cols,
            offset: j.offset,
            length: j.length,
        })
    }
}

impl From<Part> for PartJson {
    fn from(p: Part) -> PartJson {
        let (format, bits, codebook) = match p.format {
            PartFormat::Rows(f) => (f.name().to_string(), None, None),
            PartFormat::Exl3 { rate, codebook } => (
                "exl3".to_string(),
                Some(rate.bits()),
                Some(codebook.name().to_string()),
            ),
        };
        PartJson {
            format,
            bits,
            codebook,
            rows: p.rows,
            cols: p.cols,
            offset: p.offset,
            length: p.length,
        }
    }
}

impl Part {
    /// Bytes a weight of this part's shape takes in its format.
    pub fn expected_length(&self) -> Result<usize, String> {
        match self.format {
            PartFormat::Rows(f) => f
                .row_bytes(self.cols)
                .map(|b| b * self.rows)
                .map_err(|e| e.to_string()),
            PartFormat::Exl3 { rate, .. } => Ok(Exl3Linear::stored_len(self.cols, self.rows, rate)),
        }
    }
}

/// Gate, up and down, in record order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Parts {
    pub gate: Part,
    pub up: Part,
    pub down: Part,
}

impl Parts {
    pub fn all(&self) -> [&Part; 3] {
        [&self.gate, &self.up, &self.down]
    }

    /// Unpadded bytes of one record.
    pub fn length(&self) -> usize {
        self.down.offset + self.down.length
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordEntry {
    pub layer: usize,
    pub expert: usize,
    /// Byte offset in `experts.bin` (a multiple of `alignment`).
    pub offset: u64,
    /// Unpadded length; the rest of the record up to `record_size` is zeros.
    pub length: usize,
    pub sha256: String,
    /// CRC-32C (Castagnoli) of the unpadded bytes: the check every read makes (about ten
    /// times as fast as sha256 on one core; see [`super::reader::RecordCheck`]). Stores
    /// packed before it was written have none, and their reads check sha256.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crc32c: Option<u32>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format_version: u32,
    pub fingerprint: String,
    pub quick_fingerprint: String,
    pub record_size: usize,
    pub alignment: usize,
    /// Experts per MoE layer.
    pub experts_per_layer: usize,
    /// The MoE layers, ascending.
    pub layers: Vec<usize>,
    /// The records' layout (of the first MoE layer, and of every layer not in `layer_parts`).
    pub parts: Parts,
    /// MoE layers whose records are laid out otherwise: an EXL3 checkpoint may hold some
    /// layers' experts at another rate. `record_size` fits the largest layout.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub layer_parts: BTreeMap<usize, Parts>,
    /// In (layer, expert) order; record `i` is at `i * record_size`.
    pub records: Vec<RecordEntry>,
}

impl Manifest {
    pub fn load(store: &Path) -> Result<Manifest, StoreError> {
        let path = store.join(MANIFEST);
        let text = std::fs::read_to_string(&path).map_err(|source| StoreError::Io {
            path: path.display().to_string(),
            source,
        })?;
        let m: Manifest = serde_json::from_str(&text).map_err(|e| StoreError::Manifest {
            path: path.display().to_string(),
            message: format!("not a valid store manifest: {e}"),
        })?;
        m.check().map_err(|message| StoreError::Manifest {
            path: path.display().to_string(),
            message,
        })?;
        Ok(m)
    }

    fn check(&self) -> Result<(), String> {
        if self.format_version != FORMAT_VERSION {
            return Err(format!(
                "format version {} (this build reads version {FORMAT_VERSION}); rerun pack-store",
                self.format_version
            ));
        }
        if self.alignment != super::ALIGN || !self.record_size.is_multiple_of(self.alignment) {
            return Err(format!(
                "record size {} / alignment {} are not 4 KiB-aligned",
                self.record_size, self.alignment
            ));
        }
        for (&layer, parts) in &self.layer_parts {
            if self.layers.binary_search(&layer).is_err() {
                return Err(format!(
                    "layer_parts names layer {layer}, which is no MoE layer"
                ));
            }
            check_parts(parts, self.record_size).map_err(|e| format!("layer {layer}: {e}"))?;
        }
        check_parts(&self.parts, self.record_size)?;
        if self.experts_per_layer == 0
            || self.records.len() != self.layers.len() * self.experts_per_layer
        {
            return Err("record count is not layers x experts".into());
        }
        for (i, r) in self.records.iter().enumerate() {
            let key = (
                self.layers[i / self.experts_per_layer],
                i % self.experts_per_layer,
            );
            if (r.layer, r.expert) != key {
                return Err(format!(
                    "record {i} is layer {}, expert {}; the (layer, expert) order puts layer {}, expert {} there",
                    r.layer, r.expert, key.0, key.1
                ));
            }
            let length = self.parts_of(r.layer).length();
            if r.offset != (i * self.record_size) as u64 || r.length != length {
                return Err(format!(
                    "record {i} (layer {}, expert {}) has offset {} / length {}, expected {} / {}",
                    r.layer,
                    r.expert,
                    r.offset,
                    r.length,
                    i * self.record_size,
                    length
                ));
            }
        }
        Ok(())
    }

    /// The layout of `layer`'s records.
    pub fn parts_of(&self, layer: usize) -> &Parts {
        self.layer_parts.get(&layer).unwrap_or(&self.parts)
    }

    /// Index of `(layer, expert)`'s record.
    pub fn index(&self, layer: usize, expert: usize) -> Option<usize> {
        if expert >= self.experts_per_layer {
            return None;
        }
        let l = self.layers.binary_search(&layer).ok()?;
        Some(l * self.experts_per_layer + expert)
    }

    pub fn data_bytes(&self) -> u64 {
        (self.records.len() * self.record_size) as u64
    }
}

/// Each part's length fits its format and shape, and the record fits `record_size`.
fn check_parts(parts: &Parts, record_size: usize) -> Result<(), String> {
    for (name, p) in ["gate", "up", "down"].into_iter().zip(parts.all()) {
        let expected = p.expected_length()?;
        if p.length != expected {
            return Err(format!(
                "{name} part ({}x{} {}) is {} bytes, its format needs {expected}",
                p.rows,
                p.cols,
                p.format.describe(),
                p.length
            ));
        }
    }
    if parts.length() > record_size {
        return Err("parts run past the record size".into());
    }
    Ok(())
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// The CRC-32C of `bytes` (SSE 4.2's `crc32` instruction where the CPU has it).
pub fn crc32c(bytes: &[u8]) -> u32 {
    ::crc32c::crc32c(bytes)
}

/// The MoE layers of `cfg`, ascending.
pub fn moe_layers(cfg: &Config) -> Vec<usize> {
    (0..cfg.num_hidden_layers)
        .filter(|&l| cfg.mlp_kinds[l] == MlpKind::Moe)
        .collect()
}

/// Which record's source a checkpoint key belongs to: `(layer, expert)` for per-expert keys
/// (`...layers.3.mlp.experts.7.up_proj.weight`), `(layer, 0)` for fused ones
/// (`...layers.3.mlp.experts.gate_up_proj`), `None` for non-expert tensors.
pub fn expert_owner(key: &str, moe: &[usize]) -> Option<(usize, usize)> {
    let at = key.find("layers.")?;
    let rest = &key[at + "layers.".len()..];
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let rest = rest.strip_prefix("mlp.experts.")?;
    if moe.binary_search(&layer).is_err() {
        return None;
    }
    let expert = rest
        .split_once('.')
        .and_then(|(e, _)| e.parse().ok())
        .unwrap_or(0);
    Some((layer, expert))
}

/// Sha256 hex of every tensor whose key passes `want`, hashed in parallel.
pub fn tensor_hashes(
    ckpt: &Checkpoint,
    want: impl Fn(&str) -> bool + Sync,
) -> Result<BTreeMap<String, String>, StoreError> {
    ckpt.keys()
        .into_par_iter()
        .filter(|k| want(k))
        .map(|k| Ok((k.to_string(), sha256_hex(raw_view(ckpt, k)?.bytes))))
        .collect()
}

/// A tensor by its on-disk key.
pub fn raw_view<'a>(ckpt: &'a Checkpoint, key: &str) -> Result<TensorView<'a>, StoreError> {
    Ok(ckpt.view(key)?)
}

/// Fingerprint from `config.json`'s bytes and a content hash for some tensors: the full
/// fingerprint when `hashes` covers every tensor, the quick one when it covers non-experts.
pub fn fingerprint(
    config_bytes: &[u8],
    ckpt: &Checkpoint,
    hashes: &BTreeMap<String, String>,
    full: bool,
) -> Result<String, StoreError> {
    let mut h = Sha256::new();
    h.update(if full {
        b"glmflash-model-fingerprint-v1\n".as_slice()
    } else {
        b"glmflash-quick-fingerprint-v1\n".as_slice()
    });
    h.update((config_bytes.len() as u64).to_le_bytes());
    h.update(config_bytes);
    for key in ckpt.keys() {
        let view = raw_view(ckpt, key)?;
        let shape: Vec<String> = view.shape.iter().map(usize::to_string).collect();
        h.update(format!(
            "{key}\t{}\t[{}]\t",
            view.dtype.name(),
            shape.join(",")
        ));
        match hashes.get(key) {
            Some(sha) => h.update(sha.as_bytes()),
            None if full => {
                return Err(StoreError::Other(format!(
                    "internal: no content hash for tensor `{key}`"
                )));
            }
            None => h.update(format!("len={}", view.bytes.len())),
        }
        h.update(b"\n");
    }
    Ok(hex(&h.finalize()))
}

/// Quick fingerprint of the model in `dir` (reads only its non-expert tensors).
pub fn quick_fingerprint(dir: &Path) -> Result<String, StoreError> {
    let (config_bytes, cfg, ckpt) = open_model(dir)?;
    let moe = moe_layers(&cfg);
    let hashes = tensor_hashes(&ckpt, |k| expert_owner(k, &moe).is_none())?;
    fingerprint(&config_bytes, &ckpt, &hashes, false)
}

/// Full fingerprint of the model in `dir` (reads every tensor once, on all cores).
pub fn model_fingerprint(dir: &Path) -> Result<String, StoreError> {
    let (config_bytes, _, ckpt) = open_model(dir)?;
    let hashes = tensor_hashes(&ckpt, |_| true)?;
    fingerprint(&config_bytes, &ckpt, &hashes, true)
}

pub fn open_model(dir: &Path) -> Result<(Vec<u8>, Config, Checkpoint), StoreError> {
    let path = dir.join("config.json");
    let config_bytes = std::fs::read(&path).map_err(|source| StoreError::Io {
        path: path.display().to_string(),
        source,
    })?;
    let cfg = Config::from_file(&path).map_err(crate::model::loader::LoadError::from)?;
    let ckpt = Checkpoint::open(dir)?;
    Ok((config_bytes, cfg, ckpt))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Row-format parts read and write as before EXL3 records existed; an exl3 part carries
    /// its rate and codebook, and one without them is refused.
    #[test]
    fn parts_serialize_their_format() {
        let rows = Part {
            format: PartFormat::Rows(Format::Q4K),
            rows: 2,
            cols: 256,
            offset: 0,
            length: 288,
        };
        let json = serde_json::to_value(&rows).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"format": "q4_k", "rows": 2, "cols": 256, "offset": 0, "length": 288})
        );
        assert_eq!(serde_json::from_value::<Part>(json).unwrap(), rows);
        let exl3 = Part {
            format: PartFormat::Exl3 {
                rate: Rate::from_bits(2.5).unwrap(),
                codebook: Codebook::Mul1,
            },
            rows: 128,
            cols: 256,
            offset: 288,
            length: Exl3Linear::stored_len(256, 128, Rate::from_bits(2.5).unwrap()),
        };
        let json = serde_json::to_value(&exl3).unwrap();
        assert_eq!(
            (&json["format"], &json["bits"], &json["codebook"]),
            (&"exl3".into(), &2.5.into(), &"mul1".into())
        );
        assert_eq!(
            exl3.expected_length().unwrap(),
            128 * 256 * 5 / 16 + 2 * (128 + 256)
        );
        assert_eq!(serde_json::from_value::<Part>(json).unwrap(), exl3);
        let bad = serde_json::json!({"format": "exl3", "bits": 3.0, "rows": 128, "cols": 128, "offset": 0, "length": 1});
        let err = serde_json::from_value::<Part>(bad).unwrap_err().to_string();
        assert!(err.contains("needs `bits` and `codebook`"), "{err}");
        let bad = serde_json::json!({"format": "exl3", "bits": 3.3, "codebook": "mul1", "rows": 128, "cols": 128, "offset": 0, "length": 1});
        let err = serde_json::from_value::<Part>(bad).unwrap_err().to_string();
        assert!(err.contains("not an EXL3 rate"), "{err}");
    }

    #[test]
    fn expert_keys_map_to_their_record() {
        let moe = [1, 2];
        let k = "model.language_model.layers.2.mlp.experts.7.up_proj.weight";
        assert_eq!(expert_owner(k, &moe), Some((2, 7)));
        assert_eq!(
            expert_owner("model.layers.1.mlp.experts.gate_up_proj", &moe),
            Some((1, 0))
        );
        assert_eq!(expert_owner("model.layers.0.mlp.experts.3.up", &moe), None);
        assert_eq!(
            expert_owner("model.layers.2.mlp.shared_experts.up_proj.weight", &moe),
            None
        );
        assert_eq!(expert_owner("lm_head.weight", &moe), None);
    }
}
