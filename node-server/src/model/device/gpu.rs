//! The GPU device: buffers in device memory, every op a launch of the CUDA backend's kernels
//! (or cuBLAS). Only the tokens' embedding rows go up and logits and routing picks come down.

use super::*;
use crate::backend::AttnLayout;
use crate::backend::cuda::Cuda;
use crate::backend::cuda::attn::DeviceSelections;
use crate::backend::cuda::matrix::CudaMatrix;
use crate::quant::Format;
use anyhow::bail;
use cudarc::driver::CudaSlice;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

mod absorb;
mod graph;
mod side;
mod timing;
use graph::Graphs;
pub use graph::{DECODE_GRAPHS_KEPT, decode_graphs};
use side::Side;
pub use side::side_stream;

type Buf = CudaSlice<f32>;

/// Queries of one attention launch (its scratch holds a score per selected token of each
/// query and head: 256 x 64 heads x 2,048 tokens is 128 MiB at the real widths).
pub const ATTN_QUERIES: usize = 256;

/// A growable buffer holds at most `1 + 1 / GROWTH_SLACK` times its values.
pub const GROWTH_SLACK: usize = 4;

/// One CUDA device, with an optional profile of the forward's phases.
pub struct Gpu {
    cuda: Arc<Cuda>,
    /// Wall time per phase, each between two synchronisations; only with
    /// `GLMFLASH_GPU_PROFILE` set (the synchronisations cost overlap). With
    /// `GLMFLASH_GPU_PROFILE=host`, no synchronisation: the host's own time per phase
    /// (queueing its launches), which is what bounds a step whose GPU waits on the host.
    profile: Option<Arc<Profile>>,
    /// The profile times the host alone (`GLMFLASH_GPU_PROFILE=host`).
    host_profile: bool,
    /// Nanoseconds the host spent in downloads (each waits for the work queued before it):
    /// a step that spends none of its time here is bound by the host's launches.
    waited_ns: std::sync::atomic::AtomicU64,
    /// The second queue [`Device::beside`] runs its side work on, made at its first use;
    /// `None`: the side work runs on this queue, before the main work.
    side: Option<Mutex<Option<Side>>>,
    /// Decode steps captured as graphs, and the inputs of one being captured.
    graphs: Graphs,
}

/// Seconds and runs per phase.
type Profile = Mutex<BTreeMap<&'static str, (f64, u64)>>;

/// Device values that grow by appended rows (the caches of MLA layers), as bytes of their
/// dtype (the bytes [`CacheRows::to_le_bytes`] gives): pushes round f32 rows to it, the
/// attention and indexer kernels widen it back.
pub struct GrowBuf {
    buf: CudaSlice<u8>,
    dtype: CacheDtype,
    /// Values in use.
    len: usize,
}

impl GrowBuf {
    /// Values the buffer has room for.
    fn capacity(&self) -> usize {
        self.buf.len() / self.dtype.bytes()
    }
}

impl Gpu {
    /// The device behind `cuda`, with a second queue when [`side_stream`] says so.
    pub fn new(cuda: &Arc<Cuda>) -> Gpu {
        Gpu::with_side_stream(cuda, side_stream())
    }

    /// The device behind `cuda`, with a second queue for [`Device::beside`] or without.
    pub fn with_side_stream(cuda: &Arc<Cuda>, side: bool) -> Gpu {
        Gpu {
            cuda: cuda.clone(),
            profile: std::env::var_os("GLMFLASH_GPU_PROFILE").map(|_| Default::default()),
            host_profile: std::env::var_os("GLMFLASH_GPU_PROFILE").is_some_and(|v| v == "host"),
            waited_ns: Default::default(),
            side: side.then(|| Mutex::new(None)),
            graphs: Default::default(),
        }
    }

    pub fn cuda(&self) -> &Arc<Cuda> {
        &self.cuda
    }

    fn alloc(&self, n: usize) -> anyhow::Result<Buf> {
        Ok(self.cuda.alloc_f32(n)?)
    }

