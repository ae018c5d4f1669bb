//! A forward's store misses read in the background while its products run: the misses go to
//! the fetch thread as one batch (read at queue depth, each record checked and decoded on
//! the fetch pool's cores as it arrives), and each pick that needs one waits for that record
//! alone ([`Pick::get`]) — resident picks compute while the reads are in flight, and a
//! staged or CPU-lane product starts as soon as its own record is there.
//!
//! A prompt chunk's next MoE layer is read ahead the same way ([`TieredExperts::send_ahead`]),
//! once this layer's own records are admitted or dropped.
//!
//! The fetch pool is not rayon's global one: the products block on records inside the
//! global pool's workers, which must not be the threads that would deliver them.

use super::*;
use std::sync::Condvar;

/// One record on its way from the store.
#[derive(Default)]
pub(super) struct Cell {
    state: Mutex<Option<Result<Arc<SwiGlu>, Arc<anyhow::Error>>>>,
    ready: Condvar,
}

impl Cell {
    fn set(&self, result: anyhow::Result<SwiGlu>) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if state.is_none() {
            *state = Some(result.map(Arc::new).map_err(Arc::new));
            self.ready.notify_all();
        }
    }

    /// The record, once read (blocking until then).
    fn wait(&self) -> anyhow::Result<Arc<SwiGlu>> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match &*state {
                Some(Ok(w)) => return Ok(w.clone()),
                Some(Err(e)) => return Err(anyhow::anyhow!("{e:#}")),
                None => state = self.ready.wait(state).unwrap_or_else(|e| e.into_inner()),
            }
        }
    }

    /// The record if it was read without error (after the products, for admission).
    pub(super) fn read(&self) -> Option<Arc<SwiGlu>> {
        match &*self.state.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(Ok(w)) => Some(w.clone()),
            _ => None,
        }
    }
}

/// A pick's weights: at hand, or on their way from the store.
#[derive(Clone)]
pub(super) enum Pick {
    Ready(Arc<SwiGlu>),
    Coming(Arc<Cell>),
    /// In a VRAM slot, with no host copy ([`super::TierPlan::copy_down`]): the GPU tier
    /// computes it from the slot.
    InSlot,
}

impl Pick {
    /// The weights, waiting for the record if it is still being read (the wait counts as the
    /// step's `fetch` part).
    pub(super) fn get(&self, stats: &TierStats) -> anyhow::Result<Arc<SwiGlu>> {
        match self {
            Pick::Ready(w) => Ok(w.clone()),
            Pick::InSlot => {
                anyhow::bail!("it is in a VRAM slot and has no host copy")
            }
            Pick::Coming(cell) => {
                let started = std::time::Instant::now();
                let w = cell.wait();
                stats.add_part(StepPart::Fetch, started);
                w
            }
        }
    }
}

/// One batch of misses for the fetch thread.
pub(super) struct Job {
    pub layer: usize,
    pub experts: Vec<usize>,
    pub cells: Vec<Arc<Cell>>,
}

/// Fails every cell the job has not filled (a panic or an early return on the fetch thread
/// must not leave a product waiting forever).
struct FillOnDrop<'a>(&'a [Arc<Cell>]);

impl Drop for FillOnDrop<'_> {
    fn drop(&mut self) {
        for cell in self.0 {
            cell.set(Err(anyhow::anyhow!("the store read was abandoned")));
        }
    }
}

