//! `glmflash-node plan`: the memory plan for a model on a box, from flags.

use super::weights::Storage;
use super::{Bandwidths, GLM_5_3_FLASH_CONFIG, PlanInputs, Shape};
use crate::model::config::Config;
use crate::model::device::CacheDtype;
use crate::tiers::plan::{MachineFacts, SlotRequest};
use crate::tiers::source::ExpertSource;
use anyhow::Context;
use std::path::{Path, PathBuf};

/// What fits where: VRAM, RAM and store for a model on a box, before a byte is downloaded.
#[derive(clap::Args, Debug, Clone)]
pub struct PlanArgs {
    /// A model directory: its config.json, and its formats from `quantization_config`
    /// (EXL3) or the safetensors' dtype.
    #[arg(long, env = "GLMFLASH_MODEL", conflicts_with = "config")]
    pub model: Option<PathBuf>,
    /// A config.json alone (no weights needed). Default, without --model: GLM-5.3-Flash's.
    #[arg(long, env = "GLMFLASH_PLAN_CONFIG")]
    pub config: Option<PathBuf>,
    /// The packed expert store the server will read (with --model): records sized as it
    /// holds them, as the server sizes its tiers.
    #[arg(long, env = "GLMFLASH_STORE", requires = "model")]
    pub store: Option<PathBuf>,
    /// The routed experts' format: f32, bf16, f16, q8_0, q4_k or exl3:BITS (e.g. exl3:3). An
    /// EXL3 average that is no trellis rate (exl3:3.05) gets VRAM slots of the rate above.
    /// Default: the checkpoint's, else exl3:3 (GLM-5.3-Flash EXL3 3.05 bpw's experts).
    #[arg(long, env = "GLMFLASH_EXPERT_FORMAT", value_parser = Storage::parse)]
    pub expert_format: Option<Storage>,
    /// The other linear weights' format (same names). Default: the checkpoint's, else the
    /// experts' format when given, else exl3:3.05.
    #[arg(long, env = "GLMFLASH_DENSE_FORMAT", value_parser = Storage::parse)]
    pub dense_format: Option<Storage>,
    /// The output projection's format. Default: exl3:6 for EXL3 (exllamav3's head bits),
    /// else the dense format.
    #[arg(long, env = "GLMFLASH_HEAD_FORMAT", value_parser = Storage::parse)]
    pub head_format: Option<Storage>,
    /// VRAM free when the server starts, MiB (an RTX 3090: 24,576 less what the desktop holds).
    #[arg(long, env = "GLMFLASH_PLAN_VRAM_MIB", default_value_t = 24_576)]
    pub vram_mib: u64,
    /// VRAM left free beside what the plan counts (cuBLAS, fragmentation), MiB.
    #[arg(long, env = "GLMFLASH_VRAM_RESERVE_MIB", default_value_t = 512)]
    pub vram_reserve_mib: u64,
    /// The container's memory cap, as the cgroup would set it (e.g. 55GiB, 60000MiB, bytes).
    /// Default: no cap (then --ram-available).
    #[arg(long, env = "GLMFLASH_RAM_LIMIT", value_parser = parse_bytes)]
    pub ram_limit: Option<u64>,
    /// Host memory available when there is no cap.
    #[arg(long, env = "GLMFLASH_PLAN_RAM_AVAILABLE", value_parser = parse_bytes, default_value = "64GiB")]
    pub ram_available: u64,
    /// Host memory kept outside the RAM tier, MiB.
    #[arg(long, env = "GLMFLASH_RAM_RESERVE_MIB", default_value_t = 2048)]
    pub ram_reserve_mib: u64,
    /// The server's --vram-host-copies: every VRAM resident and the dense weights keep a host
    /// copy, which the RAM tier then does not get (by default a victim is copied down from
    /// VRAM instead, and the dense weights' host bytes are given back once loaded).
    #[arg(long, env = "GLMFLASH_VRAM_HOST_COPIES", value_parser = clap::builder::BoolishValueParser::new())]
    pub vram_host_copies: bool,
    /// Tokens of cache, shared by the batch (the seed runs 131,072 with batch 8).
    #[arg(long, env = "GLMFLASH_CONTEXT_LENGTH", default_value_t = 131_072)]
    pub context: usize,
    /// Sequences at once (each keeps its own KDA state).
    #[arg(long, env = "GLMFLASH_MAX_BATCH_SIZE", default_value_t = 8)]
    pub batch: usize,
    /// How the MLA latents and DSA indexer keys are cached: f32, or bf16 / f16 at half the
    /// bytes (the serving flag of the same name).
    #[arg(long, env = "GLMFLASH_CACHE_DTYPE", value_enum, default_value = "f32")]
    pub cache_dtype: CacheDtype,
    /// Prompt-chunk rows of the GPU forward (its workspace grows with them).
    #[arg(long, env = "GLMFLASH_GPU_CHUNK_SIZE", default_value_t = crate::model::decoder::DEFAULT_GPU_CHUNK)]
    pub gpu_chunk_size: usize,
    /// GPU memory bandwidth, GB/s.
    #[arg(long, default_value_t = Bandwidths::RTX_3090_BOX.hbm)]
    pub hbm_gbs: f64,
    /// Host-to-device bandwidth, GB/s.
    #[arg(long, default_value_t = Bandwidths::RTX_3090_BOX.h2d)]
    pub h2d_gbs: f64,
    /// Host memory bandwidth as the CPU lane reads it, GB/s.
    #[arg(long, default_value_t = Bandwidths::RTX_3090_BOX.ram)]
    pub ram_gbs: f64,
    /// The store disk's O_DIRECT read rate, GB/s.
    #[arg(long, default_value_t = Bandwidths::RTX_3090_BOX.nvme)]
    pub nvme_gbs: f64,
    /// One JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// `123`, `55GiB`, `60000MiB`, `64GB`, `1.5TiB` (binary and decimal units, case-insensitive).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{s:?}: expected a size such as 55GiB, 60000MiB or bytes"))?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "ki" | "kib" => 1024.0,
        "mi" | "mib" => (1u64 << 20) as f64,
        "gi" | "gib" => (1u64 << 30) as f64,
        "ti" | "tib" => (1u64 << 40) as f64,
        other => {
            return Err(format!(
                "{s:?}: unknown unit {other:?} (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
            ));
        }
    };
    Ok((value * scale) as u64)
}

