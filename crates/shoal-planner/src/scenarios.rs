//! Whole-planner tests: the properties every placement must have (proptest over random
//! clusters and models) and the scenarios the planner exists for (a fast link picks tensor
//! parallelism, a slow one a pipeline or one node, a model too big for one node is split,
//! four Mac Studios with RDMA beat the same with TCP).

use proptest::prelude::*;
use proptest::strategy::Strategy as _;

use crate::split::{part, tensor_split, ExpertSplit};
use crate::testing::{deepseek_v3_q4, dense_model, link, mac_studios, mesh, node};
use crate::{
    best, candidates, evaluate, plan, Candidate, Cluster, ModelProfile, PlanError, PlanRequest,
    SplitKind, Strategy,
};

fn req(ctx: u32) -> PlanRequest {
    PlanRequest {
        ctx,
        ..PlanRequest::default()
    }
}

/// A 7 GB model of 32 layers (Llama-8B-like shape at ~Q6).
fn model_7gb() -> ModelProfile {
    let mut m = dense_model(32, 32, 8, 128, 14_336, 210_000_000);
    m.vocab = 128_256;
    m.embedding_bytes = 300_000_000;
    m.head_bytes = 300_000_000;
    m
}

#[test]
fn one_node_cluster_gives_the_one_node_plan() {
    let c = Cluster {
        nodes: vec![node("solo", 16.0, 20.0)],
        links: vec![],
    };
    let best = plan(&c, &model_7gb(), &req(4096)).unwrap();
    assert_eq!(best.placement.strategy, SplitKind::Single);
    assert_eq!(best.placement.rank_nodes(), vec!["solo"]);
    assert_eq!(best.placement.stages[0].layers, 0..32);
    assert!(best.prediction.decode_tok_s > 0.0);
}

#[test]
fn a_model_too_big_for_one_node_is_split() {
    let c = mesh(vec![node("a", 5.0, 20.0), node("b", 5.0, 20.0)], 60.0, 10.0);
    let all = candidates(&c, &model_7gb(), &req(4096)).unwrap();
    let best = best(&all, "m").unwrap();
    assert_eq!(best.placement.world(), 2);
    // the one-node candidates are listed, infeasible, with the reason
    let single = all
        .iter()
        .find(|c| c.placement.world() == 1)
        .expect("one-node candidates are listed");
    let why = single.problem.as_deref().unwrap();
    assert!(why.contains("needs") && why.contains("GB free"), "{why}");
}

#[test]
fn a_fast_link_prefers_tensor_and_a_slow_one_pipeline() {
    // GPU-class nodes (200 GB/s): a 2 ms link costs more than halving the reads saves
    let nodes = || vec![node("a", 5.0, 200.0), node("b", 5.0, 200.0)];
    let fast = plan(&mesh(nodes(), 20.0, 100.0), &model_7gb(), &req(4096)).unwrap();
    assert_eq!(fast.placement.strategy, SplitKind::Tensor, "{fast:?}");
    let slow = plan(&mesh(nodes(), 3000.0, 1.0), &model_7gb(), &req(4096)).unwrap();
    assert_eq!(slow.placement.strategy, SplitKind::Pipeline, "{slow:?}");
    assert!(fast.prediction.decode_tok_s > slow.prediction.decode_tok_s);
}

#[test]
fn a_slow_link_loses_to_one_node() {
    // the model fits one node; tensor parallelism over a 2 ms link costs more than it saves
    let nodes = vec![node("a", 16.0, 200.0), node("b", 16.0, 200.0)];
    let best = plan(&mesh(nodes.clone(), 2000.0, 1.0), &model_7gb(), &req(4096)).unwrap();
    assert_eq!(best.placement.world(), 1);
    // and over a fast link two nodes win
    let best = plan(&mesh(nodes, 10.0, 100.0), &model_7gb(), &req(4096)).unwrap();
    assert_eq!(best.placement.strategy, SplitKind::Tensor);
}

#[test]
fn fast_islands_make_a_hybrid() {
    // two pairs of fast-linked nodes, slow between the pairs; the model needs all four
    let names = ["a", "b", "c", "d"];
    let nodes = names.iter().map(|n| node(n, 2.8, 200.0)).collect();
    let mut links = Vec::new();
    for (i, a) in names.iter().enumerate() {
        for b in &names[i + 1..] {
            let island = (*a < "c") == (*b < "c");
            links.push(if island {
                link(a, b, 10.0, 100.0)
            } else {
                link(a, b, 2000.0, 1.0)
            });
        }
    }
    let best = plan(&Cluster { nodes, links }, &model_7gb(), &req(2048)).unwrap();
    assert_eq!(best.placement.strategy, SplitKind::Hybrid, "{best:?}");
    let mut stage0 = best.placement.stages[0].nodes.clone();
    stage0.sort();
    assert!(stage0 == ["a", "b"] || stage0 == ["c", "d"], "{stage0:?}");
}

