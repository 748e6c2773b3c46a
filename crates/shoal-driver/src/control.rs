//! The requests that change or show the instance table. A client's load, unload or drain
//! reaches whichever node it asked; that node sends it to the coordinator (itself, or another
//! node through [`Node::ask`](shoal_cluster::node::Node::ask)), which applies it to the table
//! and answers. Nodes also ask each other for the manifest of a file they fetch from. The
//! messages are the typed ones of [`crate::protocol`]; a refusal travels as an answer, so its
//! HTTP status reaches the client.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use shoal_api::ControlError;
use shoal_cluster::instances::{coordinator, is_coordinator, InstanceState, NewInstance};
use shoal_cluster::node::AppCall;
use shoal_planner::{Cluster, PlanRequest};

use crate::protocol::{ControlAnswer, ControlRequest, LoadBody, LoadOp, Outcome};
use crate::{decisions, describe_model, err, now_ms, Driver, COORDINATOR_AGREEMENT};

impl Driver {
    /// Answers application requests from other nodes.
    pub(crate) async fn answer(
        self: Arc<Self>,
        mut requests: tokio::sync::mpsc::Receiver<AppCall>,
    ) {
        while let Some((from, body, reply)) = requests.recv().await {
            let me = self.clone();
            tokio::spawn(async move {
                let r = me.handle(&from, body).await;
                let _ = reply.send(r);
            });
        }
    }

