//! The building blocks of every architecture, written for tensor parallelism from the start:
//! a [`ColumnLinear`] holds a range of output features (free to cut), a [`RowLinear`] holds a
//! block-aligned range of input features and sums its partial outputs across ranks with one
//! all-reduce. At world size 1 both are plain linear layers and the all-reduce is skipped.

use std::sync::Arc;

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use shoal_comm::Communicator;

use crate::error::CandleContext;
use crate::kernels::{Isa, QuantMatrix};
use crate::weights::{load_quant_matrix, quant_matrix, Slice, WeightSource};
use crate::EngineError;

/// A weight matrix and what multiplies by it: shoal's kernels for the types they cover,
/// candle's quantized matmul for the rest (Q2_K, Q3_K, BF16, ...) and, on arm64 with the
/// portable kernels (`SHOAL_KERNELS=portable`), for everything.
#[derive(Debug, Clone)]
pub enum Matrix {
    /// Multiplied by [`crate::kernels`].
    Kernel(Arc<QuantMatrix>),
    /// Multiplied by candle.
    Candle(QMatMul),
}

/// Whether every matrix goes to candle: on arm64 when shoal's NEON kernels are switched
/// off, since its portable ones are slower than candle's NEON code.
pub(crate) fn candle_only() -> bool {
    cfg!(target_arch = "aarch64") && crate::kernels::active_isa() == Isa::Portable
}

impl Matrix {
    /// Loads `slice` of matrix `name`: straight from the source's bytes into the kernels'
    /// layout where it can, else through a candle tensor.
    ///
    /// # Errors
    /// When the tensor is missing, misshapen or cannot be cut that way.
    pub fn load(src: &dyn WeightSource, name: &str, slice: &Slice) -> Result<Self, EngineError> {
        if !candle_only() {
            if let Some(m) = load_quant_matrix(src, name, slice)? {
                return Ok(Matrix::Kernel(Arc::new(m)));
            }
        }
        Self::from_qtensor(name, src.load(name, slice)?)
    }

    /// Wraps a loaded tensor `name`.
    ///
    /// # Errors
    /// When the tensor is not 2-D or its bytes do not fit its shape.
    pub fn from_qtensor(name: &str, q: QTensor) -> Result<Self, EngineError> {
        if candle_only() {
            return Ok(Matrix::Candle(QMatMul::from_qtensor(q).ctx(name)?));
        }
        match quant_matrix(name, &q)? {
            Some(m) => Ok(Matrix::Kernel(Arc::new(m))),
            None => Ok(Matrix::Candle(QMatMul::from_qtensor(q).ctx(name)?)),
        }
    }

