//! Cross-checks glmflash's Q4_K / Q8_0 decoders and dot kernels against the
//! Python `gguf` package (see `e2e/quant_reference.py`).
//!
//! Fixture dir: `$GLMFLASH_QUANT_FIXTURES` if set, else the committed
//! `e2e/fixtures/quant/` (seed 0). It holds `<fmt>.bin` (random blocks) and
//! `<fmt>.f32` (gguf's decoding), and optionally `ours_<fmt>.bin` (blocks from
//! our quantizer, see `export_our_blocks`) with `ours_<fmt>.gguf.f32`.
//!
//! Decoding must match gguf bit for bit: GGML computes `d * q` (Q8_0) and
//! `(d * sc) * q - dmin * m` (Q4_K) with separately rounded f32 operations,
//! and so do we. Dot products are compared with an f64 reference over gguf's
//! values with a tolerance of `1e-5 * sum |w_i x_i|` (relative to the
//! magnitude of the terms, since the sum itself may cancel).

use std::path::{Path, PathBuf};

use glmflash_node::quant::{
    Format, dequantize_row, dot_row, dot_row_portable, dot_row_simd, quantize_row,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const FORMATS: [Format; 2] = [Format::Q4K, Format::Q8_0];
/// Input for `export_our_blocks`: this many values per format.
const OURS_VALUES: usize = 4096;
const OURS_SEED: u64 = 20_260_530;

fn fixture_dir() -> PathBuf {
    match std::env::var_os("GLMFLASH_QUANT_FIXTURES") {
        Some(d) => PathBuf::from(d),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../e2e/fixtures/quant"),
    }
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (generate with e2e/quant_reference.py)",
            path.display()
        )
    })
}

