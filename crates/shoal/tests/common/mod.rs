//! What the cluster tests share: the `shoal` binary, a catalog model from the cache, `shoal
//! serve` nodes on loopback (killed when dropped), CLI calls, and waiting for a condition.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The `shoal` binary, without the caller's key or URL: this build's, or the one
/// `SHOAL_TEST_BIN` names (a benchmark comparing two builds runs a test with each).
pub fn shoal() -> Command {
    let bin = std::env::var_os("SHOAL_TEST_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_shoal")));
    let mut c = Command::new(bin);
    c.env_remove("SHOAL_API_KEY").env_remove("SHOAL_URL");
    c
}

/// Whether the tests run another build than this one (`SHOAL_TEST_BIN`): checks of what
/// this build does are then reported, not asserted.
pub fn other_build() -> bool {
    std::env::var_os("SHOAL_TEST_BIN").is_some()
}

/// The cached file of catalog model `key`; `None` (the test skips) when it is not fetched,
/// unless `SHOAL_REQUIRE_MODELS` is set.
pub fn cached_model(key: &str) -> Option<PathBuf> {
    let p = shoal_model::catalog::Catalog::open_default()
        .ok()
        .and_then(|c| c.cached_path(key).ok().flatten());
    if p.is_none() {
        assert!(
            std::env::var_os("SHOAL_REQUIRE_MODELS").is_none(),
            "{key} is required: run `shoal models fetch {key}`"
        );
        eprintln!("skipped: {key} is not fetched");
    }
    p
}

