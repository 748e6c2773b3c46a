//! The instance driver: what turns the replicated instance table
//! ([`shoal_cluster::instances`]) into running ranks, on every node of a cluster.
//!
//! Every node runs the same loop (a few times a second):
//!
//! 1. **Replicate.** Adopt the newest table any live node publishes (key `instances`) and
//!    publish it again, so every survivor holds the last one a dead coordinator wrote.
//! 2. **Coordinate** (only the coordinator, the lowest live id): re-place the instances of
//!    nodes membership has declared dead ([`InstanceTable::on_nodes_lost`]); move each
//!    instance to `loading`, `ready` or `failed` from what its nodes report (key `ranks`);
//!    forget unloaded instances once no node runs them. Loads, unloads and drains arrive as
//!    application requests from whichever node a client asked ([`Node::ask`]).
//! 3. **Run.** Start a rank thread for every rank the table places on this node and stop the
//!    ones it no longer places here (unloaded, re-placed, failed). A rank thread finds the
//!    model file (here, or fetched from a node that has it: the header, every tensor outside
//!    the blocks, and the blocks of its own stage, in 4 MiB chunks each checked against the
//!    source's SHA-256 list and resumable), joins the instance's mesh of authenticated
//!    sessions, loads its shard and serves: rank 0 behind this node's HTTP APIs (a split
//!    [`Scheduler`](shoal_engine::scheduler::Scheduler)), the others serving steps.
//!
//! Each node publishes what it holds (key `models`: name, SHA-256, size and planner profile
//! of every complete model file) so that any node can place a model and any node can find a
//! source for it, including a coordinator that took over after the one that placed it died.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use shoal_api::{
    AppState, ControlError, ControlFuture, InstanceControl, InstanceView, ServedModel,
};
use shoal_cluster::instances::{
    coordinator, is_coordinator, Instance, InstanceState, InstanceTable, NewInstance,
};
use shoal_cluster::mesh::SessionTransport;
use shoal_cluster::node::{AppCall, Node, MAX_FETCH_BYTES};
use shoal_engine::model::LoadedModel;
use shoal_engine::parallel::{serve, RankContext};
use shoal_engine::scheduler::SchedulerConfig;
use shoal_engine::shard::Layout;
use shoal_model::gguf::GgufFile;
use shoal_model::source::ModelSource;
use shoal_planner::{Cluster, ModelProfile, PlanRequest, Strategy};

/// Membership key of the instance table.
const TABLE_KEY: &str = "instances";
/// Membership key of this node's rank reports.
const RANKS_KEY: &str = "ranks";
/// Membership key of the model files this node holds.
const MODELS_KEY: &str = "models";
/// How long a node keeps asking while it and the node it takes for the coordinator disagree
/// on who coordinates (gossip converges in a few rounds of 250 ms; a death takes the failure
/// detector a few seconds).
const COORDINATOR_AGREEMENT: Duration = Duration::from_secs(15);
/// How often the loop runs.
const TICK: Duration = Duration::from_millis(250);
/// Bytes per fetched and verified chunk.
const CHUNK: u64 = 4 << 20;
/// How long a rank that lacks its model waits for another node's offer of it to arrive by
/// gossip (the node that asked for the load publishes its file just before).
const OFFER_WAIT: Duration = Duration::from_secs(15);
/// How long ranks wait for each other to join an instance's mesh.
const MESH_WAIT: Duration = Duration::from_secs(600);
/// How long a collective may wait: ranks idle between requests, and a dead peer is found by
/// membership (which closes the mesh), not by this timeout.
const COLLECTIVE_WAIT: Duration = Duration::from_secs(24 * 3600);

/// A sparse copy of a model file being fetched chunk by chunk.
struct ChunkFetch {
    /// Chunks written and verified.
    done: BTreeSet<u64>,
    /// The sparse file.
    file: std::fs::File,
    /// Where `done` is kept between attempts.
    done_path: PathBuf,
    /// The node fetched from.
    src: String,
    /// The file's SHA-256.
    sha: String,
}

/// The chunks holding `ranges` of a file of `size` bytes.
fn chunks_of(ranges: &[std::ops::Range<u64>], size: u64) -> BTreeSet<u64> {
    let mut chunks = BTreeSet::new();
    for r in ranges {
        let end = r.end.min(size);
        if r.start < end {
            chunks.extend(r.start / CHUNK..end.div_ceil(CHUNK));
        }
    }
    chunks
}

/// How the node's ranks are served.
#[derive(Clone, Debug)]
pub struct DriverConfig {
    /// Where fetched model files are kept.
    pub data_dir: PathBuf,
    /// Requests generating at once per instance this node leads.
    pub parallel: usize,
    /// Requests waiting beyond those.
    pub queue: usize,
    /// Whether instances this node leads reuse the KV cache of requests sharing a prefix.
    pub prefix_cache: bool,
}

/// A model file this node holds, as published.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ModelFile {
    /// The name it is loaded by (catalog key or file name without `.gguf`).
    pub name: String,
    /// SHA-256 of the whole file, hex.
    pub sha256: String,
    /// Bytes.
    pub size: u64,
    /// What the planner needs.
    pub profile: ModelProfile,
    /// Where it is (not published).
    #[serde(skip)]
    pub path: PathBuf,
}

