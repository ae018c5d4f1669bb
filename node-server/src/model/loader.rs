//! Typed reads of a layer's weights from a [`Checkpoint`], under a module-path prefix
//! (`layers.3.self_attn`), the way the module tree names them.
//!
//! A weight `x.weight` is read as stored: a float tensor, glmflash's quantized rows (U8 with
//! metadata), or an EXL3 linear layer (exllamav3's `x.trellis`, `x.suh`, `x.svh`, optional
//! `x.bias`, and an `x.mcg` / `x.mul1` marker naming the codebook, none meaning 3INST).

use super::checkpoint::{Checkpoint, CheckpointError, DType, TensorView};
use crate::backend::cpu::{Matrix, MatrixError, Placer};
use crate::quant::Format;
use crate::quant::exl3::{Codebook, Exl3Linear};

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("tensor `{key}`: {source}")]
    Matrix {
        key: String,
        #[source]
        source: MatrixError,
    },
    #[error("tensor `{key}`: {message}")]
    Invalid { key: String, message: String },
    #[error(transparent)]
    Config(#[from] super::config::ConfigError),
}

/// Metadata key under which a quantized (U8) tensor records `format:cols`.
pub fn quant_metadata_key(tensor_key: &str) -> String {
    format!("glmflash.quant.{tensor_key}")
}

/// The on-disk tensors of one EXL3 linear layer.
pub struct Exl3Tensors<'a> {
    /// int16 `[in/16, out/16, 16 * bits]`.
    pub trellis: TensorView<'a>,
    /// Input sign x scale (`in` values).
    pub suh: TensorView<'a>,
    /// Output sign x scale (`out` values).
    pub svh: TensorView<'a>,
    pub bias: Option<TensorView<'a>>,
    /// Named by the marker tensor present (`mcg`, `mul1`; neither: 3INST).
    pub codebook: Codebook,
}

#[derive(Clone, Copy)]
pub struct Loader<'a> {
    ckpt: &'a Checkpoint,
    prefix: &'a str,
    /// Gives matrices from [`Loader::matrix`] a device copy.
    placer: Option<&'a dyn Placer>,
}

impl<'a> Loader<'a> {
    pub fn new(ckpt: &'a Checkpoint) -> Loader<'a> {
        Loader {
            ckpt,
            prefix: "",
            placer: None,
        }
    }

    /// A loader whose [`Loader::matrix`] results are placed by `placer`.
    pub fn placed(ckpt: &'a Checkpoint, placer: Option<&'a dyn Placer>) -> Loader<'a> {
        Loader {
            ckpt,
            prefix: "",
            placer,
        }
    }

