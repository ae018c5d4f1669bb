//! OpenAI request and response shapes, request validation, and the completion handlers.

use super::parse::{ChatParser, Piece, parse_all};
use super::{ApiError, ApiJson, AppState};
use crate::engine::sampling::SamplingParams;
use crate::engine::scheduler::{
    Engine, Event, FinishReason, GenRequest, SubmitError, TokenLogprob,
};
use axum::extract::{Path, State};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::{self, BoxStream, StreamExt};
use serde::Deserialize;
use serde_json::{Map, Value, json};
use std::convert::Infallible;
use tokio::sync::mpsc::UnboundedReceiver;

/// `stop`: one string or a list.
#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Debug, Clone, Default)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

#[derive(Deserialize, Debug)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<Value>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub seed: Option<i64>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub n: Option<i64>,
    pub stop: Option<Stop>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
    pub response_format: Option<Value>,
    pub ignore_eos: Option<bool>,
}

#[derive(Deserialize, Debug)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Value,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub seed: Option<i64>,
    pub max_tokens: Option<i64>,
    pub n: Option<i64>,
    pub stop: Option<Stop>,
    pub logprobs: Option<i64>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub best_of: Option<i64>,
    pub ignore_eos: Option<bool>,
}

/// The sampling knobs both endpoints share, before validation.
struct Knobs {
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    min_p: Option<f64>,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    repetition_penalty: Option<f64>,
    seed: Option<i64>,
    n: Option<i64>,
    stop: Option<Stop>,
    /// Alternatives per token when log-probabilities are asked for.
    logprobs: Option<usize>,
}

/// Validated knobs: sampling parameters (seed of choice 0), n, stop strings.
struct Validated {
    params: SamplingParams,
    n: usize,
    stop: Vec<String>,
}

const MAX_N: i64 = 16;
const MAX_STOPS: usize = 16;
const MAX_TOP_LOGPROBS: i64 = 20;

fn float(name: &str, v: Option<f64>, lo: f64, hi: f64, default: f32) -> Result<f32, ApiError> {
    match v {
        None => Ok(default),
        Some(x) if x.is_finite() && x >= lo && x <= hi => Ok(x as f32),
        Some(x) => Err(ApiError::invalid(
            name,
            format!("`{name}` must be between {lo} and {hi}, got {x}."),
        )),
    }
}

fn int(name: &str, v: i64, lo: i64, hi: i64) -> Result<i64, ApiError> {
    if (lo..=hi).contains(&v) {
        Ok(v)
    } else if hi == i64::MAX {
        Err(ApiError::invalid(
            name,
            format!("`{name}` must be at least {lo}, got {v}."),
        ))
    } else {
        Err(ApiError::invalid(
            name,
            format!("`{name}` must be between {lo} and {hi}, got {v}."),
        ))
    }
}

impl Knobs {
    fn validate(self) -> Result<Validated, ApiError> {
        let temperature = float("temperature", self.temperature, 0.0, 2.0, 1.0)?;
        let top_p = float("top_p", self.top_p, 0.0, 1.0, 1.0)?;
        if top_p <= 0.0 {
            return Err(ApiError::invalid(
                "top_p",
                "`top_p` must be greater than 0 and at most 1, got 0.",
            ));
        }
        let min_p = float("min_p", self.min_p, 0.0, 1.0, 0.0)?;
        let presence_penalty = float("presence_penalty", self.presence_penalty, -2.0, 2.0, 0.0)?;
        let frequency_penalty = float("frequency_penalty", self.frequency_penalty, -2.0, 2.0, 0.0)?;
        let repetition_penalty = float(
            "repetition_penalty",
            self.repetition_penalty,
            0.01,
            10.0,
            1.0,
        )?;
        // -1 (vLLM) and 0 both mean "no top-k".
        let top_k = match self.top_k {
            None | Some(-1) => 0,
            Some(k) => int("top_k", k, -1, i64::MAX)? as usize,
        };
        let n = int("n", self.n.unwrap_or(1), 1, MAX_N)? as usize;
        let stop = match self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s],
            Some(Stop::Many(v)) => v,
        };
        if stop.len() > MAX_STOPS {
            return Err(ApiError::invalid(
                "stop",
                format!(
                    "`stop` may hold at most {MAX_STOPS} strings, got {}.",
                    stop.len()
                ),
            ));
        }
        let seed = match self.seed {
            Some(s) => s as u64,
            None => rand::random::<u64>(),
        };
        Ok(Validated {
            params: SamplingParams {
                temperature,
                top_p,
                top_k,
                min_p,
                presence_penalty,
                frequency_penalty,
                repetition_penalty,
                seed,
                logprobs: self.logprobs,
            },
            n,
            stop,
        })
    }
}

