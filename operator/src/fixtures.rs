//! Test fixtures: objects as the API server would return them, and a scripted API server
//! on kube's mocked service (`tower_test::mock::pair`) that asserts each request's method,
//! path and query in order, answers it, records its body, and fails on any request the
//! script did not expect.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use glmflash_crds::{GlmFlashDeployment, RTX_3090_PRODUCT};
use http::{Request, Response, StatusCode};
use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::client::Body;
use kube::runtime::controller::Action;
use kube::runtime::events::{Recorder, Reporter};
use serde_json::{Value, json};
use tower_test::mock;

use crate::controller::{self, Context, FINALIZER};
use crate::metrics::Metrics;
use crate::scrape::Scrape;

pub const NS: &str = "ai";
pub const NAME: &str = "glm";

/// The smallest realistic object, with the defaults the API server fills in from the CRD.
pub fn gfd() -> GlmFlashDeployment {
    serde_json::from_value(json!({
        "apiVersion": "glmflash.io/v1alpha1",
        "kind": "GlmFlashDeployment",
        "metadata": {
            "name": NAME, "namespace": NS, "uid": "0b5e0c4e-uid", "generation": 1,
            "resourceVersion": "100"
        },
        "spec": {
            "model": {
                "huggingFace": {
                    "repo": "turboderp/GLM-5.3-Flash-exl3",
                    "revision": "332ab457b709b7ba30dd9a448be5de03b80a7ac9"
                }
            },
            "memory": { "limit": "55Gi" },
            "vram": { "expertSlots": 1376 }
        }
    }))
    .expect("fixture parses")
}

/// `gfd()` after the finalizer was added.
pub fn gfd_with_finalizer() -> GlmFlashDeployment {
    let mut g = gfd();
    g.metadata.finalizers = Some(vec![FINALIZER.to_string()]);
    g
}

/// A schedulable RTX 3090 node with `memory` allocatable and `gpus` GPUs.
pub fn gpu_node(name: &str, memory: &str, gpus: &str) -> Node {
    serde_json::from_value(json!({
        "metadata": {
            "name": name,
            "labels": { "nvidia.com/gpu.product": RTX_3090_PRODUCT, "kubernetes.io/hostname": name }
        },
        "spec": {},
        "status": { "allocatable": { "memory": memory, "nvidia.com/gpu": gpus, "cpu": "48" } }
    }))
    .expect("fixture parses")
}

/// A node without a GPU.
pub fn cpu_node(name: &str) -> Node {
    serde_json::from_value(json!({
        "metadata": { "name": name, "labels": { "kubernetes.io/hostname": name } },
        "spec": {},
        "status": { "allocatable": { "memory": "64Gi", "cpu": "16" } }
    }))
    .expect("fixture parses")
}

/// A List response.
pub fn list(kind: &str, items: Vec<Value>) -> Value {
    json!({ "apiVersion": "v1", "kind": kind, "metadata": { "resourceVersion": "1" }, "items": items })
}

/// How a scripted request is answered.
#[derive(Debug, Clone)]
pub enum Reply {
    /// 200 with this body.
    Json(Value),
    /// 200 echoing the request body (what an apply returns, near enough).
    Echo,
    /// 404 NotFound Status.
    NotFound,
    /// An error Status with this code.
    Error(u16),
}

/// One expected request.
#[derive(Debug, Clone)]
pub struct Step {
    method: &'static str,
    path: String,
    query: Vec<String>,
    reply: Reply,
}

