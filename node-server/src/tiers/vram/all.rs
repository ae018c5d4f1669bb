//! [`VramExperts`]: every routed expert of the model in one VRAM arena (the "all in VRAM"
//! ceiling, and the untiered GPU run that `nvme-exact` must match bit for bit). Its MoE steps
//! keep the router's picks on the device ([`DeviceExperts::forward_routed`]).

use super::super::source::ExpertSource;
use super::{STEP_SAMPLE, layout_of, write_slot};
use crate::backend::cuda::{Cuda, MoeStep, SlotArena};
use crate::model::moe::{DeviceExperts, ExpertProvider, Phase, Routing};
use anyhow::{Context, bail};
use cudarc::driver::CudaSlice;
use std::sync::Arc;
use std::sync::Mutex;

/// Events recorded around a sampled MoE step on the device, read once both have completed
/// (at the next sample or scrape: nothing waits for them).
struct StepTimer {
    start: cudarc::driver::CudaEvent,
    end: cudarc::driver::CudaEvent,
    /// `end` recorded and not yet read.
    pending: bool,
}

/// Every routed expert in VRAM.
pub struct VramExperts {
    cuda: Arc<Cuda>,
    arena: Mutex<SlotArena>,
    limit: f32,
    /// Slot of each (layer, expert); empty for dense layers.
    slots: Vec<Vec<u32>>,
    /// The same on the device, layer after layer (for steps whose picks stay there), and
    /// where each layer's row starts.
    slot_table: CudaSlice<i32>,
    slot_table_at: Vec<usize>,
    /// Picks served, by phase (prefill, decode).
    picks: [std::sync::atomic::AtomicU64; 2],
    /// Seconds of the last timed MoE step (f64 bits): a step from host rows, its wall time
    /// (it ends with the result's download, so the device time plus the copies); a step on
    /// the device, its device time between the events of [`StepTimer`].
    step_seconds: std::sync::atomic::AtomicU64,
    /// The events around the last sampled step on the device.
    timer: Mutex<StepTimer>,
    /// Bytes copied in at load.
    loaded_bytes: u64,
    /// Steps taken through [`DeviceExperts::forward_device`] (every STEP_SAMPLE-th is timed).
    device_steps: std::sync::atomic::AtomicU64,
}

impl VramExperts {
    /// Loads every expert of the MoE layers (`moe_layers[l]`) from `source` into one arena.
    pub fn load_all(
        cuda: Arc<Cuda>,
        source: &dyn ExpertSource,
        moe_layers: &[bool],
        experts: usize,
    ) -> anyhow::Result<VramExperts> {
        let Some(first_layer) = moe_layers.iter().position(|&m| m) else {
            bail!("the model has no MoE layer to put experts of in VRAM");
        };
        let first = source.load(first_layer, 0)?;
        let layout = layout_of(&first)?;
        let total = moe_layers.iter().filter(|&&m| m).count() * experts;
        let need = total * layout.slot_bytes;
        let (free, _) = cuda.mem_info()?;
        if need > free {
            bail!(
                "all {total} experts need {} MiB of VRAM, {} MiB are free: use a tiered mode (--mode nvme) with fewer --vram-slots",
                need >> 20,
                free >> 20
            );
        }
        let mut arena = SlotArena::new(&cuda, layout, total)?;
        let mut slots = Vec::with_capacity(moe_layers.len());
        let mut next = 0usize;
        for (l, &moe) in moe_layers.iter().enumerate() {
            if !moe {
                slots.push(Vec::new());
                continue;
            }
            let mut row = Vec::with_capacity(experts);
            // Read a batch on all cores (store reads are checked and decoded on the CPU),
            // then copy it in.
            for batch in (0..experts).collect::<Vec<_>>().chunks(32) {
                use rayon::prelude::*;
                let loaded: Vec<_> = batch
                    .par_iter()
                    .map(|&e| {
                        source
                            .load(l, e)
                            .with_context(|| format!("loading layer {l} expert {e}"))
                    })
                    .collect::<anyhow::Result<_>>()?;
                for (&e, expert) in batch.iter().zip(&loaded) {
                    write_slot(cuda.stream(), &mut arena, next, expert)
                        .with_context(|| format!("layer {l} expert {e}"))?;
                    row.push(next as u32);
                    next += 1;
                }
            }
            slots.push(row);
        }
        let mut slot_table_at = Vec::with_capacity(slots.len());
        let mut flat: Vec<i32> = Vec::with_capacity(total);
        for row in &slots {
            slot_table_at.push(flat.len());
            flat.extend(row.iter().map(|&s| s as i32));
        }
        let slot_table = cuda.upload(&flat)?;
        cuda.synchronize()?;
        tracing::info!(
            experts = total,
            slot_bytes = layout.slot_bytes,
            mib = need >> 20,
            "every routed expert in VRAM"
        );
        let timer = Mutex::new(StepTimer {
            start: cuda.timing_event()?,
            end: cuda.timing_event()?,
            pending: false,
        });
        Ok(VramExperts {
            cuda,
            arena: Mutex::new(arena),
            limit: first.limit,
            slots,
            slot_table,
            slot_table_at,
            picks: Default::default(),
            step_seconds: Default::default(),
            timer,
            loaded_bytes: need as u64,
            device_steps: Default::default(),
        })
    }

