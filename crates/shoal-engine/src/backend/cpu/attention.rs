//! The CPU backend's attention over its KV cache layout ([`super::kv`]), on plain slices:
//! for each query, scores against every visible cached key, a softmax (with the head's sink
//! logit where the model has them), and the weighted sum of the values. Decode runs one query per head, the query heads of a KV group together;
//! prefill runs `t` queries per head, heads in parallel. Each query head reads the KV head
//! its group maps to, so a tensor-parallel rank can hold any range of query heads.

use std::cell::RefCell;
use std::sync::Mutex;

use half::f16;
use rayon::prelude::*;

use crate::backend::cpu::kernels::{
    prefetch_l2, scores, softmax, softmax_with_sink, team, weighted_sum,
};

/// Shapes and options of attention over one rank's heads.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape<'a> {
    /// Query heads of this rank.
    pub n_head: usize,
    /// Global index of this rank's first query head.
    pub first_head: usize,
    /// Global index of this rank's first KV head.
    pub first_kv: usize,
    /// Query heads per KV head in the whole model.
    pub group: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Positions the cache buffers hold room for.
    pub capacity: usize,
    /// Sliding window: keys `window` or more positions back are not seen.
    pub window: Option<usize>,
    /// Score scale.
    pub scale: f32,
    /// Per query head of this rank, its sink logit (see [`crate::backend::Heads::sinks`]).
    pub sinks: Option<&'a [f32]>,
}

/// Keys per block in decode: 32 keys of 64 (128) values are 8 (16) KB of keys and as much
/// of values, which stay in L1 while every head of the group reads them.
const KEY_BLOCK: usize = 32;

/// Bytes of keys and values [`AttentionShape::prefetch`] asks for at most.
const PREFETCH_MAX: usize = 256 << 10;

/// Keys from which a decode step's team shares the attention: below, the other thread's
/// hand-over and its reads across cores (the queries, its group's keys and values, its
/// output back) cost about what the half it takes saves.
const TEAM_MIN_KEYS: usize = 32;

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

impl<'a> AttentionShape<'a> {
    /// The shape of `heads` over cache buffers of `capacity` positions.
    pub fn new(heads: &'a crate::backend::Heads, capacity: usize) -> Self {
        AttentionShape {
            n_head: heads.n_head,
            first_head: heads.first_head,
            first_kv: heads.first_kv,
            group: heads.group,
            head_dim: heads.head_dim,
            capacity,
            window: heads.window,
            scale: heads.scale,
            sinks: heads.sinks.as_deref(),
        }
    }

    /// The softmax of local head `h`'s scores `sc`, in place.
    fn softmax(&self, h: usize, sc: &mut [f32]) {
        match self.sinks {
            Some(s) => softmax_with_sink(sc, s[h]),
            None => softmax(sc),
        }
    }

    /// The local KV head that local query head `h` reads.
    fn kv_of(&self, h: usize) -> usize {
        (self.first_head + h) / self.group - self.first_kv
    }

    /// The keys a query at `pos` sees.
    fn visible(&self, pos: usize) -> std::ops::Range<usize> {
        let first = match self.window {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        };
        first..pos + 1
    }

    /// One query `qh` of head `h` at `pos` into `out`.
    fn one(&self, h: usize, pos: usize, qh: &[f32], k: &[f16], v: &[f16], out: &mut [f32]) {
        let hd = self.head_dim;
        let keys = self.visible(pos);
        let base = self.kv_of(h) * self.capacity * hd;
        let span = base + keys.start * hd..base + keys.end * hd;
        SCORES.with(|s| {
            let mut buf = s.borrow_mut();
            buf.resize(keys.len(), 0.0);
            scores(qh, &k[span.clone()], self.scale, &mut buf[..]);
            self.softmax(h, &mut buf[..]);
            out.fill(0.0);
            weighted_sum(&buf[..], &v[span], out);
        });
    }

