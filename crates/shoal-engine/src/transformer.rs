//! The decoder-only transformer every supported architecture is: token embedding, a stack of
//! blocks (attention, then a gated feed-forward, each with a residual), a final norm and the
//! output head. Differences between architectures are fields of [`ModelConfig`].
//!
//! A [`Transformer`] holds one rank's [`ShardPlan`]: the layers of its pipeline stage, and in
//! each a range of query heads (with the KV heads they read) and of feed-forward features;
//! the first stage embeds tokens and the last holds the final norm and the output head, both
//! cut by vocabulary across the stage's tensor-parallel ranks. At world size 1 the plan is
//! everything. Dimension names: `t` tokens in this step, `p` tokens already cached,
//! `T = p + t`, `nh`/`nkv` local query/KV heads, `hd` head dimension, `d` hidden width.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Device, Tensor};
use shoal_comm::Communicator;

use crate::activation;
use crate::attention::AttentionShape;
use crate::config::{Activation, ModelConfig, RopeStyle};
use crate::error::CandleContext;
use crate::kernels::{GatePair, QuantMatrix};
use crate::kv_cache::KvCache;
use crate::layers::{with_f32, ColumnLinear, Matrix, RmsNorm, RowLinear};
use crate::profile::{self, Op};
pub use crate::shard::{LayerShard, ShardPlan};
use crate::weights::{load_quant_matrix, quant_matrix, Slice, WeightSource};
use crate::EngineError;

/// Cosine and sine tables for `positions` (one row each), computed the way ggml does (in
/// f32, the angle of pair `i` built by repeated multiplication by `base^(-2/hd)`), so
/// positions match the reference implementation bit for bit where the libm does.
fn rope_tables(
    positions: &[usize],
    head_dim: usize,
    base: f64,
    scale: f64,
) -> Result<RopeTable, EngineError> {
    let half = head_dim / 2;
    let t = positions.len();
    let theta_scale = (base as f32).powf(-2.0 / head_dim as f32);
    let freq_scale = (1.0 / scale) as f32;
    let mut cos = Vec::with_capacity(t * half);
    let mut sin = Vec::with_capacity(t * half);
    for &p in positions {
        let mut theta = p as f32;
        for _ in 0..half {
            let a = theta * freq_scale;
            cos.push(a.cos());
            sin.push(a.sin());
            theta *= theta_scale;
        }
    }
    Ok(RopeTable {
        cos,
        sin,
        half,
        tensors: None,
    })
}

/// The RoPE table of one step, `(t, head_dim / 2)` cosines and sines: values for the slice
/// paths of decode, and tensors of them made on first use by prefill's tensor ops (a decode
/// step never makes them).
struct RopeTable {
    cos: Vec<f32>,
    sin: Vec<f32>,
    half: usize,
    tensors: Option<(Tensor, Tensor)>,
}

impl RopeTable {
    /// The table as `(t, head_dim / 2)` tensors (shared handles, made once).
    fn tensors(&mut self) -> Result<(Tensor, Tensor), EngineError> {
        if self.tensors.is_none() {
            let shape = (self.cos.len() / self.half.max(1), self.half);
            self.tensors = Some((
                Tensor::from_slice(&self.cos, shape, &Device::Cpu).ctx("rope table")?,
                Tensor::from_slice(&self.sin, shape, &Device::Cpu).ctx("rope table")?,
            ));
        }
        Ok(self.tensors.clone().expect("made above"))
    }
}

/// RoPE tables of one step, built once and shared by every layer (a model has at most two
/// kinds of layer: global, and sliding-window with its own RoPE base).
struct StepTables {
    /// The position of each row of the step.
    positions: Vec<usize>,
    rope: Vec<((u64, u64), RopeTable)>,
}

impl StepTables {
    /// Rows at positions `p..p + t` (one sequence).
    fn new(p: usize, t: usize) -> Self {
        Self::at((p..p + t).collect())
    }

    /// Rows at the given positions (one row per sequence of a batch).
    fn at(positions: Vec<usize>) -> Self {
        StepTables {
            positions,
            rope: Vec::new(),
        }
    }

    fn rope(
        &mut self,
        head_dim: usize,
        base: f64,
        scale: f64,
    ) -> Result<&mut RopeTable, EngineError> {
        let key = (base.to_bits(), scale.to_bits());
        let i = match self.rope.iter().position(|(k, _)| *k == key) {
            Some(i) => i,
            None => {
                self.rope
                    .push((key, rope_tables(&self.positions, head_dim, base, scale)?));
                self.rope.len() - 1
            }
        };
        Ok(&mut self.rope[i].1)
    }
}

/// RoPE in place on rows `x` laid out `(B, n, head_dim)`, row `b` rotated by its table row
/// `cos[b]`, `sin[b]` (`(B, head_dim / 2)`): the arithmetic of candle's `rope_i`
/// (interleaved pairs) and `rope` (the two halves), so results match the tensor path bit
/// for bit.
fn rope_rows(style: RopeStyle, x: &mut [f32], hd: usize, cos: &[f32], sin: &[f32]) {
    let half = hd / 2;
    let b = cos.len() / half.max(1);
    if b == 0 {
        return;
    }
    let per_row = x.len() / b;
    for (r, row) in x.chunks_exact_mut(per_row).enumerate() {
        let (c, s) = (
            &cos[r * half..(r + 1) * half],
            &sin[r * half..(r + 1) * half],
        );
        for head in row.chunks_exact_mut(hd) {
            for i in 0..half {
                let (i1, i2) = match style {
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    RopeStyle::Halves => (i, i + half),
                };
                let (a, b) = (head[i1], head[i2]);
                head[i1] = a * c[i] - b * s[i];
                head[i2] = a * s[i] + b * c[i];
            }
        }
    }
}

/// The KV caches a step writes: one sequence's (its rows are consecutive positions), or one
/// per row (a batched decode step, each row the next token of its own sequence).
enum StepCaches<'a, 'b> {
    One(&'a mut KvCache),
    Batch(&'a mut [&'b mut KvCache]),
}

