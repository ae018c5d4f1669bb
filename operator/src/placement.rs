//! Choosing the node: pure functions over Nodes and Pods, so every rule is unit-tested.
//!
//! A node fits when it matches the spec (name, selector labels, GPU product label,
//! schedulable, taints tolerated) and has room: a free `nvidia.com/gpu` and allocatable
//! memory for `memory.limit` after the requests of the pods already there. Pods of the
//! deployment being placed do not count against it, so re-placing a running deployment
//! finds its own node still free. Among fitting nodes the first by name wins, so the
//! choice is deterministic.

use glmflash_crds::{GPU_PRODUCT_LABEL, GPU_RESOURCE, GlmFlashDeploymentSpec};
use k8s_openapi::api::core::v1::{Node, Pod, Taint, Toleration};

use crate::builders;

/// Parses a Kubernetes quantity (`55Gi`, `16G`, `1e9`, `500m`) to its value.
pub fn parse_quantity(s: &str) -> Option<f64> {
    let s = s.trim();
    const SUFFIXES: [(&str, f64); 14] = [
        ("Ki", 1024.0),
        ("Mi", 1024.0 * 1024.0),
        ("Gi", 1024.0 * 1024.0 * 1024.0),
        ("Ti", 1024.0 * 1024.0 * 1024.0 * 1024.0),
        ("Pi", 1024.0 * 1024.0 * 1024.0 * 1024.0 * 1024.0),
        ("Ei", 1024.0 * 1024.0 * 1024.0 * 1024.0 * 1024.0 * 1024.0),
        ("n", 1e-9),
        ("u", 1e-6),
        ("m", 1e-3),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
        ("P", 1e15),
    ];
    let (number, factor) = SUFFIXES
        .iter()
        .find_map(|(suffix, factor)| s.strip_suffix(suffix).map(|n| (n, *factor)))
        .or_else(|| s.strip_suffix('E').map(|n| (n, 1e18)))
        .unwrap_or((s, 1.0));
    if number.is_empty() {
        return None;
    }
    let value: f64 = number.parse().ok()?;
    (value.is_finite() && value >= 0.0).then_some(value * factor)
}

/// Why `node` can never host the spec, whatever runs on it; `None` when it matches.
pub fn mismatch(spec: &GlmFlashDeploymentSpec, node: &Node) -> Option<String> {
    let name = node.metadata.name.as_deref().unwrap_or_default();
    let labels = node.metadata.labels.clone().unwrap_or_default();
    if let Some(wanted) = &spec.placement.node_name
        && wanted != name
    {
        return Some(format!("not placement.nodeName {wanted}"));
    }
    for (key, value) in &spec.placement.node_selector {
        if labels.get(key) != Some(value) {
            return Some(format!("label {key}={value} missing"));
        }
    }
    let product = &spec.placement.gpu_product;
    if spec.placement.require_gpu
        && !product.is_empty()
        && labels.get(GPU_PRODUCT_LABEL) != Some(product)
    {
        return Some(format!("label {GPU_PRODUCT_LABEL}={product} missing"));
    }
    let node_spec = node.spec.clone().unwrap_or_default();
    if node_spec.unschedulable == Some(true) {
        return Some("unschedulable (cordoned)".into());
    }
    if let Some(taint) = node_spec
        .taints
        .unwrap_or_default()
        .iter()
        .filter(|t| t.effect == "NoSchedule" || t.effect == "NoExecute")
        .find(|t| !tolerated(t, &spec.placement.tolerations))
    {
        return Some(format!(
            "taint {}:{} not tolerated",
            taint.key, taint.effect
        ));
    }
    None
}

fn tolerated(taint: &Taint, tolerations: &[Toleration]) -> bool {
    tolerations.iter().any(|t| {
        let effect_ok = t
            .effect
            .as_deref()
            .is_none_or(|e| e.is_empty() || e == taint.effect);
        let key_ok = t
            .key
            .as_deref()
            .is_none_or(|k| k.is_empty() || k == taint.key);
        let value_ok = match t.operator.as_deref() {
            Some("Exists") => true,
            _ => {
                t.value.as_deref().unwrap_or_default() == taint.value.as_deref().unwrap_or_default()
            }
        };
        // An empty key with Exists tolerates everything.
        effect_ok && key_ok && value_ok
    })
}

fn allocatable(node: &Node, resource: &str) -> f64 {
    node.status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
        .and_then(|a| a.get(resource))
        .and_then(|q| parse_quantity(&q.0))
        .unwrap_or(0.0)
}

