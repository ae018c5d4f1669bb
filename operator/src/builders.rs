//! Pure builders for every object the operator owns. No client, no I/O: each function
//! takes the `GlmFlashDeployment` (and the chosen node) and returns the object to apply,
//! so the whole shape of a deployment is unit-tested field by field.
//!
//! Layout on the node (all under `spec.store.hostPath`):
//! - `store/`: the packed expert store (`experts.bin` + `experts.json`), written by the
//!   pack-store Job, mounted read-only into the server at `/store`;
//! - `hf/<owner>--<name>/<revision>/`: a Hugging Face download, when the model comes from
//!   the Hub; a `nodePath` model is mounted from where it is instead.
//!
//! Each object carries the annotation [`CONFIG_HASH`]: the hash of the object as built.
//! The reconciler compares it with what is in the cluster and applies only on a
//! difference, so a settled deployment reconciles without writes.

use std::collections::BTreeMap;

use glmflash_crds::{
    ExpertFormat, GPU_RESOURCE, GlmFlashDeployment, GlmFlashDeploymentSpec, SecretKeyRef,
};
use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec, DeploymentStrategy};
use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{
    Affinity, Capabilities, ConfigMap, Container, ContainerPort, EmptyDirVolumeSource, EnvVar,
    EnvVarSource, HTTPGetAction, HostPathVolumeSource, KeyToPath, NodeAffinity, NodeSelector,
    NodeSelectorRequirement, NodeSelectorTerm, PodSecurityContext, PodSpec, PodTemplateSpec, Probe,
    ResourceRequirements, SecretKeySelector, SecretVolumeSource, SecurityContext, Service,
    ServicePort, ServiceSpec, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::Resource;
use kube::api::{ApiResource, DynamicObject};
use serde::Serialize;
use sha2::{Digest, Sha256};

/// The one field manager for every server-side apply.
pub const FIELD_MANAGER: &str = "glmflash-operator";
/// Annotation holding the hash of an owned object as built.
pub const CONFIG_HASH: &str = "glmflash.io/config-hash";
/// Label on pack-store Jobs: the hash of the store's inputs.
pub const STORE_HASH_LABEL: &str = "glmflash.io/store-hash";
/// The Grafana dashboard the chart ships, reused for per-object dashboard ConfigMaps.
pub const DASHBOARD_JSON: &str = include_str!("../../charts/glmflash/dashboards/glmflash.json");

const NAME_LABEL: &str = "app.kubernetes.io/name";
const INSTANCE_LABEL: &str = "app.kubernetes.io/instance";
const COMPONENT_LABEL: &str = "app.kubernetes.io/component";
const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";

const MODEL_MOUNT: &str = "/models";
const STORE_MOUNT: &str = "/store";
const TOKEN_MOUNT: &str = "/secrets/hf";
const TERMINATION_LOG: &str = "/dev/termination-log";

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
    /// Server Deployment and OpenAI Service.
    pub fn server(gfd: &str) -> String {
        gfd.to_string()
    }
    /// Metrics Service and ServiceMonitor.
    pub fn metrics(gfd: &str) -> String {
        format!("{gfd}-metrics")
    }
    /// Pack-store Job for one store hash: a new hash is a new Job.
    pub fn pack_job(gfd: &str, store_hash: &str) -> String {
        format!("{gfd}-pack-{}", &store_hash[..10.min(store_hash.len())])
    }
    /// Store cleanup Job.
    pub fn reclaim_job(gfd: &str) -> String {
        format!("{gfd}-reclaim")
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

/// Labels that select the server pod.
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
    });
    full[..16].to_string()
}

