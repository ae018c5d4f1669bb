//! A forward's store misses read in the background while its products run: the misses go to
//! the fetch thread as one batch (read at queue depth, each record checked and decoded on
//! the fetch pool's cores as it arrives), and each pick that needs one waits for that record
//! alone ([`Pick::get`]) — resident picks compute while the reads are in flight, and a
//! staged or CPU-lane product starts as soon as its own record is there.
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
}

impl Pick {
    /// The weights, waiting for the record if it is still being read (the wait counts as the
    /// step's `fetch` part).
    pub(super) fn get(&self, stats: &TierStats) -> anyhow::Result<Arc<SwiGlu>> {
        match self {
            Pick::Ready(w) => Ok(w.clone()),
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
