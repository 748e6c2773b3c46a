//! shoal against llama.cpp on synthetic models of every supported architecture (Llama,
//! Llama 3.1 RoPE scaling, Qwen2, Qwen3, Gemma 3) in F32, Q8_0 and Q4_K (and Q2_K, Q3_K,
//! IQ4_NL, IQ4_XS and MXFP4 on one each, and random blocks of each grid i-quant): the test kit
//! writes each as GGUF, llama.cpp (the test kit's oracle, with an F16 KV cache as shoal
//! keeps) loads it, decodes a prompt and 8 greedy tokens, and shoal, fed the same tokens,
//! must give its logits at every prompt position and every generated step: every logit of
//! the generated steps and llama.cpp's top 8 at the prompt positions within a tolerance
//! relative to the step's scale, and the same argmax unless llama.cpp's own top two are
//! within that tolerance. Qwen3 and Llama 3.1 have no weights on the registries, so this is
//! their oracle.
//!
//! Tolerances, measured here (`-- --nocapture` prints them): F32 models differ by at most
//! 3.8e-4 of the scale (both sides round keys and values to f16, and f32 sums in other
//! orders can flip a rounding); quantized ones by up to 1.7e-2 (4.6e-2 on the K-quant
//! shapes), since both engines round activations to 8 bits from values that differ in the
//! last bits. Skipped without `SHOAL_LLAMA_LOGITS_BIN`, except
//! under CI, where it fails.

mod common;

use std::path::Path;
use std::sync::Arc;

use common::SwappedHeads;
use shoal_engine::weights::GgufWeights;
use shoal_engine::{arch, ModelConfig, Transformer};
use shoal_model::gguf::GgufFile;
use shoal_testkit::iquants::{write_grid_iquant_gguf, GridIquant};
use shoal_testkit::{require_oracle, Comparison, GgmlType, OracleRun, TinyModelSpec, Tolerance};

/// Prompt ids of the tiny tokenizer's vocabulary.
const PROMPT: [u32; 10] = [294, 267, 266, 278, 7, 300, 296, 12, 99, 42];

/// A prompt long enough for the batched prefill of the grid i-quants (sixteen rows or more
/// per product: their blocks unpacked once per batch on x86-64).
const LONG_PROMPT: [u32; 27] = [
    294, 267, 266, 278, 7, 300, 296, 12, 99, 42, 5, 61, 250, 17, 133, 208, 77, 3, 191, 240, 9, 160,
    31, 284, 120, 56, 1,
];

/// Tokens llama.cpp generates after the prompt.
const GENERATE: usize = 8;

/// F32 weights: both sides compute in f32 and round keys and values to f16, where a last-bit
/// difference can flip an f16 rounding (measured worst: 3.8e-4 of the scale).
const F32: Tolerance = Tolerance {
    rel_logit: 1e-3,
    near_tie: 1e-3,
};

/// F32 weights through GELU: llama.cpp reads GELU from an f16 table.
const F32_GELU: Tolerance = Tolerance {
    rel_logit: 3e-3,
    near_tie: 3e-3,
};

/// Quantized weights of the default shapes: 8-bit activations rounded from slightly
/// different values (measured worst: 1.7e-2 of the scale).
const QUANTIZED: Tolerance = Tolerance {
    rel_logit: 0.05,
    near_tie: 0.05,
};

/// Quantized weights of the K-quant shapes (256-wide rows): the same over longer dot
/// products (measured worst: 4.6e-2 of the scale).
const QUANTIZED_WIDE: Tolerance = Tolerance {
    rel_logit: 0.10,
    near_tie: 0.10,
};

fn open(path: &Path) -> (GgufFile, ModelConfig) {
    let file = GgufFile::open(path).unwrap();
    let vocab = file.tensor("token_embd.weight").unwrap().shape()[0];
    let cfg = arch::config_from_gguf(file.metadata(), vocab, "llamacpp test").unwrap();
    (file, cfg)
}

fn load(path: &Path) -> Transformer {
    let (file, cfg) = open(path);
    Transformer::load(&GgufWeights::new(file), cfg, Arc::new(shoal_comm::Solo)).unwrap()
}

/// llama.cpp's run of the test prompt on `path`.
fn oracle(bin: &Path, path: &Path) -> OracleRun {
    common::llama_run(bin, path, &PROMPT, GENERATE)
}

/// `t` against llama.cpp's `run` of the test prompt.
fn compare(t: &Transformer, run: &OracleRun, tol: Tolerance) -> (Comparison, Comparison) {
    common::compare_with_run(t, run, &PROMPT, tol)
}

fn cases() -> Vec<(TinyModelSpec, GgmlType, Tolerance)> {
    let mut v = Vec::new();
    for spec in [
        TinyModelSpec::llama(70),
        TinyModelSpec::llama31(71),
        TinyModelSpec::qwen2(72),
        TinyModelSpec::qwen3(73),
        TinyModelSpec::qwen3(74).tied(false),
    ] {
        v.push((spec.clone(), GgmlType::F32, F32));
        v.push((spec.clone(), GgmlType::Q8_0, QUANTIZED));
        v.push((spec.k_quant_shapes(), GgmlType::Q4_K, QUANTIZED_WIDE));
    }
    // the 2- and 3-bit K-quants big mixtures of experts are run at
    v.push((
        TinyModelSpec::llama(77).k_quant_shapes(),
        GgmlType::Q2_K,
        QUANTIZED_WIDE,
    ));
    v.push((
        TinyModelSpec::qwen3(78).k_quant_shapes(),
        GgmlType::Q3_K,
        QUANTIZED_WIDE,
    ));
    // the 4-bit grid types: IQ4_NL and MXFP4 (gpt-oss's experts) on 32-value blocks, IQ4_XS
    // on the K-quant shapes
    v.push((TinyModelSpec::qwen2(79), GgmlType::IQ4_NL, QUANTIZED));
    v.push((TinyModelSpec::qwen3(80), GgmlType::MXFP4, QUANTIZED));
    v.push((
        TinyModelSpec::llama(81).k_quant_shapes(),
        GgmlType::IQ4_XS,
        QUANTIZED_WIDE,
    ));
    v.push((TinyModelSpec::gemma3(75), GgmlType::F32, F32_GELU));
    v.push((TinyModelSpec::gemma3(76), GgmlType::Q8_0, QUANTIZED));
    v
}

