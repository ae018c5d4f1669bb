//! Reconciler scenarios against kube's mocked API service: each scenario scripts the
//! exact requests (method, path, query) in order, answers them, and checks the bodies.
//! Later scenarios start from the status an earlier one wrote, so "settled" means what
//! the reconciler itself produced.

use std::time::Duration;

use glmflash_crds::{GlmFlashDeployment, GlmFlashDeploymentStatus, Phase, condition};
use k8s_openapi::api::batch::v1::Job;
use kube::runtime::controller::Action;
use serde_json::{Value, json};

use super::{FINALIZER, RUNNING_REQUEUE, WAITING_REQUEUE, backoff, error_policy};
use crate::builders::{self, names};
use crate::fixtures::*;

const GFD: &str = "/apis/glmflash.io/v1alpha1/namespaces/ai/glmflashdeployments/glm";
const GFD_STATUS: &str = "/apis/glmflash.io/v1alpha1/namespaces/ai/glmflashdeployments/glm/status";
const NODES: &str = "/api/v1/nodes";
const NODE_A: &str = "/api/v1/nodes/gpu-a";
const ALL_PODS: &str = "/api/v1/pods";
const NS_PODS: &str = "/api/v1/namespaces/ai/pods";
const DEPLOYMENT: &str = "/apis/apps/v1/namespaces/ai/deployments/glm";
const API_SVC: &str = "/api/v1/namespaces/ai/services/glm";
const METRICS_SVC: &str = "/api/v1/namespaces/ai/services/glm-metrics";
const DASHBOARD_CM: &str = "/api/v1/namespaces/ai/configmaps/glm-dashboard";
const MONITOR: &str = "/apis/monitoring.coreos.com/v1/namespaces/ai/servicemonitors/glm-metrics";
const EVENTS: &str = "/apis/events.k8s.io/v1/namespaces/ai/events";
const CORE_EVENTS: &str = "/api/v1/namespaces/ai/events";
const ALL_GFDS: &str = "/apis/glmflash.io/v1alpha1/glmflashdeployments";
const JOBS: &str = "/apis/batch/v1/namespaces/ai/jobs";
const PACK_JOBS: &str = "labelSelector=app.kubernetes.io/instance=glm,app.kubernetes.io/component=pack-store,app.kubernetes.io/managed-by=glmflash-operator";
const SERVER_PODS: &str = "labelSelector=app.kubernetes.io/instance=glm,app.kubernetes.io/component=server,app.kubernetes.io/managed-by=glmflash-operator";

fn job_path(name: &str) -> String {
    format!("{JOBS}/{name}")
}

/// The reads of a pack-store Job that runs but has no pod yet: its pods, then its Events.
fn job_trouble_reads(job: &str) -> [Step; 2] {
    [
        Step::get(NS_PODS)
            .query(&format!("labelSelector=batch.kubernetes.io/job-name={job}"))
            .json(list("PodList", vec![])),
        Step::get(CORE_EVENTS)
            .query(&format!(
                "fieldSelector=involvedObject.kind=Job,involvedObject.name={job},reason=FailedCreate"
            ))
            .json(list("EventList", vec![])),
    ]
}

/// The pack-store Jobs of the object, as the list of them.
fn pack_jobs(jobs: Vec<Value>) -> Step {
    Step::get(JOBS).query(PACK_JOBS).json(list("JobList", jobs))
}

/// The server's pods, when it is not available yet.
fn server_pods(pods: Vec<Value>) -> Step {
    Step::get(NS_PODS)
        .query(SERVER_PODS)
        .json(list("PodList", pods))
}

/// The cluster's objects (none but this one by default).
fn all_gfds(objects: Vec<Value>) -> Step {
    Step::get(ALL_GFDS).json(list("GlmFlashDeploymentList", objects))
}

fn deleted() -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Success"})
}

fn server(g: &GlmFlashDeployment, replicas: i32) -> Value {
    to_json(&builders::server_deployment(
        g,
        0,
        "gpu-a",
        &hash(g),
        replicas,
    ))
}

fn hash(gfd: &GlmFlashDeployment) -> String {
    builders::store_hash(&gfd.spec, "gpu-a")
}

fn to_json<T: serde::Serialize>(v: &T) -> Value {
    serde_json::to_value(v).unwrap()
}

fn nodes_a() -> Value {
    list(
        "NodeList",
        vec![
            to_json(&cpu_node("cpu-b")),
            to_json(&gpu_node("gpu-a", "251Gi", "1")),
        ],
    )
}

fn with_status(
    mut gfd: GlmFlashDeployment,
    status: GlmFlashDeploymentStatus,
) -> GlmFlashDeployment {
    gfd.status = Some(status);
    gfd
}

/// (status, reason) of a condition type.
fn cond(status: &GlmFlashDeploymentStatus, type_: &str) -> (String, String, String) {
    let c = status
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .unwrap_or_else(|| panic!("no {type_} condition in {status:?}"));
    assert_eq!(c.observed_generation, status.observed_generation, "{type_}");
    (c.status.clone(), c.reason.clone(), c.message.clone())
}

fn job_with(gfd: &GlmFlashDeployment, status: Value) -> Value {
    let mut job = to_json(&builders::pack_job(gfd, "gpu-a", &hash(gfd)));
    job["status"] = status;
    job
}

fn assert_no_writes(seen: &[Seen]) {
    let writes: Vec<_> = seen.iter().filter(|s| s.is_write()).collect();
    assert!(writes.is_empty(), "settled object wrote: {writes:#?}");
}

#[tokio::test]
async fn fresh_object_first_gets_the_finalizer() {
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let (result, seen) = run(
        ctx,
        handle,
        gfd(),
        vec![Step::patch(GFD).json(to_json(&gfd_with_finalizer()))],
    )
    .await;
    assert_eq!(result.unwrap(), Action::await_change());
    assert!(
        seen[0].body.to_string().contains(FINALIZER),
        "{}",
        seen[0].body
    );
}

/// Fresh object with its finalizer: placed on the only fitting node, pack-store Job applied.
async fn packing() -> GlmFlashDeployment {
    let g = gfd_with_finalizer();
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let job = names::pack_job("glm", &hash(&g));
    let (result, seen) = run(
        ctx,
        handle,
        g.clone(),
        [
            vec![
                Step::get(NODES).json(nodes_a()),
                all_gfds(vec![]),
                Step::get(ALL_PODS)
                    .query("fieldSelector=spec.nodeName=gpu-a")
                    .json(list("PodList", vec![])),
                pack_jobs(vec![]),
                Step::apply(job_path(&job)),
            ],
            job_trouble_reads(&job).to_vec(),
            vec![
                Step::get(DEPLOYMENT).not_found(),
                Step::apply(GFD_STATUS),
                Step::post(EVENTS),
            ],
        ]
        .concat(),
    )
    .await;
    assert_eq!(result.unwrap(), Action::requeue(WAITING_REQUEUE));
    assert_eq!(
        seen[4].body,
        to_json(&builders::pack_job(&g, "gpu-a", &hash(&g)))
    );
    let status = status_written(&seen).unwrap();
    assert_eq!(status.phase, Some(Phase::PackingStore));
    assert_eq!(status.node.as_deref(), Some("gpu-a"));
    assert_eq!(status.observed_generation, Some(1));
    assert_eq!(cond(&status, condition::NODE_SELECTED).0, "True");
    assert_eq!(cond(&status, condition::STORE_READY).1, "Packing");
    assert_eq!(cond(&status, condition::SERVER_READY).1, "WaitingForStore");
    assert_eq!(cond(&status, condition::READY).0, "False");
    assert_eq!(seen[9].body["reason"], "PackingStore");
    assert_eq!(seen[9].body["type"], "Normal");
    assert_eq!(seen[9].body["regarding"]["name"], "glm");
    with_status(g, status)
}

