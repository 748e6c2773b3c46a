//! The weights a block is made of, loaded through its architecture's table: linear layers
//! ([`Linear`], cut for tensor parallelism by output rows or by block-aligned input
//! columns), norms ([`Norm`]), and the loader that finds each role's tensor ([`Tensors`]).

use std::ops::Range;
use std::sync::Arc;

use candle_core::DType;

use crate::arch::{ArchSpec, Need, Role};
use crate::backend::Backend;
use crate::error::CandleContext;
use crate::weights::{Slice, WeightSource};
use crate::EngineError;

/// Where a block's tensors come from: the weights, the architecture's table of names, and
/// the backend that holds what is loaded.
pub(crate) struct Tensors<'a, B: Backend> {
    pub be: &'a B,
    pub src: &'a dyn WeightSource,
    pub spec: &'static ArchSpec,
}

impl<B: Backend> Tensors<'_, B> {
    /// The name of layer `layer`'s tensor of `role` when the file holds it; `None` when the
    /// architecture has no such tensor or it is optional and absent.
    ///
    /// # Errors
    /// When the tensor is required and missing.
    pub fn layer(&self, role: Role, layer: usize) -> Result<Option<String>, EngineError> {
        let Some(t) = self.spec.layer_tensor(role) else {
            return Ok(None);
        };
        let name = format!("blk.{layer}.{}", t.gguf);
        self.present(name, t.need)
    }

    /// The name of the model tensor of `role` when the file holds it (see
    /// [`Tensors::layer`]).
    ///
    /// # Errors
    /// When the tensor is required and missing.
    pub fn model(&self, role: Role) -> Result<Option<String>, EngineError> {
        let Some(t) = self.spec.model_tensor(role) else {
            return Ok(None);
        };
        self.present(t.gguf.to_string(), t.need)
    }

    fn present(&self, name: String, need: Need) -> Result<Option<String>, EngineError> {
        if self.src.contains(&name) {
            Ok(Some(name))
        } else if need == Need::Required {
            // the source names the tensor as its files do
            Err(self
                .src
                .shape(&name)
                .err()
                .unwrap_or(EngineError::MissingTensor {
                    file: self.src.describe(),
                    name,
                }))
        } else {
            Ok(None)
        }
    }

    /// Layer `layer`'s tensor of `role`, which this block needs (whether the table calls
    /// it required, or optional because other blocks do without it).
    ///
    /// # Errors
    /// When the file lacks it ([`EngineError::MissingTensor`]), or the table has no such
    /// role (a bug).
    pub fn layer_required(&self, role: Role, layer: usize) -> Result<String, EngineError> {
        let Some(t) = self.spec.layer_tensor(role) else {
            return Err(EngineError::Internal {
                what: format!(
                    "the {} table has no {role:?} tensor, which its blocks need",
                    self.spec.gguf_name
                ),
            });
        };
        self.present(format!("blk.{layer}.{}", t.gguf), Need::Required)?
            .ok_or_else(|| EngineError::Internal {
                what: format!("blk.{layer}.{} is required but absent", t.gguf),
            })
    }

    /// Checks that tensor `name` has shape `expected`.
    ///
    /// # Errors
    /// When it does not.
    pub fn check_shape(&self, name: &str, expected: &[usize]) -> Result<(), EngineError> {
        let found = self.src.shape(name)?;
        if found != expected {
            return Err(EngineError::Shape {
                tensor: name.into(),
                found,
                expected: expected.to_vec(),
            });
        }
        Ok(())
    }

    /// The f32 values of `slice` of tensor `name`.
    ///
    /// # Errors
    /// When it cannot be read.
    pub fn values(&self, name: &str, slice: &Slice) -> Result<Vec<f32>, EngineError> {
        self.src
            .load_f32(name, slice)?
            .to_dtype(DType::F32)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .ctx(name)
    }
}

/// A linear layer: a weight matrix (a slice of the model's) and an optional bias.
pub(crate) struct Linear<B: Backend> {
    pub w: Arc<B::Matrix>,
    pub bias: Option<B::Vector>,
}

impl<B: Backend> Linear<B> {
    /// Rows `rows` (output features) of the `[out, inp]` matrix `name`, and the same
    /// elements of `bias` when given: column parallel (q/k/v, gate/up, the output head).
    ///
    /// # Errors
    /// When a tensor is missing or misshapen.
    pub fn rows(
        t: &Tensors<'_, B>,
        name: &str,
        bias: Option<&str>,
        [out, inp]: [usize; 2],
        rows: Range<usize>,
    ) -> Result<Self, EngineError> {
        t.check_shape(name, &[out, inp])?;
        let whole = rows == (0..out);
        let slice = if whole {
            Slice::Full
        } else {
            Slice::Rows(rows.clone())
        };
        let w = Arc::new(t.be.matrix(t.src, name, &slice)?);
        let bias = match bias {
            Some(b) => {
                t.check_shape(b, &[out])?;
                let slice = if whole {
                    Slice::Full
                } else {
                    Slice::Cols(rows)
                };
                Some(t.be.vector(t.values(b, &slice)?))
            }
            None => None,
        };
        Ok(Linear { w, bias })
    }

    /// Columns `cols` (input features, whole quantization blocks) of the `[out, inp]`
    /// matrix `name`: row parallel (the attention output, the feed-forward down), whose
    /// products are partial sums over the ranks.
    ///
    /// # Errors
    /// When the tensor is missing, misshapen, or `cols` is not block aligned.
    pub fn cols(
        t: &Tensors<'_, B>,
        name: &str,
        [out, inp]: [usize; 2],
        cols: Range<usize>,
    ) -> Result<Self, EngineError> {
        t.check_shape(name, &[out, inp])?;
        let slice = if cols == (0..inp) {
            Slice::Full
        } else {
            Slice::Cols(cols)
        };
        Ok(Linear {
            w: Arc::new(t.be.matrix(t.src, name, &slice)?),
            bias: None,
        })
    }
}

/// An RMS norm's scale and epsilon.
pub(crate) struct Norm<B: Backend> {
    pub w: B::Vector,
    pub eps: f32,
}

impl<B: Backend> Norm<B> {
    /// The norm `name` over `dim` values.
    ///
    /// # Errors
    /// When the tensor is missing or misshapen.
    pub fn load(t: &Tensors<'_, B>, name: &str, dim: usize, eps: f64) -> Result<Self, EngineError> {
        t.check_shape(name, &[dim])?;
        Ok(Norm {
            w: t.be.vector(t.values(name, &Slice::Full)?),
            eps: eps as f32,
        })
    }

    /// Layer `layer`'s norm of `role` when the file holds it.
    ///
    /// # Errors
    /// When it is required and missing, or misshapen.
    pub fn layer(
        t: &Tensors<'_, B>,
        role: Role,
        layer: usize,
        dim: usize,
        eps: f64,
    ) -> Result<Option<Self>, EngineError> {
        t.layer(role, layer)?
            .map(|n| Self::load(t, &n, dim, eps))
            .transpose()
    }
}
