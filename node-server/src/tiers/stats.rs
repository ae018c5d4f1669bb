//! Store read latency as fixed buckets of atomic counters, cheap enough for every read; the
//! metrics registry exports it as the `glmflash_nvme_read_seconds` histogram.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

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