impl Step {
    fn new(method: &'static str, path: impl Into<String>) -> Self {
        Self {
            method,
            path: path.into(),
            query: Vec::new(),
            reply: Reply::Echo,
        }
    }
    pub fn get(path: impl Into<String>) -> Self {
        Self::new("GET", path)
    }
    pub fn patch(path: impl Into<String>) -> Self {
        Self::new("PATCH", path)
    }
    pub fn post(path: impl Into<String>) -> Self {
        Self::new("POST", path)
    }
    pub fn delete(path: impl Into<String>) -> Self {
        Self::new("DELETE", path)
    }
    /// A server-side apply by our field manager.
    pub fn apply(path: impl Into<String>) -> Self {
        Self::patch(path)
            .query("fieldManager=glmflash-operator")
            .query("force=true")
    }
    /// The query string must contain this `key=value` (URL-decoded).
    pub fn query(mut self, pair: &str) -> Self {
        self.query.push(pair.to_string());
        self
    }
    pub fn reply(mut self, reply: Reply) -> Self {
        self.reply = reply;
        self
    }
    pub fn json(self, body: Value) -> Self {
        self.reply(Reply::Json(body))
    }
    pub fn not_found(self) -> Self {
        self.reply(Reply::NotFound)
    }
}

/// A request as it arrived.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub body: Value,
}

impl Seen {
    pub fn is_write(&self) -> bool {
        self.method != "GET"
    }
}

/// Scraper answering every URL with one page, remembering the URLs.
pub struct FixedPage {
    pub page: Result<String, String>,
    pub urls: Mutex<Vec<String>>,
}

impl Scrape for FixedPage {
    fn fetch(&self, url: String) -> futures::future::BoxFuture<'_, Result<String, String>> {
        self.urls.lock().unwrap().push(url);
        let page = self.page.clone();
        Box::pin(async move { page })
    }
}

/// The page a healthy server would expose.
pub const SERVER_PAGE: &str = "glmflash_decode_tokens_per_second 19.47\n\
glmflash_expert_lookups_total{tier=\"vram\",phase=\"decode\"} 700\n\
glmflash_expert_lookups_total{tier=\"ram\",phase=\"decode\"} 250\n\
glmflash_expert_lookups_total{tier=\"nvme\",phase=\"decode\"} 50\n";

/// The test's end of kube's mocked API service.
pub type ApiHandle = mock::Handle<Request<Body>, Response<Body>>;

/// A context on a fresh mocked API server.
pub fn context(
    page: Result<&str, &str>,
    service_monitor_api: bool,
) -> (Arc<Context>, Arc<FixedPage>, ApiHandle) {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let client = Client::new(service, NS);
    let scraper = Arc::new(FixedPage {
        page: page.map(str::to_string).map_err(str::to_string),
        urls: Mutex::new(Vec::new()),
    });
    let ctx = Context::new(
        client.clone(),
        Recorder::new(
            client,
            Reporter {
                controller: "glmflash-operator".into(),
                instance: Some("test".into()),
            },
        ),
        Arc::new(Metrics::default()),
        scraper.clone(),
        service_monitor_api,
    );
    (Arc::new(ctx), scraper, handle)
}

fn decode(s: &str) -> String {
    s.replace("%3D", "=")
        .replace("%2F", "/")
        .replace("%2C", ",")
        .replace("%21", "!")
        .replace('+', " ")
}

fn respond(reply: &Reply, body: &Value) -> Response<Body> {
    let (status, value) = match reply {
        Reply::Json(v) => (StatusCode::OK, v.clone()),
        Reply::Echo => {
            // A status apply carries only status; the API server answers with the object.
            if body.get("metadata").is_none() && body.get("status").is_some() {
                let mut object = serde_json::to_value(gfd_with_finalizer()).expect("json");
                object["status"] = body["status"].clone();
                (StatusCode::OK, object)
            } else {
                (StatusCode::OK, body.clone())
            }
        }
        Reply::NotFound => (
            StatusCode::NOT_FOUND,
            json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                   "message": "not found", "reason": "NotFound", "code": 404}),
        ),
        Reply::Error(code) => (
            StatusCode::from_u16(*code).expect("valid code"),
            json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                   "message": "injected failure", "reason": "InternalError", "code": code}),
        ),
    };
    Response::builder()
        .status(status)
        .body(Body::from(serde_json::to_vec(&value).expect("json")))
        .expect("response")
}

