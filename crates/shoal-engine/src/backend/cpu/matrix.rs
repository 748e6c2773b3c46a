//! The CPU backend's weight matrices: shoal's kernels ([`QuantMatrix`]) for the types they
//! cover, candle's quantized matmul for the rest (Q8_1) and, on arm64 with the
//! portable kernels (`SHOAL_KERNELS=portable`), for everything: there candle's NEON code is
//! faster than shoal's portable Rust.

use std::cell::RefCell;
use std::sync::Arc;

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};

use super::elementwise;
use crate::backend::cpu::kernels::{GatePair, Isa, QuantMatrix, WeightType};
use crate::config::Activation;
use crate::error::CandleContext;
use crate::profile::{self, Op};
use crate::weights::{candle_dtype, Slice, WeightSource};
use crate::EngineError;
use candle_core::quantized::GgmlDType;
use shoal_model::gguf::GgmlType;

/// A weight matrix and what multiplies by it.
#[derive(Debug, Clone)]
pub enum CpuMatrix {
    /// Multiplied by [`crate::backend::cpu::kernels`].
    Kernel(Arc<QuantMatrix>),
    /// Multiplied by candle; the stored tensor is kept for row lookups (an embedding).
    Candle {
        /// The product.
        matmul: QMatMul,
        /// The tensor as stored.
        table: Arc<QTensor>,
    },
}

/// Whether every matrix goes to candle: on arm64 when shoal's NEON kernels are switched
/// off.
pub(crate) fn candle_only() -> bool {
    cfg!(target_arch = "aarch64") && crate::backend::cpu::kernels::active_isa() == Isa::Portable
}

impl CpuMatrix {
    /// Loads `slice` of matrix `name`: straight from the source's bytes into the kernels'
    /// layout where it can, else through a candle tensor.
    ///
    /// # Errors
    /// When the tensor is missing, misshapen or cannot be cut that way.
    pub fn load(src: &dyn WeightSource, name: &str, slice: &Slice) -> Result<Self, EngineError> {
        if let Some(m) = load_quant_matrix(src, name, slice, candle_only())? {
            return Ok(CpuMatrix::Kernel(Arc::new(m)));
        }
        Self::from_qtensor(name, src.load(name, slice)?)
    }

    /// Wraps a loaded tensor `name`.
    ///
    /// # Errors
    /// When the tensor is not 2-D or its bytes do not fit its shape.
    pub fn from_qtensor(name: &str, q: QTensor) -> Result<Self, EngineError> {
        if !candle_only() {
            if let Some(m) = quant_matrix(name, &q)? {
                return Ok(CpuMatrix::Kernel(Arc::new(m)));
            }
        }
        let table = Arc::new(q);
        Ok(CpuMatrix::Candle {
            matmul: QMatMul::from_arc(table.clone()).ctx(name)?,
            table,
        })
    }

    /// `[rows, cols]`.
    pub fn dims(&self) -> [usize; 2] {
        match self {
            CpuMatrix::Kernel(m) => [m.rows(), m.cols()],
            CpuMatrix::Candle { table, .. } => {
                let d = table.shape().dims();
                [d[0], d.get(1).copied().unwrap_or(1)]
            }
        }
    }

    /// The kernels' matrix, when they hold this one.
    pub fn kernel(&self) -> Option<&QuantMatrix> {
        match self {
            CpuMatrix::Kernel(m) => Some(m),
            CpuMatrix::Candle { .. } => None,
        }
    }

    /// `outs[i] = x W_i^T` for each matrix; `x` holds rows of the matrices' columns. The
    /// activations are quantized once and every product runs in one parallel region when
    /// shoal's kernels hold every matrix.
    ///
    /// # Errors
    /// On a shape mismatch.
    pub fn products(
        mats: &[&CpuMatrix],
        x: &[f32],
        outs: &mut [&mut Vec<f32>],
    ) -> Result<(), EngineError> {
        let Some(first) = mats.first() else {
            return Ok(());
        };
        let cols = first.dims()[1];
        if mats.len() != outs.len()
            || cols == 0
            || !x.len().is_multiple_of(cols)
            || mats.iter().any(|m| m.dims()[1] != cols)
        {
            return Err(EngineError::Internal {
                what: format!(
                    "products of {} values with matrices {:?} into {} outputs",
                    x.len(),
                    mats.iter().map(|m| m.dims()).collect::<Vec<_>>(),
                    outs.len()
                ),
            });
        }
        let kernels: Option<Vec<&QuantMatrix>> = mats.iter().map(|m| m.kernel()).collect();
        if let Some(kernels) = kernels {
            return QuantMatrix::products_into(&kernels, x, outs).map_err(|e| {
                EngineError::Internal {
                    what: e.to_string(),
                }
            });
        }
        let rows = x.len() / cols;
        for (m, out) in mats.iter().zip(outs.iter_mut()) {
            match m {
                CpuMatrix::Kernel(k) => {
                    QuantMatrix::products_into(&[k], x, std::slice::from_mut(out)).map_err(|e| {
                        EngineError::Internal {
                            what: e.to_string(),
                        }
                    })?
                }
                CpuMatrix::Candle { matmul, .. } => {
                    let xt =
                        Tensor::from_slice(x, (rows, cols), &Device::Cpu).ctx("matmul input")?;
                    let y = matmul
                        .forward(&xt)
                        .and_then(|y| y.to_dtype(candle_core::DType::F32))
                        .and_then(|y| y.flatten_all())
                        .and_then(|y| y.to_vec1::<f32>())
                        .ctx("quantized matmul")?;
                    **out = y;
                }
            }
        }
        Ok(())
    }

