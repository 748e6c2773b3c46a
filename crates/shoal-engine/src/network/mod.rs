//! The decoder-only transformer every supported architecture is, written once over a
//! [`Backend`]: token embedding, a stack of [`block::Block`]s, a final norm and the output
//! head. Differences between architectures are fields of [`ModelConfig`] and the tensors
//! their table says a file holds.
//!
//! A [`Network`] holds one rank's [`ShardPlan`]: the layers of its pipeline stage, and in
//! each a range of query heads (with the KV heads they read) and of feed-forward features;
//! the first stage embeds tokens and the last holds the final norm and the output head, both
//! cut by vocabulary across the stage's tensor-parallel ranks. At world size 1 the plan is
//! everything. Activations of a step live in a [`Workspace`] whose buffers are reused from
//! step to step.

pub(crate) mod attention;
pub(crate) mod block;
pub(crate) mod feed_forward;
pub(crate) mod latent;
pub(crate) mod linear;
pub(crate) mod moe;
pub(crate) mod mtp;
pub(crate) mod routing;

use std::sync::{Arc, Mutex};

use shoal_comm::Communicator;

use self::block::Block;
use self::linear::{Linear, Norm, Tensors};
use self::mtp::Mtp;
use crate::arch::{self, Role};
use crate::backend::{Backend, KvLayout, Routes, StepRows};
use crate::config::ModelConfig;
use crate::kv_cache::KvCache;
use crate::profile::{self, Op};
use crate::shard::ShardPlan;
use crate::weights::{Slice, WeightSource};
use crate::EngineError;

/// The activations of one step, reused by the next.
pub(crate) struct Workspace<B: Backend> {
    /// The residual stream, a row per token of the step.
    pub x: B::Act,
    /// A sublayer's normed input.
    pub xn: B::Act,
    /// Queries, keys and values.
    pub q: B::Act,
    pub k: B::Act,
    pub v: B::Act,
    /// Attention's output before its projection.
    pub att: B::Act,
    /// A sublayer's output.
    pub out: B::Act,
    /// The feed-forward's gated features.
    pub h: B::Act,
    /// A second sublayer output (shared experts), router logits, a compressed query.
    pub aux: B::Act,
    /// The step's expert routes.
    pub routes: Routes,
    /// Logits.
    pub logits: B::Act,
    /// The step's rows.
    pub rows: StepRows,
    /// What the step's layers share.
    pub tables: B::Tables,
}

impl<B: Backend> Default for Workspace<B> {
    fn default() -> Self {
        Workspace {
            x: B::Act::default(),
            xn: B::Act::default(),
            q: B::Act::default(),
            k: B::Act::default(),
            v: B::Act::default(),
            att: B::Act::default(),
            out: B::Act::default(),
            h: B::Act::default(),
            aux: B::Act::default(),
            routes: Routes::default(),
            logits: B::Act::default(),
            rows: StepRows::default(),
            tables: B::Tables::default(),
        }
    }
}

/// How much of a share [`Network::regrow`] kept from the share before it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reuse {
    /// Layers taken from the earlier share.
    pub layers_kept: usize,
    /// Layers read from the file.
    pub layers_loaded: usize,
}

/// Loaded pieces of an earlier share that a load takes instead of reading them again.
struct Parts<B: Backend> {
    /// The embedding's rows of the new share's vocabulary (a tied head's too).
    table: Option<Arc<B::Matrix>>,
    /// Blocks by layer, cut across the stage's ranks as the new share cuts them.
    blocks: Vec<(usize, Arc<Block<B>>)>,
    norm: Option<Arc<Norm<B>>>,
    /// An untied output head of the new share's vocabulary rows.
    head: Option<Arc<Linear<B>>>,
}

impl<B: Backend> Parts<B> {
    fn none() -> Self {
        Parts {
            table: None,
            blocks: Vec::new(),
            norm: None,
            head: None,
        }
    }
}

