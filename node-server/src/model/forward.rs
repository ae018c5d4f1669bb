//! The model's one forward, over any [`Device`]: embeddings into `hc_mult` streams, then
//! per layer an attention sublayer (KDA or MLA+DSA) and a feed-forward sublayer (dense or
//! MoE), each wrapped in mHC; then the stream mean, a norm and the head.
//!
//! A forward call takes a batch of sequences, each with its own new tokens and cache.
//! Token-wise work (projections, norms, mHC, routing, experts) runs on all sequences' tokens
//! at once, each weight read once per call; sequence-wise work (conv, recurrence,
//! attention, the indexer) runs per sequence on its own caches.

use super::device::Device;
use super::glm5::{Attention, FeedForward, ForwardHooks, ForwardOptions, Layer, LayerCache};
use super::glm5::{Model, Step, Weights};
use super::kda::KdaState;
use super::mla::MlaCache;
use super::moe::{ExpertProvider, Moe, Phase};
use crate::model::config::Config;
use anyhow::{Context, bail};

/// Token rows of one forward call (the GPU grid's y and z dimensions index them).
pub const MAX_ROWS: usize = 65_535;

/// What every layer of one forward call shares: the device, the batch's layout, the kernel
/// forms, the experts and the hooks.
struct Pass<'a, D: Device> {
    dev: &'a D,
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

impl<D: Device> Pass<'_, D> {
    /// Shows `values` to the hooks as tensor `name` (brought to the host only when hooked).
    fn tap(&self, name: &str, values: &D::Buf, width: usize) -> anyhow::Result<()> {
        if let Some(h) = self.hooks {
            let mut host = self.dev.download(values)?;
            host.truncate(self.tokens * width);
            h.tensor(name, &host, width);
        }
        Ok(())
    }
}

impl Model {
    /// Runs every step's new tokens through the model on `dev` with the weights `w` (this
    /// model's, placed there), appending to each step's cache there. Returns, per step,
    /// logits rows (`[new tokens or 1, vocab]`, flattened). After an error a sequence may
    /// hold some layers' caches advanced and others not: drop the batch's sequences.
    pub fn forward_on<D: Device>(
        &self,
        dev: &D,
        w: &Weights<D>,
        steps: &mut [Step<D>],
        hooks: Option<&dyn ForwardHooks>,
    ) -> anyhow::Result<Vec<Vec<f32>>> {
        if w.layers.len() != self.cfg.num_hidden_layers {
            bail!("the weights are not this model's");
        }
        if steps.is_empty() {
            return Ok(Vec::new());
        }
        let spans = self.check_batch(steps)?;
        if hooks.is_none()
            && let Some(logits) = dev.decode_graph(self, w, steps)?
        {
            return Ok(logits);
        }
        let (logits, counts) = self.logits_on(dev, w, steps, &spans, hooks)?;
        let (width, v) = (D::mat_rows(&w.lm_head), self.cfg.vocab_size);
        let out = dev.download_rows(logits, &counts, width, v)?;
        if let Some(hk) = hooks {
            hk.tensor("logits", &out.concat(), v);
        }
        for (step, &(_, len)) in steps.iter_mut().zip(&spans) {
            step.cache.len += len;
        }
        Ok(out)
    }

