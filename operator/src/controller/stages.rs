//! The stages of one replica's reconcile, in order. Each either hands the next stage what
//! it decided or stops with the [`Outcome`] to report for that replica and the [`Action`]
//! that says when to look again; the last always stops. `fleet` runs them for every
//! replica and makes one status of what they say.
//!
//! Whether the model fits the chosen node's GPU and memory cap is the server's own memory
//! plan (`glmflash-node plan`'s arithmetic, run by `serve` on the real free VRAM, the pod's
//! cgroup cap and the store's records), not a second estimate here: the operator cannot see
//! a GPU's free memory or read the checkpoint. A server whose plan refuses writes
//! `{"planRefused": "<why, with the numbers>"}` to its termination message
//! (`--termination-log`) and exits; the server stage reads it from the pod, scales the
//! Deployment to zero, and reports `PlanFits=False` (and Ready, with a Warning Event) until
//! the spec changes. Placement ([`crate::placement`]) checks only what the cluster knows: a
//! free GPU and allocatable memory for the cap.

use std::ops::ControlFlow;

use glmflash_crds::{
    GlmFlashDeployment, GlmFlashDeploymentSpec, GlmFlashDeploymentStatus, LiveFigures, Phase,
    condition,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Event as CoreEvent, Node, Pod, Service};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch};
use kube::runtime::controller::Action;
use tracing::{info, warn};

use super::status::{Cond, Outcome};
use super::{
    Context, JobState, RUNNING_REQUEUE, WAITING_REQUEUE, apply_params, diagnose, ensure, job_state,
    key, remove,
};
use crate::Result;
use crate::builders::{self, Component, names};
use crate::placement::{self, Owner};
use crate::scrape;

/// What a stage returns: go on with `T`, or stop with what to report and when to look again.
pub(super) type Stage<T> = ControlFlow<(Outcome, Action), T>;

/// One replica as its stages see it: its index, what the old status says of it alone
/// (as if the object had only this replica), and the nodes the object's other replicas
/// hold, which it may not take (anti-affinity by node).
pub(super) struct Replica {
    pub(super) index: u32,
    pub(super) old: GlmFlashDeploymentStatus,
    pub(super) taken: Vec<String>,
    /// The refusal this generation's servers got from their memory plan, if any.
    pub(super) plan_refused: Option<Cond>,
}

/// The node chosen, and the condition that says so.
#[derive(Clone)]
pub(super) struct Placed {
    pub(super) node: String,
    pub(super) node_selected: Cond,
}

/// The store the server reads: the hash of its inputs, its size, and the condition.
#[derive(Clone)]
pub(super) struct Stored {
    pub(super) hash: String,
    pub(super) bytes: Option<u64>,
    pub(super) store_ready: Cond,
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
        plan_fits: None,
        ready: Cond::no("InvalidSpec", message),
        endpoint: None,
        store_hash: old.store_hash.clone(),
        store_bytes: old.store_bytes,
        live: None,
    };
    // Nothing to retry until the spec changes.
    ControlFlow::Break((outcome, Action::await_change()))
}

fn fits(spec: &GlmFlashDeploymentSpec, node: &str) -> Cond {
    let room = if spec.placement.require_gpu {
        "a free GPU and memory for the cap"
    } else {
        "memory for the cap"
    };
    Cond::yes("NodeFits", format!("node {node} matches and has {room}"))
}

