//! The `shoal` command line: the glue between the library crates and a user. Each
//! subcommand lives in its own module; this file parses arguments, sets up logging and the
//! compute thread pool, and turns errors into a message and an exit code.

mod bench;
mod bench_comm;
mod bench_kernels;
mod bench_serve;
mod bench_split;
mod calibrate;
mod chat;
mod client;
mod doctor;
mod instance_cli;
mod keys;
mod models;
mod nodes;
mod plan;
mod pull;
mod ranks;
mod remote;
mod run;
mod selftest;
mod serve;
mod worker;

use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

/// shoal: turn the computers you already own into one LLM server.
#[derive(Parser, Debug)]
#[command(name = "shoal", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Fetch the demo models, pull models from a hub, list every store's models.
    #[command(subcommand)]
    Models(models::ModelsCommand),
    /// Answer one prompt: the answer on stdout, statistics on stderr.
    Run(run::RunArgs),
    /// Chat with a model in the terminal.
    Chat(chat::ChatArgs),
    /// Measure prefill and decode speed.
    Bench(bench::BenchArgs),
    /// Serve models over the OpenAI, Anthropic and Ollama HTTP APIs.
    Serve(serve::ServeArgs),
    /// Manage a node's API keys.
    Keys(keys::KeysArgs),
    /// List the cluster's nodes with their facts.
    Nodes(nodes::LookArgs),
    /// List the measured links between nodes.
    Links(nodes::LookArgs),
    /// Summarize the cluster as one node sees it.
    Status(nodes::StatusArgs),
    /// Print a new cluster secret.
    Secret,
    /// Check what stands between a node and a working cluster, with the fix for each.
    Doctor(nodes::LookArgs),
    /// Rank placements of a model on a cluster with predicted speed and memory.
    Plan(plan::PlanArgs),
    /// Place a model on the cluster and wait until it answers.
    Load(instance_cli::LoadArgs),
    /// Stop a cluster instance.
    Unload(instance_cli::UnloadArgs),
    /// List the cluster's instances.
    Ps(nodes::LookArgs),
    /// Move every instance off a node before it leaves.
    Drain(instance_cli::DrainArgs),
    /// Run one rank of a model split across processes or hosts (see `run --peers`).
    Worker(worker::WorkerArgs),
}

/// Speculative decoding, for `run` and `serve` (prompt lookup or a draft model, on one rank
/// or a split; the model's own prediction layer, on one rank).
#[derive(Args, Debug, Clone)]
pub struct SpeculationArgs {
    /// Prompt-lookup speculative decoding: draft up to N tokens per step from the text so
    /// far (what followed the last few tokens where they appeared before) and check them in
    /// one step; the output is unchanged. Strong for edits of given code.
    #[arg(long, num_args = 0..=1, default_missing_value = "8", value_name = "N")]
    pub lookup: Option<usize>,
    /// Speculative decoding with a draft model (same tokenizer, smaller: e.g. qwen05 for
    /// qwen15): it drafts --draft-max tokens per step, checked in one step; the output is
    /// unchanged. A split runs it beside rank 0; `serve` uses it for its --model models and
    /// for the cluster instances the node leads whose tokenizer it shares.
    #[arg(long, value_name = "MODEL", conflicts_with = "lookup")]
    pub draft: Option<String>,
    /// Speculative decoding with the model's own multi-token-prediction layer (GLM-4.5 and
    /// later ship one, as `nextn` tensors): no second model, one more layer's cost per
    /// drafted token; it drafts --draft-max tokens per step, checked in one step; the output
    /// is unchanged. On a split (`run --tp/--pp`, and the cluster instances `serve` leads
    /// whose model has the layer) the lead holds the layer, with the embedding and output
    /// head it reads, beside rank 0's share, and each split step returns its rows' hidden
    /// states for it.
    #[arg(long, conflicts_with_all = ["lookup", "draft"])]
    pub mtp: bool,
    /// Tokens the draft model (or the prediction layer) drafts per step at most.
    #[arg(long, default_value_t = 8, value_name = "N")]
    pub draft_max: usize,
    /// Check every drafted token each step. By default a step checks only as many as pay
    /// for their rows, judged by the measured cost of a step's rows and the share of drafts
    /// taken so far, so speculation whose drafts miss costs little time.
    #[arg(long)]
    pub fixed_drafts: bool,
}

impl SpeculationArgs {
    /// Whether either kind was asked for.
    pub fn any(&self) -> bool {
        self.lookup.is_some() || self.draft.is_some() || self.mtp
    }

