//! `glmflash-node gates --url URL`: the acceptance gates against a running server — load,
//! chat, reasoning, tools, context, speed — printed as a table; non-zero exit on a failure.
//!
//! Plain HTTP/1.0 over a TCP socket (in-cluster URLs; no TLS), so a streamed body ends when
//! the server closes it and needs no chunked decoding.

use anyhow::{Context, anyhow, bail};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

#[derive(clap::Args, Clone, Debug)]
pub struct GatesArgs {
    /// Base URL of the server, e.g. http://127.0.0.1:30000.
    #[arg(long, env = "GLMFLASH_GATES_URL")]
    pub url: String,
    /// The model id to expect and request.
    #[arg(long, env = "GLMFLASH_GATES_MODEL", default_value = "glm-5.3-flash")]
    pub model: String,
    /// Prompt length of the context gate, in tokens.
    #[arg(long, env = "GLMFLASH_GATES_CONTEXT_TOKENS", default_value_t = 93_437)]
    pub context_tokens: usize,
    /// Least decode speed of one stream over its first `--speed-seconds`.
    #[arg(long, env = "GLMFLASH_GATES_MIN_TOK_S", default_value_t = 15.0)]
    pub min_tok_s: f64,
    #[arg(long, env = "GLMFLASH_GATES_SPEED_SECONDS", default_value_t = 30.0)]
    pub speed_seconds: f64,
    /// API key, if the server wants one.
    #[arg(long, env = "GLMFLASH_API_KEY")]
    pub api_key: Option<String>,
    /// Seconds one non-streaming request may take.
    #[arg(long, env = "GLMFLASH_GATES_TIMEOUT", default_value_t = 1800)]
    pub timeout: u64,
    /// Sampling seed sent with every generating request, so a run of the gates is
    /// reproducible (an unseeded run samples differently each time: on a random demo model
    /// a natural end after no visible text is one of the outcomes).
    #[arg(long, env = "GLMFLASH_GATES_SEED", default_value_t = 0)]
    pub seed: u64,
}

/// `body` with the model and the seed of `args` added: what every generating gate sends.
fn request(args: &GatesArgs, body: Value) -> Value {
    let mut b = json!({"model": args.model, "seed": args.seed});
    b.as_object_mut()
        .expect("object")
        .extend(body.as_object().cloned().unwrap_or_default());
    b
}

struct Http {
    host: String,
    port: u16,
    key: Option<String>,
    timeout: Duration,
}

impl Http {
    fn new(url: &str, key: Option<String>, timeout: Duration) -> anyhow::Result<Http> {
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| anyhow!("--url must start with http:// (got {url})"))?;
        let authority = rest.split('/').next().unwrap_or_default();
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) => (h.to_string(), p.parse().context("the port of --url")?),
            None => (authority.to_string(), 80),
        };
        Ok(Http {
            host,
            port,
            key,
            timeout,
        })
    }

    /// Sends a request; returns the status and a reader positioned at the body.
    fn open(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> anyhow::Result<(u16, BufReader<TcpStream>)> {
        let stream = TcpStream::connect((self.host.as_str(), self.port))
            .with_context(|| format!("connecting to {}:{}", self.host, self.port))?;
        stream.set_read_timeout(Some(self.timeout))?;
        let payload = body.map(|b| b.to_string()).unwrap_or_default();
        let mut req = format!(
            "{method} {path} HTTP/1.0\r\nHost: {}\r\nAccept: */*\r\n",
            self.host
        );
        if let Some(k) = &self.key {
            req += &format!("Authorization: Bearer {k}\r\n");
        }
        if body.is_some() {
            req += &format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                payload.len()
            );
        }
        req += "\r\n";
        let mut w = stream.try_clone()?;
        w.write_all(req.as_bytes())?;
        w.write_all(payload.as_bytes())?;
        let mut r = BufReader::new(stream);
        let mut line = String::new();
        r.read_line(&mut line)?;
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| anyhow!("not an HTTP response: {line:?}"))?;
        loop {
            line.clear();
            if r.read_line(&mut line)? == 0 || line == "\r\n" || line == "\n" {
                break;
            }
        }
        Ok((status, r))
    }

    fn json(&self, method: &str, path: &str, body: Option<&Value>) -> anyhow::Result<Value> {
        let (status, mut r) = self.open(method, path, body)?;
        let mut text = String::new();
        r.read_to_string(&mut text)?;
        if status != 200 {
            bail!("HTTP {status}: {}", text.trim());
        }
        serde_json::from_str(&text).with_context(|| format!("a JSON body: {text:?}"))
    }
}

