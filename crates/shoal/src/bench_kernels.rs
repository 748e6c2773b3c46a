//! `shoal bench kernels`: the speed of each weight type's matrix kernel at each instruction
//! set this CPU has. Decode is one activation row against a matrix much larger than the
//! caches, reported as GB/s of weights streamed (beside the machine's read bandwidth: a
//! kernel at that figure is memory-bound); prefill is a batch of rows against a cache-sized
//! matrix, reported as billions of multiply-adds per second.

use std::time::Instant;

use clap::Args;
use serde::Serialize;
use shoal_engine::bench::{Isa, KernelMatrix, Prefetch, WeightType};

use crate::bench::{measure_read_bandwidth, Spread};
use crate::ComputeArgs;

#[derive(Args, Debug)]
pub struct KernelBenchArgs {
    /// Weight types (comma-separated: f32,f16,bf16,q4_0,q4_1,q5_0,q5_1,q8_0,q2_k,q3_k,q4_k,q5_k,
    /// q6_k,iq4_nl,iq4_xs,mxfp4,iq1_s,iq1_m,iq2_xxs,iq2_xs,iq2_s,iq3_xxs,iq3_s).
    #[arg(
        long,
        default_value = "q4_0,q4_1,q5_0,q5_1,q8_0,q2_k,q3_k,q4_k,q5_k,q6_k,iq4_nl,iq4_xs,mxfp4"
    )]
    pub types: String,
    /// Instruction sets (comma-separated: portable,avx2,avx512vnni on x86-64,
    /// portable,neon,neondot on arm64; default all this CPU has).
    #[arg(long)]
    pub isa: Option<String>,
    /// Megabytes of weights in the decode matrix (past the last-level cache, or the figure
    /// is the cache's speed, not memory's: a 2026 server CPU may have 260 MB of L3).
    #[arg(long, default_value_t = 512)]
    pub decode_mb: usize,
    /// Activation rows in the prefill batch.
    #[arg(long, default_value_t = 64)]
    pub batch: usize,
    /// Columns of both matrices (input features; a multiple of 256 fits every type, 32 the
    /// 32-value types): models and their shards have 576 to 8960.
    #[arg(long, default_value_t = 2048)]
    pub cols: usize,
    /// Repetitions of each measurement.
    #[arg(short = 'r', long = "repetitions", default_value_t = 5)]
    pub reps: usize,
    /// Software prefetch distances of the x86 decode kernels in bytes, `BLOCK,K[,L2]`: into
    /// L1 for the 32-value types and for the K-quants, and a second request into L2 for
    /// both (0: none; left out: this CPU's). Default: chosen for this CPU's maker; see
    /// `shoal_engine::bench::Prefetch`. To find the best for a new machine.
    #[arg(long, value_parser = parse_prefetch)]
    pub prefetch: Option<Prefetch>,
    /// One JSON object per line on stdout.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub compute: ComputeArgs,
}

#[derive(Debug, Serialize)]
struct Row {
    ty: String,
    isa: &'static str,
    threads: usize,
    /// Weights streamed per second by the one-row product, GB/s (median).
    decode_gb_s: f64,
    decode: Spread,
    /// Multiply-adds per second of the batched product, billions (median).
    prefill_gmac_s: f64,
    prefill: Spread,
    mem_read_gb_s: f64,
    /// Software prefetch distances of the decode kernels, bytes (into L1 for the 32-value
    /// types and for the K-quants, and into L2 for both; 0 for none).
    prefetch_block: usize,
    prefetch_k: usize,
    prefetch_l2: usize,
}

/// The farthest prefetch distance `--prefetch` takes: far beyond any that helps, and small
/// enough that the kernels' address arithmetic cannot overflow.
const MAX_PREFETCH: usize = 1 << 20;

