//! [`TcpTransport`]: a full mesh of TCP connections, one per pair of ranks, for ranks on
//! different hosts (or one host, as a baseline). Sockets are non-blocking with `TCP_NODELAY`;
//! `exchange` writes each frame with one `writev` straight from the caller's slices, reads
//! straight into the caller's buffers, and sleeps in `poll(2)` until some link is ready or
//! the deadline passes. A peer that closes its socket is reported at once as
//! [`CommError::Link`]; a silent one as [`CommError::Timeout`] at the deadline.
//!
//! Meshes are built from already connected streams ([`TcpTransport::from_streams`]), over
//! loopback for tests ([`tcp_mesh_local`]), or across hosts with [`connect_mesh`]: rank `r`
//! dials every lower rank and accepts every higher one, and each connection opens with a
//! hello frame (protocol version, the dialer's rank, world size) that the acceptor checks
//! and answers. Writes rely on `SIGPIPE` being ignored, which the Rust runtime does for every
//! Rust binary; a closed peer then shows up as an `EPIPE` error rather than a signal.

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::frame::{self, HEADER_LEN};
use crate::stream::{Driver, Streams, WANT_READ, WANT_WRITE};
use crate::transport::{broken, check_peers, Transport};
use crate::CommError;

/// A full mesh of TCP connections between the ranks of one world.
pub struct TcpTransport {
    rank: usize,
    world: usize,
    inner: Mutex<Inner>,
}

struct Inner {
    io: TcpIo,
    driver: Driver,
    broken: Option<String>,
}

struct TcpIo {
    rank: usize,
    streams: Vec<Option<TcpStream>>,
    pollfds: Vec<libc::pollfd>,
    polled: Vec<usize>,
}

fn link_err(rank: usize, peer: usize, reason: String) -> CommError {
    CommError::Link { rank, peer, reason }
}

impl TcpTransport {
    /// Builds the transport of `rank` from one connected stream per rank: `streams[p]` is
    /// the connection to rank `p`, `streams[rank]` is `None`. Sets `TCP_NODELAY` and
    /// non-blocking mode on every stream.
    ///
    /// # Errors
    /// [`CommError::Usage`] when a stream is missing or `rank` is outside the world;
    /// [`CommError::Link`] when a socket option cannot be set.
    pub fn from_streams(rank: usize, streams: Vec<Option<TcpStream>>) -> Result<Self, CommError> {
        let world = streams.len();
        if rank >= world {
            return Err(CommError::Usage {
                rank,
                reason: format!("rank {rank} outside a world of {world} streams"),
            });
        }
        for (peer, s) in streams.iter().enumerate() {
            match (peer == rank, s) {
                (true, Some(_)) => {
                    return Err(CommError::Usage {
                        rank,
                        reason: "a stream to this rank itself was given; pass None there".into(),
                    })
                }
                (false, None) => {
                    return Err(CommError::Usage {
                        rank,
                        reason: format!("no stream to rank {peer}; every other rank needs one"),
                    })
                }
                (false, Some(s)) => {
                    let setup = s.set_nodelay(true).and_then(|()| s.set_nonblocking(true));
                    setup.map_err(|e| {
                        link_err(rank, peer, format!("cannot configure the socket: {e}"))
                    })?;
                }
                (true, None) => {}
            }
        }
        Ok(Self {
            rank,
            world,
            inner: Mutex::new(Inner {
                io: TcpIo {
                    rank,
                    streams,
                    pollfds: Vec::new(),
                    polled: Vec::new(),
                },
                driver: Driver::default(),
                broken: None,
            }),
        })
    }
}

