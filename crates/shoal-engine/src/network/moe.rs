//! A mixture-of-experts feed-forward on one rank: the router (held whole by every rank, with
//! its bias where the file has one) scores the experts for each row of the replicated hidden
//! state, [`Routing`] picks each row's experts and weights, the backend runs the rows
//! through the routed experts this rank holds (whole experts, or a slice of every expert's
//! features; their biases with them, the down bias on one rank of a feature split), the
//! shared experts' slice adds its part, and one all-reduce over the stage's ranks, summed in
//! rank order, makes the output whole. Every rank computes the same routes from the same
//! values, so no rank waits for another's choice.

use shoal_comm::Communicator;

use super::feed_forward::{FeedForward, Out, SHARED};
use super::linear::{Linear, Tensors};
use super::routing::Routing;
use super::Workspace;
use crate::arch::Role;
use crate::backend::{Backend, ExpertBias, HeldExpert};
use crate::config::{Activation, ModelConfig};
use crate::profile::{self, Op};
use crate::shard::LayerShard;
use crate::weights::Slice;
use crate::EngineError;

/// One layer's mixture of experts on one rank.
pub(crate) struct MoeFeedForward<B: Backend> {
    router: Linear<B>,
    routing: Routing,
    experts: B::Experts,
    n_expert: usize,
    shared: Option<FeedForward<B>>,
    activation: Activation,
}

impl<B: Backend> MoeFeedForward<B> {
    /// Loads layer `layer`'s experts as `shard` cuts them.
    ///
    /// # Errors
    /// When a tensor is missing, misshapen, or its expert count disagrees with the config.
    pub fn load(
        t: &Tensors<'_, B>,
        cfg: &ModelConfig,
        layer: usize,
        shard: &LayerShard,
    ) -> Result<Self, EngineError> {
        let m = cfg.moe.as_ref().ok_or_else(|| EngineError::Internal {
            what: format!("layer {layer} loaded as experts in a model without them"),
        })?;
        let (e, f, d) = (m.n_expert, m.expert_ffn, cfg.hidden);
        let router_name = t.layer_required(Role::FfnGateInp, layer)?;
        let router_bias = t.layer(Role::FfnGateInpBias, layer)?;
        let router = Linear::rows(t, &router_name, router_bias.as_deref(), [e, d], 0..e)?;
        let bias = match t.layer(Role::FfnExpProbsBias, layer)? {
            Some(name) => {
                t.check_shape(&name, &[e])?;
                Some(t.values(&name, &Slice::Full)?)
            }
            None => None,
        };
        let down = t.layer_required(Role::FfnDownExps, layer)?;
        t.check_shape(&down, &[e, d, f])?;
        // gate and up apart, or fused (each expert's gate rows, then its up rows)
        let fused = match t.layer(Role::FfnGateExps, layer)? {
            Some(_) => None,
            None => t.layer(Role::FfnGateUpExps, layer)?,
        };
        let (gate, up, up_offset) = match fused {
            Some(name) => {
                t.check_shape(&name, &[e, 2 * f, d])?;
                (name.clone(), name, f)
            }
            None => {
                let (gate, up) = (
                    t.layer_required(Role::FfnGateExps, layer)?,
                    t.layer_required(Role::FfnUpExps, layer)?,
                );
                t.check_shape(&gate, &[e, f, d])?;
                t.check_shape(&up, &[e, f, d])?;
                (gate, up, 0)
            }
        };
        let features = shard.expert_ffn.clone();
        let rows = |offset: usize| {
            if offset == 0 && features == (0..f) {
                Slice::Full
            } else {
                Slice::Rows(offset + features.start..offset + features.end)
            }
        };
        let cols = if features == (0..f) {
            Slice::Full
        } else {
            Slice::Cols(features.clone())
        };
        let biases = ExpertBiases::load(t, layer, [e, f, d])?;
        // a feature split's partial sums must count the down bias once
        let adds_down = features.start == 0 && !features.is_empty();
        let mut held = Vec::with_capacity(shard.experts.len());
        for x in shard.experts.clone() {
            let g = t.be.matrix(t.src, &gate, &Slice::matrix(x, rows(0)))?;
            let u =
                t.be.matrix(t.src, &up, &Slice::matrix(x, rows(up_offset)))?;
            let dn = t.be.matrix(t.src, &down, &Slice::matrix(x, cols.clone()))?;
            held.push(HeldExpert {
                id: x,
                gate_up: t.be.gate_up(g, u),
                down: dn,
                bias: biases
                    .as_ref()
                    .map(|b| b.of(x, features.clone(), adds_down)),
            });
        }
        for name in [&gate, &up, &down] {
            t.src.release(name);
        }
        let shared = if m.n_shared > 0 {
            Some(FeedForward::load(
                t,
                cfg,
                layer,
                SHARED,
                m.n_shared * f,
                shard.shared_ffn.clone(),
            )?)
        } else {
            None
        };
        Ok(MoeFeedForward {
            router,
            routing: Routing::new(m, bias),
            experts: t.be.experts(held, e),
            n_expert: e,
            shared,
            activation: cfg.activation,
        })
    }

