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
    /// Prefill: seconds per prompt row of everything but attention's scores and sums.
    pub prefill_row_secs: f64,
    /// Prefill: seconds per pair of prompt positions attention relates (a causal prompt of
    /// `P` rows relates `P^2 / 2`).
    pub prefill_pair_secs: f64,
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
    /// Seconds of a prompt chunk outside the layers: embedding, the last row's head,
    /// dispatch.
    pub prefill_step_secs: f64,
    /// The decode rate the measurement ran at, tokens/s (what the decode costs add up to).
    pub measured_tok_s: f64,
    /// The prefill rate the measurement ran at, tokens/s, over prompts of
    /// `measured_prefill_rows`.
    pub measured_prefill_tok_s: f64,
    /// Prompt rows of the prefill runs measured.
    pub measured_prefill_rows: usize,
}

/// Seconds prefill runs of one prompt length spent in each part, summed over the runs
/// (what the engine's profile measures).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PrefillTimes {
    /// Prompt rows of each run (one chunk).
    pub rows: usize,
    /// Runs.
    pub runs: usize,
    /// Layers with a dense feed-forward: (attention's scores and sums, everything else).
    pub dense: (f64, f64),
    /// Layers with a mixture of experts: (attention's scores and sums, everything else).
    pub moe: (f64, f64),
    /// The runs' wall time.
    pub total_secs: f64,
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
    /// The calibration of `model`'s shape from one decode run's `times` and prefill runs'
    /// `prefill`, with `threads` threads and `mem_bandwidth_gbs` probed beside them. The
    /// weight bytes each part read are the planner's own account of a one-rank placement,
    /// so what the planner counts and what the node measured meet.
    ///
    /// # Errors
    /// When a run ran nothing or a part the model has took no time.
    pub fn from_times(
        model: &ModelProfile,
        threads: u32,
        mem_bandwidth_gbs: f64,
        times: &DecodeTimes,
        prefill: &PrefillTimes,
    ) -> Result<Self, String> {
        let positive = |x: f64| x.partial_cmp(&0.0) == Some(Ordering::Greater);
        if times.tokens == 0 || !positive(times.total_secs) {
            return Err("the calibration run decoded no tokens".into());
        }
        if prefill.rows == 0 || prefill.runs == 0 || !positive(prefill.total_secs) {
            return Err("the calibration run prefilled no prompt".into());
        }
        if !positive(times.head_secs) {
            return Err("the run timed no output head".into());
        }
        let rank = tensor_split(model, 1, ExpertSplit::Auto)?
            .into_iter()
            .next()
            .ok_or("a one-rank split has no rank")?;
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
        let tokens = times.tokens as f64;
        let (rows, runs) = (prefill.rows as f64, prefill.runs as f64);
        let cost = |layers: usize, bytes: f64, decode: (f64, f64), prompt: (f64, f64), kind| {
            let ((fixed, weights), (pairs, rest)) = (decode, prompt);
            if layers == 0 {
                return Ok(None);
            }
            if !positive(weights) || !positive(rest) {
                return Err(format!(
                    "the run timed no weight reads in its {kind} layers"
                ));
            }
            let layers = layers as f64;
            Ok(Some(LayerCost {
                fixed_secs: fixed / tokens / layers,
                weights_gbs: bytes * tokens / weights / 1e9,
                prefill_row_secs: rest / runs / rows / layers,
                prefill_pair_secs: pairs / runs / (rows * rows / 2.0) / layers,
            }))
        };
        let dense = cost(
            dense_layers,
            dense_bytes,
            times.dense,
            prefill.dense,
            "dense",
        )?;
        let moe = cost(moe_layers, moe_bytes, times.moe, prefill.moe, "expert")?;
        let parts = times.dense.0 + times.dense.1 + times.moe.0 + times.moe.1 + times.head_secs;
        let prompt_parts = prefill.dense.0 + prefill.dense.1 + prefill.moe.0 + prefill.moe.1;
        let cal = Calibration {
            shape: model.shape_key(),
            threads,
            mem_bandwidth_gbs,
            dense,
            moe,
            head_gbs: rank.head_bytes(model) as f64 * tokens / times.head_secs / 1e9,
            step_secs: (times.total_secs - parts).max(0.0) / tokens,
            prefill_step_secs: (prefill.total_secs - prompt_parts).max(0.0) / runs,
            measured_tok_s: tokens / times.total_secs,
            measured_prefill_tok_s: rows * runs / prefill.total_secs,
            measured_prefill_rows: prefill.rows,
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
        if !positive(self.head_gbs)
            || !at_least_zero(self.step_secs)
            || !at_least_zero(self.prefill_step_secs)
        {
            return Err(format!(
                "calibration of {}: head_gbs {} must be > 0, step_secs {} and \
                 prefill_step_secs {} >= 0",
                self.shape, self.head_gbs, self.step_secs, self.prefill_step_secs
            ));
        }
        for (kind, c) in [("dense", &self.dense), ("moe", &self.moe)] {
            if let Some(c) = c {
                if !positive(c.weights_gbs)
                    || !positive(c.prefill_row_secs)
                    || !at_least_zero(c.fixed_secs)
                    || !at_least_zero(c.prefill_pair_secs)
                {
                    return Err(format!(
                        "calibration of {}: {kind} layer weights_gbs {} and prefill_row_secs \
                         {} must be > 0, fixed_secs {} and prefill_pair_secs {} >= 0",
                        self.shape,
                        c.weights_gbs,
                        c.prefill_row_secs,
                        c.fixed_secs,
                        c.prefill_pair_secs
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

    /// Whether it measured every kind of layer `model` has.
    pub fn covers(&self, model: &ModelProfile) -> bool {
        (0..model.n_layers).all(|l| self.layer(model, l).is_some())
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

    /// Prefill runs of 4 runs of 100 rows: the dense layers took 0.5 s in attention's
    /// scores and sums and 2 s in the rest, the experts' layers `moe`; 3 s in all.
    fn prefill(moe: (f64, f64)) -> PrefillTimes {
        PrefillTimes {
            rows: 100,
            runs: 4,
            dense: (0.5, 2.0),
            moe,
            total_secs: 3.0 + moe.0 + moe.1,
        }
    }

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
        let cal = Calibration::from_times(&model, 2, 20.0, &times, &prefill((0.0, 0.0))).unwrap();
        let d = cal.dense.unwrap();
        assert!(cal.moe.is_none());
        let layer_fixed = 0.2 / 10.0 / model.n_layers as f64;
        assert!((d.fixed_secs - layer_fixed).abs() < 1e-12);
        let read: u64 = model.layer_bytes.iter().sum();
        assert!((d.weights_gbs - read as f64 * 10.0 / 1.0 / 1e9).abs() < 1e-9);
        assert!((cal.head_gbs - model.head_bytes as f64 * 10.0 / 0.1 / 1e9).abs() < 1e-9);
        assert!((cal.step_secs - 0.2 / 10.0).abs() < 1e-12);
        assert!((cal.measured_tok_s - 10.0 / 1.5).abs() < 1e-12);
        // prefill: per row and per pair of rows, per layer; the rest per chunk
        let layers = model.n_layers as f64;
        assert!((d.prefill_row_secs - 2.0 / 4.0 / 100.0 / layers).abs() < 1e-15);
        assert!((d.prefill_pair_secs - 0.5 / 4.0 / 5000.0 / layers).abs() < 1e-15);
        assert!((cal.prefill_step_secs - 0.5 / 4.0).abs() < 1e-12);
        assert!((cal.measured_prefill_tok_s - 400.0 / 3.0).abs() < 1e-9);
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
        let cal = Calibration::from_times(&model, 1, 20.0, &times, &prefill((1.0, 9.0))).unwrap();
        let moe = cal.moe.unwrap();
        let rank = &tensor_split(&model, 1, ExpertSplit::Auto).unwrap()[0];
        let bytes: f64 = (0..model.n_layers)
            .filter(|&l| model.is_moe_layer(l))
            .map(|l| rank.layer_read(&model, l))
            .sum();
        // the active experts only, not every expert held
        let held: u64 = model.layer_bytes.iter().sum();
        assert!(bytes < held as f64);
        assert!((moe.weights_gbs - bytes * 4.0 / 2.0 / 1e9).abs() < 1e-9);
        // 58 expert layers of 61
        assert!((moe.prefill_row_secs - 9.0 / 400.0 / 58.0).abs() < 1e-15);
        assert!(
            (cal.dense.unwrap().prefill_row_secs - 2.0 / 400.0 / 3.0).abs() < 1e-15,
            "{cal:?}"
        );
    }

    #[test]
    fn a_run_without_times_is_refused() {
        let model = dense_model(8, 16, 4, 64, 2816, 10_000_000);
        let p = prefill((0.0, 0.0));
        let none = DecodeTimes::default();
        assert!(Calibration::from_times(&model, 1, 20.0, &none, &p)
            .unwrap_err()
            .contains("no tokens"));
        let decoded = DecodeTimes {
            tokens: 1,
            dense: (0.1, 0.1),
            total_secs: 0.3,
            ..DecodeTimes::default()
        };
        assert!(Calibration::from_times(&model, 1, 20.0, &decoded, &p)
            .unwrap_err()
            .contains("head"));
        let with_head = DecodeTimes {
            head_secs: 0.05,
            ..decoded
        };
        let no_prompt = PrefillTimes::default();
        assert!(
            Calibration::from_times(&model, 1, 20.0, &with_head, &no_prompt)
                .unwrap_err()
                .contains("no prompt")
        );
    }
}
