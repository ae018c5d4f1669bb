//! The activator (`glmflash-operator activator`): a small reverse proxy in front of one
//! GlmFlashDeployment's OpenAI API that wakes it on demand and keeps sessions on one
//! replica.
//!
//! It watches the object and its server pods ([`watch`]) into one [`Backends`] value. A
//! request is read whole (up to `--max-body`), then sent to a ready replica: by rendezvous
//! hashing of its `x-session-id` header, else of the body's `user` field, so a
//! conversation keeps landing where its KV cache and expert tiers are warm; round-robin
//! without either. With no replica ready, an API request (`/v1/...`) on a deployment
//! hibernated by the `glmflash.io/hibernate` annotation removes the annotation (a merge
//! patch, at most one per [`WAKE_REPEAT`]) and waits for a replica up to `--wake-timeout`,
//! then answers an OpenAI-shaped 503. Responses stream through chunk by chunk. `/metrics`
//! (the last request time and counters) and `/healthz` are the activator's own.
//!
//! `spec.hibernate: true` is the spec owner's off switch: the activator does not write the
//! spec and answers 503 at once. Idleness is the operator's business (`spec.idleAfter`,
//! from the servers' own request counters), so the activator keeps no state on the object.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use glmflash_crds::GlmFlashDeployment;
use http_body_util::Full;
use hyper::body::Bytes;
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kube::Api;
use tokio::sync::{Mutex, watch as channel};
use tokio::time::Instant;

mod backends;
mod proxy;
mod watch;

pub use backends::{Backends, Object, rendezvous};
pub use proxy::{ActivatorMetrics, MAX_ATTEMPTS, SESSION_HEADER, app};

/// The least time between two wake patches, while the first has not shown in the watch.
pub const WAKE_REPEAT: Duration = Duration::from_secs(10);

/// The `activator` subcommand's flags.
#[derive(clap::Args, Debug, Clone)]
pub struct Settings {
    /// The GlmFlashDeployment to front.
    #[arg(long, env = "GLMFLASH_ACTIVATOR_DEPLOYMENT")]
    pub deployment: String,
    /// Its namespace.
    #[arg(long, env = "GLMFLASH_ACTIVATOR_NAMESPACE", default_value = "default")]
    pub namespace: String,
    /// Address the proxy, /metrics and /healthz listen on.
    #[arg(
        long,
        env = "GLMFLASH_ACTIVATOR_LISTEN",
        default_value = "0.0.0.0:8080"
    )]
    pub listen: SocketAddr,
    /// How long a request waits for a ready replica (`90s`, `5m`) before a 503.
    #[arg(long, env = "GLMFLASH_ACTIVATOR_WAKE_TIMEOUT", default_value = "300s", value_parser = parse_timeout)]
    pub wake_timeout: Duration,
    /// Largest request body held, in bytes (larger ones get a 413).
    #[arg(long, env = "GLMFLASH_ACTIVATOR_MAX_BODY", default_value_t = 16 << 20)]
    pub max_body: usize,
}

fn parse_timeout(text: &str) -> Result<Duration, String> {
    glmflash_crds::parse_duration(text)
        .filter(|d| !d.is_zero())
        .ok_or_else(|| format!("{text:?} is not a duration such as 90s or 5m"))
}

/// Everything a request reads: the watched backends, the API to wake through, the upstream
/// client and the limits.
pub struct Activator {
    backends: channel::Receiver<Backends>,
    gfds: Api<GlmFlashDeployment>,
    name: String,
    upstream: HttpClient<HttpConnector, Full<Bytes>>,
    wake_timeout: Duration,
    max_body: usize,
    next: AtomicUsize,
    last_wake: Mutex<Option<Instant>>,
    metrics: ActivatorMetrics,
}

impl Activator {
    /// An activator for `name` reading `backends` (fed by [`watch::backends`] in a
    /// deployment, by the test itself in tests) and waking through `gfds`.
    pub fn new(
        backends: channel::Receiver<Backends>,
        gfds: Api<GlmFlashDeployment>,
        name: &str,
        wake_timeout: Duration,
        max_body: usize,
    ) -> Self {
        Self {
            backends,
            gfds,
            name: name.to_string(),
            upstream: HttpClient::builder(TokioExecutor::new()).build_http(),
            wake_timeout,
            max_body,
            next: AtomicUsize::new(0),
            last_wake: Mutex::new(None),
            metrics: ActivatorMetrics::default(),
        }
    }
}

/// Runs the activator until the watch or the server stops.
pub async fn run(client: kube::Client, settings: Settings) -> anyhow::Result<()> {
    let (tx, rx) = channel::channel(Backends::default());
    let gfds = Api::namespaced(client.clone(), &settings.namespace);
    let activator = Arc::new(Activator::new(
        rx,
        gfds,
        &settings.deployment,
        settings.wake_timeout,
        settings.max_body,
    ));
    let listener = tokio::net::TcpListener::bind(settings.listen).await?;
    tracing::info!(deployment = %settings.deployment, namespace = %settings.namespace, listen = %settings.listen, "activator listening");
    let watching = watch::backends(client, settings.namespace, settings.deployment, tx);
    // On SIGTERM (a rollout) it stops accepting and finishes the requests it holds.
    let serving = axum::serve(listener, app(activator))
        .with_graceful_shutdown(terminated())
        .into_future();
    tokio::select! {
        result = watching => result,
        result = serving => Ok(result?),
    }
}

/// SIGTERM or SIGINT.
async fn terminated() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                term.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        () = term => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("activator stopping: finishing the requests it holds");
}

#[cfg(test)]
mod tests;