    /// Asks for the keys and values a decode query at `pos` will read into L2, up to
    /// [`PREFETCH_MAX`] bytes of each from the newest position back (see
    /// `kernels::prefetch_l2`).
    pub fn prefetch(&self, pos: usize, k: &[f16], v: &[f16]) {
        let hd = self.head_dim;
        let keys = self.visible(pos);
        let per_head = (PREFETCH_MAX / 2 / (hd * 2 * self.kv_heads().max(1))).max(1);
        let from = keys.start.max(keys.end.saturating_sub(per_head));
        for kv in 0..self.kv_heads() {
            let base = kv * self.capacity * hd;
            let span = base + from * hd..(base + keys.end * hd).min(k.len()).min(v.len());
            if span.start < span.end {
                prefetch_l2(&k[span.clone()]);
                prefetch_l2(&v[span]);
            }
        }
    }

    /// The first local query head of local KV group `g`; `n_head` for `g` = [`Self::kv_heads`]
    /// (a shard's first and last groups may be partial).
    fn group_start(&self, g: usize) -> usize {
        if g == 0 {
            0
        } else {
            ((self.first_kv + g) * self.group)
                .saturating_sub(self.first_head)
                .min(self.n_head)
        }
    }

    /// The local KV heads this rank's query heads read.
    fn kv_heads(&self) -> usize {
        if self.n_head == 0 {
            0
        } else {
            self.kv_of(self.n_head - 1) + 1
        }
    }

    /// Decode: the query at `pos`. `q` is `(n_head, head_dim)`; `k` and `v` are the f16 cache
    /// buffers `(n_kv_head, capacity, head_dim)`; `out` gets `(n_head, head_dim)`.
    ///
    /// The query heads that share a KV head run together, block of keys by block of keys,
    /// so each block is read from memory once and from the L1 cache by the group's other
    /// heads (GQA models put 3 to 7 query heads on a KV head). The results are those of
    /// running each head alone, bit for bit.
    ///
    /// # Panics
    /// When a slice is shorter than the shapes say (the caller sized them).
    pub fn decode(&self, pos: usize, q: &[f32], k: &[f16], v: &[f16], out: &mut [f32]) {
        self.decode_heads(pos, 0..self.n_head, q, k, v, out, false);
    }

    /// [`AttentionShape::decode`] with the KV groups in parallel, for a step of one
    /// sequence. The gain is not the attention itself (a few groups of a few microseconds
    /// each: the fork costs about as much) but the pool: left idle through a
    /// single-threaded attention, its other threads fall asleep and are woken late for the
    /// output projection that follows. A batch of sequences is already parallel over its
    /// sequences and uses [`AttentionShape::decode`].
    ///
    /// Inside a decode step's team (`kernels::team`), whose helpers spin rather than steal
    /// rayon's work (a join there runs both halves on the caller), the groups are cut into
    /// one run per thread and shared through the team, from [`TEAM_MIN_KEYS`] keys on.
    pub fn decode_parallel(&self, pos: usize, q: &[f32], k: &[f16], v: &[f16], out: &mut [f32]) {
        let threads = rayon::current_num_threads();
        if threads > 1 && team::in_step() && self.visible(pos).len() >= TEAM_MIN_KEYS {
            let groups = self.kv_heads();
            let parts = threads.min(groups);
            if parts > 1 {
                // part j: the KV groups from j * groups / parts on, as heads
                let bound = |j: usize| self.group_start(j * groups / parts);
                let hd = self.head_dim;
                let mut rest = &mut out[..self.n_head * hd];
                let outs: Vec<Mutex<&mut [f32]>> = (0..parts)
                    .map(|j| {
                        let (o, r) =
                            std::mem::take(&mut rest).split_at_mut((bound(j + 1) - bound(j)) * hd);
                        rest = r;
                        Mutex::new(o)
                    })
                    .collect();
                team::for_each(parts, |j| {
                    let mut o = outs[j].lock().unwrap_or_else(|e| e.into_inner());
                    self.decode_heads(pos, bound(j)..bound(j + 1), q, k, v, &mut o, false);
                });
                return;
            }
        }
        // a rayon join inside a team's step would only run both halves on this thread
        let parallel = threads > 1 && !team::in_step();
        self.decode_heads(pos, 0..self.n_head, q, k, v, out, parallel);
    }

