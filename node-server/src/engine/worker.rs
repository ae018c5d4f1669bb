//! The engine thread's loop: admits waiting sequences into the batch while the cache
//! reservation fits, then ticks: each running sequence feeds a decode token or a prompt
//! chunk, the forward runs once per device its sequences' caches live on, and sampled
//! tokens stream out as text.

use super::cache::CacheLayout;
use super::constraint::Constraint;
use super::sampling::{Sampled, Sampler, draw_each};
use super::scheduler::{
    EngineConfig, Event, FinishReason, Shared, TokenLogprob, find_stop, held_back, lock,
};
use crate::metrics::Metrics;
use crate::model::decoder::GpuDecoder;
use crate::model::{Gpu, Model, SeqCache, Step};
use crate::tokenizer::{StreamDecoder, TextCodec};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

pub(super) struct Seq {
    tx: UnboundedSender<Event>,
    prompt: Vec<u32>,
    caches: Caches,
    /// Prompt tokens already in the cache.
    prefilled: usize,
    /// The last sampled token: the next decode step's input.
    last: u32,
    generated: usize,
    max_tokens: usize,
    sampler: Sampler,
    want_logprobs: bool,
    decoder: StreamDecoder,
    stop: Vec<String>,
    stop_token_ids: Vec<u32>,
    /// Decoded text held back because it may begin a stop string.
    held: String,
    logprobs: Vec<TokenLogprob>,
    submitted: Instant,
    last_token_at: Option<Instant>,
    /// Cache bytes reserved for this sequence at its most tokens.
    reserved: usize,
    constraint: Option<Constraint>,
}

/// A sequence's caches, on the device its forward runs on: the GPU from admission when
/// there is a decoder with room, else the host (and the GPU after a host prefill, when room
/// has come).
enum Caches {
    Host(SeqCache),
    Gpu(SeqCache<Gpu>),
}

impl Caches {
    /// Tokens in the caches.
    fn tokens(&self) -> usize {
        match self {
            Caches::Host(c) => c.len,
            Caches::Gpu(g) => g.len(),
        }
    }

    /// Bytes the caches hold (a GPU sequence's counted as the layout says).
    fn bytes(&self, layout: &CacheLayout) -> usize {
        match self {
            Caches::Host(c) => c.bytes(),
            Caches::Gpu(g) => layout.bytes_for(g.len()),
        }
    }
}

/// What one tick feeds each sequence, split by the device its caches live on: (index in
/// `running`, tokens fed).
#[derive(Default)]
struct BatchPlan {
    host: Vec<(usize, usize)>,
    gpu: Vec<(usize, usize)>,
}

/// What the forward calls of a tick gave: (sequence, tokens it fed, its logits), and the
/// sequences whose forward failed, with why.
#[derive(Default)]
struct BatchOutput {
    logits: Vec<(usize, usize, Vec<f32>)>,
    failed: Vec<(usize, String)>,
}

impl BatchOutput {
    /// Takes one forward call's result for the sequences in `plan`.
    fn collect(
        &mut self,
        plan: Vec<(usize, usize)>,
        result: std::thread::Result<anyhow::Result<Vec<Vec<f32>>>>,
    ) {
        match result {
            Ok(Ok(logits)) => self
                .logits
                .extend(plan.into_iter().zip(logits).map(|((i, n), l)| (i, n, l))),
            Ok(Err(e)) => {
                let message = format!("{e:#}");
                tracing::error!(error = %message, sequences = plan.len(), "forward failed; failing its batch");
                self.failed
                    .extend(plan.into_iter().map(|(i, _)| (i, message.clone())));
            }
            Err(_) => {
                tracing::error!(
                    sequences = plan.len(),
                    "the forward panicked; failing its batch"
                );
                self.failed.extend(
                    plan.into_iter()
                        .map(|(i, _)| (i, "the engine panicked on this batch".to_string())),
                );
            }
        }
    }
}

pub(super) struct Worker {
    pub(super) model: Model,
    pub(super) decoder: Option<GpuDecoder>,
    pub(super) codec: Arc<TextCodec>,
    pub(super) config: EngineConfig,
    pub(super) metrics: Arc<Metrics>,
    pub(super) shared: Arc<Shared>,
    pub(super) layout: CacheLayout,
    /// Cache bytes all running sequences may reserve together.
    pub(super) capacity: usize,
    pub(super) running: Vec<Seq>,
    /// Cache bytes reserved by the running sequences.
    pub(super) reserved: usize,
    pub(super) window_start: Instant,
    pub(super) window_tokens: u64,
    /// GPU forwards since the decoder's phase profile was last logged.
    pub(super) profiled: Profiled,
}

