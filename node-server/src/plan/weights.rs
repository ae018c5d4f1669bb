//! The model's weights by kind, counted from its config alone: every tensor's shape as the
//! checkpoint holds it (the same names and shapes `model::random` writes), its kind, and
//! whether it is a linear layer's weight (stored in the checkpoint's dense or expert format)
//! or a small tensor kept in f32 (norms, biases, convolutions, mHC, the router).

use crate::backend::cuda::{Exl3Form, MoeLayout};
use crate::model::config::{AttnKind, Config, IndexerKind, MlpKind};
use crate::quant::Format;
use crate::quant::exl3::{Codebook, Rate};

/// What a tensor is part of, for the plan's table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// The embedding table (held in host RAM: one row per token goes to the GPU).
    Embedding,
    /// The output projection.
    Head,
    /// KDA layers' projections and states' parameters.
    Kda,
    /// MLA layers' projections (the DSA indexer's included).
    Mla,
    /// mHC's projections, bases and scales (f32).
    Mhc,
    /// The dense layers' MLPs.
    DenseMlp,
    /// The MoE layers' shared experts.
    SharedExperts,
    /// The MoE layers' routers and their score-correction biases (f32).
    Router,
    /// Norm weights, biases, convolutions, gates' parameters (f32).
    Small,
    /// The routed experts (the tiers hold them).
    RoutedExperts,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Embedding => "embedding",
            Kind::Head => "head",
            Kind::Kda => "kda",
            Kind::Mla => "mla",
            Kind::Mhc => "mhc",
            Kind::DenseMlp => "dense_mlp",
            Kind::SharedExperts => "shared_experts",
            Kind::Router => "router",
            Kind::Small => "small",
            Kind::RoutedExperts => "routed_experts",
        }
    }
}

/// One tensor of the checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub kind: Kind,
    /// A linear layer's `[out, in]` weight: stored in the checkpoint's format; else f32.
    pub linear: bool,
}

impl Tensor {
    pub fn values(&self) -> u64 {
        self.shape.iter().map(|&d| d as u64).product()
    }
}

/// How a checkpoint stores its linear weights.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Storage {
    /// One of the engine's row formats.
    Rows(Format),
    /// EXL3 at this many bits per weight (an average where a checkpoint mixes rates): the
    /// trellis plus the f16 input and output sign/scale vectors.
    Exl3 { bits: f64 },
}

impl Storage {
    /// `f32`, `bf16`, `f16`, `q8_0`, `q4_k` or `exl3:BITS` (BITS from 1 to 8, e.g. `exl3:3.05`).
    pub fn parse(s: &str) -> Result<Storage, String> {
        if let Some(bits) = s.strip_prefix("exl3:") {
            let bits: f64 = bits
                .parse()
                .map_err(|_| format!("{s:?}: the EXL3 rate after `exl3:` is not a number"))?;
            if !(1.0..=8.0).contains(&bits) {
                return Err(format!("{s:?}: EXL3 rates run from 1 to 8 bits per weight"));
            }
            return Ok(Storage::Exl3 { bits });
        }
        Format::from_name(s).map(Storage::Rows).map_err(|e| {
            format!("{e} (formats: f32, bf16, f16, q8_0, q4_k, exl3:BITS such as exl3:3.05)")
        })
    }

    /// Bytes of an `[out, in]` linear weight in this storage.
    pub fn linear_bytes(self, out: usize, input: usize) -> u64 {
        match self {
            Storage::Rows(f) => {
                // A width that is not a block multiple would be refused by the converter;
                // count it at the f16 rate rather than fail a plan.
                f.row_bytes(input).map_or(2 * input as u64, |b| b as u64) * out as u64
            }
            Storage::Exl3 { bits } => {
                let trellis = (out as f64 * input as f64 * bits / 8.0).ceil() as u64;
                trellis + 2 * (out + input) as u64
            }
        }
    }

    pub fn name(self) -> String {
        match self {
            Storage::Rows(f) => f.name().to_string(),
            Storage::Exl3 { bits } => format!("exl3:{bits}"),
        }
    }
}

impl std::fmt::Display for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

struct Inventory {
    out: Vec<Tensor>,
}

impl Inventory {
    fn push(&mut self, name: String, shape: Vec<usize>, kind: Kind, linear: bool) {
        self.out.push(Tensor {
            name,
            shape,
            kind,
            linear,
        });
    }

    fn linear(&mut self, name: String, out: usize, input: usize, kind: Kind) {
        self.push(name, vec![out, input], kind, true);
    }

    fn small(&mut self, name: String, shape: Vec<usize>) {
        self.push(name, shape, Kind::Small, false);
    }

    fn swiglu(&mut self, prefix: &str, d: usize, inter: usize, kind: Kind) {
        self.linear(format!("{prefix}.gate_proj.weight"), inter, d, kind);
        self.linear(format!("{prefix}.up_proj.weight"), inter, d, kind);
        self.linear(format!("{prefix}.down_proj.weight"), d, inter, kind);
    }
}

