//! A packed store of random experts written directly, without a source checkpoint: for
//! benchmarks at GLM-5.3-Flash width, where one MoE layer is 288 x 25.2 M parameters and
//! quantizing them from floats (or keeping a checkpoint of them next to the store) would cost
//! more time and disk than the measurement.
//!
//! Records are valid blocks of the chosen format with values of std about `1/sqrt(cols)`
//! (a random linear layer's scale), bound to the model directory's quick fingerprint so the
//! normal reader opens the store. The full fingerprint cannot be computed (there are no
//! expert tensors to hash): it is set to the quick one, so `verify-store` checks the records'
//! sha256 but `verify-store --model` refuses the store.

use super::manifest::{
    self, DATA, FORMAT_VERSION, MANIFEST, Manifest, Part, PartFormat, Parts, RecordEntry,
};
use super::{ALIGN, AlignedBuf, StoreError};
use crate::model::config::Config;
use crate::quant::Format;
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Writes `experts.bin` and `experts.json` into `store` for the MoE layers of the model in
/// `model` (a checkpoint without routed experts is enough), every weight in `format`.
/// `progress` is called with (records written, total).
pub fn write_random_store(
    model: &Path,
    store: &Path,
    format: Format,
    seed: u64,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> Result<Manifest, StoreError> {
    let cfg = Config::from_file(&model.join("config.json"))
        .map_err(|e| StoreError::Other(format!("{}: {e}", model.display())))?;
    let layers = manifest::moe_layers(&cfg);
    if layers.is_empty() {
        return Err(StoreError::Other(format!(
            "{}: the model has no MoE layers",
            model.display()
        )));
    }
    let (d, i) = (cfg.hidden_size, cfg.moe_intermediate_size);
    let part = |rows: usize, cols: usize, offset: usize| -> Result<Part, StoreError> {
        let row = format
            .row_bytes(cols)
            .map_err(|e| StoreError::Other(format!("{} rows of {cols}: {e}", format.name())))?;
        Ok(Part {
            format: PartFormat::Rows(format),
            rows,
            cols,
            offset,
            length: rows * row,
        })
    };
    let gate = part(i, d, 0)?;
    let up = part(i, d, gate.length)?;
    let down = part(d, i, gate.length + up.length)?;
    let parts = Parts { gate, up, down };
    let record_size = super::aligned::align_up(parts.length());
    let experts = cfg.n_routed_experts;
    let total = layers.len() * experts;

    std::fs::create_dir_all(store).map_err(|source| StoreError::Io {
        path: store.display().to_string(),
        source,
    })?;
    let data_path = store.join(DATA);
    let file = super::io::open_direct(&data_path, true).map_err(|e| match e {
        super::io::DirectOpenError::Unsupported => StoreError::NoDirectIo {
            path: data_path.display().to_string(),
        },
        super::io::DirectOpenError::Io(source) => StoreError::Io {
            path: data_path.display().to_string(),
            source,
        },
    })?;
    let io = |source: std::io::Error| StoreError::Io {
        path: data_path.display().to_string(),
        source,
    };
    file.set_len((total * record_size) as u64).map_err(io)?;
    let done = AtomicUsize::new(0);
    let records: Vec<RecordEntry> = (0..total)
        .into_par_iter()
        .map_init(
            || AlignedBuf::new(record_size),
            |buf, index| -> Result<RecordEntry, StoreError> {
                let bytes = buf.as_mut_slice();
                let mut rng = ChaCha8Rng::seed_from_u64(
                    seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
                );
                for p in parts.all() {
                    random_blocks(
                        &mut bytes[p.offset..p.offset + p.length],
                        format,
                        p.cols,
                        &mut rng,
                    );
                }
                bytes[parts.length()..].fill(0);
                let sha256 = manifest::sha256_hex(&bytes[..parts.length()]);
                let offset = (index * record_size) as u64;
                file.write_all_at(bytes, offset).map_err(io)?;
                let n = done.fetch_add(1, Ordering::Relaxed) + 1;
                progress(n, total);
                Ok(RecordEntry {
                    layer: layers[index / experts],
                    expert: index % experts,
                    offset,
                    length: parts.length(),
                    sha256,
                })
            },
        )
        .collect::<Result<_, _>>()?;
    file.sync_all().map_err(io)?;
    let quick = manifest::quick_fingerprint(model)?;
    let m = Manifest {
        format_version: FORMAT_VERSION,
        fingerprint: quick.clone(),
        quick_fingerprint: quick,
        record_size,
        alignment: ALIGN,
        experts_per_layer: experts,
        layers,
        parts,
        layer_parts: Default::default(),
        records,
    };
    let text = serde_json::to_string(&m).map_err(|e| StoreError::Other(e.to_string()))?;
    std::fs::write(store.join(MANIFEST), text).map_err(|source| StoreError::Io {
        path: store.join(MANIFEST).display().to_string(),
        source,
    })?;
    Ok(m)
}

/// Rebinds `store` to the model in `model` after its non-expert weights changed (a
/// benchmark rewriting router biases): the manifest takes the model's quick fingerprint.
pub fn rebind_random_store(model: &Path, store: &Path) -> Result<(), StoreError> {
    let mut m = Manifest::load(store)?;
    let quick = manifest::quick_fingerprint(model)?;
    m.fingerprint = quick.clone();
    m.quick_fingerprint = quick;
    let text = serde_json::to_string(&m).map_err(|e| StoreError::Other(e.to_string()))?;
    std::fs::write(store.join(MANIFEST), text).map_err(|source| StoreError::Io {
        path: store.join(MANIFEST).display().to_string(),
        source,
    })
}

/// Fills `out` (whole rows of `cols` values in `format`) with random blocks whose values have std about
/// `1/sqrt(cols)`.
fn random_blocks(out: &mut [u8], format: Format, cols: usize, rng: &mut ChaCha8Rng) {
    let std = 1.0 / (cols as f32).sqrt();
    match format {
        Format::Q4K => {
            // Block: d (f16), dmin (f16), 12 bytes of 6-bit scales and mins, 128 bytes of
            // nibbles. With scale, min uniform in 0..64 and q in 0..16, a value d*sc*q - dmin*m
            // has mean 0 when dmin = 7.5 d and std about 258 d.
            rng.fill_bytes(out);
            let d = half::f16::from_f32(std / 258.0).to_le_bytes();
            let dmin = half::f16::from_f32(7.5 * std / 258.0).to_le_bytes();
            for block in out.chunks_exact_mut(Format::Q4K.block_bytes()) {
                block[0..2].copy_from_slice(&d);
                block[2..4].copy_from_slice(&dmin);
            }
        }
        Format::Q8_0 => {
            // Block: d (f16) then 32 int8; uniform int8 has std about 74.
            rng.fill_bytes(out);
            let d = half::f16::from_f32(std / 74.0).to_le_bytes();
            for block in out.chunks_exact_mut(Format::Q8_0.block_bytes()) {
                block[0..2].copy_from_slice(&d);
            }
        }
        Format::F32 | Format::F16 | Format::Bf16 => {
            let bound = std * 3f32.sqrt();
            let width = format.block_bytes();
            for v in out.chunks_exact_mut(width) {
                let x = (rng.next_u32() as f32 / u32::MAX as f32 * 2.0 - 1.0) * bound;
                match format {
                    Format::F32 => v.copy_from_slice(&x.to_le_bytes()),
                    Format::F16 => v.copy_from_slice(&half::f16::from_f32(x).to_le_bytes()),
                    _ => v.copy_from_slice(&half::bf16::from_f32(x).to_le_bytes()),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::checkpoint::DType;
    use crate::model::random::{scaled_config, write_random_dense_checkpoint};
    use crate::tiers::source::{ExpertSource, StoreSource};

    #[test]
    fn random_store_opens_reads_checked_records_and_has_the_planned_scale() {
        let tmp = tempfile::Builder::new()
            .prefix("glmflash-random-store")
            .tempdir_in(std::env::var("CARGO_TARGET_TMPDIR").unwrap_or("/var/tmp".into()))
            .unwrap();
        let (model, store) = (tmp.path().join("model"), tmp.path().join("store"));
        let config = scaled_config(64, 256, 2, 1, 4, 512, 2);
        let cfg = write_random_dense_checkpoint(&model, &config, 3, DType::Bf16).unwrap();
        let ckpt = crate::model::checkpoint::Checkpoint::open(&model).unwrap();
        assert!(!ckpt.keys().iter().any(|k| k.contains(".experts.")));
        let calls = AtomicUsize::new(0);
        let m = write_random_store(&model, &store, Format::Q4K, 9, &|_, total| {
            assert_eq!(total, 4);
            calls.fetch_add(1, Ordering::Relaxed);
        })
        .unwrap();
        assert_eq!(calls.into_inner(), 4);
        assert_eq!((m.layers.clone(), m.records.len()), (vec![1], 4));
        let source = StoreSource::open(&store, &model, &cfg).unwrap();
        for e in 0..4 {
            let x = source.load(1, e).unwrap();
            for (w, cols) in [(&x.gate, 256), (&x.up, 256), (&x.down, 512)] {
                assert_eq!(w.cols(), cols);
                let values: Vec<f32> = (0..w.rows()).flat_map(|r| w.row_f32(r)).collect();
                let n = values.len() as f64;
                let mean = values.iter().map(|&v| v as f64).sum::<f64>() / n;
                let std = (values
                    .iter()
                    .map(|&v| (v as f64 - mean).powi(2))
                    .sum::<f64>()
                    / n)
                    .sqrt();
                let want = 1.0 / (cols as f64).sqrt();
                assert!(values.iter().all(|v| v.is_finite()));
                assert!(mean.abs() < 0.1 * want, "mean {mean}");
                assert!((std / want - 1.0).abs() < 0.2, "std {std} vs {want}");
            }
        }
        // A changed non-expert weight unbinds the store until it is rebound.
        let mut other = config.clone();
        other["rms_norm_eps"] = serde_json::json!(1e-6);
        std::fs::write(model.join("config.json"), other.to_string()).unwrap();
        assert!(StoreSource::open(&store, &model, &cfg).is_err());
        rebind_random_store(&model, &store).unwrap();
        assert!(StoreSource::open(&store, &model, &cfg).is_ok());
    }
}
