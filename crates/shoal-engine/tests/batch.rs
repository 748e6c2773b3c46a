//! Continuous batching is exact: a batched decode step (`Transformer::forward_batch`, every
//! sequence at its own position with its own cache) gives each sequence the logits it gets
//! decoded alone, on the test kit's tiny models (F32, Q8_0, Q4_K, Gemma 3 with a sliding
//! window shorter than the positions reached) and on SmolLM2; and the scheduler, with
//! sequences joining and leaving the batch, gives every request the greedy tokens it gets
//! alone, cancels on a dropped ticket, and refuses when full. A one-token step (on plain
//! values) and a batch of one (on tensors) give the same logits bit for bit.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use shoal_engine::model::LoadedModel;
use shoal_engine::scheduler::{Event, Scheduler, SchedulerConfig, SequenceRequest};
use shoal_engine::stop::FinishReason;
use shoal_engine::transformer::argmax;
use shoal_engine::{KvCache, Sampler, SamplerConfig, Transformer};
use shoal_model::source::ModelSource;
use shoal_testkit::{GgmlType, TinyModelSpec};

fn tiny(spec: TinyModelSpec, ty: GgmlType, dir: &Path) -> PathBuf {
    let p = dir.join(format!("{}-{ty:?}.gguf", spec.name));
    spec.build().unwrap().write_gguf(&p, ty).unwrap();
    p
}

fn load(path: &Path) -> LoadedModel {
    LoadedModel::load(&ModelSource::Gguf(path.to_path_buf())).unwrap()
}

/// Largest |a - b| over the largest |b|.
fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// Prefills `prompts` one by one, then decodes `steps` greedy tokens for all of them with
/// batched steps, sequence 1 joining after two steps and sequence 0 leaving after four;
/// each sequence's tokens and logits are compared with decoding it alone.
fn batched_matches_alone(t: &Transformer, prompts: &[Vec<u32>], steps: usize, tol: f32) {
    // alone
    let mut alone: Vec<Vec<(u32, Vec<f32>)>> = Vec::new();
    for p in prompts {
        let mut cache = t.new_cache(p.len() + steps + 1);
        let mut logits = t.forward_last(p, &mut cache).unwrap();
        let mut out = Vec::new();
        for _ in 0..steps {
            let tok = argmax(&logits) as u32;
            logits = t.forward_last(&[tok], &mut cache).unwrap();
            out.push((tok, logits.clone()));
        }
        alone.push(out);
    }
    // batched
    let mut caches: Vec<KvCache> = prompts
        .iter()
        .map(|p| t.new_cache(p.len() + steps + 1))
        .collect();
    let mut next: Vec<u32> = Vec::new();
    for (p, c) in prompts.iter().zip(caches.iter_mut()) {
        next.push(argmax(&t.forward_last(p, c).unwrap()) as u32);
    }
    let mut done = vec![0usize; prompts.len()];
    let mut step = 0;
    while done.iter().any(|&d| d < steps) {
        let members: Vec<usize> = (0..prompts.len())
            .filter(|&i| done[i] < steps)
            .filter(|&i| !(i == 1 && step < 2)) // joins late
            .filter(|&i| !(i == 0 && step >= 4 && done[0] >= 4 && step < 6)) // sits out two steps
            .collect();
        step += 1;
        if members.is_empty() {
            continue;
        }
        let tokens: Vec<u32> = members.iter().map(|&i| next[i]).collect();
        let mut refs: Vec<&mut KvCache> = caches
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| members.contains(i))
            .map(|(_, c)| c)
            .collect();
        let rows = t.forward_batch(&tokens, &mut refs).unwrap();
        let vocab = rows.len() / tokens.len();
        for (&i, row) in members.iter().zip(rows.chunks_exact(vocab)) {
            let (want_tok, want_logits) = &alone[i][done[i]];
            assert_eq!(
                tokens[members.iter().position(|&m| m == i).unwrap()],
                *want_tok
            );
            let d = rel_diff(row, want_logits);
            assert!(
                d <= tol,
                "sequence {i} step {}: logits differ by {d}",
                done[i]
            );
            next[i] = argmax(row) as u32;
            done[i] += 1;
        }
    }
}

fn prompts(vocab: u32) -> Vec<Vec<u32>> {
    vec![
        vec![1, 5, 9, 2],
        (0..11).map(|i| (i * 7 + 3) % vocab).collect(),
        vec![42],
        (0..6).map(|i| (i * 13 + 1) % vocab).collect(),
    ]
}

/// The test kit's tiny models the batch tests run: F32, Q8_0 with q/k/v biases, Gemma 3
/// (post-norms, a sliding window of 4), and Q4_K (a gate/up pair).
fn tiny_cases() -> [(TinyModelSpec, GgmlType); 6] {
    [
        (TinyModelSpec::llama(3), GgmlType::F32),
        (TinyModelSpec::qwen2(4), GgmlType::Q8_0),
        (TinyModelSpec::gemma3(5), GgmlType::F32),
        (TinyModelSpec::llama(6).k_quant_shapes(), GgmlType::Q4_K),
        (TinyModelSpec::qwen3(7), GgmlType::Q8_0),
        (TinyModelSpec::llama31(8), GgmlType::F32),
    ]
}

#[test]
fn tiny_models_batched_equal_alone() {
    let dir = tempfile::tempdir().unwrap();
    for (spec, ty) in tiny_cases() {
        let name = format!("{} {ty:?}", spec.name);
        let m = load(&tiny(spec, ty, dir.path()));
        // gemma3's window is 4: 12 steps take every prompt past it
        batched_matches_alone(&m.transformer, &prompts(320), 12, 1e-4);
        eprintln!("{name}: batched decode equals decoding alone");
    }
}

/// A one-token step of one sequence runs its blocks on plain values (`forward_last`), a
/// batched step on tensors (`forward_batch`); for a batch of one they are the same
/// arithmetic, so the logits agree bit for bit, step after step (biases, head norms, the
/// post-norms and sliding window of Gemma 3, a K-quant gate/up pair).
#[test]
fn one_token_steps_on_values_equal_a_batch_of_one() {
    let dir = tempfile::tempdir().unwrap();
    for (spec, ty) in tiny_cases() {
        let name = format!("{} {ty:?}", spec.name);
        let t = load(&tiny(spec, ty, dir.path())).transformer;
        let prompt = &prompts(320)[1];
        let (mut alone, mut batch) = (t.new_cache(32), t.new_cache(32));
        let mut logits = t.forward_last(prompt, &mut alone).unwrap();
        t.forward_last(prompt, &mut batch).unwrap();
        for step in 0..12 {
            let tok = argmax(&logits) as u32;
            logits = t.forward_last(&[tok], &mut alone).unwrap();
            let row = t.forward_batch(&[tok], &mut [&mut batch]).unwrap();
            let same = logits.len() == row.len()
                && logits
                    .iter()
                    .zip(&row)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "{name} step {step}: logits differ by {}",
                rel_diff(&logits, &row)
            );
        }
        eprintln!("{name}: one-token steps equal a batch of one, bit for bit");
    }
}

#[test]
fn smollm2_batched_equal_alone() {
    let Some(path) = common::model_path("smollm2") else {
        return;
    };
    let m = load(&path);
    let ps: Vec<Vec<u32>> = [
        "The capital of France is",
        "def fib(n):",
        "Once upon a time",
        "1, 2, 3,",
    ]
    .iter()
    .map(|p| m.raw_prompt(p).unwrap())
    .collect();
    // the batched matmul rounds differently from one row: allow a small drift, tokens equal
    batched_matches_alone(&m.transformer, &ps, 16, 2e-2);
}