fn check_model(state: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != state.0.config.model_id => Err(ApiError::model_not_found(m)),
        _ => Ok(()),
    }
}

/// Resolves `max_tokens` against the context: the prompt must leave room for at least one
/// token, and prompt + max_tokens must fit; the default is the rest of the context.
fn budget(
    engine: &Engine,
    prompt_tokens: usize,
    max_tokens: Option<i64>,
    field: &str,
) -> Result<usize, ApiError> {
    let ctx = engine.config.context_length;
    if prompt_tokens == 0 {
        return Err(ApiError::invalid(
            if field == "max_tokens" {
                "prompt"
            } else {
                "messages"
            },
            "The prompt is empty (it encodes to no tokens).",
        ));
    }
    if prompt_tokens >= ctx {
        return Err(ApiError {
            code: Some("context_length_exceeded"),
            ..ApiError::invalid(
                "messages",
                format!(
                    "This model's maximum context length is {ctx} tokens. However, your prompt has {prompt_tokens} tokens, which leaves no room for a completion."
                ),
            )
        });
    }
    let Some(max) = max_tokens else {
        return Ok(ctx - prompt_tokens);
    };
    let max = int(field, max, 1, i64::MAX)? as usize;
    if prompt_tokens.saturating_add(max) > ctx {
        return Err(ApiError {
            code: Some("context_length_exceeded"),
            ..ApiError::invalid(
                field,
                format!(
                    "This model's maximum context length is {ctx} tokens. However, you requested {} tokens ({prompt_tokens} in the prompt, {max} for the completion). Reduce the prompt or `{field}`.",
                    prompt_tokens + max
                ),
            )
        });
    }
    Ok(max)
}

fn submit(
    engine: &Engine,
    reqs: Vec<GenRequest>,
) -> Result<Vec<UnboundedReceiver<Event>>, ApiError> {
    engine.submit(reqs).map_err(|e| match e {
        SubmitError::QueueFull(n) => ApiError::queue_full(n),
        SubmitError::ShuttingDown => ApiError::unavailable("The server is shutting down."),
    })
}

fn requests(
    prompt: &[u32],
    v: &Validated,
    max_tokens: usize,
    stop_ids: &[u32],
    skip_special_tokens: bool,
) -> Vec<GenRequest> {
    (0..v.n)
        .map(|i| GenRequest {
            prompt: prompt.to_vec(),
            params: SamplingParams {
                seed: v.params.seed.wrapping_add(i as u64),
                ..v.params.clone()
            },
            max_tokens,
            stop: v.stop.clone(),
            stop_token_ids: stop_ids.to_vec(),
            skip_special_tokens,
        })
        .collect()
}

fn new_id(prefix: &str) -> String {
    format!(
        "{prefix}-{:016x}{:08x}",
        rand::random::<u64>(),
        rand::random::<u32>()
    )
}

fn model_card(state: &AppState) -> Value {
    json!({
        "id": state.0.config.model_id,
        "object": "model",
        "created": state.0.created,
        "owned_by": "glmflash",
        "max_model_len": state.engine().map(|e| e.config.context_length),
    })
}

