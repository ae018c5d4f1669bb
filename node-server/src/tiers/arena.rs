//! The RAM tier's pinned arena: the tier's memory allocated once, as fixed slots of one
//! expert each, and pinned once (registered with the GPU, or mlocked) when the tiers start.
//!
//! Without it each expert read from the store was pinned as the RAM tier admitted it and
//! unpinned as it left (`cuMemHostRegister` took ~1.7 ms for a 14 MB record, on the decode
//! step's thread; mlock ~0.65 ms), in a fresh heap buffer whose pages the kernel had to map
//! and zero first. Now an expert the source decodes is copied into a free slot on the thread
//! that decoded it ([`ArenaSource`]), its matrices then borrow the slot
//! ([`crate::quant::Bytes::Shared`]), and the slot is free again once the last of them drops.
//! A slot's memory is never unpinned while the tiers live.
//!
//! With a GPU, a registered slot may still be the source of an asynchronous host-to-device
//! copy when its expert drops: its slot then waits in `released` until the GPU tier has
//! synchronised its streams ([`RamArena::take_released`], [`RamArena::give_back`]).
//!
//! When no slot is free (more records in flight than the arena's spare slots) or an expert
//! is larger than a slot, the expert stays in its own buffer and is pinned on its own as
//! before ([`super::pin::Pinned`]); `fallbacks` counts those.
#![allow(unsafe_code)] // the slots' raw memory; each block says why it holds

use super::pin::HostRegistrar;
use super::source::ExpertSource;
use crate::model::mlp::SwiGlu;
use crate::quant::{Backing, Bytes};
use crate::store::{ALIGN, AlignedBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Bytes of one chunk of the arena (pinned as one registration or mlock).
const CHUNK_BYTES: usize = 1 << 30;

/// Slots beyond the tiers' residents: the records read but not yet admitted (a decode step's
/// misses, four streams of eight picks), and the dropped slots waiting for the GPU.
pub const IN_FLIGHT_SLOTS: usize = 32;

fn align_up(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

/// How the arena's memory is held in RAM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArenaPin {
    /// Registered with the GPU (page-locked and mapped for DMA).
    Registered,
    Mlocked,
    /// Not pinned (refused, or pinning turned off).
    None,
}

pub struct RamArena {
    chunks: Vec<AlignedBuf>,
    /// Each chunk's start, taken while the arena owned it alone (slots are written through
    /// these, never through a shared borrow of the chunk).
    bases: Vec<std::ptr::NonNull<u8>>,
    slot_len: usize,
    per_chunk: usize,
    count: usize,
    free: Mutex<Vec<usize>>,
    /// Slots whose expert dropped while a GPU copy from them may still be in flight.
    released: Mutex<Vec<usize>>,
    /// Dropped slots wait in `released` (a GPU reads the arena asynchronously).
    deferred: AtomicBool,
    pinned: AtomicBool,
    /// The registrar that holds the arena registered (unregistered when the arena drops).
    registrar: std::sync::OnceLock<Arc<dyn HostRegistrar>>,
    /// Experts kept in buffers of their own (no free slot, or larger than a slot).
    pub fallbacks: Arc<AtomicU64>,
}

// SAFETY: the chunks are owned like `AlignedBuf`s (which are Send and Sync); `bases` only
// point into them, and a slot's memory is written by the one `SlotWriter` that leased it, then
// only read until the slot is free again.
unsafe impl Send for RamArena {}
// SAFETY: as above; the free and released lists are behind mutexes.
unsafe impl Sync for RamArena {}

impl std::fmt::Debug for RamArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "RamArena({} slots of {} bytes)",
            self.count, self.slot_len
        )
    }
}