    /// `x @ W^T`; x is `(.., in)`, the result `(.., out)`.
    ///
    /// # Errors
    /// On a shape mismatch.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor, EngineError> {
        let mut ys = Self::forward_many(&[self], x)?;
        Ok(ys.pop().expect("one product per matrix"))
    }

    /// `x @ W_i^T` for each matrix, the activations quantized once and all products in one
    /// parallel region when shoal's kernels hold every matrix (`QuantMatrix::matmul_many`).
    ///
    /// # Errors
    /// On a shape mismatch.
    pub fn forward_many(mats: &[&Matrix], x: &Tensor) -> Result<Vec<Tensor>, EngineError> {
        let Some(kernels) = Self::all_kernels(mats) else {
            return mats
                .iter()
                .map(|m| match m {
                    Matrix::Candle(c) => c.forward(x).ctx("quantized matmul"),
                    Matrix::Kernel(_) => Self::forward_many(&[*m], x).map(|mut v| v.remove(0)),
                })
                .collect();
        };
        let ys = Self::kernel_products(&kernels, x)?;
        kernels
            .iter()
            .zip(ys)
            .map(|(m, y)| {
                let mut dims = x.dims().to_vec();
                *dims.last_mut().expect("checked by kernel_products") = m.rows();
                Tensor::from_vec(y, dims, &Device::Cpu).ctx("matmul output")
            })
            .collect()
    }

    /// [`Matrix::forward_many`] as plain values, row after row.
    ///
    /// # Errors
    /// On a shape mismatch.
    pub fn forward_many_values(mats: &[&Matrix], x: &Tensor) -> Result<Vec<Vec<f32>>, EngineError> {
        match Self::all_kernels(mats) {
            Some(kernels) => Self::kernel_products(&kernels, x),
            _ => Self::forward_many(mats, x)?
                .into_iter()
                .map(|y| {
                    y.flatten_all()
                        .and_then(|y| y.to_dtype(DType::F32))
                        .and_then(|y| y.to_vec1::<f32>())
                        .ctx("matmul output")
                })
                .collect(),
        }
    }

    /// [`Matrix::forward_many_values`] of plain values: `xs` holds rows of `cols` inputs
    /// (a decode step's activations, which never become tensors on the slice path).
    ///
    /// # Errors
    /// On a shape mismatch.
    pub fn forward_many_slice(
        mats: &[&Matrix],
        xs: &[f32],
        cols: usize,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        if cols == 0 || !xs.len().is_multiple_of(cols) {
            return Err(EngineError::Unsupported {
                what: format!("{} activations in rows of {cols}", xs.len()),
            });
        }
        match Self::all_kernels(mats) {
            Some(kernels) => Self::slice_products(&kernels, xs, cols),
            None => {
                let x = Tensor::from_slice(xs, (1, xs.len() / cols, cols), &Device::Cpu)
                    .ctx("matmul input")?;
                Self::forward_many_values(mats, &x)
            }
        }
    }

    /// The kernels' matrices of `mats`, when shoal's kernels hold every one.
    fn all_kernels<'a>(mats: &[&'a Matrix]) -> Option<Vec<&'a QuantMatrix>> {
        mats.iter()
            .map(|m| match m {
                Matrix::Kernel(k) => Some(&**k),
                Matrix::Candle(_) => None,
            })
            .collect()
    }

    /// The products of `x` with each of `kernels`, one value vector each.
    fn kernel_products(kernels: &[&QuantMatrix], x: &Tensor) -> Result<Vec<Vec<f32>>, EngineError> {
        let shape_error = |m: &QuantMatrix| EngineError::Unsupported {
            what: format!(
                "a matmul of shape {:?} with a {}x{} weight",
                x.dims(),
                m.rows(),
                m.cols()
            ),
        };
        let Some(first) = kernels.first() else {
            return Ok(Vec::new());
        };
        if x.dims().last() != Some(&first.cols()) {
            return Err(shape_error(first));
        }
        let x = x.contiguous().ctx("matmul input")?;
        with_f32(&x, |xs| Self::slice_products(kernels, xs, first.cols()))?
    }

    /// The products of rows `xs` of `cols` values with each of `kernels`.
    fn slice_products(
        kernels: &[&QuantMatrix],
        xs: &[f32],
        cols: usize,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        if let Some(m) = kernels.iter().find(|m| m.cols() != cols) {
            return Err(EngineError::Unsupported {
                what: format!(
                    "a matmul of rows of {cols} with a {}x{} weight",
                    m.rows(),
                    m.cols()
                ),
            });
        }
        QuantMatrix::products(kernels, xs).map_err(|e| EngineError::Unsupported {
            what: e.to_string(),
        })
    }
}

fn check_shape(src: &dyn WeightSource, name: &str, expected: &[usize]) -> Result<(), EngineError> {
    let found = src.shape(name)?;
    if found != expected {
        return Err(EngineError::Shape {
            tensor: name.into(),
            found,
            expected: expected.to_vec(),
        });
    }
    Ok(())
}

/// A linear layer whose output features (rows of the weight) may be a slice of the full
/// layer: q/k/v, gate and up projections, and the vocabulary-cut output head.
#[derive(Debug, Clone)]
pub struct ColumnLinear {
    weight: Matrix,
    bias: Option<Tensor>,
}

