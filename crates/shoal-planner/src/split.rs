//! How the tensor-parallel ranks of a stage share each layer, cut exactly as the executor
//! cuts it (`shoal-engine/src/shard.rs`): query heads in units whose columns of the attention
//! output are whole quantization blocks (whole KV groups when there are enough), feed-forward
//! features in whole blocks of the down projection, vocabulary rows in units of 16, routed
//! experts whole or sliced by features ([`ExpertSplit`]); each as even as the units allow, so
//! 14 heads over 3 ranks are 5, 4, 5. A rank holds every KV head its query heads read, so KV
//! heads are replicated when ranks outnumber them.
//!
//! A token reads `k` of a layer's `n` routed experts. With whole experts per rank, the rank
//! that holds most of them sets the pace: [`expected_busiest`] is the expected largest count
//! on one rank, exactly, over every choice of `k` of `n`. With sliced experts every rank reads
//! all `k`, each its slice, so the widest slice sets the pace.
//!
//! Bytes follow the cuts: a rank's share of a part of `B` bytes cut into `n` units, holding
//! units `a..b`, is `floor(B b / n) - floor(B a / n)`, so shares of a partition add up to `B`
//! exactly.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::spec::ModelProfile;

/// Vocabulary rows go to ranks in units of this many (as the executor cuts them).
pub const VOCAB_UNIT: usize = 16;

/// How a stage's tensor-parallel ranks divide a mixture of experts' routed experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ExpertSplit {
    /// Whichever reads fewer bytes on the busiest rank per decoded token
    /// ([`expert_split_cost`]).
    #[default]
    Auto,
    /// Each rank holds whole experts (expert parallelism).
    Whole,
    /// Each rank holds a slice of every expert's features (tensor parallelism).
    Sliced,
}

impl ExpertSplit {
    /// The split's name as the command line spells it.
    pub fn name(self) -> &'static str {
        match self {
            ExpertSplit::Auto => "auto",
            ExpertSplit::Whole => "whole",
            ExpertSplit::Sliced => "sliced",
        }
    }

    /// `Whole` or `Sliced` for `tp` ranks over `n` experts of `ffn` features in blocks of
    /// `block`, `k` per token: this split where it is one of them, else the cheaper
    /// possible one; `None` when neither is possible.
    pub fn resolve(
        self,
        n: usize,
        k: usize,
        ffn: usize,
        block: usize,
        tp: usize,
    ) -> Option<ExpertSplit> {
        let (whole, sliced) = expert_split_cost(n, k, ffn, block, tp);
        match self {
            ExpertSplit::Whole => whole.map(|_| ExpertSplit::Whole),
            ExpertSplit::Sliced => sliced.map(|_| ExpertSplit::Sliced),
            ExpertSplit::Auto => match (whole, sliced) {
                (Some(w), Some(s)) if s < w => Some(ExpertSplit::Sliced),
                (Some(_), _) => Some(ExpertSplit::Whole),
                (None, Some(_)) => Some(ExpertSplit::Sliced),
                (None, None) => None,
            },
        }
    }
}

impl std::str::FromStr for ExpertSplit {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(ExpertSplit::Auto),
            "whole" => Ok(ExpertSplit::Whole),
            "sliced" => Ok(ExpertSplit::Sliced),
            other => Err(format!("expert split `{other}`: use whole, sliced or auto")),
        }
    }
}

