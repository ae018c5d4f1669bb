//! Clients that go away: a dropped stream or connection takes its sequence out of the queue
//! and the batch at once, frees its cache and is counted in
//! `glmflash_requests_cancelled_total`; it never holds a place that turns others away (429).

mod common;

use axum::Router;
use axum::body::{Body, to_bytes};
use axum::http::{Request, StatusCode};
use glmflash_node::api::ApiConfig;
use glmflash_node::engine::scheduler::EngineConfig;
use serde_json::json;
use std::io::{Read, Write};
use std::time::{Duration, Instant};
use tower::ServiceExt;

fn server(engine: EngineConfig) -> Router {
    common::server(engine, ApiConfig::default()).0
}

fn post(body: &str) -> Request<Body> {
    Request::post("/v1/chat/completions")
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap()
}

fn chat(stream: bool, max_tokens: usize) -> String {
    json!({"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": max_tokens,
           "ignore_eos": true, "stream": stream})
    .to_string()
}

async fn metrics(app: &Router) -> String {
    let resp = app
        .clone()
        .oneshot(Request::get("/metrics").body(Body::empty()).unwrap())
        .await
        .unwrap();
    String::from_utf8(
        to_bytes(resp.into_body(), usize::MAX)
            .await
            .unwrap()
            .to_vec(),
    )
    .unwrap()
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
        .parse()
        .unwrap()
}

/// Polls `/metrics` until `done` holds (30 s at most).
async fn wait_for(app: &Router, what: &str, done: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let m = metrics(app).await;
        if done(&m) {
            return m;
        }
        assert!(Instant::now() < deadline, "{what}:\n{m}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waiting sequences whose clients dropped their streams leave the queue before the next
/// request is counted against it, even while the engine is busy with a long prefill tick
/// and has not looked at the queue; the batch's own sequence, dropped, leaves too.
#[tokio::test]
async fn dropped_streams_free_their_place_in_the_queue_at_once() {
    let app = server(EngineConfig {
        max_batch_size: 1,
        max_waiting: 4,
        ..EngineConfig::default()
    });
    // A long prompt in one chunk keeps the engine in one long tick.
    let long: Vec<u32> = (0..3000).map(|i| 32 + (i % 64)).collect();
    let busy = app.clone().oneshot(
        Request::post("/v1/completions")
            .header("content-type", "application/json")
            .body(Body::from(
                json!({"prompt": long, "max_tokens": 100000, "ignore_eos": true, "stream": true})
                    .to_string(),
            ))
            .unwrap(),
    );
    let busy = busy.await.unwrap();
    assert_eq!(busy.status(), StatusCode::OK);
    wait_for(&app, "the long prompt was not admitted", |m| {
        metric(m, "glmflash_running_requests") == 1.0
    })
    .await;
    for round in 0..3 {
        let mut held = Vec::new();
        for _ in 0..4 {
            let resp = app
                .clone()
                .oneshot(post(&chat(true, 100000)))
                .await
                .unwrap();
            assert_eq!(resp.status(), StatusCode::OK, "round {round}");
            held.push(resp);
        }
        // The queue is full now; the clients go away and others come at once.
        drop(held);
    }
    let m = metrics(&app).await;
    assert!(
        metric(&m, "glmflash_requests_cancelled_total") >= 8.0,
        "{m}"
    );
    assert!(metric(&m, "glmflash_waiting_requests") <= 4.0, "{m}");
    // The running stream, dropped, leaves the batch and frees its cache.
    drop(busy);
    let m = wait_for(&app, "the dropped sequences were not all freed", |m| {
        metric(m, "glmflash_running_requests") == 0.0
            && metric(m, "glmflash_waiting_requests") == 0.0
            && metric(m, "glmflash_kv_bytes_used") == 0.0
            && metric(m, "glmflash_requests_cancelled_total") == 13.0
    })
    .await;
    assert!(
        !m.contains(r#"status="429""#),
        "a client was turned away:\n{m}"
    );
}

/// Sends `body` over a real socket and reads until `until` appears in what came back.
fn open(addr: std::net::SocketAddr, body: &str, until: &str) -> std::net::TcpStream {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains(until) {
        let n = s.read(&mut buf).unwrap();
        let text = String::from_utf8_lossy(&got);
        assert!(n > 0, "closed early: {text}");
        got.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&got);
        assert!(
            text.len() < 12 || text.starts_with("HTTP/1.1 200"),
            "refused: {text}"
        );
    }
    s
}

/// `count` streams opened over sockets, each read to its first chunk.
async fn open_streams(addr: std::net::SocketAddr, count: usize) -> Vec<std::net::TcpStream> {
    tokio::task::spawn_blocking(move || {
        (0..count)
            .map(|_| open(addr, &chat(true, 100000), "data: "))
            .collect()
    })
    .await
    .unwrap()
}

/// Closed connections over a real socket (what a client that goes away does): streams
/// closed after their first bytes, and a non-streaming request closed while it runs,
/// leave the batch and the queue, and the next clients are all served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_connections_cancel_streams_and_whole_responses() {
    let app = server(EngineConfig {
        max_batch_size: 2,
        max_waiting: 6,
        ..EngineConfig::default()
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let served = app.clone();
    tokio::spawn(async move { axum::serve(listener, served).await.unwrap() });

    // Eight streams (two run, six wait) read to their first chunk, then closed.
    let mut socks = open_streams(addr, 2).await;
    wait_for(&app, "two running", |m| {
        metric(m, "glmflash_running_requests") == 2.0
    })
    .await;
    socks.extend(open_streams(addr, 6).await);
    wait_for(&app, "two running, six waiting", |m| {
        metric(m, "glmflash_running_requests") == 2.0
            && metric(m, "glmflash_waiting_requests") == 6.0
    })
    .await;
    drop(socks);
    wait_for(&app, "closed streams not cancelled", |m| {
        metric(m, "glmflash_requests_cancelled_total") == 8.0
            && metric(m, "glmflash_running_requests") == 0.0
            && metric(m, "glmflash_waiting_requests") == 0.0
            && metric(m, "glmflash_kv_bytes_used") == 0.0
    })
    .await;

    // A non-streaming request whose client goes away while it decodes.
    let sock = tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        let body = chat(false, 100000);
        write!(
            s,
            "POST /v1/chat/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        s
    })
    .await
    .unwrap();
    wait_for(&app, "the whole-response request never ran", |m| {
        metric(m, "glmflash_running_requests") == 1.0 && metric(m, "glmflash_kv_tokens_used") > 0.0
    })
    .await;
    drop(sock);
    wait_for(
        &app,
        "the closed whole-response request was not cancelled",
        |m| {
            metric(m, "glmflash_requests_cancelled_total") == 9.0
                && metric(m, "glmflash_running_requests") == 0.0
                && metric(m, "glmflash_kv_bytes_used") == 0.0
        },
    )
    .await;

    // Everyone after is served: the batch and the queue are whole again.
    tokio::task::spawn_blocking(move || {
        for _ in 0..8 {
            open(addr, &chat(true, 4), "data: [DONE]");
        }
    })
    .await
    .unwrap();
}
