//! A packed store of random experts written directly, without a source checkpoint: for
//! benchmarks at GLM-5.3-Flash width, where one MoE layer is 288 x 25.2 M parameters and
//! quantizing them from floats (or keeping a checkpoint of them next to the store) would cost
//! more time and disk than the measurement.
//!
//! Records are laid out as `pack-store` lays out an expert of the chosen [`PartFormat`]:
//! valid blocks of a row format, or for EXL3 a random trellis (every int16 trellis is a valid
//! EXL3 weight) followed by f16 `suh` and `svh` of random signs times a scale, as exllamav3
//! writes them. Values have std about `1/sqrt(cols)` (a random linear layer's scale). The
//! store is bound to the model directory's quick fingerprint so the normal reader opens it;
//! the model needs no word on the experts' format, which the tiers read from the manifest.
//! The full fingerprint cannot be computed (there are no expert tensors to hash): it is set
//! to the quick one, so `verify-store` checks the records' sha256 but `verify-store --model`
//! refuses the store.

use super::manifest::{
    self, DATA, FORMAT_VERSION, MANIFEST, Manifest, Part, PartFormat, Parts, RecordEntry,
};
use super::{ALIGN, AlignedBuf, StoreError};
use crate::model::config::Config;
use crate::quant::Format;
use crate::quant::exl3::Exl3Linear;
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
    format: PartFormat,
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
    let parts = random_record_parts(&cfg, format)?;
    check_decodable(&parts)?;
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
                random_record(&parts, seed, index, &mut bytes[..parts.length()]);
                bytes[parts.length()..].fill(0);
                let sha256 = manifest::sha256_hex(&bytes[..parts.length()]);
                let crc32c = Some(manifest::crc32c(&bytes[..parts.length()]));
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
                    crc32c,
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

/// The layout of an expert of `cfg` with every weight in `format`: gate, up and down back to
/// back, each as long as its format needs (the layout `pack-store` gives such an expert).
pub fn random_record_parts(cfg: &Config, format: PartFormat) -> Result<Parts, StoreError> {
    record_parts(cfg.hidden_size, cfg.moe_intermediate_size, format)
}