    /// Row `r` as values into `out` (`cols` long): an embedding lookup.
    ///
    /// # Errors
    /// When `r` is out of range or the stored type cannot be read by row.
    pub fn row(&self, r: usize, out: &mut [f32]) -> Result<(), EngineError> {
        match self {
            CpuMatrix::Kernel(m) => m.dequantize_row(r, out).map_err(|e| EngineError::Internal {
                what: format!("embedding lookup: {e}"),
            }),
            CpuMatrix::Candle { table, .. } => {
                let ids = Tensor::new(&[r as u32], &Device::Cpu).ctx("token id")?;
                let row = table
                    .embedding(&ids)
                    .and_then(|x| x.flatten_all())
                    .and_then(|x| x.to_vec1::<f32>())
                    .ctx("embedding")?;
                if row.len() != out.len() {
                    return Err(EngineError::Internal {
                        what: format!("an embedding row of {} into {}", row.len(), out.len()),
                    });
                }
                out.copy_from_slice(&row);
                Ok(())
            }
        }
    }
}

/// A feed-forward's gate and up projections: one interleaved matrix where the kernels hold
/// both alike ([`GatePair`]: the activation then runs inside the product's parallel loop),
/// else two matrices.
#[derive(Debug)]
pub enum CpuGateUp {
    /// Interleaved by tile.
    Paired(GatePair),
    /// Apart.
    Apart {
        /// The gate projection.
        gate: CpuMatrix,
        /// The up projection.
        up: CpuMatrix,
    },
}

impl CpuGateUp {
    /// `gate` and `up`, paired where the kernels can.
    pub fn new(gate: CpuMatrix, up: CpuMatrix) -> Self {
        let pair = match (gate.kernel(), up.kernel()) {
            (Some(g), Some(u)) => GatePair::new(g, u),
            _ => None,
        };
        match pair {
            Some(pair) => CpuGateUp::Paired(pair),
            None => CpuGateUp::Apart { gate, up },
        }
    }

    /// `act(x G^T) * (x U^T)` into `out` (rows of `x` of the pair's columns).
    ///
    /// # Errors
    /// When `x` is not a whole number of rows.
    pub fn gated(&self, act: Activation, x: &[f32], out: &mut Vec<f32>) -> Result<(), EngineError> {
        self.gated_biased(act, x, None, out)
    }

    /// `act(x G^T + b_g) * (x U^T + b_u)` into `out`, with `bias = (b_g, b_u)` one value per
    /// feature where given (gpt-oss's experts).
    ///
    /// # Errors
    /// When `x` is not a whole number of rows, or a bias is not one value per feature.
    pub fn gated_biased(
        &self,
        act: Activation,
        x: &[f32],
        bias: Option<(&[f32], &[f32])>,
        out: &mut Vec<f32>,
    ) -> Result<(), EngineError> {
        match self {
            CpuGateUp::Paired(pair) => {
                let _p = profile::scope(Op::GateUp);
                pair.gated_products_into(x, act, bias, out)
                    .map_err(|e| EngineError::Internal {
                        what: e.to_string(),
                    })
            }
            CpuGateUp::Apart { gate, up } => {
                // taken out while the products run: a thread waiting in their parallel loop
                // may run another step's job, which then finds empty buffers of its own
                let (mut g, mut u) = GATE_UP.with(|s| std::mem::take(&mut *s.borrow_mut()));
                let products = {
                    let _p = profile::scope(Op::GateUp);
                    CpuMatrix::products(&[gate, up], x, &mut [&mut g, &mut u])
                };
                let products = products.and_then(|()| match bias {
                    Some((bg, bu)) => {
                        add_row_bias(&mut g, bg).and_then(|()| add_row_bias(&mut u, bu))
                    }
                    None => Ok(()),
                });
                if products.is_ok() {
                    let _p = profile::scope(Op::Activation);
                    out.resize(g.len(), 0.0);
                    elementwise::gated(act, &g, &u, out);
                }
                GATE_UP.with(|s| *s.borrow_mut() = (g, u));
                products
            }
        }
    }
}

