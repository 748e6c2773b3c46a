//! The replicated instance table: which models are placed on which nodes, in what state, at
//! which version. Pure code with no I/O, clocks or threads: the caller passes `now_ms` in, and
//! a driver publishes the table in gossip, applies these functions and starts or stops
//! engines to match.
//!
//! **Replication rule.** Every node holds a copy of the table and republishes the newest one
//! it has seen ([`InstanceTable::newest`]: the highest `version`; on a tie the lowest
//! `coordinator` id, then the smaller serialized form, so every node picks the same one from
//! the same set whatever the order it heard them in). Only the coordinator, the lowest live
//! node id (computed by every node from membership with [`is_coordinator`], never elected),
//! writes: each coordinator operation returns a new table with `version + 1` and
//! `coordinator = me`. Because every node republishes the newest table, when the coordinator
//! dies every survivor already holds the latest version it published (or one being gossiped
//! towards it), and the next lowest id continues from the newest table it sees: its next
//! version is greater than anything the dead coordinator wrote that reached anyone. After a
//! partition heals, the table with the higher version wins, and a coordinator that adopts a
//! newer table must redo the changes of its own that the newer table lacks.
//!
//! **State machine** of an instance (what [`InstanceTable::set_state`] accepts is drawn with
//! `──>`; re-placement is [`InstanceTable::on_nodes_lost`], [`InstanceTable::drain`] and
//! [`InstanceTable::replace`]):
//!
//! ```text
//!   load ──> Placing ──> Loading ──> Ready
//!               │           │          │
//!               └───────────┴──────────┴──> Failed { reason }
//!
//!   re-placement (a lost or drained node, or `replace`):
//!       Placing | Loading | Ready | Failed  ==>  Placing (generation + 1)
//!                                           or  Failed  (nothing fits)
//!   unload:  any state but Unloading  ==>  Unloading  --forget-->  (removed)
//!   forget:  Unloading or Failed      ==>  (removed)
//! ```
//!
//! A report of the state an instance is already in changes nothing and returns the table
//! unchanged (same version), so a driver may repeat itself; so does `unload` of an instance
//! already unloading, and a node loss no instance uses.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use shoal_planner::split::ExpertSplit;
use shoal_planner::{plan, Cluster, ModelProfile, Placement, PlanError, PlanRequest, Strategy};

/// Lines of history an instance keeps (the oldest are dropped first).
pub const HISTORY_CAP: usize = 16;

/// Where an instance is in its life (see the module doc for the transitions).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InstanceState {
    /// Placed in the table; its nodes have not started loading.
    Placing,
    /// Its nodes are loading their slices.
    Loading,
    /// Serving requests.
    Ready,
    /// Cannot run; `reason` says why and what to do.
    Failed {
        /// What went wrong.
        reason: String,
    },
    /// Being stopped; forgotten once stopped.
    Unloading,
}

impl InstanceState {
    /// The state's name without its reason: `placing`, `loading`, `ready`, `failed`,
    /// `unloading`.
    pub fn name(&self) -> &'static str {
        match self {
            InstanceState::Placing => "placing",
            InstanceState::Loading => "loading",
            InstanceState::Ready => "ready",
            InstanceState::Failed { .. } => "failed",
            InstanceState::Unloading => "unloading",
        }
    }
}

impl fmt::Display for InstanceState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InstanceState::Failed { reason } => write!(f, "failed ({reason})"),
            other => f.write_str(other.name()),
        }
    }
}

/// A model placed on nodes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Instance {
    /// Unique id in the table.
    pub id: String,
    /// The model as the user named it (the catalog key or path given to `load`).
    pub model: String,
    /// The model file's SHA-256, hex, when known (so every node loads the same bytes).
    pub model_sha256: Option<String>,
    /// Context length the KV cache holds, tokens.
    pub ctx: u32,
    /// The strategy hint it was loaded with (kept for re-placement).
    pub strategy: Strategy,
    /// How it asked for a mixture of experts' routed experts to be cut (kept for
    /// re-placement).
    #[serde(default)]
    pub experts: ExpertSplit,
    /// Where it runs.
    pub placement: Placement,
    /// Where it is in its life.
    pub state: InstanceState,
    /// Bumped on every re-placement; reports about an older generation are stale.
    pub generation: u64,
    /// When it last changed, ms (the caller's clock).
    pub updated_ms: u64,
    /// Short human lines, oldest first, at most [`HISTORY_CAP`].
    pub history: Vec<String>,
}

impl Instance {
    /// The distinct node ids of its placement, in rank order.
    pub fn nodes(&self) -> Vec<&str> {
        let mut out: Vec<&str> = Vec::new();
        for n in self.placement.rank_nodes() {
            if !out.contains(&n) {
                out.push(n);
            }
        }
        out
    }

    /// The node of rank 0, where requests for this instance are forwarded (`None` only for
    /// an empty placement, which the planner never makes).
    pub fn lead(&self) -> Option<&str> {
        self.placement.rank_nodes().first().copied()
    }

    /// Whether any of `nodes` is one of its nodes.
    pub fn uses_any(&self, nodes: &[String]) -> bool {
        self.placement
            .rank_nodes()
            .iter()
            .any(|n| nodes.iter().any(|l| l == n))
    }

    fn note(&mut self, line: String) {
        self.history.push(line);
        if self.history.len() > HISTORY_CAP {
            let extra = self.history.len() - HISTORY_CAP;
            self.history.drain(..extra);
        }
    }
}

/// What `load` needs to know about a new instance besides where it can go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewInstance {
    /// Its id (unique in the table, not empty).
    pub id: String,
    /// The model as the user named it.
    pub model: String,
    /// The model file's SHA-256, hex, when known.
    pub model_sha256: Option<String>,
}

/// Why a coordinator operation was refused. The table is unchanged when one is returned.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InstanceError {
    /// `load` with an empty id.
    #[error("an instance id must not be empty; give one (e.g. the model's name)")]
    EmptyId,

    /// `load` with an id the table already has.
    #[error("instance `{id}` already exists ({state}); unload it first or pick another id")]
    Duplicate {
        /// The id.
        id: String,
        /// The existing instance's state.
        state: String,
    },

    /// An id the table does not have.
    #[error("no instance `{id}`; the table has: {known}")]
    Unknown {
        /// The id given.
        id: String,
        /// The ids the table has, comma separated (`none` when empty).
        known: String,
    },

    /// The planner found no placement (its message is passed through).
    #[error("cannot place instance `{id}` of model `{model}`: {error}")]
    NoFit {
        /// The instance.
        id: String,
        /// The model.
        model: String,
        /// What the planner said, with what to change.
        #[source]
        error: PlanError,
    },

    /// A state report the state machine does not allow.
    #[error("instance `{id}` cannot go from {from} to {to}: {hint}")]
    IllegalTransition {
        /// The instance.
        id: String,
        /// Its state now.
        from: String,
        /// The state asked for.
        to: String,
        /// What to do instead.
        hint: &'static str,
    },

    /// A report about an older placement of the instance.
    #[error(
        "instance `{id}` is at generation {current}, the report is about generation \
         {reported}; it was re-placed since, so drop the report"
    )]
    StaleGeneration {
        /// The instance.
        id: String,
        /// The generation the report was about.
        reported: u64,
        /// The instance's generation.
        current: u64,
    },

    /// `forget` of an instance that may still be running.
    #[error("instance `{id}` is {state}; unload it and forget it once its nodes have stopped")]
    NotStopped {
        /// The instance.
        id: String,
        /// Its state.
        state: String,
    },
}

