//! The node daemon: one running member of a cluster.
//!
//! `Node::start` binds the cluster port (TCP for sessions, UDP on the same number for
//! gossip), joins membership through the `--peer` seeds and whatever mDNS discovers,
//! publishes this node's facts, answers sessions from other nodes, and measures the link to
//! every live peer (round-trip time and bandwidth through a real session, refreshed every
//! `probe_interval`), publishing what it measured so every node sees every link. The
//! coordinator is the lowest live node id; it is computed, never elected, so a coordinator
//! that dies is replaced by the next lowest id without any hand-over.
//!
//! Everything a peer sends is untrusted: a session that fails authentication is refused and
//! counted (membership counts refused datagrams the same way), a malformed request ends
//! only that session, and every wait has a deadline.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

use crate::discovery::{Discovery, DiscoveryConfig, DiscoveryEvent};
use crate::facts::NodeFacts;
use crate::identity::Identity;
use crate::membership::{Membership, MembershipConfig};
use crate::mesh::SessionTransport;
use crate::protocol::{self, Hello, Request, Response, Versions, MAX_PROBE_BYTES};
use crate::seal::Sealer;
use crate::secret::{cluster_tag, ClusterSecret};
use crate::session::{self, Encryption, NodeKey, Session, SessionConfig};

/// Membership key holding a node's [`NodeFacts`] as JSON.
const FACTS_KEY: &str = "facts";
/// Membership key holding a node's measured links (peer id -> [`LinkFacts`]) as JSON.
const LINKS_KEY: &str = "links";
/// The largest byte range one fetch request may ask for.
pub const MAX_FETCH_BYTES: u64 = 16 << 20;
/// How long an incoming mesh link waits to be claimed by its rank.
const MESH_PARK: Duration = Duration::from_secs(120);
/// Unclaimed incoming mesh links kept at most.
const MESH_PARK_MAX: usize = 1024;
/// Bytes sent to measure a link's bandwidth.
const PROBE_BYTES: u64 = 4 << 20;
/// Round trips timed per link measurement (the median is kept).
const PINGS: usize = 7;
/// Message sizes whose round trips a link measurement times (median of [`PINGS`] each):
/// the hidden states a tensor split all-reduces and a pipeline hands on per decoded token,
/// from a 1k-wide model's (4 KiB) to a 16k-wide one's (64 KiB).
pub const SIZED_PROBES: [u64; 3] = [4 << 10, 16 << 10, 64 << 10];

/// How to run a node.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    pub identity: Identity,
    pub secret: ClusterSecret,
    /// Nodes only join clusters of the same name (and secret).
    pub cluster_name: String,
    /// Cluster address: TCP sessions and UDP gossip on the same port (0 picks a free one).
    pub listen: SocketAddr,
    /// The address others should dial when `listen` is a wildcard (default: the first
    /// non-loopback address mDNS would advertise, else loopback).
    pub advertise: Option<IpAddr>,
    /// Seeds: other nodes' cluster addresses, `host:port`.
    pub peers: Vec<String>,
    /// Advertise and browse on mDNS.
    pub mdns: bool,
    /// Encrypt the data plane (the handshake is always authenticated).
    pub encryption: Encryption,
    /// What this node publishes about itself (`listen` is filled in at start).
    pub facts: NodeFacts,
    /// How often links are measured again.
    pub probe_interval: Duration,
    /// How long a session handshake or a request may take.
    pub io_timeout: Duration,
    /// The most memory this node offers models, bytes (`None`: what is free).
    pub memory_limit: Option<u64>,
}

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("cannot bind the cluster address {addr}: {source}; pick another --listen")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("membership: {0}")]
    Membership(String),
    #[error("{0}")]
    Version(String),
}

/// Why a peer's hello was refused.
struct HelloRefused {
    message: String,
    /// Refused for its protocol version (kept in [`Node::incompatible_peers`]).
    incompatible: bool,
}

/// A node refused because its protocol version does not work with this node's.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct IncompatiblePeer {
    /// Its node id.
    pub node: String,
    /// The cluster address it was met at.
    pub address: String,
    /// Its versions.
    pub versions: Versions,
    /// Sessions with it refused.
    pub refused: u64,
    /// When the last one was, milliseconds since the Unix epoch.
    pub last_ms: u64,
}

/// One measured link, from the node that measured it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct LinkFacts {
    /// Median round-trip time of a small message through a session, microseconds.
    pub rtt_us: f64,
    /// Payload bandwidth of one probe through a session, Gbit/s.
    pub bandwidth_gbps: f64,
    /// When it was measured, milliseconds since the Unix epoch.
    pub measured_at_ms: u64,
    /// The far node's wall clock minus the measuring node's, milliseconds (from the clock
    /// in the far node's hello, against the middle of the handshake), when it told it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock_offset_ms: Option<i64>,
    /// Median round trips of messages of the sizes a split's hidden states take
    /// ([`SIZED_PROBES`]), ascending (absent from nodes older than this field).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sized: Vec<shoal_planner::SizedRoundTrip>,
}

/// A node as `shoal nodes` shows it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct NodeInfo {
    pub id: String,
    pub name: String,
    pub alive: bool,
    /// This is the node answering.
    #[serde(rename = "self")]
    pub is_self: bool,
    pub coordinator: bool,
    /// The last facts it published (absent until its first gossip arrives).
    pub facts: Option<NodeFacts>,
}

/// A link as `shoal links` shows it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct LinkInfo {
    pub from: String,
    pub to: String,
    #[serde(flatten)]
    pub facts: LinkFacts,
}

/// A request for the application, with where to send its answer.
pub type AppCall = (
    String,
    serde_json::Value,
    oneshot::Sender<Result<serde_json::Value, String>>,
);

