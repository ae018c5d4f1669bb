use super::*;
use crate::quant::Format;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn flash() -> Config {
    Config::from_json(&serde_json::from_str(GLM_5_3_FLASH_CONFIG).unwrap()).unwrap()
}

/// The seed's box: a 24,576 MiB card, a 55 GiB cap, 131,072 tokens shared by 8 sequences.
fn seed_box(cfg: Config, experts: Storage, dense: Storage, head: Storage) -> PlanInputs {
    PlanInputs {
        cfg,
        dense,
        head,
        experts,
        record_bytes: None,
        slot_bytes: None,
        vram: 24_576 * MIB,
        vram_reserve: 512 * MIB,
        ram_limit: Some(55 * GIB),
        ram_available: None,
        ram_reserve: 2048 * MIB,
        copy_down: true,
        context: 131_072,
        batch: 8,
        cache_dtype: CacheDtype::F32,
        chunk: crate::model::decoder::DEFAULT_GPU_CHUNK,
        bandwidths: Bandwidths::RTX_3090_BOX,
    }
}

fn exl3(bits: f64) -> Storage {
    Storage::Exl3 { bits }
}

#[test]
fn shipped_config_is_glm_5_3_flash() {
    let cfg = flash();
    let want = Config::from_json(&crate::model::random::flash_config(3, 42)).unwrap();
    assert_eq!(cfg, want);
    assert_eq!(cfg.moe_layers().iter().filter(|&&m| m).count(), 42);
    // 42 x 288 experts of 25.2 M parameters; 7.7 B other parameters (head and embedding
    // apart), as the model reference counts them.
    let params: u64 = weights::tensors(&cfg)
        .iter()
        .filter(|t| t.kind == Kind::RoutedExperts)
        .map(|t| t.values())
        .sum();
    assert_eq!(params, 42 * 288 * 3 * 2048 * 4096);
    let other: u64 = weights::tensors(&cfg)
        .iter()
        .filter(|t| !matches!(t.kind, Kind::RoutedExperts | Kind::Embedding | Kind::Head))
        .map(|t| t.values())
        .sum();
    assert!((7.0e9..8.5e9).contains(&(other as f64)), "{other}");
}

/// The bar: GLM-5.3-Flash as EXL3 3.05 bpw (experts at 3 bpw, head at 6 bits) on the seed's box holds
/// at least 1,300 experts in VRAM (the seed's cap is 1,376).
#[test]
fn exl3_flash_on_a_3090_holds_the_seeds_vram_experts() {
    let plan = plan(&seed_box(flash(), exl3(3.0), exl3(3.05), exl3(6.0))).unwrap();
    println!("{}", plan.table());
    assert!(plan.vram_expert_slots >= 1300, "{}", plan.vram_expert_slots);
    assert_eq!(
        plan.vram_expert_slots,
        plan.vram_expert_slots_per_layer * 42
    );
    // A 3 bpw expert: 9,437,184 bytes of trellis and 36,864 of f16 scales.
    assert!(
        (9_474_048..9_478_144).contains(&plan.record_bytes),
        "{}",
        plan.record_bytes
    );
    assert_eq!(plan.store_bytes, 42 * 288 * plan.record_bytes);
    // Everything counted fits the card.
    let used = plan.vram_weight_bytes
        + plan.cache_bytes
        + plan.workspace_bytes
        + plan.staging_bytes
        + plan.vram_reserve_bytes
        + plan.vram_expert_bytes;
    assert!(used <= plan.vram_bytes, "{used}");
    assert!(
        plan.vram_bytes - used < 42 * plan.vram_slot_bytes,
        "a layer's slot left over"
    );
    // The RAM tier: the cap less what is held less the reserve.
    assert_eq!(
        plan.ram_budget_bytes,
        55 * GIB - plan.ram_held_bytes - plan.ram_reserve_bytes
    );
    assert!(plan.ram_expert_slots > 0);
    assert_eq!(
        plan.ram_expert_slots + plan.vram_expert_slots + plan.store_only_experts,
        42 * 288
    );
    // Of what is held, the VRAM residents' host copies: none by default (a victim is copied
    // down from VRAM); with `--vram-host-copies` one record each, shown on a line of their own.
    assert_eq!(plan.ram_device_copies_bytes, 0);
    let kept = super::plan(&PlanInputs {
        copy_down: false,
        ..seed_box(flash(), exl3(3.0), exl3(3.05), exl3(6.0))
    })
    .unwrap();
    assert_eq!(
        kept.ram_device_copies_bytes,
        kept.vram_expert_slots as u64 * kept.record_bytes
    );
    assert!(kept.ram_device_copies_bytes < kept.ram_held_bytes);
    // The flag keeps the dense weights' host copies too: by default the host gives back all
    // but the embedding, MLA's kv_b and the vectors (3.47 GiB of EXL3 matrices here).
    assert_eq!(kept.ram_dense_given_back_bytes, 0);
    let given = plan.ram_dense_given_back_bytes;
    assert!(given > 3 * GIB && given < plan.vram_weight_bytes, "{given}");
    assert_eq!(
        plan.ram_budget_bytes - kept.ram_budget_bytes,
        kept.ram_device_copies_bytes + given
    );
    assert!(plan.table().contains("not held: dense weights on the GPU"));
    let table = kept.table();
    assert!(
        table.contains("held: VRAM residents' host copies"),
        "{table}"
    );
}

