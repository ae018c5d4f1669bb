//! Constrained chat output: `response_format` (JSON, or JSON matching a schema) and a
//! forced `tool_choice` (a GLM tool call of one of `tools`, each argument held to its
//! parameter's JSON Schema) become a Lark grammar, which the engine's llguidance compiles
//! into a constraint on every choice. JSON values go through llguidance's JSON Schema
//! compiler (`%json`); string arguments, which GLM writes as raw text, become terminals of
//! their own ([`text_terminal`]). [`check_tools`] refuses, naming the field, what the
//! grammar could not hold the output to.

use super::ApiError;
use super::parse::{ANNOTATIONS, ArgFormats, is_text_schema};
use crate::engine::constraint::{Grammars, lark_literal};
use crate::engine::scheduler::{Engine, GenRequest};
use crate::tokenizer::TextCodec;
use serde_json::{Map, Value, json};
use std::sync::Arc;

/// What `tool_choice` asks of the output.
pub(super) struct ToolChoice {
    /// How tool calls' arguments are read, when calls are parsed out of the output (`tools`
    /// given, and not `none`).
    pub(super) parse: Option<Arc<ArgFormats>>,
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
    let parse = parse.then(|| Arc::new(ArgFormats::of(tools)));
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

/// Most characters of a raw-text argument value whose schema sets no `maxLength`: a weak
/// model that never ends a value on its own still ends it.
const MAX_ARG_CHARS: usize = 256;

/// Keywords a tool parameter's schema may use with `strict: true`: those the grammar
/// enforces (llguidance's JSON Schema compiler for JSON arguments, [`text_terminal`] for
/// raw-text ones), besides annotations.
const ENFORCED: [&str; 27] = [
    "anyOf",
    "oneOf",
    "allOf",
    "$ref",
    "const",
    "enum",
    "type",
    "items",
    "additionalItems",
    "prefixItems",
    "minItems",
    "maxItems",
    "properties",
    "additionalProperties",
    "patternProperties",
    "required",
    "minProperties",
    "maxProperties",
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
];

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

/// A tool's function object, the path of its fields in the request, and `strict`.
fn function_of(i: usize, tool: &Value) -> Result<(&Value, String, bool), ApiError> {
    let (f, base) = match tool.get("function") {
        Some(f) => (f, format!("tools[{i}].function")),
        None => (tool, format!("tools[{i}]")),
    };
    let strict = match f.get("strict") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            let field = format!("{base}.strict");
            return Err(ApiError::invalid(
                &field,
                format!("`{field}` must be a boolean."),
            ));
        }
    };
    Ok((f, base, strict))
}

/// Checks every tool's parameter schema before anything runs: with `strict: true` each
/// keyword must be one the grammar enforces, and every `pattern` must be a regular
/// expression the grammar compiler takes (checked when `grammars` is given). Errors name
/// the field, e.g. `tools[0].function.parameters.properties.city.pattern`.
pub(super) fn check_tools(tools: &[Value], grammars: Option<&Grammars>) -> Result<(), ApiError> {
    for (i, tool) in tools.iter().enumerate() {
        let (f, base, strict) = function_of(i, tool)?;
        if let Some(params) = f.get("parameters") {
            check_schema(params, &format!("{base}.parameters"), strict, grammars)?;
        }
    }
    Ok(())
}

