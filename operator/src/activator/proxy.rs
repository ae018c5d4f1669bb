//! The proxy itself: hold a request until a replica is ready (waking the deployment),
//! pick the replica, forward, and stream the answer back; OpenAI-shaped errors otherwise.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use glmflash_crds::HIBERNATE_ANNOTATION;
use http_body_util::Full;
use kube::api::{Patch, PatchParams};
use prometheus::{Encoder, IntCounter, IntCounterVec, Opts, Registry, TextEncoder};
use tokio::time::Instant;
use tracing::{info, warn};

use super::{Activator, Backends, Object, WAKE_REPEAT, rendezvous};

/// Header naming a session: requests that carry the same value go to the same replica.
pub const SESSION_HEADER: &str = "x-session-id";

/// Replicas one request is tried on: a replica that refuses the connection, drops it before
/// answering, or answers 503 (draining for a shutdown) sends the request to the next one.
pub const MAX_ATTEMPTS: usize = 3;

/// The activator's own metrics.
pub struct ActivatorMetrics {
    registry: Registry,
    /// Requests by outcome (`forwarded`, `unavailable`, `too_large`, `upstream_error`), and
    /// `retried`: attempts sent on to another replica.
    requests: IntCounterVec,
    /// Wake patches sent.
    wakes: IntCounter,
    /// Unix time of the last request, in seconds.
    last_request: prometheus::Gauge,
}

impl Default for ActivatorMetrics {
    fn default() -> Self {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new(
                "glmflash_activator_requests_total",
                "Requests by outcome: forwarded, unavailable, too_large, upstream_error; \
                 retried counts attempts sent on to another replica.",
            ),
            &["outcome"],
        )
        .expect("valid metric");
        let wakes = IntCounter::new(
            "glmflash_activator_wakes_total",
            "Wake patches sent to a hibernated deployment.",
        )
        .expect("valid metric");
        let last_request = prometheus::Gauge::new(
            "glmflash_activator_last_request_timestamp_seconds",
            "Unix time of the last request the activator received.",
        )
        .expect("valid metric");
        for outcome in OUTCOMES {
            requests.with_label_values(&[outcome]);
        }
        registry
            .register(Box::new(requests.clone()))
            .expect("unique metric");
        registry
            .register(Box::new(wakes.clone()))
            .expect("unique metric");
        registry
            .register(Box::new(last_request.clone()))
            .expect("unique metric");
        Self {
            registry,
            requests,
            wakes,
            last_request,
        }
    }
}

const OUTCOMES: [&str; 5] = [
    "forwarded",
    "unavailable",
    "too_large",
    "upstream_error",
    "retried",
];

impl ActivatorMetrics {
    fn render(&self) -> String {
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("text encoding");
        String::from_utf8(out).expect("utf-8 metrics")
    }

    fn count(&self, outcome: &'static str) {
        self.requests.with_label_values(&[outcome]).inc();
    }
}

/// The proxy router: `/metrics` and `/healthz` are the activator's, every other path is
/// forwarded.
pub fn app(activator: Arc<Activator>) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(|State(a): State<Arc<Activator>>| async move {
                (
                    [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                    a.metrics.render(),
                )
            }),
        )
        .route("/healthz", get(|| async { "ok" }))
        .fallback(forward)
        .with_state(activator)
}

/// An error answered in the OpenAI shape, `{"error": {"message", "type", "code"}}`.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    code: &'static str,
}

impl ApiError {
    fn unavailable(code: &'static str, message: String) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message,
            kind: "service_unavailable",
            code,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({
            "error": {"message": self.message, "type": self.kind, "code": self.code}
        });
        let mut response = (self.status, axum::Json(body)).into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("30"));
        }
        response
    }
}

/// Hop-by-hop headers (RFC 9110 7.6.1) and the ones the client recomputes.
const NOT_FORWARDED: [&str; 10] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
];

fn strip(headers: &mut HeaderMap) {
    for name in NOT_FORWARDED {
        headers.remove(name);
    }
}

/// The session a request belongs to: its `x-session-id` header, else the `user` field of a
/// JSON body.
fn session_key(headers: &HeaderMap, body: &[u8]) -> Option<String> {
    if let Some(id) = headers
        .get(SESSION_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty())
    {
        return Some(id.to_string());
    }
    #[derive(serde::Deserialize)]
    struct WithUser {
        user: Option<String>,
    }
    serde_json::from_slice::<WithUser>(body)
        .ok()?
        .user
        .filter(|u| !u.is_empty())
}

