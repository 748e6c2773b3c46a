//! The decoder-only transformer every supported architecture is: token embedding, a stack of
//! blocks (attention, then a gated feed-forward, each with a residual), a final norm and the
//! output head. Differences between architectures are fields of [`ModelConfig`].
//!
//! Each block holds only its rank's [`LayerShard`]: a range of query heads (with the KV heads
//! they read), and a block-aligned range of feed-forward features. At world size 1 the shard
//! is everything. Dimension names: `t` tokens in this step, `p` tokens already cached,
//! `T = p + t`, `nh`/`nkv` local query/KV heads, `hd` head dimension, `d` hidden width.

use std::ops::Range;
use std::sync::Arc;

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Device, Tensor};
use shoal_comm::Communicator;

use crate::attention::DecodeAttention;
use crate::config::{Activation, ModelConfig, RopeStyle};
use crate::error::CandleContext;
use crate::kernels::QuantMatrix;
use crate::kv_cache::KvCache;
use crate::layers::{ColumnLinear, Matrix, RmsNorm, RowLinear};
use crate::profile::{self, Op};
use crate::weights::{load_quant_matrix, quant_matrix, Slice, WeightSource};
use crate::EngineError;

/// The part of one layer a rank holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerShard {
    /// Query heads of this rank.
    pub heads: Range<usize>,
    /// KV heads of this rank (those its query heads read; replicated across ranks when
    /// ranks outnumber KV heads).
    pub kv_heads: Range<usize>,
    /// Feed-forward features of this rank (block aligned).
    pub ffn: Range<usize>,
}

impl LayerShard {
    /// The whole layer (world size 1).
    pub fn full(cfg: &ModelConfig) -> Self {
        LayerShard {
            heads: 0..cfg.n_head,
            kv_heads: 0..cfg.n_kv_head,
            ffn: 0..cfg.ffn,
        }
    }
}

/// Cosine and sine tables for positions `pos..pos + t`, computed the way ggml does (in f32,
/// the angle of pair `i` built by repeated multiplication by `base^(-2/hd)`), so positions
/// match the reference implementation bit for bit where the libm does.
fn rope_tables(
    pos: usize,
    t: usize,
    head_dim: usize,
    base: f64,
    scale: f64,
) -> Result<(Tensor, Tensor), EngineError> {
    let half = head_dim / 2;
    let theta_scale = (base as f32).powf(-2.0 / head_dim as f32);
    let freq_scale = (1.0 / scale) as f32;
    let mut cos = Vec::with_capacity(t * half);
    let mut sin = Vec::with_capacity(t * half);
    for p in pos..pos + t {
        let mut theta = p as f32;
        for _ in 0..half {
            let a = theta * freq_scale;
            cos.push(a.cos());
            sin.push(a.sin());
            theta *= theta_scale;
        }
    }
    let cos = Tensor::from_vec(cos, (t, half), &Device::Cpu).ctx("rope table")?;
    let sin = Tensor::from_vec(sin, (t, half), &Device::Cpu).ctx("rope table")?;
    Ok((cos, sin))
}

/// The additive attention mask `(t, T)`: `-inf` where query `i` (at position `p + i`) may not
/// see key `j`: the future, and with a sliding window keys `window` or more positions back.
/// `None` when nothing is masked.
fn attention_mask(
    p: usize,
    t: usize,
    window: Option<usize>,
) -> Result<Option<Tensor>, EngineError> {
    let total = p + t;
    let needs_window = window.is_some_and(|w| total > w);
    if t == 1 && !needs_window {
        return Ok(None);
    }
    let mut m = vec![0f32; t * total];
    for i in 0..t {
        let q = p + i;
        for j in 0..total {
            let future = j > q;
            let too_old = window.is_some_and(|w| q - j.min(q) >= w);
            if future || too_old {
                m[i * total + j] = f32::NEG_INFINITY;
            }
        }
    }
    Ok(Some(
        Tensor::from_vec(m, (t, total), &Device::Cpu).ctx("attention mask")?,
    ))
}

/// RoPE tables and attention masks of one step, built once and shared by every layer (a
/// model has at most two kinds of layer: global, and sliding-window with its own RoPE base).
struct StepTables {
    p: usize,
    t: usize,
    rope: Vec<((u64, u64), (Tensor, Tensor))>,
    masks: Vec<(Option<usize>, Option<Tensor>)>,
}

impl StepTables {
    fn new(p: usize, t: usize) -> Self {
        StepTables {
            p,
            t,
            rope: Vec::new(),
            masks: Vec::new(),
        }
    }

