//! Start-up of the tiers: the placement flags (turned into the plan), the CPU-lane feature
//! check, and what the tiers report (the one-line summary printed at exit, the metrics).

use super::plan::{Placement, SlotRequest, TierPlan};
use super::policy::PolicyKind;
use super::provider::{Mode, Tier, TieredExperts};
use super::sizing::MemoryFacts;
use std::path::PathBuf;
use std::sync::atomic::Ordering;

/// The placement flags: mode, slot counts or the budgets they are sized from, eviction,
/// pinning, prefetch and the routing history. With the memory plan's slots,
/// [`TierArgs::placement`] turns them into the one [`Placement`] value.
#[derive(clap::Args, Debug, Clone)]
pub struct TierArgs {
    /// Expert residency: fast/exact (all experts in RAM) or nvme/nvme-exact (tiered).
    #[arg(long, env = "GLMFLASH_MODE", value_enum)]
    pub mode: Option<Mode>,
    /// Device-tier expert slots per MoE layer (tiered modes). Default: on a GPU, sized from
    /// the free VRAM left after the dense weights and --vram-reserve-mib; without a GPU
    /// (the device tier is then CPU memory) 4.
    #[arg(
        long,
        env = "GLMFLASH_VRAM_SLOTS",
        conflicts_with = "vram_expert_slots"
    )]
    pub vram_slots: Option<usize>,
    /// Device-tier expert slots in all, spread evenly over the MoE layers (the seed's "about
    /// 1,300 experts in VRAM"); instead of --vram-slots.
    #[arg(long, env = "GLMFLASH_VRAM_EXPERT_SLOTS")]
    pub vram_expert_slots: Option<usize>,
    /// VRAM left free when the tier is sized from free VRAM, beside what the memory plan
    /// counts (the weights, the sequences' caches at the context length and batch size, the
    /// GPU forward's workspace for a prompt chunk, the staging slots): for cuBLAS and
    /// fragmentation (MiB). `plan` has the same flag and default.
    #[arg(long, env = "GLMFLASH_VRAM_RESERVE_MIB", default_value_t = 512)]
    pub vram_reserve_mib: u64,
    /// Refuse to start on a GPU with less free VRAM than this (MiB; the seed refuses under
    /// 23,000 for the real model). 0: no floor.
    #[arg(long, env = "GLMFLASH_MIN_FREE_VRAM_MIB", default_value_t = 0)]
    pub min_free_vram_mib: u64,
    /// RAM-tier expert slots per MoE layer (tiered modes); default: sized from the memory
    /// limit (see --ram-budget-mib).
    #[arg(long, env = "GLMFLASH_RAM_SLOTS")]
    pub ram_slots: Option<usize>,
    /// RAM-tier budget in MiB, all MoE layers together (tiered modes without --ram-slots);
    /// default: the cgroup memory limit minus what the process holds minus --ram-reserve-mib.
    #[arg(long, env = "GLMFLASH_RAM_BUDGET_MIB")]
    pub ram_budget_mib: Option<u64>,
    /// Memory left outside the RAM tier for the KV cache, workspace and headroom (MiB).
    #[arg(long, env = "GLMFLASH_RAM_RESERVE_MIB", default_value_t = 2048)]
    pub ram_reserve_mib: u64,
    /// Eviction policy of the device and RAM tiers.
    #[arg(long, env = "GLMFLASH_EVICTION", value_enum, default_value_t = PolicyKind::Lfu)]
    pub eviction: PolicyKind,
    /// Entries of the write-back ring (moves down a tier waiting for the background writer).
    #[arg(long, env = "GLMFLASH_WRITEBACK_RING", default_value_t = 64)]
    pub writeback_ring: usize,
    /// Do not mlock the RAM tier.
    #[arg(long, env = "GLMFLASH_NO_PIN", value_parser = clap::builder::BoolishValueParser::new())]
    pub no_pin: bool,
    /// Turn off layer-ahead prefetch of predicted experts.
    #[arg(long, env = "GLMFLASH_NO_PREFETCH", value_parser = clap::builder::BoolishValueParser::new())]
    pub no_prefetch: bool,
    /// Read a forward's store misses in full before computing any of its experts, instead
    /// of computing each as its record arrives (what the overlap is worth, measured).
    #[arg(long, env = "GLMFLASH_NO_FETCH_OVERLAP", value_parser = clap::builder::BoolishValueParser::new())]
    pub no_fetch_overlap: bool,
    /// On a GPU, keep a host copy of every weight in VRAM: of every VRAM resident expert (one
    /// record per VRAM slot) and of the dense weights, out of the RAM tier's budget. By default
    /// a resident's VRAM slot holds its only copy (a victim is copied down from it on its way
    /// to RAM), and the dense weights' host bytes are given back once loaded (the host keeps the
    /// embedding and MLA's kv_b). `plan` has the same flag.
    #[arg(long, env = "GLMFLASH_VRAM_HOST_COPIES", value_parser = clap::builder::BoolishValueParser::new())]
    pub vram_host_copies: bool,
    /// Routing history file: read at start to warm the tiers (policies at once, slots filled
    /// in the background while serving), written at exit.
    #[arg(long, env = "GLMFLASH_HISTORY")]
    pub history: Option<PathBuf>,
    /// How each expert record read from --store is checked before use: against its CRC-32C
    /// (about a tenth of sha256's CPU; a store packed before records had one falls back to
    /// sha256), against its sha256 too, or not at all (truncated and failed reads are caught
    /// whatever this says).
    #[arg(long, env = "GLMFLASH_STORE_CHECK", value_enum, default_value_t = StoreCheck::Crc32c)]
    pub store_check: StoreCheck,
}

