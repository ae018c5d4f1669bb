//! `glmflash-node serve`: binds the API (answering `/health` at once and 503 until the model
//! is loaded), loads the model and starts the engine, and drains on SIGTERM / ctrl-c.

use super::{ApiConfig, AppState, app, metrics_app, shutdown_signal};
use crate::engine::scheduler::{Engine, EngineConfig};
use crate::metrics::Metrics;
use crate::model::Model;
use crate::tokenizer::TextCodec;
use anyhow::Context;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(clap::Args, Clone, Debug)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, env = "GLMFLASH_HOST", default_value = "0.0.0.0")]
    pub host: String,
    /// Port of the API.
    #[arg(long, env = "GLMFLASH_PORT", default_value_t = 30000)]
    pub port: u16,
    /// Also serve `/metrics` alone on this port.
    #[arg(long, env = "GLMFLASH_METRICS_PORT")]
    pub metrics_port: Option<u16>,
    /// The model id clients send and `/v1/models` lists.
    #[arg(
        long,
        env = "GLMFLASH_SERVED_MODEL_NAME",
        default_value = "glm-5.3-flash"
    )]
    pub served_model_name: String,
    /// Sequences decoded together.
    #[arg(long, env = "GLMFLASH_MAX_BATCH_SIZE", default_value_t = 8)]
    pub max_batch_size: usize,
    /// Prompt tokens prefilled per scheduler tick (interleaved with decode).
    #[arg(long, env = "GLMFLASH_CHUNK_SIZE", default_value_t = 8192)]
    pub chunk_size: usize,
    /// Most tokens (prompt + completion) of one sequence; capped at the model's.
    #[arg(long, env = "GLMFLASH_CONTEXT_LENGTH", default_value_t = 131072)]
    pub context_length: usize,
    /// Cache budget in MiB over all running sequences, reserved per sequence before
    /// admission at what its cache will hold (MLA latents, DSA indexer keys, KDA state).
    /// Default: room for the batch size of full-context sequences.
    #[arg(long, env = "GLMFLASH_KV_CACHE_MIB")]
    pub kv_cache_mib: Option<usize>,
    /// Sequences that may wait for admission; beyond, requests get 429.
    #[arg(long, env = "GLMFLASH_MAX_WAITING", default_value_t = 64)]
    pub max_waiting: usize,
    /// API keys (comma-separated); none means no auth.
    #[arg(long, env = "GLMFLASH_API_KEY", value_delimiter = ',')]
    pub api_key: Vec<String>,
    /// A file of API keys, one a line.
    #[arg(long, env = "GLMFLASH_API_KEY_FILE")]
    pub api_key_file: Option<PathBuf>,
    /// Require a key for `/metrics` too (when keys are set).
    #[arg(long, env = "GLMFLASH_PROTECT_METRICS", value_parser = clap::builder::BoolishValueParser::new())]
    pub protect_metrics: bool,
    /// Largest request body in bytes (413 beyond).
    #[arg(long, env = "GLMFLASH_MAX_BODY_BYTES", default_value_t = 32 << 20)]
    pub max_body_bytes: usize,
    /// Run prompt chunks and decode steps with every activation and sequence cache on the
    /// GPU when the model's dense weights are on one (`--device cuda`); `false` keeps the
    /// activations and caches on the host around each device product.
    #[arg(long, env = "GLMFLASH_GPU_FORWARD", default_value_t = true, action = clap::ArgAction::Set, value_parser = clap::builder::BoolishValueParser::new())]
    pub gpu_forward: bool,
    /// Prompt tokens per scheduler tick of the sequences on the GPU: the GPU forward's
    /// activations grow with it (about 0.7 MB a token at GLM-5.3-Flash's widths); VRAM
    /// sizing from free memory keeps room for the default.
    #[arg(long, env = "GLMFLASH_GPU_CHUNK_SIZE", default_value_t = crate::model::decoder::DEFAULT_GPU_CHUNK)]
    pub gpu_chunk_size: usize,
    /// Seconds to let in-flight requests finish after SIGTERM.
    #[arg(long, env = "GLMFLASH_SHUTDOWN_TIMEOUT", default_value_t = 30)]
    pub shutdown_timeout: u64,
    /// When the memory plan refuses the box (the GPU or the memory cap cannot hold what must
    /// be there before any expert), write `{"planRefused": "<why, with the numbers>"}` to
    /// this file before exiting: the operator passes the pod's termination-message path and
    /// stops the server instead of letting it restart.
    #[arg(long, env = "GLMFLASH_TERMINATION_LOG")]
    pub termination_log: Option<PathBuf>,
}

