//! [`ShmTransport`]: ranks in different processes of one host, talking through one
//! shared-memory file (under `/dev/shm` by default) that every rank maps. The file holds a
//! header and one single-producer/single-consumer byte ring per directed pair of ranks; a
//! ring's `head` (bytes ever written, advanced by the sender) and `tail` (bytes ever read,
//! advanced by the receiver) are atomics published with release and read with acquire
//! ordering, so the bytes between them are visible to the other side. Messages are framed
//! like on TCP and stream through the ring in pieces when larger than it. `exchange` spins
//! (`spin_loop`) for the first ~20 µs of waiting, then yields the CPU, and after ~5 ms of
//! waiting sleeps 50 µs at a time, until done or the deadline.
//!
//! **Joining.** Every rank calls [`ShmTransport::join`] with the same path, world size and
//! ring size. Rank 0 creates the file under a temporary name, sizes it, writes the header
//! (magic, protocol version, world size, ring size, its pid), sets a ready flag and renames
//! it into place; the other ranks wait for the file, check the header (a different version,
//! world or ring size is a [`CommError::Protocol`] error naming both values) and claim their
//! rank's slot. The last rank to join removes the file's name, so nothing is left in
//! `/dev/shm` once the world runs (and a dropped transport removes it if still there). A
//! file left by a dead world (its creator's process is gone) is ignored until rank 0
//! replaces it. Use one path per world.
//!
//! **Failures.** A peer that drops its transport, or whose exchange fails, raises its
//! `closed` flag, and its peers fail with [`CommError::Link`] once they have read what it
//! sent before. A peer process that dies cannot raise the flag; while waiting, ranks check
//! every ~10 ms whether their peers' processes still exist (`kill(pid, 0)`, when in the same
//! pid namespace), and otherwise the deadline catches it as [`CommError::Timeout`].
//! Ring indices read from shared memory are validated, so a corrupt peer cannot make this
//! rank read or write outside the file.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use memmap2::MmapRaw;

use crate::frame::PROTOCOL_VERSION;
use crate::stream::{Driver, Streams, WANT_READ};
use crate::transport::{broken, check_peers, Transport};
use crate::CommError;

/// Ring size used by [`shm_mesh_local`] callers that have no better idea: 256 KiB per
/// directed pair.
pub const DEFAULT_RING_BYTES: usize = 256 << 10;

const FILE_MAGIC: u64 = u64::from_le_bytes(*b"SHOALSHM");
const MAX_WORLD: usize = 1024;
const MIN_RING: usize = 4096;
const MAX_RING: usize = 1 << 30;
const PAGE: usize = 4096;

// Header fields (byte offsets).
const H_MAGIC: usize = 0;
const H_VERSION: usize = 8;
const H_WORLD: usize = 12;
const H_RING: usize = 16;
const H_READY: usize = 24;
const H_JOINED: usize = 28;
const H_CREATOR_PID: usize = 32;
const H_CREATOR_NS: usize = 40;
// Per-rank slots, one cache line each.
const SLOTS_AT: usize = 64;
const SLOT: usize = 64;
const S_PID: usize = 0;
const S_CLOSED: usize = 4;
const S_PIDNS: usize = 8;
// Each ring: head and tail on their own cache lines, then the data.
const CTRL: usize = 128;
const R_HEAD: usize = 0;
const R_TAIL: usize = 64;

const SPIN_FOR: Duration = Duration::from_micros(2);
const YIELD_FOR: Duration = Duration::from_millis(5);
const NAP: Duration = Duration::from_micros(50);
const LIVENESS_EVERY: Duration = Duration::from_millis(10);

/// Sizes of a world's file.
#[derive(Clone, Copy)]
struct Layout {
    world: usize,
    ring: usize,
    header: usize,
}

impl Layout {
    fn new(world: usize, ring: usize) -> Self {
        let header = (SLOTS_AT + SLOT * world).div_ceil(PAGE) * PAGE;
        Self {
            world,
            ring,
            header,
        }
    }

    fn total(&self) -> usize {
        self.header + self.world * self.world.saturating_sub(1) * (CTRL + self.ring)
    }

    /// Offset of the ring carrying bytes from `from` to `to` (`from != to`).
    fn ring_at(&self, from: usize, to: usize) -> usize {
        let idx = from * (self.world - 1) + if to < from { to } else { to - 1 };
        self.header + idx * (CTRL + self.ring)
    }
}

/// A mapping of a world's file, with typed access to its atomics.
struct Mapping {
    map: MmapRaw,
}

