//! Splits GLM chat output into reasoning (`<think>...</think>`), content and tool calls
//! (`<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>`), as text
//! arrives: a marker split across deltas is held back until it is whole.

use serde_json::{Map, Value};
use std::collections::HashMap;
use std::sync::Arc;

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const TOOL_OPEN: &str = "<tool_call>";
const TOOL_CLOSE: &str = "</tool_call>";

/// Keywords of a schema that only says things about strings (or nothing at all).
const TEXT_KEYWORDS: [&str; 7] = [
    "type",
    "enum",
    "const",
    "pattern",
    "minLength",
    "maxLength",
    "format",
];

/// Keywords that annotate a schema without constraining values.
pub const ANNOTATIONS: [&str; 15] = [
    "$anchor",
    "$defs",
    "definitions",
    "$schema",
    "$id",
    "id",
    "$comment",
    "title",
    "description",
    "default",
    "readOnly",
    "writeOnly",
    "examples",
    "contentMediaType",
    "contentEncoding",
];

/// Whether an argument with this schema is written as raw text in GLM's tool-call format
/// (as the chat template renders string values), not as JSON: the schema admits only
/// strings (`"type": "string"`, or string `enum` / `const` values) or says nothing.
pub fn is_text_schema(schema: Option<&Value>) -> bool {
    let Some(o) = schema.and_then(Value::as_object) else {
        return !matches!(schema, Some(Value::Bool(false)));
    };
    let all_strings = |k: &str| match o.get(k) {
        None => true,
        Some(Value::Array(a)) => a.iter().all(Value::is_string),
        Some(v) => v.is_string(),
    };
    match o.get("type") {
        Some(Value::String(t)) if t == "string" => {
            return all_strings("enum") && all_strings("const");
        }
        Some(Value::Array(t)) if t.len() == 1 && t[0] == "string" => {
            return all_strings("enum") && all_strings("const");
        }
        Some(_) => return false,
        None => {}
    }
    all_strings("enum")
        && all_strings("const")
        && o.keys()
            .all(|k| TEXT_KEYWORDS.contains(&k.as_str()) || ANNOTATIONS.contains(&k.as_str()))
}

/// Per tool, which arguments are raw text and which are JSON, from `tools`' schemas: the
/// grammar of a forced call and the parser of every call read them alike.
#[derive(Debug, Default)]
pub struct ArgFormats {
    /// Tool name -> argument name -> written as raw text.
    tools: HashMap<String, HashMap<String, bool>>,
}

impl ArgFormats {
    pub fn of(tools: &[Value]) -> ArgFormats {
        let mut out = HashMap::new();
        for tool in tools {
            let f = tool.get("function").unwrap_or(tool);
            let Some(name) = f.get("name").and_then(Value::as_str) else {
                continue;
            };
            let props = f
                .get("parameters")
                .and_then(|p| p.get("properties"))
                .and_then(Value::as_object);
            let args = props
                .into_iter()
                .flatten()
                .map(|(k, v)| (k.clone(), is_text_schema(Some(v))))
                .collect();
            out.insert(name.to_string(), args);
        }
        ArgFormats { tools: out }
    }