/// The formats a checkpoint declares: EXL3 from `quantization_config` (in config.json or
/// beside it), else the safetensors dtype of its output projection.
struct Declared {
    dense: Option<Storage>,
    head: Option<Storage>,
    experts: Option<Storage>,
}

fn declared(dir: &Path) -> anyhow::Result<Declared> {
    let read = |name: &str| -> anyhow::Result<Option<serde_json::Value>> {
        let path = dir.join(name);
        if !path.exists() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
        Ok(Some(
            serde_json::from_str(&text).with_context(|| path.display().to_string())?,
        ))
    };
    let config = read("config.json")?.unwrap_or_default();
    let listed = read("quantization_config.json")?;
    let quant = config
        .get("quantization_config")
        .cloned()
        .or(listed.clone());
    if let Some(q) =
        quant.filter(|q| q.get("quant_method").and_then(|m| m.as_str()) == Some("exl3"))
    {
        let bits = q
            .get("bits")
            .and_then(|b| b.as_f64())
            .context("quantization_config: exl3 without a numeric `bits`")?;
        let head = q.get("head_bits").and_then(|b| b.as_f64()).unwrap_or(6.0);
        let experts = listed.as_ref().and_then(expert_bits).unwrap_or(bits);
        return Ok(Declared {
            dense: Some(Storage::Exl3 { bits }),
            head: Some(Storage::Exl3 { bits: head }),
            experts: Some(Storage::Exl3 { bits: experts }),
        });
    }
    let dtype = crate::model::checkpoint::Checkpoint::open(dir)
        .ok()
        .and_then(|c| c.view("lm_head.weight").ok().map(|v| v.dtype));
    let rows = dtype.and_then(|d| crate::quant::Format::from_name(d.name()).ok());
    let storage = rows.map(Storage::Rows);
    Ok(Declared {
        dense: storage,
        head: storage,
        experts: storage,
    })
}

/// The formats flags ask for, else the checkpoint's, else GLM-5.3-Flash's EXL3 3.05 bpw
/// checkpoint's: experts at 3 bpw (a trellis has a whole or half-integer rate; the 3.05
/// average comes from the higher-rate attention and shared experts), the rest at 3.05. The
/// dense format defaults to the experts' when those are given; the head to exllamav3's 6
/// bits for EXL3, else the dense format.
fn formats(
    found: Declared,
    experts: Option<Storage>,
    dense: Option<Storage>,
    head: Option<Storage>,
) -> (Storage, Storage, Storage) {
    let (experts, dense) = match (experts.or(found.experts), dense.or(found.dense)) {
        (Some(e), d) => (e, d.unwrap_or(e)),
        (None, d) => (
            Storage::Exl3 { bits: 3.0 },
            d.unwrap_or(Storage::Exl3 { bits: 3.05 }),
        ),
    };
    let head = head.or(found.head).unwrap_or(match dense {
        Storage::Exl3 { .. } => Storage::Exl3 { bits: 6.0 },
        other => other,
    });
    (experts, dense, head)
}