#[tokio::test]
async fn fresh_create_places_and_starts_the_pack_job() {
    packing().await;
}

#[tokio::test]
async fn job_running_settles_without_writes() {
    let g = packing().await;
    let job = names::pack_job("glm", &hash(&g));
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let (result, seen) = run(
        ctx,
        handle,
        g.clone(),
        [
            vec![
                Step::get(NODE_A).json(to_json(&gpu_node("gpu-a", "251Gi", "1"))),
                pack_jobs(vec![job_with(&g, json!({"active": 1}))]),
            ],
            job_trouble_reads(&job).to_vec(),
            vec![Step::get(DEPLOYMENT).not_found()],
        ]
        .concat(),
    )
    .await;
    assert_eq!(result.unwrap(), Action::requeue(WAITING_REQUEUE));
    assert_no_writes(&seen);
}

#[tokio::test]
async fn job_failed_reports_its_reason_and_waits_for_a_change() {
    let g = packing().await;
    let failed = json!({"failed": 3, "conditions": [{
        "type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
        "message": "Job has reached the specified backoff limit"
    }]});
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let steps = vec![
        Step::get(NODE_A).json(to_json(&gpu_node("gpu-a", "251Gi", "1"))),
        pack_jobs(vec![job_with(&g, failed.clone())]),
        Step::get(DEPLOYMENT).not_found(),
    ];
    let mut with_writes = steps.clone();
    with_writes.extend([Step::apply(GFD_STATUS), Step::post(EVENTS)]);
    let (result, seen) = run(ctx, handle, g.clone(), with_writes).await;
    assert_eq!(result.unwrap(), Action::await_change());
    let status = status_written(&seen).unwrap();
    assert_eq!(status.phase, Some(Phase::Failed));
    let (state, reason, message) = cond(&status, condition::STORE_READY);
    assert_eq!(
        (state.as_str(), reason.as_str()),
        ("False", "PackStoreFailed")
    );
    assert!(message.contains("BackoffLimitExceeded"), "{message}");
    assert!(message.contains("after 2 retries"), "{message}");
    assert_eq!(seen[4].body["type"], "Warning");
    assert_eq!(seen[4].body["reason"], "Failed");

    // Reconciled again with that status: nothing more to say, no hot loop of writes.
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let (result, seen) = run(ctx, handle, with_status(g, status), steps).await;
    assert_eq!(result.unwrap(), Action::await_change());
    assert_no_writes(&seen);
}

