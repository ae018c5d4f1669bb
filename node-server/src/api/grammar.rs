//! Constrained chat output: `response_format` (JSON, or JSON matching a schema) and a
//! forced `tool_choice` (a GLM tool call of one of `tools`) become a Lark grammar, which
//! the engine's llguidance compiles into a constraint on every choice.

use super::ApiError;
use crate::engine::constraint::lark_literal;
use crate::engine::scheduler::{Engine, GenRequest};
use crate::tokenizer::TextCodec;
use serde_json::{Value, json};

/// What `tool_choice` asks of the output.
pub(super) struct ToolChoice {
    /// Whether tool calls are parsed out of the output (`tools` given, and not `none`).
    pub(super) parse: bool,
    /// The tools a forced call picks from (`required`, or the one function named).
    pub(super) forced: Option<Vec<Value>>,
}

/// Reads `tool_choice` against `tools`.
pub(super) fn tool_choice(
    choice: Option<&Value>,
    tools: Option<&[Value]>,
) -> Result<ToolChoice, ApiError> {
    let tools = tools.unwrap_or_default();
    let mut parse = !tools.is_empty();
    let mut forced = None;
    match choice {
        None => {}
        Some(Value::String(s)) if s == "auto" => {}
        Some(Value::String(s)) if s == "none" => parse = false,
        Some(Value::String(s)) if s == "required" => {
            if tools.is_empty() {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "`tool_choice` \"required\" needs at least one tool in `tools`.",
                ));
            }
            forced = Some(tools.to_vec());
        }
        Some(Value::Object(o)) if o.get("function").and_then(|f| f.get("name")).is_some() => {
            let name = o["function"]["name"].as_str().unwrap_or_default();
            let Some(tool) = tools.iter().find(|t| tool_name(t) == Some(name)) else {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("`tool_choice` names {name:?}, which is not in `tools`."),
                ));
            };
            forced = Some(vec![tool.clone()]);
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "tool_choice",
                "`tool_choice` must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}.",
            ));
        }
    }
    Ok(ToolChoice { parse, forced })
}

/// The grammar a chat's output must follow and the parameter it comes from: the
/// `response_format`'s or a forced tool call's (not both); `None` for free output.
/// `close_think`: the prompt left `<think>` open, so the output starts by closing it.
pub(super) fn chat_grammar(
    codec: &TextCodec,
    response_format: Option<&Value>,
    forced: Option<&[Value]>,
    close_think: bool,
) -> Result<Option<(String, &'static str)>, ApiError> {
    let format = match response_format {
        Some(rf) => response_format_grammar(codec, rf, close_think)?,
        None => None,
    };
    match (forced, format) {
        (Some(_), Some(_)) => Err(ApiError::invalid(
            "response_format",
            "`response_format` cannot be combined with a forced `tool_choice`.",
        )),
        (Some(tools), None) => Ok(Some((
            tool_call_grammar(codec, tools, close_think)?,
            "tool_choice",
        ))),
        (None, Some(grammar)) => Ok(Some((grammar, "response_format"))),
        (None, None) => Ok(None),
    }
}

fn tool_name(tool: &Value) -> Option<&str> {
    tool.get("function")
        .unwrap_or(tool)
        .get("name")
        .and_then(Value::as_str)
}

/// Most characters of one forced free-text argument value.
const MAX_ARG_CHARS: usize = 256;

/// `<[id]>`: a special token in a Lark grammar, by id.
fn special(codec: &TextCodec, param: &str, t: &str) -> Result<String, ApiError> {
    codec
        .token_to_id(t)
        .map(|id| format!("<[{id}]>"))
        .ok_or_else(|| {
            ApiError::invalid(
                param,
                format!(
                    "Constrained output needs the GLM special token {t}; this tokenizer has none."
                ),
            )
        })
}

