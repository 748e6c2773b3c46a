//! Running one model split over ranks: the step protocol between the lead rank (rank 0,
//! which tokenizes, samples and streams text) and every other rank.
//!
//! Each step the lead broadcasts a fixed-size [`Header`] (how many tokens, where the
//! sequence's cache ends, what the sampler needs back) and the token ids. First-stage ranks
//! embed the tokens; every later stage receives the hidden states from the rank with the same
//! tensor-parallel index in the stage before, runs its layers (its tensor-parallel group
//! summing partial results) and sends them on. Last-stage ranks compute their vocabulary
//! slice of the logits and send the lead only what the sampler needs: their best token for
//! greedy decoding, their top k for top-k sampling, the whole slice otherwise. The lead
//! merges them into a vocabulary-length vector (tokens no rank sent are `-inf`), so the
//! sampler and generation loop are those of one rank, and greedy tokens are exact. When the
//! lead drafts with the model's multi-token-prediction layer ([`Lead::keep_hidden`]), the
//! first rank of the last stage also sends every row's output hidden state after the final
//! norm, which that layer reads.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use shoal_comm::{CommError, Communicator, Group, Transport};

use crate::kv_cache::KvCache;
use crate::sampler::SamplerConfig;
use crate::shard::{Layout, ShardPlan};
use crate::transformer::Transformer;
use crate::EngineError;

/// Where one rank sits and how it talks to the others.
#[derive(Clone)]
pub struct RankContext {
    /// The split.
    pub layout: Layout,
    /// This rank.
    pub rank: usize,
    /// Every rank of the instance.
    pub world: Arc<dyn Communicator>,
    /// The ranks of this rank's pipeline stage.
    pub tp: Arc<dyn Communicator>,
    /// What every rank holds, in rank order.
    pub plans: Vec<ShardPlan>,
}

impl RankContext {
    /// The context of the rank at the end of `transport` (a mesh of `layout.world()` ranks),
    /// with collectives that wait at most `timeout` for a peer.
    ///
    /// # Errors
    /// When the transport's world does not match the layout.
    pub fn over(
        transport: Arc<dyn Transport>,
        layout: Layout,
        timeout: Duration,
    ) -> Result<Self, EngineError> {
        let rank = transport.rank();
        if transport.world_size() != layout.world() {
            return Err(EngineError::InvalidInput {
                what: format!(
                    "a split of {} x {} ranks over a transport of {}",
                    layout.tp,
                    layout.pp,
                    transport.world_size()
                ),
            });
        }
        let world = Group::world(transport.clone()).with_timeout(timeout);
        let members = layout.stage_ranks(layout.stage(rank)).collect();
        let tp = Group::new(transport, members)?.with_timeout(timeout);
        Ok(RankContext {
            layout,
            rank,
            world: Arc::new(world),
            tp: Arc::new(tp),
            plans: Vec::new(),
        })
    }
}

impl std::fmt::Debug for RankContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankContext")
            .field("layout", &self.layout)
            .field("rank", &self.rank)
            .finish()
    }
}

/// A communicator that adds the wall time of every call to a shared counter: how long a
/// rank spends exchanging data and waiting for its peers (for `shoal bench --tp/--pp`).
pub struct Timed {
    inner: Arc<dyn Communicator>,
    nanos: Arc<AtomicU64>,
}

impl Timed {
    /// Wraps `inner`, adding to `nanos`.
    pub fn new(inner: Arc<dyn Communicator>, nanos: Arc<AtomicU64>) -> Self {
        Timed { inner, nanos }
    }

    fn time<R>(&self, f: impl FnOnce() -> R) -> R {
        let t0 = Instant::now();
        let r = f();
        self.nanos
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r
    }
}

impl Communicator for Timed {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn all_reduce_sum(&self, data: &mut [f32]) -> Result<(), CommError> {
        self.time(|| self.inner.all_reduce_sum(data))
    }

    fn broadcast(&self, data: &mut [u8], root: usize) -> Result<(), CommError> {
        self.time(|| self.inner.broadcast(data, root))
    }

    fn all_gather(&self, mine: &[u8], out: &mut [u8]) -> Result<(), CommError> {
        self.time(|| self.inner.all_gather(mine, out))
    }

    fn send(&self, peer: usize, data: &[u8]) -> Result<(), CommError> {
        self.time(|| self.inner.send(peer, data))
    }

    fn recv(&self, peer: usize, data: &mut [u8]) -> Result<(), CommError> {
        self.time(|| self.inner.recv(peer, data))
    }
}

/// What the lead needs back from the last stage after a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    /// Nothing (a prefill chunk before the last).
    Nothing,
    /// Each rank's best token (greedy decoding).
    Best,
    /// Each rank's `k` best tokens (top-k sampling).
    TopK(usize),
    /// Every logit.
    All,
}

impl Want {
    /// What `cfg`'s sampler needs to choose exactly as it would from the full logits.
    pub fn for_sampler(cfg: &SamplerConfig) -> Want {
        if cfg.repeat_penalty != 1.0 {
            // The penalty reorders tokens before any cut: it needs every logit.
            Want::All
        } else if cfg.temperature <= 0.0 {
            Want::Best
        } else if cfg.top_k > 0 {
            Want::TopK(cfg.top_k)
        } else {
            Want::All
        }
    }

    fn code(self) -> (u32, u32) {
        match self {
            Want::Nothing => (0, 0),
            Want::Best => (1, 0),
            Want::TopK(k) => (2, k as u32),
            Want::All => (3, 0),
        }
    }

