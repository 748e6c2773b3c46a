//! `GET /cluster/doctor`, what `shoal doctor` prints: what stands between this node and a
//! working cluster, each finding with what to do about it. The checks:
//!
//! - **secret**: the secret file is readable by this user only;
//! - **strangers**: no node with another secret (or cluster name) was refused;
//! - **versions**: no node whose cluster protocol version does not work with this node's was
//!   refused;
//! - **mdns**: multicast passes here (its own announcement came back), unless it is off;
//! - **reachable**: the cluster port and the API listen where the other nodes can reach
//!   them, and every live node has measured a link with this one;
//! - **memory**: the free memory the planner counts here is what the system has;
//! - **cpu**: the kernels run vector code here;
//! - **huge pages**: transparent huge pages are not off;
//! - **clock**: no node's clock is more than 2 s from this one's.
//!
//! A node outside any cluster gets the host checks (memory, cpu, huge pages) only.
//! [`findings`] decides from plain inputs (unit-tested); the route gathers them.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::json;
use shoal_cluster::node::MdnsStatus;

use crate::state::AppState;

/// How a check came out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Level {
    /// Fine.
    Ok,
    /// Works, but worse than it could, or only on this machine.
    Warning,
    /// Stands in the way of the cluster working.
    Problem,
}

/// One check's outcome.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Finding {
    /// Which check (`secret`, `strangers`, `mdns`, `reachable`, `memory`, `cpu`,
    /// `huge_pages`, `clock`).
    pub check: String,
    /// How it came out.
    pub level: Level,
    /// What was found.
    pub what: String,
    /// What to do about it (for a warning or a problem).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

impl Finding {
    fn ok(check: &str, what: impl Into<String>) -> Self {
        Finding {
            check: check.into(),
            level: Level::Ok,
            what: what.into(),
            fix: None,
        }
    }

    fn warn(check: &str, what: impl Into<String>, fix: impl Into<String>) -> Self {
        Finding {
            check: check.into(),
            level: Level::Warning,
            what: what.into(),
            fix: Some(fix.into()),
        }
    }

    fn problem(check: &str, what: impl Into<String>, fix: impl Into<String>) -> Self {
        Finding {
            check: check.into(),
            level: Level::Problem,
            what: what.into(),
            fix: Some(fix.into()),
        }
    }
}

/// How the node was started, as the doctor needs it (set once by `shoal serve`).
#[derive(Clone, Debug, Default)]
pub struct Setup {
    /// The secret file, when the secret came from one (else from the environment).
    pub secret_file: Option<PathBuf>,
    /// Where the HTTP API listens.
    pub api: Option<SocketAddr>,
}

/// A live peer as the checks see it.
#[derive(Clone, Debug, PartialEq)]
pub struct Peer {
    /// Its name (or id).
    pub name: String,
    /// Its cluster address.
    pub listen: Option<SocketAddr>,
    /// Its API address.
    pub api: Option<SocketAddr>,
    /// Whether a link between it and this node was measured.
    pub measured: bool,
    /// Its clock minus this node's, milliseconds, when measured.
    pub clock_offset_ms: Option<i64>,
}

/// Everything the checks decide from.
#[derive(Clone, Debug, Default)]
pub struct Inputs {
    /// Whether the node is in a cluster (else only the host checks apply).
    pub in_cluster: bool,
    /// The secret file and its permission bits (`None` bits: they could not be read;
    /// `None`: the secret came from the environment).
    pub secret: Option<(PathBuf, Option<u32>)>,
    /// Sessions and gossip datagrams refused.
    pub refused: (u64, u64),
    /// Nodes refused for a protocol version this node does not work with: (node, address,
    /// their versions), and this node's versions.
    pub incompatible: Vec<(String, String, String)>,
    pub protocol: String,
    /// mDNS discovery.
    pub mdns: Option<MdnsStatus>,
    /// This node's cluster address and API address.
    pub listen: Option<SocketAddr>,
    pub api: Option<SocketAddr>,
    /// The live peers.
    pub peers: Vec<Peer>,
    /// Seconds the node has run (links are measured within the first seconds).
    pub uptime_s: u64,
    /// Free memory the planner counts here, and what the system has available, bytes.
    pub planner_free: Option<u64>,
    pub available: Option<u64>,
    /// The kernels' instruction set here, and whether it is the portable fallback.
    pub isa: (String, bool),
    /// `/sys/kernel/mm/transparent_hugepage/enabled`, when it exists.
    pub thp: Option<String>,
    /// The GPU adapters wgpu finds here.
    pub gpus: Vec<shoal_engine::device::GpuAdapter>,
    /// The GPUs this process computed on that failed, with the reason.
    pub failed_gpus: Vec<(usize, String)>,
}