/// Stage 2, place: the node in status stays while it matches the spec, and, after a spec
/// change or a wake, while it has room for it; a cordon or taint does not move a replica
/// whose pod still runs there. Otherwise the first node that fits and holds no other
/// replica; none fitting stops the replica until one might.
pub(super) async fn place(
    gfd: &GlmFlashDeployment,
    ctx: &Context,
    replica: &Replica,
) -> Result<Stage<Placed>> {
    let (old, taken) = (&replica.old, &replica.taken);
    let spec = &gfd.spec;
    let nodes: Api<Node> = Api::all(ctx.client.clone());
    let (name, namespace) = (gfd.name_any(), gfd.namespace().unwrap_or_default());
    let owner = Owner {
        name: &name,
        namespace: &namespace,
    };
    let mut leaving = None;
    if let Some(current) = old.node.as_deref() {
        match nodes.get_opt(current).await? {
            None => leaving = Some(format!("node {current} is gone")),
            Some(node) => match placement::spec_mismatch(spec, &node) {
                Some(why) => leaving = Some(format!("node {current} no longer matches: {why}")),
                None => {
                    // Room is checked again after every spec change, and until it fits.
                    let recheck = gfd.metadata.generation != old.observed_generation
                        || old
                            .conditions
                            .iter()
                            .any(|c| c.type_ == condition::NODE_SELECTED && c.status != "True");
                    let closed = placement::closed(spec, &node);
                    if !recheck && closed.is_none() {
                        return Ok(ControlFlow::Continue(placed(spec, current)));
                    }
                    let pods = pods_on(ctx, current).await?;
                    if recheck {
                        let others = all_objects(ctx).await?;
                        let reserved = placement::reservations(&others, current, owner);
                        match placement::no_room(spec, &node, &pods, owner, &reserved) {
                            // A waking replica whose GPU was taken meanwhile goes where
                            // it can serve, at the cost of a store there.
                            Some(why) if old.phase == Some(Phase::Hibernated) => {
                                leaving = Some(format!(
                                    "node {current} was taken while hibernated: {why}"
                                ));
                            }
                            Some(why) => {
                                return Ok(ControlFlow::Break(too_small(old, current, why)));
                            }
                            None => {}
                        }
                    }
                    match closed {
                        _ if leaving.is_some() => {}
                        Some(why) if !placement::owner_has_pod_on(&pods, current, owner) => {
                            leaving = Some(format!(
                                "node {current} is {why} and no pod of this deployment runs there"
                            ));
                        }
                        _ => return Ok(ControlFlow::Continue(placed(spec, current))),
                    }
                }
            },
        }
    }
    if let Some(why) = &leaving {
        info!(object = %key(gfd), %why, "placing again");
    }
    let mut all = nodes.list(&ListParams::default()).await?.items;
    all.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    let others = all_objects(ctx).await?;
    let mut reasons = Vec::new();
    for node in &all {
        let node_name = node.name_any();
        if taken.contains(&node_name) {
            reasons.push(format!("{node_name}: another replica of it runs there"));
            continue;
        }
        if let Some(why) = placement::mismatch(spec, node) {
            reasons.push(format!("{node_name}: {why}"));
            continue;
        }
        let pods = pods_on(ctx, &node_name).await?;
        let reserved = placement::reservations(&others, &node_name, owner);
        match placement::no_room(spec, node, &pods, owner, &reserved) {
            Some(why) => reasons.push(format!("{node_name}: {why}")),
            None => return Ok(ControlFlow::Continue(placed(spec, &node_name))),
        }
    }
    let mut why = placement::summarize(&reasons);
    if let Some(leaving) = leaving {
        why = format!("{leaving}; {why}");
    }
    let outcome = Outcome {
        phase: Phase::Pending,
        node: None,
        node_selected: Some(Cond::no("NoFittingNode", why.clone())),
        store_ready: Some(Cond::no("WaitingForNode", "no node chosen yet")),
        server_ready: Some(Cond::no("WaitingForNode", "no node chosen yet")),
        plan_fits: None,
        ready: Cond::no("NoFittingNode", why),
        endpoint: None,
        store_hash: old.store_hash.clone(),
        store_bytes: old.store_bytes,
        live: None,
    };
    Ok(ControlFlow::Break((
        outcome,
        Action::requeue(WAITING_REQUEUE),
    )))
}

fn placed(spec: &GlmFlashDeploymentSpec, node: &str) -> Placed {
    Placed {
        node: node.to_string(),
        node_selected: fits(spec, node),
    }
}

/// The spec no longer fits its node: say so, hold the node, and leave what runs there
/// alone (rolling it would only leave an unschedulable pod).
fn too_small(old: &GlmFlashDeploymentStatus, node: &str, why: String) -> (Outcome, Action) {
    let message = format!("node {node} has no room for the spec: {why}");
    let outcome = Outcome {
        phase: Phase::Pending,
        node: Some(node.to_string()),
        node_selected: Some(Cond::no("NodeTooSmall", message.clone())),
        store_ready: None,
        server_ready: None,
        plan_fits: None,
        ready: Cond::trouble(
            "NodeTooSmall",
            format!("{message}; the server keeps its previous spec"),
        ),
        endpoint: old.endpoint.clone(),
        store_hash: old.store_hash.clone(),
        store_bytes: old.store_bytes,
        live: None,
    };
    (outcome, Action::requeue(WAITING_REQUEUE))
}

