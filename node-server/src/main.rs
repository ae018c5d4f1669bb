//! `glmflash-node`: the inference pod's command line (definitions in `glmflash_node::cli`).

use anyhow::{Context, bail};
use clap::Parser;
use glmflash_node::api::server;
use glmflash_node::cli::{Cli, Command, GenerationArgs};
use glmflash_node::engine::sampling::Sampler;
use glmflash_node::model::decoder::{DEFAULT_GPU_CHUNK, GpuDecoder, placed_device};
use glmflash_node::model::dump::Dump;
use glmflash_node::model::{Gpu, Model, SeqCache, Step};
use glmflash_node::plan::Shape;
use glmflash_node::tokenizer::TextCodec;
use glmflash_node::tools::{bench, cuda_check, gates};
use glmflash_node::{demo, store};
use std::io::Write;
use std::time::Instant;

fn main() {
    let cli = Cli::parse();
    init_logging(&cli.log_format);
    recycle_large_allocations();
    if let Err(e) = run(cli.command) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// Keeps allocations up to 32 MiB (an expert record is 14 MB, its three matrices ~5 MB each)
/// in malloc's heap, where a freed one is reused, instead of a fresh `mmap` each that faults
/// its pages in again (3,500 faults a record: seconds of an 8k prompt's store reads). glibc
/// otherwise raises this threshold only after a large block happens to be freed, so the
/// speed of a fetch depended on what the process had freed before. A `MALLOC_MMAP_THRESHOLD_`
/// in the environment is left to rule.
///
/// And one malloc arena for every thread: `serve` hands each step's logits (4 x 620 KB at 4
/// streams of a 155k vocabulary) from the engine's thread to the samplers' and frees them
/// there; with an arena per thread their pages faulted in again every step, and 4-stream
/// decode through `serve` ran at 410-434 tok/s where `bench` made 670 (H200, 2026-12-04; 634
/// with one arena, set through `GLIBC_TUNABLES` with these thresholds). Small blocks still
/// come from each thread's own cache. A
/// `MALLOC_ARENA_MAX` in the environment is left to rule.
#[allow(unsafe_code)] // mallopt, the one libc call that sets these
fn recycle_large_allocations() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none() {
            // SAFETY: mallopt only sets malloc's tunables; called before any other thread runs.
            unsafe {
                libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
                libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
            }
        }
        if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
            // SAFETY: as above.
            unsafe {
                libc::mallopt(libc::M_ARENA_MAX, 1);
            }
        }
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
            let shape = Shape {
                context: serve.context_length,
                batch: serve.max_batch_size,
                chunk: serve.gpu_chunk_size,
            };
            server::serve(
                model.model.clone(),
                serve,
                Some(Box::new(move |metrics| {
                    let loaded = model.load(shape)?;
                    loaded.experts.attach_metrics(metrics)?;
                    if let Some(plan) = &loaded.plan {
                        metrics.set_plan(&plan.metrics())?;
                    }
                    Ok(loaded.model)
                })),
            )
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
            let model = model.load(Shape::one_sequence())?.model;
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
            let (greedy_tokens, steps) = if greedy > 0 {
                model.greedy(&tokens, greedy)?
            } else {
                (Vec::new(), Vec::new())
            };
            // The last greedy step's logits come from cached decode steps (the CPU lane's
            // phase), the prompt's from prefill.
            let decode_logits = if steps.len() > 1 {
                steps.last().cloned()
            } else {
                None
            };
            println!(
                "{}",
                serde_json::json!({"logits": logits, "greedy": greedy_tokens, "decode_logits": decode_logits})
            );
            // The tiers' one-line summary on stderr (what moved where), as `generate` ends.
            model.experts().finish()
        }
        Command::Generate { model, generation } => {
            let loaded = model.load(Shape::one_sequence())?;
            generate(&model.model, &loaded.model, &generation)?;
            loaded.model.experts().finish()
        }
        Command::ConvertExperts {
            model,
            out,
            format,
            dense_format,
        } => {
            let format = glmflash_node::quant::Format::from_name(&format)?;
            let dense_format = dense_format
                .map(|f| glmflash_node::quant::Format::from_name(&f).context("--dense-format"))
                .transpose()?;
            let cfg = glmflash_node::model::config::Config::from_file(&model.join("config.json"))?;
            let linear = glmflash_node::plan::weights::linear_names(&cfg);
            let started = Instant::now();
            let report = glmflash_node::model::convert::convert(
                &model,
                &out,
                format,
                dense_format.map(|format| glmflash_node::model::convert::DenseConversion {
                    format,
                    linear: &linear,
                }),
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
        Command::Download(args) => {
            let r = glmflash_node::download::download(&args)?;
            eprintln!(
                "{}: {} files at commit {}; fetched {} ({:.1} MiB, {} resumed)",
                args.dir.display(),
                r.files,
                r.commit,
                r.fetched_files,
                r.fetched_bytes as f64 / 1048576.0,
                r.resumed_files
            );
            Ok(())
        }
        Command::Bench(args) => bench::run(&args),
        Command::Plan(args) => glmflash_node::plan::args::run(&args),
        Command::CudaCheck(args) => {
            if cuda_check::run(&args)? {
                Ok(())
            } else {
                bail!("some CUDA kernels disagree with the CPU backend (table above)")
            }
        }
        Command::Gates(args) => {
            if gates::run(&args)? {
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
            report: report_path,
            format,
        } => {
            let opts = store::PackOptions {
                format,
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
                store::PackOutcome::AddedChecks => {
                    "store was complete; every record's CRC-32C added to its manifest".to_string()
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
            if let Some(v) = &report.verify {
                print_verify(v);
            }
            if let Some(path) = report_path {
                let json = serde_json::json!({
                    "storeBytes": dir_bytes(&store)?,
                    "records": report.records,
                    "fingerprint": report.fingerprint,
                });
                std::fs::write(&path, json.to_string())
                    .with_context(|| format!("writing the report to {}", path.display()))?;
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

/// Bytes of the regular files directly in `dir` (the store's size on disk).
fn dir_bytes(dir: &std::path::Path) -> anyhow::Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let meta = entry?.metadata()?;
        if meta.is_file() {
            total += meta.len();
        }
    }
    Ok(total)
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

/// One sequence through the forward `serve` runs: the GPU decoder (every activation and
/// cache in VRAM) when the model's dense weights are on a GPU, else the host forward.
enum Sequence {
    Host(Option<SeqCache>),
    Gpu(Box<GpuDecoder>, SeqCache<Gpu>),
}

impl Sequence {
    fn new(model: &Model) -> anyhow::Result<Sequence> {
        Ok(match placed_device(model) {
            Some(cuda) => {
                let g = GpuDecoder::new(&cuda, model)?;
                let seq = g.sequence(&model.new_cache())?;
                Sequence::Gpu(Box::new(g), seq)
            }
            None => Sequence::Host(None),
        })
    }

    /// The prompt's last logits (on the GPU in chunks of the engine's default size).
    fn prefill(&mut self, model: &Model, prompt: &[u32]) -> anyhow::Result<Vec<f32>> {
        match self {
            Sequence::Host(cache) => {
                let (logits, c) = model.prefill(prompt)?;
                *cache = Some(c);
                Ok(logits)
            }
            Sequence::Gpu(g, seq) => {
                let mut logits = Vec::new();
                for chunk in prompt.chunks(DEFAULT_GPU_CHUNK) {
                    logits = g.forward(model, &mut [&mut *seq], &[chunk])?.remove(0);
                }
                Ok(logits)
            }
        }
    }

    fn step(&mut self, model: &Model, token: u32) -> anyhow::Result<Vec<f32>> {
        match self {
            Sequence::Host(Some(cache)) => model.decode_step(token, cache),
            Sequence::Host(None) => bail!("a decode step before the prompt"),
            Sequence::Gpu(g, seq) => g.step(model, seq, token),
        }
    }
}

fn generate(dir: &std::path::Path, model: &Model, args: &GenerationArgs) -> anyhow::Result<()> {
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
    let mut run = Sequence::new(model)?;

    let started = Instant::now();
    let mut logits = run.prefill(model, &prompt)?;
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
        logits = run.step(model, next)?;
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