/// Job complete: store size read from the pod's termination message, server objects applied.
async fn starting() -> GlmFlashDeployment {
    let g = packing().await;
    let job = names::pack_job("glm", &hash(&g));
    let complete = json!({"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]});
    let pod = json!({
        "metadata": {"name": "glm-pack-x", "namespace": NS},
        "status": {"containerStatuses": [{
            "name": "pack-store", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
            "state": {"terminated": {"exitCode": 0, "message": "{\"storeBytes\": 117300000000}"}}
        }]}
    });
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let (result, seen) = run(
        ctx,
        handle,
        g.clone(),
        vec![
            Step::get(NODE_A).json(to_json(&gpu_node("gpu-a", "251Gi", "1"))),
            pack_jobs(vec![job_with(&g, complete)]),
            Step::get(NS_PODS)
                .query(&format!("labelSelector=batch.kubernetes.io/job-name={job}"))
                .json(list("PodList", vec![pod])),
            Step::get(DEPLOYMENT).not_found(),
            Step::apply(DEPLOYMENT),
            Step::get(API_SVC).not_found(),
            Step::apply(API_SVC),
            Step::get(METRICS_SVC).not_found(),
            Step::apply(METRICS_SVC),
            Step::get(DASHBOARD_CM).not_found(),
            server_pods(vec![]),
            Step::apply(GFD_STATUS),
            Step::post(EVENTS),
        ],
    )
    .await;
    assert_eq!(result.unwrap(), Action::requeue(WAITING_REQUEUE));
    assert_eq!(seen[4].body, server(&g, 1));
    assert_eq!(seen[6].body, to_json(&builders::api_service(&g)));
    assert_eq!(seen[8].body, to_json(&builders::metrics_service(&g)));
    let status = status_written(&seen).unwrap();
    assert_eq!(status.phase, Some(Phase::Starting));
    assert_eq!(status.store_hash.as_deref(), Some(hash(&g).as_str()));
    assert_eq!(status.store_bytes, Some(117_300_000_000));
    assert_eq!(
        status.endpoint.as_deref(),
        Some("http://glm.ai.svc:30000/v1")
    );
    assert_eq!(cond(&status, condition::STORE_READY).0, "True");
    assert_eq!(cond(&status, condition::SERVER_READY).1, "Starting");
    assert_eq!(seen[12].body["reason"], "Starting");
    with_status(g, status)
}

#[tokio::test]
async fn job_done_applies_the_server() {
    starting().await;
}

fn available(deployment: Value) -> Value {
    let mut d = deployment;
    d["metadata"]["generation"] = json!(1);
    d["status"] =
        json!({"observedGeneration": 1, "replicas": 1, "availableReplicas": 1, "readyReplicas": 1});
    d
}

/// The steps of a reconcile of a running, unchanged deployment: reads only.
fn settled_reads(g: &GlmFlashDeployment) -> Vec<Step> {
    vec![
        Step::get(NODE_A).json(to_json(&gpu_node("gpu-a", "251Gi", "1"))),
        Step::get(DEPLOYMENT).json(available(server(g, 1))),
        Step::get(API_SVC).json(to_json(&builders::api_service(g))),
        Step::get(METRICS_SVC).json(to_json(&builders::metrics_service(g))),
        Step::get(DASHBOARD_CM).not_found(),
    ]
}

/// [`settled_reads`] of an available server: its pods too, for the one to scrape.
fn running_reads(g: &GlmFlashDeployment) -> Vec<Step> {
    let mut steps = settled_reads(g);
    steps.push(serving_pods());
    steps
}

/// Replica 0's ready pod, whose `/metrics` is read.
fn serving_pods() -> Step {
    server_pods(vec![ready_pod("glm-7d9", None, "10.1.0.5")])
}

/// A ready server pod of replica `replica` (`None`: replica 0, which has no label).
fn ready_pod(name: &str, replica: Option<u32>, ip: &str) -> Value {
    let mut labels =
        json!({"app.kubernetes.io/instance": "glm", "app.kubernetes.io/component": "server"});
    if let Some(r) = replica {
        labels[builders::REPLICA_LABEL] = json!(r.to_string());
    }
    json!({
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}
    })
}

async fn running() -> GlmFlashDeployment {
    let g = starting().await;
    let (ctx, scraper, handle) = context(Ok(SERVER_PAGE), false);
    let mut steps = running_reads(&g);
    steps.extend([Step::apply(GFD_STATUS), Step::post(EVENTS)]);
    let (result, seen) = run(ctx, handle, g.clone(), steps).await;
    assert_eq!(result.unwrap(), Action::requeue(RUNNING_REQUEUE));
    assert_eq!(
        scraper.urls.lock().unwrap().as_slice(),
        ["http://10.1.0.5:30000/metrics"]
    );
    let status = status_written(&seen).unwrap();
    assert_eq!(status.phase, Some(Phase::Running));
    assert_eq!(cond(&status, condition::READY).0, "True");
    assert_eq!(cond(&status, condition::SERVER_READY).0, "True");
    let live = status.live.clone().unwrap();
    assert_eq!(live.decode_tokens_per_second, Some(19.5));
    assert_eq!(live.hit_rate["vram"], 0.7);
    assert_eq!(live.hit_rate["ram"], 0.25);
    assert_eq!(live.hit_rate["nvme"], 0.05);
    assert_eq!(seen[7].body["reason"], "Running");
    with_status(g, status)
}

#[tokio::test]
async fn running_object_settles_with_no_writes() {
    let g = running().await;
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let (result, seen) = run(ctx, handle, g.clone(), running_reads(&g)).await;
    assert_eq!(result.unwrap(), Action::requeue(RUNNING_REQUEUE));
    assert_no_writes(&seen);
}

#[tokio::test]
async fn unreadable_metrics_keep_the_last_figures() {
    let g = running().await;
    let (ctx, _, handle) = context(Err("connection refused"), false);
    let (result, seen) = run(ctx, handle, g.clone(), running_reads(&g)).await;
    assert_eq!(result.unwrap(), Action::requeue(RUNNING_REQUEUE));
    assert_no_writes(&seen);
}

#[tokio::test]
async fn server_only_change_rolls_the_server_not_the_store() {
    let mut g = running().await;
    g.spec.mode = glmflash_crds::Mode::NvmeExact;
    g.metadata.generation = Some(2);
    let old = {
        let mut old = g.clone();
        old.spec.mode = glmflash_crds::Mode::Nvme;
        available(server(&old, 1))
    };
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let (result, seen) = run(
        ctx,
        handle,
        g.clone(),
        vec![
            Step::get(NODE_A).json(to_json(&gpu_node("gpu-a", "251Gi", "1"))),
            Step::get(ALL_PODS)
                .query("fieldSelector=spec.nodeName=gpu-a")
                .json(list("PodList", vec![])),
            all_gfds(vec![to_json(&g)]),
            Step::get(DEPLOYMENT).json(old),
            Step::apply(DEPLOYMENT),
            Step::get(API_SVC).json(to_json(&builders::api_service(&g))),
            Step::get(METRICS_SVC).json(to_json(&builders::metrics_service(&g))),
            Step::get(DASHBOARD_CM).not_found(),
            server_pods(vec![]),
            Step::apply(GFD_STATUS),
            Step::post(EVENTS),
        ],
    )
    .await;
    assert_eq!(result.unwrap(), Action::requeue(WAITING_REQUEUE));
    assert_eq!(seen[4].body, server(&g, 1));
    let args = seen[4].body["spec"]["template"]["spec"]["containers"][0]["args"].to_string();
    assert!(args.contains("\"--mode\",\"nvme-exact\""), "{args}");
    let status = status_written(&seen).unwrap();
    assert_eq!(status.observed_generation, Some(2));
    assert_eq!(status.phase, Some(Phase::Starting));
    assert_eq!(status.store_hash.as_deref(), Some(hash(&g).as_str()));
}

#[tokio::test]
async fn model_change_repacks_and_stops_the_old_server() {
    let mut g = running().await;
    g.spec.model.hugging_face.as_mut().unwrap().revision = "main".into();
    g.metadata.generation = Some(2);
    let new_hash = hash(&g);
    assert_ne!(
        Some(new_hash.as_str()),
        g.status.as_ref().unwrap().store_hash.as_deref()
    );
    let job = names::pack_job("glm", &new_hash);
    let mut before = g.clone();
    before.spec.model.hugging_face.as_mut().unwrap().revision =
        gfd().spec.model.hugging_face.unwrap().revision;
    let old_hash = hash(&before);
    let old_job = names::pack_job("glm", &old_hash);
    let complete = json!({"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]});
    let running_deployment = available(server(&before, 1));
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let (result, seen) = run(
        ctx,
        handle,
        g.clone(),
        [
            vec![
                Step::get(NODE_A).json(to_json(&gpu_node("gpu-a", "251Gi", "1"))),
                Step::get(ALL_PODS)
                    .query("fieldSelector=spec.nodeName=gpu-a")
                    .json(list("PodList", vec![])),
                all_gfds(vec![to_json(&g)]),
                pack_jobs(vec![job_with(&before, complete)]),
                Step::delete(job_path(&old_job)).json(deleted()),
                Step::apply(job_path(&job)),
            ],
            job_trouble_reads(&job).to_vec(),
            vec![
                Step::get(DEPLOYMENT).json(running_deployment),
                Step::apply(DEPLOYMENT),
                Step::apply(GFD_STATUS),
                Step::post(EVENTS),
            ],
        ]
        .concat(),
    )
    .await;
    assert_eq!(result.unwrap(), Action::requeue(WAITING_REQUEUE));
    assert_eq!(
        seen[5].body,
        to_json(&builders::pack_job(&g, "gpu-a", &new_hash))
    );
    assert_eq!(seen[4].body["propagationPolicy"], "Foreground");
    // The old server is stopped: its template still reads the old store.
    assert_eq!(
        seen[9].body,
        to_json(&builders::server_deployment(&g, 0, "gpu-a", &old_hash, 0))
    );
    let status = status_written(&seen).unwrap();
    assert_eq!(status.phase, Some(Phase::PackingStore));
    assert_eq!(status.store_hash, None);
}

#[tokio::test]
async fn service_monitor_applied_when_asked_and_the_api_exists() {
    let mut g = running().await;
    g.spec.metrics.service_monitor = true;
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), true);
    let mut steps = running_reads(&g);
    steps.insert(4, Step::get(MONITOR).not_found());
    steps.insert(5, Step::apply(MONITOR));
    let (result, seen) = run(ctx, handle, g.clone(), steps).await;
    assert_eq!(result.unwrap(), Action::requeue(RUNNING_REQUEUE));
    assert_eq!(seen[5].body, to_json(&builders::service_monitor(&g)));
}

#[tokio::test]
async fn dashboard_config_map_applied_when_asked() {
    let mut g = running().await;
    g.spec.metrics.dashboards = true;
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let mut steps = settled_reads(&g);
    steps.extend([Step::apply(DASHBOARD_CM), serving_pods()]);
    let (result, seen) = run(ctx, handle, g.clone(), steps).await;
    assert_eq!(result.unwrap(), Action::requeue(RUNNING_REQUEUE));
    assert_eq!(seen[5].body, to_json(&builders::dashboard_config_map(&g)));
}

#[tokio::test]
async fn service_monitor_turned_off_is_deleted() {
    let g = running().await;
    let mut existing = to_json(&builders::service_monitor(&g));
    existing["metadata"]["uid"] = json!("sm-uid");
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), true);
    let mut steps = running_reads(&g);
    steps.insert(4, Step::get(MONITOR).json(existing));
    steps.insert(
        5,
        Step::delete(MONITOR)
            .json(json!({"kind": "Status", "apiVersion": "v1", "status": "Success"})),
    );
    let (result, seen) = run(ctx, handle, g, steps).await;
    assert_eq!(result.unwrap(), Action::requeue(RUNNING_REQUEUE));
    assert_eq!(seen.iter().filter(|s| s.is_write()).count(), 1);
}

