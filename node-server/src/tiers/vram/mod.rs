//! The VRAM expert tier: expert records in fixed-size slots of one device allocation,
//! computed by the fused MoE kernels (`kernels/cuda/moe.cu`).
//!
//! [`VramExperts`] (in `all.rs`) holds every routed expert in VRAM (the "all in VRAM"
//! ceiling, and the untiered GPU run that `nvme-exact` must match bit for bit).
#![allow(unsafe_code)] // CUDA host registration of RAM residents; each block says why it holds

use super::source::ExpertSource;
use crate::backend::cuda::{Cuda, Exl3Form, MoeLayout, SlotArena};
use crate::model::mlp::SwiGlu;
use crate::model::moe::Routing;
use anyhow::{Context, bail};
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream};
use std::sync::{Arc, Mutex};

mod all;
mod slot_bytes;
pub use all::{VramExperts, load_dense_on_gpu, load_model_on_gpu};
pub use slot_bytes::{expert_from_slot, slot_pieces};

/// The slot layout of an expert as loaded (its three matrices' formats and shapes).
pub fn layout_of(expert: &SwiGlu) -> anyhow::Result<MoeLayout> {
    let (inter, hidden) = (expert.gate.rows(), expert.gate.cols());
    if expert.up.format() != expert.gate.format()
        || expert.up.rows() != inter
        || expert.up.cols() != hidden
        || expert.down.rows() != hidden
        || expert.down.cols() != inter
    {
        bail!(
            "expert matrices don't share one layout: gate {:?}, up {:?}, down {:?}",
            expert.gate,
            expert.up,
            expert.down
        );
    }
    if expert.gate.exl3().is_some() || expert.down.exl3().is_some() {
        let form = |m: &crate::backend::cpu::Matrix| {
            let lin = m.exl3().with_context(|| {
                format!("{m:?}: an expert's matrices must all be EXL3 or all rows")
            })?;
            if lin.has_bias() {
                bail!("{m:?}: routed experts have no bias; the EXL3 slots hold none");
            }
            Ok(Exl3Form {
                rate: lin.rate(),
                codebook: lin.codebook(),
            })
        };
        let (gate, up) = (form(&expert.gate)?, form(&expert.up)?);
        if gate != up {
            bail!("gate {gate:?} and up {up:?} differ: an expert slot holds one form for both");
        }
        return Ok(MoeLayout::exl3(hidden, inter, gate, form(&expert.down)?)?);
    }
    let (Some(gate), Some(down)) = (expert.gate.format(), expert.down.format()) else {
        bail!("{:?} has no row format", expert.gate);
    };
    Ok(MoeLayout::new(hidden, inter, gate, down)?)
}

/// The slot layout of `source`'s experts, read from its first MoE layer's first expert: what
/// the VRAM tier allocates its slots by, and so what the memory plan sizes them by.
pub fn source_layout(
    source: &dyn ExpertSource,
    cfg: &crate::model::config::Config,
) -> anyhow::Result<MoeLayout> {
    let layer = cfg
        .moe_layers()
        .iter()
        .position(|&m| m)
        .context("the model has no MoE layer")?;
    layout_of(&source.load(layer, 0)?)
}

/// Copies one expert into arena slot `slot` on `stream`, checking it has the arena's layout.
pub fn write_slot(
    stream: &Arc<CudaStream>,
    arena: &mut SlotArena,
    slot: usize,
    expert: &SwiGlu,
) -> anyhow::Result<()> {
    let layout = layout_of(expert)?;
    if layout != arena.layout {
        bail!(
            "expert layout {layout:?} differs from the arena's {:?}",
            arena.layout
        );
    }
    // From the expert's own storage where it has rows: a RAM resident registered with CUDA is
    // copied by DMA without a bounce buffer (asynchronously; see `CudaRegistrar` for the
    // lifetime rule). EXL3 pieces are built here; a copy from these pageable buffers returns
    // once the driver holds the bytes.
    let pieces = slot_pieces(expert)?;
    let refs: Vec<&[u8]> = pieces.iter().map(|p| p.as_ref()).collect();
    arena.write(stream, slot, &refs)?;
    Ok(())
}

/// How [`GpuTier::compute`] may run a pick that is not in a device slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lane {
    /// Decode picks resident in RAM run on the CPU in place (`fast`, `nvme`).
    CpuForDecode,
    /// Every product on the GPU kernel (`exact`, `nvme-exact`): others are staged through
    /// staging slots first.
    GpuOnly,
}

