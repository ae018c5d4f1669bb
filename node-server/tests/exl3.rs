//! The EXL3 decoder and product against exllamav3 1.6.5's own outputs
//! (`e2e/fixtures/exl3/tiles.safetensors`, made by `e2e/exl3/tiles.py` on an H200): every
//! supported codebook x rate reconstructed bit for bit, every unsupported one refused, and
//! `LinearEXL3`'s outputs reproduced.

use glmflash_node::quant::exl3::{Codebook, Exl3Error, Exl3Linear, Kernel};
use half::f16;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::PathBuf;

#[path = "support/errors.rs"]
mod errors;
use errors::rel_l2;

/// Rel. L2 allowed between our f32 product and exllamav3's f16 one. exllamav3 rounds the
/// input, the rotated input, the product and the rotated output to f16 and is itself about
/// 5e-4 (rel. L2) from the float64 product (`tiles.json` `rel_l2_vs_f64`); ours is ~1e-7 from
/// it, so the two differ by exllamav3's rounding.
const VS_EXLLAMA: f64 = 1.5e-3;
/// Max error relative to the largest output, between our product and the float64 product
/// of exllamav3's reconstructed weights: f32 accumulation over K = 256.
const VS_F64: f64 = 2e-6;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../e2e/fixtures/exl3")
}

struct Tensor {
    dtype: String,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl Tensor {
    fn f16s(&self) -> Vec<f32> {
        assert_eq!(self.dtype, "F16");
        self.bytes
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect()
    }
}

fn read_safetensors(path: &std::path::Path) -> BTreeMap<String, Tensor> {
    let data = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let len = u64::from_le_bytes(data[..8].try_into().unwrap()) as usize;
    let header: BTreeMap<String, Value> = serde_json::from_slice(&data[8..8 + len]).unwrap();
    let body = &data[8 + len..];
    header
        .into_iter()
        .filter(|(k, _)| k != "__metadata__")
        .map(|(k, v)| {
            let offsets: Vec<usize> = serde_json::from_value(v["data_offsets"].clone()).unwrap();
            let tensor = Tensor {
                dtype: v["dtype"].as_str().unwrap().to_string(),
                shape: serde_json::from_value(v["shape"].clone()).unwrap(),
                bytes: body[offsets[0]..offsets[1]].to_vec(),
            };
            (k, tensor)
        })
        .collect()
}

/// `(codebook, tag)` of a `tile.{cb}.{tag}.*` / `lin.{cb}.{tag}.*` name.
fn parts(name: &str) -> (Codebook, String) {
    let mut it = name.split('.');
    it.next();
    let cb = Codebook::from_name(it.next().unwrap()).unwrap();
    (cb, it.next().unwrap().to_string())
}

fn linear(
    tiles: &BTreeMap<String, Tensor>,
    cb: Codebook,
    tag: &str,
    suh: Vec<f32>,
    svh: Vec<f32>,
) -> Exl3Linear {
    let trellis = &tiles[&format!("tile.{}.{tag}.trellis", cb.name())];
    assert_eq!(trellis.dtype, "I16");
    Exl3Linear::new(&trellis.shape, &trellis.bytes, suh, svh, cb)
        .unwrap_or_else(|e| panic!("{cb} {tag}: {e}"))
}

#[test]
fn every_supported_tile_reconstructs_bit_exact() {
    let tiles = read_safetensors(&fixtures().join("tiles.safetensors"));
    let mut checked = Vec::new();
    for name in tiles
        .keys()
        .filter(|k| k.starts_with("tile.") && k.ends_with(".trellis"))
    {
        let (cb, tag) = parts(name);
        let lin = linear(&tiles, cb, &tag, vec![1.0; 256], vec![1.0; 128]);
        let want = &tiles[&format!("tile.{}.{tag}.reconstructed", cb.name())];
        assert_eq!(want.shape, [256, 128]);
        let got = lin.reconstruct();
        let mut mismatches = 0;
        for (g, w) in got.iter().zip(want.bytes.chunks_exact(2)) {
            let ours = f16::from_f32(*g);
            assert_eq!(ours.to_f32(), *g, "{cb} {tag}: decoded value is not an f16");
            mismatches += usize::from(ours.to_bits() != u16::from_le_bytes([w[0], w[1]]));
        }
        assert_eq!(
            mismatches, 0,
            "{cb} {tag}: {mismatches} of 32768 values differ"
        );
        checked.push(format!("{cb} {}", lin.rate()));
    }
    eprintln!("bit-exact: {}", checked.join(", "));
    assert_eq!(
        checked.len(),
        27,
        "3inst and mcg at 1..8, mul1 also at 1.5, 2.5, 3.5"
    );
}

#[test]
fn unsupported_combinations_are_refused_as_exllamav3_does() {
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("tiles.json")).unwrap())
            .unwrap();
    let support = manifest["codebook_rate_support"].as_object().unwrap();
    let mut refused = 0;
    for (cb, rates) in support {
        let codebook = Codebook::from_name(cb).unwrap();
        for (tag, verdict) in rates.as_object().unwrap() {
            let bits: f64 = tag.replace('p', ".").parse().unwrap();
            let len = (16.0 * bits) as usize;
            let trellis = vec![0u8; 8 * 8 * len * 2];
            let made = Exl3Linear::new(
                &[8, 8, len],
                &trellis,
                vec![1.0; 128],
                vec![1.0; 128],
                codebook,
            );
            if verdict.as_bool() == Some(true) {
                assert!(made.is_ok(), "{cb} {tag}: {:?}", made.err());
                continue;
            }
            refused += 1;
            let e = made.expect_err(&format!("{cb} {tag} is not supported"));
            let text = e.to_string();
            match e {
                Exl3Error::HalfRateCodebook { .. } => assert!(text.contains("mul1"), "{text}"),
                Exl3Error::Rate { .. } => assert!(text.contains("4.5"), "{text}"),
                other => panic!("{cb} {tag}: unexpected error {other}"),
            }
        }
    }
    assert_eq!(refused, 9, "six half rates without mul1, 4.5 on all three");
}

