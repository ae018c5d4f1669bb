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

/// How a model is made from a checkpoint directory: where its routed experts are served
/// from (default: the checkpoint, into memory) and which dense weights get a device copy
/// (default: none). `Model::load(dir)` is the default build.
#[derive(Default)]
pub struct ModelBuilder<'a> {
    experts: Option<Arc<dyn ExpertProvider>>,
    placer: Option<&'a dyn Placer>,
}

impl<'a> ModelBuilder<'a> {
    /// Routed experts served by `experts` (the tiers, or every expert in VRAM).
    pub fn experts(mut self, experts: Arc<dyn ExpertProvider>) -> Self {
        self.experts = Some(experts);
        self
    }

    /// Dense weights get the device copy `placer` makes (the routed experts are the
    /// provider's business).
    pub fn placer(mut self, placer: &'a dyn Placer) -> Self {
        self.placer = Some(placer);
        self
    }

    /// Loads `dir` (config.json + safetensors).
    pub fn load(self, dir: &Path) -> anyhow::Result<Model> {
        let cfg = Config::from_file(&dir.join("config.json"))?;
        let ckpt = Checkpoint::open(dir)?;
        check_checkpoint_parts(&cfg, &ckpt, dir)?;
        let experts = match self.experts {
            Some(e) => e,
            None => Arc::new(InMemoryExperts::load(&cfg, Loader::new(&ckpt))?),
        };
        Ok(Model::from_checkpoint(cfg, &ckpt, experts, self.placer)?)
    }
}

impl Model {
    /// Loads `dir` (config.json + safetensors); routed experts from the checkpoint into memory.
    pub fn load(dir: &Path) -> anyhow::Result<Model> {
        ModelBuilder::default().load(dir)
    }

    /// A model made otherwise than [`Model::load`]'s defaults.
    pub fn builder<'a>() -> ModelBuilder<'a> {
        ModelBuilder::default()
    }