    fn from_code(code: u32, k: u32) -> Option<Want> {
        Some(match code {
            0 => Want::Nothing,
            1 => Want::Best,
            2 if k > 0 => Want::TopK(k as usize),
            3 => Want::All,
            _ => return None,
        })
    }

    /// Bytes one last-stage rank holding `slice` vocabulary rows sends.
    fn reply_bytes(self, slice: usize) -> usize {
        match self {
            Want::Nothing => 0,
            Want::Best => 8,
            Want::TopK(k) => 8 * k,
            Want::All => 4 * slice,
        }
    }
}

const OP_STEP: u32 = 1;
const OP_STOP: u32 = 2;
/// A batched decode step: `n_tokens` sequences, one token each; the body lists
/// (sequence, cache length, token) per row, by ascending sequence.
const OP_BATCH: u32 = 3;
/// Bytes per row of a batched step's body.
const BATCH_ROW_BYTES: usize = 12;
/// Copies the first `cache_len` positions of sequence `n_tokens`'s cache into sequence
/// `seq`'s (a prefix shared with an earlier or running sequence); no body, no reply.
const OP_COPY: u32 = 4;
/// A step of several tokens per sequence (drafted tokens checked): `n_tokens` sequences and
/// `cache_len` tokens in all; the body lists (sequence, cache length, token count) per
/// sequence, by ascending sequence, then the tokens; the last stage replies for every row.
const OP_ROWS: u32 = 5;
/// Most tokens one sequence runs in an [`OP_ROWS`] step.
pub const MAX_ROWS_PER_SEQUENCE: usize = 64;
const HEADER_BYTES: usize = 24;
/// The bit of the header's reply-kind word that asks for the rows' hidden states.
const HIDDEN_FLAG: u32 = 1 << 8;
/// Most sequences a split model keeps caches for at once.
pub const MAX_SEQUENCES: usize = 256;

/// The fixed-size message that starts every step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Header {
    op: u32,
    /// The sequence (its own KV cache on every rank).
    seq: u32,
    n_tokens: u32,
    /// The cache length every rank truncates to before the step.
    cache_len: u32,
    want: Want,
    /// Whether the first rank of the last stage sends the lead every row's output hidden
    /// state after the final norm.
    hidden: bool,
}

impl Header {
    fn encode(&self) -> [u8; HEADER_BYTES] {
        let (w, k) = self.want.code();
        let w = w | if self.hidden { HIDDEN_FLAG } else { 0 };
        let mut b = [0u8; HEADER_BYTES];
        for (i, v) in [self.op, self.n_tokens, self.cache_len, w, k, self.seq]
            .into_iter()
            .enumerate()
        {
            b[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes());
        }
        b
    }

    fn decode(b: &[u8; HEADER_BYTES]) -> Result<Header, EngineError> {
        let word =
            |i: usize| u32::from_le_bytes([b[i * 4], b[i * 4 + 1], b[i * 4 + 2], b[i * 4 + 3]]);
        let bad = |what: String| EngineError::InvalidInput {
            what: format!("step header from the lead rank: {what}"),
        };
        let op = word(0);
        if ![OP_STEP, OP_STOP, OP_BATCH, OP_COPY, OP_ROWS].contains(&op) {
            return Err(bad(format!("unknown operation {op}")));
        }
        let hidden = word(3) & HIDDEN_FLAG != 0;
        let want = Want::from_code(word(3) & !HIDDEN_FLAG, word(4))
            .ok_or_else(|| bad(format!("unknown reply kind {} (k {})", word(3), word(4))))?;
        let seq = word(5);
        if seq as usize >= MAX_SEQUENCES {
            return Err(bad(format!("sequence {seq} (at most {MAX_SEQUENCES})")));
        }
        if op == OP_COPY && (word(1) as usize >= MAX_SEQUENCES || word(1) == seq) {
            return Err(bad(format!("a copy from sequence {} into {seq}", word(1))));
        }
        Ok(Header {
            op,
            seq,
            n_tokens: word(1),
            cache_len: word(2),
            want,
            hidden,
        })
    }
}

