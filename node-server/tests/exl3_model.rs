//! EXL3 checkpoints through the normal loading path: the tiny glm5_nexts that exllamav3 1.6.5
//! converted (`e2e/fixtures/exl3/exl3_*`: mul1 at 2.5, 3 and 6 bpw, mcg at 2, 3inst at 4) against
//! transformers' float32 forward on their reconstructed weights (`reference.json`) and against
//! exllamav3's own forward (`exllamav3_logits.json`); EXL3 matrices as CPU matrices; config
//! errors.

use glmflash_node::backend::cpu::Matrix;
use glmflash_node::model::checkpoint::{Checkpoint, DType, write_safetensors};
use glmflash_node::model::config::Config;
use glmflash_node::model::{Model, Step};
use glmflash_node::quant::exl3::{Codebook, Exl3Linear};
use serde::Deserialize;
use serde_json::Value;
use std::path::PathBuf;

#[path = "support/errors.rs"]
mod errors;
use errors::rel_l2;

/// Max |ours - reference| / max |reference| of the logits: both are float32 forwards of the
/// same weights (ours decodes them from the trellis, the reference from exllamav3's
/// reconstruction), so only summation order separates them.
const REF_TOLERANCE: f32 = 1e-4;
/// Rel. L2 of prefill logits allowed against exllamav3's forward, which runs in f16: this
/// much above its own spread against the reference (`vs_reference` in its file: 0.005-0.008
/// where no router choice is close, 0.10 for the 2.5 bpw fixture, where exllamav3's f16
/// activations pick another expert at a near-tied position).
const EXLLAMA_MARGIN: f64 = 0.02;
/// The fixtures exllamav3 converted, and the rate and codebook each was asked for.
const FIXTURES: [(&str, f32, Codebook); 5] = [
    ("exl3_mul1_3bpw", 3.0, Codebook::Mul1),
    ("exl3_mul1_2p5bpw", 2.5, Codebook::Mul1),
    ("exl3_mul1_6bpw", 6.0, Codebook::Mul1),
    ("exl3_mcg_2bpw", 2.0, Codebook::Mcg),
    ("exl3_3inst_4bpw", 4.0, Codebook::Inst3),
];

#[derive(Deserialize)]
struct Logits {
    prompt: Vec<u32>,
    prefill_logits: Vec<Vec<f32>>,
    greedy: Vec<u32>,
    greedy_logits: Vec<Vec<f32>>,
    /// exllamav3's file only: its forward against the reference.
    vs_reference: Option<VsReference>,
}

#[derive(Deserialize)]
struct VsReference {
    prefill_rel_l2: f64,
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../e2e/fixtures/exl3")
        .join(name)
}

fn dir() -> PathBuf {
    fixture(FIXTURES[0].0)
}

fn read_in(dir: &std::path::Path, name: &str) -> Logits {
    let text = std::fs::read_to_string(dir.join(name)).expect(name);
    serde_json::from_str(&text).expect(name)
}

