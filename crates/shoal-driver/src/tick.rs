//! The loop every node runs a few times a second: adopt the newest instance table and
//! publish it again (replicate), on the coordinator move the table along (re-place the
//! instances of dead nodes, follow the rank reports, forget unloaded instances), start and
//! stop this node's ranks to match the table (reconcile), and publish what this node's ranks
//! report and which lead serves each ready instance.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use shoal_cluster::instances::{is_coordinator, Instance, InstanceState, InstanceTable};

use crate::rank::LocalRank;
use crate::report::RankState;
use crate::{is_running, now_ms, Driver, RankReport, RANKS_KEY, TABLE_KEY, TICK};

impl Driver {
    /// Tells the node what this node's instances hold, so its published free memory under
    /// `--max-memory` leaves it out.
    async fn publish_held(&self, table: &InstanceTable) {
        let cluster = self.cluster().await;
        let me = self.node.id();
        let held: u64 = table
            .instances
            .values()
            .filter(|i| is_running(&i.state) && i.nodes().contains(&me))
            .flat_map(|i| self.held_by(i, &cluster))
            .filter(|(n, _)| n == me)
            .map(|(_, b)| b)
            .sum();
        self.node.set_memory_held(held).await;
    }

    // ---------------------------------------------------------------- the loop

    pub(crate) async fn run(self: Arc<Self>) {
        self.publish_files().await;
        let mut published_table = String::new();
        let mut published_reports = String::new();
        let mut members = Vec::new();
        let mut held_for = u64::MAX;
        loop {
            tokio::time::sleep(TICK).await;
            self.remember_profiles();
            self.adopt_newest();
            let live = self.node.live_ids();
            if is_coordinator(self.node.id(), &live) {
                self.coordinate(live != members).await;
            }
            members = live;
            let table = self.table.lock().unwrap().clone();
            let json = serde_json::to_string(&table).expect("table serializes");
            if json != published_table {
                if let Err(e) = self.node.publish(TABLE_KEY, &json).await {
                    tracing::warn!("publishing the instance table failed: {e}");
                } else {
                    published_table = json;
                }
            }
            self.reconcile(&table);
            if table.version != held_for {
                self.publish_held(&table).await;
                held_for = table.version;
            }
            let nodes = self.node.nodes().await;
            let leads = table
                .instances
                .values()
                .filter(|i| i.state == InstanceState::Ready)
                .filter_map(|i| {
                    let lead = i.lead()?;
                    let n = nodes.iter().find(|n| n.id == lead && n.alive)?;
                    Some((i.id.clone(), n.facts.as_ref()?.api.clone()))
                })
                .collect();
            *self.leads.lock().unwrap() = leads;
            let reports = serde_json::to_string(&*self.reports.lock().unwrap()).expect("reports");
            if reports != published_reports {
                if let Err(e) = self.node.publish(RANKS_KEY, &reports).await {
                    tracing::warn!("publishing rank reports failed: {e}");
                } else {
                    published_reports = reports;
                }
            }
        }
    }

    /// Adopts the newest table a live node publishes.
    fn adopt_newest(&self) {
        let seen: Vec<InstanceTable> = self
            .node
            .published(TABLE_KEY)
            .into_iter()
            .filter_map(|(_, j)| serde_json::from_str(&j).ok())
            .collect();
        let mut mine = self.table.lock().unwrap();
        let all: Vec<&InstanceTable> = seen.iter().chain(std::iter::once(&*mine)).collect();
        // the newest by the table's own rule (a tie between two writers resolves the same
        // way on every node)
        if let Some(newest) = InstanceTable::newest(all) {
            if newest != &*mine {
                *mine = newest.clone();
            }
        }
    }

    /// Every rank report of live nodes: node -> instance -> report.
    pub(crate) fn all_reports(&self) -> HashMap<String, BTreeMap<String, RankReport>> {
        self.node
            .published(RANKS_KEY)
            .into_iter()
            .filter_map(|(n, j)| serde_json::from_str(&j).ok().map(|r| (n, r)))
            .collect()
    }

    /// Keeps the profile of every model any live node offers, so that an instance can be
    /// re-placed after the only node that offered its model died.
    fn remember_profiles(&self) {
        let offered = self.offered();
        let mut p = self.profiles.lock().unwrap();
        for (_, f) in offered {
            p.entry(f.name).or_insert(f.profile);
        }
    }

