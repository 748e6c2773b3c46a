//! Mixture-of-experts, multi-head latent attention and YaRN settings of the tiny models,
//! with the routing and RoPE arithmetic the reference uses, and deliberately broken MoE files.
//!
//! [`MoeSpec`] describes the routed feed-forward of `qwen3moe`, `deepseek2`, `glm4moe` and
//! Mixtral (`llama` with experts): how many experts, how many each token uses, their FFN size,
//! shared experts and leading dense layers (DeepSeek, GLM), the gating function, the selection
//! bias (`exp_probs_b`, DeepSeek V3, GLM), group-limited selection and the normalisation and scale of
//! the chosen experts' weights. [`route`] chooses a token's experts and weights exactly as
//! llama.cpp's `build_moe_ffn` does:
//!
//! 1. `probs` = softmax over every expert's router logit, or the sigmoid of each, or the
//!    logits themselves (gpt-oss's `SoftmaxWeight`);
//! 2. the selection scores are `probs + bias` (the bias only steers the choice);
//! 3. with `n_group > 1` groups (consecutive runs of `n_expert / n_group` experts), each group
//!    scores the sum of its two best selection scores, the `n_group_used` best groups are
//!    kept and every expert of the other groups is masked to `-inf`;
//! 4. the `n_expert_used` best selection scores are chosen (the lower index first on a tie);
//! 5. their weights are their unbiased `probs` (with `SoftmaxWeight`, a softmax over the
//!    chosen logits), divided by their sum (clamped below at
//!    `6.103515625e-5`) when `norm_weights`, then multiplied by `weights_scale` when it is
//!    set and neither 0 nor 1.
//!
//! [`route_margin`] and [`route_scale_margin`] say how close a token's choice is to changing,
//! for tests that compare with arithmetic of lower precision.
//!
//! [`MlaSpec`] holds DeepSeek's multi-head latent attention sizes and [`YarnRope`] the YaRN
//! RoPE scaling as llama.cpp's `deepseek2` applies it (see [`YarnRope::angle`] and
//! [`YarnRope::attention_factor`]). [`MoeFault`] and [`TinyModel::moe_faulty_gguf_writer`]
//! give MoE files that a loader must refuse.

use crate::gguf_writer::GgufWriter;
use crate::quants::GgmlType;
use crate::tiny_model::{Arch, TinyModel};
use crate::TestkitError;

/// How router logits become expert probabilities (`{arch}.expert_gating_func`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExpertGating {
    /// Softmax over every expert (GGUF id 1).
    Softmax,
    /// The sigmoid of each logit (GGUF id 2).
    Sigmoid,
    /// The raw logits choose and the chosen experts' weights are a softmax over their logits
    /// (GGUF id 3; llama.cpp's `gpt-oss` graph uses it whatever the file says).
    SoftmaxWeight,
}

impl ExpertGating {
    /// The value of `{arch}.expert_gating_func`.
    pub fn gguf_id(self) -> u32 {
        match self {
            ExpertGating::Softmax => 1,
            ExpertGating::Sigmoid => 2,
            ExpertGating::SoftmaxWeight => 3,
        }
    }
}

