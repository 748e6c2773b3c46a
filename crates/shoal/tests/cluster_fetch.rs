//! A slice fetch that meets bad data. Nodes `a` and `b` hold qwen05 (`b` a copy of `a`'s
//! file in its own model cache), `c` holds nothing; qwen05 is placed tensor-parallel on `a`
//! and `c`, so `c` fetches its share from `a` and `b` in turn. Each phase has a fresh `c`
//! (`c1`, `c2`, `c3`): one that fetched every chunk would offer the file itself.
//!
//! 1. Both copies good: the instance answers as the same split run in one process.
//! 2. `b`'s copy is corrupted on disk after it sent its manifest (one byte in every chunk
//!    past the header): each chunk `b` sends fails its check at `c`, is fetched from `a`
//!    instead, and `b` is asked for no more. The instance answers as before.
//! 3. `b` is replaced by `d`, a node started on that corrupted copy (its cache's checksum
//!    record says nothing changed, so `d` offers it): asked for its manifest, `d` finds the
//!    copy no longer matches the model's SHA-256, says so and stops offering it; `c` fetches
//!    everything from `a`, and the answer is the same.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{cached_model, json_of, node, node_log, run, wait_until, Node};

const PROMPT: &str = "Write one sentence about the sea.";

/// Bytes per fetched chunk (the driver's).
const CHUNK: u64 = 4 << 20;

/// The answer to `PROMPT` at `url`, greedy, 24 tokens.
fn answer(url: &str, model: &str) -> String {
    let (ok, out, err) = run(&[
        "run", model, PROMPT, "--temp", "0", "-n", "24", "-t", "1", "--url", url,
    ]);
    assert!(ok, "answer at {url}: {err}");
    out
}

/// Loads qwen05 on `a` and `fetcher` and waits until it is ready; returns its lead's URL.
/// A node that joined moments ago may not be in the planner's view yet: asked again then.
fn load(nodes: &[Node], fetcher: &str) -> String {
    let subset = format!("a,{fetcher}");
    let args = [
        "load",
        "qwen05",
        "--strategy",
        "tensor",
        "--nodes",
        &subset,
        "--ctx",
        "512",
        "--json",
        "--url",
        &nodes[0].url,
    ];
    let out = wait_until(Duration::from_secs(30), "the load is accepted", || {
        let (ok, out, err) = run(&args);
        assert!(ok || err.contains("unknown node"), "load: {err}");
        ok.then_some(out)
    });
    let inst: serde_json::Value = serde_json::from_str(&out).unwrap();
    format!("http://{}", inst["api"].as_str().unwrap())
}

fn unload(nodes: &[Node]) {
    let (ok, _, err) = run(&["unload", "qwen05", "--url", &nodes[0].url]);
    assert!(ok, "unload: {err}");
    wait_until(Duration::from_secs(30), "unloaded", || {
        let ps = json_of(&["ps", "--json", "--url", &nodes[0].url]);
        ps.as_array()?.is_empty().then_some(())
    });
}

/// Flips one byte in every chunk of `path` past its header (the tensors' data; the file
/// still opens) and gives it `like`'s modification time (what it had), so the model cache's
/// checksum record still vouches for it.
fn corrupt(path: &Path, like: &Path) {
    use std::os::unix::fs::FileExt;
    let header_end = shoal_model::gguf::GgufFile::open(path)
        .unwrap()
        .header_ranges()[0]
        .end;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let size = f.metadata().unwrap().len();
    let mut chunk = header_end.div_ceil(CHUNK);
    while chunk * CHUNK + 12_345 < size {
        let at = chunk * CHUNK + 12_345;
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, at).unwrap();
        f.write_all_at(&[b[0] ^ 0x5a], at).unwrap();
        chunk += 1;
    }
    f.sync_all().unwrap();
    drop(f);
    let ok = Command::new("touch")
        .arg("-r")
        .arg(like)
        .arg(path)
        .status()
        .unwrap()
        .success();
    assert!(ok, "touch -r");
}