impl ColumnLinear {
    /// Loads rows `rows` of `{prefix}.weight` (and `{prefix}.bias` when `bias`), checking the
    /// full tensor is `[out, in]`.
    ///
    /// # Errors
    /// When a tensor is missing or has the wrong shape.
    pub fn load(
        src: &dyn WeightSource,
        prefix: &str,
        out: usize,
        inp: usize,
        rows: std::ops::Range<usize>,
        bias: bool,
    ) -> Result<Self, EngineError> {
        let wname = format!("{prefix}.weight");
        check_shape(src, &wname, &[out, inp])?;
        let slice = if rows == (0..out) {
            Slice::Full
        } else {
            Slice::Rows(rows.clone())
        };
        let weight = Matrix::load(src, &wname, &slice)?;
        let bias = if bias {
            let bname = format!("{prefix}.bias");
            check_shape(src, &bname, &[out])?;
            let bslice = if rows == (0..out) {
                Slice::Full
            } else {
                Slice::Cols(rows)
            };
            Some(src.load_f32(&bname, &bslice)?)
        } else {
            None
        };
        Ok(ColumnLinear { weight, bias })
    }

    /// Wraps an already-loaded matrix (the tied output head).
    pub fn from_matrix(weight: Matrix) -> Self {
        ColumnLinear { weight, bias: None }
    }

    /// `x @ W^T (+ b)`; x is `(.., in)`, the result `(.., out_slice)`.
    ///
    /// # Errors
    /// On a shape mismatch.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor, EngineError> {
        let mut ys = Self::forward_many(&[self], x)?;
        Ok(ys.pop().expect("one product per layer"))
    }

    /// The kernels' matrix, when they hold the weight and there is no bias: for layers that
    /// are combined into one matrix (a feed-forward's gate and up).
    pub fn kernel_matrix(&self) -> Option<&QuantMatrix> {
        match (&self.weight, &self.bias) {
            (Matrix::Kernel(m), None) => Some(m),
            _ => None,
        }
    }

    /// [`ColumnLinear::forward`] as plain values, row after row: the output head's logits
    /// for sampling, with no tensor to copy them out of again.
    ///
    /// # Errors
    /// On a shape mismatch.
    pub fn forward_values(&self, x: &Tensor) -> Result<Vec<f32>, EngineError> {
        let mut ys = Self::forward_many_values(&[self], x)?;
        Ok(ys.pop().expect("one product per layer"))
    }

    /// [`ColumnLinear::forward_many`] as plain values, row after row, the biases added in
    /// place (the same f32 additions as the tensors' broadcast add): a decode step's q/k/v
    /// are read as values next (RoPE, the KV cache, attention), and three tensors built
    /// only to be added to and read back cost more than the additions.
    ///
    /// # Errors
    /// On a shape mismatch.
    pub fn forward_many_values(
        layers: &[&ColumnLinear],
        x: &Tensor,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let mats: Vec<&Matrix> = layers.iter().map(|l| &l.weight).collect();
        let ys = Matrix::forward_many_values(&mats, x)?;
        Self::add_biases(layers, ys)
    }

    /// [`ColumnLinear::forward_many_values`] of plain values: `xs` holds rows of `cols`
    /// inputs.
    ///
    /// # Errors
    /// On a shape mismatch.
    pub fn forward_many_slice(
        layers: &[&ColumnLinear],
        xs: &[f32],
        cols: usize,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let mats: Vec<&Matrix> = layers.iter().map(|l| &l.weight).collect();
        let ys = Matrix::forward_many_slice(&mats, xs, cols)?;
        Self::add_biases(layers, ys)
    }

    /// Each layer's bias added in place to every row of its output.
    fn add_biases(
        layers: &[&ColumnLinear],
        mut ys: Vec<Vec<f32>>,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        for (l, y) in layers.iter().zip(&mut ys) {
            if let Some(b) = &l.bias {
                with_f32(b, |b| {
                    if !b.is_empty() {
                        for row in y.chunks_exact_mut(b.len()) {
                            for (v, b) in row.iter_mut().zip(b) {
                                *v += b;
                            }
                        }
                    }
                })?;
            }
        }
        Ok(ys)
    }

    /// Several layers over the same input (q/k/v, gate/up), through
    /// [`Matrix::forward_many`].
    ///
    /// # Errors
    /// On a shape mismatch.
    pub fn forward_many(layers: &[&ColumnLinear], x: &Tensor) -> Result<Vec<Tensor>, EngineError> {
        let mats: Vec<&Matrix> = layers.iter().map(|l| &l.weight).collect();
        let ys = Matrix::forward_many(&mats, x)?;
        layers
            .iter()
            .zip(ys)
            .map(|(l, y)| match &l.bias {
                Some(b) => y.broadcast_add(b).ctx("column linear bias"),
                None => Ok(y),
            })
            .collect()
    }
}

