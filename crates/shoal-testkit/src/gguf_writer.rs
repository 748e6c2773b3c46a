//! A GGUF (version 3, little-endian) writer for tests, including deliberately broken files.
//!
//! The file is: the magic `GGUF`, `version: u32`, `n_tensors: u64`, `n_kv: u64`; then `n_kv`
//! metadata pairs (key as a string, `type: u32`, value); then `n_tensors` tensor infos (name,
//! `n_dims: u32`, `ne[n_dims]: u64` innermost dimension first, ggml `type: u32`,
//! `offset: u64` relative to the data section); then zero padding up to the alignment; then the
//! data section, each tensor starting at a multiple of the alignment and padded to it. Strings
//! are a `u64` byte length followed by UTF-8 bytes (no terminator); arrays are an element
//! `type: u32`, a `u64` count and the elements without type tags. The alignment is 32 unless
//! [`GgufWriter::set_alignment`] sets another, which also writes `general.alignment` (u32).
//!
//! For the reader's error paths, everything the header claims can be overridden (magic,
//! version, counts, tensor offsets, raw type ids and unchecked tensor bytes), and
//! [`GgufWriter::bytes`] with [`GgufWriter::layout`] give the exact bytes and where each part
//! sits, so a test can truncate or mangle them.

use std::path::Path;

use crate::quants::{quantize, GgmlType};
use crate::TestkitError;

/// The 4 bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// The GGUF version this writer produces.
pub const GGUF_VERSION: u32 = 3;
/// Alignment of the data section when `general.alignment` is absent.
pub const GGUF_DEFAULT_ALIGNMENT: u32 = 32;
/// The metadata key that sets the alignment.
pub const GGUF_ALIGNMENT_KEY: &str = "general.alignment";

/// The type tag of a GGUF metadata value (`enum gguf_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum GgufValueType {
    /// `u8`, tag 0.
    U8 = 0,
    /// `i8`, tag 1.
    I8 = 1,
    /// `u16`, tag 2.
    U16 = 2,
    /// `i16`, tag 3.
    I16 = 3,
    /// `u32`, tag 4.
    U32 = 4,
    /// `i32`, tag 5.
    I32 = 5,
    /// `f32`, tag 6.
    F32 = 6,
    /// `bool` stored as one byte 0/1, tag 7.
    Bool = 7,
    /// Length-prefixed UTF-8, tag 8.
    String = 8,
    /// Typed array, tag 9.
    Array = 9,
    /// `u64`, tag 10.
    U64 = 10,
    /// `i64`, tag 11.
    I64 = 11,
    /// `f64`, tag 12.
    F64 = 12,
}

impl GgufValueType {
    /// Every value type, in tag order.
    pub const ALL: [GgufValueType; 13] = [
        GgufValueType::U8,
        GgufValueType::I8,
        GgufValueType::U16,
        GgufValueType::I16,
        GgufValueType::U32,
        GgufValueType::I32,
        GgufValueType::F32,
        GgufValueType::Bool,
        GgufValueType::String,
        GgufValueType::Array,
        GgufValueType::U64,
        GgufValueType::I64,
        GgufValueType::F64,
    ];

    /// The numeric tag written to the file.
    pub fn tag(self) -> u32 {
        self as u32
    }
}

/// A GGUF metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    /// `u8`.
    U8(u8),
    /// `i8`.
    I8(i8),
    /// `u16`.
    U16(u16),
    /// `i16`.
    I16(i16),
    /// `u32`.
    U32(u32),
    /// `i32`.
    I32(i32),
    /// `f32`.
    F32(f32),
    /// `bool`.
    Bool(bool),
    /// UTF-8 string.
    String(String),
    /// An array whose elements all have type `.0` (nested arrays allowed: `.0` = `Array`).
    Array(GgufValueType, Vec<GgufValue>),
    /// `u64`.
    U64(u64),
    /// `i64`.
    I64(i64),
    /// `f64`.
    F64(f64),
}

impl GgufValue {
    /// The type tag of this value.
    pub fn value_type(&self) -> GgufValueType {
        match self {
            GgufValue::U8(_) => GgufValueType::U8,
            GgufValue::I8(_) => GgufValueType::I8,
            GgufValue::U16(_) => GgufValueType::U16,
            GgufValue::I16(_) => GgufValueType::I16,
            GgufValue::U32(_) => GgufValueType::U32,
            GgufValue::I32(_) => GgufValueType::I32,
            GgufValue::F32(_) => GgufValueType::F32,
            GgufValue::Bool(_) => GgufValueType::Bool,
            GgufValue::String(_) => GgufValueType::String,
            GgufValue::Array(..) => GgufValueType::Array,
            GgufValue::U64(_) => GgufValueType::U64,
            GgufValue::I64(_) => GgufValueType::I64,
            GgufValue::F64(_) => GgufValueType::F64,
        }
    }

