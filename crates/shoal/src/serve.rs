//! `shoal serve`: one node. It loads the models named with `--model` and serves them over
//! HTTP (the OpenAI, Anthropic and Ollama APIs of `shoal-api`) with continuous batching, and,
//! given a cluster secret (`--secret-file` or `SHOAL_SECRET`), joins its cluster: it binds
//! the cluster port (`--listen`), finds the other nodes by mDNS and `--peer` seeds, and
//! publishes its facts (memory, and bandwidth and compute measured by a short self-test).
//! Without a secret it is a single node outside any cluster. It runs until Ctrl-C or
//! SIGTERM, then leaves the cluster and lets running requests finish (for at most
//! `--grace-s` seconds). When ready it prints one JSON line on stdout,
//! `{"node": ID, "listen": "HOST:PORT" or null, "api": "HOST:PORT", "models": [...]}`.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use shoal_api::keys::KeyStore;
use shoal_api::{AppState, HttpOptions, ServedModel};
use shoal_cluster::facts::NodeFacts;
use shoal_cluster::identity::Identity;
use shoal_cluster::node::{Node, NodeConfig};
use shoal_cluster::secret::{ClusterSecret, SecretError};
use shoal_cluster::session::Encryption;
use shoal_driver::model_id;
use shoal_engine::scheduler::SchedulerConfig;

use crate::ComputeArgs;

#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// A model to serve (path, Hugging Face folder or cache id, or catalog key); repeatable.
    /// Clients ask for it by its catalog key or file name without `.gguf`.
    #[arg(long = "model")]
    pub models: Vec<String>,
    /// HTTP address for the APIs (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:7337")]
    pub api: String,
    /// This node's name in the cluster (default: the host name).
    #[arg(long)]
    pub name: Option<String>,
    /// Cluster address: sessions (TCP) and gossip (UDP) on one port; 0 picks a free one.
    /// Loopback unless told otherwise: give 0.0.0.0:PORT to form a cluster across machines.
    #[arg(long, default_value = "127.0.0.1:7338")]
    pub listen: String,
    /// The address other nodes should dial, when --listen is a wildcard.
    #[arg(long)]
    pub advertise: Option<std::net::IpAddr>,
    /// Another node's cluster address, HOST:PORT, to join through (repeatable); for networks
    /// without multicast.
    #[arg(long = "peer")]
    pub peers: Vec<String>,
    /// A file holding the cluster secret (else $SHOAL_SECRET; `shoal secret` makes one).
    /// Without a secret the node serves alone, outside any cluster.
    #[arg(long)]
    pub secret_file: Option<PathBuf>,
    /// The cluster's name: nodes join only clusters of the same name and secret.
    #[arg(long, default_value = "shoal")]
    pub cluster: String,
    /// Do not advertise or browse on mDNS (join through --peer only).
    #[arg(long)]
    pub no_mdns: bool,
    /// Send model data between nodes unencrypted (sessions are still authenticated); only
    /// for a physically isolated network. Every node must agree.
    #[arg(long)]
    pub no_data_encryption: bool,
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
    /// Run every prompt whole: no reuse of the KV cache of earlier or running requests that
    /// started with the same tokens.
    #[arg(long)]
    pub no_prefix_cache: bool,
    /// Before serving, measure this node's decode costs of each --model whose shape it has
    /// not measured at its thread count (`shoal bench --calibrate`, a few seconds each), so
    /// the cluster's planner predicts this node from them.
    #[arg(long)]
    pub calibrate: bool,
    /// Speculative decoding for the models served here with --model.
    #[command(flatten)]
    pub speculation: crate::SpeculationArgs,
    /// A chat template (a Jinja file) for the models given with --model, instead of the
    /// one their files carry.
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// For testing API clients: the models given with --model give back the outputs
    /// recorded in FILE (JSON: {"outputs": [{"thinking": BOOL, "tools": BOOL, "text":
    /// "..."}]}) instead of sampling, token by token through the tokenizer, scheduler and
    /// output parsers; a request gets the first output whose conditions it meets.
    #[arg(long, value_name = "FILE")]
    pub replay: Option<PathBuf>,
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
    /// The most memory this node offers cluster instances, e.g. `512M` or `8G` (default:
    /// what is free).
    #[arg(long, value_parser = parse_bytes)]
    pub max_memory: Option<u64>,
    /// Hold no model shares: answer the APIs and forward every request to the node leading
    /// its instance. Put such entry nodes in front of a cluster: when a node that computes
    /// dies, requests that entered at an entry node go on at the instance's next lead, while
    /// a client connected to the dying node itself loses its connection. It offers no
    /// memory, whatever --max-memory says.
    #[arg(long, conflicts_with = "models")]
    pub no_compute: bool,
    /// Seconds running requests may take to finish after Ctrl-C or SIGTERM.
    #[arg(long, default_value_t = 30)]
    pub grace_s: u64,
    #[command(flatten)]
    pub compute: ComputeArgs,
}

