//! `bench --flash --device cuda`: a random model at GLM-5.3-Flash width (the real MLA, KDA,
//! DSA and expert shapes; 1 dense layer and `--flash-moe-layers` MoE layers instead of 3 +
//! 42) with its experts in a packed store of `--flash-expert-format` records (q4_k, or
//! `exl3:RATE`: random trellises with their suh and svh, laid out as pack-store keeps an EXL3
//! checkpoint's experts), measured under the RTX 3090 box's budget: the VRAM and RAM expert
//! slots per layer of the memory plan for the real model (the shipped GLM-5.3-Flash config)
//! on that box with these records, `glmflash-node plan` with `--flash-plan`'s flags and
//! `--expert-format` naming them (q4_k, exl3:3), so each layer here gets the slots a layer of
//! the real model gets there.
//!
//! Runs (`--flash-runs`): `budget` (nvme mode, CPU lane on, uniform routing), `prefill`
//! (`--flash-prefill` tokens under the budget), `exact` (nvme-exact under the budget),
//! `vram` (every expert in VRAM: the ceiling), `fast` (every expert in RAM, decode picks on
//! the CPU lane), `zipf` (the budget with skewed routing). Decode runs with 1 and 4 streams,
//! on each decoder `--flash-decoders` names (`host`: `Model::forward`; `gpu`: `GpuDecoder`).
//! The CPU lane computes RAM residents in place in their own format (EXL3 from the trellis).
//!
//! Each result has hit rate and bytes per token per tier and a roofline ratio: the time the
//! bytes of one step need at the bandwidths measured in the same run (HBM copy, pinned H2D,
//! RAM read, store O_DIRECT at depth) over the measured step time, where the GPU's and the
//! CPU lane's reads overlap and H2D and store reads add:
//! `need = max(gpu bytes / HBM, cpu-lane bytes / RAM) + h2d bytes / H2D + store bytes / store`,
//! and beside it the bound of a step that overlaps all four (`roofline_ratio_overlapped`: the
//! slowest part's time over the step's). `moe_step_parts` has the GPU tier's sampled MoE
//! steps timed part by part (resident picks' kernels, CPU lane, staged picks), to set beside
//! the step's measured time.
//! Results print as JSON lines on stderr as they finish and as one JSON document at the end,
//! whose `expert_format` names the records measured.
//!
//! With `--keep` the model and store stay in `--scratch` for the next call: both are reused
//! when the config matches and the store holds records of the asked format; another format
//! rewrites only the store.

use super::args::{BenchArgs, plan_storage};
use super::common::{measure_read_bandwidth, set_router_bias, store_read_rate};
use super::figures::{Measured, figures, snapshot};
use crate::backend::cuda::Cuda;
use crate::model::checkpoint::DType;
use crate::model::config::Config;
use crate::model::decoder::GpuDecoder;
use crate::model::glm5::Step;
use crate::model::moe::ExpertProvider;
use crate::model::{Gpu, SeqCache};
use crate::model::{Model, random};
use crate::store::{ChecksumPolicy, Manifest, PartFormat};
use crate::tiers::plan::TierPlan;
use crate::tiers::provider::{Mode, TieredExperts};
use crate::tiers::source::StoreSource;
use anyhow::{Context, bail};
use serde_json::{Value, json};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

pub fn run(args: &BenchArgs) -> anyhow::Result<()> {
    let cuda = match args.device.open()? {
        crate::backend::Device::Cuda(cuda) => cuda,
        crate::backend::Device::Cpu => {
            bail!("bench --flash measures the GPU path: add --device cuda")
        }
    };
    let root = args.tiers.scratch.join("glmflash-bench-flash");
    let result = prepare_and_measure(&root, &cuda, args);
    if !args.flash.keep {
        let _ = std::fs::remove_dir_all(&root);
    }
    println!("{}", serde_json::to_string_pretty(&result?)?);
    Ok(())
}

