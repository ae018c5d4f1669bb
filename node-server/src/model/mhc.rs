//! Manifold-constrained hyper-connections (mHC): the residual is `hc_mult` streams; each
//! sublayer reads a `pre`-weighted collapse of them and writes back through `post` and a
//! Sinkhorn-balanced stream mix `comb`.

use super::config::Config;
use super::device::{Device, Host, MhcCollapse, MhcSpec};
use super::loader::{LoadError, Loader};
use crate::backend::cpu::{Matrix, ops};

pub struct HyperConnection<D: Device = Host> {
    /// `[(2 + N) N, N D]`: the projection to pre, post and comb logits.
    pub(crate) proj: D::Mat,
    pub(crate) base: D::Buf,
    pub(crate) spec: MhcSpec,
    pub(crate) norm_eps: f32,
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
            spec: MhcSpec {
                streams: cfg.hc_mult,
                hidden: cfg.hidden_size,
                scale,
                hc_eps: cfg.hc_eps,
                sinkhorn_iters: cfg.hc_sinkhorn_iters,
            },
            norm_eps: cfg.rms_norm_eps,
        }
    }

    /// This block's weights on `dev`.
    pub fn place<E: Device>(&self, dev: &E) -> anyhow::Result<HyperConnection<E>> {
        Ok(HyperConnection {
            proj: dev.matrix(&self.proj)?,
            base: dev.upload(&self.base)?,
            spec: self.spec,
            norm_eps: self.norm_eps,
        })
    }
}

impl<D: Device> HyperConnection<D> {
    /// Collapses `streams` (`[T, N, D]`) into the sublayer input `[T, D]` and gives the
    /// weights to expand the sublayer's output with: unweighted RMSNorm of each token's
    /// streams, the projection, then the weights and the pre-weighted sum.
    pub fn collapse(
        &self,
        dev: &D,
        streams: &D::Buf,
        tokens: usize,
    ) -> anyhow::Result<MhcCollapse<D::Buf>> {
        let (n, d) = (self.spec.streams, self.spec.hidden);
        let logits = dev.mhc_logits(&self.proj, streams, tokens, n * d, self.norm_eps)?;
        dev.mhc_collapse(self.spec, &logits, &self.base, streams, tokens)
    }

    /// [`HyperConnection::collapse`] with the sublayer's input norm (`rms_norm` with
    /// `weight`) applied to the collapsed rows, fused where the device can.
    pub fn collapse_normed(
        &self,
        dev: &D,
        streams: &D::Buf,
        tokens: usize,
        weight: &D::Buf,
        eps: f32,
    ) -> anyhow::Result<MhcCollapse<D::Buf>> {
        let (n, d) = (self.spec.streams, self.spec.hidden);
        let logits = dev.mhc_logits(&self.proj, streams, tokens, n * d, self.norm_eps)?;
        dev.mhc_collapse_normed(self.spec, &logits, &self.base, streams, tokens, weight, eps)
    }

    /// New streams: `stream[m] = post[m] * y + sum_n comb[n][m] * stream[n]`.
    pub fn expand(
        &self,
        dev: &D,
        mix: &MhcCollapse<D::Buf>,
        streams: &D::Buf,
        y: &D::Buf,
        tokens: usize,
    ) -> anyhow::Result<D::Buf> {
        dev.mhc_expand(self.spec, &mix.post, &mix.comb, streams, y, tokens)
    }
}

/// mHC's weights from the projection's logits and the collapse of `streams`, on the host.
pub(crate) fn collapse_mix(
    spec: MhcSpec,
    logits: &[f32],
    base: &[f32],
    streams: &[f32],
    tokens: usize,
) -> MhcCollapse<Vec<f32>> {
    let (n, d) = (spec.streams, spec.hidden);
    let width = (2 + n) * n;
    let (scale, eps) = (spec.scale, spec.hc_eps);
    let mut collapsed = vec![0f32; tokens * d];
    let mut post = vec![0f32; tokens * n];
    let mut comb = vec![0f32; tokens * n * n];
    for t in 0..tokens {
        let l = &logits[t * width..(t + 1) * width];
        let pre: Vec<f32> = (0..n)
            .map(|i| ops::sigmoid(l[i] * scale[0] + base[i]) + eps)
            .collect();
        for i in 0..n {
            post[t * n + i] = 2.0 * ops::sigmoid(l[n + i] * scale[1] + base[n + i]);
        }
        let c = &mut comb[t * n * n..(t + 1) * n * n];
        for i in 0..n {
            let row = &mut c[i * n..(i + 1) * n];
            for j in 0..n {
                row[j] = l[2 * n + i * n + j] * scale[2] + base[2 * n + i * n + j];
            }
            ops::softmax(row);
            row.iter_mut().for_each(|v| *v += eps);
        }
        sinkhorn(c, n, eps, spec.sinkhorn_iters);
        let out = &mut collapsed[t * d..(t + 1) * d];
        let s = &streams[t * n * d..(t + 1) * n * d];
        for i in 0..n {
            ops::axpy(out, pre[i], &s[i * d..(i + 1) * d]);
        }
    }
    MhcCollapse {
        collapsed,
        post,
        comb,
    }
}

/// Columns once, then (iters - 1) times rows then columns; each divide adds eps.
fn sinkhorn(c: &mut [f32], n: usize, eps: f32, iters: usize) {
    let normalize_columns = |c: &mut [f32]| {
        for j in 0..n {
            let sum: f32 = (0..n).map(|i| c[i * n + j]).sum::<f32>() + eps;
            (0..n).for_each(|i| c[i * n + j] /= sum);
        }
    };
    normalize_columns(c);
    for _ in 1..iters {
        for row in c.chunks_exact_mut(n) {
            let sum: f32 = row.iter().sum::<f32>() + eps;
            row.iter_mut().for_each(|v| *v /= sum);
        }
        normalize_columns(c);
    }
}

/// `stream[m] = post[m] * y + sum_n comb[n][m] * stream[n]`, on the host.
pub(crate) fn expand(
    spec: MhcSpec,
    post: &[f32],
    comb: &[f32],
    streams: &[f32],
    y: &[f32],
    tokens: usize,
) -> Vec<f32> {
    let (n, d) = (spec.streams, spec.hidden);
    let mut out = vec![0f32; tokens * n * d];
    for t in 0..tokens {
        let s = &streams[t * n * d..(t + 1) * n * d];
        let yt = &y[t * d..(t + 1) * d];
        let c = &comb[t * n * n..(t + 1) * n * n];
        for m in 0..n {
            let o = &mut out[(t * n + m) * d..(t * n + m + 1) * d];
            let p = post[t * n + m];
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
