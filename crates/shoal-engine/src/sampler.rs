//! Choosing the next token from the logits: greedy, or temperature sampling narrowed by
//! top-k, top-p and min-p, after a repetition penalty — applied in the order llama.cpp's
//! default chain uses (penalties, top-k, top-p, min-p, temperature), from a seeded generator
//! so a given seed always gives the same tokens.

use std::collections::VecDeque;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Sampling settings. The defaults are greedy decoding.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplerConfig {
    /// Softmax temperature; 0 or less means greedy (argmax).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens (0 = off).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p` (1.0 = off).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one (0.0 = off).
    pub min_p: f32,
    /// Divide positive (multiply negative) logits of recently seen tokens (1.0 = off).
    pub repeat_penalty: f32,
    /// How many recent tokens the repetition penalty looks at.
    pub repeat_last_n: usize,
    /// Seed of the random generator.
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 0,
        }
    }
}

impl SamplerConfig {
    /// Checks the settings are in range.
    ///
    /// # Errors
    /// A message naming the setting and its valid range.
    pub fn validate(&self) -> Result<(), String> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(format!(
                "temperature {} must be a number >= 0",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p {} must be in (0, 1]", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p {} must be in [0, 1]", self.min_p));
        }
        if !(self.repeat_penalty.is_finite() && self.repeat_penalty > 0.0) {
            return Err(format!(
                "repeat_penalty {} must be > 0",
                self.repeat_penalty
            ));
        }
        Ok(())
    }
}

/// A sampler with its random state and the recent tokens the penalty looks at.
#[derive(Debug, Clone)]
pub struct Sampler {
    cfg: SamplerConfig,
    rng: StdRng,
    recent: VecDeque<u32>,
    candidates: Vec<(u32, f32)>,
    weights: Vec<f32>,
}

impl Sampler {
    /// A sampler with `cfg`'s settings and seed.
    pub fn new(cfg: SamplerConfig) -> Self {
        let rng = StdRng::seed_from_u64(cfg.seed);
        Sampler {
            cfg,
            rng,
            recent: VecDeque::new(),
            candidates: Vec::new(),
            weights: Vec::new(),
        }
    }

    /// The settings.
    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// Records tokens the penalty should know about (the prompt, or accepted tokens).
    pub fn observe(&mut self, tokens: &[u32]) {
        if self.cfg.repeat_last_n == 0 {
            return;
        }
        for &t in tokens {
            if self.recent.len() == self.cfg.repeat_last_n {
                self.recent.pop_front();
            }
            self.recent.push_back(t);
        }
    }