impl RamArena {
    /// `count` slots of at least `slot_len` bytes (allocated, not yet touched or pinned).
    pub fn new(slot_len: usize, count: usize) -> Arc<RamArena> {
        let slot_len = align_up(slot_len.max(1));
        let per_chunk = (CHUNK_BYTES / slot_len).max(1);
        let mut chunks: Vec<AlignedBuf> = (0..count.div_ceil(per_chunk))
            .map(|c| AlignedBuf::new(slot_len * per_chunk.min(count - c * per_chunk)))
            .collect();
        let bases = chunks
            .iter_mut()
            .map(|c| std::ptr::NonNull::new(c.as_mut_ptr()).expect("an allocation"))
            .collect();
        Arc::new(RamArena {
            chunks,
            bases,
            slot_len,
            per_chunk,
            count,
            free: Mutex::new((0..count).rev().collect()),
            released: Mutex::new(Vec::new()),
            deferred: AtomicBool::new(false),
            pinned: AtomicBool::new(false),
            registrar: std::sync::OnceLock::new(),
            fallbacks: Default::default(),
        })
    }

    /// The slots' bytes in all.
    pub fn bytes(&self) -> usize {
        self.chunks.iter().map(AlignedBuf::len).sum()
    }

    /// The arena of `slots` slots of `slot_len` bytes for the tiers, pinned: registered with
    /// the GPU tier's `registrar` (which then frees its dropped slots as it drains), else
    /// mlocked; counted in `pins`.
    pub fn start(
        slot_len: usize,
        slots: usize,
        registrar: Option<&Arc<super::vram::CudaRegistrar>>,
        pins: &super::pin::PinStats,
    ) -> Arc<RamArena> {
        let arena = RamArena::new(slot_len, slots);
        let registrar = registrar.map(|r| {
            r.set_arena(&arena);
            r.clone() as Arc<dyn HostRegistrar>
        });
        let how = arena.pin(registrar);
        pins.count_arena(&arena, how);
        arena
    }

    /// The counter of experts kept outside the arena.
    pub fn fallbacks_counter(&self) -> Arc<AtomicU64> {
        self.fallbacks.clone()
    }

    pub fn slot_len(&self) -> usize {
        self.slot_len
    }

    pub fn slots(&self) -> usize {
        self.count
    }