    /// Room in `g` for `n` more values: grown by a quarter (or to what is needed) when full,
    /// so a cache holds at most a quarter more than its values (the VRAM budget counts it).
    fn make_room(&self, g: &mut GrowBuf, n: usize) -> anyhow::Result<()> {
        if g.len + n <= g.capacity() {
            return Ok(());
        }
        if self.cuda.capturing() {
            bail!("a cache grows inside a graph's capture");
        }
        let (s, size, cap) = (self.cuda.stream(), g.dtype.bytes(), g.capacity());
        let values = (cap + cap / GROWTH_SLACK).max(g.len + n);
        let mut grown = s.alloc_zeros::<u8>(values * size)?;
        if g.len > 0 {
            let mut dst = grown.slice_mut(..g.len * size);
            s.memcpy_dtod(&g.buf.slice(..g.len * size), &mut dst)?;
        }
        g.buf = grown;
        Ok(())
    }

    /// mHC's collapse into fresh buffers, with the input norm in the same launch when `norm`.
    fn collapse_with(
        &self,
        spec: MhcSpec,
        logits: &Buf,
        base: &Buf,
        streams: &Buf,
        t: usize,
        norm: Option<(&Buf, f32)>,
    ) -> anyhow::Result<MhcCollapse<Buf>> {
        let (n, d) = (spec.streams, spec.hidden);
        let mut out = MhcCollapse {
            collapsed: self.alloc(t * d)?,
            post: self.alloc(t * n)?,
            comb: self.alloc(t * n * n)?,
        };
        self.cuda
            .mhc_collapse_dev(spec, logits, base, streams, t, norm, &mut out)?;
        Ok(out)
    }

    /// Rows `first .. first + count` of `src` as a buffer that starts with them: `src` itself
    /// when they start it (the kernels read only the rows they are told of; a batch of one
    /// sequence copies nothing), else a copy, kept in `copy`.
    fn rows_from<'a>(
        &self,
        src: &'a Buf,
        first: usize,
        count: usize,
        width: usize,
        copy: &'a mut Option<Buf>,
    ) -> anyhow::Result<&'a Buf> {
        if first == 0 {
            return Ok(src);
        }
        Ok(copy.insert(Device::rows(self, src, first, count, width)?))
    }
}

impl Device for Gpu {
    type Buf = Buf;
    type Mat = CudaMatrix;
    type Table = Buf;
    type Grow = GrowBuf;
    type Sel = DeviceSelections;

    fn matrix(&self, m: &Matrix) -> anyhow::Result<CudaMatrix> {
        Ok(CudaMatrix::of(&self.cuda, m)?)
    }

    /// The f32 values `Matrix::row_f32` gives the host path.
    fn table(&self, m: &Matrix) -> anyhow::Result<Buf> {
        let values: Vec<f32> = (0..m.rows()).flat_map(|r| m.row_f32(r)).collect();
        self.upload(&values)
    }

    fn mat_rows(m: &CudaMatrix) -> usize {
        m.rows()
    }

    fn upload(&self, values: &[f32]) -> anyhow::Result<Buf> {
        // cudarc cannot upload nothing (a conv of kernel 1 keeps no inputs).
        if values.is_empty() {
            return self.alloc(0);
        }
        Ok(self.cuda.upload(values)?)
    }

    fn download(&self, b: &Buf) -> anyhow::Result<Vec<f32>> {
        self.waited(|| self.cuda.download_f32(b))
    }

    fn download_rows(
        &self,
        b: Buf,
        counts: &[usize],
        width: usize,
        keep: usize,
    ) -> anyhow::Result<Vec<Vec<f32>>> {
        self.waited(|| {
            self.cuda
                .download_f32_with(&b, |v| split_rows(v, counts, width, keep))
        })
    }

