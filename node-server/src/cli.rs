//! The `glmflash-node` command line: clap definitions (the operator parses its rendered
//! container args with these in its tests) and model loading from the flags.

use crate::api::server::ServeArgs;
use crate::backend::Device;
use crate::model::Model;
use crate::tiers::args::TierArgs;
use crate::tiers::history::RoutingHistory;
use crate::tiers::provider::{
    CheckpointSource, ExpertSource, Mode, StoreSource, TierCaps, TieredExperts,
};
use crate::{bench, demo};
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Parser)]
#[command(
    name = "glmflash-node",
    version,
    about = "GLM-5.3-Flash inference pod: engine, expert tiers and tools",
    long_about = "GLM-5.3-Flash inference pod.\n\nRuns glm5_next checkpoints on the CPU (CUDA and the expert tiers come in later releases). \
                  Every flag can also be set through the environment variable shown in its help."
)]
pub struct Cli {
    /// Log format: `text` for terminals, `json` for containers.
    #[arg(
        long,
        env = "GLMFLASH_LOG_FORMAT",
        default_value = "text",
        global = true
    )]
    pub log_format: String,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Make the demo model (if missing) in the cache dir and serve it through the OpenAI API.
    Demo {
        /// Where the demo model lives (default: $GLMFLASH_CACHE_DIR/demo-model or ~/.cache/glmflash/demo-model).
        #[arg(long, env = "GLMFLASH_DEMO_DIR")]
        dir: Option<PathBuf>,
        #[command(flatten)]
        serve: ServeArgs,
    },
    /// Serve a checkpoint through the OpenAI-compatible API (chat, completions, SSE, metrics).
    Serve {
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        serve: ServeArgs,
    },
    /// Write the deterministic demo model (random weights, real tokenizer, chat template).
    MakeDemoModel {
        /// Output directory.
        #[arg(long, env = "GLMFLASH_OUT")]
        out: PathBuf,
        /// Seed of the random weights.
        #[arg(long, env = "GLMFLASH_SEED", default_value_t = demo::DEFAULT_SEED)]
        seed: u64,
    },
    /// Print the last prompt position's logits and a cached greedy continuation as JSON.
    Logits {
        #[command(flatten)]
        model: ModelArgs,
        /// Prompt token ids, comma-separated.
        #[arg(long, env = "GLMFLASH_TOKENS", value_delimiter = ',', required = true)]
        tokens: Vec<u32>,
        /// Greedy tokens to generate after the prompt.
        #[arg(long, env = "GLMFLASH_GREEDY", default_value_t = 0)]
        greedy: usize,
        /// Also save every named intermediate of the prompt pass to this safetensors file
        /// (compare with e2e/dump_reference.py + e2e/compare_dumps.py).
        #[arg(long, env = "GLMFLASH_DUMP")]
        dump: Option<PathBuf>,
    },
    /// Generate text for a prompt, streaming tokens to the terminal, then print tok/s.
    Generate {
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        generation: GenerationArgs,
    },
    /// Rewrite a checkpoint with its routed experts in a block format (e.g. q4_k).
    ConvertExperts {
        /// Source checkpoint directory.
        #[arg(long, env = "GLMFLASH_MODEL")]
        model: PathBuf,
        /// Output directory (a complete checkpoint).
        #[arg(long, env = "GLMFLASH_OUT")]
        out: PathBuf,
        /// Target format: q4_k, q8_0, bf16, f16 or f32.
        #[arg(long, env = "GLMFLASH_EXPERT_FORMAT", default_value = "q4_k")]
        format: String,
    },
    /// Run the acceptance gates (load, chat, reasoning, tools, context, speed) against a server.
    Gates(crate::gates::GatesArgs),
    /// Measure CPU prefill and decode speed on a random model of the given shape.
    Bench(bench::BenchArgs),
    /// Check every CUDA kernel against the CPU backend on fresh random inputs (needs a GPU).
    CudaCheck(crate::cuda_check::CudaCheckArgs),
    /// Download a checkpoint (safetensors, config, tokenizer) from the Hugging Face Hub:
    /// resumable, hash-checked, `HF_ENDPOINT` honoured.
    Download(crate::download::DownloadArgs),
    /// Pack every routed expert into the O_DIRECT expert store (resumable, idempotent), then verify it.
    PackStore {
        /// Source checkpoint directory.
        #[arg(long, env = "GLMFLASH_MODEL")]
        model: PathBuf,
        /// Store directory (experts.bin + experts.json), on a disk filesystem with O_DIRECT.
        #[arg(long, env = "GLMFLASH_STORE")]
        store: PathBuf,
        /// Records compared byte for byte with the source after packing.
        #[arg(long, env = "GLMFLASH_VERIFY_SAMPLE", default_value_t = 300)]
        verify_sample: usize,
        /// Skip the verification pass after packing.
        #[arg(long, env = "GLMFLASH_NO_VERIFY")]
        no_verify: bool,
        /// Test hook: sleep this many milliseconds after each record.
        #[arg(long, env = "GLMFLASH_PACK_THROTTLE_MS", hide = true)]
        pack_throttle_ms: Option<u64>,
        /// Bytes written per batch (whole records, at least one).
        #[arg(long, env = "GLMFLASH_PACK_BATCH_BYTES", default_value_t = 64 << 20, hide = true)]
        pack_batch_bytes: usize,
        /// Test hook: skip the free-space check.
        #[arg(long, env = "GLMFLASH_PACK_SKIP_SPACE_CHECK", hide = true)]
        pack_skip_space_check: bool,
        /// Also write `{"storeBytes": N, "records": N, "fingerprint": "..."}` to this file
        /// (the operator passes the pod's termination-message path and copies it to status).
        #[arg(long, env = "GLMFLASH_PACK_REPORT")]
        report: Option<PathBuf>,
        /// Weight format of the records: bf16, q8_0 or q4_k (default: as the checkpoint
        /// stores the experts). Quantizing packs a bf16 checkpoint's experts at 4.5 bits per
        /// weight (q4_k) or 8.5 (q8_0), the same bytes `convert-experts` writes.
        #[arg(long, env = "GLMFLASH_PACK_FORMAT", value_parser = parse_format)]
        format: Option<crate::quant::Format>,
    },
    /// Check every record of an expert store (sha256 with O_DIRECT reads); with --model also the
    /// model fingerprint and a byte compare of a sample against the source.
    VerifyStore {
        /// Source checkpoint directory (optional: without it only checksums are checked).
        #[arg(long, env = "GLMFLASH_MODEL")]
        model: Option<PathBuf>,
        #[arg(long, env = "GLMFLASH_STORE")]
        store: PathBuf,
        #[arg(long, env = "GLMFLASH_VERIFY_SAMPLE", default_value_t = 300)]
        verify_sample: usize,
    },
}

