//! The OpenAI API driven through `app(state)` with `oneshot` (no socket) on the demo model.

mod common;

use axum::Router;
use axum::body::{Body, to_bytes};
use axum::http::{Request, StatusCode};
use glmflash_node::api::{ApiConfig, AppState, app};
use glmflash_node::engine::scheduler::EngineConfig;
use glmflash_node::metrics::Metrics;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tower::ServiceExt;

use common::server;

fn default_server() -> (Router, AppState) {
    server(EngineConfig::default(), ApiConfig::default())
}

fn post(path: &str, body: &str) -> Request<Body> {
    Request::post(path)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap()
}

fn get(path: &str) -> Request<Body> {
    Request::get(path).body(Body::empty()).unwrap()
}

async fn send(app: &Router, req: Request<Body>) -> (StatusCode, String) {
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let body = to_bytes(resp.into_body(), usize::MAX).await.unwrap();
    (status, String::from_utf8(body.to_vec()).unwrap())
}

async fn send_json(app: &Router, req: Request<Body>) -> (StatusCode, Value) {
    let (s, b) = send(app, req).await;
    (
        s,
        serde_json::from_str(&b).unwrap_or_else(|e| panic!("{e}: {b}")),
    )
}

fn chat(extra: Value) -> String {
    let mut body = json!({
        "model": "glm-5.3-flash",
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
    });
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body.to_string()
}

/// `data:` payloads of an SSE body.
fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(String::from)
        .collect()
}

fn assert_error(v: &Value, kind: &str, param: Option<&str>) {
    let e = &v["error"];
    assert_eq!(e["type"], kind, "{v}");
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e.get("code").is_some(), "{v}");
    match param {
        Some(p) => assert_eq!(e["param"], p, "{v}"),
        None => assert!(e["param"].is_null(), "{v}"),
    }
}

