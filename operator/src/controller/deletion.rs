//! Deletion. Owned objects go by owner references once the finalizer is removed; with
//! reclaim policy `Retain` (or no node ever chosen) that happens at once. With `Delete`
//! the store goes first, on its node, each step reported as phase `Deleting`:
//! 1. the server is scaled to zero, so nothing reads the store while it is removed;
//! 2. the reclaim Job removes the object's stores, and its Hub download unless another
//!    object on the node names the same one; the Job's watch brings the next reconcile
//!    and its deadline bounds the wait;
//! 3. once it is Complete, or Failed (a Warning Event says what to remove by hand), the
//!    finalizer is removed.

use glmflash_crds::{GlmFlashDeployment, GlmFlashDeploymentStatus, Phase, ReclaimPolicy};
use jiff::Timestamp;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use kube::api::{Api, ListParams, Patch};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType};
use kube::{Resource, ResourceExt};
use tracing::{info, warn};

use super::status::{self, Cond, Outcome};
use super::{Context, JobState, WAITING_REQUEUE, apply_params, job_state, key};
use crate::builders::{self, names};
use crate::{Error, Result};

/// What is left to do before the finalizer may go: `Some` says when to look again.
pub(super) async fn pending(gfd: &GlmFlashDeployment, ctx: &Context) -> Result<Option<Action>> {
    let old = gfd.status.clone().unwrap_or_default();
    let (ReclaimPolicy::Delete, Some(node)) = (gfd.spec.store.reclaim_policy, old.node.clone())
    else {
        return Ok(None);
    };
    let ns = gfd
        .namespace()
        .ok_or(Error::MissingField("metadata.namespace"))?;
    let name = gfd.name_any();
    let waiting = 'steps: {
        let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), &ns);
        if let Some(server) = deployments.get_opt(&name).await? {
            if server.spec.as_ref().and_then(|s| s.replicas) != Some(0) {
                let hash = old
                    .store_hash
                    .clone()
                    .unwrap_or_else(|| builders::store_hash(&gfd.spec, &node));
                let stopped = builders::server_deployment(gfd, &node, &hash, 0);
                deployments
                    .patch(&name, &apply_params(), &Patch::Apply(&stopped))
                    .await?;
                break 'steps Some("stopping the server before its store is removed".to_string());
            }
            if server.status.as_ref().and_then(|s| s.replicas).unwrap_or(0) > 0 {
                break 'steps Some("waiting for the server's pod to stop".to_string());
            }
        }
        let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), &ns);
        let job_name = names::reclaim_job(&name);
        let Some(job) = jobs.get_opt(&job_name).await? else {
            let with_download = !download_shared(gfd, ctx, &node).await?;
            let desired = builders::reclaim_job(gfd, &node, with_download);
            jobs.patch(&job_name, &apply_params(), &Patch::Apply(&desired))
                .await?;
            break 'steps Some(format!(
                "reclaim Job {job_name} is removing the store on {node}"
            ));
        };
        match job_state(&job) {
            JobState::Running => Some(format!(
                "reclaim Job {job_name} is removing the store on {node}"
            )),
            JobState::Complete => {
                info!(object = %key(gfd), %node, "store reclaimed");
                None
            }
            JobState::Failed(why) => {
                // Never block deletion on a node that cannot be cleaned: say where the bytes are.
                let note = format!(
                    "store reclaim failed ({why}); remove {} on node {node} by hand",
                    builders::stores_dir(gfd)
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
                None
            }
        }
    };
    let Some(message) = waiting else {
        return Ok(None);
    };
    let outcome = Outcome {
        phase: Phase::Deleting,
        node: Some(node),
        node_selected: None,
        store_ready: None,
        server_ready: Some(Cond::no("Deleting", "the object is being deleted")),
        ready: Cond::no("Deleting", message),
        endpoint: None,
        store_hash: old.store_hash.clone(),
        store_bytes: old.store_bytes,
        live: None,
    };
    let next: GlmFlashDeploymentStatus =
        status::next_status(&old, gfd.metadata.generation, outcome, Timestamp::now());
    status::write_status(gfd, ctx, next, false).await?;
    Ok(Some(Action::requeue(WAITING_REQUEUE)))
}

/// Whether another object on `node` reads the same Hub download, which must then stay.
async fn download_shared(gfd: &GlmFlashDeployment, ctx: &Context, node: &str) -> Result<bool> {
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
        .filter(|o| o.status.as_ref().and_then(|s| s.node.as_deref()) == Some(node))
        .any(|o| {
            (
                o.spec.store.host_path.trim_end_matches('/'),
                builders::model_dir(&o.spec),
            ) == mine
        }))
}