#[derive(Args)]
pub struct ModelArgs {
    /// Checkpoint directory: config.json, safetensors, tokenizer files.
    #[arg(long, env = "GLMFLASH_MODEL")]
    pub model: PathBuf,
    /// Expert residency: fast/exact (all experts in RAM) or nvme/nvme-exact (tiered).
    #[arg(long, env = "GLMFLASH_MODE", value_enum)]
    pub mode: Option<Mode>,
    /// Device-tier expert slots per MoE layer (tiered modes). Default: on a GPU, sized from
    /// the free VRAM left after the dense weights and --vram-reserve-mib; without a GPU
    /// (the device tier is then CPU memory) 4.
    #[arg(
        long,
        env = "GLMFLASH_VRAM_SLOTS",
        conflicts_with = "vram_expert_slots"
    )]
    pub vram_slots: Option<usize>,
    /// Device-tier expert slots in all, spread evenly over the MoE layers (the seed's "about
    /// 1,300 experts in VRAM"); instead of --vram-slots.
    #[arg(long, env = "GLMFLASH_VRAM_EXPERT_SLOTS")]
    pub vram_expert_slots: Option<usize>,
    /// VRAM left free when the tier is sized from free VRAM, for the sequences' caches (the
    /// GPU forward keeps them there) and cuBLAS (MiB). The GPU forward's activations for a
    /// default prompt chunk (`--gpu-chunk-size`), estimated from the model's widths, are kept
    /// free on top of this.
    #[arg(long, env = "GLMFLASH_VRAM_RESERVE_MIB", default_value_t = 1024)]
    pub vram_reserve_mib: u64,
    /// Refuse to start on a GPU with less free VRAM than this (MiB; the seed refuses under
    /// 23,000 for the real model). 0: no floor.
    #[arg(long, env = "GLMFLASH_MIN_FREE_VRAM_MIB", default_value_t = 0)]
    pub min_free_vram_mib: u64,
    /// RAM-tier expert slots per MoE layer (tiered modes); default: sized from the memory
    /// limit (see --ram-budget-mib).
    #[arg(long, env = "GLMFLASH_RAM_SLOTS")]
    pub ram_slots: Option<usize>,
    /// Packed expert store (from `pack-store`) that expert misses are read from; without it
    /// a tiered mode reads misses from the checkpoint.
    #[arg(long, env = "GLMFLASH_STORE")]
    pub store: Option<PathBuf>,
    /// Routing history file: loaded at start to warm the tiers, written at exit.
    #[arg(long, env = "GLMFLASH_HISTORY")]
    pub history: Option<PathBuf>,
    /// Turn off layer-ahead prefetch of predicted experts.
    #[arg(long, env = "GLMFLASH_NO_PREFETCH")]
    pub no_prefetch: bool,
    #[command(flatten)]
    pub tier: TierArgs,
    #[command(flatten)]
    pub device: crate::backend::DeviceArgs,
}

