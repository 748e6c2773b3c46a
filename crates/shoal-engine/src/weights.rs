//! Where weights come from. A [`WeightSource`] hands out one tensor, or the slice of it a
//! rank needs, as a candle `QTensor` in the file's own quantization — never dequantized to
//! make slicing easier. Tensors are named the GGUF way (`blk.3.attn_q.weight`) whatever the
//! file; the safetensors source maps Hugging Face names onto those.

use std::borrow::Cow;
use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{Device, Tensor};
use shoal_model::gguf::{GgmlType, GgufFile};

use crate::arch::{ArchSpec, Role};
use crate::{EngineError, ModelConfig};

/// Which part of a tensor to load. Rows are the outer dimension of a `[out, in]` weight
/// (output features); columns the inner one (input features), cut on quantization blocks.
/// For a 1-D tensor (a norm or a bias) `Cols` selects elements.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Slice {
    /// The whole tensor.
    Full,
    /// Output rows `range`.
    Rows(Range<usize>),
    /// Input columns `range`.
    Cols(Range<usize>),
    /// Matrix `index` of a 3-D tensor `[n, rows, cols]` (one expert's, or one head's), cut
    /// as `within` says (`Full`, `Rows` or `Cols` of that matrix).
    Matrix {
        /// Which matrix.
        index: usize,
        /// The part of it.
        within: Box<Slice>,
    },
}

impl Slice {
    /// Matrix `index` of a 3-D tensor, cut as `within` says.
    pub fn matrix(index: usize, within: Slice) -> Self {
        Slice::Matrix {
            index,
            within: Box::new(within),
        }
    }
}

/// A matrix slice as stored: its type, `[rows, cols]`, and its bytes (borrowed from the
/// file where contiguous).
pub type RawMatrix<'a> = (GgmlType, [usize; 2], Cow<'a, [u8]>);

/// A file (or set of files) that weights are read from.
pub trait WeightSource: Send + Sync {
    /// Names the source in error messages.
    fn describe(&self) -> String;
    /// Whether tensor `name` exists.
    fn contains(&self, name: &str) -> bool;
    /// Shape of tensor `name`, outermost dimension first.
    ///
    /// # Errors
    /// When the tensor does not exist.
    fn shape(&self, name: &str) -> Result<Vec<usize>, EngineError>;
    /// Loads `slice` of tensor `name`.
    ///
    /// # Errors
    /// When the tensor does not exist, the slice is impossible, or its type is unsupported.
    fn load(&self, name: &str, slice: &Slice) -> Result<QTensor, EngineError>;

    /// `slice` of the 2-D tensor `name` as its stored bytes, for sources that can hand them
    /// out without building a candle tensor (then the kernels repack them with one copy):
    /// `(type, [rows, cols], bytes)`. `None` when the source cannot.
    ///
    /// # Errors
    /// As [`WeightSource::load`].
    fn load_bytes(
        &self,
        _name: &str,
        _slice: &Slice,
    ) -> Result<Option<RawMatrix<'_>>, EngineError> {
        Ok(None)
    }

    /// Bytes tensor `name` takes as stored (what a decode step reads of it).
    ///
    /// # Errors
    /// When the tensor does not exist.
    fn stored_bytes(&self, name: &str) -> Result<u64, EngineError> {
        Ok(self.shape(name)?.iter().product::<usize>() as u64 * 4)
    }

    /// Says the caller is done reading tensor `name` (the source may let its pages go).
    fn release(&self, _name: &str) {}

    /// Elements per quantization block of tensor `name`: a column cut must fall on a
    /// multiple of it. 1 for float tensors.
    ///
    /// # Errors
    /// When the tensor does not exist.
    fn block_len(&self, name: &str) -> Result<usize, EngineError> {
        self.shape(name).map(|_| 1)
    }

    /// Loads `slice` of tensor `name` as a plain f32 tensor (norms, biases).
    ///
    /// # Errors
    /// As [`WeightSource::load`].
    fn load_f32(&self, name: &str, slice: &Slice) -> Result<Tensor, EngineError> {
        let q = self.load(name, slice)?;
        q.dequantize(&Device::Cpu)
            .map_err(|e| EngineError::candle(format!("dequantizing `{name}`"), e))
    }
}