/// The cluster's instances at one version, as written by one coordinator.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct InstanceTable {
    /// Bumped by every change; the highest wins.
    pub version: u64,
    /// The node id of the coordinator that wrote this version (empty for the initial table).
    pub coordinator: String,
    /// The instances by id.
    pub instances: BTreeMap<String, Instance>,
    /// Nodes drained of their instances: nothing is placed on them until they leave the
    /// cluster (the driver then calls [`InstanceTable::undrain`]).
    #[serde(default, skip_serializing_if = "std::collections::BTreeSet::is_empty")]
    pub drained: std::collections::BTreeSet<String>,
}

/// Whether `me` is the coordinator: no live node has a lower id (`me` counts as live whether
/// or not `live_ids` lists it).
pub fn is_coordinator<S: AsRef<str>>(me: &str, live_ids: &[S]) -> bool {
    live_ids.iter().all(|id| id.as_ref() >= me)
}

/// The coordinator among `live_ids`: the lowest id (`None` when there is none).
pub fn coordinator<S: AsRef<str>>(live_ids: &[S]) -> Option<&str> {
    live_ids.iter().map(AsRef::as_ref).min()
}

/// A line for the history when `request` forces a strategy or nodes and the planner, left
/// to choose, predicts a faster decode (by more than 5%) than `forced`'s: both placements and
/// both predictions.
fn forced_below_first_choice(
    cluster: &Cluster,
    profile: &ModelProfile,
    request: &PlanRequest,
    forced: &shoal_planner::Candidate,
) -> Option<String> {
    if request.strategy == Strategy::Auto && request.nodes.is_none() {
        return None;
    }
    let free = PlanRequest {
        strategy: Strategy::Auto,
        nodes: None,
        ..request.clone()
    };
    let first = plan(cluster, profile, &free).ok()?;
    let (f, b) = (
        forced.prediction.decode_tok_s,
        first.prediction.decode_tok_s,
    );
    (b > f * 1.05).then(|| {
        format!(
            "forced {} {}: predicted {f:.1} tok/s decode; the planner's first choice, {} {}, \
             is predicted at {b:.1} tok/s",
            forced.placement.strategy,
            forced.placement.describe(),
            first.placement.strategy,
            first.placement.describe()
        )
    })
}

fn list(nodes: &[&str]) -> String {
    format!("[{}]", nodes.join(","))
}