/// One rank's share of a model on backend `B`.
pub(crate) struct Network<B: Backend> {
    be: B,
    cfg: ModelConfig,
    plan: ShardPlan,
    /// The ranks of this rank's pipeline stage (sums partial results; world size 1 when the
    /// stage is not cut).
    tp: Arc<dyn Communicator>,
    /// The embedding table's rows this rank holds (first stage).
    embed: Option<Arc<B::Matrix>>,
    /// Its layers (shared with the share it was regrown from, or into).
    blocks: Vec<Arc<Block<B>>>,
    norm: Option<Arc<Norm<B>>>,
    head: Option<Arc<Linear<B>>>,
    /// The file's first multi-token-prediction layer, on a rank holding the whole model.
    mtp: Option<Arc<Mtp<B>>>,
    /// Workspaces of finished steps, for the next ones.
    spare: Mutex<Vec<Workspace<B>>>,
}

impl<B: Backend> Network<B> {
    /// Loads what `plan` says this rank holds on `be`; `tp` is the communicator of the
    /// ranks of its pipeline stage.
    ///
    /// # Errors
    /// When a tensor is missing or misshapen.
    pub fn load(
        be: B,
        src: &dyn WeightSource,
        cfg: ModelConfig,
        plan: ShardPlan,
        tp: Arc<dyn Communicator>,
    ) -> Result<Self, EngineError> {
        Ok(Self::load_with(be, src, cfg, plan, tp, Parts::none())?.0)
    }

    /// This share made into the share `plan` of the same file: the layers both hold (cut
    /// the same way across the stage's ranks), the embedding and the output head of the
    /// same vocabulary rows and the final norm are shared with this one, and what `plan`
    /// adds is read from `src`; `tp` is the new stage's communicator. What only this share
    /// holds goes when it is dropped.
    ///
    /// # Errors
    /// As [`Network::load`].
    pub fn regrow(
        &self,
        src: &dyn WeightSource,
        plan: ShardPlan,
        tp: Arc<dyn Communicator>,
    ) -> Result<(Self, Reuse), EngineError> {
        let old = &self.plan;
        let blocks = if old.shard == plan.shard {
            old.layers
                .clone()
                .zip(&self.blocks)
                .filter(|(layer, _)| plan.layers.contains(layer))
                .map(|(layer, b)| (layer, b.clone()))
                .collect()
        } else {
            Vec::new()
        };
        let same_rows = old.vocab == plan.vocab;
        let spec = arch::spec(self.cfg.arch);
        let be = self.be.clone();
        let tied = Tensors { be: &be, src, spec }
            .model(Role::Output)?
            .is_none();
        let table = match (&self.embed, &self.head) {
            _ if !same_rows => None,
            (Some(e), _) => Some(e.clone()),
            (None, Some(h)) if tied => Some(h.w.clone()),
            _ => None,
        };
        let parts = Parts {
            table,
            blocks,
            norm: self.norm.clone(),
            head: self.head.clone().filter(|_| same_rows && !tied),
        };
        Self::load_with(be, src, self.cfg.clone(), plan, tp, parts)
    }

