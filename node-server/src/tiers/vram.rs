//! The VRAM expert tier: expert records in fixed-size slots of one device allocation,
//! computed by the fused MoE kernels (`kernels/cuda/moe.cu`).
//!
//! [`VramExperts`] holds every routed expert in VRAM (the "all in VRAM" ceiling, and the
//! untiered GPU run that `nvme-exact` must match bit for bit).

use super::provider::ExpertSource;
use crate::backend::cuda::{Cuda, MoeLayout, MoeStep, SlotArena};
use crate::model::mlp::SwiGlu;
use crate::model::moe::{ExpertProvider, Routing};
use anyhow::{Context, bail};
use std::sync::{Arc, Mutex};

/// The slot layout of an expert as loaded (its three matrices' formats and shapes).
pub fn layout_of(expert: &SwiGlu) -> anyhow::Result<MoeLayout> {
    let (inter, hidden) = (expert.gate.rows(), expert.gate.cols());
    if expert.up.format() != expert.gate.format()
        || expert.up.rows() != inter
        || expert.up.cols() != hidden
        || expert.down.rows() != hidden
        || expert.down.cols() != inter
    {
        bail!(
            "expert matrices don't share one layout: gate {:?}, up {:?}, down {:?}",
            expert.gate,
            expert.up,
            expert.down
        );
    }
    Ok(MoeLayout::new(
        hidden,
        inter,
        expert.gate.format(),
        expert.down.format(),
    )?)
}

/// Copies one expert into arena slot `slot`, checking it has the arena's layout.
pub fn write_slot(
    cuda: &Cuda,
    arena: &mut SlotArena,
    slot: usize,
    expert: &SwiGlu,
) -> anyhow::Result<()> {
    let layout = layout_of(expert)?;
    if layout != arena.layout {
        bail!(
            "expert layout {layout:?} differs from the arena's {:?}",
            arena.layout
        );
    }
    arena.write(
        cuda,
        slot,
        &expert.gate.to_bytes(),
        &expert.up.to_bytes(),
        &expert.down.to_bytes(),
    )?;
    Ok(())
}

/// Every routed expert in VRAM.
pub struct VramExperts {
    cuda: Arc<Cuda>,
    arena: Mutex<SlotArena>,
    limit: f32,
    /// Slot of each (layer, expert); empty for dense layers.
    slots: Vec<Vec<u32>>,
}

impl VramExperts {
    /// Loads every expert of the MoE layers (`moe_layers[l]`) from `source` into one arena.
    pub fn load_all(
        cuda: Arc<Cuda>,
        source: &dyn ExpertSource,
        moe_layers: &[bool],
        experts: usize,
    ) -> anyhow::Result<VramExperts> {
        let Some(first_layer) = moe_layers.iter().position(|&m| m) else {
            bail!("the model has no MoE layer to put experts of in VRAM");
        };
        let first = source.load(first_layer, 0)?;
        let layout = layout_of(&first)?;
        let total = moe_layers.iter().filter(|&&m| m).count() * experts;
        let need = total * layout.slot_bytes;
        let (free, _) = cuda.mem_info()?;
        if need > free {
            bail!(
                "all {total} experts need {} MiB of VRAM, {} MiB are free: use a tiered mode (--mode nvme) with fewer --vram-slots",
                need >> 20,
                free >> 20
            );
        }
        let mut arena = SlotArena::new(&cuda, layout, total)?;
        let mut slots = Vec::with_capacity(moe_layers.len());
        let mut next = 0usize;
        for (l, &moe) in moe_layers.iter().enumerate() {
            if !moe {
                slots.push(Vec::new());
                continue;
            }
            let mut row = Vec::with_capacity(experts);
            for e in 0..experts {
                let expert = source
                    .load(l, e)
                    .with_context(|| format!("loading layer {l} expert {e}"))?;
                write_slot(&cuda, &mut arena, next, &expert)
                    .with_context(|| format!("layer {l} expert {e}"))?;
                row.push(next as u32);
                next += 1;
            }
            slots.push(row);
        }
        cuda.synchronize()?;
        tracing::info!(
            experts = total,
            slot_bytes = layout.slot_bytes,
            mib = need >> 20,
            "every routed expert in VRAM"
        );
        Ok(VramExperts {
            cuda,
            arena: Mutex::new(arena),
            limit: first.limit,
            slots,
        })
    }
}

impl ExpertProvider for VramExperts {
    fn forward(
        &self,
        layer: usize,
        x: &[f32],
        routing: &Routing,
        out: &mut [f32],
    ) -> anyhow::Result<()> {
        let arena = self.arena.lock().unwrap_or_else(|e| e.into_inner());
        let row = &self.slots[layer];
        let slots: Vec<u32> = routing
            .ids
            .iter()
            .map(|&e| row.get(e as usize).copied())
            .collect::<Option<_>>()
            .with_context(|| {
                format!(
                    "layer {layer} routes to an expert outside its {} experts",
                    row.len()
                )
            })?;
        let step = MoeStep {
            layout: arena.layout,
            tokens: routing.tokens(),
            k: routing.k,
            limit: self.limit,
            slots: &slots,
            weights: &routing.weights,
        };
        let y = self.cuda.moe(&arena.buf, &step, x)?;
        out.iter_mut().zip(&y).for_each(|(o, v)| *o += v);
        Ok(())
    }

    fn weight_bytes(&self) -> usize {
        let arena = self.arena.lock().unwrap_or_else(|e| e.into_inner());
        arena.slots * arena.layout.slot_bytes
    }
}

/// The model in `dir` with every routed expert in VRAM and every dense weight on the GPU.
pub fn load_model_on_gpu(
    dir: &std::path::Path,
    cuda: Arc<Cuda>,
) -> anyhow::Result<crate::model::Model> {
    let cfg = crate::model::config::Config::from_file(&dir.join("config.json"))?;
    let moe: Vec<bool> = cfg
        .mlp_kinds
        .iter()
        .map(|k| *k == crate::model::config::MlpKind::Moe)
        .collect();
    let source = super::provider::CheckpointSource::open(dir)?;
    let vram = VramExperts::load_all(cuda.clone(), &source, &moe, cfg.n_routed_experts)?;
    load_dense_on_gpu(dir, Arc::new(vram), cuda)
}

/// The model in `dir` with every dense weight on the GPU and routed experts from `experts`.
pub fn load_dense_on_gpu(
    dir: &std::path::Path,
    experts: Arc<dyn ExpertProvider>,
    cuda: Arc<Cuda>,
) -> anyhow::Result<crate::model::Model> {
    let placer = crate::backend::cuda::matrix::CudaPlacer::new(cuda, 1)?;
    let model = crate::model::Model::load_placed(dir, Some(experts), Some(&placer))?;
    if let Some(failure) = placer.failure() {
        tracing::warn!(%failure, "some dense weights stay on the CPU");
    }
    tracing::info!(
        dense_mib = placer.placed_bytes() >> 20,
        "dense weights on the GPU"
    );
    Ok(model)
}
