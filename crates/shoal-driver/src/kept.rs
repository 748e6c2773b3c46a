//! Shards a rank leaves behind for its instance's next placement. When a rank stops (its
//! instance placed again after a node died, its peers gone), its loaded weights wait here;
//! a rank of the next placement that holds the same share (the same file, tensor split,
//! stage sizes, expert cut and rank index) takes them and points their collectives at its
//! new mesh ([`Rebindable`]) instead of loading the file again. A rank whose share changed
//! but still holds some of the same layers, cut the same way (a pipeline stage that grew
//! or moved when a stage's node died), takes the shard too and reads only what its share
//! adds (`LoadedModel::regrow_split`). A kept shard is dropped as soon as the instance
//! table shows that no rank here will take it, and after [`KEEP_FOR`] in any case, so
//! weights nobody will use do not hold memory the planner counts as free.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use shoal_cluster::instances::{Instance, InstanceState, InstanceTable};
use shoal_comm::Rebindable;
use shoal_engine::model::LoadedModel;
use shoal_engine::shard::ShardPlan;
use shoal_planner::split::ExpertSplit;

/// How long a shard waits for a rank to take it.
pub(crate) const KEEP_FOR: Duration = Duration::from_secs(60);

/// What decides a rank's weights: equal keys load equal shards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ShareKey {
    path: PathBuf,
    tp: usize,
    stage_sizes: Vec<usize>,
    experts: ExpertSplit,
    rank: usize,
}

impl ShareKey {
    /// The share rank `rank` of `inst` loads from `path`.
    pub(crate) fn of(inst: &Instance, rank: usize, path: &Path) -> Self {
        ShareKey {
            path: path.to_path_buf(),
            tp: inst.placement.tp,
            stage_sizes: inst.placement.stage_sizes(),
            experts: inst.placement.experts,
            rank,
        }
    }

    /// Whether some rank of `inst` on node `me` holds this share.
    fn placed_on(&self, inst: &Instance, me: &str) -> bool {
        self.shares_on(inst, me).any(|k| k == *self)
    }

    /// The shares of the ranks of `inst` on node `me`.
    fn shares_on<'a>(
        &'a self,
        inst: &'a Instance,
        me: &'a str,
    ) -> impl Iterator<Item = ShareKey> + 'a {
        inst.placement
            .rank_nodes()
            .into_iter()
            .enumerate()
            .filter(move |(_, n)| *n == me)
            .map(|(r, _)| ShareKey::of(inst, r, &self.path))
    }

    /// The layers of this share's pipeline stage.
    pub(crate) fn layers(&self) -> Range<usize> {
        let stage = self.rank / self.tp.max(1);
        let start: usize = self.stage_sizes.iter().take(stage).sum();
        start..start + self.stage_sizes.get(stage).copied().unwrap_or(0)
    }

    /// How many layers a rank loading `other` may keep of this share: those both stages
    /// hold, when both come from the same file, are cut the same way across a stage (the
    /// tensor split, the rank's place in its stage, the expert cut). The engine checks the
    /// cut of each layer again as it takes them.
    fn common_layers(&self, other: &ShareKey) -> usize {
        let same_cut = self.path == other.path
            && self.tp == other.tp
            && self.experts == other.experts
            && self.rank % self.tp.max(1) == other.rank % other.tp.max(1);
        if !same_cut {
            return 0;
        }
        let (a, b) = (self.layers(), other.layers());
        b.end.min(a.end).saturating_sub(a.start.max(b.start))
    }
}

/// A loaded shard no rank runs.
pub(crate) struct KeptShard {
    pub(crate) instance: String,
    /// The placement it was loaded for.
    pub(crate) generation: u64,
    pub(crate) key: ShareKey,
    pub(crate) model: Arc<LoadedModel>,
    /// The communicator its layers sum their partial results over.
    pub(crate) tp: Arc<Rebindable>,
    /// What every rank of its split holds.
    pub(crate) plans: Vec<ShardPlan>,
    pub(crate) since: Instant,
}

/// The shards kept on this node, and the ranks holding loaded shards now.
#[derive(Default)]
pub(crate) struct Kept {
    shards: Mutex<Vec<KeptShard>>,
    /// (instance, generation) of every rank here holding a loaded shard.
    holding: Mutex<Vec<(String, u64)>>,
    released: Condvar,
}

/// A rank's hold on its loaded shard, from its load until it left the shard here (or
/// dropped it); see [`Kept::wait_for_older`].
pub(crate) struct Holding<'a> {
    kept: &'a Kept,
    instance: String,
    generation: u64,
}

impl Drop for Holding<'_> {
    fn drop(&mut self) {
        let mut holding = self.kept.holding.lock().unwrap();
        if let Some(i) = holding
            .iter()
            .position(|(i, g)| *i == self.instance && *g == self.generation)
        {
            holding.swap_remove(i);
        }
        self.kept.released.notify_all();
    }
}