/// Multi-head (grouped-query) self-attention over this rank's heads.
#[derive(Debug)]
pub struct Attention {
    q: ColumnLinear,
    k: ColumnLinear,
    v: ColumnLinear,
    o: RowLinear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    n_head: usize,
    n_kv_head: usize,
    first_head: usize,
    first_kv: usize,
    group: usize,
    head_dim: usize,
    scale: f64,
    rope_style: RopeStyle,
    rope_base: f64,
    rope_scale: f64,
    window: Option<usize>,
}

impl Attention {
    fn load(
        src: &dyn WeightSource,
        cfg: &ModelConfig,
        layer: usize,
        shard: &LayerShard,
        comm: Arc<dyn Communicator>,
    ) -> Result<Self, EngineError> {
        let p = format!("blk.{layer}");
        let hd = cfg.head_dim;
        let (q_out, kv_out) = (cfg.n_head * hd, cfg.n_kv_head * hd);
        let rows = |r: &Range<usize>| r.start * hd..r.end * hd;
        let q = ColumnLinear::load(
            src,
            &format!("{p}.attn_q"),
            q_out,
            cfg.hidden,
            rows(&shard.heads),
            cfg.qkv_bias,
        )?;
        let k = ColumnLinear::load(
            src,
            &format!("{p}.attn_k"),
            kv_out,
            cfg.hidden,
            rows(&shard.kv_heads),
            cfg.qkv_bias,
        )?;
        let v = ColumnLinear::load(
            src,
            &format!("{p}.attn_v"),
            kv_out,
            cfg.hidden,
            rows(&shard.kv_heads),
            cfg.qkv_bias,
        )?;
        let o = RowLinear::load(
            src,
            &format!("{p}.attn_output"),
            cfg.hidden,
            q_out,
            rows(&shard.heads),
            comm,
        )?;
        let norm = |name: &str| -> Result<Option<RmsNorm>, EngineError> {
            let n = format!("{p}.{name}.weight");
            if src.contains(&n) {
                Ok(Some(RmsNorm::load(src, &n, hd, cfg.rms_eps)?))
            } else {
                Ok(None)
            }
        };
        let local = cfg.is_local_layer(layer);
        Ok(Attention {
            q,
            k,
            v,
            o,
            q_norm: norm("attn_q_norm")?,
            k_norm: norm("attn_k_norm")?,
            n_head: shard.heads.len(),
            n_kv_head: shard.kv_heads.len(),
            first_head: shard.heads.start,
            first_kv: shard.kv_heads.start,
            group: cfg.n_head / cfg.n_kv_head.max(1),
            head_dim: hd,
            scale: cfg.attn_scale,
            rope_style: cfg.rope_style,
            rope_base: if local {
                cfg.rope_theta_local
            } else {
                cfg.rope_theta
            },
            rope_scale: if local { 1.0 } else { cfg.rope_scale },
            window: if local { cfg.sliding_window } else { None },
        })
    }

    fn rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor, EngineError> {
        match self.rope_style {
            RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i(x, cos, sin),
            RopeStyle::Halves => candle_nn::rotary_emb::rope(x, cos, sin),
        }
        .ctx("rope")
    }

    fn shape(&self, capacity: usize) -> AttentionShape {
        AttentionShape {
            n_head: self.n_head,
            first_head: self.first_head,
            first_kv: self.first_kv,
            group: self.group,
            head_dim: self.head_dim,
            capacity,
            window: self.window,
            scale: self.scale as f32,
        }
    }

    /// x `(1, t, d)` → `(1, t, d)` (summed over ranks).
    fn forward(
        &self,
        x: &Tensor,
        caches: &mut StepCaches<'_, '_>,
        layer: usize,
        tables: &mut StepTables,
    ) -> Result<Tensor, EngineError> {
        match caches {
            StepCaches::One(cache) => self.forward_one(x, cache, layer, tables),
            StepCaches::Batch(caches) => self.forward_batch(x, caches, layer, tables),
        }
    }

    /// Rows `(1, B, d)`, row `i` the next token of the sequence of `caches[i]`.
    fn forward_batch(
        &self,
        x: &Tensor,
        caches: &mut [&mut KvCache],
        layer: usize,
        tables: &mut StepTables,
    ) -> Result<Tensor, EngineError> {
        let (_, rows, _) = x.dims3().ctx("attention input")?;
        let (nh, nkv, hd) = (self.n_head, self.n_kv_head, self.head_dim);
        let x = x.contiguous().ctx("attention input")?;
        let (qs, ks, v) = with_f32(&x, |xs| self.roped_heads(xs, rows, tables))??;
        let attention = profile::scope(Op::Attention);
        let width = nh * hd;
        let kv_width = nkv * hd;
        let mut out = vec![0f32; rows * width];
        let positions = &tables.positions;
        // Each sequence appends its row (for one position, `(nkv, hd)` is `(nkv, 1, hd)`)
        // and attends over its own cache, all sequences in parallel: on the decode step's
        // team, whose helpers spin rather than take rayon's work (a rayon loop here ran
        // every sequence on the calling thread).
        let parts: Vec<Mutex<(&mut [f32], &mut &mut KvCache)>> = out
            .chunks_mut(width)
            .zip(caches.iter_mut())
            .map(Mutex::new)
            .collect();
        let failed: Mutex<Option<EngineError>> = Mutex::new(None);
        crate::kernels::team::for_each(parts.len(), |i| {
            let mut part = parts[i].lock().unwrap_or_else(|e| e.into_inner());
            let (o, cache) = &mut *part;
            let row = i * kv_width..(i + 1) * kv_width;
            if let Err(e) = cache.append(layer, &ks[row.clone()], &v[row]) {
                failed
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get_or_insert(e);
                return;
            }
            let (kc, vc) = cache.buffers(layer).expect("appended above");
            let shape = self.shape(cache.capacity());
            let qi = &qs[i * width..(i + 1) * width];
            shape.decode(positions[i], qi, kc, vc, o);
        });
        drop(parts);
        if let Some(e) = failed.into_inner().unwrap_or_else(|e| e.into_inner()) {
            return Err(e);
        }
        let y = Tensor::from_vec(out, (1, rows, width), &Device::Cpu).ctx("attention output")?;
        drop(attention);
        let _p = profile::scope(Op::AttnOut);
        self.o.forward(&y)
    }