/// Which link of which mesh an incoming session is.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct MeshKey {
    instance: String,
    generation: u64,
    from: u32,
    to: u32,
}

struct Inner {
    id: String,
    /// Incoming mesh links not yet claimed by their rank, with the dialing node and when
    /// they arrived.
    mesh_inbox: Mutex<HashMap<MeshKey, (String, Session, Instant)>>,
    mesh_arrived: tokio::sync::Notify,
    /// Where application requests go, once the application listens.
    app: Mutex<Option<mpsc::Sender<AppCall>>>,
    /// Files this node serves to fetches, by SHA-256.
    /// Files other nodes may fetch from, by SHA-256: each a model's files in order (one,
    /// or a split set's parts, read as if laid end to end).
    shared_files: Mutex<HashMap<String, Vec<std::path::PathBuf>>>,
    tag: String,
    session: SessionConfig,
    membership: Membership,
    links: Mutex<BTreeMap<String, LinkFacts>>,
    /// Facts last seen per node, kept for nodes that have since died.
    last_facts: Mutex<HashMap<String, (String, NodeFacts)>>,
    own_facts: Mutex<NodeFacts>,
    refused_sessions: AtomicU64,
    /// Nodes refused for their protocol version, by node id.
    incompatible: Mutex<BTreeMap<String, IncompatiblePeer>>,
    io_timeout: Duration,
    memory_limit: Option<u64>,
    /// Memory the node's instances hold, bytes (counted against `memory_limit`).
    memory_held: AtomicU64,
}

/// A running node; [`Node::shutdown`] stops it.
pub struct Node {
    inner: Arc<Inner>,
    listen: SocketAddr,
    stop: watch::Sender<bool>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    /// The task that feeds mDNS finds to membership; it unregisters on stop.
    discovery: Mutex<Option<JoinHandle<()>>>,
    /// How mDNS discovery is doing.
    mdns: Mdns,
}

/// mDNS discovery as this node runs it.
enum Mdns {
    /// Turned off (`--no-mdns`).
    Off,
    /// It could not start; the error.
    Failed(String),
    /// Running, with what it heard.
    Running(Arc<crate::discovery::Heard>),
}

/// Whether mDNS discovery works on this node, as `shoal doctor` reports it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum MdnsStatus {
    /// Turned off (`--no-mdns`): nodes join through `--peer` only.
    Off,
    /// The mDNS daemon could not start.
    Failed {
        /// Why.
        error: String,
    },
    /// Another node answered, or a multicast datagram came back: multicast passes.
    Passes,
    /// Multicast does not pass on this host's interfaces.
    Blocked {
        /// What failed.
        error: String,
    },
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("id", &self.inner.id)
            .field("listen", &self.listen)
            .finish()
    }
}

