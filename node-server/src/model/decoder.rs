//! A loaded [`Model`]'s weights placed on a device, with the sequences whose caches live
//! there: the engine's GPU sequences keep every activation and cache in device memory from
//! one call to the next (only the tokens' embedding rows go up, logits and routing picks
//! come down), through the same forward the host runs ([`Model::forward_on`]).
//!
//! The routed experts stay the model's [`ExpertProvider`](super::moe::ExpertProvider)'s:
//! on the device rows when it computes on this GPU, else on host rows.

use super::config::{AttnKind, Config, IndexerKind};
use super::device::{Device, Gpu};
use super::glm5::{LayerCache, Model, SeqCache, Step, Weights};
use crate::backend::cuda::Cuda;
use crate::backend::cuda::matrix::CudaMatrix;
use anyhow::bail;
use std::sync::Arc;

pub use super::device::{ATTN_QUERIES, DECODE_GRAPHS_KEPT, GROWTH_SLACK};
pub use super::forward::MAX_ROWS;

/// Tokens of room a sequence's caches are made with on a device beyond what they hold.
pub const CACHE_SPARE_TOKENS: usize = 256;

/// A model's weights on device `D` (all but the embedding, read one row per token on the
/// host, and the routed experts).
pub struct Decoder<D: Device> {
    dev: D,
    weights: Weights<D>,
    cfg: Config,
}

/// The decoder the engine runs GPU sequences with.
pub type GpuDecoder = Decoder<Gpu>;

impl Decoder<Gpu> {
    /// Device copies of every weight of `model` but the routed experts and the embedding.
    pub fn new(cuda: &Arc<Cuda>, model: &Model) -> anyhow::Result<GpuDecoder> {
        Decoder::on(Gpu::new(cuda), model)
    }

    /// [`Decoder::new`] with a second queue for the work beside the main one, or without,
    /// whatever `GLMFLASH_SIDE_STREAM` says (checks compare the two).
    pub fn with_side_stream(
        cuda: &Arc<Cuda>,
        model: &Model,
        side: bool,
    ) -> anyhow::Result<GpuDecoder> {
        Decoder::on(Gpu::with_side_stream(cuda, side), model)
    }

    /// The device the decoder runs on.
    pub fn device(&self) -> &Arc<Cuda> {
        self.dev.cuda()
    }

    /// The profile so far (see [`Gpu::take_profile`]).
    pub fn take_profile(&self) -> Vec<(&'static str, f64, u64)> {
        self.dev.take_profile()
    }

    /// Seconds spent waiting for downloads so far (see [`Gpu::take_waited`]).
    pub fn take_waited(&self) -> f64 {
        self.dev.take_waited()
    }
}

impl<D: Device> Decoder<D> {
    /// `model`'s weights placed on `dev`.
    pub fn on(dev: D, model: &Model) -> anyhow::Result<Decoder<D>> {
        Ok(Decoder {
            weights: model.weights.place(&dev)?,
            dev,
            cfg: model.cfg.clone(),
        })
    }

    pub fn dev(&self) -> &D {
        &self.dev
    }

    /// Feeds `token` to `seq` and returns the next token's logits (`[vocab]`).
    pub fn step(
        &self,
        model: &Model,
        seq: &mut SeqCache<D>,
        token: u32,
    ) -> anyhow::Result<Vec<f32>> {
        Ok(self.step_batch(model, &mut [seq], &[token])?.remove(0))
    }

    /// Feeds `tokens[i]` to `seqs[i]` for every sequence in one pass over the layers.
    pub fn step_batch(
        &self,
        model: &Model,
        seqs: &mut [&mut SeqCache<D>],
        tokens: &[u32],
    ) -> anyhow::Result<Vec<Vec<f32>>> {
        let chunks: Vec<&[u32]> = tokens.iter().map(std::slice::from_ref).collect();
        self.forward(model, seqs, &chunks)
    }

    /// Feeds `tokens[i]` (one decode token, or a chunk of a prompt) to `seqs[i]` for every
    /// sequence in one pass over the layers and returns each one's logits after its last
    /// token (`[vocab]` each); see [`Model::forward_on`]. `model` must be the model this
    /// decoder was made from (its routed experts and embedding rows are read from it).
    pub fn forward(
        &self,
        model: &Model,
        seqs: &mut [&mut SeqCache<D>],
        tokens: &[&[u32]],
    ) -> anyhow::Result<Vec<Vec<f32>>> {
        if seqs.len() != tokens.len() {
            bail!(
                "a batch of {} sequences with {} token lists",
                seqs.len(),
                tokens.len()
            );
        }
        if model.weights.layers.len() != self.weights.layers.len()
            || model.cfg.hidden_size != self.cfg.hidden_size
        {
            bail!("the model is not the one this decoder was made from");
        }
        let mut steps: Vec<Step<D>> = seqs
            .iter_mut()
            .zip(tokens)
            .map(|(s, t)| Step {
                tokens: t,
                cache: &mut **s,
                all_logits: false,
            })
            .collect();
        self.run(model, &mut steps)
    }

