//! How much memory the RAM tier may take: the container's cgroup limit minus what the process
//! already holds, and whether that memory can be pinned (RLIMIT_MEMLOCK).

use std::path::Path;

/// Memory facts of this process's container, read from the kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryFacts {
    /// The cgroup memory limit, `None` when unlimited (or no cgroup file is readable).
    pub cgroup_limit: Option<u64>,
    /// Where the limit was read.
    pub cgroup_source: Option<String>,
    /// Resident set size of this process now.
    pub rss: u64,
    /// RLIMIT_MEMLOCK soft and hard limits (`None`: unlimited).
    pub memlock_soft: Option<u64>,
    pub memlock_hard: Option<u64>,
    /// `MemAvailable` of the machine, the budget's base when no cgroup limit is set.
    pub mem_available: Option<u64>,
}

/// cgroup v1 reports "no limit" as a huge page-rounded number.
const V1_UNLIMITED_ABOVE: u64 = 1 << 62;

/// Reads the cgroup limit: v2 `memory.max` (at the cgroup root the container sees, or under
/// the process's own cgroup path), then v1 `memory.limit_in_bytes`.
pub fn cgroup_limit(root: &Path) -> Option<(u64, String)> {
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let own_path = |prefix: &str| {
        own.lines()
            .find_map(|l| {
                l.split_once(':')
                    .and_then(|(_, rest)| rest.strip_prefix(prefix))
            })
            .map(|p| p.trim_start_matches('/').to_string())
            .filter(|p| !p.is_empty())
    };
    let mut candidates = vec![root.join("memory.max")];
    if let Some(p) = own_path(":") {
        candidates.push(root.join(p).join("memory.max"));
    }
    candidates.push(root.join("memory/memory.limit_in_bytes"));
    if let Some(p) = own_path("memory:") {
        candidates.push(root.join("memory").join(p).join("memory.limit_in_bytes"));
    }
    for path in candidates {
        if let Ok(text) = std::fs::read_to_string(&path)
            && let Some(limit) = parse_limit(&text)
        {
            return Some((limit, path.display().to_string()));
        }
    }
    None
}

/// `max` (v2) and v1's near-2^63 sentinel mean unlimited.
pub fn parse_limit(text: &str) -> Option<u64> {
    let t = text.trim();
    if t == "max" {
        return None;
    }
    t.parse::<u64>().ok().filter(|&v| v < V1_UNLIMITED_ABOVE)
}

/// This process's resident set size (0 where /proc cannot say).
pub fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn memlock_limits() -> (Option<u64>, Option<u64>) {
    let rlim = rustix::process::getrlimit(rustix::process::Resource::Memlock);
    (rlim.current, rlim.maximum)
}

fn mem_available() -> Option<u64> {
    std::fs::read_to_string("/proc/meminfo")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

impl MemoryFacts {
    pub fn read() -> MemoryFacts {
        MemoryFacts::read_at(Path::new("/sys/fs/cgroup"))
    }

    /// As [`MemoryFacts::read`] with the cgroup tree mounted at `cgroup_root`.
    pub fn read_at(cgroup_root: &Path) -> MemoryFacts {
        let cg = cgroup_limit(cgroup_root);
        let (memlock_soft, memlock_hard) = memlock_limits();
        MemoryFacts {
            cgroup_limit: cg.as_ref().map(|c| c.0),
            cgroup_source: cg.map(|c| c.1),
            rss: rss_bytes(),
            memlock_soft,
            memlock_hard,
            mem_available: mem_available(),
        }
    }
}

/// Raises RLIMIT_MEMLOCK's soft limit to the hard limit when that helps; returns the
/// resulting soft limit (`None`: unlimited).
pub fn raise_memlock() -> Option<u64> {
    let rlim = rustix::process::getrlimit(rustix::process::Resource::Memlock);
    if rlim.current != rlim.maximum {
        let raised = rustix::process::Rlimit {
            current: rlim.maximum,
            maximum: rlim.maximum,
        };
        if let Err(e) = rustix::process::setrlimit(rustix::process::Resource::Memlock, raised) {
            tracing::warn!(error = %e, "could not raise RLIMIT_MEMLOCK to its hard limit");
        }
    }
    rustix::process::getrlimit(rustix::process::Resource::Memlock).current
}

/// How big the RAM tier is, and from what.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RamPlan {
    /// The cgroup limit (`None`: unlimited) and where it was read.
    pub limit: Option<u64>,
    pub source: Option<String>,
    /// What the process holds or will hold outside the tier: resident now plus the
    /// non-expert weights still to load.
    pub held: u64,
    pub reserve: u64,
    /// Bytes for the RAM tier, all MoE layers together.
    pub budget: u64,
    pub slots_per_layer: usize,
    /// Where the budget came from, for the log.
    pub basis: &'static str,
}

