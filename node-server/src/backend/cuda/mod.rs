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
mod compile;
mod dense;
mod dsa_step;
mod elementwise;
mod exl3;
mod graph;
mod groups;
pub mod matrix;
mod moe;
mod moe_rows;
mod ops;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys::cublasOperation_t};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DriverError, LaunchConfig, PushKernelArg,
};
pub use elementwise::{CallCosts, ChainCosts, KdaGates};
pub use exl3::{Exl3Weights, GEMV_BLOCKS};
pub use graph::StepGraph;
pub use moe::{Exl3Form, MoeLayout, MoeRun, MoeStep, RouteSpec, SlotArena, SlotFormat};
pub use moe_rows::MOE_GEMM_MIN_PICKS;
pub use ops::{KdaForm, KdaSpec, MhcCollapse, MhcSpec};
use std::collections::HashMap;
use std::path::Path;
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

/// Prompt chunks' bf16 dense products on the tensor cores ([`Cuda::matmul`]) and row-format
/// MoE slots of many picks through cuBLAS ([`Cuda::moe_picks`]): on unless
/// `GLMFLASH_PROMPT_GEMM=0` (the matvec-style kernels, for A/B runs and as a fallback).
pub fn prompt_gemm() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("GLMFLASH_PROMPT_GEMM").map_or(true, |v| v != "0"))
}

/// The device's default memory pool, which every stream-ordered allocation here draws from,
/// keeps the memory freed into it across synchronisations (the driver's default hands it all
/// back at each one, and a step's ~300 scratch allocations after one map memory again; on the
/// H200, 2026-12-04, keeping it decoded 4 streams 2-5% faster alone and with the batched KDA
/// 646/597 → 693/699 tok/s in two rounds). `GLMFLASH_POOL_KEEP_MIB=N` keeps at most N MiB
/// (0: the driver's default).
fn keep_pool_memory(ctx: &CudaContext) -> Result<(), CudaError> {
    use cudarc::driver::sys;
    let cap = std::env::var("GLMFLASH_POOL_KEEP_MIB")
        .ok()
        .and_then(|v| v.parse::<u64>().ok());
    let mut bytes = cap.map_or(u64::MAX, |mib| mib.saturating_mul(1 << 20));
    let mut pool = std::mem::MaybeUninit::<sys::CUmemoryPool>::uninit();
    // SAFETY: the pool handle is written by the driver for this context's device and only
    // read after it succeeded; the attribute takes a pointer to a u64, which `bytes` is.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(pool.as_mut_ptr(), ctx.cu_device()).result()?;
        sys::cuMemPoolSetAttribute(
            pool.assume_init(),
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&raw mut bytes).cast(),
        )
        .result()?;
    }
    if let Some(mib) = cap {
        tracing::info!(mib, "the memory pool keeps at most this much freed memory");
    }
    Ok(())
}

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

/// `TOK_TILE` in kernels/cuda/common.cuh: the most tokens one `matvec` pass carries.
const MATVEC_TILE: usize = 8;

/// Matrices of fewer rows go through `matvec_split` (a block per row).
const SPLIT_BELOW_ROWS: usize = 2048;
/// Threads of a `matvec_split` block (its SPLIT_WARPS warps).
const SPLIT_THREADS: u32 = 256;

/// Threads per block of the warp-per-row kernels (4 warps: 4 rows per block; gemv.cu's
/// ROW_THREADS, moe.cu's MOE_ROW_THREADS: their rings of shared memory are sized by it).
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
    /// Settings shared with the device's other queues ([`Cuda::side`]).
    settings: Settings,
    /// cuBLAS on `stream`, started at the first many-token product (`Err`: it would not start).
    blas: std::sync::OnceLock<Result<std::sync::Mutex<CudaBlas>, String>>,
    /// One zero, passed where a kernel takes an optional vector it will not read.
    unread: CudaSlice<f32>,
    /// Zeros for kernels whose last block of a group finishes the group's work
    /// (`last_of_group` in common.cuh): a launch on `stream` uses the first tickets it needs
    /// and leaves them at zero, so launches one after another share them.
    tickets: CudaSlice<u32>,
    /// Page-locked host memory that f32 downloads land in (grown to the largest asked for):
    /// a copy into pageable memory goes through the driver's bounce buffer and faults in
    /// fresh pages each time, ~1 ms for a step's 4 x 155k logits.
    staging: std::sync::Mutex<Option<cudarc::driver::PinnedHostSlice<f32>>>,
    /// While a graph is captured on this queue: the page-locked memory its tables are copied
    /// from at each replay ([`Cuda::upload_table`]).
    tables: std::sync::Mutex<Option<graph::TableArena>>,
}

