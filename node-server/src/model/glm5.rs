//! The GLM-5.3-Flash text model: embeddings into `hc_mult` streams, then per layer an
//! attention sublayer (KDA or MLA+DSA) and a feed-forward sublayer (dense or MoE), each
//! wrapped in mHC; then the stream mean, a norm and the head.
//!
//! A forward call takes a batch of sequences, each with its own new tokens and cache.
//! Token-wise work (projections, experts, mHC) runs on all sequences' tokens at once;
//! sequence-wise work (conv, recurrence, attention) runs per sequence.

use super::checkpoint::Checkpoint;
use super::config::{AttnKind, Config, IndexerKind, MlpKind};
use super::kda::{Kda, KdaMode, KdaState};
use super::loader::{LoadError, Loader};
use super::mhc::HyperConnection;
use super::mla::{Mla, MlaCache, MlaPath, Selections};
use super::mlp::SwiGlu;
use super::moe::{ExpertProvider, InMemoryExperts, Moe, Phase, Routing};
use crate::backend::cpu::{Matrix, Placer, ops};
use anyhow::{Context, bail};
use std::path::Path;
use std::sync::Arc;

pub enum Attention {
    Kda(Kda),
    Mla(Mla),
}

pub enum FeedForward {
    Dense(SwiGlu),
    Moe(Moe),
}

pub struct Layer {
    pub(crate) attn_hc: HyperConnection,
    pub(crate) ffn_hc: HyperConnection,
    pub(crate) input_norm: Vec<f32>,
    pub(crate) post_attention_norm: Vec<f32>,
    pub attention: Attention,
    pub feed_forward: FeedForward,
}

/// Per-layer cache of one sequence.
#[derive(Clone, Debug, PartialEq)]
pub enum LayerCache {
    Kda(KdaState),
    Mla(MlaCache),
}

/// Everything one sequence carries between forward calls.
#[derive(Clone, Debug, PartialEq)]
pub struct SeqCache {
    pub layers: Vec<LayerCache>,
    /// Tokens processed so far.
    pub len: usize,
}

impl SeqCache {
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerCache::Kda(s) => s.bytes(),
                LayerCache::Mla(c) => c.bytes(),
            })
            .sum()
    }
}

/// One sequence's share of a forward call.
pub struct Step<'a> {
    pub tokens: &'a [u32],
    pub cache: &'a mut SeqCache,
    /// Logits for every new token (else only the last).
    pub all_logits: bool,
}

impl Step<'_> {
    /// One new token onto a sequence that already has a cache: a decode step.
    pub fn is_decode(&self) -> bool {
        self.tokens.len() == 1 && self.cache.len > 0
    }
}

/// Observes named intermediates and routing decisions during a forward call (debug dumps,
/// tests, the expert tiers' statistics).
pub trait ForwardHooks: Sync {
    /// `values` is `[tokens of the batch, width]`; names follow the reference's module tree.
    fn tensor(&self, _name: &str, _values: &[f32], _width: usize) {}
    fn routing(&self, _layer: usize, _routing: &Routing) {}
}

/// Which kernel forms a forward call uses (tests pin them to compare forms).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForwardOptions {
    pub kda: KdaMode,
    pub mla: MlaPath,
}

impl Default for ForwardOptions {
    fn default() -> Self {
        ForwardOptions {
            kda: KdaMode::Auto,
            mla: MlaPath::Auto,
        }
    }
}

pub struct Model {
    pub cfg: Config,
    pub(crate) embed: Matrix,
    pub layers: Vec<Layer>,
    pub(crate) norm: Vec<f32>,
    pub(crate) lm_head: Matrix,
    experts: Arc<dyn ExpertProvider>,
    pub options: ForwardOptions,
    /// Bytes of every weight but the routed experts, as stored in the checkpoint.
    dense_bytes: usize,
    embed_bytes: usize,
}

impl Model {
    /// Loads `dir` (config.json + safetensors); routed experts from the checkpoint into memory.
    pub fn load(dir: &Path) -> anyhow::Result<Model> {
        Model::load_with(dir, None)
    }

    /// As [`Model::load`], with routed experts served by `experts` when given.
    pub fn load_with(
        dir: &Path,
        experts: Option<Arc<dyn ExpertProvider>>,
    ) -> anyhow::Result<Model> {
        Model::load_placed(dir, experts, None)
    }

