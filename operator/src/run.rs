//! Startup: API checks, watches, leader election, and the controller loop.
//!
//! Two replicas are safe: both serve probes and metrics, but only the holder of the
//! Lease (kube-lease-manager) runs the controller. A replica that loses the Lease exits,
//! so Kubernetes restarts it as a follower instead of it ever reconciling next to a new
//! leader.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::StreamExt;
use glmflash_crds::GlmFlashDeployment;
use jiff::Timestamp;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Service};
use kube::api::{Api, ListParams};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{Controller, controller, watcher};
use kube::{Client, ResourceExt, discovery};
use kube_lease_manager::LeaseManagerBuilder;
use tracing::{debug, error, info};

use crate::builders::FIELD_MANAGER;
use crate::controller::{self as reconciler, Context, MONITORING_GROUP};
use crate::http::Health;
use crate::scrape::HttpScraper;

/// Leader Lease duration: a replica that cannot renew for this long steps down.
const LEASE_SECONDS: i64 = 15;
/// How often the leader reads its Lease back.
const LEASE_CHECK: Duration = Duration::from_secs(5);

/// Whether `lease` names `identity` as holder.
fn held_by(lease: &Lease, identity: &str) -> bool {
    lease
        .spec
        .as_ref()
        .and_then(|s| s.holder_identity.as_deref())
        == Some(identity)
}

/// What `main` parsed.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Namespace to watch; `None` watches all.
    pub watch_namespace: Option<String>,
    /// Namespace of the leader Lease (the operator's own).
    pub lease_namespace: String,
    /// Lease name.
    pub lease_name: String,
    /// This replica's identity (its pod name).
    pub identity: String,
    /// Whether to elect a leader at all (off for a single local run).
    pub leader_election: bool,
}