    /// Tokens drafted per step at most (the scheduler's `draft_max`; 0: off).
    pub fn tokens(&self) -> usize {
        match (&self.draft, self.lookup) {
            (Some(_), _) => self.draft_max,
            _ if self.mtp => self.draft_max,
            (None, n) => n.unwrap_or(0),
        }
    }
}

/// Options every command that computes shares.
#[derive(Args, Debug, Clone)]
pub struct ComputeArgs {
    /// Compute threads (default: one per core).
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// Where shares are computed: cpu; gpu (the first GPU adapter, a software one such as
    /// Mesa's lavapipe included) or gpu:N (`shoal doctor` lists them); auto (the first
    /// real GPU, else the CPU). A split run (--tp/--pp) takes one per rank, rank 0 first
    /// (`gpu,cpu`: a tensor-parallel pair, or with --pp 2 a model's first layers on the GPU
    /// and the rest on the CPU).
    #[arg(
        long,
        env = "SHOAL_DEVICE",
        default_value = "cpu",
        value_delimiter = ','
    )]
    pub device: Vec<shoal_engine::Device>,
    /// On a GPU, how many of a share's layers it takes; the rest run on the CPU beside it.
    /// auto: as many as its memory holds (with room for an 8192-position KV cache per layer;
    /// all of them where the driver does not say its size); all; or a count (0: the CPU
    /// alone).
    #[arg(long, env = "SHOAL_GPU_LAYERS", default_value = "auto")]
    pub gpu_layers: shoal_engine::device::GpuLayers,
}

/// The `--device` list of this process (see [`ComputeArgs::device`]).
static RANK_DEVICES: std::sync::OnceLock<Vec<shoal_engine::Device>> = std::sync::OnceLock::new();

/// The device of rank `rank` of a run of `world` ranks started here: the one `--device`
/// named, or the `rank`-th of its list.
///
/// # Errors
/// When the list is neither one device nor one per rank.
pub fn rank_device(rank: usize, world: usize) -> anyhow::Result<shoal_engine::Device> {
    let list = RANK_DEVICES
        .get()
        .map_or(&[shoal_engine::Device::Cpu][..], Vec::as_slice);
    match list {
        [one] => Ok(*one),
        many if many.len() == world => Ok(many[rank]),
        many => anyhow::bail!(
            "--device lists {} devices; {} takes one, or one per rank (rank 0 first)",
            many.len(),
            if world == 1 {
                "a run on one rank".to_string()
            } else {
                format!("a split of {world} ranks")
            }
        ),
    }
}

impl ComputeArgs {
    /// Sizes the global compute pool. Must run before any tensor work.
    pub fn apply(&self) -> anyhow::Result<usize> {
        let n = self.threads.unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        });
        if n == 0 || n > 1024 {
            anyhow::bail!("--threads {n} is out of range (1..=1024)");
        }
        // candle reads RAYON_NUM_THREADS for its own kernels; rayon's pool must agree.
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .ok();
        let first = self.device.first().copied().unwrap_or_default();
        if let shoal_engine::device::GpuLayers::First(n @ 1..) = self.gpu_layers {
            if self.device.iter().all(|d| *d == shoal_engine::Device::Cpu) {
                anyhow::bail!(
                    "--gpu-layers {n} puts layers on a GPU, but --device is cpu; add --device gpu \
                     (or gpu:N, auto)"
                );
            }
        }
        shoal_engine::device::use_for_this_process(first);
        shoal_engine::device::use_gpu_layers_for_this_process(self.gpu_layers);
        RANK_DEVICES.set(self.device.clone()).ok();
        Ok(n)
    }
}

fn init_logging() {
    let filter =
        tracing_subscriber::EnvFilter::try_from_env("SHOAL_LOG").unwrap_or_else(|_| "warn".into());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

fn main() -> ExitCode {
    init_logging();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Models(c) => models::main(c),
        Command::Run(a) => run::main(a),
        Command::Chat(a) => chat::main(a),
        Command::Bench(a) => bench::main(a),
        Command::Worker(a) => worker::main(a),
        Command::Serve(a) => serve::main(a),
        Command::Keys(a) => keys::main(a),
        Command::Nodes(a) => nodes::nodes(a),
        Command::Links(a) => nodes::links(a),
        Command::Status(a) => nodes::status(a),
        Command::Secret => nodes::secret(),
        Command::Doctor(a) => doctor::main(a),
        Command::Plan(a) => plan::run(a),
        Command::Load(a) => instance_cli::load(a),
        Command::Unload(a) => instance_cli::unload(a),
        Command::Ps(a) => instance_cli::ps(a),
        Command::Drain(a) => instance_cli::drain(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if e.chain().any(|c| {
                c.downcast_ref::<std::io::Error>()
                    .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            }) {
                return ExitCode::SUCCESS;
            }
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}
