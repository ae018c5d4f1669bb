//! The tiered [`ExpertProvider`]: every routed expert resides in exactly one of the device
//! tier, the RAM tier, or only in its source (the packed store), and moves between them by
//! per-layer policy as the router picks it.
//!
//! Whatever tier serves an expert, its weights are the same bytes and the product runs the
//! same code, so every mode gives logits bit-identical to the untiered engine. On a machine
//! without a GPU the device tier is a CPU-memory tier with its own slot cap, so the full
//! three-tier logic runs (and is tested) anywhere.

use super::policy::{Lfu, Policy};
use crate::model::checkpoint::Checkpoint;
use crate::model::config::Config;
use crate::model::loader::Loader;
use crate::model::mlp::SwiGlu;
use crate::model::moe::{ExpertProvider, Routing, combine_experts};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Where experts come from on a miss: the packed store (or, untiered, the checkpoint).
pub trait ExpertSource: Send + Sync {
    fn load(&self, layer: usize, expert: usize) -> anyhow::Result<SwiGlu>;
    /// Bytes of one expert record as this source stores it.
    fn record_bytes(&self) -> usize;
}

/// Serving modes, as the seed names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// All experts in RAM, CPU lane on.
    Fast,
    /// All experts in RAM, every product by the same kernel.
    Exact,
    /// Tiered over device, RAM and store; CPU lane on.
    Nvme,
    /// Tiered; every product by the same kernel.
    NvmeExact,
}

