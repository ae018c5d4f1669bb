//! What the GPU device reports of its time: the phase profile and the host's waits.

use super::*;

impl Gpu {
    /// The profile so far, (phase, seconds, times run), most time first; and resets it.
    /// Empty unless `GLMFLASH_GPU_PROFILE` was set when the device was made.
    pub fn take_profile(&self) -> Vec<(&'static str, f64, u64)> {
        let Some(profile) = &self.profile else {
            return Vec::new();
        };
        let p = std::mem::take(&mut *profile.lock().unwrap_or_else(|e| e.into_inner()));
        let mut v: Vec<_> = p.into_iter().map(|(k, (s, n))| (k, s, n)).collect();
        v.sort_by(|a, b| b.1.total_cmp(&a.1));
        v
    }

    /// Seconds spent in downloads since the last call (waiting for the device, and the copy).
    pub fn take_waited(&self) -> f64 {
        let ns = self.waited_ns.swap(0, std::sync::atomic::Ordering::Relaxed);
        ns as f64 * 1e-9
    }

    /// `copy` (a download: waiting for the device, then the copy), its time added to the
    /// waits [`Gpu::take_waited`] reports.
    pub(super) fn waited<T>(
        &self,
        copy: impl FnOnce() -> Result<T, crate::backend::cuda::CudaError>,
    ) -> anyhow::Result<T> {
        let started = std::time::Instant::now();
        let out = copy()?;
        let ns = started.elapsed().as_nanos() as u64;
        self.waited_ns
            .fetch_add(ns, std::sync::atomic::Ordering::Relaxed);
        Ok(out)
    }
}
