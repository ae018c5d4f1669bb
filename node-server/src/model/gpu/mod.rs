//! The forward of the model with the sequences' activations on the GPU: the `hc_mult`
//! residual streams, every sublayer's intermediates and each sequence's caches (KDA conv and
//! recurrent states, MLA latents, indexer keys, gates and pool keys) stay in device memory
//! from one call to the next; only the tokens' embedding rows go up and the logits come down
//! (and the routing, see below).
//!
//! [`GpuDecoder`] holds device copies of the weights of a loaded [`Model`] (the copy a
//! weight matrix already carries on this device when it has one, else an upload of its
//! bytes), and [`GpuSeq`] one sequence's caches, made from a CPU [`SeqCache`] (empty for a
//! new sequence, or after a host prefill). Every op follows the CPU forward (`model::glm5`)
//! in order of operations:
//!
//! - KDA layers: projections, conv, forget gate and beta, the delta rule (the chunked form
//!   over a prompt chunk, the recurrent one over decode steps), the gated norm and the
//!   output projection all on the device.
//! - MLA + DSA layers: the absorbed path (`Mla::attend_absorbed`) for every query, prompt
//!   chunks included, with `kv_b` dequantized once to f32 (the values `Matrix::row_f32` gives
//!   the CPU path); the indexer (keys, pool keys, scores, top pools) on the device;
//!   shared-indexer layers reuse the last full layer's device selection.
//! - MoE layers: the router on the device (its picks come down: the tiers decide residency
//!   on the host), the routed experts through the model's [`ExpertProvider`] — on the
//!   device rows when it computes on this GPU (`ExpertProvider::on_device`: all in VRAM, or
//!   tiers with a GPU device tier, whose CPU lane alone takes rows down), else on host rows
//!   (the call's rows down, their outputs up) — and the shared expert on the device. Dense
//!   layers on the device.
//!
//! [`GpuDecoder::forward`] advances a batch of sequences together, each by one decode token
//! or a chunk of its prompt: the weight products, norms, mHC and routing run over all the
//! batch's token rows (each weight read once per call), each sequence's attention core on
//! its own caches. The serving engine runs its sequences through it when the dense weights
//! are on a GPU (`--gpu-forward`).
//!
//! Scratch buffers are allocated per op and small uploads (selection offsets, routing) go
//! per launch; a preallocated arena, fused launches and graph capture are next.
//!
//! It is the model's second forward (beside `glm5::Model::forward`) until each block is
//! written once over the device ops; the ops themselves (kernels, cuBLAS) live in
//! `backend::cuda`, which knows no model type.

mod blocks;
mod seq;
mod weights;

use crate::backend::cpu::Matrix;
use crate::backend::cuda::attn::{DeviceSelections, DsaSpec};
use crate::backend::cuda::matrix::CudaMatrix;
use crate::backend::cuda::{Cuda, KdaSpec, MhcSpec, RouteSpec};
use crate::model::config::Config;
use crate::model::glm5::{Attention, FeedForward, Model};
use crate::model::moe::Phase;
use anyhow::{Context, bail};
use cudarc::driver::CudaSlice;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

type Buf = CudaSlice<f32>;

/// Queries of one attention launch (its scratch holds a score per selected token of each
/// query and head: 256 x 64 heads x 2,048 tokens is 128 MiB at the real widths).
const ATTN_QUERIES: usize = 256;

/// A sequence's caches on the GPU hold at most `1 + 1 / GROWTH_SLACK` times their values.
pub const GROWTH_SLACK: usize = 4;

/// Token rows of one forward call (the grid's y and z dimensions index them).
pub const MAX_ROWS: usize = 65_535;

/// A device buffer that grows by appended rows (the caches of MLA layers).
struct DevVec {
    buf: Buf,
    /// Values in use.
    len: usize,
}

struct DevHc {
    proj: CudaMatrix,
    base: Buf,
    spec: MhcSpec,
    norm_eps: f32,
}

