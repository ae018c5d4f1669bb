//! The device operations every block of the model is written over, once: a forward is the
//! same code on the host ([`Host`], the CPU backend, the reference op by op) and on a GPU
//! ([`Gpu`], the CUDA backend), and differs only in where its buffers live.
//!
//! A [`Device`] names its buffer types (activations and weight vectors, weight matrices, a
//! matrix read by rows, growable caches, token selections) and the ops the blocks need:
//! products, norms, mHC's collapse and expand, KDA's gates, conv and delta rule, MLA's
//! attention over the latents, the DSA indexer's pools and selection, routing, the routed
//! experts and the head's stream mean. An op takes its inputs as whole buffers and rows
//! `first .. first + len` of them where a sequence's share of a batch is meant.
//!
//! `tests/per_op` runs every op on both devices on fresh random inputs (`cuda-check`).

mod cache_rows;
mod gpu;
mod host;

pub use crate::backend::CacheDtype;
pub use crate::backend::cuda::attn::DsaSpec;
pub use crate::backend::cuda::{KdaGates, KdaSpec, MhcCollapse, MhcSpec, RouteSpec};
pub use cache_rows::CacheRows;
pub use gpu::{ATTN_QUERIES, DECODE_GRAPHS_KEPT, GROWTH_SLACK, Gpu, GrowBuf, decode_graphs};
pub use host::Host;

use super::kda::KdaMode;
use super::mla::MlaPath;
use super::moe::{ExpertProvider, Routing};
use crate::backend::cpu::Matrix;

/// The shape of one MLA layer's attention core.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlaSpec {
    pub heads: usize,
    /// Query/key width of a head (no rotary part: NoPE).
    pub nope: usize,
    pub v_dim: usize,
    /// The latent's width (`kv_lora_rank`).
    pub rank: usize,
}

impl MlaSpec {
    /// The softmax scale, `nope^-1/2`.
    pub fn scale(&self) -> f32 {
        (self.nope as f32).powf(-0.5)
    }
}

/// Operations on buffers that live on one device. Every block's forward is generic over it.
pub trait Device: Send + Sync + Sized {
    /// f32 values (activations, weight vectors, states) on the device.
    type Buf: Send + Sync;
    /// A weight matrix in its storage format, on the device.
    type Mat: Send + Sync;
    /// A matrix the ops read by rows as f32 (MLA's `kv_b`).
    type Table: Send + Sync;
    /// Values that grow by appended rows (the MLA and indexer caches), stored in a
    /// [`CacheDtype`]: f32 rows are rounded to it when pushed and widened back when read.
    type Grow: Send + Sync;
    /// The token selections of one sequence's new tokens.
    type Sel: Send + Sync;

    // --- placing weights and moving values ---

