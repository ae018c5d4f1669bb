//! What the tiers hold and did, read without changing them: the GPU tier's counters and
//! summary, the routing history, and each layer's residents.

use super::*;

impl TieredExperts {
    /// The pinned arena RAM residents live in, if there is one.
    pub fn arena(&self) -> Option<&Arc<crate::tiers::arena::RamArena>> {
        self.shared.arena.as_ref()
    }

    /// RAM residents of every layer whose weights are in a slot of the pinned arena.
    pub fn residents_in_arena(&self) -> usize {
        self.shared
            .layers
            .iter()
            .map(|l| {
                let l = l.lock().expect("tier lock");
                l.ram.values().filter(|p| p.in_arena()).count()
            })
            .sum()
    }

    /// The GPU device tier's counters, when there is one.
    pub fn gpu_stats(&self) -> Option<crate::tiers::vram::GpuStats> {
        let g = self.gpu.as_ref()?.lock().unwrap_or_else(|e| e.into_inner());
        Some(g.stats())
    }

    /// `"gpu: N picks, M on the CPU lane, X MiB host->device, ..."` when the device tier is a
    /// GPU.
    pub fn gpu_summary(&self) -> Option<String> {
        let g = self.gpu.as_ref()?.lock().unwrap_or_else(|e| e.into_inner());
        let parts = g
            .parts
            .mean_ms()
            .iter()
            .map(|(name, ms)| format!("{name} {ms:.3}"))
            .collect::<Vec<_>>()
            .join(", ");
        Some(format!(
            "gpu ({}): {} picks on the GPU, {} on the CPU lane, {} MiB host->device, {} victims copied down ({} MiB; residents' host copies {}), {} MiB of RAM residents registered with CUDA; a sampled MoE step's parts alone, ms: {parts}",
            g.cuda().describe(),
            g.gpu_picks,
            g.cpu_picks,
            g.h2d_bytes >> 20,
            self.stats.copied_down.load(Ordering::Relaxed),
            g.d2h_bytes >> 20,
            if self.plan.copy_down {
                "dropped"
            } else {
                "kept"
            },
            self.pins.registered_bytes.load(Ordering::Relaxed) >> 20
        ))
    }

    /// The routing history so far, bound to `fingerprint`.
    pub fn history(&self, fingerprint: &str) -> crate::tiers::history::RoutingHistory {
        crate::tiers::history::RoutingHistory {
            version: crate::tiers::history::HISTORY_VERSION,
            fingerprint: fingerprint.to_string(),
            experts: self.experts,
            counts: self
                .picks
                .iter()
                .map(|row| row.iter().map(|c| c.load(Ordering::Relaxed)).collect())
                .collect(),
        }
    }

    /// Experts the prefetcher has read ahead that no lookup has taken yet.
    pub fn staged_count(&self) -> usize {
        self.staged.lock().expect("staging lock").len()
    }

    /// Device and RAM residents of `layer` (for invariant checks and the tier summary).
    pub fn layer_residents(&self, layer: usize) -> (Vec<usize>, Vec<usize>) {
        let (device, ram, _) = self.layer_snapshot(layer);
        (device, ram)
    }

    /// Device residents, RAM residents and write-backs in flight of `layer`, taken at one
    /// instant (under the layer's lock), each sorted.
    pub fn layer_snapshot(&self, layer: usize) -> (Vec<usize>, Vec<usize>, Vec<usize>) {
        let l = self.layer(layer);
        let sorted = |keys: Vec<usize>| {
            let mut k = keys;
            k.sort_unstable();
            k
        };
        (
            sorted(l.device.keys().copied().collect()),
            sorted(l.ram.keys().copied().collect()),
            sorted(l.in_flight.keys().copied().collect()),
        )
    }

    /// Where `(layer, expert)` resides now.
    /// (A write-back in flight counts as RAM, where it is going.)
    pub fn residency(&self, layer: usize, expert: usize) -> Tier {
        let l = self.layer(layer);
        if l.device.contains_key(&expert) {
            Tier::Device
        } else if l.ram.contains_key(&expert) || l.in_flight.contains_key(&expert) {
            Tier::Ram
        } else {
            Tier::Store
        }
    }

    /// Resident experts per tier, all MoE layers (write-backs in flight count as RAM).
    pub fn resident(&self, tier: Tier) -> usize {
        self.shared
            .layers
            .iter()
            .map(|l| {
                let l = l.lock().expect("tier lock");
                let ram = l.ram.len() + l.in_flight.len();
                match tier {
                    Tier::Device => l.device.len(),
                    Tier::Ram => ram,
                    Tier::Store => self.experts.saturating_sub(l.device.len() + ram),
                }
            })
            .sum::<usize>()
            - match tier {
                // Dense layers have no experts to hold.
                Tier::Store => (self.shared.layers.len() - self.moe_layers) * self.experts,
                _ => 0,
            }
    }
}
