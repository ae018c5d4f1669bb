use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::trellis::{self, TILE_VALUES};
use super::*;

const CODEBOOKS: [Codebook; 3] = [Codebook::Inst3, Codebook::Mcg, Codebook::Mul1];
/// Tile lengths (int16 words) of every rate EXL3 defines.
const TILE_LENS: [usize; 11] = [16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128];

fn random_bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random()).collect()
}

fn random_f32(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| (rng.random::<f32>() * 2.0 - 1.0) * scale)
        .collect()
}

#[cfg(target_arch = "x86_64")]
fn simd_isas() -> Vec<simd_x86::Isa> {
    [simd_x86::Isa::Avx2, simd_x86::Isa::Avx512Vnni]
        .into_iter()
        .filter(|isa| isa.supported())
        .collect()
}

fn supported(cb: Codebook, len: usize) -> bool {
    cb == Codebook::Mul1 || len.is_multiple_of(16)
}

fn random_linear(seed: u64, k: usize, n: usize, len: usize, cb: Codebook) -> Exl3Linear {
    let trellis = random_bytes(seed, k / 16 * n / 16 * len * 2);
    let suh = random_f32(seed + 1, k, 0.1);
    let svh = random_f32(seed + 2, n, 0.1);
    Exl3Linear::new(&[k / 16, n / 16, len], &trellis, suh, svh, cb).unwrap()
}

/// `x W` in f64 from `What` and the definition `W = diag(suh) H What H diag(svh)`.
fn product_f64(lin: &Exl3Linear, x: &[f32], rows: usize) -> Vec<f64> {
    let (k, n) = (lin.in_features(), lin.out_features());
    let what = lin.reconstruct();
    let mut y = vec![0f64; rows * n];
    for row in 0..rows {
        let mut xr: Vec<f64> = (0..k)
            .map(|i| f64::from(x[row * k + i]) * f64::from(lin.suh[i]))
            .collect();
        hadamard_f64(&mut xr);
        let out = &mut y[row * n..(row + 1) * n];
        for (i, xv) in xr.iter().enumerate() {
            for (c, o) in out.iter_mut().enumerate() {
                *o += xv * f64::from(what[i * n + c]);
            }
        }
        hadamard_f64(out);
        for (o, s) in out.iter_mut().zip(&lin.svh) {
            *o *= f64::from(*s);
        }
    }
    y
}

/// The orthonormal 128-point Hadamard transform of every block of `v`, in f64, by definition.
fn hadamard_f64(v: &mut [f64]) {
    for block in v.chunks_exact_mut(128) {
        let src = block.to_vec();
        for (i, out) in block.iter_mut().enumerate() {
            *out = (0..128)
                .map(|j| {
                    if (i & j).count_ones() % 2 == 0 {
                        src[j]
                    } else {
                        -src[j]
                    }
                })
                .sum::<f64>()
                / 128f64.sqrt();
        }
    }
}

fn max_rel(a: &[f32], b: &[f64]) -> f64 {
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs()));
    a.iter()
        .zip(b)
        .fold(0f64, |m, (x, y)| m.max((f64::from(*x) - y).abs()))
        / scale
}

#[test]
fn rates_come_from_the_tile_length() {
    for (len, bits) in TILE_LENS
        .iter()
        .zip([1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0])
    {
        let rate = Rate::from_tile_len(*len).unwrap();
        assert_eq!(rate.bits(), bits);
        assert_eq!(rate.stream_bytes(), 2 * len);
        assert_eq!(rate.is_half(), bits != bits.floor());
    }
    for len in [0, 8, 17, 72, 88, 120, 136, 256] {
        let e = Rate::from_tile_len(len).unwrap_err().to_string();
        assert!(e.contains(&format!("{len} int16 words")), "{e}");
    }
    assert!(
        Rate::from_tile_len(72)
            .unwrap_err()
            .to_string()
            .contains("4.5 bits")
    );
}