/// The deployment being placed, whose own pods do not count against a node.
#[derive(Clone, Copy, Debug)]
pub struct Owner<'a> {
    /// Object name.
    pub name: &'a str,
    /// Object namespace.
    pub namespace: &'a str,
}

fn is_own(pod: &Pod, owner: Owner<'_>) -> bool {
    let own = builders::labels(owner.name, builders::Component::Server);
    let labels = pod.metadata.labels.clone().unwrap_or_default();
    pod.metadata.namespace.as_deref() == Some(owner.namespace)
        && ["app.kubernetes.io/instance", "app.kubernetes.io/managed-by"]
            .iter()
            .all(|k| labels.get(*k) == own.get(*k))
}

/// Requests of `resource` by the live pods bound to `node`, not counting the owner's.
fn requested(pods: &[Pod], node: &str, resource: &str, owner: Owner<'_>) -> f64 {
    pods.iter()
        .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node))
        .filter(|p| {
            !matches!(
                p.status.as_ref().and_then(|s| s.phase.as_deref()),
                Some("Succeeded" | "Failed")
            )
        })
        .filter(|p| !is_own(p, owner))
        .flat_map(|p| p.spec.iter().flat_map(|s| s.containers.iter()))
        .filter_map(|c| {
            let r = c.resources.as_ref()?;
            // Extended resources may be given as limits only; requests default to them.
            r.requests
                .as_ref()
                .and_then(|q| q.get(resource))
                .or_else(|| r.limits.as_ref().and_then(|q| q.get(resource)))
                .and_then(|q| parse_quantity(&q.0))
        })
        .sum()
}