    /// One request from node `from`: a malformed or unknown one is an error for the asker.
    async fn handle(&self, from: &str, body: Value) -> Result<Value, String> {
        let request = ControlRequest::from_value(body)?;
        if let ControlRequest::Manifest { sha256 } = &request {
            let sha = sha256.to_ascii_lowercase();
            return self
                .manifest(&sha)
                .await
                .map(|m| serde_json::to_value(&*m).expect("manifest serializes"))
                .map_err(|e| format!("{e:#}"));
        }
        let live = self.node.live_ids();
        if !is_coordinator(self.node.id(), &live) {
            // views of who is alive differ for a moment after a join or a death:
            // the asker retries once its own view has caught up
            return Ok(ControlAnswer::NotCoordinator {
                node: self.node.id().to_string(),
                ask: coordinator(&live).unwrap_or("none").to_string(),
            }
            .to_value());
        }
        tracing::info!(from, op = request.name(), "coordinator request");
        // a refusal travels as an answer, so its status reaches the client
        Ok(ControlAnswer::of(self.apply(&request).await).to_value())
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
    async fn apply(&self, request: &ControlRequest) -> Result<Outcome, ControlError> {
        let me = self.node.id().to_string();
        let cluster = self.measured_cluster(Duration::from_secs(15)).await;
        let table = self.table.lock().unwrap().clone();
        let (next, answer) = match request {
            ControlRequest::Load(op) => {
                self.profiles
                    .lock()
                    .unwrap()
                    .insert(op.model.clone(), op.profile.clone());
                let new = NewInstance {
                    id: op.id.clone(),
                    model: op.model.clone(),
                    model_sha256: op.sha256.clone(),
                };
                let t = table
                    .load(&me, new, &op.profile, &cluster, &op.request, now_ms())
                    .map_err(|e| {
                        let status = match e {
                            shoal_cluster::instances::InstanceError::Duplicate { .. } => 409,
                            _ => 400,
                        };
                        err(status, e.to_string())
                    })?;
                let instance = t
                    .get(&op.id)
                    .cloned()
                    .ok_or_else(|| err(500, "the loaded instance is missing from the table"))?;
                let loaded = Outcome::Loaded {
                    instance: Box::new(instance),
                };
                (t, loaded)
            }
            ControlRequest::Unload { id } => {
                let t = table
                    .unload(&me, id, now_ms())
                    .map_err(|e| err(404, e.to_string()))?;
                let unloading = id.clone();
                (t, Outcome::Unloading { unloading })
            }
            ControlRequest::Drain { node } => {
                let moving = decisions::instances_on(&table, std::slice::from_ref(node));
                let cluster = decisions::releasing(&table, &moving, &cluster, |m| self.profile(m));
                let t = table.drain(&me, node, &|m| self.profile(m), &cluster, now_ms());
                // refuse rather than fail a running instance that has nowhere to go
                let stranded = decisions::stranded(&table, &t);
                if !stranded.is_empty() {
                    return Err(err(
                        409,
                        format!(
                            "node {node} is not drained: its instances would have nowhere to go ({}); unload them or add nodes first",
                            stranded.join("; ")
                        ),
                    ));
                }
                let moved = decisions::replaced(&table, &t)
                    .into_iter()
                    .map(|i| i.id.clone())
                    .collect();
                let drained = node.clone();
                (t, Outcome::Drained { drained, moved })
            }
            ControlRequest::Manifest { .. } => {
                return Err(err(
                    400,
                    "a manifest request is not a coordinator operation",
                ))
            }
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
    /// up to [`COORDINATOR_AGREEMENT`]. So it does while the node taken for the coordinator
    /// refuses connections (it died, and the failure detector has not said so yet).
    pub(crate) async fn to_coordinator(
        &self,
        request: ControlRequest,
    ) -> Result<Outcome, ControlError> {
        let deadline = Instant::now() + COORDINATOR_AGREEMENT;
        let body = request.to_value();
        loop {
            let live = self.node.live_ids();
            let coord = coordinator(&live)
                .map(str::to_string)
                .unwrap_or_else(|| self.node.id().to_string());
            if coord == self.node.id() {
                return self.apply(&request).await;
            }
            let answer = match self
                .node
                .ask(&coord, body.clone(), Duration::from_secs(30))
                .await
            {
                Ok(answer) => answer,
                // a coordinator that died a moment ago stays live in this node's view until
                // the failure detector says otherwise: wait for the view to move on
                Err(e)
                    if Instant::now() < deadline && self.node.refuses_connections(&coord).await =>
                {
                    tracing::debug!(%coord, "the coordinator refuses connections ({e}); waiting");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
                Err(e) => return Err(err(503, format!("the coordinator could not be asked: {e}"))),
            };
            match ControlAnswer::from_value(answer).map_err(|e| err(502, e))? {
                ControlAnswer::Ok(outcome) => return Ok(outcome),
                ControlAnswer::Refused { status, message } => return Err(err(status, message)),
                ControlAnswer::NotCoordinator { ask, .. } => {
                    if Instant::now() >= deadline {
                        return Err(err(
                            503,
                            format!(
                                "the nodes disagree on who coordinates: this node takes {coord} \
                                 for the coordinator, and {coord} names {ask}; they did not agree \
                                 within {}s, so check `shoal nodes` on both and retry",
                                COORDINATOR_AGREEMENT.as_secs()
                            ),
                        ));
                    }
                    tracing::debug!(%coord, %ask, "not the coordinator yet; retrying");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }

    /// This node's file called `model`, else any live node's offer of that name.
    fn file_named(&self, model: &str) -> Option<crate::ModelFile> {
        let local = self
            .files
            .lock()
            .unwrap()
            .values()
            .find(|f| f.name == model)
            .cloned();
        local.or_else(|| {
            self.offered()
                .into_iter()
                .find(|(_, f)| f.name == model)
                .map(|(_, f)| f)
        })
    }

    /// The 404 for a model no node offers, naming those the cluster does offer.
    fn no_such_model(&self, model: &str) -> ControlError {
        let offered: BTreeSet<String> = self.offered().into_iter().map(|(_, f)| f.name).collect();
        let offered = if offered.is_empty() {
            "nothing".to_string()
        } else {
            offered.into_iter().collect::<Vec<_>>().join(", ")
        };
        err(
            404,
            format!(
                "no node has model {model}; the cluster offers: {offered} (fetch it on one node with `shoal models fetch`)"
            ),
        )
    }

    /// A client's load (`req`, see [`LoadBody`]): finds the model file (this node's, any
    /// node's offer, or a path here, which this node then offers) and asks the coordinator.
    pub(crate) async fn load_request(&self, req: Value) -> Result<Outcome, ControlError> {
        let LoadBody {
            model,
            id,
            strategy,
            experts,
            ctx,
            nodes,
        } = LoadBody::parse(&req)?;
        let file = match self.file_named(&model) {
            Some(f) => f,
            None => {
                let m = model.clone();
                match tokio::task::spawn_blocking(move || describe_model(&m)).await {
                    Ok(Ok(f)) => {
                        self.add_file(f.clone());
                        self.publish_files().await;
                        f
                    }
                    // a path or a store name that this node cannot read: say why (a store
                    // missing here, a broken manifest) rather than only what is offered
                    Ok(Err(e))
                        if shoal_model::stores::has_store_prefix(&model)
                            || std::path::Path::new(&model).exists() =>
                    {
                        return Err(err(404, format!("{model} on this node: {e:#}")))
                    }
                    _ => return Err(self.no_such_model(&model)),
                }
            }
        };
        let id = id.unwrap_or_else(|| file.name.clone());
        let request = plan_request(ctx, strategy, nodes, experts);
        self.to_coordinator(ControlRequest::Load(Box::new(LoadOp {
            id,
            model: file.name,
            sha256: Some(file.sha256),
            profile: file.profile,
            request,
        })))
        .await
    }

    /// The planner's ranked placements for a load request, placing nothing.
    pub(crate) async fn plan_request(&self, req: Value) -> Result<Value, ControlError> {
        let LoadBody {
            model,
            strategy,
            experts,
            ctx,
            nodes,
            ..
        } = LoadBody::parse(&req)?;
        let Some(profile) = self
            .file_named(&model)
            .map(|f| f.profile)
            .or_else(|| self.profile(&model))
        else {
            return Err(self.no_such_model(&model));
        };
        let table = self.table.lock().unwrap().clone();
        let cluster = table.placeable(&self.cluster().await);
        let request = plan_request(ctx, strategy, nodes, experts);
        let candidates = shoal_planner::candidates(&cluster, &profile, &request)
            .map_err(|e| err(400, e.to_string()))?;
        let names: HashMap<&str, &str> = cluster
            .nodes
            .iter()
            .map(|n| (n.id.as_str(), n.name.as_str()))
            .collect();
        let list: Vec<Value> = candidates
            .iter()
            .take(8)
            .map(|c| {
                json!({
                    "placement": named(&c.placement.describe(), &names),
                    "strategy": c.placement.strategy,
                    "tp": c.placement.tp,
                    "pp": c.placement.pp(),
                    "fits": c.fits(),
                    "problem": c.problem.as_deref().map(|p| named(p, &names)),
                    "decode_tok_s": c.prediction.decode_tok_s,
                    "prefill_tok_s": c.prediction.prefill_tok_s,
                    "memory": c.prediction.memory.iter().map(|m| json!({
                        "node": named(&m.node, &names),
                        "total_bytes": m.total_bytes,
                        "free_bytes": m.free_bytes,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect();
        Ok(json!({"model": model, "ctx": ctx, "candidates": list}))
    }

    /// The model files the live nodes offer, by name.
    pub(crate) async fn offered_models(&self) -> Value {
        let nodes = self.node.nodes().await;
        let name_of = |id: &str| node_name(&nodes, id);
        let mut by_name: std::collections::BTreeMap<String, (u64, String, Vec<String>)> =
            Default::default();
        for (node, f) in self.offered() {
            let e = by_name
                .entry(f.name.clone())
                .or_insert((f.size, f.sha256.clone(), Vec::new()));
            e.2.push(name_of(&node));
        }
        let models: Vec<Value> = by_name
            .into_iter()
            .map(|(name, (size, sha256, mut nodes))| {
                nodes.sort();
                json!({"name": name, "size": size, "sha256": sha256, "nodes": nodes})
            })
            .collect();
        json!({ "models": models })
    }

    pub(crate) fn list_table(&self) -> Value {
        let table = self.table.lock().unwrap().clone();
        let reports = self.all_reports();
        let nodes = self.rt.block_on(self.node.nodes());
        let api_of = |id: &str| {
            nodes
                .iter()
                .find(|n| n.id == id)
                .and_then(|n| n.facts.as_ref().map(|f| f.api.clone()))
        };
        let name_of = |id: &str| node_name(&nodes, id);
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

/// The planner's request for a load's fields.
fn plan_request(
    ctx: u32,
    strategy: shoal_planner::Strategy,
    nodes: Option<Vec<String>>,
    experts: shoal_planner::split::ExpertSplit,
) -> PlanRequest {
    PlanRequest {
        ctx,
        strategy,
        nodes,
        experts,
        ..PlanRequest::default()
    }
}

/// The name of node `id` among `nodes` (its id when it is not there).
fn node_name(nodes: &[shoal_cluster::node::NodeInfo], id: &str) -> String {
    nodes
        .iter()
        .find(|n| n.id == id)
        .map(|n| n.name.clone())
        .unwrap_or_else(|| id.to_string())
}

/// `text` with every node id of `names` replaced by the node's name.
fn named(text: &str, names: &HashMap<&str, &str>) -> String {
    names
        .iter()
        .fold(text.to_string(), |t, (id, name)| t.replace(id, name))
}
