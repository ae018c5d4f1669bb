//! Choosing the node: pure functions over Nodes, Pods and the other objects' status, so
//! every rule is unit-tested.
//!
//! A node fits when it matches the spec (name, selector labels, GPU product label), is
//! open (schedulable, taints tolerated) and has room: a free `nvidia.com/gpu` and
//! allocatable memory for `memory.limit` after what is already taken there. Taken means
//! the requests of the live pods on the node, and for every other `GlmFlashDeployment`
//! whose status names the node for one of its replicas, its GPU and memory cap: an object
//! holds its nodes from the moment they are placed, before its server pods exist, so two
//! objects never pick the same GPU; a hibernated object holds none. The pods of the deployment being placed, and the server pods of those objects, do
//! not count twice. Among fitting nodes the first by name wins, so the choice is
//! deterministic.
//!
//! A placed deployment stays where it is while the node matches its spec: a cordon or a
//! new taint closes the node to new placements only ([`closed`]), and moving is decided by
//! the reconciler (node gone, or no pod of ours left on a closed node).

use glmflash_crds::{GPU_PRODUCT_LABEL, GPU_RESOURCE, GlmFlashDeployment, GlmFlashDeploymentSpec};
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

/// Why `node` can never host the spec, whatever runs on it: name, labels, GPU product;
/// `None` when it matches.
pub fn spec_mismatch(spec: &GlmFlashDeploymentSpec, node: &Node) -> Option<String> {
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
    None
}

/// Why `node` takes no new pods of the spec (cordoned, or a taint not tolerated); pods
/// already there keep running.
pub fn closed(spec: &GlmFlashDeploymentSpec, node: &Node) -> Option<String> {
    let node_spec = node.spec.clone().unwrap_or_default();
    if node_spec.unschedulable == Some(true) {
        return Some("unschedulable (cordoned)".into());
    }
    node_spec
        .taints
        .unwrap_or_default()
        .iter()
        .filter(|t| t.effect == "NoSchedule" || t.effect == "NoExecute")
        .find(|t| !tolerated(t, &spec.placement.tolerations))
        .map(|taint| format!("taint {}:{} not tolerated", taint.key, taint.effect))
}

/// Why a new placement cannot use `node`: [`spec_mismatch`], then [`closed`].
pub fn mismatch(spec: &GlmFlashDeploymentSpec, node: &Node) -> Option<String> {
    spec_mismatch(spec, node).or_else(|| closed(spec, node))
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

/// What another object holds on a node because its status names the node.
#[derive(Clone, Debug, PartialEq)]
pub struct Reservation {
    /// Object name.
    pub name: String,
    /// Object namespace.
    pub namespace: String,
    /// Whether it holds one `nvidia.com/gpu`.
    pub gpu: bool,
    /// Its memory cap in bytes.
    pub memory: f64,
}

/// The reservations on `node` of every object but the owner.
pub fn reservations(
    objects: &[GlmFlashDeployment],
    node: &str,
    owner: Owner<'_>,
) -> Vec<Reservation> {
    objects
        .iter()
        .filter(|o| {
            o.status
                .as_ref()
                .is_some_and(|s| s.held_nodes().contains(&node))
        })
        .filter(|o| {
            (o.metadata.name.as_deref(), o.metadata.namespace.as_deref())
                != (Some(owner.name), Some(owner.namespace))
        })
        .map(|o| Reservation {
            name: o.metadata.name.clone().unwrap_or_default(),
            namespace: o.metadata.namespace.clone().unwrap_or_default(),
            gpu: o.spec.placement.require_gpu,
            memory: parse_quantity(&o.spec.memory.limit).unwrap_or(0.0),
        })
        .collect()
}

/// Whether `pod` belongs to the object `name` in `namespace` (any of its components).
fn belongs_to(pod: &Pod, name: &str, namespace: &str) -> bool {
    let own = builders::labels(name, builders::Component::Server);
    let labels = pod.metadata.labels.clone().unwrap_or_default();
    pod.metadata.namespace.as_deref() == Some(namespace)
        && ["app.kubernetes.io/instance", "app.kubernetes.io/managed-by"]
            .iter()
            .all(|k| labels.get(*k) == own.get(*k))
}

fn is_live(pod: &Pod) -> bool {
    !matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

/// Whether a pod of the owner that has not failed (an evicted pod has) is on `node`.
pub fn owner_has_pod_on(pods: &[Pod], node: &str, owner: Owner<'_>) -> bool {
    pods.iter()
        .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node))
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Failed"))
        .any(|p| belongs_to(p, owner.name, owner.namespace))
}

