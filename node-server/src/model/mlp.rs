//! Clamped SwiGLU: `down(silu(min(gate x, L)) * clamp(up x, -L, L))`. The dense layers, the
//! shared expert and every routed expert are this block.

use super::device::{Device, Host};
use super::loader::{LoadError, Loader};
use crate::backend::cpu::ops;

pub struct SwiGlu<D: Device = Host> {
    pub gate: D::Mat,
    pub up: D::Mat,
    pub down: D::Mat,
    pub limit: f32,
}

impl<D: Device> SwiGlu<D> {
    /// `down(swiglu(gate x, up x))` for `tokens` rows on `dev`.
    pub fn run(&self, dev: &D, x: &D::Buf, tokens: usize) -> anyhow::Result<D::Buf> {
        let gate = dev.matmul(&self.gate, x, tokens)?;
        let up = dev.matmul(&self.up, x, tokens)?;
        let act = dev.swiglu(&gate, &up, self.limit)?;
        dev.matmul(&self.down, &act, tokens)
    }
}

impl SwiGlu {
    pub fn load(vb: Loader, hidden: usize, inter: usize, limit: f32) -> Result<SwiGlu, LoadError> {
        Ok(SwiGlu {
            gate: vb.matrix("gate_proj.weight", inter, hidden)?,
            up: vb.matrix("up_proj.weight", inter, hidden)?,
            down: vb.matrix("down_proj.weight", hidden, inter)?,
            limit,
        })
    }

    /// This block's weights on `dev`.
    pub fn place<E: Device>(&self, dev: &E) -> anyhow::Result<SwiGlu<E>> {
        Ok(SwiGlu {
            gate: dev.matrix(&self.gate)?,
            up: dev.matrix(&self.up)?,
            down: dev.matrix(&self.down)?,
            limit: self.limit,
        })
    }

    /// [`SwiGlu::run`] on the host (the routed experts' products).
    pub fn forward(&self, x: &[f32], tokens: usize) -> Vec<f32> {
        let gate = self.gate.matmul(x, tokens);
        let up = self.up.matmul(x, tokens);
        let act = swiglu(&gate, &up, self.limit);
        self.down.matmul(&act, tokens)
    }

    /// Where the three weights' bytes are (for pinning them in RAM).
    pub fn storage_spans(&self) -> [(*const u8, usize); 3] {
        [
            self.gate.storage_span(),
            self.up.storage_span(),
            self.down.storage_span(),
        ]
    }

    /// Bytes of the three weights.
    pub fn storage_bytes(&self) -> usize {
        self.gate.storage_bytes() + self.up.storage_bytes() + self.down.storage_bytes()
    }
}

/// `silu(min(g, limit)) * clamp(u, -limit, limit)` elementwise.
pub fn swiglu(gate: &[f32], up: &[f32], limit: f32) -> Vec<f32> {
    gate.iter()
        .zip(up)
        .map(|(&g, &u)| ops::silu(g.min(limit)) * u.clamp(-limit, limit))
        .collect()
}