#[test]
fn the_strategy_hint_filters() {
    let c = mesh(
        (0..4).map(|i| node(&format!("n{i}"), 16.0, 20.0)).collect(),
        50.0,
        10.0,
    );
    let m = model_7gb();
    type Admits = fn(usize, usize) -> bool;
    let kinds: [(Strategy, Admits); 3] = [
        (Strategy::Tensor, |_, pp| pp == 1),
        (Strategy::Pipeline, |tp, _| tp == 1),
        (Strategy::Hybrid, |tp, pp| tp > 1 && pp > 1),
    ];
    for (s, ok) in kinds {
        let r = PlanRequest {
            strategy: s,
            ..req(4096)
        };
        let all = candidates(&c, &m, &r).unwrap();
        assert!(!all.is_empty());
        assert!(
            all.iter().all(|c| ok(c.placement.tp, c.placement.pp())),
            "{s}"
        );
    }
    let two = mesh(
        vec![node("a", 16.0, 20.0), node("b", 16.0, 20.0)],
        50.0,
        10.0,
    );
    let r = PlanRequest {
        strategy: Strategy::Hybrid,
        ..req(4096)
    };
    assert!(matches!(
        candidates(&two, &m, &r),
        Err(PlanError::NoCandidate { .. })
    ));
}

#[test]
fn a_node_subset_limits_the_pool() {
    let c = mesh(
        vec![
            node("a", 16.0, 20.0),
            node("b", 16.0, 20.0),
            node("c", 16.0, 90.0),
        ],
        50.0,
        10.0,
    );
    let r = PlanRequest {
        nodes: Some(vec!["a".into(), "b".into()]),
        ..req(4096)
    };
    let all = candidates(&c, &model_7gb(), &r).unwrap();
    assert!(all.iter().all(|c| !c.placement.rank_nodes().contains(&"c")));
}

#[test]
fn fits_nowhere_names_the_shortfall() {
    let c = mesh(vec![node("a", 2.0, 20.0), node("b", 2.0, 20.0)], 50.0, 10.0);
    let e = plan(&c, &model_7gb(), &req(4096)).unwrap_err();
    let PlanError::FitsNowhere { closest, .. } = &e else {
        panic!("{e}")
    };
    assert!(
        closest.contains("GB short") && closest.contains("has 2.00 GB free"),
        "{e}"
    );
}

#[test]
fn a_missing_link_makes_a_placement_infeasible() {
    let c = Cluster {
        nodes: vec![node("a", 5.0, 20.0), node("b", 5.0, 20.0)],
        links: vec![],
    };
    let e = plan(&c, &model_7gb(), &req(4096)).unwrap_err().to_string();
    assert!(e.contains("no link between a and b"), "{e}");
    let all = candidates(&c, &model_7gb(), &req(4096)).unwrap();
    let two = all.iter().find(|c| c.placement.world() == 2).unwrap();
    assert_eq!(two.prediction.decode_tok_s, 0.0);
}

#[test]
fn three_ranks_split_fourteen_heads_unevenly() {
    // qwen2.5-0.5B's shape: 14 heads over 3 ranks is 5, 4, 5
    let mut m = dense_model(24, 14, 2, 64, 4864, 15_000_000);
    m.quant_block = 256;
    m.attn_quant_block = Some(32);
    let c = mesh(
        (0..3).map(|i| node(&format!("n{i}"), 0.7, 20.0)).collect(),
        30.0,
        20.0,
    );
    let r = PlanRequest {
        strategy: Strategy::Tensor,
        ..req(1024)
    };
    let all = candidates(&c, &m, &r).unwrap();
    let tp3 = all.iter().find(|c| c.placement.tp == 3).unwrap();
    assert!(tp3.fits(), "{tp3:?}");
    let heads: Vec<usize> = tensor_split(&m, 3, ExpertSplit::Auto)
        .unwrap()
        .iter()
        .map(|s| s.heads.len())
        .collect();
    assert_eq!(heads, vec![5, 4, 5]);
}

#[test]
fn larger_clusters_are_planned_greedily() {
    // 9 nodes (beyond exhaustive search), one slower; the 7 GB model needs at least 5
    let mut nodes: Vec<_> = (0..9).map(|i| node(&format!("n{i}"), 1.8, 100.0)).collect();
    nodes[4].mem_bandwidth_gbs = 10.0;
    let c = mesh(nodes, 20.0, 100.0);
    let all = candidates(&c, &model_7gb(), &req(1024)).unwrap();
    let best = best(&all, "m").unwrap();
    assert!(best.placement.world() >= 5, "{best:?}");
    // the slow node stays out
    assert!(!best.placement.rank_nodes().contains(&"n4"), "{best:?}");
}

