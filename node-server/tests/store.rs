//! The expert store end to end: pack a small random checkpoint on a disk filesystem, read it
//! back through both engines, and break it every way issue 3 lists.

use glmflash_node::model::checkpoint::{Checkpoint, DType};
use glmflash_node::model::config::Config;
use glmflash_node::model::loader::Loader;
use glmflash_node::model::moe::load_expert;
use glmflash_node::model::random::{scaled_config, write_random_checkpoint};
use glmflash_node::store::{
    self, ChecksumPolicy, EngineChoice, Manifest, PackOptions, PackOutcome, PartFormat,
    ReadErrorKind, ReaderOptions, RecordFormat, StoreError, StoreReader, VerifyOptions,
};
use glmflash_node::tiers::source::expert_from_record;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// hidden 256, 4 layers (1 dense), 16 experts of width 256: 48 records of 384 KiB.
fn make_model(dir: &Path, seed: u64, width: usize, dtype: DType) -> Config {
    let cfg = scaled_config(64, 256, 4, 1, 16, width, 2);
    write_random_checkpoint(dir, &cfg, seed, dtype).expect("random checkpoint")
}

struct Fixture {
    _tmp: tempfile::TempDir,
    model: PathBuf,
    store: PathBuf,
    cfg: Config,
}

fn quiet() -> PackOptions {
    PackOptions {
        progress: false,
        ..PackOptions::default()
    }
}

/// Under cargo's target dir, which sits on the repository's disk filesystem (/tmp may be a
/// tmpfs, which refuses O_DIRECT before Linux 6.6).
fn disk_tempdir() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir")
}

fn fixture_with(seed: u64, width: usize, dtype: DType) -> Fixture {
    let tmp = disk_tempdir();
    let model = tmp.path().join("model");
    let store = tmp.path().join("store");
    let cfg = make_model(&model, seed, width, dtype);
    Fixture {
        _tmp: tmp,
        model,
        store,
        cfg,
    }
}

fn packed() -> Fixture {
    let f = fixture_with(7, 256, DType::Bf16);
    let report = store::pack_store(&f.model, &f.store, &quiet()).expect("pack");
    assert_eq!(report.outcome, PackOutcome::Packed);
    assert_eq!(report.records, 48);
    let v = report.verify.expect("verified after packing");
    assert_eq!(v.records, 48);
    assert_eq!(
        v.compared, 48,
        "fewer records than the sample: all compared"
    );
    f
}

fn flip_byte(path: &Path, offset: u64) {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8];
    file.read_exact_at(&mut b, offset).unwrap();
    b[0] ^= 0x5a;
    file.write_all_at(&b, offset).unwrap();
    file.sync_all().unwrap();
}

fn reader(store: &Path, engine: EngineChoice) -> StoreReader {
    reader_with(
        store,
        ReaderOptions {
            engine,
            queue_depth: 8,
            registered_buffers: 8,
            ..ReaderOptions::default()
        },
    )
}

fn reader_with(store: &Path, options: ReaderOptions) -> StoreReader {
    StoreReader::open(store, None, options).expect("open store")
}

/// Readers of `store` with `options` through each engine (io_uring, then pread).
fn both_engines(store: &Path, options: ReaderOptions) -> [(EngineChoice, StoreReader); 2] {
    [EngineChoice::Uring, EngineChoice::Pread].map(|engine| {
        let options = ReaderOptions {
            engine,
            ..options.clone()
        };
        (engine, reader_with(store, options))
    })
}

