//! `config.json` of a glm5_next checkpoint, flat or nested under `text_config`.
//!
//! Every field is read with the reference's default; values this engine does not support are
//! rejected with a message naming the field, so a checkpoint either loads as the reference
//! would run it or not at all.

use crate::quant::exl3::Codebook;
use serde_json::{Map, Value};
use std::path::Path;

/// The attention block of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnKind {
    /// KDA linear attention (`linear_attention`).
    Kda,
    /// MLA with the DSA indexer (`indexed_attention`).
    Mla,
}

/// Whether an MLA layer runs its own DSA indexer or reuses the last full layer's selection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IndexerKind {
    Full,
    Shared,
}

/// The feed-forward block of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlpKind {
    Dense,
    Moe,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub moe_intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub n_shared_experts: usize,
    pub n_routed_experts: usize,
    pub routed_scaling_factor: f32,
    pub kv_lora_rank: usize,
    pub q_lora_rank: usize,
    pub v_head_dim: usize,
    pub qk_nope_head_dim: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub num_experts_per_tok: usize,
    pub norm_topk_prob: bool,
    pub rms_norm_eps: f32,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    pub index_topk: usize,
    pub index_head_dim: usize,
    pub index_n_heads: usize,
    pub index_kpool: usize,
    pub index_kpool_always_select_tail: bool,
    pub swiglu_limit: f32,
    pub linear_head_dim: usize,
    pub linear_num_heads: usize,
    pub linear_conv_kernel_dim: usize,
    /// `None`: the softplus forget gate; `Some(b)`: `b * sigmoid(..)`.
    pub linear_lower_bound: Option<f32>,
    pub hc_mult: usize,
    pub hc_eps: f32,
    pub hc_sinkhorn_iters: usize,
    pub attn_kinds: Vec<AttnKind>,
    pub indexer_kinds: Vec<IndexerKind>,
    pub mlp_kinds: Vec<MlpKind>,
    pub eos_token_ids: Vec<u32>,
    pub pad_token_id: Option<u32>,
    pub bos_token_id: Option<u32>,
    /// `quantization_config` of an EXL3 (exllamav3) checkpoint.
    pub exl3: Option<Exl3Quantization>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not valid JSON: {source}")]
    Json {
        path: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("config field `{field}`: {message}")]
    Field { field: String, message: String },
}

fn field_err(field: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Field {
        field: field.to_string(),
        message: message.into(),
    }
}

/// Typed reads of one JSON object with defaults; every read names its field on error.
struct Fields<'a> {
    map: &'a Map<String, Value>,
}

impl Fields<'_> {
    fn present(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn usize(&self, key: &str, default: usize) -> Result<usize, ConfigError> {
        match self.present(key) {
            None => Ok(default),
            Some(v) => v
                .as_u64()
                .map(|n| n as usize)
                .ok_or_else(|| field_err(key, format!("expected a non-negative integer, got {v}"))),
        }
    }

    fn f32(&self, key: &str, default: f32) -> Result<f32, ConfigError> {
        match self.present(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .map(|n| n as f32)
                .ok_or_else(|| field_err(key, format!("expected a number, got {v}"))),
        }
    }

    fn bool(&self, key: &str, default: bool) -> Result<bool, ConfigError> {
        match self.present(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| field_err(key, format!("expected true or false, got {v}"))),
        }
    }

    fn string(&self, key: &str, default: &str) -> Result<String, ConfigError> {
        match self.present(key) {
            None => Ok(default.to_string()),
            Some(v) => v
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| field_err(key, format!("expected a string, got {v}"))),
        }
    }

    fn strings(&self, key: &str) -> Result<Option<Vec<String>>, ConfigError> {
        match self.present(key) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    v.as_str().map(str::to_string).ok_or_else(|| {
                        field_err(
                            &format!("{key}[{i}]"),
                            format!("expected a string, got {v}"),
                        )
                    })
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(v) => Err(field_err(
                key,
                format!("expected a list of strings, got {v}"),
            )),
        }
    }

    fn token_ids(&self, key: &str) -> Result<Vec<u32>, ConfigError> {
        let as_id = |v: &Value| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| field_err(key, format!("expected token ids, got {v}")))
        };
        match self.present(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items.iter().map(as_id).collect(),
            Some(v) => Ok(vec![as_id(v)?]),
        }
    }

    fn token_id(&self, key: &str) -> Result<Option<u32>, ConfigError> {
        Ok(self.token_ids(key)?.first().copied())
    }
}

