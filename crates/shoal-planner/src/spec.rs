//! The planner's inputs: the nodes and links of a cluster (measured live, or described in a
//! file to ask "what if"), the profile of a model (its shape and the stored bytes of each
//! part, as quantized in its file), and the request (context length, strategy hint, node
//! subset, prompt length for the prefill prediction). All of them are plain data with serde,
//! so they can come from TOML, JSON or the live cluster; [`Cluster::validate`],
//! [`ModelProfile::validate`] and [`PlanRequest::validate`] reject what the cost model
//! cannot use, naming the field.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::PlanError;

/// One machine as the planner sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeSpec {
    /// Unique id (what placements name).
    pub id: String,
    /// Human name (shown in tables; may equal the id).
    pub name: String,
    /// Physical memory, bytes.
    pub memory_total_bytes: u64,
    /// Memory a model may use on this node, bytes: a placement fits when every node's
    /// predicted use is at most this.
    pub memory_free_bytes: u64,
    /// Compute backend, e.g. `cpu`, `gpu:0`.
    pub backend: String,
    /// Measured memory read bandwidth of its CPU, GB/s (1e9 bytes per second).
    pub mem_bandwidth_gbs: f64,
    /// Measured matrix-multiply throughput of the batched (prefill) kernels, GFLOP/s.
    pub compute_gflops: f64,
    /// Compute threads.
    pub threads: u32,
    /// The GPU it computes on, if any: its first layers of a share go there
    /// ([`crate::gpu`]).
    #[serde(default)]
    pub gpu: Option<crate::gpu::GpuSpec>,
    /// Its measured decode costs, one per model shape it measured ([`crate::calibration`]):
    /// the cost model predicts its ranks of a model of one of these shapes from them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub calibrations: Vec<crate::Calibration>,
}

/// A measured (or described) link between two nodes. Links are symmetric; a pair without a
/// link is unreachable, and placements that need it are infeasible.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LinkSpec {
    /// One end (a node id).
    pub a: String,
    /// The other end (a node id).
    pub b: String,
    /// Round-trip time of a small message, microseconds.
    pub rtt_us: f64,
    /// Bandwidth, gigabits per second.
    pub bandwidth_gbps: f64,
    /// Whether the link runs over RDMA (informational: `rtt_us` already says how fast it is).
    pub rdma: bool,
    /// Measured round trips of messages of the sizes a split sends (its hidden states), by
    /// ascending size: where given, a message's cost comes from these instead of `rtt_us`
    /// and `bandwidth_gbps` alone ([`crate::cost::message_secs`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sized: Vec<SizedRoundTrip>,
}

/// The measured round trip of one message of a size (its answer is small).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SizedRoundTrip {
    /// Bytes the message carried.
    pub bytes: u64,
    /// Median round trip, microseconds.
    pub rtt_us: f64,
}

/// The nodes and links to plan over.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Cluster {
    /// The nodes.
    pub nodes: Vec<NodeSpec>,
    /// The links between them.
    #[serde(default)]
    pub links: Vec<LinkSpec>,
}

