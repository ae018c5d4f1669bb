//! The memory plan: what of a model fits where on a box, from its config alone — the weights
//! by kind in the checkpoint's formats, the caches at a context and batch, the prefill
//! workspace, the expert slots of each tier, the store, and the bytes a decode token moves
//! from each tier with the speed those bytes allow.
//!
//! The expert slots come from the same arithmetic the server sizes its tiers with
//! ([`crate::tiers::plan::size_tiers`]), fed the box's numbers instead of the machine's.

pub mod args;
pub mod weights;

use crate::engine::cache::CacheLayout;
use crate::model::config::Config;
use crate::tiers::plan::{ModelSizes, STAGING_SLOTS, SlotRequest, size_tiers};
use crate::tiers::sizing::MemoryFacts;
use std::collections::BTreeMap;
use weights::{Kind, Storage};

/// GLM-5.3-Flash's text config (the published `config.json`'s fields), shipped so `plan`
/// runs without a download.
pub const GLM_5_3_FLASH_CONFIG: &str = include_str!("../../configs/glm-5.3-flash.json");

/// Bandwidths of the box, GB/s (10^9 bytes).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Bandwidths {
    /// GPU memory.
    pub hbm: f64,
    /// Host to device (PCIe).
    pub h2d: f64,
    /// Host memory, as the CPU lane reads it.
    pub ram: f64,
    /// The store's disk, O_DIRECT.
    pub nvme: f64,
}

impl Bandwidths {
    /// An RTX 3090 box: 936 GB/s GDDR6X, PCIe 4.0 x16, dual-channel DDR4/DDR5, one NVMe.
    pub const RTX_3090_BOX: Bandwidths = Bandwidths {
        hbm: 936.0,
        h2d: 25.0,
        ram: 50.0,
        nvme: 7.0,
    };
}

/// What the plan is asked for.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanInputs {
    pub cfg: Config,
    /// The non-expert linear weights' storage.
    pub dense: Storage,
    /// The output projection's storage.
    pub head: Storage,
    /// The routed experts' storage (their records in the store and the tiers).
    pub experts: Storage,
    /// VRAM free when the server starts.
    pub vram: u64,
    /// VRAM left free beside everything counted (cuBLAS, fragmentation).
    pub vram_reserve: u64,
    /// The container's memory cap (`None`: none; then `ram_available` is the base).
    pub ram_limit: Option<u64>,
    /// Host memory available without a cap.
    pub ram_available: Option<u64>,
    /// Host memory kept outside the RAM tier.
    pub ram_reserve: u64,
    /// Tokens of cache, shared by the batch.
    pub context: usize,
    /// Sequences at once (each with its own KDA state).
    pub batch: usize,
    /// Prompt-chunk rows of the GPU forward (its workspace).
    pub chunk: usize,
    pub bandwidths: Bandwidths,
}

/// Bytes one decode token moves from a tier, and the time that takes.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Traffic {
    pub tier: &'static str,
    pub bytes: u64,
    pub gbs: f64,
    pub seconds: f64,
}

/// The plan.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct MemoryPlan {
    pub dense_format: String,
    pub head_format: String,
    pub expert_format: String,
    pub moe_layers: usize,
    pub experts_per_layer: usize,
    pub experts_per_token: usize,
    /// One routed expert's record (store-aligned).
    pub record_bytes: u64,
    /// Non-expert weights by kind.
    pub weights: BTreeMap<&'static str, u64>,
    /// VRAM: the weights the GPU keeps (all but the embedding).
    pub vram_weight_bytes: u64,
    /// VRAM: the caches at `context` tokens and `batch` sequences.
    pub cache_bytes: u64,
    pub context: usize,
    pub batch: usize,
    pub workspace_bytes: u64,
    pub staging_bytes: u64,
    pub vram_reserve_bytes: u64,
    pub vram_bytes: u64,
    pub vram_expert_slots_per_layer: usize,
    pub vram_expert_slots: usize,
    pub vram_expert_bytes: u64,
    /// RAM: what the process holds outside the RAM tier (the dense weights' host copies,
    /// the device residents' host copies).
    pub ram_held_bytes: u64,
    pub ram_reserve_bytes: u64,
    pub ram_limit_bytes: Option<u64>,
    pub ram_budget_bytes: u64,
    pub ram_expert_slots_per_layer: usize,
    pub ram_expert_slots: usize,
    /// Routed experts in neither tier (read from the store when picked).
    pub store_only_experts: usize,
    pub store_bytes: u64,
    /// Per decode token under uniform routing, one sequence.
    pub traffic: Vec<Traffic>,
    /// Decode tokens per second the bytes allow: tiers one after another, and fully
    /// overlapped.
    pub tok_s_serial: f64,
    pub tok_s_overlapped: f64,
}

