//! CUDA backend: the driver and NVRTC through cudarc's dynamic loading, so the binary builds
//! and runs on machines without CUDA ([`Cuda::open`] then says why and the CPU path runs).
//!
//! The kernels come from the `glmflash-kernels` crate as CUDA C, compiled at start for the
//! device's compute capability and cached on disk as PTX (keyed by the source, the arch and
//! the NVRTC version). Every entry point here takes and returns host slices or device
//! buffers of plain numbers: this module knows no model types.
#![allow(unsafe_code)] // library probing and kernel launches; each block says why it holds

use crate::quant::Format;

pub mod attn;
pub mod decode;
pub mod matrix;
mod ops;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys::cublasOperation_t};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DriverError, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::{CompileOptions, Ptx};
pub use ops::{KdaForm, KdaSpec, MhcCollapse, MhcSpec};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("CUDA is not available: {0}")]
    Unavailable(String),
    #[error("CUDA driver call failed: {0}")]
    Driver(#[from] DriverError),
    #[error("NVRTC could not compile {file} for {arch}: {log}")]
    Compile {
        file: String,
        arch: String,
        log: String,
    },
    #[error("{0}")]
    Invalid(String),
}

/// Token rows from which [`Cuda::matmul`] hands a float-format product to cuBLAS.
pub const GEMM_MIN_TOKENS: usize = 9;
/// Token rows from which an f16/bf16 product is widened for cuBLAS: widening moves 6 bytes a
/// weight and SGEMM reads 4 more, against `matvec`'s 2 bytes per pass of TOK_TILE tokens.
pub const WIDEN_MIN_TOKENS: usize = 64;
/// Values of one f16/bf16 weight tile widened to f32 for cuBLAS (32 MiB).
pub const WIDEN_TILE_VALUES: usize = 8 << 20;

/// The sizes of a product `y[n, rows] = x[n, cols] W^T` against its buffers.
fn check_product(
    w: &CudaSlice<u8>,
    format: Format,
    rows: usize,
    cols: usize,
    x: &CudaSlice<f32>,
    n: usize,
    y: &CudaSlice<f32>,
) -> Result<(), CudaError> {
    let expected = rows
        * format
            .row_bytes(cols)
            .map_err(|e| CudaError::Invalid(e.to_string()))?;
    if w.len() < expected || x.len() < n * cols || y.len() < n * rows {
        return Err(CudaError::Invalid(format!(
            "matvec {rows}x{cols} {}: weights {} of {expected} bytes, x {} of {}, y {} of {}",
            format.name(),
            w.len(),
            x.len(),
            n * cols,
            y.len(),
            n * rows
        )));
    }
    Ok(())
}

/// Matrices of fewer rows go through `matvec_split` (a block per row).
const SPLIT_BELOW_ROWS: usize = 2048;
/// Threads of a `matvec_split` block (its SPLIT_WARPS warps).
const SPLIT_THREADS: u32 = 256;

/// Threads per block of the warp-per-row kernels (4 warps: 4 rows per block).
const ROW_BLOCK: u32 = 128;
const ROWS_PER_BLOCK: u32 = ROW_BLOCK / 32;

/// The format id the kernels dispatch on (`FMT_*` in kernels/cuda/common.cuh).
pub fn kernel_format_id(format: Format) -> i32 {
    match format {
        Format::F32 => 0,
        Format::F16 => 1,
        Format::Bf16 => 2,
        Format::Q8_0 => 3,
        Format::Q4K => 4,
    }
}

/// One CUDA device with its compiled kernels and a compute stream.
pub struct Cuda {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Host-to-device copies that overlap the kernels on `stream` (the VRAM tier's staging
    /// slots). The context tracks no events: whoever uses this stream orders it against
    /// `stream` with explicit events.
    copy: Arc<CudaStream>,
    name: String,
    arch: String,
    kernels: HashMap<&'static str, CudaFunction>,
    /// Fill scratch buffers with NaN before kernels write them (checks: an unwritten output
    /// then shows as NaN instead of a plausible zero).
    poison: std::sync::atomic::AtomicBool,
    /// cuBLAS on `stream`, started at the first many-token product (`Err`: it would not start).
    blas: std::sync::OnceLock<Result<std::sync::Mutex<CudaBlas>, String>>,
}

impl std::fmt::Debug for Cuda {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Cuda({} {})", self.name, self.arch)
    }
}

