//! A batch of decode steps as one CUDA graph (issue 17 item 1). A step is ~300 small launches,
//! and on many hosts queueing them, not the device, sets its time; a replayed graph is one
//! launch.
//!
//! The first step of a batch layout (the sequences' cache buffers, in order) runs the forward
//! under a stream capture: its launches become the graph, which is then launched to run the
//! step. Later steps of the same layout replay it with two inputs set first: the tokens'
//! embedding rows, and the graph's step count (replays since the capture). The ops whose
//! arguments move with the position read that count on the device: the caches' stores
//! ([`Cuda::cache_store`]), the indexer's pool and selection ([`Cuda::dsa_pool_step`],
//! [`Cuda::dsa_select_step`]) and the attention's offsets. Everything else a decode step
//! launches is the same at every position. Room for a step's cache rows is made before the
//! capture or replay (a cache that moves is a new layout), and after a replay the host's
//! counts of cached values advance as the ops would have advanced them; the capture checks
//! that rule against what its own run did.
//!
//! Only where every MoE layer's picks stay on the device (all experts in VRAM): a pick that
//! must come to the host cannot be captured. A capture that fails leaves the caches as they
//! were and turns graphs off for the process (the step then runs op by op).

use super::*;
use crate::backend::cuda::StepGraph;
use crate::model::glm5::{Attention, FeedForward, LayerCache, Model, Step, Weights};
use cudarc::driver::DevicePtr;

/// Graphs kept at once (each holds its step's buffers); the least recently used goes. A
/// layout outlives few changes of a batch (a finished sequence ends every layout it was in).
pub const DECODE_GRAPHS_KEPT: usize = 4;

/// Whether decode steps run as CUDA graphs: on unless `GLMFLASH_DECODE_GRAPH=0` (op by op,
/// for A/B runs and as a fallback).
pub fn decode_graphs() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("GLMFLASH_DECODE_GRAPH").map_or(true, |v| v != "0"))
}

pub(super) struct Graphs {
    /// Decode steps run as graphs here ([`decode_graphs`] unless set otherwise).
    on: std::sync::atomic::AtomicBool,
    /// The inputs of the step being captured, which the ops read while capturing.
    capture: Mutex<Option<Inputs>>,
    kept: Mutex<Kept>,
}

impl Default for Graphs {
    fn default() -> Graphs {
        Graphs {
            on: decode_graphs().into(),
            capture: Default::default(),
            kept: Default::default(),
        }
    }
}

#[derive(Default)]
struct Kept {
    /// Least recently used first.
    graphs: Vec<Entry>,
    /// A capture failed: every step runs op by op.
    off: bool,
    captures: u64,
    replays: u64,
}

/// A graph's inputs, set before each launch.
pub(super) struct Inputs {
    /// Replays since the capture (0 at the capture's own launch).
    pub(super) step: CudaSlice<i32>,
    /// The batch's embedding rows, `[sequences, hidden]`.
    pub(super) emb: CudaSlice<f32>,
}

struct Entry {
    key: Vec<u64>,
    /// Each sequence's tokens when captured.
    lens: Vec<usize>,
    inputs: Inputs,
    graph: StepGraph,
}

impl Graphs {
    /// The inputs of the step being captured on `cuda` (none when not capturing).
    pub(super) fn inputs(&self, cuda: &Cuda) -> std::sync::MutexGuard<'_, Option<Inputs>> {
        let guard = self.capture.lock().unwrap_or_else(|e| e.into_inner());
        debug_assert!(guard.is_none() || cuda.capturing());
        guard
    }
}