/// The grammar of a forced GLM tool call: `<tool_call>NAME` (one of `tools`), then
/// `<arg_key>K</arg_key><arg_value>V</arg_value>` for each required parameter (all of them
/// when none is marked required), `</tool_call>`. A value whose schema is a string (or
/// says nothing) is free text; any other is JSON matching the parameter's schema.
/// `close_think`: the prompt left `<think>` open, so the call starts by closing it.
fn tool_call_grammar(
    codec: &TextCodec,
    tools: &[Value],
    close_think: bool,
) -> Result<String, ApiError> {
    let sp = |t| special(codec, "tool_choice", t);
    let (ak, akc, av, avc) = (
        sp("<arg_key>")?,
        sp("</arg_key>")?,
        sp("<arg_value>")?,
        sp("</arg_value>")?,
    );
    let mut rules = Vec::new();
    let mut alternatives = Vec::new();
    for (i, tool) in tools.iter().enumerate() {
        let name = tool_name(tool).ok_or_else(|| {
            ApiError::invalid(
                &format!("tools[{i}].function.name"),
                format!("`tools[{i}].function.name` must be a string."),
            )
        })?;
        let params = tool.get("function").unwrap_or(tool).get("parameters");
        let props = params
            .and_then(|p| p.get("properties"))
            .and_then(Value::as_object);
        let mut keys: Vec<String> = params
            .and_then(|p| p.get("required"))
            .and_then(Value::as_array)
            .map(|r| {
                r.iter()
                    .filter_map(|k| k.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        if keys.is_empty() {
            keys = props
                .map(|o| o.keys().cloned().collect())
                .unwrap_or_default();
        }
        let mut body = vec![lark_literal(name)];
        for (j, k) in keys.iter().enumerate() {
            let schema = props.and_then(|p| p.get(k));
            let free_text = schema
                .and_then(|s| s.get("type"))
                .is_none_or(|t| t == "string");
            let value = if free_text {
                "ARG_TEXT".to_string()
            } else {
                let rule = format!("value_{i}_{j}");
                let schema = compact(schema.cloned().unwrap_or(json!({})));
                rules.push(format!("{rule}: %json {schema}"));
                rule
            };
            body.push(format!("{ak} {} {akc} {av} {value} {avc}", lark_literal(k)));
        }
        rules.push(format!("call_{i}: {}", body.join(" ")));
        alternatives.push(format!("call_{i}"));
    }
    let opening = if close_think {
        format!("{} \"\\n\" {}", sp("</think>")?, sp("<tool_call>")?)
    } else {
        format!("\"\\n\" {}", sp("<tool_call>")?)
    };
    Ok(format!(
        "start: {opening} ({}) {}\n{}\nARG_TEXT: /(?s:.{{1,{MAX_ARG_CHARS}}})/\n",
        alternatives.join(" | "),
        sp("</tool_call>")?,
        rules.join("\n"),
    ))
}

/// Longest key, string, array and object of `json_object` output.
const JSON_OBJECT_KEY_CHARS: usize = 64;
const JSON_OBJECT_STRING_CHARS: usize = 512;
const JSON_OBJECT_ITEMS: usize = 64;

/// `json_object`: any JSON object, with keys, strings, arrays and objects bounded so that
/// even a model that never closes a string on its own ends within a known length.
fn json_object_schema() -> Value {
    let object = json!({
        "type": "object",
        "patternProperties": {format!("^.{{1,{JSON_OBJECT_KEY_CHARS}}}$"): {"$ref": "#/$defs/value"}},
        "additionalProperties": false,
        "maxProperties": JSON_OBJECT_ITEMS,
    });
    let mut schema = object.clone();
    schema["$defs"] = json!({"value": {"anyOf": [
        {"type": "string", "maxLength": JSON_OBJECT_STRING_CHARS},
        {"type": "number"},
        {"type": "boolean"},
        {"type": "null"},
        {"type": "array", "items": {"$ref": "#/$defs/value"}, "maxItems": JSON_OBJECT_ITEMS},
        object,
    ]}});
    schema
}

/// `schema` asking llguidance for compact JSON: a weak model could otherwise pad with
/// whitespace forever.
fn compact(mut schema: Value) -> Value {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance")
            .or_insert_with(|| json!({"whitespace_flexible": false}));
    }
    schema
}

/// The grammar of `response_format` (`None` for plain text): JSON matching the schema,
/// after closing an open `<think>` (structured output skips the reasoning).
fn response_format_grammar(
    codec: &TextCodec,
    rf: &Value,
    close_think: bool,
) -> Result<Option<String>, ApiError> {
    let bad = |field: &str, msg: &str| {
        ApiError::invalid("response_format", format!("`response_format{field}` {msg}"))
    };
    let Some(obj) = rf.as_object() else {
        return Err(bad("", "must be an object with a `type`."));
    };
    let schema = match obj.get("type").and_then(Value::as_str) {
        Some("text") => return Ok(None),
        Some("json_object") => json_object_schema(),
        Some("json_schema") => {
            let Some(js) = obj.get("json_schema").and_then(Value::as_object) else {
                return Err(bad(
                    ".json_schema",
                    "must be an object with `name` and `schema`.",
                ));
            };
            match js.get("name").and_then(Value::as_str) {
                Some(n)
                    if !n.is_empty()
                        && n.len() <= 64
                        && n.chars()
                            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') => {}
                _ => {
                    return Err(bad(
                        ".json_schema.name",
                        "must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -.",
                    ));
                }
            }
            if js
                .get("strict")
                .is_some_and(|s| !s.is_boolean() && !s.is_null())
            {
                return Err(bad(".json_schema.strict", "must be a boolean."));
            }
            match js.get("schema") {
                None => json!({"type": "object"}),
                Some(s @ Value::Object(_)) => s.clone(),
                Some(_) => return Err(bad(".json_schema.schema", "must be a JSON Schema object.")),
            }
        }
        Some(other) => {
            return Err(bad(
                ".type",
                &format!("must be \"text\", \"json_object\" or \"json_schema\", got {other:?}."),
            ));
        }
        None => return Err(bad(".type", "must be a string.")),
    };
    let schema = compact(schema);
    let opening = if close_think {
        special(codec, "response_format", "</think>")?
    } else {
        String::new()
    };
    Ok(Some(format!(
        "start: {opening} body\nbody: %json {schema}\n"
    )))
}

/// Compiles a grammar for every choice; a grammar the compiler refuses is the client's
/// fault and names `param`.
pub(super) fn constrain(
    engine: &Engine,
    reqs: &mut [GenRequest],
    grammar: &str,
    param: &str,
) -> Result<(), ApiError> {
    let grammars = engine.grammars().map_err(|e| {
        ApiError::invalid(
            param,
            format!("This model's tokenizer cannot be constrained: {e}"),
        )
    })?;
    let constraint = grammars.compile(grammar).map_err(|e| {
        ApiError::invalid(
            param,
            format!("`{param}` cannot be compiled to a grammar: {e:#}"),
        )
    })?;
    for r in reqs {
        r.constraint = Some(constraint.clone());
    }
    Ok(())
}
