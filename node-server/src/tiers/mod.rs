//! Expert residency across tiers (device slots, pinned RAM slots, the NVMe store): the
//! placement plan (decided once, from the flags and the machine), the eviction policy, and
//! the tiered `ExpertProvider` over the store reader.

pub mod arena;
pub mod args;
pub mod history;
pub mod pin;
pub mod plan;
pub mod policy;
pub mod provider;
pub mod ring;
pub mod sizing;
pub mod source;
pub mod stats;
pub mod vram;