fn prepare_and_measure(root: &Path, cuda: &Arc<Cuda>, args: &BenchArgs) -> anyhow::Result<Value> {
    let flash = &args.flash;
    let config = random::flash_config(1, flash.flash_moe_layers);
    prepare(root, &config, flash.flash_expert_format)?;
    let (model_dir, store) = (root.join("model"), root.join("store"));
    // Uniform routing unless a run says otherwise (a kept store may come from a zipf run).
    set_skew(&model_dir, &store, 0.0)?;
    measure_all(&model_dir, &store, cuda, args)
}

/// What [`prepare`] found in the scratch root.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Prepared {
    /// The model and store of an earlier `--keep` call, as asked.
    Kept,
    /// The model kept, its store of another record format replaced.
    NewStore,
    Written,
}

/// The random model of `config` in `root/model` and its store of `format` records in
/// `root/store`: kept from an earlier `--keep` call when the config matches and the store
/// holds records of `format`; a store of another format is replaced, keeping the model.
fn prepare(root: &Path, config: &Value, format: PartFormat) -> anyhow::Result<Prepared> {
    let (model_dir, store) = (root.join("model"), root.join("store"));
    let model_kept = std::fs::read(model_dir.join("config.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
        .is_some_and(|c| c == *config);
    let store_kept = model_kept
        && Manifest::load(&store).is_ok_and(|m| {
            m.layer_parts.is_empty() && m.parts.all().iter().all(|p| p.format == format)
        });
    if store_kept {
        eprintln!("reusing {}", root.display());
        return Ok(Prepared::Kept);
    }
    if model_kept {
        eprintln!(
            "reusing the model in {}; writing a store of {} records",
            root.display(),
            format.describe()
        );
        let _ = std::fs::remove_dir_all(&store);
    } else {
        let _ = std::fs::remove_dir_all(root);
        let started = Instant::now();
        random::write_random_dense_checkpoint(&model_dir, config, 1, DType::Bf16)?;
        eprintln!(
            "dense checkpoint written in {:.1}s",
            started.elapsed().as_secs_f64()
        );
    }
    let started = Instant::now();
    let step = std::sync::atomic::AtomicUsize::new(0);
    let m = crate::store::write_random_store(&model_dir, &store, format, 7, &|n, total| {
        let pct = n * 20 / total;
        if step.fetch_max(pct, Ordering::Relaxed) < pct {
            eprintln!("store: {n}/{total} records");
        }
    })?;
    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "store: {} records of {}, {:.1} GB in {secs:.1}s ({:.2} GB/s)",
        m.records.len(),
        format.describe(),
        m.data_bytes() as f64 / 1e9,
        m.data_bytes() as f64 / 1e9 / secs
    );
    Ok(match model_kept {
        true => Prepared::NewStore,
        false => Prepared::Written,
    })
}

fn set_skew(model_dir: &Path, store: &Path, skew: f32) -> anyhow::Result<()> {
    let cfg = Config::from_file(&model_dir.join("config.json"))?;
    set_router_bias(
        &model_dir.join("model.safetensors"),
        cfg.n_routed_experts,
        skew,
    )?;
    crate::store::rebind_random_store(model_dir, store)?;
    Ok(())
}

/// The rates a flash run measures, bytes a second.
pub(super) struct Bandwidths {
    pub(super) hbm: f64,
    pub(super) h2d_pinned: f64,
    pub(super) h2d_pageable: f64,
    pub(super) ram: f64,
    pub(super) store_raw: f64,
    pub(super) store_checked: f64,
}

impl Bandwidths {
    fn json(&self) -> Value {
        json!({
            "hbm_gb_s": self.hbm / 1e9,
            "h2d_pinned_gb_s": self.h2d_pinned / 1e9,
            "h2d_pageable_gb_s": self.h2d_pageable / 1e9,
            "ram_read_gb_s": self.ram / 1e9,
            "store_o_direct_gb_s": self.store_raw / 1e9,
            "store_o_direct_checked_gb_s": self.store_checked / 1e9,
        })
    }
}

fn measure_bandwidths(cuda: &Cuda, store: &Path, cfg: &Config) -> anyhow::Result<Bandwidths> {
    // Store: 64 records per layer spread over the file, read in one batch (io_uring at depth)
    // without and with the check every product read makes (the records' CRC-32C).
    let layers = crate::store::manifest::moe_layers(cfg);
    let keys: Vec<(usize, usize)> = layers
        .iter()
        .flat_map(|&l| (0..64).map(move |i| (l, (i * 37 + l) % cfg.n_routed_experts)))
        .collect();
    Ok(Bandwidths {
        hbm: cuda.copy_bandwidth(1 << 30)?,
        h2d_pinned: cuda.h2d_bandwidth(256 << 20, true)?,
        h2d_pageable: cuda.h2d_bandwidth(256 << 20, false)?,
        ram: measure_read_bandwidth(),
        store_raw: store_read_rate(store, &keys, ChecksumPolicy::Never)?,
        store_checked: store_read_rate(store, &keys, ChecksumPolicy::Always)?,
    })
}

/// The slots per layer the 3090 box's budget gives, and how they were derived.
struct Budget {
    vram_slots: usize,
    ram_slots: usize,
    json: Value,
}

/// The memory plan of the real model on the box `flash_plan` describes (flags of
/// `glmflash-node plan`, the shipped GLM-5.3-Flash config unless they name another) with its
/// experts in `record`-byte records of `format`: the plan command's own defaults and
/// arithmetic, its VRAM slots laid out as the VRAM tier lays out such a record.
fn budget_plan(
    flash_plan: &str,
    format: PartFormat,
    record: usize,
) -> anyhow::Result<crate::plan::MemoryPlan> {
    use clap::{Args, FromArgMatches};
    let expert_format = plan_storage(format).name();
    let argv = ["plan"]
        .into_iter()
        .chain(flash_plan.split_whitespace())
        .chain(["--expert-format", expert_format.as_str()]);
    let matches = crate::plan::args::PlanArgs::augment_args(clap::Command::new("plan"))
        .try_get_matches_from(argv)
        .context("--flash-plan")?;
    let mut inputs = crate::plan::args::PlanArgs::from_arg_matches(&matches)?.inputs()?;
    inputs.record_bytes = Some(record as u64);
    Ok(crate::plan::plan(&inputs)?)
}

fn budget(
    args: &BenchArgs,
    format: PartFormat,
    experts: usize,
    record: usize,
) -> anyhow::Result<Budget> {
    let f = &args.flash;
    let flags = if args.tiers.vram_host_copies {
        format!("{} --vram-host-copies", f.flash_plan)
    } else {
        f.flash_plan.clone()
    };
    let plan = budget_plan(&flags, format, record)?;
    let (vram_slots, ram_slots) = (
        plan.vram_expert_slots_per_layer,
        plan.ram_expert_slots_per_layer,
    );
    let json = json!({
        "plan": format!(
            "glmflash-node plan {} --expert-format {}",
            f.flash_plan,
            plan_storage(format)
        ),
        "record_bytes": record,
        "vram_slot_bytes": plan.vram_slot_bytes,
        "plan_formats": [plan.dense_format, plan.head_format],
        "plan_vram_expert_bytes": plan.vram_expert_bytes,
        "plan_ram_budget_bytes": plan.ram_budget_bytes,
        "plan_ram_held_bytes": plan.ram_held_bytes,
        "budget_layers": plan.moe_layers,
        "vram_slots_per_layer": vram_slots,
        "ram_slots_per_layer": ram_slots,
        "store_share": 1.0 - (vram_slots + ram_slots) as f64 / experts as f64,
    });
    Ok(Budget {
        vram_slots,
        ram_slots,
        json,
    })
}

fn measure_all(
    model_dir: &Path,
    store: &Path,
    cuda: &Arc<Cuda>,
    args: &BenchArgs,
) -> anyhow::Result<Value> {
    let runs: Vec<&str> = args.flash.flash_runs.split(',').map(str::trim).collect();
    let switches = Switches {
        pin: !args.flash.flash_no_pin,
        fetch_overlap: !args.tiers.no_fetch_overlap,
        prefetch: !args.tiers.no_prefetch,
        copy_down: !args.tiers.vram_host_copies,
    };
    for r in &runs {
        if !["budget", "prefill", "exact", "vram", "fast", "zipf"].contains(r) {
            bail!("--flash-runs: unknown run {r:?} (budget, prefill, exact, vram, fast, zipf)");
        }
    }
    let cfg = Config::from_file(&model_dir.join("config.json"))?;
    let format = Manifest::load(store)?.parts.gate.format;
    let bw = measure_bandwidths(cuda, store, &cfg)?;
    eprintln!("{}", bw.json());
    let source = Arc::new(StoreSource::open(store, model_dir, &cfg)?);
    let record = crate::tiers::source::ExpertSource::record_bytes(source.as_ref());
    let started = Instant::now();
    let dense_on_gpu = |experts: Arc<dyn ExpertProvider>| {
        crate::tiers::vram::load_dense_on_gpu(
            model_dir,
            experts,
            cuda.clone(),
            args.tiers.vram_host_copies,
        )
    };
    let mut model = dense_on_gpu(Arc::new(tiered(
        &cfg,
        &source,
        Mode::Nvme,
        1,
        1,
        switches,
        None,
    )?))?;
    eprintln!(
        "dense model on the GPU in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    let budget = budget(args, format, cfg.n_routed_experts, record)?;
    eprintln!("{}", budget.json);
    let mut results = Vec::new();
    let mut report = |r: Value| {
        eprintln!("{r}");
        results.push(r);
    };

    for run in ["budget", "prefill", "exact"] {
        if !runs.contains(&run) {
            continue;
        }
        let mode = if run == "exact" {
            Mode::NvmeExact
        } else {
            Mode::Nvme
        };
        // Fresh (cold) tiers for each decoder, so that neither inherits the other's
        // residents.
        for name in decoders(args)? {
            let tiers = Arc::new(tiered(
                &cfg,
                &source,
                mode,
                budget.vram_slots,
                budget.ram_slots,
                switches,
                Some(cuda),
            )?);
            model.set_experts(tiers.clone());
            let gpu = gpu_decoder(name, cuda, &model)?;
            if run == "prefill" {
                let mut r = prefill(&model, Some(&tiers), gpu.as_ref(), args, &bw, record)?;
                r["decoder"] = json!(name);
                report(r.tag(run));
            } else {
                for streams in [1, 4] {
                    let mut r = decode(
                        &model,
                        Some(&tiers),
                        gpu.as_ref(),
                        streams,
                        args,
                        &bw,
                        record,
                    )?;
                    r["decoder"] = json!(name);
                    report(r.tag(run));
                }
            }
        }
    }
    if runs.contains(&"vram") {
        let started = Instant::now();
        let vram = Arc::new(crate::tiers::vram::VramExperts::load_all(
            cuda.clone(),
            source.as_ref(),
            &cfg.moe_layers(),
            cfg.n_routed_experts,
        )?);
        eprintln!(
            "every expert in VRAM in {:.1}s",
            started.elapsed().as_secs_f64()
        );
        model.set_experts(vram);
        for r in decodes(&model, None, cuda, args, &bw, record)? {
            report(r.tag("vram"));
        }
    }
    if runs.contains(&"fast") {
        let started = Instant::now();
        let tiers = Arc::new(tiered(
            &cfg,
            &source,
            Mode::Fast,
            0,
            0,
            switches,
            Some(cuda),
        )?);
        eprintln!(
            "every expert in RAM in {:.1}s",
            started.elapsed().as_secs_f64()
        );
        model.set_experts(tiers.clone());
        for r in decodes(&model, Some(&tiers), cuda, args, &bw, record)? {
            report(r.tag("fast"));
        }
    }
    if runs.contains(&"zipf") {
        drop(model);
        set_skew(model_dir, store, args.tiers.zipf_bias)?;
        let source = Arc::new(StoreSource::open(store, model_dir, &cfg)?);
        let fresh = || -> anyhow::Result<Arc<TieredExperts>> {
            Ok(Arc::new(tiered(
                &cfg,
                &source,
                Mode::Nvme,
                budget.vram_slots,
                budget.ram_slots,
                switches,
                Some(cuda),
            )?))
        };
        let mut model = dense_on_gpu(fresh()?)?;
        for name in decoders(args)? {
            let tiers = fresh()?;
            model.set_experts(tiers.clone());
            let gpu = gpu_decoder(name, cuda, &model)?;
            for streams in [1, 4] {
                let mut r = decode(
                    &model,
                    Some(&tiers),
                    gpu.as_ref(),
                    streams,
                    args,
                    &bw,
                    record,
                )?;
                r["decoder"] = json!(name);
                report(r.tag("zipf"));
            }
        }
    }
    Ok(json!({
        "device": cuda.describe(),
        "threads": rayon::current_num_threads(),
        "hidden": cfg.hidden_size,
        "layers": cfg.num_hidden_layers,
        "moe_layers": cfg.moe_layers().iter().filter(|&&m| m).count(),
        "experts": cfg.n_routed_experts,
        "top_k": cfg.num_experts_per_tok,
        "expert_format": plan_storage(format).name(),
        "bandwidths": bw.json(),
        "budget": budget.json,
        "switches": {
            "pin": switches.pin,
            "fetch_overlap": switches.fetch_overlap,
            "prefetch": switches.prefetch,
            "vram_copy_down": switches.copy_down,
        },
        "runs": results,
    }))
}

/// What `--flash-no-pin`, `--no-fetch-overlap`, `--no-prefetch` and `--vram-host-copies` turn
/// off.
#[derive(Clone, Copy)]
struct Switches {
    pin: bool,
    fetch_overlap: bool,
    prefetch: bool,
    copy_down: bool,
}

/// Cold tiers over `source` with these slots per MoE layer (LFU, prefetch on), their
/// device tier on `cuda` when given.
fn tiered(
    cfg: &Config,
    source: &Arc<StoreSource>,
    mode: Mode,
    vram_slots: usize,
    ram_slots: usize,
    switches: Switches,
    cuda: Option<&Arc<Cuda>>,
) -> anyhow::Result<TieredExperts> {
    let plan = TierPlan {
        pin: switches.pin,
        fetch_overlap: switches.fetch_overlap,
        prefetch: switches.prefetch && mode.tiered(),
        copy_down: switches.copy_down,
        ..TierPlan::new(mode, vram_slots, ram_slots, cfg.n_routed_experts)
    };
    TieredExperts::new(
        source.clone(),
        cfg.hidden_size,
        cfg.n_routed_experts,
        &cfg.moe_layers(),
        &plan,
        cuda.cloned(),
    )
}

trait Tagged {
    fn tag(self, run: &str) -> Value;
}

impl Tagged for Value {
    fn tag(mut self, run: &str) -> Value {
        self["run"] = json!(run);
        self
    }
}

fn prompt(len: usize, salt: u32, vocab: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(7919).wrapping_add(13 + salt * 104_729)) % vocab as u32)
        .collect()
}