impl Mapping {
    fn u32_at(&self, off: usize) -> &AtomicU32 {
        assert!(
            off.is_multiple_of(4) && off + 4 <= self.map.len(),
            "shm offset {off} out of range"
        );
        // SAFETY: the offset is in bounds and 4-aligned (the mapping is page-aligned), the
        // mapping lives as long as `self`, and every process touches this word only through
        // atomics, so a shared reference to an AtomicU32 there is sound.
        unsafe { &*self.map.as_mut_ptr().add(off).cast::<AtomicU32>() }
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        assert!(
            off.is_multiple_of(8) && off + 8 <= self.map.len(),
            "shm offset {off} out of range"
        );
        // SAFETY: as in `u32_at`, with 8-byte alignment.
        unsafe { &*self.map.as_mut_ptr().add(off).cast::<AtomicU64>() }
    }
}

/// One rank of a shared-memory world.
pub struct ShmTransport {
    rank: usize,
    layout: Layout,
    mapping: Mapping,
    path: PathBuf,
    ident: (u64, u64),
    my_pid: u32,
    my_ns: u64,
    inner: Mutex<Inner>,
}

struct Inner {
    driver: Driver,
    broken: Option<String>,
    last_liveness: Instant,
}

fn protocol(rank: usize, peer: usize, reason: String) -> CommError {
    CommError::Protocol { rank, peer, reason }
}

fn link(rank: usize, peer: usize, reason: String) -> CommError {
    CommError::Link { rank, peer, reason }
}

/// The pid namespace of this process (0 when unknown): pids are only comparable within one.
fn pid_namespace() -> u64 {
    std::fs::read_link("/proc/self/ns/pid")
        .ok()
        .and_then(|p| {
            let s = p.to_string_lossy().into_owned();
            let digits: String = s.chars().filter(char::is_ascii_digit).collect();
            digits.parse().ok()
        })
        .unwrap_or(0)
}