    /// [`AttentionShape::decode`] for query heads `heads`, `out` being theirs; with
    /// `parallel`, the KV groups in halves by `rayon::join`, split on a group boundary.
    #[allow(clippy::too_many_arguments)]
    fn decode_heads(
        &self,
        pos: usize,
        heads: std::ops::Range<usize>,
        q: &[f32],
        k: &[f16],
        v: &[f16],
        out: &mut [f32],
        parallel: bool,
    ) {
        let hd = self.head_dim;
        let (h0, h1) = (heads.start, heads.end);
        if h0 >= h1 {
            return;
        }
        let kv = self.kv_of(h0);
        if self.kv_of(h1 - 1) != kv {
            // the first head of the group holding the middle head, or the next group's
            let mid = (h0 + h1) / 2;
            let mut cut = (h0..=mid)
                .rev()
                .find(|&h| self.kv_of(h - 1) != self.kv_of(h));
            if cut.is_none() {
                cut = (mid + 1..h1).find(|&h| self.kv_of(h - 1) != self.kv_of(h));
            }
            let cut = cut.expect("two KV heads meet somewhere in the range");
            let (lo, hi) = out.split_at_mut((cut - h0) * hd);
            if parallel {
                rayon::join(
                    || self.decode_heads(pos, h0..cut, q, k, v, lo, true),
                    || self.decode_heads(pos, cut..h1, q, k, v, hi, true),
                );
            } else {
                self.decode_heads(pos, h0..cut, q, k, v, lo, false);
                self.decode_heads(pos, cut..h1, q, k, v, hi, false);
            }
            return;
        }
        let keys = self.visible(pos);
        let n = keys.len();
        let base = kv * self.capacity * hd + keys.start * hd;
        let (ks, vs) = (&k[base..base + n * hd], &v[base..base + n * hd]);
        SCORES.with(|s| {
            let mut buf = s.borrow_mut();
            buf.resize((h1 - h0) * n, 0.0);
            for b in (0..n).step_by(KEY_BLOCK) {
                let e = (b + KEY_BLOCK).min(n);
                for (i, h) in (h0..h1).enumerate() {
                    let qh = &q[h * hd..(h + 1) * hd];
                    let sc = &mut buf[i * n + b..i * n + e];
                    scores(qh, &ks[b * hd..e * hd], self.scale, sc);
                }
            }
            for (sc, h) in buf.chunks_exact_mut(n).zip(h0..h1) {
                self.softmax(h, sc);
            }
            out.fill(0.0);
            for b in (0..n).step_by(KEY_BLOCK) {
                let e = (b + KEY_BLOCK).min(n);
                for (i, o) in out.chunks_exact_mut(hd).enumerate() {
                    weighted_sum(&buf[i * n + b..i * n + e], &vs[b * hd..e * hd], o);
                }
            }
        });
    }

    /// Prefill: `t` queries at positions `p..p + t`, causal. `q` is `(t, n_head, head_dim)`
    /// (rows of a step); `out` gets the same layout. Heads run in parallel, each writing
    /// its own columns of every row.
    ///
    /// # Panics
    /// When a slice is shorter than the shapes say (the caller sized them).
    pub fn prefill(&self, p: usize, t: usize, q: &[f32], k: &[f16], v: &[f16], out: &mut [f32]) {
        let hd = self.head_dim;
        let width = self.n_head * hd;
        assert!(
            q.len() >= t * width && out.len() >= t * width,
            "prefill slices"
        );
        let outp = SendPtr(out.as_mut_ptr());
        (0..self.n_head).into_par_iter().for_each(|h| {
            for i in 0..t {
                let at = i * width + h * hd;
                // SAFETY: head `h` alone writes columns `h * hd..(h + 1) * hd` of each row,
                // inside `out` (checked above), and nothing reads `out` meanwhile.
                let o = unsafe { std::slice::from_raw_parts_mut(outp.get().add(at), hd) };
                self.one(h, p + i, &q[at..at + hd], k, v, o);
            }
        });
    }
}

/// A pointer the parallel prefill's heads share (each writes its own columns).
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);

