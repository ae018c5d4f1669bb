//! The request bodies of `/v1/chat/completions` and `/v1/completions`, and their
//! validation: the sampling parameters both endpoints take ([`Sampling`]) become the
//! engine's [`SamplingParams`], `max_tokens` is resolved against the context, and the
//! messages or prompts are checked.
//!
//! Each body is read through a private flat wire struct (`#[serde(from)]`), not through
//! `#[serde(flatten)]`: flatten buffers the shared fields before reading them, so a bad
//! value would no longer be reported under its field's name (`temperature`).

use super::ApiError;
use crate::engine::sampling::SamplingParams;
use crate::engine::scheduler::Engine;
use serde::Deserialize;
use serde_json::{Map, Value, json};

/// `stop`: one string or a list.
#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub(super) enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Debug, Clone, Default)]
pub(super) struct StreamOptions {
    pub(super) include_usage: Option<bool>,
}

/// The sampling parameters both endpoints take, as sent.
#[derive(Debug)]
pub(super) struct Sampling {
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    min_p: Option<f64>,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    repetition_penalty: Option<f64>,
    seed: Option<i64>,
    pub(super) n: Option<i64>,
    stop: Option<Stop>,
}

#[derive(Deserialize, Debug)]
#[serde(from = "ChatWire")]
pub(super) struct ChatRequest {
    pub(super) model: Option<String>,
    pub(super) messages: Vec<Value>,
    pub(super) tools: Option<Vec<Value>>,
    pub(super) tool_choice: Option<Value>,
    pub(super) stream: Option<bool>,
    pub(super) stream_options: Option<StreamOptions>,
    pub(super) sampling: Sampling,
    pub(super) max_tokens: Option<i64>,
    pub(super) max_completion_tokens: Option<i64>,
    pub(super) logprobs: Option<bool>,
    pub(super) top_logprobs: Option<i64>,
    pub(super) chat_template_kwargs: Option<Map<String, Value>>,
    pub(super) response_format: Option<Value>,
    pub(super) ignore_eos: Option<bool>,
}

#[derive(Deserialize, Debug)]
#[serde(from = "CompletionWire")]
pub(super) struct CompletionRequest {
    pub(super) model: Option<String>,
    pub(super) prompt: Value,
    pub(super) stream: Option<bool>,
    pub(super) stream_options: Option<StreamOptions>,
    pub(super) sampling: Sampling,
    pub(super) max_tokens: Option<i64>,
    pub(super) logprobs: Option<i64>,
    pub(super) echo: Option<bool>,
    pub(super) suffix: Option<String>,
    pub(super) best_of: Option<i64>,
    pub(super) ignore_eos: Option<bool>,
}

/// A chat body as sent: every field at the top level. Named as the request it becomes in
/// serde's messages (`expected struct ChatRequest`).
#[derive(Deserialize)]
#[serde(rename = "ChatRequest")]
struct ChatWire {
    model: Option<String>,
    messages: Vec<Value>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    min_p: Option<f64>,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    repetition_penalty: Option<f64>,
    seed: Option<i64>,
    max_tokens: Option<i64>,
    max_completion_tokens: Option<i64>,
    n: Option<i64>,
    stop: Option<Stop>,
    logprobs: Option<bool>,
    top_logprobs: Option<i64>,
    chat_template_kwargs: Option<Map<String, Value>>,
    response_format: Option<Value>,
    ignore_eos: Option<bool>,
}

impl From<ChatWire> for ChatRequest {
    fn from(w: ChatWire) -> ChatRequest {
        ChatRequest {
            model: w.model,
            messages: w.messages,
            tools: w.tools,
            tool_choice: w.tool_choice,
            stream: w.stream,
            stream_options: w.stream_options,
            sampling: Sampling {
                temperature: w.temperature,
                top_p: w.top_p,
                top_k: w.top_k,
                min_p: w.min_p,
                presence_penalty: w.presence_penalty,
                frequency_penalty: w.frequency_penalty,
                repetition_penalty: w.repetition_penalty,
                seed: w.seed,
                n: w.n,
                stop: w.stop,
            },
            max_tokens: w.max_tokens,
            max_completion_tokens: w.max_completion_tokens,
            logprobs: w.logprobs,
            top_logprobs: w.top_logprobs,
            chat_template_kwargs: w.chat_template_kwargs,
            response_format: w.response_format,
            ignore_eos: w.ignore_eos,
        }
    }
}

