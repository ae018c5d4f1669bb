//! The watches behind [`Backends`]: the one GlmFlashDeployment (by name) and its server
//! pods (by the operator's labels), each kept in a reflector store; every event recomputes
//! the value requests read. Pods rather than EndpointSlices, because a pod carries its
//! replica index (the rendezvous key) and a namespaced Role can grant them.

use futures::{StreamExt, stream};
use glmflash_crds::GlmFlashDeployment;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Api, Client};
use tokio::sync::watch as channel;
use tracing::warn;

use super::Backends;
use crate::builders::{self, Component};

/// Which watch an event came from; for the object, whether its first list is complete.
enum Seen {
    Object { listed: bool },
    Pods,
}

/// Feeds `tx` until both watches end (they retry with backoff, so in practice never).
pub(super) async fn backends(
    client: Client,
    namespace: String,
    name: String,
    tx: channel::Sender<Backends>,
) -> anyhow::Result<()> {
    let gfds: Api<GlmFlashDeployment> = Api::namespaced(client.clone(), &namespace);
    let pods: Api<Pod> = Api::namespaced(client, &namespace);
    let (gfd_store, gfd_writer) = reflector::store();
    let (pod_store, pod_writer) = reflector::store();
    let by_name = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let servers = watcher::Config::default().labels(&builders::selector(&name, Component::Server));
    let objects = reflector(gfd_writer, watcher(gfds, by_name))
        .default_backoff()
        .map(|event| {
            event.map(|e| Seen::Object {
                listed: matches!(e, watcher::Event::InitDone),
            })
        });
    let server_pods = reflector(pod_writer, watcher(pods, servers))
        .default_backoff()
        .map(|event| event.map(|_| Seen::Pods));
    let mut events = std::pin::pin!(stream::select(objects, server_pods));
    let mut listed = false;
    while let Some(event) = events.next().await {
        match event {
            Ok(Seen::Object { listed: done }) => listed |= done,
            Ok(Seen::Pods) => {}
            Err(e) => {
                warn!(error = %e, "watch failed; retrying");
                continue;
            }
        }
        let gfd = gfd_store.state().into_iter().next();
        let pods = pod_store.state();
        let pods: Vec<&Pod> = pods.iter().map(AsRef::as_ref).collect();
        let next = Backends::of(gfd.as_deref(), listed, &pods);
        tx.send_if_modified(|current| {
            let changed = *current != next;
            *current = next;
            changed
        });
    }
    anyhow::bail!("the watches of {namespace}/{name} ended")
}
