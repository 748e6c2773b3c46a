//! The cluster commands that change what runs: `shoal load`, `shoal unload`, `shoal drain`,
//! and `shoal ps`, which lists the instances. They talk to any node's HTTP API (`--url` or
//! `SHOAL_URL`); that node forwards changes to the coordinator. `load` waits until the
//! instance answers (or fails), printing its progress on stderr unless `--no-wait`.

use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::bail;
use clap::Args;
use serde_json::{json, Value};

use crate::client::Client;
use crate::nodes::LookArgs;

#[derive(Args, Debug)]
pub struct LoadArgs {
    /// The model: a catalog key or file name some node offers (see `shoal ps --models`), or
    /// a GGUF path on the node asked.
    pub model: String,
    /// auto (the fastest placement that fits), tensor, pipeline or hybrid.
    #[arg(long, default_value = "auto")]
    pub strategy: String,
    /// How a mixture of experts' routed experts are cut across a stage's nodes: whole,
    /// sliced, or auto (whichever reads fewer bytes on the busiest node per token).
    #[arg(long, default_value = "auto", value_parser = ["auto", "whole", "sliced"])]
    pub expert_split: String,
    /// Only these nodes (ids or names, comma separated).
    #[arg(long, value_delimiter = ',')]
    pub nodes: Vec<String>,
    /// Context length per request, tokens.
    #[arg(long, default_value_t = 4096)]
    pub ctx: u32,
    /// The instance id clients name as the model (default: the model's name).
    #[arg(long)]
    pub id: Option<String>,
    /// Return once placed, without waiting for it to answer.
    #[arg(long)]
    pub no_wait: bool,
    /// Seconds to wait for it to be ready.
    #[arg(long, default_value_t = 900)]
    pub timeout_s: u64,
    #[command(flatten)]
    pub look: LookArgs,
}

#[derive(Args, Debug)]
pub struct UnloadArgs {
    /// The instance id.
    pub id: String,
    #[command(flatten)]
    pub look: LookArgs,
}

#[derive(Args, Debug)]
pub struct DrainArgs {
    /// The node (id or name) whose instances move elsewhere.
    pub node: String,
    #[command(flatten)]
    pub look: LookArgs,
}

fn instance<'a>(table: &'a Value, id: &str) -> Option<&'a Value> {
    table["instances"]
        .as_array()?
        .iter()
        .find(|i| i["id"] == id)
}