/// A completions body as sent: every field at the top level, named as [`ChatWire`] is.
#[derive(Deserialize)]
#[serde(rename = "CompletionRequest")]
struct CompletionWire {
    model: Option<String>,
    prompt: Value,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    min_p: Option<f64>,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    repetition_penalty: Option<f64>,
    seed: Option<i64>,
    max_tokens: Option<i64>,
    n: Option<i64>,
    stop: Option<Stop>,
    logprobs: Option<i64>,
    echo: Option<bool>,
    suffix: Option<String>,
    best_of: Option<i64>,
    ignore_eos: Option<bool>,
}

impl From<CompletionWire> for CompletionRequest {
    fn from(w: CompletionWire) -> CompletionRequest {
        CompletionRequest {
            model: w.model,
            prompt: w.prompt,
            stream: w.stream,
            stream_options: w.stream_options,
            sampling: Sampling {
                temperature: w.temperature,
                top_p: w.top_p,
                top_k: w.top_k,
                min_p: w.min_p,
                presence_penalty: w.presence_penalty,
                frequency_penalty: w.frequency_penalty,
                repetition_penalty: w.repetition_penalty,
                seed: w.seed,
                n: w.n,
                stop: w.stop,
            },
            max_tokens: w.max_tokens,
            logprobs: w.logprobs,
            echo: w.echo,
            suffix: w.suffix,
            best_of: w.best_of,
            ignore_eos: w.ignore_eos,
        }
    }
}

/// Validated sampling: engine parameters (seed of choice 0), n, stop strings.
pub(super) struct Validated {
    pub(super) params: SamplingParams,
    pub(super) n: usize,
    pub(super) stop: Vec<String>,
}

const MAX_N: i64 = 16;
const MAX_STOPS: usize = 16;
pub(super) const MAX_TOP_LOGPROBS: i64 = 20;

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

pub(super) fn int(name: &str, v: i64, lo: i64, hi: i64) -> Result<i64, ApiError> {
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

impl Sampling {
    /// Checks every parameter; `logprobs`: alternatives per token when log-probabilities
    /// are asked for (already checked by the endpoint, whose field differs).
    pub(super) fn validate(self, logprobs: Option<usize>) -> Result<Validated, ApiError> {
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
                logprobs,
            },
            n,
            stop,
        })
    }
}

/// Resolves `max_tokens` against the context: the prompt must leave room for at least one
/// token, and prompt + max_tokens must fit; the default is the rest of the context.
pub(super) fn budget(
    engine: &Engine,
    prompt_tokens: usize,
    prompt_param: &str,
    max_tokens: Option<i64>,
    field: &str,
) -> Result<usize, ApiError> {
    let ctx = engine.config.context_length;
    let limit = if engine.context_limited_by_cache {
        format!(
            "This server's KV cache budget ({} bytes) holds at most {ctx} tokens of one sequence",
            engine.config.kv_cache_bytes.unwrap_or(0)
        )
    } else {
        format!("This model's maximum context length is {ctx} tokens")
    };
    if prompt_tokens == 0 {
        return Err(ApiError::invalid(
            prompt_param,
            "The prompt is empty (it encodes to no tokens).",
        ));
    }
    if prompt_tokens >= ctx {
        return Err(ApiError {
            code: Some("context_length_exceeded"),
            ..ApiError::invalid(
                prompt_param,
                format!(
                    "{limit}. However, your prompt has {prompt_tokens} tokens, which leaves no room for a completion."
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
                    "{limit}. However, you requested {} tokens ({prompt_tokens} in the prompt, {max} for the completion). Reduce the prompt or `{field}`.",
                    prompt_tokens + max
                ),
            )
        });
    }
    Ok(max)
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
pub(super) fn check_messages(messages: &[Value]) -> Result<Value, ApiError> {
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

/// The prompts of a completion request: text or token ids, one or many.
pub(super) fn completion_prompts(
    engine: &Engine,
    prompt: &Value,
) -> Result<Vec<Vec<u32>>, ApiError> {
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
