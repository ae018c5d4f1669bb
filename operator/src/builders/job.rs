//! The Jobs that write and remove the store on the node: pack-store (with the Hub
//! download before it) and reclaim.

use glmflash_crds::GlmFlashDeployment;
use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{Container, PodSpec, PodTemplateSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::pod::{
    MODEL_MOUNT, STORE_MOUNT, TERMINATION_LOG, host_path_volume, host_path_writer, mount,
    node_affinity, non_empty, secret_volume, security_context,
};
use super::{
    Component, NameOrEmpty, STORE_HASH_LABEL, history_dir, labels, meta, model_dir, names,
    store_dir, stores_dir, with_config_hash,
};

const TOKEN_MOUNT: &str = "/secrets/hf";
const STORES_MOUNT: &str = "/stores";
/// How long a reclaim Job may run before it counts as failed and deletion goes on.
pub const RECLAIM_DEADLINE_SECONDS: i64 = 600;

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
        host_path_volume("store", store_dir(gfd, store_hash), "DirectoryOrCreate"),
        host_path_volume("stores", stores_dir(gfd), "DirectoryOrCreate"),
    ];
    // Stores of this object's earlier inputs go first: disk holds one store per object,
    // and only this object's own directory is touched.
    let prune = Container {
        name: "prune".into(),
        image: Some(image.clone()),
        image_pull_policy: Some(pull.clone()),
        command: Some(vec!["/bin/sh".into(), "-c".into()]),
        args: Some(vec![
            r#"for d in /stores/*; do [ "$d" = "/stores/$1" ] || rm -rf -- "$d"; done"#.into(),
            "prune".into(),
            store_hash.into(),
        ]),
        volume_mounts: Some(vec![mount("stores", STORES_MOUNT, false)]),
        security_context: Some(security_context(false)),
        ..Container::default()
    };
    let mut init_containers = vec![prune];
    init_containers.extend(hf.map(|hf| {
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
        Container {
            name: "download".into(),
            image: Some(image.clone()),
            image_pull_policy: Some(pull.clone()),
            args: Some(args),
            volume_mounts: Some(mounts),
            security_context: Some(security_context(false)),
            ..Container::default()
        }
    }));

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
                    init_containers: Some(init_containers),
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

/// The Job that deletes this object's stores and routing history on `node` (reclaim
/// policy `Delete`; `index` is the replica that was there), and its Hub download when
/// `with_download` (no other object on the node reads it). It is not owned by the
/// deployment, so garbage collection cannot kill it half way; it has a deadline, and
/// removes itself after it finishes.
pub fn reclaim_job(gfd: &GlmFlashDeployment, index: u32, node: &str, with_download: bool) -> Job {
    let spec = &gfd.spec;
    let root = spec.store.host_path.trim_end_matches('/');
    // Only what the operator wrote: a nodePath model may live beside it. Paths are relative
    // to the host path mounted at /reclaim, and handed to rm as arguments, not to a shell.
    let mut paths = vec![stores_dir(gfd), history_dir(gfd)];
    let download_is_ours = spec
        .model
        .hugging_face
        .as_ref()
        .is_some_and(|hf| !hf.revision.split('/').any(|c| c == ".." || c == "."));
    if with_download && download_is_ours {
        paths.push(model_dir(spec));
    }
    let mut args = vec!["-rf".to_string(), "--".into()];
    args.extend(
        paths
            .iter()
            .filter_map(|p| p.strip_prefix(root))
            .map(|rel| format!("/reclaim{rel}")),
    );
    with_config_hash(Job {
        metadata: meta(
            gfd,
            names::reclaim_job(&gfd.name_any_or_empty(), index),
            Component::Reclaim,
            false,
        ),
        spec: Some(JobSpec {
            backoff_limit: Some(2),
            active_deadline_seconds: Some(RECLAIM_DEADLINE_SECONDS),
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
                        command: Some(vec!["rm".into()]),
                        args: Some(args),
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
