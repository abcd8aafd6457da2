//! GGUF reader: header, metadata and tensor directory, with every length checked against the file so that a
//! truncated or corrupt file gives an error that names what is wrong instead of a panic.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::model::dtype::GgmlType;
use crate::model::file_bytes::FileBytes;
use crate::model::tensors::{RawTensor, WeightSource};

const GGUF_MAGIC: u32 = 0x4655_4747; // "GGUF" little-endian
const DEFAULT_ALIGNMENT: u64 = 32;
// Limits that no real file reaches; they stop a corrupt length field from asking for terabytes.
const MAX_STRING_LEN: u64 = 1 << 26;
const MAX_ARRAY_LEN: u64 = 1 << 28;
const MAX_TENSORS: u64 = 1 << 20;
const MAX_DIMS: u32 = 4;

#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) if v >= 0 => Some(v as u64),
            Value::I16(v) if v >= 0 => Some(v as u64),
            Value::I32(v) if v >= 0 => Some(v as u64),
            Value::I64(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions in GGUF order: innermost (contiguous) first, i.e. `[columns, rows]` for a matrix.
    pub dims: Vec<usize>,
    pub type_id: u32,
    /// Byte offset relative to the start of the tensor data section.
    pub offset: u64,
}

impl TensorInfo {
    /// The product of the dimensions (checked to fit when the file was read).
    pub fn n_elements(&self) -> usize {
        self.dims.iter().product()
    }
}