impl ServeArgs {
    fn api_config(&self) -> anyhow::Result<ApiConfig> {
        let mut keys: Vec<String> = self
            .api_key
            .iter()
            .map(|k| k.trim().to_string())
            .filter(|k| !k.is_empty())
            .collect();
        if let Some(f) = &self.api_key_file {
            let text = std::fs::read_to_string(f)
                .with_context(|| format!("reading the API key file {}", f.display()))?;
            keys.extend(
                text.lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty() && !l.starts_with('#'))
                    .map(String::from),
            );
        }
        Ok(ApiConfig {
            model_id: self.served_model_name.clone(),
            api_keys: keys,
            protect_metrics: self.protect_metrics,
            max_body_bytes: self.max_body_bytes,
        })
    }

    pub fn engine_config(&self) -> EngineConfig {
        let batch = self.max_batch_size.max(1);
        EngineConfig {
            max_batch_size: batch,
            chunk_size: self.chunk_size,
            context_length: self.context_length,
            kv_cache_bytes: self.kv_cache_mib.map(|m| m.saturating_mul(1 << 20)),
            max_waiting: self.max_waiting,
            gpu_forward: self.gpu_forward,
            gpu_chunk_size: self.gpu_chunk_size,
        }
    }
}

/// Loads the tokenizer and model of `dir` (experts in memory) and starts the engine.
pub fn load_engine(
    dir: &Path,
    config: EngineConfig,
    metrics: Arc<Metrics>,
) -> anyhow::Result<Engine> {
    load_engine_with(dir, config, metrics, || Model::load(dir))
}

/// As [`load_engine`], with the model from `load` (e.g. with tiered experts).
pub fn load_engine_with(
    dir: &Path,
    config: EngineConfig,
    metrics: Arc<Metrics>,
    load: impl FnOnce() -> anyhow::Result<Model>,
) -> anyhow::Result<Engine> {
    let started = Instant::now();
    let codec = TextCodec::from_dir(dir)
        .with_context(|| format!("loading the tokenizer of {}", dir.display()))?;
    let model = load()?;
    tracing::info!(
        seconds = started.elapsed().as_secs_f64(),
        dir = %dir.display(),
        "model loaded"
    );
    Ok(Engine::start(model, Arc::new(codec), config, metrics))
}

/// Type of the model loader [`serve`] runs once the socket is bound; it gets the server's
/// metrics registry (e.g. to attach the expert tiers' metrics).
pub type ModelLoader = Box<dyn FnOnce(&Arc<Metrics>) -> anyhow::Result<Model> + Send>;

/// Runs the server until SIGTERM / ctrl-c, then drains. `load` gives the model (default:
/// `Model::load(dir)`); the tokenizer comes from `dir`.
pub fn serve(dir: PathBuf, args: ServeArgs, load: Option<ModelLoader>) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .worker_threads(2)
        .thread_name("glmflash-http")
        .build()?;
    runtime.block_on(serve_async(dir, args, load))
}

/// Writes the memory plan's refusal in `e`, if that is why the model did not load, to `path`
/// as `{"planRefused": "..."}` (what the operator reads from the termination message).
fn report_refusal(path: &Path, e: &anyhow::Error) -> std::io::Result<bool> {
    let Some(refusal) = e.downcast_ref::<crate::plan::PlanError>() else {
        return Ok(false);
    };
    let json = serde_json::json!({ "planRefused": refusal.to_string() });
    std::fs::write(path, json.to_string())?;
    Ok(true)
}