    /// In a decode graph's capture the rows are the graph's input, which holds them already.
    fn take_repeated(&self, rows: Vec<f32>, width: usize, copies: usize) -> anyhow::Result<Buf> {
        let mut out = self.alloc(rows.len() * copies)?;
        if let Some(inputs) = self.graphs.inputs(&self.cuda).as_ref() {
            if inputs.emb.len() != rows.len() {
                bail!(
                    "a graph's input of {} values for {} rows",
                    inputs.emb.len(),
                    rows.len()
                );
            }
            self.cuda
                .repeat_rows(&inputs.emb, width, copies, &mut out)?;
            return Ok(out);
        }
        let src = self.upload(&rows)?;
        self.cuda.repeat_rows(&src, width, copies, &mut out)?;
        Ok(out)
    }

    fn zeros(&self, n: usize) -> anyhow::Result<Buf> {
        Ok(self.cuda.stream().alloc_zeros(n.max(1))?)
    }

    fn grow(&self, values: &CacheRows, spare: usize) -> anyhow::Result<GrowBuf> {
        let dtype = values.dtype();
        let mut padded = values.to_le_bytes();
        padded.resize((values.len() + spare.max(1)) * dtype.bytes(), 0);
        Ok(GrowBuf {
            buf: self.cuda.upload(&padded)?,
            dtype,
            len: values.len(),
        })
    }

    fn grow_download(&self, g: &GrowBuf) -> anyhow::Result<CacheRows> {
        let bytes = self.cuda.download(&g.buf)?;
        Ok(CacheRows::from_le_bytes(
            g.dtype,
            &bytes[..g.len * g.dtype.bytes()],
        ))
    }

    fn selections(&self, sel: &[Vec<u32>]) -> anyhow::Result<DeviceSelections> {
        let mut offsets = vec![0usize];
        for s in sel {
            offsets.push(offsets[offsets.len() - 1] + s.len());
        }
        let mut flat: Vec<u32> = sel.iter().flatten().copied().collect();
        // cudarc cannot upload nothing.
        if flat.is_empty() {
            flat.push(0);
        }
        Ok(DeviceSelections {
            tokens: self.cuda.upload(&flat)?,
            offsets,
            planned: None,
        })
    }

    fn selections_download(&self, sel: &DeviceSelections) -> anyhow::Result<Vec<Vec<u32>>> {
        let flat: Vec<u32> = self.cuda.download(&sel.tokens)?;
        let planned: Vec<usize>;
        let offsets = match &sel.planned {
            Some(p) => {
                planned = self
                    .cuda
                    .download(&p.offsets)?
                    .iter()
                    .map(|&o| o as usize)
                    .collect();
                &planned
            }
            None => &sel.offsets,
        };
        Ok(offsets
            .windows(2)
            .map(|w| flat[w[0]..w[1]].to_vec())
            .collect())
    }

    fn grow_len(g: &GrowBuf) -> usize {
        g.len
    }

    /// Makes room first ([`Gpu::make_room`]). In a decode graph's capture the values go
    /// `count * width` further at each replay.
    fn push(
        &self,
        g: &mut GrowBuf,
        src: &Buf,
        first: usize,
        count: usize,
        width: usize,
    ) -> anyhow::Result<()> {
        let n = count * width;
        self.make_room(g, n)?;
        let rows = src.slice(first * width..first * width + n);
        let inputs = self.graphs.inputs(&self.cuda);
        let step = inputs.as_ref().map(|i| &i.step);
        self.cuda
            .cache_store(&rows, &mut g.buf, g.dtype, g.len, n, step)?;
        g.len += n;
        Ok(())
    }

    fn rows(&self, src: &Buf, first: usize, count: usize, width: usize) -> anyhow::Result<Buf> {
        let mut dst = self.alloc(count * width)?;
        self.cuda
            .stream()
            .memcpy_dtod(&src.slice(first * width..(first + count) * width), &mut dst)?;
        Ok(dst)
    }

    fn put_rows(&self, dst: &mut Buf, first: usize, width: usize, src: &Buf) -> anyhow::Result<()> {
        let mut d = dst.slice_mut(first * width..first * width + src.len());
        self.cuda.stream().memcpy_dtod(src, &mut d)?;
        Ok(())
    }