/// The settings a device's queues share ([`Cuda::side`]).
#[derive(Clone)]
struct Settings {
    /// Fill scratch buffers with NaN before kernels write them (checks: an unwritten output
    /// then shows as NaN instead of a plausible zero).
    poison: Arc<std::sync::atomic::AtomicBool>,
    /// Blocks a dense EXL3 GEMV aims for (N/16 strips times its K slices; see exl3.rs).
    gemv_blocks: Arc<std::sync::atomic::AtomicUsize>,
    /// `matvec`'s tokens a pass are always [`MATVEC_TILE`] (the kernel's widest) when set:
    /// the same bits as the tile fitted to the tokens, for checks and A/B timings.
    matvec_wide_tile: Arc<std::sync::atomic::AtomicBool>,
    /// The queues' work is being captured into a graph ([`Cuda::capture`]): nothing may wait
    /// for the device or copy from pageable host memory, and the ops that read a decode
    /// step's position take it from the graph's step count.
    capturing: Arc<std::sync::atomic::AtomicBool>,
    /// Programmatic edges made and refused in the capture under way (PDL; graph.rs).
    programmatic: Arc<[std::sync::atomic::AtomicUsize; 2]>,
}

/// Tickets [`Cuda`] keeps: groups one launch may count (one per token row of a grid).
pub const TICKETS: usize = 65_536;

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
        keep_pool_memory(&ctx)?;
        let (major, minor) = ctx.compute_capability()?;
        let arch = format!("sm_{major}{minor}");
        let name = ctx.name()?;
        supported_arch(&name, major, minor)?;
        // A stream of its own, not the legacy default stream: that one synchronises with every
        // blocking stream and cannot be captured into a graph (issue 17 item 1). Nothing here
        // relied on its implicit ordering: the copy stream is non-blocking, ordered by events.
        let stream = ctx.new_stream()?;
        let copy = ctx.new_stream()?;
        let mut kernels = HashMap::new();
        for (file, _, names) in glmflash_kernels::SOURCES {
            let ptx = compile::compile_cached(file, &arch, cache_dir)?;
            let module = ctx.load_module(ptx)?;
            for k in names.iter() {
                kernels.insert(*k, module.load_function(k)?);
            }
        }
        let settings = Settings {
            poison: Default::default(),
            gemv_blocks: Arc::new(exl3::GEMV_BLOCKS.into()),
            matvec_wide_tile: Default::default(),
            capturing: Default::default(),
            programmatic: Default::default(),
        };
        Cuda::on_stream(ctx, stream, copy, (name, arch), kernels, settings)
    }

    /// A device handle that queues on `stream`, with tickets and scratch state of its own.
    fn on_stream(
        ctx: Arc<CudaContext>,
        stream: Arc<CudaStream>,
        copy: Arc<CudaStream>,
        (name, arch): (String, String),
        kernels: HashMap<&'static str, CudaFunction>,
        settings: Settings,
    ) -> Result<Arc<Cuda>, CudaError> {
        let unread = stream.alloc_zeros::<f32>(1)?;
        let tickets = stream.alloc_zeros::<u32>(TICKETS)?;
        Ok(Arc::new(Cuda {
            unread,
            tickets,
            staging: Default::default(),
            tables: Default::default(),
            ctx,
            stream,
            copy,
            name,
            arch,
            kernels,
            settings,
            blas: Default::default(),
        }))
    }

    /// A second queue of the same device: a non-blocking stream whose kernels run beside
    /// this one's, with tickets of its own (launches on two streams at once must not share
    /// them), the kernels, the copy stream and the settings shared. Nothing orders the two
    /// streams but [`Cuda::after`]; a buffer is freed on the stream that allocated it.
    pub fn side(&self) -> Result<Arc<Cuda>, CudaError> {
        let names = (self.name.clone(), self.arch.clone());
        let (kernels, copy, settings) = (
            self.kernels.clone(),
            self.copy.clone(),
            self.settings.clone(),
        );
        Cuda::on_stream(
            self.ctx.clone(),
            self.ctx.new_stream()?,
            copy,
            names,
            kernels,
            settings,
        )
    }

    /// Work queued on this stream from now on waits for everything queued on `other`'s so
    /// far: `event` recorded there (an event may be recorded again once this returns).
    pub fn after(&self, other: &Cuda, event: &cudarc::driver::CudaEvent) -> Result<(), CudaError> {
        event.record(&other.stream)?;
        Ok(self.stream.wait(event)?)
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

    /// cuBLAS on the compute stream, started at its first use.
    fn blas(&self) -> Result<std::sync::MutexGuard<'_, CudaBlas>, CudaError> {
        let blas = self
            .blas
            .get_or_init(|| {
                CudaBlas::new(self.stream.clone())
                    .map(std::sync::Mutex::new)
                    .map_err(|e| format!("{e:?}"))
            })
            .as_ref()
            .map_err(|e| CudaError::Unavailable(format!("cuBLAS could not start: {e}")))?;
        Ok(blas.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// A kernel about to be launched on this handle's stream (every launch names its kernel
    /// here, right before it: see [`Cuda::before_launch`]).
    fn kernel(&self, name: &str) -> &CudaFunction {
        self.before_launch();
        self.kernels
            .get(name)
            .unwrap_or_else(|| panic!("kernel {name} is listed in glmflash_kernels::SOURCES"))
    }

    /// `host` in a fresh device buffer. Refused while capturing a graph: the graph would copy
    /// whatever the host memory holds at each replay (or the driver refuses pageable memory).
    pub fn upload<T: cudarc::driver::DeviceRepr>(
        &self,
        host: &[T],
    ) -> Result<CudaSlice<T>, CudaError> {
        self.not_capturing("an upload")?;
        Ok(self.stream.clone_htod(host)?)
    }

    pub fn download<T: cudarc::driver::DeviceRepr + Default + Clone>(
        &self,
        dev: &CudaSlice<T>,
    ) -> Result<Vec<T>, CudaError> {
        self.not_capturing("a download")?;
        Ok(self.stream.clone_dtoh(dev)?)
    }

    /// `dev`'s values on the host, copied through the page-locked staging buffer.
    pub fn download_f32(&self, dev: &CudaSlice<f32>) -> Result<Vec<f32>, CudaError> {
        self.download_f32_with(dev, <[f32]>::to_vec)
    }

    /// `f` of `dev`'s values, read where the page-locked staging buffer received them (no
    /// copy of the whole buffer on the host first).
    pub fn download_f32_with<R>(
        &self,
        dev: &CudaSlice<f32>,
        f: impl FnOnce(&[f32]) -> R,
    ) -> Result<R, CudaError> {
        if dev.is_empty() {
            return Ok(f(&[]));
        }
        self.not_capturing("a download")?;
        let mut staging = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        if staging.as_ref().is_none_or(|s| s.len() < dev.len()) {
            *staging = None;
            // SAFETY: only the first `dev.len()` values, each copied from `dev`, are read.
            *staging = Some(unsafe {
                self.ctx
                    .alloc_pinned_with_flags::<f32>(dev.len().next_power_of_two(), 0)
            }?);
        }
        let host = staging.as_mut().expect("allocated above");
        // cudarc copies a whole host slice; the staging buffer is usually longer than `dev`.
        let dst = &mut host.as_mut_slice()?[..dev.len()];
        {
            let (src, _record) = cudarc::driver::DevicePtr::device_ptr(dev, &self.stream);
            // SAFETY: `dst` is page-locked and outlives the copy, which the synchronisation
            // below ends before `dst` is read or the staging buffer reused.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(dst, src, self.stream.cu_stream())
            }?;
        }
        self.stream.synchronize()?;
        Ok(f(dst))
    }

    /// A scratch buffer of `len` floats, unwritten (NaN when poisoning: see [`Cuda::set_poison`]).
    pub fn alloc_f32(&self, len: usize) -> Result<CudaSlice<f32>, CudaError> {
        // SAFETY: any bits are a valid f32, and every caller writes a scratch buffer before
        // reading it: cuda-check runs every kernel wrapper and the decode step with each
        // buffer poisoned with NaN instead, where a read before a write would show.
        let mut buf = unsafe { self.stream.alloc::<f32>(len.max(1)) }?;
        let poison = self
            .settings
            .poison
            .load(std::sync::atomic::Ordering::Relaxed);
        if poison {
            self.fill_bits(&mut buf, f32::NAN.to_bits())?;
        }
        Ok(buf)
    }

    /// Sets the blocks a dense EXL3 GEMV aims for (timing checks try several; results then
    /// differ in their sums' order, never in their bounds).
    pub fn set_gemv_blocks(&self, blocks: usize) {
        self.settings
            .gemv_blocks
            .store(blocks.max(1), std::sync::atomic::Ordering::Relaxed);
    }

    /// `matvec` with its widest token tile whatever the tokens (see `matvec_wide_tile`).
    pub fn set_matvec_wide_tile(&self, on: bool) {
        self.settings
            .matvec_wide_tile
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Tokens a `matvec` pass carries for `n` tokens: the fewest of 1, 2, 4 and
    /// [`MATVEC_TILE`] that hold them (a row's warp then keeps only the accumulators it uses).
    fn matvec_tile(&self, n: usize) -> usize {
        if self
            .settings
            .matvec_wide_tile
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            return MATVEC_TILE;
        }
        match n {
            0 | 1 => 1,
            2 => 2,
            3 | 4 => 4,
            _ => MATVEC_TILE,
        }
    }

    /// Poison scratch and output buffers with NaN before kernels write them.
    pub fn set_poison(&self, on: bool) {
        self.settings
            .poison
            .store(on, std::sync::atomic::Ordering::Relaxed);
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

    /// An event for ordering two streams ([`Cuda::after`]; no timing).
    pub fn event(&self) -> Result<cudarc::driver::CudaEvent, CudaError> {
        Ok(self.ctx.new_event(Some(
            cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING,
        ))?)
    }

    /// An event that records the time it completes at ([`CudaEvent::elapsed_ms`] between two).
    ///
    /// [`CudaEvent::elapsed_ms`]: cudarc::driver::CudaEvent::elapsed_ms
    pub fn timing_event(&self) -> Result<cudarc::driver::CudaEvent, CudaError> {
        Ok(self
            .ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))?)
    }
}

