//! What a node measured running one model shape's decode step, and how the cost model
//! predicts from it. Without one, [`crate::cost`] charges a rank its weight bytes at
//! [`crate::cost::MEM_EFFICIENCY`] of the node's probed bandwidth and nothing else. A
//! calibration replaces that with the node's own figures for the shape (one sequence, its own
//! threads):
//! - for each kind of layer (a dense feed-forward, a mixture of experts), the seconds of the
//!   parts that read no weights (norms, RoPE, attention at a short context, residuals, the
//!   experts' routing, gathering and scattering), and the rate its weight-reading products
//!   read weights at (with the experts' real sizes, so many small experts read slower);
//! - the rate the final norm and output head read the head at;
//! - the rest of a step (embedding, sampling, dispatch).
//!
//! A rank's layer then costs its kind's fixed seconds plus its share of the layer's weights
//! (as [`crate::split`] cuts them) at the measured rate, scaled by the node's bandwidth now
//! over the bandwidth probed beside the measurement: a node whose memory bus is shared with
//! another rank reads slower in proportion. The KV cache is read at the node's bandwidth as
//! without a calibration (a calibration runs at a short context). A GPU's layers are not
//! calibrated: a rank with GPU layers is predicted as without one.

use std::cmp::Ordering;

use serde::{Deserialize, Serialize};

use crate::spec::ModelProfile;
use crate::split::{tensor_split, ExpertSplit};

/// The measured cost of one layer of a kind.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LayerCost {
    /// Seconds per decoded token of the layer's parts that read no weights.
    pub fixed_secs: f64,
    /// The rate its products read the layer's weights at, GB/s.
    pub weights_gbs: f64,
}

/// One node's measured decode costs for one model shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    /// The shape measured ([`ModelProfile::shape_key`]): it applies to every model of that
    /// shape and quantization.
    pub shape: String,
    /// Compute threads it ran with.
    pub threads: u32,
    /// Read bandwidth probed beside the measurement, GB/s.
    pub mem_bandwidth_gbs: f64,
    /// A layer with a dense feed-forward, when the shape has one.
    pub dense: Option<LayerCost>,
    /// A layer with a mixture of experts, when the shape has one.
    pub moe: Option<LayerCost>,
    /// The rate the final norm and output head read the head at, GB/s.
    pub head_gbs: f64,
    /// Seconds per step outside the layers and the head: embedding, sampling, dispatch.
    pub step_secs: f64,
    /// The decode rate the measurement ran at, tokens/s (what the costs above add up to).
    pub measured_tok_s: f64,
}

/// Seconds one decode run spent in each part, summed over its tokens (what the engine's
/// profile measures; [`Calibration::from_times`] turns it into per-token costs).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DecodeTimes {
    /// Tokens decoded (one sequence, one token per step).
    pub tokens: usize,
    /// Layers with a dense feed-forward: (seconds without weights, seconds reading weights).
    pub dense: (f64, f64),
    /// Layers with a mixture of experts: (seconds without weights, seconds reading weights).
    pub moe: (f64, f64),
    /// Final norm and output head.
    pub head_secs: f64,
    /// The whole run's wall time.
    pub total_secs: f64,
}

impl Calibration {
    /// The calibration of `model`'s shape from one decode run's `times`, with `threads`
    /// threads and `mem_bandwidth_gbs` probed beside it. The weight bytes each part read
    /// are the planner's own account of a one-rank placement, so what the planner counts
    /// and what the node measured meet.
    ///
    /// # Errors
    /// When the run decoded nothing or a part the model has took no time.
    pub fn from_times(
        model: &ModelProfile,
        threads: u32,
        mem_bandwidth_gbs: f64,
        times: &DecodeTimes,
    ) -> Result<Self, String> {
        if times.tokens == 0 || times.total_secs.partial_cmp(&0.0) != Some(Ordering::Greater) {
            return Err("the calibration run decoded no tokens".into());
        }
        let rank = tensor_split(model, 1, ExpertSplit::Auto)?
            .into_iter()
            .next()
            .ok_or("a one-rank split has no rank")?;
        let tokens = times.tokens as f64;
        let (mut dense_layers, mut dense_bytes, mut moe_layers, mut moe_bytes) = (0, 0.0, 0, 0.0);
        for l in 0..model.n_layers {
            let read = rank.layer_read(model, l);
            if model.is_moe_layer(l) {
                moe_layers += 1;
                moe_bytes += read;
            } else {
                dense_layers += 1;
                dense_bytes += read;
            }
        }
        let cost = |layers: usize, bytes: f64, (fixed, weights): (f64, f64), kind: &str| {
            if layers == 0 {
                return Ok(None);
            }
            if weights.partial_cmp(&0.0) != Some(Ordering::Greater) {
                return Err(format!(
                    "the run timed no weight reads in its {kind} layers"
                ));
            }
            Ok(Some(LayerCost {
                fixed_secs: fixed / tokens / layers as f64,
                weights_gbs: bytes * tokens / weights / 1e9,
            }))
        };
        let dense = cost(dense_layers, dense_bytes, times.dense, "dense")?;
        let moe = cost(moe_layers, moe_bytes, times.moe, "mixture-of-experts")?;
        if times.head_secs.partial_cmp(&0.0) != Some(Ordering::Greater) {
            return Err("the run timed no output head".into());
        }
        let parts = times.dense.0 + times.dense.1 + times.moe.0 + times.moe.1 + times.head_secs;
        let cal = Calibration {
            shape: model.shape_key(),
            threads,
            mem_bandwidth_gbs,
            dense,
            moe,
            head_gbs: rank.head_bytes(model) as f64 * tokens / times.head_secs / 1e9,
            step_secs: (times.total_secs - parts).max(0.0) / tokens,
            measured_tok_s: tokens / times.total_secs,
        };
        cal.validate()?;
        Ok(cal)
    }