#[test]
fn every_record_rebuilds_the_expert_bit_for_bit_through_both_engines() {
    let f = packed();
    let ckpt = Checkpoint::open(&f.model).unwrap();
    let vb = Loader::new(&ckpt);
    let manifest = Manifest::load(&f.store).unwrap();
    assert_eq!(manifest.record_size % 4096, 0);
    let keys: Vec<(usize, usize)> = manifest
        .records
        .iter()
        .map(|r| (r.layer, r.expert))
        .collect();
    assert_eq!(keys.len(), 48);
    for engine in [EngineChoice::Uring, EngineChoice::Pread] {
        let r = reader(&f.store, engine);
        assert_eq!(
            r.engine_name(),
            if engine == EngineChoice::Uring {
                "io_uring"
            } else {
                "pread"
            }
        );
        assert_eq!(r.fixed_buffers(), engine == EngineChoice::Uring);
        // More keys than registered buffers: the rest read into buffers of their own.
        let records = r.read_many(&keys);
        for (&(l, e), rec) in keys.iter().zip(records) {
            let rec = rec.expect("record reads");
            let got = expert_from_record(&rec, f.cfg.swiglu_limit).unwrap();
            let want = load_expert(&f.cfg, vb.pp(&format!("layers.{l}.mlp.experts")), e).unwrap();
            for (g, w) in [
                (&got.gate, &want.gate),
                (&got.up, &want.up),
                (&got.down, &want.down),
            ] {
                assert_eq!(
                    (g.rows(), g.cols(), g.format()),
                    (w.rows(), w.cols(), w.format())
                );
                assert_eq!(
                    g.to_bytes(),
                    w.to_bytes(),
                    "layer {l} expert {e} via {engine:?}"
                );
            }
            assert_eq!(got.limit, want.limit);
        }
    }
}

#[test]
fn a_quantized_checkpoint_packs_in_its_serving_format() {
    let f = fixture_with(11, 256, DType::Bf16);
    let q4k = f.model.with_file_name("model-q4k");
    glmflash_node::model::convert::convert_experts(
        &f.model,
        &q4k,
        glmflash_node::quant::Format::Q4K,
        |_, _| {},
    )
    .unwrap();
    store::pack_store(&q4k, &f.store, &quiet()).unwrap();
    let m = Manifest::load(&f.store).unwrap();
    assert_eq!(
        m.parts.gate.format,
        PartFormat::Rows(glmflash_node::quant::Format::Q4K)
    );
    assert_records_match(&f, &q4k, glmflash_node::quant::Format::Q4K);
}

/// A sample of the store's records rebuild, in `format`, exactly the experts of the
/// checkpoint in `dir`.
fn assert_records_match(f: &Fixture, dir: &Path, format: glmflash_node::quant::Format) {
    let ckpt = Checkpoint::open(dir).unwrap();
    let r = reader(&f.store, EngineChoice::Auto);
    for (l, e) in [(1, 0), (2, 15), (3, 8)] {
        let got = expert_from_record(&r.read(l, e).unwrap(), f.cfg.swiglu_limit).unwrap();
        let want = load_expert(
            &f.cfg,
            Loader::new(&ckpt).pp(&format!("layers.{l}.mlp.experts")),
            e,
        )
        .unwrap();
        for (g, w) in [
            (&got.gate, &want.gate),
            (&got.up, &want.up),
            (&got.down, &want.down),
        ] {
            assert_eq!((g.format(), w.format()), (Some(format), Some(format)));
            assert_eq!(g.to_bytes(), w.to_bytes(), "layer {l} expert {e}");
        }
    }
}