/// The decoders `--flash-decoders` names.
fn decoders(args: &BenchArgs) -> anyhow::Result<Vec<&str>> {
    let names: Vec<&str> = args
        .flash
        .flash_decoders
        .split(',')
        .map(str::trim)
        .collect();
    if let Some(bad) = names.iter().find(|n| !["host", "gpu"].contains(n)) {
        bail!("--flash-decoders: unknown decoder {bad:?} (host, gpu)");
    }
    Ok(names)
}

/// The GPU decoder for `name` `gpu`, none for `host`.
fn gpu_decoder(name: &str, cuda: &Arc<Cuda>, model: &Model) -> anyhow::Result<Option<GpuDecoder>> {
    Ok(match name {
        "gpu" => Some(GpuDecoder::new(cuda, model).context("the GPU decoder")?),
        _ => None,
    })
}

/// Decode runs of 1 and 4 streams on each decoder `--flash-decoders` names.
fn decodes(
    model: &Model,
    tiers: Option<&Arc<TieredExperts>>,
    cuda: &Arc<Cuda>,
    args: &BenchArgs,
    bw: &Bandwidths,
    record: usize,
) -> anyhow::Result<Vec<Value>> {
    let mut out = Vec::new();
    for name in decoders(args)? {
        let gpu = gpu_decoder(name, cuda, model)?;
        for streams in [1, 4] {
            let mut r = decode(model, tiers, gpu.as_ref(), streams, args, bw, record)?;
            r["decoder"] = json!(name);
            out.push(r);
        }
    }
    Ok(out)
}