/// `512M`, `8G`, `1.5G` or a byte count.
fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m: u64 = match c.to_ascii_uppercase() {
                'K' => 1 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'T' => 1 << 40,
                _ => return Err(format!("{s}: the unit must be K, M, G or T")),
            };
            (&t[..i], m)
        }
        _ => (t, 1),
    };
    let v: f64 = num
        .parse()
        .map_err(|_| format!("{s} is not a size like 512M or 8G"))?;
    if !(v.is_finite() && v > 0.0) {
        return Err(format!("{s}: a size must be positive"));
    }
    Ok((v * mult as f64) as u64)
}

/// The data directory: the flag, else `$SHOAL_DATA_DIR`, else `~/.local/share/shoal`.
fn data_dir(flag: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    if let Some(d) = flag.or_else(|| std::env::var_os("SHOAL_DATA_DIR").map(PathBuf::from)) {
        return Ok(d);
    }
    let home = std::env::var_os("HOME").context("HOME is not set; pass --data-dir")?;
    Ok(PathBuf::from(home).join(".local/share/shoal"))
}

/// Measures and stores this node's costs of `model`'s shape unless they are stored already.
/// A model that cannot be measured (one on a GPU) is served all the same, with a warning.
fn calibrate_once(
    model: &shoal_engine::model::LoadedModel,
    arg: &str,
    threads: usize,
) -> anyhow::Result<()> {
    let profile = shoal_driver::profile_from_model(arg)
        .with_context(|| format!("reading the profile of model {arg}"))?;
    let shape = profile.shape_key();
    if crate::calibrate::stored(threads)
        .iter()
        .any(|c| c.shape == shape)
    {
        tracing::info!(model = %model.name, "its shape's costs are measured already");
        return Ok(());
    }
    match crate::calibrate::measure(model, &profile, threads, 32, 3) {
        Ok(cal) => {
            let path = crate::calibrate::store(&cal)?;
            tracing::info!(model = %model.name, path = %path.display(), "measured its shape's costs");
        }
        Err(e) => tracing::warn!(model = %model.name, "not calibrated: {e:#}"),
    }
    Ok(())
}

/// How often a node looks for calibrations stored since it last looked.
const CALIBRATIONS_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// Publishes the calibrations stored at `threads` threads whenever they change (one measured
/// by `shoal bench --calibrate` while the node runs), until the node is gone.
async fn publish_calibrations(node: std::sync::Weak<Node>, threads: usize) {
    let mut published = crate::calibrate::stored(threads);
    loop {
        tokio::time::sleep(CALIBRATIONS_EVERY).await;
        let Some(node) = node.upgrade() else {
            return;
        };
        let now = tokio::task::spawn_blocking(move || crate::calibrate::stored(threads))
            .await
            .unwrap_or_default();
        if now != published {
            let update = now.clone();
            node.update_facts(move |f| f.calibrations = update).await;
            published = now;
        }
    }
}