impl Cluster {
    /// Checks that node ids are unique, every figure is finite and positive where the cost
    /// model divides by it, and links join two different known nodes at most once.
    ///
    /// # Errors
    /// [`PlanError::NoNodes`], [`PlanError::DuplicateNode`], [`PlanError::BadNode`] or
    /// [`PlanError::BadLink`], naming the offender.
    pub fn validate(&self) -> Result<(), PlanError> {
        if self.nodes.is_empty() {
            return Err(PlanError::NoNodes);
        }
        let mut ids = HashSet::new();
        for n in &self.nodes {
            if n.id.is_empty() {
                return Err(PlanError::BadNode {
                    id: n.name.clone(),
                    problem: "empty id; give every node an id".into(),
                });
            }
            if !ids.insert(n.id.as_str()) {
                return Err(PlanError::DuplicateNode { id: n.id.clone() });
            }
            let bad = |problem: String| PlanError::BadNode {
                id: n.id.clone(),
                problem,
            };
            if !(n.mem_bandwidth_gbs.is_finite() && n.mem_bandwidth_gbs > 0.0) {
                return Err(bad(format!(
                    "memory bandwidth {} GB/s; give the measured read bandwidth (> 0)",
                    n.mem_bandwidth_gbs
                )));
            }
            if !(n.compute_gflops.is_finite() && n.compute_gflops > 0.0) {
                return Err(bad(format!(
                    "compute {} GFLOP/s; give the measured matmul throughput (> 0)",
                    n.compute_gflops
                )));
            }
            if let Some(g) = &n.gpu {
                if !(g.mem_bandwidth_gbs.is_finite() && g.mem_bandwidth_gbs > 0.0) {
                    return Err(bad(format!(
                        "GPU memory bandwidth {} GB/s; give the measured read bandwidth (> 0)",
                        g.mem_bandwidth_gbs
                    )));
                }
            }
            for c in &n.calibrations {
                c.validate().map_err(bad)?;
            }
            if n.memory_free_bytes > n.memory_total_bytes {
                return Err(bad(format!(
                    "{} bytes free of {} total; free memory cannot exceed the total",
                    n.memory_free_bytes, n.memory_total_bytes
                )));
            }
        }
        let mut pairs = HashSet::new();
        for l in &self.links {
            let bad = |problem: String| PlanError::BadLink {
                a: l.a.clone(),
                b: l.b.clone(),
                problem,
            };
            for end in [&l.a, &l.b] {
                if !ids.contains(end.as_str()) {
                    return Err(bad(format!(
                        "`{end}` is not a node; links join the ids of described nodes"
                    )));
                }
            }
            if l.a == l.b {
                return Err(bad("a link joins two different nodes".into()));
            }
            if !(l.rtt_us.is_finite() && l.rtt_us >= 0.0) {
                return Err(bad(format!("round trip {} us; give a time >= 0", l.rtt_us)));
            }
            if !(l.bandwidth_gbps.is_finite() && l.bandwidth_gbps > 0.0) {
                return Err(bad(format!(
                    "bandwidth {} Gbit/s; give a bandwidth > 0",
                    l.bandwidth_gbps
                )));
            }
            let mut last = 0;
            for m in &l.sized {
                if m.bytes <= last || !(m.rtt_us.is_finite() && m.rtt_us >= 0.0) {
                    return Err(bad(format!(
                        "sized round trip of {} bytes in {} us; give sizes > 0 in ascending \
                         order and times >= 0",
                        m.bytes, m.rtt_us
                    )));
                }
                last = m.bytes;
            }
            let key = if l.a < l.b {
                (l.a.as_str(), l.b.as_str())
            } else {
                (l.b.as_str(), l.a.as_str())
            };
            if !pairs.insert(key) {
                return Err(bad("described twice; give each pair one link".into()));
            }
        }
        Ok(())
    }

    /// The link between nodes `a` and `b` (either order), if any.
    pub fn link(&self, a: &str, b: &str) -> Option<&LinkSpec> {
        self.links
            .iter()
            .find(|l| (l.a == a && l.b == b) || (l.a == b && l.b == a))
    }

    /// Index of the node whose id or name is `key`.
    pub fn find(&self, key: &str) -> Option<usize> {
        self.nodes
            .iter()
            .position(|n| n.id == key)
            .or_else(|| self.nodes.iter().position(|n| n.name == key))
    }

    /// Links by node index pair (smaller index first).
    pub(crate) fn link_table(&self) -> HashMap<(usize, usize), &LinkSpec> {
        let index: HashMap<&str, usize> = self
            .nodes
            .iter()
            .enumerate()
            .map(|(i, n)| (n.id.as_str(), i))
            .collect();
        self.links
            .iter()
            .filter_map(|l| {
                let (a, b) = (*index.get(l.a.as_str())?, *index.get(l.b.as_str())?);
                Some(((a.min(b), a.max(b)), l))
            })
            .collect()
    }
}

/// Mixture-of-experts facts of a model. A stage's tensor-parallel ranks hold whole routed
/// experts (as evenly as the count allows) or a slice of every expert's features, whichever
/// reads fewer bytes on the busiest rank per token (see [`crate::split::ExpertSplit`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeSpec {
    /// Routed experts per MoE layer.
    pub n_experts: u32,
    /// Experts each token is routed to (shared experts are dense bytes, not counted here).
    pub active_experts: u32,
    /// Bytes of all routed experts of each layer (0 for a dense layer); part of that layer's
    /// `layer_bytes`. One entry per layer.
    pub expert_bytes_per_layer: Vec<u64>,
    /// Features of one routed expert (0 when unknown: experts are then only held whole).
    #[serde(default)]
    pub expert_ffn: usize,
    /// Quantization block of the experts' down projection: sliced experts go to ranks in
    /// whole blocks of features.
    #[serde(default)]
    pub expert_block: u32,
}

