//! GGUF reader: the header (metadata of every value type, tensor infos, alignment) parsed
//! from a memory map, and tensor data handed out as borrowed bytes — a whole tensor, a range
//! of its rows, or a block-aligned range of its columns — so that a rank loads only its
//! slice of a model and never touches the rest of the file.
//!
//! The file is untrusted: every count, length, offset and type is checked against what the
//! file can actually hold before anything is allocated, and every failure is a [`GgufError`]
//! naming the file and the field, never a panic.

mod metadata;
pub mod set;
mod types;

use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

pub use metadata::{MetaArray, MetaValue, Metadata};
pub use types::GgmlType;

/// The GGUF magic, "GGUF" in file order.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of the tensor data section when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Most dimensions a ggml tensor can have.
pub const MAX_DIMS: usize = 4;
/// Deepest nesting of arrays accepted in metadata.
const MAX_ARRAY_DEPTH: usize = 4;
/// Most items reserved up front for a count read from the file. A count is only checked
/// against the bytes left, and one item in memory is larger than its smallest encoding, so
/// reserving the full count would let a hostile header allocate several times the file size
/// before failing; past this many items vectors grow as items are actually parsed.
const MAX_PREALLOC: usize = 4096;

/// What can go wrong reading a GGUF file. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file could not be opened or mapped.
    #[error("{path}: cannot read the file: {source}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file does not start with the GGUF magic.
    #[error(
        "{path}: not a GGUF file (it starts with {found:02x?}, a GGUF file starts with \"GGUF\")"
    )]
    BadMagic {
        /// The file.
        path: String,
        /// The first bytes found.
        found: Vec<u8>,
    },
    /// A GGUF version this reader does not handle.
    #[error("{path}: GGUF version {version} is not supported (this reader handles versions 2 and 3){hint}")]
    Version {
        /// The file.
        path: String,
        /// The version found.
        version: u32,
        /// Extra advice.
        hint: &'static str,
    },
    /// The header is truncated or holds an impossible value.
    #[error("{path}: {field}: {problem}")]
    Malformed {
        /// The file.
        path: String,
        /// Which field of the header.
        field: String,
        /// What is wrong with it.
        problem: String,
    },
    /// A metadata key is missing or of the wrong type.
    #[error("{path}: metadata `{key}` {problem}")]
    Metadata {
        /// The file.
        path: String,
        /// The key.
        key: String,
        /// What is wrong.
        problem: String,
    },
    /// A split set is incomplete, mixed with another set's files, or inconsistent.
    #[error("{path}: {problem}")]
    Set {
        /// The file that shows it.
        path: String,
        /// What is wrong, and what to do.
        problem: String,
    },
    /// A tensor is missing or a requested slice of it is impossible.
    #[error("{path}: tensor `{name}`: {problem}")]
    Tensor {
        /// The file.
        path: String,
        /// The tensor.
        name: String,
        /// What is wrong.
        problem: String,
    },
}

/// Where one tensor lives in the file and what it holds.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// The tensor's name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Dimensions innermost first, as ggml stores them: `dims[0]` is the row length.
    pub dims: Vec<u64>,
    /// Element type.
    pub dtype: GgmlType,
    /// Offset of the data from the start of the tensor data section.
    pub offset: u64,
    /// Size of the data in bytes.
    pub size: u64,
}

impl TensorInfo {
    /// Elements in the tensor.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Elements in one row (`dims[0]`).
    pub fn row_len(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }

    /// Number of rows: the product of every dimension but the first.
    pub fn n_rows(&self) -> u64 {
        self.dims.iter().skip(1).product()
    }

    /// Bytes in one row.
    pub fn row_bytes(&self) -> u64 {
        self.size / self.n_rows().max(1)
    }