    /// The coordinator's work: re-place after deaths, follow reports, forget unloaded, and
    /// when the membership changed (`changed`), try again to place failed instances.
    async fn coordinate(&self, changed: bool) {
        let me = self.node.id().to_string();
        let live = self.node.live_ids();
        let table = self.table.lock().unwrap().clone();
        let mut next = table.clone();
        let lost: Vec<String> = table
            .instances
            .values()
            .flat_map(|i| {
                i.nodes()
                    .into_iter()
                    .map(str::to_string)
                    .collect::<Vec<_>>()
            })
            .filter(|n| !live.contains(n))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        if !lost.is_empty() {
            let cluster = self.cluster().await;
            let moving: Vec<&str> = table
                .instances
                .values()
                .filter(|i| i.uses_any(&lost))
                .map(|i| i.id.as_str())
                .collect();
            let cluster = self.releasing(&table, &moving, &cluster);
            next = next.on_nodes_lost(&me, &lost, &|m| self.profile(m), &cluster, now_ms());
            for i in next.instances.values() {
                if table.get(&i.id).map(|o| o.generation) != Some(i.generation) {
                    tracing::warn!(instance = %i.id, lost = ?lost, state = %i.state, placement = %i.placement.describe(), "re-placed after losing nodes");
                }
            }
        }
        if changed {
            let failed: Vec<String> = next
                .instances
                .values()
                .filter(|i| matches!(i.state, InstanceState::Failed { .. }))
                .map(|i| i.id.clone())
                .collect();
            if !failed.is_empty() {
                let cluster = self.cluster().await;
                for id in failed {
                    let Some(profile) = next.get(&id).and_then(|i| self.profile(&i.model)) else {
                        continue;
                    };
                    match next.replace(&me, &id, &profile, &cluster, now_ms()) {
                        Ok(t) => {
                            tracing::info!(instance = %id, "re-placed a failed instance after the membership changed");
                            next = t;
                        }
                        Err(e) => tracing::debug!(instance = %id, "still cannot place: {e}"),
                    }
                }
            }
        }
        // a drained node that left may come back as a fresh member
        let left: Vec<String> = next
            .drained
            .iter()
            .filter(|n| !live.contains(n))
            .cloned()
            .collect();
        next = next.undrain(&me, &left);
        let reports = self.all_reports();
        for inst in next.instances.clone().into_values() {
            let nodes: Vec<String> = inst.nodes().into_iter().map(str::to_string).collect();
            let of = |n: &str| {
                reports
                    .get(n)
                    .and_then(|r| r.get(&inst.id))
                    .filter(|r| r.generation == inst.generation)
            };
            let now = now_ms();
            match inst.state {
                InstanceState::Unloading => {
                    let running = reports.values().any(|r| r.contains_key(&inst.id));
                    if !running {
                        if let Ok(t) = next.forget(&me, &inst.id) {
                            next = t;
                        }
                    }
                }
                InstanceState::Placing | InstanceState::Loading | InstanceState::Ready => {
                    let failed = nodes.iter().find_map(|n| {
                        of(n).filter(|r| r.state == RankState::Failed).map(|r| {
                            format!(
                                "node {n}: {}",
                                r.detail.clone().unwrap_or_else(|| "failed".into())
                            )
                        })
                    });
                    let target = if let Some(reason) = failed {
                        Some(InstanceState::Failed { reason })
                    } else if nodes
                        .iter()
                        .all(|n| of(n).is_some_and(|r| r.state == RankState::Ready))
                    {
                        Some(InstanceState::Ready)
                    } else if nodes.iter().any(|n| of(n).is_some()) {
                        Some(InstanceState::Loading)
                    } else {
                        None
                    };
                    let Some(target) = target else { continue };
                    if target == InstanceState::Ready && inst.state == InstanceState::Placing {
                        if let Ok(t) =
                            next.report(&me, &inst.id, inst.generation, InstanceState::Loading, now)
                        {
                            next = t;
                        }
                    }
                    match next.report(&me, &inst.id, inst.generation, target, now) {
                        Ok(t) => next = t,
                        Err(e) => tracing::debug!(instance = %inst.id, "report not applied: {e}"),
                    }
                }
                InstanceState::Failed { .. } => {}
            }
        }
        let mut t = self.table.lock().unwrap();
        // the table may have changed meanwhile (a load); keep the newer one
        if next.version > t.version && t.version == table.version {
            *t = next;
        }
    }

    /// Starts the ranks the table places here and stops the others.
    fn reconcile(self: &Arc<Self>, table: &InstanceTable) {
        let me = self.node.id();
        let mut want: HashMap<(String, usize), &Instance> = HashMap::new();
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
        let mut local = self.local.lock().unwrap();
        local.retain(|key, r| {
            let keep = want
                .get(key)
                .is_some_and(|i| i.generation == r.generation);
            if !keep {
                tracing::info!(instance = %key.0, rank = key.1, generation = r.generation, "stopping rank");
                r.stop("the instance was unloaded, re-placed or failed");
                if key.1 == 0 {
                    if let Some(state) = self.state.upgrade() {
                        state.remove_model(&key.0);
                    }
                }
            }
            keep
        });
        let mut reports = self.reports.lock().unwrap();
        reports.retain(|id, r| {
            local
                .iter()
                .any(|((i, _), l)| i == id && l.generation == r.generation)
        });
        for (key, inst) in want {
            if local.contains_key(&key) {
                continue;
            }
            let rank = LocalRank {
                generation: inst.generation,
                stop: Arc::new(AtomicBool::new(false)),
                mesh: Arc::new(Mutex::new(None)),
            };
            reports.insert(
                inst.id.clone(),
                RankReport {
                    generation: inst.generation,
                    state: RankState::Loading,
                    detail: None,
                },
            );
            let (stop, mesh) = (rank.stop.clone(), rank.mesh.clone());
            local.insert(key.clone(), rank);
            let me = self.clone();
            let inst = inst.clone();
            let r = key.1;
            tracing::info!(instance = %inst.id, rank = r, generation = inst.generation, placement = %inst.placement.describe(), "starting rank");
            let spawned = std::thread::Builder::new()
                .name(format!("shoal-rank-{}-{r}", inst.id))
                .spawn(move || me.rank_thread(inst, r, stop, mesh));
            if let Err(e) = spawned {
                tracing::error!("cannot start a rank thread: {e}");
            }
        }
    }

    pub(crate) fn report(&self, inst: &Instance, state: RankState, detail: Option<String>) {
        let mut reports = self.reports.lock().unwrap();
        let current = reports.get(&inst.id).map(|r| r.generation);
        // a report of an older generation than the one running here is stale
        if current.is_some_and(|g| g > inst.generation) {
            return;
        }
        reports.insert(
            inst.id.clone(),
            RankReport {
                generation: inst.generation,
                state,
                detail,
            },
        );
    }
}
