//! The tiers' counters: lookups, moves, prefetch outcomes and the time per part of a step
//! ([`TierStats`]), and the store read latency as fixed buckets of atomic counters, cheap
//! enough for every read (exported as the `glmflash_nvme_read_seconds` histogram).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::provider::Tier;

/// Lookup and movement counters (exported as metrics by the server).
#[derive(Debug, Default)]
pub struct TierStats {
    /// `[tier][phase]`, phase 0 = prefill, 1 = decode.
    pub lookups: [[AtomicU64; 2]; 3],
    pub loads: AtomicU64,
    pub promotions: AtomicU64,
    pub demotions: AtomicU64,
    pub bypassed: AtomicU64,
    /// Layer-ahead prefetch: reads issued, reads a lookup then used, reads never used.
    pub prefetch_issued: AtomicU64,
    pub prefetch_hits: AtomicU64,
    pub prefetch_wasted: AtomicU64,
    /// Records read from the source (lookups, prefetch and warm start), failed reads, and
    /// the time each read took.
    pub store_reads: AtomicU64,
    pub store_read_errors: AtomicU64,
    pub store_read_latency: ReadLatency,
    /// Device victims the write-back ring has moved into RAM.
    pub written_back: AtomicU64,
    /// Of the device victims, those read back from their VRAM slot (no host copy kept).
    pub copied_down: AtomicU64,
    /// Decode picks computed in place from RAM (the CPU lane).
    pub cpu_lane: AtomicU64,
    /// Nanoseconds `forward` spent per part, indexed by [`StepPart`].
    pub part_nanos: [AtomicU64; 4],
    /// Nanoseconds the fetch thread spent reading batches of misses (in the background of
    /// the products when they overlap: `fetch_busy` against the `fetch` part's waits shows
    /// how much of the reading the products hid).
    pub fetch_busy_nanos: AtomicU64,
}

/// The parts of one `TieredExperts::forward` call, in order.
#[derive(Clone, Copy, Debug)]
pub enum StepPart {
    /// Waiting for the call's store misses: for the whole batch before the products
    /// (`--no-fetch-overlap`), or, summed over the threads that waited, for each record a
    /// product needed and did not have yet (then inside `compute`'s time).
    Fetch,
    /// Lookups under the layer lock: residency, admission (pinning a RAM resident included).
    Resolve,
    /// Queueing the moves down (a full write-back ring blocks here).
    WriteBack,
    /// The products: device slot writes, staging and kernels, or the CPU.
    Compute,
}

impl StepPart {
    pub const ALL: [StepPart; 4] = [
        StepPart::Fetch,
        StepPart::Resolve,
        StepPart::WriteBack,
        StepPart::Compute,
    ];

    pub fn name(self) -> &'static str {
        match self {
            StepPart::Fetch => "fetch",
            StepPart::Resolve => "resolve",
            StepPart::WriteBack => "write_back",
            StepPart::Compute => "compute",
        }
    }
}

impl TierStats {
    /// Seconds `forward` has spent in `part` so far.
    pub fn part_seconds(&self, part: StepPart) -> f64 {
        self.part_nanos[part as usize].load(Ordering::Relaxed) as f64 * 1e-9
    }

    /// Seconds the fetch thread has spent reading batches of misses.
    pub fn fetch_busy_seconds(&self) -> f64 {
        self.fetch_busy_nanos.load(Ordering::Relaxed) as f64 * 1e-9
    }

    pub(super) fn add_part(&self, part: StepPart, since: std::time::Instant) -> std::time::Instant {
        let now = std::time::Instant::now();
        self.part_nanos[part as usize]
            .fetch_add((now - since).as_nanos() as u64, Ordering::Relaxed);
        now
    }

    pub fn lookups(&self, tier: Tier) -> u64 {
        self.lookups[tier as usize]
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum()
    }
}

/// Upper bounds (seconds) of the store read latency buckets: 50 µs (a page-cache hit) to
/// 1 s (a saturated or failing disk).
pub const READ_BUCKETS: [f64; 14] = [
    50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2e-3, 4e-3, 8e-3, 16e-3, 32e-3, 64e-3, 128e-3, 0.5, 1.0,
];

#[derive(Debug, Default)]
pub struct ReadLatency {
    /// Per bucket (not cumulative); the last slot counts reads above every bound.
    counts: [AtomicU64; READ_BUCKETS.len() + 1],
    total_ns: AtomicU64,
}

impl ReadLatency {
    pub fn observe(&self, took: Duration) {
        let s = took.as_secs_f64();
        let at = READ_BUCKETS
            .iter()
            .position(|&b| s <= b)
            .unwrap_or(READ_BUCKETS.len());
        self.counts[at].fetch_add(1, Ordering::Relaxed);
        self.total_ns
            .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Cumulative counts per bound (Prometheus `le` buckets), then the total count.
    pub fn cumulative(&self) -> (Vec<u64>, u64) {
        let mut running = 0;
        let mut out = Vec::with_capacity(READ_BUCKETS.len());
        for c in &self.counts[..READ_BUCKETS.len()] {
            running += c.load(Ordering::Relaxed);
            out.push(running);
        }
        (
            out,
            running + self.counts[READ_BUCKETS.len()].load(Ordering::Relaxed),
        )
    }

    pub fn total_seconds(&self) -> f64 {
        self.total_ns.load(Ordering::Relaxed) as f64 * 1e-9
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_cumulative() {
        let h = ReadLatency::default();
        h.observe(Duration::from_micros(10));
        h.observe(Duration::from_millis(3));
        h.observe(Duration::from_secs(2));
        let (cum, count) = h.cumulative();
        assert_eq!(count, 3);
        assert_eq!(cum[0], 1);
        assert_eq!(
            cum[READ_BUCKETS.iter().position(|&b| b == 4e-3).unwrap()],
            2
        );
        assert_eq!(*cum.last().unwrap(), 2);
        assert!((h.total_seconds() - 2.00301).abs() < 1e-6);
    }
}