impl Kept {
    /// Records that a rank of `instance` at `generation` holds a loaded shard until the
    /// returned hold is dropped.
    pub(crate) fn hold(&self, instance: &str, generation: u64) -> Holding<'_> {
        self.holding
            .lock()
            .unwrap()
            .push((instance.to_string(), generation));
        Holding {
            kept: self,
            instance: instance.to_string(),
            generation,
        }
    }

    /// Waits at most `wait` while a rank of an older placement of `instance` still holds
    /// its shard (it was told to stop, and leaves the shard here as it ends): a rank of the
    /// new placement asks for a kept shard only once they are all here.
    pub(crate) fn wait_for_older(&self, instance: &str, generation: u64, wait: Duration) {
        let holding = self.holding.lock().unwrap();
        let _ = self
            .released
            .wait_timeout_while(holding, wait, |h| {
                h.iter().any(|(i, g)| i == instance && *g < generation)
            })
            .unwrap();
    }

    /// Keeps `shard`, in place of any kept for the same instance and share.
    pub(crate) fn keep(&self, shard: KeptShard) {
        let mut kept = self.shards.lock().unwrap();
        kept.retain(|k| !(k.instance == shard.instance && k.key == shard.key));
        kept.push(shard);
    }

    /// Takes the shard of `instance` kept for `key`, if any.
    pub(crate) fn take(&self, instance: &str, key: &ShareKey) -> Option<KeptShard> {
        let mut kept = self.shards.lock().unwrap();
        let i = kept
            .iter()
            .position(|k| k.instance == instance && k.key == *key)?;
        Some(kept.swap_remove(i))
    }

    /// Takes the shard of `inst` kept here with the most layers in common with `key` (a
    /// share of a rank of `inst` on node `me`), leaving those another rank here takes whole.
    pub(crate) fn take_overlapping(
        &self,
        inst: &Instance,
        me: &str,
        key: &ShareKey,
    ) -> Option<KeptShard> {
        let mut kept = self.shards.lock().unwrap();
        let (i, _) = kept
            .iter()
            .enumerate()
            .filter(|(_, k)| k.instance == inst.id && !k.key.placed_on(inst, me))
            .map(|(i, k)| (i, k.key.common_layers(key)))
            .filter(|&(_, n)| n > 0)
            .max_by_key(|&(_, n)| n)?;
        Some(kept.swap_remove(i))
    }

    /// Drops the shards no rank of node `me` will take: their instance is gone from
    /// `table` or unloading, its placement holds their share nowhere on `me`, or they were
    /// kept longer than [`KEEP_FOR`]. Returns how many were dropped.
    pub(crate) fn prune(&self, table: &InstanceTable, me: &str, now: Instant) -> usize {
        let mut kept = self.shards.lock().unwrap();
        let before = kept.len();
        kept.retain(|k| {
            let wanted = wanted(&k.instance, &k.key, table, me);
            let fresh = now.saturating_duration_since(k.since) < KEEP_FOR;
            if !(wanted && fresh) {
                tracing::info!(instance = %k.instance, generation = k.generation, "dropped a kept shard no rank here takes");
            }
            wanted && fresh
        });
        before - kept.len()
    }
}

