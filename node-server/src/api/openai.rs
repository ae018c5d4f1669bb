//! OpenAI request and response shapes, request validation, and the completion handlers.

use super::parse::{ChatParser, Piece, opens_reasoning, parse_all};
use super::{ApiError, ApiJson, AppState};
use crate::engine::constraint::lark_literal;
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
            constraint: None,
        })
        .collect()
}

fn tool_name(tool: &Value) -> Option<&str> {
    tool.get("function")
        .unwrap_or(tool)
        .get("name")
        .and_then(Value::as_str)
}

/// Most characters of one forced free-text argument value.
const MAX_ARG_CHARS: usize = 256;

/// `<[id]>`: a special token in a Lark grammar, by id.
fn special(codec: &crate::tokenizer::TextCodec, param: &str, t: &str) -> Result<String, ApiError> {
    codec
        .token_to_id(t)
        .map(|id| format!("<[{id}]>"))
        .ok_or_else(|| {
            ApiError::invalid(
                param,
                format!(
                    "Constrained output needs the GLM special token {t}; this tokenizer has none."
                ),
            )
        })
}

/// The grammar of a forced GLM tool call: `<tool_call>NAME` (one of `tools`), then
/// `<arg_key>K</arg_key><arg_value>V</arg_value>` for each required parameter (all of them
/// when none is marked required), `</tool_call>`. A value whose schema is a string (or
/// says nothing) is free text; any other is JSON matching the parameter's schema.
/// `close_think`: the prompt left `<think>` open, so the call starts by closing it.
fn tool_call_grammar(
    codec: &crate::tokenizer::TextCodec,
    tools: &[Value],
    close_think: bool,
) -> Result<String, ApiError> {
    let sp = |t| special(codec, "tool_choice", t);
    let (ak, akc, av, avc) = (
        sp("<arg_key>")?,
        sp("</arg_key>")?,
        sp("<arg_value>")?,
        sp("</arg_value>")?,
    );
    let mut rules = Vec::new();
    let mut alternatives = Vec::new();
    for (i, tool) in tools.iter().enumerate() {
        let name = tool_name(tool).ok_or_else(|| {
            ApiError::invalid(
                &format!("tools[{i}].function.name"),
                format!("`tools[{i}].function.name` must be a string."),
            )
        })?;
        let params = tool.get("function").unwrap_or(tool).get("parameters");
        let props = params
            .and_then(|p| p.get("properties"))
            .and_then(Value::as_object);
        let mut keys: Vec<String> = params
            .and_then(|p| p.get("required"))
            .and_then(Value::as_array)
            .map(|r| {
                r.iter()
                    .filter_map(|k| k.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        if keys.is_empty() {
            keys = props
                .map(|o| o.keys().cloned().collect())
                .unwrap_or_default();
        }
        let mut body = vec![lark_literal(name)];
        for (j, k) in keys.iter().enumerate() {
            let schema = props.and_then(|p| p.get(k));
            let free_text = schema
                .and_then(|s| s.get("type"))
                .is_none_or(|t| t == "string");
            let value = if free_text {
                "ARG_TEXT".to_string()
            } else {
                let rule = format!("value_{i}_{j}");
                let schema = compact(schema.cloned().unwrap_or(json!({})));
                rules.push(format!("{rule}: %json {schema}"));
                rule
            };
            body.push(format!("{ak} {} {akc} {av} {value} {avc}", lark_literal(k)));
        }
        rules.push(format!("call_{i}: {}", body.join(" ")));
        alternatives.push(format!("call_{i}"));
    }
    let opening = if close_think {
        format!("{} \"\\n\" {}", sp("</think>")?, sp("<tool_call>")?)
    } else {
        format!("\"\\n\" {}", sp("<tool_call>")?)
    };
    Ok(format!(
        "start: {opening} ({}) {}\n{}\nARG_TEXT: /(?s:.{{1,{MAX_ARG_CHARS}}})/\n",
        alternatives.join(" | "),
        sp("</tool_call>")?,
        rules.join("\n"),
    ))
}

/// Longest key, string, array and object of `json_object` output.
const JSON_OBJECT_KEY_CHARS: usize = 64;
const JSON_OBJECT_STRING_CHARS: usize = 512;
const JSON_OBJECT_ITEMS: usize = 64;

/// `json_object`: any JSON object, with keys, strings, arrays and objects bounded so that
/// even a model that never closes a string on its own ends within a known length.
fn json_object_schema() -> Value {
    let object = json!({
        "type": "object",
        "patternProperties": {format!("^.{{1,{JSON_OBJECT_KEY_CHARS}}}$"): {"$ref": "#/$defs/value"}},
        "additionalProperties": false,
        "maxProperties": JSON_OBJECT_ITEMS,
    });
    let mut schema = object.clone();
    schema["$defs"] = json!({"value": {"anyOf": [
        {"type": "string", "maxLength": JSON_OBJECT_STRING_CHARS},
        {"type": "number"},
        {"type": "boolean"},
        {"type": "null"},
        {"type": "array", "items": {"$ref": "#/$defs/value"}, "maxItems": JSON_OBJECT_ITEMS},
        object,
    ]}});
    schema
}

/// `schema` asking llguidance for compact JSON: a weak model could otherwise pad with
/// whitespace forever.
fn compact(mut schema: Value) -> Value {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance")
            .or_insert_with(|| json!({"whitespace_flexible": false}));
    }
    schema
}

/// The grammar of `response_format` (`None` for plain text): JSON matching the schema,
/// after closing an open `<think>` (structured output skips the reasoning).
fn response_format_grammar(
    codec: &crate::tokenizer::TextCodec,
    rf: &Value,
    close_think: bool,
) -> Result<Option<String>, ApiError> {
    let bad = |field: &str, msg: &str| {
        ApiError::invalid("response_format", format!("`response_format{field}` {msg}"))
    };
    let Some(obj) = rf.as_object() else {
        return Err(bad("", "must be an object with a `type`."));
    };
    let schema = match obj.get("type").and_then(Value::as_str) {
        Some("text") => return Ok(None),
        Some("json_object") => json_object_schema(),
        Some("json_schema") => {
            let Some(js) = obj.get("json_schema").and_then(Value::as_object) else {
                return Err(bad(
                    ".json_schema",
                    "must be an object with `name` and `schema`.",
                ));
            };
            match js.get("name").and_then(Value::as_str) {
                Some(n)
                    if !n.is_empty()
                        && n.len() <= 64
                        && n.chars()
                            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') => {}
                _ => {
                    return Err(bad(
                        ".json_schema.name",
                        "must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -.",
                    ));
                }
            }
            if js
                .get("strict")
                .is_some_and(|s| !s.is_boolean() && !s.is_null())
            {
                return Err(bad(".json_schema.strict", "must be a boolean."));
            }
            match js.get("schema") {
                None => json!({"type": "object"}),
                Some(s @ Value::Object(_)) => s.clone(),
                Some(_) => return Err(bad(".json_schema.schema", "must be a JSON Schema object.")),
            }
        }
        Some(other) => {
            return Err(bad(
                ".type",
                &format!("must be \"text\", \"json_object\" or \"json_schema\", got {other:?}."),
            ));
        }
        None => return Err(bad(".type", "must be a string.")),
    };
    let schema = compact(schema);
    let opening = if close_think {
        special(codec, "response_format", "</think>")?
    } else {
        String::new()
    };
    Ok(Some(format!(
        "start: {opening} body\nbody: %json {schema}\n"
    )))
}

/// Compiles a grammar for every choice; a grammar the compiler refuses is the client's
/// fault and names `param`.
fn constrain(
    engine: &Engine,
    reqs: &mut [GenRequest],
    grammar: &str,
    param: &str,
) -> Result<(), ApiError> {
    let grammars = engine.grammars().map_err(|e| {
        ApiError::invalid(
            param,
            format!("This model's tokenizer cannot be constrained: {e}"),
        )
    })?;
    let constraint = grammars.compile(grammar).map_err(|e| {
        ApiError::invalid(
            param,
            format!("`{param}` cannot be compiled to a grammar: {e:#}"),
        )
    })?;
    for r in reqs {
        r.constraint = Some(constraint.clone());
    }
    Ok(())
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
    let mut parse_tools = req.tools.as_ref().is_some_and(|t| !t.is_empty());
    // Tools a forced tool call may pick (tool_choice required or named).
    let mut forced: Option<Vec<Value>> = None;
    let tool_list = req.tools.clone().unwrap_or_default();
    match &req.tool_choice {
        None => {}
        Some(Value::String(s)) if s == "auto" => {}
        Some(Value::String(s)) if s == "none" => parse_tools = false,
        Some(Value::String(s)) if s == "required" => {
            if tool_list.is_empty() {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "`tool_choice` \"required\" needs at least one tool in `tools`.",
                ));
            }
            forced = Some(tool_list.clone());
        }
        Some(Value::Object(o)) if o.get("function").and_then(|f| f.get("name")).is_some() => {
            let name = o["function"]["name"].as_str().unwrap_or_default();
            let Some(tool) = tool_list.iter().find(|t| tool_name(t) == Some(name)) else {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("`tool_choice` names {name:?}, which is not in `tools`."),
                ));
            };
            forced = Some(vec![tool.clone()]);
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "tool_choice",
                "`tool_choice` must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}.",
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
    let max_tokens = budget(&engine, prompt.len(), "messages", max, field)?;
    let stop_ids = if req.ignore_eos == Some(true) {
        Vec::new()
    } else {
        codec.eos_ids().to_vec()
    };
    let in_reasoning = opens_reasoning(&text);
    let mut reqs = requests(&prompt, &v, max_tokens, &stop_ids, false);
    let format = match &req.response_format {
        Some(rf) => response_format_grammar(&codec, rf, in_reasoning)?,
        None => None,
    };
    match (&forced, format) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "response_format",
                "`response_format` cannot be combined with a forced `tool_choice`.",
            ));
        }
        (Some(tools), None) => {
            let grammar = tool_call_grammar(&codec, tools, in_reasoning)?;
            constrain(&engine, &mut reqs, &grammar, "tool_choice")?;
        }
        (None, Some(grammar)) => constrain(&engine, &mut reqs, &grammar, "response_format")?,
        (None, None) => {}
    }
    let rxs = submit(&engine, reqs)?;
    let meta = Meta {
        id: new_id("chatcmpl"),
        created: now_secs(),
        model: state.0.config.model_id.clone(),
    };
    if req.stream == Some(true) {
        let choices = Choices::Chat {
            parsers: (0..v.n)
                .map(|_| ChatParser::new(parse_tools, in_reasoning))
                .collect(),
            tool_calls: vec![0; v.n],
        };
        let stream = EventStream::new(
            meta,
            "chat.completion.chunk",
            choices,
            req.stream_options,
            prompt.len(),
        );
        return Ok(stream.respond(rxs));
    }
    let results = futures::future::join_all(rxs.into_iter().map(collect)).await;
    let mut choices = Vec::new();
    let mut completion_tokens = 0;
    for (i, r) in results.into_iter().enumerate() {
        let c = r?;
        completion_tokens += c.completion_tokens;
        let (mut reasoning, mut content, mut calls) = (String::new(), String::new(), Vec::new());
        for p in parse_all(&c.text, parse_tools, in_reasoning) {
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
        let max_tokens = budget(&engine, p.len(), "prompt", req.max_tokens, "max_tokens")?;
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
        let choices = Choices::Text {
            offsets: vec![0; rxs.len()],
            logprobs: logprobs.is_some(),
        };
        let stream = EventStream::new(
            meta,
            "text_completion",
            choices,
            req.stream_options,
            prompt_tokens,
        );
        return Ok(stream.respond(rxs));
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

/// What differs between the chat and completions streams: how one choice's text becomes
/// a `choices[]` entry.
enum Choices {
    /// Chat: text parsed into reasoning, content and tool calls (counted per choice).
    Chat {
        parsers: Vec<ChatParser>,
        tool_calls: Vec<usize>,
    },
    /// Completions: raw text, log-probabilities with running text offsets.
    Text { offsets: Vec<usize>, logprobs: bool },
}

/// One SSE response for either endpoint: turns engine events of choice `i` into `data:`
/// payloads with the endpoint's envelope, then the usage chunk (if asked) and `[DONE]`.
struct EventStream {
    meta: Meta,
    object: &'static str,
    choices: Choices,
    include_usage: bool,
    prompt_tokens: usize,
    completion_tokens: usize,
}

impl EventStream {
    fn new(
        meta: Meta,
        object: &'static str,
        choices: Choices,
        options: Option<StreamOptions>,
        prompt_tokens: usize,
    ) -> EventStream {
        EventStream {
            meta,
            object,
            choices,
            include_usage: options.and_then(|o| o.include_usage).unwrap_or(false),
            prompt_tokens,
            completion_tokens: 0,
        }
    }

    fn envelope(&self, choices: Value, usage: Option<Value>) -> String {
        let mut v = json!({
            "id": self.meta.id,
            "object": self.object,
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": choices,
        });
        if let Some(u) = usage {
            v["usage"] = u;
        }
        v.to_string()
    }

    /// A chunk of choice `i`: `body` holds the endpoint's fields (`delta` or `text`).
    fn chunk(&self, i: usize, mut body: Value, logprobs: Value, finish: Value) -> String {
        body["index"] = json!(i);
        body["logprobs"] = logprobs;
        body["finish_reason"] = finish;
        self.envelope(json!([body]), None)
    }

    fn start(&self, n: usize) -> Vec<String> {
        match self.choices {
            Choices::Chat { .. } => (0..n)
                .map(|i| {
                    self.chunk(
                        i,
                        json!({"delta": {"role": "assistant", "content": ""}}),
                        Value::Null,
                        Value::Null,
                    )
                })
                .collect(),
            Choices::Text { .. } => Vec::new(),
        }
    }

    /// Chat deltas for parsed pieces.
    fn pieces(&mut self, i: usize, pieces: Vec<Piece>, out: &mut Vec<String>) {
        for p in pieces {
            let delta = match p {
                Piece::Reasoning(s) => json!({"reasoning_content": s}),
                Piece::Content(s) => json!({"content": s}),
                Piece::ToolCall { name, arguments } => {
                    let k = match &mut self.choices {
                        Choices::Chat { tool_calls, .. } => {
                            tool_calls[i] += 1;
                            tool_calls[i] - 1
                        }
                        Choices::Text { .. } => 0,
                    };
                    json!({"tool_calls": [{
                        "index": k,
                        "id": new_id("call"),
                        "type": "function",
                        "function": {"name": name, "arguments": arguments},
                    }]})
                }
            };
            out.push(self.chunk(i, json!({ "delta": delta }), Value::Null, Value::Null));
        }
    }

    fn event(&mut self, i: usize, ev: Event) -> Vec<String> {
        let mut out = Vec::new();
        match ev {
            Event::Delta { text, logprobs } => match &mut self.choices {
                Choices::Chat { parsers, .. } => {
                    let pieces = parsers[i].push(&text);
                    self.pieces(i, pieces, &mut out);
                    if !logprobs.is_empty() {
                        out.push(self.chunk(
                            i,
                            json!({"delta": {}}),
                            chat_logprobs(&logprobs),
                            Value::Null,
                        ));
                    }
                }
                Choices::Text {
                    offsets,
                    logprobs: want,
                } => {
                    let lp = if *want {
                        completion_logprobs(&logprobs, &mut offsets[i])
                    } else {
                        Value::Null
                    };
                    out.push(self.chunk(i, json!({ "text": text }), lp, Value::Null));
                }
            },
            Event::Done {
                finish_reason,
                completion_tokens,
                ..
            } => {
                self.completion_tokens += completion_tokens;
                let (body, finish) = match &mut self.choices {
                    Choices::Chat { parsers, .. } => {
                        let pieces = parsers[i].finish();
                        self.pieces(i, pieces, &mut out);
                        let called = matches!(&self.choices, Choices::Chat { tool_calls, .. } if tool_calls[i] > 0);
                        let finish = if called && finish_reason == FinishReason::Stop {
                            "tool_calls"
                        } else {
                            finish_reason.as_str()
                        };
                        (json!({"delta": {}}), finish)
                    }
                    Choices::Text { .. } => (json!({"text": ""}), finish_reason.as_str()),
                };
                out.push(self.chunk(i, body, Value::Null, json!(finish)));
            }
            Event::Error(e) => out.push(ApiError::internal(e).body().to_string()),
        }
        out
    }

    /// After every choice ended: the usage chunk (if asked).
    fn end(&self) -> Vec<String> {
        if !self.include_usage {
            return Vec::new();
        }
        vec![self.envelope(
            json!([]),
            Some(usage(self.prompt_tokens, self.completion_tokens)),
        )]
    }

    /// The SSE response over every choice's event channel.
    fn respond(self, rxs: Vec<UnboundedReceiver<Event>>) -> Response {
        let first = self.start(rxs.len());
        let merged: BoxStream<'static, (usize, Event)> =
            stream::select_all(rxs.into_iter().enumerate().map(|(i, rx)| {
                stream::unfold(rx, move |mut rx| async move {
                    rx.recv().await.map(|e| ((i, e), rx))
                })
                .boxed()
            }))
            .boxed();
        let body = stream::unfold(Some((merged, self)), |st| async move {
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
}