    /// Loads what `plan` says this rank holds on `be`, taking what `have` holds instead of
    /// reading it from `src`.
    fn load_with(
        be: B,
        src: &dyn WeightSource,
        cfg: ModelConfig,
        plan: ShardPlan,
        tp: Arc<dyn Communicator>,
        mut have: Parts<B>,
    ) -> Result<(Self, Reuse), EngineError> {
        be.supports(&cfg)?;
        let spec = arch::spec(cfg.arch);
        let t = Tensors { be: &be, src, spec };
        let embed_name = t
            .model(Role::TokenEmbd)?
            .ok_or_else(|| EngineError::Internal {
                what: format!("the {} table has no token embedding", spec.gguf_name),
            })?;
        t.check_shape(&embed_name, &[cfg.vocab, cfg.hidden])?;
        let head_name = t.model(Role::Output)?;
        let tied = head_name.is_none();
        let vocab_slice = if plan.vocab == (0..cfg.vocab) {
            Slice::Full
        } else {
            Slice::Rows(plan.vocab.clone())
        };
        let embed = if plan.first_stage || (plan.last_stage && tied) {
            match have.table.take() {
                Some(e) => Some(e),
                None => Some(Arc::new(be.matrix(src, &embed_name, &vocab_slice)?)),
            }
        } else {
            None
        };
        let freq_factors = match (&cfg.rope_freq_factors, t.model(Role::RopeFreqs)?) {
            (Some(f), _) => Some(f.clone()),
            (None, Some(name)) => {
                t.check_shape(&name, &[cfg.head_dim / 2])?;
                Some(Arc::from(t.values(&name, &Slice::Full)?))
            }
            (None, None) => None,
        };
        let mut reuse = Reuse::default();
        let mut blocks = Vec::with_capacity(plan.layers.len());
        for layer in plan.layers.clone() {
            match have.blocks.iter().position(|(l, _)| *l == layer) {
                Some(i) => {
                    blocks.push(have.blocks.swap_remove(i).1);
                    reuse.layers_kept += 1;
                }
                None => {
                    blocks.push(Arc::new(Block::load(
                        &t,
                        &cfg,
                        layer,
                        &plan.shard,
                        freq_factors.as_ref(),
                    )?));
                    reuse.layers_loaded += 1;
                }
            }
        }
        let (norm, head) = if plan.last_stage {
            let norm = match have.norm.take() {
                Some(n) => n,
                None => {
                    let norm_name =
                        t.model(Role::OutputNorm)?
                            .ok_or_else(|| EngineError::Internal {
                                what: format!("the {} table has no output norm", spec.gguf_name),
                            })?;
                    Arc::new(Norm::load(&t, &norm_name, cfg.hidden, cfg.rms_eps)?)
                }
            };
            let head = match (&embed, &head_name, have.head.take()) {
                (Some(e), None, _) => Arc::new(Linear {
                    w: e.clone(),
                    bias: None,
                }),
                (_, Some(_), Some(h)) => h,
                (_, Some(name), None) => Arc::new(Linear::rows(
                    &t,
                    name,
                    None,
                    [cfg.vocab, cfg.hidden],
                    plan.vocab.clone(),
                )?),
                (None, None, _) => {
                    return Err(EngineError::Internal {
                        what: "a tied output head without the embedding".into(),
                    })
                }
            };
            (Some(norm), Some(head))
        } else {
            (None, None)
        };
        let embed = if plan.first_stage { embed } else { None };
        let mtp = if plan.holds_prediction(&cfg) {
            Mtp::load(&t, &cfg, &plan.shard, freq_factors.as_ref())?.map(Arc::new)
        } else {
            None
        };
        be.loaded()?;
        let net = Network {
            be,
            cfg,
            plan,
            tp,
            embed,
            blocks,
            norm,
            head,
            mtp,
            spare: Mutex::new(Vec::new()),
        };
        Ok((net, reuse))
    }

    /// The model's hyperparameters.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// What this rank holds.
    pub fn plan(&self) -> &ShardPlan {
        &self.plan
    }