/// Lookups per layer between halvings of the LFU counts.
pub const AGING_PERIOD: u64 = 4096;

impl ModelArgs {
    /// The model with its experts served as the flags ask (untiered when no --mode).
    pub fn load(&self) -> anyhow::Result<(Model, Option<Arc<TieredExperts>>)> {
        let (model, tiers, _) = self.load_serving()?;
        Ok((model, tiers))
    }

    /// As [`ModelArgs::load`], also giving the all-in-VRAM experts (`--device cuda` without
    /// `--mode`) whose counters the metrics registry reads.
    pub fn load_serving(&self) -> anyhow::Result<LoadedModel> {
        crate::tiers::args::log_cpu_lane();
        let device = self.device.open()?;
        if let Device::Cuda(cuda) = &device {
            check_vram_floor(cuda, self.min_free_vram_mib)?;
        }
        let cfg = crate::model::config::Config::from_file(&self.model.join("config.json"))?;
        let moe = cfg.moe_layers();
        let Some(mode) = self.mode else {
            return match device {
                Device::Cpu => Ok((Model::load(&self.model)?, None, None)),
                Device::Cuda(cuda) => {
                    let (model, vram) = crate::tiers::vram::load_model_on_gpu(&self.model, cuda)?;
                    Ok((model, None, Some(vram)))
                }
            };
        };
        let source: Arc<dyn ExpertSource> = match &self.store {
            Some(store) => {
                let s = StoreSource::open(store, &self.model, &cfg)?;
                tracing::info!(
                    engine = s.engine_name(),
                    "experts served from the packed store"
                );
                Arc::new(s)
            }
            None => Arc::new(CheckpointSource::open(&self.model)?),
        };
        let moe_layers = moe.iter().filter(|&&m| m).count();
        let record = source.record_bytes() as u64;
        // The non-expert weights load after sizing: count them as held already.
        let dense = checkpoint_bytes(&self.model)
            .saturating_sub(moe_layers as u64 * cfg.n_routed_experts as u64 * record);
        let device_slots = match (self.vram_slots, self.vram_expert_slots, &device) {
            (Some(n), _, _) => n,
            (None, Some(total), _) => total / moe_layers.max(1),
            (None, None, Device::Cpu) => 4,
            (None, None, Device::Cuda(cuda)) => {
                let (free, _) = cuda.mem_info()?;
                vram_slots_from_free(
                    free as u64,
                    dense,
                    (self.vram_reserve_mib << 20)
                        + crate::backend::cuda::decode::workspace_bytes(
                            &cfg,
                            crate::backend::cuda::decode::DEFAULT_GPU_CHUNK,
                            cfg.max_position_embeddings,
                        ) as u64,
                    record,
                    moe_layers,
                    cfg.n_routed_experts,
                )
            }
        };
        let device_slots = device_slots.min(cfg.n_routed_experts);
        // The device tier's residents keep their host copy (for the CPU lane, and to go down
        // to RAM through the write-back ring when evicted): count those bytes as held too.
        let device_copies = device_slots as u64 * moe_layers as u64 * record;
        let caps = TierCaps {
            device_slots_per_layer: device_slots,
            ram_slots_per_layer: self.tier.prepare(
                mode,
                self.ram_slots,
                dense + device_copies,
                record,
                moe_layers,
                cfg.n_routed_experts,
            ),
        };
        let tiers = TieredExperts::with_tuning(
            source,
            cfg.hidden_size,
            cfg.n_routed_experts,
            &moe,
            mode,
            caps,
            AGING_PERIOD,
            !self.no_prefetch,
            self.tier.tuning(),
        )?;
        let tiers = Arc::new(match &device {
            Device::Cpu => tiers,
            Device::Cuda(cuda) => tiers.with_gpu(cuda.clone(), &moe)?,
        });
        if let Some(path) = &self.history {
            let fingerprint = crate::store::quick_fingerprint(&self.model)?;
            match RoutingHistory::load(path, &fingerprint, moe.len(), cfg.n_routed_experts) {
                Some(h) => {
                    let loaded = tiers.warm_start(&h, AGING_PERIOD)?;
                    tracing::info!(path = %path.display(), loaded, "tiers warm-started from the routing history");
                }
                None => {
                    tracing::info!(path = %path.display(), "no usable routing history; starting cold")
                }
            }
        }
        let model = match device {
            Device::Cpu => Model::load_with(&self.model, Some(tiers.clone()))?,
            Device::Cuda(cuda) => {
                crate::tiers::vram::load_dense_on_gpu(&self.model, tiers.clone(), cuda)?
            }
        };
        Ok((model, Some(tiers), None))
    }
}

