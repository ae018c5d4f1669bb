//! The reconciler: `GlmFlashDeployment` -> node, pack-store Job, server Deployment,
//! Services, and status.
//!
//! One reconcile walks the stages in order and stops at the first that is not done,
//! writing status that says where it stopped:
//! 1. validate: a bad spec gets `Ready=False, reason=InvalidSpec` and waits for a change;
//! 2. place: keep the node in status while it still matches, else pick one with a free GPU
//!    and memory for the cap (`NodeSelected`);
//! 3. store: the pack-store Job for the store's input hash (`StoreReady`); while it runs
//!    or after it failed, a server from an older store is scaled to zero;
//! 4. server: Deployment, API and metrics Services, ServiceMonitor and dashboard as asked
//!    (`ServerReady`), then live figures from the server's `/metrics`.
//!
//! Writes are server-side applies with one field manager, made only when the object in
//! the cluster differs from the one built (its config-hash annotation), and status is
//! written only when it changes: a settled deployment reconciles with reads only. An Event
//! is published on every phase change.

use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use glmflash_crds::{
    GlmFlashDeployment, GlmFlashDeploymentStatus, LiveFigures, Phase, ReclaimPolicy, condition,
};
use jiff::Timestamp;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::{info, warn};

use crate::builders::{self, FIELD_MANAGER, names};
use crate::metrics::Metrics;
use crate::placement::{self, Owner};
use crate::scrape::{self, Scrape};
use crate::{Error, Result};

/// Finalizer that runs store cleanup before the object goes away.
pub const FINALIZER: &str = "glmflash.io/cleanup";

/// How often a running deployment is looked at again to refresh live figures.
pub const RUNNING_REQUEUE: Duration = Duration::from_secs(60);
/// How often a deployment that is waiting (Job running, server starting, no node) is
/// looked at again, on top of the watches on owned objects.
pub const WAITING_REQUEUE: Duration = Duration::from_secs(30);

/// Shared state of all reconciles.
pub struct Context {
    /// Kubernetes client.
    pub client: Client,
    /// Publishes Events.
    pub recorder: Recorder,
    /// Operator metrics.
    pub metrics: Arc<Metrics>,
    /// Reads the servers' `/metrics`.
    pub scraper: Arc<dyn Scrape>,
    /// Whether the cluster serves monitoring.coreos.com/v1 (found at startup).
    pub service_monitor_api: bool,
    /// Consecutive failures per object, for the error backoff.
    failures: Mutex<HashMap<String, u32>>,
}

impl Context {
    /// A context; `service_monitor_api` comes from API discovery at startup.
    pub fn new(
        client: Client,
        recorder: Recorder,
        metrics: Arc<Metrics>,
        scraper: Arc<dyn Scrape>,
        service_monitor_api: bool,
    ) -> Self {
        Self {
            client,
            recorder,
            metrics,
            scraper,
            service_monitor_api,
            failures: Mutex::new(HashMap::new()),
        }
    }

    fn record_failure(&self, key: String) -> u32 {
        let mut failures = self.failures.lock().expect("failures lock");
        let n = failures.entry(key).or_default();
        *n = n.saturating_add(1);
        *n
    }

    fn clear_failures(&self, key: &str) {
        self.failures.lock().expect("failures lock").remove(key);
    }
}

fn key(gfd: &GlmFlashDeployment) -> String {
    format!("{}/{}", gfd.namespace().unwrap_or_default(), gfd.name_any())
}

/// Requeue delay after `failures` consecutive errors: 5 s doubling to 5 min.
pub fn backoff(failures: u32) -> Duration {
    let exp = failures.saturating_sub(1).min(6);
    Duration::from_secs((5u64 << exp).min(300))
}

/// Reconciles one object inside the finalizer.
pub async fn reconcile(gfd: Arc<GlmFlashDeployment>, ctx: Arc<Context>) -> Result<Action> {
    let _timer = ctx.metrics.duration.start_timer();
    ctx.metrics.reconciliations.inc();
    let ns = gfd
        .namespace()
        .ok_or(Error::MissingField("metadata.namespace"))?;
    let api: Api<GlmFlashDeployment> = Api::namespaced(ctx.client.clone(), &ns);
    let object_key = key(&gfd);
    let action = finalizer(&api, FINALIZER, gfd, |event| async {
        match event {
            Finalizer::Apply(gfd) => apply(&gfd, &ctx).await,
            Finalizer::Cleanup(gfd) => cleanup(&gfd, &ctx).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)))?;
    ctx.clear_failures(&object_key);
    Ok(action)
}

