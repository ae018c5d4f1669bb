//! `glmflash-node cuda-check`: every CUDA kernel against the CPU backend on fresh random
//! inputs (a new seed each run unless given), at wide and odd shapes, with outputs poisoned
//! (NaN) before each launch so an unwritten element fails. Prints one row per case and
//! exits non-zero on any failure. Needs a CUDA device.

use crate::backend::AttnLayout;
use crate::backend::cpu::Placer;
use crate::backend::cpu::{Matrix, ops};
use crate::backend::cuda::attn::DsaSpec;
use crate::backend::cuda::matrix::CudaPlacer;
use crate::backend::cuda::{
    Cuda, KdaForm, KdaSpec, MhcCollapse, MhcSpec, MoeLayout, MoeStep, RouteSpec, SlotArena,
};
use crate::model::checkpoint::DType;
use crate::model::config::Config;
use crate::model::dsa::{pool_key, pool_scores, select_tokens};
use crate::model::glm5::{LayerCache, Model, SeqCache, Step};
use crate::model::gpu::{CACHE_SPARE_TOKENS, GpuDecoder, GpuSeq};
use crate::model::kda::{self, KdaMode};
use crate::model::mhc::HyperConnection;
use crate::model::mla::sparse_attention;
use crate::model::mlp::{SwiGlu, swiglu};
use crate::model::moe::{Router, Routing, combine_experts};
use crate::model::random::{scaled_config, write_random_checkpoint};
use crate::quant::Format;
use crate::tiers::vram::write_slot;
use anyhow::Context;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;

#[derive(Debug, clap::Args)]
pub struct CudaCheckArgs {
    /// Seed of the random inputs (default: a fresh one, printed).
    #[arg(long, env = "GLMFLASH_SEED")]
    pub seed: Option<u64>,
    /// Also run the widest shapes (GLM-5.3-Flash expert size: hidden 4096, inter 2048).
    #[arg(long, env = "GLMFLASH_CHECK_WIDE")]
    pub wide: bool,
    #[arg(long, env = "GLMFLASH_CUDA_DEVICE", default_value_t = 0)]
    pub cuda_device: usize,
    /// Run only these groups of checks (comma-separated; default all): matvec, dense, moe,
    /// small, router, mhc, kda, mla, dsa, decode.
    #[arg(long, env = "GLMFLASH_CHECK_ONLY", value_delimiter = ',')]
    pub only: Vec<String>,
}

/// The groups of checks, in the order they run.
const GROUPS: [&str; 10] = [
    "matvec", "dense", "moe", "small", "router", "mhc", "kda", "mla", "dsa", "decode",
];

/// One compared case.
struct Case {
    name: String,
    rel: f64,
    bound: f64,
    finite: bool,
}

impl Case {
    fn ok(&self) -> bool {
        self.finite && self.rel <= self.bound
    }
}

/// `||a - b|| / ||b||` in f64; infinite when a length differs.
pub fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        num += (*g as f64 - *w as f64).powi(2);
        den += (*w as f64).powi(2);
    }
    (num / den.max(1e-300)).sqrt()
}

fn case(name: String, got: &[f32], want: &[f32], bound: f64) -> Case {
    Case {
        name,
        rel: rel_err(got, want),
        bound,
        finite: got.iter().all(|v| v.is_finite()) && got.len() == want.len(),
    }
}

fn randn(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.random::<f32>() * 2.0 - 1.0) * scale)
        .collect()
}

fn random_matrix(
    rng: &mut ChaCha8Rng,
    rows: usize,
    cols: usize,
    format: Format,
) -> anyhow::Result<Matrix> {
    let w = randn(rng, rows * cols, 1.0 / (cols as f32).sqrt());
    Ok(Matrix::from_f32(rows, cols, w).convert(format)?)
}