/// The candle storage type of a file's tensor type, where candle has one.
pub(crate) fn candle_dtype(t: GgmlType) -> Option<GgmlDType> {
    Some(match t {
        GgmlType::F32 => GgmlDType::F32,
        GgmlType::F16 => GgmlDType::F16,
        GgmlType::BF16 => GgmlDType::BF16,
        GgmlType::Q4_0 => GgmlDType::Q4_0,
        GgmlType::Q4_1 => GgmlDType::Q4_1,
        GgmlType::Q5_0 => GgmlDType::Q5_0,
        GgmlType::Q5_1 => GgmlDType::Q5_1,
        GgmlType::Q8_0 => GgmlDType::Q8_0,
        GgmlType::Q8_1 => GgmlDType::Q8_1,
        GgmlType::Q2_K => GgmlDType::Q2K,
        GgmlType::Q3_K => GgmlDType::Q3K,
        GgmlType::Q4_K => GgmlDType::Q4K,
        GgmlType::Q5_K => GgmlDType::Q5K,
        GgmlType::Q6_K => GgmlDType::Q6K,
        GgmlType::Q8_K => GgmlDType::Q8K,
        _ => return None,
    })
}

fn qtensor_from_bytes(
    bytes: &[u8],
    dtype: GgmlDType,
    shape: Vec<usize>,
) -> candle_core::Result<QTensor> {
    let storage = QStorage::from_data(Cow::Borrowed(bytes), &Device::Cpu, dtype)?;
    QTensor::new(storage, shape)
}

/// Weights read from one GGUF file, only the bytes of the requested slice.
pub struct GgufWeights {
    file: GgufFile,
}

impl GgufWeights {
    /// Wraps an open GGUF file.
    pub fn new(file: GgufFile) -> Self {
        GgufWeights { file }
    }

    /// The underlying file.
    pub fn file(&self) -> &GgufFile {
        &self.file
    }
}

impl WeightSource for GgufWeights {
    fn describe(&self) -> String {
        self.file.path().display().to_string()
    }

    fn contains(&self, name: &str) -> bool {
        self.file.has_tensor(name)
    }

    fn shape(&self, name: &str) -> Result<Vec<usize>, EngineError> {
        Ok(self.file.tensor(name)?.shape())
    }

    fn block_len(&self, name: &str) -> Result<usize, EngineError> {
        Ok(self.file.tensor(name)?.dtype.block_len())
    }

    fn release(&self, name: &str) {
        self.file.release(name);
    }

    fn stored_bytes(&self, name: &str) -> Result<u64, EngineError> {
        Ok(self.file.tensor(name)?.size)
    }

    fn load(&self, name: &str, slice: &Slice) -> Result<QTensor, EngineError> {
        let info = self.file.tensor(name)?;
        let dtype = candle_dtype(info.dtype).ok_or_else(|| EngineError::Unsupported {
            what: format!(
                "{}: tensor `{name}` has type {}, which shoal cannot compute with yet",
                self.describe(),
                info.dtype
            ),
        })?;
        let (bytes, shape) = self.slice_bytes(name, slice)?;
        qtensor_from_bytes(&bytes, dtype, shape)
            .map_err(|e| EngineError::candle(format!("loading `{name}`"), e))
    }

    fn load_bytes(&self, name: &str, slice: &Slice) -> Result<Option<RawMatrix<'_>>, EngineError> {
        let dtype = self.file.tensor(name)?.dtype;
        let (bytes, shape) = self.slice_bytes(name, slice)?;
        let [rows, cols] = shape[..] else {
            return Ok(None);
        };
        Ok(Some((dtype, [rows, cols], bytes)))
    }
}