fn decode(
    model: &Model,
    tiers: Option<&Arc<TieredExperts>>,
    gpu: Option<&GpuDecoder>,
    streams: usize,
    args: &BenchArgs,
    bw: &Bandwidths,
    record: usize,
) -> anyhow::Result<Value> {
    let vocab = model.cfg.vocab_size;
    let mut seqs = Vec::with_capacity(streams);
    for s in 0..streams {
        let (logits, cache) = model.prefill(&prompt(args.prompt_tokens, s as u32, vocab))?;
        seqs.push((crate::backend::cpu::ops::argmax(&logits) as u32, cache));
    }
    let mut gpu_seqs = match gpu {
        Some(g) => seqs
            .iter()
            .map(|(t, cache)| Ok((*t, g.sequence(cache)?)))
            .collect::<anyhow::Result<Vec<_>>>()?,
        None => Vec::new(),
    };
    let mut step = || -> anyhow::Result<()> {
        if let Some(g) = gpu {
            let tokens: Vec<u32> = gpu_seqs.iter().map(|(t, _)| *t).collect();
            let mut seqs: Vec<&mut SeqCache<Gpu>> = gpu_seqs.iter_mut().map(|(_, s)| s).collect();
            let out = g.step_batch(model, &mut seqs, &tokens)?;
            for ((next, _), logits) in gpu_seqs.iter_mut().zip(&out) {
                *next = crate::backend::cpu::ops::argmax(logits) as u32;
            }
            return Ok(());
        }
        let tokens: Vec<[u32; 1]> = seqs.iter().map(|(t, _)| [*t]).collect();
        let mut steps: Vec<Step> = seqs
            .iter_mut()
            .zip(&tokens)
            .map(|((_, cache), t)| Step {
                tokens: t,
                cache,
                all_logits: false,
            })
            .collect();
        let out = model.forward(&mut steps, None)?;
        for ((next, _), logits) in seqs.iter_mut().zip(&out) {
            *next = crate::backend::cpu::ops::argmax(logits) as u32;
        }
        Ok(())
    };
    for _ in 0..args.tiers.warmup_tokens {
        step()?;
    }
    let before = snapshot(tiers, 1);
    gpu.map(GpuDecoder::take_profile);
    let started = Instant::now();
    for _ in 0..args.decode_tokens {
        step().context("decode step")?;
    }
    let secs = started.elapsed().as_secs_f64();
    let after = snapshot(tiers, 1);
    let run = Measured {
        before,
        after,
        steps: args.decode_tokens,
        tokens: args.decode_tokens * streams,
        secs,
    };
    let mut r = figures(model, run, tiers.is_none(), bw, record);
    r["streams"] = json!(streams);
    r["phase"] = json!("decode");
    add_profile(&mut r, gpu, args.decode_tokens);
    Ok(r)
}

