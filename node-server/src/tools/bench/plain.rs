//! `bench` (no variant flag): prefill and decode speed of a random model of a given shape, or of
//! `--model`, with the memory-bandwidth roofline measured in the same run. On `--device cuda` it
//! runs the path `serve` runs: the GPU decoder, activations and caches on the device, the
//! `--streams` sequences stepped as one batch, every routed expert in VRAM.

use super::args::BenchArgs;
use super::common::measure_read_bandwidth;
use crate::backend::cpu::ops::argmax;
use crate::model::checkpoint::DType;
use crate::model::config::MlpKind;
use crate::model::decoder::GpuDecoder;
use crate::model::random::{scaled_config, write_random_checkpoint};
use crate::model::{Model, SeqCache, Step};
use crate::quant::Format;
use serde_json::{Value, json};
use std::time::Instant;

pub fn run(args: &BenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        !args.streams.is_empty() && !args.streams.contains(&0),
        "--streams: batch sizes of at least 1"
    );
    let scratch = std::env::temp_dir().join(format!("glmflash-bench-{}", std::process::id()));
    let dir = match &args.model {
        Some(dir) => dir.clone(),
        None => {
            let config = scaled_config(
                args.vocab,
                args.hidden,
                args.layers,
                1,
                args.experts,
                args.expert_width,
                args.top_k,
            );
            let raw = scratch.join("bf16");
            write_random_checkpoint(&raw, &config, 1, DType::Bf16)?;
            let format = Format::from_name(&args.expert_format)?;
            if format == Format::Bf16 {
                raw
            } else {
                let converted = scratch.join(format.name());
                crate::model::convert::convert_experts(&raw, &converted, format, |_, _| {})?;
                converted
            }
        }
    };
    let result = measure(&dir, args);
    let _ = std::fs::remove_dir_all(&scratch);
    let report = result?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

/// A prompt of `len` tokens, different for each `salt`.
fn prompt(len: usize, salt: u32, vocab: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 7919 + 13 + salt * 104_729) % vocab)
        .collect()
}