/// The expected largest number of a token's `k` routed experts (of `n`) that fall on one
/// rank when the ranks hold `cut` of them, over every way of choosing `k` of `n` (exact: the
/// ranks' counts follow a multivariate hypergeometric law, counted by dynamic programming
/// over the ranks).
pub fn expected_busiest(n: usize, k: usize, cut: &[Range<usize>]) -> f64 {
    let binom = |a: usize, b: usize| -> f64 {
        if b > a {
            return 0.0;
        }
        (0..b).fold(1.0, |acc, i| acc * (a - i) as f64 / (i + 1) as f64)
    };
    let total = binom(n, k);
    if total == 0.0 {
        return 0.0;
    }
    // E[max] = sum over m of P(max > m); ways[j]: choices of j experts among the ranks so
    // far with at most m on each
    let mut expected = 0.0;
    for m in 0..k {
        let mut ways = vec![0f64; k + 1];
        ways[0] = 1.0;
        for r in cut {
            let mut next = vec![0f64; k + 1];
            for (j, &w) in ways.iter().enumerate() {
                if w == 0.0 {
                    continue;
                }
                for c in 0..=m.min(r.len()).min(k - j) {
                    next[j + c] += w * binom(r.len(), c);
                }
            }
            ways = next;
        }
        expected += 1.0 - ways[k] / total;
    }
    expected
}

/// What one MoE layer's routed experts cost the busiest of `tp` ranks per decoded token, in
/// experts' worth of bytes, split each way: `(whole, sliced)`; `None` where the split is
/// impossible (fewer experts, or fewer feature blocks, than ranks).
pub fn expert_split_cost(
    n: usize,
    k: usize,
    ffn: usize,
    block: usize,
    tp: usize,
) -> (Option<f64>, Option<f64>) {
    let whole = cut(n, 1, tp).map(|c| expected_busiest(n, k, &c));
    let sliced = (ffn > 0).then(|| cut(ffn, block, tp)).flatten().map(|c| {
        let widest = c.iter().map(|r| r.len()).max().unwrap_or(0);
        k as f64 * widest as f64 / ffn as f64
    });
    (whole, sliced)
}

/// What one tensor-parallel rank of a stage holds of every layer of the stage and of the
/// vocabulary.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankShare {
    /// Query heads.
    pub heads: Range<usize>,
    /// KV heads (those its query heads read).
    pub kv_heads: Range<usize>,
    /// Feed-forward features.
    pub ffn: Range<usize>,
    /// Vocabulary rows of the embedding (first stage) and output head (last stage).
    pub vocab: Range<usize>,
    /// Routed experts (empty for a dense model).
    pub experts: Range<usize>,
    /// Features of each held expert (all of them for whole experts; empty when unknown).
    #[serde(default)]
    pub expert_ffn: Range<usize>,
    /// Experts the rank is charged for per token, each at its held part of an expert (see
    /// the module): the busiest rank's expected count for whole experts, `k` for slices.
    #[serde(default)]
    pub routed_read: f64,
}