impl Transport for TcpTransport {
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
        let result =
            inner
                .driver
                .drive(&mut inner.io, self.rank, self.world, sends, recvs, deadline);
        if let Err(e) = &result {
            // The streams may have stopped mid-frame: close them all so peers fail fast.
            inner.broken = Some(e.to_string());
            for s in inner.io.streams.iter().flatten() {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
        result
    }
}

/// How long an exchange busy-retries its non-blocking reads and writes.
const SPIN_BEFORE_POLL: Duration = Duration::from_micros(20);
/// How long it then retries them, yielding the core between tries, before sleeping in
/// `poll(2)`.
const YIELD_BEFORE_POLL: Duration = Duration::from_millis(2);

impl TcpIo {
    fn stream(&self, peer: usize) -> Result<&TcpStream, CommError> {
        self.streams
            .get(peer)
            .and_then(Option::as_ref)
            .ok_or_else(|| link_err(self.rank, peer, "no connection to this rank".into()))
    }
}

impl Streams for TcpIo {
    fn write2(&mut self, peer: usize, a: &[u8], b: &[u8]) -> Result<usize, CommError> {
        let mut s = self.stream(peer)?;
        loop {
            return match s.write_vectored(&[IoSlice::new(a), IoSlice::new(b)]) {
                Ok(0) => Err(link_err(
                    self.rank,
                    peer,
                    "the connection accepts no more bytes".into(),
                )),
                Ok(n) => Ok(n),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(0),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => Err(link_err(
                    self.rank,
                    peer,
                    format!("send failed ({e}): the peer's process probably exited or failed"),
                )),
            };
        }
    }

    fn read2(&mut self, peer: usize, a: &mut [u8], b: &mut [u8]) -> Result<usize, CommError> {
        let mut s = self.stream(peer)?;
        loop {
            return match s.read_vectored(&mut [IoSliceMut::new(a), IoSliceMut::new(b)]) {
                Ok(0) => Err(link_err(
                    self.rank,
                    peer,
                    "the peer closed the connection (its process exited, failed or dropped its \
                     transport); check that rank's log"
                        .into(),
                )),
                Ok(n) => Ok(n),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(0),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => Err(link_err(
                    self.rank,
                    peer,
                    format!("receive failed ({e}): the peer's process probably exited or failed"),
                )),
            };
        }
    }

    fn wait(
        &mut self,
        interest: &[u8],
        deadline: Instant,
        idle: Duration,
    ) -> Result<(), CommError> {
        // A peer usually answers within microseconds to a few milliseconds (whatever the
        // ranks' imbalance is); waking from poll(2) can cost tens of microseconds on a VM,
        // and a tensor-parallel token waits on its peers at every layer. So retry the
        // non-blocking calls first, yielding the core to any other runnable thread, and sleep
        // only after that.
        if idle < SPIN_BEFORE_POLL {
            std::hint::spin_loop();
            return Ok(());
        }
        if idle < YIELD_BEFORE_POLL {
            std::thread::yield_now();
            return Ok(());
        }
        self.pollfds.clear();
        self.polled.clear();
        for (peer, &want) in interest.iter().enumerate() {
            if want == 0 {
                continue;
            }
            let mut events = 0;
            if want & WANT_READ != 0 {
                events |= libc::POLLIN;
            }
            if want & WANT_WRITE != 0 {
                events |= libc::POLLOUT;
            }
            let fd = self.stream(peer)?.as_raw_fd();
            self.pollfds.push(libc::pollfd {
                fd,
                events,
                revents: 0,
            });
            self.polled.push(peer);
        }
        let remaining = deadline.saturating_duration_since(Instant::now());
        let ms = i32::try_from(remaining.as_micros().div_ceil(1000)).unwrap_or(i32::MAX);
        // SAFETY: `pollfds` is a live, initialized array of `pollfds.len()` pollfd structs
        // whose descriptors belong to streams this rank owns for the whole call.
        let rc = unsafe {
            libc::poll(
                self.pollfds.as_mut_ptr(),
                self.pollfds.len() as libc::nfds_t,
                ms,
            )
        };
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                return Ok(());
            }
            let peer = self.polled.first().copied().unwrap_or(self.rank);
            return Err(link_err(self.rank, peer, format!("poll failed: {e}")));
        }
        for (p, &peer) in self.pollfds.iter().zip(&self.polled) {
            if p.revents & libc::POLLNVAL != 0 {
                return Err(link_err(
                    self.rank,
                    peer,
                    "the socket is no longer open".into(),
                ));
            }
        }
        Ok(())
    }
}

