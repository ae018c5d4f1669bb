//! The one metrics registry and every metric name (a contract: DESIGN.md "Metrics: one
//! contract"; the operator's dashboard and alert rules read the same names).
//!
//! Each metric is registered once, here, under a name from the shared contract crate
//! (`glmflash-metric-names`, re-exported below); the API and the engine update them through
//! [`Metrics`], and `/metrics` renders [`Metrics::render`].

use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry, TextEncoder,
};
use std::sync::{Arc, Mutex};

// The metric names: one contract crate, shared with the operator and its dashboards.
pub use glmflash_metric_names::*;

/// The tier metrics, exposed once a tiered model is attached ([`Metrics::attach_tiers`]).
pub const TIER_METRICS: [&str; 14] = [
    EXPERT_LOOKUPS_TOTAL,
    TIER_RESIDENT_EXPERTS,
    TIER_CAPACITY_EXPERTS,
    BYTES_MOVED_TOTAL,
    NVME_READ_SECONDS,
    NVME_READ_ERRORS_TOTAL,
    PREFETCH_TOTAL,
    CPU_LANE_EXPERTS_TOTAL,
    MEMORY_BYTES,
    PIN_FAILURES_TOTAL,
    GPU_H2D_BYTES_TOTAL,
    EXPERT_PRODUCTS_TOTAL,
    GPU_MOE_STEP_SECONDS,
    EXPERT_STEP_SECONDS_TOTAL,
];

/// The memory plan's metrics, exposed once a plan is set ([`Metrics::set_plan`]).
pub const PLAN_METRICS: [&str; 2] = [PLAN_EXPERT_SLOTS, PLAN_MEMORY_BYTES];

/// Every name this module defines for every server.
pub const ALL: [&str; 15] = [
    REQUESTS_TOTAL,
    REQUESTS_CANCELLED_TOTAL,
    RUNNING_REQUESTS,
    WAITING_REQUESTS,
    TIME_TO_FIRST_TOKEN_SECONDS,
    INTER_TOKEN_LATENCY_SECONDS,
    PREFILL_TOKENS_TOTAL,
    DECODE_TOKENS_TOTAL,
    DECODE_TOKENS_PER_SECOND,
    KV_TOKENS_USED,
    KV_TOKENS_CAPACITY,
    KV_BYTES_USED,
    KV_BYTES_CAPACITY,
    SERVER_READY,
    GPU_FORWARD_SECONDS,
];

