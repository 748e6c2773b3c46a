//! Model stores the way other tools lay them out, for tests of reading models in place:
//! Ollama's ([`write_ollama`]: a manifest under `manifests/HOST/NAMESPACE/MODEL/TAG` naming
//! the model, template and parameter layers by digest, the layers as `blobs/sha256-HEX`) and
//! LM Studio's ([`write_lmstudio`]: `PUBLISHER/REPO/FILE` copies).

use std::fs;
use std::path::{Path, PathBuf};

use serde_json::json;
use sha2::{Digest, Sha256};

use crate::TestkitError;

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TestkitError + '_ {
    move |source| TestkitError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes `data` as a blob of the Ollama store `root`; returns its digest `sha256:HEX`.
pub fn ollama_blob(root: &Path, data: &[u8]) -> Result<String, TestkitError> {
    let hex = format!("{:x}", Sha256::digest(data));
    let blobs = root.join("blobs");
    fs::create_dir_all(&blobs).map_err(io(&blobs))?;
    let p = blobs.join(format!("sha256-{hex}"));
    fs::write(&p, data).map_err(io(&p))?;
    Ok(format!("sha256:{hex}"))
}

/// Writes model `gguf` (a file's bytes) into the Ollama store `root` as
/// `HOST/NAMESPACE/MODEL:TAG`, the way `ollama pull` leaves it: the GGUF file as the model
/// layer, beside a template and a parameters layer and a config blob. Returns the manifest's
/// path.
pub fn write_ollama(
    root: &Path,
    host: &str,
    namespace: &str,
    model: &str,
    tag: &str,
    gguf: &[u8],
) -> Result<PathBuf, TestkitError> {
    let template = b"{{ .Prompt }}";
    let params = br#"{"stop": ["<|end|>"]}"#;
    let config = br#"{"model_format": "gguf", "model_family": "llama"}"#;
    let layer = |media: &str, data: &[u8]| -> Result<serde_json::Value, TestkitError> {
        Ok(json!({
            "mediaType": media,
            "digest": ollama_blob(root, data)?,
            "size": data.len(),
        }))
    };
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": layer("application/vnd.docker.container.image.v1+json", config)?,
        "layers": [
            layer("application/vnd.ollama.image.model", gguf)?,
            layer("application/vnd.ollama.image.template", template)?,
            layer("application/vnd.ollama.image.params", params)?,
        ],
    });
    let dir = root
        .join("manifests")
        .join(host)
        .join(namespace)
        .join(model);
    fs::create_dir_all(&dir).map_err(io(&dir))?;
    let p = dir.join(tag);
    fs::write(&p, manifest.to_string()).map_err(io(&p))?;
    Ok(p)
}

/// Copies `files` into LM Studio's models folder `root` as `PUBLISHER/REPO/NAME`; returns
/// the copies' paths.
pub fn write_lmstudio(
    root: &Path,
    publisher: &str,
    repo: &str,
    files: &[(&str, &[u8])],
) -> Result<Vec<PathBuf>, TestkitError> {
    let dir = root.join(publisher).join(repo);
    fs::create_dir_all(&dir).map_err(io(&dir))?;
    let mut out = Vec::new();
    for (name, data) in files {
        let p = dir.join(name);
        fs::write(&p, data).map_err(io(&p))?;
        out.push(p);
    }
    Ok(out)
}
