//! `shoal bench MODEL`: prefill and decode speed the way llama-bench measures them (`-p`
//! prompt tokens in one batch; `-n` tokens decoded one at a time; both from an empty
//! context, or with `-d` after that many tokens already in the cache, filled untimed),
//! repeated, with median and spread — and beside the decode figure the memory-bandwidth
//! ceiling: weight bytes read per token over the measured read bandwidth (the KV cache's
//! reads, which grow with the depth, are printed beside it and not counted in it).
//! A shared machine's bandwidth drifts between minutes, so the bandwidth is probed after
//! every decode repetition and each repetition is set against its own probe; the host's
//! steal time (CPU time the hypervisor gave other guests) during the decodes is printed too.
//! On a GPU (`--device gpu`) the bandwidth is the GPU's own, probed by a kernel that
//! streams device memory, and `--profile` prints what a decoded token asks of the device.

use std::time::Instant;

use anyhow::Context;
use clap::Args;
use serde::Serialize;
use shoal_engine::bench::ReadProbe;
use shoal_engine::transformer::argmax;

use crate::ComputeArgs;

#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub what: Option<BenchWhat>,
    /// A GGUF file, a Hugging Face folder or cache id, or a fetched catalog key.
    #[arg(required = true)]
    pub model: Option<String>,
    /// Prompt tokens per prefill run (0 skips prefill).
    #[arg(short = 'p', long = "n-prompt", default_value_t = 512)]
    pub n_prompt: usize,
    /// Tokens per decode run (0 skips decode).
    #[arg(short = 'n', long = "n-gen", default_value_t = 128)]
    pub n_gen: usize,
    /// Tokens already in the cache when each prefill and decode run starts (llama-bench's
    /// `-d`), filled untimed before each run: how fast a long conversation goes on.
    #[arg(short = 'd', long = "depth", default_value_t = 0)]
    pub depth: usize,
    /// Repetitions of each measurement.
    #[arg(short = 'r', long = "repetitions", default_value_t = 5)]
    pub reps: usize,
    /// One JSON object on stdout.
    #[arg(long)]
    pub json: bool,
    /// Also time each part of the decode step and print where a token's time goes.
    #[arg(long)]
    pub profile: bool,
    /// Also measure this node's decode costs of the model's shape for the planner (one
    /// sequence from an empty cache, -n tokens -r times, after the benchmark) and keep them
    /// in the calibration store, where `shoal serve` publishes them to the cluster's
    /// planner.
    #[arg(long)]
    pub calibrate: bool,
    #[command(flatten)]
    pub compute: ComputeArgs,
    #[command(flatten)]
    pub split: crate::ranks::SplitArgs,
    /// Decode this many sequences at once; decode tokens/s is then the total. On one rank,
    /// one batched step runs a token of every sequence (continuous batching); with --tp/--pp
    /// each sequence is submitted before the others are collected (keeps stages busy).
    #[arg(long, default_value_t = 1)]
    pub seqs: usize,
}

/// Benchmarks of a part rather than a model.
#[derive(clap::Subcommand, Debug)]
pub enum BenchWhat {
    /// Matrix kernel speed per weight type and instruction set.
    Kernels(crate::bench_kernels::KernelBenchArgs),
    /// All-reduce and send/recv latency by size and rank count, over TCP loopback, shared
    /// memory and in-process channels, next to the raw TCP round trip.
    Comm(CommBenchArgs),
    /// Throughput of a running `shoal serve` as concurrent streaming clients grow.
    Serve(crate::bench_serve::ServeBenchArgs),
}

