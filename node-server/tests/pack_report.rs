//! `pack-store --report FILE`: the JSON the operator reads from the pack-store Job's
//! termination message (`storeBytes`, the store's size on disk).

use std::process::Command;

#[test]
fn pack_store_report_gives_the_store_size() {
    // O_DIRECT needs a disk filesystem: the target dir, not a tmpfs /tmp.
    let tmp = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let (model, store, report) = (
        tmp.path().join("model"),
        tmp.path().join("store"),
        tmp.path().join("termination-log"),
    );
    let node = env!("CARGO_BIN_EXE_glmflash-node");
    let out = Command::new(node)
        .args(["make-demo-model", "--out"])
        .arg(&model)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for run in 0..2 {
        let out = Command::new(node)
            .args(["pack-store", "--verify-sample", "4", "--model"])
            .arg(&model)
            .arg("--store")
            .arg(&store)
            .arg("--report")
            .arg(&report)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
        let on_disk: u64 = std::fs::read_dir(&store)
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap())
            .filter(|m| m.is_file())
            .map(|m| m.len())
            .sum();
        assert!(on_disk > 0);
        assert_eq!(
            json["storeBytes"].as_u64(),
            Some(on_disk),
            "run {run}: {json}"
        );
        assert!(json["records"].as_u64().unwrap() > 0, "{json}");
        assert_eq!(json["fingerprint"].as_str().unwrap().len(), 64, "{json}");
    }
}
