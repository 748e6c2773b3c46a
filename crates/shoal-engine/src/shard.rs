//! Which part of a model each rank holds. A split is `tp` ranks per pipeline stage times `pp`
//! stages; rank `r` is tensor-parallel index `r % tp` of stage `r / tp`. A stage holds a
//! contiguous range of layers; inside a stage each tensor-parallel rank holds a range of query
//! heads (with the KV heads they read), a range of feed-forward features and a range of the
//! vocabulary (for the embedding of the first stage and the output head of the last).
//!
//! Cuts fall where the weights allow them: a row-parallel matrix (attention output, FFN down)
//! is cut between its columns, which must be whole quantization blocks, so heads and features
//! go to ranks in units of blocks. The split is as even as those units permit, and uneven
//! where it must be, so any rank count up to the number of units works (qwen05's 14 heads
//! over 3 ranks: 5, 4, 5). When ranks outnumber KV heads, ranks share them: each holds every
//! KV head its query heads read.
//!
//! A mixture of experts' routed experts are cut one of two ways ([`ExpertSplit`]): whole
//! experts per rank (expert parallelism: fewer, larger products, but a token's experts may
//! fall unevenly on the ranks), or a slice of every expert's features per rank (tensor
//! parallelism: perfectly even, but only in whole quantization blocks, so a 768-wide expert
//! of 256-blocks cuts 512 + 256 over two ranks). Shared experts are cut by features like a
//! dense feed-forward. [`ExpertSplit::Auto`] takes the one that reads fewer bytes on the
//! busiest rank per token (`shoal_planner::split::expert_split_cost`, which the planner's
//! cost model uses too).

use std::ops::Range;

use shoal_planner::split::cut;
pub use shoal_planner::split::ExpertSplit;

use crate::arch::{ArchSpec, Role};
use crate::config::ModelConfig;
use crate::weights::WeightSource;
use crate::EngineError;

/// The part of one layer a rank holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerShard {
    /// Query heads of this rank.
    pub heads: Range<usize>,
    /// KV heads of this rank (those its query heads read; replicated across ranks when
    /// ranks outnumber KV heads).
    pub kv_heads: Range<usize>,
    /// Feed-forward features of this rank (block aligned).
    pub ffn: Range<usize>,
    /// Routed experts of this rank (mixture-of-experts layers; empty otherwise).
    pub experts: Range<usize>,
    /// Features of each of those experts (all of them for whole experts; block aligned).
    pub expert_ffn: Range<usize>,
    /// Features of the shared experts (block aligned; empty without them).
    pub shared_ffn: Range<usize>,
}

impl LayerShard {
    /// The whole layer (world size 1).
    pub fn full(cfg: &ModelConfig) -> Self {
        let (experts, expert_ffn, shared) = match &cfg.moe {
            Some(m) => (m.n_expert, m.expert_ffn, m.n_shared * m.expert_ffn),
            None => (0, 0, 0),
        };
        LayerShard {
            heads: 0..cfg.n_head,
            kv_heads: 0..cfg.n_kv_head,
            ffn: 0..cfg.ffn,
            experts: 0..experts,
            expert_ffn: 0..expert_ffn,
            shared_ffn: 0..shared,
        }
    }
}

/// Everything one rank holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardPlan {
    /// Layers of this rank's pipeline stage.
    pub layers: Range<usize>,
    /// The part of each of those layers.
    pub shard: LayerShard,
    /// Vocabulary rows of the embedding (first stage) and output head (last stage).
    pub vocab: Range<usize>,
    /// Whether this rank's stage is the first (it embeds the tokens).
    pub first_stage: bool,
    /// Whether this rank's stage is the last (it holds the final norm and the head).
    pub last_stage: bool,
}

impl ShardPlan {
    /// The whole model on one rank.
    pub fn full(cfg: &ModelConfig) -> Self {
        ShardPlan {
            layers: 0..cfg.n_layer,
            shard: LayerShard::full(cfg),
            vocab: 0..cfg.vocab,
            first_stage: true,
            last_stage: true,
        }
    }

    /// Whether this rank holds everything.
    pub fn is_full(&self, cfg: &ModelConfig) -> bool {
        *self == Self::full(cfg)
    }

    /// None of the model's layers, but its embedding, final norm and whole output head: a
    /// share that holds the multi-token-prediction layer (with `cfg.load_mtp`) beside a
    /// split that runs the layers, for the lead to draft with.
    pub fn prediction_only(cfg: &ModelConfig) -> Self {
        ShardPlan {
            layers: cfg.n_layer..cfg.n_layer,
            ..Self::full(cfg)
        }
    }