/// Registers RAM residents with CUDA ([`super::pin::HostRegistrar`]). A copy from registered
/// memory is asynchronous, so unregistering waits: a released resident (and its memory) is
/// kept until [`CudaRegistrar::drain`], which the GPU tier runs before its next copies, with
/// the stream synchronised first so no copy from it can still be in flight.
/// A released resident's registered spans (pointer, length), and the expert owning them.
type Released = (Vec<(usize, usize)>, Arc<SwiGlu>);
pub struct CudaRegistrar {
    cuda: Arc<Cuda>,
    pending: Mutex<Vec<Released>>,
    refused: std::sync::atomic::AtomicBool,
    /// The RAM tier's arena, whose dropped slots are free again after each drain (weak: the
    /// arena holds this registrar).
    arena: std::sync::OnceLock<std::sync::Weak<crate::tiers::arena::RamArena>>,
    /// Dropped arena slots, free once both streams pass these events (recorded after the
    /// drop: every copy from a slot was queued before its expert dropped).
    arena_waiting: Mutex<Vec<(Vec<usize>, [CudaEvent; 2])>>,
}

impl CudaRegistrar {
    pub fn new(cuda: Arc<Cuda>) -> CudaRegistrar {
        CudaRegistrar {
            cuda,
            pending: Mutex::new(Vec::new()),
            refused: Default::default(),
            arena: Default::default(),
            arena_waiting: Default::default(),
        }
    }

    /// The arena whose dropped slots [`CudaRegistrar::drain`] frees.
    pub fn set_arena(&self, arena: &Arc<crate::tiers::arena::RamArena>) {
        let _ = self.arena.set(Arc::downgrade(arena));
    }

    /// Frees the arena's dropped slots whose copies are done (without waiting for the
    /// device), and unregisters the released residents (after synchronising the streams, so
    /// no copy reads them any more).
    pub fn drain(&self) -> anyhow::Result<()> {
        if let Some(arena) = self.arena.get().and_then(std::sync::Weak::upgrade) {
            let mut waiting = self.arena_waiting.lock().unwrap_or_else(|e| e.into_inner());
            let mut i = 0;
            while i < waiting.len() {
                if waiting[i].1.iter().all(|e| e.is_complete()) {
                    arena.give_back(waiting.swap_remove(i).0);
                } else {
                    i += 1;
                }
            }
            let slots = arena.take_released();
            if !slots.is_empty() {
                let events = [
                    self.cuda.stream().record_event(None)?,
                    self.cuda.copy_stream().record_event(None)?,
                ];
                waiting.push((slots, events));
            }
        }
        let pending = std::mem::take(&mut *self.pending.lock().unwrap_or_else(|e| e.into_inner()));
        if pending.is_empty() {
            return Ok(());
        }
        self.cuda.synchronize()?;
        for (spans, _owner) in pending {
            for (ptr, _) in spans {
                // SAFETY: registered by `register`; the stream is idle, so no copy reads it.
                if let Err(e) = unsafe { self.cuda.unregister_host(ptr as *const u8) } {
                    tracing::warn!(error = %e, "cuMemHostUnregister failed");
                }
            }
        }
        Ok(())
    }
}

impl super::pin::HostRegistrar for CudaRegistrar {
    fn register(&self, spans: &[(usize, usize)]) -> bool {
        {
            // Released and admitted again before the drain: still registered, so the new
            // resident takes the registration over instead of the drain undoing it (and a
            // second registration of the same range being refused).
            let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(i) = pending.iter().position(|(s, _)| s.as_slice() == spans) {
                pending.swap_remove(i);
                return true;
            }
        }
        let mut done = Vec::with_capacity(spans.len());
        for &(ptr, len) in spans {
            // SAFETY: the spans are the buffers of an expert that the `Pinned` holding it keeps
            // alive; `release` hands it to `pending` until `drain` unregisters it.
            match unsafe { self.cuda.register_host(ptr as *const u8, len) } {
                Ok(()) => done.push(ptr),
                Err(e) => {
                    for p in done {
                        // SAFETY: registered just above, never copied from yet.
                        let _ = unsafe { self.cuda.unregister_host(p as *const u8) };
                    }
                    if !self
                        .refused
                        .swap(true, std::sync::atomic::Ordering::Relaxed)
                    {
                        tracing::info!(error = %e, "CUDA host registration refused for a RAM resident (buffers sharing a page, or a driver limit); such residents are mlocked instead");
                    }
                    return false;
                }
            }
        }
        true
    }