impl GgufWeights {
    /// The bytes of `slice` of tensor `name` (borrowed from the mmap where contiguous) and
    /// the slice's shape.
    fn slice_bytes(
        &self,
        name: &str,
        slice: &Slice,
    ) -> Result<(Cow<'_, [u8]>, Vec<usize>), EngineError> {
        let shape = self.file.tensor(name)?.shape();
        let (bytes, shape): (Cow<'_, [u8]>, Vec<usize>) = match slice {
            Slice::Full => (Cow::Borrowed(self.file.tensor_data(name)?), shape),
            Slice::Rows(r) => {
                if shape.len() != 2 {
                    return Err(EngineError::BadSlice {
                        tensor: name.into(),
                        problem: format!("row slice of a {}-D tensor", shape.len()),
                    });
                }
                (
                    Cow::Borrowed(self.file.tensor_rows(name, r.clone())?),
                    vec![r.len(), shape[1]],
                )
            }
            Slice::Cols(c) => {
                let mut s = shape.clone();
                *s.last_mut().expect("tensors have at least one dimension") = c.len();
                (Cow::Owned(self.file.tensor_cols(name, c.clone())?), s)
            }
            Slice::Matrix { index, within } => self.matrix_bytes(name, &shape, *index, within)?,
        };
        Ok((bytes, shape))
    }

    /// The bytes and shape of `within` of matrix `index` of the 3-D tensor `name`.
    fn matrix_bytes(
        &self,
        name: &str,
        shape: &[usize],
        index: usize,
        within: &Slice,
    ) -> Result<(Cow<'_, [u8]>, Vec<usize>), EngineError> {
        let bad = |problem: String| EngineError::BadSlice {
            tensor: name.into(),
            problem,
        };
        let &[n, rows, cols] = shape else {
            return Err(bad(format!("a matrix of a {}-D tensor", shape.len())));
        };
        if index >= n {
            return Err(bad(format!("matrix {index} of {n}")));
        }
        let base = index * rows;
        match within {
            Slice::Full => Ok((
                Cow::Borrowed(self.file.tensor_rows(name, base..base + rows)?),
                vec![rows, cols],
            )),
            Slice::Rows(r) => {
                if r.start >= r.end || r.end > rows {
                    return Err(bad(format!("rows {r:?} of a matrix of {rows}")));
                }
                Ok((
                    Cow::Borrowed(self.file.tensor_rows(name, base + r.start..base + r.end)?),
                    vec![r.len(), cols],
                ))
            }
            Slice::Cols(c) => {
                let dtype = self.file.tensor(name)?.dtype;
                let (bl, bb) = (dtype.block_len(), dtype.block_bytes());
                if c.start >= c.end
                    || c.end > cols
                    || !c.start.is_multiple_of(bl)
                    || !c.end.is_multiple_of(bl)
                {
                    return Err(bad(format!(
                        "columns {c:?} of a matrix of {cols} (cuts fall on multiples of {bl})"
                    )));
                }
                let data = self.file.tensor_rows(name, base..base + rows)?;
                let row_bytes = cols / bl * bb;
                let (b0, b1) = (c.start / bl * bb, c.end / bl * bb);
                let mut out = Vec::with_capacity(rows * (b1 - b0));
                for row in data.chunks_exact(row_bytes) {
                    out.extend_from_slice(&row[b0..b1]);
                }
                Ok((Cow::Owned(out), vec![rows, c.len()]))
            }
            Slice::Matrix { .. } => Err(bad("a matrix of a matrix".into())),
        }
    }
}