    /// An array of strings.
    pub fn strings<I, S>(items: I) -> GgufValue
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        GgufValue::Array(
            GgufValueType::String,
            items
                .into_iter()
                .map(|s| GgufValue::String(s.into()))
                .collect(),
        )
    }

    /// An array of `i32`.
    pub fn i32s(items: impl IntoIterator<Item = i32>) -> GgufValue {
        GgufValue::Array(
            GgufValueType::I32,
            items.into_iter().map(GgufValue::I32).collect(),
        )
    }

    /// An array of `u32`.
    pub fn u32s(items: impl IntoIterator<Item = u32>) -> GgufValue {
        GgufValue::Array(
            GgufValueType::U32,
            items.into_iter().map(GgufValue::U32).collect(),
        )
    }

    /// An array of `f32`.
    pub fn f32s(items: impl IntoIterator<Item = f32>) -> GgufValue {
        GgufValue::Array(
            GgufValueType::F32,
            items.into_iter().map(GgufValue::F32).collect(),
        )
    }

    fn write(&self, out: &mut Vec<u8>, key: &str) -> Result<(), TestkitError> {
        match self {
            GgufValue::U8(v) => out.push(*v),
            GgufValue::I8(v) => out.push(*v as u8),
            GgufValue::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
            GgufValue::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
            GgufValue::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
            GgufValue::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
            GgufValue::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
            GgufValue::Bool(v) => out.push(u8::from(*v)),
            GgufValue::String(s) => write_str(out, s),
            GgufValue::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
            GgufValue::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
            GgufValue::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
            GgufValue::Array(elem, items) => {
                out.extend_from_slice(&elem.tag().to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for (index, item) in items.iter().enumerate() {
                    if item.value_type() != *elem {
                        return Err(TestkitError::ArrayElementType {
                            key: key.to_string(),
                            elem: *elem,
                            found: item.value_type(),
                            index,
                        });
                    }
                    item.write(out, key)?;
                }
            }
        }
        Ok(())
    }
}

macro_rules! value_from {
    ($($t:ty => $v:ident),* $(,)?) => {
        $(impl From<$t> for GgufValue {
            fn from(x: $t) -> Self {
                GgufValue::$v(x)
            }
        })*
    };
}
value_from!(u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, f32 => F32,
    bool => Bool, String => String, u64 => U64, i64 => I64, f64 => F64);

impl From<&str> for GgufValue {
    fn from(s: &str) -> Self {
        GgufValue::String(s.to_string())
    }
}

/// One tensor as it will be written: its info fields and its data bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensor {
    /// Tensor name.
    pub name: String,
    /// Dimensions, innermost first (a row-major `[rows, cols]` matrix has `ne = [cols, rows]`).
    pub ne: Vec<u64>,
    /// The ggml type id written in the info (need not be a known type).
    pub type_id: u32,
    /// The data bytes (written as given).
    pub data: Vec<u8>,
    /// When set, the offset written in the info instead of the real one (the data still goes
    /// where the layout puts it).
    pub offset_override: Option<u64>,
}

/// Where one tensor's data landed in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorPlacement {
    /// Tensor name.
    pub name: String,
    /// Byte position of this tensor's info in the file.
    pub info_start: usize,
    /// Offset relative to the data section (what the info says unless overridden).
    pub relative_offset: u64,
    /// Absolute byte position of the data in the file.
    pub data_start: usize,
    /// Data length in bytes (without padding).
    pub data_len: usize,
}

/// Byte positions of the parts of a written file, for tests that mangle bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufLayout {
    /// Position of the `u64` tensor count (8).
    pub tensor_count_at: usize,
    /// Position of the `u64` metadata count (16).
    pub kv_count_at: usize,
    /// Position of each metadata pair, in order, with its key.
    pub kvs: Vec<(String, usize)>,
    /// Position of the first tensor info (= end of metadata).
    pub tensor_infos_start: usize,
    /// End of the tensor infos (before padding).
    pub tensor_infos_end: usize,
    /// Start of the data section (aligned).
    pub data_start: usize,
    /// The alignment used for the layout.
    pub alignment: usize,
    /// Each tensor, in order.
    pub tensors: Vec<TensorPlacement>,
    /// Total file length.
    pub total_len: usize,
}

/// Builds a GGUF file in memory; see the module docs.
#[derive(Debug, Clone)]
pub struct GgufWriter {
    magic: [u8; 4],
    version: u32,
    alignment: usize,
    kvs: Vec<(String, GgufValue)>,
    tensors: Vec<GgufTensor>,
    tensor_count_override: Option<u64>,
    kv_count_override: Option<u64>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    /// An empty version-3 file with the default alignment (32) and no metadata.
    pub fn new() -> Self {
        GgufWriter {
            magic: GGUF_MAGIC,
            version: GGUF_VERSION,
            alignment: GGUF_DEFAULT_ALIGNMENT as usize,
            kvs: Vec::new(),
            tensors: Vec::new(),
            tensor_count_override: None,
            kv_count_override: None,
        }
    }