/// Whether process `pid` is known to be gone (false when unsure).
fn process_gone(pid: u32, ns: u64, my_ns: u64) -> bool {
    if pid == 0 || ns == 0 || ns != my_ns {
        return false;
    }
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 performs no action; kill only checks that the process exists.
    let rc = unsafe { libc::kill(pid, 0) };
    rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

fn file_ident(f: &File) -> std::io::Result<(u64, u64)> {
    let m = f.metadata()?;
    Ok((m.dev(), m.ino()))
}

impl ShmTransport {
    /// Joins rank `rank` of a `world`-rank world whose file is `path` (rank 0 creates it,
    /// the others wait for it until `deadline`). `ring_bytes` per directed pair is rounded up
    /// to a power of two in 4 KiB..=1 GiB and must be the same on every rank.
    ///
    /// # Errors
    /// [`CommError::Usage`] for a rank outside the world or a world of more than 1024 ranks;
    /// [`CommError::Protocol`] when the file was made for another protocol version, world or
    /// ring size, or the rank is already taken; [`CommError::Timeout`] when rank 0's file
    /// does not appear before `deadline`; [`CommError::Link`] when the file cannot be made.
    pub fn join(
        path: impl AsRef<Path>,
        rank: usize,
        world: usize,
        ring_bytes: usize,
        deadline: Instant,
    ) -> Result<Self, CommError> {
        let path = path.as_ref().to_path_buf();
        if world == 0 || world > MAX_WORLD || rank >= world {
            return Err(CommError::Usage {
                rank,
                reason: format!(
                    "rank {rank} of a world of {world}: need rank < world <= {MAX_WORLD}"
                ),
            });
        }
        let ring = ring_bytes.clamp(MIN_RING, MAX_RING).next_power_of_two();
        let layout = Layout::new(world, ring);
        let my_pid = std::process::id();
        let my_ns = pid_namespace();
        let (file, mapping) = if rank == 0 {
            Self::create(&path, layout, my_pid, my_ns)?
        } else {
            Self::open(&path, rank, layout, my_ns, deadline)?
        };
        let ident = file_ident(&file)
            .map_err(|e| link(rank, 0, format!("cannot stat {}: {e}", path.display())))?;
        let t = Self {
            rank,
            layout,
            mapping,
            path,
            ident,
            my_pid,
            my_ns,
            inner: Mutex::new(Inner {
                driver: Driver::default(),
                broken: None,
                last_liveness: Instant::now(),
            }),
        };
        let slot = SLOTS_AT + SLOT * rank;
        if let Err(owner) = t.mapping.u32_at(slot + S_PID).compare_exchange(
            0,
            my_pid,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            return Err(protocol(
                rank,
                rank,
                format!(
                    "rank {rank} of {} was already joined by process {owner}; give every \
                     process its own rank (or a fresh path for a new world)",
                    t.path.display()
                ),
            ));
        }
        t.mapping
            .u64_at(slot + S_PIDNS)
            .store(my_ns, Ordering::Release);
        let joined = t.mapping.u32_at(H_JOINED).fetch_add(1, Ordering::AcqRel) + 1;
        if joined as usize == world {
            t.unlink_if_ours();
        }
        Ok(t)
    }

    fn create(
        path: &Path,
        layout: Layout,
        pid: u32,
        ns: u64,
    ) -> Result<(File, Mapping), CommError> {
        let fail = |what: &str, e: std::io::Error| {
            link(
                0,
                0,
                format!("cannot {what} shared-memory file {}: {e}", path.display()),
            )
        };
        let name = path
            .file_name()
            .map_or_else(|| "shoal".into(), |n| n.to_string_lossy().into_owned());
        static SEQ: AtomicUsize = AtomicUsize::new(0);
        let tmp = path.with_file_name(format!(
            ".{name}.tmp.{pid}.{}",
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(|e| fail("create", e))?;
        let made = (|| {
            file.set_len(layout.total() as u64)?;
            MmapRaw::map_raw(&file)
        })();
        let map = match made {
            Ok(m) => m,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(fail("size", e));
            }
        };
        let m = Mapping { map };
        m.u32_at(H_VERSION)
            .store(u32::from(PROTOCOL_VERSION), Ordering::Relaxed);
        m.u32_at(H_WORLD)
            .store(layout.world as u32, Ordering::Relaxed);
        m.u64_at(H_RING)
            .store(layout.ring as u64, Ordering::Relaxed);
        m.u32_at(H_CREATOR_PID).store(pid, Ordering::Relaxed);
        m.u64_at(H_CREATOR_NS).store(ns, Ordering::Relaxed);
        m.u64_at(H_MAGIC).store(FILE_MAGIC, Ordering::Relaxed);
        m.u32_at(H_READY).store(1, Ordering::Release);
        if let Err(e) = std::fs::rename(&tmp, path) {
            let _ = std::fs::remove_file(&tmp);
            return Err(fail("publish", e));
        }
        Ok((file, m))
    }

    fn open(
        path: &Path,
        rank: usize,
        layout: Layout,
        my_ns: u64,
        deadline: Instant,
    ) -> Result<(File, Mapping), CommError> {
        let start = Instant::now();
        loop {
            if Instant::now() >= deadline {
                return Err(CommError::Timeout {
                    rank,
                    peer: 0,
                    deadline_ms: u64::try_from(
                        deadline.saturating_duration_since(start).as_millis(),
                    )
                    .unwrap_or(u64::MAX),
                });
            }
            let retry = || std::thread::sleep(Duration::from_millis(1));
            let file = match OpenOptions::new().read(true).write(true).open(path) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    retry();
                    continue;
                }
                Err(e) => {
                    return Err(link(
                        rank,
                        0,
                        format!("cannot open {}: {e}", path.display()),
                    ));
                }
            };
            let len = file.metadata().map(|m| m.len()).unwrap_or(0);
            if len < PAGE as u64 {
                retry();
                continue;
            }
            let map = MmapRaw::map_raw(&file)
                .map_err(|e| link(rank, 0, format!("cannot map {}: {e}", path.display())))?;
            let m = Mapping { map };
            if m.u64_at(H_MAGIC).load(Ordering::Acquire) != FILE_MAGIC
                || m.u32_at(H_READY).load(Ordering::Acquire) != 1
            {
                retry();
                continue;
            }
            let creator = m.u32_at(H_CREATOR_PID).load(Ordering::Relaxed);
            if process_gone(
                creator,
                m.u64_at(H_CREATOR_NS).load(Ordering::Relaxed),
                my_ns,
            ) {
                retry(); // left over from a dead world; rank 0 will replace it
                continue;
            }
            let version = m.u32_at(H_VERSION).load(Ordering::Relaxed);
            if version != u32::from(PROTOCOL_VERSION) {
                return Err(protocol(
                    rank,
                    0,
                    format!(
                        "{} was made for protocol version {version}, this rank speaks version \
                         {PROTOCOL_VERSION}; run the same shoal build on every rank",
                        path.display()
                    ),
                ));
            }
            let world = m.u32_at(H_WORLD).load(Ordering::Relaxed) as usize;
            let ring = m.u64_at(H_RING).load(Ordering::Relaxed);
            if world != layout.world || ring != layout.ring as u64 {
                return Err(protocol(
                    rank,
                    0,
                    format!(
                        "{} was made for {world} ranks with {ring}-byte rings, this rank expects \
                         {} ranks with {}-byte rings; give every rank the same settings",
                        path.display(),
                        layout.world,
                        layout.ring
                    ),
                ));
            }
            if len != layout.total() as u64 {
                return Err(protocol(
                    rank,
                    0,
                    format!(
                        "{} has {len} bytes, expected {}: it is not a shoal world file",
                        path.display(),
                        layout.total()
                    ),
                ));
            }
            return Ok((file, m));
        }
    }

    /// The file's path (its name is removed once every rank has joined).
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn unlink_if_ours(&self) {
        let same = std::fs::metadata(&self.path).is_ok_and(|m| (m.dev(), m.ino()) == self.ident);
        if same {
            let _ = std::fs::remove_file(&self.path);
        }
    }

    fn closed_flag(&self, rank: usize) -> &AtomicU32 {
        self.mapping.u32_at(SLOTS_AT + SLOT * rank + S_CLOSED)
    }

    fn close(&self) {
        self.closed_flag(self.rank).store(1, Ordering::Release);
    }

    fn ring(&self, from: usize, to: usize) -> Ring<'_> {
        let at = self.layout.ring_at(from, to);
        assert!(
            at + CTRL + self.layout.ring <= self.mapping.map.len(),
            "ring outside the file"
        );
        Ring {
            head: self.mapping.u64_at(at + R_HEAD),
            tail: self.mapping.u64_at(at + R_TAIL),
            // SAFETY: `at + CTRL .. at + CTRL + ring` lies inside the mapping (asserted above).
            data: unsafe { self.mapping.map.as_mut_ptr().add(at + CTRL) },
            cap: self.layout.ring,
        }
    }
}

