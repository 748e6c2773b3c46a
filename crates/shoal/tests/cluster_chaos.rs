//! Chaos: four `shoal serve` processes on loopback serve two instances, qwen05 split
//! tensor-parallel and smollm2 split in pipeline stages; eight clients stream greedy
//! answers through random nodes while a random node (lead, non-lead or coordinator alike)
//! is killed every 45-90 s and started again 20 s later under its name and data directory.
//! Every stream is counted: finished with the uninterrupted run's text, finished with
//! another (a tensor split of another width rounds differently), or lost; a stream may be
//! lost only when its own entry node was the one killed. It also reports the longest gap
//! between two pieces of a stream and every node's resident memory over time.
//!
//! `SHOAL_CHAOS_SECONDS` (default 120, what CI runs) sets how long the clients run;
//! `bench/chaos.sh MINUTES` runs it longer.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{cached_model, node_with, run, Node};
use rand::Rng;

const CLIENTS: usize = 8;
/// Tokens each stream generates.
const TOKENS: usize = 64;
const MODELS: [&str; 2] = ["qwen05", "smollm2"];
const PROMPTS: [&str; 4] = [
    "Tell me a story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "Describe a walk through a busy market.",
    "Write a letter to a friend about the mountains.",
];

/// How one stream ended.
#[derive(Debug)]
enum Outcome {
    Same,
    Other,
    /// Refused before it started, with a status that says to retry (503 while an instance is
    /// placed again, 502 while its dead lead is not yet known to be dead): no work lost.
    Refused,
    /// Lost, and whether its entry node was killed while it ran.
    Lost(String, bool),
}

/// A greedy stream of `prompt` on `model` through `url`, [`TOKENS`] long.
fn stream(url: &str, model: &str, prompt: &str) -> Result<(String, Duration), String> {
    common::greedy_stream(url, model, prompt, TOKENS)
}

/// Resident memory of process `pid`, MB.
fn rss_mb(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 = s
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb / 1024)
}

/// The cluster's nodes by name, and when each was last killed.
struct Cluster {
    nodes: BTreeMap<String, Node>,
    killed: BTreeMap<String, Vec<Instant>>,
}

