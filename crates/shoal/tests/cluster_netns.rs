//! Three `shoal serve` nodes in three network namespaces joined by a Linux bridge, as three
//! hosts on a LAN: they find each other by mDNS alone (no `--peer`) within 5 s and agree on
//! membership; then `shoal load qwen05 --strategy auto` places the model across them (each
//! node offers at most 800 MB, so it cannot stay on one) although only the first node has
//! the model file, and the split answers as one process does. Needs root and iproute2; where either is missing the test says so and passes,
//! unless `SHOAL_REQUIRE_NETNS=1` (CI sets it) makes that a failure.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Namespaces `<tag>n0..n2` with veths on bridge `<tag>br`, addresses 10.<x>.0.1-3, and the
/// bridge itself at 10.<x>.0.254 so this process can reach the nodes. Removed on drop.
struct Lan {
    tag: String,
    subnet: String,
    n: usize,
}

impl Lan {
    fn new(n: usize) -> Result<Lan, String> {
        let pid = std::process::id();
        let lan = Lan {
            tag: format!("sh{}", pid % 100_000),
            subnet: format!("10.{}.{}", 100 + pid % 100, (pid / 100) % 250),
            n,
        };
        let br = format!("{}br", lan.tag);
        ip(&["link", "add", &br, "type", "bridge"])?;
        ip(&["addr", "add", &format!("{}.254/24", lan.subnet), "dev", &br])?;
        ip(&["link", "set", &br, "up"])?;
        for i in 0..n {
            let ns = lan.ns(i);
            let (host, peer) = (format!("{}h{i}", lan.tag), format!("{}p{i}", lan.tag));
            ip(&["netns", "add", &ns])?;
            ip(&["link", "add", &host, "type", "veth", "peer", "name", &peer])?;
            ip(&["link", "set", &host, "master", &br])?;
            ip(&["link", "set", &host, "up"])?;
            ip(&["link", "set", &peer, "netns", &ns])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/24", lan.addr(i)),
                "dev",
                &peer,
            ])?;
            ip(&["-n", &ns, "link", "set", &peer, "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            // multicast (mDNS) leaves through the veth
            ip(&["-n", &ns, "route", "add", "224.0.0.0/4", "dev", &peer])?;
        }
        Ok(lan)
    }

    fn ns(&self, i: usize) -> String {
        format!("{}n{i}", self.tag)
    }

    fn addr(&self, i: usize) -> String {
        format!("{}.{}", self.subnet, i + 1)
    }
}

impl Drop for Lan {
    fn drop(&mut self) {
        for i in 0..self.n {
            let _ = ip(&["netns", "del", &self.ns(i)]);
            let _ = ip(&["link", "del", &format!("{}h{i}", self.tag)]);
        }
        let _ = ip(&["link", "del", &format!("{}br", self.tag)]);
    }
}

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn alive(url: &str) -> Vec<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_shoal"))
        .args(["nodes", "--json", "--url", url])
        .env_remove("SHOAL_API_KEY")
        .output()
        .unwrap();
    if !out.status.success() {
        return vec![];
    }
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    let mut ids: Vec<String> = v
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|n| n["alive"] == true)
                .filter_map(|n| n["id"].as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default();
    ids.sort();
    ids
}

#[test]
fn three_namespaces_on_a_bridge_find_each_other_by_mdns() {
    let lan = match Lan::new(3) {
        Ok(l) => l,
        Err(e) => {
            assert!(
                std::env::var("SHOAL_REQUIRE_NETNS").as_deref() != Ok("1"),
                "cannot build the namespaces: {e}"
            );
            eprintln!(
                "skipping: cannot build network namespaces here ({e}); needs root and iproute2"
            );
            return;
        }
    };
    let model = shoal_model::catalog::Catalog::open_default()
        .ok()
        .and_then(|c| c.cached_path("qwen05").ok().flatten());
    if model.is_none() {
        assert!(
            std::env::var_os("SHOAL_REQUIRE_MODELS").is_none(),
            "qwen05 is required: run `shoal models fetch qwen05`"
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "netns test secret, long enough").unwrap();
    let mut procs = Vec::new();
    let mut nodes = Vec::new();
    for i in 0..3 {
        let addr = lan.addr(i);
        // only the first node has the model
        let home = match (&model, i) {
            (Some(m), 0) => m.parent().unwrap().parent().unwrap().to_path_buf(),
            _ => dir.path().join(format!("home{i}")),
        };
        let mut child = Command::new("ip")
            .args(["netns", "exec", &lan.ns(i)])
            .arg(env!("CARGO_BIN_EXE_shoal"))
            .arg("serve")
            .args(["--listen", &format!("{addr}:7338")])
            .args(["--api", &format!("{addr}:7337")])
            .args([
                "--name",
                &format!("host{i}"),
                "-t",
                "1",
                "--max-memory",
                "800M",
            ])
            .env("SHOAL_HOME", &home)
            .arg("--secret-file")
            .arg(&secret)
            .arg("--data-dir")
            .arg(dir.path().join(format!("n{i}")))
            .env_remove("SHOAL_SECRET")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let ready: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
        nodes.push((
            ready["node"].as_str().unwrap().to_string(),
            format!("http://{}", ready["api"].as_str().unwrap()),
        ));
        procs.push(Proc(child));
    }
    let mut all: Vec<String> = nodes.iter().map(|(id, _)| id.clone()).collect();
    all.sort();
    let t0 = Instant::now();
    while !nodes.iter().all(|(_, url)| alive(url) == all) {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the three hosts did not find each other within 5 s: {:?}",
            nodes.iter().map(|(_, u)| alive(u)).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!(
        "three hosts on a bridge found each other by mDNS in {:?}",
        t0.elapsed()
    );
    let Some(model) = model else {
        eprintln!("skipping the placement: qwen05 is not fetched");
        return;
    };
    let shoal = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_shoal"))
            .args(args)
            .env_remove("SHOAL_API_KEY")
            .output()
            .unwrap();
        let (o, e) = (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        );
        assert!(out.status.success(), "shoal {args:?}: {e}");
        (o, e)
    };
    let question = "What is the capital of France?";
    let (want, _) = shoal(&[
        "run",
        model.to_str().unwrap(),
        question,
        "--temp",
        "0",
        "-n",
        "24",
        "-t",
        "1",
    ]);
    let t0 = Instant::now();
    // from the host of the node asked: changing what runs is for its own machine (or an
    // administrator key)
    let out = Command::new("ip")
        .args(["netns", "exec", &lan.ns(1)])
        .arg(env!("CARGO_BIN_EXE_shoal"))
        .args([
            "load",
            "qwen05",
            "--strategy",
            "auto",
            "--ctx",
            "512",
            "--json",
        ])
        .args(["--url", &nodes[1].1])
        .env_remove("SHOAL_API_KEY")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "load: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let placed = String::from_utf8_lossy(&out.stdout).into_owned();
    let inst: Value = serde_json::from_str(&placed).unwrap();
    let used = inst["nodes"].as_array().unwrap().len();
    assert!(used >= 2, "placed across the hosts: {inst}");
    eprintln!(
        "placed and ready across {used} hosts in {:?}: {}",
        t0.elapsed(),
        inst["placement"]
    );
    let lead = format!("http://{}", inst["api"].as_str().unwrap());
    let (got, _) = shoal(&[
        "run", "qwen05", question, "--temp", "0", "-n", "24", "--url", &lead,
    ]);
    assert_eq!(got, want, "{}", inst["placement"]);
    drop(procs);
}