/// Why nothing fits.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error(
        "the GPU cannot hold the model: {need_mib} MiB needed before any expert slot (weights \
         {weights_mib}, caches {cache_mib} at {context} tokens x {batch} sequences, workspace \
         {workspace_mib}, staging {staging_mib}, reserve {reserve_mib}) against {vram_mib} MiB; \
         lower --context or --batch, or quantize the dense weights"
    )]
    Vram {
        need_mib: u64,
        weights_mib: u64,
        cache_mib: u64,
        context: usize,
        batch: usize,
        workspace_mib: u64,
        staging_mib: u64,
        reserve_mib: u64,
        vram_mib: u64,
    },
    #[error(
        "the memory cap cannot hold the process: {held_mib} MiB held (dense weights and the \
         VRAM residents' host copies) plus a {reserve_mib} MiB reserve against {limit_mib} MiB"
    )]
    Ram {
        held_mib: u64,
        reserve_mib: u64,
        limit_mib: u64,
    },
    #[error("{0}")]
    Config(String),
}

/// Bytes of the caches of `batch` sequences sharing `context` tokens.
pub fn cache_bytes(cfg: &Config, context: usize, batch: usize) -> u64 {
    let layout = CacheLayout::of(cfg);
    let tokens = layout.bytes_for(context) - layout.fixed_bytes;
    (layout.fixed_bytes * batch.max(1) + tokens) as u64
}

