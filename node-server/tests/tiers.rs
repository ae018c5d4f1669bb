//! Tiered experts change nothing in the output: every mode, down to one slot per tier, gives
//! logits bit-identical to the untiered engine on every fixture, and residency stays unique.

use glmflash_node::model::config::MlpKind;
use glmflash_node::model::{Model, Step};
use glmflash_node::tiers::plan::TierPlan;
use glmflash_node::tiers::provider::{Mode, Tier, TieredExperts};
use glmflash_node::tiers::source::CheckpointSource;
use std::path::PathBuf;
use std::sync::Arc;

#[path = "support/runs.rs"]
mod runs;

/// The tiers' plan with these slots per layer, aging period and prefetch (LFU, pinned).
fn test_plan(
    mode: Mode,
    device: usize,
    ram: usize,
    experts: usize,
    aging_period: u64,
    prefetch: bool,
) -> TierPlan {
    TierPlan {
        aging_period,
        prefetch: prefetch && mode.tiered(),
        ..TierPlan::new(mode, device, ram, experts)
    }
}

const FIXTURES: [&str; 5] = [
    "tiny_mixed",
    "tiny_nested",
    "tiny_bf16",
    "tiny_fused",
    "exl3/exl3_mul1_3bpw",
];

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../e2e/fixtures")
        .join(name)
}

/// Prompt logits (all positions) then 12 cached greedy steps' logits.
fn run(model: &Model, prompt: &[u32]) -> Vec<Vec<f32>> {
    runs::prompt_then_greedy(model, prompt, 12)
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
                    &test_plan(mode, device, ram, experts, 64, false),
                    None,
                )
                .unwrap(),
            );
            let model = Model::builder().experts(tiers.clone()).load(&dir).unwrap();
            let got = run(&model, &prompt);
            assert!(
                got == expected,
                "{name} {mode:?} device {device} ram {ram}: logits differ"
            );
            // Experts stored as bytes (not f32 values) live in the pinned arena's slots.
            if name == "tiny_bf16" || name.starts_with("exl3/") {
                let arena = tiers.arena().expect("an arena for byte-stored experts");
                let ram: usize = (0..moe.len())
                    .map(|l| tiers.layer_residents(l).1.len())
                    .sum();
                assert_eq!(tiers.residents_in_arena(), ram, "{name} {mode:?}");
                assert!(arena.slots() - arena.free_slots() >= ram, "{name} {mode:?}");
            }
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
    use glmflash_node::tiers::source::StoreSource;
    for name in [
        "tiny_mixed",
        "tiny_fused",
        "tiny_bf16",
        "exl3/exl3_mul1_3bpw",
    ] {
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
            let tiers = Arc::new(
                TieredExperts::new(
                    source,
                    untiered.cfg.hidden_size,
                    untiered.cfg.n_routed_experts,
                    &moe,
                    &test_plan(mode, 1, 1, untiered.cfg.n_routed_experts, 64, true),
                    None,
                )
                .unwrap(),
            );
            let model = Model::builder().experts(tiers.clone()).load(&dir).unwrap();
            assert!(
                run(&model, &prompt) == expected,
                "{name} {mode:?} from the store: logits differ"
            );
            if name.starts_with("exl3/") {
                assert!(
                    tiers.residents_in_arena() > 0,
                    "{name} {mode:?}: arena used"
                );
            }
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
                    &test_plan(mode, 1, 1, untiered.cfg.n_routed_experts, 64, false),
                    None,
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
            let model = Model::builder().experts(warm).load(&dir).unwrap();
            assert!(
                run(&model, &prompt) == expected,
                "{name} {mode:?} warm-started: logits differ"
            );
        }
    }
}

fn moe_flags(model: &Model) -> Vec<bool> {
    model
        .cfg
        .mlp_kinds
        .iter()
        .map(|k| *k == MlpKind::Moe)
        .collect()
}