/// What a node reports about its rank of an instance.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
struct RankReport {
    generation: u64,
    /// `loading`, `ready` or `failed`.
    state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    detail: Option<String>,
}

/// The chunk list a source sends before a fetch.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Manifest {
    size: u64,
    chunk: u64,
    /// SHA-256 of each chunk, hex.
    hashes: Vec<String>,
    /// Where the tensor data starts.
    data_offset: u64,
    /// Each tensor's absolute byte range.
    tensors: Vec<(String, u64, u64)>,
}

/// A rank this node runs.
struct LocalRank {
    generation: u64,
    stop: Arc<AtomicBool>,
    mesh: Arc<Mutex<Option<Arc<SessionTransport>>>>,
}

impl LocalRank {
    fn stop(&self, why: &str) {
        self.stop.store(true, Ordering::Release);
        if let Some(m) = self.mesh.lock().unwrap().as_ref() {
            m.close(why);
        }
    }
}

/// The driver of one node.
pub struct Driver {
    me: Weak<Driver>,
    node: Arc<Node>,
    state: Weak<AppState>,
    cfg: DriverConfig,
    rt: tokio::runtime::Handle,
    table: Mutex<InstanceTable>,
    /// Ranks running here, by (instance, rank).
    local: Mutex<HashMap<(String, usize), LocalRank>>,
    /// What this node reports, by instance.
    reports: Mutex<BTreeMap<String, RankReport>>,
    /// Model files here, by SHA-256.
    files: Mutex<BTreeMap<String, ModelFile>>,
    /// Profiles seen, by model name (for re-placing after the publisher died).
    profiles: Mutex<HashMap<String, ModelProfile>>,
    /// The API address of each ready instance's lead node, by instance id.
    leads: Mutex<HashMap<String, String>>,
    /// Manifests computed for files this node shares, by SHA-256.
    manifests: Mutex<HashMap<String, Arc<Manifest>>>,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn err(status: u16, message: impl Into<String>) -> ControlError {
    ControlError {
        status,
        message: message.into(),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of a whole file, hex.
fn sha256_file(path: &Path) -> anyhow::Result<String> {
    Ok(shoal_model::catalog::sha256_file(path)?.1)
}

/// A model this node can offer: `arg` resolved to a GGUF file, its SHA-256 (the catalog's for
/// a fetched catalog model, computed otherwise) and profile.
pub fn describe_model(arg: &str) -> anyhow::Result<ModelFile> {
    let source = shoal_model::source::resolve(arg)?;
    let ModelSource::Gguf(path) = &source else {
        bail!(
            "{arg} is a Hugging Face folder; cluster instances load GGUF files (convert it, or \
             serve it on one node with --model)"
        );
    };
    let sha256 = match shoal_model::catalog::entry(arg) {
        Some(e) => e.sha256.to_string(),
        None => sha256_file(path)?,
    };
    let size = std::fs::metadata(path)?.len();
    let name = crate::serve::model_id(arg);
    let profile = crate::plan::profile_from_model(arg)?;
    Ok(ModelFile {
        name,
        sha256,
        size,
        profile,
        path: path.clone(),
    })
}

impl Driver {
    /// Starts the driver for `node`, serving lead ranks through `state`, offering the
    /// model files `models` (and every fetched catalog model). Call inside the runtime.
    pub fn start(
        node: Arc<Node>,
        state: &Arc<AppState>,
        cfg: DriverConfig,
        models: Vec<ModelFile>,
    ) -> Arc<Driver> {
        let d = Arc::new_cyclic(|me| Driver {
            me: me.clone(),
            node,
            state: Arc::downgrade(state),
            cfg,
            rt: tokio::runtime::Handle::current(),
            table: Mutex::new(InstanceTable::new()),
            local: Mutex::new(HashMap::new()),
            reports: Mutex::new(BTreeMap::new()),
            files: Mutex::new(BTreeMap::new()),
            profiles: Mutex::new(HashMap::new()),
            manifests: Mutex::new(HashMap::new()),
            leads: Mutex::new(HashMap::new()),
        });
        for m in models {
            d.add_file(m);
        }
        // every fetched catalog model is offered too
        for key in shoal_model::catalog::keys() {
            let cached = shoal_model::catalog::Catalog::open_default()
                .ok()
                .and_then(|c| c.cached_path(key).ok().flatten());
            if cached.is_some() && !d.files.lock().unwrap().values().any(|f| f.name == key) {
                match describe_model(key) {
                    Ok(m) => d.add_file(m),
                    Err(e) => tracing::debug!(model = key, "not offered: {e:#}"),
                }
            }
        }
        let _ = state.instances.set(shoal_api::Control(d.clone()));
        let requests = d.node.app_requests();
        tokio::spawn(d.clone().answer(requests));
        tokio::spawn(d.clone().run());
        d
    }

    fn add_file(&self, m: ModelFile) {
        self.node.share_file(&m.sha256, m.path.clone());
        self.profiles
            .lock()
            .unwrap()
            .insert(m.name.clone(), m.profile.clone());
        self.files.lock().unwrap().insert(m.sha256.clone(), m);
    }

    async fn publish_files(&self) {
        let list: Vec<ModelFile> = self.files.lock().unwrap().values().cloned().collect();
        let json = serde_json::to_string(&list).expect("files serialize");
        if let Err(e) = self.node.publish(MODELS_KEY, &json).await {
            tracing::warn!("publishing this node's models failed: {e}");
        }
    }

    /// Every model file any live node offers: (node, file).
    fn offered(&self) -> Vec<(String, ModelFile)> {
        let mut out = Vec::new();
        for (node, json) in self.node.published(MODELS_KEY) {
            if let Ok(list) = serde_json::from_str::<Vec<ModelFile>>(&json) {
                out.extend(list.into_iter().map(|f| (node.clone(), f)));
            }
        }
        out
    }

    fn profile(&self, model: &str) -> Option<ModelProfile> {
        if let Some(p) = self.profiles.lock().unwrap().get(model) {
            return Some(p.clone());
        }
        let found = self
            .offered()
            .into_iter()
            .find(|(_, f)| f.name == model)
            .map(|(_, f)| f.profile);
        if let Some(p) = &found {
            self.profiles
                .lock()
                .unwrap()
                .insert(model.to_string(), p.clone());
        }
        found
    }

    /// The live cluster for the planner.
    async fn cluster(&self) -> Cluster {
        let (nodes, links) = self.node.planner_view().await;
        Cluster { nodes, links }
    }

    /// The memory `inst` holds on each of its live nodes, as the planner predicts it.
    fn held_by(&self, inst: &Instance, cluster: &Cluster) -> Vec<(String, u64)> {
        let Some(profile) = self.profile(&inst.model) else {
            return Vec::new();
        };
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
        match shoal_planner::evaluate(&full, &profile, &req, &inst.placement) {
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

    /// `cluster` with the memory the instances `ids` hold given back to their nodes (they
    /// are about to be re-placed, and their old ranks stop).
    fn releasing(&self, table: &InstanceTable, ids: &[&str], cluster: &Cluster) -> Cluster {
        let mut out = cluster.clone();
        for id in ids {
            let Some(inst) = table.get(id) else { continue };
            if !is_running(&inst.state) {
                continue;
            }
            for (node, bytes) in self.held_by(inst, cluster) {
                if let Some(n) = out.nodes.iter_mut().find(|n| n.id == node) {
                    n.memory_free_bytes = n.memory_free_bytes.saturating_add(bytes);
                }
            }
        }
        out
    }

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

    async fn run(self: Arc<Self>) {
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
    fn all_reports(&self) -> HashMap<String, BTreeMap<String, RankReport>> {
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
                        of(n).filter(|r| r.state == "failed").map(|r| {
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
                        .all(|n| of(n).is_some_and(|r| r.state == "ready"))
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
                    state: "loading".into(),
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

    fn report(&self, inst: &Instance, state: &str, detail: Option<String>) {
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
                state: state.into(),
                detail,
            },
        );
    }

    // ---------------------------------------------------------------- a rank

    fn rank_thread(
        self: Arc<Self>,
        inst: Instance,
        rank: usize,
        stop: Arc<AtomicBool>,
        mesh: Arc<Mutex<Option<Arc<SessionTransport>>>>,
    ) {
        let result = self.run_rank(&inst, rank, &stop, &mesh);
        if let Some(m) = mesh.lock().unwrap().take() {
            m.close("the rank ended");
        }
        match result {
            Ok(()) => tracing::info!(instance = %inst.id, rank, "rank stopped"),
            Err(e) if stop.load(Ordering::Acquire) => {
                tracing::info!(instance = %inst.id, rank, "rank stopped: {e:#}")
            }
            Err(e) => {
                tracing::warn!(instance = %inst.id, rank, "rank failed: {e:#}");
                self.report(&inst, "failed", Some(format!("{e:#}")));
            }
        }
    }

    fn run_rank(
        &self,
        inst: &Instance,
        rank: usize,
        stop: &AtomicBool,
        mesh_slot: &Mutex<Option<Arc<SessionTransport>>>,
    ) -> anyhow::Result<()> {
        let path = self.model_path(inst, rank, stop)?;
        if stop.load(Ordering::Acquire) {
            return Ok(());
        }
        let rank_nodes: Vec<String> = inst
            .placement
            .rank_nodes()
            .into_iter()
            .map(str::to_string)
            .collect();
        self.report(inst, "loading", Some("joining the other ranks".into()));
        let transport = self
            .rt
            .block_on(self.node.open_mesh(
                &inst.id,
                inst.generation,
                rank,
                &rank_nodes,
                Instant::now() + MESH_WAIT,
            ))
            .map_err(anyhow::Error::msg)?;
        let transport = Arc::new(transport);
        *mesh_slot.lock().unwrap() = Some(transport.clone());
        if stop.load(Ordering::Acquire) {
            transport.close("the instance was stopped");
            return Ok(());
        }
        let layout = Layout {
            tp: inst.placement.tp,
            pp: inst.placement.pp(),
        };
        let mut ctx = RankContext::over(transport, layout, COLLECTIVE_WAIT)?;
        self.report(inst, "loading", Some("loading its shard".into()));
        let source = ModelSource::Gguf(path.clone());
        let sizes = inst.placement.stage_sizes();
        let (model, plans) = LoadedModel::load_split(
            &source,
            layout,
            Some(&sizes),
            inst.placement.experts,
            rank,
            ctx.tp.clone(),
        )
        .with_context(|| format!("loading rank {rank}'s shard of {}", path.display()))?;
        ctx.plans = plans;
        let capacity = (inst.ctx as usize)
            .min(model.transformer.config().context_len)
            .max(2);
        if rank == 0 {
            let served = Arc::new(ServedModel::start_split(
                inst.id.clone(),
                model,
                ctx,
                SchedulerConfig {
                    max_batch: self.cfg.parallel,
                    max_queue: self.cfg.queue,
                    ctx: capacity,
                    prefix_cache: self.cfg.prefix_cache,
                    draft_max: 0,
                },
            )?);
            let state = self
                .state
                .upgrade()
                .context("the server is shutting down")?;
            state.add_model(served.clone());
            self.report(inst, "ready", None);
            tracing::info!(instance = %inst.id, "serving");
            drop(state);
            loop {
                if stop.load(Ordering::Acquire) {
                    return Ok(());
                }
                if let Some(why) = served.scheduler.failure() {
                    if let Some(state) = self.state.upgrade() {
                        state.remove_model(&inst.id);
                    }
                    bail!("{why}");
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        self.report(inst, "ready", None);
        serve(&ctx, &model.transformer, capacity)?;
        Ok(())
    }

    /// The model file of `inst` here: one this node has (by SHA-256, else by name), or the
    /// parts rank `rank` needs fetched from a node that has it.
    fn model_path(
        &self,
        inst: &Instance,
        rank: usize,
        stop: &AtomicBool,
    ) -> anyhow::Result<PathBuf> {
        let files = self.files.lock().unwrap().clone();
        let mine = match &inst.model_sha256 {
            Some(sha) => files.get(sha),
            None => files.values().find(|f| f.name == inst.model),
        };
        if let Some(f) = mine {
            return Ok(f.path.clone());
        }
        let sha = inst
            .model_sha256
            .clone()
            .with_context(|| format!("no node offers model {}", inst.model))?;
        // the node that asked for the load may have published its file a moment ago: wait
        // for the offer to reach this node before giving up
        let waited = Instant::now();
        let sources = loop {
            let sources: Vec<String> = self
                .offered()
                .into_iter()
                .filter(|(n, f)| f.sha256 == sha && n != self.node.id())
                .map(|(n, _)| n)
                .collect();
            if !sources.is_empty() {
                break sources;
            }
            if waited.elapsed() >= OFFER_WAIT || stop.load(Ordering::Relaxed) {
                bail!(
                    "this node lacks model {} (sha256 {sha}) and no live node offered it within {} s",
                    inst.model,
                    OFFER_WAIT.as_secs()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let mut last = None;
        for src in &sources {
            match self.fetch_slice(inst, src, &sha, rank, stop) {
                Ok(p) => return Ok(p),
                Err(e) => {
                    tracing::warn!(source = %src, "fetching from this node failed: {e:#}");
                    last = Some(e);
                }
            }
        }
        Err(last.expect("a source was tried"))
    }

    /// Fetches, from node `src`, the chunks of file `sha` that rank `rank` of `inst` reads
    /// into a sparse file of the full size: first the header, from which the rank's share is
    /// computed as the executor cuts it, then the byte ranges of that share
    /// (`shard::file_ranges`: every tensor outside the blocks, the blocks of its stage, and
    /// of the routed experts only its own). Chunks already verified by an earlier attempt
    /// are kept.
    fn fetch_slice(
        &self,
        inst: &Instance,
        src: &str,
        sha: &str,
        rank: usize,
        stop: &AtomicBool,
    ) -> anyhow::Result<PathBuf> {
        let answer = self
            .rt
            .block_on(self.node.ask(
                src,
                json!({"op": "manifest", "sha256": sha}),
                Duration::from_secs(120),
            ))
            .map_err(anyhow::Error::msg)?;
        let m: Manifest = serde_json::from_value(answer).context("reading the manifest")?;
        if m.chunk != CHUNK || m.hashes.len() as u64 != m.size.div_ceil(CHUNK) {
            bail!("node {src} sent a manifest that does not describe its file");
        }
        let dir = self.cfg.data_dir.join("models");
        std::fs::create_dir_all(&dir)?;
        let path = dir.join(format!("{sha}.gguf"));
        let done_path = dir.join(format!("{sha}.chunks"));
        let mut fetch = ChunkFetch {
            done: std::fs::read_to_string(&done_path)
                .ok()
                .and_then(|t| serde_json::from_str(&t).ok())
                .unwrap_or_default(),
            file: std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .read(true)
                .write(true)
                .open(&path)
                .with_context(|| format!("opening {}", path.display()))?,
            done_path,
            src: src.to_string(),
            sha: sha.to_string(),
        };
        if fetch.file.metadata()?.len() != m.size {
            fetch.file.set_len(m.size)?;
            fetch.done.clear();
        }
        let header: BTreeSet<u64> = (0..m.data_offset.min(m.size).div_ceil(CHUNK).max(1)).collect();
        self.fetch_chunks(inst, &m, &mut fetch, &header, stop)?;
        let needed = match self.rank_ranges(inst, rank, &path) {
            Ok(ranges) => chunks_of(&ranges, m.size),
            Err(e) => {
                // the stage's whole blocks hold every byte the rank reads
                tracing::warn!(instance = %inst.id, "fetching the stage's whole blocks: {e:#}");
                let stage = inst.placement.tp.max(1);
                let layers = inst
                    .placement
                    .stages
                    .get(rank / stage)
                    .map(|s| s.layers.clone())
                    .context("the rank is outside the placement")?;
                let mut chunks = header.clone();
                for (name, start, len) in &m.tensors {
                    let wanted = match shoal_engine::arch::layer_of(name) {
                        Some(i) => layers.contains(&i),
                        None => true,
                    };
                    if wanted && *len > 0 {
                        let end = start.saturating_add(*len).min(m.size);
                        chunks.extend(start / CHUNK..end.div_ceil(CHUNK));
                    }
                }
                chunks
            }
        };
        let total_bytes: u64 = needed.iter().map(|&c| CHUNK.min(m.size - c * CHUNK)).sum();
        tracing::info!(
            instance = %inst.id, source = %src, chunks = needed.len(),
            mb = total_bytes as f64 / 1e6, file_mb = m.size as f64 / 1e6,
            "fetching this rank's slice of the model"
        );
        let t0 = Instant::now();
        self.fetch_chunks(inst, &m, &mut fetch, &needed, stop)?;
        tracing::info!(instance = %inst.id, secs = t0.elapsed().as_secs_f64(), "fetched");
        if fetch.done.len() == m.hashes.len() {
            // every chunk is here: check the whole file and offer it like a fetched model
            if sha256_file(&path)? == sha {
                if let Some(profile) = self.profile(&inst.model) {
                    self.add_file(ModelFile {
                        name: inst.model.clone(),
                        sha256: sha.to_string(),
                        size: m.size,
                        profile,
                        path: path.clone(),
                    });
                    self.rt.block_on(self.publish_files());
                    tracing::info!(model = %inst.model, "the whole file is here and verified; offering it");
                }
            } else {
                let _ = std::fs::remove_file(&fetch.done_path);
                bail!("the assembled file does not match sha256 {sha}; its chunks will be fetched again");
            }
        }
        Ok(path)
    }

    /// The byte ranges rank `rank` of `inst` reads, from the header of the (sparse) file at
    /// `path`, as the executor will cut the model.
    fn rank_ranges(
        &self,
        inst: &Instance,
        rank: usize,
        path: &Path,
    ) -> anyhow::Result<Vec<std::ops::Range<u64>>> {
        let file = GgufFile::open(path)?;
        let vocab = file
            .tensor("token_embd.weight")?
            .shape()
            .first()
            .copied()
            .unwrap_or(0);
        let label = path.display().to_string();
        let cfg = shoal_engine::arch::config_from_gguf(file.metadata(), vocab, &label)?;
        let layout = Layout {
            tp: inst.placement.tp,
            pp: inst.placement.pp(),
        };
        let sizes = inst.placement.stage_sizes();
        let src = shoal_engine::weights::GgufWeights::new(file);
        let plans =
            shoal_engine::shard::plan(&cfg, &src, layout, Some(&sizes), inst.placement.experts)?;
        let plan = plans
            .get(rank)
            .context("the rank is outside the placement")?;
        Ok(shoal_engine::shard::file_ranges(&cfg, src.file(), plan))
    }

    /// Fetches the chunks of `chunks` not yet done, checking each against the manifest,
    /// and reports progress.
    fn fetch_chunks(
        &self,
        inst: &Instance,
        m: &Manifest,
        fetch: &mut ChunkFetch,
        chunks: &BTreeSet<u64>,
        stop: &AtomicBool,
    ) -> anyhow::Result<()> {
        let todo: Vec<u64> = chunks
            .iter()
            .copied()
            .filter(|c| !fetch.done.contains(c))
            .collect();
        for (k, &c) in todo.iter().enumerate() {
            if stop.load(Ordering::Acquire) {
                bail!("stopped while fetching");
            }
            let off = c * CHUNK;
            let len = CHUNK.min(m.size - off);
            debug_assert!(len <= MAX_FETCH_BYTES);
            let bytes = self
                .rt
                .block_on(self.node.fetch(&fetch.src, &fetch.sha, off, len))
                .map_err(anyhow::Error::msg)?;
            let got = hex(&Sha256::digest(&bytes));
            if got != m.hashes[c as usize] {
                bail!(
                    "chunk {c} from node {} failed its sha256 check (got {got})",
                    fetch.src
                );
            }
            fetch.file.seek(SeekFrom::Start(off))?;
            fetch.file.write_all(&bytes)?;
            fetch.done.insert(c);
            if k % 8 == 7 || k + 1 == todo.len() {
                fetch.file.sync_data()?;
                std::fs::write(&fetch.done_path, serde_json::to_string(&fetch.done)?)?;
                let have = chunks.iter().filter(|c| fetch.done.contains(c)).count();
                self.report(
                    inst,
                    "loading",
                    Some(format!(
                        "fetched {have}/{} chunks of its slice from node {}",
                        chunks.len(),
                        fetch.src
                    )),
                );
            }
        }
        Ok(())
    }

    // ---------------------------------------------------------------- requests

    /// Answers application requests from other nodes.
    async fn answer(self: Arc<Self>, mut requests: tokio::sync::mpsc::Receiver<AppCall>) {
        while let Some((from, body, reply)) = requests.recv().await {
            let me = self.clone();
            tokio::spawn(async move {
                let r = me.handle(&from, body).await;
                let _ = reply.send(r);
            });
        }
    }

    async fn handle(&self, from: &str, body: Value) -> Result<Value, String> {
        match body["op"].as_str().unwrap_or("") {
            "manifest" => {
                let sha = body["sha256"].as_str().unwrap_or("").to_ascii_lowercase();
                self.manifest(&sha)
                    .await
                    .map(|m| serde_json::to_value(&*m).expect("manifest serializes"))
                    .map_err(|e| format!("{e:#}"))
            }
            "load" | "unload" | "drain" => {
                let live = self.node.live_ids();
                if !is_coordinator(self.node.id(), &live) {
                    // views of who is alive differ for a moment after a join or a death:
                    // the asker retries once its own view has caught up
                    return Ok(json!({"not_coordinator": {
                        "node": self.node.id(),
                        "ask": coordinator(&live).unwrap_or("none"),
                    }}));
                }
                tracing::info!(from, op = %body["op"], "coordinator request");
                // a refusal travels as an answer, so its status reaches the client
                Ok(match self.apply(&body).await {
                    Ok(v) => json!({"ok": v}),
                    Err(e) => json!({"refused": {"status": e.status, "message": e.message}}),
                })
            }
            other => Err(format!("unknown operation {other:?}")),
        }
    }

    /// The chunk list of a file this node shares (computed once).
    async fn manifest(&self, sha: &str) -> anyhow::Result<Arc<Manifest>> {
        if let Some(m) = self.manifests.lock().unwrap().get(sha) {
            return Ok(m.clone());
        }
        let file = self
            .files
            .lock()
            .unwrap()
            .get(sha)
            .cloned()
            .with_context(|| format!("this node does not offer a file with sha256 {sha}"))?;
        let m = tokio::task::spawn_blocking(move || -> anyhow::Result<Manifest> {
            let g = GgufFile::open(&file.path)?;
            let h = g.header();
            let tensors = h
                .tensors
                .iter()
                .map(|t| (t.name.clone(), h.data_offset + t.offset, t.size))
                .collect();
            let mut f = std::fs::File::open(&file.path)?;
            let mut hashes = Vec::new();
            let mut buf = vec![0u8; CHUNK as usize];
            let mut left = file.size;
            while left > 0 {
                let n = CHUNK.min(left) as usize;
                f.read_exact(&mut buf[..n])?;
                hashes.push(hex(&Sha256::digest(&buf[..n])));
                left -= n as u64;
            }
            Ok(Manifest {
                size: file.size,
                chunk: CHUNK,
                hashes,
                data_offset: h.data_offset,
                tensors,
            })
        })
        .await??;
        let m = Arc::new(m);
        self.manifests
            .lock()
            .unwrap()
            .insert(sha.to_string(), m.clone());
        Ok(m)
    }

    /// The live cluster once every pair of its nodes has a measured link (a node that just
    /// joined is measured within seconds), or as it is after `wait`.
    async fn measured_cluster(&self, wait: Duration) -> Cluster {
        let until = Instant::now() + wait;
        loop {
            let c = self.cluster().await;
            let n = c.nodes.len();
            if c.links.len() >= n * n.saturating_sub(1) / 2 || Instant::now() >= until {
                return c;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Applies a coordinator operation to the table (on the coordinator).
    async fn apply(&self, body: &Value) -> Result<Value, ControlError> {
        let me = self.node.id().to_string();
        let cluster = self.measured_cluster(Duration::from_secs(15)).await;
        let table = self.table.lock().unwrap().clone();
        let (next, answer) = match body["op"].as_str().unwrap_or("") {
            "load" => {
                let model = body["model"].as_str().unwrap_or("").to_string();
                let profile: ModelProfile = serde_json::from_value(body["profile"].clone())
                    .map_err(|e| err(400, format!("the load carries no usable profile: {e}")))?;
                self.profiles
                    .lock()
                    .unwrap()
                    .insert(model.clone(), profile.clone());
                let request: PlanRequest = serde_json::from_value(body["request"].clone())
                    .map_err(|e| err(400, format!("the load carries no usable request: {e}")))?;
                let new = NewInstance {
                    id: body["id"].as_str().unwrap_or(&model).to_string(),
                    model,
                    model_sha256: body["sha256"].as_str().map(str::to_string),
                };
                let id = new.id.clone();
                let t = table
                    .load(&me, new, &profile, &cluster, &request, now_ms())
                    .map_err(|e| {
                        let status = match e {
                            shoal_cluster::instances::InstanceError::Duplicate { .. } => 409,
                            _ => 400,
                        };
                        err(status, e.to_string())
                    })?;
                let inst = t.get(&id).cloned();
                (t, json!({"instance": inst}))
            }
            "unload" => {
                let id = body["id"].as_str().unwrap_or("");
                let t = table
                    .unload(&me, id, now_ms())
                    .map_err(|e| err(404, e.to_string()))?;
                (t, json!({"unloading": id}))
            }
            "drain" => {
                let node = body["node"].as_str().unwrap_or("");
                let moving: Vec<&str> = table
                    .instances
                    .values()
                    .filter(|i| i.uses_any(&[node.to_string()]))
                    .map(|i| i.id.as_str())
                    .collect();
                let cluster = self.releasing(&table, &moving, &cluster);
                let t = table.drain(&me, node, &|m| self.profile(m), &cluster, now_ms());
                // refuse rather than fail a running instance that has nowhere to go
                let stranded: Vec<String> = t
                    .instances
                    .values()
                    .filter_map(|i| match (&i.state, table.get(&i.id).map(|o| &o.state)) {
                        (InstanceState::Failed { reason }, Some(before))
                            if !matches!(before, InstanceState::Failed { .. }) =>
                        {
                            Some(format!("{}: {reason}", i.id))
                        }
                        _ => None,
                    })
                    .collect();
                if !stranded.is_empty() {
                    return Err(err(
                        409,
                        format!(
                            "node {node} is not drained: its instances would have nowhere to go ({}); unload them or add nodes first",
                            stranded.join("; ")
                        ),
                    ));
                }
                let moved: Vec<&str> = t
                    .instances
                    .values()
                    .filter(|i| table.get(&i.id).map(|o| o.generation) != Some(i.generation))
                    .map(|i| i.id.as_str())
                    .collect();
                let answer = json!({"drained": node, "moved": moved});
                (t, answer)
            }
            other => return Err(err(400, format!("unknown operation {other:?}"))),
        };
        let mut t = self.table.lock().unwrap();
        if t.version != table.version {
            return Err(err(
                503,
                "the instance table changed while this request was applied; retry",
            ));
        }
        *t = next;
        Ok(answer)
    }

    /// Sends an operation to the coordinator (which may be this node).
    ///
    /// Right after a node joins or dies, this node and the one it takes for the coordinator
    /// may disagree on who is alive, and so on who coordinates. The other node then declines;
    /// the request goes again (nothing was applied) once the views had time to converge, for
    /// up to [`COORDINATOR_AGREEMENT`].
    async fn to_coordinator(&self, body: Value) -> Result<Value, ControlError> {
        let deadline = Instant::now() + COORDINATOR_AGREEMENT;
        loop {
            let live = self.node.live_ids();
            let coord = coordinator(&live)
                .map(str::to_string)
                .unwrap_or_else(|| self.node.id().to_string());
            if coord == self.node.id() {
                return self.apply(&body).await;
            }
            let answer = self
                .node
                .ask(&coord, body.clone(), Duration::from_secs(30))
                .await
                .map_err(|e| err(503, format!("the coordinator could not be asked: {e}")))?;
            match (
                answer.get("ok"),
                answer.get("refused"),
                answer.get("not_coordinator"),
            ) {
                (Some(v), _, _) => return Ok(v.clone()),
                (None, Some(r), _) => {
                    return Err(err(
                        r["status"]
                            .as_u64()
                            .and_then(|s| u16::try_from(s).ok())
                            .unwrap_or(500),
                        r["message"].as_str().unwrap_or("refused").to_string(),
                    ))
                }
                (None, None, Some(n)) => {
                    if Instant::now() >= deadline {
                        return Err(err(
                            503,
                            format!(
                                "the nodes disagree on who coordinates: this node takes {coord} \
                                 for the coordinator, and {coord} names {}; they did not agree \
                                 within {}s, so check `shoal nodes` on both and retry",
                                n["ask"].as_str().unwrap_or("none"),
                                COORDINATOR_AGREEMENT.as_secs()
                            ),
                        ));
                    }
                    tracing::debug!(%coord, ask = %n["ask"], "not the coordinator yet; retrying");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                _ => return Err(err(502, format!("the coordinator answered {answer}"))),
            }
        }
    }

    async fn load_request(&self, req: Value) -> Result<Value, ControlError> {
        let model = req["model"]
            .as_str()
            .filter(|m| !m.is_empty())
            .ok_or_else(|| err(400, "give the model to load: {\"model\": NAME}"))?
            .to_string();
        let strategy: Strategy = match req.get("strategy") {
            None | Some(Value::Null) => Strategy::Auto,
            Some(v) => serde_json::from_value(v.clone()).map_err(|_| {
                err(
                    400,
                    format!("strategy {v} is not one of auto, tensor, pipeline, hybrid"),
                )
            })?,
        };
        let experts: shoal_planner::split::ExpertSplit = match req.get("experts") {
            None | Some(Value::Null) => Default::default(),
            Some(v) => serde_json::from_value(v.clone()).map_err(|_| {
                err(
                    400,
                    format!("experts {v} is not one of auto, whole, sliced"),
                )
            })?,
        };
        let ctx = match req.get("ctx") {
            None | Some(Value::Null) => 4096,
            Some(v) => v
                .as_u64()
                .filter(|&c| (2..=1 << 20).contains(&c))
                .ok_or_else(|| {
                    err(
                        400,
                        format!("ctx {v} must be a number of tokens, 2 to 1048576"),
                    )
                })? as u32,
        };
        let nodes: Option<Vec<String>> = match req.get("nodes") {
            None | Some(Value::Null) => None,
            Some(v) => Some(
                serde_json::from_value(v.clone())
                    .map_err(|_| err(400, "nodes must be a list of node ids or names"))?,
            ),
        };
        // this node's file, else any node's offer of that name
        let local = self
            .files
            .lock()
            .unwrap()
            .values()
            .find(|f| f.name == model)
            .cloned();
        let file = match local {
            Some(f) => f,
            None => match self.offered().into_iter().find(|(_, f)| f.name == model) {
                Some((_, f)) => f,
                None => {
                    let m = model.clone();
                    match tokio::task::spawn_blocking(move || describe_model(&m)).await {
                        Ok(Ok(f)) => {
                            self.add_file(f.clone());
                            self.publish_files().await;
                            f
                        }
                        _ => {
                            let offered: BTreeSet<String> =
                                self.offered().into_iter().map(|(_, f)| f.name).collect();
                            return Err(err(
                                404,
                                format!(
                                    "no node has model {model}; the cluster offers: {} (fetch it on one node with `shoal models fetch`)",
                                    if offered.is_empty() { "nothing".to_string() } else { offered.into_iter().collect::<Vec<_>>().join(", ") }
                                ),
                            ));
                        }
                    }
                }
            },
        };
        let id = req["id"].as_str().unwrap_or(&file.name).to_string();
        let request = PlanRequest {
            ctx,
            strategy,
            nodes,
            experts,
            ..PlanRequest::default()
        };
        let body = json!({
            "op": "load",
            "id": id,
            "model": file.name,
            "sha256": file.sha256,
            "profile": file.profile,
            "request": request,
        });
        self.to_coordinator(body).await
    }

    fn list_table(&self) -> Value {
        let table = self.table.lock().unwrap().clone();
        let reports = self.all_reports();
        let nodes = self.rt.block_on(self.node.nodes());
        let api_of = |id: &str| {
            nodes
                .iter()
                .find(|n| n.id == id)
                .and_then(|n| n.facts.as_ref().map(|f| f.api.clone()))
        };
        let name_of = |id: &str| {
            nodes
                .iter()
                .find(|n| n.id == id)
                .map(|n| n.name.clone())
                .unwrap_or_else(|| id.to_string())
        };
        let list: Vec<Value> = table
            .instances
            .values()
            .map(|i| {
                let lead = i.lead().unwrap_or("");
                let progress: BTreeMap<String, Value> = i
                    .nodes()
                    .into_iter()
                    .filter_map(|n| {
                        reports
                            .get(n)
                            .and_then(|r| r.get(&i.id))
                            .filter(|r| r.generation == i.generation)
                            .map(|r| (name_of(n), json!({"state": r.state, "detail": r.detail})))
                    })
                    .collect();
                json!({
                    "id": i.id,
                    "model": i.model,
                    "state": i.state.name(),
                    "reason": match &i.state { InstanceState::Failed { reason } => Some(reason.clone()), _ => None },
                    "generation": i.generation,
                    "ctx": i.ctx,
                    "strategy": i.placement.strategy,
                    "tp": i.placement.tp,
                    "pp": i.placement.pp(),
                    "experts": i.placement.experts,
                    "placement": nodes.iter().fold(i.placement.describe(), |d, n| d.replace(&n.id, &n.name)),
                    "nodes": i.nodes().into_iter().map(name_of).collect::<Vec<_>>(),
                    "lead": name_of(lead),
                    "api": api_of(lead),
                    "ranks": progress,
                    "history": i.history,
                })
            })
            .collect();
        let drained: Vec<String> = table.drained.iter().map(|n| name_of(n)).collect();
        json!({"version": table.version, "coordinator": table.coordinator, "drained": drained, "instances": list})
    }
}

/// Whether an instance in `state` holds ranks (and memory) on its nodes.
fn is_running(state: &InstanceState) -> bool {
    matches!(
        state,
        InstanceState::Placing | InstanceState::Loading | InstanceState::Ready
    )
}

impl InstanceControl for Driver {
    fn load(&self, request: Value) -> ControlFuture {
        let me = self.self_arc();
        Box::pin(async move { me.load_request(request).await })
    }

    fn unload(&self, id: String) -> ControlFuture {
        let me = self.self_arc();
        Box::pin(async move { me.to_coordinator(json!({"op": "unload", "id": id})).await })
    }

    fn drain(&self, node: String) -> ControlFuture {
        let me = self.self_arc();
        Box::pin(async move {
            // names are accepted as well as ids
            let nodes = me.node.nodes().await;
            let id = nodes
                .iter()
                .find(|n| n.id == node || n.name == node)
                .map(|n| n.id.clone())
                .ok_or_else(|| err(404, format!("no node {node} in the cluster")))?;
            me.to_coordinator(json!({"op": "drain", "node": id})).await
        })
    }

    fn lead_api(&self, id: &str) -> Option<String> {
        self.leads.lock().unwrap().get(id).cloned()
    }

    fn ready_ids(&self) -> Vec<String> {
        self.leads.lock().unwrap().keys().cloned().collect()
    }

    fn instance(&self, id: &str) -> Option<InstanceView> {
        let table = self.table.lock().unwrap();
        let inst = table.get(id)?;
        let reason = match &inst.state {
            InstanceState::Failed { reason } => Some(reason.clone()),
            _ => None,
        };
        Some(InstanceView {
            state: inst.state.name().to_string(),
            generation: inst.generation,
            lead_here: inst.lead() == Some(self.node.id()),
            lead_api: self.leads.lock().unwrap().get(id).cloned(),
            reason,
        })
    }

    fn list(&self) -> ControlFuture {
        let me = self.self_arc();
        Box::pin(async move {
            tokio::task::spawn_blocking(move || me.list_table())
                .await
                .map_err(|e| err(500, e.to_string()))
        })
    }
}

impl Driver {
    /// The driver's own `Arc` ([`Driver::start`] always makes one).
    fn self_arc(&self) -> Arc<Driver> {
        self.me
            .upgrade()
            .expect("the driver is alive while it is called")
    }
}