    /// Checks every figure is one the cost model can divide by.
    ///
    /// # Errors
    /// Names the figure that is not.
    pub fn validate(&self) -> Result<(), String> {
        let positive = |x: f64| x.is_finite() && x > 0.0;
        let at_least_zero = |x: f64| x.is_finite() && x >= 0.0;
        if !positive(self.mem_bandwidth_gbs) {
            return Err(format!(
                "calibration of {}: mem_bandwidth_gbs {} must be > 0",
                self.shape, self.mem_bandwidth_gbs
            ));
        }
        if !positive(self.head_gbs) || !at_least_zero(self.step_secs) {
            return Err(format!(
                "calibration of {}: head_gbs {} must be > 0 and step_secs {} >= 0",
                self.shape, self.head_gbs, self.step_secs
            ));
        }
        for (kind, c) in [("dense", &self.dense), ("moe", &self.moe)] {
            if let Some(c) = c {
                if !positive(c.weights_gbs) || !at_least_zero(c.fixed_secs) {
                    return Err(format!(
                        "calibration of {}: {kind} layer weights_gbs {} must be > 0 and \
                         fixed_secs {} >= 0",
                        self.shape, c.weights_gbs, c.fixed_secs
                    ));
                }
            }
        }
        if self.dense.is_none() && self.moe.is_none() {
            return Err(format!(
                "calibration of {}: measures no kind of layer",
                self.shape
            ));
        }
        Ok(())
    }

    /// The measured cost of `model`'s layer `l`, when this calibration has its kind.
    pub fn layer(&self, model: &ModelProfile, l: usize) -> Option<LayerCost> {
        if model.is_moe_layer(l) {
            self.moe
        } else {
            self.dense
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{deepseek_v3_q4, dense_model};

    #[test]
    fn per_token_costs_come_from_the_times_and_the_planners_bytes() {
        let model = dense_model(8, 16, 4, 64, 2816, 10_000_000);
        let times = DecodeTimes {
            tokens: 10,
            dense: (0.2, 1.0),
            moe: (0.0, 0.0),
            head_secs: 0.1,
            total_secs: 1.5,
        };
        let cal = Calibration::from_times(&model, 2, 20.0, &times).unwrap();
        let d = cal.dense.unwrap();
        assert!(cal.moe.is_none());
        let layer_fixed = 0.2 / 10.0 / model.n_layers as f64;
        assert!((d.fixed_secs - layer_fixed).abs() < 1e-12);
        let read: u64 = model.layer_bytes.iter().sum();
        assert!((d.weights_gbs - read as f64 * 10.0 / 1.0 / 1e9).abs() < 1e-9);
        assert!((cal.head_gbs - model.head_bytes as f64 * 10.0 / 0.1 / 1e9).abs() < 1e-9);
        assert!((cal.step_secs - 0.2 / 10.0).abs() < 1e-12);
        assert_eq!(cal.shape, model.shape_key());
    }

    #[test]
    fn a_mixture_of_experts_is_charged_its_active_experts() {
        let model = deepseek_v3_q4();
        let times = DecodeTimes {
            tokens: 4,
            dense: (0.01, 0.1),
            moe: (0.4, 2.0),
            head_secs: 0.1,
            total_secs: 2.7,
        };
        let cal = Calibration::from_times(&model, 1, 20.0, &times).unwrap();
        let moe = cal.moe.unwrap();
        let rank = &tensor_split(&model, 1, ExpertSplit::Auto).unwrap()[0];
        let bytes: f64 = (0..model.n_layers)
            .filter(|&l| model.is_moe_layer(l))
            .map(|l| rank.layer_read(&model, l))
            .sum();
        // the active experts only, not every expert held
        assert!(
            bytes
                < (0..model.n_layers)
                    .map(|l| model.layer_bytes[l])
                    .sum::<u64>() as f64
        );
        assert!((moe.weights_gbs - bytes * 4.0 / 2.0 / 1e9).abs() < 1e-9);
    }

    #[test]
    fn a_run_without_times_is_refused() {
        let model = dense_model(8, 16, 4, 64, 2816, 10_000_000);
        let none = DecodeTimes::default();
        assert!(Calibration::from_times(&model, 1, 20.0, &none)
            .unwrap_err()
            .contains("no tokens"));
        let no_head = DecodeTimes {
            tokens: 1,
            dense: (0.1, 0.1),
            total_secs: 0.3,
            ..DecodeTimes::default()
        };
        assert!(Calibration::from_times(&model, 1, 20.0, &no_head)
            .unwrap_err()
            .contains("head"));
    }
}