type Gate = (&'static str, anyhow::Result<String>);

pub fn run(args: &GatesArgs) -> anyhow::Result<bool> {
    let http = Http::new(
        &args.url,
        args.api_key.clone(),
        Duration::from_secs(args.timeout),
    )?;
    let chat = |body: Value| -> anyhow::Result<Value> {
        http.json("POST", "/v1/chat/completions", Some(&request(args, body)))
    };
    let mut gates: Vec<Gate> = Vec::new();

    gates.push((
        "load",
        (|| {
            let v = http.json("GET", "/v1/models", None)?;
            let ids: Vec<&str> = v["data"]
                .as_array()
                .map(|d| d.iter().filter_map(|m| m["id"].as_str()).collect())
                .unwrap_or_default();
            if ids.contains(&args.model.as_str()) {
                Ok(format!("lists {}", args.model))
            } else {
                bail!("{} not in {ids:?}", args.model)
            }
        })(),
    ));

    gates.push((
        "chat",
        (|| {
            let v = chat(json!({
                "messages": [{"role": "user", "content": "Name one planet of the solar system."}],
                "max_tokens": 256,
                "chat_template_kwargs": {"enable_thinking": false},
            }))?;
            let content = v["choices"][0]["message"]["content"].as_str().unwrap_or("");
            if content.trim().is_empty() {
                bail!("empty answer: {}", v["choices"][0]);
            }
            Ok(format!("{} chars", content.chars().count()))
        })(),
    ));

    gates.push((
        "reasoning",
        (|| {
            let v = chat(json!({
                "messages": [{"role": "user", "content": "Is 97 prime? Think first."}],
                "max_tokens": 1024,
                "chat_template_kwargs": {"enable_thinking": true},
            }))?;
            let r = v["choices"][0]["message"]["reasoning_content"]
                .as_str()
                .unwrap_or("");
            if r.trim().is_empty() {
                bail!("no reasoning_content: {}", v["choices"][0]["message"]);
            }
            Ok(format!("{} chars of reasoning", r.chars().count()))
        })(),
    ));

    gates.push((
        "tools",
        (|| {
            let v = chat(json!({
                "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                "tools": [{"type": "function", "function": {
                    "name": "get_weather",
                    "description": "Current weather of a city",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                   "required": ["city"]}}}],
                "tool_choice": "required",
                "max_tokens": 256,
            }))?;
            let call = &v["choices"][0]["message"]["tool_calls"][0]["function"];
            if call["name"] != "get_weather" {
                bail!("no get_weather call: {}", v["choices"][0]["message"]);
            }
            let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap_or(""))
                .context("tool call arguments are not JSON")?;
            if !args.is_object() {
                bail!("arguments are not a JSON object: {args}");
            }
            Ok(format!("get_weather({args})"))
        })(),
    ));

    gates.push((
        "context",
        (|| {
            // Token ids below 256 exist in every byte-level vocabulary.
            let prompt: Vec<u32> = (0..args.context_tokens)
                .map(|i| 32 + (i % 64) as u32)
                .collect();
            let started = Instant::now();
            let v = http.json(
                "POST",
                "/v1/completions",
                Some(&request(args, json!({"prompt": prompt, "max_tokens": 8}))),
            )?;
            let used = v["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
            let out = v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
            if used as usize != args.context_tokens || out == 0 {
                bail!(
                    "usage {} for a {}-token prompt",
                    v["usage"],
                    args.context_tokens
                );
            }
            Ok(format!(
                "{used} prompt tokens answered in {:.1}s",
                started.elapsed().as_secs_f64()
            ))
        })(),
    ));

    gates.push(("speed", speed(&http, args)));

    println!("{:<10} {:<6} detail", "gate", "result");
    let mut ok = true;
    for (name, r) in &gates {
        match r {
            Ok(d) => println!("{name:<10} {:<6} {d}", "PASS"),
            Err(e) => {
                ok = false;
                println!(
                    "{name:<10} {:<6} {}",
                    "FAIL",
                    format!("{e:#}").replace('\n', " ")
                );
            }
        }
    }
    Ok(ok)
}

/// One stream to its natural end (or `speed_seconds`), tokens counted from logprobs.
fn speed(http: &Http, args: &GatesArgs) -> anyhow::Result<String> {
    let body = request(
        args,
        json!({
            "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
            "stream": true,
            "logprobs": true,
        }),
    );
    let started = Instant::now();
    let (status, mut r) = http.open("POST", "/v1/chat/completions", Some(&body))?;
    if status != 200 {
        let mut text = String::new();
        let _ = r.read_to_string(&mut text);
        bail!("HTTP {status}: {}", text.trim());
    }
    let mut tokens = 0usize;
    let mut first: Option<Instant> = None;
    let mut line = String::new();
    let limit = Duration::from_secs_f64(args.speed_seconds);
    loop {
        line.clear();
        if r.read_line(&mut line)? == 0 {
            break;
        }
        let Some(data) = line.trim_end().strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(data)?;
        if v.get("error").is_some() {
            bail!("stream error: {v}");
        }
        let n = v["choices"][0]["logprobs"]["content"]
            .as_array()
            .map_or(0, Vec::len);
        if n > 0 && first.is_none() {
            first = Some(Instant::now());
        }
        tokens += n;
        if started.elapsed() >= limit {
            break;
        }
    }
    let Some(first) = first else {
        bail!("no tokens streamed");
    };
    let decode_s = first.elapsed().as_secs_f64().max(1e-6);
    let tok_s = tokens.saturating_sub(1) as f64 / decode_s;
    let ttft = (first - started).as_secs_f64();
    let detail = format!(
        "{tok_s:.1} tok/s over {tokens} tokens (TTFT {ttft:.2}s, need >= {})",
        args.min_tok_s
    );
    if tokens < 2 || tok_s < args.min_tok_s {
        bail!("{detail}");
    }
    Ok(detail)
}
