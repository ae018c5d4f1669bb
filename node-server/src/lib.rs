//! glmflash-node: the inference pod for GLM-5.3-Flash.
//!
//! Imports point down: `model` -> `backend`, `quant`; nothing here knows HTTP yet.

pub mod quant;
pub mod tokenizer;
