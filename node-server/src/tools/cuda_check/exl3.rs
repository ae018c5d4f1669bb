//! EXL3 on the GPU against the CPU decoder, on random trellises of every rate (1 to 8 bits,
//! 1.5, 2.5, 3.5) and codebook: the decoded weights bit for bit, and products through the
//! GEMV (1-63 token rows) and through the decoded weights and cuBLAS (from 64), directly and
//! as a placed matrix; and against exllamav3's own outputs where its fixture is at hand
//! (`e2e/fixtures/exl3/tiles.safetensors`, from the repository root). With `--wide`, also the
//! GEMV's speed at GLM-5.3-Flash expert shapes.

use super::*;
use crate::backend::cuda::Exl3Weights;
use crate::quant::exl3::{Codebook, Exl3Linear, Kernel};
use std::collections::BTreeMap;

/// Tile lengths (int16 words) of every rate EXL3 defines.
const TILE_LENS: [usize; 11] = [16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128];
const CODEBOOKS: [Codebook; 3] = [Codebook::Inst3, Codebook::Mcg, Codebook::Mul1];
/// Both sides decode the same f16 weights and keep f32 activations; only the summation
/// order differs.
const EXL3_BOUND: f64 = 1e-4;
/// exllamav3's fixture: tiles it reconstructed and `LinearEXL3` outputs (see e2e/exl3/README.md).
const EXLLAMA_TILES: &str = "e2e/fixtures/exl3/tiles.safetensors";
/// Rel. L2 between our f32 product and exllamav3's: it rounds the input, the rotated input,
/// the product and the rotated output to f16, ~5e-4 from the float64 product itself.
const VS_EXLLAMA: f64 = 1.5e-3;

/// A layer of `k` inputs and `n` outputs with a random trellis of `len`-word tiles.
pub(super) fn random_linear(
    rng: &mut ChaCha8Rng,
    k: usize,
    n: usize,
    len: usize,
    cb: Codebook,
    bias: bool,
) -> anyhow::Result<Exl3Linear> {
    let trellis: Vec<u8> = (0..k / 16 * n / 16 * len * 2)
        .map(|_| rng.random())
        .collect();
    // f16 values, as a checkpoint stores the scales (a slot read back keeps them so).
    let f16 = |v: Vec<f32>| -> Vec<f32> {
        v.into_iter()
            .map(|x| half::f16::from_f32(x).to_f32())
            .collect()
    };
    let suh = f16(randn(rng, k, 1.0));
    let svh = f16(randn(rng, n, 0.05));
    let lin = Exl3Linear::new(&[k / 16, n / 16, len], &trellis, suh, svh, cb)?;
    Ok(if bias {
        lin.with_bias(randn(rng, n, 0.1))?
    } else {
        lin
    })
}

/// The CPU's product on the portable kernel.
fn cpu_product(lin: &Exl3Linear, x: &[f32], rows: usize) -> anyhow::Result<Vec<f32>> {
    let mut y = vec![0f32; rows * lin.out_features()];
    lin.forward_with(Kernel::Portable, x, rows, &mut y)?;
    Ok(y)
}

fn label(lin: &Exl3Linear) -> String {
    format!(
        "exl3 {} bpw {} {}x{}",
        lin.rate(),
        lin.codebook(),
        lin.in_features(),
        lin.out_features()
    )
}

/// The GEMV whose blocks rotate their own slices of the input against the rotation launched
/// first: the same bits, at pass widths of 1 to 8 tokens and over two passes, on shapes of one
/// slice and of several.
fn check_rotation_inside(
    cuda: &Arc<Cuda>,
    rng: &mut ChaCha8Rng,
    cases: &mut Vec<Case>,
) -> anyhow::Result<()> {
    for (k, n, len) in [
        (256usize, 384usize, 48usize),
        (1024, 256, 32),
        (2048, 1024, 64),
    ] {
        let lin = random_linear(rng, k, n, len, Codebook::Mul1, false)?;
        let w = Exl3Weights::upload(cuda, &lin)?;
        for tokens in [1usize, 5, 8, 20] {
            let x = randn(rng, tokens * k, 1.0);
            let dx = cuda.upload(&x)?;
            let mut inside = cuda.alloc_f32(tokens * n)?;
            let mut first = cuda.alloc_f32(tokens * n)?;
            cuda.exl3_matmul(&w, &dx, tokens, &mut inside)?;
            cuda.exl3_matmul_rotating_first(&w, &dx, tokens, &mut first)?;
            let (inside, first) = (cuda.download(&inside)?, cuda.download(&first)?);
            cases.push(same_bits_case(
                format!(
                    "{} n={tokens} rotated inside the GEMV: same bits",
                    label(&lin)
                ),
                &inside[..tokens * n],
                &first[..tokens * n],
            ));
            let want = cpu_product(&lin, &x, tokens)?;
            cases.push(case(
                format!("{} n={tokens} rotated inside the GEMV", label(&lin)),
                &inside[..tokens * n],
                &want,
                EXL3_BOUND,
            ));
        }
    }
    Ok(())
}

