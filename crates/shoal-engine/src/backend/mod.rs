//! The seam between the network and the hardware it runs on. A [`Backend`] owns where
//! weights and activations live and how each operation a transformer block needs is
//! computed: quantized matrix products over a batch of rows, RMSNorm, RoPE, attention over
//! its own KV cache layout, the gated activation, residual adds, embedding lookups, and the
//! host buffers collectives read and write. The blocks (`crate::network`) are written once
//! over this trait; [`cpu::Cpu`] implements it with shoal's kernels and thread team, and
//! [`gpu::Gpu`] with WGSL kernels through wgpu.
//!
//! Activations are rows of `f32` values ([`Backend::Act`]); an operation's widths come from
//! its weights (a matrix's columns and rows, a norm's length), and the number of rows from
//! its input. A step's rows belong to one or more sequences ([`StepRows`]): a prefill chunk
//! is one sequence of many rows, a batched decode step one row of each of several
//! sequences, and any mix of the two is one step.

pub mod cpu;
pub mod gpu;

use std::ops::Range;
use std::sync::Arc;

use shoal_comm::Communicator;

use crate::config::{Activation, RopeStyle};
use crate::weights::{Slice, WeightSource};
use crate::EngineError;

/// What a block's operations run on. See the module.
pub trait Backend: Clone + Send + Sync + Sized + 'static {
    /// Activations: rows of `f32` values in this backend's memory, sized by the operation
    /// that writes them.
    type Act: Send + Default;
    /// A weight matrix `[rows, cols]` (any stored type) ready for products.
    type Matrix: Send + Sync;
    /// A feed-forward's gate and up projections, ready for the gated product.
    type GateUp: Send + Sync;
    /// A weight vector (a norm's scale, a bias) in `f32`.
    type Vector: Send + Sync;
    /// One sequence's keys and values for the layers a rank holds.
    type Kv: Send + 'static;
    /// Values derived from a step's positions that its layers share (RoPE tables).
    type Tables: Send + Default;
    /// The routed experts of one layer that a rank holds.
    type Experts: Send + Sync;

    /// The backend's name, for logs and errors.
    fn name(&self) -> &'static str;

    /// Loads `slice` of the matrix `name` from `src`.
    ///
    /// # Errors
    /// When the tensor is missing, misshapen, of an unsupported type, or cannot be cut so.
    fn matrix(
        &self,
        src: &dyn WeightSource,
        name: &str,
        slice: &Slice,
    ) -> Result<Self::Matrix, EngineError>;

    /// Gate and up projections (the same shape) held for [`Backend::gated`].
    fn gate_up(&self, gate: Self::Matrix, up: Self::Matrix) -> Self::GateUp;

    /// A weight vector holding `values`.
    fn vector(&self, values: Vec<f32>) -> Self::Vector;

    /// Empty KV storage for one sequence: `layers` layers laid out as `layout` says, room
    /// for `capacity` positions.
    fn kv(&self, layers: usize, layout: KvLayout, capacity: usize) -> Self::Kv;

    /// A layer's routed experts from the ones this rank holds, of `n_expert` in all.
    fn experts(&self, held: Vec<HeldExpert<Self>>, n_expert: usize) -> Self::Experts;

    /// Whether this backend can run a model of `cfg` (every architecture on the CPU).
    ///
    /// # Errors
    /// Says what the backend lacks for it.
    fn supports(&self, _cfg: &crate::ModelConfig) -> Result<(), EngineError> {
        Ok(())
    }

    /// Says every weight of a model is loaded: a device backend finds out here whether
    /// they all fit.
    ///
    /// # Errors
    /// When they did not (say by how much where the device says so).
    fn loaded(&self) -> Result<(), EngineError> {
        Ok(())
    }

    /// What the device has done so far, where the backend runs on one.
    fn counters(&self) -> Option<crate::device::GpuCounters> {
        None
    }

    /// Values of `x` on the host (small activations the network decides on, such as a
    /// router's logits).
    ///
    /// # Errors
    /// When the device that holds them failed.
    fn host<'a>(&self, x: &'a Self::Act) -> Result<std::borrow::Cow<'a, [f32]>, EngineError>;

    /// Copies the first `positions` positions of every layer of `from` into `to` (whose
    /// capacity is at least as large).
    ///
    /// # Errors
    /// When the two caches' layouts differ or `to` has no room.
    fn copy_kv(
        &self,
        from: &Self::Kv,
        to: &mut Self::Kv,
        positions: usize,
    ) -> Result<(), EngineError>;

    /// Host values as activations.
    fn upload(&self, host: Vec<f32>) -> Self::Act;

    /// Activations as host values.
    ///
    /// # Errors
    /// When the device that holds them failed.
    fn download(&self, act: Self::Act) -> Result<Vec<f32>, EngineError>;

    /// Sums `x` over the ranks of `comm` (every rank gets the same values).
    ///
    /// # Errors
    /// When a peer fails or misses the deadline.
    fn all_reduce(&self, comm: &dyn Communicator, x: &mut Self::Act) -> Result<(), EngineError>;

    /// Row `ids[i] - rows.start` of `table` (which holds vocabulary rows `rows`) times
    /// `scale` into row `i` of `out`, zeros for ids outside `rows`.
    ///
    /// # Errors
    /// When the table cannot be read row by row.
    fn embed(
        &self,
        table: &Self::Matrix,
        rows: Range<usize>,
        ids: &[u32],
        scale: f32,
        out: &mut Self::Act,
    ) -> Result<(), EngineError>;

    /// `outs[i] = x W_i^T` for every matrix (the same columns), the input read once.
    ///
    /// # Errors
    /// When `x` is not a whole number of rows of the matrices' columns.
    fn matmul(
        &self,
        mats: &[&Self::Matrix],
        x: &Self::Act,
        outs: &mut [&mut Self::Act],
    ) -> Result<(), EngineError>;

    /// Adds `bias` to every row of `y`.
    fn add_bias(&self, y: &mut Self::Act, bias: &Self::Vector);

    /// `act(x G^T) * (x U^T)` into `out`.
    ///
    /// # Errors
    /// When `x` is not a whole number of rows of the pair's columns.
    fn gated(
        &self,
        gate_up: &Self::GateUp,
        act: Activation,
        x: &Self::Act,
        out: &mut Self::Act,
    ) -> Result<(), EngineError>;

    /// Every row of `x` (rows as long as `w`) normalised: `x / sqrt(mean(x^2) + eps) * w`.
    fn rms_norm(&self, x: &Self::Act, w: &Self::Vector, eps: f32, out: &mut Self::Act);

    /// [`Backend::rms_norm`] in place.
    fn rms_norm_in_place(&self, x: &mut Self::Act, w: &Self::Vector, eps: f32);

    /// The residual add `x += a`, and `out` = `x` normalised by `w`.
    fn add_rms_norm(
        &self,
        x: &mut Self::Act,
        a: &Self::Act,
        w: &Self::Vector,
        eps: f32,
        out: &mut Self::Act,
    );

    /// The residual add `x += a`.
    fn add(&self, x: &mut Self::Act, a: &Self::Act);

    /// Starts a step over `rows`: the tables of the last step no longer hold.
    fn begin_step(&self, rows: &StepRows, tables: &mut Self::Tables);

    /// Rotates every head (`head_dim` values) of every row of `x` by its row's position.
    fn rope(&self, x: &mut Self::Act, rope: &Rope, rows: &StepRows, tables: &mut Self::Tables);

    /// Says that attention of `layer` will read the caches of `rows` soon (before the
    /// step's q/k/v products, so a backend may start fetching them).
    fn prefetch_kv(&self, _kv: &[&mut Self::Kv], _layer: usize, _heads: &Heads, _rows: &StepRows) {}

    /// Appends keys `k` and values `v` (rows of `heads.kv_heads()` heads) to each
    /// sequence's cache at its position, then attends: row `i` of `q` (its query heads) over
    /// the cached keys its sequence sees at its position, into row `i` of `out`.
    ///
    /// # Errors
    /// When a sequence's cache has no room for its rows.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &Self::Act,
        k: &Self::Act,
        v: &Self::Act,
        kv: &mut [&mut Self::Kv],
        layer: usize,
        heads: &Heads,
        rows: &StepRows,
        out: &mut Self::Act,
    ) -> Result<(), EngineError>;

    /// The routed experts' part of a mixture-of-experts feed-forward: row `r` of `out` is
    /// the sum over its routes `(e, w)` of `w * down_e(act(gate_e x_r) * up_e x_r)` (each
    /// product plus its [`ExpertBias`] where the expert has one), over
    /// the experts this rank holds (zero where it holds none of a row's).
    ///
    /// # Errors
    /// When `x` and the routes do not agree.
    fn moe(
        &self,
        experts: &Self::Experts,
        act: Activation,
        x: &Self::Act,
        routes: &Routes,
        out: &mut Self::Act,
    ) -> Result<(), EngineError>;

    /// Multi-head latent attention (DeepSeek V2/V3) from the step's queries `q` (rows of
    /// `n_head` heads of `nope_dims + rope_dims`) and the projected latents `kv_a` (rows of
    /// `kv_lora_rank + rope_dims`): the latent normed, the rope parts rotated, the rows'
    /// latents and rope keys written to each sequence's cache, each head's query absorbed
    /// through its key matrix, attention over the cached latents as one shared head, and
    /// each head's result taken out through its value matrix, into `out` (rows of `n_head`
    /// heads of `v_dims`).
    ///
    /// # Errors
    /// When a sequence's cache has no room for its rows.
    #[allow(clippy::too_many_arguments)]
    fn latent_attention(
        &self,
        q: &Self::Act,
        kv_a: &Self::Act,
        layer: &LatentLayer<Self>,
        kv: &mut [&mut Self::Kv],
        cache_layer: usize,
        rows: &StepRows,
        tables: &mut Self::Tables,
        out: &mut Self::Act,
    ) -> Result<(), EngineError>;

    /// Rows `which` of `x` (rows of `width` values) into `out`, in that order.
    fn select_rows(&self, x: &Self::Act, width: usize, which: &[usize], out: &mut Self::Act);

    /// Runs one step of a model this process holds whole: `decode` when every sequence
    /// adds one row. The backend decides where and on how many threads it runs; a rank of
    /// a split model runs its steps in place instead (it waits for peers inside a step).
    fn run_step<R: Send>(&self, decode: bool, f: impl FnOnce() -> R + Send) -> R;
}