    fn rope(
        &mut self,
        head_dim: usize,
        base: f64,
        scale: f64,
    ) -> Result<&(Tensor, Tensor), EngineError> {
        let key = (base.to_bits(), scale.to_bits());
        let i = match self.rope.iter().position(|(k, _)| *k == key) {
            Some(i) => i,
            None => {
                self.rope
                    .push((key, rope_tables(self.p, self.t, head_dim, base, scale)?));
                self.rope.len() - 1
            }
        };
        Ok(&self.rope[i].1)
    }

    fn mask(&mut self, window: Option<usize>) -> Result<Option<&Tensor>, EngineError> {
        let i = match self.masks.iter().position(|(w, _)| *w == window) {
            Some(i) => i,
            None => {
                self.masks
                    .push((window, attention_mask(self.p, self.t, window)?));
                self.masks.len() - 1
            }
        };
        Ok(self.masks[i].1.as_ref())
    }
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

    /// Attention of the one new position at `pos` (already appended to `cache`); q is
    /// `(1, nh, 1, hd)`, the result `(1, 1, nh * hd)`.
    fn decode_attention(
        &self,
        q: &Tensor,
        cache: &KvCache,
        layer: usize,
        pos: usize,
    ) -> Result<Tensor, EngineError> {
        let (kc, vc) = cache
            .buffers(layer)
            .ok_or_else(|| EngineError::Unsupported {
                what: format!("kv cache layer {layer} was not written"),
            })?;
        let (nh, hd) = (self.n_head, self.head_dim);
        let att = DecodeAttention {
            n_head: nh,
            n_kv_head: self.n_kv_head,
            head_dim: hd,
            capacity: cache.capacity(),
            pos,
            window: self.window,
            scale: self.scale as f32,
        };
        let mut out = vec![0f32; nh * hd];
        with_f32(q, |qs| {
            with_f32(kc, |ks| with_f32(vc, |vs| att.run(qs, ks, vs, &mut out)))
        })???;
        Tensor::from_vec(out, (1, 1, nh * hd), &Device::Cpu).ctx("attention output")
    }

    /// x `(1, t, d)` → `(1, t, d)` (summed over ranks).
    fn forward(
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
        let (q, k, v) = {
            let _p = profile::scope(Op::Qkv);
            (self.q.forward(x)?, self.k.forward(x)?, self.v.forward(x)?)
        };
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
        let (cos, sin) = tables.rope(hd, self.rope_base, self.rope_scale)?;
        let q = self.rope(&q, cos, sin)?;
        let k = self.rope(&k, cos, sin)?;
        drop(rope);
        let attention = profile::scope(Op::Attention);
        let (k_all, v_all) = cache.append(layer, &k, &v)?; // (b, nkv, T, hd)
        if b == 1 && t == 1 {
            let y = self.decode_attention(&q, cache, layer, p)?;
            drop(attention);
            let _p = profile::scope(Op::AttnOut);
            return self.o.forward(&y);
        }
        let total = p + t;

        // Grouped-query attention without copying KV: fold the n_rep query heads that share
        // a KV head into the row dimension. q (b, nh, t, hd) -> (b, nkv, n_rep*t, hd).
        let n_rep = nh / nkv;
        let q = (q * self.scale)
            .ctx("scale q")?
            .reshape((b, nkv, n_rep * t, hd))
            .ctx("group q")?;
        let att = q.matmul(&k_all.t().ctx("k^T")?).ctx("q k^T")?; // (b, nkv, n_rep*t, T)
        let att = match tables.mask(self.window)? {
            Some(m) => att
                .reshape((b, nkv, n_rep, t, total))
                .and_then(|a| a.broadcast_add(m))
                .and_then(|a| a.reshape((b, nkv, n_rep * t, total)))
                .ctx("mask")?,
            None => att,
        };
        let att = candle_nn::ops::softmax_last_dim(&att).ctx("softmax")?;
        let y = att.matmul(&v_all).ctx("att v")?; // (b, nkv, n_rep*t, hd)
        let y = y
            .reshape((b, nh, t, hd))
            .and_then(|y| y.transpose(1, 2))
            .and_then(|y| y.reshape((b, t, nh * hd)))
            .ctx("merge heads")?;
        drop(attention);
        let _p = profile::scope(Op::AttnOut);
        self.o.forward(&y)
    }
}