/// The layout of an expert of width `i` over `d` hidden values, every weight in `format`.
pub fn record_parts(d: usize, i: usize, format: PartFormat) -> Result<Parts, StoreError> {
    let part = |rows: usize, cols: usize, offset: usize| -> Result<Part, StoreError> {
        let mut p = Part {
            format,
            rows,
            cols,
            offset,
            length: 0,
        };
        p.length = p
            .expected_length()
            .map_err(|e| StoreError::Other(format!("{} rows of {cols}: {e}", format.describe())))?;
        Ok(p)
    };
    let gate = part(i, d, 0)?;
    let up = part(i, d, gate.length)?;
    let down = part(d, i, gate.length + up.length)?;
    Ok(Parts { gate, up, down })
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

/// Refuses a layout the tiers could not decode (an EXL3 weight's widths must be multiples of
/// its Hadamard block) before a byte of the store is written.
fn check_decodable(parts: &Parts) -> Result<(), StoreError> {
    for p in parts.all() {
        if let PartFormat::Exl3 { rate, codebook } = p.format {
            Exl3Linear::from_stored(p.cols, p.rows, rate, codebook, &vec![0; p.length]).map_err(
                |e| {
                    StoreError::Other(format!(
                        "an expert weight of {} outputs x {} inputs as {}: {e}",
                        p.rows,
                        p.cols,
                        p.format.describe()
                    ))
                },
            )?;
        }
    }
    Ok(())
}

/// Fills `out` with a random weight of `part`'s shape and format whose values have std about
/// `1/sqrt(cols)`.
/// Record `index`'s bytes (`parts.length()` of them) for the random store of `seed`.
pub fn random_record(parts: &Parts, seed: u64, index: usize, out: &mut [u8]) {
    let mut rng =
        ChaCha8Rng::seed_from_u64(seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    for p in parts.all() {
        random_weight(&mut out[p.offset..p.offset + p.length], p, &mut rng);
    }
}

fn random_weight(out: &mut [u8], part: &Part, rng: &mut ChaCha8Rng) {
    match part.format {
        PartFormat::Rows(format) => random_blocks(out, format, part.cols, rng),
        PartFormat::Exl3 { rate, .. } => {
            // Trellis states decode to values of std about 1 (mul1: a sum of four random
            // bytes, scaled), which the orthonormal Hadamard rotations keep; suh and svh are
            // signs times cols^-1/4 each, so the weight's values have std about 1/sqrt(cols).
            let (trellis, scales) = out.split_at_mut(rate.trellis_bytes(part.cols, part.rows));
            rng.fill_bytes(trellis);
            let scale = (part.cols as f32).powf(-0.25);
            for v in scales.chunks_exact_mut(2) {
                let signed = if rng.next_u32() & 1 == 0 {
                    scale
                } else {
                    -scale
                };
                v.copy_from_slice(&half::f16::from_f32(signed).to_le_bytes());
            }
        }
    }
}

/// Fills `out` (whole rows of `cols` values in `format`) with random blocks whose values have
/// std about `1/sqrt(cols)`.
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
    use crate::quant::exl3::{Codebook, Rate};
    use crate::store::{VerifyOptions, verify_store};
    use crate::tiers::source::{ExpertSource, StoreSource};

    fn disk_tempdir() -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix("glmflash-random-store")
            .tempdir_in(std::env::var("CARGO_TARGET_TMPDIR").unwrap_or("/var/tmp".into()))
            .unwrap()
    }

    fn exl3_3() -> PartFormat {
        PartFormat::Exl3 {
            rate: Rate::from_bits(3.0).unwrap(),
            codebook: Codebook::Mul1,
        }
    }

    /// Every record of both kinds opens through the normal reader, decodes into the
    /// format's matrices with values of the planned scale, and passes verify-store (which
    /// refuses it with `--model`, having no expert tensors to fingerprint).
    #[test]
    fn random_store_opens_reads_checked_records_and_has_the_planned_scale() {
        for format in [PartFormat::Rows(Format::Q4K), exl3_3()] {
            let tmp = disk_tempdir();
            let (model, store) = (tmp.path().join("model"), tmp.path().join("store"));
            let config = scaled_config(64, 256, 2, 1, 4, 512, 2);
            let cfg = write_random_dense_checkpoint(&model, &config, 3, DType::Bf16).unwrap();
            let ckpt = crate::model::checkpoint::Checkpoint::open(&model).unwrap();
            assert!(!ckpt.keys().iter().any(|k| k.contains(".experts.")));
            let calls = AtomicUsize::new(0);
            let m = write_random_store(&model, &store, format, 9, &|_, total| {
                assert_eq!(total, 4);
                calls.fetch_add(1, Ordering::Relaxed);
            })
            .unwrap();
            assert_eq!(calls.into_inner(), 4);
            assert_eq!((m.layers.clone(), m.records.len()), (vec![1], 4));
            assert_eq!(m.parts, random_record_parts(&cfg, format).unwrap());
            let source = StoreSource::open(&store, &model, &cfg).unwrap();
            for e in 0..4 {
                let x = source.load(1, e).unwrap();
                for (w, cols) in [(&x.gate, 256), (&x.up, 256), (&x.down, 512)] {
                    assert_eq!(w.cols(), cols);
                    assert_eq!(w.exl3().is_some(), format == exl3_3());
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
                    let what = format.describe();
                    assert!(values.iter().all(|v| v.is_finite()));
                    assert!(mean.abs() < 0.1 * want, "{what}: mean {mean}");
                    assert!(
                        (std / want - 1.0).abs() < 0.2,
                        "{what}: std {std} vs {want}"
                    );
                }
            }
            let quiet = VerifyOptions {
                progress: false,
                ..VerifyOptions::default()
            };
            let report = verify_store(&store, None, &quiet).unwrap();
            assert_eq!((report.records, report.bytes), (4, m.data_bytes()));
            assert!(verify_store(&store, Some(&model), &quiet).is_err());
            // A changed non-expert weight unbinds the store until it is rebound.
            let mut other = config.clone();
            other["rms_norm_eps"] = serde_json::json!(1e-6);
            std::fs::write(model.join("config.json"), other.to_string()).unwrap();
            assert!(StoreSource::open(&store, &model, &cfg).is_err());
            rebind_random_store(&model, &store).unwrap();
            assert!(StoreSource::open(&store, &model, &cfg).is_ok());
        }
    }

    /// EXL3 records are laid out as pack-store lays out an EXL3 checkpoint's expert: each
    /// weight its 3-bit trellis then f16 suh (inputs) and svh (outputs), gate | up | down.
    /// A width that is no multiple of the Hadamard block is refused before anything is
    /// written; a flipped byte fails verify-store.
    #[test]
    fn exl3_records_have_pack_stores_layout_and_are_checked() {
        let tmp = disk_tempdir();
        let (model, store) = (tmp.path().join("model"), tmp.path().join("store"));
        let config = scaled_config(64, 128, 2, 1, 3, 256, 2);
        write_random_dense_checkpoint(&model, &config, 5, DType::Bf16).unwrap();
        let m = write_random_store(&model, &store, exl3_3(), 1, &|_, _| {}).unwrap();
        let (d, i) = (128, 256);
        let mut offset = 0;
        for (p, (rows, cols)) in m.parts.all().into_iter().zip([(i, d), (i, d), (d, i)]) {
            assert_eq!(
                (p.format, p.rows, p.cols, p.offset),
                (exl3_3(), rows, cols, offset)
            );
            assert_eq!(p.length, rows * cols * 3 / 8 + 2 * (rows + cols));
            offset += p.length;
        }
        let text = std::fs::read_to_string(store.join(MANIFEST)).unwrap();
        assert!(text.contains(r#""format":"exl3""#) && text.contains(r#""codebook":"mul1""#));
        // suh and svh are signs times one scale each, as exllamav3's are.
        let data = std::fs::read(store.join(DATA)).unwrap();
        let down = &m.parts.down;
        let scales = &data[down.offset + 3 * d * i / 8..down.offset + down.length];
        let values: Vec<f32> = scales
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect();
        let scale = half::f16::from_f32((i as f32).powf(-0.25)).to_f32();
        assert_eq!(values.len(), i + d);
        assert!(values.iter().all(|v| v.abs() == scale));
        assert!(values.iter().any(|v| *v < 0.0) && values.iter().any(|v| *v > 0.0));

        let narrow = tmp.path().join("narrow");
        let odd = scaled_config(64, 128, 2, 1, 3, 192, 2);
        write_random_dense_checkpoint(&narrow, &odd, 5, DType::Bf16).unwrap();
        let err = write_random_store(
            &narrow,
            &tmp.path().join("refused"),
            exl3_3(),
            1,
            &|_, _| {},
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("multiples of 128"), "{err}");
        assert!(!tmp.path().join("refused").join(DATA).exists());

        let mut bytes = data;
        bytes[m.records[2].offset as usize + 17] ^= 1;
        std::fs::write(store.join(DATA), &bytes).unwrap();
        let quiet = VerifyOptions {
            progress: false,
            ..VerifyOptions::default()
        };
        let err = verify_store(&store, None, &quiet).unwrap_err().to_string();
        assert!(err.contains("1 corrupt record"), "{err}");
    }
}
