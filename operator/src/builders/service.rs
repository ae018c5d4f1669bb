//! The Services in front of the server: the OpenAI API and `/metrics`.

use glmflash_crds::{GlmFlashDeployment, SessionAffinity};
use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::{Component, NameOrEmpty, meta, names, server_selector, with_config_hash};

/// The OpenAI API Service, over the ready pods of every replica.
pub fn api_service(gfd: &GlmFlashDeployment) -> Service {
    let name = gfd.name_any_or_empty();
    let mut api = service(
        gfd,
        names::server(&name),
        Component::Server,
        "http",
        gfd.spec.server.port,
        "http",
    );
    // Only when asked: the field's absence keeps the hash of Services built before it.
    let affinity = gfd.spec.server.session_affinity;
    if affinity != SessionAffinity::None {
        api.metadata.annotations = None;
        if let Some(spec) = api.spec.as_mut() {
            spec.session_affinity = Some(affinity.as_str().into());
        }
        api = with_config_hash(api);
    }
    api
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