/// The hidden states a step starts from on this rank (a row per token): the embedded
/// tokens in the first stage, else what the same tensor-parallel index of the stage before
/// sent.
fn stage_input(
    ctx: &RankContext,
    model: &Transformer,
    tokens: &[u32],
) -> Result<Vec<f32>, EngineError> {
    if ctx.layout.stage(ctx.rank) == 0 {
        return model.embed(tokens);
    }
    let (t, d) = (tokens.len(), model.config().hidden);
    let mut buf = vec![0u8; t * d * 4];
    ctx.world.recv(ctx.rank - ctx.layout.tp, &mut buf)?;
    Ok(buf
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// Sends the hidden states `x` on to the next stage; `false` (nothing sent) on the last.
fn pass_on(ctx: &RankContext, x: &[f32]) -> Result<bool, EngineError> {
    if ctx.layout.stage(ctx.rank) + 1 >= ctx.layout.pp {
        return Ok(false);
    }
    let bytes: Vec<u8> = x.iter().flat_map(|f| f.to_le_bytes()).collect();
    ctx.world.send(ctx.rank + ctx.layout.tp, &bytes)?;
    Ok(true)
}

/// The rank that sends the lead the rows' hidden states when a step asks for them: the
/// first of the last stage (after the stage's collectives every rank of it holds them).
fn hidden_rank(layout: &Layout) -> usize {
    layout.stage_ranks(layout.pp - 1).start
}

/// What one rank's part of a step gives: the last stage's replies (a row per sequence's
/// last positions), and on [`hidden_rank`] when asked, every row's output hidden state
/// after the final norm.
#[derive(Default)]
struct StepOut {
    reply: Vec<u8>,
    hidden: Option<Vec<f32>>,
}

/// Runs this rank's part of one step of sequences that add `counts[i]` of `tokens` after
/// what `caches[i]` holds: embed or receive, run the layers, send on or reply. Returns the
/// last stage's replies (a row per sequence: its last position), for the lead to merge or
/// to send, and the rows' hidden states where `hidden` asks this rank for them.
#[allow(clippy::too_many_arguments)]
fn run_step(
    ctx: &RankContext,
    model: &Transformer,
    caches: &mut [&mut KvCache],
    tokens: &[u32],
    counts: &[usize],
    last: usize,
    want: Want,
    hidden: bool,
) -> Result<StepOut, EngineError> {
    let x = stage_input(ctx, model, tokens)?;
    let x = model.forward_layers(x, counts, caches)?;
    if pass_on(ctx, &x)? {
        return Ok(StepOut::default());
    }
    let reply = if want == Want::Nothing {
        Vec::new()
    } else {
        let logits = model.logits(&x, counts, last)?;
        let first = model.plan().vocab.start as u32;
        let width = model.plan().vocab.len();
        logits
            .chunks_exact(width.max(1))
            .flat_map(|r| encode_reply(r, first, want))
            .collect()
    };
    let hidden = if hidden && ctx.rank == hidden_rank(&ctx.layout) {
        Some(model.final_norm(x)?)
    } else {
        None
    };
    Ok(StepOut { reply, hidden })
}

/// Sends the lead a non-lead rank's part of a step's answer: its replies, then the rows'
/// hidden states where it holds them.
fn answer(ctx: &RankContext, out: StepOut) -> Result<(), EngineError> {
    if !out.reply.is_empty() {
        ctx.world.send(0, &out.reply)?;
    }
    if let Some(h) = out.hidden {
        let bytes: Vec<u8> = h.iter().flat_map(|f| f.to_le_bytes()).collect();
        ctx.world.send(0, &bytes)?;
    }
    Ok(())
}

/// What a last-stage rank sends the lead for one row of its vocabulary slice of the logits
/// (`first` is the slice's first token id).
fn encode_reply(logits: &[f32], first: u32, want: Want) -> Vec<u8> {
    match want {
        Want::Nothing => Vec::new(),
        Want::Best => {
            let i = crate::transformer::argmax(logits);
            pairs(&[(logits[i], first + i as u32)])
        }
        Want::TopK(k) => {
            let mut c: Vec<(f32, u32)> = logits
                .iter()
                .enumerate()
                .map(|(i, &l)| (l, first + i as u32))
                .collect();
            let by = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
            if k < c.len() {
                c.select_nth_unstable_by(k - 1, by);
                c.truncate(k);
            }
            c.resize(k, (f32::NEG_INFINITY, u32::MAX));
            pairs(&c)
        }
        Want::All => logits.iter().flat_map(|f| f.to_le_bytes()).collect(),
    }
}

/// The caches of `seqs` (ascending, distinct, each below `caches.len()`), in that order.
fn caches_of<'c>(caches: &'c mut [KvCache], seqs: &[usize]) -> Vec<&'c mut KvCache> {
    caches
        .iter_mut()
        .enumerate()
        .filter(|(i, _)| seqs.binary_search(i).is_ok())
        .map(|(_, c)| c)
        .collect()
}

fn pairs(c: &[(f32, u32)]) -> Vec<u8> {
    c.iter()
        .flat_map(|(l, id)| l.to_le_bytes().into_iter().chain(id.to_le_bytes()))
        .collect()
}

/// A submitted step's state on the lead.
enum Pending {
    /// Rank 0's own reply; the others are still to be received.
    Mine(Vec<u8>),
    /// Every reply, merged.
    Merged(Vec<f32>),
}

/// A batched step's replies: rank 0's own, or every rank's merged row by row.
enum RowsReply {
    Mine(Vec<u8>),
    Merged(Vec<Vec<f32>>),
}

/// The rows' hidden states of a submitted step.
enum HiddenRows {
    /// Not asked for.
    Unasked,
    /// Rank 0's own (it is the rank that gives them).
    Here(Vec<f32>),
    /// So many rows that [`hidden_rank`] sends.
    Coming(usize),
}

/// A submitted step not yet collected.
enum Submitted {
    /// One sequence's step ([`Lead::submit`]): the sequence, what was asked, the reply, the
    /// rows' hidden states.
    One(usize, Want, Pending, HiddenRows),
    /// A batched step ([`Lead::submit_rows`]): what was asked, rank 0's own reply (or
    /// every row merged already, when the lead's stage is the last), where each row
    /// sent goes in the order the caller gave, and the rows' hidden states.
    Rows {
        want: Want,
        reply: RowsReply,
        places: Vec<usize>,
        hidden: HiddenRows,
    },
}

/// The lead rank's view of a split model: steps that run on every rank.
/// Dropping it tells the other ranks to stop.
///
/// Several sequences (each with its own KV cache on every rank) can be in flight at once:
/// [`Lead::submit`] starts a step and returns once rank 0's own part is done, and
/// [`Lead::collect`] waits for the oldest submitted step's logits ([`Lead::submit_rows`] and
/// [`Lead::collect_rows`] do the same for a batched step of several sequences). With
/// pipeline stages that keeps every stage busy: stage 0 computes one group's next tokens
/// while stage 1 still works on another's.
pub struct Lead<'a> {
    ctx: RankContext,
    model: &'a Transformer,
    caches: Vec<KvCache>,
    /// The sequence [`Lead::step_with`] runs.
    current: usize,
    /// Submitted steps not yet collected, oldest first.
    pending: VecDeque<Submitted>,
    /// Whether steps return the rows' hidden states ([`Lead::keep_hidden`]).
    keep_hidden: bool,
    /// The rows' hidden states of the step collected last.
    hidden: Vec<f32>,
    stopped: bool,
}