    fn release(&self, spans: Vec<(usize, usize)>, owner: Arc<SwiGlu>) {
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((spans, owner));
    }

    fn unregister(&self, spans: &[(usize, usize)]) {
        if spans.is_empty() {
            return;
        }
        if let Err(e) = self.cuda.synchronize() {
            tracing::warn!(error = %e, "synchronising before unregistering host memory failed");
        }
        for &(ptr, _) in spans {
            // SAFETY: registered by `register`; the device is idle, so no copy reads it.
            if let Err(e) = unsafe { self.cuda.unregister_host(ptr as *const u8) } {
                tracing::warn!(error = %e, "cuMemHostUnregister failed");
            }
        }
    }
}

impl Drop for CudaRegistrar {
    fn drop(&mut self) {
        if let Err(e) = self.drain() {
            tracing::warn!(error = %e, "unregistering the RAM tier from CUDA failed");
        }
    }
}

/// The device tier of [`super::provider::TieredExperts`] on a GPU: the device residents of
/// every MoE layer in slots of one arena (`per_layer` slots each), plus `staging` slots that
/// carry non-resident experts to the kernel in `exact` modes and in prefill.
///
/// The staging slots are two halves used in turn: the copy stream fills one half while the
/// kernels compute the picks of the other, so a step's uploads overlap its products.
///
/// Residency itself stays with the tiers' maps; [`GpuTier::reconcile`] makes a layer's
/// slots match them (freeing the slots of experts that left, writing the ones that came).
pub struct GpuTier {
    cuda: Arc<Cuda>,
    /// RAM residents registered with CUDA; drained before each round of copies.
    pub registrar: Arc<CudaRegistrar>,
    arena: SlotArena,
    per_layer: usize,
    /// First slot of each layer's block (by layer index; dense layers have none).
    base: Vec<Option<u32>>,
    /// Expert -> slot, per layer.
    slot_of: Vec<std::collections::HashMap<usize, u32>>,
    /// The staging halves (one when there is a single staging slot).
    halves: Vec<std::ops::Range<u32>>,
    /// Per half: recorded on the copy stream after its slots were written, and on the kernel
    /// stream after the picks reading them were launched.
    copied: Vec<CudaEvent>,
    computed: Vec<CudaEvent>,
    limit: f32,
    /// Bytes copied host -> device (slot writes and staging), and device -> host (victims
    /// copied down).
    pub h2d_bytes: u64,
    pub d2h_bytes: u64,
    /// Picks computed on the GPU and on the CPU lane.
    pub gpu_picks: u64,
    pub cpu_picks: u64,
    /// MoE steps computed, and the last sampled one's wall time (synchronised).
    steps: u64,
    step_seconds: f64,
    /// The sampled steps' parts, each timed on its own.
    pub parts: StepParts,
    /// The last step's staged host weights (kept until its copies are surely done).
    staged_weights: Vec<Arc<SwiGlu>>,
}

/// Where a step's token rows are.
#[derive(Clone, Copy)]
enum Rows<'a> {
    Host(&'a [f32]),
    Device(&'a CudaSlice<f32>),
}

/// What the parts of a MoE step cost on their own, summed over the sampled steps (every
/// [`STEP_SAMPLE`]th). A sampled step runs its parts one after another, the device
/// synchronised between them, so each is timed alone; the other steps overlap them (resident
/// picks on the GPU, the CPU lane, the staged uploads), and their measured time against these
/// parts' sum and their slowest shows how much.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepParts {
    /// Steps sampled.
    pub steps: u64,
    /// The resident picks' kernels (the rows gathered, every pick in a VRAM slot computed).
    pub gpu: f64,
    /// The CPU lane's products, its waits for store reads included.
    pub lane: f64,
    /// The staged picks: their uploads (and waits for their store reads) and their kernels.
    pub staged: f64,
    /// The whole sampled step: the parts, the rows' moves and the combine.
    pub wall: f64,
}

impl StepParts {
    /// What was added to `self` since `before`.
    pub fn since(&self, before: &StepParts) -> StepParts {
        StepParts {
            steps: self.steps - before.steps,
            gpu: self.gpu - before.gpu,
            lane: self.lane - before.lane,
            staged: self.staged - before.staged,
            wall: self.wall - before.wall,
        }
    }