    fn timed<T>(
        &self,
        name: &'static str,
        f: impl FnOnce() -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        let Some(profile) = &self.profile else {
            return f();
        };
        if !self.host_profile {
            self.cuda.synchronize()?;
        }
        let started = std::time::Instant::now();
        let out = f()?;
        if !self.host_profile {
            self.cuda.synchronize()?;
        }
        let mut p = profile.lock().unwrap_or_else(|e| e.into_inner());
        let e = p.entry(name).or_default();
        e.0 += started.elapsed().as_secs_f64();
        e.1 += 1;
        Ok(out)
    }

    fn matmul(&self, w: &CudaMatrix, x: &Buf, n: usize) -> anyhow::Result<Buf> {
        Ok(w.apply_on(&self.cuda, x, n)?)
    }

    fn decode_graph(
        &self,
        model: &crate::model::glm5::Model,
        w: &crate::model::glm5::Weights<Gpu>,
        steps: &mut [crate::model::glm5::Step<Gpu>],
    ) -> anyhow::Result<Option<Vec<Vec<f32>>>> {
        self.decode_step(model, w, steps)
    }

    /// On a second stream when the device has one (see `side.rs`).
    fn beside<A, B, C>(
        &self,
        side: impl FnOnce(&Self) -> anyhow::Result<A>,
        main: impl FnOnce(&Self) -> anyhow::Result<B>,
        join: impl FnOnce(&Self, &A, B) -> anyhow::Result<C>,
    ) -> anyhow::Result<C> {
        self.run_beside(side, main, join)
    }

    fn rms_norm(
        &self,
        x: &mut Buf,
        weight: Option<&Buf>,
        width: usize,
        eps: f32,
    ) -> anyhow::Result<()> {
        Ok(self.cuda.rms_norm(x, weight, width, eps)?)
    }

    fn layer_norm(
        &self,
        x: &mut Buf,
        weight: &Buf,
        bias: &Buf,
        width: usize,
        eps: f32,
        rows: usize,
    ) -> anyhow::Result<()> {
        Ok(self.cuda.layer_norm(x, weight, bias, width, eps, rows)?)
    }

    fn gated_rms_norm(
        &self,
        x: &mut Buf,
        gate: &Buf,
        weight: &Buf,
        width: usize,
        eps: f32,
    ) -> anyhow::Result<()> {
        Ok(self.cuda.gated_rms_norm(x, gate, weight, width, eps)?)
    }

    fn scale(&self, x: &mut Buf, s: f32, count: usize) -> anyhow::Result<()> {
        Ok(self.cuda.scale_values(x, s, count)?)
    }

    fn add(&self, y: &mut Buf, x: &Buf, count: usize) -> anyhow::Result<()> {
        Ok(self.cuda.add_values(y, x, count)?)
    }

    fn swiglu(&self, gate: &Buf, up: &Buf, limit: f32) -> anyhow::Result<Buf> {
        let mut act = self.alloc(gate.len())?;
        self.cuda.swiglu(gate, up, limit, &mut act)?;
        Ok(act)
    }

    fn interleave3(&self, q: &Buf, k: &Buf, v: &Buf, n: usize, c: usize) -> anyhow::Result<Buf> {
        let mut qkv = self.alloc(n * 3 * c)?;
        let (q, k, v) = (q.slice(..n * c), k.slice(..n * c), v.slice(..n * c));
        self.cuda.interleave3(&q, &k, &v, n, c, &mut qkv)?;
        Ok(qkv)
    }

    /// The fused kernel for decode batches with f32 or bf16 weights (what checkpoints hold); a
    /// prompt chunk's tokens go through the norm and a cuBLAS product.
    fn mhc_logits(
        &self,
        proj: &CudaMatrix,
        streams: &Buf,
        t: usize,
        width: usize,
        eps: f32,
    ) -> anyhow::Result<Buf> {
        match proj.row_weights() {
            Some((w, format @ (Format::F32 | Format::Bf16)))
                if t < crate::backend::cuda::GEMM_MIN_TOKENS && proj.cols() == width =>
            {
                let mut logits = self.alloc(t * proj.rows())?;
                let rows = proj.rows();
                self.cuda
                    .mhc_project(w, format, rows, width, streams, t, eps, &mut logits)?;
                Ok(logits)
            }
            _ => super::normed_product(self, proj, streams, t, width, eps),
        }
    }

