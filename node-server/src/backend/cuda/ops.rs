//! Host entry points of the mHC and KDA kernels (kernels/cuda/mhc.cu, kda.cu).
//!
//! Each op comes twice: `*_dev` launches on device buffers and leaves the results there (what
//! a device-resident forward chains), and the plain name uploads host slices, calls it and
//! downloads the results (what cuda-check and the host-side callers use).

use super::{Cuda, CudaError};
use crate::quant::Format;
use cudarc::driver::{CudaSlice, DevicePtrMut, LaunchConfig, PushKernelArg};

/// Threads per block of the column-per-thread mHC and conv kernels.
const COL_BLOCK: u32 = 256;
/// `MHC_MAX_N` in mhc.cu.
const MHC_MAX_STREAMS: usize = 8;
/// `KDA_MAX_CONV` and `KDA_CONV_SEG` in kda.cu.
const KDA_MAX_CONV: usize = 8;
const KDA_CONV_SEG: usize = 64;
/// `KDA_COLS` in kda.cu: state columns per `kda_recurrent` block (a lane of each warp per column).
const KDA_COLS: usize = 32;
/// `KDA_CHUNK` in kda.cu: tokens per chunk of `kda_chunked`.
const KDA_CHUNK: usize = 16;
/// `KDA_CHUNK_THREADS` in kda.cu: threads per `kda_chunked` block.
const KDA_CHUNK_THREADS: usize = 128;
/// Largest grid y dimension.
const MAX_GRID_Y: usize = 65535;
/// Static shared-memory limit every device grants without an opt-in.
const SHARED_BYTES: usize = 48 * 1024;

/// Settings of one hyper-connection for the mHC kernels.
#[derive(Clone, Copy, Debug)]
pub struct MhcSpec {
    /// Streams `N` (at most 8).
    pub streams: usize,
    /// Width `D` of each stream.
    pub hidden: usize,
    /// Scales of the pre, post and comb logits.
    pub scale: [f32; 3],
    pub hc_eps: f32,
    pub sinkhorn_iters: usize,
}

impl MhcSpec {
    /// Logits per token: pre `N`, post `N`, comb `N x N`.
    pub fn logits(&self) -> usize {
        (2 + self.streams) * self.streams
    }

    /// The kernels take up to `MHC_MAX_N` streams and one grid row per token.
    fn check(&self, tokens: usize) -> Result<(), CudaError> {
        if self.streams == 0
            || self.streams > MHC_MAX_STREAMS
            || self.hidden == 0
            || tokens > MAX_GRID_Y
        {
            return Err(CudaError::Invalid(format!(
                "mhc: {tokens} tokens of {} streams of {} (the kernels take 1..={MHC_MAX_STREAMS} \
                 streams and at most {MAX_GRID_Y} tokens)",
                self.streams, self.hidden
            )));
        }
        Ok(())
    }
}

/// What [`Cuda::mhc_collapse`] produces, on the host (`Vec<f32>`) or the device.
#[derive(Debug)]
pub struct MhcCollapse<B = Vec<f32>> {
    /// `[T, D]`: the sublayer input.
    pub collapsed: B,
    /// `[T, N]`
    pub post: B,
    /// `[T, N, N]`, `comb[t][i][m]`: weight of input stream `i` in output stream `m`.
    pub comb: B,
}

/// Shape of one KDA layer for the KDA kernels.
#[derive(Clone, Copy, Debug)]
pub struct KdaSpec {
    pub heads: usize,
    /// `d`: key and value width of a head.
    pub head_dim: usize,
    /// Conv kernel `K` (at most 8).
    pub kernel: usize,
    /// Eps under the square root of the q and k l2-norms.
    pub l2_eps: f32,
}