/// One routed expert as a rank holds it.
pub struct HeldExpert<B: Backend> {
    /// Its id.
    pub id: usize,
    /// Its gate and up projections (the rank's features).
    pub gate_up: B::GateUp,
    /// Its down projection (the rank's input columns).
    pub down: B::Matrix,
    /// Its biases, where the model has them (gpt-oss).
    pub bias: Option<ExpertBias>,
}

/// The biases of one routed expert: added to its gate and up products before the
/// activation, and to its down product before its routing weight scales it.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertBias {
    /// Gate bias of the rank's features.
    pub gate: Vec<f32>,
    /// Up bias of the rank's features.
    pub up: Vec<f32>,
    /// Down bias (whole), on the one rank of a feature split that adds it; `None` on the
    /// others, whose partial sums must not count it again.
    pub down: Option<Vec<f32>>,
}

/// How one sequence's KV cache lays out a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvLayout {
    /// Keys and values of `kv_heads` heads of `head_dim` each.
    Heads {
        /// KV heads the rank holds.
        kv_heads: usize,
        /// Values per head.
        head_dim: usize,
    },
    /// One latent of `dims` values per position (MLA: the key/value latent and the rope
    /// key), from which keys and values are both read.
    Latent {
        /// Values per position.
        dims: usize,
    },
}

