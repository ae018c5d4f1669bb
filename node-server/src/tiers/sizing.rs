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
}

/// cgroup v1 reports "no limit" as a huge page-rounded number.
const V1_UNLIMITED_ABOVE: u64 = 1 << 62;

/// Reads the cgroup limit: v2 `memory.max` (at the cgroup root the container sees, or under
/// the process's own cgroup path), then v1 `memory.limit_in_bytes`.
pub fn cgroup_limit(root: &Path) -> Option<(u64, String)> {
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let v2_path = own
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(|p| p.trim_start_matches('/').to_string());
    let mut candidates = vec![root.join("memory.max")];
    if let Some(p) = v2_path.filter(|p| !p.is_empty()) {
        candidates.push(root.join(p).join("memory.max"));
    }
    candidates.push(root.join("memory/memory.limit_in_bytes"));
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

fn rss_bytes() -> u64 {
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

impl MemoryFacts {
    pub fn read() -> MemoryFacts {
        let cg = cgroup_limit(Path::new("/sys/fs/cgroup"));
        let (memlock_soft, memlock_hard) = memlock_limits();
        MemoryFacts {
            cgroup_limit: cg.as_ref().map(|c| c.0),
            cgroup_source: cg.map(|c| c.1),
            rss: rss_bytes(),
            memlock_soft,
            memlock_hard,
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

/// The RAM tier's budget in slots of `record_bytes`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RamBudget {
    pub slots: usize,
    pub bytes: u64,
    /// Why this many, for the start-up log.
    pub reason: String,
}

/// Slots the RAM tier may take: `explicit` wins; else the cgroup limit minus the process's
/// resident memory minus `reserve` (KV cache, workspace, headroom); unlimited cgroups fall
/// back to `fallback_bytes`. Never more than `wanted` (the experts that exist).
pub fn ram_budget(
    facts: &MemoryFacts,
    record_bytes: u64,
    explicit: Option<usize>,
    reserve: u64,
    fallback_bytes: u64,
    wanted: usize,
) -> RamBudget {
    if let Some(slots) = explicit {
        let slots = slots.min(wanted);
        return RamBudget {
            slots,
            bytes: slots as u64 * record_bytes,
            reason: format!("--ram-slots {slots}"),
        };
    }
    let (available, why) = match facts.cgroup_limit {
        Some(limit) => {
            let free = limit.saturating_sub(facts.rss).saturating_sub(reserve);
            (
                free,
                format!(
                    "cgroup limit {} MiB ({}) - resident {} MiB - reserve {} MiB",
                    limit >> 20,
                    facts.cgroup_source.as_deref().unwrap_or("?"),
                    facts.rss >> 20,
                    reserve >> 20
                ),
            )
        }
        None => (
            fallback_bytes,
            format!(
                "no cgroup limit; default budget {} MiB",
                fallback_bytes >> 20
            ),
        ),
    };
    let slots = ((available / record_bytes.max(1)) as usize).min(wanted);
    RamBudget {
        slots,
        bytes: slots as u64 * record_bytes,
        reason: why,
    }
}

/// A plain message saying what to change when `bytes` cannot be pinned under the memlock limit.
pub fn memlock_problem(bytes: u64, soft: Option<u64>) -> Option<String> {
    match soft {
        Some(limit) if limit < bytes => Some(format!(
            "RLIMIT_MEMLOCK is {} KiB but the RAM tier needs {} MiB pinned: run the container with \
             `--ulimit memlock=-1` (Kubernetes: add the IPC_LOCK capability), or lower --ram-slots",
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
    fn budget_from_cgroup_minus_resident_and_reserve() {
        let facts = MemoryFacts {
            cgroup_limit: Some(55 << 30),
            cgroup_source: Some("/sys/fs/cgroup/memory.max".into()),
            rss: 5 << 30,
            memlock_soft: None,
            memlock_hard: None,
        };
        let b = ram_budget(&facts, 10 << 20, None, 2 << 30, 0, 100_000);
        assert_eq!(b.slots, (48usize << 30) / (10 << 20));
        assert!(b.reason.contains("cgroup limit 56320 MiB"), "{}", b.reason);
        assert_eq!(ram_budget(&facts, 10 << 20, Some(7), 0, 0, 5).slots, 5);
        let unlimited = MemoryFacts {
            cgroup_limit: None,
            ..facts
        };
        assert_eq!(
            ram_budget(&unlimited, 1 << 20, None, 0, 64 << 20, 1000).slots,
            64
        );
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