/// Records the failure and requeues with exponential backoff.
pub fn error_policy(gfd: Arc<GlmFlashDeployment>, error: &Error, ctx: Arc<Context>) -> Action {
    let failures = ctx.record_failure(key(&gfd));
    let delay = backoff(failures);
    warn!(object = %key(&gfd), %error, failures, ?delay, "reconcile failed");
    ctx.metrics
        .failures
        .with_label_values(&[error.metric_label()])
        .inc();
    Action::requeue(delay)
}

/// A condition as the reconciler decides it; times and generation are filled in later.
#[derive(Clone, Debug, PartialEq)]
struct Cond {
    ok: bool,
    reason: &'static str,
    message: String,
}

impl Cond {
    fn yes(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            ok: true,
            reason,
            message: message.into(),
        }
    }
    fn no(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            ok: false,
            reason,
            message: message.into(),
        }
    }
}

/// Everything a reconcile decided, before it becomes status.
struct Outcome {
    phase: Phase,
    node: Option<String>,
    node_selected: Option<Cond>,
    store_ready: Option<Cond>,
    server_ready: Option<Cond>,
    ready: Cond,
    endpoint: Option<String>,
    store_hash: Option<String>,
    store_bytes: Option<u64>,
    live: Option<LiveFigures>,
}

/// Builds the next status from the old one: conditions keep their transition time while
/// their status is unchanged, so an unchanged outcome yields an identical status.
fn next_status(
    old: &GlmFlashDeploymentStatus,
    generation: Option<i64>,
    outcome: Outcome,
    now: Timestamp,
) -> GlmFlashDeploymentStatus {
    let mut conditions = Vec::new();
    let decided = [
        (condition::NODE_SELECTED, outcome.node_selected),
        (condition::STORE_READY, outcome.store_ready),
        (condition::SERVER_READY, outcome.server_ready),
        (condition::READY, Some(outcome.ready)),
    ];
    for (type_, cond) in decided {
        let previous = old.conditions.iter().find(|c| c.type_ == type_);
        let Some(cond) = cond else {
            // Not decided this time (spec invalid): keep what was last known.
            conditions.extend(previous.cloned());
            continue;
        };
        let status = if cond.ok { "True" } else { "False" };
        let last_transition_time = match previous {
            Some(p) if p.status == status => p.last_transition_time.clone(),
            _ => Time(now),
        };
        conditions.push(Condition {
            type_: type_.to_string(),
            status: status.to_string(),
            reason: cond.reason.to_string(),
            message: cond.message,
            observed_generation: generation,
            last_transition_time,
        });
    }
    GlmFlashDeploymentStatus {
        phase: Some(outcome.phase),
        conditions,
        observed_generation: generation,
        node: outcome.node,
        endpoint: outcome.endpoint,
        store_hash: outcome.store_hash,
        store_bytes: outcome.store_bytes,
        live: outcome.live,
    }
}

fn apply_params() -> PatchParams {
    PatchParams::apply(FIELD_MANAGER).force()
}

/// Applies `desired` unless the object in the cluster already carries its config hash.
async fn ensure<K>(api: &Api<K>, desired: K) -> Result<K>
where
    K: Resource + Clone + Debug + Serialize + DeserializeOwned,
{
    let name = desired
        .meta()
        .name
        .clone()
        .ok_or(Error::MissingField("metadata.name"))?;
    if let Some(existing) = api.get_opt(&name).await?
        && builders::config_hash_of(&existing) == builders::config_hash_of(&desired)
    {
        return Ok(existing);
    }
    Ok(api
        .patch(&name, &apply_params(), &Patch::Apply(&desired))
        .await?)
}

/// Deletes `name` if it exists (an optional object the spec no longer asks for).
async fn remove<K>(api: &Api<K>, name: &str) -> Result<()>
where
    K: Resource + Clone + Debug + DeserializeOwned,
{
    if api.get_opt(name).await?.is_some() {
        api.delete(name, &Default::default()).await?;
    }
    Ok(())
}