struct DevKda {
    q: CudaMatrix,
    k: CudaMatrix,
    v: CudaMatrix,
    conv: Buf,
    f_a: CudaMatrix,
    f_b: CudaMatrix,
    dt_bias: Buf,
    a_log: Buf,
    b_proj: CudaMatrix,
    g_a: CudaMatrix,
    g_b: CudaMatrix,
    o_norm: Buf,
    o_proj: CudaMatrix,
    spec: KdaSpec,
    lower_bound: Option<f32>,
    eps: f32,
}

struct DevIndexer {
    wq_b: CudaMatrix,
    wk: CudaMatrix,
    k_norm_weight: Buf,
    k_norm_bias: Buf,
    weights_proj: CudaMatrix,
    ape: Buf,
    gate: CudaMatrix,
    spec: DsaSpec,
}

struct DevMla {
    q_a: CudaMatrix,
    q_a_norm: Buf,
    q_b: CudaMatrix,
    kv_a: CudaMatrix,
    kv_a_norm: Buf,
    /// `kv_b` dequantized to f32, `[heads * (nope + v_dim), rank]`.
    kv_b: Buf,
    o_proj: CudaMatrix,
    indexer: Option<DevIndexer>,
    heads: usize,
    nope: usize,
    v_dim: usize,
    rank: usize,
    eps: f32,
}

struct DevMlp {
    gate: CudaMatrix,
    up: CudaMatrix,
    down: CudaMatrix,
    limit: f32,
}

struct DevMoe {
    router: CudaMatrix,
    bias: Buf,
    spec: RouteSpec,
    shared: Option<DevMlp>,
}

enum DevAttention {
    Kda(DevKda),
    Mla(DevMla),
}

enum DevFeedForward {
    Dense(DevMlp),
    Moe(DevMoe),
}

struct DevLayer {
    attn_hc: DevHc,
    ffn_hc: DevHc,
    input_norm: Buf,
    post_attention_norm: Buf,
    attention: DevAttention,
    feed_forward: DevFeedForward,
}

/// Runs decode steps of a loaded [`Model`] with the activations on one CUDA device.
pub struct GpuDecoder {
    cuda: Arc<Cuda>,
    cfg: Config,
    layers: Vec<DevLayer>,
    norm: Buf,
    lm_head: CudaMatrix,
    /// Wall time per phase of the forward, each phase between two synchronisations; only
    /// with `GLMFLASH_GPU_PROFILE` set (the synchronisations cost overlap).
    profile: Option<Mutex<BTreeMap<&'static str, (f64, u64)>>>,
}

/// One sequence's caches on the device, advanced by [`GpuDecoder::step`].
pub struct GpuSeq {
    layers: Vec<SeqLayer>,
    /// Tokens processed so far.
    len: usize,
}

enum SeqLayer {
    Kda {
        /// `[(K - 1), 3C]`
        conv: Buf,
        /// `[H, Dk, Dv]`
        recurrent: Buf,
    },
    Mla {
        /// `[T, rank]`
        latents: DevVec,
        /// Present on layers with a full indexer.
        indexer: Option<DevIndexerCache>,
    },
}

struct DevIndexerCache {
    keys: DevVec,
    gates: DevVec,
    pool_keys: DevVec,
}

/// Tokens of room the MLA caches are made with beyond what the CPU cache holds.
pub const CACHE_SPARE_TOKENS: usize = 256;

impl GpuSeq {
    /// Tokens processed so far.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl GpuDecoder {
    /// The device the decoder runs on.
    pub fn device(&self) -> &Arc<Cuda> {
        &self.cuda
    }

