//! KDA linear attention (Kimi delta attention) with a depthwise causal conv on q|k|v.
//!
//! Per head the state `S` (`Dk x Dv`, f32) evolves as `S *= exp(g)` (per key channel),
//! `S += k (beta (v - k^T S))^T`, and the output is `o = q^T S`. Decode steps that recurrence
//! once per token; prefill uses the chunked (WY) form over chunks of [`CHUNK`] tokens, which
//! computes the same thing with matrix products inside each chunk.

use super::config::Config;
use super::device::{Device, Host, KdaGates, KdaSpec};
use super::loader::{LoadError, Loader};
use crate::backend::cpu::ops;
use rayon::prelude::*;

/// Chunk length of the chunked prefill form (as the reference's).
pub const CHUNK: usize = 64;
/// The eps of the q and k l2-norms (under the square root).
pub(crate) const L2_EPS: f32 = 1e-6;

/// The q, k and v projections: three matrices (transformers' layout), or one fused `[3C, D]`
/// matrix with q|k|v along its outputs (exllamav3's `qkv_proj`).
pub enum QkvProjection<D: Device = Host> {
    Split { q: D::Mat, k: D::Mat, v: D::Mat },
    Fused(D::Mat),
}

impl<D: Device> QkvProjection<D> {
    /// `[tokens, 3C]`: each token's q|k|v.
    fn apply(&self, dev: &D, x: &D::Buf, tokens: usize) -> anyhow::Result<D::Buf> {
        match self {
            QkvProjection::Fused(qkv) => dev.matmul(qkv, x, tokens),
            QkvProjection::Split { q, k, v } => {
                let c = D::mat_rows(q);
                let (q, k, v) = (
                    dev.matmul(q, x, tokens)?,
                    dev.matmul(k, x, tokens)?,
                    dev.matmul(v, x, tokens)?,
                );
                dev.interleave3(&q, &k, &v, tokens, c)
            }
        }
    }
}

pub struct Kda<D: Device = Host> {
    pub(crate) qkv: QkvProjection<D>,
    /// `[3C, K]`: depthwise conv taps over the concatenated q|k|v channels.
    pub(crate) conv: D::Buf,
    pub(crate) f_a: D::Mat,
    pub(crate) f_b: D::Mat,
    pub(crate) dt_bias: D::Buf,
    pub(crate) a_log: D::Buf,
    pub(crate) b_proj: D::Mat,
    pub(crate) g_a: D::Mat,
    pub(crate) g_b: D::Mat,
    pub(crate) o_norm: D::Buf,
    pub(crate) o_proj: D::Mat,
    pub(crate) spec: KdaSpec,
    pub(crate) lower_bound: Option<f32>,
    pub(crate) eps: f32,
}

/// Per-sequence KDA state: the last `K - 1` conv inputs and the recurrent state.
pub struct KdaState<D: Device = Host> {
    /// `[(K - 1), 3C]`, oldest first.
    pub conv: D::Buf,
    /// `[H, Dk, Dv]`
    pub recurrent: D::Buf,
}

impl Clone for KdaState {
    fn clone(&self) -> Self {
        KdaState {
            conv: self.conv.clone(),
            recurrent: self.recurrent.clone(),
        }
    }
}

impl PartialEq for KdaState {
    fn eq(&self, other: &Self) -> bool {
        self.conv == other.conv && self.recurrent == other.recurrent
    }
}

impl std::fmt::Debug for KdaState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KdaState")
            .field("conv", &self.conv.len())
            .field("recurrent", &self.recurrent.len())
            .finish()
    }
}

impl KdaState {
    pub fn new(cfg: &Config) -> KdaState {
        let c = cfg.kda_dim();
        KdaState {
            conv: vec![0.0; (cfg.linear_conv_kernel_dim - 1) * 3 * c],
            recurrent: vec![0.0; cfg.linear_num_heads * cfg.linear_head_dim * cfg.linear_head_dim],
        }
    }

