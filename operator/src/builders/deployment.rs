//! The server: glmflash-node `serve` and its Deployment.

use std::collections::BTreeMap;

use glmflash_crds::{GPU_RESOURCE, GlmFlashDeployment, GlmFlashDeploymentSpec};
use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec, DeploymentStrategy};
use k8s_openapi::api::core::v1::{
    Container, ContainerPort, EmptyDirVolumeSource, EnvVar, EnvVarSource, HTTPGetAction, PodSpec,
    PodTemplateSpec, Probe, ResourceRequirements, SecretKeySelector, Volume,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::pod::{
    DRIVER_CACHE, HISTORY_FILE, HISTORY_MOUNT, KERNELS_MOUNT, MODEL_MOUNT, NVRTC_CACHE,
    STORE_MOUNT, TERMINATION_LOG, host_path_volume, mount, node_affinity, non_empty,
    pinning_server, quantity, security_context,
};
use super::{
    Component, NameOrEmpty, REPLICA_LABEL, history_dir, kernels_dir, labels, meta, model_dir,
    names, server_selector, store_dir, with_config_hash,
};

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
        "--cache-dtype".into(),
        spec.server.cache_dtype.as_arg().into(),
        "--history".into(),
        format!("{HISTORY_MOUNT}/{HISTORY_FILE}"),
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
    // A refusal of the memory plan becomes the termination message the operator reads.
    args.extend(["--termination-log".into(), TERMINATION_LOG.into()]);
    args
}

/// The server Deployment of replica `index` on `node`, reading the store of `store_hash`:
/// one pod (zero while the store is being rebuilt, while hibernated or while the object is
/// deleted), `Recreate` so two servers never share the GPU. Each replica is its own
/// Deployment because each is pinned to its own node and store.
pub fn server_deployment(
    gfd: &GlmFlashDeployment,
    index: u32,
    node: &str,
    store_hash: &str,
    replicas: i32,
) -> Deployment {
    let spec = &gfd.spec;
    let name = gfd.name_any_or_empty();
    let mut selector = server_selector(&name);
    if index > 0 {
        selector.insert(REPLICA_LABEL.into(), index.to_string());
    }

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

    let mut env: Vec<EnvVar> = spec
        .server
        .api_key_secret
        .iter()
        .map(|secret| EnvVar {
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
        })
        .collect();
    // The node's kernel cache: a pod that wakes or restarts skips compiling the kernels.
    for (name, value) in [
        ("GLMFLASH_KERNEL_CACHE", NVRTC_CACHE),
        ("CUDA_CACHE_PATH", DRIVER_CACHE),
    ] {
        env.push(EnvVar {
            name: name.into(),
            value: Some(value.into()),
            ..EnvVar::default()
        });
    }

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
        env: Some(env),
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
            mount("history", HISTORY_MOUNT, false),
            mount("kernels", KERNELS_MOUNT, false),
            mount("dshm", "/dev/shm", false),
        ]),
        // Loading 125 GB of weights and warming the tiers takes minutes: allow 30 of them.
        startup_probe: Some(probe("/health", 10, 180)),
        readiness_probe: Some(probe("/ready", 10, 3)),
        liveness_probe: Some(probe("/health", 20, 3)),
        ..Container::default()
    };

    with_config_hash(Deployment {
        metadata: meta(gfd, names::replica(&name, index), Component::Server, true),
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
                    security_context: Some(pinning_server()),
                    containers: vec![container],
                    // Long enough to drain in-flight requests, save the routing history
                    // and unpin the RAM tier.
                    termination_grace_period_seconds: Some(60),
                    volumes: Some(vec![
                        host_path_volume("model", model_dir(spec), "Directory"),
                        host_path_volume("store", store_dir(gfd, store_hash), "Directory"),
                        host_path_volume("history", history_dir(gfd), "DirectoryOrCreate"),
                        host_path_volume("kernels", kernels_dir(spec), "DirectoryOrCreate"),
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