/// A VRAM slot is the VRAM tier's layout of a record, not the record: an EXL3 slot holds its
/// scales as f32 (9,510,912 bytes against a 9,474,048-byte record at 3 bpw), and the plan
/// counts resident and staging slots at that size while the RAM tier keeps records.
#[test]
fn vram_slots_are_sized_by_the_vram_tiers_layout() {
    use crate::backend::cuda::{Exl3Form, MoeLayout};
    use crate::quant::exl3::{Codebook, Rate};
    let p = plan(&seed_box(flash(), exl3(3.0), exl3(3.05), exl3(6.0))).unwrap();
    assert_eq!(p.record_bytes, 9_474_048);
    let form = |bits| Exl3Form {
        rate: Rate::from_bits(bits).unwrap(),
        codebook: Codebook::Mul1,
    };
    let layout = MoeLayout::exl3(4096, 2048, form(3.0), form(3.0)).unwrap();
    assert_eq!(layout.slot_bytes, 9_510_912);
    assert_eq!(p.vram_slot_bytes, 9_510_912);
    assert_eq!(p.staging_bytes, 16 * 9_510_912);
    assert_eq!(p.vram_expert_bytes, p.vram_expert_slots as u64 * 9_510_912);
    let used = p.vram_weight_bytes
        + p.cache_bytes
        + p.workspace_bytes
        + p.staging_bytes
        + p.vram_reserve_bytes
        + p.vram_expert_bytes;
    assert!(used <= p.vram_bytes && p.vram_bytes - used < 42 * 9_510_912);
    // The RAM budget holds the slots and a prompt chunk's reads of every expert no tier
    // holds (288 - 36 VRAM - 136 RAM = 116 records at once): the most slots for which both
    // fit (127 a layer while the dense weights kept host copies, before session 28; 90 when
    // the VRAM residents keep them too, `--vram-host-copies`).
    let (r, d) = (
        p.ram_expert_slots_per_layer as u64,
        p.vram_expert_slots_per_layer as u64,
    );
    let need = |r: u64| (42 * r + 288 - d - r) * p.record_bytes;
    assert!(need(r) <= p.ram_budget_bytes && need(r + 1) > p.ram_budget_bytes);
    assert_eq!(p.ram_prompt_reads_bytes, (288 - d - r) * p.record_bytes);
    assert_eq!((d, r), (36, 136), "{}", p.table());
    // An average rate gets the slot of the trellis rate above it (3.05 -> 3.5).
    let avg = plan(&seed_box(flash(), exl3(3.05), exl3(3.05), exl3(6.0))).unwrap();
    let up = MoeLayout::exl3(4096, 2048, form(3.5), form(3.5)).unwrap();
    assert_eq!(avg.vram_slot_bytes, up.slot_bytes as u64);
    // Rows: the slot is the rows' layout (q4_k experts are 4 KiB multiples already).
    let q4 = plan(&seed_box(
        flash(),
        Storage::Rows(Format::Q4K),
        exl3(3.05),
        exl3(6.0),
    ))
    .unwrap();
    assert_eq!(q4.vram_slot_bytes, q4.record_bytes);
}

