//! Pinning the RAM tier: each RAM-resident expert's weight bytes are `mlock`ed while it is
//! resident and unlocked when it leaves the tier, so the kernel never pages the tier out (and,
//! with CUDA, so host-to-device copies can come straight from it).
//!
//! With a GPU the tier registers the buffers with CUDA instead ([`HostRegistrar`]): the
//! driver page-locks them and maps them for DMA, so host-to-device copies of RAM residents
//! need no bounce buffer and run asynchronously. Where registration is refused, mlock is used.
//!
//! Pinning is best effort: when RLIMIT_MEMLOCK (or a missing CAP_IPC_LOCK) refuses it, the
//! expert stays resident unpinned, the failure is counted and one warning says what to change.

#![allow(unsafe_code)]

use crate::model::mlp::SwiGlu;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Page-locks host buffers for a device's DMA (CUDA host registration).
pub trait HostRegistrar: Send + Sync {
    /// Registers every span, or none (returns false).
    fn register(&self, spans: &[(usize, usize)]) -> bool;
    /// The spans' owner is leaving the RAM tier: unregister them once no copy from them can
    /// be in flight, keeping `owner` (and so the memory) alive until then.
    fn release(&self, spans: Vec<(usize, usize)>, owner: Arc<SwiGlu>);
    /// Unregisters spans registered with `register` whose memory is about to be freed, once
    /// no copy from them can be in flight (waiting for the device when it must).
    fn unregister(&self, spans: &[(usize, usize)]);
}

/// Pinned bytes now, and refusals so far.
#[derive(Default)]
pub struct PinStats {
    pub pinned_bytes: AtomicU64,
    /// Of `pinned_bytes`, those registered with the GPU.
    pub registered_bytes: AtomicU64,
    pub failures: AtomicU64,
    warned: AtomicBool,
    /// Pinning turned off (`--no-pin`): nothing is locked, nothing is counted as failed.
    pub disabled: AtomicBool,
    registrar: std::sync::OnceLock<Arc<dyn HostRegistrar>>,
    /// The pinned arena's fallback counter, once there is an arena.
    arena: std::sync::OnceLock<Arc<AtomicU64>>,
}

impl std::fmt::Debug for PinStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinStats")
            .field("pinned_bytes", &self.pinned_bytes)
            .field("registered_bytes", &self.registered_bytes)
            .field("failures", &self.failures)
            .finish()
    }
}

impl PinStats {
    pub fn pinned(&self) -> u64 {
        self.pinned_bytes.load(Ordering::Relaxed)
    }

    /// From now on residents are registered with `registrar` (once; later calls are ignored).
    pub fn set_registrar(&self, registrar: Arc<dyn HostRegistrar>) {
        let _ = self.registrar.set(registrar);
    }

    /// Counts the pinned arena's memory (once, as it is pinned; its residents add nothing).
    pub fn count_arena(&self, arena: &super::arena::RamArena, how: super::arena::ArenaPin) {
        use super::arena::ArenaPin;
        let bytes = arena.bytes() as u64;
        if how != ArenaPin::None {
            self.pinned_bytes.fetch_add(bytes, Ordering::Relaxed);
        }
        if how == ArenaPin::Registered {
            self.registered_bytes.fetch_add(bytes, Ordering::Relaxed);
        }
        let _ = self.arena.set(arena.fallbacks_counter());
    }

    /// Experts kept outside the arena (no free slot): pinned one by one as before.
    pub fn arena_fallbacks(&self) -> u64 {
        self.arena.get().map_or(0, |c| c.load(Ordering::Relaxed))
    }
}

/// A RAM-tier resident: the expert's weights, locked in memory while this lives.
pub struct Pinned {
    weights: Arc<SwiGlu>,
    locked: Vec<(usize, usize)>,
    /// Whether `locked` was registered with the GPU rather than mlocked.
    registered: bool,
    /// The weights are in a slot of the pinned arena ([`super::arena`]): pinned already.
    in_arena: bool,
    stats: Arc<PinStats>,
}

