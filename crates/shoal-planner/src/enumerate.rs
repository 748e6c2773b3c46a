//! Candidate placements, evaluated and ranked. For every subset of nodes considered, every
//! factorisation of its size `k = tp x pp` that the strategy hint admits, and every order of
//! the nodes into stages considered, the layers are split ([`crate::layers`]) and the
//! placement predicted ([`crate::cost`]); infeasible ones say why.
//!
//! Which subsets and orders: with at most [`EXHAUSTIVE_NODES`] nodes, every subset and every
//! assignment of a subset's nodes to stages (the order inside a stage does not change the
//! cost model's answer, so nodes keep cluster order there). With more, for each size `k` the
//! `k` nodes with the most bandwidth, the most free memory and the best product of the two,
//! and the whole pool; each ordered exhaustively when `k <= EXHAUSTIVE_NODES`, else greedily:
//! stages grown around the fastest free node from the nodes with the quickest links to it.
//!
//! Ranking: placements that fit first, by predicted decode tokens/s (ties: fewer nodes, then
//! prefill); then the rest, those short only of memory first, by shortfall. Placements that
//! predict the same on the same shape (identical machines in another order) are listed once.

use std::collections::HashSet;

use crate::cost::{Evaluator, Stage, TpTable};
use crate::layers::{ranges, split_layers};
use crate::placement::{Candidate, Placement, Prediction, SplitKind, StagePlacement};
use crate::spec::{Cluster, ModelProfile, PlanRequest, Strategy};
use crate::PlanError;

/// Up to this many nodes, every subset and every order into stages is tried.
pub const EXHAUSTIVE_NODES: usize = 6;

const GB: f64 = 1e9;

/// Every candidate placement for `model` on `cluster`, best first (see the module doc).
///
/// # Errors
/// When the cluster, model or request is invalid, the node subset names an unknown node, or
/// the strategy hint admits no split of the nodes at hand. A model that fits nowhere is not
/// an error here: its candidates come back infeasible ([`best`] turns that into one).
pub fn candidates(
    cluster: &Cluster,
    model: &ModelProfile,
    req: &PlanRequest,
) -> Result<Vec<Candidate>, PlanError> {
    cluster.validate()?;
    model.validate()?;
    req.validate()?;
    let pool = pool(cluster, req)?;
    let ev = Evaluator::new(cluster, model, req, pool.len());
    let mut out = Vec::new();
    for subset in subsets(cluster, &pool) {
        let k = subset.len();
        for tp in (1..=k).filter(|tp| k % tp == 0) {
            let pp = k / tp;
            if !req.strategy.admits(tp, pp) {
                continue;
            }
            for stages in orders(&ev, &subset, tp, pp) {
                out.push(evaluate_stages(&ev, tp, stages, None));
            }
        }
    }
    if out.is_empty() {
        return Err(PlanError::NoCandidate {
            strategy: req.strategy.to_string(),
            nodes: pool.len(),
            why: match req.strategy {
                Strategy::Hybrid => {
                    "hybrid needs at least 4 nodes (2 stages of 2); use tensor or pipeline".into()
                }
                _ => "no split of the nodes at hand".into(),
            },
        });
    }
    rank(&mut out);
    Ok(out)
}