    /// Slots free now.
    pub fn free_slots(&self) -> usize {
        self.free.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Maps every page (on all cores), then pins the arena: registered with `registrar` when
    /// given (dropped slots then wait for [`RamArena::give_back`]), else mlocked; on refusal
    /// it stays unpinned and says so.
    pub fn pin(&self, registrar: Option<Arc<dyn HostRegistrar>>) -> ArenaPin {
        use rayon::prelude::*;
        let started = std::time::Instant::now();
        let spans: Vec<(usize, usize)> = self
            .chunks
            .iter()
            .map(|c| (c.as_slice().as_ptr() as usize, c.len()))
            .collect();
        let bases: Vec<(usize, usize)> = self
            .bases
            .iter()
            .zip(&self.chunks)
            .map(|(b, c)| (b.as_ptr() as usize, c.len()))
            .collect();
        bases.par_iter().for_each(|&(base, len)| {
            for page in (0..len).step_by(4096) {
                // SAFETY: inside the chunk's live allocation (through the pointer taken when
                // the arena owned it alone), which nothing else uses yet; a volatile write of
                // the zero already there maps the page.
                unsafe { std::ptr::write_volatile((base + page) as *mut u8, 0) };
            }
        });
        let how = if let Some(r) = registrar {
            self.deferred.store(true, Ordering::Relaxed);
            let mut done = Vec::new();
            for s in &spans {
                if !r.register(std::slice::from_ref(s)) {
                    r.unregister(&done);
                    done.clear();
                    break;
                }
                done.push(*s);
            }
            if done.is_empty() {
                ArenaPin::None
            } else {
                let _ = self.registrar.set(r);
                ArenaPin::Registered
            }
        } else {
            // SAFETY: each span is a live chunk this arena owns until it drops, which unlocks.
            let done = spans
                .iter()
                .take_while(|&&(p, l)| unsafe { libc::mlock(p as *const libc::c_void, l) } == 0)
                .count();
            let locked = done == spans.len();
            if !locked {
                let err = std::io::Error::last_os_error();
                for &(p, l) in &spans[..done] {
                    // SAFETY: locked just above; all or nothing.
                    unsafe { libc::munlock(p as *const libc::c_void, l) };
                }
                tracing::warn!(
                    error = %err,
                    "cannot mlock the RAM tier's arena; it stays unpinned. Raise the limit: \
                     `ulimit -l unlimited`, docker `--ulimit memlock=-1`, or in Kubernetes add \
                     the IPC_LOCK capability"
                );
            }
            if locked {
                ArenaPin::Mlocked
            } else {
                ArenaPin::None
            }
        };
        self.pinned.store(how != ArenaPin::None, Ordering::Relaxed);
        tracing::info!(
            mib = self.bytes() >> 20,
            slots = self.count,
            slot_mib = self.slot_len as f64 / (1 << 20) as f64,
            pinned = ?how,
            seconds = started.elapsed().as_secs_f64(),
            "the RAM tier's arena is mapped and pinned"
        );
        how
    }

    /// A free slot for an expert whose three matrices take `lens` bytes (each region from a
    /// page of its own), to write them into; `None` (counted) when no slot is free or they do
    /// not fit one.
    pub fn lease(self: &Arc<Self>, lens: [usize; 3]) -> Option<SlotWriter> {
        let fallback = || {
            self.fallbacks.fetch_add(1, Ordering::Relaxed);
            None
        };
        if lens.iter().map(|&l| align_up(l)).sum::<usize>() > self.slot_len {
            return fallback();
        }
        let Some(index) = self.free.lock().unwrap_or_else(|e| e.into_inner()).pop() else {
            return fallback();
        };
        let mut offsets = [0usize; 3];
        for i in 1..3 {
            offsets[i] = offsets[i - 1] + align_up(lens[i - 1]);
        }
        Some(SlotWriter {
            slot: Slot {
                arena: self.clone(),
                index,
            },
            offsets,
            lens,
        })
    }

    /// `w` with its three matrices' bytes copied into a free slot (the matrices then read
    /// them there); `None` when no slot is free, `w` does not fit one, or a matrix has no
    /// byte storage (f32 values).
    pub fn adopt(self: &Arc<Self>, w: &SwiGlu) -> Option<SwiGlu> {
        let stored = [&w.gate, &w.up, &w.down].map(|m| m.storage());
        if stored.iter().any(Option::is_none) {
            return None;
        }
        let mut slot = self.lease(stored.map(|b| b.map_or(0, |b| b.len())))?;
        for (i, src) in stored.iter().enumerate() {
            slot.region(i).copy_from_slice(src.expect("checked above"));
        }
        let [gate, up, down] = slot.finish();
        Some(SwiGlu {
            gate: w.gate.with_storage(gate),
            up: w.up.with_storage(up),
            down: w.down.with_storage(down),
            limit: w.limit,
        })
    }

    /// `w` moved into a slot when one takes it, else `w` itself.
    pub fn adopt_owned(self: &Arc<Self>, w: SwiGlu) -> SwiGlu {
        self.adopt(&w).unwrap_or(w)
    }

    /// The slots dropped so far that may still be read by a GPU copy: once the caller has
    /// synchronised every stream that copies from the arena, [`RamArena::give_back`] frees
    /// them (a slot dropped after this call waits for the next round).
    pub fn take_released(&self) -> Vec<usize> {
        std::mem::take(&mut *self.released.lock().unwrap_or_else(|e| e.into_inner()))
    }

    pub fn give_back(&self, slots: Vec<usize>) {
        self.free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(slots);
    }

    fn slot_ptr(&self, index: usize) -> *mut u8 {
        let base = self.bases[index / self.per_chunk];
        // SAFETY: `index % per_chunk` slots of `slot_len` fit the chunk (sized so in `new`).
        unsafe { base.as_ptr().add((index % self.per_chunk) * self.slot_len) }
    }
}

impl Drop for RamArena {
    fn drop(&mut self) {
        let spans: Vec<(usize, usize)> = self
            .chunks
            .iter()
            .map(|c| (c.as_slice().as_ptr() as usize, c.len()))
            .collect();
        if let Some(r) = self.registrar.get() {
            // Before the chunks' memory is freed (the registrar waits for the GPU first).
            r.unregister(&spans);
        } else if self.pinned.load(Ordering::Relaxed) {
            for (p, l) in spans {
                // SAFETY: locked in `pin`, still allocated (the chunks drop after this).
                unsafe { libc::munlock(p as *const libc::c_void, l) };
            }
        }
    }
}

/// One slot of the arena, shared by the three matrices of the expert in it.
struct Slot {
    arena: Arc<RamArena>,
    index: usize,
}

impl Slot {
    fn ptr(&self) -> *mut u8 {
        self.arena.slot_ptr(self.index)
    }
}

impl Backing for Slot {
    fn bytes(&self) -> &[u8] {
        // SAFETY: the slot's memory lives as long as the arena this holds; after `adopt`
        // wrote it, it is only read until the slot drops.
        unsafe { std::slice::from_raw_parts(self.ptr(), self.arena.slot_len) }
    }

