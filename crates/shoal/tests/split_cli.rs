//! `shoal run --tp/--pp` end to end: real processes over loopback TCP and shared memory,
//! on a tiny model the test kit writes as GGUF. A split answers exactly what one process
//! answers (plain, and speculating with prompt lookup, a draft model or a GLM's own
//! prediction layer), and when a rank dies or hangs the others stop with an error naming it within
//! the communication deadline instead of hanging.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use shoal_testkit::{GgmlType, TinyModelSpec};

fn shoal() -> Command {
    Command::new(env!("CARGO_BIN_EXE_shoal"))
}

/// A tiny Llama with a long context, so generation can run long enough to be interrupted,
/// and heads of one Q8_0 block each, so it splits up to 4 ways.
fn tiny_model(dir: &Path) -> PathBuf {
    let m = TinyModelSpec {
        n_layers: 4,
        head_dim: 32,
        context_length: 32768,
        ..TinyModelSpec::llama(21)
    }
    .build()
    .unwrap();
    let p = dir.join("tiny.gguf");
    m.write_gguf(&p, GgmlType::Q8_0).unwrap();
    p
}

fn answer(model: &Path, extra: &[&str]) -> String {
    let out = shoal()
        .arg("run")
        .arg(model)
        .args(["hello world", "--raw", "--temp", "0", "-n", "40", "-t", "1"])
        .args(extra)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "shoal run {extra:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn split_runs_answer_like_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let one = answer(&model, &[]);
    assert!(!one.is_empty());
    for extra in [
        &["--tp", "2"][..],
        &["--pp", "2"],
        &["--tp", "2", "--pp", "2"],
        &["--tp", "3", "--transport", "shm"],
        &["--tp", "2", "--link-latency-us", "200", "--link-gbps", "1"],
        &["--tp", "2", "--lookup", "4", "--fixed-drafts"],
        &["--pp", "2", "--lookup"],
    ] {
        assert_eq!(answer(&model, extra), one, "shoal run {extra:?}");
    }
    // a draft model (here the model itself) runs beside rank 0
    let m = model.to_str().unwrap();
    for extra in [
        &["--pp", "2", "--draft", m][..],
        &[
            "--tp",
            "2",
            "--draft",
            m,
            "--draft-max",
            "3",
            "--fixed-drafts",
        ],
    ] {
        assert_eq!(answer(&model, extra), one, "shoal run {extra:?}");
    }
}

/// `--mtp`: a GLM's own prediction layer drafts for `shoal run` on one process and on
/// splits (the lead holding the layer), and the answer is unchanged; a model without the
/// layer is refused saying what to use instead, split or not.
#[test]
fn the_prediction_layer_drafts_without_changing_the_answer() {
    let dir = tempfile::tempdir().unwrap();
    let glm = dir.path().join("tiny-glm.gguf");
    // experts of two 32-blocks, so that two tensor-parallel ranks can cut them
    let spec = TinyModelSpec::glm4moe(5);
    TinyModelSpec {
        moe: spec.moe.clone().map(|m| shoal_testkit::MoeSpec {
            expert_ffn: 64,
            ..m
        }),
        ..spec
    }
    .build()
    .unwrap()
    .write_gguf(&glm, GgmlType::Q8_0)
    .unwrap();
    let one = answer(&glm, &[]);
    assert!(!one.is_empty());
    assert_eq!(answer(&glm, &["--mtp"]), one, "shoal run --mtp");
    let out = shoal()
        .arg("run")
        .arg(&glm)
        .args(["hello world", "--raw", "--temp", "0", "-n", "40", "-t", "1"])
        .args(["--mtp", "--draft-max", "3", "--fixed-drafts"])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8(out.stdout).unwrap(), one);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains("drafted tokens accepted"), "{log}");
    for extra in [
        &["--tp", "2", "--mtp", "--fixed-drafts"][..],
        &["--pp", "2", "--mtp", "--draft-max", "3", "--fixed-drafts"],
        &["--tp", "2", "--pp", "2", "--mtp"],
    ] {
        assert_eq!(answer(&glm, extra), one, "shoal run {extra:?}");
    }
    let tiny = tiny_model(dir.path());
    for (model, extra, want) in [
        (&tiny, &["--mtp"][..], "no multi-token-prediction layer"),
        (
            &tiny,
            &["--tp", "2", "--mtp"],
            "no multi-token-prediction layer",
        ),
    ] {
        let out = shoal()
            .arg("run")
            .arg(model)
            .args(["hello", "-n", "4", "-t", "1"])
            .args(extra)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(want),
            "{extra:?}: {err}"
        );
    }
}