#[test]
fn mac_studios_place_a_671b_moe_and_rdma_beats_tcp() {
    let m = deepseek_v3_q4();
    assert!((370e9..390e9).contains(&(m.weight_bytes() as f64)));
    let r = req(32_768);
    let rdma = plan(&mac_studios(50.0, true), &m, &r).unwrap();
    let tcp = plan(&mac_studios(300.0, false), &m, &r).unwrap();
    assert!(
        rdma.prediction.decode_tok_s > tcp.prediction.decode_tok_s,
        "rdma {rdma:?}\ntcp {tcp:?}"
    );
    // with RDMA all four Macs work together; one Mac alone is slower
    assert_eq!(rdma.placement.world(), 4, "{rdma:?}");
    let one = candidates(&mac_studios(50.0, true), &m, &r)
        .unwrap()
        .into_iter()
        .find(|c| c.placement.world() == 1)
        .unwrap();
    assert!(one.fits());
    assert!(rdma.prediction.decode_tok_s > 1.5 * one.prediction.decode_tok_s);
    // tensor-parallel decode reads about a quarter of the active bytes per Mac, and all of
    // the KV latent (replicated) at half the context
    let kv = 0.5 * 32_768.0 * 61.0 * m.kv_bytes_per_token_per_layer as f64;
    let read = m.bytes_per_token() / 4.0 + kv;
    let per_token_ms = read / (800e9 * crate::cost::MEM_EFFICIENCY) * 1e3;
    assert!(rdma.prediction.decode_compute_ms < 1.2 * per_token_ms);
}

#[test]
fn evaluate_checks_the_placement() {
    let c = mesh(
        vec![node("a", 16.0, 20.0), node("b", 16.0, 20.0)],
        50.0,
        10.0,
    );
    let m = model_7gb();
    let best = plan(&c, &m, &req(4096)).unwrap();
    let again = evaluate(&c, &m, &req(4096), &best.placement).unwrap();
    assert_eq!(again.prediction, best.prediction);
    let mut gap = best.placement.clone();
    gap.stages[0].layers.end -= 1;
    assert!(evaluate(&c, &m, &req(4096), &gap).is_err());
    let mut twice = best.placement.clone();
    twice.stages[0].nodes = vec!["a".into(); twice.tp];
    assert!(evaluate(&c, &m, &req(4096), &twice).is_err() || twice.tp == 1);
}

/// Weight bytes of the placement's ranks that the model does not have once: the KV
/// projections every rank of a stage holds beyond its share, and a tied head held again by
/// the last stage.
fn replicated_bytes(m: &ModelProfile, c: &Candidate) -> u64 {
    let p = &c.placement;
    let shares = tensor_split(m, p.tp, p.experts).unwrap();
    let mut extra = 0;
    for s in &p.stages {
        for l in s.layers.clone() {
            let kv = m.layer_parts(l).attn_kv;
            let held: u64 = shares
                .iter()
                .map(|r| part(kv, &r.kv_heads, m.n_kv_heads))
                .sum();
            extra += held - kv;
        }
    }
    if m.tied_embeddings && p.pp() > 1 {
        extra += m.embedding_bytes;
    }
    extra
}

fn arb_model() -> impl proptest::strategy::Strategy<Value = ModelProfile> {
    (
        1usize..14,
        prop::sample::select(vec![(4usize, 1usize), (8, 2), (14, 2), (16, 16), (6, 3)]),
        prop::sample::select(vec![256usize, 1000, 4864]),
        10_000_000u64..900_000_000,
        any::<bool>(),
        prop::sample::select(vec![32u32, 256]),
    )
        .prop_map(|(n, (h, kv), ffn, bytes, tied, block)| {
            let mut m = dense_model(n, h, kv, 64, ffn, bytes);
            m.quant_block = block;
            if !tied {
                m.tied_embeddings = false;
                m.head_bytes = bytes / 2 + 1;
            }
            m
        })
}

