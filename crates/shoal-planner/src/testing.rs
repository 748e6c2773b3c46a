//! Builders for the tests: nodes, links, a dense model of a given shape, the hypothetical
//! Mac Studio cluster and a DeepSeek-V3-shaped MoE.

use crate::spec::{Cluster, LinkSpec, ModelProfile, MoeSpec, NodeSpec};

/// A CPU node with `free_gb` GB free and `bw` GB/s.
pub fn node(id: &str, free_gb: f64, bw: f64) -> NodeSpec {
    let free = (free_gb * 1e9) as u64;
    NodeSpec {
        id: id.into(),
        name: id.into(),
        memory_total_bytes: free + 1_000_000_000,
        memory_free_bytes: free,
        backend: "cpu".into(),
        mem_bandwidth_gbs: bw,
        compute_gflops: 100.0,
        threads: 4,
        gpu: None,
        calibrations: Vec::new(),
    }
}

/// A link of `rtt_us` and `gbps`.
pub fn link(a: &str, b: &str, rtt_us: f64, gbps: f64) -> LinkSpec {
    LinkSpec {
        a: a.into(),
        b: b.into(),
        rtt_us,
        bandwidth_gbps: gbps,
        rdma: false,
        sized: Vec::new(),
    }
}

/// Every pair of `nodes` joined by the same link.
pub fn mesh(nodes: Vec<NodeSpec>, rtt_us: f64, gbps: f64) -> Cluster {
    let mut links = Vec::new();
    for (i, a) in nodes.iter().enumerate() {
        for b in &nodes[i + 1..] {
            links.push(link(&a.id, &b.id, rtt_us, gbps));
        }
    }
    Cluster { nodes, links }
}

/// A dense model: `n_layers` layers of `layer_bytes`, tied embedding as big as a layer,
/// 4 bits per parameter.
pub fn dense_model(
    n_layers: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    ffn: usize,
    layer_bytes: u64,
) -> ModelProfile {
    let total = layer_bytes * (n_layers as u64 + 1);
    ModelProfile {
        name: "test".into(),
        n_layers,
        hidden: n_heads * head_dim,
        n_heads,
        n_kv_heads,
        head_dim,
        ffn,
        vocab: 32_000,
        params: total * 2,
        layer_bytes: vec![layer_bytes; n_layers],
        embedding_bytes: layer_bytes,
        head_bytes: layer_bytes,
        tied_embeddings: true,
        kv_bytes_per_token_per_layer: (2 * n_kv_heads * head_dim * 4) as u64,
        quant_block: 32,
        attn_quant_block: None,
        experts: None,
    }
}

/// Four 512 GB Mac Studios (M3 Ultra: ~800 GB/s) on a Thunderbolt 5 mesh (80 Gbit/s) of
/// round trip `rtt_us` (RDMA ~50, TCP ~300).
pub fn mac_studios(rtt_us: f64, rdma: bool) -> Cluster {
    let nodes = (1..=4)
        .map(|i| NodeSpec {
            id: format!("studio-{i}"),
            name: format!("studio-{i}"),
            memory_total_bytes: 512_000_000_000,
            memory_free_bytes: 480_000_000_000,
            backend: "metal".into(),
            mem_bandwidth_gbs: 800.0,
            compute_gflops: 25_000.0,
            threads: 32,
            gpu: None,
            calibrations: Vec::new(),
        })
        .collect();
    let mut c = mesh(nodes, rtt_us, 80.0);
    for l in &mut c.links {
        l.rdma = rdma;
    }
    c
}

/// DeepSeek V3's shape at about 4.5 bits per weight (~378 GB): 61 layers, the first 3
/// dense, 58 with 256 routed experts (8 active) and a shared one; MLA's KV latent is one
/// shared "KV head" of 576 values.
pub fn deepseek_v3_q4() -> ModelProfile {
    let n = 61;
    let dense_layer = 328_000_000u64;
    let moe_dense = 130_000_000u64;
    let experts = 6_342_000_000u64;
    let layer_bytes = (0..n)
        .map(|l| {
            if l < 3 {
                dense_layer
            } else {
                moe_dense + experts
            }
        })
        .collect();
    let expert_bytes = (0..n).map(|l| if l < 3 { 0 } else { experts }).collect();
    ModelProfile {
        name: "deepseek-v3-671b-q4".into(),
        n_layers: n,
        hidden: 7168,
        n_heads: 128,
        n_kv_heads: 1,
        head_dim: 128,
        ffn: 18_432,
        vocab: 129_280,
        params: 671_000_000_000,
        layer_bytes,
        embedding_bytes: 521_000_000,
        head_bytes: 760_000_000,
        tied_embeddings: false,
        kv_bytes_per_token_per_layer: 576 * 4,
        quant_block: 256,
        attn_quant_block: None,
        experts: Some(MoeSpec {
            n_experts: 256,
            active_experts: 8,
            expert_bytes_per_layer: expert_bytes,
            expert_ffn: 2048,
            expert_block: 256,
        }),
    }
}