/// `shoal load`.
pub fn load(args: LoadArgs) -> anyhow::Result<()> {
    let client = Client::new(&args.look.client);
    let mut body = json!({
        "model": args.model,
        "strategy": args.strategy,
        "experts": args.expert_split,
        "ctx": args.ctx,
    });
    if !args.nodes.is_empty() {
        body["nodes"] = json!(args.nodes);
    }
    if let Some(id) = &args.id {
        body["id"] = json!(id);
    }
    let placed = client.post("/cluster/instances", &body)?;
    let inst = &placed["instance"];
    let id = inst["id"].as_str().unwrap_or("?").to_string();
    if !args.json_mode() {
        let experts = match inst["placement"]["experts"].as_str() {
            Some(e @ ("whole" | "sliced")) => format!(", {e} experts"),
            _ => String::new(),
        };
        eprintln!(
            "placed {id}: {} ({} x {}{experts})",
            describe(&inst["placement"]),
            inst["placement"]["tp"],
            inst["placement"]["stages"].as_array().map_or(0, Vec::len)
        );
        // the planner's word on a forced strategy or node list it ranks below its own choice
        for line in inst["history"].as_array().into_iter().flatten() {
            if let Some(l) = line.as_str().filter(|l| l.starts_with("forced ")) {
                eprintln!("note: {l}");
            }
        }
    }
    if args.no_wait {
        if args.json_mode() {
            println!("{placed}");
        }
        return Ok(());
    }
    let placed_at = Instant::now();
    let deadline = placed_at + Duration::from_secs(args.timeout_s);
    let mut last = String::new();
    loop {
        let table = client.get("/cluster/instances")?;
        let Some(i) = instance(&table, &id) else {
            // the node asked may not have heard of the placement yet
            if Instant::now() > placed_at + Duration::from_secs(15) {
                bail!("instance {id} is not in the table of the node asked (unloaded?)");
            }
            std::thread::sleep(Duration::from_millis(200));
            continue;
        };
        let line = format!(
            "{} {}",
            i["state"].as_str().unwrap_or("?"),
            i["ranks"]
                .as_object()
                .map(|r| r
                    .iter()
                    .map(|(n, v)| format!(
                        "{n}: {}",
                        v["detail"]
                            .as_str()
                            .unwrap_or(v["state"].as_str().unwrap_or(""))
                    ))
                    .collect::<Vec<_>>()
                    .join("; "))
                .unwrap_or_default()
        );
        if line != last && !args.json_mode() {
            eprintln!("  {line}");
            std::io::stderr().flush().ok();
            last = line;
        }
        match i["state"].as_str() {
            Some("ready") => {
                if args.json_mode() {
                    println!("{i}");
                } else {
                    println!(
                        "{id} is ready on {} (lead {}, API http://{})",
                        i["nodes"]
                            .as_array()
                            .map(|n| n
                                .iter()
                                .filter_map(Value::as_str)
                                .collect::<Vec<_>>()
                                .join(", "))
                            .unwrap_or_default(),
                        i["lead"].as_str().unwrap_or("?"),
                        i["api"].as_str().unwrap_or("?")
                    );
                }
                return Ok(());
            }
            Some("failed") => bail!(
                "instance {id} failed: {}",
                i["reason"].as_str().unwrap_or("no reason given")
            ),
            _ => {}
        }
        if Instant::now() > deadline {
            bail!(
                "instance {id} was not ready after {} s (state {})",
                args.timeout_s,
                i["state"]
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

impl LoadArgs {
    fn json_mode(&self) -> bool {
        self.look.json
    }
}

fn describe(p: &Value) -> String {
    let Some(stages) = p["stages"].as_array() else {
        return "?".into();
    };
    stages
        .iter()
        .map(|s| {
            format!(
                "{}[{}..{}]",
                s["nodes"]
                    .as_array()
                    .map(|n| n
                        .iter()
                        .filter_map(Value::as_str)
                        .collect::<Vec<_>>()
                        .join("+"))
                    .unwrap_or_default(),
                s["layers"]["start"],
                s["layers"]["end"]
            )
        })
        .collect::<Vec<_>>()
        .join(" -> ")
}

/// `shoal unload`.
pub fn unload(args: UnloadArgs) -> anyhow::Result<()> {
    let v = Client::new(&args.look.client).delete(&format!("/cluster/instances/{}", args.id))?;
    if args.look.json {
        println!("{v}");
    } else {
        println!("unloading {}", args.id);
    }
    Ok(())
}

/// `shoal drain`.
pub fn drain(args: DrainArgs) -> anyhow::Result<()> {
    let v = Client::new(&args.look.client).post("/cluster/drain", &json!({"node": args.node}))?;
    if args.look.json {
        println!("{v}");
    } else {
        let moved: Vec<&str> = v["moved"]
            .as_array()
            .map(|m| m.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        println!(
            "drained {}: {}",
            args.node,
            if moved.is_empty() {
                "no instance ran there".to_string()
            } else {
                format!("re-placing {}", moved.join(", "))
            }
        );
    }
    Ok(())
}

/// `shoal ps`.
pub fn ps(args: LookArgs) -> anyhow::Result<()> {
    let v = Client::new(&args.client).get("/cluster/instances")?;
    if args.json {
        println!("{}", v["instances"]);
        return Ok(());
    }
    let drained: Vec<&str> = v["drained"]
        .as_array()
        .map(|d| d.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if !drained.is_empty() {
        println!(
            "drained (no new placements until they leave): {}",
            drained.join(", ")
        );
    }
    print!("{}", ps_table(&v["instances"]));
    Ok(())
}

/// `shoal ps`'s table of `instances` (the listing's array): each column as wide as its
/// longest cell, so long ids, models or placements do not shift the columns after them; an
/// instance's failure reason on its own line below it.
fn ps_table(instances: &Value) -> String {
    let list = instances.as_array().cloned().unwrap_or_default();
    let text = |v: &Value, or: &str| v.as_str().unwrap_or(or).to_string();
    let head = ["ID", "MODEL", "STATE", "GEN", "CTX", "PLACEMENT", "API"];
    let rows: Vec<[String; 7]> = list
        .iter()
        .map(|i| {
            [
                text(&i["id"], "?"),
                text(&i["model"], "?"),
                text(&i["state"], "?"),
                i["generation"].to_string(),
                i["ctx"].to_string(),
                text(&i["placement"], "?"),
                text(&i["api"], "-"),
            ]
        })
        .collect();
    let mut w = head.map(str::len);
    for r in &rows {
        for (k, cell) in r.iter().enumerate() {
            w[k] = w[k].max(cell.chars().count());
        }
    }
    let line = |c: [&str; 7]| {
        format!(
            "{:<w0$}  {:<w1$}  {:<w2$}  {:>w3$}  {:>w4$}  {:<w5$}  {}",
            c[0],
            c[1],
            c[2],
            c[3],
            c[4],
            c[5],
            c[6],
            w0 = w[0],
            w1 = w[1],
            w2 = w[2],
            w3 = w[3],
            w4 = w[4],
            w5 = w[5],
        )
        .trim_end()
        .to_string()
    };
    let mut out = line(head) + "\n";
    for (r, i) in rows.iter().zip(&list) {
        out += &(line(std::array::from_fn(|k| r[k].as_str())) + "\n");
        if let Some(reason) = i["reason"].as_str() {
            out += &format!("    reason: {reason}\n");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ps_columns_line_up_whatever_the_ids() {
        let long = "a-very-long-instance-id-that-is-longer-than-any-column";
        let v = json!([
            {"id": "qwen05", "model": "qwen05", "state": "ready", "generation": 1, "ctx": 4096,
             "placement": "a[0..24]", "api": "127.0.0.1:7337"},
            {"id": long, "model": "Qwen2.5-Coder-7B-Instruct-Q4_K_M", "state": "loading",
             "generation": 12, "ctx": 32768, "placement": "a[0..14] -> b[14..28]",
             "api": null, "reason": "waiting"},
        ]);
        let t = ps_table(&v);
        let lines: Vec<&str> = t.lines().filter(|l| !l.starts_with("    reason")).collect();
        assert_eq!(lines.len(), 3, "{t}");
        // text columns start where their header does, number columns end where theirs does
        for head in ["MODEL", "STATE", "PLACEMENT", "API"] {
            let at = lines[0].find(head).unwrap();
            for l in &lines[1..] {
                assert!(
                    l[..at].ends_with("  ") && !l[at..].starts_with(' '),
                    "{head} in {l:?}\n{t}"
                );
            }
        }
        for head in ["GEN", "CTX"] {
            let end = lines[0].find(head).unwrap() + head.len();
            for l in &lines[1..] {
                assert!(
                    !l[..end].ends_with(' ') && l[end..].starts_with("  "),
                    "{head} in {l:?}\n{t}"
                );
            }
        }
        assert!(lines[2].starts_with(long), "{t}");
        assert!(lines[2].contains(" -> b[14..28]  -"), "{t}");
        assert!(t.contains("    reason: waiting"), "{t}");
    }
}