    /// How `tool`'s argument `key` is written; `None` when `tools` does not say.
    fn is_text(&self, tool: &str, key: &str) -> Option<bool> {
        self.tools.get(tool)?.get(key).copied()
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Piece {
    Reasoning(String),
    Content(String),
    ToolCall { name: String, arguments: String },
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum State {
    /// Nothing but whitespace yet: a `<think>` may still come.
    Start,
    Reasoning,
    /// Right after `</think>` or a tool call: leading whitespace is dropped.
    ContentStart,
    Content,
    ToolCall,
}

#[derive(Debug)]
pub struct ChatParser {
    state: State,
    buf: String,
    /// Tool calls are parsed (tools given, not `tool_choice: none`), their arguments read
    /// as these formats say.
    tools: Option<Arc<ArgFormats>>,
}

impl ChatParser {
    /// `in_reasoning`: the prompt ends inside an open `<think>` (GLM-4.7+/GLM-5 templates
    /// open it in the generation prompt when thinking is on), so the output is reasoning
    /// until `</think>`.
    pub fn new(tools: Option<Arc<ArgFormats>>, in_reasoning: bool) -> ChatParser {
        ChatParser {
            state: if in_reasoning {
                State::Reasoning
            } else {
                State::Start
            },
            buf: String::new(),
            tools,
        }
    }

    /// Feeds a text delta; returns the pieces it completed.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.state {
                State::Start => {
                    let t = self.buf.trim_start();
                    if t.is_empty() {
                        break;
                    }
                    if let Some(rest) = t.strip_prefix(THINK_OPEN) {
                        self.buf = rest.to_string();
                        self.state = State::Reasoning;
                    } else if THINK_OPEN.starts_with(t) {
                        break;
                    } else {
                        self.buf = t.to_string();
                        self.state = State::Content;
                    }
                }
                State::Reasoning => {
                    if let Some(at) = self.buf.find(THINK_CLOSE) {
                        let r = self.buf[..at].to_string();
                        self.buf.drain(..at + THINK_CLOSE.len());
                        push_piece(&mut out, Piece::Reasoning(r));
                        self.state = State::ContentStart;
                    } else {
                        let keep = partial_suffix(&self.buf, THINK_CLOSE);
                        let r: String = self.buf.drain(..self.buf.len() - keep).collect();
                        push_piece(&mut out, Piece::Reasoning(r));
                        break;
                    }
                }
                State::ContentStart => {
                    let t = self.buf.trim_start();
                    if t.is_empty() {
                        self.buf.clear();
                        break;
                    }
                    self.buf = t.to_string();
                    self.state = State::Content;
                }
                State::Content => {
                    let open = if self.tools.is_some() {
                        self.buf.find(TOOL_OPEN)
                    } else {
                        None
                    };
                    if let Some(at) = open {
                        let c = self.buf[..at].to_string();
                        self.buf.drain(..at + TOOL_OPEN.len());
                        push_piece(&mut out, Piece::Content(c));
                        self.state = State::ToolCall;
                    } else {
                        let keep = if self.tools.is_some() {
                            partial_suffix(&self.buf, TOOL_OPEN)
                        } else {
                            0
                        };
                        let c: String = self.buf.drain(..self.buf.len() - keep).collect();
                        push_piece(&mut out, Piece::Content(c));
                        break;
                    }
                }
                State::ToolCall => {
                    let Some(at) = self.buf.find(TOOL_CLOSE) else {
                        break;
                    };
                    let body = self.buf[..at].to_string();
                    self.buf.drain(..at + TOOL_CLOSE.len());
                    out.push(parse_tool_call(&body, self.tools.as_deref()));
                    self.state = State::ContentStart;
                }
            }
        }
        out
    }

    /// Flushes what is held back at the end of generation (an unterminated tool call stays
    /// content, verbatim).
    pub fn finish(&mut self) -> Vec<Piece> {
        let rest = std::mem::take(&mut self.buf);
        let piece = match self.state {
            State::Reasoning => Piece::Reasoning(rest),
            State::ToolCall => Piece::Content(format!("{TOOL_OPEN}{rest}")),
            State::Start | State::ContentStart => Piece::Content(rest.trim_start().to_string()),
            State::Content => Piece::Content(rest),
        };
        let mut out = Vec::new();
        push_piece(&mut out, piece);
        out
    }
}

fn push_piece(out: &mut Vec<Piece>, p: Piece) {
    match &p {
        Piece::Reasoning(s) | Piece::Content(s) if s.is_empty() => {}
        _ => out.push(p),
    }
}

/// Length of the longest proper prefix of `marker` that `text` ends with.
fn partial_suffix(text: &str, marker: &str) -> usize {
    (1..marker.len())
        .rev()
        .find(|&k| text.ends_with(&marker[..k]))
        .unwrap_or(0)
}

