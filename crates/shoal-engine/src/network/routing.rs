//! Where a mixture of experts sends each row: the router's logits become probabilities
//! (a softmax over the experts, or a sigmoid of each; or they stay logits, and the chosen
//! experts' weights are a softmax over theirs, as gpt-oss routes), a per-expert bias may shift them for
//! the choice only (DeepSeek V3), group-limited routing may rule out all but the best
//! groups of experts (each group scored by the sum of its two best), the `k` best experts
//! are chosen, and their weights are their unbiased probabilities, renormalised to sum to
//! one where the model says and scaled by its factor. This follows llama.cpp's
//! `build_moe_ffn` step by step, so the same logits choose the same experts.
//!
//! Every rank routes its own copy of the replicated hidden state with its own copy of the
//! router, so ranks agree on the routes without exchanging them.

use crate::backend::Routes;
use crate::config::{Gating, MoeConfig};

/// The smallest weight sum a renormalisation divides by (the smallest normal f16, as
/// llama.cpp clamps it).
const MIN_WEIGHT_SUM: f32 = 6.103_515_6e-5;

/// How one layer routes.
#[derive(Debug, Clone)]
pub(crate) struct Routing {
    /// Logits to probabilities.
    pub gating: Gating,
    /// Added to the probabilities for the choice only.
    pub bias: Option<Vec<f32>>,
    /// Experts per row.
    pub k: usize,
    /// Expert groups (1 = none).
    pub groups: usize,
    /// Groups a row's experts may come from.
    pub groups_used: usize,
    /// Whether the chosen weights are divided by their sum.
    pub norm: bool,
    /// A factor on the chosen weights.
    pub scale: f32,
}

impl Routing {
    /// The routing `moe` describes, with the selection bias `bias` where the layer has one.
    pub fn new(moe: &MoeConfig, bias: Option<Vec<f32>>) -> Self {
        Routing {
            gating: moe.gating,
            bias,
            k: moe.n_expert_used,
            groups: moe.groups,
            groups_used: moe.groups_used,
            norm: moe.norm_weights,
            scale: moe.weights_scale,
        }
    }

    /// The routes of every row of `logits` (rows of `n_expert` values) into `routes`.
    pub fn route(&self, logits: &[f32], n_expert: usize, routes: &mut Routes) {
        routes.k = self.k;
        routes.experts.clear();
        routes.weights.clear();
        let mut probs = vec![0f32; n_expert];
        let mut select = vec![0f32; n_expert];
        let mut order: Vec<usize> = Vec::with_capacity(n_expert);
        for row in logits.chunks_exact(n_expert) {
            match self.gating {
                Gating::Softmax => {
                    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut sum = 0f32;
                    for (p, &l) in probs.iter_mut().zip(row) {
                        *p = (l - max).exp();
                        sum += *p;
                    }
                    let inv = 1.0 / sum;
                    for p in &mut probs {
                        *p *= inv;
                    }
                }
                Gating::Sigmoid => {
                    for (p, &l) in probs.iter_mut().zip(row) {
                        *p = 1.0 / (1.0 + (-l).exp());
                    }
                }
                Gating::SoftmaxWeight => probs.copy_from_slice(row),
            }
            select.copy_from_slice(&probs);
            if let Some(b) = &self.bias {
                for (s, b) in select.iter_mut().zip(b) {
                    *s += b;
                }
            }
            if self.groups > 1 {
                self.mask_groups(&mut select);
            }
            order.clear();
            order.extend(0..n_expert);
            // the k best, best first; ties go to the lower id
            order.sort_by(|&a, &b| select[b].total_cmp(&select[a]).then(a.cmp(&b)));
            let chosen = &order[..self.k];
            if self.gating == Gating::SoftmaxWeight {
                // the weights are a softmax over the chosen logits (the best is first)
                let max = probs[chosen[0]];
                let mut sum = 0f32;
                for &e in chosen {
                    probs[e] = (probs[e] - max).exp();
                    sum += probs[e];
                }
                for &e in chosen {
                    probs[e] /= sum;
                }
            }
            let sum: f32 = chosen.iter().map(|&e| probs[e]).sum();
            let div = if self.norm {
                sum.max(MIN_WEIGHT_SUM)
            } else {
                1.0
            };
            for &e in chosen {
                let mut w = probs[e];
                if self.norm {
                    w /= div;
                }
                if self.scale != 1.0 {
                    w *= self.scale;
                }
                routes.experts.push(e as u32);
                routes.weights.push(w);
            }
        }
    }

