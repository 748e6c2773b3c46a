//! The GPU backend's weight matrices: a matrix's stored bytes uploaded as they are in the
//! file (no repacking, no dequantizing), cut into chunks of whole rows where one buffer
//! binding could not hold them all, and multiplied by a kernel that decodes its type's
//! blocks as it reads them (`shaders/matmul.wgsl` with the type's own file in front).

use std::borrow::Cow;
use std::sync::{Arc, OnceLock};

use candle_core::quantized::{GgmlDType, QTensor};
use shoal_model::gguf::GgmlType;

use super::context::{Bind, GpuContext};
use super::GpuAct;
use crate::weights::{Slice, WeightSource};
use crate::EngineError;

/// Activation rows one workgroup of the product takes (`TB` in `shaders/matmul.wgsl`).
const BASE_ROWS: u32 = 4;
/// The same for products over more than `BASE_ROWS` rows.
const WIDE_ROWS: u32 = 16;

/// One weight matrix on the GPU (see the module).
pub struct GpuMatrix {
    pub(super) ty: GgmlType,
    pub(super) rows: usize,
    pub(super) cols: usize,
    row_bytes: usize,
    /// Consecutive row ranges, each in its own buffer.
    chunks: Vec<(usize, usize, wgpu::Buffer)>,
    /// This type's pipelines, from the device's cache on first use: the product over
    /// `BASE_ROWS` and over `WIDE_ROWS` activation rows per workgroup, and the gather.
    pipelines: [OnceLock<Arc<wgpu::ComputePipeline>>; 3],
}

/// The WGSL of a weight type's block decoding, where the backend has it.
pub(super) fn type_source(ty: GgmlType) -> Option<&'static str> {
    Some(match ty {
        GgmlType::F32 => include_str!("shaders/f32.wgsl"),
        GgmlType::F16 => include_str!("shaders/f16.wgsl"),
        GgmlType::BF16 => include_str!("shaders/bf16.wgsl"),
        GgmlType::Q4_0 => include_str!("shaders/q4_0.wgsl"),
        GgmlType::Q4_1 => include_str!("shaders/q4_1.wgsl"),
        GgmlType::Q5_0 => include_str!("shaders/q5_0.wgsl"),
        GgmlType::Q5_1 => include_str!("shaders/q5_1.wgsl"),
        GgmlType::Q8_0 => include_str!("shaders/q8_0.wgsl"),
        GgmlType::Q2_K => include_str!("shaders/q2_k.wgsl"),
        GgmlType::Q3_K => include_str!("shaders/q3_k.wgsl"),
        GgmlType::Q4_K => include_str!("shaders/q4_k.wgsl"),
        GgmlType::Q5_K => include_str!("shaders/q5_k.wgsl"),
        GgmlType::Q6_K => include_str!("shaders/q6_k.wgsl"),
        GgmlType::MXFP4 => include_str!("shaders/mxfp4.wgsl"),
        _ => return None,
    })
}

/// The pipeline name of a type's products (a `'static` key for the pipeline cache).
fn pipeline_name(ty: GgmlType) -> &'static str {
    match ty {
        GgmlType::F32 => "matmul f32",
        GgmlType::F16 => "matmul f16",
        GgmlType::Q4_0 => "matmul q4_0",
        GgmlType::Q4_1 => "matmul q4_1",
        GgmlType::Q5_0 => "matmul q5_0",
        GgmlType::Q5_1 => "matmul q5_1",
        GgmlType::Q8_0 => "matmul q8_0",
        GgmlType::Q2_K => "matmul q2_k",
        GgmlType::Q3_K => "matmul q3_k",
        GgmlType::Q4_K => "matmul q4_k",
        GgmlType::Q5_K => "matmul q5_k",
        GgmlType::Q6_K => "matmul q6_k",
        GgmlType::BF16 => "matmul bf16",
        GgmlType::MXFP4 => "matmul mxfp4",
        _ => "matmul other",
    }
}