    fn pinned(&self) -> bool {
        self.arena.pinned.load(Ordering::Relaxed)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let list = if self.arena.deferred.load(Ordering::Relaxed) {
            &self.arena.released
        } else {
            &self.arena.free
        };
        list.lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(self.index);
    }
}

/// A leased slot being written: three regions, each a matrix's bytes; [`SlotWriter::finish`]
/// shares them (dropped unfinished, the slot goes back).
pub struct SlotWriter {
    slot: Slot,
    offsets: [usize; 3],
    lens: [usize; 3],
}

impl SlotWriter {
    /// Region `i` (0 gate, 1 up, 2 down) to write.
    pub fn region(&mut self, i: usize) -> &mut [u8] {
        // SAFETY: the regions lie inside the slot (their lengths were checked against
        // `slot_len` at the lease) and apart; this writer owns the slot alone, and the
        // `&mut self` borrow keeps the region exclusive.
        unsafe {
            std::slice::from_raw_parts_mut(self.slot.ptr().add(self.offsets[i]), self.lens[i])
        }
    }

    /// The three regions' bytes, sharing the slot (free again when the last of them drops).
    pub fn finish(self) -> [Bytes; 3] {
        let backing: Arc<dyn Backing> = Arc::new(self.slot);
        [0, 1, 2].map(|i| Bytes::shared(backing.clone(), self.offsets[i], self.lens[i]))
    }
}

/// A source whose experts arrive in arena slots: each is moved there on the thread that
/// read and decoded it (the fetch pool's, for a forward's misses).
pub struct ArenaSource {
    pub inner: Arc<dyn ExpertSource>,
    pub arena: Arc<RamArena>,
}

impl ExpertSource for ArenaSource {
    fn load(&self, layer: usize, expert: usize) -> anyhow::Result<SwiGlu> {
        Ok(self.arena.adopt_owned(self.inner.load(layer, expert)?))
    }

    fn load_many(&self, keys: &[(usize, usize)]) -> Vec<anyhow::Result<SwiGlu>> {
        use rayon::prelude::*;
        self.inner
            .load_many(keys)
            .into_par_iter()
            .map(|r| r.map(|w| self.arena.adopt_owned(w)))
            .collect()
    }

    fn load_each(
        &self,
        keys: &[(usize, usize)],
        deliver: &(dyn Fn(usize, anyhow::Result<SwiGlu>) + Sync),
    ) {
        self.inner.load_each(keys, &|i, r| {
            deliver(i, r.map(|w| self.arena.adopt_owned(w)));
        });
    }

    fn record_bytes(&self) -> usize {
        self.inner.record_bytes()
    }

