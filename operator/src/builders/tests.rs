//! Every builder, field by field.

use super::*;
use crate::fixtures::gfd;
use glmflash_crds::{Mode, SecretKeyRef};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Container, PodSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

const HASH: &str = "0123456789abcdef";

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
    let d = server_deployment(&g, 0, "gpu-a", HASH, 1);
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
        config_hash_of(&server_deployment(&other, 0, "gpu-a", HASH, 1))
    );
    assert_eq!(
        config_hash_of(&d),
        config_hash_of(&server_deployment(&gfd(), 0, "gpu-a", HASH, 1))
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
    let d = server_deployment(&g, 0, "gpu-a", HASH, 1);
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
         --context-length 131072 --max-batch-size 8 --chunk-size 8192 --cache-dtype f32 \
         --history /history/routing.json \
         --vram-expert-slots 1376 --min-free-vram-mib 23000 \
         --termination-log /dev/termination-log"
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
    // IPC_LOCK reaches the effective set only of a root process (issue 15 item 9).
    let psc = pod_spec(&d).security_context.as_ref().unwrap();
    assert_eq!(
        (psc.run_as_user, psc.run_as_non_root),
        (Some(0), Some(false))
    );
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
    // Both kernel caches in the node's kernel directory.
    let caches: Vec<(&str, Option<&str>)> = c.env.as_ref().unwrap()[1..]
        .iter()
        .map(|e| (e.name.as_str(), e.value.as_deref()))
        .collect();
    assert_eq!(
        caches,
        [
            ("GLMFLASH_KERNEL_CACHE", Some("/kernels/nvrtc")),
            ("CUDA_CACHE_PATH", Some("/kernels/driver")),
        ]
    );
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
            ("history", "/history", Some(false)),
            ("kernels", "/kernels", Some(false)),
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
        "/mnt/nvme/glmflash/stores/ai/glm/0123456789abcdef"
    );
    // The node's kernel cache, shared by every server there and kept by every reclaim.
    assert_eq!(
        volumes[3].host_path.as_ref().unwrap().path,
        "/mnt/nvme/glmflash/kernels"
    );
    let shm = volumes[4].empty_dir.as_ref().unwrap();
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
    let d = server_deployment(&g, 0, "gpu-a", HASH, 0);
    assert_eq!(d.spec.as_ref().unwrap().replicas, Some(0));
    let c = server_container(&d);
    let args = c.args.as_ref().unwrap().join(" ");
    assert!(args.contains("--mode nvme-exact"), "{args}");
    assert!(args.contains("--metrics-port 9400"), "{args}");
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
    let pod = |ip: &str, ready: &str| -> k8s_openapi::api::core::v1::Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p"},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": ready}]}
        }))
        .unwrap()
    };
    assert_eq!(pod_metrics_url(&g, &[pod("10.0.0.7", "False")]), None);
    assert_eq!(
        pod_metrics_url(&g, &[pod("10.0.0.7", "False"), pod("10.0.0.8", "True")]).as_deref(),
        Some("http://10.0.0.8:9400/metrics")
    );
    assert_eq!(
        pod_metrics_url(&g, &[pod("fd00::8", "True")]).as_deref(),
        Some("http://[fd00::8]:9400/metrics")
    );
}

