//! One transformer block: a norm, attention (grouped-query, or latent for DeepSeek), an
//! optional norm of its output (Gemma 3), the residual add fused with the feed-forward's
//! norm, the feed-forward (dense, or a mixture of experts), an optional norm of its output,
//! and the second residual add. The same definition runs prefill chunks, batched decode
//! steps and one-token steps; the rows of the step say which.

use std::sync::Arc;

use shoal_comm::Communicator;

use super::attention::Attention;
use super::feed_forward::{FeedForward, DENSE};
use super::latent::LatentAttention;
use super::linear::{Norm, Tensors};
use super::moe::MoeFeedForward;
use super::Workspace;
use crate::arch::Role;
use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::profile::{self, Op};
use crate::shard::LayerShard;
use crate::EngineError;

/// A block's attention.
enum Mixer<B: Backend> {
    /// Grouped-query attention over cached keys and values.
    Heads(Attention<B>),
    /// Latent attention over cached latents.
    Latent(LatentAttention<B>),
}

/// A block's feed-forward.
enum Ffn<B: Backend> {
    /// One gated feed-forward.
    Dense(FeedForward<B>),
    /// Routed (and shared) experts.
    Experts(MoeFeedForward<B>),
}

/// One block on one rank.
pub(crate) struct Block<B: Backend> {
    attn_norm: Norm<B>,
    attn: Mixer<B>,
    post_attn_norm: Option<Norm<B>>,
    ffn_norm: Norm<B>,
    ffn: Ffn<B>,
    post_ffn_norm: Option<Norm<B>>,
}

impl<B: Backend> Block<B> {
    /// Where the profile counts this block's ops.
    pub fn profile_part(&self) -> profile::Part {
        match self.ffn {
            Ffn::Dense(_) => profile::Part::DenseLayer,
            Ffn::Experts(_) => profile::Part::MoeLayer,
        }
    }

    /// Loads block `layer` as `shard` cuts it.
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
        let (d, eps) = (cfg.hidden, cfg.rms_eps);
        let norm = |role: Role| Norm::load(t, &t.layer_required(role, layer)?, d, eps);
        let attn = if cfg.mla.is_some() {
            Mixer::Latent(LatentAttention::load(t, cfg, layer, shard)?)
        } else {
            Mixer::Heads(Attention::load(t, cfg, layer, shard, freq_factors)?)
        };
        let ffn = if cfg.is_moe_layer(layer) {
            Ffn::Experts(MoeFeedForward::load(t, cfg, layer, shard)?)
        } else {
            Ffn::Dense(FeedForward::load(
                t,
                cfg,
                layer,
                DENSE,
                cfg.ffn,
                shard.ffn.clone(),
            )?)
        };
        Ok(Block {
            attn_norm: norm(Role::AttnNorm)?,
            attn,
            post_attn_norm: Norm::layer(t, Role::PostAttnNorm, layer, d, eps)?,
            ffn_norm: norm(Role::FfnNorm)?,
            ffn,
            post_ffn_norm: Norm::layer(t, Role::PostFfnNorm, layer, d, eps)?,
        })
    }

    /// The block over the step's residual stream `ws.x`, in place; `layer` is its index
    /// among the rank's layers (its caches' layer).
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
            let _p = profile::scope(Op::Norm);
            be.rms_norm(&ws.x, &self.attn_norm.w, self.attn_norm.eps, &mut ws.xn);
        }
        match &self.attn {
            Mixer::Heads(a) => a.forward(be, ws, kv, layer, tp)?,
            Mixer::Latent(a) => a.forward(be, ws, kv, layer, tp)?,
        }
        {
            let _p = profile::scope(Op::Norm);
            if let Some(n) = &self.post_attn_norm {
                be.rms_norm_in_place(&mut ws.out, &n.w, n.eps);
            }
            // the residual and the feed-forward's norm of it in one pass
            be.add_rms_norm(
                &mut ws.x,
                &ws.out,
                &self.ffn_norm.w,
                self.ffn_norm.eps,
                &mut ws.xn,
            );
        }
        match &self.ffn {
            Ffn::Dense(f) => f.forward(be, ws, tp)?,
            Ffn::Experts(f) => f.forward(be, ws, tp)?,
        }
        if let Some(n) = &self.post_ffn_norm {
            let _p = profile::scope(Op::Norm);
            be.rms_norm_in_place(&mut ws.out, &n.w, n.eps);
        }
        let _p = profile::scope(Op::Residual);
        be.add(&mut ws.x, &ws.out);
        Ok(())
    }
}
