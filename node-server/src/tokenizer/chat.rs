//! Chat templates rendered with minijinja, configured like `transformers` renders
//! them (trim_blocks, lstrip_blocks, Python string methods, a Python-style `tojson`,
//! `raise_exception`).

use anyhow::{Result, anyhow};
use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind, UndefinedBehavior};

/// The GLM-4.5/5-style template shipped with the demo model.
pub const DEMO_CHAT_TEMPLATE: &str = include_str!("chat_template.jinja");

const TEMPLATE_NAME: &str = "chat_template";

/// A compiled chat template.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Where the template came from (a file name), for error messages.
    origin: String,
}

/// Formats a minijinja error as "ORIGIN: WHAT at line N: DETAIL".
fn describe(origin: &str, what: &str, err: &Error) -> anyhow::Error {
    let line = err
        .line()
        .map(|l| format!(" at line {l}"))
        .unwrap_or_default();
    let detail = err
        .detail()
        .map(str::to_owned)
        .unwrap_or_else(|| err.kind().to_string());
    let mut msg = format!("{origin}: {what}{line}: {detail}");
    // Errors raised from nested calls keep their cause.
    let mut source = std::error::Error::source(err);
    while let Some(s) = source {
        msg.push_str(&format!(": {s}"));
        source = s.source();
    }
    anyhow!(msg)
}

impl ChatTemplate {
    /// Compiles `source`; `origin` names where it came from in error messages
    /// (e.g. "model/chat_template.jinja").
    pub fn new(source: String, origin: impl Into<String>) -> Result<Self> {
        let origin = origin.into();
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|e| describe(&origin, "invalid chat template", &e))?;
        Ok(Self { env, origin })
    }

    /// Renders with the given context (messages, tools, add_generation_prompt, ...).
    pub fn render(&self, ctx: Value) -> Result<String> {
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| describe(&self.origin, "chat template", &e))?;
        tmpl.render(ctx)
            .map_err(|e| describe(&self.origin, "rendering chat template failed", &e))
    }

    pub fn origin(&self) -> &str {
        &self.origin
    }
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `tojson` as `transformers` defines it: `json.dumps(x, ensure_ascii=False)` with
/// Python's default separators (", " and ": "), optional `indent`, `ensure_ascii`,
/// `sort_keys` (keys are always in the order minijinja holds them).
fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match indent {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_usize() {
            Some(n) => Some(" ".repeat(n)),
            None => match v.as_str() {
                Some(s) => Some(s.to_owned()),
                None => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: indent must be an integer or a string",
                    ));
                }
            },
        },
    };
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let _ = kwargs.get::<Option<Value>>("sort_keys")?;
    let _ = kwargs.get::<Option<Value>>("separators")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(value).map_err(|e| {
        Error::new(ErrorKind::BadSerialization, "tojson: value is not JSON").with_source(e)
    })?;
    let mut out = String::new();
    write_py_json(&json, indent.as_deref(), 0, ensure_ascii, &mut out);
    Ok(Value::from_safe_string(out))
}

fn write_py_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7e) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn newline_indent(indent: &str, level: usize, out: &mut String) {
    out.push('\n');
    for _ in 0..level {
        out.push_str(indent);
    }
}

fn write_py_json(
    v: &serde_json::Value,
    indent: Option<&str>,
    level: usize,
    ensure_ascii: bool,
    out: &mut String,
) {
    use serde_json::Value as J;
    // Python: separators are (", ", ": ") without indent and (",", ": ") with it.
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        J::Null => out.push_str("null"),
        J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        J::Number(n) => out.push_str(&n.to_string()),
        J::String(s) => write_py_str(s, ensure_ascii, out),
        J::Array(items) => {
            if items.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                if let Some(ind) = indent {
                    newline_indent(ind, level + 1, out);
                }
                write_py_json(item, indent, level + 1, ensure_ascii, out);
            }
            if let Some(ind) = indent {
                newline_indent(ind, level, out);
            }
            out.push(']');
        }
        J::Object(map) => {
            if map.is_empty() {
                out.push_str("{}");
                return;
            }
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                if let Some(ind) = indent {
                    newline_indent(ind, level + 1, out);
                }
                write_py_str(k, ensure_ascii, out);
                out.push_str(": ");
                write_py_json(item, indent, level + 1, ensure_ascii, out);
            }
            if let Some(ind) = indent {
                newline_indent(ind, level, out);
            }
            out.push('}');
        }
    }
}