    /// Milliseconds a sampled step spent per part, on average.
    pub fn mean_ms(&self) -> [(&'static str, f64); 4] {
        let n = self.steps.max(1) as f64;
        [
            ("gpu", self.gpu),
            ("lane", self.lane),
            ("staged", self.staged),
            ("wall", self.wall),
        ]
        .map(|(name, s)| (name, s * 1e3 / n))
    }
}

/// What [`GpuTier`] reports to the metrics.
#[derive(Clone, Copy, Debug, Default)]
pub struct GpuStats {
    pub h2d_bytes: u64,
    pub gpu_picks: u64,
    pub cpu_picks: u64,
    pub step_seconds: f64,
    /// The sampled steps' parts.
    pub parts: StepParts,
    pub vram_used: u64,
    pub vram_total: u64,
}

/// Every this many MoE steps one is timed (synchronising the stream around it).
pub(super) const STEP_SAMPLE: u64 = 64;

impl GpuTier {
    /// Slots for `per_layer` residents of each MoE layer plus `staging` slots, laid out for
    /// `sample` (any expert of the model).
    pub fn new(
        cuda: Arc<Cuda>,
        sample: &SwiGlu,
        moe_layers: &[bool],
        per_layer: usize,
        staging: usize,
    ) -> anyhow::Result<GpuTier> {
        let layout = layout_of(sample)?;
        let mut base = Vec::with_capacity(moe_layers.len());
        let mut next = 0u32;
        for &moe in moe_layers {
            if moe {
                base.push(Some(next));
                next += per_layer as u32;
            } else {
                base.push(None);
            }
        }
        let staging = staging.max(1) as u32;
        let slots = (next + staging) as usize;
        let need = slots * layout.slot_bytes;
        let (free, total) = cuda.mem_info()?;
        if need > free {
            bail!(
                "the VRAM tier needs {} MiB ({per_layer} slots x {} MoE layers + {staging} staging, {} KiB each); {} of {} MiB are free: lower --vram-slots",
                need >> 20,
                moe_layers.iter().filter(|&&m| m).count(),
                layout.slot_bytes >> 10,
                free >> 20,
                total >> 20
            );
        }
        let arena = SlotArena::new(&cuda, layout, slots)?;
        // The copy stream writes staging slots from now on: the allocation (on the kernel
        // stream) must have completed.
        cuda.synchronize()?;
        let half = staging.div_ceil(2);
        let halves: Vec<std::ops::Range<u32>> = [next..next + half, next + half..next + staging]
            .into_iter()
            .filter(|r| !r.is_empty())
            .collect();
        let events = |n: usize| (0..n).map(|_| cuda.event()).collect::<Result<Vec<_>, _>>();
        let (copied, computed) = (events(halves.len())?, events(halves.len())?);
        tracing::info!(
            slots,
            per_layer,
            staging,
            mib = need >> 20,
            "VRAM tier allocated"
        );
        Ok(GpuTier {
            registrar: Arc::new(CudaRegistrar::new(cuda.clone())),
            cuda,
            arena,
            per_layer,
            base,
            slot_of: moe_layers.iter().map(|_| Default::default()).collect(),
            halves,
            copied,
            computed,
            limit: sample.limit,
            h2d_bytes: 0,
            d2h_bytes: 0,
            gpu_picks: 0,
            cpu_picks: 0,
            steps: 0,
            step_seconds: 0.0,
            parts: StepParts::default(),
            staged_weights: Vec::new(),
        })
    }

    /// Makes `layer`'s slots hold exactly `residents` (the device tier's experts, with their
    /// host weights where they have them: one not yet in a slot must).
    pub fn reconcile(
        &mut self,
        layer: usize,
        residents: &[(usize, Option<Arc<SwiGlu>>)],
    ) -> anyhow::Result<()> {
        let Some(base) = self.base[layer] else {
            return Ok(());
        };
        self.registrar.drain()?;
        let map = &mut self.slot_of[layer];
        map.retain(|e, _| residents.iter().any(|(r, _)| r == e));
        for (e, w) in residents {
            if map.contains_key(e) {
                continue;
            }
            let Some(w) = w else {
                bail!("expert {e} of layer {layer} has neither a VRAM slot nor a host copy");
            };
            let used: std::collections::HashSet<u32> = map.values().copied().collect();
            let Some(slot) = (base..base + self.per_layer as u32).find(|s| !used.contains(s))
            else {
                bail!(
                    "layer {layer} has more device residents than its {} VRAM slots",
                    self.per_layer
                );
            };
            write_slot(self.cuda.stream(), &mut self.arena, slot as usize, w)?;
            self.h2d_bytes += w.storage_bytes() as u64;
            map.insert(*e, slot);
        }
        Ok(())
    }

