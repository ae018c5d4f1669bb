//! `glmflash-node download`: fetch a checkpoint from the Hugging Face Hub into a directory.
//!
//! Resumable and verified: each file streams into `NAME.part` (a rerun or a retry after a
//! dropped connection continues it with an HTTP `Range` request), is checked against the
//! hash the Hub lists (the LFS sha256 for weights, the git blob sha1 for small files, else
//! the sha256 `ETag`), and only then renamed into place. A manifest (`.glmflash-download.json`)
//! records what was verified, so a rerun over a complete directory makes no file requests.
//! `HF_ENDPOINT` points it at a mirror (or the test server in `e2e/hub_server.py`).

use anyhow::{Context, anyhow, bail};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use reqwest::StatusCode;
use reqwest::Url;
use reqwest::blocking::{Client, Response};
use serde::{Deserialize, Serialize};
use sha1::Sha1;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const MANIFEST: &str = ".glmflash-download.json";

#[derive(clap::Args, Debug, Clone)]
pub struct DownloadArgs {
    /// Hub model repository, ORG/NAME.
    #[arg(long, env = "GLMFLASH_HF_REPO")]
    pub repo: String,
    /// Branch, tag or commit; files are fetched at the commit it resolves to.
    #[arg(long, env = "GLMFLASH_HF_REVISION", default_value = "main")]
    pub revision: String,
    /// Destination directory (created); files keep their names from the repo.
    #[arg(long, visible_alias = "out", env = "GLMFLASH_DOWNLOAD_DIR")]
    pub dir: PathBuf,
    /// File holding the access token (gated or private repos); wins over HF_TOKEN.
    #[arg(long, env = "GLMFLASH_HF_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// Access token (gated or private repos).
    #[arg(long, env = "HF_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Hub base URL.
    #[arg(long, env = "HF_ENDPOINT", default_value = "https://huggingface.co")]
    pub endpoint: String,
    /// Attempts per file; each one resumes where the last stopped.
    #[arg(long, env = "GLMFLASH_DOWNLOAD_RETRIES", default_value_t = 5)]
    pub retries: u32,
}

/// What a run did.
#[derive(Debug, Default)]
pub struct DownloadReport {
    pub commit: String,
    pub files: usize,
    pub fetched_files: usize,
    pub fetched_bytes: u64,
    pub resumed_files: usize,
}

/// The Hub's answer to `/api/models/{repo}/revision/{rev}?blobs=true`.
#[derive(Deserialize)]
struct RepoInfo {
    sha: String,
    #[serde(default)]
    siblings: Vec<Sibling>,
}

#[derive(Deserialize)]
struct Sibling {
    rfilename: String,
    size: Option<u64>,
    #[serde(rename = "blobId")]
    blob_id: Option<String>,
    lfs: Option<Lfs>,
}

#[derive(Deserialize)]
struct Lfs {
    sha256: String,
    size: u64,
}

/// The hash a file is checked against.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "kind", content = "hex")]
enum Expected {
    Sha256(String),
    /// Git blob id: sha1 of `blob {len}\0` + content.
    GitSha1(String),
}

#[derive(Default, Serialize, Deserialize)]
struct Manifest {
    repo: String,
    commit: String,
    /// File name -> (size, hash) it was verified against.
    files: BTreeMap<String, (u64, Option<Expected>)>,
}

/// Files a checkpoint needs: weights, configs, tokenizer, chat template (top level only).
fn wanted(name: &str) -> bool {
    if name.contains('/') || name.starts_with('.') {
        return false;
    }
    [".safetensors", ".json", ".jinja", ".model", ".tiktoken"]
        .iter()
        .any(|ext| name.ends_with(ext))
        || matches!(name, "merges.txt" | "vocab.txt")
}

struct Hub {
    client: Client,
    endpoint: Url,
    token: Option<String>,
    repo: String,
}

impl Hub {
    fn url(&self, tail: &[&str]) -> Url {
        let mut url = self.endpoint.clone();
        url.path_segments_mut()
            .expect("an http(s) endpoint has a path")
            .pop_if_empty()
            .extend(tail);
        url
    }

