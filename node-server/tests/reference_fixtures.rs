//! The engine against transformers' glm5_next on tiny random checkpoints
//! (`e2e/make_fixtures.py`). `GLMFLASH_FIXTURES` points at a freshly generated set (CI makes
//! one with a random seed); otherwise the committed `e2e/fixtures` are used.

use glmflash_node::model::kda::KdaMode;
use glmflash_node::model::mla::MlaPath;
use glmflash_node::model::{ForwardOptions, Model, Step};
use serde::Deserialize;
use std::path::PathBuf;

#[path = "support/errors.rs"]
mod errors;
use errors::rel_max;

const FIXTURES: [&str; 4] = ["tiny_mixed", "tiny_nested", "tiny_bf16", "tiny_fused"];
/// Max |ours - ref| / max |ref| allowed against the reference.
const REF_TOLERANCE: f32 = 1e-4;
/// Between two forms of our own computation that do the same arithmetic in another order
/// (batched vs alone, ...).
const SELF_TOLERANCE: f32 = 1e-5;
/// Between two forms of KDA's delta rule over the same tokens: the recurrent form (a cached
/// decode, `KdaMode::Recurrent`) or the chunked form with its chunks starting elsewhere (a
/// chunked prefill's second part starts a chunk at its first token, from the carried state),
/// against the one-pass chunked form. Each is a few 1e-6 from transformers on most rows, but
/// a row whose KDA output nearly cancels (rms 1e-3 where the others are 1e-2, before the
/// gated RMSNorm scales it up) carries its f32 rounding 10-30x higher. CI's seed 931532970
/// (tiny_mixed, cached vs recomputed): 1.19e-5, each within 2.9e-6 / 5.9e-6 of transformers.
/// Seed 19 (tiny_bf16, chunked vs one pass): 1.92e-5, all of it in the last row of
/// layer 3's KDA; with that layer's delta rule in f64 the two forms agree to 1.9e-6 and both
/// sit 1.1e-5 from transformers' f32 (so the exact value is as far from the reference as our
/// f32 forms are from each other). Over 286 random seeds x 4 fixtures the largest were
/// 1.50e-5 (chunked), 1.43e-5 (recurrent+absorbed) and 1.28e-5 (cached); the former bound
/// of 1e-5 on the first two failed 3 of those seeds. A wrong handoff is far above: the
/// carried state's term missing the first token's decay gave 0.86 (seed 19, tiny_mixed).
const FORMS_TOLERANCE: f32 = 5e-5;

#[derive(Deserialize)]
struct Reference {
    prompt: Vec<u32>,
    prefill_logits: Vec<Vec<f32>>,
    greedy: Vec<u32>,
    greedy_logits: Vec<Vec<f32>>,
}

fn fixture_dir(name: &str) -> PathBuf {
    match std::env::var_os("GLMFLASH_FIXTURES") {
        Some(dir) => PathBuf::from(dir).join(name),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../e2e/fixtures")
            .join(name),
    }
}

fn load(name: &str) -> (Model, Reference) {
    let dir = fixture_dir(name);
    let model = Model::load(&dir).unwrap_or_else(|e| panic!("{name}: {e:#}"));
    let text = std::fs::read_to_string(dir.join("reference.json")).expect("reference.json");
    (
        model,
        serde_json::from_str(&text).expect("reference.json parses"),
    )
}

fn all_logits(model: &Model, tokens: &[u32]) -> Vec<f32> {
    let mut cache = model.new_cache();
    model
        .forward(
            &mut [Step {
                tokens,
                cache: &mut cache,
                all_logits: true,
            }],
            None,
        )
        .unwrap()
        .remove(0)
}

#[test]
fn prefill_logits_match_reference() {
    for name in FIXTURES {
        let (model, r) = load(name);
        let ours = all_logits(&model, &r.prompt);
        let expected: Vec<f32> = r.prefill_logits.concat();
        let err = rel_max(&ours, &expected);
        eprintln!("{name}: prefill rel err {err:.2e}");
        assert!(
            err < REF_TOLERANCE,
            "{name}: prefill logits rel err {err:.3e}"
        );
    }
}

