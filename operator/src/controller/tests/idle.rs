//! Issue 18, `spec.idleAfter`: the servers' request counters move the idle clock in status;
//! a deployment idle for that long gets the hibernate annotation (a merge patch of that one
//! key and an Event), and the reconcile the patch brings hibernates it.

use super::*;
use glmflash_crds::HIBERNATE_ANNOTATION;
use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

/// [`SERVER_PAGE`] with 5 chat completions served (probes do not count) and `active`
/// requests decoding.
fn page(active: u32) -> String {
    format!(
        "{SERVER_PAGE}glmflash_requests_total{{endpoint=\"/v1/chat/completions\",status=\"200\"}} 5\n\
         glmflash_requests_total{{endpoint=\"/health\",status=\"200\"}} 70\n\
         glmflash_running_requests {active}\n\
         glmflash_waiting_requests 0\n"
    )
}

/// `minutes` ago, to the second as status holds times.
fn ago(minutes: i64) -> Time {
    let now = Timestamp::now().as_second();
    Time(Timestamp::from_second(now - minutes * 60).unwrap())
}

/// Running with `idleAfter: 1h`, after a reconcile that saw a request being decoded: the
/// clock is at that reconcile.
async fn busy() -> GlmFlashDeployment {
    let mut g = running().await;
    g.spec.idle_after = Some("1h".into());
    let (ctx, _, handle) = context(Ok(page(1).as_str()), false);
    let mut steps = running_reads(&g);
    steps.push(Step::apply(GFD_STATUS));
    // Status holds times to the second.
    let before = Timestamp::now() - SignedDuration::from_secs(1);
    let (result, seen) = run(ctx, handle, g.clone(), steps).await;
    assert_eq!(result.unwrap(), Action::requeue(RUNNING_REQUEUE));
    let status = status_written(&seen).unwrap();
    let live = status.live.clone().unwrap();
    assert_eq!((live.requests, live.active_requests), (Some(5), Some(1)));
    let last = status.last_request_time.clone().expect("the clock started");
    assert!(last.0 >= before && last.0 <= Timestamp::now(), "{last:?}");
    with_status(g, status)
}

/// The request finished half an hour ago: the figures change, the clock does not, and
/// nothing hibernates before the hour.
async fn quiet_for(minutes: i64) -> GlmFlashDeployment {
    let mut g = busy().await;
    let since = ago(minutes);
    g.status.as_mut().unwrap().last_request_time = Some(since.clone());
    let (ctx, _, handle) = context(Ok(page(0).as_str()), false);
    let mut steps = running_reads(&g);
    steps.push(Step::apply(GFD_STATUS));
    let (result, seen) = run(ctx, handle, g.clone(), steps).await;
    assert_eq!(result.unwrap(), Action::requeue(RUNNING_REQUEUE));
    let status = status_written(&seen).unwrap();
    assert_eq!(status.live.as_ref().unwrap().active_requests, Some(0));
    assert_eq!(status.last_request_time, Some(since));
    with_status(g, status)
}

#[tokio::test]
async fn a_request_in_flight_moves_the_idle_clock() {
    busy().await;
}

#[tokio::test]
async fn quiet_for_less_than_idle_after_stays_up() {
    quiet_for(30).await;
}

#[tokio::test]
async fn idle_for_longer_than_idle_after_hibernates_by_annotation() {
    let mut g = quiet_for(30).await;
    let since = ago(61);
    g.status.as_mut().unwrap().last_request_time = Some(since.clone());
    let (ctx, _, handle) = context(Ok(page(0).as_str()), false);
    let mut annotated = g.clone();
    annotated.metadata.annotations =
        Some([(HIBERNATE_ANNOTATION.to_string(), "true".into())].into());
    let mut steps = running_reads(&g);
    steps.extend([
        Step::patch(GFD).json(to_json(&annotated)),
        Step::post(EVENTS),
    ]);
    let (result, seen) = run(ctx, handle, g.clone(), steps).await;
    assert_eq!(result.unwrap(), Action::requeue(RUNNING_REQUEUE));
    let patch = &seen[6];
    assert_eq!(
        patch.body,
        json!({"metadata": {"annotations": {HIBERNATE_ANNOTATION: "true"}}}),
        "only the annotation, never the spec"
    );
    assert!(
        seen.iter().all(|s| !s.path.ends_with("/status")),
        "status was unchanged"
    );
    assert_eq!(seen[7].body["reason"], "Idle");
    let note = seen[7].body["note"].as_str().unwrap();
    assert!(note.contains("longer than spec.idleAfter 1h"), "{note}");

    // The patch brings a reconcile that sees the annotation: the server scaled to zero.
    let g = annotated;
    let (ctx, _, handle) = context(Ok(page(0).as_str()), false);
    let steps = vec![
        Step::get(DEPLOYMENT).json(available(server(&g, 1))),
        Step::apply(DEPLOYMENT),
        Step::apply(GFD_STATUS),
        Step::post(EVENTS),
    ];
    let (result, seen) = run(ctx, handle, g.clone(), steps).await;
    assert_eq!(result.unwrap(), Action::requeue(WAITING_REQUEUE));
    assert_eq!(seen[1].body, server(&g, 0));
    let status = status_written(&seen).unwrap();
    assert_eq!(status.phase, Some(Phase::Hibernated));
    assert_eq!(
        status.last_request_time,
        Some(since),
        "kept while hibernated"
    );
    assert_eq!(seen[3].body["reason"], "Hibernated");
}

#[tokio::test]
async fn a_server_whose_metrics_cannot_be_read_is_not_idle() {
    let mut g = quiet_for(30).await;
    g.status.as_mut().unwrap().last_request_time = Some(ago(120));
    let (ctx, _, handle) = context(Err("connection refused"), false);
    let mut steps = running_reads(&g);
    steps.push(Step::apply(GFD_STATUS));
    let (result, seen) = run(ctx, handle, g.clone(), steps).await;
    assert_eq!(result.unwrap(), Action::requeue(RUNNING_REQUEUE));
    let live = status_written(&seen).unwrap().live.unwrap();
    assert_eq!(live.requests, Some(5), "the last figures stay");
    assert_eq!(
        live.active_requests, None,
        "but whether it is busy is unknown"
    );
}

#[tokio::test]
async fn without_idle_after_an_idle_server_stays_up() {
    let mut g = quiet_for(30).await;
    g.spec.idle_after = None;
    g.status.as_mut().unwrap().last_request_time = Some(ago(600));
    let (ctx, _, handle) = context(Ok(page(0).as_str()), false);
    let (result, seen) = run(ctx, handle, g.clone(), running_reads(&g)).await;
    assert_eq!(result.unwrap(), Action::requeue(RUNNING_REQUEUE));
    assert_no_writes(&seen);
}