    fn from_checkpoint(
        cfg: Config,
        ckpt: &Checkpoint,
        experts: Arc<dyn ExpertProvider>,
        placer: Option<&dyn Placer>,
    ) -> Result<Model, LoadError> {
        let vb = Loader::placed(ckpt, placer);
        let (d, v) = (cfg.hidden_size, cfg.vocab_size);
        // The embedding is only ever read by rows: no device copy.
        let embed = Loader::new(ckpt).matrix("embed_tokens.weight", v, d)?;
        let lm_head = if vb.has_matrix("lm_head.weight") {
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
        let spans = self.check_batch(steps)?;
        let tokens = spans.last().map_or(0, |&(start, len)| start + len);
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
        let pass = Pass {
            cfg: &self.cfg,
            spans: &spans,
            tokens,
            phases: &phases,
            options: self.options,
            experts: self.experts.as_ref(),
            hooks,
        };
        let mut streams = self.embed(steps, &pass);
        let mut carried: Option<Vec<Selections>> = None;
        for (li, layer) in self.layers.iter().enumerate() {
            let next_moe = self
                .layers
                .iter()
                .enumerate()
                .skip(li + 1)
                .find_map(|(i, l)| match &l.feed_forward {
                    FeedForward::Moe(m) => Some((i, m)),
                    FeedForward::Dense(_) => None,
                });
            streams = layer.forward(li, &pass, steps, streams, &mut carried, next_moe)?;
        }
        self.head(steps, &pass, &streams)
    }

    /// Checks each step of a batch (tokens to feed, ids in the vocabulary, a cache of this
    /// model) and gives its rows in the batch: `(first row, tokens)` per step.
    fn check_batch(&self, steps: &[Step]) -> anyhow::Result<Vec<(usize, usize)>> {
        let cfg = &self.cfg;
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
        Ok(spans)
    }

    /// The batch's tokens embedded, each row copied into the `hc_mult` residual streams
    /// (`[tokens, n, d]`).
    fn embed(&self, steps: &[Step], pass: &Pass) -> Vec<f32> {
        let (d, n) = (self.cfg.hidden_size, self.cfg.hc_mult);
        let mut embedded = Vec::with_capacity(pass.tokens * d);
        for step in steps {
            for &t in step.tokens {
                embedded.extend(self.embed.row_f32(t as usize));
            }
        }
        pass.tap("embed", &embedded, d);
        let mut streams = Vec::with_capacity(pass.tokens * n * d);
        for row in embedded.chunks_exact(d) {
            for _ in 0..n {
                streams.extend_from_slice(row);
            }
        }
        streams
    }

    /// The stream mean, the final norm and the head on the rows whose logits each step
    /// wants; advances the steps' caches. Logits per step, as [`Model::forward`] gives them.
    fn head(
        &self,
        steps: &mut [Step],
        pass: &Pass,
        streams: &[f32],
    ) -> anyhow::Result<Vec<Vec<f32>>> {
        let cfg = &self.cfg;
        let (d, n) = (cfg.hidden_size, cfg.hc_mult);
        let spans = pass.spans;
        // Rows whose logits are wanted.
        let mut rows = Vec::new();
        let mut counts = Vec::with_capacity(steps.len());
        for (step, &(start, len)) in steps.iter().zip(spans) {
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
        pass.tap("norm", &h, d);
        let logits = self.lm_head.matmul(&h, rows.len());
        pass.tap("logits", &logits, cfg.vocab_size);

        for (step, &(_, len)) in steps.iter_mut().zip(spans) {
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

/// Logs the parts of the checkpoint the text model skips (an MTP layer, a vision tower) and
/// its EXL3 quantization, which config.json must declare when tensors are trellises.
fn check_checkpoint_parts(cfg: &Config, ckpt: &Checkpoint, dir: &Path) -> anyhow::Result<()> {
    let keys = ckpt.keys();
    let mtp = format!("layers.{}.", cfg.num_hidden_layers);
    let mtp_tensors = keys
        .iter()
        .filter(|k| k.starts_with(&mtp) || k.contains(&format!(".{mtp}")))
        .count();
    let vision_tensors = keys
        .iter()
        .filter(|k| k.starts_with("model.visual.") || k.starts_with("visual."))
        .count();
    if mtp_tensors + vision_tensors > 0 {
        tracing::info!(
            mtp_layer = cfg.num_hidden_layers,
            mtp_tensors,
            vision_tensors,
            "checkpoint tensors of the MTP layer and the vision tower are skipped (no speculative decoding, text only)"
        );
    }
    let trellises = keys.iter().filter(|k| k.ends_with(".trellis")).count();
    match &cfg.exl3 {
        None if trellises > 0 => bail!(
            "{}: {trellises} tensors are EXL3 trellises but config.json has no quantization_config with quant_method \"exl3\"",
            dir.display()
        ),
        Some(q) => tracing::info!(
            bits = q.bits,
            head_bits = q.head_bits,
            codebook = %q.codebook,
            version = q.version.as_deref().unwrap_or("?"),
            linears = trellises,
            "EXL3 checkpoint (each linear's rate and codebook read from its own tensors)"
        ),
        None => {}
    }
    Ok(())
}

/// Whether a checkpoint key holds a routed expert's weights (either layout).
fn is_routed_expert_key(key: &str) -> bool {
    key.contains(".mlp.experts.")
}

/// What every layer of one forward call shares: the batch's layout, the kernel forms, the
/// experts and the hooks.
struct Pass<'a> {
    cfg: &'a Config,
    /// `(first row, tokens)` of each step.
    spans: &'a [(usize, usize)],
    tokens: usize,
    /// Each row's phase (decode picks or prefill), for the experts' statistics.
    phases: &'a [Phase],
    options: ForwardOptions,
    experts: &'a dyn ExpertProvider,
    hooks: Option<&'a dyn ForwardHooks>,
}

impl Pass<'_> {
    fn tap(&self, name: &str, values: &[f32], width: usize) {
        if let Some(h) = self.hooks {
            h.tensor(name, values, width);
        }
    }
}

impl Layer {
    /// One decoder layer on the batch's residual streams (`[tokens, n, d]`): the attention
    /// sublayer, then the feed-forward sublayer, each inside its mHC collapse and expand.
    /// `carried`: the last full indexer's selections (shared-indexer layers reuse them);
    /// `next_moe`: the next MoE layer, whose experts this layer's input predicts.
    fn forward(
        &self,
        li: usize,
        pass: &Pass,
        steps: &mut [Step],
        streams: Vec<f32>,
        carried: &mut Option<Vec<Selections>>,
        next_moe: Option<(usize, &Moe)>,
    ) -> anyhow::Result<Vec<f32>> {
        let (d, tokens) = (pass.cfg.hidden_size, pass.tokens);
        let name = |part: &str| format!("layers.{li}.{part}");

        let (mut x, mix) = self.attn_hc.collapse(&streams, tokens);
        pass.tap(&name("attn_hc.collapsed"), &x, d);
        ops::rms_norm(&mut x, Some(&self.input_norm), d, pass.cfg.rms_norm_eps);
        let y = self.attend(li, pass, steps, &x, carried);
        pass.tap(&name("self_attn"), &y, d);
        let streams = self.attn_hc.expand(&mix, &streams, &y, tokens);

        let (mut x, mix) = self.ffn_hc.collapse(&streams, tokens);
        pass.tap(&name("ffn_hc.collapsed"), &x, d);
        ops::rms_norm(
            &mut x,
            Some(&self.post_attention_norm),
            d,
            pass.cfg.rms_norm_eps,
        );
        let y = self.feed(li, pass, &x, next_moe)?;
        pass.tap(&name("mlp"), &y, d);
        let streams = self.ffn_hc.expand(&mix, &streams, &y, tokens);
        pass.tap(&format!("layers.{li}"), &streams, pass.cfg.hc_mult * d);
        Ok(streams)
    }

    /// The attention sublayer on the normed input `x`: KDA on each step's state, or MLA with
    /// the indexer on each step's cache.
    fn attend(
        &self,
        li: usize,
        pass: &Pass,
        steps: &mut [Step],
        x: &[f32],
        carried: &mut Option<Vec<Selections>>,
    ) -> Vec<f32> {
        match &self.attention {
            Attention::Kda(kda) => {
                let mut states: Vec<&mut KdaState> = steps
                    .iter_mut()
                    .map(|s| match &mut s.cache.layers[li] {
                        LayerCache::Kda(state) => state,
                        LayerCache::Mla(_) => unreachable!("cache built from the same config"),
                    })
                    .collect();
                kda.forward(x, pass.spans, &mut states, pass.options.kda)
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
                    x,
                    pass.spans,
                    &mut caches,
                    carried.as_deref(),
                    pass.options.mla,
                );
                if fresh.is_some() {
                    *carried = fresh;
                }
                y
            }
        }
    }

    /// The feed-forward sublayer on the normed input `x`: the dense MLP, or the MoE (after
    /// predicting the next MoE layer's picks from `x` when the experts read ahead).
    fn feed(
        &self,
        li: usize,
        pass: &Pass,
        x: &[f32],
        next_moe: Option<(usize, &Moe)>,
    ) -> anyhow::Result<Vec<f32>> {
        match &self.feed_forward {
            FeedForward::Dense(mlp) => Ok(mlp.forward(x, pass.tokens)),
            FeedForward::Moe(moe) => {
                // Layer-ahead prediction: the next MoE layer's router on this layer's input,
                // so its expert reads overlap this layer's compute.
                if pass.experts.wants_prefetch()
                    && let Some((next, next_moe)) = next_moe
                {
                    let predicted = next_moe.router.route(x, pass.tokens);
                    pass.experts.prefetch(next, &predicted.ids);
                }
                let (y, routing) = moe
                    .forward(li, x, pass.tokens, pass.phases, pass.experts)
                    .with_context(|| format!("experts of layer {li}"))?;
                if let Some(h) = pass.hooks {
                    h.routing(li, &routing);
                }
                Ok(y)
            }
        }
    }

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
