//! What a reconcile decided ([`Outcome`]), and the status it becomes: conditions keep
//! their transition time while unchanged, status is written only when it changes, and a
//! phase change publishes an Event.

use glmflash_crds::{
    GlmFlashDeployment, GlmFlashDeploymentStatus, LiveFigures, Phase, ReplicaStatus, condition,
};
use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::ResourceExt;
use kube::api::{Api, Patch};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use tracing::info;

use super::stages::{Placed, Stored};
use super::{Context, RUNNING_REQUEUE, apply_params, key};
use crate::{Error, Result};

/// A condition as the reconciler decides it; times and generation are filled in later.
/// `warn` marks trouble a person has to fix: as Ready, it is also published as a Warning
/// Event when it is new.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Cond {
    pub(super) ok: bool,
    pub(super) warn: bool,
    pub(super) reason: &'static str,
    pub(super) message: String,
}

impl Cond {
    pub(super) fn yes(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            ok: true,
            warn: false,
            reason,
            message: message.into(),
        }
    }
    pub(super) fn no(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            ok: false,
            warn: false,
            reason,
            message: message.into(),
        }
    }
    pub(super) fn trouble(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            warn: true,
            ..Self::no(reason, message)
        }
    }
}

/// Everything a reconcile decided, before it becomes status.
pub(super) struct Outcome {
    pub(super) phase: Phase,
    pub(super) node: Option<String>,
    pub(super) node_selected: Option<Cond>,
    pub(super) store_ready: Option<Cond>,
    pub(super) server_ready: Option<Cond>,
    /// Whether the server's memory plan fits (`None`: not known this time; kept).
    pub(super) plan_fits: Option<Cond>,
    pub(super) ready: Cond,
    pub(super) endpoint: Option<String>,
    pub(super) store_hash: Option<String>,
    pub(super) store_bytes: Option<u64>,
    pub(super) live: Option<LiveFigures>,
}

/// The trouble to report when the API server refused an object the reconcile applied (a
/// 4xx other than not-found, conflict and throttling: invalid, forbidden, denied by a
/// webhook). Any other error stays an error.
pub(super) fn refusal(error: Error) -> Result<Cond> {
    match &error {
        Error::Kube(kube::Error::Api(status))
            if (400..500).contains(&status.code) && ![404, 409, 429].contains(&status.code) =>
        {
            Ok(Cond::trouble(
                "Refused",
                format!("the API server refused an object: {}", status.message),
            ))
        }
        _ => Err(error),
    }
}

/// A replica whose object the API server refused ([`refusal`]): `Failed` with the
/// server's message, looked at again after a while as the cause may be outside the spec
/// (RBAC, a webhook).
pub(super) fn refused(
    trouble: Cond,
    placed: &Placed,
    stored: Option<&Stored>,
) -> (Outcome, Action) {
    let (store_ready, server_ready) = match stored {
        Some(stored) => (stored.store_ready.clone(), trouble.clone()),
        None => (
            trouble.clone(),
            Cond::no("WaitingForStore", "the store is not ready"),
        ),
    };
    let outcome = Outcome {
        phase: Phase::Failed,
        node: Some(placed.node.clone()),
        node_selected: Some(placed.node_selected.clone()),
        store_ready: Some(store_ready),
        server_ready: Some(server_ready),
        plan_fits: None,
        ready: trouble,
        endpoint: None,
        store_hash: stored.map(|s| s.hash.clone()),
        store_bytes: stored.and_then(|s| s.bytes),
        live: None,
    };
    (outcome, Action::requeue(RUNNING_REQUEUE))
}

/// What the replicas are: each one's status, and `ready/desired`.
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct Replicas {
    pub(super) each: Vec<ReplicaStatus>,
    pub(super) ready: Option<String>,
}

impl Replicas {
    /// As the old status has them (a reconcile that decided nothing about them).
    pub(super) fn unchanged(old: &GlmFlashDeploymentStatus) -> Self {
        Self {
            each: old.replicas.clone(),
            ready: old.ready.clone(),
        }
    }
}

/// Builds the next status from the old one: conditions keep their transition time while
/// their status is unchanged, so an unchanged outcome yields an identical status.
pub(super) fn next_status(
    old: &GlmFlashDeploymentStatus,
    generation: Option<i64>,
    outcome: Outcome,
    replicas: Replicas,
    now: Timestamp,
) -> GlmFlashDeploymentStatus {
    let mut conditions = Vec::new();
    let decided = [
        (condition::NODE_SELECTED, outcome.node_selected),
        (condition::STORE_READY, outcome.store_ready),
        (condition::SERVER_READY, outcome.server_ready),
        (condition::PLAN_FITS, outcome.plan_fits),
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
        last_request_time: super::idle::last_request(old, &replicas.each, now),
        phase: Some(outcome.phase),
        ready: replicas.ready,
        replicas: replicas.each,
        conditions,
        observed_generation: generation,
        node: outcome.node,
        endpoint: outcome.endpoint,
        store_hash: outcome.store_hash,
        store_bytes: outcome.store_bytes,
        live: outcome.live,
    }
}

/// Writes status if it changed, and publishes an Event if the phase did, or if Ready is
/// new trouble (`warn`) in the same phase.
pub(super) async fn write_status(
    gfd: &GlmFlashDeployment,
    ctx: &Context,
    next: GlmFlashDeploymentStatus,
    warn: bool,
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
    let ready = |s: &GlmFlashDeploymentStatus| {
        s.conditions
            .iter()
            .find(|c| c.type_ == condition::READY)
            .map(|c| (c.reason.clone(), c.message.clone()))
    };
    let (old_ready, next_ready) = (ready(&old), ready(&next));
    let reason = match next.phase {
        Some(phase) if next.phase != old.phase => {
            info!(object = %key(gfd), phase = phase.as_str(), "phase changed");
            Some(phase.as_str().to_string())
        }
        // By reason: a message that changes while the trouble stays (a back-off) is no news.
        _ if warn && next_ready.as_ref().map(|r| &r.0) != old_ready.as_ref().map(|r| &r.0) => {
            next_ready.as_ref().map(|r| r.0.clone())
        }
        _ => None,
    };
    if let Some(reason) = reason {
        let warning = warn
            || matches!(
                next.phase,
                Some(Phase::Invalid | Phase::Failed | Phase::Pending)
            );
        let type_ = if warning {
            EventType::Warning
        } else {
            EventType::Normal
        };
        let note = next_ready.map(|(_, m)| truncate(&m, 1000));
        ctx.event(gfd, type_, &reason, "Reconcile", note).await?;
    }
    Ok(())
}

fn truncate(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}
