//! Work on the compute stream captured once and replayed as one graph launch (issue 17 item
//! 1: a decode step is ~300 small launches, and on many hosts queueing them, not the device,
//! sets the step's time). While capturing, nothing may wait for the device or copy from
//! pageable host memory ([`Cuda::upload`] and the downloads refuse); values that change from
//! one replay to the next come from device memory the host writes before each launch.

use super::{Cuda, CudaError};
use cudarc::driver::sys::{self, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice, DevicePtr, PinnedHostSlice};
use std::sync::atomic::Ordering::Relaxed;

/// A captured graph and the page-locked host buffer its last copy writes (the step's output).
pub struct StepGraph {
    graph: CudaGraph,
    out: PinnedHostSlice<f32>,
    /// Values of `out` the graph writes.
    out_len: usize,
}

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

    /// Sets every 32-bit word of `buf` to `bits`, on the compute stream (capturable).
    pub fn fill_bits<T>(&self, buf: &mut CudaSlice<T>, bits: u32) -> Result<(), CudaError> {
        let words = buf.num_bytes() / 4;
        let (ptr, _record) = buf.device_ptr(&self.stream);
        // SAFETY: the buffer holds `words` whole 32-bit words from `ptr`, and lives until the
        // stream has run the memset (a buffer is freed on its stream, after it).
        unsafe { sys::cuMemsetD32Async(ptr, bits, words, self.stream.cu_stream()) }.result()?;
        Ok(())
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
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        self.settings.capturing.store(true, Relaxed);
        let captured = run().and_then(|dev| {
            if dev.len() != out_len {
                anyhow::bail!("a captured output of {} values, {out_len} expected", dev.len());
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
        captured?;
        left?;
        let graph = graph?.ok_or_else(|| anyhow::anyhow!("the stream capture made no graph"))?;
        Ok(StepGraph {
            graph,
            out,
            out_len,
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