/// Options of `shoal bench comm`.
#[derive(Args, Debug)]
pub struct CommBenchArgs {
    /// Rank counts to measure, comma separated.
    #[arg(long, value_delimiter = ',', default_values_t = [2usize, 4])]
    pub ranks: Vec<usize>,
    /// Message sizes in bytes, comma separated.
    #[arg(long, value_delimiter = ',', default_values_t = [64usize, 1024, 8192, 65536, 1 << 20])]
    pub sizes: Vec<usize>,
    /// Timed repetitions per measurement.
    #[arg(long, default_value_t = 2000)]
    pub iters: usize,
    /// One JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// Median, minimum and maximum of a set of runs.
#[derive(Debug, Serialize, Clone, Copy)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    pub fn of(xs: &[f64]) -> Option<Spread> {
        if xs.is_empty() {
            return None;
        }
        let mut v = xs.to_vec();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Some(Spread {
            median,
            min: v[0],
            max: v[n - 1],
        })
    }
}

#[derive(Debug, Serialize)]
struct Report {
    model: String,
    threads: usize,
    n_prompt: usize,
    n_gen: usize,
    /// Tokens in the cache before each run.
    depth: usize,
    /// Positions in a decoding sequence's cache after its last run: `depth + n_gen`.
    #[serde(skip_serializing_if = "Option::is_none")]
    decode_end_position: Option<usize>,
    /// KV cache bytes one position takes in every layer (for latent attention, the latent
    /// and its rope key).
    kv_bytes_per_token: u64,
    /// KV cache bytes attention reads per decoded token, on average over a run (not in
    /// the ceiling, which counts weights).
    kv_read_bytes_per_token: u64,
    repetitions: usize,
    /// Median prefill tokens/s.
    prefill_tok_s: Option<f64>,
    prefill: Option<Spread>,
    /// Median decode tokens/s.
    decode_tok_s: Option<f64>,
    decode: Option<Spread>,
    weight_bytes_per_token: u64,
    /// Read bandwidth with the benchmark's thread count, GB/s: the median of the probes
    /// (one after each decode repetition, or one in all without decode).
    mem_read_gb_s: f64,
    /// Each probe, GB/s, in repetition order.
    mem_read_gb_s_probes: Vec<f64>,
    /// Decode tokens/s if every weight byte were read once at `mem_read_gb_s`.
    decode_ceiling_tok_s: f64,
    /// Each decode repetition against the ceiling of the probe right after it: median, min
    /// and max of those fractions.
    decode_fraction_of_ceiling: Option<Spread>,
    /// Fraction of CPU time the hypervisor took for other guests while decoding (Linux's
    /// `/proc/stat`; absent elsewhere).
    host_steal: Option<f64>,
    /// Where a decoded token's time goes (with `--profile`, on the CPU).
    #[serde(skip_serializing_if = "Option::is_none")]
    decode_profile: Option<Vec<OpTime>>,
    /// The backend the model ran on (`cpu`, `gpu`).
    backend: &'static str,
    /// The shape of a decoded token's work on a GPU (with `--profile`).
    #[serde(skip_serializing_if = "Option::is_none")]
    device_step: Option<DeviceStep>,
    /// This node's measured costs of the model's shape (with `--calibrate`).
    #[serde(skip_serializing_if = "Option::is_none")]
    calibration: Option<shoal_planner::Calibration>,
    /// Where the calibration was stored.
    #[serde(skip_serializing_if = "Option::is_none")]
    calibration_file: Option<String>,
}

/// What one decoded token asks of a GPU, averaged over the timed decode steps.
#[derive(Debug, Serialize)]
struct DeviceStep {
    /// Queue submissions per token (each is a wait for the device).
    submissions_per_token: f64,
    /// Compute dispatches per token.
    dispatches_per_token: f64,
    /// Dispatches per layer per token.
    dispatches_per_layer: f64,
    /// Bytes read back to the host per token.
    read_back_bytes_per_token: f64,
    /// Milliseconds per token the host spent recording the step's dispatches.
    host_record_ms_per_token: f64,
    /// Milliseconds per token the host waited for the device.
    device_wait_ms_per_token: f64,
}