    /// [`Model::forward_on`] up to the logits, left on the device (`[rows, lm_head rows]`),
    /// with the rows each step gets; the caches' token counts are not advanced. `spans`: what
    /// [`Model::check_batch`] gave for `steps`.
    pub(crate) fn logits_on<D: Device>(
        &self,
        dev: &D,
        w: &Weights<D>,
        steps: &mut [Step<D>],
        spans: &[(usize, usize)],
        hooks: Option<&dyn ForwardHooks>,
    ) -> anyhow::Result<(D::Buf, Vec<usize>)> {
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
            dev,
            cfg: &self.cfg,
            spans,
            tokens,
            phases: &phases,
            options: self.options,
            experts: self.experts().as_ref(),
            hooks,
        };
        let mut streams = dev.timed("embed", || self.embed_streams(steps, &pass))?;
        let mut carried: Option<Vec<D::Sel>> = None;
        for (li, layer) in w.layers.iter().enumerate() {
            let next_moe =
                w.layers
                    .iter()
                    .enumerate()
                    .skip(li + 1)
                    .find_map(|(i, l)| match &l.feed_forward {
                        FeedForward::Moe(m) => Some((i, m)),
                        FeedForward::Dense(_) => None,
                    });
            streams = layer.forward(li, &pass, steps, streams, &mut carried, next_moe)?;
        }
        dev.timed("lm head", || self.head(w, steps, &pass, &streams))
    }

    /// Checks each step of a batch (tokens to feed, ids in the vocabulary, a cache of this
    /// model) and gives its rows in the batch: `(first row, tokens)` per step.
    pub(crate) fn check_batch<D: Device>(
        &self,
        steps: &[Step<D>],
    ) -> anyhow::Result<Vec<(usize, usize)>> {
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
        if tokens > MAX_ROWS {
            bail!("a batch of {tokens} tokens; a forward call takes at most {MAX_ROWS}");
        }
        Ok(spans)
    }

    /// The batch's tokens embedded (rows read on the host), each row copied into the
    /// `hc_mult` residual streams (`[tokens, n, d]`) on the device.
    fn embed_streams<D: Device>(
        &self,
        steps: &[Step<D>],
        pass: &Pass<D>,
    ) -> anyhow::Result<D::Buf> {
        let d = self.cfg.hidden_size;
        let embedded = self.embedded_rows(steps);
        if let Some(h) = pass.hooks {
            h.tensor("embed", &embedded, d);
        }
        // Every stream starts as the token's embedding.
        pass.dev.take_repeated(embedded, d, self.cfg.hc_mult)
    }

    /// The batch's tokens' embedding rows, in order (`[tokens, hidden]`).
    pub(crate) fn embedded_rows<D: Device>(&self, steps: &[Step<D>]) -> Vec<f32> {
        let ids: Vec<usize> = steps
            .iter()
            .flat_map(|s| s.tokens.iter().map(|&t| t as usize))
            .collect();
        let mut embedded = vec![0f32; ids.len() * self.cfg.hidden_size];
        self.embed.gather_rows_f32(&ids, &mut embedded);
        embedded
    }

    /// The stream mean, the final norm and the head on the rows whose logits each step
    /// wants: the logits on the device, and how many rows each step has.
    fn head<D: Device>(
        &self,
        w: &Weights<D>,
        steps: &[Step<D>],
        pass: &Pass<D>,
        streams: &D::Buf,
    ) -> anyhow::Result<(D::Buf, Vec<usize>)> {
        let (cfg, dev) = (&self.cfg, pass.dev);
        let (d, n) = (cfg.hidden_size, cfg.hc_mult);
        // Rows whose logits are wanted.
        let mut rows = Vec::new();
        let mut counts = Vec::with_capacity(steps.len());
        for (step, &(start, len)) in steps.iter().zip(pass.spans) {
            let first = if step.all_logits {
                start
            } else {
                start + len - 1
            };
            rows.extend(first..start + len);
            counts.push(start + len - first);
        }
        let mut h = dev.stream_mean(streams, &rows, n, d)?;
        dev.rms_norm(&mut h, Some(&w.norm), d, cfg.rms_norm_eps)?;
        let hooked = Pass {
            tokens: rows.len(),
            ..*pass
        };
        hooked.tap("norm", &h, d)?;
        let logits = dev.matmul(&w.lm_head, &h, rows.len())?;
        Ok((logits, counts))
    }
}

impl<D: Device> Layer<D> {
    /// One decoder layer on the batch's residual streams (`[tokens, n, d]`): the attention
    /// sublayer, then the feed-forward sublayer, each inside its mHC collapse and expand.
    /// `carried`: the last full indexer's selections (shared-indexer layers reuse them);
    /// `next_moe`: the next MoE layer, whose experts this layer's input predicts.
    fn forward(
        &self,
        li: usize,
        pass: &Pass<D>,
        steps: &mut [Step<D>],
        streams: D::Buf,
        carried: &mut Option<Vec<D::Sel>>,
        next_moe: Option<(usize, &Moe<D>)>,
    ) -> anyhow::Result<D::Buf> {
        let (dev, cfg, tokens) = (pass.dev, pass.cfg, pass.tokens);
        let d = cfg.hidden_size;
        let name = |part: &str| format!("layers.{li}.{part}");

        let attn_in = name("attn_hc.collapsed");
        let mix = Self::sublayer_input(pass, &self.attn_hc, &self.input_norm, &streams, &attn_in)?;
        let y = self.attend(li, pass, steps, &mix.collapsed, carried)?;
        pass.tap(&name("self_attn"), &y, d)?;
        let streams = dev.timed("mhc expand", || {
            self.attn_hc.expand(dev, &mix, &streams, &y, tokens)
        })?;

        let ffn_in = name("ffn_hc.collapsed");
        let norm = &self.post_attention_norm;
        let mix = Self::sublayer_input(pass, &self.ffn_hc, norm, &streams, &ffn_in)?;
        let y = self.feed(li, pass, &mix.collapsed, next_moe)?;
        pass.tap(&name("mlp"), &y, d)?;
        let streams = dev.timed("mhc expand", || {
            self.ffn_hc.expand(dev, &mix, &streams, &y, tokens)
        })?;
        pass.tap(&format!("layers.{li}"), &streams, cfg.hc_mult * d)?;
        Ok(streams)
    }

