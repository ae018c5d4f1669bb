//! Live figures for status, read from the server's Prometheus `/metrics`.
//!
//! Parsing is a pure function of the exposition text. Fetching is behind [`Scrape`] so
//! the reconciler can be driven in tests; the real implementation is a plain HTTP GET
//! through hyper (already in the tree through kube), tested against a real local server.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::future::BoxFuture;
use glmflash_crds::{LiveFigures, PlanFigures};
use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// Fetches a `/metrics` page.
pub trait Scrape: Send + Sync {
    /// The exposition text at `url`, or why it could not be read.
    fn fetch(&self, url: String) -> BoxFuture<'_, Result<String, String>>;
}

/// HTTP scraper with a timeout and a body size cap.
pub struct HttpScraper {
    client: Client<HttpConnector, Empty<Bytes>>,
    timeout: Duration,
}

/// Largest exposition read (the server's is a few hundred series).
const MAX_BODY: usize = 4 << 20;

impl HttpScraper {
    /// A scraper whose requests give up after `timeout`.
    pub fn new(timeout: Duration) -> Self {
        Self {
            client: Client::builder(TokioExecutor::new()).build_http(),
            timeout,
        }
    }
}

impl Scrape for HttpScraper {
    fn fetch(&self, url: String) -> BoxFuture<'_, Result<String, String>> {
        Box::pin(async move {
            let uri: hyper::Uri = url.parse().map_err(|e| format!("{url}: {e}"))?;
            let request = async {
                let response = self.client.get(uri).await.map_err(|e| e.to_string())?;
                if !response.status().is_success() {
                    return Err(format!("status {}", response.status()));
                }
                let body = Limited::new(response.into_body(), MAX_BODY)
                    .collect()
                    .await
                    .map_err(|e| e.to_string())?
                    .to_bytes();
                String::from_utf8(body.to_vec()).map_err(|e| e.to_string())
            };
            tokio::time::timeout(self.timeout, request)
                .await
                .map_err(|_| format!("{url}: timed out after {:?}", self.timeout))?
                .map_err(|e| format!("{url}: {e}"))
        })
    }
}

/// One sample of the exposition: name, labels, value.
#[derive(Debug, PartialEq)]
pub struct Sample {
    /// Metric name.
    pub name: String,
    /// Label pairs.
    pub labels: BTreeMap<String, String>,
    /// Value.
    pub value: f64,
}

/// Parses the Prometheus text format (comments skipped, timestamps ignored). Lines that do
/// not parse are skipped: one odd line must not hide the rest.
pub fn parse_exposition(text: &str) -> Vec<Sample> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(parse_line)
        .collect()
}

fn parse_line(line: &str) -> Option<Sample> {
    let (name, labels, rest) = match line.find('{') {
        Some(open) => {
            let close = line[open..].find('}')? + open;
            (
                &line[..open],
                parse_labels(&line[open + 1..close])?,
                &line[close + 1..],
            )
        }
        None => {
            let space = line.find(char::is_whitespace)?;
            (&line[..space], BTreeMap::new(), &line[space..])
        }
    };
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some(Sample {
        name: name.trim().to_string(),
        labels,
        value,
    })
}

fn parse_labels(s: &str) -> Option<BTreeMap<String, String>> {
    let mut labels = BTreeMap::new();
    let mut rest = s.trim();
    while !rest.is_empty() {
        let eq = rest.find('=')?;
        let key = rest[..eq].trim().to_string();
        let after = rest[eq + 1..].trim_start().strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next()? {
                (i, '"') => break i,
                (_, '\\') => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    c => value.push(c),
                },
                (_, c) => value.push(c),
            }
        };
        labels.insert(key, value);
        rest = after[end + 1..].trim_start();
        rest = rest.strip_prefix(',').unwrap_or(rest).trim_start();
    }
    Some(labels)
}

/// Rounds to `digits` decimals so status does not churn on noise.
fn round(value: f64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits);
    (value * scale).round() / scale
}