/// Writes status if it changed and publishes an Event if the phase did.
async fn write_status(
    gfd: &GlmFlashDeployment,
    ctx: &Context,
    next: GlmFlashDeploymentStatus,
) -> Result<()> {
    let old = gfd.status.clone().unwrap_or_default();
    if next == old {
        return Ok(());
    }
    let ns = gfd
        .namespace()
        .ok_or(Error::MissingField("metadata.namespace"))?;
    let api: Api<GlmFlashDeployment> = Api::namespaced(ctx.client.clone(), &ns);
    let patch = serde_json::json!({
        "apiVersion": "glmflash.io/v1alpha1",
        "kind": "GlmFlashDeployment",
        "status": next,
    });
    api.patch_status(&gfd.name_any(), &apply_params(), &Patch::Apply(&patch))
        .await?;
    if next.phase != old.phase
        && let Some(phase) = next.phase
    {
        let ready = next.conditions.iter().find(|c| c.type_ == condition::READY);
        info!(object = %key(gfd), phase = phase.as_str(), "phase changed");
        let warning = matches!(phase, Phase::Invalid | Phase::Failed | Phase::Pending);
        ctx.recorder
            .publish(
                &Event {
                    type_: if warning {
                        EventType::Warning
                    } else {
                        EventType::Normal
                    },
                    reason: phase.as_str().to_string(),
                    note: ready.map(|c| truncate(&c.message, 1000)),
                    action: "Reconcile".into(),
                    secondary: None,
                },
                &gfd.object_ref(&()),
            )
            .await?;
    }
    Ok(())
}