impl Gpu {
    /// Decode steps as graphs on this device, or op by op (checks compare the two).
    pub fn set_decode_graphs(&self, on: bool) {
        self.graphs
            .on
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// (graphs captured, replays) so far on this device.
    pub fn graph_counts(&self) -> (u64, u64) {
        let kept = self.graphs.kept.lock().unwrap_or_else(|e| e.into_inner());
        (kept.captures, kept.replays)
    }

    /// [`Device::decode_graph`]: replays the batch layout's graph, or captures one.
    pub(super) fn decode_step(
        &self,
        model: &Model,
        w: &Weights<Gpu>,
        steps: &mut [Step<Gpu>],
    ) -> anyhow::Result<Option<Vec<Vec<f32>>>> {
        let on = self.graphs.on.load(std::sync::atomic::Ordering::Relaxed);
        if !on || self.profile.is_some() || !self.graphable(model, w, steps) {
            return Ok(None);
        }
        let mut kept = self.graphs.kept.lock().unwrap_or_else(|e| e.into_inner());
        if kept.off {
            return Ok(None);
        }
        self.make_step_room(w, steps)?;
        let key = self.layout_key(steps);
        let lens: Vec<usize> = steps.iter().map(|s| s.cache.len).collect();
        let rows = model.embedded_rows(steps);
        let (n, width, keep) = (steps.len(), w.lm_head.rows(), model.cfg.vocab_size);
        let split = |v: &[f32]| split_rows(v, &vec![1; n], width, keep);
        // A replay moves every sequence on by the same count of steps.
        let replays = |e: &Entry| {
            let r = lens[0].wrapping_sub(e.lens[0]);
            e.key == key
                && e.lens
                    .iter()
                    .zip(&lens)
                    .all(|(a, b)| b.wrapping_sub(*a) == r)
        };
        if let Some(i) = kept.graphs.iter().position(replays) {
            let mut e = kept.graphs.remove(i);
            let r = i32::try_from(lens[0] as i64 - e.lens[0] as i64)?;
            self.cuda.fill_bits(&mut e.inputs.step, r as u32)?;
            self.cuda.copy_in(&rows, &mut e.inputs.emb)?;
            let out = self.waited(|| e.graph.replay(&self.cuda, split));
            kept.graphs.push(e);
            kept.replays += 1;
            let out = out?;
            advance(w, steps);
            let experts = model.experts().on_device().expect("checked by graphable");
            for (li, layer) in w.layers.iter().enumerate() {
                if let FeedForward::Moe(moe) = &layer.feed_forward {
                    experts.count_replayed(li, n, moe.router.spec.k);
                }
            }
            for s in steps.iter_mut() {
                s.cache.len += 1;
            }
            return Ok(Some(out));
        }

        if self.side.is_some() {
            // The second queue is made outside the capture (making one is no stream operation).
            drop(self.side_queue()?);
        }
        let before = lens_of(steps);
        let mut inputs = Inputs {
            step: self.cuda.stream().alloc_zeros::<i32>(1)?,
            emb: self.alloc(rows.len())?,
        };
        self.cuda.copy_in(&rows, &mut inputs.emb)?;
        *self
            .graphs
            .capture
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(inputs);
        let spans: Vec<(usize, usize)> = (0..n).map(|s| (s, 1)).collect();
        let started = std::time::Instant::now();
        let captured = self.cuda.capture(n * width, || {
            Ok(model.logits_on(self, w, steps, &spans, None)?.0)
        });
        let inputs = self
            .graphs
            .capture
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let after = lens_of(steps);
        // The rule a replay advances the caches by must give what the capture's run did.
        set_lens(steps, &before);
        advance(w, steps);
        let ruled = lens_of(steps);
        let graph = match (captured, inputs) {
            (Ok(g), Some(inputs)) if ruled == after => (g, inputs),
            (captured, _) => {
                set_lens(steps, &before);
                kept.off = true;
                let why = match captured {
                    // With RUST_BACKTRACE=1, where the refused call was made.
                    Err(e) => format!("{e:?}"),
                    Ok(_) => "a replay would advance the caches otherwise than the step".into(),
                };
                tracing::warn!(error = %why, "decode steps run op by op: a step could not be captured as a graph");
                return Ok(None);
            }
        };
        let (graph, inputs) = graph;
        tracing::debug!(
            sequences = n,
            capture_ms = started.elapsed().as_secs_f64() * 1e3,
            "a decode step captured as a graph"
        );
        let mut e = Entry {
            key,
            lens,
            inputs,
            graph,
        };
        let out = self.waited(|| e.graph.replay(&self.cuda, split))?;
        kept.captures += 1;
        if kept.graphs.len() >= DECODE_GRAPHS_KEPT {
            drop(kept.graphs.remove(0));
            self.cuda.trim_graph_memory();
        }
        kept.graphs.push(e);
        for s in steps.iter_mut() {
            s.cache.len += 1;
        }
        Ok(Some(out))
    }

    /// A batch of decode steps whose every MoE layer routes on this device.
    fn graphable(&self, model: &Model, w: &Weights<Gpu>, steps: &[Step<Gpu>]) -> bool {
        if !steps.iter().all(|s| s.is_decode()) {
            return false;
        }
        let experts = model.experts();
        let Some(dev) = experts.on_device() else {
            return false;
        };
        if !Arc::ptr_eq(dev.device(), &self.cuda) || experts.wants_prefetch() {
            return false;
        }
        w.layers
            .iter()
            .enumerate()
            .all(|(li, l)| match &l.feed_forward {
                FeedForward::Moe(moe) => dev.routes(li, steps.len() * moe.router.spec.k),
                FeedForward::Dense(_) => true,
            })
    }

    /// Room in every cache of the batch for one more token's rows.
    fn make_step_room(&self, w: &Weights<Gpu>, steps: &mut [Step<Gpu>]) -> anyhow::Result<()> {
        for s in steps.iter_mut() {
            for (cache, layer) in s.cache.layers.iter_mut().zip(&w.layers) {
                if let (LayerCache::Mla(c), Attention::Mla(m)) = (cache, &layer.attention) {
                    self.make_room(&mut c.latents, m.spec.rank)?;
                    if let (Some(ic), Some(ix)) = (c.indexer.as_mut(), m.indexer.as_ref()) {
                        let di = ix.spec.dim;
                        self.make_room(&mut ic.keys, di)?;
                        self.make_room(&mut ic.gates, di)?;
                        self.make_room(&mut ic.pool_keys, di)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// [`Device::dsa_pools`] in a capture: the pool a replay's token completes, if any, found
    /// and stored on the device; the host counts what this step completes.
    pub(super) fn pool_step(
        &self,
        spec: DsaSpec,
        ape: &Buf,
        keys: &GrowBuf,
        gates: &GrowBuf,
        pool_keys: &mut GrowBuf,
        step: &CudaSlice<i32>,
    ) -> anyhow::Result<()> {
        let (di, kpool) = (spec.dim, spec.kpool);
        let tokens = keys.len / di;
        let (pool, complete) = (pool_keys.len / di, tokens / kpool);
        if complete < pool || complete > pool + 1 {
            bail!("a captured decode step completes pools {pool} to {complete}");
        }
        if (keys.dtype, gates.dtype) != (pool_keys.dtype, pool_keys.dtype) {
            bail!("the indexer's caches differ in dtype");
        }
        let cache = (&keys.buf, &gates.buf, keys.dtype);
        self.cuda
            .dsa_pool_step(cache, ape, kpool, tokens, step, &mut pool_keys.buf)?;
        pool_keys.len = complete * di;
        Ok(())
    }

    /// What a graph depends on besides its inputs: the batch's cache buffers (where, how
    /// large) and the settings its launches were made with.
    fn layout_key(&self, steps: &[Step<Gpu>]) -> Vec<u64> {
        let stream = self.cuda.stream();
        let ptr = |b: &CudaSlice<u8>| b.device_ptr(stream).0;
        let mut key = vec![steps.len() as u64, self.cuda.settings_key()];
        for s in steps {
            for cache in &s.cache.layers {
                match cache {
                    LayerCache::Kda(st) => {
                        key.push(st.conv.device_ptr(stream).0);
                        key.push(st.recurrent.device_ptr(stream).0);
                    }
                    LayerCache::Mla(c) => {
                        let mut bufs = vec![&c.latents];
                        if let Some(ic) = &c.indexer {
                            bufs.extend([&ic.keys, &ic.gates, &ic.pool_keys]);
                        }
                        for g in bufs {
                            key.extend([ptr(&g.buf), g.buf.len() as u64]);
                        }
                    }
                }
            }
        }
        key
    }
}

/// Every cache buffer of the batch, in order.
fn grow_bufs<'a>(steps: &'a mut [Step<Gpu>]) -> Vec<&'a mut GrowBuf> {
    let mut out = Vec::new();
    for s in steps.iter_mut() {
        for cache in s.cache.layers.iter_mut() {
            if let LayerCache::Mla(c) = cache {
                out.push(&mut c.latents);
                if let Some(ic) = c.indexer.as_mut() {
                    out.extend([&mut ic.keys, &mut ic.gates, &mut ic.pool_keys]);
                }
            }
        }
    }
    out
}

fn lens_of(steps: &mut [Step<Gpu>]) -> Vec<usize> {
    grow_bufs(steps).iter().map(|g| g.len).collect()
}

fn set_lens(steps: &mut [Step<Gpu>], lens: &[usize]) {
    for (g, &len) in grow_bufs(steps).into_iter().zip(lens) {
        g.len = len;
    }
}

/// The host's counts of cached values after one decode step, as the ops advance them: a
/// latent row, an indexer key and gate row, and a pool key row when the token completes a
/// pool.
fn advance(w: &Weights<Gpu>, steps: &mut [Step<Gpu>]) {
    for s in steps.iter_mut() {
        for (cache, layer) in s.cache.layers.iter_mut().zip(&w.layers) {
            if let (LayerCache::Mla(c), Attention::Mla(m)) = (cache, &layer.attention) {
                c.latents.len += m.spec.rank;
                if let (Some(ic), Some(ix)) = (c.indexer.as_mut(), m.indexer.as_ref()) {
                    let di = ix.spec.dim;
                    ic.keys.len += di;
                    ic.gates.len += di;
                    if (ic.keys.len / di).is_multiple_of(ix.spec.kpool) {
                        ic.pool_keys.len += di;
                    }
                }
            }
        }
    }
}
