//! The `glmflash-node` command line: clap definitions (the operator parses its rendered
//! container args with these in its tests) and model loading from the flags.

use crate::api::server::ServeArgs;
use crate::backend::Device;
use crate::demo;
use crate::model::Model;
use crate::model::config::Config;
use crate::model::device::CacheDtype;
use crate::plan::{MemoryPlan, Shape};
use crate::tiers::args::TierArgs;
use crate::tiers::plan::{MachineFacts, Placement};
use crate::tiers::provider::TieredExperts;
use crate::tiers::source::{CheckpointSource, ExpertSource, StoreSource};
use crate::tiers::vram::VramExperts;
use crate::tools::{bench, cuda_check, gates};
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Parser)]
#[command(
    name = "glmflash-node",
    version,
    about = "GLM-5.3-Flash inference pod: engine, expert tiers and tools",
    long_about = "GLM-5.3-Flash inference pod.\n\nRuns glm5_next checkpoints on the CPU or a CUDA GPU, with the routed experts \
                  in VRAM, in RAM or tiered over VRAM, pinned RAM and a packed NVMe store. \
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
        /// Also the other linear weights (attention, KDA, shared experts, dense MLPs, the
        /// head; not the embedding, norms, router or mHC) in this format: q8_0 or q4_k put a
        /// bf16 checkpoint's non-expert weights in the VRAM a 24 GB card has (`plan` shows it).
        #[arg(long, env = "GLMFLASH_DENSE_FORMAT")]
        dense_format: Option<String>,
    },
    /// Run the acceptance gates (load, chat, reasoning, tools, context, speed) against a server.
    Gates(gates::GatesArgs),
    /// Measure CPU prefill and decode speed on a random model of the given shape.
    Bench(bench::BenchArgs),
    /// Check every CUDA kernel against the CPU backend on fresh random inputs (needs a GPU).
    CudaCheck(cuda_check::CudaCheckArgs),
    /// What fits where: VRAM, RAM and store for a model on a box (default: GLM-5.3-Flash as
    /// EXL3 3.05 bpw on an RTX 3090), before a byte is downloaded.
    Plan(crate::plan::args::PlanArgs),
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
        /// Weight format of the records: exl3, bf16, q8_0 or q4_k (default: as the
        /// checkpoint stores the experts; exl3 for an EXL3 checkpoint, whose trellis, suh and
        /// svh are kept byte for byte). Quantizing packs a bf16 checkpoint's experts at 4.5
        /// bits per weight (q4_k) or 8.5 (q8_0), the same bytes `convert-experts` writes; an
        /// EXL3 checkpoint's experts can be converted to those too.
        #[arg(long, env = "GLMFLASH_PACK_FORMAT", value_parser = crate::store::RecordFormat::parse)]
        format: Option<crate::store::RecordFormat>,
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
    /// Packed expert store (from `pack-store`) that expert misses are read from; without it
    /// a tiered mode reads misses from the checkpoint.
    #[arg(long, env = "GLMFLASH_STORE")]
    pub store: Option<PathBuf>,
    #[command(flatten)]
    pub tier: TierArgs,
    #[command(flatten)]
    pub device: crate::backend::DeviceArgs,
    /// How the sequences' MLA latents and DSA indexer keys are cached, on the host and the
    /// GPU: f32, or bf16 / f16 at half the bytes (rounded when stored, read back as f32;
    /// BENCHMARKS.md states the logits' change). The cache budget and the memory plan count
    /// the dtype's bytes.
    #[arg(long, env = "GLMFLASH_CACHE_DTYPE", value_enum, default_value = "f32")]
    pub cache_dtype: CacheDtype,
}

/// A loaded model, where its routed experts are served from, and the memory plan the tiers
/// follow (tiered modes).
pub struct Loaded {
    pub model: Model,
    pub experts: ServedExperts,
    pub plan: Option<MemoryPlan>,
}

/// The routed experts as the placement put them (their metrics and summary differ).
#[derive(Clone)]
pub enum ServedExperts {
    /// In host memory, computed on the CPU.
    Host,
    /// Every one in VRAM.
    Vram(Arc<VramExperts>),
    Tiered(Arc<TieredExperts>),
}

impl ServedExperts {
    /// Lets the registry read these experts' counters at each scrape.
    pub fn attach_metrics(&self, metrics: &crate::metrics::Metrics) -> anyhow::Result<()> {
        match self {
            ServedExperts::Host => Ok(()),
            ServedExperts::Vram(v) => {
                let v = v.clone();
                Ok(metrics.attach_tiers(move || v.metrics_snapshot())?)
            }
            ServedExperts::Tiered(t) => {
                let t = t.clone();
                Ok(metrics.attach_tiers(move || crate::tiers::args::metrics_snapshot(&t))?)
            }
        }
    }
}

impl ModelArgs {
    /// The model with its experts placed as the flags ask: in a tiered mode the memory plan
    /// ([`ModelArgs::memory_plan`], `plan`'s own arithmetic) is worked out once for `shape`
    /// from the checkpoint, the store and the machine, logged, and followed. Its caches take
    /// `--cache-dtype`.
    pub fn load(&self, shape: Shape) -> anyhow::Result<Loaded> {
        let mut loaded = self.placed(shape)?;
        loaded.model.options.cache = self.cache_dtype;
        Ok(loaded)
    }