impl InstanceTable {
    /// An empty table at version 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// The table every node adopts among `tables`: the highest version; on a tie the lowest
    /// coordinator id, then the smaller JSON form, so the choice does not depend on order.
    /// `None` when `tables` is empty.
    pub fn newest<'a>(tables: impl IntoIterator<Item = &'a InstanceTable>) -> Option<&'a Self> {
        let mut best: Option<&'a InstanceTable> = None;
        for t in tables {
            best = match best {
                None => Some(t),
                Some(b) if t.beats(b) => Some(t),
                keep => keep,
            };
        }
        best
    }

    /// Whether `self` is preferred to `other` by [`InstanceTable::newest`].
    fn beats(&self, other: &InstanceTable) -> bool {
        use std::cmp::Ordering::*;
        match self.version.cmp(&other.version) {
            Greater => return true,
            Less => return false,
            Equal => {}
        }
        match self.coordinator.cmp(&other.coordinator) {
            Less => return true,
            Greater => return false,
            Equal => {}
        }
        let json = |t: &InstanceTable| serde_json::to_string(t).unwrap_or_default();
        json(self) < json(other)
    }

    /// The instance with this id.
    pub fn get(&self, id: &str) -> Option<&Instance> {
        self.instances.get(id)
    }

    /// A copy at the next version, written by `me`.
    fn next(&self, me: &str) -> Self {
        InstanceTable {
            version: self.version.saturating_add(1),
            coordinator: me.to_string(),
            instances: self.instances.clone(),
            drained: self.drained.clone(),
        }
    }

    fn unknown(&self, id: &str) -> InstanceError {
        let known: Vec<&str> = self.instances.keys().map(String::as_str).collect();
        InstanceError::Unknown {
            id: id.to_string(),
            known: if known.is_empty() {
                "none".into()
            } else {
                known.join(", ")
            },
        }
    }

    fn find(&self, id: &str) -> Result<&Instance, InstanceError> {
        self.instances.get(id).ok_or_else(|| self.unknown(id))
    }

    /// Places a new instance with the planner; it starts [`InstanceState::Placing`] at
    /// generation 1.
    ///
    /// # Errors
    /// [`InstanceError::EmptyId`], [`InstanceError::Duplicate`] when the id is taken,
    /// [`InstanceError::NoFit`] with the planner's message (the closest placement and its
    /// shortfall) when nothing fits or the inputs are invalid.
    pub fn load(
        &self,
        me: &str,
        new: NewInstance,
        profile: &ModelProfile,
        cluster: &Cluster,
        request: &PlanRequest,
        now_ms: u64,
    ) -> Result<Self, InstanceError> {
        if new.id.is_empty() {
            return Err(InstanceError::EmptyId);
        }
        if let Some(old) = self.instances.get(&new.id) {
            return Err(InstanceError::Duplicate {
                id: new.id,
                state: old.state.to_string(),
            });
        }
        let best = plan(&self.placeable(cluster), profile, request).map_err(|error| {
            InstanceError::NoFit {
                id: new.id.clone(),
                model: new.model.clone(),
                error,
            }
        })?;
        let forced_note =
            forced_below_first_choice(&self.placeable(cluster), profile, request, &best);
        let mut inst = Instance {
            id: new.id,
            model: new.model,
            model_sha256: new.model_sha256,
            ctx: request.ctx,
            strategy: request.strategy,
            experts: request.experts,
            placement: best.placement,
            state: InstanceState::Placing,
            generation: 1,
            updated_ms: now_ms,
            history: Vec::new(),
        };
        let line = format!(
            "placed on {} ({} {})",
            list(&inst.nodes()),
            inst.placement.strategy,
            inst.placement.describe()
        );
        inst.note(line);
        if let Some(line) = forced_note {
            inst.note(line);
        }
        let mut out = self.next(me);
        out.instances.insert(inst.id.clone(), inst);
        Ok(out)
    }

    /// Records a state the driver reports: `Loading` from `Placing`, `Ready` from `Loading`,
    /// `Failed` from `Placing`, `Loading` or `Ready`. The state it is already in returns the
    /// table unchanged (a `Failed` with a new reason is recorded).
    ///
    /// # Errors
    /// [`InstanceError::Unknown`], or [`InstanceError::IllegalTransition`] for anything else
    /// (`Placing` comes only from a re-placement, `Unloading` only from `unload`, and a
    /// failed instance must be re-placed before it can load again).
    pub fn set_state(
        &self,
        me: &str,
        id: &str,
        state: InstanceState,
        now_ms: u64,
    ) -> Result<Self, InstanceError> {
        let inst = self.find(id)?;
        if inst.state == state {
            return Ok(self.clone());
        }
        use InstanceState::*;
        let refuse = |hint| {
            Err(InstanceError::IllegalTransition {
                id: id.to_string(),
                from: inst.state.name().to_string(),
                to: state.name().to_string(),
                hint,
            })
        };
        match (&inst.state, &state) {
            (Placing, Loading) | (Loading, Ready) => {}
            (Placing | Loading | Ready, Failed { .. }) => {}
            (Failed { .. }, Failed { .. }) => {}
            (_, Placing) => return refuse("an instance is placed only by load or a re-placement"),
            (_, Unloading) => return refuse("use unload"),
            (Unloading, _) => {
                return refuse("it is being unloaded; forget it once stopped, then load again")
            }
            (Failed { .. }, _) => {
                return refuse("re-place it first (replace or drain), or unload it")
            }
            (Placing, Ready) => return refuse("its nodes must report loading first"),
            (Ready, Loading) => return refuse("re-place it to load it again"),
            _ => return refuse("that transition is not in the state machine"),
        }
        let mut out = self.next(me);
        if let Some(i) = out.instances.get_mut(id) {
            if let Failed { reason } = &state {
                i.note(format!("failed at generation {}: {reason}", i.generation));
            }
            i.state = state;
            i.updated_ms = now_ms;
        }
        Ok(out)
    }

    /// [`InstanceTable::set_state`] for a report about placement `generation`, refused when
    /// the instance has been re-placed since (so a late report about the old nodes cannot
    /// move the new placement).
    ///
    /// # Errors
    /// [`InstanceError::StaleGeneration`], and those of `set_state`.
    pub fn report(
        &self,
        me: &str,
        id: &str,
        generation: u64,
        state: InstanceState,
        now_ms: u64,
    ) -> Result<Self, InstanceError> {
        let current = self.find(id)?.generation;
        if generation != current {
            return Err(InstanceError::StaleGeneration {
                id: id.to_string(),
                reported: generation,
                current,
            });
        }
        self.set_state(me, id, state, now_ms)
    }

    /// Marks an instance [`InstanceState::Unloading`] (its nodes stop it; then `forget`).
    /// Already unloading: the table unchanged.
    ///
    /// # Errors
    /// [`InstanceError::Unknown`].
    pub fn unload(&self, me: &str, id: &str, now_ms: u64) -> Result<Self, InstanceError> {
        if self.find(id)?.state == InstanceState::Unloading {
            return Ok(self.clone());
        }
        let mut out = self.next(me);
        if let Some(i) = out.instances.get_mut(id) {
            i.state = InstanceState::Unloading;
            i.updated_ms = now_ms;
            i.note("unloading".into());
        }
        Ok(out)
    }

    /// Removes an instance that is unloading (once its nodes have stopped it) or failed.
    ///
    /// # Errors
    /// [`InstanceError::Unknown`], or [`InstanceError::NotStopped`] when it may be running.
    pub fn forget(&self, me: &str, id: &str) -> Result<Self, InstanceError> {
        let inst = self.find(id)?;
        match inst.state {
            InstanceState::Unloading | InstanceState::Failed { .. } => {}
            _ => {
                return Err(InstanceError::NotStopped {
                    id: id.to_string(),
                    state: inst.state.name().to_string(),
                })
            }
        }
        let mut out = self.next(me);
        out.instances.remove(id);
        Ok(out)
    }

    /// Re-places one instance on `cluster` with its ctx and strategy hint (generation + 1,
    /// state `Placing`), e.g. a failed one once nodes have joined, or to rebalance.
    ///
    /// # Errors
    /// [`InstanceError::Unknown`], [`InstanceError::IllegalTransition`] when it is
    /// unloading, [`InstanceError::NoFit`] with the planner's message.
    pub fn replace(
        &self,
        me: &str,
        id: &str,
        profile: &ModelProfile,
        cluster: &Cluster,
        now_ms: u64,
    ) -> Result<Self, InstanceError> {
        let inst = self.find(id)?;
        if inst.state == InstanceState::Unloading {
            return Err(InstanceError::IllegalTransition {
                id: id.to_string(),
                from: inst.state.name().to_string(),
                to: InstanceState::Placing.name().to_string(),
                hint: "it is being unloaded; forget it once stopped, then load again",
            });
        }
        let placement = place_again(inst, profile, &self.placeable(cluster)).map_err(|error| {
            InstanceError::NoFit {
                id: id.to_string(),
                model: inst.model.clone(),
                error,
            }
        })?;
        let mut out = self.next(me);
        if let Some(i) = out.instances.get_mut(id) {
            let from = list(&i.nodes());
            i.placement = placement;
            let to = list(&i.nodes());
            i.generation = i.generation.saturating_add(1);
            i.state = InstanceState::Placing;
            i.updated_ms = now_ms;
            i.note(format!(
                "re-placed from {from} to {to} on request (generation {})",
                i.generation
            ));
        }
        Ok(out)
    }

    /// Places instance `id` again on `cluster` without the nodes of `unusable` (alive, but
    /// unable to run its share: their disks have no room for it, say), with the same ctx and
    /// strategy hint: generation + 1, state `Placing`, a history line naming why; when the
    /// planner finds no placement that fits, the instance becomes `Failed` with why and the
    /// planner's shortfall. An unknown or unloading instance leaves the table unchanged.
    pub fn place_without(
        &self,
        me: &str,
        id: &str,
        unusable: &Unusable<'_>,
        profile: &ModelProfile,
        cluster: &Cluster,
        now_ms: u64,
    ) -> Self {
        let (avoid, why) = (unusable.nodes, unusable.why);
        let Some(inst) = self.get(id) else {
            return self.clone();
        };
        if inst.state == InstanceState::Unloading {
            return self.clone();
        }
        let placed = place_again(inst, profile, &without(&self.placeable(cluster), avoid));
        let mut out = self.next(me);
        let Some(i) = out.instances.get_mut(id) else {
            return out;
        };
        i.updated_ms = now_ms;
        match placed {
            Ok(placement) => {
                let from = list(&i.nodes());
                i.placement = placement;
                i.generation = i.generation.saturating_add(1);
                i.state = InstanceState::Placing;
                let to = list(&i.nodes());
                i.note(format!(
                    "re-placed from {from} to {to} without {} ({why}) (generation {})",
                    avoid.join(", "),
                    i.generation
                ));
            }
            Err(e) => {
                let reason = format!(
                    "{why}; it cannot be placed without {}: {e}",
                    avoid.join(", ")
                );
                i.note(format!("failed: {reason}"));
                i.state = InstanceState::Failed { reason };
            }
        }
        out
    }

    /// After the nodes `lost` died: every instance using one of them (unless unloading) is
    /// re-placed on `survivors` (lost nodes are left out of it even if listed) with the same
    /// ctx and strategy hint — generation + 1, state `Placing`, a history line — when the
    /// planner finds a placement that fits; otherwise it becomes `Failed` with a reason naming
    /// the lost nodes and the planner's shortfall. `profiles` gives a model's profile by its
    /// `model` key (`None` fails the instance). Other instances are unchanged; when no
    /// instance uses a lost node the table is returned unchanged (same version).
    ///
    /// `survivors` should give each node's memory free for this instance (the driver
    /// subtracts what other instances hold).
    pub fn on_nodes_lost(
        &self,
        me: &str,
        lost: &[String],
        profiles: &impl Fn(&str) -> Option<ModelProfile>,
        survivors: &Cluster,
        now_ms: u64,
    ) -> Self {
        self.lose(me, lost, "died", profiles, survivors, now_ms)
    }

    /// [`InstanceTable::on_nodes_lost`] for a node leaving voluntarily: every instance on
    /// `node` is re-placed on `cluster` without it, or fails with the reason, and the node
    /// is recorded as drained (see [`InstanceTable::drained`]).
    pub fn drain(
        &self,
        me: &str,
        node: &str,
        profiles: &impl Fn(&str) -> Option<ModelProfile>,
        cluster: &Cluster,
        now_ms: u64,
    ) -> Self {
        let mut out = self.lose(
            me,
            &[node.to_string()],
            "was drained",
            profiles,
            cluster,
            now_ms,
        );
        if !out.drained.contains(node) {
            if out.version == self.version {
                out = out.next(me);
            }
            out.drained.insert(node.to_string());
        }
        out
    }

    /// Forgets that `nodes` were drained (they left, or may take instances again); the
    /// table unchanged (same version) when none of them was.
    pub fn undrain(&self, me: &str, nodes: &[String]) -> Self {
        if !nodes.iter().any(|n| self.drained.contains(n)) {
            return self.clone();
        }
        let mut out = self.next(me);
        for n in nodes {
            out.drained.remove(n);
        }
        out
    }

    /// `cluster` without the drained nodes: where new placements may go.
    pub fn placeable(&self, cluster: &Cluster) -> Cluster {
        let drained: Vec<String> = self.drained.iter().cloned().collect();
        without(cluster, &drained)
    }

    fn lose(
        &self,
        me: &str,
        lost: &[String],
        how: &str,
        profiles: &impl Fn(&str) -> Option<ModelProfile>,
        cluster: &Cluster,
        now_ms: u64,
    ) -> Self {
        let hit: Vec<&String> = self
            .instances
            .iter()
            .filter(|(_, i)| i.state != InstanceState::Unloading && i.uses_any(lost))
            .map(|(id, _)| id)
            .collect();
        if hit.is_empty() {
            return self.clone();
        }
        let survivors = without(&self.placeable(cluster), lost);
        let mut out = self.next(me);
        for id in hit {
            let Some(i) = out.instances.get_mut(id) else {
                continue;
            };
            let gone: Vec<&str> = i
                .nodes()
                .into_iter()
                .filter(|n| lost.iter().any(|l| l == n))
                .collect();
            let what = format!(
                "node{} {} {how}",
                if gone.len() > 1 { "s" } else { "" },
                gone.join(", ")
            );
            let from = list(&i.nodes());
            let placed = match profiles(&i.model) {
                Some(p) => place_again(i, &p, &survivors).map_err(|e| e.to_string()),
                None => Err(format!(
                    "no profile for model `{}` to re-place it with; load it again",
                    i.model
                )),
            };
            i.updated_ms = now_ms;
            match placed {
                Ok(placement) => {
                    i.placement = placement;
                    i.generation = i.generation.saturating_add(1);
                    i.state = InstanceState::Placing;
                    let to = list(&i.nodes());
                    i.note(format!(
                        "re-placed from {from} to {to} after {what} (generation {})",
                        i.generation
                    ));
                }
                Err(why) => {
                    let reason = format!("{what} and it cannot be re-placed: {why}");
                    i.note(format!("failed: {reason}"));
                    i.state = InstanceState::Failed { reason };
                }
            }
        }
        out
    }
}

