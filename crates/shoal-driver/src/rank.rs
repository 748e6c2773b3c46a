//! The ranks this node runs, one thread each. A rank thread finds the model file (here by
//! SHA-256 or name, else the parts it reads fetched from the nodes that offer it, see
//! `fetch.rs`), joins the instance's mesh of authenticated sessions, loads its shard (or
//! takes the one its predecessor here left for the same share, see `kept.rs`) and serves
//! until it is stopped or fails, then leaves its shard for the next placement: rank 0
//! registers a split [`ServedModel`] with this node's HTTP APIs and watches its scheduler,
//! the others serve steps. What it is doing goes into this node's rank reports, which the
//! coordinator follows.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use shoal_api::ServedModel;
use shoal_cluster::instances::Instance;
use shoal_cluster::mesh::SessionTransport;
use shoal_cluster::protocol::{SPLIT_HIDDEN, SPLIT_SPECULATION};
use shoal_comm::Rebindable;
use shoal_engine::model::LoadedModel;
use shoal_engine::parallel::{serve, RankContext};
use shoal_engine::scheduler::{check_draft, SchedulerConfig};
use shoal_engine::shard::{Layout, ShardPlan};
use shoal_engine::transformer::Reuse;
use shoal_model::source::ModelSource;

use crate::fetch::NoRoom;
use crate::kept::{KeptShard, ShareKey};
use crate::report::RankState;
use crate::Driver;

/// How long a rank that lacks its model waits for another node's offer of it to arrive by
/// gossip (the node that asked for the load publishes its file just before).
const OFFER_WAIT: Duration = Duration::from_secs(15);
/// How long ranks wait for each other to join an instance's mesh.
const MESH_WAIT: Duration = Duration::from_secs(600);
/// How long a rank of a new placement waits for the rank it replaces here to leave its
/// shard behind (it was told to stop in the same pass that started this one).
const OLDER_RANK_WAIT: Duration = Duration::from_secs(10);
/// How long a stopped lead waits for its scheduler's thread to end before it lets the shard
/// go instead of keeping it.
const RETIRE_WAIT: Duration = Duration::from_secs(5);
/// How long a collective may wait: ranks idle between requests, and a dead peer is found by
/// membership (which closes the mesh), not by this timeout.
const COLLECTIVE_WAIT: Duration = Duration::from_secs(24 * 3600);

/// What a rank thread shares with the loop that started it.
#[derive(Default)]
pub(crate) struct RankHandle {
    /// Set to stop the rank.
    stop: AtomicBool,
    /// The instance's mesh, once joined (closed to wake a rank waiting on its peers).
    mesh: Mutex<Option<Arc<SessionTransport>>>,
    /// The model rank 0 registered with this node's APIs, once it did.
    served: Mutex<Option<Arc<ServedModel>>>,
}

/// A rank this node runs.
pub(crate) struct LocalRank {
    pub(crate) generation: u64,
    pub(crate) handle: Arc<RankHandle>,
}

impl LocalRank {
    /// A rank of placement `generation`, not started yet.
    pub(crate) fn new(generation: u64) -> Self {
        LocalRank {
            generation,
            handle: Arc::new(RankHandle::default()),
        }
    }

    /// Tells the rank to stop and wakes it; returns the model it serves, if it is rank 0
    /// and registered one (for the caller to remove that one, and no other).
    pub(crate) fn stop(&self, why: &str) -> Option<Arc<ServedModel>> {
        self.handle.stop.store(true, Ordering::Release);
        if let Some(m) = self.handle.mesh.lock().unwrap().as_ref() {
            m.close(why);
        }
        self.handle.served.lock().unwrap().clone()
    }
}