/// One line of the decode profile.
#[derive(Debug, Serialize)]
struct OpTime {
    op: &'static str,
    ms_per_token: f64,
    /// Fraction of decode time.
    share: f64,
    /// For a matrix product: the weight bytes it reads per token over its time, in GB/s
    /// (absent for other ops, and for models whose tensors the bench cannot attribute).
    #[serde(skip_serializing_if = "Option::is_none")]
    weight_gb_s: Option<f64>,
}

/// KV cache bytes attention reads per decoded token, on average over `n_gen` tokens decoded
/// after `depth`: the step at position `p` reads `p + 1` positions of every layer, or at
/// most the sliding window's in a local layer.
fn kv_read_bytes_per_token(
    cfg: &shoal_engine::config::ModelConfig,
    depth: usize,
    n_gen: usize,
) -> u64 {
    let per_layer = cfg.kv_bytes_per_token_per_layer();
    let steps = n_gen.max(1);
    let positions: u64 = (0..cfg.n_layer)
        .map(|layer| {
            let window = cfg
                .sliding_window
                .filter(|_| cfg.is_local_layer(layer))
                .unwrap_or(usize::MAX);
            (0..steps)
                .map(|i| (depth + i + 1).min(window) as u64)
                .sum::<u64>()
        })
        .sum();
    per_layer * positions / steps as u64
}

/// Deterministic pseudo-random prompt tokens (as llama-bench uses random tokens).
pub fn prompt_tokens(n: usize, vocab: usize) -> Vec<u32> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % vocab as u64) as u32
        })
        .collect()
}

/// Read bandwidth in GB/s with `threads` threads over a buffer much larger than the caches,
/// read the way the weight kernels read (see [`ReadProbe::best_of`]).
pub fn measure_read_bandwidth(threads: usize) -> f64 {
    measure_read_bandwidth_with(threads, PROBE_BYTES, PROBE_PASSES)
}

/// Bytes the bandwidth probe streams: past any last-level cache of today's desktops.
const PROBE_BYTES: usize = 512 << 20;
/// Passes at each way of reading per probe.
const PROBE_PASSES: usize = 7;

/// [`measure_read_bandwidth`] over `bytes` bytes, best of `passes`.
pub fn measure_read_bandwidth_with(threads: usize, bytes: usize, passes: usize) -> f64 {
    ReadProbe::new(bytes).best_of(threads, passes)
}

/// Seconds `decode` takes on a compute-pool thread, where the server's scheduler runs its
/// steps (`Scheduler::run`). From any other thread each step starts and ends with a hand-off
/// to the pool and back, which the server never pays.
pub fn timed_on_pool(decode: impl FnOnce() -> anyhow::Result<()> + Send) -> anyhow::Result<f64> {
    rayon::scope(|_| {
        let t0 = Instant::now();
        decode()?;
        Ok(t0.elapsed().as_secs_f64())
    })
}

/// The host's CPU time counters from `/proc/stat` (all CPUs, in clock ticks): `(steal,
/// total)`; `None` where there is no such file or it reads otherwise.
fn cpu_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    parse_cpu_ticks(stat.lines().next()?)
}

/// `(steal, total)` from `/proc/stat`'s first line (`cpu user nice system idle iowait irq
/// softirq steal ...`).
fn parse_cpu_ticks(line: &str) -> Option<(u64, u64)> {
    let mut fields = line.split_whitespace();
    if fields.next()? != "cpu" {
        return None;
    }
    let ticks: Vec<u64> = fields
        .take(8)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    (ticks.len() == 8).then(|| (ticks[7], ticks.iter().sum()))
}

