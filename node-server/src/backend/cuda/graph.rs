//! Work on the compute stream captured once and replayed as one graph launch (issue 17 item
//! 1: a decode step is ~300 small launches, and on many hosts queueing them, not the device,
//! sets the step's time). While capturing, nothing may wait for the device or copy from
//! pageable host memory ([`Cuda::upload`] and the downloads refuse); values that change from
//! one replay to the next come from device memory the host writes before each launch.

use super::{Cuda, CudaError, compile};
use cudarc::driver::sys::{self, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice, DevicePtr, PinnedHostSlice};
use std::sync::atomic::Ordering::Relaxed;

/// A captured graph and the page-locked host buffer its last copy writes (the step's output).
pub struct StepGraph {
    graph: CudaGraph,
    out: PinnedHostSlice<f32>,
    /// Values of `out` the graph writes.
    out_len: usize,
    /// What the graph's table copies read at each replay.
    _tables: TableArena,
}

/// Bytes of page-locked memory a capture's tables may take.
const TABLE_BYTES: usize = 64 << 10;

/// Page-locked memory holding the tables a graph copies to the device at each replay: tables
/// that stay the same for as long as the graph may be replayed (addresses of buffers whose
/// place is part of the graph's key, or that the graph allocates itself).
pub(super) struct TableArena {
    host: PinnedHostSlice<u8>,
    /// `host`'s first byte (taken outside the capture: cudarc waits for the buffer's last
    /// copy when asked for it, which a capture refuses).
    at: usize,
    used: usize,
}

impl TableArena {
    fn new(cuda: &Cuda) -> Result<TableArena, CudaError> {
        // SAFETY: bytes are written (by `upload_table`) before any copy reads them.
        let mut host = unsafe { cuda.ctx.alloc_pinned_with_flags::<u8>(TABLE_BYTES, 0) }?;
        let at = host.as_mut_slice()?.as_mut_ptr() as usize;
        Ok(TableArena { host, at, used: 0 })
    }
}

// SAFETY: the arena's memory is only written by its owner (behind a lock) and read by copies
// the owner orders.
unsafe impl Send for TableArena {}

// SAFETY: the graph and executable handles are used by one thread at a time (the owner keeps
// a StepGraph behind a lock), which is all the driver asks of graph objects.
unsafe impl Send for StepGraph {}

impl Cuda {
    /// Whether a graph is being captured on this device's queues.
    pub fn capturing(&self) -> bool {
        self.settings.capturing.load(Relaxed)
    }

    /// An error naming `what` while a graph is being captured.
    pub(super) fn not_capturing(&self, what: &str) -> Result<(), CudaError> {
        if self.capturing() {
            return Err(CudaError::Invalid(format!(
                "{what} inside a graph capture (a replay could not repeat it)"
            )));
        }
        Ok(())
    }

    /// The settings a captured launch depends on (a graph made under others is not replayed).
    pub fn settings_key(&self) -> u64 {
        let s = &self.settings;
        (s.gemv_blocks.load(Relaxed) as u64) << 2
            | (s.matvec_wide_tile.load(Relaxed) as u64) << 1
            | s.poison.load(Relaxed) as u64
    }

    /// Gives the memory of dropped graphs back to the device (the driver keeps it for later
    /// graphs until asked); best effort.
    pub fn trim_graph_memory(&self) {
        // SAFETY: a plain driver call on this context's device.
        let r = unsafe { sys::cuDeviceGraphMemTrim(self.ctx.cu_device()) };
        if let Err(e) = r.result() {
            tracing::debug!(error = %e, "the graphs' memory was not trimmed");
        }
    }

    /// Sets every 32-bit word of `buf` to `bits`, on the compute stream (capturable).
    pub fn fill_bits<T>(&self, buf: &mut CudaSlice<T>, bits: u32) -> Result<(), CudaError> {
        let words = buf.num_bytes() / 4;
        let (ptr, _record) = buf.device_ptr(&self.stream);
        // SAFETY: the buffer holds `words` whole 32-bit words from `ptr`, and lives until the
        // stream has run the memset (a buffer is freed on its stream, after it).
        unsafe { sys::cuMemsetD32Async(ptr, bits, words, self.stream.cu_stream()) }.result()?;
        Ok(())
    }

