//! `glmflash-node`: the inference pod's command line.

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand};
use glmflash_node::api::server::{self, ServeArgs};
use glmflash_node::engine::sampling::Sampler;
use glmflash_node::model::config::MlpKind;
use glmflash_node::model::dump::Dump;
use glmflash_node::model::{Model, Step};
use glmflash_node::tiers::args::{TierArgs, tier_summary};
use glmflash_node::tiers::history::RoutingHistory;
use glmflash_node::tiers::provider::{
    CheckpointSource, ExpertSource, Mode, StoreSource, TierCaps, TieredExperts,
};
use glmflash_node::tokenizer::TextCodec;
use glmflash_node::{bench, demo, store};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(Parser)]
#[command(
    name = "glmflash-node",
    version,
    about = "GLM-5.3-Flash inference pod: engine, expert tiers and tools",
    long_about = "GLM-5.3-Flash inference pod.\n\nRuns glm5_next checkpoints on the CPU (CUDA and the expert tiers come in later releases). \
                  Every flag can also be set through the environment variable shown in its help."
)]
struct Cli {
    /// Log format: `text` for terminals, `json` for containers.
    #[arg(
        long,
        env = "GLMFLASH_LOG_FORMAT",
        default_value = "text",
        global = true
    )]
    log_format: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
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
    Gates(glmflash_node::gates::GatesArgs),
    /// Measure CPU prefill and decode speed on a random model of the given shape.
    Bench(bench::BenchArgs),
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
struct ModelArgs {
    /// Checkpoint directory: config.json, safetensors, tokenizer files.
    #[arg(long, env = "GLMFLASH_MODEL")]
    model: PathBuf,
    /// Expert residency: fast/exact (all experts in RAM) or nvme/nvme-exact (tiered).
    #[arg(long, env = "GLMFLASH_MODE", value_enum)]
    mode: Option<Mode>,
    /// Device-tier expert slots per MoE layer (tiered modes; a CPU-memory tier without a GPU).
    #[arg(long, env = "GLMFLASH_VRAM_SLOTS", default_value_t = 4)]
    vram_slots: usize,
    /// RAM-tier expert slots per MoE layer (tiered modes); default: sized from the memory
    /// limit (see --ram-budget-mib).
    #[arg(long, env = "GLMFLASH_RAM_SLOTS")]
    ram_slots: Option<usize>,
    /// Packed expert store (from `pack-store`) that expert misses are read from; without it
    /// a tiered mode reads misses from the checkpoint.
    #[arg(long, env = "GLMFLASH_STORE")]
    store: Option<PathBuf>,
    /// Routing history file: loaded at start to warm the tiers, written at exit.
    #[arg(long, env = "GLMFLASH_HISTORY")]
    history: Option<PathBuf>,
    /// Turn off layer-ahead prefetch of predicted experts.
    #[arg(long, env = "GLMFLASH_NO_PREFETCH")]
    no_prefetch: bool,
    #[command(flatten)]
    tier: TierArgs,
}

/// Lookups per layer between halvings of the LFU counts.
const AGING_PERIOD: u64 = 4096;

impl ModelArgs {
    /// The model with its experts served as the flags ask (untiered when no --mode).
    fn load(&self) -> anyhow::Result<(Model, Option<Arc<TieredExperts>>)> {
        glmflash_node::tiers::args::log_cpu_lane();
        let Some(mode) = self.mode else {
            return Ok((Model::load(&self.model)?, None));
        };
        let cfg = glmflash_node::model::config::Config::from_file(&self.model.join("config.json"))?;
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
        let moe: Vec<bool> = cfg.mlp_kinds.iter().map(|k| *k == MlpKind::Moe).collect();
        let moe_layers = moe.iter().filter(|&&m| m).count();
        let record = source.record_bytes() as u64;
        // The non-expert weights load after sizing: count them as held already.
        let dense = checkpoint_bytes(&self.model)
            .saturating_sub(moe_layers as u64 * cfg.n_routed_experts as u64 * record);
        let caps = TierCaps {
            device_slots_per_layer: self.vram_slots,
            ram_slots_per_layer: self.tier.prepare(
                mode,
                self.ram_slots,
                dense,
                record,
                moe_layers,
                cfg.n_routed_experts,
            ),
        };
        let tiers = Arc::new(TieredExperts::with_tuning(
            source,
            cfg.hidden_size,
            cfg.n_routed_experts,
            &moe,
            mode,
            caps,
            AGING_PERIOD,
            !self.no_prefetch,
            self.tier.tuning(),
        )?);
        if let Some(path) = &self.history {
            let fingerprint = glmflash_node::store::quick_fingerprint(&self.model)?;
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
        Ok((
            Model::load_with(&self.model, Some(tiers.clone()))?,
            Some(tiers),
        ))
    }
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
struct GenerationArgs {
    /// The user message (rendered with the model's chat template unless --raw).
    #[arg(long, env = "GLMFLASH_PROMPT")]
    prompt: String,
    /// Feed the prompt as plain text, without the chat template.
    #[arg(long, env = "GLMFLASH_RAW")]
    raw: bool,
    #[arg(long, env = "GLMFLASH_MAX_TOKENS", default_value_t = 128)]
    max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, env = "GLMFLASH_TEMPERATURE", default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, env = "GLMFLASH_TOP_P", default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, env = "GLMFLASH_SEED", default_value_t = 0)]
    seed: u64,
}

