//! Random glm5_next checkpoints in the original on-disk layout, for the demo model, benches
//! and tests. Weights follow the perturbation the fixtures use (std `1/sqrt(fan_in)`, norms
//! `1 +- 0.2`, small biases) so logits are not flat; the same seed gives the same bytes.

use super::checkpoint::{DType, write_safetensors};
use super::config::{AttnKind, Config, IndexerKind, MlpKind};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::Path;

/// Writes `config.json` and `model.safetensors` for `config` (a flat glm5_next text config)
/// into `dir`, storing floats as `dtype` (F32 or BF16).
pub fn write_random_checkpoint(
    dir: &Path,
    config: &Value,
    seed: u64,
    dtype: DType,
) -> anyhow::Result<Config> {
    write_checkpoint(dir, config, seed, dtype, true)
}

/// As [`write_random_checkpoint`] without the routed experts (every other weight is
/// identical): the model of a benchmark whose experts live only in a packed store
/// (`store::write_random_store`).
pub fn write_random_dense_checkpoint(
    dir: &Path,
    config: &Value,
    seed: u64,
    dtype: DType,
) -> anyhow::Result<Config> {
    write_checkpoint(dir, config, seed, dtype, false)
}

fn write_checkpoint(
    dir: &Path,
    config: &Value,
    seed: u64,
    dtype: DType,
    routed: bool,
) -> anyhow::Result<Config> {
    let cfg = Config::from_json(config)?;
    std::fs::create_dir_all(dir)?;
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(config)? + "\n",
    )?;
    let tensors = random_tensors(&cfg, seed, dtype, routed);
    write_safetensors(&dir.join("model.safetensors"), &tensors, &BTreeMap::new())?;
    Ok(cfg)
}

type Tensor = (String, DType, Vec<usize>, Vec<u8>);

struct Gen {
    rng: ChaCha8Rng,
    dtype: DType,
    out: Vec<Tensor>,
}

impl Gen {
    fn push(&mut self, name: String, shape: Vec<usize>, values: Vec<f32>, dtype: DType) {
        let bytes = match dtype {
            DType::Bf16 => values
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect(),
            _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        };
        self.out.push((name, dtype, shape, bytes));
    }

    fn uniform(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.rng.random_range(lo..hi)).collect()
    }

    /// A weight of `shape` with std `gain / sqrt(fan_in)` (uniform, so bounded).
    fn linear(&mut self, name: String, rows: usize, cols: usize, gain: f32) {
        let bound = gain * (3.0 / cols as f32).sqrt();
        let values = self.uniform(rows * cols, -bound, bound);
        let dtype = self.dtype;
        self.push(name, vec![rows, cols], values, dtype);
    }

    fn norm(&mut self, name: String, n: usize) {
        let values = self.uniform(n, 0.8, 1.2);
        let dtype = self.dtype;
        self.push(name, vec![n], values, dtype);
    }

    /// Small values kept in f32, as transformers keeps these modules.
    fn small_f32(&mut self, name: String, shape: Vec<usize>, lo: f32, hi: f32) {
        let values = self.uniform(shape.iter().product(), lo, hi);
        self.push(name, shape, values, DType::F32);
    }
}

