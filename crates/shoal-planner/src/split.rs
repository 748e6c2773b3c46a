//! How the tensor-parallel ranks of a stage share each layer, cut exactly as the executor
//! cuts it (`shoal-engine/src/shard.rs`): query heads in units whose columns of the attention
//! output are whole quantization blocks (whole KV groups when there are enough), feed-forward
//! features in whole blocks of the down projection, vocabulary rows in units of 16, routed
//! experts whole; each as even as the units allow, so 14 heads over 3 ranks are 5, 4, 5. A
//! rank holds every KV head its query heads read, so KV heads are replicated when ranks
//! outnumber them.
//!
//! Bytes follow the cuts: a rank's share of a part of `B` bytes cut into `n` units, holding
//! units `a..b`, is `floor(B b / n) - floor(B a / n)`, so shares of a partition add up to `B`
//! exactly.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::spec::ModelProfile;

/// Vocabulary rows go to ranks in units of this many (as the executor cuts them).
pub const VOCAB_UNIT: usize = 16;

/// What one tensor-parallel rank of a stage holds of every layer of the stage and of the
/// vocabulary.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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

/// What each of `tp` ranks of a stage holds, in tensor-parallel order.
///
/// # Errors
/// A sentence naming the limit when the model cannot be cut that finely (more ranks than
/// head units, feature blocks, vocabulary units or experts).
pub fn tensor_split(model: &ModelProfile, tp: usize) -> Result<Vec<RankShare>, String> {
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
    let experts = match model.n_experts() {
        0 => vec![0..0; tp],
        n => cut(n, 1, tp).ok_or_else(|| format!("tp {tp} exceeds the {n} experts"))?,
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
            }
        })
        .collect())
}

impl RankShare {
    /// Weight bytes of layer `l` this rank holds.
    pub fn layer_bytes(&self, model: &ModelProfile, l: usize) -> u64 {
        let p = model.layer_parts(l);
        part(p.attn_q_o, &self.heads, model.n_heads)
            + part(p.attn_kv, &self.kv_heads, model.n_kv_heads)
            + part(p.ffn, &self.ffn, model.ffn)
            + part(p.experts, &self.experts, model.n_experts())
    }

    /// Weight bytes of layer `l` this rank reads per decoded token: all it holds but the
    /// routed experts, of which a token reads the active fraction (in expectation, with
    /// tokens routed evenly).
    pub fn layer_read(&self, model: &ModelProfile, l: usize) -> f64 {
        let p = model.layer_parts(l);
        let experts = part(p.experts, &self.experts, model.n_experts());
        (self.layer_bytes(model, l) - experts) as f64 + experts as f64 * model.active_fraction()
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
        let s = tensor_split(&m, 3).unwrap();
        let heads: Vec<usize> = s.iter().map(|r| r.heads.len()).collect();
        assert_eq!(heads, vec![5, 4, 5]);
        assert_eq!(s[0].ffn.len() / 256, 6);
        assert_eq!(s[1].ffn.len() / 256, 7);
        // the middle rank's heads straddle both KV groups
        assert_eq!(s[1].kv_heads, 0..2);
        assert!(tensor_split(&m, 15).unwrap_err().contains("head units"));
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