/// Where each row of a step goes in a mixture of experts: `k` routes per row, each an
/// expert and its weight.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Routes {
    /// Routes per row.
    pub k: usize,
    /// The experts, `k` per row.
    pub experts: Vec<u32>,
    /// Their weights, `k` per row.
    pub weights: Vec<f32>,
}

impl Routes {
    /// Rows routed.
    pub fn rows(&self) -> usize {
        self.experts.len().checked_div(self.k).unwrap_or(0)
    }
}

/// One layer of multi-head latent attention as a rank holds it: what
/// [`Backend::latent_attention`] needs besides the step's projections.
pub struct LatentLayer<B: Backend> {
    /// Norm of the latent.
    pub kv_norm: B::Vector,
    /// Its epsilon.
    pub eps: f32,
    /// Per local head: its keys from the latent, `[kv_lora_rank, nope_dims]`.
    pub k_b: Vec<B::Matrix>,
    /// Per local head: its values from the latent, `[v_dims, kv_lora_rank]`.
    pub v_b: Vec<B::Matrix>,
    /// RoPE of the rope parts.
    pub rope: Rope,
    /// Query heads this rank holds.
    pub n_head: usize,
    /// Rank of the latent.
    pub kv_lora_rank: usize,
    /// Dimensions of a head carrying RoPE.
    pub rope_dims: usize,
    /// Dimensions of a head's key without RoPE.
    pub nope_dims: usize,
    /// Dimensions of a head's value.
    pub v_dims: usize,
    /// Score scale.
    pub scale: f32,
}