impl Pinned {
    /// Locks the expert's weight bytes (each of its three buffers): nothing to do when they
    /// are in a slot of the pinned arena; else registered with the GPU when there is a
    /// registrar, else mlocked; on refusal keeps it unpinned.
    pub fn new(weights: Arc<SwiGlu>, stats: &Arc<PinStats>) -> Pinned {
        let in_arena = [&weights.gate, &weights.up, &weights.down]
            .iter()
            .all(|m| m.storage().is_some_and(|b| b.pinned_backing()));
        if in_arena {
            return Pinned {
                weights,
                locked: Vec::new(),
                registered: false,
                in_arena: true,
                stats: stats.clone(),
            };
        }
        let mut locked = Vec::with_capacity(3);
        let spans: Vec<(usize, usize)> = weights
            .storage_spans()
            .iter()
            .filter(|s| s.1 > 0)
            .map(|&(p, l)| (p as usize, l))
            .collect();
        if !stats.disabled.load(Ordering::Relaxed)
            && let Some(r) = stats.registrar.get()
            && r.register(&spans)
        {
            let bytes: usize = spans.iter().map(|s| s.1).sum();
            stats
                .pinned_bytes
                .fetch_add(bytes as u64, Ordering::Relaxed);
            stats
                .registered_bytes
                .fetch_add(bytes as u64, Ordering::Relaxed);
            return Pinned {
                weights,
                locked: spans,
                registered: true,
                in_arena: false,
                stats: stats.clone(),
            };
        }
        if !stats.disabled.load(Ordering::Relaxed) {
            for (ptr, len) in weights.storage_spans() {
                if len == 0 {
                    continue;
                }
                // SAFETY: `ptr..ptr+len` is one live allocation owned by `weights`, which this
                // value keeps alive until `drop` unlocks the same range; mlock only changes the
                // pages' residency, never their contents.
                match unsafe { libc::mlock(ptr.cast(), len) } {
                    0 => locked.push((ptr as usize, len)),
                    _ => {
                        let err = std::io::Error::last_os_error();
                        stats.failures.fetch_add(1, Ordering::Relaxed);
                        if !stats.warned.swap(true, Ordering::Relaxed) {
                            let soft =
                                rustix::process::getrlimit(rustix::process::Resource::Memlock)
                                    .current;
                            tracing::warn!(
                                error = %err,
                                memlock_limit_kib = soft.map(|b| b >> 10),
                                pinned_mib = stats.pinned() >> 20,
                                "cannot pin the RAM tier's experts (mlock refused); serving continues \
                                 unpinned. Raise the limit: `ulimit -l unlimited`, docker `--ulimit \
                                 memlock=-1`, or in Kubernetes add the IPC_LOCK capability"
                            );
                        }
                        break;
                    }
                }
            }
        }
        let bytes: usize = locked.iter().map(|l| l.1).sum();
        stats
            .pinned_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
        Pinned {
            weights,
            locked,
            registered: false,
            in_arena: false,
            stats: stats.clone(),
        }
    }

    pub fn weights(&self) -> &Arc<SwiGlu> {
        &self.weights
    }

    /// Whether the weights are in a slot of the pinned arena.
    pub fn in_arena(&self) -> bool {
        self.in_arena
    }

    /// Whether every buffer of the expert is locked.
    pub fn is_pinned(&self) -> bool {
        self.in_arena || self.locked.len() == 3
    }

    /// Unlocks and hands back the weights (the expert leaves the RAM tier).
    pub fn into_weights(self) -> Arc<SwiGlu> {
        self.weights.clone()
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let bytes: usize = self.locked.iter().map(|l| l.1).sum();
        self.stats
            .pinned_bytes
            .fetch_sub(bytes as u64, Ordering::Relaxed);
        if self.registered {
            self.stats
                .registered_bytes
                .fetch_sub(bytes as u64, Ordering::Relaxed);
            if let Some(r) = self.stats.registrar.get() {
                r.release(std::mem::take(&mut self.locked), self.weights.clone());
            }
            return;
        }
        for &(ptr, len) in &self.locked {
            // SAFETY: the range was locked by `new` and `self.weights` still owns it. A page
            // shared with another pinned buffer is unlocked too (mlock does not nest); the
            // experts' buffers are megabytes, so at most their edge pages are affected.
            unsafe { libc::munlock(ptr as *const libc::c_void, len) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::Matrix;

    fn expert(rows: usize, cols: usize) -> Arc<SwiGlu> {
        let m = || Matrix::from_f32(rows, cols, vec![0.5; rows * cols]);
        Arc::new(SwiGlu {
            gate: m(),
            up: m(),
            down: m(),
            limit: f32::INFINITY,
        })
    }

    /// mlock really locks: VmLck of this process grows by the expert's pages and shrinks back.
    #[test]
    fn pins_and_unpins_real_pages() {
        let stats = Arc::new(PinStats::default());
        let w = expert(64, 1024); // 3 x 256 KiB, under the common 8 MiB default limit
        let before = vm_locked_kib();
        let pinned = Pinned::new(w.clone(), &stats);
        if stats.failures.load(Ordering::Relaxed) > 0 {
            // A limit of zero (or no mlock at all): refused cleanly, nothing counted as pinned.
            assert_eq!(stats.pinned(), 0);
            return;
        }
        assert!(pinned.is_pinned());
        assert_eq!(stats.pinned(), 3 * 64 * 1024 * 4);
        let during = vm_locked_kib();
        assert!(during >= before + 3 * 256, "VmLck {before} -> {during} KiB");
        let back = pinned.into_weights();
        assert!(Arc::ptr_eq(&back, &w));
        assert_eq!(stats.pinned(), 0);
        assert!(vm_locked_kib() + 3 * 256 <= during);
    }

    #[test]
    fn refused_pinning_keeps_serving_and_counts() {
        let stats = Arc::new(PinStats::default());
        // Far over any default RLIMIT_MEMLOCK: 3 x 64 MiB.
        let w = expert(4096, 4096);
        let soft = rustix::process::getrlimit(rustix::process::Resource::Memlock).current;
        let pinned = Pinned::new(w, &stats);
        // CAP_IPC_LOCK (e.g. root) lifts the limit.
        if soft.is_some_and(|l| l < 64 << 20) && !crate::tiers::sizing::has_ipc_lock() {
            assert!(!pinned.is_pinned());
            assert!(stats.failures.load(Ordering::Relaxed) >= 1);
        } else {
            assert!(pinned.is_pinned());
            assert_eq!(stats.pinned(), 3 * 4096 * 4096 * 4);
        }
        drop(pinned);
        assert_eq!(stats.pinned(), 0);
    }

    fn vm_locked_kib() -> u64 {
        std::fs::read_to_string("/proc/self/status")
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("VmLck:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap()
    }
}
