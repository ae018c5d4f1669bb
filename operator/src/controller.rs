//! The reconciler: `GlmFlashDeployment` -> node, pack-store Job, server Deployment,
//! Services, and status.
//!
//! One reconcile walks the stages in order for each of `spec.replicas` replicas (each on
//! its own node, `fleet`), and stops a replica at the first stage that is not done,
//! writing status that says where each stopped (each stage is a function in `stages`):
//! 1. validate: a bad spec gets `Ready=False, reason=InvalidSpec` and waits for a change;
//! 2. place: keep the node in status while it still matches, else pick one with a free GPU
//!    and memory for the cap (`NodeSelected`);
//! 3. store: the pack-store Job for the store's input hash (`StoreReady`); while it runs
//!    or after it failed, a server from an older store is scaled to zero;
//! 4. server: Deployment, API and metrics Services, ServiceMonitor and dashboard as asked
//!    (`ServerReady`), then live figures from the server's `/metrics`.
//!
//! Replicas past the count drain and go; a hibernating object (`spec.hibernate` or the
//! `glmflash.io/hibernate` annotation) skips the stages: its servers are scaled to zero
//! and its nodes released, its stores kept. One that served no request for
//! `spec.idleAfter` gets that annotation (`idle`).
//!
//! Writes are server-side applies with one field manager, made only when the object in
//! the cluster no longer holds every field of the one built (so a `kubectl scale` or edit
//! of an owned object, whose watch brings a reconcile, is reverted), and status is
//! written only when it changes: a settled deployment reconciles with reads only. An
//! Event is published on every phase change and on new trouble. An object the API server
//! refuses (a 4xx other than a conflict) is a `Failed` status with its message, not an
//! error loop. What the stages decided becomes status in `status`; why pods do not run
//! comes from `diagnose`; deletion is in `deletion`.

use std::collections::HashMap;
use std::fmt::Debug;
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use glmflash_crds::GlmFlashDeployment;
use jiff::Timestamp;
use k8s_openapi::api::batch::v1::Job;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::{Client, Resource, ResourceExt, discovery};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::{info, warn};

use crate::builders::{self, FIELD_MANAGER};
use crate::metrics::Metrics;
use crate::scrape::Scrape;
use crate::{Error, Result};

mod deletion;
mod diagnose;
mod fleet;
mod idle;
mod stages;
mod status;

/// Finalizer that runs store cleanup before the object goes away.
pub const FINALIZER: &str = "glmflash.io/cleanup";

/// The Prometheus operator's API group.
pub const MONITORING_GROUP: &str = "monitoring.coreos.com";

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
    /// Whether the cluster serves monitoring.coreos.com (found at startup, and looked for
    /// again while a spec asks for a ServiceMonitor and it was missing).
    service_monitor_api: AtomicBool,
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
            service_monitor_api: AtomicBool::new(service_monitor_api),
            failures: Mutex::new(HashMap::new()),
        }
    }

    /// Publishes an Event of `type_` about `gfd` (reason, the action it records, a note).
    pub async fn event(
        &self,
        gfd: &GlmFlashDeployment,
        type_: EventType,
        reason: &str,
        action: &str,
        note: Option<String>,
    ) -> Result<()> {
        let event = Event {
            type_,
            reason: reason.into(),
            note,
            action: action.into(),
            secondary: None,
        };
        Ok(self.recorder.publish(&event, &gfd.object_ref(&())).await?)
    }

    /// Whether ServiceMonitors can be applied; when `wanted` and not known yet, the API
    /// is looked for again (the Prometheus operator may have been installed since).
    async fn service_monitor_api(&self, wanted: bool) -> bool {
        if !self.service_monitor_api.load(Ordering::Relaxed)
            && wanted
            && discovery::group(&self.client, MONITORING_GROUP)
                .await
                .is_ok()
        {
            info!("the monitoring.coreos.com API is now served");
            self.service_monitor_api.store(true, Ordering::Relaxed);
        }
        self.service_monitor_api.load(Ordering::Relaxed)
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
    if gfd.meta().deletion_timestamp.is_some()
        && gfd.finalizers().iter().any(|f| f == FINALIZER)
        && let Some(action) = deletion::pending(&gfd, &ctx).await?
    {
        ctx.clear_failures(&object_key);
        return Ok(action);
    }
    let action = finalizer(&api, FINALIZER, gfd, |event| async {
        match event {
            Finalizer::Apply(gfd) => apply(&gfd, &ctx).await,
            Finalizer::Cleanup(gfd) => {
                info!(object = %key(&gfd), "deleted");
                Ok(Action::await_change())
            }
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
    // The one log line of a failed reconcile (the controller's stream logs none).
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
        && builders::holds(
            &serde_json::to_value(&existing)?,
            &serde_json::to_value(&desired)?,
        )
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
    let (outcome, action, replicas) = 'stages: {
        if let ControlFlow::Break((outcome, action)) = stages::validate(gfd, &old) {
            break 'stages (outcome, action, status::Replicas::unchanged(&old));
        }
        if gfd.hibernating() {
            break 'stages fleet::hibernate(gfd, ctx, &ns, &old).await?;
        }
        fleet::serve(gfd, ctx, &ns, &old).await?
    };
    let warn = outcome.ready.warn;
    let next = status::next_status(&old, gfd.metadata.generation, outcome, replicas, now);
    let idle_since = idle::due(gfd, &next, now)
        .then(|| next.last_request_time.clone())
        .flatten();
    status::write_status(gfd, ctx, next, warn).await?;
    if let Some(since) = idle_since {
        idle::hibernate(gfd, ctx, &since).await?;
    }
    Ok(action)
}

#[cfg(test)]
mod tests;