    /// Dimensions outermost first (the order candle, numpy and safetensors use).
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// A parsed GGUF header: version, metadata, tensor infos and where the data starts.
#[derive(Debug, Clone)]
pub struct GgufHeader {
    /// GGUF version (2 or 3).
    pub version: u32,
    /// The metadata section.
    pub metadata: Metadata,
    /// Tensor infos in file order.
    pub tensors: Vec<TensorInfo>,
    /// Alignment of the data section and of each tensor in it.
    pub alignment: u64,
    /// Absolute file offset of the tensor data section.
    pub data_offset: u64,
    index: std::collections::HashMap<String, usize>,
    label: String,
}

impl GgufHeader {
    /// Parses a header from the start of `bytes`, which must be the whole file (the tensor
    /// extents are checked against its length). `label` names the file in errors.
    ///
    /// # Errors
    /// Any malformed, truncated or hostile content, as a [`GgufError`].
    pub fn parse(bytes: &[u8], label: &str) -> Result<Self, GgufError> {
        Parser {
            bytes,
            pos: 0,
            label,
        }
        .header()
    }

    /// The info of tensor `name`, if present.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    fn tensor_err(&self, name: &str, problem: String) -> GgufError {
        GgufError::Tensor {
            path: self.label.clone(),
            name: name.to_string(),
            problem,
        }
    }

    fn info(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.tensor(name)
            .ok_or_else(|| self.tensor_err(name, "is not in the file".into()))
    }

    fn bytes_of<'b>(&self, file: &'b [u8], t: &TensorInfo) -> Result<&'b [u8], GgufError> {
        // Parsing checked the extents against the file length, but `file` may not be the
        // bytes this header was parsed from, so check again rather than index blindly.
        let range = self
            .data_offset
            .checked_add(t.offset)
            .and_then(|start| Some(start..start.checked_add(t.size)?))
            .and_then(|r| Some(usize::try_from(r.start).ok()?..usize::try_from(r.end).ok()?));
        range.and_then(|r| file.get(r)).ok_or_else(|| {
            self.tensor_err(
                &t.name,
                format!(
                    "data at offset {} with {} bytes is outside the {} bytes given (not the file this header came from?)",
                    t.offset,
                    t.size,
                    file.len()
                ),
            )
        })
    }

    /// All bytes of tensor `name`, out of `file`, the bytes this header was parsed from.
    ///
    /// # Errors
    /// When there is no such tensor or `file` is too short to hold it.
    pub fn tensor_data<'b>(&self, file: &'b [u8], name: &str) -> Result<&'b [u8], GgufError> {
        let t = self.info(name)?;
        self.bytes_of(file, t)
    }

    /// The bytes of rows `rows` of tensor `name` out of `file` (see [`GgufFile::tensor_rows`]).
    ///
    /// # Errors
    /// When the tensor is missing, the range is empty or out of bounds, or `file` is too short.
    pub fn tensor_rows<'b>(
        &self,
        file: &'b [u8],
        name: &str,
        rows: Range<usize>,
    ) -> Result<&'b [u8], GgufError> {
        let t = self.info(name)?;
        let n_rows = t.n_rows();
        if rows.start >= rows.end || rows.end as u64 > n_rows {
            return Err(self.tensor_err(
                name,
                format!("row range {rows:?} is empty or outside its {n_rows} rows"),
            ));
        }
        // `size` is `n_rows * row_bytes` exactly, so these products stay within `size`.
        let rb = t.row_bytes() as usize;
        Ok(&self.bytes_of(file, t)?[rows.start * rb..rows.end * rb])
    }

    /// The bytes of columns `cols` of every row of tensor `name` out of `file`, gathered row
    /// after row (see [`GgufFile::tensor_cols`]).
    ///
    /// # Errors
    /// When the tensor is missing, the range is empty, out of bounds or not block aligned, or
    /// `file` is too short.
    pub fn tensor_cols(
        &self,
        file: &[u8],
        name: &str,
        cols: Range<usize>,
    ) -> Result<Vec<u8>, GgufError> {
        let t = self.info(name)?;
        let row_len = t.row_len();
        let bl = t.dtype.block_len();
        if cols.start >= cols.end || cols.end as u64 > row_len {
            return Err(self.tensor_err(
                name,
                format!("column range {cols:?} is empty or outside its {row_len} columns"),
            ));
        }
        if !cols.start.is_multiple_of(bl) || !cols.end.is_multiple_of(bl) {
            return Err(self.tensor_err(
                name,
                format!("column range {cols:?} does not fall on {} block boundaries (multiples of {bl})", t.dtype),
            ));
        }
        let data = self.bytes_of(file, t)?;
        let rb = t.row_bytes() as usize;
        if rb == 0 {
            // A tensor with no rows (some outer dimension is 0) has no columns to gather.
            return Ok(Vec::new());
        }
        let bb = t.dtype.block_bytes();
        let (b0, b1) = (cols.start / bl * bb, cols.end / bl * bb);
        let mut out = Vec::with_capacity((b1 - b0) * (data.len() / rb));
        for row in data.chunks_exact(rb) {
            out.extend_from_slice(&row[b0..b1]);
        }
        Ok(out)
    }
}

