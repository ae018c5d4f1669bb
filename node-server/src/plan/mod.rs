//! The memory plan: what of a model fits where on a box, from its config alone — the weights
//! by kind in the checkpoint's formats, the caches at a context and batch, the prefill
//! workspace, the expert slots of each tier, the store, and the bytes a decode token moves
//! from each tier with the speed those bytes allow.
//!
//! One sizing path: [`plan`] (the `plan` command, `bench --flash`, the operator's fit check)
//! and the server (`serve`, `generate`, `logits` with `--mode`) both call [`plan_with`], the
//! server with the machine it reads and its slot flags, the others with a box's numbers. The
//! slot arithmetic inside is the tiers' own ([`crate::tiers::plan::size_tiers`]).

pub mod args;
pub mod weights;

use crate::engine::cache::CacheLayout;
use crate::model::config::Config;
use crate::model::device::CacheDtype;
use crate::tiers::plan::{MachineFacts, ModelSizes, STAGING_SLOTS, SlotRequest, size_tiers};
use crate::tiers::provider::Mode;
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
    /// One record's bytes as a packed store holds them, when there is one (`--store`):
    /// instead of the size `experts` gives.
    pub record_bytes: Option<u64>,
    /// One VRAM slot's bytes as the VRAM tier lays out the source's experts, when there is a
    /// source (`--store`, the server): instead of the layout of `experts`.
    pub slot_bytes: Option<u64>,
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
    /// The VRAM residents keep no host copy (the default; `--vram-host-copies` keeps them).
    pub copy_down: bool,
    /// Tokens of cache, shared by the batch.
    pub context: usize,
    /// Sequences at once (each with its own KDA state).
    pub batch: usize,
    /// How the MLA and DSA caches store a value.
    pub cache_dtype: CacheDtype,
    /// Prompt-chunk rows of the GPU forward (its workspace).
    pub chunk: usize,
    pub bandwidths: Bandwidths,
}

/// The work the caches and the GPU workspace are sized for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Tokens of cache, shared by the batch (capped at the model's positions).
    pub context: usize,
    /// Sequences at once.
    pub batch: usize,
    /// Prompt-chunk rows of the GPU forward.
    pub chunk: usize,
}

impl Shape {
    /// One sequence up to the model's positions (`generate`, `logits`).
    pub fn one_sequence() -> Shape {
        Shape {
            context: usize::MAX,
            batch: 1,
            chunk: crate::model::decoder::DEFAULT_GPU_CHUNK,
        }
    }
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
    /// One routed expert's record (store-aligned): a RAM slot, a host copy.
    pub record_bytes: u64,
    /// One VRAM slot (a resident or a staging slot), as the VRAM tier lays out a record.
    pub vram_slot_bytes: u64,
    /// Non-expert weights by kind.
    pub weights: BTreeMap<&'static str, u64>,
    /// VRAM: the weights the GPU keeps (all but the embedding).
    pub vram_weight_bytes: u64,
    /// VRAM: the caches at `context` tokens and `batch` sequences.
    pub cache_bytes: u64,
    /// How the MLA and DSA caches store a value.
    pub cache_dtype: CacheDtype,
    pub context: usize,
    pub batch: usize,
    pub workspace_bytes: u64,
    pub staging_bytes: u64,
    pub vram_reserve_bytes: u64,
    pub vram_bytes: u64,
    pub vram_expert_slots_per_layer: usize,
    pub vram_expert_slots: usize,
    pub vram_expert_bytes: u64,
    /// How the VRAM slots were chosen: "free-vram", "flag", "flag-total" or "cpu-default"
    /// (no GPU: the device tier is CPU memory).
    pub vram_basis: &'static str,
    /// RAM: what the process holds outside the RAM tier (the dense weights' host copies,
    /// the device residents' host copies when they keep them).
    pub ram_held_bytes: u64,
    /// Of `ram_held_bytes`: the device residents' host copies.
    pub ram_device_copies_bytes: u64,
    /// Not held: the dense weights' host bytes given back once the GPU holds them (0 without
    /// a GPU, or with `--vram-host-copies`).
    pub ram_dense_given_back_bytes: u64,
    /// Of the RAM budget: a prompt chunk's store reads, held beside the tiers while a layer
    /// computes (see [`crate::tiers::plan::Sizing::prompt_reads`]).
    pub ram_prompt_reads_bytes: u64,
    pub ram_reserve_bytes: u64,
    pub ram_limit_bytes: Option<u64>,
    pub ram_budget_bytes: u64,
    pub ram_expert_slots_per_layer: usize,
    pub ram_expert_slots: usize,
    /// Where the RAM budget came from: "cgroup", "mem_available", "flag" (--ram-budget-mib),
    /// "--ram-slots", or "mode" (fast / exact hold every expert).
    pub ram_basis: &'static str,
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
        "the memory cap cannot hold the process: {held_mib} MiB held (the dense weights while \
         they load; then the ones the host keeps, and with --vram-host-copies the copies of what \
         VRAM holds) plus a {reserve_mib} MiB reserve against {limit_mib} MiB"
    )]
    Ram {
        held_mib: u64,
        reserve_mib: u64,
        limit_mib: u64,
    },
    #[error("{0}")]
    Config(String),
}