impl KdaSpec {
    /// Channels `C` of each of q, k and v.
    pub fn channels(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Warps of a `kda_recurrent` block: 32 rows of its columns each (at most 32 warps, so
    /// heads of up to 1,024 channels).
    fn recurrent_warps(&self) -> usize {
        self.head_dim.div_ceil(32)
    }

    /// Dynamic shared memory of a `kda_recurrent` block: q, k and the decay of a token, and
    /// its warps' partial dots.
    fn shared_bytes(&self) -> usize {
        (3 * self.head_dim + 2 * KDA_COLS * self.recurrent_warps()) * 4
    }

    /// Dynamic shared memory of a `kda_chunked` block: its state columns, exp(G_last), the
    /// chunk's q, k and G rows (odd stride), A, P, U and beta.
    fn chunked_shared_bytes(&self) -> usize {
        let d = self.head_dim;
        ((KDA_COLS + 1) * d + 3 * KDA_CHUNK * (d | 1) + (2 * KDA_CHUNK + KDA_COLS + 1) * KDA_CHUNK)
            * 4
    }

    /// Whether the chunked form takes heads of this width: its chunk's working set must fit
    /// in the shared memory granted without an opt-in (`head_dim` up to 138).
    pub fn chunked_fits(&self) -> bool {
        self.chunked_shared_bytes() <= SHARED_BYTES
    }

    /// The form for a span of `len` tokens: chunked from a chunk's worth where the heads fit.
    /// The recurrent kernel pays a global load and two barriers per token in one warp per
    /// block; the chunked one loads a chunk's tokens at once and works on them with four
    /// warps, but does a chunk's worth of work even for one token.
    pub fn form_for(&self, len: usize) -> KdaForm {
        if len >= KDA_CHUNK && self.chunked_fits() {
            KdaForm::Chunked
        } else {
            KdaForm::Recurrent
        }
    }
}

/// The two kernels of KDA's delta rule (see [`Cuda::kda_delta`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KdaForm {
    /// `kda_recurrent`: token after token (the decode step).
    Recurrent,
    /// `kda_chunked`: `KDA_CHUNK` tokens at a time, the WY form (prompt spans).
    Chunked,
}

/// Logits of an mHC token at most (`MHC_MAX_LOGITS` in mhc.cu).
const MHC_MAX_LOGITS: usize = (2 + MHC_MAX_STREAMS) * MHC_MAX_STREAMS;
/// Threads and columns of a `mhc_project` block (mhc.cu).
const MHC_PROJECT_THREADS: u32 = 256;
const MHC_PROJECT_COLS: usize = 256;

fn too_short(what: &str, got: usize, want: usize) -> Result<(), CudaError> {
    if got < want {
        return Err(CudaError::Invalid(format!(
            "{what}: {got} values, needs {want}"
        )));
    }
    Ok(())
}

fn columns_config(width: usize, rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((width as u32).div_ceil(COL_BLOCK), rows as u32, 1),
        block_dim: (COL_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl Cuda {
    /// The part of mHC's collapse after the projection: from `logits` (`[T, (2 + N) N]`, the
    /// projection of the RMS-normed streams) and `base`, the pre/post/comb weights (comb
    /// Sinkhorn-balanced), and the pre-weighted sum of `streams` (`[T, N, D]`).
    pub fn mhc_collapse(
        &self,
        spec: MhcSpec,
        logits: &[f32],
        base: &[f32],
        streams: &[f32],
        tokens: usize,
    ) -> Result<MhcCollapse, CudaError> {
        let (n, d) = (spec.streams, spec.hidden);
        let mut out = MhcCollapse {
            collapsed: self.alloc_f32(tokens * d)?,
            post: self.alloc_f32(tokens * n)?,
            comb: self.alloc_f32(tokens * n * n)?,
        };
        self.mhc_collapse_dev(
            spec,
            &self.upload(logits)?,
            &self.upload(base)?,
            &self.upload(streams)?,
            tokens,
            None,
            &mut out,
        )?;
        let down = |b: &CudaSlice<f32>, len: usize| -> Result<Vec<f32>, CudaError> {
            let mut v = self.download(b)?;
            v.truncate(len);
            Ok(v)
        };
        Ok(MhcCollapse {
            collapsed: down(&out.collapsed, tokens * d)?,
            post: down(&out.post, tokens * n)?,
            comb: down(&out.comb, tokens * n * n)?,
        })
    }

    /// mHC's projection of each token's RMS-normed streams, `logits[t] = proj (x[t] * inv_t)`
    /// with `inv_t = 1 / sqrt(mean(x[t]^2) + eps)`, computed as `(proj x[t]) * inv_t`: the
    /// streams (`x`, `[T, width]`) are read once, never normed in a copy. `proj` holds
    /// `[rows, width]` rows of `format`, f32 or bf16 (bf16 gives the bits f32 rows of the
    /// widened values give); `logits` gets `[T, rows]`. Two passes of one launch (each
    /// token's last block adds the others' partial sums in order: results repeat).
    #[allow(clippy::too_many_arguments)] // the kernel's arguments
    pub fn mhc_project(
        &self,
        proj: &CudaSlice<u8>,
        format: Format,
        rows: usize,
        width: usize,
        x: &CudaSlice<f32>,
        tokens: usize,
        eps: f32,
        logits: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let kernel = match format {
            Format::F32 => "mhc_project",
            Format::Bf16 => "mhc_project_bf16",
            other => {
                return Err(CudaError::Invalid(format!(
                    "mhc_project: {other:?} weights (the kernel takes f32 or bf16)"
                )));
            }
        };
        if rows == 0 || rows > MHC_MAX_LOGITS || tokens > MAX_GRID_Y.min(super::TICKETS) {
            return Err(CudaError::Invalid(format!(
                "mhc_project: {rows} rows of {tokens} tokens (the kernel takes 1..={MHC_MAX_LOGITS} \
                 rows and at most {MAX_GRID_Y} tokens)"
            )));
        }
        too_short(
            "mhc_project weights",
            proj.len(),
            rows * width * format.block_bytes(),
        )?;
        too_short("mhc_project x", x.len(), tokens * width)?;
        too_short("mhc_project logits", logits.len(), tokens * rows)?;
        if tokens == 0 || width == 0 {
            return Ok(());
        }
        let chunks = width.div_ceil(MHC_PROJECT_COLS);
        let part = self.alloc_f32(tokens * chunks * (rows + 1))?;
        let (rows_i, width_i) = (rows as i32, width as i32);
        let mut b = self.stream.launch_builder(self.kernel(kernel));
        b.arg(proj)
            .arg(x)
            .arg(&rows_i)
            .arg(&width_i)
            .arg(&eps)
            .arg(&part)
            .arg(&self.tickets)
            .arg(logits);
        let cfg = LaunchConfig {
            grid_dim: (chunks as u32, tokens as u32, 1),
            block_dim: (MHC_PROJECT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: arguments match `mhc_project(_bf16)` in mhc.cu: proj holds rows x width
        // values of its format, x and
        // logits `tokens` rows (checked above), part a (rows + 1)-value record per block; one
        // ticket per token row, fewer than TICKETS.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// [`Cuda::mhc_collapse`] on device buffers; with `norm` (`weight [D]`, eps), the collapsed
    /// rows are RMS-normed and weighted in the same launch, as [`Cuda::rms_norm`] would.
    #[allow(clippy::too_many_arguments)]
    pub fn mhc_collapse_dev(
        &self,
        spec: MhcSpec,
        logits: &CudaSlice<f32>,
        base: &CudaSlice<f32>,
        streams: &CudaSlice<f32>,
        tokens: usize,
        norm: Option<(&CudaSlice<f32>, f32)>,
        out: &mut MhcCollapse<CudaSlice<f32>>,
    ) -> Result<(), CudaError> {
        spec.check(tokens)?;
        let (n, d) = (spec.streams, spec.hidden);
        too_short("mhc_collapse logits", logits.len(), tokens * spec.logits())?;
        too_short("mhc_collapse base", base.len(), spec.logits())?;
        too_short("mhc_collapse streams", streams.len(), tokens * n * d)?;
        too_short("mhc_collapse collapsed", out.collapsed.len(), tokens * d)?;
        too_short("mhc_collapse post", out.post.len(), tokens * n)?;
        too_short("mhc_collapse comb", out.comb.len(), tokens * n * n)?;
        if let Some((w, _)) = norm {
            too_short("mhc_collapse norm weight", w.len(), d)?;
        }
        if tokens == 0 {
            return Ok(());
        }
        let [s0, s1, s2] = spec.scale;
        let (n_i, d_i, iters) = (n as i32, d as i32, spec.sinkhorn_iters as i32);
        let has_norm = norm.is_some() as i32;
        let (norm_weight, norm_eps) = norm.unwrap_or((&self.unread, 0.0));
        let mut b = self.stream.launch_builder(self.kernel("mhc_collapse"));
        b.arg(logits)
            .arg(base)
            .arg(&s0)
            .arg(&s1)
            .arg(&s2)
            .arg(&n_i)
            .arg(&d_i)
            .arg(&spec.hc_eps)
            .arg(&iters)
            .arg(streams)
            .arg(&has_norm)
            .arg(norm_weight)
            .arg(&norm_eps)
            .arg(&mut out.collapsed)
            .arg(&mut out.post)
            .arg(&mut out.comb);
        // SAFETY: arguments match `mhc_collapse` in mhc.cu; n <= MHC_MAX_N and every buffer
        // holds its `tokens` rows (checked above); the grid covers d columns of each token.
        unsafe { b.launch(columns_config(d, tokens)) }?;
        Ok(())
    }

    /// mHC's expand: new stream `m` of token `t` is
    /// `post[t][m] * y[t] + sum_i comb[t][i][m] * streams[t][i]` (`streams` `[T, N, D]`,
    /// `y` `[T, D]`); returns `[T, N, D]`.
    pub fn mhc_expand(
        &self,
        spec: MhcSpec,
        post: &[f32],
        comb: &[f32],
        streams: &[f32],
        y: &[f32],
        tokens: usize,
    ) -> Result<Vec<f32>, CudaError> {
        let len = tokens * spec.streams * spec.hidden;
        let mut out = self.alloc_f32(len)?;
        self.mhc_expand_dev(
            spec,
            &self.upload(post)?,
            &self.upload(comb)?,
            &self.upload(streams)?,
            &self.upload(y)?,
            tokens,
            &mut out,
        )?;
        let mut v = self.download(&out)?;
        v.truncate(len);
        Ok(v)
    }

    /// [`Cuda::mhc_expand`] on device buffers (`out` must not be `streams`).
    #[allow(clippy::too_many_arguments)] // the kernel's arguments
    pub fn mhc_expand_dev(
        &self,
        spec: MhcSpec,
        post: &CudaSlice<f32>,
        comb: &CudaSlice<f32>,
        streams: &CudaSlice<f32>,
        y: &CudaSlice<f32>,
        tokens: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        spec.check(tokens)?;
        let (n, d) = (spec.streams, spec.hidden);
        too_short("mhc_expand post", post.len(), tokens * n)?;
        too_short("mhc_expand comb", comb.len(), tokens * n * n)?;
        too_short("mhc_expand streams", streams.len(), tokens * n * d)?;
        too_short("mhc_expand y", y.len(), tokens * d)?;
        too_short("mhc_expand out", out.len(), tokens * n * d)?;
        if tokens == 0 {
            return Ok(());
        }
        let (n_i, d_i) = (n as i32, d as i32);
        let mut b = self.stream.launch_builder(self.kernel("mhc_expand"));
        b.arg(post)
            .arg(comb)
            .arg(streams)
            .arg(y)
            .arg(&n_i)
            .arg(&d_i)
            .arg(out);
        // SAFETY: arguments match `mhc_expand` in mhc.cu; sizes checked above, n <= MHC_MAX_N.
        unsafe { b.launch(columns_config(d, tokens)) }?;
        Ok(())
    }

    /// KDA's depthwise causal conv + SiLU over `qkv` (`[len, 3C]`) continuing `conv_state`
    /// (`[K - 1, 3C]`, oldest first; advanced past these `len` inputs); `taps` is `[3C, K]`.
    /// Returns `[len, 3C]`.
    pub fn kda_conv(
        &self,
        spec: KdaSpec,
        taps: &[f32],
        qkv: &[f32],
        len: usize,
        conv_state: &mut [f32],
    ) -> Result<Vec<f32>, CudaError> {
        let w = 3 * spec.channels();
        // A kernel of 1 keeps no inputs; uploading nothing is not allowed.
        let mut d_state = if conv_state.is_empty() {
            self.alloc_f32(0)?
        } else {
            self.upload(conv_state)?
        };
        let mut out = self.alloc_f32(len * w)?;
        self.kda_conv_dev(
            spec,
            &self.upload(taps)?,
            &self.upload(qkv)?,
            len,
            &mut d_state,
            &mut out,
        )?;
        let state = self.download(&d_state)?;
        conv_state.copy_from_slice(&state[..conv_state.len()]);
        let mut v = self.download(&out)?;
        v.truncate(len * w);
        Ok(v)
    }

    /// [`Cuda::kda_conv`] on device buffers: `out` gets `[len, 3C]`, `conv_state` advances.
    pub fn kda_conv_dev(
        &self,
        spec: KdaSpec,
        taps: &CudaSlice<f32>,
        qkv: &CudaSlice<f32>,
        len: usize,
        conv_state: &mut CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let (w, k) = (3 * spec.channels(), spec.kernel);
        if k == 0 || k > KDA_MAX_CONV || w == 0 {
            return Err(CudaError::Invalid(format!(
                "kda_conv: kernel {k} over {w} channels (the kernel takes 1..={KDA_MAX_CONV})"
            )));
        }
        too_short("kda_conv taps", taps.len(), w * k)?;
        too_short("kda_conv qkv", qkv.len(), len * w)?;
        too_short("kda_conv state", conv_state.len(), (k - 1) * w)?;
        too_short("kda_conv out", out.len(), len * w)?;
        if len == 0 {
            return Ok(());
        }
        let (len_i, w_i, k_i) = (len as i32, w as i32, k as i32);
        // One token segment (decode, short chunks): the conv advances the state itself.
        let segments = len.div_ceil(KDA_CONV_SEG);
        let advance = i32::from(segments == 1);
        let mut b = self.stream.launch_builder(self.kernel("kda_conv"));
        b.arg(qkv)
            .arg(&mut *conv_state)
            .arg(taps)
            .arg(&len_i)
            .arg(&w_i)
            .arg(&k_i)
            .arg(&advance)
            .arg(&mut *out);
        // SAFETY: arguments match `kda_conv` in kda.cu; sizes checked above; the grid covers
        // w channels times the token segments, and with `advance` (one segment) each thread
        // writes only its own channel's state, after its own reads of it.
        unsafe { b.launch(columns_config(w, segments)) }?;
        if advance == 1 {
            return Ok(());
        }
        let mut b = self.stream.launch_builder(self.kernel("kda_conv_state"));
        b.arg(&mut *conv_state)
            .arg(qkv)
            .arg(&len_i)
            .arg(&w_i)
            .arg(&k_i);
        // SAFETY: as above; stream order puts it after the conv that reads the old state.
        unsafe { b.launch(columns_config(w, 1)) }?;
        Ok(())
    }

    /// KDA's delta rule over `len` tokens in `form`, from the conv output `mixed`
    /// (`[len, 3C]`: q | k | v), the log decay `g` (`[len, C]`) and `beta` (`[len, H]`):
    /// q and k l2-normalised, q scaled by `1 / sqrt(d)`; `state` (`[H, d, d]`) is updated.
    /// Returns `[len, C]`. Both forms compute the same; see [`KdaSpec::form_for`].
    #[allow(clippy::too_many_arguments)]
    pub fn kda_delta(
        &self,
        spec: KdaSpec,
        form: KdaForm,
        mixed: &[f32],
        g: &[f32],
        beta: &[f32],
        len: usize,
        state: &mut [f32],
    ) -> Result<Vec<f32>, CudaError> {
        let c = spec.channels();
        let mut d_state = self.upload(state)?;
        let mut out = self.alloc_f32(len * c)?;
        self.kda_delta_dev(
            spec,
            form,
            &self.upload(mixed)?,
            &self.upload(g)?,
            &self.upload(beta)?,
            len,
            &mut d_state,
            &mut out,
        )?;
        let s = self.download(&d_state)?;
        state.copy_from_slice(&s[..state.len()]);
        let mut v = self.download(&out)?;
        v.truncate(len * c);
        Ok(v)
    }

    /// [`Cuda::kda_delta`] on device buffers.
    #[allow(clippy::too_many_arguments)]
    pub fn kda_delta_dev(
        &self,
        spec: KdaSpec,
        form: KdaForm,
        mixed: &CudaSlice<f32>,
        g: &CudaSlice<f32>,
        beta: &CudaSlice<f32>,
        len: usize,
        state: &mut CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let (h, d) = (spec.heads, spec.head_dim);
        let c = h * d;
        // `kda_recurrent`: a warp per 32 rows of the block's state columns (held in
        // registers) and per token q, k, the decay and the partial dots in shared memory.
        // `kda_chunked`: the KDA_CHUNK_THREADS threads its token and pair split assumes, and a
        // chunk's working set.
        let (name, threads, shared) = match form {
            KdaForm::Recurrent => (
                "kda_recurrent",
                KDA_COLS * spec.recurrent_warps(),
                spec.shared_bytes(),
            ),
            KdaForm::Chunked => (
                "kda_chunked",
                KDA_CHUNK_THREADS,
                spec.chunked_shared_bytes(),
            ),
        };
        if h == 0 || h > MAX_GRID_Y || d == 0 || threads > 1024 || shared > SHARED_BYTES {
            return Err(CudaError::Invalid(format!(
                "{name}: {h} heads of {d} (the kernel takes 1..={MAX_GRID_Y} heads of at most \
                 1,024 channels, and {shared} bytes of shared memory for a head's {KDA_COLS} \
                 columns must fit in {SHARED_BYTES})"
            )));
        }
        too_short(&format!("{name} mixed"), mixed.len(), len * 3 * c)?;
        too_short(&format!("{name} g"), g.len(), len * c)?;
        too_short(&format!("{name} beta"), beta.len(), len * h)?;
        too_short(&format!("{name} state"), state.len(), h * d * d)?;
        too_short(&format!("{name} out"), out.len(), len * c)?;
        if len == 0 {
            return Ok(());
        }
        let (len_i, h_i, d_i) = (len as i32, h as i32, d as i32);
        let scale = 1.0 / (d as f32).sqrt();
        let mut b = self.stream.launch_builder(self.kernel(name));
        b.arg(mixed)
            .arg(g)
            .arg(beta)
            .arg(&len_i)
            .arg(&h_i)
            .arg(&d_i)
            .arg(&scale)
            .arg(&spec.l2_eps)
            .arg(state)
            .arg(out);
        let cfg = LaunchConfig {
            grid_dim: (d.div_ceil(KDA_COLS) as u32, h as u32, 1),
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: shared as u32,
        };
        // SAFETY: both kernels take these arguments in kda.cu; sizes checked above; the block
        // and shared memory are the ones the kernel of `form` assumes (above).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
    /// A decode step of `states.len()` sequences, one token each: row s of `qkv` (`[n, 3C]`),
    /// `g` (`[n, C]`) and `beta` (`[n, H]`) is sequence s's, `states[s]` its (conv,
    /// recurrent) state. One launch for every sequence's conv (`mixed`: `[n, 3C]`) and one for
    /// every delta rule (`out`: `[n, C]`); each sequence gets the bits [`Cuda::kda_conv_dev`]
    /// and [`Cuda::kda_delta_dev`] give it alone (the same code, on its row).
    #[allow(clippy::too_many_arguments)]
    pub fn kda_decode_seqs(
        &self,
        spec: KdaSpec,
        taps: &CudaSlice<f32>,
        qkv: &CudaSlice<f32>,
        g: &CudaSlice<f32>,
        beta: &CudaSlice<f32>,
        states: &mut [(&mut CudaSlice<f32>, &mut CudaSlice<f32>)],
        mixed: &mut CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let n = states.len();
        let (h, d, k) = (spec.heads, spec.head_dim, spec.kernel);
        let (c, w) = (h * d, 3 * spec.channels());
        let (threads, shared) = (KDA_COLS * spec.recurrent_warps(), spec.shared_bytes());
        if k == 0 || k > KDA_MAX_CONV || w == 0 || n > MAX_GRID_Y {
            return Err(CudaError::Invalid(format!(
                "kda_conv_seqs: kernel {k} over {w} channels for {n} sequences (the kernel \
                 takes 1..={KDA_MAX_CONV}, at most {MAX_GRID_Y} sequences)"
            )));
        }
        if h == 0 || h > MAX_GRID_Y || d == 0 || threads > 1024 || shared > SHARED_BYTES {
            return Err(CudaError::Invalid(format!(
                "kda_recurrent_seqs: {h} heads of {d} (as kda_recurrent)"
            )));
        }
        too_short("kda_decode_seqs taps", taps.len(), w * k)?;
        too_short("kda_decode_seqs qkv", qkv.len(), n * w)?;
        too_short("kda_decode_seqs g", g.len(), n * c)?;
        too_short("kda_decode_seqs beta", beta.len(), n * h)?;
        too_short("kda_decode_seqs mixed", mixed.len(), n * w)?;
        too_short("kda_decode_seqs out", out.len(), n * c)?;
        for (conv, recurrent) in states.iter() {
            too_short("kda_decode_seqs conv state", conv.len(), (k - 1) * w)?;
            too_short("kda_decode_seqs state", recurrent.len(), h * d * d)?;
        }
        if n == 0 {
            return Ok(());
        }
        // The sequences' state addresses, for the kernels to find their own; the guards keep
        // the stream's record of the buffers' use until the launches are queued.
        let mut guards = Vec::with_capacity(2 * n);
        let (mut convs, mut recurrents) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for (conv, recurrent) in states.iter_mut() {
            let (p, guard) = conv.device_ptr_mut(&self.stream);
            convs.push(p);
            guards.push(guard);
            let (p, guard) = recurrent.device_ptr_mut(&self.stream);
            recurrents.push(p);
            guards.push(guard);
        }
        let (convs, recurrents) = (self.upload_table(&convs)?, self.upload_table(&recurrents)?);
        let (w_i, k_i, h_i, d_i) = (w as i32, k as i32, h as i32, d as i32);
        let mut b = self.stream.launch_builder(self.kernel("kda_conv_seqs"));
        b.arg(qkv)
            .arg(&convs)
            .arg(taps)
            .arg(&w_i)
            .arg(&k_i)
            .arg(&mut *mixed);
        // SAFETY: arguments match `kda_conv_seqs` in kda.cu; every row and state checked
        // above; grid y is the sequences, whose states are distinct buffers (one `&mut`
        // each), so a thread writes only its own sequence's channel.
        unsafe { b.launch(columns_config(w, n)) }?;
        let scale = 1.0 / (d as f32).sqrt();
        let mut b = self
            .stream
            .launch_builder(self.kernel("kda_recurrent_seqs"));
        b.arg(&*mixed)
            .arg(g)
            .arg(beta)
            .arg(&h_i)
            .arg(&d_i)
            .arg(&scale)
            .arg(&spec.l2_eps)
            .arg(&recurrents)
            .arg(out);
        let cfg = LaunchConfig {
            grid_dim: (d.div_ceil(KDA_COLS) as u32, h as u32, n as u32),
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: shared as u32,
        };
        // SAFETY: arguments match `kda_recurrent_seqs` in kda.cu, block and shared memory
        // as `kda_recurrent`'s; sizes checked above; grid z is the sequences, each with its
        // own state.
        unsafe { b.launch(cfg) }?;
        drop(guards);
        Ok(())
    }
}
