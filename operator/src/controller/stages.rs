//! The stages of one reconcile, in order. Each either hands the next stage what it
//! decided or stops the reconcile with the [`Outcome`] to report and the [`Action`] that
//! says when to look again; the last always stops.

use std::ops::ControlFlow;

use glmflash_crds::{GlmFlashDeployment, GlmFlashDeploymentStatus, Phase};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod, Service};
use kube::ResourceExt;
use kube::api::{Api, DynamicObject, ListParams, Patch};
use kube::runtime::controller::Action;
use tracing::warn;

use super::status::{Cond, Outcome};
use super::{
    Context, JobState, RUNNING_REQUEUE, WAITING_REQUEUE, apply_params, ensure, job_state, key,
    remove,
};
use crate::Result;
use crate::builders::{self, names};
use crate::placement::{self, Owner};
use crate::scrape;

/// What a stage returns: go on with `T`, or stop with what to report and when to look again.
pub(super) type Stage<T> = ControlFlow<(Outcome, Action), T>;

/// The node chosen, and the condition that says so.
pub(super) struct Placed {
    node: String,
    node_selected: Cond,
}

/// The store the server reads: the hash of its inputs, its size, and the condition.
pub(super) struct Stored {
    hash: String,
    bytes: Option<u64>,
    store_ready: Cond,
}

/// Stage 1, validate: a bad spec stops the reconcile until the spec changes.
pub(super) fn validate(gfd: &GlmFlashDeployment, old: &GlmFlashDeploymentStatus) -> Stage<()> {
    let invalid = gfd.validate();
    if invalid.is_empty() {
        return ControlFlow::Continue(());
    }
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
    // Nothing to retry until the spec changes.
    ControlFlow::Break((outcome, Action::await_change()))
}

/// Stage 2, place: the node in status while it still matches, else the first that fits;
/// none fitting stops the reconcile until one might.
pub(super) async fn place(
    gfd: &GlmFlashDeployment,
    ctx: &Context,
    old: &GlmFlashDeploymentStatus,
) -> Result<Stage<Placed>> {
    Ok(match fitting_node(gfd, ctx).await? {
        Ok(node) => ControlFlow::Continue(Placed {
            node_selected: Cond::yes(
                "NodeFits",
                format!("node {node} matches and has a free GPU and memory for the cap"),
            ),
            node,
        }),
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
            ControlFlow::Break((outcome, Action::requeue(WAITING_REQUEUE)))
        }
    })
}

/// The node to use, or why none fits.
async fn fitting_node(gfd: &GlmFlashDeployment, ctx: &Context) -> Result<Result<String, String>> {
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

/// Stage 3, store: a store whose input hash is in status is built; else the pack-store
/// Job for the new hash, created if missing. While it runs or after it failed the
/// reconcile stops there, with a server from an older store scaled to zero.
pub(super) async fn store(
    gfd: &GlmFlashDeployment,
    ctx: &Context,
    ns: &str,
    old: &GlmFlashDeploymentStatus,
    placed: &Placed,
) -> Result<Stage<Stored>> {
    let (name, node) = (gfd.name_any(), &placed.node);
    let hash = builders::store_hash(&gfd.spec, node);
    let mut bytes = old.store_bytes;
    if old.store_hash.as_deref() != Some(hash.as_str()) {
        let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), ns);
        let job_name = names::pack_job(&name, &hash);
        let job = match jobs.get_opt(&job_name).await? {
            Some(job) => job,
            None => {
                let desired = builders::pack_job(gfd, node, &hash);
                jobs.patch(&job_name, &apply_params(), &Patch::Apply(&desired))
                    .await?
            }
        };
        let waiting = match job_state(&job) {
            JobState::Complete => {
                bytes = read_store_bytes(ctx, ns, &job_name).await?;
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
            let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), ns);
            if let Some(existing) = deployments.get_opt(&name).await?
                && existing.spec.as_ref().and_then(|s| s.replicas) != Some(0)
            {
                let scaled = builders::server_deployment(gfd, node, 0);
                deployments
                    .patch(&name, &apply_params(), &Patch::Apply(&scaled))
                    .await?;
            }
            let ready = Cond::no(store_ready.reason, store_ready.message.clone());
            let outcome = Outcome {
                phase,
                node: Some(node.clone()),
                node_selected: Some(placed.node_selected.clone()),
                store_ready: Some(store_ready),
                server_ready: Some(Cond::no("WaitingForStore", "the store is not ready")),
                ready,
                endpoint: None,
                store_hash: None,
                store_bytes: None,
                live: None,
            };
            return Ok(ControlFlow::Break((outcome, action)));
        }
    }
    let store_ready = Cond::yes(
        "StoreBuilt",
        format!(
            "store {} on {node} built from inputs {hash}",
            builders::store_dir(&gfd.spec)
        ),
    );
    Ok(ControlFlow::Continue(Stored {
        hash,
        bytes,
        store_ready,
    }))
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

/// Stage 4, server: the Deployment, the Services, and the ServiceMonitor and dashboard as
/// the spec asks; once a replica is available, live figures from its `/metrics`. Always
/// the last stage: it says what to report.
pub(super) async fn server(
    gfd: &GlmFlashDeployment,
    ctx: &Context,
    ns: &str,
    old: &GlmFlashDeploymentStatus,
    placed: Placed,
    stored: Stored,
) -> Result<(Outcome, Action)> {
    let name = gfd.name_any();
    let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), ns);
    let deployment = ensure(
        &deployments,
        builders::server_deployment(gfd, &placed.node, 1),
    )
    .await?;
    let services: Api<Service> = Api::namespaced(ctx.client.clone(), ns);
    ensure(&services, builders::api_service(gfd)).await?;
    ensure(&services, builders::metrics_service(gfd)).await?;

    let mut notes = Vec::new();
    if ctx.service_monitor_api {
        let monitors: Api<DynamicObject> = Api::namespaced_with(
            ctx.client.clone(),
            ns,
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
    let config_maps: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), ns);
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
        node: Some(placed.node),
        node_selected: Some(placed.node_selected),
        store_ready: Some(stored.store_ready),
        server_ready: Some(server_ready),
        ready,
        endpoint: Some(endpoint),
        store_hash: Some(stored.hash),
        store_bytes: stored.bytes,
        live,
    };
    Ok((outcome, action))
}
