//! Dev tools: benchmarks, the per-op CUDA check and the acceptance gates. They may import
//! anything in the crate; nothing in the product imports them (only the command line).

pub mod bench;
pub mod cuda_check;
pub mod gates;