/// The routed feed-forward of a mixture-of-experts model; see the module docs for how a
/// token's experts are chosen and weighted.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeSpec {
    /// Routed experts per layer (`expert_count`).
    pub n_expert: usize,
    /// Experts each token uses (`expert_used_count`).
    pub n_expert_used: usize,
    /// Inner size of each routed expert's SwiGLU FFN (`expert_feed_forward_length`; Mixtral
    /// writes it as `feed_forward_length`).
    pub expert_ffn: usize,
    /// DeepSeek and GLM only: shared experts, run on every token and added to the routed output, as
    /// one SwiGLU FFN of inner size `n_shared_expert * expert_ffn` (`expert_shared_count`).
    pub n_shared_expert: usize,
    /// DeepSeek and GLM only: the first `leading_dense` layers have a dense FFN of the spec's
    /// `ffn_size` instead of experts (`leading_dense_block_count`).
    pub leading_dense: usize,
    /// Gating function (llama.cpp's `qwen3moe` and `llama` always use softmax).
    pub gating: ExpertGating,
    /// Whether the chosen experts' weights are divided by their sum (`expert_weights_norm`;
    /// always on for `qwen3moe` and `llama` in llama.cpp).
    pub norm_weights: bool,
    /// DeepSeek and GLM only: factor on the chosen experts' weights (`expert_weights_scale`), written
    /// when set.
    pub weights_scale: Option<f32>,
    /// DeepSeek and GLM only: expert groups for group-limited selection (`expert_group_count`),
    /// written when not 0; selection is group-limited when above 1.
    pub n_group: usize,
    /// DeepSeek and GLM only: groups kept per token (`expert_group_used_count`).
    pub n_group_used: usize,
    /// DeepSeek and GLM only: a per-expert bias (`exp_probs_b.bias`) added to the probabilities for
    /// choosing the experts, not for weighting them.
    pub probs_bias: bool,
    /// When not 0: the router reads only the first `router_dims` hidden dimensions (its
    /// other columns are zero), and no layer writes them (the rows of every attention output
    /// and FFN down projection that would are zero), so they hold the token's embedding in
    /// every layer and routing depends on the token and the norm's scale alone. An engine
    /// whose quantized products perturb the rest of the hidden state then still chooses the
    /// reference's experts under softmax gating (the scale is common to every expert), where
    /// otherwise a near-tie flips a choice and moves the logits far beyond any tolerance.
    /// 0 (see [`crate::TinyModelSpec::routed_on_the_whole_state`]) routes on the whole
    /// hidden state, as a trained model does: a token's experts then follow its context,
    /// which the F32 comparisons and splits check.
    pub router_dims: usize,
}

/// DeepSeek's multi-head latent attention (MLA) sizes. Per head, a query is `nope_dim`
/// position-free dimensions followed by `rope_dim` rotated ones; keys share one rotated part
/// per token (`k_pe`) and take their position-free part, and the values, from a per-token
/// latent of `kv_lora_rank` (`c`): `k_nope[h] = k_b[h]ᵀ c`, `v[h] = v_b[h] c`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlaSpec {
    /// Rank of the key/value latent (`attention.kv_lora_rank`).
    pub kv_lora_rank: usize,
    /// Rank of the query compression (`attention.q_lora_rank`): 0 for a plain `attn_q`
    /// (DeepSeek-V2-Lite), otherwise `attn_q_a` → `attn_q_a_norm` → `attn_q_b`.
    pub q_lora_rank: usize,
    /// Rotated dimensions per query head and of the shared key (`rope.dimension_count`).
    pub rope_dim: usize,
    /// Position-free dimensions per query and key head.
    pub nope_dim: usize,
    /// Value dimensions per head (`attention.value_length_mla`).
    pub v_dim: usize,
}

impl MlaSpec {
    /// Query and key head size, `nope_dim + rope_dim` (`attention.key_length_mla`).
    pub fn qk_dim(&self) -> usize {
        self.nope_dim + self.rope_dim
    }
}

/// YaRN RoPE scaling as DeepSeek configures it (Hugging Face `rope_scaling` with `type:
/// yarn`). Pair `i` of `n_dims` rotated dimensions turns at the original frequency
/// (`base^(-2i/n_dims)`) below the correction range, at that frequency divided by `factor`
/// above it, and at a linear blend inside it ([`YarnRope::angle`]); the attention scale is
/// multiplied by [`YarnRope::attention_factor`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct YarnRope {
    /// Context extension factor (`rope.scaling.factor`).
    pub factor: f32,
    /// The context the model was first trained for (`rope.scaling.original_context_length`).
    pub original_context: usize,
    /// Rotations over the original context below which pairs are interpolated
    /// (`rope.scaling.yarn_beta_fast`). llama.cpp's `deepseek2` ignores the key and uses 32.
    pub beta_fast: f32,
    /// Rotations above which pairs keep their frequency (`rope.scaling.yarn_beta_slow`);
    /// `deepseek2` ignores the key and uses 1.
    pub beta_slow: f32,
    /// Hugging Face's `mscale_all_dim` (a `config.json` number, hence f64). The converter
    /// writes `0.1 *` it as `rope.scaling.yarn_log_multiplier` and llama.cpp's `deepseek2`
    /// loader divides by 0.1.
    pub log_multiplier: f64,
}

