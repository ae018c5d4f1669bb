//! The GLM-5.3-Flash text model: embeddings into `hc_mult` streams, then per layer an
//! attention sublayer (KDA or MLA+DSA) and a feed-forward sublayer (dense or MoE), each
//! wrapped in mHC; then the stream mean, a norm and the head.
//!
//! A forward call takes a batch of sequences, each with its own new tokens and cache.
//! Token-wise work (projections, experts, mHC) runs on all sequences' tokens at once;
//! sequence-wise work (conv, recurrence, attention) runs per sequence.

use super::checkpoint::Checkpoint;
use super::config::{AttnKind, Config, IndexerKind, MlpKind};
use super::device::{CacheDtype, Device, Host};
use super::kda::{Kda, KdaMode, KdaState, QkvProjection};
use super::loader::{LoadError, Loader};
use super::mhc::HyperConnection;
use super::mla::{Mla, MlaCache, MlaPath};
use super::mlp::SwiGlu;
use super::moe::{ExpertProvider, InMemoryExperts, Moe, Routing};
use crate::backend::cpu::{Matrix, Placer, ops};
use anyhow::{Context, bail};
use std::path::Path;
use std::sync::Arc;

pub enum Attention<D: Device = Host> {
    Kda(Kda<D>),
    Mla(Mla<D>),
}

pub enum FeedForward<D: Device = Host> {
    Dense(SwiGlu<D>),
    Moe(Moe<D>),
}

pub struct Layer<D: Device = Host> {
    pub(crate) attn_hc: HyperConnection<D>,
    pub(crate) ffn_hc: HyperConnection<D>,
    pub(crate) input_norm: D::Buf,
    pub(crate) post_attention_norm: D::Buf,
    pub attention: Attention<D>,
    pub feed_forward: FeedForward<D>,
}

/// Every weight a forward reads but the embedding and the routed experts, on one device.
pub struct Weights<D: Device = Host> {
    pub layers: Vec<Layer<D>>,
    pub(crate) norm: D::Buf,
    pub(crate) lm_head: D::Mat,
}

/// Per-layer cache of one sequence, on the device its forward runs on.
pub enum LayerCache<D: Device = Host> {
    Kda(KdaState<D>),
    Mla(MlaCache<D>),
}

/// Everything one sequence carries between forward calls, on the device its forward runs
/// on.
pub struct SeqCache<D: Device = Host> {
    pub layers: Vec<LayerCache<D>>,
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

impl Clone for SeqCache {
    fn clone(&self) -> Self {
        SeqCache {
            layers: self
                .layers
                .iter()
                .map(|l| match l {
                    LayerCache::Kda(s) => LayerCache::Kda(s.clone()),
                    LayerCache::Mla(c) => LayerCache::Mla(c.clone()),
                })
                .collect(),
            len: self.len,
        }
    }
}

impl PartialEq for SeqCache {
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len
            && self.layers.len() == other.layers.len()
            && self
                .layers
                .iter()
                .zip(&other.layers)
                .all(|(a, b)| match (a, b) {
                    (LayerCache::Kda(a), LayerCache::Kda(b)) => a == b,
                    (LayerCache::Mla(a), LayerCache::Mla(b)) => a == b,
                    _ => false,
                })
    }
}

impl std::fmt::Debug for SeqCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SeqCache")
            .field("len", &self.len)
            .field("layers", &self.layers.len())
            .finish()
    }
}

impl<D: Device> SeqCache<D> {
    /// Tokens processed so far.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// One sequence's share of a forward call.
pub struct Step<'a, D: Device = Host> {
    pub tokens: &'a [u32],
    pub cache: &'a mut SeqCache<D>,
    /// Logits for every new token (else only the last).
    pub all_logits: bool,
}

impl<D: Device> Step<'_, D> {
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

/// Which kernel forms a forward call uses (tests pin them to compare forms), and the dtype
/// of the caches [`Model::new_cache`] makes (`--cache-dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForwardOptions {
    pub kda: KdaMode,
    pub mla: MlaPath,
    /// How new caches store MLA latents and DSA indexer keys.
    pub cache: CacheDtype,
}

impl Default for ForwardOptions {
    fn default() -> Self {
        ForwardOptions {
            kda: KdaMode::Auto,
            mla: MlaPath::Auto,
            cache: CacheDtype::F32,
        }
    }
}