#[tokio::test]
async fn service_monitor_without_the_api_is_named_in_ready() {
    let mut g = running().await;
    g.spec.metrics.service_monitor = true;
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let mut steps = running_reads(&g);
    // Asked for, so the API is looked for again (the Prometheus operator may be new).
    steps.insert(
        4,
        Step::get("/apis").json(json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": []})),
    );
    steps.push(Step::apply(GFD_STATUS));
    let (_, seen) = run(ctx, handle, g, steps).await;
    let status = status_written(&seen).unwrap();
    assert!(
        cond(&status, condition::READY)
            .2
            .contains("no monitoring.coreos.com/v1")
    );
}

#[tokio::test]
async fn invalid_spec_sets_ready_false_once_and_never_loops() {
    let mut g = gfd_with_finalizer();
    g.spec.memory.limit = "8Gi".into();
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let (result, seen) = run(
        ctx,
        handle,
        g.clone(),
        vec![Step::apply(GFD_STATUS), Step::post(EVENTS)],
    )
    .await;
    assert_eq!(result.unwrap(), Action::await_change());
    let status = status_written(&seen).unwrap();
    assert_eq!(status.phase, Some(Phase::Invalid));
    let (state, reason, message) = cond(&status, condition::READY);
    assert_eq!((state.as_str(), reason.as_str()), ("False", "InvalidSpec"));
    assert!(message.contains("at least 16Gi"), "{message}");
    assert_eq!(seen[1].body["type"], "Warning");

    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let (result, seen) = run(ctx, handle, with_status(g, status), vec![]).await;
    assert_eq!(result.unwrap(), Action::await_change());
    assert!(seen.is_empty());
}

#[tokio::test]
async fn no_fitting_node_names_why_for_each() {
    let g = gfd_with_finalizer();
    let busy = json!({
        "metadata": {"name": "other", "namespace": "team-b"},
        "spec": {"nodeName": "gpu-full", "containers": [{"name": "c",
            "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
        "status": {"phase": "Running"}
    });
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let (result, seen) = run(
        ctx,
        handle,
        g,
        vec![
            Step::get(NODES).json(list(
                "NodeList",
                vec![
                    to_json(&cpu_node("cpu-b")),
                    to_json(&gpu_node("gpu-full", "251Gi", "1")),
                ],
            )),
            all_gfds(vec![]),
            Step::get(ALL_PODS)
                .query("fieldSelector=spec.nodeName=gpu-full")
                .json(list("PodList", vec![busy])),
            Step::apply(GFD_STATUS),
            Step::post(EVENTS),
        ],
    )
    .await;
    assert_eq!(result.unwrap(), Action::requeue(WAITING_REQUEUE));
    let status = status_written(&seen).unwrap();
    assert_eq!(status.phase, Some(Phase::Pending));
    let (state, reason, message) = cond(&status, condition::NODE_SELECTED);
    assert_eq!(
        (state.as_str(), reason.as_str()),
        ("False", "NoFittingNode")
    );
    assert_eq!(
        message,
        "no node fits: cpu-b: label nvidia.com/gpu.product=NVIDIA-GeForce-RTX-3090 missing; \
         gpu-full: 1 of 1 nvidia.com/gpu in use"
    );
}

fn deleting(mut g: GlmFlashDeployment) -> GlmFlashDeployment {
    g.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        "2026-11-30T00:00:00Z".parse().unwrap(),
    ));
    g
}

#[tokio::test]
async fn deletion_with_retain_only_drops_the_finalizer() {
    let g = deleting(running().await);
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let (result, seen) = run(
        ctx,
        handle,
        g.clone(),
        vec![Step::patch(GFD).json(to_json(&g))],
    )
    .await;
    assert_eq!(result.unwrap(), Action::await_change());
    assert!(
        seen[0].body.to_string().contains("remove"),
        "{}",
        seen[0].body
    );
}

/// Issue 15 item 8: Deleting with an Event, the server stopped first, then the reclaim
/// Job (bounded by a deadline) waited for without an error loop.
#[tokio::test]
async fn deletion_with_delete_stops_the_server_then_reclaims_and_waits() {
    let mut g = running().await;
    g.spec.store.reclaim_policy = glmflash_crds::ReclaimPolicy::Delete;
    let g = deleting(g);
    let job = job_path(&names::reclaim_job("glm", 0));

    // 1. The server goes to zero first; status says Deleting, with an Event.
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let (result, seen) = run(
        ctx,
        handle,
        g.clone(),
        vec![
            Step::get(DEPLOYMENT).json(available(server(&g, 1))),
            Step::apply(DEPLOYMENT),
            Step::apply(GFD_STATUS),
            Step::post(EVENTS),
        ],
    )
    .await;
    assert_eq!(result.unwrap(), Action::requeue(WAITING_REQUEUE));
    assert_eq!(seen[1].body, server(&g, 0));
    let status = status_written(&seen).unwrap();
    assert_eq!(status.phase, Some(Phase::Deleting));
    assert_eq!(status.endpoint, None);
    assert_eq!(seen[3].body["reason"], "Deleting");
    let g = with_status(g, status);

    // 2. Once its pod is gone the reclaim Job starts; the download goes too, as no other
    // object on the node reads it.
    let mut stopped = server(&g, 0);
    stopped["status"] = json!({"replicas": 0});
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let (result, seen) = run(
        ctx,
        handle,
        g.clone(),
        vec![
            Step::get(DEPLOYMENT).json(stopped.clone()),
            Step::get(&job).not_found(),
            all_gfds(vec![to_json(&g)]),
            Step::apply(&job),
            Step::apply(GFD_STATUS),
        ],
    )
    .await;
    assert_eq!(result.unwrap(), Action::requeue(WAITING_REQUEUE));
    let reclaim: Job = serde_json::from_value(seen[3].body.clone()).unwrap();
    assert_eq!(reclaim, builders::reclaim_job(&g, 0, "gpu-a", true));
    assert!(reclaim.metadata.owner_references.is_none());
    let status = status_written(&seen).unwrap();
    assert!(cond(&status, condition::READY).2.contains("reclaim Job"));
    let g = with_status(g, status);

    // 3. Complete: the finalizer goes.
    let mut done = to_json(&builders::reclaim_job(&g, 0, "gpu-a", true));
    done["status"] =
        json!({"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]});
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let (result, _) = run(
        ctx,
        handle,
        g.clone(),
        vec![
            Step::get(DEPLOYMENT).json(stopped.clone()),
            Step::get(&job).json(done),
            Step::patch(GFD).json(to_json(&g)),
        ],
    )
    .await;
    assert_eq!(result.unwrap(), Action::await_change());

    // Past its deadline the Job fails: a Warning says what to remove, and deletion ends.
    let mut late = to_json(&builders::reclaim_job(&g, 0, "gpu-a", true));
    late["status"] = json!({"failed": 1, "conditions": [{"type": "Failed", "status": "True",
        "reason": "DeadlineExceeded", "message": "Job was active longer than specified deadline"}]});
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let (result, seen) = run(
        ctx,
        handle,
        g.clone(),
        vec![
            Step::get(DEPLOYMENT).json(stopped),
            Step::get(&job).json(late),
            Step::post(EVENTS),
            Step::patch(GFD).json(to_json(&g)),
        ],
    )
    .await;
    assert_eq!(result.unwrap(), Action::await_change());
    assert_eq!(seen[2].body["type"], "Warning");
    assert_eq!(seen[2].body["reason"], "ReclaimFailed");
    let note = seen[2].body["note"].as_str().unwrap();
    assert!(note.contains("/mnt/nvme/glmflash/stores/ai/glm"), "{note}");
}

#[tokio::test]
async fn deletion_keeps_a_download_another_object_on_the_node_reads() {
    let mut g = running().await;
    g.spec.store.reclaim_policy = glmflash_crds::ReclaimPolicy::Delete;
    let g = deleting(g);
    let mut other = g.clone();
    other.metadata.name = Some("glm-2".into());
    other.metadata.uid = Some("other-uid".into());
    let job = job_path(&names::reclaim_job("glm", 0));
    let mut stopped = server(&g, 0);
    stopped["status"] = json!({"replicas": 0});
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let (_, seen) = run(
        ctx,
        handle,
        g.clone(),
        vec![
            Step::get(DEPLOYMENT).json(stopped),
            Step::get(&job).not_found(),
            all_gfds(vec![to_json(&g), to_json(&other)]),
            Step::apply(&job),
            Step::apply(GFD_STATUS),
            Step::post(EVENTS),
        ],
    )
    .await;
    let reclaim: Job = serde_json::from_value(seen[3].body.clone()).unwrap();
    assert_eq!(reclaim, builders::reclaim_job(&g, 0, "gpu-a", false));
}

#[tokio::test]
async fn api_errors_back_off_exponentially() {
    let g = packing().await;
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let (result, _) = run(
        ctx.clone(),
        handle,
        g.clone(),
        vec![Step::get(NODE_A).reply(Reply::Error(500))],
    )
    .await;
    let error = result.unwrap_err();
    assert_eq!(error.metric_label(), "kube");
    let g = std::sync::Arc::new(g);
    assert_eq!(
        error_policy(g.clone(), &error, ctx.clone()),
        Action::requeue(Duration::from_secs(5))
    );
    assert_eq!(
        error_policy(g.clone(), &error, ctx.clone()),
        Action::requeue(Duration::from_secs(10))
    );
    assert_eq!(ctx.metrics.failures.with_label_values(&["kube"]).get(), 2);
}

#[test]
fn backoff_doubles_and_caps() {
    let delays: Vec<u64> = (1..=9).map(|n| backoff(n).as_secs()).collect();
    assert_eq!(delays, [5, 10, 20, 40, 80, 160, 300, 300, 300]);
}

/// A server whose memory plan refuses the node (it wrote the refusal to its termination
/// message and exited) is stopped, not left restarting: PlanFits, ServerReady and Ready say
/// why with the plan's numbers, a Warning Event is published, the server stays at zero
/// replicas while the spec is the same, and a spec change tries again.
#[tokio::test]
async fn a_server_whose_plan_refuses_the_node_is_stopped_with_the_numbers() {
    let g = starting().await;
    let why = "the GPU cannot hold the model: 26011 MiB needed before any expert slot \
               (weights 3344, caches 19073 at 131072 tokens x 32 sequences, workspace 1566, \
               staging 145, reserve 512) against 23000 MiB";
    let crashed = json!({"metadata": {"name": "glm-abc", "namespace": NS},
        "status": {"containerStatuses": [{"name": "server", "image": "i", "imageID": "",
            "ready": false, "restartCount": 1,
            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": {"exitCode": 1,
                "message": json!({"planRefused": why}).to_string()}}}]}});
    let mut steps = settled_reads(&g);
    steps[1] = Step::get(DEPLOYMENT).json(server(&g, 1));
    steps.extend([
        server_pods(vec![crashed]),
        Step::apply(DEPLOYMENT),
        Step::apply(GFD_STATUS),
        Step::post(EVENTS),
    ]);
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let (result, seen) = run(ctx, handle, g.clone(), steps).await;
    assert_eq!(result.unwrap(), Action::await_change());
    assert_eq!(seen[6].body, server(&g, 0));
    let status = status_written(&seen).unwrap();
    assert_eq!(status.phase, Some(Phase::Failed));
    for type_ in [
        condition::PLAN_FITS,
        condition::SERVER_READY,
        condition::READY,
    ] {
        let (state, reason, message) = cond(&status, type_);
        assert_eq!(
            (state.as_str(), reason.as_str()),
            ("False", "PlanDoesNotFit")
        );
        assert!(message.contains("refuses node gpu-a"), "{message}");
        assert!(message.contains("26011 MiB needed"), "{message}");
    }
    assert_eq!(seen[8].body["type"], "Warning");
    assert!(
        seen[8].body["note"]
            .as_str()
            .is_some_and(|n| n.contains("against 23000 MiB")),
        "{}",
        seen[8].body
    );

    // Same spec: held at zero replicas, nothing written, no pod read.
    let g = with_status(g, status);
    let mut steps = settled_reads(&g);
    steps[1] = Step::get(DEPLOYMENT).json(server(&g, 0));
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let (result, seen) = run(ctx, handle, g.clone(), steps).await;
    assert_eq!(result.unwrap(), Action::await_change());
    assert_no_writes(&seen);

    // A smaller context: the server is started again.
    let mut changed = g.clone();
    changed.spec.server.context_length = 65_536;
    changed.metadata.generation = Some(2);
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let (result, seen) = run(
        ctx,
        handle,
        changed.clone(),
        vec![
            Step::get(NODE_A).json(to_json(&gpu_node("gpu-a", "251Gi", "1"))),
            Step::get(ALL_PODS)
                .query("fieldSelector=spec.nodeName=gpu-a")
                .json(list("PodList", vec![])),
            all_gfds(vec![to_json(&changed)]),
            Step::get(DEPLOYMENT).json(server(&g, 0)),
            Step::apply(DEPLOYMENT),
            Step::get(API_SVC).json(to_json(&builders::api_service(&g))),
            Step::get(METRICS_SVC).json(to_json(&builders::metrics_service(&g))),
            Step::get(DASHBOARD_CM).not_found(),
            server_pods(vec![]),
            Step::apply(GFD_STATUS),
            Step::post(EVENTS),
        ],
    )
    .await;
    assert_eq!(result.unwrap(), Action::requeue(WAITING_REQUEUE));
    assert_eq!(seen[4].body, server(&changed, 1));
    assert_eq!(status_written(&seen).unwrap().phase, Some(Phase::Starting));
}

mod properties {
    use super::*;
    use proptest::prelude::*;

    fn quantity() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("55Gi".to_string()),
            Just("16Gi".to_string()),
            Just("200Gi".to_string()),
            Just("1Gi".to_string()),
            Just("lots".to_string()),
            Just("".to_string()),
            "[0-9]{1,4}(Mi|Gi|G|Ti)?",
        ]
    }

    fn spec() -> impl Strategy<Value = Value> {
        (
            prop_oneof![
                Just(json!({"huggingFace": {"repo": "a/b", "revision": "r"}})),
                Just(json!({"nodePath": "/data/glm"})),
                Just(json!({"nodePath": "relative"})),
                Just(json!({})),
                Just(json!({"huggingFace": {"repo": "bad", "revision": "r"}, "nodePath": "/x"})),
            ],
            prop_oneof![
                Just("fast"),
                Just("exact"),
                Just("nvme"),
                Just("nvme-exact")
            ],
            quantity(),
            quantity(),
            (0u32..20_000, 1u32..300_000, 1u32..300_000, 1i32..70_000),
            prop_oneof![
                Just("/mnt/nvme/glmflash"),
                Just("/"),
                Just("x"),
                Just("/a/")
            ],
            any::<bool>(),
            any::<bool>(),
        )
            .prop_map(
                |(model, mode, limit, shm, (slots, ctx, chunk, port), host, sm, dash)| {
                    json!({
                        "model": model,
                        "mode": mode,
                        "memory": {"limit": limit, "shmSize": shm},
                        "vram": {"expertSlots": slots},
                        "server": {"contextLength": ctx, "prefillChunk": chunk, "port": port},
                        "store": {"hostPath": host},
                        "metrics": {"serviceMonitor": sm, "dashboards": dash},
                    })
                },
            )
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

        /// Whatever the spec, a reconcile succeeds and leaves a Ready condition for this
        /// generation: a bad spec is a condition, never a crash or an error loop.
        #[test]
        fn random_specs_end_in_a_condition(spec in spec(), generation in 1i64..5) {
            let mut value = to_json(&gfd_with_finalizer());
            value["spec"] = spec;
            value["metadata"]["generation"] = json!(generation);
            let g: GlmFlashDeployment = serde_json::from_value(value).unwrap();
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let (result, seen) = runtime.block_on(async {
                let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
                run_auto(ctx, handle, g.clone()).await
            });
            prop_assert!(result.is_ok(), "{:?}", result);
            let status = status_written(&seen).expect("a status is written");
            let ready = status.conditions.iter().find(|c| c.type_ == condition::READY);
            prop_assert!(ready.is_some());
            prop_assert_eq!(ready.unwrap().observed_generation, Some(generation));
            prop_assert_eq!(
                status.phase == Some(Phase::Invalid),
                !g.validate().is_empty()
            );
        }
    }
}