impl Drop for ShmTransport {
    fn drop(&mut self) {
        self.close();
        self.unlink_if_ours();
    }
}

/// One directed ring. `data` points at `cap` bytes (a power of two) inside the mapping.
struct Ring<'a> {
    head: &'a AtomicU64,
    tail: &'a AtomicU64,
    data: *mut u8,
    cap: usize,
}

impl Ring<'_> {
    /// Copies `src` (at most `cap` bytes) into the ring at stream position `pos`.
    fn copy_in(&self, pos: u64, src: &[u8]) {
        let at = (pos as usize) & (self.cap - 1);
        let first = src.len().min(self.cap - at);
        // SAFETY: `at + first <= cap` and `src.len() - first <= cap - first`, so both copies
        // stay inside the ring; the producer owns bytes `head..tail + cap` of the stream, so
        // the consumer does not touch them until `head` is published with release ordering.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.data.add(at), first);
            std::ptr::copy_nonoverlapping(src.as_ptr().add(first), self.data, src.len() - first);
        }
    }

    /// Copies ring bytes at stream position `pos` into `dst` (at most `cap` bytes).
    fn copy_out(&self, pos: u64, dst: &mut [u8]) {
        let at = (pos as usize) & (self.cap - 1);
        let first = dst.len().min(self.cap - at);
        // SAFETY: bounds as in `copy_in`; bytes `tail..head` were published by the producer
        // (acquire load of `head`) and it does not overwrite them until `tail` moves past.
        unsafe {
            std::ptr::copy_nonoverlapping(self.data.add(at), dst.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(
                self.data,
                dst.as_mut_ptr().add(first),
                dst.len() - first,
            );
        }
    }
}

struct ShmIo<'a> {
    t: &'a ShmTransport,
    last_liveness: &'a mut Instant,
}

impl ShmIo<'_> {
    fn corrupt(&self, peer: usize, what: &str, used: u64) -> CommError {
        protocol(
            self.t.rank,
            peer,
            format!(
                "the {what} ring holds {used} bytes, more than its {} bytes: shared memory was \
                 corrupted (another program wrote to the file?); restart every rank",
                self.t.layout.ring
            ),
        )
    }
}

