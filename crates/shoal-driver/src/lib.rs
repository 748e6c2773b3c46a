//! The instance driver: what turns the replicated instance table
//! ([`shoal_cluster::instances`]) into running ranks, on every node of a cluster.
//!
//! Every node runs the same loop (a few times a second, `tick.rs`):
//!
//! 1. **Replicate.** Adopt the newest table any live node publishes (key `instances`) and
//!    publish it again, so every survivor holds the last one a dead coordinator wrote.
//! 2. **Coordinate** (only the coordinator, the lowest live id): re-place the instances of
//!    nodes membership has declared dead ([`InstanceTable::on_nodes_lost`]), and those a
//!    rank of which found no disk room for its share without that node
//!    ([`InstanceTable::place_without`]); move each
//!    instance to `loading`, `ready` or `failed` from what its nodes report (key `ranks`,
//!    [`report`]); forget unloaded instances once no node runs them. The rules are pure
//!    functions in [`decisions`]. Loads, unloads and drains arrive as application requests
//!    from whichever node a client asked ([`Node::ask`], typed by [`protocol`], handled in
//!    `control.rs`).
//! 3. **Run.** Start a rank thread (`rank.rs`) for every rank the table places on this node
//!    and stop the ones it no longer places here (unloaded, re-placed, failed). A rank thread
//!    finds the model file (here, or fetched from a node that has it, `fetch.rs`: the header,
//!    every tensor outside the blocks, and the blocks of its own stage, in 4 MiB chunks each
//!    checked against the source's SHA-256 list and resumable), joins the instance's mesh of
//!    authenticated sessions, loads its shard and serves: rank 0 behind this node's HTTP APIs
//!    (a split [`Scheduler`](shoal_engine::scheduler::Scheduler)), the others serving steps.
//!    A rank that stops leaves its loaded shard behind (`kept.rs`); the next placement's
//!    rank here that holds the same share takes it instead of loading the file again.
//!
//! Each node publishes what it holds (key `models`, [`models`]: name, SHA-256, size and
//! planner profile of every complete model file) so that any node can place a model and any
//! node can find a source for it, including a coordinator that took over after the one that
//! placed it died.
//!
//! This file holds the [`Driver`] itself: its state, its start, what it shares between the
//! loop, the rank threads and the request handlers, and the [`InstanceControl`] the HTTP
//! routes call.

mod control;
pub mod decisions;
mod fetch;
mod kept;
pub mod models;
pub mod protocol;
mod rank;
pub mod report;
mod tick;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::Value;
use shoal_api::{AppState, ControlError, ControlFuture, InstanceControl, InstanceView};
use shoal_cluster::instances::{InstanceState, InstanceTable};
use shoal_cluster::node::Node;
use shoal_engine::model::LoadedModel;
use shoal_planner::{Cluster, ModelProfile};

pub use models::{describe_model, model_id, profile_from_model, ModelFile};

use fetch::Manifest;
use protocol::ControlRequest;
use rank::LocalRank;
use report::RankReport;

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
    /// Prompt-lookup speculative decoding on the instances this node leads: tokens drafted
    /// per step at most (0: off). On a split instance only when every node of its placement
    /// runs such steps ([`shoal_cluster::protocol::SPLIT_SPECULATION`]).
    pub lookup: usize,
    /// Whether each step checks only the drafted tokens that pay for their rows
    /// ([`shoal_engine::scheduler::SchedulerConfig::adaptive_drafts`]).
    pub adaptive_drafts: bool,
    /// A draft model (loaded here) for the instances this node leads whose vocabulary it
    /// shares, drafting up to `draft_max` tokens per step beside rank 0; on a split instance
    /// only when every node of its placement runs steps of several rows, as for `lookup`.
    pub draft: Option<Arc<LoadedModel>>,
    /// Tokens the draft model (or the prediction layer) drafts per step at most.
    pub draft_max: usize,
    /// Drafting with the model's own multi-token-prediction layer on the instances this node
    /// leads whose model has one (and no draft model here shares its vocabulary), up to
    /// `draft_max` tokens per step: the lead loads the layer beside rank 0's share (fetching
    /// its bytes with the share's where it lacks the file); on a split instance only when
    /// every node of its placement returns the rows' hidden states
    /// ([`shoal_cluster::protocol::SPLIT_HIDDEN`]).
    pub mtp: bool,
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
    /// The API address of each placing or loading instance's rank-0 node, by instance id.
    placed_leads: Mutex<HashMap<String, String>>,
    /// Whether this node holds the cluster's instance table (see
    /// [`InstanceControl::table_merged`]).
    table_merged: std::sync::atomic::AtomicBool,
    /// Manifests computed for files this node shares, by SHA-256.
    manifests: Mutex<HashMap<String, Arc<Manifest>>>,
    /// Shards stopped ranks left for the next placement's ranks here.
    kept: kept::Kept,
    /// Coordinating: the nodes each instance's ranks found without disk room for their
    /// share (it is placed without them).
    no_room: Mutex<HashMap<String, std::collections::BTreeSet<String>>>,
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
            placed_leads: Mutex::new(HashMap::new()),
            table_merged: std::sync::atomic::AtomicBool::new(false),
            kept: kept::Kept::default(),
            no_room: Mutex::new(HashMap::new()),
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
        self.node.share_file(&m.sha256, m.parts.clone());
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

    /// The driver's own `Arc` ([`Driver::start`] always makes one).
    fn self_arc(&self) -> Arc<Driver> {
        self.me
            .upgrade()
            .expect("the driver is alive while it is called")
    }
}

impl InstanceControl for Driver {
    fn load(&self, request: Value) -> ControlFuture {
        let me = self.self_arc();
        Box::pin(async move { me.load_request(request).await.map(|o| o.to_value()) })
    }

    fn unload(&self, id: String) -> ControlFuture {
        let me = self.self_arc();
        Box::pin(async move {
            me.to_coordinator(ControlRequest::Unload { id })
                .await
                .map(|o| o.to_value())
        })
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
            me.to_coordinator(ControlRequest::Drain { node: id })
                .await
                .map(|o| o.to_value())
        })
    }

    fn lead_api(&self, id: &str) -> Option<String> {
        self.leads.lock().unwrap().get(id).cloned()
    }

    fn ready_ids(&self) -> Vec<String> {
        self.leads.lock().unwrap().keys().cloned().collect()
    }

    fn plan(&self, request: Value) -> ControlFuture {
        let me = self.self_arc();
        Box::pin(async move { me.plan_request(request).await })
    }

    fn models(&self) -> ControlFuture {
        let me = self.self_arc();
        Box::pin(async move { Ok(me.offered_models().await) })
    }

    fn table_merged(&self) -> bool {
        self.table_merged.load(std::sync::atomic::Ordering::Acquire)
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
            placed_lead_api: self.placed_leads.lock().unwrap().get(id).cloned(),
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
