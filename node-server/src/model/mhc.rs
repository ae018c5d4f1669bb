//! Manifold-constrained hyper-connections (mHC): the residual is `hc_mult` streams; each
//! sublayer reads a `pre`-weighted collapse of them and writes back through `post` and a
//! Sinkhorn-balanced stream mix `comb`.

use super::config::Config;
use super::loader::{LoadError, Loader};
use crate::backend::cpu::{Matrix, ops};

pub struct HyperConnection {
    /// `[(2 + N) N, N D]`: the projection to pre, post and comb logits.
    pub(crate) proj: Matrix,
    pub(crate) base: Vec<f32>,
    pub(crate) scale: [f32; 3],
    pub(crate) streams: usize,
    pub(crate) hidden: usize,
    pub(crate) hc_eps: f32,
    pub(crate) norm_eps: f32,
    pub(crate) sinkhorn_iters: usize,
}

/// Per-token stream weights a sublayer's output is written back with.
pub struct StreamMix {
    /// `[T, N]`
    pub post: Vec<f32>,
    /// `[T, N, N]`, `comb[t][n][m]`: weight of input stream `n` in output stream `m`.
    pub comb: Vec<f32>,
}

impl HyperConnection {
    /// `which` is `attn` or `ffn`; accepts `hc_attn_fn` (original) and `attn_hc.fn` (fused).
    pub fn load(cfg: &Config, vb: Loader, which: &str) -> Result<HyperConnection, LoadError> {
        let n = cfg.hc_mult;
        let width = (2 + n) * n;
        let name = |part: &str| -> Result<String, LoadError> {
            let original = format!("hc_{which}_{part}");
            let fused = format!("{which}_hc.{part}");
            Ok(vb.pick(&[&original, &fused])?.to_string())
        };
        let scale = vb.vector(&name("scale")?, 3)?;
        Ok(HyperConnection::new(
            cfg,
            vb.matrix(&name("fn")?, width, n * cfg.hidden_size)?,
            vb.vector(&name("base")?, width)?,
            [scale[0], scale[1], scale[2]],
        ))
    }

    /// From weights already in hand: `proj` `[(2 + N) N, N D]`, `base` `[(2 + N) N]`.
    pub(crate) fn new(
        cfg: &Config,
        proj: Matrix,
        base: Vec<f32>,
        scale: [f32; 3],
    ) -> HyperConnection {
        HyperConnection {
            proj,
            base,
            scale,
            streams: cfg.hc_mult,
            hidden: cfg.hidden_size,
            hc_eps: cfg.hc_eps,
            norm_eps: cfg.rms_norm_eps,
            sinkhorn_iters: cfg.hc_sinkhorn_iters,
        }
    }

    /// Collapses `streams` (`[T, N, D]`) into the sublayer input `[T, D]` and returns the
    /// weights to expand the sublayer's output with.
    pub fn collapse(&self, streams: &[f32], tokens: usize) -> (Vec<f32>, StreamMix) {
        let (n, d) = (self.streams, self.hidden);
        let width = (2 + n) * n;
        let mut normed = streams.to_vec();
        ops::rms_norm(&mut normed, None, n * d, self.norm_eps);
        let logits = self.proj.matmul(&normed, tokens);

        let mut collapsed = vec![0f32; tokens * d];
        let mut post = vec![0f32; tokens * n];
        let mut comb = vec![0f32; tokens * n * n];
        for t in 0..tokens {
            let l = &logits[t * width..(t + 1) * width];
            let pre: Vec<f32> = (0..n)
                .map(|i| ops::sigmoid(l[i] * self.scale[0] + self.base[i]) + self.hc_eps)
                .collect();
            for i in 0..n {
                post[t * n + i] = 2.0 * ops::sigmoid(l[n + i] * self.scale[1] + self.base[n + i]);
            }
            let c = &mut comb[t * n * n..(t + 1) * n * n];
            for i in 0..n {
                let row = &mut c[i * n..(i + 1) * n];
                for j in 0..n {
                    row[j] = l[2 * n + i * n + j] * self.scale[2] + self.base[2 * n + i * n + j];
                }
                ops::softmax(row);
                row.iter_mut().for_each(|v| *v += self.hc_eps);
            }
            self.sinkhorn(c);
            let out = &mut collapsed[t * d..(t + 1) * d];
            let s = &streams[t * n * d..(t + 1) * n * d];
            for i in 0..n {
                ops::axpy(out, pre[i], &s[i * d..(i + 1) * d]);
            }
        }
        (collapsed, StreamMix { post, comb })
    }

    /// Columns once, then (iters - 1) times rows then columns; each divide adds eps.
    fn sinkhorn(&self, c: &mut [f32]) {
        let n = self.streams;
        let normalize_columns = |c: &mut [f32]| {
            for j in 0..n {
                let sum: f32 = (0..n).map(|i| c[i * n + j]).sum::<f32>() + self.hc_eps;
                (0..n).for_each(|i| c[i * n + j] /= sum);
            }
        };
        normalize_columns(c);
        for _ in 1..self.sinkhorn_iters {
            for row in c.chunks_exact_mut(n) {
                let sum: f32 = row.iter().sum::<f32>() + self.hc_eps;
                row.iter_mut().for_each(|v| *v /= sum);
            }
            normalize_columns(c);
        }
    }

    /// New streams: `stream[m] = post[m] * y + sum_n comb[n][m] * stream[n]`.
    pub fn expand(&self, mix: &StreamMix, streams: &[f32], y: &[f32], tokens: usize) -> Vec<f32> {
        let (n, d) = (self.streams, self.hidden);
        let mut out = vec![0f32; tokens * n * d];
        for t in 0..tokens {
            let s = &streams[t * n * d..(t + 1) * n * d];
            let yt = &y[t * d..(t + 1) * d];
            let c = &mix.comb[t * n * n..(t + 1) * n * n];
            for m in 0..n {
                let o = &mut out[(t * n + m) * d..(t * n + m + 1) * d];
                let p = mix.post[t * n + m];
                for k in 0..d {
                    let mut acc = 0f32;
                    for i in 0..n {
                        acc += c[i * n + m] * s[i * d + k];
                    }
                    o[k] = p * yt[k] + acc;
                }
            }
        }
        out
    }
}
