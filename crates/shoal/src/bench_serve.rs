//! `shoal bench serve`: how a running server's throughput grows with concurrent clients.
//! For each concurrency level it opens that many streaming chat completions at once (each
//! asked for exactly `-n` tokens, `ignore_eos`), and reports per level the aggregate decode
//! tokens/s in the window where every stream is generating (text pieces received in it over
//! its length), the aggregate over the whole level's wall time (prefill included), the
//! median time to first token and per-stream decode rate, each with its ratio to the first
//! level. With `-r R` the levels run R times in turn (1, 16, 1, 16, ...), so a slow minute of
//! a shared machine hits every level alike, and the summary gives per level the median over
//! the rounds.

use std::time::{Duration, Instant};

use clap::Args;
use serde_json::json;

use crate::client::{for_each_event, Client, ClientArgs};

/// Options of `shoal bench serve`.
#[derive(Args, Debug)]
pub struct ServeBenchArgs {
    /// The server's HTTP API.
    #[arg(long, env = "SHOAL_URL", default_value = "http://127.0.0.1:7337")]
    pub url: String,
    /// An API key, when the server has keys.
    #[arg(long, env = "SHOAL_API_KEY", hide_env_values = true)]
    pub key: Option<String>,
    /// The model id to ask for.
    #[arg(long)]
    pub model: String,
    /// Concurrency levels, comma separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 4, 16])]
    pub streams: Vec<usize>,
    /// Tokens generated per stream.
    #[arg(short = 'n', long = "n-gen", default_value_t = 64)]
    pub n_gen: usize,
    /// Rounds over all levels; the summary is the median per level.
    #[arg(short = 'r', long = "rounds", default_value_t = 1)]
    pub rounds: usize,
    /// One JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// One level's figures in one round.
struct Level {
    tokens: usize,
    wall_s: f64,
    aggregate: f64,
    per_stream: f64,
    ttft_ms: f64,
    decode: f64,
}

/// Runs `k` concurrent streams and measures them.
fn measure_level(client: &Client, args: &ServeBenchArgs, k: usize) -> anyhow::Result<Level> {
    let t0 = Instant::now();
    let results: Vec<anyhow::Result<StreamResult>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..k)
            .map(|i| s.spawn(move || one_stream(client, args, i, t0)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a client thread panicked")))
            })
            .collect()
    });
    let results = results.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
    let wall = results.iter().map(|r| r.end).max().unwrap_or_default();
    let tokens: usize = results.iter().map(|r| r.tokens).sum();
    let per_stream = median(
        results
            .iter()
            .map(|r| r.tokens.saturating_sub(1) as f64 / (r.end - r.ttft).as_secs_f64().max(1e-9))
            .collect(),
    );
    let ttft_ms = median(results.iter().map(|r| r.ttft.as_secs_f64() * 1e3).collect());
    // steady state: the window in which every stream was generating
    let from = results.iter().map(|r| r.ttft).max().unwrap_or_default();
    let to = results
        .iter()
        .map(|r| r.arrivals.last().copied().unwrap_or_default())
        .min()
        .unwrap_or_default();
    let in_window: usize = results
        .iter()
        .map(|r| r.arrivals.iter().filter(|&&a| a > from && a <= to).count())
        .sum();
    let decode = if to > from {
        in_window as f64 / (to - from).as_secs_f64()
    } else {
        0.0
    };
    Ok(Level {
        tokens,
        wall_s: wall.as_secs_f64(),
        aggregate: tokens as f64 / wall.as_secs_f64().max(1e-9),
        per_stream,
        ttft_ms,
        decode,
    })
}

struct StreamResult {
    tokens: usize,
    ttft: Duration,
    end: Duration,
    /// When each piece of text arrived.
    arrivals: Vec<Duration>,
}