#[test]
fn shoal_matches_llamacpp_on_every_architecture() {
    let Some(bin) = require_oracle("shoal_matches_llamacpp_on_every_architecture") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut failed = Vec::new();
    for (i, (spec, ty, tol)) in cases().into_iter().enumerate() {
        let label = format!("{} seed {} {ty:?}", spec.name, spec.seed);
        let m = spec.snapped_to(ty).build().unwrap();
        let path = dir.path().join(format!("{i}.gguf"));
        m.write_gguf(&path, ty).unwrap();
        let run = oracle(&bin, &path);
        let (generated, prompt) = compare(&load(&path), &run, tol);
        eprintln!(
            "{label}: worst |shoal - llama.cpp| {:.2e} of the scale over {} generated steps, \
             {:.2e} over {} prompt positions (tolerance {:e}); {} near-ties excused",
            generated.worst_rel,
            generated.steps,
            prompt.worst_rel,
            prompt.steps,
            tol.rel_logit,
            generated.excused.len() + prompt.excused.len()
        );
        for c in [generated, prompt] {
            if !c.passed() {
                failed.push(format!("{label}:\n  {}", c.failures.join("\n  ")));
            }
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// The grid i-quants, which the test kit writes as random blocks (see
/// `shoal_testkit::iquants`): a Llama and a Qwen3 on the K-quant shapes with every matrix
/// of each type, embedding and output included, give llama.cpp's logits, after the test
/// prompt and after one long enough for the batched prefill ([`LONG_PROMPT`]).
#[test]
fn grid_iquant_models_match_llamacpp() {
    let Some(bin) = require_oracle("grid_iquant_models_match_llamacpp") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut failed = Vec::new();
    for (i, ty) in GridIquant::ALL.into_iter().enumerate() {
        let spec = if i % 2 == 0 {
            TinyModelSpec::llama(90 + i as u64)
        } else {
            TinyModelSpec::qwen3(90 + i as u64)
        }
        .k_quant_shapes();
        let label = format!("{} seed {} {ty:?}", spec.name, spec.seed);
        let path = dir.path().join(format!("{ty:?}.gguf"));
        let turned = write_grid_iquant_gguf(&spec, ty, spec.seed, &path).unwrap();
        assert!(turned >= 9, "{label}: {turned} matrices turned");
        let model = load(&path);
        for tokens in [&PROMPT[..], &LONG_PROMPT[..]] {
            let run = common::llama_run(&bin, &path, tokens, GENERATE);
            let (generated, prompt) =
                common::compare_with_run(&model, &run, tokens, QUANTIZED_WIDE);
            eprintln!(
                "{label}: worst |shoal - llama.cpp| {:.2e} of the scale over {} generated steps, \
                 {:.2e} over {} prompt positions; {} near-ties excused; llama.cpp generated {:?}",
                generated.worst_rel,
                generated.steps,
                prompt.worst_rel,
                prompt.steps,
                generated.excused.len() + prompt.excused.len(),
                run.generated
            );
            for c in [generated, prompt] {
                if !c.passed() {
                    failed.push(format!("{label}:\n  {}", c.failures.join("\n  ")));
                }
            }
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// The comparison fails on planted faults: on an F32 Qwen3 model, shoal reading the file
/// with the RoPE base doubled, or with query heads 0 and 1 of every layer exchanged.
#[test]
fn planted_faults_fail_the_comparison() {
    let Some(bin) = require_oracle("planted_faults_fail_the_comparison") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("qwen3.gguf");
    TinyModelSpec::qwen3(73)
        .build()
        .unwrap()
        .write_gguf(&path, GgmlType::F32)
        .unwrap();
    let run = oracle(&bin, &path);
    let (g, p) = compare(&load(&path), &run, F32);
    assert!(g.passed() && p.passed(), "the model as it is");
    let solo = || Arc::new(shoal_comm::Solo);
    let (file, cfg) = open(&path);
    let doubled = ModelConfig {
        rope_theta: 2.0 * cfg.rope_theta,
        ..cfg.clone()
    };
    let wrong_base = Transformer::load(&GgufWeights::new(file), doubled, solo()).unwrap();
    let (file, _) = open(&path);
    let swapped = SwappedHeads {
        inner: GgufWeights::new(file),
        head_rows: cfg.head_dim,
        heads: (0, 1),
    };
    let wrong_heads = Transformer::load(&swapped, cfg, solo()).unwrap();
    for (what, t) in [
        ("RoPE base doubled", wrong_base),
        ("query heads 0 and 1 exchanged", wrong_heads),
    ] {
        let (g, p) = compare(&t, &run, F32);
        eprintln!(
            "{what}: {} failures, worst {:.2e} of the scale",
            g.failures.len() + p.failures.len(),
            g.worst_rel.max(p.worst_rel)
        );
        assert!(!g.passed() && !p.passed(), "{what} passed");
    }
}
