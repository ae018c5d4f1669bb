//! Named-intermediate dumps: every tensor the forward pass taps (`embed`,
//! `layers.3.self_attn`, `layers.3.mlp`, ...) saved to one safetensors file, so a mismatch
//! against the reference (`e2e/dump_reference.py`, `e2e/compare_dumps.py`) is located at the
//! first op that diverges, by name.

use super::checkpoint::{DType, write_safetensors};
use super::glm5::ForwardHooks;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;

/// Collects tapped tensors in the order the forward pass produced them.
#[derive(Default)]
pub struct Dump {
    tensors: Mutex<Vec<(String, usize, Vec<f32>)>>,
}

impl ForwardHooks for Dump {
    fn tensor(&self, name: &str, values: &[f32], width: usize) {
        self.tensors
            .lock()
            .expect("dump lock")
            .push((name.to_string(), width, values.to_vec()));
    }
}

impl Dump {
    pub fn names(&self) -> Vec<String> {
        self.tensors
            .lock()
            .expect("dump lock")
            .iter()
            .map(|t| t.0.clone())
            .collect()
    }

    pub fn get(&self, name: &str) -> Option<Vec<f32>> {
        self.tensors
            .lock()
            .expect("dump lock")
            .iter()
            .find(|t| t.0 == name)
            .map(|t| t.2.clone())
    }

    /// Writes `[rows, width]` f32 tensors; `__metadata__.order` lists the names in tap order.
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        let tensors = self.tensors.lock().expect("dump lock");
        let order: Vec<&str> = tensors.iter().map(|t| t.0.as_str()).collect();
        let mut meta = BTreeMap::new();
        meta.insert("order".to_string(), order.join(","));
        let out: Vec<(String, DType, Vec<usize>, Vec<u8>)> = tensors
            .iter()
            .map(|(name, width, values)| {
                let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
                (
                    name.clone(),
                    DType::F32,
                    vec![values.len() / width, *width],
                    bytes,
                )
            })
            .collect();
        write_safetensors(path, &out, &meta)
    }
}