/// Every tensor of a checkpoint of `cfg`, routed experts included, in the layout
/// `model::random` writes (the transformers names of glm5_next).
pub fn tensors(cfg: &Config) -> Vec<Tensor> {
    let mut inv = Inventory { out: Vec::new() };
    let (d, n) = (cfg.hidden_size, cfg.hc_mult);
    let p = "model.language_model";
    inv.push(
        format!("{p}.embed_tokens.weight"),
        vec![cfg.vocab_size, d],
        Kind::Embedding,
        false,
    );
    inv.small(format!("{p}.norm.weight"), vec![d]);
    inv.linear("lm_head.weight".into(), cfg.vocab_size, d, Kind::Head);
    for i in 0..cfg.num_hidden_layers {
        let l = format!("{p}.layers.{i}");
        for which in ["attn", "ffn"] {
            let fn_rows = (2 + n) * n;
            inv.push(
                format!("{l}.hc_{which}_fn"),
                vec![fn_rows, n * d],
                Kind::Mhc,
                false,
            );
            inv.push(
                format!("{l}.hc_{which}_base"),
                vec![fn_rows],
                Kind::Mhc,
                false,
            );
            inv.push(format!("{l}.hc_{which}_scale"), vec![3], Kind::Mhc, false);
        }
        inv.small(format!("{l}.input_layernorm.weight"), vec![d]);
        inv.small(format!("{l}.post_attention_layernorm.weight"), vec![d]);
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
                    inv.linear(format!("{a}.{proj}_proj.weight"), c, d, Kind::Kda);
                    inv.small(format!("{a}.{proj}_conv1d.weight"), vec![c, 1, k]);
                }
                inv.linear(format!("{a}.f_a_proj.weight"), dh, d, Kind::Kda);
                inv.linear(format!("{a}.f_b_proj.weight"), c, dh, Kind::Kda);
                inv.small(format!("{a}.dt_bias"), vec![c]);
                inv.small(format!("{a}.A_log"), vec![h]);
                inv.linear(format!("{a}.b_proj.weight"), h, d, Kind::Kda);
                inv.linear(format!("{a}.g_a_proj.weight"), dh, d, Kind::Kda);
                inv.linear(format!("{a}.g_b_proj.weight"), c, dh, Kind::Kda);
                inv.small(format!("{a}.o_norm.weight"), vec![dh]);
                inv.linear(format!("{a}.o_proj.weight"), d, c, Kind::Kda);
            }
            AttnKind::Mla => {
                let (h, q, r) = (cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank);
                let (nope, vd) = (cfg.qk_nope_head_dim, cfg.v_head_dim);
                inv.linear(format!("{a}.q_a_proj.weight"), q, d, Kind::Mla);
                inv.small(format!("{a}.q_a_layernorm.weight"), vec![q]);
                inv.linear(format!("{a}.q_b_proj.weight"), h * nope, q, Kind::Mla);
                inv.linear(format!("{a}.kv_a_proj_with_mqa.weight"), r, d, Kind::Mla);
                inv.small(format!("{a}.kv_a_layernorm.weight"), vec![r]);
                inv.linear(
                    format!("{a}.kv_b_proj.weight"),
                    h * (nope + vd),
                    r,
                    Kind::Mla,
                );
                inv.linear(format!("{a}.o_proj.weight"), d, h * vd, Kind::Mla);
                if cfg.indexer_kinds[i] == IndexerKind::Full {
                    let (di, hi) = (cfg.index_head_dim, cfg.index_n_heads);
                    let ix = format!("{a}.indexer");
                    inv.linear(format!("{ix}.wq_b.weight"), hi * di, q, Kind::Mla);
                    inv.linear(format!("{ix}.wk.weight"), di, d, Kind::Mla);
                    inv.small(format!("{ix}.k_norm.weight"), vec![di]);
                    inv.small(format!("{ix}.k_norm.bias"), vec![di]);
                    inv.linear(format!("{ix}.weights_proj.weight"), hi, d, Kind::Mla);
                    inv.small(
                        format!("{ix}.index_kpool_compress_ape"),
                        vec![cfg.index_kpool, di],
                    );
                    inv.linear(format!("{ix}.index_kpool_compress_gate"), di, d, Kind::Mla);
                }
            }
        }
        let m = format!("{l}.mlp");
        match cfg.mlp_kinds[i] {
            MlpKind::Dense => inv.swiglu(&m, d, cfg.intermediate_size, Kind::DenseMlp),
            MlpKind::Moe => {
                let e = cfg.n_routed_experts;
                inv.push(format!("{m}.gate.weight"), vec![e, d], Kind::Router, false);
                inv.push(
                    format!("{m}.gate.e_score_correction_bias"),
                    vec![e],
                    Kind::Router,
                    false,
                );
                if cfg.n_shared_experts > 0 {
                    let width = cfg.moe_intermediate_size * cfg.n_shared_experts;
                    inv.swiglu(
                        &format!("{m}.shared_experts"),
                        d,
                        width,
                        Kind::SharedExperts,
                    );
                }
                for x in 0..e {
                    inv.swiglu(
                        &format!("{m}.experts.{x}"),
                        d,
                        cfg.moe_intermediate_size,
                        Kind::RoutedExperts,
                    );
                }
            }
        }
    }
    inv.out
}

