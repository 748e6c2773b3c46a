//! The ranks of a placed instance talk over cluster sessions: [`SessionTransport`] is a
//! [`shoal_comm::Transport`] whose links are authenticated (cluster secret) and, unless the
//! cluster runs with data-plane encryption off, encrypted sessions, one per pair of ranks.
//!
//! Each link is a session split in two tokio tasks: a writer that sends the messages queued by
//! `exchange`, and a reader that hands every received message to the rank's thread through a
//! channel. `exchange` (called on the rank's own, non-async thread) queues its sends, then
//! fills each receive buffer from its peer's byte stream, waiting at most until the deadline.
//! Sends never wait for the peer, so no collective step deadlocks on full buffers. Message
//! boundaries do not matter: a receive takes exactly its length from the peer's stream.
//!
//! [`SessionTransport::close`] ends every link at once; a rank thread waiting in `exchange`
//! then gets an error naming the reason. The instance driver closes the mesh when one of its
//! nodes dies, so surviving ranks stop without waiting for a timeout.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Mutex};
use std::time::Instant;

use shoal_comm::{CommError, Transport};
use tokio::sync::mpsc as tmpsc;
use tokio::task::JoinHandle;

use crate::session::Session;

/// What a reader task hands the rank thread: a message, or why the link ended.
type Incoming = Result<Vec<u8>, String>;

struct Link {
    peer_node: String,
    out: tmpsc::UnboundedSender<Vec<u8>>,
    rx: Mutex<Inbox>,
    tasks: [JoinHandle<()>; 2],
}

struct Inbox {
    rx: mpsc::Receiver<Incoming>,
    /// The message being consumed and how far.
    current: Vec<u8>,
    pos: usize,
}

/// One rank's end of a mesh of cluster sessions.
pub struct SessionTransport {
    rank: usize,
    world: usize,
    links: Vec<Option<Link>>,
    closed: AtomicBool,
    reason: Mutex<Option<String>>,
    /// The node of the first link whose session broke or ended.
    broken: Mutex<Option<String>>,
}

impl std::fmt::Debug for SessionTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SessionTransport(rank {} of {})", self.rank, self.world)
    }
}

impl SessionTransport {
    /// Rank `rank` of a world whose links are `sessions[p]` (the session to rank `p`, with
    /// the node id it leads to; `None` only at `rank`). Must be called inside a tokio
    /// runtime: the links' tasks are spawned on it.
    ///
    /// # Errors
    /// When a link other than the rank's own is missing.
    pub fn new(rank: usize, sessions: Vec<Option<(String, Session)>>) -> Result<Self, CommError> {
        let world = sessions.len();
        let mut links = Vec::with_capacity(world);
        for (p, s) in sessions.into_iter().enumerate() {
            match (p == rank, s) {
                (true, _) => links.push(None),
                (false, None) => {
                    return Err(CommError::Usage {
                        rank,
                        reason: format!("no session to rank {p}"),
                    })
                }
                (false, Some((peer_node, session))) => links.push(Some(link(peer_node, session))),
            }
        }
        Ok(SessionTransport {
            rank,
            world,
            links,
            closed: AtomicBool::new(false),
            reason: Mutex::new(None),
            broken: Mutex::new(None),
        })
    }