fn arb_cluster() -> impl proptest::strategy::Strategy<Value = Cluster> {
    (
        prop::collection::vec((0.5f64..12.0, 5.0f64..200.0), 1..5),
        prop::collection::vec((5.0f64..3000.0, 0.5f64..200.0, 0u8..10), 6),
    )
        .prop_map(|(nodes, links)| {
            let nodes: Vec<_> = nodes
                .iter()
                .enumerate()
                .map(|(i, &(gb, bw))| node(&format!("n{i}"), gb, bw))
                .collect();
            let mut out = Vec::new();
            let mut k = 0;
            for i in 0..nodes.len() {
                for j in i + 1..nodes.len() {
                    let (rtt, gbps, missing) = links[k % links.len()];
                    k += 1;
                    if missing > 0 {
                        out.push(link(&nodes[i].id, &nodes[j].id, rtt, gbps));
                    }
                }
            }
            Cluster { nodes, links: out }
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn every_placement_is_well_formed(c in arb_cluster(), m in arb_model(), ctx in 1u32..16_384) {
        let all = candidates(&c, &m, &req(ctx)).unwrap();
        prop_assert!(!all.is_empty());
        for cand in &all {
            let p = &cand.placement;
            // ranks are distinct nodes, stages of equal width
            let nodes = p.rank_nodes();
            let mut uniq = nodes.clone();
            uniq.sort();
            uniq.dedup();
            prop_assert_eq!(uniq.len(), nodes.len());
            prop_assert!(p.stages.iter().all(|s| s.nodes.len() == p.tp));
            prop_assert_eq!(p.strategy, SplitKind::of(p.tp, p.pp()));
            if !cand.fits() {
                continue;
            }
            // layers covered exactly once, in order
            let mut next = 0;
            for s in &p.stages {
                prop_assert_eq!(s.layers.start, next);
                prop_assert!(s.layers.end > s.layers.start);
                next = s.layers.end;
            }
            prop_assert_eq!(next, m.n_layers);
            // memory adds up: the model's bytes once, plus what is replicated
            let pred = &cand.prediction;
            prop_assert_eq!(pred.memory.len(), p.world());
            let weights: u64 = pred.memory.iter().map(|n| n.weight_bytes).sum();
            prop_assert_eq!(weights, m.weight_bytes() + replicated_bytes(&m, cand));
            let kv: u64 = pred.memory.iter().map(|n| n.kv_bytes).sum();
            let kv_once = u64::from(ctx) * m.n_layers as u64 * m.kv_bytes_per_token_per_layer;
            let kv_held: usize = tensor_split(&m, p.tp, p.experts).unwrap().iter().map(|r| r.kv_heads.len()).sum();
            if kv_held == m.n_kv_heads {
                prop_assert_eq!(kv, kv_once);
            } else {
                prop_assert!(kv >= kv_once);
            }
            for n in &pred.memory {
                prop_assert_eq!(n.total_bytes, n.weight_bytes + n.kv_bytes + n.overhead_bytes);
                prop_assert!(n.total_bytes <= n.free_bytes);
            }
            prop_assert!(pred.decode_tok_s > 0.0 && pred.prefill_tok_s > 0.0);
            prop_assert!(pred.pipelined_decode_tok_s >= pred.decode_tok_s * (1.0 - 1e-9));
        }
        // ranked: feasible before infeasible, decode descending among feasible
        let feasible: Vec<_> = all.iter().take_while(|c| c.fits()).collect();
        prop_assert!(all[feasible.len()..].iter().all(|c| !c.fits()));
        for w in feasible.windows(2) {
            prop_assert!(w[0].prediction.decode_tok_s >= w[1].prediction.decode_tok_s - 1e-6);
        }
    }

    #[test]
    fn decode_is_monotone_in_bandwidth(
        c in arb_cluster(),
        m in arb_model(),
        which in 0usize..4,
        factor in 1.0f64..4.0,
    ) {
        let r = req(2048);
        let Ok(before) = plan(&c, &m, &r) else { return Ok(()) };
        // a node's memory gets faster
        let mut faster = c.clone();
        let i = which % faster.nodes.len();
        faster.nodes[i].mem_bandwidth_gbs *= factor;
        let after = plan(&faster, &m, &r).unwrap();
        prop_assert!(
            after.prediction.decode_tok_s >= before.prediction.decode_tok_s * (1.0 - 1e-6),
            "{} -> {}", before.prediction.decode_tok_s, after.prediction.decode_tok_s
        );
        // every link gets faster
        let mut quicker = c.clone();
        for l in &mut quicker.links {
            l.bandwidth_gbps *= factor;
            l.rtt_us /= factor;
        }
        let after = plan(&quicker, &m, &r).unwrap();
        prop_assert!(after.prediction.decode_tok_s >= before.prediction.decode_tok_s * (1.0 - 1e-6));
        // and the same placement, on the faster node, predicts at least as much
        let same = evaluate(&faster, &m, &r, &before.placement).unwrap();
        prop_assert!(same.prediction.decode_tok_s >= before.prediction.decode_tok_s * (1.0 - 1e-9));
        prop_assert!(same.prediction.prefill_tok_s >= before.prediction.prefill_tok_s * (1.0 - 1e-9));
    }
}
