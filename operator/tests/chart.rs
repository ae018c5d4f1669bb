//! The Helm chart, rendered by the real `helm` binary: it lints, every rendered object
//! parses into its k8s-openapi type without dropping a field, RBAC is least-privilege,
//! the CRD and alert rules are the checked-in files, and every metric the dashboard and
//! alerts name exists (the server contract in `glmflash-metric-names`, or the operator's own).
//!
//! helm comes from `e2e/tools/get-helm.sh` (cached under ~/.cache/glmflash/helm), `$HELM`,
//! or PATH. Without it these tests fail, unless GLMFLASH_SKIP_HELM=1 says to skip them.

use std::path::{Path, PathBuf};
use std::process::Command;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use serde::Deserialize;
use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn chart() -> PathBuf {
    root().join("charts/glmflash")
}

fn helm() -> Option<PathBuf> {
    if std::env::var("GLMFLASH_SKIP_HELM").as_deref() == Ok("1") {
        eprintln!("GLMFLASH_SKIP_HELM=1: skipping helm checks");
        return None;
    }
    let cached = std::env::var("HOME")
        .map(|h| PathBuf::from(h).join(".cache/glmflash/helm/bin/helm"))
        .ok();
    let candidates = [
        std::env::var("HELM").ok().map(PathBuf::from),
        cached,
        Some("helm".into()),
    ];
    for candidate in candidates.into_iter().flatten() {
        if Command::new(&candidate)
            .arg("version")
            .output()
            .is_ok_and(|o| o.status.success())
        {
            return Some(candidate);
        }
    }
    panic!("helm not found: run e2e/tools/get-helm.sh (or set GLMFLASH_SKIP_HELM=1 to skip)");
}