    pub fn bytes(&self) -> usize {
        (self.conv.len() + self.recurrent.len()) * 4
    }

    /// This state on `dev`.
    pub fn place<E: Device>(&self, dev: &E) -> anyhow::Result<KdaState<E>> {
        Ok(KdaState {
            conv: dev.upload(&self.conv)?,
            recurrent: dev.upload(&self.recurrent)?,
        })
    }
}

impl<D: Device> KdaState<D> {
    /// This state on the host; `conv_len` values of conv state (a buffer on a device may
    /// hold one unused value where a kernel of 1 keeps none).
    pub fn to_host(&self, dev: &D, conv_len: usize) -> anyhow::Result<KdaState> {
        let mut conv = dev.download(&self.conv)?;
        conv.truncate(conv_len);
        Ok(KdaState {
            conv,
            recurrent: dev.download(&self.recurrent)?,
        })
    }
}

/// How the recurrence runs over a span of tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KdaMode {
    /// Chunked for more than one token, recurrent for one (what the engine does).
    Auto,
    /// Token by token (the decode form), whatever the length.
    Recurrent,
}

impl Kda {
    pub fn load(cfg: &Config, vb: Loader) -> Result<Kda, LoadError> {
        let (d, c, h, dh, k) = (
            cfg.hidden_size,
            cfg.kda_dim(),
            cfg.linear_num_heads,
            cfg.linear_head_dim,
            cfg.linear_conv_kernel_dim,
        );
        let conv = if vb.contains("conv1d.weight") {
            vb.f32s("conv1d.weight", &[3 * c, 1, k])?
        } else {
            let mut taps = vb.f32s("q_conv1d.weight", &[c, 1, k])?;
            taps.extend(vb.f32s("k_conv1d.weight", &[c, 1, k])?);
            taps.extend(vb.f32s("v_conv1d.weight", &[c, 1, k])?);
            taps
        };
        let fg = if vb.has_matrix("forget_gate.f_a_proj.weight") {
            vb.pp("forget_gate")
        } else {
            vb
        };
        let qkv = if vb.has_matrix("qkv_proj.weight") {
            QkvProjection::Fused(vb.matrix("qkv_proj.weight", 3 * c, d)?)
        } else {
            QkvProjection::Split {
                q: vb.matrix("q_proj.weight", c, d)?,
                k: vb.matrix("k_proj.weight", c, d)?,
                v: vb.matrix("v_proj.weight", c, d)?,
            }
        };
        Ok(Kda {
            qkv,
            conv,
            f_a: fg.matrix("f_a_proj.weight", dh, d)?,
            f_b: fg.matrix("f_b_proj.weight", c, dh)?,
            dt_bias: fg.vector("dt_bias", c)?,
            a_log: fg.vector("A_log", h)?,
            b_proj: vb.matrix("b_proj.weight", h, d)?,
            g_a: vb.matrix("g_a_proj.weight", dh, d)?,
            g_b: vb.matrix("g_b_proj.weight", c, dh)?,
            o_norm: vb.vector("o_norm.weight", dh)?,
            o_proj: vb.matrix("o_proj.weight", d, c)?,
            spec: KdaSpec {
                heads: h,
                head_dim: dh,
                kernel: k,
                l2_eps: L2_EPS,
            },
            lower_bound: cfg.linear_lower_bound,
            eps: cfg.rms_norm_eps,
        })
    }

    /// This block's weights on `dev`.
    pub fn place<E: Device>(&self, dev: &E) -> anyhow::Result<Kda<E>> {
        let m = |x| dev.matrix(x);
        Ok(Kda {
            qkv: match &self.qkv {
                QkvProjection::Split { q, k, v } => QkvProjection::Split {
                    q: m(q)?,
                    k: m(k)?,
                    v: m(v)?,
                },
                QkvProjection::Fused(qkv) => QkvProjection::Fused(m(qkv)?),
            },
            conv: dev.upload(&self.conv)?,
            f_a: m(&self.f_a)?,
            f_b: m(&self.f_b)?,
            dt_bias: dev.upload(&self.dt_bias)?,
            a_log: dev.upload(&self.a_log)?,
            b_proj: m(&self.b_proj)?,
            g_a: m(&self.g_a)?,
            g_b: m(&self.g_b)?,
            o_norm: dev.upload(&self.o_norm)?,
            o_proj: m(&self.o_proj)?,
            spec: self.spec,
            lower_bound: self.lower_bound,
            eps: self.eps,
        })
    }
}

