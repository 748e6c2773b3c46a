//! [`EmulatedLink`]: wraps any [`Transport`] and makes each directed link behave like a
//! slower network, with a one-way latency and a bandwidth cap, so that a world of processes
//! on one machine can be measured as if it were spread over Ethernet or Wi-Fi.
//!
//! Emulation happens at the receiver, so a sender is never blocked: the sender precedes every
//! message with an 8-byte timestamp from `CLOCK_MONOTONIC` (a frame of its own, so the
//! payload still moves straight from the sender's slice into the receiver's buffer), and the receiver, keeping the
//! state of each incoming link, computes when the message would have arrived — transmission
//! starts at `max(timestamp, end of the previous transmission on that link)`, lasts
//! `bytes / bandwidth`, and arrival is its end plus the latency — and hands the message over
//! no earlier (sleeping while far, spinning the last ~50 µs). Timestamps only mean the same
//! thing to sender and receiver on one host, so **all ranks of an emulated world must run
//! on one host**. The real transport's own delay is absorbed when it is below the emulated
//! one. Operation lists are reused, so a warm link does not allocate.

use std::sync::Mutex;
use std::time::Instant;

use crate::clock::{monotonic_ns, wait_until_ns};
use crate::transport::{check_peers, recycle_recvs, recycle_sends, Transport};
use crate::CommError;

/// The bytes of the timestamp sent ahead of every message.
const STAMP: usize = 8;

/// What a directed link looks like.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkSpec {
    /// One-way latency in microseconds.
    pub latency_us: f64,
    /// Bandwidth in Gbit/s; 0 or a non-finite value means unlimited.
    pub gbit_per_s: f64,
}

impl LinkSpec {
    /// A link with `latency_us` of one-way latency and `gbit_per_s` of bandwidth.
    #[must_use]
    pub fn new(latency_us: f64, gbit_per_s: f64) -> Self {
        Self {
            latency_us,
            gbit_per_s,
        }
    }

    fn latency_ns(&self) -> u64 {
        if self.latency_us.is_finite() && self.latency_us > 0.0 {
            (self.latency_us * 1e3) as u64
        } else {
            0
        }
    }

    /// Nanoseconds to put `bytes` on the wire (Gbit/s are bits per nanosecond).
    fn transmit_ns(&self, bytes: usize) -> u64 {
        if self.gbit_per_s.is_finite() && self.gbit_per_s > 0.0 {
            (bytes as f64 * 8.0 / self.gbit_per_s) as u64
        } else {
            0
        }
    }
}

/// A transport whose incoming links are slowed down to a [`LinkSpec`] each.
pub struct EmulatedLink<T> {
    inner: T,
    /// `from[p]`: the link from rank `p` to this rank.
    from: Vec<LinkSpec>,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// The stamps of the messages being received.
    stamps: Vec<[u8; STAMP]>,
    /// Per source rank: when (monotonic ns) its link finishes its last transmission.
    busy_until: Vec<u64>,
    send_list: Vec<(usize, &'static [u8])>,
    recv_list: Vec<(usize, &'static mut [u8])>,
}

impl<T: Transport> EmulatedLink<T> {
    /// Emulates `spec` on every link into this rank.
    #[must_use]
    pub fn new(inner: T, spec: LinkSpec) -> Self {
        let n = inner.world_size();
        Self::build(inner, vec![spec; n])
    }

    /// Emulates `from[p]` on the link from rank `p` into this rank (`from[rank]` is unused).
    ///
    /// # Errors
    /// [`CommError::Usage`] when `from` does not have one entry per rank.
    pub fn with_links(inner: T, from: Vec<LinkSpec>) -> Result<Self, CommError> {
        if from.len() != inner.world_size() {
            return Err(CommError::Usage {
                rank: inner.rank(),
                reason: format!(
                    "{} link specs for a world of {} ranks; give one per source rank",
                    from.len(),
                    inner.world_size()
                ),
            });
        }
        Ok(Self::build(inner, from))
    }

    fn build(inner: T, from: Vec<LinkSpec>) -> Self {
        let n = from.len();
        Self {
            inner,
            from,
            state: Mutex::new(State {
                busy_until: vec![0; n],
                ..State::default()
            }),
        }
    }

    /// The wrapped transport.
    pub fn inner(&self) -> &T {
        &self.inner
    }
}

impl<T: Transport> Transport for EmulatedLink<T> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn exchange(
        &self,
        sends: &[(usize, &[u8])],
        recvs: &mut [(usize, &mut [u8])],
        deadline: Instant,
    ) -> Result<(), CommError> {
        let rank = self.rank();
        check_peers(rank, self.world_size(), sends, recvs)?;
        let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let State {
            stamps,
            busy_until,
            send_list,
            recv_list,
        } = &mut *guard;
        // Each message goes as two frames to its peer, in FIFO order: the sender's stamp,
        // then the payload straight from (and into) the caller's buffers.
        let stamp = monotonic_ns().to_le_bytes();
        let mut sl = recycle_sends(std::mem::take(send_list));
        for (p, data) in sends {
            sl.push((*p, &stamp[..]));
            sl.push((*p, *data));
        }
        stamps.resize(recvs.len(), [0; STAMP]);
        let mut rl = recycle_recvs(std::mem::take(recv_list));
        for ((p, buf), st) in recvs.iter_mut().zip(stamps.iter_mut()) {
            rl.push((*p, &mut st[..]));
            rl.push((*p, &mut **buf));
        }
        let result = self.inner.exchange(&sl, &mut rl, deadline);
        *send_list = recycle_sends(sl);
        *recv_list = recycle_recvs(rl);
        result?;

        let mut arrival_max = 0u64;
        for (st, (peer, r)) in stamps.iter().zip(recvs.iter()) {
            // Never trust the wire: a stamp from the future is taken as "now".
            let sent = u64::from_le_bytes(*st).min(monotonic_ns());
            let spec = &self.from[*peer];
            let start = sent.max(busy_until[*peer]);
            let end = start.saturating_add(spec.transmit_ns(r.len()));
            busy_until[*peer] = end;
            arrival_max = arrival_max.max(end.saturating_add(spec.latency_ns()));
        }
        let now_ns = monotonic_ns();
        let left = deadline.saturating_duration_since(Instant::now());
        let deadline_ns = now_ns.saturating_add(u64::try_from(left.as_nanos()).unwrap_or(u64::MAX));
        if arrival_max > deadline_ns {
            wait_until_ns(deadline_ns);
            let peer = recvs.first().map_or(rank, |r| r.0);
            return Err(CommError::Timeout {
                rank,
                peer,
                deadline_ms: u64::try_from(left.as_millis()).unwrap_or(u64::MAX),
            });
        }
        wait_until_ns(arrival_max);
        Ok(())
    }
}