    /// As [`Model::load_with`], giving the dense weights the `placer` wants a device copy
    /// (the routed experts are the provider's business).
    pub fn load_placed(
        dir: &Path,
        experts: Option<Arc<dyn ExpertProvider>>,
        placer: Option<&dyn Placer>,
    ) -> anyhow::Result<Model> {
        let cfg = Config::from_file(&dir.join("config.json"))?;
        let ckpt = Checkpoint::open(dir)?;
        if ckpt
            .keys()
            .iter()
            .any(|k| k.contains(&format!("layers.{}.", cfg.num_hidden_layers)))
        {
            tracing::info!(
                layer = cfg.num_hidden_layers,
                "checkpoint carries an MTP layer; it is ignored (no speculative decoding)"
            );
        }
        let experts = match experts {
            Some(e) => e,
            None => Arc::new(InMemoryExperts::load(&cfg, Loader::new(&ckpt))?),
        };
        Ok(Model::from_checkpoint_placed(cfg, &ckpt, experts, placer)?)
    }

    pub fn from_checkpoint(
        cfg: Config,
        ckpt: &Checkpoint,
        experts: Arc<dyn ExpertProvider>,
    ) -> Result<Model, LoadError> {
        Model::from_checkpoint_placed(cfg, ckpt, experts, None)
    }

