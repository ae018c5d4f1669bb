//! The MoE sublayer: a sigmoid router with correction bias and expert groups, routed experts
//! reached only through [`ExpertProvider`], and the shared expert.
//!
//! The router's choice is a [`Routing`] value handed to the provider, so a tiered store sees
//! every pick (to count, predict and prefetch) before it computes anything.

use super::config::Config;
use super::device::{Device, Host, RouteSpec};
use super::loader::{LoadError, Loader};
use super::mlp::SwiGlu;
use crate::backend::cpu::{Matrix, ops};
use crate::backend::cuda::Cuda;
use cudarc::driver::CudaSlice;
use rayon::prelude::*;
use std::sync::Arc;

/// What a token of a forward call is doing, from the kind of its step (not the call's token
/// count: a batched decode tick of several sequences is still decode, and a tick mixing
/// prompt chunks with decode steps has both).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Phase {
    /// A prompt token (or one of a prompt chunk).
    #[default]
    Prefill,
    /// The one new generated token of a sequence that already has a cache.
    Decode,
}

/// Per token: the `k` chosen experts and their weights, in the router's order.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    pub k: usize,
    /// `[T * k]`
    pub ids: Vec<u32>,
    /// `[T * k]`, already normalised and scaled.
    pub weights: Vec<f32>,
    /// `[T]`: each token's phase (empty for a prediction: all prefill).
    pub phases: Vec<Phase>,
}

impl Routing {
    pub fn tokens(&self) -> usize {
        self.ids.len() / self.k.max(1)
    }

    /// The phase of token `t`.
    pub fn phase(&self, t: usize) -> Phase {
        self.phases.get(t).copied().unwrap_or_default()
    }

    /// Token indices routed to each expert (`experts` long), in token order.
    pub fn tokens_per_expert(&self, experts: usize) -> Vec<Vec<(usize, usize)>> {
        let mut per = vec![Vec::new(); experts];
        for (i, &e) in self.ids.iter().enumerate() {
            per[e as usize].push((i / self.k, i % self.k));
        }
        per
    }
}

/// Where routed experts are computed. The engine holds one; a tiered store implements it.
pub trait ExpertProvider: Send + Sync {
    /// `out[t] = sum_j routing.weights[t, j] * expert(routing.ids[t, j])(x[t])` for layer
    /// `layer`; the sum runs in pick order `j = 0..k` so every provider gives the same bits.
    fn forward(
        &self,
        layer: usize,
        x: &[f32],
        routing: &Routing,
        out: &mut [f32],
    ) -> anyhow::Result<()>;

    /// Bytes of all routed expert weights this provider serves, wherever they reside.
    fn weight_bytes(&self) -> usize;

    /// Whether [`ExpertProvider::prefetch`] does anything (the model skips predicting if not).
    fn wants_prefetch(&self) -> bool {
        false
    }

    /// A prediction of layer `layer`'s picks (`ids`, any order, duplicates allowed), made one
    /// MoE layer ahead; a provider may start reading them. `prompt`: the forward has prompt
    /// tokens (a chunk's picks cover most of a layer, and reading them must not crowd out
    /// the current layer's).
    fn prefetch(&self, _layer: usize, _ids: &[u32], _prompt: bool) {}

    /// Called once when serving ends (after the last forward): a provider settles what it
    /// owes (pending moves, its saved state) and reports.
    fn finish(&self) -> anyhow::Result<()> {
        Ok(())
    }

    /// This provider taking token rows already on a GPU, when its products run there.
    fn on_device(&self) -> Option<&dyn DeviceExperts> {
        None
    }
}

/// An expert provider whose products run on a GPU, taking the token rows where they are
/// (see [`ExpertProvider::on_device`]): the GPU forward's activations need not come back to
/// the host and go out again around every MoE layer.
pub trait DeviceExperts {
    /// The device the products run on (the rows must live there).
    fn device(&self) -> &Arc<Cuda>;

    /// `ExpertProvider::forward` for `x` (`[tokens, hidden]` on [`DeviceExperts::device`]):
    /// the routed experts' weighted sum, `[tokens, hidden]`, on the device.
    fn forward_device(
        &self,
        layer: usize,
        x: &CudaSlice<f32>,
        routing: &Routing,
    ) -> anyhow::Result<CudaSlice<f32>>;

    /// Whether [`DeviceExperts::forward_routed`] serves `layer` for `picks` picks: every
    /// expert of the layer resident on the device, so no pick needs the host.
    fn routes(&self, _layer: usize, _picks: usize) -> bool {
        false
    }