/// The sized round trips of a pair's measurements (each way), averaged size by size over
/// the measurements that timed that size.
fn mean_sized(measured: &[LinkFacts]) -> Vec<shoal_planner::SizedRoundTrip> {
    let Some(first) = measured.iter().find(|f| !f.sized.is_empty()) else {
        return Vec::new();
    };
    first
        .sized
        .iter()
        .map(|m| {
            let same: Vec<f64> = measured
                .iter()
                .flat_map(|f| f.sized.iter().filter(|x| x.bytes == m.bytes))
                .map(|x| x.rtt_us)
                .collect();
            shoal_planner::SizedRoundTrip {
                bytes: m.bytes,
                rtt_us: same.iter().sum::<f64>() / same.len() as f64,
            }
        })
        .collect()
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Binds TCP and UDP on one port number (retrying when port 0 gave a TCP port whose UDP
/// twin is taken).
async fn bind_pair(addr: SocketAddr) -> Result<(TcpListener, SocketAddr), NodeError> {
    let mut last = None;
    for _ in 0..16 {
        let tcp = TcpListener::bind(addr)
            .await
            .map_err(|source| NodeError::Bind { addr, source })?;
        let bound = tcp
            .local_addr()
            .map_err(|source| NodeError::Bind { addr, source })?;
        // Probe that UDP can have the same number; membership binds it for real.
        match UdpSocket::bind(bound).await {
            Ok(udp) => {
                drop(udp);
                return Ok((tcp, bound));
            }
            Err(e) if addr.port() == 0 => last = Some(e),
            Err(source) => return Err(NodeError::Bind { addr, source }),
        }
    }
    Err(NodeError::Bind {
        addr,
        source: last.unwrap_or_else(|| std::io::Error::other("no free port pair")),
    })
}

impl Node {
    /// Starts the node: binds, joins, and begins answering and measuring.
    ///
    /// # Errors
    /// The cluster port cannot be bound, or membership cannot start.
    pub async fn start(mut cfg: NodeConfig) -> Result<Node, NodeError> {
        let versions = protocol::ours().map_err(NodeError::Version)?;
        cfg.facts.protocol = versions.version;
        cfg.facts.oldest_protocol = versions.oldest;
        let (listener, bound) = bind_pair(cfg.listen).await?;
        let advertise_ip = match (bound.ip().is_unspecified(), cfg.advertise) {
            (_, Some(ip)) => ip,
            (false, None) => bound.ip(),
            (true, None) => IpAddr::from([127, 0, 0, 1]),
        };
        let advertise = SocketAddr::new(advertise_ip, bound.port());
        cfg.facts.listen = advertise.to_string();
        let tag = cluster_tag(&cfg.cluster_name);
        let mut mcfg = MembershipConfig::new(
            cfg.identity.id.clone(),
            tag.clone(),
            Sealer::new(&cfg.secret),
            bound,
        );
        mcfg.advertise_addr = Some(advertise);
        mcfg.seeds = cfg.peers.clone();
        mcfg.initial_key_values = vec![(
            FACTS_KEY.to_string(),
            serde_json::to_string(&cfg.facts).expect("facts serialize"),
        )];
        let membership = Membership::start(mcfg)
            .await
            .map_err(|e| NodeError::Membership(e.to_string()))?;
        let inner = Arc::new(Inner {
            id: cfg.identity.id.clone(),
            tag: tag.clone(),
            session: SessionConfig {
                psk: cfg.secret.noise_psk(),
                key: NodeKey::from_private(&cfg.identity.key),
                handshake_timeout: cfg.io_timeout,
                encryption: cfg.encryption,
                max_message: (MAX_PROBE_BYTES as usize) + (1 << 20),
            },
            membership,
            links: Mutex::new(BTreeMap::new()),
            last_facts: Mutex::new(HashMap::new()),
            own_facts: Mutex::new(cfg.facts.clone()),
            refused_sessions: AtomicU64::new(0),
            incompatible: Mutex::new(BTreeMap::new()),
            io_timeout: cfg.io_timeout,
            memory_limit: cfg.memory_limit,
            memory_held: AtomicU64::new(0),
            mesh_inbox: Mutex::new(HashMap::new()),
            mesh_arrived: tokio::sync::Notify::new(),
            app: Mutex::new(None),
            shared_files: Mutex::new(HashMap::new()),
        });
        let (stop, stop_rx) = watch::channel(false);
        let tasks = vec![
            tokio::spawn(accept_loop(inner.clone(), listener, stop_rx.clone())),
            tokio::spawn(probe_loop(
                inner.clone(),
                cfg.probe_interval,
                stop_rx.clone(),
            )),
        ];
        let mut mdns = Mdns::Off;
        let discovery = if cfg.mdns {
            let mut dcfg =
                DiscoveryConfig::new(cfg.identity.id.clone(), tag, bound.port(), bound.port());
            // advertise where this node listens: a node bound to one address (loopback, or
            // one LAN address) is reachable there only
            if !bound.ip().is_unspecified() || cfg.advertise.is_some() {
                dcfg.advertise_ip = Some(advertise_ip);
            }
            match Discovery::start(dcfg) {
                Ok(d) => {
                    mdns = Mdns::Running(d.heard());
                    Some(tokio::spawn(seed_from_discovery(
                        inner.clone(),
                        d,
                        stop_rx.clone(),
                    )))
                }
                Err(e) => {
                    tracing::warn!(error = %e, "mDNS discovery is off; nodes join through --peer seeds only");
                    mdns = Mdns::Failed(e.to_string());
                    None
                }
            }
        } else {
            None
        };
        tracing::info!(node = %inner.id, listen = %advertise, "cluster node started");
        Ok(Node {
            inner,
            listen: advertise,
            stop,
            tasks: Mutex::new(tasks),
            discovery: Mutex::new(discovery),
            mdns,
        })
    }

    /// Whether mDNS discovery works here (may take half a second to try multicast).
    pub async fn mdns_status(&self) -> MdnsStatus {
        match &self.mdns {
            Mdns::Off => MdnsStatus::Off,
            Mdns::Failed(e) => MdnsStatus::Failed { error: e.clone() },
            Mdns::Running(heard) if heard.other.load(Ordering::Relaxed) => MdnsStatus::Passes,
            Mdns::Running(_) => {
                match tokio::task::spawn_blocking(crate::discovery::multicast_passes).await {
                    Ok(Ok(())) => MdnsStatus::Passes,
                    Ok(Err(error)) => MdnsStatus::Blocked { error },
                    Err(e) => MdnsStatus::Blocked {
                        error: e.to_string(),
                    },
                }
            }
        }
    }

    /// This node's id.
    pub fn id(&self) -> &str {
        &self.inner.id
    }

    /// The cluster address others dial.
    pub fn listen_addr(&self) -> SocketAddr {
        self.listen
    }

    /// Sessions refused since start (wrong secret, not a shoal node, wrong cluster).
    pub fn refused_sessions(&self) -> u64 {
        self.inner.refused_sessions.load(Ordering::Relaxed)
    }

    /// Nodes refused for a protocol version that does not work with this node's, with how
    /// often and when last.
    pub fn incompatible_peers(&self) -> Vec<IncompatiblePeer> {
        self.inner
            .incompatible
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .cloned()
            .collect()
    }

    /// Gossip datagrams refused since start (they failed to open with the cluster key).
    pub fn refused_datagrams(&self) -> u64 {
        self.inner.membership.stats().refused
    }

    /// Every node this one knows of, live ones first, by id.
    pub async fn nodes(&self) -> Vec<NodeInfo> {
        self.inner.nodes().await
    }

    /// The lowest live node id.
    pub fn coordinator(&self) -> Option<String> {
        self.inner
            .membership
            .live_nodes()
            .into_iter()
            .map(|v| v.id)
            .min()
    }

    /// Every link measured by a live node.
    pub fn links(&self) -> Vec<LinkInfo> {
        let mut out = Vec::new();
        for view in self.inner.membership.live_nodes() {
            let Some(json) = view.key_values.get(LINKS_KEY) else {
                continue;
            };
            let Ok(map) = serde_json::from_str::<BTreeMap<String, LinkFacts>>(json) else {
                continue;
            };
            for (to, facts) in map {
                out.push(LinkInfo {
                    from: view.id.clone(),
                    to,
                    facts,
                });
            }
        }
        out.sort_by(|a, b| (&a.from, &a.to).cmp(&(&b.from, &b.to)));
        out
    }

    /// The live cluster as the planner sees it: live nodes with facts that compute (not
    /// entry nodes) and speak a protocol version this node works with, and each pair's link
    /// (the mean of both directions where both were measured).
    pub async fn planner_view(
        &self,
    ) -> (Vec<shoal_planner::NodeSpec>, Vec<shoal_planner::LinkSpec>) {
        let ours = protocol::ours_checked();
        let nodes: Vec<_> = self
            .nodes()
            .await
            .into_iter()
            .filter(|n| n.alive)
            .filter_map(|n| {
                n.facts
                    .filter(|f| !f.entry_only && ours.works_with(f.versions()))
                    .map(|f| f.to_spec(&n.id))
            })
            .collect();
        let mut pairs: BTreeMap<(String, String), Vec<LinkFacts>> = BTreeMap::new();
        for l in self.links() {
            let key = if l.from < l.to {
                (l.from, l.to)
            } else {
                (l.to, l.from)
            };
            pairs.entry(key).or_default().push(l.facts);
        }
        let links = pairs
            .into_iter()
            .filter(|((a, b), _)| {
                nodes.iter().any(|n| &n.id == a) && nodes.iter().any(|n| &n.id == b)
            })
            .map(|((a, b), v)| shoal_planner::LinkSpec {
                a,
                b,
                rtt_us: v.iter().map(|f| f.rtt_us).sum::<f64>() / v.len() as f64,
                bandwidth_gbps: v.iter().map(|f| f.bandwidth_gbps).sum::<f64>() / v.len() as f64,
                rdma: false,
                sized: mean_sized(&v),
            })
            .collect();
        (nodes, links)
    }

    /// The ids of the live nodes, this one included, sorted.
    pub fn live_ids(&self) -> Vec<String> {
        self.inner.live_ids()
    }

    /// Publishes `value` under `key` in this node's gossiped state.
    ///
    /// # Errors
    /// The key or value is too large or malformed for membership.
    pub async fn publish(&self, key: &str, value: &str) -> Result<(), String> {
        self.inner
            .membership
            .set(key, value)
            .await
            .map_err(|e| e.to_string())
    }

    /// What each live node (this one included) publishes under `key`, by node id.
    pub fn published(&self, key: &str) -> Vec<(String, String)> {
        self.inner
            .membership
            .live_nodes()
            .into_iter()
            .filter_map(|v| v.key_values.get(key).map(|x| (v.id.clone(), x.clone())))
            .collect()
    }

    /// Receives the requests other nodes send this node's application ([`Node::ask`]).
    /// A later call replaces the earlier receiver.
    pub fn app_requests(&self) -> mpsc::Receiver<AppCall> {
        let (tx, rx) = mpsc::channel(64);
        *self.inner.app.lock().unwrap() = Some(tx);
        rx
    }

    /// Sends `body` to the application of node `node` (this one included) and returns its
    /// answer.
    ///
    /// # Errors
    /// The node is unknown or unreachable, does not answer within the I/O timeout, or its
    /// application refused.
    pub async fn ask(
        &self,
        node: &str,
        body: serde_json::Value,
        timeout: Duration,
    ) -> Result<serde_json::Value, String> {
        let addr = self.inner.address_of(node).await?;
        let (mut s, hello) = self.inner.dial(addr).await?;
        match self
            .inner
            .request(&mut s, &hello.node, &Request::App { body }, None, timeout)
            .await?
        {
            Response::App { body } => Ok(body),
            other => Err(format!(
                "node {node} answered {other:?} to an application request"
            )),
        }
    }

    /// Lets other nodes fetch byte ranges of the files at `paths` laid end to end (one file,
    /// or a split set's parts in order), whose SHA-256 together is `sha256`.
    pub fn share_file(&self, sha256: &str, paths: Vec<std::path::PathBuf>) {
        self.inner
            .shared_files
            .lock()
            .unwrap()
            .insert(sha256.to_ascii_lowercase(), paths);
    }

    /// Stops serving the file `sha256` to other nodes.
    pub fn unshare_file(&self, sha256: &str) {
        self.inner
            .shared_files
            .lock()
            .unwrap()
            .remove(&sha256.to_ascii_lowercase());
    }

    /// `len` bytes (at most [`MAX_FETCH_BYTES`]) at `offset` of the file `sha256` from node
    /// `node`.
    ///
    /// # Errors
    /// The node is unreachable, does not have the file, or sent another length.
    pub async fn fetch(
        &self,
        node: &str,
        sha256: &str,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, String> {
        let addr = self.inner.address_of(node).await?;
        let (mut s, hello) = self.inner.dial(addr).await?;
        let req = Request::Fetch {
            sha256: sha256.to_string(),
            offset,
            len,
        };
        let t = self.inner.io_timeout * 6;
        match self
            .inner
            .request(&mut s, &hello.node, &req, None, t)
            .await?
        {
            Response::Bytes { len: n } if n == len => {}
            other => return Err(format!("node {node} answered {other:?} to a fetch")),
        }
        let bytes = tokio::time::timeout(t, s.recv())
            .await
            .map_err(|_| format!("node {node} did not send the bytes within {t:?}"))?
            .map_err(|e| e.to_string())?;
        if bytes.len() as u64 != len {
            return Err(format!(
                "node {node} sent {} bytes for a range of {len}",
                bytes.len()
            ));
        }
        Ok(bytes)
    }

    /// Joins rank `rank` of generation `generation` of instance `instance`, whose ranks run
    /// on `rank_nodes` (node ids in rank order): dials every lower rank's node and waits for
    /// every higher rank to dial, each link an authenticated session.
    ///
    /// # Errors
    /// A node is unknown or unreachable, or a rank does not connect before `deadline`.
    pub async fn open_mesh(
        &self,
        instance: &str,
        generation: u64,
        rank: usize,
        rank_nodes: &[String],
        deadline: Instant,
    ) -> Result<SessionTransport, String> {
        let world = rank_nodes.len();
        if rank >= world {
            return Err(format!("rank {rank} of a world of {world}"));
        }
        let mut sessions: Vec<Option<(String, Session)>> = (0..world).map(|_| None).collect();
        for (p, node) in rank_nodes.iter().enumerate().take(rank) {
            let s = loop {
                let attempt = async {
                    let addr = self.inner.address_of(node).await?;
                    let (mut s, hello) = self.inner.dial(addr).await?;
                    let req = Request::Mesh {
                        instance: instance.to_string(),
                        generation,
                        from: rank as u32,
                        to: p as u32,
                        world: world as u32,
                    };
                    match self
                        .inner
                        .request(&mut s, &hello.node, &req, None, self.inner.io_timeout)
                        .await?
                    {
                        Response::MeshAccepted => Ok(s),
                        other => Err(format!("node {node} answered {other:?} to a mesh link")),
                    }
                };
                match attempt.await {
                    Ok(s) => break s,
                    Err(e) if Instant::now() < deadline => {
                        tracing::debug!(
                            instance,
                            rank,
                            peer = p,
                            "mesh dial failed, retrying: {e}"
                        );
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    Err(e) => {
                        return Err(format!(
                            "rank {rank} could not reach rank {p} on node {node}: {e}"
                        ))
                    }
                }
            };
            sessions[p] = Some((node.clone(), s));
        }
        for (p, node) in rank_nodes.iter().enumerate().skip(rank + 1) {
            let key = MeshKey {
                instance: instance.to_string(),
                generation,
                from: p as u32,
                to: rank as u32,
            };
            let s = loop {
                let arrived = self.inner.mesh_arrived.notified();
                if let Some((from_node, s, _)) = self.inner.mesh_inbox.lock().unwrap().remove(&key)
                {
                    if &from_node != node {
                        return Err(format!(
                            "node {from_node} dialed as rank {p}, which runs on node {node}; the                              nodes disagree about the placement"
                        ));
                    }
                    break s;
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(format!(
                        "rank {p} on node {node} did not connect to rank {rank} in time"
                    ));
                }
                let _ = tokio::time::timeout(left.min(Duration::from_millis(500)), arrived).await;
            };
            sessions[p] = Some((node.clone(), s));
        }
        SessionTransport::new(rank, sessions).map_err(|e| e.to_string())
    }

    /// Whether node `id` is certainly gone: a connection to its cluster address is refused,
    /// so nothing listens there any more (its process ended; a restarted node is a new
    /// incarnation). Anything else (accepted, timed out, an unknown node) proves nothing,
    /// and the failure detector decides.
    pub async fn refuses_connections(&self, id: &str) -> bool {
        let Ok(addr) = self.inner.address_of(id).await else {
            return false;
        };
        match tokio::time::timeout(
            Duration::from_millis(500),
            tokio::net::TcpStream::connect(addr),
        )
        .await
        {
            Ok(Err(e)) => e.kind() == std::io::ErrorKind::ConnectionRefused,
            _ => false,
        }
    }

    /// Records the memory this node's instances hold (bytes) and publishes its free memory
    /// again if that changed it.
    pub async fn set_memory_held(&self, bytes: u64) {
        if self.inner.memory_held.swap(bytes, Ordering::Relaxed) != bytes {
            self.inner.publish_memory().await;
        }
    }

    /// Changes this node's published facts.
    pub async fn update_facts(&self, update: impl FnOnce(&mut NodeFacts)) {
        self.inner.update_facts(update).await;
    }

    /// Leaves the cluster: stops discovery, gossip and sessions. Idempotent.
    pub async fn shutdown(&self) {
        let _ = self.stop.send(true);
        let discovery = self.discovery.lock().unwrap().take();
        if let Some(d) = discovery {
            // it unregisters from mDNS (bounded inside) and ends
            let _ = tokio::time::timeout(Duration::from_secs(5), d).await;
        }
        self.inner.membership.shutdown().await;
        let tasks: Vec<_> = self.tasks.lock().unwrap().drain(..).collect();
        for t in tasks {
            t.abort();
            let _ = t.await;
        }
    }
}

impl Inner {
    async fn update_facts(&self, update: impl FnOnce(&mut NodeFacts)) {
        let json = {
            let mut f = self.own_facts.lock().unwrap();
            let before = f.clone();
            update(&mut f);
            if *f == before {
                return;
            }
            serde_json::to_string(&*f).expect("facts serialize")
        };
        if let Err(e) = self.membership.set(FACTS_KEY, &json).await {
            tracing::warn!(error = %e, "publishing this node's facts failed");
        }
    }

    /// Publishes the node's total and free memory: what `/proc/meminfo` says is available
    /// (rounded down to 64 MiB, so noise does not gossip), and under `--max-memory` at most
    /// the limit less what its instances hold (exactly: the coordinator adds back what a
    /// re-placed instance held, and a rounded figure would come up short of the limit).
    async fn publish_memory(&self) {
        let Some((total, free)) = crate::facts::memory() else {
            return;
        };
        let cap = self
            .memory_limit
            .map(|l| l.saturating_sub(self.memory_held.load(Ordering::Relaxed)))
            .unwrap_or(u64::MAX);
        self.update_facts(|f| {
            f.memory_total_bytes = total;
            f.memory_free_bytes = (free >> 26 << 26).min(cap);
        })
        .await;
    }

    /// The cluster address of live node `node`, from its published facts.
    async fn address_of(&self, node: &str) -> Result<SocketAddr, String> {
        let nodes = self.nodes().await;
        let n = nodes
            .iter()
            .find(|n| n.id == node && n.alive)
            .ok_or_else(|| format!("node {node} is not a live member of the cluster"))?;
        let f = n
            .facts
            .as_ref()
            .ok_or_else(|| format!("node {node} has not published its address yet"))?;
        f.listen
            .parse()
            .map_err(|_| format!("node {node} published an unusable address {:?}", f.listen))
    }

    fn live_ids(&self) -> Vec<String> {
        self.membership
            .live_nodes()
            .into_iter()
            .map(|v| v.id)
            .collect()
    }

    async fn nodes(&self) -> Vec<NodeInfo> {
        let live = self.membership.live_nodes();
        let dead = self.membership.dead_nodes().await;
        let mut last = self.last_facts.lock().unwrap();
        let mut out = Vec::new();
        for view in &live {
            if let Some(f) = view
                .key_values
                .get(FACTS_KEY)
                .and_then(|j| serde_json::from_str::<NodeFacts>(j).ok())
            {
                last.insert(view.id.clone(), (f.name.clone(), f));
            }
            let facts = last.get(&view.id).map(|(_, f)| f.clone());
            out.push(NodeInfo {
                id: view.id.clone(),
                name: facts.as_ref().map(|f| f.name.clone()).unwrap_or_default(),
                alive: true,
                is_self: view.id == self.id,
                coordinator: false,
                facts,
            });
        }
        for id in dead {
            if out.iter().any(|n| n.id == id) {
                continue;
            }
            let facts = last.get(&id).map(|(_, f)| f.clone());
            out.push(NodeInfo {
                name: facts.as_ref().map(|f| f.name.clone()).unwrap_or_default(),
                id,
                alive: false,
                is_self: false,
                coordinator: false,
                facts,
            });
        }
        out.sort_by(|a, b| (!a.alive, &a.id).cmp(&(!b.alive, &b.id)));
        if let Some(first) = out.iter_mut().find(|n| n.alive) {
            first.coordinator = true;
        }
        out
    }

    fn hello(&self) -> Vec<u8> {
        protocol::encode(&Hello {
            node: self.id.clone(),
            cluster: self.tag.clone(),
            version: protocol::ours_checked().version,
            oldest: protocol::ours_checked().oldest,
            clock_ms: now_ms(),
        })
    }

    /// The peer's hello, checked.
    fn check_hello(&self, addr: SocketAddr, s: &Session) -> Result<Hello, HelloRefused> {
        let other = |message: String| HelloRefused {
            message,
            incompatible: false,
        };
        let h: Hello = protocol::decode(&addr.to_string(), "hello", s.peer_hello())
            .map_err(|e| other(e.to_string()))?;
        let ours = protocol::ours_checked();
        if !ours.works_with(h.versions()) {
            self.incompatible
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(h.node.clone())
                .and_modify(|p| {
                    p.refused += 1;
                    p.last_ms = now_ms();
                    p.address = addr.to_string();
                    p.versions = h.versions();
                })
                .or_insert(IncompatiblePeer {
                    node: h.node.clone(),
                    address: addr.to_string(),
                    versions: h.versions(),
                    refused: 1,
                    last_ms: now_ms(),
                });
            let older = if h.version < ours.version {
                format!("node {}", h.node)
            } else {
                "this node".to_string()
            };
            return Err(HelloRefused {
                message: format!(
                    "node {} at {addr} speaks cluster protocol {}, this node speaks {ours}: they \
                     do not work together; upgrade {older} to a shoal release that works with \
                     the other",
                    h.node,
                    h.versions()
                ),
                incompatible: true,
            });
        }
        if h.cluster != self.tag {
            return Err(other(format!(
                "node {} at {addr} belongs to another cluster name (same secret); give both the same --cluster",
                h.node
            )));
        }
        Ok(h)
    }

    /// Opens a session to `addr`.
    async fn dial(&self, addr: SocketAddr) -> Result<(Session, Hello), String> {
        let stream = tokio::time::timeout(self.io_timeout, TcpStream::connect(addr))
            .await
            .map_err(|_| format!("connecting to {addr} timed out"))?
            .map_err(|e| format!("connecting to {addr}: {e}"))?;
        let _ = stream.set_nodelay(true);
        let s = session::connect(stream, &self.session, &self.hello())
            .await
            .map_err(|e| e.to_string())?;
        let h = self.check_hello(addr, &s).map_err(|e| e.message)?;
        Ok((s, h))
    }

    /// Measures the link to the node at `addr`.
    async fn measure(&self, addr: SocketAddr) -> Result<(String, LinkFacts), String> {
        let before = now_ms();
        let (mut s, hello) = self.dial(addr).await?;
        let after = now_ms();
        let clock_offset_ms = (hello.clock_ms > 0)
            .then(|| hello.clock_ms as i64 - (before as i64 + after as i64) / 2);
        let t = self.io_timeout;
        let mut rtts = Vec::with_capacity(PINGS);
        for _ in 0..PINGS {
            let t0 = Instant::now();
            self.request(&mut s, &hello.node, &Request::Ping, None, t)
                .await?;
            rtts.push(t0.elapsed().as_secs_f64() * 1e6);
        }
        rtts.sort_by(f64::total_cmp);
        let rtt_us = rtts[PINGS / 2];
        let payload = vec![0x5a; PROBE_BYTES as usize];
        let t0 = Instant::now();
        self.request(
            &mut s,
            &hello.node,
            &Request::Probe { bytes: PROBE_BYTES },
            Some(&payload),
            t,
        )
        .await?;
        let secs = (t0.elapsed().as_secs_f64() - rtt_us / 2e6).max(1e-6);
        let mut sized = Vec::with_capacity(SIZED_PROBES.len());
        for bytes in SIZED_PROBES {
            let payload = vec![0x5a; bytes as usize];
            let mut rtts = Vec::with_capacity(PINGS);
            for _ in 0..PINGS {
                let t0 = Instant::now();
                self.request(
                    &mut s,
                    &hello.node,
                    &Request::Probe { bytes },
                    Some(&payload),
                    t,
                )
                .await?;
                rtts.push(t0.elapsed().as_secs_f64() * 1e6);
            }
            rtts.sort_by(f64::total_cmp);
            sized.push(shoal_planner::SizedRoundTrip {
                bytes,
                rtt_us: rtts[PINGS / 2],
            });
        }
        Ok((
            hello.node,
            LinkFacts {
                rtt_us,
                bandwidth_gbps: PROBE_BYTES as f64 * 8.0 / secs / 1e9,
                measured_at_ms: now_ms(),
                clock_offset_ms,
                sized,
            },
        ))
    }

    async fn request(
        &self,
        s: &mut Session,
        peer: &str,
        req: &Request,
        payload: Option<&[u8]>,
        t: Duration,
    ) -> Result<Response, String> {
        let io = async {
            s.send(&protocol::encode(req))
                .await
                .map_err(|e| e.to_string())?;
            if let Some(p) = payload {
                s.send(p).await.map_err(|e| e.to_string())?;
            }
            let bytes = s.recv().await.map_err(|e| e.to_string())?;
            protocol::decode::<Response>(peer, "response", &bytes).map_err(|e| e.to_string())
        };
        let r = tokio::time::timeout(t, io)
            .await
            .map_err(|_| format!("node {peer} did not answer within {t:?}"))??;
        match r {
            Response::Error { message } => Err(format!("node {peer} refused: {message}")),
            r => Ok(r),
        }
    }

    /// Answers one session until the peer closes it.
    async fn serve_session(self: Arc<Self>, stream: TcpStream, addr: SocketAddr) {
        let _ = stream.set_nodelay(true);
        let mut s = match session::accept(stream, &self.session, &self.hello()).await {
            Ok(s) => s,
            Err(e) => {
                self.refused_sessions.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(peer = %addr, error = %e, "session refused");
                return;
            }
        };
        let hello = match self.check_hello(addr, &s) {
            Ok(h) => h,
            Err(e) => {
                // a node of another version is one of ours, counted apart from strangers
                if !e.incompatible {
                    self.refused_sessions.fetch_add(1, Ordering::Relaxed);
                }
                tracing::warn!(peer = %addr, "session refused: {}", e.message);
                return;
            }
        };
        loop {
            let bytes = match s.recv().await {
                Ok(b) => b,
                Err(_) => return, // closed or broken: the peer is gone
            };
            let resp = match protocol::decode::<Request>(&hello.node, "request", &bytes) {
                Ok(Request::Ping) => Response::Pong,
                Ok(Request::Probe { bytes }) if bytes > MAX_PROBE_BYTES => Response::Error {
                    message: format!("probe of {bytes} bytes is above the limit {MAX_PROBE_BYTES}"),
                },
                Ok(Request::Mesh {
                    instance,
                    generation,
                    from,
                    to,
                    world,
                }) => {
                    if from >= world || to >= world || from <= to {
                        Response::Error {
                            message: format!(
                                "a mesh link from rank {from} to rank {to} of {world}: higher ranks dial lower ones"
                            ),
                        }
                    } else {
                        if s.send(&protocol::encode(&Response::MeshAccepted))
                            .await
                            .is_err()
                        {
                            return;
                        }
                        let key = MeshKey {
                            instance,
                            generation,
                            from,
                            to,
                        };
                        let mut inbox = self.mesh_inbox.lock().unwrap();
                        inbox.retain(|_, (_, _, at)| at.elapsed() < MESH_PARK);
                        if inbox.len() >= MESH_PARK_MAX {
                            tracing::warn!(node = %hello.node, "too many unclaimed mesh links; dropping this one");
                            return;
                        }
                        inbox.insert(key, (hello.node.clone(), s, Instant::now()));
                        drop(inbox);
                        self.mesh_arrived.notify_waiters();
                        return;
                    }
                }
                Ok(Request::App { body }) => {
                    let tx = self.app.lock().unwrap().clone();
                    match tx {
                        None => Response::Error {
                            message: "this node runs no application that takes requests".into(),
                        },
                        Some(tx) => {
                            let (atx, arx) = oneshot::channel();
                            if tx.send((hello.node.clone(), body, atx)).await.is_err() {
                                Response::Error {
                                    message: "this node's application stopped".into(),
                                }
                            } else {
                                match arx.await {
                                    Ok(Ok(body)) => Response::App { body },
                                    Ok(Err(message)) => Response::Error { message },
                                    Err(_) => Response::Error {
                                        message: "this node's application dropped the request"
                                            .into(),
                                    },
                                }
                            }
                        }
                    }
                }
                Ok(Request::Fetch {
                    sha256,
                    offset,
                    len,
                }) => {
                    let path = self
                        .shared_files
                        .lock()
                        .unwrap()
                        .get(&sha256.to_ascii_lowercase())
                        .cloned();
                    match read_range(path, &sha256, offset, len).await {
                        Ok(bytes) => {
                            let head = Response::Bytes { len };
                            if s.send(&protocol::encode(&head)).await.is_err()
                                || s.send(&bytes).await.is_err()
                            {
                                return;
                            }
                            continue;
                        }
                        Err(message) => Response::Error { message },
                    }
                }
                Ok(Request::Probe { bytes }) => {
                    match tokio::time::timeout(self.io_timeout, s.recv()).await {
                        Ok(Ok(p)) if p.len() as u64 == bytes => Response::ProbeReceived { bytes },
                        Ok(Ok(p)) => Response::Error {
                            message: format!("probe announced {bytes} bytes and sent {}", p.len()),
                        },
                        _ => return,
                    }
                }
                Err(e) => {
                    tracing::warn!(peer = %addr, node = %hello.node, "{e}");
                    Response::Error {
                        message: e.to_string(),
                    }
                }
            };
            if s.send(&protocol::encode(&resp)).await.is_err() {
                return;
            }
        }
    }
}

/// `len` bytes at `offset` of the shared files at `paths` laid end to end (`None`: not
/// shared).
async fn read_range(
    paths: Option<Vec<std::path::PathBuf>>,
    sha256: &str,
    offset: u64,
    len: u64,
) -> Result<Vec<u8>, String> {
    let paths =
        paths.ok_or_else(|| format!("this node does not share a file with sha256 {sha256}"))?;
    if len == 0 || len > MAX_FETCH_BYTES {
        return Err(format!("a fetch of {len} bytes (1 to {MAX_FETCH_BYTES})"));
    }
    tokio::task::spawn_blocking(move || {
        use std::io::{Read, Seek, SeekFrom};
        // each file's size from its metadata; only the files the range falls in are opened
        let mut sizes = Vec::with_capacity(paths.len());
        for p in &paths {
            let n = std::fs::metadata(p)
                .map_err(|e| format!("reading {}: {e}", p.display()))?
                .len();
            sizes.push(n);
        }
        let size: u64 = sizes.iter().sum();
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(format!(
                "bytes {offset}..+{len} are outside the file of {size} bytes"
            ));
        }
        let mut buf = vec![0u8; len as usize];
        let mut at = offset;
        let mut filled = 0usize;
        let mut start = 0u64;
        for (p, n) in paths.iter().zip(sizes) {
            if filled == buf.len() {
                break;
            }
            if at < start + n {
                let take = ((start + n - at) as usize).min(buf.len() - filled);
                let mut f =
                    std::fs::File::open(p).map_err(|e| format!("opening {}: {e}", p.display()))?;
                f.seek(SeekFrom::Start(at - start))
                    .map_err(|e| e.to_string())?;
                f.read_exact(&mut buf[filled..filled + take])
                    .map_err(|e| format!("reading the file: {e}"))?;
                filled += take;
                at += take as u64;
            }
            start += n;
        }
        Ok(buf)
    })
    .await
    .map_err(|e| format!("the read failed: {e}"))?
}

async fn accept_loop(inner: Arc<Inner>, listener: TcpListener, mut stop: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            r = listener.accept() => match r {
                Ok((stream, addr)) => {
                    tokio::spawn(inner.clone().serve_session(stream, addr));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a cluster connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }
}

/// Measures every live peer's link now and then every `interval`, and whenever a node joins.
async fn probe_loop(inner: Arc<Inner>, interval: Duration, mut stop: watch::Receiver<bool>) {
    let mut views = inner.membership.watch();
    loop {
        let measured_for = inner.live_ids();
        let peers: Vec<NodeInfo> = inner
            .nodes()
            .await
            .into_iter()
            .filter(|n| n.alive && !n.is_self)
            .collect();
        for peer in peers {
            let Some(addr) = peer
                .facts
                .as_ref()
                .and_then(|f| f.listen.parse::<SocketAddr>().ok())
            else {
                continue;
            };
            match inner.measure(addr).await {
                Ok((id, facts)) if id == peer.id => {
                    inner.links.lock().unwrap().insert(id, facts);
                }
                Ok((id, _)) => {
                    tracing::warn!(peer = %addr, "node {} advertises {addr} but {id} answered there", peer.id)
                }
                Err(e) => {
                    tracing::warn!(peer = %addr, node = %peer.id, "measuring the link failed: {e}")
                }
            }
        }
        let json = {
            let live_ids = inner.live_ids();
            let mut links = inner.links.lock().unwrap();
            links.retain(|id, _| live_ids.contains(id));
            serde_json::to_string(&*links).expect("links serialize")
        };
        if let Err(e) = inner.membership.set(LINKS_KEY, &json).await {
            tracing::warn!(error = %e, "publishing the measured links failed");
        }
        // free memory changes as models load and other programs run; publish it again
        // (to the nearest 64 MiB, so noise does not gossip)
        inner.publish_memory().await;
        // Wait for the next round, or for a node to join (views also change with every
        // key-value, such as other nodes' links: only a new id counts).
        let next = tokio::time::Instant::now() + interval;
        loop {
            tokio::select! {
                _ = stop.changed() => return,
                _ = tokio::time::sleep_until(next) => break,
                r = views.changed() => {
                    if r.is_err() {
                        return;
                    }
                    let ids: Vec<String> = views.borrow_and_update().iter().map(|v| v.id.clone()).collect();
                    if ids.iter().any(|id| !measured_for.contains(id)) {
                        // let the newcomer's facts arrive before dialing it
                        tokio::time::sleep(Duration::from_millis(300)).await;
                        break;
                    }
                }
            }
        }
    }
}

/// Feeds the nodes mDNS finds to membership as seeds (their best address); unregisters
/// from mDNS when the node stops.
async fn seed_from_discovery(
    inner: Arc<Inner>,
    mut discovery: Discovery,
    mut stop: watch::Receiver<bool>,
) {
    let mut seeded: HashMap<String, SocketAddr> = HashMap::new();
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            e = discovery.next() => match e {
                Some(DiscoveryEvent::Found(d)) if d.node_id != inner.id => {
                    let Some(ip) = d.addrs.first() else { continue };
                    let addr = SocketAddr::new(*ip, d.gossip_port);
                    if let Some(old) = seeded.insert(d.node_id.clone(), addr) {
                        if old != addr {
                            inner.membership.remove_seed(old);
                        }
                    }
                    if let Err(e) = inner.membership.add_seed(addr) {
                        tracing::warn!(node = %d.node_id, peer = %addr, error = %e, "cannot add a discovered node");
                    }
                }
                Some(DiscoveryEvent::Lost { node_id }) => {
                    if let Some(addr) = seeded.remove(&node_id) {
                        inner.membership.remove_seed(addr);
                    }
                }
                Some(_) => {}
                None => break,
            }
        }
    }
    discovery.shutdown().await;
}
