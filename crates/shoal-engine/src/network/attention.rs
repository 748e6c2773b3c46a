//! Multi-head (grouped-query) self-attention over a rank's query heads, written once for
//! every kind of step: q/k/v products (with biases where the file has them), per-head q/k
//! norms (Qwen3, Gemma 3), RoPE, the backend's attention over its KV cache (with a sink
//! logit per head where the file has them, gpt-oss), and the output projection, whose partial
//! sums one all-reduce makes whole when the heads are cut across ranks (its bias is added
//! after that sum, by every rank).

use std::sync::Arc;

use shoal_comm::Communicator;

use super::linear::{Linear, Norm, Tensors};
use super::Workspace;
use crate::arch::Role;
use crate::backend::{Backend, Heads, Rope, YarnRope};
use crate::config::ModelConfig;
use crate::profile::{self, Op};
use crate::shard::LayerShard;
use crate::weights::Slice;
use crate::EngineError;

/// One layer's attention on one rank.
pub(crate) struct Attention<B: Backend> {
    q: Linear<B>,
    k: Linear<B>,
    v: Linear<B>,
    o: Linear<B>,
    q_norm: Option<Norm<B>>,
    k_norm: Option<Norm<B>>,
    heads: Heads,
    rope: Rope,
}

impl<B: Backend> Attention<B> {
    /// Loads layer `layer`'s attention as `shard` cuts it; `freq_factors` are the global
    /// layers' RoPE frequency divisors, when the model has them.
    ///
    /// # Errors
    /// When a tensor is missing or misshapen.
    pub fn load(
        t: &Tensors<'_, B>,
        cfg: &ModelConfig,
        layer: usize,
        shard: &LayerShard,
        freq_factors: Option<&Arc<[f32]>>,
    ) -> Result<Self, EngineError> {
        let hd = cfg.head_dim;
        let (q_out, kv_out) = (cfg.n_head * hd, cfg.n_kv_head * hd);
        let rows = |r: &std::ops::Range<usize>| r.start * hd..r.end * hd;
        let column =
            |role: Role, bias: Role, out: usize, heads| -> Result<Linear<B>, EngineError> {
                let name = t.layer_required(role, layer)?;
                let bias = t.layer(bias, layer)?;
                Linear::rows(t, &name, bias.as_deref(), [out, cfg.hidden], rows(heads))
            };
        let q = column(Role::AttnQ, Role::AttnQBias, q_out, &shard.heads)?;
        let k = column(Role::AttnK, Role::AttnKBias, kv_out, &shard.kv_heads)?;
        let v = column(Role::AttnV, Role::AttnVBias, kv_out, &shard.kv_heads)?;
        let mut o = Linear::cols(
            t,
            &t.layer_required(Role::AttnOut, layer)?,
            [cfg.hidden, q_out],
            rows(&shard.heads),
        )?;
        if let Some(name) = t.layer(Role::AttnOutBias, layer)? {
            t.check_shape(&name, &[cfg.hidden])?;
            o.bias = Some(t.be.vector(t.values(&name, &Slice::Full)?));
        }
        let sinks = match t.layer(Role::AttnSinks, layer)? {
            Some(name) => {
                t.check_shape(&name, &[cfg.n_head])?;
                let all = t.values(&name, &Slice::Full)?;
                Some(all[shard.heads.clone()].into())
            }
            None => None,
        };
        let local = cfg.is_local_layer(layer);
        let rope_dims = cfg.rope_dims.unwrap_or(hd);
        let scaled = !local || cfg.sliding_rope_scaled;
        let (base, scale) = match (local, scaled) {
            (false, _) => (cfg.rope_theta, cfg.rope_scale),
            (true, true) => (cfg.rope_theta_local, cfg.rope_scale),
            (true, false) => (cfg.rope_theta_local, 1.0),
        };
        Ok(Attention {
            q,
            k,
            v,
            o,
            q_norm: Norm::layer(t, Role::AttnQNorm, layer, hd, cfg.rms_eps)?,
            k_norm: Norm::layer(t, Role::AttnKNorm, layer, hd, cfg.rms_eps)?,
            heads: Heads {
                n_head: shard.heads.len(),
                first_head: shard.heads.start,
                n_kv_head: shard.kv_heads.len(),
                first_kv: shard.kv_heads.start,
                group: cfg.n_head / cfg.n_kv_head.max(1),
                head_dim: hd,
                window: if local { cfg.sliding_window } else { None },
                scale: cfg.attn_scale as f32,
                sinks,
            },
            rope: Rope {
                style: cfg.rope_style,
                head_dim: hd,
                dims: rope_dims,
                base,
                scale,
                freq_factors: if scaled { freq_factors.cloned() } else { None },
                yarn: match (scaled, &cfg.yarn) {
                    (true, Some(y)) => Some(YarnRope::new(y, rope_dims, base, scale)),
                    _ => None,
                },
            },
        })
    }

    /// The attention of the step's normed rows `ws.xn` into `ws.out` (summed over the
    /// ranks of `tp`), appending their keys and values to each sequence's cache.
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
            be.prefetch_kv(kv, layer, &self.heads, &ws.rows);
            be.matmul(
                &[&*self.q.w, &*self.k.w, &*self.v.w],
                &ws.xn,
                &mut [&mut ws.q, &mut ws.k, &mut ws.v],
            )?;
            for (l, y) in [
                (&self.q, &mut ws.q),
                (&self.k, &mut ws.k),
                (&self.v, &mut ws.v),
            ] {
                if let Some(b) = &l.bias {
                    be.add_bias(y, b);
                }
            }
        }
        {
            let _p = profile::scope(Op::Rope);
            if let Some(n) = &self.q_norm {
                be.rms_norm_in_place(&mut ws.q, &n.w, n.eps);
            }
            if let Some(n) = &self.k_norm {
                be.rms_norm_in_place(&mut ws.k, &n.w, n.eps);
            }
            be.rope(&mut ws.q, &self.rope, &ws.rows, &mut ws.tables);
            be.rope(&mut ws.k, &self.rope, &ws.rows, &mut ws.tables);
        }
        {
            let _p = profile::scope(Op::Attention);
            be.attention(
                &ws.q,
                &ws.k,
                &ws.v,
                kv,
                layer,
                &self.heads,
                &ws.rows,
                &mut ws.att,
            )?;
        }
        let _p = profile::scope(Op::AttnOut);
        be.matmul(&[&*self.o.w], &ws.att, &mut [&mut ws.out])?;
        if tp.world_size() > 1 {
            be.all_reduce(tp, &mut ws.out)?;
        }
        // after the sum, on every rank: the same values in the same order as on one rank
        if let Some(b) = &self.o.bias {
            be.add_bias(&mut ws.out, b);
        }
        Ok(())
    }
}