impl<D: Device> Kda<D> {
    /// Runs the layer over `x` (`[T, D]`, all sequences' tokens); `spans[i]` is sequence i's
    /// `(first row, rows)`, continuing from `states[i]`: the conv and the delta rule run over
    /// a sequence's tokens in order.
    pub fn forward(
        &self,
        dev: &D,
        x: &D::Buf,
        spans: &[(usize, usize)],
        states: &mut [&mut KdaState<D>],
        mode: KdaMode,
    ) -> anyhow::Result<D::Buf> {
        let tokens: usize = spans.iter().map(|s| s.1).sum();
        let spec = self.spec;
        let gates = KdaGates {
            heads: spec.heads,
            head_dim: spec.head_dim,
            lower_bound: self.lower_bound,
        };
        // The gates' small products beside the qkv projection (on a second queue where the
        // device has one); the rest after both.
        dev.beside(
            |dev| {
                let mut g = dev.matmul(&self.f_b, &dev.matmul(&self.f_a, x, tokens)?, tokens)?;
                let mut beta = dev.matmul(&self.b_proj, x, tokens)?;
                dev.kda_gates(gates, &mut g, &self.dt_bias, &self.a_log, &mut beta, tokens)?;
                let out_gate = dev.matmul(&self.g_b, &dev.matmul(&self.g_a, x, tokens)?, tokens)?;
                Ok([g, beta, out_gate])
            },
            |dev| self.qkv.apply(dev, x, tokens),
            |dev, gates, qkv| self.mix(dev, &qkv, gates, spans, states, mode),
        )
    }

    /// [`Kda::forward`] from the projections (`gates`: the decay, beta and the output gate):
    /// the conv and the delta rule per sequence (or one launch for a decode batch), the gated
    /// norm and the output projection.
    fn mix(
        &self,
        dev: &D,
        qkv: &D::Buf,
        [g, beta, out_gate]: &[D::Buf; 3],
        spans: &[(usize, usize)],
        states: &mut [&mut KdaState<D>],
        mode: KdaMode,
    ) -> anyhow::Result<D::Buf> {
        let tokens: usize = spans.iter().map(|s| s.1).sum();
        let spec = self.spec;
        let (c, dh) = (spec.channels(), spec.head_dim);

        // A decode step of several sequences (one token each: the recurrent form in either
        // mode), one launch per op where the device has it.
        let decode = spans.len() > 1
            && (spans.iter().enumerate()).all(|(s, &(first, len))| first == s && len == 1);
        let batched = match decode {
            true => dev.kda_decode(spec, &self.conv, qkv, g, beta, states)?,
            false => None,
        };
        if let Some(mut core) = batched {
            dev.gated_rms_norm(&mut core, out_gate, &self.o_norm, dh, self.eps)?;
            return dev.matmul(&self.o_proj, &core, tokens);
        }
        // One sequence's output is the whole core; several are put in their rows.
        let mut core = (spans.len() != 1)
            .then(|| dev.zeros(tokens * c))
            .transpose()?;
        for (&(first, len), state) in spans.iter().zip(states.iter_mut()) {
            let mixed = dev.kda_conv(spec, &self.conv, qkv, first, len, &mut state.conv)?;
            let out = dev.kda_delta(
                spec,
                mode,
                &mixed,
                g,
                beta,
                first,
                len,
                &mut state.recurrent,
            )?;
            match &mut core {
                Some(core) => dev.put_rows(core, first, c, &out)?,
                None => core = Some(out),
            }
        }
        let Some(mut core) = core else {
            anyhow::bail!("KDA: no sequence in the batch");
        };
        // Gated RMSNorm per head, then the output projection.
        dev.gated_rms_norm(&mut core, out_gate, &self.o_norm, dh, self.eps)?;
        dev.matmul(&self.o_proj, &core, tokens)
    }
}