    /// `m` on this device (a copy, or a share of the copy it already has here).
    fn matrix(&self, m: &Matrix) -> anyhow::Result<Self::Mat>;
    /// `m` on this device as f32 rows.
    fn table(&self, m: &Matrix) -> anyhow::Result<Self::Table>;
    /// Output rows of a matrix on this device.
    fn mat_rows(m: &Self::Mat) -> usize;
    /// `values` on this device.
    fn upload(&self, values: &[f32]) -> anyhow::Result<Self::Buf>;
    /// The values of `b` on the host.
    fn download(&self, b: &Self::Buf) -> anyhow::Result<Vec<f32>>;
    /// `values` on this device (moved where the device is the host).
    fn take(&self, values: Vec<f32>) -> anyhow::Result<Self::Buf> {
        self.upload(&values)
    }
    /// Each row of `rows` (`width` values) `copies` times in a row, on this device (what the
    /// embedding's rows become as the mHC streams: the rows go up once, not once a stream).
    fn take_repeated(
        &self,
        rows: Vec<f32>,
        width: usize,
        copies: usize,
    ) -> anyhow::Result<Self::Buf> {
        let mut out = Vec::with_capacity(rows.len() * copies);
        for row in rows.chunks_exact(width.max(1)) {
            for _ in 0..copies {
                out.extend_from_slice(row);
            }
        }
        self.take(out)
    }
    /// `b`'s values on the host (moved where the device is the host).
    fn download_owned(&self, b: Self::Buf) -> anyhow::Result<Vec<f32>> {
        self.download(&b)
    }
    /// Rows of `b` (`[.., width]`) on the host, cut into one list per step: step i takes the
    /// next `counts[i]` rows, each cut to its first `keep` values (the head's logits).
    fn download_rows(
        &self,
        b: Self::Buf,
        counts: &[usize],
        width: usize,
        keep: usize,
    ) -> anyhow::Result<Vec<Vec<f32>>> {
        let all = self.download_owned(b)?;
        let rows: usize = counts.iter().sum();
        if counts.len() == 1 && width == keep && all.len() == rows * width {
            return Ok(vec![all]);
        }
        Ok(split_rows(&all, counts, width, keep))
    }
    /// `n` zeros.
    fn zeros(&self, n: usize) -> anyhow::Result<Self::Buf>;
    /// A growable buffer holding `values` in their dtype, with room for `spare` more values
    /// before it grows.
    fn grow(&self, values: &CacheRows, spare: usize) -> anyhow::Result<Self::Grow>;
    /// The values of a growable buffer on the host, in their dtype.
    fn grow_download(&self, g: &Self::Grow) -> anyhow::Result<CacheRows>;
    /// Selections made on the host, on this device (checks feed both devices the same).
    fn selections(&self, sel: &[Vec<u32>]) -> anyhow::Result<Self::Sel>;
    /// Selections on the host.
    fn selections_download(&self, sel: &Self::Sel) -> anyhow::Result<Vec<Vec<u32>>>;
    /// Values a growable buffer holds.
    fn grow_len(g: &Self::Grow) -> usize;
    /// Appends rows `first .. first + count` of `src` (`width` values each) to `g`, rounded to
    /// its dtype.
    fn push(
        &self,
        g: &mut Self::Grow,
        src: &Self::Buf,
        first: usize,
        count: usize,
        width: usize,
    ) -> anyhow::Result<()>;
    /// Rows `first .. first + count` of `src` (`width` values each), in a buffer of their own.
    fn rows(
        &self,
        src: &Self::Buf,
        first: usize,
        count: usize,
        width: usize,
    ) -> anyhow::Result<Self::Buf>;
    /// Writes `src` over `dst`'s rows from `first` on (`width` values each).
    fn put_rows(
        &self,
        dst: &mut Self::Buf,
        first: usize,
        width: usize,
        src: &Self::Buf,
    ) -> anyhow::Result<()>;
    /// What `join` makes of `side`'s and `main`'s results, the two independent: a device
    /// with a second queue runs `side` there beside `main` (see `Gpu`); here `side` runs
    /// first. Every value is the same either way.
    fn beside<A, B, C>(
        &self,
        side: impl FnOnce(&Self) -> anyhow::Result<A>,
        main: impl FnOnce(&Self) -> anyhow::Result<B>,
        join: impl FnOnce(&Self, &A, B) -> anyhow::Result<C>,
    ) -> anyhow::Result<C> {
        let a = side(self)?;
        let b = main(self)?;
        join(self, &a, b)
    }
    /// A batch of decode steps (one new token each, no hooks) as one replayed graph where the
    /// device keeps them (see `gpu/graph.rs`): the logits per step, each cache advanced as
    /// [`crate::model::glm5::Model::forward_on`] advances it, the same bits. `None`: run the
    /// forward op by op.
    fn decode_graph(
        &self,
        _model: &crate::model::glm5::Model,
        _w: &crate::model::glm5::Weights<Self>,
        _steps: &mut [crate::model::glm5::Step<Self>],
    ) -> anyhow::Result<Option<Vec<Vec<f32>>>> {
        Ok(None)
    }
    /// `f`, timed as phase `name` where the device keeps a profile.
    fn timed<T>(
        &self,
        _name: &'static str,
        f: impl FnOnce() -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        f()
    }

