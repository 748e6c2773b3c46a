//! Logits against llama.cpp on the real demo models, teacher-forced.
//!
//! `tests/data/golden.json` holds, per model and prompt, llama.cpp's prompt tokens (as
//! `shoal run --raw` tokenizes), its first 32 greedy tokens, and its top 8 logits after the
//! prompt and after each of those tokens: `bench/golden.sh` writes it with the test kit's
//! llama.cpp oracle (F16 KV cache as shoal keeps, no flash attention, one thread). The test
//! feeds shoal the same tokens (the prompt, then llama.cpp's tokens, so one early difference
//! cannot derail the rest) and compares every step of every prompt with
//! `shoal_testkit::compare_teacher_forced`:
//!
//! - each of llama.cpp's top 8 logits within [`REL_LOGIT`] of the step's logit scale (the
//!   largest of those |logits|);
//! - the same argmax, unless llama.cpp's own top two are within [`NEAR_TIE`] of the scale;
//! - over all of a model's prompts, the mean |shoal - llama.cpp| within [`MEAN_REL`] of the
//!   scale.
//!
//! Why these bounds: both engines round activations to 8 bits before each quantized product,
//! from starting values that differ in the last bits wherever their f32 sums are ordered
//! differently, so on these small quantized models single logits differ by a few percent of
//! the scale. llama.cpp differs from itself as much: its F16-cache and F32-cache runs of
//! the same prompts part at the median entry by 0.2-1.4% of the scale and at the 90th
//! percentile by 0.6-3.9%, and pick other greedy tokens in 7 of the 12 prompts. Measured
//! here, shoal against it: the worst single entry 6.2% (gemma3), the mean per model 0.35%
//! (qwen05) to 1.1% (gemma3). A systematic fault moves the mean: `planted_faults_fail_the_
//! check` shows a RoPE base left at the default, two query heads exchanged in every layer
//! and logit rows flattened by a tenth each failing it on smollm2, whose honest mean is
//! 0.78%.
//!
//! Models are looked up in the catalog cache (`shoal models fetch KEY`); a missing model
//! skips the test unless `SHOAL_REQUIRE_MODELS=1`, which CI sets.

mod common;

use std::path::Path;
use std::sync::Arc;

use common::{model_path, SwappedHeads};
use serde_json::Value;
use shoal_engine::model::LoadedModel;
use shoal_engine::weights::GgufWeights;
use shoal_engine::{arch, ModelConfig, Transformer};
use shoal_model::gguf::GgufFile;
use shoal_testkit::{compare_teacher_forced, Comparison, Tolerance};

/// Largest |shoal - llama.cpp| of one of llama.cpp's top entries, relative to the step's
/// scale (the largest |logit| among them).
const REL_LOGIT: f32 = 0.10;

/// Largest mean |shoal - llama.cpp| over all of a model's compared entries, relative to
/// each step's scale.
const MEAN_REL: f64 = 0.02;

/// A differing argmax is excused only where llama.cpp's own top two are this close,
/// relative to the scale: about what two entries' errors at the 90th percentile (1-2% of
/// the scale each, in opposite directions) can move a gap by.
const NEAR_TIE: f32 = 0.03;

const TOL: Tolerance = Tolerance {
    rel_logit: REL_LOGIT,
    near_tie: NEAR_TIE,
};

/// One prompt's golden data.
struct Case {
    prompt: String,
    prompt_ids: Vec<u32>,
    ids: Vec<u32>,
    steps: Vec<Vec<(u32, f32)>>,
}

fn cases(key: &str) -> Vec<Case> {
    let golden: Value =
        serde_json::from_str(include_str!("data/golden.json")).expect("golden.json");
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .expect("ids")
            .iter()
            .map(|x| x.as_u64().expect("id") as u32)
            .collect()
    };
    golden[key]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| Case {
            prompt: c["prompt"].as_str().expect("prompt").to_string(),
            prompt_ids: ids(&c["prompt_ids"]),
            ids: ids(&c["ids"]),
            steps: c["steps"]
                .as_array()
                .expect("steps")
                .iter()
                .map(|s| {
                    s.as_array()
                        .expect("step")
                        .iter()
                        .map(|e| {
                            (
                                e[0].as_u64().expect("id") as u32,
                                e[1].as_f64().unwrap_or(f64::NAN) as f32,
                            )
                        })
                        .collect()
                })
                .collect(),
        })
        .collect()
}

/// Our logit rows, teacher-forced: after `prompt`, then after each of `ids`.
fn ours(t: &Transformer, prompt: &[u32], ids: &[u32]) -> Vec<Vec<f32>> {
    let mut cache = t.new_cache(prompt.len() + ids.len() + 1);
    let mut rows = vec![t.prefill(prompt, &mut cache).expect("prefill")];
    for &id in ids {
        rows.push(t.forward_last(&[id], &mut cache).expect("decode"));
    }
    rows
}

fn compare(t: &Transformer, case: &Case) -> Comparison {
    let rows = ours(t, &case.prompt_ids, &case.ids);
    compare_teacher_forced(&case.steps, &rows, TOL)
}

