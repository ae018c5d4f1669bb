//! `/metrics`, `/healthz` and `/readyz` for the operator pod.
//!
//! `/healthz` answers while the process runs. `/readyz` answers once the operator has
//! reached the API server and checked the CRD: a replica waiting for the leader Lease is
//! ready too, so a rolling update of the operator never stalls on the follower.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::metrics::Metrics;

/// What the probe endpoints report.
pub struct Health {
    /// Operator metrics.
    pub metrics: Arc<Metrics>,
    /// Set once startup checks passed.
    pub ready: AtomicBool,
}

/// The probe and metrics router.
pub fn app(health: Arc<Health>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .with_state(health)
}

async fn metrics(State(health): State<Arc<Health>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        health.metrics.render(),
    )
}

async fn readyz(State(health): State<Arc<Health>>) -> impl IntoResponse {
    if health.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ready")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "starting")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    async fn get(app: Router, path: &str) -> (StatusCode, String) {
        let response = app
            .oneshot(Request::get(path).body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8(body.to_vec()).unwrap())
    }

    #[tokio::test]
    async fn probes_and_metrics() {
        let health = Arc::new(Health {
            metrics: Arc::new(Metrics::default()),
            ready: AtomicBool::new(false),
        });
        health.metrics.reconciliations.inc();
        assert_eq!(get(app(health.clone()), "/healthz").await.0, StatusCode::OK);
        assert_eq!(
            get(app(health.clone()), "/readyz").await.0,
            StatusCode::SERVICE_UNAVAILABLE
        );
        health.ready.store(true, Ordering::Relaxed);
        assert_eq!(get(app(health.clone()), "/readyz").await.0, StatusCode::OK);
        let (status, text) = get(app(health), "/metrics").await;
        assert_eq!(status, StatusCode::OK);
        assert!(
            text.contains("glmflash_operator_reconciliations_total 1"),
            "{text}"
        );
        assert!(text.contains("glmflash_operator_leader 0"), "{text}");
    }
}
