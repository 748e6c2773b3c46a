//! Multi-head latent attention (DeepSeek V2/V3, Kimi K2) over a rank's query heads: the
//! queries (projected directly, or through a normed compression), the token's latent and
//! rope key (`attn_kv_a_mqa`, held whole by every rank: each rank caches the whole latent),
//! the backend's absorbed attention over the cached latents, and the output projection,
//! whose partial sums one all-reduce makes whole when the heads are cut across ranks.
//!
//! Files from current converters hold each head's key and value matrices apart (`attn_k_b`,
//! `attn_v_b`); older ones hold them stacked in `attn_kv_b`, whose key part is transposed
//! here once at load into the absorbed form's layout.

use std::ops::Range;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use shoal_comm::Communicator;

use super::linear::{Linear, Norm, Tensors};
use super::Workspace;
use crate::arch::Role;
use crate::backend::{Backend, LatentLayer, Rope, YarnRope};
use crate::config::{MlaConfig, ModelConfig};
use crate::profile::{self, Op};
use crate::shard::LayerShard;
use crate::weights::{Slice, WeightSource};
use crate::EngineError;

/// How a layer makes its queries.
enum Queries<B: Backend> {
    /// One projection.
    Direct(Linear<B>),
    /// A compression, its norm, and the projection into heads.
    Compressed {
        a: Linear<B>,
        norm: Norm<B>,
        b: Linear<B>,
    },
}

/// One layer's latent attention on one rank.
pub(crate) struct LatentAttention<B: Backend> {
    q: Queries<B>,
    kv_a: Linear<B>,
    o: Linear<B>,
    layer: LatentLayer<B>,
}

impl<B: Backend> LatentAttention<B> {
    /// Loads layer `layer`'s attention as `shard` cuts it.
    ///
    /// # Errors
    /// When a tensor is missing or misshapen.
    pub fn load(
        t: &Tensors<'_, B>,
        cfg: &ModelConfig,
        layer: usize,
        shard: &LayerShard,
    ) -> Result<Self, EngineError> {
        let m = cfg.mla.ok_or_else(|| EngineError::Internal {
            what: format!("layer {layer} loaded as latent attention in a model without it"),
        })?;
        let (d, nh) = (cfg.hidden, cfg.n_head);
        let qw = m.nope_dims + m.rope_dims;
        let heads = shard.heads.clone();
        let per_head = |w: usize| heads.start * w..heads.end * w;
        let q = match t.layer(Role::AttnQ, layer)? {
            Some(name) => {
                Queries::Direct(Linear::rows(t, &name, None, [nh * qw, d], per_head(qw))?)
            }
            None => {
                let a = t.layer_required(Role::AttnQA, layer)?;
                let norm = t.layer_required(Role::AttnQANorm, layer)?;
                let b = t.layer_required(Role::AttnQB, layer)?;
                if m.q_lora_rank == 0 {
                    return Err(EngineError::Config {
                        file: t.src.describe(),
                        problem: "the file compresses queries (attn_q_a) but gives no \
                                  attention.q_lora_rank"
                            .into(),
                    });
                }
                let r = m.q_lora_rank;
                Queries::Compressed {
                    a: Linear::rows(t, &a, None, [r, d], 0..r)?,
                    norm: Norm::load(t, &norm, r, cfg.rms_eps)?,
                    b: Linear::rows(t, &b, None, [nh * qw, r], per_head(qw))?,
                }
            }
        };
        let dims = m.kv_lora_rank + m.rope_dims;
        let kv_a = Linear::rows(
            t,
            &t.layer_required(Role::AttnKvAMqa, layer)?,
            None,
            [dims, d],
            0..dims,
        )?;
        let kv_norm = t.layer_required(Role::AttnKvANorm, layer)?;
        t.check_shape(&kv_norm, &[m.kv_lora_rank])?;
        let kv_norm = t.be.vector(t.values(&kv_norm, &Slice::Full)?);
        let (k_b, v_b) = head_matrices(t, &m, nh, layer, heads.clone())?;
        let o = Linear::cols(
            t,
            &t.layer_required(Role::AttnOut, layer)?,
            [d, nh * m.v_dims],
            per_head(m.v_dims),
        )?;
        let base = cfg.rope_theta;
        Ok(LatentAttention {
            q,
            kv_a,
            o,
            layer: LatentLayer {
                kv_norm,
                eps: cfg.rms_eps as f32,
                k_b,
                v_b,
                rope: Rope {
                    style: cfg.rope_style,
                    head_dim: m.rope_dims,
                    dims: m.rope_dims,
                    base,
                    scale: cfg.rope_scale,
                    freq_factors: None,
                    yarn: cfg
                        .yarn
                        .map(|y| YarnRope::new(&y, m.rope_dims, base, cfg.rope_scale)),
                },
                n_head: heads.len(),
                kv_lora_rank: m.kv_lora_rank,
                rope_dims: m.rope_dims,
                nope_dims: m.nope_dims,
                v_dims: m.v_dims,
                scale: cfg.attn_scale as f32,
            },
        })
    }

