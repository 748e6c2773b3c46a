//! What a server holds: the models it serves (each with its scheduler and what the APIs need
//! to know about it), the key store and the metrics, shared by every route.

use std::sync::Arc;
use std::time::Instant;

use shoal_engine::model::LoadedModel;
use shoal_engine::scheduler::{Scheduler, SchedulerConfig};

use crate::error::{ApiError, ErrorKind};
use crate::keys::KeyStore;
use crate::metrics::Metrics;
use crate::tools::ToolFormat;

/// A model this server answers for.
pub struct ServedModel {
    /// The id clients ask for (`model` in requests).
    pub id: String,
    /// Its continuous-batching scheduler (which owns the loaded model).
    pub scheduler: Scheduler,
    /// How its chat template writes tool calls.
    pub tool_format: ToolFormat,
    /// Context length per request (prompt plus output).
    pub ctx: usize,
    /// Unix seconds when it was loaded.
    pub created: u64,
    /// Size of its weights in bytes.
    pub size: u64,
    /// Constraint tables, built on the first constrained request.
    pub constraint_vocab:
        std::sync::OnceLock<Result<Arc<shoal_engine::constrain::ConstraintVocab>, String>>,
}

impl std::fmt::Debug for ServedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServedModel").field("id", &self.id).finish()
    }
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
        let tool_format = ToolFormat::detect(
            model
                .chat_template
                .as_ref()
                .map(|t| t.source())
                .unwrap_or(""),
            &format!("{:?}", model.transformer.config().arch),
        );
        let size = std::fs::metadata(&model.path).map(|m| m.len()).unwrap_or(0);
        let ctx = config
            .ctx
            .min(model.transformer.config().context_len)
            .max(2);
        let scheduler = Scheduler::start(Arc::new(model), SchedulerConfig { ctx, ..config })?;
        Ok(ServedModel {
            id: id.into(),
            scheduler,
            tool_format,
            ctx,
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            size,
            constraint_vocab: std::sync::OnceLock::new(),
        })
    }

    /// The loaded model.
    pub fn model(&self) -> &LoadedModel {
        self.scheduler.model()
    }
}

/// Everything the routes share.
#[derive(Debug)]
pub struct AppState {
    /// Models served, by id.
    pub models: Vec<Arc<ServedModel>>,
    /// API keys.
    pub keys: KeyStore,
    /// Metrics.
    pub metrics: Metrics,
    /// When the server started.
    pub started: Instant,
    /// This node's cluster membership, when it runs in a cluster.
    pub cluster: Option<Arc<shoal_cluster::node::Node>>,
}

impl AppState {
    /// A state serving `models` with `keys`.
    pub fn new(models: Vec<ServedModel>, keys: KeyStore) -> Self {
        AppState {
            models: models.into_iter().map(Arc::new).collect(),
            keys,
            metrics: Metrics::new(),
            started: Instant::now(),
            cluster: None,
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
    pub fn model(&self, name: &str) -> Result<Arc<ServedModel>, ApiError> {
        let base = name.strip_suffix(":latest").unwrap_or(name);
        if let Some(m) = self.models.iter().find(|m| m.id == name || m.id == base) {
            return Ok(m.clone());
        }
        let known: Vec<&str> = self.models.iter().map(|m| m.id.as_str()).collect();
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
        for m in &self.models {
            let s = m.scheduler.stats();
            self.metrics.scheduler(
                &m.id,
                s.queued.load(Relaxed),
                s.active.load(Relaxed),
                s.last_batch.load(Relaxed),
                s.decode_steps.load(Relaxed),
            );
        }
    }
}
