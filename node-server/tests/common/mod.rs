//! The demo-model server the API tests drive through `app(state)` with `oneshot`: one
//! demo checkpoint per test binary, written once to a temporary directory.

use axum::Router;
use glmflash_node::api::server::load_engine;
use glmflash_node::api::{ApiConfig, AppState, app};
use glmflash_node::engine::scheduler::EngineConfig;
use glmflash_node::metrics::Metrics;
use std::path::Path;
use std::sync::{Arc, OnceLock};

/// The demo checkpoint, made on first use and kept for the binary's life.
pub fn demo_dir() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = tempfile::tempdir().unwrap();
        glmflash_node::demo::make_demo_model(d.path(), glmflash_node::demo::DEFAULT_SEED).unwrap();
        d
    })
    .path()
}

/// The router over the demo model, loaded with `engine` and served with `api`, and its state.
pub fn server(engine: EngineConfig, api: ApiConfig) -> (Router, AppState) {
    let metrics = Arc::new(Metrics::new());
    let state = AppState::new(api, metrics.clone());
    let e = load_engine(demo_dir(), engine, metrics).unwrap();
    state.set_engine(Arc::new(e));
    (app(state.clone()), state)
}