impl Mode {
    pub fn tiered(self) -> bool {
        matches!(self, Mode::Nvme | Mode::NvmeExact)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tier {
    Device,
    Ram,
    Store,
}

impl Tier {
    pub fn name(self) -> &'static str {
        match self {
            Tier::Device => "vram",
            Tier::Ram => "ram",
            Tier::Store => "nvme",
        }
    }
}

/// Lookup and movement counters (exported as metrics by the server).
#[derive(Debug, Default)]
pub struct TierStats {
    /// `[tier][phase]`, phase 0 = prefill, 1 = decode.
    pub lookups: [[AtomicU64; 2]; 3],
    pub loads: AtomicU64,
    pub promotions: AtomicU64,
    pub demotions: AtomicU64,
    pub bypassed: AtomicU64,
    /// Layer-ahead prefetch: reads issued, reads a lookup then used, reads never used.
    pub prefetch_issued: AtomicU64,
    pub prefetch_hits: AtomicU64,
    pub prefetch_wasted: AtomicU64,
}

impl TierStats {
    pub fn lookups(&self, tier: Tier) -> u64 {
        self.lookups[tier as usize]
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum()
    }
}

struct Layer {
    device: HashMap<usize, Arc<SwiGlu>>,
    ram: HashMap<usize, Arc<SwiGlu>>,
    device_policy: Box<dyn Policy>,
    ram_policy: Box<dyn Policy>,
}

pub struct TieredExperts {
    source: Arc<dyn ExpertSource>,
    hidden: usize,
    experts: usize,
    device_slots: usize,
    ram_slots: usize,
    layers: Vec<Mutex<Layer>>,
    moe_layers: usize,
    /// Raw pick counts per layer and expert (the routing history).
    picks: Vec<Vec<AtomicU64>>,
    /// Experts read ahead by the prefetcher, not yet looked up.
    staged: Arc<Staging>,
    prefetcher: Option<Mutex<std::sync::mpsc::Sender<(usize, usize)>>>,
    pub stats: Arc<TierStats>,
    mode: Mode,
}

/// Experts read ahead by the prefetcher, by (layer, expert), not yet looked up.
type Staging = Mutex<HashMap<(usize, usize), Arc<SwiGlu>>>;

/// Slot caps are per layer (each layer's experts compete only with each other).
#[derive(Clone, Copy, Debug)]
pub struct TierCaps {
    pub device_slots_per_layer: usize,
    pub ram_slots_per_layer: usize,
}

impl TieredExperts {
    /// `moe_layers[l]` says whether layer l has routed experts. In `fast`/`exact` every
    /// expert is loaded into RAM now and the store is never read again.
    pub fn new(
        source: Arc<dyn ExpertSource>,
        hidden: usize,
        experts: usize,
        moe_layers: &[bool],
        mode: Mode,
        caps: TierCaps,
        aging_period: u64,
        prefetch: bool,
    ) -> anyhow::Result<TieredExperts> {
        let (device_slots, ram_slots) = if mode.tiered() {
            (caps.device_slots_per_layer, caps.ram_slots_per_layer)
        } else {
            (0, experts)
        };
        let mut layers = Vec::with_capacity(moe_layers.len());
        for (l, &moe) in moe_layers.iter().enumerate() {
            let mut layer = Layer {
                device: HashMap::new(),
                ram: HashMap::new(),
                device_policy: Box::new(Lfu::new(experts, aging_period)),
                ram_policy: Box::new(Lfu::new(experts, aging_period)),
            };
            if moe && !mode.tiered() {
                for e in 0..experts {
                    layer.ram.insert(e, Arc::new(source.load(l, e)?));
                }
            }
            layers.push(Mutex::new(layer));
        }
        let stats = Arc::new(TierStats::default());
        let staged = Arc::new(Mutex::new(HashMap::new()));
        let prefetcher = (mode.tiered() && prefetch).then(|| {
            Mutex::new(spawn_prefetcher(
                source.clone(),
                staged.clone(),
                stats.clone(),
            ))
        });
        Ok(TieredExperts {
            source,
            hidden,
            experts,
            device_slots,
            ram_slots,
            layers,
            moe_layers: moe_layers.iter().filter(|&&m| m).count(),
            picks: moe_layers
                .iter()
                .map(|_| (0..experts).map(|_| AtomicU64::new(0)).collect())
                .collect(),
            staged,
            prefetcher,
            stats,
            mode,
        })
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The routing history so far, bound to `fingerprint`.
    pub fn history(&self, fingerprint: &str) -> super::history::RoutingHistory {
        super::history::RoutingHistory {
            version: super::history::HISTORY_VERSION,
            fingerprint: fingerprint.to_string(),
            experts: self.experts,
            counts: self
                .picks
                .iter()
                .map(|row| row.iter().map(|c| c.load(Ordering::Relaxed)).collect())
                .collect(),
        }
    }

    /// Warm start: seeds each layer's policy with the saved counts and loads the most picked
    /// experts into the device tier, then the RAM tier, up to their caps.
    pub fn warm_start(
        &self,
        history: &super::history::RoutingHistory,
        aging_period: u64,
    ) -> anyhow::Result<usize> {
        let mut loaded = 0;
        for (layer, row) in history.counts.iter().enumerate() {
            if row.is_empty() || !self.mode.tiered() {
                continue;
            }
            let counts: Vec<f64> = row.iter().map(|&c| c as f64).collect();
            let ranked = history.ranked(layer);
            let mut l = self.layers[layer].lock().expect("tier lock");
            l.device_policy = Box::new(Lfu::with_counts(&counts, aging_period));
            l.ram_policy = Box::new(Lfu::with_counts(&counts, aging_period));
            for (i, &e) in ranked
                .iter()
                .take(self.device_slots + self.ram_slots)
                .enumerate()
            {
                let w = Arc::new(self.source.load(layer, e)?);
                if i < self.device_slots {
                    l.device.insert(e, w);
                } else {
                    l.ram.insert(e, w);
                }
                loaded += 1;
            }
        }
        Ok(loaded)
    }

    /// Device and RAM residents of `layer` (for invariant checks and the tier summary).
    pub fn layer_residents(&self, layer: usize) -> (Vec<usize>, Vec<usize>) {
        let l = self.layers[layer].lock().expect("tier lock");
        let mut device: Vec<usize> = l.device.keys().copied().collect();
        let mut ram: Vec<usize> = l.ram.keys().copied().collect();
        device.sort_unstable();
        ram.sort_unstable();
        (device, ram)
    }

    /// Where `(layer, expert)` resides now.
    pub fn residency(&self, layer: usize, expert: usize) -> Tier {
        let l = self.layers[layer].lock().expect("tier lock");
        if l.device.contains_key(&expert) {
            Tier::Device
        } else if l.ram.contains_key(&expert) {
            Tier::Ram
        } else {
            Tier::Store
        }
    }

    /// Resident experts per tier, all layers.
    pub fn resident(&self, tier: Tier) -> usize {
        self.layers
            .iter()
            .map(|l| {
                let l = l.lock().expect("tier lock");
                match tier {
                    Tier::Device => l.device.len(),
                    Tier::Ram => l.ram.len(),
                    Tier::Store => self.experts - l.device.len() - l.ram.len(),
                }
            })
            .sum()
    }

    /// Finds (and moves, by policy) one picked expert; returns its weights.
    fn resolve(
        &self,
        layer: usize,
        l: &mut Layer,
        expert: usize,
        phase: usize,
    ) -> anyhow::Result<Arc<SwiGlu>> {
        l.device_policy.touch(expert);
        l.ram_policy.touch(expert);
        self.picks[layer][expert].fetch_add(1, Ordering::Relaxed);
        let count =
            |tier: Tier| self.stats.lookups[tier as usize][phase].fetch_add(1, Ordering::Relaxed);
        if let Some(w) = l.device.get(&expert) {
            count(Tier::Device);
            return Ok(w.clone());
        }
        let weights = match l.ram.get(&expert) {
            Some(w) => {
                count(Tier::Ram);
                w.clone()
            }
            None => {
                count(Tier::Store);
                let staged = self
                    .staged
                    .lock()
                    .expect("staging lock")
                    .remove(&(layer, expert));
                let w = match staged {
                    Some(w) => {
                        self.stats.prefetch_hits.fetch_add(1, Ordering::Relaxed);
                        w
                    }
                    None => {
                        self.stats.loads.fetch_add(1, Ordering::Relaxed);
                        Arc::new(self.source.load(layer, expert)?)
                    }
                };
                // Admit into RAM (a RAM victim falls back to the store only).
                if self.admit(&mut l.ram, l.ram_policy.as_ref(), self.ram_slots, expert) {
                    l.ram.insert(expert, w.clone());
                } else {
                    self.stats.bypassed.fetch_add(1, Ordering::Relaxed);
                }
                w
            }
        };
        // Promote into the device tier when it has room or the policy prefers this expert;
        // the device victim moves down into RAM (no duplicates: it leaves the device map).
        if l.ram.contains_key(&expert) && self.device_slots > 0 {
            let victim = if l.device.len() < self.device_slots {
                None
            } else {
                let resident: Vec<usize> = l.device.keys().copied().collect();
                match l.device_policy.victim(&resident) {
                    Some(v) if l.device_policy.score(expert) > l.device_policy.score(v) => Some(v),
                    _ => return Ok(weights),
                }
            };
            let moved = l.ram.remove(&expert).expect("checked above");
            if let Some(v) = victim {
                let down = l.device.remove(&v).expect("victim is resident");
                self.stats.demotions.fetch_add(1, Ordering::Relaxed);
                if self.admit(&mut l.ram, l.ram_policy.as_ref(), self.ram_slots, v) {
                    l.ram.insert(v, down);
                }
            }
            l.device.insert(expert, moved);
            self.stats.promotions.fetch_add(1, Ordering::Relaxed);
        }
        Ok(weights)
    }

    /// Makes room in `tier` for `candidate` (evicting the policy's victim when full and the
    /// candidate is worth it); false if it should not be admitted.
    fn admit(
        &self,
        tier: &mut HashMap<usize, Arc<SwiGlu>>,
        policy: &dyn Policy,
        slots: usize,
        candidate: usize,
    ) -> bool {
        if slots == 0 {
            return false;
        }
        if tier.len() < slots {
            return true;
        }
        let resident: Vec<usize> = tier.keys().copied().collect();
        match policy.victim(&resident) {
            Some(v) if policy.admit(candidate, v) => {
                tier.remove(&v);
                true
            }
            _ => false,
        }
    }
}

impl ExpertProvider for TieredExperts {
    fn forward(
        &self,
        layer: usize,
        x: &[f32],
        routing: &Routing,
        out: &mut [f32],
    ) -> anyhow::Result<()> {
        let phase = usize::from(routing.tokens() == 1);
        // Resolve residency first (under the layer's lock), then compute without it.
        let mut picked: HashMap<usize, Arc<SwiGlu>> = HashMap::new();
        {
            let mut l = self.layers[layer].lock().expect("tier lock");
            for &e in &routing.ids {
                let e = e as usize;
                if let std::collections::hash_map::Entry::Vacant(slot) = picked.entry(e) {
                    slot.insert(self.resolve(layer, &mut l, e, phase)?);
                }
            }
        }
        if self.prefetcher.is_some() {
            // Reads staged for this layer that no pick used are wasted.
            let mut staged = self.staged.lock().expect("staging lock");
            let before = staged.len();
            staged.retain(|&(l, _), _| l != layer);
            self.stats
                .prefetch_wasted
                .fetch_add((before - staged.len()) as u64, Ordering::Relaxed);
        }
        combine_experts(self.hidden, x, routing, self.experts, out, |e, rows, n| {
            Ok(picked[&e].forward(rows, n))
        })
    }