#[test]
fn cpu_switch_drops_the_gpu_request_only() {
    let mut g = gfd();
    g.spec.placement.require_gpu = false;
    let d = server_deployment(&g, 0, "kind-worker", HASH, 1);
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
    let inits = pod.init_containers.as_ref().unwrap();
    let prune = &inits[0];
    assert_eq!(prune.name, "prune");
    assert_eq!(
        prune.args.as_ref().unwrap()[1..],
        ["prune".to_string(), "0123456789abcdef".to_string()]
    );
    assert_eq!(
        prune.volume_mounts.as_ref().unwrap()[0].mount_path,
        "/stores"
    );
    let init = &inits[1];
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
        "/mnt/nvme/glmflash/stores/ai/glm/0123456789abcdef"
    );
    assert_eq!(
        volumes[2].host_path.as_ref().unwrap().path,
        "/mnt/nvme/glmflash/stores/ai/glm"
    );
    let token = volumes[3].secret.as_ref().unwrap();
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
    let inits: Vec<_> = pod
        .init_containers
        .iter()
        .flatten()
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(inits, ["prune"]);
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
fn reclaim_job_is_unowned_pinned_scoped_and_bounded() {
    let g = gfd();
    let job = reclaim_job(&g, 0, "gpu-a", true);
    assert!(job.metadata.owner_references.is_none());
    assert_eq!(
        job.metadata.labels.as_ref().unwrap()["app.kubernetes.io/component"],
        "reclaim"
    );
    let spec = job.spec.as_ref().unwrap();
    assert_eq!(spec.ttl_seconds_after_finished, Some(600));
    assert_eq!(spec.active_deadline_seconds, Some(RECLAIM_DEADLINE_SECONDS));
    let pod = spec.template.spec.as_ref().unwrap();
    assert!(pod.affinity.is_some());
    assert_eq!(pod.security_context.as_ref().unwrap().run_as_user, Some(0));
    let c = &pod.containers[0];
    assert_eq!(c.command.as_deref(), Some(&["rm".to_string()][..]));
    assert_eq!(
        c.args.as_ref().unwrap().join(" "),
        "-rf -- /reclaim/stores/ai/glm /reclaim/history/ai/glm \
         /reclaim/hf/turboderp--GLM-5.3-Flash-exl3/332ab457b709b7ba30dd9a448be5de03b80a7ac9"
    );
    assert_eq!(
        pod.volumes.as_ref().unwrap()[0]
            .host_path
            .as_ref()
            .unwrap()
            .path,
        "/mnt/nvme/glmflash"
    );
    // A download another object reads stays; so does anything a revision could escape to.
    let kept = reclaim_job(&g, 0, "gpu-a", false);
    let args = |j: &k8s_openapi::api::batch::v1::Job| {
        j.spec
            .as_ref()
            .unwrap()
            .template
            .spec
            .as_ref()
            .unwrap()
            .containers[0]
            .args
            .clone()
            .unwrap()
            .join(" ")
    };
    assert_eq!(
        args(&kept),
        "-rf -- /reclaim/stores/ai/glm /reclaim/history/ai/glm"
    );
    let mut escaping = gfd();
    escaping.spec.model.hugging_face.as_mut().unwrap().revision = "../..".into();
    assert_eq!(
        args(&reclaim_job(&escaping, 0, "gpu-a", true)),
        "-rf -- /reclaim/stores/ai/glm /reclaim/history/ai/glm"
    );
}

#[test]
fn each_object_and_each_input_hash_has_its_own_store() {
    let a = gfd();
    let mut b = gfd();
    b.metadata.name = Some("glm-b".into());
    assert_ne!(store_dir(&a, HASH), store_dir(&b, HASH));
    assert_ne!(store_dir(&a, HASH), store_dir(&a, "fedcba9876543210"));
    assert!(store_dir(&a, HASH).starts_with(&stores_dir(&a)));
}

#[test]
fn holds_ignores_added_fields_and_sees_changed_ones() {
    let desired = serde_json::json!({"spec": {"replicas": 1, "template": {"containers": [
        {"name": "server", "resources": {"limits": {"memory": "0.5Gi"}}}]}}});
    let mut existing = desired.clone();
    existing["spec"]["progressDeadlineSeconds"] = serde_json::json!(600);
    existing["status"] = serde_json::json!({"replicas": 1});
    existing["spec"]["template"]["containers"][0]["resources"]["limits"]["memory"] =
        serde_json::json!("512Mi");
    assert!(holds(&existing, &desired));
    let mut scaled = existing.clone();
    scaled["spec"]["replicas"] = serde_json::json!(0);
    assert!(!holds(&scaled, &desired));
    let mut edited = existing.clone();
    edited["spec"]["template"]["containers"][0]["resources"]["limits"]["memory"] =
        serde_json::json!("300Gi");
    assert!(!holds(&edited, &desired));
    let mut more = existing;
    more["spec"]["template"]["containers"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({"name": "sidecar"}));
    assert!(!holds(&more, &desired));
}