/// Where one safetensors tensor lives.
struct StEntry {
    file: usize,
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// How Hugging Face names map onto GGUF names (the architecture's table), and which rows
/// need the llama q/k permutation (the GGUF converter permutes them so interleaved RoPE can
/// be used).
#[derive(Debug, Clone)]
pub struct HfNaming {
    /// The architecture's tensor table.
    pub arch: &'static ArchSpec,
    /// Permute q/k rows from `rotate_half` order into interleaved order: the model's query
    /// and KV head counts.
    pub permute_qk: Option<(usize, usize)>,
}

impl HfNaming {
    /// The naming of `cfg`'s architecture, permuting q/k rows where its GGUF files do.
    pub fn for_config(cfg: &ModelConfig) -> Self {
        let arch = crate::arch::spec(cfg.arch);
        HfNaming {
            arch,
            permute_qk: arch.permutes_qk.then_some((cfg.n_head, cfg.n_kv_head)),
        }
    }
}

/// Weights read from Hugging Face safetensors files (one or several shards), converted to
/// f32 and exposed under GGUF names.
pub struct SafetensorsWeights {
    paths: Vec<PathBuf>,
    maps: Vec<memmap2::Mmap>,
    entries: HashMap<String, StEntry>,
    naming: HfNaming,
}

impl SafetensorsWeights {
    /// Maps the given safetensors files and indexes their tensors.
    ///
    /// # Errors
    /// When a file cannot be read or its header is malformed.
    pub fn open(paths: &[PathBuf], naming: HfNaming) -> Result<Self, EngineError> {
        let mut maps = Vec::new();
        let mut entries = HashMap::new();
        for (i, p) in paths.iter().enumerate() {
            let io = |e: std::io::Error| EngineError::Load {
                what: format!("{}: {e}", p.display()),
            };
            let f = std::fs::File::open(p).map_err(io)?;
            // SAFETY: read-only private map; see GgufFile::open for the accepted risk of a
            // concurrent writer.
            let map = unsafe { memmap2::Mmap::map(&f) }.map_err(io)?;
            let (header_len, meta) =
                safetensors::SafeTensors::read_metadata(&map).map_err(|e| EngineError::Load {
                    what: format!("{}: bad safetensors header: {e}", p.display()),
                })?;
            let base = 8 + header_len;
            for (name, info) in meta.tensors() {
                let (s, e) = info.data_offsets;
                entries.insert(
                    name.clone(),
                    StEntry {
                        file: i,
                        dtype: info.dtype,
                        shape: info.shape.clone(),
                        start: base + s,
                        end: base + e,
                    },
                );
            }
            maps.push(map);
        }
        Ok(SafetensorsWeights {
            paths: paths.to_vec(),
            maps,
            entries,
            naming,
        })
    }

    fn entry(&self, gguf: &str) -> Result<(String, &StEntry), EngineError> {
        let hf = self
            .naming
            .arch
            .hf_name(gguf)
            .ok_or_else(|| EngineError::MissingTensor {
                file: self.describe(),
                name: gguf.into(),
            })?;
        let e = self
            .entries
            .get(&hf)
            .ok_or_else(|| EngineError::MissingTensor {
                file: self.describe(),
                name: hf.clone(),
            })?;
        Ok((hf, e))
    }

    fn f32_data(&self, hf: &str, e: &StEntry) -> Result<Vec<f32>, EngineError> {
        let bytes = self.maps[e.file]
            .get(e.start..e.end)
            .ok_or_else(|| EngineError::Load {
                what: format!(
                    "{}: tensor `{hf}` data runs past the end of the file",
                    self.paths[e.file].display()
                ),
            })?;
        let n: usize = e.shape.iter().product();
        let width = match e.dtype {
            safetensors::Dtype::F32 => 4,
            safetensors::Dtype::F16 | safetensors::Dtype::BF16 => 2,
            d => {
                return Err(EngineError::Unsupported {
                    what: format!(
                        "safetensors tensor `{hf}` has dtype {d:?}; supported: F32, F16, BF16"
                    ),
                })
            }
        };
        if bytes.len() != n * width {
            return Err(EngineError::Load {
                what: format!(
                    "tensor `{hf}`: {} bytes for shape {:?} of {:?}",
                    bytes.len(),
                    e.shape,
                    e.dtype
                ),
            });
        }
        let c = bytes.chunks_exact(width);
        Ok(match e.dtype {
            safetensors::Dtype::F32 => c
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            safetensors::Dtype::F16 => c
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            _ => c
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        })
    }
}

/// Permutes the rows of a q or k weight (or bias) from Hugging Face `rotate_half` order into
/// the interleaved order GGUF llama files use: within each head, row `i` of the first half
/// and row `i` of the second half become rows `2i` and `2i+1`.
pub fn permute_rows_for_interleaved_rope(data: &[f32], n_head: usize, row_len: usize) -> Vec<f32> {
    let rows = data.len() / row_len;
    let head_dim = rows / n_head;
    let half = head_dim / 2;
    let mut out = vec![0f32; data.len()];
    for h in 0..n_head {
        for i in 0..half {
            for (j, src_row) in [i, half + i].into_iter().enumerate() {
                let src = (h * head_dim + src_row) * row_len;
                let dst = (h * head_dim + 2 * i + j) * row_len;
                out[dst..dst + row_len].copy_from_slice(&data[src..src + row_len]);
            }
        }
    }
    out
}

impl WeightSource for SafetensorsWeights {
    fn describe(&self) -> String {
        match self.paths.first() {
            Some(p) => p.parent().unwrap_or(Path::new(".")).display().to_string(),
            None => "safetensors (no files)".into(),
        }
    }