    fn mhc_collapse(
        &self,
        spec: MhcSpec,
        logits: &Buf,
        base: &Buf,
        streams: &Buf,
        t: usize,
    ) -> anyhow::Result<MhcCollapse<Buf>> {
        self.collapse_with(spec, logits, base, streams, t, None)
    }

    /// Fused for decode batches (each block collapses its token's whole row for the norm's
    /// sum; a prompt chunk's many rows take the two launches instead).
    fn mhc_collapse_normed(
        &self,
        spec: MhcSpec,
        logits: &Buf,
        base: &Buf,
        streams: &Buf,
        t: usize,
        weight: &Buf,
        eps: f32,
    ) -> anyhow::Result<MhcCollapse<Buf>> {
        if t >= crate::backend::cuda::GEMM_MIN_TOKENS {
            let mut mix = self.mhc_collapse(spec, logits, base, streams, t)?;
            self.rms_norm(&mut mix.collapsed, Some(weight), spec.hidden, eps)?;
            return Ok(mix);
        }
        self.collapse_with(spec, logits, base, streams, t, Some((weight, eps)))
    }

    fn mhc_expand(
        &self,
        spec: MhcSpec,
        post: &Buf,
        comb: &Buf,
        streams: &Buf,
        y: &Buf,
        t: usize,
    ) -> anyhow::Result<Buf> {
        let mut out = self.alloc(t * spec.streams * spec.hidden)?;
        self.cuda
            .mhc_expand_dev(spec, post, comb, streams, y, t, &mut out)?;
        Ok(out)
    }

    fn kda_gates(
        &self,
        spec: KdaGates,
        g: &mut Buf,
        dt_bias: &Buf,
        a_log: &Buf,
        beta: &mut Buf,
        rows: usize,
    ) -> anyhow::Result<()> {
        Ok(self.cuda.kda_gates(spec, g, dt_bias, a_log, beta, rows)?)
    }

    fn kda_conv(
        &self,
        spec: KdaSpec,
        taps: &Buf,
        qkv: &Buf,
        first: usize,
        len: usize,
        state: &mut Buf,
    ) -> anyhow::Result<Buf> {
        let w = 3 * spec.channels();
        let mut copy = None;
        let part = self.rows_from(qkv, first, len, w, &mut copy)?;
        let mut mixed = self.alloc(len * w)?;
        self.cuda
            .kda_conv_dev(spec, taps, part, len, state, &mut mixed)?;
        Ok(mixed)
    }

    fn kda_decode(
        &self,
        spec: KdaSpec,
        taps: &Buf,
        qkv: &Buf,
        g: &Buf,
        beta: &Buf,
        states: &mut [&mut crate::model::kda::KdaState<Gpu>],
    ) -> anyhow::Result<Option<Buf>> {
        let n = states.len();
        let (mut mixed, mut out) = (
            self.alloc(n * 3 * spec.channels())?,
            self.alloc(n * spec.channels())?,
        );
        let mut pairs: Vec<(&mut Buf, &mut Buf)> = states
            .iter_mut()
            .map(|s| {
                let s = &mut **s;
                (&mut s.conv, &mut s.recurrent)
            })
            .collect();
        self.cuda
            .kda_decode_seqs(spec, taps, qkv, g, beta, &mut pairs, &mut mixed, &mut out)?;
        Ok(Some(out))
    }

    fn kda_delta(
        &self,
        spec: KdaSpec,
        mode: KdaMode,
        mixed: &Buf,
        g: &Buf,
        beta: &Buf,
        first: usize,
        len: usize,
        state: &mut Buf,
    ) -> anyhow::Result<Buf> {
        let (c, h) = (spec.channels(), spec.heads);
        let (mut g_copy, mut beta_copy) = (None, None);
        let gi = self.rows_from(g, first, len, c, &mut g_copy)?;
        let bi = self.rows_from(beta, first, len, h, &mut beta_copy)?;
        let form = match mode {
            KdaMode::Auto => spec.form_for(len),
            KdaMode::Recurrent => crate::backend::cuda::KdaForm::Recurrent,
        };
        let mut out = self.alloc(len * c)?;
        self.cuda
            .kda_delta_dev(spec, form, mixed, gi, bi, len, state, &mut out)?;
        Ok(out)
    }

