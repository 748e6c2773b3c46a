//! [`RdmaTransport`]: ranks talking over InfiniBand or RoCE verbs (through the `sideway`
//! crate), behind the off-by-default `rdma` cargo feature.
//!
//! **Untested on hardware.** This repository's machines and CI have no RDMA device, so this
//! module is only built and its pure bookkeeping unit-tested here; the verbs calls have never
//! run. Try it on a two-host pair (or a soft-RoCE `rxe` device) and compare against
//! [`TcpTransport`](crate::TcpTransport) before relying on it.
//!
//! **Design.** Each rank opens one device (the first, or a named one), one protection domain,
//! one completion queue shared by all peers and one reliable-connected (RC) queue pair per
//! peer. All data moves with two-sided SEND/RECV through registered buffers: per peer, a ring
//! of `slots` receive slots and `slots` send slots of `slot_bytes` each (16 × 64 KiB by
//! default, so 2 MiB per peer). A message is a 16-byte [`frame`] header (magic, version,
//! length) followed by its payload, cut into slot-sized chunks; every message starts a new
//! chunk, so chunk 0 carries the header and up to `slot_bytes - 16` payload bytes and every
//! later chunk up to `slot_bytes`. Data is **copied** into the send slots and out of the
//! receive slots (the caller's buffers are never registered), which keeps the API
//! borrow-based at the cost of one memcpy per side.
//!
//! RECVs complete in the order they were posted, so chunk `s` from a peer always lands in
//! receive slot `s % slots`. The receiver re-posts a slot once it has copied the chunk out
//! and publishes the running count of re-posted slots into a 64-bit word on the sender with
//! an RDMA WRITE (one in flight per peer; a newer count is written when it completes). The
//! sender posts chunk `s` only while `s < slots + credits` (the receiver has a RECV waiting
//! for it, so there is never a receiver-not-ready retry) and `s - completed < slots` (its own
//! send slot is free again). Chunks a peer sends before this rank asks for them stay in their
//! slots until a later `exchange` takes them, which bounds how far a peer can run ahead and
//! keeps FIFO order per direction. `exchange` posts what the credits allow, polls the
//! completion queue, copies out what arrived, re-posts, publishes credits, and repeats until
//! every operation is done or the deadline passes; a peer's sends and receives all progress
//! together, so two ranks sending large messages to each other at once cannot deadlock.
//!
//! **Failures.** A completion with an error status marks that peer failed (status, vendor
//! code and a hint); any operation of this or a later exchange that still needs the peer then
//! fails with [`CommError::Link`] (data that already arrived is still delivered, so a peer
//! that sent everything and left is not an error). The TCP control connections stay open
//! after setup: a peer whose connection closes is marked failed 100 ms later (so a last
//! message still in the completion queue is taken first). A missing message at the deadline
//! is [`CommError::Timeout`] naming the peer; a message of another length is
//! [`CommError::Protocol`] naming both lengths. After a failed exchange the transport moves
//! every queue pair to the error state and shuts the control connections down, so peers fail
//! fast, and every later call fails. Dropping the transport first waits up to one second for
//! its outstanding sends to be acknowledged.
//!
//! **Use.** Connect a full mesh of TCP streams between the ranks (as for
//! [`TcpTransport::from_streams`](crate::TcpTransport::from_streams)), then on every rank call
//! [`RdmaTransport::connect`] (or [`RdmaTransport::connect_with`] with an [`RdmaConfig`] for
//! the port, GID index or buffer sizes) with those streams; each pair of ranks exchanges queue
//! pair numbers, LIDs, GIDs, PSNs and the address and key of its credit word over its stream,
//! then brings the queue pairs to ready-to-send. Every rank must use the same slot size and
//! count. Build with `--features rdma` (needs `cmake` and libclang at build time, as the
//! `rdma-mummy-sys` crate compiles a stub of rdma-core and generates its bindings; running
//! needs rdma-core's `libibverbs` and the NIC's provider). The buffers are not registered for
//! GPU memory; the transport moves host bytes only.
//!
//! Allocation: none per exchange after the first call with a given number of operations,
//! except inside `sideway`, whose receive-posting guard (and, for devices without the
//! extended verbs, its send guard and completion poller) builds small vectors per call.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{
    GenericCompletionQueue, PollCompletionQueueError, WorkCompletionStatus,
};
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, LinkLayer, Mtu, PortState};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    GenericQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState,
    SetScatterGatherEntry, WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;

use crate::frame::{self, HEADER_LEN};
use crate::transport::{broken, check_peers, Transport};
use crate::CommError;

/// Default bytes per send or receive slot.
pub const DEFAULT_SLOT_BYTES: usize = 64 << 10;
/// Default number of slots per peer and direction.
pub const DEFAULT_SLOTS: usize = 16;

const MIN_SLOT: usize = 4096;
const MAX_SLOT: usize = 1 << 30;
const MAX_SLOTS: usize = 4096;
/// Bytes between two credit words (one cache line each).
const CREDIT_STRIDE: usize = 64;
const PAGE: usize = 4096;

const SPIN_FOR: Duration = Duration::from_micros(20);
const YIELD_FOR: Duration = Duration::from_millis(2);
const NAP: Duration = Duration::from_micros(50);
const CONTROL_CHECK_EVERY: Duration = Duration::from_millis(10);
/// How long after a peer's control connection closes its last data may still be taken.
const CLOSE_GRACE: Duration = Duration::from_millis(100);
/// How long dropping the transport waits for its sends to be acknowledged.
const DRAIN_ON_DROP: Duration = Duration::from_secs(1);

/// How an [`RdmaTransport`] picks its device and sizes its buffers. Every rank of a world
/// must use the same `slot_bytes` and `slots`.
#[derive(Debug, Clone)]
pub struct RdmaConfig {
    /// The verbs device (`mlx5_0`, `rxe0`, ...); `None` takes the first one listed.
    pub device: Option<String>,
    /// The device's port, from 1.
    pub port: u8,
    /// The GID table index to address peers with. `None`: on InfiniBand, GID 0 with LID
    /// routing; on Ethernet (RoCE), the first RoCE v2 GID holding an IPv4 address, else the
    /// first RoCE v2 GID, else GID 0. Set it where the fabric needs a particular one.
    pub gid_index: Option<u32>,
    /// Bytes per slot, 4 KiB..=1 GiB; messages larger than a slot go in several chunks.
    pub slot_bytes: usize,
    /// Slots per peer and direction, 2..=4096: how many chunks may be in flight to a peer.
    pub slots: usize,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        Self {
            device: None,
            port: 1,
            gid_index: None,
            slot_bytes: DEFAULT_SLOT_BYTES,
            slots: DEFAULT_SLOTS,
        }
    }
}

// ---------------------------------------------------------------------------------------
// Pure bookkeeping (unit-tested without hardware).
// ---------------------------------------------------------------------------------------

/// Number of chunks a message of `len` payload bytes takes with `slot`-byte slots.
fn chunk_count(len: usize, slot: usize) -> u64 {
    let first = slot - HEADER_LEN;
    if len <= first {
        1
    } else {
        1 + (len - first).div_ceil(slot) as u64
    }
}

/// The payload range `(offset, bytes)` that chunk `i` of a `len`-byte message carries.
fn chunk_span(len: usize, slot: usize, i: u64) -> (usize, usize) {
    let first = slot - HEADER_LEN;
    if i == 0 {
        (0, len.min(first))
    } else {
        let off = first.saturating_add((i as usize - 1).saturating_mul(slot));
        let off = off.min(len);
        (off, (len - off).min(slot))
    }
}

/// Bytes chunk `i` of a `len`-byte message occupies on the wire (header included).
fn chunk_wire_len(len: usize, slot: usize, i: u64) -> usize {
    chunk_span(len, slot, i).1 + if i == 0 { HEADER_LEN } else { 0 }
}