    pub fn from_checkpoint_placed(
        cfg: Config,
        ckpt: &Checkpoint,
        experts: Arc<dyn ExpertProvider>,
        placer: Option<&dyn Placer>,
    ) -> Result<Model, LoadError> {
        let vb = Loader::placed(ckpt, placer);
        let (d, v) = (cfg.hidden_size, cfg.vocab_size);
        // The embedding is only ever read by rows: no device copy.
        let embed = Loader::new(ckpt).matrix("embed_tokens.weight", v, d)?;
        let lm_head = if vb.contains("lm_head.weight") {
            vb.matrix("lm_head.weight", v, d)?
        } else if cfg.tie_word_embeddings {
            let mut head = embed.clone();
            if let Some(p) = placer {
                head.set_device(p.place(&embed));
            }
            head
        } else {
            vb.matrix("lm_head.weight", v, d)?
        };
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| Layer::load(&cfg, vb.pp(&format!("layers.{i}")), i))
            .collect::<Result<_, _>>()?;
        let dense_bytes = ckpt
            .keys()
            .into_iter()
            .filter(|k| !is_routed_expert_key(k))
            .map(|k| ckpt.view(k).map(|v| v.bytes.len()).unwrap_or(0))
            .sum();
        Ok(Model {
            dense_bytes,
            embed_bytes: embed.storage_bytes(),
            norm: vb.vector("norm.weight", d)?,
            embed,
            layers,
            lm_head,
            experts,
            options: ForwardOptions::default(),
            cfg,
        })
    }

    pub fn new_cache(&self) -> SeqCache {
        SeqCache {
            layers: self
                .cfg
                .attn_kinds
                .iter()
                .map(|k| match k {
                    AttnKind::Kda => LayerCache::Kda(KdaState::new(&self.cfg)),
                    AttnKind::Mla => LayerCache::Mla(MlaCache::default()),
                })
                .collect(),
            len: 0,
        }
    }

    /// Swaps where the routed experts are computed (benchmarks comparing tier set-ups on one
    /// loaded model).
    pub fn set_experts(&mut self, experts: Arc<dyn ExpertProvider>) {
        self.experts = experts;
    }

    pub fn experts(&self) -> &Arc<dyn ExpertProvider> {
        &self.experts
    }

    /// Bytes of all weights, routed experts included.
    pub fn weight_bytes(&self) -> usize {
        self.dense_bytes + self.experts.weight_bytes()
    }

    pub fn routed_expert_bytes(&self) -> usize {
        self.experts.weight_bytes()
    }

    /// Bytes of the embedding table (read one row per token, not streamed).
    pub fn embedding_bytes(&self) -> usize {
        self.embed_bytes
    }

    /// Runs every step's new tokens through the model, appending to its cache. Returns, per
    /// step, logits rows (`[new tokens or 1, vocab]`, flattened).
    pub fn forward(
        &self,
        steps: &mut [Step],
        hooks: Option<&dyn ForwardHooks>,
    ) -> anyhow::Result<Vec<Vec<f32>>> {
        let cfg = &self.cfg;
        let (d, n) = (cfg.hidden_size, cfg.hc_mult);
        let mut spans = Vec::with_capacity(steps.len());
        let mut tokens = 0;
        for (i, step) in steps.iter().enumerate() {
            if step.tokens.is_empty() {
                bail!("sequence {i} of the batch has no tokens to process");
            }
            if let Some(&bad) = step.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
                bail!(
                    "token id {bad} is outside the vocabulary (size {})",
                    cfg.vocab_size
                );
            }
            if step.cache.layers.len() != cfg.num_hidden_layers {
                bail!("sequence {i}'s cache does not belong to this model");
            }
            spans.push((tokens, step.tokens.len()));
            tokens += step.tokens.len();
        }
        let tap = |name: &str, values: &[f32], width: usize| {
            if let Some(h) = hooks {
                h.tensor(name, values, width);
            }
        };

        let mut embedded = Vec::with_capacity(tokens * d);
        for step in steps.iter() {
            for &t in step.tokens {
                embedded.extend(self.embed.row_f32(t as usize));
            }
        }
        tap("embed", &embedded, d);
        let mut streams = Vec::with_capacity(tokens * n * d);
        for row in embedded.chunks_exact(d) {
            for _ in 0..n {
                streams.extend_from_slice(row);
            }
        }

        let phases: Vec<Phase> = steps
            .iter()
            .flat_map(|s| {
                let phase = if s.is_decode() {
                    Phase::Decode
                } else {
                    Phase::Prefill
                };
                std::iter::repeat_n(phase, s.tokens.len())
            })
            .collect();
        let mut carried: Option<Vec<Selections>> = None;
        for (li, layer) in self.layers.iter().enumerate() {
            let name = |part: &str| format!("layers.{li}.{part}");
            // Attention sublayer.
            let (mut x, mix) = layer.attn_hc.collapse(&streams, tokens);
            tap(&name("attn_hc.collapsed"), &x, d);
            ops::rms_norm(&mut x, Some(&layer.input_norm), d, cfg.rms_norm_eps);
            let y = match &layer.attention {
                Attention::Kda(kda) => {
                    let mut states: Vec<&mut KdaState> = steps
                        .iter_mut()
                        .map(|s| match &mut s.cache.layers[li] {
                            LayerCache::Kda(state) => state,
                            LayerCache::Mla(_) => unreachable!("cache built from the same config"),
                        })
                        .collect();
                    kda.forward(&x, &spans, &mut states, self.options.kda)
                }
                Attention::Mla(mla) => {
                    let mut caches: Vec<&mut MlaCache> = steps
                        .iter_mut()
                        .map(|s| match &mut s.cache.layers[li] {
                            LayerCache::Mla(c) => c,
                            LayerCache::Kda(_) => unreachable!("cache built from the same config"),
                        })
                        .collect();
                    let (y, fresh) = mla.forward(
                        &x,
                        &spans,
                        &mut caches,
                        carried.as_deref(),
                        self.options.mla,
                    );
                    if fresh.is_some() {
                        carried = fresh;
                    }
                    y
                }
            };
            tap(&name("self_attn"), &y, d);
            streams = layer.attn_hc.expand(&mix, &streams, &y, tokens);

            // Feed-forward sublayer.
            let (mut x, mix) = layer.ffn_hc.collapse(&streams, tokens);
            tap(&name("ffn_hc.collapsed"), &x, d);
            ops::rms_norm(
                &mut x,
                Some(&layer.post_attention_norm),
                d,
                cfg.rms_norm_eps,
            );
            let y = match &layer.feed_forward {
                FeedForward::Dense(mlp) => mlp.forward(&x, tokens),
                FeedForward::Moe(moe) => {
                    // Layer-ahead prediction: the next MoE layer's router on this layer's
                    // input, so its expert reads overlap this layer's compute.
                    if self.experts.wants_prefetch()
                        && let Some((next, FeedForward::Moe(next_moe))) = self
                            .layers
                            .iter()
                            .enumerate()
                            .skip(li + 1)
                            .map(|(i, l)| (i, &l.feed_forward))
                            .find(|(_, f)| matches!(f, FeedForward::Moe(_)))
                    {
                        let predicted = next_moe.router.route(&x, tokens);
                        self.experts.prefetch(next, &predicted.ids);
                    }
                    let (y, routing) = moe
                        .forward(li, &x, tokens, &phases, self.experts.as_ref())
                        .with_context(|| format!("experts of layer {li}"))?;
                    if let Some(h) = hooks {
                        h.routing(li, &routing);
                    }
                    y
                }
            };
            tap(&name("mlp"), &y, d);
            streams = layer.ffn_hc.expand(&mix, &streams, &y, tokens);
            tap(&format!("layers.{li}"), &streams, n * d);
        }

        // Rows whose logits are wanted.
        let mut rows = Vec::new();
        let mut counts = Vec::with_capacity(steps.len());
        for (step, &(start, len)) in steps.iter().zip(&spans) {
            let first = if step.all_logits {
                start
            } else {
                start + len - 1
            };
            rows.extend(first..start + len);
            counts.push(start + len - first);
        }
        let mut h = Vec::with_capacity(rows.len() * d);
        for &r in &rows {
            let s = &streams[r * n * d..(r + 1) * n * d];
            h.extend((0..d).map(|k| (0..n).map(|i| s[i * d + k]).sum::<f32>() / n as f32));
        }
        ops::rms_norm(&mut h, Some(&self.norm), d, cfg.rms_norm_eps);
        tap("norm", &h, d);
        let logits = self.lm_head.matmul(&h, rows.len());
        tap("logits", &logits, cfg.vocab_size);

        for (step, &(_, len)) in steps.iter_mut().zip(&spans) {
            step.cache.len += len;
        }
        let v = cfg.vocab_size;
        let mut out = Vec::with_capacity(steps.len());
        let mut at = 0;
        for c in counts {
            out.push(logits[at * v..(at + c) * v].to_vec());
            at += c;
        }
        Ok(out)
    }

    /// Prefills `prompt` into a fresh cache and returns the last logits and the cache.
    pub fn prefill(&self, prompt: &[u32]) -> anyhow::Result<(Vec<f32>, SeqCache)> {
        let mut cache = self.new_cache();
        let logits = self
            .forward(
                &mut [Step {
                    tokens: prompt,
                    cache: &mut cache,
                    all_logits: false,
                }],
                None,
            )?
            .remove(0);
        Ok((logits, cache))
    }

    /// One decode step: feeds `token` to `cache` and returns the next logits.
    pub fn decode_step(&self, token: u32, cache: &mut SeqCache) -> anyhow::Result<Vec<f32>> {
        let step = Step {
            tokens: &[token],
            cache,
            all_logits: false,
        };
        Ok(self.forward(&mut [step], None)?.remove(0))
    }

    /// Greedy continuation of `prompt` for `steps` tokens through the cache; returns the
    /// tokens and the logits that chose each.
    pub fn greedy(
        &self,
        prompt: &[u32],
        steps: usize,
    ) -> anyhow::Result<(Vec<u32>, Vec<Vec<f32>>)> {
        let (mut logits, mut cache) = self.prefill(prompt)?;
        let mut tokens = Vec::with_capacity(steps);
        let mut all = Vec::with_capacity(steps);
        for i in 0..steps {
            let next = ops::argmax(&logits) as u32;
            tokens.push(next);
            all.push(std::mem::take(&mut logits));
            if i + 1 < steps {
                logits = self.decode_step(next, &mut cache)?;
            }
        }
        Ok((tokens, all))
    }
}