#[tokio::test]
async fn models_health_ready_and_metrics() {
    let (app, state) = default_server();
    let (s, v) = send_json(&app, get("/v1/models")).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "glm-5.3-flash");
    assert_eq!(send(&app, get("/health")).await.0, StatusCode::OK);
    assert_eq!(send(&app, get("/ready")).await.0, StatusCode::OK);
    let (s, v) = send_json(&app, get("/v1/models/other")).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_error(&v, "invalid_request_error", Some("model"));
    let (s, _) = send_json(&app, post("/v1/chat/completions", &chat(json!({})))).await;
    assert_eq!(s, StatusCode::OK);
    let (s, text) = send(&app, get("/metrics")).await;
    assert_eq!(s, StatusCode::OK);
    for name in glmflash_node::metrics::ALL {
        assert!(text.contains(name), "{name} missing from\n{text}");
    }
    assert!(text.contains(r#"glmflash_requests_total{endpoint="/v1/models",status="200"} 1"#));
    assert!(
        text.contains(r#"glmflash_requests_total{endpoint="/v1/chat/completions",status="200"} 1"#)
    );
    // The default budget holds the batch (8) of full-context sequences, in bytes.
    let engine = state.engine().unwrap();
    let ctx = engine.config.context_length;
    assert_eq!(
        metric(&text, "glmflash_kv_bytes_capacity") as usize,
        engine.layout.bytes_for(ctx) * 8
    );
    assert!(metric(&text, "glmflash_kv_tokens_capacity") as usize >= 8 * ctx);
    let prefill: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("glmflash_prefill_tokens_total "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(prefill > 0.0);
    assert!(text.contains("glmflash_time_to_first_token_seconds_count 1"));
}

#[tokio::test]
async fn loading_gives_503_and_unknown_routes_404() {
    let state = AppState::new(ApiConfig::default(), Arc::new(Metrics::new()));
    let app = app(state);
    let (s, v) = send_json(&app, post("/v1/chat/completions", &chat(json!({})))).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    assert_error(&v, "server_error", None);
    assert_eq!(
        send(&app, get("/ready")).await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(send(&app, get("/health")).await.0, StatusCode::OK);
    let (s, v) = send_json(&app, get("/v1/nothing")).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_error(&v, "invalid_request_error", None);
}

#[tokio::test]
async fn bad_requests_get_openai_errors_naming_the_field() {
    let (app, _) = server(
        EngineConfig {
            context_length: 64,
            ..EngineConfig::default()
        },
        ApiConfig {
            max_body_bytes: 4096,
            ..ApiConfig::default()
        },
    );
    let cases: Vec<(String, StatusCode, Option<&str>, &str)> = vec![
        (
            "{not json".into(),
            StatusCode::BAD_REQUEST,
            None,
            "not valid JSON",
        ),
        (
            chat(json!({"temperature": "hot"})),
            StatusCode::BAD_REQUEST,
            Some("temperature"),
            "temperature",
        ),
        (
            chat(json!({"temperature": 3})),
            StatusCode::BAD_REQUEST,
            Some("temperature"),
            "between 0 and 2",
        ),
        (
            chat(json!({"top_p": 0})),
            StatusCode::BAD_REQUEST,
            Some("top_p"),
            "top_p",
        ),
        (
            chat(json!({"n": 0})),
            StatusCode::BAD_REQUEST,
            Some("n"),
            "between 1 and 16",
        ),
        (
            chat(json!({"max_tokens": 0})),
            StatusCode::BAD_REQUEST,
            Some("max_tokens"),
            "at least 1",
        ),
        (
            chat(json!({"messages": [{"role": "wizard", "content": "x"}]})),
            StatusCode::BAD_REQUEST,
            Some("messages[0].role"),
            "wizard",
        ),
        (
            chat(json!({"messages": [{"role": 3}]})),
            StatusCode::BAD_REQUEST,
            Some("messages[0].role"),
            "role",
        ),
        (
            chat(json!({"stop": 5})),
            StatusCode::BAD_REQUEST,
            Some("stop"),
            "stop",
        ),
        (
            chat(json!({"model": "gpt-4o"})),
            StatusCode::NOT_FOUND,
            Some("model"),
            "gpt-4o",
        ),
        (
            chat(json!({"max_tokens": 1000})),
            StatusCode::BAD_REQUEST,
            Some("max_tokens"),
            "maximum context length is 64 tokens",
        ),
        (
            chat(json!({"response_format": {"type": "xml"}})),
            StatusCode::BAD_REQUEST,
            Some("response_format"),
            "\"json_schema\"",
        ),
        (
            chat(
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 12}}}}),
            ),
            StatusCode::BAD_REQUEST,
            Some("response_format"),
            "cannot be compiled",
        ),
        (
            chat(
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}}),
            ),
            StatusCode::BAD_REQUEST,
            Some("response_format"),
            "json_schema.name",
        ),
        (
            chat(json!({"messages": [{"role": "user", "content": "x".repeat(5000)}]})),
            StatusCode::PAYLOAD_TOO_LARGE,
            None,
            "4096 bytes",
        ),
    ];
    for (body, status, param, needle) in cases {
        let (s, v) = send_json(&app, post("/v1/chat/completions", &body)).await;
        assert_eq!(s, status, "{body} -> {v}");
        assert_error(&v, "invalid_request_error", param);
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(needle), "{needle:?} not in {msg:?}");
    }
    // A prompt over the context names both numbers.
    let long = "hello world ".repeat(60);
    let (s, v) = send_json(
        &app,
        post(
            "/v1/completions",
            &json!({"prompt": long, "max_tokens": 4}).to_string(),
        ),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("64 tokens") && msg.contains("prompt has"),
        "{msg}"
    );
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    assert_eq!(v["error"]["param"], "prompt");
    let (s, v) = send_json(
        &app,
        post(
            "/v1/completions",
            &json!({"prompt": [1, 2, 99999]}).to_string(),
        ),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_error(&v, "invalid_request_error", Some("prompt"));
}