    /// Whether this rank holds the embedding, the final norm and the whole output head,
    /// and its layers whole: where a multi-token-prediction layer can run.
    pub fn holds_prediction(&self, cfg: &ModelConfig) -> bool {
        self.first_stage
            && self.last_stage
            && self.vocab == (0..cfg.vocab)
            && self.shard == LayerShard::full(cfg)
    }
}

/// `tp` ranks per stage times `pp` stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Tensor-parallel ranks per stage.
    pub tp: usize,
    /// Pipeline stages.
    pub pp: usize,
}

impl Layout {
    /// Total ranks.
    pub fn world(&self) -> usize {
        self.tp * self.pp
    }

    /// Pipeline stage of `rank`.
    pub fn stage(&self, rank: usize) -> usize {
        rank / self.tp
    }

    /// Tensor-parallel index of `rank` inside its stage.
    pub fn tp_index(&self, rank: usize) -> usize {
        rank % self.tp
    }

    /// The ranks of `stage`, in tensor-parallel order.
    pub fn stage_ranks(&self, stage: usize) -> Range<usize> {
        stage * self.tp..(stage + 1) * self.tp
    }
}

fn lcm(a: usize, b: usize) -> usize {
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    a / gcd(a, b) * b
}

/// The largest block length of the layer tensors of `role` over `layers`.
fn column_block(
    src: &dyn WeightSource,
    spec: &ArchSpec,
    layers: Range<usize>,
    role: Role,
) -> Result<usize, EngineError> {
    let mut b = 1;
    for l in layers {
        if let Some(name) = spec.layer_name(role, l).filter(|n| src.contains(n)) {
            b = lcm(b, src.block_len(&name)?);
        }
    }
    Ok(b)
}

/// Bytes of the tensors of each layer that a decode step reads (as stored; routed experts
/// at the share a token uses), and of the output head (the embedding when tied), by the
/// architecture's table.
///
/// # Errors
/// When a required tensor is missing.
pub fn stored_bytes(
    cfg: &ModelConfig,
    src: &dyn WeightSource,
) -> Result<(Vec<u64>, u64), EngineError> {
    let spec = crate::arch::spec(cfg.arch);
    let mut layers = vec![0u64; cfg.n_layer];
    for (l, bytes) in layers.iter_mut().enumerate() {
        for (t, name) in spec.layer_names(l) {
            if src.contains(&name) {
                *bytes += crate::model::read_per_token(cfg, t.role, src.stored_bytes(&name)?);
            }
        }
    }
    let head = [Role::Output, Role::TokenEmbd]
        .iter()
        .filter_map(|&r| spec.model_tensor(r))
        .find(|t| src.contains(t.gguf))
        .ok_or_else(|| EngineError::MissingTensor {
            file: src.describe(),
            name: "token_embd.weight".into(),
        })?;
    Ok((layers, src.stored_bytes(head.gguf)?))
}

/// The byte ranges of a GGUF model (offsets in its files laid end to end: one file, or a
/// split set's parts in order) that a rank holding `plan` reads: every file's header, every
/// tensor outside the blocks, every tensor of its stage's
/// blocks, except that of a tensor holding every routed expert only its experts' parts are
/// read (their rows of each expert's gate and up projections and their values of those
/// projections' biases, each expert's down projection and its bias whole). What a node that lacks the file fetches for the rank.
pub fn file_ranges(
    cfg: &ModelConfig,
    file: &shoal_model::gguf::GgufFile,
    plan: &ShardPlan,
) -> Vec<Range<u64>> {
    let spec = crate::arch::spec(cfg.arch);
    let mut out: Vec<Range<u64>> = file.header_ranges();
    let n_expert = cfg.moe.as_ref().map_or(0, |m| m.n_expert) as u64;
    let ffn = plan.shard.expert_ffn.clone();
    for t in file.tensors() {
        let Ok(whole) = file.tensor_range(&t.name) else {
            continue;
        };
        let start = whole.start;
        // a block the rank does not hold, or one the model does not run (GLM's
        // multi-token-prediction layers after the last)
        if crate::arch::layer_of(&t.name).is_some_and(|l| !plan.layers.contains(&l)) {
            continue;
        }
        let Some((entry, _)) = spec.entry(&t.name) else {
            out.push(whole);
            continue;
        };
        if !entry.role.is_routed_expert() || n_expert == 0 || !t.size.is_multiple_of(n_expert) {
            out.push(whole);
            continue;
        }
        let per_expert = t.size / n_expert;
        let rows = t.n_rows() / n_expert;
        let row_bytes = t.row_bytes();
        for e in plan.shard.experts.clone() {
            let at = start + e as u64 * per_expert;
            if let Role::FfnGateExpsBias | Role::FfnUpExpsBias = entry.role {
                // one value per feature: the rank's features of the expert's row
                let features = cfg.moe.as_ref().map_or(1, |m| m.expert_ffn as u64);
                let value = per_expert / features.max(1);
                out.push(at + ffn.start as u64 * value..at + ffn.end as u64 * value);
                continue;
            }
            // an expert's rows: its gate (or up) features, or both halves when fused
            let halves: &[u64] = match entry.role {
                Role::FfnGateUpExps => &[0, 1],
                Role::FfnDownExps | Role::FfnDownExpsBias => &[],
                _ => &[0],
            };
            if halves.is_empty() {
                out.push(at..at + per_expert);
            }
            let half_rows = rows / halves.len().max(1) as u64;
            for &h in halves {
                let first = at + (h * half_rows + ffn.start as u64) * row_bytes;
                out.push(first..first + ffn.len() as u64 * row_bytes);
            }
        }
    }
    out.sort_by_key(|r| r.start);
    out
}