struct Parser<'a> {
    bytes: &'a [u8],
    pos: usize,
    label: &'a str,
}

impl<'a> Parser<'a> {
    fn malformed(&self, field: &str, problem: impl Into<String>) -> GgufError {
        GgufError::Malformed {
            path: self.label.to_string(),
            field: field.to_string(),
            problem: problem.into(),
        }
    }

    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize, field: &str) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(self.malformed(
                field,
                format!(
                    "the file ends at byte {} but {n} more bytes are needed at byte {} (truncated file?)",
                    self.bytes.len(),
                    self.pos
                ),
            ));
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn arr<const N: usize>(&mut self, field: &str) -> Result<[u8; N], GgufError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, field)?);
        Ok(out)
    }

    fn u32(&mut self, field: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.arr(field)?))
    }

    fn u64(&mut self, field: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.arr(field)?))
    }

    /// A count that must fit in what is left of the file at `min_item` bytes per item.
    fn count(&mut self, field: &str, min_item: usize) -> Result<usize, GgufError> {
        let n = self.u64(field)?;
        let fits = (self.remaining() / min_item.max(1)) as u64;
        if n > fits {
            return Err(self.malformed(
                field,
                format!(
                    "count {n} cannot fit in the {} bytes left in the file",
                    self.remaining()
                ),
            ));
        }
        Ok(n as usize)
    }

    fn string(&mut self, field: &str) -> Result<String, GgufError> {
        let n = self.count(field, 1)?;
        let raw = self.take(n, field)?;
        match std::str::from_utf8(raw) {
            Ok(s) => Ok(s.to_string()),
            // Some tokenizers store invalid UTF-8 in vocab entries; keep the bytes readable.
            Err(_) => Ok(String::from_utf8_lossy(raw).into_owned()),
        }
    }

    fn value(&mut self, ty: u32, field: &str, depth: usize) -> Result<MetaValue, GgufError> {
        Ok(match ty {
            0 => MetaValue::U8(self.arr::<1>(field)?[0]),
            1 => MetaValue::I8(self.arr::<1>(field)?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.arr(field)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.arr(field)?)),
            4 => MetaValue::U32(self.u32(field)?),
            5 => MetaValue::I32(i32::from_le_bytes(self.arr(field)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.arr(field)?)),
            7 => {
                let b = self.arr::<1>(field)?[0];
                if b > 1 {
                    return Err(self.malformed(field, format!("bool value {b} is neither 0 nor 1")));
                }
                MetaValue::Bool(b == 1)
            }
            8 => MetaValue::String(self.string(field)?),
            9 => MetaValue::Array(self.array(field, depth)?),
            10 => MetaValue::U64(self.u64(field)?),
            11 => MetaValue::I64(i64::from_le_bytes(self.arr(field)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.arr(field)?)),
            t => {
                return Err(self.malformed(
                    field,
                    format!("unknown metadata value type {t} (known: 0..=12)"),
                ))
            }
        })
    }

    fn array(&mut self, field: &str, depth: usize) -> Result<MetaArray, GgufError> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(self.malformed(
                field,
                format!("arrays nested deeper than {MAX_ARRAY_DEPTH}"),
            ));
        }
        let ty = self.u32(field)?;
        macro_rules! prim {
            ($variant:ident, $t:ty) => {{
                let n = self.count(field, std::mem::size_of::<$t>())?;
                let raw = self.take(n * std::mem::size_of::<$t>(), field)?;
                MetaArray::$variant(
                    raw.chunks_exact(std::mem::size_of::<$t>())
                        .map(|c| {
                            <$t>::from_le_bytes(c.try_into().expect("chunk has the element size"))
                        })
                        .collect(),
                )
            }};
        }
        Ok(match ty {
            0 => prim!(U8, u8),
            1 => prim!(I8, i8),
            2 => prim!(U16, u16),
            3 => prim!(I16, i16),
            4 => prim!(U32, u32),
            5 => prim!(I32, i32),
            6 => prim!(F32, f32),
            7 => {
                let n = self.count(field, 1)?;
                let raw = self.take(n, field)?;
                if let Some(b) = raw.iter().find(|&&b| b > 1) {
                    return Err(
                        self.malformed(field, format!("bool array element {b} is neither 0 nor 1"))
                    );
                }
                MetaArray::Bool(raw.iter().map(|&b| b == 1).collect())
            }
            8 => {
                let n = self.count(field, 8)?;
                let mut v = Vec::with_capacity(n.min(MAX_PREALLOC));
                for _ in 0..n {
                    v.push(self.string(field)?);
                }
                MetaArray::String(v)
            }
            9 => {
                let n = self.count(field, 12)?;
                let mut v = Vec::with_capacity(n.min(MAX_PREALLOC));
                for _ in 0..n {
                    v.push(self.array(field, depth + 1)?);
                }
                MetaArray::Array(v)
            }
            10 => prim!(U64, u64),
            11 => prim!(I64, i64),
            12 => prim!(F64, f64),
            t => {
                return Err(self.malformed(
                    field,
                    format!("unknown array element type {t} (known: 0..=12)"),
                ))
            }
        })
    }

    fn header(mut self) -> Result<GgufHeader, GgufError> {
        let label = self.label.to_string();
        if self.bytes.len() < 4 || self.bytes[..4] != MAGIC {
            return Err(GgufError::BadMagic {
                path: label,
                found: self.bytes[..self.bytes.len().min(4)].to_vec(),
            });
        }
        self.pos = 4;
        let version = self.u32("version")?;
        match version {
            2 | 3 => {}
            1 => {
                return Err(GgufError::Version {
                    path: label,
                    version,
                    hint: "; convert it with a current llama.cpp",
                })
            }
            v if matches!(v.swap_bytes(), 1..=3) => return Err(GgufError::Version {
                path: label,
                version,
                hint:
                    " (this looks like a big-endian GGUF; only little-endian files are supported)",
            }),
            _ => {
                return Err(GgufError::Version {
                    path: label,
                    version,
                    hint: "",
                })
            }
        }
        // Minimum bytes per tensor info: name length + n_dims + one dim + type + offset.
        let n_tensors = self.count("tensor_count", 8 + 4 + 8 + 4 + 8)?;
        // Minimum bytes per metadata entry: key length + type + a one-byte value.
        let n_kv = self.count("metadata_kv_count", 8 + 4 + 1)?;

        let mut entries = Vec::with_capacity(n_kv.min(MAX_PREALLOC));
        for i in 0..n_kv {
            let key = self.string(&format!("metadata entry {i} key"))?;
            let ty = self.u32(&format!("metadata `{key}` type"))?;
            let value = self.value(ty, &format!("metadata `{key}`"), 0)?;
            entries.push((key, value));
        }
        let metadata = Metadata::from_entries(&label, entries);

        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_i64() {
                Some(a) if a > 0 && (a as u64).is_power_of_two() && a <= 1 << 20 => a as u64,
                _ => {
                    return Err(self.malformed(
                        "general.alignment",
                        format!("{v:?} is not a power of two between 1 and 1 MiB"),
                    ))
                }
            },
        };

        let mut tensors = Vec::with_capacity(n_tensors.min(MAX_PREALLOC));
        let mut index = std::collections::HashMap::with_capacity(n_tensors.min(MAX_PREALLOC));
        for i in 0..n_tensors {
            let name = self.string(&format!("tensor info {i} name"))?;
            let field = format!("tensor info `{name}`");
            let n_dims = self.u32(&field)? as usize;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(self.malformed(
                    &field,
                    format!("{n_dims} dimensions (ggml supports 1 to {MAX_DIMS})"),
                ));
            }
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                dims.push(self.u64(&field)?);
            }
            let ty = self.u32(&field)?;
            let dtype = GgmlType::from_id(ty)
                .ok_or_else(|| self.malformed(&field, format!("unknown tensor type id {ty}")))?;
            let offset = self.u64(&field)?;
            // ggml counts elements in i64. Check the product of the non-zero dimensions too: a
            // zero dimension makes the full product 0 while the row count (the product of the
            // others) could still overflow.
            let fits = dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d.max(1)))
                .is_some_and(|n| n <= i64::MAX as u64);
            if !fits {
                return Err(self.malformed(
                    &field,
                    format!(
                        "dimensions {dims:?} hold more elements than ggml can count (overflow)"
                    ),
                ));
            }
            let n: u64 = dims.iter().product();
            let size = Some(n)
                .and_then(|n| if dims[0].is_multiple_of(dtype.block_len() as u64) { dtype.bytes_for(n) } else { None })
                .ok_or_else(|| {
                    self.malformed(
                        &field,
                        format!(
                            "dimensions {dims:?} are impossible for type {dtype} (rows must be whole blocks of {})",
                            dtype.block_len()
                        ),
                    )
                })?;
            if !offset.is_multiple_of(alignment) {
                return Err(self.malformed(
                    &field,
                    format!("offset {offset} is not a multiple of the alignment {alignment}"),
                ));
            }
            if index.insert(name.clone(), i).is_some() {
                return Err(self.malformed(&field, "a second tensor with the same name"));
            }
            tensors.push(TensorInfo {
                name,
                dims,
                dtype,
                offset,
                size,
            });
        }

        let data_offset = (self.pos as u64).div_ceil(alignment) * alignment;
        if !tensors.is_empty() && data_offset > self.bytes.len() as u64 {
            return Err(self.malformed(
                "tensor data",
                format!(
                    "the file ends at byte {} inside the padding before the tensor data section at byte {data_offset} (truncated file?)",
                    self.bytes.len()
                ),
            ));
        }
        let data_len = (self.bytes.len() as u64).saturating_sub(data_offset);
        for t in &tensors {
            let end = t.offset.checked_add(t.size);
            if end.is_none_or(|e| e > data_len) {
                return Err(self.malformed(
                    &format!("tensor info `{}`", t.name),
                    format!(
                        "data at offset {} with {} bytes runs past the end of the file ({} bytes of tensor data; truncated file?)",
                        t.offset, t.size, data_len
                    ),
                ));
            }
        }
        Ok(GgufHeader {
            version,
            metadata,
            tensors,
            alignment,
            data_offset,
            index,
            label,
        })
    }
}

