//! Mixtures of experts and latent attention, end to end: the test kit's tiny Qwen3 MoE,
//! Mixtral (GGUF `llama` with experts), DeepSeek V2 (softmax routing, shared experts, a
//! leading dense layer, latent attention with plain queries) and DeepSeek V3 (sigmoid
//! routing with a selection bias and group-limited top-k, compressed queries, YaRN) and GLM-4.5
//! (`glm4moe`: biased q/k/v with q/k norms, RoPE on half of each head, a leading dense layer,
//! sigmoid routing with a selection bias beside a shared expert, a multi-token-prediction
//! layer the decoder leaves out) and gpt-oss (biased attention with a sink per head, windowed
//! and full layers alternating, YaRN on both, biased experts chosen by their logits around the
//! clamped SwiGLU; F32, MXFP4 and Q8_0) written as GGUF and loaded through the engine's
//! ordinary path.
//!
//! - Against the test kit's f64 reference (which rounds what the engine's f16 cache rounds):
//!   F32 files within `F32_TOL` absolute, whole prompt, chunked and token by token.
//! - Against llama.cpp (the test kit's oracle, F16 KV cache), teacher-forced on its own
//!   greedy continuation as `llamacpp.rs` compares the dense architectures: F32, Q8_0 and
//!   Q4_K, with that file's tolerances (both engines round activations to 8 bits, so they
//!   stay closer to each other than to the f64 reference: measured worst 4.0e-4 of the
//!   scale at F32, 1.8e-2 at Q8_0, 5.9e-2 at Q4_K, DeepSeek V3). Quantized runs first check
//!   that the sequence's routing survives a change of the router's input scale quantized
//!   arithmetic could make (else a flipped expert could pass for a fault).
//! - Planted faults fail that comparison: routing that ignores the group limit, the
//!   selection bias or the weights' renormalisation, shared experts left out, YaRN left out,
//!   RoPE over GLM's whole head, GLM's q/k biases left out; gpt-oss's window ignored, its
//!   windowed layers' RoPE unscaled, a plain SwiGLU, a softmax over every expert.
//! - Malformed files are refused at load with a message naming the problem.

mod common;

use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::QTensor;
use shoal_engine::weights::{GgufWeights, RawMatrix, Slice, WeightSource};
use shoal_engine::{arch, EngineError, ModelConfig, Transformer};
use shoal_model::gguf::GgufFile;
use shoal_testkit::{
    require_oracle, Comparison, GgmlType, MoeFault, OracleRun, TinyModel, TinyModelSpec, Tolerance,
};

/// f32 engine vs the f64 reference on F32 files (as `tiny_models.rs` bounds the dense ones).
const F32_TOL: f32 = 1e-3;

/// A 12-token prompt (every id below the tiny vocabulary of 320).
const PROMPT: [u32; 12] = [1, 17, 250, 42, 99, 3, 311, 7, 128, 64, 200, 5];

/// Tokens llama.cpp generates after the prompt.
const GENERATE: usize = 8;

/// F32 against llama.cpp: both round keys (latents) to f16 from f32 sums in other orders.
const F32: Tolerance = Tolerance {
    rel_logit: 1e-3,
    near_tie: 1e-3,
};

/// Q8_0 on the default shapes (as `llamacpp.rs`).
const QUANTIZED: Tolerance = Tolerance {
    rel_logit: 0.05,
    near_tie: 0.05,
};

/// Q4_K on the K-quant shapes (as `llamacpp.rs`).
const QUANTIZED_WIDE: Tolerance = Tolerance {
    rel_logit: 0.10,
    near_tie: 0.10,
};

/// How far the router's input scale may move before the sequence's routing changes, at
/// least, for a quantized comparison to count (the test kit's `ROUTE_SCALE_MARGIN`).
const ROUTE_SCALE_MARGIN: f64 = 1.6e-2;