/// `pack-store --format q4_k` on a bf16 checkpoint writes the bytes `convert-experts` would,
/// verifies against the source converted the same way, and a rerun asking for another format
/// is refused instead of being taken for a complete store.
#[test]
fn packing_with_a_format_quantizes_as_convert_experts_does() {
    use glmflash_node::quant::Format;
    let f = fixture_with(13, 256, DType::Bf16);
    let q4k = f.model.with_file_name("model-q4k");
    glmflash_node::model::convert::convert_experts(&f.model, &q4k, Format::Q4K, |_, _| {}).unwrap();
    let opts = PackOptions {
        format: Some(RecordFormat::Rows(Format::Q4K)),
        ..quiet()
    };
    let report = store::pack_store(&f.model, &f.store, &opts).unwrap();
    assert_eq!(report.outcome, PackOutcome::Packed);
    assert_eq!(report.verify.expect("verified").compared, 48);
    let m = Manifest::load(&f.store).unwrap();
    assert!(
        m.parts
            .all()
            .iter()
            .all(|p| p.format == PartFormat::Rows(Format::Q4K))
    );
    assert_records_match(&f, &q4k, Format::Q4K);
    let again = store::pack_store(&f.model, &f.store, &opts).unwrap();
    assert_eq!(again.outcome, PackOutcome::AlreadyComplete);
    let other = PackOptions {
        format: Some(RecordFormat::Rows(Format::Q8_0)),
        ..quiet()
    };
    let err = store::pack_store(&f.model, &f.store, &other)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("holds q4_k records") && err.contains("q8_0"),
        "{err}"
    );
    let plain = store::pack_store(&f.model, &f.store, &quiet())
        .unwrap_err()
        .to_string();
    assert!(
        plain.contains("holds q4_k records") && plain.contains("bf16"),
        "{plain}"
    );
    store::verify_store(
        &f.store,
        Some(&f.model),
        &VerifyOptions {
            sample: 48,
            progress: false,
            ..VerifyOptions::default()
        },
    )
    .unwrap();
}

#[test]
fn a_refused_io_uring_falls_back_to_pread() {
    let f = packed();
    let opts = ReaderOptions {
        refuse_uring: true,
        ..ReaderOptions::default()
    };
    let r = StoreReader::open(&f.store, None, opts.clone()).unwrap();
    assert_eq!(r.engine_name(), "pread");
    assert!(r.read(1, 3).is_ok());
    let strict = ReaderOptions {
        engine: EngineChoice::Uring,
        ..opts
    };
    let e = StoreReader::open(&f.store, None, strict).unwrap_err();
    assert!(e.to_string().contains("io_uring setup refused"), "{e}");
}

#[test]
fn records_are_padded_and_f32_round_trips() {
    // Width 98 in f32: 3 x 100352 bytes = 73.5 pages, padded to 74.
    let f = fixture_with(3, 98, DType::F32);
    store::pack_store(&f.model, &f.store, &quiet()).unwrap();
    let m = Manifest::load(&f.store).unwrap();
    assert_eq!(m.parts.length(), 3 * 98 * 256 * 4);
    assert_eq!(m.record_size, 74 * 4096);
    let data = std::fs::read(f.store.join(store::DATA)).unwrap();
    assert_eq!(data.len(), m.records.len() * m.record_size);
    assert!(
        data[m.parts.length()..m.record_size]
            .iter()
            .all(|&b| b == 0)
    );
    let ckpt = Checkpoint::open(&f.model).unwrap();
    let r = reader(&f.store, EngineChoice::Auto);
    let rec = r.read(3, 5).unwrap();
    let want = load_expert(&f.cfg, Loader::new(&ckpt).pp("layers.3.mlp.experts"), 5).unwrap();
    let got = expert_from_record(&rec, f.cfg.swiglu_limit).unwrap();
    assert_eq!(got.down.to_bytes(), want.down.to_bytes());
}

fn assert_send_sync<T: Send + Sync>() {}