    /// Appends a metadata pair (duplicates are written as given, for error tests).
    ///
    /// Adding `general.alignment` here does not change the layout; use
    /// [`GgufWriter::set_alignment`] for that.
    pub fn add_kv(&mut self, key: impl Into<String>, value: impl Into<GgufValue>) -> &mut Self {
        self.kvs.push((key.into(), value.into()));
        self
    }

    /// The metadata pairs so far.
    pub fn kvs(&self) -> &[(String, GgufValue)] {
        &self.kvs
    }

    /// Removes every metadata pair with this key; returns how many went.
    pub fn remove_kv(&mut self, key: &str) -> usize {
        let before = self.kvs.len();
        self.kvs.retain(|(k, _)| k != key);
        before - self.kvs.len()
    }

    /// Replaces the value of every pair with this key, or appends the pair if there is none.
    pub fn set_kv(&mut self, key: &str, value: impl Into<GgufValue>) -> &mut Self {
        let value = value.into();
        let mut found = false;
        for (k, v) in &mut self.kvs {
            if k == key {
                *v = value.clone();
                found = true;
            }
        }
        if !found {
            self.kvs.push((key.to_string(), value));
        }
        self
    }

    /// Sets the data alignment (a non-zero power of two) and writes it as `general.alignment`.
    pub fn set_alignment(&mut self, alignment: u32) -> Result<&mut Self, TestkitError> {
        if alignment == 0 || !alignment.is_power_of_two() {
            return Err(TestkitError::BadAlignment(alignment as u64));
        }
        self.alignment = alignment as usize;
        self.set_kv(GGUF_ALIGNMENT_KEY, GgufValue::U32(alignment));
        Ok(self)
    }

    /// The alignment the layout uses.
    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// Writes `magic` instead of `GGUF` (for error tests).
    pub fn set_magic(&mut self, magic: [u8; 4]) -> &mut Self {
        self.magic = magic;
        self
    }

    /// Writes `version` instead of 3 (for error tests; the layout stays version 3's).
    pub fn set_version(&mut self, version: u32) -> &mut Self {
        self.version = version;
        self
    }

    /// Writes `count` as the tensor count instead of the real one.
    pub fn override_tensor_count(&mut self, count: Option<u64>) -> &mut Self {
        self.tensor_count_override = count;
        self
    }

    /// Writes `count` as the metadata count instead of the real one.
    pub fn override_kv_count(&mut self, count: Option<u64>) -> &mut Self {
        self.kv_count_override = count;
        self
    }

