//! `convert-experts`: rewrites a checkpoint with every routed expert's weights in a block
//! format (e.g. q4_k), and with `--dense-format` the other linear weights too (q8_0 or q4_k:
//! what makes a bf16 checkpoint's non-expert weights fit a 24 GB card, and both the CPU and
//! the GPU multiply those formats); every other tensor is left as it is.
//!
//! Output: one safetensors shard per decoder layer plus one for the rest, with
//! `model.safetensors.index.json`; experts always in the original per-expert key layout.
//! A quantized tensor is stored as U8 `[rows, row bytes]` with `format:cols` in the file's
//! metadata (see [`quant_metadata_key`]).

use super::checkpoint::{Checkpoint, DType};
use super::config::{Config, MlpKind};
use super::loader::{Loader, quant_metadata_key};
use super::moe::load_expert;
use crate::backend::cpu::Matrix;
use crate::quant::Format;
use anyhow::{Context, bail};
use std::collections::BTreeMap;
use std::path::Path;

#[derive(Debug, Default)]
pub struct ConvertReport {
    pub experts: usize,
    pub source_bytes: usize,
    pub converted_bytes: usize,
    pub shards: usize,
}

type Tensor = (String, DType, Vec<usize>, Vec<u8>);

/// The non-expert linear weights to quantize, and their format.
pub struct DenseConversion<'a> {
    pub format: Format,
    /// Their names under the checkpoint's text-model prefix (`layers.3.self_attn.o_proj.weight`,
    /// `lm_head.weight`): the memory plan's inventory of linear weights.
    pub linear: &'a std::collections::BTreeSet<String>,
}

/// Converts `src`'s routed experts to `format`, writing a complete checkpoint to `dst`.
pub fn convert_experts(
    src: &Path,
    dst: &Path,
    format: Format,
    progress: impl FnMut(usize, usize),
) -> anyhow::Result<ConvertReport> {
    convert(src, dst, format, None, progress)
}

