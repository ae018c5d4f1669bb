//! Checks of the whole GPU forward against the CPU model: decode steps, prompt chunks,
//! batches, and the caches they leave.

use super::*;

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
pub(super) fn check_decode(
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
        let model = Model::builder().placer(&placer).load(&demo)?;
        decode_cases(cuda, &model, "demo bf16 placed", rng, cases)?;

        // Every routed expert in VRAM: the decoder hands the provider its device rows
        // (`DeviceExperts`), the CPU reference goes through the same provider's host path.
        let (model, _) = crate::tiers::vram::load_model_on_gpu(&demo, cuda.clone(), false)?;
        decode_cases(cuda, &model, "demo experts in VRAM", rng, cases)
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

pub(super) fn decode_cases(
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
    let decoder = GpuDecoder::with_side_stream(cuda, model, false)?;
    let mut seq = decoder.sequence(&cpu_cache)?;
    // The same steps with the shared experts on a second stream: the same bits.
    let beside = GpuDecoder::with_side_stream(cuda, model, true)?;
    let mut beside_seq = beside.sequence(&cpu_cache)?;
    let mut next = ops::argmax(&logits) as u32;
    for step in 0..DECODE_STEPS {
        let want = model.decode_step(next, &mut cpu_cache)?;
        let got = decoder.step(model, &mut seq, next)?;
        let label = format!("decode {name} step {step}");
        cases.push(case(format!("{label} logits"), &got, &want, DECODE_BOUND));
        let side = beside.step(model, &mut beside_seq, next)?;
        let same = side
            .iter()
            .map(|v| v.to_bits())
            .eq(got.iter().map(|v| v.to_bits()));
        cases.push(exact_case(format!("{label} side stream: same bits"), same));
        let (g, w) = (ops::argmax(&got), ops::argmax(&want));
        cases.push(exact_case(format!("{label} greedy token"), g == w));
        next = w as u32;
    }
    let gpu_cache = decoder.to_host(&seq)?;
    compare_caches(&format!("decode {name}"), &gpu_cache, &cpu_cache, cases);
    decode_batch_cases(model, &decoder, name, rng, cases)?;
    prefill_cases(model, &decoder, name, rng, cases)?;
    // Batches and prompt chunks with the second stream (cuBLAS on it too), against the CPU.
    let name = format!("{name}, side stream");
    decode_batch_cases(model, &beside, &name, rng, cases)?;
    prefill_cases(model, &beside, &name, rng, cases)
}

/// `GpuDecoder::forward` over prompt chunks: a fresh sequence's prompt in three uneven
/// chunks, the last growing the device caches (logits after each against the CPU's forward
/// over the same chunks, and the caches after them), then one call holding a third sequence's whole prompt and a decode token of the
/// first, against the CPU doing each alone.
pub(super) fn prefill_cases(
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
    let chunks = [&prompt[..13], &prompt[13..200], &prompt[200..]];
    let mut first_run = Vec::with_capacity(chunks.len());
    for (c, chunk) in chunks.into_iter().enumerate() {
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
        first_run.push(got);
    }
    let host = decoder.to_host(&gpu)?;
    compare_caches(&format!("prefill {name}"), &host, &cpu, cases);

    // The same chunks again on a fresh sequence: the same bits, logits and caches (a race
    // between launches, or a buffer read before it is written, shows here in one run).
    let mut again = decoder.sequence(&model.new_cache())?;
    let mut same = true;
    for (chunk, first) in chunks.into_iter().zip(&first_run) {
        let got = decoder
            .forward(model, &mut [&mut again], &[chunk])?
            .remove(0);
        same &= got
            .iter()
            .map(|v| v.to_bits())
            .eq(first.iter().map(|v| v.to_bits()));
    }
    cases.push(exact_case(
        format!("prefill {name} again: same logits bits"),
        same,
    ));
    cases.push(exact_case(
        format!("prefill {name} again: same caches"),
        decoder.to_host(&again)? == host,
    ));

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
pub(super) fn compare_caches(what: &str, gpu: &SeqCache, cpu: &SeqCache, cases: &mut Vec<Case>) {
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
                    &g.latents.to_f32(),
                    &w.latents.to_f32(),
                    DECODE_BOUND,
                ));
                match (&g.indexer, &w.indexer) {
                    (Some(g), Some(w)) => cases.push(case(
                        format!("{label} indexer pool keys"),
                        &g.pool_keys.to_f32(),
                        &w.pool_keys.to_f32(),
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
pub(super) fn decode_batch_cases(
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
        let mut seqs: Vec<&mut SeqCache<Gpu>> = gpu.iter_mut().collect();
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
