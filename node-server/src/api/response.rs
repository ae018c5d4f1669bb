//! The non-streaming responses of both endpoints, and what the streams share with them:
//! ids, the envelope's [`Meta`], usage, and log-probabilities in each endpoint's shape.

use super::ApiError;
use super::parse::{ArgFormats, Piece, parse_all};
use crate::engine::scheduler::{Event, FinishReason, TokenLogprob};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedReceiver;

/// What every response object (or chunk) of one request carries.
pub(super) struct Meta {
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) model: String,
}

impl Meta {
    /// A fresh id with `prefix` (`chatcmpl`, `cmpl`), created now.
    pub(super) fn new(prefix: &str, model: String) -> Meta {
        Meta {
            id: new_id(prefix),
            created: now_secs(),
            model,
        }
    }
}

pub(super) fn new_id(prefix: &str) -> String {
    format!(
        "{prefix}-{:016x}{:08x}",
        rand::random::<u64>(),
        rand::random::<u32>()
    )
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
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

pub(super) fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

fn bytes_of(s: &str) -> Vec<u8> {
    s.as_bytes().to_vec()
}

pub(super) fn chat_logprobs(lps: &[TokenLogprob]) -> Value {
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

pub(super) fn completion_logprobs(lps: &[TokenLogprob], offset: &mut usize) -> Value {
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

/// The `chat.completion` object once every choice finished: each choice's text parsed
/// into reasoning, content and tool calls (`tools`: their argument formats when calls are
/// parsed; `in_reasoning`: the prompt left `<think>` open).
pub(super) async fn chat_response(
    meta: Meta,
    rxs: Vec<UnboundedReceiver<Event>>,
    tools: Option<Arc<ArgFormats>>,
    in_reasoning: bool,
    logprobs: bool,
    prompt_tokens: usize,
) -> Result<Response, ApiError> {
    let results = futures::future::join_all(rxs.into_iter().map(collect)).await;
    let mut choices = Vec::new();
    let mut completion_tokens = 0;
    for (i, r) in results.into_iter().enumerate() {
        let c = r?;
        completion_tokens += c.completion_tokens;
        let (mut reasoning, mut content, mut calls) = (String::new(), String::new(), Vec::new());
        for p in parse_all(&c.text, tools.clone(), in_reasoning) {
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
            "logprobs": if logprobs { chat_logprobs(&c.logprobs) } else { Value::Null },
            "finish_reason": finish,
        }));
    }
    Ok(axum::Json(json!({
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens),
    }))
    .into_response())
}

/// The `text_completion` object once every choice finished.
pub(super) async fn completion_response(
    meta: Meta,
    rxs: Vec<UnboundedReceiver<Event>>,
    logprobs: bool,
    prompt_tokens: usize,
) -> Result<Response, ApiError> {
    let results = futures::future::join_all(rxs.into_iter().map(collect)).await;
    let mut choices = Vec::new();
    let mut completion_tokens = 0;
    for (i, r) in results.into_iter().enumerate() {
        let c = r?;
        completion_tokens += c.completion_tokens;
        choices.push(json!({
            "index": i,
            "text": c.text,
            "logprobs": if logprobs { completion_logprobs(&c.logprobs, &mut 0) } else { Value::Null },
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
