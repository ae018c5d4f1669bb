//! The operator's own metrics (not the server's contract, see [`glmflash_metric_names`]).

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

/// Counters and timings of the reconcile loop.
pub struct Metrics {
    /// The registry `/metrics` serves.
    pub registry: Registry,
    /// Reconciles started.
    pub reconciliations: IntCounter,
    /// Failed reconciles by [`crate::Error::metric_label`].
    pub failures: IntCounterVec,
    /// Reconcile duration.
    pub duration: Histogram,
    /// 1 while this replica holds the leader Lease.
    pub leader: IntGauge,
}

impl Default for Metrics {
    fn default() -> Self {
        let registry = Registry::new();
        let reconciliations = IntCounter::new(
            "glmflash_operator_reconciliations_total",
            "Reconciles started.",
        )
        .expect("valid metric");
        let failures = IntCounterVec::new(
            Opts::new(
                "glmflash_operator_reconcile_errors_total",
                "Failed reconciles by error kind.",
            ),
            &["error"],
        )
        .expect("valid metric");
        let duration = Histogram::with_opts(
            HistogramOpts::new(
                "glmflash_operator_reconcile_duration_seconds",
                "Reconcile duration.",
            )
            .buckets(vec![0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]),
        )
        .expect("valid metric");
        let leader = IntGauge::new(
            "glmflash_operator_leader",
            "1 while this replica holds the leader Lease.",
        )
        .expect("valid metric");
        for collector in [
            Box::new(reconciliations.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(failures.clone()),
            Box::new(duration.clone()),
            Box::new(leader.clone()),
        ] {
            registry.register(collector).expect("names are unique");
        }
        // Every error kind starts at 0, so rate() alerts see the series before the first error.
        for label in crate::Error::METRIC_LABELS {
            failures.with_label_values(&[label]);
        }
        Self {
            registry,
            reconciliations,
            failures,
            duration,
            leader,
        }
    }
}

impl Metrics {
    /// The registry in the Prometheus text format.
    pub fn render(&self) -> String {
        prometheus::TextEncoder::new()
            .encode_to_string(&self.registry.gather())
            .expect("text encoding of valid metrics")
    }
}