/// GPU forwards between two logs of the decoder's phase profile (`GLMFLASH_GPU_PROFILE`).
const PROFILE_EVERY: u64 = 256;

/// The engine's decode-only GPU forwards (every sequence one token) since the last profile
/// log: how many, their rows, their time and the decoder's phases.
#[derive(Default)]
pub(super) struct Profiled {
    calls: u64,
    rows: usize,
    forward_secs: f64,
    waited_secs: f64,
    phases: std::collections::BTreeMap<&'static str, f64>,
    /// Whole ticks of those forwards (the forward, the draws, streaming).
    tick_secs: f64,
    /// The current tick's forward was counted: its tick time is too.
    counted: bool,
}

impl Profiled {
    /// The profile so far, in milliseconds a forward.
    fn log(&self) {
        let ms = |s: f64| s * 1e3 / self.calls as f64;
        let mut phases: Vec<(&str, f64)> = self.phases.iter().map(|(k, v)| (*k, *v)).collect();
        phases.sort_by(|a, b| b.1.total_cmp(&a.1));
        let phases: Vec<String> = phases
            .iter()
            .map(|(name, s)| format!("{name} {:.3}", ms(*s)))
            .collect();
        tracing::info!(
            calls = self.calls,
            sequences = self.rows as f64 / self.calls as f64,
            forward_ms = ms(self.forward_secs),
            tick_ms = ms(self.tick_secs),
            waited_ms = ms(self.waited_secs),
            phases = %phases.join(", "),
            "GPU decode forward profile, ms a call"
        );
    }
}

impl Worker {
    /// A new sequence's caches: on the GPU when there is a decoder and room, else on the
    /// host.
    fn new_caches(&self) -> Caches {
        let host = self.model.new_cache();
        let Some(decoder) = &self.decoder else {
            return Caches::Host(host);
        };
        match decoder.sequence(&host) {
            Ok(g) => Caches::Gpu(g),
            Err(e) => {
                tracing::warn!(
                    error = %format!("{e:#}"),
                    "no room for a sequence's caches on the GPU; it runs through the host forward"
                );
                Caches::Host(host)
            }
        }
    }

    pub(super) fn run(mut self) {
        loop {
            if !self.admit() {
                return;
            }
            // Forward errors and panics are handled per batch inside; this is the last
            // resort for a bug elsewhere in the tick: its sequences fail, the engine lives on.
            if std::panic::catch_unwind(AssertUnwindSafe(|| self.tick())).is_err() {
                tracing::error!("the scheduler panicked; failing the running sequences");
                for s in self.running.drain(..) {
                    let _ =
                        s.tx.send(Event::Error("the engine failed on this batch".into()));
                }
            }
        }
    }