async fn forward(State(a): State<Arc<Activator>>, request: Request) -> Response {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    a.metrics.last_request.set(now);
    let (mut parts, body) = request.into_parts();
    let Ok(body) = axum::body::to_bytes(body, a.max_body).await else {
        a.metrics.count("too_large");
        return ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!("the request body exceeds {} bytes", a.max_body),
            kind: "invalid_request_error",
            code: "request_too_large",
        }
        .into_response();
    };
    let session = session_key(&parts.headers, &body);
    let wakes = parts.uri.path().starts_with("/v1/");
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    strip(&mut parts.headers);
    // The body is whole in memory, so a request no replica took can go to another one.
    let deadline = Instant::now() + a.wake_timeout;
    let mut tried: Vec<SocketAddr> = Vec::new();
    loop {
        let target = match a
            .ready_replica(session.as_deref(), wakes, &tried, deadline)
            .await
        {
            Ok(target) => target,
            Err(error) => {
                a.metrics.count("unavailable");
                return error.into_response();
            }
        };
        let last = tried.len() + 1 == MAX_ATTEMPTS;
        let uri = match format!("http://{target}{path}").parse() {
            Ok(uri) => uri,
            Err(e) => {
                warn!(%target, %path, error = %e, "cannot form the upstream address");
                a.metrics.count("upstream_error");
                return bad_gateway(target);
            }
        };
        let mut attempt = hyper::Request::new(Full::new(body.clone()));
        *attempt.method_mut() = parts.method.clone();
        *attempt.uri_mut() = uri;
        *attempt.version_mut() = parts.version;
        *attempt.headers_mut() = parts.headers.clone();
        match a.upstream.request(attempt).await {
            Ok(response) if response.status() == StatusCode::SERVICE_UNAVAILABLE && !last => {
                info!(%target, "the replica is unavailable (draining); trying another");
                a.metrics.count("retried");
                tried.push(target);
            }
            Ok(response) => {
                a.metrics.count("forwarded");
                let (mut parts, body) = response.into_parts();
                strip(&mut parts.headers);
                return Response::from_parts(parts, Body::new(body));
            }
            Err(e) if !last => {
                warn!(%target, error = %e, "upstream request failed; trying another replica");
                a.metrics.count("retried");
                tried.push(target);
            }
            Err(e) => {
                warn!(%target, error = %e, "upstream request failed");
                a.metrics.count("upstream_error");
                return bad_gateway(target);
            }
        }
    }
}

fn bad_gateway(target: SocketAddr) -> Response {
    ApiError {
        status: StatusCode::BAD_GATEWAY,
        message: format!("the server replica at {target} did not answer"),
        kind: "upstream_error",
        code: "upstream_unreachable",
    }
    .into_response()
}

impl Activator {
    /// A ready replica for the request other than those it was `tried` on, waiting (and
    /// waking a hibernated deployment, for an API request, `wakes`) until `deadline`.
    async fn ready_replica(
        &self,
        session: Option<&str>,
        wakes: bool,
        tried: &[SocketAddr],
        deadline: Instant,
    ) -> Result<SocketAddr, ApiError> {
        let mut backends = self.backends.clone();
        loop {
            let mut now = backends.borrow_and_update().clone();
            now.ready.retain(|_, addr| !tried.contains(addr));
            if let Some(target) = self.choose(&now, session) {
                return Ok(target);
            }
            match now.object {
                Object::Missing => {
                    return Err(ApiError::unavailable(
                        "deployment_not_found",
                        format!("GlmFlashDeployment {} does not exist", self.name),
                    ));
                }
                Object::HibernatedBySpec => {
                    return Err(ApiError::unavailable(
                        "hibernated",
                        format!(
                            "GlmFlashDeployment {} is hibernated by spec.hibernate; only its \
                             owner wakes it",
                            self.name
                        ),
                    ));
                }
                _ if !wakes => {
                    return Err(ApiError::unavailable(
                        "no_ready_replica",
                        format!("no replica of {} is ready", self.name),
                    ));
                }
                Object::HibernatedByAnnotation => self.wake().await,
                Object::Unknown | Object::Awake => {}
            }
            let waited = tokio::select! {
                changed = backends.changed() => changed.is_ok(),
                () = tokio::time::sleep_until(deadline) => false,
            };
            if !waited {
                return Err(ApiError::unavailable(
                    "wake_timeout",
                    format!(
                        "no replica of {} became ready within {:?}; retry later",
                        self.name, self.wake_timeout
                    ),
                ));
            }
        }
    }

    fn choose(&self, backends: &Backends, session: Option<&str>) -> Option<SocketAddr> {
        if backends.ready.is_empty() {
            return None;
        }
        let index = match session {
            Some(key) => rendezvous(key, backends.ready.keys().copied())?,
            None => {
                let n = self.next.fetch_add(1, Ordering::Relaxed) % backends.ready.len();
                *backends.ready.keys().nth(n)?
            }
        };
        backends.ready.get(&index).copied()
    }

    /// Removes the hibernate annotation, unless a wake was sent within [`WAKE_REPEAT`]. A
    /// failed patch is logged and the next request tries again; the ones that came keep
    /// waiting.
    async fn wake(&self) {
        {
            let mut last = self.last_wake.lock().await;
            if last.is_some_and(|t| t.elapsed() < WAKE_REPEAT) {
                return;
            }
            *last = Some(Instant::now());
        }
        let patch = serde_json::json!({"metadata": {"annotations": {HIBERNATE_ANNOTATION: null}}});
        match self
            .gfds
            .patch(&self.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {
                self.metrics.wakes.inc();
                info!(deployment = %self.name, "woke the hibernated deployment");
            }
            Err(e) => {
                warn!(deployment = %self.name, error = %e, "wake patch failed");
                *self.last_wake.lock().await = None;
            }
        }
    }
}
