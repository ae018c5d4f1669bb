//! Why the pods of a Job or of the server do not run, read from what the cluster already
//! says about them: pod conditions and container states, the Deployment's
//! `ReplicaFailure` condition, and `FailedCreate` Events (a pod that admission, such as
//! Pod Security, refused never exists, so only the Event tells). Pure functions: each
//! turns those objects into the condition the reconciler reports.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ContainerStatus, Event, Pod};

use super::status::Cond;

/// Container waiting reasons that mean the image cannot be had.
const IMAGE_REASONS: [&str; 4] = [
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "ErrImageNeverPull",
];

/// The memory plan's refusal a server container wrote to its termination message before it
/// exited (`{"planRefused": "..."}`, `serve --termination-log`), now or on its last run.
pub(super) fn plan_refusal(pods: &[Pod]) -> Option<String> {
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Report {
        plan_refused: String,
    }
    pods.iter()
        .filter_map(|p| p.status.as_ref()?.container_statuses.as_ref())
        .flatten()
        .filter(|c| c.name == "server")
        .flat_map(|c| [c.state.as_ref(), c.last_state.as_ref()])
        .filter_map(|s| s?.terminated.as_ref()?.message.as_deref())
        .find_map(|m| serde_json::from_str::<Report>(m).ok())
        .map(|r| r.plan_refused)
}

/// The first thing among `pods` that keeps one from running, as a not-ready condition.
pub(super) fn pod_trouble(pods: &[Pod]) -> Option<Cond> {
    pods.iter().find_map(one_pod)
}

fn one_pod(pod: &Pod) -> Option<Cond> {
    let name = pod.metadata.name.as_deref().unwrap_or("pod");
    let status = pod.status.as_ref()?;
    if let Some(c) = status.conditions.iter().flatten().find(|c| {
        c.type_ == "PodScheduled"
            && c.status == "False"
            && c.reason.as_deref() == Some("Unschedulable")
    }) {
        return Some(Cond::trouble(
            "Unschedulable",
            format!(
                "pod {name} cannot be scheduled: {}",
                c.message.as_deref().unwrap_or("no message")
            ),
        ));
    }
    let containers = status
        .init_container_statuses
        .iter()
        .flatten()
        .chain(status.container_statuses.iter().flatten());
    containers.filter_map(|c| waiting(name, c)).next()
}

fn waiting(pod: &str, c: &ContainerStatus) -> Option<Cond> {
    let waiting = c.state.as_ref()?.waiting.as_ref()?;
    let reason = waiting.reason.as_deref()?;
    let message = waiting.message.as_deref().unwrap_or("no message");
    let what = format!("pod {pod} container {}: {reason}: {message}", c.name);
    if IMAGE_REASONS.contains(&reason) {
        Some(Cond::trouble("ImagePullFailed", what))
    } else if reason == "CreateContainerConfigError" && message.contains("not found") {
        // A Secret or ConfigMap the pod refers to is absent (apiKeySecret, tokenSecret).
        Some(Cond::trouble("ReferenceMissing", what))
    } else if matches!(
        reason,
        "CreateContainerConfigError" | "CreateContainerError"
    ) {
        Some(Cond::trouble("ContainerConfigError", what))
    } else if reason == "CrashLoopBackOff" {
        let last = c
            .last_state
            .as_ref()
            .and_then(|s| s.terminated.as_ref())
            .map(|t| {
                format!(
                    "; last exit {}: {}",
                    t.exit_code,
                    t.message.as_deref().or(t.reason.as_deref()).unwrap_or("")
                )
            })
            .unwrap_or_default();
        Some(Cond::trouble("CrashLoopBackOff", format!("{what}{last}")))
    } else {
        None
    }
}

