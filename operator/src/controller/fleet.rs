//! The fleet: `spec.replicas` servers, each on its own node with its own store, behind the
//! one Service; a scale-down drains; hibernation stops them all and releases the GPUs.
//!
//! Each replica runs the stages (place, store, server) as if the object had only it, from
//! what status says of it ([`view`]); replica 0 keeps the names of a single server, so an
//! object from before replicas carries on unchanged. What the replicas' stages decided then
//! becomes one status ([`combine`], pure): each replica's node, phase and live figures,
//! `ready/desired`, and conditions that hold only when they hold for every replica, naming
//! the first replica for which they do not.

use std::ops::ControlFlow;

use glmflash_crds::{
    GlmFlashDeployment, GlmFlashDeploymentStatus, Phase, ReclaimPolicy, ReplicaStatus, condition,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch};
use kube::runtime::controller::Action;

use super::stages::{self, Replica};
use super::status::{self, Cond, Outcome, Replicas};
use super::{
    Context, JobState, RUNNING_REQUEUE, WAITING_REQUEUE, apply_params, deletion, job_state, remove,
};
use crate::Result;
use crate::builders::{self, names};

/// What one reconcile of the fleet reports: the object's outcome, when to look again, and
/// each replica.
pub(super) type Report = (Outcome, Action, Replicas);

/// The replicas status names; an object written before replicas existed has its one node
/// as replica 0.
pub(super) fn entries(old: &GlmFlashDeploymentStatus) -> Vec<ReplicaStatus> {
    if !old.replicas.is_empty() {
        return old.replicas.clone();
    }
    old.node
        .iter()
        .map(|node| ReplicaStatus {
            index: 0,
            node: node.clone(),
            phase: old.phase.unwrap_or(Phase::Pending),
            message: None,
            store_hash: old.store_hash.clone(),
            store_bytes: old.store_bytes,
            live: old.live.clone(),
        })
        .collect()
}

/// What the stages of one replica read: the old status as if the object had only this
/// replica. A replica that was pending on its node or hibernated checks the node's room
/// again (its NodeSelected was not true).
pub(super) fn view(
    old: &GlmFlashDeploymentStatus,
    entry: Option<&ReplicaStatus>,
) -> GlmFlashDeploymentStatus {
    let mut view = GlmFlashDeploymentStatus {
        observed_generation: old.observed_generation,
        ..GlmFlashDeploymentStatus::default()
    };
    let Some(entry) = entry else {
        return view;
    };
    view.phase = Some(entry.phase);
    view.node = Some(entry.node.clone());
    view.endpoint = old.endpoint.clone();
    view.store_hash = entry.store_hash.clone();
    view.store_bytes = entry.store_bytes;
    view.live = entry.live.clone();
    if matches!(entry.phase, Phase::Pending | Phase::Hibernated) {
        view.conditions.push(Condition {
            type_: condition::NODE_SELECTED.into(),
            status: "False".into(),
            reason: entry.phase.as_str().into(),
            message: entry.message.clone().unwrap_or_default(),
            observed_generation: old.observed_generation,
            last_transition_time: Time(jiff::Timestamp::UNIX_EPOCH),
        });
    }
    view
}