/// Why a matching node has no room right now; `None` when it does.
pub fn no_room(
    spec: &GlmFlashDeploymentSpec,
    node: &Node,
    pods: &[Pod],
    owner: Owner<'_>,
) -> Option<String> {
    let name = node.metadata.name.as_deref().unwrap_or_default();
    let gpus = allocatable(node, GPU_RESOURCE);
    let gpus_used = requested(pods, name, GPU_RESOURCE, owner);
    if spec.placement.require_gpu && gpus - gpus_used < 1.0 {
        return Some(format!("{gpus_used} of {gpus} {GPU_RESOURCE} in use"));
    }
    let cap = parse_quantity(&spec.memory.limit).unwrap_or(f64::INFINITY);
    let memory_free = allocatable(node, "memory") - requested(pods, name, "memory", owner);
    if memory_free < cap {
        return Some(format!(
            "{:.1} GiB allocatable memory free, memory.limit needs {:.1} GiB",
            memory_free / GIB,
            cap / GIB
        ));
    }
    None
}

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// One message naming, for each rejected node, why it does not fit (the first few).
pub fn summarize(reasons: &[String]) -> String {
    if reasons.is_empty() {
        return "no nodes in the cluster".into();
    }
    const SHOWN: usize = 5;
    let mut message = format!(
        "no node fits: {}",
        reasons[..reasons.len().min(SHOWN)].join("; ")
    );
    if reasons.len() > SHOWN {
        message.push_str(&format!("; and {} more", reasons.len() - SHOWN));
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{cpu_node, gfd, gpu_node};
    use serde_json::json;

    const OWNER: Owner<'static> = Owner {
        name: "glm",
        namespace: "ai",
    };

    fn pod(
        ns: &str,
        node: &str,
        labels: serde_json::Value,
        gpu: &str,
        memory: &str,
        phase: &str,
    ) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": ns, "labels": labels},
            "spec": {"nodeName": node, "containers": [{"name": "c", "resources": {
                "requests": {"memory": memory}, "limits": {"nvidia.com/gpu": gpu}}}]},
            "status": {"phase": phase}
        }))
        .unwrap()
    }

    #[test]
    fn quantities() {
        assert_eq!(parse_quantity("55Gi"), Some(55.0 * GIB));
        assert_eq!(parse_quantity("16G"), Some(16e9));
        assert_eq!(parse_quantity("1e9"), Some(1e9));
        assert_eq!(parse_quantity("500m"), Some(0.5));
        assert_eq!(parse_quantity("2"), Some(2.0));
        assert_eq!(parse_quantity("1Ki"), Some(1024.0));
        assert_eq!(parse_quantity("lots"), None);
        assert_eq!(parse_quantity(""), None);
        assert_eq!(parse_quantity("Gi"), None);
        assert_eq!(parse_quantity("-1Gi"), None);
    }

    #[test]
    fn static_mismatches_name_the_rule() {
        let mut spec = gfd().spec;
        assert_eq!(mismatch(&spec, &gpu_node("a", "251Gi", "1")), None);
        assert_eq!(
            mismatch(&spec, &cpu_node("c")),
            Some("label nvidia.com/gpu.product=NVIDIA-GeForce-RTX-3090 missing".into())
        );
        spec.placement.gpu_product = String::new();
        assert_eq!(mismatch(&spec, &cpu_node("c")), None);
        spec.placement.node_name = Some("b".into());
        assert_eq!(
            mismatch(&spec, &gpu_node("a", "251Gi", "1")),
            Some("not placement.nodeName b".into())
        );
        spec.placement.node_name = None;
        spec.placement
            .node_selector
            .insert("zone".into(), "lab".into());
        assert_eq!(
            mismatch(&spec, &gpu_node("a", "251Gi", "1")),
            Some("label zone=lab missing".into())
        );
    }

    #[test]
    fn cordons_and_taints() {
        let mut spec = gfd().spec;
        let mut node = gpu_node("a", "251Gi", "1");
        node.spec.as_mut().unwrap().taints = Some(vec![Taint {
            key: "gpu".into(),
            value: Some("3090".into()),
            effect: "NoSchedule".into(),
            time_added: None,
        }]);
        assert_eq!(
            mismatch(&spec, &node),
            Some("taint gpu:NoSchedule not tolerated".into())
        );
        spec.placement.tolerations = vec![Toleration {
            key: Some("gpu".into()),
            operator: Some("Equal".into()),
            value: Some("other".into()),
            ..Toleration::default()
        }];
        assert!(mismatch(&spec, &node).is_some());
        spec.placement.tolerations[0].value = Some("3090".into());
        assert_eq!(mismatch(&spec, &node), None);
        spec.placement.tolerations = vec![Toleration {
            operator: Some("Exists".into()),
            ..Toleration::default()
        }];
        assert_eq!(mismatch(&spec, &node), None);
        node.spec.as_mut().unwrap().unschedulable = Some(true);
        assert_eq!(
            mismatch(&spec, &node),
            Some("unschedulable (cordoned)".into())
        );
    }

    #[test]
    fn room_counts_other_live_pods_but_not_our_own() {
        let spec = gfd().spec;
        let node = gpu_node("a", "64Gi", "1");
        assert_eq!(no_room(&spec, &node, &[], OWNER), None);
        let other = pod("team", "a", json!({}), "1", "1Gi", "Running");
        assert_eq!(
            no_room(&spec, &node, &[other], OWNER),
            Some("1 of 1 nvidia.com/gpu in use".into())
        );
        let done = pod("team", "a", json!({}), "1", "1Gi", "Succeeded");
        assert_eq!(no_room(&spec, &node, &[done], OWNER), None);
        let elsewhere = pod("team", "b", json!({}), "1", "1Gi", "Running");
        assert_eq!(no_room(&spec, &node, &[elsewhere], OWNER), None);
        let ours_labels = json!({"app.kubernetes.io/instance": "glm", "app.kubernetes.io/managed-by": "glmflash-operator"});
        let ours = pod("ai", "a", ours_labels.clone(), "1", "55Gi", "Running");
        assert_eq!(no_room(&spec, &node, &[ours], OWNER), None);
        let same_name_other_ns = pod("other", "a", ours_labels, "1", "1Gi", "Running");
        assert!(no_room(&spec, &node, &[same_name_other_ns], OWNER).is_some());
        let memory_hog = pod("team", "a", json!({}), "0", "20Gi", "Running");
        assert_eq!(
            no_room(&spec, &node, &[memory_hog], OWNER),
            Some("44.0 GiB allocatable memory free, memory.limit needs 55.0 GiB".into())
        );
    }

    #[test]
    fn cpu_switch_ignores_gpu_label_and_count() {
        let mut spec = gfd().spec;
        spec.placement.require_gpu = false;
        let node = cpu_node("kind-worker");
        assert_eq!(mismatch(&spec, &node), None);
        assert_eq!(no_room(&spec, &node, &[], OWNER), None);
    }

    #[test]
    fn summary_is_bounded() {
        assert_eq!(summarize(&[]), "no nodes in the cluster");
        let reasons: Vec<String> = (0..8).map(|i| format!("n{i}: x")).collect();
        assert_eq!(
            summarize(&reasons),
            "no node fits: n0: x; n1: x; n2: x; n3: x; n4: x; and 3 more"
        );
    }
}