    /// Runs `steps` (each a sequence's tokens on its cache on this device) through
    /// [`Model::forward_on`] with these weights.
    pub fn run(&self, model: &Model, steps: &mut [Step<D>]) -> anyhow::Result<Vec<Vec<f32>>> {
        if model.weights.layers.len() != self.weights.layers.len()
            || model.cfg.hidden_size != self.cfg.hidden_size
        {
            bail!("the model is not the one this decoder was made from");
        }
        model.forward_on(&self.dev, &self.weights, steps, None)
    }

    /// A sequence's caches on this device, from its host cache (empty for a new sequence,
    /// or after a host prefill).
    pub fn sequence(&self, cache: &SeqCache) -> anyhow::Result<SeqCache<D>> {
        let cfg = &self.cfg;
        if cache.layers.len() != cfg.num_hidden_layers {
            bail!("the cache does not belong to this model");
        }
        let dev = &self.dev;
        let layers = cache
            .layers
            .iter()
            .enumerate()
            .map(|(i, c)| -> anyhow::Result<LayerCache<D>> {
                Ok(match (c, cfg.attn_kinds[i]) {
                    (LayerCache::Kda(s), AttnKind::Kda) => LayerCache::Kda(s.place(dev)?),
                    (LayerCache::Mla(m), AttnKind::Mla) => {
                        let indexer = (cfg.indexer_kinds[i] == IndexerKind::Full)
                            .then_some((cfg.index_head_dim, cfg.index_kpool));
                        LayerCache::Mla(m.place(
                            dev,
                            cfg.kv_lora_rank,
                            indexer,
                            CACHE_SPARE_TOKENS,
                        )?)
                    }
                    _ => bail!("the cache's layer kinds differ from the model's"),
                })
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(SeqCache {
            layers,
            len: cache.len,
        })
    }

    /// `seq`'s caches back on the host (to compare with a host run or to continue there).
    pub fn to_host(&self, seq: &SeqCache<D>) -> anyhow::Result<SeqCache> {
        let cfg = &self.cfg;
        let conv_len = (cfg.linear_conv_kernel_dim - 1) * 3 * cfg.kda_dim();
        let layers = seq
            .layers
            .iter()
            .map(|l| -> anyhow::Result<LayerCache> {
                Ok(match l {
                    LayerCache::Kda(s) => LayerCache::Kda(s.to_host(&self.dev, conv_len)?),
                    LayerCache::Mla(m) => LayerCache::Mla(m.to_host(&self.dev)?),
                })
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(SeqCache {
            layers,
            len: seq.len,
        })
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
    let h = cfg.num_attention_heads;
    let group = ATTN_QUERIES * h * (cfg.index_topk + 2 * cfg.kv_lora_rank);
    // One weight tile widened for cuBLAS at a time, in prompt chunks.
    let widened = if rows >= crate::backend::cuda::WIDEN_MIN_TOKENS {
        crate::backend::cuda::WIDEN_TILE_VALUES
    } else {
        0
    };
    (rows * row_values(cfg, context) + group + widened) * std::mem::size_of::<f32>()
}

/// Bytes of device memory the decode steps captured as CUDA graphs hold on top of
/// [`workspace_bytes`] (each graph keeps its step's buffers for as long as it is kept:
/// [`DECODE_GRAPHS_KEPT`] of them, each for up to `rows` sequences of up to `context` tokens,
/// with its attention scratch and logits); none when graphs are off.
pub fn decode_graphs_bytes(cfg: &Config, rows: usize, context: usize) -> usize {
    if !super::device::decode_graphs() {
        return 0;
    }
    let attention = cfg.num_attention_heads * (cfg.index_topk + cfg.index_kpool);
    let step = rows * (row_values(cfg, context) + attention + cfg.vocab_size);
    DECODE_GRAPHS_KEPT * step * std::mem::size_of::<f32>()
}

/// f32 values one token row of a forward call holds at most at once: the residual streams
/// (three copies live at once) plus the widest sublayer's buffers (KDA, MLA with its indexer
/// and its pool scores for sequences of up to `context` tokens, or an MLP).
fn row_values(cfg: &Config, context: usize) -> usize {
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
    streams + kda.max(mla).max(mlp)
}

/// The GPU that holds `model`'s dense weights (its output projection's device copy), if any.
pub fn placed_device(model: &Model) -> Option<Arc<Cuda>> {
    Some(CudaMatrix::placed(&model.weights.lm_head)?.cuda().clone())
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
        // The decode graphs of 8-sequence batches: tens of MiB (when graphs are on).
        let graphs = decode_graphs_bytes(&cfg, 8, 131_072);
        println!("decode graphs {} MiB", graphs >> 20);
        assert!(graphs < 128 << 20, "{graphs}");
    }
}