/// Writes chunk `i` of `msg` into `dst` (a slot); returns the bytes written.
fn write_chunk(msg: &[u8], slot: usize, i: u64, dst: &mut [u8]) -> usize {
    let (off, n) = chunk_span(msg.len(), slot, i);
    if i == 0 {
        dst[..HEADER_LEN].copy_from_slice(&frame::encode(msg.len()));
        dst[HEADER_LEN..HEADER_LEN + n].copy_from_slice(&msg[off..off + n]);
        HEADER_LEN + n
    } else {
        dst[..n].copy_from_slice(&msg[off..off + n]);
        n
    }
}

/// Takes chunk `i` (the received bytes of one slot) of a message into `out`, checking the
/// header on chunk 0 and every chunk's size against what `out.len()` implies.
fn read_chunk(
    chunk: &[u8],
    slot: usize,
    i: u64,
    out: &mut [u8],
    rank: usize,
    peer: usize,
) -> Result<(), CommError> {
    let mut payload = chunk;
    if i == 0 {
        if chunk.len() < HEADER_LEN {
            return Err(CommError::Protocol {
                rank,
                peer,
                reason: format!(
                    "a message's first chunk has {} bytes, less than its {HEADER_LEN}-byte \
                     header: the peer is not speaking this protocol; run the same shoal build \
                     on every rank",
                    chunk.len()
                ),
            });
        }
        let mut header = [0u8; HEADER_LEN];
        header.copy_from_slice(&chunk[..HEADER_LEN]);
        frame::check(&header, out.len(), rank, peer)?;
        payload = &chunk[HEADER_LEN..];
    }
    let (off, n) = chunk_span(out.len(), slot, i);
    if payload.len() != n {
        return Err(CommError::Protocol {
            rank,
            peer,
            reason: format!(
                "chunk {i} of a {}-byte message carries {} payload bytes where {n} were \
                 expected: the stream lost its place or the ranks use different slot sizes; \
                 restart every rank with the same configuration",
                out.len(),
                payload.len()
            ),
        });
    }
    out[off..off + n].copy_from_slice(payload);
    Ok(())
}

/// The send side of one peer's connection: chunks posted, send completions seen.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct TxWindow {
    posted: u64,
    completed: u64,
}

impl TxWindow {
    /// Whether the next chunk may be posted: the receiver has re-posted enough slots
    /// (`credits`, its running count) and this side's send slot is free again.
    fn can_post(&self, slots: usize, credits: u64) -> bool {
        let slots = slots as u64;
        self.posted < slots.saturating_add(credits) && self.posted - self.completed < slots
    }

    /// The send slot of the next chunk.
    fn next_slot(&self, slots: usize) -> usize {
        (self.posted % slots as u64) as usize
    }
}

/// The receive side of one peer's connection, as running counts of chunks.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct RxRing {
    /// Chunks whose RECV completed.
    arrived: u64,
    /// Chunks copied out to a caller.
    consumed: u64,
    /// Slots posted again after being consumed (the credit count the sender sees).
    reposted: u64,
}

impl RxRing {
    /// The receive slot the next arriving chunk lands in.
    fn arrival_slot(&self, slots: usize) -> usize {
        (self.arrived % slots as u64) as usize
    }

    /// The slot of the next chunk to consume, if one has arrived.
    fn next_ready(&self, slots: usize) -> Option<usize> {
        (self.arrived > self.consumed).then_some((self.consumed % slots as u64) as usize)
    }
}

/// What a work request was for, packed into its 64-bit id with the peer and slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WrKind {
    Recv = 1,
    Send = 2,
    Credit = 3,
}

fn wr_id(kind: WrKind, peer: usize, slot: usize) -> u64 {
    ((kind as u64) << 56) | ((peer as u64 & 0xff_ffff) << 32) | (slot as u64 & 0xffff_ffff)
}

fn parse_wr_id(id: u64) -> Option<(WrKind, usize, usize)> {
    let kind = match id >> 56 {
        1 => WrKind::Recv,
        2 => WrKind::Send,
        3 => WrKind::Credit,
        _ => return None,
    };
    Some((
        kind,
        ((id >> 32) & 0xff_ffff) as usize,
        (id & 0xffff_ffff) as usize,
    ))
}

const HS_MAGIC: &[u8; 8] = b"SHOLRDMA";
const HS_LEN: usize = 96;
const READY: &[u8; 8] = b"SHOLRDY1";

/// What each side of a pair tells the other before connecting its queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Handshake {
    rank: u32,
    world: u32,
    qpn: u32,
    psn: u32,
    lid: u16,
    /// `ibv_mtu` value of the port's active MTU (1 = 256 .. 5 = 4096).
    mtu: u16,
    gid: [u8; 16],
    link_layer: u8,
    slot_bytes: u32,
    slots: u32,
    /// Where the peer should RDMA-write its credit count for this rank.
    credit_addr: u64,
    credit_rkey: u32,
}

impl Handshake {
    fn encode(&self) -> [u8; HS_LEN] {
        let mut m = [0u8; HS_LEN];
        m[0..8].copy_from_slice(HS_MAGIC);
        m[8..10].copy_from_slice(&frame::PROTOCOL_VERSION.to_le_bytes());
        m[12..16].copy_from_slice(&self.rank.to_le_bytes());
        m[16..20].copy_from_slice(&self.world.to_le_bytes());
        m[20..24].copy_from_slice(&self.qpn.to_le_bytes());
        m[24..28].copy_from_slice(&self.psn.to_le_bytes());
        m[28..30].copy_from_slice(&self.lid.to_le_bytes());
        m[30..32].copy_from_slice(&self.mtu.to_le_bytes());
        m[32..48].copy_from_slice(&self.gid);
        m[48] = self.link_layer;
        m[52..56].copy_from_slice(&self.slot_bytes.to_le_bytes());
        m[56..60].copy_from_slice(&self.slots.to_le_bytes());
        m[60..64].copy_from_slice(&self.credit_rkey.to_le_bytes());
        m[64..72].copy_from_slice(&self.credit_addr.to_le_bytes());
        m
    }

    /// Parses and checks `peer`'s record against this rank's own.
    fn decode(m: &[u8; HS_LEN], mine: &Handshake, peer: usize) -> Result<Handshake, CommError> {
        let rank = mine.rank as usize;
        let protocol = |reason: String| CommError::Protocol { rank, peer, reason };
        let u32_at = |o: usize| u32::from_le_bytes([m[o], m[o + 1], m[o + 2], m[o + 3]]);
        let u16_at = |o: usize| u16::from_le_bytes([m[o], m[o + 1]]);
        if &m[0..8] != HS_MAGIC {
            return Err(protocol(
                "the control connection did not carry an RDMA handshake: the peer is not \
                 running the RDMA transport, or the streams were connected to the wrong ranks"
                    .into(),
            ));
        }
        let version = u16_at(8);
        if version != frame::PROTOCOL_VERSION {
            return Err(protocol(format!(
                "peer speaks protocol version {version}, this rank speaks version {}; run the \
                 same shoal build on every rank",
                frame::PROTOCOL_VERSION
            )));
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&m[32..48]);
        let mut addr = [0u8; 8];
        addr.copy_from_slice(&m[64..72]);
        let h = Handshake {
            rank: u32_at(12),
            world: u32_at(16),
            qpn: u32_at(20),
            psn: u32_at(24),
            lid: u16_at(28),
            mtu: u16_at(30),
            gid,
            link_layer: m[48],
            slot_bytes: u32_at(52),
            slots: u32_at(56),
            credit_rkey: u32_at(60),
            credit_addr: u64::from_le_bytes(addr),
        };
        if h.rank as usize != peer {
            return Err(protocol(format!(
                "the stream given for rank {peer} leads to rank {}; pass stream p for rank p",
                h.rank
            )));
        }
        if h.world != mine.world {
            return Err(protocol(format!(
                "peer believes the world has {} ranks, this rank believes {}; give every rank \
                 the same world",
                h.world, mine.world
            )));
        }
        if (h.slot_bytes, h.slots) != (mine.slot_bytes, mine.slots) {
            return Err(protocol(format!(
                "peer uses {} slots of {} bytes, this rank {} slots of {} bytes; configure every \
                 rank alike",
                h.slots, h.slot_bytes, mine.slots, mine.slot_bytes
            )));
        }
        if h.link_layer != mine.link_layer {
            return Err(protocol(format!(
                "peer's port has link layer {} and this rank's {} (1 = InfiniBand, 2 = \
                 Ethernet): they cannot reach each other; pick devices on the same fabric",
                h.link_layer, mine.link_layer
            )));
        }
        if !(1..=5).contains(&h.mtu) {
            return Err(protocol(format!(
                "peer announced an invalid MTU code {}",
                h.mtu
            )));
        }
        Ok(h)
    }
}

