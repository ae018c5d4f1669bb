//! The glmflash server's metrics contract: every metric name the server exports and the
//! Grafana dashboard, the alert rules and the operator's status read, in one place.
//!
//! A crate of its own with no dependencies, so that both sides can depend on it without
//! depending on each other: glmflash-node's `metrics` module registers each metric under
//! exactly these names, and the operator reads them here. The operator's chart tests fail
//! when a dashboard query or alert names a metric that is not listed here, and its
//! Prometheus test when the server exports one that is not.

/// Requests, labels `endpoint` and `status`.
pub const REQUESTS_TOTAL: &str = "glmflash_requests_total";
/// Sequences (one per choice) dropped because their client went away: a closed
/// connection, waiting or running; they leave the queue and the batch and free their cache.
pub const REQUESTS_CANCELLED_TOTAL: &str = "glmflash_requests_cancelled_total";
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

/// Expert lookups, labels `tier` (`vram` | `ram` | `nvme`) and `phase` (`prefill` | `decode`).
pub const EXPERT_LOOKUPS_TOTAL: &str = "glmflash_expert_lookups_total";
/// Experts resident in a tier, label `tier`.
pub const TIER_RESIDENT_EXPERTS: &str = "glmflash_tier_resident_experts";
/// Expert slots of a tier, label `tier`.
pub const TIER_CAPACITY_EXPERTS: &str = "glmflash_tier_capacity_experts";
/// Bytes moved between tiers, label `path` (`nvme_to_ram` | `ram_to_vram` | `vram_to_ram`).
pub const BYTES_MOVED_TOTAL: &str = "glmflash_bytes_moved_total";
/// Store time per record read (seconds; records read in one batch share its wait).
pub const NVME_READ_SECONDS: &str = "glmflash_nvme_read_seconds";
/// Failed store reads (I/O error or checksum mismatch).
pub const NVME_READ_ERRORS_TOTAL: &str = "glmflash_nvme_read_errors_total";
/// Layer-ahead prefetch, label `outcome` (`issued` | `hit` | `wasted`).
pub const PREFETCH_TOTAL: &str = "glmflash_prefetch_total";
/// Experts computed on the CPU lane (decode picks served in place from RAM).
pub const CPU_LANE_EXPERTS_TOTAL: &str = "glmflash_cpu_lane_experts_total";
/// Memory by `kind` (`vram_used` | `vram_total` | `pinned_ram` | `registered_ram` (of the pinned,
/// registered with CUDA) | `cgroup_limit` | `memlock_limit`).
pub const MEMORY_BYTES: &str = "glmflash_memory_bytes";
/// Failures to pin (mlock) RAM-tier memory.
pub const PIN_FAILURES_TOTAL: &str = "glmflash_pin_failures_total";

/// Bytes copied host -> GPU for experts (slot writes and staging).
pub const GPU_H2D_BYTES_TOTAL: &str = "glmflash_gpu_host_to_device_bytes_total";
/// Routed-expert products by `lane` (`gpu` | `cpu`): the CPU lane's share of the work.
pub const EXPERT_PRODUCTS_TOTAL: &str = "glmflash_expert_products_total";
/// Seconds of one MoE layer's expert step on the GPU, sampled every 64th step run op by op (by
/// two timing events; decode steps replayed as a CUDA graph are not sampled).
pub const GPU_MOE_STEP_SECONDS: &str = "glmflash_gpu_moe_step_seconds";

/// Seconds the tiered expert provider has spent per `part` of its steps: `fetch` (the
/// step's store misses, read in one batch), `resolve` (lookups and admissions, pinning
/// included), `write_back` (queueing moves down; a full ring blocks) and `compute` (the
/// products, slot writes and staging included).
pub const EXPERT_STEP_SECONDS_TOTAL: &str = "glmflash_expert_step_seconds_total";

/// Seconds of one scheduler tick's forward on the GPU (`GpuDecoder`: the decode tokens and
/// prompt chunks of the sequences there, every activation on the device; it ends with the
/// logits' download, so it spans the device's work), histogram.
pub const GPU_FORWARD_SECONDS: &str = "glmflash_gpu_forward_seconds";

/// The memory plan the server runs with (`glmflash-node plan`'s numbers, worked out at
/// start for this machine): expert slots by `tier` (`vram` | `ram` | `nvme`, as
/// [`TIER_CAPACITY_EXPERTS`] counts them, `nvme` every record of the store), beside the actual
/// capacity.
pub const PLAN_EXPERT_SLOTS: &str = "glmflash_plan_expert_slots";
/// The memory plan's bytes by `kind`: `vram_free` (when planned), `vram_weights`,
/// `vram_cache`, `vram_workspace`, `vram_staging`, `vram_reserve`, `vram_experts`, `ram_limit`
/// (the cap, when there is one), `ram_held`, `ram_reserve`, `ram_budget`,
/// `ram_prompt_reads` (of the budget, a prompt chunk's store reads), `ram_experts`, `store`; beside [`MEMORY_BYTES`], the actual figures.
pub const PLAN_MEMORY_BYTES: &str = "glmflash_plan_memory_bytes";

/// Every name above.
pub const ALL: [&str; 31] = [
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
    REQUESTS_CANCELLED_TOTAL,
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
    GPU_FORWARD_SECONDS,
    EXPERT_STEP_SECONDS_TOTAL,
    PLAN_EXPERT_SLOTS,
    PLAN_MEMORY_BYTES,
];

/// Histograms: Prometheus exposes them as `<name>_bucket`, `_sum` and `_count`.
pub const HISTOGRAMS: [&str; 4] = [
    NVME_READ_SECONDS,
    TIME_TO_FIRST_TOKEN_SECONDS,
    INTER_TOKEN_LATENCY_SECONDS,
    GPU_FORWARD_SECONDS,
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
