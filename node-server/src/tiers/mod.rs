//! Expert residency across tiers (device slots, pinned RAM slots, the NVMe store): sizing
//! from the container's limits and the eviction policy. The tiered `ExpertProvider` builds
//! on these with the store reader.

pub mod args;
pub mod history;
pub mod pin;
pub mod policy;
pub mod provider;
pub mod ring;
pub mod sizing;
pub mod stats;
pub mod vram;