    /// Moves waiting sequences into the batch; false once shut down with nothing left.
    fn admit(&mut self) -> bool {
        let mut q = lock(&self.shared.queue);
        loop {
            q.drop_cancelled(&self.metrics);
            drop_cancelled(&mut self.running, &self.metrics);
            if !self.running.is_empty() || !q.waiting.is_empty() {
                break;
            }
            self.reserved = 0;
            self.metrics.running.set(0);
            self.metrics.waiting.set(0);
            self.metrics.kv_used.set(0);
            self.metrics.kv_bytes_used.set(0);
            self.metrics.decode_tok_s.set(0.0);
            if q.shutdown {
                return false;
            }
            q = self
                .shared
                .cv
                .wait_timeout(q, Duration::from_millis(200))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        self.reserved = self.running.iter().map(|s| s.reserved).sum();
        while self.running.len() < self.config.max_batch_size {
            let Some(front) = q.waiting.front() else {
                break;
            };
            let most =
                (front.req.prompt.len() + front.req.max_tokens).min(self.config.context_length);
            let need = self.layout.bytes_for(most);
            // Alone it always fits: the context length is capped at what the budget holds.
            if self.reserved + need > self.capacity && !self.running.is_empty() {
                break;
            }
            let p = q.waiting.pop_front().expect("front exists");
            self.reserved += need;
            let caches = self.new_caches();
            let mut sampler = Sampler::with_params(p.req.params.clone());
            sampler.observe_prompt(&p.req.prompt);
            self.running.push(Seq {
                tx: p.tx,
                caches,
                prefilled: 0,
                last: 0,
                generated: 0,
                max_tokens: p.req.max_tokens,
                want_logprobs: p.req.params.logprobs.is_some(),
                sampler,
                decoder: self.codec.stream_decoder(p.req.skip_special_tokens),
                stop: p.req.stop.into_iter().filter(|s| !s.is_empty()).collect(),
                stop_token_ids: p.req.stop_token_ids,
                held: String::new(),
                logprobs: Vec::new(),
                submitted: p.submitted,
                last_token_at: None,
                reserved: need,
                constraint: p.req.constraint,
                prompt: p.req.prompt,
            });
        }
        self.metrics.waiting.set(q.waiting.len() as i64);
        self.metrics.running.set(self.running.len() as i64);
        true
    }

    /// One step of every running sequence: plan what each feeds, run the forward of each
    /// device's sequences, sample (the sequences in parallel) and stream what came out, end
    /// the finished sequences.
    fn tick(&mut self) {
        if self.running.is_empty() {
            return;
        }
        let started = Instant::now();
        let out = self.run_batch();
        // The caches hold this step's tokens now: the gauges say so before any of its tokens
        // reaches a client (who may read /metrics the moment it has one).
        self.update_cache_metrics();
        let mut finished: Vec<(usize, Result<FinishReason, String>)> =
            out.failed.into_iter().map(|(i, m)| (i, Err(m))).collect();
        let ready: Vec<(usize, Vec<f32>)> = out
            .logits
            .into_iter()
            .filter_map(|(i, n, logits)| self.fed(i, n).then_some((i, logits)))
            .collect();
        for (i, drawn) in self.draw_all(ready) {
            if let Some(reason) = self.advance(i, drawn) {
                finished.push((i, Ok(reason)));
            }
        }
        self.finish(finished);
        self.update_metrics();
        if std::mem::take(&mut self.profiled.counted) {
            self.profiled.tick_secs += started.elapsed().as_secs_f64();
        }
    }

    /// The tokens each running sequence feeds this tick (a decode token, or the next chunk
    /// of its prompt within its device's prompt budget), run through one forward call per
    /// device: the host forward over host caches, the GPU decoder over GPU caches.
    fn run_batch(&mut self) -> BatchOutput {
        let (mut host_budget, mut gpu_budget) =
            (self.config.chunk_size, self.config.gpu_chunk_size);
        let mut plan = BatchPlan::default();
        let (mut host_steps, mut gpu_steps) = (Vec::new(), Vec::new());
        for (i, s) in self.running.iter_mut().enumerate() {
            let Seq {
                prompt,
                caches,
                prefilled,
                last,
                ..
            } = s;
            let tokens: &[u32] = if *prefilled < prompt.len() {
                let budget = match caches {
                    Caches::Gpu(_) => &mut gpu_budget,
                    Caches::Host(_) => &mut host_budget,
                };
                if *budget == 0 {
                    continue;
                }
                let take = (*budget).min(prompt.len() - *prefilled);
                *budget -= take;
                &prompt[*prefilled..*prefilled + take]
            } else {
                std::slice::from_ref(last)
            };
            match caches {
                Caches::Gpu(cache) => {
                    plan.gpu.push((i, tokens.len()));
                    gpu_steps.push(Step {
                        tokens,
                        cache,
                        all_logits: false,
                    });
                }
                Caches::Host(cache) => {
                    plan.host.push((i, tokens.len()));
                    host_steps.push(Step {
                        tokens,
                        cache,
                        all_logits: false,
                    });
                }
            }
        }
        // One forward per device the batch's caches live on.
        let mut out = BatchOutput::default();
        let model = &self.model;
        if !host_steps.is_empty() {
            let result =
                std::panic::catch_unwind(AssertUnwindSafe(|| model.forward(&mut host_steps, None)));
            out.collect(plan.host, result);
        }
        if let (Some(decoder), false) = (&self.decoder, gpu_steps.is_empty()) {
            let started = Instant::now();
            let result =
                std::panic::catch_unwind(AssertUnwindSafe(|| decoder.run(model, &mut gpu_steps)));
            let secs = started.elapsed().as_secs_f64();
            self.metrics.gpu_forward.observe(secs);
            let decode_only = plan
                .gpu
                .iter()
                .all(|&(i, n)| n == 1 && self.running[i].prefilled >= self.running[i].prompt.len());
            let rows = plan.gpu.len();
            out.collect(plan.gpu, result);
            self.log_profile(secs, rows, decode_only);
        }
        out
    }

    /// With `GLMFLASH_GPU_PROFILE` set, every [`PROFILE_EVERY`] decode-only GPU forwards: the
    /// decoder's time per phase, the forward's and the whole tick's, in milliseconds a call (the
    /// engine's figures beside `bench --model`'s). Forwards with prompt chunks are left out.
    fn log_profile(&mut self, secs: f64, rows: usize, decode_only: bool) {
        let Some(decoder) = &self.decoder else {
            return;
        };
        let (phases, waited) = (decoder.take_profile(), decoder.take_waited());
        if phases.is_empty() || !decode_only {
            return;
        }
        let p = &mut self.profiled;
        // Logged at the next counted forward, when the ticks of the last ones have all ended.
        if p.calls == PROFILE_EVERY {
            p.log();
            *p = Profiled::default();
        }
        p.calls += 1;
        p.rows += rows;
        p.forward_secs += secs;
        p.waited_secs += waited;
        p.counted = true;
        for (name, s, _) in phases {
            *p.phases.entry(name).or_default() += s;
        }
    }

    /// Sequence `i` fed `n` tokens: counts its prefill; whether its prompt is all in now (its
    /// logits then give its next token).
    fn fed(&mut self, i: usize, n: usize) -> bool {
        let s = &mut self.running[i];
        if s.prefilled < s.prompt.len() {
            s.prefilled += n;
            self.metrics.prefill_tokens.inc_by(n as u64);
        }
        s.prefilled >= s.prompt.len()
    }

    /// Draws the next token of each `(sequence, logits)` of `ready`, the sequences in
    /// parallel ([`draw_each`]).
    fn draw_all(&mut self, ready: Vec<(usize, Vec<f32>)>) -> Vec<(usize, Drawn)> {
        let mut logits: Vec<Option<Vec<f32>>> = vec![None; self.running.len()];
        for (i, l) in ready {
            logits[i] = Some(l);
        }
        let jobs: Vec<(usize, &mut Seq, Vec<f32>)> = self
            .running
            .iter_mut()
            .zip(logits)
            .enumerate()
            .filter_map(|(i, (s, l))| l.map(|l| (i, s, l)))
            .collect();
        draw_each(jobs, |(i, s, l)| (i, draw(s, l)))
    }

    /// Sequence `i` drew a token: streams it, and moves a host-prefilled sequence's caches to
    /// the GPU when there is room now. The finish reason when it is done.
    fn advance(&mut self, i: usize, drawn: Drawn) -> Option<FinishReason> {
        let s = &mut self.running[i];
        self.window_tokens += 1;
        let out = match drawn {
            Ok(out) => out,
            Err(message) => {
                let _ = s.tx.send(Event::Error(message));
                return Some(FinishReason::Stop);
            }
        };
        if let Some(reason) = deliver(s, out, &self.codec, &self.metrics, &self.config) {
            return Some(reason);
        }
        if let (Caches::Host(cache), Some(decoder)) = (&s.caches, &self.decoder) {
            match decoder.sequence(cache) {
                Ok(g) => s.caches = Caches::Gpu(g),
                Err(e) => tracing::warn!(
                    error = %format!("{e:#}"),
                    "a sequence's caches did not fit on the GPU; it decodes through the host forward"
                ),
            }
        }
        None
    }

    /// Ends the `finished` sequences (indices into `running`): their last event, and their
    /// place in the batch freed.
    fn finish(&mut self, mut finished: Vec<(usize, Result<FinishReason, String>)>) {
        finished.sort_by_key(|&(i, _)| std::cmp::Reverse(i));
        for (i, outcome) in finished {
            let s = self.running.swap_remove(i);
            let _ = s.tx.send(match outcome {
                Ok(reason) => Event::Done {
                    finish_reason: reason,
                    prompt_tokens: s.prompt.len(),
                    completion_tokens: s.generated,
                },
                Err(message) => Event::Error(message),
            });
        }
    }

    /// Cache use, running sequences and the decode rate (over windows of a second).
    fn update_metrics(&mut self) {
        self.update_cache_metrics();
        let elapsed = self.window_start.elapsed().as_secs_f64();
        if elapsed >= 1.0 {
            self.metrics
                .decode_tok_s
                .set(self.window_tokens as f64 / elapsed);
            self.window_start = Instant::now();
            self.window_tokens = 0;
        }
    }

    /// Cache use and running sequences.
    fn update_cache_metrics(&mut self) {
        let used: usize = self.running.iter().map(|s| s.caches.tokens()).sum();
        let used_bytes: usize = self
            .running
            .iter()
            .map(|s| s.caches.bytes(&self.layout))
            .sum();
        self.metrics.kv_used.set(used as i64);
        self.metrics.kv_bytes_used.set(used_bytes as i64);
        self.metrics.running.set(self.running.len() as i64);
    }
}

/// Drops the running sequences whose client went away (their receiver is gone): their
/// caches are freed and their tokens no longer computed.
fn drop_cancelled(running: &mut Vec<Seq>, metrics: &Metrics) {
    let before = running.len();
    running.retain(|s| !s.tx.is_closed());
    let gone = before - running.len();
    if gone > 0 {
        metrics.cancelled.inc_by(gone as u64);
        tracing::debug!(
            sequences = gone,
            "running sequences cancelled by their clients"
        );
    }
}

/// A sequence's next token, or why its constrained decoding could not go on.
type Drawn = Result<Sampled, String>;

/// Draws the next token of `s` from `logits` (masked in place by its grammar, if it has one).
fn draw(s: &mut Seq, mut logits: Vec<f32>) -> Drawn {
    let Some(c) = &mut s.constraint else {
        return Ok(s.sampler.sample_owned(logits));
    };
    c.mask(&mut logits)
        .and_then(|()| {
            let out = s.sampler.sample_owned(logits);
            c.advance(out.token).map(|()| out)
        })
        .map_err(|e| format!("constrained decoding failed: {e:#}"))
}

/// Takes `out` as the next token of `s` and sends its text; the finish reason when done.
fn deliver(
    s: &mut Seq,
    out: Sampled,
    codec: &TextCodec,
    metrics: &Metrics,
    config: &EngineConfig,
) -> Option<FinishReason> {
    let now = Instant::now();
    match s.last_token_at {
        None => metrics.ttft.observe((now - s.submitted).as_secs_f64()),
        Some(t) => metrics.inter_token.observe((now - t).as_secs_f64()),
    }
    s.last_token_at = Some(now);
    s.generated += 1;
    s.last = out.token;
    metrics.decode_tokens.inc();
    if s.want_logprobs {
        let text = |id: u32| codec.decode_with(&[id], false).unwrap_or_default();
        s.logprobs.push(TokenLogprob {
            token: text(out.token),
            logprob: out.logprob.unwrap_or(0.0),
            top: out.top.iter().map(|&(id, lp)| (text(id), lp)).collect(),
        });
    }
    if s.stop_token_ids.contains(&out.token) {
        let rest = s.decoder.finish().unwrap_or_default();
        let text = std::mem::take(&mut s.held) + &rest;
        emit(s, text);
        return Some(FinishReason::Stop);
    }
    let delta = s.decoder.push(out.token).unwrap_or_default();
    s.held.push_str(&delta);
    let grammar_done = s.constraint.as_ref().is_some_and(Constraint::done);
    let out_of_room =
        s.generated >= s.max_tokens || s.prompt.len() + s.generated >= config.context_length;
    if out_of_room || grammar_done {
        let rest = s.decoder.finish().unwrap_or_default();
        s.held.push_str(&rest);
    }
    if let Some(at) = find_stop(&s.held, &s.stop) {
        let mut text = std::mem::take(&mut s.held);
        text.truncate(at);
        emit(s, text);
        return Some(FinishReason::Stop);
    }
    if grammar_done {
        let text = std::mem::take(&mut s.held);
        emit(s, text);
        return Some(FinishReason::Stop);
    }
    if out_of_room {
        let text = std::mem::take(&mut s.held);
        emit(s, text);
        return Some(FinishReason::Length);
    }
    let keep = held_back(&s.held, &s.stop);
    let text: String = s.held.drain(..s.held.len() - keep).collect();
    emit(s, text);
    None
}

fn emit(s: &mut Seq, text: String) {
    if text.is_empty() && s.logprobs.is_empty() {
        return;
    }
    let logprobs = std::mem::take(&mut s.logprobs);
    let _ = s.tx.send(Event::Delta { text, logprobs });
}