/// The file's type of a candle storage type.
fn ggml_type(t: GgmlDType) -> GgmlType {
    match t {
        GgmlDType::F32 => GgmlType::F32,
        GgmlDType::F16 => GgmlType::F16,
        GgmlDType::BF16 => GgmlType::BF16,
        GgmlDType::Q4_0 => GgmlType::Q4_0,
        GgmlDType::Q4_1 => GgmlType::Q4_1,
        GgmlDType::Q5_0 => GgmlType::Q5_0,
        GgmlDType::Q5_1 => GgmlType::Q5_1,
        GgmlDType::Q8_0 => GgmlType::Q8_0,
        GgmlDType::Q8_1 => GgmlType::Q8_1,
        GgmlDType::Q2K => GgmlType::Q2_K,
        GgmlDType::Q3K => GgmlType::Q3_K,
        GgmlDType::Q4K => GgmlType::Q4_K,
        GgmlDType::Q5K => GgmlType::Q5_K,
        GgmlDType::Q6K => GgmlType::Q6_K,
        GgmlDType::Q8K => GgmlType::Q8_K,
    }
}

impl GpuMatrix {
    /// Loads `slice` of matrix `name` from `src` onto the device: the file's bytes where
    /// the source hands them out, else the loaded tensor's.
    ///
    /// # Errors
    /// When the tensor is missing, not 2-D, or of a type the GPU kernels do not decode.
    pub(super) fn load(
        ctx: &GpuContext,
        src: &dyn WeightSource,
        name: &str,
        slice: &Slice,
    ) -> Result<Self, EngineError> {
        if let Some((ty, [rows, cols], bytes)) = src.load_bytes(name, slice)? {
            let m = Self::from_bytes(ctx, name, ty, rows, cols, &bytes)?;
            drop(bytes);
            src.release(name);
            return Ok(m);
        }
        let q = src.load(name, slice)?;
        Self::from_qtensor(ctx, name, &q)
    }

    /// Uploads a loaded tensor.
    ///
    /// # Errors
    /// As [`GpuMatrix::load`].
    pub(super) fn from_qtensor(
        ctx: &GpuContext,
        name: &str,
        q: &QTensor,
    ) -> Result<Self, EngineError> {
        let dims = q.shape().dims().to_vec();
        let [rows, cols] = dims[..] else {
            return Err(EngineError::BadSlice {
                tensor: name.into(),
                problem: format!("a matrix from a {}-D tensor", dims.len()),
            });
        };
        let data = q
            .data()
            .map_err(|e| EngineError::candle(format!("reading `{name}`"), e))?;
        Self::from_bytes(ctx, name, ggml_type(q.dtype()), rows, cols, &data)
    }

    /// Uploads `rows` rows of `cols` values of type `ty` stored in `bytes`.
    ///
    /// # Errors
    /// When the type has no GPU kernel or the bytes do not fit the shape.
    pub(super) fn from_bytes(
        ctx: &GpuContext,
        name: &str,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        bytes: &[u8],
    ) -> Result<Self, EngineError> {
        if type_source(ty).is_none() {
            return Err(EngineError::Unsupported {
                what: format!(
                    "tensor `{name}` has type {ty:?}, which the GPU backend cannot compute \
                     with yet; use --device cpu"
                ),
            });
        }
        if !cols.is_multiple_of(ty.block_len()) {
            return Err(EngineError::Load {
                what: format!("`{name}`: {cols} columns are not whole {ty:?} blocks"),
            });
        }
        let row_bytes = cols / ty.block_len() * ty.block_bytes();
        if bytes.len() != rows * row_bytes {
            return Err(EngineError::Load {
                what: format!(
                    "`{name}`: {} bytes for {rows} rows of {cols} {ty:?} values ({} expected)",
                    bytes.len(),
                    rows * row_bytes
                ),
            });
        }
        // rows per buffer: what one storage binding may hold
        let max = ctx
            .limits
            .max_storage_buffer_binding_size
            .min(ctx.limits.max_buffer_size) as usize;
        let per_chunk = (max / row_bytes.max(1)).max(1);
        let mut chunks = Vec::new();
        let mut r = 0;
        while r < rows {
            let n = per_chunk.min(rows - r);
            let buf = ctx.buffer_with(&bytes[r * row_bytes..(r + n) * row_bytes], name);
            chunks.push((r, n, buf));
            r += n;
        }
        Ok(GpuMatrix {
            ty,
            rows,
            cols,
            row_bytes,
            chunks,
            pipelines: Default::default(),
        })
    }

