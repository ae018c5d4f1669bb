//! The containers the operator renders run `glmflash-node`: their args (and env, mapped to
//! the flag that reads each variable) must parse with the node's own clap definition, and
//! the parsed values must be the spec's. A renamed or removed node flag fails here.

use clap::{CommandFactory, Parser, ValueEnum};
use glmflash_crds::GlmFlashDeployment;
use glmflash_node::cli::{Cli, Command};
use glmflash_operator::builders::{pack_job, server_deployment};
use k8s_openapi::api::core::v1::{Container, PodSpec};
use serde_json::json;
use std::path::Path;

/// What a secretKeyRef resolves to in the pod (the kubelet fills it in).
const FROM_SECRET: &str = "value-from-secret";

fn example() -> GlmFlashDeployment {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../charts/glmflash/examples/glmflash-deployment.yaml");
    let mut g: GlmFlashDeployment =
        serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    g.metadata.uid = Some("uid-1".into());
    g
}

/// Environment the CUDA driver reads, not the node: passed through as they are.
const DRIVER_ENV: [&str; 1] = ["CUDA_CACHE_PATH"];

/// `argv` for the container: its args, then one `--flag value` per env var (but the driver's).
fn argv(c: &Container) -> Vec<String> {
    assert!(
        c.command.is_none(),
        "{}: the image's entrypoint runs",
        c.name
    );
    let args = c.args.clone().unwrap();
    let cli = Cli::command();
    let sub = cli
        .find_subcommand(&args[0])
        .unwrap_or_else(|| panic!("glmflash-node has no subcommand {:?}", args[0]));
    let mut argv = vec!["glmflash-node".to_string()];
    argv.extend(args.iter().cloned());
    for e in c.env.iter().flatten() {
        if DRIVER_ENV.contains(&e.name.as_str()) {
            continue;
        }
        let arg = sub
            .get_arguments()
            .chain(cli.get_arguments())
            .find(|a| a.get_env().is_some_and(|v| v == e.name.as_str()))
            .unwrap_or_else(|| {
                panic!(
                    "env {} is read by no flag of `glmflash-node {}`",
                    e.name, args[0]
                )
            });
        let value = match (&e.value, &e.value_from) {
            (Some(v), None) => v.clone(),
            (None, Some(from)) if from.secret_key_ref.is_some() => FROM_SECRET.into(),
            other => panic!("env {}: unexpected source {other:?}", e.name),
        };
        argv.push(format!("--{}", arg.get_long().unwrap()));
        argv.push(value);
    }
    argv
}

fn parse(c: &Container) -> Command {
    let argv = argv(c);
    match Cli::try_parse_from(&argv) {
        Ok(cli) => cli.command,
        Err(e) => panic!("glmflash-node rejects {argv:?}:\n{e}"),
    }
}

/// Every path flag points into a volume the container mounts (read-only where asked).
fn assert_mounted(c: &Container, path: &Path, writable: bool) {
    let m = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| path.starts_with(&m.mount_path))
        .unwrap_or_else(|| panic!("{}: {} is on no volume mount", c.name, path.display()));
    if writable {
        assert_ne!(
            m.read_only,
            Some(true),
            "{}: {} is read-only",
            c.name,
            path.display()
        );
    }
}

fn pod(job: &k8s_openapi::api::batch::v1::Job) -> PodSpec {
    job.spec.clone().unwrap().template.spec.unwrap()
}

#[test]
fn pack_job_containers_parse_with_the_node_cli() {
    let mut g = example();
    g.spec.model.hugging_face.as_mut().unwrap().token_secret =
        Some(serde_json::from_value(json!({"name": "hf", "key": "token"})).unwrap());
    let pod = pod(&pack_job(&g, "gpu-a", "0123456789abcdef"));

    let download = pod
        .init_containers
        .iter()
        .flatten()
        .find(|c| c.name == "download")
        .expect("a download init container");
    let Command::Download(d) = parse(download) else {
        panic!("the init container does not run download");
    };
    let hf = g.spec.model.hugging_face.as_ref().unwrap();
    assert_eq!(d.repo, hf.repo);
    assert_eq!(d.revision, hf.revision);
    assert_mounted(download, &d.dir, true);
    let token_file = d.token_file.expect("a token Secret gives --token-file");
    assert_mounted(download, &token_file, false);
    // The Secret's key lands at the file the flag names.
    let secret = pod
        .volumes
        .iter()
        .flatten()
        .find_map(|v| v.secret.clone())
        .unwrap();
    let item = &secret.items.unwrap()[0];
    assert_eq!(item.key, "token");
    assert_eq!(token_file.file_name().unwrap(), item.path.as_str());

    let pack = &pod.containers[0];
    let Command::PackStore {
        model,
        store,
        report,
        no_verify,
        format,
        ..
    } = parse(pack)
    else {
        panic!("the Job's container does not run pack-store");
    };
    assert_eq!(model, d.dir, "pack-store reads what download wrote");
    assert_mounted(pack, &model, false);
    assert_mounted(pack, &store, true);
    assert!(!no_verify);
    // The CRD's default expert format is the node's q4_k.
    assert_eq!(
        format.map(|f| f.name()),
        g.spec.model.expert_format.as_arg()
    );
    assert_eq!(format.map(|f| f.name()), Some("q4_k"));
    // The report is the termination message the controller reads storeBytes from.
    assert_eq!(
        report.as_deref(),
        Some(Path::new(
            pack.termination_message_path
                .as_deref()
                .unwrap_or("/dev/termination-log")
        ))
    );
}

