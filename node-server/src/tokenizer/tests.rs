use std::path::Path;

use serde_json::json;

use super::*;

fn demo_dir() -> (tempfile::TempDir, DemoTokenizerInfo, TextCodec) {
    let dir = tempfile::tempdir().unwrap();
    let info = write_demo_tokenizer_files(dir.path(), DEMO_VOCAB_SIZE).unwrap();
    let codec = TextCodec::from_dir(dir.path()).unwrap();
    (dir, info, codec)
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap()
}

#[test]
fn corpus_is_tens_of_kb() {
    assert!(
        DEMO_CORPUS.len() > 20_000,
        "corpus is {} bytes",
        DEMO_CORPUS.len()
    );
}

#[test]
fn training_is_deterministic() {
    let a = train_demo_tokenizer(DEMO_VOCAB_SIZE).unwrap();
    let b = train_demo_tokenizer(DEMO_VOCAB_SIZE).unwrap();
    assert_eq!(a.to_string(true).unwrap(), b.to_string(true).unwrap());

    let d1 = tempfile::tempdir().unwrap();
    let d2 = tempfile::tempdir().unwrap();
    let i1 = write_demo_tokenizer_files(d1.path(), DEMO_VOCAB_SIZE).unwrap();
    let i2 = write_demo_tokenizer_files(d2.path(), DEMO_VOCAB_SIZE).unwrap();
    assert_eq!(i1, i2);
    for f in [TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, CHAT_TEMPLATE_FILE] {
        assert_eq!(
            read(&d1.path().join(f)),
            read(&d2.path().join(f)),
            "{f} differs"
        );
    }
}

#[test]
fn vocab_and_special_ids() {
    let (_dir, info, codec) = demo_dir();
    assert_eq!(info.vocab_size, DEMO_VOCAB_SIZE);
    assert_eq!(codec.vocab_size(), DEMO_VOCAB_SIZE);
    assert_eq!(info.eos_token_id, 2);
    assert_eq!(info.stop_token_ids, vec![2, 4, 6]);
    assert_eq!((info.gmask_token_id, info.sop_token_id), (0, 1));
    assert_eq!(codec.eos_ids(), &[2, 4, 6]);
    assert_eq!(codec.eos_token(), Some("<|endoftext|>"));
    // Every id decodes and lies below vocab_size.
    for id in 0..DEMO_VOCAB_SIZE as u32 {
        assert!(codec.id_to_token(id).is_some(), "id {id} has no token");
    }
    assert!(codec.id_to_token(DEMO_VOCAB_SIZE as u32).is_none());
    // The merges learned something: common words are single tokens.
    assert_eq!(codec.encode(" the").unwrap().len(), 1);
}

#[test]
fn tokenizer_config_fields() {
    let (dir, _info, _codec) = demo_dir();
    let cfg: serde_json::Value =
        serde_json::from_slice(&read(&dir.path().join(TOKENIZER_CONFIG_FILE))).unwrap();
    assert_eq!(cfg["eos_token"], "<|endoftext|>");
    assert_eq!(cfg["pad_token"], "<|endoftext|>");
    assert!(cfg["bos_token"].is_null());
    assert_eq!(cfg["chat_template"], DEMO_CHAT_TEMPLATE);
    assert_eq!(cfg["added_tokens_decoder"]["4"]["content"], "<|user|>");
    assert_eq!(cfg["added_tokens_decoder"]["4"]["special"], true);
    let tpl = std::fs::read_to_string(dir.path().join(CHAT_TEMPLATE_FILE)).unwrap();
    assert_eq!(tpl, DEMO_CHAT_TEMPLATE);
}

#[test]
fn round_trips_varied_utf8() {
    let (_dir, _info, codec) = demo_dir();
    let texts = [
        "",
        " ",
        "Hello, world!",
        "  leading and trailing spaces  ",
        "tabs\tand\r\nwindows newlines\n\n\nand more",
        "fn main() {\n    println!(\"{}\", 42);\n}\n",
        "{\"model\": \"glm\", \"temperature\": 0.7, \"stop\": [\"\\n\"]}",
        "Crab 🦀, rocket 🚀, family 👨‍👩‍👧, flag 🇫🇷",
        "中文测试：你好，世界！日本語のテキスト。한국어 문장.",
        "Ünïcödé ñ café naïve Ω≈ç√∫ — “quotes” ‘single’ …",
        "combining: e\u{301} a\u{308} and zero\u{200b}width",
        "mixed <|user|> special <think>inline</think> [gMASK]<sop> tokens",
        "\u{0}\u{1}\u{7f} control bytes",
    ];
    for t in texts {
        let ids = codec.encode(t).unwrap();
        assert_eq!(codec.decode(&ids).unwrap(), t, "round trip of {t:?}");
        assert!(ids.iter().all(|&id| (id as usize) < codec.vocab_size()));
    }
}