/// A linear layer whose input features (columns of the weight) are a block-aligned slice:
/// the attention output and FFN down projections. Each rank's product is a partial sum; one
/// all-reduce makes it whole.
#[derive(Clone)]
pub struct RowLinear {
    weight: Matrix,
    comm: Arc<dyn Communicator>,
}

impl std::fmt::Debug for RowLinear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowLinear")
            .field("weight", &self.weight)
            .finish()
    }
}

impl RowLinear {
    /// Loads columns `cols` of `{prefix}.weight`, checking the full tensor is `[out, in]`.
    ///
    /// # Errors
    /// When the tensor is missing, has the wrong shape, or `cols` is not block aligned.
    pub fn load(
        src: &dyn WeightSource,
        prefix: &str,
        out: usize,
        inp: usize,
        cols: std::ops::Range<usize>,
        comm: Arc<dyn Communicator>,
    ) -> Result<Self, EngineError> {
        let wname = format!("{prefix}.weight");
        check_shape(src, &wname, &[out, inp])?;
        let slice = if cols == (0..inp) {
            Slice::Full
        } else {
            Slice::Cols(cols)
        };
        let weight = Matrix::load(src, &wname, &slice)?;
        Ok(RowLinear { weight, comm })
    }

    /// `x @ W^T`, summed over ranks.
    ///
    /// # Errors
    /// On a shape mismatch or a failed all-reduce.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor, EngineError> {
        let y = self.weight.forward(x)?;
        if self.comm.world_size() == 1 {
            return Ok(y);
        }
        let shape = y.shape().clone();
        let mut data = y
            .flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .ctx("row linear gather")?;
        self.comm.all_reduce_sum(&mut data)?;
        Tensor::from_vec(data, shape, y.device()).ctx("row linear scatter")
    }

    /// [`RowLinear::forward`] of plain values: `xs` holds rows of `cols` inputs; the partial
    /// sums are reduced in place.
    ///
    /// # Errors
    /// On a shape mismatch or a failed all-reduce.
    pub fn forward_slice(&self, xs: &[f32], cols: usize) -> Result<Vec<f32>, EngineError> {
        let mut y = Matrix::forward_many_slice(&[&self.weight], xs, cols)?
            .pop()
            .expect("one product per matrix");
        if self.comm.world_size() > 1 {
            self.comm.all_reduce_sum(&mut y)?;
        }
        Ok(y)
    }
}

/// Root-mean-square normalisation with a learned scale.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Vec<f32>,
    eps: f32,
}

impl RmsNorm {
    /// Loads `{name}` (a 1-D tensor of `dim` elements).
    ///
    /// # Errors
    /// When the tensor is missing or has the wrong shape.
    pub fn load(
        src: &dyn WeightSource,
        name: &str,
        dim: usize,
        eps: f64,
    ) -> Result<Self, EngineError> {
        check_shape(src, name, &[dim])?;
        let weight = src
            .load_f32(name, &Slice::Full)?
            .to_dtype(candle_core::DType::F32)
            .and_then(|w| w.to_vec1::<f32>())
            .ctx(name)?;
        Ok(RmsNorm {
            weight,
            eps: eps as f32,
        })
    }