/// Host directory of the packed store.
pub fn store_dir(spec: &GlmFlashDeploymentSpec) -> String {
    format!("{}/store", spec.store.host_path.trim_end_matches('/'))
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

/// In-cluster URL of the server's `/metrics`.
pub fn metrics_url(gfd: &GlmFlashDeployment) -> String {
    format!(
        "http://{}.{}.svc:{}/metrics",
        names::metrics(&gfd.name_any_or_empty()),
        gfd.namespace_or_default(),
        gfd.spec.metrics.effective_port(&gfd.spec.server)
    )
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

/// The config hash an object carries, if any.
pub fn config_hash_of<K: Resource>(obj: &K) -> Option<&str> {
    obj.meta()
        .annotations
        .as_ref()?
        .get(CONFIG_HASH)
        .map(String::as_str)
}

/// Pins a pod to one node by name (the scheduler still accounts for its resources, unlike
/// `spec.nodeName`).
fn node_affinity(node: &str) -> Affinity {
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

fn host_path_volume(name: &str, path: String, type_: &str) -> Volume {
    Volume {
        name: name.into(),
        host_path: Some(HostPathVolumeSource {
            path,
            type_: Some(type_.into()),
        }),
        ..Volume::default()
    }
}

fn mount(name: &str, path: &str, read_only: bool) -> VolumeMount {
    VolumeMount {
        name: name.into(),
        mount_path: path.into(),
        read_only: Some(read_only),
        ..VolumeMount::default()
    }
}

fn quantity(s: &str) -> Quantity {
    Quantity(s.to_string())
}

fn secret_volume(name: &str, secret: &SecretKeyRef, file: &str) -> Volume {
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
fn host_path_writer() -> PodSecurityContext {
    PodSecurityContext {
        run_as_user: Some(0),
        run_as_group: Some(0),
        run_as_non_root: Some(false),
        ..PodSecurityContext::default()
    }
}

/// Capabilities of every pod we run: nothing but `IPC_LOCK` where pinning is needed.
fn security_context(ipc_lock: bool) -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".into()]),
            add: ipc_lock.then(|| vec!["IPC_LOCK".into()]),
        }),
        ..SecurityContext::default()
    }
}

/// The pack-store Job for the given store hash, pinned to `node`.
///
/// With a Hub model an init container runs `glmflash-node download` into the host path
/// first. pack-store is resumable and idempotent, so a retried pod continues where the
/// last one stopped; `backoffLimit` bounds the retries. It reports the store size as JSON
/// (`{"storeBytes": N}`) in its termination message, which the operator copies to status.
pub fn pack_job(gfd: &GlmFlashDeployment, node: &str, store_hash: &str) -> Job {
    let spec = &gfd.spec;
    let image = spec.image.reference();
    let pull = spec.image.pull_policy.as_str().to_string();
    let hf = spec.model.hugging_face.as_ref();

    let mut volumes = vec![
        host_path_volume(
            "model",
            model_dir(spec),
            if hf.is_some() {
                "DirectoryOrCreate"
            } else {
                "Directory"
            },
        ),
        host_path_volume("store", store_dir(spec), "DirectoryOrCreate"),
    ];
    let init_containers = hf.map(|hf| {
        let mut args = vec![
            "download".to_string(),
            "--repo".into(),
            hf.repo.clone(),
            "--revision".into(),
            hf.revision.clone(),
            "--dir".into(),
            MODEL_MOUNT.into(),
        ];
        let mut mounts = vec![mount("model", MODEL_MOUNT, false)];
        if let Some(token) = &hf.token_secret {
            args.extend(["--token-file".into(), format!("{TOKEN_MOUNT}/token")]);
            volumes.push(secret_volume("hf-token", token, "token"));
            mounts.push(mount("hf-token", TOKEN_MOUNT, true));
        }
        vec![Container {
            name: "download".into(),
            image: Some(image.clone()),
            image_pull_policy: Some(pull.clone()),
            args: Some(args),
            volume_mounts: Some(mounts),
            security_context: Some(security_context(false)),
            ..Container::default()
        }]
    });

    let mut pack_args = vec![
        "pack-store".to_string(),
        "--model".into(),
        MODEL_MOUNT.into(),
        "--store".into(),
        STORE_MOUNT.into(),
        "--report".into(),
        TERMINATION_LOG.into(),
    ];
    if let Some(format) = spec.model.expert_format.as_arg() {
        pack_args.extend(["--format".into(), format.into()]);
    }
    let pack = Container {
        name: "pack-store".into(),
        image: Some(image),
        image_pull_policy: Some(pull),
        args: Some(pack_args),
        volume_mounts: Some(vec![
            mount("model", MODEL_MOUNT, true),
            mount("store", STORE_MOUNT, false),
        ]),
        termination_message_policy: Some("File".into()),
        security_context: Some(security_context(false)),
        ..Container::default()
    };

    let mut labels = labels(&gfd.name_any_or_empty(), Component::PackStore);
    labels.insert(STORE_HASH_LABEL.into(), store_hash.into());
    let mut metadata = meta(
        gfd,
        names::pack_job(&gfd.name_any_or_empty(), store_hash),
        Component::PackStore,
        true,
    );
    metadata.labels = Some(labels.clone());

    with_config_hash(Job {
        metadata,
        spec: Some(JobSpec {
            backoff_limit: Some(spec.store.pack_retries),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    restart_policy: Some("Never".into()),
                    affinity: Some(node_affinity(node)),
                    tolerations: non_empty(spec.placement.tolerations.clone()),
                    init_containers,
                    security_context: Some(host_path_writer()),
                    containers: vec![pack],
                    volumes: Some(volumes),
                    ..PodSpec::default()
                }),
            },
            ..JobSpec::default()
        }),
        status: None,
    })
}

