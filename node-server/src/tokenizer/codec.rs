//! [`TextCodec`]: a model directory's tokenizer and chat template.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, anyhow, bail};
use minijinja::Value as JValue;
use serde_json::Value;
use tokenizers::Tokenizer;

use super::chat::ChatTemplate;
use super::{CHAT_TEMPLATE_FILE, STOP_TOKENS, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE};

/// Tokenizer + chat template of one model directory. Cheap to share (`Send + Sync`).
#[derive(Debug)]
pub struct TextCodec {
    tokenizer: Arc<Tokenizer>,
    template: Option<ChatTemplate>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    eos_ids: Vec<u32>,
    dir: PathBuf,
}

/// A special-token field of tokenizer_config.json: a string or `{"content": ...}`.
fn token_field(config: &Value, key: &str) -> Option<String> {
    match config.get(key)? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// `chat_template` of tokenizer_config.json: a string, or a list of
/// `{"name", "template"}` of which "default" (or the first) is used.
fn config_template(config: &Value, path: &Path) -> Result<Option<String>> {
    match config.get("chat_template") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(list)) => {
            let pick = list
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .or_else(|| list.first());
            match pick.and_then(|t| t.get("template")).and_then(Value::as_str) {
                Some(s) => Ok(Some(s.to_owned())),
                None => bail!(
                    "{}: chat_template is a list without a usable {{\"name\", \"template\"}} entry",
                    path.display()
                ),
            }
        }
        Some(other) => bail!(
            "{}: chat_template must be a string or a list, found {}",
            path.display(),
            match other {
                Value::Bool(_) => "a boolean",
                Value::Number(_) => "a number",
                _ => "an object",
            }
        ),
    }
}

impl TextCodec {
    /// Loads `dir/tokenizer.json` (required), `dir/tokenizer_config.json` (optional:
    /// special tokens and `chat_template`) and `dir/chat_template.jinja` (optional,
    /// preferred over the config's template). The template is compiled here, so a
    /// broken one fails the load with its file and line.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let tok_path = dir.join(TOKENIZER_FILE);
        if !tok_path.is_file() {
            bail!(
                "{}: missing: the model directory has no tokenizer",
                tok_path.display()
            );
        }
        let tokenizer = Tokenizer::from_file(&tok_path)
            .map_err(|e| anyhow!("{}: not a valid tokenizer: {e}", tok_path.display()))?;

        let cfg_path = dir.join(TOKENIZER_CONFIG_FILE);
        let config: Value = if cfg_path.is_file() {
            let text = std::fs::read_to_string(&cfg_path)
                .with_context(|| format!("reading {}", cfg_path.display()))?;
            serde_json::from_str(&text)
                .map_err(|e| anyhow!("{}: invalid JSON: {e}", cfg_path.display()))?
        } else {
            Value::Object(Default::default())
        };
        if !config.is_object() {
            bail!("{}: expected a JSON object", cfg_path.display());
        }

        let tmpl_path = dir.join(CHAT_TEMPLATE_FILE);
        let template = if tmpl_path.is_file() {
            let src = std::fs::read_to_string(&tmpl_path)
                .with_context(|| format!("reading {}", tmpl_path.display()))?;
            Some(ChatTemplate::new(src, tmpl_path.display().to_string())?)
        } else if let Some(src) = config_template(&config, &cfg_path)? {
            let origin = format!("{} (chat_template)", cfg_path.display());
            Some(ChatTemplate::new(src, origin)?)
        } else {
            None
        };

