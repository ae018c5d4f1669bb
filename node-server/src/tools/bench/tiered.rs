//! `bench --tiered`: decode through the three expert tiers on a wide random model whose
//! experts are read from a packed store, with uniform and with skewed (Zipf-like, set through
//! the routers' `e_score_correction_bias`) routing, under LFU and LRU. Reports decode tok/s,
//! hit rate and bytes per token per tier, the store's read rate, and the roofline ratio:
//! the time the bytes moved need at the measured bandwidths over the measured time per token.
//! The records are in `--expert-format` (bf16, q8_0 or q4_k: the random model's bf16 experts
//! converted as `pack-store --format` does); EXL3 records are `bench --flash`'s.

use super::args::BenchArgs;
use super::common::{measure_read_bandwidth, set_router_bias};
use crate::model::Model;
use crate::model::checkpoint::DType;
use crate::model::config::Config;
use crate::model::random::{scaled_config, write_random_checkpoint};
use crate::tiers::plan::TierPlan;
use crate::tiers::policy::PolicyKind;
use crate::tiers::provider::{Mode, Tier, TieredExperts};
use crate::tiers::source::StoreSource;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

pub fn run(args: &BenchArgs) -> anyhow::Result<()> {
    let root = args
        .tiers
        .scratch
        .join(format!("glmflash-bench-tiers-{}", std::process::id()));
    let result = measure_all(&root, args);
    let _ = std::fs::remove_dir_all(&root);
    println!("{}", serde_json::to_string_pretty(&result?)?);
    Ok(())
}

fn measure_all(root: &Path, args: &BenchArgs) -> anyhow::Result<serde_json::Value> {
    let format = match super::args::parse_record_format(&args.expert_format)
        .map_err(|e| anyhow::anyhow!("--expert-format {e}"))?
    {
        crate::store::PartFormat::Rows(f) => f,
        crate::store::PartFormat::Exl3 { .. } => anyhow::bail!(
            "--expert-format {}: bench --tiered packs a random bf16 model's experts, which \
             have no EXL3 trellis; EXL3 records through the tiers are `bench --flash \
             --flash-expert-format {}`",
            args.expert_format,
            args.expert_format
        ),
    };
    let config = scaled_config(
        args.vocab,
        args.hidden,
        args.layers,
        1,
        args.experts,
        args.expert_width,
        args.top_k,
    );
    let mem_bw = measure_read_bandwidth();
    let mut runs = Vec::new();
    for routing in ["uniform", "zipf"] {
        let dir = root.join(routing);
        write_random_checkpoint(&dir, &config, 1, DType::Bf16)?;
        let skew = if routing == "zipf" {
            args.tiers.zipf_bias
        } else {
            0.0
        };
        set_router_bias(&dir.join("model.safetensors"), args.experts, skew)?;
        let store = root.join(format!("{routing}-store"));
        let packed = Instant::now();
        crate::store::pack_store(
            &dir,
            &store,
            &crate::store::PackOptions {
                progress: false,
                verify: false,
                format: Some(crate::store::RecordFormat::Rows(format)),
                ..Default::default()
            },
        )?;
        eprintln!(
            "{routing}: packed in {:.1}s",
            packed.elapsed().as_secs_f64()
        );
        // The store's own rate for the roofline, unless given: every record, in chunks at
        // depth, checked as the tiers' reads are.
        let disk = match args.tiers.disk_gbps {
            Some(g) => g * 1e9,
            None => {
                let keys: Vec<(usize, usize)> = crate::store::Manifest::load(&store)?
                    .records
                    .iter()
                    .map(|r| (r.layer, r.expert))
                    .collect();
                super::common::store_read_rate(&store, &keys, crate::store::ChecksumPolicy::Always)?
            }
        };
        for policy in [PolicyKind::Lfu, PolicyKind::Lru] {
            let mut r = measure(&dir, &store, routing, policy, args, mem_bw, disk)?;
            r["store_o_direct_gb_s"] = serde_json::json!(disk / 1e9);
            eprintln!("{r}");
            runs.push(r);
        }
        std::fs::remove_dir_all(&store)?;
        std::fs::remove_dir_all(&dir)?;
    }
    Ok(serde_json::json!({
        "expert_format": format.name(),
        "memory_read_gb_s": mem_bw / 1e9,
        // Given with --disk-gbps, else each run's `store_o_direct_gb_s` is measured.
        "disk_gb_s": args.tiers.disk_gbps,
        "runs": runs,
    }))
}