impl YarnRope {
    /// The value written as `rope.scaling.yarn_log_multiplier` (`0.1 * log_multiplier`, as
    /// the converter computes it).
    pub fn gguf_log_multiplier(&self) -> f32 {
        (0.1 * self.log_multiplier) as f32
    }

    /// The first and last pair index of the correction range for `n_dims` rotated dimensions
    /// and RoPE base `base`: `floor` and `ceil` of `n_dims ln(original_context / (2π beta)) /
    /// (2 ln base)` for `beta_fast` and `beta_slow`, clamped to `[0, n_dims - 1]`.
    pub fn correction_range(&self, n_dims: usize, base: f64) -> (f64, f64) {
        let dim = |beta: f32| {
            n_dims as f64
                * (self.original_context as f64 / (f64::from(beta) * 2.0 * std::f64::consts::PI))
                    .ln()
                / (2.0 * base.ln())
        };
        let low = dim(self.beta_fast).floor().max(0.0);
        let high = dim(self.beta_slow).ceil().min(n_dims as f64 - 1.0);
        (low, high)
    }

    /// The rotation angle of pair `i` at position `pos`: with `extrap = pos *
    /// base^(-2i/n_dims)`, `interp = extrap / factor` and `ramp = 1 - clamp((i - low) /
    /// max(high - low, 0.001), 0, 1)` over the [`YarnRope::correction_range`], `interp * (1 -
    /// ramp) + extrap * ramp`.
    pub fn angle(&self, pos: usize, i: usize, n_dims: usize, base: f64) -> f64 {
        let extrap = pos as f64 * base.powf(-((2 * i) as f64) / n_dims as f64);
        let interp = extrap / f64::from(self.factor);
        let (low, high) = self.correction_range(n_dims, base);
        let y = (i as f64 - low) / (high - low).max(0.001);
        let ramp = 1.0 - y.clamp(0.0, 1.0);
        interp * (1.0 - ramp) + extrap * ramp
    }

    /// The factor on the attention scale `1/sqrt(qk_dim)`: `mscale²` with `mscale = 1 + 0.1
    /// log_multiplier ln(factor)` (Hugging Face's `yarn_get_mscale(factor, mscale_all_dim)`,
    /// which llama.cpp's `deepseek2` graph folds into its `kq_scale`). The rotation itself
    /// stays unscaled: llama.cpp's attention factor for the rotation cancels YaRN's own
    /// `1 + 0.1 ln(factor)` magnitude.
    pub fn attention_factor(&self) -> f64 {
        let m = 1.0 + 0.1 * self.log_multiplier * f64::from(self.factor).ln();
        m * m
    }
}

/// The experts chosen for one token and their weights, in the order chosen (best selection
/// score first): see the module docs. `logits` are the router's outputs (one per expert),
/// `bias` the selection bias when the layer has one.
pub fn route(logits: &[f64], moe: &MoeSpec, bias: Option<&[f32]>) -> Vec<(usize, f64)> {
    let (probs, select, _) = selection(logits, moe, bias);
    let chosen = best(&select, moe.n_expert_used);
    let mut weights: Vec<f64> = chosen.iter().map(|&e| probs[e]).collect();
    if moe.gating == ExpertGating::SoftmaxWeight {
        let m = weights.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        weights.iter_mut().for_each(|w| *w = (*w - m).exp());
        let z: f64 = weights.iter().sum();
        weights.iter_mut().for_each(|w| *w /= z);
    }
    if moe.norm_weights {
        let sum = weights.iter().sum::<f64>().max(6.103_515_625e-5);
        weights.iter_mut().for_each(|w| *w /= sum);
    }
    if let Some(scale) = moe.weights_scale.filter(|s| *s != 0.0 && *s != 1.0) {
        weights.iter_mut().for_each(|w| *w *= f64::from(scale));
    }
    chosen.into_iter().zip(weights).collect()
}