        let bos_token = token_field(&config, "bos_token");
        let eos_token = token_field(&config, "eos_token");
        let mut eos_ids = Vec::new();
        if let Some(eos) = &eos_token {
            match tokenizer.token_to_id(eos) {
                Some(id) => eos_ids.push(id),
                None => bail!(
                    "{}: eos_token {eos:?} is not in {}",
                    cfg_path.display(),
                    tok_path.display()
                ),
            }
        }
        // GLM chat also stops where the next user turn or a tool observation starts.
        let added = tokenizer.get_added_tokens_decoder();
        for t in STOP_TOKENS {
            if let Some((id, _)) = added.iter().find(|(_, a)| a.content == t && a.special) {
                eos_ids.push(*id);
            }
        }
        let mut seen = std::collections::HashSet::new();
        eos_ids.retain(|id| seen.insert(*id));

        Ok(Self {
            tokenizer: Arc::new(tokenizer),
            template,
            bos_token,
            eos_token,
            eos_ids,
            dir: dir.to_path_buf(),
        })
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Number of ids (model vocabulary plus added tokens).
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.tokenizer.id_to_token(id)
    }

    /// Ids that end generation: the config's eos token first, then those of
    /// `<|endoftext|>`, `<|user|>`, `<|observation|>` that exist as special tokens.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// Token ids of `text`. Nothing is added: special-token strings that occur in
    /// the text become their ids, everything else is byte-level BPE.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .tokenizer
            .encode_fast(text, false)
            .map_err(|e| anyhow!("encoding text: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.decode_with(ids, false)
    }

    pub fn decode_with(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        decode(&self.tokenizer, ids, skip_special_tokens)
    }

    /// An incremental decoder for generated ids; see [`StreamDecoder`].
    pub fn stream_decoder(&self, skip_special_tokens: bool) -> StreamDecoder {
        StreamDecoder::new(self.tokenizer.clone(), skip_special_tokens)
    }

    /// Renders an OpenAI-style `messages` array (and optional `tools` array) with
    /// the chat template. Tool-call `arguments` given as a JSON string are parsed
    /// into objects first, so templates can list them key by key.
    pub fn render_chat(
        &self,
        messages: &Value,
        tools: Option<&Value>,
        add_generation_prompt: bool,
        enable_thinking: bool,
    ) -> Result<String> {
        let extra = serde_json::json!({ "enable_thinking": enable_thinking });
        self.render_chat_with(messages, tools, add_generation_prompt, Some(&extra))
    }

    /// Like [`render_chat`](TextCodec::render_chat), with extra template variables
    /// (an object, e.g. a request's `chat_template_kwargs`; `enable_thinking` left
    /// out means thinking on). `messages`, `tools` and `add_generation_prompt` win
    /// over same-named entries of `extra`.
    pub fn render_chat_with(
        &self,
        messages: &Value,
        tools: Option<&Value>,
        add_generation_prompt: bool,
        extra: Option<&Value>,
    ) -> Result<String> {
        let Some(template) = &self.template else {
            bail!(
                "{}: no chat template (neither {CHAT_TEMPLATE_FILE} nor chat_template in {TOKENIZER_CONFIG_FILE})",
                self.dir.display()
            );
        };
        if !messages.is_array() {
            bail!("render_chat: messages must be a JSON array");
        }
        let mut ctx = serde_json::Map::new();
        ctx.insert(
            "bos_token".into(),
            self.bos_token.clone().unwrap_or_default().into(),
        );
        ctx.insert(
            "eos_token".into(),
            self.eos_token.clone().unwrap_or_default().into(),
        );
        match extra {
            None | Some(Value::Null) => {}
            Some(Value::Object(map)) => {
                ctx.extend(map.iter().map(|(k, v)| (k.clone(), v.clone())));
            }
            Some(_) => bail!("render_chat: extra template variables must be a JSON object"),
        }
        ctx.insert("messages".into(), normalize_tool_call_arguments(messages));
        ctx.insert("tools".into(), tools.cloned().unwrap_or(Value::Null));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::Bool(add_generation_prompt),
        );
        template.render(JValue::from_serialize(&ctx))
    }
}

