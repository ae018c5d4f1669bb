//! One sizing path: the memory plan the server follows in a tiered mode (`serve`, `generate`,
//! `logits`) is `glmflash-node plan`'s for the same checkpoint, store, box and shape; and the
//! server's sizing rules (free VRAM, the cgroup cap, the flags, the modes, the floor) each move
//! it as they say.

#[path = "support/node.rs"]
mod node;

use clap::Parser;
use glmflash_node::cli::{Cli, Command, ModelArgs, vram_floor_problem};
use glmflash_node::model::checkpoint::DType;
use glmflash_node::model::config::Config;
use glmflash_node::model::random::{scaled_config, write_random_checkpoint};
use glmflash_node::plan::{MemoryPlan, Shape, plan};
use glmflash_node::store::{self, PackOptions};
use glmflash_node::tiers::plan::MachineFacts;
use glmflash_node::tiers::sizing::MemoryFacts;
use glmflash_node::tiers::source::{ExpertSource, StoreSource};
use std::path::{Path, PathBuf};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

struct Fixture {
    _tmp: tempfile::TempDir,
    model: PathBuf,
    store: PathBuf,
    cfg: Config,
    record: u64,
}

/// hidden 256, 4 layers (1 dense), 16 experts of width 256 in bf16, packed (O_DIRECT needs a
/// disk filesystem: cargo's target dir).
fn fixture() -> Fixture {
    let tmp = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let model = tmp.path().join("model");
    let store = tmp.path().join("store");
    let cfg = write_random_checkpoint(
        &model,
        &scaled_config(64, 256, 4, 1, 16, 256, 2),
        7,
        DType::Bf16,
    )
    .unwrap();
    let options = PackOptions {
        progress: false,
        ..PackOptions::default()
    };
    store::pack_store(&model, &store, &options).unwrap();
    let record = StoreSource::open(&store, &model, &cfg)
        .unwrap()
        .record_bytes() as u64;
    Fixture {
        _tmp: tmp,
        model,
        store,
        cfg,
        record,
    }
}

fn path(p: &Path) -> String {
    p.display().to_string()
}

/// `glmflash-node plan --model M --store S ...` as the command parses and plans it.
fn plan_command(f: &Fixture, extra: &[&str]) -> MemoryPlan {
    let mut argv = vec![
        "glmflash-node".to_string(),
        "plan".into(),
        "--model".into(),
        path(&f.model),
        "--store".into(),
        path(&f.store),
    ];
    argv.extend(extra.iter().map(|s| s.to_string()));
    let Command::Plan(args) = Cli::try_parse_from(argv).unwrap().command else {
        unreachable!("plan parses to Command::Plan")
    };
    plan(&args.inputs().unwrap()).unwrap()
}

/// `glmflash-node serve --model M --store S ...`: its model flags and the shape it plans for.
fn serve_command(f: &Fixture, extra: &[&str]) -> (ModelArgs, Shape) {
    let mut argv = vec![
        "glmflash-node".to_string(),
        "serve".into(),
        "--model".into(),
        path(&f.model),
        "--store".into(),
        path(&f.store),
    ];
    argv.extend(extra.iter().map(|s| s.to_string()));
    let Command::Serve { model, serve } = Cli::try_parse_from(argv).unwrap().command else {
        unreachable!("serve parses to Command::Serve")
    };
    let shape = Shape {
        context: serve.context_length,
        batch: serve.max_batch_size,
        chunk: serve.gpu_chunk_size,
    };
    (model, shape)
}

/// A machine with `vram` free (`None`: no GPU) and a cgroup cap, nothing resident.
fn machine(vram: Option<u64>, cap: Option<u64>) -> MachineFacts {
    MachineFacts {
        free_vram: vram,
        memory: MemoryFacts {
            cgroup_limit: cap,
            cgroup_source: cap.map(|_| "test".into()),
            rss: 0,
            memlock_soft: Some(64 << 10),
            memlock_hard: Some(64 << 10),
            mem_available: Some(64 * GIB),
        },
    }
}

