//! [`MemTransport`]: ranks that are threads of one process, for tests. Every directed pair
//! of ranks has a queue of messages; sends copy into the queue and never block; receives wait
//! on a condition variable until their message, a closed peer, or the deadline. Dropping a
//! transport (or a failed exchange) closes it, and its peers then fail with
//! [`CommError::Link`] once they have taken every message it sent before closing.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use crate::frame;
use crate::transport::{broken, check_peers, Transport};
use crate::CommError;

struct World {
    n: usize,
    state: Mutex<State>,
    changed: Condvar,
}

struct State {
    /// `queues[from * n + to]`: messages from `from` not yet taken by `to`.
    queues: Vec<VecDeque<Vec<u8>>>,
    /// Why each rank closed, if it did.
    closed: Vec<Option<String>>,
}

/// One rank of an in-process world made by [`mem_mesh`].
pub struct MemTransport {
    rank: usize,
    world: Arc<World>,
}

/// Builds an in-process world of `n` ranks; element `r` is rank `r`'s transport.
#[must_use]
pub fn mem_mesh(n: usize) -> Vec<MemTransport> {
    let world = Arc::new(World {
        n,
        state: Mutex::new(State {
            queues: (0..n * n).map(|_| VecDeque::new()).collect(),
            closed: vec![None; n],
        }),
        changed: Condvar::new(),
    });
    (0..n)
        .map(|rank| MemTransport {
            rank,
            world: Arc::clone(&world),
        })
        .collect()
}

impl MemTransport {
    fn close(&self, why: String) {
        let mut st = self.world.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.closed[self.rank].is_none() {
            st.closed[self.rank] = Some(why);
        }
        drop(st);
        self.world.changed.notify_all();
    }
}

impl Drop for MemTransport {
    fn drop(&mut self) {
        self.close("dropped".into());
    }
}

impl Transport for MemTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world.n
    }

    fn exchange(
        &self,
        sends: &[(usize, &[u8])],
        recvs: &mut [(usize, &mut [u8])],
        deadline: Instant,
    ) -> Result<(), CommError> {
        let (me, n) = (self.rank, self.world.n);
        check_peers(me, n, sends, recvs)?;
        let start = Instant::now();
        let mut st = self.world.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(why) = &st.closed[me] {
            return Err(broken(me, why, sends, recvs));
        }
        for (peer, data) in sends {
            st.queues[me * n + peer].push_back(data.to_vec());
        }
        drop(st);
        self.world.changed.notify_all();
        let result = self.receive(recvs, start, deadline);
        if let Err(e) = &result {
            self.close(e.to_string());
        }
        result
    }
}

impl MemTransport {
    fn receive(
        &self,
        recvs: &mut [(usize, &mut [u8])],
        start: Instant,
        deadline: Instant,
    ) -> Result<(), CommError> {
        let (me, n) = (self.rank, self.world.n);
        let mut st = self.world.state.lock().unwrap_or_else(|e| e.into_inner());
        for (peer, buf) in recvs.iter_mut() {
            let peer = *peer;
            loop {
                if let Some(msg) = st.queues[peer * n + me].pop_front() {
                    if msg.len() != buf.len() {
                        return Err(frame::length_mismatch(
                            me,
                            peer,
                            msg.len() as u64,
                            buf.len(),
                        ));
                    }
                    buf.copy_from_slice(&msg);
                    break;
                }
                if let Some(why) = &st.closed[peer] {
                    return Err(CommError::Link {
                        rank: me,
                        peer,
                        reason: format!("the peer closed its transport ({why})"),
                    });
                }
                let now = Instant::now();
                if now >= deadline {
                    return Err(CommError::Timeout {
                        rank: me,
                        peer,
                        deadline_ms: u64::try_from((deadline - start).as_millis())
                            .unwrap_or(u64::MAX),
                    });
                }
                st = self
                    .world
                    .changed
                    .wait_timeout(st, deadline - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
        Ok(())
    }
}
