//! The cost model: what a placement costs per decoded token, per prompt, and in memory on
//! each node. Every figure comes from the inputs (measured bandwidth, compute, link round
//! trips and bandwidths, the model's stored bytes) and the named constants below.
//!
//! Notation: a stage `s` has tensor-parallel ranks `i` on nodes with read bandwidth `bw_i`
//! (bytes/s) and compute `F_i` (FLOP/s), and layers `L_s`; `h` is the hidden width, `P` the
//! prompt length, `ctx` the context. A message of `m` bytes over a link costs
//! `msg(m) = rtt / 2 + 8 m / link_bits_per_s`; a one-shot all-reduce of `m` bytes inside a
//! stage costs `ar_s(m) = max over the stage's pairs of msg(m)` (everyone sends its partial
//! to everyone at once; links assumed independent).
//!
//! **Decode**, seconds per token (one sequence):
//! ```text
//! T = header + sum_s [ max_i R_si / (MEM_EFFICIENCY * bw_i)
//!                      + (2 |L_s| + [s = 0 and tp > 1]) * ar_s(4 h) ]
//!       + sum over stage boundaries of max_i msg_(s,i)->(s+1,i)(4 h)
//!       + return
//! R_si = sum_{l in L_s} read_i(l) + |L_s| * KV_READ_FRACTION * ctx * kv_i + [s last] head_i
//! ```
//! `read_i(l)` is rank `i`'s share of layer `l`'s weights (cut as the executor cuts them, see
//! [`crate::split`]) with routed experts counted at the active fraction; `kv_i` its KV bytes
//! per token per layer (the KV cache is read at an average context of `ctx / 2`); `head_i`
//! its vocabulary slice of the output head. The embedding all-reduce of the first stage
//! assembles the looked-up rows (the lookup itself reads one row: ignored). `header` is the
//! lead's step header to the other first-stage ranks (`msg(24)`, 0 with one rank there) and
//! `return` the last stage's best tokens to the lead (`msg(8)`, 0 for one rank). Decode
//! tokens/s = `1 / T`; with one sequence per stage in flight the slowest stage (with its
//! outgoing hop) bounds the aggregate: `pipelined = 1 / max_s (stage_s + hop_s)`.
//!
//! **Prefill** of `P` tokens, one chunk, stages in turn (a single prompt does not overlap
//! across stages):
//! ```text
//! T = header(4 P) + sum_s [ max_i max(FLOP_si / (COMPUTE_EFFICIENCY * F_i),
//!                                     W_si / (MEM_EFFICIENCY * bw_i))
//!                           + (2 |L_s| + [s = 0 and tp > 1]) * ar_s(4 h P) ]
//!       + sum of hops msg(4 h P) + return
//! FLOP_si = 2 P (params/byte) sum_{l in L_s} read_i(l) + 2 P^2 head_dim heads_i |L_s|
//!           + [s last] 2 (params/byte) head_i
//! ```
//! (`params/byte` is the model's average; attention is causal, so `P^2 / 2` pairs, each two
//! multiply-adds of `head_dim`; only the last position's logits are computed.) `W_si` is the
//! weight bytes read once for the chunk (all held experts when `P * active >= experts`).
//! Prefill tokens/s = `P / T`.
//!
//! **Memory** per node: its weight bytes (its layers' shares, plus its vocabulary slice of
//! the embedding on the first stage and of the head on the last; a tied head is held once on
//! a one-stage placement) + KV cache `ctx * |L_s| * kv_i` (KV heads replicated when ranks
//! outnumber them) + [`RUNTIME_OVERHEAD_BYTES`]. A placement fits when every node's total is
//! at most its `memory_free_bytes` (what the node reports as available; a cluster file
//! gives it, or the total minus a reserve).

use std::collections::HashMap;
use std::ops::Range;

use crate::calibration::Calibration;
use crate::placement::{NodeMemory, Prediction};
use crate::spec::{Cluster, LinkSpec, ModelProfile, PlanRequest};
use crate::split::{tensor_split, ExpertSplit, RankShare};

/// Fraction of its measured read bandwidth a node reaches streaming weights in decode.
pub const MEM_EFFICIENCY: f64 = 0.8;
/// Fraction of its measured matmul throughput a node reaches in prefill.
pub const COMPUTE_EFFICIENCY: f64 = 0.8;
/// Memory a rank needs beyond weights and KV cache: activations, logits, kernel tiles,
/// message buffers, the process itself.
pub const RUNTIME_OVERHEAD_BYTES: u64 = 512 << 20;
/// Decode reads the KV cache at an average context of this fraction of `ctx`.
pub const KV_READ_FRACTION: f64 = 0.5;
/// Prompt length of the prefill prediction unless the request says otherwise.
pub const DEFAULT_PROMPT_TOKENS: u32 = 128;
/// Bytes per element of the hidden states that all-reduces and stage hops carry (f32).
pub const ACTIVATION_BYTES: f64 = 4.0;
/// Bytes of the lead's per-step header (plus 4 per token id).
pub const HEADER_BYTES: f64 = 20.0;
/// Bytes a last-stage rank returns to the lead per decoded token (greedy: value and id).
pub const TOKEN_RETURN_BYTES: f64 = 8.0;