/// `--store-check`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum StoreCheck {
    Crc32c,
    Sha256,
    Off,
}

impl StoreCheck {
    /// The store reader's options for this check.
    pub fn reader_options(self) -> crate::store::ReaderOptions {
        use crate::store::{ChecksumPolicy, RecordCheck};
        let (checksum, check) = match self {
            StoreCheck::Crc32c => (ChecksumPolicy::Always, RecordCheck::Fast),
            StoreCheck::Sha256 => (ChecksumPolicy::Always, RecordCheck::Full),
            StoreCheck::Off => (ChecksumPolicy::Never, RecordCheck::Fast),
        };
        crate::store::ReaderOptions {
            checksum,
            check,
            ..Default::default()
        }
    }
}

impl TierArgs {
    /// The slot counts and reserves these flags ask for (`None`: sized from the machine).
    pub fn request(&self) -> SlotRequest {
        SlotRequest {
            device_slots: self.vram_slots,
            device_slots_total: self.vram_expert_slots,
            ram_slots: self.ram_slots,
            ram_budget: self.ram_budget_mib.map(|m| m << 20),
            ram_reserve: self.ram_reserve_mib << 20,
            vram_reserve: self.vram_reserve_mib << 20,
            copy_down: !self.vram_host_copies,
        }
    }

    /// The placement these flags ask for, with the slots per MoE layer the memory plan gave
    /// (the `plan` module's `plan_with`): untiered without --mode.
    pub fn placement(&self, device_slots: usize, ram_slots: usize, experts: usize) -> Placement {
        let Some(mode) = self.mode else {
            return Placement::Untiered;
        };
        Placement::Tiered(TierPlan {
            prefetch: mode.tiered() && !self.no_prefetch,
            fetch_overlap: !self.no_fetch_overlap,
            copy_down: !self.vram_host_copies,
            eviction: self.eviction,
            writeback_ring: self.writeback_ring,
            pin: !self.no_pin,
            history: self.history.clone(),
            ..TierPlan::new(mode, device_slots, ram_slots, experts)
        })
    }
}

/// Says which CPU-lane kernels run: the SIMD ones need AVX2, FMA and F16C.
pub fn log_cpu_lane() {
    let f = crate::quant::cpu_features();
    match cpu_lane_problem(f) {
        None => tracing::info!(
            avx2 = f.avx2,
            fma = f.fma,
            f16c = f.f16c,
            exl3 = crate::quant::exl3::simd_build(),
            q4_k = crate::quant::lane::kernel_name(),
            "CPU lane: SIMD kernels"
        ),
        Some(problem) => tracing::warn!("{problem}"),
    }
}

/// A plain sentence naming what the CPU lacks, or `None` when the SIMD kernels can run.
pub fn cpu_lane_problem(f: crate::quant::CpuFeatures) -> Option<String> {
    let missing: Vec<&str> = [("AVX2", f.avx2), ("FMA", f.fma), ("F16C", f.f16c)]
        .iter()
        .filter(|(_, has)| !has)
        .map(|(name, _)| *name)
        .collect();
    (!missing.is_empty()).then(|| {
        format!(
            "this CPU lacks {} needed by the CPU lane's SIMD kernels; the portable fallback runs \
             instead (same results, slower)",
            missing.join(", ")
        )
    })
}

