//! Drafting with a model's own multi-token-prediction layer (GLM-4.5's `nextn` layer), on the
//! test kit's tiny GLM written as GGUF (its fourth block and `nextn.*` tensors):
//! - the layer's logits equal the test kit's f64 reference of it (`reference_mtp_logits`),
//!   over a whole prompt, in chunks, and for drafts chained past the prompt; the same
//!   comparison fails when the hidden states are paired with the wrong tokens;
//! - decoding with its drafts gives plain decoding's tokens, greedy and seeded, with every
//!   draft checked or as many as pay, and from a prompt that starts another's cache;
//! - a layer built to predict exactly what the model will say (every block's output
//!   projections zero, so the model maps each token to the next on its own, and the layer
//!   reading only the token) has every draft taken; one that reads only the hidden state
//!   drafts the next token again, and has exactly the drafts taken that the output says
//!   (which checks that each hidden state goes with its own position);
//! - a model without the layer is refused, naming what to use instead;
//! - on a split (tensor, pipeline and both), with the layer held on the lead and the split's
//!   steps returning their rows' hidden states: the same tokens as one rank decoding plainly,
//!   greedy and seeded, and for the layer that reads only the hidden state exactly the drafts
//!   taken that the output says, two sequences at once (which checks that each row's hidden
//!   state comes back to its own sequence and position).
//!
//! The llama.cpp built from the PyPI sdist loads GLM's prediction layer but does not draft
//! with it, so it is no oracle here.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use shoal_engine::model::LoadedModel;
use shoal_engine::scheduler::{Event, Scheduler, SchedulerConfig, SequenceRequest};
use shoal_engine::shard::Layout;
use shoal_engine::transformer::argmax;
use shoal_engine::SamplerConfig;
use shoal_model::source::ModelSource;
use shoal_testkit::{GgmlType, TinyModel, TinyModelSpec};

/// f32 engine against the f64 reference on F32 files (as `moe.rs` bounds the model).
const F32_TOL: f32 = 1e-3;

/// A 12-token prompt (every id below the tiny vocabulary of 320).
const PROMPT: [u32; 12] = [1, 17, 250, 42, 99, 3, 311, 7, 128, 64, 200, 5];

fn write(m: &TinyModel, dir: &Path, ty: GgmlType) -> PathBuf {
    let p = dir.join(format!("{}-{}-{ty:?}.gguf", m.spec().name, m.spec().seed));
    m.write_gguf(&p, ty).unwrap();
    p
}

fn load(path: &Path) -> LoadedModel {
    LoadedModel::load_with_mtp(&ModelSource::Gguf(path.to_path_buf())).unwrap()
}

fn max_abs_diff(a: &[f32], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.iter().map(Vec::len).sum::<usize>());
    a.iter()
        .zip(b.iter().flatten())
        .map(|(x, y)| {
            assert!(x.is_finite(), "a non-finite logit");
            (x - y).abs()
        })
        .fold(0.0, f32::max)
}

/// The layer's logits over `PROMPT` fed `chunks` rows at a time, then `chained` drafts past
/// it, each from the row before: the rows `reference_mtp_logits(&PROMPT, chained)` gives.
/// With `misaligned`, each hidden state goes with the token one further on.
fn engine_mtp(m: &LoadedModel, chunks: &[usize], chained: usize, misaligned: bool) -> Vec<f32> {
    let t = &m.transformer;
    let h = t.config().hidden;
    let mut cache = t.new_cache(64);
    let n = PROMPT.len();
    let (_, hidden) = t.step_hidden(&PROMPT, &[n], &mut [&mut cache], 1).unwrap();
    assert_eq!(hidden.len(), n * h);
    let mut mtp = t
        .new_mtp_cache(64)
        .expect("the tiny GLM has a prediction layer");
    let mut out = Vec::new();
    let mut at = 0;
    let mut last = (Vec::new(), Vec::new());
    for &c in chunks {
        let tokens: Vec<u32> = if misaligned {
            (at..at + c).map(|i| PROMPT[(i + 2).min(n - 1)]).collect()
        } else {
            PROMPT[at + 1..at + 1 + c].to_vec()
        };
        let rows = hidden[at * h..(at + c) * h].to_vec();
        last = t.mtp_step(rows, &tokens, &[c], &mut [&mut mtp], c).unwrap();
        out.extend_from_slice(&last.0);
        at += c;
    }
    assert_eq!(at, n - 1);
    let vocab = t.config().vocab;
    for _ in 0..chained {
        let (logits, state) = &last;
        let token = argmax(&logits[logits.len() - vocab..]) as u32;
        let state = state[state.len() - h..].to_vec();
        last = t
            .mtp_step(state, &[token], &[1], &mut [&mut mtp], 1)
            .unwrap();
        out.extend_from_slice(&last.0);
    }
    out
}