fn main() {
    let cli = Cli::parse();
    init_logging(&cli.log_format);
    if let Err(e) = run(cli.command) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn init_logging(format: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("GLMFLASH_LOG")
        .unwrap_or_else(|_| "info".into());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
}

fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Demo { dir, serve } => {
            let dir = dir.unwrap_or_else(demo::default_demo_dir);
            demo::ensure_demo_model(&dir)?;
            server::serve(dir, serve, None)
        }
        Command::Serve { model, serve } => {
            let dir = model.model.clone();
            let history = model.history.clone();
            // The tiers outlive the server so their routing history is saved at exit.
            let slot: Arc<std::sync::Mutex<Option<Arc<TieredExperts>>>> = Arc::default();
            let keep = slot.clone();
            server::serve(
                dir.clone(),
                serve,
                Some(Box::new(move |metrics| {
                    let (loaded, tiers) = model.load()?;
                    if let Some(t) = &tiers {
                        let t = t.clone();
                        metrics.attach_tiers(move || {
                            glmflash_node::tiers::args::metrics_snapshot(&t)
                        })?;
                    }
                    *keep.lock().unwrap_or_else(|e| e.into_inner()) = tiers;
                    Ok(loaded)
                })),
            )?;
            let tiers = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(tiers) = &tiers {
                tiers.flush();
                eprintln!("tiers ({:?}): {}", tiers.mode(), tier_summary(tiers));
            }
            if let (Some(tiers), Some(path)) = (tiers, history) {
                let fingerprint = glmflash_node::store::quick_fingerprint(&dir)?;
                tiers
                    .history(&fingerprint)
                    .save(&path)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            Ok(())
        }
        Command::MakeDemoModel { out, seed } => {
            demo::make_demo_model(&out, seed)?;
            eprintln!("demo model written to {}", out.display());
            Ok(())
        }
        Command::Logits {
            model,
            tokens,
            greedy,
            dump,
        } => {
            let (model, _) = model.load()?;
            if let Some(path) = dump {
                let hooks = Dump::default();
                let mut cache = model.new_cache();
                model.forward(
                    &mut [Step {
                        tokens: &tokens,
                        cache: &mut cache,
                        all_logits: true,
                    }],
                    Some(&hooks),
                )?;
                hooks
                    .save(&path)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            let (logits, _) = model.prefill(&tokens)?;
            let (greedy_tokens, _) = if greedy > 0 {
                model.greedy(&tokens, greedy)?
            } else {
                (Vec::new(), Vec::new())
            };
            println!(
                "{}",
                serde_json::json!({"logits": logits, "greedy": greedy_tokens})
            );
            Ok(())
        }
        Command::Generate { model, generation } => {
            let (loaded, tiers) = model.load()?;
            generate(&model.model, loaded, &generation)?;
            if let Some(tiers) = tiers {
                tiers.flush();
                eprintln!("tiers ({:?}): {}", tiers.mode(), tier_summary(&tiers));
                if let Some(path) = &model.history {
                    let fingerprint = glmflash_node::store::quick_fingerprint(&model.model)?;
                    tiers
                        .history(&fingerprint)
                        .save(path)
                        .with_context(|| format!("writing {}", path.display()))?;
                }
            }
            Ok(())
        }
        Command::ConvertExperts { model, out, format } => {
            let format = glmflash_node::quant::Format::from_name(&format)?;
            let started = Instant::now();
            let report = glmflash_node::model::convert::convert_experts(
                &model,
                &out,
                format,
                |done, total| {
                    if done == total || done % 64 == 0 {
                        eprint!("\rconverted {done}/{total} experts");
                    }
                },
            )?;
            eprintln!();
            eprintln!(
                "{} experts: {:.1} MiB -> {:.1} MiB ({}) in {} shards, {:.1}s",
                report.experts,
                report.source_bytes as f64 / 1048576.0,
                report.converted_bytes as f64 / 1048576.0,
                format.name(),
                report.shards,
                started.elapsed().as_secs_f64()
            );
            Ok(())
        }
        Command::Bench(args) => bench::run(&args),
        Command::Gates(args) => {
            if glmflash_node::gates::run(&args)? {
                Ok(())
            } else {
                bail!("some gates failed")
            }
        }
        Command::PackStore {
            model,
            store,
            verify_sample,
            no_verify,
            pack_throttle_ms,
            pack_batch_bytes,
            pack_skip_space_check,
        } => {
            let opts = store::PackOptions {
                verify: !no_verify,
                sample: verify_sample,
                throttle: pack_throttle_ms.map(std::time::Duration::from_millis),
                skip_space_check: pack_skip_space_check,
                batch_bytes: pack_batch_bytes,
                ..store::PackOptions::default()
            };
            let report = store::pack_store(&model, &store, &opts)?;
            let what = match report.outcome {
                store::PackOutcome::AlreadyComplete => {
                    "store is already complete for this model; nothing to do".to_string()
                }
                store::PackOutcome::Packed => "packed".to_string(),
                store::PackOutcome::Resumed { from_record } => {
                    format!("resumed at record {from_record} and packed")
                }
            };
            eprintln!(
                "{}: {what}: {} records of {} bytes, {:.1} MiB written in {:.1}s; fingerprint {}",
                store.display(),
                report.records,
                report.record_size,
                report.bytes_written as f64 / 1048576.0,
                report.seconds,
                report.fingerprint
            );
            if let Some(v) = report.verify {
                print_verify(&v);
            }
            Ok(())
        }
        Command::VerifyStore {
            model,
            store,
            verify_sample,
        } => {
            let opts = store::VerifyOptions {
                sample: verify_sample,
                ..store::VerifyOptions::default()
            };
            let report = store::verify_store(&store, model.as_deref(), &opts)?;
            print_verify(&report);
            Ok(())
        }
    }
}

fn print_verify(v: &store::VerifyReport) {
    eprintln!(
        "verified {} records ({:.1} MiB) by sha256 in {:.2}s ({:.2} GB/s, {}); {} compared with the source{}",
        v.records,
        v.bytes as f64 / 1048576.0,
        v.seconds,
        v.bytes as f64 / v.seconds.max(1e-9) / 1e9,
        v.engine,
        v.compared,
        if v.fingerprint_checked {
            "; model fingerprint matches"
        } else {
            ""
        }
    );
}

fn generate(dir: &std::path::Path, model: Model, args: &GenerationArgs) -> anyhow::Result<()> {
    let codec = TextCodec::from_dir(dir)
        .with_context(|| format!("loading the tokenizer of {}", dir.display()))?;
    let text = if args.raw || !codec.has_chat_template() {
        args.prompt.clone()
    } else {
        codec.render_chat(
            &serde_json::json!([{"role": "user", "content": args.prompt}]),
            None,
            true,
            false,
        )?
    };
    let prompt = codec.encode(&text)?;
    if prompt.is_empty() {
        bail!("the prompt encodes to no tokens");
    }
    let mut sampler = Sampler::new(args.temperature, args.top_p, args.seed);
    let mut decoder = codec.stream_decoder(true);
    let mut stdout = std::io::stdout();

    let started = Instant::now();
    let (mut logits, mut cache) = model.prefill(&prompt)?;
    let prefill_s = started.elapsed().as_secs_f64();
    let decode_started = Instant::now();
    let mut generated = 0;
    for _ in 0..args.max_tokens {
        let next = sampler.sample(&logits);
        generated += 1;
        if codec.eos_ids().contains(&next) {
            break;
        }
        write!(stdout, "{}", decoder.push(next)?)?;
        stdout.flush()?;
        logits = model.decode_step(next, &mut cache)?;
    }
    writeln!(stdout, "{}", decoder.finish()?)?;
    let decode_s = decode_started.elapsed().as_secs_f64();
    eprintln!(
        "prompt {} tokens in {:.2}s ({:.1} tok/s); generated {} tokens in {:.2}s ({:.1} tok/s)",
        prompt.len(),
        prefill_s,
        prompt.len() as f64 / prefill_s,
        generated,
        decode_s,
        generated as f64 / decode_s.max(1e-9)
    );
    Ok(())
}