    // --- products and elementwise ops ---

    /// `y[n, rows] = x[n, cols] W^T`.
    fn matmul(&self, w: &Self::Mat, x: &Self::Buf, n: usize) -> anyhow::Result<Self::Buf>;
    /// RMSNorm of each row of `width` values, times `weight` when given.
    fn rms_norm(
        &self,
        x: &mut Self::Buf,
        weight: Option<&Self::Buf>,
        width: usize,
        eps: f32,
    ) -> anyhow::Result<()>;
    /// LayerNorm of `rows` rows of `width` values with weight and bias.
    fn layer_norm(
        &self,
        x: &mut Self::Buf,
        weight: &Self::Buf,
        bias: &Self::Buf,
        width: usize,
        eps: f32,
        rows: usize,
    ) -> anyhow::Result<()>;
    /// RMSNorm of each row of `width` values times `weight`, then times `sigmoid(gate)`.
    fn gated_rms_norm(
        &self,
        x: &mut Self::Buf,
        gate: &Self::Buf,
        weight: &Self::Buf,
        width: usize,
        eps: f32,
    ) -> anyhow::Result<()>;
    /// `x[..count] *= s`.
    fn scale(&self, x: &mut Self::Buf, s: f32, count: usize) -> anyhow::Result<()>;
    /// `y[..count] += x[..count]`.
    fn add(&self, y: &mut Self::Buf, x: &Self::Buf, count: usize) -> anyhow::Result<()>;
    /// `silu(min(gate, limit)) * clamp(up, -limit, limit)`.
    fn swiglu(&self, gate: &Self::Buf, up: &Self::Buf, limit: f32) -> anyhow::Result<Self::Buf>;
    /// `[n, 3c]`: each row's q|k|v from three `[n, c]` buffers.
    fn interleave3(
        &self,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        n: usize,
        c: usize,
    ) -> anyhow::Result<Self::Buf>;

    // --- blocks' cores ---