/// A model as the planner needs it: its shape and the stored bytes of each part.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelProfile {
    /// Name (shown in messages).
    pub name: String,
    /// Transformer blocks.
    pub n_layers: usize,
    /// Width of the residual stream (d_model).
    pub hidden: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (1 for a shared latent such as DeepSeek's MLA: replicated on every
    /// tensor-parallel rank).
    pub n_kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// Inner width of the dense feed-forward block.
    pub ffn: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Parameters in all, to turn bytes into FLOPs (`params / weight_bytes()` parameters per
    /// stored byte).
    pub params: u64,
    /// Stored bytes of each block's weights (norms, attention, feed-forward, experts), as
    /// quantized in the file. One entry per layer.
    pub layer_bytes: Vec<u64>,
    /// Stored bytes of the token embedding.
    pub embedding_bytes: u64,
    /// Stored bytes of the output head; equal to `embedding_bytes` when `tied_embeddings`.
    pub head_bytes: u64,
    /// Whether the output head is the token embedding (then a one-stage placement holds it
    /// once, and a pipeline holds it on the first stage and again on the last).
    pub tied_embeddings: bool,
    /// KV cache bytes per token per layer, for all KV heads (shoal's f16 cache:
    /// `2 * n_kv_heads * head_dim * 2`).
    pub kv_bytes_per_token_per_layer: u64,
    /// Quantization block of the feed-forward down projection (32, or 256 for k-quants):
    /// feed-forward features go to tensor-parallel ranks in whole blocks.
    pub quant_block: u32,
    /// Quantization block of the attention output projection when it differs from
    /// `quant_block` (heads go to ranks so that their columns are whole blocks).
    #[serde(default)]
    pub attn_quant_block: Option<u32>,
    /// Mixture-of-experts facts, for MoE models.
    #[serde(default)]
    pub experts: Option<MoeSpec>,
}

/// One layer's bytes by how tensor parallelism cuts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerParts {
    /// Query and output projections (and the norms): cut by query heads.
    pub attn_q_o: u64,
    /// Key and value projections: cut by the KV heads a rank reads (replicated when ranks
    /// outnumber KV heads).
    pub attn_kv: u64,
    /// Dense feed-forward (and shared experts): cut by features in whole blocks.
    pub ffn: u64,
    /// Routed experts: whole experts per rank.
    pub experts: u64,
}

impl ModelProfile {
    /// Stored bytes of the whole model: every layer, the embedding, and the head unless tied.
    pub fn weight_bytes(&self) -> u64 {
        self.layer_bytes.iter().sum::<u64>()
            + self.embedding_bytes
            + if self.tied_embeddings {
                0
            } else {
                self.head_bytes
            }
    }

    /// Weight bytes one node reads per decoded token holding the whole model: every dense
    /// byte, the routed experts' share `active / n_experts`, and the output head.
    pub fn bytes_per_token(&self) -> f64 {
        let experts: u64 = self.experts_of_all();
        let active = self.active_fraction();
        (self.layer_bytes.iter().sum::<u64>() - experts) as f64
            + experts as f64 * active
            + self.head_bytes as f64
    }

    /// Fraction of the routed experts' bytes a token reads (1 for a dense model).
    pub fn active_fraction(&self) -> f64 {
        match &self.experts {
            Some(m) if m.n_experts > 0 => {
                f64::from(m.active_experts.min(m.n_experts)) / f64::from(m.n_experts)
            }
            _ => 1.0,
        }
    }

    /// Parameters per stored byte (the model's average).
    pub fn params_per_byte(&self) -> f64 {
        self.params as f64 / self.weight_bytes().max(1) as f64
    }

    fn experts_of_all(&self) -> u64 {
        self.experts
            .as_ref()
            .map_or(0, |m| m.expert_bytes_per_layer.iter().sum())
    }

    /// Whether layer `l` has routed experts.
    pub fn is_moe_layer(&self, l: usize) -> bool {
        self.experts
            .as_ref()
            .and_then(|m| m.expert_bytes_per_layer.get(l))
            .is_some_and(|&b| b > 0)
    }

    /// What tells this model's shape and quantization apart for a node's measured costs
    /// ([`crate::Calibration`]): its dimensions, its experts and its stored bytes. Two files
    /// of the same model at the same quantization share it; a different quantization does
    /// not.
    pub fn shape_key(&self) -> String {
        let experts = self.experts.as_ref().map_or(String::new(), |m| {
            format!("-e{}a{}", m.n_experts, m.active_experts)
        });
        format!(
            "l{}-h{}-q{}kv{}x{}-f{}-v{}{experts}-{}B",
            self.n_layers,
            self.hidden,
            self.n_heads,
            self.n_kv_heads,
            self.head_dim,
            self.ffn,
            self.vocab,
            self.weight_bytes()
        )
    }