#[test]
fn batch_errors_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let m = load(&tiny(TinyModelSpec::llama(1), GgmlType::F32, dir.path()));
    let t = &m.transformer;
    let mut a = t.new_cache(4);
    let mut b = t.new_cache(1);
    assert!(
        t.forward_batch(&[1], &mut [&mut a, &mut b]).is_err(),
        "lengths differ"
    );
    assert!(t.forward_batch(&[], &mut []).is_err(), "empty batch");
    assert!(
        t.forward_batch(&[100_000], &mut [&mut a]).is_err(),
        "id out of vocabulary"
    );
    t.forward_batch(&[1], &mut [&mut b]).unwrap();
    assert!(t.forward_batch(&[1], &mut [&mut b]).is_err(), "full cache");
}

fn collect(rx: &mpsc::Receiver<Event>) -> (Vec<u32>, String, Option<FinishReason>) {
    let mut toks = Vec::new();
    let mut text = String::new();
    loop {
        match rx
            .recv_timeout(Duration::from_secs(60))
            .expect("events within 60 s")
        {
            Event::Token { id, text: t, .. } => {
                toks.push(id);
                text.push_str(&t);
            }
            Event::Text(t) => text.push_str(&t),
            Event::Done(f) => return (toks, text, Some(f.reason)),
            Event::Failed(e) | Event::Interrupted(e) => panic!("failed: {e}"),
        }
    }
}

fn request(prompt: Vec<u32>, max_tokens: usize) -> SequenceRequest {
    SequenceRequest {
        prompt,
        max_tokens,
        sampler: SamplerConfig::default(),
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

#[test]
fn scheduler_gives_each_request_its_own_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let m = Arc::new(load(&tiny(
        TinyModelSpec::qwen2(9),
        GgmlType::F32,
        dir.path(),
    )));
    let ps = prompts(320);
    let lens = [20usize, 7, 13, 30];
    // alone, step by step
    let want: Vec<Vec<u32>> = ps.iter().zip(lens).map(|(p, n)| alone(&m, p, n)).collect();
    let sched = Scheduler::start(
        m.clone(),
        SchedulerConfig {
            max_batch: 3, // four requests: one waits for a slot
            max_queue: 8,
            ctx: 256,
            prefix_cache: true,
            draft_max: 0,
            adaptive_drafts: false,
        },
    )
    .unwrap();
    let mut rxs = Vec::new();
    let mut tickets = Vec::new();
    for (p, n) in ps.iter().zip(lens) {
        let (tx, rx) = mpsc::channel();
        tickets.push(
            sched
                .submit(request(p.clone(), n), Box::new(move |e| tx.send(e).is_ok()))
                .unwrap(),
        );
        rxs.push(rx);
    }
    for (i, rx) in rxs.iter().enumerate() {
        let (toks, _, reason) = collect(rx);
        assert_eq!(toks, want[i], "request {i}");
        assert_eq!(reason, Some(FinishReason::Length));
    }
    assert!(
        sched.stats().decode_steps.load(Ordering::Relaxed) < 70,
        "steps were batched"
    );
}

/// Each token's id and the text that became final with it, the text released at the end,
/// and how the sequence ended.
type Stream = (Vec<(u32, String)>, String, FinishReason, usize);

fn stream(rx: &mpsc::Receiver<Event>) -> Stream {
    let (mut toks, mut tail) = (Vec::new(), String::new());
    loop {
        match rx
            .recv_timeout(Duration::from_secs(60))
            .expect("events within 60 s")
        {
            Event::Token { id, text, .. } => toks.push((id, text)),
            Event::Text(t) => tail.push_str(&t),
            Event::Done(f) => return (toks, tail, f.reason, f.completion_tokens),
            Event::Failed(e) | Event::Interrupted(e) => panic!("failed: {e}"),
        }
    }
}

/// A request resumed after `k` of its tokens (what a client was sent before its instance
/// was lost) goes on exactly as the uninterrupted request did: the same later tokens, the
/// same text after what was sent, the same end, also when a stop string spans the point
/// where it stopped, and with the resumed tokens counted towards `max_tokens`. Asked to
/// report the resumed tokens, it gives each with the text it gave the first time, then goes
/// on the same.
#[test]
fn a_resumed_request_goes_on_where_it_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let m = Arc::new(load(&tiny(
        TinyModelSpec::qwen2(9),
        GgmlType::F32,
        dir.path(),
    )));
    let sched = Scheduler::start(
        m.clone(),
        SchedulerConfig {
            max_batch: 2,
            max_queue: 4,
            ctx: 256,
            prefix_cache: false,
            draft_max: 0,
            adaptive_drafts: false,
        },
    )
    .unwrap();
    let prompt = prompts(320).swap_remove(2);
    let run_reporting = |stop: Vec<String>, resume: Vec<u32>, report: bool| {
        let (tx, rx) = mpsc::channel();
        let mut r = request(prompt.clone(), 24);
        r.stop = stop;
        r.resume = resume;
        r.report_resumed = report;
        let _t = sched
            .submit(r, Box::new(move |e| tx.send(e).is_ok()))
            .unwrap();
        stream(&rx)
    };
    let run = |stop: Vec<String>, resume: Vec<u32>| run_reporting(stop, resume, false);
    let (whole, _, reason, n) = run(Vec::new(), Vec::new());
    assert_eq!((reason, n), (FinishReason::Length, 24));
    let ids: Vec<u32> = whole.iter().map(|t| t.0).collect();
    // a stop string spanning tokens 9 to 12 of the output
    let tok = &m.tokenizer;
    let pieces: Vec<String> = ids.iter().map(|&i| tok.decode(&[i], false)).collect();
    let stop: String = pieces[9..12].concat();
    assert!(!stop.is_empty(), "the tiny model's tokens print as text");
    for stops in [Vec::new(), vec![stop.clone()]] {
        let (want, want_tail, want_reason, want_n) = run(stops.clone(), Vec::new());
        for k in [1usize, 5, 10, 11, 23] {
            if k >= want.len() {
                continue;
            }
            let resumed: Vec<u32> = want[..k].iter().map(|t| t.0).collect();
            let (got, tail, reason, n) = run(stops.clone(), resumed);
            assert_eq!(
                got,
                want[k..].to_vec(),
                "stops {stops:?}, resumed after {k}"
            );
            assert_eq!(tail, want_tail, "stops {stops:?}, resumed after {k}");
            assert_eq!((reason, n), (want_reason, want_n), "resumed after {k}");
            let (all, tail, reason, n) =
                run_reporting(stops.clone(), want[..k].iter().map(|t| t.0).collect(), true);
            assert_eq!(all, want, "stops {stops:?}, resumed after {k}, reported");
            assert_eq!((tail, reason, n), (want_tail.clone(), want_reason, want_n));
        }
    }
}

/// `n` tokens after `prompt`, sampled with the default sampler, one step at a time.
fn alone(m: &LoadedModel, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut cache = m.new_cache(256);
    let mut s = Sampler::new(SamplerConfig::default());
    s.observe(prompt);
    let mut logits = m.transformer.prefill(prompt, &mut cache).unwrap();
    let mut out = Vec::new();
    for _ in 0..n {
        let id = s.sample(&mut logits);
        out.push(id);
        logits = m.transformer.forward_last(&[id], &mut cache).unwrap();
    }
    out
}