/// Bytes of the caches of `batch` sequences sharing `context` tokens, the MLA and DSA caches
/// in `dtype`.
pub fn cache_bytes(cfg: &Config, context: usize, batch: usize, dtype: CacheDtype) -> u64 {
    let layout = CacheLayout::of(cfg, dtype);
    let tokens = layout.bytes_for(context) - layout.fixed_bytes;
    (layout.fixed_bytes * batch.max(1) + tokens) as u64
}

impl PlanInputs {
    /// The box these inputs describe, as the tiers' sizing reads a machine: the free VRAM,
    /// the cap (else the available memory), nothing resident yet and no memlock limit.
    pub fn machine(&self) -> MachineFacts {
        MachineFacts {
            free_vram: Some(self.vram),
            memory: MemoryFacts {
                cgroup_limit: self.ram_limit,
                cgroup_source: self.ram_limit.map(|_| "--ram-limit".to_string()),
                rss: 0,
                memlock_soft: None,
                memlock_hard: None,
                mem_available: self.ram_available,
            },
        }
    }

    /// No slot flags: every tier sized from the box, with these inputs' reserves.
    pub fn request(&self) -> SlotRequest {
        SlotRequest {
            device_slots: None,
            device_slots_total: None,
            ram_slots: None,
            ram_budget: None,
            ram_reserve: self.ram_reserve,
            vram_reserve: self.vram_reserve,
            copy_down: self.copy_down,
        }
    }
}

/// Works the plan out for the box `inputs` describe, every tier sized from it (the tiered
/// modes); refuses (with the numbers) when the GPU or the memory cap cannot hold what must be
/// there before any expert.
pub fn plan(inputs: &PlanInputs) -> Result<MemoryPlan, PlanError> {
    plan_with(inputs, &inputs.request(), &inputs.machine(), Mode::Nvme)
}