/// Ranks on different devices (`--device gpu,cpu`, rank 0 first): a tensor-parallel pair of
/// a GPU rank and a CPU rank, and a pipeline whose first layers are on the GPU, answer what
/// one CPU process answers. F32 weights: neither backend rounds the activations, so the
/// two agree to f32 rounding. A list that is neither one device nor one per rank is refused.
#[test]
fn ranks_on_a_gpu_and_the_cpu_answer_like_one_process() {
    if shoal_engine::device::gpus().is_empty() {
        assert!(
            std::env::var("SHOAL_REQUIRE_GPU").as_deref() != Ok("1"),
            "no GPU adapter, and SHOAL_REQUIRE_GPU=1"
        );
        shoal_testkit::skip_or_fail(
            "ranks_on_a_gpu_and_the_cpu_answer_like_one_process",
            "no GPU adapter (on Debian: apt-get install mesa-vulkan-drivers libvulkan1)",
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let m = TinyModelSpec {
        n_layers: 4,
        head_dim: 32,
        ..TinyModelSpec::llama(21)
    }
    .build()
    .unwrap();
    let model = dir.path().join("tiny-f32.gguf");
    m.write_gguf(&model, GgmlType::F32).unwrap();
    let one = answer(&model, &[]);
    for extra in [
        &["--device", "gpu"][..],
        &["--tp", "2", "--device", "gpu,cpu"],
        &["--tp", "2", "--device", "cpu,gpu"],
        &["--pp", "2", "--device", "gpu,cpu"],
    ] {
        assert_eq!(answer(&model, extra), one, "shoal run {extra:?}");
    }
    for (extra, want) in [
        (
            &["--tp", "2", "--device", "gpu,cpu,cpu"][..],
            "a split of 2 ranks",
        ),
        (&["--device", "gpu,cpu"], "a run on one rank"),
    ] {
        let out = shoal()
            .arg("run")
            .arg(&model)
            .args(["hello", "-n", "2"])
            .args(extra)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(want),
            "{extra:?}: {err}"
        );
    }
}

/// The pids of `parent`'s child processes.
fn children(parent: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|s| s.parse().ok())
        .collect()
}

fn alive(pid: u32) -> bool {
    // a zombie has exited; only its parent's wait is missing
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.contains(") Z "))
        .unwrap_or(false)
}

fn signal(pid: u32, sig: &str) {
    assert!(Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap()
        .success());
}