fn specs() -> [TinyModelSpec; 6] {
    [
        TinyModelSpec::qwen3moe(7),
        TinyModelSpec::mixtral(7),
        TinyModelSpec::deepseek2(7),
        TinyModelSpec::deepseek3(7),
        TinyModelSpec::glm4moe(7),
        TinyModelSpec::gpt_oss(7),
    ]
}

fn open(path: &Path) -> (GgufFile, ModelConfig) {
    let file = GgufFile::open(path).unwrap();
    let vocab = file.tensor("token_embd.weight").unwrap().shape()[0];
    let cfg = arch::config_from_gguf(file.metadata(), vocab, "moe test").unwrap();
    (file, cfg)
}

fn try_load(path: &Path) -> Result<Transformer, EngineError> {
    let file = GgufFile::open(path)?;
    let vocab = file.tensor("token_embd.weight")?.shape()[0];
    let cfg = arch::config_from_gguf(file.metadata(), vocab, &path.display().to_string())?;
    Transformer::load(&GgufWeights::new(file), cfg, Arc::new(shoal_comm::Solo))
}

fn load(path: &Path) -> Transformer {
    try_load(path).unwrap()
}

fn write(m: &TinyModel, dir: &Path, ty: GgmlType) -> std::path::PathBuf {
    let p = dir.join(format!("{}-{}-{ty:?}.gguf", m.spec().name, m.spec().seed));
    m.write_gguf(&p, ty).unwrap();
    p
}

/// Logits at every position, fed `chunks` tokens at a time.
fn chunked(t: &Transformer, ids: &[u32], chunks: &[usize]) -> Vec<Vec<f32>> {
    let mut cache = t.new_cache(64);
    let vocab = t.config().vocab;
    let mut out = Vec::new();
    let mut at = 0;
    for &n in chunks {
        let l = t.forward(&ids[at..at + n], &mut cache, n).unwrap();
        out.extend(l.chunks_exact(vocab).map(<[f32]>::to_vec));
        at += n;
    }
    out
}

fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| {
            assert!(x.is_finite() && y.is_finite(), "a non-finite logit");
            (x - y).abs()
        })
        .fold(0.0, f32::max)
}

#[test]
fn f32_files_match_the_reference_whole_chunked_and_token_by_token() {
    let dir = tempfile::tempdir().unwrap();
    for spec in specs() {
        let m = TinyModel::new(spec).unwrap();
        let t = load(&write(&m, dir.path(), GgmlType::F32));
        let want: Vec<Vec<f32>> = m.reference_logits_f16_kv(&PROMPT);
        let name = &m.spec().name;
        for chunks in [vec![12], vec![5, 4, 3], vec![1; 12]] {
            let got = chunked(&t, &PROMPT, &chunks);
            let d = max_abs_diff(&got, &want);
            eprintln!("{name}, chunks {chunks:?}: max |shoal - reference| {d:.2e}");
            assert!(d <= F32_TOL, "{name}, chunks {chunks:?}: {d} > {F32_TOL}");
        }
    }
}

/// The sequence's routing margin under a change of the router's input scale (see
/// [`ROUTE_SCALE_MARGIN`]).
fn route_margin(m: &TinyModel, run: &OracleRun) -> f64 {
    m.reference_route_scale_margins(&run.sequence())
        .into_iter()
        .fold(f64::INFINITY, f64::min)
}

/// llama.cpp's run of the test prompt on `path`.
fn oracle(bin: &Path, path: &Path) -> OracleRun {
    common::llama_run(bin, path, &PROMPT, GENERATE)
}

/// `t` against llama.cpp's `run` of the test prompt.
fn compare(t: &Transformer, run: &OracleRun, tol: Tolerance) -> (Comparison, Comparison) {
    common::compare_with_run(t, run, &PROMPT, tol)
}