#[test]
fn node_path_model_needs_no_download() {
    let mut g = example();
    g.spec.model.hugging_face = None;
    g.spec.model.node_path = Some("/mnt/models/glm".into());
    let pod = pod(&pack_job(&g, "gpu-a", "0123456789abcdef"));
    assert!(
        !pod.init_containers
            .iter()
            .flatten()
            .any(|c| c.name == "download")
    );
    let Command::PackStore { model, .. } = parse(&pod.containers[0]) else {
        panic!("not pack-store");
    };
    assert_mounted(&pod.containers[0], &model, false);
}

/// Every `model.expertFormat` reaches pack-store as a `--format` the node accepts (or none
/// for `checkpoint`), `exl3` included.
#[test]
fn every_expert_format_parses_with_the_node_cli() {
    for name in ["q4_k", "q8_0", "bf16", "exl3", "checkpoint"] {
        let mut g = example();
        g.spec.model.expert_format = serde_json::from_value(json!(name)).unwrap();
        let pod = pod(&pack_job(&g, "gpu-a", "0123456789abcdef"));
        let Command::PackStore { format, .. } = parse(&pod.containers[0]) else {
            panic!("not pack-store");
        };
        assert_eq!(
            format.map(|f| f.name()),
            (name != "checkpoint").then_some(name)
        );
    }
}

#[test]
fn server_container_parses_with_the_node_cli_in_every_mode() {
    for (mode, slots, metrics_port, api_key, cache_dtype) in [
        ("nvme", Some(1376), None, true, "f32"),
        ("nvme-exact", None, Some(9400), false, "bf16"),
        ("fast", None, None, false, "f16"),
        ("exact", Some(0), Some(9400), true, "bf16"),
    ] {
        let mut g = example();
        let mut spec = serde_json::to_value(&g.spec).unwrap();
        spec["mode"] = json!(mode);
        spec["vram"]["expertSlots"] = json!(slots);
        spec["metrics"]["port"] = json!(metrics_port);
        spec["server"]["cacheDtype"] = json!(cache_dtype);
        if api_key {
            spec["server"]["apiKeySecret"] = json!({"name": "keys", "key": "key"});
        }
        g.spec = serde_json::from_value(spec).unwrap();

        let d = server_deployment(&g, 0, "gpu-a", "0123456789abcdef", 1);
        let c = &d.spec.unwrap().template.spec.unwrap().containers[0];
        let Command::Serve { model, serve } = parse(c) else {
            panic!("the server container does not run serve");
        };
        let what = format!("mode {mode}");
        assert_mounted(c, &model.model, false);
        assert_mounted(c, model.store.as_ref().unwrap(), false);
        // The server writes its routing history at exit onto the node, for the next start.
        assert_mounted(c, model.tier.history.as_ref().unwrap(), true);
        assert_eq!(
            model
                .tier
                .mode
                .unwrap()
                .to_possible_value()
                .unwrap()
                .get_name(),
            mode,
            "{what}"
        );
        assert_eq!(
            model.tier.vram_expert_slots,
            slots.map(|s| s as usize),
            "{what}"
        );
        assert_eq!(model.tier.vram_slots, None, "{what}");
        assert_eq!(
            model.tier.min_free_vram_mib,
            u64::from(g.spec.vram.min_free_mib),
            "{what}"
        );
        let s = &g.spec.server;
        assert_eq!(i32::from(serve.port), s.port, "{what}");
        assert_eq!(serve.served_model_name, s.served_model_name, "{what}");
        assert_eq!(
            serve.context_length as u64, s.context_length as u64,
            "{what}"
        );
        assert_eq!(
            serve.max_batch_size as u64, s.max_batch_size as u64,
            "{what}"
        );
        assert_eq!(serve.chunk_size as u64, s.prefill_chunk as u64, "{what}");
        assert_eq!(s.cache_dtype.as_arg(), cache_dtype, "{what}");
        assert_eq!(
            model.cache_dtype.to_possible_value().unwrap().get_name(),
            cache_dtype,
            "{what}"
        );
        assert_eq!(serve.metrics_port.map(i32::from), metrics_port, "{what}");
        let keys: Vec<String> = if api_key {
            vec![FROM_SECRET.into()]
        } else {
            vec![]
        };
        assert_eq!(serve.api_key, keys, "{what}");
        // The probes and Services name ports the server listens on.
        let ports: Vec<i32> = c.ports.iter().flatten().map(|p| p.container_port).collect();
        assert!(ports.contains(&i32::from(serve.port)), "{what}");
        if let Some(p) = serve.metrics_port {
            assert!(ports.contains(&i32::from(p)), "{what}");
        }
    }
}

#[test]
fn the_parse_check_catches_a_flag_the_node_lacks() {
    let g = example();
    let d = server_deployment(&g, 0, "gpu-a", "0123456789abcdef", 1);
    let mut c = d.spec.unwrap().template.spec.unwrap().containers[0].clone();
    c.args.as_mut().unwrap().push("--min-free-vram-mib".into());
    c.args.as_mut().unwrap().push("23000".into());
    assert!(Cli::try_parse_from(argv(&c)).is_err());
}
