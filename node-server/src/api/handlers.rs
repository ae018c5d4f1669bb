//! The OpenAI endpoints: `/v1/models`, `/v1/chat/completions` and `/v1/completions`. A
//! completion handler checks the request, turns it into one engine request per choice,
//! submits them, and answers with a stream or a whole response.

use super::grammar::{chat_grammar, check_tools, constrain, tool_choice};
use super::parse::opens_reasoning;
use super::request::{
    ChatRequest, CompletionRequest, MAX_TOP_LOGPROBS, Validated, budget, check_messages,
    completion_prompts, int,
};
use super::response::{Meta, chat_response, completion_response};
use super::stream::{Choices, EventStream};
use super::{ApiError, ApiJson, AppState};
use crate::engine::sampling::SamplingParams;
use crate::engine::scheduler::{Engine, Event, GenRequest, SubmitError};
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::mpsc::UnboundedReceiver;

fn check_model(state: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != state.0.config.model_id => Err(ApiError::model_not_found(m)),
        _ => Ok(()),
    }
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

/// One engine request per choice of `prompt`, choice `i` seeded with the seed plus `i`.
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

fn model_card(state: &AppState) -> Value {
    json!({
        "id": state.0.config.model_id,
        "object": "model",
        "created": state.0.created,
        "owned_by": "glmflash",
        "max_model_len": state.engine().map(|e| e.config.context_length),
    })
}

pub(super) async fn list_models(State(state): State<AppState>) -> Response {
    axum::Json(json!({"object": "list", "data": [model_card(&state)]})).into_response()
}

pub(super) async fn get_model(
    State(state): State<AppState>,
    Path(model): Path<String>,
) -> Response {
    if model == state.0.config.model_id {
        axum::Json(model_card(&state)).into_response()
    } else {
        ApiError::model_not_found(&model).into_response()
    }
}

pub(super) async fn chat_completions(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<ChatRequest>,
) -> Result<Response, ApiError> {
    let engine = state.ready_engine()?.clone();
    check_model(&state, req.model.as_deref())?;
    let messages = check_messages(&req.messages)?;
    let choice = tool_choice(req.tool_choice.as_ref(), req.tools.as_deref())?;
    if let Some(tools) = req.tools.as_deref() {
        check_tools(tools, engine.grammars().ok().map(|g| &**g))?;
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
    let v = req.sampling.validate(top_logprobs)?;
    let kwargs = req.chat_template_kwargs.map(Value::Object);
    let codec = engine.codec.clone();
    let text = codec
        .render_chat_with(
            &messages,
            req.tools.map(Value::Array).as_ref(),
            true,
            kwargs.as_ref(),
        )
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
    let grammar = chat_grammar(
        &codec,
        req.response_format.as_ref(),
        choice.forced.as_deref(),
        in_reasoning,
    )?;
    if let Some((grammar, param)) = grammar {
        constrain(&engine, &mut reqs, &grammar, param)?;
    }
    let rxs = submit(&engine, reqs)?;
    let meta = Meta::new("chatcmpl", state.0.config.model_id.clone());
    if req.stream == Some(true) {
        let stream = EventStream::new(
            meta,
            "chat.completion.chunk",
            Choices::chat(v.n, choice.parse, in_reasoning),
            req.stream_options,
            prompt.len(),
        );
        return Ok(stream.respond(rxs));
    }
    chat_response(
        meta,
        rxs,
        choice.parse,
        in_reasoning,
        v.params.logprobs.is_some(),
        prompt.len(),
    )
    .await
}

pub(super) async fn completions(
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
        && b != req.sampling.n.unwrap_or(1)
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
    let v = req.sampling.validate(logprobs)?;
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
    let meta = Meta::new("cmpl", state.0.config.model_id.clone());
    if req.stream == Some(true) {
        let stream = EventStream::new(
            meta,
            "text_completion",
            Choices::text(rxs.len(), logprobs.is_some()),
            req.stream_options,
            prompt_tokens,
        );
        return Ok(stream.respond(rxs));
    }
    completion_response(meta, rxs, logprobs.is_some(), prompt_tokens).await
}
