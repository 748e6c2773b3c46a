//! The driver's decisions, apart from acting on them: which nodes an instance lost, which
//! state each instance moves to from its nodes' rank reports, which unloaded instances can
//! be forgotten, which drain must be refused, which ranks this node must start and stop, and
//! how much memory the instances hold. Pure functions of the table, the reports and the
//! planner's view of the cluster: no sockets, threads or clocks (`now_ms` is passed in), so
//! each rule is unit-tested here, and the loop (`tick.rs`) and the request handlers
//! (`control.rs`) only gather their inputs and carry out what they return.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use shoal_cluster::instances::{Instance, InstanceState, InstanceTable};
use shoal_cluster::node::NodeInfo;
use shoal_planner::{Cluster, ModelProfile, PlanRequest};

use crate::report::{RankReport, RankState};

/// A rank of an instance: (instance id, rank).
pub type RankKey = (String, usize);

/// Every live node's rank reports: node id -> instance id -> report.
pub type NodeReports = HashMap<String, BTreeMap<String, RankReport>>;

/// Whether an instance in `state` holds ranks (and memory) on its nodes.
pub fn is_running(state: &InstanceState) -> bool {
    matches!(
        state,
        InstanceState::Placing | InstanceState::Loading | InstanceState::Ready
    )
}

// ------------------------------------------------------------------ membership

/// The nodes some instance of `table` is placed on that are not among `live`, sorted.
pub fn lost_nodes(table: &InstanceTable, live: &[String]) -> Vec<String> {
    table
        .instances
        .values()
        .flat_map(|i| i.nodes())
        .filter(|n| !live.iter().any(|l| l == n))
        .map(str::to_string)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect()
}

/// The nodes that failed ranks of the current placements name as lost (their session to
/// it broke) and that membership still counts alive, sorted: each one of the instance's
/// own nodes, named by another of them.
pub fn suspects(table: &InstanceTable, reports: &NodeReports, live: &[String]) -> Vec<String> {
    let mut out = BTreeSet::new();
    for inst in table.instances.values() {
        if inst.state == InstanceState::Unloading {
            continue;
        }
        let nodes = inst.nodes();
        for n in &nodes {
            let Some(s) = current_report(reports, inst, n)
                .filter(|r| r.state == RankState::Failed)
                .and_then(|r| r.suspect.as_deref())
            else {
                continue;
            };
            if s != *n && nodes.contains(&s) && live.iter().any(|l| l == s) {
                out.insert(s.to_string());
            }
        }
    }
    out.into_iter().collect()
}

/// The ids of the instances placed on any of `nodes`.
pub fn instances_on<'a>(table: &'a InstanceTable, nodes: &[String]) -> Vec<&'a str> {
    table
        .instances
        .values()
        .filter(|i| i.uses_any(nodes))
        .map(|i| i.id.as_str())
        .collect()
}

/// The instances of `after` that `before` lacks or had at another generation (re-placed).
pub fn replaced<'a>(before: &InstanceTable, after: &'a InstanceTable) -> Vec<&'a Instance> {
    after
        .instances
        .values()
        .filter(|i| before.get(&i.id).map(|o| o.generation) != Some(i.generation))
        .collect()
}

/// The failed instances, tried again when the membership changes.
pub fn failed(table: &InstanceTable) -> Vec<String> {
    table
        .instances
        .values()
        .filter(|i| matches!(i.state, InstanceState::Failed { .. }))
        .map(|i| i.id.clone())
        .collect()
}

/// The drained nodes that left the cluster (one that comes back is a fresh member).
pub fn departed_drained(table: &InstanceTable, live: &[String]) -> Vec<String> {
    table
        .drained
        .iter()
        .filter(|n| !live.contains(n))
        .cloned()
        .collect()
}

/// The instances a drain would fail (running or placing in `before`, failed in `after`),
/// as `id: reason`: the drain is refused rather than strand them.
pub fn stranded(before: &InstanceTable, after: &InstanceTable) -> Vec<String> {
    after
        .instances
        .values()
        .filter_map(|i| match (&i.state, before.get(&i.id).map(|o| &o.state)) {
            (InstanceState::Failed { reason }, Some(was))
                if !matches!(was, InstanceState::Failed { .. }) =>
            {
                Some(format!("{}: {reason}", i.id))
            }
            _ => None,
        })
        .collect()
}

// ------------------------------------------------------------------ following reports

/// What node `node` reports about the current generation of `inst` (reports about an
/// older generation are stale and count as none).
pub fn current_report<'a>(
    reports: &'a NodeReports,
    inst: &Instance,
    node: &str,
) -> Option<&'a RankReport> {
    reports
        .get(node)
        .and_then(|r| r.get(&inst.id))
        .filter(|r| r.generation == inst.generation)
}

/// The state the reports of `inst`'s nodes (only those of its placement, only about its
/// generation) put it in: `Failed` with the first failing node's detail when one failed,
/// `Ready` when every node is ready, `Loading` when any reported, `None` while none has.
pub fn target_state(inst: &Instance, reports: &NodeReports) -> Option<InstanceState> {
    let nodes = inst.nodes();
    let failed = nodes.iter().find_map(|n| {
        current_report(reports, inst, n)
            .filter(|r| r.state == RankState::Failed)
            .map(|r| {
                format!(
                    "node {n}: {}",
                    r.detail.clone().unwrap_or_else(|| "failed".into())
                )
            })
    });
    if let Some(reason) = failed {
        Some(InstanceState::Failed { reason })
    } else if nodes
        .iter()
        .all(|n| current_report(reports, inst, n).is_some_and(|r| r.state == RankState::Ready))
    {
        Some(InstanceState::Ready)
    } else if nodes
        .iter()
        .any(|n| current_report(reports, inst, n).is_some())
    {
        Some(InstanceState::Loading)
    } else {
        None
    }
}