/// The fetch thread: reads each job's records with [`ExpertSource::load_each`] on a pool of
/// its own, filling the cells as records arrive; ends when the sender is dropped.
pub(super) fn spawn_fetcher(
    source: Arc<dyn ExpertSource>,
    stats: Arc<TierStats>,
) -> anyhow::Result<(std::sync::mpsc::Sender<Job>, std::thread::JoinHandle<()>)> {
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("store-fetch-{i}"))
        .build()?;
    let (tx, rx) = std::sync::mpsc::channel::<Job>();
    let thread = std::thread::Builder::new()
        .name("expert-fetch".into())
        .spawn(move || {
            for job in rx {
                let _fill = FillOnDrop(&job.cells);
                let keys: Vec<(usize, usize)> =
                    job.experts.iter().map(|&e| (job.layer, e)).collect();
                // The reads overlap: each record is timed from the one delivered before it
                // (the first from the batch's start), so the latency histogram and the fetch
                // thread's busy time sum to the time the store was busy for the tiers. Counted
                // before the cell is filled: a forward that has its records has their counts.
                let last = Mutex::new(std::time::Instant::now());
                pool.install(|| {
                    source.load_each(&keys, &|i, result| {
                        let since = {
                            let now = std::time::Instant::now();
                            let mut last = last.lock().unwrap_or_else(|e| e.into_inner());
                            let since = now.saturating_duration_since(*last);
                            *last = now;
                            since
                        };
                        stats
                            .fetch_busy_nanos
                            .fetch_add(since.as_nanos() as u64, Ordering::Relaxed);
                        match &result {
                            Ok(_) => {
                                stats.store_read_latency.observe(since);
                                stats.store_reads.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(_) => {
                                stats.store_read_errors.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        job.cells[i].set(result);
                    })
                });
            }
        })?;
    Ok((tx, thread))
}

impl TieredExperts {
    /// Sends the picked experts of `layer` that no tier holds (and no prefetch staged) to
    /// the fetch thread in one batch, in the order the products first need them: the store
    /// serves them at queue depth while the products run, instead of one after another under
    /// the layer's lock. One miss is left to the lookup itself. Without the plan's
    /// `fetch_overlap` this waits for the whole batch.
    pub(super) fn start_fetch(&self, layer: usize, routing: &Routing) -> Vec<(usize, Arc<Cell>)> {
        let Some(fetcher) = &self.fetcher else {
            return Vec::new();
        };
        {
            // A read-ahead of this layer that was never sent (its forward failed early).
            let mut request = self.ahead_request.lock().expect("read-ahead request");
            if request.as_ref().is_some_and(|(l, _)| *l == layer) {
                *request = None;
            }
        }
        let mut seen = std::collections::HashSet::new();
        let missing: Vec<usize> = {
            let l = self.layer(layer);
            let staged = self.staged.lock().expect("staging lock");
            routing
                .ids
                .iter()
                .map(|&e| e as usize)
                .filter(|&e| seen.insert(e) && !l.holds(e) && !staged.contains_key(&(layer, e)))
                .collect()
        };
        // What was read ahead for this layer serves its misses; the rest of it is wasted.
        let mut cells: Vec<Option<Arc<Cell>>> = Vec::with_capacity(missing.len());
        {
            let mut ahead = self.ahead.lock().expect("read-ahead map");
            cells.extend(missing.iter().map(|&e| ahead.remove(&(layer, e))));
            let before = ahead.len();
            ahead.retain(|&(l, _), _| l != layer);
            self.stats
                .prefetch_wasted
                .fetch_add((before - ahead.len()) as u64, Ordering::Relaxed);
        }
        let read_ahead = cells.iter().filter(|c| c.is_some()).count();
        self.stats
            .prefetch_hits
            .fetch_add(read_ahead as u64, Ordering::Relaxed);
        // The rest in one batch (one alone is left to its lookup).
        let new: Vec<usize> = missing
            .iter()
            .zip(&cells)
            .filter(|(_, c)| c.is_none())
            .map(|(&e, _)| e)
            .collect();
        if new.len() >= 2 {
            let fresh: Vec<Arc<Cell>> = new.iter().map(|_| Arc::default()).collect();
            let job = fetch::Job {
                layer,
                experts: new,
                cells: fresh.clone(),
            };
            // If the fetch thread is gone (shutting down), the lookups read them.
            if fetcher.lock().expect("fetch queue").send(job).is_ok() {
                let mut fresh = fresh.into_iter();
                for c in cells.iter_mut().filter(|c| c.is_none()) {
                    *c = fresh.next();
                }
            }
        }
        // In the order the products first need them (the admissions follow it too).
        let coming: Vec<(usize, Arc<Cell>)> = missing
            .into_iter()
            .zip(cells)
            .filter_map(|(e, c)| Some((e, c?)))
            .collect();
        if !self.plan.fetch_overlap {
            for (_, cell) in &coming {
                // An error stays in the cell for the pick that needs it.
                let _ = Pick::Coming(cell.clone()).get(&self.stats);
            }
        }
        coming
    }

    /// Sends the read-ahead a prompt chunk asked for ([`ExpertProvider::prefetch`]) to the
    /// fetch thread, once the forward before it has admitted or dropped its own records: at
    /// most one layer's misses are held beside the tiers (what the memory plan keeps room
    /// for), and the next layer's reads overlap what runs before its experts (attention,
    /// the shared expert, the dense layers between).
    fn send_ahead(&self) {
        let Some(fetcher) = &self.fetcher else { return };
        let Some((layer, experts)) = self
            .ahead_request
            .lock()
            .expect("read-ahead request")
            .take()
        else {
            return;
        };
        // Placed meanwhile (the history fill, an admission): not read again.
        let experts: Vec<usize> = {
            let l = self.layer(layer);
            experts.into_iter().filter(|&e| !l.holds(e)).collect()
        };
        if experts.is_empty() {
            return;
        }
        let cells: Vec<Arc<Cell>> = experts.iter().map(|_| Arc::default()).collect();
        {
            let mut ahead = self.ahead.lock().expect("read-ahead map");
            for (&e, cell) in experts.iter().zip(&cells) {
                ahead.insert((layer, e), cell.clone());
            }
        }
        self.stats
            .prefetch_issued
            .fetch_add(experts.len() as u64, Ordering::Relaxed);
        let job = fetch::Job {
            layer,
            experts,
            cells,
        };
        if fetcher.lock().expect("fetch queue").send(job).is_err() {
            self.ahead
                .lock()
                .expect("read-ahead map")
                .retain(|&(l, _), _| l != layer);
        }
    }

    /// After the products: the records the fetch thread read for them are admitted as a
    /// lookup's own read would have been (unless another path placed them meanwhile).
    fn admit_fetched(&self, layer: usize, coming: &[(usize, Arc<Cell>)]) {
        if coming.is_empty() {
            return;
        }
        let started = std::time::Instant::now();
        let mut jobs = Vec::new();
        {
            let mut l = self.layer(layer);
            for (e, cell) in coming {
                let e = *e;
                let Some(w) = cell.read() else { continue };
                if l.holds(e) {
                    continue;
                }
                self.admit(layer, &mut l, e, w, &mut jobs);
            }
        }
        let at = self.stats.add_part(StepPart::Resolve, started);
        self.write_back(jobs);
        self.stats.add_part(StepPart::WriteBack, at);
    }

    /// The products' order of the distinct experts `routing` picked: those at hand first,
    /// then the records on their way, in the order the fetch thread reads them.
    pub(super) fn product_order(&self, picked: &Picked, routing: &Routing) -> Vec<usize> {
        let mut seen = std::collections::HashSet::new();
        let (mut ready, mut coming): (Vec<usize>, Vec<usize>) = routing
            .ids
            .iter()
            .map(|&e| e as usize)
            .filter(|&e| seen.insert(e))
            .partition(|e| !matches!(picked.picked[e], Pick::Coming(_)));
        ready.append(&mut coming);
        ready
    }
}

/// A `forward`'s picks between resolving and the products' end: each distinct expert's
/// weights or its record on the way. Dropped (whichever way the products return), it counts
/// their time and admits the records read for them.
pub(super) struct Picked<'a> {
    pub(super) tiers: &'a TieredExperts,
    pub(super) layer: usize,
    pub(super) picked: HashMap<usize, Pick>,
    pub(super) coming: Vec<(usize, Arc<Cell>)>,
    pub(super) started: std::time::Instant,
}

impl Picked<'_> {
    /// The weights of picked expert `e` (waiting for its record if it is still being read).
    pub(super) fn get(&self, e: usize) -> anyhow::Result<Arc<SwiGlu>> {
        self.picked
            .get(&e)
            .ok_or_else(|| anyhow::anyhow!("expert {e} was not picked"))?
            .get(&self.tiers.stats)
            .map_err(|err| err.context(format!("expert {e} of layer {}", self.layer)))
    }
}

impl Drop for Picked<'_> {
    fn drop(&mut self) {
        self.tiers.stats.add_part(StepPart::Compute, self.started);
        let coming = std::mem::take(&mut self.coming);
        if !coming.is_empty() {
            // A record still being read (the products failed early) is waited for here, so
            // the next forward's batch does not read it again.
            for (_, cell) in &coming {
                let _ = Pick::Coming(cell.clone()).get(&self.tiers.stats);
            }
            self.tiers.admit_fetched(self.layer, &coming);
        }
        // What the RAM tier did not admit is freed before the next layer is read ahead.
        drop(coming);
        self.picked.clear();
        self.tiers.send_ahead();
    }
}