    /// Device copies of every weight of `model` but the routed experts and the embedding
    /// (read one row per token on the host).
    pub fn new(cuda: &Arc<Cuda>, model: &Model) -> anyhow::Result<GpuDecoder> {
        let layers = model
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| DevLayer::new(cuda, l).with_context(|| format!("layer {i}")))
            .collect::<anyhow::Result<_>>()?;
        Ok(GpuDecoder {
            cuda: cuda.clone(),
            cfg: model.cfg.clone(),
            layers,
            norm: cuda.upload(&model.norm)?,
            lm_head: CudaMatrix::of(cuda, &model.lm_head)?,
            profile: std::env::var_os("GLMFLASH_GPU_PROFILE").map(|_| Default::default()),
        })
    }

    /// `f`'s wall time added to phase `name` when profiling (the device synchronised before
    /// and after, so the time is the phase's own); just `f` otherwise.
    fn timed<T>(
        &self,
        name: &'static str,
        f: impl FnOnce() -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        let Some(profile) = &self.profile else {
            return f();
        };
        self.cuda.synchronize()?;
        let started = std::time::Instant::now();
        let out = f()?;
        self.cuda.synchronize()?;
        let mut p = profile.lock().unwrap_or_else(|e| e.into_inner());
        let e = p.entry(name).or_default();
        e.0 += started.elapsed().as_secs_f64();
        e.1 += 1;
        Ok(out)
    }

    /// The profile so far, (phase, seconds, times run), most time first; and resets it.
    /// Empty unless `GLMFLASH_GPU_PROFILE` was set when the decoder was made.
    pub fn take_profile(&self) -> Vec<(&'static str, f64, u64)> {
        let Some(profile) = &self.profile else {
            return Vec::new();
        };
        let p = std::mem::take(&mut *profile.lock().unwrap_or_else(|e| e.into_inner()));
        let mut v: Vec<_> = p.into_iter().map(|(k, (s, n))| (k, s, n)).collect();
        v.sort_by(|a, b| b.1.total_cmp(&a.1));
        v
    }

    /// Feeds `token` to `seq` and returns the next token's logits (`[vocab]`); see
    /// [`GpuDecoder::step_batch`].
    pub fn step(&self, model: &Model, seq: &mut GpuSeq, token: u32) -> anyhow::Result<Vec<f32>> {
        Ok(self.step_batch(model, &mut [seq], &[token])?.remove(0))
    }

    /// Feeds `tokens[i]` to `seqs[i]` for every sequence in one pass over the layers and
    /// returns each one's next-token logits (`[vocab]` each); see [`GpuDecoder::forward`].
    pub fn step_batch(
        &self,
        model: &Model,
        seqs: &mut [&mut GpuSeq],
        tokens: &[u32],
    ) -> anyhow::Result<Vec<Vec<f32>>> {
        let chunks: Vec<&[u32]> = tokens.iter().map(std::slice::from_ref).collect();
        self.forward(model, seqs, &chunks)
    }

    /// Feeds `tokens[i]` (one decode token, or a chunk of a prompt) to `seqs[i]` for every
    /// sequence in one pass over the layers and returns each one's logits after its last
    /// token (`[vocab]` each). The weight products, norms, mHC and routing run over all the
    /// batch's token rows at once (every weight is read once per call, and the routed
    /// experts see the batch's picks together); each sequence's attention core (KDA conv and
    /// delta rule over its tokens in order, MLA over its latents, its indexer) runs on its
    /// own caches. A sequence's tokens are decode picks ([`Phase::Decode`]) when it feeds
    /// one token onto a cache that holds some, else prefill (as `Step::is_decode`).
    /// `model` must be the model this decoder was made from (its routed experts and
    /// embedding rows are read from it). After an error a sequence may hold some layers'
    /// caches advanced and others not: drop the batch's sequences.
    pub fn forward(
        &self,
        model: &Model,
        seqs: &mut [&mut GpuSeq],
        tokens: &[&[u32]],
    ) -> anyhow::Result<Vec<Vec<f32>>> {
        let cuda = &*self.cuda;
        let cfg = &self.cfg;
        let (d, n, v) = (cfg.hidden_size, cfg.hc_mult, cfg.vocab_size);
        let b = seqs.len();
        if b == 0 || tokens.len() != b {
            bail!("a batch of {b} sequences with {} token lists", tokens.len());
        }
        if model.layers.len() != self.layers.len() || model.cfg.hidden_size != d {
            bail!("the model is not the one this decoder was made from");
        }
        // Each sequence's rows of the batch: (first row, tokens).
        let mut rows = Vec::with_capacity(b);
        let mut total = 0;
        for (i, t) in tokens.iter().enumerate() {
            if t.is_empty() {
                bail!("sequence {i} of the batch has no tokens to process");
            }
            rows.push((total, t.len()));
            total += t.len();
        }
        if total > MAX_ROWS {
            bail!("a batch of {total} tokens; the GPU forward takes at most {MAX_ROWS} per call");
        }
        let mut host = Vec::with_capacity(total * n * d);
        for (i, (t, seq)) in tokens.iter().zip(seqs.iter()).enumerate() {
            if seq.layers.len() != self.layers.len() {
                bail!("sequence {i} does not belong to this model");
            }
            for &token in t.iter() {
                if token as usize >= v {
                    bail!("sequence {i}: token id {token} is outside the vocabulary (size {v})");
                }
                let row = model.embed.row_f32(token as usize);
                for _ in 0..n {
                    host.extend_from_slice(&row);
                }
            }
        }
        let mut streams = self.timed("embed", || Ok(cuda.upload(&host)?))?;
        drop(host);
        let positions: Vec<usize> = seqs.iter().map(|s| s.len).collect();
        let phases: Vec<Phase> = rows
            .iter()
            .zip(&positions)
            .flat_map(|(&(_, len), &pos)| {
                let phase = if len == 1 && pos > 0 {
                    Phase::Decode
                } else {
                    Phase::Prefill
                };
                std::iter::repeat_n(phase, len)
            })
            .collect();
        // Each sequence's last full indexer layer's selection, used by the shared layers
        // after it.
        let mut carried: Vec<Option<DeviceSelections>> = (0..b).map(|_| None).collect();
        for (li, layer) in self.layers.iter().enumerate() {
            let mix = self.timed("mhc collapse", || {
                self.collapse(&layer.attn_hc, &streams, total)
            })?;
            let mut x = mix.collapsed;
            cuda.rms_norm(&mut x, Some(&layer.input_norm), d, cfg.rms_norm_eps)?;
            let y = match &layer.attention {
                DevAttention::Kda(w) => {
                    let mut states = Vec::with_capacity(b);
                    for s in seqs.iter_mut() {
                        let SeqLayer::Kda { conv, recurrent } = &mut s.layers[li] else {
                            bail!("layer {li}: a sequence's cache kind differs from the layer's");
                        };
                        states.push((conv, recurrent));
                    }
                    self.timed("kda", || self.kda(w, &x, &mut states, &rows))?
                }
                DevAttention::Mla(w) => {
                    let mut states = Vec::with_capacity(b);
                    for s in seqs.iter_mut() {
                        let SeqLayer::Mla { latents, indexer } = &mut s.layers[li] else {
                            bail!("layer {li}: a sequence's cache kind differs from the layer's");
                        };
                        states.push((latents, indexer.as_mut()));
                    }
                    self.timed("mla", || {
                        self.mla(w, &x, &mut states, &rows, &positions, &mut carried)
                    })?
                }
            };
            streams = self.timed("mhc expand", || {
                self.expand(&layer.attn_hc, &mix.post, &mix.comb, &streams, &y, total)
            })?;

            let mix = self.timed("mhc collapse", || {
                self.collapse(&layer.ffn_hc, &streams, total)
            })?;
            let mut x = mix.collapsed;
            cuda.rms_norm(
                &mut x,
                Some(&layer.post_attention_norm),
                d,
                cfg.rms_norm_eps,
            )?;
            let y = match &layer.feed_forward {
                DevFeedForward::Dense(mlp) => {
                    self.timed("dense mlp", || self.mlp(mlp, &x, total))?
                }
                DevFeedForward::Moe(moe) => self
                    .moe(model, li, moe, &x, &phases)
                    .with_context(|| format!("experts of layer {li}"))?,
            };
            streams = self.timed("mhc expand", || {
                self.expand(&layer.ffn_hc, &mix.post, &mix.comb, &streams, &y, total)
            })?;
        }

        // The stream mean of each sequence's last token.
        let mut h = cuda.alloc_f32(b * d)?;
        for (i, &(first, len)) in rows.iter().enumerate() {
            let last = first + len - 1;
            let src = streams.slice(last * n * d..(last + 1) * n * d);
            cuda.stream_mean(&src, n, d, &mut h.slice_mut(i * d..(i + 1) * d))?;
        }
        let all = self.timed("lm head", || {
            cuda.rms_norm(&mut h, Some(&self.norm), d, cfg.rms_norm_eps)?;
            let logits = self.lm_head.apply(&h, b)?;
            Ok(cuda.download(&logits)?)
        })?;
        for (s, &(_, len)) in seqs.iter_mut().zip(&rows) {
            s.len += len;
        }
        Ok(all
            .chunks(self.lm_head.rows())
            .take(b)
            .map(|row| row[..v].to_vec())
            .collect())
    }
}