#[test]
fn special_tokens_are_single_ids() {
    let (_dir, _info, codec) = demo_dir();
    for (i, t) in SPECIAL_TOKENS.iter().enumerate() {
        assert_eq!(codec.encode(t).unwrap(), vec![i as u32], "{t}");
        assert_eq!(codec.decode(&[i as u32]).unwrap(), *t);
    }
    let ids = codec.encode("<|user|>\nhi<|assistant|>").unwrap();
    assert_eq!(ids[0], 4);
    assert_eq!(*ids.last().unwrap(), 5);
    // Nothing is added around plain text.
    let plain = codec.encode("hi").unwrap();
    assert!(plain.iter().all(|&id| id as usize >= SPECIAL_TOKENS.len()));
    // Skipping special tokens when asked.
    assert_eq!(codec.decode_with(&ids, true).unwrap(), "\nhi");
}

#[test]
fn stream_decoder_holds_back_split_characters() {
    let (_dir, _info, codec) = demo_dir();
    let text = "Crab 🦀 says 你好 and 👨‍👩‍👧!";
    let ids = codec.encode(text).unwrap();
    // The emoji is several byte tokens: some single ids are not valid UTF-8.
    let crab = codec.encode("🦀").unwrap();
    assert!(crab.len() > 1, "expected 🦀 to be split, got {crab:?}");
    assert!(codec.decode(&crab[..1]).unwrap().contains('\u{FFFD}'));

    let mut dec = codec.stream_decoder(false);
    let mut out = String::new();
    let mut deltas = Vec::new();
    for &id in &ids {
        let d = dec.push(id).unwrap();
        assert!(!d.contains('\u{FFFD}'), "delta {d:?} splits a character");
        out.push_str(&d);
        deltas.push(d);
    }
    out.push_str(&dec.finish().unwrap());
    assert_eq!(out, text);
    // Pushing the first piece of a split emoji alone yields nothing.
    let mut dec = codec.stream_decoder(false);
    assert_eq!(dec.push(crab[0]).unwrap(), "");
    let rest = dec.push_all(&crab[1..]).unwrap();
    assert_eq!(rest, "🦀");
    assert_eq!(dec.finish().unwrap(), "");
    assert!(deltas.iter().filter(|d| d.is_empty()).count() >= crab.len() - 1);
}

#[test]
fn stream_decoder_flushes_incomplete_tail_and_specials() {
    let (_dir, _info, codec) = demo_dir();
    let crab = codec.encode("🦀").unwrap();
    let mut dec = codec.stream_decoder(false);
    assert_eq!(dec.push_all(&codec.encode("ok ").unwrap()).unwrap(), "ok ");
    assert_eq!(dec.push(crab[0]).unwrap(), "");
    assert_eq!(dec.finish().unwrap(), "\u{FFFD}");

    let ids = codec.encode("<think>plan</think>\nanswer<|user|>").unwrap();
    let mut keep = codec.stream_decoder(false);
    assert_eq!(
        keep.push_all(&ids).unwrap() + &keep.finish().unwrap(),
        "<think>plan</think>\nanswer<|user|>"
    );
    let mut skip = codec.stream_decoder(true);
    assert_eq!(
        skip.push_all(&ids).unwrap() + &skip.finish().unwrap(),
        "plan\nanswer"
    );
}

fn weather_tools() -> serde_json::Value {
    json!([{
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"]
            }
        }
    }])
}

fn tool_conversation() -> serde_json::Value {
    json!([
        {"role": "system", "content": "You are a careful cooking assistant."},
        {"role": "user", "content": "How long should I rest a steak?"},
        {"role": "assistant", "content": "About five minutes.",
         "reasoning_content": "Older turn; this reasoning is dropped."},
        {"role": "user", "content": "What is the weather in Paris? Use the tool."},
        {"role": "assistant", "content": "", "reasoning_content": "I should call get_weather.",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 2}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 18}"}
    ])
}