/// A 24-bit initial packet sequence number, different per process, pair and time.
fn initial_psn(rank: usize, peer: usize) -> u32 {
    let mut x = crate::clock::monotonic_ns()
        ^ (u64::from(std::process::id()) << 32)
        ^ ((rank as u64) << 16)
        ^ peer as u64;
    // splitmix64 finalizer
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 31;
    (x & 0xff_ffff) as u32
}

fn status_text(code: u32) -> String {
    let name = if code <= 23 {
        format!("{:?}", WorkCompletionStatus::from(code))
    } else {
        "unknown status".into()
    };
    let hint = match code {
        5 => "flushed after an earlier error on this connection",
        10 => "the peer refused the access: its buffers are gone (it dropped its transport)",
        12 => {
            "the peer did not acknowledge: its process exited, its queue pair was destroyed, or \
             the fabric path is down"
        }
        13 => "the peer had no receive posted (a protocol bug: credits should prevent this)",
        _ => "see the verbs documentation for this status",
    };
    format!("{name} ({code}): {hint}")
}

// ---------------------------------------------------------------------------------------
// Registered memory.
// ---------------------------------------------------------------------------------------

/// A page-aligned, zeroed heap block that the NIC reads and writes through a memory region.
/// It is only ever accessed through raw pointers (short-lived slices at points where the
/// protocol guarantees the NIC is not touching those bytes), never through a long-lived
/// reference.
struct Region {
    ptr: NonNull<u8>,
    layout: std::alloc::Layout,
}

// SAFETY: the block is owned by one Region and only accessed by the thread holding the
// transport's mutex (and by the NIC); moving the owner between threads is sound.
unsafe impl Send for Region {}

impl Region {
    fn new(len: usize) -> Option<Self> {
        let len = len.max(1).div_ceil(PAGE) * PAGE;
        let layout = std::alloc::Layout::from_size_align(len, PAGE).ok()?;
        // SAFETY: `layout` has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        NonNull::new(ptr).map(|ptr| Self { ptr, layout })
    }

    fn len(&self) -> usize {
        self.layout.size()
    }

    fn addr(&self, off: usize) -> u64 {
        assert!(off <= self.len(), "region offset {off} out of range");
        self.ptr.as_ptr() as u64 + off as u64
    }

    /// A mutable view of `len` bytes at `off`.
    ///
    /// # Safety
    /// No posted work request may be reading or writing these bytes, and no other view of
    /// them may be alive, for the lifetime of the slice.
    unsafe fn slice_mut(&mut self, off: usize, len: usize) -> &mut [u8] {
        assert!(
            off + len <= self.len(),
            "region range {off}+{len} out of range"
        );
        // SAFETY: in bounds (checked above) of a live allocation; exclusivity is the
        // caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(off), len) }
    }