impl Streams for ShmIo<'_> {
    fn write2(&mut self, peer: usize, a: &[u8], b: &[u8]) -> Result<usize, CommError> {
        let r = self.t.ring(self.t.rank, peer);
        let head = r.head.load(Ordering::Relaxed);
        let tail = r.tail.load(Ordering::Acquire);
        let used = head.wrapping_sub(tail);
        if used > r.cap as u64 {
            return Err(self.corrupt(peer, "outgoing", used));
        }
        let free = r.cap - used as usize;
        let na = a.len().min(free);
        let nb = b.len().min(free - na);
        if na + nb == 0 {
            return Ok(0);
        }
        r.copy_in(head, &a[..na]);
        r.copy_in(head.wrapping_add(na as u64), &b[..nb]);
        r.head
            .store(head.wrapping_add((na + nb) as u64), Ordering::Release);
        Ok(na + nb)
    }

    fn read2(&mut self, peer: usize, a: &mut [u8], b: &mut [u8]) -> Result<usize, CommError> {
        let r = self.t.ring(peer, self.t.rank);
        let tail = r.tail.load(Ordering::Relaxed);
        let head = r.head.load(Ordering::Acquire);
        let avail = head.wrapping_sub(tail);
        if avail > r.cap as u64 {
            return Err(self.corrupt(peer, "incoming", avail));
        }
        let avail = avail as usize;
        let na = a.len().min(avail);
        let nb = b.len().min(avail - na);
        if na + nb == 0 {
            return Ok(0);
        }
        r.copy_out(tail, &mut a[..na]);
        r.copy_out(tail.wrapping_add(na as u64), &mut b[..nb]);
        r.tail
            .store(tail.wrapping_add((na + nb) as u64), Ordering::Release);
        Ok(na + nb)
    }

    fn wait(
        &mut self,
        interest: &[u8],
        deadline: Instant,
        idle: Duration,
    ) -> Result<(), CommError> {
        let t = self.t;
        for (peer, &want) in interest.iter().enumerate() {
            if want == 0 || t.closed_flag(peer).load(Ordering::Acquire) == 0 {
                continue;
            }
            // Deliver what the peer sent before it closed.
            if want & WANT_READ != 0 {
                let r = t.ring(peer, t.rank);
                if r.head.load(Ordering::Acquire) != r.tail.load(Ordering::Relaxed) {
                    return Ok(());
                }
            }
            return Err(link(
                t.rank,
                peer,
                "the peer closed its shared-memory transport (it was dropped or failed); check \
                 that rank's log"
                    .into(),
            ));
        }
        if idle < SPIN_FOR {
            for _ in 0..16 {
                std::hint::spin_loop();
            }
            return Ok(());
        }
        let now = Instant::now();
        if now.duration_since(*self.last_liveness) >= LIVENESS_EVERY {
            *self.last_liveness = now;
            for (peer, &want) in interest.iter().enumerate() {
                if want == 0 {
                    continue;
                }
                let slot = SLOTS_AT + SLOT * peer;
                let pid = t.mapping.u32_at(slot + S_PID).load(Ordering::Acquire);
                let ns = t.mapping.u64_at(slot + S_PIDNS).load(Ordering::Acquire);
                if pid != t.my_pid && process_gone(pid, ns, t.my_ns) {
                    return Err(link(
                        t.rank,
                        peer,
                        format!("the peer's process {pid} is gone (it exited or crashed)"),
                    ));
                }
            }
        }
        if idle < YIELD_FOR {
            std::thread::yield_now();
        } else {
            std::thread::sleep(NAP.min(deadline.saturating_duration_since(now)));
        }
        Ok(())
    }
}

impl Transport for ShmTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.layout.world
    }

    fn exchange(
        &self,
        sends: &[(usize, &[u8])],
        recvs: &mut [(usize, &mut [u8])],
        deadline: Instant,
    ) -> Result<(), CommError> {
        check_peers(self.rank, self.layout.world, sends, recvs)?;
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let Inner {
            driver,
            broken: why,
            last_liveness,
        } = &mut *guard;
        if let Some(why) = why {
            return Err(broken(self.rank, why, sends, recvs));
        }
        let mut io = ShmIo {
            t: self,
            last_liveness,
        };
        let result = driver.drive(
            &mut io,
            self.rank,
            self.layout.world,
            sends,
            recvs,
            deadline,
        );
        if let Err(e) = &result {
            *why = Some(e.to_string());
            self.close();
        }
        result
    }
}

/// A directory for shared-memory files: `/dev/shm` when present, else the temp directory.
fn shm_dir() -> PathBuf {
    let dev_shm = Path::new("/dev/shm");
    if dev_shm.is_dir() {
        dev_shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

/// Builds a shared-memory world of `n` ranks inside this process (threads), with a fresh
/// file under `/dev/shm`, for tests and benchmarks: element `r` is rank `r`'s transport.
///
/// # Errors
/// As [`ShmTransport::join`].
pub fn shm_mesh_local(n: usize, ring_bytes: usize) -> Result<Vec<ShmTransport>, CommError> {
    static SEQ: AtomicUsize = AtomicUsize::new(0);
    let path = shm_dir().join(format!(
        "shoal-mesh-{}-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed),
        crate::clock::monotonic_ns()
    ));
    let deadline = Instant::now() + Duration::from_secs(10);
    (0..n)
        .map(|r| ShmTransport::join(&path, r, n, ring_bytes, deadline))
        .collect()
}
