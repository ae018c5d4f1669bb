//! The activator over real sockets: fake upstream replicas (axum on localhost) behind it,
//! a client in front, the backends set by the test as the watches would, and the kube API
//! mocked (`tower_test`) so the wake patch is checked exactly.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, Request, Response, StatusCode};
use axum::routing::post;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kube::Api;
use serde_json::{Value, json};
use tokio::sync::{Notify, watch as channel};
use tower_test::mock;

use super::*;

type ApiHandle = mock::Handle<Request<kube::client::Body>, Response<kube::client::Body>>;
type Client = HttpClient<HttpConnector, Full<Bytes>>;

const GFD: &str = "/apis/glmflash.io/v1alpha1/namespaces/ai/glmflashdeployments/glm";

/// A fake server replica: `/v1/chat/completions` answers which replica it is and what it
/// got; `/v1/stream` sends one event, waits for `gate`, then sends the second.
async fn replica(id: u32, gate: Arc<Notify>) -> SocketAddr {
    async fn chat(State(id): State<u32>, headers: HeaderMap, body: String) -> axum::Json<Value> {
        let session = headers
            .get(SESSION_HEADER)
            .map(|v| v.to_str().unwrap().to_string());
        axum::Json(json!({"replica": id, "body": body, "session": session}))
    }
    let stream = move || {
        let gate = gate.clone();
        async move {
            let events = futures::stream::unfold(0, move |step| {
                let gate = gate.clone();
                async move {
                    let event = match step {
                        0 => "data: one\n\n",
                        1 => {
                            gate.notified().await;
                            "data: two\n\n"
                        }
                        _ => return None,
                    };
                    Some((Ok::<_, Infallible>(Bytes::from(event)), step + 1))
                }
            });
            (
                [("content-type", "text/event-stream")],
                Body::from_stream(events),
            )
        }
    };
    let app = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/stream", post(stream))
        .with_state(id);
    serve(app).await
}

async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// The client's side of the activator.
#[derive(Clone)]
struct Front {
    url: String,
    client: Client,
}

struct Harness {
    front: Front,
    backends: channel::Sender<Backends>,
    api: ApiHandle,
}

async fn harness(backends: Backends, wake_timeout: Duration) -> Harness {
    let (service, api) = mock::pair::<Request<kube::client::Body>, Response<kube::client::Body>>();
    let gfds = Api::namespaced(kube::Client::new(service, "ai"), "ai");
    let (tx, rx) = channel::channel(backends);
    let activator = Arc::new(Activator::new(rx, gfds, "glm", wake_timeout, 1024));
    let addr = serve(app(activator)).await;
    Harness {
        front: Front {
            url: format!("http://{addr}"),
            client: HttpClient::builder(TokioExecutor::new()).build_http(),
        },
        backends: tx,
        api,
    }
}

fn awake(ready: &[(u32, SocketAddr)]) -> Backends {
    Backends {
        object: Object::Awake,
        ready: ready.iter().copied().collect::<BTreeMap<_, _>>(),
    }
}

impl Front {
    async fn send(
        &self,
        path: &str,
        session: Option<&str>,
        body: &str,
    ) -> hyper::Response<hyper::body::Incoming> {
        let mut request = hyper::Request::post(format!("{}{path}", self.url))
            .header("content-type", "application/json");
        if let Some(id) = session {
            request = request.header(SESSION_HEADER, id);
        }
        let request = request
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap();
        tokio::time::timeout(Duration::from_secs(10), self.client.request(request))
            .await
            .expect("the activator answered in time")
            .unwrap()
    }

    async fn chat(&self, session: Option<&str>, body: &str) -> (StatusCode, Value) {
        let response = self.send("/v1/chat/completions", session, body).await;
        let status = response.status();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&bytes).unwrap())
    }

    async fn served_by(&self, session: &str) -> u64 {
        let (status, body) = self.chat(Some(session), "{}").await;
        assert_eq!(status, StatusCode::OK, "{body}");
        body["replica"].as_u64().unwrap()
    }

    async fn metrics(&self) -> String {
        let response = self
            .client
            .get(format!("{}/metrics", self.url).parse().unwrap())
            .await
            .unwrap();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8(bytes.to_vec()).unwrap()
    }
}

