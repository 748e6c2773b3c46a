//! What a server holds: the models it serves (each with its scheduler and what the APIs need
//! to know about it), the key store and the metrics, shared by every route.

use std::sync::Arc;
use std::time::Instant;

use shoal_engine::model::LoadedModel;
use shoal_engine::scheduler::{Scheduler, SchedulerConfig};

use crate::error::{ApiError, ErrorKind};
use crate::keys::KeyStore;
use crate::metrics::Metrics;
use crate::reasoning::ReasoningFormat;
use crate::replay::Replay;
use crate::tools::ToolFormat;

/// A model this server answers for.
pub struct ServedModel {
    /// The id clients ask for (`model` in requests).
    pub id: String,
    /// Its continuous-batching scheduler (which owns the loaded model).
    pub scheduler: Scheduler,
    /// How its chat template writes tool calls.
    pub tool_format: ToolFormat,
    /// How it writes its reasoning, if it reasons.
    pub reasoning: ReasoningFormat,
    /// Recorded outputs given instead of sampled ones (see [`crate::replay`]).
    pub replay: Option<Arc<Replay>>,
    /// Context length per request (prompt plus output).
    pub ctx: usize,
    /// Unix seconds when it was loaded.
    pub created: u64,
    /// Size of its weights in bytes.
    pub size: u64,
    /// Constraint tables, built on the first constrained request.
    pub constraint_vocab:
        std::sync::OnceLock<Result<Arc<shoal_engine::constrain::ConstraintVocab>, String>>,
    /// The most bytes one token of its vocabulary stands for, found on first use.
    longest_token: std::sync::OnceLock<usize>,
}

impl std::fmt::Debug for ServedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServedModel").field("id", &self.id).finish()
    }
}

/// What drafts tokens for a served model when its speculation is on.
enum Drafts {
    /// Prompt lookup (or nothing, with speculation off).
    Lookup,
    /// A draft model.
    Model(Arc<LoadedModel>),
    /// The model's own prediction layer (on a split, the lead's share holding it).
    Mtp(Option<Arc<LoadedModel>>),
}

impl ServedModel {
    /// Starts serving `model` as `id` with `config`'s limits.
    ///
    /// # Errors
    /// When the scheduler cannot start.
    pub fn start(
        id: impl Into<String>,
        model: LoadedModel,
        config: SchedulerConfig,
    ) -> Result<Self, shoal_engine::EngineError> {
        Self::build(id.into(), Arc::new(model), config, None, Drafts::Lookup)
    }

    /// Starts serving `model` as `id` with speculative decoding by its own
    /// multi-token-prediction layer (see [`Scheduler::start_with_mtp`]).
    ///
    /// # Errors
    /// When the model has no such layer, speculation is off, or the scheduler cannot start.
    pub fn start_with_mtp(
        id: impl Into<String>,
        model: LoadedModel,
        config: SchedulerConfig,
    ) -> Result<Self, shoal_engine::EngineError> {
        Self::build(id.into(), Arc::new(model), config, None, Drafts::Mtp(None))
    }

    /// Starts serving `model` as `id` with speculative decoding by `draft` (a smaller model
    /// with the same tokenizer; see [`Scheduler::start_with_draft`]).
    ///
    /// # Errors
    /// When the draft model's vocabulary differs, or the scheduler cannot start.
    pub fn start_with_draft(
        id: impl Into<String>,
        model: LoadedModel,
        draft: Arc<LoadedModel>,
        config: SchedulerConfig,
    ) -> Result<Self, shoal_engine::EngineError> {
        Self::build(
            id.into(),
            Arc::new(model),
            config,
            None,
            Drafts::Model(draft),
        )
    }

    /// Serves a split model: `model` is rank 0's shard and `ctx` rank 0's place in the
    /// split (see [`Scheduler::start_split`]). The shard may have served an earlier
    /// placement (see [`Scheduler::retire`]).
    pub fn start_split(
        id: impl Into<String>,
        model: Arc<LoadedModel>,
        ctx: shoal_engine::parallel::RankContext,
        config: SchedulerConfig,
    ) -> Result<Self, shoal_engine::EngineError> {
        Self::build(id.into(), model, config, Some(ctx), Drafts::Lookup)
    }

