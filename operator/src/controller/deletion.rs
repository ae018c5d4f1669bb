//! Deletion. Owned objects go by owner references once the finalizer is removed; with
//! reclaim policy `Retain` (or no node ever chosen) that happens at once. With `Delete`
//! the stores go first, on every replica's node, each step reported as phase `Deleting`:
//! 1. the servers are scaled to zero, so nothing reads a store while it is removed;
//! 2. a reclaim Job per node removes the object's stores and routing history, and its Hub
//!    download unless another object on the node names the same one; the Jobs' watch
//!    brings the next reconcile and their deadline bounds the wait;
//! 3. once it is Complete, or Failed (a Warning Event says what to remove by hand), the
//!    finalizer is removed.

use glmflash_crds::{GlmFlashDeployment, GlmFlashDeploymentStatus, Phase, ReclaimPolicy};
use jiff::Timestamp;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use tracing::{info, warn};

use super::fleet;
use super::status::{self, Cond, Outcome};
use super::{Context, JobState, WAITING_REQUEUE, apply_params, job_state, key};
use crate::builders::{self, names};
use crate::{Error, Result};

/// What is left to do before the finalizer may go: `Some` says when to look again.
pub(super) async fn pending(gfd: &GlmFlashDeployment, ctx: &Context) -> Result<Option<Action>> {
    let old = gfd.status.clone().unwrap_or_default();
    let placed = fleet::entries(&old);
    if gfd.spec.store.reclaim_policy != ReclaimPolicy::Delete || placed.is_empty() {
        return Ok(None);
    }
    let ns = gfd
        .namespace()
        .ok_or(Error::MissingField("metadata.namespace"))?;
    let name = gfd.name_any();
    let nodes = placed
        .iter()
        .map(|e| e.node.as_str())
        .collect::<Vec<_>>()
        .join(", ");
    let waiting = 'steps: {
        let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), &ns);
        let (mut stopped, mut running) = (false, false);
        for entry in &placed {
            let server_name = names::replica(&name, entry.index);
            let Some(server) = deployments.get_opt(&server_name).await? else {
                continue;
            };
            if server.spec.as_ref().and_then(|s| s.replicas) != Some(0) {
                let hash = entry
                    .store_hash
                    .clone()
                    .unwrap_or_else(|| builders::store_hash(&gfd.spec, &entry.node));
                let zero = builders::server_deployment(gfd, entry.index, &entry.node, &hash, 0);
                deployments
                    .patch(&server_name, &apply_params(), &Patch::Apply(&zero))
                    .await?;
                stopped = true;
            } else if server.status.as_ref().and_then(|s| s.replicas).unwrap_or(0) > 0 {
                running = true;
            }
        }
        if stopped {
            break 'steps Some("stopping the server before its store is removed".to_string());
        }
        if running {
            break 'steps Some("waiting for the server's pod to stop".to_string());
        }
        let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), &ns);
        let mut removing = Vec::new();
        for entry in &placed {
            let node = &entry.node;
            let job_name = names::reclaim_job(&name, entry.index);
            let Some(job) = jobs.get_opt(&job_name).await? else {
                let with_download = !download_shared(gfd, ctx, node).await?;
                let desired = builders::reclaim_job(gfd, entry.index, node, with_download);
                jobs.patch(&job_name, &apply_params(), &Patch::Apply(&desired))
                    .await?;
                removing.push(job_name);
                continue;
            };
            match job_state(&job) {
                JobState::Running => removing.push(job_name),
                JobState::Complete => info!(object = %key(gfd), %node, "store reclaimed"),
                // Never block deletion on a node that cannot be cleaned.
                JobState::Failed(why) => reclaim_failed(ctx, gfd, node, &why, "Cleanup").await?,
            }
        }
        (!removing.is_empty()).then(|| {
            format!(
                "reclaim Job {} is removing the store on {nodes}",
                removing.join(", ")
            )
        })
    };
    let Some(message) = waiting else {
        return Ok(None);
    };
    let outcome = Outcome {
        phase: Phase::Deleting,
        node: old.node.clone(),
        node_selected: None,
        store_ready: None,
        server_ready: Some(Cond::no("Deleting", "the object is being deleted")),
        plan_fits: None,
        ready: Cond::no("Deleting", message),
        endpoint: None,
        store_hash: old.store_hash.clone(),
        store_bytes: old.store_bytes,
        live: None,
    };
    let next: GlmFlashDeploymentStatus = status::next_status(
        &old,
        gfd.metadata.generation,
        outcome,
        status::Replicas::unchanged(&old),
        Timestamp::now(),
    );
    status::write_status(gfd, ctx, next, false).await?;
    Ok(Some(Action::requeue(WAITING_REQUEUE)))
}

/// Whether another object on `node` reads the same Hub download, which must then stay.
pub(super) async fn download_shared(
    gfd: &GlmFlashDeployment,
    ctx: &Context,
    node: &str,
) -> Result<bool> {
    if gfd.spec.model.hugging_face.is_none() {
        return Ok(false);
    }
    let api: Api<GlmFlashDeployment> = Api::all(ctx.client.clone());
    let mine = (
        gfd.spec.store.host_path.trim_end_matches('/'),
        builders::model_dir(&gfd.spec),
    );
    Ok(api
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .filter(|o| o.metadata.uid != gfd.metadata.uid)
        .filter(|o| {
            o.status
                .as_ref()
                .is_some_and(|s| fleet::entries(s).iter().any(|e| e.node == node))
        })
        .any(|o| {
            (
                o.spec.store.host_path.trim_end_matches('/'),
                builders::model_dir(&o.spec),
            ) == mine
        }))
}

/// A reclaim Job failed on `node`: a Warning Event (recording `action`) that says where the
/// bytes are left, so the owner can remove them by hand.
pub(super) async fn reclaim_failed(
    ctx: &Context,
    gfd: &GlmFlashDeployment,
    node: &str,
    why: &str,
    action: &str,
) -> Result<()> {
    let note = format!(
        "store reclaim failed ({why}); remove {} on node {node} by hand",
        builders::stores_dir(gfd)
    );
    warn!(object = %key(gfd), %note);
    ctx.event(gfd, EventType::Warning, "ReclaimFailed", action, Some(note))
        .await
}