/// Seconds after start by which every live peer should have a measured link.
const LINK_GRACE_S: u64 = 30;
/// Clock offsets beyond this are reported.
const CLOCK_TOLERANCE_MS: i64 = 2000;

fn gib(b: u64) -> String {
    format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
}

/// The findings for `i`, one or more per check.
pub fn findings(i: &Inputs) -> Vec<Finding> {
    let mut out = Vec::new();
    if i.in_cluster {
        cluster_findings(i, &mut out);
    } else {
        out.push(Finding::ok(
            "cluster",
            "a single node outside any cluster (start it with --secret-file FILE to join one)",
        ));
    }
    host_findings(i, &mut out);
    out
}

/// The checks of the node's place in its cluster.
fn cluster_findings(i: &Inputs, out: &mut Vec<Finding>) {
    // secret
    match &i.secret {
        Some((path, None)) => out.push(Finding::problem(
            "secret",
            format!(
                "the secret file {} cannot be read any more (moved or deleted since the node started)",
                path.display()
            ),
            "put the cluster's secret file back, with mode 600, at the path the node was started with",
        )),
        Some((path, Some(mode))) if mode & 0o077 != 0 => out.push(Finding::problem(
            "secret",
            format!(
                "the secret file {} can be read by other users (mode {:o}): anyone on this machine can join the cluster",
                path.display(),
                mode & 0o777
            ),
            format!("chmod 600 {}", path.display()),
        )),
        Some((path, _)) => out.push(Finding::ok(
            "secret",
            format!("the secret file {} is readable by its owner only", path.display()),
        )),
        None => out.push(Finding::ok("secret", "the secret comes from SHOAL_SECRET")),
    }
    // strangers
    let (sessions, datagrams) = i.refused;
    if sessions + datagrams > 0 {
        out.push(Finding::problem(
            "strangers",
            format!(
                "{sessions} sessions and {datagrams} gossip datagrams were refused: a node holds another secret or cluster name (its address is in this node's log)"
            ),
            "give every node the same secret file (made once with `shoal secret > FILE`, copied to each node with mode 600) and the same --cluster",
        ));
    } else {
        out.push(Finding::ok(
            "strangers",
            "no node with another secret knocked",
        ));
    }
    // versions
    if i.incompatible.is_empty() {
        if i.in_cluster {
            out.push(Finding::ok(
                "versions",
                format!(
                    "no node of a protocol version this node does not work with was met (this \
                     node: {})",
                    i.protocol
                ),
            ));
        }
    } else {
        let list: Vec<String> = i
            .incompatible
            .iter()
            .map(|(node, addr, v)| format!("node {node} at {addr}: {v}"))
            .collect();
        out.push(Finding::problem(
            "versions",
            format!(
                "refused for their cluster protocol version (this node: {}): {}",
                i.protocol,
                list.join("; ")
            ),
            "run shoal releases that work together on every node: upgrade one node at a time \
             (README, \"Upgrading a cluster\")",
        ));
    }
    // mdns
    out.push(match &i.mdns {
        None | Some(MdnsStatus::Off) => {
            Finding::ok("mdns", "mDNS discovery is off: nodes join through --peer")
        }
        Some(MdnsStatus::Failed { error }) => Finding::problem(
            "mdns",
            format!("mDNS discovery could not start: {error}"),
            "join through --peer HOST:PORT, or free UDP port 5353 (another mDNS responder may hold it exclusively)",
        ),
        Some(MdnsStatus::Passes) => Finding::ok("mdns", "multicast passes: mDNS finds nodes here"),
        Some(MdnsStatus::Blocked { error }) => Finding::warn(
            "mdns",
            format!(
                "multicast does not pass on this host's interfaces ({error}), so no node finds this one by mDNS"
            ),
            "join through --peer HOST:PORT, or let UDP 5353 multicast pass (a firewall, a network namespace or a Wi-Fi access point's client isolation blocks it)",
        ),
    });
    // reachable
    let loopback = |a: &Option<SocketAddr>| a.is_some_and(|a| a.ip().is_loopback());
    let peers_elsewhere = i
        .peers
        .iter()
        .any(|p| p.listen.is_some_and(|a| !a.ip().is_loopback()));
    let mut reachable_ok = true;
    if loopback(&i.listen) && peers_elsewhere {
        reachable_ok = false;
        out.push(Finding::problem(
            "reachable",
            format!(
                "the cluster port listens on {} only, but other nodes are on other machines",
                i.listen.map(|a| a.to_string()).unwrap_or_default()
            ),
            "start `shoal serve` with --listen 0.0.0.0:7338 (or an address the other machines reach)",
        ));
    }
    let apis_elsewhere = i
        .peers
        .iter()
        .any(|p| p.api.is_some_and(|a| !a.ip().is_loopback()));
    if loopback(&i.api) && apis_elsewhere {
        reachable_ok = false;
        out.push(Finding::warn(
            "reachable",
            format!(
                "the API listens on {} only: the other nodes cannot forward requests for instances this node leads",
                i.api.map(|a| a.to_string()).unwrap_or_default()
            ),
            "start `shoal serve` with --api 0.0.0.0:7337 (behind API keys)",
        ));
    }
    if i.uptime_s >= LINK_GRACE_S {
        for p in i.peers.iter().filter(|p| !p.measured) {
            reachable_ok = false;
            out.push(Finding::problem(
                "reachable",
                format!(
                    "no link with node {} ({}) was measured: the nodes gossip, but a session between them fails",
                    p.name,
                    p.listen.map(|a| a.to_string()).unwrap_or_else(|| "no address".into())
                ),
                "let TCP pass on the cluster port (--listen) between the two machines, both ways",
            ));
        }
    }
    if reachable_ok {
        out.push(Finding::ok(
            "reachable",
            match i.peers.len() {
                0 => "no other live node yet".to_string(),
                n => format!("{n} live peers, every link measured"),
            },
        ));
    }
    // clock
    let mut clock_ok = true;
    for p in &i.peers {
        if let Some(o) = p.clock_offset_ms.filter(|o| o.abs() > CLOCK_TOLERANCE_MS) {
            clock_ok = false;
            out.push(Finding::warn(
                "clock",
                format!(
                    "node {}'s clock is {:.1} s {} this node's",
                    p.name,
                    o.abs() as f64 / 1000.0,
                    if o > 0 { "ahead of" } else { "behind" }
                ),
                "synchronize the clocks (NTP: e.g. systemd-timesyncd or chrony on every node); logs and `dead since` times disagree otherwise",
            ));
        }
    }
    if clock_ok {
        out.push(Finding::ok(
            "clock",
            format!(
                "every measured clock within {} s",
                CLOCK_TOLERANCE_MS / 1000
            ),
        ));
    }
}