/// One line: lookups and residents per tier, bytes moved, pinned bytes, prefetch, ring.
pub fn tier_summary(tiers: &TieredExperts) -> String {
    let s = &tiers.stats;
    let get = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
    let record = tiers.record_bytes() as f64 / 1048576.0;
    let (ring, high, stalls) = tiers.writeback_ring();
    let tiers_part = [Tier::Device, Tier::Ram, Tier::Store]
        .iter()
        .map(|&t| {
            format!(
                "{}: {} lookups, {} resident",
                t.name(),
                s.lookups(t),
                tiers.resident(t)
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    format!(
        "{tiers_part}; moved MiB nvme->ram {:.1}, ram->vram {:.1}, vram->ram {:.1}; \
         pinned {:.1} MiB ({} refusals, {} experts outside the pinned arena); prefetch: {} issued, {} hits, {} wasted; \
         store batches {:.2} s reading, products {:.2} s waiting ({}); \
         cpu lane {}; write-back ring {high}/{ring} peak, {stalls} stalls; {} policy",
        get(&s.store_reads) as f64 * record,
        get(&s.promotions) as f64 * record,
        get(&s.written_back) as f64 * record,
        tiers.pins.pinned() as f64 / 1048576.0,
        get(&tiers.pins.failures),
        tiers.pins.arena_fallbacks(),
        get(&s.prefetch_issued),
        get(&s.prefetch_hits),
        get(&s.prefetch_wasted),
        s.fetch_busy_seconds(),
        s.part_seconds(super::stats::StepPart::Fetch),
        if tiers.plan().fetch_overlap {
            "overlapped"
        } else {
            "read first"
        },
        get(&s.cpu_lane),
        match tiers.policy() {
            PolicyKind::Lfu => "lfu",
            PolicyKind::Lru => "lru",
        }
    ) + &tiers
        .gpu_summary()
        .map(|g| format!("; {g}"))
        .unwrap_or_default()
}

/// The tiers' counters in the metrics registry's terms (read at each scrape).
pub fn metrics_snapshot(tiers: &TieredExperts) -> crate::metrics::TierSnapshot {
    let s = &tiers.stats;
    let get = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
    let record = tiers.record_bytes() as u64;
    let (device_slots, ram_slots) = tiers.caps();
    let layers = tiers.moe_layers() as u64;
    let all = [Tier::Device, Tier::Ram, Tier::Store];
    let (read_cumulative, read_count) = s.store_read_latency.cumulative();
    let facts = MemoryFacts::read();
    let mut memory = vec![("pinned_ram", tiers.pins.pinned())];
    let gpu = tiers.gpu_stats();
    if let Some(g) = &gpu {
        memory.push((
            "registered_ram",
            tiers.pins.registered_bytes.load(Ordering::Relaxed),
        ));
        memory.push(("vram_used", g.vram_used));
        memory.push(("vram_total", g.vram_total));
    }
    memory.extend(facts.cgroup_limit.map(|b| ("cgroup_limit", b)));
    memory.extend(facts.memlock_soft.map(|b| ("memlock_limit", b)));
    crate::metrics::TierSnapshot {
        lookups: all
            .iter()
            .flat_map(|&t| {
                [("prefill", 0), ("decode", 1)]
                    .map(|(phase, i)| (t.name(), phase, get(&s.lookups[t as usize][i])))
            })
            .collect(),
        residency: all
            .iter()
            .map(|&t| {
                let slots = match t {
                    Tier::Device => device_slots as u64 * layers,
                    Tier::Ram => ram_slots as u64 * layers,
                    Tier::Store => tiers.experts() as u64 * layers,
                };
                (t.name(), tiers.resident(t) as u64, slots)
            })
            .collect(),
        bytes_moved: vec![
            ("nvme_to_ram", get(&s.store_reads) * record),
            ("ram_to_vram", get(&s.promotions) * record),
            ("vram_to_ram", get(&s.written_back) * record),
        ],
        read_bounds: super::stats::READ_BUCKETS.to_vec(),
        read_cumulative,
        read_count,
        read_sum: s.store_read_latency.total_seconds(),
        read_errors: get(&s.store_read_errors),
        prefetch: vec![
            ("issued", get(&s.prefetch_issued)),
            ("hit", get(&s.prefetch_hits)),
            ("wasted", get(&s.prefetch_wasted)),
        ],
        cpu_lane_experts: get(&s.cpu_lane),
        memory,
        pin_failures: get(&tiers.pins.failures),
        gpu_h2d_bytes: gpu.as_ref().map_or(0, |g| g.h2d_bytes),
        expert_products: vec![
            ("gpu", gpu.as_ref().map_or(0, |g| g.gpu_picks)),
            (
                "cpu",
                gpu.as_ref().map_or(get(&s.cpu_lane), |g| g.cpu_picks),
            ),
        ],
        gpu_moe_step_seconds: gpu.as_ref().map_or(0.0, |g| g.step_seconds),
        step_parts: super::stats::StepPart::ALL
            .iter()
            .map(|&p| (p.name(), s.part_seconds(p)))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::CpuFeatures;

    #[test]
    fn cpu_lane_names_what_is_missing() {
        let all = CpuFeatures {
            avx2: true,
            fma: true,
            f16c: true,
        };
        assert_eq!(cpu_lane_problem(all), None);
        let msg = cpu_lane_problem(CpuFeatures {
            fma: false,
            f16c: false,
            ..all
        })
        .unwrap();
        assert!(
            msg.contains("lacks FMA, F16C") && msg.contains("portable fallback"),
            "{msg}"
        );
    }
}