#[test]
fn greedy_continuation_matches_reference() {
    for name in FIXTURES {
        let (model, r) = load(name);
        let (tokens, logits) = model.greedy(&r.prompt, r.greedy.len()).unwrap();
        assert_eq!(tokens, r.greedy, "{name}: greedy tokens");
        let err = rel_max(&logits.concat(), &r.greedy_logits.concat());
        eprintln!("{name}: greedy logits rel err {err:.2e}");
        assert!(
            err < REF_TOLERANCE,
            "{name}: greedy logits rel err {err:.3e}"
        );
    }
}

#[test]
fn cached_decode_equals_full_recompute() {
    for name in FIXTURES {
        let (model, r) = load(name);
        let (tokens, cached) = model.greedy(&r.prompt, 12).unwrap();
        for step in [0, 5, 11] {
            let mut seq = r.prompt.clone();
            seq.extend_from_slice(&tokens[..step]);
            let (full, _) = model.prefill(&seq).unwrap();
            let err = rel_max(&cached[step], &full);
            assert!(
                err < FORMS_TOLERANCE,
                "{name} step {step}: cached vs recomputed rel err {err:.3e}"
            );
        }
    }
}

#[test]
fn chunked_prefill_equals_one_pass() {
    for name in FIXTURES {
        let (model, r) = load(name);
        let one = all_logits(&model, &r.prompt);
        let mut cache = model.new_cache();
        let split = r.prompt.len() / 3;
        let mut chunks = Vec::new();
        for part in [&r.prompt[..split], &r.prompt[split..]] {
            let out = model
                .forward(
                    &mut [Step {
                        tokens: part,
                        cache: &mut cache,
                        all_logits: true,
                    }],
                    None,
                )
                .unwrap();
            chunks.extend(out.into_iter().flatten());
        }
        let err = rel_max(&chunks, &one);
        assert!(
            err < FORMS_TOLERANCE,
            "{name}: chunked prefill rel err {err:.3e}"
        );
    }
}

#[test]
fn batch_of_different_lengths_equals_each_alone() {
    for name in FIXTURES {
        let (model, r) = load(name);
        let a = &r.prompt;
        let b: Vec<u32> = r.prompt[..r.prompt.len() / 2 + 3]
            .iter()
            .rev()
            .copied()
            .collect();
        let alone_a = all_logits(&model, a);
        let alone_b = all_logits(&model, &b);
        let (mut ca, mut cb) = (model.new_cache(), model.new_cache());
        let out = model
            .forward(
                &mut [
                    Step {
                        tokens: a,
                        cache: &mut ca,
                        all_logits: true,
                    },
                    Step {
                        tokens: &b,
                        cache: &mut cb,
                        all_logits: true,
                    },
                ],
                None,
            )
            .unwrap();
        assert!(
            rel_max(&out[0], &alone_a) < SELF_TOLERANCE,
            "{name}: batched a"
        );
        assert!(
            rel_max(&out[1], &alone_b) < SELF_TOLERANCE,
            "{name}: batched b"
        );
        // Then one decode step for both at different positions, batched vs alone.
        let next = [3u32, 5u32];
        let (mut ca2, mut cb2) = (ca.clone(), cb.clone());
        let both = model
            .forward(
                &mut [
                    Step {
                        tokens: &next[..1],
                        cache: &mut ca,
                        all_logits: false,
                    },
                    Step {
                        tokens: &next[1..],
                        cache: &mut cb,
                        all_logits: false,
                    },
                ],
                None,
            )
            .unwrap();
        for (i, cache) in [&mut ca2, &mut cb2].into_iter().enumerate() {
            let alone = model
                .forward(
                    &mut [Step {
                        tokens: &next[i..i + 1],
                        cache,
                        all_logits: false,
                    }],
                    None,
                )
                .unwrap()
                .remove(0);
            assert!(
                rel_max(&both[i], &alone) < SELF_TOLERANCE,
                "{name}: batched decode {i}"
            );
        }
    }
}

#[test]
fn kernel_forms_agree() {
    for name in FIXTURES {
        let (mut model, r) = load(name);
        let auto = all_logits(&model, &r.prompt);
        model.options = ForwardOptions {
            kda: KdaMode::Recurrent,
            mla: MlaPath::Absorbed,
            ..ForwardOptions::default()
        };
        let other = all_logits(&model, &r.prompt);
        let err = rel_max(&other, &auto);
        assert!(
            err < FORMS_TOLERANCE,
            "{name}: recurrent+absorbed vs chunked+expanded rel err {err:.3e}"
        );
    }
}