/// The first candidate if it fits.
///
/// # Errors
/// [`PlanError::FitsNowhere`] naming the closest candidate and what it lacks.
pub fn best<'c>(candidates: &'c [Candidate], model: &str) -> Result<&'c Candidate, PlanError> {
    if let Some(c) = candidates.first().filter(|c| c.fits()) {
        return Ok(c);
    }
    // one that has room but lacks a link (or a finer cut) is closer than one short of memory
    let has_room = candidates
        .iter()
        .find(|c| !c.prediction.memory.is_empty() && c.prediction.shortfall_bytes() == 0);
    let memory_short = candidates
        .iter()
        .filter(|c| c.prediction.shortfall_bytes() > 0)
        .min_by_key(|c| c.prediction.shortfall_bytes());
    let closest = match (has_room, memory_short, candidates.first()) {
        (Some(c), _, _) => format!(
            "{} {} has the memory but cannot run: {}",
            c.placement.strategy,
            c.placement.describe(),
            c.problem.as_deref().unwrap_or("")
        ),
        (None, Some(c), _) => format!(
            "the closest placement, {} {}, is {:.1} GB short ({}); add memory or nodes, or \
             lower --ctx",
            c.placement.strategy,
            c.placement.describe(),
            c.prediction.shortfall_bytes() as f64 / GB,
            c.problem.as_deref().unwrap_or("")
        ),
        (None, None, Some(c)) => format!(
            "every placement is infeasible, e.g. {} {}: {}",
            c.placement.strategy,
            c.placement.describe(),
            c.problem.as_deref().unwrap_or("")
        ),
        (None, None, None) => "no placement was considered".into(),
    };
    Err(PlanError::FitsNowhere {
        model: model.into(),
        closest,
    })
}

/// The fastest placement that fits.
///
/// # Errors
/// As [`candidates`] and [`best`].
pub fn plan(
    cluster: &Cluster,
    model: &ModelProfile,
    req: &PlanRequest,
) -> Result<Candidate, PlanError> {
    let all = candidates(cluster, model, req)?;
    best(&all, &model.name).cloned()
}

/// The prediction for a given placement (its own layer ranges), with the reason it cannot
/// run, if any. For checking a placement chosen elsewhere, or predictions against
/// measurements.
///
/// # Errors
/// When the inputs are invalid or the placement is malformed: unknown or repeated nodes,
/// stages of unequal width, layer ranges that do not cover the model once in order.
pub fn evaluate(
    cluster: &Cluster,
    model: &ModelProfile,
    req: &PlanRequest,
    placement: &Placement,
) -> Result<Candidate, PlanError> {
    cluster.validate()?;
    model.validate()?;
    req.validate()?;
    let bad = |problem: String| PlanError::BadRequest {
        problem: format!("placement {}: {problem}", placement.describe()),
    };
    let tp = placement.tp;
    if tp == 0 || placement.stages.is_empty() {
        return Err(bad("no ranks".into()));
    }
    let mut seen = HashSet::new();
    let mut stages = Vec::new();
    let mut next = 0;
    for s in &placement.stages {
        if s.nodes.len() != tp {
            return Err(bad(format!(
                "a stage of {} nodes in a placement of tp {tp}",
                s.nodes.len()
            )));
        }
        if s.layers.start != next || s.layers.end <= s.layers.start {
            return Err(bad(format!(
                "layers {:?} do not follow on from layer {next}",
                s.layers
            )));
        }
        next = s.layers.end;
        let mut ids = Vec::new();
        for id in &s.nodes {
            let i = cluster.find(id).ok_or_else(|| PlanError::UnknownNode {
                id: id.clone(),
                known: known(cluster),
            })?;
            if !seen.insert(i) {
                return Err(bad(format!("node {id} holds two ranks")));
            }
            ids.push(i);
        }
        stages.push(ids);
    }
    if next != model.n_layers {
        return Err(bad(format!(
            "layers end at {next}, the model has {}",
            model.n_layers
        )));
    }
    let ev = Evaluator::new(cluster, model, req, tp);
    Ok(evaluate_stages(
        &ev,
        tp,
        stages,
        Some(placement.stage_sizes()),
    ))
}

