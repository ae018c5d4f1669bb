//! Pure builders for every object the operator owns. No client, no I/O: each function
//! takes the `GlmFlashDeployment` (and the chosen node) and returns the object to apply,
//! so the whole shape of a deployment is unit-tested field by field.
//!
//! This module holds what every object shares (names, labels, owner reference, config
//! hash) and the store's place on the node; the objects are built by what they are:
//! `job` (pack-store and reclaim Jobs), `deployment` (the server), `service` (API and
//! metrics Services), `monitoring` (ServiceMonitor and dashboard ConfigMap), over `pod`
//! (volumes, mounts, security and node affinity of every pod).
//!
//! Layout on the node (all under `spec.store.hostPath`):
//! - `stores/<namespace>/<name>/<store hash>/`: the packed expert store (`experts.bin` +
//!   `experts.json`) of one object built from one set of inputs, written by the pack-store
//!   Job of that hash and mounted read-only into the server at `/store`. The path says
//!   what the store holds, so a server can only ever mount the store of its own object
//!   and inputs; a pack-store Job first removes the object's stores of other hashes;
//! - `hf/<owner>--<name>/<revision>/`: a Hugging Face download, when the model comes from
//!   the Hub, shared by the objects on the node that name the same revision; a `nodePath`
//!   model is mounted from where it is instead.
//!
//! Each object carries the annotation [`CONFIG_HASH`]: the hash of the object as built.
//! The reconciler compares it with what is in the cluster and applies only on a
//! difference, so a settled deployment reconciles without writes.

use std::collections::BTreeMap;

use glmflash_crds::{ExpertFormat, GlmFlashDeployment, GlmFlashDeploymentSpec};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::Resource;
use serde::Serialize;
use sha2::{Digest, Sha256};

mod deployment;
mod job;
mod monitoring;
mod pod;
mod service;

pub use deployment::{server_args, server_deployment};
pub use job::{RECLAIM_DEADLINE_SECONDS, pack_job, reclaim_job};
pub use monitoring::{
    DASHBOARD_JSON, dashboard_config_map, service_monitor, service_monitor_resource,
};
pub use service::{api_service, metrics_service};

/// The one field manager for every server-side apply.
pub const FIELD_MANAGER: &str = "glmflash-operator";
/// Annotation holding the hash of an owned object as built.
pub const CONFIG_HASH: &str = "glmflash.io/config-hash";
/// Label on pack-store Jobs: the hash of the store's inputs.
pub const STORE_HASH_LABEL: &str = "glmflash.io/store-hash";
/// Label on the pods of replicas 1 and up: the replica index. Replica 0 has none, so the
/// pods and selector of a server created before replicas existed stay as they were (a
/// Deployment's selector cannot change).
pub const REPLICA_LABEL: &str = "glmflash.io/replica";

const NAME_LABEL: &str = "app.kubernetes.io/name";
const INSTANCE_LABEL: &str = "app.kubernetes.io/instance";
const COMPONENT_LABEL: &str = "app.kubernetes.io/component";
const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";

/// Which part of a deployment an object is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Component {
    /// The OpenAI server pod.
    Server,
    /// The pack-store Job.
    PackStore,
    /// The store cleanup Job.
    Reclaim,
    /// The metrics Service and ServiceMonitor.
    Metrics,
    /// The dashboard ConfigMap.
    Dashboard,
}

impl Component {
    fn as_str(self) -> &'static str {
        match self {
            Component::Server => "server",
            Component::PackStore => "pack-store",
            Component::Reclaim => "reclaim",
            Component::Metrics => "metrics",
            Component::Dashboard => "dashboard",
        }
    }
}

/// Names of the owned objects of one `GlmFlashDeployment`.
pub mod names {
    /// OpenAI Service, and the server Deployment of replica 0.
    pub fn server(gfd: &str) -> String {
        gfd.to_string()
    }
    /// Server Deployment of one replica.
    pub fn replica(gfd: &str, index: u32) -> String {
        match index {
            0 => server(gfd),
            i => format!("{gfd}-r{i}"),
        }
    }
    /// Metrics Service and ServiceMonitor.
    pub fn metrics(gfd: &str) -> String {
        format!("{gfd}-metrics")
    }
    /// Pack-store Job for one store hash: a new hash is a new Job.
    pub fn pack_job(gfd: &str, store_hash: &str) -> String {
        format!("{gfd}-pack-{}", &store_hash[..10.min(store_hash.len())])
    }
    /// Store cleanup Job of one replica's node.
    pub fn reclaim_job(gfd: &str, index: u32) -> String {
        match index {
            0 => format!("{gfd}-reclaim"),
            i => format!("{gfd}-reclaim-r{i}"),
        }
    }
    /// Dashboard ConfigMap.
    pub fn dashboard(gfd: &str) -> String {
        format!("{gfd}-dashboard")
    }
}

