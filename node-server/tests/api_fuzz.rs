//! Property test of the request path: any body (random JSON in every field, or random bytes)
//! gets a well-formed answer: 200 or an OpenAI-shaped 4xx, never a 5xx or a panic, and the
//! server keeps answering afterwards.

use axum::Router;
use axum::body::{Body, to_bytes};
use axum::http::{Request, StatusCode};
use glmflash_node::api::server::load_engine;
use glmflash_node::api::{ApiConfig, AppState, app};
use glmflash_node::engine::scheduler::EngineConfig;
use glmflash_node::metrics::Metrics;
use proptest::prelude::*;
use serde_json::{Map, Value, json};
use std::sync::{Arc, OnceLock};
use tower::ServiceExt;

fn router() -> &'static (Router, tokio::runtime::Runtime, tempfile::TempDir) {
    static APP: OnceLock<(Router, tokio::runtime::Runtime, tempfile::TempDir)> = OnceLock::new();
    APP.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        glmflash_node::demo::make_demo_model(dir.path(), glmflash_node::demo::DEFAULT_SEED)
            .unwrap();
        let metrics = Arc::new(Metrics::new());
        let state = AppState::new(
            ApiConfig {
                max_body_bytes: 64 << 10,
                ..ApiConfig::default()
            },
            metrics.clone(),
        );
        // A short context bounds every generation (max_tokens defaults to the rest of it).
        let engine = load_engine(
            dir.path(),
            EngineConfig {
                context_length: 48,
                max_waiting: 64,
                ..EngineConfig::default()
            },
            metrics,
        )
        .unwrap();
        state.set_engine(Arc::new(engine));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        (app(state), rt, dir)
    })
}

fn send(path: &str, body: Vec<u8>) -> (StatusCode, Vec<u8>) {
    let (app, rt, _) = router();
    rt.block_on(async {
        let req = Request::post(path)
            .header("content-type", "application/json")
            .body(Body::from(body))
            .unwrap();
        let resp = app.clone().oneshot(req).await.unwrap();
        let status = resp.status();
        (
            status,
            to_bytes(resp.into_body(), usize::MAX)
                .await
                .unwrap()
                .to_vec(),
        )
    })
}

fn check(status: StatusCode, body: &[u8], sent: &str) {
    assert!(
        [200, 400, 404, 413, 429].contains(&status.as_u16()),
        "{status} for {sent}: {}",
        String::from_utf8_lossy(body)
    );
    if status != StatusCode::OK {
        let v: Value = serde_json::from_slice(body).expect("error bodies are JSON");
        let e = &v["error"];
        assert!(e["message"].is_string() && e["type"].is_string(), "{v}");
        assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
    }
}

fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|i| json!(i)),
        (-3i64..40).prop_map(|i| json!(i)),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        (-3.0f64..3.0).prop_map(|f| json!(f)),
        ".{0,12}".prop_map(Value::String),
        prop_oneof![
            Just("user"),
            Just("system"),
            Just("tool"),
            Just("assistant"),
            Just("auto"),
            Just("glm-5.3-flash"),
            Just("<think>"),
            Just("</tool_call>")
        ]
        .prop_map(|s| json!(s)),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec((".{0,6}", inner), 0..4)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

const FIELDS: [&str; 23] = [
    "model",
    "messages",
    "tools",
    "tool_choice",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "stop",
    "logprobs",
    "top_logprobs",
    "chat_template_kwargs",
    "prompt",
    "response_format",
];

fn mutated_request() -> impl Strategy<Value = Value> {
    prop::collection::vec((0..FIELDS.len(), any_json()), 1..4).prop_map(|changes| {
        let mut body = json!({
            "model": "glm-5.3-flash",
            "messages": [{"role": "user", "content": "Hi"}],
            "prompt": "Hi",
            "max_tokens": 4,
        });
        for (f, v) in changes {
            body[FIELDS[f]] = v;
        }
        body
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn any_field_value_gets_a_well_formed_answer(body in mutated_request(), chat in any::<bool>()) {
        let path = if chat { "/v1/chat/completions" } else { "/v1/completions" };
        let text = body.to_string();
        let (status, out) = send(path, text.clone().into_bytes());
        check(status, &out, &text);
    }

    /// Any schema, valid or not, compiles to a grammar or gets a 400; tool parameter
    /// schemas likewise under a forced tool call.
    #[test]
    fn any_schema_gets_a_well_formed_answer(schema in any_json(), props in any_json(), strict in any::<bool>()) {
        let body = json!({
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 6,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": strict}},
        });
        let text = body.to_string();
        let (status, out) = send("/v1/chat/completions", text.clone().into_bytes());
        check(status, &out, &text);
        let body = json!({
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 6,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": props}}}],
            "tool_choice": "required",
        });
        let text = body.to_string();
        let (status, out) = send("/v1/chat/completions", text.clone().into_bytes());
        check(status, &out, &text);
    }

    #[test]
    fn any_bytes_get_a_well_formed_answer(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        let (status, out) = send("/v1/chat/completions", bytes.clone());
        check(status, &out, &String::from_utf8_lossy(&bytes));
    }
}

#[test]
fn still_serving_after_fuzzing() {
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2});
    let (status, out) = send("/v1/chat/completions", body.to_string().into_bytes());
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&out));
}
