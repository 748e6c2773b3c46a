//! `shoal keys create|list|revoke`: manages a node's API keys through its HTTP API
//! (`--url` or `SHOAL_URL`), authenticating with `--key` or `SHOAL_API_KEY` once keys exist.

use clap::{Args, Subcommand};
use serde_json::{json, Value};

use crate::client::Client;

#[derive(Args, Debug)]
pub struct KeysArgs {
    #[command(subcommand)]
    pub command: KeysCommand,
    #[command(flatten)]
    pub client: crate::client::ClientArgs,
    /// Print JSON.
    #[arg(long, global = true)]
    pub json: bool,
}

#[derive(Subcommand, Debug)]
pub enum KeysCommand {
    /// Create a key; its secret is printed once (the first key is an administrator key).
    Create {
        /// A label for the key.
        #[arg(long)]
        name: String,
        /// May manage keys.
        #[arg(long)]
        admin: bool,
        /// Requests per minute allowed (default: the server's --rate-limit).
        #[arg(long)]
        rpm: Option<u32>,
    },
    /// List keys (never their secrets).
    List,
    /// Revoke a key by id.
    Revoke {
        /// The key's id (`key_...`).
        id: String,
    },
}

pub fn main(args: KeysArgs) -> anyhow::Result<()> {
    let client = Client::new(&args.client);
    match args.command {
        KeysCommand::Create { name, admin, rpm } => {
            let v = client.post(
                "/admin/keys",
                &json!({"name": name, "admin": admin, "rpm": rpm}),
            )?;
            if args.json {
                println!("{v}");
            } else {
                let id = v["key"]["id"].as_str().unwrap_or("?");
                let admin = v["key"]["admin"].as_bool().unwrap_or(false);
                eprintln!(
                    "created {}key {id}; its secret is shown only now:",
                    if admin { "administrator " } else { "" }
                );
                println!("{}", v["secret"].as_str().unwrap_or(""));
            }
        }
        KeysCommand::List => {
            let v = client.get("/admin/keys")?;
            if args.json {
                println!("{}", v["keys"]);
            } else {
                let keys = v["keys"].as_array().cloned().unwrap_or_default();
                println!("{:<18} {:<24} {:<6} {:>6}", "ID", "NAME", "ADMIN", "RPM");
                for k in keys {
                    println!(
                        "{:<18} {:<24} {:<6} {:>6}",
                        k["id"].as_str().unwrap_or(""),
                        k["name"].as_str().unwrap_or(""),
                        k["admin"].as_bool().unwrap_or(false),
                        match &k["rpm"] {
                            Value::Number(n) => n.to_string(),
                            _ => "-".into(),
                        }
                    );
                }
            }
        }
        KeysCommand::Revoke { id } => {
            let v = client.delete(&format!("/admin/keys/{id}"))?;
            if args.json {
                println!("{v}");
            } else {
                eprintln!("revoked {id}");
            }
        }
    }
    Ok(())
}
