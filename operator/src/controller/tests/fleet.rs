//! Issue 18: a fleet of replicas, each on its own node — scale up, scale down, a node lost,
//! hibernate and wake — each scenario starting from the status the one before it wrote.

use super::*;
use glmflash_crds::HIBERNATE_ANNOTATION;

const NODE_B: &str = "/api/v1/nodes/gpu-b";
const DEPLOYMENT_R1: &str = "/apis/apps/v1/namespaces/ai/deployments/glm-r1";

fn hash_on(g: &GlmFlashDeployment, node: &str) -> String {
    builders::store_hash(&g.spec, node)
}

fn replica_server(g: &GlmFlashDeployment, node: &str, replicas: i32) -> Value {
    to_json(&builders::server_deployment(
        g,
        1,
        node,
        &hash_on(g, node),
        replicas,
    ))
}

fn pods_on(node: &str) -> Step {
    Step::get(ALL_PODS)
        .query(&format!("fieldSelector=spec.nodeName={node}"))
        .json(list("PodList", vec![]))
}

fn complete_job(g: &GlmFlashDeployment, node: &str) -> Value {
    let mut job = to_json(&builders::pack_job(g, node, &hash_on(g, node)));
    job["status"] = json!({"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]});
    job
}

fn both_pods() -> Step {
    server_pods(vec![
        ready_pod("glm-7d9", None, "10.1.0.5"),
        ready_pod("glm-r1-4c2", Some(1), "10.1.0.6"),
    ])
}

fn front_reads(g: &GlmFlashDeployment) -> Vec<Step> {
    vec![
        Step::get(API_SVC).json(to_json(&builders::api_service(g))),
        Step::get(METRICS_SVC).json(to_json(&builders::metrics_service(g))),
        Step::get(DASHBOARD_CM).not_found(),
    ]
}

fn three_nodes(last: &str) -> Value {
    list(
        "NodeList",
        vec![
            to_json(&cpu_node("cpu-b")),
            to_json(&gpu_node("gpu-a", "251Gi", "1")),
            to_json(&gpu_node(last, "251Gi", "1")),
        ],
    )
}

fn replica(status: &GlmFlashDeploymentStatus, index: u32) -> &glmflash_crds::ReplicaStatus {
    status
        .replicas
        .iter()
        .find(|r| r.index == index)
        .unwrap_or_else(|| panic!("no replica {index} in {status:?}"))
}

/// Scale 1 -> 2: replica 0 stays on gpu-a; replica 1 skips gpu-a (anti-affinity by node)
/// and the GPU-less node, lands on gpu-b and packs its own store there.
async fn scaled_up() -> GlmFlashDeployment {
    let mut g = running().await;
    g.spec.replicas = 2;
    g.metadata.generation = Some(2);
    let job_b = names::pack_job("glm", &hash_on(&g, "gpu-b"));
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let steps = [
        vec![
            // Replica 0: the spec changed, so its node's room is checked again.
            Step::get(NODE_A).json(to_json(&gpu_node("gpu-a", "251Gi", "1"))),
            pods_on("gpu-a"),
            all_gfds(vec![to_json(&g)]),
            Step::get(DEPLOYMENT).json(available(server(&g, 1))),
            // Replica 1.
            Step::get(NODES).json(three_nodes("gpu-b")),
            all_gfds(vec![to_json(&g)]),
            pods_on("gpu-b"),
            pack_jobs(vec![complete_job(&g, "gpu-a")]),
            Step::apply(job_path(&job_b)),
        ],
        job_trouble_reads(&job_b).to_vec(),
        vec![Step::get(DEPLOYMENT_R1).not_found()],
        front_reads(&g),
        vec![serving_pods(), Step::apply(GFD_STATUS)],
    ]
    .concat();
    let (result, seen) = run(ctx, handle, g.clone(), steps).await;
    assert_eq!(result.unwrap(), Action::requeue(WAITING_REQUEUE));
    assert_eq!(
        seen[8].body,
        to_json(&builders::pack_job(&g, "gpu-b", &hash_on(&g, "gpu-b")))
    );
    let status = status_written(&seen).unwrap();
    assert_eq!(status.phase, Some(Phase::Running), "replica 0 still serves");
    assert_eq!(status.ready.as_deref(), Some("1/2"));
    assert_eq!(status.node.as_deref(), Some("gpu-a"));
    let (ready, reason, message) = cond(&status, condition::READY);
    assert_eq!((ready.as_str(), reason.as_str()), ("False", "Packing"));
    assert!(
        message.starts_with("1 of 2 replicas serving; replica 1: pack-store Job"),
        "{message}"
    );
    assert_eq!(replica(&status, 0).phase, Phase::Running);
    assert_eq!(replica(&status, 1).node, "gpu-b");
    assert_eq!(replica(&status, 1).phase, Phase::PackingStore);
    with_status(g, status)
}

#[tokio::test]
async fn scaling_up_places_the_new_replica_on_another_node() {
    scaled_up().await;
}

/// Replica 1's store is built: its Deployment on gpu-b, then both serve, each scraped at
/// its own pod.
async fn both_serving() -> GlmFlashDeployment {
    let g = scaled_up().await;
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let job_b = names::pack_job("glm", &hash_on(&g, "gpu-b"));
    let steps = [
        vec![
            Step::get(NODE_A).json(to_json(&gpu_node("gpu-a", "251Gi", "1"))),
            Step::get(DEPLOYMENT).json(available(server(&g, 1))),
            Step::get(NODE_B).json(to_json(&gpu_node("gpu-b", "251Gi", "1"))),
            pack_jobs(vec![complete_job(&g, "gpu-a"), complete_job(&g, "gpu-b")]),
            Step::get(NS_PODS)
                .query(&format!(
                    "labelSelector=batch.kubernetes.io/job-name={job_b}"
                ))
                .json(list("PodList", vec![])),
            Step::get(DEPLOYMENT_R1).not_found(),
            Step::apply(DEPLOYMENT_R1),
        ],
        front_reads(&g),
        // Replica 1's Deployment has no status yet: its pods say why it does not run.
        vec![serving_pods(), both_pods(), Step::apply(GFD_STATUS)],
    ]
    .concat();
    let (result, seen) = run(ctx, handle, g.clone(), steps).await;
    assert_eq!(result.unwrap(), Action::requeue(WAITING_REQUEUE));
    assert_eq!(seen[6].body, replica_server(&g, "gpu-b", 1));
    let status = status_written(&seen).unwrap();
    assert_eq!(status.ready.as_deref(), Some("1/2"));
    assert_eq!(replica(&status, 1).phase, Phase::Starting);
    let g = with_status(g, status);

    let (ctx, scraper, handle) = context(Ok(SERVER_PAGE), false);
    let steps = [
        vec![
            Step::get(NODE_A).json(to_json(&gpu_node("gpu-a", "251Gi", "1"))),
            Step::get(DEPLOYMENT).json(available(server(&g, 1))),
            Step::get(NODE_B).json(to_json(&gpu_node("gpu-b", "251Gi", "1"))),
            Step::get(DEPLOYMENT_R1).json(available(replica_server(&g, "gpu-b", 1))),
        ],
        front_reads(&g),
        vec![serving_pods(), both_pods(), Step::apply(GFD_STATUS)],
    ]
    .concat();
    let (result, seen) = run(ctx, handle, g.clone(), steps).await;
    assert_eq!(result.unwrap(), Action::requeue(RUNNING_REQUEUE));
    assert_eq!(
        scraper.urls.lock().unwrap().as_slice(),
        [
            "http://10.1.0.5:30000/metrics",
            "http://10.1.0.6:30000/metrics"
        ]
    );
    let status = status_written(&seen).unwrap();
    assert_eq!(status.phase, Some(Phase::Running));
    assert_eq!(status.ready.as_deref(), Some("2/2"));
    let (ready, _, message) = cond(&status, condition::READY);
    assert_eq!(ready, "True");
    assert!(message.starts_with("2 of 2 replicas serving http://glm.ai.svc:30000/v1"));
    assert_eq!(cond(&status, condition::NODE_SELECTED).0, "True");
    for index in [0, 1] {
        let live = replica(&status, index).live.clone().unwrap();
        assert_eq!(live.decode_tokens_per_second, Some(19.5));
    }
    with_status(g, status)
}

#[tokio::test]
async fn both_replicas_serve_and_each_reports_its_own_figures() {
    let g = both_serving().await;
    // Settled: reads only.
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let steps = [
        vec![
            Step::get(NODE_A).json(to_json(&gpu_node("gpu-a", "251Gi", "1"))),
            Step::get(DEPLOYMENT).json(available(server(&g, 1))),
            Step::get(NODE_B).json(to_json(&gpu_node("gpu-b", "251Gi", "1"))),
            Step::get(DEPLOYMENT_R1).json(available(replica_server(&g, "gpu-b", 1))),
        ],
        front_reads(&g),
        vec![serving_pods(), both_pods()],
    ]
    .concat();
    let (result, seen) = run(ctx, handle, g, steps).await;
    assert_eq!(result.unwrap(), Action::requeue(RUNNING_REQUEUE));
    assert_no_writes(&seen);
}

/// Scale 2 -> 1: replica 1's Deployment is deleted (its pod drains); it holds gpu-b until
/// it is gone, and then leaves status with its store and pack-store Job kept (Retain).
#[tokio::test]
async fn scaling_down_drains_the_last_replica_and_keeps_its_store() {
    let mut g = both_serving().await;
    g.spec.replicas = 1;
    g.metadata.generation = Some(3);
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let steps = [
        vec![
            Step::get(NODE_A).json(to_json(&gpu_node("gpu-a", "251Gi", "1"))),
            pods_on("gpu-a"),
            all_gfds(vec![to_json(&g)]),
            Step::get(DEPLOYMENT).json(available(server(&g, 1))),
        ],
        front_reads(&g),
        vec![
            serving_pods(),
            Step::get(DEPLOYMENT_R1).json(available(replica_server(&g, "gpu-b", 1))),
            Step::delete(DEPLOYMENT_R1).json(deleted()),
            Step::apply(GFD_STATUS),
        ],
    ]
    .concat();
    let (result, seen) = run(ctx, handle, g.clone(), steps).await;
    assert_eq!(result.unwrap(), Action::requeue(WAITING_REQUEUE));
    assert_eq!(seen[9].body["propagationPolicy"], "Foreground");
    let status = status_written(&seen).unwrap();
    assert_eq!(status.ready.as_deref(), Some("1/1"));
    assert_eq!(replica(&status, 1).phase, Phase::Draining);
    // Still held: another object cannot take gpu-b's GPU while the pod drains.
    assert_eq!(status.held_nodes(), ["gpu-a", "gpu-b"]);
    let g = with_status(g, status);

    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let steps = [
        vec![
            Step::get(NODE_A).json(to_json(&gpu_node("gpu-a", "251Gi", "1"))),
            Step::get(DEPLOYMENT).json(available(server(&g, 1))),
        ],
        front_reads(&g),
        vec![
            serving_pods(),
            Step::get(DEPLOYMENT_R1).not_found(),
            Step::apply(GFD_STATUS),
        ],
    ]
    .concat();
    let (result, seen) = run(ctx, handle, g, steps).await;
    assert_eq!(result.unwrap(), Action::requeue(RUNNING_REQUEUE));
    let status = status_written(&seen).unwrap();
    assert_eq!(status.replicas.len(), 1);
    assert_eq!(status.held_nodes(), ["gpu-a"]);
}

/// With reclaim policy Delete, a drained replica's store goes with a reclaim Job on its
/// node, then the pack-store Job that said the store was there.
#[tokio::test]
async fn scaling_down_with_delete_reclaims_the_store_on_that_node() {
    let mut g = both_serving().await;
    g.spec.replicas = 1;
    g.spec.store.reclaim_policy = glmflash_crds::ReclaimPolicy::Delete;
    let status = g.status.as_mut().unwrap();
    status.replicas[1].phase = Phase::Draining;
    status.observed_generation = Some(3);
    g.metadata.generation = Some(3);
    let reclaim = job_path(&names::reclaim_job("glm", 1));
    let running_reads = [
        vec![
            Step::get(NODE_A).json(to_json(&gpu_node("gpu-a", "251Gi", "1"))),
            Step::get(DEPLOYMENT).json(available(server(&g, 1))),
        ],
        front_reads(&g),
        vec![serving_pods(), Step::get(DEPLOYMENT_R1).not_found()],
    ]
    .concat();
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let mut steps = running_reads.clone();
    steps.extend([
        Step::get(&reclaim).not_found(),
        all_gfds(vec![to_json(&g)]),
        Step::apply(&reclaim),
        Step::apply(GFD_STATUS),
    ]);
    let (result, seen) = run(ctx, handle, g.clone(), steps).await;
    assert_eq!(result.unwrap(), Action::requeue(WAITING_REQUEUE));
    assert_eq!(
        seen[9].body,
        to_json(&builders::reclaim_job(&g, 1, "gpu-b", true))
    );
    let status = status_written(&seen).unwrap();
    let message = replica(&status, 1).message.clone().unwrap();
    assert!(message.contains("glm-reclaim-r1"), "{message}");
    let g = with_status(g, status);

    let mut done = to_json(&builders::reclaim_job(&g, 1, "gpu-b", true));
    done["status"] =
        json!({"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]});
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let mut steps = running_reads;
    steps.extend([
        Step::get(&reclaim).json(done),
        Step::get(job_path(&names::pack_job("glm", &hash_on(&g, "gpu-b"))))
            .json(complete_job(&g, "gpu-b")),
        Step::delete(job_path(&names::pack_job("glm", &hash_on(&g, "gpu-b")))).json(deleted()),
        Step::delete(&reclaim).json(deleted()),
        Step::apply(GFD_STATUS),
    ]);
    let (_, seen) = run(ctx, handle, g, steps).await;
    assert_eq!(status_written(&seen).unwrap().replicas.len(), 1);
}

/// gpu-b disappears: replica 1 is placed again on gpu-c (not gpu-a, replica 0's), packs
/// its store there, and its old server is scaled to zero meanwhile.
#[tokio::test]
async fn a_lost_node_is_replaced_elsewhere() {
    let g = both_serving().await;
    let job_c = names::pack_job("glm", &hash_on(&g, "gpu-c"));
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let steps = [
        vec![
            Step::get(NODE_A).json(to_json(&gpu_node("gpu-a", "251Gi", "1"))),
            Step::get(DEPLOYMENT).json(available(server(&g, 1))),
            Step::get(NODE_B).not_found(),
            Step::get(NODES).json(three_nodes("gpu-c")),
            all_gfds(vec![to_json(&g)]),
            pods_on("gpu-c"),
            pack_jobs(vec![complete_job(&g, "gpu-a"), complete_job(&g, "gpu-b")]),
            Step::apply(job_path(&job_c)),
        ],
        job_trouble_reads(&job_c).to_vec(),
        vec![
            Step::get(DEPLOYMENT_R1).json(available(replica_server(&g, "gpu-b", 1))),
            Step::apply(DEPLOYMENT_R1),
        ],
        front_reads(&g),
        vec![serving_pods(), Step::apply(GFD_STATUS)],
    ]
    .concat();
    let (result, seen) = run(ctx, handle, g.clone(), steps).await;
    assert_eq!(result.unwrap(), Action::requeue(WAITING_REQUEUE));
    assert_eq!(
        seen[7].body,
        to_json(&builders::pack_job(&g, "gpu-c", &hash_on(&g, "gpu-c")))
    );
    // The old server, on the lost node's store, stops.
    let stopped = builders::server_deployment(&g, 1, "gpu-c", &hash_on(&g, "gpu-b"), 0);
    assert_eq!(seen[11].body, to_json(&stopped));
    let status = status_written(&seen).unwrap();
    assert_eq!(replica(&status, 1).node, "gpu-c");
    assert_eq!(replica(&status, 1).phase, Phase::PackingStore);
    assert_eq!(status.ready.as_deref(), Some("1/2"));
}

/// The annotation hibernates: both servers scaled to zero, then, once their pods are
/// gone, phase Hibernated with no node held; the Services and stores stay.
async fn hibernated() -> GlmFlashDeployment {
    let mut g = both_serving().await;
    g.metadata.annotations = Some([(HIBERNATE_ANNOTATION.to_string(), "true".to_string())].into());
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let steps = vec![
        Step::get(DEPLOYMENT).json(available(server(&g, 1))),
        Step::apply(DEPLOYMENT),
        Step::get(DEPLOYMENT_R1).json(available(replica_server(&g, "gpu-b", 1))),
        Step::apply(DEPLOYMENT_R1),
        Step::apply(GFD_STATUS),
        Step::post(EVENTS),
    ];
    let (result, seen) = run(ctx, handle, g.clone(), steps).await;
    assert_eq!(result.unwrap(), Action::requeue(WAITING_REQUEUE));
    assert_eq!(seen[1].body, server(&g, 0));
    assert_eq!(seen[3].body, replica_server(&g, "gpu-b", 0));
    let status = status_written(&seen).unwrap();
    assert_eq!(status.phase, Some(Phase::Hibernated));
    assert_eq!(status.ready.as_deref(), Some("0/2"));
    assert!(status.held_nodes().is_empty(), "the GPUs are released");
    let (_, reason, message) = cond(&status, condition::READY);
    assert_eq!(reason, "Hibernated");
    assert!(message.contains("2 server pod(s) stopping"), "{message}");
    assert_eq!(seen[5].body["reason"], "Hibernated");
    let g = with_status(g, status);

    let mut stopped = server(&g, 0);
    stopped["status"] = json!({"replicas": 0});
    let mut stopped_r1 = replica_server(&g, "gpu-b", 0);
    stopped_r1["status"] = json!({"replicas": 0});
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let steps = vec![
        Step::get(DEPLOYMENT).json(stopped.clone()),
        Step::get(DEPLOYMENT_R1).json(stopped_r1.clone()),
        Step::apply(GFD_STATUS),
    ];
    let (result, seen) = run(ctx, handle, g.clone(), steps.clone()).await;
    assert_eq!(result.unwrap(), Action::await_change());
    let status = status_written(&seen).unwrap();
    assert!(cond(&status, condition::READY).2.starts_with("hibernated:"));
    assert_eq!(replica(&status, 1).node, "gpu-b", "kept for the wake");
    assert_eq!(replica(&status, 1).store_hash, Some(hash_on(&g, "gpu-b")));
    let g = with_status(g, status);

    // Settled while hibernated: reads only.
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let (_, seen) = run(ctx, handle, g.clone(), steps[..2].to_vec()).await;
    assert_no_writes(&seen);
    g
}

#[tokio::test]
async fn hibernating_scales_every_replica_to_zero_and_releases_the_gpus() {
    hibernated().await;
}

/// The wake: each replica checks its node's room again (its GPU was free for others),
/// finds its store built (no pack-store request at all) and scales its server back up.
#[tokio::test]
async fn waking_returns_to_the_same_nodes_without_packing() {
    let mut g = hibernated().await;
    g.metadata.annotations = None;
    let mut stopped = server(&g, 0);
    stopped["status"] = json!({"replicas": 0});
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let steps = [
        vec![
            Step::get(NODE_A).json(to_json(&gpu_node("gpu-a", "251Gi", "1"))),
            pods_on("gpu-a"),
            all_gfds(vec![to_json(&g)]),
            Step::get(DEPLOYMENT).json(stopped),
            Step::apply(DEPLOYMENT),
            Step::get(NODE_B).json(to_json(&gpu_node("gpu-b", "251Gi", "1"))),
            pods_on("gpu-b"),
            all_gfds(vec![to_json(&g)]),
            Step::get(DEPLOYMENT_R1).json(replica_server(&g, "gpu-b", 0)),
            Step::apply(DEPLOYMENT_R1),
        ],
        front_reads(&g),
        vec![
            server_pods(vec![]),
            server_pods(vec![]),
            Step::apply(GFD_STATUS),
            Step::post(EVENTS),
        ],
    ]
    .concat();
    let (result, seen) = run(ctx, handle, g.clone(), steps).await;
    assert_eq!(result.unwrap(), Action::requeue(WAITING_REQUEUE));
    assert_eq!(seen[4].body, server(&g, 1));
    assert_eq!(seen[9].body, replica_server(&g, "gpu-b", 1));
    let status = status_written(&seen).unwrap();
    assert_eq!(status.phase, Some(Phase::Starting));
    assert_eq!(status.ready.as_deref(), Some("0/2"));
    assert_eq!(status.held_nodes(), ["gpu-a", "gpu-b"]);
    assert_eq!(seen[16].body["reason"], "Starting");
}

/// Another object took gpu-a's GPU while this one was hibernated: the wake goes to a
/// node with room (gpu-c) and packs its store there, rather than wait for gpu-a; the
/// replica scaled away while hibernated is drained.
#[tokio::test]
async fn a_wake_onto_a_taken_gpu_moves_elsewhere() {
    let mut g = hibernated().await;
    g.spec.replicas = 1;
    g.metadata.generation = Some(3);
    g.metadata.annotations = None;
    let mut other = gfd_with_finalizer();
    other.metadata.name = Some("other".into());
    other.metadata.uid = Some("other-uid".into());
    other.status = Some(GlmFlashDeploymentStatus {
        node: Some("gpu-a".into()),
        ..Default::default()
    });
    let objects = vec![to_json(&g), to_json(&other)];
    let job_c = names::pack_job("glm", &hash_on(&g, "gpu-c"));
    let mut stopped = server(&g, 0);
    stopped["status"] = json!({"replicas": 0});
    let (ctx, _, handle) = context(Ok(SERVER_PAGE), false);
    let steps = [
        vec![
            Step::get(NODE_A).json(to_json(&gpu_node("gpu-a", "251Gi", "1"))),
            pods_on("gpu-a"),
            all_gfds(objects.clone()),
            Step::get(NODES).json(three_nodes("gpu-c")),
            all_gfds(objects),
            pods_on("gpu-a"),
            pods_on("gpu-c"),
            pack_jobs(vec![complete_job(&g, "gpu-a"), complete_job(&g, "gpu-b")]),
            Step::apply(job_path(&job_c)),
        ],
        job_trouble_reads(&job_c).to_vec(),
        vec![
            Step::get(DEPLOYMENT).json(stopped),
            Step::get(DEPLOYMENT_R1).json(replica_server(&g, "gpu-b", 0)),
            Step::delete(DEPLOYMENT_R1).json(deleted()),
            Step::apply(GFD_STATUS),
            Step::post(EVENTS),
        ],
    ]
    .concat();
    let (result, seen) = run(ctx, handle, g, steps).await;
    assert_eq!(result.unwrap(), Action::requeue(WAITING_REQUEUE));
    let status = status_written(&seen).unwrap();
    assert_eq!(status.phase, Some(Phase::PackingStore));
    assert_eq!(status.node.as_deref(), Some("gpu-c"));
    assert_eq!(replica(&status, 1).phase, Phase::Draining);
}
