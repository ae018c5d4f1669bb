//! A real Prometheus (Debian's `prometheus` binary) scrapes a real glmflash-node: the demo
//! model served in this process through the same `demo` command line as the binary, with
//! `--metrics-port`, while a few chat requests run (plain, streamed, and a rejected one).
//! Every dashboard query and alert expression is then evaluated against those series. A
//! query whose metrics the node exposes must return data; a query naming a contract metric
//! the node does not export yet (the expert-tier, memory and store series, which come with
//! the tiers on the server) must still evaluate, and is listed. Every metric a query names
//! must be in the contract (`glmflash-metric-names`) and every metric the node exports must be too.
//!
//! Without `prometheus` on PATH the test fails, unless GLMFLASH_SKIP_PROMETHEUS=1.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use glmflash_metric_names as m;
use glmflash_node::cli::{Cli, Command as NodeCommand};
use glmflash_operator::scrape::{HttpScraper, Scrape};
use serde_json::Value;

/// Starts `glmflash-node demo --dir DIR --metrics-port ...` in a thread of this process
/// (the dispatch of main.rs); returns the API and metrics ports.
fn start_node(dir: &Path) -> (u16, u16) {
    let (api, metrics) = (free_port(), free_port());
    let argv = [
        "glmflash-node".to_string(),
        "demo".into(),
        "--dir".into(),
        dir.display().to_string(),
        "--host".into(),
        "127.0.0.1".into(),
        "--port".into(),
        api.to_string(),
        "--metrics-port".into(),
        metrics.to_string(),
        "--max-batch-size".into(),
        "2".into(),
    ];
    let NodeCommand::Demo { dir, serve } = Cli::try_parse_from(argv).unwrap().command else {
        unreachable!("demo parses to Command::Demo")
    };
    let dir = dir.unwrap();
    glmflash_node::demo::ensure_demo_model(&dir).unwrap();
    std::thread::spawn(move || {
        if let Err(e) = glmflash_node::api::server::serve(dir, serve, None) {
            panic!("glmflash-node serve: {e:#}");
        }
    });
    (api, metrics)
}

/// One HTTP/1.1 exchange; returns the status code and body.
fn http(port: u16, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, out)
}

/// Chat requests in a loop until `stop`: plain, streamed, and one the server rejects.
fn drive(port: u16, stop: Arc<AtomicBool>, served: Arc<AtomicU64>) {
    let chat = |stream: bool| {
        serde_json::json!({
            "model": "glm-5.3-flash",
            "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": 8,
            "stream": stream,
        })
        .to_string()
    };
    while !stop.load(Ordering::Relaxed) {
        for stream in [false, true] {
            let (status, body) = http(port, "POST", "/v1/chat/completions", &chat(stream));
            assert_eq!(status, 200, "{body}");
            served.fetch_add(1, Ordering::Relaxed);
        }
        let (status, _) = http(port, "POST", "/v1/chat/completions", "{\"messages\": 3}");
        assert!((400..500).contains(&status), "{status}");
    }
}