    /// Resident `expert` of `layer` read back from its slot (after the work queued on the
    /// kernel stream): the same matrices, bit for bit, as the expert written there.
    pub fn copy_down(&mut self, layer: usize, expert: usize) -> anyhow::Result<SwiGlu> {
        let &slot = self.slot_of[layer]
            .get(&expert)
            .with_context(|| format!("expert {expert} of layer {layer} has no VRAM slot"))?;
        let bytes = self.arena.read(self.cuda.stream(), slot as usize)?;
        self.d2h_bytes += bytes.len() as u64;
        expert_from_slot(&self.arena.layout, &bytes, self.limit)
    }

    /// `out += sum_j w[t, j] * expert(ids[t, j])(x[t])`: residents from their slots, the rest
    /// by `lane` — on the CPU in place (decode picks, [`Lane::CpuForDecode`]) or through the
    /// staging slots. `weights_of` gives a non-resident expert's host weights (waiting for a
    /// record still being read from the store).
    pub fn compute(
        &mut self,
        layer: usize,
        x: &[f32],
        routing: &Routing,
        lane: Lane,
        weights_of: &(dyn Fn(usize) -> anyhow::Result<Arc<SwiGlu>> + Sync),
        out: &mut [f32],
    ) -> anyhow::Result<()> {
        let y = self.run(layer, Rows::Host(x), routing, lane, weights_of)?;
        let y = self.cuda.download(&y)?;
        out.iter_mut().zip(&y).for_each(|(o, v)| *o += v);
        Ok(())
    }

    /// [`GpuTier::compute`] on token rows on the device, the sum left there
    /// (`[tokens, hidden]`); the rows come to the host only for CPU-lane picks.
    pub fn compute_device(
        &mut self,
        layer: usize,
        x: &CudaSlice<f32>,
        routing: &Routing,
        lane: Lane,
        weights_of: &(dyn Fn(usize) -> anyhow::Result<Arc<SwiGlu>> + Sync),
    ) -> anyhow::Result<CudaSlice<f32>> {
        self.run(layer, Rows::Device(x), routing, lane, weights_of)
    }