#[test]
fn bad_layers_are_errors_naming_the_problem() {
    let ok_trellis = vec![0u8; 8 * 8 * 48 * 2];
    let make = |shape: &[usize], bytes: &[u8], k: usize, n: usize, cb: Codebook| {
        Exl3Linear::new(shape, bytes, vec![1.0; k], vec![1.0; n], cb)
            .unwrap_err()
            .to_string()
    };
    let e = make(
        &[8, 8, 40],
        &vec![0u8; 8 * 8 * 40 * 2],
        128,
        128,
        Codebook::Inst3,
    );
    assert!(
        e.contains("2.5") && e.contains("mul1") && e.contains("3inst"),
        "{e}"
    );
    let e = make(
        &[8, 8, 40],
        &vec![0u8; 8 * 8 * 40 * 2],
        128,
        128,
        Codebook::Mcg,
    );
    assert!(e.contains("mcg"), "{e}");
    let e = make(&[8, 8], &ok_trellis, 128, 128, Codebook::Mul1);
    assert!(e.contains("3 dimensions"), "{e}");
    let e = make(
        &[4, 8, 48],
        &vec![0u8; 4 * 8 * 48 * 2],
        64,
        128,
        Codebook::Mul1,
    );
    assert!(e.contains("K = 64") && e.contains("128"), "{e}");
    let e = make(&[8, 0, 48], &[], 128, 0, Codebook::Mul1);
    assert!(e.contains("N = 0"), "{e}");
    let e = make(&[8, 8, 48], &ok_trellis[1..], 128, 128, Codebook::Mul1);
    assert!(e.contains("trellis") && e.contains("6143"), "{e}");
    let e = make(&[8, 8, 48], &ok_trellis, 127, 128, Codebook::Mul1);
    assert!(e.contains("suh") && e.contains("127"), "{e}");
    let e = make(&[8, 8, 48], &ok_trellis, 128, 256, Codebook::Mul1);
    assert!(e.contains("svh") && e.contains("256"), "{e}");
    let e = make(
        &[8, 8, 72],
        &vec![0u8; 8 * 8 * 72 * 2],
        128,
        128,
        Codebook::Mul1,
    );
    assert!(e.contains("4.5"), "{e}");
    let lin = Exl3Linear::new(
        &[8, 8, 48],
        &ok_trellis,
        vec![1.0; 128],
        vec![1.0; 128],
        Codebook::Mul1,
    )
    .unwrap();
    let e = lin.with_bias(vec![0.0; 3]).unwrap_err().to_string();
    assert!(e.contains("bias") && e.contains('3'), "{e}");
    assert_eq!(Codebook::from_name("mcg").unwrap(), Codebook::Mcg);
    let e = Codebook::from_name("4inst").unwrap_err().to_string();
    assert!(e.contains("4inst"), "{e}");
}

#[test]
fn codebooks_have_their_known_rms() {
    for (cb, rms) in [
        (Codebook::Inst3, 1.2437),
        (Codebook::Mcg, 1.2441),
        (Codebook::Mul1, 1.0003),
    ] {
        let t = trellis::table(cb);
        let got = (t.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / t.len() as f64).sqrt();
        assert!((got - rms).abs() < 1e-4, "{cb}: rms {got}");
    }
}