/// The gated feed-forward block over this rank's features.
#[derive(Debug)]
pub struct FeedForward {
    gate: ColumnLinear,
    up: ColumnLinear,
    down: RowLinear,
    activation: Activation,
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
        Ok(FeedForward {
            gate: ColumnLinear::load(
                src,
                &format!("{p}.ffn_gate"),
                cfg.ffn,
                cfg.hidden,
                shard.ffn.clone(),
                false,
            )?,
            up: ColumnLinear::load(
                src,
                &format!("{p}.ffn_up"),
                cfg.ffn,
                cfg.hidden,
                shard.ffn.clone(),
                false,
            )?,
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

    fn forward(&self, x: &Tensor) -> Result<Tensor, EngineError> {
        let (g, u) = {
            let _p = profile::scope(Op::GateUp);
            (self.gate.forward(x)?, self.up.forward(x)?)
        };
        let act = profile::scope(Op::Activation);
        let g = match self.activation {
            Activation::Silu => candle_nn::ops::silu(&g),
            Activation::GeluTanh => g.gelu(),
        }
        .ctx("activation")?;
        let h = (g * u).ctx("gate * up")?;
        drop(act);
        let _p = profile::scope(Op::Down);
        self.down.forward(&h)
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
        cache: &mut KvCache,
        layer: usize,
        tables: &mut StepTables,
    ) -> Result<Tensor, EngineError> {
        // attention with residual
        let xn = profiled(Op::Norm, || self.attn_norm.forward(x))?;
        let mut a = self.attn.forward(&xn, cache, layer, tables)?;
        if let Some(n) = &self.post_attn_norm {
            a = profiled(Op::Norm, || n.forward(&a))?;
        }
        let h = profiled(Op::Residual, || (x + a).ctx("attention residual"))?;
        // feed-forward with residual
        let hn = profiled(Op::Norm, || self.ffn_norm.forward(&h))?;
        let mut f = self.ffn.forward(&hn)?;
        if let Some(n) = &self.post_ffn_norm {
            f = profiled(Op::Norm, || n.forward(&f))?;
        }
        profiled(Op::Residual, || (h + f).ctx("ffn residual"))
    }
}

/// The token embedding table, which is also the output head when the model ties them.
enum Embedding {
    /// Read row by row through the kernels' dequantizer.
    Kernel(Arc<QuantMatrix>),
    /// A type the kernels do not cover: candle's lookup.
    Candle(Arc<QTensor>),
}

impl Embedding {
    fn load(src: &dyn WeightSource) -> Result<Self, EngineError> {
        let name = "token_embd.weight";
        if crate::layers::candle_only() {
            return Ok(Embedding::Candle(Arc::new(src.load(name, &Slice::Full)?)));
        }
        if let Some(m) = load_quant_matrix(src, name, &Slice::Full)? {
            return Ok(Embedding::Kernel(Arc::new(m)));
        }
        let q = src.load(name, &Slice::Full)?;
        Ok(match quant_matrix(name, &q)? {
            Some(m) => Embedding::Kernel(Arc::new(m)),
            None => Embedding::Candle(Arc::new(q)),
        })
    }

    /// The rows of `tokens` (ids already checked against the vocabulary), `(t, d)`.
    fn lookup(&self, tokens: &[u32]) -> Result<Tensor, EngineError> {
        match self {
            Embedding::Kernel(m) => {
                let d = m.cols();
                let mut x = vec![0f32; tokens.len() * d];
                for (&id, row) in tokens.iter().zip(x.chunks_exact_mut(d)) {
                    m.dequantize_row(id as usize, row)
                        .map_err(|e| EngineError::Unsupported {
                            what: format!("embedding lookup: {e}"),
                        })?;
                }
                Tensor::from_vec(x, (tokens.len(), d), &Device::Cpu).ctx("embedding")
            }
            Embedding::Candle(q) => {
                let ids = Tensor::new(tokens, &Device::Cpu).ctx("token ids")?;
                q.embedding(&ids).ctx("embedding")
            }
        }
    }

    /// The same table as an output head (tied embeddings).
    fn as_head(&self) -> Result<Matrix, EngineError> {
        Ok(match self {
            Embedding::Kernel(m) => Matrix::Kernel(m.clone()),
            Embedding::Candle(q) => {
                Matrix::Candle(QMatMul::from_arc(q.clone()).ctx("tied output head")?)
            }
        })
    }
}

/// A loaded model (one rank's shard of it).
pub struct Transformer {
    cfg: ModelConfig,
    embed: Embedding,
    blocks: Vec<Block>,
    norm: RmsNorm,
    head: ColumnLinear,
}

impl std::fmt::Debug for Transformer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transformer")
            .field("cfg", &self.cfg)
            .field("blocks", &self.blocks.len())
            .finish()
    }
}