    /// The attention of the step's normed rows `ws.xn` into `ws.out` (summed over the
    /// ranks of `tp`), appending their latents to each sequence's cache.
    ///
    /// # Errors
    /// When a cache has no room, or a peer fails.
    pub fn forward(
        &self,
        be: &B,
        ws: &mut Workspace<B>,
        kv: &mut [&mut B::Kv],
        layer: usize,
        tp: &dyn Communicator,
    ) -> Result<(), EngineError> {
        {
            let _p = profile::scope(Op::Qkv);
            match &self.q {
                Queries::Direct(q) => {
                    be.matmul(&[&*q.w, &*self.kv_a.w], &ws.xn, &mut [&mut ws.q, &mut ws.k])?
                }
                Queries::Compressed { a, norm, b } => {
                    be.matmul(
                        &[&*a.w, &*self.kv_a.w],
                        &ws.xn,
                        &mut [&mut ws.aux, &mut ws.k],
                    )?;
                    be.rms_norm_in_place(&mut ws.aux, &norm.w, norm.eps);
                    be.matmul(&[&*b.w], &ws.aux, &mut [&mut ws.q])?;
                }
            }
        }
        {
            let _p = profile::scope(Op::Attention);
            be.latent_attention(
                &ws.q,
                &ws.k,
                &self.layer,
                kv,
                layer,
                &ws.rows,
                &mut ws.tables,
                &mut ws.att,
            )?;
        }
        let _p = profile::scope(Op::AttnOut);
        be.matmul(&[&*self.o.w], &ws.att, &mut [&mut ws.out])?;
        if tp.world_size() > 1 {
            be.all_reduce(tp, &mut ws.out)?;
        }
        Ok(())
    }
}

/// Each of `heads`' key matrix `[kv_lora_rank, nope_dims]` (absorbed into the query) and
/// value matrix `[v_dims, kv_lora_rank]`, from `attn_k_b`/`attn_v_b` or from `attn_kv_b`.
#[allow(clippy::type_complexity)]
fn head_matrices<B: Backend>(
    t: &Tensors<'_, B>,
    m: &MlaConfig,
    n_head: usize,
    layer: usize,
    heads: Range<usize>,
) -> Result<(Vec<B::Matrix>, Vec<B::Matrix>), EngineError> {
    let (r, nope, v) = (m.kv_lora_rank, m.nope_dims, m.v_dims);
    if let (Some(kb), Some(vb)) = (t.layer(Role::AttnKB, layer)?, t.layer(Role::AttnVB, layer)?) {
        t.check_shape(&kb, &[n_head, r, nope])?;
        t.check_shape(&vb, &[n_head, v, r])?;
        let mut k_b = Vec::with_capacity(heads.len());
        let mut v_b = Vec::with_capacity(heads.len());
        for h in heads {
            k_b.push(t.be.matrix(t.src, &kb, &Slice::matrix(h, Slice::Full))?);
            v_b.push(t.be.matrix(t.src, &vb, &Slice::matrix(h, Slice::Full))?);
        }
        return Ok((k_b, v_b));
    }
    let Some(kvb) = t.layer(Role::AttnKvB, layer)? else {
        return Err(EngineError::MissingTensor {
            file: t.src.describe(),
            name: format!("blk.{layer}.attn_k_b.weight (or blk.{layer}.attn_kv_b.weight)"),
        });
    };
    t.check_shape(&kvb, &[n_head * (nope + v), r])?;
    let mut k_b = Vec::with_capacity(heads.len());
    let mut v_b = Vec::with_capacity(heads.len());
    for h in heads {
        let base = h * (nope + v);
        let k = t.values(&kvb, &Slice::Rows(base..base + nope))?;
        let mut kt = vec![0f32; r * nope];
        for (i, row) in k.chunks_exact(r).enumerate() {
            for (j, &x) in row.iter().enumerate() {
                kt[j * nope + i] = x;
            }
        }
        let held = Held {
            name: format!("blk.{layer}.attn_k_b.{h} (from attn_kv_b)"),
            shape: [r, nope],
            values: kt,
        };
        k_b.push(t.be.matrix(&held, &held.name, &Slice::Full)?);
        v_b.push(t.be.matrix(t.src, &kvb, &Slice::Rows(base + nope..base + nope + v))?);
    }
    Ok((k_b, v_b))
}

/// One f32 matrix made at load time, as a weight source.
struct Held {
    name: String,
    shape: [usize; 2],
    values: Vec<f32>,
}

impl WeightSource for Held {
    fn describe(&self) -> String {
        self.name.clone()
    }

    fn contains(&self, name: &str) -> bool {
        name == self.name
    }

    fn shape(&self, name: &str) -> Result<Vec<usize>, EngineError> {
        if name != self.name {
            return Err(EngineError::MissingTensor {
                file: self.describe(),
                name: name.into(),
            });
        }
        Ok(self.shape.to_vec())
    }

    fn load(&self, name: &str, slice: &Slice) -> Result<QTensor, EngineError> {
        if name != self.name || *slice != Slice::Full {
            return Err(EngineError::Internal {
                what: format!("{}: {slice:?} of `{name}`", self.name),
            });
        }
        let t = Tensor::from_slice(&self.values, &self.shape[..], &Device::Cpu)
            .map_err(|e| EngineError::candle(format!("building `{name}`"), e))?;
        QTensor::quantize(&t, GgmlDType::F32)
            .map_err(|e| EngineError::candle(format!("building `{name}`"), e))
    }
}