    /// The absorbed path for every query (the expanded one has no kernels here), queries in
    /// groups so the attention's scratch stays bounded on long prompt chunks.
    fn mla_attend(
        &self,
        spec: MlaSpec,
        path: MlaPath,
        kv_b: &Buf,
        q: &Buf,
        first: usize,
        len: usize,
        latents: &GrowBuf,
        sel: &DeviceSelections,
    ) -> anyhow::Result<Buf> {
        if path == MlaPath::Expanded {
            bail!("the GPU runs MLA on the absorbed path only");
        }
        let layout = AttnLayout::absorbed(spec.heads, spec.rank, spec.scale());
        if sel.planned.is_some() {
            // Planned on the device (a decode graph): the step's few queries in one launch.
            return self.absorbed(spec, kv_b, q, first, len, len, |_, _, q_lat, o_lat| {
                let kv = (&latents.buf, latents.dtype);
                Ok(self
                    .cuda
                    .mla_sparse_attend_planned(q_lat, kv, &layout, sel, o_lat)?)
            });
        }
        self.absorbed(
            spec,
            kv_b,
            q,
            first,
            len,
            ATTN_QUERIES,
            |a, m, q_lat, o_lat| {
                let offsets = &sel.offsets[a..=a + m];
                let kv = (&latents.buf, latents.dtype);
                Ok(self.cuda.mla_sparse_attend_part_dev(
                    q_lat,
                    kv,
                    &layout,
                    &sel.tokens,
                    offsets,
                    o_lat,
                )?)
            },
        )
    }

    fn mla_attend_seqs(
        &self,
        spec: MlaSpec,
        kv_b: &Buf,
        q: &Buf,
        latents: &[&GrowBuf],
        sels: &[&DeviceSelections],
    ) -> anyhow::Result<Option<Buf>> {
        if latents.len() != sels.len() {
            return Ok(None);
        }
        let layout = AttnLayout::absorbed(spec.heads, spec.rank, spec.scale());
        // Launches of fewer rows than take the absorptions to cuBLAS: every row's absorption
        // and attention is then its own blocks' work, so the bits are each sequence's alone.
        let per = crate::backend::cuda::attn::MLA_SHARED_MIN_QUERIES - 1;
        let attn = self.absorbed(
            spec,
            kv_b,
            q,
            0,
            latents.len(),
            per,
            |a, m, q_lat, o_lat| {
                let seqs: Vec<_> = (a..a + m)
                    .map(|s| ((&latents[s].buf, latents[s].dtype), sels[s]))
                    .collect();
                Ok(self
                    .cuda
                    .mla_sparse_attend_seqs(q_lat, &seqs, &layout, o_lat)?)
            },
        )?;
        Ok(Some(attn))
    }

    fn dsa_pools(
        &self,
        spec: DsaSpec,
        ape: &Buf,
        keys: &GrowBuf,
        gates: &GrowBuf,
        pool_keys: &mut GrowBuf,
    ) -> anyhow::Result<()> {
        if let Some(inputs) = self.graphs.inputs(&self.cuda).as_ref() {
            return self.pool_step(spec, ape, keys, gates, pool_keys, &inputs.step);
        }
        let (di, kpool) = (spec.dim, spec.kpool);
        let pool = pool_keys.len / di;
        let complete = (keys.len / di) / kpool;
        if complete > pool {
            let n = complete - pool;
            let mut key = self.alloc(n * di)?;
            if (keys.dtype, gates.dtype) != (pool_keys.dtype, pool_keys.dtype) {
                bail!("the indexer's caches differ in dtype");
            }
            let cache = (&keys.buf, &gates.buf, keys.dtype);
            self.cuda
                .dsa_pool_keys_dev(cache, ape, kpool, pool, n, &mut key)?;
            self.push(pool_keys, &key, 0, n, di)?;
        }
        Ok(())
    }

