//! The one metrics registry and every metric name (a contract: DESIGN.md "Metrics: one
//! contract"; the operator's dashboard and alert rules read the same names).
//!
//! Each metric is defined once, here; the API and the engine update them through
//! [`Metrics`], and `/metrics` renders [`Metrics::render`].

use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
    TextEncoder,
};

/// Requests, labels `endpoint` and `status`.
pub const REQUESTS_TOTAL: &str = "glmflash_requests_total";
/// Requests being decoded (admitted into the running batch).
pub const RUNNING_REQUESTS: &str = "glmflash_running_requests";
/// Requests queued for admission.
pub const WAITING_REQUESTS: &str = "glmflash_waiting_requests";
/// Time to first token histogram (seconds, from submission).
pub const TIME_TO_FIRST_TOKEN_SECONDS: &str = "glmflash_time_to_first_token_seconds";
/// Inter-token latency histogram (seconds).
pub const INTER_TOKEN_LATENCY_SECONDS: &str = "glmflash_inter_token_latency_seconds";
/// Prompt tokens processed.
pub const PREFILL_TOKENS_TOTAL: &str = "glmflash_prefill_tokens_total";
/// Tokens generated.
pub const DECODE_TOKENS_TOTAL: &str = "glmflash_decode_tokens_total";
/// Decode speed over the last window (gauge, tokens/s summed over the batch).
pub const DECODE_TOKENS_PER_SECOND: &str = "glmflash_decode_tokens_per_second";
/// KV cache tokens in use (tokens held by running sequences' caches).
pub const KV_TOKENS_USED: &str = "glmflash_kv_tokens_used";
/// Tokens one sequence's cache can hold within the cache budget.
pub const KV_TOKENS_CAPACITY: &str = "glmflash_kv_tokens_capacity";
/// Bytes held by running sequences' caches (every layer type: MLA latents, DSA indexer
/// keys, KDA state).
pub const KV_BYTES_USED: &str = "glmflash_kv_bytes_used";
/// The cache budget in bytes that admission reserves against.
pub const KV_BYTES_CAPACITY: &str = "glmflash_kv_bytes_capacity";
/// 1 once the model is loaded and the server accepts requests.
pub const SERVER_READY: &str = "glmflash_server_ready";

/// Every name this module defines.
pub const ALL: [&str; 13] = [
    REQUESTS_TOTAL,
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
];

/// Latency buckets (seconds) for TTFT and inter-token latency.
const LATENCY_BUCKETS: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

pub struct Metrics {
    registry: Registry,
    pub requests: IntCounterVec,
    pub running: IntGauge,
    pub waiting: IntGauge,
    pub ttft: Histogram,
    pub inter_token: Histogram,
    pub prefill_tokens: IntCounter,
    pub decode_tokens: IntCounter,
    pub decode_tok_s: Gauge,
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
            Box::new(running.clone()),
            Box::new(waiting.clone()),
            Box::new(ttft.clone()),
            Box::new(inter_token.clone()),
            Box::new(prefill_tokens.clone()),
            Box::new(decode_tokens.clone()),
            Box::new(decode_tok_s.clone()),
            Box::new(kv_used.clone()),
            Box::new(kv_capacity.clone()),
            Box::new(kv_bytes_used.clone()),
            Box::new(kv_bytes_capacity.clone()),
            Box::new(ready.clone()),
        ] {
            registry.register(c).expect("each metric registered once");
        }
        Metrics {
            registry,
            requests,
            running,
            waiting,
            ttft,
            inter_token,
            prefill_tokens,
            decode_tokens,
            decode_tok_s,
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

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
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
    }
}
