//! The GPU backend: every operation of [`Backend`] as a WGSL compute kernel run through
//! wgpu, so one implementation runs on Vulkan (NVIDIA, AMD, Intel), Metal (every Mac) and
//! DX12, and on Mesa's software Vulkan driver (lavapipe), where the tests check it against
//! the CPU backend. Weights are uploaded once in their file's own quantization
//! ([`matrix`]); activations and the KV cache live on the device; a step's kernels are
//! recorded into one command encoder ([`context`]) and submitted when the host reads
//! values back: the logits at a step's end, a router's logits, or a collective's input.

pub mod adapters;
pub mod context;
mod latent;
pub mod matrix;
#[cfg(test)]
mod op_tests;
mod probe;
#[cfg(test)]
mod type_tests;

use std::borrow::Cow;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use shoal_comm::Communicator;

use self::context::{Bind, GpuContext};
use self::matrix::GpuMatrix;
use super::cpu::rope::{fill as rope_fill, key as rope_key, Key as RopeKey};
use super::{Backend, Heads, HeldExpert, KvLayout, LatentLayer, Rope, Routes, StepRows};
use crate::config::{Activation, RopeStyle};
use crate::weights::{Slice, WeightSource};
use crate::EngineError;

/// Rows of `f32` values on the device: the first `len` values of `buf` (whose capacity
/// may be larger, kept from step to step).
#[derive(Default)]
pub struct GpuAct {
    buf: Option<wgpu::Buffer>,
    /// Values held.
    pub(super) len: usize,
}

impl GpuAct {
    /// The buffer (an empty activation has a one-word buffer once resized).
    pub(super) fn buf(&self) -> &wgpu::Buffer {
        self.buf
            .as_ref()
            .expect("a GPU activation is resized before it is bound")
    }

    /// Makes room for `n` values (a new buffer when the old one is too small; its values
    /// are then undefined) and sets the length.
    pub(super) fn resize(&mut self, ctx: &GpuContext, n: usize) {
        let cap = self.buf.as_ref().map_or(0, |b| b.size() as usize / 4);
        if self.buf.is_none() || cap < n {
            self.buf = Some(ctx.buffer(n.max(1).next_power_of_two() * 4, "activation"));
        }
        self.len = n;
    }

    /// An activation holding `values`.
    pub(super) fn from_host(ctx: &GpuContext, values: &[f32]) -> Self {
        GpuAct {
            buf: Some(ctx.buffer_with(bytemuck::cast_slice(values), "activation")),
            len: values.len(),
        }
    }

    /// The values, read back.
    ///
    /// # Errors
    /// When the device failed.
    pub(super) fn to_host(&self, ctx: &GpuContext) -> Result<Vec<f32>, crate::EngineError> {
        if self.len == 0 {
            return Ok(Vec::new());
        }
        let bytes = ctx.read(self.buf(), self.len * 4)?;
        Ok(bytemuck::cast_slice(&bytes).to_vec())
    }
}

/// The GPU backend on one device (see the module).
#[derive(Clone)]
pub struct Gpu {
    pub(super) ctx: Arc<GpuContext>,
    /// Activations products borrow for their intermediate values.
    scratch: Arc<Mutex<Vec<GpuAct>>>,
    /// Device copies of attention sink logits, each beside the host values it was made from
    /// (held, so no other values take their address while the entry lives).
    sinks: Arc<Mutex<Vec<SinkCopy>>>,
}

/// A layer's attention sink logits on the host and their copy on the device.
type SinkCopy = (Arc<[f32]>, wgpu::Buffer);

impl Gpu {
    /// The backend on GPU adapter `index` (see [`adapters::adapters`]).
    ///
    /// # Errors
    /// When there is no such adapter or it refuses a device.
    pub fn open(index: usize) -> Result<Self, EngineError> {
        Ok(Gpu {
            ctx: adapters::open(index)?,
            scratch: Arc::default(),
            sinks: Arc::default(),
        })
    }

