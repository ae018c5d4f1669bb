//! `--cache-dtype`: the CPU logits with the MLA latents and DSA indexer keys cached in bf16
//! or f16 against the f32 cache, on the demo model and the committed fixtures (tiny
//! transformers checkpoints and EXL3 ones). Measured: the relative L2 change of the logits
//! of the prompt's last position and of each greedy step (the compact run fed the f32 run's
//! tokens), and whether the compact run's own greedy tokens stay the f32 run's. The bounds
//! sit just above what was measured (BENCHMARKS.md, "cache dtype").

use glmflash_node::model::Model;
use glmflash_node::model::device::CacheDtype;
use std::path::{Path, PathBuf};

#[path = "support/errors.rs"]
mod errors;
use errors::rel_l2;

/// (model, greedy steps, bound on the bf16 cache's rel L2 change, on the f16 cache's, whether
/// bf16's greedy tokens stay f32's, f16's).
const MEASURED: [(&str, usize, f64, f64, bool, bool); 10] = [
    ("demo", 16, 5e-2, 5e-5, true, true),
    ("tiny_mixed", 32, 3e-3, 9e-2, true, false),
    ("tiny_nested", 32, 2.2e-3, 2.6e-4, true, true),
    ("tiny_bf16", 32, 1.8e-3, 2.6e-4, true, true),
    ("tiny_fused", 32, 1.2e-3, 2.1e-4, true, true),
    ("exl3/exl3_3inst_4bpw", 16, 1.6e-3, 1.9e-4, true, true),
    ("exl3/exl3_mcg_2bpw", 16, 1.6e-3, 1.9e-4, true, true),
    ("exl3/exl3_mul1_2p5bpw", 16, 4e-2, 6.2e-2, false, false),
    ("exl3/exl3_mul1_3bpw", 16, 1.5e-3, 2e-4, true, true),
    ("exl3/exl3_mul1_6bpw", 16, 1.6e-3, 2e-4, true, true),
];

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../e2e/fixtures")
}

/// The prompt of a fixture's reference run; the demo model gets 400 tokens, past its DSA
/// top-k (256), so the indexer's selection drops tokens.
fn prompt(dir: &Path, name: &str) -> Vec<u32> {
    if name == "demo" {
        return (0..400u32).map(|i| 10 + (i * 7919) % 480).collect();
    }
    let text = std::fs::read_to_string(dir.join("reference.json")).expect("reference.json");
    let r: serde_json::Value = serde_json::from_str(&text).expect("reference.json parses");
    r["prompt"]
        .as_array()
        .expect("a prompt")
        .iter()
        .map(|t| t.as_u64().expect("a token id") as u32)
        .collect()
}

/// The logits of `prompt`'s last position, then of each of `tokens` but the last fed in
/// turn through the cache.
fn forced(model: &Model, prompt: &[u32], tokens: &[u32]) -> Vec<f32> {
    let (mut logits, mut cache) = model.prefill(prompt).unwrap();
    let mut all = logits.clone();
    for &t in &tokens[..tokens.len() - 1] {
        logits = model.decode_step(t, &mut cache).unwrap();
        all.extend_from_slice(&logits);
    }
    all
}

/// (rel L2 change of the logits, own greedy tokens equal f32's) for each compact dtype.
fn measure(model: &mut Model, prompt: &[u32], steps: usize) -> [(f64, bool); 2] {
    model.options.cache = CacheDtype::F32;
    let (tokens, logits) = model.greedy(prompt, steps).unwrap();
    let want = logits.concat();
    assert_eq!(
        forced(model, prompt, &tokens),
        want,
        "the f32 cache repeats"
    );
    [CacheDtype::Bf16, CacheDtype::F16].map(|dtype| {
        model.options.cache = dtype;
        let got = forced(model, prompt, &tokens);
        let (own, _) = model.greedy(prompt, steps).unwrap();
        (rel_l2(&got, &want), own == tokens)
    })
}

#[test]
fn compact_caches_change_the_logits_by_what_was_measured() {
    let demo = tempfile::tempdir().unwrap();
    glmflash_node::demo::make_demo_model(demo.path(), glmflash_node::demo::DEFAULT_SEED).unwrap();
    let mut failures = Vec::new();
    for (name, steps, bf16_bound, f16_bound, bf16_same, f16_same) in MEASURED {
        let dir = match name {
            "demo" => demo.path().to_path_buf(),
            _ => fixtures().join(name),
        };
        let mut model = Model::load(&dir).unwrap_or_else(|e| panic!("{name}: {e:#}"));
        let [(bf16, bf16_kept), (f16, f16_kept)] = measure(&mut model, &prompt(&dir, name), steps);
        eprintln!(
            "{name:<24} bf16: rel L2 {bf16:.3e}, greedy kept {bf16_kept}; \
             f16: rel L2 {f16:.3e}, greedy kept {f16_kept}"
        );
        // A compact cache changes the logits (the latents really are rounded), by at most
        // the bound.
        let ok = bf16 > 0.0
            && f16 > 0.0
            && bf16 <= bf16_bound
            && f16 <= f16_bound
            && bf16_kept == bf16_same
            && f16_kept == f16_same;
        if !ok {
            failures.push(name);
        }
    }
    assert!(
        failures.is_empty(),
        "beyond what was measured: {failures:?}"
    );
}