/// Recommended labels for one component of one deployment.
pub fn labels(gfd_name: &str, component: Component) -> BTreeMap<String, String> {
    BTreeMap::from([
        (NAME_LABEL.to_string(), "glmflash-node".to_string()),
        (INSTANCE_LABEL.to_string(), gfd_name.to_string()),
        (COMPONENT_LABEL.to_string(), component.as_str().to_string()),
        (MANAGED_BY_LABEL.to_string(), FIELD_MANAGER.to_string()),
    ])
}

/// Label selector (as a query string) for the objects of one component of a deployment.
pub fn selector(gfd_name: &str, component: Component) -> String {
    let labels = labels(gfd_name, component);
    [INSTANCE_LABEL, COMPONENT_LABEL, MANAGED_BY_LABEL]
        .iter()
        .map(|k| format!("{k}={}", labels[*k]))
        .collect::<Vec<_>>()
        .join(",")
}

/// The replica a server pod belongs to (replica 0's pods carry no [`REPLICA_LABEL`]).
pub fn replica_of(labels: Option<&BTreeMap<String, String>>) -> u32 {
    labels
        .and_then(|l| l.get(REPLICA_LABEL))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Labels that select the server pods of every replica (the OpenAI Service's selector).
pub fn server_selector(gfd_name: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (NAME_LABEL.to_string(), "glmflash-node".to_string()),
        (INSTANCE_LABEL.to_string(), gfd_name.to_string()),
        (
            COMPONENT_LABEL.to_string(),
            Component::Server.as_str().to_string(),
        ),
    ])
}

/// Hex sha256 of any serializable value.
pub fn sha256_hex(value: &impl Serialize) -> String {
    let bytes = serde_json::to_vec(value).expect("builder values serialize");
    Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Hash of everything the packed store depends on: a change re-runs pack-store, anything
/// else (mode, server flags, memory) only rolls the server.
pub fn store_hash(spec: &GlmFlashDeploymentSpec, node: &str) -> String {
    #[derive(Serialize)]
    struct StoreInputs<'a> {
        node: &'a str,
        repo: Option<&'a str>,
        revision: Option<&'a str>,
        node_path: Option<&'a str>,
        expert_format: ExpertFormat,
        host_path: &'a str,
        image: String,
        /// Bumped when the store's place on the node changes, so each store is rebuilt
        /// where the new layout puts it.
        layout: u32,
    }
    let hf = spec.model.hugging_face.as_ref();
    let full = sha256_hex(&StoreInputs {
        node,
        repo: hf.map(|h| h.repo.as_str()),
        revision: hf.map(|h| h.revision.as_str()),
        node_path: spec.model.node_path.as_deref(),
        expert_format: spec.model.expert_format,
        host_path: &spec.store.host_path,
        image: spec.image.reference(),
        layout: 2,
    });
    full[..16].to_string()
}

/// Host directory holding every store of one object, one subdirectory per store hash.
pub fn stores_dir(gfd: &GlmFlashDeployment) -> String {
    format!(
        "{}/stores/{}/{}",
        gfd.spec.store.host_path.trim_end_matches('/'),
        gfd.namespace_or_default(),
        gfd.name_any_or_empty()
    )
}

/// Host directory of the packed store built from the inputs with hash `store_hash`.
pub fn store_dir(gfd: &GlmFlashDeployment, store_hash: &str) -> String {
    format!("{}/{store_hash}", stores_dir(gfd))
}

/// Host directory of this object's routing history on a node: outside the stores, so a
/// repack keeps it (the server ignores a history of another model by its fingerprint),
/// and written by the server on shutdown, so a wake or restart warm-starts the tiers.
pub fn history_dir(gfd: &GlmFlashDeployment) -> String {
    format!(
        "{}/history/{}/{}",
        gfd.spec.store.host_path.trim_end_matches('/'),
        gfd.namespace_or_default(),
        gfd.name_any_or_empty()
    )
}

/// Host directory of the compiled kernels every server on a node shares: NVRTC's PTX (entries
/// named by the source's hash, the GPU's architecture and the compiler's version) and the
/// driver's PTX-to-machine-code cache. Outside the stores and every object's own directory,
/// so no reclaim removes it; a pod that wakes or restarts finds its kernels built (compiling
/// them takes ~15 s of host time, seconds more for the driver's step).
pub fn kernels_dir(spec: &GlmFlashDeploymentSpec) -> String {
    format!("{}/kernels", spec.store.host_path.trim_end_matches('/'))
}