#[test]
fn the_prediction_layer_matches_the_reference() {
    let dir = tempfile::tempdir().unwrap();
    let tm = TinyModel::new(TinyModelSpec::glm4moe(7)).unwrap();
    let m = load(&write(&tm, dir.path(), GgmlType::F32));
    assert!(m.transformer.has_mtp());
    let want = tm.reference_mtp_logits(&PROMPT, 3);
    assert_eq!(want.len(), PROMPT.len() - 1 + 3);
    let plain = &want[..PROMPT.len() - 1];
    for chunks in [vec![11], vec![5, 6], vec![1; 11]] {
        let d = max_abs_diff(&engine_mtp(&m, &chunks, 0, false), plain);
        eprintln!("chunks {chunks:?}: max |shoal - reference| {d:.2e}");
        assert!(d <= F32_TOL, "chunks {chunks:?}: {d} > {F32_TOL}");
    }
    let d = max_abs_diff(&engine_mtp(&m, &[11], 3, false), &want);
    eprintln!("3 chained drafts: max |shoal - reference| {d:.2e}");
    assert!(d <= F32_TOL, "chained: {d} > {F32_TOL}");
    // the comparison sees a hidden state paired with the wrong token
    let d = max_abs_diff(&engine_mtp(&m, &[11], 0, true), plain);
    eprintln!("misaligned (planted fault): max |shoal - reference| {d:.2e}");
    assert!(d > 100.0 * F32_TOL, "a misaligned layer passed: {d}");
}

fn request(prompt: Vec<u32>, max_tokens: usize, sampler: SamplerConfig) -> SequenceRequest {
    SequenceRequest {
        prompt,
        max_tokens,
        sampler,
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        stop: Vec::new(),
        logprobs: None,
        constraint: None,
        ignore_eos: true,
        special_text: false,
        resume: Vec::new(),
        report_resumed: false,
    }
}

fn run(sched: &Scheduler, r: SequenceRequest) -> Vec<u32> {
    run_all(sched, vec![r]).remove(0)
}

/// The scheduler's (drafted, taken, decode steps), once it counted `steps` steps or a second
/// passed (a step is counted after its events went out).
fn draft_counts(sched: &Scheduler, steps: u64) -> (u64, u64, u64) {
    let s = sched.stats();
    let t0 = Instant::now();
    while s.decode_steps.load(Ordering::Acquire) < steps && t0.elapsed() < Duration::from_secs(1) {
        std::thread::sleep(Duration::from_millis(5));
    }
    (
        s.drafted.load(Ordering::Relaxed),
        s.accepted_drafts.load(Ordering::Relaxed),
        s.decode_steps.load(Ordering::Relaxed),
    )
}

/// A scheduler of `m` with `config`'s limits and no speculation: what drafting must equal.
fn plain_scheduler(m: &Arc<LoadedModel>, config: SchedulerConfig) -> Scheduler {
    Scheduler::start(
        m.clone(),
        SchedulerConfig {
            draft_max: 0,
            ..config
        },
    )
    .unwrap()
}

const CONFIG: SchedulerConfig = SchedulerConfig {
    max_batch: 2,
    max_queue: 4,
    ctx: 1024,
    prefix_cache: false,
    draft_max: 3,
    adaptive_drafts: false,
};

