//! `shoal plan MODEL [--cluster FILE]`: where a model would run on a cluster and how fast. The
//! cluster (and optionally a hypothetical model) comes from a TOML file, or is the live
//! cluster a node reports (`/cluster/planner`: measured node facts and links); a real MODEL's
//! profile (its shape and the stored bytes of every block, embedding and head) is read from
//! its GGUF or safetensors headers without loading weights. The placement planner
//! (`shoal-planner`) ranks the candidates; this prints them as a table or JSON.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Args;
use serde::{Deserialize, Serialize};
use shoal_driver::profile_from_model;
use shoal_engine::kv_cache::KvCache;
use shoal_planner::split::ExpertSplit;
use shoal_planner::{
    Candidate, Cluster, LinkSpec, ModelProfile, MoeSpec, NodeSpec, Placement, PlanRequest,
    Prediction, Strategy,
};

/// Bytes in the files' GB (decimal, as memory and disk are sold).
const GB: f64 = 1e9;
/// When a node gives no `memory_free_gb`: this fraction of its memory is kept for the OS...
const RESERVE_FRACTION: f64 = 0.10;
/// ...and at least this many GB.
const RESERVE_MIN_GB: f64 = 1.0;

const CLUSTER_FORMAT: &str = "\
CLUSTER FILE (TOML; GB = 1e9 bytes, Gbit/s = 1e9 bits/s):

  [[node]]                     # one per machine
  name = \"studio-1\"            # also its id unless `id` is given
  memory_gb = 512              # physical memory
  memory_free_gb = 480         # what a model may use (default: memory_gb less 10%, >= 1 GB)
  backend = \"cpu\"              # informational: cpu (default), gpu:0
  mem_bandwidth_gbs = 800      # measured memory read bandwidth, GB/s
  compute_gflops = 25000       # measured matmul throughput (prefill), GFLOP/s
  threads = 32                 # compute threads (default 1)
  gpu_bandwidth_gbs = 900      # optional: it computes on a GPU reading this fast, GB/s;
  gpu_compute_gflops = 60000   #   measured matmul throughput (default: compute_gflops),
  gpu_memory_gb = 24           #   with its own memory (omit when it shares the host's):
  gpu_layers = 20              #   a share's first layers that fit (or this many) go there,
                               #   the rest run on the CPU (mem_bandwidth_gbs) in memory_gb
  calibrations = [\"a.json\"]    # optional: its measured costs of model shapes (`shoal bench
                               #   MODEL --calibrate` prints where it kept them); decode of
                               #   a model of such a shape is predicted from them

  [[link]]                     # one per pair of nodes; a pair without one is unreachable
  a = \"studio-1\"
  b = \"studio-2\"
  rtt_us = 50                  # round-trip time of a small message, microseconds
  bandwidth_gbps = 80          # Gbit/s
  rdma = true                  # default false
  sized = [{ bytes = 16384, rtt_us = 90 }]  # optional: measured round trips of messages
                               #   of a split's sizes (`shoal links --json` shows a live
                               #   cluster's), ascending

  [default_link]               # optional: every pair without its own [[link]]
  rtt_us = 50
  bandwidth_gbps = 80

  [model]                      # optional: a hypothetical model (MODEL is then only a name)
  name = \"deepseek-v3-671b-q4\"
  hidden = 7168                # d_model
  n_heads = 128
  n_kv_heads = 1               # KV heads (1 for a shared latent such as MLA)
  head_dim = 128
  ffn = 18432                  # dense feed-forward width
  vocab = 129280
  params_b = 671               # parameters, billions
  embedding_gb = 0.52
  head_gb = 0.76               # omit when the head is tied to the embedding
  kv_bytes_per_token_per_layer = 2304   # default 2 * n_kv_heads * head_dim * 2 (f16)
  quant_block = 256            # 32, or 256 for k-quants (default 32)
  [[model.layers]]             # groups of identical layers, in order
  count = 3
  gb = 0.328                   # stored bytes of one layer, all of it
  [[model.layers]]
  count = 58
  gb = 6.472
  experts_gb = 6.342           # of which routed experts
  [model.moe]
  n_experts = 256
  active_experts = 8
  expert_ffn = 2048            # features of one expert (omit: experts are only held whole)
  expert_block = 256           # quantization block of the experts' down projection

Examples: examples/clusters/mac-studios.toml, mac-studios-tcp.toml, loopback.toml.";

/// Options of `shoal plan`.
#[derive(Args, Debug)]
#[command(after_long_help = CLUSTER_FORMAT)]
pub struct PlanArgs {
    /// A GGUF file, a Hugging Face folder or cache id, or a fetched catalog key; or only a
    /// name when the cluster file has a [model] table.
    pub model: String,
    /// A TOML file describing the nodes and links to plan for (see --help for the format).
    /// Without it, the live cluster of the node at --url (its nodes' measured facts and
    /// links).
    #[arg(long, value_name = "FILE.toml")]
    pub cluster: Option<PathBuf>,
    #[command(flatten)]
    pub client: crate::client::ClientArgs,
    /// Context length the KV cache must hold, tokens.
    #[arg(long, default_value_t = 4096)]
    pub ctx: u32,
    /// Which placements to consider: auto, tensor, pipeline or hybrid.
    #[arg(long, default_value = "auto", value_parser = parse_strategy)]
    pub strategy: Strategy,
    /// Only these nodes (ids or names), comma separated.
    #[arg(long, value_delimiter = ',')]
    pub nodes: Option<Vec<String>>,
    /// Prompt length of the prefill prediction, tokens.
    #[arg(long, default_value_t = shoal_planner::cost::DEFAULT_PROMPT_TOKENS)]
    pub prompt_tokens: u32,
    /// How a mixture of experts' routed experts are cut across a stage's ranks: whole,
    /// sliced, or auto (whichever reads fewer bytes on the busiest rank).
    #[arg(long, default_value = "auto", value_parser = parse_experts)]
    pub expert_split: ExpertSplit,
    /// Candidates to show (0 = all).
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// An array of JSON objects on stdout, one per candidate.
    #[arg(long)]
    pub json: bool,
}

fn parse_strategy(s: &str) -> Result<Strategy, String> {
    s.parse()
}

fn parse_experts(s: &str) -> Result<ExpertSplit, String> {
    s.parse()
}

/// The cluster file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterFile {
    #[serde(default)]
    node: Vec<NodeEntry>,
    #[serde(default)]
    link: Vec<LinkEntry>,
    default_link: Option<LinkDefaults>,
    model: Option<ModelEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NodeEntry {
    name: String,
    id: Option<String>,
    memory_gb: f64,
    memory_free_gb: Option<f64>,
    #[serde(default = "cpu")]
    backend: String,
    mem_bandwidth_gbs: f64,
    compute_gflops: f64,
    #[serde(default = "one")]
    threads: u32,
    /// The GPU the node computes on: its own memory (absent: it shares the host's, as a
    /// Mac's does), its read bandwidth, and a fixed `--gpu-layers` count.
    gpu_memory_gb: Option<f64>,
    gpu_bandwidth_gbs: Option<f64>,
    gpu_compute_gflops: Option<f64>,
    gpu_layers: Option<u32>,
    /// Files of its measured costs (`shoal bench --calibrate`).
    #[serde(default)]
    calibrations: Vec<PathBuf>,
}

fn cpu() -> String {
    "cpu".into()
}

fn one() -> u32 {
    1
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LinkEntry {
    a: String,
    b: String,
    rtt_us: f64,
    bandwidth_gbps: f64,
    #[serde(default)]
    rdma: bool,
    #[serde(default)]
    sized: Vec<shoal_planner::SizedRoundTrip>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LinkDefaults {
    rtt_us: f64,
    bandwidth_gbps: f64,
    #[serde(default)]
    rdma: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelEntry {
    name: Option<String>,
    n_layers: Option<usize>,
    hidden: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    ffn: usize,
    vocab: usize,
    params_b: f64,
    embedding_gb: f64,
    head_gb: Option<f64>,
    kv_bytes_per_token_per_layer: Option<u64>,
    quant_block: Option<u32>,
    attn_quant_block: Option<u32>,
    layers: Vec<LayerGroup>,
    moe: Option<MoeEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LayerGroup {
    count: usize,
    gb: f64,
    #[serde(default)]
    experts_gb: f64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MoeEntry {
    n_experts: u32,
    active_experts: u32,
    /// Features of one routed expert (omit to hold experts only whole).
    #[serde(default)]
    expert_ffn: usize,
    /// Quantization block of the experts' down projection (default 256).
    expert_block: Option<u32>,
}

/// `gb` gigabytes as bytes, or an error naming `what`.
fn gb_bytes(gb: f64, what: &str) -> anyhow::Result<u64> {
    if !(0.0..1e9).contains(&gb) {
        bail!("{what} = {gb}: give a number of GB >= 0");
    }
    Ok((gb * GB).round() as u64)
}

impl ClusterFile {
    fn read(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading cluster file {}", path.display()))?;
        toml::from_str(&text).with_context(|| {
            format!(
                "{} is not a valid cluster file (see `shoal plan --help` for the format)",
                path.display()
            )
        })
    }

    fn cluster(&self) -> anyhow::Result<Cluster> {
        let mut nodes = Vec::with_capacity(self.node.len());
        for n in &self.node {
            let what = |field: &str| format!("node {}: {field}", n.name);
            let total = gb_bytes(n.memory_gb, &what("memory_gb"))?;
            let free = match n.memory_free_gb {
                Some(f) => gb_bytes(f, &what("memory_free_gb"))?,
                None => {
                    let reserve = (n.memory_gb * RESERVE_FRACTION).max(RESERVE_MIN_GB);
                    gb_bytes((n.memory_gb - reserve).max(0.0), &what("memory_gb"))?
                }
            };
            nodes.push(NodeSpec {
                id: n.id.clone().unwrap_or_else(|| n.name.clone()),
                name: n.name.clone(),
                memory_total_bytes: total,
                memory_free_bytes: free,
                backend: n.backend.clone(),
                mem_bandwidth_gbs: n.mem_bandwidth_gbs,
                compute_gflops: n.compute_gflops,
                threads: n.threads,
                gpu: match n.gpu_bandwidth_gbs {
                    Some(bw) => Some(shoal_planner::GpuSpec {
                        memory_bytes: n
                            .gpu_memory_gb
                            .map(|g| gb_bytes(g, &what("gpu_memory_gb")))
                            .transpose()?,
                        mem_bandwidth_gbs: bw,
                        compute_gflops: n.gpu_compute_gflops,
                        max_layers: n.gpu_layers,
                    }),
                    None if n.gpu_memory_gb.is_some()
                        || n.gpu_layers.is_some()
                        || n.gpu_compute_gflops.is_some() =>
                    {
                        anyhow::bail!(
                            "{}: gpu_memory_gb, gpu_compute_gflops and gpu_layers describe a \
                             GPU; give its gpu_bandwidth_gbs too",
                            what("gpu_bandwidth_gbs")
                        )
                    }
                    None => None,
                },
                calibrations: n
                    .calibrations
                    .iter()
                    .map(|p| crate::calibrate::read(p))
                    .collect::<anyhow::Result<_>>()
                    .with_context(|| what("calibrations"))?,
            });
        }
        let mut links: Vec<LinkSpec> = self
            .link
            .iter()
            .map(|l| LinkSpec {
                a: l.a.clone(),
                b: l.b.clone(),
                rtt_us: l.rtt_us,
                bandwidth_gbps: l.bandwidth_gbps,
                rdma: l.rdma,
                sized: l.sized.clone(),
            })
            .collect();
        if let Some(d) = &self.default_link {
            // links may name nodes by name or id; compare on the ids they resolve to
            let id_of = |key: &str| {
                nodes
                    .iter()
                    .find(|n| n.id == key || n.name == key)
                    .map(|n| n.id.clone())
                    .unwrap_or_else(|| key.to_string())
            };
            let have: BTreeSet<(String, String)> = links
                .iter()
                .map(|l| {
                    let (a, b) = (id_of(&l.a), id_of(&l.b));
                    if a < b {
                        (a, b)
                    } else {
                        (b, a)
                    }
                })
                .collect();
            for (i, a) in nodes.iter().enumerate() {
                for b in &nodes[i + 1..] {
                    let key = if a.id < b.id {
                        (a.id.clone(), b.id.clone())
                    } else {
                        (b.id.clone(), a.id.clone())
                    };
                    if !have.contains(&key) {
                        links.push(LinkSpec {
                            a: a.id.clone(),
                            b: b.id.clone(),
                            rtt_us: d.rtt_us,
                            bandwidth_gbps: d.bandwidth_gbps,
                            rdma: d.rdma,
                            sized: Vec::new(),
                        });
                    }
                }
            }
        }
        // links may name nodes by name: the planner wants ids
        for l in &mut links {
            for end in [&mut l.a, &mut l.b] {
                if let Some(n) = nodes.iter().find(|n| n.id != *end && n.name == *end) {
                    *end = n.id.clone();
                }
            }
        }
        Ok(Cluster { nodes, links })
    }
}

impl ModelEntry {
    fn profile(&self, fallback_name: &str) -> anyhow::Result<ModelProfile> {
        let name = self.name.clone().unwrap_or_else(|| fallback_name.into());
        let mut layer_bytes = Vec::new();
        let mut expert_bytes = Vec::new();
        for (i, g) in self.layers.iter().enumerate() {
            let what = |f: &str| format!("[model] layers group {}: {f}", i + 1);
            let bytes = gb_bytes(g.gb, &what("gb"))?;
            let experts = gb_bytes(g.experts_gb, &what("experts_gb"))?;
            layer_bytes.extend(std::iter::repeat_n(bytes, g.count));
            expert_bytes.extend(std::iter::repeat_n(experts, g.count));
        }
        if layer_bytes.is_empty() {
            bail!("[model] has no layers; add [[model.layers]] groups with count and gb");
        }
        if let Some(n) = self.n_layers {
            if n != layer_bytes.len() {
                bail!(
                    "[model] n_layers = {n} but the [[model.layers]] groups count {}",
                    layer_bytes.len()
                );
            }
        }
        let embedding_bytes = gb_bytes(self.embedding_gb, "[model] embedding_gb")?;
        let head_bytes = match self.head_gb {
            Some(h) => gb_bytes(h, "[model] head_gb")?,
            None => embedding_bytes,
        };
        if !(self.params_b.is_finite() && self.params_b > 0.0) {
            bail!(
                "[model] params_b = {}: give the parameter count in billions",
                self.params_b
            );
        }
        let experts = match &self.moe {
            Some(m) => Some(MoeSpec {
                n_experts: m.n_experts,
                active_experts: m.active_experts,
                expert_bytes_per_layer: expert_bytes,
                expert_ffn: m.expert_ffn,
                expert_block: m.expert_block.unwrap_or(256),
            }),
            None if expert_bytes.iter().any(|&b| b > 0) => {
                bail!("[model] layers have experts_gb but there is no [model.moe] table")
            }
            None => None,
        };
        Ok(ModelProfile {
            name,
            n_layers: layer_bytes.len(),
            hidden: self.hidden,
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            ffn: self.ffn,
            vocab: self.vocab,
            params: (self.params_b * 1e9).round() as u64,
            layer_bytes,
            embedding_bytes,
            head_bytes,
            tied_embeddings: self.head_gb.is_none(),
            kv_bytes_per_token_per_layer: self.kv_bytes_per_token_per_layer.unwrap_or(
                KvCache::bytes_per_token_per_layer(self.n_kv_heads, self.head_dim),
            ),
            quant_block: self.quant_block.unwrap_or(32),
            attn_quant_block: self.attn_quant_block,
            experts,
        })
    }
}

/// One candidate as `--json` prints it.
#[derive(Serialize)]
struct Row<'a> {
    rank: usize,
    #[serde(flatten)]
    placement: &'a Placement,
    pp: usize,
    #[serde(flatten)]
    prediction: &'a Prediction,
    fits: bool,
    problem: Option<&'a str>,
}

fn gb(bytes: u64) -> String {
    let g = bytes as f64 / GB;
    if g < 10.0 {
        format!("{g:.2}")
    } else {
        format!("{g:.1}")
    }
}

fn rate(x: f64) -> String {
    if x <= 0.0 {
        "-".into()
    } else if x < 100.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.1}")
    }
}

fn print_table(model: &ModelProfile, cluster: &Cluster, args: &PlanArgs, shown: &[Candidate]) {
    let experts = model
        .experts
        .as_ref()
        .map(|m| format!(", {} of {} experts active", m.active_experts, m.n_experts))
        .unwrap_or_default();
    println!(
        "model {}: {} layers, {} GB of weights, {} GB read per token{experts}",
        model.name,
        model.n_layers,
        gb(model.weight_bytes()),
        gb(model.bytes_per_token() as u64),
    );
    println!(
        "cluster: {} node(s), {} link(s); context {} tokens, prefill of {} tokens",
        cluster.nodes.len(),
        cluster.links.len(),
        args.ctx,
        args.prompt_tokens
    );
    println!();
    println!(
        "{:>3}  {:<8}  {:>5}  {:>9}  {:>10}  {:<26}  placement (nodes[layers])",
        "#", "strategy", "tp*pp", "decode/s", "prefill/s", "memory: tightest node"
    );
    for (i, c) in shown.iter().enumerate() {
        let p = &c.placement;
        let mem = c
            .prediction
            .tightest()
            .map(|m| match m.gpu_memory_bytes {
                Some(g) if m.gpu_bytes > 0 => format!(
                    "{} {}/{} GB, GPU {}/{}",
                    m.node,
                    gb(m.total_bytes),
                    gb(m.free_bytes),
                    gb(m.gpu_bytes),
                    gb(g)
                ),
                _ => format!("{} {}/{} GB", m.node, gb(m.total_bytes), gb(m.free_bytes)),
            })
            .unwrap_or_else(|| "-".into());
        println!(
            "{:>3}  {:<8}  {:>5}  {:>9}  {:>10}  {:<26}  {}",
            i + 1,
            p.strategy.to_string(),
            format!("{}x{}", p.tp, p.pp()),
            rate(c.prediction.decode_tok_s),
            rate(c.prediction.prefill_tok_s),
            mem,
            p.describe()
        );
        if let Some(why) = &c.problem {
            println!("{:>3}  does not fit: {why}", "");
        }
    }
}

/// Runs `shoal plan`.
pub fn run(args: PlanArgs) -> anyhow::Result<()> {
    let (cluster, model, source) = match &args.cluster {
        Some(path) => {
            let file = ClusterFile::read(path)?;
            let cluster = file
                .cluster()
                .with_context(|| format!("in {}", path.display()))?;
            let model = match &file.model {
                Some(m) => m
                    .profile(&args.model)
                    .with_context(|| format!("in {}", path.display()))?,
                None => profile_from_model(&args.model)
                    .with_context(|| format!("reading the profile of model {}", args.model))?,
            };
            (cluster, model, path.display().to_string())
        }
        None => {
            let v = crate::client::Client::new(&args.client).get("/cluster/planner")?;
            let cluster = Cluster {
                nodes: serde_json::from_value(v["nodes"].clone())
                    .context("the node's /cluster/planner answer has no valid nodes")?,
                links: serde_json::from_value(v["links"].clone())
                    .context("the node's /cluster/planner answer has no valid links")?,
            };
            let model = profile_from_model(&args.model)
                .with_context(|| format!("reading the profile of model {}", args.model))?;
            (
                cluster,
                model,
                format!("the live cluster at {}", args.client.url),
            )
        }
    };
    let req = PlanRequest {
        ctx: args.ctx,
        strategy: args.strategy,
        nodes: args.nodes.clone(),
        prompt_tokens: args.prompt_tokens,
        experts: args.expert_split,
    };
    let all = shoal_planner::candidates(&cluster, &model, &req)
        .with_context(|| format!("planning with {source}"))?;
    let shown = if args.top == 0 {
        &all[..]
    } else {
        &all[..args.top.min(all.len())]
    };
    if args.json {
        let rows: Vec<Row<'_>> = shown
            .iter()
            .enumerate()
            .map(|(i, c)| Row {
                rank: i + 1,
                placement: &c.placement,
                pp: c.placement.pp(),
                prediction: &c.prediction,
                fits: c.fits(),
                problem: c.problem.as_deref(),
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        print_table(&model, &cluster, &args, shown);
    }
    let best = shoal_planner::best(&all, &model.name)?;
    if !args.json {
        let p = &best.placement;
        println!();
        println!(
            "best: {} {}x{} over {} node(s), {} decode tok/s, {} prefill tok/s ({} of {} \
             candidates shown)",
            p.strategy,
            p.tp,
            p.pp(),
            p.world(),
            rate(best.prediction.decode_tok_s),
            rate(best.prediction.prefill_tok_s),
            shown.len(),
            all.len()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"
        [[node]]
        name = "a"
        memory_gb = 16
        mem_bandwidth_gbs = 20
        compute_gflops = 100

        [[node]]
        name = "b"
        id = "node-b"
        memory_gb = 16
        memory_free_gb = 12
        mem_bandwidth_gbs = 20
        compute_gflops = 100

        [[node]]
        name = "c"
        memory_gb = 8
        mem_bandwidth_gbs = 20
        compute_gflops = 100

        [[link]]
        a = "a"
        b = "b"
        rtt_us = 10
        bandwidth_gbps = 100

        [default_link]
        rtt_us = 100
        bandwidth_gbps = 10
    "#;

    #[test]
    fn cluster_file_reads_with_defaults() {
        let f: ClusterFile = toml::from_str(FILE).unwrap();
        let c = f.cluster().unwrap();
        c.validate().unwrap();
        assert_eq!(c.nodes[0].memory_free_bytes, 14_400_000_000);
        assert_eq!(c.nodes[1].id, "node-b");
        assert_eq!(c.nodes[2].memory_free_bytes, 7_000_000_000);
        assert_eq!(c.links.len(), 3);
        assert_eq!(c.link("a", "node-b").unwrap().rtt_us, 10.0);
        assert_eq!(c.link("node-b", "c").unwrap().rtt_us, 100.0);
    }

    #[test]
    fn unknown_fields_are_refused() {
        let e = toml::from_str::<ClusterFile>("[[node]]\nname = \"a\"\nmemory = 3\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("memory"), "{e}");
    }

    #[test]
    fn example_clusters_plan() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/clusters");
        for name in ["mac-studios.toml", "mac-studios-tcp.toml"] {
            let f = ClusterFile::read(&dir.join(name)).unwrap();
            let c = f.cluster().unwrap();
            let m = f.model.as_ref().unwrap().profile("x").unwrap();
            let best = shoal_planner::plan(&c, &m, &PlanRequest::default()).unwrap();
            assert!(best.prediction.decode_tok_s > 0.0, "{name}");
        }
        let f = ClusterFile::read(&dir.join("loopback.toml")).unwrap();
        assert!(f.model.is_none());
        f.cluster().unwrap().validate().unwrap();
    }
}
