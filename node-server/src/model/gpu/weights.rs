//! Device copies of the model's weights for the GPU forward, and the growable cache buffer.

use super::*;
use crate::model::dsa::Indexer;
use crate::model::glm5::Layer;
use crate::model::kda::{Kda, L2_EPS, QkvProjection};
use crate::model::mhc::HyperConnection;
use crate::model::mla::Mla;
use crate::model::mlp::SwiGlu;
use crate::model::moe::Moe;
use cudarc::driver::CudaView;
impl DevVec {
    /// `values` with room for `spare` more values.
    pub(super) fn from_host(cuda: &Cuda, values: &[f32], spare: usize) -> anyhow::Result<DevVec> {
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
    pub(super) fn push(&mut self, cuda: &Cuda, src: &CudaView<f32>) -> anyhow::Result<()> {
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

    pub(super) fn download(&self, cuda: &Cuda) -> anyhow::Result<Vec<f32>> {
        let mut v = cuda.download(&self.buf)?;
        v.truncate(self.len);
        Ok(v)
    }
}

impl DevLayer {
    pub(super) fn new(cuda: &Arc<Cuda>, l: &Layer) -> anyhow::Result<DevLayer> {
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
    pub(super) fn new(cuda: &Arc<Cuda>, hc: &HyperConnection) -> anyhow::Result<DevHc> {
        Ok(DevHc {
            proj: CudaMatrix::of(cuda, &hc.proj)?,
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
    pub(super) fn new(cuda: &Arc<Cuda>, k: &Kda) -> anyhow::Result<DevKda> {
        let m = |x: &Matrix| CudaMatrix::of(cuda, x);
        let QkvProjection::Split { q, k: key, v } = &k.qkv else {
            anyhow::bail!("a fused KDA qkv_proj (EXL3 checkpoints) has no GPU path");
        };
        Ok(DevKda {
            q: m(q)?,
            k: m(key)?,
            v: m(v)?,
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
    pub(super) fn new(cuda: &Arc<Cuda>, m: &Mla) -> anyhow::Result<DevMla> {
        let kv_b: Vec<f32> = (0..m.kv_b.rows()).flat_map(|r| m.kv_b.row_f32(r)).collect();
        Ok(DevMla {
            q_a: CudaMatrix::of(cuda, &m.q_a)?,
            q_a_norm: cuda.upload(&m.q_a_norm)?,
            q_b: CudaMatrix::of(cuda, &m.q_b)?,
            kv_a: CudaMatrix::of(cuda, &m.kv_a)?,
            kv_a_norm: cuda.upload(&m.kv_a_norm)?,
            kv_b: cuda.upload(&kv_b)?,
            o_proj: CudaMatrix::of(cuda, &m.o_proj)?,
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
    pub(super) fn new(cuda: &Arc<Cuda>, ix: &Indexer) -> anyhow::Result<DevIndexer> {
        Ok(DevIndexer {
            wq_b: CudaMatrix::of(cuda, &ix.wq_b)?,
            wk: CudaMatrix::of(cuda, &ix.wk)?,
            k_norm_weight: cuda.upload(&ix.k_norm_weight)?,
            k_norm_bias: cuda.upload(&ix.k_norm_bias)?,
            weights_proj: CudaMatrix::of(cuda, &ix.weights_proj)?,
            ape: cuda.upload(&ix.ape)?,
            gate: CudaMatrix::of(cuda, &ix.gate)?,
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
    pub(super) fn new(cuda: &Arc<Cuda>, s: &SwiGlu) -> anyhow::Result<DevMlp> {
        Ok(DevMlp {
            gate: CudaMatrix::of(cuda, &s.gate)?,
            up: CudaMatrix::of(cuda, &s.up)?,
            down: CudaMatrix::of(cuda, &s.down)?,
            limit: s.limit,
        })
    }
}

impl DevMoe {
    pub(super) fn new(cuda: &Arc<Cuda>, moe: &Moe) -> anyhow::Result<DevMoe> {
        let r = &moe.router;
        Ok(DevMoe {
            router: CudaMatrix::of(cuda, &r.weight)?,
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