    /// Routed experts per layer (0 for a dense model).
    pub fn n_experts(&self) -> usize {
        self.experts.as_ref().map_or(0, |m| m.n_experts as usize)
    }

    /// Layer `l`'s bytes by how tensor parallelism cuts them. The dense bytes are divided
    /// among attention q/o, attention k/v and feed-forward in proportion to their parameter
    /// counts from the shape (`2 hidden n_heads head_dim`, `2 hidden n_kv_heads head_dim`,
    /// `3 hidden ffn`); the parts add up to `layer_bytes[l]` exactly.
    pub fn layer_parts(&self, l: usize) -> LayerParts {
        let total = self.layer_bytes.get(l).copied().unwrap_or(0);
        let experts = self
            .experts
            .as_ref()
            .and_then(|m| m.expert_bytes_per_layer.get(l).copied())
            .unwrap_or(0)
            .min(total);
        let dense = u128::from(total - experts);
        let (h, hd) = (self.hidden as u128, self.head_dim as u128);
        let w_qo = 2 * h * self.n_heads as u128 * hd;
        let w_kv = 2 * h * self.n_kv_heads as u128 * hd;
        let w_ffn = 3 * h * self.ffn as u128;
        let w = (w_qo + w_kv + w_ffn).max(1);
        let attn_q_o = (dense * w_qo / w) as u64;
        let attn_kv = (dense * w_kv / w) as u64;
        LayerParts {
            attn_q_o,
            attn_kv,
            ffn: (total - experts) - attn_q_o - attn_kv,
            experts,
        }
    }

    /// Checks the relations the cost model relies on.
    ///
    /// # Errors
    /// [`PlanError::BadModel`] naming the inconsistent fields.
    pub fn validate(&self) -> Result<(), PlanError> {
        let bad = |problem: String| PlanError::BadModel {
            model: self.name.clone(),
            problem,
        };
        for (field, v) in [
            ("n_layers", self.n_layers),
            ("hidden", self.hidden),
            ("n_heads", self.n_heads),
            ("n_kv_heads", self.n_kv_heads),
            ("head_dim", self.head_dim),
            ("ffn", self.ffn),
            ("vocab", self.vocab),
            ("quant_block", self.quant_block as usize),
        ] {
            if v == 0 {
                return Err(bad(format!("{field} is 0")));
            }
        }
        if self.attn_quant_block == Some(0) {
            return Err(bad("attn_quant_block is 0".into()));
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(bad(format!(
                "{} query heads are not a multiple of {} KV heads",
                self.n_heads, self.n_kv_heads
            )));
        }
        if self.layer_bytes.len() != self.n_layers {
            return Err(bad(format!(
                "{} layer byte counts for {} layers; give one per layer",
                self.layer_bytes.len(),
                self.n_layers
            )));
        }
        if self.tied_embeddings && self.head_bytes != self.embedding_bytes {
            return Err(bad(format!(
                "tied embeddings but head_bytes {} != embedding_bytes {}; a tied head is the \
                 embedding",
                self.head_bytes, self.embedding_bytes
            )));
        }
        if self.params == 0 {
            return Err(bad("params is 0; give the parameter count".into()));
        }
        let total = self
            .layer_bytes
            .iter()
            .try_fold(self.embedding_bytes, |a, &b| a.checked_add(b))
            .and_then(|s| s.checked_add(self.head_bytes));
        if total.is_none() {
            return Err(bad("byte counts overflow 64 bits".into()));
        }
        if let Some(m) = &self.experts {
            if m.n_experts == 0 || m.active_experts == 0 || m.active_experts > m.n_experts {
                return Err(bad(format!(
                    "{} active of {} experts; need 1 <= active <= experts",
                    m.active_experts, m.n_experts
                )));
            }
            if m.expert_bytes_per_layer.len() != self.n_layers {
                return Err(bad(format!(
                    "{} expert byte counts for {} layers; give one per layer (0 for dense ones)",
                    m.expert_bytes_per_layer.len(),
                    self.n_layers
                )));
            }
            if let Some(l) =
                (0..self.n_layers).find(|&l| m.expert_bytes_per_layer[l] > self.layer_bytes[l])
            {
                return Err(bad(format!(
                    "layer {l}: experts take {} bytes of a layer of {}; expert bytes are part \
                     of the layer's bytes",
                    m.expert_bytes_per_layer[l], self.layer_bytes[l]
                )));
            }
        }
        Ok(())
    }
}

