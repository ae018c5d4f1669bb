//! An EXL3 checkpoint's routed experts in the packed store: the tiny glm5_next that exllamav3
//! 1.6.5 converted at mul1 3 bpw (`e2e/fixtures/exl3/exl3_mul1_3bpw`) packs as `exl3`
//! records holding the checkpoint's trellis, suh and svh byte for byte; the tiers decode them
//! into the same products as the checkpoint's experts; `plan` predicts the record size and
//! the VRAM slot.

use glmflash_node::model::checkpoint::Checkpoint;
use glmflash_node::model::config::Config;
use glmflash_node::model::loader::Loader;
use glmflash_node::model::moe::load_expert;
use glmflash_node::quant::Format;
use glmflash_node::quant::exl3::{Codebook, Rate};
use glmflash_node::store::{
    self, Manifest, PackOptions, PartFormat, ReaderOptions, RecordFormat, StoreReader,
    VerifyOptions,
};
use glmflash_node::tiers::source::expert_from_record;
use std::path::PathBuf;

#[path = "support/node.rs"]
mod node;
#[path = "support/runs.rs"]
mod runs;

fn model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../e2e/fixtures/exl3/exl3_mul1_3bpw")
}

fn config() -> Config {
    Config::from_file(&model().join("config.json")).unwrap()
}

fn quiet() -> PackOptions {
    PackOptions {
        progress: false,
        ..PackOptions::default()
    }
}

/// On the repository's disk filesystem (a tmpfs may refuse O_DIRECT).
fn disk_tempdir() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir")
}

/// The checkpoint's bytes of expert `e`'s gate, up and down, each trellis | suh | svh.
fn checkpoint_bytes(ckpt: &Checkpoint, layer: usize, e: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for proj in ["gate_proj", "up_proj", "down_proj"] {
        for part in ["trellis", "suh", "svh"] {
            let key = ckpt
                .keys()
                .into_iter()
                .find(|k| k.ends_with(&format!("layers.{layer}.mlp.experts.{e}.{proj}.{part}")))
                .unwrap_or_else(|| panic!("no {proj}.{part} of layer {layer} expert {e}"));
            out.extend_from_slice(ckpt.view(key).unwrap().bytes);
        }
    }
    out
}

#[test]
fn an_exl3_checkpoint_packs_its_experts_byte_for_byte() {
    let cfg = config();
    let tmp = disk_tempdir();
    let store_dir = tmp.path().join("store");
    let report = store::pack_store(&model(), &store_dir, &quiet()).unwrap();
    let verified = report.verify.expect("verified after packing");
    assert_eq!((report.records, verified.compared), (32, 32));

    let m = Manifest::load(&store_dir).unwrap();
    let exl3 = PartFormat::Exl3 {
        rate: Rate::from_bits(3.0).unwrap(),
        codebook: Codebook::Mul1,
    };
    let (d, i) = (cfg.hidden_size, cfg.moe_intermediate_size);
    for (p, (rows, cols)) in m.parts.all().into_iter().zip([(i, d), (i, d), (d, i)]) {
        assert_eq!((p.format, p.rows, p.cols), (exl3, rows, cols));
        // trellis at 3 bits a weight, then f16 suh and svh
        assert_eq!(p.length, rows * cols * 3 / 8 + 2 * (rows + cols));
    }
    let text = std::fs::read_to_string(store_dir.join(store::MANIFEST)).unwrap();
    assert!(
        text.contains(r#""format": "exl3""#) && text.contains(r#""codebook": "mul1""#),
        "the manifest says the records are EXL3"
    );

    let ckpt = Checkpoint::open(&model()).unwrap();
    let reader = StoreReader::open(&store_dir, None, ReaderOptions::default()).unwrap();
    let x: Vec<f32> = (0..3 * d)
        .map(|j| ((j * 37 % 101) as f32 - 50.0) / 50.0)
        .collect();
    for &(layer, e) in &[(1, 0), (1, 9), (2, 15)] {
        let record = reader.read(layer, e).unwrap();
        assert_eq!(record.bytes(), checkpoint_bytes(&ckpt, layer, e).as_slice());
        // Decoded by the tiers: the same products as the checkpoint's expert, bit for bit.
        let got = expert_from_record(&record, cfg.swiglu_limit).unwrap();
        let want = load_expert(
            &cfg,
            Loader::new(&ckpt).pp(&format!("layers.{layer}.mlp.experts")),
            e,
        )
        .unwrap();
        assert!(got.gate.exl3().is_some() && got.down.exl3().is_some());
        assert_eq!(got.storage_bytes(), want.storage_bytes());
        assert!(
            got.forward(&x, 3) == want.forward(&x, 3),
            "layer {layer} expert {e}: products differ"
        );
    }

    // verify-store with the model: fingerprint and every record against the checkpoint.
    let v = store::verify_store(
        &store_dir,
        Some(&model()),
        &VerifyOptions {
            sample: 32,
            progress: false,
            ..VerifyOptions::default()
        },
    )
    .unwrap();
    assert!(v.fingerprint_checked && v.compared == 32);

    // `--format exl3` names the default; asking for it again finds the store complete.
    let again = PackOptions {
        format: Some(RecordFormat::Exl3),
        ..quiet()
    };
    let report = store::pack_store(&model(), &store_dir, &again).unwrap();
    assert_eq!(report.outcome, store::PackOutcome::AlreadyComplete);
    // A row format is another layout: refused, naming both.
    let q8 = PackOptions {
        format: Some(RecordFormat::Rows(Format::Q8_0)),
        ..quiet()
    };
    let err = store::pack_store(&model(), &store_dir, &q8)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("holds exl3 3 bpw mul1 records") && err.contains("q8_0"),
        "{err}"
    );
}