/// max |a - b| / max |b|
fn rel_max(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    assert!(a.iter().all(|v| v.is_finite()), "non-finite output");
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn argmax(v: &[f32]) -> usize {
    (0..v.len()).fold(0, |best, i| if v[i] > v[best] { i } else { best })
}

fn prefill_logits(model: &Model, tokens: &[u32]) -> Vec<f32> {
    let mut cache = model.new_cache();
    model
        .forward(
            &mut [Step {
                tokens,
                cache: &mut cache,
                all_logits: true,
            }],
            None,
        )
        .unwrap()
        .remove(0)
}

#[test]
fn exl3_checkpoints_match_reference_and_exllamav3() {
    for (name, bits, codebook) in FIXTURES {
        eprintln!("== {name}");
        check_fixture(&fixture(name), bits, codebook);
    }
}

fn check_fixture(dir: &std::path::Path, bits: f32, codebook: Codebook) {
    let model = Model::load(dir).unwrap_or_else(|e| panic!("{}: {e:#}", dir.display()));
    let reference = read_in(dir, "reference.json");
    let theirs = read_in(dir, "exllamav3_logits.json");
    assert_eq!(reference.prompt, theirs.prompt);
    // The checkpoint is at the rate and codebook it was converted for.
    let q: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("quantization_config.json"))
            .expect("quantization_config.json"),
    )
    .expect("quantization_config.json");
    assert_eq!(q["bits"].as_f64(), Some(f64::from(bits)));
    assert_eq!(q["codebook"].as_str(), Some(codebook.name()));

    let ours = prefill_logits(&model, &reference.prompt);
    let want = reference.prefill_logits.concat();
    let err = rel_max(&ours, &want);
    eprintln!(
        "prefill vs reference: rel max {err:.2e}, rel L2 {:.2e}",
        rel_l2(&ours, &want)
    );
    assert!(err < REF_TOLERANCE, "prefill logits rel err {err:.3e}");

    let (tokens, logits) = model
        .greedy(&reference.prompt, reference.greedy.len())
        .unwrap();
    assert_eq!(tokens, reference.greedy, "greedy ids");
    let err = rel_max(&logits.concat(), &reference.greedy_logits.concat());
    eprintln!("greedy (cached decode) vs reference: rel max {err:.2e}");
    assert!(err < REF_TOLERANCE, "greedy logits rel err {err:.3e}");

    let vocab = model.cfg.vocab_size;
    let theirs_prefill = theirs.prefill_logits.concat();
    let spread = rel_l2(&ours, &theirs_prefill);
    let per_position: Vec<String> = ours
        .chunks_exact(vocab)
        .zip(theirs_prefill.chunks_exact(vocab))
        .map(|(a, b)| format!("{:.4}", rel_l2(a, b)))
        .collect();
    let argmax_agree = ours
        .chunks_exact(vocab)
        .zip(theirs_prefill.chunks_exact(vocab))
        .filter(|(a, b)| argmax(a) == argmax(b))
        .count();
    let greedy_spread = rel_l2(&logits.concat(), &theirs.greedy_logits.concat());
    let theirs_vs_ref = theirs
        .vs_reference
        .as_ref()
        .expect("exllamav3_logits.json has vs_reference")
        .prefill_rel_l2;
    eprintln!(
        "vs exllamav3: prefill rel L2 {spread:.4} (exllamav3 vs reference {theirs_vs_ref:.4}; per position {}), argmax {argmax_agree}/{}, greedy ids equal {}, greedy logits rel L2 {greedy_spread:.4}",
        per_position.join(" "),
        reference.prompt.len(),
        tokens == theirs.greedy
    );
    assert!(
        spread < theirs_vs_ref + EXLLAMA_MARGIN,
        "prefill rel L2 vs exllamav3 {spread:.4}, exllamav3 vs reference {theirs_vs_ref:.4}"
    );
    // Where exllamav3's own greedy run follows the reference, ours (equal to the reference)
    // follows exllamav3.
    if theirs.greedy == reference.greedy {
        assert_eq!(tokens, theirs.greedy, "greedy ids vs exllamav3");
    }
}

#[test]
fn exl3_matrix_products_agree_across_token_counts() {
    let (k, n) = (256, 384);
    let trellis: Vec<u8> = (0..k / 16 * n / 16 * 48 * 2)
        .map(|i| ((i * 2_654_435_761usize) >> 9) as u8)
        .collect();
    let suh: Vec<f32> = (0..k).map(|i| 0.05 * (1.0 + (i % 5) as f32)).collect();
    let svh: Vec<f32> = (0..n)
        .map(|i| if i % 3 == 0 { -0.07 } else { 0.04 })
        .collect();
    let lin = Exl3Linear::new(&[k / 16, n / 16, 48], &trellis, suh, svh, Codebook::Mul1).unwrap();
    let m = Matrix::from_exl3(lin);
    assert_eq!((m.rows(), m.cols(), m.format()), (n, k, None));
    assert!(m.to_bytes().is_none() && m.as_bytes().is_none());
    let rows: Vec<Vec<f32>> = (0..n).map(|r| m.row_f32(r)).collect();
    // 3 tokens take the fused kernel, 40 the strip-by-strip GEMM.
    for tokens in [1, 3, 40] {
        let x: Vec<f32> = (0..tokens * k)
            .map(|i| ((i * 7919) % 101) as f32 / 50.0 - 1.0)
            .collect();
        let y = m.matmul(&x, tokens);
        let want: Vec<f32> = (0..tokens)
            .flat_map(|t| {
                let (x, rows) = (&x, &rows);
                (0..n).map(move |r| {
                    let dot: f64 = (0..k)
                        .map(|i| f64::from(x[t * k + i]) * f64::from(rows[r][i]))
                        .sum();
                    dot as f32
                })
            })
            .collect();
        let err = rel_max(&y, &want);
        assert!(err < 1e-5, "{tokens} tokens: rel err {err:.2e}");
    }
    // Conversion to a row format goes through the same decoded rows.
    let f32_rows = m.convert(glmflash_node::quant::Format::F32).unwrap();
    for r in [0, 127, 128, 383] {
        assert_eq!(f32_rows.row_f32(r), rows[r]);
    }
}

fn config_error(edit: impl FnOnce(&mut serde_json::Map<String, Value>)) -> String {
    let text = std::fs::read_to_string(dir().join("config.json")).unwrap();
    let mut json: Value = serde_json::from_str(&text).unwrap();
    edit(
        json["quantization_config"]
            .as_object_mut()
            .expect("quantization_config"),
    );
    Config::from_json(&json).unwrap_err().to_string()
}