    /// The node whose session broke first (not a close), if one did: the node a failed
    /// collective suspects of being gone.
    pub fn broken_peer(&self) -> Option<String> {
        self.broken
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn note_broken(&self, node: &str) {
        self.broken
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert_with(|| node.to_string());
    }

    /// Ends every link; waiting and later exchanges fail with `why`. Idempotent.
    pub fn close(&self, why: &str) {
        {
            let mut r = self.reason.lock().unwrap_or_else(|e| e.into_inner());
            r.get_or_insert_with(|| why.to_string());
        }
        self.closed.store(true, Ordering::Release);
        for l in self.links.iter().flatten() {
            for t in &l.tasks {
                t.abort();
            }
        }
    }

    fn closed_error(&self, peer: usize) -> CommError {
        let why = self
            .reason
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .unwrap_or_else(|| "closed".into());
        CommError::Link {
            rank: self.rank,
            peer,
            reason: format!("the instance's mesh was closed: {why}"),
        }
    }

    fn link(&self, peer: usize) -> Result<&Link, CommError> {
        self.links
            .get(peer)
            .and_then(Option::as_ref)
            .ok_or_else(|| CommError::Usage {
                rank: self.rank,
                reason: format!(
                    "exchange with rank {peer}: peers are the other ranks of 0..{}",
                    self.world
                ),
            })
    }

    fn fill(&self, peer: usize, buf: &mut [u8], deadline: Instant) -> Result<(), CommError> {
        let link = self.link(peer)?;
        let mut inbox = link.rx.lock().unwrap_or_else(|e| e.into_inner());
        let mut filled = 0;
        while filled < buf.len() {
            if inbox.pos < inbox.current.len() {
                let n = (buf.len() - filled).min(inbox.current.len() - inbox.pos);
                buf[filled..filled + n].copy_from_slice(&inbox.current[inbox.pos..inbox.pos + n]);
                inbox.pos += n;
                filled += n;
                continue;
            }
            if self.closed.load(Ordering::Acquire) {
                return Err(self.closed_error(peer));
            }
            let wait = deadline.saturating_duration_since(Instant::now());
            match inbox.rx.recv_timeout(wait) {
                Ok(Ok(m)) => {
                    inbox.current = m;
                    inbox.pos = 0;
                }
                Ok(Err(e)) => {
                    self.note_broken(&link.peer_node);
                    return Err(CommError::Link {
                        rank: self.rank,
                        peer,
                        reason: format!("the session to node {} broke: {e}", link.peer_node),
                    });
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    return Err(CommError::Timeout {
                        rank: self.rank,
                        peer,
                        deadline_ms: wait.as_millis() as u64,
                    })
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(if self.closed.load(Ordering::Acquire) {
                        self.closed_error(peer)
                    } else {
                        self.note_broken(&link.peer_node);
                        CommError::Link {
                            rank: self.rank,
                            peer,
                            reason: format!("the session to node {} ended", link.peer_node),
                        }
                    })
                }
            }
        }
        Ok(())
    }
}

impl Drop for SessionTransport {
    fn drop(&mut self) {
        // The writers end once their queues are dropped (after sending what is queued, so a
        // last "stop" reaches the peers); the readers would wait for the peer forever.
        for l in self.links.iter().flatten() {
            l.tasks[0].abort();
        }
    }
}

fn link(peer_node: String, session: Session) -> Link {
    let (mut reader, mut writer) = session.into_split();
    let (out, mut queue) = tmpsc::unbounded_channel::<Vec<u8>>();
    let (tx, rx) = mpsc::channel::<Incoming>();
    let read = tokio::spawn(async move {
        loop {
            match reader.recv().await {
                Ok(m) => {
                    if tx.send(Ok(m)).is_err() {
                        return;
                    }
                }
                Err(e) => {
                    let _ = tx.send(Err(e.to_string()));
                    return;
                }
            }
        }
    });
    let write = tokio::spawn(async move {
        while let Some(m) = queue.recv().await {
            if writer.send(&m).await.is_err() {
                return; // the reader side reports the broken session
            }
        }
    });
    Link {
        peer_node,
        out,
        rx: Mutex::new(Inbox {
            rx,
            current: Vec::new(),
            pos: 0,
        }),
        tasks: [read, write],
    }
}

impl Transport for SessionTransport {
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
        for &(peer, data) in sends {
            if self.closed.load(Ordering::Acquire) {
                return Err(self.closed_error(peer));
            }
            let link = self.link(peer)?;
            if data.is_empty() {
                continue;
            }
            link.out.send(data.to_vec()).map_err(|_| CommError::Link {
                rank: self.rank,
                peer,
                reason: format!("the session to node {} ended", link.peer_node),
            })?;
        }
        for (peer, buf) in recvs.iter_mut() {
            self.fill(*peer, buf, deadline)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::{accept, connect, Encryption, NodeKey, SessionConfig};
    use std::sync::Arc;
    use std::time::Duration;
    use tokio::net::{TcpListener, TcpStream};

    async fn pair(enc: Encryption) -> (Session, Session) {
        let mut cfg = SessionConfig::new([7; 32], NodeKey::generate());
        cfg.encryption = enc;
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let c2 = SessionConfig {
            key: NodeKey::generate(),
            ..cfg.clone()
        };
        let a = tokio::spawn(async move {
            let (s, _) = l.accept().await.unwrap();
            accept(s, &c2, b"b").await.unwrap()
        });
        let s = connect(TcpStream::connect(addr).await.unwrap(), &cfg, b"a")
            .await
            .unwrap();
        (s, a.await.unwrap())
    }

    #[test]
    fn exchanges_across_a_pair_and_fails_once_closed() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        for enc in [Encryption::On, Encryption::Off] {
            let (a, b) = rt.block_on(pair(enc));
            let _g = rt.enter();
            let t0 = Arc::new(SessionTransport::new(0, vec![None, Some(("b".into(), a))]).unwrap());
            let t1 = Arc::new(SessionTransport::new(1, vec![Some(("a".into(), b)), None]).unwrap());
            let deadline = || Instant::now() + Duration::from_secs(10);
            // sizes that cross message and record boundaries, both ways at once
            for len in [1usize, 7, 65_519, 65_520, 300_000] {
                let x: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
                let y: Vec<u8> = x.iter().map(|v| v ^ 0x5a).collect();
                let (t1c, yc) = (t1.clone(), y.clone());
                let h = std::thread::spawn(move || {
                    let mut got = vec![0u8; len];
                    t1c.exchange(&[(0, &yc)], &mut [(0, &mut got)], deadline())
                        .unwrap();
                    got
                });
                let mut got = vec![0u8; len];
                t0.exchange(&[(1, &x)], &mut [(1, &mut got)], deadline())
                    .unwrap();
                assert_eq!(got, y);
                assert_eq!(h.join().unwrap(), x);
            }
            // a receive made of two sends
            t1.exchange(&[(0, &[1, 2]), (0, &[3])], &mut [], deadline())
                .unwrap();
            let mut got = [0u8; 3];
            t0.exchange(&[], &mut [(1, &mut got)], deadline()).unwrap();
            assert_eq!(got, [1, 2, 3]);
            // nothing sent: a timeout, not a hang
            let e = t0
                .exchange(
                    &[],
                    &mut [(1, &mut [0u8; 1])],
                    Instant::now() + Duration::from_millis(50),
                )
                .unwrap_err();
            assert!(matches!(e, CommError::Timeout { .. }), "{e}");
            // closing wakes a waiting receiver with the reason
            let t0c = t0.clone();
            let h = std::thread::spawn(move || {
                t0c.exchange(&[], &mut [(1, &mut [0u8; 1])], deadline())
                    .unwrap_err()
            });
            std::thread::sleep(Duration::from_millis(50));
            t0.close("node b died");
            let e = h.join().unwrap();
            assert!(e.to_string().contains("node b died"), "{e}");
            assert_eq!(t0.broken_peer(), None, "closed, not broken");
            // the peer sees its session end, and suspects the node at its other end
            let e = t1
                .exchange(&[], &mut [(0, &mut [0u8; 1])], deadline())
                .unwrap_err();
            assert!(matches!(e, CommError::Link { .. }), "{e}");
            assert_eq!(t1.broken_peer().as_deref(), Some("a"));
        }
    }
}
