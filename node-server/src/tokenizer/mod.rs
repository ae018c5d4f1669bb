//! Text side of the model: the demo tokenizer (trained here, deterministically),
//! the GLM-style chat template, and [`TextCodec`], which loads `tokenizer.json`
//! plus a chat template from a model directory and does encode / decode /
//! streaming decode / chat rendering.
//!
//! Files in a model directory that this module reads or writes:
//! - `tokenizer.json`: a Hugging Face `tokenizers` serialisation (byte-level BPE here).
//! - `tokenizer_config.json`: HF-style config with `chat_template`, `bos_token`,
//!   `eos_token`, `pad_token` and `added_tokens_decoder`.
//! - `chat_template.jinja`: the same template as a file; preferred over the
//!   config's `chat_template` when both exist (as recent `transformers` does).

mod chat;
mod codec;
mod train;

#[cfg(test)]
mod tests;

pub use chat::{ChatTemplate, DEMO_CHAT_TEMPLATE};
pub use codec::{StreamDecoder, TextCodec};
pub use train::{
    DEMO_CORPUS, DEMO_VOCAB_SIZE, DemoTokenizerInfo, train_demo_tokenizer,
    write_demo_tokenizer_files,
};

/// GLM-style special tokens, in id order: the demo tokenizer gives them ids 0..17.
pub const SPECIAL_TOKENS: [&str; 17] = [
    "[gMASK]",
    "<sop>",
    "<|endoftext|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
];

/// The end-of-sequence token of GLM chat models.
pub const EOS_TOKEN: &str = "<|endoftext|>";

/// Tokens that end an assistant turn in GLM chat: end of text, the start of the
/// next user turn, or the start of a tool observation.
pub const STOP_TOKENS: [&str; 3] = ["<|endoftext|>", "<|user|>", "<|observation|>"];

/// File names inside a model directory.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";