    fn get(&self, url: Url, range_from: u64) -> reqwest::Result<Response> {
        let mut req = self.client.get(url);
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        if range_from > 0 {
            req = req.header(reqwest::header::RANGE, format!("bytes={range_from}-"));
        }
        req.send()
    }

    /// A clear error for a refused request.
    fn error(&self, resp: Response, what: &str) -> anyhow::Error {
        let status = resp.status();
        let header = |name: &str| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string()
        };
        let code = header("x-error-code");
        let mut message = header("x-error-message");
        if message.is_empty() {
            message = resp.text().unwrap_or_default();
            message.truncate(300);
        }
        let repo = &self.repo;
        match (status, code.as_str()) {
            (StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN, _) if self.token.is_some() => {
                anyhow!(
                    "{repo}: the Hub refused the token ({status} {code}: {message}); check that it \
                 is valid and, for a gated repo, that its account accepted the repo's terms"
                )
            }
            (StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN, _) => anyhow!(
                "{repo}: access denied ({status} {code}): the repo is gated or private, or does \
                 not exist; pass a token with --token-file FILE or the HF_TOKEN environment variable"
            ),
            (StatusCode::NOT_FOUND, "RevisionNotFound") => {
                anyhow!("{repo}: {what} not found: no such branch, tag or commit ({message})")
            }
            (StatusCode::NOT_FOUND, "RepoNotFound") => {
                anyhow!("{repo}: no such model repo ({message})")
            }
            (StatusCode::NOT_FOUND, _) => anyhow!("{repo}: {what} not found ({status} {message})"),
            _ => anyhow!("{repo}: {what}: HTTP {status} {code} {message}"),
        }
    }
}

fn read_token(args: &DownloadArgs) -> anyhow::Result<Option<String>> {
    let token = match &args.token_file {
        Some(path) => Some(
            fs::read_to_string(path)
                .with_context(|| format!("reading the token file {}", path.display()))?,
        ),
        None => args.token.clone(),
    };
    Ok(token
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty()))
}