/// The checks of the machine the node runs on.
fn host_findings(i: &Inputs, out: &mut Vec<Finding>) {
    // memory
    match (i.planner_free, i.available) {
        (Some(free), Some(avail)) if free > avail + avail / 10 + (256 << 20) => {
            out.push(Finding::warn(
                "memory",
                format!(
                    "the planner counts {} free here, but the system has {} available: a model placed here may not fit",
                    gib(free),
                    gib(avail)
                ),
                format!(
                    "start `shoal serve` with --max-memory {}G at most, or free memory",
                    avail >> 30
                ),
            ))
        }
        (Some(free), Some(avail)) => out.push(Finding::ok(
            "memory",
            format!("the planner counts {} free, the system has {} available", gib(free), gib(avail)),
        )),
        _ => out.push(Finding::ok("memory", "no memory figures to compare")),
    }
    // cpu
    let (isa, portable) = &i.isa;
    out.push(if *portable && cfg!(target_arch = "x86_64") {
        Finding::warn(
            "cpu",
            "this CPU lacks AVX2, FMA or F16C: the kernels run portable code, several times slower",
            "give this node only small shares (the planner measured its speed), or use another machine",
        )
    } else {
        Finding::ok("cpu", format!("the kernels use {isa}"))
    });
    // gpus
    out.push(if let Some((n, why)) = i.failed_gpus.first() {
        Finding::problem(
            "gpu",
            format!("gpu:{n} failed: {why}"),
            "restart shoal serve on this node (check the GPU's driver first: dmesg, \
             vulkaninfo --summary); until then its shares are placed elsewhere",
        )
    } else if i.gpus.is_empty() {
        Finding::ok(
            "gpu",
            "no GPU adapter (no Vulkan, Metal or DX12 driver answered): shares run on the CPU",
        )
    } else {
        let list: Vec<String> = i
            .gpus
            .iter()
            .map(|g| {
                let kind = if g.software {
                    ", software: computes on the CPU"
                } else {
                    ""
                };
                let memory = g
                    .memory_bytes
                    .map(|b| format!(", {:.1} GiB", b as f64 / (1u64 << 30) as f64))
                    .unwrap_or_default();
                format!("gpu:{} {} ({}{memory}{kind})", g.index, g.name, g.api)
            })
            .collect();
        Finding::ok(
            "gpu",
            format!(
                "{}; --device gpu:N computes on one (--gpu-layers N: its first N layers, the \
                 rest on the CPU)",
                list.join(", ")
            ),
        )
    });
    // huge pages
    match &i.thp {
        Some(t) if t.contains("[never]") => out.push(Finding::warn(
            "huge_pages",
            "transparent huge pages are off: large weights and KV caches take more TLB misses",
            "echo madvise | sudo tee /sys/kernel/mm/transparent_hugepage/enabled",
        )),
        Some(t) => out.push(Finding::ok(
            "huge_pages",
            format!("transparent huge pages: {}", t.trim()),
        )),
        None => out.push(Finding::ok(
            "huge_pages",
            "no transparent huge pages setting here",
        )),
    }
}