/// Copies `messages`, replacing `tool_calls[].function.arguments` strings that hold a
/// JSON object with that object.
fn normalize_tool_call_arguments(messages: &Value) -> Value {
    let mut out = messages.clone();
    if let Some(list) = out.as_array_mut() {
        for m in list {
            let Some(calls) = m.get_mut("tool_calls").and_then(Value::as_array_mut) else {
                continue;
            };
            for call in calls {
                let target = match call.get_mut("function") {
                    Some(f) if f.is_object() => f,
                    _ => call,
                };
                if let Some(Value::String(s)) = target.get("arguments")
                    && let Ok(parsed @ Value::Object(_)) = serde_json::from_str::<Value>(s)
                {
                    target["arguments"] = parsed;
                }
            }
        }
    }
    out
}

fn decode(tokenizer: &Tokenizer, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
    tokenizer
        .decode(ids, skip_special_tokens)
        .map_err(|e| anyhow!("decoding {} ids: {e}", ids.len()))
}

/// After this many held-back ids a trailing U+FFFD is taken as real text (a UTF-8
/// character is at most 4 bytes, and every id carries at least one).
const MAX_HELD_IDS: usize = 8;

/// Turns generated ids into text deltas as they arrive. A multi-byte character
/// split across ids is held back until its last byte arrives, so every delta is
/// whole characters and the concatenation of all deltas (plus [`finish`]) equals
/// decoding all ids at once.
///
/// [`finish`]: StreamDecoder::finish
#[derive(Debug)]
pub struct StreamDecoder {
    tokenizer: Arc<Tokenizer>,
    skip_special_tokens: bool,
    ids: Vec<u32>,
    /// Ids before `prefix` are done; `prefix..read` is context already emitted.
    prefix: usize,
    read: usize,
    /// Bytes of text past `decode(ids[prefix..read])` already emitted.
    emitted_extra: usize,
}

impl StreamDecoder {
    pub fn new(tokenizer: Arc<Tokenizer>, skip_special_tokens: bool) -> Self {
        Self {
            tokenizer,
            skip_special_tokens,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
            emitted_extra: 0,
        }
    }

    /// Adds one id; returns the newly completed text (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let base = decode(
            &self.tokenizer,
            &self.ids[self.prefix..self.read],
            self.skip_special_tokens,
        )?;
        let text = decode(
            &self.tokenizer,
            &self.ids[self.prefix..],
            self.skip_special_tokens,
        )?;
        let held = self.ids.len() - self.read;
        let stable_end = if held < MAX_HELD_IDS {
            text.trim_end_matches('\u{FFFD}').len()
        } else {
            text.len()
        };
        let already = base.len() + self.emitted_extra;
        let delta = match text.get(already..stable_end) {
            Some(d) if stable_end > already => d.to_owned(),
            _ => String::new(),
        };
        if stable_end == text.len() {
            self.prefix = self.read;
            self.read = self.ids.len();
            self.emitted_extra = 0;
        } else {
            self.emitted_extra = already.max(stable_end) - base.len();
        }
        Ok(delta)
    }

    /// Adds several ids; returns the text they completed.
    pub fn push_all(&mut self, ids: &[u32]) -> Result<String> {
        let mut out = String::new();
        for &id in ids {
            out.push_str(&self.push(id)?);
        }
        Ok(out)
    }

    /// Flushes what is held back (an incomplete character becomes U+FFFD) and resets.
    pub fn finish(&mut self) -> Result<String> {
        let base = decode(
            &self.tokenizer,
            &self.ids[self.prefix..self.read],
            self.skip_special_tokens,
        )?;
        let text = decode(
            &self.tokenizer,
            &self.ids[self.prefix..],
            self.skip_special_tokens,
        )?;
        let already = base.len() + self.emitted_extra;
        let rest = text.get(already..).unwrap_or_default().to_owned();
        self.ids.clear();
        self.prefix = 0;
        self.read = 0;
        self.emitted_extra = 0;
        Ok(rest)
    }

    /// All ids pushed since the last [`finish`](StreamDecoder::finish).
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
}
