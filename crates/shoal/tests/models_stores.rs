//! Models read in place from Ollama's store and LM Studio's folder, laid out by the test kit:
//! `shoal run ollama:NAME` and `shoal run lmstudio:...` answer as the GGUF file itself does,
//! `shoal models list` shows each store's models marked by store, and on a cluster `shoal
//! load ollama:NAME` places the model on a node without the store (which fetches
//! the model from the one with it) and `shoal run` through the API answers the same, whether
//! given the instance id, the store name or the file's path.

mod common;

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{json_of, node_with_env, secret, wait_until};
use shoal_testkit::stores::{write_lmstudio, write_ollama};
use shoal_testkit::{GgmlType, TinyModelSpec};

/// A tiny Llama of four layers, written as GGUF at `path`.
fn tiny(path: &Path) -> Vec<u8> {
    let m = TinyModelSpec {
        n_layers: 4,
        ..TinyModelSpec::llama(31)
    }
    .build()
    .unwrap();
    m.write_gguf(path, GgmlType::Q8_0).unwrap();
    fs::read(path).unwrap()
}

/// `shoal` with the stores at `ollama` and `lmstudio` and the rest of its home in `home`.
fn shoal(home: &Path, ollama: &Path, lmstudio: &Path) -> Command {
    let mut c = common::shoal();
    c.env("HOME", home)
        .env("SHOAL_HOME", home.join("shoal"))
        .env("HF_HUB_CACHE", home.join("hub"))
        .env("OLLAMA_MODELS", ollama)
        .env("SHOAL_LMSTUDIO_MODELS", lmstudio);
    c
}

fn ok(c: &mut Command) -> String {
    let o = c.output().unwrap();
    assert!(
        o.status.success(),
        "{c:?} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

const ANSWER_ARGS: [&str; 8] = ["--raw", "--temp", "0", "-n", "12", "-t", "1", "--seed"];

fn answer(c: &mut Command, model: &str, extra: &[&str]) -> String {
    ok(c.args(["run", model, "hello world"])
        .args(ANSWER_ARGS)
        .arg("1")
        .args(extra))
}

#[test]
fn ollama_and_lmstudio_models_run_in_place_and_are_listed() {
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path();
    let file = home.join("tiny.gguf");
    let data = tiny(&file);
    let ollama = home.join("ollama");
    let lm = home.join("lmstudio");
    write_ollama(
        &ollama,
        "registry.example",
        "library",
        "tiny",
        "latest",
        &data,
    )
    .unwrap();
    write_lmstudio(&lm, "pub", "Tiny-GGUF", &[("Tiny-Q8_0.gguf", &data)]).unwrap();
    let sh = || shoal(home, &ollama, &lm);

    let want = answer(&mut sh(), file.to_str().unwrap(), &[]);
    assert!(!want.is_empty());
    for name in [
        "ollama:tiny",
        "ollama:tiny:latest",
        "lmstudio:pub/Tiny-GGUF/Tiny-Q8_0.gguf",
        "lmstudio:Tiny-Q8_0",
    ] {
        assert_eq!(answer(&mut sh(), name, &[]), want, "{name}");
    }

    let list = ok(sh().args(["models", "list"]));
    let row = |store: &str, key: &str| {
        list.lines()
            .any(|l| l.split_whitespace().take(2).eq([store, key]))
    };
    assert!(row("ollama", "ollama:tiny:latest"), "{list}");
    assert!(
        row("lmstudio", "lmstudio:pub/Tiny-GGUF/Tiny-Q8_0.gguf"),
        "{list}"
    );
    assert!(row("catalog", "qwen05"), "{list}");
    let json = ok(sh().args(["models", "list", "--json"]));
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let ol = v
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["store"] == "ollama")
        .unwrap();
    assert_eq!(ol["key"], "ollama:tiny:latest");
    assert_eq!(ol["cached"], true);
    assert_eq!(ol["size"], data.len() as u64);

    let o = sh()
        .args(["run", "ollama:absent", "hi", "-n", "1"])
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        e.contains("ollama pull absent:latest") && e.contains("ollama:tiny:latest"),
        "{e}"
    );
}