/// Whether the host gives `t`'s bytes back once the GPU holds it
/// ([`crate::model::Weights::release_host_copies`]): every weight matrix but the embedding,
/// MLA's `kv_b` (read by rows) and the routed experts (the tiers' business); not the weight
/// vectors.
pub fn given_back_with_gpu(t: &Tensor) -> bool {
    t.shape.len() == 2
        && !matches!(t.kind, Kind::Embedding | Kind::Small | Kind::RoutedExperts)
        && !t.name.ends_with(".kv_b_proj.weight")
}

/// The non-expert linear weights of `cfg` (the head included, the embedding not), named under
/// the text model's prefix as a converter finds them (`layers.3.mlp.down_proj.weight`).
pub fn linear_names(cfg: &Config) -> std::collections::BTreeSet<String> {
    tensors(cfg)
        .into_iter()
        .filter(|t| t.linear && t.kind != Kind::RoutedExperts)
        .map(|t| {
            t.name
                .strip_prefix("model.language_model.")
                .map(String::from)
                .unwrap_or(t.name)
        })
        .collect()
}

/// Bytes of one routed expert's record in `storage` (gate, up and down; the store rounds a
/// record up to its alignment).
pub fn expert_bytes(cfg: &Config, storage: Storage) -> u64 {
    let (d, i) = (cfg.hidden_size, cfg.moe_intermediate_size);
    2 * storage.linear_bytes(i, d) + storage.linear_bytes(d, i)
}

/// The VRAM slot of a routed expert in `storage`, laid out by the VRAM tier's own
/// [`MoeLayout`] (an EXL3 slot holds its scales as f32, so it is larger than its record). A
/// trellis has a whole or half-integer rate: an average such as `exl3:3.05` gets the slot of
/// the next rate up, the smallest that holds every expert of that average's lower rates.
pub fn slot_layout(cfg: &Config, storage: Storage) -> Result<MoeLayout, String> {
    let (d, i) = (cfg.hidden_size, cfg.moe_intermediate_size);
    let layout = match storage {
        Storage::Rows(f) => MoeLayout::new(d, i, f, f),
        Storage::Exl3 { bits } => {
            let halves = (bits * 2.0 - 1e-9).ceil() as usize;
            let rate = (halves..=16)
                .find_map(|h| Rate::from_tile_len(8 * h).ok())
                .ok_or_else(|| format!("exl3:{bits}: no trellis rate holds it"))?;
            // mul1 is the codebook every rate has; the codebook does not change the size.
            let form = Exl3Form {
                rate,
                codebook: Codebook::Mul1,
            };
            MoeLayout::exl3(d, i, form, form)
        }
    };
    layout.map_err(|e| format!("routed experts in {storage}: {e}"))
}

/// Bytes of a tensor: linear weights in `linear` storage (the head in `head`), the
/// embedding in bf16, everything else f32.
pub fn tensor_bytes(t: &Tensor, linear: Storage, head: Storage) -> u64 {
    match (t.kind, t.linear) {
        (Kind::Embedding, _) => 2 * t.values(),
        (Kind::Head, true) => head.linear_bytes(t.shape[0], t.shape[1]),
        (_, true) => linear.linear_bytes(t.shape[0], t.shape[1]),
        (_, false) => 4 * t.values(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::checkpoint::{Checkpoint, DType};

    /// The inventory names and shapes exactly the tensors of a random checkpoint of the
    /// same config (every layer kind, full and shared indexers, dense and MoE).
    #[test]
    fn inventory_matches_a_written_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let value = crate::model::random::scaled_config(64, 64, 8, 1, 4, 32, 2);
        let config =
            crate::model::random::write_random_checkpoint(dir.path(), &value, 7, DType::F32)
                .unwrap();
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let mut want: Vec<(String, Vec<usize>)> = ckpt
            .keys()
            .into_iter()
            .map(|k| (k.to_string(), ckpt.view(k).unwrap().shape.to_vec()))
            .collect();
        let mut got: Vec<(String, Vec<usize>)> = tensors(&config)
            .into_iter()
            .map(|t| (t.name, t.shape))
            .collect();
        want.sort();
        got.sort();
        assert_eq!(got, want);
    }

    #[test]
    fn storage_bytes() {
        assert_eq!(Storage::parse("q4_k").unwrap(), Storage::Rows(Format::Q4K));
        assert_eq!(
            Storage::parse("exl3:3.05").unwrap(),
            Storage::Exl3 { bits: 3.05 }
        );
        for bad in ["exl3:9", "exl3:x", "q5"] {
            assert!(Storage::parse(bad).is_err(), "{bad}");
        }
        // 4 bits: half a byte a weight, plus f16 scales for both sides.
        assert_eq!(
            Storage::Exl3 { bits: 4.0 }.linear_bytes(2048, 4096),
            2048 * 4096 / 2 + 2 * (2048 + 4096)
        );
        // Q4_K: 144 bytes per 256 values.
        assert_eq!(
            Storage::Rows(Format::Q4K).linear_bytes(2048, 4096),
            2048 * 16 * 144
        );
    }
}