/// Builds a mesh of `n` ranks over 127.0.0.1 (ephemeral ports) in this process, for tests
/// and benchmarks: element `r` is rank `r`'s transport.
///
/// # Errors
/// [`CommError::Link`] when a loopback socket cannot be bound or connected.
pub fn tcp_mesh_local(n: usize) -> Result<Vec<TcpTransport>, CommError> {
    let err = |rank: usize, peer: usize, e: std::io::Error| {
        link_err(rank, peer, format!("loopback mesh setup failed: {e}"))
    };
    let listeners = (0..n)
        .map(|r| TcpListener::bind("127.0.0.1:0").map_err(|e| err(r, r, e)))
        .collect::<Result<Vec<_>, _>>()?;
    let mut streams: Vec<Vec<Option<TcpStream>>> =
        (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
    for (hi, lo) in (0..n).flat_map(|hi| (0..hi).map(move |lo| (hi, lo))) {
        let addr = listeners[lo].local_addr().map_err(|e| err(lo, hi, e))?;
        let dialed = TcpStream::connect(addr).map_err(|e| err(hi, lo, e))?;
        let (accepted, _) = listeners[lo].accept().map_err(|e| err(lo, hi, e))?;
        streams[hi][lo] = Some(dialed);
        streams[lo][hi] = Some(accepted);
    }
    streams
        .into_iter()
        .enumerate()
        .map(|(r, s)| TcpTransport::from_streams(r, s))
        .collect()
}

const HELLO_MAGIC: &[u8; 4] = b"HELO";
const HELLO_PAYLOAD: usize = 16;
/// The longest an acceptor waits for a connection's hello before dropping it.
const HELLO_WAIT: Duration = Duration::from_secs(5);

fn hello(rank: usize, world: usize) -> [u8; HEADER_LEN + HELLO_PAYLOAD] {
    let mut m = [0u8; HEADER_LEN + HELLO_PAYLOAD];
    m[..HEADER_LEN].copy_from_slice(&frame::encode(HELLO_PAYLOAD));
    m[16..20].copy_from_slice(HELLO_MAGIC);
    m[20..24].copy_from_slice(&(rank as u32).to_le_bytes());
    m[24..28].copy_from_slice(&(world as u32).to_le_bytes());
    m
}

/// What a hello says: `None` when it is no shoal hello at all (a stray connection).
fn parse_hello(
    m: &[u8; HEADER_LEN + HELLO_PAYLOAD],
    rank: usize,
    world: usize,
) -> Option<Result<usize, CommError>> {
    if m[..4] != frame::MAGIC.to_le_bytes() || &m[16..20] != HELLO_MAGIC {
        return None;
    }
    let claimed = u32::from_le_bytes([m[20], m[21], m[22], m[23]]) as usize;
    let their_world = u32::from_le_bytes([m[24], m[25], m[26], m[27]]) as usize;
    let mut header = [0u8; HEADER_LEN];
    header.copy_from_slice(&m[..HEADER_LEN]);
    if let Err(e) = frame::check(&header, HELLO_PAYLOAD, rank, claimed) {
        return Some(Err(e));
    }
    if their_world != world {
        return Some(Err(CommError::Protocol {
            rank,
            peer: claimed,
            reason: format!(
                "peer believes the world has {their_world} ranks, this rank believes {world}; \
                 give every rank the same address list"
            ),
        }));
    }
    Some(Ok(claimed))
}

/// Builds rank `rank`'s transport of a world whose rank `p` listens on `addrs[p]`: dials
/// every lower rank (retrying until it listens) and accepts every higher one on `listener`
/// (which must be bound to `addrs[rank]`). Each connection opens with a hello frame from the
/// dialer (protocol version, its rank, the world size), checked by the acceptor, which
/// answers with its own. Connections that send no shoal hello are dropped.
///
/// # Errors
/// [`CommError::Timeout`] when a rank cannot be reached or does not connect before
/// `deadline`; [`CommError::Protocol`] when a peer runs another protocol version, another
/// world size or claims a wrong rank; [`CommError::Link`] on socket failures.
pub fn connect_mesh(
    rank: usize,
    listener: TcpListener,
    addrs: &[SocketAddr],
    deadline: Instant,
) -> Result<TcpTransport, CommError> {
    let world = addrs.len();
    if rank >= world {
        return Err(CommError::Usage {
            rank,
            reason: format!("rank {rank} outside a world of {world} addresses"),
        });
    }
    let start = Instant::now();
    let timeout = |peer: usize| CommError::Timeout {
        rank,
        peer,
        deadline_ms: u64::try_from(deadline.saturating_duration_since(start).as_millis())
            .unwrap_or(u64::MAX),
    };
    let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    for (peer, addr) in addrs.iter().enumerate().take(rank) {
        streams[peer] = Some(dial(rank, world, peer, *addr, deadline, timeout)?);
    }
    listener
        .set_nonblocking(true)
        .map_err(|e| link_err(rank, rank, format!("cannot configure the listener: {e}")))?;
    while let Some(missing) = (rank + 1..world).find(|&p| streams[p].is_none()) {
        let (mut s, from) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(timeout(missing));
                }
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(link_err(rank, missing, format!("accept failed: {e}"))),
        };
        let wait = deadline
            .saturating_duration_since(Instant::now())
            .clamp(Duration::from_millis(1), HELLO_WAIT);
        let mut m = [0u8; HEADER_LEN + HELLO_PAYLOAD];
        let got = s
            .set_nonblocking(false)
            .and_then(|()| s.set_read_timeout(Some(wait)))
            .and_then(|()| s.read_exact(&mut m));
        if let Err(e) = got {
            tracing::warn!(rank, %from, "dropped a connection that sent no hello: {e}");
            continue;
        }
        let Some(parsed) = parse_hello(&m, rank, world) else {
            tracing::warn!(rank, %from, "dropped a connection that is not a shoal rank");
            continue;
        };
        let peer = parsed?;
        if peer <= rank || peer >= world {
            return Err(CommError::Protocol {
                rank,
                peer,
                reason: format!(
                    "a peer at {from} claims rank {peer}, but only ranks {}..{world} dial rank \
                     {rank}; check the ranks and address list given to each process",
                    rank + 1
                ),
            });
        }
        if streams[peer].is_some() {
            return Err(CommError::Protocol {
                rank,
                peer,
                reason: format!(
                    "a second process at {from} claims rank {peer}; ranks must be unique"
                ),
            });
        }
        s.write_all(&hello(rank, world))
            .map_err(|e| link_err(rank, peer, format!("cannot answer the hello: {e}")))?;
        streams[peer] = Some(s);
    }
    TcpTransport::from_streams(rank, streams)
}