/// Runs one reconcile of `gfd` against the script. Panics on a request out of order or
/// not in the script, and on a script step that never came.
pub async fn run(
    ctx: Arc<Context>,
    mut handle: ApiHandle,
    gfd: GlmFlashDeployment,
    steps: Vec<Step>,
) -> (crate::Result<Action>, Vec<Seen>) {
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let mut seen = Vec::new();
        for (i, step) in steps.into_iter().enumerate() {
            let next = tokio::time::timeout(Duration::from_secs(5), handle.next_request())
                .await
                .map_err(|_| format!("step {i}: no request came for {step:?}"))?;
            let Some((request, send)) = next else {
                return Err(format!("step {i}: the reconcile ended before {step:?}"));
            };
            let method = request.method().to_string();
            let path = request.uri().path().to_string();
            let query = decode(request.uri().query().unwrap_or_default());
            let bytes = request.into_body().collect_bytes().await.expect("body");
            let body: Value = if bytes.is_empty() {
                Value::Null
            } else {
                serde_json::from_slice(&bytes).expect("json body")
            };
            if (method.as_str(), path.as_str()) != (step.method, step.path.as_str()) {
                return Err(format!(
                    "step {i}: expected {} {}, got {method} {path}?{query} with body {body}",
                    step.method, step.path
                ));
            }
            for pair in &step.query {
                if !query.split('&').any(|q| q == pair) {
                    return Err(format!(
                        "step {i}: {method} {path}: query {query:?} lacks {pair:?}"
                    ));
                }
            }
            send.send_response(respond(&step.reply, &body));
            seen.push(Seen { method, path, body });
        }
        tokio::select! {
            extra = handle.next_request() => {
                if let Some((request, _)) = extra {
                    return Err(format!("unexpected extra request {} {}", request.method(), request.uri()));
                }
            }
            _ = done_rx => {}
        }
        Ok(seen)
    });
    let result = tokio::time::timeout(
        Duration::from_secs(10),
        controller::reconcile(Arc::new(gfd), ctx),
    )
    .await;
    let _ = done_tx.send(());
    let seen = match server.await.expect("server task") {
        Ok(seen) => seen,
        Err(why) => panic!("{why}\nreconcile returned {result:?}"),
    };
    (result.expect("reconcile hung"), seen)
}

/// The status body of the status apply among `seen`.
pub fn status_written(seen: &[Seen]) -> Option<glmflash_crds::GlmFlashDeploymentStatus> {
    seen.iter()
        .find(|s| s.method == "PATCH" && s.path.ends_with("/status"))
        .map(|s| serde_json::from_value(s.body["status"].clone()).expect("status parses"))
}

/// Answers whatever the reconciler asks like an empty cluster with one free RTX 3090 node
/// would, recording every request: for property tests, where no script can be written.
pub async fn run_auto(
    ctx: Arc<Context>,
    mut handle: ApiHandle,
    gfd: GlmFlashDeployment,
) -> (crate::Result<Action>, Vec<Seen>) {
    let (done_tx, mut done_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let mut seen = Vec::new();
        loop {
            let next = tokio::select! {
                next = handle.next_request() => next,
                _ = &mut done_rx => break,
            };
            let Some((request, send)) = next else { break };
            let method = request.method().to_string();
            let path = request.uri().path().to_string();
            let bytes = request.into_body().collect_bytes().await.expect("body");
            let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            let reply = match (method.as_str(), path.as_str()) {
                ("GET", "/api/v1/nodes") => Reply::Json(list(
                    "NodeList",
                    vec![serde_json::to_value(gpu_node("gpu-a", "251Gi", "1")).unwrap()],
                )),
                ("GET", p)
                    if ["/pods", "/jobs", "/events", "/glmflashdeployments"]
                        .iter()
                        .any(|end| p.ends_with(end)) =>
                {
                    Reply::Json(list("List", vec![]))
                }
                ("GET", _) => Reply::NotFound,
                _ => Reply::Echo,
            };
            send.send_response(respond(&reply, &body));
            seen.push(Seen { method, path, body });
        }
        seen
    });
    let result = tokio::time::timeout(
        Duration::from_secs(10),
        controller::reconcile(Arc::new(gfd), ctx),
    )
    .await;
    let _ = done_tx.send(());
    let seen = match server.await {
        Ok(seen) => seen,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    };
    (result.expect("reconcile hung"), seen)
}
