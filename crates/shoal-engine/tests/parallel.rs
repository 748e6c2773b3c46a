//! Split execution is exact: the test kit's tiny models (written as real GGUF, F32 and
//! quantized) and, when fetched, the real demo models, run on one rank and split over
//! ranks (tensor parallel, pipeline parallel, both), each rank a thread with its own shard,
//! talking through an in-process transport. Greedy tokens must be identical to one rank's.
//!
//! Logits: a pipeline split runs the same arithmetic in the same order as one rank, so its
//! logits are bit-identical. A tensor-parallel split sums each row-parallel product's partial
//! results across ranks, which rounds differently in f32: `TP_TOL` bounds the difference
//! relative to the largest logit (observed: about 1e-6 on the tiny models, 1e-5 on the real
//! ones; a wrong head mapping, cut or merge moves logits by 1e-1 or more).

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::model_path;
use shoal_comm::{mem_mesh, Transport};
use shoal_engine::parallel::{serve, Lead, RankContext, Want};
use shoal_engine::shard::{self, Layout};
use shoal_engine::weights::GgufWeights;
use shoal_engine::{arch, ModelConfig, Transformer};
use shoal_model::gguf::GgufFile;
use shoal_testkit::{GgmlType, TinyModelSpec};

/// Largest logit difference of a tensor-parallel split of a tiny model, relative to the
/// largest |logit|.
const TP_TOL: f32 = 1e-4;

/// Largest absolute logit difference of a tensor-parallel split of a real model.
const REAL_TP_TOL: f32 = 2.0;

/// A top-2 gap below which a real model's greedy choice may go either way under a
/// tensor-parallel split (the golden test's bound for llama.cpp against itself).
const NEAR_TIE: f32 = 0.15;

fn open(path: &Path) -> (GgufWeights, ModelConfig) {
    let file = GgufFile::open(path).unwrap();
    let vocab = file.tensor("token_embd.weight").unwrap().shape()[0];
    let cfg = arch::config_from_gguf(file.metadata(), vocab, "test").unwrap();
    (GgufWeights::new(file), cfg)
}

/// Greedy generation on one rank: the tokens and the logits that chose each.
fn one_rank(path: &Path, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let (src, cfg) = open(path);
    let m = Transformer::load(&src, cfg, Arc::new(shoal_comm::Solo)).unwrap();
    let mut cache = m.new_cache(prompt.len() + n + 1);
    let mut logits = m.forward_last(prompt, &mut cache).unwrap();
    let (mut tokens, mut all) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let id = shoal_engine::transformer::argmax(&logits) as u32;
        tokens.push(id);
        all.push(logits);
        logits = m.forward_last(&[id], &mut cache).unwrap();
    }
    (tokens, all)
}

/// Rank threads of a split: rank 0's context and model (for a [`Lead`]) and the other ranks
/// serving steps with caches of `capacity` tokens.
struct Ranks {
    ctx: RankContext,
    model: Transformer,
    workers: Vec<std::thread::JoinHandle<Result<(), shoal_engine::EngineError>>>,
}

impl Ranks {
    fn start(path: &Path, layout: Layout, capacity: usize) -> Ranks {
        let (src, cfg) = open(path);
        let plans = shard::plan(&cfg, &src, layout, None).unwrap();
        let transports: Vec<Arc<dyn Transport>> = mem_mesh(layout.world())
            .into_iter()
            .map(|t| Arc::new(t) as Arc<dyn Transport>)
            .collect();
        let mut workers = Vec::new();
        let mut lead_ctx = None;
        for (r, t) in transports.into_iter().enumerate() {
            let mut ctx = RankContext::over(t, layout, Duration::from_secs(60)).unwrap();
            ctx.plans = plans.clone();
            if r == 0 {
                lead_ctx = Some(ctx);
                continue;
            }
            let (path, cfg, plan) = (path.to_path_buf(), cfg.clone(), plans[r].clone());
            workers.push(std::thread::spawn(move || {
                let (src, _) = open(&path);
                let m = Transformer::load_shard(&src, cfg, plan, ctx.tp.clone()).unwrap();
                serve(&ctx, &m, capacity)
            }));
        }
        let ctx = lead_ctx.unwrap();
        let model = Transformer::load_shard(&src, cfg, plans[0].clone(), ctx.tp.clone()).unwrap();
        Ranks {
            ctx,
            model,
            workers,
        }
    }

