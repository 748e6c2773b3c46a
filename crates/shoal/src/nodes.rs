//! The cluster commands that look: `shoal nodes`, `shoal links`, `shoal status [--watch]`,
//! through a node's HTTP API (`--url` or `SHOAL_URL`); and `shoal secret`, which makes a new
//! cluster secret. Each prints a table, or with `--json` what the node answered.

use std::time::Duration;

use clap::Args;
use serde_json::Value;

use crate::client::{Client, ClientArgs};

/// Options of the looking commands.
#[derive(Args, Debug)]
pub struct LookArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct StatusArgs {
    #[command(flatten)]
    pub look: LookArgs,
    /// Print again every --interval seconds until Ctrl-C.
    #[arg(long)]
    pub watch: bool,
    /// Seconds between prints with --watch.
    #[arg(long, default_value_t = 2.0)]
    pub interval: f64,
}

fn gb(v: &Value) -> String {
    v.as_f64()
        .map(|b| format!("{:.1}", b / 1e9))
        .unwrap_or_else(|| "-".into())
}

/// `shoal nodes`.
pub fn nodes(args: LookArgs) -> anyhow::Result<()> {
    let v = Client::new(&args.client).get("/cluster/nodes")?;
    let nodes = v["nodes"].as_array().cloned().unwrap_or_default();
    if args.json {
        println!("{}", Value::Array(nodes));
        return Ok(());
    }
    println!(
        "{:<17} {:<14} {:<6} {:<12} {:>14} {:>8} {:>8}  {:<21} API",
        "ID", "NAME", "ALIVE", "ROLE", "MEM FREE/TOTAL", "BW GB/s", "GFLOP/s", "LISTEN"
    );
    for n in &nodes {
        let f = &n["facts"];
        let role = match (n["coordinator"].as_bool(), n["self"].as_bool()) {
            (Some(true), Some(true)) => "coord, self",
            (Some(true), _) => "coordinator",
            (_, Some(true)) => "self",
            _ => "",
        };
        // an entry node (`serve --no-compute`) holds no shares
        let role = match (f["entry_only"].as_bool() == Some(true), role) {
            (true, "") => "entry".to_string(),
            (true, r) => format!("{r}, entry"),
            (false, r) => r.to_string(),
        };
        println!(
            "{:<17} {:<14} {:<6} {:<12} {:>14} {:>8} {:>8}  {:<21} {}",
            n["id"].as_str().unwrap_or("?"),
            n["name"].as_str().unwrap_or(""),
            if n["alive"].as_bool() == Some(true) {
                "yes"
            } else {
                "no"
            },
            role,
            format!(
                "{}/{} GB",
                gb(&f["memory_free_bytes"]),
                gb(&f["memory_total_bytes"])
            ),
            f["mem_bandwidth_gbs"]
                .as_f64()
                .map(|x| format!("{x:.1}"))
                .unwrap_or_else(|| "-".into()),
            f["compute_gflops"]
                .as_f64()
                .map(|x| format!("{x:.0}"))
                .unwrap_or_else(|| "-".into()),
            f["listen"].as_str().unwrap_or("-"),
            f["api"].as_str().unwrap_or("-"),
        );
        let backend = f["backend"].as_str().unwrap_or("cpu");
        for g in f["gpus"].as_array().into_iter().flatten() {
            let n = g["index"].as_u64().unwrap_or(0);
            let using = backend == format!("gpu:{n}");
            println!(
                "{:<17} gpu:{n} {} ({}{}{}){}{}",
                "",
                g["name"].as_str().unwrap_or("?"),
                g["api"].as_str().unwrap_or("?"),
                g["memory_bytes"]
                    .as_u64()
                    .map(|b| format!(", {:.1} GiB", b as f64 / (1u64 << 30) as f64))
                    .unwrap_or_default(),
                if g["software"].as_bool() == Some(true) {
                    ", software"
                } else {
                    ""
                },
                g["read_gb_s"]
                    .as_f64()
                    .map(|b| format!(", {b:.0} GB/s"))
                    .unwrap_or_default()
                    + &g["compute_gflops"]
                        .as_f64()
                        .map(|f| format!(", {f:.0} GFLOP/s"))
                        .unwrap_or_default(),
                if using { ", computes here" } else { "" },
            );
            if let Some(why) = g["failed"].as_str() {
                println!("{:<17}   FAILED: {why}", "");
            }
        }
    }
    Ok(())
}