/// Seconds to send `bytes` over `link`: half a small message's round trip plus what the
/// size adds. With measured round trips of sized messages (`LinkSpec::sized`), the size adds
/// what the measurements add over the small round trip, interpolated between the measured
/// sizes (from nothing at 0 bytes) and extended past the largest at the link's bandwidth;
/// without them, serialization at the bandwidth.
pub fn message_secs(link: &LinkSpec, bytes: f64) -> f64 {
    let serialization = |b: f64| b * 8.0 / (link.bandwidth_gbps * 1e9);
    let added = |m: &crate::spec::SizedRoundTrip| ((m.rtt_us - link.rtt_us) * 1e-6).max(0.0);
    let size = match link.sized.iter().position(|m| m.bytes as f64 >= bytes) {
        _ if link.sized.is_empty() => serialization(bytes),
        Some(i) => {
            let (lo_bytes, lo) = match i {
                0 => (0.0, 0.0),
                _ => (link.sized[i - 1].bytes as f64, added(&link.sized[i - 1])),
            };
            let hi = &link.sized[i];
            let f = (bytes - lo_bytes) / (hi.bytes as f64 - lo_bytes).max(1.0);
            lo + f * (added(hi) - lo)
        }
        None => {
            let last = &link.sized[link.sized.len() - 1];
            added(last) + serialization(bytes - last.bytes as f64)
        }
    };
    link.rtt_us * 0.5e-6 + size
}

/// What every tensor-parallel index of a `tp`-rank stage holds, with prefix sums over the
/// layers so a stage's cost over any layer range is O(tp).
pub(crate) struct TpTable {
    pub ranks: Vec<RankShare>,
    /// Per index: prefix sums of weight bytes held.
    held: Vec<Vec<u64>>,
    /// Per index: prefix sums of routed-expert bytes held.
    routed_held: Vec<Vec<u64>>,
    /// Per index: prefix sums of routed-expert bytes charged per decoded token.
    routed_read: Vec<Vec<f64>>,
    /// Per index: prefix sums of weight bytes read per decoded token.
    read: Vec<Vec<f64>>,
    /// Per index: KV bytes per token per layer.
    kv: Vec<u64>,
    emb: Vec<u64>,
    head: Vec<u64>,
}

impl TpTable {
    fn new(model: &ModelProfile, tp: usize, asked: ExpertSplit) -> Result<Self, String> {
        let ranks = tensor_split(model, tp, asked)?;
        let n = model.n_layers;
        let mut held = Vec::with_capacity(tp);
        let mut routed_held = Vec::with_capacity(tp);
        let mut routed_read = Vec::with_capacity(tp);
        let mut read = Vec::with_capacity(tp);
        for r in &ranks {
            let (mut h, mut e, mut d) = (vec![0u64; n + 1], vec![0u64; n + 1], vec![0.0; n + 1]);
            let mut er = vec![0.0; n + 1];
            for l in 0..n {
                h[l + 1] = h[l] + r.layer_bytes(model, l);
                e[l + 1] = e[l] + r.expert_bytes(model, l);
                er[l + 1] = er[l] + r.routed_layer_read(model, l);
                d[l + 1] = d[l] + r.layer_read(model, l);
            }
            held.push(h);
            routed_held.push(e);
            routed_read.push(er);
            read.push(d);
        }
        Ok(TpTable {
            routed_held,
            routed_read,
            kv: ranks.iter().map(|r| r.kv_per_token_layer(model)).collect(),
            emb: ranks.iter().map(|r| r.embedding_bytes(model)).collect(),
            head: ranks.iter().map(|r| r.head_bytes(model)).collect(),
            ranks,
            held,
            read,
        })
    }
}

/// A stage as the cost model sees it: its nodes (cluster indices, tensor-parallel order),
/// its layers and whether it is first or last.
#[derive(Clone, Copy)]
pub(crate) struct Stage<'s> {
    pub nodes: &'s [usize],
    pub layers: (usize, usize),
    pub first: bool,
    pub last: bool,
}

impl Stage<'_> {
    fn len(&self) -> usize {
        self.layers.1 - self.layers.0
    }

    /// All-reduces per token: two per layer, one for the embedding on the first stage.
    fn all_reduces(&self) -> f64 {
        if self.nodes.len() < 2 {
            return 0.0;
        }
        (2 * self.len() + usize::from(self.first)) as f64
    }
}

/// The cost model over one cluster, model and request.
pub(crate) struct Evaluator<'a> {
    pub cluster: &'a Cluster,
    pub model: &'a ModelProfile,
    pub req: &'a PlanRequest,
    links: HashMap<(usize, usize), &'a LinkSpec>,
    tables: HashMap<usize, Result<TpTable, String>>,
    /// Per node (cluster index): its calibration of the model's shape, when it has one
    /// with every kind of layer the model has.
    calibrations: Vec<Option<&'a Calibration>>,
}

