//! Token-exactness against llama.cpp on the real demo models.
//!
//! `tests/data/golden.json` holds, per model and prompt, llama.cpp's prompt tokens, its first
//! 32 greedy tokens and the two best logits at each step, made by
//!
//! ```text
//! bench/golden.sh MODEL.gguf 32 "The capital of France is" "def fibonacci(n):" \
//!     "Once upon a time, there was a little" "The three primary colors are"
//! GOLDEN_KV_F32=1 GOLDEN_NO_FA=1 bench/golden.sh ...   # the `llamacpp_f32` variant
//! ```
//!
//! (`llamacpp_default`: llama.cpp's defaults, F16 KV cache and flash attention;
//! `llamacpp_f32`: F32 KV cache, no flash attention — shoal keeps an F16 KV cache, like
//! llama.cpp's default, and computes attention over it in f32.)
//! llama.cpp's two configurations disagree with each other on several prompts: these small
//! quantized models meet near-ties within 32 tokens, and 8-bit activation quantization turns
//! last-bit differences anywhere into logit differences of about 0.1. So the test demands:
//! our prompt tokens equal llama.cpp's exactly, our greedy tokens equal llama.cpp's up to the
//! first step where they differ, and at that step the two best logits are within
//! [`NEAR_TIE`] on our side or on llama.cpp's (a coin toss that rounding decides, not a bug).
//!
//! Why 0.15 and not tighter: at the first step where llama.cpp's default run and its own F32
//! run part ways, the gap between the two best logits is 0.26 / 0.034 (smollm2, "The capital
//! of France is"), 0.148 / 0.094 (smollm2, "def fibonacci(n):"), 0.205 / 0.002 (qwen05),
//! 0.193 / 0.009 and 0.142 / 0.077 (gemma3): llama.cpp disagrees with itself at gaps up to
//! 0.094 on the closer side. Our divergences sit in the same band (worst 0.117).
//!
//! Models are looked up in the catalog cache (`shoal models fetch KEY`); a missing model
//! skips the test unless `SHOAL_REQUIRE_MODELS=1`, which CI sets.

mod common;

use common::model_path;
use serde_json::Value;
use shoal_engine::model::LoadedModel;
use shoal_engine::transformer::argmax;

/// Largest gap between the two best logits that counts as a near-tie.
const NEAR_TIE: f32 = 0.15;

/// Our greedy tokens and, per step, (best, gap to second best).
fn greedy(model: &LoadedModel, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<f32>) {
    let mut cache = model.new_cache(prompt.len() + n + 1);
    let mut logits = model
        .transformer
        .forward_last(prompt, &mut cache)
        .expect("prefill");
    let (mut ids, mut gaps) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let best = argmax(&logits);
        let second = logits
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != best)
            .map(|(_, &l)| l)
            .fold(f32::NEG_INFINITY, f32::max);
        ids.push(best as u32);
        gaps.push(logits[best] - second);
        logits = model
            .transformer
            .forward_last(&[best as u32], &mut cache)
            .expect("decode");
    }
    (ids, gaps)
}

fn check_model(key: &str) {
    let Some(path) = model_path(key) else { return };
    let golden: Value =
        serde_json::from_str(include_str!("data/golden.json")).expect("golden.json");
    let model = LoadedModel::load(&shoal_model::source::ModelSource::Gguf(path)).expect("load");
    let mut report = Vec::new();
    let mut failures = Vec::new();
    for variant in ["llamacpp_default", "llamacpp_f32"] {
        for case in golden[key][variant].as_array().expect("cases") {
            let prompt = case["prompt"].as_str().expect("prompt");
            let ids = |v: &Value| -> Vec<u32> {
                v.as_array()
                    .expect("ids")
                    .iter()
                    .map(|x| x.as_u64().expect("id") as u32)
                    .collect()
            };
            let want_prompt = ids(&case["prompt_ids"]);
            let got_prompt = model.raw_prompt(prompt).expect("tokenize");
            assert_eq!(
                got_prompt, want_prompt,
                "{key}: prompt tokens of {prompt:?} differ from llama.cpp's"
            );
            let want = ids(&case["ids"]);
            let (got, gaps) = greedy(&model, &got_prompt, want.len());
            match got.iter().zip(&want).position(|(a, b)| a != b) {
                None => report.push(format!(
                    "{key} {variant} {prompt:?}: all {} tokens equal",
                    want.len()
                )),
                Some(step) => {
                    let theirs = &case["top2"][step];
                    let their_gap =
                        theirs[1].as_f64().unwrap_or(0.0) - theirs[3].as_f64().unwrap_or(0.0);
                    if gaps[step].min(their_gap as f32) > NEAR_TIE {
                        failures.push(format!(
                            "{key} {variant} {prompt:?}: first difference at step {step}: ours {} (gap to second {:.4}), \
                             llama.cpp {} (top two {theirs}); not a near-tie",
                            got[step], gaps[step], want[step]
                        ));
                    }
                    report.push(format!(
                        "{key} {variant} {prompt:?}: equal for {step} tokens, then a near-tie (our gap {:.4}, llama.cpp gap {their_gap:.4})",
                        gaps[step]
                    ));
                }
            }
        }
    }
    for line in report {
        eprintln!("{line}");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
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