#[test]
fn concurrent_requests_for_one_record_share_one_read() {
    assert_send_sync::<StoreReader>();
    assert_send_sync::<store::RecordBuf>();
    let f = packed();
    let r = reader(&f.store, EngineChoice::Auto);
    let out = r.read_many(&[(2, 4), (2, 4), (3, 1), (2, 4)]);
    assert_eq!(r.reads_issued(), 2);
    let a = out[0].as_ref().unwrap();
    assert!(std::sync::Arc::ptr_eq(a, out[1].as_ref().unwrap()));
    assert!(std::sync::Arc::ptr_eq(a, out[3].as_ref().unwrap()));
    // Many threads at once: every one gets the same bytes.
    let want = a.bytes().to_vec();
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| {
                for _ in 0..20 {
                    assert_eq!(r.read(2, 4).unwrap().bytes(), want.as_slice());
                }
            });
        }
    });
    // From rayon threads too.
    use rayon::prelude::*;
    let n: usize = (0..64)
        .into_par_iter()
        .map(|i| r.read(1 + i % 3, i % 16).unwrap().bytes().len())
        .sum();
    assert_eq!(n, 64 * want.len());
    assert!(r.read(0, 0).is_err(), "layer 0 is dense: no record");
}

/// A batch larger than the registered buffers goes to the engine a window at a time (each
/// window's buffers free for the next): every key is still delivered once, with its index.
#[test]
fn a_batch_past_the_registered_buffers_is_read_in_windows_each_key_once() {
    let f = packed();
    for (engine, r) in both_engines(&f.store, buffers(3)) {
        let keys: Vec<(usize, usize)> = (0..10).map(|i| (1 + i % 3, i)).collect();
        assert_each_key_delivered_once(&r, &keys, engine);
        assert_eq!(r.reads_issued(), 10);
    }
}

/// `n` registered buffers (and a queue as deep).
fn buffers(n: usize) -> ReaderOptions {
    ReaderOptions {
        queue_depth: n,
        registered_buffers: n,
        ..ReaderOptions::default()
    }
}

/// `read_each` of `keys` delivers each index its own key's record, once.
fn assert_each_key_delivered_once(
    r: &StoreReader,
    keys: &[(usize, usize)],
    engine: impl std::fmt::Debug,
) {
    let seen: Vec<std::sync::Mutex<Vec<(usize, usize)>>> =
        keys.iter().map(|_| Default::default()).collect();
    r.read_each(keys, &|i, rec| {
        let rec = rec.expect("record reads");
        seen[i].lock().unwrap().push((rec.layer(), rec.expert()));
    });
    for (i, s) in seen.iter().enumerate() {
        assert_eq!(*s.lock().unwrap(), vec![keys[i]], "key {i} via {engine:?}");
    }
}

#[test]
fn the_next_window_is_read_while_a_window_is_delivered() {
    let f = packed();
    // Windows of two: half the buffers, so the next window's reads have buffers too.
    for (engine, r) in both_engines(&f.store, buffers(4)) {
        let keys: Vec<(usize, usize)> = (0..9).map(|i| (1 + i % 3, i)).collect();
        let issued_at: Vec<std::sync::Mutex<u64>> =
            keys.iter().map(|_| Default::default()).collect();
        r.read_each(&keys, &|i, rec| {
            rec.expect("record reads");
            *issued_at[i].lock().unwrap() = r.reads_issued();
        });
        for (i, at) in issued_at.iter().enumerate() {
            let after_next = ((i / 2 + 2) * 2).min(keys.len()) as u64;
            assert_eq!(*at.lock().unwrap(), after_next, "key {i} via {engine:?}");
        }
        assert_eq!(r.reads_issued(), keys.len() as u64);
    }
}

#[test]
fn a_key_asked_twice_in_one_batch_is_read_once_and_delivered_twice() {
    let f = packed();
    for (engine, r) in both_engines(&f.store, buffers(2)) {
        // Windows of one key: the repeats are windows apart.
        let keys = [(1, 0), (2, 1), (1, 0), (3, 2), (2, 1), (1, 0)];
        assert_each_key_delivered_once(&r, &keys, engine);
        assert_eq!(r.reads_issued(), 3, "via {engine:?}");
    }
}