pub async fn list_models(State(state): State<AppState>) -> Response {
    axum::Json(json!({"object": "list", "data": [model_card(&state)]})).into_response()
}

pub async fn get_model(State(state): State<AppState>, Path(model): Path<String>) -> Response {
    if model == state.0.config.model_id {
        axum::Json(model_card(&state)).into_response()
    } else {
        ApiError::model_not_found(&model).into_response()
    }
}

/// Everything one choice produced (non-streaming).
#[derive(Default)]
struct Collected {
    text: String,
    logprobs: Vec<TokenLogprob>,
    finish: Option<FinishReason>,
    prompt_tokens: usize,
    completion_tokens: usize,
}

async fn collect(mut rx: UnboundedReceiver<Event>) -> Result<Collected, ApiError> {
    let mut c = Collected::default();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Delta { text, logprobs } => {
                c.text.push_str(&text);
                c.logprobs.extend(logprobs);
            }
            Event::Done {
                finish_reason,
                prompt_tokens,
                completion_tokens,
            } => {
                c.finish = Some(finish_reason);
                c.prompt_tokens = prompt_tokens;
                c.completion_tokens = completion_tokens;
            }
            Event::Error(e) => return Err(ApiError::internal(e)),
        }
    }
    if c.finish.is_none() {
        return Err(ApiError::internal(
            "the engine stopped before the sequence finished",
        ));
    }
    Ok(c)
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

fn bytes_of(s: &str) -> Vec<u8> {
    s.as_bytes().to_vec()
}

