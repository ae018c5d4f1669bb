//! The expert placement plan: where every routed expert lives, which lane computes it, and
//! how many slots each tier has. It is decided once at start, from the flags, the model's
//! sizes and the machine (free VRAM, the cgroup limit); the tiers, the loaders and the
//! benchmarks receive the value instead of re-deriving any of it.
//!
//! The slot arithmetic ([`size_tiers`]) is pure and unit-tested; the memory plan
//! (the `plan` module) calls it for the server and for `plan` alike, and [`MachineFacts::read`]
//! reads the machine it is fed.

use super::policy::PolicyKind;
use super::provider::Mode;
use super::sizing::{self, MemoryFacts};
use std::path::PathBuf;

/// Lookups per layer between halvings of the LFU counts.
pub const AGING_PERIOD: u64 = 4096;

/// Staging slots of a GPU device tier: one layer's non-resident picks per round, a decode
/// step's worth (the exact modes and prompt chunks stage what is not in a VRAM slot).
pub const STAGING_SLOTS: usize = 16;

/// Device-tier slots per MoE layer when the device tier is CPU memory (no GPU) and no flag
/// sets them.
pub const CPU_DEVICE_SLOTS: usize = 4;

/// Where the routed experts live.
#[derive(Clone, Debug, PartialEq)]
pub enum Placement {
    /// Every expert beside the dense weights, loaded from the checkpoint: host memory and
    /// the CPU, or VRAM and the GPU.
    Untiered,
    /// Through the expert tiers.
    Tiered(TierPlan),
}

/// The tiers' shape and behaviour.
#[derive(Clone, Debug, PartialEq)]
pub struct TierPlan {
    pub mode: Mode,
    /// Device-tier slots per MoE layer (VRAM on a GPU, else CPU memory); 0 in fast/exact.
    pub device_slots: usize,
    /// RAM-tier slots per MoE layer (every expert in fast/exact).
    pub ram_slots: usize,
    /// Staging slots of a GPU device tier.
    pub staging_slots: usize,
    /// Layer-ahead prefetch of predicted picks (tiered modes only).
    pub prefetch: bool,
    /// A forward's store misses read while its products run, each product waiting for its
    /// own record only (off: the whole batch is read first, as before).
    pub fetch_overlap: bool,
    /// A GPU device tier's residents keep no host copy: the slot holds the only one, and a
    /// victim is copied down from it (device to host) on its way to RAM. Without a GPU the
    /// device tier is CPU memory and this does nothing.
    pub copy_down: bool,
    pub eviction: PolicyKind,
    pub aging_period: u64,
    /// Entries of the write-back ring.
    pub writeback_ring: usize,
    /// mlock (or register with CUDA) the RAM tier.
    pub pin: bool,
    /// The routing history: loaded at start to warm the tiers, saved at exit.
    pub history: Option<PathBuf>,
}

impl TierPlan {
    /// A plan with these slot caps and the defaults: LFU, prefetch, a 64-entry ring,
    /// pinning, no history. In `fast`/`exact` every expert is in RAM whatever the caps say.
    pub fn new(mode: Mode, device_slots: usize, ram_slots: usize, experts: usize) -> TierPlan {
        let (device_slots, ram_slots) = if mode.tiered() {
            (device_slots.min(experts), ram_slots.min(experts))
        } else {
            (0, experts)
        };
        TierPlan {
            mode,
            device_slots,
            ram_slots,
            staging_slots: STAGING_SLOTS,
            prefetch: mode.tiered(),
            fetch_overlap: true,
            copy_down: true,
            eviction: PolicyKind::Lfu,
            aging_period: AGING_PERIOD,
            writeback_ring: 64,
            pin: true,
            history: None,
        }
    }
}

/// What the plan needs to know of the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelSizes {
    pub moe_layers: usize,
    pub experts: usize,
    /// Bytes of one expert record as the source stores it (a RAM slot, a host copy).
    pub record_bytes: u64,
    /// Bytes of one VRAM slot (a resident or a staging slot), as the VRAM tier lays the
    /// record out ([`crate::backend::cuda::MoeLayout`]).
    pub slot_bytes: u64,
    /// Bytes of every weight but the routed experts, as the checkpoint stores them (the
    /// process holds them in host memory; all but `host_only_bytes` also go to the GPU).
    pub dense_bytes: u64,
    /// Of `dense_bytes`, what stays in host memory only (the embedding table: one row per
    /// token goes up).
    pub host_only_bytes: u64,
    /// Of `dense_bytes`, what the host keeps when the GPU holds the rest without host copies
    /// ([`SlotRequest::copy_down`]): `host_only_bytes`, MLA's `kv_b` (read by rows) and the
    /// weight vectors.
    pub host_kept_bytes: u64,
    /// The sequences' caches in VRAM, when sized here (else `SlotRequest::vram_reserve`
    /// covers them).
    pub cache_bytes: u64,
    /// The GPU forward's activations for a default prompt chunk, kept free in VRAM.
    pub gpu_workspace_bytes: u64,
}

