//! Drafting on cluster instances, two `shoal serve` nodes on loopback placing a model as two
//! pipeline stages; each answer runs to its token budget (`--ignore-eos`), so no draft goes
//! past its end, and every step checks its drafts (`--fixed-drafts`). The lead drafts beside
//! rank 0 and checks each draft in one split step: the answer is the same split's, run
//! locally without drafts, and the lead's metrics count the drafts.
//! - With `--draft`: qwen05 drafting for itself (it shares its tokenizer); nearly all taken.
//! - With `--mtp`: the test kit's GLM whose prediction layer foresees the model, given as a
//!   path on one node only (so the other fetches its share, and if it leads, the layer's
//!   bytes too); every draft taken, which only the layer's true weights give.

mod common;

use std::time::Duration;

use common::{agree, cached_model, json_of as json, metric, node, run, secret};
use serde_json::Value;
use shoal_testkit::{GgmlType, MoeSpec, TinyModel, TinyModelSpec};

/// The lead's `/metrics` (drafted tokens, taken).
fn drafts_at(lead: &str) -> (u64, u64) {
    let text = ureq::get(&format!("{lead}/metrics"))
        .config()
        .timeout_global(Some(Duration::from_secs(10)))
        .build()
        .call()
        .unwrap()
        .body_mut()
        .read_to_string()
        .unwrap();
    (
        metric(&text, "shoal_draft_tokens"),
        metric(&text, "shoal_draft_tokens_accepted"),
    )
}

/// The greedy answer of `model` (a path, or an instance at `--url`) to `prompt`, run to
/// `tokens` tokens: `shoal run` with `extra` flags.
fn answer(model: &str, prompt: &str, tokens: &str, extra: &[&str]) -> String {
    let mut args = vec![
        "run",
        model,
        prompt,
        "--temp",
        "0",
        "-n",
        tokens,
        "--ignore-eos",
    ];
    args.extend_from_slice(extra);
    let (ok, out, err) = run(&args);
    assert!(ok, "shoal run {extra:?}: {err}");
    out
}

/// `model` loaded as two pipeline stages on nodes a and b (through the node at `url`): the
/// instance, and its lead's API address.
fn place_on_two_stages(model: &str, ctx: &str, url: &str) -> (Value, String) {
    let inst: Value = json(&[
        "load",
        model,
        "--strategy",
        "pipeline",
        "--nodes",
        "a,b",
        "--ctx",
        ctx,
        "--json",
        "--url",
        url,
    ]);
    assert_eq!(inst["pp"], 2, "{inst}");
    let lead = format!("http://{}", inst["api"].as_str().unwrap());
    (inst, lead)
}

/// The layers of each stage of an instance's `placement` ("node[a..b] -> node[b..c]"), as
/// `--stage-layers` takes them.
fn stage_layers(inst: &Value) -> String {
    inst["placement"]
        .as_str()
        .unwrap()
        .split(" -> ")
        .map(|s| {
            let r = s.rsplit('[').next().unwrap().trim_end_matches(']');
            let (x, y) = r.split_once("..").unwrap();
            (y.parse::<usize>().unwrap() - x.parse::<usize>().unwrap()).to_string()
        })
        .collect::<Vec<_>>()
        .join(",")
}

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
    let (inst, lead) = place_on_two_stages("qwen05", "512", &nodes[0].url);
    let layers = stage_layers(&inst);
    // the same stages run locally, plain
    let local = answer(
        m,
        prompt,
        "32",
        &["-t", "1", "--pp", "2", "--stage-layers", &layers],
    );
    let there = answer("qwen05", prompt, "32", &["--url", &lead]);
    assert_eq!(there, local, "{}", inst["placement"]);
    let (drafted, taken) = drafts_at(&lead);
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

#[test]
fn a_split_instance_drafts_with_the_models_prediction_layer() {
    let dir = tempfile::tempdir().unwrap();
    let secret = secret(dir.path());
    let path = dir.path().join("glm-foresees.gguf");
    // five layers of 128 experts of 768 features (after one dense layer): about 380 MB of
    // F32, which a node offering 800 MB (as the test nodes do) cannot hold whole beside the
    // 512 MiB a rank is planned to need beyond weights, but half of it
    let glm = TinyModelSpec::glm4moe(71);
    TinyModel::foreseeing(TinyModelSpec {
        n_layers: 6,
        context_length: 1024,
        moe: glm.moe.clone().map(|m| MoeSpec {
            n_expert: 128,
            expert_ffn: 768,
            ..m
        }),
        ..glm
    })
    .unwrap()
    .write_gguf(&path, GgmlType::F32)
    .unwrap();
    let m = path.to_str().unwrap();
    let prompt = "the cat sat on the mat";
    let homes = ["home-a", "home-b"].map(|h| dir.path().join(h));
    for h in &homes {
        std::fs::create_dir_all(h).unwrap();
    }
    let extra = ["--mtp", "--draft-max", "4", "--fixed-drafts"];
    let a = node(dir.path(), "a", &secret, &homes[0], None, &extra);
    let b = node(dir.path(), "b", &secret, &homes[1], Some(&a.listen), &extra);
    let nodes = [a, b];
    agree(&nodes);
    // the file is a path on node a; b has nothing
    let (inst, lead) = place_on_two_stages(m, "256", &nodes[0].url);
    let layers = stage_layers(&inst);
    let local = answer(
        m,
        prompt,
        "41",
        &["-t", "1", "--pp", "2", "--stage-layers", &layers],
    );
    let name = path.file_stem().unwrap().to_str().unwrap();
    let there = answer(name, prompt, "41", &["--url", &lead]);
    assert_eq!(there, local, "{}", inst["placement"]);
    let (drafted, taken) = drafts_at(&lead);
    eprintln!(
        "{} (lead {lead}): {taken} of {drafted} drafted tokens taken",
        inst["placement"]
    );
    // 32 tokens after the first: 8 steps of 1 + 4, each draft taken
    assert_eq!((drafted, taken), (32, 32));
}
