//! The tiered [`ExpertProvider`]: every routed expert resides in exactly one of the device
//! tier, the RAM tier, or only in its source (the packed store), and moves between them by
//! per-layer policy as the router picks it.
//!
//! Whatever tier serves an expert, its weights are the same bytes and the product runs the
//! same code, so every mode gives logits bit-identical to the untiered engine. On a machine
//! without a GPU the device tier is a CPU-memory tier with its own slot cap, so the full
//! three-tier logic runs (and is tested) anywhere.
//!
//! Lookups only decide; the slow parts of moving down a tier go through the bounded
//! write-back ring ([`super::ring`]) to one background thread: a device victim waits there
//! "in flight" (still served to lookups, in no tier's map) until the writer pins it into a
//! RAM slot, and RAM victims are unpinned and freed there. RAM residents are `mlock`ed
//! ([`super::pin`]).

mod background;
mod fetch;
mod report;
mod warm;

use super::pin::{PinStats, Pinned};
use super::plan::TierPlan;
use super::policy::{Policy, PolicyKind};
use super::ring::Ring;
use super::source::ExpertSource;
use super::stats::{StepPart, TierStats};
use crate::model::mlp::SwiGlu;
use crate::model::moe::{ExpertProvider, Phase, Routing, combine_experts_in};
use anyhow::Context;
use background::{Room, handle_write_back, make_room, spawn_prefetcher, spawn_writer, timed_load};
use fetch::{Cell, Pick, Picked};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

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

struct Layer {
    /// The device tier's residents and their host weights; on a GPU tier that copies victims
    /// down ([`TierPlan::copy_down`]) `None` once the resident's slot holds it.
    device: HashMap<usize, Option<Arc<SwiGlu>>>,
    ram: HashMap<usize, Pinned>,
    /// Device victims queued on the write-back ring, on their way into RAM.
    in_flight: HashMap<usize, Arc<SwiGlu>>,
    device_policy: Box<dyn Policy>,
    ram_policy: Box<dyn Policy>,
}

impl Layer {
    /// Whether a tier holds `expert` (a write-back in flight counts: it is on its way to RAM).
    fn holds(&self, expert: usize) -> bool {
        self.device.contains_key(&expert)
            || self.ram.contains_key(&expert)
            || self.in_flight.contains_key(&expert)
    }
}

/// Work for the write-back thread.
enum WriteBack {
    /// Move the in-flight device victim `(layer, expert)` into a RAM slot (pinning it).
    Demote { layer: usize, expert: usize },
    /// Unpin and free an expert that left the RAM tier.
    Release(Pinned),
}

/// Everything the write-back thread shares with lookups.
struct Shared {
    layers: Vec<Mutex<Layer>>,
    ram_slots: usize,
    /// The pinned arena RAM residents live in (none with pinning off or f32 experts).
    arena: Option<Arc<super::arena::RamArena>>,
    pins: Arc<PinStats>,
    stats: Arc<TierStats>,
}

pub struct TieredExperts {
    source: Arc<dyn ExpertSource>,
    hidden: usize,
    experts: usize,
    device_slots: usize,
    ram_slots: usize,
    shared: Arc<Shared>,
    ring: Arc<Ring<WriteBack>>,
    policy: PolicyKind,
    moe_layers: usize,
    /// Raw pick counts per layer and expert (the routing history).
    picks: Vec<Vec<AtomicU64>>,
    /// Experts read ahead by the prefetcher, not yet looked up.
    staged: Arc<Staging>,
    prefetcher: Option<Mutex<std::sync::mpsc::Sender<(usize, usize)>>>,
    /// The fetch thread's queue: a forward's store misses, read while its products run.
    fetcher: Option<Mutex<std::sync::mpsc::Sender<fetch::Job>>>,
    /// A prompt chunk's predicted misses of the next MoE layer, waiting for the current
    /// forward's products to end ([`TieredExperts::send_ahead`]), and the records then read
    /// ahead, by (layer, expert), until that layer's forward takes them.
    ahead_request: Mutex<Option<(usize, Vec<usize>)>>,
    ahead: Mutex<HashMap<(usize, usize), Arc<Cell>>>,
    /// The write-back and prefetch threads, joined on drop: nothing of the tiers runs on
    /// while the process tears down (the CUDA driver and the store with it).
    threads: Vec<std::thread::JoinHandle<()>>,
    pub stats: Arc<TierStats>,
    pub pins: Arc<PinStats>,
    mode: Mode,
    /// The device tier's slots on a GPU (see [`TieredExperts::new`]); without it the
    /// device tier is CPU memory.
    gpu: Option<Mutex<super::vram::GpuTier>>,
    /// That GPU (read without the tier's lock).
    gpu_device: Option<Arc<crate::backend::cuda::Cuda>>,
    /// Where [`ExpertProvider::finish`] saves the routing history, and its fingerprint.
    history_file: std::sync::OnceLock<(std::path::PathBuf, String)>,
    /// The thread filling free slots from the routing history ([`TieredExperts::open_history`]),
    /// and the flag that stops it early (on drop).
    filler: Mutex<Option<std::thread::JoinHandle<usize>>>,
    stop_filling: Arc<std::sync::atomic::AtomicBool>,
    plan: TierPlan,
}