    /// Counts `tokens` x `k` decode picks of `layer` that a replayed graph of
    /// [`DeviceExperts::forward_routed`]'s launches made (a replay runs no host code).
    fn count_replayed(&self, _layer: usize, _tokens: usize, _k: usize) {}

    /// [`DeviceExperts::forward_device`] with the router's picks on the device (`ids` int32
    /// and `weights`, `[tokens, k]`, as the router kernel wrote them; `phases` per token):
    /// nothing waits for the host. Only where [`DeviceExperts::routes`] said so.
    fn forward_routed(
        &self,
        layer: usize,
        _x: &CudaSlice<f32>,
        _ids: &CudaSlice<i32>,
        _weights: &CudaSlice<f32>,
        _phases: &[Phase],
        _k: usize,
    ) -> anyhow::Result<CudaSlice<f32>> {
        anyhow::bail!("layer {layer}: this provider takes its picks on the host")
    }
}

/// `(token, pick slot)` pairs routed to one expert.
type Picks = Vec<(usize, usize)>;

/// Runs the picked experts of one layer given a way to compute one expert on token rows,
/// and sums their weighted outputs per token in pick order.
pub fn combine_experts<F>(
    hidden: usize,
    x: &[f32],
    routing: &Routing,
    experts: usize,
    out: &mut [f32],
    run: F,
) -> anyhow::Result<()>
where
    F: Fn(usize, &[f32], usize) -> anyhow::Result<Vec<f32>> + Sync,
{
    let order: Vec<usize> = (0..experts).collect();
    combine_experts_in(hidden, x, routing, &order, out, run)
}

/// [`combine_experts`] running the experts in `order` (every picked expert listed once):
/// a provider whose weights arrive over time runs first what it has. The sum is the same
/// bits in any order (it runs per token in pick order once every expert is done).
pub fn combine_experts_in<F>(
    hidden: usize,
    x: &[f32],
    routing: &Routing,
    order: &[usize],
    out: &mut [f32],
    run: F,
) -> anyhow::Result<()>
where
    F: Fn(usize, &[f32], usize) -> anyhow::Result<Vec<f32>> + Sync,
{
    let k = routing.k;
    let tokens = routing.tokens();
    let experts = (routing.ids.iter().map(|&e| e as usize))
        .chain(order.iter().copied())
        .max()
        .map_or(0, |m| m + 1);
    let mut per_expert = routing.tokens_per_expert(experts);
    let ordered: Vec<(usize, Picks)> = order
        .iter()
        .map(|&e| (e, std::mem::take(&mut per_expert[e])))
        .collect();
    if per_expert.iter().any(|p| !p.is_empty()) {
        anyhow::bail!("an expert picked by the routing is missing from the product order");
    }
    let results: Vec<(Picks, Vec<f32>)> = ordered
        .into_par_iter()
        .filter(|(_, picks)| !picks.is_empty())
        .map(|(e, picks)| {
            let mut rows = Vec::with_capacity(picks.len() * hidden);
            for &(t, _) in &picks {
                rows.extend_from_slice(&x[t * hidden..(t + 1) * hidden]);
            }
            run(e, &rows, picks.len()).map(|y| (picks, y))
        })
        .collect::<anyhow::Result<_>>()?;
    let mut slots = vec![0f32; tokens * k * hidden];
    for (picks, y) in results {
        for (row, (t, j)) in picks.into_iter().enumerate() {
            slots[(t * k + j) * hidden..(t * k + j + 1) * hidden]
                .copy_from_slice(&y[row * hidden..(row + 1) * hidden]);
        }
    }
    for t in 0..tokens {
        let o = &mut out[t * hidden..(t + 1) * hidden];
        for j in 0..k {
            let w = routing.weights[t * k + j];
            ops::axpy(o, w, &slots[(t * k + j) * hidden..(t * k + j + 1) * hidden]);
        }
    }
    Ok(())
}

/// All routed experts in memory, as loaded from the checkpoint.
pub struct InMemoryExperts {
    hidden: usize,
    /// `[layer][expert]`; empty for dense layers.
    layers: Vec<Vec<SwiGlu>>,
}

impl InMemoryExperts {
    pub fn load(cfg: &Config, vb: Loader) -> Result<InMemoryExperts, LoadError> {
        let mut layers = Vec::new();
        for (i, kind) in cfg.mlp_kinds.iter().enumerate() {
            if *kind == super::config::MlpKind::Moe {
                let ev = vb.pp(&format!("layers.{i}.mlp.experts"));
                layers.push(
                    (0..cfg.n_routed_experts)
                        .map(|e| load_expert(cfg, ev, e))
                        .collect::<Result<_, _>>()?,
                );
            } else {
                layers.push(Vec::new());
            }
        }
        Ok(InMemoryExperts::new(cfg.hidden_size, layers))
    }