#[test]
fn drafting_with_the_prediction_layer_gives_the_same_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinyModelSpec {
        context_length: 1024,
        ..TinyModelSpec::glm4moe(9)
    };
    let tm = TinyModel::new(spec).unwrap();
    let m = Arc::new(load(&write(&tm, dir.path(), GgmlType::Q8_0)));
    // a long prompt: the layer reads it chunk by chunk beside the model
    let prompt: Vec<u32> = (0..700).map(|i| (i * 17 + 3) % 320).collect();
    for sampler in [
        SamplerConfig::default(),
        SamplerConfig {
            temperature: 0.9,
            seed: 5,
            ..SamplerConfig::default()
        },
    ] {
        let plain = plain_scheduler(&m, CONFIG);
        let want = run(&plain, request(prompt.clone(), 40, sampler.clone()));
        let fixed = Scheduler::start_with_mtp(m.clone(), CONFIG).unwrap();
        assert_eq!(
            run(&fixed, request(prompt.clone(), 40, sampler.clone())),
            want,
            "{sampler:?}"
        );
        let (drafted, taken, steps) = draft_counts(&fixed, 1);
        eprintln!("{sampler:?}: {drafted} drafted, {taken} taken in {steps} steps");
        // every step drafts 3 but the last three, which have fewer tokens left to make
        assert!(
            drafted >= 3 * (steps - 3),
            "{drafted} drafted in {steps} steps"
        );
        let adaptive = Scheduler::start_with_mtp(
            m.clone(),
            SchedulerConfig {
                adaptive_drafts: true,
                ..CONFIG
            },
        )
        .unwrap();
        assert_eq!(
            run(&adaptive, request(prompt.clone(), 40, sampler.clone())),
            want,
            "{sampler:?}, adaptive drafts"
        );
    }
    // two sequences at once, the second starting from the first's cache
    let shared = SchedulerConfig {
        prefix_cache: true,
        ..CONFIG
    };
    let plain = plain_scheduler(&m, shared);
    let with = Scheduler::start_with_mtp(m.clone(), shared).unwrap();
    let mut other = prompt.clone();
    other.extend([5, 6, 7]);
    for p in [&prompt, &other] {
        let want = run(&plain, request(p.clone(), 24, SamplerConfig::default()));
        assert_eq!(
            run(&with, request(p.clone(), 24, SamplerConfig::default())),
            want
        );
    }
}

/// The test kit's GLM whose prediction layer foresees the model
/// ([`TinyModel::foreseeing`]): every draft it makes is taken.
fn foresighted(seed: u64) -> TinyModel {
    TinyModel::foreseeing(TinyModelSpec::glm4moe(seed)).unwrap()
}

#[test]
fn a_layer_that_foresees_the_model_has_every_draft_taken() {
    let dir = tempfile::tempdir().unwrap();
    let m = Arc::new(load(&write(&foresighted(11), dir.path(), GgmlType::F32)));
    let config = SchedulerConfig {
        max_batch: 1,
        draft_max: 4,
        ..CONFIG
    };
    let prompt: Vec<u32> = (0..20).map(|i| (i * 13 + 5) % 320).collect();
    let plain = plain_scheduler(&m, config);
    let with = Scheduler::start_with_mtp(m.clone(), config).unwrap();
    let want = run(
        &plain,
        request(prompt.clone(), 41, SamplerConfig::default()),
    );
    assert_eq!(
        run(&with, request(prompt, 41, SamplerConfig::default())),
        want
    );
    // 40 tokens after the first: 8 steps of 1 + 4
    assert_eq!(draft_counts(&with, 8), (32, 32, 8));
}

/// [`foresighted`]'s model with a prediction layer that reads only the hidden state: from
/// the model's output at a position it predicts what the model predicted there (the
/// token at the next position, not the one after), so it drafts the sequence's next token
/// again and again. Which of those drafts are taken follows from the output alone, and
/// pairing a hidden state with the wrong position would draft the token after instead.
fn hindsighted(seed: u64) -> TinyModel {
    let mut tm = foresighted(seed);
    let h = tm.spec().hidden_size;
    let l = tm.spec().n_layers;
    for (name, w) in tm.weights_mut().iter_mut() {
        if name == &format!("model.layers.{l}.eh_proj.weight") {
            for r in 0..h {
                for c in 0..2 * h {
                    w.data[r * 2 * h + c] = if c == h + r { 1.0 } else { 0.0 };
                }
            }
        }
        // a norm of weight 1 scales the model's normed output; the head's choice stays
        if name == &format!("model.layers.{l}.hnorm.weight")
            || name == &format!("model.layers.{l}.shared_head.norm.weight")
        {
            w.data.fill(1.0);
        }
    }
    tm
}