/// The `glmflash_*` metric names an expression or exposition mentions (histogram series
/// reduced to their family).
fn metric_names_in(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("glmflash_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let name = &tail[..end];
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| {
                name.strip_suffix(suffix)
                    .filter(|f| m::HISTOGRAMS.contains(f))
            })
            .unwrap_or(name);
        names.insert(family.to_string());
        rest = &tail[end..];
    }
    names
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

    let model_dir = tempfile::tempdir().unwrap();
    let (api_port, metrics_port) = start_node(&model_dir.path().join("demo-model"));
    let scraper = HttpScraper::new(Duration::from_secs(5));
    let deadline = Instant::now() + Duration::from_secs(180);
    while scraper
        .fetch(format!("http://127.0.0.1:{api_port}/ready"))
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "glmflash-node did not get ready");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let served = Arc::new(AtomicU64::new(0));
    let driver = {
        let (stop, served) = (stop.clone(), served.clone());
        std::thread::spawn(move || drive(api_port, stop, served))
    };
    let target = format!("127.0.0.1:{metrics_port}/metrics");
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

    let deadline = Instant::now() + Duration::from_secs(90);
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
        if ready.is_some_and(|n| n >= 6.0) && served.load(Ordering::Relaxed) >= 4 {
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
    let exposition = scraper.fetch(format!("http://{target}")).await.unwrap();
    let exposed = metric_names_in(&exposition);
    let contract: BTreeSet<String> = m::ALL.iter().map(|s| s.to_string()).collect();
    assert!(
        exposed.is_subset(&contract),
        "glmflash-node exports metrics outside the contract: {:?}",
        exposed.difference(&contract).collect::<Vec<_>>()
    );
    assert!(exposed.len() >= 10, "{exposed:?}");

    let mut with_data = 0;
    let mut awaiting = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"]
                .as_str()
                .unwrap()
                .replace("$namespace", ".*")
                .replace("$service", ".*")
                .replace("$__rate_interval", "30s");
            let names = metric_names_in(&expr);
            assert!(!names.is_empty(), "{expr}");
            assert!(
                names.is_subset(&contract),
                "{}: {expr} names metrics outside the contract",
                panel["title"]
            );
            let answer = query(&scraper, port, &expr).await;
            assert_eq!(
                answer["status"], "success",
                "{}: {expr}: {answer}",
                panel["title"]
            );
            let result = answer["data"]["result"].as_array().unwrap();
            if names.is_subset(&exposed) {
                assert!(!result.is_empty(), "{}: no data for {expr}", panel["title"]);
                with_data += 1;
            } else {
                assert!(
                    result.is_empty(),
                    "{expr}: data from a metric not exported?"
                );
                let missing: Vec<_> = names.difference(&exposed).cloned().collect();
                awaiting.push(format!("{} ({})", panel["title"], missing.join(", ")));
            }
        }
    }
    eprintln!(
        "{with_data} dashboard queries returned data from glmflash-node; {} await metrics it \
         does not export yet: {awaiting:#?}",
        awaiting.len()
    );
    assert!(with_data >= 12, "{with_data}");

    // The traffic shows in the series: requests by status, tokens, latencies.
    for (expr, what) in [
        (
            "sum(increase(glmflash_requests_total{status=\"200\"}[1m]))",
            "served requests",
        ),
        (
            "sum(increase(glmflash_decode_tokens_total[1m]))",
            "decoded tokens",
        ),
        (
            "sum(increase(glmflash_time_to_first_token_seconds_count[1m]))",
            "TTFT observations",
        ),
        ("max(glmflash_server_ready)", "readiness"),
    ] {
        let answer = query(&scraper, port, expr).await;
        let value: f64 = answer["data"]["result"][0]["value"][1]
            .as_str()
            .unwrap_or_else(|| panic!("{what}: {answer}"))
            .parse()
            .unwrap();
        assert!(value > 0.0, "{what}: {expr} = {value}");
    }
    let rules: serde_yaml::Value = serde_yaml::from_str(
        &std::fs::read_to_string(chart.join("files/alerts.rules.yaml")).unwrap(),
    )
    .unwrap();
    for group in rules["groups"].as_sequence().unwrap() {
        for rule in group["rules"].as_sequence().unwrap() {
            let expr = rule["expr"].as_str().unwrap();
            let server_metrics: BTreeSet<String> = metric_names_in(expr)
                .into_iter()
                .filter(|n| !n.starts_with("glmflash_operator_"))
                .collect();
            assert!(server_metrics.is_subset(&contract), "{expr}");
            let answer = query(&scraper, port, expr).await;
            assert_eq!(answer["status"], "success", "{expr}: {answer}");
        }
    }
    stop.store(true, Ordering::Relaxed);
    driver.join().unwrap();
}