fn check_schema(
    schema: &Value,
    path: &str,
    strict: bool,
    grammars: Option<&Grammars>,
) -> Result<(), ApiError> {
    let o = match schema {
        Value::Bool(_) => return Ok(()),
        Value::Object(o) => o,
        _ => {
            return Err(ApiError::invalid(
                path,
                format!("`{path}` must be a JSON Schema object."),
            ));
        }
    };
    for (k, v) in o {
        let here = format!("{path}.{k}");
        if strict && !ENFORCED.contains(&k.as_str()) && !ANNOTATIONS.contains(&k.as_str()) {
            return Err(ApiError::invalid(
                &here,
                format!(
                    "`{here}` is not supported with `strict: true`: the output cannot be held to it. Supported keywords: {}.",
                    ENFORCED.join(", ")
                ),
            ));
        }
        match (k.as_str(), v) {
            ("pattern", _) => check_pattern(v, &here, grammars)?,
            ("properties" | "patternProperties" | "$defs" | "definitions", Value::Object(m)) => {
                for (name, sub) in m {
                    check_schema(sub, &format!("{here}.{name}"), strict, grammars)?;
                }
            }
            ("items" | "additionalProperties" | "additionalItems", Value::Object(_)) => {
                check_schema(v, &here, strict, grammars)?;
            }
            ("items" | "prefixItems" | "anyOf" | "oneOf" | "allOf", Value::Array(a)) => {
                for (j, sub) in a.iter().enumerate() {
                    check_schema(sub, &format!("{here}[{j}]"), strict, grammars)?;
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// A `pattern` compiles as the JSON grammar compiles it.
fn check_pattern(v: &Value, path: &str, grammars: Option<&Grammars>) -> Result<(), ApiError> {
    let Some(p) = v.as_str() else {
        return Err(ApiError::invalid(
            path,
            format!("`{path}` must be a string (a regular expression)."),
        ));
    };
    if let Some(g) = grammars {
        let probe = json!({"type": "string", "pattern": p});
        g.compile(&format!("start: %json {probe}")).map_err(|e| {
            ApiError::invalid(
                path,
                format!("`{path}` is not a regular expression this server can enforce: {e:#}"),
            )
        })?;
    }
    Ok(())
}

/// The grammar of a forced GLM tool call: `<tool_call>NAME` (one of `tools`), then
/// `<arg_key>K</arg_key><arg_value>V</arg_value>` for each required parameter (all of them
/// when none is marked required), `</tool_call>`. As the chat template writes them, a value
/// whose schema admits only strings (or says nothing) is raw text held to the schema by
/// [`text_terminal`]; any other is JSON matching the parameter's schema (llguidance's JSON
/// Schema compiler; lenient about keywords it cannot enforce unless the tool is `strict`).
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
        let (f, base, strict) = function_of(i, tool)?;
        let params = f.get("parameters");
        let props = params
            .and_then(|p| p.get("properties"))
            .and_then(Value::as_object);
        // A parameter's `$ref`s point into the parameters' definitions.
        let defs: Map<String, Value> = ["$defs", "definitions"]
            .into_iter()
            .filter_map(|d| Some((d.to_string(), params?.get(d)?.clone())))
            .collect();
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
            let path = format!("{base}.parameters.properties.{k}");
            let value = if is_text_schema(schema) {
                let terminal = format!("TEXT_{i}_{j}");
                match text_terminal(schema, &path, strict)? {
                    (None, _) => String::new(),
                    (Some(rule), may_be_empty) => {
                        rules.push(format!("{terminal}: {rule}"));
                        if may_be_empty {
                            format!("{terminal}?")
                        } else {
                            terminal
                        }
                    }
                }
            } else {
                let rule = format!("value_{i}_{j}");
                let mut schema = schema.cloned().unwrap_or(json!({}));
                if let Some(o) = schema.as_object_mut() {
                    for (d, v) in &defs {
                        o.entry(d.clone()).or_insert_with(|| v.clone());
                    }
                }
                rules.push(format!("{rule}: %json {}", compact(schema, !strict)));
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
        "start: {opening} ({}) {}\n{}\n",
        alternatives.join(" | "),
        sp("</tool_call>")?,
        rules.join("\n"),
    ))
}

/// The Lark terminal of a raw-text argument (`None` when only the empty value is allowed)
/// and whether the value may be empty, which a terminal cannot match: its schema's `enum`
/// or `const` as literals, else text of
/// `minLength` to `maxLength` characters (at most [`MAX_ARG_CHARS`] when unbounded) that
/// matches `pattern`, and never holds a tool-call marker's text (the parser would end the
/// value there). `format` is not enforced on raw text: refused when `strict`.
fn text_terminal(
    schema: Option<&Value>,
    path: &str,
    strict: bool,
) -> Result<(Option<String>, bool), ApiError> {
    let get = |k: &str| schema.and_then(|s| s.get(k));
    let choices: Option<Vec<&str>> = match (get("const"), get("enum")) {
        (Some(c), _) => Some(c.as_str().into_iter().collect()),
        (None, Some(Value::Array(e))) => Some(e.iter().filter_map(Value::as_str).collect()),
        _ => None,
    };
    if let Some(choices) = choices {
        if choices.is_empty() {
            let field = format!("{path}.enum");
            return Err(ApiError::invalid(
                &field,
                format!("`{field}` must hold at least one value."),
            ));
        }
        let may_be_empty = choices.contains(&"");
        let literals: Vec<String> = choices
            .iter()
            .filter(|c| !c.is_empty())
            .map(|c| lark_literal(c))
            .collect();
        if literals.is_empty() {
            return Ok((None, true));
        }
        return Ok((Some(literals.join(" | ")), may_be_empty));
    }
    if strict && get("format").is_some() {
        let field = format!("{path}.format");
        return Err(ApiError::invalid(
            &field,
            format!(
                "`{field}` is not supported with `strict: true` on a string argument, which the model writes as raw text; use `pattern`."
            ),
        ));
    }
    let length = |k: &str| -> Result<Option<usize>, ApiError> {
        match get(k) {
            None => Ok(None),
            Some(v) => v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| {
                let field = format!("{path}.{k}");
                ApiError::invalid(&field, format!("`{field}` must be a non-negative integer."))
            }),
        }
    };
    let min = length("minLength")?.unwrap_or(0);
    let max = length("maxLength")?.unwrap_or(MAX_ARG_CHARS.max(min));
    if min > max {
        let field = format!("{path}.minLength");
        return Err(ApiError::invalid(
            &field,
            format!("`{field}` ({min}) is greater than `maxLength` ({max})."),
        ));
    }
    if max == 0 {
        return Ok((None, true));
    }
    let mut parts = vec![format!("/(?s:.{{{},{max}}})/", min.max(1))];
    if let Some(p) = get("pattern") {
        let field = format!("{path}.pattern");
        let p = p
            .as_str()
            .ok_or_else(|| ApiError::invalid(&field, format!("`{field}` must be a string.")))?;
        parts.push(format!("/{}/", whole_value_regex(p, &field)?));
    }
    parts.push(r"~/(?s:.*<\/(?:arg_key|arg_value|tool_call)>.*)/".to_string());
    Ok((Some(parts.join(" & ")), min == 0))
}

/// A JSON Schema `pattern` (found anywhere in the value unless anchored by `^` / `$`) as a
/// Lark regex of the whole value, with `\d` and `\w` ASCII as the JSON compiler reads them.
fn whole_value_regex(pattern: &str, field: &str) -> Result<String, ApiError> {
    let rx = llguidance::regex_to_lark(pattern, "dw");
    let (start, body) = match rx.strip_prefix('^') {
        Some(b) => (true, b),
        None => (false, rx.as_str()),
    };
    let (end, body) = match body.strip_suffix('$') {
        Some(b) if b.chars().rev().take_while(|&c| c == '\\').count() % 2 == 0 => (true, b),
        _ => (false, body),
    };
    if has_anchor(body) {
        return Err(ApiError::invalid(
            field,
            format!(
                "`{field}` may anchor with `^` and `$` only at its start and end on a string argument."
            ),
        ));
    }
    let any = "(?s:.*)";
    Ok(format!(
        "{}(?:{body}){}",
        if start { "" } else { any },
        if end { "" } else { any }
    ))
}

/// Whether `rx` holds a `^` or `$` outside escapes and character classes.
fn has_anchor(rx: &str) -> bool {
    let (mut escaped, mut class) = (false, 0usize);
    for c in rx.chars() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '[' => class += 1,
            ']' if class > 0 => class -= 1,
            '^' | '$' if class == 0 => return true,
            _ => {}
        }
    }
    false
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

/// `schema` asking llguidance for compact JSON (a weak model could otherwise pad with
/// whitespace forever); `lenient`: keywords it cannot enforce are ignored, not refused.
fn compact(mut schema: Value, lenient: bool) -> Value {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance")
            .or_insert_with(|| json!({"whitespace_flexible": false, "lenient": lenient}));
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
    let schema = compact(schema, false);
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
