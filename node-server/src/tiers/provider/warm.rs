//! Warm start from a routing history: the policies take the saved counts, and the free
//! device and RAM slots fill with the most picked experts (at once for [`TieredExperts::warm_start`],
//! on a thread of its own for a server's [`TieredExperts::open_history`]).

use super::background::load_batch;
use super::{Layer, Shared, Staging, TieredExperts};
use crate::tiers::history::RoutingHistory;
use crate::tiers::pin::Pinned;
use crate::tiers::source::ExpertSource;
use std::sync::atomic::Ordering;

impl TieredExperts {
    /// With a history file in the plan: warm-starts the tiers from it when it matches
    /// `fingerprint` (the model's), and remembers where [`crate::model::moe::ExpertProvider::finish`] saves it.
    /// The policies take the saved counts at once; the slots fill in the background (see
    /// [`TieredExperts::fill_in_background`]), so the server is ready as soon as a cold one.
    pub fn open_history(&self, fingerprint: &str) -> anyhow::Result<()> {
        let Some(path) = &self.plan.history else {
            return Ok(());
        };
        let layers = self.picks.len();
        match RoutingHistory::load(path, fingerprint, layers, self.experts) {
            Some(h) => {
                let wanted = self.seed_policies(&h, self.plan.aging_period);
                tracing::info!(path = %path.display(), experts = wanted.iter().map(|(_, e)| e.len()).sum::<usize>(), "routing history read: filling the tiers' slots from it in the background");
                self.fill_in_background(wanted);
            }
            None => {
                tracing::info!(path = %path.display(), "no usable routing history; starting cold")
            }
        }
        let _ = self
            .history_file
            .set((path.clone(), fingerprint.to_string()));
        Ok(())
    }

    /// Warm start: seeds each layer's policy with the saved counts and loads the most picked
    /// experts into the device tier, then the RAM tier, up to their caps; returns how many.
    pub fn warm_start(&self, history: &RoutingHistory, aging_period: u64) -> anyhow::Result<usize> {
        let wanted = self.seed_policies(history, aging_period);
        fill_slots(
            self.source.as_ref(),
            &self.shared,
            &self.staged,
            self.device_slots,
            &wanted,
            &std::sync::atomic::AtomicBool::new(false),
        )
    }

    /// Seeds each MoE layer's policies with the history's counts; gives each layer's most
    /// picked experts, as many as its device and RAM slots hold, most picked first.
    fn seed_policies(
        &self,
        history: &RoutingHistory,
        aging_period: u64,
    ) -> Vec<(usize, Vec<usize>)> {
        let mut wanted = Vec::new();
        for (layer, row) in history.counts.iter().enumerate() {
            if row.is_empty() || !self.mode.tiered() {
                continue;
            }
            let counts: Vec<f64> = row.iter().map(|&c| c as f64).collect();
            let mut l = self.layer(layer);
            l.device_policy = self.policy.build(self.experts, aging_period, Some(&counts));
            l.ram_policy = self.policy.build(self.experts, aging_period, Some(&counts));
            let mut ranked = history.ranked(layer);
            ranked.truncate(self.device_slots + self.ram_slots);
            wanted.push((layer, ranked));
        }
        wanted
    }

    /// Fills the free device and RAM slots with `wanted` (per layer, most picked first) on a
    /// thread of its own while lookups go on: a lookup that comes first keeps its place (the
    /// fill never evicts), and the fill reads the store in batches at queue depth.
    fn fill_in_background(&self, wanted: Vec<(usize, Vec<usize>)>) {
        let (source, shared, staged, stop) = (
            self.source.clone(),
            self.shared.clone(),
            self.staged.clone(),
            self.stop_filling.clone(),
        );
        let device_slots = self.device_slots;
        let thread = std::thread::Builder::new()
            .name("tier-fill".into())
            .spawn(move || {
                let started = std::time::Instant::now();
                match fill_slots(source.as_ref(), &shared, &staged, device_slots, &wanted, &stop) {
                    Ok(loaded) => {
                        tracing::info!(loaded, secs = started.elapsed().as_secs_f64(), "tiers warm-started from the routing history");
                        loaded
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "filling the tiers from the routing history stopped");
                        0
                    }
                }
            });
        match thread {
            Ok(t) => *self.filler.lock().unwrap_or_else(|e| e.into_inner()) = Some(t),
            Err(e) => tracing::warn!(error = %e, "no thread to fill the tiers from the history"),
        }
    }

    /// Waits for the background fill of [`TieredExperts::open_history`], if one runs; gives
    /// how many experts it loaded.
    pub fn wait_filled(&self) -> usize {
        let t = self.filler.lock().unwrap_or_else(|e| e.into_inner()).take();
        t.map_or(0, |t| t.join().unwrap_or(0))
    }
}

/// Experts a fill reads in one batch: enough for queue depth, few enough that the fill
/// stops soon when told and lookups' own reads get their turn.
const FILL_BATCH: usize = 16;

/// Loads `wanted` (per layer, most wanted first) into the free device slots, then the free
/// RAM slots, skipping what is resident or on its way down already; never evicts. An expert
/// the prefetcher has staged moves from the staging into its slot (no second read, no second
/// copy), and a staged copy of one the fill read is dropped. Returns how many it loaded; ends
/// early when `stop` is set.
fn fill_slots(
    source: &dyn ExpertSource,
    shared: &Shared,
    staged: &Staging,
    device_slots: usize,
    wanted: &[(usize, Vec<usize>)],
    stop: &std::sync::atomic::AtomicBool,
) -> anyhow::Result<usize> {
    let held = |l: &Layer, e: &usize| l.holds(*e);
    let lock = |layer: usize| shared.layers[layer].lock().expect("tier lock");
    let stage = || staged.lock().expect("staging lock");
    let mut loaded = 0;
    for (layer, experts) in wanted {
        for chunk in experts.chunks(FILL_BATCH) {
            if stop.load(Ordering::Relaxed) {
                return Ok(loaded);
            }
            // The chunk's experts no tier holds, in order, with the staged ones' weights.
            let todo: Vec<(usize, Option<_>)> = {
                let l = lock(*layer);
                if l.device.len() >= device_slots && l.ram.len() >= shared.ram_slots {
                    break;
                }
                let mut s = stage();
                chunk
                    .iter()
                    .filter(|e| !held(&l, e))
                    .map(|&e| (e, s.remove(&(*layer, e))))
                    .collect()
            };
            let missing: Vec<usize> = todo
                .iter()
                .filter(|(_, w)| w.is_none())
                .map(|&(e, _)| e)
                .collect();
            let mut read = load_batch(source, &shared.stats, *layer, &missing)?.into_iter();
            let mut l = lock(*layer);
            for (e, w) in todo {
                let Some(w) = w.or_else(|| read.next()) else {
                    break;
                };
                if held(&l, &e) {
                    continue;
                }
                if stage().remove(&(*layer, e)).is_some() {
                    // Staged while the fill read it: the slot's copy serves the lookups.
                    shared.stats.prefetch_wasted.fetch_add(1, Ordering::Relaxed);
                }
                if l.device.len() < device_slots {
                    l.device.insert(e, Some(w));
                } else if l.ram.len() < shared.ram_slots {
                    l.ram.insert(e, Pinned::new(w, &shared.pins));
                } else {
                    break;
                }
                loaded += 1;
            }
        }
    }
    Ok(loaded)
}