impl Harness {
    /// No kube API request came (none is due when a replica is ready).
    async fn assert_no_api_calls(&mut self) {
        let next = tokio::time::timeout(Duration::from_millis(100), self.api.next_request()).await;
        assert!(next.is_err(), "unexpected API request");
    }
}

#[tokio::test]
async fn forwards_path_headers_and_body_and_counts_the_request() {
    let r0 = replica(0, Arc::new(Notify::new())).await;
    let mut h = harness(awake(&[(0, r0)]), Duration::from_secs(5)).await;
    let (status, body) = h
        .front
        .chat(Some("conv-1"), r#"{"model":"glm-5.3-flash","messages":[]}"#)
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["replica"], 0);
    assert_eq!(body["body"], r#"{"model":"glm-5.3-flash","messages":[]}"#);
    assert_eq!(body["session"], "conv-1");
    let metrics = h.front.metrics().await;
    assert!(
        metrics.contains("glmflash_activator_requests_total{outcome=\"forwarded\"} 1"),
        "{metrics}"
    );
    let last = metrics
        .lines()
        .find_map(|l| l.strip_prefix("glmflash_activator_last_request_timestamp_seconds "))
        .unwrap()
        .parse::<f64>()
        .unwrap();
    assert!(last > 1.7e9, "{last}");
    h.assert_no_api_calls().await;
}

#[tokio::test]
async fn a_stream_passes_through_event_by_event() {
    let gate = Arc::new(Notify::new());
    let r0 = replica(0, gate.clone()).await;
    let h = harness(awake(&[(0, r0)]), Duration::from_secs(5)).await;
    let response = h.front.send("/v1/stream", None, "").await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let mut body = response.into_body();
    // The replica sends the second event only once the first came out of the activator.
    let first = tokio::time::timeout(Duration::from_secs(5), body.frame())
        .await
        .expect("the first event arrived before the stream ended")
        .unwrap()
        .unwrap();
    assert_eq!(first.into_data().unwrap(), "data: one\n\n");
    gate.notify_one();
    let rest = body.collect().await.unwrap().to_bytes();
    assert_eq!(rest, "data: two\n\n");
}

#[tokio::test]
async fn sessions_stay_on_their_replica_when_another_goes() {
    let gate = Arc::new(Notify::new());
    let (r0, r1, r2) = (
        replica(0, gate.clone()).await,
        replica(1, gate.clone()).await,
        replica(2, gate).await,
    );
    let h = harness(awake(&[(0, r0), (1, r1), (2, r2)]), Duration::from_secs(5)).await;
    let sessions: Vec<String> = (0..24).map(|i| format!("conv-{i}")).collect();
    let mut before = Vec::new();
    for s in &sessions {
        let first = h.front.served_by(s).await;
        assert_eq!(
            h.front.served_by(s).await,
            first,
            "{s} moved while nothing changed"
        );
        before.push(first);
    }
    assert!((0..3).all(|r| before.contains(&r)), "{before:?}");
    // The body's `user` field is the session when there is no header.
    let (_, by_user) = h
        .front
        .chat(None, r#"{"user":"conv-0","messages":[]}"#)
        .await;
    assert_eq!(by_user["replica"].as_u64(), Some(before[0]));

    h.backends.send(awake(&[(0, r0), (2, r2)])).unwrap();
    for (s, was) in sessions.iter().zip(&before) {
        let now = h.front.served_by(s).await;
        if *was == 1 {
            assert_ne!(now, 1);
        } else {
            assert_eq!(now, *was, "{s} moved though its replica stayed");
        }
    }
}

#[tokio::test]
async fn requests_without_a_session_take_turns() {
    let gate = Arc::new(Notify::new());
    let (r0, r1) = (replica(0, gate.clone()).await, replica(1, gate).await);
    let h = harness(awake(&[(0, r0), (1, r1)]), Duration::from_secs(5)).await;
    let mut served = Vec::new();
    for _ in 0..4 {
        let (_, body) = h.front.chat(None, "{}").await;
        served.push(body["replica"].as_u64().unwrap());
    }
    served.sort();
    assert_eq!(served, [0, 0, 1, 1]);
}

#[tokio::test]
async fn no_ready_replica_until_the_timeout_is_an_openai_503() {
    let mut h = harness(awake(&[]), Duration::from_millis(300)).await;
    let started = std::time::Instant::now();
    let response = h.front.send("/v1/chat/completions", None, "{}").await;
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(response.headers()["retry-after"], "30");
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let body: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(body["error"]["type"], "service_unavailable");
    assert_eq!(body["error"]["code"], "wake_timeout");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("within 300ms"),
        "{body}"
    );
    assert!(
        h.front
            .metrics()
            .await
            .contains("outcome=\"unavailable\"} 1")
    );
    h.assert_no_api_calls().await;
}

#[tokio::test]
async fn a_hibernated_deployment_is_woken_once_and_the_held_requests_forwarded() {
    let r0 = replica(0, Arc::new(Notify::new())).await;
    let hibernated = Backends {
        object: Object::HibernatedByAnnotation,
        ready: BTreeMap::new(),
    };
    let mut h = harness(hibernated, Duration::from_secs(10)).await;
    let held: Vec<_> = ["conv-a", "conv-b"]
        .into_iter()
        .map(|session| {
            let front = h.front.clone();
            tokio::spawn(async move { front.chat(Some(session), "{}").await })
        })
        .collect();

    let (request, respond) = tokio::time::timeout(Duration::from_secs(5), h.api.next_request())
        .await
        .expect("a wake patch came")
        .unwrap();
    assert_eq!(request.method(), "PATCH");
    assert_eq!(request.uri().path(), GFD);
    assert_eq!(
        request.headers()["content-type"],
        "application/merge-patch+json"
    );
    let body = request.into_body().collect_bytes().await.unwrap();
    let patch: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        patch,
        json!({"metadata": {"annotations": {"glmflash.io/hibernate": null}}}),
        "the annotation removed, the spec untouched"
    );
    let object = json!({
        "apiVersion": "glmflash.io/v1alpha1", "kind": "GlmFlashDeployment",
        "metadata": {"name": "glm", "namespace": "ai"},
        "spec": {"model": {"nodePath": "/m"}, "memory": {"limit": "16Gi"}}
    });
    respond.send_response(
        Response::builder()
            .body(kube::client::Body::from(
                serde_json::to_vec(&object).unwrap(),
            ))
            .unwrap(),
    );
    // The operator wakes it: awake with no server yet, then a ready replica.
    h.backends.send(awake(&[])).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(held.iter().all(|t| !t.is_finished()), "still held");
    h.backends.send(awake(&[(0, r0)])).unwrap();
    for task in held {
        let (status, body) = task.await.unwrap();
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["replica"], 0);
    }
    h.assert_no_api_calls().await;
    let metrics = h.front.metrics().await;
    assert!(
        metrics.contains("glmflash_activator_wakes_total 1"),
        "{metrics}"
    );
    assert!(metrics.contains("outcome=\"forwarded\"} 2"), "{metrics}");
}