    /// The query, key and value projections of `x`, in one parallel region.
    fn qkv(&self, x: &Tensor) -> Result<(Tensor, Tensor, Tensor), EngineError> {
        let _p = profile::scope(Op::Qkv);
        let mut qkv = ColumnLinear::forward_many(&[&self.q, &self.k, &self.v], x)?;
        let v = qkv.pop().expect("three products");
        let k = qkv.pop().expect("three products");
        Ok((qkv.pop().expect("three products"), k, v))
    }

    /// The slice paths' start: q/k/v of `rows` rows, and the query and key heads as values
    /// laid out `(rows, heads, head_dim)`, through the head norms and rotated by each row's
    /// RoPE position (the head norms work on the last dimension in any layout, so no
    /// transposes are needed).
    fn roped_heads(
        &self,
        xs: &[f32],
        rows: usize,
        tables: &mut StepTables,
    ) -> Result<Heads, EngineError> {
        let hd = self.head_dim;
        let (q, k, v) = {
            let _p = profile::scope(Op::Qkv);
            let cols = xs.len() / rows.max(1);
            let mut qkv = ColumnLinear::forward_many_slice(&[&self.q, &self.k, &self.v], xs, cols)?;
            let v = qkv.pop().expect("three products");
            let k = qkv.pop().expect("three products");
            (qkv.pop().expect("three products"), k, v)
        };
        let _p = profile::scope(Op::Rope);
        let mut qs = self.head_rows(q, rows, self.n_head, &self.q_norm)?;
        let mut ks = self.head_rows(k, rows, self.n_kv_head, &self.k_norm)?;
        let table = tables.rope(hd, self.rope_base, self.rope_scale)?;
        rope_rows(self.rope_style, &mut qs, hd, &table.cos, &table.sin);
        rope_rows(self.rope_style, &mut ks, hd, &table.cos, &table.sin);
        Ok((qs, ks, v))
    }

    /// `y` (`rows` rows of `n` heads) as values laid out `(rows, n, head_dim)`, through the
    /// head norm when the model has one.
    fn head_rows(
        &self,
        y: Vec<f32>,
        rows: usize,
        n: usize,
        norm: &Option<RmsNorm>,
    ) -> Result<Vec<f32>, EngineError> {
        let Some(nm) = norm else {
            return Ok(y);
        };
        if y.len() != rows * n * self.head_dim {
            return Err(EngineError::Unsupported {
                what: format!("{} values for {rows} rows of {n} heads", y.len()),
            });
        }
        nm.forward_slice(&y)
    }

    /// One token of one sequence, its normed hidden state `x` as values, into this rank's
    /// part of the attention's output (summed over ranks): the heads of one position are
    /// already `(n, head_dim)`, so the tensor path's reshapes, transposes and RoPE ops (and
    /// their allocations) are skipped. The arithmetic is the tensor path's, bit for bit.
    fn forward_token(
        &self,
        x: &[f32],
        cache: &mut KvCache,
        layer: usize,
        tables: &mut StepTables,
    ) -> Result<Vec<f32>, EngineError> {
        let (nh, hd) = (self.n_head, self.head_dim);
        let p = cache.len();
        // the keys and values the attention reads after the q/k/v product: the last token's
        // weights pushed them out of every cache
        if let Some((kc, vc)) = cache.buffers(layer) {
            self.shape(cache.capacity()).prefetch(p, kc, vc);
        }
        let (qs, ks, v) = self.roped_heads(x, 1, tables)?;
        let attention = profile::scope(Op::Attention);
        cache.append(layer, &ks, &v)?;
        let (kc, vc) = cache.buffers(layer).expect("appended above");
        let mut out = vec![0f32; nh * hd];
        self.shape(cache.capacity())
            .decode_parallel(p, &qs, kc, vc, &mut out);
        drop(attention);
        let _p = profile::scope(Op::AttnOut);
        self.o.forward_slice(&out, nh * hd)
    }

    /// Rows `(1, t, d)` of one sequence at consecutive positions after what `cache` holds.
    fn forward_one(
        &self,
        x: &Tensor,
        cache: &mut KvCache,
        layer: usize,
        tables: &mut StepTables,
    ) -> Result<Tensor, EngineError> {
        let (b, t, _) = x.dims3().ctx("attention input")?;
        let (nh, nkv, hd) = (self.n_head, self.n_kv_head, self.head_dim);
        let p = cache.len();
        let heads = |y: Tensor, n: usize| -> Result<Tensor, EngineError> {
            // (b, t, n*hd) -> (b, n, t, hd)
            y.reshape((b, t, n, hd))
                .and_then(|y| y.transpose(1, 2))
                .and_then(|y| y.contiguous())
                .ctx("split heads")
        };
        let (q, k, v) = self.qkv(x)?;
        let rope = profile::scope(Op::Rope);
        let mut q = heads(q, nh)?;
        let mut k = heads(k, nkv)?;
        let v = heads(v, nkv)?;
        if let Some(n) = &self.q_norm {
            q = n.forward(&q)?;
        }
        if let Some(n) = &self.k_norm {
            k = n.forward(&k)?;
        }
        let (cos, sin) = tables
            .rope(hd, self.rope_base, self.rope_scale)?
            .tensors()?;
        let q = self.rope(&q, &cos, &sin)?;
        let k = self.rope(&k, &cos, &sin)?;
        drop(rope);
        let attention = profile::scope(Op::Attention);
        with_f32(&k, |ks| with_f32(&v, |vs| cache.append(layer, ks, vs)))???;
        let (ks, vs) = cache.buffers(layer).expect("appended above");
        let shape = self.shape(cache.capacity());
        let mut out = vec![0f32; t * nh * hd];
        with_f32(&q, |qs| {
            if t == 1 {
                shape.decode_parallel(p, qs, ks, vs, &mut out)
            } else {
                shape.prefill(p, t, qs, ks, vs, &mut out)
            }
        })?;
        let y = Tensor::from_vec(out, (b, t, nh * hd), &Device::Cpu).ctx("attention output")?;
        drop(attention);
        let _p = profile::scope(Op::AttnOut);
        self.o.forward(&y)
    }
}