    /// Picks the next token from `logits` (modified in place by the penalty) and records it.
    pub fn sample(&mut self, logits: &mut [f32]) -> u32 {
        if self.cfg.repeat_penalty != 1.0 {
            let p = self.cfg.repeat_penalty;
            let mut seen: Vec<u32> = self.recent.iter().copied().collect();
            seen.sort_unstable();
            seen.dedup();
            for t in seen {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 { *l / p } else { *l * p };
                }
            }
        }
        let id = if self.cfg.temperature <= 0.0 {
            greedy(logits)
        } else {
            self.sample_distribution(logits)
        };
        self.observe(&[id]);
        id
    }

    fn sample_distribution(&mut self, logits: &[f32]) -> u32 {
        if self.cfg.top_k == 0 && self.cfg.top_p >= 1.0 && self.cfg.min_p <= 0.0 {
            return self.sample_whole(logits);
        }
        let c = &mut self.candidates;
        c.clear();
        c.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, l)| l.is_finite())
                .map(|(i, &l)| (i as u32, l)),
        );
        if c.is_empty() {
            return greedy(logits);
        }
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        // The candidates' order decides which one a random draw lands on, so it must not
        // depend on how the logits were laid out (a split model's lead holds only the ranks'
        // top candidates): best first after a top-k cut, else vocabulary order.
        if self.cfg.top_k > 0 {
            if self.cfg.top_k < c.len() {
                c.select_nth_unstable_by(self.cfg.top_k - 1, by_logit);
                c.truncate(self.cfg.top_k);
            }
            c.sort_unstable_by(by_logit);
        }
        let max_of = |c: &[(u32, f32)]| c.iter().map(|x| x.1).fold(f32::NEG_INFINITY, f32::max);
        // probabilities at temperature 1 for top-p and min-p, as llama.cpp computes them
        let softmax = |c: &[(u32, f32)], temp: f32| -> Vec<f32> {
            let max = max_of(c);
            let e: Vec<f32> = c.iter().map(|&(_, l)| ((l - max) / temp).exp()).collect();
            let s: f32 = e.iter().sum();
            e.into_iter().map(|x| x / s).collect()
        };
        if self.cfg.top_p < 1.0 {
            // The smallest most-likely set reaching top_p, found by sorting only as many of
            // the best candidates as it takes (a vocabulary of 150k is rarely sorted whole).
            let max = max_of(c);
            let total: f32 = c.iter().map(|&(_, l)| (l - max).exp()).sum();
            let mut k = c.len().min(64);
            let keep = loop {
                if k < c.len() {
                    c.select_nth_unstable_by(k - 1, by_logit);
                }
                c[..k].sort_unstable_by(by_logit);
                let mut cum = 0.0;
                let found = c[..k].iter().position(|&(_, l)| {
                    cum += (l - max).exp() / total;
                    cum >= self.cfg.top_p
                });
                match found {
                    Some(i) => break i + 1,
                    None if k == c.len() => break c.len(),
                    None => k = (k * 4).min(c.len()),
                }
            };
            c.truncate(keep.max(1));
        }
        if self.cfg.min_p > 0.0 {
            // p_i / p_max >= min_p  <=>  l_i - l_max >= ln(min_p)
            let threshold = max_of(c) + self.cfg.min_p.ln();
            c.retain(|&(_, l)| l >= threshold);
        }
        let probs = softmax(c, self.cfg.temperature);
        let r: f32 = self.rng.random();
        let mut cum = 0.0;
        for (i, p) in probs.iter().enumerate() {
            cum += p;
            if r < cum {
                return c[i].0;
            }
        }
        c[c.len() - 1].0
    }
}

impl Sampler {
    /// Temperature sampling over the whole vocabulary, in vocabulary order (what the
    /// candidate path does with no cut), in two vectorized passes and no candidate list:
    /// over a vocabulary of 150k tokens, a list and a scalar `expf` call per token would
    /// be a sizeable share of a batched serve step.
    fn sample_whole(&mut self, logits: &[f32]) -> u32 {
        let max = max_finite(logits);
        if max == f32::NEG_INFINITY {
            return greedy(logits);
        }
        self.weights.resize(logits.len(), 0.0);
        let total = crate::backend::cpu::softmax_weights(
            logits,
            max,
            1.0 / self.cfg.temperature,
            &mut self.weights,
        );
        let target = self.rng.random::<f32>() * total;
        draw(&self.weights, target)
    }
}

/// How many weights [`draw`] sums at once before it looks inside.
const DRAW_BLOCK: usize = 256;

/// The first token whose running sum of `weights` passes `target`: the draw of a
/// categorical sample. Blocks of [`DRAW_BLOCK`] weights are summed in eight lanes and
/// skipped while their running total stays at or below `target`; only the block it passes
/// in is scanned one weight at a time, where one running sum over the whole vocabulary
/// would be a chain of dependent adds. A token of weight 0 is never drawn; when rounding
/// leaves `target` past every sum, the last token of positive weight is.
fn draw(weights: &[f32], target: f32) -> u32 {
    let mut cum = 0.0f32;
    for (b, block) in weights.chunks(DRAW_BLOCK).enumerate() {
        let sum = lane_sum(block);
        if target < cum + sum {
            let mut inner = cum;
            for (i, &w) in block.iter().enumerate() {
                if w > 0.0 {
                    inner += w;
                    if target < inner {
                        return (b * DRAW_BLOCK + i) as u32;
                    }
                }
            }
        }
        cum += sum;
    }
    weights.iter().rposition(|&w| w > 0.0).unwrap_or(0) as u32
}

/// The sum of `xs` in eight running lanes, so that it vectorizes.
fn lane_sum(xs: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let mut chunks = xs.chunks_exact(8);
    for c in &mut chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l += v;
        }
    }
    lanes.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()
}

