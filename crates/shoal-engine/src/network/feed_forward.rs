//! The gated feed-forward block over a rank's features: `down(act(gate(x)) * up(x))`, the
//! gate and up projections held as the backend's pair (cut by output rows), the down
//! projection cut by block-aligned input columns, its partial sums made whole by one
//! all-reduce when the features are cut across ranks. A dense layer's feed-forward and a
//! mixture of experts' shared experts are both one.

use std::ops::Range;

use shoal_comm::Communicator;

use super::linear::{Linear, Tensors};
use super::Workspace;
use crate::arch::Role;
use crate::backend::Backend;
use crate::config::{Activation, ModelConfig};
use crate::profile::{self, Op};
use crate::EngineError;

/// The roles of a feed-forward's gate, up and down projections.
pub(crate) type FfnRoles = [Role; 3];

/// A dense layer's feed-forward.
pub(crate) const DENSE: FfnRoles = [Role::FfnGate, Role::FfnUp, Role::FfnDown];

/// A mixture of experts' shared experts.
pub(crate) const SHARED: FfnRoles = [Role::FfnGateShexp, Role::FfnUpShexp, Role::FfnDownShexp];

/// One layer's feed-forward on one rank.
pub(crate) struct FeedForward<B: Backend> {
    gate_up: B::GateUp,
    down: Linear<B>,
    activation: Activation,
}

impl<B: Backend> FeedForward<B> {
    /// Loads layer `layer`'s feed-forward of `roles`, `width` features wide, of which this
    /// rank holds `features`.
    ///
    /// # Errors
    /// When a tensor is missing or misshapen.
    pub fn load(
        t: &Tensors<'_, B>,
        cfg: &ModelConfig,
        layer: usize,
        roles: FfnRoles,
        width: usize,
        features: Range<usize>,
    ) -> Result<Self, EngineError> {
        let [gate, up, down] = roles;
        let column = |role: Role| -> Result<B::Matrix, EngineError> {
            let name = t.layer_required(role, layer)?;
            let l = Linear::rows(t, &name, None, [width, cfg.hidden], features.clone())?;
            std::sync::Arc::try_unwrap(l.w).map_err(|_| EngineError::Internal {
                what: format!("{name} is shared before it is paired"),
            })
        };
        let (gate, up) = (column(gate)?, column(up)?);
        let gate_up = t.be.gate_up(gate, up);
        let down = Linear::cols(
            t,
            &t.layer_required(down, layer)?,
            [cfg.hidden, width],
            features,
        )?;
        Ok(FeedForward {
            gate_up,
            down,
            activation: cfg.activation,
        })
    }

    /// This rank's part of the feed-forward of the step's normed rows `ws.xn` into `out`
    /// (partial sums when the features are cut across ranks).
    ///
    /// # Errors
    /// When the rows do not fit the weights.
    pub fn partial(&self, be: &B, ws: &mut Workspace<B>, out: Out) -> Result<(), EngineError> {
        be.gated(&self.gate_up, self.activation, &ws.xn, &mut ws.h)?;
        let _p = profile::scope(Op::Down);
        let out = match out {
            Out::Out => &mut ws.out,
            Out::Aux => &mut ws.aux,
        };
        be.matmul(&[&*self.down.w], &ws.h, &mut [out])
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
        self.partial(be, ws, Out::Out)?;
        if tp.world_size() > 1 {
            let _p = profile::scope(Op::Down);
            be.all_reduce(tp, &mut ws.out)?;
        }
        Ok(())
    }
}

/// Which workspace buffer a partial feed-forward writes.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Out {
    /// `ws.out`.
    Out,
    /// `ws.aux`.
    Aux,
}