/// A corrupted record is caught by verify-store, whose sample compare reports the byte.
#[test]
fn verify_store_compares_exl3_records_with_the_checkpoint() {
    let tmp = disk_tempdir();
    let store_dir = tmp.path().join("store");
    let opts = PackOptions {
        verify: false,
        ..quiet()
    };
    store::pack_store(&model(), &store_dir, &opts).unwrap();
    let m = Manifest::load(&store_dir).unwrap();
    // Rewrite one record (and its manifest sha256 and CRC) so that only the compare can see it.
    let data = store_dir.join(store::DATA);
    let mut bytes = std::fs::read(&data).unwrap();
    let r = &m.records[5];
    let at = r.offset as usize + m.parts.down.offset + 3;
    bytes[at] ^= 0x40;
    std::fs::write(&data, &bytes).unwrap();
    let mut edited = m.clone();
    let record = &bytes[r.offset as usize..r.offset as usize + r.length];
    edited.records[5].sha256 = store::manifest::sha256_hex(record);
    edited.records[5].crc32c = Some(store::crc32c(record));
    std::fs::write(
        store_dir.join(store::MANIFEST),
        serde_json::to_vec_pretty(&edited).unwrap(),
    )
    .unwrap();
    let err = store::verify_store(
        &store_dir,
        Some(&model()),
        &VerifyOptions {
            sample: 32,
            progress: false,
            ..VerifyOptions::default()
        },
    )
    .unwrap_err()
    .to_string();
    let (layer, expert) = (m.records[5].layer, m.records[5].expert);
    let byte = m.parts.down.offset + 3;
    assert!(
        err.contains(&format!("layer {layer}, expert {expert}"))
            && err.contains(&format!("at byte {byte}")),
        "{err}"
    );
}

