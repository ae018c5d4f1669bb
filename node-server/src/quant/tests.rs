use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;

fn gaussian(seed: u64, n: usize) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            // Box-Muller; 1 - u keeps the log argument in (0, 1].
            let u: f64 = 1.0 - rng.random::<f64>();
            let v: f64 = rng.random();
            ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
        })
        .collect()
}

fn round_trip(format: Format, src: &[f32]) -> Vec<f32> {
    let mut bytes = vec![0u8; format.row_bytes(src.len()).unwrap()];
    quantize_row(format, src, &mut bytes).unwrap();
    let mut out = vec![0.0f32; src.len()];
    dequantize_row(format, &bytes, &mut out).unwrap();
    out
}

fn rel_rms(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2))
        .sum();
    let den: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum();
    (num / den).sqrt()
}

#[test]
fn sizes_and_names() {
    let expect = [
        (Format::F32, 1, 4, "f32"),
        (Format::F16, 1, 2, "f16"),
        (Format::Bf16, 1, 2, "bf16"),
        (Format::Q8_0, 32, 34, "q8_0"),
        (Format::Q4K, 256, 144, "q4_k"),
    ];
    for (f, bv, bb, name) in expect {
        assert_eq!(f.block_values(), bv);
        assert_eq!(f.block_bytes(), bb);
        assert_eq!(f.name(), name);
        assert_eq!(Format::from_name(name).unwrap(), f);
        assert_eq!(Format::from_name(&name.to_uppercase()).unwrap(), f);
        assert_eq!(serde_json::to_string(&f).unwrap(), format!("\"{name}\""));
        assert_eq!(
            serde_json::from_str::<Format>(&format!("\"{name}\"")).unwrap(),
            f
        );
        assert_eq!(f.row_bytes(4096).unwrap(), 4096 / bv * bb);
    }
    assert_eq!(Format::Q4K.row_bytes(0).unwrap(), 0);
}

#[test]
fn errors_name_format_and_numbers() {
    let e = Format::Q4K.row_bytes(300).unwrap_err().to_string();
    assert!(
        e.contains("q4_k") && e.contains("300") && e.contains("256"),
        "{e}"
    );
    let e = Format::from_name("q5_k").unwrap_err().to_string();
    assert!(e.contains("q5_k"), "{e}");
    let mut dst = vec![0u8; 33];
    let e = quantize_row(Format::Q8_0, &[0.0; 32], &mut dst)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("q8_0") && e.contains("33") && e.contains("34"),
        "{e}"
    );
    let mut out = vec![0.0f32; 64];
    let e = dequantize_row(Format::F16, &[0u8; 100], &mut out)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("f16") && e.contains("100") && e.contains("128"),
        "{e}"
    );
    let mut src = vec![0.5f32; 256];
    src[77] = f32::NAN;
    let mut dst = vec![0u8; 144];
    let e = quantize_row(Format::Q4K, &src, &mut dst)
        .unwrap_err()
        .to_string();
    assert!(e.contains("q4_k") && e.contains("77"), "{e}");
}

#[test]
fn float_formats_round_trip() {
    let src = gaussian(1, 1000);
    assert_eq!(round_trip(Format::F32, &src), src);
    for (f, tol) in [(Format::F16, 1.0 / 2048.0), (Format::Bf16, 1.0 / 256.0)] {
        for (a, b) in src.iter().zip(round_trip(f, &src)) {
            assert!((a - b).abs() <= tol * a.abs() + 1e-7, "{f}: {a} vs {b}");
        }
    }
    // Little-endian, round-to-nearest-even encodings.
    let mut b = [0u8; 2];
    quantize_row(Format::F16, &[1.0], &mut b).unwrap();
    assert_eq!(b, [0x00, 0x3c]);
    quantize_row(Format::Bf16, &[1.0 + 1.0 / 256.0], &mut b).unwrap();
    assert_eq!(b, [0x80, 0x3f], "tie rounds to even");
    let mut b4 = [0u8; 4];
    quantize_row(Format::F32, &[1.5], &mut b4).unwrap();
    assert_eq!(b4, 1.5f32.to_le_bytes());
}

#[test]
fn q8_0_error_is_small() {
    let src = gaussian(2, 64 * 1024);
    let err = rel_rms(&src, &round_trip(Format::Q8_0, &src));
    eprintln!("q8_0 relative RMS error {err}");
    assert!(err < 0.01, "q8_0 relative RMS error {err}");
}