impl<'a> Evaluator<'a> {
    /// Tables for every tensor-parallel width up to `max_tp`.
    pub fn new(
        cluster: &'a Cluster,
        model: &'a ModelProfile,
        req: &'a PlanRequest,
        max_tp: usize,
    ) -> Self {
        let tables = (1..=max_tp.max(1))
            .map(|tp| (tp, TpTable::new(model, tp, req.experts)))
            .collect();
        let shape = model.shape_key();
        let calibrations = cluster
            .nodes
            .iter()
            .map(|n| {
                n.calibrations
                    .iter()
                    .find(|c| c.shape == shape && c.covers(model))
            })
            .collect();
        Evaluator {
            cluster,
            model,
            req,
            links: cluster.link_table(),
            tables,
            calibrations,
        }
    }

    /// The shares of a `tp`-rank stage, or why the model cannot be cut that finely.
    pub fn table(&self, tp: usize) -> Result<&TpTable, String> {
        match self.tables.get(&tp) {
            Some(Ok(t)) => Ok(t),
            Some(Err(e)) => Err(e.clone()),
            None => Err(format!("tp {tp} is wider than the cluster")),
        }
    }

    /// The link between nodes `a` and `b` (cluster indices).
    pub fn link(&self, a: usize, b: usize) -> Option<&'a LinkSpec> {
        self.links.get(&(a.min(b), a.max(b))).copied()
    }

    /// Seconds to send `bytes` from `a` to `b`; 0 on the same node, `None` without a link.
    pub fn msg(&self, a: usize, b: usize, bytes: f64) -> Option<f64> {
        if a == b {
            return Some(0.0);
        }
        self.link(a, b).map(|l| message_secs(l, bytes))
    }

    /// A one-shot all-reduce of `bytes` among `nodes`: the slowest pair's message.
    pub fn all_reduce(&self, nodes: &[usize], bytes: f64) -> Option<f64> {
        let mut worst = 0.0f64;
        for (k, &a) in nodes.iter().enumerate() {
            for &b in &nodes[k + 1..] {
                worst = worst.max(self.msg(a, b, bytes)?);
            }
        }
        Some(worst)
    }

    fn bw(&self, node: usize) -> f64 {
        self.cluster.nodes[node].mem_bandwidth_gbs * 1e9 * MEM_EFFICIENCY
    }

    /// The read bandwidth of `node`'s GPU (its CPU's where it has none).
    fn gpu_bw(&self, node: usize) -> f64 {
        match &self.cluster.nodes[node].gpu {
            Some(g) => g.mem_bandwidth_gbs * 1e9 * MEM_EFFICIENCY,
            None => self.bw(node),
        }
    }

    /// How many of the first layers of index `i`'s share of `st` run on `node`'s GPU (0
    /// without one), by the rule the node loads by ([`crate::gpu`]).
    fn gpu_layers(&self, t: &TpTable, i: usize, node: usize, st: Stage<'_>) -> usize {
        let Some(g) = &self.cluster.nodes[node].gpu else {
            return 0;
        };
        let (a, b) = st.layers;
        let layers: Vec<u64> = (a..b).map(|l| t.held[i][l + 1] - t.held[i][l]).collect();
        let embedding = if st.first { t.emb[i] } else { 0 };
        g.layers(embedding, &layers, t.kv[i])
    }

    /// Seconds index `i` of `stage` on `node` reads for a decoded token: its GPU's layers
    /// (with the head when it holds them all) at the GPU's bandwidth, the rest at the CPU's.
    fn decode_secs(&self, t: &TpTable, i: usize, node: usize, st: Stage<'_>) -> f64 {
        let all = self.decode_read(t, i, st);
        let k = self.gpu_layers(t, i, node, st);
        if k == 0 {
            return self
                .calibrated_decode_secs(t, i, node, st)
                .unwrap_or(all / self.bw(node));
        }
        let a = st.layers.0;
        let gpu = if k == st.len() {
            all
        } else {
            t.read[i][a + k] - t.read[i][a]
                + k as f64 * KV_READ_FRACTION * self.ctx() * t.kv[i] as f64
        };
        gpu / self.gpu_bw(node) + (all - gpu) / self.bw(node)
    }

    /// [`Evaluator::decode_secs`] from `node`'s measured costs of the model's shape
    /// ([`crate::calibration`]), when it has them.
    fn calibrated_decode_secs(
        &self,
        t: &TpTable,
        i: usize,
        node: usize,
        st: Stage<'_>,
    ) -> Option<f64> {
        let cal = self.calibrations[node]?;
        // the bus as it is now against the bus beside the measurement
        let scale = self.cluster.nodes[node].mem_bandwidth_gbs / cal.mem_bandwidth_gbs * 1e9;
        let (a, b) = st.layers;
        let mut secs = cal.step_secs;
        for l in a..b {
            let cost = cal.layer(self.model, l)?;
            let read = t.read[i][l + 1] - t.read[i][l];
            secs += cost.fixed_secs + read / (cost.weights_gbs * scale);
        }
        let kv = st.len() as f64 * KV_READ_FRACTION * self.ctx() * t.kv[i] as f64;
        secs += kv / self.bw(node);
        if st.last {
            secs += t.head[i] as f64 / (cal.head_gbs * scale);
        }
        Some(secs)
    }

    /// Prefill seconds of index `i` of `stage` on `node` from the node's measured costs of
    /// the model's shape: per layer its kind's cost per prompt row for the rank's share of
    /// the layer's weights, and per pair of positions for its share of the query heads,
    /// plus the chunk's cost outside the layers.
    fn calibrated_prefill_secs(
        &self,
        t: &TpTable,
        i: usize,
        node: usize,
        st: Stage<'_>,
    ) -> Option<f64> {
        let cal = self.calibrations[node]?;
        let p = f64::from(self.req.prompt_tokens);
        let heads = t.ranks[i].heads.len() as f64 / self.model.n_heads as f64;
        let (a, b) = st.layers;
        let mut secs = cal.prefill_step_secs;
        for l in a..b {
            let cost = cal.layer(self.model, l)?;
            let whole = self.model.layer_bytes[l].max(1) as f64;
            let share = (t.held[i][l + 1] - t.held[i][l]) as f64 / whole;
            secs +=
                share * cost.prefill_row_secs * p + heads * cost.prefill_pair_secs * p * p / 2.0;
        }
        Some(secs)
    }

    /// Whether every rank of `stage` is predicted from its node's measured costs.
    pub fn stage_calibrated(&self, t: &TpTable, st: Stage<'_>) -> bool {
        st.nodes
            .iter()
            .enumerate()
            .all(|(i, &n)| self.gpu_layers(t, i, n, st) == 0 && self.calibrations[n].is_some())
    }

    fn flops(&self, node: usize) -> f64 {
        self.cluster.nodes[node].compute_gflops * 1e9 * COMPUTE_EFFICIENCY
    }

    /// The matrix throughput of `node`'s GPU (its CPU's where it has none or it was not
    /// measured).
    fn gpu_flops(&self, node: usize) -> f64 {
        match self.cluster.nodes[node]
            .gpu
            .as_ref()
            .and_then(|g| g.compute_gflops)
        {
            Some(g) => g * 1e9 * COMPUTE_EFFICIENCY,
            None => self.flops(node),
        }
    }

    fn ctx(&self) -> f64 {
        f64::from(self.req.ctx)
    }

    fn hidden_bytes(&self) -> f64 {
        self.model.hidden as f64 * ACTIVATION_BYTES
    }

    /// Bytes tensor-parallel index `i` of `stage` reads per decoded token.
    fn decode_read(&self, t: &TpTable, i: usize, st: Stage<'_>) -> f64 {
        let (a, b) = st.layers;
        t.read[i][b] - t.read[i][a]
            + st.len() as f64 * KV_READ_FRACTION * self.ctx() * t.kv[i] as f64
            + if st.last { t.head[i] as f64 } else { 0.0 }
    }

    /// Decode seconds of `stage` per token: (slowest rank's reading, all-reduces); missing
    /// links cost nothing here (the caller marks the placement infeasible).
    pub fn stage_decode(&self, t: &TpTable, st: Stage<'_>) -> (f64, f64) {
        let compute = st
            .nodes
            .iter()
            .enumerate()
            .map(|(i, &n)| self.decode_secs(t, i, n, st))
            .fold(0.0, f64::max);
        let ar = self
            .all_reduce(st.nodes, self.hidden_bytes())
            .unwrap_or(0.0);
        (compute, st.all_reduces() * ar)
    }

    /// Prefill seconds of `stage` for the request's prompt.
    fn stage_prefill(&self, t: &TpTable, st: Stage<'_>) -> f64 {
        let p = f64::from(self.req.prompt_tokens);
        let compute = st
            .nodes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                // the GPU's layers (and the head when it takes them all) at its figures,
                // the rest at the CPU's
                let (a, b) = st.layers;
                let k = self.gpu_layers(t, i, n, st);
                if k == 0 {
                    if let Some(secs) = self.calibrated_prefill_secs(t, i, n, st) {
                        return secs;
                    }
                }
                let all = k == st.len();
                let on_gpu = self.prefill_part(t, i, (a, a + k), st.last && all);
                let on_cpu = self.prefill_part(t, i, (a + k, b), st.last && !all);
                let secs = |(flop, weights): (f64, f64), flops: f64, bw: f64| {
                    (flop / flops).max(weights / bw)
                };
                secs(on_gpu, self.gpu_flops(n), self.gpu_bw(n))
                    + secs(on_cpu, self.flops(n), self.bw(n))
            })
            .fold(0.0, f64::max);
        let ar = self
            .all_reduce(st.nodes, self.hidden_bytes() * p)
            .unwrap_or(0.0);
        compute + st.all_reduces() * ar
    }

    /// The FLOPs and weight bytes read of index `i`'s prefill of the request's prompt over
    /// `layers` (and the head where `head`).
    fn prefill_part(
        &self,
        t: &TpTable,
        i: usize,
        layers: (usize, usize),
        head: bool,
    ) -> (f64, f64) {
        let p = f64::from(self.req.prompt_tokens);
        let (a, b) = layers;
        let ppb = self.model.params_per_byte();
        let expert_touch = (p * self.model.active_fraction()).min(1.0);
        let read = t.read[i][b] - t.read[i][a];
        let routed = t.routed_read[i][b] - t.routed_read[i][a];
        let experts = (t.routed_held[i][b] - t.routed_held[i][a]) as f64;
        let heads = t.ranks[i].heads.len() as f64;
        let head = if head { t.head[i] as f64 } else { 0.0 };
        let flop = 2.0 * p * ppb * read
            + 2.0 * p * p * self.model.head_dim as f64 * heads * (b - a) as f64
            + 2.0 * ppb * head;
        (flop, read - routed + experts * expert_touch + head)
    }

    /// Memory tensor-parallel index `i` of `stage` needs, on node `node`.
    pub fn memory(&self, t: &TpTable, i: usize, node: usize, st: Stage<'_>) -> NodeMemory {
        let (a, b) = st.layers;
        let tied_once = self.model.tied_embeddings && st.first;
        let weight_bytes = t.held[i][b] - t.held[i][a]
            + if st.first { t.emb[i] } else { 0 }
            + if st.last && !tied_once { t.head[i] } else { 0 };
        let kv_bytes = u64::from(self.req.ctx) * st.len() as u64 * t.kv[i];
        let spec = &self.cluster.nodes[node];
        // the GPU's part: its layers and their cache, with the embedding (first stage),
        // and everything when it takes every layer
        let k = self.gpu_layers(t, i, node, st);
        let own_memory = spec.gpu.as_ref().and_then(|g| g.memory_bytes);
        let gpu_bytes = match (k, own_memory) {
            (0, _) | (_, None) => 0,
            (k, Some(_)) if k == st.len() => weight_bytes + kv_bytes,
            (k, Some(_)) => {
                t.held[i][a + k] - t.held[i][a]
                    + if st.first { t.emb[i] } else { 0 }
                    + u64::from(self.req.ctx) * k as u64 * t.kv[i]
            }
        };
        // a tied head on the CPU beside an embedding on the GPU is a second copy
        let second_copy = if tied_once && st.last && k > 0 && k < st.len() {
            t.head[i]
        } else {
            0
        };
        let host = weight_bytes + kv_bytes + second_copy - gpu_bytes;
        NodeMemory {
            node: spec.id.clone(),
            weight_bytes,
            kv_bytes,
            overhead_bytes: RUNTIME_OVERHEAD_BYTES,
            total_bytes: host + RUNTIME_OVERHEAD_BYTES,
            free_bytes: spec.memory_free_bytes,
            gpu_bytes,
            gpu_memory_bytes: own_memory,
        }
    }

    /// Whether every rank of `stage` fits its node.
    pub fn stage_fits(&self, t: &TpTable, st: Stage<'_>) -> bool {
        st.nodes
            .iter()
            .enumerate()
            .all(|(i, &n)| self.memory(t, i, n, st).fits())
    }

    /// Node pairs a placement exchanges messages over that have no link.
    pub fn missing_links(&self, stages: &[Vec<usize>]) -> Vec<(usize, usize)> {
        let mut need = Vec::new();
        let lead = stages[0][0];
        for (s, nodes) in stages.iter().enumerate() {
            for (k, &a) in nodes.iter().enumerate() {
                need.extend(nodes[k + 1..].iter().map(|&b| (a, b)));
                if let Some(next) = stages.get(s + 1) {
                    need.push((a, next[k]));
                }
                if s + 1 == stages.len() {
                    need.push((lead, a));
                }
            }
        }
        let mut missing: Vec<(usize, usize)> = need
            .into_iter()
            .filter(|&(a, b)| a != b && self.link(a, b).is_none())
            .map(|(a, b)| (a.min(b), a.max(b)))
            .collect();
        missing.sort_unstable();
        missing.dedup();
        missing
    }

    /// The prediction for `stages` (cluster indices, tensor-parallel order) holding
    /// `ranges`; `t` is the table of their width.
    pub fn predict(
        &self,
        t: &TpTable,
        stages: &[Vec<usize>],
        ranges: &[Range<usize>],
    ) -> Prediction {
        let pp = stages.len();
        let st = |s: usize| Stage {
            nodes: &stages[s],
            layers: (ranges[s].start, ranges[s].end),
            first: s == 0,
            last: s + 1 == pp,
        };
        let lead = stages[0][0];
        let p = f64::from(self.req.prompt_tokens);
        let hb = self.hidden_bytes();
        let reachable = self.missing_links(stages).is_empty();
        let msg = |a: usize, b: usize, bytes: f64| self.msg(a, b, bytes).unwrap_or(0.0);
        let header = |bytes: f64| {
            stages[0]
                .iter()
                .map(|&n| msg(lead, n, bytes))
                .fold(0.0, f64::max)
        };
        let ret = stages[pp - 1]
            .iter()
            .map(|&n| msg(n, lead, TOKEN_RETURN_BYTES))
            .fold(0.0, f64::max);
        let hop = |s: usize, bytes: f64| -> f64 {
            if s + 1 == pp {
                return 0.0;
            }
            stages[s]
                .iter()
                .zip(&stages[s + 1])
                .map(|(&a, &b)| msg(a, b, bytes))
                .fold(0.0, f64::max)
        };

        let mut compute = 0.0;
        let mut comm = header(HEADER_BYTES + 4.0) + ret;
        let mut slowest = 0.0f64;
        let mut prefill = header(HEADER_BYTES + 4.0 * p) + ret;
        let calibrated = (0..pp).all(|s| self.stage_calibrated(t, st(s)));
        for s in 0..pp {
            let (c, a) = self.stage_decode(t, st(s));
            let h = hop(s, hb);
            compute += c;
            comm += a + h;
            let edge = if s == 0 {
                header(HEADER_BYTES + 4.0)
            } else {
                0.0
            } + if s + 1 == pp { ret } else { 0.0 };
            slowest = slowest.max(c + a + h + edge);
            prefill += self.stage_prefill(t, st(s)) + hop(s, hb * p);
        }
        let per_s = |secs: f64, tokens: f64| {
            if reachable && secs > 0.0 {
                tokens / secs
            } else {
                0.0
            }
        };
        let memory = (0..pp)
            .flat_map(|s| stages[s].iter().enumerate().map(move |(i, &n)| (s, i, n)))
            .map(|(s, i, n)| self.memory(t, i, n, st(s)))
            .collect();
        Prediction {
            decode_tok_s: per_s(compute + comm, 1.0),
            pipelined_decode_tok_s: per_s(slowest, 1.0),
            prefill_tok_s: per_s(prefill, p),
            prompt_tokens: self.req.prompt_tokens,
            decode_compute_ms: compute * 1e3,
            decode_comm_ms: comm * 1e3,
            calibrated,
            memory,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::NodeSpec;
    use crate::testing::{dense_model, link, node};

    #[test]
    fn one_node_decode_is_bytes_over_bandwidth() {
        let m = dense_model(10, 8, 8, 64, 2048, 100_000_000);
        let c = Cluster {
            nodes: vec![node("a", 64.0, 10.0)],
            links: vec![],
        };
        let req = PlanRequest {
            ctx: 1,
            ..PlanRequest::default()
        };
        let ev = Evaluator::new(&c, &m, &req, 1);
        let t = ev.table(1).unwrap();
        let whole = crate::layers::ranges(&[10]);
        let p = ev.predict(t, &[vec![0]], &whole);
        let kv = 0.5 * m.kv_bytes_per_token_per_layer as f64 * 10.0;
        let want = 10e9 * MEM_EFFICIENCY / (m.bytes_per_token() + kv);
        assert!((p.decode_tok_s - want).abs() < 1e-9 * want, "{p:?}");
        assert_eq!(p.decode_comm_ms, 0.0);
        assert_eq!(p.memory[0].weight_bytes, m.weight_bytes());
    }

    #[test]
    fn a_calibrated_node_is_predicted_from_its_measured_costs() {
        use crate::calibration::{Calibration, LayerCost};
        let m = dense_model(10, 8, 8, 64, 2048, 100_000_000);
        let cal = Calibration {
            shape: m.shape_key(),
            threads: 1,
            mem_bandwidth_gbs: 10.0,
            dense: Some(LayerCost {
                fixed_secs: 1e-4,
                weights_gbs: 5.0,
                prefill_row_secs: 2e-5,
                prefill_pair_secs: 1e-8,
            }),
            moe: None,
            head_gbs: 4.0,
            step_secs: 2e-4,
            prefill_step_secs: 1e-3,
            measured_tok_s: 1.0,
            measured_prefill_tok_s: 1.0,
            measured_prefill_rows: 128,
        };
        let calibrated = |bw: f64, cal: Calibration| NodeSpec {
            calibrations: vec![cal],
            ..node("a", 64.0, bw)
        };
        let req = PlanRequest {
            ctx: 1,
            ..PlanRequest::default()
        };
        let predict = |nodes: Vec<NodeSpec>, tp: usize| {
            let c = Cluster {
                links: vec![link("a", "b", 100.0, 10.0)],
                nodes,
            };
            let ev = Evaluator::new(&c, &m, &req, tp);
            let t = ev.table(tp).unwrap();
            let stage: Vec<usize> = (0..tp).collect();
            ev.predict(t, &[stage], &crate::layers::ranges(&[10]))
        };
        let kv = 0.5 * m.kv_bytes_per_token_per_layer as f64 * 10.0 / (10e9 * MEM_EFFICIENCY);
        let layers = 10.0 * (1e-4 + 1e8 / 5e9);
        let one = predict(vec![calibrated(10.0, cal.clone())], 1);
        let want = 2e-4 + layers + kv + m.head_bytes as f64 / 4e9;
        assert!((1.0 / one.decode_tok_s - want).abs() < 1e-9, "{one:?}");
        assert!(one.calibrated);
        // prefill of the request's prompt: rows and pairs of rows per layer, and the chunk
        let p = f64::from(req.prompt_tokens);
        let want_prefill = 1e-3 + 10.0 * (2e-5 * p + 1e-8 * p * p / 2.0);
        assert!(
            (p / one.prefill_tok_s - want_prefill).abs() < 1e-9,
            "{one:?}"
        );

        // a bus half as fast reads the weights half as fast; the fixed parts stay
        let slow = predict(vec![calibrated(5.0, cal.clone())], 1);
        let want_slow = 2e-4 + 10.0 * (1e-4 + 1e8 / 2.5e9) + 2.0 * kv + m.head_bytes as f64 / 2e9;
        assert!(
            (1.0 / slow.decode_tok_s - want_slow).abs() < 1e-9,
            "{slow:?}"
        );

        // two tensor-parallel ranks each pay every layer's fixed part and read their share
        let b = NodeSpec {
            id: "b".into(),
            name: "b".into(),
            ..calibrated(10.0, cal.clone())
        };
        let two = predict(vec![calibrated(10.0, cal.clone()), b], 2);
        assert!(two.calibrated);
        let fixed = 2e-4 + 10.0 * 1e-4;
        let weights = 10.0 * 1e8 / 5e9 + m.head_bytes as f64 / 4e9;
        let rank = two.decode_compute_ms * 1e-3;
        assert!(
            rank > fixed + 0.45 * weights && rank < fixed + 0.55 * weights + kv,
            "{two:?}"
        );

        // another shape's costs are not this model's
        let other = Calibration {
            shape: "l1-other".into(),
            ..cal
        };
        let unc = predict(vec![calibrated(10.0, other)], 1);
        assert!(!unc.calibrated);
        let bytes = 10e9 * MEM_EFFICIENCY
            / (m.bytes_per_token() + 0.5 * m.kv_bytes_per_token_per_layer as f64 * 10.0);
        assert!((unc.decode_tok_s - bytes).abs() < 1e-9 * bytes);
    }

    #[test]
    fn a_message_costs_what_measured_messages_of_its_size_added() {
        use crate::spec::SizedRoundTrip;
        let mut l = link("a", "b", 100.0, 10.0);
        // without sized measurements: half the round trip plus serialization
        assert!((message_secs(&l, 1250.0) - (50e-6 + 1e-6)).abs() < 1e-12);
        l.sized = vec![
            SizedRoundTrip {
                bytes: 4096,
                rtt_us: 140.0,
            },
            SizedRoundTrip {
                bytes: 65536,
                rtt_us: 400.0,
            },
        ];
        let at = |b: f64| message_secs(&l, b) * 1e6;
        assert!((at(0.0) - 50.0).abs() < 1e-9);
        // halfway to the first size adds half of its 40 us
        assert!((at(2048.0) - 70.0).abs() < 1e-9);
        assert!((at(4096.0) - 90.0).abs() < 1e-9);
        // between sizes: interpolated
        let mid = (4096.0 + 65536.0) / 2.0;
        assert!((at(mid) - (50.0 + 40.0 + 130.0)).abs() < 1e-9);
        // past the largest: its cost plus serialization at the bandwidth
        let beyond = 65536.0 + 1250.0;
        assert!((at(beyond) - (50.0 + 300.0 + 1.0)).abs() < 1e-9);
        // a measurement faster than the small round trip adds nothing
        l.sized[0].rtt_us = 90.0;
        assert!((message_secs(&l, 4096.0) * 1e6 - 50.0).abs() < 1e-9);
    }

    #[test]
    fn all_reduce_is_the_slowest_pair() {
        let m = dense_model(4, 8, 8, 64, 2048, 1000);
        let c = Cluster {
            nodes: vec![
                node("a", 8.0, 10.0),
                node("b", 8.0, 10.0),
                node("c", 8.0, 10.0),
            ],
            links: vec![link("a", "b", 10.0, 10.0), link("a", "c", 100.0, 10.0)],
        };
        let req = PlanRequest::default();
        let ev = Evaluator::new(&c, &m, &req, 3);
        assert_eq!(ev.all_reduce(&[0, 1, 2], 8.0), None);
        let t = ev.all_reduce(&[0, 1], 1250.0).unwrap();
        assert!((t - (5e-6 + 1e-6)).abs() < 1e-12);
        assert_eq!(ev.missing_links(&[vec![0], vec![1], vec![2]]), vec![(1, 2)]);
    }

    /// A node computing on a GPU that holds `gpu_gb` GB (`None`: shares the host's) at
    /// `gpu_bw` GB/s, its CPU reading at `bw`.
    fn gpu_node(id: &str, free_gb: f64, bw: f64, gpu_gb: Option<f64>, gpu_bw: f64) -> NodeSpec {
        NodeSpec {
            gpu: Some(crate::GpuSpec {
                memory_bytes: gpu_gb.map(|g| (g * 1e9) as u64),
                mem_bandwidth_gbs: gpu_bw,
                compute_gflops: None,
                max_layers: None,
            }),
            backend: "gpu:0".into(),
            ..node(id, free_gb, bw)
        }
    }

    #[test]
    fn a_gpu_takes_the_layers_that_fit_and_reads_them_at_its_bandwidth() {
        use crate::gpu::{FIT_KV_POSITIONS, FIT_SPARE_BYTES};
        let layer = 1_000_000_000u64;
        let m = dense_model(10, 8, 8, 64, 2048, layer);
        let kv = m.kv_bytes_per_token_per_layer;
        // room for the embedding and exactly 4 layers with their fit-time caches
        let room = layer + 4 * (layer + kv * FIT_KV_POSITIONS) + FIT_SPARE_BYTES;
        let gpu_memory = (room * 10).div_ceil(9) + 10;
        let c = Cluster {
            nodes: vec![gpu_node(
                "a",
                64.0,
                10.0,
                Some(gpu_memory as f64 / 1e9),
                100.0,
            )],
            links: vec![],
        };
        let req = PlanRequest {
            ctx: 1,
            ..PlanRequest::default()
        };
        let ev = Evaluator::new(&c, &m, &req, 1);
        let t = ev.table(1).unwrap();
        let p = ev.predict(t, &[vec![0]], &crate::layers::ranges(&[10]));
        let kv_read = 0.5 * kv as f64;
        let gpu = 4.0 * (layer as f64 + kv_read);
        let cpu = 6.0 * (layer as f64 + kv_read) + layer as f64; // and the head
        let want = 1.0 / (gpu / (100e9 * MEM_EFFICIENCY) + cpu / (10e9 * MEM_EFFICIENCY));
        assert!(
            (p.decode_tok_s - want).abs() < 1e-9 * want,
            "{p:?} want {want}"
        );
        let mem = &p.memory[0];
        assert_eq!(mem.gpu_bytes, 5 * layer + 4 * kv, "embedding and 4 layers");
        // the host holds the other 6 layers and the tied head's own copy
        assert_eq!(mem.total_bytes, 7 * layer + 6 * kv + RUNTIME_OVERHEAD_BYTES);
        assert!(mem.fits());
        // a GPU that shares the host's memory takes every layer, counted there
        let c = Cluster {
            nodes: vec![gpu_node("a", 64.0, 10.0, None, 100.0)],
            links: vec![],
        };
        let ev = Evaluator::new(&c, &m, &req, 1);
        let p = ev.predict(
            ev.table(1).unwrap(),
            &[vec![0]],
            &crate::layers::ranges(&[10]),
        );
        let want = 100e9 * MEM_EFFICIENCY / (m.bytes_per_token() + 10.0 * kv_read);
        assert!((p.decode_tok_s - want).abs() < 1e-9 * want, "{p:?}");
        assert_eq!(p.memory[0].gpu_bytes, 0);
        assert_eq!(
            p.memory[0].total_bytes,
            m.weight_bytes() + 10 * kv + RUNTIME_OVERHEAD_BYTES
        );
        // its prefill at its measured throughput, where it was measured
        let mut c = c.clone();
        let prefill = |c: &Cluster| {
            let ev = Evaluator::new(c, &m, &req, 1);
            ev.predict(
                ev.table(1).unwrap(),
                &[vec![0]],
                &crate::layers::ranges(&[10]),
            )
            .prefill_tok_s
        };
        let cpu_figure = prefill(&c);
        c.nodes[0].gpu.as_mut().unwrap().compute_gflops = Some(100_000.0);
        let gpu_figure = prefill(&c);
        let tokens = f64::from(req.prompt_tokens);
        let flop = 2.0 * tokens * m.params_per_byte() * m.bytes_per_token()
            + 2.0 * tokens * tokens * 64.0 * 8.0 * 10.0;
        let want = tokens
            / (flop / (100_000e9 * COMPUTE_EFFICIENCY))
                .max(m.bytes_per_token() / (100e9 * MEM_EFFICIENCY));
        assert!(
            (gpu_figure - want).abs() < 1e-6 * want,
            "{gpu_figure} want {want}"
        );
        assert!(
            gpu_figure > 10.0 * cpu_figure,
            "{gpu_figure} vs {cpu_figure}"
        );
        // a fixed count larger than the GPU's memory does not fit
        let mut c = Cluster {
            nodes: vec![gpu_node("a", 64.0, 10.0, Some(2.0), 100.0)],
            links: vec![],
        };
        c.nodes[0].gpu.as_mut().unwrap().max_layers = Some(8);
        let ev = Evaluator::new(&c, &m, &req, 1);
        let p = ev.predict(
            ev.table(1).unwrap(),
            &[vec![0]],
            &crate::layers::ranges(&[10]),
        );
        assert!(!p.memory[0].fits(), "{:?}", p.memory[0]);
    }

    #[test]
    fn a_gpu_node_that_holds_the_model_beats_a_split_over_cpu_nodes() {
        let m = dense_model(16, 8, 8, 64, 2048, 500_000_000);
        let mut nodes = vec![node("cpu1", 64.0, 50.0), node("cpu2", 64.0, 50.0)];
        nodes.push(gpu_node("gpu", 32.0, 40.0, Some(24.0), 900.0));
        let c = crate::testing::mesh(nodes, 100.0, 10.0);
        let best = crate::plan(&c, &m, &PlanRequest::default()).unwrap();
        assert_eq!(best.placement.describe(), "gpu[0..16]", "{best:?}");
        // with a GPU too small for a third of it, the GPU node still leads its share
        let mut small = c.clone();
        small.nodes[2].gpu.as_mut().unwrap().memory_bytes = Some(3_000_000_000);
        let best = crate::plan(&small, &m, &PlanRequest::default()).unwrap();
        eprintln!("{} {:?}", best.placement.describe(), best.prediction);
        assert!(best.placement.describe().contains("gpu"), "{best:?}");
    }
}