/// The instances (placing, loading or ready) a rank of which failed for want of disk room
/// on its node, by id, with each such node and its report's detail.
pub fn out_of_room(
    table: &InstanceTable,
    reports: &NodeReports,
) -> Vec<(String, Vec<(String, String)>)> {
    table
        .instances
        .values()
        .filter(|i| {
            matches!(
                i.state,
                InstanceState::Placing | InstanceState::Loading | InstanceState::Ready
            )
        })
        .filter_map(|i| {
            let nodes: Vec<(String, String)> = i
                .nodes()
                .into_iter()
                .filter_map(|n| {
                    current_report(reports, i, n)
                        .filter(|r| r.state == RankState::Failed && r.no_room)
                        .map(|r| (n.to_string(), r.detail.clone().unwrap_or_default()))
                })
                .collect();
            (!nodes.is_empty()).then(|| (i.id.clone(), nodes))
        })
        .collect()
}

/// The states to report, in order, to move an instance from `from` to `to`: a placing
/// instance whose nodes are all ready already passes through `Loading` first.
pub fn steps(from: &InstanceState, to: InstanceState) -> Vec<InstanceState> {
    if to == InstanceState::Ready && *from == InstanceState::Placing {
        vec![InstanceState::Loading, InstanceState::Ready]
    } else {
        vec![to]
    }
}

/// Whether an unloading instance can be forgotten: no live node reports a rank of it, of
/// any generation.
pub fn may_forget(id: &str, reports: &NodeReports) -> bool {
    !reports.values().any(|r| r.contains_key(id))
}

/// `table` after the coordinator `me` followed the nodes' `reports`: each placing, loading
/// or ready instance moves to its [`target_state`] (a move the table refuses, such as
/// `Ready` back to `Loading`, is left out), and each unloading instance nobody runs any more
/// is forgotten. Failed instances stay as they are.
pub fn follow_reports(
    me: &str,
    table: &InstanceTable,
    reports: &NodeReports,
    now_ms: u64,
) -> InstanceTable {
    let mut next = table.clone();
    for inst in table.instances.values() {
        match inst.state {
            InstanceState::Unloading => {
                if may_forget(&inst.id, reports) {
                    if let Ok(t) = next.forget(me, &inst.id) {
                        next = t;
                    }
                }
            }
            InstanceState::Placing | InstanceState::Loading | InstanceState::Ready => {
                let Some(target) = target_state(inst, reports) else {
                    continue;
                };
                for state in steps(&inst.state, target) {
                    match next.report(me, &inst.id, inst.generation, state, now_ms) {
                        Ok(t) => next = t,
                        Err(e) => tracing::debug!(instance = %inst.id, "report not applied: {e}"),
                    }
                }
            }
            InstanceState::Failed { .. } => {}
        }
    }
    next
}

/// Whether the coordinator's `next`, computed from `base`, replaces the table it holds now
/// (`current`): only when nothing else (a load, an unload) changed the table meanwhile and
/// `next` changed something.
pub fn supersedes(next: &InstanceTable, base: &InstanceTable, current: &InstanceTable) -> bool {
    next.version > current.version && current.version == base.version
}

// ------------------------------------------------------------------ this node's ranks

/// Every rank the table places on node `me` of the instances that run, with its instance.
pub fn wanted<'a>(table: &'a InstanceTable, me: &str) -> BTreeMap<RankKey, &'a Instance> {
    let mut want = BTreeMap::new();
    for inst in table.instances.values() {
        if !is_running(&inst.state) {
            continue;
        }
        for (rank, node) in inst.placement.rank_nodes().into_iter().enumerate() {
            if node == me {
                want.insert((inst.id.clone(), rank), inst);
            }
        }
    }
    want
}

/// What a node does to run what the table places on it.
#[derive(Clone, Debug, PartialEq)]
pub struct RankPlan {
    /// Ranks to stop: no longer placed here, of another generation, or of an instance no
    /// longer running (unloading, failed, forgotten).
    pub stop: Vec<RankKey>,
    /// Ranks to start, with the instance as the table has it.
    pub start: Vec<(RankKey, Instance)>,
    /// Instances whose report this node withdraws: no rank of the reported generation is
    /// left running here.
    pub drop_reports: Vec<String>,
}

/// The ranks node `me` must stop and start so that it runs what `table` places on it, given
/// the ranks it runs (`running`: rank -> generation) and what it reports (`reports`, by
/// instance).
pub fn plan_ranks(
    table: &InstanceTable,
    me: &str,
    running: &BTreeMap<RankKey, u64>,
    reports: &BTreeMap<String, RankReport>,
) -> RankPlan {
    let want = wanted(table, me);
    let (keep, stop): (Vec<_>, Vec<_>) = running.iter().partition(|(key, generation)| {
        want.get(*key).is_some_and(|i| i.generation == **generation)
    });
    let drop_reports = reports
        .iter()
        .filter(|(id, r)| {
            !keep
                .iter()
                .any(|((i, _), g)| i == *id && **g == r.generation)
        })
        .map(|(id, _)| id.clone())
        .collect();
    let start = want
        .into_iter()
        .filter(|(key, _)| !keep.iter().any(|(k, _)| *k == key))
        .map(|(key, inst)| (key, inst.clone()))
        .collect();
    RankPlan {
        stop: stop.into_iter().map(|(k, _)| k.clone()).collect(),
        start,
        drop_reports,
    }
}