fn prefill(
    model: &Model,
    tiers: Option<&Arc<TieredExperts>>,
    gpu: Option<&GpuDecoder>,
    args: &BenchArgs,
    bw: &Bandwidths,
    record: usize,
) -> anyhow::Result<Value> {
    let len = args.flash.flash_prefill;
    let p = prompt(len, 99, model.cfg.vocab_size);
    let before = snapshot(tiers, 0);
    gpu.map(GpuDecoder::take_profile);
    let started = Instant::now();
    let logits = match gpu {
        Some(g) => {
            let mut seq = g.sequence(&model.new_cache())?;
            g.forward(model, &mut [&mut seq], &[&p])?.remove(0)
        }
        None => model.prefill(&p)?.0,
    };
    let secs = started.elapsed().as_secs_f64();
    anyhow::ensure!(
        logits.iter().all(|v| v.is_finite()),
        "prefill logits are not finite"
    );
    let after = snapshot(tiers, 0);
    let run = Measured {
        before,
        after,
        steps: 1,
        tokens: len,
        secs,
    };
    let mut r = figures(model, run, tiers.is_none(), bw, record);
    r["phase"] = json!("prefill");
    add_profile(&mut r, gpu, 1);
    Ok(r)
}

/// The GPU decoder's phase profile of the timed calls (`GLMFLASH_GPU_PROFILE`), in
/// milliseconds per call of the forward.
fn add_profile(r: &mut Value, gpu: Option<&GpuDecoder>, calls: usize) {
    let phases = gpu.map(GpuDecoder::take_profile).unwrap_or_default();
    if !phases.is_empty() {
        r["gpu_profile_ms"] = phases
            .iter()
            .map(|(name, secs, _)| (name.to_string(), json!(secs * 1e3 / calls.max(1) as f64)))
            .collect::<serde_json::Map<_, _>>()
            .into();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::Format;

    fn bench_args(extra: &[&str]) -> BenchArgs {
        use clap::Parser;
        let argv = ["glmflash-node", "bench", "--flash"].iter().chain(extra);
        let crate::cli::Command::Bench(args) = crate::cli::Cli::parse_from(argv).command else {
            unreachable!("bench parses to Command::Bench")
        };
        args
    }

    /// Bytes of one record of the random store at GLM-5.3-Flash width in `format`.
    fn flash_record(format: PartFormat) -> usize {
        let cfg = Config::from_json(&random::flash_config(1, 1)).unwrap();
        let parts = crate::store::random_record_parts(&cfg, format).unwrap();
        parts.length().div_ceil(crate::store::ALIGN) * crate::store::ALIGN
    }

    /// A kept scratch is reused only with records of the asked format: another format
    /// replaces the store (keeping the model), another config rewrites both.
    #[test]
    fn a_kept_scratch_is_reused_for_its_own_record_format_only() {
        let tmp = tempfile::Builder::new()
            .prefix("glmflash-flash-scratch")
            .tempdir_in(std::env::var("CARGO_TARGET_TMPDIR").unwrap_or("/var/tmp".into()))
            .unwrap();
        let root = tmp.path().join("glmflash-bench-flash");
        let config = random::scaled_config(64, 256, 2, 1, 3, 256, 2);
        let q4k = PartFormat::Rows(Format::Q4K);
        let exl3 = super::super::args::parse_record_format("exl3:3").unwrap();
        let format_of = || {
            Manifest::load(&root.join("store"))
                .unwrap()
                .parts
                .gate
                .format
        };
        let model_written = || {
            std::fs::metadata(root.join("model/model.safetensors"))
                .unwrap()
                .modified()
                .unwrap()
        };
        assert_eq!(prepare(&root, &config, q4k).unwrap(), Prepared::Written);
        assert_eq!(format_of(), q4k);
        let first = model_written();
        assert_eq!(prepare(&root, &config, q4k).unwrap(), Prepared::Kept);
        assert_eq!(prepare(&root, &config, exl3).unwrap(), Prepared::NewStore);
        assert_eq!(format_of(), exl3);
        assert_eq!(model_written(), first);
        assert_eq!(prepare(&root, &config, exl3).unwrap(), Prepared::Kept);
        let wider = random::scaled_config(64, 256, 2, 1, 4, 256, 2);
        assert_eq!(prepare(&root, &wider, exl3).unwrap(), Prepared::Written);
        assert_eq!(
            Manifest::load(&root.join("store")).unwrap().records.len(),
            4
        );
    }

    /// The default budget is `plan --ram-limit 55GiB --dense-format exl3:3.05 --expert-format
    /// q4_k` for GLM-5.3-Flash on the 3090 box: the seed's EXL3 non-expert weights, this
    /// bench's q4_k records (BENCHMARKS.md quotes these slots).
    #[test]
    fn the_default_budget_is_the_plan_of_the_real_model_on_the_3090_box() {
        let args = bench_args(&[]);
        let q4k = args.flash.flash_expert_format;
        assert_eq!(q4k, PartFormat::Rows(Format::Q4K));
        let record = flash_record(q4k);
        assert_eq!(record, 3 * 2048 * 16 * 144);
        let b = budget(&args, q4k, 288, record).unwrap();
        let plan = budget_plan(&args.flash.flash_plan, q4k, record).unwrap();
        println!("{}\n{}", b.json, plan.table());
        assert_eq!(
            (plan.vram_bytes, plan.ram_limit_bytes),
            (24_576 << 20, Some(55 << 30))
        );
        assert_eq!(
            (plan.context, plan.batch, plan.moe_layers),
            (131_072, 8, 42)
        );
        assert_eq!(plan.dense_format, "exl3:3.05");
        // 63 RAM slots a layer before a prompt chunk's store reads were planned (session 25),
        // 58 while the VRAM residents kept host copies (before session 26), 83 while the dense
        // weights did (before session 28).
        assert_eq!((b.vram_slots, b.ram_slots), (24, 89));
        assert_eq!(b.vram_slots, plan.vram_expert_slots_per_layer);
        assert!(
            b.json["plan"]
                .as_str()
                .unwrap()
                .ends_with("--expert-format q4_k")
        );
        // Another box moves it: a bigger cap, more RAM slots.
        let more = budget_plan("--ram-limit 64GiB --dense-format exl3:3.05", q4k, record).unwrap();
        assert!(more.ram_expert_slots_per_layer > b.ram_slots);
        assert!(budget_plan("--no-such-flag", q4k, record).is_err());
    }

    /// `--flash-expert-format exl3:3` plans the box with the real model's EXL3 experts:
    /// records of a 3-bit trellis with f16 suh and svh per weight (two thirds of q4_k's), VRAM
    /// slots as the VRAM tier lays them out (f32 scales), so every tier holds more experts.
    #[test]
    fn exl3_records_get_the_plan_of_exl3_experts_and_more_slots() {
        let args = bench_args(&["--flash-expert-format", "exl3:3"]);
        let exl3 = args.flash.flash_expert_format;
        let PartFormat::Exl3 { rate, codebook } = exl3 else {
            panic!("exl3:3 parses to EXL3 records, not {exl3:?}")
        };
        assert_eq!((rate.bits(), codebook.name()), (3.0, "mul1"));
        let record = flash_record(exl3);
        assert_eq!(record, 3 * (4096 * 2048 * 3 / 8 + 2 * (4096 + 2048)));
        let q4k = PartFormat::Rows(Format::Q4K);
        let b = budget(&args, exl3, 288, record).unwrap();
        let plan = budget_plan(&args.flash.flash_plan, exl3, record).unwrap();
        let q = budget(&args, q4k, 288, flash_record(q4k)).unwrap();
        println!("{}\n{}\n{}", b.json, q.json, plan.table());
        assert!(
            b.json["plan"]
                .as_str()
                .unwrap()
                .ends_with("--expert-format exl3:3")
        );
        // The VRAM slot is the VRAM tier's layout of these records (f32 scales).
        let form = crate::backend::cuda::Exl3Form { rate, codebook };
        let layout = crate::backend::cuda::MoeLayout::exl3(4096, 2048, form, form).unwrap();
        assert_eq!(plan.vram_slot_bytes, layout.slot_bytes as u64);
        assert!(plan.vram_slot_bytes >= record as u64);
        assert!(
            b.vram_slots > q.vram_slots,
            "{} vs {}",
            b.vram_slots,
            q.vram_slots
        );
        assert!(
            b.ram_slots > q.ram_slots,
            "{} vs {}",
            b.ram_slots,
            q.ram_slots
        );
        assert!(b.json["store_share"].as_f64() < q.json["store_share"].as_f64());
        // A record has one trellis rate: a checkpoint's average is refused, as is no format.
        for bad in ["exl3:3.05", "exl3:9", "q5"] {
            assert!(
                super::super::args::parse_record_format(bad).is_err(),
                "{bad}"
            );
        }
    }
}