fn one_stream(
    client: &Client,
    args: &ServeBenchArgs,
    i: usize,
    t0: Instant,
) -> anyhow::Result<StreamResult> {
    let body = json!({
        "model": args.model,
        "messages": [{"role": "user", "content": format!("Tell me story number {i} about a lighthouse keeper.")}],
        "max_tokens": args.n_gen,
        "ignore_eos": true,
        "temperature": 0.7,
        "seed": i,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let reader = client
        .post_stream("/v1/chat/completions", &body)?
        .into_reader();
    let mut ttft = None;
    let mut tokens = 0;
    let mut arrivals = Vec::new();
    for_each_event(reader, |v| {
        if v["choices"][0]["delta"]["content"]
            .as_str()
            .is_some_and(|s| !s.is_empty())
        {
            let now = t0.elapsed();
            ttft.get_or_insert(now);
            arrivals.push(now);
        }
        if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
            tokens = n as usize;
        }
        Ok(())
    })?;
    Ok(StreamResult {
        tokens,
        ttft: ttft.unwrap_or_default(),
        end: t0.elapsed(),
        arrivals,
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

pub fn main(args: ServeBenchArgs) -> anyhow::Result<()> {
    let client = Client::new(&ClientArgs {
        url: args.url.clone(),
        key: args.key.clone(),
    });
    // warm-up: one short request (first-use costs are not the server's steady state)
    one_stream(
        &client,
        &ServeBenchArgs {
            n_gen: 4,
            streams: vec![1],
            rounds: 1,
            json: false,
            model: args.model.clone(),
            url: args.url.clone(),
            key: args.key.clone(),
        },
        0,
        Instant::now(),
    )?;
    if args.rounds == 0 || args.streams.is_empty() {
        anyhow::bail!("-r/--rounds and --streams need at least one value");
    }
    let mut by_level: Vec<Vec<Level>> = args.streams.iter().map(|_| Vec::new()).collect();
    for round in 0..args.rounds {
        for (li, &k) in args.streams.iter().enumerate() {
            let l = measure_level(&client, &args, k)?;
            if !args.json {
                let base = match by_level[0].last() {
                    Some(first) if li > 0 => first,
                    _ => &l,
                };
                eprintln!(
                    "{}{k:>3} streams: decode {:>7.1} tok/s while all stream ({:.2}x); {:>5} tokens in {:>6.2} s = {:>7.1} tok/s with prefill ({:.2}x); per stream {:>6.1} tok/s; TTFT median {:>6.0} ms",
                    if args.rounds > 1 { format!("round {}: ", round + 1) } else { String::new() },
                    l.decode,
                    l.decode / base.decode.max(1e-9),
                    l.tokens,
                    l.wall_s,
                    l.aggregate,
                    l.aggregate / base.aggregate.max(1e-9),
                    l.per_stream,
                    l.ttft_ms
                );
            }
            by_level[li].push(l);
        }
    }
    let med = |li: usize, f: fn(&Level) -> f64| median(by_level[li].iter().map(f).collect());
    let (base_decode, base_rate) = (med(0, |l| l.decode), med(0, |l| l.aggregate));
    let mut rows = Vec::new();
    for (li, &k) in args.streams.iter().enumerate() {
        let (decode, aggregate) = (med(li, |l| l.decode), med(li, |l| l.aggregate));
        // the ratio within each round, where both levels met the same machine state
        let round_ratios: Vec<f64> = (0..args.rounds)
            .map(|r| by_level[li][r].decode / by_level[0][r].decode.max(1e-9))
            .collect();
        rows.push(json!({
            "streams": k,
            "rounds": args.rounds,
            "tokens": by_level[li][0].tokens,
            "wall_s": med(li, |l| l.wall_s),
            "aggregate_tok_s": aggregate,
            "per_stream_decode_tok_s": med(li, |l| l.per_stream),
            "ttft_ms_median": med(li, |l| l.ttft_ms),
            "vs_first_level": aggregate / base_rate.max(1e-9),
            "decode_tok_s": decode,
            "decode_vs_first_level": decode / base_decode.max(1e-9),
            "decode_vs_first_level_by_round": round_ratios,
        }));
        if !args.json && args.rounds > 1 {
            eprintln!(
                "median of {} rounds, {k:>3} streams: decode {decode:>7.1} tok/s ({:.2}x; per round {}); with prefill {aggregate:>7.1} tok/s ({:.2}x)",
                args.rounds,
                decode / base_decode.max(1e-9),
                round_ratios
                    .iter()
                    .map(|r| format!("{r:.2}"))
                    .collect::<Vec<_>>()
                    .join(" "),
                aggregate / base_rate.max(1e-9)
            );
        }
    }
    if args.json {
        println!(
            "{}",
            json!({"model": args.model, "n_gen": args.n_gen, "levels": rows})
        );
    }
    Ok(())
}