#[test]
fn bad_chunks_are_fetched_from_another_node_and_a_bad_copy_stops_being_offered() {
    let Some(model) = cached_model("qwen05") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let secret = common::secret(dir.path());
    let home = model.parent().unwrap().parent().unwrap().to_path_buf();
    // b's cache: a copy of the model and its checksum record, same modification times
    let home_b = dir.path().join("home-b");
    let rel = model.strip_prefix(&home).unwrap();
    let copy = home_b.join(rel);
    std::fs::create_dir_all(copy.parent().unwrap()).unwrap();
    let record = model.with_extension("gguf.sha256");
    for (from, to) in [
        (&model, &copy),
        (&record, &copy.with_extension("gguf.sha256")),
    ] {
        let ok = Command::new("cp")
            .arg("-p")
            .arg(from)
            .arg(to)
            .status()
            .unwrap()
            .success();
        assert!(ok, "cp -p {}", from.display());
    }
    let empty = dir.path().join("empty-home");
    std::fs::create_dir_all(&empty).unwrap();
    let a = node(dir.path(), "a", &secret, &home, None, &[]);
    let seed = a.listen.clone();
    let b = node(dir.path(), "b", &secret, &home_b, Some(&seed), &[]);
    let c = node(dir.path(), "c1", &secret, &empty, Some(&seed), &[]);
    let mut nodes = vec![a, b, c];
    // each phase fetches on a fresh node (one that fetched every chunk offers the file)
    let fresh_fetcher = |nodes: &mut Vec<Node>, name: &str| {
        nodes.truncate(2);
        nodes.push(node(dir.path(), name, &secret, &empty, Some(&seed), &[]));
        common::agree(nodes);
    };
    common::agree(&nodes);
    let b_id = nodes[1].id.clone();

    // the same split in one process: what the cluster must answer
    let (ok, want, err) = run(&[
        "run",
        model.to_str().unwrap(),
        PROMPT,
        "--temp",
        "0",
        "-n",
        "24",
        "-t",
        "1",
        "--tp",
        "2",
    ]);
    assert!(ok, "local split: {err}");

    // 1: both copies good
    let lead = load(&nodes, "c1");
    assert_eq!(answer(&lead, "qwen05"), want, "both sources good");
    unload(&nodes);
    assert!(
        !node_log(dir.path(), "c1").contains("failed its sha256 check"),
        "no chunk failed while both copies were good"
    );

    // 2: b's copy goes bad after its manifest was sent
    corrupt(&copy, &model);
    fresh_fetcher(&mut nodes, "c2");
    let lead = load(&nodes, "c2");
    assert_eq!(answer(&lead, "qwen05"), want, "b's chunks fetched from a");
    unload(&nodes);
    let c_log = node_log(dir.path(), "c2");
    let failed = c_log
        .lines()
        .find(|l| l.contains("failed its sha256 check"))
        .unwrap_or_else(|| panic!("c's log names no failed chunk:\n{c_log}"));
    eprintln!("c: {failed}");
    assert!(
        failed.contains(&format!("from node {b_id}"))
            && failed.contains("fetching it and the rest from"),
        "{failed}"
    );

    // 3: d starts on b's bad copy; asked for a manifest, it stops offering the model
    nodes.truncate(1);
    nodes.push(node(dir.path(), "d", &secret, &home_b, Some(&seed), &[]));
    fresh_fetcher(&mut nodes, "c3");
    // whether the node at `url` knows d offers qwen05
    let offered_by_d =
        |url: &str| {
            let models: serde_json::Value = ureq::get(&format!("{url}/cluster/models"))
                .call()
                .unwrap()
                .body_mut()
                .read_json()
                .unwrap();
            models["models"].as_array().unwrap().iter().any(|m| {
                m["name"] == "qwen05" && m["nodes"].as_array().unwrap().contains(&"d".into())
            })
        };
    // d offers its copy until someone checks it, and the fetcher knows it
    let t0 = std::time::Instant::now();
    while !offered_by_d(&nodes[2].url) {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "c3 never saw d's offer; d's log:\n{}",
            node_log(dir.path(), "d")
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let lead = load(&nodes, "c3");
    assert_eq!(answer(&lead, "qwen05"), want, "everything fetched from a");
    let d_log = node_log(dir.path(), "d");
    let refused = d_log
        .lines()
        .find(|l| l.contains("no longer matches its sha256"))
        .unwrap_or_else(|| panic!("d's log does not say its copy is bad:\n{d_log}"));
    eprintln!("d: {refused}");
    let c_log = node_log(dir.path(), "c3");
    let left_out = c_log
        .lines()
        .find(|l| l.contains("left out") && l.contains("no longer matches its sha256"))
        .unwrap_or_else(|| panic!("c3's log does not say why d was left out:\n{c_log}"));
    eprintln!("c: {left_out}");
    wait_until(Duration::from_secs(10), "d no longer offers qwen05", || {
        (!offered_by_d(&nodes[0].url)).then_some(())
    });
}