    /// These experts, `[layer][expert]` (empty for dense layers): ones read from elsewhere
    /// than the checkpoint, such as every record of a packed store.
    pub fn new(hidden: usize, layers: Vec<Vec<SwiGlu>>) -> InMemoryExperts {
        InMemoryExperts { hidden, layers }
    }

    pub fn expert(&self, layer: usize, expert: usize) -> Option<&SwiGlu> {
        self.layers.get(layer).and_then(|l| l.get(expert))
    }

    /// Bytes of all routed expert weights.
    pub fn storage_bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(SwiGlu::storage_bytes)
            .sum()
    }
}

/// One routed expert from either layout: per-expert keys (`experts.{e}.gate_proj.weight`)
/// or transformers' fused `experts.gate_up_proj` `[E, 2I, D]` / `experts.down_proj` `[E, D, I]`.
pub fn load_expert(cfg: &Config, experts: Loader, e: usize) -> Result<SwiGlu, LoadError> {
    let (d, i, n) = (
        cfg.hidden_size,
        cfg.moe_intermediate_size,
        cfg.n_routed_experts,
    );
    if experts.contains("gate_up_proj") {
        return Ok(SwiGlu {
            gate: experts.matrix_slice("gate_up_proj", [n, 2 * i, d], e, 0, i)?,
            up: experts.matrix_slice("gate_up_proj", [n, 2 * i, d], e, i, i)?,
            down: experts.matrix_slice("down_proj", [n, d, i], e, 0, d)?,
            limit: cfg.swiglu_limit,
        });
    }
    SwiGlu::load(experts.pp(&e.to_string()), d, i, cfg.swiglu_limit)
}

impl ExpertProvider for InMemoryExperts {
    fn forward(
        &self,
        layer: usize,
        x: &[f32],
        routing: &Routing,
        out: &mut [f32],
    ) -> anyhow::Result<()> {
        let experts = &self.layers[layer];
        combine_experts(self.hidden, x, routing, experts.len(), out, |e, rows, n| {
            Ok(experts[e].forward(rows, n))
        })
    }

    fn weight_bytes(&self) -> usize {
        self.storage_bytes()
    }
}

pub struct Router<D: Device = Host> {
    pub(crate) weight: D::Mat,
    pub(crate) bias: D::Buf,
    pub(crate) spec: RouteSpec,
}

impl Router {
    pub fn load(cfg: &Config, vb: Loader) -> Result<Router, LoadError> {
        let e = cfg.n_routed_experts;
        Ok(Router {
            weight: vb.matrix("weight", e, cfg.hidden_size)?,
            bias: vb.vector("e_score_correction_bias", e)?,
            spec: RouteSpec {
                experts: e,
                k: cfg.num_experts_per_tok,
                groups: cfg.n_group,
                topk_groups: cfg.topk_group,
                normalize: cfg.norm_topk_prob,
                scale: cfg.routed_scaling_factor,
            },
        })
    }

    /// A router from its parts (`weight` is `[experts, hidden]`).
    pub fn new(
        weight: Matrix,
        bias: Vec<f32>,
        top_k: usize,
        groups: usize,
        topk_groups: usize,
        normalize: bool,
        scale: f32,
    ) -> Router {
        Router {
            spec: RouteSpec {
                experts: weight.rows(),
                k: top_k,
                groups,
                topk_groups,
                normalize,
                scale,
            },
            weight,
            bias,
        }
    }

    pub fn bias(&self) -> &[f32] {
        &self.bias
    }

    /// [`Router::route`] from the logits (`[tokens, experts]`).
    pub fn choose(&self, logits: &[f32], tokens: usize) -> Routing {
        let (ids, weights) = choose(self.spec, &self.bias, logits, tokens);
        Routing {
            k: self.spec.k,
            ids,
            weights,
            phases: Vec::new(),
        }
    }

    /// This router's weights on `dev`.
    pub fn place<E: Device>(&self, dev: &E) -> anyhow::Result<Router<E>> {
        Ok(Router {
            weight: dev.matrix(&self.weight)?,
            bias: dev.upload(&self.bias)?,
            spec: self.spec,
        })
    }
}

