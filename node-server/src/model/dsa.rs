//! The DSA indexer with k-pools: picks which cached tokens an MLA query attends to.
//!
//! Tokens are grouped into pools of `kpool` consecutive positions. A pool's key is a
//! per-channel softmax-weighted sum of its tokens' indexer keys (weights: learned gate +
//! position bias). A query scores every complete pool it can see with
//! `sum_h w_h relu(q_h . key * Di^-0.5)`, keeps the best `index_topk / kpool`, expands them
//! to their tokens, and always adds its own incomplete tail pool. Ties go to the earlier
//! pool, so a choice never depends on how many pools exist.

use super::config::Config;
use super::device::{CacheDtype, CacheRows, Device, DsaSpec, Host};
use super::loader::{LoadError, Loader};
use super::mla::MlaCache;
use crate::backend::cpu::ops;

pub(crate) const K_NORM_EPS: f32 = 1e-6;

pub struct Indexer<D: Device = Host> {
    pub(crate) wq_b: D::Mat,
    pub(crate) wk: D::Mat,
    pub(crate) k_norm_weight: D::Buf,
    pub(crate) k_norm_bias: D::Buf,
    pub(crate) weights_proj: D::Mat,
    /// `[kpool, Di]`
    pub(crate) ape: D::Buf,
    pub(crate) gate: D::Mat,
    pub(crate) spec: DsaSpec,
}

/// What the indexer keeps per sequence: per-token keys and gate scores, and the keys of the
/// pools completed so far.
pub struct IndexerCache<D: Device = Host> {
    /// `[T, Di]`
    pub keys: D::Grow,
    /// `[T, Di]`
    pub gates: D::Grow,
    /// `[complete pools, Di]`
    pub pool_keys: D::Grow,
}

impl IndexerCache {
    /// An empty cache in `dtype`.
    pub fn new(dtype: CacheDtype) -> IndexerCache {
        IndexerCache {
            keys: CacheRows::new(dtype),
            gates: CacheRows::new(dtype),
            pool_keys: CacheRows::new(dtype),
        }
    }
}

impl Clone for IndexerCache {
    fn clone(&self) -> Self {
        IndexerCache {
            keys: self.keys.clone(),
            gates: self.gates.clone(),
            pool_keys: self.pool_keys.clone(),
        }
    }
}

impl PartialEq for IndexerCache {
    fn eq(&self, other: &Self) -> bool {
        self.keys == other.keys && self.gates == other.gates && self.pool_keys == other.pool_keys
    }
}

impl std::fmt::Debug for IndexerCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IndexerCache")
            .field("keys", &self.keys.len())
            .field("pool_keys", &self.pool_keys.len())
            .finish()
    }
}

impl IndexerCache {
    pub fn bytes(&self) -> usize {
        self.keys.bytes() + self.gates.bytes() + self.pool_keys.bytes()
    }

    /// This cache on `dev`, with room for `spare_tokens` more tokens before it grows.
    pub fn place<E: Device>(
        &self,
        dev: &E,
        di: usize,
        kpool: usize,
        spare_tokens: usize,
    ) -> anyhow::Result<IndexerCache<E>> {
        let spare_pools = spare_tokens / kpool.max(1) + 1;
        Ok(IndexerCache {
            keys: dev.grow(&self.keys, spare_tokens * di)?,
            gates: dev.grow(&self.gates, spare_tokens * di)?,
            pool_keys: dev.grow(&self.pool_keys, spare_pools * di)?,
        })
    }
}

impl<D: Device> IndexerCache<D> {
    /// This cache on the host.
    pub fn to_host(&self, dev: &D) -> anyhow::Result<IndexerCache> {
        Ok(IndexerCache {
            keys: dev.grow_download(&self.keys)?,
            gates: dev.grow_download(&self.gates)?,
            pool_keys: dev.grow_download(&self.pool_keys)?,
        })
    }
}

impl Indexer {
    pub fn load(cfg: &Config, vb: Loader) -> Result<Indexer, LoadError> {
        let (d, di, hi) = (cfg.hidden_size, cfg.index_head_dim, cfg.index_n_heads);
        Ok(Indexer {
            wq_b: vb.matrix("wq_b.weight", hi * di, cfg.q_lora_rank)?,
            wk: vb.matrix("wk.weight", di, d)?,
            k_norm_weight: vb.vector("k_norm.weight", di)?,
            k_norm_bias: vb.vector("k_norm.bias", di)?,
            weights_proj: vb.matrix("weights_proj.weight", hi, d)?,
            ape: vb.f32s("index_kpool_compress_ape", &[cfg.index_kpool, di])?,
            gate: vb.matrix("index_kpool_compress_gate", di, d)?,
            spec: DsaSpec {
                heads: hi,
                dim: di,
                kpool: cfg.index_kpool,
                topk: cfg.index_topk,
                select_tail: cfg.index_kpool_always_select_tail,
            },
        })
    }

