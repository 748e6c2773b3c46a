//! `shoal serve`: loads the models named with `--model` and serves them over HTTP (the
//! OpenAI, Anthropic and Ollama APIs of `shoal-api`) with continuous batching, until Ctrl-C
//! or SIGTERM, then lets running requests finish (for at most `--grace-s` seconds). When ready it prints one JSON line on
//! stdout, `{"node": ID, "listen": null, "api": "HOST:PORT", "models": [...]}`; `listen` (the
//! cluster port) is null until the cluster daemon exists.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use shoal_api::keys::KeyStore;
use shoal_api::{AppState, HttpOptions, ServedModel};
use shoal_engine::scheduler::SchedulerConfig;

use crate::ComputeArgs;

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// A model to serve (path, Hugging Face folder or cache id, or catalog key); repeatable.
    /// Clients ask for it by its catalog key or file name without `.gguf`.
    #[arg(long = "model", required = true)]
    pub models: Vec<String>,
    /// HTTP address for the APIs (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:7337")]
    pub api: String,
    /// Where the node keeps its id and API keys (default: $SHOAL_DATA_DIR, else
    /// ~/.local/share/shoal).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Requests generating at once per model (the batch size).
    #[arg(long, default_value_t = 16)]
    pub parallel: usize,
    /// Requests waiting per model beyond those; more get 503.
    #[arg(long, default_value_t = 64)]
    pub queue: usize,
    /// Context length per request, prompt plus output (default: the model's, at most 4096).
    #[arg(long)]
    pub ctx: Option<usize>,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 4 << 20)]
    pub body_limit: usize,
    /// Allow browsers from this origin (`*` for any); repeatable. Off by default.
    #[arg(long = "cors-origin")]
    pub cors: Vec<String>,
    /// Requests per minute per API key, for keys created without their own limit.
    #[arg(long)]
    pub rate_limit: Option<u32>,
    /// Seconds running requests may take to finish after Ctrl-C or SIGTERM.
    #[arg(long, default_value_t = 30)]
    pub grace_s: u64,
    #[command(flatten)]
    pub compute: ComputeArgs,
}

/// The data directory: the flag, else `$SHOAL_DATA_DIR`, else `~/.local/share/shoal`.
fn data_dir(flag: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    if let Some(d) = flag.or_else(|| std::env::var_os("SHOAL_DATA_DIR").map(PathBuf::from)) {
        return Ok(d);
    }
    let home = std::env::var_os("HOME").context("HOME is not set; pass --data-dir")?;
    Ok(PathBuf::from(home).join(".local/share/shoal"))
}

/// This node's id, made once and kept in the data directory.
fn node_id(dir: &std::path::Path) -> anyhow::Result<String> {
    let path = dir.join("node_id");
    if let Ok(s) = std::fs::read_to_string(&path) {
        let s = s.trim();
        if s.len() == 16 && s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Ok(s.to_string());
        }
        anyhow::bail!(
            "{} does not hold a node id (16 hex digits); remove it to make a new one",
            path.display()
        );
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let id = format!("{:016x}", rand::random::<u64>());
    std::fs::write(&path, &id).with_context(|| format!("writing {}", path.display()))?;
    Ok(id)
}

/// The id clients use for a MODEL argument: the catalog key, or the file or folder name
/// without `.gguf`.
fn model_id(arg: &str) -> String {
    let p = std::path::Path::new(arg);
    if p.exists() {
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| arg.to_string());
        return name.strip_suffix(".gguf").unwrap_or(&name).to_string();
    }
    arg.rsplit('/').next().unwrap_or(arg).to_string()
}

pub fn main(args: ServeArgs) -> anyhow::Result<()> {
    args.compute.apply()?;
    if args.parallel == 0 || args.parallel > 256 {
        anyhow::bail!("--parallel {} is out of range (1..=256)", args.parallel);
    }
    let dir = data_dir(args.data_dir.clone())?;
    let node = node_id(&dir)?;
    let keys = KeyStore::open(Some(&dir.join("keys.json")), args.rate_limit)?;
    let mut served = Vec::new();
    for arg in &args.models {
        let id = model_id(arg);
        if served.iter().any(|m: &ServedModel| m.id == id) {
            anyhow::bail!("two --model arguments are both called '{id}'");
        }
        let model = crate::models::open(arg)?;
        let ctx = args.ctx.unwrap_or(4096);
        let m = ServedModel::start(
            id,
            model,
            SchedulerConfig {
                max_batch: args.parallel,
                max_queue: args.queue,
                ctx,
            },
        )?;
        served.push(m);
    }
    let ids: Vec<String> = served.iter().map(|m| m.id.clone()).collect();
    let state = Arc::new(AppState::new(served, keys));
    let opts = HttpOptions {
        body_limit: args.body_limit,
        cors_origins: args.cors.clone(),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&args.api)
            .await
            .with_context(|| format!("binding the API address {}", args.api))?;
        let addr = listener.local_addr()?;
        let shutdown = shutdown_signal()?;
        println!(
            "{}",
            serde_json::json!({"node": node, "listen": null, "api": addr.to_string(), "models": ids})
        );
        use std::io::Write;
        std::io::stdout().flush().ok();
        tracing::info!(%addr, "serving");
        let router = shoal_api::router(state, &opts);
        // On Ctrl-C or SIGTERM stop accepting, let running requests finish for up to
        // --grace-s, then stop them.
        let (stopping_tx, mut stopping) = tokio::sync::watch::channel(false);
        let signal = async move {
            shutdown.await;
            let _ = stopping_tx.send(true);
        };
        let grace = std::time::Duration::from_secs(args.grace_s);
        let deadline = async move {
            let _ = stopping.wait_for(|s| *s).await;
            tokio::time::sleep(grace).await;
        };
        tokio::select! {
            r = shoal_api::serve(listener, router, signal) => r.context("serving HTTP"),
            _ = deadline => {
                tracing::warn!(grace_s = grace.as_secs(), "requests still running after the grace period; stopping them");
                Ok(())
            }
        }
    })
}

/// Ctrl-C and SIGTERM, listened for from the moment this is called (before the ready line,
/// so a signal sent right after it is never missed).
fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).context("listening for SIGTERM")?;
        let mut int = signal(SignalKind::interrupt()).context("listening for Ctrl-C")?;
        Ok(async move {
            tokio::select! {
                _ = term.recv() => {},
                _ = int.recv() => {},
            }
            tracing::info!("shutting down");
        })
    }
    #[cfg(not(unix))]
    {
        Ok(async move {
            let _ = tokio::signal::ctrl_c().await;
            tracing::info!("shutting down");
        })
    }
}