    /// Serves a split model ([`ServedModel::start_split`]) with speculative decoding by
    /// `draft`, which runs here beside rank 0 (see [`Scheduler::start_split_with_draft`]).
    ///
    /// # Errors
    /// When the draft model's vocabulary differs, or the scheduler cannot start.
    pub fn start_split_with_draft(
        id: impl Into<String>,
        model: Arc<LoadedModel>,
        ctx: shoal_engine::parallel::RankContext,
        draft: Arc<LoadedModel>,
        config: SchedulerConfig,
    ) -> Result<Self, shoal_engine::EngineError> {
        Self::build(id.into(), model, config, Some(ctx), Drafts::Model(draft))
    }

    /// Serves a split model ([`ServedModel::start_split`]) with speculative decoding by the
    /// model's multi-token-prediction layer, which `layer` holds here beside rank 0 (see
    /// [`Scheduler::start_split_with_mtp`]).
    ///
    /// # Errors
    /// When `layer` holds no such layer of the model, speculation is off, or the scheduler
    /// cannot start.
    pub fn start_split_with_mtp(
        id: impl Into<String>,
        model: Arc<LoadedModel>,
        ctx: shoal_engine::parallel::RankContext,
        layer: Arc<LoadedModel>,
        config: SchedulerConfig,
    ) -> Result<Self, shoal_engine::EngineError> {
        Self::build(
            id.into(),
            model,
            config,
            Some(ctx),
            Drafts::Mtp(Some(layer)),
        )
    }

    fn build(
        id: String,
        model: Arc<LoadedModel>,
        config: SchedulerConfig,
        split: Option<shoal_engine::parallel::RankContext>,
        drafts: Drafts,
    ) -> Result<Self, shoal_engine::EngineError> {
        let template = model
            .chat_template
            .as_ref()
            .map(|t| t.source())
            .unwrap_or("");
        let tool_format =
            ToolFormat::detect(template, &format!("{:?}", model.transformer.config().arch));
        let reasoning = ReasoningFormat::detect(template);
        let size = std::fs::metadata(&model.path).map(|m| m.len()).unwrap_or(0);
        let ctx = config
            .ctx
            .min(model.transformer.config().context_len)
            .max(2);
        let config = SchedulerConfig { ctx, ..config };
        let scheduler = match (split, drafts) {
            (None, Drafts::Lookup) => Scheduler::start(model, config)?,
            (None, Drafts::Model(d)) => Scheduler::start_with_draft(model, d, config)?,
            (None, Drafts::Mtp(_)) => Scheduler::start_with_mtp(model, config)?,
            (Some(rc), Drafts::Lookup) => Scheduler::start_split(model, rc, config)?,
            (Some(rc), Drafts::Model(d)) => {
                Scheduler::start_split_with_draft(model, rc, d, config)?
            }
            (Some(rc), Drafts::Mtp(Some(layer))) => {
                Scheduler::start_split_with_mtp(model, rc, layer, config)?
            }
            (Some(_), Drafts::Mtp(None)) => {
                return Err(shoal_engine::EngineError::InvalidInput {
                    what: "drafting with the prediction layer on a split model needs the layer loaded beside rank 0 (LoadedModel::load_prediction_layer)".into(),
                })
            }
        };
        Ok(ServedModel {
            id,
            scheduler,
            tool_format,
            reasoning,
            replay: None,
            ctx,
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            size,
            constraint_vocab: std::sync::OnceLock::new(),
            longest_token: std::sync::OnceLock::new(),
        })
    }

    /// The most bytes one token of the model's vocabulary stands for: a text of more than
    /// `ctx` times this many bytes cannot fit the context, whatever it says.
    pub fn longest_token_bytes(&self) -> usize {
        *self.longest_token.get_or_init(|| {
            let model = self.model();
            (0..model.transformer.config().vocab as u32)
                .map(|id| model.tokenizer.token_bytes(id).len())
                .max()
                .unwrap_or(1)
                .max(1)
        })
    }

    /// The loaded model.
    pub fn model(&self) -> &LoadedModel {
        self.scheduler.model()
    }

    /// Serves `replay`'s recorded outputs instead of sampled ones (see [`crate::replay`]).
    pub fn with_replay(mut self, replay: Replay) -> Self {
        self.replay = Some(Arc::new(replay));
        self
    }
}

/// Everything the routes share.
/// Why a cluster instance operation failed: the HTTP status to answer and what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlError {
    /// 400 (bad request), 404 (no such instance or node), 409 (conflicts with the table),
    /// 503 (the cluster cannot do it now).
    pub status: u16,
    /// What was wrong and what to do.
    pub message: String,
}