impl<D: Device> Router<D> {
    /// Sigmoid scores; choice by score + bias within the best groups; weights from the scores.
    pub fn route(&self, dev: &D, x: &D::Buf, tokens: usize) -> anyhow::Result<Routing> {
        let (ids, weights) = dev.route(&self.weight, &self.bias, self.spec, x, tokens)?;
        Ok(Routing {
            k: self.spec.k,
            ids,
            weights,
            phases: Vec::new(),
        })
    }
}

/// The router's choice from its logits (`[tokens, experts]`), on the host: ids and weights.
pub(crate) fn choose(
    spec: RouteSpec,
    bias: &[f32],
    logits: &[f32],
    tokens: usize,
) -> (Vec<u32>, Vec<f32>) {
    let (e, k) = (spec.experts, spec.k);
    let per_group = e / spec.groups;
    let mut ids = Vec::with_capacity(tokens * k);
    let mut weights = Vec::with_capacity(tokens * k);
    for t in 0..tokens {
        let scores: Vec<f32> = logits[t * e..(t + 1) * e]
            .iter()
            .map(|&l| ops::sigmoid(l))
            .collect();
        let mut choice: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
        if spec.groups > 1 {
            let group_scores: Vec<f32> = choice
                .chunks_exact(per_group)
                .map(|g| ops::top_k(g, 2).iter().map(|&i| g[i]).sum())
                .collect();
            let keep = ops::top_k(&group_scores, spec.topk_groups);
            for (g, chunk) in choice.chunks_exact_mut(per_group).enumerate() {
                if !keep.contains(&g) {
                    chunk.iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
                }
            }
        }
        let picked = ops::top_k(&choice, k);
        let mut w: Vec<f32> = picked.iter().map(|&i| scores[i]).collect();
        if spec.normalize {
            let denom = w.iter().sum::<f32>() + 1e-20;
            w.iter_mut().for_each(|v| *v /= denom);
        }
        w.iter_mut().for_each(|v| *v *= spec.scale);
        ids.extend(picked.iter().map(|&i| i as u32));
        weights.extend(w);
    }
    (ids, weights)
}

pub struct Moe<D: Device = Host> {
    pub router: Router<D>,
    pub shared: Option<SwiGlu<D>>,
    hidden: usize,
}

impl Moe {
    pub fn load(cfg: &Config, vb: Loader) -> Result<Moe, LoadError> {
        let shared = if cfg.n_shared_experts > 0 {
            Some(SwiGlu::load(
                vb.pp("shared_experts"),
                cfg.hidden_size,
                cfg.moe_intermediate_size * cfg.n_shared_experts,
                cfg.swiglu_limit,
            )?)
        } else {
            None
        };
        Ok(Moe {
            router: Router::load(cfg, vb.pp("gate"))?,
            shared,
            hidden: cfg.hidden_size,
        })
    }

    /// This block's weights on `dev` (the routed experts are the provider's).
    pub fn place<E: Device>(&self, dev: &E) -> anyhow::Result<Moe<E>> {
        Ok(Moe {
            router: self.router.place(dev)?,
            shared: self.shared.as_ref().map(|s| s.place(dev)).transpose()?,
            hidden: self.hidden,
        })
    }
}

impl<D: Device> Moe<D> {
    /// Routed experts (through `experts`) plus the shared expert; returns the output and,
    /// when `want_routing` or the picks came to the host anyway, the routing.
    pub fn forward(
        &self,
        dev: &D,
        layer: usize,
        x: &D::Buf,
        phases: &[Phase],
        experts: &dyn ExpertProvider,
        want_routing: bool,
    ) -> anyhow::Result<(D::Buf, Option<Routing>)> {
        let tokens = phases.len();
        let routed = |dev: &D| -> anyhow::Result<(D::Buf, Option<Routing>)> {
            if !want_routing {
                let routed = dev.timed("moe routed", || {
                    dev.routed_experts(&self.router, experts, layer, x, phases)
                })?;
                if let Some(out) = routed {
                    return Ok((out, None));
                }
            }
            let routing = Routing {
                phases: phases.to_vec(),
                ..dev.timed("moe route", || self.router.route(dev, x, tokens))?
            };
            let out = dev.timed("moe experts", || {
                dev.experts(experts, layer, x, &routing, self.hidden)
            })?;
            Ok((out, Some(routing)))
        };
        let Some(shared) = &self.shared else {
            return routed(dev);
        };
        // The shared expert beside the routed ones (on a second queue where the device has
        // one), added after them.
        dev.beside(
            |dev| dev.timed("moe shared", || shared.run(dev, x, tokens)),
            routed,
            |dev, s, (mut out, routing)| {
                dev.add(&mut out, s, tokens * self.hidden)?;
                Ok((out, routing))
            },
        )
    }
}