/// How far one token's choice is from changing: the gap between the last chosen and the
/// best unchosen selection score, and with groups also the gap between the last kept and the
/// best dropped group score (infinite when nothing is left to compare).
pub fn route_margin(logits: &[f64], moe: &MoeSpec, bias: Option<&[f32]>) -> f64 {
    let (_, select, group_margin) = selection(logits, moe, bias);
    let order = best(&select, select.len());
    let (last, next) = (
        select[order[moe.n_expert_used - 1]],
        select.get(order.get(moe.n_expert_used).copied().unwrap_or(usize::MAX)),
    );
    match next {
        Some(next) if next.is_finite() => group_margin.min(last - next),
        _ => group_margin,
    }
}

/// How far one token's choice is from changing when every router logit is multiplied by
/// one factor `1 + e` (what an engine's different scale of the normed FFN input does with
/// [`MoeSpec::router_dims`] reserved, the rest of the router's input being exact): the
/// largest `eta` of `1e-6 * 2^k` for which no factor `1 ± eta * j / 16` (`j` = 1..16) changes
/// the chosen set of experts (0 when even `1e-6` does, and at most about 1). Softmax gating
/// without groups never changes its choice this way.
pub fn route_scale_margin(logits: &[f64], moe: &MoeSpec, bias: Option<&[f32]>) -> f64 {
    let chosen = |scale: f64| {
        let scaled: Vec<f64> = logits.iter().map(|l| l * scale).collect();
        let mut set: Vec<usize> = route(&scaled, moe, bias).iter().map(|r| r.0).collect();
        set.sort_unstable();
        set
    };
    let base = chosen(1.0);
    let mut stable = 0.0;
    for k in 0..21 {
        let eta = 1e-6 * f64::from(1u32 << k);
        let holds = (1..=16).all(|j| {
            let e = eta * f64::from(j) / 16.0;
            chosen(1.0 + e) == base && chosen(1.0 - e) == base
        });
        if !holds {
            break;
        }
        stable = eta;
    }
    stable
}

/// Steps 1-3 of the routing: the probabilities, the selection scores with the other groups
/// masked to `-inf`, and the gap between the last kept and the best dropped group score
/// (infinite without groups).
fn selection(logits: &[f64], moe: &MoeSpec, bias: Option<&[f32]>) -> (Vec<f64>, Vec<f64>, f64) {
    let probs: Vec<f64> = match moe.gating {
        ExpertGating::Softmax => {
            let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
            let z: f64 = e.iter().sum();
            e.iter().map(|v| v / z).collect()
        }
        ExpertGating::Sigmoid => logits.iter().map(|l| 1.0 / (1.0 + (-l).exp())).collect(),
        ExpertGating::SoftmaxWeight => logits.to_vec(),
    };
    let mut select: Vec<f64> = match bias {
        Some(b) => probs
            .iter()
            .zip(b)
            .map(|(p, b)| p + f64::from(*b))
            .collect(),
        None => probs.clone(),
    };
    let mut group_margin = f64::INFINITY;
    if moe.n_group > 1 {
        let size = logits.len() / moe.n_group;
        let scores: Vec<f64> = select
            .chunks(size)
            .map(|g| best(g, 2).iter().map(|&i| g[i]).sum())
            .collect();
        let order = best(&scores, scores.len());
        let kept = &order[..moe.n_group_used];
        if let Some(&dropped) = order.get(moe.n_group_used) {
            group_margin = scores[order[moe.n_group_used - 1]] - scores[dropped];
        }
        for (g, chunk) in select.chunks_mut(size).enumerate() {
            if !kept.contains(&g) {
                chunk.iter_mut().for_each(|v| *v = f64::NEG_INFINITY);
            }
        }
    }
    (probs, select, group_margin)
}

