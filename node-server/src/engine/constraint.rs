//! Constrained decoding through llguidance: a grammar (Lark, with `%json { schema }` for
//! JSON Schema parts and `<[id]>` for special tokens) is compiled against the tokenizer's
//! token trie, and each step the sampler only sees the tokens the grammar allows next.
//! This is how `response_format` (json_object / json_schema) and forced `tool_choice` give
//! well-formed output from any model, the random demo model included.
//!
//! [`Grammars`] holds the token trie and parser factory, built once per tokenizer;
//! [`Constraint`] is one sequence's matcher.

use crate::tokenizer::TextCodec;
use anyhow::{Context, Result, anyhow};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{InferenceCapabilities, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use std::sync::Arc;

/// The tokenizer as llguidance sees it: the bytes of every token (special tokens marked)
/// and an encoder for grammar literals.
struct CodecEnv {
    trie: TokTrie,
    codec: Arc<TextCodec>,
}

impl TokenizerEnv for CodecEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.codec
            .encode(&String::from_utf8_lossy(s))
            .unwrap_or_default()
    }
}

/// Compiles grammars for one tokenizer. Cheap to share.
pub struct Grammars {
    factory: ParserFactory,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Grammars")
    }
}

impl Grammars {
    /// Builds the token trie of `codec`'s tokenizer over `vocab_size` ids (the model's
    /// logits may cover more ids than the tokenizer has; those are never allowed).
    pub fn new(codec: Arc<TextCodec>, vocab_size: usize) -> Result<Grammars> {
        let json = serde_json::to_value(codec.tokenizer()).context("serialising the tokenizer")?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json)
            .context("reading token bytes from the tokenizer")?;
        let n = words.len().max(vocab_size);
        words.resize(n, Vec::new());
        let eos = *codec
            .eos_ids()
            .first()
            .ok_or_else(|| anyhow!("the tokenizer has no end-of-sequence token"))?;
        let info = TokRxInfo::new(n as u32, eos);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(CodecEnv { trie, codec });
        let mut factory = ParserFactory::new(
            &env,
            InferenceCapabilities::default(),
            &llguidance::earley::SlicedBiasComputer::general_slices(),
        )?;
        // Grammar warnings and errors reach the caller as values, not on stderr.
        factory.set_stderr_log_level(0);
        Ok(Grammars { factory })
    }

    /// Compiles a Lark grammar; the error says what is wrong with it. Grammars come from
    /// requests, so a panic inside the compiler is an error too.
    pub fn compile(&self, lark: &str) -> Result<Constraint> {
        let grammar = TopLevelGrammar::from_lark(lark.to_string());
        let parser = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.factory.create_parser(grammar)
        }))
        .map_err(|_| anyhow!("the grammar compiler failed on this grammar"))??;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(anyhow!(e));
        }
        Ok(Constraint { matcher })
    }
}

/// One sequence's grammar state.
pub struct Constraint {
    matcher: Matcher,
}

impl Clone for Constraint {
    fn clone(&self) -> Self {
        Constraint {
            matcher: self.matcher.deep_clone(),
        }
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl Constraint {
    /// True once the grammar is complete and nothing may follow (the sequence ends).
    pub fn done(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// Sets every logit the grammar does not allow next to -inf. A token the grammar
    /// allows keeps a finite logit even where the model gave it -inf, so a sample exists.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<()> {
        let allowed = self.matcher.compute_mask_or_eos()?;
        if allowed.num_set() == 0 {
            return Err(anyhow!("the grammar allows no next token"));
        }
        for (t, v) in logits.iter_mut().enumerate() {
            if !allowed.is_allowed(t as u32) {
                *v = f32::NEG_INFINITY;
            } else if !v.is_finite() {
                *v = 0.0;
            }
        }
        Ok(())
    }

    /// Records the sampled token (one the mask allowed).
    pub fn advance(&mut self, token: u32) -> Result<()> {
        self.matcher.consume_token(token)
    }
}

/// A Lark string literal for `s`.
pub fn lark_literal(s: &str) -> String {
    serde_json::Value::String(s.to_string()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `c` like a weak model: fresh random logits each step, sampled at temperature 1.
    fn run(mut c: Constraint, vocab: usize, max: usize, seed: u64) -> Vec<u32> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut sampler = crate::engine::sampling::Sampler::new(1.0, 1.0, seed);
        let mut out = Vec::new();
        while !c.done() && out.len() < max {
            let mut l: Vec<f32> = (0..vocab).map(|_| rng.random_range(-4.0..4.0)).collect();
            c.mask(&mut l).unwrap();
            let t = sampler.sample(&l);
            out.push(t);
            c.advance(t).unwrap();
        }
        out
    }

    fn demo_codec() -> Arc<TextCodec> {
        let dir = tempfile::tempdir().unwrap();
        crate::tokenizer::write_demo_tokenizer_files(dir.path(), crate::tokenizer::DEMO_VOCAB_SIZE)
            .unwrap();
        Arc::new(TextCodec::from_dir(dir.path()).unwrap())
    }

    #[test]
    fn json_schema_output_parses_and_matches_from_random_logits() {
        let codec = demo_codec();
        let g = Grammars::new(codec.clone(), codec.vocab_size()).unwrap();
        let schema = r#"{"type":"object","properties":{"n":{"type":"integer"},"ok":{"type":"boolean"}},"required":["n","ok"],"additionalProperties":false}"#;
        let eos = codec.eos_ids()[0];
        for seed in 0..6 {
            let c = g.compile(&format!("start: %json {schema}")).unwrap();
            let ids = run(c, codec.vocab_size(), 400, seed);
            let body: Vec<u32> = ids.iter().copied().filter(|&t| t != eos).collect();
            let text = codec.decode_with(&body, true).unwrap();
            let v: serde_json::Value =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
            assert!(v["n"].is_i64() && v["ok"].is_boolean(), "{text}");
            assert_eq!(v.as_object().unwrap().len(), 2);
        }
    }

    #[test]
    fn special_tokens_are_forced_by_id_and_bad_grammars_fail() {
        let codec = demo_codec();
        let g = Grammars::new(codec.clone(), codec.vocab_size()).unwrap();
        let open = codec.token_to_id("<tool_call>").unwrap();
        let close = codec.token_to_id("</tool_call>").unwrap();
        let c = g
            .compile(&format!(
                "start: <[{open}]> {} <[{close}]>",
                lark_literal("get_weather")
            ))
            .unwrap();
        let ids = run(c, codec.vocab_size(), 50, 1);
        assert_eq!(ids.first(), Some(&open));
        assert!(ids.contains(&close));
        let text = codec.decode_with(&ids, false).unwrap();
        assert!(
            text.starts_with("<tool_call>get_weather</tool_call>"),
            "{text}"
        );
        assert!(g.compile("start: %json {\"type\": 12}").is_err());
        assert!(g.compile("start: undefined_rule").is_err());
    }
}