fn server_plan(f: &Fixture, flags: &[&str], m: &MachineFacts) -> anyhow::Result<MemoryPlan> {
    let (args, shape) = serve_command(f, flags);
    let mode = args.tier.mode.expect("a tiered mode");
    let source = StoreSource::open(&f.store, &f.model, &f.cfg).unwrap();
    args.memory_plan(&f.cfg, mode, &source, shape, m)
}

/// The test: for the same inputs the server's runtime sizing is `plan`'s, number for
/// number, on boxes where each tier is cut short by its own limit.
#[test]
fn the_servers_sizing_is_plans_for_the_same_inputs() {
    let f = fixture();
    let shape = ["--context-length", "4096", "--max-batch-size", "2"];
    let plan_shape = ["--context", "4096", "--batch", "2"];
    // What the GPU holds before any slot, from an open box.
    let open = plan_command(&f, &[&plan_shape[..], &["--vram-mib", "200000"]].concat());
    assert_eq!(open.vram_expert_slots_per_layer, 16);
    let before_slots = open.vram_weight_bytes
        + open.cache_bytes
        + open.workspace_bytes
        + open.staging_bytes
        + open.vram_reserve_bytes;
    let layer_row = open.moe_layers as u64 * f.record;
    for (vram_mib, ram_slots) in [(6u64, 4u64), (0, 9), (13, 3)] {
        // Free VRAM `vram_mib` over what the GPU holds first (whole MiB, as `--vram-mib`
        // takes it); a cap for `ram_slots` a layer beside what the process holds, the
        // reserve and a prompt chunk's reads of the experts no tier holds (one more slot
        // would need two records more: its own row of 3 less the read it saves).
        let vram_mib = before_slots.div_ceil(MIB) + vram_mib;
        let vram_slots = (vram_mib * MIB - before_slots) / layer_row;
        // (The VRAM residents keep no host copy: what is held does not move with them.)
        let held = open.ram_held_bytes;
        let reads = (16 - vram_slots - ram_slots) * f.record;
        let cap = held + 2048 * MIB + ram_slots * layer_row + reads + f.record / 2;
        let box_flags = [
            "--vram-mib".to_string(),
            vram_mib.to_string(),
            "--ram-limit".into(),
            cap.to_string(),
        ];
        let box_flags: Vec<&str> = box_flags.iter().map(String::as_str).collect();
        let planned = plan_command(&f, &[&plan_shape[..], &box_flags].concat());
        let server = server_plan(
            &f,
            &[&shape[..], &["--mode", "nvme"]].concat(),
            &machine(Some(vram_mib * MIB), Some(cap)),
        )
        .unwrap();
        assert_eq!(server, planned);
        assert_eq!(
            (
                server.vram_expert_slots_per_layer as u64,
                server.ram_expert_slots_per_layer as u64
            ),
            (vram_slots, ram_slots),
            "{}",
            server.table()
        );
        assert_eq!(
            (server.vram_basis, server.ram_basis),
            ("free-vram", "cgroup")
        );
        assert_eq!(server.ram_prompt_reads_bytes, reads);
        assert_eq!(server.record_bytes, f.record);
        assert_eq!(server.store_bytes, 3 * 16 * f.record);
    }
}