/// One block of 256 threads per row, for `rows` rows.
pub(super) fn block_per_row(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Rows a warp of the four-token products (gemv.cu's T4_ROWS: 4, or the knob's 2 or 4).
fn t4_rows() -> usize {
    match compile::kernel_knob("T4_ROWS") {
        Some(2) => 2,
        _ => 4,
    }
}

/// Whether the q4_k MoE rows read x and act in lane-of-32 order (moe.cu's MOE_XL: 0, or the
/// knob's 1).
fn moe_xl() -> bool {
    compile::kernel_knob("MOE_XL") == Some(1)
}

/// Rows a warp of `moe_down`'s q4_k rows (moe.cu's DOWN_ROWS: 2, or the knob's 1, 2 or 4).
fn down_rows() -> usize {
    match compile::kernel_knob("DOWN_ROWS") {
        Some(n @ (1 | 2 | 4)) => n as usize,
        _ => 2,
    }
}

/// Gate rows a warp of `moe_gate_up`'s q4_k rows (moe.cu's GATE_UP_ROWS: 1, or the knob's 2).
fn gate_up_rows() -> usize {
    match compile::kernel_knob("GATE_UP_ROWS") {
        Some(2) => 2,
        _ => 1,
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

/// The kernels need compute capability 8.0 or newer (Ampere; the RTX 3090 is 8.6): cp.async,
/// f16x2 conversions and bf16 arithmetic. An older device is refused here with its name, not
/// by a PTX assembler error at the first module.
fn supported_arch(name: &str, major: i32, minor: i32) -> Result<(), CudaError> {
    if major < 8 {
        return Err(CudaError::Unavailable(format!(
            "{name} has compute capability {major}.{minor}; glmflash's kernels need 8.0 or newer \
             (Ampere: A100, RTX 30xx, or later)"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn devices_before_ampere_are_refused_by_name() {
        let err = super::supported_arch("Tesla T4", 7, 5)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("Tesla T4") && err.contains("7.5") && err.contains("8.0"),
            "{err}"
        );
        assert!(super::supported_arch("NVIDIA GeForce RTX 3090", 8, 6).is_ok());
        assert!(super::supported_arch("NVIDIA H100 80GB HBM3", 9, 0).is_ok());
    }

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
