//! Hugging Face safetensors checkpoints (one file or sharded), f32 / f16 / bf16, memory-mapped.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub use safetensors::tensor::Dtype;
use safetensors::tensor::Metadata;
use safetensors::SafeTensors;

use crate::error::{Error, Result};
use crate::model::dtype::GgmlType;
use crate::model::file_bytes::FileBytes;
use crate::model::tensors::{RawTensor, WeightSource};

struct Shard {
    path: PathBuf,
    bytes: FileBytes,
    header_len: usize,
    metadata: Metadata,
}

pub struct SafetensorsFiles {
    shards: Vec<Shard>,
    /// tensor name -> shard index
    index: HashMap<String, usize>,
}

impl SafetensorsFiles {
    /// Opens every `*.safetensors` file in `dir` (a sharded checkpoint's shards, or the single file).
    pub fn open_dir(dir: &Path) -> Result<Self> {
        let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
        let mut paths: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        paths.sort();
        if paths.is_empty() {
            return Err(Error::BadSafetensors {
                path: dir.to_path_buf(),
                reason: "the directory holds no *.safetensors file".into(),
            });
        }
        Self::open(&paths)
    }

    pub fn open(paths: &[PathBuf]) -> Result<Self> {
        let shards = paths
            .iter()
            .map(|path| Ok((path.clone(), FileBytes::map(path)?)))
            .collect::<Result<Vec<_>>>()?;
        Self::from_shards(shards)
    }

    /// Shards held in memory, each with the path that names it in errors.
    pub fn from_bytes(shards: Vec<(PathBuf, Vec<u8>)>) -> Result<Self> {
        Self::from_shards(
            shards
                .into_iter()
                .map(|(path, bytes)| (path, FileBytes::Owned(bytes)))
                .collect(),
        )
    }

    fn from_shards(files: Vec<(PathBuf, FileBytes)>) -> Result<Self> {
        let mut shards = Vec::new();
        let mut index = HashMap::new();
        for (path, bytes) in files {
            let (header_len, metadata) =
                SafeTensors::read_metadata(&bytes).map_err(|e| Error::BadSafetensors {
                    path: path.clone(),
                    reason: match e {
                        safetensors::SafeTensorError::MetadataIncompleteBuffer => {
                            "the tensor data does not match the header's size; the file is truncated or corrupt"
                                .to_string()
                        }
                        other => other.to_string(),
                    },
                })?;
            for name in metadata.tensors().keys() {
                index.insert(name.clone(), shards.len());
            }
            shards.push(Shard {
                path,
                bytes,
                header_len,
                metadata,
            });
        }
        Ok(SafetensorsFiles { shards, index })
    }
}

impl WeightSource for SafetensorsFiles {
    fn has(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    fn tensor(&self, name: &str, rows: usize, cols: usize) -> Result<RawTensor<'_>> {
        let (shard, info) = self.locate(name)?;
        let shape_ok = match info.shape.as_slice() {
            [c] => rows == 1 && *c == cols,
            [r, c] => *r == rows && *c == cols,
            _ => false,
        };
        if !shape_ok {
            return Err(Error::ShapeMismatch {
                name: name.to_string(),
                actual: info.shape.clone(),
                expected: if rows == 1 {
                    vec![cols]
                } else {
                    vec![rows, cols]
                },
            });
        }
        let ty = match info.dtype {
            Dtype::F32 => GgmlType::F32,
            Dtype::F16 => GgmlType::F16,
            Dtype::BF16 => GgmlType::BF16,
            other => {
                return Err(Error::UnsupportedTensorType {
                    path: shard.path.clone(),
                    tensor: name.to_string(),
                    dtype: format!("{other:?}"),
                    supported: "F32, F16, BF16",
                })
            }
        };
        let data = shard.data(name, info)?;
        let expected = rows
            .checked_mul(cols)
            .and_then(|n| ty.bytes_for(n))
            .ok_or_else(|| Error::BadSafetensors {
                path: shard.path.clone(),
                reason: format!("tensor {name}: {rows} x {cols} elements overflow"),
            })?;
        if data.len() != expected {
            return Err(Error::BadSafetensors {
                path: shard.path.clone(),
                reason: format!(
                    "tensor {name} has {} bytes, expected {expected}",
                    data.len()
                ),
            });
        }
        Ok(RawTensor {
            dtype: ty,
            rows,
            cols,
            bytes: data,
            file: &shard.path,
        })
    }
}