/// A request that starts as an ended one did runs only the rest: its cache is the ended
/// sequence's (in place when large enough, else copied into a larger one), and its tokens
/// are those it gets alone.
#[test]
fn scheduler_reuses_the_cache_of_an_ended_sequence() {
    let dir = tempfile::tempdir().unwrap();
    let m = Arc::new(load(&tiny(
        TinyModelSpec::llama(15),
        GgmlType::Q8_0,
        dir.path(),
    )));
    let sched = Scheduler::start(
        m.clone(),
        SchedulerConfig {
            max_batch: 1,
            max_queue: 1,
            ctx: 256,
            prefix_cache: true,
            draft_max: 0,
            adaptive_drafts: false,
        },
    )
    .unwrap();
    let first = prompts(320)[0].clone();
    let r1 = sched
        .generate(request(first.clone(), 10), &mut |_| true)
        .unwrap();
    assert_eq!(r1.finished.cached_tokens, 0);
    assert_eq!(r1.tokens, alone(&m, &first, 10));
    // the next turn of a conversation: everything so far, then more; its cache must grow
    // (the first held room for its prompt and 10 tokens), so the prefix is copied
    let mut second = first.clone();
    second.extend_from_slice(&r1.tokens);
    second.extend_from_slice(&[7, 8, 9]);
    let r2 = sched
        .generate(request(second.clone(), 30), &mut |_| true)
        .unwrap();
    // the cache held the prompt and all generated tokens but the last, which never ran
    assert_eq!(r2.finished.cached_tokens, first.len() + 9);
    assert_eq!(r2.tokens, alone(&m, &second, 30));
    // a shorter request that shares only the first prompt's start reuses that part in place
    let third = first[..first.len() - 2].to_vec();
    let r3 = sched
        .generate(request(third.clone(), 5), &mut |_| true)
        .unwrap();
    assert_eq!(r3.finished.cached_tokens, third.len() - 1);
    assert_eq!(r3.tokens, alone(&m, &third, 5));
    // nothing in common: a new cache
    let r4 = sched
        .generate(request(vec![300, 301], 5), &mut |_| true)
        .unwrap();
    assert_eq!(r4.finished.cached_tokens, 0);
    assert_eq!(r4.tokens, alone(&m, &[300, 301], 5));
}

#[test]
fn scheduler_cancels_dropped_tickets_and_refuses_when_full() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinyModelSpec {
        context_length: 4096,
        ..TinyModelSpec::llama(2)
    };
    let m = Arc::new(load(&tiny(spec, GgmlType::F32, dir.path())));
    let sched = Scheduler::start(
        m,
        SchedulerConfig {
            max_batch: 1,
            max_queue: 1,
            ctx: 4096,
            prefix_cache: true,
            draft_max: 0,
            adaptive_drafts: false,
        },
    )
    .unwrap();
    let (tx, rx) = mpsc::channel();
    let long = sched
        .submit(
            request(vec![1, 2, 3], 4000),
            Box::new(move |e| tx.send(e).is_ok()),
        )
        .unwrap();
    // wait until it holds the slot
    let _ = rx.recv_timeout(Duration::from_secs(30)).unwrap();
    let (tx2, rx2) = mpsc::channel();
    let queued = sched
        .submit(request(vec![4], 3), Box::new(move |e| tx2.send(e).is_ok()))
        .unwrap();
    let busy = sched.submit(request(vec![5], 3), Box::new(|_| true));
    assert!(busy.is_err(), "a full queue refuses");
    let t0 = Instant::now();
    drop(long);
    let (toks, _, reason) = collect(&rx2);
    assert_eq!((toks.len(), reason), (3, Some(FinishReason::Length)));
    eprintln!(
        "queued request done {:?} after the first was cancelled",
        t0.elapsed()
    );
    assert!(t0.elapsed() < Duration::from_secs(5));
    drop(queued);
    let s = sched.stats();
    let deadline = Instant::now() + Duration::from_secs(5);
    while s.active.load(Ordering::Relaxed) != 0 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn presence_and_frequency_penalties_push_away_repeats() {
    let dir = tempfile::tempdir().unwrap();
    let m = Arc::new(load(&tiny(
        TinyModelSpec::llama(12),
        GgmlType::F32,
        dir.path(),
    )));
    let sched = Scheduler::start(
        m,
        SchedulerConfig {
            max_batch: 2,
            max_queue: 2,
            ctx: 256,
            prefix_cache: true,
            draft_max: 0,
            adaptive_drafts: false,
        },
    )
    .unwrap();
    let run = |presence: f32, frequency: f32| {
        let (tx, rx) = mpsc::channel();
        let mut r = request(vec![3, 1, 4, 1, 5], 40);
        r.presence_penalty = presence;
        r.frequency_penalty = frequency;
        let _t = sched
            .submit(r, Box::new(move |e| tx.send(e).is_ok()))
            .unwrap();
        collect(&rx).0
    };
    let distinct = |v: &[u32]| v.iter().collect::<std::collections::HashSet<_>>().len();
    let plain = run(0.0, 0.0);
    let penalised = run(1e4, 0.0);
    assert!(
        distinct(&plain) < plain.len(),
        "the tiny model repeats itself: {plain:?}"
    );
    assert_eq!(distinct(&penalised), penalised.len(), "{penalised:?}");
    let freq = run(0.0, 1e4);
    assert_eq!(distinct(&freq), freq.len(), "{freq:?}");
}

/// Runs `ps` (with their lengths) through a scheduler and returns each request's tokens.
fn schedule(sched: &Scheduler, ps: &[Vec<u32>], lens: &[usize]) -> Vec<Vec<u32>> {
    let mut rxs = Vec::new();
    let mut tickets = Vec::new();
    for (p, &n) in ps.iter().zip(lens) {
        let (tx, rx) = mpsc::channel();
        let mut r = request(p.clone(), n);
        if n % 2 == 1 {
            // asks the split for every logit instead of each rank's best
            r.logprobs = Some(2);
        }
        tickets.push(
            sched
                .submit(r, Box::new(move |e| tx.send(e).is_ok()))
                .unwrap(),
        );
        rxs.push(rx);
    }
    rxs.iter().map(|rx| collect(rx).0).collect()
}

/// Runs `f` on a scheduler leading `layout`'s ranks of `source` (see [`common::split_ranks`]), then
/// checks that the split did not fail and that every rank stopped cleanly.
fn on_split<T>(
    source: &ModelSource,
    layout: shoal_engine::shard::Layout,
    config: SchedulerConfig,
    f: impl FnOnce(&Scheduler) -> T,
) -> T {
    on_split_with(source, layout, config, None, f)
}

