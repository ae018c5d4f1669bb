//! The OpenAI-compatible HTTP API (axum): `/v1/models`, `/v1/chat/completions`,
//! `/v1/completions` (SSE streaming or not), `/health`, `/ready`, `/metrics`.
//!
//! [`app`] builds the router from an [`AppState`], so tests drive it with
//! `tower::ServiceExt::oneshot` and no socket; [`server`] binds it with graceful shutdown.
//!
//! A completion goes through `request` (the body and its validation), `grammar`
//! (`response_format` and forced tool calls as a constraint), `handlers` (the endpoints),
//! then `stream` (SSE) or `response` (one JSON object); [`parse`] splits chat output into
//! reasoning, content and tool calls, and [`error`] gives every failure OpenAI's shape.

pub mod error;
mod grammar;
mod handlers;
pub mod parse;
mod request;
mod response;
pub mod server;
mod stream;

use crate::engine::scheduler::Engine;
use crate::metrics::Metrics;
use axum::Router;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::header;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
pub use error::{ApiError, ApiJson};
use std::sync::{Arc, Mutex, OnceLock};

#[derive(Clone, Debug)]
pub struct ApiConfig {
    /// The model id clients name (`--served-model-name`).
    pub model_id: String,
    /// Accepted API keys; empty: no auth.
    pub api_keys: Vec<String>,
    /// Whether `/metrics` needs a key too when keys are set.
    pub protect_metrics: bool,
    pub max_body_bytes: usize,
}

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig {
            model_id: "glm-5.3-flash".into(),
            api_keys: Vec::new(),
            protect_metrics: false,
            max_body_bytes: 32 << 20,
        }
    }
}

pub struct Inner {
    pub config: ApiConfig,
    pub metrics: Arc<Metrics>,
    engine: OnceLock<Arc<Engine>>,
    load_error: Mutex<Option<String>>,
    pub created: u64,
}

/// What every handler shares: the engine once loaded (503 before), config and metrics.
#[derive(Clone)]
pub struct AppState(pub Arc<Inner>);

impl AppState {
    pub fn new(config: ApiConfig, metrics: Arc<Metrics>) -> AppState {
        AppState(Arc::new(Inner {
            config,
            metrics,
            engine: OnceLock::new(),
            load_error: Mutex::new(None),
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        }))
    }

    /// Marks the model loaded: requests are served from now on.
    pub fn set_engine(&self, engine: Arc<Engine>) {
        let _ = self.0.engine.set(engine);
        self.0.metrics.ready.set(1);
    }

    pub fn set_load_error(&self, error: String) {
        *self.0.load_error.lock().unwrap_or_else(|e| e.into_inner()) = Some(error);
    }

    pub fn engine(&self) -> Option<&Arc<Engine>> {
        self.0.engine.get()
    }

    /// The engine, or 503 while loading (or when loading failed).
    pub fn ready_engine(&self) -> Result<&Arc<Engine>, ApiError> {
        self.engine().ok_or_else(|| {
            match self
                .0
                .load_error
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
            {
                Some(e) => ApiError::unavailable(format!("The model failed to load: {e}")),
                None => ApiError::unavailable("The model is still loading. Retry shortly."),
            }
        })
    }
}

/// The whole API.
pub fn app(state: AppState) -> Router {
    let limit = state.0.config.max_body_bytes;
    let v1 = Router::new()
        .route("/v1/models", get(handlers::list_models))
        .route("/v1/models/{model}", get(handlers::get_model))
        .route("/v1/chat/completions", post(handlers::chat_completions))
        .route("/v1/completions", post(handlers::completions))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_key));
    let metrics_route = if state.0.config.protect_metrics {
        Router::new()
            .route("/metrics", get(metrics))
            .route_layer(middleware::from_fn_with_state(state.clone(), require_key))
    } else {
        Router::new().route("/metrics", get(metrics))
    };
    Router::new()
        .merge(v1)
        .merge(metrics_route)
        .route("/health", get(health))
        .route("/ready", get(ready))
        .fallback(fallback)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            count_requests,
        ))
        .layer(DefaultBodyLimit::max(limit))
        .layer(axum::Extension(error::BodyLimit(limit)))
        .with_state(state)
}

/// Only `/metrics` (for `--metrics-port`).
pub fn metrics_app(state: AppState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .with_state(state)
}

async fn health() -> impl IntoResponse {
    axum::Json(serde_json::json!({"status": "ok"}))
}

async fn ready(State(state): State<AppState>) -> Response {
    match state.ready_engine() {
        Ok(_) => axum::Json(serde_json::json!({"status": "ready"})).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.0.metrics.render(),
    )
}

async fn fallback(req: Request) -> ApiError {
    ApiError::not_found(req.uri().path())
}

async fn count_requests(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let endpoint = req
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", |p| match p.as_str() {
            "/v1/models" => "/v1/models",
            "/v1/models/{model}" => "/v1/models/{model}",
            "/v1/chat/completions" => "/v1/chat/completions",
            "/v1/completions" => "/v1/completions",
            "/health" => "/health",
            "/ready" => "/ready",
            "/metrics" => "/metrics",
            _ => "other",
        });
    let resp = next.run(req).await;
    state.0.metrics.request(endpoint, resp.status().as_u16());
    resp
}

async fn require_key(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let keys = &state.0.config.api_keys;
    if !keys.is_empty() {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        if !given.is_some_and(|g| keys.iter().any(|k| k == g)) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

/// Waits for SIGTERM or ctrl-c.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutdown signal received: draining");
}