#[test]
fn rerun_on_a_complete_store_does_nothing() {
    let f = packed();
    let data = f.store.join(store::DATA);
    let before = std::fs::metadata(&data).unwrap().modified().unwrap();
    let bytes = std::fs::read(&data).unwrap();
    let again = store::pack_store(&f.model, &f.store, &quiet()).unwrap();
    assert_eq!(again.outcome, PackOutcome::AlreadyComplete);
    assert_eq!(again.bytes_written, 0);
    assert_eq!(
        std::fs::metadata(&data).unwrap().modified().unwrap(),
        before
    );
    assert_eq!(std::fs::read(&data).unwrap(), bytes);
    let out = Command::new(env!("CARGO_BIN_EXE_glmflash-node"))
        .args(["pack-store", "--model"])
        .arg(&f.model)
        .arg("--store")
        .arg(&f.store)
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("nothing to do"));
}

fn journal_lines(store: &Path) -> usize {
    std::fs::read_to_string(store.join(store::JOURNAL))
        .map(|t| t.lines().count())
        .unwrap_or(0)
}

#[test]
fn kill_9_mid_pack_resumes_to_the_identical_store() {
    let reference = packed();
    let f = fixture_with(7, 256, DType::Bf16);
    for corrupt_first in [false, true] {
        let _ = std::fs::remove_dir_all(&f.store);
        let mut child = Command::new(env!("CARGO_BIN_EXE_glmflash-node"))
            .args(["pack-store", "--model"])
            .arg(&f.model)
            .arg("--store")
            .arg(&f.store)
            .env("GLMFLASH_PACK_THROTTLE_MS", "40")
            .env("GLMFLASH_PACK_BATCH_BYTES", "1")
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        while journal_lines(&f.store) < 10 {
            assert!(Instant::now() < deadline, "pack-store made no progress");
            std::thread::sleep(Duration::from_millis(10));
        }
        // SIGKILL, as kill -9 would.
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!f.store.join(store::MANIFEST).exists());
        let kept = journal_lines(&f.store) - 1;
        assert!(kept < 48, "killed before the end");
        if corrupt_first {
            // A journaled record damaged on disk is noticed and rewritten.
            flip_byte(&f.store.join(store::DATA), 1000);
        } else {
            // A torn last journal line is ignored.
            use std::io::Write;
            let mut j = std::fs::OpenOptions::new()
                .append(true)
                .open(f.store.join(store::JOURNAL))
                .unwrap();
            j.write_all(b"{\"i\": 4").unwrap();
        }
        let report = store::pack_store(&f.model, &f.store, &quiet()).unwrap();
        let from_record = match report.outcome {
            PackOutcome::Resumed { from_record } => from_record,
            // Record 0 itself was damaged: nothing could be kept.
            PackOutcome::Packed => 0,
            other => panic!("expected a resume, got {other:?}"),
        };
        if corrupt_first {
            assert_eq!(from_record, 0);
        } else {
            assert!(
                from_record >= kept - 1 && from_record > 0,
                "{from_record} vs {kept}"
            );
        }
        for name in [store::DATA, store::MANIFEST] {
            assert!(
                std::fs::read(f.store.join(name)).unwrap()
                    == std::fs::read(reference.store.join(name)).unwrap(),
                "{name} differs from an uninterrupted run"
            );
        }
        assert!(!f.store.join(store::JOURNAL).exists());
    }
}