/// A [`hindsighted`] model written in `dir` and two last prompt tokens whose continuation
/// changes a few times, then repeats one token (the model maps a token to the next whatever
/// came before it).
fn settling_hindsighted(dir: &Path) -> (PathBuf, [u32; 2]) {
    (13..40)
        .find_map(|seed| {
            let path = write(&hindsighted(seed), dir, GgmlType::F32);
            let m = load(&path);
            let t = &m.transformer;
            let next: Vec<u32> = (0..t.config().vocab as u32)
                .map(|x| argmax(&t.forward_last(&[x], &mut t.new_cache(4)).unwrap()) as u32)
                .collect();
            let settles = |x: u32| {
                let mut y = x;
                (0..20).position(|_| {
                    y = next[y as usize];
                    next[y as usize] == y
                })
            };
            let mut starts = (0..next.len() as u32).filter(|&x| settles(x).is_some_and(|s| s >= 3));
            Some((path, [starts.next()?, starts.next()?]))
        })
        .expect("a seed whose model settles on a token")
}

/// What fixed drafts of `k` tokens with a [`hindsighted`] layer give for output `out`
/// (drafted, taken, steps): each step runs the next token and drafts it again as often as
/// tokens are left, and the drafts taken are the repeats that follow.
fn hindsight_counts(out: &[u32], k: usize) -> (u64, u64, u64) {
    let n = out.len();
    let (mut drafted, mut taken, mut steps, mut at) = (0, 0, 0, 0);
    while at < n - 1 {
        let d = k.min(n - at - 2);
        let t = (1..=d).take_while(|&j| out[at + j] == out[at]).count();
        drafted += d as u64;
        taken += t as u64;
        steps += 1;
        at += 1 + t;
    }
    (drafted, taken, steps)
}

#[test]
fn the_layer_reads_each_positions_own_hidden_state() {
    let dir = tempfile::tempdir().unwrap();
    let (path, starts) = settling_hindsighted(dir.path());
    let (m, start) = (Arc::new(load(&path)), starts[0]);
    let (k, n) = (3, 41);
    let config = SchedulerConfig {
        max_batch: 1,
        draft_max: k,
        prefix_cache: true,
        ..CONFIG
    };
    let with = Scheduler::start_with_mtp(m.clone(), config).unwrap();
    let plain = plain_scheduler(&m, config);
    let mut prompt: Vec<u32> = (0..20).map(|i| (i * 7 + 2) % 320).collect();
    prompt.push(start);
    let mut seen = (0, 0, 0);
    // the second request starts from the first one's kept cache, which the prediction
    // layer had read to one position short of its end: it takes one position less and
    // runs it again
    for turn in 0..2 {
        let out = run(&with, request(prompt.clone(), n, SamplerConfig::default()));
        assert_eq!(
            run(&plain, request(prompt.clone(), n, SamplerConfig::default())),
            out
        );
        let (drafted, taken, steps) = hindsight_counts(&out, k);
        eprintln!("turn {turn}, output {out:?}: {drafted} drafted, {taken} taken in {steps} steps");
        assert_ne!(
            taken, 0,
            "the output never repeats a token: pick another seed"
        );
        assert_ne!(drafted, taken, "the output is one token: pick another seed");
        let now = draft_counts(&with, seen.2 + steps);
        let got = (now.0 - seen.0, now.1 - seen.1, now.2 - seen.2);
        assert_eq!(got, (drafted, taken, steps), "turn {turn}");
        seen = now;
        let hits = with.stats().prefix_hits.load(Ordering::Relaxed);
        assert_eq!(hits, turn, "turn {turn} starts from the kept cache");
        // the next turn: this one's prompt and the first tokens of its answer, then more
        prompt.extend_from_slice(&out[..3]);
        prompt.push(start);
    }
}