/// The plan for `inputs`' model and shape on `machine` (free VRAM: `None` without a GPU,
/// when the device tier is CPU memory), with the slots `request` asks for and `mode`'s
/// placement (`fast` / `exact`: every expert in RAM). The reserves are `request`'s. A tier
/// sized from the machine is refused when what it must hold first does not fit; one a flag
/// sizes is not.
pub fn plan_with(
    inputs: &PlanInputs,
    request: &SlotRequest,
    machine: &MachineFacts,
    mode: Mode,
) -> Result<MemoryPlan, PlanError> {
    let cfg = &inputs.cfg;
    let moe_layers = cfg.moe_layers().iter().filter(|&&m| m).count();
    let experts = cfg.n_routed_experts;
    let record_bytes = inputs.record_bytes.unwrap_or_else(|| {
        weights::expert_bytes(cfg, inputs.experts).div_ceil(crate::store::ALIGN as u64)
            * crate::store::ALIGN as u64
    });
    let slot_bytes = match inputs.slot_bytes {
        Some(b) => b,
        None => {
            weights::slot_layout(cfg, inputs.experts)
                .map_err(PlanError::Config)?
                .slot_bytes as u64
        }
    };
    let mut by_kind: BTreeMap<&'static str, u64> = BTreeMap::new();
    let mut dense_bytes = 0;
    let mut host_only = 0;
    let mut host_kept = 0;
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
        if !weights::given_back_with_gpu(&t) {
            host_kept += bytes;
        }
    }
    // A sequence never holds more than the model's positions.
    let context = inputs.context.min(cfg.max_position_embeddings);
    let cache = cache_bytes(cfg, context, inputs.batch, inputs.cache_dtype);
    let workspace = crate::model::decoder::workspace_bytes(cfg, inputs.chunk, context) as u64;
    let sizes = ModelSizes {
        moe_layers,
        experts,
        record_bytes,
        slot_bytes,
        dense_bytes,
        host_only_bytes: host_only,
        host_kept_bytes: host_kept,
        cache_bytes: cache,
        gpu_workspace_bytes: workspace,
    };
    let held = sizes.vram_held(request.vram_reserve);
    let mib = |b: u64| b >> 20;
    let sized_from_vram = request.device_slots.is_none() && request.device_slots_total.is_none();
    if let Some(vram) = machine.free_vram
        && sized_from_vram
        && mode.tiered()
        && held > vram
    {
        return Err(PlanError::Vram {
            need_mib: mib(held),
            weights_mib: mib(dense_bytes - host_only),
            cache_mib: mib(cache),
            context,
            batch: inputs.batch,
            workspace_mib: mib(workspace),
            staging_mib: mib(STAGING_SLOTS as u64 * slot_bytes),
            reserve_mib: mib(request.vram_reserve),
            vram_mib: mib(vram),
        });
    }
    let sizing = size_tiers(&sizes, request, machine);
    let sized_from_cap = request.ram_slots.is_none() && request.ram_budget.is_none();
    // While the model loads, every dense weight is in host memory before the GPU's copies
    // let their host bytes go (the RAM tier fills after).
    let load_peak = machine.memory.rss + dense_bytes;
    if let Some(limit) = machine.memory.cgroup_limit
        && sized_from_cap
        && (sizing.ram.held + request.ram_reserve > limit || load_peak > limit)
    {
        return Err(PlanError::Ram {
            held_mib: mib(sizing.ram.held.max(load_peak)),
            reserve_mib: mib(request.ram_reserve),
            limit_mib: mib(limit),
        });
    }
    let (vram_slots, ram_slots) = if !mode.tiered() {
        (0, experts)
    } else if request.ram_slots.is_some() {
        (sizing.device_slots, sizing.ram_slots)
    } else {
        // The RAM tier holds experts the VRAM tier does not.
        let vram = sizing.device_slots;
        (vram, sizing.ram_slots.min(experts - vram))
    };
    let store_only = experts.saturating_sub(vram_slots + ram_slots);

    // One decode token, uniform routing: each MoE layer's picks land in a tier in proportion
    // to its share of the layer's experts; the GPU reads every weight it keeps once; the CPU
    // lane's rows go down and come back for each MoE layer it computes a pick of.
    let picks = (moe_layers * cfg.num_experts_per_tok) as f64;
    let share = |slots: usize| picks * slots as f64 / experts.max(1) as f64;
    let bw = inputs.bandwidths;
    let hbm_bytes = (dense_bytes - host_only) as f64 + share(vram_slots) * slot_bytes as f64;
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
        expert_format: match inputs.record_bytes {
            Some(_) => "the store's records".to_string(),
            None => inputs.experts.name(),
        },
        moe_layers,
        experts_per_layer: experts,
        experts_per_token: cfg.num_experts_per_tok,
        record_bytes,
        vram_slot_bytes: slot_bytes,
        weights: by_kind,
        vram_weight_bytes: dense_bytes - host_only,
        cache_bytes: cache,
        cache_dtype: inputs.cache_dtype,
        context,
        batch: inputs.batch,
        workspace_bytes: workspace,
        staging_bytes: STAGING_SLOTS as u64 * slot_bytes,
        vram_reserve_bytes: request.vram_reserve,
        vram_bytes: machine.free_vram.unwrap_or(0),
        vram_expert_slots_per_layer: vram_slots,
        vram_expert_slots: vram_slots * moe_layers,
        vram_expert_bytes: (vram_slots * moe_layers) as u64 * slot_bytes,
        vram_basis: sizing.device_basis,
        ram_held_bytes: sizing.ram.held,
        ram_dense_given_back_bytes: dense_bytes - sizing.dense_held,
        ram_device_copies_bytes: if mode.tiered() {
            sizing.device_copies
        } else {
            0
        },
        ram_prompt_reads_bytes: if mode.tiered() {
            sizing.prompt_reads
        } else {
            0
        },
        ram_reserve_bytes: request.ram_reserve,
        ram_limit_bytes: machine.memory.cgroup_limit,
        ram_budget_bytes: sizing.ram.budget,
        ram_expert_slots_per_layer: ram_slots,
        ram_expert_slots: ram_slots * moe_layers,
        ram_basis: match (mode.tiered(), request.ram_slots) {
            (false, _) => "mode",
            (true, Some(_)) => "--ram-slots",
            (true, None) => sizing.ram.basis,
        },
        store_only_experts: store_only * moe_layers,
        store_bytes: (experts * moe_layers) as u64 * record_bytes,
        traffic,
        tok_s_serial: per_sec(serial),
        tok_s_overlapped: per_sec(overlapped),
    })
}

impl MemoryPlan {
    /// Bytes of the RAM tier's slots (what pinning locks).
    pub fn ram_expert_bytes(&self) -> u64 {
        self.ram_expert_slots as u64 * self.record_bytes
    }

