use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::quant::{dequantize_row, dot_row, quantize_row};

/// Heavy-tailed values (a cube of uniforms), as activations after a norm tend to be.
fn values(seed: u64, n: usize, spread: f32) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| spread * rng.random_range(-1.0f32..1.0).powi(3))
        .collect()
}

fn encoded(format: Format, w: &[f32]) -> Vec<u8> {
    let mut row = vec![0u8; format.row_bytes(w.len()).unwrap()];
    quantize_row(format, w, &mut row).unwrap();
    row
}

#[test]
fn quantized_rows_keep_each_value_within_half_a_step() {
    for (seed, n) in [(1u64, 256usize), (2, 1024), (3, 4096)] {
        let mut x = values(seed, n, 3.0);
        x[7] = 0.0;
        x[n - 1] = -x.iter().fold(0f32, |m, v| m.max(v.abs())); // a block's extreme, negative
        let q = Q16Row::quantize(&x).unwrap();
        assert_eq!(q.len(), n);
        let back = q.dequantize();
        for (i, (a, b)) in x.iter().zip(&back).enumerate() {
            // Half a step, plus the f32 roundings of `32767 / max`, of the product, of the
            // added half (at most 1/512 of a step each near 32767) and of `scale * q`.
            let step = q.scales[i / BLOCK];
            assert!((a - b).abs() <= 0.51 * step, "value {i}: {a} -> {b}");
        }
        for (s, part) in q.sums.iter().zip(q.q.chunks_exact(SUM)) {
            assert_eq!(*s, part.iter().map(|&v| i32::from(v)).sum::<i32>());
        }
        assert!(q.q.iter().all(|v| (-32767..=32767).contains(v)));
        assert_eq!(q.q[n - 1], -32767);
    }
    // A block of zeros has a zero scale and zero values.
    let q = Q16Row::quantize(&[0.0; 512]).unwrap();
    assert!(q.scales.iter().all(|&s| s == 0.0) && q.q.iter().all(|&v| v == 0));
}

#[test]
fn rows_it_cannot_quantize_are_refused() {
    assert!(Q16Row::quantize(&[1.0; 255]).is_none());
    let mut x = vec![1.0f32; 256];
    x[3] = f32::NAN;
    assert!(Q16Row::quantize(&x).is_none());
    x[3] = f32::INFINITY;
    assert!(Q16Row::quantize(&x).is_none());
    assert!(supported(Format::Q4K, 512));
    assert!(!supported(Format::Q4K, 288) && !supported(Format::Q8_0, 256));
}

/// The integer dot equals the exact dot of the dequantized weights and the quantized
/// activations up to the f32 rounding of its per-block combination, on every kernel, which
/// agree bit for bit; and it stays within the activations' rounding of the f32 kernel.
#[test]
fn integer_dots_match_the_dequantized_dot_on_every_kernel() {
    let format = Format::Q4K;
    for (seed, n) in [(10u64, 256usize), (11, 2048), (12, 4096)] {
        let w = values(seed, n, 1.0);
        let x = values(seed + 100, n, 4.0);
        let row = encoded(format, &w);
        let xq = Q16Row::quantize(&x).unwrap();
        let mut deq = vec![0f32; n];
        dequantize_row(format, &row, &mut deq).unwrap();
        let xd = xq.dequantize();
        let exact: f64 = deq
            .iter()
            .zip(&xd)
            .map(|(a, b)| f64::from(*a) * f64::from(*b))
            .sum();
        let scale: f64 = deq
            .iter()
            .zip(&xd)
            .map(|(a, b)| (f64::from(*a) * f64::from(*b)).abs())
            .sum();
        let p = dot_q4k_portable(&row, &xq);
        assert!(
            (f64::from(p) - exact).abs() <= 1e-5 * scale,
            "{format} n={n}: portable {p} vs {exact}"
        );
        if let Some(s) = dot_q4k_simd(&row, &xq) {
            assert_eq!(
                s.to_bits(),
                p.to_bits(),
                "{format} n={n}: simd {s} vs portable {p}"
            );
        }
        if let Some(s) = dot_q4k_wide(&row, &xq) {
            assert_eq!(
                s.to_bits(),
                p.to_bits(),
                "{format} n={n}: avx-512 {s} vs portable {p}"
            );
        }
        assert_eq!(dot_q4k(&row, &xq).to_bits(), p.to_bits());
        // Against the f32 kernel: each activation moved by at most half its block's step.
        let f = f64::from(dot_row(format, &row, &x));
        let bound: f64 = deq
            .iter()
            .enumerate()
            .map(|(i, a)| f64::from(a.abs()) * 0.5 * f64::from(xq.scales[i / BLOCK]))
            .sum();
        assert!(
            (f64::from(p) - f).abs() <= bound + 1e-5 * scale,
            "{format} n={n}: {p} vs f32 {f}, bound {bound}"
        );
    }
}

