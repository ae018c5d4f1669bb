//! Tiered experts change nothing in the output: every mode, down to one slot per tier, gives
//! logits bit-identical to the untiered engine on every fixture, and residency stays unique.

use glmflash_node::model::config::MlpKind;
use glmflash_node::model::{Model, Step};
use glmflash_node::tiers::provider::{CheckpointSource, Mode, Tier, TierCaps, TieredExperts};
use std::path::PathBuf;
use std::sync::Arc;

const FIXTURES: [&str; 4] = ["tiny_mixed", "tiny_nested", "tiny_bf16", "tiny_fused"];

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../e2e/fixtures")
        .join(name)
}

/// Prompt logits (all positions) then 12 cached greedy steps' logits.
fn run(model: &Model, prompt: &[u32]) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache();
    let mut out = model
        .forward(
            &mut [Step {
                tokens: prompt,
                cache: &mut cache,
                all_logits: true,
            }],
            None,
        )
        .unwrap();
    for _ in 0..12 {
        let last = out.last().unwrap();
        let next =
            glmflash_node::backend::cpu::ops::argmax(&last[last.len() - model.cfg.vocab_size..])
                as u32;
        out.extend(
            model
                .forward(
                    &mut [Step {
                        tokens: &[next],
                        cache: &mut cache,
                        all_logits: false,
                    }],
                    None,
                )
                .unwrap(),
        );
    }
    out
}

#[test]
fn every_mode_and_cap_is_bit_identical_to_untiered() {
    for name in FIXTURES {
        let dir = fixture(name);
        let untiered = Model::load(&dir).unwrap();
        let prompt: Vec<u32> = (0..30)
            .map(|i| (i * 29 + 7) % untiered.cfg.vocab_size as u32)
            .collect();
        let expected = run(&untiered, &prompt);
        let moe: Vec<bool> = untiered
            .cfg
            .mlp_kinds
            .iter()
            .map(|k| *k == MlpKind::Moe)
            .collect();
        let experts = untiered.cfg.n_routed_experts;
        let cases = [
            (Mode::Fast, 0, 0),
            (Mode::Exact, 0, 0),
            (Mode::Nvme, 1, 1),
            (Mode::NvmeExact, 1, 1),
            (Mode::Nvme, 0, 1),
            (Mode::Nvme, 2, 3),
            (Mode::NvmeExact, experts, experts),
        ];
        for (mode, device, ram) in cases {
            let source = Arc::new(CheckpointSource::open(&dir).unwrap());
            let tiers = Arc::new(
                TieredExperts::new(
                    source,
                    untiered.cfg.hidden_size,
                    experts,
                    &moe,
                    mode,
                    TierCaps {
                        device_slots_per_layer: device,
                        ram_slots_per_layer: ram,
                    },
                    64,
                    false,
                )
                .unwrap(),
            );
            let model = Model::load_with(&dir, Some(tiers.clone())).unwrap();
            let got = run(&model, &prompt);
            assert!(
                got == expected,
                "{name} {mode:?} device {device} ram {ram}: logits differ"
            );
            for layer in (0..moe.len()).filter(|&l| moe[l]) {
                let (d, r) = tiers.layer_residents(layer);
                assert!(
                    d.iter().all(|e| !r.contains(e)),
                    "{name} {mode:?}: expert in two tiers at layer {layer}"
                );
                if mode.tiered() {
                    assert!(
                        d.len() <= device && r.len() <= ram,
                        "{name}: caps exceeded {d:?} {r:?}"
                    );
                } else {
                    assert_eq!(r.len(), experts, "{name} {mode:?}: all experts in RAM");
                }
            }
            let lookups: u64 = [Tier::Device, Tier::Ram, Tier::Store]
                .iter()
                .map(|t| tiers.stats.lookups(*t))
                .sum();
            assert!(lookups > 0);
            if !mode.tiered() {
                assert_eq!(
                    tiers.stats.lookups(Tier::Store),
                    0,
                    "{mode:?} must not read the store after load"
                );
            } else if device > 0 && device < experts {
                assert!(
                    tiers.stats.lookups(Tier::Device) > 0,
                    "{name} {mode:?}: device tier used"
                );
                assert!(
                    tiers.stats.lookups(Tier::Store) > 0,
                    "{name} {mode:?}: store read on misses"
                );
            }
        }
    }
}

#[test]
fn packed_store_source_is_bit_identical_too() {
    use glmflash_node::tiers::provider::StoreSource;
    for name in ["tiny_mixed", "tiny_fused"] {
        let dir = fixture(name);
        let store = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        glmflash_node::store::pack_store(&dir, store.path(), &Default::default()).unwrap();
        let untiered = Model::load(&dir).unwrap();
        let prompt: Vec<u32> = (0..30)
            .map(|i| (i * 13 + 1) % untiered.cfg.vocab_size as u32)
            .collect();
        let expected = run(&untiered, &prompt);
        let moe: Vec<bool> = untiered
            .cfg
            .mlp_kinds
            .iter()
            .map(|k| *k == MlpKind::Moe)
            .collect();
        for mode in [Mode::NvmeExact, Mode::Nvme, Mode::Exact] {
            let source = Arc::new(StoreSource::open(store.path(), &dir, &untiered.cfg).unwrap());
            let caps = TierCaps {
                device_slots_per_layer: 1,
                ram_slots_per_layer: 1,
            };
            let tiers = Arc::new(
                TieredExperts::new(
                    source,
                    untiered.cfg.hidden_size,
                    untiered.cfg.n_routed_experts,
                    &moe,
                    mode,
                    caps,
                    64,
                    true,
                )
                .unwrap(),
            );
            let model = Model::load_with(&dir, Some(tiers.clone())).unwrap();
            assert!(
                run(&model, &prompt) == expected,
                "{name} {mode:?} from the store: logits differ"
            );
            if mode.tiered() {
                let issued = tiers
                    .stats
                    .prefetch_issued
                    .load(std::sync::atomic::Ordering::Relaxed);
                assert!(
                    issued > 0,
                    "{name} {mode:?}: layer-ahead prefetch issued reads"
                );
            }
            // Warm start from the history reproduces the same logits and preloads the favourites.
            let history = tiers.history("fp");
            let source = Arc::new(StoreSource::open(store.path(), &dir, &untiered.cfg).unwrap());
            let warm = Arc::new(
                TieredExperts::new(
                    source,
                    untiered.cfg.hidden_size,
                    untiered.cfg.n_routed_experts,
                    &moe,
                    mode,
                    caps,
                    64,
                    false,
                )
                .unwrap(),
            );
            let loaded = warm.warm_start(&history, 64).unwrap();
            let first_moe = moe.iter().position(|&m| m).unwrap();
            if mode.tiered() {
                assert!(loaded > 0);
                assert_eq!(
                    warm.layer_residents(first_moe).0,
                    vec![history.ranked(first_moe)[0]]
                );
            }
            let model = Model::load_with(&dir, Some(warm)).unwrap();
            assert!(
                run(&model, &prompt) == expected,
                "{name} {mode:?} warm-started: logits differ"
            );
        }
    }
}