/// Experts read ahead by the prefetcher, by (layer, expert), not yet looked up.
type Staging = Mutex<HashMap<(usize, usize), Arc<SwiGlu>>>;

impl TieredExperts {
    /// The tiers `plan` describes over `source`; `moe_layers[l]` says whether layer l has
    /// routed experts. In `fast`/`exact` every expert is loaded into RAM now and the store
    /// is never read again. With `gpu` the device tier's residents live in VRAM slots and
    /// are computed there; in `nvme`/`fast` RAM-resident decode picks run on the CPU lane, in
    /// the exact modes every product runs on the GPU kernel (non-residents through the
    /// plan's staging slots). Without it the device tier is CPU memory.
    pub fn new(
        source: Arc<dyn ExpertSource>,
        hidden: usize,
        experts: usize,
        moe_layers: &[bool],
        plan: &TierPlan,
        gpu: Option<Arc<crate::backend::cuda::Cuda>>,
    ) -> anyhow::Result<TieredExperts> {
        let mode = plan.mode;
        let (device_slots, ram_slots) = (plan.device_slots, plan.ram_slots);
        let stats = Arc::new(TierStats::default());
        let pins = Arc::new(PinStats::default());
        pins.disabled.store(!plan.pin, Ordering::Relaxed);
        let mut sample_slot = None;
        let gpu = match gpu {
            Some(cuda) => {
                let first = moe_layers
                    .iter()
                    .position(|&m| m)
                    .ok_or_else(|| anyhow::anyhow!("no MoE layer"))?;
                let sample = source.load(first, 0)?;
                sample_slot = super::arena::slot_len_of(&sample);
                let tier = super::vram::GpuTier::new(
                    cuda,
                    &sample,
                    moe_layers,
                    device_slots,
                    plan.staging_slots,
                )?;
                // RAM residents are registered with CUDA (pinned, copied by DMA).
                pins.set_registrar(tier.registrar.clone());
                Some(tier)
            }
            None => None,
        };
        let moe_count = moe_layers.iter().filter(|&&m| m).count();
        // The RAM tier's slots (and the device tier's where its residents keep host weights:
        // without a GPU, or keeping host copies), plus room for the records in flight.
        let resident_slots = if mode.tiered() {
            let host_device = if gpu.is_none() || !plan.copy_down {
                device_slots
            } else {
                0
            };
            (ram_slots + host_device) * moe_count + super::arena::IN_FLIGHT_SLOTS
        } else {
            experts * moe_count
        };
        let arena = match source.slot_bytes().or(sample_slot) {
            Some(slot_len) if plan.pin && resident_slots > 0 => {
                Some(super::arena::RamArena::start(
                    slot_len,
                    resident_slots,
                    gpu.as_ref().map(|g| &g.registrar),
                    &pins,
                ))
            }
            _ => None,
        };
        // Records decoded into slots where the source can (the store), else copied there.
        let source: Arc<dyn ExpertSource> = match &arena {
            Some(arena) if !source.place_in(arena) => Arc::new(super::arena::ArenaSource {
                inner: source,
                arena: arena.clone(),
            }),
            _ => source,
        };
        let mut layers = Vec::with_capacity(moe_layers.len());
        for (l, &moe) in moe_layers.iter().enumerate() {
            let mut layer = Layer {
                device: HashMap::new(),
                ram: HashMap::new(),
                in_flight: HashMap::new(),
                device_policy: plan.eviction.build(experts, plan.aging_period, None),
                ram_policy: plan.eviction.build(experts, plan.aging_period, None),
            };
            if moe && !mode.tiered() {
                use rayon::prelude::*;
                let loaded: Vec<SwiGlu> = (0..experts)
                    .into_par_iter()
                    .map(|e| timed_load(source.as_ref(), &stats, l, e))
                    .collect::<anyhow::Result<_>>()?;
                for (e, w) in loaded.into_iter().enumerate() {
                    layer.ram.insert(e, Pinned::new(Arc::new(w), &pins));
                }
            }
            layers.push(Mutex::new(layer));
        }
        let shared = Arc::new(Shared {
            layers,
            ram_slots,
            arena,
            pins: pins.clone(),
            stats: stats.clone(),
        });
        let ring = Arc::new(Ring::new(plan.writeback_ring));
        let mut threads = vec![spawn_writer(shared.clone(), ring.clone())];
        let staged = Arc::new(Mutex::new(HashMap::new()));
        let prefetcher = (mode.tiered() && plan.prefetch).then(|| {
            let (tx, thread) = spawn_prefetcher(source.clone(), staged.clone(), stats.clone());
            threads.push(thread);
            Mutex::new(tx)
        });
        let fetcher = if mode.tiered() {
            let (tx, thread) = fetch::spawn_fetcher(source.clone(), stats.clone())?;
            threads.push(thread);
            Some(Mutex::new(tx))
        } else {
            None
        };
        Ok(TieredExperts {
            source,
            hidden,
            experts,
            device_slots,
            ram_slots,
            shared,
            ring,
            policy: plan.eviction,
            moe_layers: moe_layers.iter().filter(|&&m| m).count(),
            picks: moe_layers
                .iter()
                .map(|_| (0..experts).map(|_| AtomicU64::new(0)).collect())
                .collect(),
            staged,
            prefetcher,
            fetcher,
            ahead_request: Mutex::new(None),
            ahead: Mutex::new(HashMap::new()),
            threads,
            stats,
            pins,
            mode,
            gpu_device: gpu.as_ref().map(|g| g.cuda().clone()),
            gpu: gpu.map(Mutex::new),
            history_file: std::sync::OnceLock::new(),
            filler: Mutex::new(None),
            stop_filling: Default::default(),
            plan: plan.clone(),
        })
    }

