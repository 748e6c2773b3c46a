//! The gated feed-forward block over a rank's features: `down(act(gate(x)) * up(x))`, the
//! gate and up projections held as the backend's pair (cut by output rows), the down
//! projection cut by block-aligned input columns, its partial sums made whole by one
//! all-reduce when the features are cut across ranks.

use shoal_comm::Communicator;

use super::linear::{Linear, Tensors};
use super::Workspace;
use crate::arch::Role;
use crate::backend::Backend;
use crate::config::{Activation, ModelConfig};
use crate::profile::{self, Op};
use crate::shard::LayerShard;
use crate::EngineError;

/// One layer's feed-forward on one rank.
pub(crate) struct FeedForward<B: Backend> {
    gate_up: B::GateUp,
    down: Linear<B>,
    activation: Activation,
}

impl<B: Backend> FeedForward<B> {
    /// Loads layer `layer`'s feed-forward as `shard` cuts it.
    ///
    /// # Errors
    /// When a tensor is missing or misshapen.
    pub fn load(
        t: &Tensors<'_, B>,
        cfg: &ModelConfig,
        layer: usize,
        shard: &LayerShard,
    ) -> Result<Self, EngineError> {
        let column = |role: Role| -> Result<B::Matrix, EngineError> {
            let name = t.layer_required(role, layer)?;
            let l = Linear::rows(t, &name, None, [cfg.ffn, cfg.hidden], shard.ffn.clone())?;
            std::sync::Arc::try_unwrap(l.w).map_err(|_| EngineError::Internal {
                what: format!("{name} is shared before it is paired"),
            })
        };
        let (gate, up) = (column(Role::FfnGate)?, column(Role::FfnUp)?);
        let gate_up = t.be.gate_up(gate, up);
        let down = Linear::cols(
            t,
            &t.layer_required(Role::FfnDown, layer)?,
            [cfg.hidden, cfg.ffn],
            shard.ffn.clone(),
        )?;
        Ok(FeedForward {
            gate_up,
            down,
            activation: cfg.activation,
        })
    }

    /// The feed-forward of the step's normed rows `ws.xn` into `ws.out` (summed over the
    /// ranks of `tp`).
    ///
    /// # Errors
    /// When a peer fails.
    pub fn forward(
        &self,
        be: &B,
        ws: &mut Workspace<B>,
        tp: &dyn Communicator,
    ) -> Result<(), EngineError> {
        be.gated(&self.gate_up, self.activation, &ws.xn, &mut ws.h)?;
        let _p = profile::scope(Op::Down);
        be.matmul(&[&*self.down.w], &ws.h, &mut [&mut ws.out])?;
        if tp.world_size() > 1 {
            be.all_reduce(tp, &mut ws.out)?;
        }
        Ok(())
    }
}