fn oracle_cases() -> Vec<(TinyModelSpec, GgmlType, Tolerance)> {
    vec![
        (TinyModelSpec::qwen3moe(64), GgmlType::F32, F32),
        (TinyModelSpec::qwen3moe(65), GgmlType::Q8_0, QUANTIZED),
        (
            TinyModelSpec::qwen3moe(66).k_quant_shapes(),
            GgmlType::Q4_K,
            QUANTIZED_WIDE,
        ),
        // gpt-oss keeps its experts in MXFP4
        (TinyModelSpec::qwen3moe(79), GgmlType::MXFP4, QUANTIZED),
        (TinyModelSpec::mixtral(67), GgmlType::F32, F32),
        (TinyModelSpec::mixtral(68), GgmlType::Q8_0, QUANTIZED),
        (
            TinyModelSpec::mixtral(69).k_quant_shapes(),
            GgmlType::Q4_K,
            QUANTIZED_WIDE,
        ),
        (TinyModelSpec::deepseek2(70), GgmlType::F32, F32),
        (TinyModelSpec::deepseek2(71), GgmlType::Q8_0, QUANTIZED),
        (
            TinyModelSpec::deepseek2(72).k_quant_shapes(),
            GgmlType::Q4_K,
            QUANTIZED_WIDE,
        ),
        (TinyModelSpec::deepseek3(73), GgmlType::F32, F32),
        (TinyModelSpec::deepseek3(76), GgmlType::Q8_0, QUANTIZED),
        (
            TinyModelSpec::deepseek3(78).k_quant_shapes(),
            GgmlType::Q4_K,
            QUANTIZED_WIDE,
        ),
        (TinyModelSpec::glm4moe(84), GgmlType::F32, F32),
        // routers reading the whole hidden state: a token's experts depend on its context
        (
            TinyModelSpec::qwen3moe(64).routed_on_the_whole_state(),
            GgmlType::F32,
            F32,
        ),
        (
            TinyModelSpec::mixtral(67).routed_on_the_whole_state(),
            GgmlType::F32,
            F32,
        ),
        (
            TinyModelSpec::deepseek2(70).routed_on_the_whole_state(),
            GgmlType::F32,
            F32,
        ),
        (
            TinyModelSpec::deepseek3(73).routed_on_the_whole_state(),
            GgmlType::F32,
            F32,
        ),
        (
            TinyModelSpec::glm4moe(84).routed_on_the_whole_state(),
            GgmlType::F32,
            F32,
        ),
        (TinyModelSpec::glm4moe(89), GgmlType::Q8_0, QUANTIZED),
        (
            TinyModelSpec::glm4moe(86).k_quant_shapes(),
            GgmlType::Q4_K,
            QUANTIZED_WIDE,
        ),
        (TinyModelSpec::gpt_oss(91), GgmlType::F32, F32),
        // gpt-oss's tiny model carries 8-bit activation rounding further than the others
        // (both engines land 2.6e-2 to 4.7e-2 of the scale from the f64 reference on it)
        (TinyModelSpec::gpt_oss(92), GgmlType::MXFP4, QUANTIZED_WIDE),
        (TinyModelSpec::gpt_oss(93), GgmlType::Q8_0, QUANTIZED_WIDE),
    ]
}

