//! `shoal bench MODEL --tp N --pp M`: prefill and decode speed of a model split over local
//! rank processes (or the ranks of a `--peers` table), measured on rank 0 the way the
//! one-rank benchmark measures (`-p` random prompt tokens from an empty context, `-n` greedy
//! tokens one at a time), with the share of each step rank 0 spends in collectives — sending,
//! receiving and waiting for the other ranks — beside the compute.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use shoal_engine::parallel::{Lead, Want};
use shoal_engine::transformer::argmax;

use crate::bench::{prompt_tokens, BenchArgs, Spread};
use crate::ranks::LeadRank;

#[derive(Debug, Serialize)]
struct SplitReport {
    model: String,
    tp: usize,
    pp: usize,
    threads_per_rank: usize,
    transport: String,
    link_latency_us: f64,
    link_gbps: f64,
    n_prompt: usize,
    n_gen: usize,
    /// Sequences decoded at once (decode tokens/s is their total).
    sequences: usize,
    repetitions: usize,
    prefill_tok_s: Option<f64>,
    prefill: Option<Spread>,
    decode_tok_s: Option<f64>,
    decode: Option<Spread>,
    /// Milliseconds per decoded token rank 0 spends in collectives (including waiting).
    decode_comm_ms_per_token: Option<f64>,
    /// Milliseconds per decoded token rank 0 spends on everything else.
    decode_compute_ms_per_token: Option<f64>,
}

pub fn main(args: &BenchArgs, model_arg: &str) -> anyhow::Result<()> {
    let threads = args.compute.apply()?;
    let ctx_len = args.n_prompt.max(args.n_gen) + 17;
    let comm_ns = Arc::new(AtomicU64::new(0));
    let mut lead_rank = LeadRank::start(
        &args.split,
        model_arg,
        ctx_len,
        threads,
        Some(comm_ns.clone()),
    )?;
    let job = lead_rank.job.clone();
    let capacity = lead_rank.capacity();
    let model = &lead_rank.model;
    let cfg = model.transformer.config().clone();
    if args.n_prompt >= capacity || args.n_gen >= capacity {
        anyhow::bail!(
            "-p {} / -n {} exceed the model's context of {}",
            args.n_prompt,
            args.n_gen,
            cfg.context_len
        );
    }
    let seqs = args.seqs;
    let mut lead = Lead::with_sequences(lead_rank.ctx.clone(), &model.transformer, capacity, seqs)?;
    // warm-up: every rank pages its weights in
    lead.step_with(&prompt_tokens(16, cfg.vocab), Want::Best)?;
    let (mut pp, mut tg) = (Vec::new(), Vec::new());
    let (mut decode_secs, mut decode_comm) = (0.0, 0.0);
    for rep in 0..args.reps {
        if args.n_prompt > 0 {
            lead.truncate(0);
            let toks = prompt_tokens(args.n_prompt, cfg.vocab);
            let t0 = Instant::now();
            for (i, chunk) in toks
                .chunks(shoal_engine::scheduler::PROMPT_CHUNK)
                .enumerate()
            {
                let last = (i + 1) * shoal_engine::scheduler::PROMPT_CHUNK >= toks.len();
                lead.step_with(chunk, if last { Want::Best } else { Want::Nothing })?;
            }
            pp.push(args.n_prompt as f64 / t0.elapsed().as_secs_f64());
        }
        if args.n_gen > 0 {
            let first = prompt_tokens(seqs + rep, cfg.vocab);
            let c0 = comm_ns.load(Ordering::Relaxed);
            let t0 = Instant::now();
            // every sequence in flight: collect the oldest, submit its next token
            let mut done = vec![0usize; seqs];
            for (seq, &tok) in first[rep..].iter().enumerate() {
                lead.select(seq)?;
                lead.truncate(0);
                lead.submit(seq, &[tok], Want::Best)?;
            }
            while done.iter().any(|&d| d < args.n_gen) {
                let (seq, logits) = lead.collect()?;
                done[seq] += 1;
                if done[seq] < args.n_gen {
                    lead.submit(seq, &[argmax(&logits) as u32], Want::Best)?;
                }
            }
            lead.select(0)?;
            let secs = t0.elapsed().as_secs_f64();
            decode_secs += secs;
            decode_comm += (comm_ns.load(Ordering::Relaxed) - c0) as f64 / 1e9;
            tg.push((seqs * args.n_gen) as f64 / secs);
        }
    }
    lead.stop()?;
    drop(lead);
    lead_rank.launched.finish(Duration::from_secs(10));
    let tokens = (seqs * args.n_gen * args.reps) as f64;
    let per_token = |s: f64| (args.n_gen > 0).then(|| s * 1e3 / tokens);
    let prefill = Spread::of(&pp);
    let decode = Spread::of(&tg);
    let report = SplitReport {
        model: model.name.clone(),
        tp: job.tp,
        pp: job.pp,
        threads_per_rank: threads,
        transport: job.transport.clone(),
        link_latency_us: job.link_latency_us,
        link_gbps: job.link_gbps,
        n_prompt: args.n_prompt,
        n_gen: args.n_gen,
        sequences: seqs,
        repetitions: args.reps,
        prefill_tok_s: prefill.map(|s| s.median),
        prefill,
        decode_tok_s: decode.map(|s| s.median),
        decode,
        decode_comm_ms_per_token: per_token(decode_comm),
        decode_compute_ms_per_token: per_token(decode_secs - decode_comm),
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    println!(
        "model {}  tp {} x pp {}  {} thread(s) per rank  transport {}{}  repetitions {}",
        report.model,
        job.tp,
        job.pp,
        threads,
        job.transport,
        if job.link_latency_us > 0.0 || job.link_gbps > 0.0 {
            format!(
                " (emulated link: {} us one way, {} Gbit/s)",
                job.link_latency_us, job.link_gbps
            )
        } else {
            String::new()
        },
        args.reps
    );
    if let Some(p) = prefill {
        println!(
            "pp{:<5} {:>9.1} tok/s  (min {:.1}, max {:.1})",
            args.n_prompt, p.median, p.min, p.max
        );
    }
    if let (Some(d), Some(comm), Some(compute)) = (
        decode,
        report.decode_comm_ms_per_token,
        report.decode_compute_ms_per_token,
    ) {
        println!(
            "tg{:<5} {:>9.1} tok/s  (min {:.1}, max {:.1}){}  per token on rank 0: compute {:.2} ms, collectives and waiting {:.2} ms",
            args.n_gen,
            d.median,
            d.min,
            d.max,
            if seqs > 1 {
                format!(" total over {seqs} sequences in flight")
            } else {
                String::new()
            },
            compute,
            comm
        );
    }
    Ok(())
}