    /// The metrics registry's view (read at each scrape): every lookup a VRAM hit, every
    /// product on the GPU, the VRAM in use, the last step's time.
    pub fn metrics_snapshot(&self) -> crate::metrics::TierSnapshot {
        use std::sync::atomic::Ordering::Relaxed;
        self.read_timer();
        let (free, total) = self.cuda.mem_info().unwrap_or((0, 0));
        let slots = self.slots.iter().map(Vec::len).sum::<usize>() as u64;
        let [prefill, decode] = [&self.picks[0], &self.picks[1]].map(|c| c.load(Relaxed));
        crate::metrics::TierSnapshot {
            lookups: vec![("vram", "prefill", prefill), ("vram", "decode", decode)],
            residency: vec![("vram", slots, slots)],
            memory: vec![
                ("vram_used", (total - free) as u64),
                ("vram_total", total as u64),
            ],
            gpu_h2d_bytes: self.loaded_bytes,
            expert_products: vec![("gpu", prefill + decode), ("cpu", 0)],
            gpu_moe_step_seconds: f64::from_bits(self.step_seconds.load(Relaxed)),
            ..Default::default()
        }
    }
}

impl VramExperts {
    /// The arena slot of each pick of `routing` in `layer`.
    fn slots_of(&self, layer: usize, routing: &Routing) -> anyhow::Result<Vec<u32>> {
        let row = &self.slots[layer];
        routing
            .ids
            .iter()
            .map(|&e| row.get(e as usize).copied())
            .collect::<Option<_>>()
            .with_context(|| {
                format!(
                    "layer {layer} routes to an expert outside its {} experts",
                    row.len()
                )
            })
    }

    fn count_picks(&self, routing: &Routing) {
        self.count_phases(&routing.phases, routing.tokens(), routing.k);
    }

    /// Counts `k` picks for each of `tokens` tokens by its phase (prefill where none given).
    fn count_phases(&self, phases: &[Phase], tokens: usize, k: usize) {
        use std::sync::atomic::Ordering::Relaxed;
        for t in 0..tokens {
            let decode = phases.get(t).copied().unwrap_or_default() == Phase::Decode;
            self.picks[decode as usize].fetch_add(k as u64, Relaxed);
        }
    }