/// Works the plan out; refuses (with the numbers) when the GPU or the memory cap cannot hold
/// what must be there before any expert.
pub fn plan(inputs: &PlanInputs) -> Result<MemoryPlan, PlanError> {
    let cfg = &inputs.cfg;
    let moe_layers = cfg.moe_layers().iter().filter(|&&m| m).count();
    let experts = cfg.n_routed_experts;
    let record_bytes = weights::expert_bytes(cfg, inputs.experts)
        .div_ceil(crate::store::ALIGN as u64)
        * crate::store::ALIGN as u64;
    let mut by_kind: BTreeMap<&'static str, u64> = BTreeMap::new();
    let mut dense_bytes = 0;
    let mut host_only = 0;
    for t in weights::tensors(cfg) {
        if t.kind == Kind::RoutedExperts {
            continue;
        }
        let bytes = weights::tensor_bytes(&t, inputs.dense, inputs.head);
        *by_kind.entry(t.kind.name()).or_default() += bytes;
        dense_bytes += bytes;
        if t.kind == Kind::Embedding {
            host_only += bytes;
        }
    }
    let cache = cache_bytes(cfg, inputs.context, inputs.batch);
    let workspace =
        crate::model::decoder::workspace_bytes(cfg, inputs.chunk, inputs.context) as u64;
    let sizes = ModelSizes {
        moe_layers,
        experts,
        record_bytes,
        dense_bytes,
        host_only_bytes: host_only,
        cache_bytes: cache,
        gpu_workspace_bytes: workspace,
    };
    let held = sizes.vram_held(inputs.vram_reserve);
    let mib = |b: u64| b >> 20;
    if held > inputs.vram {
        return Err(PlanError::Vram {
            need_mib: mib(held),
            weights_mib: mib(dense_bytes - host_only),
            cache_mib: mib(cache),
            context: inputs.context,
            batch: inputs.batch,
            workspace_mib: mib(workspace),
            staging_mib: mib(STAGING_SLOTS as u64 * record_bytes),
            reserve_mib: mib(inputs.vram_reserve),
            vram_mib: mib(inputs.vram),
        });
    }
    let request = SlotRequest {
        device_slots: None,
        device_slots_total: None,
        ram_slots: None,
        ram_budget: None,
        ram_reserve: inputs.ram_reserve,
        vram_reserve: inputs.vram_reserve,
    };
    let machine = crate::tiers::plan::MachineFacts {
        free_vram: Some(inputs.vram),
        memory: MemoryFacts {
            cgroup_limit: inputs.ram_limit,
            cgroup_source: inputs.ram_limit.map(|_| "--ram-limit".to_string()),
            rss: 0,
            memlock_soft: None,
            memlock_hard: None,
            mem_available: inputs.ram_available,
        },
    };
    let sizing = size_tiers(&sizes, &request, &machine);
    if let Some(limit) = inputs.ram_limit
        && sizing.ram.held + inputs.ram_reserve > limit
    {
        return Err(PlanError::Ram {
            held_mib: mib(sizing.ram.held),
            reserve_mib: mib(inputs.ram_reserve),
            limit_mib: mib(limit),
        });
    }
    let vram_slots = sizing.device_slots;
    // The RAM tier holds experts the VRAM tier does not.
    let ram_slots = sizing.ram_slots.min(experts - vram_slots);
    let store_only = experts - vram_slots - ram_slots;

    // One decode token, uniform routing: each MoE layer's picks land in a tier in proportion
    // to its share of the layer's experts; the GPU reads every weight it keeps once; the CPU
    // lane's rows go down and come back for each MoE layer it computes a pick of.
    let picks = (moe_layers * cfg.num_experts_per_tok) as f64;
    let share = |slots: usize| picks * slots as f64 / experts.max(1) as f64;
    let bw = inputs.bandwidths;
    let hbm_bytes = (dense_bytes - host_only) as f64 + share(vram_slots) * record_bytes as f64;
    let ram_bytes = share(ram_slots) * record_bytes as f64;
    let nvme_bytes = share(store_only) * record_bytes as f64;
    let h2d_bytes = if ram_slots + store_only > 0 {
        (moe_layers * 2 * cfg.hidden_size * 4) as f64
    } else {
        0.0
    };
    let traffic: Vec<Traffic> = [
        ("hbm", hbm_bytes, bw.hbm),
        ("h2d", h2d_bytes, bw.h2d),
        ("ram", ram_bytes, bw.ram),
        ("nvme", nvme_bytes, bw.nvme),
    ]
    .into_iter()
    .map(|(tier, bytes, gbs)| Traffic {
        tier,
        bytes: bytes as u64,
        gbs,
        seconds: if gbs > 0.0 { bytes / (gbs * 1e9) } else { 0.0 },
    })
    .collect();
    let serial: f64 = traffic.iter().map(|t| t.seconds).sum();
    let overlapped = traffic.iter().map(|t| t.seconds).fold(0.0, f64::max);
    let per_sec = |s: f64| if s > 0.0 { 1.0 / s } else { f64::INFINITY };
    Ok(MemoryPlan {
        dense_format: inputs.dense.name(),
        head_format: inputs.head.name(),
        expert_format: inputs.experts.name(),
        moe_layers,
        experts_per_layer: experts,
        experts_per_token: cfg.num_experts_per_tok,
        record_bytes,
        weights: by_kind,
        vram_weight_bytes: dense_bytes - host_only,
        cache_bytes: cache,
        context: inputs.context,
        batch: inputs.batch,
        workspace_bytes: workspace,
        staging_bytes: STAGING_SLOTS as u64 * record_bytes,
        vram_reserve_bytes: inputs.vram_reserve,
        vram_bytes: inputs.vram,
        vram_expert_slots_per_layer: vram_slots,
        vram_expert_slots: vram_slots * moe_layers,
        vram_expert_bytes: (vram_slots * moe_layers) as u64 * record_bytes,
        ram_held_bytes: sizing.ram.held,
        ram_reserve_bytes: inputs.ram_reserve,
        ram_limit_bytes: inputs.ram_limit,
        ram_budget_bytes: sizing.ram.budget,
        ram_expert_slots_per_layer: ram_slots,
        ram_expert_slots: ram_slots * moe_layers,
        store_only_experts: store_only * moe_layers,
        store_bytes: (experts * moe_layers) as u64 * record_bytes,
        traffic,
        tok_s_serial: per_sec(serial),
        tok_s_overlapped: per_sec(overlapped),
    })
}