/// `GET /cluster/doctor`: `{"node", "findings": [...]}`.
pub async fn doctor(State(state): State<Arc<AppState>>, req: Request) -> Response {
    if let Err(e) = state.keys.authorize_view(req.headers()) {
        return e.into_response();
    }
    let inputs = gather(&state).await;
    Json(json!({
        "node": state.cluster.as_ref().map(|n| n.id().to_string()),
        "findings": findings(&inputs),
    }))
    .into_response()
}

/// The inputs of this node.
async fn gather(state: &AppState) -> Inputs {
    let setup = state.doctor.get().cloned().unwrap_or_default();
    let mut i = Inputs {
        secret: setup
            .secret_file
            .as_ref()
            .map(|p| (p.clone(), file_mode(p))),
        api: setup.api,
        uptime_s: state.started.elapsed().as_secs(),
        available: shoal_cluster::facts::memory().map(|(_, avail)| avail),
        thp: std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").ok(),
        ..Inputs::default()
    };
    i.gpus = shoal_engine::device::gpus();
    i.failed_gpus = shoal_engine::device::failed_gpus();
    let isa = shoal_engine::bench::Isa::detected();
    i.isa = (
        isa.name().to_string(),
        isa == shoal_engine::bench::Isa::Portable,
    );
    if let Some(node) = &state.cluster {
        i.in_cluster = true;
        let me = node.id().to_string();
        i.refused = (node.refused_sessions(), node.refused_datagrams());
        i.protocol = shoal_cluster::protocol::ours()
            .map(|v| v.to_string())
            .unwrap_or_else(|e| e);
        i.incompatible = node
            .incompatible_peers()
            .into_iter()
            .map(|p| (p.node, p.address, p.versions.to_string()))
            .collect();
        i.mdns = Some(node.mdns_status().await);
        i.listen = Some(node.listen_addr());
        let links = node.links();
        for n in node.nodes().await {
            let addr = |s: Option<&String>| s.and_then(|a| a.parse().ok());
            if n.is_self {
                i.planner_free = n.facts.as_ref().map(|f| f.memory_free_bytes);
                continue;
            }
            if !n.alive {
                continue;
            }
            let mine = links
                .iter()
                .find(|l| (l.from == me && l.to == n.id) || (l.from == n.id && l.to == me));
            i.peers.push(Peer {
                name: n.name.clone(),
                listen: addr(n.facts.as_ref().map(|f| &f.listen)),
                api: addr(n.facts.as_ref().map(|f| &f.api)),
                measured: mine.is_some(),
                clock_offset_ms: mine.and_then(|l| {
                    let o = l.facts.clock_offset_ms?;
                    Some(if l.from == me { o } else { -o })
                }),
            });
        }
    }
    i
}