#[test]
fn an_ollama_model_loads_on_a_cluster_and_is_asked_by_any_of_its_names() {
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path();
    let file = home.join("tiny.gguf");
    let data = tiny(&file);
    let ollama = home.join("ollama");
    let empty = home.join("empty");
    fs::create_dir(&empty).unwrap();
    write_ollama(
        &ollama,
        "registry.example",
        "library",
        "tiny",
        "latest",
        &data,
    )
    .unwrap();
    let want = answer(&mut shoal(home, &ollama, &empty), "ollama:tiny", &[]);

    let s = secret(home);
    let env_a = [("OLLAMA_MODELS", ollama.to_str().unwrap())];
    let env_b = [("OLLAMA_MODELS", empty.to_str().unwrap())];
    let a = node_with_env(
        home,
        "a",
        &s,
        &home.join("ha"),
        None,
        &["--no-mdns"],
        &env_a,
    );
    let peer = a.listen.clone();
    let b = node_with_env(
        home,
        "b",
        &s,
        &home.join("hb"),
        Some(&peer),
        &["--no-mdns"],
        &env_b,
    );
    let nodes = [a, b];
    common::agree(&nodes);
    let (url_a, url_b) = (nodes[0].url.clone(), nodes[1].url.clone());

    // placed on b, which has no store, so it fetches the model from a
    let (placed, _, err) = common::run(&[
        "load",
        "ollama:tiny",
        "--nodes",
        "b",
        "--timeout-s",
        "120",
        "--url",
        &url_a,
    ]);
    assert!(placed, "load ollama:tiny: {err}");
    let inst = wait_until(Duration::from_secs(30), "the instance is listed", || {
        json_of(&["ps", "--json", "--url", &url_b])
            .as_array()?
            .iter()
            .find(|i| i["id"] == "tiny" && i["state"] == "ready")
            .cloned()
    });
    assert_eq!(inst["model"], "tiny");
    assert_eq!(inst["nodes"], serde_json::json!(["b"]), "{inst}");
    let fetched = fs::read_dir(home.join("b").join("models"))
        .map(|d| d.flatten().count())
        .unwrap_or(0);
    assert!(fetched > 0, "node b fetched nothing of the model");

    let remote = |model: &str, url: &str| answer(&mut common::shoal(), model, &["--url", url]);
    // a store name the node asked cannot read: refused saying why, not only what is offered
    let (placed, _, err) = common::run(&["load", "ollama:absent", "--url", &url_a]);
    assert!(!placed);
    assert!(
        err.contains("404") && err.contains("ollama pull absent:latest"),
        "{err}"
    );

    // by its id, as an Ollama client names it, and by the store name, through either node
    assert_eq!(remote("tiny", &url_b), want);
    assert_eq!(remote("tiny:latest", &url_a), want);
    assert_eq!(remote("ollama:tiny", &url_a), want);

    // a file loaded by its path under another id: `run PATH --url` finds that instance
    let other = home.join("other.gguf");
    TinyModelSpec {
        n_layers: 2,
        ..TinyModelSpec::llama(32)
    }
    .build()
    .unwrap()
    .write_gguf(&other, GgmlType::Q8_0)
    .unwrap();
    let long_id = "a-rather-long-instance-id-that-is-wider-than-any-column";
    let path = other.to_str().unwrap();
    let (placed, _, err) = common::run(&[
        "load",
        path,
        "--id",
        long_id,
        "--timeout-s",
        "120",
        "--url",
        &url_a,
    ]);
    assert!(placed, "load {path}: {err}");
    let local = answer(&mut common::shoal(), path, &[]);
    assert_eq!(remote(path, &url_a), local);
    assert_eq!(remote(long_id, &url_a), local);

    // `shoal ps`: every column starts where its header does, the long id notwithstanding
    let (listed, ps, err) = common::run(&["ps", "--url", &url_a]);
    assert!(listed, "{err}");
    let lines: Vec<&str> = ps.lines().filter(|l| !l.starts_with(' ')).collect();
    let head = lines.iter().position(|l| l.starts_with("ID")).unwrap();
    for col in ["MODEL", "STATE", "PLACEMENT"] {
        let at = lines[head].find(col).unwrap();
        for l in &lines[head + 1..] {
            assert!(
                l[..at].ends_with("  ") && !l[at..].starts_with(' '),
                "{col} does not line up in {l:?}:\n{ps}"
            );
        }
    }
    assert!(lines.iter().any(|l| l.starts_with(long_id)), "{ps}");
}
