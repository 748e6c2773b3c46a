//! The routed experts of a mixture-of-experts layer on the CPU: each held expert a gate/up
//! pair and a down matrix ([`super::matrix`]) with their biases where the model has them,
//! and the product of a step's rows through
//! their routes. Rows are grouped by expert, so each expert's weights are read once per
//! step whatever the number of rows routed to it (one row for a decode step, many for a
//! prefill chunk or a batched decode step); each group's rows are gathered, run through
//! the expert, and added back into their rows with their routing weights. A row's
//! contributions are added in the order of expert ids, whatever the step's shape, so a
//! row gets the same bits in a prefill chunk as in a decode step.

use std::cell::RefCell;

use super::matrix::{add_row_bias, CpuGateUp, CpuMatrix};
use super::{elementwise, sized, Cpu};
use crate::backend::{ExpertBias, HeldExpert, Routes};
use crate::config::Activation;
use crate::profile::{self, Op};
use crate::EngineError;

/// The routed experts of one layer that a rank holds.
#[derive(Debug)]
pub struct CpuExperts {
    /// Per expert id: its gate/up pair, down projection and biases, where this rank holds it.
    held: Vec<Option<Expert>>,
}

/// One held expert.
#[derive(Debug)]
struct Expert {
    gate_up: CpuGateUp,
    down: CpuMatrix,
    bias: Option<ExpertBias>,
}

/// An expert's work in a step: its id and the `(row, weight)` of every row routed to it.
type Group = (usize, Vec<(usize, f32)>);

thread_local! {
    /// Gathered rows, their gated features and their outputs.
    static BUFFERS: RefCell<(Vec<f32>, Vec<f32>, Vec<f32>)> =
        const { RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

impl CpuExperts {
    /// The experts `held` of `n_expert` in all.
    pub fn new(held: Vec<HeldExpert<Cpu>>, n_expert: usize) -> Self {
        let mut slots: Vec<Option<Expert>> = (0..n_expert).map(|_| None).collect();
        for x in held {
            if let Some(slot) = slots.get_mut(x.id) {
                *slot = Some(Expert {
                    gate_up: x.gate_up,
                    down: x.down,
                    bias: x.bias,
                });
            }
        }
        CpuExperts { held: slots }
    }

    /// The held experts' groups of a step's routes, in expert order.
    fn groups(&self, routes: &Routes) -> Result<Vec<Group>, EngineError> {
        let mut by_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); self.held.len()];
        for (i, (&e, &w)) in routes.experts.iter().zip(&routes.weights).enumerate() {
            let slot = by_expert
                .get_mut(e as usize)
                .ok_or_else(|| EngineError::Internal {
                    what: format!("a route to expert {e} of {}", self.held.len()),
                })?;
            if self.held[e as usize].is_some() {
                slot.push((i / routes.k, w));
            }
        }
        Ok(by_expert
            .into_iter()
            .enumerate()
            .filter(|(_, rows)| !rows.is_empty())
            .collect())
    }

    /// The routed experts' part of the feed-forward (see [`crate::backend::Backend::moe`]).
    pub fn forward(
        &self,
        act: Activation,
        x: &[f32],
        routes: &Routes,
        out: &mut Vec<f32>,
    ) -> Result<(), EngineError> {
        let rows = routes.rows();
        if rows == 0
            || routes.weights.len() != routes.experts.len()
            || !x.len().is_multiple_of(rows)
        {
            return Err(EngineError::Internal {
                what: format!(
                    "{} values routed as {} rows of {} routes",
                    x.len(),
                    rows,
                    routes.k
                ),
            });
        }
        let d = x.len() / rows;
        out.clear();
        sized(out, x.len());
        let groups = self.groups(routes)?;
        BUFFERS.with(|b| {
            // taken out while the products run (see `Cpu::gated`)
            let (mut xs, mut h, mut y) = std::mem::take(&mut *b.borrow_mut());
            let result = (|| {
                for (e, members) in &groups {
                    let Some(expert) = &self.held[*e] else {
                        continue;
                    };
                    let input: &[f32] = if rows == 1 {
                        x
                    } else {
                        let _p = profile::scope(Op::Experts);
                        xs.clear();
                        for &(r, _) in members {
                            xs.extend_from_slice(&x[r * d..(r + 1) * d]);
                        }
                        &xs
                    };
                    let bias = expert.bias.as_ref();
                    expert.gate_up.gated_biased(
                        act,
                        input,
                        bias.map(|b| (&b.gate[..], &b.up[..])),
                        &mut h,
                    )?;
                    {
                        let _p = profile::scope(Op::Down);
                        CpuMatrix::products(&[&expert.down], &h, &mut [&mut y])?;
                        if let Some(down) = bias.and_then(|b| b.down.as_deref()) {
                            add_row_bias(&mut y, down)?;
                        }
                    }
                    let _p = profile::scope(Op::Experts);
                    for (j, &(r, w)) in members.iter().enumerate() {
                        elementwise::add_scaled(
                            &mut out[r * d..(r + 1) * d],
                            &y[j * d..(j + 1) * d],
                            w,
                        );
                    }
                }
                Ok(())
            })();
            *b.borrow_mut() = (xs, h, y);
            result
        })
    }
}