#[tokio::test]
async fn spec_hibernation_and_probes_are_answered_at_once_without_a_wake() {
    let by_spec = Backends {
        object: Object::HibernatedBySpec,
        ready: BTreeMap::new(),
    };
    let mut h = harness(by_spec, Duration::from_secs(30)).await;
    let (status, body) = h.front.chat(None, "{}").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(body["error"]["code"], "hibernated");
    h.backends
        .send(Backends {
            object: Object::HibernatedByAnnotation,
            ready: BTreeMap::new(),
        })
        .unwrap();
    // Not an API path: a load balancer's probe must not wake the GPUs.
    let response = h.front.send("/health", None, "").await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    h.assert_no_api_calls().await;
}

#[tokio::test]
async fn a_body_over_the_limit_is_refused() {
    let r0 = replica(0, Arc::new(Notify::new())).await;
    let h = harness(awake(&[(0, r0)]), Duration::from_secs(5)).await;
    let (status, body) = h.front.chat(None, &"x".repeat(2048)).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert_eq!(body["error"]["code"], "request_too_large");
}

/// An address nothing listens on: connections are refused.
async fn dead() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    listener.local_addr().unwrap()
}

/// A replica shutting down: the server's 503 to every completion.
async fn draining() -> SocketAddr {
    let refuse = || async {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"error": {"message": "The server is shutting down.",
                "type": "server_error", "code": "service_unavailable"}})),
        )
    };
    serve(Router::new().route("/v1/chat/completions", post(refuse))).await
}