/// `name<arg_key>k</arg_key><arg_value>v</arg_value>...` (or a JSON object with `name` and
/// `arguments`) into a call whose arguments are a JSON object string. An argument that
/// `formats` says is raw text stays text; one it says is JSON is read as JSON (text when it
/// is not); of the others, values that are JSON but not a string (numbers, booleans,
/// objects, arrays) keep their type and the rest are text.
pub fn parse_tool_call(body: &str, formats: Option<&ArgFormats>) -> Piece {
    let body = body.trim();
    if let Ok(Value::Object(obj)) = serde_json::from_str::<Value>(body)
        && let Some(Value::String(name)) = obj.get("name")
    {
        let args = obj
            .get("arguments")
            .cloned()
            .unwrap_or(Value::Object(Map::new()));
        let arguments = match args {
            Value::String(s) => s,
            other => other.to_string(),
        };
        return Piece::ToolCall {
            name: name.clone(),
            arguments,
        };
    }
    let (name, mut rest) = match body.find("<arg_key>") {
        Some(at) => (body[..at].trim(), &body[at..]),
        None => (body, ""),
    };
    let mut args = Map::new();
    while let Some(k0) = rest.find("<arg_key>") {
        let after_key = &rest[k0 + "<arg_key>".len()..];
        let Some(k1) = after_key.find("</arg_key>") else {
            break;
        };
        let key = after_key[..k1].trim().to_string();
        let after = &after_key[k1 + "</arg_key>".len()..];
        let Some(v0) = after.find("<arg_value>") else {
            break;
        };
        let after_v = &after[v0 + "<arg_value>".len()..];
        let (value, next) = match after_v.find("</arg_value>") {
            Some(v1) => (&after_v[..v1], &after_v[v1 + "</arg_value>".len()..]),
            None => (after_v, ""),
        };
        let text = formats.and_then(|f| f.is_text(name.trim(), &key));
        let parsed = match (text, serde_json::from_str::<Value>(value)) {
            (Some(true), _) | (_, Err(_)) => Value::String(value.to_string()),
            (Some(false), Ok(v)) => v,
            (None, Ok(v)) if !v.is_string() => v,
            (None, Ok(_)) => Value::String(value.to_string()),
        };
        args.insert(key, parsed);
        rest = next;
    }
    Piece::ToolCall {
        name: name.to_string(),
        arguments: Value::Object(args).to_string(),
    }
}

/// True when the rendered prompt leaves a `<think>` open for the model to continue.
pub fn opens_reasoning(prompt: &str) -> bool {
    prompt.trim_end().ends_with(THINK_OPEN)
}