/// Runs the operator until shutdown or loss of leadership.
pub async fn run(client: Client, settings: Settings, health: Arc<Health>) -> anyhow::Result<()> {
    let gfds: Api<GlmFlashDeployment> = match &settings.watch_namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    if let Err(e) = gfds.list(&ListParams::default().limit(1)).await {
        anyhow::bail!(
            "cannot list GlmFlashDeployments ({e}); is the CRD installed (crds/glmflash.io_glmflashdeployments.yaml)?"
        );
    }
    let service_monitor_api = discovery::group(&client, MONITORING_GROUP).await.is_ok();
    info!(service_monitor_api, "startup checks passed");
    health.ready.store(true, Ordering::Relaxed);

    let ctx = Arc::new(Context::new(
        client.clone(),
        Recorder::new(
            client.clone(),
            Reporter {
                controller: FIELD_MANAGER.into(),
                instance: Some(settings.identity.clone()),
            },
        ),
        health.metrics.clone(),
        Arc::new(HttpScraper::new(Duration::from_secs(5))),
        service_monitor_api,
    ));

    let owned = watcher::Config::default().labels("app.kubernetes.io/managed-by=glmflash-operator");
    // Reclaim Jobs are not owned (garbage collection must not stop them half way): they
    // are watched by their labels, for the object being deleted.
    let reclaim = watcher::Config::default().labels(
        "app.kubernetes.io/managed-by=glmflash-operator,app.kubernetes.io/component=reclaim",
    );
    let (jobs, deployments, services): (Api<Job>, Api<Deployment>, Api<Service>) =
        match &settings.watch_namespace {
            Some(ns) => (
                Api::namespaced(client.clone(), ns),
                Api::namespaced(client.clone(), ns),
                Api::namespaced(client.clone(), ns),
            ),
            None => (
                Api::all(client.clone()),
                Api::all(client.clone()),
                Api::all(client.clone()),
            ),
        };
    let controller = Controller::new(gfds, watcher::Config::default().any_semantic())
        // One reconcile at a time: placement reads the nodes other objects hold from their
        // status, which a concurrent reconcile may not have written yet.
        .with_config(controller::Config::default().concurrency(1));
    let store = controller.store();
    let controller = controller
        .owns(jobs.clone(), owned.clone())
        .owns(deployments, owned.clone())
        .owns(services, owned)
        .watches(jobs, reclaim, |job| {
            let name = job.labels().get("app.kubernetes.io/instance")?.clone();
            Some(ObjectRef::new(&name).within(job.namespace()?.as_str()))
        })
        // A node that changes (ready, uncordoned, labelled, gone) may be where a pending
        // deployment fits, or where a placed one lives.
        .watches(
            Api::<Node>::all(client.clone()),
            watcher::Config::default(),
            move |node| {
                let name = node.name_any();
                store
                    .state()
                    .into_iter()
                    .filter(|g| {
                        // Placed replicas care about their own nodes; an object short of
                        // placed replicas may fit on any.
                        let status = g.status.clone().unwrap_or_default();
                        let placed: Vec<&str> = if status.replicas.is_empty() {
                            status.node.as_deref().into_iter().collect()
                        } else {
                            status.replicas.iter().map(|r| r.node.as_str()).collect()
                        };
                        placed.len() < usize::try_from(g.spec.replicas).unwrap_or(1)
                            || placed.contains(&name.as_str())
                    })
                    .map(|g| ObjectRef::from_obj(g.as_ref()))
                    .collect::<Vec<_>>()
            },
        )
        .shutdown_on_signal()
        .run(reconciler::reconcile, reconciler::error_policy, ctx)
        .for_each(|result| async move {
            // A failed reconcile was logged by the error policy; an object deleted while
            // queued is no news.
            match result {
                Ok((object, _)) => debug!(%object.name, ns = ?object.namespace, "reconciled"),
                Err(e) => debug!(error = %e, "reconcile not run"),
            }
        });

    if !settings.leader_election {
        health.metrics.leader.set(1);
        controller.await;
        return Ok(());
    }

    let leases: Api<Lease> = Api::namespaced(client.clone(), &settings.lease_namespace);
    let manager = LeaseManagerBuilder::new(client, &settings.lease_name)
        .with_namespace(&settings.lease_namespace)
        .with_identity(&settings.identity)
        .with_duration(LEASE_SECONDS as u64)
        .with_grace(5)
        .build()
        .await?;
    let (mut leader, lease_task) = manager.watch().await;
    info!(lease = %settings.lease_name, identity = %settings.identity, "waiting for the leader lease");
    while !*leader.borrow_and_update() {
        leader.changed().await?;
    }
    info!("acquired the leader lease; starting the controller");
    health.metrics.leader.set(1);

    let lost = async {
        loop {
            if leader.changed().await.is_err() || !*leader.borrow_and_update() {
                break;
            }
        }
    };
    // The lease manager retries renewals through an API outage and keeps saying "leader"
    // while the Lease expires and another replica takes it: step down on our own once
    // the Lease could not be read as ours for its whole duration.
    let unrenewed = async {
        let mut last_held = Timestamp::now();
        loop {
            tokio::time::sleep(LEASE_CHECK).await;
            let now = Timestamp::now();
            match leases.get(&settings.lease_name).await {
                Ok(lease) if held_by(&lease, &settings.identity) => last_held = now,
                Ok(_) => break,
                Err(e) => debug!(error = %e, "could not read the leader lease"),
            }
            if now.duration_since(last_held) > jiff::SignedDuration::from_secs(LEASE_SECONDS) {
                break;
            }
        }
    };
    // On a normal stop the Lease is not released: it expires after its 15 s duration and
    // the other replica takes over.
    let result = tokio::select! {
        () = controller => {
            info!("controller stopped");
            Ok(())
        }
        () = lost => {
            health.metrics.leader.set(0);
            error!("lost the leader lease; exiting so a restart rejoins as a follower");
            Err(anyhow::anyhow!("lost the leader lease"))
        }
        () = unrenewed => {
            health.metrics.leader.set(0);
            error!("the leader lease was not ours for its whole duration (API unreachable?); exiting");
            Err(anyhow::anyhow!("leader lease not renewed"))
        }
    };
    lease_task.abort();
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lease_is_held_only_under_our_identity() {
        let lease: Lease = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "glmflash-operator"},
            "spec": {"holderIdentity": "pod-a", "leaseDurationSeconds": 15}
        }))
        .unwrap();
        assert!(held_by(&lease, "pod-a"));
        assert!(!held_by(&lease, "pod-b"));
        assert!(!held_by(&Lease::default(), "pod-a"));
    }
}