impl<'a> Lead<'a> {
    /// The lead over `model` (rank 0's shard) with one sequence of `capacity` tokens.
    ///
    /// # Errors
    /// When `ctx` is not rank 0's.
    pub fn new(
        ctx: RankContext,
        model: &'a Transformer,
        capacity: usize,
    ) -> Result<Self, EngineError> {
        Self::with_sequences(ctx, model, capacity, 1)
    }

    /// The lead with `n` sequences of `capacity` tokens each (`0..n`).
    ///
    /// # Errors
    /// When `ctx` is not rank 0's, or `n` is 0 or above [`MAX_SEQUENCES`].
    pub fn with_sequences(
        ctx: RankContext,
        model: &'a Transformer,
        capacity: usize,
        n: usize,
    ) -> Result<Self, EngineError> {
        if ctx.rank != 0 {
            return Err(EngineError::InvalidInput {
                what: format!("rank {} cannot lead; rank 0 does", ctx.rank),
            });
        }
        if n == 0 || n > MAX_SEQUENCES {
            return Err(EngineError::InvalidInput {
                what: format!("{n} sequences (1 to {MAX_SEQUENCES})"),
            });
        }
        Ok(Lead {
            ctx,
            model,
            caches: (0..n).map(|_| model.new_cache(capacity)).collect(),
            current: 0,
            pending: VecDeque::new(),
            keep_hidden: false,
            hidden: Vec::new(),
            stopped: false,
        })
    }

    /// Makes every later step also return each row's output hidden state after the final
    /// norm ([`Lead::take_hidden`]), what a multi-token-prediction layer on the lead reads:
    /// the first rank of the last stage sends them, `hidden` values a row.
    pub fn keep_hidden(&mut self, on: bool) {
        self.keep_hidden = on;
    }

    /// The output hidden states after the final norm of every row of the step collected
    /// last, a row each in the order its rows came back (empty unless
    /// [`Lead::keep_hidden`] asked for them).
    pub fn take_hidden(&mut self) -> Vec<f32> {
        std::mem::take(&mut self.hidden)
    }

    /// What a step of `rows` rows gives of their hidden states, `mine` being rank 0's own.
    fn hidden_rows(&self, mine: Option<Vec<f32>>, rows: usize) -> HiddenRows {
        match mine {
            _ if !self.keep_hidden => HiddenRows::Unasked,
            Some(h) => HiddenRows::Here(h),
            None => HiddenRows::Coming(rows),
        }
    }

    /// The rows' hidden states of a step, received where another rank gives them.
    fn receive_hidden(&self, rows: HiddenRows) -> Result<Vec<f32>, EngineError> {
        Ok(match rows {
            HiddenRows::Unasked => Vec::new(),
            HiddenRows::Here(h) => h,
            HiddenRows::Coming(n) => {
                let mut buf = vec![0u8; n * self.model.config().hidden * 4];
                self.ctx
                    .world
                    .recv(hidden_rank(&self.ctx.layout), &mut buf)?;
                buf.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect()
            }
        })
    }

    /// Makes `seq` the sequence [`Lead::step_with`] runs.
    ///
    /// # Errors
    /// When there is no such sequence.
    pub fn select(&mut self, seq: usize) -> Result<(), EngineError> {
        if seq >= self.caches.len() {
            return Err(EngineError::InvalidInput {
                what: format!("sequence {seq} of {}", self.caches.len()),
            });
        }
        self.current = seq;
        Ok(())
    }

    /// Forgets the current sequence's positions from `len` on, on every rank (at its next
    /// step).
    pub fn truncate(&mut self, len: usize) {
        self.caches[self.current].truncate(len);
    }

    /// Makes sequence `to` hold the first `len` positions of sequence `from`, on every rank
    /// (a prompt that starts as another sequence's runs only the rest).
    ///
    /// # Errors
    /// When a sequence does not exist, they are the same, `from` holds fewer positions,
    /// steps are uncollected, or a rank cannot be reached.
    pub fn copy_prefix(&mut self, from: usize, to: usize, len: usize) -> Result<(), EngineError> {
        let n = self.caches.len();
        if from >= n || to >= n || from == to || len > self.caches[from].len() {
            return Err(EngineError::InvalidInput {
                what: format!("a copy of {len} positions from sequence {from} into {to} of {n}"),
            });
        }
        if !self.pending.is_empty() {
            return Err(EngineError::InvalidInput {
                what: "a copy while submitted steps are uncollected".into(),
            });
        }
        let header = Header {
            op: OP_COPY,
            seq: to as u32,
            n_tokens: from as u32,
            cache_len: len as u32,
            want: Want::Nothing,
            hidden: false,
        };
        self.ctx.world.broadcast(&mut header.encode(), 0)?;
        copy_between(self.model, &mut self.caches, from, to, len)
    }