fn random_tensors(cfg: &Config, seed: u64, dtype: DType, routed: bool) -> Vec<Tensor> {
    let mut g = Gen {
        rng: ChaCha8Rng::seed_from_u64(seed),
        dtype,
        out: Vec::new(),
    };
    let (d, n) = (cfg.hidden_size, cfg.hc_mult);
    let p = "model.language_model";
    let values = g.uniform(cfg.vocab_size * d, -1.0, 1.0);
    g.push(
        format!("{p}.embed_tokens.weight"),
        vec![cfg.vocab_size, d],
        values,
        dtype,
    );
    g.norm(format!("{p}.norm.weight"), d);
    g.linear("lm_head.weight".into(), cfg.vocab_size, d, 1.0);
    for i in 0..cfg.num_hidden_layers {
        let l = format!("{p}.layers.{i}");
        for which in ["attn", "ffn"] {
            g.linear(format!("{l}.hc_{which}_fn"), (2 + n) * n, n * d, 0.5);
            g.small_f32(format!("{l}.hc_{which}_base"), vec![(2 + n) * n], -0.5, 0.5);
            g.small_f32(format!("{l}.hc_{which}_scale"), vec![3], 0.5, 1.5);
        }
        g.norm(format!("{l}.input_layernorm.weight"), d);
        g.norm(format!("{l}.post_attention_layernorm.weight"), d);
        let a = format!("{l}.self_attn");
        match cfg.attn_kinds[i] {
            AttnKind::Kda => {
                let (c, h, dh, k) = (
                    cfg.kda_dim(),
                    cfg.linear_num_heads,
                    cfg.linear_head_dim,
                    cfg.linear_conv_kernel_dim,
                );
                for proj in ["q", "k", "v"] {
                    g.linear(format!("{a}.{proj}_proj.weight"), c, d, 1.0);
                    g.small_f32(
                        format!("{a}.{proj}_conv1d.weight"),
                        vec![c, 1, k],
                        -0.6,
                        0.6,
                    );
                }
                g.linear(format!("{a}.f_a_proj.weight"), dh, d, 1.0);
                g.linear(format!("{a}.f_b_proj.weight"), c, dh, 1.0);
                g.small_f32(format!("{a}.dt_bias"), vec![c], -0.5, 0.5);
                g.small_f32(format!("{a}.A_log"), vec![h], -0.5, 0.5);
                g.linear(format!("{a}.b_proj.weight"), h, d, 1.0);
                g.linear(format!("{a}.g_a_proj.weight"), dh, d, 1.0);
                g.linear(format!("{a}.g_b_proj.weight"), c, dh, 1.0);
                g.norm(format!("{a}.o_norm.weight"), dh);
                g.linear(format!("{a}.o_proj.weight"), d, c, 1.0);
            }
            AttnKind::Mla => {
                let (h, q, r) = (cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank);
                let (nope, vd) = (cfg.qk_nope_head_dim, cfg.v_head_dim);
                g.linear(format!("{a}.q_a_proj.weight"), q, d, 1.0);
                g.norm(format!("{a}.q_a_layernorm.weight"), q);
                g.linear(format!("{a}.q_b_proj.weight"), h * nope, q, 1.0);
                g.linear(format!("{a}.kv_a_proj_with_mqa.weight"), r, d, 1.0);
                g.norm(format!("{a}.kv_a_layernorm.weight"), r);
                g.linear(format!("{a}.kv_b_proj.weight"), h * (nope + vd), r, 1.0);
                g.linear(format!("{a}.o_proj.weight"), d, h * vd, 1.0);
                if cfg.indexer_kinds[i] == IndexerKind::Full {
                    let (di, hi) = (cfg.index_head_dim, cfg.index_n_heads);
                    g.linear(format!("{a}.indexer.wq_b.weight"), hi * di, q, 1.0);
                    g.linear(format!("{a}.indexer.wk.weight"), di, d, 1.0);
                    g.norm(format!("{a}.indexer.k_norm.weight"), di);
                    g.small_f32(format!("{a}.indexer.k_norm.bias"), vec![di], -0.1, 0.1);
                    g.linear(format!("{a}.indexer.weights_proj.weight"), hi, d, 1.0);
                    g.small_f32(
                        format!("{a}.indexer.index_kpool_compress_ape"),
                        vec![cfg.index_kpool, di],
                        -0.5,
                        0.5,
                    );
                    g.linear(format!("{a}.indexer.index_kpool_compress_gate"), di, d, 1.0);
                }
            }
        }
        let m = format!("{l}.mlp");
        match cfg.mlp_kinds[i] {
            MlpKind::Dense => swiglu(&mut g, &m, d, cfg.intermediate_size),
            MlpKind::Moe => {
                g.linear(format!("{m}.gate.weight"), cfg.n_routed_experts, d, 1.0);
                g.small_f32(
                    format!("{m}.gate.e_score_correction_bias"),
                    vec![cfg.n_routed_experts],
                    -0.05,
                    0.05,
                );
                if cfg.n_shared_experts > 0 {
                    swiglu(
                        &mut g,
                        &format!("{m}.shared_experts"),
                        d,
                        cfg.moe_intermediate_size * cfg.n_shared_experts,
                    );
                }
                for e in (0..cfg.n_routed_experts).filter(|_| routed) {
                    swiglu(
                        &mut g,
                        &format!("{m}.experts.{e}"),
                        d,
                        cfg.moe_intermediate_size,
                    );
                }
            }
        }
    }
    g.out
}