/// The Job that deletes `store/` and `hf/` under the host path on `node` (reclaim policy
/// `Delete`). It is not
/// owned by the deployment, so garbage collection cannot kill it half way; it removes
/// itself after it finishes.
pub fn reclaim_job(gfd: &GlmFlashDeployment, node: &str) -> Job {
    let spec = &gfd.spec;
    with_config_hash(Job {
        metadata: meta(
            gfd,
            names::reclaim_job(&gfd.name_any_or_empty()),
            Component::Reclaim,
            false,
        ),
        spec: Some(JobSpec {
            backoff_limit: Some(2),
            ttl_seconds_after_finished: Some(600),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels(&gfd.name_any_or_empty(), Component::Reclaim)),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    restart_policy: Some("Never".into()),
                    affinity: Some(node_affinity(node)),
                    tolerations: non_empty(spec.placement.tolerations.clone()),
                    security_context: Some(host_path_writer()),
                    containers: vec![Container {
                        name: "reclaim".into(),
                        image: Some(spec.image.reference()),
                        image_pull_policy: Some(spec.image.pull_policy.as_str().into()),
                        command: Some(vec!["/bin/sh".into(), "-c".into()]),
                        // Only what the operator wrote: a nodePath model may live beside it.
                        args: Some(vec!["rm -rf /reclaim/store /reclaim/hf".into()]),
                        volume_mounts: Some(vec![mount("reclaim", "/reclaim", false)]),
                        security_context: Some(security_context(false)),
                        ..Container::default()
                    }],
                    volumes: Some(vec![host_path_volume(
                        "reclaim",
                        spec.store.host_path.clone(),
                        "Directory",
                    )]),
                    ..PodSpec::default()
                }),
            },
            ..JobSpec::default()
        }),
        status: None,
    })
}

fn non_empty<T>(v: Vec<T>) -> Option<Vec<T>> {
    (!v.is_empty()).then_some(v)
}

/// glmflash-node `serve` arguments for the spec.
pub fn server_args(spec: &GlmFlashDeploymentSpec) -> Vec<String> {
    let mut args: Vec<String> = vec![
        "serve".into(),
        "--model".into(),
        MODEL_MOUNT.into(),
        "--store".into(),
        STORE_MOUNT.into(),
        "--mode".into(),
        spec.mode.as_arg().into(),
        "--host".into(),
        "0.0.0.0".into(),
        "--port".into(),
        spec.server.port.to_string(),
        "--served-model-name".into(),
        spec.server.served_model_name.clone(),
        "--context-length".into(),
        spec.server.context_length.to_string(),
        "--max-batch-size".into(),
        spec.server.max_batch_size.to_string(),
        "--chunk-size".into(),
        spec.server.prefill_chunk.to_string(),
    ];
    if let Some(slots) = spec.vram.expert_slots {
        args.extend(["--vram-expert-slots".into(), slots.to_string()]);
    }
    args.extend([
        "--min-free-vram-mib".into(),
        spec.vram.min_free_mib.to_string(),
    ]);
    if let Some(port) = spec.metrics.port {
        args.extend(["--metrics-port".into(), port.to_string()]);
    }
    args
}