    /// A sublayer's input: `streams` collapsed by `hc`, then RMS-normed with `norm` — one
    /// fused op, unless a tap wants the collapsed rows before the norm (`tap` names them).
    fn sublayer_input(
        pass: &Pass<D>,
        hc: &super::mhc::HyperConnection<D>,
        norm: &D::Buf,
        streams: &D::Buf,
        tap: &str,
    ) -> anyhow::Result<super::device::MhcCollapse<D::Buf>> {
        let (dev, tokens) = (pass.dev, pass.tokens);
        let (d, eps) = (pass.cfg.hidden_size, pass.cfg.rms_norm_eps);
        if pass.hooks.is_none() {
            return dev.timed("mhc collapse", || {
                hc.collapse_normed(dev, streams, tokens, norm, eps)
            });
        }
        let mut mix = dev.timed("mhc collapse", || hc.collapse(dev, streams, tokens))?;
        pass.tap(tap, &mix.collapsed, d)?;
        dev.rms_norm(&mut mix.collapsed, Some(norm), d, eps)?;
        Ok(mix)
    }

    /// The attention sublayer on the normed input `x`: KDA on each step's state, or MLA with
    /// the indexer on each step's cache.
    fn attend(
        &self,
        li: usize,
        pass: &Pass<D>,
        steps: &mut [Step<D>],
        x: &D::Buf,
        carried: &mut Option<Vec<D::Sel>>,
    ) -> anyhow::Result<D::Buf> {
        let dev = pass.dev;
        match &self.attention {
            Attention::Kda(kda) => {
                let mut states = Vec::with_capacity(steps.len());
                for s in steps.iter_mut() {
                    let LayerCache::Kda(state) = &mut s.cache.layers[li] else {
                        bail!("layer {li}: a sequence's cache kind differs from the layer's");
                    };
                    states.push(state);
                }
                let states: &mut [&mut KdaState<D>] = &mut states;
                dev.timed("kda", || {
                    kda.forward(dev, x, pass.spans, states, pass.options.kda)
                })
            }
            Attention::Mla(mla) => {
                let mut caches = Vec::with_capacity(steps.len());
                for s in steps.iter_mut() {
                    let LayerCache::Mla(cache) = &mut s.cache.layers[li] else {
                        bail!("layer {li}: a sequence's cache kind differs from the layer's");
                    };
                    caches.push(cache);
                }
                let caches: &mut [&mut MlaCache<D>] = &mut caches;
                dev.timed("mla", || {
                    mla.forward(dev, x, pass.spans, caches, carried, pass.options.mla)
                })
            }
        }
    }

    /// The feed-forward sublayer on the normed input `x`: the dense MLP, or the MoE (after
    /// predicting the next MoE layer's picks from `x` when the experts read ahead).
    fn feed(
        &self,
        li: usize,
        pass: &Pass<D>,
        x: &D::Buf,
        next_moe: Option<(usize, &Moe<D>)>,
    ) -> anyhow::Result<D::Buf> {
        let dev = pass.dev;
        match &self.feed_forward {
            FeedForward::Dense(mlp) => dev.timed("dense mlp", || mlp.run(dev, x, pass.tokens)),
            FeedForward::Moe(moe) => {
                // Layer-ahead prediction: the next MoE layer's router on this layer's input,
                // so its expert reads overlap the compute before it. A prompt chunk's picks
                // cover most of a layer: the tiers read them once this layer's own reads are
                // done with (see `TieredExperts::prefetch`).
                if pass.experts.wants_prefetch()
                    && let Some((next, next_moe)) = next_moe
                {
                    let predicted = next_moe.router.route(dev, x, pass.tokens)?;
                    let prompt = pass.phases.contains(&Phase::Prefill);
                    pass.experts.prefetch(next, &predicted.ids, prompt);
                }
                let (y, routing) = moe
                    .forward(dev, li, x, pass.phases, pass.experts, pass.hooks.is_some())
                    .with_context(|| format!("experts of layer {li}"))?;
                if let (Some(h), Some(routing)) = (pass.hooks, routing) {
                    h.routing(li, &routing);
                }
                Ok(y)
            }
        }
    }
}