/// Parses a whole completion at once (non-streaming responses).
pub fn parse_all(text: &str, tools: Option<Arc<ArgFormats>>, in_reasoning: bool) -> Vec<Piece> {
    let mut p = ChatParser::new(tools, in_reasoning);
    let mut out = p.push(text);
    out.extend(p.finish());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tool calls parsed, no tool's schema known.
    fn any_tools() -> Option<Arc<ArgFormats>> {
        Some(Arc::default())
    }

    fn merged(pieces: Vec<Piece>) -> (String, String, Vec<(String, String)>) {
        let (mut r, mut c, mut t) = (String::new(), String::new(), Vec::new());
        for p in pieces {
            match p {
                Piece::Reasoning(s) => r += &s,
                Piece::Content(s) => c += &s,
                Piece::ToolCall { name, arguments } => t.push((name, arguments)),
            }
        }
        (r, c, t)
    }

    const TEXT: &str = "\n<think>Weigh it.</think>\nIt is sunny.\n<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>";

    #[test]
    fn reasoning_content_and_tool_calls_whole() {
        let (r, c, t) = merged(parse_all(TEXT, any_tools(), false));
        assert_eq!(r, "Weigh it.");
        assert_eq!(c, "It is sunny.\n");
        assert_eq!(
            t,
            [(
                "get_weather".to_string(),
                r#"{"city":"Paris","days":3}"#.to_string()
            )]
        );
        // Without tools the call stays text; thinking off means no reasoning at all.
        let (_, c, t) = merged(parse_all(TEXT, None, false));
        assert!(t.is_empty() && c.contains("<tool_call>get_weather"));
        let (r, c, _) = merged(parse_all("\nplain answer", any_tools(), false));
        assert_eq!((r.as_str(), c.as_str()), ("", "plain answer"));
    }

    #[test]
    fn streaming_in_any_split_gives_the_same_pieces() {
        let whole = merged(parse_all(TEXT, any_tools(), false));
        let chars: Vec<char> = TEXT.chars().collect();
        for step in 1..12 {
            let mut p = ChatParser::new(any_tools(), false);
            let mut out = Vec::new();
            for chunk in chars.chunks(step) {
                out.extend(p.push(&chunk.iter().collect::<String>()));
            }
            out.extend(p.finish());
            assert_eq!(merged(out), whole, "chunks of {step}");
        }
    }

    #[test]
    fn a_prompt_that_opens_think_makes_the_output_reasoning_until_it_closes() {
        assert!(opens_reasoning("<|user|>\nhi<|assistant|><think>"));
        assert!(!opens_reasoning("<|user|>\nhi<|assistant|></think>"));
        let (r, c, t) = merged(parse_all("Weigh it.</think>\nSunny.", any_tools(), true));
        assert_eq!(
            (r.as_str(), c.as_str(), t.len()),
            ("Weigh it.", "Sunny.", 0)
        );
        // A model that never closes it (the random demo model) reasons to the end.
        let (r, c, _) = merged(parse_all("random words", any_tools(), true));
        assert_eq!((r.as_str(), c.as_str()), ("random words", ""));
        // Streamed in pieces, the split marker is held back.
        let mut p = ChatParser::new(any_tools(), true);
        let mut out = p.push("a</th");
        out.extend(p.push("ink>b"));
        out.extend(p.finish());
        assert_eq!(merged(out), ("a".into(), "b".into(), vec![]));
    }

    #[test]
    fn unterminated_markers_fall_back_to_text() {
        let (r, c, t) = merged(parse_all("<think>still thinking", any_tools(), false));
        assert_eq!((r.as_str(), c.as_str(), t.len()), ("still thinking", "", 0));
        let (_, c, t) = merged(parse_all("x <tool_call>f<arg_key>a", any_tools(), false));
        assert_eq!((c.as_str(), t.len()), ("x <tool_call>f<arg_key>a", 0));
        assert_eq!(
            parse_tool_call(r#"{"name":"f","arguments":{"a":1}}"#, None),
            Piece::ToolCall {
                name: "f".into(),
                arguments: r#"{"a":1}"#.into()
            }
        );
    }

    #[test]
    fn argument_formats_follow_the_schemas() {
        let schema = |v: Value| is_text_schema(Some(&v));
        assert!(schema(
            serde_json::json!({"type": "string", "maxLength": 3})
        ));
        assert!(schema(serde_json::json!({"enum": ["Oslo", "Paris"]})));
        assert!(schema(serde_json::json!({"description": "anything"})));
        assert!(is_text_schema(None));
        assert!(!schema(serde_json::json!({"enum": ["a", 1]})));
        assert!(!schema(serde_json::json!({"type": "integer"})));
        assert!(!schema(serde_json::json!({"anyOf": [{"type": "string"}]})));
        assert!(!schema(serde_json::json!({"type": ["string", "null"]})));
        let tools = [
            serde_json::json!({"type": "function", "function": {"name": "f",
            "parameters": {"type": "object", "properties": {
                "code": {"type": "string"}, "n": {"type": "integer"},
                "either": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}}}}),
        ];
        let formats = ArgFormats::of(&tools);
        let call = "f<arg_key>code</arg_key><arg_value>42</arg_value>\
            <arg_key>n</arg_key><arg_value>7</arg_value>\
            <arg_key>either</arg_key><arg_value>\"x\"</arg_value>\
            <arg_key>other</arg_key><arg_value>true</arg_value>";
        let Piece::ToolCall { arguments, .. } = parse_tool_call(call, Some(&formats)) else {
            panic!("not a call");
        };
        // A string argument stays the text written, even when it reads as JSON; a JSON one
        // is decoded (a quoted string too); an unknown one keeps the old reading.
        assert_eq!(
            arguments,
            r#"{"code":"42","n":7,"either":"x","other":true}"#
        );
        let Piece::ToolCall { arguments, .. } = parse_tool_call(call, None) else {
            panic!("not a call");
        };
        assert_eq!(
            arguments,
            r#"{"code":42,"n":7,"either":"\"x\"","other":true}"#
        );
    }
}