fn truncate(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

/// The node to use: the one in status while it still matches, else the first that fits.
async fn place(gfd: &GlmFlashDeployment, ctx: &Context) -> Result<Result<String, String>> {
    let nodes: Api<Node> = Api::all(ctx.client.clone());
    let spec = &gfd.spec;
    if let Some(current) = gfd.status.as_ref().and_then(|s| s.node.as_ref())
        && let Some(node) = nodes.get_opt(current).await?
        && placement::mismatch(spec, &node).is_none()
    {
        return Ok(Ok(current.clone()));
    }
    let mut all = nodes.list(&ListParams::default()).await?.items;
    all.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    let pods: Api<Pod> = Api::all(ctx.client.clone());
    let (name, namespace) = (gfd.name_any(), gfd.namespace().unwrap_or_default());
    let owner = Owner {
        name: &name,
        namespace: &namespace,
    };
    let mut reasons = Vec::new();
    for node in &all {
        let node_name = node.name_any();
        if let Some(why) = placement::mismatch(spec, node) {
            reasons.push(format!("{node_name}: {why}"));
            continue;
        }
        let on_node = pods
            .list(&ListParams::default().fields(&format!("spec.nodeName={node_name}")))
            .await?
            .items;
        match placement::no_room(spec, node, &on_node, owner) {
            Some(why) => reasons.push(format!("{node_name}: {why}")),
            None => return Ok(Ok(node_name)),
        }
    }
    Ok(Err(placement::summarize(&reasons)))
}

/// Where a pack-store Job is.
#[derive(Debug, PartialEq)]
enum JobState {
    Running,
    Complete,
    Failed(String),
}

fn job_state(job: &Job) -> JobState {
    let conditions = job
        .status
        .as_ref()
        .and_then(|s| s.conditions.clone())
        .unwrap_or_default();
    let is = |t: &str| {
        conditions
            .iter()
            .find(|c| c.type_ == t && c.status == "True")
    };
    if is("Complete").is_some() {
        JobState::Complete
    } else if let Some(failed) = is("Failed") {
        JobState::Failed(format!(
            "{}: {}",
            failed.reason.as_deref().unwrap_or("Failed"),
            failed.message.as_deref().unwrap_or("no message")
        ))
    } else {
        JobState::Running
    }
}

/// The store size pack-store wrote to its termination message (`{"storeBytes": N}`).
async fn read_store_bytes(ctx: &Context, ns: &str, job: &str) -> Result<Option<u64>> {
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Report {
        store_bytes: u64,
    }
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    let list = pods
        .list(&ListParams::default().labels(&format!("batch.kubernetes.io/job-name={job}")))
        .await?;
    Ok(list
        .items
        .iter()
        .filter_map(|p| p.status.as_ref()?.container_statuses.as_ref())
        .flatten()
        .filter(|c| c.name == "pack-store")
        .filter_map(|c| c.state.as_ref()?.terminated.as_ref()?.message.as_ref())
        .find_map(|m| serde_json::from_str::<Report>(m).ok())
        .map(|r| r.store_bytes))
}

async fn apply(gfd: &GlmFlashDeployment, ctx: &Context) -> Result<Action> {
    let ns = gfd
        .namespace()
        .ok_or(Error::MissingField("metadata.namespace"))?;
    let name = gfd.name_any();
    let old = gfd.status.clone().unwrap_or_default();
    let generation = gfd.metadata.generation;
    let now = Timestamp::now();

    let invalid = gfd.validate();
    if !invalid.is_empty() {
        let message = invalid
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ");
        let outcome = Outcome {
            phase: Phase::Invalid,
            node: old.node.clone(),
            node_selected: None,
            store_ready: None,
            server_ready: None,
            ready: Cond::no("InvalidSpec", message),
            endpoint: None,
            store_hash: old.store_hash.clone(),
            store_bytes: old.store_bytes,
            live: None,
        };
        write_status(gfd, ctx, next_status(&old, generation, outcome, now)).await?;
        // Nothing to retry until the spec changes.
        return Ok(Action::await_change());
    }

    let node = match place(gfd, ctx).await? {
        Ok(node) => node,
        Err(why) => {
            let outcome = Outcome {
                phase: Phase::Pending,
                node: None,
                node_selected: Some(Cond::no("NoFittingNode", why.clone())),
                store_ready: Some(Cond::no("WaitingForNode", "no node chosen yet")),
                server_ready: Some(Cond::no("WaitingForNode", "no node chosen yet")),
                ready: Cond::no("NoFittingNode", why),
                endpoint: None,
                store_hash: old.store_hash.clone(),
                store_bytes: old.store_bytes,
                live: None,
            };
            write_status(gfd, ctx, next_status(&old, generation, outcome, now)).await?;
            return Ok(Action::requeue(WAITING_REQUEUE));
        }
    };
    let node_selected = Cond::yes(
        "NodeFits",
        format!("node {node} matches and has a free GPU and memory for the cap"),
    );

    let hash = builders::store_hash(&gfd.spec, &node);
    let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), &ns);
    let mut store_bytes = old.store_bytes;
    if old.store_hash.as_deref() != Some(hash.as_str()) {
        let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), &ns);
        let job_name = names::pack_job(&name, &hash);
        let job = match jobs.get_opt(&job_name).await? {
            Some(job) => job,
            None => {
                let desired = builders::pack_job(gfd, &node, &hash);
                jobs.patch(&job_name, &apply_params(), &Patch::Apply(&desired))
                    .await?
            }
        };
        let waiting = match job_state(&job) {
            JobState::Complete => {
                store_bytes = read_store_bytes(ctx, &ns, &job_name).await?;
                None
            }
            JobState::Running => Some((
                Phase::PackingStore,
                Cond::no(
                    "Packing",
                    format!("pack-store Job {job_name} is running on {node}"),
                ),
                Action::requeue(WAITING_REQUEUE),
            )),
            JobState::Failed(why) => Some((
                Phase::Failed,
                Cond::no(
                    "PackStoreFailed",
                    format!(
                        "pack-store Job {job_name} failed after {} retries ({why}); fix the cause and delete the Job to retry",
                        gfd.spec.store.pack_retries
                    ),
                ),
                Action::await_change(),
            )),
        };
        if let Some((phase, store_ready, action)) = waiting {
            // A server still running from an older store must not read it while it is rewritten.
            if let Some(existing) = deployments.get_opt(&name).await?
                && existing.spec.as_ref().and_then(|s| s.replicas) != Some(0)
            {
                let scaled = builders::server_deployment(gfd, &node, 0);
                deployments
                    .patch(&name, &apply_params(), &Patch::Apply(&scaled))
                    .await?;
            }
            let ready = Cond::no(store_ready.reason, store_ready.message.clone());
            let outcome = Outcome {
                phase,
                node: Some(node),
                node_selected: Some(node_selected),
                store_ready: Some(store_ready),
                server_ready: Some(Cond::no("WaitingForStore", "the store is not ready")),
                ready,
                endpoint: None,
                store_hash: None,
                store_bytes: None,
                live: None,
            };
            write_status(gfd, ctx, next_status(&old, generation, outcome, now)).await?;
            return Ok(action);
        }
    }
    let store_ready = Cond::yes(
        "StoreBuilt",
        format!(
            "store {} on {node} built from inputs {hash}",
            builders::store_dir(&gfd.spec)
        ),
    );

    let deployment = ensure(&deployments, builders::server_deployment(gfd, &node, 1)).await?;
    let services: Api<Service> = Api::namespaced(ctx.client.clone(), &ns);
    ensure(&services, builders::api_service(gfd)).await?;
    ensure(&services, builders::metrics_service(gfd)).await?;

    let mut notes = Vec::new();
    if ctx.service_monitor_api {
        let monitors: Api<DynamicObject> = Api::namespaced_with(
            ctx.client.clone(),
            &ns,
            &builders::service_monitor_resource(),
        );
        if gfd.spec.metrics.service_monitor {
            ensure(&monitors, builders::service_monitor(gfd)).await?;
        } else {
            remove(&monitors, &names::metrics(&name)).await?;
        }
    } else if gfd.spec.metrics.service_monitor {
        notes.push(
            "metrics.serviceMonitor is set but the cluster has no monitoring.coreos.com/v1 API",
        );
    }
    let config_maps: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), &ns);
    if gfd.spec.metrics.dashboards {
        ensure(&config_maps, builders::dashboard_config_map(gfd)).await?;
    } else {
        remove(&config_maps, &names::dashboard(&name)).await?;
    }

    let endpoint = builders::endpoint(gfd);
    let available = deployment
        .status
        .as_ref()
        .filter(|s| s.observed_generation >= deployment.metadata.generation)
        .and_then(|s| s.available_replicas)
        .unwrap_or(0);
    let (phase, server_ready, ready, live, action) = if available >= 1 {
        let live = match ctx.scraper.fetch(builders::metrics_url(gfd)).await {
            Ok(text) => Some(scrape::live_figures(&scrape::parse_exposition(&text))),
            Err(why) => {
                warn!(object = %key(gfd), %why, "could not read server metrics");
                old.live.clone()
            }
        };
        let mut message = format!("serving {endpoint}");
        for note in &notes {
            message.push_str("; ");
            message.push_str(note);
        }
        (
            Phase::Running,
            Cond::yes("Available", format!("{available} server replica available")),
            Cond::yes("Serving", message),
            live,
            Action::requeue(RUNNING_REQUEUE),
        )
    } else {
        (
            Phase::Starting,
            Cond::no(
                "Starting",
                "the server is loading the model (startup probe pending)",
            ),
            Cond::no("Starting", "the server is loading the model"),
            None,
            Action::requeue(WAITING_REQUEUE),
        )
    };
    let outcome = Outcome {
        phase,
        node: Some(node),
        node_selected: Some(node_selected),
        store_ready: Some(store_ready),
        server_ready: Some(server_ready),
        ready,
        endpoint: Some(endpoint),
        store_hash: Some(hash),
        store_bytes,
        live,
    };
    write_status(gfd, ctx, next_status(&old, generation, outcome, now)).await?;
    Ok(action)
}