/// Q4_K at its largest nibbles and scales against activations at the top of their range stays
/// exact (no 16- or 32-bit overflow).
#[test]
fn integer_dots_do_not_overflow() {
    let n = 512;
    // Q4_K: every nibble 15, every scale 63, d = 1, no mins.
    let mut blk = [0u8; 144];
    blk[0..2].copy_from_slice(&half::f16::ONE.to_le_bytes());
    for j in 0..4 {
        blk[4 + j] = 63 | (3 << 6); // sc[j] = 63, top bits of sc[j + 4]
        blk[12 + j] = 0x0F; // low bits of sc[j + 4] = 15; m = 0
    }
    blk[16..].fill(0xFF);
    let row: Vec<u8> = blk.iter().copied().cycle().take(144 * (n / 256)).collect();
    let x = vec![-1.0f32; n];
    let xq = Q16Row::quantize(&x).unwrap();
    let want: f64 = x.iter().map(|v| 63.0 * 15.0 * f64::from(*v)).sum();
    let p = dot_q4k_portable(&row, &xq);
    assert_eq!(f64::from(p), want);
    if let Some(s) = dot_q4k_simd(&row, &xq) {
        assert_eq!(s, p);
    }
    if let Some(s) = dot_q4k_wide(&row, &xq) {
        assert_eq!(s, p);
    }
}

#[test]
#[should_panic(expected = "q4_k")]
fn integer_dot_panics_on_bad_shape() {
    let xq = Q16Row::quantize(&[0.5; 512]).unwrap();
    dot_q4k(&[0u8; 144], &xq);
}

/// Every kernel gives the portable kernel's bits on rows of random bytes (every scale, min and
/// nibble pattern a block can hold; d and dmin finite) against random activations.
#[test]
fn integer_dots_agree_bit_for_bit_on_random_blocks() {
    let mut rng = ChaCha8Rng::seed_from_u64(77);
    for case in 0..64 {
        let blocks = 1 + case % 17;
        let mut row = vec![0u8; 144 * blocks];
        rng.fill(&mut row[..]);
        for blk in row.chunks_exact_mut(144) {
            let d = half::f16::from_f32(rng.random_range(-0.05f32..0.05));
            let dmin = half::f16::from_f32(rng.random_range(-0.05f32..0.05));
            blk[0..2].copy_from_slice(&d.to_le_bytes());
            blk[2..4].copy_from_slice(&dmin.to_le_bytes());
        }
        let x = values(1000 + case as u64, 256 * blocks, 3.0);
        let xq = Q16Row::quantize(&x).unwrap();
        let p = dot_q4k_portable(&row, &xq);
        assert!(p.is_finite(), "case {case}");
        for (name, got) in [
            ("avx2", dot_q4k_simd(&row, &xq)),
            ("avx-512", dot_q4k_wide(&row, &xq)),
            ("dispatched", Some(dot_q4k(&row, &xq))),
        ] {
            if let Some(v) = got {
                assert_eq!(
                    v.to_bits(),
                    p.to_bits(),
                    "case {case} ({blocks} blocks): {name} {v} vs {p}"
                );
            }
        }
    }
}