fn outcome(metrics: &str, name: &str) -> u64 {
    let prefix = format!("glmflash_activator_requests_total{{outcome=\"{name}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no {name} outcome in {metrics}"))
        .parse()
        .unwrap()
}

#[tokio::test]
async fn a_replica_that_refuses_or_drains_hands_the_request_to_the_next() {
    let live = replica(2, Arc::new(Notify::new())).await;
    let h = harness(
        awake(&[(0, dead().await), (1, draining().await), (2, live)]),
        Duration::from_secs(5),
    )
    .await;
    let sessions: Vec<String> = (0..12).map(|i| format!("conv-{i}")).collect();
    // Sessions whose first choice is replica 0 or 1, and whose second is the other one.
    let first_choices: Vec<u32> = sessions
        .iter()
        .map(|s| rendezvous(s, [0u32, 1, 2].into_iter()).unwrap())
        .collect();
    assert!(first_choices.iter().any(|&r| r != 2), "{first_choices:?}");
    for s in &sessions {
        assert_eq!(h.front.served_by(s).await, 2, "{s}");
    }
    let metrics = h.front.metrics().await;
    assert_eq!(outcome(&metrics, "forwarded"), 12);
    assert_eq!(outcome(&metrics, "upstream_error"), 0);
    let retried = outcome(&metrics, "retried");
    let at_least = first_choices.iter().filter(|&&r| r != 2).count() as u64;
    assert!(
        (at_least..=2 * at_least).contains(&retried),
        "{retried} retries for {at_least} sessions first sent to a failing replica"
    );
}

#[tokio::test]
async fn a_lone_failing_replica_holds_the_request_until_its_replacement_is_ready() {
    let h = harness(awake(&[(0, dead().await)]), Duration::from_secs(5)).await;
    let front = h.front.clone();
    let request = tokio::spawn(async move { front.served_by("conv-1").await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!request.is_finished(), "the request did not wait");
    let replacement = replica(7, Arc::new(Notify::new())).await;
    h.backends.send(awake(&[(0, replacement)])).unwrap();
    assert_eq!(request.await.unwrap(), 7);
    let metrics = h.front.metrics().await;
    assert_eq!(outcome(&metrics, "retried"), 1);
    assert_eq!(outcome(&metrics, "forwarded"), 1);
}

#[tokio::test]
async fn a_request_no_replica_takes_is_a_502_after_its_attempts() {
    let ready = [(0, dead().await), (1, dead().await), (2, dead().await)];
    let h = harness(awake(&ready), Duration::from_secs(5)).await;
    let response = h.front.send("/v1/chat/completions", None, "{}").await;
    assert_eq!(response.status(), StatusCode::BAD_GATEWAY);
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let body: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(body["error"]["code"], "upstream_unreachable");
    let metrics = h.front.metrics().await;
    assert_eq!(outcome(&metrics, "retried"), (MAX_ATTEMPTS - 1) as u64);
    assert_eq!(outcome(&metrics, "upstream_error"), 1);
    assert_eq!(outcome(&metrics, "forwarded"), 0);
}