#[test]
fn a_flipped_byte_is_caught_by_verify_and_by_read() {
    let f = packed();
    let m = Manifest::load(&f.store).unwrap();
    let victim = m
        .records
        .iter()
        .find(|r| r.layer == 2 && r.expert == 9)
        .unwrap()
        .clone();
    flip_byte(&f.store.join(store::DATA), victim.offset + 12345);
    let named = format!("layer 2, expert 9 at offset {}", victim.offset);
    let err = store::verify_store(
        &f.store,
        None,
        &VerifyOptions {
            progress: false,
            ..VerifyOptions::default()
        },
    )
    .unwrap_err();
    assert!(matches!(err, StoreError::Corrupt { count: 1, .. }), "{err}");
    assert!(err.to_string().contains(&named), "{err}");
    for engine in [EngineChoice::Uring, EngineChoice::Pread] {
        let r = reader(&f.store, engine);
        let e = r.read(2, 9).unwrap_err();
        assert!(
            matches!(
                e.kind,
                ReadErrorKind::Checksum {
                    digest: "crc32c",
                    ..
                }
            ),
            "reads check the CRC: {e}"
        );
        assert_eq!((e.layer, e.expert, e.offset), (2, 9, victim.offset));
        assert!(e.to_string().contains(&named), "{e}");
        assert!(r.read(2, 8).is_ok(), "neighbours are fine");
    }
    // The CLI says the same and fails.
    let out = Command::new(env!("CARGO_BIN_EXE_glmflash-node"))
        .args(["verify-store", "--store"])
        .arg(&f.store)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains(&named));
    // With checksums off the damage goes through, by design; the default never lets it.
    let unchecked = StoreReader::open(
        &f.store,
        None,
        ReaderOptions {
            checksum: ChecksumPolicy::Never,
            ..ReaderOptions::default()
        },
    )
    .unwrap();
    assert!(unchecked.read(2, 9).is_ok());
}

/// A read of `record` fails its `digest` check.
fn assert_digest_fails(store: &Path, (layer, expert): (usize, usize), digest: &str) {
    let e = reader(store, EngineChoice::Auto)
        .read(layer, expert)
        .unwrap_err();
    let ReadErrorKind::Checksum { digest: found, .. } = e.kind else {
        panic!("not a checksum failure: {e}");
    };
    assert_eq!(found, digest, "{e}");
}

/// Every packed record carries the CRC-32C of its bytes; a store whose manifest lacks them
/// (packed before they existed) reads with sha256 and gets them from `pack-store`; a CRC that
/// disagrees with the record fails reads and `verify-store` even where the sha256 agrees.
#[test]
fn records_carry_a_crc_and_an_older_store_gets_one() {
    let f = packed();
    let m = Manifest::load(&f.store).unwrap();
    let r = reader(&f.store, EngineChoice::Auto);
    for entry in &m.records {
        let record = r.read(entry.layer, entry.expert).unwrap();
        assert_eq!(entry.crc32c, Some(store::crc32c(record.bytes())));
    }
    drop(r);
    let write = |m: &Manifest| {
        std::fs::write(
            f.store.join(store::MANIFEST),
            serde_json::to_vec_pretty(m).unwrap(),
        )
        .unwrap()
    };
    // An older store: no CRCs. Reads check sha256 (a flipped byte is still caught).
    let mut old = m.clone();
    old.records.iter_mut().for_each(|e| e.crc32c = None);
    write(&old);
    let victim = m
        .records
        .iter()
        .find(|e| (e.layer, e.expert) == (3, 4))
        .unwrap();
    flip_byte(&f.store.join(store::DATA), victim.offset + 777);
    assert_digest_fails(&f.store, (3, 4), "sha256");
    // pack-store adds the CRCs, but only after every sha256 matched.
    let err = store::pack_store(&f.model, &f.store, &quiet()).unwrap_err();
    assert!(err.to_string().contains("sha256"), "{err}");
    assert!(
        Manifest::load(&f.store).unwrap().records[0]
            .crc32c
            .is_none()
    );
    flip_byte(&f.store.join(store::DATA), victim.offset + 777);
    let again = store::pack_store(&f.model, &f.store, &quiet()).unwrap();
    assert_eq!(again.outcome, PackOutcome::AddedChecks);
    assert_eq!(again.bytes_written, 0);
    assert_eq!(
        Manifest::load(&f.store).unwrap(),
        m,
        "the CRCs packing wrote"
    );
    let third = store::pack_store(&f.model, &f.store, &quiet()).unwrap();
    assert_eq!(third.outcome, PackOutcome::AlreadyComplete);
    // A CRC that disagrees with its record (the sha256 still agrees).
    let mut wrong = m.clone();
    let entry = wrong
        .records
        .iter_mut()
        .find(|e| (e.layer, e.expert) == (1, 2));
    let entry = entry.unwrap();
    entry.crc32c = entry.crc32c.map(|c| c ^ 1);
    write(&wrong);
    assert_digest_fails(&f.store, (1, 2), "crc32c");
    let quiet_verify = VerifyOptions {
        progress: false,
        ..VerifyOptions::default()
    };
    let err = store::verify_store(&f.store, None, &quiet_verify).unwrap_err();
    assert!(matches!(err, StoreError::Corrupt { count: 1, .. }), "{err}");
}