/// As [`convert_experts`], and with `dense` its non-expert linear weights to that format.
pub fn convert(
    src: &Path,
    dst: &Path,
    format: Format,
    dense: Option<DenseConversion<'_>>,
    mut progress: impl FnMut(usize, usize),
) -> anyhow::Result<ConvertReport> {
    if src.canonicalize().ok() == dst.canonicalize().ok() {
        bail!("--out must differ from --model ({})", src.display());
    }
    let cfg = Config::from_file(&src.join("config.json"))?;
    for (what, cols) in [
        ("hidden_size", cfg.hidden_size),
        ("moe_intermediate_size", cfg.moe_intermediate_size),
    ] {
        if cols % format.block_values() != 0 {
            bail!(
                "{what} is {cols}; {} stores rows in blocks of {} values, so it needs a multiple of {}",
                format.name(),
                format.block_values(),
                format.block_values()
            );
        }
    }
    let ckpt = Checkpoint::open(src)?;
    std::fs::create_dir_all(dst).with_context(|| format!("creating {}", dst.display()))?;
    for entry in std::fs::read_dir(src)? {
        let path = entry?.path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if path.is_file()
            && !name.ends_with(".safetensors")
            && name != "model.safetensors.index.json"
        {
            std::fs::copy(&path, dst.join(name))?;
        }
    }

    let vb = Loader::new(&ckpt);
    let prefix = ckpt_prefix(&ckpt);
    let moe_layer = |l: usize| cfg.mlp_kinds[l] == MlpKind::Moe;
    let is_expert_key = |key: &str| {
        (0..cfg.num_hidden_layers)
            .any(|l| moe_layer(l) && key.contains(&format!("layers.{l}.mlp.experts.")))
    };
    // Non-expert tensors grouped by layer (None: embeddings, final norm, head), one shard each.
    let mut groups: BTreeMap<Option<usize>, Vec<Tensor>> = BTreeMap::new();
    let mut metadata: BTreeMap<Option<usize>, BTreeMap<String, String>> = BTreeMap::new();
    for key in ckpt.keys() {
        if is_expert_key(key) {
            continue;
        }
        let view = ckpt.view(key)?;
        let layer = key
            .split("layers.")
            .nth(1)
            .and_then(|rest| rest.split('.').next())
            .and_then(|n| n.parse::<usize>().ok());
        let relative = key.strip_prefix(prefix.as_str()).unwrap_or(key);
        // A width that is not a block multiple stays as it is (the plan counts it so too).
        if let Some(d) = dense.as_ref().filter(|d| d.linear.contains(relative))
            && let [rows, cols] = view.shape[..]
            && cols.is_multiple_of(d.format.block_values())
        {
            let m = vb.matrix(key, rows, cols)?;
            let bytes = m
                .encode(d.format)
                .with_context(|| format!("quantizing {key} to {}", d.format.name()))?;
            let tensors = groups.entry(layer).or_default();
            let meta = metadata.entry(layer).or_default();
            push_matrix(tensors, meta, key.to_string(), &m, d.format, bytes);
            continue;
        }
        groups.entry(layer).or_default().push((
            key.to_string(),
            view.dtype,
            view.shape.to_vec(),
            view.bytes.to_vec(),
        ));
    }
    for l in (0..cfg.num_hidden_layers).filter(|&l| moe_layer(l)) {
        groups.entry(Some(l)).or_default();
    }

    let total_experts =
        (0..cfg.num_hidden_layers).filter(|&l| moe_layer(l)).count() * cfg.n_routed_experts;
    let shard_count = groups.len();
    let mut report = ConvertReport {
        shards: shard_count,
        ..ConvertReport::default()
    };
    let mut weight_map = serde_json::Map::new();
    for (shard, (group, mut tensors)) in groups.into_iter().enumerate() {
        let mut metadata = metadata.remove(&group).unwrap_or_default();
        if let Some(layer) = group.filter(|&l| moe_layer(l)) {
            let experts = vb.pp(&format!("layers.{layer}.mlp.experts"));
            for e in 0..cfg.n_routed_experts {
                let expert = load_expert(&cfg, experts, e)?;
                for (part, m) in [
                    ("gate_proj", &expert.gate),
                    ("up_proj", &expert.up),
                    ("down_proj", &expert.down),
                ] {
                    let key = format!("{prefix}layers.{layer}.mlp.experts.{e}.{part}.weight");
                    report.source_bytes += m.storage_bytes();
                    let bytes = m
                        .encode(format)
                        .with_context(|| format!("quantizing {key}"))?;
                    report.converted_bytes += bytes.len();
                    push_matrix(&mut tensors, &mut metadata, key, m, format, bytes);
                }
                report.experts += 1;
                progress(report.experts, total_experts);
            }
        }
        let file = format!("model-{:05}-of-{shard_count:05}.safetensors", shard + 1);
        for (k, ..) in &tensors {
            weight_map.insert(k.clone(), file.clone().into());
        }
        super::checkpoint::write_safetensors(&dst.join(&file), &tensors, &metadata)?;
    }
    let mut meta = serde_json::json!({"glmflash.expert_format": format.name()});
    if let Some(d) = &dense {
        meta["glmflash.dense_format"] = d.format.name().into();
    }
    let index = serde_json::json!({"metadata": meta, "weight_map": weight_map});
    std::fs::write(
        dst.join("model.safetensors.index.json"),
        serde_json::to_string_pretty(&index)?,
    )?;
    Ok(report)
}

fn ckpt_prefix(ckpt: &Checkpoint) -> String {
    let embed = ckpt.resolve("embed_tokens.weight").unwrap_or_default();
    embed.trim_end_matches("embed_tokens.weight").to_string()
}

fn push_matrix(
    tensors: &mut Vec<Tensor>,
    metadata: &mut BTreeMap<String, String>,
    key: String,
    m: &Matrix,
    format: Format,
    bytes: Vec<u8>,
) {
    let (dtype, shape) = match format {
        Format::F32 => (DType::F32, vec![m.rows(), m.cols()]),
        Format::F16 => (DType::F16, vec![m.rows(), m.cols()]),
        Format::Bf16 => (DType::Bf16, vec![m.rows(), m.cols()]),
        _ => {
            metadata.insert(
                quant_metadata_key(&key),
                format!("{}:{}", format.name(), m.cols()),
            );
            (
                DType::U8,
                vec![
                    m.rows(),
                    format.row_bytes(m.cols()).expect("converted matrix"),
                ],
            )
        }
    };
    tensors.push((key, dtype, shape, bytes));
}