/// A parsed GGUF file, memory-mapped (or in memory); tensors are copied out on demand.
pub struct GgufFile {
    pub path: PathBuf,
    pub metadata: HashMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    data_start: u64,
    bytes: FileBytes,
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn bad(&self, reason: String) -> Error {
        Error::BadGguf {
            path: self.path.to_path_buf(),
            reason,
        }
    }
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        match end {
            Some(end) => {
                let s = &self.bytes[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(self.bad(format!(
                "file ends at byte {} while reading {what} ({n} bytes at offset {}); the file is truncated",
                self.bytes.len(),
                self.pos
            ))),
        }
    }
    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16> {
        Ok(u16::from_le_bytes(
            self.take(2, what)?.try_into().unwrap_or_default(),
        ))
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4, what)?.try_into().unwrap_or_default(),
        ))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(8, what)?.try_into().unwrap_or_default(),
        ))
    }
    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        if len > MAX_STRING_LEN {
            return Err(self.bad(format!("{what} has length {len}, which is corrupt")));
        }
        let bytes = self.take(len as usize, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| self.bad(format!("{what} is not valid UTF-8")))
    }
    fn value(&mut self, type_id: u32, what: &str, depth: usize) -> Result<Value> {
        Ok(match type_id {
            0 => Value::U8(self.u8(what)?),
            1 => Value::I8(self.u8(what)? as i8),
            2 => Value::U16(self.u16(what)?),
            3 => Value::I16(self.u16(what)? as i16),
            4 => Value::U32(self.u32(what)?),
            5 => Value::I32(self.u32(what)? as i32),
            6 => Value::F32(f32::from_bits(self.u32(what)?)),
            7 => Value::Bool(self.u8(what)? != 0),
            8 => Value::String(self.string(what)?),
            9 => {
                if depth > 2 {
                    return Err(self.bad(format!("{what}: arrays nested too deeply")));
                }
                let elem_type = self.u32(what)?;
                let len = self.u64(what)?;
                if len > MAX_ARRAY_LEN {
                    return Err(
                        self.bad(format!("{what} has array length {len}, which is corrupt"))
                    );
                }
                let mut items = Vec::with_capacity((len as usize).min(1 << 20));
                for _ in 0..len {
                    items.push(self.value(elem_type, what, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64(what)?),
            11 => Value::I64(self.u64(what)? as i64),
            12 => Value::F64(f64::from_bits(self.u64(what)?)),
            other => return Err(self.bad(format!("{what} has unknown value type {other}"))),
        })
    }
}

impl GgufFile {
    /// Maps and parses a GGUF file, checking that every tensor lies inside it.
    pub fn open(path: &Path) -> Result<Self> {
        let gguf = Self::parse(FileBytes::map(path)?, path)?;
        gguf.check_tensor_extents()?;
        Ok(gguf)
    }

    /// Parses GGUF bytes held in memory (`label` names them in errors), checking tensor extents like [`open`].
    ///
    /// [`open`]: GgufFile::open
    pub fn from_bytes(bytes: Vec<u8>, label: &Path) -> Result<Self> {
        let gguf = Self::parse(FileBytes::Owned(bytes), label)?;
        gguf.check_tensor_extents()?;
        Ok(gguf)
    }

    /// Header, metadata and tensor directory only: tensors are not checked against the file's length until
    /// [`GgufFile::check_tensor_extents`] (a header without its data still has a config and a tokenizer).
    pub fn parse_header(bytes: Vec<u8>, label: &Path) -> Result<Self> {
        Self::parse(FileBytes::Owned(bytes), label)
    }

    fn parse(bytes: FileBytes, path: &Path) -> Result<Self> {
        let mut cur = Cursor {
            bytes: &bytes,
            pos: 0,
            path,
        };
        let magic = cur.u32("magic")?;
        if magic != GGUF_MAGIC {
            return Err(cur.bad(format!(
                "magic is {:?}, expected \"GGUF\"",
                String::from_utf8_lossy(&magic.to_le_bytes())
            )));
        }
        let version = cur.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(cur.bad(format!("GGUF version {version} is not supported (2 or 3)")));
        }
        let tensor_count = cur.u64("tensor count")?;
        let kv_count = cur.u64("metadata count")?;
        if tensor_count > MAX_TENSORS || kv_count > MAX_TENSORS {
            return Err(cur.bad(format!(
                "header claims {tensor_count} tensors and {kv_count} metadata entries, which is corrupt"
            )));
        }
        let mut metadata = HashMap::new();
        for i in 0..kv_count {
            let key = cur.string(&format!("metadata key #{i}"))?;
            let type_id = cur.u32(&format!("type of metadata {key}"))?;
            let value = cur.value(type_id, &format!("metadata {key}"), 0)?;
            metadata.insert(key, value);
        }
        let mut tensors = Vec::with_capacity(tensor_count as usize);
        for i in 0..tensor_count {
            let name = cur.string(&format!("name of tensor #{i}"))?;
            let n_dims = cur.u32(&format!("rank of tensor {name}"))?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(cur.bad(format!("tensor {name} has rank {n_dims}")));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                let d = cur.u64(&format!("shape of tensor {name}"))?;
                if d == 0 || d > (1 << 40) {
                    return Err(cur.bad(format!("tensor {name} has a dimension of {d}")));
                }
                dims.push(d as usize);
            }
            // Four dimensions of up to 2^40 can overflow; a wrapped product would defeat the extent check.
            if dims
                .iter()
                .try_fold(1usize, |acc, &d| acc.checked_mul(d))
                .is_none()
            {
                return Err(cur.bad(format!(
                    "tensor {name} has dimensions {dims:?}, whose product overflows"
                )));
            }
            let type_id = cur.u32(&format!("type of tensor {name}"))?;
            let offset = cur.u64(&format!("offset of tensor {name}"))?;
            tensors.push(TensorInfo {
                name,
                dims,
                type_id,
                offset,
            });
        }
        let alignment = metadata
            .get("general.alignment")
            .and_then(Value::as_u64)
            .unwrap_or(DEFAULT_ALIGNMENT)
            .max(1);
        let data_start = (cur.pos as u64).div_ceil(alignment) * alignment;
        let tensor_index = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(GgufFile {
            path: path.to_path_buf(),
            metadata,
            tensors,
            tensor_index,
            data_start,
            bytes,
        })
    }

    /// Every tensor must lie inside the file: a truncated download is caught at load, naming the first tensor cut off.
    pub fn check_tensor_extents(&self) -> Result<()> {
        let file_len = self.bytes.len() as u64;
        for t in &self.tensors {
            let Some(ty) = GgmlType::from_id(t.type_id) else {
                continue; // reported when (and if) the tensor is used, with its type named
            };
            let Some(bytes) = ty.bytes_for(t.n_elements()) else {
                return Err(self.bad(format!(
                    "tensor {} has {} elements: not a multiple of {}'s block size {}, or too many",
                    t.name,
                    t.n_elements(),
                    ty.name(),
                    ty.block_size()
                )));
            };
            let end = self
                .data_start
                .checked_add(t.offset)
                .and_then(|v| v.checked_add(bytes as u64))
                .unwrap_or(u64::MAX);
            if end > file_len {
                return Err(self.bad(format!(
                    "tensor {} needs bytes up to {end} but the file has {file_len}; the file is truncated",
                    t.name
                )));
            }
        }
        Ok(())
    }

    fn bad(&self, reason: String) -> Error {
        Error::BadGguf {
            path: self.path.clone(),
            reason,
        }
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Value::as_str)
    }

    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(Value::as_u64)
    }

    pub fn get_f64(&self, key: &str) -> Option<f64> {
        self.get(key).and_then(Value::as_f64)
    }

    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// A tensor as a `rows x cols` matrix (GGUF dims `[cols, rows]`), or a vector when `rows == 1`, checked.
    pub fn tensor(&self, name: &str, rows: usize, cols: usize) -> Result<RawTensor<'_>> {
        let info = self.tensor_info(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
            hint: format!(" in {}", self.path.display()),
        })?;
        let expected_elems = rows
            .checked_mul(cols)
            .ok_or_else(|| self.bad(format!("tensor {name}: {rows} x {cols} elements overflow")))?;
        let shape_ok = match info.dims.as_slice() {
            [c] => rows == 1 && *c == cols,
            [c, r] => *c == cols && *r == rows,
            _ => false,
        };
        if !shape_ok || info.n_elements() != expected_elems {
            return Err(Error::ShapeMismatch {
                name: name.to_string(),
                actual: info.dims.iter().rev().copied().collect(),
                expected: if rows == 1 {
                    vec![cols]
                } else {
                    vec![rows, cols]
                },
            });
        }
        let ty = GgmlType::from_id(info.type_id).ok_or_else(|| Error::UnsupportedTensorType {
            path: self.path.clone(),
            tensor: name.to_string(),
            dtype: ggml_type_name(info.type_id),
            supported: GgmlType::SUPPORTED,
        })?;
        if !cols.is_multiple_of(ty.block_size()) {
            return Err(self.bad(format!(
                "tensor {name} row length {cols} is not a multiple of {}'s block size {}",
                ty.name(),
                ty.block_size()
            )));
        }
        let bytes = ty.bytes_for(expected_elems).ok_or_else(|| {
            self.bad(format!(
                "tensor {name}: {expected_elems} elements of {} overflow",
                ty.name()
            ))
        })?;
        Ok(RawTensor {
            dtype: ty,
            rows,
            cols,
            bytes: self.data_of(info, bytes)?,
            file: &self.path,
        })
    }
}