    /// Normalises over the last dimension: `x / sqrt(mean(x^2) + eps) * weight` per row,
    /// the mean summed in eight lanes (so it vectorizes; candle's one running sum was a
    /// serial chain, 24 µs for 16 SmolLM2 rows), rows split across the pool when there are
    /// many.
    ///
    /// # Errors
    /// On a shape mismatch.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor, EngineError> {
        self.check_width(x)?;
        let x = x.contiguous().ctx("rms norm")?;
        let out = with_f32(&x, |xs| self.rows(xs))?;
        Tensor::from_vec(out, x.dims(), &Device::Cpu).ctx("rms norm")
    }

    /// The residual stream after a sublayer, `x + a`, and its normalised copy, from one
    /// pass over plain values (a candle add allocates a tensor and dispatches an op for
    /// what is one addition per value). The sums are the tensor add's, bit for bit.
    ///
    /// # Errors
    /// On a shape mismatch.
    pub fn add_forward(&self, x: &Tensor, a: &Tensor) -> Result<(Tensor, Tensor), EngineError> {
        self.check_width(x)?;
        if x.dims() != a.dims() {
            return Err(EngineError::Unsupported {
                what: format!("a residual add of {:?} and {:?}", x.dims(), a.dims()),
            });
        }
        let (x, a) = (
            x.contiguous().ctx("residual")?,
            a.contiguous().ctx("residual")?,
        );
        let mut h = with_f32(&x, |xs| xs.to_vec())?;
        let hn = with_f32(&a, |r| self.add_forward_slice(&mut h, r))??;
        Ok((
            Tensor::from_vec(h, x.dims(), &Device::Cpu).ctx("residual")?,
            Tensor::from_vec(hn, x.dims(), &Device::Cpu).ctx("rms norm")?,
        ))
    }

    /// [`RmsNorm::forward`] of plain values: every row of `xs` normalised.
    ///
    /// # Errors
    /// When `xs` is not a whole number of rows.
    pub fn forward_slice(&self, xs: &[f32]) -> Result<Vec<f32>, EngineError> {
        self.check_len(xs.len())?;
        Ok(self.rows(xs))
    }

    /// [`RmsNorm::add_forward`] of plain values: the residual `x + a` replaces `x`, and its
    /// normalised copy is returned.
    ///
    /// # Errors
    /// When the lengths differ or are not a whole number of rows.
    pub fn add_forward_slice(&self, x: &mut [f32], a: &[f32]) -> Result<Vec<f32>, EngineError> {
        self.check_len(x.len())?;
        if x.len() != a.len() {
            return Err(EngineError::Unsupported {
                what: format!("a residual add of {} and {} values", x.len(), a.len()),
            });
        }
        for (x, a) in x.iter_mut().zip(a) {
            *x += a;
        }
        Ok(self.rows(x))
    }

    fn check_len(&self, len: usize) -> Result<(), EngineError> {
        let n = self.weight.len();
        if n == 0 || !len.is_multiple_of(n) {
            return Err(EngineError::Unsupported {
                what: format!("rms norm of width {n} over {len} values"),
            });
        }
        Ok(())
    }

    fn check_width(&self, x: &Tensor) -> Result<(), EngineError> {
        let n = self.weight.len();
        if x.dims().last() != Some(&n) {
            return Err(EngineError::Unsupported {
                what: format!("rms norm of width {n} over a {:?} tensor", x.dims()),
            });
        }
        Ok(())
    }

    /// Every row of `xs` normalised.
    fn rows(&self, xs: &[f32]) -> Vec<f32> {
        let n = self.weight.len();
        let mut out = vec![0f32; xs.len()];
        let row = |src: &[f32], dst: &mut [f32]| {
            let mut lanes = [0f32; 8];
            let mut chunks = src.chunks_exact(8);
            for c in &mut chunks {
                for (l, v) in lanes.iter_mut().zip(c) {
                    *l += v * v;
                }
            }
            let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
            let sum2 = lanes.iter().sum::<f32>() + tail;
            let m = (sum2 / n as f32 + self.eps).sqrt();
            for ((d, s), w) in dst.iter_mut().zip(src).zip(&self.weight) {
                *d = *s / m * *w;
            }
        };
        if xs.len() >= 64 * 1024 {
            use rayon::prelude::*;
            xs.par_chunks(n)
                .zip(out.par_chunks_mut(n))
                .for_each(|(s, d)| row(s, d));
        } else {
            for (s, d) in xs.chunks(n).zip(out.chunks_mut(n)) {
                row(s, d);
            }
        }
        out
    }
}

/// `f` over the values of a contiguous f32 tensor on the CPU, read in place.
///
/// # Errors
/// When the tensor is elsewhere, of another type or not contiguous.
pub(crate) fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R, EngineError> {
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        return Err(EngineError::Unsupported {
            what: "shoal's kernels and the ops around them run on the CPU only".into(),
        });
    };
    let all = cpu.as_slice::<f32>().ctx("f32 activations")?;
    let (a, b) = layout
        .contiguous_offsets()
        .ok_or_else(|| EngineError::Unsupported {
            what: "non-contiguous activations".into(),
        })?;
    Ok(f(&all[a..b]))
}
