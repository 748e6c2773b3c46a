//! A draft model on a cluster instance: two `shoal serve` nodes on loopback, each started
//! with `--draft` (qwen05 itself, which shares its tokenizer, with `--fixed-drafts` so that
//! every step checks its drafts), place qwen05 as two pipeline stages; the answer runs to
//! its token budget (`--ignore-eos`), so no draft goes past its end. The lead drafts beside
//! rank 0 and checks each draft in one split step: the answer is the same split's, run
//! locally without drafts, and the lead's metrics count the drafts, nearly all taken.

mod common;

use std::time::Duration;

use common::{agree, cached_model, json_of as json, metric, node, run, secret};
use serde_json::Value;

#[test]
fn a_split_instance_checks_the_lead_nodes_draft_model() {
    let Some(model) = cached_model("qwen05") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let secret = secret(dir.path());
    let m = model.to_str().unwrap();
    let prompt = "Count from one to twenty in words.";

    let home_a = model.parent().unwrap().parent().unwrap().to_path_buf();
    let home_b = dir.path().join("home-b");
    std::fs::create_dir_all(&home_b).unwrap();
    let extra = ["--draft", m, "--draft-max", "4", "--fixed-drafts"];
    let a = node(dir.path(), "a", &secret, &home_a, None, &extra);
    let b = node(dir.path(), "b", &secret, &home_b, Some(&a.listen), &extra);
    let nodes = [a, b];
    agree(&nodes);
    let inst: Value = json(&[
        "load",
        "qwen05",
        "--strategy",
        "pipeline",
        "--nodes",
        "a,b",
        "--ctx",
        "512",
        "--json",
        "--url",
        &nodes[0].url,
    ]);
    assert_eq!(inst["pp"], 2, "{inst}");
    let lead = format!("http://{}", inst["api"].as_str().unwrap());
    let layers: Vec<String> = inst["placement"]
        .as_str()
        .unwrap()
        .split(" -> ")
        .map(|s| {
            let r = s.rsplit('[').next().unwrap().trim_end_matches(']');
            let (x, y) = r.split_once("..").unwrap();
            (y.parse::<usize>().unwrap() - x.parse::<usize>().unwrap()).to_string()
        })
        .collect();
    // the same stages run locally, plain
    let (ok, local, err) = run(&[
        "run",
        m,
        prompt,
        "--temp",
        "0",
        "-n",
        "32",
        "--ignore-eos",
        "-t",
        "1",
        "--pp",
        "2",
        "--stage-layers",
        &layers.join(","),
    ]);
    assert!(ok, "{err}");
    let (ok, there, err) = run(&[
        "run",
        "qwen05",
        prompt,
        "--temp",
        "0",
        "-n",
        "32",
        "--ignore-eos",
        "--url",
        &lead,
    ]);
    assert!(ok, "{err}");
    assert_eq!(there, local, "{}", inst["placement"]);
    let text = ureq::get(&format!("{lead}/metrics"))
        .config()
        .timeout_global(Some(Duration::from_secs(10)))
        .build()
        .call()
        .unwrap()
        .body_mut()
        .read_to_string()
        .unwrap();
    let drafted = metric(&text, "shoal_draft_tokens");
    let taken = metric(&text, "shoal_draft_tokens_accepted");
    eprintln!(
        "{}: {taken} of {drafted} drafted tokens taken",
        inst["placement"]
    );
    // the model as its own draft: its drafts are taken (all but where a step of several
    // rows rounds a near tie the other way)
    assert!(
        drafted > 0 && taken * 10 >= drafted * 9,
        "{taken} of {drafted}"
    );
}
