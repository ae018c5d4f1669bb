//! Training and writing the demo tokenizer.

use std::collections::HashSet;
use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use serde_json::{Map, Value, json};
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer, TokenizerBuilder};

use super::chat::DEMO_CHAT_TEMPLATE;
use super::{
    CHAT_TEMPLATE_FILE, EOS_TOKEN, SPECIAL_TOKENS, STOP_TOKENS, TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
};

/// Training text for the demo tokenizer (original text written for this project).
pub const DEMO_CORPUS: &str = include_str!("corpus.txt");

/// Vocabulary size (special tokens + 256 byte symbols + merges) of the demo tokenizer.
pub const DEMO_VOCAB_SIZE: usize = 512;

/// What [`write_demo_tokenizer_files`] produced, for the model config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DemoTokenizerInfo {
    /// `tokenizer.get_vocab_size(true)`: every id is `< vocab_size`.
    pub vocab_size: usize,
    /// Id of `<|endoftext|>`.
    pub eos_token_id: u32,
    /// Ids of `<|endoftext|>`, `<|user|>`, `<|observation|>` (generation stops on any).
    pub stop_token_ids: Vec<u32>,
    /// Id of `[gMASK]` and `<sop>`, the prefix of every rendered chat.
    pub gmask_token_id: u32,
    pub sop_token_id: u32,
}

fn byte_level() -> ByteLevel {
    // No prefix space: encode(text) must decode back to exactly `text`.
    ByteLevel::new(false, true, true)
}

/// Trains a byte-level BPE on [`DEMO_CORPUS`] with the GLM special tokens.
///
/// `vocab_size` counts everything (special tokens, the 256 byte symbols and the
/// merges); it must be at least 17 + 256. Training is single-sequence and the
/// trainer breaks ties by pair ids, so the serialised JSON is identical on every run.
pub fn train_demo_tokenizer(vocab_size: usize) -> Result<Tokenizer> {
    let min = SPECIAL_TOKENS.len() + 256;
    if vocab_size < min {
        bail!("demo tokenizer vocab_size {vocab_size} is too small: need at least {min}");
    }
    let specials: Vec<AddedToken> = SPECIAL_TOKENS
        .iter()
        .map(|t| AddedToken::from(*t, true))
        .collect();
    let alphabet: HashSet<char> = ByteLevel::alphabet().into_iter().collect();
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(specials.clone())
        .initial_alphabet(alphabet)
        .build();

    let mut tk = TokenizerBuilder::<BPE, NormalizerWrapper, ByteLevel, ByteLevel, ByteLevel>::new()
        .with_model(BPE::default())
        .with_normalizer(None)
        .with_pre_tokenizer(Some(byte_level()))
        .with_post_processor(Some(byte_level()))
        .with_decoder(Some(byte_level()))
        .build()
        .map_err(|e| anyhow!("building demo tokenizer: {e}"))?;
    tk.train(&mut trainer, std::iter::once(DEMO_CORPUS))
        .map_err(|e| anyhow!("training demo tokenizer: {e}"))?;
    // `train` registers the trainer's special tokens; make sure all are there as
    // special added tokens (idempotent).
    tk.add_special_tokens(&specials);

    let tokenizer = Tokenizer::from(tk);
    for (i, t) in SPECIAL_TOKENS.iter().enumerate() {
        let id = tokenizer.token_to_id(t);
        if id != Some(i as u32) {
            bail!("demo tokenizer: special token {t} got id {id:?}, expected {i}");
        }
    }
    Ok(tokenizer)
}

/// The HF-style `tokenizer_config.json` for a tokenizer with GLM special tokens.
fn tokenizer_config(tokenizer: &Tokenizer, chat_template: &str) -> Value {
    let mut decoder: Vec<(u32, tokenizers::AddedToken)> =
        tokenizer.get_added_tokens_decoder().into_iter().collect();
    decoder.sort_by_key(|(id, _)| *id);
    let mut added = Map::new();
    for (id, t) in decoder {
        added.insert(
            id.to_string(),
            json!({
                "content": t.content,
                "lstrip": t.lstrip,
                "normalized": t.normalized,
                "rstrip": t.rstrip,
                "single_word": t.single_word,
                "special": t.special,
            }),
        );
    }
    let additional: Vec<&str> = SPECIAL_TOKENS
        .iter()
        .copied()
        .filter(|t| *t != EOS_TOKEN)
        .collect();
    json!({
        "added_tokens_decoder": added,
        "additional_special_tokens": additional,
        "bos_token": null,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": false,
        "do_lower_case": false,
        "eos_token": EOS_TOKEN,
        "extra_special_tokens": {},
        "model_max_length": 131072,
        "pad_token": EOS_TOKEN,
        "padding_side": "left",
        "remove_space": false,
        "tokenizer_class": "PreTrainedTokenizerFast",
    })
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))
}

/// Trains the demo tokenizer and writes `tokenizer.json`, `tokenizer_config.json`
/// and `chat_template.jinja` into `dir` (created if missing). Deterministic.
pub fn write_demo_tokenizer_files(dir: &Path, vocab_size: usize) -> Result<DemoTokenizerInfo> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tokenizer = train_demo_tokenizer(vocab_size)?;
    let json = tokenizer
        .to_string(true)
        .map_err(|e| anyhow!("serialising demo tokenizer: {e}"))?;
    write_file(&dir.join(TOKENIZER_FILE), json.as_bytes())?;
    let config = tokenizer_config(&tokenizer, DEMO_CHAT_TEMPLATE);
    let mut config_text = serde_json::to_string_pretty(&config)?;
    config_text.push('\n');
    write_file(&dir.join(TOKENIZER_CONFIG_FILE), config_text.as_bytes())?;
    write_file(&dir.join(CHAT_TEMPLATE_FILE), DEMO_CHAT_TEMPLATE.as_bytes())?;

    let id = |t: &str| {
        tokenizer
            .token_to_id(t)
            .ok_or_else(|| anyhow!("demo tokenizer has no token {t}"))
    };
    Ok(DemoTokenizerInfo {
        vocab_size: tokenizer.get_vocab_size(true),
        eos_token_id: id(EOS_TOKEN)?,
        stop_token_ids: STOP_TOKENS.iter().map(|t| id(t)).collect::<Result<_>>()?,
        gmask_token_id: id("[gMASK]")?,
        sop_token_id: id("<sop>")?,
    })
}