#[test]
fn service_monitor_takes_extra_labels_but_keeps_its_own() {
    let mut g = gfd();
    g.spec.metrics.service_monitor_labels = BTreeMap::from([
        ("release".to_string(), "kube-prometheus-stack".to_string()),
        (
            "app.kubernetes.io/instance".to_string(),
            "hijack".to_string(),
        ),
    ]);
    let sm = service_monitor(&g);
    let labels = sm.metadata.labels.as_ref().unwrap();
    assert_eq!(labels["release"], "kube-prometheus-stack");
    assert_eq!(labels["app.kubernetes.io/instance"], "glm");
}

#[test]
fn selector_names_instance_component_and_manager() {
    assert_eq!(
        selector("glm", Component::PackStore),
        "app.kubernetes.io/instance=glm,app.kubernetes.io/component=pack-store,\
         app.kubernetes.io/managed-by=glmflash-operator"
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

#[test]
fn replicas_after_the_first_get_their_own_name_selector_and_reclaim_job() {
    let g = gfd();
    let first = server_deployment(&g, 0, "gpu-a", HASH, 1);
    let second = server_deployment(&g, 1, "gpu-b", HASH, 1);
    assert_eq!(first.metadata.name.as_deref(), Some("glm"));
    assert_eq!(second.metadata.name.as_deref(), Some("glm-r1"));
    let selector = |d: &k8s_openapi::api::apps::v1::Deployment| {
        d.spec
            .as_ref()
            .unwrap()
            .selector
            .match_labels
            .clone()
            .unwrap()
    };
    // Replica 0 keeps the selector of a server made before replicas existed.
    assert_eq!(selector(&first), server_selector("glm"));
    let mut own = server_selector("glm");
    own.insert(REPLICA_LABEL.into(), "1".into());
    assert_eq!(selector(&second), own);
    let labels = second.spec.as_ref().unwrap().template.metadata.clone();
    let labels = labels.unwrap().labels;
    assert_eq!(replica_of(labels.as_ref()), 1);
    // Every replica's pods match the one Service's selector.
    for (k, v) in server_selector("glm") {
        assert_eq!(labels.as_ref().unwrap()[&k], v);
    }
    assert_eq!(
        reclaim_job(&g, 2, "gpu-c", false).metadata.name.as_deref(),
        Some("glm-reclaim-r2")
    );
}

#[test]
fn the_routing_history_lives_on_the_node_outside_the_store() {
    let g = gfd();
    let d = server_deployment(&g, 0, "gpu-a", HASH, 1);
    let history = pod_spec(&d)
        .volumes
        .as_ref()
        .unwrap()
        .iter()
        .find(|v| v.name == "history")
        .unwrap()
        .host_path
        .clone()
        .unwrap();
    assert_eq!(history.path, "/mnt/nvme/glmflash/history/ai/glm");
    assert_eq!(history.type_.as_deref(), Some("DirectoryOrCreate"));
    let mount = server_container(&d)
        .volume_mounts
        .as_ref()
        .unwrap()
        .iter()
        .find(|m| m.name == "history")
        .unwrap()
        .clone();
    assert_eq!(
        (mount.mount_path.as_str(), mount.read_only),
        ("/history", Some(false))
    );
}

#[test]
fn client_ip_affinity_keeps_a_client_on_one_replica() {
    let mut g = gfd();
    let plain = api_service(&g);
    assert_eq!(plain.spec.as_ref().unwrap().session_affinity, None);
    g.spec.server.session_affinity = glmflash_crds::SessionAffinity::ClientIp;
    let sticky = api_service(&g);
    assert_eq!(
        sticky.spec.as_ref().unwrap().session_affinity.as_deref(),
        Some("ClientIP")
    );
    assert_ne!(config_hash_of(&plain), config_hash_of(&sticky));
    // The metrics Service is scraped, not balanced: no affinity there.
    assert_eq!(
        metrics_service(&g).spec.as_ref().unwrap().session_affinity,
        None
    );
}
