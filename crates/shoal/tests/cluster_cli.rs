//! `shoal serve` nodes forming a cluster, as processes on loopback: they find each other
//! (through a `--peer` seed, and by mDNS alone), agree on membership, measure their links,
//! keep a node with the wrong secret out (it is refused and counted, membership does not
//! change), declare a killed node dead within seconds, and agree on a new coordinator when
//! the coordinator dies. `shoal nodes`, `links` and `status` read it all through the API.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

fn shoal() -> Command {
    Command::new(env!("CARGO_BIN_EXE_shoal"))
}

struct Node {
    child: Child,
    id: String,
    url: String,
    listen: String,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Node {
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts a model-less node of the cluster whose secret is in `secret`, seeded with `peers`.
fn node(dir: &Path, name: &str, secret: &Path, peers: &[&str], mdns: bool) -> Node {
    let mut cmd = shoal();
    cmd.arg("serve")
        .args(["--api", "127.0.0.1:0", "--listen", "127.0.0.1:0", "-t", "1"])
        .args(["--name", name])
        .arg("--secret-file")
        .arg(secret)
        .arg("--data-dir")
        .arg(dir.join(name))
        .env_remove("SHOAL_SECRET")
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    for p in peers {
        cmd.args(["--peer", p]);
    }
    if !mdns {
        cmd.arg("--no-mdns");
    }
    let mut child = cmd.spawn().unwrap();
    let ready = ready_line(&mut child);
    Node {
        child,
        id: ready["node"].as_str().unwrap().to_string(),
        url: format!("http://{}", ready["api"].as_str().unwrap()),
        listen: ready["listen"]
            .as_str()
            .unwrap_or_else(|| panic!("no cluster port: {ready}"))
            .to_string(),
    }
}

/// The JSON line a started `shoal serve` prints once it serves.
fn ready_line(child: &mut Child) -> Value {
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"))
}

fn look(cmd: &str, url: &str) -> Value {
    let out = shoal()
        .args([cmd, "--json", "--url", url])
        .env_remove("SHOAL_API_KEY")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "shoal {cmd}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Ids of the live nodes `url` knows, sorted.
fn alive(url: &str) -> Vec<String> {
    let mut ids: Vec<String> = look("nodes", url)
        .as_array()
        .unwrap()
        .iter()
        .filter(|n| n["alive"] == true)
        .map(|n| n["id"].as_str().unwrap().to_string())
        .collect();
    ids.sort();
    ids
}

/// Waits until `ok` holds, up to `limit`; returns how long it took.
fn wait_until(limit: Duration, what: &str, mut ok: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while !ok() {
        assert!(t0.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    t0.elapsed()
}

fn secret_file(dir: &Path, name: &str) -> std::path::PathBuf {
    let out = shoal().arg("secret").output().unwrap();
    assert!(out.status.success());
    let p = dir.join(name);
    std::fs::write(&p, &out.stdout).unwrap();
    p
}

#[test]
fn seeded_nodes_agree_measure_links_keep_strangers_out_and_survive_losses() {
    let dir = tempfile::tempdir().unwrap();
    let secret = secret_file(dir.path(), "secret");
    let a = node(dir.path(), "a", &secret, &[], false);
    let b = node(dir.path(), "b", &secret, &[&a.listen], false);
    let c = node(dir.path(), "c", &secret, &[&b.listen], false);
    let mut all = vec![a.id.clone(), b.id.clone(), c.id.clone()];
    all.sort();
    let took = wait_until(Duration::from_secs(10), "three nodes agree", || {
        [&a, &b, &c].iter().all(|n| alive(&n.url) == all)
    });
    eprintln!("three seeded nodes agreed in {took:?}");

    // every node shows the others' facts, and one coordinator: the lowest id
    let nodes = look("nodes", &c.url);
    for n in nodes.as_array().unwrap() {
        assert!(
            n["facts"]["mem_bandwidth_gbs"].as_f64().unwrap() > 0.0,
            "{n}"
        );
        assert!(
            n["facts"]["memory_total_bytes"].as_u64().unwrap() > 0,
            "{n}"
        );
        assert_eq!(n["coordinator"] == true, n["id"] == all[0].as_str(), "{n}");
    }

    // links: each node measures the other two
    wait_until(Duration::from_secs(15), "six links measured", || {
        look("links", &a.url).as_array().unwrap().len() == 6
    });
    for l in look("links", &b.url).as_array().unwrap() {
        assert!(l["rtt_us"].as_f64().unwrap() > 0.0, "{l}");
        assert!(l["bandwidth_gbps"].as_f64().unwrap() > 0.0, "{l}");
        // and the round trips of messages of a split's sizes, 4, 16 and 64 KiB
        let sized: Vec<u64> = l["sized"]
            .as_array()
            .unwrap_or_else(|| panic!("no sized round trips: {l}"))
            .iter()
            .map(|m| {
                assert!(m["rtt_us"].as_f64().unwrap() > 0.0, "{l}");
                m["bytes"].as_u64().unwrap()
            })
            .collect();
        assert_eq!(sized, [4096, 16384, 65536], "{l}");
    }

    // a stranger with another secret is refused; membership does not change
    let other = secret_file(dir.path(), "other-secret");
    let stranger = node(dir.path(), "stranger", &other, &[&a.listen], false);
    std::thread::sleep(Duration::from_secs(3));
    for n in [&a, &b, &c] {
        assert_eq!(alive(&n.url), all, "the stranger got in");
    }
    assert_eq!(alive(&stranger.url), vec![stranger.id.clone()]);
    let status = look("status", &a.url);
    assert!(
        status["refused_datagrams"].as_u64().unwrap() > 0,
        "the stranger's gossip was not counted as refused: {status}"
    );

    // killing a node: declared dead by the others within seconds
    let mut nodes = vec![a, b, c];
    let victim = nodes.iter().position(|n| n.id != all[0]).unwrap();
    let victim_id = nodes[victim].id.clone();
    nodes[victim].kill();
    let t = wait_until(
        Duration::from_secs(5),
        "the killed node is declared dead",
        || {
            nodes
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != victim)
                .all(|(_, n)| !alive(&n.url).contains(&victim_id))
        },
    );
    eprintln!("a killed node was declared dead in {t:?}");
    nodes.remove(victim);

    // killing the coordinator: the survivor becomes coordinator
    let coord = nodes.iter().position(|n| n.id == all[0]).unwrap();
    nodes[coord].kill();
    let survivor = &nodes[1 - coord];
    let t = wait_until(Duration::from_secs(5), "the survivor takes over", || {
        look("status", &survivor.url)["coordinator"] == survivor.id.as_str()
    });
    eprintln!("the coordinator's death was noticed and replaced in {t:?}");
}

#[test]
fn nodes_find_each_other_by_mdns_alone() {
    let dir = tempfile::tempdir().unwrap();
    let secret = secret_file(dir.path(), "secret");
    let nodes: Vec<Node> = ["m1", "m2", "m3"]
        .iter()
        .map(|n| node(dir.path(), n, &secret, &[], true))
        .collect();
    let mut all: Vec<String> = nodes.iter().map(|n| n.id.clone()).collect();
    all.sort();
    let t0 = Instant::now();
    while !nodes.iter().all(|n| alive(&n.url) == all) {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "three nodes did not find each other by mDNS within 5 s; they see {:?} of {all:?}",
            nodes.iter().map(|n| alive(&n.url)).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let took = t0.elapsed();
    eprintln!("three nodes found each other by mDNS in {took:?}");
}

#[test]
fn a_node_without_a_secret_or_a_model_says_what_is_missing() {
    let dir = tempfile::tempdir().unwrap();
    let out = shoal()
        .arg("serve")
        .arg("--data-dir")
        .arg(dir.path())
        .env_remove("SHOAL_SECRET")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--secret-file"), "{err}");
    let short = dir.path().join("short");
    std::fs::write(&short, "abc\n").unwrap();
    let out = shoal()
        .arg("serve")
        .arg("--secret-file")
        .arg(&short)
        .arg("--data-dir")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("at least 16"), "{err}");
}

/// A node started with `--calibrate` measures its costs of its model's shape before it
/// serves and keeps them in its store; the node publishes them, and the cluster's planner
/// (`shoal plan` against the live node) predicts that node from them. A node started
/// without them publishes a calibration `shoal bench --calibrate` stores while it runs,
/// without a restart. A start with `--calibrate` that finds them stored does not measure
/// again.
#[test]
fn a_calibrated_node_publishes_its_measured_costs_to_the_planner() {
    use shoal_testkit::{GgmlType, TinyModelSpec};
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny.gguf");
    TinyModelSpec::llama(3)
        .build()
        .unwrap()
        .write_gguf(&model, GgmlType::Q8_0)
        .unwrap();
    let secret = secret_file(dir.path(), "secret");
    let home = dir.path().join("home");
    let start = |log: &Path, calibrate: bool| {
        let mut cmd = shoal();
        cmd.arg("serve")
            .args(["--api", "127.0.0.1:0", "--listen", "127.0.0.1:0", "-t", "1"])
            .args(["--name", "calibrated", "--no-mdns"])
            .arg("--model")
            .arg(&model)
            .arg("--secret-file")
            .arg(&secret)
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .env("SHOAL_HOME", &home)
            .env("SHOAL_LOG", "shoal=info")
            .env_remove("SHOAL_SECRET")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(log).unwrap());
        if calibrate {
            cmd.arg("--calibrate");
        }
        let mut child = cmd.spawn().unwrap();
        let ready = ready_line(&mut child);
        let url = format!("http://{}", ready["api"].as_str().unwrap());
        (child, url)
    };
    // whether the live node's planner predicts the one-node placement from measured costs
    let calibrated = |url: &str| {
        let out = shoal()
            .arg("plan")
            .arg(&model)
            .args(["--url", url, "--json", "--top", "0"])
            .env_remove("SHOAL_API_KEY")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let rows: Value = serde_json::from_slice(&out.stdout).unwrap();
        rows[0]["calibrated"] == true
    };
    let first_log = dir.path().join("first.log");
    let (mut child, url) = start(&first_log, true);
    let stored: Vec<_> = std::fs::read_dir(home.join("calibrations"))
        .unwrap()
        .flatten()
        .collect();
    assert_eq!(stored.len(), 1, "one shape, one file: {stored:?}");
    assert!(calibrated(&url));
    let _ = child.kill();
    let _ = child.wait();
    let log = std::fs::read_to_string(&first_log).unwrap();
    assert!(log.contains("measured its shape's costs"), "{log}");

    // measured while a node runs: published without a restart
    std::fs::remove_dir_all(home.join("calibrations")).unwrap();
    let (mut child, url) = start(&dir.path().join("second.log"), false);
    assert!(!calibrated(&url));
    let out = shoal()
        .arg("bench")
        .arg(&model)
        .args([
            "-p",
            "0",
            "-n",
            "8",
            "-r",
            "1",
            "-t",
            "1",
            "--calibrate",
            "--json",
        ])
        .env("SHOAL_HOME", &home)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_until(
        Duration::from_secs(30),
        "the new calibration published",
        || calibrated(&url),
    );
    let _ = child.kill();
    let _ = child.wait();

    let third_log = dir.path().join("third.log");
    let (mut child, _) = start(&third_log, true);
    let _ = child.kill();
    let _ = child.wait();
    let log = std::fs::read_to_string(&third_log).unwrap();
    assert!(log.contains("measured already"), "{log}");
}