async fn pods_on(ctx: &Context, node: &str) -> Result<Vec<Pod>> {
    let pods: Api<Pod> = Api::all(ctx.client.clone());
    Ok(pods
        .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
        .await?
        .items)
}

/// Every `GlmFlashDeployment` in the cluster, for the nodes their status holds.
async fn all_objects(ctx: &Context) -> Result<Vec<GlmFlashDeployment>> {
    let api: Api<GlmFlashDeployment> = Api::all(ctx.client.clone());
    Ok(api.list(&ListParams::default()).await?.items)
}

/// Stage 3, store: a store whose input hash is in status is built. Else pack-store Jobs of
/// other hashes on the node are stopped and removed first (one writer per object and
/// node), then the Job for the new hash is created if missing; a Complete one means the
/// node already holds that store (a replica that comes back to a node whose store was
/// retained packs nothing). While it runs or after it failed the replica stops there, with
/// a server from an older store scaled to zero. Jobs on other nodes belong to the other
/// replicas, or are what a retained store on a node left behind.
pub(super) async fn store(
    gfd: &GlmFlashDeployment,
    ctx: &Context,
    ns: &str,
    replica: &Replica,
    placed: &Placed,
) -> Result<Stage<Stored>> {
    let old = &replica.old;
    let (name, node) = (gfd.name_any(), &placed.node);
    let hash = builders::store_hash(&gfd.spec, node);
    let mut bytes = old.store_bytes;
    if old.store_hash.as_deref() != Some(hash.as_str()) {
        let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), ns);
        let job_name = names::pack_job(&name, &hash);
        let selector = builders::selector(&name, Component::PackStore);
        let listed = jobs
            .list(&ListParams::default().labels(&selector))
            .await?
            .items
            .into_iter()
            .filter(|j| builders::pinned_node(j).as_deref() == Some(node.as_str()));
        let (mut current, mut others): (Vec<Job>, Vec<Job>) = listed
            .partition(|j| j.name_any() == job_name && j.metadata.deletion_timestamp.is_none());
        // A Job of other inputs started after ours removed our store when it began: ours
        // must run again before its Complete means anything.
        if let Some(ours) = current.first()
            && others
                .iter()
                .any(|o| o.metadata.creation_timestamp >= ours.metadata.creation_timestamp)
        {
            others.append(&mut current);
        }
        let mut stopping = Vec::new();
        for job in &others {
            let this = job.name_any();
            if job.metadata.deletion_timestamp.is_none() {
                // Foreground: the Job is gone only once its pods are, so no two write.
                jobs.delete(&this, &DeleteParams::foreground()).await?;
            }
            if job_state(job) == JobState::Running || this == job_name {
                stopping.push(this);
            }
        }
        let current = current.pop();
        let waiting = if !stopping.is_empty() {
            Some((
                Phase::PackingStore,
                Cond::no(
                    "StoppingOldJob",
                    format!(
                        "waiting for pack-store Job {} to stop before {job_name} packs inputs {hash}",
                        stopping.join(", ")
                    ),
                ),
                Action::requeue(WAITING_REQUEUE),
            ))
        } else {
            let job = match current {
                Some(job) => job,
                None => {
                    let desired = builders::pack_job(gfd, node, &hash);
                    jobs.patch(&job_name, &apply_params(), &Patch::Apply(&desired))
                        .await?
                }
            };
            match job_state(&job) {
                JobState::Complete => {
                    bytes = read_store_bytes(ctx, ns, &job_name).await?;
                    None
                }
                JobState::Running => {
                    let trouble = job_trouble(ctx, ns, &job_name).await?;
                    let packing = Cond::no(
                        "Packing",
                        format!("pack-store Job {job_name} is running on {node}"),
                    );
                    Some((
                        Phase::PackingStore,
                        trouble.unwrap_or(packing),
                        Action::requeue(WAITING_REQUEUE),
                    ))
                }
                JobState::Failed(why) => Some((
                    Phase::Failed,
                    Cond::trouble(
                        "PackStoreFailed",
                        format!(
                            "pack-store Job {job_name} failed after {} retries ({why}); fix the cause and delete the Job to retry",
                            gfd.spec.store.pack_retries
                        ),
                    ),
                    Action::await_change(),
                )),
            }
        };
        if let Some((phase, store_ready, action)) = waiting {
            // A server from an older store stops: it must not hold the GPU and memory
            // the new one needs, nor serve the old inputs under the new spec.
            let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), ns);
            let server = names::replica(&name, replica.index);
            if let Some(existing) = deployments.get_opt(&server).await?
                && existing.spec.as_ref().and_then(|s| s.replicas) != Some(0)
            {
                let serving = old.store_hash.as_deref().unwrap_or(&hash);
                let scaled = builders::server_deployment(gfd, replica.index, node, serving, 0);
                deployments
                    .patch(&server, &apply_params(), &Patch::Apply(&scaled))
                    .await?;
            }
            let ready = store_ready.clone();
            let outcome = Outcome {
                phase,
                node: Some(node.clone()),
                node_selected: Some(placed.node_selected.clone()),
                store_ready: Some(store_ready),
                server_ready: Some(Cond::no("WaitingForStore", "the store is not ready")),
                plan_fits: None,
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
            builders::store_dir(gfd, &hash)
        ),
    );
    Ok(ControlFlow::Continue(Stored {
        hash,
        bytes,
        store_ready,
    }))
}