    /// The plan these tiers were built from.
    pub fn plan(&self) -> &TierPlan {
        &self.plan
    }

    fn layer(&self, layer: usize) -> std::sync::MutexGuard<'_, Layer> {
        self.shared.layers[layer].lock().expect("tier lock")
    }

    /// Slots per MoE layer: (device, RAM).
    pub fn caps(&self) -> (usize, usize) {
        (self.device_slots, self.ram_slots)
    }

    pub fn moe_layers(&self) -> usize {
        self.moe_layers
    }

    /// Routed experts per MoE layer.
    pub fn experts(&self) -> usize {
        self.experts
    }

    pub fn record_bytes(&self) -> usize {
        self.source.record_bytes()
    }

    pub fn policy(&self) -> PolicyKind {
        self.policy
    }

    /// The write-back ring (its capacity, high-water mark and stalls).
    pub fn writeback_ring(&self) -> (usize, usize, u64) {
        (
            self.ring.capacity(),
            self.ring.high_water(),
            self.ring.stalls(),
        )
    }

    /// Waits until the write-back ring has handled everything queued so far.
    pub fn flush(&self) {
        self.ring.wait_idle();
    }

    /// Queues moves decided under a layer lock (call without holding it: a full ring blocks).
    fn write_back(&self, jobs: Vec<WriteBack>) {
        for job in jobs {
            if let Err(job) = self.ring.push(job) {
                handle_write_back(&self.shared, job);
            }
        }
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Finds (and moves, by policy) one picked expert; gives its weights, or the record on
    /// its way from the store (`coming`: admitted by [`TieredExperts::admit_fetched`] once
    /// the products are done). Moves down a tier are decided here and queued in `jobs` for
    /// the write-back ring.
    fn resolve(
        &self,
        layer: usize,
        l: &mut Layer,
        expert: usize,
        phase: Phase,
        jobs: &mut Vec<WriteBack>,
        coming: &[(usize, Arc<Cell>)],
    ) -> anyhow::Result<Pick> {
        l.device_policy.touch(expert);
        l.ram_policy.touch(expert);
        self.picks[layer][expert].fetch_add(1, Ordering::Relaxed);
        let decode = phase == Phase::Decode;
        let count = |tier: Tier| {
            self.stats.lookups[tier as usize][usize::from(decode)].fetch_add(1, Ordering::Relaxed);
            if tier == Tier::Ram && decode && matches!(self.mode, Mode::Fast | Mode::Nvme) {
                self.stats.cpu_lane.fetch_add(1, Ordering::Relaxed);
            }
        };
        if let Some(w) = l.device.get(&expert) {
            count(Tier::Device);
            return Ok(w.clone().map_or(Pick::InSlot, Pick::Ready));
        }
        if let Some(w) = l.in_flight.get(&expert) {
            // On its way down to RAM: served from where it is, left to the writer.
            count(Tier::Ram);
            return Ok(Pick::Ready(w.clone()));
        }
        if let Some(p) = l.ram.get(&expert) {
            count(Tier::Ram);
            let w = p.weights().clone();
            self.promote(layer, l, expert, jobs);
            return Ok(Pick::Ready(w));
        }
        count(Tier::Store);
        if let Some((_, cell)) = coming.iter().find(|(e, _)| *e == expert) {
            self.stats.loads.fetch_add(1, Ordering::Relaxed);
            return Ok(Pick::Coming(cell.clone()));
        }
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
                Arc::new(timed_load(
                    self.source.as_ref(),
                    &self.stats,
                    layer,
                    expert,
                )?)
            }
        };
        self.admit(layer, l, expert, w.clone(), jobs);
        Ok(Pick::Ready(w))
    }

    /// Admits `expert`, just read from the store, into the RAM tier (a RAM victim falls back
    /// to the store only), then offers it to the device tier.
    fn admit(
        &self,
        layer: usize,
        l: &mut Layer,
        expert: usize,
        w: Arc<SwiGlu>,
        jobs: &mut Vec<WriteBack>,
    ) {
        match make_room(&mut l.ram, l.ram_policy.as_ref(), self.ram_slots, expert) {
            Room::Refused => {
                self.stats.bypassed.fetch_add(1, Ordering::Relaxed);
            }
            room => {
                if let Room::Evicted(v) = room {
                    jobs.push(WriteBack::Release(v));
                }
                l.ram.insert(expert, Pinned::new(w, &self.pins));
            }
        }
        self.promote(layer, l, expert, jobs);
    }

    /// Promotes a RAM resident into the device tier when it has room or the policy prefers
    /// it; the device victim goes in flight to RAM (no duplicates: it leaves the device map),
    /// copied down from its VRAM slot when it has no host copy. A copy-down that fails leaves
    /// both where they were.
    fn promote(&self, layer: usize, l: &mut Layer, expert: usize, jobs: &mut Vec<WriteBack>) {
        if !l.ram.contains_key(&expert) || self.device_slots == 0 {
            return;
        }
        let victim = if l.device.len() < self.device_slots {
            None
        } else {
            let resident: Vec<usize> = l.device.keys().copied().collect();
            match l.device_policy.victim(&resident) {
                Some(v) if l.device_policy.score(expert) > l.device_policy.score(v) => Some(v),
                _ => return,
            }
        };
        let down = match victim {
            None => None,
            Some(v) => {
                let w = match l.device[&v].clone() {
                    Some(w) => w,
                    None => match self.copy_down(layer, v) {
                        Ok(w) => w,
                        Err(e) => {
                            tracing::warn!(layer, expert = v, error = %e, "copying a VRAM victim down failed; it stays");
                            return;
                        }
                    },
                };
                Some((v, w))
            }
        };
        let moved = l.ram.remove(&expert).expect("checked above");
        if let Some((v, down)) = down {
            l.device.remove(&v);
            self.stats.demotions.fetch_add(1, Ordering::Relaxed);
            l.in_flight.insert(v, down);
            jobs.push(WriteBack::Demote { layer, expert: v });
        }
        l.device.insert(expert, Some(moved.weights().clone()));
        jobs.push(WriteBack::Release(moved));
        self.stats.promotions.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for TieredExperts {
    fn drop(&mut self) {
        self.stop_filling.store(true, Ordering::Relaxed);
        self.wait_filled();
        // The writer drains what is queued, then exits; the prefetcher and the fetch thread
        // end with their senders.
        self.ring.close();
        self.prefetcher = None;
        self.fetcher = None;
        for thread in self.threads.drain(..) {
            if thread.join().is_err() {
                tracing::warn!("a tier thread panicked");
            }
        }
    }
}

impl TieredExperts {
    /// The first half of a `forward`: this call's store misses sent to the fetch thread in
    /// one batch, residency resolved under the layer's lock (admissions of what is at hand
    /// included), the moves down queued. Gives each picked expert's weights or its record on
    /// the way; the products take them with [`Picked::get`] and end with
    /// [`Picked::finish`], which admits the records read for them.
    fn resolve_picks(&self, layer: usize, routing: &Routing) -> anyhow::Result<Picked<'_>> {
        let coming = self.start_fetch(layer, routing);
        let started = std::time::Instant::now();
        let mut picked: HashMap<usize, Pick> = HashMap::new();
        let mut jobs = Vec::new();
        let resolved = {
            let mut l = self.layer(layer);
            // One lookup per distinct expert, in the phase of the first token that picked it.
            let resolved = routing.ids.iter().enumerate().try_for_each(|(i, &e)| {
                let e = e as usize;
                if let std::collections::hash_map::Entry::Vacant(slot) = picked.entry(e) {
                    let phase = routing.phase(i / routing.k.max(1));
                    slot.insert(self.resolve(layer, &mut l, e, phase, &mut jobs, &coming)?);
                }
                anyhow::Ok(())
            });
            // A VRAM resident a later pick's promotion evicted leaves its slot: the products
            // take it from its copy on the way down.
            for (e, pick) in picked.iter_mut() {
                if matches!(pick, Pick::InSlot)
                    && let Some(w) = l.in_flight.get(e)
                {
                    *pick = Pick::Ready(w.clone());
                }
            }
            resolved
        };
        let at = self.stats.add_part(StepPart::Resolve, started);
        self.write_back(jobs);
        let at = self.stats.add_part(StepPart::WriteBack, at);
        resolved?;
        if self.prefetcher.is_some() {
            // Reads staged for this layer that no pick used are wasted.
            let mut staged = self.staged.lock().expect("staging lock");
            let before = staged.len();
            staged.retain(|&(l, _), _| l != layer);
            self.stats
                .prefetch_wasted
                .fetch_add((before - staged.len()) as u64, Ordering::Relaxed);
        }
        Ok(Picked {
            tiers: self,
            layer,
            picked,
            coming,
            started: at,
        })
    }

    /// Device resident `expert` of `layer`, which has no host copy, read back from its VRAM
    /// slot (the caller holds the layer's lock: the slot cannot be given to another expert
    /// meanwhile).
    fn copy_down(&self, layer: usize, expert: usize) -> anyhow::Result<Arc<SwiGlu>> {
        let gpu = self
            .gpu
            .as_ref()
            .context("a device resident without a host copy, and no GPU tier")?;
        let w = gpu
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .copy_down(layer, expert)?;
        self.stats.copied_down.fetch_add(1, Ordering::Relaxed);
        Ok(Arc::new(w))
    }

    /// The GPU tier with `layer`'s device slots made to match its residents, and the lane
    /// the mode puts non-resident decode picks on. With `copy_down` the residents' host
    /// copies go once their slots hold them (the layer's lock is held throughout, so no
    /// resident leaves between the write and the drop).
    fn gpu_for(
        &self,
        layer: usize,
    ) -> anyhow::Result<
        Option<(
            std::sync::MutexGuard<'_, super::vram::GpuTier>,
            super::vram::Lane,
        )>,
    > {
        let Some(gpu) = &self.gpu else {
            return Ok(None);
        };
        let lane = match self.mode {
            Mode::Fast | Mode::Nvme => super::vram::Lane::CpuForDecode,
            Mode::Exact | Mode::NvmeExact => super::vram::Lane::GpuOnly,
        };
        // Lock order: a layer, then the GPU tier (nothing holding the GPU tier waits for a
        // layer).
        let mut l = self.layer(layer);
        let residents: Vec<(usize, Option<Arc<SwiGlu>>)> =
            l.device.iter().map(|(e, w)| (*e, w.clone())).collect();
        let mut g = gpu.lock().unwrap_or_else(|e| e.into_inner());
        g.reconcile(layer, &residents)?;
        if self.plan.copy_down {
            l.device.values_mut().for_each(|w| *w = None);
        }
        Ok(Some((g, lane)))
    }
}