#[test]
fn streams_survive_random_kills() {
    let (Some(qwen), Some(_)) = (cached_model("qwen05"), cached_model("smollm2")) else {
        return;
    };
    let seconds: u64 = std::env::var("SHOAL_CHAOS_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(120);
    let dir = tempfile::tempdir().unwrap();
    let secret = common::secret(dir.path());
    let home = qwen.parent().unwrap().parent().unwrap().to_path_buf();
    let extra = ["--no-mdns", "--parallel", "8"];
    let start =
        |name: &str, seed: Option<&str>| node_with(dir.path(), name, &secret, &home, seed, &extra);
    let a = start("a", None);
    let seed = a.listen.clone();
    let mut nodes = vec![a];
    for n in ["b", "c", "d"] {
        nodes.push(start(n, Some(&seed)));
    }
    common::agree(&nodes);
    for (model, strategy, on) in [("qwen05", "tensor", "a,b"), ("smollm2", "pipeline", "c,d")] {
        let (ok, _, err) = run(&[
            "load",
            model,
            "--strategy",
            strategy,
            "--nodes",
            on,
            "--ctx",
            "512",
            "--url",
            &nodes[0].url,
        ]);
        assert!(ok, "load {model}: {err}");
    }
    let want: BTreeMap<(usize, usize), String> = (0..MODELS.len())
        .flat_map(|m| (0..PROMPTS.len()).map(move |p| (m, p)))
        .map(|(m, p)| {
            // the entry node answers 503 until the instance table it replicates names the
            // lead
            let t = Instant::now();
            loop {
                match stream(&nodes[0].url, MODELS[m], PROMPTS[p]) {
                    Ok((text, _)) => break ((m, p), text),
                    Err(e) if e.starts_with("retry:") && t.elapsed() < Duration::from_secs(60) => {
                        std::thread::sleep(Duration::from_millis(200))
                    }
                    Err(e) => panic!("uninterrupted {}: {e}", MODELS[m]),
                }
            }
        })
        .collect();
    let cluster = Arc::new(Mutex::new(Cluster {
        nodes: nodes.into_iter().map(|n| (n.name.clone(), n)).collect(),
        killed: BTreeMap::new(),
    }));
    let running = Arc::new(AtomicBool::new(true));
    let outcomes = Arc::new(Mutex::new(Vec::<(Outcome, Duration)>::new()));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|i| {
            let (cluster, running, outcomes, want) = (
                cluster.clone(),
                running.clone(),
                outcomes.clone(),
                want.clone(),
            );
            std::thread::spawn(move || {
                let mut rng = rand::rng();
                while running.load(Ordering::Relaxed) {
                    let (m, p) = (i % MODELS.len(), (i / MODELS.len()) % PROMPTS.len());
                    let (name, url) = {
                        let c = cluster.lock().unwrap();
                        let names: Vec<&String> = c.nodes.keys().collect();
                        let name = names[rng.random_range(0..names.len())].clone();
                        let url = c.nodes[&name].url.clone();
                        (name, url)
                    };
                    let began = Instant::now();
                    let outcome = match stream(&url, MODELS[m], PROMPTS[p]) {
                        Ok((text, gap)) if text == want[&(m, p)] => (Outcome::Same, gap),
                        Ok((_, gap)) => (Outcome::Other, gap),
                        Err(e) if e.starts_with("retry:") => (Outcome::Refused, Duration::ZERO),
                        Err(e) => {
                            let c = cluster.lock().unwrap();
                            let entry_killed = c
                                .killed
                                .get(&name)
                                .is_some_and(|t| t.iter().any(|&k| k >= began));
                            (
                                Outcome::Lost(format!("via {name}: {e}"), entry_killed),
                                Duration::ZERO,
                            )
                        }
                    };
                    let lost = matches!(outcome.0, Outcome::Lost(..) | Outcome::Refused);
                    outcomes.lock().unwrap().push(outcome);
                    if lost {
                        // as a real client would, before it asks again
                        std::thread::sleep(Duration::from_millis(500));
                    }
                }
            })
        })
        .collect();
    // the killer, and the memory of every node every 5 s
    let t0 = Instant::now();
    let mut rng = rand::rng();
    let mut memory: BTreeMap<String, Vec<(u64, u64)>> = BTreeMap::new();
    let mut next_kill = t0 + Duration::from_secs(rng.random_range(45..=90));
    let mut restart: Option<(String, Instant)> = None;
    let mut sampled = t0;
    while t0.elapsed() < Duration::from_secs(seconds) {
        std::thread::sleep(Duration::from_millis(200));
        let now = Instant::now();
        if now >= sampled {
            sampled = now + Duration::from_secs(5);
            let c = cluster.lock().unwrap();
            for (name, n) in &c.nodes {
                if let Some(mb) = rss_mb(n.child.id()) {
                    memory
                        .entry(name.clone())
                        .or_default()
                        .push((t0.elapsed().as_secs(), mb));
                }
            }
        }
        if restart.is_none() && now >= next_kill {
            let mut c = cluster.lock().unwrap();
            let names: Vec<String> = c.nodes.keys().cloned().collect();
            let victim = names[rng.random_range(0..names.len())].clone();
            eprintln!("{:>4} s: killing {victim}", t0.elapsed().as_secs());
            c.killed.entry(victim.clone()).or_default().push(now);
            drop(c.nodes.remove(&victim));
            restart = Some((victim, now + Duration::from_secs(20)));
        }
        if let Some((name, at)) = restart.clone() {
            if now >= at {
                let seed = cluster
                    .lock()
                    .unwrap()
                    .nodes
                    .values()
                    .next()
                    .map(|n| n.listen.clone());
                let n = start(&name, seed.as_deref());
                eprintln!("{:>4} s: {name} started again", t0.elapsed().as_secs());
                cluster.lock().unwrap().nodes.insert(name, n);
                restart = None;
                next_kill = Instant::now() + Duration::from_secs(rng.random_range(25..=70));
            }
        }
    }
    running.store(false, Ordering::Relaxed);
    for c in clients {
        c.join().unwrap();
    }
    let outcomes = outcomes.lock().unwrap();
    let count = |f: fn(&Outcome) -> bool| outcomes.iter().filter(|(o, _)| f(o)).count();
    let longest = outcomes.iter().map(|(_, g)| *g).max().unwrap_or_default();
    eprintln!(
        "chaos {seconds} s: {} streams, {} same text, {} other text, {} refused before they \
         started (retry), {} lost with their entry node, {} lost otherwise; longest gap {} ms",
        outcomes.len(),
        count(|o| matches!(o, Outcome::Same)),
        count(|o| matches!(o, Outcome::Other)),
        count(|o| matches!(o, Outcome::Refused)),
        count(|o| matches!(o, Outcome::Lost(_, true))),
        count(|o| matches!(o, Outcome::Lost(_, false))),
        longest.as_millis()
    );
    for (name, samples) in &memory {
        let line: Vec<String> = samples.iter().map(|(t, mb)| format!("{t}s:{mb}")).collect();
        eprintln!("memory (MB) {name}: {}", line.join(" "));
    }
    let lost: Vec<&String> = outcomes
        .iter()
        .filter_map(|(o, _)| match o {
            Outcome::Lost(why, false) => Some(why),
            _ => None,
        })
        .collect();
    assert!(
        lost.is_empty(),
        "streams lost whose entry node lived: {lost:#?}"
    );
    assert!(
        count(|o| matches!(o, Outcome::Same)) > 0,
        "no stream finished"
    );
}
