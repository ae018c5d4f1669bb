//! `glmflash-node cuda-check`: every CUDA kernel against the CPU backend on fresh random
//! inputs (a new seed each run unless given), at wide and odd shapes, with outputs poisoned
//! (NaN) before each launch so an unwritten element fails. Prints one row per case and
//! exits non-zero on any failure. Needs a CUDA device.

mod blocks;
mod exl3;
mod graph;
mod model;
mod per_op;
mod products;

use crate::backend::AttnLayout;
use crate::backend::cpu::Placer;
use crate::backend::cpu::{Matrix, ops};
use crate::backend::cuda::attn::DsaSpec;
use crate::backend::cuda::matrix::CudaPlacer;
use crate::backend::cuda::{
    Cuda, GEMM_MIN_TOKENS, KdaForm, KdaSpec, MhcCollapse, MhcSpec, MoeStep, RouteSpec, SlotArena,
};
use crate::model::checkpoint::DType;
use crate::model::config::Config;
use crate::model::decoder::{CACHE_SPARE_TOKENS, GpuDecoder};
use crate::model::dsa::{pool_key, pool_scores, select_tokens};
use crate::model::glm5::{LayerCache, Model, SeqCache, Step};
use crate::model::kda::{self, KdaMode};
use crate::model::mhc::HyperConnection;
use crate::model::mla::sparse_attention;
use crate::model::mlp::{SwiGlu, swiglu};
use crate::model::moe::{Router, Routing, combine_experts};
use crate::model::random::{scaled_config, write_random_checkpoint};
use crate::model::{Gpu, Host};
use crate::quant::Format;
use crate::tiers::vram::write_slot;
use anyhow::Context;
use blocks::{check_dsa, check_kda, check_mhc, check_mla, check_mla_seqs};
use exl3::check_exl3;
use model::check_decode;
use products::{check_dense, check_matvec, check_moe, check_router, check_small_ops, moe_speeds};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;

#[derive(Debug, clap::Args)]
pub struct CudaCheckArgs {
    /// Seed of the random inputs (default: a fresh one, printed).
    #[arg(long, env = "GLMFLASH_SEED")]
    pub seed: Option<u64>,
    /// Also run the widest shapes (GLM-5.3-Flash expert size: hidden 4096, inter 2048).
    #[arg(long, env = "GLMFLASH_CHECK_WIDE", value_parser = clap::builder::BoolishValueParser::new())]
    pub wide: bool,
    #[arg(long, env = "GLMFLASH_CUDA_DEVICE", default_value_t = 0)]
    pub cuda_device: usize,
    /// Run only these groups of checks (comma-separated; default all): ops, matvec, dense,
    /// moe, small, router, mhc, kda, mla, dsa, decode, graph, exl3; and `moe-speed` (only when named:
    /// the decode MoE step's timings that `moe --wide` prints too, without its checks).
    #[arg(long, env = "GLMFLASH_CHECK_ONLY", value_delimiter = ',')]
    pub only: Vec<String>,
}

/// The groups of checks, in the order they run: `ops` runs every op of the model's device
/// interface on the host and the GPU; the others check kernels the interface does not reach
/// one by one (each format's matvec, forced KDA forms, the expanded MLA layout, the fused
/// MoE launches, EXL3's decode and products against exllamav3's) and the whole model.
const GROUPS: [&str; 14] = [
    "ops",
    "matvec",
    "dense",
    "moe",
    "small",
    "router",
    "mhc",
    "kda",
    "mla",
    "dsa",
    "decode",
    "graph",
    "exl3",
    "moe-speed",
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

/// A case that passes only when `got` has `want`'s bits.
fn same_bits_case(name: String, got: &[f32], want: &[f32]) -> Case {
    let same = got.len() == want.len()
        && got
            .iter()
            .zip(want)
            .all(|(a, b)| a.to_bits() == b.to_bits());
    Case {
        name,
        rel: if same { 0.0 } else { f64::INFINITY },
        bound: 0.0,
        finite: got.iter().all(|v| v.is_finite()),
    }
}

/// Before a speed print: poisoning off (it would add a fill to every timed call), and the
/// device's copy rate (bytes read plus written a second), printed and returned.
fn copy_rate_for_speeds(cuda: &Cuda) -> anyhow::Result<f64> {
    cuda.set_poison(false);
    let copy = cuda.copy_bandwidth(1 << 30)?;
    println!(
        "device copy bandwidth {:.0} GB/s (read + write)",
        copy / 1e9
    );
    Ok(copy)
}

/// Seconds a call of `run` takes on the device: one call to warm up, then `reps` back to
/// back between two synchronisations.
fn seconds_per_call<E>(
    cuda: &Cuda,
    reps: usize,
    mut run: impl FnMut() -> Result<(), E>,
) -> anyhow::Result<f64>
where
    anyhow::Error: From<E>,
{
    run()?;
    cuda.synchronize()?;
    let started = std::time::Instant::now();
    for _ in 0..reps {
        run()?;
    }
    cuda.synchronize()?;
    Ok(started.elapsed().as_secs_f64() / reps as f64)
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
        let named = args.only.iter().any(|g| g == group);
        if (!args.only.is_empty() || group == "moe-speed") && !named {
            continue;
        }
        let (cuda, rng, cases) = (&cuda, &mut rng, &mut cases);
        match group {
            "ops" => per_op::check_ops(&Gpu::new(cuda), rng, args.wide, cases)?,
            "matvec" => check_matvec(cuda, rng, args.wide, cases)?,
            "dense" => check_dense(cuda, rng, cases)?,
            "moe" => check_moe(cuda, rng, args.wide, cases)?,
            "small" => check_small_ops(cuda, rng, cases)?,
            "router" => check_router(cuda, rng, cases)?,
            "mhc" => check_mhc(cuda, rng, cases)?,
            "kda" => check_kda(cuda, rng, cases)?,
            "mla" => {
                check_mla(cuda, rng, cases)?;
                check_mla_seqs(cuda, rng, cases)?
            }
            "dsa" => check_dsa(cuda, rng, cases)?,
            "decode" => check_decode(cuda, rng, cases)?,
            "graph" => graph::check_graph(cuda, rng, cases)?,
            "moe-speed" => moe_speeds(cuda, rng)?,
            _ => check_exl3(cuda, rng, args.wide, cases)?,
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

/// A case that passes only on exact equality.
fn exact_case(name: String, same: bool) -> Case {
    Case {
        name,
        rel: if same { 0.0 } else { f64::INFINITY },
        bound: 0.0,
        finite: true,
    }
}

/// A default config with the mHC shape set (the other fields do not matter to mHC).
fn mhc_config(streams: usize, hidden: usize) -> anyhow::Result<Config> {
    let mut cfg = Config::from_json(&serde_json::json!({}))?;
    cfg.hc_mult = streams;
    cfg.hidden_size = hidden;
    Ok(cfg)
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