impl Shard {
    /// Tensor `name`'s bytes (its header entry `info`), checked to lie inside the file.
    fn data(&self, name: &str, info: &safetensors::tensor::TensorInfo) -> Result<&[u8]> {
        let (begin, end) = info.data_offsets;
        let base = 8 + self.header_len;
        base.checked_add(begin)
            .zip(base.checked_add(end))
            .and_then(|(b, e)| self.bytes.get(b..e))
            .ok_or_else(|| Error::BadSafetensors {
                path: self.path.clone(),
                reason: format!("tensor {name}'s data offsets {begin}..{end} lie outside the file"),
            })
    }
}

impl SafetensorsFiles {
    /// The shard holding tensor `name` and its header entry.
    fn locate(&self, name: &str) -> Result<(&Shard, &safetensors::tensor::TensorInfo)> {
        let shard = self
            .index
            .get(name)
            .map(|&i| &self.shards[i])
            .ok_or_else(|| Error::MissingTensor {
                name: name.to_string(),
                hint: " in the safetensors files".into(),
            })?;
        let info = shard
            .metadata
            .info(name)
            .ok_or_else(|| Error::MissingTensor {
                name: name.to_string(),
                hint: format!(" in {}", shard.path.display()),
            })?;
        Ok((shard, info))
    }

    /// The shape of tensor `name`, if present.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let shard = &self.shards[*self.index.get(name)?];
        shard.metadata.info(name).map(|i| i.shape.clone())
    }

    /// An integer vector of `len` values (I64 or I32), e.g. an EAGLE-3 head's d2t.
    pub fn integers(&self, name: &str, len: usize) -> Result<Vec<i64>> {
        let (shard, info) = self.locate(name)?;
        if info.shape != [len] {
            return Err(Error::ShapeMismatch {
                name: name.to_string(),
                actual: info.shape.clone(),
                expected: vec![len],
            });
        }
        let width = match info.dtype {
            Dtype::I64 => 8,
            Dtype::I32 => 4,
            other => {
                return Err(Error::UnsupportedTensorType {
                    path: shard.path.clone(),
                    tensor: name.to_string(),
                    dtype: format!("{other:?}"),
                    supported: "I64, I32",
                })
            }
        };
        let data = Some(shard.data(name, info)?)
            .filter(|d| d.len() == len * width)
            .ok_or_else(|| Error::BadSafetensors {
                path: shard.path.clone(),
                reason: format!("tensor {name} does not hold {len} integers"),
            })?;
        Ok(data
            .chunks_exact(width)
            .map(|b| match width {
                8 => i64::from_le_bytes(b.try_into().expect("8 bytes")),
                _ => i64::from(i32::from_le_bytes(b.try_into().expect("4 bytes"))),
            })
            .collect())
    }
}

/// Writes f32 tensors as a safetensors file (tests build tiny HF checkpoints with it).
pub fn write_f32_safetensors(
    path: &Path,
    tensors: &[(String, Vec<usize>, Vec<f32>)],
) -> Result<()> {
    let bytes: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, s, d)| {
            (
                n.clone(),
                Dtype::F32,
                s.clone(),
                d.iter().flat_map(|v| v.to_le_bytes()).collect(),
            )
        })
        .collect();
    write_safetensors(path, &bytes)
}

/// Writes tensors of any safetensors type, given as little-endian bytes.
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)],
) -> Result<()> {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, ty, s, b)| {
            safetensors::tensor::TensorView::new(*ty, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| Error::BadSafetensors {
                    path: path.to_path_buf(),
                    reason: e.to_string(),
                })
        })
        .collect::<Result<_>>()?;
    safetensors::serialize_to_file(views, None, path).map_err(|e| Error::BadSafetensors {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}