/// `x W` in float64 from exllamav3's reconstructed `What` and `W = diag(suh) H What H diag(svh)`.
fn product_f64(what: &[f32], x: &[f32], suh: &[f32], svh: &[f32]) -> Vec<f64> {
    let (k, n) = (suh.len(), svh.len());
    let had = |v: &mut [f64]| {
        for block in v.chunks_exact_mut(128) {
            let src = block.to_vec();
            for (i, out) in block.iter_mut().enumerate() {
                let s: f64 = (0..128)
                    .map(|j| {
                        if (i & j).count_ones() % 2 == 0 {
                            src[j]
                        } else {
                            -src[j]
                        }
                    })
                    .sum();
                *out = s / 128f64.sqrt();
            }
        }
    };
    x.chunks_exact(k)
        .flat_map(|row| {
            let mut xr: Vec<f64> = row
                .iter()
                .zip(suh)
                .map(|(a, s)| f64::from(*a) * f64::from(*s))
                .collect();
            had(&mut xr);
            let mut z = vec![0f64; n];
            for (i, xv) in xr.iter().enumerate() {
                for (c, zc) in z.iter_mut().enumerate() {
                    *zc += xv * f64::from(what[i * n + c]);
                }
            }
            had(&mut z);
            z.iter()
                .zip(svh)
                .map(|(v, s)| v * f64::from(*s))
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn linear_outputs_match_exllamav3() {
    let tiles = read_safetensors(&fixtures().join("tiles.safetensors"));
    let mut lines = Vec::new();
    for name in tiles
        .keys()
        .filter(|k| k.starts_with("lin.") && k.ends_with(".x"))
    {
        let (cb, tag) = parts(name);
        let p = format!("lin.{}.{tag}", cb.name());
        let (suh, svh, x) = (
            tiles[&format!("{p}.suh")].f16s(),
            tiles[&format!("{p}.svh")].f16s(),
            tiles[name].f16s(),
        );
        let rows = x.len() / suh.len();
        let lin = linear(&tiles, cb, &tag, suh.clone(), svh.clone());
        let what: Vec<f32> = tiles[&format!("tile.{}.{tag}.reconstructed", cb.name())].f16s();
        let exact = product_f64(&what, &x, &suh, &svh);
        let exact_scale = exact.iter().fold(0f64, |m, v| m.max(v.abs()));

        let mut outputs = Vec::new();
        for kernel in [Kernel::Portable, Kernel::Simd, Kernel::Avx2] {
            let mut y = vec![0f32; rows * lin.out_features()];
            match lin.forward_with(kernel, &x, rows, &mut y) {
                Ok(()) => outputs.push((kernel, y)),
                Err(Exl3Error::SimdUnsupported) => {
                    eprintln!("no AVX2+FMA+F16C: SIMD kernel not checked")
                }
                Err(e) => panic!("{e}"),
            }
        }
        for (kernel, y) in &outputs {
            let vs_f64 = y
                .iter()
                .zip(&exact)
                .fold(0f64, |m, (a, b)| m.max((f64::from(*a) - b).abs()))
                / exact_scale;
            assert!(vs_f64 < VS_F64, "{p} {kernel:?}: vs float64 {vs_f64:.2e}");
            let mut line = format!("{p} {kernel:?}: vs f64 {vs_f64:.1e}");
            for which in ["y", "y_gemm", "y_recon"] {
                let theirs = tiles[&format!("{p}.{which}")].f16s();
                let err = rel_l2(y, &theirs);
                assert!(
                    err < VS_EXLLAMA,
                    "{p} {kernel:?}: rel L2 vs exllamav3 {which} {err:.2e}"
                );
                line += &format!(", {which} {err:.2e}");
            }
            lines.push(line);
        }
        if let [(_, a), (_, b)] = &outputs[..] {
            let err = rel_l2(a, b);
            assert!(err < 1e-6, "{p}: portable vs SIMD rel L2 {err:.2e}");
        }
    }
    eprintln!("{}", lines.join("\n"));
    assert_eq!(lines.len() % 15, 0, "15 lin entries");
}

/// Decode throughput of one-row products (`cargo test --test exl3 -- --ignored --nocapture`):
/// trellis bytes read per second, on every rayon thread, both kernels.
#[test]
#[ignore]
fn one_row_product_throughput() {
    // GLM-5.3-Flash's expert shapes (gate/up 4096 -> 2048, down 2048 -> 4096) and a square
    // 4096; `GLMFLASH_EXL3_BENCH_SHAPES=KxN,...` picks others, `GLMFLASH_EXL3_BENCH_ROWS`
    // the token rows a product takes (1: decode).
    let rows: usize =
        std::env::var("GLMFLASH_EXL3_BENCH_ROWS").map_or(1, |r| r.parse().expect("rows"));
    let shapes: Vec<(usize, usize)> = std::env::var("GLMFLASH_EXL3_BENCH_SHAPES")
        .unwrap_or_else(|_| "4096x4096,4096x2048,2048x4096".into())
        .split(',')
        .map(|s| {
            let (k, n) = s.split_once('x').expect("KxN");
            (k.parse().expect("K"), n.parse().expect("N"))
        })
        .collect();
    for (k, n) in shapes {
        for (cb, len) in [
            (Codebook::Mul1, 48),
            (Codebook::Mul1, 40),
            (Codebook::Mul1, 64),
            (Codebook::Inst3, 48),
            (Codebook::Mcg, 64),
        ] {
            let bytes: Vec<u8> = (0..k / 16 * n / 16 * len * 2)
                .map(|i| ((i * 2_654_435_761usize) >> 7) as u8)
                .collect();
            let lin = Exl3Linear::new(
                &[k / 16, n / 16, len],
                &bytes,
                vec![1.0; k],
                vec![1.0; n],
                cb,
            )
            .unwrap();
            let x: Vec<f32> = (0..rows * k).map(|i| (i % 7) as f32 - 3.0).collect();
            for kernel in [Kernel::Simd, Kernel::Avx2, Kernel::Portable] {
                let mut y = vec![0f32; rows * n];
                if lin.forward_with(kernel, &x, rows, &mut y).is_err() {
                    continue;
                }
                // The best of seven rounds of ten products: the development VM is shared.
                let reps = if kernel == Kernel::Portable { 2 } else { 10 };
                let secs = (0..7)
                    .map(|_| {
                        let start = std::time::Instant::now();
                        for _ in 0..reps {
                            lin.forward_with(kernel, &x, rows, &mut y).unwrap();
                        }
                        start.elapsed().as_secs_f64() / f64::from(reps)
                    })
                    .fold(f64::INFINITY, f64::min);
                eprintln!(
                    "{k}x{n} {cb} {} bpw {kernel:?}: {:.3} ms per {rows}-row product, {:.2} GB/s of trellis, {:.2} G weights/s on {} threads",
                    lin.rate(),
                    secs * 1e3,
                    bytes.len() as f64 / secs / 1e9,
                    (k * n) as f64 / secs / 1e9,
                    rayon::current_num_threads()
                );
            }
        }
    }
}

/// GLM-5.3-Flash experts (mul1 3 bpw: gate and up 4096 -> 2048, down 2048 -> 4096) computed
/// one row at a time as the CPU lane computes them, from cache ("hot": one expert again and
/// again) and from memory ("cold": `GLMFLASH_EXL3_BENCH_EXPERTS` experts, 48 by default, 450
/// MB, taken in turn, so each is read from DRAM). The lane's real case is cold.
#[test]
#[ignore]
fn expert_products_hot_and_cold() {
    let experts: usize =
        std::env::var("GLMFLASH_EXL3_BENCH_EXPERTS").map_or(48, |r| r.parse().expect("experts"));
    let linear = |k: usize, n: usize, seed: usize| {
        let bytes: Vec<u8> = (0..k / 16 * n / 16 * 48 * 2)
            .map(|i| (((i + seed) * 2_654_435_761usize) >> 7) as u8)
            .collect();
        Exl3Linear::new(
            &[k / 16, n / 16, 48],
            &bytes,
            vec![1.0; k],
            vec![1.0; n],
            Codebook::Mul1,
        )
        .unwrap()
    };
    let set: Vec<[Exl3Linear; 3]> = (0..experts)
        .map(|e| {
            [
                linear(4096, 2048, 3 * e),
                linear(4096, 2048, 3 * e + 1),
                linear(2048, 4096, 3 * e + 2),
            ]
        })
        .collect();
    let bytes: usize = set[0].iter().map(Exl3Linear::stored_bytes).sum();
    // What taking an expert in costs (a store miss builds its three layers from the record).
    let raw: Vec<u8> = (0..4096 / 16 * 2048 / 16 * 48 * 2)
        .map(|i| (i >> 3) as u8)
        .collect();
    let build = (0..5)
        .map(|_| {
            let start = std::time::Instant::now();
            for _ in 0..3 {
                let lin = Exl3Linear::new(
                    &[4096 / 16, 2048 / 16, 48],
                    &raw,
                    vec![1.0; 4096],
                    vec![1.0; 2048],
                    Codebook::Mul1,
                );
                std::hint::black_box(lin.unwrap());
            }
            start.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min);
    eprintln!("expert built from its record: {:.3} ms", build * 1e3);
    // And what giving its trellises back in the checkpoint's order costs (a GPU slot's copy).
    let back = (0..5)
        .map(|_| {
            let start = std::time::Instant::now();
            for lin in &set[0] {
                std::hint::black_box(lin.checkpoint_trellis());
            }
            start.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min);
    eprintln!(
        "expert's trellises in the checkpoint's order: {:.3} ms",
        back * 1e3
    );
    let x: Vec<f32> = (0..4096).map(|i| (i % 7) as f32 - 3.0).collect();
    let (mut g, mut d) = (vec![0f32; 2048], vec![0f32; 4096]);
    let mut expert = |e: &[Exl3Linear; 3]| {
        e[0].forward(&x, 1, &mut g);
        e[1].forward(&x, 1, &mut g);
        e[2].forward(&g, 1, &mut d);
    };
    for (name, order) in [
        ("hot", vec![0; experts]),
        ("cold", (0..experts).collect::<Vec<_>>()),
    ] {
        // Best of five rounds over the order (the first round of cold warms nothing it reuses).
        let secs = (0..5)
            .map(|_| {
                let start = std::time::Instant::now();
                for &e in &order {
                    expert(&set[e]);
                }
                start.elapsed().as_secs_f64() / order.len() as f64
            })
            .fold(f64::INFINITY, f64::min);
        eprintln!(
            "expert {name}: {:.3} ms, {:.2} GB/s, {:.0} experts/s on {} threads",
            secs * 1e3,
            bytes as f64 / secs / 1e9,
            1.0 / secs,
            rayon::current_num_threads()
        );
    }
}