/// What one decode run measured: seconds for `steps` steps of `streams` sequences, and the GPU
/// decoder's phase profile (milliseconds a step) when `GLMFLASH_GPU_PROFILE` is set.
struct DecodeRun {
    streams: usize,
    steps: usize,
    secs: f64,
    profile: Vec<(&'static str, f64, u64)>,
    /// Seconds of `secs` the host spent waiting in downloads (the logits'); the rest it spent
    /// queueing work. GPU decoder only.
    waited: Option<f64>,
}

/// One prompt's prefill: seconds, and the GPU decoder's phase profile (seconds, calls) when
/// `GLMFLASH_GPU_PROFILE` is set.
struct Prefill {
    secs: f64,
    profile: Vec<(&'static str, f64, u64)>,
}

/// The prefill of one prompt (on the GPU the second of two, warm), then each decode run.
fn time_gpu(
    model: &Model,
    g: &GpuDecoder,
    args: &BenchArgs,
) -> anyhow::Result<(Prefill, Vec<DecodeRun>)> {
    let vocab = model.cfg.vocab_size as u32;
    let p = prompt(args.prompt_tokens, 0, vocab);
    // The first prompt compiles kernels and grows scratch; the second, another sequence of
    // the same prompt, is the one timed (and profiled with `GLMFLASH_GPU_PROFILE`).
    let mut seq = g.sequence(&model.new_cache())?;
    g.forward(model, &mut [&mut seq], &[&p])?;
    drop(seq);
    g.take_profile();
    let mut seq = g.sequence(&model.new_cache())?;
    let started = Instant::now();
    g.forward(model, &mut [&mut seq], &[&p])?;
    let prefill = Prefill {
        secs: started.elapsed().as_secs_f64(),
        profile: g.take_profile(),
    };
    drop(seq);
    let mut runs = Vec::new();
    for &b in &args.streams {
        let mut seqs: Vec<(u32, SeqCache<crate::model::Gpu>)> = Vec::new();
        for s in 0..b {
            let mut seq = g.sequence(&model.new_cache())?;
            let logits = g.forward(
                model,
                &mut [&mut seq],
                &[&prompt(args.prompt_tokens, s as u32, vocab)],
            )?;
            seqs.push((argmax(&logits[0]) as u32, seq));
        }
        let mut step = || -> anyhow::Result<()> {
            let tokens: Vec<u32> = seqs.iter().map(|(t, _)| *t).collect();
            let mut caches: Vec<&mut SeqCache<crate::model::Gpu>> =
                seqs.iter_mut().map(|(_, s)| s).collect();
            let out = g.step_batch(model, &mut caches, &tokens)?;
            for ((next, _), logits) in seqs.iter_mut().zip(&out) {
                *next = argmax(logits) as u32;
            }
            Ok(())
        };
        // Two untimed steps: kernels compiled and scratch grown before the clock starts.
        step()?;
        step()?;
        g.take_profile();
        g.take_waited();
        let started = Instant::now();
        for _ in 0..args.decode_tokens {
            step()?;
        }
        runs.push(DecodeRun {
            streams: b,
            steps: args.decode_tokens,
            secs: started.elapsed().as_secs_f64(),
            profile: g.take_profile(),
            waited: Some(g.take_waited()),
        });
    }
    Ok((prefill, runs))
}

/// The same on the host: `Model::forward` over the batch.
fn time_host(model: &Model, args: &BenchArgs) -> anyhow::Result<(Prefill, Vec<DecodeRun>)> {
    let vocab = model.cfg.vocab_size as u32;
    let started = Instant::now();
    model.prefill(&prompt(args.prompt_tokens, 0, vocab))?;
    let prefill = Prefill {
        secs: started.elapsed().as_secs_f64(),
        profile: Vec::new(),
    };
    let mut runs = Vec::new();
    for &b in &args.streams {
        let mut seqs: Vec<(u32, SeqCache)> = Vec::new();
        for s in 0..b {
            let (logits, cache) = model.prefill(&prompt(args.prompt_tokens, s as u32, vocab))?;
            seqs.push((argmax(&logits) as u32, cache));
        }
        let started = Instant::now();
        for _ in 0..args.decode_tokens {
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
                *next = argmax(logits) as u32;
            }
        }
        runs.push(DecodeRun {
            streams: b,
            steps: args.decode_tokens,
            secs: started.elapsed().as_secs_f64(),
            profile: Vec::new(),
            waited: None,
        });
    }
    Ok((prefill, runs))
}

fn measure(dir: &std::path::Path, args: &BenchArgs) -> anyhow::Result<Value> {
    let device = args.device.open()?;
    let mut costs = None;
    let (model, decoder, (prefill, runs), bandwidth, device_name) = match &device {
        crate::backend::Device::Cpu => {
            let model = Model::load(dir)?;
            let timed = time_host(&model, args)?;
            (
                model,
                "host (Model::forward)",
                timed,
                measure_read_bandwidth(),
                "cpu".to_string(),
            )
        }
        crate::backend::Device::Cuda(cuda) => {
            let model = crate::tiers::vram::load_model_on_gpu(
                dir,
                cuda.clone(),
                args.tiers.vram_host_copies,
            )?
            .0;
            let g = GpuDecoder::new(cuda, &model)?;
            let timed = time_gpu(&model, &g, args)?;
            let bw = cuda.copy_bandwidth(1 << 30)?;
            if args.call_costs {
                costs = Some(cuda.call_costs(20_000)?);
            }
            drop(g);
            (
                model,
                "gpu (GpuDecoder, as serve)",
                timed,
                bw,
                cuda.describe(),
            )
        }
    };
    let cfg = &model.cfg;
    let weights = model.weight_bytes();
    let routed = model.routed_expert_bytes();
    let moe_layers = cfg.mlp_kinds.iter().filter(|k| **k == MlpKind::Moe).count();
    let expert_bytes = routed / (moe_layers * cfg.n_routed_experts).max(1);
    // A decode step reads every non-expert weight once (the embedding only a row a token) and
    // the experts its tokens pick: at most k a token per MoE layer, all of them at most.
    let dense = weights - routed - model.embedding_bytes();
    let step_bytes = |b: usize| {
        dense + moe_layers * (b * cfg.num_experts_per_tok).min(cfg.n_routed_experts) * expert_bytes
    };
    let decode: Vec<Value> = runs
        .iter()
        .map(|r| {
            let tok_s = (r.steps * r.streams) as f64 / r.secs;
            let bytes = step_bytes(r.streams);
            let roofline = bandwidth / bytes as f64 * r.streams as f64;
            let mut v = json!({
                "streams": r.streams,
                "steps": r.steps,
                "tok_s": tok_s,
                "ms_per_step": r.secs * 1e3 / r.steps as f64,
                "bytes_per_step": bytes,
                "roofline_tok_s": roofline,
                "roofline_ratio": tok_s / roofline,
            });
            if let Some(waited) = r.waited {
                // Host-bound when the host rarely waits: the GPU drains the queue as fast as
                // the host fills it.
                v["host_queue_ms_per_step"] = json!((r.secs - waited) * 1e3 / r.steps as f64);
                v["wait_ms_per_step"] = json!(waited * 1e3 / r.steps as f64);
            }
            if !r.profile.is_empty() {
                v["gpu_profile_ms_per_step"] = r
                    .profile
                    .iter()
                    .map(|(name, secs, _)| (name.to_string(), json!(secs * 1e3 / r.steps as f64)))
                    .collect::<serde_json::Map<_, _>>()
                    .into();
                v["gpu_profile_calls_per_step"] = r
                    .profile
                    .iter()
                    .map(|(name, _, n)| (name.to_string(), json!(*n as f64 / r.steps as f64)))
                    .collect::<serde_json::Map<_, _>>()
                    .into();
            }
            v
        })
        .collect();
    let mut report = json!({
        "model": dir.display().to_string(),
        "decoder": decoder,
        "hidden": cfg.hidden_size,
        "layers": cfg.num_hidden_layers,
        "moe_layers": moe_layers,
        "experts": cfg.n_routed_experts,
        "expert_width": cfg.moe_intermediate_size,
        "top_k": cfg.num_experts_per_tok,
        "expert_bytes": expert_bytes,
        "threads": rayon::current_num_threads(),
        "device": device_name,
        "weight_bytes": weights,
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "prefill_tokens": args.prompt_tokens,
        "prefill_tok_s": args.prompt_tokens as f64 / prefill.secs,
        "decode": decode,
    });
    if !prefill.profile.is_empty() {
        report["prefill_gpu_profile_ms"] = prefill
            .profile
            .iter()
            .map(|(name, secs, n)| (name.to_string(), json!([secs * 1e3, n])))
            .collect::<serde_json::Map<_, _>>()
            .into();
    }
    if let Some(c) = costs {
        // The host's side of a step: what each kind of CUDA call costs it on this machine.
        report["cuda_call_costs_us"] = serde_json::to_value(c)?;
    }
    if args.model.is_none() {
        report["expert_format"] = json!(args.expert_format);
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn args(extra: &[&str]) -> BenchArgs {
        let mut argv = vec![
            "glmflash-node",
            "bench",
            "--hidden",
            "128",
            "--layers",
            "2",
            "--experts",
            "8",
            "--top-k",
            "2",
            "--expert-width",
            "128",
            "--vocab",
            "256",
            "--prompt-tokens",
            "4",
            "--decode-tokens",
            "2",
        ];
        argv.extend_from_slice(extra);
        let crate::cli::Command::Bench(args) = crate::cli::Cli::parse_from(argv).command else {
            unreachable!("bench parses to Command::Bench")
        };
        args
    }

    /// `--tiered` and `--flash` build their own random model: with `--model` they are refused
    /// at parse time, naming both flags, instead of measuring something else than asked.
    #[test]
    fn variants_refuse_a_checkpoint() {
        for variant in ["--tiered", "--flash", "--sampling"] {
            let argv = ["glmflash-node", "bench", variant, "--model", "/tmp/ckpt"];
            let Err(err) = crate::cli::Cli::try_parse_from(argv) else {
                panic!("bench {variant} --model parsed");
            };
            assert_eq!(err.kind(), clap::error::ErrorKind::ArgumentConflict);
            let text = err.to_string();
            assert!(text.contains(variant) && text.contains("--model"), "{text}");
        }
        assert!(crate::cli::Cli::try_parse_from(["glmflash-node", "bench", "--tiered"]).is_ok());
        let both = ["glmflash-node", "bench", "--sampling", "--flash"];
        assert!(crate::cli::Cli::try_parse_from(both).is_err());
    }

    /// One decode run per batch size, each with its own step bytes: a batch reads more
    /// experts than one stream, never more than all of them.
    #[test]
    fn one_decode_run_per_batch_size() {
        let a = args(&["--streams", "1,3"]);
        let dir = tempfile::tempdir().unwrap();
        let config = scaled_config(
            a.vocab,
            a.hidden,
            a.layers,
            1,
            a.experts,
            a.expert_width,
            a.top_k,
        );
        write_random_checkpoint(dir.path(), &config, 1, DType::Bf16).unwrap();
        let r = measure(dir.path(), &a).unwrap();
        let runs = r["decode"].as_array().unwrap();
        assert_eq!(runs.len(), 2);
        assert_eq!(
            (runs[0]["streams"].as_u64(), runs[1]["streams"].as_u64()),
            (Some(1), Some(3))
        );
        let bytes = |i: usize| runs[i]["bytes_per_step"].as_u64().unwrap();
        assert!(bytes(1) > bytes(0));
        assert!(runs.iter().all(|v| v["tok_s"].as_f64().unwrap() > 0.0));
        assert_eq!(r["decoder"], "host (Model::forward)");
    }

    #[test]
    fn a_batch_of_no_streams_is_refused() {
        let err = run(&args(&["--streams", "0"])).unwrap_err();
        assert!(err.to_string().contains("--streams"), "{err}");
    }
}
