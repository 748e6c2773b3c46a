//! `shoal bench comm`: how fast the ranks of one instance can agree. In one process, with
//! one thread per rank, it measures over TCP loopback, shared memory and in-process
//! channels the all-reduce latency by message size and rank count, and the send/recv round
//! trip, next to the baseline of a raw TCP round trip (a ping-pong of the same size on a
//! plain blocking socket). Each row shows the median and 90th percentile in microseconds and
//! its ratio to the raw TCP round trip of the same size, as a table or as JSON.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use shoal_comm::{
    mem_mesh, shm_mesh_local, tcp_mesh_local, Communicator, Group, Transport, DEFAULT_RING_BYTES,
};

/// One measured row.
struct Row {
    transport: &'static str,
    op: &'static str,
    ranks: usize,
    bytes: usize,
    median_us: f64,
    p90_us: f64,
    /// Median over the raw TCP round trip of the same size.
    vs_tcp_rtt: f64,
}

const KINDS: [&str; 3] = ["tcp", "shm", "mem"];

/// Runs the benchmark: all-reduce for every rank count in `ranks` (each 2..=64) and every
/// size in `sizes` (bytes; all-reduce rounds down to whole f32s), send/recv round trips
/// between 2 ranks and raw TCP round trips for every size, each with `iters` timed
/// iterations after a short warm-up; prints a table, or JSON when `json` is set.
///
/// # Errors
/// When a rank count is out of range, `iters` is 0, or a transport fails.
pub fn run(ranks: &[usize], sizes: &[usize], iters: usize, json: bool) -> anyhow::Result<()> {
    if iters == 0 {
        bail!("the iteration count must be at least 1");
    }
    if let Some(n) = ranks.iter().find(|&&n| !(2..=64).contains(&n)) {
        bail!("rank count {n} is out of range (2..=64)");
    }
    let warmup = (iters / 10).clamp(3, 100);
    let mut rows = Vec::new();

    let mut baseline = Vec::with_capacity(sizes.len());
    for &bytes in sizes {
        let times = raw_tcp_round_trip(bytes, iters, warmup)
            .with_context(|| format!("raw TCP round trip of {bytes} bytes"))?;
        let (median_us, p90_us) = stats(times);
        baseline.push(median_us);
        rows.push(Row {
            transport: "tcp-raw",
            op: "round-trip",
            ranks: 2,
            bytes,
            median_us,
            p90_us,
            vs_tcp_rtt: 1.0,
        });
    }
    for kind in KINDS {
        let world = make_world(kind, 2)?;
        for (&bytes, &base) in sizes.iter().zip(&baseline) {
            let times = measure(&world, iters, warmup, bytes, round_trip)
                .with_context(|| format!("{kind} send/recv of {bytes} bytes"))?;
            let (median_us, p90_us) = stats(times);
            rows.push(Row {
                transport: kind,
                op: "send/recv",
                ranks: 2,
                bytes,
                median_us,
                p90_us,
                vs_tcp_rtt: median_us / base,
            });
        }
    }
    for kind in KINDS {
        for &n in ranks {
            let world = make_world(kind, n)?;
            for (&bytes, &base) in sizes.iter().zip(&baseline) {
                let floats = (bytes / 4).max(1);
                let times = measure(&world, iters, warmup, floats * 4, |g, b| {
                    g.all_reduce_sum(&mut b.floats)
                })
                .with_context(|| format!("{kind} all-reduce of {bytes} bytes on {n} ranks"))?;
                let (median_us, p90_us) = stats(times);
                rows.push(Row {
                    transport: kind,
                    op: "all-reduce",
                    ranks: n,
                    bytes: floats * 4,
                    median_us,
                    p90_us,
                    vs_tcp_rtt: median_us / base,
                });
            }
        }
    }
    if json {
        let v: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                serde_json::json!({
                    "transport": r.transport,
                    "op": r.op,
                    "ranks": r.ranks,
                    "bytes": r.bytes,
                    "median_us": r.median_us,
                    "p90_us": r.p90_us,
                    "vs_tcp_rtt": r.vs_tcp_rtt,
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print_table(&rows, iters);
    }
    Ok(())
}

fn print_table(rows: &[Row], iters: usize) {
    println!("ranks are threads of one process; {iters} timed iterations per row");
    println!("raw TCP round trip: ping-pong of the same size on one plain blocking socket");
    println!(
        "{:<8} {:<11} {:>5} {:>9} {:>11} {:>11} {:>10}",
        "link", "op", "ranks", "bytes", "median µs", "p90 µs", "÷ TCP RTT"
    );
    for r in rows {
        println!(
            "{:<8} {:<11} {:>5} {:>9} {:>11.1} {:>11.1} {:>10.2}",
            r.transport, r.op, r.ranks, r.bytes, r.median_us, r.p90_us, r.vs_tcp_rtt
        );
    }
}

fn make_world(kind: &str, n: usize) -> anyhow::Result<Vec<Arc<dyn Transport>>> {
    fn arcs<T: Transport + 'static>(v: Vec<T>) -> Vec<Arc<dyn Transport>> {
        v.into_iter()
            .map(|t| Arc::new(t) as Arc<dyn Transport>)
            .collect()
    }
    Ok(match kind {
        "tcp" => arcs(tcp_mesh_local(n).context("building a loopback TCP mesh")?),
        "shm" => {
            arcs(shm_mesh_local(n, DEFAULT_RING_BYTES).context("building a shared-memory world")?)
        }
        _ => arcs(mem_mesh(n)),
    })
}

/// The buffers of one rank: `bytes` bytes, and as many bytes of f32s.
struct Bufs {
    bytes: Vec<u8>,
    floats: Vec<f32>,
}

/// Runs `op` on every rank with buffers of `bytes`, `warmup` then `iters` times; returns
/// rank 0's time per timed call.
fn measure<F>(
    world: &[Arc<dyn Transport>],
    iters: usize,
    warmup: usize,
    bytes: usize,
    op: F,
) -> anyhow::Result<Vec<Duration>>
where
    F: Fn(&Group, &mut Bufs) -> Result<(), shoal_comm::CommError> + Sync,
{
    let results: Vec<anyhow::Result<Vec<Duration>>> = std::thread::scope(|s| {
        let handles: Vec<_> = world
            .iter()
            .map(|t| {
                let op = &op;
                s.spawn(move || {
                    let g = Group::world(Arc::clone(t)).with_timeout(Duration::from_secs(30));
                    let mut b = Bufs {
                        bytes: vec![0; bytes],
                        floats: vec![1.0; bytes / 4],
                    };
                    for _ in 0..warmup {
                        op(&g, &mut b)?;
                    }
                    let mut times = Vec::with_capacity(iters);
                    for _ in 0..iters {
                        let start = Instant::now();
                        op(&g, &mut b)?;
                        times.push(start.elapsed());
                    }
                    Ok(times)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a rank thread panicked")))
            })
            .collect()
    });
    let mut first = None;
    for r in results {
        let times = r?;
        first.get_or_insert(times);
    }
    first.context("an empty world")
}

/// One send/recv ping-pong between ranks 0 and 1 of `g`.
fn round_trip(g: &Group, b: &mut Bufs) -> Result<(), shoal_comm::CommError> {
    if g.rank() == 0 {
        g.send(1, &b.bytes)?;
        g.recv(1, &mut b.bytes)
    } else {
        g.recv(0, &mut b.bytes)?;
        g.send(0, &b.bytes)
    }
}

/// Ping-pong of `bytes` each way on one plain blocking loopback socket with `TCP_NODELAY`.
fn raw_tcp_round_trip(bytes: usize, iters: usize, warmup: usize) -> anyhow::Result<Vec<Duration>> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let mut client = TcpStream::connect(listener.local_addr()?)?;
    let (mut server, _) = listener.accept()?;
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    let total = warmup + iters;
    std::thread::scope(|s| {
        let echo = s.spawn(move || -> std::io::Result<()> {
            let mut buf = vec![0u8; bytes];
            for _ in 0..total {
                server.read_exact(&mut buf)?;
                server.write_all(&buf)?;
            }
            Ok(())
        });
        let mut buf = vec![0u8; bytes];
        let mut times = Vec::with_capacity(iters);
        for i in 0..total {
            let start = Instant::now();
            client.write_all(&buf)?;
            client.read_exact(&mut buf)?;
            if i >= warmup {
                times.push(start.elapsed());
            }
        }
        echo.join()
            .map_err(|_| anyhow::anyhow!("the echo thread panicked"))??;
        Ok(times)
    })
}

/// Median and 90th percentile, in microseconds.
fn stats(mut times: Vec<Duration>) -> (f64, f64) {
    if times.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    times.sort_unstable();
    let at = |q: usize| times[(times.len() * q / 100).min(times.len() - 1)].as_secs_f64() * 1e6;
    (at(50), at(90))
}
