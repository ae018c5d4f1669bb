//! Safetensors checkpoints, memory-mapped: one `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`.
//!
//! Tensors are found by their name in the text model's module tree (`layers.3.mlp.gate.weight`);
//! [`Checkpoint::resolve`] maps that to the key on disk, trying the prefixes a glm5_next
//! checkpoint can carry. Reads check the shape and name the key and both shapes on mismatch.

use memmap2::Mmap;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    Bf16,
    U8,
    /// EXL3 trellises.
    I16,
    /// EXL3 codebook markers (0-d).
    I32,
}

impl DType {
    fn parse(s: &str) -> Option<DType> {
        Some(match s {
            "F32" => DType::F32,
            "F16" => DType::F16,
            "BF16" => DType::Bf16,
            "U8" => DType::U8,
            "I16" => DType::I16,
            "I32" => DType::I32,
            _ => return None,
        })
    }

    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::Bf16 | DType::I16 => 2,
            DType::U8 => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::Bf16 => "BF16",
            DType::U8 => "U8",
            DType::I16 => "I16",
            DType::I32 => "I32",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Format { path: String, message: String },
    #[error("tensor `{key}` is missing from the checkpoint (looked for {tried})")]
    Missing { key: String, tried: String },
    #[error("tensor `{key}` has shape {found:?}, expected {expected:?}")]
    Shape {
        key: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("tensor `{key}` has dtype {found}, expected one of {expected}")]
    DType {
        key: String,
        expected: String,
        found: String,
    },
}

#[derive(Clone, Debug)]
struct Entry {
    file: usize,
    dtype: DType,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// A tensor's bytes inside a mapped file.
#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    pub key: &'a str,
    pub dtype: DType,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

impl TensorView<'_> {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Values as f32 (exact for every float dtype).
    pub fn to_f32(&self) -> Result<Vec<f32>, CheckpointError> {
        let b = self.bytes;
        Ok(match self.dtype {
            DType::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            DType::F16 => b
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            DType::Bf16 => b
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            DType::U8 | DType::I16 | DType::I32 => {
                return Err(CheckpointError::DType {
                    key: self.key.to_string(),
                    expected: "F32, F16 or BF16".into(),
                    found: self.dtype.name().into(),
                });
            }
        })
    }
}

pub struct Checkpoint {
    dir: PathBuf,
    maps: Vec<Mmap>,
    files: Vec<PathBuf>,
    entries: HashMap<String, Entry>,
    /// `__metadata__` of every file, merged.
    metadata: BTreeMap<String, String>,
    prefix: String,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("dir", &self.dir)
            .field("files", &self.files)
            .field("tensors", &self.entries.len())
            .finish()
    }
}

/// Where the text model lives in the key space, most specific first.
const TEXT_PREFIXES: [&str; 3] = ["model.language_model.", "model.", ""];

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Checkpoint, CheckpointError> {
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|source| CheckpointError::Io {
                path: index.display().to_string(),
                source,
            })?;
            let json: Value = serde_json::from_str(&text).map_err(|e| CheckpointError::Format {
                path: index.display().to_string(),
                message: format!("not valid JSON: {e}"),
            })?;
            let map = json
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| CheckpointError::Format {
                    path: index.display().to_string(),
                    message: "has no `weight_map` object".into(),
                })?;
            let mut names: Vec<String> = map
                .values()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect();
            names.sort();
            names.dedup();
            names.into_iter().map(|n| dir.join(n)).collect()
        } else {
            let single = dir.join("model.safetensors");
            if !single.exists() {
                return Err(CheckpointError::Format {
                    path: dir.display().to_string(),
                    message: "has neither model.safetensors nor model.safetensors.index.json"
                        .into(),
                });
            }
            vec![single]
        };

        let mut maps = Vec::new();
        let mut entries = HashMap::new();
        let mut metadata = BTreeMap::new();
        for (i, path) in files.iter().enumerate() {
            let (map, file_entries, meta) = read_file(path, i)?;
            for (k, e) in file_entries {
                if entries.insert(k.clone(), e).is_some() {
                    return Err(CheckpointError::Format {
                        path: path.display().to_string(),
                        message: format!("tensor `{k}` appears in more than one shard"),
                    });
                }
            }
            metadata.extend(meta);
            maps.push(map);
        }
        let prefix = TEXT_PREFIXES
            .iter()
            .find(|p| entries.contains_key(&format!("{p}embed_tokens.weight")))
            .unwrap_or(&"model.language_model.")
            .to_string();
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            maps,
            files,
            entries,
            metadata,
            prefix,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// All keys on disk, sorted.
    pub fn keys(&self) -> Vec<&str> {
        let mut keys: Vec<&str> = self.entries.keys().map(String::as_str).collect();
        keys.sort_unstable();
        keys
    }

    /// The on-disk key of a text-model tensor (`layers.0.mlp...`), or of a top-level one
    /// (`lm_head.weight`).
    pub fn resolve(&self, name: &str) -> Option<String> {
        [format!("{}{name}", self.prefix), name.to_string()]
            .into_iter()
            .find(|k| self.entries.contains_key(k))
    }

    pub fn contains(&self, name: &str) -> bool {
        self.resolve(name).is_some()
    }

    /// The tensor named `name` (text-model relative), any dtype, any shape.
    pub fn view(&self, name: &str) -> Result<TensorView<'_>, CheckpointError> {
        let key = self.resolve(name).ok_or_else(|| CheckpointError::Missing {
            key: name.to_string(),
            tried: format!("`{}{name}`", self.prefix),
        })?;
        let (key, e) = self
            .entries
            .get_key_value(&key)
            .expect("resolved key exists");
        Ok(TensorView {
            key,
            dtype: e.dtype,
            shape: &e.shape,
            bytes: &self.maps[e.file][e.start..e.end],
        })
    }

    /// The tensor named `name`, which must have exactly `shape`.
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<TensorView<'_>, CheckpointError> {
        let view = self.view(name)?;
        if view.shape != shape {
            return Err(CheckpointError::Shape {
                key: view.key.to_string(),
                expected: shape.to_vec(),
                found: view.shape.to_vec(),
            });
        }
        Ok(view)
    }

    /// The first of `names` present in the checkpoint (aliases of one tensor across layouts).
    pub fn first_present<'n>(&self, names: &[&'n str]) -> Option<&'n str> {
        names.iter().copied().find(|n| self.contains(n))
    }
}