    /// The 8-byte word at `off` (8-aligned) as an atomic, for words the NIC writes.
    fn atomic_u64(&self, off: usize) -> &AtomicU64 {
        assert!(
            off.is_multiple_of(8) && off + 8 <= self.len(),
            "credit word offset {off} out of range"
        );
        // SAFETY: in bounds, 8-aligned (the block is page-aligned), lives as long as `self`,
        // and the CPU only touches this word atomically; the NIC's 8-byte aligned DMA writes
        // land as a whole on the platforms RDMA NICs ship for.
        unsafe { &*self.ptr.as_ptr().add(off).cast::<AtomicU64>() }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout; the memory regions over it were
        // deregistered first (field order of `Inner`).
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

// ---------------------------------------------------------------------------------------
// The transport.
// ---------------------------------------------------------------------------------------

/// One peer's connection.
struct Peer {
    /// Index among the peers (0..world-1), for buffer offsets.
    idx: usize,
    qp: GenericQueuePair,
    control: TcpStream,
    remote_credit_addr: u64,
    remote_credit_rkey: u32,
    tx: TxWindow,
    rx: RxRing,
    /// Received bytes per receive slot.
    rx_len: Vec<u32>,
    /// Credit count last posted to the peer, and whether that write is still in flight.
    credit_written: u64,
    credit_in_flight: bool,
    /// Why the peer is unusable, once it is.
    failed: Option<String>,
    control_closed_at: Option<Instant>,
}

/// Progress of one operation of the current exchange.
#[derive(Debug, Default, Clone, Copy)]
struct OpState {
    next_chunk: u64,
    chunks: u64,
}

/// A completion copied out of the queue.
#[derive(Debug, Clone, Copy)]
struct Wc {
    id: u64,
    status: u32,
    vendor_err: u32,
    byte_len: u32,
}

struct Inner {
    // Field order is drop order: queue pairs, then memory regions, then the memory.
    peers: Vec<Option<Peer>>,
    cq: GenericCompletionQueue,
    data_mr: Arc<MemoryRegion>,
    credit_mr: Arc<MemoryRegion>,
    _pd: Arc<ProtectionDomain>,
    _ctx: Arc<DeviceContext>,
    data: Region,
    credit: Region,
    broken: Option<String>,
    // Per-exchange scratch, kept for its allocations.
    send_ops: Vec<OpState>,
    recv_ops: Vec<OpState>,
    send_cur: Vec<usize>,
    recv_cur: Vec<usize>,
    wcs: Vec<Wc>,
    last_control_check: Instant,
}

/// Point-to-point messages over RDMA verbs (feature `rdma`): one RC queue pair per peer,
/// messages copied through rings of registered slots with two-sided SEND/RECV, and credits
/// (the receiver's count of re-posted slots) published by RDMA WRITE so a sender never
/// overruns its peer. **Untested on hardware in this repository.** Build it with
/// [`RdmaTransport::connect`] from a full mesh of connected TCP streams; the design notes are
/// at the top of `crates/shoal-comm/src/rdma.rs`.
pub struct RdmaTransport {
    rank: usize,
    world: usize,
    slot: usize,
    slots: usize,
    inner: Mutex<Inner>,
}

fn link(rank: usize, peer: usize, reason: String) -> CommError {
    CommError::Link { rank, peer, reason }
}

impl RdmaTransport {
    /// Connects rank `rank` with default settings on `device` (or the first device): see
    /// [`RdmaTransport::connect_with`].
    ///
    /// # Errors
    /// As [`RdmaTransport::connect_with`].
    pub fn connect(
        rank: usize,
        device: Option<&str>,
        control: Vec<Option<TcpStream>>,
        deadline: Instant,
    ) -> Result<Self, CommError> {
        let config = RdmaConfig {
            device: device.map(str::to_owned),
            ..RdmaConfig::default()
        };
        Self::connect_with(rank, &config, control, deadline)
    }

    /// Connects rank `rank` of a world of `control.len()` ranks: `control[p]` is a connected
    /// TCP stream to rank `p` (`None` at `rank`), used to exchange connection details and,
    /// afterwards, to notice a peer that goes away. Every rank must call this at about the
    /// same time with the same configuration.
    ///
    /// # Errors
    /// [`CommError::Usage`] for a bad rank, stream list or configuration;
    /// [`CommError::Link`] when no usable device or port is found or a verbs call fails;
    /// [`CommError::Protocol`] when a peer runs another version or configuration;
    /// [`CommError::Timeout`] when a peer does not answer before `deadline`.
    pub fn connect_with(
        rank: usize,
        config: &RdmaConfig,
        mut control: Vec<Option<TcpStream>>,
        deadline: Instant,
    ) -> Result<Self, CommError> {
        let world = control.len();
        let usage = |reason: String| CommError::Usage { rank, reason };
        if rank >= world {
            return Err(usage(format!(
                "rank {rank} outside a world of {world} streams"
            )));
        }
        for (p, s) in control.iter().enumerate() {
            match (p == rank, s.is_some()) {
                (true, true) => {
                    return Err(usage(
                        "a stream to this rank itself was given; pass None there".into(),
                    ))
                }
                (false, false) => {
                    return Err(usage(format!(
                        "no control stream to rank {p}; every other rank needs one"
                    )))
                }
                _ => {}
            }
        }
        let slot = config.slot_bytes;
        let slots = config.slots;
        if !(MIN_SLOT..=MAX_SLOT).contains(&slot) || !(2..=MAX_SLOTS).contains(&slots) {
            return Err(usage(format!(
                "RDMA slots of {slot} bytes x {slots}: need {MIN_SLOT}..={MAX_SLOT} bytes and \
                 2..={MAX_SLOTS} slots"
            )));
        }
        let npeers = world - 1;
        let local = |reason: String| link(rank, rank, reason);

        // Device, port, GID.
        let list = DeviceList::new().map_err(|e| {
            local(format!(
                "cannot list RDMA devices ({e}): is rdma-core (libibverbs) installed and the \
                 NIC's driver loaded?"
            ))
        })?;
        let device = match &config.device {
            Some(name) => list.iter().find(|d| d.name() == *name).ok_or_else(|| {
                let names: Vec<String> = list.iter().map(|d| d.name()).collect();
                local(format!(
                    "no RDMA device named {name:?}; this host has {names:?} (see ibv_devices)"
                ))
            })?,
            None => list.iter().next().ok_or_else(|| {
                local(
                    "no RDMA device found: check that rdma-core and the provider for the NIC \
                     are installed (ibv_devices should list it), or use the TCP transport"
                        .into(),
                )
            })?,
        };
        let dev_name = device.name();
        let ctx = device
            .open()
            .map_err(|e| local(format!("cannot open RDMA device {dev_name}: {e}")))?;
        drop(list);
        let port = ctx.query_port(config.port).map_err(|e| {
            local(format!(
                "cannot query port {} of {dev_name}: {e}; set RdmaConfig::port to an existing \
                 port",
                config.port
            ))
        })?;
        if port.attr.state != PortState::Active as u32 {
            return Err(local(format!(
                "port {} of {dev_name} is not active (state {}); check the link and, on \
                 InfiniBand, the subnet manager (ibstat)",
                config.port, port.attr.state
            )));
        }
        if !(1..=5).contains(&port.attr.active_mtu) {
            return Err(local(format!(
                "port {} of {dev_name} reports an unknown MTU code {}",
                config.port, port.attr.active_mtu
            )));
        }
        let ethernet = port.attr.link_layer == LinkLayer::Ethernet as u8;
        let gid_index = match config.gid_index {
            Some(i) => i,
            None if ethernet => pick_roce_gid(&ctx, config.port, port.attr.gid_tbl_len),
            None => 0,
        };
        let use_grh = ethernet || config.gid_index.is_some();
        let gid = if use_grh {
            ctx.query_gid(config.port, gid_index).map_err(|e| {
                local(format!(
                    "cannot read GID {gid_index} of {dev_name} port {}: {e}; set \
                     RdmaConfig::gid_index to a valid entry (show_gids lists them)",
                    config.port
                ))
            })?
        } else {
            ctx.query_gid(config.port, 0).unwrap_or_default()
        };
        if use_grh && gid.is_zero() {
            return Err(local(format!(
                "GID {gid_index} of {dev_name} port {} is empty; set RdmaConfig::gid_index to a \
                 populated entry (show_gids lists them)",
                config.port
            )));
        }
        let sgid_index = u8::try_from(gid_index)
            .map_err(|_| usage(format!("GID index {gid_index} is above 255")))?;

        // Memory.
        let data_len = 2 * npeers * slots * slot;
        let data = Region::new(data_len)
            .ok_or_else(|| local(format!("cannot allocate {data_len} bytes of RDMA buffers")))?;
        let credit = Region::new(2 * npeers * CREDIT_STRIDE)
            .ok_or_else(|| local("cannot allocate the credit words".into()))?;
        let pd = ctx
            .alloc_pd()
            .map_err(|e| local(format!("cannot allocate a protection domain: {e}")))?;
        let reg = |r: &Region, access: AccessFlags, what: &str| {
            // SAFETY: `r` is a live allocation of `r.len()` bytes that outlives the memory
            // region (Inner drops the regions before the memory) and is only accessed as the
            // protocol allows while registered.
            unsafe { pd.reg_mr(r.addr(0) as usize, r.len(), access) }.map_err(|e| {
                local(format!(
                    "cannot register {} bytes of {what} ({e}): raise the locked-memory limit \
                     (ulimit -l) or use fewer/smaller slots",
                    r.len()
                ))
            })
        };
        let data_mr = reg(&data, AccessFlags::LocalWrite, "send/receive slots")?;
        let credit_mr = reg(
            &credit,
            AccessFlags::LocalWrite | AccessFlags::RemoteWrite,
            "credit words",
        )?;

        // Completion queue: extended verbs where the provider has them.
        let cqe = u32::try_from(npeers * (2 * slots + 2) + 64).unwrap_or(u32::MAX);
        let mut cq_builder = ctx.create_cq_builder();
        cq_builder.setup_cqe(cqe);
        let cq = match cq_builder.build_ex() {
            Ok(cq) => GenericCompletionQueue::from(cq),
            Err(_) => GenericCompletionQueue::from(cq_builder.build().map_err(|e| {
                local(format!(
                    "cannot create a completion queue of {cqe} entries: {e}"
                ))
            })?),
        };

        // Queue pairs, INIT, receives posted.
        let mut peers: Vec<Option<Peer>> = (0..world).map(|_| None).collect();
        for p in (0..world).filter(|&p| p != rank) {
            let idx = if p < rank { p } else { p - 1 };
            let mut builder = pd.create_qp_builder();
            builder
                .setup_send_cq(cq.clone())
                .setup_recv_cq(cq.clone())
                .setup_max_send_wr(slots as u32 + 2)
                .setup_max_recv_wr(slots as u32)
                .setup_max_send_sge(1)
                .setup_max_recv_sge(1);
            let mut qp = match builder.build_ex() {
                Ok(qp) => GenericQueuePair::from(qp),
                Err(_) => GenericQueuePair::from(
                    builder
                        .build()
                        .map_err(|e| link(rank, p, format!("cannot create a queue pair: {e}")))?,
                ),
            };
            let mut attr = QueuePairAttribute::new();
            attr.setup_state(QueuePairState::Init)
                .setup_pkey_index(0)
                .setup_port(config.port)
                .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteWrite);
            qp.modify(&attr)
                .map_err(|e| link(rank, p, format!("cannot move the queue pair to INIT: {e}")))?;
            let control = control[p].take().expect("checked above");
            peers[p] = Some(Peer {
                idx,
                qp,
                control,
                remote_credit_addr: 0,
                remote_credit_rkey: 0,
                tx: TxWindow::default(),
                rx: RxRing::default(),
                rx_len: vec![0; slots],
                credit_written: 0,
                credit_in_flight: false,
                failed: None,
                control_closed_at: None,
            });
        }
        let mut inner = Inner {
            peers,
            cq,
            data_mr,
            credit_mr,
            _pd: pd,
            _ctx: ctx,
            data,
            credit,
            broken: None,
            send_ops: Vec::new(),
            recv_ops: Vec::new(),
            send_cur: vec![0; world],
            recv_cur: vec![0; world],
            wcs: Vec::with_capacity(64),
            last_control_check: Instant::now(),
        };
        for p in (0..world).filter(|&p| p != rank) {
            inner.post_recvs(rank, p, slot, slots, 0, slots as u64)?;
        }

        // Handshake over the control streams: everyone writes, then everyone reads.
        let start = Instant::now();
        let timeout = |peer: usize| CommError::Timeout {
            rank,
            peer,
            deadline_ms: u64::try_from(deadline.saturating_duration_since(start).as_millis())
                .unwrap_or(u64::MAX),
        };
        let mut mine: Vec<Option<Handshake>> = vec![None; world];
        for p in (0..world).filter(|&p| p != rank) {
            let peer = inner.peers[p].as_mut().expect("built above");
            let h = Handshake {
                rank: rank as u32,
                world: world as u32,
                qpn: peer.qp.qp_number(),
                psn: initial_psn(rank, p),
                lid: port.attr.lid,
                mtu: port.attr.active_mtu as u16,
                gid: gid.raw,
                link_layer: port.attr.link_layer,
                slot_bytes: slot as u32,
                slots: slots as u32,
                credit_addr: inner.credit.addr(peer.idx * CREDIT_STRIDE),
                credit_rkey: inner.credit_mr.rkey(),
            };
            control_io(&mut peer.control, deadline, |s| s.write_all(&h.encode()))
                .map_err(|e| control_err(rank, p, e, &timeout))?;
            mine[p] = Some(h);
        }
        for p in (0..world).filter(|&p| p != rank) {
            let peer = inner.peers[p].as_mut().expect("built above");
            let mut m = [0u8; HS_LEN];
            control_io(&mut peer.control, deadline, |s| s.read_exact(&mut m))
                .map_err(|e| control_err(rank, p, e, &timeout))?;
            let h_mine = mine[p].expect("written above");
            let theirs = Handshake::decode(&m, &h_mine, p)?;
            peer.remote_credit_addr = theirs.credit_addr;
            peer.remote_credit_rkey = theirs.credit_rkey;
            connect_qp(
                &mut peer.qp,
                config.port,
                &h_mine,
                &theirs,
                use_grh,
                sgid_index,
            )
            .map_err(|reason| link(rank, p, reason))?;
        }
        // Every queue pair is ready to send: tell the peers, and wait until they are too.
        for p in (0..world).filter(|&p| p != rank) {
            let peer = inner.peers[p].as_mut().expect("built above");
            control_io(&mut peer.control, deadline, |s| s.write_all(READY))
                .map_err(|e| control_err(rank, p, e, &timeout))?;
        }
        for p in (0..world).filter(|&p| p != rank) {
            let peer = inner.peers[p].as_mut().expect("built above");
            let mut m = [0u8; 8];
            control_io(&mut peer.control, deadline, |s| s.read_exact(&mut m))
                .map_err(|e| control_err(rank, p, e, &timeout))?;
            if &m != READY {
                return Err(CommError::Protocol {
                    rank,
                    peer: p,
                    reason: "the peer's ready message is garbled; restart every rank".into(),
                });
            }
            peer.control
                .set_nonblocking(true)
                .map_err(|e| link(rank, p, format!("cannot configure the control socket: {e}")))?;
        }
        tracing::info!(rank, world, device = %dev_name, port = config.port, slot, slots, "RDMA transport connected");
        Ok(Self {
            rank,
            world,
            slot,
            slots,
            inner: Mutex::new(inner),
        })
    }
}

/// Picks a RoCE GID: the first RoCE v2 entry holding an IPv4 address, else the first RoCE v2
/// entry, else 0.
fn pick_roce_gid(ctx: &DeviceContext, port: u8, table_len: i32) -> u32 {
    // `ibv_query_gid_type` reports 1 for RoCE v2 (IBV_GID_TYPE_SYSFS_ROCE_V2).
    const ROCE_V2: u32 = 1;
    let mut first_v2 = None;
    for i in 0..u32::try_from(table_len).unwrap_or(0) {
        let Ok(gid) = ctx.query_gid(port, i) else {
            continue;
        };
        if gid.is_zero() || ctx.query_gid_type(port, i).ok() != Some(ROCE_V2) {
            continue;
        }
        let ipv4_mapped = gid.raw[..10].iter().all(|&b| b == 0) && gid.raw[10..12] == [0xff; 2];
        if ipv4_mapped {
            return i;
        }
        first_v2.get_or_insert(i);
    }
    first_v2.unwrap_or(0)
}

/// Moves a queue pair from INIT through RTR to RTS towards the peer `theirs` describes.
fn connect_qp(
    qp: &mut GenericQueuePair,
    port: u8,
    mine: &Handshake,
    theirs: &Handshake,
    use_grh: bool,
    sgid_index: u8,
) -> Result<(), String> {
    let mtu = Mtu::from(u32::from(mine.mtu.min(theirs.mtu)));
    let mut ah = AddressHandleAttribute::new();
    ah.setup_dest_lid(theirs.lid)
        .setup_port(port)
        .setup_service_level(0);
    if use_grh {
        ah.setup_grh(&Gid { raw: theirs.gid }, 0, sgid_index, 64, 0);
    }
    let mut attr = QueuePairAttribute::new();
    attr.setup_state(QueuePairState::ReadyToReceive)
        .setup_path_mtu(mtu)
        .setup_dest_qp_num(theirs.qpn)
        .setup_rq_psn(theirs.psn)
        .setup_max_dest_read_atomic(1)
        .setup_min_rnr_timer(12)
        .setup_address_vector(&ah);
    qp.modify(&attr).map_err(|e| {
        format!(
            "cannot move the queue pair to RTR ({e}); on RoCE check RdmaConfig::gid_index and \
             that the hosts reach each other over IP"
        )
    })?;
    let mut attr = QueuePairAttribute::new();
    attr.setup_state(QueuePairState::ReadyToSend)
        .setup_sq_psn(mine.psn)
        .setup_timeout(14)
        .setup_retry_cnt(7)
        .setup_rnr_retry(7)
        .setup_max_read_atomic(1);
    qp.modify(&attr)
        .map_err(|e| format!("cannot move the queue pair to RTS: {e}"))
}

/// Runs blocking I/O on a control stream with timeouts set from `deadline`.
fn control_io(
    s: &mut TcpStream,
    deadline: Instant,
    f: impl FnOnce(&mut TcpStream) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(std::io::ErrorKind::TimedOut.into());
    }
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(left))?;
    s.set_write_timeout(Some(left))?;
    f(s)
}