/// Host directory of the model weights.
pub fn model_dir(spec: &GlmFlashDeploymentSpec) -> String {
    match (&spec.model.node_path, &spec.model.hugging_face) {
        (Some(path), _) => path.clone(),
        (None, Some(hf)) => format!(
            "{}/hf/{}/{}",
            spec.store.host_path.trim_end_matches('/'),
            hf.repo.replace('/', "--"),
            hf.revision
        ),
        // Unreachable for a validated spec; a path that cannot exist keeps the builder total.
        (None, None) => format!("{}/hf/unset", spec.store.host_path.trim_end_matches('/')),
    }
}

/// In-cluster base URL of the OpenAI API.
pub fn endpoint(gfd: &GlmFlashDeployment) -> String {
    format!(
        "http://{}.{}.svc:{}/v1",
        names::server(&gfd.name_any_or_empty()),
        gfd.namespace_or_default(),
        gfd.spec.server.port
    )
}

/// URL of `/metrics` on the first ready pod among `pods` (one replica's): each replica's
/// figures are its own, which the metrics Service, balancing over all, cannot give.
pub fn pod_metrics_url(gfd: &GlmFlashDeployment, pods: &[Pod]) -> Option<String> {
    let ready = |p: &&Pod| {
        p.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
    };
    let ip = pods
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .find(ready)?
        .status
        .as_ref()?
        .pod_ip
        .clone()?;
    let host = if ip.contains(':') {
        format!("[{ip}]")
    } else {
        ip
    };
    Some(format!(
        "http://{host}:{}/metrics",
        gfd.spec.metrics.effective_port(&gfd.spec.server)
    ))
}

/// The node a Job built here is pinned to (by [`pod::node_affinity`]).
pub fn pinned_node(job: &Job) -> Option<String> {
    job.spec
        .as_ref()?
        .template
        .spec
        .as_ref()?
        .affinity
        .as_ref()?
        .node_affinity
        .as_ref()?
        .required_during_scheduling_ignored_during_execution
        .as_ref()?
        .node_selector_terms
        .iter()
        .flat_map(|t| t.match_fields.iter().flatten())
        .find(|r| r.key == "metadata.name" && r.operator == "In")?
        .values
        .as_ref()?
        .first()
        .cloned()
}

trait NameOrEmpty {
    fn name_any_or_empty(&self) -> String;
    fn namespace_or_default(&self) -> String;
}

impl NameOrEmpty for GlmFlashDeployment {
    fn name_any_or_empty(&self) -> String {
        self.meta().name.clone().unwrap_or_default()
    }
    fn namespace_or_default(&self) -> String {
        self.meta()
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into())
    }
}

fn owner_reference(gfd: &GlmFlashDeployment) -> Option<Vec<OwnerReference>> {
    gfd.controller_owner_ref(&()).map(|o| vec![o])
}

fn meta(gfd: &GlmFlashDeployment, name: String, component: Component, owned: bool) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace: Some(gfd.namespace_or_default()),
        labels: Some(labels(&gfd.name_any_or_empty(), component)),
        owner_references: if owned { owner_reference(gfd) } else { None },
        ..ObjectMeta::default()
    }
}

/// Stamps [`CONFIG_HASH`] on an object: the hash of the object without it.
fn with_config_hash<K: Resource + Serialize>(mut obj: K) -> K {
    let hash = sha256_hex(&obj);
    obj.meta_mut()
        .annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(CONFIG_HASH.to_string(), hash);
    obj
}

/// Whether `existing` (as read from the cluster) holds every field of `desired` (as built)
/// with the same value: fields the API server adds (defaults, status, bookkeeping) do not
/// count, anything the operator sets and someone changed (replicas, resources, args) does.
/// Quantities compare by value, as the API server may rewrite `0.5Gi` as `512Mi`.
pub fn holds(existing: &serde_json::Value, desired: &serde_json::Value) -> bool {
    use serde_json::Value;
    match (existing, desired) {
        (Value::Object(e), Value::Object(d)) => d
            .iter()
            .all(|(k, dv)| dv.is_null() || e.get(k).is_some_and(|ev| holds(ev, dv))),
        (Value::Array(e), Value::Array(d)) => {
            e.len() == d.len() && e.iter().zip(d).all(|(ev, dv)| holds(ev, dv))
        }
        (Value::String(e), Value::String(d)) => {
            e == d
                || matches!(
                    (crate::placement::parse_quantity(e), crate::placement::parse_quantity(d)),
                    (Some(a), Some(b)) if a == b
                )
        }
        (e, d) => e == d,
    }
}

/// The config hash an object carries, if any.
pub fn config_hash_of<K: Resource>(obj: &K) -> Option<&str> {
    obj.meta()
        .annotations
        .as_ref()?
        .get(CONFIG_HASH)
        .map(String::as_str)
}

#[cfg(test)]
mod tests;
