//! [`Group`]: the collectives of [`Communicator`] over any [`Transport`], for all ranks of a
//! world or a subset of them (a tensor-parallel group can be ranks {2, 3} of 4). Group rank
//! `i` is global rank `members[i]`; "rank order" below means member order.
//!
//! Every collective is one or two calls of [`Transport::exchange`] under one deadline: the
//! group's per-call timeout (60 s unless set) from the start of the call, so a dead or silent
//! peer becomes an error on every member instead of a hang.
//!
//! **All-reduce.** Results are bit-identical on every member *and* equal to the plain sum in
//! member order, `((x0 + x1) + x2) + ...`, whatever the size: small messages (up to 64 KiB,
//! or groups of 2) go one-shot — every member sends its data to every other and sums all
//! inputs in member order; larger ones use a direct reduce-scatter + all-gather — the data
//! is cut into one chunk per member, member `j` receives chunk `j` from everyone (one
//! exchange), sums it in member order, and sends the reduced chunk to everyone (a second
//! exchange). This moves the same bytes per member as a ring (2·(n−1)/n of the data each
//! way) in 2 steps instead of 2·(n−1), and, unlike a ring, sums every chunk in the same
//! order, so the large path gives the same bits as the small one. Scratch buffers are kept
//! between calls: a warm group does not allocate.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::transport::{recycle_recvs, recycle_sends, Transport};
use crate::{CommError, Communicator};

/// The per-call timeout of a new [`Group`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// Largest all-reduce, in bytes, that goes one-shot by default.
pub const DEFAULT_ONE_SHOT_LIMIT: usize = 64 << 10;

/// A communicator over a set of ranks of a transport's world.
pub struct Group {
    transport: Arc<dyn Transport>,
    members: Vec<usize>,
    me: usize,
    timeout: Duration,
    one_shot_limit: usize,
    scratch: Mutex<Scratch>,
}