#[test]
fn a_model_without_the_layer_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let tm = TinyModel::new(TinyModelSpec::qwen3moe(3)).unwrap();
    let m = Arc::new(load(&write(&tm, dir.path(), GgmlType::F32)));
    assert!(!m.transformer.has_mtp());
    let e = Scheduler::start_with_mtp(m.clone(), CONFIG).unwrap_err();
    assert!(
        e.to_string().contains("no multi-token-prediction layer"),
        "{e}"
    );
    assert!(e.to_string().contains("prompt lookup"), "{e}");
    let glm = TinyModel::new(TinyModelSpec::glm4moe(3)).unwrap();
    let glm = Arc::new(load(&write(&glm, dir.path(), GgmlType::F32)));
    let e = Scheduler::start_with_mtp(
        glm,
        SchedulerConfig {
            draft_max: 0,
            ..CONFIG
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("speculation on"), "{e}");
    // a model loaded the ordinary way leaves its layer out
    let path = write(
        &TinyModel::new(TinyModelSpec::glm4moe(3)).unwrap(),
        dir.path(),
        GgmlType::F32,
    );
    let plain = Arc::new(LoadedModel::load(&ModelSource::Gguf(path)).unwrap());
    assert!(!plain.transformer.has_mtp());
    let e = Scheduler::start_with_mtp(plain, CONFIG).unwrap_err();
    assert!(e.to_string().contains("loaded without"), "{e}");
}

/// The tokens of every request, all submitted to `sched` at once.
fn run_all(sched: &Scheduler, requests: Vec<SequenceRequest>) -> Vec<Vec<u32>> {
    let rxs: Vec<_> = requests
        .into_iter()
        .map(|r| {
            let (tx, rx) = mpsc::channel();
            let t = sched
                .submit(r, Box::new(move |e| tx.send(e).is_ok()))
                .unwrap();
            (t, rx)
        })
        .collect();
    rxs.iter()
        .map(|(_, rx)| {
            let mut toks = Vec::new();
            loop {
                match rx
                    .recv_timeout(Duration::from_secs(60))
                    .expect("events within 60 s")
                {
                    Event::Token { id, .. } => toks.push(id),
                    Event::Text(_) => {}
                    Event::Done(_) => return toks,
                    Event::Failed(e) | Event::Interrupted(e) => panic!("failed: {e}"),
                }
            }
        })
        .collect()
}

/// Runs `f` on a scheduler leading `layout`'s ranks of `path` (in-process channels) and
/// drafting with the model's prediction layer, held on the lead apart from rank 0's share
/// (with `config.draft_max` 0, decoding plainly); then checks that the split did not fail
/// and that every rank stopped cleanly.
fn on_split<T>(
    path: &Path,
    layout: Layout,
    config: SchedulerConfig,
    f: impl FnOnce(&Scheduler) -> T,
) -> T {
    let source = ModelSource::Gguf(path.to_path_buf());
    let (ctx, m, workers) = common::split_ranks(&source, layout, config.ctx);
    let sched = if config.draft_max == 0 {
        Scheduler::start_split(Arc::new(m), ctx, config).unwrap()
    } else {
        let layer = Arc::new(LoadedModel::load_prediction_layer(&source).unwrap());
        assert!(layer.transformer.has_mtp());
        assert!(layer.transformer.plan().layers.is_empty());
        Scheduler::start_split_with_mtp(Arc::new(m), ctx, layer, config).unwrap()
    };
    let out = f(&sched);
    assert!(
        sched.failure().is_none(),
        "{layout:?}: {:?}",
        sched.failure()
    );
    drop(sched);
    for w in workers {
        w.join().unwrap().unwrap();
    }
    out
}

/// Tensor, pipeline and both.
const LAYOUTS: [Layout; 3] = [
    Layout { tp: 2, pp: 1 },
    Layout { tp: 1, pp: 2 },
    Layout { tp: 2, pp: 2 },
];