    /// The backend's name.
    pub fn backend_name(&self) -> &'static str {
        self.be.name()
    }

    /// The backend's device counters, where it runs on a device.
    pub fn backend_counters(&self) -> Option<crate::device::GpuCounters> {
        self.be.counters()
    }

    /// An empty cache for one sequence of up to `capacity` positions of this rank's layers.
    pub fn new_cache(&self, capacity: usize) -> KvCache {
        self.cache_of(self.plan.layers.len(), capacity)
    }

    /// An empty cache of `layers` layers of this rank's heads, `capacity` positions each.
    fn cache_of(&self, layers: usize, capacity: usize) -> KvCache {
        let layout = match &self.cfg.mla {
            Some(m) => KvLayout::Latent {
                dims: m.kv_lora_rank + m.rope_dims,
            },
            None => KvLayout::Heads {
                kv_heads: self.plan.shard.kv_heads.len(),
                head_dim: self.cfg.head_dim,
            },
        };
        let kv = self.be.kv(layers, layout, capacity);
        KvCache::new(Box::new(kv), capacity, self.be.name())
    }

    /// Makes `to` hold the first `len` positions `from` holds.
    ///
    /// # Errors
    /// When either cache is another backend's, `from` holds fewer positions, or `to` has no
    /// room for them.
    pub fn copy_prefix(
        &self,
        from: &KvCache,
        to: &mut KvCache,
        len: usize,
    ) -> Result<(), EngineError> {
        if len > from.len() || len > to.capacity() {
            return Err(EngineError::InvalidInput {
                what: format!(
                    "copying {len} positions from a cache holding {} into one with room for {}",
                    from.len(),
                    to.capacity()
                ),
            });
        }
        let src = from.store::<B::Kv>().ok_or_else(|| self.foreign(from))?;
        let to_backend = to.backend();
        let dst = to
            .store_mut::<B::Kv>()
            .ok_or_else(|| self.foreign_named(to_backend))?;
        self.be.copy_kv(src, dst, len)?;
        to.truncate(0);
        to.advance(len);
        Ok(())
    }

    /// The error for a cache another backend made.
    fn foreign(&self, c: &KvCache) -> EngineError {
        self.foreign_named(c.backend())
    }

    fn foreign_named(&self, made_by: &str) -> EngineError {
        EngineError::InvalidInput {
            what: format!(
                "a KV cache made by the {made_by} backend, for a model on the {} backend",
                self.be.name()
            ),
        }
    }

    /// Runs `f` with a workspace for the step whose sequences add `counts[i]` rows after
    /// what `caches[i]` holds, and this backend's storage of those caches; the caches'
    /// ends move past the rows when `f` succeeds.
    fn with_step<R>(
        &self,
        counts: &[usize],
        caches: &mut [&mut KvCache],
        f: impl FnOnce(&mut Workspace<B>, &mut [&mut B::Kv]) -> Result<R, EngineError>,
    ) -> Result<R, EngineError> {
        check_rows(counts, caches)?;
        let starts: Vec<usize> = caches.iter().map(|c| c.len()).collect();
        let mut kv: Vec<&mut B::Kv> = Vec::with_capacity(caches.len());
        for c in caches.iter_mut() {
            let made_by = c.backend();
            kv.push(
                c.store_mut::<B::Kv>()
                    .ok_or_else(|| self.foreign_named(made_by))?,
            );
        }
        let mut ws = self
            .spare
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop()
            .unwrap_or_default();
        ws.rows.reset(counts, &starts);
        let result = f(&mut ws, &mut kv);
        drop(kv);
        self.spare
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(ws);
        let r = result?;
        for (c, &n) in caches.iter_mut().zip(counts) {
            c.advance(n);
        }
        Ok(r)
    }

    /// Checks the token ids of a step against the vocabulary.
    fn check_ids(&self, tokens: &[u32]) -> Result<(), EngineError> {
        if let Some(&bad) = tokens.iter().find(|&&id| id as usize >= self.cfg.vocab) {
            return Err(EngineError::InvalidInput {
                what: format!(
                    "token id {bad} is outside the vocabulary of {}",
                    self.cfg.vocab
                ),
            });
        }
        Ok(())
    }

    /// The embedded `tokens` into `ws.x` (first stage), gathered across the stage's ranks
    /// when the vocabulary is cut.
    fn embed_into(&self, tokens: &[u32], ws: &mut Workspace<B>) -> Result<(), EngineError> {
        let Some(table) = &self.embed else {
            return Err(EngineError::Internal {
                what: "embedding tokens on a rank that is not in the first pipeline stage".into(),
            });
        };
        self.check_ids(tokens)?;
        let _p = profile::scope(Op::Embed);
        // ggml scales in f32: round the factor the same way
        let scale = self.cfg.embed_scale as f32;
        self.be
            .embed(table, self.plan.vocab.clone(), tokens, scale, &mut ws.x)?;
        if self.tp.world_size() > 1 {
            self.be.all_reduce(&*self.tp, &mut ws.x)?;
        }
        Ok(())
    }

    /// This rank's layers over `ws.x`.
    fn layers(&self, ws: &mut Workspace<B>, kv: &mut [&mut B::Kv]) -> Result<(), EngineError> {
        self.be.begin_step(&ws.rows, &mut ws.tables);
        let profiling = profile::enabled();
        for (layer, block) in self.blocks.iter().enumerate() {
            if profiling {
                profile::enter(block.profile_part());
            }
            let done = block.forward(&self.be, ws, kv, layer, &*self.tp);
            if profiling {
                profile::enter(profile::Part::Outside);
            }
            done?;
        }
        Ok(())
    }

    /// The logits of the last `last` rows of each sequence of the step (last stage):
    /// `(rows, vocabulary slice)`.
    fn head(&self, ws: &mut Workspace<B>, last: usize) -> Result<Vec<f32>, EngineError> {
        let (Some(norm), Some(head)) = (&self.norm, &self.head) else {
            return Err(EngineError::Internal {
                what: "logits on a rank that is not in the last pipeline stage".into(),
            });
        };
        self.head_with(ws, last, norm, head)
    }

    /// [`Network::head`] with the final norm `norm` and the output head `head`.
    fn head_with(
        &self,
        ws: &mut Workspace<B>,
        last: usize,
        norm: &Norm<B>,
        head: &Linear<B>,
    ) -> Result<Vec<f32>, EngineError> {
        let _p = profile::scope(Op::Head);
        let which: Vec<usize> = ws
            .rows
            .seqs
            .iter()
            .flat_map(|s| s.rows.end - last.clamp(1, s.rows.len())..s.rows.end)
            .collect();
        self.be
            .select_rows(&ws.x, self.cfg.hidden, &which, &mut ws.out);
        self.be.rms_norm(&ws.out, &norm.w, norm.eps, &mut ws.xn);
        self.be.matmul(&[&*head.w], &ws.xn, &mut [&mut ws.logits])?;
        self.be.download(std::mem::take(&mut ws.logits))
    }

    /// A whole step on a rank that holds the whole model: `tokens` (each sequence's
    /// `counts[i]` tokens in turn) after what each of `caches` holds, and the logits of
    /// the last `last` rows of each sequence.
    ///
    /// # Errors
    /// When a cache has no room, an id is out of range, the lengths do not agree, or this
    /// rank holds only part of the model.
    pub fn step(
        &self,
        tokens: &[u32],
        counts: &[usize],
        caches: &mut [&mut KvCache],
        last: usize,
    ) -> Result<Vec<f32>, EngineError> {
        Ok(self.whole_step(tokens, counts, caches, last, false)?.0)
    }

    /// [`Network::step`], and with `hidden` every row's output hidden state after the final
    /// norm (else an empty vector).
    fn whole_step(
        &self,
        tokens: &[u32],
        counts: &[usize],
        caches: &mut [&mut KvCache],
        last: usize,
        hidden: bool,
    ) -> Result<(Vec<f32>, Vec<f32>), EngineError> {
        let (true, Some(norm)) = (self.plan.is_full(&self.cfg), &self.norm) else {
            return Err(EngineError::Internal {
                what: format!(
                    "a whole forward pass on a rank holding only part of the model ({:?})",
                    self.plan
                ),
            });
        };
        check_tokens(tokens, counts)?;
        self.check_ids(tokens)?;
        let decode = counts.iter().all(|&n| n == 1);
        self.be.run_step(decode, || {
            self.with_step(counts, caches, |ws, kv| {
                self.embed_into(tokens, ws)?;
                self.layers(ws, kv)?;
                let rows = if hidden {
                    self.be.rms_norm(&ws.x, &norm.w, norm.eps, &mut ws.aux);
                    self.be.download(std::mem::take(&mut ws.aux))?
                } else {
                    Vec::new()
                };
                Ok((self.head(ws, last)?, rows))
            })
        })
    }

    /// [`Network::step`] that also returns every row's output hidden state after the final
    /// norm (what a multi-token-prediction layer reads), a row of `hidden` values each.
    ///
    /// # Errors
    /// As [`Network::step`].
    pub fn step_hidden(
        &self,
        tokens: &[u32],
        counts: &[usize],
        caches: &mut [&mut KvCache],
        last: usize,
    ) -> Result<(Vec<f32>, Vec<f32>), EngineError> {
        self.whole_step(tokens, counts, caches, last, true)
    }

    /// An empty cache of the multi-token-prediction layer for one sequence of up to
    /// `capacity` positions; `None` without the layer.
    pub fn new_mtp_cache(&self, capacity: usize) -> Option<KvCache> {
        self.mtp.as_ref()?;
        Some(self.cache_of(1, capacity))
    }

    /// The multi-token-prediction layer over `counts[i]` rows of each sequence after what
    /// its layer cache `caches[i]` holds: row `r` joins `hidden[r]` (the model's normed
    /// output at a position, or the layer's own output for a further draft) with
    /// `tokens[r]`, the token after that position. Returns the logits of the last `last`
    /// rows of each sequence (of the token two after each position; none when `last` is 0,
    /// for rows only read into the layer's cache) and every row's output hidden state
    /// (before the head's norm).
    ///
    /// # Errors
    /// Without the layer, when the rows disagree, an id is out of range, or a cache has no
    /// room.
    pub fn mtp_step(
        &self,
        hidden: Vec<f32>,
        tokens: &[u32],
        counts: &[usize],
        caches: &mut [&mut KvCache],
        last: usize,
    ) -> Result<(Vec<f32>, Vec<f32>), EngineError> {
        let (Some(mtp), Some(table), Some(norm), Some(head)) =
            (&self.mtp, &self.embed, &self.norm, &self.head)
        else {
            return Err(EngineError::Unsupported {
                what: "drafting with multi-token prediction: this model (or this rank's share of it) has no prediction layer".into(),
            });
        };
        check_tokens(tokens, counts)?;
        self.check_ids(tokens)?;
        if hidden.len() != tokens.len() * self.cfg.hidden {
            return Err(EngineError::InvalidInput {
                what: format!(
                    "{} hidden values for {} rows of {}",
                    hidden.len(),
                    tokens.len(),
                    self.cfg.hidden
                ),
            });
        }
        let norm = mtp.head_norm().unwrap_or(norm);
        let head = mtp.head().unwrap_or(head);
        let decode = counts.iter().all(|&n| n == 1);
        self.be.run_step(decode, || {
            self.with_step(counts, caches, |ws, kv| {
                mtp.forward(
                    &self.be, &self.cfg, table, tokens, hidden, ws, kv, &*self.tp,
                )?;
                let out = self.be.host(&ws.x)?.into_owned();
                let logits = if last == 0 {
                    Vec::new()
                } else {
                    self.head_with(ws, last, norm, head)?
                };
                Ok((logits, out))
            })
        })
    }

    /// The output hidden states `x` (a row each) after the final norm (last stage only):
    /// what a multi-token-prediction layer reads.
    ///
    /// # Errors
    /// When this rank is not in the last stage or `x` is not whole rows.
    pub fn final_norm(&self, x: Vec<f32>) -> Result<Vec<f32>, EngineError> {
        let Some(norm) = &self.norm else {
            return Err(EngineError::Internal {
                what: "the final norm on a rank that is not in the last pipeline stage".into(),
            });
        };
        if !x.len().is_multiple_of(self.cfg.hidden) {
            return Err(EngineError::InvalidInput {
                what: format!("{} hidden values in rows of {}", x.len(), self.cfg.hidden),
            });
        }
        let mut out = B::Act::default();
        self.be
            .rms_norm(&self.be.upload(x), &norm.w, norm.eps, &mut out);
        self.be.download(out)
    }

    /// The hidden states of `tokens`, a row each (first stage only).
    ///
    /// # Errors
    /// When this rank is not in the first stage, an id is out of range, or a peer fails.
    pub fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        let mut ws = Workspace::<B>::default();
        self.embed_into(tokens, &mut ws)?;
        self.be.download(ws.x)
    }

    /// Runs this rank's layers over hidden states `x` (a row per token, each sequence's
    /// `counts[i]` rows in turn, after what `caches[i]` holds) and returns them.
    ///
    /// # Errors
    /// When the rows and caches do not agree, a cache has no room, or a peer fails (the
    /// caches of a failed step are unusable).
    pub fn forward_layers(
        &self,
        x: Vec<f32>,
        counts: &[usize],
        caches: &mut [&mut KvCache],
    ) -> Result<Vec<f32>, EngineError> {
        let rows: usize = counts.iter().sum();
        if x.len() != rows * self.cfg.hidden {
            return Err(EngineError::InvalidInput {
                what: format!(
                    "{} hidden values for {rows} rows of {}",
                    x.len(),
                    self.cfg.hidden
                ),
            });
        }
        let run = || {
            self.with_step(counts, caches, |ws, kv| {
                ws.x = self.be.upload(x);
                self.layers(ws, kv)?;
                self.be.download(std::mem::take(&mut ws.x))
            })
        };
        if self.plan.is_full(&self.cfg) {
            self.be.run_step(counts.iter().all(|&n| n == 1), run)
        } else {
            run()
        }
    }

    /// Runs part of a step on a rank that holds part of a share (one device's layers, see
    /// `crate::offload`): `input` (token ids on the first stage, hidden states otherwise,
    /// each sequence's `counts[i]` rows in turn, after what `caches[i]` holds) through this
    /// rank's layers, then the logits of the last `last` rows of each sequence where
    /// `last` is given (last stage), else the hidden states.
    ///
    /// # Errors
    /// As [`Network::step`] and [`Network::forward_layers`].
    pub fn part_step(
        &self,
        input: PartInput<'_>,
        counts: &[usize],
        caches: &mut [&mut KvCache],
        last: Option<usize>,
    ) -> Result<Vec<f32>, EngineError> {
        let rows: usize = counts.iter().sum();
        match input {
            PartInput::Tokens(tokens) => {
                check_tokens(tokens, counts)?;
                self.check_ids(tokens)?;
            }
            PartInput::Hidden(x) if x.len() != rows * self.cfg.hidden => {
                return Err(EngineError::InvalidInput {
                    what: format!(
                        "{} hidden values for {rows} rows of {}",
                        x.len(),
                        self.cfg.hidden
                    ),
                })
            }
            PartInput::Hidden(_) => {}
        }
        let run = || {
            self.with_step(counts, caches, |ws, kv| {
                match input {
                    PartInput::Tokens(tokens) => self.embed_into(tokens, ws)?,
                    PartInput::Hidden(x) => ws.x = self.be.upload(x),
                }
                self.layers(ws, kv)?;
                match last {
                    Some(last) => self.head(ws, last),
                    None => self.be.download(std::mem::take(&mut ws.x)),
                }
            })
        };
        // as in `forward_layers`: a step with collectives inside runs outside the backend's
        // step team, which ranks of one process would otherwise wait on each other for
        if self.tp.world_size() == 1 {
            self.be.run_step(counts.iter().all(|&n| n == 1), run)
        } else {
            run()
        }
    }

    /// This rank's vocabulary slice of the logits of the last `last` rows of each
    /// sequence of hidden states `x` (last stage only).
    ///
    /// # Errors
    /// When this rank is not in the last stage, or the rows do not agree.
    pub fn logits(
        &self,
        x: &[f32],
        counts: &[usize],
        last: usize,
    ) -> Result<Vec<f32>, EngineError> {
        let rows: usize = counts.iter().sum();
        if x.len() != rows * self.cfg.hidden || counts.contains(&0) {
            return Err(EngineError::InvalidInput {
                what: format!(
                    "{} hidden values for sequences of {counts:?} rows of {}",
                    x.len(),
                    self.cfg.hidden
                ),
            });
        }
        let mut ws = Workspace::<B>::default();
        let starts = vec![0; counts.len()];
        ws.rows.reset(counts, &starts);
        ws.x = self.be.upload(x.to_vec());
        self.head(&mut ws, last)
    }
}

