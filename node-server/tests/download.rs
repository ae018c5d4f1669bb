//! `glmflash-node download` against a local Hub look-alike (`e2e/hub_server.py`): full
//! download through redirects, a killed download resumed to identical bytes, a dropped
//! connection resumed within one run, a corrupted file refused, 401 and a missing revision.

use rand::{RngCore, SeedableRng};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";
const TOKEN: &str = "hf_test_token";

struct Server {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    fn start(root: &Path, log: PathBuf, extra: &[&str]) -> Server {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../e2e/hub_server.py");
        let mut child = Command::new("python3")
            .arg(script)
            .arg("--root")
            .arg(root)
            .args(["--token", TOKEN])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("python3 runs e2e/hub_server.py");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port = line
            .trim()
            .strip_prefix("listening ")
            .unwrap_or_else(|| panic!("hub_server said {line:?}"))
            .parse()
            .unwrap();
        Server { child, port, log }
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn requests(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(&self.log)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }
}

/// A repo with two weight shards (served through the CDN redirect), configs, a tokenizer
/// and files the download must skip.
fn make_repo(root: &Path) -> Vec<(String, Vec<u8>)> {
    let dir = root.join("org/model").join(COMMIT);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        root.join("org/model/refs.json"),
        format!(r#"{{"main": "{COMMIT}", "v1": "{COMMIT}"}}"#),
    )
    .unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let mut blob = |n: usize| {
        let mut v = vec![0u8; n];
        rng.fill_bytes(&mut v);
        v
    };
    let files = vec![
        (
            "config.json".to_string(),
            br#"{"model_type": "glm5_next"}"#.to_vec(),
        ),
        (
            "tokenizer.json".to_string(),
            br#"{"version": "1.0"}"#.to_vec(),
        ),
        (
            "model-00001-of-00002.safetensors".to_string(),
            blob(3 << 20),
        ),
        (
            "model-00002-of-00002.safetensors".to_string(),
            blob(2 << 20),
        ),
        (
            "model.safetensors.index.json".to_string(),
            br#"{"weight_map": {}}"#.to_vec(),
        ),
    ];
    for (name, data) in &files {
        std::fs::write(dir.join(name), data).unwrap();
    }
    std::fs::write(dir.join("README.md"), "# skipped").unwrap();
    std::fs::write(dir.join(".gitattributes"), "*.safetensors filter=lfs").unwrap();
    files
}

fn download(server: &Server, dir: &Path, token_file: Option<&Path>, rev: &str) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_glmflash-node"));
    cmd.args([
        "download",
        "--repo",
        "org/model",
        "--revision",
        rev,
        "--dir",
    ])
    .arg(dir)
    .env("HF_ENDPOINT", server.endpoint())
    .env_remove("HF_TOKEN")
    .env("GLMFLASH_DOWNLOAD_RETRIES", "3");
    if let Some(f) = token_file {
        cmd.arg("--token-file").arg(f);
    }
    cmd
}

fn run(mut cmd: Command) -> Output {
    let out = cmd.output().unwrap();
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    out
}

fn assert_same(dir: &Path, files: &[(String, Vec<u8>)]) {
    for (name, data) in files {
        let got = std::fs::read(dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(got == *data, "{name} differs");
        assert!(
            !dir.join(format!("{name}.part")).exists(),
            "{name}.part left"
        );
    }
    assert!(!dir.join("README.md").exists());
    assert!(!dir.join(".gitattributes").exists());
}

#[test]
fn full_download_then_a_rerun_fetches_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let files = make_repo(&tmp.path().join("hub"));
    let server = Server::start(&tmp.path().join("hub"), tmp.path().join("log"), &[]);
    let token = tmp.path().join("token");
    std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
    let out_dir = tmp.path().join("out");

    let out = run(download(&server, &out_dir, Some(&token), "main"));
    assert!(out.status.success());
    assert_same(&out_dir, &files);
    let reqs = server.requests();
    // The weights went through the CDN redirect.
    assert!(
        reqs.iter()
            .any(|r| r["path"].as_str().unwrap().starts_with("/cdn/") && r["status"] == 200)
    );
    assert!(reqs.iter().all(|r| r["status"] != 401));

    // The token also works from HF_TOKEN; a complete directory costs one info request.
    let before = reqs.len();
    let mut cmd = download(&server, &out_dir, None, "v1");
    cmd.env("HF_TOKEN", TOKEN);
    let out = run(cmd);
    assert!(out.status.success());
    let reqs = server.requests();
    assert_eq!(reqs.len(), before + 1, "{:?}", &reqs[before..]);
    assert!(
        reqs[before]["path"]
            .as_str()
            .unwrap()
            .starts_with("/api/models/org/model/revision/v1")
    );
    assert_same(&out_dir, &files);
}