    /// Runs one step of the current sequence on every rank and returns the merged
    /// last-position logits (`-inf` where no rank sent a value), or nothing when `want` is
    /// [`Want::Nothing`].
    ///
    /// # Errors
    /// When a rank fails or misses the deadline, the tokens do not fit, or steps submitted
    /// with [`Lead::submit`] are still uncollected.
    pub fn step_with(&mut self, tokens: &[u32], want: Want) -> Result<Vec<f32>, EngineError> {
        if !self.pending.is_empty() {
            return Err(EngineError::InvalidInput {
                what: "a blocking step while submitted steps are uncollected".into(),
            });
        }
        self.submit(self.current, tokens, want)?;
        Ok(self.collect()?.1)
    }

    /// Starts a step of sequence `seq` on every rank and runs rank 0's part of it.
    ///
    /// # Errors
    /// When a rank fails or misses the deadline, or the tokens do not fit.
    pub fn submit(&mut self, seq: usize, tokens: &[u32], want: Want) -> Result<(), EngineError> {
        let cfg = self.model.config();
        // more candidates than the vocabulary holds change nothing
        let want = match want {
            Want::TopK(k) => Want::TopK(k.clamp(1, cfg.vocab)),
            w => w,
        };
        let cache = self
            .caches
            .get_mut(seq)
            .ok_or_else(|| EngineError::InvalidInput {
                what: format!("sequence {seq} of a lead with fewer"),
            })?;
        if tokens.is_empty() {
            return Err(EngineError::InvalidInput {
                what: "a forward pass over zero tokens".into(),
            });
        }
        if cache.len() + tokens.len() > cache.capacity() {
            return Err(EngineError::ContextFull {
                prompt: cache.len() + tokens.len(),
                ctx: cache.capacity(),
            });
        }
        if let Some(&bad) = tokens.iter().find(|&&id| id as usize >= cfg.vocab) {
            return Err(EngineError::InvalidInput {
                what: format!("token id {bad} is outside the vocabulary of {}", cfg.vocab),
            });
        }
        let header = Header {
            op: OP_STEP,
            seq: seq as u32,
            n_tokens: tokens.len() as u32,
            cache_len: cache.len() as u32,
            want,
            hidden: self.keep_hidden,
        };
        self.ctx.world.broadcast(&mut header.encode(), 0)?;
        let mut ids: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        self.ctx.world.broadcast(&mut ids, 0)?;
        let mine = run_step(
            &self.ctx,
            self.model,
            &mut [cache],
            tokens,
            &[tokens.len()],
            1,
            want,
            self.keep_hidden,
        )?;
        let hidden = self.hidden_rows(mine.hidden, tokens.len());
        let pending = if self.ctx.layout.pp == 1 {
            // The last stage's replies share links with the stage's collectives: take them
            // before the next step's collectives start.
            Pending::Merged(self.gather(want, mine.reply)?)
        } else {
            Pending::Mine(mine.reply)
        };
        self.pending
            .push_back(Submitted::One(seq, want, pending, hidden));
        Ok(())
    }

    /// Receives the last stage's replies to a step and merges them with rank 0's.
    fn gather(&self, want: Want, mine: Vec<u8>) -> Result<Vec<f32>, EngineError> {
        if want == Want::Nothing {
            return Ok(Vec::new());
        }
        let mut logits = vec![f32::NEG_INFINITY; self.model.config().vocab];
        let mut buf = Vec::new();
        for r in self.ctx.layout.stage_ranks(self.ctx.layout.pp - 1) {
            let slice = self.ctx.plans[r].vocab.clone();
            let reply = if r == 0 {
                &mine
            } else {
                buf.resize(want.reply_bytes(slice.len()), 0);
                self.ctx.world.recv(r, &mut buf)?;
                &buf
            };
            merge(reply, want, slice, &mut logits, r)?;
        }
        Ok(logits)
    }

    /// Waits for the oldest submitted step and returns its sequence and merged logits
    /// (empty when it asked for nothing).
    ///
    /// # Errors
    /// When nothing is pending, or a rank fails or misses the deadline.
    pub fn collect(&mut self) -> Result<(usize, Vec<f32>), EngineError> {
        match self.pending.pop_front() {
            Some(Submitted::One(seq, want, pending, hidden)) => {
                let logits = match pending {
                    Pending::Merged(l) => l,
                    Pending::Mine(mine) => self.gather(want, mine)?,
                };
                self.hidden = self.receive_hidden(hidden)?;
                Ok((seq, logits))
            }
            Some(rows @ Submitted::Rows { .. }) => {
                self.pending.push_front(rows);
                Err(EngineError::InvalidInput {
                    what: "collecting one sequence's step where a batched step is next".into(),
                })
            }
            None => Err(EngineError::InvalidInput {
                what: "collecting with no step submitted".into(),
            }),
        }
    }

    /// How many pipeline stages a step goes through.
    pub fn stages(&self) -> usize {
        self.ctx.layout.pp
    }

    /// One batched decode step: `tokens[i]` goes after what sequence `seqs[i]` holds, on
    /// every rank at once (each rank reads its weights once for all rows). Returns the merged
    /// logits of each row, in the order given.
    ///
    /// # Errors
    /// When a sequence is unknown or repeated, a cache is full, a token is outside the
    /// vocabulary, steps are still uncollected, or a rank fails or misses the deadline.
    pub fn step_batch(
        &mut self,
        seqs: &[usize],
        tokens: &[u32],
        want: Want,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        if seqs.len() != tokens.len() {
            return Err(EngineError::InvalidInput {
                what: format!(
                    "a batch of {} tokens for {} sequences",
                    tokens.len(),
                    seqs.len()
                ),
            });
        }
        self.step_rows(seqs, tokens, &vec![1; seqs.len()], want)
    }

