//! The demo model: a small glm5_next checkpoint with random weights, a real byte-level BPE
//! tokenizer and the chat template, made deterministically from a seed so the README's first
//! command works on any machine with no download.

use crate::model::checkpoint::DType;
use crate::model::random::{scaled_config, write_random_checkpoint};
use crate::tokenizer::{DEMO_VOCAB_SIZE, write_demo_tokenizer_files};
use std::path::{Path, PathBuf};

pub const DEFAULT_SEED: u64 = 5;

/// Writes the demo model into `dir` (created if needed).
pub fn make_demo_model(dir: &Path, seed: u64) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let tok = write_demo_tokenizer_files(dir, DEMO_VOCAB_SIZE)?;
    // 8 layers in the real model's rhythm (KDA x3, MLA; MLA layers alternate full/shared
    // indexers), one dense layer then MoE with 32 experts of width 256, top-4 in 4 groups.
    let mut config = scaled_config(tok.vocab_size, 256, 8, 1, 32, 256, 4);
    config["eos_token_id"] = serde_json::json!(tok.stop_token_ids);
    config["bos_token_id"] = serde_json::json!(tok.gmask_token_id);
    write_random_checkpoint(dir, &config, seed, DType::Bf16)?;
    Ok(())
}

/// Where `demo` keeps its model: `$GLMFLASH_CACHE_DIR`, else `$XDG_CACHE_HOME/glmflash`, else
/// `~/.cache/glmflash`, each with `demo-model/` inside.
pub fn default_demo_dir() -> PathBuf {
    let base = std::env::var_os("GLMFLASH_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("glmflash")))
        .or_else(|| std::env::var_os("HOME").map(|d| PathBuf::from(d).join(".cache/glmflash")))
        .unwrap_or_else(|| std::env::temp_dir().join("glmflash"));
    base.join("demo-model")
}

/// The demo model directory, made first if it is missing or incomplete.
pub fn ensure_demo_model(dir: &Path) -> anyhow::Result<()> {
    let complete = [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    .iter()
    .all(|f| dir.join(f).is_file());
    if !complete {
        tracing::info!(dir = %dir.display(), "making the demo model");
        // Build beside the target and rename, so an interrupted run never leaves half a model.
        let tmp = dir.with_extension("partial");
        let _ = std::fs::remove_dir_all(&tmp);
        make_demo_model(&tmp, DEFAULT_SEED)?;
        let _ = std::fs::remove_dir_all(dir);
        std::fs::rename(&tmp, dir)?;
    }
    Ok(())
}