impl Config {
    /// Per layer: whether it has routed experts.
    pub fn moe_layers(&self) -> Vec<bool> {
        self.mlp_kinds.iter().map(|k| *k == MlpKind::Moe).collect()
    }

    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.display().to_string(),
            source,
        })?;
        let value: Value = serde_json::from_str(&text).map_err(|source| ConfigError::Json {
            path: path.display().to_string(),
            source,
        })?;
        Config::from_json(&value)
    }

    /// Parses a config: the text fields at the top level, or under `text_config`.
    pub fn from_json(value: &Value) -> Result<Config, ConfigError> {
        let top = value
            .as_object()
            .ok_or_else(|| field_err("(root)", "expected a JSON object"))?;
        let map = match top.get("text_config") {
            Some(Value::Object(text)) => text,
            Some(Value::Null) | None => top,
            Some(v) => {
                return Err(field_err(
                    "text_config",
                    format!("expected an object, got {v}"),
                ));
            }
        };
        let f = Fields { map };

        let model_type = f.string("model_type", "glm5_next_text")?;
        if !matches!(model_type.as_str(), "glm5_next" | "glm5_next_text") {
            return Err(field_err(
                "model_type",
                format!("`{model_type}` is not supported (expected glm5_next or glm5_next_text)"),
            ));
        }

        let num_hidden_layers = f.usize("num_hidden_layers", 45)?;
        let num_attention_heads = f.usize("num_attention_heads", 64)?;
        let num_key_value_heads = f.usize("num_key_value_heads", num_attention_heads)?;
        if num_key_value_heads != num_attention_heads {
            return Err(field_err(
                "num_key_value_heads",
                format!(
                    "must equal num_attention_heads ({num_attention_heads}), got {num_key_value_heads}"
                ),
            ));
        }
        let qk_rope_head_dim = f.usize("qk_rope_head_dim", 0)?;
        if qk_rope_head_dim > 0 {
            return Err(field_err(
                "qk_rope_head_dim",
                format!(
                    "GLM-5.3-Flash attention is NoPE; RoPE dims > 0 are not supported (got {qk_rope_head_dim})"
                ),
            ));
        }
        if f.present("q_lora_rank").is_none() && map.contains_key("q_lora_rank") {
            return Err(field_err(
                "q_lora_rank",
                "is required by the DSA indexer (got null)",
            ));
        }
        let hidden_act = f.string("hidden_act", "silu")?;
        if hidden_act != "silu" {
            return Err(field_err(
                "hidden_act",
                format!("only `silu` is supported, got `{hidden_act}`"),
            ));
        }
        if f.bool("attention_bias", false)? {
            return Err(field_err(
                "attention_bias",
                "attention biases are not supported (GLM-5.3-Flash has none)",
            ));
        }

        // KDA fields may come as the original `linear_attn_config` dict.
        let linear = match f.present("linear_attn_config") {
            Some(Value::Object(m)) => Some(m),
            Some(v) => {
                return Err(field_err(
                    "linear_attn_config",
                    format!("expected an object, got {v}"),
                ));
            }
            None => None,
        };
        let mut linear_head_dim = f.usize("linear_head_dim", 128)?;
        let mut linear_num_heads = f.usize("linear_num_heads", 64)?;
        let mut linear_conv_kernel_dim = f.usize("linear_conv_kernel_dim", 4)?;
        let mut linear_lower_bound = match map.get("linear_lower_bound") {
            Some(Value::Null) => None,
            _ => Some(f.f32("linear_lower_bound", -5.0)?),
        };
        if let Some(m) = linear {
            let lf = Fields { map: m };
            linear_head_dim = lf.usize("head_dim", linear_head_dim)?;
            linear_num_heads = lf.usize("num_heads", linear_num_heads)?;
            linear_conv_kernel_dim = lf.usize("short_conv_kernel_size", linear_conv_kernel_dim)?;
            if let Some(v) = lf.present("gate_lower_bound") {
                linear_lower_bound = Some(v.as_f64().ok_or_else(|| {
                    field_err("linear_attn_config.gate_lower_bound", "expected a number")
                })? as f32);
            }
            if lf.bool("safe_gate", true)? && linear_lower_bound.is_none() {
                linear_lower_bound = Some(-5.0);
            }
        }

        let mlp_kinds = match f.strings("mlp_layer_types")? {
            None => (0..num_hidden_layers)
                .map(|i| if i < 3 { MlpKind::Dense } else { MlpKind::Moe })
                .collect(),
            Some(types) => types
                .iter()
                .enumerate()
                .map(|(i, t)| match t.as_str() {
                    "dense" => Ok(MlpKind::Dense),
                    "sparse" => Ok(MlpKind::Moe),
                    other => Err(field_err(
                        &format!("mlp_layer_types[{i}]"),
                        format!("unknown layer type `{other}` (expected dense or sparse)"),
                    )),
                })
                .collect::<Result<_, _>>()?,
        };
        let attn_kinds = match f.strings("layer_types")? {
            None => (0..num_hidden_layers)
                .map(|i| if i % 4 == 3 { AttnKind::Mla } else { AttnKind::Kda })
                .collect(),
            Some(types) => types
                .iter()
                .enumerate()
                .map(|(i, t)| match t.as_str() {
                    "linear_attention" => Ok(AttnKind::Kda),
                    // exllamav3 spells it `deepseek_sparse_attention`.
                    "indexed_attention" | "deepseek_sparse_attention" | "full_attention" => {
                        Ok(AttnKind::Mla)
                    }
                    other => Err(field_err(
                        &format!("layer_types[{i}]"),
                        format!("unknown layer type `{other}` (expected linear_attention, indexed_attention or deepseek_sparse_attention)"),
                    )),
                })
                .collect::<Result<_, _>>()?,
        };
        let indexer_kinds = parse_indexer_kinds(&f, num_hidden_layers)?;

        let cfg = Config {
            vocab_size: f.usize("vocab_size", 154_880)?,
            hidden_size: f.usize("hidden_size", 4096)?,
            intermediate_size: f.usize("intermediate_size", 12_288)?,
            moe_intermediate_size: f.usize("moe_intermediate_size", 2048)?,
            num_hidden_layers,
            num_attention_heads,
            n_shared_experts: f.usize("n_shared_experts", 1)?,
            n_routed_experts: f.usize("n_routed_experts", f.usize("num_local_experts", 288)?)?,
            routed_scaling_factor: f.f32("routed_scaling_factor", 2.5)?,
            kv_lora_rank: f.usize("kv_lora_rank", 512)?,
            q_lora_rank: f.usize("q_lora_rank", 1536)?,
            v_head_dim: f.usize("v_head_dim", 256)?,
            qk_nope_head_dim: f.usize("qk_nope_head_dim", 256)?,
            n_group: f.usize("n_group", 1)?,
            topk_group: f.usize("topk_group", 1)?,
            num_experts_per_tok: f.usize("num_experts_per_tok", 8)?,
            norm_topk_prob: f.bool("norm_topk_prob", true)?,
            rms_norm_eps: f.f32("rms_norm_eps", 1e-5)?,
            tie_word_embeddings: top
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(f.bool("tie_word_embeddings", false)?),
            max_position_embeddings: f.usize("max_position_embeddings", 1_048_576)?,
            index_topk: f.usize("index_topk", 2048)?,
            index_head_dim: f.usize("index_head_dim", 128)?,
            index_n_heads: f.usize("index_n_heads", 32)?,
            index_kpool: f.usize("index_kpool", 16)?,
            index_kpool_always_select_tail: f.bool("index_kpool_always_select_tail", true)?,
            swiglu_limit: f.f32("swiglu_limit", 10.0)?,
            linear_head_dim,
            linear_num_heads,
            linear_conv_kernel_dim,
            linear_lower_bound,
            hc_mult: f.usize("hc_mult", 4)?,
            hc_eps: f.f32("hc_eps", 1e-6)?,
            hc_sinkhorn_iters: f.usize("hc_sinkhorn_iters", 20)?,
            attn_kinds,
            indexer_kinds,
            mlp_kinds,
            eos_token_ids: match f.token_ids("eos_token_id")? {
                ids if ids.is_empty() => Fields { map: top }.token_ids("eos_token_id")?,
                ids => ids,
            },
            pad_token_id: f.token_id("pad_token_id")?,
            bos_token_id: f.token_id("bos_token_id")?,
            exl3: parse_quantization(top)?,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Cross-field checks; the reference accepts some of these silently and misbehaves.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("kv_lora_rank", self.kv_lora_rank),
            ("q_lora_rank", self.q_lora_rank),
            ("v_head_dim", self.v_head_dim),
            ("qk_nope_head_dim", self.qk_nope_head_dim),
            ("index_head_dim", self.index_head_dim),
            ("index_n_heads", self.index_n_heads),
            ("index_kpool", self.index_kpool),
            ("linear_head_dim", self.linear_head_dim),
            ("linear_num_heads", self.linear_num_heads),
            ("linear_conv_kernel_dim", self.linear_conv_kernel_dim),
            ("hc_mult", self.hc_mult),
            ("hc_sinkhorn_iters", self.hc_sinkhorn_iters),
            ("n_group", self.n_group),
            ("topk_group", self.topk_group),
        ];
        for (field, value) in positive {
            if value == 0 {
                return Err(field_err(field, "must be at least 1, got 0"));
            }
        }
        for (field, len) in [
            ("layer_types", self.attn_kinds.len()),
            ("mlp_layer_types", self.mlp_kinds.len()),
            ("indexer_types", self.indexer_kinds.len()),
        ] {
            if len != self.num_hidden_layers {
                return Err(field_err(
                    field,
                    format!(
                        "has {len} entries but num_hidden_layers is {}",
                        self.num_hidden_layers
                    ),
                ));
            }
        }
        if !self.index_topk.is_multiple_of(self.index_kpool) || self.index_topk == 0 {
            return Err(field_err(
                "index_topk",
                format!(
                    "must be a positive multiple of index_kpool ({}), got {}",
                    self.index_kpool, self.index_topk
                ),
            ));
        }
        if !self.index_kpool_always_select_tail && self.index_kpool > 1 {
            return Err(field_err(
                "index_kpool_always_select_tail",
                "false is not supported with index_kpool > 1: early queries would have no keys to attend to",
            ));
        }
        let has_moe = self.mlp_kinds.contains(&MlpKind::Moe);
        if has_moe {
            let e = self.n_routed_experts;
            if e == 0 {
                return Err(field_err(
                    "n_routed_experts",
                    "must be at least 1 when a layer is sparse",
                ));
            }
            if !e.is_multiple_of(self.n_group) {
                return Err(field_err(
                    "n_group",
                    format!("must divide n_routed_experts ({e}), got {}", self.n_group),
                ));
            }
            let per_group = e / self.n_group;
            if self.n_group > 1 && per_group < 2 {
                return Err(field_err(
                    "n_group",
                    format!(
                        "groups are ranked by their top-2 experts, so each needs 2; {e} experts in {} groups",
                        self.n_group
                    ),
                ));
            }
            if self.topk_group > self.n_group {
                return Err(field_err(
                    "topk_group",
                    format!(
                        "must be at most n_group ({}), got {}",
                        self.n_group, self.topk_group
                    ),
                ));
            }
            let reachable = self.topk_group * per_group;
            if self.num_experts_per_tok == 0 || self.num_experts_per_tok > reachable {
                return Err(field_err(
                    "num_experts_per_tok",
                    format!(
                        "must be between 1 and the experts in the kept groups ({reachable}), got {}",
                        self.num_experts_per_tok
                    ),
                ));
            }
            if self.moe_intermediate_size == 0 {
                return Err(field_err("moe_intermediate_size", "must be at least 1"));
            }
        }
        if self.mlp_kinds.contains(&MlpKind::Dense) && self.intermediate_size == 0 {
            return Err(field_err(
                "intermediate_size",
                "must be at least 1 when a layer is dense",
            ));
        }
        let mut seen_full = false;
        for (i, (attn, idx)) in self.attn_kinds.iter().zip(&self.indexer_kinds).enumerate() {
            if *attn != AttnKind::Mla {
                continue;
            }
            match idx {
                IndexerKind::Full => seen_full = true,
                IndexerKind::Shared if !seen_full => {
                    return Err(field_err(
                        &format!("indexer_types[{i}]"),
                        "a shared indexer layer needs an earlier full indexed_attention layer",
                    ));
                }
                IndexerKind::Shared => {}
            }
        }
        if self.rms_norm_eps.is_nan() || self.rms_norm_eps <= 0.0 {
            return Err(field_err(
                "rms_norm_eps",
                format!("must be positive, got {}", self.rms_norm_eps),
            ));
        }
        if self.swiglu_limit.is_nan() || self.swiglu_limit <= 0.0 {
            return Err(field_err(
                "swiglu_limit",
                format!("must be positive, got {}", self.swiglu_limit),
            ));
        }
        Ok(())
    }

    /// q/k/v width of a KDA layer.
    pub fn kda_dim(&self) -> usize {
        self.linear_num_heads * self.linear_head_dim
    }

    /// Query/key head width of MLA (no RoPE part).
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim
    }
}