fn chat_logprobs(lps: &[TokenLogprob]) -> Value {
    let content: Vec<Value> = lps
        .iter()
        .map(|t| {
            json!({
                "token": t.token,
                "logprob": t.logprob,
                "bytes": bytes_of(&t.token),
                "top_logprobs": t.top.iter().map(|(tok, lp)| json!({
                    "token": tok, "logprob": lp, "bytes": bytes_of(tok)
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({ "content": content })
}

fn completion_logprobs(lps: &[TokenLogprob], offset: &mut usize) -> Value {
    let mut text_offset = Vec::new();
    for t in lps {
        text_offset.push(*offset);
        *offset += t.token.len();
    }
    json!({
        "tokens": lps.iter().map(|t| t.token.clone()).collect::<Vec<_>>(),
        "token_logprobs": lps.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "top_logprobs": lps.iter().map(|t| {
            t.top.iter().map(|(tok, lp)| (tok.clone(), json!(lp))).collect::<Map<String, Value>>()
        }).collect::<Vec<_>>(),
        "text_offset": text_offset,
    })
}

const ROLES: [&str; 6] = [
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "observation",
];

/// Checks `messages` and maps `developer` to `system` for the template.
fn check_messages(messages: &[Value]) -> Result<Value, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must hold at least one message.",
        ));
    }
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let Some(obj) = m.as_object() else {
            return Err(ApiError::invalid(
                &format!("messages[{i}]"),
                format!("`messages[{i}]` must be an object with `role` and `content`."),
            ));
        };
        let role = obj.get("role").and_then(Value::as_str).ok_or_else(|| {
            ApiError::invalid(
                &format!("messages[{i}].role"),
                format!("`messages[{i}].role` must be a string, one of {ROLES:?}."),
            )
        })?;
        if !ROLES.contains(&role) {
            return Err(ApiError::invalid(
                &format!("messages[{i}].role"),
                format!("`messages[{i}].role` must be one of {ROLES:?}, got {role:?}."),
            ));
        }
        match obj.get("content") {
            None | Some(Value::Null | Value::String(_) | Value::Array(_)) => {}
            Some(_) => {
                return Err(ApiError::invalid(
                    &format!("messages[{i}].content"),
                    format!(
                        "`messages[{i}].content` must be a string or an array of content parts."
                    ),
                ));
            }
        }
        let mut m = m.clone();
        if role == "developer" {
            m["role"] = json!("system");
        }
        out.push(m);
    }
    Ok(Value::Array(out))
}

pub async fn chat_completions(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<ChatRequest>,
) -> Result<Response, ApiError> {
    let engine = state.ready_engine()?.clone();
    check_model(&state, req.model.as_deref())?;
    let messages = check_messages(&req.messages)?;
    if let Some(rf) = &req.response_format {
        let kind = rf.get("type").and_then(Value::as_str).unwrap_or("");
        if kind != "text" {
            return Err(ApiError::invalid(
                "response_format",
                format!(
                    "`response_format` of type {kind:?} is not supported by this server yet (only \"text\")."
                ),
            ));
        }
    }
    let mut parse_tools = req.tools.as_ref().is_some_and(|t| !t.is_empty());
    match &req.tool_choice {
        None => {}
        Some(Value::String(s)) if s == "auto" => {}
        Some(Value::String(s)) if s == "none" => parse_tools = false,
        Some(_) => {
            return Err(ApiError::invalid(
                "tool_choice",
                "`tool_choice` may be \"auto\" or \"none\" on this server (forced tool calls are not supported yet).",
            ));
        }
    }
    let top_logprobs = match (req.logprobs, req.top_logprobs) {
        (Some(true), k) => Some(int("top_logprobs", k.unwrap_or(0), 0, MAX_TOP_LOGPROBS)? as usize),
        (_, Some(_)) => {
            return Err(ApiError::invalid(
                "top_logprobs",
                "`top_logprobs` needs `logprobs` set to true.",
            ));
        }
        _ => None,
    };
    let v = Knobs {
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        min_p: req.min_p,
        presence_penalty: req.presence_penalty,
        frequency_penalty: req.frequency_penalty,
        repetition_penalty: req.repetition_penalty,
        seed: req.seed,
        n: req.n,
        stop: req.stop,
        logprobs: top_logprobs,
    }
    .validate()?;
    let kwargs = req.chat_template_kwargs.map(Value::Object);
    let tools = req.tools.map(Value::Array);
    let codec = engine.codec.clone();
    let text = codec
        .render_chat_with(&messages, tools.as_ref(), true, kwargs.as_ref())
        .map_err(|e| {
            ApiError::invalid(
                "messages",
                format!("The chat template rejected the messages: {e:#}"),
            )
        })?;
    let prompt = codec.encode(&text).map_err(ApiError::internal)?;
    let (field, max) = match req.max_completion_tokens {
        Some(m) => ("max_completion_tokens", Some(m)),
        None => ("max_tokens", req.max_tokens),
    };
    let max_tokens = budget(&engine, prompt.len(), max, field)?;
    let stop_ids = if req.ignore_eos == Some(true) {
        Vec::new()
    } else {
        codec.eos_ids().to_vec()
    };
    let rxs = submit(&engine, requests(&prompt, &v, max_tokens, &stop_ids, false))?;
    let meta = Meta {
        id: new_id("chatcmpl"),
        created: now_secs(),
        model: state.0.config.model_id.clone(),
    };
    if req.stream == Some(true) {
        let include_usage = req
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        let conv = ChatStream {
            meta,
            parsers: (0..v.n).map(|_| ChatParser::new(parse_tools)).collect(),
            tool_calls: vec![0; v.n],
            include_usage,
            prompt_tokens: prompt.len(),
            completion_tokens: 0,
        };
        return Ok(sse(rxs, conv));
    }
    let results = futures::future::join_all(rxs.into_iter().map(collect)).await;
    let mut choices = Vec::new();
    let mut completion_tokens = 0;
    for (i, r) in results.into_iter().enumerate() {
        let c = r?;
        completion_tokens += c.completion_tokens;
        let (mut reasoning, mut content, mut calls) = (String::new(), String::new(), Vec::new());
        for p in parse_all(&c.text, parse_tools) {
            match p {
                Piece::Reasoning(s) => reasoning.push_str(&s),
                Piece::Content(s) => content.push_str(&s),
                Piece::ToolCall { name, arguments } => calls.push(json!({
                    "id": new_id("call"),
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                })),
            }
        }
        let content = content.trim().to_string();
        let reasoning = reasoning.trim().to_string();
        let mut message = json!({
            "role": "assistant",
            "content": if content.is_empty() && !calls.is_empty() { Value::Null } else { json!(content) },
            "reasoning_content": if reasoning.is_empty() { Value::Null } else { json!(reasoning) },
        });
        let finish = if !calls.is_empty() && c.finish == Some(FinishReason::Stop) {
            "tool_calls"
        } else {
            c.finish.map_or("stop", FinishReason::as_str)
        };
        if !calls.is_empty() {
            message["tool_calls"] = Value::Array(calls);
        }
        choices.push(json!({
            "index": i,
            "message": message,
            "logprobs": if v.params.logprobs.is_some() { chat_logprobs(&c.logprobs) } else { Value::Null },
            "finish_reason": finish,
        }));
    }
    Ok(axum::Json(json!({
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "choices": choices,
        "usage": usage(prompt.len(), completion_tokens),
    }))
    .into_response())
}

/// The prompts of a completion request: text or token ids, one or many.
fn completion_prompts(engine: &Engine, prompt: &Value) -> Result<Vec<Vec<u32>>, ApiError> {
    let bad = || {
        ApiError::invalid(
            "prompt",
            "`prompt` must be a string, an array of strings, an array of token ids or an array of arrays of token ids.",
        )
    };
    let ids = |v: &[Value]| -> Result<Vec<u32>, ApiError> {
        v.iter()
            .map(|t| {
                t.as_u64()
                    .filter(|&id| (id as usize) < engine.vocab_size)
                    .map(|id| id as u32)
                    .ok_or_else(|| {
                        ApiError::invalid(
                            "prompt",
                            format!(
                                "Token ids in `prompt` must be integers from 0 to {}, got {t}.",
                                engine.vocab_size - 1
                            ),
                        )
                    })
            })
            .collect()
    };
    let encode = |s: &str| engine.codec.encode(s).map_err(ApiError::internal);
    match prompt {
        Value::String(s) => Ok(vec![encode(s)?]),
        Value::Array(items) if items.is_empty() => Err(bad()),
        Value::Array(items) if items.iter().all(Value::is_string) => items
            .iter()
            .map(|s| encode(s.as_str().unwrap_or_default()))
            .collect(),
        Value::Array(items) if items.iter().all(Value::is_number) => Ok(vec![ids(items)?]),
        Value::Array(items) if items.iter().all(Value::is_array) => items
            .iter()
            .map(|a| ids(a.as_array().map(Vec::as_slice).unwrap_or_default()))
            .collect(),
        _ => Err(bad()),
    }
}

pub async fn completions(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    let engine = state.ready_engine()?.clone();
    check_model(&state, req.model.as_deref())?;
    if req.echo == Some(true) {
        return Err(ApiError::invalid(
            "echo",
            "`echo` is not supported by this server yet.",
        ));
    }
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid(
            "suffix",
            "`suffix` is not supported by this model.",
        ));
    }
    if let Some(b) = req.best_of
        && b != req.n.unwrap_or(1)
    {
        return Err(ApiError::invalid(
            "best_of",
            "`best_of` must equal `n` on this server.",
        ));
    }
    let logprobs = match req.logprobs {
        None => None,
        Some(k) => Some(int("logprobs", k, 0, MAX_TOP_LOGPROBS)? as usize),
    };
    let v = Knobs {
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        min_p: req.min_p,
        presence_penalty: req.presence_penalty,
        frequency_penalty: req.frequency_penalty,
        repetition_penalty: req.repetition_penalty,
        seed: req.seed,
        n: req.n,
        stop: req.stop,
        logprobs,
    }
    .validate()?;
    let prompts = completion_prompts(&engine, &req.prompt)?;
    let stop_ids = if req.ignore_eos == Some(true) {
        Vec::new()
    } else {
        engine.codec.eos_ids().to_vec()
    };
    let mut reqs = Vec::new();
    let mut prompt_tokens = 0;
    for p in &prompts {
        let max_tokens = budget(&engine, p.len(), req.max_tokens, "max_tokens")?;
        prompt_tokens += p.len();
        reqs.extend(requests(p, &v, max_tokens, &stop_ids, true));
    }
    let rxs = submit(&engine, reqs)?;
    let meta = Meta {
        id: new_id("cmpl"),
        created: now_secs(),
        model: state.0.config.model_id.clone(),
    };
    if req.stream == Some(true) {
        let include_usage = req
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        let conv = CompletionStream {
            meta,
            offsets: vec![0; rxs.len()],
            logprobs: logprobs.is_some(),
            include_usage,
            prompt_tokens,
            completion_tokens: 0,
        };
        return Ok(sse(rxs, conv));
    }
    let results = futures::future::join_all(rxs.into_iter().map(collect)).await;
    let mut choices = Vec::new();
    let mut completion_tokens = 0;
    for (i, r) in results.into_iter().enumerate() {
        let c = r?;
        completion_tokens += c.completion_tokens;
        choices.push(json!({
            "index": i,
            "text": c.text,
            "logprobs": if logprobs.is_some() { completion_logprobs(&c.logprobs, &mut 0) } else { Value::Null },
            "finish_reason": c.finish.map_or("stop", FinishReason::as_str),
        }));
    }
    Ok(axum::Json(json!({
        "id": meta.id,
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens),
    }))
    .into_response())
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