    fn placed(&self, shape: Shape) -> anyhow::Result<Loaded> {
        crate::tiers::args::log_cpu_lane();
        let device = self.device.open()?;
        let cuda = match &device {
            Device::Cuda(cuda) => {
                check_vram_floor(cuda, self.tier.min_free_vram_mib)?;
                Some(cuda.clone())
            }
            Device::Cpu => None,
        };
        let cfg = Config::from_file(&self.model.join("config.json"))?;
        let source = self.expert_source(&cfg)?;
        let (placement, plan) = match (&source, self.tier.mode) {
            (Some(source), Some(mode)) => {
                let free_vram = cuda
                    .as_ref()
                    .map(|c| c.mem_info().map(|(free, _)| free as u64))
                    .transpose()?;
                let machine = MachineFacts::read(free_vram);
                let plan = self.memory_plan(&cfg, mode, source.as_ref(), shape, &machine)?;
                plan.log(&machine);
                if !self.tier.no_pin {
                    crate::tiers::plan::warn_if_unpinnable(&machine, plan.ram_expert_bytes());
                }
                let placement = self.tier.placement(
                    plan.vram_expert_slots_per_layer,
                    plan.ram_expert_slots_per_layer,
                    cfg.n_routed_experts,
                );
                (placement, Some(plan))
            }
            _ => (Placement::Untiered, None),
        };
        let (tier_plan, cuda) = match (placement, cuda) {
            (Placement::Untiered, None) => {
                return Ok(Loaded {
                    model: Model::load(&self.model)?,
                    experts: ServedExperts::Host,
                    plan,
                });
            }
            (Placement::Untiered, Some(cuda)) => {
                let (model, vram) = crate::tiers::vram::load_model_on_gpu(
                    &self.model,
                    cuda,
                    self.tier.vram_host_copies,
                )?;
                return Ok(Loaded {
                    model,
                    experts: ServedExperts::Vram(vram),
                    plan,
                });
            }
            (Placement::Tiered(tier_plan), cuda) => (tier_plan, cuda),
        };
        let source = source.expect("a tiered placement has an expert source");
        let moe = cfg.moe_layers();
        let tiers = Arc::new(TieredExperts::new(
            source,
            cfg.hidden_size,
            cfg.n_routed_experts,
            &moe,
            &tier_plan,
            cuda.clone(),
        )?);
        let model = match cuda {
            None => Model::builder().experts(tiers.clone()).load(&self.model)?,
            Some(cuda) => crate::tiers::vram::load_dense_on_gpu(
                &self.model,
                tiers.clone(),
                cuda,
                self.tier.vram_host_copies,
            )?,
        };
        // The slots fill from the history once the dense weights' host copies are given back:
        // the plan's RAM tier counts on their memory.
        if tier_plan.history.is_some() {
            tiers.open_history(&crate::store::quick_fingerprint(&self.model)?)?;
        }
        Ok(Loaded {
            model,
            experts: ServedExperts::Tiered(tiers),
            plan,
        })
    }

    /// The memory plan a tiered `mode` runs with on `machine`: `plan --model DIR --store
    /// STORE`'s inputs for this checkpoint (its declared formats, the source's records and VRAM slots) with
    /// these flags' slot counts and reserves, through the same [`crate::plan::plan_with`].
    /// Refuses, with the numbers, what the GPU or the memory cap cannot hold.
    pub fn memory_plan(
        &self,
        cfg: &Config,
        mode: crate::tiers::provider::Mode,
        source: &dyn ExpertSource,
        shape: Shape,
        machine: &MachineFacts,
    ) -> anyhow::Result<MemoryPlan> {
        let request = self.tier.request();
        let inputs = crate::plan::args::checkpoint_inputs(
            &self.model,
            cfg.clone(),
            source,
            shape,
            self.cache_dtype,
            machine,
            &request,
        )?;
        Ok(crate::plan::plan_with(&inputs, &request, machine, mode)?)
    }

    /// Where a tiered placement reads experts from (the store, else the checkpoint); `None`
    /// without --mode.
    fn expert_source(&self, cfg: &Config) -> anyhow::Result<Option<Arc<dyn ExpertSource>>> {
        if self.tier.mode.is_none() {
            return Ok(None);
        }
        Ok(Some(match &self.store {
            Some(store) => {
                let s = StoreSource::open_with(
                    store,
                    &self.model,
                    cfg,
                    self.tier.store_check.reader_options(),
                )?;
                tracing::info!(
                    engine = s.engine_name(),
                    check = ?self.tier.store_check,
                    "experts served from the packed store"
                );
                Arc::new(s)
            }
            None => Arc::new(CheckpointSource::open(&self.model)?),
        }))
    }
}

/// Refuses a GPU with less free VRAM than `floor_mib`, printing the numbers.
fn check_vram_floor(cuda: &crate::backend::cuda::Cuda, floor_mib: u64) -> anyhow::Result<()> {
    let (free, total) = cuda.mem_info()?;
    match vram_floor_problem(&cuda.describe(), free as u64, total as u64, floor_mib) {
        Some(problem) => anyhow::bail!("{problem}"),
        None => Ok(()),
    }
}

/// What is wrong when `free` bytes of VRAM (of `total`) are below the floor of `floor_mib`
/// (`--min-free-vram-mib`); `None` when they are not.
pub fn vram_floor_problem(gpu: &str, free: u64, total: u64, floor_mib: u64) -> Option<String> {
    let free_mib = free >> 20;
    (free_mib < floor_mib).then(|| {
        format!(
            "{gpu}: {free_mib} MiB of VRAM free (of {} MiB), below the floor of {floor_mib} MiB \
             (--min-free-vram-mib); free the GPU of other processes or lower the floor",
            total >> 20
        )
    })
}

#[derive(Args)]
pub struct GenerationArgs {
    /// The user message (rendered with the model's chat template unless --raw).
    #[arg(long, env = "GLMFLASH_PROMPT")]
    pub prompt: String,
    /// Feed the prompt as plain text, without the chat template.
    #[arg(long, env = "GLMFLASH_RAW", value_parser = clap::builder::BoolishValueParser::new())]
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
