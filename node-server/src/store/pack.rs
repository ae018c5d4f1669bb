//! `pack-store`: one pass over the checkpoint writing `experts.bin` with O_DIRECT.
//!
//! Records are built in batches (on all cores), written with one aligned `pwrite`, made
//! durable with `fdatasync`, and only then appended to the journal `experts.json.partial`
//! (header line, then one JSON line per record with its sha256 and its source tensors'
//! hashes), which is fsynced too. After `kill -9` or a full disk the journal names exactly
//! the records that are on disk; a rerun with the same model (same quick fingerprint)
//! re-reads those records with O_DIRECT, keeps the prefix whose sha256 still matches and
//! rewrites the rest. Every record is a pure function of the source, so the resumed store
//! is byte-identical to an uninterrupted run. At the end the manifest is written to a
//! temporary file, fsynced and renamed over `experts.json`, and the journal removed.

use super::aligned::{AlignedBuf, align_up};
use super::io::{DirectOpenError, open_direct};
use super::manifest::{
    self, DATA, FORMAT_VERSION, JOURNAL, MANIFEST, Manifest, Part, Parts, RecordEntry,
    expert_owner, moe_layers, sha256_hex,
};
use super::records::{RecordFormat, Weight, expert_weights, resolve_format};
use super::verify::{VerifyOptions, VerifyReport, verify_opened};
use super::{ALIGN, StoreError};
use crate::model::loader::Loader;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufRead, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct PackOptions {
    /// Draw a progress bar on stderr (hidden anyway when stderr is not a terminal).
    pub progress: bool,
    /// Verify the store after packing (every sha256, plus a byte compare of a sample).
    pub verify: bool,
    /// Records compared byte for byte with the source during verification.
    pub sample: usize,
    /// Bytes written per batch (rounded to whole records, at least one).
    pub batch_bytes: usize,
    /// Test hook: sleep this long after each record.
    #[doc(hidden)]
    pub throttle: Option<Duration>,
    /// Test hook: skip the free-space check (to hit a real ENOSPC).
    #[doc(hidden)]
    pub skip_space_check: bool,
    /// Weight format of the records; `None` keeps the checkpoint's (`exl3` for an EXL3
    /// checkpoint). A row format other than the checkpoint's converts each expert as it is
    /// packed (deterministically, as `convert-experts` does).
    pub format: Option<RecordFormat>,
}

