//! The planner's outputs: a [`Placement`] (which nodes run which layers, in the executor's
//! `tp` x `pp` shape), its [`Prediction`] (decode and prefill tokens/s, memory per node), and
//! a [`Candidate`] pairing the two with the reason it cannot run, if any.
//!
//! The shape is the executor's: `tp` ranks per stage times `pp` stages, rank `r` is
//! tensor-parallel index `r % tp` of stage `r / tp`, each stage a contiguous layer range.

use std::fmt;
use std::ops::Range;

use serde::{Deserialize, Serialize};

/// The kind of a placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SplitKind {
    /// The whole model on one node.
    Single,
    /// One stage, several tensor-parallel nodes.
    Tensor,
    /// Several stages of one node each.
    Pipeline,
    /// Several stages of several tensor-parallel nodes each.
    Hybrid,
}

impl SplitKind {
    /// The kind of a `tp` x `pp` split.
    pub fn of(tp: usize, pp: usize) -> Self {
        match (tp > 1, pp > 1) {
            (false, false) => SplitKind::Single,
            (true, false) => SplitKind::Tensor,
            (false, true) => SplitKind::Pipeline,
            (true, true) => SplitKind::Hybrid,
        }
    }
}

impl fmt::Display for SplitKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SplitKind::Single => "single",
            SplitKind::Tensor => "tensor",
            SplitKind::Pipeline => "pipeline",
            SplitKind::Hybrid => "hybrid",
        })
    }
}

/// One pipeline stage.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StagePlacement {
    /// The stage's layers (serialized as `{start, end}`).
    pub layers: Range<usize>,
    /// The stage's nodes by id; index = tensor-parallel index.
    pub nodes: Vec<String>,
}

/// Where a model runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// Its kind (follows from `tp` and the stage count).
    pub strategy: SplitKind,
    /// Tensor-parallel ranks per stage.
    pub tp: usize,
    /// The stages in pipeline order.
    pub stages: Vec<StagePlacement>,
    /// How a mixture of experts' routed experts are cut across a stage's ranks (`auto` for a
    /// dense model or one rank per stage).
    #[serde(default)]
    pub experts: crate::split::ExpertSplit,
}

impl Placement {
    /// Pipeline stages.
    pub fn pp(&self) -> usize {
        self.stages.len()
    }

    /// Ranks in all.
    pub fn world(&self) -> usize {
        self.tp * self.pp()
    }

    /// The node of every rank, in rank order.
    pub fn rank_nodes(&self) -> Vec<&str> {
        self.stages
            .iter()
            .flat_map(|s| s.nodes.iter().map(String::as_str))
            .collect()
    }

    /// Layers per stage, in stage order (what the executor's `stage_sizes` takes).
    pub fn stage_sizes(&self) -> Vec<usize> {
        self.stages.iter().map(|s| s.layers.len()).collect()
    }

    /// One line: `a[0..12] -> b+c[12..24]`.
    pub fn describe(&self) -> String {
        self.stages
            .iter()
            .map(|s| {
                format!(
                    "{}[{}..{}]",
                    s.nodes.join("+"),
                    s.layers.start,
                    s.layers.end
                )
            })
            .collect::<Vec<_>>()
            .join(" -> ")
    }
}

/// Memory one node would use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeMemory {
    /// The node's id.
    pub node: String,
    /// Weight bytes of its slice.
    pub weight_bytes: u64,
    /// KV cache bytes at the requested context for its layers and KV heads.
    pub kv_bytes: u64,
    /// Runtime overhead (activations, buffers): [`crate::cost::RUNTIME_OVERHEAD_BYTES`].
    pub overhead_bytes: u64,
    /// All of the above that lives in the host's memory.
    pub total_bytes: u64,
    /// What the node has free for it.
    pub free_bytes: u64,
    /// The part of the weights and KV cache in its GPU's own memory (0 without one, or
    /// where the GPU shares the host's memory).
    #[serde(default)]
    pub gpu_bytes: u64,
    /// The GPU's memory, where it has its own.
    #[serde(default)]
    pub gpu_memory_bytes: Option<u64>,
}

impl NodeMemory {
    /// Whether the slice fits, in the host's memory and the GPU's.
    pub fn fits(&self) -> bool {
        self.total_bytes <= self.free_bytes
            && self
                .gpu_memory_bytes
                .is_none_or(|m| self.gpu_bytes + crate::gpu::FIT_SPARE_BYTES <= m)
    }
}

/// What a placement is predicted to do.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// Tokens/s decoding one sequence (0 when a link it needs is missing).
    pub decode_tok_s: f64,
    /// Aggregate decode tokens/s with one sequence per stage in flight (the slowest stage
    /// bounds it); equals `decode_tok_s` for one stage.
    pub pipelined_decode_tok_s: f64,
    /// Tokens/s of a prefill of `prompt_tokens`.
    pub prefill_tok_s: f64,
    /// The prompt length of `prefill_tok_s`.
    pub prompt_tokens: u32,
    /// Per decoded token: time the slowest rank of each stage spends reading memory, summed
    /// over stages, ms.
    pub decode_compute_ms: f64,
    /// Per decoded token: time in messages (header, all-reduces, stage hops, the token's
    /// return), ms.
    pub decode_comm_ms: f64,
    /// Whether every rank's decode and prefill times came from its node's measured costs of
    /// the model's shape ([`crate::calibration`]) rather than from bytes over bandwidth and
    /// FLOPs over compute.
    #[serde(default)]
    pub calibrated: bool,
    /// Memory per node, in rank order.
    pub memory: Vec<NodeMemory>,
}

impl Prediction {
    /// The node using the largest fraction of its free memory.
    pub fn tightest(&self) -> Option<&NodeMemory> {
        self.memory.iter().max_by(|a, b| {
            let f = |m: &NodeMemory| {
                let gpu = m.gpu_memory_bytes.map_or(0.0, |g| {
                    (m.gpu_bytes + crate::gpu::FIT_SPARE_BYTES) as f64 / g.max(1) as f64
                });
                (m.total_bytes as f64 / m.free_bytes.max(1) as f64).max(gpu)
            };
            f(a).total_cmp(&f(b))
        })
    }

    /// Bytes by which the nodes that overflow exceed their free memory, summed.
    pub fn shortfall_bytes(&self) -> u64 {
        self.memory
            .iter()
            .map(|m| {
                let gpu = m.gpu_memory_bytes.map_or(0, |g| {
                    (m.gpu_bytes + crate::gpu::FIT_SPARE_BYTES).saturating_sub(g)
                });
                m.total_bytes.saturating_sub(m.free_bytes) + gpu
            })
            .sum()
    }
}

/// One placement, its prediction, and whether it can run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    /// The placement.
    pub placement: Placement,
    /// What it would do.
    pub prediction: Prediction,
    /// Why it cannot run (`None` when it fits): a node out of memory, a missing link, a
    /// split finer than the model allows.
    pub problem: Option<String>,
}

impl Candidate {
    /// Whether it can run.
    pub fn fits(&self) -> bool {
        self.problem.is_none()
    }
}