fn swiglu(g: &mut Gen, prefix: &str, d: usize, inter: usize) {
    g.linear(format!("{prefix}.gate_proj.weight"), inter, d, 1.0);
    g.linear(format!("{prefix}.up_proj.weight"), inter, d, 1.0);
    g.linear(format!("{prefix}.down_proj.weight"), d, inter, 1.0);
}

/// GLM-5.3-Flash's real widths (hidden 4096, vocabulary 154,880, 288 experts of 2048 with 8
/// picked, MLA 64 heads of 256 over a 512-wide latent, DSA 32 x 128 keeping 2,048 positions
/// in pools of 16, KDA 64 x 128, mHC 4 streams), with `dense_layers` dense then `moe_layers`
/// MoE layers instead of the real 3 + 42.
pub fn flash_config(dense_layers: usize, moe_layers: usize) -> Value {
    let mut c = scaled_config(
        154_880,
        4096,
        dense_layers + moe_layers,
        dense_layers,
        288,
        2048,
        8,
    );
    for (key, value) in [
        ("intermediate_size", json!(12288)),
        ("num_attention_heads", json!(64)),
        ("num_key_value_heads", json!(64)),
        ("q_lora_rank", json!(1536)),
        ("kv_lora_rank", json!(512)),
        ("qk_nope_head_dim", json!(256)),
        ("v_head_dim", json!(256)),
        ("n_group", json!(1)),
        ("topk_group", json!(1)),
        ("index_topk", json!(2048)),
        ("index_head_dim", json!(128)),
        ("index_n_heads", json!(32)),
        ("linear_head_dim", json!(128)),
        ("linear_num_heads", json!(64)),
    ] {
        c[key] = value;
    }
    c
}

/// A flat config in the real model's shape family, scaled by the arguments: layer `i` is MLA
/// when `i % 4 == 3` (alternating full/shared indexers), the first `dense_layers` are dense.
pub fn scaled_config(
    vocab: usize,
    hidden: usize,
    layers: usize,
    dense_layers: usize,
    experts: usize,
    expert_width: usize,
    top_k: usize,
) -> Value {
    let layer_types: Vec<&str> = (0..layers)
        .map(|i| {
            if i % 4 == 3 {
                "indexed_attention"
            } else {
                "linear_attention"
            }
        })
        .collect();
    let mut mla_seen = 0;
    let indexer_types: Vec<&str> = layer_types
        .iter()
        .map(|t| {
            if *t == "indexed_attention" {
                mla_seen += 1;
                if mla_seen % 2 == 1 { "full" } else { "shared" }
            } else {
                "full"
            }
        })
        .collect();
    let mlp_types: Vec<&str> = (0..layers)
        .map(|i| if i < dense_layers { "dense" } else { "sparse" })
        .collect();
    let heads = (hidden / 64).max(2);
    let groups = if experts.is_multiple_of(4) && experts >= 8 {
        4
    } else {
        1
    };
    json!({
        "model_type": "glm5_next_text",
        "architectures": ["Glm5NextForConditionalGeneration"],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": hidden * 3,
        "moe_intermediate_size": expert_width,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "n_shared_experts": 1,
        "n_routed_experts": experts,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": (hidden / 2).max(16),
        "q_lora_rank": (hidden * 3 / 8).max(16),
        "qk_rope_head_dim": 0,
        "qk_nope_head_dim": 64,
        "v_head_dim": 64,
        "n_group": groups,
        "topk_group": if groups > 1 { 2 } else { 1 },
        "num_experts_per_tok": top_k,
        "norm_topk_prob": true,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": false,
        "max_position_embeddings": 131072,
        "index_topk": 256,
        "index_head_dim": 64,
        "index_n_heads": 8,
        "index_kpool": 16,
        "index_kpool_always_select_tail": true,
        "layer_types": layer_types,
        "indexer_types": indexer_types,
        "mlp_layer_types": mlp_types,
        "swiglu_limit": 10.0,
        "linear_head_dim": 64,
        "linear_num_heads": heads,
        "linear_conv_kernel_dim": 4,
        "linear_lower_bound": -5.0,
        "hc_mult": 4,
        "hc_eps": 1e-6,
        "hc_sinkhorn_iters": 20,
        "eos_token_id": Value::Null,
        "pad_token_id": Value::Null,
    })
}