fn dial(
    rank: usize,
    world: usize,
    peer: usize,
    addr: SocketAddr,
    deadline: Instant,
    timeout: impl Fn(usize) -> CommError,
) -> Result<TcpStream, CommError> {
    let mut s = loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            tracing::warn!(rank, peer, %addr, "gave up dialing");
            return Err(timeout(peer));
        }
        match TcpStream::connect_timeout(&addr, remaining.min(Duration::from_secs(1))) {
            Ok(s) => break s,
            Err(e) => {
                tracing::debug!(rank, peer, %addr, "dial failed, retrying: {e}");
                std::thread::sleep(remaining.min(Duration::from_millis(20)));
            }
        }
    };
    let remaining = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    let mut m = [0u8; HEADER_LEN + HELLO_PAYLOAD];
    let io = s
        .set_nodelay(true)
        .and_then(|()| s.set_read_timeout(Some(remaining)))
        .and_then(|()| s.write_all(&hello(rank, world)))
        .and_then(|()| s.read_exact(&mut m));
    if let Err(e) = io {
        return Err(link_err(
            rank,
            peer,
            format!(
                "hello with {addr} failed ({e}): the process there rejected this rank (see its \
                 log), is not a shoal rank, or did not answer in time"
            ),
        ));
    }
    match parse_hello(&m, rank, world) {
        None => Err(CommError::Protocol {
            rank,
            peer,
            reason: format!("{addr} answered the hello with something that is not shoal"),
        }),
        Some(Err(e)) => Err(e),
        Some(Ok(claimed)) if claimed != peer => Err(CommError::Protocol {
            rank,
            peer,
            reason: format!(
                "{addr} answered as rank {claimed}, expected rank {peer}; the address list \
                 differs between processes"
            ),
        }),
        Some(Ok(_)) => Ok(s),
    }
}