/// Every replica up to `spec.replicas` through its stages, then the Services once some
/// replica has its server, then each server's state; replicas past the count drain.
pub(super) async fn serve(
    gfd: &GlmFlashDeployment,
    ctx: &Context,
    ns: &str,
    old: &GlmFlashDeploymentStatus,
) -> Result<Report> {
    let desired = u32::try_from(gfd.spec.replicas).unwrap_or(1).max(1);
    let known = entries(old);
    let entry = |index: u32| known.iter().find(|e| e.index == index);
    // Each replica's node as decided so far: this round's for those done, the old one
    // for those to come, so no replica takes another's node.
    let mut nodes: Vec<Option<String>> = (0..desired)
        .map(|i| entry(i).map(|e| e.node.clone()))
        .collect();
    let mut results: Vec<(u32, Outcome, Action)> = Vec::new();
    let mut deployed = Vec::new();
    for index in 0..desired {
        let slot = index as usize;
        let replica = Replica {
            index,
            old: view(old, entry(index)),
            taken: nodes
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != slot)
                .filter_map(|(_, n)| n.clone())
                .collect(),
            plan_refused: stages::plan_refused(old, gfd.metadata.generation),
        };
        let placed = match stages::place(gfd, ctx, &replica).await? {
            ControlFlow::Continue(placed) => placed,
            ControlFlow::Break((outcome, action)) => {
                nodes[slot] = outcome.node.clone();
                results.push((index, outcome, action));
                continue;
            }
        };
        nodes[slot] = Some(placed.node.clone());
        let stored = match stages::store(gfd, ctx, ns, &replica, &placed).await {
            Ok(ControlFlow::Continue(stored)) => stored,
            Ok(ControlFlow::Break((outcome, action))) => {
                results.push((index, outcome, action));
                continue;
            }
            Err(e) => {
                let (outcome, action) = status::refused(status::refusal(e)?, &placed, None);
                results.push((index, outcome, action));
                continue;
            }
        };
        match stages::deploy(gfd, ctx, ns, &replica, &placed, &stored).await {
            Ok(deployment) => deployed.push((replica, placed, stored, deployment)),
            Err(e) => {
                let trouble = status::refusal(e)?;
                let (outcome, action) = status::refused(trouble, &placed, Some(&stored));
                results.push((index, outcome, action));
            }
        }
    }
    if !deployed.is_empty() {
        match stages::front(gfd, ctx, ns).await {
            Ok(notes) => {
                for (replica, placed, stored, deployment) in deployed {
                    let index = replica.index;
                    let (outcome, action) = match stages::serving(
                        gfd,
                        ctx,
                        ns,
                        &replica,
                        &deployment,
                        placed.clone(),
                        stored.clone(),
                        &notes,
                    )
                    .await
                    {
                        Ok(done) => done,
                        Err(e) => status::refused(status::refusal(e)?, &placed, Some(&stored)),
                    };
                    results.push((index, outcome, action));
                }
            }
            Err(e) => {
                let trouble = status::refusal(e)?;
                for (replica, placed, stored, _) in deployed {
                    let (outcome, action) =
                        status::refused(trouble.clone(), &placed, Some(&stored));
                    results.push((replica.index, outcome, action));
                }
            }
        }
    }
    results.sort_by_key(|(index, _, _)| *index);
    let mut draining = Vec::new();
    for leaving in known.iter().filter(|e| e.index >= desired) {
        draining.extend(drain(gfd, ctx, ns, leaving).await?);
    }
    Ok(combine(desired, results, draining))
}

/// A replica past `spec.replicas`: its Deployment is deleted, so its pod gets SIGTERM and
/// drains (the server finishes in-flight requests and saves its routing history); once it
/// is gone, with reclaim policy `Delete` its store and history go too, and with `Retain`
/// they stay, with the pack-store Job that says so, for a replica that comes back there.
/// `Some` while it is on its way out: it holds its node until then.
async fn drain(
    gfd: &GlmFlashDeployment,
    ctx: &Context,
    ns: &str,
    entry: &ReplicaStatus,
) -> Result<Option<ReplicaStatus>> {
    let name = gfd.name_any();
    let node = &entry.node;
    let still = |message: String| {
        Some(ReplicaStatus {
            phase: Phase::Draining,
            message: Some(message),
            live: None,
            ..entry.clone()
        })
    };
    let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), ns);
    let server = names::replica(&name, entry.index);
    if let Some(existing) = deployments.get_opt(&server).await? {
        if existing.metadata.deletion_timestamp.is_none() {
            // Foreground: the Deployment is gone only once its pod is.
            deployments
                .delete(&server, &DeleteParams::foreground())
                .await?;
        }
        return Ok(still(format!(
            "scaled down: the server on {node} is draining"
        )));
    }
    if gfd.spec.store.reclaim_policy == ReclaimPolicy::Retain {
        return Ok(None);
    }
    let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), ns);
    let job_name = names::reclaim_job(&name, entry.index);
    let Some(job) = jobs.get_opt(&job_name).await? else {
        let with_download = !deletion::download_shared(gfd, ctx, node).await?;
        let desired = builders::reclaim_job(gfd, entry.index, node, with_download);
        jobs.patch(&job_name, &apply_params(), &Patch::Apply(&desired))
            .await?;
        return Ok(still(format!(
            "scaled down: reclaim Job {job_name} is removing the store on {node}"
        )));
    };
    match job_state(&job) {
        JobState::Running => {
            return Ok(still(format!(
                "scaled down: reclaim Job {job_name} is removing the store on {node}"
            )));
        }
        JobState::Failed(why) => {
            deletion::reclaim_failed(ctx, gfd, node, &why, "ScaleDown").await?;
        }
        JobState::Complete => {}
    }
    // The store is gone: so goes the Job whose Complete said it was there, and the reclaim
    // Job, so that a later scale-down of this index runs its own.
    if let Some(hash) = &entry.store_hash {
        remove(&jobs, &names::pack_job(&name, hash)).await?;
    }
    jobs.delete(&job_name, &DeleteParams::background()).await?;
    Ok(None)
}