fn helm_run(args: &[&str]) -> Option<String> {
    let helm = helm()?;
    let out = Command::new(helm).args(args).output().expect("helm runs");
    assert!(
        out.status.success(),
        "helm {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Some(String::from_utf8(out.stdout).unwrap())
}

/// Renders with every optional object on.
fn render_all() -> Option<Vec<Value>> {
    let chart = chart();
    let text = helm_run(&[
        "template",
        "glmflash",
        chart.to_str().unwrap(),
        "--namespace",
        "glmflash-system",
        "--include-crds",
        "--set",
        "alerts.enabled=true",
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "activator.enabled=true",
        "--set",
        "activator.deployment=glm",
        "--set",
        "activator.namespace=ai",
    ])?;
    let docs = serde_yaml::Deserializer::from_str(&text)
        .map(|d| {
            serde_yaml::from_value::<Value>(serde_yaml::Value::deserialize(d).unwrap()).unwrap()
        })
        .filter(|v| !v.is_null())
        .collect();
    Some(docs)
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

/// The object of `kind` named `name`.
fn named<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    of_kind(docs, kind)
        .into_iter()
        .find(|d| d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

/// Typed round trip: a field the k8s-openapi type does not know would be lost.
fn round_trip<T: serde::de::DeserializeOwned + serde::Serialize>(doc: &Value) {
    let typed: T = serde_json::from_value(doc.clone())
        .unwrap_or_else(|e| panic!("{} does not parse: {e}\n{doc:#}", doc["kind"]));
    let back = serde_json::to_value(&typed).unwrap();
    assert_eq!(&back, doc, "{} lost or changed fields", doc["kind"]);
}

#[test]
fn chart_lints() {
    let chart = chart();
    let Some(out) = helm_run(&["lint", "--strict", chart.to_str().unwrap()]) else {
        return;
    };
    assert!(out.contains("0 chart(s) failed"), "{out}");
}

#[test]
fn every_rendered_object_parses_into_its_type() {
    let Some(docs) = render_all() else { return };
    let mut kinds: Vec<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    kinds.sort();
    assert_eq!(
        kinds,
        [
            "ClusterRole",
            "ClusterRoleBinding",
            "ConfigMap",
            "CustomResourceDefinition",
            "Deployment",
            "Deployment",
            "PrometheusRule",
            "Role",
            "Role",
            "RoleBinding",
            "RoleBinding",
            "Service",
            "Service",
            "ServiceAccount",
            "ServiceAccount",
            "ServiceMonitor",
        ]
    );
    for doc in &docs {
        match doc["kind"].as_str().unwrap() {
            "ClusterRole" => round_trip::<ClusterRole>(doc),
            "ClusterRoleBinding" => round_trip::<ClusterRoleBinding>(doc),
            "ConfigMap" => round_trip::<ConfigMap>(doc),
            "CustomResourceDefinition" => round_trip::<CustomResourceDefinition>(doc),
            "Deployment" => round_trip::<Deployment>(doc),
            "Role" => round_trip::<Role>(doc),
            "RoleBinding" => round_trip::<RoleBinding>(doc),
            "Service" => round_trip::<Service>(doc),
            "ServiceAccount" => round_trip::<ServiceAccount>(doc),
            // Prometheus operator kinds: no k8s-openapi type; checked below.
            "PrometheusRule" | "ServiceMonitor" => {}
            other => panic!("unexpected kind {other}"),
        }
    }
}

#[test]
fn crd_in_chart_is_the_generated_one() {
    let Some(docs) = render_all() else { return };
    let crd = of_kind(&docs, "CustomResourceDefinition")[0];
    let generated: Value = serde_yaml::from_str(&glmflash_crds::crd_yaml()).unwrap();
    assert_eq!(crd, &generated);
}

#[test]
fn rbac_is_exact_and_nodes_are_read_only() {
    let Some(docs) = render_all() else { return };
    let role: ClusterRole =
        serde_json::from_value(of_kind(&docs, "ClusterRole")[0].clone()).unwrap();
    let mut rules: Vec<(String, String, Vec<String>)> = role
        .rules
        .unwrap()
        .into_iter()
        .flat_map(|r| {
            let groups = r.api_groups.unwrap_or_default();
            let verbs = r.verbs.clone();
            r.resources
                .unwrap_or_default()
                .into_iter()
                .flat_map(move |res| {
                    let verbs = verbs.clone();
                    groups
                        .clone()
                        .into_iter()
                        .map(move |g| (g, res.clone(), verbs.clone()))
                })
        })
        .collect();
    rules.sort();
    let v = |verbs: &[&str]| verbs.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let expected = vec![
        (
            "".into(),
            "configmaps".into(),
            v(&["get", "create", "patch", "delete"]),
        ),
        ("".into(), "events".into(), v(&["list"])),
        ("".into(), "nodes".into(), v(&["get", "list", "watch"])),
        ("".into(), "pods".into(), v(&["list"])),
        (
            "".into(),
            "services".into(),
            v(&["get", "list", "watch", "create", "patch"]),
        ),
        (
            "apps".into(),
            "deployments".into(),
            // delete: a scale-down removes the last replicas' Deployments.
            v(&["get", "list", "watch", "create", "patch", "delete"]),
        ),
        (
            "batch".into(),
            "jobs".into(),
            v(&["get", "list", "watch", "create", "patch", "delete"]),
        ),
        (
            "events.k8s.io".into(),
            "events".into(),
            v(&["create", "patch"]),
        ),
        (
            "glmflash.io".into(),
            "glmflashdeployments".into(),
            v(&["get", "list", "watch", "patch"]),
        ),
        (
            "glmflash.io".into(),
            "glmflashdeployments/finalizers".into(),
            v(&["update"]),
        ),
        (
            "glmflash.io".into(),
            "glmflashdeployments/status".into(),
            v(&["get", "patch"]),
        ),
        (
            "monitoring.coreos.com".into(),
            "servicemonitors".into(),
            v(&["get", "create", "patch", "delete"]),
        ),
    ];
    assert_eq!(rules, expected);
    let lease: Role =
        serde_json::from_value(named(&docs, "Role", "glmflash-operator-leader").clone()).unwrap();
    let lease_rule = &lease.rules.unwrap()[0];
    assert_eq!(
        lease_rule.resources.as_deref(),
        Some(&["leases".to_string()][..])
    );
    assert_eq!(lease_rule.verbs, v(&["get", "create", "patch"]));
}

#[test]
fn operator_deployment_wires_probes_identity_and_hardening() {
    let Some(docs) = render_all() else { return };
    let d: Deployment =
        serde_json::from_value(named(&docs, "Deployment", "glmflash-operator").clone()).unwrap();
    let spec = d.spec.unwrap();
    assert_eq!(spec.replicas, Some(2));
    let pod = spec.template.spec.unwrap();
    assert_eq!(
        pod.service_account_name.as_deref(),
        Some("glmflash-operator")
    );
    let c = &pod.containers[0];
    let env: Vec<&str> = c
        .env
        .as_ref()
        .unwrap()
        .iter()
        .map(|e| e.name.as_str())
        .collect();
    for name in [
        "POD_NAME",
        "POD_NAMESPACE",
        "GLMFLASH_LEASE_NAME",
        "GLMFLASH_HTTP_ADDR",
        "RUST_LOG",
    ] {
        assert!(env.contains(&name), "{name} missing from {env:?}");
    }
    let path = |p: &Option<k8s_openapi::api::core::v1::Probe>| {
        p.as_ref()
            .unwrap()
            .http_get
            .as_ref()
            .unwrap()
            .path
            .clone()
            .unwrap()
    };
    assert_eq!(path(&c.liveness_probe), "/healthz");
    assert_eq!(path(&c.readiness_probe), "/readyz");
    let sc = c.security_context.as_ref().unwrap();
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(pod.security_context.unwrap().run_as_non_root, Some(true));
}

#[test]
fn activator_runs_the_operator_image_with_least_privilege_in_the_target_namespace() {
    let Some(docs) = render_all() else { return };
    let d: Deployment =
        serde_json::from_value(named(&docs, "Deployment", "glmflash-activator").clone()).unwrap();
    let spec = d.spec.unwrap();
    let selector = spec.selector.match_labels.unwrap();
    assert_eq!(selector["app.kubernetes.io/name"], "glmflash-activator");
    let pod = spec.template.spec.unwrap();
    assert_eq!(
        pod.service_account_name.as_deref(),
        Some("glmflash-activator")
    );
    let c = &pod.containers[0];
    assert_eq!(c.args.as_deref(), Some(&["activator".to_string()][..]));
    let env: Vec<(&str, &str)> = c
        .env
        .as_ref()
        .unwrap()
        .iter()
        .filter_map(|e| Some((e.name.as_str(), e.value.as_deref()?)))
        .collect();
    for pair in [
        ("GLMFLASH_ACTIVATOR_DEPLOYMENT", "glm"),
        ("GLMFLASH_ACTIVATOR_NAMESPACE", "ai"),
        ("GLMFLASH_ACTIVATOR_LISTEN", "0.0.0.0:8080"),
        ("GLMFLASH_ACTIVATOR_WAKE_TIMEOUT", "300s"),
        ("GLMFLASH_ACTIVATOR_MAX_BODY", "16777216"),
    ] {
        assert!(env.contains(&pair), "{pair:?} missing from {env:?}");
    }
    let sc = c.security_context.as_ref().unwrap();
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    // The operator's Deployment must not select the activator's pods.
    let operator: Deployment =
        serde_json::from_value(named(&docs, "Deployment", "glmflash-operator").clone()).unwrap();
    let operator_selector = operator.spec.unwrap().selector.match_labels.unwrap();
    let labels = spec.template.metadata.unwrap().labels.unwrap();
    assert!(
        operator_selector
            .iter()
            .any(|(k, v)| labels.get(k) != Some(v))
    );

    let role: Role =
        serde_json::from_value(named(&docs, "Role", "glmflash-activator").clone()).unwrap();
    assert_eq!(role.metadata.namespace.as_deref(), Some("ai"));
    let rules: Vec<(Vec<String>, Vec<String>, Vec<String>)> = role
        .rules
        .unwrap()
        .into_iter()
        .map(|r| {
            (
                r.api_groups.unwrap_or_default(),
                r.resources.unwrap_or_default(),
                r.verbs,
            )
        })
        .collect();
    let v = |items: &[&str]| items.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(
        rules,
        [
            (
                v(&["glmflash.io"]),
                v(&["glmflashdeployments"]),
                v(&["get", "list", "watch", "patch"])
            ),
            (v(&[""]), v(&["pods"]), v(&["list", "watch"])),
        ]
    );
    let binding: RoleBinding =
        serde_json::from_value(named(&docs, "RoleBinding", "glmflash-activator").clone()).unwrap();
    let subject = &binding.subjects.unwrap()[0];
    assert_eq!(subject.name, "glmflash-activator");
    assert_eq!(subject.namespace.as_deref(), Some("glmflash-system"));
    let service: Service =
        serde_json::from_value(named(&docs, "Service", "glmflash-activator").clone()).unwrap();
    assert_eq!(
        service.spec.unwrap().selector.unwrap()["app.kubernetes.io/name"],
        "glmflash-activator"
    );
}

fn alert_rules_file() -> Value {
    let text = std::fs::read_to_string(chart().join("files/alerts.rules.yaml")).unwrap();
    serde_yaml::from_str(&text).unwrap()
}

#[test]
fn prometheus_rule_carries_the_tested_rules_file() {
    let Some(docs) = render_all() else { return };
    let rule = of_kind(&docs, "PrometheusRule")[0];
    assert_eq!(rule["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(rule["spec"], alert_rules_file());
    let names: Vec<&str> = rule["spec"]["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap())
        .map(|r| r["alert"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "GlmFlashDecodeBelowSpeedGate",
            "GlmFlashStoreReadErrors",
            "GlmFlashServerNotReady",
            "GlmFlashPinningFailed",
            "GlmFlashOperatorReconcileErrors",
        ]
    );
    let monitor = of_kind(&docs, "ServiceMonitor")[0];
    assert_eq!(monitor["spec"]["endpoints"][0]["path"], "/metrics");
}

/// `glmflash_*` identifiers in a PromQL expression.
fn metric_names_in(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(start) = rest.find("glmflash_") {
        let tail = &rest[start..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        names.push(tail[..end].to_string());
        rest = &tail[end..];
    }
    names
}

fn dashboard_exprs(dashboard: &Value) -> Vec<String> {
    let mut exprs = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            exprs.push(target["expr"].as_str().unwrap().to_string());
        }
    }
    for var in dashboard["templating"]["list"].as_array().unwrap() {
        if let Some(q) = var["query"].as_str().filter(|q| q.contains("glmflash_")) {
            exprs.push(q.to_string());
        }
    }
    exprs
}

#[test]
fn dashboard_and_alerts_name_only_existing_metrics() {
    let operator_metrics: Vec<String> = glmflash_operator::metrics::Metrics::default()
        .registry
        .gather()
        .iter()
        .map(|f| f.name().to_string())
        .collect();
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(chart().join("dashboards/glmflash.json")).unwrap(),
    )
    .unwrap();
    let mut exprs = dashboard_exprs(&dashboard);
    assert!(exprs.len() >= 20, "{}", exprs.len());
    for group in alert_rules_file()["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            exprs.push(rule["expr"].as_str().unwrap().to_string());
        }
    }
    for expr in &exprs {
        let names = metric_names_in(expr);
        assert!(!names.is_empty(), "{expr} names no glmflash metric");
        for name in names {
            assert!(
                glmflash_metric_names::is_known_series(&name) || operator_metrics.contains(&name),
                "{name} (in {expr}) is neither in glmflash-metric-names nor an operator metric"
            );
        }
    }
    // The panels the issue asks for are there.
    let titles: Vec<&str> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["title"].as_str().unwrap())
        .collect();
    for wanted in [
        "Expert hit rate by tier",
        "Bytes moved per token by path",
        "Resident vs capacity per tier",
        "Decode tokens per second",
        "Time to first token",
        "Inter-token latency",
        "Running and waiting requests",
        "Memory by kind",
    ] {
        assert!(titles.contains(&wanted), "{wanted} panel missing");
    }
}

#[test]
fn dashboard_config_map_carries_the_dashboard_file() {
    let Some(docs) = render_all() else { return };
    let cm = of_kind(&docs, "ConfigMap")[0];
    assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
    let file = std::fs::read_to_string(chart().join("dashboards/glmflash.json")).unwrap();
    assert_eq!(
        cm["data"]["glmflash.json"].as_str().unwrap().trim_end(),
        file.trim_end()
    );
}

#[test]
fn default_values_need_no_prometheus_operator() {
    let chart = chart();
    let Some(text) = helm_run(&["template", "glmflash", chart.to_str().unwrap()]) else {
        return;
    };
    assert!(!text.contains("kind: PrometheusRule"), "{text}");
    assert!(!text.contains("kind: ServiceMonitor"), "{text}");
    assert!(
        !text.contains("glmflash-activator"),
        "the activator is opt-in"
    );
    assert!(text.contains("kind: Deployment"));
    assert!(text.contains("grafana_dashboard: \"1\""));
}
