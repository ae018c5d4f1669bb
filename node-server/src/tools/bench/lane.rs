//! `bench --lane`: what the CPU lane of the near-exact modes spends on a decode step's routed
//! experts at a given width. Each step computes `--top-k` picks of one token row in parallel,
//! as the lane does (`GpuTier` hands it the RAM-resident picks), by the exact kernels (f32
//! activations: what `exact` and the GPU-less runs compute) and by the lane's (16-bit integer
//! activations where the weight format takes them, [`crate::quant::lane`]), both kernels on
//! every step in alternating order. The picks cycle through `--experts` experts (cold: far
//! more bytes than the caches hold, as RAM residents are) or repeat the same `--top-k` (hot:
//! from cache where it holds them). The roofline is the weights' bytes a step over the memory
//! bandwidth measured in the same run.

use super::BenchArgs;
use super::args::parse_record_format;
use super::common::measure_read_bandwidth;
use crate::model::mlp::SwiGlu;
use rayon::prelude::*;
use serde_json::json;
use std::time::Instant;

/// Steps timed per case (the median is reported).
const STEPS: usize = 32;
/// The model's SwiGLU clamp in the random experts.
const LIMIT: f32 = 10.0;

pub fn run(args: &BenchArgs) -> anyhow::Result<()> {
    let format = parse_record_format(&args.expert_format).map_err(anyhow::Error::msg)?;
    let (hidden, width, k) = (args.hidden, args.expert_width, args.top_k);
    anyhow::ensure!(k > 0, "--top-k must be at least 1");
    anyhow::ensure!(
        args.experts >= 2 * k,
        "--experts must be at least twice --top-k (the cold set cycles through them)"
    );
    let parts = crate::store::record_parts(hidden, width, format)?;
    eprintln!(
        "building {} random {} experts of {hidden} x {width} ({:.1} MiB each)",
        args.experts,
        format.describe(),
        parts.length() as f64 / (1 << 20) as f64
    );
    let experts: Vec<SwiGlu> = (0..args.experts)
        .into_par_iter()
        .map(|e| {
            let mut bytes = vec![0u8; parts.length()];
            crate::store::random_record(&parts, 11, e, &mut bytes);
            crate::tiers::source::expert_from_bytes(&parts, &bytes, LIMIT)
        })
        .collect::<anyhow::Result<_>>()?;
    let bytes: usize = experts[0].storage_bytes();
    let bandwidth = measure_read_bandwidth();
    // One token row per step, std about 1 (as the norm leaves it), heavy-tailed.
    let rows: Vec<Vec<f32>> = (0..STEPS)
        .map(|s| {
            (0..hidden)
                .map(|i| {
                    let u = (((s * hidden + i) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40)
                        as f32
                        / (1u64 << 24) as f32;
                    3.0 * (2.0 * u - 1.0).powi(3)
                })
                .collect()
        })
        .collect();

    // How far the lane's outputs are from the exact kernels' (relative RMS over a step's picks).
    let picks: Vec<&SwiGlu> = experts.iter().take(k).collect();
    let (mut num, mut den) = (0f64, 0f64);
    for p in &picks {
        let (a, b) = (p.forward(&rows[0], 1), p.forward_lane(&rows[0]));
        num += a
            .iter()
            .zip(&b)
            .map(|(x, y)| f64::from(x - y).powi(2))
            .sum::<f64>();
        den += a.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>();
    }
    let rel_rms = (num / den.max(f64::MIN_POSITIVE)).sqrt();

    // Both kernels take every step, in alternating order, so that drift in the machine's speed
    // (other tenants, frequency) falls on both alike.
    let mut cases = Vec::new();
    for set in ["cold", "hot"] {
        let mut times = [Vec::with_capacity(STEPS), Vec::with_capacity(STEPS)];
        for (s, row) in rows.iter().enumerate() {
            let picks: Vec<&SwiGlu> = (0..k)
                .map(|j| match set {
                    "cold" => &experts[(s * k + j) % experts.len()],
                    _ => &experts[j],
                })
                .collect();
            for turn in 0..2 {
                let lane = (s + turn) % 2 == 1;
                let started = Instant::now();
                let out: Vec<Vec<f32>> = picks
                    .par_iter()
                    .map(|e| {
                        if lane {
                            e.forward_lane(row)
                        } else {
                            e.forward(row, 1)
                        }
                    })
                    .collect();
                times[usize::from(lane)].push(started.elapsed().as_secs_f64());
                std::hint::black_box(out);
            }
        }
        for (kernel, times) in ["exact", "lane"].into_iter().zip(times) {
            // The first steps warm the pool.
            let mut steady = times[2..].to_vec();
            steady.sort_by(f64::total_cmp);
            let t = steady[steady.len() / 2];
            let step_bytes = (k * bytes) as f64;
            cases.push(json!({
                "set": set,
                "kernel": kernel,
                "ms_per_step": t * 1e3,
                "experts_per_s": k as f64 / t,
                "weights_gb_per_s": step_bytes / t / 1e9,
                "roofline_ratio": step_bytes / bandwidth / t,
            }));
        }
    }
    let ms = |set: &str, kernel: &str| {
        cases
            .iter()
            .find(|c| c["set"] == set && c["kernel"] == kernel)
            .and_then(|c| c["ms_per_step"].as_f64())
            .unwrap_or(f64::NAN)
    };
    let report = json!({
        "bench": "lane",
        "expert_format": format.describe(),
        "hidden": hidden,
        "expert_width": width,
        "picks_per_step": k,
        "experts": args.experts,
        "expert_bytes": bytes,
        "threads": rayon::current_num_threads(),
        "memory_read_gb_per_s": bandwidth / 1e9,
        "lane_vs_exact_rel_rms": rel_rms,
        "lane_kernels": {
            "q4_k": crate::quant::lane::kernel_name(),
            "exl3": crate::quant::exl3::simd_build(),
        },
        "lane_speedup": {
            "cold": ms("cold", "exact") / ms("cold", "lane"),
            "hot": ms("hot", "exact") / ms("hot", "lane"),
        },
        "cases": cases,
    });
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}
