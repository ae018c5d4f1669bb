//! The scheduler: one engine thread owns the model and runs continuous batching.
//!
//! Each tick it drops cancelled sequences (their receiver is gone: the client left), admits
//! waiting sequences while the batch has room and the cache reservation fits, then runs one
//! forward over every running sequence: one token per decoding sequence plus prompt chunks
//! of prefilling ones (at most `chunk_size` prompt tokens per tick, so running streams keep
//! flowing while a long prompt is prefilled). Sampled tokens are decoded to text here, stop
//! strings are held back across token boundaries and cut, and events go to the request's
//! channel.

use super::worker::Worker;
use crate::engine::cache::CacheLayout;
use crate::engine::constraint::{Constraint, Grammars};
use crate::engine::sampling::SamplingParams;
use crate::metrics::Metrics;
use crate::model::Model;
use crate::model::decoder::{
    DEFAULT_GPU_CHUNK, GROWTH_SLACK, GpuDecoder, MAX_ROWS, decode_graphs_bytes, placed_device,
    workspace_bytes,
};
use crate::model::moe::ExpertProvider;
use crate::tokenizer::TextCodec;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub max_batch_size: usize,
    /// Prompt tokens prefilled per tick, over all prefilling sequences.
    pub chunk_size: usize,
    /// Most tokens (prompt + generated) one sequence may hold.
    pub context_length: usize,
    /// Cache budget in bytes over all running sequences: each reserves what its cache will
    /// hold at prompt + max_tokens ([`CacheLayout::bytes_for`]). `None`: room for
    /// `max_batch_size` sequences of `context_length` tokens. Set by [`Engine::start`].
    pub kv_cache_bytes: Option<usize>,
    /// Sequences that may wait for admission; more are refused (429).
    pub max_waiting: usize,
    /// Sequences run with every activation and cache on the GPU (`GpuDecoder`: prompt
    /// chunks and decode steps) when the model's dense weights are on one; else (or when
    /// false) through `Model::forward`.
    pub gpu_forward: bool,
    /// Prompt tokens per tick of the sequences on the GPU (the GPU forward's activations
    /// grow with it; VRAM sizing keeps room for `DEFAULT_GPU_CHUNK`).
    pub gpu_chunk_size: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_batch_size: 8,
            chunk_size: 8192,
            context_length: 131072,
            kv_cache_bytes: None,
            max_waiting: 64,
            gpu_forward: true,
            gpu_chunk_size: DEFAULT_GPU_CHUNK,
        }
    }
}