/// The byte ranges of `file` that the share holding only the model's first
/// multi-token-prediction layer reads ([`ShardPlan::prediction_only`] with the layer
/// loaded): every file's header, every tensor outside the blocks, and the layer's block
/// (`blk.{n_layer}`). What the lead of a split that drafts with the layer fetches beside its
/// rank's ranges, where it lacks the file.
pub fn prediction_ranges(cfg: &ModelConfig, file: &shoal_model::gguf::GgufFile) -> Vec<Range<u64>> {
    let plan = ShardPlan {
        layers: cfg.n_layer..cfg.n_layer + cfg.mtp_layers.min(1),
        ..ShardPlan::full(cfg)
    };
    file_ranges(cfg, file, &plan)
}

/// Contiguous layer ranges of `sizes` (one per stage), or as even as possible when `None`
/// (earlier stages take the extra layer). [`plan`] balances by bytes instead.
///
/// # Errors
/// When the sizes do not add up to the layer count or a stage would be empty.
pub fn stage_layers(
    n_layer: usize,
    pp: usize,
    sizes: Option<&[usize]>,
) -> Result<Vec<Range<usize>>, EngineError> {
    let bad = |what: String| EngineError::InvalidInput { what };
    if pp == 0 || pp > n_layer {
        return Err(bad(format!(
            "{pp} pipeline stages for a model of {n_layer} layers (use 1 to {n_layer})"
        )));
    }
    let sizes: Vec<usize> = match sizes {
        Some(s) => {
            if s.len() != pp || s.iter().sum::<usize>() != n_layer || s.contains(&0) {
                return Err(bad(format!(
                    "stage sizes {s:?} must be {pp} positive layer counts adding up to {n_layer}"
                )));
            }
            s.to_vec()
        }
        None => (0..pp)
            .map(|i| n_layer / pp + usize::from(i < n_layer % pp))
            .collect(),
    };
    let mut start = 0;
    Ok(sizes
        .iter()
        .map(|&n| {
            start += n;
            start - n..start
        })
        .collect())
}

/// Layer counts per stage that balance what each stage reads per decoded token: `layer[l]`
/// bytes for layer `l`, and `head` bytes more for the last stage (the output head is read
/// whole every token; the embedding only a row per token). Minimises the largest stage.
pub fn balanced_stage_sizes(layer: &[u64], head: u64, pp: usize) -> Vec<usize> {
    let n = layer.len();
    if pp == 0 || pp > n {
        return Vec::new();
    }
    let prefix: Vec<u64> = std::iter::once(0)
        .chain(layer.iter().scan(0u64, |a, &b| {
            *a += b;
            Some(*a)
        }))
        .collect();
    let cost = |a: usize, b: usize, last: bool| prefix[b] - prefix[a] + if last { head } else { 0 };
    // best[s][i]: the smallest largest stage of layers 0..i in s + 1 stages; from[s][i]: where
    // the last of those stages starts
    let mut best = vec![vec![u64::MAX; n + 1]; pp];
    let mut from = vec![vec![0usize; n + 1]; pp];
    for (i, b) in best[0].iter_mut().enumerate().skip(1) {
        *b = cost(0, i, pp == 1);
    }
    for s in 1..pp {
        let last = s + 1 == pp;
        for i in s + 1..=n {
            for j in s..i {
                let c = best[s - 1][j].max(cost(j, i, last));
                if c < best[s][i] {
                    best[s][i] = c;
                    from[s][i] = j;
                }
            }
        }
    }
    let mut sizes = vec![0; pp];
    let mut end = n;
    for s in (0..pp).rev() {
        let start = if s == 0 { 0 } else { from[s][end] };
        sizes[s] = end - start;
        end = start;
    }
    sizes
}