    /// Stops the other ranks (the lead must be dropped first) and checks they ended well.
    fn join(self) {
        for w in self.workers {
            w.join().unwrap().unwrap();
        }
    }
}

/// Greedy generation split as `layout`: tokens and full logits (asking every rank for all
/// of its logits), and the tokens again asking only for each rank's best (the fast path).
fn split(
    path: &Path,
    layout: Layout,
    prompt: &[u32],
    n: usize,
) -> (Vec<u32>, Vec<Vec<f32>>, Vec<u32>) {
    let ranks = Ranks::start(path, layout, prompt.len() + n + 1);
    let mut lead = Lead::new(ranks.ctx.clone(), &ranks.model, prompt.len() + n + 1).unwrap();
    let greedy = |want: Want, lead: &mut Lead| {
        lead.truncate(0);
        let mut logits = lead.step_with(prompt, want).unwrap();
        let (mut tokens, mut all) = (Vec::new(), Vec::new());
        for _ in 0..n {
            let id = shoal_engine::transformer::argmax(&logits) as u32;
            tokens.push(id);
            all.push(logits);
            logits = lead.step_with(&[id], want).unwrap();
        }
        (tokens, all)
    };
    let (tokens, logits) = greedy(Want::All, &mut lead);
    let (fast, _) = greedy(Want::Best, &mut lead);
    lead.stop().unwrap();
    drop(lead);
    ranks.join();
    (tokens, logits, fast)
}

/// Checks every split of `layouts` against one rank. `quantized_tp_tol` is `None` for the
/// tiny models (every token must match, logits within `TP_TOL`), and for the real models
/// the absolute logit tolerance of a tensor-parallel split (see [`check_real`]), under which
/// tokens must match up to the first near-tie.
fn check(path: &Path, prompt: &[u32], n: usize, layouts: &[(usize, usize)], real_tol: Option<f32>) {
    let (want, want_logits) = one_rank(path, prompt, n);
    for &(tp, pp) in layouts {
        let (got, logits, fast) = split(path, Layout { tp, pp }, prompt, n);
        assert_eq!(
            got, fast,
            "tp {tp} pp {pp}: best-only replies give other tokens"
        );
        // the steps both runs took from the same context
        let same = match got.iter().zip(&want).position(|(a, b)| a != b) {
            None => n,
            Some(i) => {
                let mut v = want_logits[i].clone();
                v.sort_by(|a, b| b.total_cmp(a));
                let gap = v[0] - v[1];
                eprintln!("tp {tp} pp {pp}: tokens part at step {i}, one rank's top-2 gap {gap}");
                assert!(
                    real_tol.is_some() && tp > 1 && gap < NEAR_TIE,
                    "tp {tp} pp {pp}: greedy tokens differ at step {i} (gap {gap}):\n{got:?}\n{want:?}"
                );
                i + 1
            }
        };
        let scale = want_logits[..same]
            .iter()
            .flatten()
            .fold(0f32, |m, x| m.max(x.abs()));
        let diff = logits[..same]
            .iter()
            .flatten()
            .zip(want_logits[..same].iter().flatten())
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        eprintln!(
            "tp {tp} pp {pp}: {same} of {n} tokens identical; max logit difference {diff:.3e} \
             (largest |logit| {scale:.2})"
        );
        if tp == 1 {
            assert_eq!(
                diff, 0.0,
                "tp 1 pp {pp}: a pipeline split must be bit-exact"
            );
        } else {
            let tol = real_tol.unwrap_or(TP_TOL * scale);
            assert!(
                diff <= tol,
                "tp {tp} pp {pp}: logits differ by {diff} > {tol}"
            );
        }
    }
}

const PROMPT: [u32; 12] = [1, 17, 250, 42, 99, 3, 311, 7, 128, 64, 200, 5];

