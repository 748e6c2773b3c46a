//! `shoal doctor`: asks a node (`--url`, `SHOAL_URL`) what stands between it and a working
//! cluster (`GET /cluster/doctor`: the secret file's permissions, nodes refused for another
//! secret, multicast for mDNS, reachable ports and measured links, memory against what the
//! planner counts, the kernels' CPU features, transparent huge pages, clock skew) and prints
//! each finding with its fix. Exits non-zero when it finds a problem.

use serde_json::Value;

use crate::client::Client;
use crate::nodes::LookArgs;

/// `shoal doctor`.
pub fn main(args: LookArgs) -> anyhow::Result<()> {
    let v = Client::new(&args.client).get("/cluster/doctor")?;
    let findings = v["findings"].as_array().cloned().unwrap_or_default();
    if args.json {
        println!("{v}");
    } else {
        let node = v["node"].as_str().unwrap_or("a node outside any cluster");
        println!("node {node}:");
        for f in &findings {
            let mark = match f["level"].as_str() {
                Some("problem") => "PROBLEM",
                Some("warning") => "warning",
                _ => "ok",
            };
            println!("  {mark:<8} {:<11} {}", text(&f["check"]), text(&f["what"]));
            if let Some(fix) = f["fix"].as_str() {
                println!("  {:<8} {:<11} fix: {fix}", "", "");
            }
        }
    }
    let problems = findings.iter().filter(|f| f["level"] == "problem").count();
    let warnings = findings.iter().filter(|f| f["level"] == "warning").count();
    if !args.json {
        println!("{problems} problems, {warnings} warnings");
    }
    if problems > 0 {
        anyhow::bail!("{problems} problems found");
    }
    Ok(())
}

fn text(v: &Value) -> &str {
    v.as_str().unwrap_or("")
}
