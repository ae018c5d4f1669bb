//! Cache accounting in bytes, per layer type, before a sequence is admitted.
//!
//! What one sequence's cache holds, layer by layer (the KDA state in f32; the MLA and DSA
//! caches in the cache dtype, `--cache-dtype`: 4 bytes a value for f32, 2 for bf16 / f16):
//! - MLA: the normalised latent, `kv_lora_rank` per token (GLM-5.3-Flash attention is NoPE,
//!   so there is no separate rope key: `qk_rope_head_dim` is 0 and the config refuses more);
//! - MLA with a full DSA indexer: per token an indexer key and a gate score (`index_head_dim`
//!   each), plus one pooled key per completed pool of `index_kpool` tokens (shared-indexer
//!   layers reuse the full layer's selection and keep nothing);
//! - KDA: a fixed recurrent state (`H x Dk x Dv`) and the short-convolution tail
//!   (`(kernel - 1) x 3C`), whatever the sequence's length.
//!
//! The scheduler reserves [`CacheLayout::bytes_for`] of a sequence's most tokens (prompt +
//! max_tokens) against the budget, so admission never over-commits memory.

use crate::model::config::{AttnKind, Config, IndexerKind};
use crate::model::device::CacheDtype;

const F32: usize = 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheLayout {
    /// Bytes per sequence whatever its length: KDA recurrent and conv state.
    pub fixed_bytes: usize,
    /// Bytes per token over all layers: MLA latents, DSA indexer keys and gates.
    pub token_bytes: usize,
    /// Bytes per completed DSA pool over all full-indexer layers.
    pub pool_bytes: usize,
    /// Tokens per DSA pool.
    pub pool_tokens: usize,
}

impl CacheLayout {
    /// The layout of `cfg`'s caches with the MLA and DSA caches in `dtype`.
    pub fn of(cfg: &Config, dtype: CacheDtype) -> CacheLayout {
        let value = dtype.bytes();
        let kda_state = (cfg.linear_conv_kernel_dim.saturating_sub(1) * 3 * cfg.kda_dim()
            + cfg.linear_num_heads * cfg.linear_head_dim * cfg.linear_head_dim)
            * F32;
        let mut layout = CacheLayout {
            fixed_bytes: 0,
            token_bytes: 0,
            pool_bytes: 0,
            pool_tokens: cfg.index_kpool.max(1),
        };
        for (attn, indexer) in cfg.attn_kinds.iter().zip(&cfg.indexer_kinds) {
            match attn {
                AttnKind::Kda => layout.fixed_bytes += kda_state,
                AttnKind::Mla => {
                    layout.token_bytes += cfg.kv_lora_rank * value;
                    if *indexer == IndexerKind::Full {
                        layout.token_bytes += 2 * cfg.index_head_dim * value;
                        layout.pool_bytes += cfg.index_head_dim * value;
                    }
                }
            }
        }
        layout
    }

    /// Bytes one sequence's cache holds after `tokens` tokens.
    pub fn bytes_for(&self, tokens: usize) -> usize {
        self.fixed_bytes
            .saturating_add(tokens.saturating_mul(self.token_bytes))
            .saturating_add((tokens / self.pool_tokens).saturating_mul(self.pool_bytes))
    }

    /// Most tokens one sequence can hold within `budget` bytes (0 when even its fixed
    /// state does not fit).
    pub fn tokens_within(&self, budget: usize) -> usize {
        if budget < self.fixed_bytes {
            return 0;
        }
        let per_token = self.token_bytes as f64 + self.pool_bytes as f64 / self.pool_tokens as f64;
        if per_token == 0.0 {
            return usize::MAX;
        }
        // The estimate can be a token off either way (pools complete in steps): correct it.
        let mut n = ((budget - self.fixed_bytes) as f64 / per_token) as usize;
        while n > 0 && self.bytes_for(n) > budget {
            n -= 1;
        }
        while self.bytes_for(n + 1) <= budget {
            n += 1;
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::checkpoint::DType;
    use crate::model::random::{scaled_config, write_random_checkpoint};
    use crate::model::{Model, Step};

    /// The accounting equals what the engine's cache really holds, token by token, across
    /// pool boundaries, for every layer type of the real model's rhythm and every cache dtype.
    #[test]
    fn accounted_bytes_equal_the_cache_the_model_fills() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = scaled_config(64, 64, 8, 1, 4, 32, 2);
        write_random_checkpoint(dir.path(), &cfg, 3, DType::F32).unwrap();
        let mut model = Model::load(dir.path()).unwrap();
        let f32_layout = CacheLayout::of(&model.cfg, CacheDtype::F32);
        for dtype in CacheDtype::ALL {
            model.options.cache = dtype;
            let layout = CacheLayout::of(&model.cfg, dtype);
            assert_eq!(layout.fixed_bytes, f32_layout.fixed_bytes, "{dtype:?}");
            assert_eq!(
                layout.token_bytes * 4,
                f32_layout.token_bytes * dtype.bytes(),
                "{dtype:?}"
            );
            fill_and_count(&model, &layout);
        }
    }

    fn fill_and_count(model: &Model, layout: &CacheLayout) {
        assert!(layout.fixed_bytes > 0 && layout.token_bytes > 0 && layout.pool_bytes > 0);
        let mut cache = model.new_cache();
        let kpool = model.cfg.index_kpool;
        let mut fed = 0;
        // Prefill a span that ends inside a pool, then decode across the next boundary.
        let mut spans = vec![kpool + kpool / 2];
        spans.extend(std::iter::repeat_n(1, kpool));
        for n in spans {
            let tokens: Vec<u32> = (0..n).map(|i| ((fed + i) % 60) as u32 + 1).collect();
            let mut steps = [Step {
                tokens: &tokens,
                cache: &mut cache,
                all_logits: false,
            }];
            model.forward(&mut steps, None).unwrap();
            fed += n;
            // The DSA indexer cache appears with the first token; before, nothing is held.
            assert_eq!(cache.bytes(), layout.bytes_for(fed), "after {fed} tokens");
        }
    }

    #[test]
    fn tokens_within_is_the_largest_that_fits() {
        let layout = CacheLayout {
            fixed_bytes: 1000,
            token_bytes: 10,
            pool_bytes: 7,
            pool_tokens: 4,
        };
        assert_eq!(layout.tokens_within(999), 0);
        assert_eq!(layout.tokens_within(1000), 0);
        for budget in [1010, 1047, 1048, 5000, 123_457] {
            let n = layout.tokens_within(budget);
            assert!(layout.bytes_for(n) <= budget, "{budget}");
            assert!(layout.bytes_for(n + 1) > budget, "{budget}");
        }
    }
}