    fn dsa_select(
        &self,
        spec: DsaSpec,
        q: &Buf,
        weights: &Buf,
        first: usize,
        len: usize,
        pos: usize,
        pool_keys: &GrowBuf,
    ) -> anyhow::Result<DeviceSelections> {
        let (di, hi) = (spec.dim, spec.heads);
        let (mut q_copy, mut w_copy) = (None, None);
        let qi = self.rows_from(q, first, len, hi * di, &mut q_copy)?;
        let wi = self.rows_from(weights, first, len, hi, &mut w_copy)?;
        if let Some(inputs) = self.graphs.inputs(&self.cuda).as_ref() {
            let keys = (&pool_keys.buf, pool_keys.dtype);
            let room = pool_keys.capacity() / di;
            let step = &inputs.step;
            return Ok(self
                .cuda
                .dsa_select_step(qi, wi, keys, room, spec, pos, len, step)?);
        }
        let at: Vec<usize> = (pos..pos + len).collect();
        Ok(self.cuda.dsa_select_dev(
            qi,
            wi,
            (&pool_keys.buf, pool_keys.dtype),
            pool_keys.len / di,
            spec,
            &at,
        )?)
    }

    fn route(
        &self,
        weight: &CudaMatrix,
        bias: &Buf,
        spec: RouteSpec,
        x: &Buf,
        n: usize,
    ) -> anyhow::Result<(Vec<u32>, Vec<f32>)> {
        let logits = weight.apply(x, n)?;
        Ok(self.cuda.route(&logits, bias, spec, n)?)
    }

    /// On the device rows when the provider computes on this GPU, else through host rows.
    fn experts(
        &self,
        experts: &dyn ExpertProvider,
        layer: usize,
        x: &Buf,
        routing: &Routing,
        hidden: usize,
    ) -> anyhow::Result<Buf> {
        match experts.on_device() {
            Some(dev) if Arc::ptr_eq(dev.device(), &self.cuda) => {
                dev.forward_device(layer, x, routing)
            }
            _ => {
                let b = routing.tokens();
                let mut xh = self.cuda.download(x)?;
                xh.truncate(b * hidden);
                let mut out = vec![0f32; b * hidden];
                experts.forward(layer, &xh, routing, &mut out)?;
                self.upload(&out)
            }
        }
    }

    /// On the device when the provider computes every pick of the layer on this GPU: the
    /// router's ids and weights stay here, grouped by a launch (no host round trip).
    fn routed_experts(
        &self,
        router: &crate::model::moe::Router<Self>,
        experts: &dyn ExpertProvider,
        layer: usize,
        x: &Buf,
        phases: &[crate::model::moe::Phase],
    ) -> anyhow::Result<Option<Buf>> {
        let n = phases.len();
        let Some(dev) = experts.on_device() else {
            return Ok(None);
        };
        let spec = router.spec;
        if !Arc::ptr_eq(dev.device(), &self.cuda) || n == 0 || !dev.routes(layer, n * spec.k) {
            return Ok(None);
        }
        let logits = router.weight.apply(x, n)?;
        let (ids, weights) = self.cuda.route_dev(&logits, &router.bias, spec, n)?;
        Ok(Some(dev.forward_routed(
            layer, x, &ids, &weights, phases, spec.k,
        )?))
    }

    fn stream_mean(
        &self,
        streams: &Buf,
        rows: &[usize],
        n: usize,
        d: usize,
    ) -> anyhow::Result<Buf> {
        let mut h = self.alloc(rows.len() * d)?;
        for (i, &r) in rows.iter().enumerate() {
            let src = streams.slice(r * n * d..(r + 1) * n * d);
            self.cuda
                .stream_mean(&src, n, d, &mut h.slice_mut(i * d..(i + 1) * d))?;
        }
        Ok(h)
    }
}