impl ModelSizes {
    /// VRAM held besides the expert slots: the dense weights the GPU keeps, the caches, the
    /// workspace, the staging slots and `reserve`.
    pub fn vram_held(&self, reserve: u64) -> u64 {
        self.dense_bytes.saturating_sub(self.host_only_bytes)
            + self.cache_bytes
            + self.gpu_workspace_bytes
            + STAGING_SLOTS as u64 * self.slot_bytes
            + reserve
    }
}

/// What the flags ask for (`None`: size it from the machine).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotRequest {
    pub device_slots: Option<usize>,
    /// Device slots in all, spread over the MoE layers.
    pub device_slots_total: Option<usize>,
    pub ram_slots: Option<usize>,
    /// RAM-tier budget in bytes, all layers together.
    pub ram_budget: Option<u64>,
    /// Memory kept outside the RAM tier.
    pub ram_reserve: u64,
    /// VRAM kept free besides the dense weights, the staging and the GPU workspace.
    pub vram_reserve: u64,
    /// What VRAM holds keeps no host copy: neither the VRAM residents ([`TierPlan::copy_down`])
    /// nor the dense weights (their host bytes are given back once loaded, but
    /// [`ModelSizes::host_kept_bytes`]). With a GPU, the RAM budget does not hold them.
    pub copy_down: bool,
}

/// The machine, as far as sizing goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MachineFacts {
    /// Free VRAM of the GPU the device tier lives on; `None`: no GPU (the device tier is CPU
    /// memory).
    pub free_vram: Option<u64>,
    pub memory: MemoryFacts,
}

/// Slot counts and the numbers behind them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sizing {
    pub device_slots: usize,
    pub ram_slots: usize,
    /// How the device slots were chosen: "flag", "flag-total", "cpu-default" or "free-vram".
    pub device_basis: &'static str,
    /// Of `ram.held`: the device residents' host copies (none on a GPU with `copy_down`).
    pub device_copies: u64,
    /// Of `ram.held`: the dense weights the host keeps (on a GPU with `copy_down`, only
    /// [`ModelSizes::host_kept_bytes`]).
    pub dense_held: u64,
    /// Of the RAM budget: the records one forward may hold beside the tiers, a prompt
    /// chunk's reads of every expert of a layer that no tier holds (read, computed, then
    /// admitted or dropped); the RAM slots are what is left. 0 when the slots or the budget
    /// come from a flag.
    pub prompt_reads: u64,
    pub ram: sizing::RamPlan,
}

/// Slots per MoE layer for each tier. Device slots: the flags, else what the free VRAM
/// holds after the dense weights, the reserve, the GPU workspace and the staging slots (a
/// fixed default without a GPU). RAM slots: the flags, else the cgroup budget less what the
/// process holds, which includes the dense weights still to load and the device residents'
/// host copies (unless `copy_down` on a GPU: then a victim is copied down from VRAM, and of
/// the dense weights the host keeps only [`ModelSizes::host_kept_bytes`]).
pub fn size_tiers(model: &ModelSizes, request: &SlotRequest, machine: &MachineFacts) -> Sizing {
    let layers = model.moe_layers.max(1) as u64;
    let (device_slots, device_basis) = match (
        request.device_slots,
        request.device_slots_total,
        machine.free_vram,
    ) {
        (Some(n), _, _) => (n, "flag"),
        (None, Some(total), _) => (total / layers as usize, "flag-total"),
        (None, None, None) => (CPU_DEVICE_SLOTS, "cpu-default"),
        (None, None, Some(free)) => {
            let left = free.saturating_sub(model.vram_held(request.vram_reserve));
            (
                (left / (model.slot_bytes * layers).max(1)) as usize,
                "free-vram",
            )
        }
    };
    let device_slots = device_slots.min(model.experts);
    let (device_copies, dense_held) = if request.copy_down && machine.free_vram.is_some() {
        (0, model.host_kept_bytes.min(model.dense_bytes))
    } else {
        (
            device_slots as u64 * layers * model.record_bytes,
            model.dense_bytes,
        )
    };
    let ram = sizing::plan_ram_tier(
        &machine.memory,
        dense_held + device_copies,
        request.ram_reserve,
        request.ram_budget,
        model.record_bytes,
        model.moe_layers,
        model.experts,
    );
    let mut ram_slots = request
        .ram_slots
        .unwrap_or(ram.slots_per_layer)
        .min(model.experts);
    let mut prompt_reads = 0;
    if request.ram_slots.is_none() && request.ram_budget.is_none() {
        // A prompt chunk picks nearly every expert of a layer: the ones no tier holds are
        // read and held while the layer computes, beside the full tiers. Fewer RAM slots
        // mean more such reads, so take slots off until both fit the budget.
        let reads =
            |r: usize| model.experts.saturating_sub(device_slots + r) as u64 * model.record_bytes;
        while ram_slots > 0
            && ram_slots as u64 * layers * model.record_bytes + reads(ram_slots) > ram.budget
        {
            ram_slots -= 1;
        }
        prompt_reads = reads(ram_slots);
    }
    Sizing {
        device_slots,
        ram_slots,
        device_basis,
        device_copies,
        dense_held,
        prompt_reads,
        ram,
    }
}