#[tokio::test]
async fn api_keys_guard_v1_but_not_health() {
    let (app, _) = server(
        EngineConfig::default(),
        ApiConfig {
            api_keys: vec!["sekret".into()],
            ..ApiConfig::default()
        },
    );
    let (s, v) = send_json(&app, get("/v1/models")).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    assert_eq!(v["error"]["code"], "invalid_api_key");
    let authed = Request::get("/v1/models")
        .header("authorization", "Bearer sekret")
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(&app, authed).await.0, StatusCode::OK);
    assert_eq!(send(&app, get("/health")).await.0, StatusCode::OK);
    assert_eq!(send(&app, get("/metrics")).await.0, StatusCode::OK);
}

#[tokio::test]
async fn chat_is_reproducible_with_seed_n_and_logprobs() {
    let (app, _) = default_server();
    let body =
        chat(json!({"seed": 42, "temperature": 0.9, "n": 2, "logprobs": true, "top_logprobs": 3}));
    let (s, a) = send_json(&app, post("/v1/chat/completions", &body)).await;
    assert_eq!(s, StatusCode::OK, "{a}");
    let (_, b) = send_json(&app, post("/v1/chat/completions", &body)).await;
    assert_eq!(a["object"], "chat.completion");
    assert_eq!(a["choices"].as_array().unwrap().len(), 2);
    for i in 0..2 {
        assert_eq!(a["choices"][i]["message"], b["choices"][i]["message"]);
        assert_eq!(a["choices"][i]["index"], i);
        let fr = a["choices"][i]["finish_reason"].as_str().unwrap();
        assert!(["stop", "length", "tool_calls"].contains(&fr), "{fr}");
        let lp = a["choices"][i]["logprobs"]["content"].as_array().unwrap();
        assert!(!lp.is_empty() && lp.len() <= 8);
        assert_eq!(lp[0]["top_logprobs"].as_array().unwrap().len(), 3);
        assert!(lp[0]["logprob"].as_f64().unwrap() <= 0.0);
    }
    let u = &a["usage"];
    assert!(u["completion_tokens"].as_u64().unwrap() <= 16);
    assert_eq!(
        u["total_tokens"].as_u64().unwrap(),
        u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap()
    );
}

#[tokio::test]
async fn choices_drawn_together_are_those_drawn_alone() {
    // The n choices run as one batch and draw their tokens in parallel; choice i is seeded
    // with seed + i, so each must be the answer of a request of n = 1 with that seed.
    let (app, _) = default_server();
    let params = |seed: u64, n: usize| {
        chat(
            json!({"seed": seed, "temperature": 1.0, "n": n, "max_tokens": 12, "ignore_eos": true}),
        )
    };
    let (s, together) = send_json(&app, post("/v1/chat/completions", &params(5, 4))).await;
    assert_eq!(s, StatusCode::OK, "{together}");
    for i in 0..4u64 {
        let (_, alone) = send_json(&app, post("/v1/chat/completions", &params(5 + i, 1))).await;
        assert_eq!(
            together["choices"][i as usize]["message"], alone["choices"][0]["message"],
            "choice {i}"
        );
    }
}

#[tokio::test]
async fn streaming_matches_non_streaming_and_ends_with_done() {
    let (app, _) = default_server();
    let base = json!({"seed": 7, "temperature": 0.7, "max_tokens": 12, "ignore_eos": true});
    let (_, whole) = send_json(&app, post("/v1/chat/completions", &chat(base.clone()))).await;
    let mut streamed = base.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (s, body) = send(&app, post("/v1/chat/completions", &chat(streamed))).await;
    assert_eq!(s, StatusCode::OK);
    let data = sse_data(&body);
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let (mut content, mut reasoning) = (String::new(), String::new());
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        if let Some(ch) = c["choices"].get(0) {
            content += ch["delta"]["content"].as_str().unwrap_or("");
            reasoning += ch["delta"]["reasoning_content"].as_str().unwrap_or("");
        }
    }
    let finish = &chunks[chunks.len() - 2]["choices"][0]["finish_reason"];
    assert_eq!(finish, "length");
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 12);
    let msg = &whole["choices"][0]["message"];
    assert_eq!(content.trim(), msg["content"].as_str().unwrap_or(""));
    assert_eq!(
        reasoning.trim(),
        msg["reasoning_content"].as_str().unwrap_or("")
    );
}