const LAYOUTS: [(usize, usize); 8] = [
    (1, 1),
    (2, 1),
    (3, 1),
    (4, 1),
    (1, 2),
    (1, 3),
    (1, 4),
    (2, 2),
];

fn tiny(spec: TinyModelSpec, ty: GgmlType, dir: &Path) -> PathBuf {
    let m = spec.build().unwrap();
    let p = dir.join(format!("{ty:?}.gguf"));
    m.write_gguf(&p, ty).unwrap();
    p
}

#[test]
fn tiny_f32_every_split_matches_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    // 4 layers so 4 stages each get one; 4 heads over 2 KV heads so TP 3 and 4 share KV heads
    let spec = TinyModelSpec {
        n_layers: 4,
        ..TinyModelSpec::llama(7)
    };
    check(
        &tiny(spec, GgmlType::F32, dir.path()),
        &PROMPT,
        8,
        &LAYOUTS,
        None,
    );
}

#[test]
fn tiny_quantized_every_split_matches_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    // head_dim 32: each head's columns of the attention output are one Q8_0 block, so 4
    // heads can go to 4 ranks
    let spec = TinyModelSpec {
        n_layers: 4,
        head_dim: 32,
        ..TinyModelSpec::qwen2(11)
    }
    .snapped_to(GgmlType::Q8_0);
    check(
        &tiny(spec, GgmlType::Q8_0, dir.path()),
        &PROMPT,
        8,
        &LAYOUTS,
        None,
    );
}

#[test]
fn tiny_gemma3_windows_split() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinyModelSpec {
        n_layers: 4,
        ..TinyModelSpec::gemma3(5)
    };
    check(
        &tiny(spec, GgmlType::F32, dir.path()),
        &PROMPT,
        8,
        &[(2, 1), (4, 1), (1, 2), (2, 2)],
        None,
    );
}

#[test]
fn tiny_k_quant_split() {
    let dir = tempfile::tempdir().unwrap();
    // 8 heads of 64: the attention output's 512 columns are two 256-wide K-quant blocks,
    // so each of 2 ranks gets 4 heads (the cut must fall on a block)
    let spec = TinyModelSpec {
        n_layers: 2,
        n_head: 8,
        ..TinyModelSpec::llama(3).k_quant_shapes()
    }
    .snapped_to(GgmlType::Q4_K);
    check(
        &tiny(spec, GgmlType::Q4_K, dir.path()),
        &PROMPT,
        6,
        &[(2, 1), (1, 2)],
        None,
    );
}

/// Sampling through a split: top-k sampling (each last-stage rank sends its top k) and
/// sampling with a repetition penalty (every logit is sent) draw the tokens one rank draws
/// with the same seed.
#[test]
fn sampled_tokens_match_one_rank() {
    use shoal_engine::{Sampler, SamplerConfig};
    let dir = tempfile::tempdir().unwrap();
    let spec = TinyModelSpec {
        n_layers: 4,
        ..TinyModelSpec::qwen2(9)
    };
    let path = tiny(spec, GgmlType::F32, dir.path());
    let configs = [
        SamplerConfig {
            temperature: 1.0,
            top_k: 20,
            seed: 5,
            ..Default::default()
        },
        SamplerConfig {
            temperature: 0.8,
            top_p: 0.9,
            repeat_penalty: 1.3,
            seed: 6,
            ..Default::default()
        },
    ];
    let n = 16;
    for cfg_s in configs {
        let want = {
            let (src, cfg) = open(&path);
            let m = Transformer::load(&src, cfg, Arc::new(shoal_comm::Solo)).unwrap();
            let mut cache = m.new_cache(64);
            let mut sampler = Sampler::new(cfg_s.clone());
            sampler.observe(&PROMPT);
            let mut logits = m.forward_last(&PROMPT, &mut cache).unwrap();
            let mut out = Vec::new();
            for _ in 0..n {
                let id = sampler.sample(&mut logits);
                out.push(id);
                logits = m.forward_last(&[id], &mut cache).unwrap();
            }
            out
        };
        for (tp, pp) in [(2, 1), (1, 2), (2, 2)] {
            let ranks = Ranks::start(&path, Layout { tp, pp }, 64);
            let mut lead = Lead::new(ranks.ctx.clone(), &ranks.model, 64).unwrap();
            lead.set_sampler(&cfg_s);
            let mut sampler = Sampler::new(cfg_s.clone());
            sampler.observe(&PROMPT);
            let mut logits = shoal_engine::generate::Stepper::step(&mut lead, &PROMPT).unwrap();
            let mut got = Vec::new();
            for _ in 0..n {
                let id = sampler.sample(&mut logits);
                got.push(id);
                logits = shoal_engine::generate::Stepper::step(&mut lead, &[id]).unwrap();
            }
            lead.stop().unwrap();
            drop(lead);
            ranks.join();
            assert_eq!(got, want, "tp {tp} pp {pp}, {cfg_s:?}");
        }
    }
}

