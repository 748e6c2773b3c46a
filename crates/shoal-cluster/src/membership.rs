//! Who is in the cluster and who is alive: gossip membership with a phi-accrual failure detector
//! (chitchat 0.13), over a sealed UDP transport.
//!
//! Every node gossips its versioned key-values (node facts, API and cluster addresses, link facts,
//! as JSON strings chosen by the daemon) and a heartbeat; chitchat reconciles them scuttlebutt
//! style and its failure detector declares a node dead when its heartbeat stops advancing. Every
//! datagram is sealed with [`Sealer`] (AES-256-GCM under a key derived from the cluster secret)
//! before it leaves and opened on arrival; a datagram that does not open (a stranger, another
//! cluster, corruption) is dropped, counted, and logged at most once a minute per sender address,
//! so a node without the secret can neither read the cluster's state nor appear in it.
//!
//! Two things about chitchat 0.13 shape the transport. Its envelope (de)serialization is
//! crate-private (quickwit-oss/chitchat#207), so an out-of-tree transport cannot turn a message
//! into bytes; `LoopbackCodec` borrows chitchat's own public UDP socket for that, over a private
//! pair of loopback sockets (the host's loopback interface must be up). And it sizes messages for
//! 65,507-byte datagrams with a constant an embedder cannot lower, so a message that no longer
//! fits once sealed is split into at most [`MAX_PARTS`] sealed parts and reassembled on arrival.
//!
//! Seeds: chitchat resolves its seed list once at start (host names again every 60 s), and offers
//! no way to add one later. Nodes found afterwards (by discovery) go into a seed book shared with
//! the transport; a small task sends each seed chitchat's opening message until an authenticated
//! datagram comes back from that address, backing off while it stays silent. One reply is enough:
//! from then on the two nodes know each other and chitchat gossips between them by itself.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use async_trait::async_trait;
use chitchat::transport::{RecvOutcome, SendOutcome, Socket, Transport};
use chitchat::{
    spawn_chitchat, ChitchatConfig, ChitchatEnvelope, ChitchatHandle, ChitchatId, NodeState,
    ProtocolVersion,
};
use tokio::sync::watch;
use tracing::{debug, info, warn};

pub use chitchat::FailureDetectorConfig;

use crate::seal::{SealError, Sealer};

/// Default time between gossip rounds.
pub const DEFAULT_GOSSIP_INTERVAL: Duration = Duration::from_millis(250);

/// Key prefix reserved for membership's own bookkeeping; [`Membership::set`] refuses it.
pub const RESERVED_KEY_PREFIX: &str = "__";

/// Set (to "1") by a node that is leaving gracefully; the others stop counting it as live.
const LEAVING_KEY: &str = "__leaving";

/// Largest key plus value [`Membership::set`] accepts. chitchat sends one key-value whole or not
/// at all, in datagrams of at most 64 KiB shared with the rest of the state.
pub const MAX_KEY_VALUE_LEN: usize = 32 * 1024;

/// Largest datagram chitchat sizes its messages for (`MAX_UDP_DATAGRAM_PAYLOAD_SIZE`, crate
/// private in chitchat 0.13): the largest UDP payload IPv4 can carry.
const MAX_DATAGRAM: usize = 65_507;

/// Most parts one gossip message may be split into.
pub const MAX_PARTS: usize = 4;

/// How long a partly received message is kept waiting for its other parts.
const REASSEMBLY_TIMEOUT: Duration = Duration::from_secs(2);

/// Senders with partly received messages at once; the oldest is dropped beyond this.
const MAX_PARTIALS: usize = 64;

/// How often an undecryptable sender is logged.
const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(60);

/// Sender addresses remembered for log rate limiting.
const MAX_WARNED_ADDRS: usize = 1024;

/// Most seeds [`Membership::add_seed`] holds.
pub const MAX_SEEDS: usize = 256;

/// A seed heard from within this long is not pinged.
const SEED_HEARD_WINDOW: Duration = Duration::from_secs(3);

/// Longest wait between two pings of a silent seed.
const SEED_MAX_BACKOFF: Duration = Duration::from_secs(8);

/// How long decoding one received message through the loopback codec may take.
const DECODE_TIMEOUT: Duration = Duration::from_millis(500);

/// What [`Membership::start`] needs.
pub struct MembershipConfig {
    /// This node's id, unique in the cluster.
    pub node_id: String,
    /// This run of the node: its start time, so a restarted node is a new generation.
    pub generation: u64,
    /// Where to bind the gossip UDP socket; port 0 picks a free one
    /// ([`Membership::gossip_addr`] reports it).
    pub gossip_addr: SocketAddr,
    /// The address other nodes gossip to; `None` means the bound address (which then must not
    /// be unspecified). A port of 0 is replaced by the bound port.
    pub advertise_addr: Option<SocketAddr>,
    /// Seed nodes, `ip:port` or `host:port` (host names are re-resolved every 60 s).
    pub seeds: Vec<String>,
    /// The cluster id: gossip from another cluster id is answered with a refusal.
    pub cluster_id: String,
    /// Seals and opens every gossip datagram.
    pub sealer: Sealer,
    /// Time between gossip rounds.
    pub gossip_interval: Duration,
    /// Failure detector settings; `None` derives them from `gossip_interval` with
    /// [`failure_detector_for`].
    pub failure_detector: Option<FailureDetectorConfig>,
    /// Key-values this node publishes from the start.
    pub initial_key_values: Vec<(String, String)>,
}

impl MembershipConfig {
    /// A config with the defaults: generation = now in ms since the Unix epoch, advertise the
    /// bound address, no seeds, [`DEFAULT_GOSSIP_INTERVAL`], derived failure detection, no keys.
    pub fn new(
        node_id: impl Into<String>,
        cluster_id: impl Into<String>,
        sealer: Sealer,
        gossip_addr: SocketAddr,
    ) -> Self {
        Self {
            node_id: node_id.into(),
            generation: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            gossip_addr,
            advertise_addr: None,
            seeds: Vec::new(),
            cluster_id: cluster_id.into(),
            sealer,
            gossip_interval: DEFAULT_GOSSIP_INTERVAL,
            failure_detector: None,
            initial_key_values: Vec::new(),
        }
    }
}

/// Failure detection tuned to declare a silent node dead in about 3 s at 250 ms gossip.
///
/// chitchat's phi is `silence / mean heartbeat interval`, where the mean is smoothed toward
/// `initial_interval` with the weight of 5 samples. Heartbeats reach a node from every peer that
/// gossips, so the raw mean shrinks as traffic grows; a short window (20 samples) with a prior of
/// 4 gossip intervals keeps the mean between 0.8 and 1.6 intervals, and a threshold of 8 turns
/// that into 6.4 to 12.8 intervals of silence (1.6 to 3.2 s at 250 ms), plus up to one interval
/// until the next liveness check. Dead nodes are forgotten after an hour.
pub fn failure_detector_for(gossip_interval: Duration) -> FailureDetectorConfig {
    FailureDetectorConfig {
        phi_threshold: 8.0,
        sampling_window_size: 20,
        max_interval: gossip_interval * 8,
        initial_interval: gossip_interval * 4,
        dead_node_grace_period: Duration::from_secs(3600),
    }
}

/// One live node as gossip sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeView {
    /// The node id.
    pub id: String,
    /// Its generation (start time).
    pub generation: u64,
    /// The address it gossips on.
    pub gossip_addr: SocketAddr,
    /// Its published key-values (reserved keys left out).
    pub key_values: BTreeMap<String, String>,
}

/// Transport counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GossipStats {
    /// Datagrams that failed to open (wrong secret, corrupted, too short).
    pub refused: u64,
    /// Authenticated datagrams that were not a valid gossip message.
    pub malformed: u64,
    /// Messages sent.
    pub sent: u64,
    /// Messages received and decoded.
    pub received: u64,
    /// Messages that had to be split into several datagrams.
    pub split: u64,
}