    fn contains(&self, name: &str) -> bool {
        self.naming
            .arch
            .hf_name(name)
            .is_some_and(|h| self.entries.contains_key(&h))
    }

    fn shape(&self, name: &str) -> Result<Vec<usize>, EngineError> {
        Ok(self.entry(name)?.1.shape.clone())
    }

    fn load(&self, name: &str, slice: &Slice) -> Result<QTensor, EngineError> {
        let (hf, e) = self.entry(name)?;
        let mut data = self.f32_data(&hf, e)?;
        let mut shape = e.shape.clone();
        if let Some((n_head, n_kv_head)) = self.naming.permute_qk {
            let heads = match self.naming.arch.entry(name).map(|(t, _)| t.role) {
                Some(Role::AttnQ | Role::AttnQBias) => Some(n_head),
                Some(Role::AttnK | Role::AttnKBias) => Some(n_kv_head),
                _ => None,
            };
            if let Some(h) = heads {
                let row_len = if shape.len() == 2 { shape[1] } else { 1 };
                data = permute_rows_for_interleaved_rope(&data, h, row_len);
            }
        }
        let row_len = *shape.last().unwrap_or(&1);
        match slice {
            Slice::Full => {}
            Slice::Rows(r) => {
                let n_rows = data.len() / row_len.max(1);
                if shape.len() != 2 || r.start >= r.end || r.end > n_rows {
                    return Err(EngineError::BadSlice {
                        tensor: name.into(),
                        problem: format!("rows {r:?} of shape {shape:?}"),
                    });
                }
                data = data[r.start * row_len..r.end * row_len].to_vec();
                shape[0] = r.len();
            }
            Slice::Cols(c) => {
                if c.start >= c.end || c.end > row_len {
                    return Err(EngineError::BadSlice {
                        tensor: name.into(),
                        problem: format!("columns {c:?} of shape {shape:?}"),
                    });
                }
                data = data
                    .chunks_exact(row_len)
                    .flat_map(|row| row[c.clone()].iter().copied())
                    .collect();
                *shape.last_mut().expect("non-empty shape") = c.len();
            }
            Slice::Matrix { .. } => {
                return Err(EngineError::Unsupported {
                    what: format!(
                        "{}: `{hf}`: stacked expert or head tensors come from GGUF files only",
                        self.describe()
                    ),
                })
            }
        }
        let t = Tensor::from_vec(data, shape, &Device::Cpu)
            .map_err(|e| EngineError::candle(format!("loading `{hf}`"), e))?;
        QTensor::quantize(&t, GgmlDType::F32)
            .map_err(|e| EngineError::candle(format!("loading `{hf}`"), e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutation_interleaves_halves() {
        // One head of dim 4, rows of length 1: rows [a b | c d] become [a c b d].
        let p = permute_rows_for_interleaved_rope(&[0.0, 1.0, 2.0, 3.0], 1, 1);
        assert_eq!(p, vec![0.0, 2.0, 1.0, 3.0]);
    }
}