/// Nodes an instance cannot use, and why (see [`InstanceTable::place_without`]).
#[derive(Debug, Clone, Copy)]
pub struct Unusable<'a> {
    /// The nodes' ids.
    pub nodes: &'a [String],
    /// Why, for the instance's history and its failure reason.
    pub why: &'a str,
}

/// The best placement for `inst` on `cluster` with its ctx and strategy hint.
fn place_again(
    inst: &Instance,
    profile: &ModelProfile,
    cluster: &Cluster,
) -> Result<Placement, PlanError> {
    let request = PlanRequest {
        ctx: inst.ctx,
        strategy: inst.strategy,
        experts: inst.experts,
        ..PlanRequest::default()
    };
    let mut placement = plan(cluster, profile, &request)?.placement;
    keep_lead(&mut placement, inst.lead());
    if let Some(lead) = inst.lead() {
        lead_first(&mut placement, lead, |p| {
            shoal_planner::evaluate(cluster, profile, &request, p).is_ok_and(|c| c.fits())
        });
    }
    keep_ranks(&mut placement, &inst.placement);
    Ok(placement)
}

/// When `lead` is in `placement` but not its rank 0 (the planner put it in a later stage),
/// swaps it with rank 0's node if the placement still `fits` so: the requests a lead runs
/// go on only where it leads again, and one that entered at the lead itself has nowhere
/// else to go.
fn lead_first(placement: &mut Placement, lead: &str, fits: impl Fn(&Placement) -> bool) {
    let Some(first) = placement
        .stages
        .first()
        .and_then(|s| s.nodes.first())
        .cloned()
    else {
        return;
    };
    if first == lead {
        return;
    }
    let mut swapped = placement.clone();
    let mut found = false;
    for node in swapped.stages.iter_mut().flat_map(|s| s.nodes.iter_mut()) {
        if *node == lead {
            *node = first.clone();
            found = true;
        } else if *node == first {
            *node = lead.to_string();
        }
    }
    if found && fits(&swapped) {
        *placement = swapped;
    }
}

/// When `placement` cuts the model as `before` did (the same tensor split, stage layers and
/// expert cut), puts every node that keeps a stage back at its rank index there: its share
/// is then the one it holds loaded, and it need not load it again. Ranks of one stage hold
/// equal shares, so the swaps keep the placement's fit; a lead kept as rank 0 stays there.
fn keep_ranks(placement: &mut Placement, before: &Placement) {
    let same_cut = placement.tp == before.tp
        && placement.experts == before.experts
        && placement.stages.len() == before.stages.len()
        && placement
            .stages
            .iter()
            .zip(&before.stages)
            .all(|(s, b)| s.layers == b.layers && s.nodes.len() == b.nodes.len());
    if !same_cut {
        return;
    }
    for (stage, old) in placement.stages.iter_mut().zip(&before.stages) {
        for (j, node) in old.nodes.iter().enumerate() {
            if let Some(k) = stage.nodes.iter().position(|n| n == node) {
                stage.nodes.swap(j, k);
            }
        }
    }
}