impl Transformer {
    /// Loads every block whole (world size 1).
    ///
    /// # Errors
    /// When a tensor is missing or misshapen.
    pub fn load(
        src: &dyn WeightSource,
        cfg: ModelConfig,
        comm: Arc<dyn Communicator>,
    ) -> Result<Self, EngineError> {
        let embed_shape = src.shape("token_embd.weight")?;
        if embed_shape != [cfg.vocab, cfg.hidden] {
            return Err(EngineError::Shape {
                tensor: "token_embd.weight".into(),
                found: embed_shape,
                expected: vec![cfg.vocab, cfg.hidden],
            });
        }
        let embed = Embedding::load(src)?;
        let shard = LayerShard::full(&cfg);
        let mut blocks = Vec::with_capacity(cfg.n_layer);
        for layer in 0..cfg.n_layer {
            blocks.push(Block::load(src, &cfg, layer, &shard, comm.clone())?);
        }
        let norm = RmsNorm::load(src, "output_norm.weight", cfg.hidden, cfg.rms_eps)?;
        let head = if src.contains("output.weight") {
            ColumnLinear::load(src, "output", cfg.vocab, cfg.hidden, 0..cfg.vocab, false)?
        } else {
            ColumnLinear::from_matrix(embed.as_head()?)
        };
        Ok(Transformer {
            cfg,
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

    /// A KV cache for up to `capacity` tokens.
    pub fn new_cache(&self, capacity: usize) -> KvCache {
        KvCache::new(
            self.cfg.n_layer,
            self.cfg.n_kv_head,
            self.cfg.head_dim,
            capacity,
        )
    }

    /// Runs `tokens` (appended after what `cache` holds) and returns the logits `(n, vocab)`
    /// of the last `n_logits` positions.
    ///
    /// # Errors
    /// When the tokens do not fit the cache, an id is out of range, or a tensor op fails.
    pub fn forward(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        n_logits: usize,
    ) -> Result<Tensor, EngineError> {
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
        let embed = profile::scope(Op::Embed);
        let mut x = self.embed.lookup(tokens)?.unsqueeze(0).ctx("embedding")?; // (1, t, d)
        if self.cfg.embed_scale != 1.0 {
            // ggml scales in f32: round the factor the same way.
            x = (x * (self.cfg.embed_scale as f32) as f64).ctx("embedding scale")?;
        }
        drop(embed);
        let mut tables = StepTables::new(cache.len(), t);
        for (layer, block) in self.blocks.iter().enumerate() {
            x = block.forward(&x, cache, layer, &mut tables)?;
        }
        cache.advance(t);
        let _p = profile::scope(Op::Head);
        let n = n_logits.clamp(1, t);
        let x = x.narrow(1, t - n, n).ctx("last positions")?;
        let x = self.norm.forward(&x)?;
        let logits = self.head.forward(&x)?; // (1, n, vocab)
        logits
            .squeeze(0)
            .and_then(|l| l.to_dtype(DType::F32))
            .ctx("logits")
    }

    /// Logits of the last position only, as a vector.
    ///
    /// # Errors
    /// As [`Transformer::forward`].
    pub fn forward_last(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
    ) -> Result<Vec<f32>, EngineError> {
        let l = self.forward(tokens, cache, 1)?;
        l.squeeze(0).and_then(|l| l.to_vec1::<f32>()).ctx("logits")
    }
}

/// Runs `f` on the f32 values of contiguous CPU tensor `t`.
fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R, EngineError> {
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        return Err(EngineError::Unsupported {
            what: "attention runs on the CPU only".into(),
        });
    };
    let all = cpu.as_slice::<f32>().ctx("attention input")?;
    let (a, b) = layout
        .contiguous_offsets()
        .ok_or_else(|| EngineError::Unsupported {
            what: "a non-contiguous attention input".into(),
        })?;
    Ok(f(&all[a..b]))
}

/// Runs `f`, timing it as `op`.
fn profiled<T>(op: Op, f: impl FnOnce() -> T) -> T {
    let _p = profile::scope(op);
    f()
}

/// Index of the largest value (the first one on ties), for greedy decoding and tests.
pub fn argmax(xs: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in xs.iter().enumerate() {
        if x > xs[best] {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mask_causal_and_window() {
        let m = attention_mask(0, 3, None)
            .unwrap()
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        assert_eq!(m[0][1], f32::NEG_INFINITY);
        assert_eq!(m[2][0], 0.0);
        assert!(attention_mask(5, 1, None).unwrap().is_none());
        // window 2: query at position 3 sees keys 2 and 3 only
        let m = attention_mask(3, 1, Some(2))
            .unwrap()
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        assert_eq!(m[0], vec![f32::NEG_INFINITY, f32::NEG_INFINITY, 0.0, 0.0]);
    }

    #[test]
    fn rope_table_position_zero_is_identity() {
        let (c, s) = rope_tables(0, 1, 8, 10000.0, 1.0).unwrap();
        assert_eq!(c.to_vec2::<f32>().unwrap()[0], vec![1.0; 4]);
        assert_eq!(s.to_vec2::<f32>().unwrap()[0], vec![0.0; 4]);
    }

    #[test]
    fn argmax_first_on_ties() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
    }
}