    /// One batched step of one or more tokens per sequence (a sequence's next token and the
    /// tokens drafted after it): sequence `seqs[i]` runs the next `counts[i]` of `tokens`
    /// (each sequence's tokens one after another, in the order given) after what it holds,
    /// on every rank at once. Returns the merged logits of every token's row, in the same
    /// order. With one token per sequence it is the batched decode step of older versions
    /// ([`OP_BATCH`]).
    ///
    /// # Errors
    /// As [`Lead::step_batch`], and when a count is 0, above [`MAX_ROWS_PER_SEQUENCE`], or
    /// the counts do not add up to the tokens.
    pub fn step_rows(
        &mut self,
        seqs: &[usize],
        tokens: &[u32],
        counts: &[usize],
        want: Want,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        if !self.pending.is_empty() {
            return Err(EngineError::InvalidInput {
                what: "a batched step while submitted steps are uncollected".into(),
            });
        }
        self.submit_rows(seqs, tokens, counts, want)?;
        self.collect_rows()
    }

    /// Starts the batched step [`Lead::step_rows`] describes and runs rank 0's part of it;
    /// [`Lead::collect_rows`] returns its rows. A sequence may be in several uncollected
    /// steps: every rank runs them in the order submitted.
    ///
    /// # Errors
    /// As [`Lead::step_rows`] (steps may be uncollected).
    pub fn submit_rows(
        &mut self,
        seqs: &[usize],
        tokens: &[u32],
        counts: &[usize],
        want: Want,
    ) -> Result<(), EngineError> {
        let bad = |what: String| EngineError::InvalidInput { what };
        if seqs.len() != counts.len()
            || seqs.is_empty()
            || counts.iter().sum::<usize>() != tokens.len()
            || counts.iter().any(|&c| c == 0 || c > MAX_ROWS_PER_SEQUENCE)
        {
            return Err(bad(format!(
                "a batch of {} tokens for {} sequences of {counts:?} tokens (1 to \
                 {MAX_ROWS_PER_SEQUENCE} each)",
                tokens.len(),
                seqs.len()
            )));
        }
        let cfg = self.model.config();
        let want = match want {
            Want::TopK(k) => Want::TopK(k.clamp(1, cfg.vocab)),
            w => w,
        };
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= cfg.vocab) {
            return Err(bad(format!(
                "token id {t} is outside the vocabulary of {}",
                cfg.vocab
            )));
        }
        // sequences go out by ascending sequence, each with its tokens
        let mut starts = Vec::with_capacity(seqs.len());
        let mut at = 0;
        for &c in counts {
            starts.push(at);
            at += c;
        }
        let mut order: Vec<usize> = (0..seqs.len()).collect();
        order.sort_by_key(|&i| seqs[i]);
        let sorted: Vec<usize> = order.iter().map(|&i| seqs[i]).collect();
        if sorted.windows(2).any(|w| w[0] == w[1]) {
            return Err(bad("a sequence twice in one batch".into()));
        }
        if let Some(&s) = sorted.last().filter(|&&s| s >= self.caches.len()) {
            return Err(bad(format!("sequence {s} of a lead with fewer")));
        }
        let toks: Vec<u32> = order
            .iter()
            .flat_map(|&i| &tokens[starts[i]..starts[i] + counts[i]])
            .copied()
            .collect();
        let sorted_counts: Vec<usize> = order.iter().map(|&i| counts[i]).collect();
        let single = counts.iter().all(|&c| c == 1);
        let mut body = Vec::with_capacity(sorted.len() * BATCH_ROW_BYTES + 4 * toks.len());
        for (k, &s) in sorted.iter().enumerate() {
            let c = &self.caches[s];
            let n = sorted_counts[k];
            if c.len() + n > c.capacity() {
                return Err(EngineError::ContextFull {
                    prompt: c.len() + n,
                    ctx: c.capacity(),
                });
            }
            let third = if single { toks[k] } else { n as u32 };
            for v in [s as u32, c.len() as u32, third] {
                body.extend_from_slice(&v.to_le_bytes());
            }
        }
        if !single {
            body.extend(toks.iter().flat_map(|t| t.to_le_bytes()));
        }
        let header = Header {
            op: if single { OP_BATCH } else { OP_ROWS },
            seq: 0,
            n_tokens: sorted.len() as u32,
            cache_len: if single { 0 } else { toks.len() as u32 },
            want,
            hidden: self.keep_hidden,
        };
        self.ctx.world.broadcast(&mut header.encode(), 0)?;
        self.ctx.world.broadcast(&mut body, 0)?;
        let mut caches = caches_of(&mut self.caches, &sorted);
        let last = sorted_counts.iter().copied().max().unwrap_or(1);
        let mine = run_step(
            &self.ctx,
            self.model,
            &mut caches,
            &toks,
            &sorted_counts,
            last,
            want,
            self.keep_hidden,
        )?;
        drop(caches);
        let hidden = self.hidden_rows(mine.hidden, toks.len());
        // back to the order given: sequence by sequence as sorted, each to its place
        let places: Vec<usize> = order
            .iter()
            .flat_map(|&i| starts[i]..starts[i] + counts[i])
            .collect();
        // With one stage, the last stage's replies share links with the next step's
        // collectives: take them now.
        let reply = if self.ctx.layout.pp == 1 {
            RowsReply::Merged(self.gather_rows(want, &mine.reply, toks.len())?)
        } else {
            RowsReply::Mine(mine.reply)
        };
        self.pending.push_back(Submitted::Rows {
            want,
            reply,
            places,
            hidden,
        });
        Ok(())
    }

    /// Waits for the oldest submitted step, a batched one, and returns the merged logits of
    /// every row in the order its submission gave.
    ///
    /// # Errors
    /// When nothing is pending, the oldest step is one sequence's, or a rank fails or misses
    /// the deadline.
    pub fn collect_rows(&mut self) -> Result<Vec<Vec<f32>>, EngineError> {
        let (want, reply, places, hidden) = match self.pending.pop_front() {
            Some(Submitted::Rows {
                want,
                reply,
                places,
                hidden,
            }) => (want, reply, places, hidden),
            Some(one) => {
                self.pending.push_front(one);
                return Err(EngineError::InvalidInput {
                    what: "collecting a batched step where one sequence's step is next".into(),
                });
            }
            None => {
                return Err(EngineError::InvalidInput {
                    what: "collecting with no step submitted".into(),
                })
            }
        };
        let rows = match reply {
            RowsReply::Merged(rows) => rows,
            RowsReply::Mine(mine) => self.gather_rows(want, &mine, places.len())?,
        };
        let hidden = self.receive_hidden(hidden)?;
        let mut out = vec![Vec::new(); places.len()];
        for (row, &place) in rows.into_iter().zip(&places) {
            out[place] = row;
        }
        // the hidden states too, back to the order given
        let width = self.model.config().hidden;
        self.hidden = vec![0.0; hidden.len()];
        if !hidden.is_empty() {
            for (row, &place) in hidden.chunks_exact(width).zip(&places) {
                self.hidden[place * width..(place + 1) * width].copy_from_slice(row);
            }
        }
        Ok(out)
    }

    /// Receives the last stage's replies to a batched step of `b` rows and merges each row.
    fn gather_rows(&self, want: Want, mine: &[u8], b: usize) -> Result<Vec<Vec<f32>>, EngineError> {
        let vocab = self.model.config().vocab;
        let mut rows = vec![vec![f32::NEG_INFINITY; vocab]; b];
        if want == Want::Nothing {
            return Ok(rows);
        }
        let mut buf = Vec::new();
        for r in self.ctx.layout.stage_ranks(self.ctx.layout.pp - 1) {
            let slice = self.ctx.plans[r].vocab.clone();
            let per_row = want.reply_bytes(slice.len());
            let reply = if r == 0 {
                mine
            } else {
                buf.resize(per_row * b, 0);
                self.ctx.world.recv(r, &mut buf)?;
                &buf[..]
            };
            if reply.len() != per_row * b {
                return Err(EngineError::InvalidInput {
                    what: format!("rank {r} replied {} bytes for {b} rows", reply.len()),
                });
            }
            for (row, chunk) in rows.iter_mut().zip(reply.chunks_exact(per_row.max(1))) {
                merge(chunk, want, slice.clone(), row, r)?;
            }
        }
        Ok(rows)
    }

    /// Tells every other rank to stop serving steps.
    ///
    /// # Errors
    /// When a rank cannot be reached.
    pub fn stop(&mut self) -> Result<(), EngineError> {
        if self.stopped {
            return Ok(());
        }
        self.stopped = true;
        let header = Header {
            op: OP_STOP,
            seq: 0,
            n_tokens: 0,
            cache_len: 0,
            want: Want::Nothing,
            hidden: false,
        };
        self.ctx.world.broadcast(&mut header.encode(), 0)?;
        Ok(())
    }
}