/// Cuts `0..len` into `parts` ranges, each a multiple of `unit` long except possibly the
/// last, as even as that allows; `None` when some range would be empty. The executor's cut.
pub fn cut(len: usize, unit: usize, parts: usize) -> Option<Vec<Range<usize>>> {
    let unit = unit.max(1);
    let units = len.div_ceil(unit);
    if parts == 0 || units < parts {
        return None;
    }
    let bound = |i: usize| {
        if i == parts {
            len
        } else {
            ((i * len + parts * unit / 2) / (parts * unit) * unit).min(len)
        }
    };
    let ranges: Vec<Range<usize>> = (0..parts).map(|i| bound(i)..bound(i + 1)).collect();
    ranges.iter().all(|r| !r.is_empty()).then_some(ranges)
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn lcm(a: usize, b: usize) -> usize {
    if a == 0 || b == 0 {
        return a.max(b);
    }
    a / gcd(a, b) * b
}

/// The share of `bytes` of a part cut into `n` units that a rank holding units `r` gets.
pub fn part(bytes: u64, r: &Range<usize>, n: usize) -> u64 {
    if n == 0 {
        return 0;
    }
    let at = |i: usize| (u128::from(bytes) * i.min(n) as u128 / n as u128) as u64;
    at(r.end) - at(r.start.min(r.end))
}

/// What each of `tp` ranks of a stage holds, in tensor-parallel order, routed experts cut
/// as `experts` says (resolved as [`ExpertSplit::resolve`]; see [`split_of`]).
///
/// # Errors
/// A sentence naming the limit when the model cannot be cut that finely (more ranks than
/// head units, feature blocks, vocabulary units or experts).
pub fn tensor_split(
    model: &ModelProfile,
    tp: usize,
    experts: ExpertSplit,
) -> Result<Vec<RankShare>, String> {
    if tp == 0 {
        return Err("0 tensor-parallel ranks".into());
    }
    let hd = model.head_dim.max(1);
    let o_block = model.attn_quant_block.unwrap_or(model.quant_block).max(1) as usize;
    let group = model.n_heads / model.n_kv_heads.max(1);
    let head_unit = lcm(hd, o_block) / hd;
    let group_unit = lcm(group.max(1), head_unit);
    let heads = if model.n_heads / group_unit >= tp && model.n_heads.is_multiple_of(group_unit) {
        cut(model.n_heads, group_unit, tp)
    } else {
        cut(model.n_heads, head_unit, tp)
    }
    .ok_or_else(|| {
        format!(
            "tp {tp} exceeds the {} head units ({} heads in units of {head_unit})",
            model.n_heads.div_ceil(head_unit),
            model.n_heads
        )
    })?;
    let block = model.quant_block.max(1) as usize;
    let ffn = cut(model.ffn, block, tp).ok_or_else(|| {
        format!(
            "tp {tp} exceeds the {} feed-forward blocks ({} features in blocks of {block})",
            model.ffn.div_ceil(block),
            model.ffn
        )
    })?;
    let vocab = cut(model.vocab, VOCAB_UNIT, tp)
        .ok_or_else(|| format!("tp {tp} exceeds a vocabulary of {}", model.vocab))?;
    let (experts, expert_ffn, routed_read) = match &model.experts {
        Some(m) if m.n_experts > 0 => {
            let (n, k) = (m.n_experts as usize, m.active_experts as usize);
            let (f, b) = (m.expert_ffn, m.expert_block.max(1) as usize);
            match split_of(model, tp, experts) {
                Some(ExpertSplit::Sliced) => {
                    // every rank reads all k experts, each its own slice of them
                    let c = cut(f, b, tp).expect("resolved as possible");
                    (vec![0..n; tp], c, k as f64)
                }
                Some(_) => {
                    let c = cut(n, 1, tp).expect("resolved as possible");
                    let busiest = expected_busiest(n, k, &c);
                    (c, vec![0..f; tp], busiest)
                }
                None => return Err(format!("tp {tp} exceeds the {n} experts")),
            }
        }
        _ => (vec![0..0; tp], vec![0..0; tp], 0.0),
    };
    Ok((0..tp)
        .map(|i| {
            let h = heads[i].clone();
            RankShare {
                kv_heads: h.start / group.max(1)..h.end.div_ceil(group.max(1)),
                heads: h,
                ffn: ffn[i].clone(),
                vocab: vocab[i].clone(),
                experts: experts[i].clone(),
                expert_ffn: expert_ffn[i].clone(),
                routed_read,
            }
        })
        .collect())
}

/// The split `tp` ranks of `model` use for its routed experts: `Whole` or `Sliced` as
/// `asked` resolves ([`ExpertSplit::resolve`]), `Auto` for a dense model or one rank, `None`
/// when the experts cannot be cut so.
pub fn split_of(model: &ModelProfile, tp: usize, asked: ExpertSplit) -> Option<ExpertSplit> {
    match &model.experts {
        Some(m) if m.n_experts > 0 && tp > 1 => asked.resolve(
            m.n_experts as usize,
            m.active_experts as usize,
            m.expert_ffn,
            m.expert_block.max(1) as usize,
            tp,
        ),
        _ => Some(ExpertSplit::Auto),
    }
}

impl RankShare {
    /// Bytes of layer `l`'s routed experts this rank holds.
    pub fn expert_bytes(&self, model: &ModelProfile, l: usize) -> u64 {
        let p = model.layer_parts(l);
        let whole = part(p.experts, &self.experts, model.n_experts());
        match &model.experts {
            Some(m) if m.expert_ffn > 0 => part(whole, &self.expert_ffn, m.expert_ffn),
            _ => whole,
        }
    }

    /// Weight bytes of layer `l` this rank holds.
    pub fn layer_bytes(&self, model: &ModelProfile, l: usize) -> u64 {
        let p = model.layer_parts(l);
        part(p.attn_q_o, &self.heads, model.n_heads)
            + part(p.attn_kv, &self.kv_heads, model.n_kv_heads)
            + part(p.ffn, &self.ffn, model.ffn)
            + self.expert_bytes(model, l)
    }

    /// Bytes of layer `l`'s routed experts this rank is charged per decoded token: the
    /// busiest rank's experts' worth ([`RankShare::routed_read`]) of one expert's held part,
    /// or on one rank the active fraction of them all.
    pub fn routed_layer_read(&self, model: &ModelProfile, l: usize) -> f64 {
        let n = model.n_experts();
        if n == 0 {
            return 0.0;
        }
        let all = model.layer_parts(l).experts as f64;
        let per_expert_slice = match &model.experts {
            Some(m) if m.expert_ffn > 0 => {
                all / n as f64 * self.expert_ffn.len() as f64 / m.expert_ffn as f64
            }
            _ => all / n as f64,
        };
        if self.routed_read > 0.0 {
            self.routed_read * per_expert_slice
        } else {
            self.expert_bytes(model, l) as f64 * model.active_fraction()
        }
    }

    /// Weight bytes of layer `l` this rank reads per decoded token: all it holds but the
    /// routed experts, and of those what [`RankShare::routed_layer_read`] charges.
    pub fn layer_read(&self, model: &ModelProfile, l: usize) -> f64 {
        (self.layer_bytes(model, l) - self.expert_bytes(model, l)) as f64
            + self.routed_layer_read(model, l)
    }

    /// KV cache bytes per token per layer this rank keeps.
    pub fn kv_per_token_layer(&self, model: &ModelProfile) -> u64 {
        part(
            model.kv_bytes_per_token_per_layer,
            &self.kv_heads,
            model.n_kv_heads,
        )
    }

    /// Bytes of this rank's slice of the embedding.
    pub fn embedding_bytes(&self, model: &ModelProfile) -> u64 {
        part(model.embedding_bytes, &self.vocab, model.vocab)
    }

    /// Bytes of this rank's slice of the output head.
    pub fn head_bytes(&self, model: &ModelProfile) -> u64 {
        part(model.head_bytes, &self.vocab, model.vocab)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::dense_model;

    #[test]
    fn cuts_match_the_executor() {
        assert_eq!(cut(14, 1, 3).unwrap(), vec![0..5, 5..9, 9..14]);
        assert_eq!(
            cut(4864, 256, 3).unwrap(),
            vec![0..1536, 1536..3328, 3328..4864]
        );
        assert!(cut(2, 1, 3).is_none());
    }

    #[test]
    fn qwen05_over_three_ranks() {
        // 14 heads of 64 (o_proj in 32-blocks), 2 KV heads, 4864 features in 256-blocks
        let mut m = dense_model(24, 14, 2, 64, 4864, 1000);
        m.quant_block = 256;
        m.attn_quant_block = Some(32);
        let s = tensor_split(&m, 3, ExpertSplit::Auto).unwrap();
        let heads: Vec<usize> = s.iter().map(|r| r.heads.len()).collect();
        assert_eq!(heads, vec![5, 4, 5]);
        assert_eq!(s[0].ffn.len() / 256, 6);
        assert_eq!(s[1].ffn.len() / 256, 7);
        // the middle rank's heads straddle both KV groups
        assert_eq!(s[1].kv_heads, 0..2);
        assert!(tensor_split(&m, 15, ExpertSplit::Auto)
            .unwrap_err()
            .contains("head units"));
    }

    #[test]
    fn the_busiest_rank_expectation_is_exact() {
        // 8 of 128 experts over two even halves: E max(X, 8 - X), X hypergeometric
        let halves = [0..64, 64..128];
        let binom = |a: f64, b: f64| -> f64 {
            (0..b as usize).fold(1.0, |acc, i| acc * (a - i as f64) / (i as f64 + 1.0))
        };
        let want: f64 = (0..=8)
            .map(|x| {
                let p = binom(64.0, x as f64) * binom(64.0, (8 - x) as f64) / binom(128.0, 8.0);
                p * (x.max(8 - x) as f64)
            })
            .sum();
        assert!((expected_busiest(128, 8, &halves) - want).abs() < 1e-9);
        // one rank holds every chosen expert
        let all: Vec<Range<usize>> = std::iter::once(0..16).collect();
        assert!((expected_busiest(16, 4, &all) - 4.0).abs() < 1e-12);
        // each expert its own rank: the busiest holds one
        let singles: Vec<_> = (0..4).map(|i| i..i + 1).collect();
        assert!((expected_busiest(4, 2, &singles) - 1.0).abs() < 1e-12);
    }

    #[test]
    fn qwen3_30b_experts_go_whole_on_two_ranks_and_sliced_on_three() {
        // 128 experts of 768 features in 256-blocks, 8 per token
        let (w2, s2) = expert_split_cost(128, 8, 768, 256, 2);
        assert!(w2.unwrap() < s2.unwrap(), "{w2:?} {s2:?}");
        assert_eq!(
            ExpertSplit::Auto.resolve(128, 8, 768, 256, 2),
            Some(ExpertSplit::Whole)
        );
        let (w3, s3) = expert_split_cost(128, 8, 768, 256, 3);
        assert!(s3.unwrap() < w3.unwrap(), "{w3:?} {s3:?}");
        assert_eq!(
            ExpertSplit::Auto.resolve(128, 8, 768, 256, 3),
            Some(ExpertSplit::Sliced)
        );
        // four ranks cannot slice three blocks
        assert_eq!(expert_split_cost(128, 8, 768, 256, 4).1, None);
        assert_eq!(ExpertSplit::Sliced.resolve(128, 8, 768, 256, 4), None);
    }

    #[test]
    fn routed_reads_follow_the_split() {
        // DeepSeek V3: 256 experts of 2048 features in 256-blocks, 8 per token
        let m = crate::testing::deepseek_v3_q4();
        let l = 10;
        let all = m.layer_parts(l).experts as f64;
        let one = &tensor_split(&m, 1, ExpertSplit::Auto).unwrap()[0];
        assert!((one.routed_layer_read(&m, l) - all * 8.0 / 256.0).abs() < 1.0);
        // sliced in two: each rank reads its half of all 8 experts
        for r in tensor_split(&m, 2, ExpertSplit::Sliced).unwrap() {
            assert_eq!(r.expert_ffn.len(), 1024);
            let want = all * 8.0 / 256.0 / 2.0;
            assert!((r.routed_layer_read(&m, l) - want).abs() < 1.0, "{r:?}");
        }
        // whole in two: each rank is charged the busier half's expected count
        let busiest = expected_busiest(256, 8, &[0..128, 128..256]);
        assert!(busiest > 4.0 && busiest < 6.0, "{busiest}");
        for r in tensor_split(&m, 2, ExpertSplit::Whole).unwrap() {
            let want = all / 256.0 * busiest;
            assert!((r.routed_layer_read(&m, l) - want).abs() < 1.0, "{r:?}");
        }
    }

    #[test]
    fn shares_of_a_partition_add_up() {
        for n in 1..20 {
            for parts in 1..=n.min(5) {
                let ranges = cut(n, 1, parts).unwrap();
                for bytes in [0u64, 1, 7, 1_000_003] {
                    let s: u64 = ranges.iter().map(|r| part(bytes, r, n)).sum();
                    assert_eq!(s, bytes);
                }
            }
        }
    }
}
