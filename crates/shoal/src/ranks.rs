//! Starting the ranks of a split model without the cluster daemon: `shoal run --tp N --pp M`
//! launches `N x M - 1` local `shoal worker` processes and leads them as rank 0, and `shoal
//! worker --rank R --peers FILE` runs one rank on another host from a rank table.
//!
//! The rank table is one `host:port` per line, rank 0 first (`#` starts a comment). Rank `r`
//! listens on line `r`; port 0 there means any free port. Assembly, with a deadline on every
//! wait:
//! 1. every rank `r > 0` dials rank 0 and says hello (protocol version, rank, world size,
//!    its listening port, the model file's size and name);
//! 2. rank 0 checks every hello (a wrong version, world, duplicate rank or different model
//!    is refused with the reason sent back), then sends each rank the job: the real address
//!    of every rank, the split and the run's settings;
//! 3. every rank `r` dials the ranks between 1 and `r - 1` and accepts the ones above it,
//!    each connection opening with the dialer's rank.
//!
//! The result is a full mesh of TCP connections, the data transport itself, or with
//! `--transport shm` the control path beside a shared-memory transport.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::sync::atomic::AtomicU64;

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use shoal_comm::{EmulatedLink, LinkSpec, ShmTransport, TcpTransport, Transport};
use shoal_engine::model::LoadedModel;
use shoal_engine::parallel::{RankContext, Timed};
use shoal_engine::shard::{ExpertSplit, Layout};

/// Version of the assembly protocol; ranks of another version are refused.
const PROTOCOL: u32 = 1;
/// Largest assembly message accepted.
const MAX_MESSAGE: usize = 1 << 20;

/// How the ranks of a split talk, chosen on rank 0 and sent to every rank.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Job {
    /// Tensor-parallel ranks per stage.
    pub tp: usize,
    /// Pipeline stages.
    pub pp: usize,
    /// Layers per stage (even when empty).
    pub stage_sizes: Vec<usize>,
    /// How a mixture of experts' routed experts are cut (`auto`, `whole`, `sliced`).
    #[serde(default)]
    pub expert_split: String,
    /// Context size of the sequence.
    pub ctx: usize,
    /// Compute threads per rank.
    pub threads: usize,
    /// Longest wait for a peer, in milliseconds.
    pub timeout_ms: u64,
    /// `tcp` or `shm`.
    pub transport: String,
    /// The shared-memory file (`shm` only).
    pub shm_path: Option<PathBuf>,
    /// Emulated one-way link latency in microseconds (0 = none).
    pub link_latency_us: f64,
    /// Emulated link bandwidth in Gbit/s (0 = unlimited).
    pub link_gbps: f64,
}

impl Job {
    /// How the job cuts a mixture of experts.
    ///
    /// # Errors
    /// When the split is not one shoal knows.
    pub fn experts(&self) -> anyhow::Result<ExpertSplit> {
        if self.expert_split.is_empty() {
            return Ok(ExpertSplit::Auto);
        }
        self.expert_split.parse().map_err(anyhow::Error::msg)
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct Hello {
    protocol: u32,
    rank: usize,
    world: usize,
    port: u16,
    model_bytes: u64,
    model_name: String,
}

#[derive(Debug, Serialize, Deserialize)]
enum Welcome {
    Job { addrs: Vec<SocketAddr>, job: Job },
    Refused(String),
}

/// Reads a rank table.
///
/// # Errors
/// When the file cannot be read or a line is not `host:port`.
pub fn read_table(path: &Path) -> anyhow::Result<Vec<SocketAddr>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the rank table {}", path.display()))?;
    let mut addrs = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let addr = line
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .with_context(|| {
                format!(
                    "{}:{}: `{line}` is not a host:port address",
                    path.display(),
                    i + 1
                )
            })?;
        addrs.push(addr);
    }
    if addrs.len() < 2 {
        bail!(
            "{}: a rank table needs at least two ranks, one `host:port` per line",
            path.display()
        );
    }
    if addrs[0].port() == 0 {
        bail!(
            "{}: rank 0 (the first line) needs a fixed port: every other rank dials it",
            path.display()
        );
    }
    Ok(addrs)
}

fn send_msg<T: Serialize>(s: &mut TcpStream, msg: &T) -> anyhow::Result<()> {
    let body = serde_json::to_vec(msg)?;
    s.write_all(&(body.len() as u32).to_le_bytes())?;
    s.write_all(&body)?;
    s.flush()?;
    Ok(())
}