/// Rank 0's watch over the model it serves: until it is stopped (`Ok`) or its scheduler
/// fails (the reason).
fn lead(served: &ServedModel, stop: &AtomicBool) -> anyhow::Result<()> {
    loop {
        if stop.load(Ordering::Acquire) {
            return Ok(());
        }
        if let Some(why) = served.scheduler.failure() {
            bail!("{why}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

impl Driver {
    pub(crate) fn rank_thread(
        self: Arc<Self>,
        inst: Instance,
        rank: usize,
        handle: Arc<RankHandle>,
    ) {
        let result = self.run_rank(&inst, rank, &handle);
        let mesh = handle.mesh.lock().unwrap().take();
        let suspect = mesh.as_ref().and_then(|m| m.broken_peer());
        if let Some(m) = mesh {
            m.close("the rank ended");
        }
        match result {
            Ok(()) => tracing::info!(instance = %inst.id, rank, "rank stopped"),
            Err(e) if handle.stop.load(Ordering::Acquire) => {
                tracing::info!(instance = %inst.id, rank, "rank stopped: {e:#}")
            }
            Err(e) => {
                tracing::warn!(instance = %inst.id, rank, suspect = ?suspect, "rank failed: {e:#}");
                let no_room = e.chain().any(|c| c.is::<NoRoom>());
                self.report_failure(&inst, format!("{e:#}"), suspect, no_room);
            }
        }
    }

    /// Whether every node of `inst`'s placement speaks protocol `version` or later: with
    /// [`SPLIT_SPECULATION`] its ranks run split steps of several tokens per sequence (so
    /// that the lead may check drafted tokens), with [`SPLIT_HIDDEN`] they also return the
    /// rows' hidden states (so that the lead may draft with the prediction layer). A node
    /// whose facts are unknown counts as one that does not.
    fn placement_speaks(&self, inst: &Instance, version: u32) -> bool {
        let nodes = self.rt.block_on(self.node.nodes());
        inst.nodes().iter().all(|id| {
            nodes
                .iter()
                .any(|n| n.id == *id && n.facts.as_ref().is_some_and(|f| f.protocol >= version))
        })
    }

    /// The model's multi-token-prediction layer for the lead of `inst` to draft with, loaded
    /// from `path` beside rank 0's share: where this node drafts with it (`--mtp`), the
    /// model has one and every node of the placement returns the rows' hidden states. A
    /// failure to load it is logged and the instance served without it.
    fn prediction_layer(
        &self,
        inst: &Instance,
        model: &LoadedModel,
        path: &Path,
    ) -> Option<Arc<LoadedModel>> {
        if !self.cfg.mtp || model.transformer.config().mtp_layers == 0 {
            return None;
        }
        if !self.placement_speaks(inst, SPLIT_HIDDEN) {
            tracing::info!(instance = %inst.id, "no drafting with the prediction layer: a node of the placement runs an older shoal");
            return None;
        }
        // the planner does not count the layer in the lead's share: load it only where the
        // memory is there
        let need = prediction_bytes(path);
        let available = shoal_cluster::facts::memory().map(|(_, available)| available);
        if let (Some(need), Some(available)) = (need, available) {
            if need + need / 4 > available {
                tracing::info!(
                    instance = %inst.id,
                    need_mb = need / 1_000_000,
                    available_mb = available / 1_000_000,
                    "no drafting with the prediction layer: the memory for it is not there"
                );
                return None;
            }
        }
        let t0 = Instant::now();
        match LoadedModel::load_prediction_layer(&ModelSource::Gguf(path.to_path_buf())) {
            Ok(layer) => {
                tracing::info!(instance = %inst.id, ms = t0.elapsed().as_millis() as u64, "drafting with the model's prediction layer");
                Some(Arc::new(layer))
            }
            Err(e) => {
                tracing::warn!(instance = %inst.id, "no drafting with the prediction layer: {e}");
                None
            }
        }
    }

    fn run_rank(&self, inst: &Instance, rank: usize, handle: &RankHandle) -> anyhow::Result<()> {
        let stop = &handle.stop;
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
        self.report(
            inst,
            RankState::Loading,
            Some("joining the other ranks".into()),
        );
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
        *handle.mesh.lock().unwrap() = Some(transport.clone());
        if stop.load(Ordering::Acquire) {
            transport.close("the instance was stopped");
            return Ok(());
        }
        let layout = Layout {
            tp: inst.placement.tp,
            pp: inst.placement.pp(),
        };
        let mut ctx = RankContext::over(transport, layout, COLLECTIVE_WAIT)?;
        // the rank this one replaces here may still be leaving its shard behind
        self.kept
            .wait_for_older(&inst.id, inst.generation, OLDER_RANK_WAIT);
        let key = ShareKey::of(inst, rank, &path);
        let (model, tp, reuse) = match self.kept.take(&inst.id, &key) {
            Some(k) => {
                k.tp.bind(ctx.tp.clone())
                    .map_err(|e| anyhow::anyhow!("rebinding the kept shard: {e}"))?;
                ctx.plans = k.plans;
                tracing::info!(instance = %inst.id, rank, from = k.generation, "kept the shard loaded for the previous placement");
                let reuse = Reuse {
                    layers_kept: key.layers().len(),
                    layers_loaded: 0,
                };
                (k.model, k.tp, reuse)
            }
            None => {
                let tp = Arc::new(Rebindable::new(ctx.tp.clone()));
                let (model, plans, reuse) =
                    self.load_share(inst, rank, &path, &key, layout, tp.clone())?;
                ctx.plans = plans;
                (Arc::new(model), tp, reuse)
            }
        };
        if let Some(state) = self.state.upgrade() {
            state
                .metrics
                .shard(&inst.id, reuse.layers_kept, reuse.layers_loaded);
        }
        ctx.tp = tp.clone();
        let _holding = self.kept.hold(&inst.id, inst.generation);
        let plans = ctx.plans.clone();
        let keep = |model: Arc<LoadedModel>| {
            self.kept.keep(KeptShard {
                instance: inst.id.clone(),
                generation: inst.generation,
                key: key.clone(),
                model,
                tp: tp.clone(),
                plans: plans.clone(),
                since: Instant::now(),
            })
        };
        let capacity = (inst.ctx as usize)
            .min(model.transformer.config().context_len)
            .max(2);
        if rank == 0 {
            let speculates = self.placement_speaks(inst, SPLIT_SPECULATION);
            // the node's draft model drafts for the instances whose vocabulary it shares
            let draft = self.cfg.draft.clone().filter(|d| {
                let fits = check_draft(&model, d);
                if let Err(e) = &fits {
                    tracing::info!(instance = %inst.id, "no draft model: {e}");
                }
                speculates && fits.is_ok()
            });
            // else the model's own prediction layer, where it has one
            let layer = match (&draft, speculates) {
                (None, true) => self.prediction_layer(inst, &model, &path),
                _ => None,
            };
            let draft_max = match (&draft, &layer) {
                (Some(_), _) | (_, Some(_)) => self.cfg.draft_max,
                _ if self.cfg.lookup > 0 && speculates => self.cfg.lookup,
                _ => 0,
            };
            let config = SchedulerConfig {
                max_batch: self.cfg.parallel,
                max_queue: self.cfg.queue,
                ctx: capacity,
                prefix_cache: self.cfg.prefix_cache,
                draft_max,
                adaptive_drafts: self.cfg.adaptive_drafts,
            };
            let id = inst.id.clone();
            let served = Arc::new(match (draft, layer) {
                (Some(d), _) => ServedModel::start_split_with_draft(id, model, ctx, d, config)?,
                (None, Some(l)) => ServedModel::start_split_with_mtp(id, model, ctx, l, config)?,
                (None, None) => ServedModel::start_split(id, model, ctx, config)?,
            });
            let state = self
                .state
                .upgrade()
                .context("the server is shutting down")?;
            // kept before it is served, so that a stop from now on removes it
            *handle.served.lock().unwrap() = Some(served.clone());
            state.add_model(served.clone());
            self.report(inst, RankState::Ready, None);
            tracing::info!(instance = %inst.id, "serving");
            drop(state);
            let result = lead(&served, stop);
            // let go of it (its weights), and stop serving this model and no other: a newer
            // generation of the instance may be served under the same id already
            handle.served.lock().unwrap().take();
            if let Some(state) = self.state.upgrade() {
                state.remove_served(&served);
            }
            // the requests it runs go on where the instance is served next; once its thread
            // has ended nothing steps the shard, and the next placement may take it
            if served
                .scheduler
                .retire("the instance is being placed again", RETIRE_WAIT)
            {
                keep(served.scheduler.model().clone());
            }
            return result;
        }
        self.report(inst, RankState::Ready, None);
        let result = serve(&ctx, &model.transformer, capacity);
        keep(model);
        result?;
        Ok(())
    }

    /// Loads rank `rank`'s share `key` of `inst` from `path`, its layers summing over `tp`:
    /// from the shard kept here with the most layers in common with it, reading only what
    /// that lacks, or else from the file alone.
    fn load_share(
        &self,
        inst: &Instance,
        rank: usize,
        path: &Path,
        key: &ShareKey,
        layout: Layout,
        tp: Arc<Rebindable>,
    ) -> anyhow::Result<(LoadedModel, Vec<ShardPlan>, Reuse)> {
        let source = ModelSource::Gguf(path.to_path_buf());
        let sizes = inst.placement.stage_sizes();
        let experts = inst.placement.experts;
        let context = || format!("loading rank {rank}'s shard of {}", path.display());
        let Some(old) = self.kept.take_overlapping(inst, self.node.id(), key) else {
            self.report(inst, RankState::Loading, Some("loading its shard".into()));
            let (model, plans) =
                LoadedModel::load_split(&source, layout, Some(&sizes), experts, rank, tp)
                    .with_context(context)?;
            let reuse = Reuse {
                layers_kept: 0,
                layers_loaded: key.layers().len(),
            };
            return Ok((model, plans, reuse));
        };
        self.report(
            inst,
            RankState::Loading,
            Some("loading what its shard adds".into()),
        );
        let (model, plans, reuse) =
            LoadedModel::regrow_split(&old.model, &source, layout, Some(&sizes), experts, rank, tp)
                .with_context(context)?;
        tracing::info!(instance = %inst.id, rank, from = old.generation, kept = reuse.layers_kept, loaded = reuse.layers_loaded, "kept the layers of the previous placement's shard that this one holds");
        // the old share's other layers go here
        drop(old);
        Ok((model, plans, reuse))
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
        self.fetch_slice(inst, &sources, &sha, rank, stop)
    }
}

/// The bytes of the model at `path` that its prediction layer's share holds (the layer, the
/// embedding, the final norm and the output head); `None` where the file cannot be read.
fn prediction_bytes(path: &Path) -> Option<u64> {
    let file = shoal_model::gguf::GgufFile::open(path).ok()?;
    let cfg = shoal_engine::arch::config_of_file(&file, &path.display().to_string()).ok()?;
    Some(
        shoal_engine::shard::prediction_ranges(&cfg, &file)
            .iter()
            .map(|r| r.end - r.start)
            .sum(),
    )
}