/// What every rank of `layout` holds, in rank order; `stage_sizes` gives each stage's layer
/// count (when `None`, [`balanced_stage_sizes`] by the bytes each stage reads per token);
/// `experts` says how a mixture of experts' routed experts are cut.
///
/// # Errors
/// When the model cannot be cut that finely (more ranks than heads, feature blocks, experts
/// or layers), naming the limit.
pub fn plan(
    cfg: &ModelConfig,
    src: &dyn WeightSource,
    layout: Layout,
    stage_sizes: Option<&[usize]>,
    experts: ExpertSplit,
) -> Result<Vec<ShardPlan>, EngineError> {
    let Layout { tp, pp } = layout;
    if tp == 0 {
        return Err(EngineError::InvalidInput {
            what: "0 tensor-parallel ranks".into(),
        });
    }
    let balanced;
    let stage_sizes = match stage_sizes {
        Some(s) => Some(s),
        None if pp > 1 && pp <= cfg.n_layer => {
            let (layer, head) = stored_bytes(cfg, src)?;
            balanced = balanced_stage_sizes(&layer, head, pp);
            Some(&balanced[..])
        }
        None => None,
    };
    let stages = stage_layers(cfg.n_layer, pp, stage_sizes)?;
    let mut plans = Vec::with_capacity(tp * pp);
    for (s, layers) in stages.iter().enumerate() {
        let spec = crate::arch::spec(cfg.arch);
        let o_block = column_block(src, spec, layers.clone(), Role::AttnOut)?;
        let down_block = column_block(src, spec, layers.clone(), Role::FfnDown)?;
        let hd = cfg.head_out_dim();
        let group = cfg.n_head / cfg.n_kv_head.max(1);
        // Heads go in units whose columns of the output projection are whole blocks; whole
        // KV groups when there are enough of them, so no KV head is held twice.
        let head_unit = lcm(hd, o_block) / hd;
        let group_unit = lcm(group, head_unit);
        let heads = if cfg.n_head / group_unit >= tp && cfg.n_head.is_multiple_of(group_unit) {
            cut(cfg.n_head, group_unit, tp)
        } else {
            cut(cfg.n_head, head_unit, tp)
        }
        .ok_or_else(|| EngineError::InvalidInput {
            what: format!(
                "{tp} tensor-parallel ranks for {} attention heads cut in units of {head_unit} \
                 (the output projection's {o_block}-column blocks); use at most {} ranks",
                cfg.n_head,
                cfg.n_head / head_unit
            ),
        })?;
        let dense = layers.clone().any(|l| !cfg.is_moe_layer(l));
        let ffn = if dense || tp == 1 {
            cut(cfg.ffn, down_block, tp).ok_or_else(|| EngineError::InvalidInput {
                what: format!(
                    "{tp} tensor-parallel ranks for {} feed-forward features in blocks of \
                     {down_block}; use at most {} ranks",
                    cfg.ffn,
                    cfg.ffn.div_ceil(down_block)
                ),
            })?
        } else {
            vec![0..cfg.ffn; tp]
        };
        let moe = expert_cuts(cfg, src, layers.clone(), tp, experts)?;
        let vocab = cut(cfg.vocab, 16, tp).ok_or_else(|| EngineError::InvalidInput {
            what: format!("{tp} ranks for a vocabulary of {}", cfg.vocab),
        })?;
        for i in 0..tp {
            let h = heads[i].clone();
            plans.push(ShardPlan {
                layers: layers.clone(),
                shard: LayerShard {
                    kv_heads: h.start / group..h.end.div_ceil(group),
                    heads: h,
                    ffn: ffn[i].clone(),
                    experts: moe.experts[i].clone(),
                    expert_ffn: moe.expert_ffn[i].clone(),
                    shared_ffn: moe.shared_ffn[i].clone(),
                },
                vocab: vocab[i].clone(),
                first_stage: s == 0,
                last_stage: s + 1 == pp,
            });
        }
    }
    Ok(plans)
}

/// Each rank's routed experts, their features and the shared experts' features.
struct ExpertCuts {
    experts: Vec<Range<usize>>,
    expert_ffn: Vec<Range<usize>>,
    shared_ffn: Vec<Range<usize>>,
}

