//! Bad checkpoints and configs fail with a message naming the field, key or shapes.

use glmflash_node::model::Model;
use glmflash_node::model::checkpoint::{DType, write_safetensors};
use glmflash_node::model::config::Config;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../e2e/fixtures")
        .join(name)
}

fn base_config() -> Value {
    serde_json::from_str(
        &std::fs::read_to_string(fixture("tiny_mixed").join("config.json")).unwrap(),
    )
    .unwrap()
}

fn config_error(edit: impl FnOnce(&mut Value)) -> String {
    let mut cfg = base_config();
    edit(&mut cfg);
    Config::from_json(&cfg)
        .expect_err("config must be rejected")
        .to_string()
}

#[test]
fn config_flat_and_nested_parse_the_same_fields() {
    let flat = base_config();
    let nested = json!({"model_type": "glm5_next", "text_config": flat.clone()});
    assert_eq!(
        Config::from_json(&flat).unwrap(),
        Config::from_json(&nested).unwrap()
    );
}

#[test]
fn unsupported_config_values_name_the_field() {
    type Edit = Box<dyn FnOnce(&mut Value)>;
    let cases: Vec<(Edit, &str)> = vec![
        (
            Box::new(|c| c["qk_rope_head_dim"] = json!(64)),
            "`qk_rope_head_dim`: GLM-5.3-Flash attention is NoPE",
        ),
        (
            Box::new(|c| c["n_group"] = json!(3)),
            "`n_group`: must divide n_routed_experts (16), got 3",
        ),
        (
            Box::new(|c| c["layer_types"][2] = json!("sliding_attention")),
            "`layer_types[2]`: unknown layer type `sliding_attention`",
        ),
        (
            Box::new(|c| c["mlp_layer_types"][0] = json!("moe")),
            "`mlp_layer_types[0]`: unknown layer type `moe`",
        ),
        (
            Box::new(|c| c["indexer_types"][1] = json!("shared")),
            "`indexer_types[1]`: a shared indexer layer needs an earlier full",
        ),
        (
            Box::new(|c| c["index_topk"] = json!(6)),
            "`index_topk`: must be a positive multiple of index_kpool (4), got 6",
        ),
        (
            Box::new(|c| c["hidden_size"] = json!("64")),
            "`hidden_size`: expected a non-negative integer, got \"64\"",
        ),
        (
            Box::new(|c| c["num_key_value_heads"] = json!(1)),
            "`num_key_value_heads`: must equal num_attention_heads (2), got 1",
        ),
        (
            Box::new(|c| c["hidden_act"] = json!("gelu")),
            "`hidden_act`: only `silu` is supported",
        ),
        (
            Box::new(|c| c["num_experts_per_tok"] = json!(9)),
            "`num_experts_per_tok`: must be between 1 and the experts in the kept groups (8), got 9",
        ),
        (
            Box::new(|c| c["layer_types"] = json!(["linear_attention"])),
            "`layer_types`: has 1 entries but num_hidden_layers is 6",
        ),
        (
            Box::new(|c| c["attention_bias"] = json!(true)),
            "`attention_bias`",
        ),
        (
            Box::new(|c| c["index_kpool_always_select_tail"] = json!(false)),
            "`index_kpool_always_select_tail`",
        ),
    ];
    for (edit, expected) in cases {
        let msg = config_error(edit);
        assert!(msg.contains(expected), "message `{msg}` lacks `{expected}`");
    }
}

/// Copies tiny_mixed into a temp dir with its tensors edited by `edit`.
fn edited_checkpoint(
    edit: impl FnOnce(&mut Vec<(String, DType, Vec<usize>, Vec<u8>)>),
) -> tempfile::TempDir {
    let src = fixture("tiny_mixed");
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    let ckpt = glmflash_node::model::checkpoint::Checkpoint::open(&src).unwrap();
    let mut tensors: Vec<_> = ckpt
        .keys()
        .into_iter()
        .map(|k| {
            let v = ckpt.view(k).unwrap();
            (k.to_string(), v.dtype, v.shape.to_vec(), v.bytes.to_vec())
        })
        .collect();
    edit(&mut tensors);
    write_safetensors(
        &dir.path().join("model.safetensors"),
        &tensors,
        &BTreeMap::new(),
    )
    .unwrap();
    dir
}