fn known(cluster: &Cluster) -> String {
    cluster
        .nodes
        .iter()
        .map(|n| n.id.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The nodes the request allows, as cluster indices.
fn pool(cluster: &Cluster, req: &PlanRequest) -> Result<Vec<usize>, PlanError> {
    let Some(names) = &req.nodes else {
        return Ok((0..cluster.nodes.len()).collect());
    };
    let mut pool = Vec::new();
    for name in names {
        let i = cluster.find(name).ok_or_else(|| PlanError::UnknownNode {
            id: name.clone(),
            known: known(cluster),
        })?;
        if !pool.contains(&i) {
            pool.push(i);
        }
    }
    if pool.is_empty() {
        return Err(PlanError::NoNodes);
    }
    pool.sort_unstable();
    Ok(pool)
}

/// The node subsets to try (each in cluster order).
fn subsets(cluster: &Cluster, pool: &[usize]) -> Vec<Vec<usize>> {
    let n = pool.len();
    if n <= EXHAUSTIVE_NODES {
        return (1u32..1 << n)
            .map(|mask| {
                (0..n)
                    .filter(|b| mask & (1 << b) != 0)
                    .map(|b| pool[b])
                    .collect()
            })
            .collect();
    }
    let node = |i: usize| &cluster.nodes[i];
    let by = |key: &dyn Fn(usize) -> f64| {
        let mut v = pool.to_vec();
        v.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
        v
    };
    let orders = [
        by(&|i| node(i).mem_bandwidth_gbs),
        by(&|i| node(i).memory_free_bytes as f64),
        by(&|i| node(i).mem_bandwidth_gbs * node(i).memory_free_bytes as f64),
    ];
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for k in 1..=n {
        for o in &orders {
            let mut s = o[..k].to_vec();
            s.sort_unstable();
            if seen.insert(s.clone()) {
                out.push(s);
            }
        }
    }
    out
}

/// The orders of `subset` into `pp` stages of `tp` nodes to try.
fn orders(ev: &Evaluator<'_>, subset: &[usize], tp: usize, pp: usize) -> Vec<Vec<Vec<usize>>> {
    if subset.len() <= EXHAUSTIVE_NODES {
        let mut out = Vec::new();
        partitions(subset.to_vec(), tp, &mut Vec::new(), &mut out);
        return out;
    }
    let nodes = &ev.cluster.nodes;
    let mut fast = subset.to_vec();
    fast.sort_by(|&a, &b| {
        nodes[b]
            .mem_bandwidth_gbs
            .total_cmp(&nodes[a].mem_bandwidth_gbs)
    });
    let mut roomy = subset.to_vec();
    roomy.sort_by_key(|&i| std::cmp::Reverse(nodes[i].memory_free_bytes));
    let mut out: Vec<Vec<Vec<usize>>> = Vec::new();
    for seeds in [fast, roomy] {
        let g = greedy(ev, seeds, tp);
        if g.len() == pp && !out.contains(&g) {
            out.push(g);
        }
    }
    out
}

/// Ordered partitions of `left` into groups of `tp` (each group in the given order).
fn partitions(
    left: Vec<usize>,
    tp: usize,
    prefix: &mut Vec<Vec<usize>>,
    out: &mut Vec<Vec<Vec<usize>>>,
) {
    if left.is_empty() {
        out.push(prefix.clone());
        return;
    }
    let mut pick = Vec::with_capacity(tp);
    combinations(&left, tp, 0, &mut pick, &mut |group| {
        let rest: Vec<usize> = left
            .iter()
            .copied()
            .filter(|x| !group.contains(x))
            .collect();
        prefix.push(group.to_vec());
        partitions(rest, tp, prefix, out);
        prefix.pop();
    });
}

fn combinations(
    from: &[usize],
    k: usize,
    start: usize,
    pick: &mut Vec<usize>,
    f: &mut dyn FnMut(&[usize]),
) {
    if pick.len() == k {
        f(pick);
        return;
    }
    for i in start..from.len() {
        if from.len() - i < k - pick.len() {
            break;
        }
        pick.push(from[i]);
        combinations(from, k, i + 1, pick, f);
        pick.pop();
    }
}

/// Stages grown around the first free node of `seeds`, each from the free nodes whose
/// slowest link to the stage is quickest.
fn greedy(ev: &Evaluator<'_>, seeds: Vec<usize>, tp: usize) -> Vec<Vec<usize>> {
    let mut left = seeds;
    let mut stages = Vec::new();
    while !left.is_empty() {
        let mut group = vec![left.remove(0)];
        while group.len() < tp && !left.is_empty() {
            let worst = |c: usize| {
                group
                    .iter()
                    .map(|&g| ev.msg(g, c, 0.0).unwrap_or(f64::INFINITY))
                    .fold(0.0, f64::max)
            };
            let (j, _) = left
                .iter()
                .enumerate()
                .min_by(|a, b| worst(*a.1).total_cmp(&worst(*b.1)))
                .expect("left is not empty");
            group.push(left.remove(j));
        }
        stages.push(group);
    }
    stages
}

/// Evaluates `stages` (cluster indices) with the given layer counts, or the best split.
fn evaluate_stages(
    ev: &Evaluator<'_>,
    tp: usize,
    stages: Vec<Vec<usize>>,
    sizes: Option<Vec<usize>>,
) -> Candidate {
    let pp = stages.len();
    let n = ev.model.n_layers;
    let ids = |s: &[usize]| -> Vec<String> {
        s.iter().map(|&i| ev.cluster.nodes[i].id.clone()).collect()
    };
    let experts = crate::split::split_of(ev.model, tp, ev.req.experts).unwrap_or_default();
    let placement = |sizes: &[usize]| Placement {
        strategy: SplitKind::of(tp, pp),
        tp,
        experts,
        stages: stages
            .iter()
            .zip(ranges(sizes))
            .map(|(s, layers)| StagePlacement {
                layers,
                nodes: ids(s),
            })
            .collect(),
    };
    let even = || -> Vec<usize> { (0..pp).map(|i| n / pp + usize::from(i < n % pp)).collect() };
    let unrunnable = |sizes: Vec<usize>, problem: String| Candidate {
        placement: placement(&sizes),
        prediction: Prediction {
            decode_tok_s: 0.0,
            pipelined_decode_tok_s: 0.0,
            prefill_tok_s: 0.0,
            prompt_tokens: ev.req.prompt_tokens,
            decode_compute_ms: 0.0,
            decode_comm_ms: 0.0,
            calibrated: false,
            memory: Vec::new(),
        },
        problem: Some(problem),
    };
    if pp > n {
        return unrunnable(
            vec![1; pp],
            format!("pp {pp} exceeds the model's {n} layers"),
        );
    }
    let t: &TpTable = match ev.table(tp) {
        Ok(t) => t,
        Err(e) => return unrunnable(sizes.unwrap_or_else(even), e),
    };
    let stage = |s: usize, a: usize, b: usize| Stage {
        nodes: &stages[s],
        layers: (a, b),
        first: s == 0,
        last: s + 1 == pp,
    };
    let time = |s: usize, a: usize, b: usize| {
        let (c, r) = ev.stage_decode(t, stage(s, a, b));
        c + r
    };
    let sizes = sizes.unwrap_or_else(|| {
        split_layers(n, pp, time, |s, a, b| ev.stage_fits(t, stage(s, a, b)))
            .or_else(|| split_layers(n, pp, time, |_, _, _| true))
            .unwrap_or_else(even)
    });
    let prediction = ev.predict(t, &stages, &ranges(&sizes));
    let mut problems: Vec<String> = prediction
        .memory
        .iter()
        .filter(|m| !m.fits())
        .map(|m| {
            format!(
                "node {} needs {:.2} GB, has {:.2} GB free",
                m.node,
                m.total_bytes as f64 / GB,
                m.free_bytes as f64 / GB
            )
        })
        .collect();
    problems.extend(ev.missing_links(&stages).into_iter().map(|(a, b)| {
        format!(
            "no link between {} and {} (a live cluster measures a new node's links within seconds of it joining; retry then)",
            ev.cluster.nodes[a].id, ev.cluster.nodes[b].id
        )
    }));
    Candidate {
        placement: placement(&sizes),
        prediction,
        problem: (!problems.is_empty()).then(|| problems.join("; ")),
    }
}

/// Sorts best first and drops repeats (same shape and the same predictions).
fn rank(all: &mut Vec<Candidate>) {
    let q = |x: f64| (x * 1e6).round();
    // infeasible: short of memory only, then the rest
    let kind = |c: &Candidate| {
        if c.fits() {
            0
        } else if !c.prediction.memory.is_empty() && c.prediction.decode_tok_s > 0.0 {
            1
        } else {
            2
        }
    };
    all.sort_by(|a, b| {
        let (ka, kb) = (kind(a), kind(b));
        ka.cmp(&kb).then_with(|| {
            let (pa, pb) = (&a.prediction, &b.prediction);
            let (na, nb) = (a.placement.world(), b.placement.world());
            if ka == 0 {
                q(pb.decode_tok_s)
                    .total_cmp(&q(pa.decode_tok_s))
                    .then(na.cmp(&nb))
                    .then(q(pb.prefill_tok_s).total_cmp(&q(pa.prefill_tok_s)))
            } else {
                pa.shortfall_bytes()
                    .cmp(&pb.shortfall_bytes())
                    .then(na.cmp(&nb))
                    .then(q(pb.decode_tok_s).total_cmp(&q(pa.decode_tok_s)))
            }
        })
    });
    let mut seen = HashSet::new();
    all.retain(|c| {
        let p = &c.prediction;
        let mut mem: Vec<(u64, u64)> = p
            .memory
            .iter()
            .map(|m| (m.total_bytes, m.free_bytes))
            .collect();
        mem.sort_unstable();
        let key = format!(
            "{}|{}|{:?}|{:.6e}|{:.6e}|{mem:?}|{}",
            kind(c),
            c.placement.tp,
            c.placement.stage_sizes(),
            p.decode_tok_s,
            p.prefill_tok_s,
            if p.memory.is_empty() {
                c.problem.clone().unwrap_or_default()
            } else {
                String::new()
            }
        );
        seen.insert(key)
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{dense_model, link, node};

    #[test]
    fn partitions_count_and_cover() {
        let mut out = Vec::new();
        partitions(vec![0, 1, 2, 3], 2, &mut Vec::new(), &mut out);
        assert_eq!(out.len(), 6); // 4! / (2! 2!)
        let mut out = Vec::new();
        partitions(vec![0, 1, 2], 1, &mut Vec::new(), &mut out);
        assert_eq!(out.len(), 6);
    }

    #[test]
    fn subset_of_unknown_node_is_an_error() {
        let c = Cluster {
            nodes: vec![node("a", 8.0, 10.0)],
            links: vec![],
        };
        let req = PlanRequest {
            nodes: Some(vec!["b".into()]),
            ..PlanRequest::default()
        };
        let e = candidates(&c, &dense_model(4, 8, 8, 64, 2048, 1000), &req).unwrap_err();
        assert_eq!(
            e,
            PlanError::UnknownNode {
                id: "b".into(),
                known: "a".into()
            }
        );
    }

    #[test]
    fn greedy_orders_keep_fast_islands_together() {
        // 8 nodes: a fast island a..d, another e..h, slow between islands
        let names = ["a", "b", "c", "d", "e", "f", "g", "h"];
        let nodes = names.iter().map(|n| node(n, 8.0, 10.0)).collect();
        let mut links = Vec::new();
        for (i, a) in names.iter().enumerate() {
            for b in &names[i + 1..] {
                let same = (*a < "e") == (*b < "e");
                links.push(link(a, b, if same { 10.0 } else { 1000.0 }, 10.0));
            }
        }
        let c = Cluster { nodes, links };
        let m = dense_model(4, 8, 8, 64, 2048, 1000);
        let req = PlanRequest::default();
        let ev = Evaluator::new(&c, &m, &req, 8);
        let g = greedy(&ev, (0..8).collect(), 4);
        assert_eq!(g, vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
    }
}