/// Sizes the RAM tier: `budget_override` bytes when given; else the cgroup limit minus what
/// the process holds (`facts.rss + held_extra`) minus `reserve` (KV cache, workspace,
/// headroom); with no cgroup limit, `MemAvailable` minus `reserve`. The budget is divided
/// by the record size and shared evenly by the MoE layers, never more than `experts` each.
pub fn plan_ram_tier(
    facts: &MemoryFacts,
    held_extra: u64,
    reserve: u64,
    budget_override: Option<u64>,
    record_bytes: u64,
    moe_layers: usize,
    experts: usize,
) -> RamPlan {
    let held = facts.rss + held_extra;
    let (budget, basis) = match (budget_override, facts.cgroup_limit) {
        (Some(bytes), _) => (bytes, "flag"),
        (None, Some(limit)) => (limit.saturating_sub(held).saturating_sub(reserve), "cgroup"),
        (None, None) => (
            facts.mem_available.unwrap_or(0).saturating_sub(reserve),
            "mem_available",
        ),
    };
    let slots = budget / record_bytes.max(1) / moe_layers.max(1) as u64;
    RamPlan {
        limit: facts.cgroup_limit,
        source: facts.cgroup_source.clone(),
        held,
        reserve,
        budget,
        slots_per_layer: (slots as usize).min(experts),
        basis,
    }
}

/// Whether this process holds CAP_IPC_LOCK, which lifts RLIMIT_MEMLOCK for mlock.
pub fn has_ipc_lock() -> bool {
    const CAP_IPC_LOCK: u32 = 14;
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .is_some_and(|caps| caps >> CAP_IPC_LOCK & 1 == 1)
}

/// A plain message saying what to change when `bytes` cannot be pinned under the memlock limit.
pub fn memlock_problem(bytes: u64, soft: Option<u64>) -> Option<String> {
    match soft {
        Some(limit) if limit < bytes => Some(format!(
            "RLIMIT_MEMLOCK is {} KiB but the RAM tier needs {} MiB pinned: run the container with \
             `--ulimit memlock=-1` or `ulimit -l unlimited` (Kubernetes: add the IPC_LOCK \
             capability), or lower --ram-slots / --ram-budget-mib; serving continues unpinned",
            limit >> 10,
            bytes >> 20
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_v1_and_v2_limits() {
        assert_eq!(parse_limit("max\n"), None);
        assert_eq!(parse_limit("59055800320\n"), Some(59_055_800_320));
        assert_eq!(parse_limit("9223372036854771712\n"), None);
        assert_eq!(parse_limit("garbage"), None);
    }

    #[test]
    fn reads_a_v2_cgroup_tree() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("memory.max"), "17179869184\n").unwrap();
        let (limit, source) = cgroup_limit(dir.path()).unwrap();
        assert_eq!(limit, 16 << 30);
        assert!(source.ends_with("memory.max"));
        let v1 = tempfile::tempdir().unwrap();
        std::fs::create_dir(v1.path().join("memory")).unwrap();
        std::fs::write(
            v1.path().join("memory/memory.limit_in_bytes"),
            "1073741824\n",
        )
        .unwrap();
        assert_eq!(cgroup_limit(v1.path()).unwrap().0, 1 << 30);
    }

    #[test]
    fn budget_from_a_fake_cgroup_minus_held_and_reserve() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("memory.max"), "8589934592\n").unwrap();
        let facts = MemoryFacts::read_at(dir.path());
        assert_eq!(facts.cgroup_limit, Some(8 << 30));
        assert!(facts.rss > 0);
        let (record, layers, dense, reserve) = (3u64 << 20, 4, 256u64 << 20, 1u64 << 30);
        let plan = plan_ram_tier(&facts, dense, reserve, None, record, layers, 10_000);
        assert_eq!(plan.basis, "cgroup");
        assert_eq!(plan.held, facts.rss + dense);
        assert_eq!(plan.budget, (8u64 << 30) - facts.rss - dense - reserve);
        assert_eq!(
            plan.slots_per_layer as u64,
            plan.budget / record / layers as u64
        );
        // Capped by the experts that exist; the flag wins over the cgroup.
        assert_eq!(
            plan_ram_tier(&facts, dense, reserve, None, record, layers, 5).slots_per_layer,
            5
        );
        let flag = plan_ram_tier(&facts, dense, reserve, Some(120 << 20), record, 4, 10_000);
        assert_eq!((flag.basis, flag.slots_per_layer), ("flag", 10));
        // Held memory over the limit leaves no RAM tier rather than underflowing.
        let tight = plan_ram_tier(&facts, 9 << 30, reserve, None, record, layers, 10_000);
        assert_eq!((tight.budget, tight.slots_per_layer), (0, 0));
        // A v2 "max" falls back to MemAvailable.
        std::fs::write(dir.path().join("memory.max"), "max\n").unwrap();
        let unlimited = MemoryFacts {
            mem_available: Some(4 << 30),
            ..MemoryFacts::read_at(dir.path())
        };
        assert_eq!(unlimited.cgroup_limit, None);
        let plan = plan_ram_tier(&unlimited, 0, 1 << 30, None, 1 << 20, 3, 10_000);
        assert_eq!((plan.basis, plan.slots_per_layer), ("mem_available", 1024));
    }

    #[test]
    fn memlock_message_says_what_to_change() {
        assert!(memlock_problem(1 << 30, None).is_none());
        let msg = memlock_problem(1 << 30, Some(64 << 10)).unwrap();
        assert!(
            msg.contains("RLIMIT_MEMLOCK is 64 KiB") && msg.contains("--ulimit memlock=-1"),
            "{msg}"
        );
    }

    #[test]
    fn reads_this_process() {
        let facts = MemoryFacts::read();
        assert!(facts.rss > 0);
    }
}