/// `quantization_config` of an EXL3 (exllamav3) checkpoint. Each linear's rate and codebook
/// are read from its own tensors (trellis shape, `mcg` / `mul1` markers); these are the
/// converter's targets, logged and checked for sense.
#[derive(Clone, Debug, PartialEq)]
pub struct Exl3Quantization {
    /// Average bits per weight of the quantized linears.
    pub bits: f32,
    /// Bits per weight of `lm_head`.
    pub head_bits: f32,
    /// The converter's default codebook.
    pub codebook: Codebook,
    /// exllamav3's version that wrote the checkpoint, when recorded.
    pub version: Option<String>,
}

/// Keys of exllamav3's `quantization_config` that this engine reads or may ignore.
const EXL3_KEYS: [&str; 9] = [
    "quant_method",
    "version",
    "bits",
    "head_bits",
    "codebook",
    "calibration",
    "out_scales",
    "mtp_bits",
    "tensor_storage",
];

/// Parses the top-level `quantization_config`: absent (unquantized or glmflash's own row
/// formats) or exllamav3's EXL3 block; any other method, a missing or unknown field is an
/// error naming it.
fn parse_quantization(top: &Map<String, Value>) -> Result<Option<Exl3Quantization>, ConfigError> {
    let map = match top.get("quantization_config") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(m)) => m,
        Some(v) => {
            return Err(field_err(
                "quantization_config",
                format!("expected an object, got {v}"),
            ));
        }
    };
    let name = |key: &str| format!("quantization_config.{key}");
    let required = |key: &str| {
        map.get(key)
            .filter(|v| !v.is_null())
            .ok_or_else(|| field_err(&name(key), "is required for an EXL3 checkpoint"))
    };
    let method = required("quant_method")?;
    if method.as_str() != Some("exl3") {
        return Err(field_err(
            &name("quant_method"),
            format!("{method} is not supported (expected \"exl3\")"),
        ));
    }
    if let Some(unknown) = map.keys().find(|k| !EXL3_KEYS.contains(&k.as_str())) {
        return Err(field_err(
            &name(unknown),
            format!(
                "is not a field of exllamav3's quantization_config (known: {})",
                EXL3_KEYS.join(", ")
            ),
        ));
    }
    let bits_of = |key: &str| -> Result<f32, ConfigError> {
        let v = required(key)?;
        v.as_f64()
            .map(|b| b as f32)
            .filter(|b| (1.0..=8.0).contains(b))
            .ok_or_else(|| {
                field_err(
                    &name(key),
                    format!("expected bits per weight in 1..=8, got {v}"),
                )
            })
    };
    let codebook = required("codebook")?;
    let codebook = codebook
        .as_str()
        .ok_or_else(|| {
            field_err(
                &name("codebook"),
                format!("expected a string, got {codebook}"),
            )
        })
        .and_then(|c| {
            Codebook::from_name(c).map_err(|e| field_err(&name("codebook"), e.to_string()))
        })?;
    let version = match map.get("version") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(v) => {
            return Err(field_err(
                &name("version"),
                format!("expected a string, got {v}"),
            ));
        }
    };
    Ok(Some(Exl3Quantization {
        bits: bits_of("bits")?,
        head_bits: bits_of("head_bits")?,
        codebook,
        version,
    }))
}