pub(super) fn check_exl3(
    cuda: &Arc<Cuda>,
    rng: &mut ChaCha8Rng,
    wide: bool,
    cases: &mut Vec<Case>,
) -> anyhow::Result<()> {
    for cb in CODEBOOKS {
        for len in TILE_LENS {
            if cb != Codebook::Mul1 && !len.is_multiple_of(16) {
                continue; // half-integer rates exist for mul1 only
            }
            let (k, n) = (256, 384);
            let lin = random_linear(rng, k, n, len, cb, false)?;
            let w = Exl3Weights::upload(cuda, &lin)?;
            let want = lin.reconstruct();
            let mut out = cuda.alloc_f32(k * n)?;
            cuda.exl3_reconstruct(&w, 0, k / 16, &mut out)?;
            let got = cuda.download(&out)?;
            let same = got.len() >= want.len()
                && got
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
            cases.push(exact_case(
                format!("{} reconstruct: same bits", label(&lin)),
                same,
            ));
            for tokens in [1usize, 3, 8, 9, 64] {
                let x = randn(rng, tokens * k, 1.0);
                let want = cpu_product(&lin, &x, tokens)?;
                let dx = cuda.upload(&x)?;
                let mut dy = cuda.alloc_f32(tokens * n)?;
                cuda.exl3_matmul(&w, &dx, tokens, &mut dy)?;
                let got = cuda.download(&dy)?;
                cases.push(case(
                    format!("{} n={tokens}", label(&lin)),
                    &got[..tokens * n],
                    &want,
                    EXL3_BOUND,
                ));
            }
        }
    }
    check_rotation_inside(cuda, rng, cases)?;
    check_placed(cuda, rng, wide, cases)?;
    check_exllamav3(cuda, cases)?;
    if wide {
        gemv_speed(cuda, rng)?;
    }
    Ok(())
}

/// EXL3 matrices placed as a model load places them (with a bias, a slice of the decoded
/// weights, and at expert width with `wide`).
fn check_placed(
    cuda: &Arc<Cuda>,
    rng: &mut ChaCha8Rng,
    wide: bool,
    cases: &mut Vec<Case>,
) -> anyhow::Result<()> {
    let placer = CudaPlacer::new(cuda.clone(), 1)?;
    let mut shapes = vec![(512usize, 1024usize, 48usize, Codebook::Mul1, true)];
    if wide {
        shapes.extend([
            (4096, 2048, 48, Codebook::Mul1, false),
            (2048, 4096, 40, Codebook::Mul1, false),
            (4096, 2048, 64, Codebook::Inst3, false),
            (2048, 4096, 32, Codebook::Mcg, false),
        ]);
    }
    for (k, n, len, cb, bias) in shapes {
        let lin = random_linear(rng, k, n, len, cb, bias)?;
        let name = format!("{} bias={bias} placed", label(&lin));
        // A slice of k-tiles of the decoded weights is those rows of the whole.
        let w = Exl3Weights::upload(cuda, &lin)?;
        let (kt0, kt1) = (3, 7);
        let mut out = cuda.alloc_f32(16 * (kt1 - kt0) * n)?;
        cuda.exl3_reconstruct(&w, kt0, kt1, &mut out)?;
        let got = cuda.download(&out)?;
        let want = &lin.reconstruct()[16 * kt0 * n..16 * kt1 * n];
        let same = got
            .iter()
            .zip(want)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        cases.push(exact_case(
            format!(
                "{} reconstruct k-tiles {kt0}..{kt1}: same bits",
                label(&lin)
            ),
            same,
        ));
        let m = Matrix::from_exl3(lin);
        let device = placer
            .place(&m)
            .with_context(|| format!("placing {m:?} failed: {:?}", placer.failure()))?;
        for tokens in [1usize, 5, 64, 300] {
            let x = randn(rng, tokens * k, 1.0);
            let want = cpu_product(m.exl3().context("an EXL3 matrix")?, &x, tokens)?;
            let mut got = vec![f32::NAN; tokens * n];
            device.matmul_into(&x, tokens, &mut got)?;
            cases.push(case(format!("{name} n={tokens}"), &got, &want, EXL3_BOUND));
        }
    }
    Ok(())
}

/// `(shape, bytes)` of every tensor of a safetensors file, by name.
type Tensors = BTreeMap<String, (Vec<usize>, Vec<u8>)>;