/// What went wrong in membership.
#[derive(Debug, thiserror::Error)]
pub enum MembershipError {
    /// A required config field is empty.
    #[error("membership config: {0} is empty")]
    EmptyField(&'static str),
    /// The gossip interval is zero.
    #[error("membership config: the gossip interval must be above zero (250 ms is the default)")]
    ZeroInterval,
    /// The gossip socket could not be bound.
    #[error("cannot bind the gossip socket to {addr}/udp: {source} (is the port taken, or the address not on this host?)")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Bound to an unspecified address with nothing to advertise.
    #[error("gossip is bound to {0}, which other nodes cannot reach: set advertise_addr to this node's address on the cluster network")]
    NoAdvertiseAddr(SocketAddr),
    /// chitchat failed to start.
    #[error("the gossip server did not start: {0}")]
    Start(String),
    /// A key in the reserved namespace.
    #[error("key {0:?} starts with {RESERVED_KEY_PREFIX:?}, which membership reserves for itself; pick another key")]
    ReservedKey(String),
    /// A key-value too large to gossip.
    #[error("key-value {key:?} is {len} bytes, more than the {MAX_KEY_VALUE_LEN} gossip carries; publish a summary and fetch the rest over a session")]
    TooLarge {
        /// The key.
        key: String,
        /// Key plus value length.
        len: usize,
    },
    /// The seed book is full.
    #[error("already {MAX_SEEDS} seeds; remove stale ones (remove_seed) before adding more")]
    TooManySeeds,
    /// The gossip loop is gone.
    #[error("the gossip loop has stopped")]
    Stopped,
}

/// A running membership: the gossip loop, its transport and the seed pinger.
///
/// Dropping it stops gossip at once, as a crash would (the others declare it dead after the
/// failure detector's timeout); [`Membership::shutdown`] leaves gracefully.
pub struct Membership {
    node_id: String,
    gossip_addr: SocketAddr,
    advertise_addr: SocketAddr,
    gossip_interval: Duration,
    handle: Arc<ChitchatHandle>,
    shared: Arc<Shared>,
    views: watch::Receiver<Vec<NodeView>>,
    ever_live: Arc<Mutex<HashSet<ChitchatId>>>,
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl Membership {
    /// Binds the gossip socket and starts gossiping.
    ///
    /// # Errors
    /// [`MembershipError::EmptyField`], [`MembershipError::ZeroInterval`],
    /// [`MembershipError::NoAdvertiseAddr`], [`MembershipError::ReservedKey`] or
    /// [`MembershipError::TooLarge`] for a bad config, [`MembershipError::Bind`] when the socket
    /// cannot be bound, [`MembershipError::Start`] when chitchat (or the loopback codec) fails.
    pub async fn start(config: MembershipConfig) -> Result<Membership, MembershipError> {
        let MembershipConfig {
            node_id,
            generation,
            gossip_addr,
            advertise_addr,
            seeds,
            cluster_id,
            sealer,
            gossip_interval,
            failure_detector,
            initial_key_values,
        } = config;
        if node_id.is_empty() {
            return Err(MembershipError::EmptyField("node_id"));
        }
        if cluster_id.is_empty() {
            return Err(MembershipError::EmptyField("cluster_id"));
        }
        if gossip_interval.is_zero() {
            return Err(MembershipError::ZeroInterval);
        }
        for (key, value) in &initial_key_values {
            check_key_value(key, value)?;
        }
        let socket = tokio::net::UdpSocket::bind(gossip_addr)
            .await
            .map_err(|source| MembershipError::Bind {
                addr: gossip_addr,
                source,
            })?;
        let bound = socket
            .local_addr()
            .map_err(|source| MembershipError::Bind {
                addr: gossip_addr,
                source,
            })?;
        let advertise_addr = match advertise_addr {
            Some(a) if a.port() == 0 => SocketAddr::new(a.ip(), bound.port()),
            Some(a) => a,
            None if bound.ip().is_unspecified() => {
                return Err(MembershipError::NoAdvertiseAddr(bound))
            }
            None => bound,
        };

        let shared = Arc::new(Shared::new(sealer, node_id.clone(), gossip_interval));
        let transport = SealedTransport {
            socket: Mutex::new(Some(socket)),
            shared: shared.clone(),
        };
        let chitchat_config = ChitchatConfig {
            chitchat_id: ChitchatId::new(node_id.clone(), generation, advertise_addr),
            cluster_id,
            gossip_interval,
            listen_addr: bound,
            seed_nodes: seeds,
            failure_detector_config: failure_detector
                .unwrap_or_else(|| failure_detector_for(gossip_interval)),
            marked_for_deletion_grace_period: Duration::from_secs(3600),
            catchup_callback: None,
            extra_liveness_predicate: Some(Box::new(|state: &NodeState| {
                !state.contains_key(LEAVING_KEY)
            })),
            // Every shoal node runs chitchat 0.13, which reads the compressed digest.
            protocol_version: ProtocolVersion::V1,
        };
        let handle = spawn_chitchat(chitchat_config, initial_key_values, &transport)
            .await
            .map_err(|e| MembershipError::Start(format!("{e:#}")))?;
        let handle = Arc::new(handle);

        let (views_tx, views) = watch::channel(Vec::new());
        let ever_live = Arc::new(Mutex::new(HashSet::new()));
        let live_rx = handle.chitchat().lock().await.live_nodes_watcher();
        let publisher = tokio::spawn(publish_views(live_rx, views_tx, ever_live.clone()));
        let pinger = tokio::spawn(ping_seeds(handle.clone(), shared.clone(), gossip_interval));
        info!(node = %node_id, generation, gossip = %bound, advertise = %advertise_addr, "membership started");
        Ok(Membership {
            node_id,
            gossip_addr: bound,
            advertise_addr,
            gossip_interval,
            handle,
            shared,
            views,
            ever_live,
            tasks: Mutex::new(vec![publisher, pinger]),
        })
    }

    /// This node's id.
    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// The address the gossip socket is bound to (with the real port when 0 was asked for).
    pub fn gossip_addr(&self) -> SocketAddr {
        self.gossip_addr
    }

    /// The address other nodes gossip to.
    pub fn advertise_addr(&self) -> SocketAddr {
        self.advertise_addr
    }

    /// Publishes `key` = `value` for this node (the daemon uses JSON values).
    ///
    /// # Errors
    /// [`MembershipError::ReservedKey`] for a key starting with [`RESERVED_KEY_PREFIX`],
    /// [`MembershipError::TooLarge`] beyond [`MAX_KEY_VALUE_LEN`].
    pub async fn set(&self, key: &str, value: &str) -> Result<(), MembershipError> {
        check_key_value(key, value)?;
        self.handle
            .chitchat()
            .lock()
            .await
            .self_node_state()
            .set(key, value);
        Ok(())
    }

    /// Withdraws `key` from this node's key-values.
    ///
    /// # Errors
    /// [`MembershipError::ReservedKey`] for a reserved key.
    pub async fn delete(&self, key: &str) -> Result<(), MembershipError> {
        check_key_value(key, "")?;
        self.handle
            .chitchat()
            .lock()
            .await
            .self_node_state()
            .delete(key);
        Ok(())
    }

    /// The live nodes, this one included, sorted by id.
    pub fn live_nodes(&self) -> Vec<NodeView> {
        self.views.borrow().clone()
    }

    /// A receiver of the live nodes; it changes when a node joins, leaves, dies or changes its
    /// key-values (not on mere heartbeats).
    pub fn watch(&self) -> watch::Receiver<Vec<NodeView>> {
        self.views.clone()
    }

    /// Ids of nodes that were live and are now declared dead or have left, with no live
    /// generation, sorted.
    pub async fn dead_nodes(&self) -> Vec<String> {
        let live: HashSet<String> = self.views.borrow().iter().map(|v| v.id.clone()).collect();
        let chitchat = self.handle.chitchat();
        let chitchat = chitchat.lock().await;
        let ever_live = self
            .ever_live
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let dead = chitchat.dead_nodes().filter(|id| ever_live.contains(*id));
        let left = chitchat
            .node_states()
            .iter()
            .filter(|(_, state)| state.contains_key(LEAVING_KEY))
            .map(|(id, _)| id);
        let mut out: Vec<String> = dead
            .chain(left)
            .filter(|id| *id != chitchat.self_chitchat_id() && !live.contains(&*id.node_id))
            .map(|id| id.node_id.to_string())
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// Adds a gossip address to contact (a node discovery found): it is sent chitchat's opening
    /// message now and again, with back-off, until it answers. Returns false if it was already
    /// known or is this node's own address.
    ///
    /// # Errors
    /// [`MembershipError::TooManySeeds`] past [`MAX_SEEDS`], [`MembershipError::Stopped`] when
    /// the gossip loop has ended.
    pub fn add_seed(&self, addr: SocketAddr) -> Result<bool, MembershipError> {
        if addr == self.advertise_addr || addr == self.gossip_addr {
            return Ok(false);
        }
        {
            let mut seeds = self
                .shared
                .seeds
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if seeds.contains_key(&addr) {
                return Ok(false);
            }
            if seeds.len() >= MAX_SEEDS {
                return Err(MembershipError::TooManySeeds);
            }
            let now = Instant::now();
            seeds.insert(
                addr,
                SeedState {
                    last_heard: None,
                    next_try: now + self.gossip_interval,
                    backoff: self.gossip_interval * 2,
                },
            );
        }
        debug!(node = %self.node_id, seed = %addr, "added a gossip seed");
        self.handle
            .gossip(addr)
            .map_err(|_| MembershipError::Stopped)?;
        Ok(true)
    }

    /// Stops contacting a seed added with [`Membership::add_seed`] (discovery saw it leave).
    /// Returns whether it was there. Gossip with a node already met goes on regardless.
    pub fn remove_seed(&self, addr: SocketAddr) -> bool {
        let mut seeds = self
            .shared
            .seeds
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        seeds.remove(&addr).is_some()
    }

    /// Transport counters.
    pub fn stats(&self) -> GossipStats {
        self.shared.stats()
    }

    /// Leaves gracefully: marks this node as leaving, gossips that to every live peer, then stops.
    /// The others drop it from their live set within a gossip round or two and list it in
    /// [`Membership::dead_nodes`]. Later calls do nothing more than stop again.
    pub async fn shutdown(&self) {
        let peers: Vec<SocketAddr> = self
            .live_nodes()
            .iter()
            .filter(|v| v.id != self.node_id)
            .map(|v| v.gossip_addr)
            .collect();
        self.handle
            .chitchat()
            .lock()
            .await
            .self_node_state()
            .set(LEAVING_KEY, "1");
        // Syn -> SynAck -> Ack: the Ack carries our new key; give it a few rounds to spread.
        for _ in 0..2 {
            for &peer in &peers {
                let _ = self.handle.gossip(peer);
            }
            tokio::time::sleep(self.gossip_interval).await;
        }
        let tasks: Vec<_> = self
            .tasks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain(..)
            .collect();
        for task in tasks {
            task.abort();
        }
        let _ = self.handle.initiate_shutdown();
        let _ =
            tokio::time::timeout(Duration::from_secs(2), self.handle.termination_watcher()).await;
        info!(node = %self.node_id, "left the cluster");
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        for task in self
            .tasks
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
        {
            task.abort();
        }
        self.handle.abort();
    }
}

fn check_key_value(key: &str, value: &str) -> Result<(), MembershipError> {
    if key.starts_with(RESERVED_KEY_PREFIX) {
        return Err(MembershipError::ReservedKey(key.to_string()));
    }
    if key.len() + value.len() > MAX_KEY_VALUE_LEN {
        return Err(MembershipError::TooLarge {
            key: key.to_string(),
            len: key.len() + value.len(),
        });
    }
    Ok(())
}

/// Mirrors chitchat's live-node map into [`NodeView`]s, and remembers who was ever live.
async fn publish_views(
    mut live: watch::Receiver<BTreeMap<ChitchatId, NodeState>>,
    views: watch::Sender<Vec<NodeView>>,
    ever_live: Arc<Mutex<HashSet<ChitchatId>>>,
) {
    loop {
        let next: Vec<NodeView> = {
            let map = live.borrow_and_update();
            ever_live
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .extend(map.keys().cloned());
            let mut next: Vec<NodeView> = map
                .iter()
                .map(|(id, state)| NodeView {
                    id: id.node_id.to_string(),
                    generation: id.generation_id,
                    gossip_addr: id.gossip_advertise_addr,
                    key_values: state
                        .key_values()
                        .filter(|(k, _)| !k.starts_with(RESERVED_KEY_PREFIX))
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                })
                .collect();
            next.sort_by(|a, b| (&a.id, a.generation).cmp(&(&b.id, b.generation)));
            next
        };
        views.send_if_modified(|current| {
            if *current == next {
                return false;
            }
            *current = next;
            true
        });
        if live.changed().await.is_err() {
            return;
        }
    }
}

/// Sends chitchat's opening message to seeds that have not been heard from lately.
async fn ping_seeds(handle: Arc<ChitchatHandle>, shared: Arc<Shared>, gossip_interval: Duration) {
    let mut tick = tokio::time::interval(gossip_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let now = Instant::now();
        let due: Vec<SocketAddr> = {
            let mut seeds = shared.seeds.lock().unwrap_or_else(PoisonError::into_inner);
            seeds
                .iter_mut()
                .filter_map(|(addr, seed)| {
                    if seed
                        .last_heard
                        .is_some_and(|t| now.duration_since(t) < SEED_HEARD_WINDOW)
                    {
                        seed.backoff = gossip_interval;
                        return None;
                    }
                    if now < seed.next_try {
                        return None;
                    }
                    seed.next_try = now + seed.backoff;
                    seed.backoff = (seed.backoff * 2).min(SEED_MAX_BACKOFF);
                    Some(*addr)
                })
                .collect()
        };
        for addr in due {
            if handle.gossip(addr).is_err() {
                return;
            }
        }
    }
}

/// A seed added after start.
#[derive(Debug)]
struct SeedState {
    last_heard: Option<Instant>,
    next_try: Instant,
    backoff: Duration,
}

/// State shared by the membership handle, the transport and the seed pinger.
struct Shared {
    sealer: Sealer,
    node: String,
    gossip_interval: Duration,
    refused: AtomicU64,
    malformed: AtomicU64,
    sent: AtomicU64,
    received: AtomicU64,
    split: AtomicU64,
    warned: Mutex<HashMap<IpAddr, Instant>>,
    seeds: Mutex<HashMap<SocketAddr, SeedState>>,
}

impl Shared {
    fn new(sealer: Sealer, node: String, gossip_interval: Duration) -> Self {
        Self {
            sealer,
            node,
            gossip_interval,
            refused: AtomicU64::new(0),
            malformed: AtomicU64::new(0),
            sent: AtomicU64::new(0),
            received: AtomicU64::new(0),
            split: AtomicU64::new(0),
            warned: Mutex::new(HashMap::new()),
            seeds: Mutex::new(HashMap::new()),
        }
    }

    fn stats(&self) -> GossipStats {
        GossipStats {
            refused: self.refused.load(Ordering::Relaxed),
            malformed: self.malformed.load(Ordering::Relaxed),
            sent: self.sent.load(Ordering::Relaxed),
            received: self.received.load(Ordering::Relaxed),
            split: self.split.load(Ordering::Relaxed),
        }
    }

    /// Whether a warning about `ip` may be logged now: at most once per
    /// [`REFUSAL_LOG_INTERVAL`], for at most [`MAX_WARNED_ADDRS`] addresses at a time.
    fn may_warn(&self, ip: IpAddr, now: Instant) -> bool {
        let mut warned = self.warned.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(last) = warned.get(&ip) {
            if now.duration_since(*last) < REFUSAL_LOG_INTERVAL {
                return false;
            }
        } else if warned.len() >= MAX_WARNED_ADDRS {
            warned.retain(|_, last| now.duration_since(*last) < REFUSAL_LOG_INTERVAL);
            if warned.len() >= MAX_WARNED_ADDRS {
                return false;
            }
        }
        warned.insert(ip, now);
        true
    }

    fn refuse(&self, from: SocketAddr, error: &SealError) {
        let total = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
        if self.may_warn(from.ip(), Instant::now()) {
            warn!(node = %self.node, peer = %from, %error, refused_total = total,
                "dropped a gossip datagram that does not open with our cluster secret (a stranger, another cluster, or corruption); this sender is logged at most once a minute");
        }
    }

    fn malformed(&self, from: SocketAddr, what: &str) {
        let total = self.malformed.fetch_add(1, Ordering::Relaxed) + 1;
        if self.may_warn(from.ip(), Instant::now()) {
            warn!(node = %self.node, peer = %from, problem = what, malformed_total = total,
                "dropped an authenticated gossip datagram that is not a valid message (a node running another shoal version?); this sender is logged at most once a minute");
        }
    }

    fn send_failed(&self, to: SocketAddr, error: &std::io::Error) {
        if self.may_warn(to.ip(), Instant::now()) {
            warn!(node = %self.node, peer = %to, %error, "could not send a gossip datagram; this peer is logged at most once a minute");
        }
    }

    fn heard(&self, from: SocketAddr) {
        let mut seeds = self.seeds.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(seed) = seeds.get_mut(&from) {
            seed.last_heard = Some(Instant::now());
            seed.backoff = self.gossip_interval;
        }
    }
}

/// chitchat transport whose socket is bound before chitchat starts (so port 0 can be
/// reported) and which seals every datagram.
struct SealedTransport {
    socket: Mutex<Option<tokio::net::UdpSocket>>,
    shared: Arc<Shared>,
}

#[async_trait]
impl Transport for SealedTransport {
    async fn open(&self, listen_addr: SocketAddr) -> anyhow::Result<Box<dyn Socket>> {
        let socket = self
            .socket
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .with_context(|| {
                format!("the sealed gossip socket for {listen_addr} was already opened")
            })?;
        let local_addr = socket
            .local_addr()
            .context("gossip socket has no local address")?;
        let codec = LoopbackCodec::open().await?;
        Ok(Box::new(SealedSocket {
            socket,
            local_addr,
            codec,
            shared: self.shared.clone(),
            buf: vec![0; MAX_DATAGRAM + 1].into_boxed_slice(),
            reassembly: Reassembly::default(),
            decoding: None,
            next_message_id: rand::random(),
        }))
    }
}

/// The socket chitchat gossips through: envelope -> bytes (codec) -> parts -> sealed datagrams,
/// and back.
struct SealedSocket {
    socket: tokio::net::UdpSocket,
    local_addr: SocketAddr,
    codec: LoopbackCodec,
    shared: Arc<Shared>,
    buf: Box<[u8]>,
    reassembly: Reassembly,
    /// A message handed to the codec and not yet taken back: its sender and wire size. Kept
    /// across a cancelled `recv` so the next one returns it with the right sender.
    decoding: Option<(SocketAddr, usize)>,
    next_message_id: u32,
}

fn is_transient(error: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        error.kind(),
        OutOfMemory | ConnectionReset | ConnectionRefused | Interrupted | WouldBlock
    )
}

#[async_trait]
impl Socket for SealedSocket {
    fn local_addr(&self) -> anyhow::Result<SocketAddr> {
        Ok(self.local_addr)
    }

