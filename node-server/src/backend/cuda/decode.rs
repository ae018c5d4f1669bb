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
//! This module reads model types (it is the bridge from a loaded model to the kernels), which
//! the rest of `backend::cuda` does not.
#![allow(unsafe_code)] // kernel launches; each block says why it holds

use super::attn::{DeviceSelections, DsaSpec};
use super::matrix::CudaMatrix;
use super::{Cuda, KdaSpec, MhcCollapse, MhcSpec, RouteSpec, norm_config, rows_config};
use crate::backend::AttnLayout;
use crate::backend::cpu::{DeviceWeights, Matrix};
use crate::model::config::Config;
use crate::model::dsa::{Indexer, IndexerCache, K_NORM_EPS};
use crate::model::glm5::{Attention, FeedForward, Layer, LayerCache, Model, SeqCache};
use crate::model::kda::{Kda, KdaState, L2_EPS};
use crate::model::mhc::HyperConnection;
use crate::model::mla::{Mla, MlaCache};
use crate::model::mlp::SwiGlu;
use crate::model::moe::{Moe, Phase, Routing};
use crate::quant::Format;
use anyhow::{Context, bail};
use cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

type Buf = CudaSlice<f32>;

/// Threads per block of the elementwise and column kernels of decode.cu.
const ELEM_BLOCK: u32 = 256;

/// Queries of one attention launch (its scratch holds a score per selected token of each
/// query and head: 256 x 64 heads x 2,048 tokens is 128 MiB at the real widths).
const ATTN_QUERIES: usize = 256;

/// A sequence's caches on the GPU hold at most `1 + 1 / GROWTH_SLACK` times their values.
pub const GROWTH_SLACK: usize = 4;

/// Token rows of one forward call (the grid's y and z dimensions index them).
pub const MAX_ROWS: usize = 65_535;

/// A weight matrix the decode step multiplies by with `Cuda::matvec`.
struct DevMatrix {
    weights: Weights,
    format: Format,
    rows: usize,
    cols: usize,
}

enum Weights {
    /// The model's own device copy (a `CudaMatrix` on this device).
    Placed(Arc<dyn DeviceWeights>),
    /// Uploaded for the decoder.
    Owned(CudaSlice<u8>),
}

impl DevMatrix {
    fn new(cuda: &Arc<Cuda>, m: &Matrix) -> anyhow::Result<DevMatrix> {
        let placed = m.device().filter(|d| {
            d.as_any()
                .downcast_ref::<CudaMatrix>()
                .is_some_and(|c| c.is_on(cuda))
        });
        let weights = match placed {
            Some(d) => Weights::Placed(d.clone()),
            None => Weights::Owned(cuda.upload(&m.as_bytes())?),
        };
        Ok(DevMatrix {
            weights,
            format: m.format(),
            rows: m.rows(),
            cols: m.cols(),
        })
    }

    fn bytes(&self) -> &CudaSlice<u8> {
        match &self.weights {
            Weights::Placed(d) => d
                .as_any()
                .downcast_ref::<CudaMatrix>()
                .expect("only a CudaMatrix is kept as placed")
                .weights(),
            Weights::Owned(b) => b,
        }
    }

    /// `W x` for each of `n` token rows (`x` is `[n, cols]`).
    fn apply(&self, cuda: &Cuda, x: &Buf, n: usize) -> anyhow::Result<Buf> {
        let mut y = cuda.alloc_f32(n * self.rows)?;
        cuda.matmul(
            self.bytes(),
            self.format,
            self.rows,
            self.cols,
            x,
            n,
            &mut y,
        )?;
        Ok(y)
    }
}

/// A device buffer that grows by appended rows (the caches of MLA layers).
struct DevVec {
    buf: Buf,
    /// Values in use.
    len: usize,
}

impl DevVec {
    /// `values` with room for `spare` more values.
    fn from_host(cuda: &Cuda, values: &[f32], spare: usize) -> anyhow::Result<DevVec> {
        let mut padded = Vec::with_capacity(values.len() + spare.max(1));
        padded.extend_from_slice(values);
        padded.resize(values.len() + spare.max(1), 0.0);
        Ok(DevVec {
            buf: cuda.upload(&padded)?,
            len: values.len(),
        })
    }