/// Decode tokens per second and the share of expert lookups served by each tier.
pub fn live_figures(samples: &[Sample]) -> LiveFigures {
    let decode_tokens_per_second = samples
        .iter()
        .find(|s| s.name == glmflash_metric_names::DECODE_TOKENS_PER_SECOND)
        .map(|s| s.value)
        .filter(|v| v.is_finite())
        .map(|v| round(v, 1));

    let mut per_tier: BTreeMap<String, f64> = BTreeMap::new();
    for s in samples
        .iter()
        .filter(|s| s.name == glmflash_metric_names::EXPERT_LOOKUPS_TOTAL)
        .filter(|s| s.value.is_finite() && s.value >= 0.0)
    {
        if let Some(tier) = s.labels.get("tier") {
            *per_tier.entry(tier.clone()).or_default() += s.value;
        }
    }
    let total: f64 = per_tier.values().sum();
    let hit_rate = if total > 0.0 {
        per_tier
            .into_iter()
            .map(|(tier, n)| (tier, round(n / total, 3)))
            .collect()
    } else {
        BTreeMap::new()
    };
    let pin_failures = sum(samples, glmflash_metric_names::PIN_FAILURES_TOTAL, |_| true);
    LiveFigures {
        decode_tokens_per_second,
        hit_rate,
        pin_failures,
        plan: plan_figures(samples),
        requests: sum(samples, glmflash_metric_names::REQUESTS_TOTAL, |s| {
            s.labels
                .get("endpoint")
                .is_some_and(|e| COMPLETION_ENDPOINTS.contains(&e.as_str()))
        }),
        active_requests: [
            glmflash_metric_names::RUNNING_REQUESTS,
            glmflash_metric_names::WAITING_REQUESTS,
        ]
        .into_iter()
        .filter_map(|name| sum(samples, name, |_| true))
        .reduce(|a, b| a + b),
    }
}

/// The endpoints whose requests are work for the model: probes and scrapes are not, so
/// they never keep a server from going idle.
const COMPLETION_ENDPOINTS: [&str; 2] = ["/v1/chat/completions", "/v1/completions"];

/// The sum of the samples of `name` that `keep` accepts; `None` when there are none.
fn sum(samples: &[Sample], name: &str, keep: impl Fn(&Sample) -> bool) -> Option<u64> {
    samples
        .iter()
        .filter(|s| s.name == name && s.value.is_finite() && s.value >= 0.0 && keep(s))
        .map(|s| s.value as u64)
        .reduce(|a, b| a + b)
}