pub(crate) const EXPECTED_TOOL_CHAT: &str = concat!(
    "[gMASK]<sop><|system|>\n# Tools\n\n",
    "You may call the functions described below to help with the request. ",
    "Each signature is JSON inside <tools></tools>:\n<tools>\n",
    "{\"function\": {\"description\": \"Weather for a city\", \"name\": \"get_weather\", ",
    "\"parameters\": {\"properties\": {\"city\": {\"type\": \"string\"}}, ",
    "\"required\": [\"city\"], \"type\": \"object\"}}, \"type\": \"function\"}\n",
    "</tools>\n\nTo call a function, write its name and arguments exactly like this:\n",
    "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key>",
    "<arg_value>{arg-value-1}</arg_value>...</tool_call>",
    "<|system|>\nYou are a careful cooking assistant.",
    "<|user|>\nHow long should I rest a steak?",
    "<|assistant|>\n<think></think>\nAbout five minutes.",
    "<|user|>\nWhat is the weather in Paris? Use the tool.",
    "<|assistant|>\n<think>I should call get_weather.</think>\n",
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>",
    "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>",
    "<|observation|>\n<tool_response>{\"temp_c\": 18}</tool_response>",
    "<|assistant|><think>",
);

#[test]
fn chat_render_with_tools_matches_exactly() {
    let (_dir, _info, codec) = demo_dir();
    let tools = weather_tools();
    let out = codec
        .render_chat(&tool_conversation(), Some(&tools), true, true)
        .unwrap();
    assert_eq!(out, EXPECTED_TOOL_CHAT);
    // The rendered prompt tokenizes with the special tokens as single ids.
    let ids = codec.encode(&out).unwrap();
    assert_eq!(&ids[..3], &[0, 1, 3]);
    assert_eq!(ids[ids.len() - 2..], [5, 7]);
    assert_eq!(codec.decode(&ids).unwrap(), out);
}

#[test]
fn chat_render_without_thinking_and_inline_think() {
    let (_dir, _info, codec) = demo_dir();
    let msgs = json!([
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>greet back</think>Hello!"},
        {"role": "user", "content": [{"type": "text", "text": "Two "}, {"type": "text", "text": "parts"}]}
    ]);
    let out = codec.render_chat(&msgs, None, true, false).unwrap();
    assert_eq!(
        out,
        "[gMASK]<sop><|user|>\nHi<|assistant|>\n<think></think>\nHello!<|user|>\nTwo parts<|assistant|></think>"
    );
    let out = codec.render_chat(&msgs, None, true, true).unwrap();
    assert!(out.ends_with("<|user|>\nTwo parts<|assistant|><think>"));
    let out = codec.render_chat(&msgs, None, false, false).unwrap();
    assert!(out.ends_with("<|user|>\nTwo parts"));

    // Reasoning after the last user turn is kept, inline or not.
    let msgs = json!([
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>greet back</think>Hello!"}
    ]);
    let out = codec
        .render_chat(&msgs, Some(&json!(null)), false, true)
        .unwrap();
    assert_eq!(
        out,
        "[gMASK]<sop><|user|>\nHi<|assistant|>\n<think>greet back</think>\nHello!"
    );
}

#[test]
fn chat_render_consecutive_tool_results_and_object_arguments() {
    let (_dir, _info, codec) = demo_dir();
    let msgs = json!([
        {"role": "user", "content": "Both?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"type": "function", "function": {"name": "a", "arguments": {"x": [1, 2], "y": "é<b>"}}},
            {"type": "function", "function": {"name": "b", "arguments": "{}"}}
        ]},
        {"role": "tool", "content": "one"},
        {"role": "tool", "content": "two"}
    ]);
    let out = codec.render_chat(&msgs, None, true, true).unwrap();
    assert_eq!(
        out,
        concat!(
            "[gMASK]<sop><|user|>\nBoth?<|assistant|>\n<think></think>\nChecking.",
            "\n<tool_call>a<arg_key>x</arg_key><arg_value>[1, 2]</arg_value>",
            "<arg_key>y</arg_key><arg_value>é<b></arg_value></tool_call>",
            "\n<tool_call>b</tool_call>",
            "<|observation|>\n<tool_response>one</tool_response>\n<tool_response>two</tool_response>",
            "<|assistant|><think>"
        )
    );
}

#[test]
fn chat_render_errors() {
    let (_dir, _info, codec) = demo_dir();
    let err = codec
        .render_chat(
            &json!([{"role": "narrator", "content": "x"}]),
            None,
            true,
            true,
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("chat_template.jinja"), "{err}");
    assert!(err.contains("unsupported message role: narrator"), "{err}");
    assert!(
        codec
            .render_chat(&json!({"role": "user"}), None, true, true)
            .is_err()
    );
}