#[test]
fn split_drafting_with_the_prediction_layer_gives_one_ranks_tokens() {
    let dir = tempfile::tempdir().unwrap();
    // experts of two 32-blocks, so that two tensor-parallel ranks can cut them
    let glm = TinyModelSpec::glm4moe(9);
    let spec = TinyModelSpec {
        context_length: 1024,
        moe: glm.moe.clone().map(|m| shoal_testkit::MoeSpec {
            expert_ffn: 64,
            ..m
        }),
        ..glm
    };
    let tm = TinyModel::new(spec).unwrap();
    let path = write(&tm, dir.path(), GgmlType::Q8_0);
    let m = Arc::new(load(&path));
    // a prompt of two chunks, and a second one that starts as the first
    let prompt: Vec<u32> = (0..600).map(|i| (i * 17 + 3) % 320).collect();
    let mut other = prompt.clone();
    other.extend([5, 6, 7]);
    let samplers = [
        SamplerConfig::default(),
        // a penalty: every logit of every row comes back
        SamplerConfig {
            temperature: 0.9,
            seed: 5,
            repeat_penalty: 1.1,
            ..SamplerConfig::default()
        },
    ];
    let config = SchedulerConfig {
        prefix_cache: true,
        ..CONFIG
    };
    let generate = |sched: &Scheduler| -> Vec<Vec<u32>> {
        samplers
            .iter()
            .flat_map(|s| [&prompt, &other].map(|p| run(sched, request(p.clone(), 30, s.clone()))))
            .collect()
    };
    let one_rank = generate(&plain_scheduler(&m, config));
    for layout in LAYOUTS {
        // the split decoding plainly: greedy, one rank's tokens; seeded, one rank's up to a
        // draw on the edge between two tokens, where the split's rounding may tip it (this
        // model's fourth request does so on tp2)
        let plain = on_split(
            &path,
            layout,
            SchedulerConfig {
                draft_max: 0,
                ..config
            },
            generate,
        );
        assert_eq!(plain[..2], one_rank[..2], "{layout:?}");
        for adaptive_drafts in [false, true] {
            let config = SchedulerConfig {
                adaptive_drafts,
                ..config
            };
            on_split(&path, layout, config, |sched| {
                let got = generate(sched);
                assert_eq!(got, plain, "{layout:?}, adaptive {adaptive_drafts}");
                let (drafted, taken, steps) = draft_counts(sched, 1);
                eprintln!(
                    "{layout:?}, adaptive {adaptive_drafts}: {drafted} drafted, {taken} taken in {steps} steps"
                );
                assert!(drafted > 0, "{layout:?}: nothing drafted");
                if !adaptive_drafts {
                    // every step drafts 3 but the last three of each request
                    assert!(
                        drafted >= 3 * (steps - 12),
                        "{drafted} drafted in {steps} steps"
                    );
                }
            });
        }
    }
}

#[test]
fn split_steps_return_each_rows_own_hidden_state() {
    let dir = tempfile::tempdir().unwrap();
    let (path, starts) = settling_hindsighted(dir.path());
    let m = Arc::new(load(&path));
    let (k, n) = (3, 41);
    let config = SchedulerConfig {
        max_batch: 2,
        draft_max: k,
        ..CONFIG
    };
    // two sequences at once, each continuing its own way
    let prompts: Vec<Vec<u32>> = starts
        .iter()
        .enumerate()
        .map(|(s, &start)| {
            let mut p: Vec<u32> = (0..20 + 3 * s as u32).map(|i| (i * 7 + 2) % 320).collect();
            p.push(start);
            p
        })
        .collect();
    let requests = || {
        prompts
            .iter()
            .map(|p| request(p.clone(), n, SamplerConfig::default()))
            .collect::<Vec<_>>()
    };
    let want = run_all(&plain_scheduler(&m, config), requests());
    let (mut drafted, mut taken) = (0, 0);
    for out in &want {
        let (d, t, _) = hindsight_counts(out, k);
        drafted += d;
        taken += t;
    }
    eprintln!("outputs {want:?}: {drafted} drafted, {taken} taken");
    assert!(taken > 0 && taken < drafted, "pick other prompts");
    for layout in LAYOUTS {
        on_split(&path, layout, config, |sched| {
            assert_eq!(run_all(sched, requests()), want, "{layout:?}");
            // the step's counts go out after its tokens
            let s = sched.stats();
            let t0 = Instant::now();
            let counts = || {
                (
                    s.drafted.load(Ordering::Relaxed),
                    s.accepted_drafts.load(Ordering::Relaxed),
                )
            };
            while counts() != (drafted, taken) && t0.elapsed() < Duration::from_secs(1) {
                std::thread::sleep(Duration::from_millis(5));
            }
            assert_eq!(counts(), (drafted, taken), "{layout:?}");
        });
    }
}

