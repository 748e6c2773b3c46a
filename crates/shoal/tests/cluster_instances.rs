//! A model placed on a cluster of `shoal serve` processes on loopback: only one node has the
//! model file; each node offers at most 800 MB, so qwen05 (0.49 GB of weights, about 1 GB
//! on one node at this context) must be split. `shoal load` places it across the nodes (the
//! others fetch their slices from the node that has it), and it answers with the same greedy
//! text and token count as one process. Killing one of its nodes re-places it on the
//! survivors, which answer the same again; killing the coordinator loses no instance.
//! Unloading removes it everywhere.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{cached_model, json_of as json, run, wait_timed as wait_until, Node};
use serde_json::Value;

/// A node offering at most 800 MB that runs two requests at once (see [`common::node`]).
fn node(dir: &Path, name: &str, secret: &Path, home: &Path, peer: Option<&str>) -> Node {
    common::node(dir, name, secret, home, peer, &["--parallel", "2"])
}

const PROMPT: &str = "Write one sentence about the sea.";
const QUESTION: &str = "What is the capital of France?";
const TOKENS: &str = "32";

/// The body of `GET path` at `url` (`http://host:port`).
fn http_get(url: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let host = url.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(host).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or(out)
}

/// The instance as `url` lists it.
fn instance(url: &str) -> Option<Value> {
    json(&["ps", "--json", "--url", url])
        .as_array()?
        .iter()
        .find(|i| i["id"] == "qwen05")
        .cloned()
}

/// The answer to `prompt` at `url` (text on stdout; the token count from stderr's
/// statistics line).
fn answer(url: &str, prompt: &str) -> (String, String) {
    let (ok, out, err) = run(&[
        "run", "qwen05", prompt, "--temp", "0", "-n", TOKENS, "--url", url,
    ]);
    assert!(ok, "answer at {url}: {err}");
    (out, generated(&err))
}

/// The answer to `prompt` of local processes split as `inst` is (same tensor-parallel
/// width, same stage layers): what the cluster must reproduce exactly.
fn local_split(model: &Path, inst: &Value, prompt: &str) -> (String, String) {
    let stages: Vec<String> = inst["placement"]
        .as_str()
        .unwrap()
        .split(" -> ")
        .map(|s| {
            let r = s.rsplit('[').next().unwrap().trim_end_matches(']');
            let (a, b) = r.split_once("..").unwrap();
            (b.parse::<usize>().unwrap() - a.parse::<usize>().unwrap()).to_string()
        })
        .collect();
    let (tp, pp) = (inst["tp"].to_string(), inst["pp"].to_string());
    let layers = stages.join(",");
    let (ok, out, err) = run(&[
        "run",
        model.to_str().unwrap(),
        prompt,
        "--temp",
        "0",
        "-n",
        TOKENS,
        "-t",
        "1",
        "--tp",
        &tp,
        "--pp",
        &pp,
        "--stage-layers",
        &layers,
    ]);
    assert!(ok, "local split {tp}x{pp} [{layers}]: {err}");
    (out, generated(&err))
}

/// The cluster's answers match one process (a question without near ties, where a
/// tensor-parallel split's rounding cannot change the greedy choice) and, exactly, the same
/// split run locally.
fn check_answers(model: &Path, inst: &Value, one: &(String, String)) {
    let lead = format!("http://{}", inst["api"].as_str().unwrap());
    assert_eq!(&answer(&lead, QUESTION), one, "{}", inst["placement"]);
    let split = local_split(model, inst, PROMPT);
    assert_eq!(answer(&lead, PROMPT), split, "{}", inst["placement"]);
    eprintln!("{}: {:?}", inst["placement"], split.0);
}

fn generated(stats: &str) -> String {
    stats
        .split("generation: ")
        .nth(1)
        .and_then(|s| s.split(" tokens").next())
        .unwrap_or_else(|| panic!("no generation count in {stats:?}"))
        .to_string()
}