    /// mHC's projection of each token's RMS-normed (unweighted) streams: `[t, rows of proj]`
    /// from `streams` (`[t, width]`), which stay as they are.
    fn mhc_logits(
        &self,
        proj: &Self::Mat,
        streams: &Self::Buf,
        t: usize,
        width: usize,
        eps: f32,
    ) -> anyhow::Result<Self::Buf> {
        normed_product(self, proj, streams, t, width, eps)
    }
    /// mHC's weights from the projection's `logits` (`[t, (2 + N) N]`) and the pre-weighted
    /// sum of each token's `streams` (`[t, N, D]`).
    fn mhc_collapse(
        &self,
        spec: MhcSpec,
        logits: &Self::Buf,
        base: &Self::Buf,
        streams: &Self::Buf,
        t: usize,
    ) -> anyhow::Result<MhcCollapse<Self::Buf>>;
    /// [`Device::mhc_collapse`], then the sublayer's input norm on the collapsed rows
    /// (`rms_norm` with `weight`): one launch where the device fuses them.
    #[allow(clippy::too_many_arguments)]
    fn mhc_collapse_normed(
        &self,
        spec: MhcSpec,
        logits: &Self::Buf,
        base: &Self::Buf,
        streams: &Self::Buf,
        t: usize,
        weight: &Self::Buf,
        eps: f32,
    ) -> anyhow::Result<MhcCollapse<Self::Buf>> {
        let mut mix = self.mhc_collapse(spec, logits, base, streams, t)?;
        self.rms_norm(&mut mix.collapsed, Some(weight), spec.hidden, eps)?;
        Ok(mix)
    }
    /// New streams: `stream[m] = post[m] y + sum_n comb[n][m] stream[n]`.
    fn mhc_expand(
        &self,
        spec: MhcSpec,
        post: &Self::Buf,
        comb: &Self::Buf,
        streams: &Self::Buf,
        y: &Self::Buf,
        t: usize,
    ) -> anyhow::Result<Self::Buf>;
    /// KDA's per-channel log decay (`g`, from the forget gate's output, in place) and beta
    /// (`sigmoid`, in place) for `rows` tokens.
    fn kda_gates(
        &self,
        spec: KdaGates,
        g: &mut Self::Buf,
        dt_bias: &Self::Buf,
        a_log: &Self::Buf,
        beta: &mut Self::Buf,
        rows: usize,
    ) -> anyhow::Result<()>;
    /// Depthwise causal conv + SiLU over rows `first .. first + len` of `qkv` (`[.., 3C]`),
    /// continuing the sequence's conv `state`; `[len, 3C]`.
    fn kda_conv(
        &self,
        spec: KdaSpec,
        taps: &Self::Buf,
        qkv: &Self::Buf,
        first: usize,
        len: usize,
        state: &mut Self::Buf,
    ) -> anyhow::Result<Self::Buf>;
    /// The delta rule over a sequence's `len` tokens (`mixed`: the conv output `[len, 3C]`;
    /// rows `first ..` of `g` `[.., C]` and `beta` `[.., H]`) on its recurrent `state`;
    /// `[len, C]`.
    #[allow(clippy::too_many_arguments)]
    fn kda_delta(
        &self,
        spec: KdaSpec,
        mode: KdaMode,
        mixed: &Self::Buf,
        g: &Self::Buf,
        beta: &Self::Buf,
        first: usize,
        len: usize,
        state: &mut Self::Buf,
    ) -> anyhow::Result<Self::Buf>;
    /// A decode step's conv and delta rule for several sequences, one token each (row s of
    /// `qkv` `[n, 3C]`, `g` and `beta` is `states[s]`'s): `[n, C]`, each row the bits
    /// [`Device::kda_conv`] then [`Device::kda_delta`] give its sequence alone. `None` where
    /// the device has no launch for it (the caller then runs the sequences one by one).
    #[allow(clippy::too_many_arguments)]
    fn kda_decode(
        &self,
        _spec: KdaSpec,
        _taps: &Self::Buf,
        _qkv: &Self::Buf,
        _g: &Self::Buf,
        _beta: &Self::Buf,
        _states: &mut [&mut crate::model::kda::KdaState<Self>],
    ) -> anyhow::Result<Option<Self::Buf>> {
        Ok(None)
    }
    /// MLA's attention for a sequence's `len` new queries (rows `first ..` of `q`,
    /// `[.., heads, nope]`) over its cached `latents` (the new ones included), each query
    /// over its selected tokens; `[len, heads, v_dim]`.
    #[allow(clippy::too_many_arguments)]
    fn mla_attend(
        &self,
        spec: MlaSpec,
        path: MlaPath,
        kv_b: &Self::Table,
        q: &Self::Buf,
        first: usize,
        len: usize,
        latents: &Self::Grow,
        sel: &Self::Sel,
    ) -> anyhow::Result<Self::Buf>;
    /// A decode step's MLA attention for several sequences, one query each (row s of `q` is
    /// sequence s's, over `latents[s]` and `sels[s]`): `[n, heads, v_dim]`, each row the bits
    /// [`Device::mla_attend`] gives its sequence alone. `None` where the device has no launch
    /// for it (the caller then runs the sequences one by one).
    fn mla_attend_seqs(
        &self,
        _spec: MlaSpec,
        _kv_b: &Self::Table,
        _q: &Self::Buf,
        _latents: &[&Self::Grow],
        _sels: &[&Self::Sel],
    ) -> anyhow::Result<Option<Self::Buf>> {
        Ok(None)
    }
    /// The pool keys of the pools `keys` now completes (`[.., Di]` with `gates`; `ape`
    /// `[kpool, Di]`), appended to `pool_keys`.
    fn dsa_pools(
        &self,
        spec: DsaSpec,
        ape: &Self::Buf,
        keys: &Self::Grow,
        gates: &Self::Grow,
        pool_keys: &mut Self::Grow,
    ) -> anyhow::Result<()>;
    /// The selections of a sequence's `len` new tokens at positions `pos ..` (rows `first ..`
    /// of `q` `[.., heads, Di]` and `weights` `[.., heads]`) over its `pool_keys`.
    #[allow(clippy::too_many_arguments)]
    fn dsa_select(
        &self,
        spec: DsaSpec,
        q: &Self::Buf,
        weights: &Self::Buf,
        first: usize,
        len: usize,
        pos: usize,
        pool_keys: &Self::Grow,
    ) -> anyhow::Result<Self::Sel>;
    /// The router's choice for `n` tokens: ids and weights `[n, k]`, on the host (the tiers
    /// decide residency there).
    fn route(
        &self,
        weight: &Self::Mat,
        bias: &Self::Buf,
        spec: RouteSpec,
        x: &Self::Buf,
        n: usize,
    ) -> anyhow::Result<(Vec<u32>, Vec<f32>)>;
    /// The routed experts' weighted sum for `x` (`[tokens, hidden]`) through `experts`.
    fn experts(
        &self,
        experts: &dyn ExpertProvider,
        layer: usize,
        x: &Self::Buf,
        routing: &Routing,
        hidden: usize,
    ) -> anyhow::Result<Self::Buf>;
    /// The router and the routed experts of `layer` with the picks never leaving this
    /// device, when `experts` serves every pick of the layer here (see
    /// [`crate::model::moe::DeviceExperts::routes`]); `None` when the picks must come to the
    /// host ([`Device::route`] then [`Device::experts`]). Same bits either way.
    fn routed_experts(
        &self,
        _router: &super::moe::Router<Self>,
        _experts: &dyn ExpertProvider,
        _layer: usize,
        _x: &Self::Buf,
        _phases: &[super::moe::Phase],
    ) -> anyhow::Result<Option<Self::Buf>> {
        Ok(None)
    }
    /// `[rows.len(), d]`: the mean of the `n` streams of each listed row of `streams`.
    fn stream_mean(
        &self,
        streams: &Self::Buf,
        rows: &[usize],
        n: usize,
        d: usize,
    ) -> anyhow::Result<Self::Buf>;
}