fn control_err(
    rank: usize,
    peer: usize,
    e: std::io::Error,
    timeout: &impl Fn(usize) -> CommError,
) -> CommError {
    match e.kind() {
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => timeout(peer),
        std::io::ErrorKind::UnexpectedEof => link(
            rank,
            peer,
            "the peer closed the control connection during RDMA setup: its setup failed \
             (check that rank's log)"
                .into(),
        ),
        _ => link(
            rank,
            peer,
            format!("control connection failed during RDMA setup: {e}"),
        ),
    }
}

impl Inner {
    fn peer(&mut self, rank: usize, p: usize) -> Result<&mut Peer, CommError> {
        self.peers
            .get_mut(p)
            .and_then(Option::as_mut)
            .ok_or_else(|| link(rank, p, "no connection to this rank".into()))
    }

    /// Posts RECVs for chunks `from..to` of peer `p` (slot = chunk % slots).
    fn post_recvs(
        &mut self,
        rank: usize,
        p: usize,
        slot: usize,
        slots: usize,
        from: u64,
        to: u64,
    ) -> Result<(), CommError> {
        if from >= to {
            return Ok(());
        }
        let lkey = self.data_mr.lkey();
        let base = self.data.addr(0);
        let peer = self.peers[p].as_mut().expect("peer exists");
        let mut guard = peer.qp.start_post_recv();
        for seq in from..to {
            let s = (seq % slots as u64) as usize;
            let off = (peer.idx * slots + s) * slot;
            let wr = guard.construct_wr(wr_id(WrKind::Recv, p, s));
            // SAFETY: the slot lies inside the registered data region (lkey), which outlives
            // the queue pair; the protocol leaves the slot alone until this RECV completes.
            unsafe { wr.setup_sge(lkey, base + off as u64, slot as u32) };
        }
        guard.post().map_err(|e| {
            link(
                rank,
                p,
                format!("posting receives failed ({e}): the queue pair is in error"),
            )
        })
    }