/// Why a running pack-store Job makes no progress, if its pods or Events say.
async fn job_trouble(ctx: &Context, ns: &str, job: &str) -> Result<Option<Cond>> {
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    let list = pods
        .list(&ListParams::default().labels(&format!("batch.kubernetes.io/job-name={job}")))
        .await?
        .items;
    if !list.is_empty() {
        return Ok(diagnose::pod_trouble(&list));
    }
    let events: Api<CoreEvent> = Api::namespaced(ctx.client.clone(), ns);
    let list = events
        .list(&ListParams::default().fields(&format!(
            "involvedObject.kind=Job,involvedObject.name={job},reason=FailedCreate"
        )))
        .await?
        .items;
    Ok(diagnose::failed_create(
        &list,
        &format!("pack-store Job {job}"),
    ))
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

/// Stage 4a, server: the replica's Deployment, on its node, reading its store.
pub(super) async fn deploy(
    gfd: &GlmFlashDeployment,
    ctx: &Context,
    ns: &str,
    replica: &Replica,
    placed: &Placed,
    stored: &Stored,
) -> Result<Deployment> {
    let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), ns);
    // A server whose plan refused this generation stays at zero until the spec changes.
    let servers = if replica.plan_refused.is_some() { 0 } else { 1 };
    ensure(
        &deployments,
        builders::server_deployment(gfd, replica.index, &placed.node, &stored.hash, servers),
    )
    .await
}

/// Stage 4b, once for every replica: the API and metrics Services, and the ServiceMonitor
/// and dashboard as the spec asks. Returns what Ready should note.
pub(super) async fn front(
    gfd: &GlmFlashDeployment,
    ctx: &Context,
    ns: &str,
) -> Result<Vec<&'static str>> {
    let name = gfd.name_any();
    let services: Api<Service> = Api::namespaced(ctx.client.clone(), ns);
    ensure(&services, builders::api_service(gfd)).await?;
    ensure(&services, builders::metrics_service(gfd)).await?;

    let mut notes = Vec::new();
    if ctx
        .service_monitor_api(gfd.spec.metrics.service_monitor)
        .await
    {
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
    Ok(notes)
}

/// The server pods of one replica (replica 0's carry no replica label).
async fn replica_pods(
    gfd: &GlmFlashDeployment,
    ctx: &Context,
    ns: &str,
    index: u32,
) -> Result<Vec<Pod>> {
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    let selector = builders::selector(&gfd.name_any(), Component::Server);
    let list = pods.list(&ListParams::default().labels(&selector)).await?;
    Ok(list
        .items
        .into_iter()
        .filter(|p| builders::replica_of(p.metadata.labels.as_ref()) == index)
        .collect())
}

