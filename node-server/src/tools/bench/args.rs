//! The flags of `bench` and its `--tiered`, `--flash`, `--sampling` and `--lane` variants (one
//! flag set: the variants share the model shape and token counts).

use crate::plan::weights::Storage;
use crate::quant::exl3::{Codebook, Rate};
use crate::store::PartFormat;
use std::path::PathBuf;

#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// Use this checkpoint instead of a random one.
    #[arg(long, env = "GLMFLASH_MODEL")]
    pub model: Option<std::path::PathBuf>,
    #[arg(long, default_value_t = 1024)]
    pub hidden: usize,
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    #[arg(long, default_value_t = 32)]
    pub experts: usize,
    #[arg(long, default_value_t = 512)]
    pub expert_width: usize,
    #[arg(long, default_value_t = 8)]
    pub top_k: usize,
    #[arg(long, default_value_t = 4096)]
    pub vocab: usize,
    /// Routed expert weight format of the random model: bf16, q8_0 or q4_k (`--lane` also
    /// takes exl3:RATE).
    #[arg(long, default_value = "bf16")]
    pub expert_format: String,
    #[arg(long, default_value_t = 256)]
    pub prompt_tokens: usize,
    #[arg(long, default_value_t = 32)]
    pub decode_tokens: usize,
    /// Sequences decoded together, comma-separated batch sizes (plain `bench`: one decode run
    /// per size; with `--device cuda` the GPU decoder `serve` runs steps them as one batch).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub streams: Vec<usize>,
    #[command(flatten)]
    pub device: crate::backend::DeviceArgs,
    #[command(flatten)]
    pub tiers: TierBenchArgs,
    #[command(flatten)]
    pub flash: FlashBenchArgs,
    /// Time the engine's token draw instead of a model: one draw per sequence of each
    /// `--streams` size over `--vocab` random logits, the sequences in turn and as the engine
    /// draws them (in parallel), at temperature 1 (not with --model).
    #[arg(long, env = "GLMFLASH_BENCH_SAMPLING", conflicts_with_all = ["model", "tiered", "flash"], value_parser = clap::builder::BoolishValueParser::new())]
    pub sampling: bool,
    /// Time the CPU lane of the near-exact modes instead of a model: a decode step's
    /// `--top-k` routed experts of `--hidden` x `--expert-width` in `--expert-format` (also
    /// exl3:RATE), one token row each, in parallel, by the exact kernels and by the lane's
    /// integer kernels, cycling through `--experts` experts (cold) or repeating `--top-k`
    /// (hot) (not with --model).
    #[arg(long, env = "GLMFLASH_BENCH_LANE", conflicts_with_all = ["model", "tiered", "flash", "sampling"], value_parser = clap::builder::BoolishValueParser::new())]
    pub lane: bool,
    /// With `--device cuda`: also time the host's side of the CUDA calls a decode step makes
    /// (a launch, a stream-ordered allocation and free, a small upload), 20,000 of each, and
    /// the device's time a kernel in chains of 256 dependent launches, launched one by one and
    /// replayed as a CUDA graph; report microseconds a call (`cuda_call_costs_us`).
    #[arg(long, env = "GLMFLASH_BENCH_CALL_COSTS", value_parser = clap::builder::BoolishValueParser::new())]
    pub call_costs: bool,
}

#[derive(clap::Args, Debug, Clone)]
pub struct TierBenchArgs {
    /// Measure decode through the expert tiers (experts read from a packed store) instead of
    /// with every expert in memory, on a random model it writes (not with --model: a
    /// checkpoint's tiers are measured through `serve` or `generate` with --mode).
    #[arg(long, env = "GLMFLASH_BENCH_TIERED", conflicts_with = "model", value_parser = clap::builder::BoolishValueParser::new())]
    pub tiered: bool,
    /// Where the model and its packed stores are written (a disk filesystem with O_DIRECT);
    /// removed afterwards.
    #[arg(long, env = "GLMFLASH_BENCH_SCRATCH", default_value = "/tmp")]
    pub scratch: PathBuf,
    /// Device-tier slots per MoE layer.
    #[arg(long, env = "GLMFLASH_BENCH_VRAM_SLOTS", default_value_t = 8)]
    pub vram_slots: usize,
    /// RAM-tier slots per MoE layer.
    #[arg(long, env = "GLMFLASH_BENCH_RAM_SLOTS", default_value_t = 16)]
    pub ram_slots: usize,
    /// Skew of the Zipf-like routing: the expert of popularity rank r gets bias -s * ln(1 + r).
    #[arg(long, env = "GLMFLASH_BENCH_ZIPF_BIAS", default_value_t = 0.1)]
    pub zipf_bias: f32,
    /// Decode steps run before measuring (to fill the tiers).
    #[arg(long, env = "GLMFLASH_BENCH_WARMUP", default_value_t = 16)]
    pub warmup_tokens: usize,
    /// Read each forward's store misses in full before computing its experts (the tiers'
    /// `--no-fetch-overlap`), to measure what the overlap is worth.
    #[arg(long, env = "GLMFLASH_BENCH_NO_FETCH_OVERLAP", value_parser = clap::builder::BoolishValueParser::new())]
    pub no_fetch_overlap: bool,
    /// Turn off layer-ahead prefetch (decode) and read-ahead (prompt chunks), as the tiers'
    /// `--no-prefetch`.
    #[arg(long, env = "GLMFLASH_BENCH_NO_PREFETCH", value_parser = clap::builder::BoolishValueParser::new())]
    pub no_prefetch: bool,
    /// Keep a host copy of every VRAM resident and of the dense weights (the tiers'
    /// `--vram-host-copies`); `--flash` sizes its budget with the flag too, so the RAM tier
    /// loses those copies' memory.
    #[arg(long, env = "GLMFLASH_BENCH_VRAM_HOST_COPIES", value_parser = clap::builder::BoolishValueParser::new())]
    pub vram_host_copies: bool,
    /// The store disk's O_DIRECT read bandwidth in GB/s, for the roofline (default: measured,
    /// every record of the bench's store read once at depth).
    #[arg(long, env = "GLMFLASH_BENCH_DISK_GBPS")]
    pub disk_gbps: Option<f64>,
}

