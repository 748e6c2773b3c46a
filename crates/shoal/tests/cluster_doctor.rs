//! `shoal doctor` against real nodes: a healthy two-node cluster on loopback has nothing
//! wrong with its cluster (secret, strangers, mDNS, reachability, clocks; the host checks
//! may warn about this machine); a node whose secret file is world-readable is told to
//! `chmod 600` it; a node that a node with another secret knocks on reports the stranger;
//! and a node in a network namespace without multicast reports that mDNS cannot pass (needs
//! root and iproute2; skipped without them unless `SHOAL_REQUIRE_NETNS=1`).

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{node, node_with, run, wait_until};
use serde_json::Value;

/// The checks a cluster's own setup decides (the others describe the host).
const CLUSTER_CHECKS: [&str; 5] = ["secret", "strangers", "mdns", "reachable", "clock"];

/// `shoal doctor --json` at `url` (through `prefix`, e.g. `ip netns exec NS`): whether it
/// exited 0, and the findings that are not ok, as (check, level).
fn doctor(prefix: &[&str], url: &str) -> (bool, Vec<(String, String)>, Value) {
    let shoal = env!("CARGO_BIN_EXE_shoal");
    let mut cmd = match prefix.split_first() {
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(shoal);
            c
        }
        None => Command::new(shoal),
    };
    let out = cmd
        .args(["doctor", "--json", "--url", url])
        .env_remove("SHOAL_API_KEY")
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: {} {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let bad = v["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["level"] != "ok")
        .map(|f| {
            (
                f["check"].as_str().unwrap().to_string(),
                f["level"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    (out.status.success(), bad, v)
}

fn cluster_faults(bad: &[(String, String)]) -> Vec<(String, String)> {
    bad.iter()
        .filter(|(c, _)| CLUSTER_CHECKS.contains(&c.as_str()))
        .cloned()
        .collect()
}

fn write_secret(dir: &Path, name: &str, mode: u32) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let (ok, s, err) = run(&["secret"]);
    assert!(ok, "{err}");
    let p = dir.join(name);
    std::fs::write(&p, s).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
    p
}

#[test]
fn doctor_finds_each_fault_with_its_fix_and_nothing_on_a_healthy_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path().join("home");
    std::fs::create_dir_all(&home).unwrap();
    let good = write_secret(dir.path(), "good", 0o600);
    // mDNS on: the two find each other on this host; a cluster name of their own keeps
    // them apart from any other shoal node on the network
    let name = format!("doctor-{}", std::process::id());
    let own = ["--cluster", name.as_str()];
    let a = node_with(dir.path(), "a", &good, &home, None, &own);
    let b = node_with(dir.path(), "b", &good, &home, Some(&a.listen), &own);
    let nodes = [a, b];
    common::agree(&nodes);
    let [a, b] = &nodes;
    let nodes = [a, b];
    for n in nodes {
        // links are measured within seconds of joining
        let mut last = None;
        let settled = std::iter::repeat_with(|| {
            let r = doctor(&[], &n.url);
            let done = cluster_faults(&r.1).is_empty();
            last = Some(r.2.clone());
            std::thread::sleep(Duration::from_millis(if done { 0 } else { 250 }));
            done.then_some(r)
        })
        .take(80)
        .flatten()
        .next();
        let Some((ok, bad, v)) = settled else {
            panic!("{}: cluster findings after 20 s: {}", n.name, last.unwrap());
        };
        eprintln!("healthy {}: {bad:?}", n.name);
        assert!(ok, "{v}");
        let mdns = v["findings"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["check"] == "mdns")
            .unwrap();
        assert!(
            mdns["what"].as_str().unwrap().contains("multicast passes"),
            "{mdns}"
        );
        assert!(
            bad.iter().all(|(_, level)| level != "problem"),
            "{}: {v}",
            n.name
        );
    }

    // a world-readable secret, and a node with another secret knocking on a
    let loose = write_secret(dir.path(), "loose", 0o644);
    let c = node(dir.path(), "c", &loose, &home, Some(&a.listen), &own);
    let (ok, bad, v) = doctor(&[], &c.url);
    assert!(!ok, "a problem fails the command");
    assert!(
        bad.contains(&("secret".into(), "problem".into())),
        "{bad:?}"
    );
    let fix = v["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["check"] == "secret")
        .unwrap()["fix"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(fix.starts_with("chmod 600 "), "{fix}");
    let (ok, bad, _) = wait_until(Duration::from_secs(10), "a refuses the stranger", || {
        let r = doctor(&[], &a.url);
        r.1.contains(&("strangers".into(), "problem".into()))
            .then_some(r)
    });
    assert!(!ok, "{bad:?}");
    // the human form says what to do
    let (ok, text, _) = run(&["doctor", "--url", &a.url]);
    assert!(
        !ok && text.contains("fix: give every node the same secret file"),
        "{text}"
    );
    drop(c);

    // a namespace whose only interface routes no multicast
    let ns = format!("shoaldoc{}", std::process::id());
    let made = Command::new("ip").args(["netns", "add", &ns]).status();
    if !made.is_ok_and(|s| s.success()) {
        assert!(
            std::env::var("SHOAL_REQUIRE_NETNS").as_deref() != Ok("1"),
            "cannot make a network namespace"
        );
        eprintln!("skipping the multicast check: needs root and iproute2");
        return;
    }
    struct Ns(String);
    impl Drop for Ns {
        fn drop(&mut self) {
            let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
        }
    }
    let _ns = Ns(ns.clone());
    let up = Command::new("ip")
        .args(["netns", "exec", &ns, "ip", "link", "set", "lo", "up"])
        .status()
        .unwrap();
    assert!(up.success());
    let mut child = Command::new("ip")
        .args(["netns", "exec", &ns, env!("CARGO_BIN_EXE_shoal"), "serve"])
        .args(["--api", "127.0.0.1:0", "--listen", "127.0.0.1:0", "-t", "1"])
        .arg("--secret-file")
        .arg(&good)
        .arg("--data-dir")
        .arg(dir.path().join("isolated"))
        .env("SHOAL_HOME", &home)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let ready: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
    let url = format!("http://{}", ready["api"].as_str().unwrap());
    let (_, bad, v) = doctor(&["ip", "netns", "exec", &ns], &url);
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(
        cluster_faults(&bad),
        vec![("mdns".to_string(), "warning".to_string())],
        "{v}"
    );
}