#[test]
fn a_split_model_without_the_layer_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let tm = TinyModel::new(TinyModelSpec::qwen3moe(3)).unwrap();
    let path = write(&tm, dir.path(), GgmlType::F32);
    let e = LoadedModel::load_prediction_layer(&ModelSource::Gguf(path)).unwrap_err();
    assert!(
        e.to_string().contains("no multi-token-prediction layer"),
        "{e}"
    );
    assert!(e.to_string().contains("prompt lookup"), "{e}");
}

/// A lead that lacks the model file fetches the byte ranges `shard::prediction_ranges` names
/// beside its rank's: the prediction layer loaded from a copy holding only those (zeros
/// elsewhere) gives the whole file's layer's logits exactly, and the copy holds none of the
/// model's own layers. The ranges of the same share without the layer's block (a planted
/// fault: what a lead would fetch if the block were left out) give other logits.
#[test]
fn the_prediction_layer_loads_from_only_its_byte_ranges() {
    use shoal_engine::shard::{self, ShardPlan};
    use shoal_model::gguf::GgufFile;

    let dir = tempfile::tempdir().unwrap();
    let tm = TinyModel::new(TinyModelSpec {
        n_layers: 4,
        ..TinyModelSpec::glm4moe(61)
    })
    .unwrap();
    let path = write(&tm, dir.path(), GgmlType::F32);
    let whole_model = load(&path);
    let t = &whole_model.transformer;
    let cfg = t.config().clone();
    let n = PROMPT.len();
    let (_, hidden) = t
        .step_hidden(&PROMPT, &[n], &mut [&mut t.new_cache(64)], 1)
        .unwrap();
    let rows = hidden[..(n - 1) * cfg.hidden].to_vec();
    let logits_of = |layer: &LoadedModel| {
        let l = &layer.transformer;
        let mut cache = l.new_mtp_cache(64).unwrap();
        l.mtp_step(
            rows.clone(),
            &PROMPT[1..],
            &[n - 1],
            &mut [&mut cache],
            n - 1,
        )
        .unwrap()
        .0
    };
    let want = logits_of(&whole_model);
    let whole = std::fs::read(&path).unwrap();
    let file = GgufFile::open(&path).unwrap();
    let sparse_copy = |ranges: Vec<std::ops::Range<u64>>, name: &str| {
        let mut sparse = vec![0u8; whole.len()];
        let mut kept = 0;
        for r in ranges {
            let (a, b) = (r.start as usize, r.end as usize);
            sparse[a..b].copy_from_slice(&whole[a..b]);
            kept += b - a;
        }
        let p = dir.path().join(name);
        std::fs::write(&p, &sparse).unwrap();
        (p, kept)
    };
    let (p, kept) = sparse_copy(shard::prediction_ranges(&cfg, &file), "prediction.gguf");
    let layers: usize = file
        .tensors()
        .iter()
        .filter(|t| shoal_engine::arch::layer_of(&t.name).is_some_and(|l| l < cfg.n_layer))
        .map(|t| t.size as usize)
        .sum();
    eprintln!(
        "the prediction layer's ranges: {kept} of {} bytes",
        whole.len()
    );
    assert!(kept + layers <= whole.len(), "{kept} bytes kept");
    let layer = LoadedModel::load_prediction_layer(&ModelSource::Gguf(p)).unwrap();
    assert_eq!(logits_of(&layer), want);
    // without the layer's block
    let plan = ShardPlan::prediction_only(&cfg);
    let (p, _) = sparse_copy(shard::file_ranges(&cfg, &file, &plan), "planted.gguf");
    let planted = LoadedModel::load_prediction_layer(&ModelSource::Gguf(p)).unwrap();
    let d = max_abs_diff(&logits_of(&planted), &[want]);
    eprintln!("without the layer's block: logits {d:.2e} off");
    assert!(d > 1e-2);
}