    fn slot_bytes(&self) -> Option<usize> {
        self.inner.slot_bytes()
    }
}

/// Bytes of a slot that holds `w` (its three matrices' bytes, each from a page of its own);
/// `None` when a matrix has no byte storage.
pub fn slot_len_of(w: &SwiGlu) -> Option<usize> {
    [&w.gate, &w.up, &w.down]
        .iter()
        .map(|m| m.storage().map(|b| align_up(b.len())))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::Matrix;
    use crate::quant::Format;

    fn expert(seed: u32, format: Format) -> SwiGlu {
        let m = |rows: usize, cols: usize, s: u32| {
            let v = (0..rows * cols)
                .map(|i| ((i as u32 ^ s).wrapping_mul(0x9E37_79B9) >> 20) as f32 / 4096.0 - 0.5)
                .collect();
            Matrix::from_f32(rows, cols, v).convert(format).unwrap()
        };
        SwiGlu {
            gate: m(256, 256, seed),
            up: m(256, 256, seed + 1),
            down: m(256, 256, seed + 2),
            limit: 7.0,
        }
    }

    /// An adopted expert computes the same bits from its slot, the slot is free again when
    /// the expert drops, and a full arena leaves experts in their own buffers.
    #[test]
    fn adopted_experts_compute_the_same_and_give_their_slot_back() {
        let sample = expert(1, Format::Q4K);
        let arena = RamArena::new(slot_len_of(&sample).unwrap(), 2);
        assert_eq!(
            arena.pin(None) == ArenaPin::None,
            !arena.pinned.load(Ordering::Relaxed)
        );
        let x: Vec<f32> = (0..256).map(|i| (i as f32 * 0.37).sin()).collect();
        let want = sample.forward(&x, 1);
        let a = arena.adopt_owned(expert(1, Format::Q4K));
        assert!(matches!(a.gate.storage(), Some(Bytes::Shared { .. })));
        assert_eq!(a.forward(&x, 1), want);
        assert_eq!(a.forward_lane(&x), sample.forward_lane(&x));
        let b = arena.adopt_owned(expert(2, Format::Q4K));
        assert_eq!(arena.free_slots(), 0);
        let c = arena.adopt_owned(expert(3, Format::Q4K));
        assert!(matches!(c.gate.storage(), Some(Bytes::Owned(_))));
        assert_eq!(arena.fallbacks.load(Ordering::Relaxed), 1);
        drop(a);
        assert_eq!(arena.free_slots(), 1);
        drop(b);
        assert_eq!(arena.free_slots(), 2);
        // f32 weights have no byte storage: left as they are, not counted as a fallback.
        let f = arena.adopt_owned(expert(4, Format::F32));
        assert!(f.gate.storage().is_none());
        assert_eq!(arena.free_slots(), 2);
    }

    /// With a GPU registrar, a dropped slot is free only once given back (after the streams
    /// that copy from it were synchronised).
    #[test]
    fn registered_slots_wait_for_give_back() {
        struct Accept(AtomicU64);
        impl HostRegistrar for Accept {
            fn register(&self, spans: &[(usize, usize)]) -> bool {
                self.0.fetch_add(spans.len() as u64, Ordering::Relaxed);
                true
            }
            fn release(&self, _: Vec<(usize, usize)>, _: Arc<SwiGlu>) {}
            fn unregister(&self, spans: &[(usize, usize)]) {
                self.0.fetch_sub(spans.len() as u64, Ordering::Relaxed);
            }
        }
        let sample = expert(1, Format::Bf16);
        let arena = RamArena::new(slot_len_of(&sample).unwrap(), 3);
        let registrar = Arc::new(Accept(AtomicU64::new(0)));
        assert_eq!(arena.pin(Some(registrar.clone())), ArenaPin::Registered);
        assert_eq!(registrar.0.load(Ordering::Relaxed), 1, "one chunk");
        let a = arena.adopt_owned(sample);
        assert!(a.gate.storage().unwrap().pinned_backing());
        drop(a);
        assert_eq!(arena.free_slots(), 2);
        let released = arena.take_released();
        assert_eq!(released.len(), 1);
        arena.give_back(released);
        assert_eq!(arena.free_slots(), 3);
        drop(arena);
        assert_eq!(
            registrar.0.load(Ordering::Relaxed),
            0,
            "unregistered as it dropped"
        );
    }
}