    /// Adds a tensor of `ty` from `f32` values in row-major order (`ne[0]` varies fastest),
    /// quantizing with the reference quantizers. `ne[0]` must be a multiple of the type's
    /// block size.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        ne: &[u64],
        ty: GgmlType,
        data: &[f32],
    ) -> Result<&mut Self, TestkitError> {
        let name = name.into();
        let n: u64 = ne.iter().product();
        if n != data.len() as u64 {
            return Err(TestkitError::ShapeMismatch {
                name,
                ne: ne.to_vec(),
                got: data.len(),
            });
        }
        if ne.first().copied().unwrap_or(1) % ty.block_size() as u64 != 0 {
            return Err(TestkitError::NotBlockAligned {
                ty: ty.name(),
                n_elements: ne.first().copied().unwrap_or(1) as usize,
                block: ty.block_size(),
            });
        }
        let bytes = quantize(ty, data)?;
        Ok(self.add_raw_tensor(name, ne.to_vec(), ty.id(), bytes))
    }

    /// Adds a tensor from already-encoded bytes of `ty`, checking only their length.
    pub fn add_tensor_bytes(
        &mut self,
        name: impl Into<String>,
        ne: &[u64],
        ty: GgmlType,
        bytes: Vec<u8>,
    ) -> Result<&mut Self, TestkitError> {
        let n: u64 = ne.iter().product();
        let expected = ty
            .bytes_for(n as usize)
            .ok_or(TestkitError::NotBlockAligned {
                ty: ty.name(),
                n_elements: n as usize,
                block: ty.block_size(),
            })?;
        if expected != bytes.len() {
            return Err(TestkitError::ByteLength {
                ty: ty.name(),
                n_elements: n as usize,
                expected,
                got: bytes.len(),
            });
        }
        Ok(self.add_raw_tensor(name, ne.to_vec(), ty.id(), bytes))
    }

    /// Adds a tensor with no checks at all: any type id, any byte length (for error tests).
    pub fn add_raw_tensor(
        &mut self,
        name: impl Into<String>,
        ne: Vec<u64>,
        type_id: u32,
        data: Vec<u8>,
    ) -> &mut Self {
        self.tensors.push(GgufTensor {
            name: name.into(),
            ne,
            type_id,
            data,
            offset_override: None,
        });
        self
    }

    /// The tensors so far (mutable, so tests can change any field).
    pub fn tensors_mut(&mut self) -> &mut Vec<GgufTensor> {
        &mut self.tensors
    }

    /// The tensors so far.
    pub fn tensors(&self) -> &[GgufTensor] {
        &self.tensors
    }

    /// Makes the info of tensor `name` claim `offset`; false if there is no such tensor.
    pub fn set_tensor_offset(&mut self, name: &str, offset: u64) -> bool {
        match self.tensors.iter_mut().find(|t| t.name == name) {
            Some(t) => {
                t.offset_override = Some(offset);
                true
            }
            None => false,
        }
    }

    /// The complete file and the positions of its parts.
    pub fn build(&self) -> Result<(Vec<u8>, GgufLayout), TestkitError> {
        let align = self.alignment;
        let mut out = Vec::new();
        out.extend_from_slice(&self.magic);
        out.extend_from_slice(&self.version.to_le_bytes());
        let tensor_count_at = out.len();
        let n_tensors = self
            .tensor_count_override
            .unwrap_or(self.tensors.len() as u64);
        out.extend_from_slice(&n_tensors.to_le_bytes());
        let kv_count_at = out.len();
        let n_kv = self.kv_count_override.unwrap_or(self.kvs.len() as u64);
        out.extend_from_slice(&n_kv.to_le_bytes());

        let mut kvs = Vec::with_capacity(self.kvs.len());
        for (key, value) in &self.kvs {
            kvs.push((key.clone(), out.len()));
            write_str(&mut out, key);
            out.extend_from_slice(&value.value_type().tag().to_le_bytes());
            value.write(&mut out, key)?;
        }

        let tensor_infos_start = out.len();
        let mut placements = Vec::with_capacity(self.tensors.len());
        let mut rel = 0u64;
        for t in &self.tensors {
            let info_start = out.len();
            write_str(&mut out, &t.name);
            out.extend_from_slice(&(t.ne.len() as u32).to_le_bytes());
            for d in &t.ne {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.type_id.to_le_bytes());
            let written = t.offset_override.unwrap_or(rel);
            out.extend_from_slice(&written.to_le_bytes());
            placements.push(TensorPlacement {
                name: t.name.clone(),
                info_start,
                relative_offset: rel,
                data_start: 0,
                data_len: t.data.len(),
            });
            rel = pad_to(rel + t.data.len() as u64, align as u64);
        }
        let tensor_infos_end = out.len();
        out.resize(pad_to(out.len() as u64, align as u64) as usize, 0);
        let data_start = out.len();
        for (t, p) in self.tensors.iter().zip(placements.iter_mut()) {
            p.data_start = data_start + p.relative_offset as usize;
            debug_assert_eq!(out.len(), p.data_start);
            out.extend_from_slice(&t.data);
            out.resize(pad_to(out.len() as u64, align as u64) as usize, 0);
        }
        let total_len = out.len();
        Ok((
            out,
            GgufLayout {
                tensor_count_at,
                kv_count_at,
                kvs,
                tensor_infos_start,
                tensor_infos_end,
                data_start,
                alignment: align,
                tensors: placements,
                total_len,
            },
        ))
    }

    /// The complete file as bytes.
    pub fn bytes(&self) -> Result<Vec<u8>, TestkitError> {
        Ok(self.build()?.0)
    }

    /// Same as [`GgufWriter::bytes`].
    pub fn to_bytes(&self) -> Result<Vec<u8>, TestkitError> {
        self.bytes()
    }

    /// Where each part of the file sits.
    pub fn layout(&self) -> Result<GgufLayout, TestkitError> {
        Ok(self.build()?.1)
    }

    /// Writes the file to `path`.
    pub fn write_to(&self, path: impl AsRef<Path>) -> Result<(), TestkitError> {
        let path = path.as_ref();
        let bytes = self.bytes()?;
        std::fs::write(path, bytes).map_err(|source| TestkitError::Io {
            path: path.to_path_buf(),
            source,
        })
    }

    /// This file cut into a split set of `parts` files the way llama.cpp's `gguf-split`
    /// cuts one: the tensors in order, as evenly as their count allows; every part carries
    /// `split.no` (u16, from 0), `split.count` (u16) and `split.tensors.count` (i32, the
    /// set's), and the first part all the metadata besides.
    pub fn split(&self, parts: usize) -> Vec<GgufWriter> {
        let parts = parts.clamp(1, self.tensors.len().max(1));
        let n = self.tensors.len();
        (0..parts)
            .map(|i| {
                let mut w = GgufWriter {
                    kvs: if i == 0 { self.kvs.clone() } else { Vec::new() },
                    tensors: self.tensors[i * n / parts..(i + 1) * n / parts].to_vec(),
                    ..self.clone()
                };
                w.add_kv("split.no", i as u16)
                    .add_kv("split.count", parts as u16)
                    .add_kv("split.tensors.count", n as i32);
                w
            })
            .collect()
    }

    /// Writes [`GgufWriter::split`]'s parts into `dir` under llama.cpp's names
    /// (`PREFIX-00001-of-00003.gguf`, ...) and returns their paths in order.
    ///
    /// # Errors
    /// When a file cannot be written.
    pub fn write_split(
        &self,
        dir: impl AsRef<Path>,
        prefix: &str,
        parts: usize,
    ) -> Result<Vec<std::path::PathBuf>, TestkitError> {
        let split = self.split(parts);
        let count = split.len();
        let mut paths = Vec::with_capacity(count);
        for (i, w) in split.iter().enumerate() {
            let p = dir
                .as_ref()
                .join(format!("{prefix}-{:05}-of-{count:05}.gguf", i + 1));
            w.write_to(&p)?;
            paths.push(p);
        }
        Ok(paths)
    }
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn pad_to(n: u64, align: u64) -> u64 {
    n.div_ceil(align) * align
}

