//! Server-sent events for both endpoints: one [`EventStream`] turns the engine events of
//! every choice into `data:` chunks in the endpoint's envelope, then the usage chunk (if
//! asked) and `data: [DONE]`.

use super::ApiError;
use super::parse::{ArgFormats, ChatParser, Piece};
use super::request::StreamOptions;
use super::response::{Meta, chat_logprobs, completion_logprobs, new_id, usage};
use crate::engine::scheduler::{Event, FinishReason};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::{self, BoxStream, StreamExt};
use serde_json::{Value, json};
use std::convert::Infallible;
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedReceiver;

/// What differs between the chat and completions streams: how one choice's text becomes
/// a `choices[]` entry.
pub(super) enum Choices {
    /// Chat: text parsed into reasoning, content and tool calls (counted per choice).
    Chat {
        parsers: Vec<ChatParser>,
        tool_calls: Vec<usize>,
    },
    /// Completions: raw text, log-probabilities with running text offsets.
    Text { offsets: Vec<usize>, logprobs: bool },
}

impl Choices {
    /// `n` chat choices; `tools` and `in_reasoning` as for [`ChatParser::new`].
    pub(super) fn chat(n: usize, tools: Option<Arc<ArgFormats>>, in_reasoning: bool) -> Choices {
        Choices::Chat {
            parsers: (0..n)
                .map(|_| ChatParser::new(tools.clone(), in_reasoning))
                .collect(),
            tool_calls: vec![0; n],
        }
    }

    /// `n` completion choices, with log-probabilities or not.
    pub(super) fn text(n: usize, logprobs: bool) -> Choices {
        Choices::Text {
            offsets: vec![0; n],
            logprobs,
        }
    }
}

/// One SSE response for either endpoint: turns engine events of choice `i` into `data:`
/// payloads with the endpoint's envelope, then the usage chunk (if asked) and `[DONE]`.
pub(super) struct EventStream {
    meta: Meta,
    object: &'static str,
    choices: Choices,
    include_usage: bool,
    prompt_tokens: usize,
    completion_tokens: usize,
}

impl EventStream {
    pub(super) fn new(
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
    pub(super) fn respond(self, rxs: Vec<UnboundedReceiver<Event>>) -> Response {
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