/// The indices of the `k` largest values, largest first (the lower index first on a tie).
fn best(v: &[f64], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// A defect planted in a MoE GGUF by [`TinyModel::moe_faulty_gguf_writer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MoeFault {
    /// `blk.L.ffn_up_exps.weight` of the last layer is left out.
    MissingExpertTensor,
    /// `{arch}.expert_count` says twice the experts the tensors hold (so groups still divide
    /// it and `expert_used_count` stays below it).
    ExpertCountMismatch,
    /// `{arch}.expert_used_count` is `expert_count + 1`.
    ExpertsUsedAboveCount,
}

impl TinyModel {
    /// [`TinyModel::gguf_writer`] of a mixture-of-experts model with `fault` planted, for
    /// tests of a loader's refusals (the writer can be changed further before writing).
    ///
    /// # Errors
    /// When the model has no experts, or as [`TinyModel::gguf_writer`].
    pub fn moe_faulty_gguf_writer(
        &self,
        ty: GgmlType,
        fault: MoeFault,
    ) -> Result<GgufWriter, TestkitError> {
        let s = self.spec();
        let moe = s.moe.as_ref().ok_or_else(|| {
            TestkitError::InvalidSpec(format!("{} has no experts to break", s.name))
        })?;
        let mut w = self.gguf_writer(ty)?;
        let a = s.arch.gguf_name();
        match fault {
            MoeFault::MissingExpertTensor => {
                let name = format!("blk.{}.ffn_up_exps.weight", s.n_layers - 1);
                let before = w.tensors().len();
                w.tensors_mut().retain(|t| t.name != name);
                if w.tensors().len() == before {
                    return Err(TestkitError::InvalidSpec(format!(
                        "{}: its last layer has no {name} to leave out",
                        s.name
                    )));
                }
            }
            MoeFault::ExpertCountMismatch => {
                w.set_kv(&format!("{a}.expert_count"), (2 * moe.n_expert) as u32);
            }
            MoeFault::ExpertsUsedAboveCount => {
                w.set_kv(&format!("{a}.expert_used_count"), (moe.n_expert + 1) as u32);
            }
        }
        Ok(w)
    }
}

/// Hugging Face-style names of the MoE tensors of layer prefix `p` (`model.layers.N`):
/// Mixtral's `block_sparse_moe.gate` and stacked `experts.w1` (gate), `w3` (up), `w2`
/// (down); the others' `mlp.gate` and stacked `mlp.experts.{gate,up,down}_proj` (the names
/// llama.cpp's converters give the stacked tensors before mapping them).
pub(crate) struct MoeNames {
    pub router: String,
    pub gate: String,
    pub up: String,
    pub down: String,
}