/// Whether a rank of `generation` may set this node's report, `current` being the report
/// now: not when the report is about a newer generation (a late word from a stopped rank).
pub fn accepts_report(current: Option<&RankReport>, generation: u64) -> bool {
    current.is_none_or(|r| r.generation <= generation)
}

/// The HTTP API address of each ready instance's lead node, by instance id, among `nodes`
/// (an instance whose lead is dead or has not published its facts has none).
pub fn leads(table: &InstanceTable, nodes: &[NodeInfo]) -> HashMap<String, String> {
    table
        .instances
        .values()
        .filter(|i| i.state == InstanceState::Ready)
        .filter_map(|i| {
            let lead = i.lead()?;
            let n = nodes.iter().find(|n| n.id == lead && n.alive)?;
            Some((i.id.clone(), n.facts.as_ref()?.api.clone()))
        })
        .collect()
}

/// The HTTP API address of the rank-0 node of each placing or loading instance, by id, among
/// `nodes` (alive, with published facts): where its requests go once it serves.
pub fn placed_leads(table: &InstanceTable, nodes: &[NodeInfo]) -> HashMap<String, String> {
    table
        .instances
        .values()
        .filter(|i| matches!(i.state, InstanceState::Placing | InstanceState::Loading))
        .filter_map(|i| {
            let lead = i.lead()?;
            let n = nodes.iter().find(|n| n.id == lead && n.alive)?;
            Some((i.id.clone(), n.facts.as_ref()?.api.clone()))
        })
        .collect()
}

// ------------------------------------------------------------------ memory

