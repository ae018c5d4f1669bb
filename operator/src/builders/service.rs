//! The Services in front of the server: the OpenAI API and `/metrics`.

use glmflash_crds::GlmFlashDeployment;
use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::{Component, NameOrEmpty, meta, names, server_selector, with_config_hash};

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