/// Hibernation: every replica's server is scaled to zero (its pod saves the routing history
/// on SIGTERM) and its node released for others, while its store, history and the
/// Services stay; each replica keeps its node in status, so the wake goes back there when
/// the node still has room, and finds the store built.
pub(super) async fn hibernate(
    gfd: &GlmFlashDeployment,
    ctx: &Context,
    ns: &str,
    old: &GlmFlashDeploymentStatus,
) -> Result<Report> {
    let name = gfd.name_any();
    let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), ns);
    let mut stopping = 0;
    let mut each = Vec::new();
    for entry in entries(old) {
        let server = names::replica(&name, entry.index);
        if let Some(existing) = deployments.get_opt(&server).await? {
            if existing.metadata.deletion_timestamp.is_none()
                && existing.spec.as_ref().and_then(|s| s.replicas) != Some(0)
            {
                let hash = entry
                    .store_hash
                    .clone()
                    .unwrap_or_else(|| builders::store_hash(&gfd.spec, &entry.node));
                let stopped = builders::server_deployment(gfd, entry.index, &entry.node, &hash, 0);
                deployments
                    .patch(&server, &apply_params(), &Patch::Apply(&stopped))
                    .await?;
            }
            stopping += existing
                .status
                .as_ref()
                .and_then(|s| s.replicas)
                .unwrap_or(0);
        }
        each.push(ReplicaStatus {
            phase: Phase::Hibernated,
            message: Some("hibernated; its store and routing history stay on the node".into()),
            live: None,
            ..entry
        });
    }
    let message = if stopping > 0 {
        format!("hibernating: {stopping} server pod(s) stopping and saving their routing history")
    } else {
        "hibernated: no server runs and no GPU is held; the stores and routing histories stay on the nodes, and spec.hibernate: false (or removing the glmflash.io/hibernate annotation) wakes it".into()
    };
    let outcome = Outcome {
        phase: Phase::Hibernated,
        node: old.node.clone(),
        node_selected: Some(Cond::no(
            "Hibernated",
            "no GPU is held; a wake checks the node's room again",
        )),
        store_ready: None,
        server_ready: Some(Cond::no("Hibernated", message.clone())),
        plan_fits: None,
        ready: Cond::no("Hibernated", message),
        endpoint: old.endpoint.clone(),
        store_hash: old.store_hash.clone(),
        store_bytes: old.store_bytes,
        live: None,
    };
    let action = if stopping > 0 {
        Action::requeue(WAITING_REQUEUE)
    } else {
        Action::await_change()
    };
    let desired = gfd.spec.replicas.max(1);
    let replicas = Replicas {
        each,
        ready: Some(format!("0/{desired}")),
    };
    Ok((outcome, action, replicas))
}

