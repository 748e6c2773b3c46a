//! Finding the other nodes of our cluster on the local network with mDNS / DNS-SD (`mdns-sd`).
//!
//! Every node registers one service instance of type [`SERVICE_TYPE`] whose instance name is its
//! node id, and browses for the others. The TXT record carries only what is safe to tell anyone
//! on the link: `c` = the cluster tag (a hash of the cluster *name*, see
//! [`crate::secret::cluster_tag`]), `id` = the node id, `gp` = the gossip port, `v` = the
//! discovery protocol version. Never the secret nor anything derived from it: discovery only says
//! where a node might be; membership (sealed gossip) and sessions (Noise) decide whether it
//! belongs. Nodes that advertise another tag or protocol version are ignored (logged at debug).
//!
//! mdns-sd enables every interface by default, loopback included, so discovery also works on a
//! host whose only interface is `lo` and between processes or network namespaces on one bridge.
//! A network without multicast needs static seeds instead (membership's seed list).

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::time::Duration;

use mdns_sd::{DaemonEvent, IfKind, ServiceDaemon, ServiceEvent, ServiceInfo};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

/// The DNS-SD service type every shoal node registers and browses.
pub const SERVICE_TYPE: &str = "_shoal._tcp.local.";

/// The discovery protocol version advertised in TXT `v`; nodes advertising another are ignored.
pub const PROTOCOL_VERSION: u32 = 1;

/// The standard mDNS UDP port.
pub const MDNS_PORT: u16 = 5353;

/// Longest node id discovery accepts: one DNS label (the instance name).
pub const MAX_NODE_ID_LEN: usize = 63;

const TXT_CLUSTER: &str = "c";
const TXT_NODE_ID: &str = "id";
const TXT_GOSSIP_PORT: &str = "gp";
const TXT_VERSION: &str = "v";

/// While a node is young, how often it asks the network again (mdns-sd backs its own queries
/// off 1, 2, 4, 8 ... s, so a query or announcement lost at start, on a busy host or before an
/// interface is ready, would otherwise delay discovery by many seconds).
const EARLY_REBROWSE: Duration = Duration::from_secs(2);

/// How long a node counts as young for [`EARLY_REBROWSE`].
const EARLY_PERIOD: Duration = Duration::from_secs(30);

/// How often an older node asks again, so a lost packet never hides a node for long.
const LATE_REBROWSE: Duration = Duration::from_secs(30);

/// How long [`Discovery::shutdown`] waits for the mDNS daemon to confirm each step.
const SHUTDOWN_STEP_TIMEOUT: Duration = Duration::from_secs(2);

/// Which network interfaces discovery announces on and listens on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Interfaces {
    /// Every interface, loopback included (the default).
    #[default]
    All,
    /// Only the IPv4 loopback interface (tests, single-host clusters).
    LoopbackV4,
    /// Only the interfaces with these names (`eth0`, `enp5s0f1`, ...).
    Named(Vec<String>),
}

/// What [`Discovery::start`] needs.
#[derive(Debug, Clone)]
pub struct DiscoveryConfig {
    /// This node's id: the instance name and TXT `id`. At most [`MAX_NODE_ID_LEN`] bytes.
    pub node_id: String,
    /// The cluster tag ([`crate::secret::cluster_tag`]); only nodes advertising the same tag are
    /// reported.
    pub cluster_tag: String,
    /// This node's cluster TCP port (the SRV port).
    pub port: u16,
    /// This node's gossip UDP port (TXT `gp`).
    pub gossip_port: u16,
    /// Interfaces to announce and listen on.
    pub interfaces: Interfaces,
    /// The mDNS UDP port: [`MDNS_PORT`] except in tests that want a private one.
    pub mdns_port: u16,
    /// The one address to advertise, when the node listens on one address only (others
    /// would dial addresses where nothing listens); `None` advertises every address of the
    /// chosen interfaces (a node listening on a wildcard).
    pub advertise_ip: Option<IpAddr>,
}