impl Drop for Lead<'_> {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// Writes one rank's reply into the vocabulary-length `logits`.
fn merge(
    reply: &[u8],
    want: Want,
    slice: std::ops::Range<usize>,
    logits: &mut [f32],
    rank: usize,
) -> Result<(), EngineError> {
    let f = |c: &[u8]| f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    match want {
        Want::Nothing => {}
        Want::All => {
            for (l, c) in logits[slice].iter_mut().zip(reply.chunks_exact(4)) {
                *l = f(c);
            }
        }
        Want::Best | Want::TopK(_) => {
            for c in reply.chunks_exact(8) {
                let id = u32::from_le_bytes([c[4], c[5], c[6], c[7]]) as usize;
                if id == u32::MAX as usize {
                    continue;
                }
                if !slice.contains(&id) {
                    return Err(EngineError::InvalidInput {
                        what: format!(
                            "rank {rank} sent token {id}, outside its vocabulary slice {slice:?}"
                        ),
                    });
                }
                logits[id] = f(c);
            }
        }
    }
    Ok(())
}

/// Serves a batched step ([`OP_BATCH`]: one token per sequence, or [`OP_ROWS`]: several)
/// on a rank other than the lead.
fn serve_batch(
    ctx: &RankContext,
    model: &Transformer,
    capacity: usize,
    caches: &mut Vec<KvCache>,
    header: Header,
) -> Result<(), EngineError> {
    let b = header.n_tokens as usize;
    let rows = header.op == OP_ROWS;
    let total = if rows { header.cache_len as usize } else { b };
    let bad = |what: String| EngineError::InvalidInput {
        what: format!("batched step from the lead rank: {what}"),
    };
    if b == 0 || b > MAX_SEQUENCES {
        return Err(bad(format!("{b} sequences (1 to {MAX_SEQUENCES})")));
    }
    if total < b || total > b * MAX_ROWS_PER_SEQUENCE {
        return Err(bad(format!(
            "{total} tokens for {b} sequences (1 to {MAX_ROWS_PER_SEQUENCE} each)"
        )));
    }
    let mut body = vec![0u8; b * BATCH_ROW_BYTES + if rows { 4 * total } else { 0 }];
    ctx.world.broadcast(&mut body, 0)?;
    let word = |at: usize| {
        u32::from_le_bytes([body[at], body[at + 1], body[at + 2], body[at + 3]]) as usize
    };
    let field = |r: usize, k: usize| word(r * BATCH_ROW_BYTES + k * 4);
    let seqs: Vec<usize> = (0..b).map(|r| field(r, 0)).collect();
    if seqs.windows(2).any(|w| w[0] >= w[1]) || seqs[b - 1] >= MAX_SEQUENCES {
        return Err(bad(format!(
            "sequences {seqs:?} are not ascending and below {MAX_SEQUENCES}"
        )));
    }
    let (counts, tokens): (Vec<usize>, Vec<u32>) = if rows {
        let counts: Vec<usize> = (0..b).map(|r| field(r, 2)).collect();
        if counts.iter().sum::<usize>() != total
            || counts.iter().any(|&c| c == 0 || c > MAX_ROWS_PER_SEQUENCE)
        {
            return Err(bad(format!(
                "token counts {counts:?} for {total} tokens (1 to {MAX_ROWS_PER_SEQUENCE} each)"
            )));
        }
        let from = b * BATCH_ROW_BYTES;
        (
            counts,
            (0..total).map(|t| word(from + 4 * t) as u32).collect(),
        )
    } else {
        (vec![1; b], (0..b).map(|r| field(r, 2) as u32).collect())
    };
    if let Want::TopK(k) = header.want {
        if k > model.config().vocab {
            return Err(bad(format!(
                "the top {k} of a vocabulary of {}",
                model.config().vocab
            )));
        }
    }
    while caches.len() <= seqs[b - 1] {
        caches.push(model.new_cache(capacity));
    }
    for (r, &s) in seqs.iter().enumerate() {
        let len = field(r, 1);
        let c = &mut caches[s];
        c.truncate(len);
        if c.len() != len || len + counts[r] > capacity {
            return Err(bad(format!(
                "sequence {s} at {len} positions and {} more; this rank holds {} of a \
                 capacity of {capacity}",
                counts[r],
                c.len()
            )));
        }
    }
    let mut refs = caches_of(caches, &seqs);
    let last = counts.iter().copied().max().unwrap_or(1);
    let out = run_step(
        ctx,
        model,
        &mut refs,
        &tokens,
        &counts,
        last,
        header.want,
        header.hidden,
    )?;
    answer(ctx, out)
}