/// What a part of a step starts from.
pub(crate) enum PartInput<'a> {
    /// Token ids (the first stage embeds them).
    Tokens(&'a [u32]),
    /// Hidden states, a row per token.
    Hidden(Vec<f32>),
}

/// Checks that the tokens of a step are the sequences' rows.
fn check_tokens(tokens: &[u32], counts: &[usize]) -> Result<(), EngineError> {
    if tokens.len() != counts.iter().sum::<usize>() {
        return Err(EngineError::InvalidInput {
            what: format!("{} tokens for sequences of {counts:?} tokens", tokens.len()),
        });
    }
    Ok(())
}

/// Checks that a step has rows, one count per cache, and room for them in every cache.
fn check_rows(counts: &[usize], caches: &[&mut KvCache]) -> Result<(), EngineError> {
    if counts.is_empty() || counts.contains(&0) {
        return Err(EngineError::InvalidInput {
            what: format!("a forward pass over sequences of {counts:?} tokens"),
        });
    }
    if counts.len() != caches.len() {
        return Err(EngineError::InvalidInput {
            what: format!(
                "a step of {} sequences with {} caches",
                counts.len(),
                caches.len()
            ),
        });
    }
    for (c, &n) in caches.iter().zip(counts) {
        if c.len() + n > c.capacity() {
            return Err(EngineError::ContextFull {
                prompt: c.len() + n,
                ctx: c.capacity(),
            });
        }
    }
    Ok(())
}