/// Whether a checkpoint key holds a routed expert's weights (either layout).
fn is_routed_expert_key(key: &str) -> bool {
    key.contains(".mlp.experts.")
}

impl Layer {
    fn load(cfg: &Config, vb: Loader, i: usize) -> Result<Layer, LoadError> {
        let d = cfg.hidden_size;
        let attention = match cfg.attn_kinds[i] {
            AttnKind::Kda => Attention::Kda(Kda::load(cfg, vb.pp("self_attn"))?),
            AttnKind::Mla => Attention::Mla(Mla::load(
                cfg,
                vb.pp("self_attn"),
                cfg.indexer_kinds[i] == IndexerKind::Full,
            )?),
        };
        let feed_forward = match cfg.mlp_kinds[i] {
            MlpKind::Dense => FeedForward::Dense(SwiGlu::load(
                vb.pp("mlp"),
                d,
                cfg.intermediate_size,
                cfg.swiglu_limit,
            )?),
            MlpKind::Moe => FeedForward::Moe(Moe::load(cfg, vb.pp("mlp"))?),
        };
        Ok(Layer {
            attn_hc: HyperConnection::load(cfg, vb, "attn")?,
            ffn_hc: HyperConnection::load(cfg, vb, "ffn")?,
            input_norm: vb.vector("input_layernorm.weight", d)?,
            post_attention_norm: vb.vector("post_attention_layernorm.weight", d)?,
            attention,
            feed_forward,
        })
    }
}
