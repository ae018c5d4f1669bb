//! `bench`: prefill and decode speed of a random model (or `--model`), and its variants
//! `--tiered` (decode through the expert tiers), `--flash` (GLM-5.3-Flash width under
//! the RTX 3090 box's budget), `--sampling` (the engine's token draw) and `--lane` (the CPU lane's
//! routed experts). Each reports its roofline from bandwidths measured in the
//! same run.

mod args;
mod common;
mod figures;
mod flash;
mod lane;
mod plain;
mod sampling;
mod tiered;

pub use args::{BenchArgs, FlashBenchArgs, TierBenchArgs};

pub fn run(args: &BenchArgs) -> anyhow::Result<()> {
    if args.sampling {
        sampling::run(args)
    } else if args.lane {
        lane::run(args)
    } else if args.flash.flash {
        flash::run(args)
    } else if args.tiers.tiered {
        tiered::run(args)
    } else {
        plain::run(args)
    }
}