    /// Publishes peer `p`'s credit count if it grew and no write is in flight.
    fn post_credit(&mut self, rank: usize, p: usize, npeers: usize) -> Result<(), CommError> {
        let lkey = self.credit_mr.lkey();
        let peer = self.peers[p].as_mut().expect("peer exists");
        if peer.credit_in_flight || peer.rx.reposted <= peer.credit_written || peer.failed.is_some()
        {
            return Ok(());
        }
        let off = (npeers + peer.idx) * CREDIT_STRIDE;
        // No write from this word is in flight, so updating it is safe.
        self.credit
            .atomic_u64(off)
            .store(peer.rx.reposted, Ordering::Release);
        let mut guard = peer.qp.start_post_send();
        let wr = guard
            .construct_wr(wr_id(WrKind::Credit, p, 0), WorkRequestFlags::Signaled)
            .setup_write(peer.remote_credit_rkey, peer.remote_credit_addr);
        // SAFETY: the 8-byte word is inside the registered credit region, which outlives the
        // queue pair, and is not modified again until this write completes (in_flight).
        unsafe { wr.setup_sge(lkey, self.credit.addr(off), 8) };
        guard.post().map_err(|e| {
            link(
                rank,
                p,
                format!("posting a credit update failed ({e}): the queue pair is in error"),
            )
        })?;
        peer.credit_in_flight = true;
        peer.credit_written = peer.rx.reposted;
        Ok(())
    }

    /// Drains the completion queue into the peers' counters; returns whether anything came.
    fn poll(&mut self, rank: usize, slots: usize, blame: usize) -> Result<bool, CommError> {
        self.wcs.clear();
        let cap = self.wcs.capacity().max(64);
        match self.cq.start_poll() {
            Ok(poller) => {
                for wc in poller.take(cap) {
                    let status = wc.status();
                    let ok = status == WorkCompletionStatus::Success as u32;
                    let recv = parse_wr_id(wc.wr_id()).map(|w| w.0) == Some(WrKind::Recv);
                    self.wcs.push(Wc {
                        id: wc.wr_id(),
                        status,
                        vendor_err: if ok { 0 } else { wc.vendor_err() },
                        byte_len: if ok && recv { wc.byte_len() } else { 0 },
                    });
                }
            }
            Err(PollCompletionQueueError::CompletionQueueEmpty) => return Ok(false),
            Err(e) => {
                return Err(link(
                    rank,
                    blame,
                    format!("polling the completion queue failed: {e}"),
                ))
            }
        }
        for i in 0..self.wcs.len() {
            let wc = self.wcs[i];
            let Some((kind, p, s)) = parse_wr_id(wc.id) else {
                return Err(link(
                    rank,
                    blame,
                    format!("a completion with unknown id {:#x}", wc.id),
                ));
            };
            let peer = self.peer(rank, p)?;
            if wc.status != WorkCompletionStatus::Success as u32 {
                let what = match kind {
                    WrKind::Recv => "a receive",
                    WrKind::Send => "a send",
                    WrKind::Credit => "a credit update",
                };
                peer.failed.get_or_insert_with(|| {
                    format!(
                        "{what} completed with {} (vendor error {:#x})",
                        status_text(wc.status),
                        wc.vendor_err
                    )
                });
                if kind == WrKind::Credit {
                    peer.credit_in_flight = false;
                }
                continue;
            }
            match kind {
                WrKind::Recv => {
                    let expect = peer.rx.arrival_slot(slots);
                    if s != expect {
                        return Err(CommError::Protocol {
                            rank,
                            peer: p,
                            reason: format!(
                                "a chunk landed in receive slot {s}, expected slot {expect}: \
                                 receive bookkeeping is inconsistent (a bug in this transport)"
                            ),
                        });
                    }
                    peer.rx_len[s] = wc.byte_len;
                    peer.rx.arrived += 1;
                }
                WrKind::Send => peer.tx.completed += 1,
                WrKind::Credit => peer.credit_in_flight = false,
            }
        }
        Ok(true)
    }

    /// Reads each peer's control stream: notes closed ones, fails those closed long enough.
    fn check_controls(&mut self, now: Instant) {
        for peer in self.peers.iter_mut().flatten() {
            if peer.failed.is_some() {
                continue;
            }
            if peer.control_closed_at.is_none() {
                let mut buf = [0u8; 64];
                match peer.control.read(&mut buf) {
                    Ok(0) => peer.control_closed_at = Some(now),
                    Ok(_) => {
                        tracing::warn!("ignored unexpected bytes on an RDMA control connection");
                    }
                    Err(e)
                        if e.kind() == std::io::ErrorKind::WouldBlock
                            || e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => peer.control_closed_at = Some(now),
                }
            }
            if let Some(at) = peer.control_closed_at {
                if now.duration_since(at) >= CLOSE_GRACE {
                    peer.failed = Some(
                        "the peer closed its control connection (its process exited, failed or \
                         dropped its transport); check that rank's log"
                            .into(),
                    );
                }
            }
        }
    }

    /// After a failure: error every queue pair and close the control streams so peers fail
    /// fast.
    fn shut_down(&mut self) {
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Error);
        for peer in self.peers.iter_mut().flatten() {
            let _ = peer.qp.modify(&attr);
            let _ = peer.control.shutdown(Shutdown::Both);
        }
    }
}