/// The server Deployment on `node`: one replica (zero while the store is being rebuilt),
/// `Recreate` so two servers never share the GPU.
pub fn server_deployment(gfd: &GlmFlashDeployment, node: &str, replicas: i32) -> Deployment {
    let spec = &gfd.spec;
    let name = gfd.name_any_or_empty();
    let selector = server_selector(&name);

    let mut pod_labels = labels(&name, Component::Server);
    pod_labels.extend(selector.clone());

    let mut ports = vec![ContainerPort {
        name: Some("http".into()),
        container_port: spec.server.port,
        protocol: Some("TCP".into()),
        ..ContainerPort::default()
    }];
    if let Some(port) = spec.metrics.port.filter(|p| *p != spec.server.port) {
        ports.push(ContainerPort {
            name: Some("metrics".into()),
            container_port: port,
            protocol: Some("TCP".into()),
            ..ContainerPort::default()
        });
    }

    let env = spec.server.api_key_secret.as_ref().map(|secret| {
        vec![EnvVar {
            name: "GLMFLASH_API_KEY".into(),
            value_from: Some(EnvVarSource {
                secret_key_ref: Some(SecretKeySelector {
                    name: secret.name.clone(),
                    key: secret.key.clone(),
                    optional: Some(false),
                }),
                ..EnvVarSource::default()
            }),
            ..EnvVar::default()
        }]
    });

    let mut resources = BTreeMap::from([("memory".to_string(), quantity(&spec.memory.limit))]);
    if spec.placement.require_gpu {
        resources.insert(GPU_RESOURCE.to_string(), quantity("1"));
    }

    let probe = |path: &str, period: i32, failures: i32| Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.into()),
            port: IntOrString::String("http".into()),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(period),
        failure_threshold: Some(failures),
        timeout_seconds: Some(5),
        ..Probe::default()
    };

    let container = Container {
        name: "server".into(),
        image: Some(spec.image.reference()),
        image_pull_policy: Some(spec.image.pull_policy.as_str().into()),
        args: Some(server_args(spec)),
        env,
        ports: Some(ports),
        resources: Some(ResourceRequirements {
            // requests = limits: the scheduler reserves the whole cap that the RAM tier
            // will pin, and the pod is never the first evicted.
            limits: Some(resources.clone()),
            requests: Some(resources),
            ..ResourceRequirements::default()
        }),
        security_context: Some(security_context(true)),
        volume_mounts: Some(vec![
            mount("model", MODEL_MOUNT, true),
            mount("store", STORE_MOUNT, true),
            mount("dshm", "/dev/shm", false),
        ]),
        // Loading 125 GB of weights and warming the tiers takes minutes: allow 30 of them.
        startup_probe: Some(probe("/health", 10, 180)),
        readiness_probe: Some(probe("/ready", 10, 3)),
        liveness_probe: Some(probe("/health", 20, 3)),
        ..Container::default()
    };

    with_config_hash(Deployment {
        metadata: meta(gfd, names::server(&name), Component::Server, true),
        spec: Some(DeploymentSpec {
            replicas: Some(replicas),
            selector: LabelSelector {
                match_labels: Some(selector),
                ..LabelSelector::default()
            },
            strategy: Some(DeploymentStrategy {
                type_: Some("Recreate".into()),
                ..DeploymentStrategy::default()
            }),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(pod_labels),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    affinity: Some(node_affinity(node)),
                    tolerations: non_empty(spec.placement.tolerations.clone()),
                    containers: vec![container],
                    // Long enough to drain in-flight requests and unpin the RAM tier.
                    termination_grace_period_seconds: Some(60),
                    volumes: Some(vec![
                        host_path_volume("model", model_dir(spec), "Directory"),
                        host_path_volume("store", store_dir(spec), "Directory"),
                        Volume {
                            name: "dshm".into(),
                            empty_dir: Some(EmptyDirVolumeSource {
                                medium: Some("Memory".into()),
                                size_limit: Some(quantity(&spec.memory.shm_size)),
                            }),
                            ..Volume::default()
                        },
                    ]),
                    ..PodSpec::default()
                }),
            },
            ..DeploymentSpec::default()
        }),
        status: None,
    })
}

/// The OpenAI API Service.
pub fn api_service(gfd: &GlmFlashDeployment) -> Service {
    let name = gfd.name_any_or_empty();
    service(
        gfd,
        names::server(&name),
        Component::Server,
        "http",
        gfd.spec.server.port,
        "http",
    )
}

/// The metrics Service, selected by the ServiceMonitor.
pub fn metrics_service(gfd: &GlmFlashDeployment) -> Service {
    let name = gfd.name_any_or_empty();
    let port = gfd.spec.metrics.effective_port(&gfd.spec.server);
    let target = if port == gfd.spec.server.port {
        "http"
    } else {
        "metrics"
    };
    service(
        gfd,
        names::metrics(&name),
        Component::Metrics,
        "metrics",
        port,
        target,
    )
}

