//! What every pod the operator runs is made of: host-path and secret volumes and their
//! mounts, node affinity, and the security settings.

use glmflash_crds::SecretKeyRef;
use k8s_openapi::api::core::v1::{
    Affinity, Capabilities, HostPathVolumeSource, KeyToPath, NodeAffinity, NodeSelector,
    NodeSelectorRequirement, NodeSelectorTerm, PodSecurityContext, SecretVolumeSource,
    SecurityContext, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

/// Where the model weights are mounted, in every pod that reads or writes them.
pub(super) const MODEL_MOUNT: &str = "/models";
/// Where the packed store is mounted.
pub(super) const STORE_MOUNT: &str = "/store";
/// Where the node's kernel cache ([`super::kernels_dir`]) is mounted (read-write), and the
/// two caches in it: NVRTC's PTX and the driver's compiled code.
pub(super) const KERNELS_MOUNT: &str = "/kernels";
pub(super) const NVRTC_CACHE: &str = "/kernels/nvrtc";
pub(super) const DRIVER_CACHE: &str = "/kernels/driver";
/// Where the server's routing history directory is mounted (read-write).
pub(super) const HISTORY_MOUNT: &str = "/history";
/// The routing history file the server loads at start and writes at exit.
pub(super) const HISTORY_FILE: &str = "routing.json";
/// The container's termination-message file (kube's default path; the policy is `File`):
/// pack-store reports the store's size there, the server a refusal of its memory plan.
pub(super) const TERMINATION_LOG: &str = "/dev/termination-log";

/// Pins a pod to one node by name (the scheduler still accounts for its resources, unlike
/// `spec.nodeName`).
pub(super) fn node_affinity(node: &str) -> Affinity {
    Affinity {
        node_affinity: Some(NodeAffinity {
            required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                node_selector_terms: vec![NodeSelectorTerm {
                    match_fields: Some(vec![NodeSelectorRequirement {
                        key: "metadata.name".into(),
                        operator: "In".into(),
                        values: Some(vec![node.to_string()]),
                    }]),
                    ..NodeSelectorTerm::default()
                }],
            }),
            ..NodeAffinity::default()
        }),
        ..Affinity::default()
    }
}

pub(super) fn host_path_volume(name: &str, path: String, type_: &str) -> Volume {
    Volume {
        name: name.into(),
        host_path: Some(HostPathVolumeSource {
            path,
            type_: Some(type_.into()),
        }),
        ..Volume::default()
    }
}

pub(super) fn mount(name: &str, path: &str, read_only: bool) -> VolumeMount {
    VolumeMount {
        name: name.into(),
        mount_path: path.into(),
        read_only: Some(read_only),
        ..VolumeMount::default()
    }
}

pub(super) fn quantity(s: &str) -> Quantity {
    Quantity(s.to_string())
}

pub(super) fn secret_volume(name: &str, secret: &SecretKeyRef, file: &str) -> Volume {
    Volume {
        name: name.into(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(secret.name.clone()),
            items: Some(vec![KeyToPath {
                key: secret.key.clone(),
                path: file.into(),
                mode: Some(0o400),
            }]),
            ..SecretVolumeSource::default()
        }),
        ..Volume::default()
    }
}

/// Pod security of the Jobs that write the host path. The kubelet creates a
/// `DirectoryOrCreate` host path as root:root 0755 and `fsGroup` does not apply to host
/// paths, so the image's non-root user (10001) could not write there: these pods run as
/// uid 0 with every capability dropped (no DAC override: they can write only what root
/// owns, which is what they create). The server only reads the files (0644) and keeps the
/// image's user.
pub(super) fn host_path_writer() -> PodSecurityContext {
    PodSecurityContext {
        run_as_user: Some(0),
        run_as_group: Some(0),
        run_as_non_root: Some(false),
        ..PodSecurityContext::default()
    }
}

/// Pod security of the server: uid 0 so that the one capability it is given, `IPC_LOCK`,
/// is in its effective set. Container runtimes hand added capabilities to a non-root
/// process only through ambient capabilities, which Kubernetes does not set, and a file
/// capability on the binary would need `allowPrivilegeEscalation` (no_new_privs ignores
/// it). Root here holds no other capability (no DAC override, chown or setuid): it reads
/// the world-readable store and weights through read-only mounts and owns nothing on the
/// node.
pub(super) fn pinning_server() -> PodSecurityContext {
    host_path_writer()
}

/// Capabilities of every pod we run: nothing but `IPC_LOCK` where pinning is needed.
pub(super) fn security_context(ipc_lock: bool) -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".into()]),
            add: ipc_lock.then(|| vec!["IPC_LOCK".into()]),
        }),
        ..SecurityContext::default()
    }
}

pub(super) fn non_empty<T>(v: Vec<T>) -> Option<Vec<T>> {
    (!v.is_empty()).then_some(v)
}