type FileContents = (Mmap, Vec<(String, Entry)>, BTreeMap<String, String>);

fn read_file(path: &Path, index: usize) -> Result<FileContents, CheckpointError> {
    let fmt_err = |message: String| CheckpointError::Format {
        path: path.display().to_string(),
        message,
    };
    let file = File::open(path).map_err(|source| CheckpointError::Io {
        path: path.display().to_string(),
        source,
    })?;
    let map = crate::mmap::map_readonly(&file).map_err(|source| CheckpointError::Io {
        path: path.display().to_string(),
        source,
    })?;
    if map.len() < 8 {
        return Err(fmt_err(format!(
            "is {} bytes, too short for a safetensors header",
            map.len()
        )));
    }
    let header_len = u64::from_le_bytes(map[..8].try_into().expect("8 bytes")) as usize;
    let data_start = 8usize
        .checked_add(header_len)
        .filter(|&end| end <= map.len())
        .ok_or_else(|| {
            fmt_err(format!(
                "header length {header_len} runs past the end of the file ({} bytes)",
                map.len()
            ))
        })?;
    let header: Value = serde_json::from_slice(&map[8..data_start])
        .map_err(|e| fmt_err(format!("safetensors header is not valid JSON: {e}")))?;
    let header = header
        .as_object()
        .ok_or_else(|| fmt_err("safetensors header is not a JSON object".into()))?;
    let data_len = map.len() - data_start;
    let mut entries = Vec::new();
    let mut metadata = BTreeMap::new();
    for (key, info) in header {
        if key == "__metadata__" {
            if let Some(m) = info.as_object() {
                for (k, v) in m {
                    if let Some(s) = v.as_str() {
                        metadata.insert(k.clone(), s.to_string());
                    }
                }
            }
            continue;
        }
        let dtype_name = info.get("dtype").and_then(Value::as_str).unwrap_or("?");
        let dtype = DType::parse(dtype_name).ok_or_else(|| {
            fmt_err(format!(
                "tensor `{key}` has unsupported dtype {dtype_name} (F32, F16, BF16, U8, I16, I32 are)"
            ))
        })?;
        let shape: Vec<usize> = info
            .get("shape")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_u64)
                    .map(|n| n as usize)
                    .collect()
            })
            .ok_or_else(|| fmt_err(format!("tensor `{key}` has no shape")))?;
        let offsets: Vec<usize> = info
            .get("data_offsets")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_u64)
                    .map(|n| n as usize)
                    .collect()
            })
            .filter(|o: &Vec<usize>| o.len() == 2)
            .ok_or_else(|| fmt_err(format!("tensor `{key}` has no data_offsets pair")))?;
        let (start, end) = (offsets[0], offsets[1]);
        let expected = shape.iter().product::<usize>() * dtype.size();
        if start > end || end > data_len || end - start != expected {
            return Err(fmt_err(format!(
                "tensor `{key}` data_offsets [{start}, {end}] do not fit its shape {shape:?} {dtype_name} ({expected} bytes) in {data_len} data bytes"
            )));
        }
        entries.push((
            key.clone(),
            Entry {
                file: index,
                dtype,
                shape,
                start: data_start + start,
                end: data_start + end,
            },
        ));
    }
    Ok((map, entries, metadata))
}

/// Writes a safetensors file (used by the demo model, the expert converter and tests).
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, DType, Vec<usize>, Vec<u8>)],
    metadata: &BTreeMap<String, String>,
) -> std::io::Result<()> {
    use std::io::Write;
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        header.insert(
            "__metadata__".into(),
            serde_json::to_value(metadata).expect("string map"),
        );
    }
    let mut offset = 0usize;
    let mut sorted: Vec<&(String, DType, Vec<usize>, Vec<u8>)> = tensors.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, dtype, shape, bytes) in &sorted {
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype.name(), "shape": shape, "data_offsets": [offset, offset + bytes.len()]}),
        );
        offset += bytes.len();
    }
    let mut header_bytes = serde_json::to_vec(&header).expect("header serialises");
    while !(8 + header_bytes.len()).is_multiple_of(8) {
        header_bytes.push(b' ');
    }
    let mut out = std::io::BufWriter::new(File::create(path)?);
    out.write_all(&(header_bytes.len() as u64).to_le_bytes())?;
    out.write_all(&header_bytes)?;
    for (_, _, _, bytes) in sorted {
        out.write_all(bytes)?;
    }
    out.flush()
}