/// The per-channel log decay `g` (`[rows, C]`, <= 0) from the forget gate's output, in place.
pub(crate) fn gates(spec: KdaGates, g: &mut [f32], dt_bias: &[f32], a_log: &[f32], rows: usize) {
    let dh = spec.head_dim;
    let c = spec.heads * dh;
    for t in 0..rows {
        for ch in 0..c {
            let rate = a_log[ch / dh].exp();
            let pre = g[t * c + ch] + dt_bias[ch];
            g[t * c + ch] = match spec.lower_bound {
                Some(bound) => bound * ops::sigmoid(rate * pre),
                None => {
                    let softplus = if pre > 20.0 {
                        pre
                    } else {
                        (1.0 + pre.exp()).ln()
                    };
                    -rate * softplus
                }
            };
        }
    }
}

/// Depthwise causal conv (kernel `k`, no bias) + SiLU over `[T, 3C]`, continuing
/// `conv_state`; `taps` is `[3C, k]`.
pub(crate) fn conv_step(
    taps: &[f32],
    k: usize,
    qkv: &[f32],
    len: usize,
    conv_state: &mut [f32],
) -> Vec<f32> {
    let width = qkv.len() / len.max(1);
    let hist = k - 1;
    // Inputs of the window: the K-1 remembered rows, then this span's rows.
    let mut window = conv_state.to_vec();
    window.extend_from_slice(qkv);
    let mut out = vec![0f32; len * width];
    for t in 0..len {
        for ch in 0..width {
            let taps = &taps[ch * k..(ch + 1) * k];
            let mut acc = 0f32;
            for (j, w) in taps.iter().enumerate() {
                acc += w * window[(t + j) * width + ch];
            }
            out[t * width + ch] = ops::silu(acc);
        }
    }
    conv_state.copy_from_slice(&window[len * width..(len + hist) * width]);
    out
}

/// Normalises q and k of the conv output `mixed` (`[T, 3C]`), then runs the delta rule per
/// head (in parallel across heads) on `state` (`[H, d, d]`) with the tokens' log decays `g`
/// (`[T, C]`) and betas (`[T, H]`, so T = beta.len() / H); returns `[T, C]`.
pub(crate) fn attend(
    mixed: &[f32],
    g: &[f32],
    beta: &[f32],
    h: usize,
    dh: usize,
    state: &mut [f32],
    mode: KdaMode,
) -> Vec<f32> {
    let c = h * dh;
    let len = beta.len() / h;
    let scale = 1.0 / (dh as f32).sqrt();
    let mut out = vec![0f32; len * c];
    let per_head: Vec<Vec<f32>> = state
        .par_chunks_mut(dh * dh)
        .enumerate()
        .map(|(head, s)| {
            let gather = |offset: usize| -> Vec<f32> {
                let mut v = Vec::with_capacity(len * dh);
                for t in 0..len {
                    v.extend_from_slice(
                        &mixed
                            [t * 3 * c + offset + head * dh..t * 3 * c + offset + (head + 1) * dh],
                    );
                }
                v
            };
            let mut q = gather(0);
            let mut k = gather(c);
            let v = gather(2 * c);
            ops::l2_norm(&mut q, dh, L2_EPS);
            ops::l2_norm(&mut k, dh, L2_EPS);
            q.iter_mut().for_each(|x| *x *= scale);
            let gh: Vec<f32> = (0..len)
                .flat_map(|t| g[t * c + head * dh..t * c + (head + 1) * dh].to_vec())
                .collect();
            let bh: Vec<f32> = (0..len).map(|t| beta[t * h + head]).collect();
            if len == 1 || mode == KdaMode::Recurrent {
                recurrent(&q, &k, &v, &gh, &bh, dh, s)
            } else {
                chunked(&q, &k, &v, &gh, &bh, dh, s)
            }
        })
        .collect();
    for (head, o) in per_head.iter().enumerate() {
        for t in 0..len {
            out[t * c + head * dh..t * c + (head + 1) * dh]
                .copy_from_slice(&o[t * dh..(t + 1) * dh]);
        }
    }
    out
}