/// Starts a long TP 2 generation and returns rank 0 (this test's child) once text flows,
/// with its worker's pid.
fn start_long_run(model: &Path, timeout_ms: u64) -> (Child, u32) {
    let mut lead = shoal()
        .arg("run")
        .arg(model)
        .args([
            "hello", "--raw", "--temp", "0", "-n", "30000", "--ctx", "32000",
        ])
        .arg("--ignore-eos")
        .args([
            "-t",
            "1",
            "--tp",
            "2",
            "--comm-timeout-ms",
            &timeout_ms.to_string(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 16];
    lead.stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut first)
        .expect("the split run produced no text");
    let workers = children(lead.id());
    assert_eq!(
        workers.len(),
        1,
        "rank 0 should have one worker: {workers:?}"
    );
    (lead, workers[0])
}

/// Waits for `child` to exit, at most `limit`; returns its stderr and how long it took.
fn wait_exit(mut child: Child, limit: Duration) -> (bool, String, Duration) {
    let t0 = Instant::now();
    // drain stdout so a full pipe cannot block the child
    let mut out = child.stdout.take().unwrap();
    std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            return (status.success(), err, t0.elapsed());
        }
        if t0.elapsed() > limit {
            child.kill().unwrap();
            panic!("rank 0 did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn killing_a_worker_stops_rank_zero_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let (lead, worker) = start_long_run(&model, 4000);
    signal(worker, "-KILL");
    let (ok, err, took) = wait_exit(lead, Duration::from_secs(30));
    assert!(!ok, "rank 0 succeeded after its worker was killed");
    assert!(
        err.contains("rank 1"),
        "the error does not name rank 1: {err}"
    );
    // a closed socket is noticed without waiting for the deadline
    assert!(took < Duration::from_secs(4), "took {took:?}");
    eprintln!(
        "rank 0 exited {took:?} after its worker died: {}",
        err.trim()
    );
}

#[test]
fn a_hung_worker_times_out_within_the_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let (lead, worker) = start_long_run(&model, 2000);
    signal(worker, "-STOP");
    let (ok, err, took) = wait_exit(lead, Duration::from_secs(30));
    // rank 0 kills its local workers on the way out; make sure
    let _ = Command::new("kill")
        .args(["-KILL", &worker.to_string()])
        .stderr(Stdio::null())
        .status();
    assert!(!ok, "rank 0 succeeded with a hung worker");
    assert!(
        err.contains("rank 1"),
        "the error does not name rank 1: {err}"
    );
    assert!(
        took >= Duration::from_millis(1500) && took < Duration::from_secs(10),
        "took {took:?} for a 2 s deadline"
    );
    eprintln!(
        "rank 0 exited {took:?} after its worker hung: {}",
        err.trim()
    );
}

#[test]
fn killing_rank_zero_stops_the_worker() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let (mut lead, worker) = start_long_run(&model, 4000);
    lead.kill().unwrap();
    lead.wait().unwrap();
    let t0 = Instant::now();
    while alive(worker) {
        assert!(
            t0.elapsed() < Duration::from_secs(6),
            "the worker outlived rank 0 by {:?}",
            t0.elapsed()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("the worker exited {:?} after rank 0 died", t0.elapsed());
}

/// Two network namespaces joined by a veth pair, removed on drop.
struct Netns {
    names: [String; 2],
}

impl Netns {
    /// `None` where namespaces cannot be made (not root, no `ip`).
    fn new() -> Option<Self> {
        let id = std::process::id() % 10000;
        let names = [format!("shoal-t{id}a"), format!("shoal-t{id}b")];
        let (va, vb) = (format!("sht{id}a"), format!("sht{id}b"));
        let ip = |args: &[&str]| {
            Command::new("ip")
                .args(args)
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        if !ip(&["netns", "add", &names[0]]) {
            return None;
        }
        let ns = Netns { names };
        let [a, b] = [ns.names[0].as_str(), ns.names[1].as_str()];
        let ok = ip(&["netns", "add", b])
            && ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb])
            && ip(&["link", "set", &va, "netns", a])
            && ip(&["link", "set", &vb, "netns", b])
            && ip(&["-n", a, "addr", "add", "10.78.0.1/24", "dev", &va])
            && ip(&["-n", b, "addr", "add", "10.78.0.2/24", "dev", &vb])
            && ip(&["-n", a, "link", "set", &va, "up"])
            && ip(&["-n", b, "link", "set", &vb, "up"])
            && ip(&["-n", a, "link", "set", "lo", "up"])
            && ip(&["-n", b, "link", "set", "lo", "up"]);
        ok.then_some(ns)
    }

    fn exec(&self, i: usize) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.names[i], env!("CARGO_BIN_EXE_shoal")]);
        c
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = Command::new("ip")
                .args(["netns", "del", n])
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// Two "hosts" (network namespaces on a veth pair) from a rank table: rank 1 runs `shoal
/// worker` in one, rank 0 `shoal run --peers` in the other; the answer is one process's.
/// Skips where namespaces cannot be made unless `SHOAL_REQUIRE_NETNS=1`.
#[test]
fn ranks_on_two_hosts_from_a_rank_table() {
    let Some(ns) = Netns::new() else {
        assert!(
            std::env::var("SHOAL_REQUIRE_NETNS").as_deref() != Ok("1"),
            "cannot create network namespaces (needs root and iproute2)"
        );
        eprintln!("skipping: cannot create network namespaces (needs root and iproute2)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let table = dir.path().join("ranks.txt");
    std::fs::write(&table, "10.78.0.1:47123  # rank 0\n10.78.0.2:0  # rank 1\n").unwrap();
    let mut worker = ns
        .exec(1)
        .arg("worker")
        .arg(&model)
        .args(["--rank", "1", "--peers"])
        .arg(&table)
        .args(["--join-timeout-s", "30"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = ns
        .exec(0)
        .arg("run")
        .arg(&model)
        .args(["hello world", "--raw", "--temp", "0", "-n", "40", "-t", "1"])
        .args(["--tp", "2", "--peers"])
        .arg(&table)
        .output()
        .unwrap();
    let status = worker.wait().unwrap();
    let mut werr = String::new();
    worker
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut werr)
        .unwrap();
    assert!(
        out.status.success(),
        "rank 0 failed: {}\nworker: {werr}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(status.success(), "the worker failed: {werr}");
    assert_eq!(String::from_utf8(out.stdout).unwrap(), answer(&model, &[]));
}
