//! The tiers' two background threads: the write-back writer (moves down a tier, taken off
//! the bounded ring) and the layer-ahead prefetcher (reads into the staging map).

use super::*;

/// Whether a tier admits a candidate, and what it evicted to make room.
pub(super) enum Room {
    Free,
    Evicted(Pinned),
    Refused,
}

/// Makes room in the RAM tier for `candidate` (evicting the policy's victim when full and
/// the candidate is worth it).
pub(super) fn make_room(
    ram: &mut HashMap<usize, Pinned>,
    policy: &dyn Policy,
    slots: usize,
    candidate: usize,
) -> Room {
    if slots == 0 {
        return Room::Refused;
    }
    if ram.len() < slots {
        return Room::Free;
    }
    let resident: Vec<usize> = ram.keys().copied().collect();
    match policy.victim(&resident) {
        Some(v) if policy.admit(candidate, v) => {
            Room::Evicted(ram.remove(&v).expect("victim is resident"))
        }
        _ => Room::Refused,
    }
}

/// Reads one record from the source, counting it and timing it.
pub(super) fn timed_load(
    source: &dyn ExpertSource,
    stats: &TierStats,
    layer: usize,
    expert: usize,
) -> anyhow::Result<SwiGlu> {
    let started = std::time::Instant::now();
    match source.load(layer, expert) {
        Ok(w) => {
            stats.store_read_latency.observe(started.elapsed());
            stats.store_reads.fetch_add(1, Ordering::Relaxed);
            Ok(w)
        }
        Err(e) => {
            stats.store_read_errors.fetch_add(1, Ordering::Relaxed);
            Err(e)
        }
    }
}

/// One write-back job, on the writer thread (or inline once the ring is closed).
pub(super) fn handle_write_back(shared: &Shared, job: WriteBack) {
    match job {
        WriteBack::Demote { layer, expert } => {
            // Copied into a slot of the pinned arena first, outside the layer's lock (the
            // victim stays in flight, served from where it is, meanwhile).
            let moved = shared.arena.as_ref().and_then(|arena| {
                let w = shared.layers[layer]
                    .lock()
                    .expect("tier lock")
                    .in_flight
                    .get(&expert)
                    .cloned()?;
                arena.adopt(&w).map(Arc::new)
            });
            let evicted = {
                let mut l = shared.layers[layer].lock().expect("tier lock");
                let Some(w) = l.in_flight.remove(&expert) else {
                    return;
                };
                let w = moved.unwrap_or(w);
                shared.stats.written_back.fetch_add(1, Ordering::Relaxed);
                let l = &mut *l;
                match make_room(&mut l.ram, l.ram_policy.as_ref(), shared.ram_slots, expert) {
                    Room::Refused => None,
                    room => {
                        l.ram.insert(expert, Pinned::new(w, &shared.pins));
                        match room {
                            Room::Evicted(v) => Some(v),
                            _ => None,
                        }
                    }
                }
            };
            // Unpinned and freed outside the lock.
            drop(evicted);
        }
        WriteBack::Release(pinned) => drop(pinned),
    }
}

/// The write-back thread: handles the ring until it is closed and drained.
pub(super) fn spawn_writer(
    shared: Arc<Shared>,
    ring: Arc<Ring<WriteBack>>,
) -> std::thread::JoinHandle<()> {
    std::thread::Builder::new()
        .name("expert-writeback".into())
        .spawn(move || {
            while let Some(job) = ring.pop() {
                handle_write_back(&shared, job);
                ring.done();
            }
        })
        .expect("spawning the write-back thread")
}

/// The background reader behind layer-ahead prefetch: loads queued (layer, expert) records
/// into the staging map, which lookups consume; it ends when the sender is dropped.
pub(super) fn spawn_prefetcher(
    source: Arc<dyn ExpertSource>,
    staged: Arc<Staging>,
    stats: Arc<TierStats>,
) -> (
    std::sync::mpsc::Sender<(usize, usize)>,
    std::thread::JoinHandle<()>,
) {
    let (tx, rx) = std::sync::mpsc::channel::<(usize, usize)>();
    let thread = std::thread::Builder::new()
        .name("expert-prefetch".into())
        .spawn(move || {
            for key in rx {
                if staged.lock().expect("staging lock").contains_key(&key) {
                    continue;
                }
                match timed_load(source.as_ref(), &stats, key.0, key.1) {
                    Ok(w) => {
                        staged.lock().expect("staging lock").insert(key, Arc::new(w));
                    }
                    Err(e) => {
                        // The lookup will read (and report) it itself.
                        stats.prefetch_wasted.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(layer = key.0, expert = key.1, error = %e, "prefetch read failed");
                    }
                }
            }
        })
        .expect("spawning the prefetch thread");
    (tx, thread)
}

/// `experts` of `layer` read from `source` in one batch (at queue depth, decoded in
/// parallel), in order; the first failure fails the batch.
pub(super) fn load_batch(
    source: &dyn ExpertSource,
    stats: &TierStats,
    layer: usize,
    experts: &[usize],
) -> anyhow::Result<Vec<Arc<SwiGlu>>> {
    let keys: Vec<(usize, usize)> = experts.iter().map(|&e| (layer, e)).collect();
    let started = std::time::Instant::now();
    let results = source.load_many(&keys);
    // The reads overlap: the batch's wait is split over its records, so the latency
    // histogram sums to the time lookups spent on the store (its rate is the effective one).
    let waited = started.elapsed() / keys.len().max(1) as u32;
    let mut out = Vec::with_capacity(keys.len());
    for r in results {
        match r {
            Ok(w) => {
                stats.store_read_latency.observe(waited);
                stats.store_reads.fetch_add(1, Ordering::Relaxed);
                out.push(Arc::new(w));
            }
            Err(err) => {
                stats.store_read_errors.fetch_add(1, Ordering::Relaxed);
                return Err(err);
            }
        }
    }
    Ok(out)
}
