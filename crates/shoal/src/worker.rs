//! `shoal worker MODEL --rank R --peers FILE`: one rank of a split model, on this host, for a
//! lead (`shoal run ... --peers FILE`, or the local ranks `shoal run --tp/--pp` starts). It
//! joins the mesh, takes the job from rank 0, loads only its shard of the model and serves
//! steps until rank 0 says stop; it exits with an error naming the peer when a rank fails.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use shoal_engine::model::LoadedModel;
use shoal_engine::parallel::{serve, RankContext};
use shoal_engine::shard::Layout;

use crate::ranks::{join_mesh, read_table};
use crate::ComputeArgs;

#[derive(Args, Debug)]
pub struct WorkerArgs {
    /// The model (the same file rank 0 loads): a GGUF file, a Hugging Face folder or cache
    /// id, or a fetched catalog key.
    pub model: String,
    /// This rank (1 or more; rank 0 leads).
    #[arg(long)]
    pub rank: usize,
    /// The rank table: one host:port per line, rank 0 first.
    #[arg(long)]
    pub peers: PathBuf,
    /// Compute threads (default: what rank 0 asks for).
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// Where this rank computes (see `shoal run --help`; default: what the process that
    /// started it uses).
    #[arg(long, env = "SHOAL_DEVICE", default_value = "cpu")]
    pub device: shoal_engine::Device,
    /// On a GPU, how many of this rank's layers it takes (see `shoal run --help`).
    #[arg(long, env = "SHOAL_GPU_LAYERS", default_value = "auto")]
    pub gpu_layers: shoal_engine::device::GpuLayers,
    /// How long to wait for rank 0 and the other ranks to appear, in seconds.
    #[arg(long, default_value_t = 600)]
    pub join_timeout_s: u64,
}

pub fn main(args: WorkerArgs) -> anyhow::Result<()> {
    let table = read_table(&args.peers)?;
    let source = shoal_model::source::resolve(&args.model)?;
    let deadline = Instant::now() + Duration::from_secs(args.join_timeout_s);
    let rank = args.rank;
    let (job, transport) = join_mesh(rank, &table, source.path(), deadline)
        .with_context(|| format!("rank {rank}: joining the mesh"))?;
    ComputeArgs {
        threads: Some(args.threads.unwrap_or(job.threads)),
        device: vec![args.device],
        gpu_layers: args.gpu_layers,
    }
    .apply()?;
    let layout = Layout {
        tp: job.tp,
        pp: job.pp,
    };
    let mut ctx = RankContext::over(transport, layout, Duration::from_millis(job.timeout_ms))?;
    let sizes = (!job.stage_sizes.is_empty()).then_some(&job.stage_sizes[..]);
    let experts = job.experts()?;
    let (model, plans) =
        LoadedModel::load_split(&source, layout, sizes, experts, rank, ctx.tp.clone())
            .with_context(|| {
                format!(
                    "rank {rank}: loading its shard of {}",
                    source.path().display()
                )
            })?;
    ctx.plans = plans;
    tracing::info!(rank, plan = ?model.transformer.plan(), "serving");
    let capacity = job.ctx.min(model.transformer.config().context_len).max(1);
    serve(&ctx, &model.transformer, capacity).with_context(|| format!("rank {rank}"))?;
    if let Some(mb) = crate::ranks::peak_rss_mb() {
        tracing::info!(rank, peak_rss_mb = mb as u64, "done");
    }
    Ok(())
}