/// Flags win over the machine, `fast` / `exact` hold every expert in RAM, no GPU gives the
/// CPU device tier its default, and the server refuses what cannot fit, with the numbers.
#[test]
fn the_servers_sizing_rules() {
    let f = fixture();
    let roomy = machine(Some(100 * GIB), Some(100 * GIB));
    let flags = server_plan(
        &f,
        &["--mode", "nvme", "--vram-slots", "3", "--ram-slots", "20"],
        &roomy,
    )
    .unwrap();
    assert_eq!(
        (
            flags.vram_expert_slots_per_layer,
            flags.ram_expert_slots_per_layer,
            flags.vram_basis,
            flags.ram_basis
        ),
        (3, 16, "flag", "--ram-slots")
    );
    let fast = server_plan(&f, &["--mode", "fast"], &roomy).unwrap();
    assert_eq!(
        (
            fast.vram_expert_slots,
            fast.ram_expert_slots,
            fast.store_only_experts
        ),
        (0, 48, 0)
    );
    // No GPU: the device tier is CPU memory with its default slots, and no VRAM is refused.
    let cpu = server_plan(
        &f,
        &["--mode", "nvme-exact"],
        &machine(None, Some(100 * GIB)),
    )
    .unwrap();
    assert_eq!(
        (cpu.vram_expert_slots_per_layer, cpu.vram_basis),
        (glmflash_node::tiers::plan::CPU_DEVICE_SLOTS, "cpu-default")
    );
    assert!(!cpu.metrics().memory.iter().any(|(k, _)| *k == "vram_free"));
    // A card too small for the dense weights, caches and workspace: refused with the numbers.
    let e = server_plan(&f, &["--mode", "nvme"], &machine(Some(64 * MIB), None))
        .unwrap_err()
        .to_string();
    assert!(e.contains("GPU cannot hold") && e.contains("64 MiB"), "{e}");
    // ... unless the slots are given: then the flags are followed.
    assert!(
        server_plan(
            &f,
            &["--mode", "nvme", "--vram-slots", "1"],
            &machine(Some(64 * MIB), None)
        )
        .is_ok()
    );
    // A cap below the reserve: refused, unless a budget is given.
    let e = server_plan(
        &f,
        &["--mode", "nvme"],
        &machine(Some(100 * GIB), Some(GIB)),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("memory cap") && e.contains("1024 MiB"), "{e}");
    let budget = server_plan(
        &f,
        &["--mode", "nvme", "--ram-budget-mib", "8"],
        &machine(Some(100 * GIB), Some(GIB)),
    )
    .unwrap();
    assert_eq!(budget.ram_basis, "flag");
    assert_eq!(
        budget.ram_expert_slots_per_layer as u64,
        (8 * MIB / f.record / 3).min(16 - budget.vram_expert_slots_per_layer as u64)
    );
}

/// The RAM tier from a cgroup v2 tree on disk: the cap less what the process holds (its
/// resident memory, the dense weights, the VRAM residents' host copies) less the reserve.
#[test]
fn the_ram_tier_is_sized_from_the_cgroup_limit() {
    let f = fixture();
    let cgroup = tempfile::tempdir().unwrap();
    std::fs::write(cgroup.path().join("memory.max"), format!("{}\n", 3 * GIB)).unwrap();
    let m = MachineFacts {
        free_vram: None,
        memory: MemoryFacts::read_at(cgroup.path()),
    };
    assert_eq!(m.memory.cgroup_limit, Some(3 * GIB));
    let p = server_plan(&f, &["--mode", "nvme", "--vram-slots", "2"], &m).unwrap();
    let dense: u64 = p.weights.values().sum();
    let copies = 2 * 3 * f.record;
    assert_eq!(p.ram_held_bytes, m.memory.rss + dense + copies);
    assert_eq!(p.ram_budget_bytes, 3 * GIB - p.ram_held_bytes - 2048 * MIB);
    assert_eq!(p.ram_limit_bytes, Some(3 * GIB));
}

#[test]
fn the_vram_floor_refuses_with_the_numbers() {
    assert_eq!(
        vram_floor_problem("GPU 0", 23_500 * MIB, 24_576 * MIB, 23_000),
        None
    );
    let e = vram_floor_problem("GPU 0", 20_000 * MIB, 24_576 * MIB, 23_000).unwrap();
    assert!(
        e.contains("20000 MiB of VRAM free (of 24576 MiB)") && e.contains("23000 MiB"),
        "{e}"
    );
    assert_eq!(vram_floor_problem("GPU 0", 0, 24_576 * MIB, 0), None);
}