    fn run(
        &mut self,
        layer: usize,
        x: Rows,
        routing: &Routing,
        lane: Lane,
        weights_of: &(dyn Fn(usize) -> anyhow::Result<Arc<SwiGlu>> + Sync),
    ) -> anyhow::Result<CudaSlice<f32>> {
        use rayon::prelude::*;
        self.registrar.drain()?;
        // The last step's staged weights: its copies have long been waited for by the
        // kernels, and the copy stream is idle by now.
        self.cuda.copy_stream().synchronize()?;
        self.staged_weights.clear();
        self.steps += 1;
        let sampled = self.steps % STEP_SAMPLE == 1;
        if sampled {
            self.cuda.synchronize()?;
        }
        let started = std::time::Instant::now();
        let layout = self.arena.layout;
        let (k, tokens, hidden) = (routing.k, routing.tokens(), layout.hidden);
        let mut run = match x {
            Rows::Host(x) => self.cuda.moe_begin(layout, tokens, k, x)?,
            Rows::Device(x) => self.cuda.moe_begin_dev(layout, tokens, k, x)?,
        };
        let mut on_gpu = Vec::new();
        let mut on_cpu = Vec::new();
        let mut staged: Vec<(usize, Vec<usize>)> = Vec::new();
        for (p, &e) in routing.ids.iter().enumerate() {
            let e = e as usize;
            if let Some(&slot) = self.slot_of[layer].get(&e) {
                on_gpu.push((p, slot));
            } else if lane == Lane::CpuForDecode
                && routing.phase(p / k) == crate::model::moe::Phase::Decode
            {
                on_cpu.push(p);
            } else {
                match staged.iter_mut().find(|(s, _)| *s == e) {
                    Some((_, picks)) => picks.push(p),
                    None => staged.push((e, vec![p])),
                }
            }
        }
        // The CPU lane's rows come down before the resident picks launch: a copy queued behind
        // their kernels would hold the lane until they end.
        let host_rows = match x {
            Rows::Device(x) if !on_cpu.is_empty() => {
                let mut rows = self.cuda.download(x)?;
                rows.truncate(tokens * hidden);
                std::borrow::Cow::Owned(rows)
            }
            Rows::Device(_) => std::borrow::Cow::Borrowed(&[][..]),
            Rows::Host(x) => std::borrow::Cow::Borrowed(x),
        };
        // Launches are asynchronous: the CPU lane below overlaps the resident picks (but for a
        // sampled step, which times its parts one at a time).
        self.cuda
            .moe_picks(&mut run, &self.arena.buf, self.limit, &on_gpu)?;
        let mut part = started;
        let mut lap = |cuda: &Cuda, seconds: &mut f64| -> anyhow::Result<()> {
            if sampled {
                cuda.synchronize()?;
                cuda.copy_stream().synchronize()?;
                let now = std::time::Instant::now();
                *seconds += (now - part).as_secs_f64();
                part = now;
            }
            Ok(())
        };
        lap(&self.cuda, &mut self.parts.gpu)?;
        let cpu_rows: Vec<(usize, Vec<f32>)> = on_cpu
            .par_iter()
            .map(|&p| {
                let t = p / k;
                let w = weights_of(routing.ids[p] as usize)?;
                Ok((p, w.forward_lane(&host_rows[t * hidden..(t + 1) * hidden])))
            })
            .collect::<anyhow::Result<_>>()?;
        lap(&self.cuda, &mut self.parts.lane)?;
        // Staged experts in rounds of a half's slots, halves alternating: the copy stream
        // fills a half once the kernels that read it last are done (`computed`), and the
        // kernels take it once its copies are (`copied`). The host weights are held until
        // the next step, when the copy stream has finished with them.
        let kernels = self.cuda.stream().clone();
        let copies = self.cuda.copy_stream().clone();
        for (round, batch) in staged.chunks(self.halves[0].len()).enumerate() {
            let h = round % self.halves.len();
            copies.wait(&self.computed[h])?;
            let mut picks = Vec::new();
            for ((e, ps), slot) in batch.iter().zip(self.halves[h].clone()) {
                let w = weights_of(*e)?;
                write_slot(&copies, &mut self.arena, slot as usize, &w)?;
                self.h2d_bytes += w.storage_bytes() as u64;
                picks.extend(ps.iter().map(|&p| (p, slot)));
                self.staged_weights.push(w);
            }
            self.copied[h].record(&copies)?;
            kernels.wait(&self.copied[h])?;
            self.cuda
                .moe_picks(&mut run, &self.arena.buf, self.limit, &picks)?;
            self.computed[h].record(&kernels)?;
        }
        if !staged.is_empty() {
            // The staged host weights go as soon as their uploads are done: a prompt chunk
            // stages most of a layer, and the tiers read the next layer ahead once this one's
            // records are let go (one layer's reads beside the tiers, as the plan keeps room
            // for). The kernels wait for these uploads anyway, and the next layer's routing
            // waits for the kernels.
            copies.synchronize()?;
            self.staged_weights.clear();
        }
        lap(&self.cuda, &mut self.parts.staged)?;
        for (p, y) in &cpu_rows {
            self.cuda.moe_set_rows(&mut run, *p, y)?;
        }
        self.cpu_picks += cpu_rows.len() as u64;
        self.gpu_picks += (tokens * k - cpu_rows.len()) as u64;
        let y = self.cuda.moe_combine(run, &routing.weights)?;
        if sampled {
            self.cuda.synchronize()?;
            self.step_seconds = started.elapsed().as_secs_f64();
            self.parts.steps += 1;
            self.parts.wall += self.step_seconds;
        }
        Ok(y)
    }

    pub fn stats(&self) -> GpuStats {
        let (free, total) = self.cuda.mem_info().unwrap_or((0, 0));
        GpuStats {
            h2d_bytes: self.h2d_bytes,
            gpu_picks: self.gpu_picks,
            cpu_picks: self.cpu_picks,
            step_seconds: self.step_seconds,
            parts: self.parts,
            vram_used: (total - free) as u64,
            vram_total: total as u64,
        }
    }

    pub fn cuda(&self) -> &Arc<Cuda> {
        &self.cuda
    }
}