/// The largest finite value of `xs` (minus infinity when there is none), kept in eight
/// running lanes so that it vectorizes: one running maximum is a chain of dependent
/// compares. The maximum of finite values does not depend on the order they are met in
/// (two zeros of either sign give the same weights).
pub(crate) fn max_finite(xs: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let mut chunks = xs.chunks_exact(8);
    for c in &mut chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            if v.is_finite() && v > *m {
                *m = v;
            }
        }
    }
    let mut best = f32::NEG_INFINITY;
    for &v in lanes.iter().chain(chunks.remainder()) {
        if v.is_finite() && v > best {
            best = v;
        }
    }
    best
}

/// Index of the largest logit (the lowest index on ties).
pub fn greedy(logits: &[f32]) -> u32 {
    crate::transformer::argmax(logits) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_finite_is_the_filtered_maximum() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for len in [0usize, 1, 7, 8, 9, 63, 1000] {
            let v: Vec<f32> = (0..len)
                .map(|_| match next() % 10 {
                    0 => f32::NAN,
                    1 => f32::INFINITY,
                    2 => f32::NEG_INFINITY,
                    _ => (next() % 2001) as f32 / 100.0 - 10.0,
                })
                .collect();
            let want = v
                .iter()
                .filter(|l| l.is_finite())
                .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            assert_eq!(max_finite(&v), want, "{len} values");
        }
        assert_eq!(max_finite(&[f32::NAN, f32::INFINITY]), f32::NEG_INFINITY);
    }

    #[test]
    fn greedy_by_default() {
        let mut s = Sampler::new(SamplerConfig::default());
        assert_eq!(s.sample(&mut [0.1, 2.0, -1.0, 1.9]), 1);
    }

    #[test]
    fn repeat_penalty_changes_choice() {
        let mut s = Sampler::new(SamplerConfig {
            repeat_penalty: 2.0,
            ..Default::default()
        });
        s.observe(&[1]);
        assert_eq!(s.sample(&mut [0.1, 2.0, -1.0, 1.9]), 3);
    }

    #[test]
    fn top_k_one_is_greedy_at_any_temperature() {
        let mut s = Sampler::new(SamplerConfig {
            temperature: 5.0,
            top_k: 1,
            seed: 9,
            ..Default::default()
        });
        for _ in 0..50 {
            assert_eq!(s.sample(&mut [0.1, 2.0, -1.0, 1.9]), 1);
        }
    }

    #[test]
    fn min_p_and_top_p_cut_the_tail() {
        let logits = [5.0, 4.9, -10.0, -10.0];
        let mut s = Sampler::new(SamplerConfig {
            temperature: 1.0,
            min_p: 0.5,
            seed: 1,
            ..Default::default()
        });
        let mut s2 = Sampler::new(SamplerConfig {
            temperature: 1.0,
            top_p: 0.5,
            seed: 1,
            ..Default::default()
        });
        for _ in 0..100 {
            assert!(s.sample(&mut logits.clone()) < 2);
            assert_eq!(s2.sample(&mut logits.clone()), 0);
        }
    }

    /// Plain temperature sampling draws in proportion to `e^(l / T)` and never a masked
    /// (-inf) or NaN logit; the two paths (whole vocabulary, and candidates with a cut that
    /// removes nothing) agree on the distribution.
    #[test]
    fn temperature_sampling_follows_the_softmax() {
        let mut logits = vec![f32::NEG_INFINITY; 40];
        logits[3] = 1.0;
        logits[7] = 2.0;
        logits[20] = 0.0;
        logits[21] = f32::NAN;
        let t = 0.8f64;
        let z: f64 = [1.0f64, 2.0, 0.0].iter().map(|l| (l / t).exp()).sum();
        let want = |l: f64| (l / t).exp() / z;
        for top_k in [0usize, 40] {
            let mut s = Sampler::new(SamplerConfig {
                temperature: t as f32,
                top_k,
                seed: 9,
                ..Default::default()
            });
            let n = 20_000;
            let mut counts = [0usize; 40];
            for _ in 0..n {
                counts[s.sample(&mut logits.clone()) as usize] += 1;
            }
            for (id, l) in [(3usize, 1.0), (7, 2.0), (20, 0.0)] {
                let got = counts[id] as f64 / n as f64;
                assert!(
                    (got - want(l)).abs() < 0.015,
                    "top_k {top_k} id {id}: {got} vs {}",
                    want(l)
                );
            }
            assert_eq!(
                counts[3] + counts[7] + counts[20],
                n,
                "top_k {top_k} drew a masked token"
            );
        }
    }

    /// Whole numbers add up exactly in f32, so the block-wise draw must pick exactly the
    /// token that one running sum picks, for every target: in the first block, the last
    /// (partial) block, right at a block's edge, past every sum, and over blocks of zeros.
    #[test]
    fn draw_matches_one_running_sum() {
        fn reference(weights: &[f32], target: f32) -> u32 {
            let (mut cum, mut last) = (0.0f32, 0);
            for (i, &w) in weights.iter().enumerate() {
                if w > 0.0 {
                    cum += w;
                    last = i;
                    if target < cum {
                        return i as u32;
                    }
                }
            }
            last as u32
        }
        proptest::proptest!(|(
            raw in proptest::collection::vec(0u8..4, 1..1200),
            zero_from in 0usize..1200,
            zero_len in 0usize..600,
            pick in 0.0f64..1.05,
        )| {
            let mut weights: Vec<f32> = raw.iter().map(|&w| w as f32).collect();
            let end = (zero_from + zero_len).min(weights.len());
            for w in weights.iter_mut().take(end).skip(zero_from) {
                *w = 0.0;
            }
            let total: f32 = weights.iter().sum();
            let target = (pick * total as f64).floor() as f32;
            let got = draw(&weights, target);
            proptest::prop_assert_eq!(got, reference(&weights, target));
            if total > 0.0 {
                proptest::prop_assert!(weights[got as usize] > 0.0);
            }
        });
        // no token of positive weight (the reference's answer, token 0)
        assert_eq!(draw(&[0.0; 300], 0.0), reference(&[0.0; 300], 0.0));
        // every edge of the first blocks, and the first token after one
        let weights = vec![1.0f32; 3 * DRAW_BLOCK + 5];
        for t in 0..weights.len() + 2 {
            assert_eq!(
                draw(&weights, t as f32),
                reference(&weights, t as f32),
                "target {t}"
            );
        }
    }

    /// Temperature sampling over a vocabulary of many blocks, most of them masked, draws
    /// only finite logits, in proportion to their weights.
    #[test]
    fn temperature_sampling_across_blocks() {
        let mut logits = vec![f32::NEG_INFINITY; 5 * DRAW_BLOCK + 7];
        let live = [
            (3usize, 0.5f32),
            (DRAW_BLOCK, 0.0),
            (3 * DRAW_BLOCK + 9, 1.0),
        ];
        let last = logits.len() - 1;
        for &(i, l) in &live {
            logits[i] = l;
        }
        logits[last] = 0.25;
        let mut s = Sampler::new(SamplerConfig {
            temperature: 1.0,
            seed: 5,
            ..Default::default()
        });
        let n = 20_000;
        let mut counts = std::collections::HashMap::new();
        for _ in 0..n {
            *counts
                .entry(s.sample(&mut logits.clone()))
                .or_insert(0usize) += 1;
        }
        let all = [live[0], live[1], live[2], (last, 0.25)];
        let z: f64 = all.iter().map(|&(_, l)| (l as f64).exp()).sum();
        for &(i, l) in &all {
            let got = *counts.get(&(i as u32)).unwrap_or(&0) as f64 / n as f64;
            let want = (l as f64).exp() / z;
            assert!((got - want).abs() < 0.015, "id {i}: {got} vs {want}");
        }
        assert_eq!(
            counts.len(),
            all.len(),
            "a masked token was drawn: {counts:?}"
        );
    }

    #[test]
    fn same_seed_same_tokens() {
        let cfg = SamplerConfig {
            temperature: 1.0,
            seed: 42,
            ..Default::default()
        };
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin()).collect();
        let run = || {
            let mut s = Sampler::new(cfg.clone());
            (0..20)
                .map(|_| s.sample(&mut logits.clone()))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(), run());
        let other: Vec<u32> = {
            let mut s = Sampler::new(SamplerConfig {
                seed: 43,
                ..cfg.clone()
            });
            (0..20).map(|_| s.sample(&mut logits.clone())).collect()
        };
        assert_ne!(run(), other);
    }

    #[test]
    fn rejects_bad_settings() {
        assert!(SamplerConfig {
            top_p: 0.0,
            ..Default::default()
        }
        .validate()
        .is_err());
        assert!(SamplerConfig {
            temperature: f32::NAN,
            ..Default::default()
        }
        .validate()
        .is_err());
        assert!(SamplerConfig::default().validate().is_ok());
    }
}