/// Whether the CUDA driver library can be loaded at all (no device needed).
pub fn driver_present() -> bool {
    // SAFETY: only dlopens the candidate library names and closes them again.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

fn nvrtc_present() -> bool {
    // SAFETY: as in `driver_present`.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

impl Cuda {
    /// Opens device `ordinal` and compiles (or loads from `cache_dir`) every kernel.
    pub fn open(ordinal: usize, cache_dir: Option<&Path>) -> Result<Arc<Cuda>, CudaError> {
        if !driver_present() {
            return Err(CudaError::Unavailable(
                "the NVIDIA driver library (libcuda.so.1) was not found".into(),
            ));
        }
        let count = CudaContext::device_count().map_err(|e| {
            CudaError::Unavailable(format!(
                "the driver is present but reports no devices ({e})"
            ))
        })?;
        if ordinal >= count.max(0) as usize {
            return Err(CudaError::Unavailable(format!(
                "device {ordinal} asked for, the driver reports {count}"
            )));
        }
        let ctx = CudaContext::new(ordinal)?;
        // SAFETY: called before any buffer exists. Every buffer is used on `stream` alone,
        // except the slots the copy stream writes, which their user orders with events
        // (`GpuTier::compute`); so no buffer needs cudarc's per-use event tracking, which would
        // also make the copy stream wait for every kernel reading any part of the arena.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability()?;
        let arch = format!("sm_{major}{minor}");
        let name = ctx.name()?;
        let stream = ctx.default_stream();
        let copy = ctx.new_stream()?;
        let mut kernels = HashMap::new();
        for (file, _, names) in glmflash_kernels::SOURCES {
            let ptx = compile_cached(file, &arch, cache_dir)?;
            let module = ctx.load_module(ptx)?;
            for k in names.iter() {
                kernels.insert(*k, module.load_function(k)?);
            }
        }
        Ok(Arc::new(Cuda {
            ctx,
            stream,
            copy,
            name,
            arch,
            kernels,
            poison: Default::default(),
            blas: Default::default(),
        }))
    }

    /// `"NVIDIA H200 (sm_90)"`.
    pub fn describe(&self) -> String {
        format!("{} ({})", self.name, self.arch)
    }

    /// (free, total) bytes of device memory.
    pub fn mem_info(&self) -> Result<(usize, usize), CudaError> {
        Ok(self.ctx.mem_get_info()?)
    }

    /// Device memory bandwidth, bytes read plus bytes written per second, of the best of a
    /// few device-to-device copies of `bytes` (the HBM/GDDR ceiling measured in-run).
    pub fn copy_bandwidth(&self, bytes: usize) -> Result<f64, CudaError> {
        let src = self.stream.alloc_zeros::<u8>(bytes)?;
        let mut dst = self.stream.alloc_zeros::<u8>(bytes)?;
        let mut best = f64::MAX;
        for _ in 0..5 {
            self.stream.synchronize()?;
            let started = std::time::Instant::now();
            self.stream.memcpy_dtod(&src, &mut dst)?;
            self.stream.synchronize()?;
            best = best.min(started.elapsed().as_secs_f64());
        }
        Ok(2.0 * bytes as f64 / best)
    }

    /// Host-to-device bandwidth, bytes per second, of the best of a few copies of `bytes`
    /// from page-locked memory (`pinned`, the path of registered RAM slots) or from
    /// ordinary pageable memory.
    pub fn h2d_bandwidth(&self, bytes: usize, pinned: bool) -> Result<f64, CudaError> {
        let mut dst = self.stream.alloc_zeros::<u8>(bytes)?;
        let mut best = f64::MAX;
        let mut time = |copy: &mut dyn FnMut(&mut CudaSlice<u8>) -> Result<(), CudaError>| {
            for _ in 0..5 {
                self.stream.synchronize()?;
                let started = std::time::Instant::now();
                copy(&mut dst)?;
                self.stream.synchronize()?;
                best = best.min(started.elapsed().as_secs_f64());
            }
            Ok::<(), CudaError>(())
        };
        if pinned {
            // SAFETY: the page-locked buffer is filled before any copy reads it.
            let mut host = unsafe { self.ctx.alloc_pinned_with_flags::<u8>(bytes, 0) }?;
            host.as_mut_slice()?.fill(1);
            time(&mut |dst| Ok(self.stream.memcpy_htod(&host, dst)?))?;
        } else {
            let host = vec![1u8; bytes];
            time(&mut |dst| Ok(self.stream.memcpy_htod(&host[..], dst)?))?;
        }
        Ok(bytes as f64 / best)
    }

    /// Page-locks `len` bytes at `ptr` and maps them for the device (cuMemHostRegister), so
    /// copies from them are DMA without a bounce buffer and asynchronous to the host.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be one live allocation that stays allocated until
    /// [`Cuda::unregister_host`] is called for `ptr`, and after any copy from it has finished.
    pub unsafe fn register_host(&self, ptr: *const u8, len: usize) -> Result<(), CudaError> {
        self.ctx.bind_to_thread()?;
        // SAFETY: the caller keeps the range allocated while registered.
        unsafe {
            cudarc::driver::sys::cuMemHostRegister_v2(
                ptr as *mut std::ffi::c_void,
                len,
                cudarc::driver::sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        }
        .result()?;
        Ok(())
    }

    /// Undoes [`Cuda::register_host`] for `ptr`.
    ///
    /// # Safety
    /// No copy from the range may still be in flight.
    pub unsafe fn unregister_host(&self, ptr: *const u8) -> Result<(), CudaError> {
        use cudarc::driver::sys::CUresult::CUDA_ERROR_DEINITIALIZED;
        // At process exit the driver may be torn down before the last residents drop (then
        // binding the context fails too); it has released every registration then.
        match self.ctx.bind_to_thread() {
            Err(e) if e.0 == CUDA_ERROR_DEINITIALIZED => return Ok(()),
            r => r?,
        }
        // SAFETY: registered by `register_host`; the caller has drained copies from it.
        let r = unsafe { cudarc::driver::sys::cuMemHostUnregister(ptr as *mut std::ffi::c_void) };
        if r == CUDA_ERROR_DEINITIALIZED {
            return Ok(());
        }
        r.result()?;
        Ok(())
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn kernel(&self, name: &str) -> &CudaFunction {
        self.kernels
            .get(name)
            .unwrap_or_else(|| panic!("kernel {name} is listed in glmflash_kernels::SOURCES"))
    }

    pub fn upload<T: cudarc::driver::DeviceRepr>(
        &self,
        host: &[T],
    ) -> Result<CudaSlice<T>, CudaError> {
        Ok(self.stream.clone_htod(host)?)
    }

    pub fn download<T: cudarc::driver::DeviceRepr + Default + Clone>(
        &self,
        dev: &CudaSlice<T>,
    ) -> Result<Vec<T>, CudaError> {
        Ok(self.stream.clone_dtoh(dev)?)
    }

    /// A scratch buffer of `len` floats: zeros, or NaN when poisoning (see [`Cuda::set_poison`]).
    pub fn alloc_f32(&self, len: usize) -> Result<CudaSlice<f32>, CudaError> {
        if self.poison.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(self.stream.clone_htod(&vec![f32::NAN; len.max(1)])?);
        }
        // SAFETY: any bits are a valid f32, and every caller writes a scratch buffer before
        // reading it: cuda-check runs every kernel wrapper and the decode step with each
        // buffer poisoned with NaN instead, where a read before a write would show.
        Ok(unsafe { self.stream.alloc::<f32>(len.max(1)) }?)
    }

    /// Poison scratch and output buffers with NaN before kernels write them.
    pub fn set_poison(&self, on: bool) {
        self.poison.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Waits for both streams (kernels and copies).
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.copy.synchronize()?;
        Ok(self.stream.synchronize()?)
    }

    /// The stream of host-to-device copies that overlap the kernels.
    pub fn copy_stream(&self) -> &Arc<CudaStream> {
        &self.copy
    }

    /// An event for ordering the two streams (no timing).
    pub fn event(&self) -> Result<cudarc::driver::CudaEvent, CudaError> {
        Ok(self.ctx.new_event(Some(
            cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING,
        ))?)
    }

    /// [`Cuda::matvec`]'s product, through cuBLAS SGEMM for many tokens of a float-format
    /// matrix (f32 from `GEMM_MIN_TOKENS`; f16 and bf16 from `WIDEN_MIN_TOKENS`, widened to
    /// f32 a tile of rows at a time, so the product keeps f32 activations and f32 arithmetic:
    /// no TF32), else through `matvec`.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        w: &CudaSlice<u8>,
        format: Format,
        rows: usize,
        cols: usize,
        x: &CudaSlice<f32>,
        n: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let min = match format {
            Format::F32 => GEMM_MIN_TOKENS,
            Format::F16 | Format::Bf16 => WIDEN_MIN_TOKENS,
            Format::Q8_0 | Format::Q4K => usize::MAX,
        };
        if n < min || cols == 0 {
            return self.matvec(w, format, rows, cols, x, n, y);
        }
        check_product(w, format, rows, cols, x, n, y)?;
        let blas = self
            .blas
            .get_or_init(|| {
                CudaBlas::new(self.stream.clone())
                    .map(std::sync::Mutex::new)
                    .map_err(|e| format!("{e:?}"))
            })
            .as_ref()
            .map_err(|e| CudaError::Unavailable(format!("cuBLAS could not start: {e}")))?;
        let blas = blas.lock().unwrap_or_else(|e| e.into_inner());
        let tile = (WIDEN_TILE_VALUES / cols).clamp(1, rows);
        let mut widened = match format {
            Format::F32 => None,
            _ => Some(self.alloc_f32(tile * cols)?),
        };
        for r0 in (0..rows).step_by(tile) {
            let m = tile.min(rows - r0);
            if let Some(out) = widened.as_mut() {
                let src = w.slice(r0 * cols * 2..(r0 + m) * cols * 2);
                let (fmt, count) = (kernel_format_id(format), (m * cols) as i64);
                let mut b = self.stream.launch_builder(self.kernel("widen_f32"));
                b.arg(&src).arg(&fmt).arg(&count).arg(&mut *out);
                // SAFETY: src holds m * cols 2-byte values, out at least as many f32.
                unsafe { b.launch(LaunchConfig::for_num_elems((m * cols) as u32)) }?;
            }
            // SAFETY: an f32 matrix's bytes are rows * cols little-endian f32 (checked
            // above), the device's own byte order; the view covers exactly them.
            let all = match &widened {
                Some(out) => out.slice(..m * cols),
                None => unsafe { w.transmute::<f32>(rows * cols) }
                    .ok_or_else(|| CudaError::Invalid("f32 weights short of their size".into()))?
                    .slice(r0 * cols..(r0 + m) * cols),
            };
            // Row-major y[n, rows] = x[n, cols] W^T is, column-major, y^T = W x^T: the tile's
            // row-major bytes are its transpose column-major (lda = cols), so op(A) = T; its
            // rows are y's columns r0.. with y's stride (ldc = rows).
            let cfg = GemmConfig {
                transa: cublasOperation_t::CUBLAS_OP_T,
                transb: cublasOperation_t::CUBLAS_OP_N,
                m: m as i32,
                n: n as i32,
                k: cols as i32,
                alpha: 1.0f32,
                lda: cols as i32,
                ldb: cols as i32,
                beta: 0.0f32,
                ldc: rows as i32,
            };
            let mut c = y.slice_mut(r0..n * rows);
            // SAFETY: A is m x cols, x holds n x cols, and C's view from r0 covers
            // (n - 1) * rows + m values, as cfg says.
            unsafe { blas.gemm(cfg, &all, x, &mut c) }
                .map_err(|e| CudaError::Invalid(format!("cuBLAS SGEMM: {e:?}")))?;
        }
        Ok(())
    }

    /// `y[t] = W x[t]` for `n` tokens: `w` holds `rows` rows of `cols` values in `format`,
    /// `x` is `[n, cols]`, `y` is `[n, rows]` (device buffers).
    pub fn matvec(
        &self,
        w: &CudaSlice<u8>,
        format: Format,
        rows: usize,
        cols: usize,
        x: &CudaSlice<f32>,
        n: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        check_product(w, format, rows, cols, x, n, y)?;
        if n == 0 || rows == 0 {
            return Ok(());
        }
        let (fmt, rows_i, cols_i, n_i) =
            (kernel_format_id(format), rows as i32, cols as i32, n as i32);
        // A warp per row leaves most of the GPU idle below a few thousand rows (the mHC,
        // router and gate projections): those rows get a block each instead.
        let split = rows < SPLIT_BELOW_ROWS;
        let (name, cfg) = if split {
            let cfg = LaunchConfig {
                grid_dim: (rows as u32, 1, 1),
                block_dim: (SPLIT_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            ("matvec_split", cfg)
        } else {
            ("matvec", rows_config(rows, 1))
        };
        let mut b = self.stream.launch_builder(self.kernel(name));
        b.arg(w)
            .arg(&fmt)
            .arg(&rows_i)
            .arg(&cols_i)
            .arg(x)
            .arg(&n_i)
            .arg(y);
        // SAFETY: both kernels take `matvec`'s argument list in gemv.cu; the sizes were
        // checked above, and the grid covers `rows` rows (a warp each, or a block of
        // SPLIT_WARPS warps each).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Clamped SwiGLU over `n` values of device buffers.
    pub fn swiglu(
        &self,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
        limit: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let n = gate.len().min(up.len()).min(out.len());
        let n_i = n as i64;
        let mut b = self.stream.launch_builder(self.kernel("swiglu"));
        b.arg(gate).arg(up).arg(&limit).arg(&n_i).arg(out);
        // SAFETY: `n` is within all three buffers; arguments match act.cu.
        unsafe { b.launch(LaunchConfig::for_num_elems(n as u32)) }?;
        Ok(())
    }

    /// RMSNorm of each `width`-wide row of `x` in place (`weight` of `width`, or none).
    pub fn rms_norm(
        &self,
        x: &mut CudaSlice<f32>,
        weight: Option<&CudaSlice<f32>>,
        width: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        let rows = x.len() / width.max(1);
        if weight.is_some_and(|w| w.len() != width) || rows * width != x.len() {
            return Err(CudaError::Invalid(format!(
                "rms_norm of {} values in rows of {width}",
                x.len()
            )));
        }
        let dummy;
        let w = match weight {
            Some(w) => w,
            None => {
                dummy = self.stream.alloc_zeros::<f32>(1)?;
                &dummy
            }
        };
        let (has_weight, width_i) = (weight.is_some() as i32, width as i32);
        let mut b = self.stream.launch_builder(self.kernel("rms_norm"));
        b.arg(x).arg(w).arg(&has_weight).arg(&width_i).arg(&eps);
        // SAFETY: one block per row of `width` values; the weight is `width` long or null.
        unsafe { b.launch(norm_config(rows, width)) }?;
        Ok(())
    }

    /// `x = rms_norm(x) * weight * sigmoid(gate)` per row of `width`, in place.
    pub fn gated_rms_norm(
        &self,
        x: &mut CudaSlice<f32>,
        gate: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        width: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        let rows = x.len() / width.max(1);
        if weight.len() != width || rows * width != x.len() || gate.len() != x.len() {
            return Err(CudaError::Invalid(format!(
                "gated_rms_norm of {} values (gate {}) in rows of {width}",
                x.len(),
                gate.len()
            )));
        }
        let width_i = width as i32;
        let mut b = self.stream.launch_builder(self.kernel("gated_rms_norm"));
        b.arg(x).arg(gate).arg(weight).arg(&width_i).arg(&eps);
        // SAFETY: as in `rms_norm`; `gate` has the shape of `x`.
        unsafe { b.launch(norm_config(rows, width)) }?;
        Ok(())
    }

    /// The router's choice from its logits (`[tokens, experts]`): ids and weights `[tokens, k]`.
    pub fn route(
        &self,
        logits: &CudaSlice<f32>,
        bias: &CudaSlice<f32>,
        spec: RouteSpec,
        tokens: usize,
    ) -> Result<(Vec<u32>, Vec<f32>), CudaError> {
        let RouteSpec {
            experts,
            groups,
            topk_groups,
            k,
            normalize,
            scale,
        } = spec;
        if experts > 1024
            || groups == 0
            || experts % groups != 0
            || k > experts
            || logits.len() < tokens * experts
            || bias.len() != experts
        {
            return Err(CudaError::Invalid(format!(
                "route: {spec:?} for {tokens} tokens"
            )));
        }
        if tokens == 0 {
            return Ok((Vec::new(), Vec::new()));
        }
        let mut ids = self.stream.clone_htod(&vec![-1i32; tokens * k])?;
        let mut weights = self.alloc_f32(tokens * k)?;
        let (e, g, tg, k_i, norm) = (
            experts as i32,
            groups as i32,
            topk_groups as i32,
            k as i32,
            normalize as i32,
        );
        let mut b = self.stream.launch_builder(self.kernel("route"));
        b.arg(logits)
            .arg(bias)
            .arg(&e)
            .arg(&g)
            .arg(&tg)
            .arg(&k_i)
            .arg(&norm)
            .arg(&scale)
            .arg(&mut ids)
            .arg(&mut weights);
        let cfg = LaunchConfig {
            grid_dim: (tokens as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: experts <= 1024 (the kernel's shared arrays), buffers sized above.
        unsafe { b.launch(cfg) }?;
        let ids = self.download(&ids)?.into_iter().map(|i| i as u32).collect();
        Ok((ids, self.download(&weights)?))
    }

    /// The routed-expert step for expert records already in `arena`; see [`MoeStep`].
    pub fn moe(
        &self,
        arena: &CudaSlice<u8>,
        step: &MoeStep,
        x: &[f32],
    ) -> Result<Vec<f32>, CudaError> {
        step.check(arena.len(), x.len())?;
        let mut run = self.moe_begin(step.layout, step.tokens, step.k, x)?;
        let picks: Vec<(usize, u32)> = step.slots.iter().copied().enumerate().collect();
        self.moe_picks(&mut run, arena, step.limit, &picks)?;
        self.moe_finish(run, step.weights)
    }

    /// Starts a routed-expert step over `tokens` rows of `x` with `k` picks each: per-pick
    /// outputs are filled by [`Cuda::moe_picks`] (GPU) or [`Cuda::moe_set_rows`] (computed
    /// elsewhere), then [`Cuda::moe_finish`] combines them in pick order.
    pub fn moe_begin(
        &self,
        layout: MoeLayout,
        tokens: usize,
        k: usize,
        x: &[f32],
    ) -> Result<MoeRun, CudaError> {
        if x.len() != tokens * layout.hidden {
            return Err(CudaError::Invalid(format!(
                "moe step of {tokens} tokens of {}: {} inputs",
                layout.hidden,
                x.len()
            )));
        }
        Ok(MoeRun {
            layout,
            tokens,
            k,
            x: self.stream.clone_htod(x)?,
            yp: self.alloc_f32(tokens * k * layout.hidden)?,
            act: self.alloc_f32(tokens * k * layout.inter)?,
        })
    }

    /// [`Cuda::moe_begin`] on token rows already on the device (`x`: at least
    /// `tokens * hidden` values).
    pub fn moe_begin_dev(
        &self,
        layout: MoeLayout,
        tokens: usize,
        k: usize,
        x: &CudaSlice<f32>,
    ) -> Result<MoeRun, CudaError> {
        let n = tokens * layout.hidden;
        if x.len() < n {
            return Err(CudaError::Invalid(format!(
                "moe step of {tokens} tokens of {}: {} inputs",
                layout.hidden,
                x.len()
            )));
        }
        let mut rows = self.alloc_f32(n.max(1))?;
        self.stream.memcpy_dtod(&x.slice(..n), &mut rows)?;
        Ok(MoeRun {
            layout,
            tokens,
            k,
            x: rows,
            yp: self.alloc_f32(tokens * k * layout.hidden)?,
            act: self.alloc_f32(tokens * k * layout.inter)?,
        })
    }

    /// Computes the outputs of `picks` (`(pick index t * k + j, arena slot)`) on the GPU.
    /// Each pick's output depends only on its token row and its slot's bytes, never on
    /// which other picks share the launch.
    pub fn moe_picks(
        &self,
        run: &mut MoeRun,
        arena: &CudaSlice<u8>,
        limit: f32,
        picks: &[(usize, u32)],
    ) -> Result<(), CudaError> {
        let layout = run.layout;
        let slots = arena.len() / layout.slot_bytes.max(1);
        let total = run.tokens * run.k;
        if let Some(bad) = picks
            .iter()
            .find(|(p, s)| *p >= total || *s as usize >= slots)
        {
            return Err(CudaError::Invalid(format!(
                "moe pick {bad:?}: {total} picks, the arena holds {slots} slots"
            )));
        }
        if picks.is_empty() {
            return Ok(());
        }
        // Group the picks by slot, in order of first appearance.
        let mut group_of: HashMap<u32, usize> = HashMap::new();
        let mut members: Vec<Vec<i32>> = Vec::new();
        let mut slot_of_group: Vec<u32> = Vec::new();
        for &(p, s) in picks {
            let g = *group_of.entry(s).or_insert_with(|| {
                members.push(Vec::new());
                slot_of_group.push(s);
                members.len() - 1
            });
            members[g].push(p as i32);
        }
        let base: Vec<i64> = slot_of_group
            .iter()
            .map(|&s| (s as usize * layout.slot_bytes) as i64)
            .collect();
        let mut start = Vec::with_capacity(members.len());
        let mut len = Vec::with_capacity(members.len());
        let mut list = Vec::with_capacity(picks.len());
        for m in &members {
            start.push(list.len() as i32);
            len.push(m.len() as i32);
            list.extend_from_slice(m);
        }
        let s = &self.stream;
        let (d_base, d_start, d_len, d_list) = (
            s.clone_htod(&base)?,
            s.clone_htod(&start)?,
            s.clone_htod(&len)?,
            s.clone_htod(&list)?,
        );
        let (hidden, inter) = (layout.hidden, layout.inter);
        let groups = members.len() as u32;
        let (gate_fmt, down_fmt) = (
            kernel_format_id(layout.gate_up),
            kernel_format_id(layout.down),
        );
        let (up_off, down_off) = (layout.up_offset as i64, layout.down_offset as i64);
        let (inter_i, hidden_i, k_i) = (inter as i32, hidden as i32, run.k as i32);

        let mut b = s.launch_builder(self.kernel("moe_gate_up"));
        b.arg(arena)
            .arg(&gate_fmt)
            .arg(&d_base)
            .arg(&d_start)
            .arg(&d_len)
            .arg(&d_list)
            .arg(&up_off)
            .arg(&inter_i)
            .arg(&hidden_i)
            .arg(&k_i)
            .arg(&limit)
            .arg(&run.x)
            .arg(&mut run.act);
        // SAFETY: every slot was checked to lie inside the arena and every pick index below
        // `tokens * k` (the rows of act and yp); the grid covers `inter` rows of each group.
        unsafe { b.launch(rows_config(inter, groups)) }?;

        let mut b = s.launch_builder(self.kernel("moe_down"));
        b.arg(arena)
            .arg(&down_fmt)
            .arg(&d_base)
            .arg(&d_start)
            .arg(&d_len)
            .arg(&d_list)
            .arg(&down_off)
            .arg(&hidden_i)
            .arg(&inter_i)
            .arg(&run.act)
            .arg(&mut run.yp);
        // SAFETY: as above, for `hidden` rows of the down projection.
        unsafe { b.launch(rows_config(hidden, groups)) }?;
        Ok(())
    }

    /// Sets the output of pick `pick` to `values` (computed off the GPU, e.g. the CPU lane).
    pub fn moe_set_rows(
        &self,
        run: &mut MoeRun,
        pick: usize,
        values: &[f32],
    ) -> Result<(), CudaError> {
        let h = run.layout.hidden;
        if pick >= run.tokens * run.k || values.len() != h {
            return Err(CudaError::Invalid(format!(
                "moe row {pick} of {} values; {} picks of {h}",
                values.len(),
                run.tokens * run.k
            )));
        }
        let mut dst = run.yp.slice_mut(pick * h..(pick + 1) * h);
        self.stream.memcpy_htod(values, &mut dst)?;
        Ok(())
    }

    /// `out[t] = sum_j weights[t, j] * pick(t * k + j)` in pick order, on the GPU.
    pub fn moe_finish(&self, run: MoeRun, weights: &[f32]) -> Result<Vec<f32>, CudaError> {
        let n = run.tokens * run.layout.hidden;
        if run.tokens == 0 {
            return Ok(Vec::new());
        }
        let out = self.moe_combine(run, weights)?;
        let mut y = self.stream.clone_dtoh(&out)?;
        y.truncate(n);
        Ok(y)
    }

    /// [`Cuda::moe_finish`] leaving the result on the device (`[tokens, hidden]`).
    pub fn moe_combine(&self, run: MoeRun, weights: &[f32]) -> Result<CudaSlice<f32>, CudaError> {
        let (tokens, k, hidden) = (run.tokens, run.k, run.layout.hidden);
        if weights.len() != tokens * k || tokens == 0 {
            return Err(CudaError::Invalid(format!(
                "moe combine of {tokens} x {k} picks with {} weights",
                weights.len()
            )));
        }
        let s = &self.stream;
        let d_w = s.clone_htod(weights)?;
        let mut out = self.alloc_f32(tokens * hidden)?;
        let (tokens_i, k_i, hidden_i) = (tokens as i32, k as i32, hidden as i32);
        let mut b = s.launch_builder(self.kernel("moe_combine"));
        b.arg(&run.yp)
            .arg(&d_w)
            .arg(&tokens_i)
            .arg(&k_i)
            .arg(&hidden_i)
            .arg(&mut out);
        // SAFETY: `tokens * hidden` outputs from `tokens * k` pick rows and weights.
        unsafe { b.launch(LaunchConfig::for_num_elems((tokens * hidden) as u32)) }?;
        Ok(out)
    }
}

/// An expert provider whose products run on a GPU, taking the token rows where they are
/// (see `ExpertProvider::on_device`): the GPU forward's activations need not come back to
/// the host and go out again around every MoE layer.
pub trait DeviceExperts {
    /// The device the products run on (the rows must live there).
    fn device(&self) -> &Arc<Cuda>;

    /// `ExpertProvider::forward` for `x` (`[tokens, hidden]` on [`DeviceExperts::device`]):
    /// the routed experts' weighted sum, `[tokens, hidden]`, on the device.
    fn forward_device(
        &self,
        layer: usize,
        x: &CudaSlice<f32>,
        routing: &crate::model::moe::Routing,
    ) -> anyhow::Result<CudaSlice<f32>>;
}

/// A routed-expert step in progress (see [`Cuda::moe_begin`]).
pub struct MoeRun {
    layout: MoeLayout,
    tokens: usize,
    k: usize,
    x: CudaSlice<f32>,
    yp: CudaSlice<f32>,
    act: CudaSlice<f32>,
}

/// Router settings for [`Cuda::route`].
#[derive(Clone, Copy, Debug)]
pub struct RouteSpec {
    pub experts: usize,
    pub groups: usize,
    pub topk_groups: usize,
    pub k: usize,
    pub normalize: bool,
    pub scale: f32,
}

/// Where gate, up and down sit inside one expert slot, and their formats.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeLayout {
    pub hidden: usize,
    pub inter: usize,
    /// Format of gate and up (`[inter, hidden]` each).
    pub gate_up: Format,
    /// Format of down (`[hidden, inter]`).
    pub down: Format,
    pub up_offset: usize,
    pub down_offset: usize,
    /// Bytes between slot starts (a multiple of 4 KiB).
    pub slot_bytes: usize,
}

impl MoeLayout {
    /// Gate, up and down back to back, each 256-byte aligned, the slot rounded to 4 KiB.
    pub fn new(
        hidden: usize,
        inter: usize,
        gate_up: Format,
        down: Format,
    ) -> Result<MoeLayout, CudaError> {
        let bad = |e: crate::quant::QuantError| CudaError::Invalid(e.to_string());
        let gate_bytes = inter * gate_up.row_bytes(hidden).map_err(bad)?;
        let down_bytes = hidden * down.row_bytes(inter).map_err(bad)?;
        let up_offset = gate_bytes.next_multiple_of(256);
        let down_offset = (up_offset + gate_bytes).next_multiple_of(256);
        Ok(MoeLayout {
            hidden,
            inter,
            gate_up,
            down,
            up_offset,
            down_offset,
            slot_bytes: (down_offset + down_bytes).next_multiple_of(4096),
        })
    }

    /// Bytes of gate (and of up).
    pub fn gate_bytes(&self) -> usize {
        self.inter * self.gate_up.row_bytes(self.hidden).unwrap_or(0)
    }

    pub fn down_bytes(&self) -> usize {
        self.hidden * self.down.row_bytes(self.inter).unwrap_or(0)
    }
}

/// One routed-expert step: `out[t] = sum_j weights[t, j] * expert(slots[t * k + j])(x[t])`,
/// the sum in pick order.
#[derive(Clone, Copy, Debug)]
pub struct MoeStep<'a> {
    pub layout: MoeLayout,
    pub tokens: usize,
    pub k: usize,
    pub limit: f32,
    /// Arena slot of every pick, `[tokens * k]`.
    pub slots: &'a [u32],
    /// `[tokens * k]`
    pub weights: &'a [f32],
}

impl MoeStep<'_> {
    fn check(&self, arena_bytes: usize, x_len: usize) -> Result<(), CudaError> {
        let picks = self.tokens * self.k;
        let slots = arena_bytes / self.layout.slot_bytes.max(1);
        if self.slots.len() != picks
            || self.weights.len() != picks
            || x_len != self.tokens * self.layout.hidden
        {
            return Err(CudaError::Invalid(format!(
                "moe step of {} tokens x {} picks: {} slots, {} weights, {} inputs",
                self.tokens,
                self.k,
                self.slots.len(),
                self.weights.len(),
                x_len
            )));
        }
        if let Some(s) = self.slots.iter().find(|&&s| s as usize >= slots) {
            return Err(CudaError::Invalid(format!(
                "moe step names slot {s}; the arena holds {slots}"
            )));
        }
        Ok(())
    }
}

/// Expert slots in one device allocation.
pub struct SlotArena {
    pub buf: CudaSlice<u8>,
    pub layout: MoeLayout,
    pub slots: usize,
}

impl SlotArena {
    pub fn new(cuda: &Cuda, layout: MoeLayout, slots: usize) -> Result<SlotArena, CudaError> {
        let bytes = layout.slot_bytes * slots.max(1);
        // SAFETY: the arena is written slot by slot before any kernel reads a slot.
        let buf = unsafe { cuda.stream.alloc::<u8>(bytes) }?;
        Ok(SlotArena { buf, layout, slots })
    }

    /// Copies one expert's gate, up and down bytes into slot `slot`, on `stream` (the
    /// kernel stream, or the copy stream for slots its user orders with events).
    pub fn write(
        &mut self,
        stream: &Arc<CudaStream>,
        slot: usize,
        gate: &[u8],
        up: &[u8],
        down: &[u8],
    ) -> Result<(), CudaError> {
        let l = self.layout;
        let gb = l.gate_bytes();
        if slot >= self.slots || gate.len() != gb || up.len() != gb || down.len() != l.down_bytes()
        {
            return Err(CudaError::Invalid(format!(
                "slot {slot} of {}: gate {} up {} down {} bytes, the layout wants {gb}, {gb}, {}",
                self.slots,
                gate.len(),
                up.len(),
                down.len(),
                l.down_bytes()
            )));
        }
        let base = slot * l.slot_bytes;
        for (off, bytes) in [(0, gate), (l.up_offset, up), (l.down_offset, down)] {
            let mut dst = self.buf.slice_mut(base + off..base + off + bytes.len());
            stream.memcpy_htod(bytes, &mut dst)?;
        }
        Ok(())
    }
}

fn rows_config(rows: usize, groups: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((rows as u32).div_ceil(ROWS_PER_BLOCK), groups.max(1), 1),
        block_dim: (ROW_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn norm_config(rows: usize, width: usize) -> LaunchConfig {
    let threads = (width.next_power_of_two() as u32).clamp(32, 1024);
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// PTX for `file` on `arch`, from `cache_dir` when a matching entry exists, else compiled
/// with NVRTC (and written there).
fn compile_cached(file: &str, arch: &str, cache_dir: Option<&Path>) -> Result<Ptx, CudaError> {
    use sha2::{Digest, Sha256};
    let src = glmflash_kernels::module_source(file).expect("file comes from SOURCES");
    let nvrtc = nvrtc_version();
    let key = {
        let mut h = Sha256::new();
        h.update(src.as_bytes());
        h.update(arch.as_bytes());
        h.update(nvrtc.as_bytes());
        let d = h.finalize();
        d.iter()
            .take(12)
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    };
    let path: Option<PathBuf> =
        cache_dir.map(|d| d.join(format!("{}-{arch}-{key}.ptx", file.trim_end_matches(".cu"))));
    if let Some(p) = &path
        && let Ok(text) = std::fs::read_to_string(p)
    {
        tracing::debug!(file, arch, path = %p.display(), "kernel PTX from the cache");
        return Ok(Ptx::from_src(text));
    }
    if !nvrtc_present() {
        return Err(CudaError::Unavailable(
            "the CUDA runtime compiler (libnvrtc) was not found: install the CUDA toolkit (or the \
             nvidia-cuda-nvrtc package) and put its lib directory on LD_LIBRARY_PATH"
                .into(),
        ));
    }
    let started = std::time::Instant::now();
    let opts = CompileOptions {
        arch: Some(static_arch(arch)),
        options: vec!["--std=c++17".into(), "--generate-line-info".into()],
        name: Some(file.to_string()),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(&src, opts).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => CudaError::Compile {
            file: file.into(),
            arch: arch.into(),
            log: log.to_string_lossy().into_owned(),
        },
        other => CudaError::Compile {
            file: file.into(),
            arch: arch.into(),
            log: format!("{other:?}"),
        },
    })?;
    tracing::info!(file, arch, nvrtc = %nvrtc, ms = started.elapsed().as_millis() as u64, "compiled kernels with NVRTC");
    if let Some(p) = &path {
        let write = || -> std::io::Result<()> {
            std::fs::create_dir_all(p.parent().unwrap_or(Path::new(".")))?;
            let tmp = p.with_extension("tmp");
            std::fs::write(&tmp, ptx.to_src())?;
            std::fs::rename(&tmp, p)
        };
        if let Err(e) = write() {
            tracing::warn!(path = %p.display(), error = %e, "could not cache compiled kernels");
        }
    }
    Ok(ptx)
}

fn nvrtc_version() -> String {
    if !nvrtc_present() {
        return "absent".into();
    }
    let (mut major, mut minor) = (0i32, 0i32);
    // SAFETY: nvrtcVersion writes two ints through valid pointers; the library is present.
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if status == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        format!("{major}.{minor}")
    } else {
        format!("unknown ({status:?})")
    }
}

/// cudarc wants the arch as a `&'static str`; the common ones are literals, others leak once.
fn static_arch(arch: &str) -> &'static str {
    const KNOWN: [&str; 9] = [
        "sm_75", "sm_80", "sm_86", "sm_87", "sm_89", "sm_90", "sm_100", "sm_120", "sm_121",
    ];
    KNOWN
        .iter()
        .find(|a| **a == arch)
        .copied()
        .unwrap_or_else(|| Box::leak(arch.to_string().into_boxed_str()))
}

#[cfg(test)]
mod tests {
    /// Every kernel a wrapper launches by name is in the kernel crate's lists: a missing one
    /// would only show at its first launch, on a GPU.
    #[test]
    fn every_launched_kernel_is_listed() {
        let listed: Vec<&str> = glmflash_kernels::SOURCES
            .iter()
            .flat_map(|(_, _, kernels)| kernels.iter().copied())
            .collect();
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/backend/cuda");
        let mut launched = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let text = std::fs::read_to_string(&path).unwrap();
            for (at, _) in text.match_indices("kernel(\"") {
                let rest = &text[at + "kernel(\"".len()..];
                let name = &rest[..rest.find('"').unwrap()];
                assert!(
                    listed.contains(&name),
                    "{}: kernel {name} is not in glmflash_kernels::SOURCES",
                    path.display()
                );
                launched += 1;
            }
        }
        assert!(launched > 20, "found {launched} launches by name");
    }
}