/// `shoal links`.
pub fn links(args: LookArgs) -> anyhow::Result<()> {
    let v = Client::new(&args.client).get("/cluster/links")?;
    let links = v["links"].as_array().cloned().unwrap_or_default();
    if args.json {
        println!("{}", Value::Array(links));
        return Ok(());
    }
    println!(
        "{:<17} {:<17} {:>10} {:>12} {:>20} {:>8}",
        "FROM", "TO", "RTT us", "Gbit/s", "4K/16K/64K RTT us", "AGE s"
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    for l in &links {
        let age = l["measured_at_ms"]
            .as_u64()
            .map(|t| format!("{:.0}", now.saturating_sub(t) as f64 / 1e3))
            .unwrap_or_else(|| "-".into());
        // the round trips of messages of a split's sizes
        let sized: Vec<String> = l["sized"]
            .as_array()
            .map(|s| {
                s.iter()
                    .map(|m| format!("{:.0}", m["rtt_us"].as_f64().unwrap_or(f64::NAN)))
                    .collect()
            })
            .unwrap_or_default();
        let sized = if sized.is_empty() {
            "-".to_string()
        } else {
            sized.join("/")
        };
        println!(
            "{:<17} {:<17} {:>10.0} {:>12.2} {:>20} {:>8}",
            l["from"].as_str().unwrap_or("?"),
            l["to"].as_str().unwrap_or("?"),
            l["rtt_us"].as_f64().unwrap_or(f64::NAN),
            l["bandwidth_gbps"].as_f64().unwrap_or(f64::NAN),
            sized,
            age
        );
    }
    if links.is_empty() {
        eprintln!("no link measured yet (links are measured when a node joins and every 15 s)");
    }
    Ok(())
}

/// `shoal status`.
pub fn status(args: StatusArgs) -> anyhow::Result<()> {
    if !(args.interval > 0.0 && args.interval.is_finite()) {
        anyhow::bail!("--interval must be a positive number of seconds");
    }
    let client = Client::new(&args.look.client);
    loop {
        let v = client.get("/cluster/status")?;
        if args.look.json {
            println!("{v}");
        } else {
            println!(
                "node {}  listen {}  coordinator {}  nodes alive {}  dead {}  links {}  refused sessions {}  refused datagrams {}  models {}  instances {}",
                v["node"].as_str().unwrap_or("?"),
                v["listen"].as_str().unwrap_or("?"),
                v["coordinator"].as_str().unwrap_or("none"),
                v["alive"],
                v["dead"],
                v["links"],
                v["refused_sessions"],
                v["refused_datagrams"],
                v["models"]
                    .as_array()
                    .map(|m| m.iter().filter_map(|x| x.as_str()).collect::<Vec<_>>().join(","))
                    .unwrap_or_default(),
                v["instances"]
                    .as_object()
                    .filter(|m| !m.is_empty())
                    .map(|m| m
                        .iter()
                        .map(|(k, n)| format!("{n} {k}"))
                        .collect::<Vec<_>>()
                        .join(", "))
                    .unwrap_or_else(|| "none".into()),
            );
            for p in v["incompatible_nodes"].as_array().into_iter().flatten() {
                println!(
                    "  refused node {} at {}: cluster protocol {} (works with {}..), this node {} \
                     (works with {}..); {} sessions refused",
                    p["node"].as_str().unwrap_or("?"),
                    p["address"].as_str().unwrap_or("?"),
                    p["versions"]["version"],
                    p["versions"]["oldest"],
                    v["protocol"]["version"],
                    v["protocol"]["oldest"],
                    p["refused"],
                );
            }
        }
        if !args.watch {
            return Ok(());
        }
        std::thread::sleep(Duration::from_secs_f64(args.interval));
    }
}

/// `shoal secret`: a new cluster secret on stdout.
pub fn secret() -> anyhow::Result<()> {
    println!("{}", shoal_cluster::secret::ClusterSecret::generate());
    eprintln!("store it in a file readable only by you (chmod 600) and give every node --secret-file FILE, or set SHOAL_SECRET");
    Ok(())
}