    /// The device's read bandwidth, GB/s (see [`probe`]).
    ///
    /// # Errors
    /// When the device fails.
    pub fn read_bandwidth(&self) -> Result<f64, EngineError> {
        probe::read_bandwidth(&self.ctx, 20, 3)
    }

    /// The device's throughput on prefill's matrix products, GFLOP/s (see [`probe`]).
    ///
    /// # Errors
    /// When the device fails.
    pub fn matmul_gflops(&self) -> Result<f64, EngineError> {
        probe::matmul_gflops(&self.ctx, 8, 3)
    }

    /// The adapter's name and API.
    pub fn describe(&self) -> String {
        self.ctx.describe()
    }

    fn kernel(
        &self,
        name: &'static str,
        entry: &'static str,
        src: &'static str,
    ) -> Arc<wgpu::ComputePipeline> {
        self.ctx.pipeline(name, entry, || src.to_string())
    }

    /// The device copy of a layer's attention sink logits, uploaded on first use.
    fn sinks(&self, host: &Arc<[f32]>) -> wgpu::Buffer {
        let mut cache = self.sinks.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, b)) = cache.iter().find(|(h, _)| Arc::ptr_eq(h, host)) {
            return b.clone();
        }
        // entries whose model is gone (the cache holds their last reference) go first
        cache.retain(|(h, _)| Arc::strong_count(h) > 1);
        let b = self.ctx.buffer_with(bytemuck::cast_slice(host), "sinks");
        cache.push((host.clone(), b.clone()));
        b
    }

    /// Workgroups for `n` items of `per` each, folded into two dimensions.
    fn groups(n: usize, per: usize) -> [u32; 3] {
        let g = n.div_ceil(per) as u32;
        [g.min(65535), g.div_ceil(65535), 1]
    }

    /// Activations for a product's scratch, taken from the pool.
    fn scratch(&self) -> GpuAct {
        self.scratch
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
            .unwrap_or_default()
    }

    /// Gives scratch activations back to the pool.
    fn give_back(&self, acts: impl IntoIterator<Item = GpuAct>) {
        self.scratch
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(acts);
    }

    fn rms_into(&self, x: &GpuAct, w: &GpuVector, eps: f32, out: &mut GpuAct) {
        let width = w.len.max(1);
        let rows = x.len / width;
        out.resize(&self.ctx, x.len);
        let pipe = self.kernel(
            "rms_norm",
            "rms_norm",
            concat!(
                include_str!("shaders/norm.wgsl"),
                include_str!("shaders/norm_rms.wgsl")
            ),
        );
        self.ctx.dispatch(
            &pipe,
            &[width as u32, eps.to_bits()],
            &[
                Bind::Whole(x.buf()),
                Bind::Whole(w.act.buf()),
                Bind::Whole(out.buf()),
            ],
            [(rows as u32).min(65535), (rows as u32).div_ceil(65535), 1],
        );
    }

    fn gated_from(&self, g: &GpuAct, u: &GpuAct, act: Activation, out: &mut GpuAct) {
        out.resize(&self.ctx, g.len);
        let pipe = self.kernel("gated", "gated", include_str!("shaders/gated.wgsl"));
        let code = match act {
            Activation::Silu => 0,
            Activation::GeluTanh => 1,
            Activation::SwigluOai => 2,
        };
        self.ctx.dispatch(
            &pipe,
            &[g.len as u32, code],
            &[
                Bind::Whole(g.buf()),
                Bind::Whole(u.buf()),
                Bind::Whole(out.buf()),
            ],
            Self::groups(g.len, 256),
        );
    }
}

/// A feed-forward's gate and up projections.
pub struct GpuGateUp {
    gate: GpuMatrix,
    up: GpuMatrix,
}

/// A weight vector on the device.
pub struct GpuVector {
    act: GpuAct,
    len: usize,
}

/// One sequence's keys and values on the device: per layer a key and a value buffer of
/// f16 pairs, `[kv head][position][head_dim / 2]` words.
pub struct GpuKv {
    layers: Vec<(wgpu::Buffer, wgpu::Buffer)>,
    layout: KvLayout,
    capacity: usize,
}