/// Prompt tokens of one GPU forward call the engine plans for (`--gpu-chunk-size`'s default,
/// and what VRAM sizing keeps room for).
pub const DEFAULT_GPU_CHUNK: usize = 2048;

/// Bytes of device memory one [`GpuDecoder::forward`] call of `rows` token rows allocates
/// beyond the weights and the sequences' caches, with sequences of up to `context` tokens:
/// per row the residual streams (three copies live at once) plus the widest sublayer's
/// buffers (KDA, MLA with its indexer, or an MLP), the indexer's pool scores, one
/// attention group's scratch, and a weight tile widened for cuBLAS. An estimate from the
/// widths, counted per buffer; the stream-ordered allocator's rounding comes on top.
pub fn workspace_bytes(cfg: &Config, rows: usize, context: usize) -> usize {
    let (d, n, h) = (cfg.hidden_size, cfg.hc_mult, cfg.num_attention_heads);
    let c = cfg.kda_dim();
    let (di, hi) = (cfg.index_head_dim, cfg.index_n_heads);
    let streams = 3 * n * d + 2 * d;
    let kda = 14 * c + cfg.linear_num_heads;
    let mla = cfg.q_lora_rank
        + h * cfg.qk_nope_head_dim
        + cfg.kv_lora_rank
        + h * cfg.v_head_dim
        + 2 * hi * di
        + 2 * di
        + 2 * hi
        + context / cfg.index_kpool.max(1);
    let shared = cfg.moe_intermediate_size * cfg.n_shared_experts.max(1);
    let mlp = 3 * cfg.intermediate_size.max(shared) + cfg.n_routed_experts + d;
    let per_row = streams + kda.max(mla).max(mlp);
    let group = ATTN_QUERIES * h * (cfg.index_topk + 2 * cfg.kv_lora_rank);
    // One weight tile widened for cuBLAS at a time, in prompt chunks.
    let widened = if rows >= crate::backend::cuda::WIDEN_MIN_TOKENS {
        crate::backend::cuda::WIDEN_TILE_VALUES
    } else {
        0
    };
    (rows * per_row + group + widened) * std::mem::size_of::<f32>()
}