/// A bf16 checkpoint converted to q4_k experts and q8_0 dense weights: bigger records, fewer
/// slots, on the same box.
#[test]
fn q4k_experts_and_q8_dense_hold_fewer() {
    let exl = plan(&seed_box(flash(), exl3(3.0), exl3(3.05), exl3(6.0))).unwrap();
    let q = Storage::Rows(Format::Q8_0);
    let q4 = plan(&seed_box(flash(), Storage::Rows(Format::Q4K), q, q)).unwrap();
    println!("{}", q4.table());
    assert_eq!(q4.record_bytes, (3 * 2048 * 16 * 144) as u64);
    assert!(q4.vram_expert_slots < exl.vram_expert_slots);
    assert!(q4.vram_weight_bytes > exl.vram_weight_bytes);
    // bf16 dense weights and q4_k experts: the case the issue counts at ~200 VRAM slots
    // without the embedding off the card; with it off and the caches counted, a few hundred.
    let bf16 = Storage::Rows(Format::Bf16);
    let b = plan(&seed_box(flash(), Storage::Rows(Format::Q4K), bf16, bf16)).unwrap();
    assert!(b.vram_expert_slots < q4.vram_expert_slots);
}

/// Each input moves the plan the way its rule says.
#[test]
fn sizing_rules() {
    let base = seed_box(flash(), exl3(3.0), exl3(3.05), exl3(6.0));
    let p0 = plan(&base).unwrap();
    // More cap: the extra over whole records goes to the RAM tier; a slot in each of the 42
    // layers takes 41 records of it, as a prompt chunk's reads of the experts no tier holds
    // shrink by one.
    let more = plan(&PlanInputs {
        ram_limit: Some(55 * GIB + 41 * 10 * p0.record_bytes),
        ..base.clone()
    })
    .unwrap();
    assert_eq!(
        more.ram_expert_slots_per_layer,
        p0.ram_expert_slots_per_layer + 10
    );
    // A longer context takes VRAM from the experts, a bigger batch too (KDA states).
    let ctx = plan(&PlanInputs {
        context: 32_768,
        ..base.clone()
    })
    .unwrap();
    assert!(ctx.cache_bytes < p0.cache_bytes);
    assert!(ctx.vram_expert_slots > p0.vram_expert_slots);
    // A sequence holds no more than the model's positions.
    let past = plan(&PlanInputs {
        context: 262_144,
        ..base.clone()
    })
    .unwrap();
    assert_eq!((past.context, past.cache_bytes), (131_072, p0.cache_bytes));
    let batch = plan(&PlanInputs {
        batch: 16,
        ..base.clone()
    })
    .unwrap();
    assert_eq!(
        batch.cache_bytes - p0.cache_bytes,
        8 * crate::engine::cache::CacheLayout::of(&base.cfg, CacheDtype::F32).fixed_bytes as u64
    );
    // A 2-byte cache dtype halves the tokens' share of the caches (the KDA states stay f32)
    // and gives the VRAM it frees to expert slots.
    let fixed =
        8 * crate::engine::cache::CacheLayout::of(&base.cfg, CacheDtype::F32).fixed_bytes as u64;
    for dtype in [CacheDtype::Bf16, CacheDtype::F16] {
        let compact = plan(&PlanInputs {
            cache_dtype: dtype,
            ..base.clone()
        })
        .unwrap();
        assert_eq!(
            2 * (compact.cache_bytes - fixed),
            p0.cache_bytes - fixed,
            "{dtype:?}"
        );
        assert!(
            compact.vram_expert_slots > p0.vram_expert_slots,
            "{dtype:?}"
        );
        assert!(compact.table().contains(dtype.name()));
    }
    // No cap: the available memory is the base.
    let open = plan(&PlanInputs {
        ram_limit: None,
        ram_available: Some(55 * GIB),
        ..base.clone()
    })
    .unwrap();
    assert_eq!(open.ram_budget_bytes, 55 * GIB - 2048 * MIB);
    // All in VRAM: every token's bytes come from HBM.
    let big = plan(&PlanInputs {
        vram: 200 * GIB,
        ram_limit: None,
        ram_available: Some(512 * GIB),
        ..base.clone()
    })
    .unwrap();
    assert_eq!(big.vram_expert_slots_per_layer, 288);
    assert_eq!(big.store_only_experts, 0);
    assert!(big.traffic.iter().all(|t| t.tier == "hbm" || t.bytes == 0));
}

