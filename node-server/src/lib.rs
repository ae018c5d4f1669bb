#![recursion_limit = "256"]
//! glmflash-node: the inference pod for GLM-5.3-Flash.
//!
//! Imports point down: `model` -> `backend`, `quant`; `backend` knows no model.

pub mod api;
pub mod backend;
pub mod bench;
pub mod bench_flash;
pub mod bench_tiers;
pub mod cli;
pub mod cuda_check;
pub mod demo;
pub mod download;
pub mod engine;
pub mod gates;
pub mod metrics;
pub mod mmap;
pub mod model;
pub mod quant;
pub mod store;
pub mod tiers;
pub mod tokenizer;