/// One file of an open GGUF model.
struct Part {
    path: PathBuf,
    header: GgufHeader,
    map: memmap2::Mmap,
    /// Where this file starts in the set's files laid end to end.
    start: u64,
}

/// An open, memory-mapped GGUF model: one file, or a split set (`NAME-00001-of-00003.gguf`
/// and its other parts, as llama.cpp's `gguf-split` writes them) read as one model: the
/// metadata from the first part, each tensor from the part that holds it ([`set`]).
pub struct GgufFile {
    parts: Vec<Part>,
    /// Every part's tensors, in set order.
    tensors: Vec<TensorInfo>,
    /// Tensor name to (part, index in `tensors`).
    index: std::collections::HashMap<String, (usize, usize)>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.parts[0].path)
            .field("parts", &self.parts.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Opens and maps `path` and parses its header; when it is a part of a split set, every
    /// part of the set (found by the set's file names beside it). Tensor data is not read
    /// until asked for.
    ///
    /// # Errors
    /// When a file cannot be read, a header is malformed, or the set is incomplete or mixed
    /// ([`set`] says how each is refused).
    pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let given = open_part(path.as_ref())?;
        let Some(split) = set::Split::of(&given.path, &given.header.metadata)? else {
            return Self::from_parts(vec![given]);
        };
        let paths = split.paths(&given.path)?;
        let mut parts = Vec::with_capacity(paths.len());
        for (i, p) in paths.iter().enumerate() {
            if i == split.no {
                // the file given is reopened in place below
                parts.push(None);
                continue;
            }
            if !p.exists() {
                return Err(set::missing(p, i, paths.len(), &given.path));
            }
            parts.push(Some(open_part(p)?));
        }
        parts[split.no] = Some(given);
        let parts: Vec<Part> = parts.into_iter().flatten().collect();
        let first = (parts[0].path.as_path(), &parts[0].header.metadata);
        for (i, part) in parts.iter().enumerate() {
            split.check_part(i, (&part.path, &part.header.metadata), first)?;
        }
        Self::from_parts(parts)
    }

    /// The model over `parts` (in set order): their offsets end to end, and the tensor
    /// index, refusing a tensor held by two parts or a count other than the set's.
    fn from_parts(mut parts: Vec<Part>) -> Result<Self, GgufError> {
        let mut start = 0;
        for p in &mut parts {
            p.start = start;
            start += p.map.len() as u64;
        }
        let mut tensors = Vec::new();
        let mut index: std::collections::HashMap<String, (usize, usize)> =
            std::collections::HashMap::new();
        for (i, p) in parts.iter().enumerate() {
            for t in &p.header.tensors {
                if let Some(&(other, _)) = index.get(&t.name) {
                    return Err(set::twice(&t.name, &parts[other].path, &p.path));
                }
                index.insert(t.name.clone(), (i, tensors.len()));
                tensors.push(t.clone());
            }
        }
        if parts.len() > 1 {
            set::check_count(&parts[0].path, &parts[0].header.metadata, tensors.len())?;
        }
        Ok(GgufFile {
            parts,
            tensors,
            index,
        })
    }

    /// The file's path (a split set's first part).
    pub fn path(&self) -> &Path {
        &self.parts[0].path
    }

    /// Every file of the model, in set order (one for a single file).
    pub fn part_paths(&self) -> Vec<&Path> {
        self.parts.iter().map(|p| p.path.as_path()).collect()
    }

    /// The bytes of every file, in set order.
    pub fn part_sizes(&self) -> Vec<u64> {
        self.parts.iter().map(|p| p.map.len() as u64).collect()
    }

    /// Bytes of all the model's files.
    pub fn size(&self) -> u64 {
        self.parts.iter().map(|p| p.map.len() as u64).sum()
    }

    /// The GGUF version of the (first) file.
    pub fn version(&self) -> u32 {
        self.parts[0].header.version
    }

    /// The byte ranges of the files' headers (everything before each file's tensor data),
    /// as offsets in the files laid end to end in set order.
    pub fn header_ranges(&self) -> Vec<Range<u64>> {
        self.parts
            .iter()
            .map(|p| p.start..p.start + p.header.data_offset)
            .collect()
    }

    /// Where tensor `t` (one of [`GgufFile::tensors`]) lies in the files laid end to end in
    /// set order.
    ///
    /// # Errors
    /// When the model has no such tensor.
    pub fn tensor_range(&self, name: &str) -> Result<Range<u64>, GgufError> {
        let (p, i) = self.locate(name)?;
        let part = &self.parts[p];
        let t = &self.tensors[i];
        let start = part.start + part.header.data_offset + t.offset;
        Ok(start..start + t.size)
    }

    /// The metadata section (a split set's first part's).
    pub fn metadata(&self) -> &Metadata {
        &self.parts[0].header.metadata
    }

    /// All tensor infos, in set order (each offset within its own file's data section).
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    fn locate(&self, name: &str) -> Result<(usize, usize), GgufError> {
        self.index.get(name).copied().ok_or_else(|| {
            let problem = if self.parts.len() > 1 {
                format!("is not in any of the set's {} parts", self.parts.len())
            } else {
                "is not in the file".into()
            };
            GgufError::Tensor {
                path: self.parts[0].path.display().to_string(),
                name: name.to_string(),
                problem,
            }
        })
    }

    /// The part holding tensor `name`.
    fn part_of(&self, name: &str) -> Result<&Part, GgufError> {
        Ok(&self.parts[self.locate(name)?.0])
    }

    /// The info of tensor `name`.
    ///
    /// # Errors
    /// When the model has no such tensor.
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        Ok(&self.tensors[self.locate(name)?.1])
    }

    /// Whether the model holds tensor `name`.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Tells the OS this process is done with tensor `name`'s bytes for now: the whole pages
    /// inside it leave the process's resident set (they stay in the page cache, and reading
    /// them again faults them back in). A loader that copies each tensor into its own layout
    /// calls this after the copy, so its peak memory is the copies, not the copies plus the
    /// file. Best effort: does nothing where the OS refuses.
    pub fn release(&self, name: &str) {
        const PAGE: usize = 4096;
        let Ok(part) = self.part_of(name) else {
            return;
        };
        let Some(t) = part.header.tensor(name) else {
            return;
        };
        let Some(start) = usize::try_from(part.header.data_offset + t.offset).ok() else {
            return;
        };
        let end = start.saturating_add(usize::try_from(t.size).unwrap_or(0));
        let (a, b) = (
            start.div_ceil(PAGE) * PAGE,
            (end / PAGE * PAGE).min(part.map.len()),
        );
        if a < b {
            // SAFETY: the map is a read-only private file mapping, so dropping its pages
            // loses nothing: a later read faults the file's bytes back in, and no reference
            // into the map sees different bytes.
            let _ = unsafe {
                part.map
                    .unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, a, b - a)
            };
        }
    }

    /// All bytes of tensor `name`.
    ///
    /// # Errors
    /// When the file has no such tensor.
    pub fn tensor_data(&self, name: &str) -> Result<&[u8], GgufError> {
        let p = self.part_of(name)?;
        p.header.tensor_data(&p.map, name)
    }

    /// The bytes of rows `rows` of tensor `name` (a row is `dims[0]` elements; for a weight
    /// matrix of shape `[out, in]` a row is one output feature). Contiguous, no copy.
    ///
    /// # Errors
    /// When the tensor is missing or the range is empty or out of bounds.
    pub fn tensor_rows(&self, name: &str, rows: Range<usize>) -> Result<&[u8], GgufError> {
        let p = self.part_of(name)?;
        p.header.tensor_rows(&p.map, name, rows)
    }

    /// The bytes of columns `cols` of every row of tensor `name`, gathered row after row
    /// (the input-dimension slice a row-parallel layer needs). The range must start and end
    /// on a quantization block boundary.
    ///
    /// # Errors
    /// When the tensor is missing, or the range is empty, out of bounds or not block aligned.
    pub fn tensor_cols(&self, name: &str, cols: Range<usize>) -> Result<Vec<u8>, GgufError> {
        let p = self.part_of(name)?;
        p.header.tensor_cols(&p.map, name, cols)
    }
}

/// Opens and maps one file and parses its header.
fn open_part(path: &Path) -> Result<Part, GgufError> {
    let label = path.display().to_string();
    let io = |source| GgufError::Io {
        path: label.clone(),
        source,
    };
    let file = File::open(path).map_err(io)?;
    // SAFETY: the map is read-only and private to this process. Like every mmap-based
    // model loader we accept that another process truncating or rewriting the file while
    // it is open is outside what we can defend against.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
    let header = GgufHeader::parse(&map, &label)?;
    Ok(Part {
        path: path.to_path_buf(),
        header,
        map,
        start: 0,
    })
}
