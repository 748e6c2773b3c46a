//! `shoal serve` end to end as a process, on a tiny model the test kit writes as GGUF: it
//! prints its ready line, `shoal run --url` answers exactly what `shoal run` answers
//! locally (greedy, seeded with penalties, and under a JSON schema), `shoal keys` manages keys through the HTTP API (the first is an administrator
//! key, and once one exists requests without a key are refused), and SIGTERM stops it.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use shoal_testkit::{GgmlType, TinyModelSpec};

fn shoal() -> Command {
    Command::new(env!("CARGO_BIN_EXE_shoal"))
}

fn tiny_model(dir: &Path) -> PathBuf {
    let p = dir.join("tiny.gguf");
    TinyModelSpec::qwen2(31)
        .build()
        .unwrap()
        .write_gguf(&p, GgmlType::Q8_0)
        .unwrap();
    p
}

struct Server {
    child: Child,
    url: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(model: &Path, data: &Path, extra: &[&str]) -> Server {
    let mut child = shoal()
        .arg("serve")
        .arg("--model")
        .arg(model)
        .args(["--api", "127.0.0.1:0", "-t", "1", "--ctx", "256"])
        .args(extra)
        .arg("--data-dir")
        .arg(data)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let ready: serde_json::Value =
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
    assert_eq!(ready["node"].as_str().unwrap().len(), 16, "{ready}");
    assert_eq!(ready["models"][0], "tiny", "{ready}");
    Server {
        child,
        url: format!("http://{}", ready["api"].as_str().unwrap()),
    }
}

fn run(args: &[&str]) -> (bool, String, String) {
    let out = shoal().args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn run_on_a_node_answers_like_running_here_and_keys_guard_it() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let m = model.to_str().unwrap();
    let server = serve(&model, &dir.path().join("node"), &[]);
    let url = server.url.as_str();

    // `shoal run` and `shoal serve` generate through one scheduler: the same request gives
    // the same text greedily, seeded with penalties, and under a JSON schema
    // bounded, so the tiny model's answer completes within the token limit
    let schema = r#"{"type":"object","properties":{"n":{"type":"integer","minimum":0,"maximum":99},"w":{"type":"string","maxLength":6}},"required":["n","w"],"additionalProperties":false}"#;
    let variants: [(&str, Vec<&str>); 3] = [
        ("greedy", vec!["--temp", "0", "--ignore-eos"]),
        (
            "seeded, penalised",
            vec![
                "--temp",
                "0.9",
                "--seed",
                "7",
                "--top-k",
                "30",
                "--top-p",
                "0.9",
                "--min-p",
                "0.02",
                "--repeat-penalty",
                "1.3",
                "--ignore-eos",
            ],
        ),
        ("json schema", vec!["--temp", "0", "--json-schema", schema]),
    ];
    for (what, opts) in &variants {
        for raw in [true, false] {
            if raw && *what == "json schema" {
                continue;
            }
            let mut args = vec!["run", m, "hello world", "-n", "40", "-t", "1"];
            args.extend(opts);
            if raw {
                args.push("--raw");
            }
            let (ok, here, err) = run(&args);
            assert!(ok, "{what}: {err}");
            let mut remote = vec!["run", "tiny", "hello world", "-n", "40", "--url", url];
            remote.extend(opts);
            if raw {
                remote.push("--raw");
            }
            let (ok, there, err) = run(&remote);
            assert!(ok, "{what}: {err}");
            assert_eq!(
                there, here,
                "{what}, raw {raw}: the node answers what a local run answers"
            );
            if *what == "json schema" {
                let v: serde_json::Value = serde_json::from_str(here.trim())
                    .unwrap_or_else(|e| panic!("{e}: not JSON: {here:?}"));
                assert!(v["n"].is_i64() && v["w"].is_string(), "{v}");
            } else {
                assert!(err.contains("generation: 40 tokens"), "{what}: {err}");
            }
        }
    }

    // keys: the first is an administrator key; then a key is required
    let (ok, secret, err) = run(&["keys", "create", "--name", "ops", "--url", url]);
    assert!(ok, "{err}");
    let secret = secret.trim().to_string();
    assert!(
        secret.starts_with("sk-shoal-") && err.contains("administrator"),
        "{secret} {err}"
    );
    let (ok, _, err) = run(&["run", "tiny", "hi", "-n", "2", "--url", url]);
    assert!(!ok && err.contains("401"), "{err}");
    let (ok, list, err) = run(&["keys", "list", "--json", "--url", url, "--key", &secret]);
    assert!(ok, "{err}");
    let keys: serde_json::Value = serde_json::from_str(&list).unwrap();
    assert_eq!(keys[0]["name"], "ops");
    assert!(
        keys[0].get("hash").is_none(),
        "hashes never leave the node: {keys}"
    );
    let (ok, _, err) = run(&[
        "run", "tiny", "hi", "-n", "2", "--url", url, "--key", &secret,
    ]);
    assert!(ok, "{err}");
    let id = keys[0]["id"].as_str().unwrap().to_string();
    let (ok, _, err) = run(&["keys", "revoke", &id, "--url", url, "--key", &secret]);
    assert!(ok, "{err}");
    let (ok, _, err) = run(&["keys", "list", "--url", url, "--key", &secret]);
    assert!(ok, "with no key left the node is open again: {err}");
}

/// The value of metric `name` (for any model) in a Prometheus exposition.
fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in the metrics"))
}