fn measure(
    dir: &Path,
    store: &Path,
    routing: &str,
    policy: PolicyKind,
    args: &BenchArgs,
    mem_bw: f64,
    disk: f64,
) -> anyhow::Result<serde_json::Value> {
    let cfg = Config::from_file(&dir.join("config.json"))?;
    let moe = cfg.moe_layers();
    let source = Arc::new(StoreSource::open(store, dir, &cfg)?);
    let plan = TierPlan {
        eviction: policy,
        fetch_overlap: !args.tiers.no_fetch_overlap,
        prefetch: !args.tiers.no_prefetch,
        ..TierPlan::new(
            Mode::Nvme,
            args.tiers.vram_slots,
            args.tiers.ram_slots,
            cfg.n_routed_experts,
        )
    };
    let tiers = Arc::new(TieredExperts::new(
        source,
        cfg.hidden_size,
        cfg.n_routed_experts,
        &moe,
        &plan,
        None,
    )?);
    let model = Model::builder().experts(tiers.clone()).load(dir)?;
    let vocab = cfg.vocab_size as u32;
    let prompt: Vec<u32> = (0..args.prompt_tokens as u32)
        .map(|i| (i * 7919 + 13) % vocab)
        .collect();
    // The prompt first, on cold tiers: its chunk picks nearly every expert of a layer, so
    // it is the store-bound part (the reads against the products they overlap).
    let parts =
        |t: &TieredExperts| crate::tiers::stats::StepPart::ALL.map(|p| t.stats.part_seconds(p));
    let prefill_started = Instant::now();
    let (mut logits, mut cache) = model.prefill(&prompt)?;
    let prefill_s = prefill_started.elapsed().as_secs_f64();
    let prefill_reads = tiers.stats.store_reads.load(Ordering::Relaxed);
    let prefill_parts = parts(&tiers);
    let prefill_busy = tiers.stats.fetch_busy_seconds();
    let ahead_used = tiers.stats.prefetch_hits.load(Ordering::Relaxed);
    let ahead_wasted = tiers.stats.prefetch_wasted.load(Ordering::Relaxed);
    let mut step = |logits: &mut Vec<f32>| -> anyhow::Result<()> {
        let next = crate::backend::cpu::ops::argmax(logits) as u32;
        *logits = model.decode_step(next, &mut cache)?;
        Ok(())
    };
    for _ in 0..args.tiers.warmup_tokens {
        step(&mut logits)?;
    }
    tiers.flush();
    let s = &tiers.stats;
    let get = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
    let counters = || {
        (
            [Tier::Device, Tier::Ram, Tier::Store].map(|t| get(&s.lookups[t as usize][1])),
            get(&s.store_reads),
            s.store_read_latency.total_seconds(),
        )
    };
    let (lookups0, reads0, read_s0) = counters();
    let started = Instant::now();
    for _ in 0..args.decode_tokens {
        step(&mut logits)?;
    }
    let decode_s = started.elapsed().as_secs_f64();
    tiers.flush();
    let (lookups1, reads1, read_s1) = counters();

    let n = args.decode_tokens as f64;
    let record = tiers.record_bytes() as f64;
    let lookups: Vec<f64> = (0..3).map(|i| (lookups1[i] - lookups0[i]) as f64).collect();
    let store_bytes = (reads1 - reads0) as f64 * record;
    let store_read_s = read_s1 - read_s0;
    // Bytes a token needs: the non-expert weights once, each picked expert once from memory
    // (wherever it resides, it is computed from CPU memory here), plus what the store supplied
    // at the disk's rate.
    let moe_layers = moe.iter().filter(|&&m| m).count() as f64;
    let dense =
        (model.weight_bytes() - model.routed_expert_bytes() - model.embedding_bytes()) as f64;
    let expert_bytes = moe_layers * cfg.num_experts_per_tok as f64 * record;
    let (memory_s, store_s) = ((dense + expert_bytes) / mem_bw, store_bytes / n / disk);
    let need_s = memory_s + store_s;
    let per_token_s = decode_s / n;
    let history = tiers.history("bench");
    let top_decile: f64 = history
        .counts
        .iter()
        .filter(|row| row.iter().any(|&c| c > 0))
        .map(|row| {
            let mut sorted = row.clone();
            sorted.sort_unstable_by(|a, b| b.cmp(a));
            let top: u64 = sorted.iter().take(row.len().div_ceil(10)).sum();
            top as f64 / sorted.iter().sum::<u64>().max(1) as f64
        })
        .sum::<f64>()
        / moe_layers;
    Ok(serde_json::json!({
        "routing": routing,
        "policy": format!("{policy:?}").to_lowercase(),
        "hidden": cfg.hidden_size,
        "experts": cfg.n_routed_experts,
        "moe_layers": moe_layers,
        "top_k": cfg.num_experts_per_tok,
        "record_bytes": record,
        "vram_slots": args.tiers.vram_slots,
        "ram_slots": args.tiers.ram_slots,
        "top_decile_pick_share": top_decile,
        "prefill": {
            "tokens": args.prompt_tokens,
            "tok_s": args.prompt_tokens as f64 / prefill_s,
            "store_records": prefill_reads,
            "store_gb": prefill_reads as f64 * record / 1e9,
            "fetch_overlap": tiers.plan().fetch_overlap,
            "read_ahead": tiers.plan().prefetch,
            "read_ahead_used": ahead_used,
            "read_ahead_wasted": ahead_wasted,
            "ms": {
                "total": prefill_s * 1e3,
                "fetch_wait": prefill_parts[0] * 1e3,
                "fetch_busy": prefill_busy * 1e3,
                "resolve": prefill_parts[1] * 1e3,
                "write_back": prefill_parts[2] * 1e3,
                "experts": prefill_parts[3] * 1e3,
            },
        },
        "decode_tokens": args.decode_tokens,
        "decode_tok_s": n / decode_s,
        "hit_rate": super::common::hit_rates(&lookups),
        "bytes_per_token": {
            "vram": lookups[0] * record / n,
            "ram": lookups[1] * record / n,
            "nvme": store_bytes / n,
        },
        "store_read_gb_s": store_bytes / store_read_s.max(1e-9) / 1e9,
        "store_read_ms_per_record": store_read_s * 1e3 / (reads1 - reads0).max(1) as f64,
        "time_needed_ms_per_token": need_s * 1e3,
        "time_measured_ms_per_token": per_token_s * 1e3,
        "roofline_ratio": need_s / per_token_s,
        // The store's reads under the products: the slower of the two alone.
        "roofline_ratio_overlapped": memory_s.max(store_s) / per_token_s,
    }))
}