/// Copies the first `len` positions of `caches[from]` into `caches[to]` (distinct).
fn copy_between(
    model: &Transformer,
    caches: &mut [KvCache],
    from: usize,
    to: usize,
    len: usize,
) -> Result<(), EngineError> {
    let (src, dst) = if from < to {
        let (a, b) = caches.split_at_mut(to);
        (&a[from], &mut b[0])
    } else {
        let (a, b) = caches.split_at_mut(from);
        (&b[0], &mut a[to])
    };
    model.copy_prefix(src, dst, len)
}

/// Serves steps on a rank other than the lead until the lead says stop.
///
/// # Errors
/// When the lead or a peer fails or misses the deadline, or sends a malformed step.
pub fn serve(ctx: &RankContext, model: &Transformer, capacity: usize) -> Result<(), EngineError> {
    let mut caches: Vec<KvCache> = Vec::new();
    loop {
        let mut h = [0u8; HEADER_BYTES];
        ctx.world.broadcast(&mut h, 0)?;
        let header = Header::decode(&h)?;
        if header.op == OP_STOP {
            return Ok(());
        }
        if header.op == OP_BATCH || header.op == OP_ROWS {
            serve_batch(ctx, model, capacity, &mut caches, header)?;
            continue;
        }
        if header.op == OP_COPY {
            let (from, to) = (header.n_tokens as usize, header.seq as usize);
            while caches.len() <= from.max(to) {
                caches.push(model.new_cache(capacity));
            }
            if header.cache_len as usize > caches[from].len() {
                return Err(EngineError::InvalidInput {
                    what: format!(
                        "the lead copies {} positions of sequence {from}, which holds {} here",
                        header.cache_len,
                        caches[from].len()
                    ),
                });
            }
            copy_between(model, &mut caches, from, to, header.cache_len as usize)?;
            continue;
        }
        let t = header.n_tokens as usize;
        if t == 0 || header.cache_len as usize + t > capacity {
            return Err(EngineError::InvalidInput {
                what: format!(
                    "the lead asked for {t} tokens after {} cached, beyond this rank's \
                     capacity of {capacity}",
                    header.cache_len
                ),
            });
        }
        let mut ids = vec![0u8; t * 4];
        ctx.world.broadcast(&mut ids, 0)?;
        let tokens: Vec<u32> = ids
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        if let Want::TopK(k) = header.want {
            if k > model.config().vocab {
                return Err(EngineError::InvalidInput {
                    what: format!(
                        "the lead asked for the top {k} of a vocabulary of {}",
                        model.config().vocab
                    ),
                });
            }
        }
        let seq = header.seq as usize;
        while caches.len() <= seq {
            caches.push(model.new_cache(capacity));
        }
        let cache = &mut caches[seq];
        cache.truncate(header.cache_len as usize);
        if cache.len() != header.cache_len as usize {
            return Err(EngineError::InvalidInput {
                what: format!(
                    "the lead's cache of sequence {seq} holds {} positions, this rank's only {}",
                    header.cache_len,
                    cache.len()
                ),
            });
        }
        let out = run_step(
            ctx,
            model,
            &mut [cache],
            &tokens,
            &[t],
            1,
            header.want,
            header.hidden,
        )?;
        answer(ctx, out)?;
    }
}