/// Stage 4c, the replica's server: once its pod is available, live figures from that
/// pod's `/metrics` (each replica's tiers are its own); else why it does not run. Always
/// the last stage: it says what to report.
#[allow(clippy::too_many_arguments)]
pub(super) async fn serving(
    gfd: &GlmFlashDeployment,
    ctx: &Context,
    ns: &str,
    replica: &Replica,
    deployment: &Deployment,
    placed: Placed,
    stored: Stored,
    notes: &[&str],
) -> Result<(Outcome, Action)> {
    let old = &replica.old;
    let mut notes = notes.to_vec();
    let endpoint = builders::endpoint(gfd);
    if let Some(refusal) = &replica.plan_refused {
        return Ok(plan_does_not_fit(&placed, stored, refusal.clone()));
    }
    let available = deployment
        .status
        .as_ref()
        .filter(|s| s.observed_generation >= deployment.metadata.generation)
        .and_then(|s| s.available_replicas)
        .unwrap_or(0);
    let (phase, server_ready, plan_fits, ready, live, action) = if available >= 1 {
        let pods = replica_pods(gfd, ctx, ns, replica.index).await?;
        let live = match builders::pod_metrics_url(gfd, &pods) {
            None => old.live.clone(),
            Some(url) => match ctx.scraper.fetch(url).await {
                Ok(text) => Some(scrape::live_figures(&scrape::parse_exposition(&text))),
                Err(why) => {
                    warn!(object = %key(gfd), replica = replica.index, %why, "could not read server metrics");
                    // The last figures stay, but whether it holds requests now is unknown.
                    old.live.clone().map(|live| LiveFigures {
                        active_requests: None,
                        ..live
                    })
                }
            },
        };
        if live
            .as_ref()
            .and_then(|l| l.pin_failures)
            .is_some_and(|n| n > 0)
        {
            notes.push("the RAM tier is not pinned (the kernel refused mlock; see status.live.pinFailures)");
        }
        let mut message = format!("serving {endpoint}");
        for note in &notes {
            message.push_str("; ");
            message.push_str(note);
        }
        (
            Phase::Running,
            Cond::yes("Available", format!("{available} server replica available")),
            Some(Cond::yes(
                "PlanFits",
                format!("the server's memory plan fits node {}", placed.node),
            )),
            Cond::yes("Serving", message),
            live,
            Action::requeue(RUNNING_REQUEUE),
        )
    } else {
        let trouble = match diagnose::deployment_trouble(deployment) {
            Some(trouble) => Some(trouble),
            None => {
                let pods = replica_pods(gfd, ctx, ns, replica.index).await?;
                if let Some(why) = diagnose::plan_refusal(&pods) {
                    // Restarting cannot help: stop the server until the spec changes.
                    let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), ns);
                    let stopped = builders::server_deployment(
                        gfd,
                        replica.index,
                        &placed.node,
                        &stored.hash,
                        0,
                    );
                    let server = names::replica(&gfd.name_any(), replica.index);
                    deployments
                        .patch(&server, &apply_params(), &Patch::Apply(&stopped))
                        .await?;
                    let refusal = Cond::trouble(
                        "PlanDoesNotFit",
                        format!(
                            "the server's memory plan refuses node {}: {why}; the server is \
                             stopped until the spec changes",
                            placed.node
                        ),
                    );
                    return Ok(plan_does_not_fit(&placed, stored, refusal));
                }
                diagnose::pod_trouble(&pods)
            }
        };
        let (server_ready, ready) = match trouble {
            Some(trouble) => (trouble.clone(), trouble),
            None => (
                Cond::no(
                    "Starting",
                    "the server is loading the model (startup probe pending)",
                ),
                Cond::no("Starting", "the server is loading the model"),
            ),
        };
        (
            Phase::Starting,
            server_ready,
            None,
            ready,
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
        plan_fits,
        ready,
        endpoint: Some(endpoint),
        store_hash: Some(stored.hash),
        store_bytes: stored.bytes,
        live,
    };
    Ok((outcome, action))
}

/// The refusal this generation's server already got from its memory plan (PlanFits False
/// decided for this generation): the server stays at zero replicas until the spec changes.
pub(super) fn plan_refused(
    old: &GlmFlashDeploymentStatus,
    generation: Option<i64>,
) -> Option<Cond> {
    old.conditions
        .iter()
        .find(|c| {
            c.type_ == condition::PLAN_FITS
                && c.status == "False"
                && c.observed_generation == generation
        })
        .map(|c| Cond::trouble("PlanDoesNotFit", c.message.clone()))
}

/// The server's memory plan refused the node: Failed, with the plan's numbers in PlanFits,
/// ServerReady and Ready, looked at again when the spec changes.
fn plan_does_not_fit(placed: &Placed, stored: Stored, refusal: Cond) -> (Outcome, Action) {
    let outcome = Outcome {
        phase: Phase::Failed,
        node: Some(placed.node.clone()),
        node_selected: Some(placed.node_selected.clone()),
        store_ready: Some(stored.store_ready),
        server_ready: Some(refusal.clone()),
        plan_fits: Some(refusal.clone()),
        ready: refusal,
        endpoint: None,
        store_hash: Some(stored.hash),
        store_bytes: stored.bytes,
        live: None,
    };
    (outcome, Action::await_change())
}