fn read_tensors(path: &std::path::Path) -> anyhow::Result<Tensors> {
    let data = std::fs::read(path).with_context(|| path.display().to_string())?;
    let len = u64::from_le_bytes(data.get(..8).context("short file")?.try_into()?) as usize;
    let header: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(data.get(8..8 + len).context("short header")?)?;
    let body = &data[8 + len..];
    header
        .into_iter()
        .filter(|(k, _)| k != "__metadata__")
        .map(|(k, v)| {
            let at: Vec<usize> = serde_json::from_value(v["data_offsets"].clone())?;
            let shape: Vec<usize> = serde_json::from_value(v["shape"].clone())?;
            let bytes = body
                .get(at[0]..at[1])
                .context("tensor past the end")?
                .to_vec();
            Ok((k, (shape, bytes)))
        })
        .collect()
}

fn f16s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(2)
        .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect()
}

/// Every tile exllamav3 reconstructed, decoded on the GPU bit for bit, and its `LinearEXL3`
/// outputs reproduced (GEMV for its 5 rows, and the decoded weights with cuBLAS).
fn check_exllamav3(cuda: &Arc<Cuda>, cases: &mut Vec<Case>) -> anyhow::Result<()> {
    let path = std::path::Path::new(EXLLAMA_TILES);
    if !path.exists() {
        println!(
            "{EXLLAMA_TILES} not found (run from the repository root): exllamav3 cases skipped"
        );
        return Ok(());
    }
    let tiles = read_tensors(path)?;
    for (name, (shape, trellis)) in tiles.iter().filter(|(k, _)| k.ends_with(".trellis")) {
        let mut it = name.split('.').skip(1);
        let (cb, tag) = (
            it.next().context(name.clone())?,
            it.next().context(name.clone())?,
        );
        let cb = Codebook::from_name(cb)?;
        let p = format!("lin.{}.{tag}", cb.name());
        let (suh, svh) = match (
            tiles.get(&format!("{p}.suh")),
            tiles.get(&format!("{p}.svh")),
        ) {
            (Some(suh), Some(svh)) => (f16s(&suh.1), f16s(&svh.1)),
            _ => (vec![1.0; 16 * shape[0]], vec![1.0; 16 * shape[1]]),
        };
        let lin = Exl3Linear::new(shape, trellis, suh, svh, cb)?;
        let w = Exl3Weights::upload(cuda, &lin)?;
        let (k, n) = (lin.in_features(), lin.out_features());
        let mut out = cuda.alloc_f32(k * n)?;
        cuda.exl3_reconstruct(&w, 0, k / 16, &mut out)?;
        let got = cuda.download(&out)?;
        let want = &tiles[&format!("tile.{}.{tag}.reconstructed", cb.name())].1;
        let same = f16s(want)
            .iter()
            .zip(&got)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        cases.push(exact_case(
            format!("{} reconstruct = exllamav3's", label(&lin)),
            same,
        ));
        let Some((_, x)) = tiles.get(&format!("{p}.x")) else {
            continue;
        };
        let x = f16s(x);
        let rows = x.len() / k;
        // exllamav3's 5 rows through the GEMV, and 13 copies of them (65 rows) through cuBLAS.
        for copies in [1usize, 64usize.div_ceil(rows)] {
            let xs: Vec<f32> = (0..copies).flat_map(|_| x.iter().copied()).collect();
            let dxs = cuda.upload(&xs)?;
            let mut dy = cuda.alloc_f32(copies * rows * n)?;
            cuda.exl3_matmul(&w, &dxs, copies * rows, &mut dy)?;
            let got = cuda.download(&dy)?;
            let theirs = f16s(&tiles[&format!("{p}.y")].1);
            let want: Vec<f32> = (0..copies).flat_map(|_| theirs.iter().copied()).collect();
            cases.push(case(
                format!("{} n={} vs exllamav3's y", label(&lin), copies * rows),
                &got[..copies * rows * n],
                &want,
                VS_EXLLAMA,
            ));
        }
    }
    Ok(())
}