/// Moves down a tier go through the bounded write-back ring: at every instant (sampled by
/// another thread under each layer's lock) an expert is in at most one of device / RAM /
/// in flight, the caps hold, the ring never holds more than its capacity, everything in
/// flight lands once flushed, and the logits stay bit-identical.
#[test]
fn write_back_ring_keeps_residency_unique_and_bounded() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let dir = fixture("tiny_mixed");
    let untiered = Model::load(&dir).unwrap();
    let prompt: Vec<u32> = (0..30)
        .map(|i| (i * 31 + 3) % untiered.cfg.vocab_size as u32)
        .collect();
    let expected = run(&untiered, &prompt);
    let moe = moe_flags(&untiered);
    let (device, ram) = (2, 3);
    for ring in [1, 4] {
        let tiers = Arc::new(
            TieredExperts::new(
                Arc::new(CheckpointSource::open(&dir).unwrap()),
                untiered.cfg.hidden_size,
                untiered.cfg.n_routed_experts,
                &moe,
                &TierPlan {
                    writeback_ring: ring,
                    ..test_plan(
                        Mode::NvmeExact,
                        device,
                        ram,
                        untiered.cfg.n_routed_experts,
                        64,
                        true,
                    )
                },
                None,
            )
            .unwrap(),
        );
        let stop = Arc::new(AtomicBool::new(false));
        let samples = Arc::new(AtomicU64::new(0));
        let checker = {
            let (tiers, stop, samples, moe) =
                (tiers.clone(), stop.clone(), samples.clone(), moe.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    for layer in (0..moe.len()).filter(|&l| moe[l]) {
                        let (d, r, f) = tiers.layer_snapshot(layer);
                        let mut all: Vec<usize> = d.iter().chain(&r).chain(&f).copied().collect();
                        let n = all.len();
                        all.sort_unstable();
                        all.dedup();
                        assert_eq!(all.len(), n, "layer {layer}: {d:?} {r:?} {f:?}");
                        assert!(d.len() <= device && r.len() <= ram, "{d:?} {r:?}");
                        samples.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        };
        let model = Model::builder().experts(tiers.clone()).load(&dir).unwrap();
        let got = run(&model, &prompt);
        stop.store(true, Ordering::Relaxed);
        checker.join().unwrap();
        assert!(got == expected, "ring {ring}: logits differ");
        assert!(samples.load(Ordering::Relaxed) > 0);
        tiers.flush();
        let (capacity, high_water, _) = tiers.writeback_ring();
        assert_eq!(capacity, ring);
        assert!(
            high_water >= 1 && high_water <= ring,
            "peak {high_water} of {ring}"
        );
        let demoted = tiers.stats.demotions.load(Ordering::Relaxed);
        assert!(demoted > 0, "the caps force device victims down");
        assert_eq!(tiers.stats.written_back.load(Ordering::Relaxed), demoted);
        for layer in (0..moe.len()).filter(|&l| moe[l]) {
            assert!(
                tiers.layer_snapshot(layer).2.is_empty(),
                "nothing left in flight"
            );
        }
    }
}

/// A batched decode tick (several sequences, one new token each) counts as decode: the
/// phase comes from the kind of step, not from how many tokens the call carries.
#[test]
fn batched_decode_tick_is_counted_as_decode() {
    let dir = fixture("tiny_mixed");
    let cfg = Model::load(&dir).unwrap().cfg;
    let moe: Vec<bool> = cfg.mlp_kinds.iter().map(|k| *k == MlpKind::Moe).collect();
    let tiers = Arc::new(
        TieredExperts::new(
            Arc::new(CheckpointSource::open(&dir).unwrap()),
            cfg.hidden_size,
            cfg.n_routed_experts,
            &moe,
            &test_plan(Mode::Nvme, 2, 4, cfg.n_routed_experts, 64, false),
            None,
        )
        .unwrap(),
    );
    let model = Model::builder().experts(tiers.clone()).load(&dir).unwrap();
    let phase_total = |phase: usize| -> u64 {
        tiers
            .stats
            .lookups
            .iter()
            .map(|t| t[phase].load(std::sync::atomic::Ordering::Relaxed))
            .sum()
    };
    let (mut a, mut b) = (model.new_cache(), model.new_cache());
    model
        .forward(
            &mut [
                Step {
                    tokens: &[1, 2, 3],
                    cache: &mut a,
                    all_logits: false,
                },
                Step {
                    tokens: &[4],
                    cache: &mut b,
                    all_logits: false,
                },
            ],
            None,
        )
        .unwrap();
    // A one-token prompt is still prefill.
    let prefill = phase_total(0);
    assert!(prefill > 0);
    assert_eq!(phase_total(1), 0);
    for _ in 0..3 {
        model
            .forward(
                &mut [
                    Step {
                        tokens: &[5],
                        cache: &mut a,
                        all_logits: false,
                    },
                    Step {
                        tokens: &[6],
                        cache: &mut b,
                        all_logits: false,
                    },
                ],
                None,
            )
            .unwrap();
    }
    assert_eq!(phase_total(0), prefill, "decode ticks counted as prefill");
    let decode = phase_total(1);
    assert!(decode > 0);
    // A tick mixing a prompt chunk with a decode step counts each token in its own phase.
    let mut c = model.new_cache();
    model
        .forward(
            &mut [
                Step {
                    tokens: &[7],
                    cache: &mut a,
                    all_logits: false,
                },
                Step {
                    tokens: &[8, 9, 10, 11],
                    cache: &mut c,
                    all_logits: false,
                },
            ],
            None,
        )
        .unwrap();
    assert!(phase_total(0) > prefill && phase_total(1) > decode);
}

/// `/metrics` of a tiered server shows the tier metrics under the contract's names, with the
/// lookups of a real request behind them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiered_server_exports_the_tier_metrics() {
    use axum::body::{Body, to_bytes};
    use axum::http::Request;
    use glmflash_node::api::server::load_engine_with;
    use glmflash_node::api::{ApiConfig, AppState, app};
    use glmflash_node::engine::scheduler::EngineConfig;
    use glmflash_node::metrics::{self, Metrics};
    use tower::ServiceExt;

    let dir = tempfile::tempdir().unwrap();
    glmflash_node::demo::make_demo_model(dir.path(), glmflash_node::demo::DEFAULT_SEED).unwrap();
    let model_dir = dir.path().to_path_buf();
    let metrics_registry = Arc::new(Metrics::new());
    let state = AppState::new(ApiConfig::default(), metrics_registry.clone());
    let registry = metrics_registry.clone();
    let engine = tokio::task::spawn_blocking(move || {
        load_engine_with(
            &model_dir,
            EngineConfig::default(),
            registry.clone(),
            || {
                let cfg = glmflash_node::model::config::Config::from_file(
                    &model_dir.join("config.json"),
                )?;
                let moe: Vec<bool> = cfg.mlp_kinds.iter().map(|k| *k == MlpKind::Moe).collect();
                let tiers = Arc::new(TieredExperts::new(
                    Arc::new(CheckpointSource::open(&model_dir)?),
                    cfg.hidden_size,
                    cfg.n_routed_experts,
                    &moe,
                    &test_plan(Mode::Nvme, 2, 3, cfg.n_routed_experts, 64, true),
                    None,
                )?);
                let t = tiers.clone();
                registry.attach_tiers(move || glmflash_node::tiers::args::metrics_snapshot(&t))?;
                Model::builder().experts(tiers).load(&model_dir)
            },
        )
    })
    .await
    .unwrap()
    .unwrap();
    state.set_engine(Arc::new(engine));
    let router = app(state);
    let send = |req: Request<Body>| {
        let router = router.clone();
        async move {
            let resp = router.oneshot(req).await.unwrap();
            assert!(resp.status().is_success(), "{}", resp.status());
            let body = to_bytes(resp.into_body(), usize::MAX).await.unwrap();
            String::from_utf8(body.to_vec()).unwrap()
        }
    };
    send(
        Request::post("/v1/completions")
            .header("content-type", "application/json")
            .body(Body::from(
                r#"{"model":"glm-5.3-flash","prompt":"Hello there","max_tokens":6,"ignore_eos":true}"#,
            ))
            .unwrap(),
    )
    .await;
    let text = send(Request::get("/metrics").body(Body::empty()).unwrap()).await;
    for name in metrics::TIER_METRICS {
        assert!(
            text.contains(&format!("# TYPE {name} ")),
            "{name} missing in\n{text}"
        );
    }
    let value = |series: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(series))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("{series} missing in\n{text}"))
    };
    let decode: f64 = ["vram", "ram", "nvme"]
        .iter()
        .map(|t| {
            value(&format!(
                r#"glmflash_expert_lookups_total{{phase="decode",tier="{t}"}}"#
            ))
        })
        .sum();
    assert!(decode > 0.0, "decode lookups counted");
    assert!(value(r#"glmflash_expert_lookups_total{phase="prefill",tier="nvme"}"#) > 0.0);
    assert!(value(r#"glmflash_tier_capacity_experts{tier="vram"}"#) > 0.0);
    assert!(value(r#"glmflash_bytes_moved_total{path="nvme_to_ram"}"#) > 0.0);
    assert!(value("glmflash_nvme_read_seconds_count") > 0.0);
    assert!(text.contains(r#"glmflash_memory_bytes{kind="pinned_ram"}"#));
}

/// A source that records how it is asked (one expert at a time or in batches) and, when
/// told, fails one record's batch read once, delivering it last (after the products had the
/// others to start on).
struct Counting {
    inner: CheckpointSource,
    singles: std::sync::atomic::AtomicUsize,
    batches: std::sync::Mutex<Vec<usize>>,
    fail_once: Option<(usize, usize)>,
    failed: std::sync::atomic::AtomicBool,
}

impl Counting {
    fn new(dir: &std::path::Path, fail_once: Option<(usize, usize)>) -> Arc<Counting> {
        Arc::new(Counting {
            inner: CheckpointSource::open(dir).unwrap(),
            singles: Default::default(),
            batches: Default::default(),
            fail_once,
            failed: Default::default(),
        })
    }
}

impl glmflash_node::tiers::source::ExpertSource for Counting {
    fn load(
        &self,
        layer: usize,
        expert: usize,
    ) -> anyhow::Result<glmflash_node::model::mlp::SwiGlu> {
        self.singles
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.load(layer, expert)
    }

    fn load_each(
        &self,
        keys: &[(usize, usize)],
        deliver: &(dyn Fn(usize, anyhow::Result<glmflash_node::model::mlp::SwiGlu>) + Sync),
    ) {
        self.batches.lock().unwrap().push(keys.len());
        let mut order: Vec<usize> = (0..keys.len()).collect();
        order.sort_by_key(|&i| Some(keys[i]) == self.fail_once);
        for i in order {
            let (l, e) = keys[i];
            if Some(keys[i]) == self.fail_once
                && !self.failed.swap(true, std::sync::atomic::Ordering::SeqCst)
            {
                deliver(
                    i,
                    Err(anyhow::anyhow!(
                        "injected: layer {l}, expert {e} unreadable"
                    )),
                );
            } else {
                deliver(i, self.inner.load(l, e));
            }
        }
    }

    fn record_bytes(&self) -> usize {
        self.inner.record_bytes()
    }

    fn slot_bytes(&self) -> Option<usize> {
        self.inner.slot_bytes()
    }
}

/// `tiny_mixed`, its untiered model and the 30-token prompt these tests serve.
fn tiny_mixed() -> (PathBuf, Model, Vec<u32>) {
    let dir = fixture("tiny_mixed");
    let untiered = Model::load(&dir).unwrap();
    let prompt: Vec<u32> = (0..30)
        .map(|i| (i * 29 + 7) % untiered.cfg.vocab_size as u32)
        .collect();
    (dir, untiered, prompt)
}

/// A prefill's store misses of a layer are read in one batch (at queue depth on the real
/// store), not one after another; the logits stay bit-identical.
#[test]
fn a_layers_store_misses_are_read_in_one_batch() {
    let (dir, untiered, prompt) = tiny_mixed();
    let expected = run(&untiered, &prompt);
    let source = Counting::new(&dir, None);
    let tiers = Arc::new(
        TieredExperts::new(
            source.clone(),
            untiered.cfg.hidden_size,
            untiered.cfg.n_routed_experts,
            &untiered.cfg.moe_layers(),
            &test_plan(
                Mode::NvmeExact,
                1,
                1,
                untiered.cfg.n_routed_experts,
                64,
                false,
            ),
            None,
        )
        .unwrap(),
    );
    let model = Model::builder().experts(tiers.clone()).load(&dir).unwrap();
    assert!(run(&model, &prompt) == expected, "logits differ");
    let batches = source.batches.lock().unwrap().clone();
    let moe_layers = untiered.cfg.moe_layers().iter().filter(|&&m| m).count();
    // The prefill: every MoE layer asks once for all its misses (30 tokens pick most experts).
    assert!(batches.len() >= moe_layers, "{batches:?}");
    assert!(
        batches[..moe_layers].iter().all(|&n| n > 2),
        "prefill batches {batches:?}"
    );
    let batched: usize = batches.iter().sum();
    let reads = tiers
        .stats
        .store_reads
        .load(std::sync::atomic::Ordering::Relaxed) as usize;
    assert_eq!(
        reads,
        batched + source.singles.load(std::sync::atomic::Ordering::Relaxed)
    );
}

/// `tiny_mixed` through tiers over `source` with `device` and `ram` slots a layer, the
/// store misses overlapping the products or read first.
fn overlap_tiers(
    source: Arc<dyn glmflash_node::tiers::source::ExpertSource>,
    cfg: &glmflash_node::model::config::Config,
    mode: Mode,
    (device, ram): (usize, usize),
    fetch_overlap: bool,
) -> Arc<TieredExperts> {
    let plan = TierPlan {
        fetch_overlap,
        ..test_plan(mode, device, ram, cfg.n_routed_experts, 64, false)
    };
    Arc::new(
        TieredExperts::new(
            source,
            cfg.hidden_size,
            cfg.n_routed_experts,
            &cfg.moe_layers(),
            &plan,
            None,
        )
        .unwrap(),
    )
}

/// Computing each pick as its record arrives changes neither the logits (bit for bit, every
/// tiered mode, prompt and greedy steps) nor what a cold prompt reads: each layer's distinct
/// picks, each once, as when the whole batch is read first. (After the prompt, what is read
/// depends on when the write-back thread settled the moves down, on and off alike.)
#[test]
fn products_overlapping_the_reads_change_nothing_but_the_wait() {
    let (dir, untiered, prompt) = tiny_mixed();
    let expected = run(&untiered, &prompt);
    let reads = |t: &TieredExperts| {
        t.stats
            .store_reads
            .load(std::sync::atomic::Ordering::Relaxed) as usize
    };
    for (mode, slots) in [
        (Mode::NvmeExact, (1, 1)),
        (Mode::Nvme, (2, 3)),
        (Mode::Nvme, (0, 0)),
    ] {
        let mut prompt_reads = Vec::new();
        for overlap in [true, false] {
            let source = Counting::new(&dir, None);
            let tiers = overlap_tiers(source.clone(), &untiered.cfg, mode, slots, overlap);
            let model = Model::builder().experts(tiers.clone()).load(&dir).unwrap();
            let cold = overlap_tiers(
                Arc::new(CheckpointSource::open(&dir).unwrap()),
                &untiered.cfg,
                mode,
                slots,
                overlap,
            );
            let prompt_model = Model::builder().experts(cold.clone()).load(&dir).unwrap();
            prompt_model.prefill(&prompt).unwrap();
            let picked: usize = cold
                .history("cold")
                .counts
                .iter()
                .map(|row| row.iter().filter(|&&c| c > 0).count())
                .sum();
            prompt_reads.push(reads(&cold));
            assert_eq!(reads(&cold), picked, "a cold prompt reads each pick once");
            assert!(
                run(&model, &prompt) == expected,
                "{mode:?} {slots:?} overlap {overlap}: logits differ"
            );
            tiers.flush();
            let batched: usize = source.batches.lock().unwrap().iter().sum();
            let singles = source.singles.load(std::sync::atomic::Ordering::Relaxed);
            assert_eq!(reads(&tiers), batched + singles, "each read counted once");
            assert!(
                batched > 0,
                "{mode:?}: the prompt's misses went to the fetch thread"
            );
            let moe = untiered.cfg.moe_layers();
            for layer in (0..moe.len()).filter(|&l| moe[l]) {
                let (d, r, f) = tiers.layer_snapshot(layer);
                assert!(d.len() <= slots.0 && r.len() <= slots.1 && f.is_empty());
                assert!(d.iter().all(|e| !r.contains(e)), "an expert in two tiers");
            }
        }
        assert_eq!(
            prompt_reads[0], prompt_reads[1],
            "{mode:?} {slots:?}: overlap on and off read alike"
        );
    }
}

/// A prompt chunk's predicted misses of the next MoE layer are read ahead (once this layer's
/// records are admitted) and serve that layer's misses: the logits stay bit-identical, the
/// prompt reads nothing twice, and every read is one the tiers would have made or one
/// counted as wasted (a prediction no token picked).
#[test]
fn a_prompts_next_layer_is_read_ahead_and_nothing_twice() {
    let (dir, untiered, prompt) = tiny_mixed();
    let expected = untiered.prefill(&prompt).unwrap().0;
    let experts = untiered.cfg.n_routed_experts;
    let get = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    let mut reads = Vec::new();
    for prefetch in [false, true] {
        let source = Arc::new(CheckpointSource::open(&dir).unwrap());
        let plan = TierPlan {
            prefetch,
            ..test_plan(Mode::NvmeExact, 1, 1, experts, 64, prefetch)
        };
        let tiers = Arc::new(
            TieredExperts::new(
                source,
                untiered.cfg.hidden_size,
                experts,
                &untiered.cfg.moe_layers(),
                &plan,
                None,
            )
            .unwrap(),
        );
        let model = Model::builder().experts(tiers.clone()).load(&dir).unwrap();
        assert!(
            model.prefill(&prompt).unwrap().0 == expected,
            "prefetch {prefetch}: logits differ"
        );
        tiers.flush();
        let s = &tiers.stats;
        reads.push((
            get(&s.store_reads),
            get(&s.prefetch_hits),
            get(&s.prefetch_wasted),
        ));
        if prefetch {
            assert!(
                get(&s.prefetch_issued) > 0 && get(&s.prefetch_hits) > 0,
                "{:?}",
                reads
            );
            // Issued reads were used or wasted, none left over after the last MoE layer.
            assert_eq!(
                get(&s.prefetch_issued),
                get(&s.prefetch_hits) + get(&s.prefetch_wasted)
            );
        }
    }
    let ((off, ..), (on, _, wasted)) = (reads[0], reads[1]);
    assert_eq!(
        on,
        off + wasted,
        "reads without read-ahead {off}, with {on}, {wasted} wasted"
    );
}

/// A record that fails while the products run fails that forward with the record's error
/// (no hang, nothing admitted from it), and the tiers serve the next request bit-exactly.
#[test]
fn a_read_failing_under_the_products_fails_that_forward_only() {
    let (dir, untiered, prompt) = tiny_mixed();
    let expected = run(&untiered, &prompt);
    let first_moe = untiered.cfg.moe_layers().iter().position(|&m| m).unwrap();
    // The expert the prompt's first token picks first in the first MoE layer is surely read.
    let source = Arc::new(CheckpointSource::open(&dir).unwrap());
    let probe = overlap_tiers(source, &untiered.cfg, Mode::NvmeExact, (0, 0), true);
    let model = Model::builder().experts(probe.clone()).load(&dir).unwrap();
    run(&model, &prompt);
    let picked = probe.history("probe").counts[first_moe]
        .iter()
        .position(|&c| c > 0)
        .unwrap();
    drop(model);
    drop(probe);
    let source = Counting::new(&dir, Some((first_moe, picked)));
    let tiers = overlap_tiers(source.clone(), &untiered.cfg, Mode::NvmeExact, (1, 2), true);
    let model = Model::builder().experts(tiers.clone()).load(&dir).unwrap();
    let Err(err) = model.prefill(&prompt) else {
        panic!("the failed read fails the prefill");
    };
    assert!(
        format!("{err:#}").contains(&format!("layer {first_moe}, expert {picked} unreadable")),
        "{err:#}"
    );
    assert!(source.failed.load(std::sync::atomic::Ordering::SeqCst));
    tiers.flush();
    assert_ne!(
        tiers.residency(first_moe, picked),
        Tier::Ram,
        "a failed read is not admitted"
    );
    assert_ne!(tiers.residency(first_moe, picked), Tier::Device);
    assert!(
        run(&model, &prompt) == expected,
        "the next request is served bit-exactly"
    );
}

/// A packed store of `tiny_mixed` and tiers over it with `device` and `ram` slots a layer.
struct HistoryRig {
    dir: PathBuf,
    store: tempfile::TempDir,
    cfg: glmflash_node::model::config::Config,
    moe: Vec<bool>,
    prompt: Vec<u32>,
    device: usize,
    ram: usize,
}

impl HistoryRig {
    fn new(device: usize, ram: usize) -> HistoryRig {
        let dir = fixture("tiny_mixed");
        let store = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        glmflash_node::store::pack_store(&dir, store.path(), &Default::default()).unwrap();
        let cfg = Model::load(&dir).unwrap().cfg.clone();
        let moe = cfg.mlp_kinds.iter().map(|k| *k == MlpKind::Moe).collect();
        let prompt = (0..30)
            .map(|i| (i * 17 + 3) % cfg.vocab_size as u32)
            .collect();
        HistoryRig {
            dir,
            store,
            cfg,
            moe,
            prompt,
            device,
            ram,
        }
    }

    fn tiers(&self, history: Option<PathBuf>, prefetch: bool) -> Arc<TieredExperts> {
        use glmflash_node::tiers::source::StoreSource;
        let cfg = &self.cfg;
        let source = Arc::new(StoreSource::open(self.store.path(), &self.dir, cfg).unwrap());
        let plan = TierPlan {
            history,
            ..test_plan(
                Mode::Nvme,
                self.device,
                self.ram,
                cfg.n_routed_experts,
                64,
                prefetch,
            )
        };
        let (hidden, experts) = (cfg.hidden_size, cfg.n_routed_experts);
        Arc::new(TieredExperts::new(source, hidden, experts, &self.moe, &plan, None).unwrap())
    }

    /// Serves the prompt once through fresh tiers; gives the logits, the history and its file.
    fn serve_once(&self) -> (Vec<Vec<f32>>, RoutingHistory, PathBuf) {
        let first = self.tiers(None, false);
        let served = Model::builder()
            .experts(first.clone())
            .load(&self.dir)
            .unwrap();
        let expected = run(&served, &self.prompt);
        let history = first.history("fp");
        let file = self.store.path().join("history.json");
        history.save(&file).unwrap();
        (expected, history, file)
    }
}

use glmflash_node::tiers::history::RoutingHistory;

/// A routing history fills the free slots in the background, most picked first (what the
/// synchronous warm start loads), and never takes a slot a lookup holds.
#[test]
fn a_history_fills_free_slots_in_the_background_and_evicts_nothing() {
    let rig = HistoryRig::new(2, 3);
    let (device, ram, moe) = (rig.device, rig.ram, &rig.moe);
    let (expected, history, file) = rig.serve_once();

    // A fresh start with it: the slots fill in the background with the most picked experts.
    let warm = rig.tiers(Some(file.clone()), false);
    warm.open_history("fp").unwrap();
    let loaded = warm.wait_filled();
    let mut wanted_total = 0;
    for (layer, &is_moe) in moe.iter().enumerate() {
        if !is_moe {
            continue;
        }
        let ranked = history.ranked(layer);
        let (mut d, mut r) = warm.layer_residents(layer);
        d.sort_unstable();
        r.sort_unstable();
        let mut want_d = ranked[..device.min(ranked.len())].to_vec();
        let mut want_r = ranked[want_d.len()..(device + ram).min(ranked.len())].to_vec();
        want_d.sort_unstable();
        want_r.sort_unstable();
        assert_eq!((d, r), (want_d, want_r), "layer {layer}");
        wanted_total += (device + ram).min(ranked.len());
    }
    assert_eq!(loaded, wanted_total);
    let model = Model::builder().experts(warm).load(&rig.dir).unwrap();
    assert!(
        run(&model, &rig.prompt) == expected,
        "warm-filled: logits differ"
    );

    // Slots that lookups filled first stay theirs: a fill finds nothing free to load.
    let busy = rig.tiers(Some(file), false);
    let model = Model::builder()
        .experts(busy.clone())
        .load(&rig.dir)
        .unwrap();
    let _ = run(&model, &rig.prompt);
    let before: Vec<_> = (0..moe.len()).map(|l| busy.layer_residents(l)).collect();
    busy.open_history("fp").unwrap();
    assert_eq!(busy.wait_filled(), 0);
    let after: Vec<_> = (0..moe.len()).map(|l| busy.layer_residents(l)).collect();
    assert_eq!(before, after);
}

/// An expert the prefetcher staged before the fill reached it moves from the staging into its
/// slot: the fill does not read it again, and no second copy stays staged.
#[test]
fn the_history_fill_takes_what_the_prefetcher_staged_instead_of_reading_it_again() {
    use glmflash_node::model::moe::ExpertProvider;
    use std::sync::atomic::Ordering::Relaxed;
    let rig = HistoryRig::new(2, 3);
    let (_, history, file) = rig.serve_once();
    let layer = rig.moe.iter().position(|&m| m).expect("a MoE layer");
    let ranked = history.ranked(layer);
    let staged: Vec<usize> = ranked[..2.min(ranked.len())].to_vec();
    assert!(
        !staged.is_empty(),
        "the history picked experts of layer {layer}"
    );

    let tiers = rig.tiers(Some(file), true);
    let reads = |t: &TieredExperts| t.stats.store_reads.load(Relaxed);
    let ids: Vec<u32> = staged.iter().map(|&e| e as u32).collect();
    tiers.prefetch(layer, &ids, false);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while reads(&tiers) < staged.len() as u64 {
        assert!(
            std::time::Instant::now() < deadline,
            "the prefetcher staged nothing"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    while tiers.staged_count() < staged.len() {
        assert!(
            std::time::Instant::now() < deadline,
            "the staging never filled"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let before = reads(&tiers);
    tiers.open_history("fp").unwrap();
    let loaded = tiers.wait_filled();
    // Every wanted expert is in a slot, and only the ones not staged were read.
    assert_eq!(reads(&tiers) - before, (loaded - staged.len()) as u64);
    let (d, r) = tiers.layer_residents(layer);
    for e in &staged {
        assert!(
            d.contains(e) || r.contains(e),
            "staged expert {e} not in a slot"
        );
    }
    assert_eq!(tiers.staged_count(), 0, "a second copy stayed staged");
}