/// How `tp` ranks cut the experts of `layers` (empty ranges for a dense model).
fn expert_cuts(
    cfg: &ModelConfig,
    src: &dyn WeightSource,
    layers: Range<usize>,
    tp: usize,
    split: ExpertSplit,
) -> Result<ExpertCuts, EngineError> {
    let Some(m) = cfg.moe.as_ref() else {
        return Ok(ExpertCuts {
            experts: vec![0..0; tp],
            expert_ffn: vec![0..0; tp],
            shared_ffn: vec![0..0; tp],
        });
    };
    let spec = crate::arch::spec(cfg.arch);
    let block = column_block(src, spec, layers.clone(), Role::FfnDownExps)?;
    let shared = m.n_shared * m.expert_ffn;
    let shared_ffn = if shared == 0 {
        vec![0..0; tp]
    } else {
        let b = column_block(src, spec, layers, Role::FfnDownShexp)?;
        cut(shared, b, tp).ok_or_else(|| EngineError::InvalidInput {
            what: format!(
                "{tp} tensor-parallel ranks for {shared} shared-expert features in blocks of \
                 {b}; use at most {} ranks",
                shared.div_ceil(b)
            ),
        })?
    };
    let resolved = split.resolve(m.n_expert, m.n_expert_used, m.expert_ffn, block, tp);
    let whole_experts = match (resolved, split) {
        (Some(s), _) => s == ExpertSplit::Whole,
        (None, asked) => asked != ExpertSplit::Sliced,
    };
    let (experts, expert_ffn) = if whole_experts {
        let e = cut(m.n_expert, 1, tp).ok_or_else(|| EngineError::InvalidInput {
            what: format!(
                "{tp} tensor-parallel ranks holding whole experts of {}; use at most {} ranks, \
                 or slice the experts",
                m.n_expert, m.n_expert
            ),
        })?;
        (e, vec![0..m.expert_ffn; tp])
    } else {
        let f = cut(m.expert_ffn, block, tp).ok_or_else(|| EngineError::InvalidInput {
            what: format!(
                "{tp} tensor-parallel ranks slicing experts of {} features in blocks of \
                 {block}; use at most {} ranks, or split whole experts",
                m.expert_ffn,
                m.expert_ffn.div_ceil(block)
            ),
        })?;
        (vec![0..m.n_expert; tp], f)
    };
    Ok(ExpertCuts {
        experts,
        expert_ffn,
        shared_ffn,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_are_even_in_units_and_cover_everything() {
        assert_eq!(cut(14, 1, 3).unwrap(), vec![0..5, 5..9, 9..14]);
        assert_eq!(
            cut(4864, 256, 3).unwrap(),
            vec![0..1536, 1536..3328, 3328..4864]
        );
        assert_eq!(cut(100, 32, 3).unwrap(), vec![0..32, 32..64, 64..100]);
        assert_eq!(cut(10, 1, 1).unwrap(), vec![0..10]);
        assert!(cut(2, 1, 3).is_none());
        for len in 1..60 {
            for unit in [1, 3, 8] {
                for parts in 1..6 {
                    if let Some(r) = cut(len, unit, parts) {
                        assert_eq!(r[0].start, 0);
                        assert_eq!(r[parts - 1].end, len);
                        for w in r.windows(2) {
                            assert_eq!(w[0].end, w[1].start);
                            assert_eq!(w[0].end % unit, 0);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn balanced_stages_carry_the_head() {
        assert_eq!(balanced_stage_sizes(&[10; 24], 0, 2), vec![12, 12]);
        // a head as big as 14 layers: the last stage takes fewer layers
        assert_eq!(balanced_stage_sizes(&[10; 24], 140, 2), vec![19, 5]);
        assert_eq!(balanced_stage_sizes(&[10; 4], 0, 4), vec![1, 1, 1, 1]);
        assert_eq!(balanced_stage_sizes(&[10; 4], 1000, 3)[2], 1);
        assert_eq!(balanced_stage_sizes(&[10; 4], 0, 1), vec![4]);
        for pp in 1..6 {
            let s = balanced_stage_sizes(&[3, 9, 1, 4, 4, 7, 2], 5, pp);
            assert_eq!(s.len(), pp);
            assert_eq!(s.iter().sum::<usize>(), 7);
            assert!(s.iter().all(|&n| n > 0));
        }
    }

    #[test]
    fn stages_split_layers() {
        assert_eq!(
            stage_layers(24, 3, None).unwrap(),
            vec![0..8, 8..16, 16..24]
        );
        assert_eq!(stage_layers(5, 2, None).unwrap(), vec![0..3, 3..5]);
        assert_eq!(stage_layers(5, 2, Some(&[1, 4])).unwrap(), vec![0..1, 1..5]);
        assert!(stage_layers(5, 2, Some(&[2, 2])).is_err());
        assert!(stage_layers(2, 3, None).is_err());
    }
}