fn check_model(key: &str) {
    let Some(path) = model_path(key) else { return };
    let model = LoadedModel::load(&shoal_model::source::ModelSource::Gguf(path)).expect("load");
    let mut failed = Vec::new();
    let (mut sum, mut entries) = (0f64, 0usize);
    for case in cases(key) {
        let got = model.raw_prompt(&case.prompt).expect("tokenize");
        assert_eq!(
            got, case.prompt_ids,
            "{key}: prompt tokens of {:?} differ from llama.cpp's",
            case.prompt
        );
        let c = compare(&model.transformer, &case);
        let label = format!("{key} {:?}", case.prompt);
        eprintln!(
            "{label}: {} steps, worst |ours - llama.cpp| {:.2}% of the logit scale, {} near-ties excused",
            c.steps,
            100.0 * c.worst_rel,
            c.excused.len()
        );
        sum += c.sum_rel;
        entries += c.entries;
        if !c.passed() {
            failed.push((label, c));
        }
    }
    for (label, c) in &failed {
        eprintln!("{label}: {}", c.failures.join("\n  "));
    }
    let mean = sum / entries.max(1) as f64;
    eprintln!(
        "{key}: mean |ours - llama.cpp| {:.2}% of the logit scale over {entries} entries",
        100.0 * mean
    );
    assert!(failed.is_empty(), "{} of the prompts failed", failed.len());
    assert!(
        mean <= MEAN_REL,
        "{key}: mean |ours - llama.cpp| is {:.2}% of the scale, above {:.0}%",
        100.0 * mean,
        100.0 * MEAN_REL
    );
}

#[test]
fn smollm2_matches_llamacpp() {
    check_model("smollm2");
}

#[test]
fn qwen05_matches_llamacpp() {
    check_model("qwen05");
}

#[test]
fn gemma3_matches_llamacpp() {
    check_model("gemma3");
}

fn open(path: &Path) -> (GgufFile, ModelConfig) {
    let file = GgufFile::open(path).unwrap();
    let vocab = file.tensor("token_embd.weight").unwrap().shape()[0];
    let cfg = arch::config_from_gguf(file.metadata(), vocab, "golden").unwrap();
    (file, cfg)
}

/// Whether the rows `rows(case)` pass every rule over all of `cases`: each prompt's
/// comparison, and the mean over all of them. Returns the failures' count and the mean.
fn judge(cases: &[Case], rows: impl Fn(&Case) -> Vec<Vec<f32>>) -> (usize, f64) {
    let (mut failures, mut sum, mut entries) = (0, 0f64, 0);
    for case in cases {
        let c = compare_teacher_forced(&case.steps, &rows(case), TOL);
        failures += c.failures.len();
        sum += c.sum_rel;
        entries += c.entries;
    }
    let mean = sum / entries.max(1) as f64;
    (failures + usize::from(mean > MEAN_REL), mean)
}

/// The checks above can fail: on smollm2, the RoPE base left at the common default
/// (10,000 where the file says 100,000), query heads 0 and 1 exchanged in every layer, and
/// every logit row flattened by a tenth each fail them, where the model as it is passes.
#[test]
fn planted_faults_fail_the_check() {
    let Some(path) = model_path("smollm2") else {
        return;
    };
    let cases = cases("smollm2");
    let solo = || Arc::new(shoal_comm::Solo);
    let (file, cfg) = open(&path);
    assert_eq!(cfg.rope_theta, 100_000.0, "smollm2's RoPE base");
    let honest = Transformer::load(&GgufWeights::new(file), cfg.clone(), solo()).unwrap();
    let (failures, mean) = judge(&cases, |c| ours(&honest, &c.prompt_ids, &c.ids));
    eprintln!("as it is: {failures} failures, mean {:.2}%", 100.0 * mean);
    assert_eq!(failures, 0, "the model as it is fails");

    let mut faults: Vec<(&str, (usize, f64))> = Vec::new();
    let (file, _) = open(&path);
    let default_base = ModelConfig {
        rope_theta: 10_000.0,
        rope_theta_local: 10_000.0,
        ..cfg.clone()
    };
    let t = Transformer::load(&GgufWeights::new(file), default_base, solo()).unwrap();
    faults.push((
        "RoPE base 10,000",
        judge(&cases, |c| ours(&t, &c.prompt_ids, &c.ids)),
    ));

    let (file, _) = open(&path);
    let swapped = SwappedHeads {
        inner: GgufWeights::new(file),
        head_rows: cfg.head_dim,
        heads: (0, 1),
    };
    let t = Transformer::load(&swapped, cfg.clone(), solo()).unwrap();
    faults.push((
        "query heads 0 and 1 exchanged",
        judge(&cases, |c| ours(&t, &c.prompt_ids, &c.ids)),
    ));

    faults.push((
        "logit rows flattened by a tenth",
        judge(&cases, |c| {
            ours(&honest, &c.prompt_ids, &c.ids)
                .into_iter()
                .map(|row| row.into_iter().map(|l| 0.9 * l).collect())
                .collect()
        }),
    ));

    for (what, (failures, mean)) in &faults {
        eprintln!("{what}: {failures} failures, mean {:.2}%", 100.0 * mean);
        assert!(*failures > 0, "{what} passed the check");
    }
}