/// `proj` times each row of `x` (`[t, width]`) RMS-normed (unweighted), normed in a copy: the
/// [`Device::mhc_logits`] of a device without a fused kernel for it.
fn normed_product<D: Device>(
    dev: &D,
    proj: &D::Mat,
    x: &D::Buf,
    t: usize,
    width: usize,
    eps: f32,
) -> anyhow::Result<D::Buf> {
    let mut normed = dev.rows(x, 0, t, width)?;
    dev.rms_norm(&mut normed, None, width, eps)?;
    dev.matmul(proj, &normed, t)
}

/// `values` (`[.., width]`) cut into one list per count of rows, each row cut to `keep`.
pub fn split_rows(values: &[f32], counts: &[usize], width: usize, keep: usize) -> Vec<Vec<f32>> {
    let mut rows = values.chunks(width.max(1));
    counts
        .iter()
        .map(|&c| {
            let mut out = Vec::with_capacity(c * keep);
            for row in rows.by_ref().take(c) {
                out.extend_from_slice(&row[..keep.min(row.len())]);
            }
            out
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::split_rows;

    #[test]
    fn split_rows_takes_each_steps_rows_and_cuts_the_padding() {
        // Three rows of width 4 (two steps: 2 rows, 1 row), kept to 3 values; a padded tail.
        let v: Vec<f32> = (0..14).map(|i| i as f32).collect();
        let got = split_rows(&v, &[2, 1], 4, 3);
        assert_eq!(got, vec![vec![0., 1., 2., 4., 5., 6.], vec![8., 9., 10.]]);
        assert_eq!(split_rows(&v, &[1], 4, 4), vec![vec![0., 1., 2., 3.]]);
    }
}