/// What a cluster instance operation answers.
pub type ControlFuture = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<serde_json::Value, ControlError>> + Send>,
>;

/// Places and removes model instances on the cluster (the node's instance driver).
pub trait InstanceControl: Send + Sync {
    /// Loads an instance: `{"model", "id"?, "strategy"?, "nodes"?, "ctx"?}`.
    fn load(&self, request: serde_json::Value) -> ControlFuture;
    /// Unloads instance `id`.
    fn unload(&self, id: String) -> ControlFuture;
    /// Moves every instance off node `node` (id or name).
    fn drain(&self, node: String) -> ControlFuture;
    /// The instance table, with each instance's lead API address.
    fn list(&self) -> ControlFuture;
    /// The HTTP API address of the node leading ready instance `id`, if there is one.
    fn lead_api(&self, id: &str) -> Option<String>;
    /// The ids of the ready instances (each led by some node).
    fn ready_ids(&self) -> Vec<String>;
    /// Where instance `id` stands in the instance table (`None`: no such instance).
    fn instance(&self, id: &str) -> Option<InstanceView>;
    /// Whether this node holds the cluster's instance table yet: a node that just joined
    /// has seen no peer's table, and an instance it does not know of may well exist.
    fn table_merged(&self) -> bool {
        true
    }
    /// The planner's ranked placements for a load request (same fields as [`Self::load`]),
    /// without placing anything: `{"model", "candidates": [...]}`.
    fn plan(&self, request: serde_json::Value) -> ControlFuture;
    /// The model files the cluster's nodes offer: `{"models": [{"name", "size", "sha256",
    /// "nodes"}]}`.
    fn models(&self) -> ControlFuture;
}

/// An instance as a request running on it sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceView {
    /// `placing`, `loading`, `ready`, `failed` or `unloading`.
    pub state: String,
    /// Its placement's generation (one more each time it is placed again).
    pub generation: u64,
    /// Whether this node leads it (holds its rank 0).
    pub lead_here: bool,
    /// The HTTP API address of the node that leads it, when known.
    pub lead_api: Option<String>,
    /// While it is placed or loading: the HTTP API address of its new placement's rank-0
    /// node, when known (it answers 503 until it serves the model).
    pub placed_lead_api: Option<String>,
    /// Why it failed, when it did.
    pub reason: Option<String>,
}

/// The instance driver as the routes hold it.
#[derive(Clone)]
pub struct Control(pub Arc<dyn InstanceControl>);

impl std::fmt::Debug for Control {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("InstanceControl")
    }
}

#[derive(Debug)]
pub struct AppState {
    /// Models served, by id.
    /// What this node serves; instances placed by the cluster come and go.
    pub models: std::sync::RwLock<Vec<Arc<ServedModel>>>,
    /// API keys.
    pub keys: KeyStore,
    /// Metrics.
    pub metrics: Metrics,
    /// When the server started.
    pub started: Instant,
    /// This node's cluster membership, when it runs in a cluster.
    pub cluster: Option<Arc<shoal_cluster::node::Node>>,
    /// The cluster's instance driver, once the node runs one.
    pub instances: std::sync::OnceLock<Control>,
    /// Addresses of this machine besides loopback (the API's own address when it is bound
    /// to one): a client connecting from one is on the server's machine.
    pub local_ips: std::sync::RwLock<Vec<std::net::IpAddr>>,
    /// Responses kept for the Responses API's `previous_response_id`.
    pub responses: crate::responses::ResponseStore,
    /// How the node was started, for `/cluster/doctor`.
    pub doctor: std::sync::OnceLock<crate::doctor::Setup>,
    /// The generated text of recent chat turns, rendered again when a client sends them back.
    pub turns: crate::turns::GeneratedTurns,
    /// The bounded pool that prepares prompts off the async workers.
    pub prompts: crate::generation::PromptPool,
}

impl AppState {
    /// A state serving `models` with `keys`.
    pub fn new(models: Vec<ServedModel>, keys: KeyStore) -> Self {
        AppState {
            models: std::sync::RwLock::new(models.into_iter().map(Arc::new).collect()),
            keys,
            metrics: Metrics::new(),
            started: Instant::now(),
            cluster: None,
            instances: std::sync::OnceLock::new(),
            local_ips: std::sync::RwLock::new(Vec::new()),
            responses: crate::responses::ResponseStore::default(),
            doctor: std::sync::OnceLock::new(),
            turns: crate::turns::GeneratedTurns::default(),
            prompts: crate::generation::PromptPool::default(),
        }
    }