async fn serve_async(
    dir: PathBuf,
    args: ServeArgs,
    load: Option<ModelLoader>,
) -> anyhow::Result<()> {
    let metrics = Arc::new(Metrics::new());
    let state = AppState::new(args.api_config()?, metrics.clone());
    let addr = format!("{}:{}", args.host, args.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    tracing::info!(addr = %listener.local_addr()?, model = %args.served_model_name, "listening");
    if let Some(port) = args.metrics_port {
        let maddr = format!("{}:{port}", args.host);
        let ml = tokio::net::TcpListener::bind(&maddr)
            .await
            .with_context(|| format!("binding {maddr}"))?;
        let mapp = metrics_app(state.clone());
        tokio::spawn(async move {
            let _ = axum::serve(ml, mapp).await;
        });
    }

    let load_failed = Arc::new(tokio::sync::Notify::new());
    let failed = load_failed.clone();
    let loader_state = state.clone();
    let engine_config = args.engine_config();
    let termination_log = args.termination_log.clone();
    let loader = tokio::task::spawn_blocking(move || {
        let loaded = match load {
            Some(load) => {
                let registry = metrics.clone();
                load_engine_with(&dir, engine_config, metrics, move || load(&registry))
            }
            None => load_engine(&dir, engine_config, metrics),
        };
        match loaded {
            Ok(engine) => {
                loader_state.set_engine(Arc::new(engine));
                tracing::info!("ready");
            }
            Err(e) => {
                tracing::error!(error = %format!("{e:#}"), "loading the model failed");
                if let Some(path) = &termination_log
                    && let Err(w) = report_refusal(path, &e)
                {
                    tracing::warn!(path = %path.display(), error = %w, "cannot write the refusal");
                }
                loader_state.set_load_error(format!("{e:#}"));
                failed.notify_one();
            }
        }
    });

    let (signalled_tx, mut signalled) = tokio::sync::watch::channel(false);
    let server = axum::serve(listener, app(state.clone())).with_graceful_shutdown(async move {
        tokio::select! {
            _ = shutdown_signal() => {}
            _ = load_failed.notified() => {}
        }
        let _ = signalled_tx.send(true);
    });
    let timeout = Duration::from_secs(args.shutdown_timeout);
    let drained = tokio::select! {
        r = server => { r?; true }
        _ = async {
            let _ = signalled.wait_for(|s| *s).await;
            tokio::time::sleep(timeout).await;
        } => false,
    };
    if !drained {
        tracing::warn!(
            seconds = args.shutdown_timeout,
            "drain timed out; stopping with requests in flight"
        );
    }
    let _ = loader.await;
    if state.engine().is_none() {
        // The model never loaded: exit non-zero so the pod restarts and shows why.
        anyhow::bail!("the model did not load; see the log above");
    }
    if let Some(engine) = state.engine().cloned() {
        tokio::task::spawn_blocking(move || engine.finish(drained)).await??;
    }
    tracing::info!("stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plan refusal, under any context, is written with its numbers; other load errors
    /// are not (the operator must not read them as a plan that does not fit).
    #[test]
    fn only_a_plan_refusal_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("termination-log");
        let refusal = crate::plan::PlanError::Ram {
            held_mib: 18_000,
            reserve_mib: 2048,
            limit_mib: 16_384,
        };
        let e = anyhow::Error::new(refusal).context("loading /model");
        assert!(report_refusal(&path, &e).unwrap());
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let why = v["planRefused"].as_str().unwrap();
        assert!(
            why.contains("18000 MiB held") && why.contains("16384 MiB"),
            "{why}"
        );
        std::fs::remove_file(&path).unwrap();
        assert!(!report_refusal(&path, &anyhow::anyhow!("no such file")).unwrap());
        assert!(!path.exists());
    }
}
