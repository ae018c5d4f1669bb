//! Which expert leaves a full tier: interchangeable per-layer policies behind one trait.
//!
//! [`Lfu`] counts lookups and halves every count each `period` lookups (aging), so a
//! popularity shift wins within a few periods while one-off picks never push out the
//! steady favourites; [`Lru`] is the baseline it is measured against. A candidate only
//! displaces a resident expert when it is at least as popular (frequency-aware admission).

/// Scores one layer's experts; the lowest-scored resident expert is the victim.
pub trait Policy: Send {
    /// An expert of this layer was looked up.
    fn touch(&mut self, expert: usize);
    /// Higher is more worth keeping.
    fn score(&self, expert: usize) -> f64;
    fn name(&self) -> &'static str;

    /// The resident expert to evict, lowest score first, ties to the lower id.
    fn victim(&self, resident: &[usize]) -> Option<usize> {
        resident
            .iter()
            .copied()
            .min_by(|&a, &b| self.score(a).total_cmp(&self.score(b)).then(a.cmp(&b)))
    }

    /// Whether `candidate` should replace `victim`.
    fn admit(&self, candidate: usize, victim: usize) -> bool {
        self.score(candidate) >= self.score(victim)
    }
}

/// Which [`Policy`] a tier uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyKind {
    /// Frequency with aging (the default).
    #[default]
    Lfu,
    /// Recency, the baseline.
    Lru,
}

impl PolicyKind {
    /// A fresh policy over `experts`; `counts` warm-starts LFU (LRU has no use for them).
    pub fn build(self, experts: usize, period: u64, counts: Option<&[f64]>) -> Box<dyn Policy> {
        match (self, counts) {
            (PolicyKind::Lfu, Some(c)) => Box::new(Lfu::with_counts(c, period)),
            (PolicyKind::Lfu, None) => Box::new(Lfu::new(experts, period)),
            (PolicyKind::Lru, _) => Box::new(Lru::new(experts)),
        }
    }
}

pub struct Lfu {
    counts: Vec<f64>,
    lookups: u64,
    period: u64,
}

impl Lfu {
    /// `period`: lookups between halvings (e.g. a few thousand tokens' worth of picks).
    pub fn new(experts: usize, period: u64) -> Lfu {
        Lfu {
            counts: vec![0.0; experts],
            lookups: 0,
            period: period.max(1),
        }
    }

    /// Starts from a saved histogram (warm start).
    pub fn with_counts(counts: &[f64], period: u64) -> Lfu {
        Lfu {
            counts: counts.to_vec(),
            lookups: 0,
            period: period.max(1),
        }
    }

    pub fn counts(&self) -> &[f64] {
        &self.counts
    }
}

impl Policy for Lfu {
    fn touch(&mut self, expert: usize) {
        self.counts[expert] += 1.0;
        self.lookups += 1;
        if self.lookups.is_multiple_of(self.period) {
            self.counts.iter_mut().for_each(|c| *c *= 0.5);
        }
    }

    fn score(&self, expert: usize) -> f64 {
        self.counts[expert]
    }

    fn name(&self) -> &'static str {
        "lfu"
    }
}

pub struct Lru {
    last: Vec<u64>,
    clock: u64,
}

impl Lru {
    pub fn new(experts: usize) -> Lru {
        Lru {
            last: vec![0; experts],
            clock: 0,
        }
    }
}

impl Policy for Lru {
    fn touch(&mut self, expert: usize) {
        self.clock += 1;
        self.last[expert] = self.clock;
    }

    fn score(&self, expert: usize) -> f64 {
        self.last[expert] as f64
    }

    fn name(&self) -> &'static str {
        "lru"
    }

    /// LRU always admits the newcomer.
    fn admit(&self, _candidate: usize, _victim: usize) -> bool {
        true
    }
}

/// Replays `trace` (expert ids of one layer) through a cache of `slots` under `policy`;
/// returns the hit rate. Misses that the policy declines to admit are served uncached.
pub fn simulate(policy: &mut dyn Policy, slots: usize, trace: &[usize]) -> f64 {
    let mut resident: Vec<usize> = Vec::with_capacity(slots);
    let mut hits = 0usize;
    for &e in trace {
        policy.touch(e);
        if resident.contains(&e) {
            hits += 1;
            continue;
        }
        if resident.len() < slots {
            resident.push(e);
        } else if let Some(v) = policy.victim(&resident)
            && policy.admit(e, v)
        {
            let at = resident
                .iter()
                .position(|&r| r == v)
                .expect("victim is resident");
            resident[at] = e;
        }
    }
    hits as f64 / trace.len().max(1) as f64
}

/// A routing-like trace: `picks` per token from a Zipf(`s`) popularity over `experts`,
/// distinct within a token, popularity order shuffled by `seed`.
pub fn zipf_trace(experts: usize, picks: usize, tokens: usize, s: f64, seed: u64) -> Vec<usize> {
    use rand::{Rng, SeedableRng, seq::SliceRandom};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut order: Vec<usize> = (0..experts).collect();
    order.shuffle(&mut rng);
    let weights: Vec<f64> = (1..=experts).map(|r| (r as f64).powf(-s)).collect();
    let total: f64 = weights.iter().sum();
    let mut trace = Vec::with_capacity(tokens * picks);
    for _ in 0..tokens {
        let mut chosen: Vec<usize> = Vec::with_capacity(picks);
        while chosen.len() < picks.min(experts) {
            let mut r = rng.random_range(0.0..total);
            let mut rank = 0;
            while rank + 1 < experts && r >= weights[rank] {
                r -= weights[rank];
                rank += 1;
            }
            let e = order[rank];
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        trace.extend(chosen);
    }
    trace
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lfu_beats_lru_on_skewed_routing() {
        let trace = zipf_trace(288, 8, 3000, 1.0, 1);
        let lfu = simulate(&mut Lfu::new(288, 8 * 512), 64, &trace);
        let lru = simulate(&mut Lru::new(288), 64, &trace);
        assert!(lfu > lru + 0.05, "lfu {lfu:.3} vs lru {lru:.3}");
    }

    #[test]
    fn aging_follows_a_popularity_shift() {
        // The first half favours one order, the second half another: aged LFU recovers.
        let mut trace = zipf_trace(64, 4, 2000, 1.2, 2);
        let second = zipf_trace(64, 4, 2000, 1.2, 3);
        let split = trace.len();
        trace.extend(&second);
        let mut lfu = Lfu::new(64, 256);
        simulate(&mut lfu, 16, &trace[..split]);
        let late = simulate(&mut lfu, 16, &trace[split..]);
        let fresh = simulate(&mut Lfu::new(64, 256), 16, &second);
        assert!(late > fresh - 0.05, "aged {late:.3} vs fresh {fresh:.3}");
    }

    #[test]
    fn victim_is_least_valuable_with_stable_ties() {
        let mut lfu = Lfu::new(4, 1000);
        for e in [0, 0, 1, 2, 2, 2] {
            lfu.touch(e);
        }
        assert_eq!(lfu.victim(&[0, 1, 2]), Some(1));
        assert_eq!(lfu.victim(&[3, 1]), Some(3));
        assert!(!lfu.admit(3, 0));
        assert!(lfu.admit(2, 0));
    }
}