impl MemoryPlan {
    /// The plan as a table for people.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let mut text = |s: String| {
            out.push_str(&s);
            out.push('\n');
        };
        let row = |label: String, bytes: u64| {
            format!(
                "  {label:<44}{:>9.2} GiB",
                bytes as f64 / (1u64 << 30) as f64
            )
        };
        text(format!(
            "formats: dense {}, head {}, experts {} ({:.2} MiB a record); {} MoE layers x {} \
             experts, {} a token",
            self.dense_format,
            self.head_format,
            self.expert_format,
            self.record_bytes as f64 / (1 << 20) as f64,
            self.moe_layers,
            self.experts_per_layer,
            self.experts_per_token
        ));
        text("VRAM".into());
        for (kind, bytes) in &self.weights {
            if *kind != Kind::Embedding.name() {
                text(row(format!("weights: {kind}"), *bytes));
            }
        }
        text(row(
            format!("caches: {} tokens, {} sequences", self.context, self.batch),
            self.cache_bytes,
        ));
        text(row("prefill workspace".into(), self.workspace_bytes));
        text(row(
            format!("staging: {STAGING_SLOTS} records"),
            self.staging_bytes,
        ));
        text(row("reserve".into(), self.vram_reserve_bytes));
        text(row(
            format!(
                "expert slots: {} ({} a layer)",
                self.vram_expert_slots, self.vram_expert_slots_per_layer
            ),
            self.vram_expert_bytes,
        ));
        text(row("of the card's".into(), self.vram_bytes));
        text("RAM".into());
        text(row(
            "embedding (host only)".into(),
            self.weights
                .get(Kind::Embedding.name())
                .copied()
                .unwrap_or(0),
        ));
        text(row(
            "held: dense weights, VRAM residents' copies".into(),
            self.ram_held_bytes,
        ));
        text(row("reserve".into(), self.ram_reserve_bytes));
        text(row(
            format!(
                "expert slots: {} ({} a layer)",
                self.ram_expert_slots, self.ram_expert_slots_per_layer
            ),
            self.ram_budget_bytes,
        ));
        match self.ram_limit_bytes {
            Some(l) => text(row("of the memory cap".into(), l)),
            None => text("  no memory cap: the machine's available memory is the base".into()),
        }
        text("store".into());
        text(row(
            format!(
                "{} experts, {} read from it when picked",
                self.moe_layers * self.experts_per_layer,
                self.store_only_experts
            ),
            self.store_bytes,
        ));
        text("a decode token, one sequence, uniform routing (the worst case: real routing is skewed)".into());
        for t in &self.traffic {
            text(format!(
                "  {:<6}{:>10.1} MB at {:>6.1} GB/s: {:>8.2} ms",
                t.tier,
                t.bytes as f64 / 1e6,
                t.gbs,
                t.seconds * 1e3
            ));
        }
        text(format!(
            "  at most {:.1} tok/s with the tiers one after another, {:.1} fully overlapped",
            self.tok_s_serial, self.tok_s_overlapped
        ));
        out
    }
}

#[cfg(test)]
mod tests;
