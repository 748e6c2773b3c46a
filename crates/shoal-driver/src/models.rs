//! The model files a node offers the cluster. Each node publishes (key `models`) a
//! [`ModelFile`] for every complete GGUF file it holds: the name it is loaded by, its SHA-256,
//! its size and the planner's profile of it, read from the headers without loading weights.
//! With these any node can place a model, and a rank that lacks the file can find a node to
//! fetch it from. The same naming ([`model_id`]) and profile ([`profile_from_model`]) serve
//! the command line, so a model is called the same everywhere.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use shoal_engine::planning::model_profile;
use shoal_engine::weights::{GgufWeights, HfNaming, SafetensorsWeights};
use shoal_model::gguf::GgufFile;
use shoal_model::source::ModelSource;
use shoal_planner::ModelProfile;

/// A model file this node holds, as published.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ModelFile {
    /// The name it is loaded by (catalog key or file name without `.gguf`).
    pub name: String,
    /// SHA-256 of the whole file, hex.
    pub sha256: String,
    /// Bytes.
    pub size: u64,
    /// What the planner needs.
    pub profile: ModelProfile,
    /// Where it is (not published): the file, or a split set's first part.
    #[serde(skip)]
    pub path: PathBuf,
    /// Its files in order (not published): the file, or a split set's parts.
    #[serde(skip)]
    pub parts: Vec<PathBuf>,
}

/// SHA-256 of a model's files read one after the other, hex.
pub(crate) fn sha256_parts(paths: &[PathBuf]) -> anyhow::Result<String> {
    let paths: Vec<&Path> = paths.iter().map(PathBuf::as_path).collect();
    Ok(shoal_model::catalog::sha256_files(&paths)?.1)
}

/// A model this node can offer: `arg` resolved to a GGUF file (or split set), its SHA-256
/// (the catalog's for a fetched catalog model, the digest a store names a one-file blob by,
/// computed otherwise, over a set's parts in order) and profile.
pub fn describe_model(arg: &str) -> anyhow::Result<ModelFile> {
    let source = shoal_model::source::resolve(arg)?;
    let ModelSource::Gguf(path) = &source else {
        bail!(
            "{arg} is a Hugging Face folder; cluster instances load GGUF files (convert it, or \
             serve it on one node with --model)"
        );
    };
    let parts: Vec<PathBuf> = GgufFile::open(path)
        .with_context(|| format!("opening {}", path.display()))?
        .part_paths()
        .into_iter()
        .map(Path::to_path_buf)
        .collect();
    let sha256 = match shoal_model::catalog::entry(arg) {
        Some(e) => e.sha256.to_string(),
        // a store's blob is named by its digest (a wrong one is found when a node asks for
        // its manifest, which is computed with the whole file's SHA-256)
        None => match (
            &parts[..],
            parts
                .first()
                .and_then(|p| shoal_model::stores::blob_sha256(p)),
        ) {
            ([_], Some(sha)) => sha,
            _ => sha256_parts(&parts)?,
        },
    };
    let mut size = 0;
    for p in &parts {
        size += std::fs::metadata(p)?.len();
    }
    let name = model_id(arg);
    let profile = profile_from_model(arg)?;
    Ok(ModelFile {
        name,
        sha256,
        size,
        profile,
        path: path.clone(),
        parts,
    })
}

/// The id clients use for a MODEL argument: the catalog key; an Ollama model's `NAME:TAG`;
/// for a path (or a `.gguf` name), or a store name that resolves to a file (`lmstudio:`,
/// `hf:`), the file or
/// folder name without `.gguf` (a split set's name without its part number: `NAME` for any of
/// `NAME-0000i-of-0000n.gguf`); else the argument's last `/`-separated piece.
pub fn model_id(arg: &str) -> String {
    if let Some(id) = shoal_model::stores::ollama_id(arg) {
        return id;
    }
    let file_id = |p: &Path| {
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| arg.to_string());
        if let Some((prefix, _, _)) = shoal_model::gguf::set::parse_name(&name) {
            return prefix.to_string();
        }
        name.strip_suffix(".gguf").unwrap_or(&name).to_string()
    };
    let p = std::path::Path::new(arg);
    if p.exists() || arg.to_ascii_lowercase().ends_with(".gguf") {
        return file_id(p);
    }
    if shoal_model::stores::has_store_prefix(arg) {
        if let Ok(source) = shoal_model::source::resolve(arg) {
            return file_id(source.path());
        }
    }
    arg.rsplit('/').next().unwrap_or(arg).to_string()
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| p.display().to_string())
}

/// Resolves MODEL and reads its profile from the file headers.
pub fn profile_from_model(arg: &str) -> anyhow::Result<ModelProfile> {
    let source = shoal_model::source::resolve(arg)?;
    match &source {
        ModelSource::Gguf(path) => {
            let label = path.display().to_string();
            let file = GgufFile::open(path).with_context(|| format!("opening {label}"))?;
            let cfg = shoal_engine::arch::config_of_file(&file, &label)?;
            Ok(model_profile(
                &file_name(path),
                &cfg,
                &GgufWeights::new(file),
            )?)
        }
        ModelSource::HfFolder(dir) => {
            let config = dir.join("config.json");
            let text = std::fs::read_to_string(&config)
                .with_context(|| format!("reading {}", config.display()))?;
            let json: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not valid JSON", config.display()))?;
            let cfg = shoal_engine::arch::config_from_hf(&json, &dir.display().to_string())?;
            let files = source.safetensors_files()?;
            let src = SafetensorsWeights::open(&files, HfNaming::for_config(&cfg))?;
            Ok(model_profile(&file_name(dir), &cfg, &src)?)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::model_id;

    #[test]
    fn ids_of_paths_store_names_and_keys() {
        assert_eq!(model_id("ollama:tiny"), "tiny");
        assert_eq!(model_id("ollama:tiny:latest"), "tiny");
        assert_eq!(
            model_id("ollama:someone/qwen2.5-coder:7b"),
            "qwen2.5-coder:7b"
        );
        // a path on another node: named as the node names the file
        assert_eq!(model_id("/elsewhere/Model-Q4_K_M.gguf"), "Model-Q4_K_M");
        assert_eq!(model_id("/elsewhere/Big-00002-of-00003.gguf"), "Big");
        assert_eq!(model_id("org/name"), "name");
        assert_eq!(model_id("qwen05"), "qwen05");
    }
}