#[test]
fn tojson_is_python_style() {
    let t = ChatTemplate::new(
        "{{ v | tojson }}|{{ v | tojson(ensure_ascii=True) }}|{{ v | tojson(indent=2) }}".into(),
        "inline",
    )
    .unwrap();
    let v = json!({"a": [1, "x\"y"], "b": "ü", "c": {}});
    let out = t
        .render(minijinja::context! { v => minijinja::Value::from_serialize(&v) })
        .unwrap();
    assert_eq!(
        out,
        "{\"a\": [1, \"x\\\"y\"], \"b\": \"ü\", \"c\": {}}|\
         {\"a\": [1, \"x\\\"y\"], \"b\": \"\\u00fc\", \"c\": {}}|\
         {\n  \"a\": [\n    1,\n    \"x\\\"y\"\n  ],\n  \"b\": \"ü\",\n  \"c\": {}\n}"
    );
}

#[test]
fn loading_errors_name_file_and_problem() {
    let empty = tempfile::tempdir().unwrap();
    let err = TextCodec::from_dir(empty.path()).unwrap_err().to_string();
    assert!(
        err.contains("tokenizer.json") && err.contains("missing"),
        "{err}"
    );

    let (dir, _info, _codec) = demo_dir();
    // A template with a syntax error on line 3.
    std::fs::write(
        dir.path().join(CHAT_TEMPLATE_FILE),
        "{% for m in messages %}\n{{ m.content }}\n{{ m.role }\n{% endfor %}\n",
    )
    .unwrap();
    let err = TextCodec::from_dir(dir.path()).unwrap_err().to_string();
    assert!(err.contains("chat_template.jinja"), "{err}");
    assert!(err.contains("line 3"), "{err}");

    // Without chat_template.jinja the config's template is used; break that one.
    std::fs::remove_file(dir.path().join(CHAT_TEMPLATE_FILE)).unwrap();
    assert!(TextCodec::from_dir(dir.path()).unwrap().has_chat_template());
    let cfg_path = dir.path().join(TOKENIZER_CONFIG_FILE);
    let mut cfg: serde_json::Value = serde_json::from_slice(&read(&cfg_path)).unwrap();
    cfg["chat_template"] = json!("line one\n{% if %}");
    std::fs::write(&cfg_path, serde_json::to_vec(&cfg).unwrap()).unwrap();
    let err = TextCodec::from_dir(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("tokenizer_config.json") && err.contains("line 2"),
        "{err}"
    );

    // No template at all: loading works, rendering says why not.
    cfg.as_object_mut().unwrap().remove("chat_template");
    std::fs::write(&cfg_path, serde_json::to_vec(&cfg).unwrap()).unwrap();
    let codec = TextCodec::from_dir(dir.path()).unwrap();
    let err = codec
        .render_chat(&json!([]), None, true, true)
        .unwrap_err()
        .to_string();
    assert!(err.contains("no chat template"), "{err}");

    // Broken config JSON and broken tokenizer.json.
    std::fs::write(&cfg_path, "{not json").unwrap();
    let err = TextCodec::from_dir(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("tokenizer_config.json") && err.contains("invalid JSON"),
        "{err}"
    );
    std::fs::remove_file(&cfg_path).unwrap();
    std::fs::write(dir.path().join(TOKENIZER_FILE), "{\"model\": 3}").unwrap();
    let err = TextCodec::from_dir(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("tokenizer.json") && err.contains("not a valid tokenizer"),
        "{err}"
    );
}

/// FNV-1a, to pin the exact bytes of the demo tokenizer across processes and machines.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[test]
fn demo_tokenizer_bytes_are_pinned() {
    // Hash maps inside the trainer are seeded per process; the output must not
    // depend on that. If a `tokenizers` upgrade changes the bytes, update this
    // value deliberately (demo checkpoints change with it).
    let json = train_demo_tokenizer(DEMO_VOCAB_SIZE)
        .unwrap()
        .to_string(true)
        .unwrap();
    let h = fnv1a(json.as_bytes());
    println!("demo tokenizer.json: {} bytes, fnv1a {h:#018x}", json.len());
    assert_eq!(h, 0x940e_f889_7cef_df7e);
}

#[test]
fn chat_render_with_extra_variables() {
    let (_dir, _info, codec) = demo_dir();
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    let off = json!({"enable_thinking": false});
    assert_eq!(
        codec
            .render_chat_with(&msgs, None, true, Some(&off))
            .unwrap(),
        "[gMASK]<sop><|user|>\nHi<|assistant|></think>"
    );
    // Thinking defaults to on when the variable is absent: the prompt opens the block.
    assert_eq!(
        codec.render_chat_with(&msgs, None, true, None).unwrap(),
        "[gMASK]<sop><|user|>\nHi<|assistant|><think>"
    );
    assert!(
        codec
            .render_chat_with(&msgs, None, true, Some(&json!([1])))
            .is_err()
    );
}

#[test]
fn codec_is_shareable_across_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<TextCodec>();
    send_sync::<StreamDecoder>();
}