#[test]
fn q4k_error_is_small() {
    let src = gaussian(3, 64 * 1024);
    let err = rel_rms(&src, &round_trip(Format::Q4K, &src));
    eprintln!("q4_k relative RMS error {err}");
    assert!(err < 0.08, "q4_k relative RMS error {err}");
}

#[test]
fn quantizers_handle_edge_blocks() {
    for f in [Format::Q8_0, Format::Q4K] {
        let n = 512;
        // Zeros, a constant, all-positive, all-negative, tiny and huge values.
        let cases: Vec<Vec<f32>> = vec![
            vec![0.0; n],
            vec![3.25; n],
            vec![-0.75; n],
            (0..n).map(|i| 1.0 + i as f32 / 100.0).collect(),
            (0..n).map(|i| -1.0 - i as f32 / 100.0).collect(),
            (0..n).map(|i| (i as f32 - 256.0) * 1e-9).collect(),
            (0..n).map(|i| (i as f32 - 256.0) * 1e4).collect(),
        ];
        for (k, src) in cases.iter().enumerate() {
            let out = round_trip(f, src);
            assert!(out.iter().all(|v| v.is_finite()), "{f} case {k}");
            let err = rel_rms(src, &out);
            // Case 5 is below f16 resolution of the scale: it may flush to zero.
            let bound = if k == 5 { 1.0 + 1e-9 } else { 0.1 };
            assert!(err.is_nan() || err < bound, "{f} case {k}: rel rms {err}");
        }
    }
}

fn check_dots(format: Format, n: usize, seed: u64) {
    let w = gaussian(seed, n);
    let x = gaussian(seed + 1000, n);
    let mut row = vec![0u8; format.row_bytes(n).unwrap()];
    quantize_row(format, &w, &mut row).unwrap();
    let mut deq = vec![0.0f32; n];
    dequantize_row(format, &row, &mut deq).unwrap();
    let exact: f64 = deq
        .iter()
        .zip(&x)
        .map(|(a, b)| f64::from(*a) * f64::from(*b))
        .sum();
    let scale: f64 = deq
        .iter()
        .zip(&x)
        .map(|(a, b)| (f64::from(*a) * f64::from(*b)).abs())
        .sum();
    let tol = 1e-5 * scale + 1e-30;
    let p = dot_row_portable(format, &row, &x);
    assert!(
        (f64::from(p) - exact).abs() <= tol,
        "{format} n={n}: portable {p} vs {exact}"
    );
    if let Some(s) = dot_row_simd(format, &row, &x) {
        assert!(
            (f64::from(s) - exact).abs() <= tol,
            "{format} n={n}: simd {s} vs {exact}"
        );
    }
    let d = dot_row(format, &row, &x);
    assert!((f64::from(d) - exact).abs() <= tol, "{format} n={n}: {d}");
}

#[test]
fn dot_paths_agree_with_dequantized_dot() {
    for f in Format::ALL {
        let bv = f.block_values();
        for blocks in [0usize, 1, 2, 3, 7, 16] {
            check_dots(f, blocks * bv.max(32), 10 + blocks as u64);
        }
    }
    // Float rows of any length (SIMD tail handling).
    for f in [Format::F32, Format::F16, Format::Bf16] {
        for n in [1usize, 5, 31, 33, 63, 100, 4097] {
            check_dots(f, n, 99 + n as u64);
        }
    }
}

#[test]
fn dot_reads_unaligned_rows() {
    for f in Format::ALL {
        let n = 1024;
        let w = gaussian(7, n);
        let x = gaussian(8, n);
        let len = f.row_bytes(n).unwrap();
        let mut buf = vec![0u8; len + 3];
        for off in 0..4 {
            quantize_row(f, &w, &mut buf[off..off + len]).unwrap();
            let row = &buf[off..off + len];
            let p = dot_row_portable(f, row, &x);
            let s = dot_row_simd(f, row, &x).unwrap_or(p);
            assert!((p - s).abs() <= 1e-4 * p.abs().max(1.0), "{f} off {off}");
        }
    }
}

#[test]
#[should_panic(expected = "q4_k")]
fn dot_panics_on_bad_shape() {
    dot_row(Format::Q4K, &[0u8; 144], &[0.0; 255]);
}

#[test]
fn features_are_consistent() {
    let f = cpu_features();
    assert_eq!(f.simd_supported(), f.avx2 && f.fma && f.f16c);
    if f.simd_active() {
        assert!(f.simd_supported());
    }
}
