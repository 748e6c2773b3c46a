//! The engine behind `exchange` for byte-stream transports (TCP sockets, shared-memory
//! rings). A transport supplies non-blocking "write/read as much as you can" on each link
//! and a way to wait for readiness; [`Driver::drive`] frames every message (see
//! [`crate::frame`]), keeps sends and receives to one peer in FIFO order, progresses every
//! link in turn until all operations are done, and turns a missed deadline into
//! [`CommError::Timeout`]. Bytes move straight between the caller's slices and the link; the
//! operation lists are kept between calls, so a warm driver does not allocate.

use std::time::{Duration, Instant};

use crate::frame::{self, HEADER_LEN};
use crate::CommError;

/// `interest` bit: the active receive from this peer waits for bytes.
pub(crate) const WANT_READ: u8 = 1;
/// `interest` bit: the active send to this peer waits for room.
pub(crate) const WANT_WRITE: u8 = 2;

/// Non-blocking access to the links of one rank.
pub(crate) trait Streams {
    /// Writes a prefix of `a` followed by `b` to `peer`; returns the bytes written, 0 when
    /// the link has no room now.
    fn write2(&mut self, peer: usize, a: &[u8], b: &[u8]) -> Result<usize, CommError>;
    /// Reads from `peer` into `a` then `b`; returns the bytes read, 0 when none are waiting.
    fn read2(&mut self, peer: usize, a: &mut [u8], b: &mut [u8]) -> Result<usize, CommError>;
    /// Waits, at most until `deadline`, until a link marked in `interest` (indexed by peer,
    /// bits [`WANT_READ`], [`WANT_WRITE`]) may progress. `idle` is how long the exchange has
    /// gone without progress. May return early; the driver retries.
    fn wait(&mut self, interest: &[u8], deadline: Instant, idle: Duration)
        -> Result<(), CommError>;
}

struct Op {
    peer: usize,
    header: [u8; HEADER_LEN],
    /// Bytes of header plus payload done so far.
    done: usize,
    finished: bool,
}

/// Operation lists kept between calls.
#[derive(Default)]
pub(crate) struct Driver {
    sends: Vec<Op>,
    recvs: Vec<Op>,
    interest: Vec<u8>,
}

impl Driver {
    /// Runs one exchange over `io`. Peers must have been checked by the caller.
    pub(crate) fn drive<S: Streams>(
        &mut self,
        io: &mut S,
        rank: usize,
        world: usize,
        sends: &[(usize, &[u8])],
        recvs: &mut [(usize, &mut [u8])],
        deadline: Instant,
    ) -> Result<(), CommError> {
        let start = Instant::now();
        self.sends.clear();
        self.sends.extend(sends.iter().map(|(peer, data)| Op {
            peer: *peer,
            header: frame::encode(data.len()),
            done: 0,
            finished: false,
        }));
        self.recvs.clear();
        self.recvs.extend(recvs.iter().map(|(peer, _)| Op {
            peer: *peer,
            header: [0; HEADER_LEN],
            done: 0,
            finished: false,
        }));
        self.interest.clear();
        self.interest.resize(world, 0);
        let mut idle_since: Option<Instant> = None;
        loop {
            self.interest.fill(0);
            let mut progress = false;
            let mut pending = false;
            for (op, (_, data)) in self.sends.iter_mut().zip(sends) {
                if op.finished {
                    continue;
                }
                pending = true;
                if self.interest[op.peer] & WANT_WRITE != 0 {
                    continue; // an earlier message to this peer is still on its way
                }
                let total = HEADER_LEN + data.len();
                while op.done < total {
                    let n = if op.done < HEADER_LEN {
                        io.write2(op.peer, &op.header[op.done..], data)?
                    } else {
                        io.write2(op.peer, &[], &data[op.done - HEADER_LEN..])?
                    };
                    if n == 0 {
                        break;
                    }
                    op.done += n;
                    progress = true;
                }
                if op.done == total {
                    op.finished = true;
                } else {
                    self.interest[op.peer] |= WANT_WRITE;
                }
            }
            for (op, (_, buf)) in self.recvs.iter_mut().zip(recvs.iter_mut()) {
                if op.finished {
                    continue;
                }
                pending = true;
                if self.interest[op.peer] & WANT_READ != 0 {
                    continue; // an earlier message from this peer is still arriving
                }
                let total = HEADER_LEN + buf.len();
                while op.done < total {
                    let in_header = op.done < HEADER_LEN;
                    let n = if in_header {
                        io.read2(op.peer, &mut op.header[op.done..], buf)?
                    } else {
                        io.read2(op.peer, &mut [], &mut buf[op.done - HEADER_LEN..])?
                    };
                    if n == 0 {
                        break;
                    }
                    op.done += n;
                    progress = true;
                    if in_header && op.done >= HEADER_LEN {
                        frame::check(&op.header, buf.len(), rank, op.peer)?;
                    }
                }
                if op.done == total {
                    op.finished = true;
                } else {
                    self.interest[op.peer] |= WANT_READ;
                }
            }
            if !pending {
                return Ok(());
            }
            if progress {
                idle_since = None;
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(self.timeout(rank, deadline.saturating_duration_since(start)));
            }
            let idle = now - *idle_since.get_or_insert(now);
            io.wait(&self.interest, deadline, idle)?;
        }
    }

    /// The timeout error, naming the first peer still owing a message (or room).
    fn timeout(&self, rank: usize, waited: Duration) -> CommError {
        let peer = self
            .recvs
            .iter()
            .chain(&self.sends)
            .find(|op| !op.finished)
            .map_or(rank, |op| op.peer);
        CommError::Timeout {
            rank,
            peer,
            deadline_ms: u64::try_from(waited.as_millis()).unwrap_or(u64::MAX),
        }
    }
}
