//! A real Prometheus (Debian's `prometheus` binary) scrapes an exposition of every metric
//! in the contract (`metric_names`), and every dashboard query must return data and every
//! alert expression must evaluate. This catches PromQL errors and label mismatches that a
//! name check cannot.
//!
//! What is scraped is NOT glmflash-node: the server does not expose its metrics yet. The
//! exposition here is built from the contract's names and documented labels, with
//! counters that grow between scrapes. Point `GLMFLASH_NODE_METRICS_URL` at a running
//! glmflash-node's `/metrics` to scrape the real server instead.
//!
//! Without `prometheus` on PATH the test fails, unless GLMFLASH_SKIP_PROMETHEUS=1.

use std::fmt::Write as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use glmflash_operator::metric_names as m;
use glmflash_operator::scrape::{HttpScraper, Scrape};
use serde_json::Value;

/// The contract's metrics with their documented label values; counters and histograms
/// advance with `tick` so `rate()` has something to see.
fn contract_exposition(tick: u64) -> String {
    let t = tick as f64 + 1.0;
    let mut out = String::new();
    let mut line = |name: &str, labels: &str, value: f64| {
        let _ = writeln!(out, "{name}{{{labels}}} {value}");
    };
    for (i, tier) in ["vram", "ram", "nvme"].iter().enumerate() {
        for phase in ["prefill", "decode"] {
            line(
                m::EXPERT_LOOKUPS_TOTAL,
                &format!("tier=\"{tier}\",phase=\"{phase}\""),
                t * (100.0 / (i as f64 + 1.0)),
            );
        }
        line(
            m::TIER_RESIDENT_EXPERTS,
            &format!("tier=\"{tier}\""),
            1000.0 / (i as f64 + 1.0),
        );
        line(
            m::TIER_CAPACITY_EXPERTS,
            &format!("tier=\"{tier}\""),
            1376.0 / (i as f64 + 1.0),
        );
    }
    for path in ["nvme_to_ram", "ram_to_vram", "vram_to_ram"] {
        line(m::BYTES_MOVED_TOTAL, &format!("path=\"{path}\""), t * 9.7e6);
    }
    for outcome in ["hit", "wasted"] {
        line(
            m::PREFETCH_TOTAL,
            &format!("outcome=\"{outcome}\""),
            t * 40.0,
        );
    }
    for kind in ["vram", "pinned_ram", "cgroup_limit", "memlock_limit"] {
        line(m::MEMORY_BYTES, &format!("kind=\"{kind}\""), 2.4e10);
    }
    for status in ["200", "400"] {
        line(
            m::REQUESTS_TOTAL,
            &format!("endpoint=\"/v1/chat/completions\",status=\"{status}\""),
            t,
        );
    }
    for (name, value) in [
        (m::CPU_LANE_EXPERTS_TOTAL, t * 30.0),
        (m::PREFILL_TOKENS_TOTAL, t * 600.0),
        (m::DECODE_TOKENS_TOTAL, t * 19.0),
        (m::NVME_READ_ERRORS_TOTAL, 0.0),
        (m::PIN_FAILURES_TOTAL, 0.0),
        (m::DECODE_TOKENS_PER_SECOND, 19.5),
        (m::RUNNING_REQUESTS, 1.0),
        (m::WAITING_REQUESTS, 0.0),
        (m::KV_TOKENS_USED, 8192.0),
        (m::KV_TOKENS_CAPACITY, 131_072.0),
        (m::SERVER_READY, 1.0),
    ] {
        line(name, "", value);
    }
    for histogram in m::HISTOGRAMS {
        let mut cumulative = 0.0;
        for le in ["0.001", "0.01", "0.1", "1", "+Inf"] {
            cumulative += t;
            line(
                &format!("{histogram}_bucket"),
                &format!("le=\"{le}\""),
                cumulative,
            );
        }
        line(&format!("{histogram}_sum"), "", t * 0.5);
        line(&format!("{histogram}_count"), "", cumulative);
    }
    out
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn query(scraper: &HttpScraper, port: u16, expr: &str) -> Value {
    let url = format!(
        "http://127.0.0.1:{port}/api/v1/query?query={}",
        encode(expr)
    );
    let text = scraper
        .fetch(url)
        .await
        .unwrap_or_else(|e| panic!("{expr}: {e}"));
    serde_json::from_str(&text).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_query_returns_data_from_a_real_prometheus() {
    if std::env::var("GLMFLASH_SKIP_PROMETHEUS").as_deref() == Ok("1") {
        eprintln!("GLMFLASH_SKIP_PROMETHEUS=1: skipping");
        return;
    }
    let prometheus = std::env::var("PROMETHEUS").unwrap_or_else(|_| "prometheus".into());
    assert!(
        Command::new(&prometheus)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success()),
        "prometheus not found: apt-get install prometheus (or GLMFLASH_SKIP_PROMETHEUS=1)"
    );

    let target = match std::env::var("GLMFLASH_NODE_METRICS_URL") {
        Ok(url) => url.trim_start_matches("http://").to_string(),
        Err(_) => {
            use axum::{Router, routing::get};
            let ticks = Arc::new(AtomicU64::new(0));
            let app = Router::new().route(
                "/metrics",
                get(move || {
                    let tick = ticks.fetch_add(1, Ordering::Relaxed);
                    async move { contract_exposition(tick) }
                }),
            );
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            tokio::spawn(async move { axum::serve(listener, app).await });
            format!("{addr}/metrics")
        }
    };
    let (host, path) = target.split_once('/').unwrap();

    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n\
             scrape_configs:\n\
             - job_name: glmflash\n  metrics_path: /{path}\n  static_configs:\n\
             \x20 - targets: ['{host}']\n    labels: {{namespace: ai, service: glm-metrics}}\n"
        ),
    )
    .unwrap();
    let port = free_port();
    let _prometheus = Killed(
        Command::new(&prometheus)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );

    let scraper = HttpScraper::new(Duration::from_secs(5));
    let deadline = Instant::now() + Duration::from_secs(60);
    // Enough scrapes that a rate over 30 s has several samples.
    loop {
        let ready = match scraper
            .fetch(format!(
                "http://127.0.0.1:{port}/api/v1/query?query={}",
                encode("count_over_time(up[1m])")
            ))
            .await
        {
            Ok(text) => serde_json::from_str::<Value>(&text).ok().and_then(|v| {
                v["data"]["result"][0]["value"][1]
                    .as_str()
                    .and_then(|n| n.parse::<f64>().ok())
            }),
            Err(_) => None,
        };
        if ready.is_some_and(|n| n >= 6.0) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "prometheus did not scrape {target} in time"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    let chart = Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/glmflash");
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(chart.join("dashboards/glmflash.json")).unwrap(),
    )
    .unwrap();
    let mut checked = 0;
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"]
                .as_str()
                .unwrap()
                .replace("$namespace", ".*")
                .replace("$service", ".*")
                .replace("$__rate_interval", "30s");
            let answer = query(&scraper, port, &expr).await;
            assert_eq!(
                answer["status"], "success",
                "{}: {expr}: {answer}",
                panel["title"]
            );
            let result = answer["data"]["result"].as_array().unwrap();
            assert!(!result.is_empty(), "{}: no data for {expr}", panel["title"]);
            checked += 1;
        }
    }
    assert!(checked >= 20, "{checked}");

    let rules: serde_yaml::Value = serde_yaml::from_str(
        &std::fs::read_to_string(chart.join("files/alerts.rules.yaml")).unwrap(),
    )
    .unwrap();
    for group in rules["groups"].as_sequence().unwrap() {
        for rule in group["rules"].as_sequence().unwrap() {
            let expr = rule["expr"].as_str().unwrap();
            let answer = query(&scraper, port, expr).await;
            assert_eq!(answer["status"], "success", "{expr}: {answer}");
        }
    }
}