impl GgufFile {
    /// The `len` bytes of a tensor's data, or an error if they lie past the end of the file.
    fn data_of(&self, info: &TensorInfo, len: usize) -> Result<&[u8]> {
        self.data_start
            .checked_add(info.offset)
            .and_then(|start| usize::try_from(start).ok())
            .and_then(|start| self.bytes.get(start..start.checked_add(len)?))
            .ok_or_else(|| {
                self.bad(format!(
                    "tensor {} lies past the end of the file ({} bytes); the file is truncated",
                    info.name,
                    self.bytes.len()
                ))
            })
    }

    /// A tensor's stored bytes as they are in the file (any type specula knows the size of).
    pub fn raw_tensor_bytes(&self, name: &str) -> Result<&[u8]> {
        let info = self.tensor_info(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
            hint: format!(" in {}", self.path.display()),
        })?;
        let len = GgmlType::from_id(info.type_id)
            .and_then(|ty| ty.bytes_for(info.n_elements()))
            .ok_or_else(|| {
                self.bad(format!(
                    "tensor {name} has type {}, whose size specula cannot compute",
                    ggml_type_name(info.type_id)
                ))
            })?;
        self.data_of(info, len)
    }
}

impl WeightSource for GgufFile {
    fn tensor(&self, name: &str, rows: usize, cols: usize) -> Result<RawTensor<'_>> {
        GgufFile::tensor(self, name, rows, cols)
    }
    fn has(&self, name: &str) -> bool {
        self.tensor_info(name).is_some()
    }
}