/// The delta rule token by token. `s` is `[Dk, Dv]` with `Dk = Dv = d`.
pub fn recurrent(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    d: usize,
    s: &mut [f32],
) -> Vec<f32> {
    let len = beta.len();
    let mut out = vec![0f32; len * d];
    let mut kv_mem = vec![0f32; d];
    for t in 0..len {
        let (qt, kt, vt, gt) = (
            &q[t * d..(t + 1) * d],
            &k[t * d..(t + 1) * d],
            &v[t * d..(t + 1) * d],
            &g[t * d..(t + 1) * d],
        );
        for i in 0..d {
            let decay = gt[i].exp();
            s[i * d..(i + 1) * d].iter_mut().for_each(|x| *x *= decay);
        }
        kv_mem.iter_mut().for_each(|x| *x = 0.0);
        for i in 0..d {
            ops::axpy(&mut kv_mem, kt[i], &s[i * d..(i + 1) * d]);
        }
        let delta: Vec<f32> = vt
            .iter()
            .zip(&kv_mem)
            .map(|(v, m)| (v - m) * beta[t])
            .collect();
        for i in 0..d {
            ops::axpy(&mut s[i * d..(i + 1) * d], kt[i], &delta);
        }
        let o = &mut out[t * d..(t + 1) * d];
        for i in 0..d {
            ops::axpy(o, qt[i], &s[i * d..(i + 1) * d]);
        }
    }
    out
}