/// A step's query heads, key heads and values as plain values (see `roped_heads`).
type Heads = (Vec<f32>, Vec<f32>, Vec<f32>);

/// The gated feed-forward block over this rank's features.
#[derive(Debug)]
pub struct FeedForward {
    gate_up: GateUp,
    down: RowLinear,
    activation: Activation,
}

/// A feed-forward's gate and up projections: one interleaved matrix where the kernels hold
/// both alike ([`GatePair`]: the activation then runs inside the product's parallel loop),
/// else two layers.
#[derive(Debug)]
enum GateUp {
    Paired(GatePair),
    Apart {
        gate: ColumnLinear,
        up: ColumnLinear,
    },
}

impl FeedForward {
    fn load(
        src: &dyn WeightSource,
        cfg: &ModelConfig,
        layer: usize,
        shard: &LayerShard,
        comm: Arc<dyn Communicator>,
    ) -> Result<Self, EngineError> {
        let p = format!("blk.{layer}");
        let column = |name: &str| {
            ColumnLinear::load(
                src,
                &format!("{p}.{name}"),
                cfg.ffn,
                cfg.hidden,
                shard.ffn.clone(),
                false,
            )
        };
        let (gate, up) = (column("ffn_gate")?, column("ffn_up")?);
        let pair = match (gate.kernel_matrix(), up.kernel_matrix()) {
            (Some(g), Some(u)) => GatePair::new(g, u),
            _ => None,
        };
        Ok(FeedForward {
            gate_up: match pair {
                Some(pair) => GateUp::Paired(pair),
                None => GateUp::Apart { gate, up },
            },
            down: RowLinear::load(
                src,
                &format!("{p}.ffn_down"),
                cfg.hidden,
                cfg.ffn,
                shard.ffn.clone(),
                comm,
            )?,
            activation: cfg.activation,
        })
    }

    /// x `(.., d)` → `(.., d)` (summed over ranks).
    fn forward(&self, x: &Tensor) -> Result<Tensor, EngineError> {
        let x = x.contiguous().ctx("feed-forward input")?;
        let cols = x.dims().last().copied().unwrap_or(0);
        let y = with_f32(&x, |xs| self.forward_slice(xs, cols))??;
        Tensor::from_vec(y, x.dims(), &Device::Cpu).ctx("feed-forward output")
    }

    /// [`FeedForward::forward`] of plain values: `xs` holds rows of `cols` inputs.
    fn forward_slice(&self, xs: &[f32], cols: usize) -> Result<Vec<f32>, EngineError> {
        let h = match &self.gate_up {
            GateUp::Paired(pair) => {
                let _p = profile::scope(Op::GateUp);
                if cols != pair.cols() || !xs.len().is_multiple_of(cols) {
                    return Err(EngineError::Unsupported {
                        what: format!(
                            "a feed-forward input of {} values in rows of {cols} for {} columns",
                            xs.len(),
                            pair.cols()
                        ),
                    });
                }
                pair.gated_products(xs, self.activation)
                    .map_err(|e| EngineError::Unsupported {
                        what: e.to_string(),
                    })?
            }
            GateUp::Apart { gate, up } => {
                // as values: read once by the activation, never as tensors
                let (g, u) = {
                    let _p = profile::scope(Op::GateUp);
                    let mut gu = ColumnLinear::forward_many_slice(&[gate, up], xs, cols)?;
                    let u = gu.pop().expect("two products");
                    (gu.pop().expect("two products"), u)
                };
                let _act = profile::scope(Op::Activation);
                let mut h = vec![0f32; g.len()];
                activation::gated(self.activation, &g, &u, &mut h);
                h
            }
        };
        let rows = xs.len() / cols.max(1);
        let _p = profile::scope(Op::Down);
        self.down.forward_slice(&h, h.len() / rows.max(1))
    }
}

/// One transformer block.
#[derive(Debug)]
pub struct Block {
    attn_norm: RmsNorm,
    attn: Attention,
    post_attn_norm: Option<RmsNorm>,
    ffn_norm: RmsNorm,
    ffn: FeedForward,
    post_ffn_norm: Option<RmsNorm>,
}

impl Block {
    /// Loads block `layer`'s shard.
    ///
    /// # Errors
    /// When a tensor is missing or misshapen.
    pub fn load(
        src: &dyn WeightSource,
        cfg: &ModelConfig,
        layer: usize,
        shard: &LayerShard,
        comm: Arc<dyn Communicator>,
    ) -> Result<Self, EngineError> {
        let p = format!("blk.{layer}");
        let norm =
            |name: &str| RmsNorm::load(src, &format!("{p}.{name}.weight"), cfg.hidden, cfg.rms_eps);
        let opt_norm = |name: &str| -> Result<Option<RmsNorm>, EngineError> {
            if src.contains(&format!("{p}.{name}.weight")) {
                norm(name).map(Some)
            } else {
                Ok(None)
            }
        };
        Ok(Block {
            attn_norm: norm("attn_norm")?,
            attn: Attention::load(src, cfg, layer, shard, comm.clone())?,
            post_attn_norm: opt_norm("post_attention_norm")?,
            ffn_norm: norm("ffn_norm")?,
            ffn: FeedForward::load(src, cfg, layer, shard, comm)?,
            post_ffn_norm: opt_norm("post_ffw_norm")?,
        })
    }