    /// The mixture of the step's normed rows `ws.xn` into `ws.out` (summed over the ranks
    /// of `tp`).
    ///
    /// # Errors
    /// When a peer fails.
    pub fn forward(
        &self,
        be: &B,
        ws: &mut Workspace<B>,
        tp: &dyn Communicator,
    ) -> Result<(), EngineError> {
        {
            let _p = profile::scope(Op::Router);
            be.matmul(&[&*self.router.w], &ws.xn, &mut [&mut ws.aux])?;
            if let Some(b) = &self.router.bias {
                be.add_bias(&mut ws.aux, b);
            }
            let logits = be.host(&ws.aux)?;
            self.routing.route(&logits, self.n_expert, &mut ws.routes);
        }
        be.moe(
            &self.experts,
            self.activation,
            &ws.xn,
            &ws.routes,
            &mut ws.out,
        )?;
        if let Some(shared) = &self.shared {
            shared.partial(be, ws, Out::Aux)?;
            let _p = profile::scope(Op::Residual);
            be.add(&mut ws.out, &ws.aux);
        }
        if tp.world_size() > 1 {
            let _p = profile::scope(Op::Down);
            be.all_reduce(tp, &mut ws.out)?;
        }
        Ok(())
    }
}

/// A layer's expert biases as the file holds them (gpt-oss): `[n_expert, expert_ffn]` for
/// the gate and up projections, `[n_expert, hidden]` for the down projection.
struct ExpertBiases {
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
    expert_ffn: usize,
    hidden: usize,
}

impl ExpertBiases {
    /// Layer `layer`'s expert biases, when the file has them (all three, or none).
    ///
    /// # Errors
    /// When only some are present, or one is misshapen.
    fn load<B: Backend>(
        t: &Tensors<'_, B>,
        layer: usize,
        [e, f, d]: [usize; 3],
    ) -> Result<Option<Self>, EngineError> {
        let names = [
            t.layer(Role::FfnGateExpsBias, layer)?,
            t.layer(Role::FfnUpExpsBias, layer)?,
            t.layer(Role::FfnDownExpsBias, layer)?,
        ];
        let [Some(gate), Some(up), Some(down)] = names else {
            if let Some(name) = names.iter().flatten().next() {
                return Err(EngineError::Load {
                    what: format!(
                        "`{name}` is in the file without the other expert biases of layer \
                         {layer}; the file is incomplete"
                    ),
                });
            }
            return Ok(None);
        };
        t.check_shape(&gate, &[e, f])?;
        t.check_shape(&up, &[e, f])?;
        t.check_shape(&down, &[e, d])?;
        Ok(Some(ExpertBiases {
            gate: t.values(&gate, &Slice::Full)?,
            up: t.values(&up, &Slice::Full)?,
            down: t.values(&down, &Slice::Full)?,
            expert_ffn: f,
            hidden: d,
        }))
    }

    /// Expert `x`'s biases for the rank holding its `features`; the down bias only where
    /// `adds_down`.
    fn of(&self, x: usize, features: std::ops::Range<usize>, adds_down: bool) -> ExpertBias {
        let at = x * self.expert_ffn;
        let part = at + features.start..at + features.end;
        ExpertBias {
            gate: self.gate[part.clone()].to_vec(),
            up: self.up[part].to_vec(),
            down: adds_down.then(|| self.down[x * self.hidden..(x + 1) * self.hidden].to_vec()),
        }
    }
}