/// The rows of one step: each sequence's rows are consecutive, at positions after what
/// its cache holds.
#[derive(Debug, Clone, Default)]
pub struct StepRows {
    /// Per sequence, in order: its rows of the step.
    pub seqs: Vec<SeqRows>,
    /// The position of every row.
    pub positions: Vec<usize>,
}

/// One sequence's rows of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqRows {
    /// Its rows of the step.
    pub rows: Range<usize>,
    /// The position of its first row (the positions its cache held before the step).
    pub start: usize,
}

impl StepRows {
    /// Rows for sequences that add `counts[i]` rows after `starts[i]` cached positions.
    #[cfg(test)]
    pub fn new(counts: &[usize], starts: &[usize]) -> Self {
        let mut s = StepRows::default();
        s.reset(counts, starts);
        s
    }

    /// Makes these the rows of another step (keeping the buffers).
    pub fn reset(&mut self, counts: &[usize], starts: &[usize]) {
        self.seqs.clear();
        self.positions.clear();
        let mut row = 0;
        for (&n, &start) in counts.iter().zip(starts) {
            self.seqs.push(SeqRows {
                rows: row..row + n,
                start,
            });
            self.positions.extend(start..start + n);
            row += n;
        }
    }

    /// Rows in the step.
    pub fn len(&self) -> usize {
        self.positions.len()
    }

    /// Whether every sequence adds one row (a decode step).
    pub fn is_decode(&self) -> bool {
        self.seqs.iter().all(|s| s.rows.len() == 1)
    }
}

/// How one layer rotates queries and keys.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    /// How dimensions pair up.
    pub style: RopeStyle,
    /// Values per head.
    pub head_dim: usize,
    /// Dimensions of each head rotated, the first ones (`head_dim` for the whole head); the
    /// frequencies are spread over these.
    pub dims: usize,
    /// Base frequency.
    pub base: f64,
    /// Linear position scaling (1 = none): positions are divided by it.
    pub scale: f64,
    /// Per-pair divisors of the frequencies (Llama 3.1's `rope_freqs`), `head_dim / 2` long.
    pub freq_factors: Option<Arc<[f32]>>,
    /// YaRN's interpolation, where the model scales so.
    pub yarn: Option<YarnRope>,
}

/// YaRN's part of a rotation (ggml's `rope_yarn`): pair `i` mixes the interpolated angle
/// (`freq_scale = 1 / scale` of the original) with the extrapolated one by a ramp over the
/// pairs between `corr_low` and `corr_high`, and cosines and sines are multiplied by `mscale`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct YarnRope {
    /// Extrapolation factor of the ramp.
    pub ext_factor: f32,
    /// First pair of the ramp.
    pub corr_low: f32,
    /// Last pair of the ramp.
    pub corr_high: f32,
    /// Multiplier of cosines and sines.
    pub mscale: f32,
}

impl YarnRope {
    /// YaRN's part for `yarn` over `dims` rotated dimensions of base `base` and scale
    /// `scale`.
    pub fn new(yarn: &crate::config::YarnConfig, dims: usize, base: f64, scale: f64) -> Self {
        let corr = |beta: f32| -> f32 {
            dims as f32 * (yarn.original_context as f32 / (beta * 2.0 * std::f32::consts::PI)).ln()
                / (2.0 * (base as f32).ln())
        };
        let low = corr(yarn.beta_fast).floor().max(0.0);
        let high = corr(yarn.beta_slow).ceil().min(dims as f32 - 1.0);
        let mut mscale = yarn.attn_factor;
        if yarn.ext_factor != 0.0 {
            mscale *= 1.0 + 0.1 * (scale as f32).ln();
        }
        YarnRope {
            ext_factor: yarn.ext_factor,
            corr_low: low,
            corr_high: high,
            mscale,
        }
    }
}

/// The query heads a rank holds in one layer and the KV heads they read.
#[derive(Debug, Clone, PartialEq)]
pub struct Heads {
    /// Query heads of this rank.
    pub n_head: usize,
    /// Global index of its first query head.
    pub first_head: usize,
    /// KV heads of this rank.
    pub n_kv_head: usize,
    /// Global index of its first KV head.
    pub first_kv: usize,
    /// Query heads per KV head in the whole model.
    pub group: usize,
    /// Values per head.
    pub head_dim: usize,
    /// Keys `window` or more positions back are not seen (sliding-window layers).
    pub window: Option<usize>,
    /// Score scale.
    pub scale: f32,
    /// Per query head of this rank, a logit that joins its softmax without a value
    /// (gpt-oss's attention sinks): the weights of the real keys then sum to less than one.
    pub sinks: Option<Arc<[f32]>>,
}