#[tokio::test]
async fn completions_stop_strings_are_cut_and_chunked_prefill_agrees() {
    let (app, _) = default_server();
    let req = |extra: Value| {
        let mut b = json!({"prompt": "The experts live in VRAM because", "max_tokens": 24,
                           "temperature": 0, "ignore_eos": true});
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        post("/v1/completions", &b.to_string())
    };
    let (s, v) = send_json(&app, req(json!({}))).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "text_completion");
    let text = v["choices"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    // A stop string from the middle of the greedy text: cut before it, not emitted.
    let chars: Vec<char> = text.chars().collect();
    let start = (chars.len() / 2).min(chars.len().saturating_sub(3));
    let stop: String = chars[start..(start + 3).min(chars.len())].iter().collect();
    let expected = &text[..text.find(&stop).unwrap()];
    let (_, v) = send_json(&app, req(json!({"stop": [stop.clone(), "\u{1}never"]}))).await;
    assert_eq!(
        v["choices"][0]["text"], expected,
        "stop {stop:?} in {text:?}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // Streaming with the stop string gives the same text.
    let (_, body) = send(&app, req(json!({"stop": stop, "stream": true}))).await;
    let streamed: String = sse_data(&body)
        .iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| {
            serde_json::from_str::<Value>(d).unwrap()["choices"][0]["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(streamed, expected);
    // Prefilling the prompt 3 tokens a tick gives the same greedy text.
    let (chunked, _) = server(
        EngineConfig {
            chunk_size: 3,
            ..EngineConfig::default()
        },
        ApiConfig::default(),
    );
    let (_, v) = send_json(&chunked, req(json!({}))).await;
    assert_eq!(v["choices"][0]["text"], text.as_str());
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap()
        .parse()
        .unwrap()
}

#[tokio::test]
async fn full_queue_gives_429_and_disconnects_free_the_cache() {
    let (app, _) = server(
        EngineConfig {
            max_batch_size: 1,
            max_waiting: 1,
            ..EngineConfig::default()
        },
        ApiConfig::default(),
    );
    let long = chat(json!({"max_tokens": 5000, "ignore_eos": true, "stream": true}));
    let mut held = Vec::new();
    let mut limited = None;
    let mut refused = 0;
    for _ in 0..3 {
        let resp = app
            .clone()
            .oneshot(post("/v1/chat/completions", &long))
            .await
            .unwrap();
        if resp.status() == StatusCode::TOO_MANY_REQUESTS {
            refused += 1;
            limited = Some(resp);
        } else {
            assert_eq!(resp.status(), StatusCode::OK);
            held.push(resp);
        }
    }
    let resp = limited.expect("one of three requests is refused (1 running + 1 waiting)");
    assert_eq!(resp.headers()["retry-after"], "1");
    let v: Value =
        serde_json::from_slice(&to_bytes(resp.into_body(), usize::MAX).await.unwrap()).unwrap();
    assert_error(&v, "rate_limit_error", None);
    // The running stream holds cache tokens; dropping the clients frees them.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, m) = send(&app, get("/metrics")).await;
        if metric(&m, "glmflash_kv_tokens_used") > 0.0 {
            break;
        }
        assert!(Instant::now() < deadline, "no cache in use:\n{m}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(held);
    loop {
        let (_, m) = send(&app, get("/metrics")).await;
        if metric(&m, "glmflash_kv_tokens_used") == 0.0
            && metric(&m, "glmflash_running_requests") == 0.0
            && metric(&m, "glmflash_waiting_requests") == 0.0
        {
            break;
        }
        assert!(Instant::now() < deadline, "cache not freed:\n{m}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (_, m) = send(&app, get("/metrics")).await;
    let line = format!(
        r#"glmflash_requests_total{{endpoint="/v1/chat/completions",status="429"}} {refused}"#
    );
    assert!(m.contains(&line), "{line} not in\n{m}");
}

#[tokio::test]
async fn tools_and_thinking_pass_through_the_template() {
    let (app, _) = default_server();
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let body = chat(json!({
        "tools": tools,
        "chat_template_kwargs": {"enable_thinking": false},
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
              "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
    }));
    let (s, v) = send_json(&app, post("/v1/chat/completions", &body)).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    // tool_choice required / named force a well-formed call even from random weights.
    for choice in [
        json!("required"),
        json!({"type": "function", "function": {"name": "get_weather"}}),
    ] {
        for stream in [false, true] {
            let body = chat(
                json!({"tools": tools, "tool_choice": choice, "max_tokens": 200,
                                   "seed": 3, "stream": stream}),
            );
            let (s, text) = send(&app, post("/v1/chat/completions", &body)).await;
            assert_eq!(s, StatusCode::OK, "{text}");
            let (name, args, finish) = if stream {
                let (mut name, mut args, mut finish) =
                    (String::new(), String::new(), String::new());
                for d in sse_data(&text).iter().filter(|d| *d != "[DONE]") {
                    let c: Value = serde_json::from_str(d).unwrap();
                    let ch = &c["choices"][0];
                    if let Some(tc) = ch["delta"]["tool_calls"].get(0) {
                        name += tc["function"]["name"].as_str().unwrap_or("");
                        args += tc["function"]["arguments"].as_str().unwrap_or("");
                    }
                    if let Some(f) = ch["finish_reason"].as_str() {
                        finish = f.to_string();
                    }
                }
                (name, args, finish)
            } else {
                let v: Value = serde_json::from_str(&text).unwrap();
                let call = &v["choices"][0]["message"]["tool_calls"][0]["function"];
                (
                    call["name"].as_str().unwrap_or("").to_string(),
                    call["arguments"].as_str().unwrap_or("").to_string(),
                    v["choices"][0]["finish_reason"]
                        .as_str()
                        .unwrap()
                        .to_string(),
                )
            };
            assert_eq!(name, "get_weather", "{text}");
            let args: Value = serde_json::from_str(&args).unwrap();
            assert!(
                args["city"].is_string() || args["city"].is_number(),
                "{args}"
            );
            assert_eq!(finish, "tool_calls");
        }
    }
    let named_missing = chat(json!({"tools": tools, "tool_choice":
        {"type": "function", "function": {"name": "nope"}}}));
    let (s, v) = send_json(&app, post("/v1/chat/completions", &named_missing)).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_error(&v, "invalid_request_error", Some("tool_choice"));
}

#[tokio::test]
async fn chunked_prefill_keeps_running_streams_flowing() {
    use futures::StreamExt;
    // 8 prompt tokens a tick: a 480-token prompt takes 60 ticks to prefill, and a stream
    // already decoding gets a token on every one of them.
    let (app, _) = server(
        EngineConfig {
            chunk_size: 8,
            ..EngineConfig::default()
        },
        ApiConfig::default(),
    );
    let a = app
        .clone()
        .oneshot(post(
            "/v1/completions",
            &json!({"prompt": "Stream", "max_tokens": 3000, "ignore_eos": true, "stream": true})
                .to_string(),
        ))
        .await
        .unwrap();
    let mut a_body = a.into_body().into_data_stream();
    // Wait until A decodes.
    a_body.next().await.unwrap().unwrap();
    let arrivals = Arc::new(std::sync::Mutex::new(Vec::<Instant>::new()));
    let sink = arrivals.clone();
    let reader = tokio::spawn(async move {
        while let Some(Ok(_)) = a_body.next().await {
            sink.lock().unwrap().push(Instant::now());
        }
    });
    let long: Vec<u32> = (0..480).map(|i| 32 + (i % 64)).collect();
    let submitted = Instant::now();
    let (s, v) = send_json(
        &app,
        post(
            "/v1/completions",
            &json!({"prompt": long, "max_tokens": 1}).to_string(),
        ),
    )
    .await;
    let answered = Instant::now();
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], 480);
    reader.abort();
    let during = arrivals
        .lock()
        .unwrap()
        .iter()
        .filter(|t| **t > submitted && **t < answered)
        .count();
    assert!(
        during >= 20,
        "only {during} tokens of the running stream while a 480-token prompt was prefilled"
    );
}

/// A tiny JSON Schema check: types, required keys, enums, no extra keys when closed.
fn matches_schema(v: &Value, schema: &Value) -> bool {
    if let Some(e) = schema.get("enum").and_then(Value::as_array) {
        return e.contains(v);
    }
    match schema["type"].as_str() {
        Some("object") => {
            let Some(o) = v.as_object() else { return false };
            let props = schema["properties"]
                .as_object()
                .cloned()
                .unwrap_or_default();
            let required = schema["required"].as_array().cloned().unwrap_or_default();
            required.iter().all(|k| o.contains_key(k.as_str().unwrap()))
                && o.iter().all(|(k, x)| match props.get(k) {
                    Some(p) => matches_schema(x, p),
                    None => schema["additionalProperties"] != json!(false),
                })
        }
        Some("array") => v
            .as_array()
            .is_some_and(|a| a.iter().all(|x| matches_schema(x, &schema["items"]))),
        Some("string") => v.is_string(),
        // JSON Schema integers are unbounded: beyond 64 bits serde_json reads an f64.
        Some("integer") => v.is_i64() || v.is_u64() || v.as_f64().is_some_and(|f| f.fract() == 0.0),
        Some("number") => v.is_number(),
        Some("boolean") => v.is_boolean(),
        _ => true,
    }
}

#[tokio::test]
async fn response_format_gives_json_matching_the_schema_from_random_weights() {
    let (app, _) = default_server();
    let schema = json!({"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "days": {"type": "integer"},
        "unit": {"enum": ["c", "f"]},
        "tags": {"type": "array", "items": {"type": "boolean"}}},
        "required": ["city", "days", "unit", "tags"], "additionalProperties": false});
    // json_object bounds its strings at 512 characters: a random model needs room.
    let formats = [
        (
            json!({"type": "json_schema", "json_schema": {"name": "weather", "schema": schema, "strict": true}}),
            300,
            &[false, true][..],
        ),
        (json!({"type": "json_object"}), 2000, &[false][..]),
    ];
    for (k, (format, max_tokens, streams)) in formats.iter().enumerate() {
        for &stream in *streams {
            for thinking in [true, false] {
                let body = chat(
                    json!({"response_format": format, "max_tokens": max_tokens, "n": 2,
                    "seed": 11, "stream": stream, "temperature": 1.0,
                    "chat_template_kwargs": {"enable_thinking": thinking}}),
                );
                let (s, text) = send(&app, post("/v1/chat/completions", &body)).await;
                assert_eq!(s, StatusCode::OK, "{text}");
                let mut contents = vec![String::new(); 2];
                let mut finishes = vec![String::new(); 2];
                if stream {
                    for d in sse_data(&text).iter().filter(|d| *d != "[DONE]") {
                        let c: Value = serde_json::from_str(d).unwrap();
                        let ch = &c["choices"][0];
                        let i = ch["index"].as_u64().unwrap() as usize;
                        contents[i] += ch["delta"]["content"].as_str().unwrap_or("");
                        if let Some(f) = ch["finish_reason"].as_str() {
                            finishes[i] = f.to_string();
                        }
                    }
                } else {
                    let v: Value = serde_json::from_str(&text).unwrap();
                    for i in 0..2 {
                        let ch = &v["choices"][i];
                        contents[i] = ch["message"]["content"].as_str().unwrap().to_string();
                        finishes[i] = ch["finish_reason"].as_str().unwrap().to_string();
                        assert!(ch["message"]["reasoning_content"].is_null(), "{v}");
                    }
                }
                for (c, f) in contents.iter().zip(&finishes) {
                    let v: Value =
                        serde_json::from_str(c).unwrap_or_else(|e| panic!("not JSON ({e}): {c:?}"));
                    assert!(v.is_object(), "{c}");
                    if k == 0 {
                        assert!(matches_schema(&v, &schema), "{c}");
                    }
                    assert_eq!(f, "stop", "{c}");
                }
            }
        }
    }
    // A forced tool call and a JSON format together are refused.
    let tools =
        json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    let body = chat(json!({"tools": tools, "tool_choice": "required",
        "response_format": {"type": "json_object"}}));
    let (s, v) = send_json(&app, post("/v1/chat/completions", &body)).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_error(&v, "invalid_request_error", Some("response_format"));
}

#[tokio::test]
async fn thinking_on_makes_the_output_reasoning_as_the_glm5_template_opens_think() {
    let (app, _) = default_server();
    // The random model never writes </think>: with thinking on (the default) all of its
    // output is reasoning; with thinking off, all of it is content.
    let (s, v) = send_json(
        &app,
        post("/v1/chat/completions", &chat(json!({"seed": 1}))),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let m = &v["choices"][0]["message"];
    assert!(
        m["reasoning_content"]
            .as_str()
            .is_some_and(|r| !r.is_empty()),
        "{v}"
    );
    let off = chat(json!({"seed": 1, "chat_template_kwargs": {"enable_thinking": false}}));
    let (_, v) = send_json(&app, post("/v1/chat/completions", &off)).await;
    let m = &v["choices"][0]["message"];
    assert!(m["reasoning_content"].is_null(), "{v}");
    assert!(m["content"].as_str().is_some_and(|c| !c.is_empty()), "{v}");
}

#[tokio::test]
async fn the_cache_budget_in_bytes_limits_sequences_and_admission() {
    use futures::StreamExt;
    let probe = default_server().1.engine().unwrap().layout;
    // Room for one sequence of 300 tokens and a bit: a 400-token request can never fit,
    // two 200-token ones cannot run together.
    let budget = probe.bytes_for(300);
    let (app, state) = server(
        EngineConfig {
            kv_cache_bytes: Some(budget),
            ..EngineConfig::default()
        },
        ApiConfig::default(),
    );
    let engine = state.engine().unwrap();
    assert_eq!(engine.config.context_length, 300);
    assert!(engine.context_limited_by_cache);
    let (s, v) = send_json(
        &app,
        post("/v1/chat/completions", &chat(json!({"max_tokens": 400}))),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert_error(&v, "invalid_request_error", Some("max_tokens"));
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("KV cache budget") && msg.contains("300 tokens"),
        "{msg}"
    );
    let (_, text) = send(&app, get("/metrics")).await;
    assert_eq!(metric(&text, "glmflash_kv_bytes_capacity") as usize, budget);
    // Two 200-token streams: the second waits for the first's bytes.
    let long = || {
        post(
            "/v1/completions",
            &json!({"prompt": "Stream", "max_tokens": 200, "ignore_eos": true, "stream": true})
                .to_string(),
        )
    };
    let a = app.clone().oneshot(long()).await.unwrap();
    let b = app.clone().oneshot(long()).await.unwrap();
    let mut a = a.into_body().into_data_stream();
    a.next().await.unwrap().unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let text = loop {
        let (_, text) = send(&app, get("/metrics")).await;
        if metric(&text, "glmflash_waiting_requests") == 1.0 {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "the second stream never waited:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    assert_eq!(metric(&text, "glmflash_running_requests"), 1.0, "{text}");
    let used = metric(&text, "glmflash_kv_bytes_used") as usize;
    let tokens = metric(&text, "glmflash_kv_tokens_used") as usize;
    assert!(
        tokens > 0 && used == probe.bytes_for(tokens),
        "{used} bytes for {tokens} tokens"
    );
    while a.next().await.is_some() {}
    let body = to_bytes(b.into_body(), usize::MAX).await.unwrap();
    assert!(String::from_utf8_lossy(&body).ends_with("data: [DONE]\n\n"));
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (_, text) = send(&app, get("/metrics")).await;
        if metric(&text, "glmflash_kv_bytes_used") == 0.0 {
            break;
        }
        assert!(Instant::now() < deadline, "cache bytes not freed:\n{text}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
