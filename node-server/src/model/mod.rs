//! The glm5_next model: config, checkpoint loading, and one file per block, each reading like
//! the math in `shared/reference/glm5-next.md`.

pub mod checkpoint;
pub mod config;
pub mod convert;
pub mod decoder;
pub mod device;
pub mod dsa;
pub mod dump;
mod forward;
pub mod glm5;
pub mod kda;
pub mod loader;
pub mod mhc;
pub mod mla;
pub mod mlp;
pub mod moe;
pub mod random;

pub use decoder::{Decoder, GpuDecoder};
pub use device::{Device, Gpu, Host};
pub use glm5::{ForwardHooks, ForwardOptions, Model, ModelBuilder, SeqCache, Step};