/// Scenarios of issue 15: each failed on the reconciler before its fix.
mod hardening {
    use super::*;

    fn created(mut job: Value, at: &str) -> Value {
        job["metadata"]["creationTimestamp"] = json!(at);
        job
    }

    fn no_pods_on(node: &str) -> Step {
        Step::get(ALL_PODS)
            .query(&format!("fieldSelector=spec.nodeName={node}"))
            .json(list("PodList", vec![]))
    }

    fn server_pod(phase: &str) -> Value {
        json!({
            "metadata": {"name": "glm-abc", "namespace": NS, "labels": {
                "app.kubernetes.io/instance": "glm",
                "app.kubernetes.io/managed-by": "glmflash-operator",
                "app.kubernetes.io/component": "server"}},
            "spec": {"nodeName": "gpu-a", "containers": [{"name": "server"}]},
            "status": {"phase": phase}
        })
    }

    /// Item 10: with `requireGpu: false` the node is not said to have a free GPU.
    #[tokio::test]
    async fn without_a_gpu_request_no_free_gpu_is_claimed() {
        let mut g = gfd_with_finalizer();
        g.spec.placement.require_gpu = false;
        let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
        let (result, seen) = run_auto(ctx, handle, g).await;
        result.unwrap();
        let status = status_written(&seen).unwrap();
        assert_eq!(
            cond(&status, condition::NODE_SELECTED).2,
            "node gpu-a matches and has memory for the cap"
        );
    }

