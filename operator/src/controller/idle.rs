//! `spec.idleAfter`: a deployment whose servers have served no completion request for that
//! long is hibernated by setting the `glmflash.io/hibernate` annotation, never by editing
//! the spec, so the activator (or `kubectl annotate ... glmflash.io/hibernate-`) wakes it.
//!
//! "No request" comes from the servers' own counters, read where the operator already
//! scrapes each replica's `/metrics` for status (`live.requests`, `live.activeRequests`),
//! rather than from a last-request time the activator would write onto the object: the
//! servers count every request whichever way it came (through the activator, straight to
//! the Service, a port-forward), the object keeps one writer, and idleness works without
//! an activator. The time a counter last moved is kept in status (`lastRequestTime`), so
//! an operator restart or a new leader does not restart the clock. A replica whose
//! `/metrics` could not be read reports no `activeRequests` and keeps the deployment awake.

use glmflash_crds::{
    GlmFlashDeployment, GlmFlashDeploymentStatus, HIBERNATE_ANNOTATION, Phase, ReplicaStatus,
};
use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::EventType;
use tracing::info;

use super::{Context, key};
use crate::{Error, Result};

/// When a request was last seen: `now` if any replica's request counter moved since the
/// old status or a replica holds a request, else the old time. A replica that starts
/// serving (no figures before) counts as a request, so a wake starts the clock afresh.
pub(super) fn last_request(
    old: &GlmFlashDeploymentStatus,
    each: &[ReplicaStatus],
    now: Timestamp,
) -> Option<Time> {
    let moved = each.iter().any(|replica| {
        let Some(live) = &replica.live else {
            return false;
        };
        let before = old
            .replicas
            .iter()
            .find(|o| o.index == replica.index)
            .and_then(|o| o.live.as_ref());
        live.active_requests.is_some_and(|n| n > 0)
            || before.map(|b| b.requests) != Some(live.requests)
    });
    if moved {
        Some(Time(now))
    } else {
        old.last_request_time.clone()
    }
}

/// Whether the deployment is to hibernate now: `spec.idleAfter` is set, it serves, every
/// serving replica was read and holds no request, and the last request is that long ago.
pub(super) fn due(
    gfd: &GlmFlashDeployment,
    next: &GlmFlashDeploymentStatus,
    now: Timestamp,
) -> bool {
    let (Some(after), Some(last)) = (gfd.idle_after(), &next.last_request_time) else {
        return false;
    };
    let Ok(after) = SignedDuration::try_from(after) else {
        return false;
    };
    next.phase == Some(Phase::Running)
        && !gfd.hibernating()
        && next
            .replicas
            .iter()
            .filter(|r| r.phase == Phase::Running)
            .all(|r| r.live.as_ref().and_then(|l| l.active_requests) == Some(0))
        && now.duration_since(last.0) >= after
}

/// Sets the hibernate annotation (a merge patch of that one key, so the spec and every
/// other annotation stay as they are) and says why in an Event. The patch brings the next
/// reconcile, which hibernates.
pub(super) async fn hibernate(gfd: &GlmFlashDeployment, ctx: &Context, since: &Time) -> Result<()> {
    let ns = gfd
        .namespace()
        .ok_or(Error::MissingField("metadata.namespace"))?;
    let api: Api<GlmFlashDeployment> = Api::namespaced(ctx.client.clone(), &ns);
    let patch = serde_json::json!({"metadata": {"annotations": {HIBERNATE_ANNOTATION: "true"}}});
    api.patch(
        &gfd.name_any(),
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await?;
    let idle_after = gfd.spec.idle_after.as_deref().unwrap_or_default();
    let note = format!(
        "no completion request since {}, longer than spec.idleAfter {idle_after}: hibernating \
         (the next request through the activator, or removing the {HIBERNATE_ANNOTATION} \
         annotation, wakes it)",
        since.0
    );
    info!(object = %key(gfd), %note, "idle");
    ctx.event(gfd, EventType::Normal, "Idle", "Hibernate", Some(note))
        .await
}