#[test]
fn a_killed_download_resumes_to_identical_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let files = make_repo(&tmp.path().join("hub"));
    // 1 MiB/s: the 3 MiB shard takes about three seconds.
    let server = Server::start(
        &tmp.path().join("hub"),
        tmp.path().join("log"),
        &["--throttle-bps", "1048576"],
    );
    let token = tmp.path().join("token");
    std::fs::write(&token, TOKEN).unwrap();
    let out_dir = tmp.path().join("out");

    let mut child = download(&server, &out_dir, Some(&token), "main")
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let part = out_dir.join("model-00001-of-00002.safetensors.part");
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::fs::metadata(&part).map_or(0, |m| m.len()) < 1 << 20 {
        assert!(
            Instant::now() < deadline,
            "no progress on {}",
            part.display()
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "finished before the kill"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap(); // SIGKILL: no cleanup runs
    child.wait().unwrap();
    let kept = std::fs::metadata(&part).unwrap().len();
    assert!((1 << 20..3 << 20).contains(&kept), "{kept}");
    assert!(!out_dir.join("model-00001-of-00002.safetensors").exists());

    let out = run(download(&server, &out_dir, Some(&token), "main"));
    assert!(out.status.success());
    assert_same(&out_dir, &files);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("resumed at"), "{stderr}");
    // The rerun asked for the rest of the shard only.
    let ranged: Vec<_> = server
        .requests()
        .into_iter()
        .filter(|r| r["range"].is_string() && r["path"].as_str().unwrap().starts_with("/cdn/"))
        .collect();
    assert!(!ranged.is_empty());
    let from: u64 = ranged[0]["range"].as_str().unwrap()["bytes=".len()..]
        .trim_end_matches('-')
        .parse()
        .unwrap();
    assert!(from >= kept, "range from {from}, kept {kept}");
    assert_eq!(ranged[0]["status"], 206);
}

#[test]
fn a_dropped_connection_resumes_within_the_run() {
    let tmp = tempfile::tempdir().unwrap();
    let files = make_repo(&tmp.path().join("hub"));
    let server = Server::start(
        &tmp.path().join("hub"),
        tmp.path().join("log"),
        &["--drop-after", "1000000"],
    );
    let token = tmp.path().join("token");
    std::fs::write(&token, TOKEN).unwrap();
    let out_dir = tmp.path().join("out");
    let out = run(download(&server, &out_dir, Some(&token), "main"));
    assert!(out.status.success());
    assert_same(&out_dir, &files);
    let ranged = server
        .requests()
        .into_iter()
        .filter(|r| {
            r["range"].as_str() == Some("bytes=1000000-")
                && r["path"].as_str().unwrap().starts_with("/cdn/")
        })
        .count();
    assert_eq!(ranged, 2, "each shard resumed once at the drop point");
}

#[test]
fn a_corrupted_file_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    make_repo(&tmp.path().join("hub"));
    let server = Server::start(
        &tmp.path().join("hub"),
        tmp.path().join("log"),
        &["--corrupt", "model-00002-of-00002.safetensors"],
    );
    let token = tmp.path().join("token");
    std::fs::write(&token, TOKEN).unwrap();
    let out_dir = tmp.path().join("out");
    let out = run(download(&server, &out_dir, Some(&token), "main"));
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("checksum mismatch"), "{stderr}");
    assert!(!out_dir.join("model-00002-of-00002.safetensors").exists());
    assert!(
        !out_dir
            .join("model-00002-of-00002.safetensors.part")
            .exists()
    );
}

#[test]
fn refused_token_and_missing_revision_say_so() {
    let tmp = tempfile::tempdir().unwrap();
    make_repo(&tmp.path().join("hub"));
    let server = Server::start(&tmp.path().join("hub"), tmp.path().join("log"), &[]);
    let out_dir = tmp.path().join("out");

    let out = run(download(&server, &out_dir, None, "main"));
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("401"), "{stderr}");
    assert!(
        stderr.contains("--token-file") && stderr.contains("HF_TOKEN"),
        "{stderr}"
    );

    let wrong = tmp.path().join("wrong");
    std::fs::write(&wrong, "hf_wrong").unwrap();
    let out = run(download(&server, &out_dir, Some(&wrong), "main"));
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("refused the token"), "{stderr}");

    let token = tmp.path().join("token");
    std::fs::write(&token, TOKEN).unwrap();
    let out = run(download(&server, &out_dir, Some(&token), "no-such-branch"));
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("revision \"no-such-branch\" not found"),
        "{stderr}"
    );
    // Nothing was written for a failed lookup.
    assert!(!out_dir.exists() || std::fs::read_dir(&out_dir).unwrap().next().is_none());
}
