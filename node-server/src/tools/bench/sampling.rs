//! `bench --sampling`: what the engine's token draw costs a step, the batch's sequences drawn
//! in turn against drawn as the engine draws them ([`draw_each`]: in parallel).

use super::BenchArgs;
use crate::engine::sampling::{Sampler, SamplingParams, draw_each};
use rand::{Rng, SeedableRng};
use serde_json::json;
use std::time::Instant;

/// Steps timed per batch size and logits shape (the median is reported).
const STEPS: usize = 21;

pub fn run(args: &BenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.vocab > 0, "--vocab must be at least 1");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    // Flat: every token within a few nats of the others (a draw walks most of the vocabulary);
    // peaked: a model's usual spread, most mass on a few hundred tokens.
    let shapes = [("flat", 1.0f32), ("peaked", 12.0)];
    let mut rows = Vec::new();
    for &streams in &args.streams {
        anyhow::ensure!(streams > 0, "--streams sizes must be at least 1");
        for (shape, spread) in shapes {
            let logits: Vec<Vec<f32>> = (0..streams)
                .map(|_| {
                    (0..args.vocab)
                        .map(|_| spread * rng.random_range(-1.0f32..1.0).powi(3))
                        .collect()
                })
                .collect();
            let new_samplers = || -> Vec<Sampler> {
                (0..streams)
                    .map(|s| {
                        Sampler::with_params(SamplingParams {
                            seed: s as u64,
                            ..SamplingParams::default()
                        })
                    })
                    .collect()
            };
            let (mut turn, mut together) = (new_samplers(), new_samplers());
            let (mut t_turn, mut t_together) = (Vec::new(), Vec::new());
            for _ in 0..STEPS {
                let started = Instant::now();
                let a: Vec<u32> = turn
                    .iter_mut()
                    .zip(&logits)
                    .map(|(s, l)| s.sample_full(l).token)
                    .collect();
                t_turn.push(started.elapsed().as_secs_f64());
                let started = Instant::now();
                let jobs: Vec<_> = together.iter_mut().zip(&logits).collect();
                let b = draw_each(jobs, |(s, l)| s.sample_full(l).token);
                t_together.push(started.elapsed().as_secs_f64());
                anyhow::ensure!(a == b, "the parallel draw gave other tokens: {a:?} {b:?}");
            }
            let (turn_ms, together_ms) = (median(&mut t_turn) * 1e3, median(&mut t_together) * 1e3);
            rows.push(json!({
                "streams": streams,
                "logits": shape,
                "in_turn_ms_per_step": turn_ms,
                "parallel_ms_per_step": together_ms,
                "speedup": turn_ms / together_ms,
            }));
        }
    }
    let report = json!({
        "bench": "sampling",
        "vocab": args.vocab,
        "threads": rayon::current_num_threads(),
        "temperature": 1.0,
        "runs": rows,
    });
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
