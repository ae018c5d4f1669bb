//! Forced tool calls whose arguments obey each parameter's JSON Schema (enum, const,
//! pattern, lengths, ranges, nested objects and arrays), written in GLM's format (strings
//! raw, the rest JSON) and read back into OpenAI `tool_calls` with their types; schemas the
//! grammar cannot hold the output to are refused with a 400 naming the field.

mod common;

use axum::Router;
use axum::body::{Body, to_bytes};
use axum::http::{Request, StatusCode};
use glmflash_node::api::ApiConfig;
use glmflash_node::engine::scheduler::EngineConfig;
use serde_json::{Value, json};
use tower::ServiceExt;

fn server() -> Router {
    common::server(EngineConfig::default(), ApiConfig::default()).0
}

async fn send(app: &Router, body: &Value) -> (StatusCode, String) {
    let req = Request::post("/v1/chat/completions")
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let body = to_bytes(resp.into_body(), usize::MAX).await.unwrap();
    (status, String::from_utf8(body.to_vec()).unwrap())
}

fn tools(parameters: Value, strict: bool) -> Value {
    json!([{"type": "function", "function": {"name": "book", "strict": strict,
        "parameters": parameters}}])
}

fn weather_parameters() -> Value {
    json!({"type": "object", "properties": {
        "city": {"enum": ["Oslo", "Paris"]},
        "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "note": {"type": "string", "maxLength": 5},
        "tag": {"type": "string", "pattern": "x-\\d+", "maxLength": 8},
        "unit": {"const": "c"},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "opts": {"type": "object", "properties": {"metric": {"type": "boolean"},
                 "level": {"enum": [1, 2]}},
                 "required": ["metric", "level"], "additionalProperties": false},
        "stops": {"type": "array", "items": {"$ref": "#/$defs/stop"}, "minItems": 1,
                  "maxItems": 2}},
        "required": ["city", "code", "note", "tag", "unit", "days", "opts", "stops"],
        "additionalProperties": false,
        "$defs": {"stop": {"type": "string", "enum": ["A", "B"]}}})
}