#[derive(clap::Args, Debug, Clone)]
pub struct FlashBenchArgs {
    /// Benchmark a random model at GLM-5.3-Flash width under the RTX 3090 box's budget
    /// (needs --device cuda; writes about 4.1 GB of store per MoE layer into --scratch; not
    /// with --model: the model is its own).
    #[arg(long, env = "GLMFLASH_BENCH_FLASH", conflicts_with = "model", value_parser = clap::builder::BoolishValueParser::new())]
    pub flash: bool,
    /// MoE layers of the random model (the real one has 42).
    #[arg(long, env = "GLMFLASH_BENCH_FLASH_LAYERS", default_value_t = 8)]
    pub flash_moe_layers: usize,
    /// The random experts' records: `q4_k` (or another row format: q8_0, bf16, f16, f32),
    /// or `exl3:RATE`, random trellises at that rate (1 to 8, or 1.5, 2.5, 3.5 bits per
    /// weight; the mul1 codebook) with their suh and svh, as pack-store keeps an EXL3
    /// checkpoint's experts. GLM-5.3-Flash EXL3 3.05 bpw's experts are exl3:3.
    #[arg(
        long,
        env = "GLMFLASH_BENCH_FLASH_EXPERT_FORMAT",
        default_value = "q4_k",
        value_parser = parse_record_format
    )]
    pub flash_expert_format: PartFormat,
    /// The box the budget is planned for: flags of `glmflash-node plan` (GLM-5.3-Flash's
    /// config and a 24,576 MiB RTX 3090 with 131,072 tokens for 8 sequences unless they say
    /// otherwise; `--expert-format` is added, naming the records this bench packs). Each MoE
    /// layer here gets the VRAM and RAM slots a layer of the real model gets there. Default:
    /// the seed's box, a 55 GiB cap, and the seed's EXL3 3.05 bpw non-expert weights.
    #[arg(long, default_value = "--ram-limit 55GiB --dense-format exl3:3.05")]
    pub flash_plan: String,
    /// Prompt length of the `prefill` run.
    #[arg(long, default_value_t = 8192)]
    pub flash_prefill: usize,
    /// Runs, comma-separated: budget, prefill, exact, vram, fast, zipf.
    #[arg(long, default_value = "budget,prefill,exact,vram,fast,zipf")]
    pub flash_runs: String,
    /// Keep the generated model and store in --scratch, and reuse them when present.
    #[arg(long)]
    pub keep: bool,
    /// Decode paths each decode run measures, comma-separated: `host` (`Model::forward`,
    /// activations on the host around every device product) and `gpu` (`GpuDecoder`: the
    /// activations and caches stay on the GPU, the streams stepped as one batch).
    #[arg(long, default_value = "host,gpu")]
    pub flash_decoders: String,
    /// Leave the RAM tier unpinned (neither registered with CUDA nor mlocked): shows what
    /// pinning costs at admission.
    #[arg(long)]
    pub flash_no_pin: bool,
}

/// `--flash-expert-format`: a row format's name, or `exl3:RATE` at one trellis rate (an
/// average such as exl3:3.05 is a checkpoint's, no record's).
pub fn parse_record_format(s: &str) -> Result<PartFormat, String> {
    match Storage::parse(s)? {
        Storage::Rows(format) => Ok(PartFormat::Rows(format)),
        Storage::Exl3 { bits } => {
            let rate = Rate::from_bits(bits as f32).map_err(|e| {
                format!(
                    "{s:?}: {e}; a record holds trellises of one rate (Flash's experts: exl3:3)"
                )
            })?;
            Ok(PartFormat::Exl3 {
                rate,
                codebook: Codebook::Mul1,
            })
        }
    }
}

/// The `glmflash-node plan --expert-format` naming `format`'s records.
pub fn plan_storage(format: PartFormat) -> Storage {
    match format {
        PartFormat::Rows(f) => Storage::Rows(f),
        PartFormat::Exl3 { rate, .. } => Storage::Exl3 {
            bits: f64::from(rate.bits()),
        },
    }
}
