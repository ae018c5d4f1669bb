//! The DSA indexer with k-pools: picks which cached tokens an MLA query attends to.
//!
//! Tokens are grouped into pools of `kpool` consecutive positions. A pool's key is a
//! per-channel softmax-weighted sum of its tokens' indexer keys (weights: learned gate +
//! position bias). A query scores every complete pool it can see with
//! `sum_h w_h relu(q_h . key * Di^-0.5)`, keeps the best `index_topk / kpool`, expands them
//! to their tokens, and always adds its own incomplete tail pool. Ties go to the earlier
//! pool, so a choice never depends on how many pools exist.

use super::config::Config;
use super::loader::{LoadError, Loader};
use crate::backend::cpu::{Matrix, ops};

pub(crate) const K_NORM_EPS: f32 = 1e-6;

pub struct Indexer {
    pub(crate) wq_b: Matrix,
    pub(crate) wk: Matrix,
    pub(crate) k_norm_weight: Vec<f32>,
    pub(crate) k_norm_bias: Vec<f32>,
    pub(crate) weights_proj: Matrix,
    /// `[kpool, Di]`
    pub(crate) ape: Vec<f32>,
    pub(crate) gate: Matrix,
    pub(crate) heads: usize,
    pub(crate) dim: usize,
    pub(crate) kpool: usize,
    pub(crate) topk: usize,
    pub(crate) select_tail: bool,
}

/// What the indexer keeps per sequence: per-token keys and gate scores, and the keys of the
/// pools completed so far.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct IndexerCache {
    /// `[T, Di]`
    pub keys: Vec<f32>,
    /// `[T, Di]`
    pub gates: Vec<f32>,
    /// `[complete pools, Di]`
    pub pool_keys: Vec<f32>,
}

impl IndexerCache {
    pub fn bytes(&self) -> usize {
        (self.keys.len() + self.gates.len() + self.pool_keys.len()) * 4
    }
}

/// Projections of the new tokens the selection needs (all `[T, ..]`).
pub struct IndexerInputs {
    q: Vec<f32>,
    weights: Vec<f32>,
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
            heads: hi,
            dim: di,
            kpool: cfg.index_kpool,
            topk: cfg.index_topk,
            select_tail: cfg.index_kpool_always_select_tail,
        })
    }

    /// Projects the new tokens (`x`: block input, `qr`: normalised q latent) and appends their
    /// keys to each sequence's cache. Returns the query side for [`Indexer::select`].
    pub fn prepare(
        &self,
        x: &[f32],
        qr: &[f32],
        tokens: usize,
    ) -> (IndexerInputs, Vec<f32>, Vec<f32>) {
        let mut keys = self.wk.matmul(x, tokens);
        ops::layer_norm(
            &mut keys,
            &self.k_norm_weight,
            &self.k_norm_bias,
            K_NORM_EPS,
        );
        let gates = self.gate.matmul(x, tokens);
        let scale = (self.heads as f32).powf(-0.5);
        let weights = self
            .weights_proj
            .matmul(x, tokens)
            .into_iter()
            .map(|w| w * scale)
            .collect();
        (
            IndexerInputs {
                q: self.wq_b.matmul(qr, tokens),
                weights,
            },
            keys,
            gates,
        )
    }

    /// Appends new tokens' keys and gates, and computes the keys of pools they complete.
    pub fn append(&self, cache: &mut IndexerCache, keys: &[f32], gates: &[f32]) {
        let di = self.dim;
        cache.keys.extend_from_slice(keys);
        cache.gates.extend_from_slice(gates);
        let tokens = cache.keys.len() / di;
        let mut pool = cache.pool_keys.len() / di;
        while (pool + 1) * self.kpool <= tokens {
            let rows = pool * self.kpool * di..(pool + 1) * self.kpool * di;
            let key = pool_key(
                &cache.keys[rows.clone()],
                &cache.gates[rows],
                &self.ape,
                di,
                self.kpool,
            );
            cache.pool_keys.extend_from_slice(&key);
            pool += 1;
        }
    }

    /// The token positions query `row` of `inputs` (at absolute position `pos`) attends to,
    /// ascending.
    pub fn select(
        &self,
        inputs: &IndexerInputs,
        row: usize,
        pos: usize,
        cache: &IndexerCache,
    ) -> Vec<u32> {
        let (di, hi) = (self.dim, self.heads);
        let visible = pos + 1;
        let candidates = (visible / self.kpool).min(cache.pool_keys.len() / di);
        let scores = pool_scores(
            &inputs.q[row * hi * di..(row + 1) * hi * di],
            &inputs.weights[row * hi..(row + 1) * hi],
            &cache.pool_keys[..candidates * di],
            di,
        );
        select_tokens(&scores, self.topk, self.kpool, visible, self.select_tail)
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
