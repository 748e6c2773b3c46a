//! Where a model runs in a cluster. A pure function of the nodes (memory, measured bandwidth
//! and compute), the links between them (measured round trip and bandwidth), a model profile
//! (shape and stored bytes per part), a context length and a strategy hint: it enumerates
//! placements in the executor's shape (`tp` tensor-parallel ranks per stage times `pp`
//! pipeline stages, contiguous layer ranges, heads and features cut in whole quantization
//! blocks), predicts each one's decode and prefill tokens/s and memory per node with the cost
//! model of [`cost`], and picks the fastest that fits. Fewer nodes win when they are faster
//! (a slow link makes tensor parallelism over it lose to one node). No I/O, clocks or
//! threads: the live cluster and `shoal plan` both call it with data.
//!
//! ```
//! use shoal_planner::{plan, Cluster, LinkSpec, ModelProfile, NodeSpec, PlanRequest};
//!
//! let node = |id: &str| NodeSpec {
//!     id: id.into(),
//!     name: id.into(),
//!     memory_total_bytes: 16_000_000_000,
//!     memory_free_bytes: 12_000_000_000,
//!     backend: "cpu".into(),
//!     mem_bandwidth_gbs: 20.0,
//!     compute_gflops: 200.0,
//!     threads: 8,
//!     gpu: None,
//!     calibrations: Vec::new(),
//! };
//! let cluster = Cluster {
//!     nodes: vec![node("a"), node("b")],
//!     links: vec![LinkSpec { a: "a".into(), b: "b".into(), rtt_us: 60.0,
//!                            bandwidth_gbps: 10.0, rdma: false, sized: vec![] }],
//! };
//! let model = ModelProfile {
//!     name: "example-1b".into(),
//!     n_layers: 16, hidden: 2048, n_heads: 32, n_kv_heads: 8, head_dim: 64, ffn: 8192,
//!     vocab: 128_256, params: 1_240_000_000,
//!     layer_bytes: vec![34_000_000; 16],
//!     embedding_bytes: 140_000_000, head_bytes: 140_000_000, tied_embeddings: true,
//!     kv_bytes_per_token_per_layer: 2 * 8 * 64 * 4,
//!     quant_block: 32, attn_quant_block: None, experts: None,
//! };
//! let best = plan(&cluster, &model, &PlanRequest::default()).unwrap();
//! println!("{} {}: {:.1} tok/s", best.placement.strategy, best.placement.describe(),
//!          best.prediction.decode_tok_s);
//! ```

pub mod calibration;
pub mod cost;
mod enumerate;
mod error;
pub mod gpu;
pub mod layers;
mod placement;
mod spec;
pub mod split;

#[cfg(test)]
mod scenarios;
#[cfg(test)]
mod testing;

pub use calibration::{Calibration, DecodeTimes, LayerCost, PrefillTimes};
pub use enumerate::{best, candidates, evaluate, plan, EXHAUSTIVE_NODES};
pub use error::PlanError;
pub use gpu::GpuSpec;
pub use placement::{Candidate, NodeMemory, Placement, Prediction, SplitKind, StagePlacement};
pub use spec::{
    Cluster, LayerParts, LinkSpec, ModelProfile, MoeSpec, NodeSpec, PlanRequest, SizedRoundTrip,
    Strategy,
};