/// `BLOCK,K` or `BLOCK,K,L2` in bytes (without `L2`, this CPU's own).
fn parse_prefetch(s: &str) -> Result<Prefetch, String> {
    let bad = || {
        format!(
            "--prefetch wants two or three byte counts up to {MAX_PREFETCH}, BLOCK,K or \
             BLOCK,K,L2 (e.g. 1536,8192 or 1536,1536,4096; L2 0 for none), not {s:?}"
        )
    };
    let bytes = |v: &str| match v.trim().parse::<usize>() {
        Ok(n) if n <= MAX_PREFETCH => Ok(n),
        _ => Err(bad()),
    };
    let parts: Vec<&str> = s.split(',').collect();
    let (block, k, l2) = match parts[..] {
        [block, k] => (bytes(block)?, bytes(k)?, Prefetch::for_this_cpu().l2),
        [block, k, l2] => (bytes(block)?, bytes(k)?, bytes(l2)?),
        _ => return Err(bad()),
    };
    Ok(Prefetch { block, k, l2 })
}

fn parse_type(s: &str) -> anyhow::Result<WeightType> {
    Ok(match s.trim().to_ascii_lowercase().as_str() {
        "f32" => WeightType::F32,
        "f16" => WeightType::F16,
        "bf16" => WeightType::Bf16,
        "q4_0" => WeightType::Q4_0,
        "q4_1" => WeightType::Q4_1,
        "q5_0" => WeightType::Q5_0,
        "q5_1" => WeightType::Q5_1,
        "q8_0" => WeightType::Q8_0,
        "q2_k" => WeightType::Q2K,
        "q3_k" => WeightType::Q3K,
        "q4_k" => WeightType::Q4K,
        "q5_k" => WeightType::Q5K,
        "q6_k" => WeightType::Q6K,
        "iq4_nl" | "iq4nl" => WeightType::Iq4Nl,
        "iq4_xs" | "iq4xs" => WeightType::Iq4Xs,
        "mxfp4" => WeightType::Mxfp4,
        "iq1_s" | "iq1s" => WeightType::Iq1S,
        "iq1_m" | "iq1m" => WeightType::Iq1M,
        "iq2_xxs" | "iq2xxs" => WeightType::Iq2Xxs,
        "iq2_xs" | "iq2xs" => WeightType::Iq2Xs,
        "iq2_s" | "iq2s" => WeightType::Iq2S,
        "iq3_xxs" | "iq3xxs" => WeightType::Iq3Xxs,
        "iq3_s" | "iq3s" => WeightType::Iq3S,
        other => anyhow::bail!("unknown weight type {other:?} in --types"),
    })
}

fn parse_isa(s: &str) -> anyhow::Result<Isa> {
    let isa = Isa::from_name(s)
        .ok_or_else(|| anyhow::anyhow!("unknown instruction set {s:?} in --isa"))?;
    if !isa.runs_here() {
        anyhow::bail!("this CPU cannot run {}", isa.name());
    }
    Ok(isa)
}

/// A matrix of about `mb` megabytes with `cols` columns.
pub(crate) fn matrix(
    isa: Isa,
    ty: WeightType,
    mb: usize,
    cols: usize,
) -> anyhow::Result<KernelMatrix> {
    Ok(KernelMatrix::synthetic(isa, ty, mb, cols)?)
}