impl MoeNames {
    pub(crate) fn of(arch: Arch, p: &str) -> MoeNames {
        if arch == Arch::Mixtral {
            MoeNames {
                router: format!("{p}.block_sparse_moe.gate.weight"),
                gate: format!("{p}.block_sparse_moe.experts.w1.weight"),
                up: format!("{p}.block_sparse_moe.experts.w3.weight"),
                down: format!("{p}.block_sparse_moe.experts.w2.weight"),
            }
        } else {
            MoeNames {
                router: format!("{p}.mlp.gate.weight"),
                gate: format!("{p}.mlp.experts.gate_proj.weight"),
                up: format!("{p}.mlp.experts.up_proj.weight"),
                down: format!("{p}.mlp.experts.down_proj.weight"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moe(gating: ExpertGating) -> MoeSpec {
        MoeSpec {
            n_expert: 8,
            n_expert_used: 2,
            expert_ffn: 32,
            n_shared_expert: 0,
            leading_dense: 0,
            gating,
            norm_weights: false,
            weights_scale: None,
            n_group: 0,
            n_group_used: 0,
            probs_bias: false,
            router_dims: 0,
        }
    }

    const LOGITS: [f64; 8] = [0.1, 2.0, -1.0, 1.5, 0.3, 1.9, -0.5, 0.0];

    #[test]
    fn softmax_top_k_takes_the_largest_probabilities() {
        let r = route(&LOGITS, &moe(ExpertGating::Softmax), None);
        let z: f64 = LOGITS.iter().map(|l| l.exp()).sum();
        assert_eq!(r.iter().map(|p| p.0).collect::<Vec<_>>(), vec![1, 5]);
        assert!((r[0].1 - 2f64.exp() / z).abs() < 1e-12);
        assert!((r[1].1 - 1.9f64.exp() / z).abs() < 1e-12);
        // normalised: the two weights sum to one, in the ratio of their probabilities
        let mut m = moe(ExpertGating::Softmax);
        m.norm_weights = true;
        let n = route(&LOGITS, &m, None);
        assert!((n[0].1 + n[1].1 - 1.0).abs() < 1e-12);
        assert!((n[0].1 / n[1].1 - (0.1f64).exp()).abs() < 1e-12);
        // scaled after normalising; a scale of 1 changes nothing
        m.weights_scale = Some(2.5);
        let s = route(&LOGITS, &m, None);
        assert!((s[0].1 - 2.5 * n[0].1).abs() < 1e-12);
        m.weights_scale = Some(1.0);
        assert_eq!(route(&LOGITS, &m, None), n);
    }

    #[test]
    fn bias_steers_the_choice_but_not_the_weights() {
        let mut m = moe(ExpertGating::Sigmoid);
        m.probs_bias = true;
        let mut bias = [0f32; 8];
        bias[3] = 0.5; // expert 3 (logit 1.5) overtakes expert 5 (1.9)
        let r = route(&LOGITS, &m, Some(&bias));
        assert_eq!(r.iter().map(|p| p.0).collect::<Vec<_>>(), vec![3, 1]);
        let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
        assert!((r[0].1 - sig(1.5)).abs() < 1e-12);
        assert!((r[1].1 - sig(2.0)).abs() < 1e-12);
        let unbiased = route(&LOGITS, &m, None);
        assert_eq!(unbiased.iter().map(|p| p.0).collect::<Vec<_>>(), vec![1, 5]);
    }

    #[test]
    fn groups_limit_the_choice() {
        // 4 groups of 2, each scoring the sum of its two sigmoids: {0,1} 1.406, {2,3} 1.087,
        // {4,5} 1.444, {6,7} 0.878
        let mut m = moe(ExpertGating::Sigmoid);
        m.n_group = 4;
        m.n_group_used = 1;
        m.n_expert_used = 2;
        // only group {4, 5} survives: experts 5 then 4
        let r = route(&LOGITS, &m, None);
        assert_eq!(r.iter().map(|p| p.0).collect::<Vec<_>>(), vec![5, 4]);
        m.n_group_used = 2;
        let r = route(&LOGITS, &m, None);
        assert_eq!(r.iter().map(|p| p.0).collect::<Vec<_>>(), vec![1, 5]);
        assert!(route_margin(&LOGITS, &m, None) > 0.0);
    }

    #[test]
    fn yarn_blends_between_the_correction_dims() {
        let y = YarnRope {
            factor: 4.0,
            original_context: 32,
            beta_fast: 32.0,
            beta_slow: 1.0,
            log_multiplier: 0.707,
        };
        assert_eq!(y.correction_range(16, 10000.0), (0.0, 2.0));
        let plain = |i: usize| 7.0 * 10000f64.powf(-((2 * i) as f64) / 16.0);
        assert!((y.angle(7, 0, 16, 10000.0) - plain(0)).abs() < 1e-12);
        assert!((y.angle(7, 1, 16, 10000.0) - plain(1) * (0.5 + 0.5 / 4.0)).abs() < 1e-12);
        for i in 2..8 {
            assert!((y.angle(7, i, 16, 10000.0) - plain(i) / 4.0).abs() < 1e-12);
        }
        let m = 1.0 + 0.0707 * 4f64.ln();
        assert!((y.attention_factor() - m * m).abs() < 1e-9);
        assert_eq!(y.gguf_log_multiplier(), 0.0707f32);
    }
}