/// Three sequences decoded round-robin with all of them in flight (each submitted before
/// the previous is collected) give the tokens each gives alone on one rank.
#[test]
fn sequences_in_flight_match_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinyModelSpec {
        n_layers: 4,
        ..TinyModelSpec::llama(8)
    };
    let path = tiny(spec, GgmlType::F32, dir.path());
    let prompts: [&[u32]; 3] = [&PROMPT, &[5, 6, 7], &[300, 2, 99, 41, 8]];
    let n = 10;
    let want: Vec<Vec<u32>> = prompts.iter().map(|p| one_rank(&path, p, n).0).collect();
    for (tp, pp) in [(1, 2), (1, 3), (2, 2), (2, 1)] {
        let ranks = Ranks::start(&path, Layout { tp, pp }, 64);
        let mut lead = Lead::with_sequences(ranks.ctx.clone(), &ranks.model, 64, 3).unwrap();
        for (seq, p) in prompts.iter().enumerate() {
            lead.submit(seq, p, Want::Best).unwrap();
        }
        let mut got = vec![Vec::new(); 3];
        while got.iter().any(|g| g.len() < n) {
            let (seq, logits) = lead.collect().unwrap();
            let id = shoal_engine::transformer::argmax(&logits) as u32;
            got[seq].push(id);
            if got[seq].len() < n {
                lead.submit(seq, &[id], Want::Best).unwrap();
            }
        }
        lead.stop().unwrap();
        drop(lead);
        ranks.join();
        assert_eq!(got, want, "tp {tp} pp {pp}: interleaved sequences");
    }
}

/// The real demo models at TP 2 and 3, PP 2 and 3, and TP 2 x PP 2: 24 greedy tokens after a
/// chat-free prompt, identical to one rank's.
///
/// A pipeline split is bit-exact. A tensor-parallel split is not: each rank sums its share
/// of a row-parallel product, and the all-reduce adds the shares, so f32 rounding differs
/// from one rank's single running sum in the last bit (measured after SmolLM2's first layer:
/// 7.6e-6 on values up to 39). These models' hidden states carry outlier features (SmolLM2's
/// reach 24,860 by layer 15), and the kernels quantize activations to 8 bits per block of
/// 32: a last-bit change moves a quantized value by a whole step when it sits near a
/// rounding boundary, and layers compound it. Logits then differ by up to 0.5 (qwen05) and
/// 1.1 (SmolLM2) of values up to 24 and 38, the same order as llama.cpp's two attention
/// configurations differ from each other (see `golden.rs`). So tokens must match until the
/// first step where one rank's two best logits are within `NEAR_TIE`, where either choice is
/// a coin toss of rounding.
fn check_real(key: &str) {
    let Some(path) = model_path(key) else { return };
    let file = GgufFile::open(&path).unwrap();
    let tok = shoal_model::tokenizer::Tokenizer::from_gguf(file.metadata()).unwrap();
    let prompt = tok.encode("The capital of France is", true, false).unwrap();
    check(
        &path,
        &prompt,
        24,
        &[(2, 1), (3, 1), (1, 2), (1, 3), (2, 2)],
        Some(REAL_TP_TOL),
    );
}

#[test]
fn smollm2_splits_match_one_rank() {
    check_real("smollm2");
}

#[test]
fn qwen05_splits_match_one_rank() {
    check_real("qwen05");
}
