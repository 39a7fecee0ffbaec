//! Reading a checkpoint's tensors as host f32.
//!
//! [`TensorStore`] opens `model.safetensors`, or the shards listed by
//! `model.safetensors.index.json`, parses every header once, and hands out
//! tensors by name as `Vec<f32>` after checking dtype (F32 or BF16, both
//! converted exactly) and shape. It must never accept another dtype, reshape a
//! tensor, or look at what the tensors mean; naming and layout belong to
//! `model`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, Metadata};
use serde_json::Value;

use crate::error::EngineError;

/// One opened safetensors file: its bytes and parsed header.
struct File {
    path: PathBuf,
    bytes: Vec<u8>,
    data_start: usize,
    meta: Metadata,
}

/// Every tensor of one checkpoint folder, looked up by name.
pub(crate) struct TensorStore {
    files: Vec<File>,
    /// Tensor name -> index into `files`.
    index: HashMap<String, usize>,
    /// Where a missing tensor is reported (the single file or the shard index).
    label: PathBuf,
}

impl TensorStore {
    /// Opens `dir/model.safetensors`, or the shards of `dir/model.safetensors.index.json`.
    pub(crate) fn open(dir: &Path) -> Result<Self, EngineError> {
        let single = dir.join("model.safetensors");
        let index_path = dir.join("model.safetensors.index.json");
        if !single.exists() && index_path.exists() {
            return Self::open_sharded(dir, &index_path);
        }
        let file = open_file(&single)?;
        let index = file.meta.tensors().into_keys().map(|name| (name, 0)).collect();
        Ok(Self {
            files: vec![file],
            index,
            label: single,
        })
    }

    fn open_sharded(dir: &Path, index_path: &Path) -> Result<Self, EngineError> {
        let text = std::fs::read_to_string(index_path).map_err(|source| EngineError::Io {
            path: index_path.to_path_buf(),
            source,
        })?;
        let value: Value = serde_json::from_str(&text).map_err(|source| EngineError::Json {
            path: index_path.to_path_buf(),
            source,
        })?;
        let bad = |reason: &str| EngineError::ConfigField {
            path: index_path.to_path_buf(),
            field: "weight_map".to_string(),
            reason: reason.to_string(),
        };
        let map = value
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| bad("missing or not an object"))?;
        let mut shard_of: HashMap<String, usize> = HashMap::new();
        let mut files = Vec::new();
        let mut index = HashMap::new();
        for (tensor, shard) in map {
            let shard = shard.as_str().ok_or_else(|| bad("shard names must be strings"))?;
            if shard.contains('/') || shard.contains('\\') || shard == ".." {
                return Err(bad("shard names must be plain file names"));
            }
            let slot = match shard_of.get(shard) {
                Some(&slot) => slot,
                None => {
                    files.push(open_file(&dir.join(shard))?);
                    shard_of.insert(shard.to_string(), files.len() - 1);
                    files.len() - 1
                }
            };
            index.insert(tensor.clone(), slot);
        }
        Ok(Self {
            files,
            index,
            label: index_path.to_path_buf(),
        })
    }

    /// Whether the checkpoint holds `name`.
    pub(crate) fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Tensor `name` as f32, checked to have exactly `shape`.
    pub(crate) fn load(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, EngineError> {
        let missing = || EngineError::MissingTensor {
            file: self.label.clone(),
            tensor: name.to_string(),
        };
        let &slot = self.index.get(name).ok_or_else(missing)?;
        let file = self.files.get(slot).ok_or_else(missing)?;
        let info = file.meta.info(name).ok_or_else(missing)?;
        if info.shape != shape {
            return Err(EngineError::TensorShape {
                file: file.path.clone(),
                tensor: name.to_string(),
                expected: shape.to_vec(),
                found: info.shape.clone(),
            });
        }
        let (start, end) = info.data_offsets;
        let bytes = start
            .checked_add(file.data_start)
            .zip(end.checked_add(file.data_start))
            .and_then(|(s, e)| file.bytes.get(s..e))
            .ok_or_else(|| EngineError::Safetensors {
                file: file.path.clone(),
                source: safetensors::SafeTensorError::InvalidOffset(name.to_string()),
            })?;
        match info.dtype {
            Dtype::F32 => Ok(bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()),
            // bf16 is the top half of an f32: the widening is exact.
            Dtype::BF16 => Ok(bytes
                .chunks_exact(2)
                .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16))
                .collect()),
            other => Err(EngineError::UnsupportedDtype {
                file: file.path.clone(),
                tensor: name.to_string(),
                dtype: format!("{other:?}"),
            }),
        }
    }

    /// Where a missing tensor is reported.
    pub(crate) fn label(&self) -> &Path {
        &self.label
    }
}

fn open_file(path: &Path) -> Result<File, EngineError> {
    let bytes = std::fs::read(path).map_err(|source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let (header_len, meta) =
        safetensors::SafeTensors::read_metadata(&bytes).map_err(|source| EngineError::Safetensors {
            file: path.to_path_buf(),
            source,
        })?;
    Ok(File {
        path: path.to_path_buf(),
        data_start: 8 + header_len,
        bytes,
        meta,
    })
}