/// Prints the GEMV's time and trellis bytes read per second (whole product: both rotations
/// included) at GLM-5.3-Flash expert shapes, against the device's copy bandwidth.
fn gemv_speed(cuda: &Arc<Cuda>, rng: &mut ChaCha8Rng) -> anyhow::Result<()> {
    copy_rate_for_speeds(cuda)?;
    // Expert gate/up and down, and a layer large enough that launch overheads do not hide
    // the kernel's own rate.
    for (k, n) in [(4096usize, 2048usize), (2048, 4096), (16384, 16384)] {
        for (len, cb) in [
            (32, Codebook::Mul1),
            (48, Codebook::Mul1),
            (56, Codebook::Mul1),
            (64, Codebook::Mul1),
            (48, Codebook::Inst3),
            (48, Codebook::Mcg),
        ] {
            let lin = random_linear(rng, k, n, len, cb, false)?;
            let w = Exl3Weights::upload(cuda, &lin)?;
            let trellis_bytes = (k * n * len / 128) as f64;
            for tokens in [1usize, 4, 8] {
                let dx = cuda.upload(&randn(rng, tokens * k, 1.0))?;
                let mut dy = cuda.alloc_f32(tokens * n)?;
                let secs =
                    seconds_per_call(cuda, 50, || cuda.exl3_matmul(&w, &dx, tokens, &mut dy))?;
                println!(
                    "{} n={tokens}: {:.1} us, {:.0} GB/s of trellis",
                    label(&lin),
                    secs * 1e6,
                    trellis_bytes / secs / 1e9
                );
            }
        }
    }
    dense_speed(cuda, rng)?;
    cuda.set_poison(true);
    Ok(())
}

/// The GLM-5.3-Flash-width model's dense EXL3 products (KDA qkv and o, the dense MLP, a
/// shared expert's gate, the 6 bpw head) at 1 and 4 tokens: the GEMV rotating its input
/// itself and after a rotation launch, at several block targets.
fn dense_speed(cuda: &Arc<Cuda>, rng: &mut ChaCha8Rng) -> anyhow::Result<()> {
    let shapes = [
        (4096usize, 24576usize, 48usize),
        (8192, 4096, 48),
        (4096, 12288, 48),
        (12288, 4096, 48),
        (4096, 2048, 48),
        (4096, 154_880, 96),
    ];
    for (k, n, len) in shapes {
        let lin = random_linear(rng, k, n, len, Codebook::Mul1, false)?;
        let w = Exl3Weights::upload(cuda, &lin)?;
        let trellis_bytes = (k * n * len / 128) as f64;
        for tokens in [1usize, 4] {
            let dx = cuda.upload(&randn(rng, tokens * k, 1.0))?;
            let mut dy = cuda.alloc_f32(tokens * n)?;
            for blocks in [512usize, 1024, 2048] {
                cuda.set_gemv_blocks(blocks);
                for inside in [true, false] {
                    let run = |dy: &mut cudarc::driver::CudaSlice<f32>| {
                        if inside {
                            cuda.exl3_matmul(&w, &dx, tokens, dy)
                        } else {
                            cuda.exl3_matmul_rotating_first(&w, &dx, tokens, dy)
                        }
                    };
                    let secs = seconds_per_call(cuda, 30, || run(&mut dy))?;
                    println!(
                        "dense {} n={tokens} blocks={blocks} {}: {:.1} us, {:.0} GB/s of trellis",
                        label(&lin),
                        if inside {
                            "rotating inside"
                        } else {
                            "rotating first"
                        },
                        secs * 1e6,
                        trellis_bytes / secs / 1e9
                    );
                }
            }
        }
    }
    cuda.set_gemv_blocks(crate::backend::cuda::GEMV_BLOCKS);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fixture parses into what `check_exllamav3` reads: 27 trellises with their
    /// reconstructions, 15 of them with a `LinearEXL3` run of 5 rows; and the CPU's product on
    /// them is within the bound the GPU's is held to.
    #[test]
    fn exllamav3_fixture_reads_as_the_gpu_check_expects() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(EXLLAMA_TILES);
        let tiles = read_tensors(&path).unwrap();
        let (mut trellises, mut runs) = (0, 0);
        for (name, (shape, trellis)) in tiles.iter().filter(|(k, _)| k.ends_with(".trellis")) {
            trellises += 1;
            let base = name.trim_end_matches(".trellis");
            assert_eq!(tiles[&format!("{base}.reconstructed")].0, [256, 128]);
            let p = base.replacen("tile.", "lin.", 1);
            let Some((_, x)) = tiles.get(&format!("{p}.x")) else {
                continue;
            };
            runs += 1;
            let cb = Codebook::from_name(name.split('.').nth(1).unwrap()).unwrap();
            let (suh, svh) = (
                f16s(&tiles[&format!("{p}.suh")].1),
                f16s(&tiles[&format!("{p}.svh")].1),
            );
            let lin = Exl3Linear::new(shape, trellis, suh, svh, cb).unwrap();
            let x = f16s(x);
            assert_eq!(x.len(), 5 * 256);
            let y = cpu_product(&lin, &x, 5).unwrap();
            let err = rel_err(&y, &f16s(&tiles[&format!("{p}.y")].1));
            assert!(err < VS_EXLLAMA, "{p}: {err:.2e}");
        }
        assert_eq!((trellises, runs), (27, 15));
    }
}