#[test]
fn refuses_with_the_numbers() {
    let base = seed_box(flash(), exl3(3.0), exl3(3.05), exl3(6.0));
    let small = PlanInputs {
        vram: 4096 * MIB,
        ..base.clone()
    };
    let e = plan(&small).unwrap_err().to_string();
    assert!(
        e.contains("4096 MiB") && e.contains("131072 tokens x 8"),
        "{e}"
    );
    let tight = PlanInputs {
        ram_limit: Some(4 * GIB),
        ..base.clone()
    };
    let e = plan(&tight).unwrap_err().to_string();
    assert!(e.contains("memory cap") && e.contains("4096 MiB"), "{e}");
    // A cap that holds what the host keeps and the reserve, but not every dense weight while
    // they load (before the GPU's copies let their host bytes go): refused with the peak.
    let p = plan(&base).unwrap();
    let dense: u64 = p.weights.values().sum();
    let kept = dense - p.ram_dense_given_back_bytes;
    let limit = (kept + p.ram_reserve_bytes).max(dense - 64 * MIB) + MIB;
    assert!(limit < dense, "{kept} {dense}");
    let loading = PlanInputs {
        ram_limit: Some(limit),
        ..base
    };
    let e = plan(&loading).unwrap_err().to_string();
    assert!(e.contains(&format!("{} MiB held", dense >> 20)), "{e}");
}

#[test]
fn byte_sizes_parse() {
    use super::args::parse_bytes;
    assert_eq!(parse_bytes("55GiB").unwrap(), 55 * GIB);
    assert_eq!(parse_bytes("60000MiB").unwrap(), 60_000 * MIB);
    assert_eq!(parse_bytes("64GB").unwrap(), 64_000_000_000);
    assert_eq!(parse_bytes("123").unwrap(), 123);
    assert!(parse_bytes("55 parsecs").is_err());
    assert!(parse_bytes("GiB").is_err());
}

/// The plan reads an EXL3 checkpoint's formats from its `quantization_config`, and counts its
/// experts' and linear weights' bytes as exllamav3 wrote them (trellis plus the f16 scales;
/// the codebook markers are a few bytes a tensor).
#[test]
fn exl3_checkpoint_bytes_as_exllamav3_wrote_them() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../e2e/fixtures/exl3/exl3_mul1_3bpw");
    let args = <args::PlanArgs as clap::FromArgMatches>::from_arg_matches(
        &<args::PlanArgs as clap::Args>::augment_args(clap::Command::new("plan"))
            .get_matches_from(["plan", "--model", dir.to_str().unwrap()]),
    )
    .unwrap();
    let inputs = args.inputs().unwrap();
    assert_eq!(inputs.experts, exl3(3.0));
    assert_eq!(inputs.dense, exl3(3.0));
    let ckpt = crate::model::checkpoint::Checkpoint::open(&dir).unwrap();
    let on_disk = |prefix: &str| -> u64 {
        ckpt.keys()
            .into_iter()
            .filter(|k| k.contains(prefix) && !k.ends_with(".mul1"))
            .map(|k| ckpt.view(k).unwrap().bytes.len() as u64)
            .sum()
    };
    let layer = inputs
        .cfg
        .mlp_kinds
        .iter()
        .position(|k| *k == crate::model::config::MlpKind::Moe)
        .unwrap();
    assert_eq!(
        weights::expert_bytes(&inputs.cfg, inputs.experts),
        on_disk(&format!("layers.{layer}.mlp.experts.0."))
    );
    let shared = weights::tensors(&inputs.cfg)
        .into_iter()
        .filter(|t| t.kind == Kind::SharedExperts && t.name.contains(&format!("layers.{layer}.")))
        .map(|t| weights::tensor_bytes(&t, inputs.dense, inputs.head))
        .sum::<u64>();
    assert_eq!(
        shared,
        on_disk(&format!("layers.{layer}.mlp.shared_experts."))
    );
}