/// [`on_split`] with a draft model on the lead, if `draft` is one.
fn on_split_with<T>(
    source: &ModelSource,
    layout: shoal_engine::shard::Layout,
    config: SchedulerConfig,
    draft: Option<Arc<LoadedModel>>,
    f: impl FnOnce(&Scheduler) -> T,
) -> T {
    let (ctx, m, workers) = common::split_ranks(source, layout, 256);
    let sched = match draft {
        Some(d) => Scheduler::start_split_with_draft(Arc::new(m), ctx, d, config).unwrap(),
        None => Scheduler::start_split(Arc::new(m), ctx, config).unwrap(),
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

/// The tokens of `prompts[i]` continued by `lens[i]` tokens with `sampler`, all submitted at
/// once to `sched`.
fn generate_all(
    sched: &Scheduler,
    prompts: &[Vec<u32>],
    lens: &[usize],
    sampler: &SamplerConfig,
) -> Vec<Vec<u32>> {
    let subs: Vec<_> = prompts
        .iter()
        .zip(lens)
        .map(|(p, &n)| {
            let (tx, rx) = mpsc::channel();
            let mut r = request(p.clone(), n);
            r.sampler = sampler.clone();
            let t = sched
                .submit(r, Box::new(move |e| tx.send(e).is_ok()))
                .unwrap();
            (t, rx)
        })
        .collect();
    subs.iter().map(|(_, rx)| collect(rx).0).collect()
}

#[test]
fn split_scheduler_matches_one_rank() {
    use shoal_engine::shard::Layout;

    let dir = tempfile::tempdir().unwrap();
    let path = tiny(TinyModelSpec::qwen2(9), GgmlType::Q8_0, dir.path());
    let config = SchedulerConfig {
        max_batch: 3,
        max_queue: 8,
        ctx: 256,
        prefix_cache: true,
        draft_max: 0,
        adaptive_drafts: false,
    };
    let ps = prompts(320);
    let lens = [20usize, 7, 13, 30];
    let local = Scheduler::start(Arc::new(load(&path)), config).unwrap();
    let want = schedule(&local, &ps, &lens);
    drop(local);
    let source = ModelSource::Gguf(path.clone());
    for (tp, pp) in [(2, 1), (1, 2), (2, 2)] {
        let (got, overlapped) = on_split(&source, Layout { tp, pp }, config, |sched| {
            let got = schedule(sched, &ps, &lens);
            (got, sched.stats().overlapped_steps.load(Ordering::Relaxed))
        });
        assert_eq!(got, want, "tp {tp} pp {pp}");
        // on a pipeline, decode steps went out while others were in it
        assert_eq!(
            overlapped > 0,
            pp > 1,
            "tp {tp} pp {pp}: {overlapped} overlapped"
        );
    }
}

/// Prompt lookup on a split model (tensor, pipeline and both): drafted tokens are checked in
/// one split step of several rows per sequence, and greedy and seeded sampling (with a
/// repetition penalty, so every logit of every row comes back) give the tokens one rank
/// gives without speculation; drafts were checked and some taken. On a pipeline, steps go
/// in before the step they follow is collected, on a guess of what it samples: some such
/// guesses hold and some miss (their rows thrown away), and the tokens are still one rank's.
#[test]
fn split_lookup_decoding_gives_one_ranks_tokens() {
    use shoal_engine::shard::Layout;

    let dir = tempfile::tempdir().unwrap();
    let path = tiny(TinyModelSpec::qwen2(23), GgmlType::Q8_0, dir.path());
    let cycle: Vec<u32> = (0..12).map(|i| (i * 29 + 7) % 320).collect();
    let ps: Vec<Vec<u32>> = vec![
        cycle.iter().cycle().take(40).copied().collect(),
        cycle.iter().rev().cycle().take(30).copied().collect(),
        (0..9).map(|i| (i * 7 + 3) % 320).collect(),
    ];
    let lens = [40usize, 33, 60];
    let config = |draft_max: usize| SchedulerConfig {
        max_batch: 3,
        max_queue: 4,
        ctx: 256,
        prefix_cache: false,
        draft_max,
        adaptive_drafts: false,
    };
    let samplers = [
        SamplerConfig::default(),
        SamplerConfig {
            temperature: 0.8,
            seed: 3,
            repeat_penalty: 1.1,
            ..SamplerConfig::default()
        },
    ];
    let local = Scheduler::start(Arc::new(load(&path)), config(0)).unwrap();
    let want: Vec<_> = samplers
        .iter()
        .map(|s| generate_all(&local, &ps, &lens, s))
        .collect();
    drop(local);
    let source = ModelSource::Gguf(path.clone());
    for (tp, pp) in [(2, 1), (1, 2), (2, 2)] {
        on_split(&source, Layout { tp, pp }, config(5), |sched| {
            for (sampler, want) in samplers.iter().zip(&want) {
                let got = generate_all(sched, &ps, &lens, sampler);
                assert_eq!(&got, want, "tp {tp} pp {pp} {sampler:?}");
            }
            let s = sched.stats();
            let drafted = s.drafted.load(Ordering::Relaxed);
            let taken = s.accepted_drafts.load(Ordering::Relaxed);
            let ahead = s.overlapped_steps.load(Ordering::Relaxed);
            let missed = s.discarded_steps.load(Ordering::Relaxed);
            eprintln!(
                "tp {tp} pp {pp}: {taken} of {drafted} drafted tokens taken; {ahead} steps \
                 went in ahead of the step before, {missed} more on a guess that missed"
            );
            assert!(
                drafted > 0 && taken > 0,
                "tp {tp} pp {pp}: {taken} of {drafted}"
            );
            // on a pipeline, checks go in while the step before is in it, and some guesses
            // hold and some miss
            assert_eq!(ahead > 0 && missed > 0, pp > 1, "tp {tp} pp {pp}");
            assert_eq!(ahead + missed > 0, pp > 1, "tp {tp} pp {pp}");
        });
    }
}

/// A split step of several rows per sequence returns each row's logits in the order given:
/// against one rank's step of the same rows, sequences given out of order and with
/// different row counts. A planted fault (two rows swapped) is caught by the same check.
/// Asked for them, every step also returns its rows' output hidden states after the final
/// norm (what a prediction layer on the lead reads) in the same order, as one rank's.
#[test]
fn split_rows_come_back_in_order() {
    use shoal_engine::parallel::{Lead, Want};
    use shoal_engine::shard::Layout;

    let dir = tempfile::tempdir().unwrap();
    let path = tiny(TinyModelSpec::llama(31), GgmlType::F32, dir.path());
    let m = load(&path);
    let prompts: [Vec<u32>; 2] = [vec![5, 9, 11, 2, 7], vec![40, 41, 3]];
    // what each row gives on one rank
    // every row's logits and output hidden state
    let rows_of = |tokens: &[u32], cache: &mut KvCache| {
        m.transformer
            .step_hidden(tokens, &[tokens.len()], &mut [cache], tokens.len())
            .unwrap()
    };
    let mut c0 = m.transformer.new_cache(64);
    let mut c1 = m.transformer.new_cache(64);
    let prompt_hidden = [
        rows_of(&prompts[0], &mut c0).1,
        rows_of(&prompts[1], &mut c1).1,
    ];
    let vocab = m.transformer.config().vocab;
    let width = m.transformer.config().hidden;
    let (more0, more1): (Vec<u32>, Vec<u32>) = (vec![8, 1, 30, 4], vec![17, 6]);
    let (want0, hidden0) = rows_of(&more0, &mut c0);
    let (want1, hidden1) = rows_of(&more1, &mut c1);
    let want_hidden: Vec<f32> = hidden1.iter().chain(&hidden0).copied().collect();
    let max_diff = |a: &[f32], b: &[f32]| {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    };
    let best = |row: &[f32]| argmax(row) as u32;
    let want: Vec<u32> = want1
        .chunks(vocab)
        .chain(want0.chunks(vocab))
        .map(best)
        .collect();
    let source = ModelSource::Gguf(path.clone());
    for (tp, pp) in [(2, 1), (1, 2)] {
        let (ctx, m, workers) = common::split_ranks(&source, Layout { tp, pp }, 256);
        {
            let mut lead = Lead::with_sequences(ctx, &m.transformer, 64, 2).unwrap();
            lead.keep_hidden(true);
            for (s, p) in prompts.iter().enumerate() {
                lead.select(s).unwrap();
                lead.step_with(p, Want::Nothing).unwrap();
                let d = max_diff(&lead.take_hidden(), &prompt_hidden[s]);
                assert!(
                    d < 1e-4,
                    "tp {tp} pp {pp}: prompt {s}'s hidden states {d} off"
                );
            }
            // sequence 1 first, with 2 rows; then sequence 0 with 4
            let tokens: Vec<u32> = more1.iter().chain(&more0).copied().collect();
            let rows = lead
                .step_rows(&[1, 0], &tokens, &[2, 4], Want::All)
                .unwrap();
            let got: Vec<u32> = rows.iter().map(|r| best(r)).collect();
            assert_eq!(got, want, "tp {tp} pp {pp}");
            let mut planted = got.clone();
            planted.swap(1, 2);
            assert_ne!(planted, want, "a swapped row must be caught");
            let hidden = lead.take_hidden();
            let d = max_diff(&hidden, &want_hidden);
            eprintln!("tp {tp} pp {pp}: hidden states within {d:.2e} of one rank's");
            assert!(d < 1e-4, "tp {tp} pp {pp}: hidden states {d} off");
            // the same check catches two rows swapped
            let mut planted = hidden.clone();
            planted[width..3 * width].rotate_left(width);
            assert!(
                max_diff(&planted, &want_hidden) > 1e-2,
                "a swapped row must be caught"
            );
            // bad counts are refused before anything is sent
            assert!(lead
                .step_rows(&[1, 0], &tokens, &[3, 4], Want::Best)
                .is_err());
            assert!(lead
                .step_rows(&[1, 0], &tokens, &[0, 6], Want::Best)
                .is_err());
            lead.stop().unwrap();
        }
        for w in workers {
            w.join().unwrap().unwrap();
        }
    }
}

#[test]
fn broken_split_interrupts_requests_and_says_why() {
    use shoal_comm::{mem_mesh, Transport};
    use shoal_engine::parallel::RankContext;
    use shoal_engine::shard::Layout;

    let dir = tempfile::tempdir().unwrap();
    let path = tiny(TinyModelSpec::qwen2(9), GgmlType::F32, dir.path());
    let layout = Layout { tp: 2, pp: 1 };
    let mut ts = mem_mesh(2).into_iter();
    let t0: Arc<dyn Transport> = Arc::new(ts.next().unwrap());
    drop(ts); // rank 1 never serves: its end of the mesh is gone
    let mut ctx = RankContext::over(t0, layout, Duration::from_secs(5)).unwrap();
    let source = ModelSource::Gguf(path);
    let (m, plans) =
        LoadedModel::load_split(&source, layout, None, Default::default(), 0, ctx.tp.clone())
            .unwrap();
    ctx.plans = plans;
    let sched = Scheduler::start_split(
        Arc::new(m),
        ctx,
        SchedulerConfig {
            max_batch: 2,
            max_queue: 4,
            ctx: 64,
            prefix_cache: true,
            draft_max: 0,
            adaptive_drafts: false,
        },
    )
    .unwrap();
    for attempt in 0..2 {
        let (tx, rx) = mpsc::channel();
        let _t = sched
            .submit(
                request(vec![1, 2, 3], 4),
                Box::new(move |e| tx.send(e).is_ok()),
            )
            .unwrap();
        match rx.recv_timeout(Duration::from_secs(30)).unwrap() {
            // the first request meets the broken mesh, the second the broken split: both
            // may go on where the model is placed next
            Event::Interrupted(e) => assert!(!e.is_empty(), "attempt {attempt}"),
            other => panic!("attempt {attempt}: {other:?}"),
        }
    }
    assert!(sched.failure().is_some());
}

/// A split retired by its lead leaves every rank's weights usable: over a new mesh (its
/// communicators bound where the layers' collectives go) the same weights give the tokens of
/// one rank, and a request running at the retirement is interrupted with the reason.
#[test]
fn retired_split_weights_serve_again_over_a_new_mesh() {
    use shoal_comm::{mem_mesh, Communicator, Rebindable, Transport};
    use shoal_engine::parallel::{serve, RankContext};
    use shoal_engine::shard::Layout;

    let dir = tempfile::tempdir().unwrap();
    let path = tiny(TinyModelSpec::qwen2(9), GgmlType::Q8_0, dir.path());
    let config = SchedulerConfig {
        max_batch: 2,
        max_queue: 8,
        ctx: 256,
        prefix_cache: true,
        draft_max: 0,
        adaptive_drafts: false,
    };
    let ps = prompts(320);
    let lens = [12usize, 9];
    let local = Scheduler::start(Arc::new(load(&path)), config).unwrap();
    let want = schedule(&local, &ps[..2], &lens);
    drop(local);
    let layout = Layout { tp: 2, pp: 1 };
    let source = ModelSource::Gguf(path);
    let contexts = |binds: Option<&[Arc<Rebindable>]>| -> Vec<RankContext> {
        mem_mesh(2)
            .into_iter()
            .enumerate()
            .map(|(r, t)| {
                let t: Arc<dyn Transport> = Arc::new(t);
                let mut ctx = RankContext::over(t, layout, Duration::from_secs(60)).unwrap();
                if let Some(b) = binds {
                    b[r].bind(ctx.tp.clone()).unwrap();
                    ctx.tp = b[r].clone();
                }
                ctx
            })
            .collect()
    };
    let mut first = contexts(None);
    let old_tp: Vec<std::sync::Weak<dyn Communicator>> =
        first.iter().map(|ctx| Arc::downgrade(&ctx.tp)).collect();
    let binds: Vec<Arc<Rebindable>> = first
        .iter_mut()
        .map(|ctx| {
            let b = Arc::new(Rebindable::new(ctx.tp.clone()));
            ctx.tp = b.clone() as Arc<dyn Communicator>;
            b
        })
        .collect();
    let models: Vec<Arc<LoadedModel>> = std::thread::scope(|s| {
        let loads: Vec<_> = first
            .iter_mut()
            .enumerate()
            .map(|(r, ctx)| {
                let source = &source;
                s.spawn(move || {
                    let (m, plans) = LoadedModel::load_split(
                        source,
                        layout,
                        None,
                        Default::default(),
                        r,
                        ctx.tp.clone(),
                    )
                    .unwrap();
                    ctx.plans = plans;
                    Arc::new(m)
                })
            })
            .collect();
        loads.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // runs one placement: rank 1 serves on a thread, rank 0's scheduler leads
    let place = |mut ctxs: Vec<RankContext>| {
        let plans = ctxs[0].plans.clone();
        let ctx1 = ctxs.pop().unwrap();
        let mut ctx0 = ctxs.pop().unwrap();
        ctx0.plans = plans;
        let m1 = models[1].clone();
        let worker = std::thread::spawn(move || serve(&ctx1, &m1.transformer, 256));
        let sched = Scheduler::start_split(models[0].clone(), ctx0, config).unwrap();
        (sched, worker)
    };
    let plans = first[0].plans.clone();
    let (sched, worker) = place(first);
    assert_eq!(schedule(&sched, &ps[..2], &lens), want, "first placement");
    // a long request is running when the lead retires the split
    let (_t, rx) = submit(&sched, &ps[2], 200);
    assert!(matches!(
        rx.recv_timeout(Duration::from_secs(60)).unwrap(),
        Event::Token { .. }
    ));
    assert!(sched.retire("placed again", Duration::from_secs(30)));
    let interrupted = loop {
        match rx.recv_timeout(Duration::from_secs(30)).unwrap() {
            Event::Token { .. } | Event::Text(_) => {}
            Event::Interrupted(why) => break why,
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(interrupted, "placed again");
    // later requests are interrupted the same way, not run
    let (_t, rx) = submit(&sched, &ps[0], 4);
    assert!(matches!(
        rx.recv_timeout(Duration::from_secs(30)).unwrap(),
        Event::Interrupted(_)
    ));
    drop(sched);
    worker.join().unwrap().unwrap();
    // the same weights over a new mesh
    let mut second = contexts(Some(&binds));
    second[0].plans = plans;
    // nothing runs over the first mesh any more (its ends would still talk to each other)
    assert!(old_tp.iter().all(|w| w.upgrade().is_none()));
    let (sched, worker) = place(second);
    assert_eq!(
        schedule(&sched, &ps[..2], &lens),
        want,
        "the kept weights over a new mesh"
    );
    assert!(sched.failure().is_none());
    drop(sched);
    worker.join().unwrap().unwrap();
}

/// A share made into another share of the same file keeps the layers both hold: three
/// pipeline stages of two layers regrown into two of three keep two layers on each new
/// stage and read one, a tensor-parallel share regrown into the whole model keeps none
/// (its layers are cut another way), and the regrown ranks give one rank's tokens.
#[test]
fn a_regrown_share_keeps_the_layers_it_held() {
    use shoal_comm::{mem_mesh, Transport};
    use shoal_engine::parallel::{serve, RankContext};
    use shoal_engine::shard::Layout;
    use shoal_engine::transformer::Reuse;

    let dir = tempfile::tempdir().unwrap();
    let spec = TinyModelSpec {
        n_layers: 6,
        ..TinyModelSpec::qwen2(9)
    };
    let path = tiny(spec, GgmlType::Q8_0, dir.path());
    let source = ModelSource::Gguf(path.clone());
    let config = SchedulerConfig {
        max_batch: 2,
        max_queue: 8,
        ctx: 256,
        prefix_cache: true,
        draft_max: 0,
        adaptive_drafts: false,
    };
    let ps = prompts(320);
    let lens = [12usize, 9];
    let local = Scheduler::start(Arc::new(load(&path)), config).unwrap();
    let want = schedule(&local, &ps[..2], &lens);
    drop(local);
    // loads `layout` cut by `sizes`: each rank's context and share
    let contexts = |layout: Layout| -> Vec<RankContext> {
        mem_mesh(layout.world())
            .into_iter()
            .map(|t| {
                let t: Arc<dyn Transport> = Arc::new(t);
                RankContext::over(t, layout, Duration::from_secs(60)).unwrap()
            })
            .collect()
    };
    let old_layout = Layout { tp: 1, pp: 3 };
    let old: Vec<LoadedModel> = contexts(old_layout)
        .into_iter()
        .enumerate()
        .map(|(r, ctx)| {
            LoadedModel::load_split(
                &source,
                old_layout,
                Some(&[2, 2, 2]),
                Default::default(),
                r,
                ctx.tp.clone(),
            )
            .unwrap()
            .0
        })
        .collect();
    let mut old: Vec<Option<LoadedModel>> = old.into_iter().map(Some).collect();
    let layout = Layout { tp: 1, pp: 2 };
    let mut ctxs = contexts(layout);
    // the new first stage (layers 0..3) from the old first (0..2), the new last (3..6) from
    // the old last (4..6); the old middle stage is let go
    let mut models = Vec::new();
    for (r, from) in [(0, 0), (1, 2)] {
        let (m, plans, reuse) = LoadedModel::regrow_split(
            &old[from].take().unwrap(),
            &source,
            layout,
            Some(&[3, 3]),
            Default::default(),
            r,
            ctxs[r].tp.clone(),
        )
        .unwrap();
        assert_eq!(
            reuse,
            Reuse {
                layers_kept: 2,
                layers_loaded: 1
            },
            "rank {r}"
        );
        assert_eq!(m.transformer.plan().layers, [0..3, 3..6][r]);
        ctxs[r].plans = plans;
        models.push(Arc::new(m));
    }
    let ctx1 = ctxs.pop().unwrap();
    let ctx0 = ctxs.pop().unwrap();
    let m1 = models[1].clone();
    let worker = std::thread::spawn(move || serve(&ctx1, &m1.transformer, 256));
    let sched = Scheduler::start_split(models[0].clone(), ctx0, config).unwrap();
    assert_eq!(schedule(&sched, &ps[..2], &lens), want, "regrown stages");
    assert!(sched.failure().is_none());
    drop(sched);
    worker.join().unwrap().unwrap();
    // a tensor-parallel share holds other cuts of its layers than the whole model does
    let tp2 = Layout { tp: 2, pp: 1 };
    let half = LoadedModel::load_split(
        &source,
        tp2,
        None,
        Default::default(),
        0,
        contexts(tp2)[0].tp.clone(),
    )
    .unwrap()
    .0;
    let one = Layout { tp: 1, pp: 1 };
    let (whole, _, reuse) = LoadedModel::regrow_split(
        &half,
        &source,
        one,
        None,
        Default::default(),
        0,
        contexts(one)[0].tp.clone(),
    )
    .unwrap();
    assert_eq!(
        reuse,
        Reuse {
            layers_kept: 0,
            layers_loaded: 6
        }
    );
    let sched = Scheduler::start(Arc::new(whole), config).unwrap();
    assert_eq!(schedule(&sched, &ps[..2], &lens), want, "regrown whole");
}

/// Submits `prompt` for `n` tokens; the receiver gets its events.
fn submit(
    sched: &Scheduler,
    prompt: &[u32],
    n: usize,
) -> (shoal_engine::scheduler::Ticket, mpsc::Receiver<Event>) {
    let (tx, rx) = mpsc::channel();
    let t = sched
        .submit(
            request(prompt.to_vec(), n),
            Box::new(move |e| tx.send(e).is_ok()),
        )
        .unwrap();
    (t, rx)
}

/// Its tokens and how many prompt tokens came from another sequence's cache.
fn tokens_and_cached(rx: &mpsc::Receiver<Event>) -> (Vec<u32>, usize) {
    let mut toks = Vec::new();
    loop {
        match rx
            .recv_timeout(Duration::from_secs(60))
            .expect("events within 60 s")
        {
            Event::Token { id, .. } => toks.push(id),
            Event::Text(_) => {}
            Event::Done(f) => return (toks, f.cached_tokens),
            Event::Failed(e) | Event::Interrupted(e) => panic!("failed: {e}"),
        }
    }
}

/// Requests that share a system prompt `s`: one arrives while another that starts with `s`
/// is running (its positions are copied from the running sequence), two more after it
/// ended (from the kept caches, which stay kept while slots are free). With the prefix
/// cache on each takes `s` from another's cache, with it off none does; the tokens are
/// `want`'s either way.
fn check_prefix_sharing(sched: &Scheduler, on: bool, want: &dyn Fn(&[u32], usize) -> Vec<u32>) {
    let ps = prompts(320);
    let s: Vec<u32> = ps[1].iter().chain(&ps[3]).chain(&ps[0]).copied().collect();
    let with = |tail: &[u32]| -> Vec<u32> { s.iter().chain(tail).copied().collect() };
    let expect = |n: usize| if on { n } else { 0 };
    let a = with(&[5, 6]);
    let (_ta, rx_a) = submit(sched, &a, 60);
    // once A has its first token its prompt is in its cache
    match rx_a.recv_timeout(Duration::from_secs(60)).unwrap() {
        Event::Token { .. } => {}
        e => panic!("{e:?}"),
    }
    let b = with(&[7, 8]);
    let (_tb, rx_b) = submit(sched, &b, 5);
    let (got, cached) = tokens_and_cached(&rx_b);
    assert_eq!(got, want(&b, 5), "B, beside the running A");
    assert_eq!(
        cached,
        expect(s.len()),
        "B takes the system prompt from the running A"
    );
    let (rest, cached) = tokens_and_cached(&rx_a);
    assert_eq!(cached, 0);
    assert_eq!(rest.len(), 59);
    for tail in [&[9u32][..], &[10, 11]] {
        let c = with(tail);
        let (_t, rx) = submit(sched, &c, 4);
        let (got, cached) = tokens_and_cached(&rx);
        assert_eq!(got, want(&c, 4), "{tail:?}");
        assert_eq!(cached, expect(s.len()), "{tail:?} from a kept cache");
    }
    let kept = sched.stats().kept_tokens.load(Ordering::Relaxed);
    assert_eq!(kept > 0, on, "{kept} positions kept");
}

/// Three requests with one long system prompt arriving at once (a fresh start, nothing
/// kept): the first runs it, the others wait for it and copy it (with the cache on).
fn check_arrivals_at_once(sched: &Scheduler, on: bool, want: &dyn Fn(&[u32], usize) -> Vec<u32>) {
    let s: Vec<u32> = (0..100).map(|i| (i * 11 + 5) % 320).collect();
    let with = |tail: &[u32]| -> Vec<u32> { s.iter().chain(tail).copied().collect() };
    let reqs: Vec<Vec<u32>> = [&[3u32][..], &[4, 5], &[6]]
        .iter()
        .map(|t| with(t))
        .collect();
    let subs: Vec<_> = reqs.iter().map(|p| submit(sched, p, 6)).collect();
    for (i, (p, (_t, rx))) in reqs.iter().zip(&subs).enumerate() {
        let (got, cached) = tokens_and_cached(rx);
        assert_eq!(got, want(p, 6), "request {i}");
        let expect = if on && i > 0 { s.len() } else { 0 };
        assert_eq!(cached, expect, "request {i}");
    }
}

#[test]
fn sequences_share_a_prompts_start_across_slots() {
    let dir = tempfile::tempdir().unwrap();
    let m = Arc::new(load(&tiny(
        TinyModelSpec::qwen2(21),
        GgmlType::Q8_0,
        dir.path(),
    )));
    for on in [true, false] {
        let sched = Scheduler::start(
            m.clone(),
            SchedulerConfig {
                max_batch: 3,
                max_queue: 4,
                ctx: 256,
                prefix_cache: on,
                draft_max: 0,
                adaptive_drafts: false,
            },
        )
        .unwrap();
        check_arrivals_at_once(&sched, on, &|p, n| alone(&m, p, n));
        check_prefix_sharing(&sched, on, &|p, n| alone(&m, p, n));
    }
}

#[test]
fn split_sequences_share_a_prompts_start_on_every_rank() {
    use shoal_engine::shard::Layout;

    let dir = tempfile::tempdir().unwrap();
    let path = tiny(TinyModelSpec::qwen2(22), GgmlType::Q8_0, dir.path());
    let one = load(&path);
    let source = ModelSource::Gguf(path.clone());
    for (tp, pp) in [(2, 1), (1, 2)] {
        let (ctx, m, workers) = common::split_ranks(&source, Layout { tp, pp }, 256);
        let config = SchedulerConfig {
            max_batch: 3,
            max_queue: 4,
            ctx: 256,
            prefix_cache: true,
            draft_max: 0,
            adaptive_drafts: false,
        };
        let sched = Scheduler::start_split(Arc::new(m), ctx, config).unwrap();
        check_arrivals_at_once(&sched, true, &|p, n| alone(&one, p, n));
        check_prefix_sharing(&sched, true, &|p, n| alone(&one, p, n));
        assert!(sched.failure().is_none(), "tp {tp} pp {pp}");
        drop(sched);
        for w in workers {
            w.join().unwrap().unwrap();
        }
    }
}

/// Prompt-lookup speculative decoding changes nothing but the steps: two sequences at once,
/// greedy and seeded sampling with a repetition penalty, give the tokens they give without
/// it, and drafts were made and some taken (the prompts repeat themselves, and so does a
/// tiny model's output).
#[test]
fn lookup_decoding_gives_the_same_tokens_in_fewer_steps() {
    let dir = tempfile::tempdir().unwrap();
    let m = Arc::new(load(&tiny(
        TinyModelSpec::qwen2(23),
        GgmlType::Q8_0,
        dir.path(),
    )));
    let cycle: Vec<u32> = (0..12).map(|i| (i * 29 + 7) % 320).collect();
    let prompts: Vec<Vec<u32>> = vec![
        cycle.iter().cycle().take(40).copied().collect(),
        cycle.iter().rev().cycle().take(30).copied().collect(),
    ];
    let configs = [
        SamplerConfig::default(),
        SamplerConfig {
            temperature: 0.8,
            seed: 11,
            repeat_penalty: 1.1,
            ..SamplerConfig::default()
        },
    ];
    for sampler in configs {
        let run = |lookup: usize, adaptive_drafts: bool| {
            let sched = Scheduler::start(
                m.clone(),
                SchedulerConfig {
                    max_batch: 2,
                    max_queue: 2,
                    ctx: 256,
                    prefix_cache: false,
                    draft_max: lookup,
                    adaptive_drafts,
                },
            )
            .unwrap();
            let tokens = generate_all(&sched, &prompts, &[60, 60], &sampler);
            let s = sched.stats();
            let steps = s.decode_steps.load(Ordering::Relaxed);
            let drafted = s.drafted.load(Ordering::Relaxed);
            let taken = s.accepted_drafts.load(Ordering::Relaxed);
            (tokens, steps, drafted, taken)
        };
        let (want, plain_steps, d0, _) = run(0, false);
        let (got, steps, drafted, taken) = run(6, false);
        assert_eq!(d0, 0);
        assert_eq!(got, want, "{sampler:?}");
        // drafts checked as the measured costs and acceptance choose: the same tokens
        let (adapted, _, _, _) = run(6, true);
        assert_eq!(adapted, want, "{sampler:?}, adaptive drafts");
        assert!(drafted > 0 && taken > 0, "{drafted} drafted, {taken} taken");
        assert!(steps < plain_steps, "{steps} steps against {plain_steps}");
        eprintln!(
            "{sampler:?}: {taken} of {drafted} drafts taken; {steps} decode steps against {plain_steps}"
        );
    }
}

/// A draft model that is the model itself drafts what the model then chooses: with greedy
/// decoding every drafted token is taken, and a step checks the whole draft.
#[test]
fn a_draft_model_identical_to_the_model_has_every_draft_taken() {
    let dir = tempfile::tempdir().unwrap();
    let m = Arc::new(load(&tiny(
        TinyModelSpec::qwen2(27),
        GgmlType::F32,
        dir.path(),
    )));
    let config = SchedulerConfig {
        max_batch: 1,
        max_queue: 1,
        ctx: 128,
        prefix_cache: false,
        draft_max: 4,
        adaptive_drafts: false,
    };
    let prompt: Vec<u32> = (0..20).map(|i| (i * 13 + 5) % 320).collect();
    let plain = Scheduler::start(
        m.clone(),
        SchedulerConfig {
            draft_max: 0,
            ..config
        },
    )
    .unwrap();
    let itself = Scheduler::start_with_draft(m.clone(), m.clone(), config).unwrap();
    let run = |sched: &Scheduler| {
        let (tx, rx) = mpsc::channel();
        let _t = sched
            .submit(
                request(prompt.clone(), 41),
                Box::new(move |e| tx.send(e).is_ok()),
            )
            .unwrap();
        collect(&rx).0
    };
    assert_eq!(run(&itself), run(&plain));
    // 40 tokens after the first: 8 steps of 1 + 4
    assert_eq!(draft_counts(&itself, 8), (32, 32, 8));
}

/// The scheduler's (drafted, taken, decode steps), once it counted `steps` steps or a second
/// passed: a step is counted after its sequences' events went out, so a reader that just saw
/// the last token may be ahead of the count.
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

/// A draft model (here another tiny model with the same tokenizer) changes nothing but the
/// steps either; a draft model with another vocabulary is refused at start.
#[test]
fn draft_model_decoding_gives_the_same_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let m = Arc::new(load(&tiny(
        TinyModelSpec::qwen2(24),
        GgmlType::Q8_0,
        dir.path(),
    )));
    let sub = dir.path().join("draft");
    std::fs::create_dir_all(&sub).unwrap();
    let spec = TinyModelSpec {
        n_layers: 1,
        ..TinyModelSpec::qwen2(25)
    };
    let draft = Arc::new(load(&tiny(spec, GgmlType::F32, &sub)));
    let prompt: Vec<u32> = (0..30).map(|i| (i * 17 + 3) % 320).collect();
    for sampler in [
        SamplerConfig::default(),
        SamplerConfig {
            temperature: 0.9,
            seed: 5,
            ..SamplerConfig::default()
        },
    ] {
        let config = SchedulerConfig {
            max_batch: 2,
            max_queue: 2,
            ctx: 256,
            prefix_cache: false,
            draft_max: 5,
            adaptive_drafts: false,
        };
        let run = |sched: &Scheduler| {
            let mut r = request(prompt.clone(), 40);
            r.sampler = sampler.clone();
            let (tx, rx) = mpsc::channel();
            let _t = sched
                .submit(r, Box::new(move |e| tx.send(e).is_ok()))
                .unwrap();
            collect(&rx).0
        };
        let plain = Scheduler::start(
            m.clone(),
            SchedulerConfig {
                draft_max: 0,
                adaptive_drafts: false,
                ..config
            },
        )
        .unwrap();
        let with = Scheduler::start_with_draft(m.clone(), draft.clone(), config).unwrap();
        let adaptive = Scheduler::start_with_draft(
            m.clone(),
            draft.clone(),
            SchedulerConfig {
                adaptive_drafts: true,
                ..config
            },
        )
        .unwrap();
        let want = run(&plain);
        assert_eq!(run(&with), want, "{sampler:?}");
        assert_eq!(run(&adaptive), want, "{sampler:?}, adaptive drafts");
        let drafted = with.stats().drafted.load(Ordering::Relaxed);
        assert!(drafted > 0, "nothing drafted");
    }
    let other_dir = dir.path().join("other");
    std::fs::create_dir_all(&other_dir).unwrap();
    let other = TinyModelSpec {
        vocab_size: 400,
        ..TinyModelSpec::qwen2(26)
    };
    let other = Arc::new(load(&tiny(other, GgmlType::F32, &other_dir)));
    let e = Scheduler::start_with_draft(
        m.clone(),
        other,
        SchedulerConfig {
            max_batch: 1,
            max_queue: 1,
            ctx: 64,
            prefix_cache: false,
            draft_max: 4,
            adaptive_drafts: false,
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("vocabulary"), "{e}");
}

/// A draft model on a split's lead: its drafts are checked in one split step of every rank
/// (tensor, pipeline and both), and greedy and seeded sampling give one rank's plain tokens,
/// with every draft checked or as many as pay. The model itself as its own draft has every
/// draft taken on a pipeline (whose stages compute as one rank does), and every draft after
/// the first made while the second stage checked the one before it.
#[test]
fn a_split_checks_a_draft_models_drafts() {
    use shoal_engine::shard::Layout;

    let dir = tempfile::tempdir().unwrap();
    let path = tiny(TinyModelSpec::qwen2(24), GgmlType::Q8_0, dir.path());
    let m = Arc::new(load(&path));
    let sub = dir.path().join("draft");
    std::fs::create_dir_all(&sub).unwrap();
    let spec = TinyModelSpec {
        n_layers: 1,
        ..TinyModelSpec::qwen2(25)
    };
    let draft = Arc::new(load(&tiny(spec, GgmlType::F32, &sub)));
    let prompts: Vec<Vec<u32>> = vec![
        (0..30).map(|i| (i * 17 + 3) % 320).collect(),
        (0..12).map(|i| (i * 5 + 1) % 320).collect(),
    ];
    let lens = [40, 25];
    let config = SchedulerConfig {
        max_batch: 2,
        max_queue: 2,
        ctx: 256,
        prefix_cache: false,
        draft_max: 5,
        adaptive_drafts: false,
    };
    let source = ModelSource::Gguf(path.clone());
    for sampler in [
        SamplerConfig::default(),
        SamplerConfig {
            temperature: 0.9,
            seed: 5,
            ..SamplerConfig::default()
        },
    ] {
        let plain = Scheduler::start(
            m.clone(),
            SchedulerConfig {
                draft_max: 0,
                ..config
            },
        )
        .unwrap();
        let want = generate_all(&plain, &prompts, &lens, &sampler);
        drop(plain);
        for (tp, pp) in [(2, 1), (1, 2), (2, 2)] {
            for adaptive_drafts in [false, true] {
                let config = SchedulerConfig {
                    adaptive_drafts,
                    ..config
                };
                let (got, drafted) = on_split_with(
                    &source,
                    Layout { tp, pp },
                    config,
                    Some(draft.clone()),
                    |s| {
                        let got = generate_all(s, &prompts, &lens, &sampler);
                        (got, s.stats().drafted.load(Ordering::Relaxed))
                    },
                );
                let case = format!("tp {tp} pp {pp}, {sampler:?}, adaptive {adaptive_drafts}");
                assert_eq!(got, want, "{case}");
                assert!(adaptive_drafts || drafted > 0, "{case}: nothing drafted");
            }
        }
    }
    // the model as its own draft
    let f32_dir = dir.path().join("f32");
    std::fs::create_dir_all(&f32_dir).unwrap();
    let path = tiny(TinyModelSpec::qwen2(27), GgmlType::F32, &f32_dir);
    let itself = Arc::new(load(&path));
    let config = SchedulerConfig {
        max_batch: 1,
        max_queue: 1,
        ctx: 128,
        prefix_cache: false,
        draft_max: 4,
        adaptive_drafts: false,
    };
    let prompt: Vec<u32> = (0..20).map(|i| (i * 13 + 5) % 320).collect();
    let source = ModelSource::Gguf(path);
    let ((drafted, taken, steps), ahead) = on_split_with(
        &source,
        Layout { tp: 1, pp: 2 },
        config,
        Some(itself),
        |s| {
            generate_all(
                s,
                std::slice::from_ref(&prompt),
                &[41],
                &SamplerConfig::default(),
            );
            let counts = draft_counts(s, 8);
            (counts, s.stats().drafted_ahead.load(Ordering::Relaxed))
        },
    );
    // 40 tokens after the first: 8 steps of 1 + 4
    assert_eq!((drafted, taken, steps), (32, 32, 8));
    // every draft after the first was drafted while the second stage checked the one
    // before it (past it, guessing the token after it right)
    assert_eq!(ahead, 28);
}

/// Allows exactly the given tokens, in order.
struct Forced(Vec<u32>, usize);

impl shoal_engine::scheduler::TokenConstraint for Forced {
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), shoal_engine::EngineError> {
        let want = self.0[self.1] as usize;
        for (i, l) in logits.iter_mut().enumerate() {
            if i != want {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }
    fn commit(&mut self, _token: u32) -> Result<(), shoal_engine::EngineError> {
        self.1 += 1;
        Ok(())
    }
    fn is_finished(&self) -> bool {
        self.1 >= self.0.len()
    }
}

/// A control token generated mid-output gives no text, unless the request asks for control
/// tokens' text (output parsers that read markup made of them).
#[test]
fn control_tokens_give_their_text_only_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let m = Arc::new(load(&tiny(
        TinyModelSpec::qwen2(9),
        GgmlType::F32,
        dir.path(),
    )));
    let ids = m.tokenizer.encode("x<|im_start|>y", false, true).unwrap();
    assert_eq!(ids.len(), 3, "{ids:?}");
    let sched = Scheduler::start(
        m.clone(),
        SchedulerConfig {
            max_batch: 1,
            max_queue: 2,
            ctx: 64,
            prefix_cache: false,
            draft_max: 0,
            adaptive_drafts: false,
        },
    )
    .unwrap();
    for (special_text, want) in [(false, "xy"), (true, "x<|im_start|>y")] {
        let mut r = request(vec![1, 2, 3], 10);
        r.constraint = Some(Box::new(Forced(ids.clone(), 0)));
        r.special_text = special_text;
        let done = sched.generate(r, &mut |_| true).unwrap();
        assert_eq!(done.text, want);
    }
}
