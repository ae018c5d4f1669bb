//! The dense weights' host copies given back once a device holds them
//! (`Weights::release_host_copies`, what `load_dense_on_gpu` does unless --vram-host-copies):
//! the forward reads nothing it gave back, and what it gives back is what the memory plan
//! counts on (`plan::weights::given_back_with_gpu`).

use glmflash_node::backend::cpu::{DeviceWeights, Matrix, Placer};
use glmflash_node::model::Model;
use glmflash_node::model::config::Config;
use glmflash_node::plan::weights::{given_back_with_gpu, tensors};
use std::path::PathBuf;
use std::sync::Arc;

#[path = "support/runs.rs"]
mod runs;

/// A device stand-in: the products come from its own copy of the matrix, on the CPU.
struct CpuCopy(Matrix);

impl DeviceWeights for CpuCopy {
    fn matmul_into(&self, x: &[f32], n: usize, y: &mut [f32]) -> anyhow::Result<()> {
        self.0.matmul_into(x, n, y);
        Ok(())
    }

    fn bytes(&self) -> usize {
        self.0.storage_bytes()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Gives every matrix a [`CpuCopy`], as the GPU's placer gives every matrix a device copy.
struct CopyEverything;

impl Placer for CopyEverything {
    fn place(&self, m: &Matrix) -> Option<Arc<dyn DeviceWeights>> {
        Some(Arc::new(CpuCopy(m.clone())))
    }
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../e2e/fixtures")
        .join(name)
}

#[test]
fn a_forward_after_the_host_copies_are_given_back_is_the_same_bits() {
    // KDA split and fused, MLA with full and shared indexers, dense and MoE layers with
    // shared experts: every kind of matrix the walk visits.
    for name in ["tiny_mixed", "tiny_nested", "tiny_fused"] {
        let dir = fixture(name);
        let mut model = Model::builder().placer(&CopyEverything).load(&dir).unwrap();
        let prompt: Vec<u32> = (0..24).map(|i| (i * 7 + 3) % 60).collect();
        let before = runs::prompt_then_greedy(&model, &prompt, 6);

        let freed = model.weights.release_host_copies();
        // All f32 here: the plan's bytes of what a GPU box gives back, tensor by tensor.
        let cfg = Config::from_file(&dir.join("config.json")).unwrap();
        let planned: u64 = tensors(&cfg)
            .iter()
            .filter(|t| given_back_with_gpu(t))
            .map(|t| 4 * t.values())
            .sum();
        assert_eq!(freed as u64, planned, "{name}: given back against the plan");
        assert_eq!(model.weights.release_host_copies(), 0, "{name}: twice");

        let after = runs::prompt_then_greedy(&model, &prompt, 6);
        assert_eq!(before.len(), after.len());
        for (i, (b, a)) in before.iter().zip(&after).enumerate() {
            assert!(
                b.iter().zip(a).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{name}: step {i} differs once the host copies are gone"
            );
        }
    }
}

#[test]
fn a_matrix_without_a_device_copy_keeps_its_host_bytes() {
    let mut m = Matrix::from_f32(2, 3, vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    assert_eq!(m.release_host(), 0);
    assert!(!m.host_released());
    assert_eq!(m.matmul(&[1.0, 1.0, 1.0], 1), vec![6.0, 15.0]);

    m.set_device(CopyEverything.place(&m));
    assert_eq!(m.release_host(), 24);
    assert!(m.host_released());
    assert_eq!(m.storage_bytes(), 0);
    // The format stays known; the products come from the device copy.
    assert_eq!(m.format().map(|f| f.name()), Some("f32"));
    assert_eq!(m.matmul(&[1.0, 1.0, 1.0], 1), vec![6.0, 15.0]);
    assert!(format!("{m:?}").contains("host copy released"));
}

/// A device product that fails where the host copy is gone: the error says why, with the flag
/// that keeps the copy (the engine turns the panic into that request's error).
#[test]
fn a_failing_device_product_with_no_host_copy_says_so() {
    struct Broken;
    impl DeviceWeights for Broken {
        fn matmul_into(&self, _: &[f32], _: usize, _: &mut [f32]) -> anyhow::Result<()> {
            anyhow::bail!("device lost")
        }
        fn bytes(&self) -> usize {
            0
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    }
    let mut m = Matrix::from_f32(1, 2, vec![1.0, 2.0]);
    m.set_device(Some(Arc::new(Broken)));
    m.release_host();
    let err = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| m.matmul(&[1.0, 1.0], 1)))
        .unwrap_err();
    let text = err.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(text.contains("--vram-host-copies"), "{text}");
}