fn recv_msg<T: for<'de> Deserialize<'de>>(s: &mut TcpStream, what: &str) -> anyhow::Result<T> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)
        .with_context(|| format!("waiting for the {what}"))?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_MESSAGE {
        bail!("the {what} claims {len} bytes (at most {MAX_MESSAGE}): not a shoal rank");
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body)
        .with_context(|| format!("reading the {what}"))?;
    serde_json::from_slice(&body).with_context(|| format!("the {what} is not valid"))
}

fn accept_until(l: &TcpListener, deadline: Instant, what: &str) -> anyhow::Result<TcpStream> {
    l.set_nonblocking(true)?;
    loop {
        match l.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false)?;
                s.set_read_timeout(Some(
                    deadline
                        .saturating_duration_since(Instant::now())
                        .max(Duration::from_millis(1)),
                ))?;
                return Ok(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    bail!("timed out waiting for {what}");
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(e).context(format!("accepting {what}")),
        }
    }
}

fn dial_until(addr: SocketAddr, deadline: Instant, what: &str) -> anyhow::Result<TcpStream> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(10))) {
            Ok(s) => {
                s.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
                return Ok(s);
            }
            Err(e) => {
                if Instant::now() >= deadline {
                    return Err(e).context(format!("connecting to {what} at {addr}"));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// A model file's identity for the hello: its size and name.
pub fn model_identity(path: &Path) -> (u64, String) {
    let bytes = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    (bytes, name)
}

/// Rank 0's side of assembly: accepts every other rank on `listener`, checks them against
/// `job` and this rank's model, and sends them the job. Returns the transport.
///
/// # Errors
/// When a rank does not show up before the deadline, or one is refused.
pub fn lead_mesh(
    listener: TcpListener,
    world: usize,
    job: &Job,
    model: &Path,
    deadline: Instant,
) -> anyhow::Result<Arc<dyn Transport>> {
    let (bytes, name) = model_identity(model);
    let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    let mut addrs = vec![listener.local_addr()?; world];
    for _ in 1..world {
        let mut s = accept_until(&listener, deadline, "the other ranks to dial in")?;
        let peer = s.peer_addr()?;
        let hello: Hello = recv_msg(&mut s, "hello of a rank")?;
        let refusal = if hello.protocol != PROTOCOL {
            Some(format!(
                "protocol version {} (rank 0 speaks {PROTOCOL}): run the same shoal on every host",
                hello.protocol
            ))
        } else if hello.world != world {
            Some(format!(
                "a world of {} ranks (rank 0 runs {world}): give every rank the same table",
                hello.world
            ))
        } else if hello.rank == 0 || hello.rank >= world || streams[hello.rank].is_some() {
            Some(format!("rank {} is invalid or already taken", hello.rank))
        } else if hello.model_bytes != bytes {
            Some(format!(
                "model `{}` of {} bytes; rank 0 loads `{name}` of {bytes} bytes",
                hello.model_name, hello.model_bytes
            ))
        } else {
            None
        };
        if let Some(why) = refusal {
            let _ = send_msg(&mut s, &Welcome::Refused(why.clone()));
            bail!("refused a rank from {peer}: {why}");
        }
        addrs[hello.rank] = SocketAddr::new(peer.ip(), hello.port);
        streams[hello.rank] = Some(s);
    }
    for s in streams.iter_mut().flatten() {
        send_msg(
            s,
            &Welcome::Job {
                addrs: addrs.clone(),
                job: job.clone(),
            },
        )?;
    }
    finish(0, streams, job, deadline)
}

/// A worker's side of assembly: dials rank 0 at `table[0]`, gets the job, connects to the
/// other ranks. Returns the job and the transport.
///
/// # Errors
/// When rank 0 or another rank cannot be reached before the deadline, or rank 0 refuses.
pub fn join_mesh(
    rank: usize,
    table: &[SocketAddr],
    model: &Path,
    deadline: Instant,
) -> anyhow::Result<(Job, Arc<dyn Transport>)> {
    let world = table.len();
    if rank == 0 || rank >= world {
        bail!("--rank {rank} is not a worker rank of this {world}-rank table (1..{world})");
    }
    let listener = TcpListener::bind(table[rank]).with_context(|| {
        format!(
            "listening on {} (line {} of the table)",
            table[rank],
            rank + 1
        )
    })?;
    let (model_bytes, model_name) = model_identity(model);
    let mut lead = dial_until(table[0], deadline, "rank 0")?;
    send_msg(
        &mut lead,
        &Hello {
            protocol: PROTOCOL,
            rank,
            world,
            port: listener.local_addr()?.port(),
            model_bytes,
            model_name,
        },
    )?;
    let (addrs, job) = match recv_msg(&mut lead, "job from rank 0")? {
        Welcome::Job { addrs, job } => (addrs, job),
        Welcome::Refused(why) => bail!("rank 0 refused this rank: {why}"),
    };
    if addrs.len() != world || job.tp * job.pp != world {
        bail!(
            "rank 0 sent {} addresses and a {} x {} split for a table of {world} ranks",
            addrs.len(),
            job.tp,
            job.pp
        );
    }
    if job.threads == 0 || job.threads > 1024 || job.ctx == 0 {
        bail!(
            "rank 0 asked for {} threads and a context of {} (not a valid job)",
            job.threads,
            job.ctx
        );
    }
    let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    streams[0] = Some(lead);
    for (peer, addr) in addrs.iter().enumerate().take(rank).skip(1) {
        let mut s = dial_until(*addr, deadline, &format!("rank {peer}"))?;
        s.write_all(&(rank as u32).to_le_bytes())?;
        streams[peer] = Some(s);
    }
    for _ in rank + 1..world {
        let mut s = accept_until(&listener, deadline, "the ranks above this one")?;
        let mut r = [0u8; 4];
        s.read_exact(&mut r).context("reading a peer's rank")?;
        let r = u32::from_le_bytes(r) as usize;
        if r <= rank || r >= world || streams[r].is_some() {
            bail!("a peer claimed rank {r}, which cannot dial rank {rank}");
        }
        streams[r] = Some(s);
    }
    let t = finish(rank, streams, &job, deadline)?;
    Ok((job, t))
}

/// Turns the connected streams into the job's transport, with the emulated link on top.
fn finish(
    rank: usize,
    streams: Vec<Option<TcpStream>>,
    job: &Job,
    deadline: Instant,
) -> anyhow::Result<Arc<dyn Transport>> {
    let world = streams.len();
    let base: Box<dyn Transport> = match job.transport.as_str() {
        "tcp" => Box::new(TcpTransport::from_streams(rank, streams)?),
        "shm" => {
            let path = job
                .shm_path
                .as_ref()
                .context("a shared-memory job without a file")?;
            let t =
                ShmTransport::join(path, rank, world, shoal_comm::DEFAULT_RING_BYTES, deadline)?;
            // every rank has mapped the file once all have answered over TCP
            let mut tcp = TcpTransport::from_streams(rank, streams)?;
            barrier(&mut tcp, deadline)?;
            if rank == 0 {
                let _ = std::fs::remove_file(path);
            }
            Box::new(t)
        }
        other => bail!("unknown transport `{other}` (tcp or shm)"),
    };
    if job.link_latency_us > 0.0 || job.link_gbps > 0.0 {
        let spec = LinkSpec::new(job.link_latency_us, job.link_gbps);
        return Ok(Arc::new(EmulatedLink::new(base, spec)));
    }
    Ok(Arc::from(base))
}

/// Every rank waits until every other has reached this point.
fn barrier(t: &mut TcpTransport, deadline: Instant) -> anyhow::Result<()> {
    let world = t.world_size();
    let me = t.rank();
    let one = [1u8];
    let sends: Vec<(usize, &[u8])> = (0..world)
        .filter(|&p| p != me)
        .map(|p| (p, &one[..]))
        .collect();
    let mut bufs = vec![[0u8; 1]; world];
    let mut recvs: Vec<(usize, &mut [u8])> = bufs
        .iter_mut()
        .enumerate()
        .filter(|(p, _)| *p != me)
        .map(|(p, b)| (p, &mut b[..]))
        .collect();
    t.exchange(&sends, &mut recvs, deadline)?;
    Ok(())
}

/// The local worker processes of a `shoal run --tp/--pp`, killed if rank 0 leaves early.
pub struct LocalWorkers {
    children: Vec<std::process::Child>,
    /// The rank table the workers read (deleted with this).
    table: tempfile::NamedTempFile,
}

impl LocalWorkers {
    /// Starts ranks `1..world` of a split of `model` as `shoal worker` processes that dial
    /// rank 0 at `lead`.
    ///
    /// # Errors
    /// When the table cannot be written or a process cannot start.
    pub fn spawn(
        model: &str,
        world: usize,
        lead: SocketAddr,
        threads: usize,
    ) -> anyhow::Result<Self> {
        let mut table = tempfile::Builder::new()
            .prefix("shoal-ranks-")
            .suffix(".txt")
            .tempfile()?;
        writeln!(table, "{lead}  # rank 0")?;
        for r in 1..world {
            writeln!(table, "127.0.0.1:0  # rank {r}")?;
        }
        table.flush()?;
        let exe = std::env::current_exe().context("finding the shoal executable")?;
        // pushed one by one, so dropping it on an error kills the ranks already started
        let mut workers = LocalWorkers {
            children: Vec::new(),
            table,
        };
        for r in 1..world {
            let device = crate::rank_device(r, world)?;
            let child = std::process::Command::new(&exe)
                .arg("worker")
                .arg("--device")
                .arg(device.to_string())
                .arg("--gpu-layers")
                .arg(shoal_engine::device::gpu_layers_for_this_process().to_string())
                .arg(model)
                .arg("--rank")
                .arg(r.to_string())
                .arg("--peers")
                .arg(workers.table.path())
                .arg("--threads")
                .arg(threads.to_string())
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .spawn()
                .with_context(|| format!("starting rank {r}"))?;
            workers.children.push(child);
        }
        Ok(workers)
    }

    /// Waits up to `grace` for the workers to exit on their own, then kills the rest.
    pub fn finish(&mut self, grace: Duration) {
        let end = Instant::now() + grace;
        for c in &mut self.children {
            loop {
                match c.try_wait() {
                    Ok(Some(_)) | Err(_) => break,
                    Ok(None) if Instant::now() >= end => {
                        let _ = c.kill();
                        let _ = c.wait();
                        break;
                    }
                    Ok(None) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        }
    }
}

impl Drop for LocalWorkers {
    fn drop(&mut self) {
        self.finish(Duration::from_millis(500));
    }
}

/// The options of a split run, shared by `run`, `chat` and `bench`.
#[derive(clap::Args, Debug, Clone)]
pub struct SplitArgs {
    /// Tensor-parallel ranks per pipeline stage (local processes).
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Pipeline stages (local processes).
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
    /// Layers per pipeline stage, comma separated (default: as even as possible).
    #[arg(long, value_delimiter = ',')]
    pub stage_layers: Vec<usize>,
    /// How a mixture of experts' routed experts are cut across the tensor-parallel ranks:
    /// `whole` experts per rank, `sliced` (a slice of every expert), or `auto` (whichever
    /// the planner predicts faster).
    #[arg(long, default_value = "auto", value_parser = ["auto", "whole", "sliced"])]
    pub expert_split: String,
    /// How ranks talk: `tcp` (loopback) or `shm` (shared memory).
    #[arg(long, default_value = "tcp")]
    pub transport: String,
    /// Emulated one-way latency added to every link, in microseconds.
    #[arg(long, default_value_t = 0.0)]
    pub link_latency_us: f64,
    /// Emulated bandwidth of every link in Gbit/s (0 = unlimited).
    #[arg(long, default_value_t = 0.0)]
    pub link_gbps: f64,
    /// Longest wait for another rank before giving up, in milliseconds.
    #[arg(long, default_value_t = 60_000)]
    pub comm_timeout_ms: u64,
    /// A rank table (one host:port per line, rank 0 first) to lead ranks started elsewhere
    /// with `shoal worker`, instead of starting local ones.
    #[arg(long)]
    pub peers: Option<PathBuf>,
}

impl SplitArgs {
    /// Whether the run is split at all.
    pub fn is_split(&self) -> bool {
        self.tp * self.pp > 1 || self.peers.is_some()
    }

    /// Checks the options and makes the job every rank will run.
    ///
    /// # Errors
    /// On an impossible combination, naming it.
    pub fn job(&self, ctx: usize, threads: usize) -> anyhow::Result<Job> {
        if self.tp == 0 || self.pp == 0 || self.tp * self.pp > 64 {
            bail!(
                "--tp {} --pp {}: need 1 to 64 ranks in all",
                self.tp,
                self.pp
            );
        }
        if !self.stage_layers.is_empty() && self.stage_layers.len() != self.pp {
            bail!(
                "--stage-layers gives {} stages for --pp {}",
                self.stage_layers.len(),
                self.pp
            );
        }
        let ok = |x: f64| x.is_finite() && x >= 0.0;
        if !ok(self.link_latency_us) || !ok(self.link_gbps) {
            bail!("--link-latency-us and --link-gbps must be numbers >= 0");
        }
        let shm_path = match self.transport.as_str() {
            "tcp" => None,
            "shm" => Some(std::env::temp_dir().join(format!(
                "shoal-shm-{}-{}",
                std::process::id(),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos())
                    .unwrap_or(0)
            ))),
            other => bail!("--transport {other}: use tcp or shm"),
        };
        Ok(Job {
            tp: self.tp,
            pp: self.pp,
            stage_sizes: self.stage_layers.clone(),
            expert_split: self.expert_split.clone(),
            ctx,
            threads,
            timeout_ms: self.comm_timeout_ms.max(1),
            transport: self.transport.clone(),
            shm_path,
            link_latency_us: self.link_latency_us,
            link_gbps: self.link_gbps,
        })
    }
}

/// A split run's lead: the transport to the other ranks and the local workers, if any.
pub struct Launched {
    /// The mesh.
    pub transport: Arc<dyn Transport>,
    /// Local worker processes (none when leading a rank table).
    pub workers: Option<LocalWorkers>,
}

impl Launched {
    /// Waits (up to `grace`) for local workers to finish after the lead stopped them.
    pub fn finish(&mut self, grace: Duration) {
        if let Some(w) = self.workers.as_mut() {
            w.finish(grace);
        }
    }
}

/// Starts (or, with `--peers`, waits for) every other rank of `job` and assembles the mesh.
///
/// # Errors
/// When a rank cannot start or join before the deadline.
pub fn launch(args: &SplitArgs, job: &Job, model: &str, path: &Path) -> anyhow::Result<Launched> {
    let deadline = Instant::now() + Duration::from_millis(job.timeout_ms);
    let world = job.tp * job.pp;
    let (listener, workers) = match &args.peers {
        Some(table) => {
            let addrs = read_table(table)?;
            if addrs.len() != world {
                bail!(
                    "{} lists {} ranks; --tp {} x --pp {} needs {world}",
                    table.display(),
                    addrs.len(),
                    job.tp,
                    job.pp
                );
            }
            let l = TcpListener::bind(addrs[0])
                .with_context(|| format!("listening on {} (rank 0)", addrs[0]))?;
            (l, None)
        }
        None => {
            let l = TcpListener::bind("127.0.0.1:0").context("listening for local ranks")?;
            let w = LocalWorkers::spawn(model, world, l.local_addr()?, job.threads)?;
            (l, Some(w))
        }
    };
    let transport = lead_mesh(listener, world, job, path, deadline)?;
    Ok(Launched { transport, workers })
}

/// Rank 0 of a split, ready to lead: the job, the other ranks, its context and its shard.
pub struct LeadRank {
    /// What every rank runs.
    pub job: Job,
    /// The mesh and any local workers.
    pub launched: Launched,
    /// Rank 0's place in the split (plans filled in).
    pub ctx: RankContext,
    /// Rank 0's shard, with the tokenizer and template.
    pub model: LoadedModel,
}

impl LeadRank {
    /// Starts or joins every rank for `model_arg` (a context of `ctx_len` tokens, `threads`
    /// per rank) and loads rank 0's shard. With `comm_nanos`, rank 0's collectives add their
    /// wall time to it.
    ///
    /// # Errors
    /// When a rank cannot start or join, or the model cannot be loaded or split that way.
    pub fn start(
        args: &SplitArgs,
        model_arg: &str,
        ctx_len: usize,
        threads: usize,
        comm_nanos: Option<Arc<AtomicU64>>,
    ) -> anyhow::Result<Self> {
        let source = shoal_model::source::resolve(model_arg)?;
        let job = args.job(ctx_len, threads)?;
        crate::rank_device(0, job.tp * job.pp)?;
        let launched = launch(args, &job, model_arg, source.path())?;
        let layout = Layout {
            tp: job.tp,
            pp: job.pp,
        };
        let mut ctx = RankContext::over(
            launched.transport.clone(),
            layout,
            Duration::from_millis(job.timeout_ms),
        )?;
        if let Some(ns) = comm_nanos {
            ctx.world = Arc::new(Timed::new(ctx.world.clone(), ns.clone()));
            ctx.tp = Arc::new(Timed::new(ctx.tp.clone(), ns));
        }
        let sizes = (!job.stage_sizes.is_empty()).then_some(&job.stage_sizes[..]);
        let (model, plans) =
            LoadedModel::load_split(&source, layout, sizes, job.experts()?, 0, ctx.tp.clone())
                .with_context(|| {
                    format!("rank 0: loading its shard of {}", source.path().display())
                })?;
        ctx.plans = plans;
        Ok(LeadRank {
            job,
            launched,
            ctx,
            model,
        })
    }

    /// Tokens each sequence's cache holds: the job's context, at most the model's.
    pub fn capacity(&self) -> usize {
        self.job
            .ctx
            .min(self.model.transformer.config().context_len)
            .max(1)
    }
}

/// This process's peak resident memory in MB (`VmHWM`), where the OS reports it.
pub fn peak_rss_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}
