//! Monitoring of the server: the Prometheus operator's ServiceMonitor and the Grafana
//! dashboard ConfigMap.

use std::collections::BTreeMap;

use glmflash_crds::GlmFlashDeployment;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{ApiResource, DynamicObject};

use super::{Component, NameOrEmpty, labels, meta, names, with_config_hash};

/// The Grafana dashboard the chart ships, reused for per-object dashboard ConfigMaps.
pub const DASHBOARD_JSON: &str = include_str!("../../../charts/glmflash/dashboards/glmflash.json");

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

/// A ServiceMonitor scraping the metrics Service, with `metrics.serviceMonitorLabels`
/// beside the operator's own labels (which win on a clash: the operator selects by them).
pub fn service_monitor(gfd: &GlmFlashDeployment) -> DynamicObject {
    let name = gfd.name_any_or_empty();
    let mut obj = DynamicObject::new(&names::metrics(&name), &service_monitor_resource());
    obj.metadata = meta(gfd, names::metrics(&name), Component::Metrics, true);
    let mut all = gfd.spec.metrics.service_monitor_labels.clone();
    all.extend(obj.metadata.labels.take().unwrap_or_default());
    obj.metadata.labels = Some(all);
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