/// The permission bits of `path` (`None` where they cannot be read; 0o600 where the
/// system has none).
fn file_mode(path: &std::path::Path) -> Option<u32> {
    let meta = std::fs::metadata(path).ok()?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        Some(meta.permissions().mode())
    }
    #[cfg(not(unix))]
    {
        let _ = meta;
        Some(0o600)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn healthy() -> Inputs {
        let a = |s: &str| Some(s.parse().unwrap());
        Inputs {
            in_cluster: true,
            secret: Some(("/etc/shoal/secret".into(), Some(0o100600))),
            refused: (0, 0),
            incompatible: Vec::new(),
            protocol: "version 2 (works with 1 to 2)".into(),
            mdns: Some(MdnsStatus::Passes),
            listen: a("10.0.0.1:7338"),
            api: a("10.0.0.1:7337"),
            peers: vec![Peer {
                name: "b".into(),
                listen: a("10.0.0.2:7338"),
                api: a("10.0.0.2:7337"),
                measured: true,
                clock_offset_ms: Some(40),
            }],
            uptime_s: 100,
            planner_free: Some(8 << 30),
            available: Some(10 << 30),
            isa: ("avx2".into(), false),
            thp: Some("always [madvise] never".into()),
            gpus: vec![shoal_engine::device::GpuAdapter {
                index: 0,
                name: "llvmpipe".into(),
                api: "Vulkan".into(),
                software: true,
                discrete: false,
                max_buffer_bytes: 1 << 31,
                memory_bytes: Some(24 << 30),
            }],
            failed_gpus: Vec::new(),
        }
    }

    fn bad(i: &Inputs) -> Vec<(String, Level)> {
        findings(i)
            .into_iter()
            .filter(|f| f.level != Level::Ok)
            .map(|f| (f.check, f.level))
            .collect()
    }

    #[test]
    fn a_healthy_node_has_nothing_to_fix() {
        let f = findings(&healthy());
        assert!(f.iter().all(|f| f.level == Level::Ok), "{f:#?}");
        for check in [
            "secret",
            "strangers",
            "versions",
            "mdns",
            "reachable",
            "memory",
            "cpu",
            "huge_pages",
            "clock",
        ] {
            assert!(f.iter().any(|x| x.check == check), "{check} missing");
        }
    }

    #[test]
    fn each_fault_is_found_with_its_fix() {
        type Fault = Box<dyn Fn(&mut Inputs)>;
        let cases: Vec<(&str, Level, Fault)> = vec![
            (
                "secret",
                Level::Problem,
                Box::new(|i| i.secret.as_mut().unwrap().1 = Some(0o100644)),
            ),
            (
                "secret",
                Level::Problem,
                Box::new(|i| i.secret.as_mut().unwrap().1 = None),
            ),
            (
                "strangers",
                Level::Problem,
                Box::new(|i| i.refused = (3, 0)),
            ),
            (
                "strangers",
                Level::Problem,
                Box::new(|i| i.refused = (0, 12)),
            ),
            (
                "versions",
                Level::Problem,
                Box::new(|i| {
                    i.incompatible = vec![(
                        "n3".into(),
                        "10.0.0.3:7338".into(),
                        "version 3 (works with 3 only)".into(),
                    )]
                }),
            ),
            (
                "mdns",
                Level::Warning,
                Box::new(|i| {
                    i.mdns = Some(MdnsStatus::Blocked {
                        error: "no route".into(),
                    })
                }),
            ),
            (
                "mdns",
                Level::Problem,
                Box::new(|i| {
                    i.mdns = Some(MdnsStatus::Failed {
                        error: "port in use".into(),
                    })
                }),
            ),
            (
                "reachable",
                Level::Problem,
                Box::new(|i| i.listen = Some("127.0.0.1:7338".parse().unwrap())),
            ),
            (
                "reachable",
                Level::Warning,
                Box::new(|i| i.api = Some("127.0.0.1:7337".parse().unwrap())),
            ),
            (
                "reachable",
                Level::Problem,
                Box::new(|i| i.peers[0].measured = false),
            ),
            (
                "memory",
                Level::Warning,
                Box::new(|i| i.available = Some(2 << 30)),
            ),
            (
                "huge_pages",
                Level::Warning,
                Box::new(|i| i.thp = Some("always madvise [never]".into())),
            ),
            (
                "clock",
                Level::Warning,
                Box::new(|i| i.peers[0].clock_offset_ms = Some(-5300)),
            ),
        ];
        for (check, level, fault) in cases {
            let mut i = healthy();
            fault(&mut i);
            assert_eq!(bad(&i), vec![(check.to_string(), level)], "{check}");
            let f = findings(&i);
            let found = f.iter().find(|f| f.level != Level::Ok).unwrap();
            assert!(
                found.fix.as_deref().is_some_and(|x| !x.is_empty()),
                "{found:?}"
            );
        }
        // a portable-only CPU on x86
        let mut i = healthy();
        i.isa = ("portable".into(), true);
        let want = if cfg!(target_arch = "x86_64") {
            vec![("cpu".to_string(), Level::Warning)]
        } else {
            vec![]
        };
        assert_eq!(bad(&i), want);
    }

    #[test]
    fn loopback_clusters_and_young_nodes_are_not_faults() {
        // every node on loopback: one machine, nothing to reach from elsewhere
        let mut i = healthy();
        i.listen = Some("127.0.0.1:1".parse().unwrap());
        i.api = Some("127.0.0.1:2".parse().unwrap());
        i.peers[0].listen = Some("127.0.0.1:3".parse().unwrap());
        i.peers[0].api = Some("127.0.0.1:4".parse().unwrap());
        assert!(bad(&i).is_empty(), "{:?}", bad(&i));
        // a link not measured yet in the first seconds
        let mut i = healthy();
        i.peers[0].measured = false;
        i.uptime_s = 3;
        assert!(bad(&i).is_empty());
        // the secret from the environment
        let mut i = healthy();
        i.secret = None;
        assert!(bad(&i).is_empty());
        // outside a cluster only the host is checked
        let mut i = healthy();
        i.in_cluster = false;
        i.secret = Some(("/x".into(), Some(0o100644)));
        let checks: Vec<String> = findings(&i).into_iter().map(|f| f.check).collect();
        assert_eq!(checks, ["cluster", "memory", "cpu", "gpu", "huge_pages"]);
    }

    #[test]
    fn a_failed_gpu_is_a_problem_naming_it_and_why() {
        let mut i = healthy();
        i.failed_gpus = vec![(0, "the GPU device was lost (Destroyed)".into())];
        let f = findings(&i).into_iter().find(|f| f.check == "gpu").unwrap();
        assert_eq!(f.level, Level::Problem);
        assert!(
            f.what.contains("gpu:0 failed: the GPU device was lost"),
            "{}",
            f.what
        );
        assert!(f.fix.unwrap().contains("restart shoal serve"));
    }
}