#[test]
fn a_model_split_over_nodes_answers_like_one_and_survives_losing_nodes() {
    let Some(model) = cached_model("qwen05") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("secret");
    let (ok, s, _) = run(&["secret"]);
    assert!(ok);
    std::fs::write(&secret, s).unwrap();

    // one process, for the reference
    let (ok, want, err) = run(&[
        "run",
        model.to_str().unwrap(),
        QUESTION,
        "--temp",
        "0",
        "-n",
        TOKENS,
        "-t",
        "1",
    ]);
    assert!(ok, "{err}");
    let one = (want, generated(&err));
    eprintln!("one process: {one:?}");

    // the model's home holds it; the others are empty
    let home_a = model.parent().unwrap().parent().unwrap().to_path_buf();
    let empty = |n: &str| {
        let p = dir.path().join(format!("home-{n}"));
        std::fs::create_dir_all(&p).unwrap();
        p
    };
    let a = node(dir.path(), "a", &secret, &home_a, None);
    let seed = a.listen.clone();
    let mut nodes = vec![a];
    for n in ["b", "c", "d"] {
        nodes.push(node(dir.path(), n, &secret, &empty(n), Some(&seed)));
    }
    // only one node's view is awaited: the others may still disagree on who is alive, and
    // so on who coordinates, which the load below must ride out
    wait_until(Duration::from_secs(30), "four nodes agree", || {
        let v = json(&["nodes", "--json", "--url", &nodes[3].url]);
        (v.as_array()?.iter().filter(|n| n["alive"] == true).count() == 4).then_some(())
    });

    // load through a node without the model, and wait for it to answer
    let t0 = Instant::now();
    let (ok, out, err) = run(&[
        "load",
        "qwen05",
        "--strategy",
        "auto",
        "--ctx",
        "512",
        "--json",
        "--url",
        &nodes[1].url,
    ]);
    assert!(ok, "load: {err}");
    let inst: Value = serde_json::from_str(&out).unwrap();
    eprintln!("loaded in {:?}: {} {err}", t0.elapsed(), inst["placement"]);
    let used: Vec<String> = inst["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap().to_string())
        .collect();
    assert!(used.len() >= 2, "split over several nodes: {inst}");
    // the nodes without the file fetched only what they needed, checked chunk by chunk
    for n in nodes
        .iter()
        .filter(|n| n.name != "a" && used.contains(&n.name))
    {
        let fetched = std::fs::read_dir(dir.path().join(&n.name).join("models"))
            .unwrap()
            .filter_map(|e| e.ok())
            .any(|e| e.file_name().to_string_lossy().ends_with(".chunks"));
        assert!(fetched, "node {} fetched its slice", n.name);
    }
    check_answers(&model, &inst, &one);
    let lead = inst["api"].as_str().unwrap().to_string();
    // every node's status counts it
    for n in &nodes {
        wait_until(
            Duration::from_secs(10),
            "status counts the instance",
            || {
                (json(&["status", "--json", "--url", &n.url])["instances"]["ready"] == 1)
                    .then_some(())
            },
        );
    }

    // the memory it holds is taken: a second copy goes only to the nodes it left free, and
    // fits nowhere when it left fewer than two (each node offers 800 MB, a copy needs two)
    let (ok, out, err) = run(&[
        "load",
        "qwen05",
        "--id",
        "second",
        "--ctx",
        "512",
        "--json",
        "--url",
        &nodes[0].url,
    ]);
    if used.len() >= nodes.len() - 1 {
        assert!(!ok && err.contains("fits nowhere"), "{err}");
    } else {
        assert!(
            ok,
            "a second copy on the {} free nodes: {err}",
            nodes.len() - used.len()
        );
        let second: Value = serde_json::from_str(&out).unwrap();
        let overlap: Vec<&Value> = second["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|n| used.iter().any(|u| n.as_str() == Some(u.as_str())))
            .collect();
        assert!(
            overlap.is_empty(),
            "the second copy shares {overlap:?}: {second}"
        );
        let (ok, _, err) = run(&["unload", "second", "--url", &nodes[0].url]);
        assert!(ok, "{err}");
        for n in &nodes {
            wait_until(Duration::from_secs(30), "the second copy unloaded", || {
                json(&["ps", "--json", "--url", &n.url])
                    .as_array()?
                    .iter()
                    .all(|i| i["id"] != "second")
                    .then_some(())
            });
        }
    }

    // every node answers for the instance: the others list it and forward to the lead
    for n in nodes.iter().filter(|n| !n.url.ends_with(&lead)) {
        let models = http_get(&n.url, "/v1/models");
        assert!(
            models.contains("\"qwen05\""),
            "{} lists it: {models}",
            n.name
        );
        assert_eq!(&answer(&n.url, QUESTION), &one, "asked at {}", n.name);
    }

    // kill a node of the instance that is neither the coordinator nor the model's holder
    let coordinator = nodes.iter().map(|n| n.id.clone()).min().unwrap();
    let victim = nodes
        .iter()
        .position(|n| used.contains(&n.name) && n.name != "a" && n.id != coordinator)
        .expect("a node to kill");
    let gen = inst["generation"].as_u64().unwrap();
    eprintln!("killing {}", nodes[victim].name);
    nodes.remove(victim);
    let watch = nodes[0].url.clone();
    let (_, replaced_in) = wait_until(Duration::from_secs(30), "re-placed", || {
        let i = instance(&watch)?;
        (i["generation"].as_u64()? > gen).then_some(())
    });
    let (inst, ready_in) = wait_until(Duration::from_secs(300), "ready again", || {
        instance(&watch).filter(|i| i["state"] == "ready")
    });
    eprintln!(
        "re-placed {replaced_in:?} after the kill, ready {ready_in:?} later: {}",
        inst["placement"]
    );
    check_answers(&model, &inst, &one);

    // kill the coordinator
    let coordinator = nodes.iter().map(|n| n.id.clone()).min().unwrap();
    let c = nodes.iter().position(|n| n.id == coordinator).unwrap();
    let gone = nodes[c].name.clone();
    eprintln!("killing the coordinator {gone}");
    nodes.remove(c);
    let watch = nodes[0].url.clone();
    // ready on nodes that are all alive (re-placed if the coordinator was one of them)
    let (inst, t) = wait_until(
        Duration::from_secs(300),
        "ready after the coordinator",
        || {
            instance(&watch).filter(|i| {
                i["state"] == "ready" && !i["nodes"].as_array().unwrap().iter().any(|n| n == &gone)
            })
        },
    );
    eprintln!(
        "after the coordinator died: ready in {t:?}: {}",
        inst["placement"]
    );
    check_answers(&model, &inst, &one);

    // draining a node of the instance when the rest cannot hold it is refused, not a failure
    let (ok, _, err) = run(&["drain", &nodes[1].name, "--url", &nodes[0].url]);
    assert!(!ok && err.contains("not drained"), "{err}");
    assert_eq!(instance(&nodes[0].url).unwrap()["state"], "ready");

    // unload: gone from every survivor's table
    let (ok, _, err) = run(&["unload", "qwen05", "--url", &nodes[0].url]);
    assert!(ok, "{err}");
    for n in &nodes {
        wait_until(Duration::from_secs(30), "unloaded", || {
            instance(&n.url).is_none().then_some(())
        });
    }
}
