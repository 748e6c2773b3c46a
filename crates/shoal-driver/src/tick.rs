//! The loop every node runs a few times a second: adopt the newest instance table and
//! publish it again (replicate), on the coordinator move the table along (re-place the
//! instances of dead nodes, follow the rank reports, forget unloaded instances), start and
//! stop this node's ranks to match the table (reconcile), and publish what this node's ranks
//! report and which lead serves each ready instance.

use std::sync::Arc;

use shoal_cluster::instances::{is_coordinator, Instance, InstanceTable, Unusable};

use crate::decisions::{self, NodeReports};
use crate::rank::LocalRank;
use crate::report::{RankReport, RankState};
use crate::{now_ms, Driver, RANKS_KEY, TABLE_KEY, TICK};

impl Driver {
    /// Tells the node what this node's instances hold, so its published free memory under
    /// `--max-memory` leaves it out.
    async fn publish_held(&self, table: &InstanceTable) {
        let cluster = self.cluster().await;
        let held = decisions::held_on(table, self.node.id(), &cluster, |m| self.profile(m));
        self.node.set_memory_held(held).await;
    }

    // ---------------------------------------------------------------- the loop

    pub(crate) async fn run(self: Arc<Self>) {
        self.publish_files().await;
        let mut published_table = String::new();
        let mut published_reports = String::new();
        let mut members = Vec::new();
        let mut measured = 0;
        let mut held_for = u64::MAX;
        loop {
            tokio::time::sleep(TICK).await;
            self.remember_profiles();
            self.adopt_newest();
            let live = self.node.live_ids();
            // a placement may wait for a link: a node that just joined is measured within
            // seconds, and an instance that failed for want of its links is tried again then
            let links = self.node.links().len();
            if is_coordinator(self.node.id(), &self.coordinating(&live).await) {
                self.coordinate(live != members || links != measured).await;
            }
            members = live;
            measured = links;
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
            self.kept
                .prune(&table, self.node.id(), std::time::Instant::now());
            if table.version != held_for {
                self.publish_held(&table).await;
                held_for = table.version;
            }
            let nodes = self.node.nodes().await;
            *self.leads.lock().unwrap() = decisions::leads(&table, &nodes);
            *self.placed_leads.lock().unwrap() = decisions::placed_leads(&table, &nodes);
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

    /// Adopts the newest table a live node publishes; once a peer's table was seen (or the
    /// node settled that it is alone), this node holds the cluster's (see
    /// `InstanceControl::table_merged`).
    fn adopt_newest(&self) {
        let published = self.node.published(TABLE_KEY);
        if !self.table_merged.load(std::sync::atomic::Ordering::Relaxed) {
            // every node publishes the newest table it adopted, so one peer's is the
            // cluster's; a node with no peer holds it once it has settled that it is alone
            // (its API keys' merge decides that, see `shoal_api::keys::replicate`)
            let me = self.node.id();
            let peer_seen = published.iter().any(|(p, _)| p != me);
            let alone = self.node.live_ids().iter().all(|n| n == me)
                && self.state.upgrade().is_some_and(|s| s.keys.merged());
            if peer_seen || alone {
                self.table_merged
                    .store(true, std::sync::atomic::Ordering::Release);
            }
        }
        let seen: Vec<InstanceTable> = published
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

    /// The live nodes that may coordinate: `live`, less the coordinator when a rank that
    /// lost its session to it names it and its address refuses connections (its process is
    /// gone), so the next takes over seconds before the failure detector would let it.
    async fn coordinating(&self, live: &[String]) -> Vec<String> {
        let mut out = live.to_vec();
        let Some(coordinator) = live.iter().min().cloned() else {
            return out;
        };
        if coordinator == self.node.id() {
            return out;
        }
        let table = self.table.lock().unwrap().clone();
        if decisions::suspects(&table, &self.all_reports(), live).contains(&coordinator)
            && self.node.refuses_connections(&coordinator).await
        {
            out.retain(|n| n != &coordinator);
        }
        out
    }

    /// Every rank report of live nodes: node -> instance -> report.
    pub(crate) fn all_reports(&self) -> NodeReports {
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
    /// when the membership or the measured links changed (`changed`), try again to place
    /// failed instances.
    async fn coordinate(&self, changed: bool) {
        let me = self.node.id().to_string();
        let live = self.node.live_ids();
        let table = self.table.lock().unwrap().clone();
        let mut next = table.clone();
        let mut lost = decisions::lost_nodes(&table, &live);
        // a rank that lost its session to a node names it; a node whose address refuses
        // connections is gone, seconds before the failure detector would say so
        for node in decisions::suspects(&table, &self.all_reports(), &live) {
            if self.node.refuses_connections(&node).await {
                tracing::warn!(%node, "a rank lost its session to this node, whose address refuses connections: taken as dead");
                lost.push(node);
            }
        }
        if !lost.is_empty() {
            let cluster = self.cluster().await;
            let moving = decisions::instances_on(&table, &lost);
            let cluster = decisions::releasing(&table, &moving, &cluster, |m| self.profile(m));
            next = next.on_nodes_lost(&me, &lost, &|m| self.profile(m), &cluster, now_ms());
            for i in decisions::replaced(&table, &next) {
                tracing::warn!(instance = %i.id, lost = ?lost, state = %i.state, placement = %i.placement.describe(), "re-placed after losing nodes");
            }
            for id in decisions::failed(&next) {
                if decisions::failed(&table).contains(&id) {
                    continue;
                }
                let why = next
                    .get(&id)
                    .map(|i| i.state.to_string())
                    .unwrap_or_default();
                tracing::warn!(instance = %id, lost = ?lost, "could not re-place after losing nodes: {why}");
            }
        }
        if changed {
            let failed = decisions::failed(&next);
            if !failed.is_empty() {
                let cluster = self.cluster().await;
                for id in failed {
                    let Some(profile) = next.get(&id).and_then(|i| self.profile(&i.model)) else {
                        continue;
                    };
                    match next.replace(&me, &id, &profile, &cluster, now_ms()) {
                        Ok(t) => {
                            tracing::info!(instance = %id, "re-placed a failed instance after the membership or the links changed");
                            next = t;
                        }
                        Err(e) => tracing::debug!(instance = %id, "still cannot place: {e}"),
                    }
                }
            }
        }
        // a rank whose node has no disk room for its share: placed again without that node
        // (nor any other this coordinator saw out of room for it)
        let out_of_room = decisions::out_of_room(&next, &self.all_reports());
        if !out_of_room.is_empty() {
            let cluster = self.cluster().await;
            for (id, nodes) in out_of_room {
                let Some(profile) = next.get(&id).and_then(|i| self.profile(&i.model)) else {
                    continue;
                };
                let avoid: Vec<String> = {
                    let mut seen = self.no_room.lock().unwrap();
                    let avoid = seen.entry(id.clone()).or_default();
                    avoid.extend(nodes.iter().map(|(n, _)| n.clone()));
                    avoid.iter().cloned().collect()
                };
                let why = nodes
                    .iter()
                    .map(|(n, detail)| format!("node {n}: {detail}"))
                    .collect::<Vec<_>>()
                    .join("; ");
                let freed =
                    decisions::releasing(&next, &[id.as_str()], &cluster, |m| self.profile(m));
                let unusable = Unusable {
                    nodes: &avoid,
                    why: &why,
                };
                next = next.place_without(&me, &id, &unusable, &profile, &freed, now_ms());
                let state = next
                    .get(&id)
                    .map(|i| i.state.to_string())
                    .unwrap_or_default();
                tracing::warn!(instance = %id, avoid = ?avoid, "placed again without nodes out of disk room: {state}");
            }
        }
        self.no_room
            .lock()
            .unwrap()
            .retain(|id, _| next.get(id).is_some());
        // a drained node that left may come back as a fresh member
        next = next.undrain(&me, &decisions::departed_drained(&next, &live));
        next = decisions::follow_reports(&me, &next, &self.all_reports(), now_ms());
        let mut t = self.table.lock().unwrap();
        // the table may have changed meanwhile (a load); keep the newer one
        if decisions::supersedes(&next, &table, &t) {
            *t = next;
        }
    }

    /// Starts the ranks the table places here and stops the others.
    fn reconcile(self: &Arc<Self>, table: &InstanceTable) {
        let mut local = self.local.lock().unwrap();
        let mut reports = self.reports.lock().unwrap();
        let running = local
            .iter()
            .map(|(key, r)| (key.clone(), r.generation))
            .collect();
        let plan = decisions::plan_ranks(table, self.node.id(), &running, &reports);
        for key in &plan.stop {
            let Some(r) = local.remove(key) else { continue };
            tracing::info!(instance = %key.0, rank = key.1, generation = r.generation, "stopping rank");
            let served = r.stop("the instance was unloaded, re-placed or failed");
            // rank 0 removes the model it serves, not a newer generation's under its id
            if let (Some(served), Some(state)) = (served, self.state.upgrade()) {
                state.remove_served(&served);
            }
        }
        for id in &plan.drop_reports {
            reports.remove(id);
        }
        for (key, inst) in plan.start {
            let rank = LocalRank::new(inst.generation);
            reports.insert(
                inst.id.clone(),
                RankReport::new(inst.generation, RankState::Loading, None),
            );
            let handle = rank.handle.clone();
            local.insert(key.clone(), rank);
            let me = self.clone();
            let r = key.1;
            tracing::info!(instance = %inst.id, rank = r, generation = inst.generation, placement = %inst.placement.describe(), "starting rank");
            let spawned = std::thread::Builder::new()
                .name(format!("shoal-rank-{}-{r}", inst.id))
                .spawn(move || me.rank_thread(inst, r, handle));
            if let Err(e) = spawned {
                tracing::error!("cannot start a rank thread: {e}");
            }
        }
    }

    /// Sets this node's report about its rank of `inst`, unless it is a late word from a
    /// rank of an older generation than the one reported now.
    pub(crate) fn report(&self, inst: &Instance, state: RankState, detail: Option<String>) {
        self.set_report(inst, RankReport::new(inst.generation, state, detail));
    }

    /// Reports that this node's rank of `inst` failed with `detail`, naming the node whose
    /// session to it broke, if one did, and whether it failed for want of disk room.
    pub(crate) fn report_failure(
        &self,
        inst: &Instance,
        detail: String,
        suspect: Option<String>,
        no_room: bool,
    ) {
        let r = RankReport::new(inst.generation, RankState::Failed, Some(detail));
        self.set_report(inst, r.suspecting(suspect).for_want_of_room(no_room));
    }

    fn set_report(&self, inst: &Instance, report: RankReport) {
        let mut reports = self.reports.lock().unwrap();
        if !decisions::accepts_report(reports.get(&inst.id), inst.generation) {
            return;
        }
        reports.insert(inst.id.clone(), report);
    }
}