/// A step's RoPE tables on the device, one per kind of rotation, made on first use.
#[derive(Default)]
pub struct GpuTables {
    tables: Vec<(RopeKey, wgpu::Buffer)>,
}

/// The routed experts a rank holds of one layer: `(gate/up, down)` by expert id.
pub struct GpuExperts {
    held: Vec<Option<GpuExpert>>,
}

/// One routed expert on the device: its gate and up projections, its down projection and
/// its biases where the model has them (gpt-oss; see [`crate::backend::ExpertBias`]).
struct GpuExpert {
    gate_up: GpuGateUp,
    down: GpuMatrix,
    bias: Option<GpuExpertBias>,
}

/// [`crate::backend::ExpertBias`] on the device.
struct GpuExpertBias {
    gate: GpuVector,
    up: GpuVector,
    down: Option<GpuVector>,
}

impl Backend for Gpu {
    type Act = GpuAct;
    type Matrix = GpuMatrix;
    type GateUp = GpuGateUp;
    type Vector = GpuVector;
    type Kv = GpuKv;
    type Tables = GpuTables;
    type Experts = GpuExperts;

    fn name(&self) -> &'static str {
        "gpu"
    }

    fn loaded(&self) -> Result<(), EngineError> {
        // uploads are recorded copies and buffer creations report running out of memory
        // through the device's error callback: run them, then look
        self.ctx.submit();
        self.ctx.wait();
        self.ctx.check().map_err(|e| EngineError::Load {
            what: format!(
                "{e} (loading the model onto the GPU; a model larger than the GPU's memory \
                 can be cut: --gpu-layers N puts its first N layers on the GPU and the rest \
                 on the CPU, --gpu-layers auto as many as its memory is known to hold; or \
                 use --device cpu)"
            ),
        })
    }

    fn counters(&self) -> Option<context::GpuCounters> {
        Some(self.ctx.counters())
    }

    fn supports(&self, cfg: &crate::ModelConfig) -> Result<(), EngineError> {
        if let Some(m) = &cfg.mla {
            let dims = m.kv_lora_rank + m.rope_dims;
            if dims > latent::MAX_DIMS || !dims.is_multiple_of(2) {
                return Err(EngineError::Unsupported {
                    what: format!(
                        "latents of {dims} values: the GPU latent attention takes an even \
                         number up to {}; use --device cpu",
                        latent::MAX_DIMS
                    ),
                });
            }
        } else if cfg.head_dim > 256 {
            return Err(EngineError::Unsupported {
                what: format!(
                    "heads of {} values: the GPU attention kernel takes at most 256; use \
                     --device cpu",
                    cfg.head_dim
                ),
            });
        }
        Ok(())
    }

    fn matrix(
        &self,
        src: &dyn WeightSource,
        name: &str,
        slice: &Slice,
    ) -> Result<GpuMatrix, EngineError> {
        GpuMatrix::load(&self.ctx, src, name, slice)
    }

    fn gate_up(&self, gate: GpuMatrix, up: GpuMatrix) -> GpuGateUp {
        GpuGateUp { gate, up }
    }

    fn vector(&self, values: Vec<f32>) -> GpuVector {
        GpuVector {
            len: values.len(),
            act: GpuAct::from_host(&self.ctx, &values),
        }
    }

    fn kv(&self, layers: usize, layout: KvLayout, capacity: usize) -> GpuKv {
        let words = match layout {
            KvLayout::Heads { kv_heads, head_dim } => kv_heads * capacity * head_dim / 2,
            // one latent per position; the value buffers stay unused
            KvLayout::Latent { dims } => capacity * dims / 2,
        };
        GpuKv {
            layers: (0..layers)
                .map(|_| {
                    (
                        self.ctx.buffer(words * 4, "keys"),
                        self.ctx.buffer(words * 4, "values"),
                    )
                })
                .collect(),
            layout,
            capacity,
        }
    }

    fn experts(&self, held: Vec<HeldExpert<Gpu>>, n_expert: usize) -> GpuExperts {
        let mut slots: Vec<Option<GpuExpert>> = (0..n_expert).map(|_| None).collect();
        for x in held {
            if let Some(slot) = slots.get_mut(x.id) {
                let bias = x.bias.map(|b| GpuExpertBias {
                    gate: self.vector(b.gate),
                    up: self.vector(b.up),
                    down: b.down.map(|d| self.vector(d)),
                });
                *slot = Some(GpuExpert {
                    gate_up: x.gate_up,
                    down: x.down,
                    bias,
                });
            }
        }
        GpuExperts { held: slots }
    }

    fn host<'a>(&self, x: &'a GpuAct) -> Result<Cow<'a, [f32]>, EngineError> {
        Ok(Cow::Owned(x.to_host(&self.ctx)?))
    }

    fn copy_kv(&self, from: &GpuKv, to: &mut GpuKv, positions: usize) -> Result<(), EngineError> {
        if from.layout != to.layout || positions > to.capacity || positions > from.capacity {
            return Err(EngineError::Internal {
                what: format!(
                    "copying {positions} positions from a {:?} cache of {} to a {:?} cache of {}",
                    from.layout, from.capacity, to.layout, to.capacity
                ),
            });
        }
        let (kv_heads, row) = match from.layout {
            KvLayout::Heads { kv_heads, head_dim } => (kv_heads, (head_dim / 2 * 4) as u64),
            // one "head" of latents, no values
            KvLayout::Latent { dims } => (1, (dims / 2 * 4) as u64),
        };
        let latent = matches!(from.layout, KvLayout::Latent { .. });
        for ((fk, fv), (tk, tv)) in from.layers.iter().zip(&to.layers) {
            for h in 0..kv_heads as u64 {
                let (src, dst) = (h * from.capacity as u64 * row, h * to.capacity as u64 * row);
                self.ctx.copy(fk, src, tk, dst, positions as u64 * row);
                if !latent {
                    self.ctx.copy(fv, src, tv, dst, positions as u64 * row);
                }
            }
        }
        Ok(())
    }

    fn upload(&self, host: Vec<f32>) -> GpuAct {
        GpuAct::from_host(&self.ctx, &host)
    }

    fn download(&self, act: GpuAct) -> Result<Vec<f32>, EngineError> {
        act.to_host(&self.ctx)
    }

    fn all_reduce(&self, comm: &dyn Communicator, x: &mut GpuAct) -> Result<(), EngineError> {
        if comm.world_size() == 1 {
            return Ok(());
        }
        let mut values = x.to_host(&self.ctx)?;
        comm.all_reduce_sum(&mut values)?;
        self.ctx.write(x.buf(), bytemuck::cast_slice(&values));
        Ok(())
    }

    fn embed(
        &self,
        table: &GpuMatrix,
        rows: Range<usize>,
        ids: &[u32],
        scale: f32,
        out: &mut GpuAct,
    ) -> Result<(), EngineError> {
        // ids outside `rows` point past the table and read as zeros
        let local: Vec<u32> = ids
            .iter()
            .map(|&id| {
                let id = id as usize;
                if rows.contains(&id) {
                    (id - rows.start) as u32
                } else {
                    u32::MAX
                }
            })
            .collect();
        table.gather(&self.ctx, &local, scale, out);
        Ok(())
    }

    fn matmul(
        &self,
        mats: &[&GpuMatrix],
        x: &GpuAct,
        outs: &mut [&mut GpuAct],
    ) -> Result<(), EngineError> {
        for (m, out) in mats.iter().zip(outs.iter_mut()) {
            m.matmul(&self.ctx, x, out)?;
        }
        Ok(())
    }

    fn add_bias(&self, y: &mut GpuAct, bias: &GpuVector) {
        if bias.len == 0 {
            return;
        }
        let pipe = self.kernel("add", "add_bias", include_str!("shaders/add.wgsl"));
        self.ctx.dispatch(
            &pipe,
            &[y.len as u32, bias.len as u32],
            &[Bind::Whole(y.buf()), Bind::Whole(bias.act.buf())],
            Self::groups(y.len, 256),
        );
    }

    fn gated(
        &self,
        gate_up: &GpuGateUp,
        act: Activation,
        x: &GpuAct,
        out: &mut GpuAct,
    ) -> Result<(), EngineError> {
        let (mut g, mut u) = (self.scratch(), self.scratch());
        let result = gate_up
            .gate
            .matmul(&self.ctx, x, &mut g)
            .and_then(|()| gate_up.up.matmul(&self.ctx, x, &mut u));
        if result.is_ok() {
            self.gated_from(&g, &u, act, out);
        }
        self.give_back([g, u]);
        result
    }

    fn rms_norm(&self, x: &GpuAct, w: &GpuVector, eps: f32, out: &mut GpuAct) {
        self.rms_into(x, w, eps, out);
    }

    fn rms_norm_in_place(&self, x: &mut GpuAct, w: &GpuVector, eps: f32) {
        let width = w.len.max(1);
        let rows = x.len / width;
        let pipe = self.kernel(
            "rms_norm_in_place",
            "rms_norm_in_place",
            concat!(
                include_str!("shaders/norm_in_place.wgsl"),
                include_str!("shaders/norm_rms.wgsl")
            ),
        );
        self.ctx.dispatch(
            &pipe,
            &[width as u32, eps.to_bits()],
            &[Bind::Whole(x.buf()), Bind::Whole(w.act.buf())],
            [(rows as u32).min(65535), (rows as u32).div_ceil(65535), 1],
        );
    }

    fn add_rms_norm(&self, x: &mut GpuAct, a: &GpuAct, w: &GpuVector, eps: f32, out: &mut GpuAct) {
        self.add(x, a);
        self.rms_into(x, w, eps, out);
    }

    fn add(&self, x: &mut GpuAct, a: &GpuAct) {
        let pipe = self.kernel("add", "add", include_str!("shaders/add.wgsl"));
        self.ctx.dispatch(
            &pipe,
            &[x.len as u32, 0],
            &[Bind::Whole(x.buf()), Bind::Whole(a.buf())],
            Self::groups(x.len, 256),
        );
    }

    fn begin_step(&self, _rows: &StepRows, tables: &mut GpuTables) {
        tables.tables.clear();
    }

    fn rope(&self, x: &mut GpuAct, rope: &Rope, rows: &StepRows, tables: &mut GpuTables) {
        let n = rows.len();
        if n == 0 || x.len == 0 {
            return;
        }
        let key = rope_key(rope);
        let table = match tables.tables.iter().position(|(k, _)| *k == key) {
            Some(i) => &tables.tables[i].1,
            None => {
                let (mut cos, mut sin) = (Vec::new(), Vec::new());
                rope_fill(rope, &rows.positions, &mut cos, &mut sin);
                let half = rope.dims / 2;
                let mut both = Vec::with_capacity(cos.len() * 2);
                for r in 0..n {
                    both.extend_from_slice(&cos[r * half..(r + 1) * half]);
                    both.extend_from_slice(&sin[r * half..(r + 1) * half]);
                }
                let buf = self.ctx.buffer_with(bytemuck::cast_slice(&both), "rope");
                tables.tables.push((key, buf));
                &tables.tables[tables.tables.len() - 1].1
            }
        };
        let per_row = x.len / n;
        let style = match rope.style {
            RopeStyle::Interleaved => 0,
            RopeStyle::Halves => 1,
        };
        let pipe = self.kernel("rope", "rope", include_str!("shaders/rope.wgsl"));
        let pairs = per_row / rope.head_dim * (rope.dims / 2);
        self.ctx.dispatch(
            &pipe,
            &[
                per_row as u32,
                rope.head_dim as u32,
                style,
                n as u32,
                rope.dims as u32,
                0,
                0,
                0,
            ],
            &[Bind::Whole(x.buf()), Bind::Whole(table)],
            [(pairs as u32).div_ceil(64), n as u32, 1],
        );
    }

    fn attention(
        &self,
        q: &GpuAct,
        k: &GpuAct,
        v: &GpuAct,
        kv: &mut [&mut GpuKv],
        layer: usize,
        heads: &Heads,
        rows: &StepRows,
        out: &mut GpuAct,
    ) -> Result<(), EngineError> {
        let width = heads.n_head * heads.head_dim;
        let kv_width = heads.n_kv_head * heads.head_dim;
        let n = rows.len();
        if kv.len() != rows.seqs.len()
            || q.len != n * width
            || k.len != n * kv_width
            || v.len != n * kv_width
        {
            return Err(EngineError::Internal {
                what: format!(
                    "GPU attention over {} rows of {} sequences with {} caches, {} queries, {} \
                     keys, {} values ({heads:?})",
                    n,
                    rows.seqs.len(),
                    kv.len(),
                    q.len,
                    k.len,
                    v.len
                ),
            });
        }
        out.resize(&self.ctx, n * width);
        let write = self.kernel("write_kv", "write_kv", include_str!("shaders/kv.wgsl"));
        let attend = self.kernel("attend", "attend", include_str!("shaders/attention.wgsl"));
        let sinks = heads.sinks.as_ref().map(|s| self.sinks(s));
        for (s, cache) in rows.seqs.iter().zip(kv.iter_mut()) {
            let count = s.rows.len();
            if s.start + count > cache.capacity {
                return Err(EngineError::InvalidInput {
                    what: format!(
                        "the KV cache holds {} positions; {} more after {} do not fit",
                        cache.capacity, count, s.start
                    ),
                });
            }
            let Some((kc, vc)) = cache.layers.get(layer) else {
                return Err(EngineError::Internal {
                    what: format!("no cache for layer {layer}"),
                });
            };
            self.ctx.dispatch(
                &write,
                &[
                    heads.n_kv_head as u32,
                    heads.head_dim as u32,
                    cache.capacity as u32,
                    count as u32,
                    s.start as u32,
                    s.rows.start as u32,
                ],
                &[
                    Bind::Whole(k.buf()),
                    Bind::Whole(v.buf()),
                    Bind::Whole(kc),
                    Bind::Whole(vc),
                ],
                [
                    ((heads.head_dim / 2) as u32).div_ceil(64),
                    heads.n_kv_head as u32,
                    count as u32,
                ],
            );
            self.ctx.dispatch(
                &attend,
                &[
                    heads.n_head as u32,
                    heads.first_head as u32,
                    heads.first_kv as u32,
                    heads.group as u32,
                    heads.head_dim as u32,
                    cache.capacity as u32,
                    heads.window.unwrap_or(0) as u32,
                    heads.scale.to_bits(),
                    s.rows.start as u32,
                    s.start as u32,
                    sinks.is_some() as u32,
                ],
                &[
                    Bind::Whole(q.buf()),
                    Bind::Whole(kc),
                    Bind::Whole(vc),
                    Bind::Whole(out.buf()),
                    // without sinks, any buffer (never read)
                    Bind::Whole(sinks.as_ref().unwrap_or(q.buf())),
                ],
                [count as u32, heads.n_head as u32, 1],
            );
        }
        Ok(())
    }

    fn moe(
        &self,
        experts: &GpuExperts,
        act: Activation,
        x: &GpuAct,
        routes: &Routes,
        out: &mut GpuAct,
    ) -> Result<(), EngineError> {
        let rows = routes.rows();
        if rows == 0 || routes.weights.len() != routes.experts.len() || !x.len.is_multiple_of(rows)
        {
            return Err(EngineError::Internal {
                what: format!(
                    "{} values routed as {rows} rows of {} routes",
                    x.len, routes.k
                ),
            });
        }
        let d = x.len / rows;
        out.resize(&self.ctx, x.len);
        self.ctx.fill_zero(out.buf(), x.len * 4);
        let mut members: Vec<(Vec<u32>, Vec<f32>)> = vec![Default::default(); experts.held.len()];
        for (i, (&e, &w)) in routes.experts.iter().zip(&routes.weights).enumerate() {
            let Some(m) = members.get_mut(e as usize) else {
                return Err(EngineError::Internal {
                    what: format!("a route to expert {e} of {}", experts.held.len()),
                });
            };
            m.0.push((i / routes.k) as u32);
            m.1.push(w);
        }
        let (mut xs, mut h, mut y) = (self.scratch(), self.scratch(), self.scratch());
        let (mut g, mut u) = (self.scratch(), self.scratch());
        let result = (|| {
            for (e, (which, weights)) in members.iter().enumerate() {
                let Some(expert) = experts.held.get(e).and_then(|s| s.as_ref()) else {
                    continue;
                };
                if which.is_empty() {
                    continue;
                }
                let idx = self.ctx.buffer_with(bytemuck::cast_slice(which), "rows");
                let wts = self
                    .ctx
                    .buffer_with(bytemuck::cast_slice(weights), "weights");
                xs.resize(&self.ctx, which.len() * d);
                let select = self.kernel(
                    "select_rows",
                    "select_rows",
                    include_str!("shaders/rows.wgsl"),
                );
                self.ctx.dispatch(
                    &select,
                    &[d as u32, which.len() as u32],
                    &[
                        Bind::Whole(x.buf()),
                        Bind::Whole(&idx),
                        Bind::Whole(xs.buf()),
                    ],
                    [(d as u32).div_ceil(64), which.len() as u32, 1],
                );
                match &expert.bias {
                    None => self.gated(&expert.gate_up, act, &xs, &mut h)?,
                    Some(bias) => {
                        // the biases join the gate and up products before the activation
                        expert.gate_up.gate.matmul(&self.ctx, &xs, &mut g)?;
                        expert.gate_up.up.matmul(&self.ctx, &xs, &mut u)?;
                        self.add_bias(&mut g, &bias.gate);
                        self.add_bias(&mut u, &bias.up);
                        self.gated_from(&g, &u, act, &mut h);
                    }
                }
                expert.down.matmul(&self.ctx, &h, &mut y)?;
                if let Some(down) = expert.bias.as_ref().and_then(|b| b.down.as_ref()) {
                    self.add_bias(&mut y, down);
                }
                let scatter = self.kernel(
                    "scatter_add",
                    "scatter_add",
                    include_str!("shaders/scatter.wgsl"),
                );
                self.ctx.dispatch(
                    &scatter,
                    &[d as u32, which.len() as u32],
                    &[
                        Bind::Whole(y.buf()),
                        Bind::Whole(&idx),
                        Bind::Whole(&wts),
                        Bind::Whole(out.buf()),
                    ],
                    [(d as u32).div_ceil(64), which.len() as u32, 1],
                );
            }
            Ok(())
        })();
        self.give_back([xs, h, y, g, u]);
        result
    }

    fn latent_attention(
        &self,
        q: &GpuAct,
        kv_a: &GpuAct,
        layer: &LatentLayer<Gpu>,
        kv: &mut [&mut GpuKv],
        cache_layer: usize,
        rows: &StepRows,
        tables: &mut GpuTables,
        out: &mut GpuAct,
    ) -> Result<(), EngineError> {
        self.attend_latent(q, kv_a, layer, kv, cache_layer, rows, tables, out)
    }

    fn select_rows(&self, x: &GpuAct, width: usize, which: &[usize], out: &mut GpuAct) {
        out.resize(&self.ctx, which.len() * width);
        let idx: Vec<u32> = which.iter().map(|&r| r as u32).collect();
        let idx = self.ctx.buffer_with(bytemuck::cast_slice(&idx), "rows");
        let pipe = self.kernel(
            "select_rows",
            "select_rows",
            include_str!("shaders/rows.wgsl"),
        );
        self.ctx.dispatch(
            &pipe,
            &[width as u32, which.len() as u32],
            &[
                Bind::Whole(x.buf()),
                Bind::Whole(&idx),
                Bind::Whole(out.buf()),
            ],
            [(width as u32).div_ceil(64), which.len() as u32, 1],
        );
    }

    fn run_step<R: Send>(&self, _decode: bool, f: impl FnOnce() -> R + Send) -> R {
        let r = f();
        self.ctx.submit();
        r
    }
}