    /// x `(1, t, d)` → `(1, t, d)`.
    ///
    /// # Errors
    /// On a tensor or communication failure.
    fn forward(
        &self,
        x: &Tensor,
        caches: &mut StepCaches<'_, '_>,
        layer: usize,
        tables: &mut StepTables,
    ) -> Result<Tensor, EngineError> {
        // attention with residual
        let xn = profiled(Op::Norm, || self.attn_norm.forward(x))?;
        let mut a = self.attn.forward(&xn, caches, layer, tables)?;
        if let Some(n) = &self.post_attn_norm {
            a = profiled(Op::Norm, || n.forward(&a))?;
        }
        // the residual and the feed-forward's norm of it in one pass
        let (h, hn) = profiled(Op::Norm, || self.ffn_norm.add_forward(x, &a))?;
        let mut f = self.ffn.forward(&hn)?;
        if let Some(n) = &self.post_ffn_norm {
            f = profiled(Op::Norm, || n.forward(&f))?;
        }
        profiled(Op::Residual, || (h + f).ctx("ffn residual"))
    }

    /// [`Block::forward`] for one token of one sequence, on values: `x` (the hidden state,
    /// `d` values) becomes the block's output in place. Between the matrix products a
    /// decode step only norms, adds and rotates a few thousand values; as tensors, each of
    /// those allocated, dispatched and wrapped its result, touching code and data that the
    /// weight stream had just pushed out of the caches.
    ///
    /// # Errors
    /// On a shape mismatch, a full cache or a failed all-reduce.
    fn forward_token(
        &self,
        x: &mut [f32],
        cache: &mut KvCache,
        layer: usize,
        tables: &mut StepTables,
    ) -> Result<(), EngineError> {
        let xn = profiled(Op::Norm, || self.attn_norm.forward_slice(x))?;
        let mut a = self.attn.forward_token(&xn, cache, layer, tables)?;
        if let Some(n) = &self.post_attn_norm {
            a = profiled(Op::Norm, || n.forward_slice(&a))?;
        }
        let hn = profiled(Op::Norm, || self.ffn_norm.add_forward_slice(x, &a))?;
        let mut f = self.ffn.forward_slice(&hn, hn.len())?;
        if let Some(n) = &self.post_ffn_norm {
            f = profiled(Op::Norm, || n.forward_slice(&f))?;
        }
        let _p = profile::scope(Op::Residual);
        if f.len() != x.len() {
            return Err(EngineError::Unsupported {
                what: format!("a residual add of {} and {} values", x.len(), f.len()),
            });
        }
        for (h, f) in x.iter_mut().zip(&f) {
            *h += f;
        }
        Ok(())
    }
}

/// The token embedding table (this rank's vocabulary rows of it), which is also the output
/// head when the model ties them.
struct Embedding {
    table: EmbeddingTable,
    /// The vocabulary rows held.
    rows: Range<usize>,
}

enum EmbeddingTable {
    /// Read row by row through the kernels' dequantizer.
    Kernel(Arc<QuantMatrix>),
    /// A type the kernels do not cover: candle's lookup.
    Candle(Arc<QTensor>),
}

impl Embedding {
    fn load(src: &dyn WeightSource, rows: Range<usize>, vocab: usize) -> Result<Self, EngineError> {
        let name = "token_embd.weight";
        let slice = if rows == (0..vocab) {
            Slice::Full
        } else {
            Slice::Rows(rows.clone())
        };
        let table = if crate::layers::candle_only() {
            EmbeddingTable::Candle(Arc::new(src.load(name, &slice)?))
        } else if let Some(m) = load_quant_matrix(src, name, &slice)? {
            EmbeddingTable::Kernel(Arc::new(m))
        } else {
            let q = src.load(name, &slice)?;
            match quant_matrix(name, &q)? {
                Some(m) => EmbeddingTable::Kernel(Arc::new(m)),
                None => EmbeddingTable::Candle(Arc::new(q)),
            }
        };
        Ok(Embedding { table, rows })
    }

    /// The rows of `tokens` (ids already checked against the vocabulary), `(t, d)`; zero
    /// for ids outside the rows held (another rank of the stage has them).
    fn lookup(&self, tokens: &[u32], d: usize) -> Result<Tensor, EngineError> {
        let local = |id: u32| {
            let id = id as usize;
            self.rows.contains(&id).then(|| id - self.rows.start)
        };
        match &self.table {
            EmbeddingTable::Kernel(m) => {
                let mut x = vec![0f32; tokens.len() * d];
                for (&id, row) in tokens.iter().zip(x.chunks_exact_mut(d)) {
                    if let Some(r) = local(id) {
                        m.dequantize_row(r, row)
                            .map_err(|e| EngineError::Unsupported {
                                what: format!("embedding lookup: {e}"),
                            })?;
                    }
                }
                Tensor::from_vec(x, (tokens.len(), d), &Device::Cpu).ctx("embedding")
            }
            EmbeddingTable::Candle(q) => {
                let ids: Vec<u32> = tokens
                    .iter()
                    .map(|&id| local(id).unwrap_or(0) as u32)
                    .collect();
                let held: Vec<f32> = tokens
                    .iter()
                    .map(|&id| if local(id).is_some() { 1.0 } else { 0.0 })
                    .collect();
                let ids = Tensor::new(ids, &Device::Cpu).ctx("token ids")?;
                let held =
                    Tensor::from_vec(held, (tokens.len(), 1), &Device::Cpu).ctx("token ids")?;
                q.embedding(&ids)
                    .and_then(|x| x.broadcast_mul(&held))
                    .ctx("embedding")
            }
        }
    }

    /// The same table as an output head (tied embeddings).
    fn as_head(&self) -> Result<Matrix, EngineError> {
        Ok(match &self.table {
            EmbeddingTable::Kernel(m) => Matrix::Kernel(m.clone()),
            EmbeddingTable::Candle(q) => {
                Matrix::Candle(QMatMul::from_arc(q.clone()).ctx("tied output head")?)
            }
        })
    }
}

