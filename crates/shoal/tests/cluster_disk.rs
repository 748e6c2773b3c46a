//! A node without disk room for its share. Node `a` has qwen05, node `b` does not and keeps
//! its data on a small filesystem (a tmpfs, mounted by the test: it needs root, and where it
//! cannot mount it says so and passes).
//!
//! - On 48 MiB the fetch would not fit and fails before it starts: placing qwen05 over `a`
//!   and `b` (and nowhere else fits it) fails with a reason naming what the fetch needs and
//!   what is free, and nothing but the files' headers was written.
//! - On 640 MiB the fetch starts, and something else fills the disk while it runs: `b`
//!   reports it, and the coordinator places the instance without `b`, on `a` and a third
//!   node `c`, where it serves.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{cached_model, json_of, node_with, run, wait_until};

/// A tmpfs of `size` at `dir`, unmounted when dropped.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(dir: &std::path::Path, size: &str) -> Result<Self, String> {
        std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
        }
        Ok(Tmpfs(dir.to_path_buf()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[test]
fn a_fetch_that_would_not_fit_on_disk_fails_before_it_starts() {
    let Some(model) = cached_model("qwen05") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let _disk = match Tmpfs::mount(&dir.path().join("b"), "48m") {
        Ok(t) => t,
        Err(e) => {
            eprintln!("skipping: cannot mount a small filesystem here ({e}); needs root");
            return;
        }
    };
    let secret = common::secret(dir.path());
    let home = model.parent().unwrap().parent().unwrap().to_path_buf();
    let empty = dir.path().join("empty-home");
    std::fs::create_dir_all(&empty).unwrap();
    let a = node_with(dir.path(), "a", &secret, &home, None, &["--no-mdns"]);
    let seed = a.listen.clone();
    let nodes = vec![
        a,
        node_with(
            dir.path(),
            "b",
            &secret,
            &empty,
            Some(&seed),
            &["--no-mdns"],
        ),
    ];
    common::agree(&nodes);
    let (_, _, err) = run(&[
        "load",
        "qwen05",
        "--strategy",
        "tensor",
        "--nodes",
        "a,b",
        "--ctx",
        "1024",
        "--url",
        &nodes[0].url,
    ]);
    eprintln!("shoal load: {err}");
    let inst = wait_until(Duration::from_secs(120), "the instance fails", || {
        let ps = json_of(&["ps", "--json", "--url", &nodes[0].url]);
        ps.as_array()?
            .iter()
            .find(|i| i["id"] == "qwen05" && i["state"] == "failed")
            .cloned()
    });
    let reason = inst["reason"].as_str().unwrap_or_default().to_string();
    eprintln!("failed: {reason}");
    assert!(
        reason.contains("GB more on the disk of")
            && reason.contains("GB is free there")
            && reason.contains("--data-dir"),
        "{inst}"
    );
    // only the headers' chunks were written
    let models = dir.path().join("b").join("models");
    let written: u64 = std::fs::read_dir(&models)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| e.metadata().ok())
                .map(|m| {
                    use std::os::unix::fs::MetadataExt;
                    m.blocks() * 512
                })
                .sum()
        })
        .unwrap_or(0);
    assert!(written <= 16 << 20, "{written} bytes written on b's disk");
}

/// Fills the filesystem holding `dir` with a file there, until it is full.
fn fill(dir: &std::path::Path) -> u64 {
    use std::io::Write;
    let mut f = std::fs::File::create(dir.join("filler")).unwrap();
    let block = vec![0u8; 1 << 20];
    let mut written = 0;
    while f.write_all(&block).is_ok() {
        written += block.len() as u64;
    }
    written
}

#[test]
fn a_node_whose_disk_fills_mid_fetch_is_left_out_and_the_instance_placed_elsewhere() {
    let Some(model) = cached_model("qwen05") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    // room for b's share and the margin, so the fetch starts
    let disk = dir.path().join("b");
    let _disk = match Tmpfs::mount(&disk, "640m") {
        Ok(t) => t,
        Err(e) => {
            eprintln!("skipping: cannot mount a small filesystem here ({e}); needs root");
            return;
        }
    };
    let secret = common::secret(dir.path());
    let home = model.parent().unwrap().parent().unwrap().to_path_buf();
    let empty = dir.path().join("empty-home");
    std::fs::create_dir_all(&empty).unwrap();
    let a = node_with(dir.path(), "a", &secret, &home, None, &["--no-mdns"]);
    let seed = a.listen.clone();
    let mut nodes = vec![a];
    for n in ["b", "c"] {
        nodes.push(node_with(
            dir.path(),
            n,
            &secret,
            &empty,
            Some(&seed),
            &["--no-mdns"],
        ));
    }
    common::agree(&nodes);
    // once b has fetched some of its slice, something else fills its disk
    let filler = {
        let models = disk.join("models");
        std::thread::spawn(move || {
            let t0 = std::time::Instant::now();
            while t0.elapsed() < Duration::from_secs(120) {
                let done = std::fs::read_dir(&models)
                    .into_iter()
                    .flatten()
                    .filter_map(|e| e.ok())
                    .filter(|e| e.path().extension().is_some_and(|x| x == "chunks"))
                    .filter_map(|e| std::fs::read_to_string(e.path()).ok())
                    .map(|t| t.matches(',').count())
                    .max()
                    .unwrap_or(0);
                if done >= 16 {
                    return Some((done, fill(models.parent().unwrap())));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            None
        })
    };
    let (ok, _, err) = run(&[
        "load",
        "qwen05",
        "--strategy",
        "tensor",
        "--nodes",
        "a,b",
        "--ctx",
        "1024",
        "--url",
        &nodes[0].url,
    ]);
    eprintln!("shoal load: ok {ok}: {err}");
    let filled = filler.join().unwrap();
    eprintln!("b's disk filled after {filled:?} (chunks done, bytes written)");
    assert!(filled.is_some(), "b's fetch never got under way");
    let inst = wait_until(Duration::from_secs(120), "the instance is ready", || {
        let ps = json_of(&["ps", "--json", "--url", &nodes[0].url]);
        let i = ps.as_array()?.iter().find(|i| i["id"] == "qwen05")?.clone();
        assert_ne!(i["state"], "failed", "{i}");
        (i["state"] == "ready").then_some(i)
    });
    let history = inst["history"].to_string();
    eprintln!("placed on {}: {history}", inst["placement"]);
    // b's place goes to c (which rank leads follows the planner's order of the node ids)
    let mut placed: Vec<&str> = inst["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|n| n.as_str())
        .collect();
    placed.sort_unstable();
    assert_eq!(placed, ["a", "c"], "{inst}");
    assert!(
        history.contains("filled up while fetching the model") && history.contains("without"),
        "{history}"
    );
    let (ok, out, err) = run(&[
        "run",
        "qwen05",
        "Say hi.",
        "--temp",
        "0",
        "-n",
        "8",
        "--url",
        &nodes[0].url,
    ]);
    assert!(ok && !out.trim().is_empty(), "{err}");
}