    fn wants_prefetch(&self) -> bool {
        self.prefetcher.is_some()
    }

    fn prefetch(&self, layer: usize, ids: &[u32]) {
        let Some(tx) = &self.prefetcher else { return };
        let mut wanted: Vec<usize> = ids.iter().map(|&e| e as usize).collect();
        wanted.sort_unstable();
        wanted.dedup();
        let missing: Vec<usize> = {
            let l = self.layers[layer].lock().expect("tier lock");
            wanted
                .into_iter()
                .filter(|e| !l.device.contains_key(e) && !l.ram.contains_key(e))
                .collect()
        };
        let tx = tx.lock().expect("prefetch queue");
        for e in missing {
            if tx.send((layer, e)).is_ok() {
                self.stats.prefetch_issued.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn weight_bytes(&self) -> usize {
        self.moe_layers * self.experts * self.source.record_bytes()
    }
}

/// The background reader behind layer-ahead prefetch: loads queued (layer, expert) records
/// into the staging map, which lookups consume.
fn spawn_prefetcher(
    source: Arc<dyn ExpertSource>,
    staged: Arc<Staging>,
    stats: Arc<TierStats>,
) -> std::sync::mpsc::Sender<(usize, usize)> {
    let (tx, rx) = std::sync::mpsc::channel::<(usize, usize)>();
    std::thread::Builder::new()
        .name("expert-prefetch".into())
        .spawn(move || {
            for key in rx {
                if staged.lock().expect("staging lock").contains_key(&key) {
                    continue;
                }
                match source.load(key.0, key.1) {
                    Ok(w) => {
                        staged.lock().expect("staging lock").insert(key, Arc::new(w));
                    }
                    Err(e) => {
                        // The lookup will read (and report) it itself.
                        stats.prefetch_wasted.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(layer = key.0, expert = key.1, error = %e, "prefetch read failed");
                    }
                }
            }
        })
        .expect("spawning the prefetch thread");
    tx
}

/// Experts read from the checkpoint itself (the untiered source, and the tiers' source until
/// a packed store is given).
pub struct CheckpointSource {
    ckpt: Checkpoint,
    cfg: Config,
    record_bytes: usize,
}

impl CheckpointSource {
    pub fn open(dir: &std::path::Path) -> anyhow::Result<CheckpointSource> {
        let cfg = Config::from_file(&dir.join("config.json"))?;
        let ckpt = Checkpoint::open(dir)?;
        let first = cfg
            .mlp_kinds
            .iter()
            .position(|k| *k == crate::model::config::MlpKind::Moe)
            .ok_or_else(|| anyhow::anyhow!("{} has no MoE layer", dir.display()))?;
        let e = crate::model::moe::load_expert(
            &cfg,
            Loader::new(&ckpt).pp(&format!("layers.{first}.mlp.experts")),
            0,
        )?;
        Ok(CheckpointSource {
            record_bytes: e.storage_bytes(),
            ckpt,
            cfg,
        })
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }
}

impl ExpertSource for CheckpointSource {
    fn load(&self, layer: usize, expert: usize) -> anyhow::Result<SwiGlu> {
        let experts = Loader::new(&self.ckpt).pp(&format!("layers.{layer}.mlp.experts"));
        Ok(crate::model::moe::load_expert(&self.cfg, experts, expert)?)
    }

    fn record_bytes(&self) -> usize {
        self.record_bytes
    }
}

/// Experts read from the packed store (O_DIRECT, io_uring or pread; sha256-checked).
pub struct StoreSource {
    reader: crate::store::StoreReader,
    limit: f32,
    record_bytes: usize,
}

impl StoreSource {
    /// Opens `store` for the model in `model_dir`, refusing a store made from another model.
    pub fn open(
        store: &std::path::Path,
        model_dir: &std::path::Path,
        cfg: &Config,
    ) -> anyhow::Result<StoreSource> {
        let fingerprint = crate::store::quick_fingerprint(model_dir)?;
        let reader = crate::store::StoreReader::open(
            store,
            Some(&fingerprint),
            crate::store::ReaderOptions::default(),
        )?;
        Ok(StoreSource {
            record_bytes: reader.manifest().record_size,
            reader,
            limit: cfg.swiglu_limit,
        })
    }

    pub fn engine_name(&self) -> &'static str {
        self.reader.engine_name()
    }
}

impl ExpertSource for StoreSource {
    fn load(&self, layer: usize, expert: usize) -> anyhow::Result<SwiGlu> {
        let record = self.reader.read(layer, expert)?;
        Ok(record.to_expert(self.limit)?)
    }

    fn record_bytes(&self) -> usize {
        self.record_bytes
    }
}
