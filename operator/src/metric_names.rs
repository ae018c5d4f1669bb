//! The glmflash server's metrics contract: every metric name the Grafana dashboard, the
//! alert rules and the operator's status read, in one place.
//!
//! This file has no dependencies on purpose, so glmflash-node's `metrics/` module can
//! share it (`#[path]` include or a move into a shared crate) and define each metric
//! under exactly these names. The chart's tests fail when a dashboard query or alert names
//! a metric that is not listed here.

/// Expert lookups, labels `tier` (`vram` | `ram` | `nvme`) and `phase` (`prefill` | `decode`).
pub const EXPERT_LOOKUPS_TOTAL: &str = "glmflash_expert_lookups_total";
/// Experts resident in a tier, label `tier`.
pub const TIER_RESIDENT_EXPERTS: &str = "glmflash_tier_resident_experts";
/// Expert slots of a tier, label `tier`.
pub const TIER_CAPACITY_EXPERTS: &str = "glmflash_tier_capacity_experts";
/// Bytes moved between tiers, label `path` (`nvme_to_ram` | `ram_to_vram` | `vram_to_ram`).
pub const BYTES_MOVED_TOTAL: &str = "glmflash_bytes_moved_total";
/// NVMe record read latency histogram (seconds).
pub const NVME_READ_SECONDS: &str = "glmflash_nvme_read_seconds";
/// Failed NVMe store reads (I/O error or checksum mismatch).
pub const NVME_READ_ERRORS_TOTAL: &str = "glmflash_nvme_read_errors_total";
/// Prefetch outcomes, label `outcome` (`hit` | `wasted`).
pub const PREFETCH_TOTAL: &str = "glmflash_prefetch_total";
/// Experts computed on the CPU lane.
pub const CPU_LANE_EXPERTS_TOTAL: &str = "glmflash_cpu_lane_experts_total";
/// Prompt tokens processed.
pub const PREFILL_TOKENS_TOTAL: &str = "glmflash_prefill_tokens_total";
/// Tokens generated.
pub const DECODE_TOKENS_TOTAL: &str = "glmflash_decode_tokens_total";
/// Decode speed over the last window (gauge).
pub const DECODE_TOKENS_PER_SECOND: &str = "glmflash_decode_tokens_per_second";
/// Time to first token histogram (seconds).
pub const TIME_TO_FIRST_TOKEN_SECONDS: &str = "glmflash_time_to_first_token_seconds";
/// Inter-token latency histogram (seconds).
pub const INTER_TOKEN_LATENCY_SECONDS: &str = "glmflash_inter_token_latency_seconds";
/// Requests, labels `endpoint` and `status`.
pub const REQUESTS_TOTAL: &str = "glmflash_requests_total";
/// Requests being decoded.
pub const RUNNING_REQUESTS: &str = "glmflash_running_requests";
/// Requests queued.
pub const WAITING_REQUESTS: &str = "glmflash_waiting_requests";
/// KV cache tokens in use.
pub const KV_TOKENS_USED: &str = "glmflash_kv_tokens_used";
/// KV cache tokens available.
pub const KV_TOKENS_CAPACITY: &str = "glmflash_kv_tokens_capacity";
/// Memory by `kind` (`vram_used` | `vram_total` | `pinned_ram` | `registered_ram` (of the pinned,
/// registered with CUDA) | `cgroup_limit` | `memlock_limit`).
pub const MEMORY_BYTES: &str = "glmflash_memory_bytes";
/// Failures to pin (mlock / cudaHostRegister) RAM tier memory.
pub const PIN_FAILURES_TOTAL: &str = "glmflash_pin_failures_total";
/// 1 once the model is loaded and the server accepts requests.
pub const SERVER_READY: &str = "glmflash_server_ready";
/// KV cache bytes reserved by running sequences.
pub const KV_BYTES_USED: &str = "glmflash_kv_bytes_used";
/// KV cache budget in bytes.
pub const KV_BYTES_CAPACITY: &str = "glmflash_kv_bytes_capacity";
/// Expert bytes copied host to GPU (VRAM slot writes and staging).
pub const GPU_H2D_BYTES_TOTAL: &str = "glmflash_gpu_host_to_device_bytes_total";
/// Routed-expert products, label `lane` (`gpu` | `cpu`).
pub const EXPERT_PRODUCTS_TOTAL: &str = "glmflash_expert_products_total";
/// Seconds of one MoE layer's expert step on the GPU, sampled (gauge).
pub const GPU_MOE_STEP_SECONDS: &str = "glmflash_gpu_moe_step_seconds";

/// Every name above.
pub const ALL: [&str; 26] = [
    EXPERT_LOOKUPS_TOTAL,
    TIER_RESIDENT_EXPERTS,
    TIER_CAPACITY_EXPERTS,
    BYTES_MOVED_TOTAL,
    NVME_READ_SECONDS,
    NVME_READ_ERRORS_TOTAL,
    PREFETCH_TOTAL,
    CPU_LANE_EXPERTS_TOTAL,
    PREFILL_TOKENS_TOTAL,
    DECODE_TOKENS_TOTAL,
    DECODE_TOKENS_PER_SECOND,
    TIME_TO_FIRST_TOKEN_SECONDS,
    INTER_TOKEN_LATENCY_SECONDS,
    REQUESTS_TOTAL,
    RUNNING_REQUESTS,
    WAITING_REQUESTS,
    KV_TOKENS_USED,
    KV_TOKENS_CAPACITY,
    MEMORY_BYTES,
    PIN_FAILURES_TOTAL,
    SERVER_READY,
    KV_BYTES_USED,
    KV_BYTES_CAPACITY,
    GPU_H2D_BYTES_TOTAL,
    EXPERT_PRODUCTS_TOTAL,
    GPU_MOE_STEP_SECONDS,
];

/// Histograms: Prometheus exposes them as `<name>_bucket`, `_sum` and `_count`.
pub const HISTOGRAMS: [&str; 3] = [
    NVME_READ_SECONDS,
    TIME_TO_FIRST_TOKEN_SECONDS,
    INTER_TOKEN_LATENCY_SECONDS,
];

/// Whether `series` (a name as it appears in PromQL or an exposition) belongs to the
/// contract, counting a histogram's `_bucket`, `_sum` and `_count` series.
pub fn is_known_series(series: &str) -> bool {
    if ALL.contains(&series) {
        return true;
    }
    ["_bucket", "_sum", "_count"].iter().any(|suffix| {
        series
            .strip_suffix(suffix)
            .is_some_and(|base| HISTOGRAMS.contains(&base))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_prefixed_and_valid() {
        let mut seen = std::collections::BTreeSet::new();
        for name in ALL {
            assert!(name.starts_with("glmflash_"), "{name}");
            assert!(
                name.chars().all(|c| c.is_ascii_lowercase() || c == '_'),
                "{name}"
            );
            assert!(seen.insert(name), "duplicate {name}");
        }
        for h in HISTOGRAMS {
            assert!(ALL.contains(&h), "{h}");
        }
    }

    #[test]
    fn histogram_series_are_known_and_others_are_not() {
        assert!(is_known_series("glmflash_nvme_read_seconds_bucket"));
        assert!(is_known_series("glmflash_running_requests"));
        assert!(!is_known_series("glmflash_running_requests_bucket"));
        assert!(!is_known_series("glmflash_made_up"));
    }
}