    async fn send(
        &mut self,
        to: SocketAddr,
        envelope: ChitchatEnvelope,
    ) -> anyhow::Result<SendOutcome> {
        let message = self.codec.encode(envelope).await?;
        let id = self.next_message_id;
        self.next_message_id = id.wrapping_add(1);
        let Some(parts) = split(&message, id) else {
            anyhow::bail!(
                "gossip message of {} bytes does not fit in {MAX_PARTS} sealed datagrams; the cluster state is too large",
                message.len()
            );
        };
        if parts.len() > 1 {
            self.shared.split.fetch_add(1, Ordering::Relaxed);
        }
        let mut num_bytes_sent = 0;
        for part in parts {
            let datagram = self.shared.sealer.seal(&part);
            match self.socket.send_to(&datagram, to).await {
                Ok(n) => num_bytes_sent += n,
                // A per-destination failure (unreachable, no route): not a broken transport.
                Err(error) => {
                    self.shared.send_failed(to, &error);
                    return Ok(SendOutcome { num_bytes_sent });
                }
            }
        }
        self.shared.sent.fetch_add(1, Ordering::Relaxed);
        Ok(SendOutcome { num_bytes_sent })
    }

    /// Cancel-safe: every await is either cancel-safe itself or resumed through `decoding`.
    async fn recv(&mut self) -> anyhow::Result<RecvOutcome> {
        loop {
            if let Some((from_addr, num_bytes_received)) = self.decoding {
                let decoded = tokio::time::timeout(DECODE_TIMEOUT, self.codec.decoded()).await;
                self.decoding = None;
                match decoded {
                    Ok(Ok(envelope)) => {
                        self.shared.received.fetch_add(1, Ordering::Relaxed);
                        return Ok(RecvOutcome {
                            from_addr,
                            envelope,
                            num_bytes_received,
                        });
                    }
                    Ok(Err(error)) => return Err(error),
                    Err(_) => {
                        self.shared
                            .malformed(from_addr, "chitchat could not decode it");
                        continue;
                    }
                }
            }
            let (n, from) = match self.socket.recv_from(&mut self.buf).await {
                Ok(received) => received,
                Err(error) if is_transient(&error) => {
                    debug!(node = %self.shared.node, %error, "transient gossip recv error");
                    continue;
                }
                Err(error) => {
                    return Err(anyhow::Error::new(error).context("the gossip socket failed"))
                }
            };
            let plaintext = match self.shared.sealer.open(&self.buf[..n]) {
                Ok(plaintext) => plaintext,
                Err(error) => {
                    self.shared.refuse(from, &error);
                    continue;
                }
            };
            let message = match parse_frame(&plaintext) {
                Ok(Frame::Whole(message)) => message.to_vec(),
                Ok(Frame::Part {
                    id,
                    index,
                    count,
                    chunk,
                }) => {
                    self.shared.heard(from);
                    match self
                        .reassembly
                        .add(from, id, index, count, chunk, Instant::now())
                    {
                        Some(message) => message,
                        None => continue,
                    }
                }
                Err(problem) => {
                    self.shared.malformed(from, problem);
                    continue;
                }
            };
            self.shared.heard(from);
            if message.len() > MAX_DATAGRAM {
                self.shared
                    .malformed(from, "message larger than chitchat reads");
                continue;
            }
            self.codec.feed(&message).await?;
            // No await between a completed feed and this line: a cancelled recv resumes here.
            self.decoding = Some((from, n));
        }
    }
}

const FRAME_WHOLE: u8 = 0;
const FRAME_PART: u8 = 1;
const PART_HEADER_LEN: usize = 1 + 4 + 1 + 1;
const MAX_WHOLE_LEN: usize = MAX_DATAGRAM - Sealer::OVERHEAD - 1;
const MAX_CHUNK_LEN: usize = MAX_DATAGRAM - Sealer::OVERHEAD - PART_HEADER_LEN;

/// One opened datagram.
#[derive(Debug, PartialEq, Eq)]
enum Frame<'a> {
    /// A whole chitchat message.
    Whole(&'a [u8]),
    /// Part `index` of `count` of message `id`.
    Part {
        id: u32,
        index: u8,
        count: u8,
        chunk: &'a [u8],
    },
}

/// The plaintexts to seal for `message`: one `[0] ++ message` when it fits, else up to
/// [`MAX_PARTS`] `[1, id (4, LE), index, count] ++ chunk`. `None` when even that is too small.
fn split(message: &[u8], id: u32) -> Option<Vec<Vec<u8>>> {
    if message.len() <= MAX_WHOLE_LEN {
        let mut whole = Vec::with_capacity(1 + message.len());
        whole.push(FRAME_WHOLE);
        whole.extend_from_slice(message);
        return Some(vec![whole]);
    }
    let count = message.len().div_ceil(MAX_CHUNK_LEN);
    if count > MAX_PARTS {
        return None;
    }
    let chunk_len = message.len().div_ceil(count);
    Some(
        message
            .chunks(chunk_len)
            .enumerate()
            .map(|(index, chunk)| {
                let mut part = Vec::with_capacity(PART_HEADER_LEN + chunk.len());
                part.push(FRAME_PART);
                part.extend_from_slice(&id.to_le_bytes());
                part.push(index as u8);
                part.push(count as u8);
                part.extend_from_slice(chunk);
                part
            })
            .collect(),
    )
}

fn parse_frame(plaintext: &[u8]) -> Result<Frame<'_>, &'static str> {
    match plaintext.first() {
        Some(&FRAME_WHOLE) => Ok(Frame::Whole(&plaintext[1..])),
        Some(&FRAME_PART) => {
            if plaintext.len() <= PART_HEADER_LEN {
                return Err("truncated part header");
            }
            let id = u32::from_le_bytes([plaintext[1], plaintext[2], plaintext[3], plaintext[4]]);
            let (index, count) = (plaintext[5], plaintext[6]);
            if !(2..=MAX_PARTS as u8).contains(&count) || index >= count {
                return Err("bad part numbering");
            }
            Ok(Frame::Part {
                id,
                index,
                count,
                chunk: &plaintext[PART_HEADER_LEN..],
            })
        }
        Some(_) => Err("unknown frame kind"),
        None => Err("empty datagram"),
    }
}

/// Messages partly received, keyed by sender and message id; at most
/// [`MAX_PARTIALS_PER_SENDER`] per sender and [`MAX_PARTIALS`] in all (the oldest go first).
#[derive(Default)]
struct Reassembly {
    partials: HashMap<(SocketAddr, u32), Partial>,
}

/// Unfinished messages kept per sender.
const MAX_PARTIALS_PER_SENDER: usize = 2;

struct Partial {
    parts: Vec<Option<Vec<u8>>>,
    started: Instant,
}

impl Reassembly {
    /// Adds a part; returns the whole message once its last part is in.
    fn add(
        &mut self,
        from: SocketAddr,
        id: u32,
        index: u8,
        count: u8,
        chunk: &[u8],
        now: Instant,
    ) -> Option<Vec<u8>> {
        self.partials
            .retain(|_, p| now.duration_since(p.started) < REASSEMBLY_TIMEOUT);
        let key = (from, id);
        if self
            .partials
            .get(&key)
            .is_some_and(|p| p.parts.len() != count as usize)
        {
            self.partials.remove(&key);
        }
        if !self.partials.contains_key(&key) {
            let from_sender = self.partials.keys().filter(|(a, _)| *a == from).count();
            if from_sender >= MAX_PARTIALS_PER_SENDER {
                self.remove_oldest(|(a, _)| *a == from);
            }
            if self.partials.len() >= MAX_PARTIALS {
                self.remove_oldest(|_| true);
            }
            let parts = vec![None; count as usize];
            self.partials.insert(
                key,
                Partial {
                    parts,
                    started: now,
                },
            );
        }
        let partial = self.partials.get_mut(&key)?;
        partial.parts[index as usize] = Some(chunk.to_vec());
        if partial.parts.iter().any(Option::is_none) {
            return None;
        }
        let partial = self.partials.remove(&key)?;
        Some(partial.parts.into_iter().flatten().flatten().collect())
    }