#[test]
fn a_truncated_store_fails_cleanly() {
    let f = packed();
    let m = Manifest::load(&f.store).unwrap();
    let data = f.store.join(store::DATA);
    let open_reader = reader(&f.store, EngineChoice::Uring);
    let pread_reader = reader(&f.store, EngineChoice::Pread);
    let last = m.records.last().unwrap().clone();
    let cut = last.offset + 8192;
    std::fs::OpenOptions::new()
        .write(true)
        .open(&data)
        .unwrap()
        .set_len(cut)
        .unwrap();
    // Readers opened before the cut see a short read, named.
    for r in [&open_reader, &pread_reader] {
        let e = r.read(last.layer, last.expert).unwrap_err();
        assert_eq!(
            e.kind,
            ReadErrorKind::Truncated {
                got: 8192,
                want: m.record_size
            },
            "{}",
            r.engine_name()
        );
        assert!(r.read(1, 0).is_ok());
    }
    // Opening, verifying and re-packing refuse, naming the first record cut.
    let named = format!(
        "layer {}, expert {}, offset {}",
        last.layer, last.expert, last.offset
    );
    let e = StoreReader::open(&f.store, None, ReaderOptions::default()).unwrap_err();
    assert!(e.to_string().contains(&named), "{e}");
    let e = store::verify_store(&f.store, None, &VerifyOptions::default()).unwrap_err();
    assert!(matches!(e, StoreError::Truncated { .. }), "{e}");
    let e = store::pack_store(&f.model, &f.store, &quiet()).unwrap_err();
    assert!(e.to_string().contains(&named), "{e}");
}

#[test]
fn a_store_from_another_model_is_refused() {
    let f = packed();
    let other = f.model.with_file_name("other-model");
    make_model(&other, 8, 256, DType::Bf16);
    let mine = Manifest::load(&f.store).unwrap();
    let theirs = store::model_fingerprint(&other).unwrap();
    assert_ne!(mine.fingerprint, theirs);
    let e = store::verify_store(&f.store, Some(&other), &VerifyOptions::default()).unwrap_err();
    assert!(matches!(e, StoreError::FingerprintMismatch { .. }));
    let text = e.to_string();
    assert!(
        text.contains(&mine.fingerprint) && text.contains(&theirs),
        "{text}"
    );
    let e = StoreReader::open(&f.store, Some(&theirs), ReaderOptions::default()).unwrap_err();
    assert!(e.to_string().contains(&theirs));
    let e = store::pack_store(&other, &f.store, &quiet()).unwrap_err();
    assert!(matches!(e, StoreError::FingerprintMismatch { .. }), "{e}");
    // The right model passes, with either fingerprint.
    assert_eq!(
        store::model_fingerprint(&f.model).unwrap(),
        mine.fingerprint
    );
    assert_eq!(
        store::quick_fingerprint(&f.model).unwrap(),
        mine.quick_fingerprint
    );
    StoreReader::open(
        &f.store,
        Some(&mine.quick_fingerprint),
        ReaderOptions::default(),
    )
    .unwrap();
    let v = store::verify_store(
        &f.store,
        Some(&f.model),
        &VerifyOptions {
            progress: false,
            ..VerifyOptions::default()
        },
    )
    .unwrap();
    assert!(v.fingerprint_checked);
}