    pub fn checkpoint(&self) -> &'a Checkpoint {
        self.ckpt
    }

    /// The full name of `name` under this prefix.
    pub fn name(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        }
    }

    /// A loader one module deeper; the prefix string is leaked once per module at load time.
    pub fn pp(&self, name: &str) -> Loader<'a> {
        Loader {
            ckpt: self.ckpt,
            prefix: Box::leak(self.name(name).into_boxed_str()),
            placer: self.placer,
        }
    }

    pub fn contains(&self, name: &str) -> bool {
        self.ckpt.contains(&self.name(name))
    }

    /// Whether the weight `name` is present, as stored or as an EXL3 layer.
    pub fn has_matrix(&self, name: &str) -> bool {
        self.contains(name) || self.exl3_base(name).is_some()
    }

    /// `x` of a weight `x.weight` stored as an EXL3 layer (`x.trellis`).
    fn exl3_base<'n>(&self, name: &'n str) -> Option<&'n str> {
        name.strip_suffix(".weight")
            .filter(|base| self.contains(&format!("{base}.trellis")))
    }

    /// The first name of `names` present (one tensor's names across the on-disk layouts).
    pub fn pick<'n>(&self, names: &[&'n str]) -> Result<&'n str, LoadError> {
        names
            .iter()
            .copied()
            .find(|n| self.contains(n))
            .ok_or_else(|| {
                LoadError::Checkpoint(CheckpointError::Missing {
                    key: self.name(names[0]),
                    tried: names
                        .iter()
                        .map(|n| format!("`{}`", self.name(n)))
                        .collect::<Vec<_>>()
                        .join(", "),
                })
            })
    }

    /// A vector of exactly `len` values.
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, LoadError> {
        Ok(self.ckpt.tensor(&self.name(name), &[len])?.to_f32()?)
    }

    /// Any float tensor of `shape`, as f32.
    pub fn f32s(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, LoadError> {
        Ok(self.ckpt.tensor(&self.name(name), shape)?.to_f32()?)
    }

    /// A `rows x cols` weight in its stored format (float, or quantized blocks), with a
    /// device copy when this loader has a placer that wants one.
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix, LoadError> {
        let mut m = self.host_matrix(name, rows, cols)?;
        if let Some(placer) = self.placer {
            let device = placer.place(&m);
            m.set_device(device);
        }
        Ok(m)
    }

    fn host_matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix, LoadError> {
        if let Some(tensors) = self.exl3_tensors(name, rows, cols)? {
            return self.exl3_matrix(tensors);
        }
        let full = self.name(name);
        let view = self.ckpt.view(&full)?;
        if view.dtype == DType::U8 {
            return self.quantized(view, rows, cols);
        }
        let view = self.ckpt.tensor(&full, &[rows, cols])?;
        let format = float_format(&view)?;
        Matrix::from_bytes(rows, cols, format, view.bytes.to_vec()).map_err(|source| {
            LoadError::Matrix {
                key: view.key.to_string(),
                source,
            }
        })
    }

    /// Row block `[row0, row0 + rows)` of slice `index` of a 3-D float tensor `[n, total_rows, cols]`
    /// (one expert of transformers' fused layout).
    pub fn matrix_slice(
        &self,
        name: &str,
        shape: [usize; 3],
        index: usize,
        row0: usize,
        rows: usize,
    ) -> Result<Matrix, LoadError> {
        let view = self.ckpt.tensor(&self.name(name), &shape)?;
        let [_, total_rows, cols] = shape;
        let size = view.dtype.size();
        let start = (index * total_rows + row0) * cols * size;
        let bytes = view.bytes[start..start + rows * cols * size].to_vec();
        Matrix::from_bytes(rows, cols, float_format(&view)?, bytes).map_err(|source| {
            LoadError::Matrix {
                key: view.key.to_string(),
                source,
            }
        })
    }

    /// The tensors of weight `name` (`rows` outputs, `cols` inputs) when it is stored as an
    /// EXL3 layer, as they are on disk, checked against that shape; `None` when it is not
    /// EXL3 (exllamav3's padding of other sizes to multiples of 128 is not supported).
    pub fn exl3_tensors(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Option<Exl3Tensors<'a>>, LoadError> {
        let Some(base) = self.exl3_base(name) else {
            return Ok(None);
        };
        let part = |p: &str| self.name(&format!("{base}.{p}"));
        let trellis = self.ckpt.view(&part("trellis"))?;
        let invalid = |message: String| LoadError::Invalid {
            key: trellis.key.to_string(),
            message,
        };
        if trellis.dtype != DType::I16 {
            return Err(LoadError::Checkpoint(CheckpointError::DType {
                key: trellis.key.to_string(),
                expected: "I16".into(),
                found: trellis.dtype.name().into(),
            }));
        }
        if trellis.shape.len() != 3
            || [16 * trellis.shape[0], 16 * trellis.shape[1]] != [cols, rows]
        {
            return Err(invalid(format!(
                "EXL3 trellis of shape {:?} does not hold a weight of {cols} inputs and {rows} outputs (expected [{cols}/16, {rows}/16, 16 * bits])",
                trellis.shape
            )));
        }
        let codebook = match (
            self.ckpt.contains(&part("mcg")),
            self.ckpt.contains(&part("mul1")),
        ) {
            (false, false) => Codebook::Inst3,
            (true, false) => Codebook::Mcg,
            (false, true) => Codebook::Mul1,
            (true, true) => {
                return Err(invalid("has both an mcg and a mul1 codebook marker".into()));
            }
        };
        let bias = if self.ckpt.contains(&part("bias")) {
            Some(self.ckpt.tensor(&part("bias"), &[rows])?)
        } else {
            None
        };
        Ok(Some(Exl3Tensors {
            suh: self.ckpt.tensor(&part("suh"), &[cols])?,
            svh: self.ckpt.tensor(&part("svh"), &[rows])?,
            trellis,
            bias,
            codebook,
        }))
    }

    /// The EXL3 layer as the matrix `W^T` (`out_features x in_features`).
    fn exl3_matrix(&self, t: Exl3Tensors<'_>) -> Result<Matrix, LoadError> {
        let invalid = |message: String| LoadError::Invalid {
            key: t.trellis.key.to_string(),
            message,
        };
        let mut linear = Exl3Linear::new(
            t.trellis.shape,
            t.trellis.bytes,
            t.suh.to_f32()?,
            t.svh.to_f32()?,
            t.codebook,
        )
        .map_err(|e| invalid(e.to_string()))?;
        if let Some(bias) = t.bias {
            linear = linear
                .with_bias(bias.to_f32()?)
                .map_err(|e| invalid(e.to_string()))?;
        }
        Ok(Matrix::from_exl3(linear))
    }

    fn quantized(
        &self,
        view: TensorView<'_>,
        rows: usize,
        cols: usize,
    ) -> Result<Matrix, LoadError> {
        let invalid = |message: String| LoadError::Invalid {
            key: view.key.to_string(),
            message,
        };
        let meta = self
            .ckpt
            .metadata()
            .get(&quant_metadata_key(view.key))
            .ok_or_else(|| {
                invalid(format!(
                    "is U8 but the file has no `{}` metadata",
                    quant_metadata_key(view.key)
                ))
            })?;
        let (format, stored_cols) = meta
            .split_once(':')
            .and_then(|(f, c)| Some((Format::from_name(f).ok()?, c.parse::<usize>().ok()?)))
            .ok_or_else(|| {
                invalid(format!(
                    "quantization metadata `{meta}` is not `format:cols`"
                ))
            })?;
        if stored_cols != cols {
            return Err(invalid(format!(
                "quantized for {stored_cols} columns, expected {cols}"
            )));
        }
        let row_bytes = format.row_bytes(cols).map_err(|e| invalid(e.to_string()))?;
        if view.shape != [rows, row_bytes] {
            return Err(LoadError::Checkpoint(CheckpointError::Shape {
                key: view.key.to_string(),
                expected: vec![rows, row_bytes],
                found: view.shape.to_vec(),
            }));
        }
        Matrix::from_bytes(rows, cols, format, view.bytes.to_vec()).map_err(|source| {
            LoadError::Matrix {
                key: view.key.to_string(),
                source,
            }
        })
    }
}

fn float_format(view: &TensorView<'_>) -> Result<Format, LoadError> {
    match view.dtype {
        DType::F32 => Ok(Format::F32),
        DType::F16 => Ok(Format::F16),
        DType::Bf16 => Ok(Format::Bf16),
        other => Err(LoadError::Checkpoint(CheckpointError::DType {
            key: view.key.to_string(),
            expected: "F32, F16 or BF16".into(),
            found: other.name().into(),
        })),
    }
}