    fn remove_oldest(&mut self, matching: impl Fn(&(SocketAddr, u32)) -> bool) {
        let oldest = self
            .partials
            .iter()
            .filter(|(key, _)| matching(key))
            .min_by_key(|(_, p)| p.started)
            .map(|(key, _)| *key);
        if let Some(oldest) = oldest {
            self.partials.remove(&oldest);
        }
    }
}

/// Turns chitchat envelopes into bytes and back through chitchat's own public UDP socket, since
/// chitchat 0.13 keeps its (de)serialization crate-private.
///
/// Encoding: chitchat's socket `enc` sends the envelope to `enc_sink`, which reads the bytes.
/// Decoding: `dec_feed` sends the bytes to chitchat's socket `dec`, which parses them. All four
/// sockets are on loopback; the sinks are connected to their one peer and `dec`'s sender is
/// checked, so no other local process can inject into them.
struct LoopbackCodec {
    enc: Box<dyn Socket>,
    enc_sink: tokio::net::UdpSocket,
    enc_sink_addr: SocketAddr,
    dec: Box<dyn Socket>,
    dec_feed: tokio::net::UdpSocket,
    dec_feed_addr: SocketAddr,
    buf: Vec<u8>,
}

impl LoopbackCodec {
    async fn open() -> anyhow::Result<Self> {
        let v4 = Self::open_on(IpAddr::V4(Ipv4Addr::LOCALHOST)).await;
        match v4 {
            Ok(codec) => Ok(codec),
            Err(v4_error) => Self::open_on(IpAddr::V6(Ipv6Addr::LOCALHOST))
                .await
                .map_err(|_| {
                    v4_error.context(
                        "the gossip codec needs the loopback interface up (ip link set lo up)",
                    )
                }),
        }
    }

