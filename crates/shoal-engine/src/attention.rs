//! Attention of one new position over the KV cache, on plain slices: for each query head,
//! scores against every visible cached key, a softmax, and the weighted sum of the values.
//! This is the decode step's attention (candle's batched matmuls serve prefill, where they
//! are faster); at decode, dispatching several tensor ops per layer cost more than the
//! arithmetic (16% of a SmolLM2 token, measured with `shoal bench --profile`).

use std::cell::RefCell;

use crate::kernels::{scores, weighted_sum};

/// Shapes and options of one decode attention.
#[derive(Debug, Clone, Copy)]
pub struct DecodeAttention {
    /// Query heads.
    pub n_head: usize,
    /// KV heads (each serves `n_head / n_kv_head` query heads).
    pub n_kv_head: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Positions the cache buffers hold room for.
    pub capacity: usize,
    /// Position of the query (keys `0..=pos` are cached, the query's own included).
    pub pos: usize,
    /// Sliding window: keys `window` or more positions back are not seen.
    pub window: Option<usize>,
    /// Score scale.
    pub scale: f32,
}

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

impl DecodeAttention {
    /// `q` is `(n_head, head_dim)`; `k` and `v` are the cache buffers `(n_kv_head, capacity,
    /// head_dim)`; `out` gets `(n_head, head_dim)`.
    ///
    /// # Panics
    /// When a slice is shorter than the shapes say (the caller sized them).
    pub fn run(&self, q: &[f32], k: &[f32], v: &[f32], out: &mut [f32]) {
        let hd = self.head_dim;
        let group = self.n_head / self.n_kv_head;
        let first = match self.window {
            Some(w) => (self.pos + 1).saturating_sub(w),
            None => 0,
        };
        let keys = first..self.pos + 1;
        SCORES.with(|s| {
            let mut scores_buf = s.borrow_mut();
            scores_buf.resize(keys.len(), 0.0);
            for h in 0..self.n_head {
                let kvh = h / group;
                let qh = &q[h * hd..(h + 1) * hd];
                let base = kvh * self.capacity * hd;
                let span = base + keys.start * hd..base + keys.end * hd;
                scores(qh, &k[span.clone()], self.scale, &mut scores_buf[..]);
                let max = scores_buf.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0f32;
                for sc in scores_buf.iter_mut() {
                    *sc = (*sc - max).exp();
                    sum += *sc;
                }
                for sc in scores_buf.iter_mut() {
                    *sc /= sum;
                }
                weighted_sum(&scores_buf[..], &v[span], &mut out[h * hd..(h + 1) * hd]);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Softmax attention written the obvious way, in f64.
    fn naive(a: &DecodeAttention, q: &[f32], k: &[f32], v: &[f32]) -> Vec<f64> {
        let hd = a.head_dim;
        let mut out = vec![0f64; a.n_head * hd];
        for h in 0..a.n_head {
            let kvh = h / (a.n_head / a.n_kv_head);
            let visible: Vec<usize> = (0..=a.pos)
                .filter(|&j| a.window.is_none_or(|w| a.pos - j < w))
                .collect();
            let s: Vec<f64> = visible
                .iter()
                .map(|&j| {
                    (0..hd)
                        .map(|d| q[h * hd + d] as f64 * k[(kvh * a.capacity + j) * hd + d] as f64)
                        .sum::<f64>()
                        * a.scale as f64
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for (w, &j) in e.iter().zip(&visible) {
                for d in 0..hd {
                    out[h * hd + d] += w / z * v[(kvh * a.capacity + j) * hd + d] as f64;
                }
            }
        }
        out
    }

    #[test]
    fn matches_naive_attention_with_groups_and_windows() {
        let val =
            |i: usize, salt: usize| (((i * 7919 + salt * 104729) % 1000) as f32 - 500.0) / 250.0;
        for (window, pos) in [(None, 0), (None, 13), (Some(4), 13), (Some(20), 13)] {
            let a = DecodeAttention {
                n_head: 6,
                n_kv_head: 2,
                head_dim: 20,
                capacity: 17,
                pos,
                window,
                scale: 0.3,
            };
            let q: Vec<f32> = (0..6 * 20).map(|i| val(i, 1)).collect();
            let k: Vec<f32> = (0..2 * 17 * 20).map(|i| val(i, 2)).collect();
            let v: Vec<f32> = (0..2 * 17 * 20).map(|i| val(i, 3)).collect();
            let mut out = vec![0f32; 6 * 20];
            a.run(&q, &k, &v, &mut out);
            for (i, (got, want)) in out.iter().zip(naive(&a, &q, &k, &v)).enumerate() {
                assert!(
                    (*got as f64 - want).abs() < 1e-5,
                    "{window:?} {pos} {i}: {got} vs {want}"
                );
            }
        }
    }
}