/// A loaded model (one rank's shard of it).
pub struct Transformer {
    cfg: ModelConfig,
    plan: ShardPlan,
    /// The ranks of this rank's pipeline stage (sums partial results; world size 1 when the
    /// stage is not cut).
    tp: Arc<dyn Communicator>,
    embed: Option<Embedding>,
    blocks: Vec<Block>,
    norm: Option<RmsNorm>,
    head: Option<ColumnLinear>,
}

impl std::fmt::Debug for Transformer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transformer")
            .field("cfg", &self.cfg)
            .field("plan", &self.plan)
            .finish()
    }
}

impl Transformer {
    /// Loads the whole model on one rank, or, when `comm` has several ranks, this rank's
    /// tensor-parallel share of it (every rank one stage).
    ///
    /// # Errors
    /// When a tensor is missing or misshapen, or the model cannot be cut that many ways.
    pub fn load(
        src: &dyn WeightSource,
        cfg: ModelConfig,
        comm: Arc<dyn Communicator>,
    ) -> Result<Self, EngineError> {
        let plan = if comm.world_size() == 1 {
            ShardPlan::full(&cfg)
        } else {
            let layout = crate::shard::Layout {
                tp: comm.world_size(),
                pp: 1,
            };
            crate::shard::plan(&cfg, src, layout, None)?.swap_remove(comm.rank())
        };
        Self::load_shard(src, cfg, plan, comm)
    }

    /// Loads what `plan` says this rank holds; `tp` is the communicator of the ranks of its
    /// pipeline stage.
    ///
    /// # Errors
    /// When a tensor is missing or misshapen.
    pub fn load_shard(
        src: &dyn WeightSource,
        cfg: ModelConfig,
        plan: ShardPlan,
        tp: Arc<dyn Communicator>,
    ) -> Result<Self, EngineError> {
        let embed_shape = src.shape("token_embd.weight")?;
        if embed_shape != [cfg.vocab, cfg.hidden] {
            return Err(EngineError::Shape {
                tensor: "token_embd.weight".into(),
                found: embed_shape,
                expected: vec![cfg.vocab, cfg.hidden],
            });
        }
        let tied = !src.contains("output.weight");
        let embed = if plan.first_stage || (plan.last_stage && tied) {
            Some(Embedding::load(src, plan.vocab.clone(), cfg.vocab)?)
        } else {
            None
        };
        let mut blocks = Vec::with_capacity(plan.layers.len());
        for layer in plan.layers.clone() {
            blocks.push(Block::load(src, &cfg, layer, &plan.shard, tp.clone())?);
        }
        let (norm, head) = if plan.last_stage {
            let norm = RmsNorm::load(src, "output_norm.weight", cfg.hidden, cfg.rms_eps)?;
            let head = match &embed {
                Some(e) if tied => ColumnLinear::from_matrix(e.as_head()?),
                _ => ColumnLinear::load(
                    src,
                    "output",
                    cfg.vocab,
                    cfg.hidden,
                    plan.vocab.clone(),
                    false,
                )?,
            };
            (Some(norm), Some(head))
        } else {
            (None, None)
        };
        let embed = if plan.first_stage { embed } else { None };
        Ok(Transformer {
            cfg,
            plan,
            tp,
            embed,
            blocks,
            norm,
            head,
        })
    }

    /// The model's hyperparameters.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// What this rank holds.
    pub fn plan(&self) -> &ShardPlan {
        &self.plan
    }

    /// A KV cache for up to `capacity` tokens of this rank's layers and KV heads.
    pub fn new_cache(&self, capacity: usize) -> KvCache {
        KvCache::new(
            self.plan.layers.len(),
            self.plan.shard.kv_heads.len(),
            self.cfg.head_dim,
            capacity,
        )
    }

    fn check_step(&self, tokens: &[u32], cache: &KvCache) -> Result<(), EngineError> {
        let t = tokens.len();
        if t == 0 {
            return Err(EngineError::Unsupported {
                what: "a forward pass over zero tokens".into(),
            });
        }
        if cache.len() + t > cache.capacity() {
            return Err(EngineError::ContextFull {
                prompt: cache.len() + t,
                ctx: cache.capacity(),
            });
        }
        if let Some(&bad) = tokens.iter().find(|&&id| id as usize >= self.cfg.vocab) {
            return Err(EngineError::Unsupported {
                what: format!(
                    "token id {bad} is outside the vocabulary of {}",
                    self.cfg.vocab
                ),
            });
        }
        Ok(())
    }

    /// The hidden states `(1, t, d)` of `tokens` (first stage only): the embedding rows,
    /// gathered across the stage's ranks when the vocabulary is cut.
    ///
    /// # Errors
    /// When this rank is not in the first stage, an id is out of range, or a peer fails.
    pub fn embed(&self, tokens: &[u32]) -> Result<Tensor, EngineError> {
        let Some(embed) = &self.embed else {
            return Err(EngineError::Unsupported {
                what: "embedding tokens on a rank that is not in the first pipeline stage".into(),
            });
        };
        if let Some(&bad) = tokens.iter().find(|&&id| id as usize >= self.cfg.vocab) {
            return Err(EngineError::Unsupported {
                what: format!(
                    "token id {bad} is outside the vocabulary of {}",
                    self.cfg.vocab
                ),
            });
        }
        let _p = profile::scope(Op::Embed);
        let d = self.cfg.hidden;
        let mut x = embed.lookup(tokens, d)?;
        if self.tp.world_size() > 1 {
            let mut data = x
                .flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .ctx("embedding")?;
            self.tp.all_reduce_sum(&mut data)?;
            x = Tensor::from_vec(data, (tokens.len(), d), &Device::Cpu).ctx("embedding")?;
        }
        let mut x = x.unsqueeze(0).ctx("embedding")?;
        if self.cfg.embed_scale != 1.0 {
            // ggml scales in f32: round the factor the same way.
            x = (x * (self.cfg.embed_scale as f32) as f64).ctx("embedding scale")?;
        }
        Ok(x)
    }