fn parse_indexer_kinds(f: &Fields, layers: usize) -> Result<Vec<IndexerKind>, ConfigError> {
    let parse = |field: &str, s: &str| match s {
        "full" | "F" => Ok(IndexerKind::Full),
        "shared" | "S" => Ok(IndexerKind::Shared),
        other => Err(field_err(
            field,
            format!("unknown indexer type `{other}` (expected full or shared)"),
        )),
    };
    if let Some(types) = f.strings("indexer_types")? {
        return types
            .iter()
            .enumerate()
            .map(|(i, t)| parse(&format!("indexer_types[{i}]"), t))
            .collect();
    }
    match f.present("index_topk_pattern") {
        Some(Value::String(pattern)) => {
            return pattern
                .chars()
                .enumerate()
                .map(|(i, c)| parse(&format!("index_topk_pattern[{i}]"), &c.to_string()))
                .collect();
        }
        Some(Value::Array(_)) => {
            return f
                .strings("index_topk_pattern")?
                .unwrap_or_default()
                .iter()
                .enumerate()
                .map(|(i, t)| parse(&format!("index_topk_pattern[{i}]"), t))
                .collect();
        }
        Some(v) => {
            return Err(field_err(
                "index_topk_pattern",
                format!("expected a string or list, got {v}"),
            ));
        }
        None => {}
    }
    let freq = f.usize("index_topk_freq", 1)?.max(1);
    let offset = f.usize("index_skip_topk_offset", 2)?;
    Ok((0..layers)
        .map(|i| {
            if (i + 1).saturating_sub(offset) % freq == 0 {
                IndexerKind::Full
            } else {
                IndexerKind::Shared
            }
        })
        .collect())
}