    /// This block's weights on `dev`.
    pub fn place<E: Device>(&self, dev: &E) -> anyhow::Result<Indexer<E>> {
        Ok(Indexer {
            wq_b: dev.matrix(&self.wq_b)?,
            wk: dev.matrix(&self.wk)?,
            k_norm_weight: dev.upload(&self.k_norm_weight)?,
            k_norm_bias: dev.upload(&self.k_norm_bias)?,
            weights_proj: dev.matrix(&self.weights_proj)?,
            ape: dev.upload(&self.ape)?,
            gate: dev.matrix(&self.gate)?,
            spec: self.spec,
        })
    }
}

impl<D: Device> Indexer<D> {
    /// The new tokens' selections per sequence (`x`: block input, `qr`: normalised q
    /// latent; `spans[i]` sequence i's rows, its cache's token count its position): their
    /// keys and gates join each sequence's cache (and the keys of the pools they complete),
    /// then each token's pools are scored and chosen.
    pub fn select(
        &self,
        dev: &D,
        x: &D::Buf,
        qr: &D::Buf,
        spans: &[(usize, usize)],
        caches: &mut [&mut MlaCache<D>],
    ) -> anyhow::Result<Vec<D::Sel>> {
        let tokens: usize = spans.iter().map(|s| s.1).sum();
        let (di, hi) = (self.spec.dim, self.spec.heads);
        let mut keys = dev.matmul(&self.wk, x, tokens)?;
        dev.layer_norm(
            &mut keys,
            &self.k_norm_weight,
            &self.k_norm_bias,
            di,
            K_NORM_EPS,
            tokens,
        )?;
        let gates = dev.matmul(&self.gate, x, tokens)?;
        let mut weights = dev.matmul(&self.weights_proj, x, tokens)?;
        dev.scale(&mut weights, (hi as f32).powf(-0.5), tokens * hi)?;
        let q = dev.matmul(&self.wq_b, qr, tokens)?;

        let mut out = Vec::with_capacity(spans.len());
        for (&(first, len), cache) in spans.iter().zip(caches.iter_mut()) {
            let Some(ic) = cache.indexer.as_mut() else {
                anyhow::bail!("a full indexer layer's cache has no indexer state");
            };
            let past = D::grow_len(&ic.keys) / di;
            dev.push(&mut ic.keys, &keys, first, len, di)?;
            dev.push(&mut ic.gates, &gates, first, len, di)?;
            dev.dsa_pools(self.spec, &self.ape, &ic.keys, &ic.gates, &mut ic.pool_keys)?;
            out.push(dev.dsa_select(self.spec, &q, &weights, first, len, past, &ic.pool_keys)?);
        }
        Ok(out)
    }
}

/// The key of one pool from its tokens' keys and gates (`[kpool, di]` each): per channel, a
/// softmax over the pool's tokens of gate + position bias (`ape`) weights their keys.
pub(crate) fn pool_key(
    keys: &[f32],
    gates: &[f32],
    ape: &[f32],
    di: usize,
    kpool: usize,
) -> Vec<f32> {
    let mut key = vec![0f32; di];
    let mut logits = vec![0f32; kpool];
    for c in 0..di {
        for j in 0..kpool {
            logits[j] = gates[j * di + c] + ape[j * di + c];
        }
        ops::softmax(&mut logits);
        key[c] = (0..kpool).map(|j| logits[j] * keys[j * di + c]).sum();
    }
    key
}

/// One query's score of every pool in `pool_keys` (`[pools, di]`): `q` is `[heads, di]`,
/// `w` the per-head weights; `sum_h w_h relu(q_h . key * di^-0.5)`.
pub(crate) fn pool_scores(q: &[f32], w: &[f32], pool_keys: &[f32], di: usize) -> Vec<f32> {
    let scale = (di as f32).powf(-0.5);
    pool_keys
        .chunks_exact(di)
        .map(|key| {
            w.iter()
                .enumerate()
                .map(|(h, wh)| wh * (ops::dot(&q[h * di..(h + 1) * di], key) * scale).max(0.0))
                .sum()
        })
        .collect()
}

/// The tokens a query with `visible` tokens attends to, ascending: the best
/// `topk / kpool` pools of `scores` (ties to the earlier pool) expanded to their tokens, then
/// the incomplete tail pool when `select_tail`.
pub(crate) fn select_tokens(
    scores: &[f32],
    topk: usize,
    kpool: usize,
    visible: usize,
    select_tail: bool,
) -> Vec<u32> {
    let budget = (topk / kpool).min(scores.len());
    let mut pools = ops::top_k(scores, budget);
    pools.sort_unstable();
    let mut tokens: Vec<u32> = pools
        .iter()
        .flat_map(|&p| (p * kpool..(p + 1) * kpool).map(|t| t as u32))
        .collect();
    if select_tail {
        let tail = visible % kpool;
        tokens.extend((visible - tail..visible).map(|t| t as u32));
    }
    tokens
}