// SAFETY: the heads of `prefill` write disjoint parts of one buffer through it.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Softmax attention of the query at `pos` written the obvious way, in f64.
    fn naive(a: &AttentionShape, pos: usize, q: &[f32], k: &[f16], v: &[f16]) -> Vec<f64> {
        let hd = a.head_dim;
        let mut out = vec![0f64; a.n_head * hd];
        for h in 0..a.n_head {
            let kvh = (a.first_head + h) / a.group - a.first_kv;
            let visible: Vec<usize> = (0..=pos)
                .filter(|&j| a.window.is_none_or(|w| pos - j < w))
                .collect();
            let s: Vec<f64> = visible
                .iter()
                .map(|&j| {
                    (0..hd)
                        .map(|d| q[h * hd + d] as f64 * k[(kvh * a.capacity + j) * hd + d].to_f64())
                        .sum::<f64>()
                        * a.scale as f64
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for (w, &j) in e.iter().zip(&visible) {
                for d in 0..hd {
                    out[h * hd + d] += w / z * v[(kvh * a.capacity + j) * hd + d].to_f64();
                }
            }
        }
        out
    }

    fn val(i: usize, salt: usize) -> f32 {
        (((i * 7919 + salt * 104729) % 1000) as f32 - 500.0) / 250.0
    }

    /// Heads 2..5 of a model with 3 query heads per KV head: local heads read KV heads 0,
    /// 1, 1 of the rank's two.
    fn shape(window: Option<usize>) -> AttentionShape<'static> {
        AttentionShape {
            n_head: 3,
            first_head: 2,
            first_kv: 0,
            group: 3,
            head_dim: 20,
            capacity: 17,
            window,
            scale: 0.3,
            sinks: None,
        }
    }

    #[test]
    fn decode_matches_naive_with_groups_shards_and_windows() {
        for (window, pos) in [(None, 0), (None, 13), (Some(4), 13), (Some(20), 13)] {
            let a = shape(window);
            let q: Vec<f32> = (0..3 * 20).map(|i| val(i, 1)).collect();
            let k: Vec<f16> = (0..2 * 17 * 20).map(|i| f16::from_f32(val(i, 2))).collect();
            let v: Vec<f16> = (0..2 * 17 * 20).map(|i| f16::from_f32(val(i, 3))).collect();
            let mut out = vec![0f32; 3 * 20];
            a.decode(pos, &q, &k, &v, &mut out);
            for (i, (got, want)) in out.iter().zip(naive(&a, pos, &q, &k, &v)).enumerate() {
                assert!(
                    (*got as f64 - want).abs() < 1e-5,
                    "{window:?} {pos} {i}: {got} vs {want}"
                );
            }
            // the groups in parallel: the same bits
            let mut par = vec![f32::NAN; 3 * 20];
            a.decode_parallel(pos, &q, &k, &v, &mut par);
            assert_eq!(par, out, "{window:?} {pos}: parallel decode");
        }
    }

    /// 7 local heads from global head 1, 2 per KV head (groups of 1, 2, 2, 2), a cache of 9
    /// positions.
    fn ragged_shard(window: Option<usize>) -> AttentionShape<'static> {
        AttentionShape {
            n_head: 7,
            first_head: 1,
            first_kv: 0,
            group: 2,
            head_dim: 8,
            capacity: 9,
            window,
            scale: 0.5,
            sinks: None,
        }
    }

    #[test]
    fn parallel_decode_splits_ragged_groups() {
        let a = ragged_shard(None);
        // the groups' first heads, as the KV head of each head says
        let firsts: Vec<usize> = (0..=a.kv_heads()).map(|g| a.group_start(g)).collect();
        assert_eq!(firsts, [0, 1, 3, 5, 7]);
        let q: Vec<f32> = (0..7 * 8).map(|i| val(i, 7)).collect();
        let k: Vec<f16> = (0..4 * 9 * 8).map(|i| f16::from_f32(val(i, 8))).collect();
        let v: Vec<f16> = (0..4 * 9 * 8).map(|i| f16::from_f32(val(i, 9))).collect();
        let (mut one, mut par) = (vec![0f32; 7 * 8], vec![f32::NAN; 7 * 8]);
        a.decode(6, &q, &k, &v, &mut one);
        a.decode_parallel(6, &q, &k, &v, &mut par);
        assert_eq!(one, par);
        for (i, (got, want)) in one.iter().zip(naive(&a, 6, &q, &k, &v)).enumerate() {
            assert!((*got as f64 - want).abs() < 1e-5, "{i}: {got} vs {want}");
        }
        // in a decode step's team of 2 and 3 threads, with enough keys to share: one run of
        // groups per thread
        let a = AttentionShape {
            capacity: TEAM_MIN_KEYS + 9,
            ..a
        };
        let pos = TEAM_MIN_KEYS + 3;
        let k: Vec<f16> = (0..4 * a.capacity * 8)
            .map(|i| f16::from_f32(val(i, 8)))
            .collect();
        let v: Vec<f16> = (0..4 * a.capacity * 8)
            .map(|i| f16::from_f32(val(i, 9)))
            .collect();
        let mut want = vec![0f32; 7 * 8];
        a.decode(pos, &q, &k, &v, &mut want);
        for threads in [2, 3] {
            let pool = team::test_pool(threads);
            team::until_teamed(
                &pool,
                || {
                    let mut par = vec![f32::NAN; 7 * 8];
                    a.decode_parallel(pos, &q, &k, &v, &mut par);
                    par
                },
                |par, _| assert_eq!(want, par, "{threads} threads"),
            );
        }
        for (i, (got, want)) in want.iter().zip(naive(&a, pos, &q, &k, &v)).enumerate() {
            assert!((*got as f64 - want).abs() < 1e-5, "{i}: {got} vs {want}");
        }
    }

    #[test]
    fn prefetch_stays_inside_the_cache_buffers() {
        // every position of a full cache, with and without a window, on a ragged shard of
        // heads, and a cache too short for its shape (a caller's mistake) asks for nothing
        // past its end
        for window in [None, Some(3)] {
            let a = ragged_shard(window);
            assert_eq!(a.kv_heads(), 4);
            let k = vec![f16::ZERO; 4 * 9 * 8];
            for pos in 0..9 {
                a.prefetch(pos, &k, &k);
            }
            a.prefetch(8, &k[..100], &k[..50]);
        }
    }

    #[test]
    fn grouped_decode_is_each_head_alone_bit_for_bit() {
        // the heads of a group run block by block together, a head alone in one pass: the
        // same sums. Past one key block, at SIMD and tail head sizes.
        for (hd, pos) in [(64, 70), (20, 40), (8, 3)] {
            let cap = 80;
            let a = AttentionShape {
                n_head: 6,
                first_head: 0,
                first_kv: 0,
                group: 3,
                head_dim: hd,
                capacity: cap,
                window: None,
                scale: 0.2,
                sinks: None,
            };
            let q: Vec<f32> = (0..6 * hd).map(|i| val(i, 10)).collect();
            let k: Vec<f16> = (0..2 * cap * hd)
                .map(|i| f16::from_f32(val(i, 11)))
                .collect();
            let v: Vec<f16> = (0..2 * cap * hd)
                .map(|i| f16::from_f32(val(i, 12)))
                .collect();
            let mut grouped = vec![f32::NAN; 6 * hd];
            a.decode(pos, &q, &k, &v, &mut grouped);
            for h in 0..6 {
                let mut alone = vec![f32::NAN; hd];
                a.one(h, pos, &q[h * hd..(h + 1) * hd], &k, &v, &mut alone);
                assert_eq!(
                    &grouped[h * hd..(h + 1) * hd],
                    &alone[..],
                    "hd {hd} head {h}"
                );
            }
        }
    }

    #[test]
    fn prefill_is_decode_at_each_position() {
        for window in [None, Some(3)] {
            let a = shape(window);
            let (p, t, hd) = (4, 6, 20);
            let q: Vec<f32> = (0..3 * t * hd).map(|i| val(i, 4)).collect();
            let k: Vec<f16> = (0..2 * 17 * hd).map(|i| f16::from_f32(val(i, 5))).collect();
            let v: Vec<f16> = (0..2 * 17 * hd).map(|i| f16::from_f32(val(i, 6))).collect();
            let mut out = vec![0f32; t * 3 * hd];
            a.prefill(p, t, &q, &k, &v, &mut out);
            for i in 0..t {
                let qi = &q[i * 3 * hd..(i + 1) * 3 * hd];
                let mut want = vec![0f32; 3 * hd];
                a.decode(p + i, qi, &k, &v, &mut want);
                assert_eq!(
                    &out[i * 3 * hd..(i + 1) * 3 * hd],
                    &want[..],
                    "{window:?} {i}"
                );
            }
        }
    }
}