/// `plan` predicts the store's record size for the EXL3 checkpoint (and so its VRAM/RAM slot
/// counts are in real records); `pack-store --format exl3` on a checkpoint that is not EXL3
/// is refused with the reason; an EXL3 checkpoint still converts to a row format.
#[test]
fn plan_predicts_the_exl3_record_and_formats_are_checked() {
    let tmp = disk_tempdir();
    let store_dir = tmp.path().join("store");
    let packed = store::pack_store(&model(), &store_dir, &quiet()).unwrap();
    let plan = plan_json(&model());
    assert_eq!(plan["expert_format"], "exl3:3");
    assert_eq!(plan["record_bytes"], packed.record_size as u64);
    assert_eq!(
        plan["store_bytes"],
        Manifest::load(&store_dir).unwrap().data_bytes()
    );
    // Its VRAM slot is the VRAM tier's layout of a real record (f32 scales), not the record.
    let source =
        glmflash_node::tiers::source::StoreSource::open(&store_dir, &model(), &config()).unwrap();
    let layout = glmflash_node::tiers::vram::source_layout(&source, &config()).unwrap();
    assert_eq!(plan["vram_slot_bytes"], layout.slot_bytes as u64);

    let bf16 = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../e2e/fixtures/tiny_mixed");
    let err = store::pack_store(
        &bf16,
        &tmp.path().join("refused"),
        &PackOptions {
            format: Some(RecordFormat::Exl3),
            ..quiet()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("not EXL3"), "{err}");

    let q8 = tmp.path().join("q8");
    store::pack_store(
        &model(),
        &q8,
        &PackOptions {
            format: Some(RecordFormat::Rows(Format::Q8_0)),
            ..quiet()
        },
    )
    .unwrap();
    let m = Manifest::load(&q8).unwrap();
    assert_eq!(m.parts.gate.format, PartFormat::Rows(Format::Q8_0));
}

/// The fixture with layer 2's routed experts re-encoded at 4 bits per weight (random
/// trellises are valid EXL3), as exllamav3 may rate layers differently; written under `dir`.
fn mixed_rate_checkpoint(dir: &std::path::Path) {
    use glmflash_node::model::checkpoint::write_safetensors;
    let ckpt = Checkpoint::open(&model()).unwrap();
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let tensors: Vec<_> = ckpt
        .keys()
        .into_iter()
        .map(|k| {
            let v = ckpt.view(k).unwrap();
            if k.contains("layers.2.mlp.experts.") && k.ends_with(".trellis") {
                let shape = vec![v.shape[0], v.shape[1], 64];
                let bytes = (0..shape.iter().product::<usize>() * 2)
                    .map(|_| {
                        seed ^= seed << 13;
                        seed ^= seed >> 7;
                        seed ^= seed << 17;
                        seed as u8
                    })
                    .collect();
                return (k.to_string(), v.dtype, shape, bytes);
            }
            (k.to_string(), v.dtype, v.shape.to_vec(), v.bytes.to_vec())
        })
        .collect();
    std::fs::create_dir_all(dir).unwrap();
    for f in [
        "config.json",
        "generation_config.json",
        "quantization_config.json",
        "tokenizer.json",
    ] {
        std::fs::copy(model().join(f), dir.join(f)).unwrap();
    }
    write_safetensors(
        &dir.join("model.safetensors"),
        &tensors,
        &Default::default(),
    )
    .unwrap();
    // What exllamav3 lists for those modules.
    let path = dir.join("quantization_config.json");
    let mut q: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for (module, m) in q["tensor_storage"].as_object_mut().unwrap() {
        if module.contains("layers.2.mlp.experts.") {
            m["bits_per_weight"] = 4.into();
        }
    }
    std::fs::write(&path, serde_json::to_vec(&q).unwrap()).unwrap();
}

/// `glmflash-node plan --model DIR --json`.
fn plan_json(dir: &std::path::Path) -> serde_json::Value {
    node::json(node::node(["plan", "--json", "--model"]).arg(dir))
}

/// Layers at different rates: one record size (the largest layout's), each layer's layout in
/// the manifest, and the tiered nvme-exact run from that store bit-identical to the untiered
/// run of the checkpoint.
#[test]
fn layers_at_different_rates_pack_and_serve_bit_identically() {
    use glmflash_node::model::Model;
    use glmflash_node::model::config::MlpKind;
    use glmflash_node::tiers::plan::TierPlan;
    use glmflash_node::tiers::provider::{Mode, TieredExperts};
    use glmflash_node::tiers::source::StoreSource;
    use std::sync::Arc;

    let tmp = disk_tempdir();
    let dir = tmp.path().join("mixed");
    mixed_rate_checkpoint(&dir);
    let store_dir = tmp.path().join("store");
    let report = store::pack_store(&dir, &store_dir, &quiet()).unwrap();
    assert_eq!(report.verify.unwrap().compared, 32);
    let m = Manifest::load(&store_dir).unwrap();
    let cfg = config();
    let (d, i) = (cfg.hidden_size, cfg.moe_intermediate_size);
    let four = PartFormat::Exl3 {
        rate: Rate::from_bits(4.0).unwrap(),
        codebook: Codebook::Mul1,
    };
    assert_eq!(m.layer_parts.keys().copied().collect::<Vec<_>>(), vec![2]);
    assert_eq!(m.layer_parts[&2].gate.format, four);
    let largest = 3 * (d * i / 2 + 2 * (d + i));
    assert_eq!(m.record_size, largest.div_ceil(4096) * 4096);
    assert_eq!(m.records[0].length, 3 * (d * i * 3 / 8 + 2 * (d + i)));
    assert_eq!(m.records[16].length, largest);
    let plan = plan_json(&dir);
    assert_eq!(plan["expert_format"], "exl3:4");
    assert_eq!(plan["record_bytes"], m.record_size as u64);

    let untiered = Model::load(&dir).unwrap();
    let moe: Vec<bool> = cfg.mlp_kinds.iter().map(|k| *k == MlpKind::Moe).collect();
    let source = Arc::new(StoreSource::open(&store_dir, &dir, &cfg).unwrap());
    let plan = TierPlan::new(Mode::NvmeExact, 1, 2, cfg.n_routed_experts);
    let tiers =
        Arc::new(TieredExperts::new(source, d, cfg.n_routed_experts, &moe, &plan, None).unwrap());
    let tiered = Model::builder().experts(tiers).load(&dir).unwrap();
    let prompt: Vec<u32> = (0..20)
        .map(|t| (t * 31 + 5) % cfg.vocab_size as u32)
        .collect();
    let logits = |model: &Model| runs::prompt_then_greedy(model, &prompt, 0);
    let want = logits(&untiered);
    assert!(want.iter().flatten().all(|v| v.is_finite()));
    assert!(logits(&tiered) == want, "tiered logits differ");
}

/// A random EXL3 store (as `bench --flash --flash-expert-format exl3:3` writes at Flash width)
/// at a small width: served through the tiers in every mode, down to one slot per tier, its
/// logits are bit-identical to the untiered engine holding every record in memory; decode
/// picks resident in RAM count as the CPU lane's in `fast` and `nvme`, computed in place from
/// the trellis.
#[test]
fn a_random_exl3_store_serves_bit_identically_through_the_tiers() {
    use glmflash_node::model::Model;
    use glmflash_node::model::checkpoint::DType;
    use glmflash_node::model::config::MlpKind;
    use glmflash_node::model::moe::InMemoryExperts;
    use glmflash_node::model::random::{scaled_config, write_random_dense_checkpoint};
    use glmflash_node::tiers::plan::TierPlan;
    use glmflash_node::tiers::provider::{Mode, Tier, TieredExperts};
    use glmflash_node::tiers::source::{ExpertSource, StoreSource};
    use std::sync::Arc;
    use std::sync::atomic::Ordering;

    let tmp = disk_tempdir();
    let (dir, store_dir) = (tmp.path().join("model"), tmp.path().join("store"));
    let cfg = write_random_dense_checkpoint(
        &dir,
        &scaled_config(96, 128, 4, 1, 8, 256, 2),
        11,
        DType::F32,
    )
    .unwrap();
    let exl3 = PartFormat::Exl3 {
        rate: Rate::from_bits(3.0).unwrap(),
        codebook: Codebook::Mul1,
    };
    store::write_random_store(&dir, &store_dir, exl3, 5, &|_, _| {}).unwrap();
    let moe: Vec<bool> = cfg.mlp_kinds.iter().map(|k| *k == MlpKind::Moe).collect();
    let experts = cfg.n_routed_experts;
    let source = || Arc::new(StoreSource::open(&store_dir, &dir, &cfg).unwrap());

    let all = source();
    let layers: Vec<Vec<_>> = moe
        .iter()
        .enumerate()
        .map(|(l, &m)| match m {
            true => (0..experts).map(|e| all.load(l, e).unwrap()).collect(),
            false => Vec::new(),
        })
        .collect();
    assert!(layers[1][0].gate.exl3().is_some() && layers[3][7].down.exl3().is_some());
    let untiered = Model::builder()
        .experts(Arc::new(InMemoryExperts::new(cfg.hidden_size, layers)))
        .load(&dir)
        .unwrap();

    let prompt: Vec<u32> = (0..24)
        .map(|t| (t * 37 + 3) % cfg.vocab_size as u32)
        .collect();
    // Prompt logits (every position), then 8 cached greedy decode steps.
    let run = |model: &Model| runs::prompt_then_greedy(model, &prompt, 8);
    let want = run(&untiered);
    assert!(want.iter().flatten().all(|v| v.is_finite()));
    let spread = want[0].iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(spread > 0.0, "logits are not flat");

    for (mode, device, ram) in [
        (Mode::NvmeExact, 1, 1),
        (Mode::NvmeExact, 2, 3),
        (Mode::Exact, 0, 0),
        (Mode::Nvme, 1, 2),
        (Mode::Fast, 0, 0),
    ] {
        let plan = TierPlan::new(mode, device, ram, experts);
        let tiers = Arc::new(
            TieredExperts::new(source(), cfg.hidden_size, experts, &moe, &plan, None).unwrap(),
        );
        let model = Model::builder().experts(tiers.clone()).load(&dir).unwrap();
        assert!(
            run(&model) == want,
            "{mode:?} device {device} ram {ram}: logits differ from the untiered run"
        );
        if mode.tiered() {
            assert!(tiers.stats.lookups(Tier::Store) > 0, "{mode:?}: store read");
        } else {
            assert_eq!(tiers.stats.lookups(Tier::Store), 0, "{mode:?}");
        }
        let cpu_lane = tiers.stats.cpu_lane.load(Ordering::Relaxed);
        match mode {
            Mode::Fast | Mode::Nvme => assert!(cpu_lane > 0, "{mode:?}: CPU-lane picks"),
            Mode::Exact | Mode::NvmeExact => assert_eq!(cpu_lane, 0, "{mode:?}"),
        }
    }
}