fn read_f32(path: &Path) -> Vec<f32> {
    let b = read(path);
    assert_eq!(b.len() % 4, 0, "{}", path.display());
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn random_x(seed: u64, n: usize) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// Asserts our decoding of `blocks` equals `expected` bitwise, and that every
/// dot path matches the f64 dot of `expected` with x, row by row.
fn check_against(format: Format, blocks: &[u8], expected: &[f32], what: &str) {
    let n = expected.len();
    assert_eq!(
        blocks.len(),
        format.row_bytes(n).unwrap(),
        "{what}: {} bytes vs {n} values",
        blocks.len()
    );
    assert!(n > 0, "{what}: empty fixture");

    let mut ours = vec![0.0f32; n];
    dequantize_row(format, blocks, &mut ours).unwrap();
    let mismatches: Vec<_> = ours
        .iter()
        .zip(expected)
        .enumerate()
        .filter(|(_, (a, b))| a.to_bits() != b.to_bits())
        .take(5)
        .collect();
    assert!(
        mismatches.is_empty(),
        "{what}: dequantize differs from gguf (index, (ours, gguf)): {mismatches:?}"
    );

    // Dots over rows of up to 1024 values (several blocks each).
    let row_values = n.min(1024);
    assert_eq!(n % row_values, 0);
    let row_bytes = format.row_bytes(row_values).unwrap();
    let x = random_x(n as u64, row_values);
    let simd_available = dot_row_simd(format, &blocks[..row_bytes], &x).is_some();
    for (r, (row, w)) in blocks
        .chunks_exact(row_bytes)
        .zip(expected.chunks_exact(row_values))
        .enumerate()
    {
        let exact: f64 = w
            .iter()
            .zip(&x)
            .map(|(a, b)| f64::from(*a) * f64::from(*b))
            .sum();
        let mag: f64 = w
            .iter()
            .zip(&x)
            .map(|(a, b)| (f64::from(*a) * f64::from(*b)).abs())
            .sum();
        let tol = 1e-5 * mag;
        let mut results = vec![
            ("portable", dot_row_portable(format, row, &x)),
            ("dispatch", dot_row(format, row, &x)),
        ];
        if let Some(s) = dot_row_simd(format, row, &x) {
            results.push(("simd", s));
        }
        for (path, got) in results {
            assert!(
                (f64::from(got) - exact).abs() <= tol,
                "{what} row {r}: {path} dot {got} vs gguf reference {exact} (tol {tol})"
            );
        }
    }
    eprintln!(
        "{what}: {n} values bit-exact; dots ok (simd path {})",
        if simd_available {
            "checked"
        } else {
            "not available on this CPU"
        }
    );
}

#[test]
fn random_blocks_match_gguf() {
    let dir = fixture_dir();
    for f in FORMATS {
        let blocks = read(&dir.join(format!("{}.bin", f.name())));
        let expected = read_f32(&dir.join(format!("{}.f32", f.name())));
        check_against(f, &blocks, &expected, &format!("{} random", f.name()));
    }
}

#[test]
fn our_blocks_decode_identically_in_gguf() {
    let dir = fixture_dir();
    let mut checked = 0;
    for f in FORMATS {
        let bin = dir.join(format!("ours_{}.bin", f.name()));
        let deq = dir.join(format!("ours_{}.gguf.f32", f.name()));
        if !bin.exists() && std::env::var_os("GLMFLASH_QUANT_FIXTURES").is_some() {
            // A fresh CI dir may hold only the random blocks.
            continue;
        }
        let blocks = read(&bin);
        let expected = read_f32(&deq);
        check_against(f, &blocks, &expected, &format!("{} ours", f.name()));
        // gguf's view of our blocks must also be close to the input we
        // quantized (catches a self-consistent but non-GGML packing).
        let input = our_input();
        let num: f64 = input
            .iter()
            .zip(&expected)
            .map(|(a, b)| (f64::from(*a) - f64::from(*b)).powi(2))
            .sum();
        let den: f64 = input.iter().map(|a| f64::from(*a).powi(2)).sum();
        let err = (num / den).sqrt();
        let bound = if f == Format::Q4K { 0.08 } else { 0.01 };
        assert!(
            err < bound,
            "{}: gguf decode of ours, rel RMS {err}",
            f.name()
        );
        checked += 1;
    }
    eprintln!("checked {checked} formats of our blocks");
}

/// Deterministic Gaussian input for our quantizer (Box-Muller).
fn our_input() -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(OURS_SEED);
    (0..OURS_VALUES)
        .map(|_| {
            let u: f64 = 1.0 - rng.random::<f64>();
            let v: f64 = rng.random();
            ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
        })
        .collect()
}

/// With `GLMFLASH_QUANT_OURS_OUT=DIR`, writes `DIR/ours_input.f32` and our
/// quantization of it as `DIR/ours_q4_k.bin` / `DIR/ours_q8_0.bin` for
/// `e2e/quant_reference.py --ours`. Without the variable it only checks the
/// committed blocks are what the current quantizer produces (informational).
#[test]
fn export_our_blocks() {
    let input = our_input();
    let out = std::env::var_os("GLMFLASH_QUANT_OURS_OUT").map(PathBuf::from);
    if let Some(dir) = &out {
        std::fs::create_dir_all(dir).unwrap();
        let bytes: Vec<u8> = input.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(dir.join("ours_input.f32"), bytes).unwrap();
    }
    for f in FORMATS {
        let mut blocks = vec![0u8; f.row_bytes(input.len()).unwrap()];
        quantize_row(f, &input, &mut blocks).unwrap();
        match &out {
            Some(dir) => {
                std::fs::write(dir.join(format!("ours_{}.bin", f.name())), &blocks).unwrap()
            }
            None => {
                let committed = fixture_dir().join(format!("ours_{}.bin", f.name()));
                if std::fs::read(&committed).ok().as_deref() != Some(&blocks[..]) {
                    eprintln!(
                        "note: {} differs from the current quantizer's output; \
                         regenerate the fixture if the quantizer changed on purpose",
                        committed.display()
                    );
                }
            }
        }
    }
}