/// The host's name, for a node started without --name.
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "node".to_string())
}

/// This node's backend (`cpu` or `gpu:N`) and its GPU adapters, with the read bandwidth of
/// the one it computes on (probed).
///
/// # Errors
/// When the GPU this process computes on cannot be opened.
fn gpu_facts() -> anyhow::Result<(String, Vec<shoal_cluster::facts::GpuFacts>)> {
    let device = shoal_engine::device::for_this_process();
    let using = match device.resolve() {
        shoal_engine::device::Resolved::Cpu => None,
        shoal_engine::device::Resolved::Gpu(n) => Some(n),
    };
    let (bw, gflops) = match using {
        Some(_) => (
            Some(
                shoal_engine::device::gpu_read_bandwidth(device)
                    .with_context(|| format!("--device {device}"))?,
            ),
            Some(
                shoal_engine::device::gpu_matmul_gflops(device)
                    .with_context(|| format!("--device {device}"))?,
            ),
        ),
        None => (None, None),
    };
    let gpus = shoal_engine::device::gpus()
        .into_iter()
        .map(|g| shoal_cluster::facts::GpuFacts {
            read_gb_s: bw.filter(|_| using == Some(g.index)),
            compute_gflops: gflops.filter(|_| using == Some(g.index)),
            index: g.index,
            name: g.name,
            api: g.api,
            software: g.software,
            memory_bytes: g.memory_bytes,
            failed: None,
        })
        .collect();
    let backend = using.map_or_else(|| "cpu".to_string(), |n| format!("gpu:{n}"));
    Ok((backend, gpus))
}

/// Joins the cluster: self-test, facts, then the node daemon.
async fn join_cluster(
    args: &ServeArgs,
    identity: Identity,
    secret: ClusterSecret,
    api: std::net::SocketAddr,
    threads: usize,
) -> anyhow::Result<Arc<Node>> {
    let listen: std::net::SocketAddr = args.listen.parse().with_context(|| {
        format!(
            "--listen {} is not HOST:PORT (an IP address and a port)",
            args.listen
        )
    })?;
    // an entry node computes nothing: nothing to measure
    let test = if args.no_compute {
        crate::selftest::SelfTest {
            mem_bandwidth_gbs: 0.0,
            compute_gflops: 0.0,
        }
    } else {
        tokio::task::spawn_blocking(move || crate::selftest::run(threads))
            .await
            .context("the self-test stopped")??
    };
    let memory_limit = if args.no_compute {
        Some(0)
    } else {
        args.max_memory
    };
    let (total, free) = shoal_cluster::facts::memory().unwrap_or((0, 0));
    let (backend, gpus) = tokio::task::spawn_blocking(gpu_facts)
        .await
        .context("the GPU probe stopped")??;
    let facts = NodeFacts {
        name: args.name.clone().unwrap_or_else(host_name),
        api: api.to_string(),
        listen: String::new(),
        memory_total_bytes: total,
        memory_free_bytes: (free >> 26 << 26).min(memory_limit.unwrap_or(u64::MAX)),
        backend,
        threads: threads as u32,
        // the CPU's; the GPU's bandwidth is its own fact, for the layers it takes
        mem_bandwidth_gbs: test.mem_bandwidth_gbs,
        compute_gflops: test.compute_gflops,
        version: env!("CARGO_PKG_VERSION").to_string(),
        gpus,
        gpu_layers: match shoal_engine::device::gpu_layers_for_this_process() {
            shoal_engine::device::GpuLayers::Fit => None,
            shoal_engine::device::GpuLayers::All => Some(u32::MAX),
            shoal_engine::device::GpuLayers::First(n) => Some(n.min(u32::MAX as usize) as u32),
        },
        entry_only: args.no_compute,
        // the node writes its own versions at start
        protocol: 0,
        oldest_protocol: 0,
        calibrations: crate::calibrate::stored(threads),
    };
    let node = Node::start(NodeConfig {
        identity,
        secret,
        cluster_name: args.cluster.clone(),
        listen,
        advertise: args.advertise,
        peers: args.peers.clone(),
        mdns: !args.no_mdns,
        encryption: if args.no_data_encryption {
            Encryption::Off
        } else {
            Encryption::On
        },
        facts,
        probe_interval: std::time::Duration::from_secs(15),
        io_timeout: std::time::Duration::from_secs(5),
        memory_limit,
    })
    .await?;
    Ok(Arc::new(node))
}