/// Adds `bias` to every row of `y` (rows as long as `bias`).
///
/// # Errors
/// When `y` is not a whole number of such rows.
pub(crate) fn add_row_bias(y: &mut [f32], bias: &[f32]) -> Result<(), EngineError> {
    if bias.is_empty() || !y.len().is_multiple_of(bias.len()) {
        return Err(EngineError::Internal {
            what: format!("a bias of {} values on {} products", bias.len(), y.len()),
        });
    }
    for row in y.chunks_exact_mut(bias.len()) {
        elementwise::add(row, bias);
    }
    Ok(())
}

thread_local! {
    /// The gate and up products of a feed-forward whose projections are not paired.
    static GATE_UP: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// `q` (the 2-D tensor `name`) as a [`QuantMatrix`] for shoal's kernels, or `None` when its
/// type has no kernel (those fall back to candle's).
///
/// # Errors
/// When the tensor is not 2-D or its bytes do not match its shape.
fn quant_matrix(name: &str, q: &QTensor) -> Result<Option<QuantMatrix>, EngineError> {
    let dims = q.shape().dims().to_vec();
    let [rows, cols] = dims[..] else {
        return Err(EngineError::BadSlice {
            tensor: name.into(),
            problem: format!("a matrix from a {}-D tensor", dims.len()),
        });
    };
    let Some(ty) = kernel_type(q.dtype()) else {
        return Ok(None);
    };
    let data = q
        .data()
        .map_err(|e| EngineError::candle(format!("reading `{name}`"), e))?
        .into_owned();
    QuantMatrix::new(ty, rows, cols, data)
        .map(Some)
        .map_err(|e| EngineError::Load {
            what: format!("`{name}`: {e}"),
        })
}

/// `slice` of matrix `name` straight from the source's bytes into a [`QuantMatrix`] (one
/// copy), when the source hands out bytes and the type has a kernel (with `candle_first`,
/// only a type candle cannot read); `None` otherwise.
///
/// # Errors
/// As [`WeightSource::load`], and when the bytes do not fit the shape.
fn load_quant_matrix(
    src: &dyn WeightSource,
    name: &str,
    slice: &Slice,
    candle_first: bool,
) -> Result<Option<QuantMatrix>, EngineError> {
    let Some((dtype, [rows, cols], bytes)) = src.load_bytes(name, slice)? else {
        return Ok(None);
    };
    if candle_first && candle_dtype(dtype).is_some() {
        return Ok(None);
    }
    let Some(ty) = file_kernel_type(dtype) else {
        return Ok(None);
    };
    let m = QuantMatrix::from_bytes(ty, rows, cols, &bytes).map_err(|e| EngineError::Load {
        what: format!("`{name}`: {e}"),
    })?;
    drop(bytes);
    src.release(name);
    Ok(Some(m))
}

/// The kernel type of a file's tensor type: the types candle also stores, and those only
/// shoal's kernels read (the i-quants and MXFP4).
fn file_kernel_type(t: GgmlType) -> Option<WeightType> {
    match t {
        GgmlType::IQ4_NL => Some(WeightType::Iq4Nl),
        GgmlType::IQ4_XS => Some(WeightType::Iq4Xs),
        GgmlType::MXFP4 => Some(WeightType::Mxfp4),
        GgmlType::IQ1_S => Some(WeightType::Iq1S),
        GgmlType::IQ1_M => Some(WeightType::Iq1M),
        GgmlType::IQ2_XXS => Some(WeightType::Iq2Xxs),
        GgmlType::IQ2_XS => Some(WeightType::Iq2Xs),
        GgmlType::IQ2_S => Some(WeightType::Iq2S),
        GgmlType::IQ3_XXS => Some(WeightType::Iq3Xxs),
        GgmlType::IQ3_S => Some(WeightType::Iq3S),
        other => candle_dtype(other).and_then(kernel_type),
    }
}

/// The kernel type of a candle storage type, where shoal has a kernel for it.
fn kernel_type(t: GgmlDType) -> Option<WeightType> {
    Some(match t {
        GgmlDType::F32 => WeightType::F32,
        GgmlDType::F16 => WeightType::F16,
        GgmlDType::BF16 => WeightType::Bf16,
        GgmlDType::Q4_0 => WeightType::Q4_0,
        GgmlDType::Q4_1 => WeightType::Q4_1,
        GgmlDType::Q5_0 => WeightType::Q5_0,
        GgmlDType::Q5_1 => WeightType::Q5_1,
        GgmlDType::Q8_0 => WeightType::Q8_0,
        GgmlDType::Q2K => WeightType::Q2K,
        GgmlDType::Q3K => WeightType::Q3K,
        GgmlDType::Q4K => WeightType::Q4K,
        GgmlDType::Q5K => WeightType::Q5K,
        GgmlDType::Q6K => WeightType::Q6K,
        _ => return None,
    })
}