impl crate::model::moe::DeviceExperts for TieredExperts {
    fn device(&self) -> &Arc<crate::backend::cuda::Cuda> {
        self.gpu_device
            .as_ref()
            .expect("on_device offers only a tier with a GPU")
    }

    fn forward_device(
        &self,
        layer: usize,
        x: &cudarc::driver::CudaSlice<f32>,
        routing: &Routing,
    ) -> anyhow::Result<cudarc::driver::CudaSlice<f32>> {
        let picked = self.resolve_picks(layer, routing)?;
        let Some((mut g, lane)) = self.gpu_for(layer)? else {
            anyhow::bail!("the tiers have no GPU device tier");
        };
        g.compute_device(layer, x, routing, lane, &|e| picked.get(e))
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
        let picked = self.resolve_picks(layer, routing)?;
        if let Some((mut g, lane)) = self.gpu_for(layer)? {
            return g.compute(layer, x, routing, lane, &|e| picked.get(e), out);
        }
        let order = self.product_order(&picked, routing);
        combine_experts_in(self.hidden, x, routing, &order, out, |e, rows, n| {
            Ok(picked.get(e)?.forward(rows, n))
        })
    }

    /// Settles the write-back ring, prints the one-line tier summary on stderr and saves
    /// the routing history where [`TieredExperts::open_history`] was told to.
    fn finish(&self) -> anyhow::Result<()> {
        use anyhow::Context;
        // Serving has ended: a fill from the history still running stops here, so the summary
        // and the saved history describe the tiers as they are left.
        self.stop_filling.store(true, Ordering::Relaxed);
        self.wait_filled();
        self.flush();
        eprintln!(
            "tiers ({:?}): {}",
            self.mode,
            super::args::tier_summary(self)
        );
        if let Some((path, fingerprint)) = self.history_file.get() {
            self.history(fingerprint)
                .save(path)
                .with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    }

    fn on_device(&self) -> Option<&dyn crate::model::moe::DeviceExperts> {
        self.gpu_device.as_ref().map(|_| self as _)
    }

    fn wants_prefetch(&self) -> bool {
        self.prefetcher.is_some()
    }

    /// Decode: the predicted misses go to the prefetcher, one record at a time, into the
    /// staging map. A prompt chunk: they are read ahead in one batch by the fetch thread
    /// once this forward's own records are admitted ([`TieredExperts::send_ahead`]).
    fn prefetch(&self, layer: usize, ids: &[u32], prompt: bool) {
        let Some(tx) = &self.prefetcher else { return };
        let mut wanted: Vec<usize> = ids.iter().map(|&e| e as usize).collect();
        wanted.sort_unstable();
        wanted.dedup();
        if prompt {
            if self.fetcher.is_some() {
                *self.ahead_request.lock().expect("read-ahead request") = Some((layer, wanted));
            }
            return;
        }
        let missing: Vec<usize> = {
            let l = self.layer(layer);
            wanted.into_iter().filter(|&e| !l.holds(e)).collect()
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
