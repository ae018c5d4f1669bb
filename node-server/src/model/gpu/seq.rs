//! A sequence's caches moved between the host layout (`SeqCache`) and the device's.

use super::*;
use crate::model::dsa::IndexerCache;
use crate::model::glm5::{LayerCache, SeqCache};
use crate::model::kda::KdaState;
use crate::model::mla::MlaCache;
impl GpuDecoder {
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
}