impl DiscoveryConfig {
    /// A config for `node_id` in the cluster tagged `cluster_tag`, on every interface and the
    /// standard mDNS port.
    pub fn new(
        node_id: impl Into<String>,
        cluster_tag: impl Into<String>,
        port: u16,
        gossip_port: u16,
    ) -> Self {
        Self {
            node_id: node_id.into(),
            cluster_tag: cluster_tag.into(),
            port,
            gossip_port,
            interfaces: Interfaces::All,
            mdns_port: MDNS_PORT,
            advertise_ip: None,
        }
    }
}

/// A node of our cluster found on the network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Discovered {
    /// The node's id (TXT `id`).
    pub node_id: String,
    /// The addresses it announced, most useful first: routable IPv4, routable IPv6, then
    /// loopback and link-local ones.
    pub addrs: Vec<IpAddr>,
    /// Its cluster TCP port.
    pub port: u16,
    /// Its gossip UDP port.
    pub gossip_port: u16,
}

/// A change discovery saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiscoveryEvent {
    /// A node of our cluster was found, or its addresses or ports changed.
    Found(Discovered),
    /// A node we reported withdrew its announcement (it shut down gracefully).
    Lost {
        /// The id of the node that left.
        node_id: String,
    },
}

/// Why discovery could not start.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// The node id cannot be an mDNS instance name.
    #[error("node id {0:?} cannot be announced: it must be 1 to {MAX_NODE_ID_LEN} bytes without control characters")]
    BadNodeId(String),
    /// The cluster tag is empty.
    #[error("the cluster tag is empty: pass cluster_tag(cluster name)")]
    EmptyClusterTag,
    /// `start` was called outside a tokio runtime.
    #[error("discovery must be started inside a tokio runtime")]
    NoRuntime,
    /// The mDNS daemon refused something.
    #[error("mDNS {what} failed: {source} (is UDP port {port} usable and multicast allowed on the chosen interfaces?)")]
    Mdns {
        /// What was being done.
        what: &'static str,
        /// The mDNS port in use.
        port: u16,
        /// mdns-sd's error.
        #[source]
        source: mdns_sd::Error,
    },
}

/// What discovery has heard since it started.
#[derive(Debug, Default)]
pub struct Heard {
    /// Another node of our cluster answered (so multicast passes).
    pub other: std::sync::atomic::AtomicBool,
}

/// Whether multicast passes on this host: a datagram sent to an administratively scoped
/// group (with loopback on) comes back to a socket that joined it, within half a second.
/// (The mDNS daemon answers its own browse from its own records, so hearing itself proves
/// nothing.)
///
/// # Errors
/// What failed: joining the group (no interface routes multicast), sending, or nothing
/// came back.
pub fn multicast_passes() -> Result<(), String> {
    use std::net::{Ipv4Addr, UdpSocket};
    let group = Ipv4Addr::new(239, 255, 83, 72);
    let recv = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).map_err(|e| e.to_string())?;
    let port = recv.local_addr().map_err(|e| e.to_string())?.port();
    recv.join_multicast_v4(&group, &Ipv4Addr::UNSPECIFIED)
        .map_err(|e| format!("joining a multicast group failed: {e}"))?;
    recv.set_read_timeout(Some(Duration::from_millis(500)))
        .map_err(|e| e.to_string())?;
    let send = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).map_err(|e| e.to_string())?;
    send.set_multicast_loop_v4(true)
        .map_err(|e| e.to_string())?;
    let token: [u8; 8] = rand::random();
    send.send_to(&token, (group, port))
        .map_err(|e| format!("sending to a multicast group failed: {e}"))?;
    let mut buf = [0u8; 16];
    loop {
        match recv.recv_from(&mut buf) {
            Ok((n, _)) if buf[..n] == token => return Ok(()),
            Ok(_) => continue,
            Err(_) => return Err("a multicast datagram sent here did not come back".into()),
        }
    }
}