struct Meta {
    id: String,
    created: u64,
    model: String,
}

/// Turns engine events of choice `i` into SSE `data:` payloads.
trait StreamConv: Send + 'static {
    fn start(&mut self, choices: usize) -> Vec<String>;
    fn event(&mut self, i: usize, ev: Event) -> Vec<String>;
    /// After every choice ended: the usage chunk (if asked).
    fn end(&mut self) -> Vec<String>;
}

fn sse<C: StreamConv>(rxs: Vec<UnboundedReceiver<Event>>, mut conv: C) -> Response {
    let first = conv.start(rxs.len());
    let merged: BoxStream<'static, (usize, Event)> =
        stream::select_all(rxs.into_iter().enumerate().map(|(i, rx)| {
            stream::unfold(rx, move |mut rx| async move {
                rx.recv().await.map(|e| ((i, e), rx))
            })
            .boxed()
        }))
        .boxed();
    let body = stream::unfold(Some((merged, conv)), |st| async move {
        let (mut merged, mut conv) = st?;
        match merged.next().await {
            Some((i, ev)) => {
                let out = conv.event(i, ev);
                Some((out, Some((merged, conv))))
            }
            None => {
                let mut out = conv.end();
                out.push("[DONE]".to_string());
                Some((out, None))
            }
        }
    });
    let events = stream::iter([first])
        .chain(body)
        .flat_map(stream::iter)
        .map(|data| Ok::<_, Infallible>(SseEvent::default().data(data)));
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

fn error_chunk(message: &str) -> String {
    ApiError::internal(message).body().to_string()
}

struct ChatStream {
    meta: Meta,
    parsers: Vec<ChatParser>,
    /// Tool calls streamed so far per choice.
    tool_calls: Vec<usize>,
    include_usage: bool,
    prompt_tokens: usize,
    completion_tokens: usize,
}

impl ChatStream {
    fn chunk(&self, i: usize, delta: Value, logprobs: Value, finish: Value) -> String {
        json!({
            "id": self.meta.id,
            "object": "chat.completion.chunk",
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        })
        .to_string()
    }

    fn pieces(&mut self, i: usize, pieces: Vec<Piece>, out: &mut Vec<String>) {
        for p in pieces {
            let delta = match p {
                Piece::Reasoning(s) => json!({"reasoning_content": s}),
                Piece::Content(s) => json!({"content": s}),
                Piece::ToolCall { name, arguments } => {
                    let k = self.tool_calls[i];
                    self.tool_calls[i] += 1;
                    json!({"tool_calls": [{
                        "index": k,
                        "id": new_id("call"),
                        "type": "function",
                        "function": {"name": name, "arguments": arguments},
                    }]})
                }
            };
            out.push(self.chunk(i, delta, Value::Null, Value::Null));
        }
    }
}

impl StreamConv for ChatStream {
    fn start(&mut self, choices: usize) -> Vec<String> {
        (0..choices)
            .map(|i| {
                self.chunk(
                    i,
                    json!({"role": "assistant", "content": ""}),
                    Value::Null,
                    Value::Null,
                )
            })
            .collect()
    }

    fn event(&mut self, i: usize, ev: Event) -> Vec<String> {
        let mut out = Vec::new();
        match ev {
            Event::Delta { text, logprobs } => {
                let pieces = self.parsers[i].push(&text);
                self.pieces(i, pieces, &mut out);
                if !logprobs.is_empty() {
                    out.push(self.chunk(i, json!({}), chat_logprobs(&logprobs), Value::Null));
                }
            }
            Event::Done {
                finish_reason,
                completion_tokens,
                ..
            } => {
                let pieces = self.parsers[i].finish();
                self.pieces(i, pieces, &mut out);
                self.completion_tokens += completion_tokens;
                let finish = if self.tool_calls[i] > 0 && finish_reason == FinishReason::Stop {
                    "tool_calls"
                } else {
                    finish_reason.as_str()
                };
                out.push(self.chunk(i, json!({}), Value::Null, json!(finish)));
            }
            Event::Error(e) => out.push(error_chunk(&e)),
        }
        out
    }

    fn end(&mut self) -> Vec<String> {
        if !self.include_usage {
            return Vec::new();
        }
        vec![
            json!({
                "id": self.meta.id,
                "object": "chat.completion.chunk",
                "created": self.meta.created,
                "model": self.meta.model,
                "choices": [],
                "usage": usage(self.prompt_tokens, self.completion_tokens),
            })
            .to_string(),
        ]
    }
}

struct CompletionStream {
    meta: Meta,
    offsets: Vec<usize>,
    logprobs: bool,
    include_usage: bool,
    prompt_tokens: usize,
    completion_tokens: usize,
}

impl CompletionStream {
    fn chunk(&self, i: usize, text: &str, logprobs: Value, finish: Value) -> String {
        json!({
            "id": self.meta.id,
            "object": "text_completion",
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}],
        })
        .to_string()
    }
}

impl StreamConv for CompletionStream {
    fn start(&mut self, _choices: usize) -> Vec<String> {
        Vec::new()
    }

    fn event(&mut self, i: usize, ev: Event) -> Vec<String> {
        match ev {
            Event::Delta { text, logprobs } => {
                let lp = if self.logprobs {
                    completion_logprobs(&logprobs, &mut self.offsets[i])
                } else {
                    Value::Null
                };
                vec![self.chunk(i, &text, lp, Value::Null)]
            }
            Event::Done {
                finish_reason,
                completion_tokens,
                ..
            } => {
                self.completion_tokens += completion_tokens;
                vec![self.chunk(i, "", Value::Null, json!(finish_reason.as_str()))]
            }
            Event::Error(e) => vec![error_chunk(&e)],
        }
    }

    fn end(&mut self) -> Vec<String> {
        if !self.include_usage {
            return Vec::new();
        }
        vec![
            json!({
                "id": self.meta.id,
                "object": "text_completion",
                "created": self.meta.created,
                "model": self.meta.model,
                "choices": [],
                "usage": usage(self.prompt_tokens, self.completion_tokens),
            })
            .to_string(),
        ]
    }
}