    /// Runs `step` for a MoE step, timing every STEP_SAMPLE-th on the device by two events
    /// around it for the step-time gauge (read later: nothing here waits for the device).
    /// A step captured into a graph goes untimed (its events would not be recorded).
    fn sampled<T>(&self, step: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
        use std::sync::atomic::Ordering::Relaxed;
        if self.cuda.capturing() {
            return step();
        }
        if !self
            .device_steps
            .fetch_add(1, Relaxed)
            .is_multiple_of(STEP_SAMPLE)
        {
            return step();
        }
        self.read_timer();
        let timer = self.timer.lock().unwrap_or_else(|e| e.into_inner());
        if timer.pending {
            // The last sample has not completed yet: this step goes untimed.
            drop(timer);
            return step();
        }
        timer.start.record(self.cuda.stream())?;
        drop(timer);
        let out = step()?;
        let mut timer = self.timer.lock().unwrap_or_else(|e| e.into_inner());
        timer.end.record(self.cuda.stream())?;
        timer.pending = true;
        Ok(out)
    }

    /// Stores the last sampled step's device time if both its events have completed.
    fn read_timer(&self) {
        let mut t = self.timer.lock().unwrap_or_else(|e| e.into_inner());
        if !t.pending || !t.end.try_is_complete().unwrap_or(false) {
            return;
        }
        t.pending = false;
        if let Ok(ms) = t.start.elapsed_ms(&t.end) {
            let secs = f64::from(ms) / 1e3;
            self.step_seconds
                .store(secs.to_bits(), std::sync::atomic::Ordering::Relaxed);
        }
    }
}

impl DeviceExperts for VramExperts {
    fn device(&self) -> &Arc<Cuda> {
        &self.cuda
    }

    fn forward_device(
        &self,
        layer: usize,
        x: &CudaSlice<f32>,
        routing: &Routing,
    ) -> anyhow::Result<CudaSlice<f32>> {
        let arena = self.arena.lock().unwrap_or_else(|e| e.into_inner());
        let slots = self.slots_of(layer, routing)?;
        let y = self.sampled(|| {
            let mut run = self
                .cuda
                .moe_begin_dev(arena.layout, routing.tokens(), routing.k, x)?;
            let picks: Vec<(usize, u32)> = slots.iter().copied().enumerate().collect();
            self.cuda
                .moe_picks(&mut run, &arena.buf, self.limit, &picks)?;
            Ok(self.cuda.moe_combine(run, &routing.weights)?)
        })?;
        self.count_picks(routing);
        Ok(y)
    }

    /// Every expert is here: any MoE layer's picks stay on the device when the step is
    /// small enough for one grouping launch.
    fn routes(&self, layer: usize, picks: usize) -> bool {
        self.slots.get(layer).is_some_and(|row| !row.is_empty()) && Cuda::moe_routes(picks)
    }

    fn count_replayed(&self, _layer: usize, tokens: usize, k: usize) {
        self.count_phases(&vec![Phase::Decode; tokens], tokens, k);
    }

    fn forward_routed(
        &self,
        layer: usize,
        x: &CudaSlice<f32>,
        ids: &CudaSlice<i32>,
        weights: &CudaSlice<f32>,
        phases: &[Phase],
        k: usize,
    ) -> anyhow::Result<CudaSlice<f32>> {
        let arena = self.arena.lock().unwrap_or_else(|e| e.into_inner());
        let experts = self.slots.get(layer).map_or(0, Vec::len);
        if experts == 0 {
            bail!("layer {layer} has no routed experts");
        }
        let at = self.slot_table_at[layer];
        let slot_of = self.slot_table.slice(at..at + experts);
        let tokens = phases.len();
        let y = self.sampled(|| {
            Ok(self.cuda.moe_routed(
                &arena.buf,
                arena.layout,
                self.limit,
                x,
                ids,
                weights,
                &slot_of,
                tokens,
                k,
            )?)
        })?;
        self.count_phases(phases, tokens, k);
        Ok(y)
    }
}