    /// Appends the values of `src`, growing the buffer by a quarter (or to what is needed)
    /// when full: a cache holds at most a quarter more than its values, which the engine's
    /// VRAM budget counts ([`GROWTH_SLACK`]).
    fn push(&mut self, cuda: &Cuda, src: &CudaView<f32>) -> anyhow::Result<()> {
        let (s, n) = (cuda.stream(), src.len());
        if self.len + n > self.buf.len() {
            let mut grown =
                cuda.alloc_f32((self.buf.len() + self.buf.len() / GROWTH_SLACK).max(self.len + n))?;
            if self.len > 0 {
                let mut dst = grown.slice_mut(..self.len);
                s.memcpy_dtod(&self.buf.slice(..self.len), &mut dst)?;
            }
            self.buf = grown;
        }
        let mut dst = self.buf.slice_mut(self.len..self.len + n);
        s.memcpy_dtod(src, &mut dst)?;
        self.len += n;
        Ok(())
    }

    fn download(&self, cuda: &Cuda) -> anyhow::Result<Vec<f32>> {
        let mut v = cuda.download(&self.buf)?;
        v.truncate(self.len);
        Ok(v)
    }
}

struct DevHc {
    proj: DevMatrix,
    base: Buf,
    spec: MhcSpec,
    norm_eps: f32,
}

struct DevKda {
    q: DevMatrix,
    k: DevMatrix,
    v: DevMatrix,
    conv: Buf,
    f_a: DevMatrix,
    f_b: DevMatrix,
    dt_bias: Buf,
    a_log: Buf,
    b_proj: DevMatrix,
    g_a: DevMatrix,
    g_b: DevMatrix,
    o_norm: Buf,
    o_proj: DevMatrix,
    spec: KdaSpec,
    lower_bound: Option<f32>,
    eps: f32,
}

struct DevIndexer {
    wq_b: DevMatrix,
    wk: DevMatrix,
    k_norm_weight: Buf,
    k_norm_bias: Buf,
    weights_proj: DevMatrix,
    ape: Buf,
    gate: DevMatrix,
    spec: DsaSpec,
}

struct DevMla {
    q_a: DevMatrix,
    q_a_norm: Buf,
    q_b: DevMatrix,
    kv_a: DevMatrix,
    kv_a_norm: Buf,
    /// `kv_b` dequantized to f32, `[heads * (nope + v_dim), rank]`.
    kv_b: Buf,
    o_proj: DevMatrix,
    indexer: Option<DevIndexer>,
    heads: usize,
    nope: usize,
    v_dim: usize,
    rank: usize,
    eps: f32,
}

struct DevMlp {
    gate: DevMatrix,
    up: DevMatrix,
    down: DevMatrix,
    limit: f32,
}

struct DevMoe {
    router: DevMatrix,
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
    lm_head: DevMatrix,
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
            lm_head: DevMatrix::new(cuda, &model.lm_head)?,
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