    /// Runs this rank's layers over hidden states `x` `(1, t, d)` of the positions after what
    /// `cache` holds, and moves the cache's end past them.
    ///
    /// # Errors
    /// When the positions do not fit the cache, or a tensor op or peer fails.
    pub fn forward_layers(&self, x: Tensor, cache: &mut KvCache) -> Result<Tensor, EngineError> {
        if self.plan.is_full(&self.cfg) {
            let decode = x.dim(1).is_ok_and(|t| t == 1);
            on_pool(decode, || self.run_layers(x, cache))
        } else {
            self.run_layers(x, cache)
        }
    }

    fn run_layers(&self, x: Tensor, cache: &mut KvCache) -> Result<Tensor, EngineError> {
        let t = x.dim(1).ctx("hidden states")?;
        if cache.len() + t > cache.capacity() {
            return Err(EngineError::ContextFull {
                prompt: cache.len() + t,
                ctx: cache.capacity(),
            });
        }
        let mut tables = StepTables::new(cache.len(), t);
        if t == 1 {
            // one token: the blocks work on values (see `Block::forward_token`)
            let x = x.contiguous().ctx("hidden states")?;
            let mut xs = with_f32(&x, |v| v.to_vec())?;
            for (layer, block) in self.blocks.iter().enumerate() {
                block.forward_token(&mut xs, cache, layer, &mut tables)?;
            }
            cache.advance(1);
            return Tensor::from_vec(xs, x.dims(), &Device::Cpu).ctx("hidden states");
        }
        let mut x = x;
        let mut caches = StepCaches::One(cache);
        for (layer, block) in self.blocks.iter().enumerate() {
            x = block.forward(&x, &mut caches, layer, &mut tables)?;
        }
        cache.advance(t);
        Ok(x)
    }

    /// Runs this rank's layers over `x` `(1, B, d)`, row `i` the next token of the sequence
    /// of `caches[i]` (a batched decode step of a split model: the matrices read this
    /// rank's weights once for all rows), and moves each cache's end past its row.
    ///
    /// # Errors
    /// When the rows and caches differ in number, a cache is full, or a tensor op or peer
    /// fails (the caches of a failed step are unusable).
    pub fn forward_layers_batch(
        &self,
        x: Tensor,
        caches: &mut [&mut KvCache],
    ) -> Result<Tensor, EngineError> {
        let rows = x.dim(1).ctx("hidden states")?;
        if rows != caches.len() || rows == 0 {
            return Err(EngineError::Unsupported {
                what: format!("a batch of {rows} rows for {} sequences", caches.len()),
            });
        }
        if let Some(c) = caches.iter().find(|c| c.len() + 1 > c.capacity()) {
            return Err(EngineError::ContextFull {
                prompt: c.len() + 1,
                ctx: c.capacity(),
            });
        }
        let run = |caches: &mut [&mut KvCache]| -> Result<Tensor, EngineError> {
            let mut x = x;
            let mut tables = StepTables::at(caches.iter().map(|c| c.len()).collect());
            let mut step = StepCaches::Batch(&mut *caches);
            for (layer, block) in self.blocks.iter().enumerate() {
                x = block.forward(&x, &mut step, layer, &mut tables)?;
            }
            for c in caches.iter_mut() {
                c.advance(1);
            }
            Ok(x)
        };
        if self.plan.is_full(&self.cfg) {
            on_pool(true, || run(caches))
        } else {
            run(caches)
        }
    }

    /// One decode step for several independent sequences at once: `tokens[i]` goes after
    /// what `caches[i]` holds (each sequence at its own position), and the result is the
    /// logits `(B, vocab)` of each sequence's new token, row `i` for sequence `i`. The
    /// matrices see all `B` rows at once, so the weights are read once for the batch;
    /// attention runs per sequence over its own cache. A rank holding the whole model only.
    ///
    /// # Errors
    /// When the lengths differ, the batch is empty, a cache is full, an id is out of range,
    /// or a tensor op fails (the caches of a failed step are unusable).
    pub fn forward_batch(
        &self,
        tokens: &[u32],
        caches: &mut [&mut KvCache],
    ) -> Result<Tensor, EngineError> {
        let rows = tokens.len();
        let logits = self.forward_batch_values(tokens, caches)?;
        let vocab = logits.len() / rows.max(1);
        Tensor::from_vec(logits, (rows, vocab), &Device::Cpu).ctx("logits")
    }

    /// [`Transformer::forward_batch`]'s logits as plain values, row after row (`B * vocab`):
    /// the output head's own value vector. Read out of a tensor into a vector per row, 16
    /// qwen05 rows (9.7 MB) were copied again every step.
    ///
    /// # Errors
    /// As [`Transformer::forward_batch`].
    pub fn forward_batch_values(
        &self,
        tokens: &[u32],
        caches: &mut [&mut KvCache],
    ) -> Result<Vec<f32>, EngineError> {
        on_pool(true, || self.run_batch(tokens, caches))
    }

    fn run_batch(
        &self,
        tokens: &[u32],
        caches: &mut [&mut KvCache],
    ) -> Result<Vec<f32>, EngineError> {
        if !self.plan.is_full(&self.cfg) {
            return Err(EngineError::Unsupported {
                what: "a batched forward pass on a rank holding only part of the model".into(),
            });
        }
        if tokens.len() != caches.len() {
            return Err(EngineError::Unsupported {
                what: format!(
                    "a batch of {} tokens for {} sequences",
                    tokens.len(),
                    caches.len()
                ),
            });
        }
        if tokens.is_empty() {
            return Err(EngineError::Unsupported {
                what: "a batched forward pass over no sequences".into(),
            });
        }
        for (tok, cache) in tokens.iter().zip(caches.iter()) {
            self.check_step(std::slice::from_ref(tok), cache)?;
        }
        let rows = tokens.len();
        let mut x = self.embed(tokens)?;
        let mut tables = StepTables::at(caches.iter().map(|c| c.len()).collect());
        let mut step = StepCaches::Batch(&mut *caches);
        for (layer, block) in self.blocks.iter().enumerate() {
            x = block.forward(&x, &mut step, layer, &mut tables)?;
        }
        for c in caches.iter_mut() {
            c.advance(1);
        }
        let _p = profile::scope(Op::Head);
        let (head, x) = self.head_input(&x, rows)?;
        head.forward_values(&x)
    }