impl ExpertProvider for VramExperts {
    fn forward(
        &self,
        layer: usize,
        x: &[f32],
        routing: &Routing,
        out: &mut [f32],
    ) -> anyhow::Result<()> {
        let arena = self.arena.lock().unwrap_or_else(|e| e.into_inner());
        let slots = self.slots_of(layer, routing)?;
        let step = MoeStep {
            layout: arena.layout,
            tokens: routing.tokens(),
            k: routing.k,
            limit: self.limit,
            slots: &slots,
            weights: &routing.weights,
        };
        let started = std::time::Instant::now();
        let y = self.cuda.moe(&arena.buf, &step, x)?;
        let secs = started.elapsed().as_secs_f64();
        self.step_seconds
            .store(secs.to_bits(), std::sync::atomic::Ordering::Relaxed);
        self.count_picks(routing);
        out.iter_mut().zip(&y).for_each(|(o, v)| *o += v);
        Ok(())
    }

    fn on_device(&self) -> Option<&dyn DeviceExperts> {
        Some(self)
    }

    fn weight_bytes(&self) -> usize {
        let arena = self.arena.lock().unwrap_or_else(|e| e.into_inner());
        arena.slots * arena.layout.slot_bytes
    }
}

/// The model in `dir` with every routed expert in VRAM and every dense weight on the GPU,
/// and the experts' provider (for its metrics). `host_copies`: as [`load_dense_on_gpu`].
pub fn load_model_on_gpu(
    dir: &std::path::Path,
    cuda: Arc<Cuda>,
    host_copies: bool,
) -> anyhow::Result<(crate::model::Model, Arc<VramExperts>)> {
    let cfg = crate::model::config::Config::from_file(&dir.join("config.json"))?;
    let moe = cfg.moe_layers();
    let source = super::super::source::CheckpointSource::open(dir)?;
    let vram = Arc::new(VramExperts::load_all(
        cuda.clone(),
        &source,
        &moe,
        cfg.n_routed_experts,
    )?);
    Ok((
        load_dense_on_gpu(dir, vram.clone(), cuda, host_copies)?,
        vram,
    ))
}

/// The model in `dir` with every dense weight on the GPU and routed experts from `experts`.
/// Without `host_copies` the host bytes of every weight the GPU holds are given back once
/// loaded ([`crate::model::Weights::release_host_copies`]; the memory plan counts them
/// so): the host keeps the embedding and MLA's `kv_b`.
pub fn load_dense_on_gpu(
    dir: &std::path::Path,
    experts: Arc<dyn ExpertProvider>,
    cuda: Arc<Cuda>,
    host_copies: bool,
) -> anyhow::Result<crate::model::Model> {
    let placer = crate::backend::cuda::matrix::CudaPlacer::new(cuda, 1)?;
    let mut model = crate::model::Model::builder()
        .experts(experts)
        .placer(&placer)
        .load(dir)?;
    if let Some(failure) = placer.failure() {
        tracing::warn!(%failure, "some dense weights stay on the CPU");
    }
    tracing::info!(
        dense_mib = placer.placed_bytes() >> 20,
        "dense weights on the GPU"
    );
    if !host_copies {
        let rss = crate::tiers::sizing::rss_bytes();
        let freed = model.weights.release_host_copies();
        give_back_freed_memory();
        tracing::info!(
            freed_mib = freed >> 20,
            rss_mib_before = rss >> 20,
            rss_mib_after = crate::tiers::sizing::rss_bytes() >> 20,
            "the dense weights' host copies given back (the GPU holds them; --vram-host-copies keeps them)"
        );
    }
    Ok(model)
}

/// Returns the heap's free pages to the system (glibc keeps blocks under the mmap threshold
/// in its heap after they are freed), so what was given back leaves the process's RSS.
#[allow(unsafe_code)] // malloc_trim, the one libc call that does it
fn give_back_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap pages to the system; it touches no live block.
    unsafe {
        libc::malloc_trim(0);
    }
}