/// Requests of `resource` by the live pods bound to `node`, not counting the owner's nor
/// those of objects whose reservation counts instead.
fn requested(
    pods: &[Pod],
    node: &str,
    resource: &str,
    owner: Owner<'_>,
    reserved: &[Reservation],
) -> f64 {
    pods.iter()
        .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node))
        .filter(|p| is_live(p))
        .filter(|p| !belongs_to(p, owner.name, owner.namespace))
        .filter(|p| {
            !reserved
                .iter()
                .any(|r| belongs_to(p, &r.name, &r.namespace))
        })
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
    reserved: &[Reservation],
) -> Option<String> {
    let name = node.metadata.name.as_deref().unwrap_or_default();
    let gpus = allocatable(node, GPU_RESOURCE);
    let gpus_reserved = reserved.iter().filter(|r| r.gpu).count() as f64;
    let gpus_used = requested(pods, name, GPU_RESOURCE, owner, reserved) + gpus_reserved;
    if spec.placement.require_gpu && gpus - gpus_used < 1.0 {
        let mut why = format!("{gpus_used} of {gpus} {GPU_RESOURCE} in use");
        if gpus_reserved > 0.0 {
            let holders: Vec<String> = reserved
                .iter()
                .filter(|r| r.gpu)
                .map(|r| format!("{}/{}", r.namespace, r.name))
                .collect();
            why.push_str(&format!(" (held by {})", holders.join(", ")));
        }
        return Some(why);
    }
    let cap = parse_quantity(&spec.memory.limit).unwrap_or(f64::INFINITY);
    let memory_free = allocatable(node, "memory")
        - requested(pods, name, "memory", owner, reserved)
        - reserved.iter().map(|r| r.memory).sum::<f64>();
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
        assert_eq!(no_room(&spec, &node, &[], OWNER, &[]), None);
        let other = pod("team", "a", json!({}), "1", "1Gi", "Running");
        assert_eq!(
            no_room(&spec, &node, &[other], OWNER, &[]),
            Some("1 of 1 nvidia.com/gpu in use".into())
        );
        let done = pod("team", "a", json!({}), "1", "1Gi", "Succeeded");
        assert_eq!(no_room(&spec, &node, &[done], OWNER, &[]), None);
        let elsewhere = pod("team", "b", json!({}), "1", "1Gi", "Running");
        assert_eq!(no_room(&spec, &node, &[elsewhere], OWNER, &[]), None);
        let ours_labels = json!({"app.kubernetes.io/instance": "glm", "app.kubernetes.io/managed-by": "glmflash-operator"});
        let ours = pod("ai", "a", ours_labels.clone(), "1", "55Gi", "Running");
        assert_eq!(no_room(&spec, &node, &[ours], OWNER, &[]), None);
        let same_name_other_ns = pod("other", "a", ours_labels, "1", "1Gi", "Running");
        assert!(no_room(&spec, &node, &[same_name_other_ns], OWNER, &[]).is_some());
        let memory_hog = pod("team", "a", json!({}), "0", "20Gi", "Running");
        assert_eq!(
            no_room(&spec, &node, &[memory_hog], OWNER, &[]),
            Some("44.0 GiB allocatable memory free, memory.limit needs 55.0 GiB".into())
        );
    }

    #[test]
    fn another_objects_status_holds_its_gpu_and_memory_before_its_pod_exists() {
        let spec = gfd().spec;
        let node = gpu_node("a", "251Gi", "1");
        let mut other = gfd();
        other.metadata.name = Some("other".into());
        other.status = Some(glmflash_crds::GlmFlashDeploymentStatus {
            node: Some("a".into()),
            ..Default::default()
        });
        let mut me = gfd();
        me.status = other.status.clone();
        let reserved = reservations(&[other.clone(), me], "a", OWNER);
        assert_eq!(reserved.len(), 1, "the owner's own status holds nothing");
        assert_eq!(
            no_room(&spec, &node, &[], OWNER, &reserved),
            Some("1 of 1 nvidia.com/gpu in use (held by ai/other)".into())
        );
        // Its server pod, once it exists, does not count a second time.
        let labels = json!({"app.kubernetes.io/instance": "other", "app.kubernetes.io/managed-by": "glmflash-operator"});
        let its_pod = pod("ai", "a", labels, "1", "55Gi", "Running");
        let two_gpus = gpu_node("a", "251Gi", "2");
        assert_eq!(
            no_room(&spec, &two_gpus, &[its_pod], OWNER, &reserved),
            None
        );
        // Memory caps add up too.
        let small = gpu_node("a", "100Gi", "2");
        assert_eq!(
            no_room(&spec, &small, &[], OWNER, &reserved),
            Some("45.0 GiB allocatable memory free, memory.limit needs 55.0 GiB".into())
        );
        assert!(reservations(&[other.clone()], "b", OWNER).is_empty());

        // Every replica's node is held; a hibernated replica's is not.
        let replica = |index, node: &str, phase| glmflash_crds::ReplicaStatus {
            index,
            node: node.into(),
            phase,
            message: None,
            store_hash: None,
            store_bytes: None,
            live: None,
        };
        other.status = Some(glmflash_crds::GlmFlashDeploymentStatus {
            node: Some("a".into()),
            replicas: vec![
                replica(0, "a", glmflash_crds::Phase::Running),
                replica(1, "b", glmflash_crds::Phase::Starting),
            ],
            ..Default::default()
        });
        assert_eq!(reservations(&[other.clone()], "b", OWNER).len(), 1);
        other.status.as_mut().unwrap().replicas[1].phase = glmflash_crds::Phase::Hibernated;
        assert!(reservations(&[other.clone()], "b", OWNER).is_empty());
        assert_eq!(reservations(&[other.clone()], "a", OWNER).len(), 1);
        // An object from before replicas, hibernated, holds nothing either.
        other.status = Some(glmflash_crds::GlmFlashDeploymentStatus {
            node: Some("a".into()),
            phase: Some(glmflash_crds::Phase::Hibernated),
            ..Default::default()
        });
        assert!(reservations(&[other], "a", OWNER).is_empty());
    }

    #[test]
    fn a_cordon_closes_the_node_but_does_not_unmatch_it() {
        let spec = gfd().spec;
        let mut node = gpu_node("a", "251Gi", "1");
        node.spec.as_mut().unwrap().unschedulable = Some(true);
        assert_eq!(spec_mismatch(&spec, &node), None);
        assert_eq!(
            closed(&spec, &node),
            Some("unschedulable (cordoned)".into())
        );
        let labels = json!({"app.kubernetes.io/instance": "glm", "app.kubernetes.io/managed-by": "glmflash-operator"});
        let running = pod("ai", "a", labels.clone(), "1", "55Gi", "Running");
        assert!(owner_has_pod_on(&[running], "a", OWNER));
        let evicted = pod("ai", "a", labels, "1", "55Gi", "Failed");
        assert!(!owner_has_pod_on(&[evicted], "a", OWNER));
    }

    #[test]
    fn cpu_switch_ignores_gpu_label_and_count() {
        let mut spec = gfd().spec;
        spec.placement.require_gpu = false;
        let node = cpu_node("kind-worker");
        assert_eq!(mismatch(&spec, &node), None);
        assert_eq!(no_room(&spec, &node, &[], OWNER, &[]), None);
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