/// The Deployment's `ReplicaFailure` condition: its ReplicaSet could not create a pod.
pub(super) fn deployment_trouble(deployment: &Deployment) -> Option<Cond> {
    let c = deployment
        .status
        .as_ref()?
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "ReplicaFailure" && c.status == "True")?;
    Some(Cond::trouble(
        "PodCreateFailed",
        format!(
            "the server's pod cannot be created: {}",
            c.message.as_deref().unwrap_or("no message")
        ),
    ))
}

/// The newest `FailedCreate` Event among `events` (for a Job whose pods were refused).
pub(super) fn failed_create(events: &[Event], what: &str) -> Option<Cond> {
    let e = events
        .iter()
        .filter(|e| e.reason.as_deref() == Some("FailedCreate"))
        .max_by_key(|e| e.last_timestamp.as_ref().map(|t| t.0))?;
    Some(Cond::trouble(
        "PodCreateFailed",
        format!(
            "{what} cannot create its pod: {}",
            e.message.as_deref().unwrap_or("no message")
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(status: serde_json::Value) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": "p"}, "status": status})).unwrap()
    }

    fn waiting_pod(reason: &str, message: &str) -> Pod {
        pod(json!({"containerStatuses": [{
            "name": "server", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
            "state": {"waiting": {"reason": reason, "message": message}}
        }]}))
    }

    #[test]
    fn each_failure_gets_its_reason() {
        let unschedulable = pod(json!({"conditions": [{"type": "PodScheduled",
            "status": "False", "reason": "Unschedulable",
            "message": "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."}]}));
        let c = pod_trouble(&[unschedulable]).unwrap();
        assert_eq!(c.reason, "Unschedulable");
        assert!(
            c.message.contains("Insufficient nvidia.com/gpu"),
            "{}",
            c.message
        );

        let image = waiting_pod("ImagePullBackOff", "Back-off pulling image \"x\"");
        assert_eq!(pod_trouble(&[image]).unwrap().reason, "ImagePullFailed");

        let secret = waiting_pod("CreateContainerConfigError", "secret \"keys\" not found");
        let c = pod_trouble(&[secret]).unwrap();
        assert_eq!(c.reason, "ReferenceMissing");
        assert!(
            c.message.contains("secret \"keys\" not found"),
            "{}",
            c.message
        );

        assert_eq!(
            pod_trouble(&[waiting_pod("CrashLoopBackOff", "back-off")])
                .unwrap()
                .reason,
            "CrashLoopBackOff"
        );
        assert_eq!(pod_trouble(&[waiting_pod("ContainerCreating", "")]), None);
        assert_eq!(pod_trouble(&[]), None);
    }

    #[test]
    fn init_containers_count_too() {
        let p = pod(json!({"initContainerStatuses": [{
            "name": "download", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
            "state": {"waiting": {"reason": "ErrImagePull", "message": "not found"}}
        }]}));
        let c = pod_trouble(&[p]).unwrap();
        assert_eq!(c.reason, "ImagePullFailed");
        assert!(c.message.contains("download"), "{}", c.message);
    }

    #[test]
    fn refused_pods_are_read_from_the_deployment_and_events() {
        let d: Deployment = serde_json::from_value(json!({"status": {"conditions": [{
            "type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
            "message": "pods \"glm-x\" is forbidden: violates PodSecurity \"restricted:latest\""
        }]}}))
        .unwrap();
        let c = deployment_trouble(&d).unwrap();
        assert_eq!(c.reason, "PodCreateFailed");
        assert!(c.message.contains("PodSecurity"), "{}", c.message);

        let e: Event = serde_json::from_value(json!({
            "metadata": {"name": "e"}, "involvedObject": {"name": "glm-pack"},
            "reason": "FailedCreate", "message": "violates PodSecurity \"baseline:latest\""
        }))
        .unwrap();
        let c = failed_create(&[e], "pack-store Job glm-pack").unwrap();
        assert!(
            c.message
                .starts_with("pack-store Job glm-pack cannot create its pod: violates")
        );
    }
}
