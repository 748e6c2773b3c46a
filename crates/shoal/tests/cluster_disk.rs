//! A slice fetch that would not fit on the node's disk fails before it starts: node `a` has
//! qwen05, node `b` does not and keeps its data on a 48 MiB filesystem (a tmpfs, mounted by
//! the test: it needs root, and where it cannot mount it says so and passes). Placing qwen05
//! over both makes `b` fetch its share (some hundreds of MB); the instance fails with a
//! reason naming what the fetch needs and what is free, and nothing but the files' headers
//! was written.

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