/// Whether a rank of node `me` may still take the share `key` of `instance`: the instance
/// is in `table`, not unloading, and its placement has a rank on `me` of that share or of
/// one with layers in common with it.
fn wanted(instance: &str, key: &ShareKey, table: &InstanceTable, me: &str) -> bool {
    table.get(instance).is_some_and(|inst| {
        inst.state != InstanceState::Unloading
            && key
                .shares_on(inst, me)
                .any(|k| k == *key || key.common_layers(&k) > 0)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_planner::{Placement, SplitKind, StagePlacement, Strategy};

    /// An instance placed as `stages` (each stage's nodes in rank order, 8 layers each).
    fn inst(generation: u64, state: InstanceState, stages: &[&[&str]]) -> Instance {
        let tp = stages[0].len();
        Instance {
            id: "x".into(),
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

    fn table(i: Option<Instance>) -> InstanceTable {
        InstanceTable {
            version: 7,
            coordinator: "a".into(),
            instances: i.into_iter().map(|i| (i.id.clone(), i)).collect(),
            drained: Default::default(),
        }
    }

    #[test]
    fn a_new_rank_waits_for_older_ranks_to_let_go_only() {
        let kept = Arc::new(Kept::default());
        // a rank of the same placement, or of another instance, is not waited for
        let _same = kept.hold("x", 3);
        let _other = kept.hold("y", 1);
        let t0 = Instant::now();
        kept.wait_for_older("x", 3, Duration::from_secs(10));
        assert!(t0.elapsed() < Duration::from_secs(5));
        // an older one is, until it lets go
        let k = kept.clone();
        let (held, holding) = std::sync::mpsc::channel();
        let release = std::thread::spawn(move || {
            let old = k.hold("x", 2);
            held.send(()).unwrap();
            std::thread::sleep(Duration::from_millis(300));
            drop(old);
        });
        holding.recv().unwrap();
        let t0 = Instant::now();
        kept.wait_for_older("x", 3, Duration::from_secs(10));
        let waited = t0.elapsed();
        assert!(waited >= Duration::from_millis(100), "{waited:?}");
        assert!(waited < Duration::from_secs(5), "{waited:?}");
        release.join().unwrap();
    }

    #[test]
    fn a_share_is_wanted_while_a_rank_here_holds_it() {
        let file = Path::new("/m.gguf");
        let old = inst(1, InstanceState::Ready, &[&["a", "b"]]);
        let b = ShareKey::of(&old, 1, file);
        // before the re-placement, and after one that keeps b at rank 1
        assert!(wanted("x", &b, &table(Some(old.clone())), "b"));
        let kept = inst(2, InstanceState::Placing, &[&["c", "b"]]);
        assert!(wanted("x", &b, &table(Some(kept)), "b"));
        // b moved to rank 0: another share
        let moved = inst(2, InstanceState::Placing, &[&["b", "c"]]);
        assert!(!wanted("x", &b, &table(Some(moved)), "b"));
        // not on b at all, unloading, forgotten
        let elsewhere = inst(2, InstanceState::Placing, &[&["a", "c"]]);
        assert!(!wanted("x", &b, &table(Some(elsewhere)), "b"));
        let unloading = inst(1, InstanceState::Unloading, &[&["a", "b"]]);
        assert!(!wanted("x", &b, &table(Some(unloading)), "b"));
        assert!(!wanted("x", &b, &table(None), "b"));
        // another split of the same nodes (one rank, or two stages) loads other weights
        let whole = inst(2, InstanceState::Placing, &[&["b"]]);
        assert!(!wanted(
            "x",
            &ShareKey::of(&old, 0, file),
            &table(Some(whole)),
            "b"
        ));
        let piped = inst(2, InstanceState::Placing, &[&["c"], &["b"]]);
        assert!(!wanted("x", &b, &table(Some(piped)), "b"));
        // a rank taking a kept shard asks by the file it found too
        assert_ne!(ShareKey::of(&old, 1, Path::new("/n.gguf")), b);
    }

    #[test]
    fn a_stage_that_grew_or_moved_wants_the_layers_it_held() {
        let file = Path::new("/m.gguf");
        let old = inst(1, InstanceState::Ready, &[&["a"], &["b"], &["c"]]);
        let [a, b, c] = [0, 1, 2].map(|r| ShareKey::of(&old, r, file));
        assert_eq!(c.layers(), 16..24);
        // b died: a takes layers 0..12, c 12..24
        let mut new = inst(2, InstanceState::Placing, &[&["a"], &["c"]]);
        new.placement.stages[0].layers = 0..12;
        new.placement.stages[1].layers = 12..24;
        let [a2, c2] = [0, 1].map(|r| ShareKey::of(&new, r, file));
        assert_eq!(a.common_layers(&a2), 8);
        assert_eq!(c.common_layers(&c2), 8);
        assert_eq!(b.common_layers(&c2), 4);
        assert_eq!(a.common_layers(&c2), 0);
        let t = table(Some(new));
        assert!(wanted("x", &a, &t, "a"));
        assert!(wanted("x", &c, &t, "c"));
        // b's old share is wanted only where a rank of the new placement runs
        assert!(!wanted("x", &b, &t, "b"));
        // another file, another tensor cut, or another place in the stage keeps nothing
        assert_eq!(
            ShareKey::of(&old, 2, Path::new("/n.gguf")).common_layers(&c2),
            0
        );
        let tp2 = inst(3, InstanceState::Placing, &[&["a", "c"]]);
        let [a3, c3] = [0, 1].map(|r| ShareKey::of(&tp2, r, file));
        assert_eq!(a.common_layers(&a3), 0);
        assert_eq!(c.common_layers(&c3), 0);
        let wide = inst(3, InstanceState::Placing, &[&["a", "b"], &["c", "d"]]);
        let [w0, w1, w2, w3] = [0, 1, 2, 3].map(|r| ShareKey::of(&wide, r, file));
        assert_eq!(w2.layers(), 8..16);
        assert_eq!(w0.common_layers(&w2), 0, "stages apart");
        assert_eq!(w1.common_layers(&w3), 0, "stages apart");
        assert_eq!(w1.common_layers(&w2), 0, "another place in the stage");
    }
}