    async fn open_on(ip: IpAddr) -> anyhow::Result<Self> {
        let any = SocketAddr::new(ip, 0);
        let enc: Box<dyn Socket> = Box::new(chitchat::transport::UdpSocket::open(any).await?);
        let dec: Box<dyn Socket> = Box::new(chitchat::transport::UdpSocket::open(any).await?);
        let enc_sink = tokio::net::UdpSocket::bind(any).await?;
        enc_sink.connect(enc.local_addr()?).await?;
        let dec_feed = tokio::net::UdpSocket::bind(any).await?;
        dec_feed.connect(dec.local_addr()?).await?;
        Ok(Self {
            enc_sink_addr: enc_sink.local_addr()?,
            dec_feed_addr: dec_feed.local_addr()?,
            enc,
            enc_sink,
            dec,
            dec_feed,
            buf: vec![0; MAX_DATAGRAM + 1],
        })
    }

    /// The wire bytes of `envelope`.
    async fn encode(&mut self, envelope: ChitchatEnvelope) -> anyhow::Result<Vec<u8>> {
        // Anything left over from an earlier, failed round would be mistaken for this one.
        while self.enc_sink.try_recv(&mut self.buf).is_ok() {}
        let sent = self.enc.send(self.enc_sink_addr, envelope).await?;
        let n = tokio::time::timeout(Duration::from_secs(1), self.enc_sink.recv(&mut self.buf))
            .await
            .context("the loopback gossip codec did not deliver an encoded message")?
            .context("the loopback gossip codec failed")?;
        anyhow::ensure!(
            n == sent.num_bytes_sent,
            "the loopback gossip codec delivered {n} bytes for a {}-byte message",
            sent.num_bytes_sent
        );
        Ok(self.buf[..n].to_vec())
    }

