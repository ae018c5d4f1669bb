#![recursion_limit = "256"]
//! glmflash-node: the inference pod for GLM-5.3-Flash.
//!
//! Imports point one way (checked by hand; no two folders import each other):
//! `api` -> `engine` -> `model` -> `backend` -> `quant`; `tiers` implements the model's
//! `ExpertProvider` over `store` (records) and `backend`; `store` reads checkpoints through
//! `model`'s loader. `backend` knows no model type, and nothing in the product imports
//! `tools` (benchmarks and checks; the command line dispatches to them).

pub mod api;
pub mod backend;
pub mod cli;
pub mod demo;
pub mod download;
pub mod engine;
pub mod metrics;
pub mod mmap;
pub mod model;
pub mod plan;
pub mod quant;
pub mod store;
pub mod tiers;
pub mod tokenizer;
pub mod tools;