/// A running discovery: our announcement plus a browser for the other nodes.
///
/// Dropping it stops the daemon without the goodbye; call [`Discovery::shutdown`] to leave
/// gracefully.
pub struct Discovery {
    daemon: Option<ServiceDaemon>,
    fullname: String,
    events: mpsc::UnboundedReceiver<DiscoveryEvent>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    mdns_port: u16,
    heard: std::sync::Arc<Heard>,
}

impl Discovery {
    /// Announces this node and starts browsing for the other nodes of its cluster.
    ///
    /// # Errors
    /// [`DiscoveryError::BadNodeId`] / [`DiscoveryError::EmptyClusterTag`] for an unusable
    /// config, [`DiscoveryError::NoRuntime`] outside tokio, [`DiscoveryError::Mdns`] when the
    /// mDNS daemon cannot start, register or browse.
    pub fn start(config: DiscoveryConfig) -> Result<Discovery, DiscoveryError> {
        let DiscoveryConfig {
            node_id,
            cluster_tag,
            port,
            gossip_port,
            interfaces,
            mdns_port,
            advertise_ip,
        } = config;
        if node_id.is_empty()
            || node_id.len() > MAX_NODE_ID_LEN
            || node_id.chars().any(char::is_control)
        {
            return Err(DiscoveryError::BadNodeId(node_id));
        }
        if cluster_tag.is_empty() {
            return Err(DiscoveryError::EmptyClusterTag);
        }
        let runtime =
            tokio::runtime::Handle::try_current().map_err(|_| DiscoveryError::NoRuntime)?;
        let mdns = |what| {
            move |source| DiscoveryError::Mdns {
                what,
                port: mdns_port,
                source,
            }
        };

        let daemon = ServiceDaemon::new_with_port(mdns_port).map_err(mdns("daemon start"))?;
        let if_kinds = match &interfaces {
            Interfaces::All => None,
            Interfaces::LoopbackV4 => Some(vec![IfKind::LoopbackV4]),
            Interfaces::Named(names) => {
                Some(names.iter().map(|n| IfKind::Name(n.clone())).collect())
            }
        };
        if let Some(kinds) = &if_kinds {
            daemon
                .disable_interface(IfKind::All)
                .map_err(mdns("interface selection"))?;
            daemon
                .enable_interface(kinds.clone())
                .map_err(mdns("interface selection"))?;
        }
        let monitor = daemon.monitor().map_err(mdns("monitor"))?;

        let properties: HashMap<String, String> = [
            (TXT_CLUSTER, cluster_tag.clone()),
            (TXT_NODE_ID, node_id.clone()),
            (TXT_GOSSIP_PORT, gossip_port.to_string()),
            (TXT_VERSION, PROTOCOL_VERSION.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let host = format!("{}.local.", host_label(&node_id));
        let mut info = match advertise_ip {
            Some(ip) => ServiceInfo::new(SERVICE_TYPE, &node_id, &host, ip, port, properties)
                .map_err(mdns("service description"))?,
            None => ServiceInfo::new(SERVICE_TYPE, &node_id, &host, "", port, properties)
                .map_err(mdns("service description"))?
                .enable_addr_auto(),
        };
        if let Some(kinds) = if_kinds {
            info.set_interfaces(kinds);
        }
        let fullname = info.get_fullname().to_string();
        daemon.register(info).map_err(mdns("register"))?;
        let browse = daemon.browse(SERVICE_TYPE).map_err(mdns("browse"))?;

        let (tx, events) = mpsc::unbounded_channel();
        let heard = std::sync::Arc::new(Heard::default());
        let mut filter = Filter {
            own_id: node_id.clone(),
            cluster_tag,
            reported: HashMap::new(),
            heard: heard.clone(),
        };
        let asker = daemon.clone();
        let browser = runtime.spawn(async move {
            let mut browse = browse;
            let started = tokio::time::Instant::now();
            let mut next_ask = started + EARLY_REBROWSE;
            loop {
                tokio::select! {
                    event = browse.recv_async() => {
                        let Ok(event) = event else { return };
                        if let Some(ev) = filter.on_event(event) {
                            if tx.send(ev).is_err() {
                                return;
                            }
                        }
                    }
                    _ = tokio::time::sleep_until(next_ask) => {
                        // A new browse replaces the old listener, answers from the cache at
                        // once and queries the network again; the filter reports only changes.
                        match asker.browse(SERVICE_TYPE) {
                            Ok(b) => browse = b,
                            Err(e) => debug!(error = %e, "asking mDNS again failed"),
                        }
                        let young = started.elapsed() < EARLY_PERIOD;
                        next_ask += if young { EARLY_REBROWSE } else { LATE_REBROWSE };
                    }
                }
            }
        });
        let monitor_node = node_id.clone();
        let monitor = runtime.spawn(async move {
            while let Ok(event) = monitor.recv_async().await {
                match event {
                    DaemonEvent::Error(e) => {
                        warn!(node = %monitor_node, error = %e, "mDNS daemon error")
                    }
                    other => debug!(node = %monitor_node, event = ?other, "mDNS daemon event"),
                }
            }
        });
        info!(node = %node_id, port, gossip_port, mdns_port, interfaces = ?interfaces, "discovery started");
        Ok(Discovery {
            daemon: Some(daemon),
            fullname,
            events,
            tasks: vec![browser, monitor],
            mdns_port,
            heard,
        })
    }

    /// What it has heard so far (shared: it keeps changing while discovery runs).
    pub fn heard(&self) -> std::sync::Arc<Heard> {
        self.heard.clone()
    }

    /// The next discovery event, or `None` once discovery has stopped.
    pub async fn next(&mut self) -> Option<DiscoveryEvent> {
        self.events.recv().await
    }

    /// The mDNS port this discovery uses.
    pub fn mdns_port(&self) -> u16 {
        self.mdns_port
    }

    /// Withdraws our announcement (the other nodes see us leave) and stops the mDNS daemon.
    pub async fn shutdown(mut self) {
        let Some(daemon) = self.daemon.take() else {
            return;
        };
        match daemon.unregister(&self.fullname) {
            Ok(status) => {
                if tokio::time::timeout(SHUTDOWN_STEP_TIMEOUT, status.recv_async())
                    .await
                    .is_err()
                {
                    warn!(service = %self.fullname, "mDNS unregister not confirmed in time; other nodes will notice when the record expires");
                }
            }
            Err(e) => warn!(service = %self.fullname, error = %e, "mDNS unregister failed"),
        }
        if let Ok(status) = daemon.shutdown() {
            let _ = tokio::time::timeout(SHUTDOWN_STEP_TIMEOUT, status.recv_async()).await;
        }
        for task in self.tasks.drain(..) {
            task.abort();
        }
    }
}

impl Drop for Discovery {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
        if let Some(daemon) = self.daemon.take() {
            let _ = daemon.shutdown();
        }
    }
}

/// A DNS host label made from a node id: ASCII letters, digits and `-`.
fn host_label(node_id: &str) -> String {
    let mut label: String = node_id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    label.truncate(MAX_NODE_ID_LEN - "shoal-".len());
    format!("shoal-{label}")
}

/// Turns mdns-sd events into ours: keeps our cluster, drops ourselves, dedups repeats.
struct Filter {
    own_id: String,
    cluster_tag: String,
    /// Instance full name -> what we last reported for it.
    reported: HashMap<String, Discovered>,
    /// What came back.
    heard: std::sync::Arc<Heard>,
}

impl Filter {
    fn on_event(&mut self, event: ServiceEvent) -> Option<DiscoveryEvent> {
        match event {
            ServiceEvent::ServiceResolved(service) => {
                let txt = |key| service.get_property_val_str(key);
                let fullname = service.get_fullname().to_string();
                let Some(tag) = txt(TXT_CLUSTER) else {
                    debug!(service = %fullname, "ignoring a shoal announcement without a cluster tag");
                    return None;
                };
                if tag != self.cluster_tag {
                    debug!(service = %fullname, "ignoring a node of another cluster");
                    return None;
                }
                if txt(TXT_VERSION) != Some(PROTOCOL_VERSION.to_string().as_str()) {
                    debug!(service = %fullname, version = ?txt(TXT_VERSION), "ignoring a node speaking another discovery protocol version");
                    return None;
                }
                let node_id = match txt(TXT_NODE_ID) {
                    Some(id) if !id.is_empty() && id.len() <= MAX_NODE_ID_LEN => id.to_string(),
                    _ => {
                        debug!(service = %fullname, "ignoring an announcement without a usable node id");
                        return None;
                    }
                };
                if node_id == self.own_id {
                    return None;
                }
                self.heard
                    .other
                    .store(true, std::sync::atomic::Ordering::Relaxed);
                let Some(gossip_port) = txt(TXT_GOSSIP_PORT)
                    .and_then(|p| p.parse::<u16>().ok())
                    .filter(|p| *p != 0)
                else {
                    debug!(service = %fullname, node = %node_id, "ignoring an announcement without a usable gossip port");
                    return None;
                };
                let addrs = rank_addrs(service.get_addresses().iter().map(|a| a.to_ip_addr()));
                if addrs.is_empty() || service.get_port() == 0 {
                    return None;
                }
                let found = Discovered {
                    node_id,
                    addrs,
                    port: service.get_port(),
                    gossip_port,
                };
                if self.reported.get(&fullname) == Some(&found) {
                    return None;
                }
                debug!(node = %found.node_id, addrs = ?found.addrs, port = found.port, gossip_port, "discovered a node");
                self.reported.insert(fullname, found.clone());
                Some(DiscoveryEvent::Found(found))
            }
            ServiceEvent::ServiceRemoved(_, fullname) => {
                let gone = self.reported.remove(&fullname)?;
                debug!(node = %gone.node_id, "a node withdrew its announcement");
                Some(DiscoveryEvent::Lost {
                    node_id: gone.node_id,
                })
            }
            _ => None,
        }
    }
}

/// Deduplicated addresses, most useful first.
fn rank_addrs(addrs: impl Iterator<Item = IpAddr>) -> Vec<IpAddr> {
    let rank = |a: &IpAddr| match a {
        IpAddr::V4(v4) if !v4.is_loopback() && !v4.is_link_local() && !v4.is_unspecified() => 0,
        IpAddr::V6(v6)
            if !v6.is_loopback()
                && !v6.is_unspecified()
                && (v6.segments()[0] & 0xffc0) != 0xfe80 =>
        {
            1
        }
        IpAddr::V4(v4) if v4.is_loopback() => 2,
        IpAddr::V6(v6) if v6.is_loopback() => 3,
        _ => 4,
    };
    let mut out: Vec<IpAddr> = addrs
        .filter(|a| !a.is_unspecified() && !a.is_multicast())
        .collect::<HashSet<_>>()
        .into_iter()
        .collect();
    out.sort_by_key(|a| (rank(a), *a));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;
    use std::time::Instant;

    fn config(id: &str, tag: &str, port: u16, mdns_port: u16) -> DiscoveryConfig {
        DiscoveryConfig {
            interfaces: Interfaces::LoopbackV4,
            mdns_port,
            ..DiscoveryConfig::new(id, tag, port, port + 1)
        }
    }

    /// A private mDNS port per test run, so parallel runs and the host's own mDNS stay apart.
    fn private_mdns_port() -> u16 {
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        socket.local_addr().unwrap().port()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn three_nodes_on_loopback_find_each_other_and_not_a_stranger() {
        let mdns_port = private_mdns_port();
        let tag = crate::secret::cluster_tag("discovery-test");
        let ids = ["node-a", "node-b", "node-c"];
        let mut nodes: Vec<Discovery> = ids
            .iter()
            .enumerate()
            .map(|(i, id)| {
                Discovery::start(config(id, &tag, 41000 + 10 * i as u16, mdns_port)).unwrap()
            })
            .collect();
        let mut stranger = Discovery::start(config(
            "stranger",
            &crate::secret::cluster_tag("other"),
            42000,
            mdns_port,
        ))
        .unwrap();

        let start = Instant::now();
        let deadline = start + Duration::from_secs(5);
        let mut seen: Vec<BTreeSet<String>> = vec![BTreeSet::new(); nodes.len()];
        let mut found: Vec<Vec<Discovered>> = vec![Vec::new(); nodes.len()];
        while seen.iter().any(|s| s.len() < 2) && Instant::now() < deadline {
            for (i, node) in nodes.iter_mut().enumerate() {
                if let Ok(Some(DiscoveryEvent::Found(d))) =
                    tokio::time::timeout(Duration::from_millis(20), node.next()).await
                {
                    seen[i].insert(d.node_id.clone());
                    found[i].push(d);
                }
            }
        }
        println!("discovery on loopback took {:?}: {seen:?}", start.elapsed());
        for (i, id) in ids.iter().enumerate() {
            let expected: BTreeSet<String> = ids
                .iter()
                .filter(|o| *o != id)
                .map(|s| s.to_string())
                .collect();
            assert_eq!(seen[i], expected, "{id} saw {:?} within 5 s", seen[i]);
        }
        // Ports and addresses come through as announced.
        let b = found[0].iter().find(|d| d.node_id == "node-b").unwrap();
        assert_eq!((b.port, b.gossip_port), (41010, 41011));
        assert!(b.addrs.iter().any(|a| a.is_loopback()), "{:?}", b.addrs);

        // The stranger (another cluster tag) is never reported, and sees none of us either.
        tokio::time::sleep(Duration::from_millis(500)).await;
        for (i, node) in nodes.iter_mut().enumerate() {
            while let Ok(ev) = node.events.try_recv() {
                if let DiscoveryEvent::Found(d) = ev {
                    seen[i].insert(d.node_id);
                }
            }
            assert!(
                !seen[i].contains("stranger"),
                "{} reported the stranger",
                ids[i]
            );
        }
        assert!(
            stranger.events.try_recv().is_err(),
            "the stranger saw one of us"
        );

        // A graceful shutdown is seen as a departure.
        let c = nodes.pop().unwrap();
        c.shutdown().await;
        let left = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                match nodes[0].next().await {
                    Some(DiscoveryEvent::Lost { node_id }) if node_id == "node-c" => return true,
                    Some(_) => continue,
                    None => return false,
                }
            }
        })
        .await;
        assert_eq!(left.ok(), Some(true), "node-a did not see node-c leave");
        for node in nodes {
            node.shutdown().await;
        }
        stranger.shutdown().await;
    }

    #[test]
    fn bad_configs_are_refused_with_a_reason() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let _guard = rt.enter();
        let long = "x".repeat(MAX_NODE_ID_LEN + 1);
        assert!(matches!(
            Discovery::start(config(&long, "t", 1, 9)),
            Err(DiscoveryError::BadNodeId(_))
        ));
        assert!(matches!(
            Discovery::start(config("", "t", 1, 9)),
            Err(DiscoveryError::BadNodeId(_))
        ));
        assert!(matches!(
            Discovery::start(config("a", "", 1, 9)),
            Err(DiscoveryError::EmptyClusterTag)
        ));
        drop(_guard);
        assert!(matches!(
            Discovery::start(config("a", "t", 1, 9)),
            Err(DiscoveryError::NoRuntime)
        ));
    }

    #[test]
    fn addresses_are_ranked_routable_first() {
        let addrs: Vec<IpAddr> = ["127.0.0.1", "fe80::1", "192.0.2.2", "fd00::2", "192.0.2.2"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        let ranked: Vec<String> = rank_addrs(addrs.into_iter())
            .iter()
            .map(|a| a.to_string())
            .collect();
        assert_eq!(ranked, ["192.0.2.2", "fd00::2", "127.0.0.1", "fe80::1"]);
    }
}