/// `--store-check`: a record whose bytes changed but whose CRC-32C was rewritten to match (so
/// only its sha256 disagrees) is read as it is with the default check, refused with `sha256`,
/// and read with `off`; the server's flag reaches the store reader.
#[test]
fn store_check_flag_picks_the_digest_reads_compare() {
    use glmflash_node::tiers::args::StoreCheck;
    let f = fixture();
    let m = store::Manifest::load(&f.store).unwrap();
    let entry = m.records[5].clone();
    let data = f.store.join(store::DATA);
    let mut bytes = std::fs::read(&data).unwrap();
    let at = entry.offset as usize + 4321;
    bytes[at] ^= 0x20;
    std::fs::write(&data, &bytes).unwrap();
    let mut edited = m.clone();
    let record = &bytes[entry.offset as usize..entry.offset as usize + entry.length];
    edited.records[5].crc32c = Some(store::crc32c(record));
    std::fs::write(
        f.store.join(store::MANIFEST),
        serde_json::to_vec_pretty(&edited).unwrap(),
    )
    .unwrap();
    let load = |check: StoreCheck| {
        StoreSource::open_with(&f.store, &f.model, &f.cfg, check.reader_options())
            .unwrap()
            .load(entry.layer, entry.expert)
            .map(|_| ())
    };
    assert!(load(StoreCheck::Crc32c).is_ok());
    let err = format!("{:#}", load(StoreCheck::Sha256).unwrap_err());
    assert!(err.contains("sha256"), "{err}");
    assert!(load(StoreCheck::Off).is_ok());
    let (model, _) = serve_command(&f, &["--mode", "nvme", "--store-check", "sha256"]);
    assert_eq!(model.tier.store_check, StoreCheck::Sha256);
    let (model, _) = serve_command(&f, &["--mode", "nvme"]);
    assert_eq!(model.tier.store_check, StoreCheck::Crc32c);
}

/// By default the server and `plan` both give the VRAM residents' host copies and the dense
/// weights' to the RAM tier (a victim is copied down from VRAM; the dense weights' host bytes
/// go once loaded); `--vram-host-copies` (or its variable at `1`, as a container sets it)
/// keeps them.
#[test]
fn copying_victims_down_gives_the_ram_tier_the_copies_in_plan_and_server() {
    let f = fixture();
    let gpu = ["--vram-mib", "200000", "--context", "4096", "--batch", "2"];
    let cap = ["--ram-limit", "3GiB"];
    let kept = plan_command(&f, &[&gpu[..], &cap, &["--vram-host-copies"]].concat());
    let down = plan_command(&f, &[&gpu[..], &cap].concat());
    assert!(kept.ram_device_copies_bytes > 0);
    assert_eq!(down.ram_device_copies_bytes, 0);
    assert_eq!(kept.ram_dense_given_back_bytes, 0);
    assert!(down.ram_dense_given_back_bytes > 0);
    let given = kept.ram_device_copies_bytes + down.ram_dense_given_back_bytes;
    assert_eq!(kept.ram_held_bytes - down.ram_held_bytes, given);
    assert_eq!(down.ram_budget_bytes - kept.ram_budget_bytes, given);
    let serve = |flags: &[&str]| {
        server_plan(
            &f,
            &[
                &[
                    "--context-length",
                    "4096",
                    "--max-batch-size",
                    "2",
                    "--mode",
                    "nvme",
                ],
                flags,
            ]
            .concat(),
            &machine(Some(200_000 * MIB), Some(3 * GIB)),
        )
        .unwrap()
    };
    assert_eq!(
        (
            serve(&[]).ram_device_copies_bytes,
            serve(&[]).ram_dense_given_back_bytes
        ),
        (0, down.ram_dense_given_back_bytes)
    );
    let serve_kept = serve(&["--vram-host-copies"]);
    assert_eq!(
        (
            serve_kept.ram_device_copies_bytes,
            serve_kept.ram_dense_given_back_bytes
        ),
        (kept.ram_device_copies_bytes, 0)
    );
    // The variable as containers set it ("1"; clap's plain bool flags take only true/false).
    let json = |env: &str| {
        node::json(
            node::node([
                "plan",
                "--json",
                "--model",
                &path(&f.model),
                "--store",
                &path(&f.store),
            ])
            .args(gpu)
            .args(cap)
            .env("GLMFLASH_VRAM_HOST_COPIES", env),
        )
    };
    let off = json("0");
    assert_eq!(off["ram_device_copies_bytes"], 0, "{off}");
    assert_eq!(
        off["ram_expert_slots_per_layer"],
        down.ram_expert_slots_per_layer as u64
    );
    assert_eq!(
        json("1")["ram_expert_slots_per_layer"],
        kept.ram_expert_slots_per_layer as u64
    );
}
