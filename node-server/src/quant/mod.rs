//! Weight formats: f32, f16, bf16 and quantized blocks.
