//! Clamped SwiGLU: `down(silu(min(gate x, L)) * clamp(up x, -L, L))`. The dense layers, the
//! shared expert and every routed expert are this block.

use super::device::{Device, Host};
use super::loader::{LoadError, Loader};
use crate::backend::cpu::{Matrix, ops};

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

    /// [`SwiGlu::forward`] for one row as the CPU lane of the near-exact modes (`fast`, `nvme`)
    /// computes it ([`Matrix::matvec_lane`]): the input and the activation rounded to 16-bit
    /// integers once each for the row-format matrices that take integer dots.
    pub fn forward_lane(&self, x: &[f32]) -> Vec<f32> {
        use crate::quant::lane::Q16Row;
        // Row formats share one rounded input; an EXL3 matrix rounds its own rotated input.
        let rows_integer = |m: &Matrix| m.lane_integer() && m.format().is_some();
        let quantized = |v: &[f32], any: bool| if any { Q16Row::quantize(v) } else { None };
        let xq = quantized(x, rows_integer(&self.gate) || rows_integer(&self.up));
        let gate = self.gate.matvec_lane(x, xq.as_ref());
        let up = self.up.matvec_lane(x, xq.as_ref());
        let act = swiglu(&gate, &up, self.limit);
        let aq = quantized(&act, rows_integer(&self.down));
        self.down.matvec_lane(&act, aq.as_ref())
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::Matrix;
    use crate::quant::Format;

    fn matrix(rows: usize, cols: usize, format: Format, seed: u32) -> Matrix {
        let values = (0..rows * cols)
            .map(|i| {
                let h = (i as u32 ^ seed).wrapping_mul(0x9E37_79B9) >> 8;
                (h as f32 / (1 << 24) as f32 - 0.5) / (cols as f32).sqrt()
            })
            .collect();
        Matrix::from_f32(rows, cols, values)
            .convert(format)
            .unwrap()
    }

    fn expert(format: Format) -> SwiGlu {
        SwiGlu {
            gate: matrix(512, 256, format, 1),
            up: matrix(512, 256, format, 2),
            down: matrix(256, 512, format, 3),
            limit: 7.0,
        }
    }

    /// The lane's integer products stay within the 16-bit activations' rounding of the exact
    /// kernels for the formats it multiplies in integers, and are the exact kernels' own for
    /// the others.
    #[test]
    fn the_lane_follows_the_exact_products() {
        let x: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
            .collect();
        let format = Format::Q4K;
        let e = expert(format);
        assert!(e.gate.lane_integer() && e.down.lane_integer());
        let (want, got) = (e.forward(&x, 1), e.forward_lane(&x));
        let num: f32 = want.iter().zip(&got).map(|(a, b)| (a - b).powi(2)).sum();
        let den: f32 = want.iter().map(|a| a * a).sum();
        let rel = (num / den).sqrt();
        assert!(rel < 3e-4 && rel > 0.0, "{format}: relative RMS {rel}");
        for format in [Format::Q8_0, Format::Bf16, Format::F32] {
            let e = expert(format);
            assert!(!e.gate.lane_integer());
            assert_eq!(e.forward(&x, 1), e.forward_lane(&x), "{format}");
        }
    }
}