/// Deletion: owned objects go by owner references; the store goes only when the reclaim
/// policy says so, through a Job on its node that deletion waits for.
async fn cleanup(gfd: &GlmFlashDeployment, ctx: &Context) -> Result<Action> {
    let node = gfd.status.as_ref().and_then(|s| s.node.clone());
    let (ReclaimPolicy::Delete, Some(node)) = (gfd.spec.store.reclaim_policy, node) else {
        info!(object = %key(gfd), "deleted; store retained");
        return Ok(Action::await_change());
    };
    let ns = gfd
        .namespace()
        .ok_or(Error::MissingField("metadata.namespace"))?;
    let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), &ns);
    let job_name = names::reclaim_job(&gfd.name_any());
    let job = match jobs.get_opt(&job_name).await? {
        Some(job) => job,
        None => {
            let desired = builders::reclaim_job(gfd, &node);
            jobs.patch(&job_name, &apply_params(), &Patch::Apply(&desired))
                .await?;
            return Err(Error::ReclaimPending(job_name));
        }
    };
    match job_state(&job) {
        JobState::Running => Err(Error::ReclaimPending(job_name)),
        JobState::Complete => {
            info!(object = %key(gfd), %node, "store reclaimed");
            Ok(Action::await_change())
        }
        JobState::Failed(why) => {
            // Never block deletion on a node that cannot be cleaned: say where the bytes are.
            let note = format!(
                "store reclaim failed ({why}); remove {} on node {node} by hand",
                gfd.spec.store.host_path
            );
            warn!(object = %key(gfd), %note);
            ctx.recorder
                .publish(
                    &Event {
                        type_: EventType::Warning,
                        reason: "ReclaimFailed".into(),
                        note: Some(note),
                        action: "Cleanup".into(),
                        secondary: None,
                    },
                    &gfd.object_ref(&()),
                )
                .await?;
            Ok(Action::await_change())
        }
    }
}

#[cfg(test)]
mod tests;