    /// `host` (a table that stays the same for as long as a graph being captured may be
    /// replayed) in a fresh device buffer: while capturing, copied from page-locked memory the
    /// graph keeps (a pageable copy cannot be captured); else [`Cuda::upload`].
    pub fn upload_table<T: cudarc::driver::DeviceRepr>(
        &self,
        host: &[T],
    ) -> Result<CudaSlice<T>, CudaError> {
        if !self.capturing() {
            return self.upload(host);
        }
        let mut tables = self.tables.lock().unwrap_or_else(|e| e.into_inner());
        let Some(arena) = tables.as_mut() else {
            return Err(CudaError::Invalid(
                "a table upload inside a capture on a queue without a table arena".into(),
            ));
        };
        let bytes = std::mem::size_of_val(host);
        let start = arena.used.next_multiple_of(16);
        if start + bytes > arena.host.len() {
            return Err(CudaError::Invalid(format!(
                "a captured graph's tables outgrow {TABLE_BYTES} bytes"
            )));
        }
        // SAFETY: `start .. start + bytes` lies inside the arena (checked above), which no copy
        // reads yet (its graph is still being captured); T is plain data (DeviceRepr).
        unsafe {
            std::ptr::copy_nonoverlapping(
                host.as_ptr().cast::<u8>(),
                (arena.at + start) as *mut u8,
                bytes,
            )
        };
        arena.used = start + bytes;
        // SAFETY: the copy below writes every element before any kernel reads it.
        let mut dev = unsafe { self.stream.alloc::<T>(host.len().max(1)) }?;
        {
            let (dst, _record) =
                cudarc::driver::DevicePtrMut::device_ptr_mut(&mut dev, &self.stream);
            // SAFETY: the arena's bytes live as long as the graph (moved into it), the device
            // buffer holds `bytes`, and the copy is a captured node on this stream.
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    dst,
                    (arena.at + start) as *const std::ffi::c_void,
                    bytes,
                    self.stream.cu_stream(),
                )
            }
            .result()?;
        }
        Ok(dev)
    }

    /// Copies `host` into the start of `dst` on the compute stream (not capturable: outside a
    /// graph, before its launch).
    pub fn copy_in(&self, host: &[f32], dst: &mut CudaSlice<f32>) -> Result<(), CudaError> {
        self.not_capturing("an upload")?;
        if host.len() > dst.len() {
            return Err(CudaError::Invalid(format!(
                "{} values into a buffer of {}",
                host.len(),
                dst.len()
            )));
        }
        let mut part = dst.slice_mut(..host.len());
        Ok(self.stream.memcpy_htod(host, &mut part)?)
    }

    /// Captures what `run` queues on the compute stream (and on side queues it orders after
    /// it and joins back) into a graph whose last node copies the f32 buffer `run` returns
    /// (`out_len` values) to page-locked host memory. Nothing runs on the device. The capture
    /// ends whatever `run` did, so the stream stays usable after an error.
    pub fn capture(
        &self,
        out_len: usize,
        run: impl FnOnce() -> anyhow::Result<CudaSlice<f32>>,
    ) -> anyhow::Result<StepGraph> {
        // Page-locked before the capture (no stream operation), and its address taken before
        // too (cudarc waits for the buffer's last copy there, which a capture refuses).
        // SAFETY: only the first `out_len` values, each written by the graph's copy, are read.
        let mut out = unsafe { self.ctx.alloc_pinned_with_flags::<f32>(out_len.max(1), 0) }?;
        let host = out.as_mut_slice()?.as_mut_ptr();
        *self.tables.lock().unwrap_or_else(|e| e.into_inner()) = Some(TableArena::new(self)?);
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        self.settings.capturing.store(true, Relaxed);
        let captured = run().and_then(|dev| {
            if dev.len() != out_len {
                anyhow::bail!(
                    "a captured output of {} values, {out_len} expected",
                    dev.len()
                );
            }
            let (src, _record) = dev.device_ptr(&self.stream);
            // SAFETY: `host` holds `out_len` page-locked values and lives as long as the graph;
            // each replay ends (the owner synchronises) before they are read.
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(host.cast(), src, out_len * 4, self.stream.cu_stream())
            }
            .result()?;
            Ok(())
        });
        self.settings.capturing.store(false, Relaxed);
        // An error a drop left with the context (a free refused inside a failed capture) would
        // fail the end of the capture before it ends, leaving the stream capturing: it belongs
        // to this capture.
        let left = self.ctx.check_err();
        let graph = self.stream.end_capture(CUgraphInstantiate_flags(0));
        let [made, refused] = self
            .settings
            .programmatic
            .each_ref()
            .map(|c| c.swap(0, Relaxed));
        if made + refused > 0 {
            tracing::info!(made, refused, "step graph: programmatic edges (PDL)");
        }
        let tables = self.tables.lock().unwrap_or_else(|e| e.into_inner()).take();
        captured?;
        left?;
        let graph = graph?.ok_or_else(|| anyhow::anyhow!("the stream capture made no graph"))?;
        Ok(StepGraph {
            graph,
            out,
            out_len,
            _tables: tables.expect("made before the capture"),
        })
    }
}

impl StepGraph {
    /// Launches the graph on `cuda`'s compute stream (the one it was captured on), waits for
    /// it, and gives `f` of the output it copied to the host.
    pub fn replay<R>(&mut self, cuda: &Cuda, f: impl FnOnce(&[f32]) -> R) -> Result<R, CudaError> {
        self.graph.launch()?;
        cuda.stream.synchronize()?;
        Ok(f(&self.out.as_slice()?[..self.out_len]))
    }
}