#[derive(Default)]
struct Scratch {
    floats: Vec<f32>,
    sends: Vec<(usize, &'static [u8])>,
    recvs: Vec<(usize, &'static mut [u8])>,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("members", &self.members)
            .field("me", &self.me)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// Bounds of chunk `i` when `len` elements are cut into `n` near-equal chunks.
fn chunk(len: usize, n: usize, i: usize) -> std::ops::Range<usize> {
    (i * len / n)..((i + 1) * len / n)
}

impl Group {
    /// A group of every rank of the transport's world, in rank order.
    #[must_use]
    pub fn world(transport: Arc<dyn Transport>) -> Self {
        let members = (0..transport.world_size()).collect();
        let me = transport.rank();
        Self::build(transport, members, me)
    }

    /// A group of the global ranks `members` (distinct, in the order that defines group
    /// ranks and the summation order), which must include this transport's rank.
    ///
    /// # Errors
    /// [`CommError::Usage`] when a member is outside the world, repeated, or this rank is
    /// not a member.
    pub fn new(transport: Arc<dyn Transport>, members: Vec<usize>) -> Result<Self, CommError> {
        let (rank, world) = (transport.rank(), transport.world_size());
        let usage = |reason: String| CommError::Usage { rank, reason };
        for (i, &m) in members.iter().enumerate() {
            if m >= world {
                return Err(usage(format!(
                    "group member {m} is outside the world of {world} ranks"
                )));
            }
            if members[..i].contains(&m) {
                return Err(usage(format!("group member {m} is listed twice")));
            }
        }
        let Some(me) = members.iter().position(|&m| m == rank) else {
            return Err(usage(format!(
                "this rank is not a member of the group {members:?}"
            )));
        };
        Ok(Self::build(transport, members, me))
    }

    fn build(transport: Arc<dyn Transport>, members: Vec<usize>, me: usize) -> Self {
        Self {
            transport,
            members,
            me,
            timeout: DEFAULT_TIMEOUT,
            one_shot_limit: DEFAULT_ONE_SHOT_LIMIT,
            scratch: Mutex::new(Scratch::default()),
        }
    }

    /// Sets the time each collective may take before it fails with [`CommError::Timeout`].
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets the largest all-reduce (bytes) sent one-shot; larger ones use reduce-scatter +
    /// all-gather. Every member must use the same limit.
    #[must_use]
    pub fn with_one_shot_limit(mut self, bytes: usize) -> Self {
        self.one_shot_limit = bytes;
        self
    }

    /// The global ranks of the members, in group-rank order.
    pub fn members(&self) -> &[usize] {
        &self.members
    }

    /// The transport underneath.
    pub fn transport(&self) -> &Arc<dyn Transport> {
        &self.transport
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.timeout
    }

    fn usage(&self, reason: String) -> CommError {
        CommError::Usage {
            rank: self.transport.rank(),
            reason,
        }
    }

    fn peer(&self, group_rank: usize, what: &str) -> Result<usize, CommError> {
        if group_rank >= self.members.len() || group_rank == self.me {
            return Err(self.usage(format!(
                "{what} rank {group_rank}: must be another rank of the group (0..{}, not {})",
                self.members.len(),
                self.me
            )));
        }
        Ok(self.members[group_rank])
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Scratch> {
        self.scratch.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Every member sends `data` to every other; sums in member order.
    fn all_reduce_one_shot(
        &self,
        data: &mut [f32],
        sc: &mut Scratch,
        deadline: Instant,
    ) -> Result<(), CommError> {
        let (n, me, len) = (self.members.len(), self.me, data.len());
        sc.floats.resize((n - 1) * len, 0.0);
        let Scratch {
            floats,
            sends,
            recvs,
        } = sc;
        let mut sl = recycle_sends(std::mem::take(sends));
        let mut rl = recycle_recvs(std::mem::take(recvs));
        let others = self.members.iter().enumerate().filter(|&(i, _)| i != me);
        sl.extend(
            others
                .clone()
                .map(|(_, &g)| (g, bytemuck::cast_slice::<f32, u8>(data))),
        );
        rl.extend(
            others
                .zip(slots(floats, len, n - 1))
                .map(|((_, &g), s)| (g, s)),
        );
        let result = self.transport.exchange(&sl, &mut rl, deadline);
        *sends = recycle_sends(sl);
        *recvs = recycle_recvs(rl);
        result?;
        reduce_in_order(data, me, n, floats);
        Ok(())
    }

    /// Direct reduce-scatter (member j sums chunk j in member order) then all-gather.
    fn all_reduce_scatter_gather(
        &self,
        data: &mut [f32],
        sc: &mut Scratch,
        deadline: Instant,
    ) -> Result<(), CommError> {
        let (n, me, len) = (self.members.len(), self.me, data.len());
        let mine = chunk(len, n, me);
        let clen = mine.len();
        sc.floats.resize((n - 1) * clen, 0.0);
        let Scratch {
            floats,
            sends,
            recvs,
        } = sc;
        // Step 1: chunk j of my data to member j; chunk `me` of everyone's data to me.
        let mut sl = recycle_sends(std::mem::take(sends));
        let mut rl = recycle_recvs(std::mem::take(recvs));
        let others = self.members.iter().enumerate().filter(|&(i, _)| i != me);
        sl.extend(
            others
                .clone()
                .map(|(i, &g)| (g, bytemuck::cast_slice::<f32, u8>(&data[chunk(len, n, i)]))),
        );
        rl.extend(
            others
                .clone()
                .zip(slots(floats, clen, n - 1))
                .map(|((_, &g), s)| (g, s)),
        );
        let result = self.transport.exchange(&sl, &mut rl, deadline);
        let mut sl = recycle_sends(sl);
        let mut rl = recycle_recvs(rl);
        result?;
        reduce_in_order(&mut data[mine], me, n, floats);
        // Step 2: my reduced chunk to everyone; chunk j from member j into place.
        let mut reduced: &[f32] = &[];
        let mut rest = &mut data[..];
        let mut taken = 0;
        for i in 0..n {
            let r = chunk(len, n, i);
            let (c, tail) = std::mem::take(&mut rest).split_at_mut(r.end - taken);
            taken = r.end;
            rest = tail;
            if i == me {
                reduced = c;
            } else {
                rl.push((self.members[i], bytemuck::cast_slice_mut::<f32, u8>(c)));
            }
        }
        sl.extend(others.map(|(_, &g)| (g, bytemuck::cast_slice::<f32, u8>(reduced))));
        let result = self.transport.exchange(&sl, &mut rl, deadline);
        *sends = recycle_sends(sl);
        *recvs = recycle_recvs(rl);
        result
    }
}

/// `count` consecutive slices of `each` floats from the front of `buf`, as bytes (works for
/// `each == 0`, unlike `chunks_mut`).
fn slots(buf: &mut [f32], each: usize, count: usize) -> impl Iterator<Item = &mut [u8]> {
    let mut rest = buf;
    (0..count).map(move |_| {
        let (c, tail) = std::mem::take(&mut rest).split_at_mut(each);
        rest = tail;
        bytemuck::cast_slice_mut::<f32, u8>(c)
    })
}

/// Replaces `own`, member `me`'s input, with `x0 + x1 + ... + x(n-1)` summed in member
/// order, where the other members' inputs lie in consecutive `own.len()`-float slots of
/// `others` (member order, `me` skipped). Accumulates in member 0's slot (clobbering it)
/// unless `me` is 0, so the order of additions is the same on every member.
fn reduce_in_order(own: &mut [f32], me: usize, n: usize, others: &mut [f32]) {
    let len = own.len();
    if me == 0 {
        for x in others.chunks(len.max(1)).take(n - 1) {
            add_into(own, x);
        }
        return;
    }
    let (acc, rest) = others.split_at_mut(len);
    for i in 1..n {
        let x: &[f32] = if i == me {
            own
        } else {
            let k = if i < me { i } else { i - 1 };
            &rest[(k - 1) * len..k * len]
        };
        add_into(acc, x);
    }
    own.copy_from_slice(acc);
}

/// `acc[i] += x[i]`, element by element (vectorizes; the order per element is fixed).
fn add_into(acc: &mut [f32], x: &[f32]) {
    for (a, b) in acc.iter_mut().zip(x) {
        *a += *b;
    }
}

impl Communicator for Group {
    fn rank(&self) -> usize {
        self.me
    }

    fn world_size(&self) -> usize {
        self.members.len()
    }

    fn all_reduce_sum(&self, data: &mut [f32]) -> Result<(), CommError> {
        let n = self.members.len();
        if n == 1 {
            return Ok(());
        }
        let deadline = self.deadline();
        let mut sc = self.lock();
        if n <= 2 || std::mem::size_of_val(data) <= self.one_shot_limit {
            self.all_reduce_one_shot(data, &mut sc, deadline)
        } else {
            self.all_reduce_scatter_gather(data, &mut sc, deadline)
        }
    }

    fn broadcast(&self, data: &mut [u8], root: usize) -> Result<(), CommError> {
        let n = self.members.len();
        if root >= n {
            return Err(self.usage(format!("broadcast from rank {root} in a group of {n}")));
        }
        if n == 1 {
            return Ok(());
        }
        let mut sc = self.lock();
        let Scratch { sends, .. } = &mut *sc;
        if root == self.me {
            let mut sl = recycle_sends(std::mem::take(sends));
            sl.extend(
                self.members
                    .iter()
                    .enumerate()
                    .filter(|&(i, _)| i != root)
                    .map(|(_, &g)| (g, &*data)),
            );
            let result = self.transport.exchange(&sl, &mut [], self.deadline());
            *sends = recycle_sends(sl);
            result
        } else {
            let from = self.members[root];
            self.transport
                .exchange(&[], &mut [(from, data)], self.deadline())
        }
    }

    fn all_gather(&self, mine: &[u8], out: &mut [u8]) -> Result<(), CommError> {
        let (n, me, len) = (self.members.len(), self.me, mine.len());
        if out.len() != n * len {
            return Err(self.usage(format!(
                "all_gather output of {} bytes for {n} ranks of {len} bytes; it must be {}",
                out.len(),
                n * len
            )));
        }
        if n == 1 {
            out.copy_from_slice(mine);
            return Ok(());
        }
        let mut sc = self.lock();
        let Scratch { sends, recvs, .. } = &mut *sc;
        let mut sl = recycle_sends(std::mem::take(sends));
        let mut rl = recycle_recvs(std::mem::take(recvs));
        let mut rest = out;
        for (i, &g) in self.members.iter().enumerate() {
            let (c, tail) = std::mem::take(&mut rest).split_at_mut(len);
            rest = tail;
            if i == me {
                c.copy_from_slice(mine);
            } else {
                sl.push((g, mine));
                rl.push((g, c));
            }
        }
        let result = self.transport.exchange(&sl, &mut rl, self.deadline());
        *sends = recycle_sends(sl);
        *recvs = recycle_recvs(rl);
        result
    }

    fn send(&self, peer: usize, data: &[u8]) -> Result<(), CommError> {
        let to = self.peer(peer, "send to")?;
        self.transport
            .exchange(&[(to, data)], &mut [], self.deadline())
    }

    fn recv(&self, peer: usize, data: &mut [u8]) -> Result<(), CommError> {
        let from = self.peer(peer, "recv from")?;
        self.transport
            .exchange(&[], &mut [(from, data)], self.deadline())
    }
}
