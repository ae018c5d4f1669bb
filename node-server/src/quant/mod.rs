//! Weight formats: f32, f16, bf16 and quantized blocks.
//! (Interim float-only version; the block formats land with the quant branch.)

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    F32,
    F16,
    Bf16,
    Q8_0,
    Q4K,
}

#[derive(Debug, thiserror::Error)]
pub enum QuantError {
    #[error("{0}")]
    Unsupported(String),
}

impl Format {
    pub fn block_values(self) -> usize {
        match self {
            Format::F32 | Format::F16 | Format::Bf16 => 1,
            Format::Q8_0 => 32,
            Format::Q4K => 256,
        }
    }
    pub fn block_bytes(self) -> usize {
        match self {
            Format::F32 => 4,
            Format::F16 | Format::Bf16 => 2,
            Format::Q8_0 => 34,
            Format::Q4K => 144,
        }
    }
    pub fn row_bytes(self, cols: usize) -> Result<usize, QuantError> {
        if cols % self.block_values() != 0 {
            return Err(QuantError::Unsupported(format!("{cols} not a multiple")));
        }
        Ok(cols / self.block_values() * self.block_bytes())
    }
    pub fn name(self) -> &'static str {
        match self {
            Format::F32 => "f32",
            Format::F16 => "f16",
            Format::Bf16 => "bf16",
            Format::Q8_0 => "q8_0",
            Format::Q4K => "q4_k",
        }
    }
    pub fn from_name(s: &str) -> Result<Format, QuantError> {
        Ok(match s {
            "f32" => Format::F32,
            "f16" => Format::F16,
            "bf16" => Format::Bf16,
            "q8_0" => Format::Q8_0,
            "q4_k" => Format::Q4K,
            _ => return Err(QuantError::Unsupported(s.into())),
        })
    }
}

pub fn quantize_row(format: Format, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    match format {
        Format::F32 => src.iter().zip(dst.chunks_exact_mut(4)).for_each(|(v, d)| d.copy_from_slice(&v.to_le_bytes())),
        Format::F16 => src
            .iter()
            .zip(dst.chunks_exact_mut(2))
            .for_each(|(v, d)| d.copy_from_slice(&half::f16::from_f32(*v).to_le_bytes())),
        Format::Bf16 => src
            .iter()
            .zip(dst.chunks_exact_mut(2))
            .for_each(|(v, d)| d.copy_from_slice(&half::bf16::from_f32(*v).to_le_bytes())),
        _ => return Err(QuantError::Unsupported(format.name().into())),
    }
    Ok(())
}

pub fn dequantize_row(format: Format, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    match format {
        Format::F32 => src
            .chunks_exact(4)
            .zip(dst.iter_mut())
            .for_each(|(c, d)| *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        Format::F16 => src
            .chunks_exact(2)
            .zip(dst.iter_mut())
            .for_each(|(c, d)| *d = half::f16::from_le_bytes([c[0], c[1]]).to_f32()),
        Format::Bf16 => src
            .chunks_exact(2)
            .zip(dst.iter_mut())
            .for_each(|(c, d)| *d = half::bf16::from_le_bytes([c[0], c[1]]).to_f32()),
        _ => return Err(QuantError::Unsupported(format.name().into())),
    }
    Ok(())
}

pub fn dot_row(format: Format, row: &[u8], x: &[f32]) -> f32 {
    let mut tmp = vec![0f32; x.len()];
    dequantize_row(format, row, &mut tmp).expect("float format");
    tmp.iter().zip(x).map(|(a, b)| a * b).sum()
}