/// Download the checkpoint files of `args.repo` at `args.revision` into `args.dir`.
pub fn download(args: &DownloadArgs) -> anyhow::Result<DownloadReport> {
    let Some((org, name)) = args.repo.split_once('/') else {
        bail!("--repo must be ORG/NAME, got {:?}", args.repo);
    };
    let endpoint = Url::parse(&args.endpoint)
        .with_context(|| format!("HF_ENDPOINT / --endpoint {:?} is not a URL", args.endpoint))?;
    if endpoint.cannot_be_a_base() {
        bail!("--endpoint {} is not an http(s) base URL", args.endpoint);
    }
    let hub = Hub {
        client: Client::builder()
            .connect_timeout(Duration::from_secs(30))
            // Shards are gigabytes: no overall deadline; keepalive notices a dead peer.
            .timeout(None)
            .tcp_keepalive(Duration::from_secs(60))
            .user_agent(concat!("glmflash-node/", env!("CARGO_PKG_VERSION")))
            .build()?,
        endpoint,
        token: read_token(args)?,
        repo: args.repo.clone(),
    };

    let info_url = hub.url(&["api", "models", org, name, "revision", &args.revision]);
    let mut info_url_blobs = info_url.clone();
    info_url_blobs
        .query_pairs_mut()
        .append_pair("blobs", "true");
    let resp = hub
        .get(info_url_blobs, 0)
        .with_context(|| format!("asking {info_url} for the file list"))?;
    if !resp.status().is_success() {
        return Err(hub.error(resp, &format!("revision {:?}", args.revision)));
    }
    let body = resp
        .bytes()
        .with_context(|| format!("reading {info_url}"))?;
    let info: RepoInfo = serde_json::from_slice(&body)
        .with_context(|| format!("{info_url}: not the Hub's repo info JSON"))?;
    let files: Vec<&Sibling> = info
        .siblings
        .iter()
        .filter(|s| wanted(&s.rfilename))
        .collect();
    if !files.iter().any(|s| s.rfilename.ends_with(".safetensors")) {
        bail!(
            "{}@{}: no .safetensors files at the top level of the repo",
            args.repo,
            args.revision
        );
    }

    fs::create_dir_all(&args.dir).with_context(|| format!("creating {}", args.dir.display()))?;
    let manifest_path = args.dir.join(MANIFEST);
    let mut manifest: Manifest = fs::read(&manifest_path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .filter(|m: &Manifest| m.repo == args.repo)
        .unwrap_or_default();
    manifest.repo = args.repo.clone();
    manifest.commit = info.sha.clone();

    // Plan: what is already there, what is left, and whether the disk can take it.
    let mut todo = Vec::new();
    let mut total = 0u64;
    let mut present = 0u64;
    for s in &files {
        let size = s.lfs.as_ref().map(|l| l.size).or(s.size);
        let expected = s
            .lfs
            .as_ref()
            .map(|l| Expected::Sha256(l.sha256.to_ascii_lowercase()))
            .or_else(|| s.blob_id.clone().map(Expected::GitSha1));
        total += size.unwrap_or(0);
        let path = args.dir.join(&s.rfilename);
        let recorded = manifest.files.get(&s.rfilename);
        let done = match (fs::metadata(&path), size) {
            (Ok(m), Some(size)) if m.len() == size => {
                recorded == Some(&(size, expected.clone()))
                    || (expected.is_some()
                        && hash_file(&path, expected.as_ref(), size)? == expected)
            }
            _ => false,
        };
        if done {
            present += size.unwrap_or(0);
            manifest
                .files
                .insert(s.rfilename.clone(), (size.unwrap_or(0), expected));
        } else {
            let part_len = fs::metadata(part_path(&path)).map_or(0, |m| m.len());
            present += part_len;
            todo.push((s, size, expected));
        }
    }
    write_manifest(&manifest_path, &manifest)?;
    let needed = total.saturating_sub(present);
    let stat = rustix::fs::statvfs(&args.dir)
        .with_context(|| format!("statvfs {}", args.dir.display()))?;
    let available = stat.f_bavail * stat.f_frsize;
    if needed > available {
        bail!(
            "{}: not enough free space: {:.2} GiB still to download, {:.2} GiB available",
            args.dir.display(),
            needed as f64 / (1u64 << 30) as f64,
            available as f64 / (1u64 << 30) as f64
        );
    }
    eprintln!(
        "{}@{} (commit {}): {} files, {:.1} MiB; {} to fetch, {:.1} MiB",
        args.repo,
        args.revision,
        info.sha,
        files.len(),
        total as f64 / 1048576.0,
        todo.len(),
        needed as f64 / 1048576.0
    );

    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template(
            "downloading [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta} {msg}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar.set_position(present);

    let mut report = DownloadReport {
        commit: info.sha.clone(),
        files: files.len(),
        ..DownloadReport::default()
    };
    for (s, size, expected) in todo {
        let path = args.dir.join(&s.rfilename);
        let url = hub.url(&[org, name, "resolve", &info.sha, &s.rfilename]);
        bar.set_message(s.rfilename.clone());
        let started = Instant::now();
        let mut attempt = 0;
        let outcome = loop {
            attempt += 1;
            match fetch_file(&hub, &url, &path, size, expected.as_ref(), &bar) {
                Ok(outcome) => break outcome,
                Err(Fetch::Fatal(e)) => return Err(e.context(format!("downloading {url}"))),
                Err(Fetch::Retry(e)) if attempt >= args.retries.max(1) => {
                    return Err(e.context(format!("downloading {url} ({attempt} attempts)")));
                }
                Err(Fetch::Retry(e)) => {
                    bar.suspend(|| {
                        eprintln!(
                            "{}: attempt {attempt} failed ({e:#}); resuming",
                            s.rfilename
                        )
                    });
                    std::thread::sleep(Duration::from_millis(500 << attempt.min(6)));
                }
            }
        };
        manifest
            .files
            .insert(s.rfilename.clone(), (outcome.len, outcome.verified));
        write_manifest(&manifest_path, &manifest)?;
        report.fetched_files += 1;
        report.fetched_bytes += outcome.fetched;
        report.resumed_files += usize::from(outcome.resumed_from > 0);
        bar.suspend(|| {
            eprintln!(
                "{}: {:.1} MiB{} in {:.1}s, {}",
                s.rfilename,
                outcome.len as f64 / 1048576.0,
                if outcome.resumed_from > 0 {
                    format!(" (resumed at {})", outcome.resumed_from)
                } else {
                    String::new()
                },
                started.elapsed().as_secs_f64(),
                if manifest.files[&s.rfilename].1.is_some() {
                    "hash verified"
                } else {
                    "size only: the Hub lists no hash"
                }
            )
        });
    }
    bar.finish_and_clear();
    Ok(report)
}

fn part_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".part");
    path.with_file_name(name)
}