impl RdmaTransport {
    fn drive(
        &self,
        inner: &mut Inner,
        sends: &[(usize, &[u8])],
        recvs: &mut [(usize, &mut [u8])],
        deadline: Instant,
    ) -> Result<(), CommError> {
        let (rank, slot, slots) = (self.rank, self.slot, self.slots);
        let npeers = self.world - 1;
        const NONE: usize = usize::MAX;

        inner.send_ops.clear();
        inner.send_ops.extend(sends.iter().map(|(_, m)| OpState {
            next_chunk: 0,
            chunks: chunk_count(m.len(), slot),
        }));
        inner.recv_ops.clear();
        inner.recv_ops.extend(recvs.iter().map(|(_, b)| OpState {
            next_chunk: 0,
            chunks: chunk_count(b.len(), slot),
        }));
        let first_from = |peers: &mut dyn Iterator<Item = usize>, p: usize, from: usize| {
            peers
                .enumerate()
                .skip(from)
                .find(|&(_, q)| q == p)
                .map_or(NONE, |(i, _)| i)
        };
        for p in 0..self.world {
            inner.send_cur[p] = first_from(&mut sends.iter().map(|s| s.0), p, 0);
            inner.recv_cur[p] = first_from(&mut recvs.iter().map(|r| r.0), p, 0);
        }
        let (mut sends_left, mut recvs_left) = (sends.len(), recvs.len());
        let start = Instant::now();
        let mut idle_since = start;

        loop {
            let mut progressed = inner.poll(rank, slots, sends.first().map_or(rank, |s| s.0))?;

            // Receives: copy out what arrived, in order, into the current operation.
            for p in 0..self.world {
                while inner.recv_cur[p] != NONE {
                    let i = inner.recv_cur[p];
                    let peer = inner.peers[p].as_mut().expect("checked peer");
                    let Some(s) = peer.rx.next_ready(slots) else {
                        break;
                    };
                    let len = peer.rx_len[s] as usize;
                    let off = (peer.idx * slots + s) * slot;
                    let op = &mut inner.recv_ops[i];
                    // SAFETY: the chunk's RECV completed and the slot is not re-posted until
                    // after this copy, so the NIC is not touching it; len <= slot (NIC-bounded).
                    let chunk = unsafe { inner.data.slice_mut(off, len.min(slot)) };
                    read_chunk(chunk, slot, op.next_chunk, recvs[i].1, rank, p)?;
                    op.next_chunk += 1;
                    peer.rx.consumed += 1;
                    progressed = true;
                    if op.next_chunk == op.chunks {
                        recvs_left -= 1;
                        inner.recv_cur[p] = first_from(&mut recvs.iter().map(|r| r.0), p, i + 1);
                    }
                }
            }

            // Re-post consumed slots and publish the credits.
            for p in (0..self.world).filter(|&p| p != rank) {
                let (from, to, failed) = {
                    let peer = inner.peers[p].as_ref().expect("peer exists");
                    (peer.rx.reposted, peer.rx.consumed, peer.failed.is_some())
                };
                if to > from && !failed {
                    inner.post_recvs(rank, p, slot, slots, from, to)?;
                    inner.peers[p].as_mut().expect("peer exists").rx.reposted = to;
                }
                inner.post_credit(rank, p, npeers)?;
            }

            // Sends: post every chunk the credits and free send slots allow.
            for p in 0..self.world {
                if inner.send_cur[p] == NONE {
                    continue;
                }
                let lkey = inner.data_mr.lkey();
                let base = inner.data.addr(0);
                let peer = inner.peers[p].as_mut().expect("checked peer");
                if let Some(why) = &peer.failed {
                    return Err(link(rank, p, why.clone()));
                }
                let credit_off = peer.idx * CREDIT_STRIDE;
                let credits = inner.credit.atomic_u64(credit_off).load(Ordering::Acquire);
                if !peer.tx.can_post(slots, credits) {
                    continue;
                }
                let mut guard = peer.qp.start_post_send();
                while inner.send_cur[p] != NONE && peer.tx.can_post(slots, credits) {
                    let i = inner.send_cur[p];
                    let op = &mut inner.send_ops[i];
                    let s = peer.tx.next_slot(slots);
                    let off = (npeers * slots + peer.idx * slots + s) * slot;
                    // SAFETY: this send slot's previous send completed (can_post checks
                    // posted - completed < slots), so the NIC is not reading it.
                    let dst = unsafe { inner.data.slice_mut(off, slot) };
                    let n = write_chunk(sends[i].1, slot, op.next_chunk, dst);
                    debug_assert_eq!(n, chunk_wire_len(sends[i].1.len(), slot, op.next_chunk));
                    let wr = guard
                        .construct_wr(wr_id(WrKind::Send, p, s), WorkRequestFlags::Signaled)
                        .setup_send();
                    // SAFETY: the slot is inside the registered data region, which outlives
                    // the queue pair, and stays untouched until this send completes.
                    unsafe { wr.setup_sge(lkey, base + off as u64, n as u32) };
                    peer.tx.posted += 1;
                    op.next_chunk += 1;
                    if op.next_chunk == op.chunks {
                        sends_left -= 1;
                        inner.send_cur[p] = first_from(&mut sends.iter().map(|s| s.0), p, i + 1);
                    }
                }
                guard.post().map_err(|e| {
                    link(
                        rank,
                        p,
                        format!("posting sends failed ({e}): the queue pair is in error"),
                    )
                })?;
                progressed = true;
            }

            if sends_left == 0 && recvs_left == 0 {
                return Ok(());
            }

            // A failed peer that this exchange still waits on fails it.
            for p in 0..self.world {
                let Some(peer) = inner.peers[p].as_ref() else {
                    continue;
                };
                let Some(why) = &peer.failed else {
                    continue;
                };
                let waits_recv = inner.recv_cur[p] != NONE && peer.rx.next_ready(slots).is_none();
                if waits_recv || inner.send_cur[p] != NONE {
                    return Err(link(rank, p, why.clone()));
                }
            }

            let now = Instant::now();
            if progressed {
                idle_since = now;
                continue;
            }
            if now >= deadline {
                let peer = (0..self.world)
                    .find(|&p| inner.recv_cur[p] != NONE)
                    .or_else(|| (0..self.world).find(|&p| inner.send_cur[p] != NONE))
                    .unwrap_or(rank);
                return Err(CommError::Timeout {
                    rank,
                    peer,
                    deadline_ms: u64::try_from(
                        deadline.saturating_duration_since(start).as_millis(),
                    )
                    .unwrap_or(u64::MAX),
                });
            }
            if now.duration_since(inner.last_control_check) >= CONTROL_CHECK_EVERY {
                inner.last_control_check = now;
                inner.check_controls(now);
            }
            let idle = now.duration_since(idle_since);
            if idle < SPIN_FOR {
                std::hint::spin_loop();
            } else if idle < YIELD_FOR {
                std::thread::yield_now();
            } else {
                std::thread::sleep(NAP.min(deadline.saturating_duration_since(now)));
            }
        }
    }
}

impl Transport for RdmaTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn exchange(
        &self,
        sends: &[(usize, &[u8])],
        recvs: &mut [(usize, &mut [u8])],
        deadline: Instant,
    ) -> Result<(), CommError> {
        check_peers(self.rank, self.world, sends, recvs)?;
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let inner = &mut *guard;
        if let Some(why) = &inner.broken {
            return Err(broken(self.rank, why, sends, recvs));
        }
        let result = self.drive(inner, sends, recvs, deadline);
        if let Err(e) = &result {
            inner.broken = Some(e.to_string());
            inner.shut_down();
        }
        result
    }
}