    /// The pipeline of `entry` for this type, with `rows` activation rows per workgroup
    /// (kept by the matrix: a product looks nothing up).
    fn pipeline(
        &self,
        ctx: &GpuContext,
        entry: &'static str,
        rows: u32,
    ) -> Arc<wgpu::ComputePipeline> {
        let slot = match (entry, rows) {
            ("gather", _) => 2,
            (_, BASE_ROWS) => 0,
            _ => 1,
        };
        self.pipelines[slot]
            .get_or_init(|| self.build_pipeline(ctx, entry, rows))
            .clone()
    }

    fn build_pipeline(
        &self,
        ctx: &GpuContext,
        entry: &'static str,
        rows: u32,
    ) -> Arc<wgpu::ComputePipeline> {
        let ty = self.ty;
        let name: Cow<'static, str> = if rows == BASE_ROWS {
            pipeline_name(ty).into()
        } else {
            format!("{} x{rows}", pipeline_name(ty)).into()
        };
        ctx.pipeline(name, entry, || {
            format!(
                "{}\n{}",
                include_str!("shaders/matmul.wgsl").replace(
                    &format!("const TB: u32 = {BASE_ROWS}u;"),
                    &format!("const TB: u32 = {rows}u;")
                ),
                type_source(ty).unwrap_or_default()
            )
        })
    }

    /// `y = x W^T`: `x` holds rows of [`GpuMatrix::cols`] values; `y` becomes as many rows
    /// of [`GpuMatrix::rows`] values.
    ///
    /// # Errors
    /// When `x` is not a whole number of rows.
    pub(super) fn matmul(
        &self,
        ctx: &GpuContext,
        x: &GpuAct,
        y: &mut GpuAct,
    ) -> Result<(), EngineError> {
        if self.cols == 0 || !x.len.is_multiple_of(self.cols) {
            return Err(EngineError::Internal {
                what: format!(
                    "GPU matmul: {} input values are not rows of {}",
                    x.len, self.cols
                ),
            });
        }
        let t = x.len / self.cols;
        y.resize(ctx, t * self.rows);
        // more activation rows per workgroup where there are many: fewer reads of each
        // weight row
        let per_group = if t > BASE_ROWS as usize {
            WIDE_ROWS
        } else {
            BASE_ROWS
        };
        let pipe = self.pipeline(ctx, "matmul", per_group);
        let blocks = self.cols / self.ty.block_len();
        for (first, n, buf) in &self.chunks {
            ctx.dispatch(
                &pipe,
                &[
                    *n as u32,
                    self.cols as u32,
                    t as u32,
                    self.row_bytes as u32,
                    blocks as u32,
                    *first as u32,
                    self.rows as u32,
                    0,
                ],
                &[Bind::Whole(buf), Bind::Whole(x.buf()), Bind::Whole(y.buf())],
                [
                    (*n as u32).min(65535),
                    (*n as u32).div_ceil(65535),
                    (t as u32).div_ceil(per_group),
                ],
            );
        }
        Ok(())
    }

    /// Rows `ids[i]` (rows of the whole matrix; those outside it give zeros) times `scale`
    /// into row `i` of `out`.
    pub(super) fn gather(&self, ctx: &GpuContext, ids: &[u32], scale: f32, out: &mut GpuAct) {
        out.resize(ctx, ids.len() * self.cols);
        ctx.fill_zero(out.buf(), out.len * 4);
        let idx = ctx.buffer_with(bytemuck::cast_slice(ids), "ids");
        let pipe = self.pipeline(ctx, "gather", BASE_ROWS);
        for (first, n, buf) in &self.chunks {
            ctx.dispatch(
                &pipe,
                &[
                    *n as u32,
                    self.cols as u32,
                    ids.len() as u32,
                    self.row_bytes as u32,
                    (self.cols / self.ty.block_len()) as u32,
                    *first as u32,
                    self.rows as u32,
                    scale.to_bits(),
                ],
                &[Bind::Whole(buf), Bind::Whole(&idx), Bind::Whole(out.buf())],
                [(self.cols as u32).div_ceil(64), ids.len() as u32, 1],
            );
        }
    }
}
