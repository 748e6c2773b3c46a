//! A mixture of experts placed by expert across two `shoal serve` processes on loopback,
//! each offering less memory than the model needs and only one holding the file: the test
//! kit's Qwen3 MoE shape with 3 layers of 128 experts of 1024 features (F32, about 300 MB,
//! so the file spans many 4 MiB fetch chunks) is loaded with whole experts on each node; the
//! node without the file fetches only the chunks its rank reads (its half of every expert
//! tensor, and everything else), and the cluster's greedy answer equals one process's. The
//! same again with the model as a split set of three files (llama.cpp's `gguf-split`
//! layout): `shoal run` on any part answers as the single file does, and the node without
//! it fetches its share across the three files into a sparse set of its own.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use shoal_testkit::{GgmlType, MoeSpec, TinyModelSpec};

const PROMPT: &str = "the cat sat on the mat";
const TOKENS: &str = "12";

/// What each node offers: a copy of the model (300 MB of weights, plus the 512 MiB a rank
/// is planned to need beyond weights) does not fit, half of it does.
const MAX_MEMORY: &str = "704M";

fn shoal() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_shoal"));
    c.env_remove("SHOAL_API_KEY").env_remove("SHOAL_URL");
    c
}

struct Node {
    child: Child,
    url: String,
    listen: String,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn node(dir: &Path, name: &str, secret: &Path, peer: Option<&str>) -> Node {
    let home = dir.join(format!("home-{name}"));
    std::fs::create_dir_all(&home).unwrap();
    let mut cmd = shoal();
    cmd.arg("serve")
        .args(["--api", "127.0.0.1:0", "--listen", "127.0.0.1:0", "-t", "1"])
        .args(["--name", name, "--no-mdns", "--max-memory", MAX_MEMORY])
        .arg("--secret-file")
        .arg(secret)
        .arg("--data-dir")
        .arg(dir.join(name))
        .env("SHOAL_HOME", &home)
        .env_remove("SHOAL_SECRET")
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(
            std::fs::File::create(dir.join(format!("{name}.log")))
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
        url: format!("http://{}", ready["api"].as_str().unwrap()),
        listen: ready["listen"].as_str().unwrap().to_string(),
    }
}

fn run(args: &[&str]) -> (bool, String, String) {
    let out = shoal().args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn wait_until<T>(limit: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let t0 = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(t0.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn experts_placed_across_nodes_fetch_only_their_bytes_and_answer_like_one_process() {
    placed_by_expert(None);
}

#[test]
fn a_split_set_is_placed_fetched_and_answered_as_one_file() {
    placed_by_expert(Some(3));
}

/// The test of the module: the model as one file, or as a set of `parts` files.
fn placed_by_expert(parts: Option<usize>) {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinyModelSpec {
        n_layers: 3,
        moe: TinyModelSpec::qwen3moe(91).moe.map(|m| MoeSpec {
            n_expert: 128,
            n_expert_used: 4,
            expert_ffn: 1024,
            ..m
        }),
        ..TinyModelSpec::qwen3moe(91)
    };
    let single = dir.path().join("moe.gguf");
    let built = spec.build().unwrap();
    built.write_gguf(&single, GgmlType::F32).unwrap();
    // one process on the single file, for the reference
    let (ok, want, err) = run(&[
        "run",
        single.to_str().unwrap(),
        PROMPT,
        "--temp",
        "0",
        "-n",
        TOKENS,
        "-t",
        "1",
    ]);
    assert!(ok, "{err}");
    let (path, size) = match parts {
        None => {
            let size = std::fs::metadata(&single).unwrap().len();
            (single, size)
        }
        Some(n) => {
            let set_dir = dir.path().join("set");
            std::fs::create_dir_all(&set_dir).unwrap();
            let paths = built
                .gguf_writer(GgmlType::F32)
                .unwrap()
                .write_split(&set_dir, "moe", n)
                .unwrap();
            std::fs::remove_file(&single).unwrap();
            let size = paths
                .iter()
                .map(|p| std::fs::metadata(p).unwrap().len())
                .sum();
            // any part names the set
            let (ok, got, err) = run(&[
                "run",
                paths[n - 1].to_str().unwrap(),
                PROMPT,
                "--temp",
                "0",
                "-n",
                TOKENS,
                "-t",
                "1",
            ]);
            assert!(ok, "{err}");
            assert_eq!(got, want, "the set answers as the single file");
            (paths[0].clone(), size)
        }
    };
    let model = path.to_str().unwrap();
    let secret = dir.path().join("secret");
    let (ok, s, _) = run(&["secret"]);
    assert!(ok);
    std::fs::write(&secret, s).unwrap();
    let a = node(dir.path(), "a", &secret, None);
    let b = node(dir.path(), "b", &secret, Some(&a.listen));
    wait_until(Duration::from_secs(30), "two nodes agree", || {
        let (ok, out, _) = run(&["nodes", "--json", "--url", &b.url]);
        let v: Value = serde_json::from_str(&out).ok()?;
        (ok && v.as_array()?.iter().filter(|n| n["alive"] == true).count() == 2).then_some(())
    });

    // the file is a path on node a; b has nothing
    let (ok, out, err) = run(&[
        "load",
        model,
        "--strategy",
        "tensor",
        "--expert-split",
        "whole",
        "--ctx",
        "256",
        "--json",
        "--url",
        &a.url,
    ]);
    assert!(ok, "load: {err}");
    let inst: Value = serde_json::from_str(&out).unwrap();
    eprintln!(
        "placed: {} ({} experts)",
        inst["placement"], inst["experts"]
    );
    assert_eq!(inst["tp"], 2, "{inst}");
    assert_eq!(inst["experts"], "whole", "{inst}");

    // b fetched a strict subset of the file's chunks
    let models = dir.path().join("b").join("models");
    let chunks_file = std::fs::read_dir(&models)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "chunks"))
        .expect("node b fetched chunks");
    let fetched: Vec<u64> =
        serde_json::from_str(&std::fs::read_to_string(&chunks_file).unwrap()).unwrap();
    let total = size.div_ceil(4 << 20);
    let sha = chunks_file
        .file_stem()
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    let sparse: Vec<std::path::PathBuf> = match parts {
        None => vec![chunks_file.with_extension("gguf")],
        Some(n) => (1..=n)
            .map(|i| models.join(format!("{sha}-{i:05}-of-{n:05}.gguf")))
            .collect(),
    };
    let allocated: u64 = sparse
        .iter()
        .map(|p| {
            use std::os::unix::fs::MetadataExt;
            std::fs::metadata(p)
                .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
                .blocks()
                * 512
        })
        .sum();
    eprintln!(
        "node b fetched {} of {total} chunks; its sparse copy takes {allocated} of {size} bytes",
        fetched.len()
    );
    assert!(
        (fetched.len() as u64) < total * 3 / 4,
        "node b fetched {} of {total} chunks",
        fetched.len()
    );
    assert!(
        allocated < size * 3 / 4,
        "{allocated} of {size} bytes on disk"
    );

    // the cluster answers as one process
    let lead = format!("http://{}", inst["api"].as_str().unwrap());
    let (ok, got, err) = run(&[
        "run", "moe", PROMPT, "--temp", "0", "-n", TOKENS, "--url", &lead,
    ]);
    assert!(ok, "{err}");
    assert_eq!(got, want);
}