#[test]
fn shoal_matches_llamacpp_on_every_moe_architecture() {
    let Some(bin) = require_oracle("shoal_matches_llamacpp_on_every_moe_architecture") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut failed = Vec::new();
    for (spec, ty, tol) in oracle_cases() {
        let m = spec.snapped_to(ty).build().unwrap();
        let whole = m.spec().moe.as_ref().is_some_and(|e| e.router_dims == 0);
        let label = format!(
            "{} seed {} {ty:?}{}",
            m.spec().name,
            m.spec().seed,
            if whole {
                " (routed on the whole state)"
            } else {
                ""
            }
        );
        let path = write(&m, dir.path(), ty);
        let run = oracle(&bin, &path);
        let margin = route_margin(&m, &run);
        if ty != GgmlType::F32 {
            assert!(
                margin >= ROUTE_SCALE_MARGIN,
                "{label}: the routing changes when the router's input scale moves by \
                 {margin:.1e}: a flipped expert could pass for a fault; pick another seed"
            );
        }
        let (generated, prompt) = compare(&load(&path), &run, tol);
        eprintln!(
            "{label}: worst |shoal - llama.cpp| {:.2e} of the scale over {} generated steps, \
             {:.2e} over {} prompt positions (tolerance {:e}); {} near-ties excused; routing \
             scale margin {margin:.1e}",
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

/// A GGUF file without the tensors `hidden` names (as if they were not in it).
struct Hidden {
    inner: GgufWeights,
    hidden: fn(&str) -> bool,
}

impl WeightSource for Hidden {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn contains(&self, name: &str) -> bool {
        !(self.hidden)(name) && self.inner.contains(name)
    }
    fn shape(&self, name: &str) -> Result<Vec<usize>, EngineError> {
        self.inner.shape(name)
    }
    fn load(&self, name: &str, slice: &Slice) -> Result<QTensor, EngineError> {
        self.inner.load(name, slice)
    }
    fn load_bytes(&self, name: &str, slice: &Slice) -> Result<Option<RawMatrix<'_>>, EngineError> {
        self.inner.load_bytes(name, slice)
    }
    fn stored_bytes(&self, name: &str) -> Result<u64, EngineError> {
        self.inner.stored_bytes(name)
    }
    fn block_len(&self, name: &str) -> Result<usize, EngineError> {
        self.inner.block_len(name)
    }
}

/// The comparison with llama.cpp fails when shoal routes or attends differently: each fault
/// is planted in how shoal reads an honest F32 file, which passes as it is.
#[test]
fn planted_moe_faults_fail_the_comparison() {
    let Some(bin) = require_oracle("planted_moe_faults_fail_the_comparison") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let solo = || Arc::new(shoal_comm::Solo);
    type Plant = fn(&mut ModelConfig);
    type Hide = fn(&str) -> bool;
    let cases: [(TinyModelSpec, &str, Option<Plant>, Option<Hide>); 12] = [
        (
            TinyModelSpec::mixtral(67),
            "the chosen experts' weights not renormalised",
            Some(|c| c.moe.as_mut().unwrap().norm_weights = false),
            None,
        ),
        (
            TinyModelSpec::deepseek3(73),
            "the group limit ignored",
            Some(|c| {
                let m = c.moe.as_mut().unwrap();
                m.groups = 1;
                m.groups_used = 1;
            }),
            None,
        ),
        (
            TinyModelSpec::deepseek3(73),
            "the selection bias ignored",
            None,
            Some(|n| n.ends_with("exp_probs_b.bias")),
        ),
        (
            TinyModelSpec::deepseek3(73),
            "YaRN left out",
            Some(|c| c.yarn = None),
            None,
        ),
        (
            TinyModelSpec::deepseek2(70),
            "shared experts left out",
            Some(|c| c.moe.as_mut().unwrap().n_shared = 0),
            None,
        ),
        (
            TinyModelSpec::glm4moe(84),
            "RoPE over the whole head",
            Some(|c| c.rope_dims = None),
            None,
        ),
        (
            TinyModelSpec::glm4moe(84),
            "the q/k biases left out",
            None,
            Some(|n| n.ends_with("attn_q.bias") || n.ends_with("attn_k.bias")),
        ),
        (
            TinyModelSpec::gpt_oss(91),
            "the sliding window ignored",
            Some(|c| c.sliding_window = None),
            None,
        ),
        (
            TinyModelSpec::gpt_oss(91),
            "the windowed layers' RoPE unscaled",
            Some(|c| c.sliding_rope_scaled = false),
            None,
        ),
        (
            TinyModelSpec::gpt_oss(91),
            "a plain SwiGLU for the clamped one",
            Some(|c| c.activation = shoal_engine::config::Activation::Silu),
            None,
        ),
        (
            TinyModelSpec::gpt_oss(91),
            "a softmax over every expert for one over the chosen",
            Some(|c| c.moe.as_mut().unwrap().gating = shoal_engine::config::Gating::Softmax),
            None,
        ),
        (
            TinyModelSpec::qwen3moe(64),
            "sigmoid routing for softmax",
            Some(|c| c.moe.as_mut().unwrap().gating = shoal_engine::config::Gating::Sigmoid),
            None,
        ),
    ];
    for (spec, what, plant, hidden) in cases {
        let m = spec.build().unwrap();
        let path = write(&m, dir.path(), GgmlType::F32);
        let run = oracle(&bin, &path);
        let (g, p) = compare(&load(&path), &run, F32);
        assert!(
            g.passed() && p.passed(),
            "{}: the honest model",
            m.spec().name
        );
        let (file, mut cfg) = open(&path);
        if let Some(plant) = plant {
            plant(&mut cfg);
        }
        let t = match hidden {
            Some(hidden) => Transformer::load(
                &Hidden {
                    inner: GgufWeights::new(file),
                    hidden,
                },
                cfg,
                solo(),
            ),
            None => Transformer::load(&GgufWeights::new(file), cfg, solo()),
        }
        .unwrap();
        let (g, p) = compare(&t, &run, F32);
        eprintln!(
            "{} with {what}: {} failures, worst {:.2e} of the scale",
            m.spec().name,
            g.failures.len() + p.failures.len(),
            g.worst_rel.max(p.worst_rel)
        );
        assert!(
            !(g.passed() && p.passed()),
            "{}: {what} passed the comparison",
            m.spec().name
        );
    }
}

/// Malformed mixture-of-experts files are refused at load, naming what is wrong.
#[test]
fn malformed_moe_files_are_refused_naming_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    for spec in specs() {
        let m = spec.build().unwrap();
        let name = m.spec().name.clone();
        for (fault, expect) in [
            (MoeFault::MissingExpertTensor, "ffn_up_exps"),
            (MoeFault::ExpertCountMismatch, "ffn_gate_inp"),
            (MoeFault::ExpertsUsedAboveCount, "expert_used_count"),
        ] {
            let p = dir.path().join(format!("{name}-{fault:?}.gguf"));
            m.moe_faulty_gguf_writer(GgmlType::F32, fault)
                .unwrap()
                .write_to(&p)
                .unwrap();
            let err = match try_load(&p) {
                Ok(_) => panic!("{name}: a file with {fault:?} loaded"),
                Err(e) => e.to_string(),
            };
            eprintln!("{name}, {fault:?}: {err}");
            assert!(err.contains(expect), "{name}, {fault:?}: {err}");
        }
    }
}

/// GLM files whose layer counts or rotated dimensions cannot work are refused at load,
/// naming the key.
#[test]
fn malformed_glm_files_are_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let m = TinyModelSpec::glm4moe(7).build().unwrap();
    for (key, value, expect) in [
        (
            "glm4moe.nextn_predict_layers",
            4u32,
            "nextn_predict_layers 4",
        ),
        ("glm4moe.rope.dimension_count", 48, "48"),
        ("glm4moe.rope.dimension_count", 15, "15"),
        ("glm4moe.rope.dimension_count", 0, "rope"),
    ] {
        let mut w = m.gguf_writer(GgmlType::F32).unwrap();
        w.set_kv(key, value);
        let p = dir.path().join(format!("glm-{value}.gguf"));
        w.write_to(&p).unwrap();
        let err = match try_load(&p) {
            Ok(_) => panic!("{key} = {value} loaded"),
            Err(e) => e.to_string(),
        };
        eprintln!("{key} = {value}: {err}");
        assert!(err.contains(expect), "{key} = {value}: {err}");
    }
}