/// One status from each replica's outcome (sorted by index, replica 0 first) and the
/// replicas still draining. One replica alone is reported as it is; with more, the object
/// is `Running` while any replica serves, and each condition holds only when it holds for
/// all, else it says why for the first replica it does not.
pub(super) fn combine(
    desired: u32,
    mut results: Vec<(u32, Outcome, Action)>,
    draining: Vec<ReplicaStatus>,
) -> Report {
    let serving = results
        .iter()
        .filter(|(_, o, _)| o.phase == Phase::Running)
        .count();
    let action = if !draining.is_empty()
        || results
            .iter()
            .any(|(_, _, a)| *a == Action::requeue(WAITING_REQUEUE))
    {
        Action::requeue(WAITING_REQUEUE)
    } else if results
        .iter()
        .any(|(_, _, a)| *a == Action::requeue(RUNNING_REQUEUE))
    {
        Action::requeue(RUNNING_REQUEUE)
    } else {
        Action::await_change()
    };
    let mut each: Vec<ReplicaStatus> = results
        .iter()
        .filter_map(|(index, o, _)| {
            Some(ReplicaStatus {
                index: *index,
                node: o.node.clone()?,
                phase: o.phase,
                message: (!o.ready.ok).then(|| o.ready.message.clone()),
                store_hash: o.store_hash.clone(),
                store_bytes: o.store_bytes,
                live: o.live.clone(),
            })
        })
        .collect();
    each.extend(draining);
    let replicas = Replicas {
        each,
        ready: Some(format!("{serving}/{desired}")),
    };
    if results.len() == 1 {
        let (_, outcome, _) = results.pop().expect("one result");
        return (outcome, action, replicas);
    }
    let phase = if serving > 0 {
        Phase::Running
    } else if results.iter().any(|(_, o, _)| o.phase == Phase::Failed) {
        Phase::Failed
    } else {
        // The replica furthest behind says where the object is.
        let rank = |p: Phase| match p {
            Phase::Pending => 0,
            Phase::PackingStore => 1,
            _ => 2,
        };
        results
            .iter()
            .map(|(_, o, _)| o.phase)
            .min_by_key(|p| rank(*p))
            .unwrap_or(Phase::Pending)
    };
    let all = |pick: fn(&Outcome) -> Option<&Cond>| -> Option<Cond> {
        let conds: Vec<(u32, &Cond)> = results
            .iter()
            .filter_map(|(i, o, _)| pick(o).map(|c| (*i, c)))
            .collect();
        let first = conds.first()?;
        Some(match conds.iter().find(|(_, c)| !c.ok) {
            Some((i, c)) => Cond {
                message: format!("replica {i}: {}", c.message),
                warn: conds.iter().any(|(_, c)| c.warn),
                ..(*c).clone()
            },
            None => Cond::yes(
                first.1.reason,
                conds
                    .iter()
                    .map(|(i, c)| format!("replica {i}: {}", c.message))
                    .collect::<Vec<_>>()
                    .join("; "),
            ),
        })
    };
    let (node_selected, store_ready, server_ready) = (
        all(|o| o.node_selected.as_ref()),
        all(|o| o.store_ready.as_ref()),
        all(|o| o.server_ready.as_ref()),
    );
    let total = results.len();
    let ready = match results.iter().find(|(_, o, _)| !o.ready.ok) {
        None => Cond::yes(
            "Serving",
            format!("{total} of {total} replicas {}", results[0].1.ready.message),
        ),
        Some((i, o, _)) => Cond {
            message: format!(
                "{serving} of {total} replicas serving; replica {i}: {}",
                o.ready.message
            ),
            warn: results.iter().any(|(_, o, _)| o.ready.warn),
            ..o.ready.clone()
        },
    };
    let endpoint = results.iter().find_map(|(_, o, _)| o.endpoint.clone());
    // A refusal by any replica's plan is the object's; else what the replicas decided.
    let plan_fits = results
        .iter()
        .filter_map(|(_, o, _)| o.plan_fits.clone())
        .max_by_key(|c| !c.ok);
    let (_, first, _) = results.swap_remove(0);
    let outcome = Outcome {
        phase,
        node: first.node,
        node_selected,
        store_ready,
        server_ready,
        plan_fits,
        ready,
        endpoint,
        store_hash: first.store_hash,
        store_bytes: first.store_bytes,
        live: first.live,
    };
    (outcome, action, replicas)
}