#[test]
fn quantization_config_is_read_and_checked() {
    let cfg = Config::from_file(&dir().join("config.json")).unwrap();
    let q = cfg.exl3.expect("EXL3 quantization_config");
    assert_eq!(
        (q.bits, q.head_bits, q.codebook, q.version.as_deref()),
        (3.0, 6.0, Codebook::Mul1, Some("1.6.5"))
    );
    let e = config_error(|q| {
        q.remove("bits");
    });
    assert!(
        e.contains("quantization_config.bits") && e.contains("required"),
        "{e}"
    );
    let e = config_error(|q| {
        q.remove("codebook");
    });
    assert!(e.contains("quantization_config.codebook"), "{e}");
    let e = config_error(|q| {
        q.insert("codebook".into(), "4inst".into());
    });
    assert!(
        e.contains("quantization_config.codebook") && e.contains("4inst"),
        "{e}"
    );
    let e = config_error(|q| {
        q.insert("quant_method".into(), "gptq".into());
    });
    assert!(e.contains("quant_method") && e.contains("gptq"), "{e}");
    let e = config_error(|q| {
        q.insert("group_size".into(), 128.into());
    });
    assert!(e.contains("quantization_config.group_size"), "{e}");
    let e = config_error(|q| {
        q.insert("head_bits".into(), "six".into());
    });
    assert!(e.contains("quantization_config.head_bits"), "{e}");
}

#[test]
fn trellises_without_exl3_config_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(dir().join("config.json")).unwrap();
    let mut json: Value = serde_json::from_str(&text).unwrap();
    json.as_object_mut().unwrap().remove("quantization_config");
    std::fs::write(tmp.path().join("config.json"), json.to_string()).unwrap();
    std::fs::copy(
        dir().join("model.safetensors"),
        tmp.path().join("model.safetensors"),
    )
    .unwrap();
    let e = format!("{:#}", Model::load(tmp.path()).err().expect("refused"));
    assert!(
        e.contains("EXL3 trellises") && e.contains("quantization_config"),
        "{e}"
    );
}

/// The fixture checkpoint with `edit` applied to its tensors, loaded.
fn load_edited(edit: impl FnOnce(&mut Vec<(String, DType, Vec<usize>, Vec<u8>)>)) -> String {
    let ckpt = Checkpoint::open(&dir()).unwrap();
    let mut tensors: Vec<_> = ckpt
        .keys()
        .into_iter()
        .map(|k| {
            let v = ckpt.view(k).unwrap();
            (k.to_string(), v.dtype, v.shape.to_vec(), v.bytes.to_vec())
        })
        .collect();
    edit(&mut tensors);
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(dir().join("config.json"), tmp.path().join("config.json")).unwrap();
    write_safetensors(
        &tmp.path().join("model.safetensors"),
        &tensors,
        &Default::default(),
    )
    .unwrap();
    format!("{:#}", Model::load(tmp.path()).err().expect("refused"))
}

#[test]
fn bad_exl3_tensors_are_load_errors_naming_them() {
    let o_proj = "model.language_model.layers.1.self_attn.o_proj";
    let e = load_edited(|t| {
        t.push((format!("{o_proj}.mcg"), DType::I32, vec![], vec![0; 4]));
    });
    assert!(
        e.contains(&format!("{o_proj}.trellis")) && e.contains("mcg and a mul1"),
        "{e}"
    );
    let e = load_edited(|t| {
        let tr = t
            .iter_mut()
            .find(|x| x.0 == format!("{o_proj}.trellis"))
            .unwrap();
        tr.2 = vec![16, 8, 72];
        tr.3 = vec![0; 16 * 8 * 72 * 2];
    });
    assert!(
        e.contains(&format!("{o_proj}.trellis")) && e.contains("4.5"),
        "{e}"
    );
    let e = load_edited(|t| {
        let tr = t
            .iter_mut()
            .find(|x| x.0 == format!("{o_proj}.trellis"))
            .unwrap();
        tr.2 = vec![8, 8, 48];
        tr.3.truncate(8 * 8 * 48 * 2);
    });
    assert!(
        e.contains(&format!("{o_proj}.trellis")) && e.contains("256 inputs and 128 outputs"),
        "{e}"
    );
    let e = load_edited(|t| t.retain(|x| x.0 != format!("{o_proj}.svh")));
    assert!(e.contains(&format!("{o_proj}.svh")), "{e}");
    let e = load_edited(|t| {
        let tr = t
            .iter_mut()
            .find(|x| x.0 == format!("{o_proj}.trellis"))
            .unwrap();
        tr.1 = DType::F16;
    });
    assert!(
        e.contains(&format!("{o_proj}.trellis")) && e.contains("I16"),
        "{e}"
    );
}