/// Speculative decoding on `shoal serve`, by prompt lookup and by a draft model: the
/// answers are a plain run's, and the metrics count drafted and accepted tokens.
#[test]
fn serve_speculates_with_lookup_and_a_draft_model() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let m = model.to_str().unwrap();
    let draft = dir.path().join("draft.gguf");
    TinyModelSpec::qwen2(32)
        .build()
        .unwrap()
        .write_gguf(&draft, GgmlType::Q8_0)
        .unwrap();
    let prompt = "one two three one two three one two three";
    let (ok, plain, err) = run(&[
        "run",
        m,
        prompt,
        "-n",
        "40",
        "-t",
        "1",
        "--temp",
        "0",
        "--ignore-eos",
    ]);
    assert!(ok, "{err}");
    for (what, extra) in [
        ("lookup", vec!["--lookup", "4"]),
        ("draft", vec!["--draft", draft.to_str().unwrap()]),
    ] {
        let server = serve(&model, &dir.path().join(what), &extra);
        let url = server.url.as_str();
        let (ok, there, err) = run(&[
            "run",
            "tiny",
            prompt,
            "-n",
            "40",
            "--temp",
            "0",
            "--ignore-eos",
            "--url",
            url,
        ]);
        assert!(ok, "{what}: {err}");
        assert_eq!(
            there, plain,
            "{what}: speculation leaves the text as it was"
        );
        let text = ureq::get(&format!("{url}/metrics"))
            .call()
            .unwrap()
            .body_mut()
            .read_to_string()
            .unwrap();
        let drafted = metric(&text, "shoal_draft_tokens");
        let accepted = metric(&text, "shoal_draft_tokens_accepted");
        eprintln!("{what}: {accepted} of {drafted} drafted tokens accepted");
        assert!(
            drafted > 0 && accepted <= drafted,
            "{what}: {drafted} {accepted}"
        );
    }
    // a draft model is for the models served here
    let (ok, _, err) = run(&["serve", "--draft", m, "--api", "127.0.0.1:0"]);
    assert!(!ok && err.contains("--draft"), "{err}");
}

#[test]
fn sigterm_stops_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let mut server = serve(&model, &dir.path().join("node"), &[]);
    let pid = server.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let t0 = Instant::now();
    loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            assert!(status.success(), "{status}");
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "still running 10 s after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