/// The GPU that holds `model`'s dense weights (its output projection's device copy), if any.
pub fn placed_device(model: &Model) -> Option<Arc<Cuda>> {
    Some(CudaMatrix::placed(&model.lm_head)?.cuda().clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// At GLM-5.3-Flash's widths a default prompt chunk's workspace is about 1.5 GiB (KDA's
    /// buffers are the widest sublayer), a decode batch's a few MiB over the fixed attention
    /// group: what VRAM sizing on a 24 GB card must leave free beside the experts.
    #[test]
    fn workspace_at_flash_width() {
        let cfg = Config::from_json(&crate::model::random::flash_config(1, 4)).unwrap();
        let chunk = workspace_bytes(&cfg, DEFAULT_GPU_CHUNK, 131_072);
        let decode = workspace_bytes(&cfg, 8, 131_072);
        let per_row = (chunk - decode) / (DEFAULT_GPU_CHUNK - 8);
        println!(
            "chunk {} MiB, decode {} MiB, {per_row} bytes a row",
            chunk >> 20,
            decode >> 20
        );
        assert!((600_000..800_000).contains(&per_row), "{per_row}");
        assert!((1200 << 20..1700 << 20).contains(&chunk), "{chunk}");
        assert!(decode < 300 << 20, "{decode}");
    }
}