pub struct Model {
    pub cfg: Config,
    pub(crate) embed: Matrix,
    /// The weights on the host (each matrix with its device copy, when placed).
    pub weights: Weights,
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
            weights: Weights {
                norm: vb.vector("norm.weight", d)?,
                layers,
                lm_head,
            },
            embed,
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
                .zip(&self.cfg.indexer_kinds)
                .map(|(k, ix)| match k {
                    AttnKind::Kda => LayerCache::Kda(KdaState::new(&self.cfg)),
                    AttnKind::Mla => {
                        LayerCache::Mla(MlaCache::new(self.options.cache, *ix == IndexerKind::Full))
                    }
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

    /// Runs every step's new tokens through the model on the host, appending to its cache.
    /// Returns, per step, logits rows (`[new tokens or 1, vocab]`, flattened).
    pub fn forward(
        &self,
        steps: &mut [Step],
        hooks: Option<&dyn ForwardHooks>,
    ) -> anyhow::Result<Vec<Vec<f32>>> {
        self.forward_on(&Host, &self.weights, steps, hooks)
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

    /// This layer's weights on `dev`.
    pub fn place<E: Device>(&self, dev: &E) -> anyhow::Result<Layer<E>> {
        Ok(Layer {
            attn_hc: self.attn_hc.place(dev)?,
            ffn_hc: self.ffn_hc.place(dev)?,
            input_norm: dev.upload(&self.input_norm)?,
            post_attention_norm: dev.upload(&self.post_attention_norm)?,
            attention: match &self.attention {
                Attention::Kda(k) => Attention::Kda(k.place(dev)?),
                Attention::Mla(m) => Attention::Mla(m.place(dev)?),
            },
            feed_forward: match &self.feed_forward {
                FeedForward::Dense(mlp) => FeedForward::Dense(mlp.place(dev)?),
                FeedForward::Moe(moe) => FeedForward::Moe(moe.place(dev)?),
            },
        })
    }
}

impl Weights {
    /// Gives back the host bytes of every matrix a device copy holds ([`Matrix::release_host`]),
    /// but MLA's `kv_b`, which the forwards read by rows (a GPU decoder makes its f32 table
    /// from them); returns the bytes freed. Host forwards then run every product on the
    /// device, with no CPU fallback.
    pub fn release_host_copies(&mut self) -> usize {
        let mut mats: Vec<&mut Matrix> = vec![&mut self.lm_head];
        for layer in &mut self.layers {
            mats.push(&mut layer.attn_hc.proj);
            mats.push(&mut layer.ffn_hc.proj);
            match &mut layer.attention {
                Attention::Kda(k) => {
                    match &mut k.qkv {
                        QkvProjection::Split { q, k, v } => mats.extend([q, k, v]),
                        QkvProjection::Fused(qkv) => mats.push(qkv),
                    }
                    mats.extend([
                        &mut k.f_a,
                        &mut k.f_b,
                        &mut k.b_proj,
                        &mut k.g_a,
                        &mut k.g_b,
                        &mut k.o_proj,
                    ]);
                }
                Attention::Mla(m) => {
                    mats.extend([&mut m.q_a, &mut m.q_b, &mut m.kv_a, &mut m.o_proj]);
                    if let Some(ix) = &mut m.indexer {
                        mats.extend([&mut ix.wq_b, &mut ix.wk, &mut ix.weights_proj, &mut ix.gate]);
                    }
                }
            }
            let (router, mlp) = match &mut layer.feed_forward {
                FeedForward::Dense(mlp) => (None, Some(mlp)),
                FeedForward::Moe(moe) => (Some(&mut moe.router.weight), moe.shared.as_mut()),
            };
            mats.extend(router);
            if let Some(mlp) = mlp {
                mats.extend([&mut mlp.gate, &mut mlp.up, &mut mlp.down]);
            }
        }
        mats.into_iter().map(Matrix::release_host).sum()
    }

    /// These weights on `dev`.
    pub fn place<E: Device>(&self, dev: &E) -> anyhow::Result<Weights<E>> {
        Ok(Weights {
            layers: self
                .layers
                .iter()
                .enumerate()
                .map(|(i, l)| l.place(dev).with_context(|| format!("layer {i}")))
                .collect::<anyhow::Result<_>>()?,
            norm: dev.upload(&self.norm)?,
            lm_head: dev.matrix(&self.lm_head)?,
        })
    }
}