fn service(
    gfd: &GlmFlashDeployment,
    name: String,
    component: Component,
    port_name: &str,
    port: i32,
    target: &str,
) -> Service {
    with_config_hash(Service {
        metadata: meta(gfd, name, component, true),
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".into()),
            selector: Some(server_selector(&gfd.name_any_or_empty())),
            ports: Some(vec![ServicePort {
                name: Some(port_name.into()),
                port,
                target_port: Some(IntOrString::String(target.into())),
                protocol: Some("TCP".into()),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        status: None,
    })
}

/// API resource of the Prometheus operator's ServiceMonitor.
pub fn service_monitor_resource() -> ApiResource {
    ApiResource {
        group: "monitoring.coreos.com".into(),
        version: "v1".into(),
        api_version: "monitoring.coreos.com/v1".into(),
        kind: "ServiceMonitor".into(),
        plural: "servicemonitors".into(),
    }
}

/// A ServiceMonitor scraping the metrics Service.
pub fn service_monitor(gfd: &GlmFlashDeployment) -> DynamicObject {
    let name = gfd.name_any_or_empty();
    let mut obj = DynamicObject::new(&names::metrics(&name), &service_monitor_resource());
    obj.metadata = meta(gfd, names::metrics(&name), Component::Metrics, true);
    obj.data = serde_json::json!({
        "spec": {
            "selector": { "matchLabels": labels(&name, Component::Metrics) },
            "endpoints": [{ "port": "metrics", "path": "/metrics", "interval": "15s" }]
        }
    });
    with_config_hash(obj)
}

/// A ConfigMap carrying the chart's Grafana dashboard, for Grafana's sidecar.
pub fn dashboard_config_map(gfd: &GlmFlashDeployment) -> ConfigMap {
    let name = gfd.name_any_or_empty();
    let mut metadata = meta(gfd, names::dashboard(&name), Component::Dashboard, true);
    metadata
        .labels
        .get_or_insert_with(BTreeMap::new)
        .insert("grafana_dashboard".into(), "1".into());
    with_config_hash(ConfigMap {
        metadata,
        data: Some(BTreeMap::from([(
            format!("glmflash-{name}.json"),
            DASHBOARD_JSON.to_string(),
        )])),
        ..ConfigMap::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::gfd;
    use glmflash_crds::{Mode, SecretKeyRef};

    fn server_container(d: &Deployment) -> &Container {
        &d.spec
            .as_ref()
            .unwrap()
            .template
            .spec
            .as_ref()
            .unwrap()
            .containers[0]
    }

    fn pod_spec(d: &Deployment) -> &PodSpec {
        d.spec.as_ref().unwrap().template.spec.as_ref().unwrap()
    }

    #[test]
    fn owned_objects_carry_owner_reference_labels_and_hash() {
        let g = gfd();
        let d = server_deployment(&g, "gpu-a", 1);
        let owner = &d.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(owner.kind, "GlmFlashDeployment");
        assert_eq!(owner.api_version, "glmflash.io/v1alpha1");
        assert_eq!(owner.name, "glm");
        assert_eq!(owner.uid, "0b5e0c4e-uid");
        assert_eq!(owner.controller, Some(true));
        assert_eq!(d.metadata.namespace.as_deref(), Some("ai"));
        let labels = d.metadata.labels.as_ref().unwrap();
        assert_eq!(labels["app.kubernetes.io/instance"], "glm");
        assert_eq!(labels["app.kubernetes.io/managed-by"], "glmflash-operator");
        assert_eq!(labels["app.kubernetes.io/component"], "server");
        // The hash covers the object: change anything, the hash changes.
        let mut other = gfd();
        other.spec.server.max_batch_size = 4;
        assert_ne!(
            config_hash_of(&d),
            config_hash_of(&server_deployment(&other, "gpu-a", 1))
        );
        assert_eq!(
            config_hash_of(&d),
            config_hash_of(&server_deployment(&gfd(), "gpu-a", 1))
        );
        for owned in [
            api_service(&g).metadata,
            metrics_service(&g).metadata,
            pack_job(&g, "gpu-a", "0123456789abcdef").metadata,
            dashboard_config_map(&g).metadata,
            service_monitor(&g).metadata,
        ] {
            assert_eq!(
                owned.owner_references.as_ref().unwrap()[0].uid,
                "0b5e0c4e-uid"
            );
            assert!(
                owned
                    .annotations
                    .as_ref()
                    .unwrap()
                    .contains_key(CONFIG_HASH)
            );
        }
    }

    #[test]
    fn server_deployment_field_by_field() {
        let mut g = gfd();
        g.spec.server.api_key_secret = Some(SecretKeyRef {
            name: "api".into(),
            key: "key".into(),
        });
        let d = server_deployment(&g, "gpu-a", 1);
        let spec = d.spec.as_ref().unwrap();
        assert_eq!(spec.replicas, Some(1));
        assert_eq!(
            spec.strategy.as_ref().unwrap().type_.as_deref(),
            Some("Recreate")
        );
        assert_eq!(
            spec.selector.match_labels.as_ref().unwrap(),
            &server_selector("glm")
        );
        let template_labels = spec
            .template
            .metadata
            .as_ref()
            .unwrap()
            .labels
            .as_ref()
            .unwrap();
        for (k, v) in server_selector("glm") {
            assert_eq!(template_labels[&k], v);
        }

        let c = server_container(&d);
        assert_eq!(
            c.image.as_deref(),
            Some("ghcr.io/glmflash/glmflash-node:0.1.0")
        );
        assert_eq!(c.image_pull_policy.as_deref(), Some("IfNotPresent"));
        assert_eq!(
            c.args.as_ref().unwrap().join(" "),
            "serve --model /models --store /store --mode nvme \
             --host 0.0.0.0 --port 30000 --served-model-name glm-5.3-flash \
             --context-length 131072 --max-batch-size 8 --chunk-size 8192 \
             --vram-expert-slots 1376 --min-free-vram-mib 23000"
        );
        let limits = c.resources.as_ref().unwrap().limits.as_ref().unwrap();
        assert_eq!(limits["memory"], Quantity("55Gi".into()));
        assert_eq!(limits["nvidia.com/gpu"], Quantity("1".into()));
        assert_eq!(
            c.resources.as_ref().unwrap().requests.as_ref(),
            Some(limits)
        );
        let caps = c
            .security_context
            .as_ref()
            .unwrap()
            .capabilities
            .as_ref()
            .unwrap();
        assert_eq!(caps.add.as_deref(), Some(&["IPC_LOCK".to_string()][..]));
        assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_string()][..]));
        assert_eq!(
            c.security_context
                .as_ref()
                .unwrap()
                .allow_privilege_escalation,
            Some(false)
        );
        let env = &c.env.as_ref().unwrap()[0];
        assert_eq!(env.name, "GLMFLASH_API_KEY");
        let secret = env
            .value_from
            .as_ref()
            .unwrap()
            .secret_key_ref
            .as_ref()
            .unwrap();
        assert_eq!((secret.name.as_str(), secret.key.as_str()), ("api", "key"));
        let ports = c.ports.as_ref().unwrap();
        assert_eq!(ports.len(), 1);
        assert_eq!(ports[0].container_port, 30000);
        assert_eq!(ports[0].name.as_deref(), Some("http"));

        let startup = c.startup_probe.as_ref().unwrap();
        assert_eq!(
            startup.http_get.as_ref().unwrap().path.as_deref(),
            Some("/health")
        );
        assert!(startup.period_seconds.unwrap() * startup.failure_threshold.unwrap() >= 1800);
        let ready = c.readiness_probe.as_ref().unwrap();
        assert_eq!(
            ready.http_get.as_ref().unwrap().path.as_deref(),
            Some("/ready")
        );
        let live = c.liveness_probe.as_ref().unwrap();
        assert_eq!(
            live.http_get.as_ref().unwrap().path.as_deref(),
            Some("/health")
        );

        let mounts: Vec<(&str, &str, Option<bool>)> = c
            .volume_mounts
            .as_ref()
            .unwrap()
            .iter()
            .map(|m| (m.name.as_str(), m.mount_path.as_str(), m.read_only))
            .collect();
        assert_eq!(
            mounts,
            [
                ("model", "/models", Some(true)),
                ("store", "/store", Some(true)),
                ("dshm", "/dev/shm", Some(false)),
            ]
        );

        let pod = pod_spec(&d);
        let volumes = pod.volumes.as_ref().unwrap();
        assert_eq!(
            volumes[0].host_path.as_ref().unwrap().path,
            "/mnt/nvme/glmflash/hf/turboderp--GLM-5.3-Flash-exl3/332ab457b709b7ba30dd9a448be5de03b80a7ac9"
        );
        assert_eq!(
            volumes[1].host_path.as_ref().unwrap().path,
            "/mnt/nvme/glmflash/store"
        );
        let shm = volumes[2].empty_dir.as_ref().unwrap();
        assert_eq!(shm.medium.as_deref(), Some("Memory"));
        assert_eq!(shm.size_limit, Some(Quantity("1Gi".into())));
        let term = &pod
            .affinity
            .as_ref()
            .unwrap()
            .node_affinity
            .as_ref()
            .unwrap()
            .required_during_scheduling_ignored_during_execution
            .as_ref()
            .unwrap()
            .node_selector_terms[0];
        let field = &term.match_fields.as_ref().unwrap()[0];
        assert_eq!(
            (
                field.key.as_str(),
                field.operator.as_str(),
                field.values.as_deref()
            ),
            ("metadata.name", "In", Some(&["gpu-a".to_string()][..]))
        );
        assert!(pod.tolerations.is_none());
    }

    #[test]
    fn separate_metrics_port_and_other_modes_reach_the_args() {
        let mut g = gfd();
        g.spec.mode = Mode::NvmeExact;
        g.spec.metrics.port = Some(9400);
        g.spec.vram.expert_slots = None;
        g.spec.model.hugging_face = None;
        g.spec.model.node_path = Some("/data/glm53".into());
        let d = server_deployment(&g, "gpu-a", 0);
        assert_eq!(d.spec.as_ref().unwrap().replicas, Some(0));
        let c = server_container(&d);
        let args = c.args.as_ref().unwrap().join(" ");
        assert!(args.contains("--mode nvme-exact"), "{args}");
        assert!(args.ends_with("--metrics-port 9400"), "{args}");
        assert!(!args.contains("--vram-expert-slots"), "{args}");
        assert_eq!(c.ports.as_ref().unwrap()[1].container_port, 9400);
        assert_eq!(
            pod_spec(&d).volumes.as_ref().unwrap()[0]
                .host_path
                .as_ref()
                .unwrap()
                .path,
            "/data/glm53"
        );
        let svc = metrics_service(&g);
        let port = &svc.spec.as_ref().unwrap().ports.as_ref().unwrap()[0];
        assert_eq!(port.port, 9400);
        assert_eq!(
            port.target_port,
            Some(IntOrString::String("metrics".into()))
        );
        assert_eq!(metrics_url(&g), "http://glm-metrics.ai.svc:9400/metrics");
    }

    #[test]
    fn cpu_switch_drops_the_gpu_request_only() {
        let mut g = gfd();
        g.spec.placement.require_gpu = false;
        let d = server_deployment(&g, "kind-worker", 1);
        let limits = server_container(&d)
            .resources
            .as_ref()
            .unwrap()
            .limits
            .clone()
            .unwrap();
        assert_eq!(limits.keys().collect::<Vec<_>>(), ["memory"]);
    }

    #[test]
    fn services_select_the_server() {
        let g = gfd();
        let api = api_service(&g);
        assert_eq!(api.metadata.name.as_deref(), Some("glm"));
        let spec = api.spec.as_ref().unwrap();
        assert_eq!(spec.selector.as_ref().unwrap(), &server_selector("glm"));
        let port = &spec.ports.as_ref().unwrap()[0];
        assert_eq!((port.name.as_deref(), port.port), (Some("http"), 30000));
        assert_eq!(port.target_port, Some(IntOrString::String("http".into())));
        let metrics = metrics_service(&g);
        assert_eq!(metrics.metadata.name.as_deref(), Some("glm-metrics"));
        assert_eq!(
            metrics.metadata.labels.as_ref().unwrap()["app.kubernetes.io/component"],
            "metrics"
        );
        assert_eq!(endpoint(&g), "http://glm.ai.svc:30000/v1");
    }

    #[test]
    fn service_monitor_selects_the_metrics_service() {
        let g = gfd();
        let sm = service_monitor(&g);
        let sm_json = serde_json::to_value(&sm).unwrap();
        assert_eq!(sm_json["apiVersion"], "monitoring.coreos.com/v1");
        assert_eq!(sm_json["kind"], "ServiceMonitor");
        let selector = &sm_json["spec"]["selector"]["matchLabels"];
        let svc_labels = metrics_service(&g).metadata.labels.unwrap();
        for (k, v) in selector.as_object().unwrap() {
            assert_eq!(svc_labels[k], v.as_str().unwrap(), "{k}");
        }
        assert_eq!(sm_json["spec"]["endpoints"][0]["port"], "metrics");
        assert_eq!(sm_json["spec"]["endpoints"][0]["path"], "/metrics");
    }

    #[test]
    fn pack_job_downloads_then_packs_on_the_node() {
        let mut g = gfd();
        g.spec.model.hugging_face.as_mut().unwrap().token_secret = Some(SecretKeyRef {
            name: "hf".into(),
            key: "token".into(),
        });
        let job = pack_job(&g, "gpu-a", "0123456789abcdef");
        assert_eq!(job.metadata.name.as_deref(), Some("glm-pack-0123456789"));
        assert_eq!(
            job.metadata.labels.as_ref().unwrap()[STORE_HASH_LABEL],
            "0123456789abcdef"
        );
        let spec = job.spec.as_ref().unwrap();
        assert_eq!(spec.backoff_limit, Some(2));
        let pod = spec.template.spec.as_ref().unwrap();
        assert_eq!(pod.restart_policy.as_deref(), Some("Never"));
        // Writes the root-owned host path as root, with no capabilities (below).
        let psc = pod.security_context.as_ref().unwrap();
        assert_eq!((psc.run_as_user, psc.run_as_group), (Some(0), Some(0)));
        let init = &pod.init_containers.as_ref().unwrap()[0];
        assert_eq!(
            init.args.as_ref().unwrap().join(" "),
            "download --repo turboderp/GLM-5.3-Flash-exl3 --revision \
             332ab457b709b7ba30dd9a448be5de03b80a7ac9 --dir /models --token-file /secrets/hf/token"
        );
        let pack = &pod.containers[0];
        assert_eq!(
            pack.args.as_ref().unwrap().join(" "),
            "pack-store --model /models --store /store --report /dev/termination-log \
             --format q4_k"
        );
        assert_eq!(pack.termination_message_policy.as_deref(), Some("File"));
        // pack-store needs no GPU and no pinning.
        assert!(pack.resources.is_none());
        assert!(
            pack.security_context
                .as_ref()
                .unwrap()
                .capabilities
                .as_ref()
                .unwrap()
                .add
                .is_none()
        );
        let volumes = pod.volumes.as_ref().unwrap();
        assert_eq!(
            volumes[0].host_path.as_ref().unwrap().type_.as_deref(),
            Some("DirectoryOrCreate")
        );
        assert_eq!(
            volumes[1].host_path.as_ref().unwrap().path,
            "/mnt/nvme/glmflash/store"
        );
        let token = volumes[2].secret.as_ref().unwrap();
        assert_eq!(token.secret_name.as_deref(), Some("hf"));
        assert_eq!(token.items.as_ref().unwrap()[0].path, "token");
        let pack_mounts = pack.volume_mounts.as_ref().unwrap();
        assert_eq!(pack_mounts[0].read_only, Some(true));
        assert_eq!(pack_mounts[1].read_only, Some(false));
    }

    #[test]
    fn node_path_model_needs_no_download() {
        let mut g = gfd();
        g.spec.model.hugging_face = None;
        g.spec.model.node_path = Some("/data/glm53".into());
        let job = pack_job(&g, "gpu-a", "0123456789abcdef");
        let pod = job.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
        assert!(pod.init_containers.is_none());
        let model = &pod.volumes.as_ref().unwrap()[0];
        assert_eq!(model.host_path.as_ref().unwrap().path, "/data/glm53");
        assert_eq!(
            model.host_path.as_ref().unwrap().type_.as_deref(),
            Some("Directory")
        );
    }

    #[test]
    fn store_hash_tracks_store_inputs_only() {
        let g = gfd();
        let base = store_hash(&g.spec, "gpu-a");
        assert_eq!(base.len(), 16);
        let mut server_only = g.spec.clone();
        server_only.mode = Mode::Fast;
        server_only.memory.limit = "200Gi".into();
        server_only.server.max_batch_size = 1;
        assert_eq!(store_hash(&server_only, "gpu-a"), base);
        assert_ne!(store_hash(&g.spec, "gpu-b"), base);
        let mut revision = g.spec.clone();
        revision.model.hugging_face.as_mut().unwrap().revision = "other".into();
        assert_ne!(store_hash(&revision, "gpu-a"), base);
        let mut image = g.spec.clone();
        image.image.tag = "0.2.0".into();
        assert_ne!(store_hash(&image, "gpu-a"), base);
    }

    #[test]
    fn reclaim_job_is_unowned_pinned_and_scoped() {
        let g = gfd();
        let job = reclaim_job(&g, "gpu-a");
        assert!(job.metadata.owner_references.is_none());
        let spec = job.spec.as_ref().unwrap();
        assert_eq!(spec.ttl_seconds_after_finished, Some(600));
        let pod = spec.template.spec.as_ref().unwrap();
        assert!(pod.affinity.is_some());
        assert_eq!(pod.security_context.as_ref().unwrap().run_as_user, Some(0));
        assert_eq!(
            pod.containers[0].args.as_ref().unwrap()[0],
            "rm -rf /reclaim/store /reclaim/hf"
        );
        assert_eq!(
            pod.volumes.as_ref().unwrap()[0]
                .host_path
                .as_ref()
                .unwrap()
                .path,
            "/mnt/nvme/glmflash"
        );
    }

    #[test]
    fn dashboard_config_map_is_labelled_for_grafana() {
        let cm = dashboard_config_map(&gfd());
        assert_eq!(
            cm.metadata.labels.as_ref().unwrap()["grafana_dashboard"],
            "1"
        );
        let data = cm.data.as_ref().unwrap();
        let json: serde_json::Value = serde_json::from_str(&data["glmflash-glm.json"]).unwrap();
        assert_eq!(json["uid"], "glmflash-node");
    }
}