/// A model, its expert tiers (with `--mode`) and its all-in-VRAM experts (`--device cuda`
/// without `--mode`).
pub type LoadedModel = (
    Model,
    Option<Arc<TieredExperts>>,
    Option<Arc<crate::tiers::vram::VramExperts>>,
);

fn parse_format(s: &str) -> Result<crate::quant::Format, String> {
    crate::quant::Format::from_name(s).map_err(|e| e.to_string())
}

/// Refuses a GPU with less free VRAM than `floor_mib`, printing the numbers.
fn check_vram_floor(cuda: &crate::backend::cuda::Cuda, floor_mib: u64) -> anyhow::Result<()> {
    let (free, total) = cuda.mem_info()?;
    let free_mib = free as u64 >> 20;
    if free_mib < floor_mib {
        anyhow::bail!(
            "{}: {free_mib} MiB of VRAM free (of {} MiB), below the floor of {floor_mib} MiB              (--min-free-vram-mib); free the GPU of other processes or lower the floor",
            cuda.describe(),
            total >> 20
        );
    }
    Ok(())
}

/// Device-tier slots per MoE layer that fit in `free` bytes of VRAM after the dense weights
/// (`dense`, as the checkpoint stores them), `reserve` and the staging slots.
fn vram_slots_from_free(
    free: u64,
    dense: u64,
    reserve: u64,
    record: u64,
    moe_layers: usize,
    experts: usize,
) -> usize {
    let staging = 16 * record;
    let left = free.saturating_sub(dense + reserve + staging);
    let slots = (left / (record * moe_layers.max(1) as u64).max(1)) as usize;
    let slots = slots.min(experts);
    tracing::info!(
        free_mib = free >> 20,
        dense_mib = dense >> 20,
        reserve_mib = reserve >> 20,
        record_kib = record >> 10,
        moe_layers,
        slots_per_layer = slots,
        "VRAM tier sized from free VRAM"
    );
    slots
}

/// Bytes of the checkpoint's safetensors files.
fn checkpoint_bytes(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum()
}

#[derive(Args)]
pub struct GenerationArgs {
    /// The user message (rendered with the model's chat template unless --raw).
    #[arg(long, env = "GLMFLASH_PROMPT")]
    pub prompt: String,
    /// Feed the prompt as plain text, without the chat template.
    #[arg(long, env = "GLMFLASH_RAW")]
    pub raw: bool,
    #[arg(long, env = "GLMFLASH_MAX_TOKENS", default_value_t = 128)]
    pub max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, env = "GLMFLASH_TEMPERATURE", default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, env = "GLMFLASH_TOP_P", default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, env = "GLMFLASH_SEED", default_value_t = 0)]
    pub seed: u64,
}

#[cfg(test)]
mod tests {
    use super::vram_slots_from_free;

    #[test]
    fn vram_slots_fill_what_the_dense_weights_reserve_and_staging_leave() {
        let mib = 1u64 << 20;
        // 24,000 MiB free, 9,000 dense, 1,024 reserve, 16 staging records of 14 MiB:
        // 13,752 MiB left for 42 layers of 14 MiB records -> 23 per layer.
        assert_eq!(
            vram_slots_from_free(24_000 * mib, 9_000 * mib, 1024 * mib, 14 * mib, 42, 288),
            23
        );
        // Never more than the layer's experts, never negative.
        assert_eq!(vram_slots_from_free(1 << 40, 0, 0, 14 * mib, 1, 288), 288);
        assert_eq!(
            vram_slots_from_free(mib, 9_000 * mib, 0, 14 * mib, 42, 288),
            0
        );
    }
}