impl Default for PackOptions {
    fn default() -> PackOptions {
        PackOptions {
            progress: true,
            verify: true,
            sample: 300,
            batch_bytes: 64 << 20,
            throttle: None,
            skip_space_check: false,
            format: None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PackOutcome {
    /// Packed from scratch.
    Packed,
    /// Continued a partial store; records before `from_record` were kept.
    Resumed { from_record: usize },
    /// The store was already complete for this model; nothing was written.
    AlreadyComplete,
    /// The store was complete but its records had no CRC-32C (packed before records carried
    /// one): every record was read and its sha256 checked, and the manifest rewritten with
    /// their CRCs; no record was written.
    AddedChecks,
}

#[derive(Clone, Debug)]
pub struct PackReport {
    pub outcome: PackOutcome,
    pub records: usize,
    pub record_size: usize,
    /// Bytes written by this run.
    pub bytes_written: u64,
    pub fingerprint: String,
    pub seconds: f64,
    pub verify: Option<VerifyReport>,
}

#[derive(Serialize, Deserialize, PartialEq)]
struct JournalHeader {
    format_version: u32,
    quick_fingerprint: String,
    record_size: usize,
    records: usize,
    parts: Parts,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    layer_parts: BTreeMap<usize, Parts>,
}

#[derive(Serialize, Deserialize, Clone)]
struct JournalRecord {
    i: usize,
    sha256: String,
    /// Absent in journals written before records carried it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    crc32c: Option<u32>,
    /// Content hashes of the source tensors this record owns (for the full fingerprint).
    tensors: BTreeMap<String, String>,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Packs the routed experts of the checkpoint in `model` into `store` (see the module doc).
pub fn pack_store(
    model: &Path,
    store: &Path,
    opts: &PackOptions,
) -> Result<PackReport, StoreError> {
    let started = Instant::now();
    let (config_bytes, cfg, ckpt) = manifest::open_model(model)?;
    let layers = moe_layers(&cfg);
    if layers.is_empty() {
        return Err(StoreError::Other(format!(
            "{}: the model has no MoE layers, so there is nothing to pack",
            model.display()
        )));
    }
    let experts = cfg.n_routed_experts;
    let keys: Vec<(usize, usize)> = layers
        .iter()
        .flat_map(|&l| (0..experts).map(move |e| (l, e)))
        .collect();
    let loader = Loader::new(&ckpt);
    let layer_loaders: HashMap<usize, Loader> = layers
        .iter()
        .map(|&l| (l, loader.pp(&format!("layers.{l}.mlp.experts"))))
        .collect();
    let format = resolve_format(&cfg, layer_loaders[&layers[0]], opts.format)?;
    let build = |l: usize, e: usize| expert_weights(&cfg, layer_loaders[&l], e, format);
    // Each layer's layout from its first expert: an EXL3 checkpoint may hold some layers'
    // experts at another rate. Records are all the largest layout's size.
    let layouts: BTreeMap<usize, Parts> = layers
        .iter()
        .map(|&l| Ok((l, layout(&build(l, 0)?))))
        .collect::<Result<_, StoreError>>()?;
    let parts = layouts[&layers[0]].clone();
    let layer_parts: BTreeMap<usize, Parts> = layouts
        .iter()
        .filter(|(_, p)| **p != parts)
        .map(|(&l, p)| (l, p.clone()))
        .collect();
    let record_size = layouts
        .values()
        .map(|p| align_up(p.length()))
        .max()
        .unwrap_or(ALIGN);
    let total = keys.len();
    let total_bytes = (total * record_size) as u64;

    let mut owned: HashMap<(usize, usize), Vec<String>> = HashMap::new();
    for k in ckpt.keys() {
        if let Some(owner) = expert_owner(k, &layers) {
            owned.entry(owner).or_default().push(k.to_string());
        }
    }
    let mut hashes = manifest::tensor_hashes(&ckpt, |k| expert_owner(k, &layers).is_none())?;
    let quick = manifest::fingerprint(&config_bytes, &ckpt, &hashes, false)?;

    std::fs::create_dir_all(store).map_err(io_err(store))?;
    let data_path = store.join(DATA);
    let journal_path = store.join(JOURNAL);
    let manifest_path = store.join(MANIFEST);

    if manifest_path.exists() {
        let mut existing = Manifest::load(store)?;
        if existing.quick_fingerprint != quick {
            return Err(StoreError::FingerprintMismatch {
                which: "quick fingerprint",
                store: store.display().to_string(),
                store_fingerprint: existing.quick_fingerprint,
                model_fingerprint: quick,
            });
        }
        if existing.parts != parts || existing.layer_parts != layer_parts {
            return Err(StoreError::Other(format!(
                "store {} holds {} records ({} bytes each); this run asks for {} records ({} bytes): \
                 pack into another directory or remove this one",
                store.display(),
                existing.parts.gate.format.describe(),
                existing.record_size,
                parts.gate.format.describe(),
                record_size
            )));
        }
        let found = std::fs::metadata(&data_path).map(|m| m.len()).unwrap_or(0);
        super::reader::check_length(&existing, &data_path, found)?;
        let outcome = if existing.records.iter().any(|r| r.crc32c.is_none()) {
            add_checks(store, &mut existing, opts.progress)?;
            PackOutcome::AddedChecks
        } else {
            tracing::info!(store = %store.display(), "store is already complete for this model; nothing to do");
            PackOutcome::AlreadyComplete
        };
        return Ok(PackReport {
            outcome,
            records: existing.records.len(),
            record_size: existing.record_size,
            bytes_written: 0,
            fingerprint: existing.fingerprint,
            seconds: started.elapsed().as_secs_f64(),
            verify: None,
        });
    }

    let header = JournalHeader {
        format_version: FORMAT_VERSION,
        quick_fingerprint: quick.clone(),
        record_size,
        records: total,
        parts: parts.clone(),
        layer_parts: layer_parts.clone(),
    };
    let file = open_direct(&data_path, true).map_err(|e| match e {
        DirectOpenError::Unsupported => StoreError::NoDirectIo {
            path: data_path.display().to_string(),
        },
        DirectOpenError::Io(source) => StoreError::Io {
            path: data_path.display().to_string(),
            source,
        },
    })?;
    let lengths: Vec<usize> = keys.iter().map(|(l, _)| layouts[l].length()).collect();
    let done = resume_point(&journal_path, &header, &lengths, &file, store)?;
    let from = done.len();

    if !opts.skip_space_check {
        let existing = file.metadata().map_err(io_err(&data_path))?.len();
        let needed = total_bytes.saturating_sub(existing) + (total as u64 * 256);
        let stat = rustix::fs::statvfs(store).map_err(|e| StoreError::Io {
            path: store.display().to_string(),
            source: e.into(),
        })?;
        let available = stat.f_bavail * stat.f_frsize;
        if needed > available {
            return Err(StoreError::NoSpace {
                path: store.display().to_string(),
                needed,
                available,
            });
        }
    }

    // The journal restarts from the verified prefix, so a torn tail never survives.
    let mut journal = rewrite_journal(&journal_path, &header, &done)?;
    let mut records: Vec<JournalRecord> = done;
    if from > 0 {
        tracing::info!(from_record = from, total, "resuming a partial store");
    }

    let bar = if opts.progress {
        ProgressBar::with_draw_target(Some(total_bytes), ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template(
            "packing [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar.set_position((from * record_size) as u64);
    bar.reset_eta();

    let per_batch = (opts.batch_bytes / record_size).max(1);
    let mut written = 0u64;
    let mut start = from;
    while start < total {
        let end = (start + per_batch).min(total);
        let built: Vec<(Vec<u8>, JournalRecord)> = (start..end)
            .into_par_iter()
            .map(|i| {
                let (l, e) = keys[i];
                let weights = build(l, e)?;
                let want = &layouts[&l];
                if layout(&weights) != *want {
                    let describe = |p: &Parts| {
                        p.all()
                            .map(|p| format!("{}x{} {}", p.rows, p.cols, p.format.describe()))
                            .join(", ")
                    };
                    return Err(StoreError::Other(format!(
                        "layer {l}, expert {e} is laid out as {}, expert 0 of that layer as {}; \
                         the experts of one layer must share one record layout",
                        describe(&layout(&weights)),
                        describe(want)
                    )));
                }
                let mut record = Vec::with_capacity(want.length());
                for w in &weights {
                    record.extend_from_slice(&w.bytes);
                }
                let mut tensors = BTreeMap::new();
                for key in owned.get(&(l, e)).into_iter().flatten() {
                    let view = manifest::raw_view(&ckpt, key)?;
                    tensors.insert(key.clone(), sha256_hex(view.bytes));
                }
                let (sha256, crc32c) = (sha256_hex(&record), Some(manifest::crc32c(&record)));
                Ok((
                    record,
                    JournalRecord {
                        i,
                        sha256,
                        crc32c,
                        tensors,
                    },
                ))
            })
            .collect::<Result<_, StoreError>>()?;
        let mut buf = AlignedBuf::new((end - start) * record_size);
        for (k, (record, _)) in built.iter().enumerate() {
            buf.as_mut_slice()[k * record_size..k * record_size + record.len()]
                .copy_from_slice(record);
        }
        let offset = (start * record_size) as u64;
        let disk_full = |e: &std::io::Error| e.raw_os_error() == Some(libc::ENOSPC);
        let write = file
            .write_all_at(buf.as_slice(), offset)
            .and_then(|()| file.sync_data());
        if let Err(e) = write {
            if disk_full(&e) {
                return Err(StoreError::DiskFull {
                    path: data_path.display().to_string(),
                    record: start,
                    total,
                });
            }
            return Err(StoreError::Io {
                path: data_path.display().to_string(),
                source: e,
            });
        }
        for (_, r) in &built {
            if let Some(pause) = opts.throttle {
                std::thread::sleep(pause);
            }
            let line = serde_json::to_string(r).expect("journal record serializes") + "\n";
            journal
                .write_all(line.as_bytes())
                .map_err(|e| journal_error(&journal_path, e, start, total))?;
            records.push(r.clone());
            bar.inc(record_size as u64);
        }
        journal
            .sync_data()
            .map_err(|e| journal_error(&journal_path, e, start, total))?;
        written += buf.len() as u64;
        start = end;
    }
    bar.finish_and_clear();
    // A longer file left by an abandoned layout would break byte identity: cut it.
    file.set_len(total_bytes)
        .and_then(|()| file.sync_all())
        .map_err(io_err(&data_path))?;

    for r in &records {
        hashes.extend(r.tensors.clone());
    }
    let fingerprint = manifest::fingerprint(&config_bytes, &ckpt, &hashes, true)?;
    let manifest = Manifest {
        format_version: FORMAT_VERSION,
        fingerprint: fingerprint.clone(),
        quick_fingerprint: quick,
        record_size,
        alignment: ALIGN,
        experts_per_layer: experts,
        layers,
        parts,
        layer_parts,
        records: records
            .iter()
            .map(|r| {
                let (layer, expert) = keys[r.i];
                RecordEntry {
                    layer,
                    expert,
                    offset: (r.i * record_size) as u64,
                    length: lengths[r.i],
                    sha256: r.sha256.clone(),
                    crc32c: r.crc32c,
                }
            })
            .collect(),
    };
    write_durably(
        store,
        &manifest_path,
        &serde_json::to_vec_pretty(&manifest).expect("manifest serializes"),
    )?;
    std::fs::remove_file(&journal_path).map_err(io_err(&journal_path))?;
    sync_dir(store)?;
    tracing::info!(records = total, bytes = total_bytes, "store packed");

    let verify = if opts.verify {
        let vopts = VerifyOptions {
            sample: opts.sample,
            progress: opts.progress,
            ..VerifyOptions::default()
        };
        Some(verify_opened(
            store,
            &manifest,
            Some((&cfg, &ckpt)),
            &vopts,
        )?)
    } else {
        None
    };
    Ok(PackReport {
        outcome: if from == 0 {
            PackOutcome::Packed
        } else {
            PackOutcome::Resumed { from_record: from }
        },
        records: total,
        record_size,
        bytes_written: written,
        fingerprint,
        seconds: started.elapsed().as_secs_f64(),
        verify,
    })
}

/// Where an expert's gate, up and down sit in its record, and their formats and shapes.
fn layout(weights: &[Weight; 3]) -> Parts {
    let part = |w: &Weight, offset: usize| Part {
        format: w.format,
        rows: w.rows,
        cols: w.cols,
        offset,
        length: w.bytes.len(),
    };
    let gate = part(&weights[0], 0);
    let up = part(&weights[1], gate.length);
    let down = part(&weights[2], gate.length + up.length);
    Parts { gate, up, down }
}

fn journal_error(path: &Path, e: std::io::Error, record: usize, total: usize) -> StoreError {
    if e.raw_os_error() == Some(libc::ENOSPC) {
        StoreError::DiskFull {
            path: path.display().to_string(),
            record,
            total,
        }
    } else {
        StoreError::Io {
            path: path.display().to_string(),
            source: e,
        }
    }
}

/// The journal's records that are still intact on disk, in order. A journal from another
/// model is refused; one from another layout or version is discarded.
fn resume_point(
    journal: &Path,
    header: &JournalHeader,
    lengths: &[usize],
    file: &File,
    store: &Path,
) -> Result<Vec<JournalRecord>, StoreError> {
    let Ok(f) = File::open(journal) else {
        return Ok(Vec::new());
    };
    let mut lines = std::io::BufReader::new(f).lines();
    let Some(Ok(first)) = lines.next() else {
        return Ok(Vec::new());
    };
    let Ok(found) = serde_json::from_str::<JournalHeader>(&first) else {
        return Ok(Vec::new());
    };
    if found.quick_fingerprint != header.quick_fingerprint {
        return Err(StoreError::FingerprintMismatch {
            which: "quick fingerprint",
            store: store.display().to_string(),
            store_fingerprint: found.quick_fingerprint,
            model_fingerprint: header.quick_fingerprint.clone(),
        });
    }
    if found != *header {
        tracing::warn!("the partial store has another layout; packing from scratch");
        return Ok(Vec::new());
    }
    let mut journaled: Vec<JournalRecord> = Vec::new();
    for line in lines {
        let Ok(line) = line else { break };
        let Ok(r) = serde_json::from_str::<JournalRecord>(&line) else {
            break;
        };
        if r.i != journaled.len() || r.i >= header.records {
            break;
        }
        journaled.push(r);
    }
    // Re-read every journaled record (O_DIRECT, on all cores); keep the intact prefix.
    let intact: Vec<bool> = journaled
        .par_iter()
        .map_init(
            || AlignedBuf::new(header.record_size),
            |buf, r| {
                let offset = (r.i * header.record_size) as u64;
                file.read_exact_at(buf.as_mut_slice(), offset).is_ok()
                    && sha256_hex(&buf.as_slice()[..lengths[r.i]]) == r.sha256
            },
        )
        .collect();
    let keep = intact.iter().position(|ok| !ok).unwrap_or(journaled.len());
    if keep < journaled.len() {
        tracing::warn!(
            record = keep,
            "a journaled record is not intact on disk; rewriting from it"
        );
    }
    journaled.truncate(keep);
    let done = journaled;
    Ok(done)
}

fn rewrite_journal(
    path: &Path,
    header: &JournalHeader,
    done: &[JournalRecord],
) -> Result<File, StoreError> {
    let mut text = serde_json::to_string(header).expect("header serializes") + "\n";
    for r in done {
        text += &(serde_json::to_string(r).expect("record serializes") + "\n");
    }
    let store = path.parent().unwrap_or(Path::new("."));
    write_durably(store, path, text.as_bytes())?;
    std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .map_err(io_err(path))
}

/// Writes `bytes` to a temporary file, fsyncs it and renames it over `path`.
/// Gives every record of the complete store `m` its CRC-32C: one O_DIRECT pass, each record's
/// sha256 checked before its CRC is taken, then the manifest rewritten durably.
fn add_checks(store: &Path, m: &mut Manifest, progress: bool) -> Result<(), StoreError> {
    tracing::info!(
        store = %store.display(),
        "the store's records have no CRC-32C (packed by an older glmflash): adding them, every record's sha256 checked"
    );
    let opts = VerifyOptions {
        progress,
        ..VerifyOptions::default()
    };
    let reader = super::reader::StoreReader::open(
        store,
        Some(&m.fingerprint),
        super::reader::ReaderOptions {
            check: super::reader::RecordCheck::Full,
            ..opts.reader.clone()
        },
    )?;
    let bar = if progress {
        ProgressBar::with_draw_target(Some(m.data_bytes()), ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    };
    let keys: Vec<(usize, usize)> = m.records.iter().map(|r| (r.layer, r.expert)).collect();
    let mut crcs = Vec::with_capacity(keys.len());
    for chunk in keys.chunks(opts.reader.queue_depth.max(1) * 2) {
        for record in reader.read_many(chunk) {
            crcs.push(manifest::crc32c(record?.bytes()));
        }
        bar.inc((chunk.len() * m.record_size) as u64);
    }
    bar.finish_and_clear();
    for (entry, crc) in m.records.iter_mut().zip(crcs) {
        entry.crc32c = Some(crc);
    }
    write_durably(
        store,
        &store.join(MANIFEST),
        &serde_json::to_vec_pretty(&m).expect("manifest serializes"),
    )?;
    tracing::info!(
        records = m.records.len(),
        "CRC-32C of every record written to the manifest"
    );
    Ok(())
}

fn write_durably(dir: &Path, path: &Path, bytes: &[u8]) -> Result<(), StoreError> {
    let tmp = path.with_extension("tmp");
    let mut f = File::create(&tmp).map_err(io_err(&tmp))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .map_err(io_err(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io_err(path))?;
    sync_dir(dir)
}

fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err(dir))
}