/// Latency buckets (seconds) for TTFT and inter-token latency.
const LATENCY_BUCKETS: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// The tiers' counters at one instant, read at each scrape. Label values are the contract's.
#[derive(Clone, Debug, Default)]
pub struct TierSnapshot {
    /// `(tier, phase, lookups)`.
    pub lookups: Vec<(&'static str, &'static str, u64)>,
    /// `(tier, resident experts, slots)`.
    pub residency: Vec<(&'static str, u64, u64)>,
    /// `(path, bytes)`.
    pub bytes_moved: Vec<(&'static str, u64)>,
    /// Read latency: bucket upper bounds (seconds), cumulative counts, total count, sum.
    pub read_bounds: Vec<f64>,
    pub read_cumulative: Vec<u64>,
    pub read_count: u64,
    pub read_sum: f64,
    pub read_errors: u64,
    /// `(outcome, count)`.
    pub prefetch: Vec<(&'static str, u64)>,
    pub cpu_lane_experts: u64,
    /// `(kind, bytes)`; a kind without a limit is left out.
    pub memory: Vec<(&'static str, u64)>,
    pub pin_failures: u64,
    /// GPU device tier (zeros without one): host -> device bytes, `(lane, products)`, and
    /// the last sampled MoE step time.
    pub gpu_h2d_bytes: u64,
    pub expert_products: Vec<(&'static str, u64)>,
    pub gpu_moe_step_seconds: f64,
    /// `(part, seconds)` of the tiered provider's steps (none without tiers).
    pub step_parts: Vec<(&'static str, f64)>,
}

/// The memory plan's figures, in the contract's label values.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PlanSnapshot {
    /// `(tier, slots)`, all MoE layers.
    pub expert_slots: Vec<(&'static str, u64)>,
    /// `(kind, bytes)`.
    pub memory: Vec<(&'static str, u64)>,
}

type TierSource = Box<dyn Fn() -> TierSnapshot + Send + Sync>;

/// The tier metrics, filled from a [`TierSnapshot`] at each scrape.
struct TierMetrics {
    source: TierSource,
    lookups: IntCounterVec,
    resident: IntGaugeVec,
    capacity: IntGaugeVec,
    bytes_moved: IntCounterVec,
    read_seconds: Arc<Mutex<TierSnapshot>>,
    read_errors: IntCounter,
    prefetch: IntCounterVec,
    cpu_lane: IntCounter,
    memory: IntGaugeVec,
    pin_failures: IntCounter,
    gpu_h2d: IntCounter,
    products: IntCounterVec,
    gpu_step: prometheus::Gauge,
    step_parts: prometheus::CounterVec,
}

/// Advances a counter to `total` (the tiers count; the registry mirrors).
fn mirror(counter: &IntCounter, total: u64) {
    counter.inc_by(total.saturating_sub(counter.get()));
}

impl TierMetrics {
    fn refresh(&self) {
        let snap = (self.source)();
        for &(part, secs) in &snap.step_parts {
            let c = self.step_parts.with_label_values(&[part]);
            c.inc_by((secs - c.get()).max(0.0));
        }
        for &(tier, phase, n) in &snap.lookups {
            mirror(&self.lookups.with_label_values(&[tier, phase]), n);
        }
        for &(tier, resident, slots) in &snap.residency {
            self.resident
                .with_label_values(&[tier])
                .set(resident as i64);
            self.capacity.with_label_values(&[tier]).set(slots as i64);
        }
        for &(path, bytes) in &snap.bytes_moved {
            mirror(&self.bytes_moved.with_label_values(&[path]), bytes);
        }
        mirror(&self.read_errors, snap.read_errors);
        for &(outcome, n) in &snap.prefetch {
            mirror(&self.prefetch.with_label_values(&[outcome]), n);
        }
        mirror(&self.cpu_lane, snap.cpu_lane_experts);
        for &(kind, bytes) in &snap.memory {
            self.memory.with_label_values(&[kind]).set(bytes as i64);
        }
        mirror(&self.pin_failures, snap.pin_failures);
        mirror(&self.gpu_h2d, snap.gpu_h2d_bytes);
        for lane in ["gpu", "cpu"] {
            // Both lanes are always exposed, at 0 until they compute anything.
            self.products.with_label_values(&[lane]);
        }
        for &(lane, n) in &snap.expert_products {
            mirror(&self.products.with_label_values(&[lane]), n);
        }
        self.gpu_step.set(snap.gpu_moe_step_seconds);
        *self.read_seconds.lock().unwrap_or_else(|e| e.into_inner()) = snap;
    }
}

/// The store read latency histogram, rendered from the tiers' own buckets.
struct ReadSecondsCollector {
    desc: prometheus::core::Desc,
    snapshot: Arc<Mutex<TierSnapshot>>,
}

impl prometheus::core::Collector for ReadSecondsCollector {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        vec![&self.desc]
    }

    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        use prometheus::proto;
        let snap = self.snapshot.lock().unwrap_or_else(|e| e.into_inner());
        let mut h = proto::Histogram::default();
        h.set_sample_count(snap.read_count);
        h.set_sample_sum(snap.read_sum);
        h.set_bucket(
            snap.read_bounds
                .iter()
                .zip(&snap.read_cumulative)
                .map(|(&le, &n)| {
                    let mut b = proto::Bucket::default();
                    b.set_upper_bound(le);
                    b.set_cumulative_count(n);
                    b
                })
                .collect(),
        );
        let mut m = proto::Metric::default();
        m.set_histogram(h);
        let mut family = proto::MetricFamily::default();
        family.set_name(NVME_READ_SECONDS.to_string());
        family.set_help(self.desc.help.clone());
        family.set_field_type(proto::MetricType::HISTOGRAM);
        family.set_metric(vec![m]);
        vec![family]
    }
}

pub struct Metrics {
    tiers: Mutex<Option<TierMetrics>>,
    plan: Mutex<Option<(IntGaugeVec, IntGaugeVec)>>,
    registry: Registry,
    pub requests: IntCounterVec,
    pub cancelled: IntCounter,
    pub running: IntGauge,
    pub waiting: IntGauge,
    pub ttft: Histogram,
    pub inter_token: Histogram,
    pub prefill_tokens: IntCounter,
    pub decode_tokens: IntCounter,
    pub decode_tok_s: Gauge,
    pub gpu_forward: Histogram,
    pub kv_used: IntGauge,
    pub kv_capacity: IntGauge,
    pub kv_bytes_used: IntGauge,
    pub kv_bytes_capacity: IntGauge,
    pub ready: IntGauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    /// A fresh registry with every metric registered (each server and test has its own).
    pub fn new() -> Metrics {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new(REQUESTS_TOTAL, "Requests by endpoint and HTTP status."),
            &["endpoint", "status"],
        )
        .expect("valid metric");
        let cancelled = IntCounter::new(
            REQUESTS_CANCELLED_TOTAL,
            "Sequences dropped because their client went away (waiting or running).",
        )
        .expect("valid metric");
        let running = IntGauge::new(RUNNING_REQUESTS, "Sequences in the running batch.")
            .expect("valid metric");
        let waiting =
            IntGauge::new(WAITING_REQUESTS, "Sequences waiting for admission.").expect("valid");
        let hist = |name: &str, help: &str| {
            Histogram::with_opts(HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec()))
                .expect("valid metric")
        };
        let ttft = hist(
            TIME_TO_FIRST_TOKEN_SECONDS,
            "Seconds from submission to the first generated token.",
        );
        let inter_token = hist(
            INTER_TOKEN_LATENCY_SECONDS,
            "Seconds between consecutive generated tokens of a sequence.",
        );
        let prefill_tokens =
            IntCounter::new(PREFILL_TOKENS_TOTAL, "Prompt tokens processed.").expect("valid");
        let decode_tokens =
            IntCounter::new(DECODE_TOKENS_TOTAL, "Tokens generated.").expect("valid");
        let decode_tok_s = Gauge::new(
            DECODE_TOKENS_PER_SECOND,
            "Generated tokens per second over the last scheduler window, all sequences.",
        )
        .expect("valid");
        let gpu_forward = hist(
            GPU_FORWARD_SECONDS,
            "Seconds of one tick's forward of the sequences on the GPU, logits downloaded.",
        );
        let kv_used = IntGauge::new(KV_TOKENS_USED, "Tokens held in running sequences' caches.")
            .expect("valid");
        let kv_capacity = IntGauge::new(
            KV_TOKENS_CAPACITY,
            "Tokens one sequence's cache can hold within the cache budget.",
        )
        .expect("valid");
        let kv_bytes_used = IntGauge::new(
            KV_BYTES_USED,
            "Bytes held in running sequences' caches (MLA latents, DSA indexer keys, KDA state).",
        )
        .expect("valid");
        let kv_bytes_capacity = IntGauge::new(
            KV_BYTES_CAPACITY,
            "Cache budget in bytes that admission reserves against.",
        )
        .expect("valid");
        let ready = IntGauge::new(SERVER_READY, "1 once the model is loaded.").expect("valid");
        for c in [
            Box::new(requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(cancelled.clone()),
            Box::new(running.clone()),
            Box::new(waiting.clone()),
            Box::new(ttft.clone()),
            Box::new(inter_token.clone()),
            Box::new(prefill_tokens.clone()),
            Box::new(decode_tokens.clone()),
            Box::new(decode_tok_s.clone()),
            Box::new(gpu_forward.clone()),
            Box::new(kv_used.clone()),
            Box::new(kv_capacity.clone()),
            Box::new(kv_bytes_used.clone()),
            Box::new(kv_bytes_capacity.clone()),
            Box::new(ready.clone()),
        ] {
            registry.register(c).expect("each metric registered once");
        }
        Metrics {
            tiers: Mutex::new(None),
            plan: Mutex::new(None),
            registry,
            requests,
            cancelled,
            running,
            waiting,
            ttft,
            inter_token,
            prefill_tokens,
            decode_tokens,
            decode_tok_s,
            gpu_forward,
            kv_used,
            kv_capacity,
            kv_bytes_used,
            kv_bytes_capacity,
            ready,
        }
    }

    /// Counts one finished request.
    pub fn request(&self, endpoint: &str, status: u16) {
        self.requests
            .with_label_values(&[endpoint, &status.to_string()])
            .inc();
    }

    /// Registers the tier metrics, read from `source` at each scrape (once per registry;
    /// a second call is refused).
    pub fn attach_tiers(
        &self,
        source: impl Fn() -> TierSnapshot + Send + Sync + 'static,
    ) -> prometheus::Result<()> {
        let counter_vec = |name: &str, help: &str, labels: &[&str]| {
            IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric")
        };
        let gauge_vec = |name: &str, help: &str, labels: &[&str]| {
            IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric")
        };
        let counter = |name: &str, help: &str| IntCounter::new(name, help).expect("valid metric");
        let read_seconds = Arc::new(Mutex::new(TierSnapshot::default()));
        let t = TierMetrics {
            source: Box::new(source),
            lookups: counter_vec(
                EXPERT_LOOKUPS_TOTAL,
                "Routed expert lookups by the tier that served them and the phase.",
                &["tier", "phase"],
            ),
            resident: gauge_vec(
                TIER_RESIDENT_EXPERTS,
                "Experts resident in each tier (all MoE layers).",
                &["tier"],
            ),
            capacity: gauge_vec(
                TIER_CAPACITY_EXPERTS,
                "Expert slots of each tier (all MoE layers).",
                &["tier"],
            ),
            bytes_moved: counter_vec(
                BYTES_MOVED_TOTAL,
                "Expert bytes moved between tiers, by path.",
                &["path"],
            ),
            read_seconds: read_seconds.clone(),
            read_errors: counter(
                NVME_READ_ERRORS_TOTAL,
                "Store reads that failed (I/O error or checksum mismatch).",
            ),
            prefetch: counter_vec(
                PREFETCH_TOTAL,
                "Layer-ahead prefetch reads: issued, used by a lookup (hit), never used (wasted).",
                &["outcome"],
            ),
            cpu_lane: counter(
                CPU_LANE_EXPERTS_TOTAL,
                "Decode expert picks computed in place from the RAM tier (the CPU lane).",
            ),
            memory: gauge_vec(
                MEMORY_BYTES,
                "Memory by kind: pinned RAM tier, cgroup limit, RLIMIT_MEMLOCK.",
                &["kind"],
            ),
            pin_failures: counter(
                PIN_FAILURES_TOTAL,
                "Refusals to pin (mlock) RAM-tier experts.",
            ),
            gpu_h2d: counter(
                GPU_H2D_BYTES_TOTAL,
                "Expert bytes copied host to GPU (VRAM slot writes and staging).",
            ),
            products: counter_vec(
                EXPERT_PRODUCTS_TOTAL,
                "Routed-expert products by lane: on the GPU, or in place on the CPU lane.",
                &["lane"],
            ),
            gpu_step: prometheus::Gauge::new(
                GPU_MOE_STEP_SECONDS,
                "Seconds of one MoE layer's expert step on the GPU (sampled every 64th step run \
                 op by op; decode steps replayed as a CUDA graph are not sampled).",
            )?,
            step_parts: prometheus::CounterVec::new(
                Opts::new(
                    EXPERT_STEP_SECONDS_TOTAL,
                    "Seconds the tiered expert provider spent per part of its steps: fetch \
                     (store misses), resolve (lookups, admissions), write_back, compute.",
                ),
                &["part"],
            )?,
        };
        let histogram = ReadSecondsCollector {
            desc: prometheus::core::Desc::new(
                NVME_READ_SECONDS.to_string(),
                "Seconds per expert record read from the packed store (O_DIRECT read, sha256 \
                 check and decode)."
                    .to_string(),
                vec![],
                Default::default(),
            )?,
            snapshot: read_seconds,
        };
        let mut slot = self.tiers.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_some() {
            return Err(prometheus::Error::AlreadyReg);
        }
        for c in [
            Box::new(t.lookups.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(t.resident.clone()),
            Box::new(t.capacity.clone()),
            Box::new(t.bytes_moved.clone()),
            Box::new(histogram),
            Box::new(t.read_errors.clone()),
            Box::new(t.prefetch.clone()),
            Box::new(t.cpu_lane.clone()),
            Box::new(t.memory.clone()),
            Box::new(t.pin_failures.clone()),
            Box::new(t.gpu_h2d.clone()),
            Box::new(t.products.clone()),
            Box::new(t.gpu_step.clone()),
            Box::new(t.step_parts.clone()),
        ] {
            self.registry.register(c)?;
        }
        t.refresh();
        *slot = Some(t);
        Ok(())
    }

    /// Sets the memory plan's gauges (registered at the first call).
    pub fn set_plan(&self, plan: &PlanSnapshot) -> prometheus::Result<()> {
        let mut slot = self.plan.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            let slots = IntGaugeVec::new(
                Opts::new(
                    PLAN_EXPERT_SLOTS,
                    "Expert slots the memory plan gives each tier (all MoE layers; nvme: the \
                     store's records).",
                ),
                &["tier"],
            )?;
            let memory = IntGaugeVec::new(
                Opts::new(
                    PLAN_MEMORY_BYTES,
                    "Bytes the memory plan counts, by kind (VRAM weights, caches, workspace, \
                     staging, reserve, experts; RAM limit, held, reserve, budget, experts; store).",
                ),
                &["kind"],
            )?;
            self.registry.register(Box::new(slots.clone()))?;
            self.registry.register(Box::new(memory.clone()))?;
            *slot = Some((slots, memory));
        }
        let (slots, memory) = slot.as_ref().expect("registered above");
        for &(tier, n) in &plan.expert_slots {
            slots.with_label_values(&[tier]).set(n as i64);
        }
        for &(kind, bytes) in &plan.memory {
            memory.with_label_values(&[kind]).set(bytes as i64);
        }
        Ok(())
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        if let Some(t) = &*self.tiers.lock().unwrap_or_else(|e| e.into_inner()) {
            t.refresh();
        }
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("text encoding of gathered metrics");
        String::from_utf8(buf).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_contract_name_is_exposed_once() {
        let m = Metrics::new();
        m.request("/v1/models", 200);
        m.ttft.observe(0.1);
        m.inter_token.observe(0.01);
        let text = m.render();
        for name in ALL {
            let type_line = format!("# TYPE {name} ");
            assert_eq!(text.matches(&type_line).count(), 1, "{name} in\n{text}");
        }
        assert!(text.contains(r#"glmflash_requests_total{endpoint="/v1/models",status="200"} 1"#));
        for name in TIER_METRICS.iter().chain(&PLAN_METRICS) {
            assert!(!text.contains(name), "{name} before any tiers are attached");
        }
    }

    #[test]
    fn plan_gauges_show_the_plan() {
        let m = Metrics::new();
        let plan = PlanSnapshot {
            expert_slots: vec![("vram", 1554), ("ram", 3906), ("nvme", 12096)],
            memory: vec![("vram_cache", 7 << 20), ("store", 1 << 40)],
        };
        m.set_plan(&plan).unwrap();
        m.set_plan(&PlanSnapshot {
            expert_slots: vec![("vram", 1512)],
            ..plan
        })
        .unwrap();
        let text = m.render();
        for name in PLAN_METRICS {
            let type_line = format!("# TYPE {name} gauge");
            assert_eq!(text.matches(&type_line).count(), 1, "{name} in\n{text}");
        }
        for line in [
            r#"glmflash_plan_expert_slots{tier="vram"} 1512"#,
            r#"glmflash_plan_expert_slots{tier="nvme"} 12096"#,
            r#"glmflash_plan_memory_bytes{kind="vram_cache"} 7340032"#,
            r#"glmflash_plan_memory_bytes{kind="store"} 1099511627776"#,
        ] {
            assert!(text.contains(line), "{line} in\n{text}");
        }
    }

    #[test]
    fn tier_metrics_follow_the_snapshot_at_each_scrape() {
        let m = Metrics::new();
        let lookups = Arc::new(std::sync::atomic::AtomicU64::new(5));
        let seen = lookups.clone();
        m.attach_tiers(move || TierSnapshot {
            lookups: vec![(
                "vram",
                "decode",
                seen.load(std::sync::atomic::Ordering::Relaxed),
            )],
            residency: vec![("ram", 3, 8)],
            bytes_moved: vec![("nvme_to_ram", 1 << 20)],
            prefetch: vec![("hit", 2)],
            read_bounds: vec![0.001, 0.01],
            read_cumulative: vec![2, 3],
            read_count: 4,
            read_sum: 1.5,
            memory: vec![("pinned_ram", 4096)],
            step_parts: vec![("fetch", 0.25)],
            ..Default::default()
        })
        .unwrap();
        assert!(m.attach_tiers(TierSnapshot::default).is_err());
        lookups.store(9, std::sync::atomic::Ordering::Relaxed);
        let text = m.render();
        for name in TIER_METRICS {
            let type_line = format!("# TYPE {name} ");
            assert_eq!(text.matches(&type_line).count(), 1, "{name} in\n{text}");
        }
        for line in [
            r#"glmflash_expert_lookups_total{phase="decode",tier="vram"} 9"#,
            r#"glmflash_tier_resident_experts{tier="ram"} 3"#,
            r#"glmflash_tier_capacity_experts{tier="ram"} 8"#,
            r#"glmflash_nvme_read_seconds_bucket{le="0.01"} 3"#,
            r#"glmflash_nvme_read_seconds_bucket{le="+Inf"} 4"#,
            "glmflash_nvme_read_seconds_sum 1.5",
            r#"glmflash_memory_bytes{kind="pinned_ram"} 4096"#,
            r#"glmflash_bytes_moved_total{path="nvme_to_ram"} 1048576"#,
            r#"glmflash_prefetch_total{outcome="hit"} 2"#,
            r#"glmflash_expert_step_seconds_total{part="fetch"} 0.25"#,
        ] {
            assert!(text.contains(line), "{line} in\n{text}");
        }
    }
}
