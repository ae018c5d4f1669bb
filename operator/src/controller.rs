//! The reconciler: `GlmFlashDeployment` -> node, pack-store Job, server Deployment,
//! Services, and status.
//!
//! One reconcile walks the stages in order and stops at the first that is not done,
//! writing status that says where it stopped (each stage is a function in `stages`):
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
//! is published on every phase change. What the stages decided becomes status in `status`.

use std::collections::HashMap;
use std::fmt::Debug;
use std::ops::ControlFlow;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use glmflash_crds::{GlmFlashDeployment, ReclaimPolicy};
use jiff::Timestamp;
use k8s_openapi::api::batch::v1::Job;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::{info, warn};

use crate::builders::{self, FIELD_MANAGER, names};
use crate::metrics::Metrics;
use crate::scrape::Scrape;
use crate::{Error, Result};

mod stages;
mod status;

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

/// The stages in order, up to the first that stops; then status says where it stopped.
async fn apply(gfd: &GlmFlashDeployment, ctx: &Context) -> Result<Action> {
    let ns = gfd
        .namespace()
        .ok_or(Error::MissingField("metadata.namespace"))?;
    let old = gfd.status.clone().unwrap_or_default();
    let now = Timestamp::now();
    let (outcome, action) = 'stages: {
        if let ControlFlow::Break(stop) = stages::validate(gfd, &old) {
            break 'stages stop;
        }
        let placed = match stages::place(gfd, ctx, &old).await? {
            ControlFlow::Continue(placed) => placed,
            ControlFlow::Break(stop) => break 'stages stop,
        };
        let stored = match stages::store(gfd, ctx, &ns, &old, &placed).await? {
            ControlFlow::Continue(stored) => stored,
            ControlFlow::Break(stop) => break 'stages stop,
        };
        stages::server(gfd, ctx, &ns, &old, placed, stored).await?
    };
    let next = status::next_status(&old, gfd.metadata.generation, outcome, now);
    status::write_status(gfd, ctx, next).await?;
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