    /// Rules out (sets to minus infinity) every expert outside the `groups_used` groups whose
    /// two best experts score highest.
    fn mask_groups(&self, select: &mut [f32]) {
        let per = select.len() / self.groups;
        let mut scores: Vec<(usize, f32)> = select
            .chunks_exact(per)
            .enumerate()
            .map(|(g, s)| {
                let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
                for &v in s {
                    if v > a {
                        b = a;
                        a = v;
                    } else if v > b {
                        b = v;
                    }
                }
                (g, if per > 1 { a + b } else { a })
            })
            .collect();
        scores.sort_by(|x, y| y.1.total_cmp(&x.1).then(x.0.cmp(&y.0)));
        for &(g, _) in &scores[self.groups_used..] {
            select[g * per..(g + 1) * per].fill(f32::NEG_INFINITY);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routing(gating: Gating, k: usize) -> Routing {
        Routing {
            gating,
            bias: None,
            k,
            groups: 1,
            groups_used: 1,
            norm: false,
            scale: 1.0,
        }
    }

    #[test]
    fn softmax_top_k_picks_the_largest_with_their_probabilities() {
        let logits = [0.0, 2.0, 1.0, -1.0];
        let mut routes = Routes::default();
        routing(Gating::Softmax, 2).route(&logits, 4, &mut routes);
        assert_eq!(routes.experts, vec![1, 2]);
        let z: f32 = logits.iter().map(|l| l.exp()).sum();
        assert!((routes.weights[0] - 2f32.exp() / z).abs() < 1e-6);
        assert!((routes.weights[1] - 1f32.exp() / z).abs() < 1e-6);
    }

    #[test]
    fn renormalised_weights_sum_to_one_then_scale() {
        let mut r = routing(Gating::Softmax, 2);
        r.norm = true;
        r.scale = 2.5;
        let mut routes = Routes::default();
        r.route(&[0.3, -0.2, 1.1, 0.7, 0.0, 0.9], 3, &mut routes);
        assert_eq!(routes.rows(), 2);
        for row in routes.weights.chunks(2) {
            assert!((row.iter().sum::<f32>() - 2.5).abs() < 1e-5);
        }
        assert_eq!(routes.experts, vec![2, 0, 2, 0]);
    }

    #[test]
    fn bias_changes_the_choice_but_not_the_weights() {
        let mut r = routing(Gating::Sigmoid, 1);
        r.bias = Some(vec![0.0, 0.0, 10.0]);
        let mut routes = Routes::default();
        r.route(&[3.0, 1.0, -2.0], 3, &mut routes);
        assert_eq!(routes.experts, vec![2]);
        let sig = 1.0 / (1.0 + 2f32.exp());
        assert!((routes.weights[0] - sig).abs() < 1e-6);
    }

    #[test]
    fn softmax_weight_chooses_by_logit_and_weighs_the_chosen() {
        let logits = [0.5, 3.0, -1.0, 2.0];
        let mut routes = Routes::default();
        routing(Gating::SoftmaxWeight, 2).route(&logits, 4, &mut routes);
        assert_eq!(routes.experts, vec![1, 3]);
        let z = 3f32.exp() + 2f32.exp();
        assert!((routes.weights[0] - 3f32.exp() / z).abs() < 1e-6);
        assert!((routes.weights[1] - 2f32.exp() / z).abs() < 1e-6);
    }

    #[test]
    fn groups_limit_the_choice_to_the_best_groups() {
        // four groups of two; group 3 holds the single best expert, but group 0's pair
        // sums highest and only one group may be used
        let mut r = routing(Gating::Sigmoid, 2);
        r.groups = 4;
        r.groups_used = 1;
        let logits = [2.0, 2.0, -1.0, -1.0, -2.0, -2.0, 3.0, -5.0];
        let mut routes = Routes::default();
        r.route(&logits, 8, &mut routes);
        assert_eq!(routes.experts, vec![0, 1]);
        r.groups_used = 2;
        r.route(&logits, 8, &mut routes);
        assert_eq!(routes.experts, vec![6, 0]);
    }
}
