//! Nodes of different cluster protocol versions. The tests play other builds of shoal with
//! `SHOAL_PROTOCOL_VERSION` (`VERSION:OLDEST`; a build's own versions are constants):
//!
//! - a node whose version does not work with the cluster's (version 4 working with 4 only,
//!   against version 3) is refused with both versions named, shown by `shoal status` and
//!   `shoal doctor`, and kept out of the planner's view, while a newer node that works with
//!   version 3 joins as any other;
//! - a rolling upgrade: each node of a three-node cluster serving qwen05 split in pipeline
//!   stages is killed in turn and started again as a newer build (4, working with 1), while
//!   four clients stream through an entry node; no stream is lost and every one gives the
//!   text of the uninterrupted run (stages compute whole layers, so every placement of the
//!   upgrade gives the same tokens; tensor splits of different widths round differently).

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{cached_model, json_of, node, node_with_env, run, wait_until, wait_until_else, Node};
use serde_json::{json, Value};

/// `GET path` on the node at `url`, as JSON.
fn get(url: &str, path: &str) -> Value {
    ureq::get(&format!("{url}{path}"))
        .call()
        .unwrap_or_else(|e| panic!("GET {path}: {e}"))
        .body_mut()
        .read_json()
        .unwrap()
}

#[test]
fn a_node_of_an_incompatible_version_is_refused_and_shown() {
    let dir = tempfile::tempdir().unwrap();
    let secret = common::secret(dir.path());
    let home = dir.path().join("home");
    let a = node(dir.path(), "a", &secret, &home, None, &[]);
    let newer = |name: &str, versions: &str| {
        node_with_env(
            dir.path(),
            name,
            &secret,
            &home,
            Some(&a.listen),
            &["--no-mdns"],
            &[("SHOAL_PROTOCOL_VERSION", versions)],
        )
    };
    let b = newer("b", "4:4");
    let c = newer("c", "4:1");
    // a refuses b's sessions, naming b's versions; c works with a
    let refused = wait_until(Duration::from_secs(60), "a refuses b", || {
        let st = json_of(&["status", "--json", "--url", &a.url]);
        let list = st["incompatible_nodes"].as_array()?.clone();
        list.iter().find(|p| p["node"] == b.id.as_str()).cloned()
    });
    assert_eq!(
        refused["versions"],
        json!({"version": 4, "oldest": 4}),
        "{refused}"
    );
    wait_until(
        Duration::from_secs(60),
        "a and c measure their link",
        || {
            let l = get(&a.url, "/cluster/links");
            l["links"]
                .as_array()?
                .iter()
                .any(|x| {
                    (x["from"] == a.id.as_str() && x["to"] == c.id.as_str())
                        || (x["from"] == c.id.as_str() && x["to"] == a.id.as_str())
                })
                .then_some(())
        },
    );
    let st = json_of(&["status", "--json", "--url", &a.url]);
    assert!(
        !st["incompatible_nodes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["node"] == c.id.as_str()),
        "c works with a: {st}"
    );
    // the newer node, refused by a, sees a refused too
    let st_b = json_of(&["status", "--json", "--url", &b.url]);
    assert!(
        st_b["incompatible_nodes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["node"] == a.id.as_str() && p["versions"]["version"] == 3),
        "{st_b}"
    );
    // shown: shoal status and shoal doctor name both versions
    let (ok, out, err) = run(&["status", "--url", &a.url]);
    assert!(ok, "{err}");
    eprintln!("{out}");
    assert!(
        out.contains(&format!("refused node {}", b.id))
            && out.contains("cluster protocol 4 (works with 4..), this node 3 (works with 1..)"),
        "{out}"
    );
    let (_, out, _) = run(&["doctor", "--url", &a.url]);
    eprintln!("{out}");
    let line = out
        .lines()
        .find(|l| l.contains("versions"))
        .unwrap_or_else(|| panic!("no versions finding: {out}"));
    assert!(
        line.contains(&b.id) && line.contains("version 4 (works with 4 only)"),
        "{out}"
    );
    assert!(
        out.contains("this node: version 3 (works with 1 to 3)"),
        "{out}"
    );
    // the planner never sees b; c is there
    let view = get(&a.url, "/cluster/planner");
    let ids: Vec<&str> = view["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|n| n["id"].as_str())
        .collect();
    assert!(
        ids.contains(&c.id.as_str()) && !ids.contains(&b.id.as_str()),
        "{view}"
    );
}

/// Tokens each stream generates.
const TOKENS: usize = 120;

const PROMPTS: [&str; 4] = [
    "Tell me a long story about a lighthouse keeper.",
    "Explain in detail how a bicycle works.",
    "Describe a walk through a busy market, at length.",
    "Write a long letter to a friend about the mountains.",
];

/// A greedy stream of `prompt` on qwen05 through `url`: its text, or what went wrong.
fn stream(url: &str, prompt: &str) -> Result<String, String> {
    common::greedy_stream(url, "qwen05", prompt, TOKENS).map(|(text, _)| text)
}

#[test]
fn a_rolling_upgrade_under_four_streams_loses_none() {
    let Some(model) = cached_model("qwen05") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let secret = common::secret(dir.path());
    let home = model.parent().unwrap().parent().unwrap().to_path_buf();
    let extra = ["--no-mdns", "--parallel", "4"];
    let start = |name: &str, seed: Option<&str>, env: &[(&str, &str)]| {
        node_with_env(dir.path(), name, &secret, &home, seed, &extra, env)
    };
    let a = start("a", None, &[]);
    let seed = a.listen.clone();
    let mut nodes: Vec<Node> = vec![a];
    for n in ["b", "c"] {
        nodes.push(start(n, Some(&seed), &[]));
    }
    nodes.push(node_with_env(
        dir.path(),
        "e",
        &secret,
        &home,
        Some(&seed),
        &["--no-mdns", "--no-compute"],
        &[],
    ));
    common::agree(&nodes);
    let entry_url = nodes[3].url.clone();
    let entry_listen = nodes[3].listen.clone();
    let (ok, out, err) = run(&[
        "load",
        "qwen05",
        "--strategy",
        "pipeline",
        "--nodes",
        "a,b",
        "--ctx",
        "1024",
        "--json",
        "--url",
        &entry_url,
    ]);
    assert!(ok, "load: {err}");
    let inst: Value = serde_json::from_str(&out).unwrap();
    eprintln!("placed: {}", inst["placement"]);
    // the instance once ready at a generation of at least `generation`; a timeout shows
    // what the entry node last listed and the end of each node's log
    let ready = |generation: u64| {
        let last = std::cell::RefCell::new(Value::Null);
        wait_until_else(
            Duration::from_secs(120),
            &format!("the instance is ready at generation {generation} or later"),
            || {
                *last.borrow_mut() = json_of(&["ps", "--json", "--url", &entry_url]);
                let ps = last.borrow();
                ps.as_array()?
                    .iter()
                    .find(|i| {
                        i["id"] == "qwen05"
                            && i["state"] == "ready"
                            && i["generation"].as_u64().unwrap_or(0) >= generation
                    })
                    .cloned()
            },
            || {
                let logs = common::log_tails(dir.path(), &["a", "b", "c", "e"], 30);
                format!("the entry node lists {:#}\n{logs}", last.borrow())
            },
        )
    };
    let mut info = ready(0);
    let want: Vec<String> = PROMPTS
        .iter()
        .map(|p| stream(&entry_url, p).unwrap_or_else(|e| panic!("uninterrupted: {e}")))
        .collect();
    // four clients stream through the entry node, one request after another, until the
    // upgrade is over
    let upgrading = Arc::new(AtomicBool::new(true));
    let (done, lost) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let clients: Vec<_> = (0..4)
        .map(|i| {
            let (url, want) = (entry_url.clone(), want[i].clone());
            let (upgrading, done, lost) = (upgrading.clone(), done.clone(), lost.clone());
            std::thread::spawn(move || {
                let mut failures = Vec::new();
                loop {
                    match stream(&url, PROMPTS[i]) {
                        Ok(text) if text == want => {}
                        Ok(text) => failures.push(format!("client {i}: other text: {text:?}")),
                        Err(e) => failures.push(format!("client {i}: {e}")),
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                    if !failures.is_empty() {
                        lost.fetch_add(1, Ordering::Relaxed);
                    }
                    if !upgrading.load(Ordering::Relaxed) {
                        return failures;
                    }
                }
            })
        })
        .collect();
    // one node at a time: first the one holding no share, then the instance's lead, then
    // the last (the entry node, the clients' own, would be upgraded once they are done)
    let mut left: Vec<String> = ["a", "b", "c"].map(String::from).to_vec();
    for step in 0..3 {
        std::thread::sleep(Duration::from_secs(3));
        let holders: Vec<String> = info["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|n| n.as_str().map(str::to_string))
            .collect();
        let name = match step {
            0 => left.iter().find(|n| !holders.contains(n)).cloned(),
            1 => left.iter().find(|n| *n == &holders[0]).cloned(),
            _ => None,
        }
        .unwrap_or_else(|| left[0].clone());
        left.retain(|n| n != &name);
        let name = name.as_str();
        let i = nodes.iter().position(|n| n.name == name).unwrap();
        let id = nodes[i].id.clone();
        let placed = holders.iter().any(|n| n == name);
        let lead = holders.first().is_some_and(|n| n == name);
        eprintln!("upgrading {name} (holds a share: {placed}, leads: {lead})");
        drop(nodes.remove(i));
        let new = start(
            name,
            Some(&entry_listen),
            &[("SHOAL_PROTOCOL_VERSION", "4:1")],
        );
        assert_eq!(new.id, id, "the node keeps its identity across the upgrade");
        nodes.push(new);
        let generation = info["generation"].as_u64().unwrap() + u64::from(placed);
        info = ready(generation);
        eprintln!("{name} upgraded; qwen05 on {}", info["placement"]);
    }
    std::thread::sleep(Duration::from_secs(3));
    upgrading.store(false, Ordering::Relaxed);
    let failures: Vec<String> = clients
        .into_iter()
        .flat_map(|c| c.join().unwrap())
        .collect();
    eprintln!(
        "rolling upgrade: {} streams, {} lost",
        done.load(Ordering::Relaxed),
        lost.load(Ordering::Relaxed)
    );
    assert!(failures.is_empty(), "{failures:#?}");
    // every node now speaks version 4 and works with the entry node's 3
    let a = nodes.iter().find(|n| n.name == "a").unwrap();
    let st = json_of(&["status", "--json", "--url", &a.url]);
    assert_eq!(st["protocol"], json!({"version": 4, "oldest": 1}), "{st}");
    assert_eq!(st["incompatible_nodes"], json!([]), "{st}");
}