pub(crate) fn time_runs(
    reps: usize,
    mut f: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<Vec<f64>> {
    f()?; // warm-up
    (0..reps)
        .map(|_| {
            let t0 = Instant::now();
            f()?;
            Ok(t0.elapsed().as_secs_f64())
        })
        .collect()
}

pub fn main(args: KernelBenchArgs) -> anyhow::Result<()> {
    let threads = args.compute.apply()?;
    if args.reps == 0 || args.batch == 0 || args.decode_mb == 0 {
        anyhow::bail!("-r, --batch and --decode-mb must be at least 1");
    }
    let types = args
        .types
        .split(',')
        .map(parse_type)
        .collect::<anyhow::Result<Vec<_>>>()?;
    if args.cols == 0 {
        anyhow::bail!("--cols must be at least 1 (a multiple of 256 fits every type)");
    }
    if let Some(ty) = types
        .iter()
        .find(|t| !args.cols.is_multiple_of(t.block_elems()))
    {
        anyhow::bail!(
            "--cols {} is not a whole number of {:?} blocks ({} values); use a multiple of 256",
            args.cols,
            ty,
            ty.block_elems()
        );
    }
    let isas = match &args.isa {
        Some(s) => s
            .split(',')
            .map(parse_isa)
            .collect::<anyhow::Result<Vec<_>>>()?,
        None => Isa::available(),
    };
    if let Some(p) = args.prefetch {
        p.set();
    }
    let prefetch = Prefetch::current();
    let bw = measure_read_bandwidth(threads);
    if !args.json {
        println!(
            "threads {threads}  read bandwidth {bw:.1} GB/s  decode matrix {} MB  prefill batch {}  prefetch {} / {} / {} bytes",
            args.decode_mb, args.batch, prefetch.block, prefetch.k, prefetch.l2
        );
        println!(
            "{:<6} {:<11} {:>14} {:>8} {:>16}",
            "type", "isa", "decode GB/s", "of bw", "prefill GMAC/s"
        );
    }
    let cols = args.cols;
    for &ty in &types {
        for &isa in &isas {
            let big = matrix(isa, ty, args.decode_mb, cols)?;
            let x: Vec<f32> = (0..cols)
                .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1)
                .collect();
            let mut y = vec![0f32; big.rows()];
            // timed on a pool thread, as the engine runs its steps (`transformer::on_pool`)
            let dec = rayon::scope(|_| time_runs(args.reps, || Ok(big.matmul(&x, &mut y)?)))?;
            let dec_gb: Vec<f64> = dec.iter().map(|s| big.bytes() as f64 / s / 1e9).collect();
            drop(big);
            let small = matrix(isa, ty, 4, cols)?;
            let xb: Vec<f32> = (0..cols * args.batch)
                .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1)
                .collect();
            let mut yb = vec![0f32; small.rows() * args.batch];
            let pre = rayon::scope(|_| time_runs(args.reps, || Ok(small.matmul(&xb, &mut yb)?)))?;
            let macs = (small.rows() * cols * args.batch) as f64;
            let pre_g: Vec<f64> = pre.iter().map(|s| macs / s / 1e9).collect();
            let (decode, prefill) = (
                Spread::of(&dec_gb).expect("reps >= 1"),
                Spread::of(&pre_g).expect("reps >= 1"),
            );
            let row = Row {
                ty: format!("{ty:?}"),
                isa: isa.name(),
                threads,
                decode_gb_s: decode.median,
                decode,
                prefill_gmac_s: prefill.median,
                prefill,
                mem_read_gb_s: bw,
                prefetch_block: prefetch.block,
                prefetch_k: prefetch.k,
                prefetch_l2: prefetch.l2,
            };
            if args.json {
                println!("{}", serde_json::to_string(&row)?);
            } else {
                println!(
                    "{:<6} {:<11} {:>14.2} {:>7.0}% {:>16.2}",
                    row.ty,
                    row.isa,
                    row.decode_gb_s,
                    100.0 * row.decode_gb_s / bw,
                    row.prefill_gmac_s
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every type the kernels have parses, ggml's spelling (`q2_K`) included, and so does
    /// the default list; others are refused.
    #[test]
    fn weight_types_parse() {
        for ty in WeightType::ALL {
            let name = match ty {
                WeightType::Q2K => "q2_K",
                WeightType::Q3K => "Q3_K",
                other => &format!("{other:?}").to_ascii_lowercase().replace('k', "_k"),
            };
            assert_eq!(parse_type(name).unwrap(), ty, "{name}");
        }
        let default = KernelBenchArgs::augment_args(clap::Command::new("t"))
            .get_arguments()
            .find(|a| a.get_id() == "types")
            .and_then(|a| a.get_default_values().first().cloned())
            .unwrap();
        for t in default.to_str().unwrap().split(',') {
            parse_type(t).unwrap();
        }
        assert!(parse_type("q1_k").is_err());
    }

    #[test]
    fn prefetch_distances_parse_or_say_what_is_wanted() {
        assert_eq!(
            parse_prefetch("1536, 8192"),
            Ok(Prefetch {
                block: 1536,
                k: 8192,
                l2: Prefetch::for_this_cpu().l2,
            })
        );
        assert_eq!(
            parse_prefetch("1536,1536, 0"),
            Ok(Prefetch {
                block: 1536,
                k: 1536,
                l2: 0
            })
        );
        for bad in [
            "",
            "1536",
            "a,b",
            "1536,8192,1,2",
            "1536,8192,",
            "-1,2",
            "1536,18446744073709551615",
            "1536,1536,2000000",
        ] {
            let e = parse_prefetch(bad).unwrap_err();
            assert!(e.contains("BLOCK,K"), "{bad:?}: {e}");
        }
    }
}
