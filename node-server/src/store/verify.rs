//! `verify-store`: every record's sha256 and CRC-32C through O_DIRECT reads, and with the model at hand
//! its full fingerprint plus a byte compare of a sample of records against the source.

use super::StoreError;
use super::manifest::PartFormat;
use super::manifest::{self, Manifest};
use super::reader::{ChecksumPolicy, ReaderOptions, RecordCheck, StoreReader};
use super::records::{RecordFormat, expert_weights};
use crate::model::checkpoint::Checkpoint;
use crate::model::config::Config;
use crate::model::loader::Loader;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::path::Path;
use std::time::Instant;

#[derive(Clone, Debug)]
pub struct VerifyOptions {
    /// Records compared byte for byte with the source (all when the store has fewer).
    pub sample: usize,
    pub progress: bool,
    pub reader: ReaderOptions,
}

impl Default for VerifyOptions {
    fn default() -> VerifyOptions {
        VerifyOptions {
            sample: 300,
            progress: true,
            reader: ReaderOptions::default(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct VerifyReport {
    pub records: usize,
    pub bytes: u64,
    /// Seconds spent reading and hashing every record.
    pub seconds: f64,
    pub engine: &'static str,
    /// Records compared with the source (0 without the model).
    pub compared: usize,
    /// Whether the full model fingerprint was recomputed and matched.
    pub fingerprint_checked: bool,
}

/// Verifies the store in `store`; with `model`, also recomputes the model's full
/// fingerprint (refusing a store made from another model) and compares a sample of records
/// with the source bytes.
pub fn verify_store(
    store: &Path,
    model: Option<&Path>,
    opts: &VerifyOptions,
) -> Result<VerifyReport, StoreError> {
    let manifest = Manifest::load(store)?;
    let Some(model) = model else {
        return verify_opened(store, &manifest, None, opts);
    };
    let found = manifest::model_fingerprint(model)?;
    if found != manifest.fingerprint {
        return Err(StoreError::FingerprintMismatch {
            which: "fingerprint",
            store: store.display().to_string(),
            store_fingerprint: manifest.fingerprint,
            model_fingerprint: found,
        });
    }
    let (_, cfg, ckpt) = manifest::open_model(model)?;
    let mut report = verify_opened(store, &manifest, Some((&cfg, &ckpt)), opts)?;
    report.fingerprint_checked = true;
    Ok(report)
}

/// Checks every record's sha256 (and CRC-32C), then compares the sample with `source` when given.
pub(super) fn verify_opened(
    store: &Path,
    manifest: &Manifest,
    source: Option<(&Config, &Checkpoint)>,
    opts: &VerifyOptions,
) -> Result<VerifyReport, StoreError> {
    let reader = StoreReader::open(
        store,
        Some(&manifest.fingerprint),
        ReaderOptions {
            checksum: ChecksumPolicy::Always,
            check: RecordCheck::Full,
            ..opts.reader.clone()
        },
    )?;
    let keys: Vec<(usize, usize)> = manifest
        .records
        .iter()
        .map(|r| (r.layer, r.expert))
        .collect();
    let bar = if opts.progress {
        ProgressBar::with_draw_target(Some(manifest.data_bytes()), ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template(
            "verifying [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    let started = Instant::now();
    let mut bad = Vec::new();
    let batch = opts.reader.queue_depth.max(1) * 2;
    for chunk in keys.chunks(batch) {
        for result in reader.read_many(chunk) {
            if let Err(e) = result {
                tracing::error!(%e, "corrupt record");
                bad.push(e);
            }
        }
        bar.inc((chunk.len() * manifest.record_size) as u64);
    }
    let seconds = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    if let Some(first) = bad.first() {
        return Err(StoreError::Corrupt {
            count: bad.len(),
            first: first.clone(),
        });
    }
    let mut compared = 0;
    if let Some((cfg, ckpt)) = source {
        let loader = Loader::new(ckpt);
        let record_format = match manifest.parts.gate.format {
            PartFormat::Rows(f) => RecordFormat::Rows(f),
            PartFormat::Exl3 { .. } => RecordFormat::Exl3,
        };
        let n = keys.len();
        let take = opts.sample.min(n);
        for s in 0..take {
            let (layer, expert) = keys[s * n / take];
            let record = reader.read(layer, expert)?;
            // Records hold the weights as the manifest says (pack-store --format, or EXL3
            // as the checkpoint stores it): build the source's bytes the same way.
            let want: Vec<u8> = expert_weights(
                cfg,
                loader.pp(&format!("layers.{layer}.mlp.experts")),
                expert,
                Some(record_format),
            )?
            .into_iter()
            .flat_map(|w| w.bytes)
            .collect();
            let got = record.bytes();
            if got != want.as_slice() {
                let byte = got
                    .iter()
                    .zip(&want)
                    .position(|(a, b)| a != b)
                    .unwrap_or(got.len().min(want.len()));
                return Err(StoreError::SourceMismatch {
                    layer,
                    expert,
                    offset: manifest.records[s * n / take].offset,
                    byte,
                });
            }
            compared += 1;
        }
    }
    Ok(VerifyReport {
        records: keys.len(),
        bytes: manifest.data_bytes(),
        seconds,
        engine: reader.engine_name(),
        compared,
        fingerprint_checked: false,
    })
}