/// Runs every check; `Ok(true)` when all pass.
pub fn run(args: &CudaCheckArgs) -> anyhow::Result<bool> {
    let seed = args.seed.unwrap_or_else(rand::random);
    println!("cuda-check seed {seed}");
    let cuda = Cuda::open(args.cuda_device, None)?;
    println!("device {}", cuda.describe());
    cuda.set_poison(true);
    if let Some(bad) = args.only.iter().find(|g| !GROUPS.contains(&g.as_str())) {
        anyhow::bail!(
            "--only: no check group {bad:?} (groups: {})",
            GROUPS.join(", ")
        );
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut cases = Vec::new();
    for group in GROUPS {
        if !args.only.is_empty() && !args.only.iter().any(|g| g == group) {
            continue;
        }
        let (cuda, rng, cases) = (&cuda, &mut rng, &mut cases);
        match group {
            "matvec" => check_matvec(cuda, rng, args.wide, cases)?,
            "dense" => check_dense(cuda, rng, cases)?,
            "moe" => check_moe(cuda, rng, args.wide, cases)?,
            "small" => check_small_ops(cuda, rng, cases)?,
            "router" => check_router(cuda, rng, cases)?,
            "mhc" => check_mhc(cuda, rng, cases)?,
            "kda" => check_kda(cuda, rng, cases)?,
            "mla" => check_mla(cuda, rng, cases)?,
            "dsa" => check_dsa(cuda, rng, cases)?,
            _ => check_decode(cuda, rng, cases)?,
        }
    }
    println!("{:<52} {:>12} {:>10}  result", "case", "rel err", "bound");
    let mut failed = 0;
    for c in &cases {
        let verdict = if c.ok() { "ok" } else { "FAIL" };
        if !c.ok() {
            failed += 1;
        }
        let note = if c.finite { "" } else { " (non-finite output)" };
        println!(
            "{:<52} {:>12.3e} {:>10.0e}  {verdict}{note}",
            c.name, c.rel, c.bound
        );
    }
    println!("{} cases, {} failed (seed {seed})", cases.len(), failed);
    Ok(failed == 0)
}

/// f32 products in another summation order: far under 1e-5 relative.
const F32_BOUND: f64 = 1e-5;

fn check_matvec(
    cuda: &Cuda,
    rng: &mut ChaCha8Rng,
    wide: bool,
    cases: &mut Vec<Case>,
) -> anyhow::Result<()> {
    // Below 2048 rows `matvec_split` (a block per row; 37 x 512 leaves most of its warps
    // without columns), from 2048 the warp per row; 24 x 16384 is mHC's projection.
    let mut shapes = vec![(37, 512), (256, 768), (1024, 2048), (24, 16384)];
    if wide {
        shapes.extend([(2048, 4096), (4096, 2048), (6144, 4096)]);
    }
    for format in Format::ALL {
        // Columns not a multiple of 8 take the float formats' scalar loads.
        let odd = [(5, 260), (2100, 100)];
        let float = matches!(format, Format::F32 | Format::F16 | Format::Bf16);
        for &(rows, cols) in shapes.iter().chain(odd.iter().filter(|_| float)) {
            let m = random_matrix(rng, rows, cols, format)?;
            let w = cuda.upload(&m.to_bytes())?;
            for n in [1usize, 3, 8, 9, 17] {
                let x = randn(rng, n * cols, 1.0);
                let want = m.matmul(&x, n);
                let dx = cuda.upload(&x)?;
                let mut dy = cuda.alloc_f32(n * rows)?;
                cuda.matvec(&w, format, rows, cols, &dx, n, &mut dy)?;
                let got = cuda.download(&dy)?;
                cases.push(case(
                    format!("matvec {} {rows}x{cols} n={n}", format.name()),
                    &got[..n * rows],
                    &want,
                    F32_BOUND,
                ));
            }
        }
    }
    Ok(())
}

/// Dense matrices placed on the GPU as a model load places them (`Cuda::matmul`: cuBLAS for
/// many tokens of f32, and of f16/bf16 widened a tile at a time: 4100 x 4096 is three tiles,
/// the last of 4 rows).
fn check_dense(
    cuda: &Arc<Cuda>,
    rng: &mut ChaCha8Rng,
    cases: &mut Vec<Case>,
) -> anyhow::Result<()> {
    let placer = CudaPlacer::new(cuda.clone(), 1)?;
    for format in [Format::F32, Format::F16, Format::Bf16, Format::Q4K] {
        for (rows, cols) in [(512usize, 256usize), (1000, 1536), (4100, 4096)] {
            let m = random_matrix(rng, rows, cols, format)?;
            // Called directly, not through Matrix::matmul, whose CPU fallback would hide a
            // failing device product.
            let device = placer
                .place(&m)
                .with_context(|| format!("placing {m:?} failed: {:?}", placer.failure()))?;
            for n in [1usize, 9, 64, 300] {
                let x = randn(rng, n * cols, 1.0);
                let want = m.matmul(&x, n);
                let mut got = vec![f32::NAN; n * rows];
                device.matmul_into(&x, n, &mut got)?;
                cases.push(case(
                    format!("dense {} {rows}x{cols} n={n}", format.name()),
                    &got,
                    &want,
                    F32_BOUND,
                ));
            }
        }
    }
    Ok(())
}

fn check_moe(
    cuda: &Cuda,
    rng: &mut ChaCha8Rng,
    wide: bool,
    cases: &mut Vec<Case>,
) -> anyhow::Result<()> {
    let mut shapes = vec![(512, 256, 16, 4)];
    if wide {
        shapes.push((4096, 2048, 12, 8));
    }
    for (hidden, inter, experts, k) in shapes {
        for (gu, down) in [
            (Format::F32, Format::F32),
            (Format::Bf16, Format::Bf16),
            (Format::F16, Format::F16),
            (Format::Q8_0, Format::Q8_0),
            (Format::Q4K, Format::Q4K),
            (Format::Q4K, Format::Q8_0),
        ] {
            let limit = 7.0;
            let ex: Vec<SwiGlu> = (0..experts)
                .map(|_| {
                    Ok(SwiGlu {
                        gate: random_matrix(rng, inter, hidden, gu)?,
                        up: random_matrix(rng, inter, hidden, gu)?,
                        down: random_matrix(rng, hidden, inter, down)?,
                        limit,
                    })
                })
                .collect::<anyhow::Result<_>>()?;
            let layout = MoeLayout::new(hidden, inter, gu, down)?;
            // Slots in reverse order, so slot and expert numbers differ.
            let mut arena = SlotArena::new(cuda, layout, experts)?;
            for (e, expert) in ex.iter().enumerate() {
                write_slot(cuda.stream(), &mut arena, experts - 1 - e, expert)?;
            }
            for tokens in [1usize, 4, 33] {
                let x = randn(rng, tokens * hidden, 2.0);
                let routing = random_routing(rng, tokens, experts, k);
                let mut want = vec![0f32; tokens * hidden];
                combine_experts(hidden, &x, &routing, experts, &mut want, |e, rows, n| {
                    Ok(ex[e].forward(rows, n))
                })?;
                let slots: Vec<u32> = routing
                    .ids
                    .iter()
                    .map(|&e| (experts - 1 - e as usize) as u32)
                    .collect();
                let step = MoeStep {
                    layout,
                    tokens,
                    k,
                    limit,
                    slots: &slots,
                    weights: &routing.weights,
                };
                let got = cuda.moe(&arena.buf, &step, &x)?;
                cases.push(case(
                    format!(
                        "moe {}/{} h{hidden} i{inter} T={tokens} k={k}",
                        gu.name(),
                        down.name()
                    ),
                    &got,
                    &want,
                    F32_BOUND,
                ));
                // The same step in two launches with the odd picks computed on the CPU (as
                // the CPU lane does) must agree, and the GPU picks split across launches must
                // give the single launch's bits for an all-GPU split.
                let mut run = cuda.moe_begin(layout, tokens, k, &x)?;
                let (even, odd): (Vec<Pick>, Vec<Pick>) = slots
                    .iter()
                    .copied()
                    .enumerate()
                    .partition(|(p, _)| p % 2 == 0);
                cuda.moe_picks(&mut run, &arena.buf, limit, &even)?;
                for &(p, _) in &odd {
                    let (t, e) = (p / k, routing.ids[p] as usize);
                    let y = ex[e].forward(&x[t * hidden..(t + 1) * hidden], 1);
                    cuda.moe_set_rows(&mut run, p, &y)?;
                }
                let mixed = cuda.moe_finish(run, &routing.weights)?;
                cases.push(case(
                    format!(
                        "moe {}/{} T={tokens} half on the CPU lane",
                        gu.name(),
                        down.name()
                    ),
                    &mixed,
                    &want,
                    F32_BOUND,
                ));
                let mut run = cuda.moe_begin(layout, tokens, k, &x)?;
                cuda.moe_picks(&mut run, &arena.buf, limit, &odd)?;
                cuda.moe_picks(&mut run, &arena.buf, limit, &even)?;
                let split = cuda.moe_finish(run, &routing.weights)?;
                let same_bits = split
                    .iter()
                    .zip(&got)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                cases.push(Case {
                    name: format!(
                        "moe {}/{} T={tokens} two launches: same bits",
                        gu.name(),
                        down.name()
                    ),
                    rel: if same_bits { 0.0 } else { f64::INFINITY },
                    bound: 0.0,
                    finite: split.iter().all(|v| v.is_finite()),
                });
            }
        }
    }
    Ok(())
}

/// `(pick index, arena slot)`.
type Pick = (usize, u32);

/// `k` distinct experts per token with positive weights.
fn random_routing(rng: &mut ChaCha8Rng, tokens: usize, experts: usize, k: usize) -> Routing {
    let mut ids = Vec::with_capacity(tokens * k);
    let mut weights = Vec::with_capacity(tokens * k);
    for _ in 0..tokens {
        let mut picked: Vec<u32> = Vec::with_capacity(k);
        while picked.len() < k {
            let e = rng.random_range(0..experts) as u32;
            if !picked.contains(&e) {
                picked.push(e);
            }
        }
        ids.extend(picked);
        weights.extend((0..k).map(|_| rng.random::<f32>() + 0.1));
    }
    Routing {
        k,
        ids,
        weights,
        phases: Vec::new(),
    }
}

fn check_small_ops(cuda: &Cuda, rng: &mut ChaCha8Rng, cases: &mut Vec<Case>) -> anyhow::Result<()> {
    for (rows, width) in [(1usize, 64usize), (7, 128), (33, 4096), (5, 1000)] {
        let x = randn(rng, rows * width, 3.0);
        let w = randn(rng, width, 1.0);
        let g = randn(rng, rows * width, 4.0);
        for weighted in [false, true] {
            let mut want = x.clone();
            ops::rms_norm(&mut want, weighted.then_some(&w[..]), width, 1e-6);
            let mut dx = cuda.upload(&x)?;
            let dw = cuda.upload(&w)?;
            cuda.rms_norm(&mut dx, weighted.then_some(&dw), width, 1e-6)?;
            let got = cuda.download(&dx)?;
            cases.push(case(
                format!("rms_norm {rows}x{width} weight={weighted}"),
                &got,
                &want,
                F32_BOUND,
            ));
        }
        let mut want = x.clone();
        for (o, gg) in want.chunks_exact_mut(width).zip(g.chunks_exact(width)) {
            ops::rms_norm(o, Some(&w), width, 1e-6);
            o.iter_mut()
                .zip(gg)
                .for_each(|(o, gg)| *o *= ops::sigmoid(*gg));
        }
        let mut dx = cuda.upload(&x)?;
        let (dg, dw) = (cuda.upload(&g)?, cuda.upload(&w)?);
        cuda.gated_rms_norm(&mut dx, &dg, &dw, width, 1e-6)?;
        cases.push(case(
            format!("gated_rms_norm {rows}x{width}"),
            &cuda.download(&dx)?,
            &want,
            F32_BOUND,
        ));
    }
    for n in [1usize, 1000, 100_003] {
        let gate = randn(rng, n, 20.0);
        let up = randn(rng, n, 20.0);
        let want = swiglu(&gate, &up, 7.0);
        let (dg, du) = (cuda.upload(&gate)?, cuda.upload(&up)?);
        let mut out = cuda.alloc_f32(n)?;
        cuda.swiglu(&dg, &du, 7.0, &mut out)?;
        cases.push(case(
            format!("swiglu n={n}"),
            &cuda.download(&out)?,
            &want,
            F32_BOUND,
        ));
    }
    Ok(())
}

fn check_router(cuda: &Cuda, rng: &mut ChaCha8Rng, cases: &mut Vec<Case>) -> anyhow::Result<()> {
    for (experts, groups, topk_groups, k, normalize) in [
        (16usize, 1usize, 1usize, 4usize, true),
        (64, 8, 4, 8, true),
        (288, 1, 1, 8, true),
        (288, 8, 4, 8, false),
    ] {
        let tokens = 37;
        let hidden = 8;
        let router = Router::new(
            Matrix::from_f32(experts, hidden, randn(rng, experts * hidden, 1.0)),
            randn(rng, experts, 0.1),
            k,
            groups,
            topk_groups,
            normalize,
            2.5,
        );
        let mut logits = randn(rng, tokens * experts, 4.0);
        // Exact ties in the choice must go to the lower index, as on the CPU.
        logits[3] = logits[5];
        let want = router.choose(&logits, tokens);
        let (dl, db) = (cuda.upload(&logits)?, cuda.upload(router.bias())?);
        let spec = RouteSpec {
            experts,
            groups,
            topk_groups,
            k,
            normalize,
            scale: 2.5,
        };
        let (ids, weights) = cuda.route(&dl, &db, spec, tokens)?;
        let name = format!("route E={experts} groups={groups}/{topk_groups} k={k}");
        let same_ids = ids == want.ids;
        cases.push(Case {
            name: format!("{name} ids"),
            rel: if same_ids { 0.0 } else { f64::INFINITY },
            bound: 0.0,
            finite: true,
        });
        cases.push(case(
            format!("{name} weights"),
            &weights,
            &want.weights,
            F32_BOUND,
        ));
    }
    Ok(())
}

/// A default config with the mHC shape set (the other fields do not matter to mHC).
fn mhc_config(streams: usize, hidden: usize) -> anyhow::Result<Config> {
    let mut cfg = Config::from_json(&serde_json::json!({}))?;
    cfg.hc_mult = streams;
    cfg.hidden_size = hidden;
    Ok(cfg)
}

/// mHC collapse (RMSNorm, projection, weights, collapse: all on the GPU) and expand against
/// `HyperConnection`, then three layers chained on each side (identity sublayers).
fn check_mhc(cuda: &Cuda, rng: &mut ChaCha8Rng, cases: &mut Vec<Case>) -> anyhow::Result<()> {
    for (n, d) in [(4usize, 4096usize), (4, 100), (3, 257)] {
        let cfg = mhc_config(n, d)?;
        let width = (2 + n) * n;
        let proj = random_matrix(rng, width, n * d, Format::F32)?;
        let w = cuda.upload(&proj.to_bytes())?;
        let base = randn(rng, width, 1.0);
        let scale = [0.5 + rng.random::<f32>(), 0.5 + rng.random::<f32>(), 2.0];
        let hc = HyperConnection::new(&cfg, proj, base.clone(), scale);
        let db = cuda.upload(&base)?;
        let spec = MhcSpec {
            streams: n,
            hidden: d,
            scale,
            hc_eps: cfg.hc_eps,
            sinkhorn_iters: cfg.hc_sinkhorn_iters,
        };
        let gpu_collapse = |streams: &[f32], tokens: usize| -> anyhow::Result<MhcCollapse> {
            let ds = cuda.upload(streams)?;
            let mut normed = cuda.upload(streams)?;
            cuda.rms_norm(&mut normed, None, n * d, cfg.rms_norm_eps)?;
            let mut logits = cuda.alloc_f32(tokens * width)?;
            cuda.matvec(&w, Format::F32, width, n * d, &normed, tokens, &mut logits)?;
            let mut out = MhcCollapse {
                collapsed: cuda.alloc_f32(tokens * d)?,
                post: cuda.alloc_f32(tokens * n)?,
                comb: cuda.alloc_f32(tokens * n * n)?,
            };
            cuda.mhc_collapse_dev(spec, &logits, &db, &ds, tokens, &mut out)?;
            Ok(MhcCollapse {
                collapsed: cuda.download(&out.collapsed)?,
                post: cuda.download(&out.post)?,
                comb: cuda.download(&out.comb)?,
            })
        };
        for tokens in [1usize, 5] {
            let name = format!("mhc n{n} d{d} T={tokens}");
            let streams = randn(rng, tokens * n * d, 2.0);
            let (want_x, want_mix) = hc.collapse(&streams, tokens);
            let got = gpu_collapse(&streams, tokens)?;
            cases.push(case(
                format!("{name} collapse"),
                &got.collapsed,
                &want_x,
                F32_BOUND,
            ));
            cases.push(case(
                format!("{name} post"),
                &got.post,
                &want_mix.post,
                F32_BOUND,
            ));
            cases.push(case(
                format!("{name} comb"),
                &got.comb,
                &want_mix.comb,
                F32_BOUND,
            ));
            let y = randn(rng, tokens * d, 2.0);
            let want = hc.expand(&want_mix, &streams, &y, tokens);
            let got =
                cuda.mhc_expand(spec, &want_mix.post, &want_mix.comb, &streams, &y, tokens)?;
            cases.push(case(format!("{name} expand"), &got, &want, F32_BOUND));

            let (mut cpu, mut gpu) = (streams.clone(), streams);
            for _ in 0..3 {
                let (x, mix) = hc.collapse(&cpu, tokens);
                cpu = hc.expand(&mix, &cpu, &x, tokens);
                let c = gpu_collapse(&gpu, tokens)?;
                gpu = cuda.mhc_expand(spec, &c.post, &c.comb, &gpu, &c.collapsed, tokens)?;
            }
            cases.push(case(
                format!("{name} 3 layers chained"),
                &gpu,
                &cpu,
                F32_BOUND,
            ));
        }
    }
    Ok(())
}

/// KDA's conv over spans continuing one conv state, then the delta rule (the recurrent and
/// the chunked kernel) over decode steps and prefill spans continuing one recurrent state
/// kept on the device; outputs and both states after every span against the CPU
/// (`kda::conv_step`, `kda::attend`).
fn check_kda(cuda: &Cuda, rng: &mut ChaCha8Rng, cases: &mut Vec<Case>) -> anyhow::Result<()> {
    for (heads, dh, kernel) in [(32usize, 128usize, 4usize), (3, 40, 4), (2, 16, 3)] {
        let spec = KdaSpec {
            heads,
            head_dim: dh,
            kernel,
            l2_eps: kda::L2_EPS,
        };
        let (c, w) = (heads * dh, 3 * heads * dh);
        let shape = format!("H{heads} d{dh}");
        let taps = randn(rng, w * kernel, 0.6);
        let mut cpu_conv = randn(rng, (kernel - 1) * w, 2.0);
        let mut gpu_conv = cpu_conv.clone();
        // Spans shorter than K - 1 shift the state partly; 70 spans two conv segments.
        for (step, len) in [1usize, 2, 70, 1].into_iter().enumerate() {
            let qkv = randn(rng, len * w, 2.0);
            let want = kda::conv_step(&taps, kernel, &qkv, len, &mut cpu_conv);
            let got = cuda.kda_conv(spec, &taps, &qkv, len, &mut gpu_conv)?;
            let name = format!("kda_conv {shape} K{kernel} span {step} T={len}");
            cases.push(case(name.clone(), &got, &want, F32_BOUND));
            cases.push(case(
                format!("{name} state"),
                &gpu_conv,
                &cpu_conv,
                F32_BOUND,
            ));
        }

        // Log decays uniform in [-decay, 0].
        let inputs = |rng: &mut ChaCha8Rng, len: usize, decay: f32| {
            let mixed = randn(rng, len * w, 1.0);
            let g: Vec<f32> = (0..len * c).map(|_| -rng.random::<f32>() * decay).collect();
            let beta: Vec<f32> = (0..len * heads).map(|_| rng.random::<f32>()).collect();
            (mixed, g, beta)
        };
        let s0 = randn(rng, heads * dh * dh, 0.5);
        // Spans through one kernel form continuing one device state, each against the CPU in
        // `mode` continuing its own: the output and both states after every span.
        let mut spans = |rng: &mut ChaCha8Rng,
                         form: KdaForm,
                         mode: KdaMode,
                         lens: &[usize],
                         decay: f32,
                         label: &str|
         -> anyhow::Result<()> {
            let mut cpu_s = s0.clone();
            let mut d_state = cuda.upload(&s0)?;
            for (step, &len) in lens.iter().enumerate() {
                let (mixed, g, beta) = inputs(rng, len, decay);
                let want = kda::attend(&mixed, &g, &beta, len, heads, dh, &mut cpu_s, mode);
                let mut out = cuda.alloc_f32(len * c)?;
                cuda.kda_delta_dev(
                    spec,
                    form,
                    &cuda.upload(&mixed)?,
                    &cuda.upload(&g)?,
                    &cuda.upload(&beta)?,
                    len,
                    &mut d_state,
                    &mut out,
                )?;
                let name = format!("{label} {shape} span {step} T={len}");
                cases.push(case(name.clone(), &cuda.download(&out)?, &want, F32_BOUND));
                cases.push(case(
                    format!("{name} state"),
                    &cuda.download(&d_state)?,
                    &cpu_s,
                    F32_BOUND,
                ));
            }
            Ok(())
        };
        let (recurrent, chunked) = (KdaForm::Recurrent, KdaForm::Chunked);
        spans(
            rng,
            recurrent,
            KdaMode::Recurrent,
            &[1, 1, 1, 7, 1, 130],
            0.5,
            "kda_recurrent",
        )?;
        // Prefill as the CPU engine runs it (chunked for more than one token): another
        // algorithm, yet on the CPU the two forms agree to ~4e-7 at these shapes.
        spans(
            rng,
            recurrent,
            KdaMode::Auto,
            &[150],
            0.5,
            "kda_recurrent vs chunked",
        )?;
        // The chunked kernel (16-token chunks) against both CPU forms (the CPU's chunks are
        // 64 tokens): one token, a chunk less one, a chunk, a chunk and one, then long spans
        // that end mid-chunk. Its sums run in another order than either CPU form's, as the
        // recurrent kernel's do against the CPU's chunked form above.
        for mode in [KdaMode::Auto, KdaMode::Recurrent] {
            let label = format!("kda_chunked vs {mode:?}");
            spans(rng, chunked, mode, &[1, 15, 16, 17, 150, 1000], 0.5, &label)?;
        }
        // Log decays down to -5 per token (a gate's lower bound): across a chunk the decay
        // reaches exp(-80), which the kernel only meets as exp(G_t - G_s) <= 1 and exp(G_t).
        let label = "kda_chunked strong decay";
        spans(rng, chunked, KdaMode::Recurrent, &[17, 150], 5.0, label)?;
        // The host-slice wrapper, once per form.
        for form in [recurrent, chunked] {
            let len = 40;
            let (mixed, g, beta) = inputs(rng, len, 0.5);
            let (mut cpu_s, mut gpu_s) = (s0.clone(), s0.clone());
            let want = kda::attend(&mixed, &g, &beta, len, heads, dh, &mut cpu_s, KdaMode::Auto);
            let got = cuda.kda_delta(spec, form, &mixed, &g, &beta, len, &mut gpu_s)?;
            let name = format!("kda_delta {form:?} {shape} host slices T={len}");
            cases.push(case(name.clone(), &got, &want, F32_BOUND));
            cases.push(case(format!("{name} state"), &gpu_s, &cpu_s, F32_BOUND));
        }
    }
    Ok(())
}

/// A case that passes only on exact equality.
fn exact_case(name: String, same: bool) -> Case {
    Case {
        name,
        rel: if same { 0.0 } else { f64::INFINITY },
        bound: 0.0,
        finite: true,
    }
}

/// A selection as the indexer makes one: `topk` tokens of whole pools of `kpool` among the
/// first `visible` tokens, plus the incomplete tail.
fn random_selection(rng: &mut ChaCha8Rng, visible: usize, kpool: usize, topk: usize) -> Vec<u32> {
    let scores = randn(rng, visible / kpool, 1.0);
    select_tokens(&scores, topk, kpool, visible, true)
}

/// MLA attention over selected tokens: absorbed decode over the latent cache (GLM-5.3-Flash:
/// 64 heads, rank 512, 8K cache, 2048 selected of pools of 16) and expanded prefill.
fn check_mla(cuda: &Cuda, rng: &mut ChaCha8Rng, cases: &mut Vec<Case>) -> anyhow::Result<()> {
    // (heads, rank, cached tokens, query positions, kpool, topk); topk >= cache: dense.
    let absorbed = [
        (3usize, 40usize, 37usize, vec![36usize], 4usize, 64usize),
        (5, 72, 300, vec![10, 150, 299], 4, 64),
        (64, 512, 8192, vec![8191], 16, 2048),
        (64, 512, 8192, vec![8189, 8190, 8191], 16, 2048),
        (64, 512, 1500, vec![1499], 16, 2048),
    ];
    let scale = 256f32.powf(-0.5);
    for (heads, rank, cached, positions, kpool, topk) in absorbed {
        let latents = randn(rng, cached * rank, 1.7);
        let sel: Vec<Vec<u32>> = positions
            .iter()
            .map(|&p| random_selection(rng, p + 1, kpool, topk))
            .collect();
        let q = randn(rng, positions.len() * heads * rank, 4.0);
        let layout = AttnLayout::absorbed(heads, rank, scale);
        let want = sparse_attention(&q, &latents, &layout, &sel);
        let got = cuda.mla_sparse_attend(&q, &latents, &layout, &sel)?;
        cases.push(case(
            format!(
                "mla absorbed h{heads} r{rank} T={cached} q={} picks={}",
                positions.len(),
                sel[0].len()
            ),
            &got,
            &want,
            F32_BOUND,
        ));
    }
    // (heads, nope, v_dim, tokens, new tokens at the end, kpool, topk)
    let expanded = [
        (3usize, 24usize, 20usize, 50usize, 7usize, 4usize, 16usize),
        (64, 256, 256, 600, 5, 16, 256),
        (64, 256, 256, 600, 3, 16, 2048),
    ];
    for (heads, nope, vd, tokens, new, kpool, topk) in expanded {
        let layout = AttnLayout::expanded(heads, nope, vd, (nope as f32).powf(-0.5));
        let kv = randn(rng, tokens * layout.stride, 1.7);
        let sel: Vec<Vec<u32>> = (tokens - new..tokens)
            .map(|p| random_selection(rng, p + 1, kpool, topk))
            .collect();
        let q = randn(rng, new * heads * nope, 2.0);
        let want = sparse_attention(&q, &kv, &layout, &sel);
        let got = cuda.mla_sparse_attend(&q, &kv, &layout, &sel)?;
        cases.push(case(
            format!("mla expanded h{heads} nope{nope} v{vd} T={tokens} new={new} topk={topk}"),
            &got,
            &want,
            F32_BOUND,
        ));
    }
    Ok(())
}

/// The DSA indexer: pool keys, and selections that must equal the CPU's exactly, ties
/// included (duplicated pool keys, all-zero scores).
fn check_dsa(cuda: &Cuda, rng: &mut ChaCha8Rng, cases: &mut Vec<Case>) -> anyhow::Result<()> {
    struct Shape {
        heads: usize,
        dim: usize,
        kpool: usize,
        topk: usize,
        tokens: usize,
        select_tail: bool,
    }
    let shapes = [
        Shape {
            heads: 2,
            dim: 20,
            kpool: 4,
            topk: 16,
            tokens: 37,
            select_tail: true,
        },
        Shape {
            heads: 1,
            dim: 20,
            kpool: 3,
            topk: 9,
            tokens: 50,
            select_tail: false,
        },
        Shape {
            heads: 40,
            dim: 36,
            kpool: 4,
            topk: 64,
            tokens: 1000,
            select_tail: true,
        },
        Shape {
            heads: 32,
            dim: 128,
            kpool: 16,
            topk: 2048,
            tokens: 8192,
            select_tail: true,
        },
        Shape {
            heads: 32,
            dim: 128,
            kpool: 16,
            topk: 2048,
            tokens: 8199,
            select_tail: true,
        },
    ];
    for sh in shapes {
        let (di, kpool) = (sh.dim, sh.kpool);
        let pools = sh.tokens / kpool;
        let keys = randn(rng, sh.tokens * di, 1.7);
        let gates = randn(rng, sh.tokens * di, 3.0);
        let ape = randn(rng, kpool * di, 1.0);
        let mut want_keys = Vec::with_capacity(pools * di);
        for p in 0..pools {
            let rows = p * kpool * di..(p + 1) * kpool * di;
            want_keys.extend(pool_key(&keys[rows.clone()], &gates[rows], &ape, di, kpool));
        }
        // In two launches, as pools complete over time.
        let half = pools / 2;
        let mut got_keys = cuda.dsa_pool_keys(&keys, &gates, &ape, kpool, 0, half)?;
        got_keys.extend(cuda.dsa_pool_keys(&keys, &gates, &ape, kpool, half, pools - half)?);
        let name = format!(
            "dsa h{} d{di} kpool{kpool} topk{} T={}",
            sh.heads, sh.topk, sh.tokens
        );
        cases.push(case(
            format!("{name} pool keys"),
            &got_keys,
            &want_keys,
            F32_BOUND,
        ));

        // Selections from the CPU's pool keys, so both sides score the same numbers. Ties:
        // every other pool of the last two thirds carries pool 3's key (more of them than
        // the budget on the wide shapes), query 4 scores those best, and query 3 scores
        // every pool -0.0.
        let mut pool_keys = want_keys;
        let dup = pool_keys[3 * di..4 * di].to_vec();
        for p in (pools / 3..pools).step_by(2) {
            pool_keys[p * di..(p + 1) * di].copy_from_slice(&dup);
        }
        let t = sh.tokens;
        let positions = vec![
            0usize,
            kpool - 1,
            kpool,
            t / 2 + 1,
            t - 2,
            sh.topk.min(t - 1),
            t - 1,
        ];
        let queries = positions.len();
        let (hd, h) = (sh.heads * di, sh.heads);
        let mut q = randn(rng, queries * hd, 1.0);
        let mut w = randn(rng, queries * h, 1.0);
        // All-zero dots and negative weights: every term, so every score, is -0.0.
        q[3 * hd..4 * hd].fill(0.0);
        w[3 * h..4 * h].iter_mut().for_each(|v| *v = -v.abs() - 0.1);
        for head in 0..h {
            q[4 * hd + head * di..4 * hd + (head + 1) * di].copy_from_slice(&dup);
        }
        w[4 * h..5 * h].iter_mut().for_each(|v| *v = v.abs() + 0.1);
        let want: Vec<Vec<u32>> = positions
            .iter()
            .enumerate()
            .map(|(i, &pos)| {
                let cand = ((pos + 1) / kpool).min(pools);
                let scores = pool_scores(
                    &q[i * sh.heads * di..(i + 1) * sh.heads * di],
                    &w[i * sh.heads..(i + 1) * sh.heads],
                    &pool_keys[..cand * di],
                    di,
                );
                select_tokens(&scores, sh.topk, kpool, pos + 1, sh.select_tail)
            })
            .collect();
        let spec = DsaSpec {
            heads: sh.heads,
            dim: di,
            kpool,
            topk: sh.topk,
            select_tail: sh.select_tail,
        };
        let got = cuda.dsa_select(&q, &w, &pool_keys, spec, &positions)?;
        cases.push(exact_case(
            format!("{name} select {queries} queries"),
            got == want,
        ));
        // Decode: the last position alone, as one step asks.
        let last = queries - 1;
        let got = cuda.dsa_select(
            &q[last * sh.heads * di..],
            &w[last * sh.heads..],
            &pool_keys,
            spec,
            &positions[last..],
        )?;
        cases.push(exact_case(
            format!("{name} select decode"),
            got[..] == want[last..],
        ));
    }
    Ok(())
}

/// Whole-model decode steps on the GPU: bound of the logits against the CPU's after every
/// step (f32 sums in other orders through every layer).
const DECODE_BOUND: f64 = 1e-4;
/// Prompt tokens prefilled on the CPU before the decode steps, and the steps.
const DECODE_PROMPT: usize = 40;
const DECODE_STEPS: usize = 8;

/// `GpuDecoder` against `Model::decode_step` from one CPU prefill: a random f32 model with
/// every layer kind (KDA, MLA with full and shared indexers, dense and MoE; index_topk 16 so
/// the indexer keeps one of two or three pools) whose weights the decoder uploads itself, then
/// the demo model (bf16) with its dense weights placed on the GPU, whose copies the decoder
/// reuses, and the demo model with its routed experts in VRAM too.
fn check_decode(
    cuda: &Arc<Cuda>,
    rng: &mut ChaCha8Rng,
    cases: &mut Vec<Case>,
) -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!("glmflash-decode-check-{}", std::process::id()));
    let result = (|| -> anyhow::Result<()> {
        let random = dir.join("random");
        let mut config = scaled_config(512, 256, 8, 1, 16, 256, 4);
        config["index_topk"] = serde_json::json!(16);
        write_random_checkpoint(&random, &config, rng.random(), DType::F32)?;
        let model = Model::load(&random)?;
        decode_cases(cuda, &model, "random f32", rng, cases)?;

        let demo = dir.join("demo");
        crate::demo::make_demo_model(&demo, crate::demo::DEFAULT_SEED)?;
        let placer = CudaPlacer::new(cuda.clone(), 0)?;
        let model = Model::load_placed(&demo, None, Some(&placer))?;
        decode_cases(cuda, &model, "demo bf16 placed", rng, cases)?;

        // Every routed expert in VRAM: the decoder hands the provider its device rows
        // (`DeviceExperts`), the CPU reference goes through the same provider's host path.
        let (model, _) = crate::tiers::vram::load_model_on_gpu(&demo, cuda.clone())?;
        decode_cases(cuda, &model, "demo experts in VRAM", rng, cases)
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn decode_cases(
    cuda: &Arc<Cuda>,
    model: &Model,
    name: &str,
    rng: &mut ChaCha8Rng,
    cases: &mut Vec<Case>,
) -> anyhow::Result<()> {
    let vocab = model.cfg.vocab_size as u32;
    let prompt: Vec<u32> = (0..DECODE_PROMPT)
        .map(|_| rng.random_range(0..vocab))
        .collect();
    let (logits, mut cpu_cache) = model.prefill(&prompt)?;
    let decoder = GpuDecoder::new(cuda, model)?;
    let mut seq = decoder.sequence(&cpu_cache)?;
    let mut next = ops::argmax(&logits) as u32;
    for step in 0..DECODE_STEPS {
        let want = model.decode_step(next, &mut cpu_cache)?;
        let got = decoder.step(model, &mut seq, next)?;
        let label = format!("decode {name} step {step}");
        cases.push(case(format!("{label} logits"), &got, &want, DECODE_BOUND));
        let (g, w) = (ops::argmax(&got), ops::argmax(&want));
        cases.push(exact_case(format!("{label} greedy token"), g == w));
        next = w as u32;
    }
    let gpu_cache = decoder.to_host(&seq)?;
    compare_caches(&format!("decode {name}"), &gpu_cache, &cpu_cache, cases);
    decode_batch_cases(model, &decoder, name, rng, cases)?;
    prefill_cases(model, &decoder, name, rng, cases)
}

/// `GpuDecoder::forward` over prompt chunks: a fresh sequence's prompt in three uneven
/// chunks, the last growing the device caches (logits after each against the CPU's forward
/// over the same chunks, and the caches after them), then one call holding a third sequence's whole prompt and a decode token of the
/// first, against the CPU doing each alone.
fn prefill_cases(
    model: &Model,
    decoder: &GpuDecoder,
    name: &str,
    rng: &mut ChaCha8Rng,
    cases: &mut Vec<Case>,
) -> anyhow::Result<()> {
    let vocab = model.cfg.vocab_size as u32;
    let mut random =
        |len: usize| -> Vec<u32> { (0..len).map(|_| rng.random_range(0..vocab)).collect() };
    // Longer than a new sequence's room on the device, so the last chunk grows its caches.
    let prompt = random(CACHE_SPARE_TOKENS + 60);
    let mut cpu = model.new_cache();
    let mut gpu = decoder.sequence(&model.new_cache())?;
    for (c, chunk) in [&prompt[..13], &prompt[13..200], &prompt[200..]]
        .into_iter()
        .enumerate()
    {
        let want = model
            .forward(
                &mut [Step {
                    tokens: chunk,
                    cache: &mut cpu,
                    all_logits: false,
                }],
                None,
            )?
            .remove(0);
        let got = decoder.forward(model, &mut [&mut gpu], &[chunk])?.remove(0);
        let label = format!("prefill {name} chunk {c} ({} tokens)", chunk.len());
        cases.push(case(format!("{label} logits"), &got, &want, DECODE_BOUND));
    }
    let host = decoder.to_host(&gpu)?;
    compare_caches(&format!("prefill {name}"), &host, &cpu, cases);

    // A prompt and a decode token in one call.
    let other = random(DECODE_PROMPT / 2 + 5);
    let token = random(1);
    let mut cpu_other = model.new_cache();
    let mut gpu_other = decoder.sequence(&model.new_cache())?;
    let got = decoder.forward(model, &mut [&mut gpu_other, &mut gpu], &[&other, &token])?;
    let want_other = model
        .forward(
            &mut [Step {
                tokens: &other,
                cache: &mut cpu_other,
                all_logits: false,
            }],
            None,
        )?
        .remove(0);
    let want = model.decode_step(token[0], &mut cpu)?;
    cases.push(case(
        format!("prefill {name} mixed call: prompt logits"),
        &got[0],
        &want_other,
        DECODE_BOUND,
    ));
    cases.push(case(
        format!("prefill {name} mixed call: decode logits"),
        &got[1],
        &want,
        DECODE_BOUND,
    ));
    Ok(())
}

/// A device sequence's caches (`gpu`, back on the host) against the CPU's (`cpu`) after the
/// same tokens: length, KDA conv and state, MLA latents and indexer pool keys per layer.
fn compare_caches(what: &str, gpu: &SeqCache, cpu: &SeqCache, cases: &mut Vec<Case>) {
    cases.push(exact_case(
        format!("{what} cache length"),
        gpu.len == cpu.len,
    ));
    for (li, (g, w)) in gpu.layers.iter().zip(&cpu.layers).enumerate() {
        let label = format!("{what} layer {li}");
        match (g, w) {
            (LayerCache::Kda(g), LayerCache::Kda(w)) => {
                cases.push(case(
                    format!("{label} kda conv"),
                    &g.conv,
                    &w.conv,
                    DECODE_BOUND,
                ));
                cases.push(case(
                    format!("{label} kda state"),
                    &g.recurrent,
                    &w.recurrent,
                    DECODE_BOUND,
                ));
            }
            (LayerCache::Mla(g), LayerCache::Mla(w)) => {
                cases.push(case(
                    format!("{label} mla latents"),
                    &g.latents,
                    &w.latents,
                    DECODE_BOUND,
                ));
                match (&g.indexer, &w.indexer) {
                    (Some(g), Some(w)) => cases.push(case(
                        format!("{label} indexer pool keys"),
                        &g.pool_keys,
                        &w.pool_keys,
                        DECODE_BOUND,
                    )),
                    (g, w) => cases.push(exact_case(
                        format!("{label} indexer presence"),
                        g.is_some() == w.is_some(),
                    )),
                }
            }
            _ => cases.push(exact_case(format!("{label} cache kind"), false)),
        }
    }
}

/// `GpuDecoder::step_batch` over sequences of different lengths (so different positions,
/// pool counts and selections) against each one's own CPU decode steps.
fn decode_batch_cases(
    model: &Model,
    decoder: &GpuDecoder,
    name: &str,
    rng: &mut ChaCha8Rng,
    cases: &mut Vec<Case>,
) -> anyhow::Result<()> {
    let vocab = model.cfg.vocab_size as u32;
    let mut cpu = Vec::new();
    let mut next = Vec::new();
    for len in [DECODE_PROMPT, DECODE_PROMPT / 2 + 3, 1] {
        let prompt: Vec<u32> = (0..len).map(|_| rng.random_range(0..vocab)).collect();
        let (logits, cache) = model.prefill(&prompt)?;
        next.push(ops::argmax(&logits) as u32);
        cpu.push(cache);
    }
    let mut gpu = cpu
        .iter()
        .map(|c| decoder.sequence(c))
        .collect::<anyhow::Result<Vec<_>>>()?;
    for step in 0..DECODE_STEPS / 2 {
        let mut seqs: Vec<&mut GpuSeq> = gpu.iter_mut().collect();
        let got = decoder.step_batch(model, &mut seqs, &next)?;
        for (i, (cache, got)) in cpu.iter_mut().zip(&got).enumerate() {
            let want = model.decode_step(next[i], cache)?;
            let label = format!("decode batch {name} step {step} sequence {i}");
            cases.push(case(format!("{label} logits"), got, &want, DECODE_BOUND));
            next[i] = ops::argmax(&want) as u32;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mhc_config_takes_the_shape() {
        let cfg = mhc_config(3, 257).unwrap();
        assert_eq!((cfg.hc_mult, cfg.hidden_size), (3, 257));
    }
}
