//! The glm5_next model: config, checkpoint loading, and one file per block, each reading like
//! the math in `shared/reference/glm5-next.md`.

pub mod checkpoint;
pub mod config;
pub mod convert;
pub mod dsa;
pub mod dump;
pub mod glm5;
pub mod gpu;
pub mod kda;
pub mod loader;
pub mod mhc;
pub mod mla;
pub mod mlp;
pub mod moe;
pub mod random;

pub use glm5::{ForwardHooks, ForwardOptions, Model, ModelBuilder, SeqCache, Step};