/// One sequence to generate.
#[derive(Clone, Debug)]
pub struct GenRequest {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// Tokens to generate at most (the API defaults it to the rest of the context).
    pub max_tokens: usize,
    /// Strings that end generation; not emitted.
    pub stop: Vec<String>,
    /// Token ids that end generation (EOS and the chat stop tokens); not emitted.
    pub stop_token_ids: Vec<u32>,
    /// Leave special tokens out of the text (completions); chat keeps them for parsing.
    pub skip_special_tokens: bool,
    /// Forces the output's shape (structured output, forced tool calls); the sequence
    /// ends when the grammar is complete.
    pub constraint: Option<Constraint>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// New text (possibly empty when only logprobs arrive) and, when asked, the log
    /// probabilities of the tokens sampled since the last delta.
    Delta {
        text: String,
        logprobs: Vec<TokenLogprob>,
    },
    Done {
        finish_reason: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    Error(String),
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the waiting queue is full ({0} sequences)")]
    QueueFull(usize),
    #[error("the server is shutting down")]
    ShuttingDown,
}

pub(super) struct Pending {
    pub(super) req: GenRequest,
    pub(super) tx: UnboundedSender<Event>,
    pub(super) submitted: Instant,
}

#[derive(Default)]
pub(super) struct Queue {
    pub(super) waiting: VecDeque<Pending>,
    pub(super) shutdown: bool,
}

impl Queue {
    /// Drops the waiting sequences whose client went away (their receiver is gone) and
    /// counts them.
    pub(super) fn drop_cancelled(&mut self, metrics: &Metrics) {
        let before = self.waiting.len();
        self.waiting.retain(|p| !p.tx.is_closed());
        let gone = before - self.waiting.len();
        if gone > 0 {
            metrics.cancelled.inc_by(gone as u64);
            metrics.waiting.set(self.waiting.len() as i64);
            tracing::debug!(
                sequences = gone,
                "waiting sequences cancelled by their clients"
            );
        }
    }
}

pub(super) struct Shared {
    pub(super) queue: Mutex<Queue>,
    pub(super) cv: Condvar,
}

/// The handle the API holds; the engine thread runs until [`Engine::shutdown`].
pub struct Engine {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    pub config: EngineConfig,
    pub codec: Arc<TextCodec>,
    pub vocab_size: usize,
    /// Bytes a sequence's cache holds per layer type.
    pub layout: CacheLayout,
    /// The budget (not the model) limits `config.context_length`.
    pub context_limited_by_cache: bool,
    grammars: std::sync::OnceLock<Result<Arc<Grammars>, String>>,
    /// The model's routed experts, settled by [`Engine::finish`].
    experts: Arc<dyn ExpertProvider>,
    metrics: Arc<Metrics>,
}

impl Engine {
    /// Starts the engine thread. `config.context_length` is capped at the model's
    /// `max_position_embeddings` and at the tokens one sequence's cache can hold within
    /// the cache budget, which is resolved into `config.kv_cache_bytes`.
    pub fn start(
        model: Model,
        codec: Arc<TextCodec>,
        mut config: EngineConfig,
        metrics: Arc<Metrics>,
    ) -> Engine {
        config.max_batch_size = config.max_batch_size.max(1);
        config.chunk_size = config.chunk_size.max(1);
        // One GPU forward call takes the prompt chunks and a decode row per sequence.
        config.gpu_chunk_size = config
            .gpu_chunk_size
            .clamp(1, MAX_ROWS.saturating_sub(config.max_batch_size).max(1));
        let layout = CacheLayout::of(&model.cfg, model.options.cache);
        let context = config
            .context_length
            .min(model.cfg.max_position_embeddings)
            .max(2);
        let mut capacity = config.kv_cache_bytes.unwrap_or_else(|| {
            layout
                .bytes_for(context)
                .saturating_mul(config.max_batch_size)
        });
        let decoder = if config.gpu_forward {
            gpu_decoder(&model)
                .and_then(|d| fit_on_gpu(d, &model.cfg, &config, context, &mut capacity))
        } else {
            None
        };
        let fits = layout.tokens_within(capacity);
        config.context_length = context.min(fits);
        config.kv_cache_bytes = Some(capacity);
        let context_limited_by_cache = fits < context;
        if context_limited_by_cache {
            tracing::warn!(
                kv_cache_bytes = capacity,
                context_length = config.context_length,
                "the cache budget limits one sequence to fewer tokens than the context length"
            );
        }
        metrics.kv_capacity.set(fits.min(i64::MAX as usize) as i64);
        metrics
            .kv_bytes_capacity
            .set(capacity.min(i64::MAX as usize) as i64);
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            cv: Condvar::new(),
        });
        let vocab_size = model.cfg.vocab_size;
        let experts = model.experts().clone();
        let worker = Worker {
            decoder,
            model,
            codec: codec.clone(),
            config: config.clone(),
            metrics: metrics.clone(),
            shared: shared.clone(),
            layout,
            capacity,
            running: Vec::new(),
            reserved: 0,
            window_start: Instant::now(),
            window_tokens: 0,
            profiled: super::worker::Profiled::default(),
        };
        let thread = std::thread::Builder::new()
            .name("glmflash-engine".into())
            .spawn(move || worker.run())
            .expect("spawning the engine thread");
        Engine {
            shared,
            thread: Mutex::new(Some(thread)),
            config,
            codec,
            vocab_size,
            layout,
            context_limited_by_cache,
            grammars: std::sync::OnceLock::new(),
            experts,
            metrics,
        }
    }

    /// The grammar compiler for this tokenizer, built on first use; the error says why the
    /// tokenizer cannot be constrained.
    pub fn grammars(&self) -> Result<&Arc<Grammars>, &str> {
        self.grammars
            .get_or_init(|| {
                Grammars::new(self.codec.clone(), self.vocab_size)
                    .map(Arc::new)
                    .map_err(|e| format!("{e:#}"))
            })
            .as_ref()
            .map_err(String::as_str)
    }

    /// Queues sequences (all or none); each gets its own event channel. Dropping a
    /// receiver cancels its sequence: it leaves the queue here or at the engine's next
    /// tick, and the batch at that tick. Sequences whose clients went away never count
    /// against `max_waiting`.
    pub fn submit(
        &self,
        reqs: Vec<GenRequest>,
    ) -> Result<Vec<UnboundedReceiver<Event>>, SubmitError> {
        let mut q = lock(&self.shared.queue);
        if q.shutdown {
            return Err(SubmitError::ShuttingDown);
        }
        q.drop_cancelled(&self.metrics);
        if q.waiting.len() + reqs.len() > self.config.max_waiting {
            return Err(SubmitError::QueueFull(self.config.max_waiting));
        }
        let now = Instant::now();
        let mut rxs = Vec::with_capacity(reqs.len());
        for req in reqs {
            let (tx, rx) = unbounded_channel();
            q.waiting.push_back(Pending {
                req,
                tx,
                submitted: now,
            });
            rxs.push(rx);
        }
        drop(q);
        self.shared.cv.notify_all();
        Ok(rxs)
    }

    /// Refuses new work, lets running and waiting sequences finish, and joins the thread.
    pub fn shutdown(&self) {
        lock(&self.shared.queue).shutdown = true;
        self.shared.cv.notify_all();
        if let Some(t) = lock(&self.thread).take() {
            let _ = t.join();
        }
    }
}