/// Makes `lead` rank 0 again when the new placement puts it among the first stage's ranks:
/// the requests a lead was running go on only where it leads again. The ranks of one
/// stage hold equal shares (to one head or block), so the swap keeps the placement's fit.
fn keep_lead(placement: &mut Placement, lead: Option<&str>) {
    let (Some(lead), Some(first)) = (lead, placement.stages.first_mut()) else {
        return;
    };
    if let Some(j) = first.nodes.iter().position(|n| n == lead) {
        first.nodes.swap(0, j);
    }
}

/// `cluster` without the nodes `lost` and their links.
fn without(cluster: &Cluster, lost: &[String]) -> Cluster {
    let gone = |id: &String| lost.contains(id);
    Cluster {
        nodes: cluster
            .nodes
            .iter()
            .filter(|n| !gone(&n.id))
            .cloned()
            .collect(),
        links: cluster
            .links
            .iter()
            .filter(|l| !gone(&l.a) && !gone(&l.b))
            .cloned()
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::{prop_assert, prop_assert_eq, proptest, Just, ProptestConfig};
    use proptest::strategy::Strategy as _;
    use shoal_planner::{LinkSpec, NodeSpec};

    const GB: u64 = 1_000_000_000;

    fn node(id: &str, free: u64) -> NodeSpec {
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

    /// Every pair joined by a 10 Gbit/s, 60 us link.
    fn mesh(ids: &[&str], free: u64) -> Cluster {
        let nodes: Vec<NodeSpec> = ids.iter().map(|id| node(id, free)).collect();
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

    /// A dense 16-layer model of `layer_bytes` per layer (about 17 x that in all).
    fn model(name: &str, layer_bytes: u64) -> ModelProfile {
        ModelProfile {
            name: name.into(),
            n_layers: 16,
            hidden: 2048,
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: 64,
            ffn: 8192,
            vocab: 32_000,
            params: layer_bytes * 17 * 2,
            layer_bytes: vec![layer_bytes; 16],
            embedding_bytes: layer_bytes,
            head_bytes: layer_bytes,
            tied_embeddings: true,
            kv_bytes_per_token_per_layer: 2 * 8 * 64 * 4,
            quant_block: 32,
            attn_quant_block: None,
            experts: None,
        }
    }

    /// 1.7 GB of weights: needs two nodes of 1.5 GB free.
    fn big() -> ModelProfile {
        model("big", 100_000_000)
    }

    /// 170 MB: fits on any one node.
    fn small() -> ModelProfile {
        model("small", 10_000_000)
    }

    fn profiles(name: &str) -> Option<ModelProfile> {
        match name {
            "big" => Some(big()),
            "small" => Some(small()),
            _ => None,
        }
    }

    fn req(nodes: Option<&[&str]>) -> PlanRequest {
        PlanRequest {
            ctx: 1024,
            nodes: nodes.map(|n| n.iter().map(|s| s.to_string()).collect()),
            ..PlanRequest::default()
        }
    }

    fn new(id: &str, model: &str) -> NewInstance {
        NewInstance {
            id: id.into(),
            model: model.into(),
            model_sha256: None,
        }
    }

    fn strs(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    /// "big" over a, b, c (1.5 GB each) and "small" pinned to d.
    fn two_instances() -> (Cluster, InstanceTable) {
        let cluster = mesh(&["a", "b", "c", "d"], 3 * GB / 2);
        let t = InstanceTable::new()
            .load(
                "a",
                new("big", "big"),
                &big(),
                &cluster,
                &req(Some(&["a", "b", "c"])),
                10,
            )
            .unwrap()
            .load(
                "a",
                new("small", "small"),
                &small(),
                &cluster,
                &req(Some(&["d"])),
                20,
            )
            .unwrap();
        (cluster, t)
    }

    #[test]
    fn load_places_and_bumps_the_version() {
        let cluster = mesh(&["a", "b", "c"], 3 * GB / 2);
        let t0 = InstanceTable::new();
        let t1 = t0
            .load("a", new("m1", "big"), &big(), &cluster, &req(None), 5)
            .unwrap();
        assert_eq!(t1.version, 1);
        assert_eq!(t1.coordinator, "a");
        let i = t1.get("m1").unwrap();
        assert_eq!(i.state, InstanceState::Placing);
        assert_eq!(i.generation, 1);
        assert_eq!(i.ctx, 1024);
        assert_eq!(i.updated_ms, 5);
        assert!(
            i.nodes().len() >= 2,
            "1.7 GB needs two nodes: {:?}",
            i.nodes()
        );
        assert_eq!(i.lead(), i.nodes().first().copied());
        assert_eq!(i.history.len(), 1);
        assert!(i.history[0].starts_with("placed on ["), "{:?}", i.history);
        assert!(t0.instances.is_empty(), "the old table is untouched");
    }

    /// A load that forces two nodes over a slow link, where a third node holds the model
    /// alone and decodes faster, says so in its history with both predictions; the
    /// planner's own choice, or a forced one as fast, says nothing.
    #[test]
    fn a_forced_placement_ranked_below_the_first_choice_is_noted() {
        let mut cluster = mesh(&["a", "b", "c"], 2 * GB);
        for l in &mut cluster.links {
            l.rtt_us = 10_000.0;
        }
        cluster.nodes[2].memory_free_bytes = 8 * GB;
        cluster.nodes[2].memory_total_bytes = 9 * GB;
        let forced = PlanRequest {
            strategy: Strategy::Tensor,
            ..req(Some(&["a", "b"]))
        };
        let t = InstanceTable::new()
            .load("a", new("m", "big"), &big(), &cluster, &forced, 1)
            .unwrap();
        let i = t.get("m").unwrap();
        assert_eq!(i.nodes().len(), 2, "{:?}", i.placement);
        let note = i
            .history
            .iter()
            .find(|l| l.starts_with("forced tensor"))
            .unwrap_or_else(|| panic!("no note: {:?}", i.history));
        assert!(
            note.contains("tok/s decode; the planner's first choice, single c[0..16], is")
                && note.matches(" tok/s").count() == 2,
            "{note}"
        );
        for request in [req(None), req(Some(&["c"]))] {
            let t = InstanceTable::new()
                .load("a", new("m", "big"), &big(), &cluster, &request, 1)
                .unwrap();
            let h = &t.get("m").unwrap().history;
            assert!(!h.iter().any(|l| l.starts_with("forced")), "{h:?}");
        }
    }

    #[test]
    fn duplicate_id_is_refused() {
        let cluster = mesh(&["a"], 4 * GB);
        let t = InstanceTable::new()
            .load("a", new("x", "small"), &small(), &cluster, &req(None), 0)
            .unwrap();
        let err = t
            .load("a", new("x", "small"), &small(), &cluster, &req(None), 0)
            .unwrap_err();
        assert!(matches!(err, InstanceError::Duplicate { .. }), "{err}");
        assert!(err.to_string().contains("unload it first"), "{err}");
        let err = t
            .load("a", new("", "small"), &small(), &cluster, &req(None), 0)
            .unwrap_err();
        assert_eq!(err, InstanceError::EmptyId);
    }

    #[test]
    fn a_model_too_big_names_the_shortfall() {
        let cluster = mesh(&["a", "b"], GB / 2);
        let err = InstanceTable::new()
            .load("a", new("x", "big"), &big(), &cluster, &req(None), 0)
            .unwrap_err();
        let InstanceError::NoFit { error, .. } = &err else {
            panic!("{err:?}");
        };
        assert!(matches!(error, PlanError::FitsNowhere { .. }), "{error:?}");
        let msg = err.to_string();
        assert!(
            msg.contains("cannot place instance `x` of model `big`"),
            "{msg}"
        );
        assert!(msg.contains("GB short"), "{msg}");
    }

    #[test]
    fn newest_picks_the_highest_version_in_any_order() {
        let t = |v: u64, c: &str| InstanceTable {
            version: v,
            coordinator: c.into(),
            instances: BTreeMap::new(),
            drained: Default::default(),
        };
        let ts = [t(3, "b"), t(5, "c"), t(5, "a"), t(1, "a")];
        let n = InstanceTable::newest(&ts).unwrap();
        assert_eq!((n.version, n.coordinator.as_str()), (5, "a"));
        let rev: Vec<&InstanceTable> = ts.iter().rev().collect();
        assert_eq!(InstanceTable::newest(rev), Some(n));
        assert_eq!(InstanceTable::newest(&[] as &[InstanceTable]), None);
    }

    #[test]
    fn a_killed_coordinator_is_continued_by_the_next() {
        let (cluster, t2) = two_instances();
        // a (coordinator) wrote versions 1 and 2; b heard both, c only the first
        let t1 = {
            let mut t = t2.clone();
            t.version = 1;
            t.instances.remove("small");
            t
        };
        let views = [("a", t2.clone()), ("b", t2.clone()), ("c", t1)];
        // a dies: the survivors gossip their copies and adopt the newest
        let live = strs(&["b", "c", "d"]);
        let surviving: Vec<&InstanceTable> = views
            .iter()
            .filter(|(n, _)| live.iter().any(|l| l == n))
            .map(|(_, t)| t)
            .collect();
        let adopted = InstanceTable::newest(surviving).unwrap();
        assert_eq!(adopted, &t2);
        assert_eq!(adopted.instances.len(), 2, "every instance survives");
        assert!(is_coordinator("b", &live));
        assert!(!is_coordinator("c", &live));
        assert_eq!(coordinator(&live), Some("b"));
        // b continues: its next version is greater than anything a wrote
        let t3 = adopted.unload("b", "small", 30).unwrap();
        assert_eq!(t3.version, 3);
        assert_eq!(t3.coordinator, "b");
        assert_eq!(t3.get("big"), t2.get("big"));
        // and the loss of a leaves every instance in the table (re-placed or failed)
        let t4 = t3.on_nodes_lost("b", &strs(&["a"]), &profiles, &cluster, 31);
        assert!(t4.version >= t3.version);
        assert_eq!(t4.instances.len(), 2);
        assert!(
            !t4.get("big").unwrap().uses_any(&strs(&["a"]))
                || matches!(t4.get("big").unwrap().state, InstanceState::Failed { .. })
        );
        assert_eq!(InstanceTable::newest([&t2, &t4, &t3]), Some(&t4));
    }

    #[test]
    fn a_surviving_lead_of_the_first_stage_leads_again() {
        let stage =
            |layers: std::ops::Range<usize>, nodes: &[&str]| shoal_planner::StagePlacement {
                layers,
                nodes: strs(nodes),
            };
        let mut p = Placement {
            strategy: shoal_planner::SplitKind::Hybrid,
            tp: 2,
            stages: vec![stage(0..8, &["c", "a"]), stage(8..16, &["d", "e"])],
            experts: ExpertSplit::default(),
        };
        keep_lead(&mut p, Some("a"));
        assert_eq!(p.stages[0].nodes, strs(&["a", "c"]));
        assert_eq!(p.stages[1].nodes, strs(&["d", "e"]));
        // a lead placed in a later stage, or gone, changes nothing
        let before = p.clone();
        keep_lead(&mut p, Some("e"));
        keep_lead(&mut p, Some("z"));
        keep_lead(&mut p, None);
        assert_eq!(p, before);
        // on a node loss, the old lead leads wherever the planner keeps it in stage 0
        let (cluster, t) = two_instances();
        let before = t.get("big").unwrap().clone();
        let lead = before.lead().unwrap().to_string();
        let victim = before.nodes().into_iter().find(|n| *n != lead).unwrap();
        let t2 = t.on_nodes_lost("a", &strs(&[victim]), &profiles, &cluster, 99);
        let after = t2.get("big").unwrap();
        if after.placement.stages[0].nodes.contains(&lead) {
            assert_eq!(after.lead(), Some(lead.as_str()));
        }
    }

    #[test]
    fn an_instance_is_placed_without_the_nodes_it_cannot_use() {
        let (cluster, t) = two_instances();
        let before = t.get("big").unwrap().clone();
        let avoid = vec![before.nodes()[1].to_string()];
        let unusable = |nodes| Unusable {
            nodes,
            why: "node x: disk full",
        };
        let t2 = t.place_without("a", "big", &unusable(&avoid), &big(), &cluster, 50);
        assert_eq!(t2.version, t.version + 1);
        let after = t2.get("big").unwrap();
        assert_eq!(after.state, InstanceState::Placing);
        assert_eq!(after.generation, before.generation + 1);
        assert!(
            !after.nodes().contains(&avoid[0].as_str()),
            "{:?}",
            after.nodes()
        );
        assert!(after
            .history
            .last()
            .unwrap()
            .contains("(node x: disk full)"));
        // the other instance is untouched
        assert_eq!(t2.get("small"), t.get("small"));
        // nowhere left: failed, saying why and what the planner lacked
        let all: Vec<String> = ["a", "b", "c", "d"].iter().map(|s| s.to_string()).collect();
        let t3 = t.place_without("a", "big", &unusable(&all), &big(), &cluster, 60);
        match &t3.get("big").unwrap().state {
            InstanceState::Failed { reason } => assert!(
                reason.starts_with("node x: disk full; it cannot be placed without a, b, c, d: "),
                "{reason}"
            ),
            other => panic!("{other:?}"),
        }
        // unknown: unchanged
        assert_eq!(
            t.place_without("a", "nope", &unusable(&all), &big(), &cluster, 70),
            t
        );
    }

    #[test]
    fn a_surviving_lead_in_a_later_stage_leads_again_where_that_fits() {
        let stage =
            |layers: std::ops::Range<usize>, nodes: &[&str]| shoal_planner::StagePlacement {
                layers,
                nodes: strs(nodes),
            };
        let planned = Placement {
            strategy: shoal_planner::SplitKind::Pipeline,
            tp: 1,
            stages: vec![stage(0..10, &["c"]), stage(10..24, &["a"])],
            experts: ExpertSplit::default(),
        };
        let mut p = planned.clone();
        lead_first(&mut p, "a", |_| true);
        assert_eq!(p.stages[0].nodes, strs(&["a"]));
        assert_eq!(p.stages[1].nodes, strs(&["c"]));
        assert_eq!(p.stages[0].layers, 0..10, "the stages' layers stay");
        // not when the swap would not fit, or the lead is gone, or leads already
        for (lead, fits) in [("a", false), ("z", true), ("c", true)] {
            let mut q = planned.clone();
            lead_first(&mut q, lead, |_| fits);
            assert_eq!(q, planned, "{lead} {fits}");
        }
    }

    #[test]
    fn survivors_keep_their_rank_index_when_the_cut_is_the_same() {
        let stage =
            |layers: std::ops::Range<usize>, nodes: &[&str]| shoal_planner::StagePlacement {
                layers,
                nodes: strs(nodes),
            };
        let placed = |stages: Vec<shoal_planner::StagePlacement>| Placement {
            strategy: shoal_planner::SplitKind::Hybrid,
            tp: stages[0].nodes.len(),
            stages,
            experts: ExpertSplit::default(),
        };
        let before = placed(vec![
            stage(0..8, &["a", "b", "c"]),
            stage(8..16, &["d", "e", "f"]),
        ]);
        // a and e died: the planner's order is put back where b, c, d and f were
        let mut p = placed(vec![
            stage(0..8, &["c", "x", "b"]),
            stage(8..16, &["f", "d", "y"]),
        ]);
        keep_ranks(&mut p, &before);
        assert_eq!(p.stages[0].nodes, strs(&["x", "b", "c"]));
        assert_eq!(p.stages[1].nodes, strs(&["d", "y", "f"]));
        // another cut (other stage layers, another tensor split) is left as planned
        for other in [
            placed(vec![
                stage(0..6, &["c", "x", "b"]),
                stage(6..16, &["f", "d", "y"]),
            ]),
            placed(vec![stage(0..8, &["c", "b"]), stage(8..16, &["f", "d"])]),
            placed(vec![stage(0..16, &["c", "x", "b"])]),
        ] {
            let mut q = other.clone();
            keep_ranks(&mut q, &before);
            assert_eq!(q, other);
        }
        // on a node loss the survivor of a two-rank split keeps its index
        let (cluster, t) = two_instances();
        let before = t.get("big").unwrap().clone();
        if before.placement.tp == 2 && before.placement.stages.len() == 1 {
            let victim = before.placement.stages[0].nodes[0].clone();
            let survivor = before.placement.stages[0].nodes[1].clone();
            let t2 = t.on_nodes_lost("a", &[victim], &profiles, &cluster, 99);
            let after = t2.get("big").unwrap();
            if after.placement.tp == 2 && after.placement.stages.len() == 1 {
                assert_eq!(after.placement.stages[0].nodes[1], survivor);
            }
        }
    }

    #[test]
    fn node_loss_re_places_on_survivors_when_it_fits() {
        let (cluster, t) = two_instances();
        let before = t.get("big").unwrap().clone();
        let victim = before.nodes()[before.nodes().len() - 1].to_string();
        let t2 = t.on_nodes_lost("a", std::slice::from_ref(&victim), &profiles, &cluster, 99);
        assert_eq!(t2.version, t.version + 1);
        let after = t2.get("big").unwrap();
        assert!(
            !after.nodes().contains(&victim.as_str()),
            "{:?}",
            after.nodes()
        );
        assert!(after
            .nodes()
            .iter()
            .all(|n| ["a", "b", "c", "d"].contains(n)));
        assert_eq!(after.generation, before.generation + 1);
        assert_eq!(after.state, InstanceState::Placing);
        assert_eq!(after.ctx, before.ctx);
        assert_eq!(after.strategy, before.strategy);
        assert_eq!(after.updated_ms, 99);
        let line = after.history.last().unwrap();
        assert!(line.starts_with("re-placed from ["), "{line}");
        assert!(
            line.contains(&format!("after node {victim} died")),
            "{line}"
        );
        // the instance that did not use the lost node is identical
        assert_eq!(t2.get("small"), t.get("small"));
    }

    #[test]
    fn node_loss_fails_with_a_reason_when_nothing_fits() {
        let cluster = mesh(&["a", "b", "c"], 3 * GB / 2);
        let t = InstanceTable::new()
            .load(
                "a",
                new("big", "big"),
                &big(),
                &cluster,
                &req(Some(&["a", "b"])),
                0,
            )
            .unwrap()
            .load(
                "a",
                new("small", "small"),
                &small(),
                &cluster,
                &req(Some(&["c"])),
                0,
            )
            .unwrap();
        // a and b both gone: c alone cannot hold 1.7 GB
        let t2 = t.on_nodes_lost("c", &strs(&["a", "b"]), &profiles, &cluster, 7);
        let big_after = t2.get("big").unwrap();
        let InstanceState::Failed { reason } = &big_after.state else {
            panic!("{:?}", big_after.state);
        };
        assert!(reason.contains("nodes a, b died"), "{reason}");
        assert!(reason.contains("GB short"), "{reason}");
        assert_eq!(big_after.generation, 1, "not re-placed");
        assert_eq!(t2.get("small"), t.get("small"));
        // a failed instance cannot become ready without a re-placement, but can be forgotten
        assert!(matches!(
            t2.set_state("c", "big", InstanceState::Ready, 8),
            Err(InstanceError::IllegalTransition { .. })
        ));
        let t3 = t2.forget("c", "big").unwrap();
        assert!(t3.get("big").is_none());
    }

    #[test]
    fn a_loss_no_instance_uses_changes_nothing() {
        let (cluster, t) = two_instances();
        let used: Vec<&str> = t.instances.values().flat_map(|i| i.nodes()).collect();
        let spare = ["a", "b", "c", "d"].into_iter().find(|n| !used.contains(n));
        if let Some(spare) = spare {
            assert_eq!(
                t.on_nodes_lost("a", &strs(&[spare]), &profiles, &cluster, 1),
                t
            );
        }
        assert_eq!(
            t.on_nodes_lost("a", &strs(&["zz"]), &profiles, &cluster, 1),
            t
        );
    }

    #[test]
    fn drain_moves_instances_off_the_node() {
        let (cluster, t) = two_instances();
        let t2 = t.drain("a", "d", &profiles, &cluster, 5);
        let small_after = t2.get("small").unwrap();
        assert!(!small_after.nodes().contains(&"d"));
        assert_eq!(small_after.generation, 2);
        assert!(small_after
            .history
            .last()
            .unwrap()
            .contains("node d was drained"));
        assert_eq!(t2.get("big"), t.get("big"));
    }

    #[test]
    fn a_drained_node_takes_nothing_until_undrained() {
        let (cluster, t) = two_instances();
        let t2 = t.drain("a", "d", &profiles, &cluster, 5);
        assert!(t2.drained.contains("d"));
        // draining a node no instance uses is still recorded
        let t3 = t2.drain("a", "c", &profiles, &cluster, 6);
        assert!(t3.drained.contains("c") && t3.version > t2.version);
        let fresh = t3
            .load("a", new("x", "small"), &small(), &cluster, &req(None), 7)
            .unwrap();
        let x = fresh.get("x").unwrap();
        assert!(!x.nodes().contains(&"d") && !x.nodes().contains(&"c"));
        // re-placement after a loss avoids them too
        let lost = t3.on_nodes_lost("a", &strs(&["a"]), &profiles, &cluster, 8);
        for i in lost.instances.values() {
            assert!(
                !i.nodes().contains(&"d") && !i.nodes().contains(&"c"),
                "{}",
                i.placement.describe()
            );
        }
        let t4 = t3.undrain("a", &strs(&["d", "z"]));
        assert!(!t4.drained.contains("d") && t4.drained.contains("c"));
        assert_eq!(
            t4.undrain("a", &strs(&["z"])),
            t4,
            "nothing to undrain: unchanged"
        );
        // the set survives serialization (and an old table without it still parses)
        let back: InstanceTable =
            serde_json::from_str(&serde_json::to_string(&t4).unwrap()).unwrap();
        assert_eq!(back, t4);
        let old: InstanceTable =
            serde_json::from_str(r#"{"version":1,"coordinator":"a","instances":{}}"#).unwrap();
        assert!(old.drained.is_empty());
    }

    #[test]
    fn the_state_machine_refuses_illegal_transitions() {
        use InstanceState::*;
        let (cluster, t) = two_instances();
        let failed = || Failed {
            reason: "engine exited".into(),
        };
        let ill = |r: Result<InstanceTable, InstanceError>| {
            matches!(r, Err(InstanceError::IllegalTransition { .. }))
        };
        assert!(ill(t.set_state("a", "big", Ready, 1)), "Placing -> Ready");
        assert!(ill(t.set_state("a", "big", Unloading, 1)));
        let t = t.set_state("a", "big", Loading, 1).unwrap();
        assert!(ill(t.set_state("a", "big", Placing, 1)));
        let t = t.set_state("a", "big", Ready, 2).unwrap();
        assert_eq!(
            t.set_state("a", "big", Ready, 3).unwrap(),
            t,
            "a repeat changes nothing"
        );
        assert!(ill(t.set_state("a", "big", Loading, 3)));
        let t = t.set_state("a", "big", failed(), 4).unwrap();
        assert!(ill(t.set_state("a", "big", Loading, 5)));
        assert!(ill(t.set_state("a", "big", Ready, 5)));
        // re-placement brings it back
        let t = t.replace("a", "big", &big(), &cluster, 6).unwrap();
        assert_eq!(t.get("big").unwrap().state, Placing);
        assert_eq!(t.get("big").unwrap().generation, 2);
        // a late report about generation 1 is stale
        assert!(matches!(
            t.report("a", "big", 1, Loading, 7),
            Err(InstanceError::StaleGeneration { .. })
        ));
        let t = t.report("a", "big", 2, Loading, 7).unwrap();
        // unload, then forget
        assert!(matches!(
            t.forget("a", "big"),
            Err(InstanceError::NotStopped { .. })
        ));
        let t = t.unload("a", "big", 8).unwrap();
        assert_eq!(t.unload("a", "big", 9).unwrap(), t);
        assert!(ill(t.set_state("a", "big", Ready, 9)));
        assert!(ill(t.replace("a", "big", &big(), &cluster, 9)));
        let v = t.version;
        let t = t.forget("a", "big").unwrap();
        assert_eq!(t.version, v + 1);
        let err = t.set_state("a", "big", Ready, 10).unwrap_err();
        assert!(err.to_string().contains("the table has: small"), "{err}");
    }

    #[test]
    fn history_is_capped() {
        let (cluster, mut t) = two_instances();
        for k in 0..40 {
            t = t.replace("a", "small", &small(), &cluster, k).unwrap();
        }
        let i = t.get("small").unwrap();
        assert_eq!(i.history.len(), HISTORY_CAP);
        assert_eq!(i.generation, 41);
        assert!(i.history.last().unwrap().contains("generation 41"));
    }

    #[test]
    fn serde_round_trip() {
        let (_, t) = two_instances();
        let t = t
            .set_state(
                "a",
                "small",
                InstanceState::Failed {
                    reason: "out of memory".into(),
                },
                3,
            )
            .unwrap();
        let json = serde_json::to_string(&t).unwrap();
        assert!(json.contains("\"placing\""), "{json}");
        assert!(
            json.contains("{\"failed\":{\"reason\":\"out of memory\"}}"),
            "{json}"
        );
        let back: InstanceTable = serde_json::from_str(&json).unwrap();
        assert_eq!(back, t);
        assert!(serde_json::from_str::<InstanceTable>("{\"version\":1}").is_err());
    }

    fn arb_table() -> impl proptest::strategy::Strategy<Value = InstanceTable> {
        (0u64..4, 0usize..3, 0u64..3).prop_map(|(version, c, extra)| {
            let mut t = InstanceTable {
                version,
                coordinator: ["a", "b", "c"][c].into(),
                instances: BTreeMap::new(),
                drained: Default::default(),
            };
            let (_, base) = two_instances_cached();
            for (k, (id, i)) in base.instances.iter().enumerate() {
                if (k as u64) < extra {
                    t.instances.insert(id.clone(), i.clone());
                }
            }
            t
        })
    }

    fn two_instances_cached() -> &'static (Cluster, InstanceTable) {
        static CELL: std::sync::OnceLock<(Cluster, InstanceTable)> = std::sync::OnceLock::new();
        CELL.get_or_init(two_instances)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn newest_is_order_independent(
            (tables, shuffled) in proptest::collection::vec(arb_table(), 1..8)
                .prop_flat_map(|v| (Just(v.clone()), Just(v).prop_shuffle()))
        ) {
            let a = InstanceTable::newest(&tables).unwrap();
            let b = InstanceTable::newest(&shuffled).unwrap();
            prop_assert_eq!(a, b);
            prop_assert!(tables.iter().all(|t| t.version <= a.version));
        }

        #[test]
        fn node_loss_leaves_only_survivors_or_failures(
            lost_mask in 1u8..16,
        ) {
            let (cluster, t) = two_instances_cached();
            let ids = ["a", "b", "c", "d"];
            let lost: Vec<String> = (0..4)
                .filter(|b| lost_mask & (1 << b) != 0)
                .map(|b| ids[b].to_string())
                .collect();
            let t2 = t.on_nodes_lost("x", &lost, &profiles, cluster, 1);
            prop_assert!(t2.version == t.version || t2.version == t.version + 1);
            for (id, before) in &t.instances {
                let after = &t2.instances[id];
                if !before.uses_any(&lost) {
                    prop_assert_eq!(after, before);
                } else if let InstanceState::Failed { reason } = &after.state {
                    prop_assert!(reason.contains("died"));
                    prop_assert_eq!(after.generation, before.generation);
                } else {
                    prop_assert_eq!(&after.state, &InstanceState::Placing);
                    prop_assert!(!after.uses_any(&lost));
                    prop_assert_eq!(after.generation, before.generation + 1);
                }
            }
        }
    }
}