#[test]
fn positions_cover_the_tile_once() {
    let mut seen = [false; TILE_VALUES];
    for p in 0..TILE_VALUES {
        let (r, c) = trellis::position(p);
        assert!(!seen[16 * r + c], "position {p}");
        seen[16 * r + c] = true;
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn simd_decode_is_bit_exact() {
    // Every instruction set this CPU has (a CPU without AVX2 checks nothing here).
    for isa in simd_isas() {
        for cb in CODEBOOKS {
            for len in TILE_LENS.into_iter().filter(|&l| supported(cb, l)) {
                let lin = random_linear(len as u64, 128, 128, len, cb);
                let what = lin.reconstruct();
                for nt in 0..8 {
                    for kt in 0..8 {
                        let simd = simd_x86::decode_tile(isa, lin.rate, cb, lin.tile(kt, nt));
                        for r in 0..16 {
                            for c in 0..16 {
                                let want = what[(16 * kt + r) * 128 + 16 * nt + c];
                                assert_eq!(
                                    simd[16 * r + c].to_bits(),
                                    want.to_bits(),
                                    "{isa:?} {cb} {len}: tile ({kt}, {nt}) [{r}, {c}]"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Every state of every codebook through the SIMD decoder (its arithmetic at a scale of its
/// own, its f16 rounding) against the scalar decoder.
#[cfg(target_arch = "x86_64")]
#[test]
fn simd_rounding_matches_f16_for_every_state() {
    for isa in simd_isas() {
        for cb in CODEBOOKS {
            for first in (0..=u16::MAX as u32).step_by(8) {
                let states: [u32; 8] = std::array::from_fn(|i| first + i as u32);
                let got = simd_x86::decode_states(isa, cb, &states);
                for (s, v) in states.iter().zip(got) {
                    let want = trellis::decode_state(cb, *s);
                    assert_eq!(v.to_bits(), want.to_bits(), "{isa:?} {cb} state {s}");
                }
            }
        }
    }
}

/// The SIMD kernel's strips bit for bit against a scalar model of its order: per row, eight
/// lanes per column pair `(c0, c0 + 8)`, each an FMA chain over tiles and the tile's row
/// pairs, the lanes summed pairwise at the end.
#[cfg(target_arch = "x86_64")]
#[test]
fn simd_strips_follow_their_summation_order_bit_for_bit() {
    // Every instruction set this CPU has (a CPU without AVX2 checks nothing here).
    for isa in simd_isas() {
        let (k, n) = (256, 128);
        for cb in CODEBOOKS {
            for len in TILE_LENS.into_iter().filter(|&l| supported(cb, l)) {
                let lin = random_linear(300 + len as u64, k, n, len, cb);
                let what = lin.reconstruct();
                for rows in 1..=5 {
                    let xr = random_f32(rows as u64, rows * k, 3.0);
                    let arranged = simd_x86::arrange(&xr, rows, cb);
                    let lanes = simd_x86::lane_positions(cb);
                    for nt in 0..n / 16 {
                        let mut got = vec![0f32; rows * 16];
                        simd_x86::strip(
                            isa,
                            lin.rate,
                            cb,
                            lin.column(nt),
                            &arranged,
                            rows,
                            &mut got,
                        );
                        for r in 0..rows {
                            let mut sums = [[0f32; 8]; 8];
                            for kt in 0..k / 16 {
                                for (c0, acc) in sums.iter_mut().enumerate() {
                                    for q in 0..4 {
                                        for (lane, &j) in lanes.iter().enumerate() {
                                            let (dr, dc) = trellis::GROUP_OFFSETS[j];
                                            let i = 16 * kt + 2 * q + dr;
                                            let w = what[i * n + 16 * nt + c0 + dc];
                                            acc[lane] = xr[r * k + i].mul_add(w, acc[lane]);
                                        }
                                    }
                                }
                            }
                            // Per column, its four lanes in lane order, summed pairwise.
                            let side = |l: &[f32; 8], dc: usize| {
                                let mut four = (0..8)
                                    .filter(|&lane| trellis::GROUP_OFFSETS[lanes[lane]].1 == dc);
                                let mut next = || l[four.next().expect("four lanes a column")];
                                let (a, b, c, d) = (next(), next(), next(), next());
                                (a + b) + (c + d)
                            };
                            for (c0, l) in sums.iter().enumerate() {
                                for (c, want) in [(c0, side(l, 0)), (c0 + 8, side(l, 8))] {
                                    assert_eq!(
                                        got[16 * r + c].to_bits(),
                                        want.to_bits(),
                                        "{isa:?} {cb} {len} rows {rows}: strip {nt} row {r} column {c}"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn products_match_the_definition_on_both_kernels() {
    let (k, n) = (256, 384);
    for cb in CODEBOOKS {
        for len in TILE_LENS.into_iter().filter(|&l| supported(cb, l)) {
            let lin = random_linear(100 + len as u64, k, n, len, cb);
            for rows in [1, 3, 6] {
                let x = random_f32(7 + rows as u64, rows * k, 1.0);
                let want = product_f64(&lin, &x, rows);
                let mut portable = vec![0f32; rows * n];
                lin.forward_with(Kernel::Portable, &x, rows, &mut portable)
                    .unwrap();
                let err = max_rel(&portable, &want);
                assert!(
                    err < 2e-6,
                    "{cb} {len} rows {rows}: portable rel err {err:.2e}"
                );
                for kernel in [Kernel::Simd, Kernel::Avx2] {
                    let mut simd = vec![0f32; rows * n];
                    match lin.forward_with(kernel, &x, rows, &mut simd) {
                        Ok(()) => {
                            let err = max_rel(&simd, &want);
                            assert!(
                                err < 2e-6,
                                "{cb} {len} rows {rows}: {kernel:?} rel err {err:.2e}"
                            );
                        }
                        Err(Exl3Error::SimdUnsupported) => {}
                        Err(e) => panic!("{e}"),
                    }
                }
            }
        }
    }
}

#[test]
fn bias_is_added_and_no_rows_is_nothing() {
    let lin = random_linear(5, 128, 128, 48, Codebook::Mul1);
    let x = random_f32(6, 2 * 128, 1.0);
    let mut plain = vec![0f32; 2 * 128];
    lin.forward(&x, 2, &mut plain);
    let bias = random_f32(8, 128, 1.0);
    let biased = lin.clone().with_bias(bias.clone()).unwrap();
    let mut y = vec![0f32; 2 * 128];
    biased.forward(&x, 2, &mut y);
    for (i, (a, b)) in y.iter().zip(&plain).enumerate() {
        assert!((a - b - bias[i % 128]).abs() < 1e-6);
    }
    lin.forward(&[], 0, &mut []);
}

#[test]
fn dequantized_rows_give_the_same_product() {
    let (k, n) = (256, 256);
    let lin = random_linear(9, k, n, 40, Codebook::Mul1);
    let mut wt = vec![0f32; n * k];
    lin.dequantize_rows(0, n, &mut wt);
    let mut part = vec![0f32; 3 * k];
    lin.dequantize_rows(125, 128, &mut part);
    assert_eq!(part, wt[125 * k..128 * k]);
    let x = random_f32(10, 2 * k, 1.0);
    let want = product_f64(&lin, &x, 2);
    let via_rows: Vec<f32> = (0..2)
        .flat_map(|t| {
            let (x, wt) = (&x, &wt);
            (0..n).map(move |r| (0..k).map(|i| x[t * k + i] * wt[r * k + i]).sum::<f32>())
        })
        .collect();
    let err = max_rel(&via_rows, &want);
    assert!(err < 2e-6, "rel err {err:.2e}");
    let mut cols = vec![0f32; 32 * k];
    lin.reconstruct_columns_t(32, 64, &mut cols);
    let what = lin.reconstruct();
    for c in 0..32 {
        for i in 0..k {
            assert_eq!(cols[c * k + i], what[i * n + 32 + c]);
        }
    }
}

#[test]
fn checkpoint_trellis_gives_back_the_stored_words() {
    for len in TILE_LENS {
        let (k, n) = (128, 256);
        let trellis = random_bytes(len as u64, k / 16 * n / 16 * len * 2);
        let lin = Exl3Linear::new(
            &[k / 16, n / 16, len],
            &trellis,
            vec![1.0; k],
            vec![1.0; n],
            Codebook::Mul1,
        )
        .unwrap();
        assert_eq!(lin.checkpoint_trellis(), trellis, "tiles of {len} words");
    }
}

/// The lane's product by its definition, in f64: the rotated input as the lane rounds it,
/// times mul1's weights before their f16 rounding, rotated back and scaled.
fn lane_product_f64(lin: &Exl3Linear, x: &[f32]) -> Vec<f64> {
    let (k, n) = (lin.in_features(), lin.out_features());
    let input = lane::LaneInput::new(&lin.rotate_input(x, 1)).unwrap();
    let plan = trellis::RatePlan::of(lin.rate());
    let mut z = vec![0f64; n];
    for nt in 0..n / 16 {
        for kt in 0..k / 16 {
            let tile = lin.tile(kt, nt);
            for p in 0..TILE_VALUES {
                let (r, c) = trellis::position(p);
                let y = plan.state(tile, p).wrapping_mul(trellis::MUL1_MUL);
                let s: i32 = y.to_le_bytes().iter().map(|&b| i32::from(b)).sum();
                let w = f64::from(trellis::MUL1_SCALE * s - trellis::MUL1_OFFSET) / 262_144.0;
                let i = 16 * kt + r;
                let xv = f64::from(input.q[i]) * f64::from(input.scales[i / 128]);
                z[16 * nt + c] += xv * w;
            }
        }
    }
    hadamard_f64(&mut z);
    z.iter()
        .zip(&lin.svh)
        .map(|(v, s)| v * f64::from(*s))
        .collect()
}

/// The lane's mul1 product is its definition (to f32 rounding), gives the same bits on every
/// kernel, and stays within the f16 rounding of the weights and the 16-bit rounding of the
/// input of the exact product.
#[test]
fn lane_products_match_their_definition_on_every_kernel() {
    let (k, n) = (512, 256);
    for len in TILE_LENS {
        let lin = random_linear(300 + len as u64, k, n, len, Codebook::Mul1);
        assert!(lin.lane_integer());
        // A mean and a few large values, as a model's hidden states have.
        let mut x = random_f32(9 + len as u64, k, 1.0);
        x.iter_mut().for_each(|v| *v += 0.3);
        x[17] = 40.0;
        x[300] = -25.0;
        let want = lane_product_f64(&lin, &x);
        let mut portable = vec![0f32; n];
        lin.forward_lane_with(Kernel::Portable, &x, &mut portable)
            .unwrap();
        let err = max_rel(&portable, &want);
        assert!(err < 1e-6, "{len}: portable rel err {err:.2e}");
        for kernel in [Kernel::Simd, Kernel::Avx2] {
            let mut simd = vec![0f32; n];
            match lin.forward_lane_with(kernel, &x, &mut simd) {
                Ok(()) => assert!(
                    simd.iter()
                        .zip(&portable)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{len}: {kernel:?} differs from the portable lane"
                ),
                Err(Exl3Error::SimdUnsupported) => {}
                Err(e) => panic!("{e}"),
            }
        }
        let exact = product_f64(&lin, &x, 1);
        let err = max_rel(&portable, &exact);
        assert!(
            err < 2e-3 && err > 0.0,
            "{len}: lane vs exact rel err {err:.2e}"
        );
    }
}

/// Codebooks other than mul1 take the exact product on the lane.
#[test]
fn lane_products_of_other_codebooks_are_the_exact_ones() {
    for cb in [Codebook::Inst3, Codebook::Mcg] {
        let lin = random_linear(77, 256, 128, 48, cb);
        assert!(!lin.lane_integer());
        let x = random_f32(5, 256, 1.0);
        let (mut a, mut b) = (vec![0f32; 128], vec![0f32; 128]);
        lin.forward(&x, 1, &mut a);
        lin.forward_lane(&x, &mut b);
        assert_eq!(a, b, "{cb}");
    }
}