/// Name of any GGML type id, including the ones specula cannot compute with, for error messages.
pub fn ggml_type_name(id: u32) -> String {
    let name = match id {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        30 => "BF16",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => return format!("unknown GGML type {id}"),
    };
    format!("{name} (GGML type {id})")
}

/// Writes a minimal GGUF file; used by tests to build tiny models and corrupt files.
pub fn write_gguf(
    path: &Path,
    metadata: &[(&str, Value)],
    tensors: &[(&str, Vec<usize>, u32, Vec<u8>)],
) -> std::io::Result<()> {
    let mut offset = 0u64;
    let mut infos = Vec::new();
    for (name, dims, ty, data) in tensors {
        infos.push(TensorInfo {
            name: name.to_string(),
            dims: dims.clone(),
            type_id: *ty,
            offset,
        });
        offset += (data.len() as u64).div_ceil(DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT;
    }
    let mut out = header_bytes(metadata, &infos);
    for (_, _, _, data) in tensors {
        out.extend_from_slice(data);
        while !(out.len() as u64).is_multiple_of(DEFAULT_ALIGNMENT) {
            out.push(0);
        }
    }
    std::fs::write(path, out)
}

/// A GGUF header (magic, version 3, metadata, tensor directory with the given offsets) padded to the default
/// alignment, where the tensor data would start. Used to write tiny models and fuzzing seeds.
pub fn header_bytes(metadata: &[(&str, Value)], tensors: &[TensorInfo]) -> Vec<u8> {
    fn put_string(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }
    fn type_of(v: &Value) -> u32 {
        match v {
            Value::U8(_) => 0,
            Value::I8(_) => 1,
            Value::U16(_) => 2,
            Value::I16(_) => 3,
            Value::U32(_) => 4,
            Value::I32(_) => 5,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::String(_) => 8,
            Value::Array(_) => 9,
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
        }
    }
    fn put_value(out: &mut Vec<u8>, v: &Value) {
        match v {
            Value::U8(x) => out.push(*x),
            Value::I8(x) => out.push(*x as u8),
            Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::Bool(x) => out.push(*x as u8),
            Value::String(s) => put_string(out, s),
            Value::Array(items) => {
                let elem = items.first().map(type_of).unwrap_or(4);
                out.extend_from_slice(&elem.to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for it in items {
                    put_value(out, it);
                }
            }
            Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        }
    }
    let mut out = Vec::new();
    out.extend_from_slice(&GGUF_MAGIC.to_le_bytes());
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        put_string(&mut out, k);
        out.extend_from_slice(&type_of(v).to_le_bytes());
        put_value(&mut out, v);
    }
    for t in tensors {
        put_string(&mut out, &t.name);
        out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            out.extend_from_slice(&(*d as u64).to_le_bytes());
        }
        out.extend_from_slice(&t.type_id.to_le_bytes());
        out.extend_from_slice(&t.offset.to_le_bytes());
    }
    while !(out.len() as u64).is_multiple_of(DEFAULT_ALIGNMENT) {
        out.push(0);
    }
    out
}