/// The server's memory plan from its `glmflash_plan_*` gauges; `None` when it exports none
/// (an untiered server plans no tiers).
fn plan_figures(samples: &[Sample]) -> Option<PlanFigures> {
    let gauge = |name: &str, label: &str, value: &str| {
        samples
            .iter()
            .find(|s| s.name == name && s.labels.get(label).is_some_and(|v| v == value))
            .map(|s| s.value)
            .filter(|v| v.is_finite() && *v >= 0.0)
            .map(|v| v as u64)
    };
    let slots = |tier| gauge(glmflash_metric_names::PLAN_EXPERT_SLOTS, "tier", tier);
    let plan = PlanFigures {
        vram_expert_slots: slots("vram"),
        ram_expert_slots: slots("ram"),
        store_bytes: gauge(glmflash_metric_names::PLAN_MEMORY_BYTES, "kind", "store"),
    };
    (plan != PlanFigures::default()).then_some(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = r#"
# HELP glmflash_expert_lookups_total Expert lookups.
# TYPE glmflash_expert_lookups_total counter
glmflash_expert_lookups_total{tier="vram",phase="decode"} 600
glmflash_expert_lookups_total{tier="vram",phase="prefill"} 200
glmflash_expert_lookups_total{phase="decode",tier="ram"} 150
glmflash_expert_lookups_total{tier="nvme",phase="decode"} 50 1700000000000
glmflash_decode_tokens_per_second 19.4712
glmflash_nvme_read_seconds_bucket{le="+Inf"} 3
weird line without value
glmflash_requests_total{endpoint="/v1/chat/completions",status="200",note="a \"quoted\", value"} 7
"#;

    #[test]
    fn parses_names_labels_values_and_skips_junk() {
        let samples = parse_exposition(PAGE);
        assert_eq!(samples.len(), 7);
        assert_eq!(samples[2].labels["tier"], "ram");
        assert_eq!(samples[3].value, 50.0);
        assert_eq!(samples[5].labels["le"], "+Inf");
        assert_eq!(samples[5].value, 3.0);
        assert_eq!(samples[6].labels["note"], r#"a "quoted", value"#);
        assert_eq!(samples[6].labels["status"], "200");
    }

    #[test]
    fn figures_are_shares_of_all_lookups_rounded() {
        let figures = live_figures(&parse_exposition(PAGE));
        assert_eq!(figures.decode_tokens_per_second, Some(19.5));
        assert_eq!(figures.hit_rate["vram"], 0.8);
        assert_eq!(figures.hit_rate["ram"], 0.15);
        assert_eq!(figures.hit_rate["nvme"], 0.05);
    }

    #[test]
    fn refused_pinning_is_counted() {
        let figures = live_figures(&parse_exposition("glmflash_pin_failures_total 3\n"));
        assert_eq!(figures.pin_failures, Some(3));
        assert_eq!(live_figures(&parse_exposition(PAGE)).pin_failures, None);
    }

    #[test]
    fn the_servers_plan_is_read_from_its_gauges() {
        let page = "glmflash_plan_expert_slots{tier=\"vram\"} 1008\n\
                    glmflash_plan_expert_slots{tier=\"ram\"} 2646\n\
                    glmflash_plan_expert_slots{tier=\"nvme\"} 12096\n\
                    glmflash_plan_memory_bytes{kind=\"vram_cache\"} 5000\n\
                    glmflash_plan_memory_bytes{kind=\"store\"} 171229298688\n";
        let plan = live_figures(&parse_exposition(page)).plan.unwrap();
        assert_eq!(
            plan,
            PlanFigures {
                vram_expert_slots: Some(1008),
                ram_expert_slots: Some(2646),
                store_bytes: Some(171_229_298_688),
            }
        );
        assert_eq!(live_figures(&parse_exposition(PAGE)).plan, None);
    }

    #[test]
    fn no_lookups_means_no_hit_rates() {
        let figures = live_figures(&parse_exposition("glmflash_decode_tokens_total 0\n"));
        assert_eq!(figures, LiveFigures::default());
    }

    #[test]
    fn completion_requests_count_and_probes_do_not() {
        let page = "glmflash_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} 5\n\
                    glmflash_requests_total{endpoint=\"/v1/chat/completions\",status=\"400\"} 1\n\
                    glmflash_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 2\n\
                    glmflash_requests_total{endpoint=\"/metrics\",status=\"200\"} 90\n\
                    glmflash_requests_total{endpoint=\"/health\",status=\"200\"} 40\n\
                    glmflash_running_requests 2\n\
                    glmflash_waiting_requests 1\n";
        let figures = live_figures(&parse_exposition(page));
        assert_eq!(figures.requests, Some(8));
        assert_eq!(figures.active_requests, Some(3));
        let idle = live_figures(&parse_exposition("glmflash_running_requests 0\n"));
        assert_eq!((idle.requests, idle.active_requests), (None, Some(0)));
    }

    #[tokio::test]
    async fn http_scraper_reads_a_real_server_and_reports_errors() {
        use axum::{Router, routing::get};
        let app = Router::new().route("/metrics", get(|| async { PAGE }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move { axum::serve(listener, app).await });

        let scraper = HttpScraper::new(Duration::from_secs(5));
        let text = scraper
            .fetch(format!("http://{addr}/metrics"))
            .await
            .unwrap();
        assert_eq!(text, PAGE);
        let missing = scraper.fetch(format!("http://{addr}/nope")).await;
        assert!(missing.unwrap_err().contains("404"));
        server.abort();
    }
}