    /// Hands wire bytes to the decoder; [`LoopbackCodec::decoded`] returns the envelope.
    async fn feed(&mut self, message: &[u8]) -> anyhow::Result<()> {
        self.dec_feed
            .send(message)
            .await
            .context("the loopback gossip codec failed")?;
        Ok(())
    }

    /// The next envelope fed in. Cancel-safe. Waits forever for bytes chitchat cannot parse
    /// (it logs and skips them), so callers bound it with a timeout.
    async fn decoded(&mut self) -> anyhow::Result<ChitchatEnvelope> {
        loop {
            let outcome = self.dec.recv().await?;
            if outcome.from_addr == self.dec_feed_addr {
                return Ok(outcome.envelope);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::secret::ClusterSecret;

    fn sealer(secret: &str) -> Sealer {
        Sealer::new(&ClusterSecret::from_text(secret, "test").unwrap())
    }

    async fn node(id: &str, secret: &str, seeds: Vec<String>) -> Membership {
        let mut config = MembershipConfig::new(
            id,
            "test-cluster",
            sealer(secret),
            "127.0.0.1:0".parse().unwrap(),
        );
        config.seeds = seeds;
        config.initial_key_values = vec![("facts".into(), format!("{{\"name\":\"{id}\"}}"))];
        Membership::start(config).await.unwrap()
    }

    const SECRET: &str = "membership test secret, long enough";

    fn ids(views: &[NodeView]) -> Vec<String> {
        views.iter().map(|v| v.id.clone()).collect()
    }

    /// Waits until every node's live set is exactly `expected`, or panics after `limit`.
    async fn converge(nodes: &[&Membership], expected: &[&str], limit: Duration) -> Duration {
        let start = Instant::now();
        loop {
            if nodes.iter().all(|n| ids(&n.live_nodes()) == expected) {
                return start.elapsed();
            }
            if start.elapsed() > limit {
                let seen: Vec<_> = nodes
                    .iter()
                    .map(|n| (n.node_id().to_string(), ids(&n.live_nodes())))
                    .collect();
                panic!("no agreement on {expected:?} within {limit:?}: {seen:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn chain_seeded_nodes_agree_and_share_key_values() {
        let a = node("a", SECRET, vec![]).await;
        let b = node("b", SECRET, vec![a.gossip_addr().to_string()]).await;
        let c = node("c", SECRET, vec![b.gossip_addr().to_string()]).await;
        assert_ne!(a.gossip_addr().port(), 0);
        let took = converge(&[&a, &b, &c], &["a", "b", "c"], Duration::from_secs(8)).await;
        println!("three nodes agreed in {took:?}");

        c.set("api", "{\"addr\":\"127.0.0.1:8080\"}").await.unwrap();
        let mut watch = a.watch();
        let view = tokio::time::timeout(
            Duration::from_secs(5),
            watch.wait_for(|views| {
                views
                    .iter()
                    .any(|v| v.id == "c" && v.key_values.contains_key("api"))
            }),
        )
        .await
        .expect("a did not see c's new key within 5 s")
        .unwrap()
        .clone();
        let c_view = view.iter().find(|v| v.id == "c").unwrap();
        assert_eq!(c_view.key_values["facts"], "{\"name\":\"c\"}");
        assert_eq!(c_view.key_values["api"], "{\"addr\":\"127.0.0.1:8080\"}");
        assert_eq!(c_view.gossip_addr, c.advertise_addr());
        assert!(b
            .live_nodes()
            .iter()
            .all(|v| !v.key_values.keys().any(|k| k.starts_with("__"))));
        assert_eq!(a.stats().refused, 0);
        assert!(a.stats().received > 0 && a.stats().sent > 0);
        assert!(a.dead_nodes().await.is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_node_with_another_secret_never_joins() {
        let a = node("a", SECRET, vec![]).await;
        let b = node("b", SECRET, vec![a.gossip_addr().to_string()]).await;
        let stranger = node(
            "stranger",
            "some other secret, also long",
            vec![a.gossip_addr().to_string()],
        )
        .await;
        converge(&[&a, &b], &["a", "b"], Duration::from_secs(8)).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(ids(&a.live_nodes()), ["a", "b"]);
        assert_eq!(ids(&b.live_nodes()), ["a", "b"]);
        assert_eq!(ids(&stranger.live_nodes()), ["stranger"]);
        assert!(
            a.stats().refused > 0,
            "a counted no refused datagrams: {:?}",
            a.stats()
        );
        assert_eq!(stranger.stats().received, 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_crashed_node_is_declared_dead_and_a_leaving_one_leaves() {
        let a = node("a", SECRET, vec![]).await;
        let b = node("b", SECRET, vec![a.gossip_addr().to_string()]).await;
        let c = node("c", SECRET, vec![a.gossip_addr().to_string()]).await;
        let d = node("d", SECRET, vec![a.gossip_addr().to_string()]).await;
        converge(
            &[&a, &b, &c, &d],
            &["a", "b", "c", "d"],
            Duration::from_secs(8),
        )
        .await;
        // Let the failure detector collect a few seconds of heartbeats, as in a running cluster.
        tokio::time::sleep(Duration::from_secs(2)).await;

        // Crash: the gossip task and its socket vanish without a word.
        let crashed = Instant::now();
        drop(c);
        let detected = loop {
            let a_dead = a.dead_nodes().await;
            let b_dead = b.dead_nodes().await;
            if a_dead == ["c"]
                && b_dead == ["c"]
                && !ids(&a.live_nodes()).contains(&"c".to_string())
            {
                break crashed.elapsed();
            }
            assert!(
                crashed.elapsed() < Duration::from_secs(5),
                "c not declared dead within 5 s: a {a_dead:?}, b {b_dead:?}"
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        };
        println!("crashed node declared dead by both peers after {detected:?}");
        assert_eq!(ids(&a.live_nodes()), ["a", "b", "d"]);

        // Graceful leave: much faster than the failure detector.
        let left = Instant::now();
        d.shutdown().await;
        let seen = loop {
            if ids(&a.live_nodes()) == ["a", "b"] && ids(&b.live_nodes()) == ["a", "b"] {
                break left.elapsed();
            }
            assert!(
                left.elapsed() < Duration::from_secs(5),
                "d did not leave within 5 s"
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        };
        println!("leaving node gone from both peers after {seen:?}");
        assert_eq!(a.dead_nodes().await, ["c", "d"]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn seeds_added_later_are_contacted() {
        let a = node("a", SECRET, vec![]).await;
        let b = node("b", SECRET, vec![]).await;
        // An address where nobody listens costs a few datagrams and nothing else.
        let silent = std::net::UdpSocket::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        assert!(b.add_seed(silent).unwrap());
        assert!(b.add_seed(a.gossip_addr()).unwrap());
        assert!(
            !b.add_seed(a.gossip_addr()).unwrap(),
            "a seed is added once"
        );
        assert!(
            !b.add_seed(b.gossip_addr()).unwrap(),
            "a node is not its own seed"
        );
        let took = converge(&[&a, &b], &["a", "b"], Duration::from_secs(5)).await;
        println!("added seed met in {took:?}");
        assert!(b.remove_seed(silent));
        assert!(!b.remove_seed(silent));
    }

    #[tokio::test]
    async fn bad_configs_and_keys_are_refused_with_a_reason() {
        let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let config =
            |id: &str, cluster: &str| MembershipConfig::new(id, cluster, sealer(SECRET), addr);
        assert!(matches!(
            Membership::start(config("", "x")).await,
            Err(MembershipError::EmptyField("node_id"))
        ));
        assert!(matches!(
            Membership::start(config("n", "")).await,
            Err(MembershipError::EmptyField("cluster_id"))
        ));
        let mut zero = config("n", "x");
        zero.gossip_interval = Duration::ZERO;
        assert!(matches!(
            Membership::start(zero).await,
            Err(MembershipError::ZeroInterval)
        ));
        let unspecified =
            MembershipConfig::new("n", "x", sealer(SECRET), "0.0.0.0:0".parse().unwrap());
        assert!(matches!(
            Membership::start(unspecified).await,
            Err(MembershipError::NoAdvertiseAddr(_))
        ));
        let mut advertised =
            MembershipConfig::new("n", "x", sealer(SECRET), "0.0.0.0:0".parse().unwrap());
        advertised.advertise_addr = Some("127.0.0.1:0".parse().unwrap());
        let m = Membership::start(advertised).await.unwrap();
        assert_eq!(m.advertise_addr().port(), m.gossip_addr().port());
        assert!(matches!(
            m.set("__leaving", "1").await,
            Err(MembershipError::ReservedKey(_))
        ));
        let big = "x".repeat(MAX_KEY_VALUE_LEN);
        let e = m.set("k", &big).await.unwrap_err();
        assert!(e.to_string().contains("more than"), "{e}");
        m.set("k", "v").await.unwrap();
        m.delete("k").await.unwrap();
        let taken = config("n2", "x");
        let taken = MembershipConfig {
            gossip_addr: m.gossip_addr(),
            ..taken
        };
        assert!(matches!(
            Membership::start(taken).await,
            Err(MembershipError::Bind { .. })
        ));
    }

    #[test]
    fn messages_split_and_reassemble_in_any_order() {
        let from: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let now = Instant::now();
        for len in [
            0,
            1,
            MAX_WHOLE_LEN,
            MAX_WHOLE_LEN + 1,
            MAX_DATAGRAM,
            3 * MAX_CHUNK_LEN + 5,
        ] {
            let message: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
            let parts = split(&message, 42).unwrap();
            assert_eq!(parts.len() > 1, len > MAX_WHOLE_LEN, "len {len}");
            for part in &parts {
                assert!(
                    part.len() + Sealer::OVERHEAD <= MAX_DATAGRAM,
                    "a {len}-byte message made a too-large datagram"
                );
            }
            let mut reassembly = Reassembly::default();
            let mut out = None;
            for part in parts.iter().rev() {
                out = match parse_frame(part).unwrap() {
                    Frame::Whole(m) => Some(m.to_vec()),
                    Frame::Part {
                        id,
                        index,
                        count,
                        chunk,
                    } => reassembly.add(from, id, index, count, chunk, now),
                };
            }
            assert_eq!(out.as_deref(), Some(&message[..]), "len {len}");
            assert!(reassembly.partials.is_empty());
        }
        assert!(split(&vec![0; MAX_PARTS * MAX_CHUNK_LEN + 1], 1).is_none());
    }

    #[test]
    fn unfinished_messages_interleave_expire_and_are_bounded() {
        let now = Instant::now();
        let a: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let mut r = Reassembly::default();
        // Two split messages from one sender may interleave.
        assert_eq!(r.add(a, 1, 0, 2, b"x", now), None);
        assert_eq!(r.add(a, 2, 0, 2, b"he", now), None);
        assert_eq!(r.add(a, 1, 1, 2, b"y", now).as_deref(), Some(&b"xy"[..]));
        assert_eq!(
            r.add(a, 2, 1, 2, b"llo", now).as_deref(),
            Some(&b"hello"[..])
        );
        // A third unfinished one pushes out the oldest.
        for id in 10..13 {
            assert_eq!(
                r.add(a, id, 0, 2, b"p", now + Duration::from_millis(id as u64)),
                None
            );
        }
        assert_eq!(r.partials.len(), MAX_PARTIALS_PER_SENDER);
        assert_eq!(
            r.add(a, 10, 1, 2, b"q", now),
            None,
            "message 10 was dropped, this starts anew"
        );
        // Expired parts are dropped.
        let later = now + REASSEMBLY_TIMEOUT + Duration::from_secs(1);
        assert_eq!(r.add(a, 3, 1, 2, b"b", later), None);
        assert_eq!(r.partials.len(), 1);
        // At most MAX_PARTIALS in all.
        for port in 0..(MAX_PARTIALS as u16 + 10) {
            r.add(SocketAddr::new(a.ip(), 1000 + port), 1, 0, 2, b"z", later);
        }
        assert_eq!(r.partials.len(), MAX_PARTIALS);
    }

    #[test]
    fn malformed_frames_are_rejected() {
        assert!(parse_frame(&[]).is_err());
        assert!(parse_frame(&[9, 1, 2]).is_err());
        assert!(
            parse_frame(&[FRAME_PART, 0, 0, 0, 0, 0, 2]).is_err(),
            "no chunk"
        );
        assert!(
            parse_frame(&[FRAME_PART, 0, 0, 0, 0, 2, 2, 1]).is_err(),
            "index past count"
        );
        assert!(
            parse_frame(&[FRAME_PART, 0, 0, 0, 0, 0, 1, 1]).is_err(),
            "a single part"
        );
        assert!(parse_frame(&[FRAME_PART, 0, 0, 0, 0, 0, MAX_PARTS as u8 + 1, 1]).is_err());
        assert_eq!(parse_frame(&[FRAME_WHOLE, 5]), Ok(Frame::Whole(&[5])));
    }

    #[test]
    fn refusals_are_logged_once_a_minute_per_sender() {
        let shared = Shared::new(sealer(SECRET), "n".into(), DEFAULT_GOSSIP_INTERVAL);
        let now = Instant::now();
        let ip: IpAddr = "192.0.2.9".parse().unwrap();
        assert!(shared.may_warn(ip, now));
        assert!(!shared.may_warn(ip, now + Duration::from_secs(59)));
        assert!(shared.may_warn(ip, now + Duration::from_secs(61)));
        // A flood of senders is bounded too.
        let logged = (0..2 * MAX_WARNED_ADDRS as u32)
            .filter(|i| shared.may_warn(IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i)), now))
            .count();
        assert_eq!(logged, MAX_WARNED_ADDRS - 1);
    }

    #[tokio::test]
    async fn a_message_in_parts_arrives_whole_and_junk_is_counted() {
        let shared = Arc::new(Shared::new(
            sealer(SECRET),
            "n".into(),
            DEFAULT_GOSSIP_INTERVAL,
        ));
        let transport = SealedTransport {
            socket: Mutex::new(Some(
                tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap(),
            )),
            shared: shared.clone(),
        };
        let mut socket = transport
            .open("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let to = socket.local_addr().unwrap();
        let peer = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let mut codec = LoopbackCodec::open().await.unwrap();
        let message = codec
            .encode(ChitchatEnvelope {
                version: ProtocolVersion::V1,
                message: chitchat::ChitchatMessage::BadCluster,
            })
            .await
            .unwrap();
        let part = |index: u8, chunk: &[u8]| {
            let mut p = vec![FRAME_PART, 7, 0, 0, 0, index, 2];
            p.extend_from_slice(chunk);
            shared.sealer.seal(&p)
        };
        let (first, second) = message.split_at(2);
        peer.send_to(b"not sealed at all", to).await.unwrap();
        peer.send_to(
            &sealer("another secret, long enough").seal(&[FRAME_WHOLE]),
            to,
        )
        .await
        .unwrap();
        peer.send_to(&shared.sealer.seal(&[42]), to).await.unwrap();
        peer.send_to(&part(1, second), to).await.unwrap();
        peer.send_to(&part(0, first), to).await.unwrap();
        let got = tokio::time::timeout(Duration::from_secs(2), socket.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got.from_addr, peer.local_addr().unwrap());
        assert_eq!(got.envelope.message, chitchat::ChitchatMessage::BadCluster);
        let stats = shared.stats();
        assert_eq!((stats.refused, stats.malformed, stats.received), (2, 1, 1));
    }

    #[tokio::test]
    async fn the_loopback_codec_round_trips_and_ignores_strangers() {
        let mut codec = LoopbackCodec::open().await.unwrap();
        // A stranger writing to the decoder is not taken for a fed message.
        let stranger = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let bytes = {
            let transport = SealedTransport {
                socket: Mutex::new(Some(
                    tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap(),
                )),
                shared: Arc::new(Shared::new(
                    sealer(SECRET),
                    "n".into(),
                    DEFAULT_GOSSIP_INTERVAL,
                )),
            };
            let _ = transport
                .open("127.0.0.1:0".parse().unwrap())
                .await
                .unwrap();
            assert!(
                transport
                    .open("127.0.0.1:0".parse().unwrap())
                    .await
                    .is_err(),
                "opened twice"
            );
            codec
                .encode(ChitchatEnvelope {
                    version: ProtocolVersion::V1,
                    message: chitchat::ChitchatMessage::BadCluster,
                })
                .await
                .unwrap()
        };
        stranger
            .send_to(&bytes, codec.dec.local_addr().unwrap())
            .await
            .unwrap();
        codec.feed(&bytes).await.unwrap();
        let envelope = tokio::time::timeout(Duration::from_secs(1), codec.decoded())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(envelope.message, chitchat::ChitchatMessage::BadCluster);
        assert!(
            tokio::time::timeout(Duration::from_millis(200), codec.decoded())
                .await
                .is_err(),
            "the stranger's copy came through"
        );
    }

    /// Runs whole nodes (discovery + membership) in network namespaces: three on a bridge, and
    /// three in a namespace whose only interface is `lo`. Each child is this test binary run
    /// again inside its namespace with `SHOAL_NETNS_CHILD` set.
    #[test]
    #[ignore = "needs root and iproute2: creates network namespaces, veths and a bridge"]
    fn discovery_and_gossip_across_network_namespaces() {
        if let Ok(id) = std::env::var("SHOAL_NETNS_CHILD") {
            return netns::child(&id);
        }
        netns::parent();
    }

    mod netns {
        use super::*;
        use crate::discovery::{Discovery, DiscoveryConfig, DiscoveryEvent};
        use std::process::{Command, Stdio};

        const TEST: &str = "membership::tests::discovery_and_gossip_across_network_namespaces";

        fn ip(args: &[&str]) {
            let status = Command::new("ip").args(args).status().expect("run ip");
            assert!(status.success(), "ip {args:?} failed");
        }

        /// Namespaces and links made by this test, removed on drop.
        #[derive(Default)]
        struct Made {
            namespaces: Vec<String>,
            links: Vec<String>,
        }

        impl Drop for Made {
            fn drop(&mut self) {
                for ns in &self.namespaces {
                    let _ = Command::new("ip").args(["netns", "del", ns]).status();
                }
                for link in &self.links {
                    // Deleting a namespace already took its veth pair with it.
                    let _ = Command::new("ip")
                        .args(["link", "del", link])
                        .stderr(Stdio::null())
                        .status();
                }
            }
        }

        pub(super) fn parent() {
            let tag = std::process::id() % 100_000;
            let mut made = Made::default();
            // Three namespaces on one bridge.
            let bridge = format!("shb{tag}");
            ip(&["link", "add", &bridge, "type", "bridge"]);
            made.links.push(bridge.clone());
            ip(&["link", "set", &bridge, "up"]);
            let mut children = Vec::new();
            for i in 1..=3 {
                let ns = format!("sh{tag}n{i}");
                ip(&["netns", "add", &ns]);
                made.namespaces.push(ns.clone());
                let host_end = format!("sh{tag}v{i}");
                ip(&[
                    "link", "add", &host_end, "type", "veth", "peer", "name", "eth0", "netns", &ns,
                ]);
                made.links.push(host_end.clone());
                ip(&["link", "set", &host_end, "master", &bridge]);
                ip(&["link", "set", &host_end, "up"]);
                ip(&[
                    "-n",
                    &ns,
                    "addr",
                    "add",
                    &format!("10.77.0.{i}/24"),
                    "dev",
                    "eth0",
                ]);
                ip(&["-n", &ns, "link", "set", "eth0", "up"]);
                ip(&["-n", &ns, "link", "set", "lo", "up"]);
                children.push((ns, format!("br{i}"), format!("10.77.0.{i}")));
            }
            // Three nodes in a namespace with nothing but loopback.
            let lo_ns = format!("sh{tag}lo");
            ip(&["netns", "add", &lo_ns]);
            made.namespaces.push(lo_ns.clone());
            ip(&["-n", &lo_ns, "link", "set", "lo", "up"]);
            for i in 1..=3 {
                children.push((lo_ns.clone(), format!("lo{i}"), "127.0.0.1".to_string()));
            }

            let exe = std::env::current_exe().unwrap();
            let running: Vec<_> = children
                .iter()
                .map(|(ns, id, addr)| {
                    let child = Command::new("ip")
                        .args(["netns", "exec", ns])
                        .arg(&exe)
                        .args(["--exact", TEST, "--ignored", "--nocapture"])
                        .env("SHOAL_NETNS_CHILD", id)
                        .env("SHOAL_NETNS_IP", addr)
                        .stdout(Stdio::piped())
                        .spawn()
                        .unwrap();
                    (id.clone(), child)
                })
                .collect();
            let mut results = BTreeMap::new();
            for (id, child) in running {
                let out = child.wait_with_output().unwrap();
                let text = String::from_utf8_lossy(&out.stdout).to_string();
                let line = text
                    .lines()
                    .find(|l| l.starts_with("SHOAL_LIVE"))
                    .unwrap_or("")
                    .to_string();
                println!("{id}: {line}");
                results.insert(id, line);
            }
            for (id, line) in &results {
                let group = if id.starts_with("br") { "br" } else { "lo" };
                let want = format!("{group}1,{group}2,{group}3");
                assert!(line.contains(&want), "{id} saw {line:?}, wanted {want}");
            }
        }

        pub(super) fn child(id: &str) {
            let ip: IpAddr = std::env::var("SHOAL_NETNS_IP").unwrap().parse().unwrap();
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async move {
                let tag = crate::secret::cluster_tag("netns-test");
                let any = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0);
                let mut config = MembershipConfig::new(id, tag.clone(), sealer(SECRET), any);
                config.advertise_addr = Some(SocketAddr::new(ip, 0));
                let m = Membership::start(config).await.unwrap();
                let gossip_port = m.gossip_addr().port();
                let mut d =
                    Discovery::start(DiscoveryConfig::new(id, tag, 7000, gossip_port)).unwrap();
                let start = Instant::now();
                while m.live_nodes().len() < 3 && start.elapsed() < Duration::from_secs(15) {
                    let next = tokio::time::timeout(Duration::from_millis(100), d.next()).await;
                    if let Ok(Some(DiscoveryEvent::Found(found))) = next {
                        let addr = SocketAddr::new(found.addrs[0], found.gossip_port);
                        println!("{id} found {} at {addr}", found.node_id);
                        let _ = m.add_seed(addr);
                    }
                }
                let live: Vec<String> = ids(&m.live_nodes());
                println!(
                    "SHOAL_LIVE {id} after {:?}: {}",
                    start.elapsed(),
                    live.join(",")
                );
                // Stay a little so slower peers finish too.
                tokio::time::sleep(Duration::from_secs(3)).await;
                d.shutdown().await;
                m.shutdown().await;
            });
        }
    }
}