fn write_manifest(path: &Path, manifest: &Manifest) -> anyhow::Result<()> {
    let tmp = path.with_extension("json.tmp");
    fs::write(&tmp, serde_json::to_vec_pretty(manifest)?)
        .with_context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

enum Fetch {
    /// Worth another attempt (network, server error, bad bytes).
    Retry(anyhow::Error),
    /// Will not change on retry (refused, not found, disk full).
    Fatal(anyhow::Error),
}

struct Fetched {
    len: u64,
    fetched: u64,
    resumed_from: u64,
    verified: Option<Expected>,
}

enum Hasher {
    Sha256(Sha256),
    GitSha1(Sha1),
}

impl Hasher {
    fn new(kind: Option<&Expected>, size: u64) -> Self {
        match kind {
            Some(Expected::GitSha1(_)) => {
                let mut h = Sha1::new();
                h.update(format!("blob {size}\0").as_bytes());
                Hasher::GitSha1(h)
            }
            _ => Hasher::Sha256(Sha256::new()),
        }
    }

    fn update(&mut self, bytes: &[u8]) {
        match self {
            Hasher::Sha256(h) => h.update(bytes),
            Hasher::GitSha1(h) => h.update(bytes),
        }
    }

    fn finish(self) -> Expected {
        match self {
            Hasher::Sha256(h) => Expected::Sha256(hex(&h.finalize())),
            Hasher::GitSha1(h) => Expected::GitSha1(hex(&h.finalize())),
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The hash of a file in the form `expected` asks for.
fn hash_file(
    path: &Path,
    expected: Option<&Expected>,
    size: u64,
) -> anyhow::Result<Option<Expected>> {
    let mut h = Hasher::new(expected, size);
    let mut f = File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(Some(h.finish()))
}

/// The sha256 an `ETag` names, when it is one (the Hub's ETag of an LFS file).
fn etag_sha256(resp: &Response) -> Option<Expected> {
    ["x-linked-etag", "etag"].iter().find_map(|name| {
        let v = resp.headers().get(*name)?.to_str().ok()?;
        let v = v
            .trim_start_matches("W/")
            .trim_matches('"')
            .to_ascii_lowercase();
        (v.len() == 64 && v.bytes().all(|b| b.is_ascii_hexdigit())).then_some(Expected::Sha256(v))
    })
}

fn fetch_file(
    hub: &Hub,
    url: &Url,
    path: &Path,
    size: Option<u64>,
    expected: Option<&Expected>,
    bar: &ProgressBar,
) -> Result<Fetched, Fetch> {
    let retry = |e: anyhow::Error| Fetch::Retry(e);
    let part = part_path(path);
    let io_fatal = |what: String| {
        move |e: std::io::Error| {
            if e.kind() == std::io::ErrorKind::StorageFull {
                Fetch::Fatal(anyhow!("{what}: the disk is full"))
            } else {
                Fetch::Fatal(anyhow::Error::new(e).context(what))
            }
        }
    };
    let mut have = fs::metadata(&part).map_or(0, |m| m.len());
    if size.is_some_and(|s| have > s) {
        have = 0;
    }
    let resp = hub
        .get(url.clone(), have)
        .map_err(|e| retry(anyhow::Error::new(e)))?;
    let status = resp.status();
    let resumed_from = match status {
        StatusCode::PARTIAL_CONTENT => {
            let start = resp
                .headers()
                .get(reqwest::header::CONTENT_RANGE)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("bytes "))
                .and_then(|v| v.split('-').next())
                .and_then(|v| v.parse::<u64>().ok());
            if start != Some(have) {
                let _ = fs::remove_file(&part);
                return Err(retry(anyhow!(
                    "asked for bytes {have}- and got a Content-Range starting at {start:?}"
                )));
            }
            have
        }
        StatusCode::OK => 0,
        StatusCode::RANGE_NOT_SATISFIABLE if size == Some(have) => have,
        StatusCode::RANGE_NOT_SATISFIABLE => {
            let _ = fs::remove_file(&part);
            return Err(retry(anyhow!(
                "the partial file is longer than the remote one"
            )));
        }
        s if s.is_server_error() || s == StatusCode::TOO_MANY_REQUESTS => {
            return Err(retry(anyhow!("HTTP {s}")));
        }
        _ => {
            let name = path.file_name().unwrap_or_default().to_string_lossy();
            return Err(Fetch::Fatal(hub.error(resp, &format!("file {name}"))));
        }
    };
    let expected = expected.cloned().or_else(|| etag_sha256(&resp));
    let total = size.or_else(|| resp.content_length().map(|l| l + resumed_from));

    let mut file = OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(resumed_from == 0)
        .open(&part)
        .map_err(io_fatal(format!("opening {}", part.display())))?;
    // The hash covers the kept prefix too.
    let mut hasher = Hasher::new(expected.as_ref(), total.unwrap_or(0));
    let mut buf = vec![0u8; 1 << 20];
    if resumed_from > 0 {
        let mut f = File::open(&part).map_err(io_fatal(format!("reading {}", part.display())))?;
        let mut left = resumed_from;
        while left > 0 {
            let n = f
                .read(&mut buf[..left.min(1 << 20) as usize])
                .map_err(io_fatal(format!("reading {}", part.display())))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            left -= n as u64;
        }
        file.set_len(resumed_from)
            .map_err(io_fatal(format!("truncating {}", part.display())))?;
    }
    use std::io::Seek;
    file.seek(std::io::SeekFrom::Start(resumed_from))
        .map_err(io_fatal(format!("seeking {}", part.display())))?;
    bar.set_position(bar.position().saturating_sub(have) + resumed_from);

    let mut len = resumed_from;
    let mut body = resp;
    if status != StatusCode::RANGE_NOT_SATISFIABLE {
        loop {
            let n = body
                .read(&mut buf)
                .map_err(|e| retry(anyhow::Error::new(e).context("reading the response")))?;
            if n == 0 {
                break;
            }
            file.write_all(&buf[..n])
                .map_err(io_fatal(format!("writing {}", part.display())))?;
            hasher.update(&buf[..n]);
            len += n as u64;
            bar.inc(n as u64);
        }
    }
    if let Some(total) = total
        && len != total
    {
        return Err(retry(anyhow!("got {len} of {total} bytes")));
    }
    let got = hasher.finish();
    if let Some(want) = &expected
        && &got != want
    {
        let _ = fs::remove_file(&part);
        bar.set_position(bar.position().saturating_sub(len));
        return Err(retry(anyhow!(
            "checksum mismatch: the Hub lists {want:?}, the bytes hash to {got:?}; the partial \
             file was discarded"
        )));
    }
    file.sync_all()
        .map_err(io_fatal(format!("syncing {}", part.display())))?;
    drop(file);
    fs::rename(&part, path).map_err(io_fatal(format!("renaming {}", part.display())))?;
    Ok(Fetched {
        len,
        fetched: len - resumed_from,
        resumed_from,
        verified: expected,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wanted_keeps_checkpoint_files_only() {
        for name in [
            "config.json",
            "model-00001-of-00002.safetensors",
            "model.safetensors.index.json",
            "tokenizer.json",
            "chat_template.jinja",
            "merges.txt",
        ] {
            assert!(wanted(name), "{name}");
        }
        for name in [
            "README.md",
            ".gitattributes",
            "pytorch_model.bin",
            "original/model.safetensors",
            "model.gguf",
        ] {
            assert!(!wanted(name), "{name}");
        }
    }

    #[test]
    fn git_blob_sha1_matches_git() {
        // `printf 'hello\n' | git hash-object --stdin`
        let mut h = Hasher::new(Some(&Expected::GitSha1(String::new())), 6);
        h.update(b"hello\n");
        assert_eq!(
            h.finish(),
            Expected::GitSha1("ce013625030ba8dba906f756967f9e9ca394464a".into())
        );
    }
}