    /// The same state, as a member of a cluster through `node`.
    pub fn with_cluster(mut self, node: Arc<shoal_cluster::node::Node>) -> Self {
        self.cluster = Some(node);
        self
    }

    /// The model called `name` (an Ollama-style `:latest` tag is ignored).
    ///
    /// # Errors
    /// 404 naming the models that are served.
    /// Whether a client at `peer` is on this machine (loopback, or one of `local_ips`).
    pub fn is_local(&self, peer: std::net::IpAddr) -> bool {
        peer.is_loopback()
            || self
                .local_ips
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .contains(&peer)
    }

    /// Whether the client of `req` is on this machine.
    pub fn is_local_request(&self, req: &axum::extract::Request) -> bool {
        req.extensions()
            .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
            .is_some_and(|c| self.is_local(c.0.ip()))
    }

    /// Ready cluster instances this node does not serve itself (it forwards them).
    pub fn remote_instances(&self) -> Vec<String> {
        let Some(c) = self.instances.get() else {
            return Vec::new();
        };
        let local = self.served();
        c.0.ready_ids()
            .into_iter()
            .filter(|id| !local.iter().any(|m| &m.id == id))
            .collect()
    }

    /// Every model served now.
    pub fn served(&self) -> Vec<Arc<ServedModel>> {
        self.models
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Starts serving `model` (replacing one with the same id).
    pub fn add_model(&self, model: Arc<ServedModel>) {
        let mut m = self.models.write().unwrap_or_else(|e| e.into_inner());
        m.retain(|x| x.id != model.id);
        m.push(model);
    }

    /// Stops serving `id`; returns it (requests in flight keep it alive until they end).
    pub fn remove_model(&self, id: &str) -> Option<Arc<ServedModel>> {
        let mut m = self.models.write().unwrap_or_else(|e| e.into_inner());
        let i = m.iter().position(|x| x.id == id)?;
        Some(m.remove(i))
    }

    /// Stops serving exactly `served` (compared by pointer), not another model registered
    /// under its id since, such as a newer generation of the same cluster instance; whether
    /// it was served.
    pub fn remove_served(&self, served: &Arc<ServedModel>) -> bool {
        let mut m = self.models.write().unwrap_or_else(|e| e.into_inner());
        let before = m.len();
        m.retain(|x| !Arc::ptr_eq(x, served));
        m.len() != before
    }

    pub fn model(&self, name: &str) -> Result<Arc<ServedModel>, ApiError> {
        let base = name.strip_suffix(":latest").unwrap_or(name);
        let models = self.served();
        if let Some(m) = models.iter().find(|m| m.id == name || m.id == base) {
            return Ok(m.clone());
        }
        let known: Vec<&str> = models.iter().map(|m| m.id.as_str()).collect();
        // A cluster instance not served here now: this node's view or the sender's is a
        // moment old (a request forwarded to a lead that just lost its split, or to a node
        // that has not started serving), so the answer says to retry, not that it is missing.
        if let Some(control) = self.instances.get() {
            if let Some(view) = control.0.instance(base) {
                let message = match control.0.lead_api(base) {
                    Some(api) => format!(
                        "model '{name}' is a cluster instance led by another node: send the \
                         request to http://{api}, or retry here shortly"
                    ),
                    None => format!(
                        "model '{name}' is a cluster instance {} on the cluster and not served \
                         by this node now; retry shortly",
                        view.state
                    ),
                };
                return Err(ApiError::new(ErrorKind::Overloaded, message));
            }
        }
        Err(ApiError::new(
            ErrorKind::NotFound,
            if name.is_empty() {
                format!(
                    "no model was named; this server serves: {}",
                    known.join(", ")
                )
            } else {
                format!(
                    "model '{name}' is not served here; this server serves: {}",
                    known.join(", ")
                )
            },
        ))
    }

    /// Copies each scheduler's live counters into the metrics.
    pub fn refresh_gauges(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        for m in &self.served() {
            let s = m.scheduler.stats();
            self.metrics.scheduler(
                &m.id,
                s.queued.load(Relaxed),
                s.active.load(Relaxed),
                s.last_batch.load(Relaxed),
                s.decode_steps.load(Relaxed),
            );
            self.metrics.prefix_cache(&m.id, s);
        }
    }
}