#[test]
fn an_injected_read_error_fails_only_that_request() {
    let f = packed();
    let failing = ReaderOptions {
        fail_record: Some((3, 7)),
        ..ReaderOptions::default()
    };
    for (_, r) in both_engines(&f.store, failing) {
        let out = r.read_many(&[(3, 6), (3, 7), (3, 8)]);
        assert!(out[0].is_ok() && out[2].is_ok());
        let e = out[1].as_ref().unwrap_err();
        assert!(matches!(e.kind, ReadErrorKind::Io(_)));
        assert!(e.to_string().contains("layer 3, expert 7"), "{e}");
        assert!(r.read(3, 6).is_ok(), "the reader keeps working");
    }
}

/// A scratch mount for filesystem-specific tests, unmounted on drop; `None` (with a note)
/// where this process may not mount.
struct Mount(PathBuf);

impl Mount {
    fn new(fstype: &str, options: &str) -> Option<Mount> {
        let dir = disk_tempdir().keep();
        let ok = Command::new("mount")
            .args(["-t", fstype, "-o", options, fstype])
            .arg(&dir)
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if ok {
            Some(Mount(dir))
        } else {
            eprintln!("SKIP: cannot mount a {fstype} here (needs root)");
            None
        }
    }

    fn remount(&self, options: &str) {
        let ok = Command::new("mount")
            .args(["-o", &format!("remount,{options}")])
            .arg(&self.0)
            .status()
            .unwrap()
            .success();
        assert!(ok);
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

#[test]
fn a_filesystem_without_o_direct_is_refused() {
    let f = fixture_with(7, 256, DType::Bf16);
    let Some(ramfs) = Mount::new("ramfs", "size=64m") else {
        return;
    };
    let e = store::pack_store(&f.model, &ramfs.0.join("store"), &quiet()).unwrap_err();
    assert!(matches!(e, StoreError::NoDirectIo { .. }), "{e}");
    assert!(e.to_string().contains("O_DIRECT"), "{e}");
}

#[test]
fn too_little_space_is_refused_and_a_full_disk_leaves_a_resumable_store() {
    let reference = packed();
    let f = fixture_with(7, 256, DType::Bf16);
    // tmpfs takes O_DIRECT on this kernel (6.6+); the store needs 18 MiB.
    let Some(small) = Mount::new("tmpfs", "size=8m") else {
        return;
    };
    let dir = small.0.join("store");
    let e = store::pack_store(&f.model, &dir, &quiet()).unwrap_err();
    let StoreError::NoSpace {
        needed, available, ..
    } = e
    else {
        panic!("expected NoSpace, got {e}");
    };
    assert!(needed > 18 << 20 && available <= 8 << 20);
    let msg = StoreError::NoSpace {
        path: String::new(),
        needed,
        available,
    }
    .to_string();
    assert!(msg.contains(&needed.to_string()) && msg.contains(&available.to_string()));

    // Past the check, the disk really fills up mid-pack.
    let opts = PackOptions {
        skip_space_check: true,
        batch_bytes: 1 << 20,
        ..quiet()
    };
    let e = store::pack_store(&f.model, &dir, &opts).unwrap_err();
    assert!(matches!(e, StoreError::DiskFull { .. }), "{e}");
    assert!(journal_lines(&dir) > 1, "some records were journaled");
    small.remount("size=64m");
    let report = store::pack_store(&f.model, &dir, &quiet()).unwrap();
    assert!(
        matches!(report.outcome, PackOutcome::Resumed { .. }),
        "{:?}",
        report.outcome
    );
    for name in [store::DATA, store::MANIFEST] {
        assert!(
            std::fs::read(dir.join(name)).unwrap()
                == std::fs::read(reference.store.join(name)).unwrap(),
            "{name} differs from an uninterrupted run"
        );
    }
}