impl Drop for RdmaTransport {
    fn drop(&mut self) {
        let inner = self.inner.get_mut().unwrap_or_else(|e| e.into_inner());
        if inner.broken.is_some() {
            return;
        }
        // Let outstanding sends reach the peers before the queue pairs go. (Credit updates
        // are not waited for: nobody needs them once this rank is gone, and a peer that left
        // first would only make them wait for the retry timeout.)
        let until = Instant::now() + DRAIN_ON_DROP;
        while Instant::now() < until {
            let pending = inner
                .peers
                .iter()
                .flatten()
                .any(|p| p.failed.is_none() && p.tx.posted > p.tx.completed);
            if !pending {
                break;
            }
            match inner.poll(self.rank, self.slots, self.rank) {
                Ok(true) => {}
                Ok(false) => std::thread::sleep(NAP),
                Err(_) => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SLOT: usize = 4096;

    #[test]
    fn chunk_counts() {
        let first = SLOT - HEADER_LEN;
        assert_eq!(chunk_count(0, SLOT), 1);
        assert_eq!(chunk_count(first, SLOT), 1);
        assert_eq!(chunk_count(first + 1, SLOT), 2);
        assert_eq!(chunk_count(first + SLOT, SLOT), 2);
        assert_eq!(chunk_count(first + SLOT + 1, SLOT), 3);
        assert_eq!(chunk_count(10 << 20, 64 << 10), 161);
    }

    #[test]
    fn spans_cover_the_message_once() {
        for len in [
            0,
            1,
            SLOT - HEADER_LEN,
            SLOT,
            3 * SLOT + 17,
            10 * SLOT - HEADER_LEN,
        ] {
            let mut next = 0;
            for i in 0..chunk_count(len, SLOT) {
                let (off, n) = chunk_span(len, SLOT, i);
                assert_eq!(off, next, "len {len} chunk {i}");
                assert!(chunk_wire_len(len, SLOT, i) <= SLOT);
                assert!(n > 0 || len == 0);
                next = off + n;
            }
            assert_eq!(next, len);
        }
    }

    #[test]
    fn split_and_reassemble() {
        let msg: Vec<u8> = (0..3 * SLOT + 123).map(|i| (i * 7 % 251) as u8).collect();
        let mut out = vec![0u8; msg.len()];
        let mut slot = vec![0u8; SLOT];
        for i in 0..chunk_count(msg.len(), SLOT) {
            let n = write_chunk(&msg, SLOT, i, &mut slot);
            read_chunk(&slot[..n], SLOT, i, &mut out, 0, 1).unwrap();
        }
        assert_eq!(out, msg);
    }

    #[test]
    fn length_mismatch_names_both() {
        let msg = vec![1u8; 100];
        let mut slot = vec![0u8; SLOT];
        let n = write_chunk(&msg, SLOT, 0, &mut slot);
        let mut out = vec![0u8; 64];
        let e = read_chunk(&slot[..n], SLOT, 0, &mut out, 2, 3).unwrap_err();
        assert!(matches!(
            e,
            CommError::Protocol {
                rank: 2,
                peer: 3,
                ..
            }
        ));
        let e = e.to_string();
        assert!(e.contains("100 bytes") && e.contains("expected 64"), "{e}");
        let e = read_chunk(&slot[..8], SLOT, 0, &mut out, 2, 3).unwrap_err();
        assert!(e.to_string().contains("header"), "{e}");
        // A later chunk of the wrong size.
        let big = vec![0u8; 2 * SLOT];
        let mut out = vec![0u8; big.len()];
        let e = read_chunk(&slot[..10], SLOT, 1, &mut out, 0, 1).unwrap_err();
        assert!(e.to_string().contains("chunk 1"), "{e}");
    }

    #[test]
    fn tx_window_respects_credits_and_slots() {
        let mut tx = TxWindow::default();
        // No credits published yet: the initially posted receives allow `slots` chunks.
        for _ in 0..4 {
            assert!(tx.can_post(4, 0));
            tx.posted += 1;
        }
        assert!(!tx.can_post(4, 0));
        // The receiver re-posted two slots, but no send completed: own slots are busy.
        assert!(!tx.can_post(4, 2));
        tx.completed = 4;
        assert!(tx.can_post(4, 2));
        tx.posted += 2;
        assert!(!tx.can_post(4, 2));
        assert_eq!(tx.next_slot(4), 2);
    }

    /// Simulates a sender and receiver over the slot rings, with posting, arrival and
    /// consumption interleaved at random (several seeds, some with a slow receiver), and
    /// checks that no receive slot is ever overwritten before it is consumed, that the sender
    /// really runs out of credits, and that every message arrives intact and in order.
    #[test]
    fn simulated_ring_never_overruns() {
        let slots = 3;
        let msgs: Vec<Vec<u8>> = [0usize, 5, SLOT, 4 * SLOT + 9, 1, 2 * SLOT, 7 * SLOT]
            .iter()
            .enumerate()
            .map(|(k, &n)| (0..n).map(|i| (i + k) as u8).collect())
            .collect();
        let mut blocked_total = 0;
        for seed in 1..=20u64 {
            let mut rng = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            let mut next = move || {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng
            };
            // Odd seeds consume rarely, so the sender runs into the window.
            let consume_weight = if seed % 2 == 1 { 1 } else { 4 };
            let mut ring = vec![(vec![0u8; SLOT], 0usize, false); slots]; // data, len, full
            let mut tx = TxWindow::default();
            let mut rx = RxRing::default();
            let mut wire: std::collections::VecDeque<Vec<u8>> = Default::default();
            let (mut sm, mut sc) = (0usize, 0u64); // sender: message, chunk
            let (mut rm, mut rc) = (0usize, 0u64); // receiver: message, chunk
            let mut out: Vec<Vec<u8>> = msgs.iter().map(|m| vec![0u8; m.len()]).collect();
            let mut steps = 0;
            while rm < msgs.len() {
                steps += 1;
                assert!(steps < 1_000_000, "seed {seed}: no progress");
                let r = next() % (8 + consume_weight);
                if r < 4 {
                    if sm == msgs.len() {
                        continue;
                    }
                    if !tx.can_post(slots, rx.reposted) {
                        blocked_total += 1;
                        continue;
                    }
                    let mut buf = vec![0u8; SLOT];
                    let n = write_chunk(&msgs[sm], SLOT, sc, &mut buf);
                    assert_eq!(n, chunk_wire_len(msgs[sm].len(), SLOT, sc));
                    buf.truncate(n);
                    wire.push_back(buf);
                    tx.posted += 1;
                    sc += 1;
                    if sc == chunk_count(msgs[sm].len(), SLOT) {
                        (sm, sc) = (sm + 1, 0);
                    }
                } else if r < 8 {
                    let Some(buf) = wire.pop_front() else {
                        continue;
                    };
                    let s = rx.arrival_slot(slots);
                    assert!(
                        !ring[s].2,
                        "seed {seed}: slot {s} overwritten before consumed"
                    );
                    ring[s].0[..buf.len()].copy_from_slice(&buf);
                    ring[s].1 = buf.len();
                    ring[s].2 = true;
                    rx.arrived += 1;
                    tx.completed += 1;
                } else if let Some(s) = rx.next_ready(slots) {
                    let (data, len, _) = &ring[s];
                    read_chunk(&data[..*len], SLOT, rc, &mut out[rm], 0, 1).unwrap();
                    ring[s].2 = false;
                    rx.consumed += 1;
                    // Re-posting (and so crediting) may lag consumption.
                    if next() % 2 == 0 {
                        rx.reposted = rx.consumed;
                    }
                    rc += 1;
                    if rc == chunk_count(msgs[rm].len(), SLOT) {
                        (rm, rc) = (rm + 1, 0);
                    }
                } else {
                    rx.reposted = rx.consumed;
                }
            }
            assert_eq!(out, msgs, "seed {seed}");
        }
        assert!(blocked_total > 0, "the window was never exercised");
    }

    #[test]
    fn wr_ids_roundtrip() {
        for (k, p, s) in [
            (WrKind::Recv, 0, 0),
            (WrKind::Send, 1023, 4095),
            (WrKind::Credit, 7, 0),
        ] {
            assert_eq!(parse_wr_id(wr_id(k, p, s)), Some((k, p, s)));
        }
        assert_eq!(parse_wr_id(0), None);
    }

    fn hs(rank: u32) -> Handshake {
        Handshake {
            rank,
            world: 4,
            qpn: 0x1234,
            psn: 0xabcdef,
            lid: 7,
            mtu: 5,
            gid: [9; 16],
            link_layer: 1,
            slot_bytes: 65536,
            slots: 16,
            credit_addr: 0xdead_beef_0000,
            credit_rkey: 42,
        }
    }

    #[test]
    fn handshake_roundtrip_and_checks() {
        let mine = hs(0);
        let theirs = hs(2);
        assert_eq!(
            Handshake::decode(&theirs.encode(), &mine, 2).unwrap(),
            theirs
        );
        let e = Handshake::decode(&theirs.encode(), &mine, 1).unwrap_err();
        assert!(e.to_string().contains("leads to rank 2"), "{e}");
        let mut other = hs(2);
        other.slots = 8;
        let e = Handshake::decode(&other.encode(), &mine, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("8 slots") && e.contains("16 slots"), "{e}");
        let mut m = theirs.encode();
        m[0] ^= 1;
        assert!(matches!(
            Handshake::decode(&m, &mine, 2),
            Err(CommError::Protocol { .. })
        ));
    }

    #[test]
    fn psn_is_24_bits() {
        for p in 0..8 {
            assert!(initial_psn(0, p) < 1 << 24);
        }
    }

    #[test]
    fn status_text_never_panics() {
        for code in 0..40 {
            assert!(!status_text(code).is_empty());
        }
    }
}