    /// This rank's vocabulary slice of the logits `(n, vocab slice)` of the last `n_logits`
    /// positions of `x` `(1, t, d)` (last stage only).
    ///
    /// # Errors
    /// When this rank is not in the last stage, or a tensor op fails.
    pub fn logits(&self, x: &Tensor, n_logits: usize) -> Result<Tensor, EngineError> {
        if self.plan.is_full(&self.cfg) {
            on_pool(false, || self.head_logits(x, n_logits))
        } else {
            self.head_logits(x, n_logits)
        }
    }

    fn head_logits(&self, x: &Tensor, n_logits: usize) -> Result<Tensor, EngineError> {
        let _p = profile::scope(Op::Head);
        let (head, x) = self.head_input(x, n_logits)?;
        let logits = head.forward(&x)?; // (1, n, vocab slice)
        logits
            .squeeze(0)
            .and_then(|l| l.to_dtype(DType::F32))
            .ctx("logits")
    }

    /// The output head and its input: the last `n_logits` positions of `x` `(1, t, d)`,
    /// normed.
    fn head_input(
        &self,
        x: &Tensor,
        n_logits: usize,
    ) -> Result<(&ColumnLinear, Tensor), EngineError> {
        let (Some(norm), Some(head)) = (&self.norm, &self.head) else {
            return Err(EngineError::Unsupported {
                what: "logits on a rank that is not in the last pipeline stage".into(),
            });
        };
        let t = x.dim(1).ctx("hidden states")?;
        let n = n_logits.clamp(1, t);
        let x = x.narrow(1, t - n, n).ctx("last positions")?;
        Ok((head, norm.forward(&x)?))
    }

    /// Runs `tokens` (appended after what `cache` holds) and returns the logits `(n, vocab)`
    /// of the last `n_logits` positions; a rank that holds the whole model only.
    ///
    /// # Errors
    /// When the tokens do not fit the cache, an id is out of range, a tensor op fails, or
    /// this rank holds only part of the model.
    pub fn forward(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        n_logits: usize,
    ) -> Result<Tensor, EngineError> {
        self.whole_step(tokens, cache, |x| self.head_logits(x, n_logits))
    }

    /// Logits of the last position only, as a vector: the head's output values themselves,
    /// where a tensor's would be copied out (600 KB for Qwen's vocabulary: 62 µs of a
    /// 13 ms token, rdtsc marks, qwen05 at 2 threads on a 2-vCPU Intel VM).
    ///
    /// # Errors
    /// As [`Transformer::forward`].
    pub fn forward_last(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
    ) -> Result<Vec<f32>, EngineError> {
        self.whole_step(tokens, cache, |x| {
            let _p = profile::scope(Op::Head);
            let (head, x) = self.head_input(x, 1)?;
            head.forward_values(&x)
        })
    }

    /// Runs `tokens` after what `cache` holds through every layer (on the compute pool) and
    /// `finish` over the last hidden states; a rank that holds the whole model only.
    fn whole_step<R: Send>(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        finish: impl FnOnce(&Tensor) -> Result<R, EngineError> + Send,
    ) -> Result<R, EngineError> {
        if !self.plan.is_full(&self.cfg) {
            return Err(EngineError::Unsupported {
                what: format!(
                    "a whole forward pass on a rank holding only part of the model ({:?})",
                    self.plan
                ),
            });
        }
        self.check_step(tokens, cache)?;
        on_pool(tokens.len() == 1, || {
            let x = self.embed(tokens)?;
            let x = self.run_layers(x, cache)?;
            finish(&x)
        })
    }
}

/// Runs `f` on a thread of the compute pool (inline when already on one). A step starts
/// hundreds of parallel loops; driven from outside the pool, each of them would cost a
/// hand-off to a pool thread and back (measured: one SmolLM2 stream at 2 threads, 66 -> 111
/// tokens/s when the scheduler moved onto the pool), from inside it costs none. Only a rank
/// holding the whole model does this: a split rank waits for its peers inside the step, and
/// ranks sharing one process (the tests) would hold every pool thread while they wait.
///
/// A `decode` step (one new position per sequence) runs as one `kernels::team::step`: the
/// pool's other threads spin between its matrix products instead of falling asleep and
/// being woken for each (measured on a 2-vCPU Intel VM: see the module). Prefill keeps
/// rayon alone: its products are long, and its attention is a rayon loop that a spinning
/// helper would leave to one thread (so it first sends away the helpers that linger after
/// a decode step).
fn on_pool<R: Send>(decode: bool, f: impl FnOnce() -> R + Send) -> R {
    if decode {
        crate::kernels::team::step(f)
    } else {
        crate::kernels::team::release();
        rayon::scope(|_| f())
    }
}

/// Runs `f`, timing it as `op`.
fn profiled<T>(op: Op, f: impl FnOnce() -> T) -> T {
    let _p = profile::scope(op);
    f()
}

/// Index of the largest value (the first one on ties), for greedy decoding and tests.
pub use crate::kernels::argmax;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_table_position_zero_is_identity() {
        let mut table = rope_tables(&[0], 8, 10000.0, 1.0).unwrap();
        let (c, s) = table.tensors().unwrap();
        assert_eq!(c.to_vec2::<f32>().unwrap()[0], vec![1.0; 4]);
        assert_eq!(s.to_vec2::<f32>().unwrap()[0], vec![0.0; 4]);
        assert_eq!((table.cos, table.sin), (vec![1.0; 4], vec![0.0; 4]));
    }

    #[test]
    fn argmax_first_on_ties() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
    }
}