/// A `shoal serve` process.
pub struct Node {
    pub child: Child,
    pub name: String,
    pub id: String,
    pub url: String,
    pub listen: String,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A node called `name` offering at most 800 MB, its model cache `home`, its data and log
/// (`NAME.log`) in `dir`, joining through `peer` (mDNS off), with `extra` arguments.
pub fn node(
    dir: &Path,
    name: &str,
    secret: &Path,
    home: &Path,
    peer: Option<&str>,
    extra: &[&str],
) -> Node {
    let mut args = vec!["--no-mdns"];
    args.extend(extra);
    node_with(dir, name, secret, home, peer, &args)
}

/// [`node`] with mDNS on unless `extra` turns it off.
pub fn node_with(
    dir: &Path,
    name: &str,
    secret: &Path,
    home: &Path,
    peer: Option<&str>,
    extra: &[&str],
) -> Node {
    node_with_env(dir, name, secret, home, peer, extra, &[])
}

/// [`node_with`], with `env` set for the node's process.
pub fn node_with_env(
    dir: &Path,
    name: &str,
    secret: &Path,
    home: &Path,
    peer: Option<&str>,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Node {
    let mut cmd = shoal();
    cmd.envs(env.iter().copied());
    cmd.arg("serve")
        .args(["--api", "127.0.0.1:0", "--listen", "127.0.0.1:0", "-t", "1"])
        .args(["--name", name, "--max-memory", "800M"])
        .args(extra)
        .arg("--secret-file")
        .arg(secret)
        .arg("--data-dir")
        .arg(dir.join(name))
        .env("SHOAL_HOME", home)
        .env_remove("SHOAL_SECRET")
        .env("SHOAL_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(
            // appended: a node restarted under its name keeps one log
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(dir.join(format!("{name}.log")))
                .map(Stdio::from)
                .unwrap_or(Stdio::null()),
        );
    if let Some(p) = peer {
        cmd.args(["--peer", p]);
    }
    let mut child = cmd.spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let ready: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
    Node {
        child,
        name: name.to_string(),
        id: ready["node"].as_str().unwrap().to_string(),
        url: format!("http://{}", ready["api"].as_str().unwrap()),
        listen: ready["listen"].as_str().unwrap().to_string(),
    }
}

/// A new cluster secret written to `dir/secret`, readable by its owner only.
pub fn secret(dir: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join("secret");
    let (ok, s, err) = run(&["secret"]);
    assert!(ok, "{err}");
    std::fs::write(&path, s).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

/// `shoal ARGS`: success, stdout, stderr.
pub fn run(args: &[&str]) -> (bool, String, String) {
    let out = shoal().args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `shoal ARGS`'s JSON output (it must succeed).
pub fn json_of(args: &[&str]) -> Value {
    let (ok, out, err) = run(args);
    assert!(ok, "shoal {args:?}: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// Waits for `f` to give a value, at most `limit`.
pub fn wait_until<T>(limit: Duration, what: &str, f: impl FnMut() -> Option<T>) -> T {
    wait_until_else(limit, what, f, String::new)
}

/// [`wait_until`], whose panic at `limit` adds what `explain` then says (the state waited on,
/// the nodes' logs).
pub fn wait_until_else<T>(
    limit: Duration,
    what: &str,
    mut f: impl FnMut() -> Option<T>,
    explain: impl FnOnce() -> String,
) -> T {
    let t0 = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        if t0.elapsed() >= limit {
            let why = explain();
            let sep = if why.is_empty() { "" } else { "\n" };
            panic!("{what}: not within {limit:?}{sep}{why}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The log of the node started as `name` in `dir` (every run under that name); empty when
/// there is none.
pub fn node_log(dir: &Path, name: &str) -> String {
    std::fs::read_to_string(dir.join(format!("{name}.log"))).unwrap_or_default()
}

/// The last `n` lines of each named node's log in `dir`, each under a heading.
pub fn log_tails(dir: &Path, names: &[&str], n: usize) -> String {
    names
        .iter()
        .map(|name| {
            let log = node_log(dir, name);
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines[lines.len().saturating_sub(n)..].join("\n");
            format!("--- {name}.log, its last {n} lines\n{tail}\n")
        })
        .collect()
}

/// [`wait_until`], also giving how long it took.
pub fn wait_timed<T>(limit: Duration, what: &str, f: impl FnMut() -> Option<T>) -> (T, Duration) {
    let t0 = Instant::now();
    let v = wait_until(limit, what, f);
    (v, t0.elapsed())
}

/// Waits until `nodes` each see all of them alive.
pub fn agree(nodes: &[Node]) {
    for n in nodes {
        wait_until(Duration::from_secs(30), "the nodes agree", || {
            let v = json_of(&["nodes", "--json", "--url", &n.url]);
            (v.as_array()?.iter().filter(|n| n["alive"] == true).count() == nodes.len())
                .then_some(())
        });
    }
}

/// A greedy chat stream (OpenAI chat, `ignore_eos`) of `prompt` on `model` through `url`,
/// `tokens` long: its text and the longest time between two pieces of it, or what went
/// wrong. A refusal that asks to retry (502 or 503) is `Err("retry: status N")`; an error
/// event, a broken stream or one that ends without a finish reason is an error too.
pub fn greedy_stream(
    url: &str,
    model: &str,
    prompt: &str,
    tokens: usize,
) -> Result<(String, Duration), String> {
    let body = serde_json::json!({"model": model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0, "max_tokens": tokens, "ignore_eos": true, "stream": true});
    let resp = ureq::post(&format!("{url}/v1/chat/completions"))
        .send_json(&body)
        .map_err(|e| match e {
            ureq::Error::StatusCode(s @ (502 | 503)) => format!("retry: status {s}"),
            e => format!("the request failed: {e}"),
        })?;
    let (mut text, mut gap, mut last, mut finished) = (String::new(), Duration::ZERO, None, false);
    for line in BufReader::new(resp.into_body().into_reader()).lines() {
        let line = line.map_err(|e| format!("the stream broke: {e}"))?;
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(data).map_err(|e| format!("{e}: {data}"))?;
        if let Some(e) = v.get("error") {
            return Err(format!("error event: {e}"));
        }
        if let Some(t) = v["choices"][0]["delta"]["content"]
            .as_str()
            .filter(|t| !t.is_empty())
        {
            let now = Instant::now();
            if let Some(l) = last {
                gap = gap.max(now - l);
            }
            last = Some(now);
            text.push_str(t);
        }
        finished |= v["choices"][0]["finish_reason"] == "length";
    }
    if finished {
        Ok((text, gap))
    } else {
        Err(format!("ended without a finish reason after {text:?}"))
    }
}

/// The value of the metric `name` (its first labelled line) in a `/metrics` body.
pub fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in the metrics"))
}