impl Engine {
    /// Ends serving: with `drain`, lets the sequences finish and joins the engine thread
    /// first ([`Engine::shutdown`]); then the experts settle (the tiers save their routing
    /// history). Without `drain` the sequences in flight are abandoned.
    pub fn finish(&self, drain: bool) -> anyhow::Result<()> {
        if drain {
            self.shutdown();
        }
        self.experts.finish()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A decoder on the GPU that holds `model`'s dense weights, if one does.
fn gpu_decoder(model: &Model) -> Option<GpuDecoder> {
    let cuda = placed_device(model)?;
    match GpuDecoder::new(&cuda, model) {
        Ok(d) => {
            tracing::info!(device = %cuda.describe(), "sequences run on the GPU");
            Some(d)
        }
        Err(e) => {
            tracing::warn!(error = %format!("{e:#}"), "no GPU decoder; sequences run through the host forward");
            None
        }
    }
}

/// Keeps `decoder` when the GPU has room for its forward's workspace, and bounds the cache
/// budget `capacity` by the VRAM left after it (the sequences' caches live there, each up to
/// a quarter over its values while it grows). `None`: no room, the host forward instead.
fn fit_on_gpu(
    decoder: GpuDecoder,
    cfg: &crate::model::config::Config,
    config: &EngineConfig,
    context: usize,
    capacity: &mut usize,
) -> Option<GpuDecoder> {
    let workspace = workspace_bytes(cfg, config.gpu_chunk_size + config.max_batch_size, context)
        + decode_graphs_bytes(cfg, config.max_batch_size, context);
    let free = match decoder.device().mem_info() {
        Ok((free, _)) => free,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the free VRAM; the cache budget is not bounded by it");
            return Some(decoder);
        }
    };
    let Some(room) = vram_cache_room(free, workspace) else {
        tracing::error!(
            free_mib = free >> 20,
            workspace_mib = workspace >> 20,
            gpu_chunk_size = config.gpu_chunk_size,
            "no room on the GPU for the forward's workspace; sequences run through the host \
             forward (lower --gpu-chunk-size, or leave more VRAM with --vram-reserve-mib)"
        );
        return None;
    };
    if config.kv_cache_bytes.is_some_and(|asked| asked > room) {
        tracing::warn!(
            kv_cache_mib = *capacity >> 20,
            room_mib = room >> 20,
            "the cache budget asked for does not fit in the free VRAM; using what fits"
        );
    }
    *capacity = (*capacity).min(room);
    tracing::info!(
        free_mib = free >> 20,
        workspace_mib = workspace >> 20,
        kv_cache_mib = *capacity >> 20,
        "the sequences' caches live on the GPU: the cache budget is what the free VRAM holds \
         after the forward's workspace"
    );
    Some(decoder)
}

/// Cache bytes that fit in `free` bytes of VRAM after `workspace`, with each cache up to a
/// `1 / GROWTH_SLACK` over its values while it grows; `None` when the workspace alone does not
/// fit.
fn vram_cache_room(free: usize, workspace: usize) -> Option<usize> {
    let left = free.checked_sub(workspace).filter(|&b| b > 0)?;
    Some(left / (GROWTH_SLACK + 1) * GROWTH_SLACK)
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Byte offset of the earliest stop string in `text`.
pub fn find_stop(text: &str, stops: &[String]) -> Option<usize> {
    stops.iter().filter_map(|s| text.find(s.as_str())).min()
}

/// Bytes at the end of `text` that may be the start of a stop string (held back until the
/// next token decides), on a character boundary.
pub fn held_back(text: &str, stops: &[String]) -> usize {
    let mut keep = 0;
    for stop in stops {
        for (k, _) in stop.char_indices().skip(1) {
            // `stop[..k]` is a proper prefix; does `text` end with it?
            if k > keep && text.ends_with(&stop[..k]) {
                keep = k;
            }
        }
    }
    keep
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(xs: &[&str]) -> Vec<String> {
        xs.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn stop_prefixes_are_held_back_across_tokens() {
        let st = stops(&["END", "é!"]);
        assert_eq!(held_back("hello EN", &st), 2);
        assert_eq!(held_back("hello E", &st), 1);
        assert_eq!(held_back("hello", &st), 0);
        assert_eq!(held_back("caf\u{e9}", &st), "é".len());
        assert_eq!(find_stop("a END b", &st), Some(2));
        assert_eq!(find_stop("aé! END", &st), Some(1));
        assert_eq!(find_stop("abc", &st), None);
    }

    /// The caches get what the free VRAM holds after the forward's workspace, less the room
    /// they may grow into; no room at all without the workspace.
    #[test]
    fn vram_cache_room_leaves_the_workspace_and_the_growth() {
        let gib = 1usize << 30;
        // 6 GiB free, 1 GiB workspace: 5 GiB for caches that may each be a quarter over.
        assert_eq!(vram_cache_room(6 * gib, gib), Some(4 * gib));
        assert_eq!(vram_cache_room(gib, gib), None);
        assert_eq!(vram_cache_room(gib / 2, gib), None);
        let room = vram_cache_room(gib + 1000, gib).unwrap();
        assert!(room + room / GROWTH_SLACK <= 1000, "{room}");
    }
}
