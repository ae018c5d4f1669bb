//! `bench` (no variant flag): prefill and decode speed of a random model of a given shape, with the
//! memory-bandwidth roofline measured in the same run.

use super::args::BenchArgs;
use super::common::measure_read_bandwidth;
use crate::model::Model;
use crate::model::checkpoint::DType;
use crate::model::config::MlpKind;
use crate::model::random::{scaled_config, write_random_checkpoint};
use crate::quant::Format;
use std::time::Instant;

pub fn run(args: &BenchArgs) -> anyhow::Result<()> {
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

fn measure(dir: &std::path::Path, args: &BenchArgs) -> anyhow::Result<serde_json::Value> {
    let device = args.device.open()?;
    let model = match &device {
        crate::backend::Device::Cpu => Model::load(dir)?,
        crate::backend::Device::Cuda(cuda) => {
            crate::tiers::vram::load_model_on_gpu(dir, cuda.clone())?.0
        }
    };
    let cfg = &model.cfg;
    let vocab = cfg.vocab_size as u32;
    let prompt: Vec<u32> = (0..args.prompt_tokens as u32)
        .map(|i| (i * 7919 + 13) % vocab)
        .collect();

    let started = Instant::now();
    let (mut logits, mut cache) = model.prefill(&prompt)?;
    let prefill_s = started.elapsed().as_secs_f64();

    let started = Instant::now();
    for _ in 0..args.decode_tokens {
        let next = crate::backend::cpu::ops::argmax(&logits) as u32;
        logits = model.decode_step(next, &mut cache)?;
    }
    let decode_s = started.elapsed().as_secs_f64();

    let weights = model_bytes(&model);
    let moe_layers = cfg.mlp_kinds.iter().filter(|k| **k == MlpKind::Moe).count();
    let expert_bytes = weights.routed / (moe_layers * cfg.n_routed_experts).max(1);
    // Decode reads every non-expert weight once and k experts per MoE layer (the head once).
    let bytes_per_token = weights.total - weights.routed - weights.embed
        + moe_layers * cfg.num_experts_per_tok * expert_bytes;
    // The memory the weights stream from: host RAM, or the GPU's (every weight is there).
    let (bandwidth, device_name) = match &device {
        crate::backend::Device::Cpu => (measure_read_bandwidth(), "cpu".to_string()),
        crate::backend::Device::Cuda(cuda) => (cuda.copy_bandwidth(1 << 30)?, cuda.describe()),
    };
    let decode_tok_s = args.decode_tokens as f64 / decode_s;
    let roofline_tok_s = bandwidth / bytes_per_token as f64;
    Ok(serde_json::json!({
        "model": dir.display().to_string(),
        "hidden": cfg.hidden_size,
        "layers": cfg.num_hidden_layers,
        "experts": cfg.n_routed_experts,
        "expert_width": cfg.moe_intermediate_size,
        "top_k": cfg.num_experts_per_tok,
        "expert_format": args.expert_format,
        "threads": rayon::current_num_threads(),
        "device": device_name,
        "weight_bytes": weights.total,
        "prefill_tokens": args.prompt_tokens,
        "prefill_tok_s": args.prompt_tokens as f64 / prefill_s,
        "decode_tokens": args.decode_tokens,
        "decode_tok_s": decode_tok_s,
        "decode_bytes_per_token": bytes_per_token,
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "decode_roofline_tok_s": roofline_tok_s,
        "decode_roofline_ratio": decode_tok_s / roofline_tok_s,
    }))
}

struct WeightBytes {
    total: usize,
    routed: usize,
    embed: usize,
}

fn model_bytes(model: &Model) -> WeightBytes {
    let routed = model.routed_expert_bytes();
    WeightBytes {
        total: model.weight_bytes(),
        routed,
        embed: model.embedding_bytes(),
    }
}