/// The plan's inputs for the checkpoint in `dir` as the server runs it on `machine`: its
/// declared formats (as `plan --model DIR` reads them), the records and VRAM slots of the
/// source it reads experts from, and the reserves of `request`; caches in `cache_dtype`.
pub fn checkpoint_inputs(
    dir: &Path,
    cfg: Config,
    source: &dyn ExpertSource,
    shape: Shape,
    cache_dtype: CacheDtype,
    machine: &MachineFacts,
    request: &SlotRequest,
) -> anyhow::Result<PlanInputs> {
    let (experts, dense, head) = formats(declared(dir)?, None, None, None);
    let slot_bytes = crate::tiers::vram::source_layout(source, &cfg)?.slot_bytes as u64;
    Ok(PlanInputs {
        cfg,
        dense,
        head,
        experts,
        record_bytes: Some(source.record_bytes() as u64),
        slot_bytes: Some(slot_bytes),
        vram: machine.free_vram.unwrap_or(0),
        vram_reserve: request.vram_reserve,
        ram_limit: machine.memory.cgroup_limit,
        ram_available: machine.memory.mem_available,
        ram_reserve: request.ram_reserve,
        copy_down: request.copy_down,
        context: shape.context,
        batch: shape.batch,
        cache_dtype,
        chunk: shape.chunk,
        bandwidths: Bandwidths::RTX_3090_BOX,
    })
}

/// The highest rate of the routed experts in `quantization_config.json`'s `tensor_storage`
/// (exllamav3 lists every quantized module with its `bits_per_weight`): the store sizes every
/// record for its largest layer, and a checkpoint's average `bits` is no rate a trellis has.
fn expert_bits(listed: &serde_json::Value) -> Option<f64> {
    listed
        .get("tensor_storage")?
        .as_object()?
        .iter()
        .filter(|(module, _)| module.contains(".mlp.experts."))
        .filter_map(|(_, m)| m.get("bits_per_weight")?.as_f64())
        .reduce(f64::max)
}

impl PlanArgs {
    pub fn inputs(&self) -> anyhow::Result<PlanInputs> {
        let (cfg, found) = match (&self.model, &self.config) {
            (Some(dir), _) => (
                Config::from_file(&dir.join("config.json"))
                    .with_context(|| format!("--model {}", dir.display()))?,
                declared(dir)?,
            ),
            (None, Some(path)) => (
                Config::from_file(path).with_context(|| format!("--config {}", path.display()))?,
                Declared {
                    dense: None,
                    head: None,
                    experts: None,
                },
            ),
            (None, None) => (
                Config::from_json(&serde_json::from_str(GLM_5_3_FLASH_CONFIG)?)?,
                Declared {
                    dense: None,
                    head: None,
                    experts: None,
                },
            ),
        };
        // A store's records, and the VRAM slots the tier lays them out in.
        let (record_bytes, slot_bytes) = match (&self.store, &self.model) {
            (Some(store), Some(dir)) => {
                let source = crate::tiers::source::StoreSource::open(store, dir, &cfg)
                    .with_context(|| format!("--store {}", store.display()))?;
                let layout = crate::tiers::vram::source_layout(&source, &cfg)
                    .with_context(|| format!("--store {}", store.display()))?;
                (
                    Some(source.record_bytes() as u64),
                    Some(layout.slot_bytes as u64),
                )
            }
            _ => (None, None),
        };
        let (experts, dense, head) = formats(
            found,
            self.expert_format,
            self.dense_format,
            self.head_format,
        );
        Ok(PlanInputs {
            cfg,
            dense,
            head,
            experts,
            record_bytes,
            slot_bytes,
            vram: self.vram_mib << 20,
            vram_reserve: self.vram_reserve_mib << 20,
            ram_limit: self.ram_limit,
            ram_available: Some(self.ram_available),
            ram_reserve: self.ram_reserve_mib << 20,
            copy_down: !self.vram_host_copies,
            context: self.context,
            batch: self.batch,
            cache_dtype: self.cache_dtype,
            chunk: self.gpu_chunk_size,
            bandwidths: Bandwidths {
                hbm: self.hbm_gbs,
                h2d: self.h2d_gbs,
                ram: self.ram_gbs,
                nvme: self.nvme_gbs,
            },
        })
    }
}

/// Prints the plan (table or JSON); fails with the numbers when nothing fits.
pub fn run(args: &PlanArgs) -> anyhow::Result<()> {
    use std::io::Write;
    let plan = super::plan(&args.inputs()?)?;
    let text = if args.json {
        serde_json::to_string_pretty(&plan)? + "\n"
    } else {
        plan.table()
    };
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        // A reader that stops early (`| head`) is not an error of the plan.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => Ok(other?),
    }
}
