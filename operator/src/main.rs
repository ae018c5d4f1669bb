//! `glmflash-operator`: the GlmFlashDeployment controller, or with `activator` the proxy
//! that wakes one deployment on demand. Logs are JSON lines on stderr (`RUST_LOG`
//! filters); the controller's probes and metrics listen on `--http-addr`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use clap::{Parser, Subcommand};
use glmflash_operator::activator;
use glmflash_operator::http::{self, Health};
use glmflash_operator::metrics::Metrics;
use glmflash_operator::run::{Settings, run};
use tracing_subscriber::EnvFilter;

#[derive(Parser, Debug)]
#[command(
    version,
    about = "Reconciles GlmFlashDeployment objects into glmflash-node servers",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    controller: ControllerArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Proxy one deployment's OpenAI API: wake it on demand, keep sessions on one replica.
    Activator(activator::Settings),
}

#[derive(clap::Args, Debug)]
struct ControllerArgs {
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, env = "GLMFLASH_HTTP_ADDR", default_value = "0.0.0.0:8080")]
    http_addr: SocketAddr,
    /// Watch only this namespace (default: all).
    #[arg(long, env = "GLMFLASH_WATCH_NAMESPACE")]
    watch_namespace: Option<String>,
    /// Namespace of the leader Lease: the operator's own.
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    lease_namespace: String,
    /// Name of the leader Lease.
    #[arg(long, env = "GLMFLASH_LEASE_NAME", default_value = "glmflash-operator")]
    lease_name: String,
    /// This replica's identity in the Lease.
    #[arg(long, env = "POD_NAME", default_value = "glmflash-operator-local")]
    identity: String,
    /// Run without leader election (one replica only).
    #[arg(long, env = "GLMFLASH_NO_LEADER_ELECTION")]
    no_leader_election: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .json()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    if let Some(Command::Activator(settings)) = cli.command {
        return activator::run(kube::Client::try_default().await?, settings).await;
    }
    let cli = cli.controller;

    let health = Arc::new(Health {
        metrics: Arc::new(Metrics::default()),
        ready: AtomicBool::new(false),
    });
    let listener = tokio::net::TcpListener::bind(cli.http_addr).await?;
    let server = tokio::spawn(axum::serve(listener, http::app(health.clone())).into_future());

    let client = kube::Client::try_default().await?;
    let settings = Settings {
        watch_namespace: cli.watch_namespace,
        lease_namespace: cli.lease_namespace,
        lease_name: cli.lease_name,
        identity: cli.identity,
        leader_election: !cli.no_leader_election,
    };
    let result = run(client, settings, health).await;
    server.abort();
    result
}