/// Which kinds of placement to consider.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    /// Every kind; the fastest wins.
    #[default]
    Auto,
    /// One pipeline stage (`pp = 1`), tensor parallel over its nodes (one node included).
    Tensor,
    /// One node per stage (`tp = 1`; one node included).
    Pipeline,
    /// Several stages of several tensor-parallel nodes each.
    Hybrid,
}

impl Strategy {
    /// Whether a split of `tp` x `pp` is of this kind.
    pub fn admits(self, tp: usize, pp: usize) -> bool {
        match self {
            Strategy::Auto => true,
            Strategy::Tensor => pp == 1,
            Strategy::Pipeline => tp == 1,
            Strategy::Hybrid => tp > 1 && pp > 1,
        }
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Strategy::Auto => "auto",
            Strategy::Tensor => "tensor",
            Strategy::Pipeline => "pipeline",
            Strategy::Hybrid => "hybrid",
        })
    }
}

impl FromStr for Strategy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(Strategy::Auto),
            "tensor" | "tp" => Ok(Strategy::Tensor),
            "pipeline" | "pp" => Ok(Strategy::Pipeline),
            "hybrid" => Ok(Strategy::Hybrid),
            other => Err(format!(
                "unknown strategy `{other}`; use auto, tensor, pipeline or hybrid"
            )),
        }
    }
}

/// What to plan for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanRequest {
    /// Context length the KV cache must hold, tokens.
    pub ctx: u32,
    /// Which kinds of placement to consider.
    #[serde(default)]
    pub strategy: Strategy,
    /// Only these nodes (ids or names); `None` for all.
    #[serde(default)]
    pub nodes: Option<Vec<String>>,
    /// Prompt length of the prefill prediction, tokens.
    pub prompt_tokens: u32,
    /// How a mixture of experts' routed experts are cut across a stage's ranks.
    #[serde(default)]
    pub experts: crate::split::ExpertSplit,
}

impl Default for PlanRequest {
    fn default() -> Self {
        PlanRequest {
            ctx: 4096,
            strategy: Strategy::Auto,
            nodes: None,
            prompt_tokens: crate::cost::DEFAULT_PROMPT_TOKENS,
            experts: crate::split::ExpertSplit::Auto,
        }
    }
}

impl PlanRequest {
    /// Checks the numbers.
    ///
    /// # Errors
    /// [`PlanError::BadRequest`] when the context or prompt length is 0.
    pub fn validate(&self) -> Result<(), PlanError> {
        if self.ctx == 0 {
            return Err(PlanError::BadRequest {
                problem: "context length 0; give --ctx of at least 1 token".into(),
            });
        }
        if self.prompt_tokens == 0 {
            return Err(PlanError::BadRequest {
                problem: "prompt length 0; give --prompt-tokens of at least 1".into(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{dense_model, node};

    #[test]
    fn layer_parts_add_up() {
        let m = dense_model(24, 14, 2, 64, 4864, 1_000_000);
        for l in 0..24 {
            let p = m.layer_parts(l);
            assert_eq!(p.attn_q_o + p.attn_kv + p.ffn + p.experts, m.layer_bytes[l]);
            assert!(p.ffn > p.attn_q_o);
        }
    }

    #[test]
    fn validation_names_the_problem() {
        let mut m = dense_model(4, 8, 2, 16, 256, 1000);
        m.layer_bytes.pop();
        let e = m.validate().unwrap_err().to_string();
        assert!(e.contains("3 layer byte counts for 4 layers"), "{e}");
        let c = Cluster {
            nodes: vec![node("a", 8.0, 10.0), node("a", 8.0, 10.0)],
            links: vec![],
        };
        assert_eq!(
            c.validate(),
            Err(PlanError::DuplicateNode { id: "a".into() })
        );
        let c = Cluster {
            nodes: vec![node("a", 8.0, 10.0)],
            links: vec![LinkSpec {
                a: "a".into(),
                b: "z".into(),
                rtt_us: 1.0,
                bandwidth_gbps: 1.0,
                rdma: false,
                sized: Vec::new(),
            }],
        };
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("`z` is not a node"));
        assert_eq!(Cluster::default().validate(), Err(PlanError::NoNodes));
    }

    #[test]
    fn strategies_parse_and_filter() {
        assert_eq!("Hybrid".parse::<Strategy>(), Ok(Strategy::Hybrid));
        assert!("diagonal".parse::<Strategy>().is_err());
        assert!(Strategy::Tensor.admits(1, 1) && Strategy::Pipeline.admits(1, 1));
        assert!(!Strategy::Hybrid.admits(1, 4) && Strategy::Hybrid.admits(2, 2));
    }
}