    /// A sequence's caches on the device, from its CPU cache (after a CPU prefill).
    pub fn sequence(&self, cache: &SeqCache) -> anyhow::Result<GpuSeq> {
        let cuda = &*self.cuda;
        if cache.layers.len() != self.layers.len() {
            bail!("the cache does not belong to this model");
        }
        let cfg = &self.cfg;
        let layers = cache
            .layers
            .iter()
            .zip(&self.layers)
            .map(|(c, l)| -> anyhow::Result<SeqLayer> {
                Ok(match (c, &l.attention) {
                    (LayerCache::Kda(s), DevAttention::Kda(_)) => SeqLayer::Kda {
                        // A kernel of 1 keeps no inputs; cudarc cannot upload nothing.
                        conv: if s.conv.is_empty() {
                            cuda.alloc_f32(0)?
                        } else {
                            cuda.upload(&s.conv)?
                        },
                        recurrent: cuda.upload(&s.recurrent)?,
                    },
                    (LayerCache::Mla(m), DevAttention::Mla(mla)) => {
                        let di = cfg.index_head_dim;
                        let spare_pools = CACHE_SPARE_TOKENS / cfg.index_kpool.max(1) + 1;
                        let indexer = match (&mla.indexer, &m.indexer) {
                            (None, _) => None,
                            (Some(_), Some(ic)) => Some(DevIndexerCache {
                                keys: DevVec::from_host(cuda, &ic.keys, CACHE_SPARE_TOKENS * di)?,
                                gates: DevVec::from_host(cuda, &ic.gates, CACHE_SPARE_TOKENS * di)?,
                                pool_keys: DevVec::from_host(
                                    cuda,
                                    &ic.pool_keys,
                                    spare_pools * di,
                                )?,
                            }),
                            (Some(_), None) => Some(DevIndexerCache {
                                keys: DevVec::from_host(cuda, &[], CACHE_SPARE_TOKENS * di)?,
                                gates: DevVec::from_host(cuda, &[], CACHE_SPARE_TOKENS * di)?,
                                pool_keys: DevVec::from_host(cuda, &[], spare_pools * di)?,
                            }),
                        };
                        SeqLayer::Mla {
                            latents: DevVec::from_host(
                                cuda,
                                &m.latents,
                                CACHE_SPARE_TOKENS * mla.rank,
                            )?,
                            indexer,
                        }
                    }
                    _ => bail!("the cache's layer kinds differ from the model's"),
                })
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(GpuSeq {
            layers,
            len: cache.len,
        })
    }

    /// `seq`'s caches back on the host in the CPU's layout (to compare with a CPU run or to
    /// continue there).
    pub fn to_host(&self, seq: &GpuSeq) -> anyhow::Result<SeqCache> {
        let cuda = &*self.cuda;
        let cfg = &self.cfg;
        let conv_len = (cfg.linear_conv_kernel_dim - 1) * 3 * cfg.kda_dim();
        let layers = seq
            .layers
            .iter()
            .map(|l| -> anyhow::Result<LayerCache> {
                Ok(match l {
                    SeqLayer::Kda { conv, recurrent } => {
                        let mut conv_host = cuda.download(conv)?;
                        // A kernel of 1 keeps no inputs (the buffer holds one unused value).
                        conv_host.truncate(conv_len);
                        LayerCache::Kda(KdaState {
                            conv: conv_host,
                            recurrent: cuda.download(recurrent)?,
                        })
                    }
                    SeqLayer::Mla { latents, indexer } => LayerCache::Mla(MlaCache {
                        latents: latents.download(cuda)?,
                        indexer: match indexer {
                            Some(ix) => Some(IndexerCache {
                                keys: ix.keys.download(cuda)?,
                                gates: ix.gates.download(cuda)?,
                                pool_keys: ix.pool_keys.download(cuda)?,
                            }),
                            None => None,
                        },
                    }),
                })
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(SeqCache {
            layers,
            len: seq.len,
        })
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
        let (n_i, d_i) = (n as i32, d as i32);
        for (i, &(first, len)) in rows.iter().enumerate() {
            let last = first + len - 1;
            let src = streams.slice(last * n * d..(last + 1) * n * d);
            let mut dst = h.slice_mut(i * d..(i + 1) * d);
            let mut l = cuda.stream.launch_builder(cuda.kernel("stream_mean"));
            l.arg(&src).arg(&n_i).arg(&d_i).arg(&mut dst);
            // SAFETY: src holds n * d values, dst d; one thread per column.
            unsafe { l.launch(elem_config(d)) }?;
        }
        let all = self.timed("lm head", || {
            cuda.rms_norm(&mut h, Some(&self.norm), d, cfg.rms_norm_eps)?;
            let logits = self.lm_head.apply(cuda, &h, b)?;
            Ok(cuda.download(&logits)?)
        })?;
        for (s, &(_, len)) in seqs.iter_mut().zip(&rows) {
            s.len += len;
        }
        Ok(all
            .chunks(self.lm_head.rows)
            .take(b)
            .map(|row| row[..v].to_vec())
            .collect())
    }

    /// mHC's collapse of `b` tokens' streams: unweighted RMSNorm of each token's streams,
    /// the projection, then the weights and the pre-weighted sum (`mhc_collapse`).
    fn collapse(&self, hc: &DevHc, streams: &Buf, b: usize) -> anyhow::Result<MhcCollapse<Buf>> {
        let cuda = &*self.cuda;
        let (n, d) = (hc.spec.streams, hc.spec.hidden);
        let mut normed = cuda.alloc_f32(b * n * d)?;
        cuda.stream
            .memcpy_dtod(&streams.slice(..b * n * d), &mut normed)?;
        cuda.rms_norm(&mut normed, None, n * d, hc.norm_eps)?;
        let logits = hc.proj.apply(cuda, &normed, b)?;
        let mut out = MhcCollapse {
            collapsed: cuda.alloc_f32(b * d)?,
            post: cuda.alloc_f32(b * n)?,
            comb: cuda.alloc_f32(b * n * n)?,
        };
        cuda.mhc_collapse_dev(hc.spec, &logits, &hc.base, streams, b, &mut out)?;
        Ok(out)
    }

    fn expand(
        &self,
        hc: &DevHc,
        post: &Buf,
        comb: &Buf,
        streams: &Buf,
        y: &Buf,
        b: usize,
    ) -> anyhow::Result<Buf> {
        let mut out = self.cuda.alloc_f32(b * hc.spec.streams * hc.spec.hidden)?;
        self.cuda
            .mhc_expand_dev(hc.spec, post, comb, streams, y, b, &mut out)?;
        Ok(out)
    }

    /// Rows `first .. first + count` of `[.., width]` values, in a buffer of their own.
    fn rows(&self, src: &Buf, first: usize, count: usize, width: usize) -> anyhow::Result<Buf> {
        let mut dst = self.cuda.alloc_f32(count * width)?;
        self.cuda
            .stream
            .memcpy_dtod(&src.slice(first * width..(first + count) * width), &mut dst)?;
        Ok(dst)
    }

    /// `Kda::forward` for each sequence's tokens (`x` is `[rows, d]`; `spans[i]` sequence
    /// i's rows, `states[i]` its conv and recurrent state): the delta rule runs over a
    /// sequence's tokens in order (the chunked form over a prompt chunk, the recurrent one
    /// over decode steps).
    fn kda(
        &self,
        w: &DevKda,
        x: &Buf,
        states: &mut [(&mut Buf, &mut Buf)],
        spans: &[(usize, usize)],
    ) -> anyhow::Result<Buf> {
        let cuda = &*self.cuda;
        let total: usize = spans.iter().map(|s| s.1).sum();
        let (c, h, dh) = (w.spec.channels(), w.spec.heads, w.spec.head_dim);
        let [q, k, v] = [&w.q, &w.k, &w.v].map(|m| m.apply(cuda, x, total));
        let (q, k, v) = (q?, k?, v?);
        let mut g = w.f_b.apply(cuda, &w.f_a.apply(cuda, x, total)?, total)?;
        let mut beta = w.b_proj.apply(cuda, x, total)?;
        let (dh_i, c_i, h_i) = (dh as i32, c as i32, h as i32);
        let (has_bound, bound) = match w.lower_bound {
            Some(b) => (1i32, b),
            None => (0i32, 0.0f32),
        };
        let mut l = cuda.stream.launch_builder(cuda.kernel("kda_gates"));
        l.arg(&mut g)
            .arg(&w.dt_bias)
            .arg(&w.a_log)
            .arg(&dh_i)
            .arg(&c_i)
            .arg(&has_bound)
            .arg(&bound)
            .arg(&mut beta)
            .arg(&h_i);
        let mut grid = elem_config(c.max(h));
        grid.grid_dim.1 = total as u32;
        // SAFETY: g holds total rows of c values, beta total rows of h (h <= c), dt_bias c
        // and a_log h; one thread per channel of a row (grid y over the rows), the first h
        // of a row also do its beta.
        unsafe { l.launch(grid) }?;

        let mut core = cuda.alloc_f32(total * c)?;
        for ((conv, recurrent), &(first, len)) in states.iter_mut().zip(spans) {
            let mut qkv = cuda.alloc_f32(len * 3 * c)?;
            let (qs, ks, vs) = (
                q.slice(first * c..(first + len) * c),
                k.slice(first * c..(first + len) * c),
                v.slice(first * c..(first + len) * c),
            );
            let (len_i, c_i) = (len as i32, c as i32);
            let mut l = cuda.stream.launch_builder(cuda.kernel("interleave3"));
            l.arg(&qs)
                .arg(&ks)
                .arg(&vs)
                .arg(&len_i)
                .arg(&c_i)
                .arg(&mut qkv);
            // SAFETY: qs, ks and vs hold len * c values, qkv len * 3c; one thread per value of
            // a projection.
            unsafe { l.launch(elem_config(len * c)) }?;
            let mut mixed = cuda.alloc_f32(len * 3 * c)?;
            cuda.kda_conv_dev(w.spec, &w.conv, &qkv, len, conv, &mut mixed)?;
            let gi = self.rows(&g, first, len, c)?;
            let bi = self.rows(&beta, first, len, h)?;
            let mut out = cuda.alloc_f32(len * c)?;
            let form = w.spec.form_for(len);
            cuda.kda_delta_dev(w.spec, form, &mixed, &gi, &bi, len, recurrent, &mut out)?;
            let mut dst = core.slice_mut(first * c..(first + len) * c);
            cuda.stream.memcpy_dtod(&out, &mut dst)?;
        }
        let out_gate = w.g_b.apply(cuda, &w.g_a.apply(cuda, x, total)?, total)?;
        cuda.gated_rms_norm(&mut core, &out_gate, &w.o_norm, dh, w.eps)?;
        w.o_proj.apply(cuda, &core, total)
    }

    /// `Mla::forward` for each sequence's tokens on the absorbed path (`states`: each
    /// sequence's latents and indexer cache, `spans` its rows of `x`, `positions` its tokens
    /// before this call); a full indexer layer replaces each sequence's `carried` selection
    /// with its fresh one. A sequence's new latents join its cache before its queries
    /// attend, and each query sees only what its selection (causal) holds.
    fn mla(
        &self,
        w: &DevMla,
        x: &Buf,
        states: &mut [(&mut DevVec, Option<&mut DevIndexerCache>)],
        spans: &[(usize, usize)],
        positions: &[usize],
        carried: &mut [Option<DeviceSelections>],
    ) -> anyhow::Result<Buf> {
        let cuda = &*self.cuda;
        let total: usize = spans.iter().map(|s| s.1).sum();
        let (h, nope, vd, r) = (w.heads, w.nope, w.v_dim, w.rank);
        let mut qr = w.q_a.apply(cuda, x, total)?;
        cuda.rms_norm(&mut qr, Some(&w.q_a_norm), w.q_a.rows, w.eps)?;
        let q = w.q_b.apply(cuda, &qr, total)?;
        let mut latent = w.kv_a.apply(cuda, x, total)?;
        cuda.rms_norm(&mut latent, Some(&w.kv_a_norm), r, w.eps)?;

        if let Some(ix) = &w.indexer {
            let mut caches = Vec::with_capacity(states.len());
            for (_, ic) in states.iter_mut() {
                let Some(ic) = ic.as_deref_mut() else {
                    bail!("a full indexer layer's cache has no indexer state");
                };
                caches.push(ic);
            }
            for (slot, sel) in
                carried
                    .iter_mut()
                    .zip(self.select(ix, &mut caches, x, &qr, spans, positions)?)
            {
                *slot = Some(sel);
            }
        }

        let (nope_i, vd_i, r_i, h_i) = (nope as i32, vd as i32, r as i32, h as i32);
        let layout = AttnLayout::absorbed(h, r, (nope as f32).powf(-0.5));
        let mut attn = cuda.alloc_f32(total * h * vd)?;
        for (i, ((latents, _), &(first, len))) in states.iter_mut().zip(spans).enumerate() {
            let Some(sel) = carried[i].as_ref() else {
                bail!("a shared indexer layer with no full indexer layer before it");
            };
            latents.push(cuda, &latent.slice(first * r..(first + len) * r))?;
            // Queries in groups, so the attention's scratch (a score per selected token of
            // each query and head) stays bounded on long prompt chunks.
            for a in (0..len).step_by(ATTN_QUERIES) {
                let m = ATTN_QUERIES.min(len - a);
                let t0 = first + a;
                let mut q_lat = cuda.alloc_f32(m * h * r)?;
                let qi = q.slice(t0 * h * nope..(t0 + m) * h * nope);
                let mut l = cuda.stream.launch_builder(cuda.kernel("mla_absorb_q"));
                l.arg(&qi)
                    .arg(&w.kv_b)
                    .arg(&nope_i)
                    .arg(&vd_i)
                    .arg(&r_i)
                    .arg(&mut q_lat);
                let grid = LaunchConfig {
                    grid_dim: ((r as u32).div_ceil(ELEM_BLOCK), h as u32, m as u32),
                    block_dim: (ELEM_BLOCK, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: qi holds m * h * nope values, kv_b h * (nope + vd) rows of r, q_lat
                // m * h * r; one thread per (column < r, head < h, token < m).
                unsafe { l.launch(grid) }?;

                let mut o_lat = cuda.alloc_f32(m * h * r)?;
                cuda.mla_sparse_attend_part_dev(
                    &q_lat,
                    &latents.buf,
                    &layout,
                    &sel.tokens,
                    &sel.offsets[a..=a + m],
                    &mut o_lat,
                )?;

                let mut dst = attn.slice_mut(t0 * h * vd..(t0 + m) * h * vd);
                let mut l = cuda.stream.launch_builder(cuda.kernel("mla_absorb_out"));
                l.arg(&o_lat)
                    .arg(&w.kv_b)
                    .arg(&h_i)
                    .arg(&nope_i)
                    .arg(&vd_i)
                    .arg(&r_i)
                    .arg(&mut dst);
                // SAFETY: o_lat holds m * h * r values, dst m * h * vd; one warp per row of a
                // token's h * vd (grid y over the m tokens), reading kv_b's value rows.
                unsafe { l.launch(rows_config(h * vd, m as u32)) }?;
            }
        }
        w.o_proj.apply(cuda, &attn, total)
    }

    /// The indexer of a full layer for each sequence's new tokens (`spans` its rows,
    /// `positions` its tokens before them): their keys and gates appended (and the keys of
    /// the pools they complete), then the selection of each token (`Indexer::select`).
    fn select(
        &self,
        ix: &DevIndexer,
        caches: &mut [&mut DevIndexerCache],
        x: &Buf,
        qr: &Buf,
        spans: &[(usize, usize)],
        positions: &[usize],
    ) -> anyhow::Result<Vec<DeviceSelections>> {
        let cuda = &*self.cuda;
        let total: usize = spans.iter().map(|s| s.1).sum();
        let (di, hi, kpool) = (ix.spec.dim, ix.spec.heads, ix.spec.kpool);
        let mut keys = ix.wk.apply(cuda, x, total)?;
        let di_i = di as i32;
        let mut l = cuda.stream.launch_builder(cuda.kernel("layer_norm"));
        l.arg(&mut keys)
            .arg(&ix.k_norm_weight)
            .arg(&ix.k_norm_bias)
            .arg(&di_i)
            .arg(&K_NORM_EPS);
        // SAFETY: one block per row of di values of keys (total rows), weight and bias di.
        unsafe { l.launch(norm_config(total, di)) }?;
        let gates = ix.gate.apply(cuda, x, total)?;
        let mut weights = ix.weights_proj.apply(cuda, x, total)?;
        let (scale, count) = ((hi as f32).powf(-0.5), (total * hi) as i32);
        let mut l = cuda.stream.launch_builder(cuda.kernel("scale_values"));
        l.arg(&mut weights).arg(&scale).arg(&count);
        // SAFETY: weights holds total * hi values, one thread each.
        unsafe { l.launch(elem_config(total * hi)) }?;
        let q = ix.wq_b.apply(cuda, qr, total)?;

        let mut out = Vec::with_capacity(caches.len());
        for ((ic, &(first, len)), &pos) in caches.iter_mut().zip(spans).zip(positions) {
            ic.keys
                .push(cuda, &keys.slice(first * di..(first + len) * di))?;
            ic.gates
                .push(cuda, &gates.slice(first * di..(first + len) * di))?;
            let pool = ic.pool_keys.len / di;
            let complete = (ic.keys.len / di) / kpool;
            if complete > pool {
                let mut key = cuda.alloc_f32((complete - pool) * di)?;
                cuda.dsa_pool_keys_dev(
                    &ic.keys.buf,
                    &ic.gates.buf,
                    &ix.ape,
                    kpool,
                    pool,
                    complete - pool,
                    &mut key,
                )?;
                ic.pool_keys
                    .push(cuda, &key.slice(..(complete - pool) * di))?;
            }
            let qi = self.rows(&q, first, len, hi * di)?;
            let wi = self.rows(&weights, first, len, hi)?;
            let at: Vec<usize> = (pos..pos + len).collect();
            out.push(cuda.dsa_select_dev(
                &qi,
                &wi,
                &ic.pool_keys.buf,
                complete.max(pool),
                ix.spec,
                &at,
            )?);
        }
        Ok(out)
    }

    fn mlp(&self, w: &DevMlp, x: &Buf, b: usize) -> anyhow::Result<Buf> {
        let cuda = &*self.cuda;
        let gate = w.gate.apply(cuda, x, b)?;
        let up = w.up.apply(cuda, x, b)?;
        let mut act = cuda.alloc_f32(b * w.gate.rows)?;
        cuda.swiglu(&gate, &up, w.limit, &mut act)?;
        w.down.apply(cuda, &act, b)
    }

    /// `Moe::forward` for the batch's tokens: routing on the device, the routed experts
    /// through the model's provider (all the batch's picks in one call; on the device rows
    /// when the provider computes on this GPU, else on host rows), plus the shared expert.
    fn moe(
        &self,
        model: &Model,
        layer: usize,
        w: &DevMoe,
        x: &Buf,
        phases: &[Phase],
    ) -> anyhow::Result<Buf> {
        let cuda = &*self.cuda;
        let (d, b) = (self.cfg.hidden_size, phases.len());
        let (ids, weights) = self.timed("moe route", || {
            let logits = w.router.apply(cuda, x, b)?;
            Ok(cuda.route(&logits, &w.bias, w.spec, b)?)
        })?;
        let routing = Routing {
            k: w.spec.k,
            ids,
            weights,
            phases: phases.to_vec(),
        };
        let experts = model.experts();
        let mut y = self.timed("moe experts", || match experts.on_device() {
            // The rows stay on this device: the provider takes them where they are.
            Some(dev) if Arc::ptr_eq(dev.device(), &self.cuda) => {
                dev.forward_device(layer, x, &routing)
            }
            _ => {
                let mut xh = cuda.download(x)?;
                xh.truncate(b * d);
                let mut out = vec![0f32; b * d];
                experts.forward(layer, &xh, &routing, &mut out)?;
                Ok(cuda.upload(&out)?)
            }
        })?;
        if let Some(shared) = &w.shared {
            let s = self.timed("moe shared", || self.mlp(shared, x, b))?;
            let count = (b * d) as i32;
            let mut l = cuda.stream.launch_builder(cuda.kernel("add_values"));
            l.arg(&mut y).arg(&s).arg(&count);
            // SAFETY: y and s hold b * d values each, one thread per value.
            unsafe { l.launch(elem_config(b * d)) }?;
        }
        Ok(y)
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
    let widened = if rows >= super::WIDEN_MIN_TOKENS {
        super::WIDEN_TILE_VALUES
    } else {
        0
    };
    (rows * per_row + group + widened) * std::mem::size_of::<f32>()
}

/// The GPU that holds `model`'s dense weights (its output projection's device copy), if any.
pub fn placed_device(model: &Model) -> Option<Arc<Cuda>> {
    let placed = model.lm_head.device()?;
    let m = placed.as_any().downcast_ref::<CudaMatrix>()?;
    Some(m.cuda().clone())
}

fn elem_config(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u32).div_ceil(ELEM_BLOCK).max(1), 1, 1),
        block_dim: (ELEM_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl DevLayer {
    fn new(cuda: &Arc<Cuda>, l: &Layer) -> anyhow::Result<DevLayer> {
        let attention = match &l.attention {
            Attention::Kda(k) => DevAttention::Kda(DevKda::new(cuda, k)?),
            Attention::Mla(m) => DevAttention::Mla(DevMla::new(cuda, m)?),
        };
        let feed_forward = match &l.feed_forward {
            FeedForward::Dense(mlp) => DevFeedForward::Dense(DevMlp::new(cuda, mlp)?),
            FeedForward::Moe(moe) => DevFeedForward::Moe(DevMoe::new(cuda, moe)?),
        };
        Ok(DevLayer {
            attn_hc: DevHc::new(cuda, &l.attn_hc)?,
            ffn_hc: DevHc::new(cuda, &l.ffn_hc)?,
            input_norm: cuda.upload(&l.input_norm)?,
            post_attention_norm: cuda.upload(&l.post_attention_norm)?,
            attention,
            feed_forward,
        })
    }
}

impl DevHc {
    fn new(cuda: &Arc<Cuda>, hc: &HyperConnection) -> anyhow::Result<DevHc> {
        Ok(DevHc {
            proj: DevMatrix::new(cuda, &hc.proj)?,
            base: cuda.upload(&hc.base)?,
            spec: MhcSpec {
                streams: hc.streams,
                hidden: hc.hidden,
                scale: hc.scale,
                hc_eps: hc.hc_eps,
                sinkhorn_iters: hc.sinkhorn_iters,
            },
            norm_eps: hc.norm_eps,
        })
    }
}

impl DevKda {
    fn new(cuda: &Arc<Cuda>, k: &Kda) -> anyhow::Result<DevKda> {
        let m = |x: &Matrix| DevMatrix::new(cuda, x);
        Ok(DevKda {
            q: m(&k.q_proj)?,
            k: m(&k.k_proj)?,
            v: m(&k.v_proj)?,
            conv: cuda.upload(&k.conv)?,
            f_a: m(&k.f_a)?,
            f_b: m(&k.f_b)?,
            dt_bias: cuda.upload(&k.dt_bias)?,
            a_log: cuda.upload(&k.a_log)?,
            b_proj: m(&k.b_proj)?,
            g_a: m(&k.g_a)?,
            g_b: m(&k.g_b)?,
            o_norm: cuda.upload(&k.o_norm)?,
            o_proj: m(&k.o_proj)?,
            spec: KdaSpec {
                heads: k.heads,
                head_dim: k.head_dim,
                kernel: k.kernel,
                l2_eps: L2_EPS,
            },
            lower_bound: k.lower_bound,
            eps: k.eps,
        })
    }
}

impl DevMla {
    fn new(cuda: &Arc<Cuda>, m: &Mla) -> anyhow::Result<DevMla> {
        let kv_b: Vec<f32> = (0..m.kv_b.rows()).flat_map(|r| m.kv_b.row_f32(r)).collect();
        Ok(DevMla {
            q_a: DevMatrix::new(cuda, &m.q_a)?,
            q_a_norm: cuda.upload(&m.q_a_norm)?,
            q_b: DevMatrix::new(cuda, &m.q_b)?,
            kv_a: DevMatrix::new(cuda, &m.kv_a)?,
            kv_a_norm: cuda.upload(&m.kv_a_norm)?,
            kv_b: cuda.upload(&kv_b)?,
            o_proj: DevMatrix::new(cuda, &m.o_proj)?,
            indexer: m
                .indexer
                .as_ref()
                .map(|ix| DevIndexer::new(cuda, ix))
                .transpose()?,
            heads: m.heads,
            nope: m.nope,
            v_dim: m.v_dim,
            rank: m.rank,
            eps: m.eps,
        })
    }
}

impl DevIndexer {
    fn new(cuda: &Arc<Cuda>, ix: &Indexer) -> anyhow::Result<DevIndexer> {
        Ok(DevIndexer {
            wq_b: DevMatrix::new(cuda, &ix.wq_b)?,
            wk: DevMatrix::new(cuda, &ix.wk)?,
            k_norm_weight: cuda.upload(&ix.k_norm_weight)?,
            k_norm_bias: cuda.upload(&ix.k_norm_bias)?,
            weights_proj: DevMatrix::new(cuda, &ix.weights_proj)?,
            ape: cuda.upload(&ix.ape)?,
            gate: DevMatrix::new(cuda, &ix.gate)?,
            spec: DsaSpec {
                heads: ix.heads,
                dim: ix.dim,
                kpool: ix.kpool,
                topk: ix.topk,
                select_tail: ix.select_tail,
            },
        })
    }
}

impl DevMlp {
    fn new(cuda: &Arc<Cuda>, s: &SwiGlu) -> anyhow::Result<DevMlp> {
        Ok(DevMlp {
            gate: DevMatrix::new(cuda, &s.gate)?,
            up: DevMatrix::new(cuda, &s.up)?,
            down: DevMatrix::new(cuda, &s.down)?,
            limit: s.limit,
        })
    }
}

impl DevMoe {
    fn new(cuda: &Arc<Cuda>, moe: &Moe) -> anyhow::Result<DevMoe> {
        let r = &moe.router;
        Ok(DevMoe {
            router: DevMatrix::new(cuda, &r.weight)?,
            bias: cuda.upload(&r.bias)?,
            spec: RouteSpec {
                experts: r.experts,
                groups: r.groups,
                topk_groups: r.topk_groups,
                k: r.top_k,
                normalize: r.normalize,
                scale: r.scale,
            },
            shared: moe
                .shared
                .as_ref()
                .map(|s| DevMlp::new(cuda, s))
                .transpose()?,
        })
    }
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