/// The memory `inst` of a model of `profile` holds on each of its nodes in `cluster`, as
/// the planner predicts it (nothing when the planner cannot evaluate it).
pub fn held_by(inst: &Instance, profile: &ModelProfile, cluster: &Cluster) -> Vec<(String, u64)> {
    let req = PlanRequest {
        ctx: inst.ctx,
        strategy: inst.strategy,
        experts: inst.experts,
        ..PlanRequest::default()
    };
    // Only the live nodes' share matters, but evaluation needs every node of the
    // placement: a dead one stands in as a copy of a live one (memory per rank depends
    // on the model and the split, not on the node).
    let Some(template) = cluster.nodes.first().cloned() else {
        return Vec::new();
    };
    let mut full = cluster.clone();
    for n in inst.nodes() {
        if !full.nodes.iter().any(|x| x.id == n) {
            full.nodes.push(shoal_planner::NodeSpec {
                id: n.to_string(),
                name: n.to_string(),
                ..template.clone()
            });
        }
    }
    match shoal_planner::evaluate(&full, profile, &req, &inst.placement) {
        Ok(c) => c
            .prediction
            .memory
            .into_iter()
            .filter(|m| cluster.nodes.iter().any(|n| n.id == m.node))
            .map(|m| (m.node, m.total_bytes))
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// `cluster` with the memory the running instances `ids` hold given back to their nodes
/// (they are about to be re-placed, and their old ranks stop). `profile` gives a model's
/// profile by name; an instance without one gives nothing back.
pub fn releasing(
    table: &InstanceTable,
    ids: &[&str],
    cluster: &Cluster,
    profile: impl Fn(&str) -> Option<ModelProfile>,
) -> Cluster {
    let mut out = cluster.clone();
    for id in ids {
        let Some(inst) = table.get(id) else { continue };
        if !is_running(&inst.state) {
            continue;
        }
        let Some(p) = profile(&inst.model) else {
            continue;
        };
        for (node, bytes) in held_by(inst, &p, cluster) {
            if let Some(n) = out.nodes.iter_mut().find(|n| n.id == node) {
                n.memory_free_bytes = n.memory_free_bytes.saturating_add(bytes);
            }
        }
    }
    out
}

/// What the running instances of `table` hold on node `me`.
pub fn held_on(
    table: &InstanceTable,
    me: &str,
    cluster: &Cluster,
    profile: impl Fn(&str) -> Option<ModelProfile>,
) -> u64 {
    table
        .instances
        .values()
        .filter(|i| is_running(&i.state) && i.nodes().contains(&me))
        .filter_map(|i| Some(held_by(i, &profile(&i.model)?, cluster)))
        .flatten()
        .filter(|(n, _)| n == me)
        .map(|(_, b)| b)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_cluster::facts::NodeFacts;
    use shoal_cluster::instances::NewInstance;
    use shoal_planner::split::ExpertSplit;
    use shoal_planner::{LinkSpec, NodeSpec, Placement, SplitKind, StagePlacement, Strategy};

    const GB: u64 = 1_000_000_000;

    /// An instance at `generation` in `state` placed as `stages` (each stage's nodes, in
    /// rank order).
    fn inst(id: &str, generation: u64, state: InstanceState, stages: &[&[&str]]) -> Instance {
        let tp = stages[0].len();
        Instance {
            id: id.into(),
            model: "m".into(),
            model_sha256: Some("5ha".into()),
            ctx: 512,
            strategy: Strategy::Auto,
            experts: ExpertSplit::default(),
            placement: Placement {
                strategy: SplitKind::of(tp, stages.len()),
                tp,
                stages: stages
                    .iter()
                    .enumerate()
                    .map(|(k, nodes)| StagePlacement {
                        layers: k * 8..(k + 1) * 8,
                        nodes: nodes.iter().map(|n| n.to_string()).collect(),
                    })
                    .collect(),
                experts: ExpertSplit::default(),
            },
            state,
            generation,
            updated_ms: 0,
            history: Vec::new(),
        }
    }

    fn table(instances: Vec<Instance>) -> InstanceTable {
        InstanceTable {
            version: 7,
            coordinator: "a".into(),
            instances: instances.into_iter().map(|i| (i.id.clone(), i)).collect(),
            drained: Default::default(),
        }
    }

    /// Reports as (node, instance, generation, state, detail).
    fn reports(list: &[(&str, &str, u64, RankState, Option<&str>)]) -> NodeReports {
        let mut out = NodeReports::new();
        for (node, id, generation, state, detail) in list {
            out.entry(node.to_string()).or_default().insert(
                id.to_string(),
                RankReport::new(*generation, *state, detail.map(str::to_string)),
            );
        }
        out
    }

    fn live(ids: &[&str]) -> Vec<String> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    use InstanceState::{Loading, Placing, Ready, Unloading};
    use RankState::{Failed as RFailed, Loading as RLoading, Ready as RReady};

    fn fails(reason: &str) -> InstanceState {
        InstanceState::Failed {
            reason: reason.into(),
        }
    }

    // ---------------------------------------------------------------- target_state

    #[test]
    fn every_node_ready_makes_the_instance_ready() {
        let i = inst("x", 2, Loading, &[&["a"], &["b", "c"]]);
        let r = reports(&[
            ("a", "x", 2, RReady, None),
            ("b", "x", 2, RReady, None),
            ("c", "x", 2, RReady, None),
        ]);
        assert_eq!(target_state(&i, &r), Some(Ready));
    }

    #[test]
    fn one_failed_node_fails_the_instance_with_its_detail() {
        let i = inst("x", 2, Ready, &[&["a"], &["b"]]);
        let r = reports(&[
            ("a", "x", 2, RReady, None),
            ("b", "x", 2, RFailed, Some("out of memory")),
        ]);
        assert_eq!(target_state(&i, &r), Some(fails("node b: out of memory")));
        // without a detail the reason still names the node
        let r = reports(&[("a", "x", 2, RFailed, None), ("b", "x", 2, RReady, None)]);
        assert_eq!(target_state(&i, &r), Some(fails("node a: failed")));
    }

    #[test]
    fn the_first_failed_node_in_rank_order_gives_the_reason() {
        let i = inst("x", 1, Loading, &[&["b"], &["a"]]);
        let r = reports(&[
            ("a", "x", 1, RFailed, Some("second")),
            ("b", "x", 1, RFailed, Some("first")),
        ]);
        assert_eq!(target_state(&i, &r), Some(fails("node b: first")));
    }

    #[test]
    fn a_failure_outweighs_ranks_still_loading() {
        let i = inst("x", 1, Loading, &[&["a"], &["b"]]);
        let r = reports(&[
            ("a", "x", 1, RLoading, Some("fetched 3/9 chunks")),
            ("b", "x", 1, RFailed, Some("no mesh")),
        ]);
        assert_eq!(target_state(&i, &r), Some(fails("node b: no mesh")));
    }

    #[test]
    fn some_nodes_reporting_makes_it_loading_and_none_leaves_it() {
        let i = inst("x", 1, Placing, &[&["a"], &["b"]]);
        let r = reports(&[("a", "x", 1, RReady, None)]);
        assert_eq!(target_state(&i, &r), Some(Loading));
        let r = reports(&[("a", "x", 1, RReady, None), ("b", "x", 1, RLoading, None)]);
        assert_eq!(target_state(&i, &r), Some(Loading));
        assert_eq!(target_state(&i, &NodeReports::new()), None);
        // reports about another instance are not about this one
        let r = reports(&[("a", "y", 1, RReady, None), ("b", "y", 1, RReady, None)]);
        assert_eq!(target_state(&i, &r), None);
    }

    #[test]
    fn reports_of_an_older_generation_are_ignored() {
        let i = inst("x", 3, Loading, &[&["a"], &["b"]]);
        // a failure of the old placement does not fail the new one
        let r = reports(&[
            ("a", "x", 2, RFailed, Some("old")),
            ("b", "x", 3, RReady, None),
        ]);
        assert_eq!(target_state(&i, &r), Some(Loading));
        // old ready reports do not make it ready
        let r = reports(&[("a", "x", 2, RReady, None), ("b", "x", 2, RReady, None)]);
        assert_eq!(target_state(&i, &r), None);
    }

    #[test]
    fn a_node_outside_the_placement_is_ignored() {
        let i = inst("x", 1, Loading, &[&["a", "b"]]);
        let r = reports(&[
            ("a", "x", 1, RReady, None),
            ("b", "x", 1, RReady, None),
            ("z", "x", 1, RFailed, Some("left over from before")),
        ]);
        assert_eq!(target_state(&i, &r), Some(Ready));
        let r = reports(&[("z", "x", 1, RReady, None)]);
        assert_eq!(target_state(&i, &r), None);
    }

    #[test]
    fn instances_out_of_room_are_those_a_current_rank_failed_for_want_of_disk() {
        let mut r = reports(&[
            ("b", "x", 2, RankState::Failed, Some("disk full")),
            ("a", "x", 2, RankState::Ready, None),
            ("c", "y", 1, RankState::Failed, Some("disk full")),
            ("d", "z", 1, RankState::Failed, Some("out of memory")),
        ]);
        for (node, id) in [("b", "x"), ("c", "y")] {
            let report = r.get_mut(node).unwrap().get_mut(id).unwrap();
            *report = report.clone().for_want_of_room(true);
        }
        let t = table(vec![
            inst("x", 2, InstanceState::Loading, &[&["a", "b"]]),
            // an older generation's report does not count
            inst("y", 2, InstanceState::Placing, &[&["c"]]),
            // a failure for another reason does not count
            inst("z", 1, InstanceState::Loading, &[&["d"]]),
        ]);
        assert_eq!(
            out_of_room(&t, &r),
            vec![(
                "x".to_string(),
                vec![("b".to_string(), "disk full".to_string())]
            )]
        );
        // a failed instance is left as it is
        let failed = table(vec![inst("x", 2, fails("disk full"), &[&["a", "b"]])]);
        assert!(out_of_room(&failed, &r).is_empty());
    }

    #[test]
    fn a_placing_instance_passes_through_loading() {
        assert_eq!(steps(&Placing, Ready), vec![Loading, Ready]);
        assert_eq!(steps(&Loading, Ready), vec![Ready]);
        assert_eq!(steps(&Placing, Loading), vec![Loading]);
        assert_eq!(steps(&Placing, fails("x")), vec![fails("x")]);
    }

    // ---------------------------------------------------------------- follow_reports

    #[test]
    fn following_reports_moves_a_placing_instance_to_ready() {
        let t = table(vec![inst("x", 1, Placing, &[&["a"], &["b"]])]);
        let r = reports(&[("a", "x", 1, RReady, None), ("b", "x", 1, RReady, None)]);
        let next = follow_reports("a", &t, &r, 1234);
        let x = next.get("x").unwrap();
        assert_eq!(x.state, Ready);
        assert_eq!(x.updated_ms, 1234);
        // two writes: placing -> loading -> ready
        assert_eq!(next.version, t.version + 2);
        assert_eq!(next.coordinator, "a");
    }

    #[test]
    fn following_reports_fails_a_ready_instance() {
        let t = table(vec![inst("x", 4, Ready, &[&["a"], &["b"]])]);
        let r = reports(&[
            ("a", "x", 4, RReady, None),
            ("b", "x", 4, RFailed, Some("the scheduler stopped")),
        ]);
        let next = follow_reports("a", &t, &r, 5);
        assert_eq!(
            next.get("x").unwrap().state,
            fails("node b: the scheduler stopped")
        );
    }

    #[test]
    fn following_reports_keeps_a_ready_instance_whose_rank_reports_loading() {
        // ready -> loading is not a transition: nothing changes
        let t = table(vec![inst("x", 1, Ready, &[&["a"], &["b"]])]);
        let r = reports(&[("a", "x", 1, RReady, None), ("b", "x", 1, RLoading, None)]);
        let next = follow_reports("a", &t, &r, 5);
        assert_eq!(next, t);
    }

    #[test]
    fn following_no_news_changes_nothing() {
        let t = table(vec![
            inst("x", 1, Loading, &[&["a"], &["b"]]),
            inst("y", 1, fails("earlier"), &[&["a"]]),
        ]);
        let r = reports(&[("a", "x", 1, RLoading, None), ("a", "y", 1, RReady, None)]);
        let next = follow_reports("a", &t, &r, 5);
        assert_eq!(
            next, t,
            "loading stays loading, a failed instance stays failed"
        );
    }

    #[test]
    fn an_unloaded_instance_is_forgotten_only_once_no_node_reports_it() {
        let t = table(vec![inst("x", 2, Unloading, &[&["a"], &["b"]])]);
        // any node, any generation still running it keeps it
        for r in [
            reports(&[("b", "x", 2, RReady, None)]),
            reports(&[("c", "x", 1, RFailed, None)]),
        ] {
            assert!(!may_forget("x", &r));
            assert_eq!(follow_reports("a", &t, &r, 5), t);
        }
        let r = reports(&[("a", "y", 1, RReady, None)]);
        assert!(may_forget("x", &r));
        let next = follow_reports("a", &t, &r, 5);
        assert!(next.get("x").is_none());
        assert_eq!(next.version, t.version + 1);
    }

    #[test]
    fn each_instance_follows_its_own_reports() {
        let t = table(vec![
            inst("x", 1, Loading, &[&["a"]]),
            inst("y", 1, Loading, &[&["b"]]),
            inst("z", 1, Unloading, &[&["c"]]),
        ]);
        let r = reports(&[
            ("a", "x", 1, RReady, None),
            ("b", "y", 1, RFailed, Some("bad file")),
        ]);
        let next = follow_reports("a", &t, &r, 5);
        assert_eq!(next.get("x").unwrap().state, Ready);
        assert_eq!(next.get("y").unwrap().state, fails("node b: bad file"));
        assert!(next.get("z").is_none());
    }

    #[test]
    fn a_table_changed_meanwhile_is_not_overwritten() {
        let base = table(vec![]);
        let mut next = base.clone();
        next.version += 1;
        assert!(supersedes(&next, &base, &base));
        // nothing changed: nothing to write
        assert!(!supersedes(&base, &base, &base));
        // a load landed while the coordinator computed `next`
        let mut current = base.clone();
        current.version += 1;
        assert!(!supersedes(&next, &base, &current));
    }

    // ---------------------------------------------------------------- membership

    #[test]
    fn lost_nodes_are_the_placed_nodes_not_alive() {
        let t = table(vec![
            inst("x", 1, Ready, &[&["a"], &["c"]]),
            inst("y", 1, Unloading, &[&["d", "c"]]),
            inst("z", 1, Ready, &[&["b"]]),
        ]);
        assert_eq!(lost_nodes(&t, &live(&["a", "b"])), live(&["c", "d"]));
        assert!(lost_nodes(&t, &live(&["a", "b", "c", "d"])).is_empty());
        assert_eq!(instances_on(&t, &live(&["c"])), vec!["x", "y"]);
        assert_eq!(instances_on(&t, &live(&["b"])), vec!["z"]);
        assert!(instances_on(&t, &live(&["q"])).is_empty());
    }

    #[test]
    fn suspects_are_live_nodes_of_the_instance_named_by_its_failed_ranks() {
        let t = table(vec![
            inst("x", 2, fails("link broke"), &[&["a", "b"]]),
            inst("y", 1, Ready, &[&["c", "d"]]),
            inst("z", 1, Unloading, &[&["e", "f"]]),
        ]);
        let suspecting = |node: &str, id: &str, generation: u64, s: &str| {
            (
                node.to_string(),
                [(
                    id.to_string(),
                    RankReport::new(generation, RFailed, Some("broke".into()))
                        .suspecting(Some(s.into())),
                )]
                .into_iter()
                .collect::<BTreeMap<_, _>>(),
            )
        };
        let all = live(&["a", "b", "c", "d", "e", "f"]);
        let r: NodeReports = [suspecting("a", "x", 2, "b")].into_iter().collect();
        assert_eq!(suspects(&t, &r, &all), live(&["b"]));
        // already declared dead: lost_nodes has it
        assert!(suspects(&t, &r, &live(&["a", "c", "d"])).is_empty());
        // an older placement's report, a node outside the instance, a rank naming itself,
        // a node the report's instance does not use, an instance being unloaded: nothing
        for r in [
            suspecting("a", "x", 1, "b"),
            suspecting("c", "x", 2, "b"),
            suspecting("a", "x", 2, "a"),
            suspecting("a", "x", 2, "c"),
            suspecting("e", "z", 1, "f"),
        ] {
            let r: NodeReports = [r].into_iter().collect();
            assert!(suspects(&t, &r, &all).is_empty(), "{r:?}");
        }
        // a failed report without a suspect names nobody
        let r = reports(&[("a", "x", 2, RFailed, Some("out of memory"))]);
        assert!(suspects(&t, &r, &all).is_empty());
    }

    #[test]
    fn replaced_instances_are_new_or_of_another_generation() {
        let before = table(vec![
            inst("x", 1, Ready, &[&["a"]]),
            inst("y", 1, Ready, &[&["b"]]),
        ]);
        let after = table(vec![
            inst("x", 1, Ready, &[&["a"]]),
            inst("y", 2, Placing, &[&["c"]]),
            inst("n", 1, Placing, &[&["a"]]),
        ]);
        let ids: Vec<&str> = replaced(&before, &after)
            .iter()
            .map(|i| i.id.as_str())
            .collect();
        assert_eq!(ids, vec!["n", "y"]);
    }

    #[test]
    fn failed_and_departed_drained() {
        let mut t = table(vec![
            inst("x", 1, fails("no room"), &[&["a"]]),
            inst("y", 1, Ready, &[&["b"]]),
        ]);
        assert_eq!(super::failed(&t), vec!["x".to_string()]);
        t.drained = ["b".to_string(), "d".to_string()].into_iter().collect();
        assert_eq!(departed_drained(&t, &live(&["a", "b"])), live(&["d"]));
        assert!(departed_drained(&t, &live(&["b", "d"])).is_empty());
    }

    #[test]
    fn a_drain_that_fails_a_running_instance_is_stranded() {
        let before = table(vec![
            inst("x", 1, Ready, &[&["a"]]),
            inst("y", 1, fails("old"), &[&["a"]]),
            inst("z", 1, Ready, &[&["a"]]),
        ]);
        let after = table(vec![
            inst("x", 1, fails("fits nowhere"), &[&["a"]]),
            inst("y", 1, fails("still nowhere"), &[&["a"]]),
            inst("z", 2, Placing, &[&["b"]]),
        ]);
        assert_eq!(
            stranded(&before, &after),
            vec!["x: fits nowhere".to_string()]
        );
        assert!(stranded(&before, &before).is_empty());
    }

    // ---------------------------------------------------------------- this node's ranks

    fn running(list: &[(&str, usize, u64)]) -> BTreeMap<RankKey, u64> {
        list.iter()
            .map(|(id, r, g)| ((id.to_string(), *r), *g))
            .collect()
    }

    fn local_reports(list: &[(&str, u64)]) -> BTreeMap<String, RankReport> {
        list.iter()
            .map(|(id, g)| (id.to_string(), RankReport::new(*g, RLoading, None)))
            .collect()
    }

    fn keys(v: &[(&str, usize)]) -> Vec<RankKey> {
        v.iter().map(|(id, r)| (id.to_string(), *r)).collect()
    }

    #[test]
    fn a_node_wants_exactly_the_ranks_placed_on_it() {
        let t = table(vec![
            // a holds ranks 0 and 2 of x (tp 2 x pp 2)
            inst("x", 1, Ready, &[&["a", "b"], &["a", "c"]]),
            inst("y", 1, Loading, &[&["b"], &["a"]]),
            inst("z", 1, Placing, &[&["c"]]),
            inst("u", 1, Unloading, &[&["a"]]),
            inst("f", 1, fails("x"), &[&["a"]]),
        ]);
        let want: Vec<RankKey> = wanted(&t, "a").into_keys().collect();
        assert_eq!(want, keys(&[("x", 0), ("x", 2), ("y", 1)]));
        let plan = plan_ranks(&t, "a", &BTreeMap::new(), &BTreeMap::new());
        let start: Vec<RankKey> = plan.start.iter().map(|(k, _)| k.clone()).collect();
        assert_eq!(start, want);
        assert_eq!(plan.start[2].1.id, "y");
        assert!(plan.stop.is_empty());
        assert!(plan.drop_reports.is_empty());
    }

    #[test]
    fn running_ranks_of_the_current_generation_are_kept() {
        let t = table(vec![inst("x", 3, Ready, &[&["a"], &["b"]])]);
        let plan = plan_ranks(
            &t,
            "a",
            &running(&[("x", 0, 3)]),
            &local_reports(&[("x", 3)]),
        );
        assert_eq!(
            plan,
            RankPlan {
                stop: vec![],
                start: vec![],
                drop_reports: vec![],
            }
        );
    }

    #[test]
    fn a_rank_of_an_older_generation_is_stopped_and_the_new_one_started() {
        // re-placed: a keeps rank 0 but at generation 4
        let t = table(vec![inst("x", 4, Placing, &[&["a"], &["c"]])]);
        let plan = plan_ranks(
            &t,
            "a",
            &running(&[("x", 0, 3)]),
            &local_reports(&[("x", 3)]),
        );
        assert_eq!(plan.stop, keys(&[("x", 0)]));
        assert_eq!(plan.start.len(), 1);
        assert_eq!(plan.start[0].0, ("x".to_string(), 0));
        assert_eq!(plan.start[0].1.generation, 4);
        // the old generation's report goes with it
        assert_eq!(plan.drop_reports, vec!["x".to_string()]);
    }

    #[test]
    fn a_rank_moved_to_another_rank_index_is_restarted() {
        let t = table(vec![inst("x", 2, Placing, &[&["b"], &["a"]])]);
        let plan = plan_ranks(&t, "a", &running(&[("x", 0, 2)]), &BTreeMap::new());
        assert_eq!(plan.stop, keys(&[("x", 0)]));
        let start: Vec<RankKey> = plan.start.iter().map(|(k, _)| k.clone()).collect();
        assert_eq!(start, keys(&[("x", 1)]));
    }

    #[test]
    fn ranks_of_unloaded_failed_forgotten_or_moved_instances_stop() {
        let t = table(vec![
            inst("u", 1, Unloading, &[&["a"]]),
            inst("f", 1, fails("oom"), &[&["a"]]),
            inst("m", 2, Placing, &[&["b"]]),
        ]);
        let plan = plan_ranks(
            &t,
            "a",
            &running(&[("u", 0, 1), ("f", 0, 1), ("m", 0, 1), ("gone", 0, 1)]),
            &local_reports(&[("u", 1), ("f", 1), ("m", 1), ("gone", 1)]),
        );
        assert_eq!(
            plan.stop,
            keys(&[("f", 0), ("gone", 0), ("m", 0), ("u", 0)])
        );
        assert!(plan.start.is_empty());
        assert_eq!(plan.drop_reports, live(&["f", "gone", "m", "u"]));
    }

    #[test]
    fn a_report_stays_while_a_rank_of_its_generation_runs_here() {
        // both ranks of x run here at its generation; no rank of y runs here any more
        let t = table(vec![inst("x", 1, Ready, &[&["a", "b"], &["a", "c"]])]);
        let plan = plan_ranks(
            &t,
            "a",
            &running(&[("x", 0, 1), ("x", 2, 1)]),
            &local_reports(&[("x", 1), ("y", 5)]),
        );
        assert!(plan.stop.is_empty());
        assert_eq!(plan.drop_reports, vec!["y".to_string()]);
    }

    #[test]
    fn a_late_report_of_an_older_generation_is_refused() {
        let now = RankReport::new(4, RLoading, None);
        assert!(accepts_report(None, 1));
        assert!(accepts_report(Some(&now), 4));
        assert!(accepts_report(Some(&now), 5));
        assert!(!accepts_report(Some(&now), 3));
    }

    // ---------------------------------------------------------------- leads

    fn node_info(id: &str, alive: bool, api: Option<&str>) -> NodeInfo {
        NodeInfo {
            id: id.into(),
            name: format!("name-{id}"),
            alive,
            is_self: false,
            coordinator: false,
            facts: api.map(|api| NodeFacts {
                name: format!("name-{id}"),
                api: api.into(),
                listen: "127.0.0.1:1".into(),
                memory_total_bytes: 0,
                memory_free_bytes: 0,
                backend: "cpu".into(),
                threads: 1,
                mem_bandwidth_gbs: 0.0,
                compute_gflops: 0.0,
                version: "0".into(),
                gpus: Vec::new(),
                gpu_layers: None,
                entry_only: false,
                protocol: 1,
                oldest_protocol: 1,
                calibrations: Vec::new(),
            }),
        }
    }

    #[test]
    fn a_ready_instance_is_led_by_its_live_rank_0_node() {
        let t = table(vec![
            inst("x", 1, Ready, &[&["a"], &["b"]]),
            inst("y", 1, Loading, &[&["a"]]),
            inst("d", 1, Ready, &[&["c"]]),
            inst("n", 1, Ready, &[&["b"]]),
        ]);
        let nodes = [
            node_info("a", true, Some("10.0.0.1:8080")),
            node_info("b", true, None),
            node_info("c", false, Some("10.0.0.3:8080")),
        ];
        let l = leads(&t, &nodes);
        assert_eq!(l.len(), 1, "{l:?}");
        assert_eq!(l["x"], "10.0.0.1:8080");
        // while placed or loading, the rank-0 node it will be served from
        let p = placed_leads(&t, &nodes);
        assert_eq!(p.len(), 1, "{p:?}");
        assert_eq!(p["y"], "10.0.0.1:8080");
    }

    // ---------------------------------------------------------------- memory

    fn spec(id: &str, free: u64) -> NodeSpec {
        NodeSpec {
            id: id.into(),
            name: id.into(),
            memory_total_bytes: free + GB,
            memory_free_bytes: free,
            backend: "cpu".into(),
            mem_bandwidth_gbs: 20.0,
            compute_gflops: 100.0,
            threads: 4,
            gpu: None,
            calibrations: Vec::new(),
        }
    }

    fn cluster(ids: &[&str], free: u64) -> Cluster {
        let nodes = ids.iter().map(|id| spec(id, free)).collect();
        let mut links = Vec::new();
        for (i, a) in ids.iter().enumerate() {
            for b in &ids[i + 1..] {
                links.push(LinkSpec {
                    a: (*a).into(),
                    b: (*b).into(),
                    rtt_us: 60.0,
                    bandwidth_gbps: 10.0,
                    rdma: false,
                    sized: Vec::new(),
                });
            }
        }
        Cluster { nodes, links }
    }

    /// A dense 16-layer model of 100 MB per layer.
    fn profile() -> ModelProfile {
        let layer = 100_000_000;
        ModelProfile {
            name: "m".into(),
            n_layers: 16,
            hidden: 2048,
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: 64,
            ffn: 8192,
            vocab: 32_000,
            params: layer * 17 * 2,
            layer_bytes: vec![layer; 16],
            embedding_bytes: layer,
            head_bytes: layer,
            tied_embeddings: true,
            kv_bytes_per_token_per_layer: 2 * 8 * 64 * 4,
            quant_block: 32,
            attn_quant_block: None,
            experts: None,
        }
    }

    /// A table with instance `x` of [`profile`] placed by the planner on `c`.
    fn placed(c: &Cluster) -> InstanceTable {
        let new = NewInstance {
            id: "x".into(),
            model: "m".into(),
            model_sha256: None,
        };
        let req = PlanRequest {
            ctx: 512,
            strategy: Strategy::Pipeline,
            ..PlanRequest::default()
        };
        InstanceTable::new()
            .load("a", new, &profile(), c, &req, 0)
            .expect("it fits")
    }

    #[test]
    fn memory_held_is_given_back_only_for_running_instances_with_a_profile() {
        // 2 GB free each: the model (1.7 GB of weights, and what each rank needs beyond
        // them) must be split
        let c = cluster(&["a", "b", "c"], 2 * GB);
        let t = placed(&c);
        let x = t.get("x").unwrap();
        let held = held_by(x, &profile(), &c);
        assert_eq!(held.len(), x.nodes().len(), "{held:?}");
        assert!(held.iter().all(|(_, b)| *b > 0));
        let some = |_: &str| Some(profile());
        let freed = releasing(&t, &["x"], &c, some);
        for n in &freed.nodes {
            let before = c.nodes.iter().find(|o| o.id == n.id).unwrap();
            let back: u64 = held
                .iter()
                .filter(|(h, _)| *h == n.id)
                .map(|(_, b)| b)
                .sum();
            assert_eq!(n.memory_free_bytes, before.memory_free_bytes + back);
        }
        // what one node's ranks hold is what it reports as held
        for (node, bytes) in &held {
            assert_eq!(held_on(&t, node, &c, some), *bytes);
        }
        // an unknown model gives nothing back, nor does an instance that is not running
        assert_eq!(releasing(&t, &["x"], &c, |_| None), c);
        let unloading = t.unload("a", "x", 1).unwrap();
        assert_eq!(releasing(&unloading, &["x"], &c, some), c);
        assert_eq!(held_on(&unloading, "a", &c, some), 0);
        // a dead node of the placement still lets the live ones be counted
        let dead = x.nodes().last().unwrap().to_string();
        let mut survivors = c.clone();
        survivors.nodes.retain(|n| n.id != dead);
        let held_live = held_by(x, &profile(), &survivors);
        assert_eq!(held_live.len(), held.len() - 1);
        assert!(held_live.iter().all(|h| held.contains(h)));
    }
}