    /// Item 1: q4_k -> q8_0 -> back to q4_k while the q8_0 Job runs. The old, Complete
    /// q4_k Job says nothing about the store (the q8_0 Job pruned it): both Jobs are
    /// stopped, and only then is q4_k packed again.
    #[tokio::test]
    async fn back_to_earlier_inputs_while_a_job_runs_stops_it_before_packing_again() {
        let mut g = running().await;
        let q4 = hash(&g);
        let mut q8 = g.clone();
        q8.spec.model.expert_format = glmflash_crds::ExpertFormat::Q8_0;
        let status = g.status.as_mut().unwrap();
        status.store_hash = None;
        status.phase = Some(Phase::PackingStore);
        status.replicas[0].store_hash = None;
        status.replicas[0].phase = Phase::PackingStore;
        g.metadata.generation = Some(3);
        let complete =
            json!({"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]});
        let q4_job = created(job_with(&g, complete), "2026-12-01T10:00:00Z");
        let q8_job = created(job_with(&q8, json!({"active": 1})), "2026-12-01T11:00:00Z");
        let (q4_name, q8_name) = (
            names::pack_job("glm", &q4),
            names::pack_job("glm", &hash(&q8)),
        );
        let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
        let (result, seen) = run(
            ctx,
            handle,
            g.clone(),
            vec![
                Step::get(NODE_A).json(to_json(&gpu_node("gpu-a", "251Gi", "1"))),
                no_pods_on("gpu-a"),
                all_gfds(vec![to_json(&g)]),
                pack_jobs(vec![q4_job, q8_job]),
                Step::delete(job_path(&q8_name)).json(deleted()),
                Step::delete(job_path(&q4_name)).json(deleted()),
                Step::get(DEPLOYMENT).json(server(&g, 0)),
                Step::apply(GFD_STATUS),
            ],
        )
        .await;
        assert_eq!(result.unwrap(), Action::requeue(WAITING_REQUEUE));
        let status = status_written(&seen).unwrap();
        let (state, reason, message) = cond(&status, condition::STORE_READY);
        assert_eq!(
            (state.as_str(), reason.as_str()),
            ("False", "StoppingOldJob")
        );
        assert!(
            message.contains(&q8_name) && message.contains(&q4_name),
            "{message}"
        );
        assert_eq!(status.store_hash, None);

        // Both gone: q4_k packs again, into its own directory.
        let g = with_status(g, status);
        let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
        let (_, seen) = run(
            ctx,
            handle,
            g.clone(),
            [
                vec![
                    Step::get(NODE_A).json(to_json(&gpu_node("gpu-a", "251Gi", "1"))),
                    pack_jobs(vec![]),
                    Step::apply(job_path(&q4_name)),
                ],
                job_trouble_reads(&q4_name).to_vec(),
                vec![
                    Step::get(DEPLOYMENT).json(server(&g, 0)),
                    Step::apply(GFD_STATUS),
                ],
            ]
            .concat(),
        )
        .await;
        assert_eq!(seen[2].body, to_json(&builders::pack_job(&g, "gpu-a", &q4)));
    }

    /// Item 2: a GPU another object's status holds is taken, though its pod does not
    /// exist yet.
    #[tokio::test]
    async fn a_gpu_held_in_another_objects_status_is_not_free() {
        let g = gfd_with_finalizer();
        let mut other = gfd_with_finalizer();
        other.metadata.name = Some("other".into());
        other.status = Some(GlmFlashDeploymentStatus {
            node: Some("gpu-a".into()),
            ..Default::default()
        });
        let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
        let (result, seen) = run(
            ctx,
            handle,
            g,
            vec![
                Step::get(NODES).json(nodes_a()),
                all_gfds(vec![to_json(&other)]),
                no_pods_on("gpu-a"),
                Step::apply(GFD_STATUS),
                Step::post(EVENTS),
            ],
        )
        .await;
        assert_eq!(result.unwrap(), Action::requeue(WAITING_REQUEUE));
        let status = status_written(&seen).unwrap();
        assert_eq!(status.phase, Some(Phase::Pending));
        assert_eq!(status.node, None);
        let message = cond(&status, condition::NODE_SELECTED).2;
        assert!(
            message.contains("gpu-a: 1 of 1 nvidia.com/gpu in use (held by ai/other)"),
            "{message}"
        );
    }

    /// Item 3: a cap raised past the node's allocatable memory is caught at the spec
    /// change, and stays caught; the running server is not rolled to a pod that cannot
    /// be scheduled.
    #[tokio::test]
    async fn a_cap_raised_past_the_node_is_caught_and_the_server_left_alone() {
        let mut g = running().await;
        g.spec.memory.limit = "300Gi".into();
        g.metadata.generation = Some(2);
        let reads = vec![
            Step::get(NODE_A).json(to_json(&gpu_node("gpu-a", "251Gi", "1"))),
            no_pods_on("gpu-a"),
            all_gfds(vec![to_json(&g)]),
        ];
        let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
        let mut steps = reads.clone();
        steps.extend([Step::apply(GFD_STATUS), Step::post(EVENTS)]);
        let (result, seen) = run(ctx, handle, g.clone(), steps).await;
        assert_eq!(result.unwrap(), Action::requeue(WAITING_REQUEUE));
        let status = status_written(&seen).unwrap();
        let (state, reason, message) = cond(&status, condition::NODE_SELECTED);
        assert_eq!((state.as_str(), reason.as_str()), ("False", "NodeTooSmall"));
        assert!(
            message.contains("memory.limit needs 300.0 GiB"),
            "{message}"
        );
        assert_eq!(status.node.as_deref(), Some("gpu-a"));
        assert_eq!(
            status.endpoint.as_deref(),
            Some("http://glm.ai.svc:30000/v1")
        );
        assert_eq!(seen[4].body["type"], "Warning");

        // The next reconcile checks again and, still too small, writes nothing.
        let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
        let (_, seen) = run(ctx, handle, with_status(g, status), reads).await;
        assert_no_writes(&seen);
    }

    /// Item 4: a negative /dev/shm is refused by the spec's own rule.
    #[tokio::test]
    async fn a_negative_shm_size_is_an_invalid_spec() {
        let mut g = gfd_with_finalizer();
        g.spec.memory.shm_size = "-1Gi".into();
        let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
        let (_, seen) = run(
            ctx,
            handle,
            g,
            vec![Step::apply(GFD_STATUS), Step::post(EVENTS)],
        )
        .await;
        let status = status_written(&seen).unwrap();
        assert_eq!(status.phase, Some(Phase::Invalid));
        assert!(cond(&status, condition::READY).2.contains("memory.shmSize"));
    }

    /// Item 4: an object the API server refuses is a Failed status and a Warning Event,
    /// not an error loop behind a stale PackingStore.
    #[tokio::test]
    async fn a_refused_deployment_is_a_failed_status_with_a_warning() {
        let g = packing().await;
        let job = names::pack_job("glm", &hash(&g));
        let complete =
            json!({"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]});
        let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
        let (result, seen) = run(
            ctx,
            handle,
            g.clone(),
            vec![
                Step::get(NODE_A).json(to_json(&gpu_node("gpu-a", "251Gi", "1"))),
                pack_jobs(vec![job_with(&g, complete)]),
                Step::get(NS_PODS)
                    .query(&format!("labelSelector=batch.kubernetes.io/job-name={job}"))
                    .json(list("PodList", vec![])),
                Step::get(DEPLOYMENT).not_found(),
                Step::apply(DEPLOYMENT).reply(Reply::Error(422)),
                Step::apply(GFD_STATUS),
                Step::post(EVENTS),
            ],
        )
        .await;
        assert_eq!(result.unwrap(), Action::requeue(RUNNING_REQUEUE));
        let status = status_written(&seen).unwrap();
        assert_eq!(status.phase, Some(Phase::Failed));
        assert_eq!(cond(&status, condition::STORE_READY).0, "True");
        let (_, reason, message) = cond(&status, condition::SERVER_READY);
        assert_eq!(reason, "Refused");
        assert!(message.contains("injected failure"), "{message}");
        assert_eq!(seen[6].body["type"], "Warning");
    }

    /// Item 5: a cordon does not take a serving server down.
    #[tokio::test]
    async fn a_cordon_leaves_a_running_server_where_it_is() {
        let g = running().await;
        let mut cordoned = gpu_node("gpu-a", "251Gi", "1");
        cordoned.spec.as_mut().unwrap().unschedulable = Some(true);
        let mut steps = running_reads(&g);
        steps[0] = Step::get(NODE_A).json(to_json(&cordoned));
        steps.insert(
            1,
            Step::get(ALL_PODS)
                .query("fieldSelector=spec.nodeName=gpu-a")
                .json(list("PodList", vec![server_pod("Running")])),
        );
        let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
        let (result, seen) = run(ctx, handle, g, steps).await;
        assert_eq!(result.unwrap(), Action::requeue(RUNNING_REQUEUE));
        assert_no_writes(&seen);
    }

    /// Item 5: moving is a decision: the server was evicted from the cordoned node.
    #[tokio::test]
    async fn an_evicted_server_on_a_cordoned_node_moves() {
        let g = running().await;
        let mut cordoned = gpu_node("gpu-a", "251Gi", "1");
        cordoned.spec.as_mut().unwrap().unschedulable = Some(true);
        let new_hash = builders::store_hash(&g.spec, "gpu-b");
        let job = names::pack_job("glm", &new_hash);
        let complete =
            json!({"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]});
        let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
        let (result, seen) = run(
            ctx,
            handle,
            g.clone(),
            [
                vec![
                    Step::get(NODE_A).json(to_json(&cordoned)),
                    Step::get(ALL_PODS)
                        .query("fieldSelector=spec.nodeName=gpu-a")
                        .json(list("PodList", vec![server_pod("Failed")])),
                    Step::get(NODES).json(list(
                        "NodeList",
                        vec![
                            to_json(&cordoned),
                            to_json(&gpu_node("gpu-b", "251Gi", "1")),
                        ],
                    )),
                    all_gfds(vec![to_json(&g)]),
                    no_pods_on("gpu-b"),
                    // The Job of gpu-a's store stays: that store is retained there.
                    pack_jobs(vec![created(
                        job_with(&g, complete),
                        "2026-12-01T10:00:00Z",
                    )]),
                    Step::apply(job_path(&job)),
                ],
                job_trouble_reads(&job).to_vec(),
                vec![
                    Step::get(DEPLOYMENT).json(available(server(&g, 1))),
                    Step::apply(DEPLOYMENT),
                    Step::apply(GFD_STATUS),
                    Step::post(EVENTS),
                ],
            ]
            .concat(),
        )
        .await;
        assert_eq!(result.unwrap(), Action::requeue(WAITING_REQUEUE));
        let status = status_written(&seen).unwrap();
        assert_eq!(status.node.as_deref(), Some("gpu-b"));
        assert_eq!(status.phase, Some(Phase::PackingStore));
    }

    /// Item 6: `kubectl scale --replicas=0` of the owned Deployment is reverted.
    #[tokio::test]
    async fn a_scaled_down_server_is_scaled_back() {
        let g = running().await;
        let mut scaled = available(server(&g, 1));
        scaled["spec"]["replicas"] = json!(0);
        let mut steps = settled_reads(&g);
        steps[1] = Step::get(DEPLOYMENT).json(scaled);
        steps.insert(2, Step::apply(DEPLOYMENT));
        steps.extend([
            server_pods(vec![]),
            Step::apply(GFD_STATUS),
            Step::post(EVENTS),
        ]);
        let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
        let (_, seen) = run(ctx, handle, g.clone(), steps).await;
        assert_eq!(seen[2].body, server(&g, 1));
    }

    /// Item 7: why the server's pod cannot be created, or cannot start, is in status.
    #[tokio::test]
    async fn why_the_server_pod_does_not_run_is_in_status() {
        let g = starting().await;
        let mut refused = server(&g, 1);
        refused["status"] = json!({"conditions": [{"type": "ReplicaFailure", "status": "True",
            "reason": "FailedCreate",
            "message": "pods \"glm-x\" is forbidden: violates PodSecurity \"restricted:latest\""}]});
        let mut steps = settled_reads(&g);
        steps[1] = Step::get(DEPLOYMENT).json(refused);
        steps.extend([Step::apply(GFD_STATUS), Step::post(EVENTS)]);
        let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
        let (_, seen) = run(ctx, handle, g.clone(), steps).await;
        let status = status_written(&seen).unwrap();
        let (_, reason, message) = cond(&status, condition::SERVER_READY);
        assert_eq!(reason, "PodCreateFailed");
        assert!(message.contains("PodSecurity"), "{message}");
        assert_eq!(seen[6].body["type"], "Warning");
        assert_eq!(seen[6].body["reason"], "PodCreateFailed");

        let no_secret = json!({"metadata": {"name": "glm-abc", "namespace": NS},
            "status": {"containerStatuses": [{"name": "server", "image": "i", "imageID": "",
                "ready": false, "restartCount": 0, "state": {"waiting": {
                "reason": "CreateContainerConfigError", "message": "secret \"keys\" not found"}}}]}});
        let mut steps = settled_reads(&g);
        steps[1] = Step::get(DEPLOYMENT).json(server(&g, 1));
        steps.extend([
            server_pods(vec![no_secret]),
            Step::apply(GFD_STATUS),
            Step::post(EVENTS),
        ]);
        let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
        let (_, seen) = run(ctx, handle, g, steps).await;
        let status = status_written(&seen).unwrap();
        let (_, reason, message) = cond(&status, condition::READY);
        assert_eq!(reason, "ReferenceMissing");
        assert!(message.contains("secret \"keys\" not found"), "{message}");
    }

    /// Item 7: a pack-store Job whose pod Pod Security refused says so.
    #[tokio::test]
    async fn a_refused_pack_store_pod_is_in_status() {
        let g = packing().await;
        let job = names::pack_job("glm", &hash(&g));
        let event = json!({"metadata": {"name": "e", "namespace": NS},
            "involvedObject": {"kind": "Job", "name": job}, "reason": "FailedCreate",
            "message": "Error creating: pods \"x\" is forbidden: violates PodSecurity \"baseline:latest\": hostPath volumes"});
        let [pods, _] = job_trouble_reads(&job);
        let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
        let (_, seen) = run(
            ctx,
            handle,
            g.clone(),
            vec![
                Step::get(NODE_A).json(to_json(&gpu_node("gpu-a", "251Gi", "1"))),
                pack_jobs(vec![job_with(&g, json!({"active": 0}))]),
                pods,
                Step::get(CORE_EVENTS).json(list("EventList", vec![event])),
                Step::get(DEPLOYMENT).not_found(),
                Step::apply(GFD_STATUS),
                Step::post(EVENTS),
            ],
        )
        .await;
        let status = status_written(&seen).unwrap();
        let (_, reason, message) = cond(&status, condition::STORE_READY);
        assert_eq!(reason, "PodCreateFailed");
        assert!(message.contains("hostPath volumes"), "{message}");
        assert_eq!(seen[6].body["type"], "Warning");
    }
}

mod fleet;
mod idle;