    /// The plan's figures for `/metrics` (`glmflash_plan_*`), in the tier metrics' terms.
    pub fn metrics(&self) -> crate::metrics::PlanSnapshot {
        let records = (self.moe_layers * self.experts_per_layer) as u64;
        let mut memory = vec![
            ("vram_weights", self.vram_weight_bytes),
            ("vram_cache", self.cache_bytes),
            ("vram_workspace", self.workspace_bytes),
            ("vram_staging", self.staging_bytes),
            ("vram_reserve", self.vram_reserve_bytes),
            ("vram_experts", self.vram_expert_bytes),
            ("ram_held", self.ram_held_bytes),
            ("ram_reserve", self.ram_reserve_bytes),
            ("ram_budget", self.ram_budget_bytes),
            ("ram_prompt_reads", self.ram_prompt_reads_bytes),
            ("ram_experts", self.ram_expert_bytes()),
            ("store", self.store_bytes),
        ];
        // No GPU: no free VRAM was planned against.
        if self.vram_bytes > 0 {
            memory.push(("vram_free", self.vram_bytes));
        }
        memory.extend(self.ram_limit_bytes.map(|b| ("ram_limit", b)));
        crate::metrics::PlanSnapshot {
            expert_slots: vec![
                ("vram", self.vram_expert_slots as u64),
                ("ram", self.ram_expert_slots as u64),
                ("nvme", records),
            ],
            memory,
        }
    }

    /// Logs the plan the server runs with: a line per tier with the numbers behind its
    /// slots, and the whole plan as JSON (the fields of `plan --json`).
    pub fn log(&self, machine: &MachineFacts) {
        let mib = |b: u64| b >> 20;
        if machine.free_vram.is_some() {
            tracing::info!(
                free_mib = mib(self.vram_bytes),
                weights_mib = mib(self.vram_weight_bytes),
                cache_mib = mib(self.cache_bytes),
                workspace_mib = mib(self.workspace_bytes),
                staging_mib = mib(self.staging_bytes),
                reserve_mib = mib(self.vram_reserve_bytes),
                slot_kib = self.vram_slot_bytes >> 10,
                moe_layers = self.moe_layers,
                slots_per_layer = self.vram_expert_slots_per_layer,
                basis = self.vram_basis,
                "VRAM tier sized"
            );
        }
        tracing::info!(
            cgroup_limit_mib = self.ram_limit_bytes.map(mib),
            cgroup_source = machine.memory.cgroup_source.as_deref().unwrap_or("none"),
            held_mib = mib(self.ram_held_bytes),
            reserve_mib = mib(self.ram_reserve_bytes),
            budget_mib = mib(self.ram_budget_bytes),
            budget_from = self.ram_basis,
            prompt_reads_mib = mib(self.ram_prompt_reads_bytes),
            record_bytes = self.record_bytes,
            moe_layers = self.moe_layers,
            ram_slots_per_layer = self.ram_expert_slots_per_layer,
            memlock_limit_kib = machine.memory.memlock_soft.map(|b| b >> 10),
            "RAM tier sized"
        );
        tracing::info!(
            vram_expert_slots = self.vram_expert_slots,
            ram_expert_slots = self.ram_expert_slots,
            store_only_experts = self.store_only_experts,
            store_bytes = self.store_bytes,
            plan = %serde_json::to_string(self).unwrap_or_default(),
            "memory plan"
        );
    }

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
            "formats: dense {}, head {}, experts {} ({:.2} MiB a record, {:.2} MiB a VRAM \
             slot); {} MoE layers x {} experts, {} a token",
            self.dense_format,
            self.head_format,
            self.expert_format,
            self.record_bytes as f64 / (1 << 20) as f64,
            self.vram_slot_bytes as f64 / (1 << 20) as f64,
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
            format!(
                "caches: {} tokens, {} sequences, {}",
                self.context,
                self.batch,
                self.cache_dtype.name()
            ),
            self.cache_bytes,
        ));
        text(row("prefill workspace".into(), self.workspace_bytes));
        text(row(
            format!("staging: {STAGING_SLOTS} slots"),
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
            "held: dense weights kept, the process".into(),
            self.ram_held_bytes
                .saturating_sub(self.ram_device_copies_bytes),
        ));
        text(row(
            "held: VRAM residents' host copies".into(),
            self.ram_device_copies_bytes,
        ));
        if self.ram_dense_given_back_bytes > 0 {
            text(row(
                "not held: dense weights on the GPU".into(),
                self.ram_dense_given_back_bytes,
            ));
        }
        text(row("reserve".into(), self.ram_reserve_bytes));
        text(row(
            format!(
                "expert slots: {} ({} a layer)",
                self.ram_expert_slots, self.ram_expert_slots_per_layer
            ),
            self.ram_budget_bytes,
        ));
        if self.ram_prompt_reads_bytes > 0 {
            text(row(
                "  of which a prompt chunk's store reads".into(),
                self.ram_prompt_reads_bytes,
            ));
        }
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