/// The chunked (WY) form of [`recurrent`]: within a chunk the delta rule's triangular system
/// is solved by forward substitution, then one state update per chunk.
pub fn chunked(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    d: usize,
    s: &mut [f32],
) -> Vec<f32> {
    let len = beta.len();
    let mut out = vec![0f32; len * d];
    for c0 in (0..len).step_by(CHUNK) {
        let n = CHUNK.min(len - c0);
        let rows = |x: &[f32]| x[c0 * d..(c0 + n) * d].to_vec();
        let (qc, kc, vc) = (rows(q), rows(k), rows(v));
        let bc = &beta[c0..c0 + n];
        // Cumulative log decay within the chunk.
        let mut gc = rows(g);
        for t in 1..n {
            for i in 0..d {
                gc[t * d + i] += gc[(t - 1) * d + i];
            }
        }
        // With D_ij[c] = exp(G_i[c] - G_j[c]) (j <= i, one exp each, shared by both):
        // A[i][j] = -beta_i sum_c k_i[c] k_j[c] D_ij[c] for j < i (the delta rule's triangular
        // system, solved below by forward substitution as the reference does), and the
        // intra-chunk attention P[i][j] = sum_c q_i[c] k_j[c] D_ij[c] for j <= i.
        let mut a = vec![0f32; n * n];
        let mut intra = vec![0f32; n * n];
        let mut decay = vec![0f32; d];
        for i in 0..n {
            for j in 0..=i {
                let (gi, gj) = (&gc[i * d..(i + 1) * d], &gc[j * d..(j + 1) * d]);
                decay
                    .iter_mut()
                    .zip(gi.iter().zip(gj))
                    .for_each(|(e, (x, y))| *e = (x - y).exp());
                let (ki, kj, qi) = (
                    &kc[i * d..(i + 1) * d],
                    &kc[j * d..(j + 1) * d],
                    &qc[i * d..(i + 1) * d],
                );
                decay.iter_mut().zip(kj).for_each(|(e, k)| *e *= k);
                let (kk, qk) = (ops::dot(ki, &decay), ops::dot(qi, &decay));
                if j < i {
                    a[i * n + j] = -(kk * bc[i]);
                }
                intra[i * n + j] = qk;
            }
        }
        for i in 1..n {
            let row: Vec<f32> = a[i * n..i * n + i].to_vec();
            for j in 0..i {
                let mut acc = 0f32;
                for m in 0..i {
                    acc += row[m] * a[m * n + j];
                }
                a[i * n + j] = row[j] + acc;
            }
        }
        for i in 0..n {
            a[i * n + i] += 1.0;
        }
        // u = T (beta v), w = T (beta k exp(G)).
        let v_beta: Vec<f32> = (0..n * d).map(|x| vc[x] * bc[x / d]).collect();
        let k_beta_decay: Vec<f32> = (0..n * d)
            .map(|x| kc[x] * bc[x / d] * gc[x].exp())
            .collect();
        let mut u = vec![0f32; n * d];
        let mut w = vec![0f32; n * d];
        for i in 0..n {
            for j in 0..=i {
                let t = a[i * n + j];
                ops::axpy(&mut u[i * d..(i + 1) * d], t, &v_beta[j * d..(j + 1) * d]);
                ops::axpy(
                    &mut w[i * d..(i + 1) * d],
                    t,
                    &k_beta_decay[j * d..(j + 1) * d],
                );
            }
        }
        // v_new = u - w S
        let mut v_new = u;
        for i in 0..n {
            for c in 0..d {
                ops::axpy(
                    &mut v_new[i * d..(i + 1) * d],
                    -w[i * d + c],
                    &s[c * d..(c + 1) * d],
                );
            }
        }
        // o_i = (q_i exp(G_i)) S + sum_{j<=i} (q_i . k_j exp(G_i - G_j)) v_new_j
        for i in 0..n {
            let o = &mut out[(c0 + i) * d..(c0 + i + 1) * d];
            for c in 0..d {
                let coef = qc[i * d + c] * gc[i * d + c].exp();
                ops::axpy(o, coef, &s[c * d..(c + 1) * d]);
            }
            for j in 0..=i {
                ops::axpy(o, intra[i * n + j], &v_new[j * d..(j + 1) * d]);
            }
        }
        // S = S exp(G_last) + sum_j (k_j exp(G_last - G_j))^T v_new_j
        let last = &gc[(n - 1) * d..n * d];
        for c in 0..d {
            let decay = last[c].exp();
            s[c * d..(c + 1) * d].iter_mut().for_each(|x| *x *= decay);
        }
        for j in 0..n {
            for c in 0..d {
                let coef = kc[j * d + c] * (last[c] - gc[j * d + c]).exp();
                ops::axpy(&mut s[c * d..(c + 1) * d], coef, &v_new[j * d..(j + 1) * d]);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn chunked_equals_recurrent_across_chunks() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let (len, d) = (150, 8);
        let mut rnd = |n: usize, lo: f32, hi: f32| -> Vec<f32> {
            (0..n).map(|_| rng.random_range(lo..hi)).collect()
        };
        let mut q = rnd(len * d, -1.0, 1.0);
        let mut k = rnd(len * d, -1.0, 1.0);
        ops::l2_norm(&mut q, d, L2_EPS);
        ops::l2_norm(&mut k, d, L2_EPS);
        let v = rnd(len * d, -1.0, 1.0);
        let g = rnd(len * d, -0.5, 0.0);
        let beta = rnd(len, 0.0, 1.0);
        let s0 = rnd(d * d, -0.5, 0.5);
        let (mut s1, mut s2) = (s0.clone(), s0);
        let o1 = recurrent(&q, &k, &v, &g, &beta, d, &mut s1);
        let o2 = chunked(&q, &k, &v, &g, &beta, d, &mut s2);
        let max_diff = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max)
        };
        assert!(
            max_diff(&o1, &o2) < 1e-4,
            "outputs differ by {}",
            max_diff(&o1, &o2)
        );
        assert!(
            max_diff(&s1, &s2) < 1e-4,
            "states differ by {}",
            max_diff(&s1, &s2)
        );
    }
}
