//! The generated CRD: checked-in copies match, its shape is what kubectl users see, and
//! its CEL rules accept the example and reject each cross-field mistake (evaluated by
//! kube's client-side CEL, the same rules the API server runs).

use std::path::Path;

use glmflash_crds::{GlmFlashDeployment, Mode, SpecError, crd_yaml};
use kube::CustomResourceExt;
use serde_json::{Value, json};

fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

#[test]
fn checked_in_crd_matches_generated() {
    let generated = crd_yaml();
    for file in [glmflash_crds::CRD_FILE, glmflash_crds::CHART_CRD_FILE] {
        let on_disk =
            std::fs::read_to_string(root().join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert!(
            on_disk == generated,
            "{file} is stale: run `cargo run -p glmflash-crds --bin crdgen -- --write`"
        );
    }
}

#[test]
fn crd_names_scope_columns_and_subresources() {
    let crd = serde_json::to_value(GlmFlashDeployment::crd()).unwrap();
    let spec = &crd["spec"];
    assert_eq!(crd["metadata"]["name"], "glmflashdeployments.glmflash.io");
    assert_eq!(spec["group"], "glmflash.io");
    assert_eq!(spec["scope"], "Namespaced");
    assert_eq!(spec["names"]["kind"], "GlmFlashDeployment");
    assert_eq!(spec["names"]["shortNames"], json!(["gfd"]));
    let version = &spec["versions"][0];
    assert_eq!(version["name"], "v1alpha1");
    assert_eq!(version["subresources"]["status"], json!({}));
    let columns: Vec<(&str, &str)> = version["additionalPrinterColumns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["name"].as_str().unwrap(), c["jsonPath"].as_str().unwrap()))
        .collect();
    assert_eq!(
        columns,
        [
            ("Phase", ".status.phase"),
            ("Ready", ".status.ready"),
            ("Node", ".status.node"),
            ("Mode", ".spec.mode"),
            ("VRAM experts", ".status.live.plan.vramExpertSlots"),
            ("Tok/s", ".status.live.decodeTokensPerSecond"),
            ("Age", ".metadata.creationTimestamp"),
        ]
    );
    let schema = &version["schema"]["openAPIV3Schema"]["properties"]["spec"];
    let rules = serde_json::to_string(schema).unwrap();
    assert!(rules.contains("x-kubernetes-validations"));
    assert_eq!(
        schema["properties"]["server"]["properties"]["port"]["default"],
        json!(30000)
    );
    assert_eq!(
        schema["properties"]["mode"]["enum"],
        json!(["fast", "exact", "nvme", "nvme-exact"])
    );
}

fn example() -> Value {
    let text =
        std::fs::read_to_string(root().join("charts/glmflash/examples/glmflash-deployment.yaml"))
            .unwrap();
    serde_yaml::from_str(&text).unwrap()
}

/// Every field of `part` is in `whole` with the same value.
fn assert_contains(whole: &Value, part: &Value, path: &str) {
    match part {
        Value::Object(fields) => {
            for (key, value) in fields {
                assert_contains(&whole[key], value, &format!("{path}.{key}"));
            }
        }
        _ => assert_eq!(whole, part, "{path}"),
    }
}

fn parse(value: Value) -> GlmFlashDeployment {
    serde_json::from_value(value).expect("object parses")
}

fn errors_of(value: Value) -> Vec<String> {
    parse(value)
        .validate()
        .iter()
        .map(ToString::to_string)
        .collect()
}

#[test]
fn example_round_trips_without_unknown_fields_and_is_valid() {
    let value = example();
    let gfd = parse(value.clone());
    // Serializing back must reproduce every field given (defaults may be added): a
    // misspelled key would be dropped.
    let back = serde_json::to_value(&gfd).unwrap();
    assert_contains(&back["spec"], &value["spec"], "spec");
    assert_eq!(gfd.validate(), Vec::<SpecError>::new());
    assert_eq!(gfd.spec.mode, Mode::Nvme);
}

#[test]
fn minimal_object_gets_the_seed_defaults() {
    let gfd = parse(json!({
        "apiVersion": "glmflash.io/v1alpha1", "kind": "GlmFlashDeployment",
        "metadata": {"name": "g", "namespace": "n"},
        "spec": {"model": {"nodePath": "/data/glm"}, "memory": {"limit": "16Gi"}}
    }));
    let s = &gfd.spec;
    assert_eq!(s.server.port, 30000);
    assert_eq!(s.server.served_model_name, "glm-5.3-flash");
    assert_eq!(s.server.context_length, 131_072);
    assert_eq!(s.server.max_batch_size, 8);
    assert_eq!(s.server.prefill_chunk, 8192);
    assert_eq!(s.vram.min_free_mib, 23_000);
    assert_eq!(s.placement.gpu_product, "NVIDIA-GeForce-RTX-3090");
    assert_eq!(s.memory.shm_size, "1Gi");
    assert_eq!(s.mode, Mode::Nvme);
    assert_eq!(s.replicas, 1);
    assert!(!s.hibernate && !gfd.hibernating());
    assert!(gfd.validate().is_empty(), "{:?}", gfd.validate());
}

#[test]
fn the_annotation_hibernates_like_the_spec_field() {
    let mut value = example();
    value["metadata"]["annotations"] = json!({"glmflash.io/hibernate": "true"});
    assert!(parse(value.clone()).hibernating());
    value["metadata"]["annotations"] = json!({"glmflash.io/hibernate": "false"});
    assert!(!parse(value.clone()).hibernating());
    value["spec"]["hibernate"] = json!(true);
    assert!(parse(value).hibernating());
}

/// Each mistake, applied to the valid example, and a fragment of the message it must give.
#[test]
fn each_cel_rule_rejects_its_mistake() {
    type Mistake = (&'static str, fn(&mut Value), &'static str);
    let cases: Vec<Mistake> = vec![
        (
            "both sources",
            |v| v["spec"]["model"]["nodePath"] = json!("/data/glm"),
            "exactly one of huggingFace or nodePath",
        ),
        (
            "no source",
            |v| {
                v["spec"]["model"]
                    .as_object_mut()
                    .unwrap()
                    .remove("huggingFace");
            },
            "exactly one of huggingFace or nodePath",
        ),
        (
            "relative node path",
            |v| {
                v["spec"]["model"] = json!({"nodePath": "data/glm"});
            },
            "model.nodePath must be an absolute path",
        ),
        (
            "bad repo",
            |v| v["spec"]["model"]["huggingFace"]["repo"] = json!("no-slash"),
            "owner/name",
        ),
        (
            "fast mode on 55Gi",
            |v| v["spec"]["mode"] = json!("fast"),
            "at least 128Gi",
        ),
        (
            "two replicas pinned to one node",
            |v| {
                v["spec"]["replicas"] = json!(2);
                v["spec"]["placement"] = json!({"nodeName": "gpu-a"});
            },
            "every replica needs its own",
        ),
        (
            "exact mode on 55Gi",
            |v| v["spec"]["mode"] = json!("exact"),
            "at least 128Gi",
        ),
        (
            "cap under 16Gi",
            |v| v["spec"]["memory"]["limit"] = json!("8Gi"),
            "at least 16Gi",
        ),
        (
            "cap not a quantity",
            |v| v["spec"]["memory"]["limit"] = json!("lots"),
            "memory.limit must be a quantity",
        ),
        (
            "shm not below cap",
            |v| v["spec"]["memory"]["shmSize"] = json!("55Gi"),
            "shmSize must be smaller",
        ),
        (
            "negative shm",
            |v| v["spec"]["memory"]["shmSize"] = json!("-1Gi"),
            "memory.shmSize must be a quantity of at least 1Mi",
        ),
        (
            "zero shm",
            |v| v["spec"]["memory"]["shmSize"] = json!("0"),
            "memory.shmSize must be a quantity of at least 1Mi",
        ),
        (
            "chunk over context",
            |v| v["spec"]["server"]["prefillChunk"] = json!(262144),
            "prefillChunk must not exceed",
        ),
        (
            "relative store",
            |v| v["spec"]["store"]["hostPath"] = json!("nvme"),
            "store.hostPath must be an absolute path",
        ),
        (
            "idle under a minute",
            |v| v["spec"]["idleAfter"] = json!("30s"),
            "idleAfter must be a duration such as 90s, 30m or 1h30m, of at least 1m",
        ),
        (
            "idle not a duration",
            |v| v["spec"]["idleAfter"] = json!("ten minutes"),
            "idleAfter must be a duration",
        ),
        (
            "idle units out of order",
            |v| v["spec"]["idleAfter"] = json!("30m1h"),
            "idleAfter must be a duration",
        ),
        (
            "root store",
            |v| v["spec"]["store"]["hostPath"] = json!("/"),
            "store.hostPath must be an absolute path",
        ),
    ];
    for (name, mutate, expected) in cases {
        let mut value = example();
        mutate(&mut value);
        let errors = errors_of(value);
        assert!(
            errors.iter().any(|e| e.contains(expected)),
            "{name}: expected {expected:?} in {errors:?}"
        );
    }
}

#[test]
fn fast_mode_with_a_large_cap_is_valid() {
    let mut value = example();
    value["spec"]["mode"] = json!("fast");
    value["spec"]["memory"]["limit"] = json!("200Gi");
    assert_eq!(errors_of(value), Vec::<String>::new());
}

#[test]
fn checks_cel_cannot_express() {
    let mut value = example();
    value["spec"]["vram"]["expertSlots"] = json!(20000);
    value["spec"]["placement"]["nodeName"] = json!("");
    let errors = errors_of(value);
    assert!(
        errors
            .iter()
            .any(|e| e.contains("vram.expertSlots: 20000 exceeds the model's 12096")),
        "{errors:?}"
    );
    assert!(
        errors.iter().any(|e| e.contains("placement.nodeName")),
        "{errors:?}"
    );
}

/// A negative cap or shm size is named by its own rule alone, not first as "shmSize must
/// be smaller than limit" (issue 15).
#[test]
fn a_negative_quantity_gets_one_message_naming_its_field() {
    let mut value = example();
    value["spec"]["memory"]["limit"] = json!("-16Gi");
    assert_eq!(
        errors_of(value),
        ["spec.memory.limit: memory.limit must be a quantity of at least 16Gi"]
    );
    let mut value = example();
    value["spec"]["memory"]["shmSize"] = json!("-1Gi");
    assert_eq!(
        errors_of(value),
        ["spec.memory.shmSize: memory.shmSize must be a quantity of at least 1Mi, such as 1Gi"]
    );
}

#[test]
fn crd_has_no_formats_the_api_server_warns_about() {
    let yaml = glmflash_crds::crd_yaml();
    assert!(
        !yaml.contains("format: uint"),
        "unsigned formats left in the CRD"
    );
}

#[test]
fn idle_after_is_a_duration_of_at_least_a_minute() {
    use std::time::Duration;
    for (text, seconds) in [("1m", 60), ("90s", 90), ("1h30m", 5400), ("2h0m5s", 7205)] {
        let mut value = example();
        value["spec"]["idleAfter"] = json!(text);
        let gfd = parse(value.clone());
        assert_eq!(gfd.validate(), Vec::<SpecError>::new(), "{text}");
        assert_eq!(
            gfd.idle_after(),
            Some(Duration::from_secs(seconds)),
            "{text}"
        );
    }
    assert_eq!(parse(example()).idle_after(), None);
    for bad in ["", "5", "m", "1x", "1m1h", "1s1s", "-1m", "1.5h"] {
        assert_eq!(glmflash_crds::parse_duration(bad), None, "{bad:?}");
    }
}
