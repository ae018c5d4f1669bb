//! Where requests can go: the deployment's hibernation and its ready replicas, from the
//! watched object and server pods (pure), and the choice of one replica for a request.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use glmflash_crds::{GlmFlashDeployment, HIBERNATE_ANNOTATION};
use k8s_openapi::api::core::v1::Pod;
use sha2::{Digest, Sha256};

use crate::builders;

/// What the watches say of the deployment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Object {
    /// Not listed yet (the activator just started).
    #[default]
    Unknown,
    /// No such GlmFlashDeployment.
    Missing,
    /// Serving or on its way: no hibernation asked.
    Awake,
    /// Hibernated by the `glmflash.io/hibernate` annotation: a request removes it.
    HibernatedByAnnotation,
    /// Hibernated by `spec.hibernate`: the owner of the spec turned it off, and the
    /// activator, which does not own the spec, leaves it off.
    HibernatedBySpec,
}

/// The deployment's state and its ready replicas by index.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Backends {
    /// Whether it exists and is asked to hibernate.
    pub object: Object,
    /// Address of each replica's ready server pod.
    pub ready: BTreeMap<u32, SocketAddr>,
}

impl Backends {
    /// From the watched object (`None`: missing, once `listed`) and its server pods: a pod
    /// counts when it is Ready, not terminating and has an IP; one per replica index (the
    /// first by name, while a rollout briefly has two).
    pub fn of(gfd: Option<&GlmFlashDeployment>, listed: bool, pods: &[&Pod]) -> Self {
        let Some(gfd) = gfd else {
            let object = if listed {
                Object::Missing
            } else {
                Object::Unknown
            };
            return Self {
                object,
                ready: BTreeMap::new(),
            };
        };
        let by_annotation = gfd
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(HIBERNATE_ANNOTATION))
            .is_some_and(|v| v == "true");
        let object = if gfd.spec.hibernate {
            Object::HibernatedBySpec
        } else if by_annotation {
            Object::HibernatedByAnnotation
        } else {
            Object::Awake
        };
        let port = u16::try_from(gfd.spec.server.port).unwrap_or(30000);
        let mut pods: Vec<&Pod> = pods
            .iter()
            .copied()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .collect();
        pods.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        let mut ready = BTreeMap::new();
        for pod in pods {
            let Some(status) = &pod.status else { continue };
            let is_ready = status
                .conditions
                .as_ref()
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
            let ip = status
                .pod_ip
                .as_deref()
                .and_then(|ip| ip.parse::<IpAddr>().ok());
            if let (true, Some(ip)) = (is_ready, ip) {
                let index = builders::replica_of(pod.metadata.labels.as_ref());
                ready.entry(index).or_insert(SocketAddr::new(ip, port));
            }
        }
        Self { object, ready }
    }
}

/// The replica for a session by rendezvous (highest random weight) hashing: each replica
/// scores `sha256(key, index)` and the highest wins. A session stays on its replica while
/// that replica is ready, and when one goes or comes only the sessions it wins or loses
/// move. Replica indexes, not pod addresses, are hashed, so a restarted pod of the same
/// replica (same node, same warm store and routing history) gets its sessions back.
pub fn rendezvous(key: &str, replicas: impl IntoIterator<Item = u32>) -> Option<u32> {
    replicas.into_iter().max_by_key(|index| {
        let digest = Sha256::new()
            .chain_update(key.as_bytes())
            .chain_update([0])
            .chain_update(index.to_be_bytes())
            .finalize();
        let mut score = [0u8; 8];
        score.copy_from_slice(&digest[..8]);
        u64::from_be_bytes(score)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(name: &str, replica: Option<u32>, ip: &str, ready: bool) -> Pod {
        let mut labels = json!({"app.kubernetes.io/instance": "glm"});
        if let Some(r) = replica {
            labels[builders::REPLICA_LABEL] = json!(r.to_string());
        }
        let status = if ready { "True" } else { "False" };
        serde_json::from_value(json!({
            "metadata": {"name": name, "labels": labels},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": status}]}
        }))
        .unwrap()
    }

    fn gfd(annotation: Option<&str>, spec_hibernate: bool) -> GlmFlashDeployment {
        let mut g: GlmFlashDeployment = serde_json::from_value(json!({
            "apiVersion": "glmflash.io/v1alpha1", "kind": "GlmFlashDeployment",
            "metadata": {"name": "glm", "namespace": "ai"},
            "spec": {"model": {"nodePath": "/m"}, "memory": {"limit": "16Gi"},
                     "server": {"port": 31000}, "hibernate": spec_hibernate}
        }))
        .unwrap();
        if let Some(value) = annotation {
            g.metadata.annotations =
                Some([(HIBERNATE_ANNOTATION.to_string(), value.to_string())].into());
        }
        g
    }

    #[test]
    fn ready_pods_by_replica_on_the_server_port() {
        let pods = [
            pod("glm-b", None, "10.0.0.2", true),
            pod("glm-a", None, "10.0.0.1", true),
            pod("glm-r1-x", Some(1), "10.0.0.3", false),
            pod("glm-r2-x", Some(2), "fd00::4", true),
        ];
        let refs: Vec<&Pod> = pods.iter().collect();
        let b = Backends::of(Some(&gfd(None, false)), true, &refs);
        assert_eq!(b.object, Object::Awake);
        assert_eq!(
            b.ready,
            BTreeMap::from([
                (0, "10.0.0.1:31000".parse().unwrap()),
                (2, "[fd00::4]:31000".parse().unwrap()),
            ])
        );
    }

    #[test]
    fn hibernation_by_annotation_or_spec_and_a_missing_object() {
        let object =
            |g: Option<GlmFlashDeployment>, listed| Backends::of(g.as_ref(), listed, &[]).object;
        assert_eq!(
            object(Some(gfd(Some("true"), false)), true),
            Object::HibernatedByAnnotation
        );
        assert_eq!(object(Some(gfd(Some("false"), false)), true), Object::Awake);
        assert_eq!(
            object(Some(gfd(Some("true"), true)), true),
            Object::HibernatedBySpec
        );
        assert_eq!(object(None, false), Object::Unknown);
        assert_eq!(object(None, true), Object::Missing);
    }

    #[test]
    fn rendezvous_moves_only_the_sessions_of_a_replica_that_goes() {
        let keys: Vec<String> = (0..2000).map(|i| format!("session-{i}")).collect();
        let before: Vec<u32> = keys
            .iter()
            .map(|k| rendezvous(k, [0, 1, 2]).unwrap())
            .collect();
        for replica in 0..3 {
            let share = before.iter().filter(|r| **r == replica).count();
            assert!((500..834).contains(&share), "replica {replica}: {share}");
        }
        let after: Vec<u32> = keys
            .iter()
            .map(|k| rendezvous(k, [0, 2]).unwrap())
            .collect();
        for (b, a) in before.iter().zip(&after) {
            if *b != 1 {
                assert_eq!(a, b, "a session not on replica 1 moved");
            }
        }
        assert_eq!(rendezvous("any", []), None);
    }
}