/// Whether the step graph's kernels follow one another by programmatic dependent launch: the
/// knob PDL=1 (GLMFLASH_KERNEL_DEFINES, which also compiles `grid_wait` into every kernel);
/// off until measured.
fn pdl() -> bool {
    compile::kernel_knob("PDL") == Some(1)
}

/// Where `stream` is capturing and its next node's only dependency is one of glmflash's
/// kernels (every one begins with `grid_wait`) that nothing depends on yet, makes that
/// dependency programmatic: the node captured next, which the caller makes one of glmflash's
/// kernels, may then start while the kernel before it finishes, and waits for it in its
/// `grid_wait`. The edges are given as the capture makes them: a graph holding memory
/// allocations refuses changes to its edges afterwards (`CUDA_ERROR_NOT_SUPPORTED`, session
/// 46). Returns whether the edge was made.
///
/// # Safety
/// `stream` is a live stream of the current context.
unsafe fn programmatic_dependency(stream: sys::CUstream) -> Result<bool, sys::CUresult> {
    use sys::{CUgraphDependencyType as Dep, CUgraphNodeType as Node, CUresult as R};
    let ok = |r: R| if r == R::CUDA_SUCCESS { Ok(()) } else { Err(r) };
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let (mut id, mut graph, mut n) = (0, std::ptr::null_mut(), 0usize);
    let (mut deps, mut data) = (std::ptr::null(), std::ptr::null());
    // SAFETY: every out-pointer is a local; the arrays the driver gives are read below only.
    ok(unsafe {
        sys::cuStreamGetCaptureInfo_v3(
            stream,
            &mut status,
            &mut id,
            &mut graph,
            &mut deps,
            &mut data,
            &mut n,
        )
    })?;
    if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE || n != 1 {
        return Ok(false);
    }
    // SAFETY: the driver's arrays of `n` (1) entries; no edge data means a plain edge.
    let (mut node, plain) = unsafe {
        (
            *deps,
            data.is_null() || (*data).type_ == Dep::CU_GRAPH_DEPENDENCY_TYPE_DEFAULT as u8,
        )
    };
    let mut kind = Node::CU_GRAPH_NODE_TYPE_EMPTY;
    ok(unsafe { sys::cuGraphNodeGetType(node, &mut kind) })?;
    if !plain || kind != Node::CU_GRAPH_NODE_TYPE_KERNEL {
        return Ok(false);
    }
    // One programmatic edge out of a kernel at most, as a stream makes (a second queue that
    // forked from this kernel already depends on it: this edge stays plain).
    let mut dependents = 0usize;
    let (none, no_data) = (std::ptr::null_mut(), std::ptr::null_mut());
    // (A count the driver will not give without the edges' data means a dependent too.)
    let counted =
        unsafe { sys::cuGraphNodeGetDependentNodes_v2(node, none, no_data, &mut dependents) };
    if counted != R::CUDA_SUCCESS || dependents > 0 {
        return Ok(false);
    }
    // SAFETY: plain data the call fills.
    let mut params: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
    ok(unsafe { sys::cuGraphKernelNodeGetParams_v2(node, &mut params) })?;
    if params.func.is_null() {
        return Ok(false);
    }
    let mut name = std::ptr::null();
    ok(unsafe { sys::cuFuncGetName(&mut name, params.func) })?;
    // SAFETY: the driver's NUL-terminated name of a loaded function.
    let name = unsafe { std::ffi::CStr::from_ptr(name) }.to_string_lossy();
    let ours = glmflash_kernels::SOURCES
        .iter()
        .any(|(_, _, kernels)| kernels.contains(&name.as_ref()));
    if !ours {
        return Ok(false);
    }
    // SAFETY: plain data (ports and type).
    let mut edge: sys::CUgraphEdgeData = unsafe { std::mem::zeroed() };
    edge.from_port = sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8;
    edge.type_ = Dep::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8;
    let set = sys::CUstreamUpdateCaptureDependencies_flags::CU_STREAM_SET_CAPTURE_DEPENDENCIES;
    ok(unsafe {
        sys::cuStreamUpdateCaptureDependencies_v2(stream, &mut node, &edge, 1, set as u32)
    })?;
    Ok(true)
}

impl Cuda {
    /// Before each of glmflash's kernels is launched ([`Cuda::kernel`]): under PDL, while
    /// capturing, its dependency on the kernel before it made programmatic
    /// ([`programmatic_dependency`]). A refusal leaves the edge plain and is counted.
    pub(super) fn before_launch(&self) {
        if !self.capturing() || !pdl() {
            return;
        }
        // SAFETY: the compute stream of this handle's context, bound by the caller's launch.
        match unsafe { programmatic_dependency(self.stream.cu_stream()) } {
            Ok(true) => self.settings.programmatic[0].fetch_add(1, Relaxed),
            Ok(false) => 0,
            Err(e) => {
                tracing::debug!(error = ?e, "a programmatic edge refused; the edge stays plain");
                self.settings.programmatic[1].fetch_add(1, Relaxed)
            }
        };
    }
}