pub fn main(mut args: BenchArgs) -> anyhow::Result<()> {
    let model_arg = match (args.what.take(), &args.model) {
        (Some(BenchWhat::Kernels(k)), _) => return crate::bench_kernels::main(k),
        (Some(BenchWhat::Serve(s)), _) => return crate::bench_serve::main(s),
        (Some(BenchWhat::Comm(c)), _) => {
            return crate::bench_comm::run(&c.ranks, &c.sizes, c.iters, c.json)
        }
        (None, Some(m)) => m.clone(),
        (None, None) => anyhow::bail!("name a model to benchmark, or `shoal bench kernels`"),
    };
    if args.reps == 0 {
        anyhow::bail!("-r/--repetitions must be at least 1");
    }
    if args.seqs == 0 || args.seqs > shoal_engine::parallel::MAX_SEQUENCES {
        anyhow::bail!(
            "--seqs {} is out of range (1..={})",
            args.seqs,
            shoal_engine::parallel::MAX_SEQUENCES
        );
    }
    if args.split.is_split() {
        if args.depth > 0 {
            anyhow::bail!("-d/--depth is measured on one rank for now; use it without --tp/--pp");
        }
        if args.profile || args.calibrate {
            anyhow::bail!(
                "--profile and --calibrate time one rank's step; use them without --tp/--pp"
            );
        }
        return crate::bench_split::main(&args, &model_arg);
    }
    if args.calibrate && args.n_gen == 0 {
        anyhow::bail!("--calibrate decodes -n tokens -r times; give -n > 0");
    }
    let threads = args.compute.apply()?;
    crate::rank_device(0, 1)?;
    let model = crate::models::open(&model_arg)?;
    let t = &model.transformer;
    let vocab = t.config().vocab;
    let deepest = args.depth.saturating_add(args.n_prompt.max(args.n_gen));
    if deepest > t.config().context_len {
        anyhow::bail!(
            "-d {} with -p {} / -n {} needs {deepest} positions, more than the model's \
             context of {}; ask for fewer",
            args.depth,
            args.n_prompt,
            args.n_gen,
            t.config().context_len
        );
    }
    let ctx = (deepest + 1).min(t.config().context_len);
    // the same `depth` tokens before every run, as if a conversation went on
    let history = prompt_tokens(args.depth, vocab);
    let fill = |cache: &mut shoal_engine::kv_cache::KvCache| -> anyhow::Result<()> {
        cache.clear();
        if !history.is_empty() {
            t.prefill(&history, cache)?;
        }
        Ok(())
    };
    let mut cache = t.new_cache(ctx);
    // warm-up: page the weights in, fill allocator pools
    t.prefill(&prompt_tokens(16.min(ctx), vocab), &mut cache)?;
    let mut pp = Vec::new();
    let mut tg = Vec::new();
    let mut decode_secs = 0.0;
    // the ceiling is the memory the weights are read from: the GPU's own on a GPU
    let on_gpu = t.backend() == "gpu";
    let probe = (!on_gpu).then(|| ReadProbe::new(PROBE_BYTES));
    let mut bws = Vec::new();
    let read_bw = || -> anyhow::Result<f64> {
        Ok(match &probe {
            Some(p) => p.best_of(threads, PROBE_PASSES),
            None => shoal_engine::device::gpu_read_bandwidth(crate::rank_device(0, 1)?)?,
        })
    };
    let (mut stolen, mut ticks) = (Some(0u64), 0u64);
    let mut decode_end = None;
    // device counters over the single-sequence decode steps
    let (mut counted, mut counted_tokens) = (shoal_engine::device::GpuCounters::default(), 0usize);
    shoal_engine::profile::reset();
    for rep in 0..args.reps {
        if args.n_prompt > 0 {
            fill(&mut cache)?;
            let toks = prompt_tokens(args.n_prompt, vocab);
            let t0 = Instant::now();
            t.prefill(&toks, &mut cache)?;
            pp.push(args.n_prompt as f64 / t0.elapsed().as_secs_f64());
        }
        let before = cpu_ticks();
        if args.n_gen > 0 && args.seqs > 1 {
            // one batched step decodes a token of every sequence (continuous batching)
            let mut caches: Vec<_> = (0..args.seqs).map(|_| t.new_cache(ctx)).collect();
            for c in &mut caches {
                fill(c)?;
            }
            let mut toks: Vec<u32> = prompt_tokens(args.seqs + rep, vocab)[rep..].to_vec();
            shoal_engine::profile::enable(args.profile);
            let secs = timed_on_pool(|| {
                for _ in 0..args.n_gen {
                    let mut refs: Vec<_> = caches.iter_mut().collect();
                    // the values the server's scheduler samples from (no tensor)
                    let logits = t.forward_batch(&toks, &mut refs)?;
                    let width = (logits.len() / toks.len()).max(1);
                    for (tok, row) in toks.iter_mut().zip(logits.chunks(width)) {
                        *tok = argmax(row) as u32;
                    }
                }
                Ok(())
            })?;
            shoal_engine::profile::enable(false);
            decode_secs += secs;
            tg.push((args.n_gen * args.seqs) as f64 / secs);
            decode_end = caches.first().map(|c| c.len());
        } else if args.n_gen > 0 {
            fill(&mut cache)?;
            let mut tok = prompt_tokens(1 + rep, vocab)[rep];
            shoal_engine::profile::enable(args.profile);
            let before = t.device_counters();
            let secs = timed_on_pool(|| {
                for _ in 0..args.n_gen {
                    let logits = t.forward_last(&[tok], &mut cache)?;
                    tok = argmax(&logits) as u32;
                }
                Ok(())
            })?;
            shoal_engine::profile::enable(false);
            if let (Some(b), Some(a)) = (before, t.device_counters()) {
                counted.submissions += a.submissions - b.submissions;
                counted.dispatches += a.dispatches - b.dispatches;
                counted.read_back += a.read_back - b.read_back;
                counted.record_ns += a.record_ns - b.record_ns;
                counted.wait_ns += a.wait_ns - b.wait_ns;
                counted_tokens += args.n_gen;
            }
            decode_secs += secs;
            tg.push(args.n_gen as f64 / secs);
            decode_end = Some(cache.len());
        }
        if args.n_gen > 0 {
            match (before, cpu_ticks()) {
                (Some((s0, t0)), Some((s1, t1))) => {
                    stolen = stolen.map(|s| s + s1.saturating_sub(s0));
                    ticks += t1.saturating_sub(t0);
                }
                _ => stolen = None,
            }
            bws.push(read_bw()?);
        }
    }
    if bws.is_empty() {
        bws.push(read_bw()?);
    }
    let bw = Spread::of(&bws).map_or(0.0, |s| s.median);
    let device_step = (args.profile && on_gpu && counted_tokens > 0).then(|| {
        let n = counted_tokens as f64;
        DeviceStep {
            submissions_per_token: counted.submissions as f64 / n,
            dispatches_per_token: counted.dispatches as f64 / n,
            dispatches_per_layer: counted.dispatches as f64 / n / t.config().n_layer.max(1) as f64,
            read_back_bytes_per_token: counted.read_back as f64 / n,
            host_record_ms_per_token: counted.record_ns as f64 / n / 1e6,
            device_wait_ms_per_token: counted.wait_ns as f64 / n / 1e6,
        }
    });
    // the per-op times are where the host spends a step: on a GPU that is recording
    // commands, not computing, so they are left out there
    let profile = (args.profile && !on_gpu).then(|| {
        let tokens = (args.n_gen * args.reps).max(1) as f64;
        let mut ops: Vec<OpTime> = shoal_engine::profile::snapshot()
            .into_iter()
            .map(|(op, s)| {
                let bytes = model.weight_bytes_by_op.iter().find(|(o, _)| *o == op);
                OpTime {
                    op: op.name(),
                    ms_per_token: s * 1e3 / tokens,
                    share: s / decode_secs.max(1e-12),
                    weight_gb_s: bytes
                        .filter(|_| s > 0.0)
                        .map(|(_, b)| *b as f64 * tokens / s / 1e9),
                }
            })
            .collect();
        let accounted: f64 = ops.iter().map(|o| o.share).sum();
        ops.push(OpTime {
            op: "rest (sampling, glue)",
            ms_per_token: (1.0 - accounted).max(0.0) * decode_secs * 1e3 / tokens,
            share: (1.0 - accounted).max(0.0),
            weight_gb_s: None,
        });
        ops
    });
    let calibration = if args.calibrate {
        let profile = shoal_driver::profile_from_model(&model_arg)
            .with_context(|| format!("reading the profile of model {model_arg}"))?;
        let cal = crate::calibrate::measure(&model, &profile, threads, args.n_gen, args.reps)?;
        let path = crate::calibrate::store(&cal)?;
        Some((cal, path))
    } else {
        None
    };
    let prefill = Spread::of(&pp);
    let decode = Spread::of(&tg);
    let bytes = model.weight_bytes_per_token.max(1) as f64;
    let ceiling = bw * 1e9 / bytes;
    let fractions: Vec<f64> = tg
        .iter()
        .zip(&bws)
        .map(|(tok_s, gb_s)| tok_s * bytes / (gb_s * 1e9))
        .collect();
    let host_steal = stolen
        .filter(|_| ticks > 0)
        .map(|s| s as f64 / ticks as f64);
    let report = Report {
        model: model.name.clone(),
        threads,
        n_prompt: args.n_prompt,
        n_gen: args.n_gen,
        depth: args.depth,
        decode_end_position: decode_end,
        kv_bytes_per_token: t.config().kv_bytes_per_token_per_layer() * t.config().n_layer as u64,
        kv_read_bytes_per_token: kv_read_bytes_per_token(t.config(), args.depth, args.n_gen),
        repetitions: args.reps,
        prefill_tok_s: prefill.map(|s| s.median),
        prefill,
        decode_tok_s: decode.map(|s| s.median),
        decode,
        weight_bytes_per_token: model.weight_bytes_per_token,
        mem_read_gb_s: bw,
        mem_read_gb_s_probes: bws,
        decode_ceiling_tok_s: ceiling,
        decode_fraction_of_ceiling: Spread::of(&fractions),
        host_steal,
        decode_profile: profile,
        backend: t.backend(),
        device_step,
        calibration_file: calibration.as_ref().map(|(_, p)| p.display().to_string()),
        calibration: calibration.map(|(c, _)| c),
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    println!(
        "model {}  backend {}  threads {}  repetitions {}",
        report.model, report.backend, threads, args.reps
    );
    // llama-bench's names: "pp128", "tg64", and "pp128 @ d2048" after a fill
    let at = if args.depth > 0 {
        format!(" @ d{}", args.depth)
    } else {
        String::new()
    };
    let width = 7 + at.len();
    if let Some(p) = prefill {
        println!(
            "{:<width$} {:>9.1} tok/s  (min {:.1}, max {:.1})",
            format!("pp{}{at}", args.n_prompt),
            p.median,
            p.min,
            p.max
        );
    }
    if let Some(d) = decode {
        println!(
            "{:<width$} {:>9.1} tok/s  (min {:.1}, max {:.1})  ceiling {:.1} tok/s = {:.1} MB/token at {:.1} GB/s -> {:.0}% of ceiling",
            format!("tg{}{at}", args.n_gen),
            d.median,
            d.min,
            d.max,
            ceiling,
            model.weight_bytes_per_token as f64 / 1e6,
            bw,
            100.0 * d.median / ceiling
        );
        if let Some(f) = report.decode_fraction_of_ceiling {
            println!(
                "             each repetition against the probe right after it: {:.0}% (min {:.0}, max {:.0})",
                100.0 * f.median,
                100.0 * f.min,
                100.0 * f.max
            );
        }
        if args.depth > 0 {
            println!(
                "             the KV cache adds {:.1} MB read per token at this depth (not in the ceiling)",
                report.kv_read_bytes_per_token as f64 / 1e6
            );
        }
        if let Some(steal) = host_steal {
            println!(
                "             host steal while decoding: {:.1}% of CPU time{}",
                100.0 * steal,
                if steal > 0.05 {
                    " (other guests took this machine's cores: not an idle machine)"
                } else {
                    ""
                }
            );
        }
    }
    if let Some(d) = &report.device_step {
        println!(
            "GPU decode step (per token): {:.1} queue submissions, {:.0} dispatches ({:.1} per \
             layer), {:.0} bytes read back; the host records for {:.2} ms and waits {:.2} ms",
            d.submissions_per_token,
            d.dispatches_per_token,
            d.dispatches_per_layer,
            d.read_back_bytes_per_token,
            d.host_record_ms_per_token,
            d.device_wait_ms_per_token
        );
    }
    if let Some(ops) = &report.decode_profile {
        println!("decode profile (per token):");
        for o in ops {
            let reads = o.weight_gb_s.map_or(String::new(), |g| {
                format!(
                    "  weights at {g:5.1} GB/s = {:3.0}% of the probe",
                    100.0 * g / report.mem_read_gb_s.max(1e-9)
                )
            });
            println!(
                "  {:<22} {:>8.3} ms  {:>5.1}%{reads}",
                o.op,
                o.ms_per_token,
                100.0 * o.share
            );
        }
    }
    if let (Some(c), Some(path)) = (&report.calibration, &report.calibration_file) {
        println!(
            "calibration of this shape at {} threads (stored in {path}):",
            c.threads
        );
        for (kind, cost) in [("dense layer", c.dense), ("experts layer", c.moe)] {
            if let Some(cost) = cost {
                println!(
                    "  {kind:<14} decode: {:.3} ms without weights, weights read at {:.1} GB/s; \
                     prefill: {:.1} us per row, {:.2} ns per pair of rows",
                    cost.fixed_secs * 1e3,
                    cost.weights_gbs,
                    cost.prefill_row_secs * 1e6,
                    cost.prefill_pair_secs * 1e9
                );
            }
        }
        println!("  {:<14} read at {:.1} GB/s", "output head", c.head_gbs);
        println!(
            "  {:<14} {:.3} ms per decode step, {:.3} ms per prompt chunk",
            "the rest",
            c.step_secs * 1e3,
            c.prefill_step_secs * 1e3
        );
        println!(
            "  measured at {:.1} tok/s decode, {:.1} tok/s prefill of {} rows",
            c.measured_tok_s, c.measured_prefill_tok_s, c.measured_prefill_rows
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_median() {
        let s = Spread::of(&[3.0, 1.0, 2.0]).unwrap();
        assert_eq!((s.median, s.min, s.max), (2.0, 1.0, 3.0));
        assert_eq!(Spread::of(&[1.0, 2.0]).unwrap().median, 1.5);
        assert!(Spread::of(&[]).is_none());
    }

    #[test]
    fn steal_and_total_from_proc_stat() {
        let line = "cpu  2341809 0 258012 1130762 18659 0 5327 54329 0 0";
        let total = 2341809 + 258012 + 1130762 + 18659 + 5327 + 54329;
        assert_eq!(parse_cpu_ticks(line), Some((54329, total)));
        // a per-CPU line, a short line, and garbage are not the total line
        assert_eq!(parse_cpu_ticks("cpu0 1 2 3 4 5 6 7 8"), None);
        assert_eq!(parse_cpu_ticks("cpu 1 2 3"), None);
        assert_eq!(parse_cpu_ticks("cpu 1 2 x 4 5 6 7 8"), None);
    }

    #[test]
    fn prompt_tokens_in_vocab() {
        assert!(prompt_tokens(1000, 7).iter().all(|&t| t < 7));
        assert_eq!(prompt_tokens(5, 100), prompt_tokens(5, 100));
    }
}