impl MachineFacts {
    /// Reads this machine with `free_vram` (`None`: no GPU), once RLIMIT_MEMLOCK's soft limit
    /// is raised to its hard limit, so the facts hold the limit pinning will meet.
    pub fn read(free_vram: Option<u64>) -> MachineFacts {
        sizing::raise_memlock();
        MachineFacts {
            free_vram,
            memory: MemoryFacts::read(),
        }
    }
}

/// Warns (saying what to change) when `pinned` bytes of RAM tier cannot be pinned under the
/// memlock limit of `machine` and the process lacks CAP_IPC_LOCK.
pub fn warn_if_unpinnable(machine: &MachineFacts, pinned: u64) {
    if !sizing::has_ipc_lock()
        && let Some(problem) = sizing::memlock_problem(pinned, machine.memory.memlock_soft)
    {
        tracing::warn!("{problem}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn machine(free_vram: Option<u64>, cgroup: Option<u64>) -> MachineFacts {
        MachineFacts {
            free_vram,
            memory: MemoryFacts {
                cgroup_limit: cgroup,
                cgroup_source: cgroup.map(|_| "test".into()),
                rss: 100 * MIB,
                memlock_soft: None,
                memlock_hard: None,
                mem_available: Some(1 << 40),
            },
        }
    }

    fn request() -> SlotRequest {
        SlotRequest {
            device_slots: None,
            device_slots_total: None,
            ram_slots: None,
            ram_budget: None,
            ram_reserve: 2048 * MIB,
            vram_reserve: 1024 * MIB,
            copy_down: false,
        }
    }

    fn flash(dense_mib: u64) -> ModelSizes {
        ModelSizes {
            moe_layers: 42,
            experts: 288,
            record_bytes: 14 * MIB,
            slot_bytes: 14 * MIB,
            dense_bytes: dense_mib * MIB,
            host_only_bytes: 0,
            host_kept_bytes: 0,
            cache_bytes: 0,
            gpu_workspace_bytes: 0,
        }
    }

    #[test]
    fn vram_slots_fill_what_the_dense_weights_reserve_workspace_and_staging_leave() {
        // 24,000 MiB free, 9,000 dense, 1,024 reserve, 16 staging records of 14 MiB:
        // 13,752 MiB left for 42 layers of 14 MiB records -> 23 per layer.
        let s = size_tiers(
            &flash(9_000),
            &request(),
            &machine(Some(24_000 * MIB), None),
        );
        assert_eq!((s.device_slots, s.device_basis), (23, "free-vram"));
        // The workspace is held too: 1,176 MiB more takes two slots per layer.
        let model = ModelSizes {
            gpu_workspace_bytes: 1_176 * MIB,
            ..flash(9_000)
        };
        let s = size_tiers(&model, &request(), &machine(Some(24_000 * MIB), None));
        assert_eq!(s.device_slots, 21);
        // The embedding stays in host memory: its bytes are not held in VRAM (1,200 MiB
        // gives back two slots a layer).
        let model = ModelSizes {
            host_only_bytes: 1_200 * MIB,
            ..model
        };
        let s = size_tiers(&model, &request(), &machine(Some(24_000 * MIB), None));
        assert_eq!(s.device_slots, 23);
        // Never more than the layer's experts, never negative.
        let one = ModelSizes {
            moe_layers: 1,
            dense_bytes: 0,
            ..flash(0)
        };
        let open = SlotRequest {
            vram_reserve: 0,
            ..request()
        };
        assert_eq!(
            size_tiers(&one, &open, &machine(Some(1 << 40), None)).device_slots,
            288
        );
        assert_eq!(
            size_tiers(&flash(9_000), &open, &machine(Some(MIB), None)).device_slots,
            0
        );
    }

    #[test]
    fn flags_win_and_no_gpu_gets_the_cpu_default() {
        let m = machine(None, Some(64 << 30));
        let s = size_tiers(&flash(1_000), &request(), &m);
        assert_eq!(
            (s.device_slots, s.device_basis),
            (CPU_DEVICE_SLOTS, "cpu-default")
        );
        let r = SlotRequest {
            device_slots_total: Some(1_300),
            ram_slots: Some(7),
            ..request()
        };
        let s = size_tiers(&flash(1_000), &r, &machine(Some(1 << 40), None));
        assert_eq!(
            (s.device_slots, s.device_basis, s.ram_slots),
            (30, "flag-total", 7)
        );
        let r = SlotRequest {
            device_slots: Some(500),
            ..request()
        };
        assert_eq!(size_tiers(&flash(1_000), &r, &m).device_slots, 288);
    }

    #[test]
    fn ram_tier_holds_the_dense_weights_the_device_copies_and_a_prompts_reads_outside_its_slots() {
        // 64 GiB cap: budget = 64 GiB - (rss 100 MiB + dense 1,000 MiB + 4 x 42 device
        // copies of 14 MiB) - 2,048 MiB reserve.
        let s = size_tiers(&flash(1_000), &request(), &machine(None, Some(64 << 30)));
        let held = 100 * MIB + 1_000 * MIB + 4 * 42 * 14 * MIB;
        assert_eq!(s.ram.held, held);
        assert_eq!(s.ram.budget, (64 << 30) - held - 2048 * MIB);
        // The budget also holds a prompt chunk's reads of the experts no tier holds
        // (288 - 4 device - r RAM of them): r = 102 slots alone, 97 beside the reads.
        assert_eq!(s.ram.budget / (14 * MIB) / 42, 102);
        let need = |r: u64| (42 * r + 288 - 4 - r) * 14 * MIB;
        let r = s.ram_slots as u64;
        assert!(need(r) <= s.ram.budget && need(r + 1) > s.ram.budget);
        assert_eq!((r, s.prompt_reads), (97, (288 - 4 - 97) * 14 * MIB));
        // Slots or a budget from a flag are the tier's own: no reads taken off.
        let flagged = SlotRequest {
            ram_budget: Some(s.ram.budget),
            ..request()
        };
        let f = size_tiers(&flash(1_000), &flagged, &machine(None, Some(64 << 30)));
        assert_eq!((f.ram_slots, f.prompt_reads), (102, 0));
    }

    #[test]
    fn copying_victims_down_gives_the_device_copies_to_the_ram_tier_on_a_gpu_only() {
        let down = SlotRequest {
            device_slots: Some(20),
            copy_down: true,
            ..request()
        };
        let keep = SlotRequest {
            copy_down: false,
            ..down.clone()
        };
        let gpu = machine(Some(1 << 40), Some(64 << 30));
        // Of 1,000 MiB of dense weights the host keeps 300 once the GPU holds the rest.
        let model = ModelSizes {
            host_kept_bytes: 300 * MIB,
            ..flash(1_000)
        };
        let (k, d) = (
            size_tiers(&model, &keep, &gpu),
            size_tiers(&model, &down, &gpu),
        );
        assert_eq!(k.device_copies, 20 * 42 * 14 * MIB);
        assert_eq!(d.device_copies, 0);
        assert_eq!((k.dense_held, d.dense_held), (1_000 * MIB, 300 * MIB));
        assert_eq!(k.ram.held - d.ram.held, k.device_copies + 700 * MIB);
        // 840 records more of budget: more RAM slots a layer, as many as fit beside the
        // prompt chunk's reads.
        assert!(
            d.ram_slots > k.ram_slots,
            "{} vs {}",
            d.ram_slots,
            k.ram_slots
        );
        let need = |r: u64| (42 * r + 288 - 20 - r) * 14 * MIB;
        let r = d.ram_slots as u64;
        assert!(need(r) <= d.ram.budget && need(r + 1) > d.ram.budget);
        // Without a GPU the device tier is CPU memory: its residents are the copies, and the
        // dense weights have no other home.
        let cpu = machine(None, Some(64 << 30));
        let c = size_tiers(&model, &down, &cpu);
        assert_eq!(
            (c.device_copies, c.dense_held),
            (k.device_copies, 1_000 * MIB)
        );
    }

    #[test]
    fn untiered_modes_keep_every_expert_in_ram() {
        let p = TierPlan::new(Mode::Fast, 9, 3, 64);
        assert_eq!((p.device_slots, p.ram_slots, p.prefetch), (0, 64, false));
        let p = TierPlan::new(Mode::NvmeExact, 9, 300, 64);
        assert_eq!((p.device_slots, p.ram_slots, p.prefetch), (9, 64, true));
    }
}
