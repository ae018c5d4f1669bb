//! The figures of a measured `bench --flash` run: the tiers' counters before and after it,
//! its hit rates and bytes per tier, its rooflines and the GPU tier's sampled step parts.

use super::flash::Bandwidths;
use crate::model::Model;
use crate::tiers::provider::{Tier, TieredExperts};
use crate::tiers::stats::StepPart;
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// Counters of the tiers (and their GPU) at one moment.
#[derive(Clone, Copy, Default)]
pub(super) struct Snapshot {
    /// Lookups per tier (device, RAM, store) in the phase measured.
    lookups: [u64; 3],
    store_reads: u64,
    h2d: u64,
    gpu_picks: u64,
    cpu_picks: u64,
    /// Seconds the tiers' `forward` spent per part (`StepPart::ALL`).
    parts: [f64; 4],
    /// Seconds the fetch thread spent reading.
    fetch_busy: f64,
    /// The GPU tier's sampled MoE steps, part by part.
    moe_parts: crate::tiers::vram::StepParts,
}

pub(super) fn snapshot(tiers: Option<&Arc<TieredExperts>>, phase: usize) -> Snapshot {
    let Some(t) = tiers else {
        return Snapshot::default();
    };
    t.flush();
    let s = &t.stats;
    let gpu = t.gpu_stats();
    Snapshot {
        lookups: [Tier::Device, Tier::Ram, Tier::Store]
            .map(|tier| s.lookups[tier as usize][phase].load(Ordering::Relaxed)),
        store_reads: s.store_reads.load(Ordering::Relaxed),
        h2d: gpu.as_ref().map_or(0, |g| g.h2d_bytes),
        gpu_picks: gpu.as_ref().map_or(0, |g| g.gpu_picks),
        cpu_picks: gpu.as_ref().map_or(0, |g| g.cpu_picks),
        parts: StepPart::ALL.map(|p| s.part_seconds(p)),
        fetch_busy: s.fetch_busy_seconds(),
        moe_parts: gpu.as_ref().map(|g| g.parts).unwrap_or_default(),
    }
}

/// One measured run: the counters around it, its steps, the tokens they made, its time.
#[derive(Clone, Copy)]
pub(super) struct Measured {
    pub(super) before: Snapshot,
    pub(super) after: Snapshot,
    pub(super) steps: usize,
    pub(super) tokens: usize,
    pub(super) secs: f64,
}

/// Tier figures and the roofline of a measured run.
pub(super) fn figures(
    model: &Model,
    run: Measured,
    all_vram: bool,
    bw: &Bandwidths,
    record: usize,
) -> Value {
    let Measured {
        before,
        after,
        steps,
        tokens,
        secs,
    } = run;
    let cfg = &model.cfg;
    let picks =
        (cfg.moe_layers().iter().filter(|&&m| m).count() * cfg.num_experts_per_tok * tokens) as f64;
    let mut lookups: Vec<f64> = (0..3)
        .map(|i| (after.lookups[i] - before.lookups[i]) as f64)
        .collect();
    if all_vram {
        lookups = vec![picks, 0.0, 0.0];
    }
    let record = record as f64;
    let store_bytes = (after.store_reads - before.store_reads) as f64 * record;
    let h2d = (after.h2d - before.h2d) as f64;
    let cpu_picks = (after.cpu_picks - before.cpu_picks) as f64;
    let gpu_picks = if all_vram {
        picks
    } else {
        (after.gpu_picks - before.gpu_picks) as f64
    };
    let dense =
        (model.weight_bytes() - model.routed_expert_bytes() - model.embedding_bytes()) as f64;
    let n = steps as f64;
    let gpu_bytes = dense * n + gpu_picks * record;
    let cpu_bytes = cpu_picks * record;
    let parts = [
        gpu_bytes / bw.hbm,
        cpu_bytes / bw.ram,
        h2d / bw.h2d_pinned,
        store_bytes / bw.store_raw,
    ];
    let need = parts[0].max(parts[1]) + parts[2] + parts[3];
    // Every part beside every other: the slowest alone.
    let need_overlapped = parts.iter().copied().fold(0.0, f64::max);
    let t = tokens as f64;
    json!({
        "tokens": tokens,
        "steps": steps,
        "tok_s": t / secs,
        "ms_per_step": secs * 1e3 / n,
        "hit_rate": super::common::hit_rates(&lookups),
        "bytes_per_token": {
            "vram_experts": lookups[0] * record / t,
            "ram_experts": lookups[1] * record / t,
            "nvme": store_bytes / t,
            "h2d": h2d / t,
            "dense_hbm": dense * n / t,
        },
        "cpu_lane_share": cpu_picks / (cpu_picks + gpu_picks).max(1.0),
        "time_needed_ms_per_step": need * 1e3 / n,
        "roofline_ratio": need / secs,
        "time_needed_overlapped_ms_per_step": need_overlapped * 1e3 / n,
        "roofline_ratio_overlapped": need_overlapped / secs,
        "tier_ms_per_step": StepPart::ALL
            .iter()
            .map(|&p| {
                let i = p as usize;
                (p.name().to_string(), json!((after.parts[i] - before.parts[i]) * 1e3 / n))
            })
            .collect::<serde_json::Map<_, _>>(),
        // The fetch thread's reading, in the background of the parts above when it overlaps.
        "fetch_busy_ms_per_step": (after.fetch_busy - before.fetch_busy) * 1e3 / n,
        "moe_step_parts": moe_parts_json(&after.moe_parts.since(&before.moe_parts)),
    })
}

/// The GPU tier's sampled MoE steps, each part timed alone (ms, averaged), beside their sum
/// and slowest: a step that overlaps its parts takes between the two.
pub(super) fn moe_parts_json(p: &crate::tiers::vram::StepParts) -> Value {
    let ms = p.mean_ms();
    let parts = &ms[..3];
    json!({
        "sampled_steps": p.steps,
        "ms": ms.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
        "sum_ms": parts.iter().map(|(_, v)| v).sum::<f64>(),
        "slowest_ms": parts.iter().map(|(_, v)| *v).fold(0.0, f64::max),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tiers::vram::StepParts;

    #[test]
    fn sampled_parts_are_averaged_per_step_with_their_sum_and_slowest() {
        let before = StepParts {
            steps: 2,
            gpu: 0.5,
            lane: 0.5,
            staged: 0.0,
            wall: 1.0,
        };
        let after = StepParts {
            steps: 6,
            gpu: 0.5 + 0.004,
            lane: 0.5 + 0.012,
            staged: 0.002,
            wall: 1.0 + 0.020,
        };
        let j = moe_parts_json(&after.since(&before));
        let close = |v: &Value, want: f64| (v.as_f64().unwrap() - want).abs() < 1e-9;
        assert_eq!(j["sampled_steps"], 4);
        assert!(close(&j["ms"]["gpu"], 1.0), "{j}");
        assert!(close(&j["ms"]["lane"], 3.0), "{j}");
        assert!(close(&j["ms"]["staged"], 0.5), "{j}");
        assert!(close(&j["ms"]["wall"], 5.0), "{j}");
        assert!(close(&j["sum_ms"], 4.5), "{j}");
        assert!(close(&j["slowest_ms"], 3.0), "{j}");
    }
}