pub fn main(args: ServeArgs) -> anyhow::Result<()> {
    args.compute.apply()?;
    crate::rank_device(0, 1)?;
    if args.parallel == 0 || args.parallel > 256 {
        anyhow::bail!("--parallel {} is out of range (1..=256)", args.parallel);
    }
    let clustered = args.secret_file.is_some() || std::env::var_os("SHOAL_SECRET").is_some();
    if let (Some(d), true, false) = (&args.speculation.draft, args.models.is_empty(), clustered) {
        anyhow::bail!(
            "--draft {d} drafts for the models given with --model and for the cluster instances this node leads; give --model, or a cluster secret"
        );
    }
    if args.calibrate && args.models.is_empty() {
        anyhow::bail!(
            "--calibrate measures the models given with --model; give --model, or measure a \
             model with `shoal bench MODEL --calibrate`"
        );
    }
    if args.speculation.mtp && args.models.is_empty() && !clustered {
        anyhow::bail!(
            "--mtp drafts for the models given with --model and for the cluster instances this node leads; give --model, or a cluster secret"
        );
    }
    let threads = rayon::current_num_threads();
    let dir = data_dir(args.data_dir.clone())?;
    let identity = Identity::load_or_create(&dir)?;
    let node_id = identity.id.clone();
    let secret = match ClusterSecret::load(args.secret_file.as_deref()) {
        Ok(s) => Some(s),
        Err(SecretError::Missing) => None,
        Err(e) => return Err(e.into()),
    };
    if secret.is_none() && args.models.is_empty() {
        anyhow::bail!(
            "nothing to serve: give --model MODEL, or a cluster secret (--secret-file FILE or SHOAL_SECRET) to join a cluster"
        );
    }
    let keys = KeyStore::open(Some(&dir.join("keys.json")), args.rate_limit)?;
    let mut served = Vec::new();
    let draft = match &args.speculation.draft {
        Some(d) => Some(Arc::new(crate::models::open(d)?)),
        None => None,
    };
    let template = match &args.chat_template {
        Some(p) => Some(
            std::fs::read_to_string(p)
                .with_context(|| format!("reading the chat template {}", p.display()))?,
        ),
        None => None,
    };
    let replay = match &args.replay {
        Some(p) => Some(shoal_api::replay::Replay::load(p).map_err(anyhow::Error::msg)?),
        None => None,
    };
    for arg in &args.models {
        let id = model_id(arg);
        if served.iter().any(|m: &ServedModel| m.id == id) {
            anyhow::bail!("two --model arguments are both called '{id}'");
        }
        let mut model = crate::models::open_as(arg, args.speculation.mtp)?;
        if args.calibrate {
            calibrate_once(&model, arg, threads)?;
        }
        if let (Some(t), Some(p)) = (&template, &args.chat_template) {
            model
                .set_chat_template(t)
                .with_context(|| format!("the chat template {}", p.display()))?;
        }
        let ctx = args.ctx.unwrap_or(4096);
        let config = SchedulerConfig {
            max_batch: args.parallel,
            max_queue: args.queue,
            ctx,
            prefix_cache: !args.no_prefix_cache,
            draft_max: args.speculation.tokens(),
            adaptive_drafts: !args.speculation.fixed_drafts,
        };
        let m = match &draft {
            Some(d) => ServedModel::start_with_draft(id, model, d.clone(), config)?,
            None if args.speculation.mtp => ServedModel::start_with_mtp(id, model, config)?,
            None => ServedModel::start(id, model, config)?,
        };
        served.push(match &replay {
            Some(r) => m.with_replay(r.clone()),
            None => m,
        });
    }
    let ids: Vec<String> = served.iter().map(|m| m.id.clone()).collect();
    let state = AppState::new(served, keys);
    let opts = HttpOptions {
        body_limit: args.body_limit,
        cors_origins: args.cors.clone(),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    // Membership, gossip and the failure detector run on threads of their own: however busy
    // the HTTP side is, this node answers its peers in time and is not declared dead.
    let cluster_runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("shoal-cluster")
        .enable_all()
        .build()
        .context("starting the cluster's async runtime")?;
    let cluster = cluster_runtime.handle().clone();
    let served_result = runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&args.api)
            .await
            .with_context(|| format!("binding the API address {}", args.api))?;
        let addr = listener.local_addr()?;
        if !addr.ip().is_unspecified() {
            state.local_ips.write().unwrap().push(addr.ip());
        }
        let _ = state.doctor.set(shoal_api::doctor::Setup {
            secret_file: args.secret_file.clone().filter(|_| secret.is_some()),
            api: Some(addr),
        });
        let shutdown = shutdown_signal()?;
        let (state, node) = match secret {
            Some(secret) => {
                let joining = args.clone();
                let node = cluster
                    .spawn(async move {
                        join_cluster(&joining, identity, secret, addr, threads).await
                    })
                    .await
                    .context("joining the cluster stopped")??;
                let state = Arc::new(state.with_cluster(node.clone()));
                tokio::spawn(shoal_api::keys::replicate(
                    Arc::downgrade(&state),
                    node.clone(),
                    !args.peers.is_empty(),
                    !args.no_mdns,
                ));
                tokio::spawn(shoal_api::cluster::publish_figures(
                    Arc::downgrade(&state),
                    node.clone(),
                ));
                tokio::spawn(shoal_api::cluster::publish_gpu_failures(Arc::downgrade(&node)));
                tokio::spawn(publish_calibrations(Arc::downgrade(&node), threads));
                let offered = {
                    let models = args.models.clone();
                    tokio::task::spawn_blocking(move || {
                        models
                            .iter()
                            .map(|m| shoal_driver::describe_model(m))
                            .collect::<anyhow::Result<Vec<_>>>()
                    })
                    .await
                    .context("describing the models")??
                };
                shoal_driver::Driver::start(
                    node.clone(),
                    &state,
                    shoal_driver::DriverConfig {
                        data_dir: dir.clone(),
                        parallel: args.parallel.min(shoal_engine::parallel::MAX_SEQUENCES),
                        queue: args.queue,
                        prefix_cache: !args.no_prefix_cache,
                        lookup: args.speculation.lookup.unwrap_or(0),
                        adaptive_drafts: !args.speculation.fixed_drafts,
                        draft: draft.clone(),
                        draft_max: args.speculation.draft_max,
                        mtp: args.speculation.mtp,
                    },
                    offered,
                );
                (state, Some(node))
            }
            None => (Arc::new(state), None),
        };
        let listen = node.as_ref().map(|n| n.listen_addr().to_string());
        println!(
            "{}",
            serde_json::json!({"node": node_id, "listen": listen, "api": addr.to_string(), "models": ids})
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
        let result = tokio::select! {
            r = shoal_api::serve(listener, router, signal) => r.context("serving HTTP"),
            _ = deadline => {
                tracing::warn!(grace_s = grace.as_secs(), "requests still running after the grace period; stopping them");
                Ok(())
            }
        };
        if let Some(node) = node {
            let _ = cluster.spawn(async move { node.shutdown().await }).await;
        }
        result
    });
    cluster_runtime.shutdown_timeout(std::time::Duration::from_secs(2));
    served_result
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
