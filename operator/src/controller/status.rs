//! What a reconcile decided ([`Outcome`]), and the status it becomes: conditions keep
//! their transition time while unchanged, status is written only when it changes, and a
//! phase change publishes an Event.

use glmflash_crds::{GlmFlashDeployment, GlmFlashDeploymentStatus, LiveFigures, Phase, condition};
use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Api, Patch};
use kube::runtime::events::{Event, EventType};
use kube::{Resource, ResourceExt};
use tracing::info;

use super::{Context, apply_params, key};
use crate::{Error, Result};

/// A condition as the reconciler decides it; times and generation are filled in later.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Cond {
    ok: bool,
    pub(super) reason: &'static str,
    pub(super) message: String,
}

impl Cond {
    pub(super) fn yes(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            ok: true,
            reason,
            message: message.into(),
        }
    }
    pub(super) fn no(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            ok: false,
            reason,
            message: message.into(),
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
    pub(super) ready: Cond,
    pub(super) endpoint: Option<String>,
    pub(super) store_hash: Option<String>,
    pub(super) store_bytes: Option<u64>,
    pub(super) live: Option<LiveFigures>,
}

/// Builds the next status from the old one: conditions keep their transition time while
/// their status is unchanged, so an unchanged outcome yields an identical status.
pub(super) fn next_status(
    old: &GlmFlashDeploymentStatus,
    generation: Option<i64>,
    outcome: Outcome,
    now: Timestamp,
) -> GlmFlashDeploymentStatus {
    let mut conditions = Vec::new();
    let decided = [
        (condition::NODE_SELECTED, outcome.node_selected),
        (condition::STORE_READY, outcome.store_ready),
        (condition::SERVER_READY, outcome.server_ready),
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
        phase: Some(outcome.phase),
        conditions,
        observed_generation: generation,
        node: outcome.node,
        endpoint: outcome.endpoint,
        store_hash: outcome.store_hash,
        store_bytes: outcome.store_bytes,
        live: outcome.live,
    }
}

/// Writes status if it changed and publishes an Event if the phase did.
pub(super) async fn write_status(
    gfd: &GlmFlashDeployment,
    ctx: &Context,
    next: GlmFlashDeploymentStatus,
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
    if next.phase != old.phase
        && let Some(phase) = next.phase
    {
        let ready = next.conditions.iter().find(|c| c.type_ == condition::READY);
        info!(object = %key(gfd), phase = phase.as_str(), "phase changed");
        let warning = matches!(phase, Phase::Invalid | Phase::Failed | Phase::Pending);
        ctx.recorder
            .publish(
                &Event {
                    type_: if warning {
                        EventType::Warning
                    } else {
                        EventType::Normal
                    },
                    reason: phase.as_str().to_string(),
                    note: ready.map(|c| truncate(&c.message, 1000)),
                    action: "Reconcile".into(),
                    secondary: None,
                },
                &gfd.object_ref(&()),
            )
            .await?;
    }
    Ok(())
}

fn truncate(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}