/// A minimal GGUF parser used only by this crate's tests to check what the writer wrote.
#[cfg(test)]
pub(crate) mod parse {
    use super::*;

    pub struct Parsed {
        pub version: u32,
        pub kvs: Vec<(String, GgufValue)>,
        pub tensors: Vec<(String, Vec<u64>, u32, u64)>,
        pub data_start: usize,
    }

    struct Cur<'a> {
        b: &'a [u8],
        pos: usize,
    }

    impl Cur<'_> {
        fn take(&mut self, n: usize) -> Result<&[u8], String> {
            if self.pos + n > self.b.len() {
                return Err(format!("truncated at {} (+{n})", self.pos));
            }
            let s = &self.b[self.pos..self.pos + n];
            self.pos += n;
            Ok(s)
        }
        fn u32(&mut self) -> Result<u32, String> {
            Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
        }
        fn u64(&mut self) -> Result<u64, String> {
            Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
        }
        fn string(&mut self) -> Result<String, String> {
            let n = self.u64()? as usize;
            String::from_utf8(self.take(n)?.to_vec()).map_err(|e| e.to_string())
        }
        fn value(&mut self, ty: u32) -> Result<GgufValue, String> {
            let t = GgufValueType::ALL
                .into_iter()
                .find(|t| t.tag() == ty)
                .ok_or(format!("bad type {ty}"))?;
            Ok(match t {
                GgufValueType::U8 => GgufValue::U8(self.take(1)?[0]),
                GgufValueType::I8 => GgufValue::I8(self.take(1)?[0] as i8),
                GgufValueType::U16 => {
                    GgufValue::U16(u16::from_le_bytes(self.take(2)?.try_into().unwrap()))
                }
                GgufValueType::I16 => {
                    GgufValue::I16(i16::from_le_bytes(self.take(2)?.try_into().unwrap()))
                }
                GgufValueType::U32 => GgufValue::U32(self.u32()?),
                GgufValueType::I32 => GgufValue::I32(self.u32()? as i32),
                GgufValueType::F32 => GgufValue::F32(f32::from_bits(self.u32()?)),
                GgufValueType::Bool => match self.take(1)?[0] {
                    0 => GgufValue::Bool(false),
                    1 => GgufValue::Bool(true),
                    b => return Err(format!("bad bool {b}")),
                },
                GgufValueType::String => GgufValue::String(self.string()?),
                GgufValueType::U64 => GgufValue::U64(self.u64()?),
                GgufValueType::I64 => GgufValue::I64(self.u64()? as i64),
                GgufValueType::F64 => GgufValue::F64(f64::from_bits(self.u64()?)),
                GgufValueType::Array => {
                    let et = self.u32()?;
                    let n = self.u64()?;
                    let elem = GgufValueType::ALL
                        .into_iter()
                        .find(|t| t.tag() == et)
                        .ok_or(format!("bad elem type {et}"))?;
                    let mut items = Vec::new();
                    for _ in 0..n {
                        items.push(self.value(et)?);
                    }
                    GgufValue::Array(elem, items)
                }
            })
        }
    }

    pub fn parse(b: &[u8]) -> Result<Parsed, String> {
        let mut c = Cur { b, pos: 0 };
        if c.take(4)? != b"GGUF" {
            return Err("bad magic".into());
        }
        let version = c.u32()?;
        let nt = c.u64()?;
        let nkv = c.u64()?;
        let mut kvs = Vec::new();
        for _ in 0..nkv {
            let k = c.string()?;
            let t = c.u32()?;
            kvs.push((k, c.value(t)?));
        }
        let mut tensors = Vec::new();
        for _ in 0..nt {
            let name = c.string()?;
            let nd = c.u32()?;
            let mut ne = Vec::new();
            for _ in 0..nd {
                ne.push(c.u64()?);
            }
            let ty = c.u32()?;
            let off = c.u64()?;
            tensors.push((name, ne, ty, off));
        }
        let align = kvs
            .iter()
            .find(|(k, _)| k == GGUF_ALIGNMENT_KEY)
            .map(|(_, v)| match v {
                GgufValue::U32(a) => *a as usize,
                _ => 0,
            })
            .unwrap_or(32);
        let data_start = c.pos.div_ceil(align) * align;
        Ok(Parsed {
            version,
            kvs,
            tensors,
            data_start,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::parse::parse;
    use super::*;
    use crate::quants::dequantize;

    /// One metadata pair of every type, including arrays of each and nested arrays.
    pub(crate) fn every_type_writer() -> GgufWriter {
        let mut w = GgufWriter::new();
        w.add_kv("t.u8", 200u8)
            .add_kv("t.i8", -100i8)
            .add_kv("t.u16", 60000u16)
            .add_kv("t.i16", -30000i16)
            .add_kv("t.u32", 4_000_000_000u32)
            .add_kv("t.i32", -2_000_000_000i32)
            .add_kv("t.f32", 1.5f32)
            .add_kv("t.bool", true)
            .add_kv("t.string", "héllo ✓")
            .add_kv("t.u64", u64::MAX - 1)
            .add_kv("t.i64", i64::MIN + 1)
            .add_kv("t.f64", -2.25f64)
            .add_kv(
                "t.arr.u8",
                GgufValue::Array(GgufValueType::U8, vec![1u8.into(), 2u8.into()]),
            )
            .add_kv(
                "t.arr.i8",
                GgufValue::Array(GgufValueType::I8, vec![(-1i8).into()]),
            )
            .add_kv(
                "t.arr.u16",
                GgufValue::Array(GgufValueType::U16, vec![7u16.into()]),
            )
            .add_kv(
                "t.arr.i16",
                GgufValue::Array(GgufValueType::I16, vec![(-7i16).into()]),
            )
            .add_kv("t.arr.u32", GgufValue::u32s([1, 2, 3]))
            .add_kv("t.arr.i32", GgufValue::i32s([-1, 0, 1]))
            .add_kv("t.arr.f32", GgufValue::f32s([0.5, -0.25]))
            .add_kv(
                "t.arr.bool",
                GgufValue::Array(GgufValueType::Bool, vec![true.into(), false.into()]),
            )
            .add_kv("t.arr.string", GgufValue::strings(["a", "", "ĠtĊ"]))
            .add_kv(
                "t.arr.u64",
                GgufValue::Array(GgufValueType::U64, vec![u64::MAX.into()]),
            )
            .add_kv(
                "t.arr.i64",
                GgufValue::Array(GgufValueType::I64, vec![(-5i64).into()]),
            )
            .add_kv(
                "t.arr.f64",
                GgufValue::Array(GgufValueType::F64, vec![1e300f64.into()]),
            )
            .add_kv("t.arr.empty", GgufValue::Array(GgufValueType::U32, vec![]))
            .add_kv(
                "t.arr.nested",
                GgufValue::Array(
                    GgufValueType::Array,
                    vec![GgufValue::u32s([1, 2]), GgufValue::strings(["x"])],
                ),
            );
        w
    }

    #[test]
    fn header_fields_and_every_value_type_reparse() {
        let mut w = every_type_writer();
        w.add_tensor("a", &[32, 2], GgmlType::F32, &[0.25; 64])
            .unwrap();
        let bytes = w.bytes().unwrap();
        assert_eq!(&bytes[0..4], b"GGUF");
        assert_eq!(u32::from_le_bytes(bytes[4..8].try_into().unwrap()), 3);
        assert_eq!(u64::from_le_bytes(bytes[8..16].try_into().unwrap()), 1);
        assert_eq!(
            u64::from_le_bytes(bytes[16..24].try_into().unwrap()),
            w.kvs().len() as u64
        );
        let p = parse(&bytes).unwrap();
        assert_eq!(p.version, 3);
        assert_eq!(p.kvs, w.kvs().to_vec());
        assert_eq!(p.tensors, vec![("a".to_string(), vec![32, 2], 0, 0)]);
        // first byte of every kv is its key length
        let layout = w.layout().unwrap();
        for (key, at) in &layout.kvs {
            let n = u64::from_le_bytes(bytes[*at..*at + 8].try_into().unwrap());
            assert_eq!(n as usize, key.len());
        }
    }

    #[test]
    fn tensors_are_aligned_and_padded() {
        for align in [32u32, 64, 8] {
            let mut w = GgufWriter::new();
            if align != 32 {
                w.set_alignment(align).unwrap();
            }
            w.add_kv("general.architecture", "llama");
            w.add_tensor("x", &[3], GgmlType::F32, &[1.0, 2.0, 3.0])
                .unwrap();
            let q: Vec<f32> = (0..64).map(|i| i as f32 / 10.0).collect();
            w.add_tensor("q8", &[32, 2], GgmlType::Q8_0, &q).unwrap();
            w.add_tensor("q4", &[64], GgmlType::Q4_0, &q).unwrap();
            w.add_tensor("h", &[5], GgmlType::F16, &[1.0; 5]).unwrap();
            let (bytes, layout) = w.build().unwrap();
            assert_eq!(layout.alignment, align as usize);
            assert_eq!(layout.data_start % align as usize, 0);
            assert_eq!(bytes.len() % align as usize, 0);
            assert_eq!(bytes.len(), layout.total_len);
            let p = parse(&bytes).unwrap();
            assert_eq!(p.data_start, layout.data_start);
            for ((name, ne, ty, off), place) in p.tensors.iter().zip(&layout.tensors) {
                assert_eq!(name, &place.name);
                assert_eq!(*off % align as u64, 0, "{name}");
                assert_eq!(*off, place.relative_offset);
                let t = GgmlType::from_id(*ty).unwrap();
                let n = ne.iter().product::<u64>() as usize;
                let start = p.data_start + *off as usize;
                let len = t.bytes_for(n).unwrap();
                assert_eq!(len, place.data_len);
                let vals = dequantize(t, &bytes[start..start + len], n).unwrap();
                match name.as_str() {
                    "x" => assert_eq!(vals, vec![1.0, 2.0, 3.0]),
                    "h" => assert_eq!(vals, vec![1.0; 5]),
                    _ => {
                        for (a, b) in vals.iter().zip(&q) {
                            assert!((a - b).abs() < 0.45, "{name}: {a} vs {b}");
                        }
                    }
                }
            }
            // zero padding between tensors
            let x = &layout.tensors[0];
            assert!(bytes[x.data_start + 12..layout.tensors[1].data_start]
                .iter()
                .all(|b| *b == 0));
        }
    }

    #[test]
    fn overrides_write_what_they_say() {
        let mut w = GgufWriter::new();
        w.add_tensor("x", &[4], GgmlType::F32, &[0.0; 4]).unwrap();
        w.set_magic(*b"GGUX")
            .set_version(2)
            .override_tensor_count(Some(u64::MAX))
            .override_kv_count(Some(7));
        assert!(w.set_tensor_offset("x", 5));
        assert!(!w.set_tensor_offset("nope", 5));
        let (b, l) = w.build().unwrap();
        assert_eq!(&b[0..4], b"GGUX");
        assert_eq!(u32::from_le_bytes(b[4..8].try_into().unwrap()), 2);
        assert_eq!(
            u64::from_le_bytes(
                b[l.tensor_count_at..l.tensor_count_at + 8]
                    .try_into()
                    .unwrap()
            ),
            u64::MAX
        );
        assert_eq!(
            u64::from_le_bytes(b[l.kv_count_at..l.kv_count_at + 8].try_into().unwrap()),
            7
        );
        let off_at = l.tensor_infos_end - 8;
        assert_eq!(
            u64::from_le_bytes(b[off_at..].get(..8).unwrap().try_into().unwrap()),
            5
        );
    }

    #[test]
    fn checked_adds_reject_bad_input() {
        let mut w = GgufWriter::new();
        assert!(w
            .add_tensor("a", &[32, 2], GgmlType::F32, &[0.0; 63])
            .is_err());
        assert!(w
            .add_tensor("a", &[16, 2], GgmlType::Q8_0, &[0.0; 32])
            .is_err());
        assert!(w
            .add_tensor_bytes("a", &[32], GgmlType::Q8_0, vec![0; 33])
            .is_err());
        assert!(w.set_alignment(0).is_err());
        assert!(w.set_alignment(48).is_err());
        let mut bad = GgufWriter::new();
        bad.add_kv(
            "k",
            GgufValue::Array(GgufValueType::U32, vec![GgufValue::I32(1)]),
        );
        assert!(bad.bytes().is_err());
        // raw tensors skip every check
        w.add_raw_tensor("r", vec![3, 3], 99, vec![1, 2, 3]);
        assert!(w.bytes().is_ok());
    }

    /// Writes `every_type_writer()` plus tensors to a file and, when Python with the `gguf`
    /// package is installed, reads it back with the official reader. Skipped otherwise,
    /// except under CI.
    #[test]
    fn official_python_reader_accepts_file() {
        let ok = std::process::Command::new("python3")
            .args(["-c", "import gguf"])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        if !ok {
            crate::skip_or_fail(
                "official_python_reader_accepts_file",
                "python3 with the gguf package is not installed (python3 -m pip install gguf)",
            );
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("every.gguf");
        let mut w = every_type_writer();
        w.set_alignment(64).unwrap();
        let q: Vec<f32> = (0..64).map(|i| (i as f32 - 30.0) / 7.0).collect();
        w.add_tensor("w.q8", &[32, 2], GgmlType::Q8_0, &q).unwrap();
        w.add_tensor("w.q4", &[32, 2], GgmlType::Q4_0, &q).unwrap();
        w.add_tensor("w.q41", &[32, 2], GgmlType::Q4_1, &q).unwrap();
        let k: Vec<f32> = (0..512)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 97.0)
            .collect();
        w.add_tensor("w.q4k", &[256, 2], GgmlType::Q4_K, &k)
            .unwrap();
        w.add_tensor("w.q6k", &[256, 2], GgmlType::Q6_K, &k)
            .unwrap();
        let expect_q4k = crate::quants::round_trip(GgmlType::Q4_K, &k).unwrap();
        let expect_q6k = crate::quants::round_trip(GgmlType::Q6_K, &k).unwrap();
        w.add_tensor("w.f32", &[3], GgmlType::F32, &[1.0, -2.0, 3.5])
            .unwrap();
        w.add_tensor("w.f16", &[2], GgmlType::F16, &[0.5, 4.0])
            .unwrap();
        w.add_tensor("w.bf16", &[2], GgmlType::BF16, &[0.5, 4.0])
            .unwrap();
        w.write_to(&path).unwrap();
        let expect_q8 = crate::quants::round_trip(GgmlType::Q8_0, &q).unwrap();
        let expect_q4 = crate::quants::round_trip(GgmlType::Q4_0, &q).unwrap();
        let script = r#"
import sys, json
import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
r = GGUFReader(sys.argv[1])
f = r.fields
def val(name):
    return f[name].contents()
assert val("t.u8") == 200
assert val("t.i8") == -100
assert val("t.u16") == 60000
assert val("t.i16") == -30000
assert val("t.u32") == 4000000000
assert val("t.i32") == -2000000000
assert val("t.f32") == 1.5
assert val("t.bool") is True or val("t.bool") == True
assert val("t.string") == "héllo ✓", val("t.string")
assert val("t.u64") == 2**64 - 2
assert val("t.i64") == -2**63 + 1
assert val("t.f64") == -2.25
assert list(val("t.arr.u8")) == [1, 2]
assert list(val("t.arr.i32")) == [-1, 0, 1]
assert list(val("t.arr.string")) == ["a", "", "ĠtĊ"], val("t.arr.string")
assert list(val("t.arr.bool")) == [True, False]
assert list(val("t.arr.empty")) == []
assert val("general.alignment") == 64
assert r.alignment == 64
ts = {t.name: t for t in r.tensors}
assert set(ts) == {"w.q8", "w.q4", "w.q41", "w.q4k", "w.q6k", "w.f32", "w.f16", "w.bf16"}, set(ts)
for t in r.tensors:
    assert t.data_offset % 64 == 0, (t.name, t.data_offset)
assert list(ts["w.q8"].shape) == [32, 2]
assert ts["w.q8"].tensor_type.name == "Q8_0"
assert ts["w.q4"].tensor_type.name == "Q4_0"
assert ts["w.q41"].tensor_type.name == "Q4_1"
q8 = dequantize(ts["w.q8"].data, ts["w.q8"].tensor_type).reshape(-1)
q4 = dequantize(ts["w.q4"].data, ts["w.q4"].tensor_type).reshape(-1)
exp8 = np.array(json.loads(sys.argv[2]), dtype=np.float32)
exp4 = np.array(json.loads(sys.argv[3]), dtype=np.float32)
assert np.array_equal(q8, exp8), (q8, exp8)
assert np.array_equal(q4, exp4), (q4, exp4)
assert list(ts["w.f32"].data) == [1.0, -2.0, 3.5]
for name, arg in (("w.q4k", 4), ("w.q6k", 5)):
    got = dequantize(ts[name].data, ts[name].tensor_type).reshape(-1)
    exp = np.array(json.loads(sys.argv[arg]), dtype=np.float32)
    assert ts[name].tensor_type.name == ("Q4_K" if name == "w.q4k" else "Q6_K")
    assert np.array_equal(got, exp), (name, np.abs(got - exp).max())
print("ok")
"#;
        let out = std::process::Command::new("python3")
            .arg("-c")
            .arg(script)
            .arg(&path)
            .arg(serde_json::to_string(&expect_q8).unwrap())
            .arg(serde_json::to_string(&expect_q4).unwrap())
            .arg(serde_json::to_string(&expect_q4k).unwrap())
            .arg(serde_json::to_string(&expect_q6k).unwrap())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "python gguf reader failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