fn load_error(dir: &Path) -> String {
    match Model::load(dir) {
        Ok(_) => panic!("{} must not load", dir.display()),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn missing_tensor_names_the_key() {
    let key = "model.language_model.layers.1.self_attn.kv_b_proj.weight";
    let dir = edited_checkpoint(|t| t.retain(|(k, ..)| k != key));
    let msg = load_error(dir.path());
    assert!(
        msg.contains("tensor `layers.1.self_attn.kv_b_proj.weight` is missing"),
        "{msg}"
    );
    assert!(msg.contains(key), "{msg}");
}

#[test]
fn misshaped_tensor_names_key_and_both_shapes() {
    let key = "model.language_model.layers.2.mlp.experts.5.down_proj.weight";
    let dir = edited_checkpoint(|t| {
        let entry = t.iter_mut().find(|(k, ..)| k == key).unwrap();
        entry.2 = vec![8, 64];
    });
    let msg = load_error(dir.path());
    assert!(
        msg.contains(&format!(
            "tensor `{key}` has shape [8, 64], expected [64, 8]"
        )),
        "{msg}"
    );
}

#[test]
fn unsupported_dtype_and_truncated_file_are_refused() {
    let dir = edited_checkpoint(|_| {});
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    let msg = load_error(dir.path());
    assert!(msg.contains("do not fit its shape"), "{msg}");

    let text = String::from_utf8_lossy(&bytes[8..]).replacen("\"F32\"", "\"I64\"", 1);
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut patched = bytes[..8].to_vec();
    patched.extend_from_slice(&text.as_bytes()[..header_len]);
    patched.extend_from_slice(&bytes[8 + header_len..]);
    std::fs::write(&path, patched).unwrap();
    let msg = load_error(dir.path());
    assert!(msg.contains("unsupported dtype I64"), "{msg}");
}

#[test]
fn no_weights_and_bad_index_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture("tiny_mixed").join("config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    let msg = load_error(dir.path());
    assert!(
        msg.contains("has neither model.safetensors nor model.safetensors.index.json"),
        "{msg}"
    );
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        "{\"metadata\": {}}",
    )
    .unwrap();
    let msg = load_error(dir.path());
    assert!(msg.contains("has no `weight_map` object"), "{msg}");
}

#[test]
fn vocabulary_overflow_is_an_error_not_a_panic() {
    let model = Model::load(&fixture("tiny_mixed")).unwrap();
    let err = model.prefill(&[1, 2, 128]).unwrap_err().to_string();
    assert!(
        err.contains("token id 128 is outside the vocabulary (size 128)"),
        "{err}"
    );
}

/// The names the published checkpoints and the converters (transformers, llama.cpp's
/// `Glm5NextModel`, exllamav3) use for the same fields parse to the same config: layer types
/// `full_attention` and `deepseek_sparse_attention` for `indexed_attention`, the
/// `linear_attn_config` dict for the flat `linear_*` fields, `index_topk_pattern` (a string of
/// F/S or a list) for `indexer_types`.
#[test]
fn converters_field_names_parse_as_the_canonical_ones() {
    let canonical = Config::from_json(&base_config()).unwrap();
    let same = |edit: &dyn Fn(&mut serde_json::Map<String, Value>)| {
        let mut cfg = base_config();
        edit(cfg.as_object_mut().unwrap());
        Config::from_json(&cfg).unwrap()
    };
    for spelling in ["full_attention", "deepseek_sparse_attention"] {
        let cfg = same(&|m| {
            let types = m["layer_types"].as_array().unwrap().iter();
            let renamed: Vec<Value> = types
                .map(|t| match t.as_str() {
                    Some("indexed_attention") => json!(spelling),
                    _ => t.clone(),
                })
                .collect();
            m.insert("layer_types".into(), Value::Array(renamed));
        });
        assert_eq!(cfg, canonical, "layer type {spelling}");
    }
    let nested_linear = same(&|m| {
        for k in [
            "linear_head_dim",
            "linear_num_heads",
            "linear_conv_kernel_dim",
            "linear_lower_bound",
        ] {
            m.remove(k);
        }
        m.insert(
            "linear_attn_config".into(),
            json!({"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4,
                   "gate_lower_bound": -5.0}),
        );
    });
    assert_eq!(nested_linear, canonical, "linear_attn_config");
    for pattern in [
        json!("FFSFFS"),
        json!(["full", "full", "shared", "full", "full", "shared"]),
    ] {
        let cfg = same(&|m| {
            m.remove("indexer_types");
            m.insert("index_topk_pattern".into(), pattern.clone());
        });
        assert_eq!(cfg, canonical, "index_topk_pattern {pattern}");
    }
    // A spelling none of them uses is refused with the field named.
    let err = config_error(|c| c["layer_types"][1] = json!("sliding_attention"));
    assert!(err.contains("layer_types[1]"), "{err}");
    let err = config_error(|c| {
        c.as_object_mut().unwrap().remove("indexer_types");
        c["index_topk_pattern"] = json!("FX");
    });
    assert!(err.contains("index_topk_pattern[1]"), "{err}");
}