/// The call's name, arguments and finish reason, from a whole response or a stream.
fn call_of(text: &str, stream: bool) -> (String, String, String) {
    if !stream {
        let v: Value = serde_json::from_str(text).unwrap();
        let call = &v["choices"][0]["message"]["tool_calls"][0]["function"];
        return (
            call["name"].as_str().unwrap_or_default().to_string(),
            call["arguments"].as_str().unwrap_or_default().to_string(),
            v["choices"][0]["finish_reason"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        );
    }
    let (mut name, mut args, mut finish) = (String::new(), String::new(), String::new());
    for d in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if d == "[DONE]" {
            continue;
        }
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
}

#[tokio::test]
async fn forced_tool_call_arguments_obey_every_schema_keyword() {
    let app = server();
    let tools = tools(weather_parameters(), true);
    for seed in 0..4 {
        for stream in [false, true] {
            // A small budget: constrained values end quickly; free text ran it out.
            let body = json!({"messages": [{"role": "user", "content": "Book it."}],
                "tools": tools, "tool_choice": "required", "max_tokens": 120, "seed": seed,
                "temperature": 1.0, "stream": stream});
            let (s, text) = send(&app, &body).await;
            assert_eq!(s, StatusCode::OK, "{text}");
            let (name, args, finish) = call_of(&text, stream);
            assert_eq!(
                (name.as_str(), finish.as_str()),
                ("book", "tool_calls"),
                "{text}"
            );
            let a: Value =
                serde_json::from_str(&args).unwrap_or_else(|e| panic!("{e}: {args:?}\n{text}"));
            let why = format!("seed {seed} stream {stream}: {a}");
            assert_eq!(a.as_object().unwrap().len(), 8, "{why}");
            assert!(a["city"] == "Oslo" || a["city"] == "Paris", "{why}");
            let code = a["code"].as_str().unwrap();
            assert!(
                code.len() == 3 && code.chars().all(|c| c.is_ascii_uppercase()),
                "{why}"
            );
            assert!(a["note"].as_str().unwrap().chars().count() <= 5, "{why}");
            let tag = a["tag"].as_str().unwrap();
            assert!(tag.chars().count() <= 8, "{why}");
            assert!(
                tag.match_indices("x-")
                    .any(|(i, _)| tag[i + 2..].starts_with(|c: char| c.is_ascii_digit())),
                "{why}"
            );
            assert_eq!(a["unit"], "c", "{why}");
            assert!((1..=7).contains(&a["days"].as_i64().unwrap()), "{why}");
            assert!(a["opts"]["metric"].is_boolean(), "{why}");
            assert!(a["opts"]["level"] == 1 || a["opts"]["level"] == 2, "{why}");
            assert_eq!(a["opts"].as_object().unwrap().len(), 2, "{why}");
            let stops = a["stops"].as_array().unwrap();
            assert!((1..=2).contains(&stops.len()), "{why}");
            assert!(stops.iter().all(|s| s == "A" || s == "B"), "{why}");
        }
    }
}

/// A string argument whose text reads as a number or a boolean stays a string; one that
/// may only be empty is.
#[tokio::test]
async fn string_arguments_stay_strings() {
    let app = server();
    let params = json!({"type": "object", "properties": {
        "zip": {"type": "string", "pattern": "^[0-9]{4}$"}, "flag": {"enum": ["true", "false"]},
        "blank": {"type": "string", "maxLength": 0}},
        "required": ["zip", "flag", "blank"]});
    for seed in 0..3 {
        let body = json!({"messages": [{"role": "user", "content": "Zip?"}],
            "tools": tools(params.clone(), false), "tool_choice": "required", "max_tokens": 60,
            "seed": seed});
        let (s, text) = send(&app, &body).await;
        assert_eq!(s, StatusCode::OK, "{text}");
        let (_, args, _) = call_of(&text, false);
        let a: Value = serde_json::from_str(&args).unwrap();
        let zip = a["zip"].as_str().unwrap_or_else(|| panic!("{a}"));
        assert!(
            zip.len() == 4 && zip.chars().all(|c| c.is_ascii_digit()),
            "{a}"
        );
        assert!(a["flag"] == "true" || a["flag"] == "false", "{a}");
        assert_eq!(a["blank"], "", "{a}");
    }
}

#[tokio::test]
async fn schemas_the_grammar_cannot_enforce_get_a_400_naming_the_field() {
    let app = server();
    let bad = |params: Value, strict: bool, choice: Value| {
        json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
               "tools": tools(params, strict), "tool_choice": choice})
    };
    let cases = [
        (
            json!({"type": "object", "properties": {"city": {"type": "string", "pattern": "(unclosed"}}}),
            false,
            json!("auto"),
            "tools[0].function.parameters.properties.city.pattern",
        ),
        (
            json!({"type": "object", "properties": {"deep": {"type": "object", "properties":
                {"x": {"type": "string", "pattern": "a(?=b)"}}}}}),
            false,
            json!("required"),
            "tools[0].function.parameters.properties.deep.properties.x.pattern",
        ),
        (
            json!({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": true}}}),
            true,
            json!("required"),
            "tools[0].function.parameters.properties.tags.uniqueItems",
        ),
        (
            json!({"type": "object", "properties": {"when": {"type": "string", "format": "date"}}}),
            true,
            json!("required"),
            "tools[0].function.parameters.properties.when.format",
        ),
        (
            json!({"type": "object", "properties": {"n": {"type": "string", "minLength": 4, "maxLength": 2}}}),
            false,
            json!("required"),
            "tools[0].function.parameters.properties.n.minLength",
        ),
    ];
    for (params, strict, choice, field) in cases {
        let (s, text) = send(&app, &bad(params, strict, choice)).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{field}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        assert_eq!(v["error"]["param"], field, "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(field),
            "{v}"
        );
    }
    // Without `strict`, a keyword the grammar cannot enforce is ignored.
    let lenient = json!({"type": "object", "properties": {"tags": {"type": "array",
        "items": {"type": "integer"}, "maxItems": 2, "uniqueItems": true}}, "required": ["tags"]});
    let (s, text) = send(&app, &bad(lenient, false, json!("required"))).await;
    assert_eq!(s, StatusCode::OK, "{text}");
}
