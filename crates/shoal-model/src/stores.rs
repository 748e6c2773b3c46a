//! Models where other tools keep them. Ollama keeps a model as a manifest
//! (`manifests/HOST/NAMESPACE/MODEL/TAG`, JSON naming content-addressed layers) beside the
//! layers themselves (`blobs/sha256-HEX`), under `$OLLAMA_MODELS` or `~/.ollama/models` (the
//! Linux service's `/usr/share/ollama/.ollama/models` when only that exists); the layer of
//! media type `application/vnd.ollama.image.model` is the GGUF file, read in place. LM Studio
//! keeps GGUF files as `PUBLISHER/REPO/FILE.gguf` under `~/.lmstudio/models` (older versions:
//! `~/.cache/lm-studio/models`; `$SHOAL_LMSTUDIO_MODELS` names another folder). A model in
//! either store is named `ollama:NAME[:TAG]` or `lmstudio:PUBLISHER/REPO/FILE.gguf` (or
//! `lmstudio:` and a file name, file stem, split-set name, `PUBLISHER/REPO` or `REPO` that
//! names one model). [`list`] shows what every store on this machine holds, the Hugging Face
//! cache included, each entry with the MODEL argument that loads it. Nothing here writes to a
//! store.

use std::fs;
use std::io::Read;
use std::path::{Component, Path, PathBuf};

use serde::Serialize;

use crate::hub::{self, GgufModel};
use crate::source::{ResolveError, Result, GGUF_MAGIC};

/// The prefix of an Ollama model name given as MODEL.
pub const OLLAMA_PREFIX: &str = "ollama:";
/// The prefix of an LM Studio model given as MODEL.
pub const LMSTUDIO_PREFIX: &str = "lmstudio:";
/// Environment variable naming Ollama's store (Ollama's own setting).
pub const OLLAMA_ENV: &str = "OLLAMA_MODELS";
/// Environment variable naming LM Studio's models folder when it is not in a default place.
pub const LMSTUDIO_ENV: &str = "SHOAL_LMSTUDIO_MODELS";
/// The media type of the layer that holds an Ollama model's weights.
pub const OLLAMA_MODEL_LAYER: &str = "application/vnd.ollama.image.model";
/// Manifests larger than this are not Ollama manifests (real ones are about 1 KB).
const MAX_MANIFEST: u64 = 1 << 20;

fn env_dir(k: &str) -> Option<PathBuf> {
    std::env::var_os(k)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// Ollama's store: `$OLLAMA_MODELS`, else `~/.ollama/models`, else (when only it exists) the
/// Linux service's `/usr/share/ollama/.ollama/models`.
pub fn ollama_dir() -> Option<PathBuf> {
    if let Some(p) = env_dir(OLLAMA_ENV) {
        return Some(p);
    }
    let home = env_dir("HOME").map(|h| h.join(".ollama/models"));
    let service = PathBuf::from("/usr/share/ollama/.ollama/models");
    match home {
        Some(h) if h.is_dir() || !service.is_dir() => Some(h),
        _ => Some(service),
    }
}

/// LM Studio's models folders that may hold models: `$SHOAL_LMSTUDIO_MODELS` alone when set,
/// else `~/.lmstudio/models` and `~/.cache/lm-studio/models`.
pub fn lmstudio_dirs() -> Vec<PathBuf> {
    if let Some(p) = env_dir(LMSTUDIO_ENV) {
        return vec![p];
    }
    match env_dir("HOME") {
        Some(h) => vec![
            h.join(".lmstudio/models"),
            h.join(".cache/lm-studio/models"),
        ],
        None => Vec::new(),
    }
}

/// Which store a listed model is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Store {
    Ollama,
    Lmstudio,
    Hf,
}

impl Store {
    /// The name shown in listings.
    pub fn name(self) -> &'static str {
        match self {
            Store::Ollama => "ollama",
            Store::Lmstudio => "lmstudio",
            Store::Hf => "hf",
        }
    }
}

/// A model found in a store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StoredModel {
    pub store: Store,
    /// The MODEL argument that loads it (`ollama:qwen2.5-coder:7b`, ...).
    pub key: String,
    /// The file (a split set's first part, or a Hugging Face model folder).
    pub path: PathBuf,
    /// Bytes on disk (all parts of a set).
    pub size: u64,
    /// Why it cannot be loaded, when it cannot.
    pub problem: Option<String>,
}

fn io_err<'a>(
    action: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> ResolveError + 'a {
    move |source| ResolveError::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

/// A name component of a store path: plain characters, not `.` or `..`.
fn plain(s: &str, extra: &[char]) -> bool {
    !s.is_empty()
        && s != "."
        && s != ".."
        && s.chars().all(|c| {
            c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') || extra.contains(&c)
        })
}

/// An Ollama model name split into its parts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OllamaName {
    /// The registry's folder, when the name gives it (`HOST/NAMESPACE/MODEL`).
    pub host: Option<String>,
    /// `library` unless the name gives one.
    pub namespace: String,
    pub model: String,
    /// `latest` unless the name gives one.
    pub tag: String,
}

impl OllamaName {
    /// Parses `[[HOST/]NAMESPACE/]MODEL[:TAG]` (without the `ollama:` prefix).
    ///
    /// # Errors
    /// When a part is empty or holds characters Ollama names do not.
    pub fn parse(name: &str) -> Result<OllamaName> {
        let bad = |problem: &str| ResolveError::BadStoreName {
            arg: format!("{OLLAMA_PREFIX}{name}"),
            problem: problem.to_string(),
        };
        let (path, tag) = match name.rsplit_once(':') {
            Some((p, t)) if !t.contains('/') => (p, t),
            _ => (name, "latest"),
        };
        let parts: Vec<&str> = path.split('/').collect();
        let (host, namespace, model) = match parts[..] {
            [m] => (None, "library", m),
            [ns, m] => (None, ns, m),
            [h, ns, m] => (Some(h), ns, m),
            _ => return Err(bad("expected [[HOST/]NAMESPACE/]MODEL[:TAG]")),
        };
        if !plain(model, &[]) || !plain(namespace, &[]) || !plain(tag, &[]) {
            return Err(bad(
                "a name, namespace or tag is empty or holds characters other than letters, \
                 digits, `-`, `_` and `.`",
            ));
        }
        if host.is_some_and(|h| !plain(h, &[':'])) {
            return Err(bad(
                "the registry host holds characters a host name does not",
            ));
        }
        Ok(OllamaName {
            host: host.map(str::to_string),
            namespace: namespace.to_string(),
            model: model.to_string(),
            tag: tag.to_string(),
        })
    }

    /// The name as Ollama shows it: `MODEL:TAG` in the `library` namespace, else
    /// `NAMESPACE/MODEL:TAG` (with the host when it was given).
    pub fn display(&self) -> String {
        let short = if self.namespace == "library" {
            format!("{}:{}", self.model, self.tag)
        } else {
            format!("{}/{}:{}", self.namespace, self.model, self.tag)
        };
        match &self.host {
            Some(h) => format!("{h}/{}/{}:{}", self.namespace, self.model, self.tag),
            None => short,
        }
    }

    /// The id a server names it by: `MODEL:TAG`, or `MODEL` for the tag `latest` (which
    /// the APIs take off a requested name, as Ollama's clients add it); no slash, so it fits
    /// in a URL path.
    pub fn id(&self) -> String {
        if self.tag == "latest" {
            self.model.clone()
        } else {
            format!("{}:{}", self.model, self.tag)
        }
    }
}

/// The registry folders under `manifests/`.
fn ollama_hosts(root: &Path) -> Vec<String> {
    let mut hosts: Vec<String> = fs::read_dir(root.join("manifests"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().is_dir())
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .collect();
    hosts.sort();
    hosts
}

/// The GGUF file of Ollama model `name` (`[[HOST/]NAMESPACE/]MODEL[:TAG]`) in the store at
/// `root`.
///
/// # Errors
/// When the store or the model is missing, the name is ambiguous across registries, or the
/// manifest or its model layer is broken.
pub fn ollama_resolve(root: &Path, name: &str) -> Result<PathBuf> {
    let n = OllamaName::parse(name)?;
    if !root.join("manifests").is_dir() {
        return Err(ResolveError::NoStore {
            store: "Ollama",
            dir: root.to_path_buf(),
            hint: format!("set {OLLAMA_ENV} to the folder holding Ollama's manifests/ and blobs/"),
        });
    }
    let hosts = match &n.host {
        Some(h) => vec![h.clone()],
        None => ollama_hosts(root),
    };
    let found: Vec<(String, PathBuf)> = hosts
        .into_iter()
        .map(|h| {
            let p = root
                .join("manifests")
                .join(&h)
                .join(&n.namespace)
                .join(&n.model)
                .join(&n.tag);
            (h, p)
        })
        .filter(|(_, p)| p.is_file())
        .collect();
    match found.len() {
        0 => {
            let held: Vec<String> = ollama_list(root).into_iter().map(|m| m.key).collect();
            Err(ResolveError::NotInStore {
                store: "Ollama",
                name: format!("{OLLAMA_PREFIX}{name}"),
                dir: root.to_path_buf(),
                held: held_list(&held),
                hint: format!("`ollama pull {}` fetches it", n.display()),
            })
        }
        1 => ollama_blob(root, &found[0].1, &n.display()),
        _ => Err(ResolveError::AmbiguousInStore {
            name: format!("{OLLAMA_PREFIX}{name}"),
            matches: found
                .iter()
                .map(|(h, _)| {
                    format!(
                        "{OLLAMA_PREFIX}{}",
                        OllamaName {
                            host: Some(h.clone()),
                            ..n.clone()
                        }
                        .display()
                    )
                })
                .collect::<Vec<_>>()
                .join(", "),
        }),
    }
}

fn held_list(held: &[String]) -> String {
    if held.is_empty() {
        "nothing".to_string()
    } else {
        held.join(", ")
    }
}

/// The model layer's blob named by the manifest at `manifest`, checked to exist, to have the
/// manifest's size and to start as a GGUF file.
fn ollama_blob(root: &Path, manifest: &Path, display: &str) -> Result<PathBuf> {
    let bad = |problem: String| ResolveError::BadStoreEntry {
        path: manifest.to_path_buf(),
        problem,
    };
    let mut text = String::new();
    fs::File::open(manifest)
        .map_err(io_err("opening", manifest))?
        .take(MAX_MANIFEST + 1)
        .read_to_string(&mut text)
        .map_err(|e| bad(format!("not a text manifest ({e})")))?;
    if text.len() as u64 > MAX_MANIFEST {
        return Err(bad(format!(
            "larger than {MAX_MANIFEST} bytes, so not an Ollama manifest"
        )));
    }
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("not JSON ({e})")))?;
    let layers = json["layers"]
        .as_array()
        .ok_or_else(|| bad("no `layers` list".to_string()))?;
    let models: Vec<&serde_json::Value> = layers
        .iter()
        .filter(|l| l["mediaType"] == OLLAMA_MODEL_LAYER)
        .collect();
    let layer = match models[..] {
        [one] => one,
        [] => return Err(bad(format!("no layer of media type {OLLAMA_MODEL_LAYER}"))),
        _ => {
            return Err(bad(format!(
                "{} layers of media type {OLLAMA_MODEL_LAYER}; shoal reads models of one",
                models.len()
            )))
        }
    };
    let digest = layer["digest"]
        .as_str()
        .ok_or_else(|| bad("the model layer has no `digest`".to_string()))?;
    let hex = digest
        .strip_prefix("sha256:")
        .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
        .ok_or_else(|| bad(format!("model layer digest {digest:?} is not sha256:HEX")))?;
    let blobs = root.join("blobs");
    let blob = [format!("sha256-{hex}"), format!("sha256:{hex}")]
        .into_iter()
        .map(|n| blobs.join(n))
        .find(|p| p.is_file())
        .ok_or_else(|| ResolveError::MissingBlob {
            blob: blobs.join(format!("sha256-{hex}")),
            manifest: manifest.to_path_buf(),
            hint: format!("run `ollama pull {display}` to complete it"),
        })?;
    let len = fs::metadata(&blob)
        .map_err(io_err("reading metadata of", &blob))?
        .len();
    if let Some(want) = layer["size"].as_u64() {
        if len != want {
            return Err(ResolveError::BadStoreEntry {
                path: blob,
                problem: format!(
                    "{len} bytes where the manifest says {want} (an interrupted pull?); run \
                     `ollama pull {display}`"
                ),
            });
        }
    }
    let mut magic = [0u8; 4];
    let starts_gguf = fs::File::open(&blob)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && &magic == GGUF_MAGIC;
    if !starts_gguf {
        return Err(ResolveError::BadStoreEntry {
            path: blob,
            problem: "the model layer is not a GGUF file; shoal reads Ollama's GGUF models"
                .to_string(),
        });
    }
    Ok(blob)
}

/// Every model in the Ollama store at `root`, named as [`ollama_resolve`] takes them (with the
/// registry folder only where two registries hold the same name); those that cannot be
/// loaded carry their problem.
pub fn ollama_list(root: &Path) -> Vec<StoredModel> {
    let mut names: Vec<(String, OllamaName, PathBuf)> = Vec::new();
    for host in ollama_hosts(root) {
        let hdir = root.join("manifests").join(&host);
        for ns in sorted_dirs(&hdir) {
            for model in sorted_dirs(&hdir.join(&ns)) {
                let mdir = hdir.join(&ns).join(&model);
                let mut tags: Vec<String> = fs::read_dir(&mdir)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .filter(|e| e.path().is_file())
                    .filter_map(|e| e.file_name().to_str().map(str::to_string))
                    .collect();
                tags.sort();
                for tag in tags {
                    let n = OllamaName {
                        host: None,
                        namespace: ns.clone(),
                        model: model.clone(),
                        tag: tag.clone(),
                    };
                    names.push((host.clone(), n, mdir.join(&tag)));
                }
            }
        }
    }
    let mut out = Vec::new();
    for (host, n, manifest) in &names {
        let short = n.display();
        let twice = names
            .iter()
            .filter(|(_, m, _)| m.display() == short)
            .count()
            > 1;
        let shown = if twice {
            OllamaName {
                host: Some(host.clone()),
                ..n.clone()
            }
            .display()
        } else {
            short
        };
        let (path, size, problem) = match ollama_blob(root, manifest, &shown) {
            Ok(p) => {
                let size = fs::metadata(&p).map(|m| m.len()).unwrap_or(0);
                (p, size, None)
            }
            Err(e) => (manifest.clone(), 0, Some(e.to_string())),
        };
        out.push(StoredModel {
            store: Store::Ollama,
            key: format!("{OLLAMA_PREFIX}{shown}"),
            path,
            size,
            problem,
        });
    }
    out
}

fn sorted_dirs(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().is_dir())
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .collect();
    v.sort();
    v
}

/// One model in an LM Studio folder.
struct LmModel {
    publisher: String,
    repo: String,
    model: GgufModel,
    /// The folder of `PUBLISHER/REPO`.
    dir: PathBuf,
}

impl LmModel {
    fn key(&self) -> String {
        format!("{}/{}/{}", self.publisher, self.repo, self.model.first())
    }

    /// Whether `name` names it: its full name, `PUBLISHER/REPO`, `REPO`, its file name, its
    /// file stem, or its split set's name (ASCII case ignored).
    fn answers_to(&self, name: &str) -> bool {
        let eq = |s: &str| s.eq_ignore_ascii_case(name);
        let first = self.model.first();
        let first = first.as_str();
        eq(&self.key())
            || eq(&format!("{}/{}", self.publisher, self.repo))
            || eq(&self.repo)
            || eq(first)
            || eq(first.strip_suffix(".gguf").unwrap_or(first))
            || eq(&self.model.name())
    }
}

fn lmstudio_models(roots: &[PathBuf]) -> Vec<LmModel> {
    let mut out = Vec::new();
    for root in roots {
        for publisher in sorted_dirs(root) {
            for repo in sorted_dirs(&root.join(&publisher)) {
                let dir = root.join(&publisher).join(&repo);
                let files: Vec<String> = fs::read_dir(&dir)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .filter(|e| e.path().is_file())
                    .filter_map(|e| e.file_name().to_str().map(str::to_string))
                    .collect();
                for model in hub::gguf_models(&files) {
                    out.push(LmModel {
                        publisher: publisher.clone(),
                        repo: repo.clone(),
                        model,
                        dir: dir.clone(),
                    });
                }
            }
        }
    }
    out
}

/// The GGUF file LM Studio model `name` names in the folders `roots` (the first that has
/// it): `PUBLISHER/REPO/FILE.gguf`, or a name that only one model answers to (its file name
/// or stem, its split set's name, `PUBLISHER/REPO` or `REPO`).
///
/// # Errors
/// When no folder exists, nothing or several models answer to the name, or the name is
/// not a plain relative path.
pub fn lmstudio_resolve(roots: &[PathBuf], name: &str) -> Result<PathBuf> {
    let arg = format!("{LMSTUDIO_PREFIX}{name}");
    let rel = Path::new(name);
    if name.is_empty() || !rel.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err(ResolveError::BadStoreName {
            arg,
            problem: "expected PUBLISHER/REPO/FILE.gguf or a model's name, a relative path \
                      without `.` or `..`"
                .to_string(),
        });
    }
    let existing: Vec<PathBuf> = roots.iter().filter(|r| r.is_dir()).cloned().collect();
    if existing.is_empty() {
        return Err(ResolveError::NoStore {
            store: "LM Studio",
            dir: roots.first().cloned().unwrap_or_default(),
            hint: format!("set {LMSTUDIO_ENV} to LM Studio's models folder"),
        });
    }
    if rel.components().count() == 3 {
        if let Some(p) = existing.iter().map(|r| r.join(rel)).find(|p| p.is_file()) {
            return Ok(p);
        }
    }
    let models = lmstudio_models(&existing);
    let hits: Vec<&LmModel> = models.iter().filter(|m| m.answers_to(name)).collect();
    match hits[..] {
        [one] => Ok(one.dir.join(one.model.first())),
        [] => Err(ResolveError::NotInStore {
            store: "LM Studio",
            name: arg,
            dir: existing[0].clone(),
            held: held_list(
                &models
                    .iter()
                    .map(|m| format!("{LMSTUDIO_PREFIX}{}", m.key()))
                    .collect::<Vec<_>>(),
            ),
            hint: "download it in LM Studio, or pass the file's path".to_string(),
        }),
        _ => Err(ResolveError::AmbiguousInStore {
            name: arg,
            matches: hits
                .iter()
                .map(|m| format!("{LMSTUDIO_PREFIX}{}", m.key()))
                .collect::<Vec<_>>()
                .join(", "),
        }),
    }
}

/// Every GGUF model in the LM Studio folders `roots`.
pub fn lmstudio_list(roots: &[PathBuf]) -> Vec<StoredModel> {
    lmstudio_models(roots)
        .into_iter()
        .map(|m| {
            let size = m
                .model
                .files()
                .iter()
                .map(|f| fs::metadata(m.dir.join(f)).map(|x| x.len()).unwrap_or(0))
                .sum();
            let missing = m
                .model
                .files()
                .into_iter()
                .find(|f| !m.dir.join(f).is_file());
            StoredModel {
                store: Store::Lmstudio,
                key: format!("{LMSTUDIO_PREFIX}{}", m.key()),
                path: m.dir.join(m.model.first()),
                size,
                problem: missing.map(|f| format!("split set part {f} is missing")),
            }
        })
        .collect()
}

/// Every model in the Hugging Face cache `cache`: a repo's snapshot (its `refs/main`, else
/// its only one) as a Hugging Face folder, or each GGUF model in it, keyed
/// `hf:org/name:QUANT` when its name carries a quant tag that names it alone, else `org/name`
/// when it is the only one, else by the file's path.
pub fn hf_list(cache: &Path) -> Vec<StoredModel> {
    let mut out = Vec::new();
    for dir in sorted_dirs(cache) {
        let Some(repo) = dir
            .strip_prefix("models--")
            .and_then(|r| r.split_once("--"))
            .map(|(o, n)| format!("{o}/{}", n.replace("--", "/")))
        else {
            continue;
        };
        let Ok(snap) = crate::source::snapshot_of(&cache.join(&dir), None) else {
            continue;
        };
        if snap.join("config.json").exists() {
            out.push(StoredModel {
                store: Store::Hf,
                key: repo.clone(),
                size: dir_size(&snap),
                path: snap,
                problem: None,
            });
            continue;
        }
        let files = hub::relative_files(&snap);
        let models = hub::gguf_models(&files);
        for m in &models {
            let key = match m.quant().filter(|q| hub::pick(&models, Some(q)).is_ok()) {
                Some(q) => format!("hf:{repo}:{q}"),
                None if models.len() == 1 => repo.clone(),
                None => snap.join(m.first()).display().to_string(),
            };
            let size = m
                .files()
                .iter()
                .map(|f| fs::metadata(snap.join(f)).map(|x| x.len()).unwrap_or(0))
                .sum();
            out.push(StoredModel {
                store: Store::Hf,
                key,
                path: snap.join(m.first()),
                size,
                problem: None,
            });
        }
    }
    out
}

fn dir_size(dir: &Path) -> u64 {
    fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| fs::metadata(e.path()).ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum()
}

/// What every store on this machine holds: the Hugging Face cache, Ollama's store and LM
/// Studio's folders, where they are found (the catalog is listed by [`crate::catalog`]).
pub fn list() -> Vec<StoredModel> {
    let mut out = Vec::new();
    if let Some(c) = crate::source::hf_cache_dir() {
        out.extend(hf_list(&c));
    }
    if let Some(o) = ollama_dir() {
        out.extend(ollama_list(&o));
    }
    out.extend(lmstudio_list(&lmstudio_dirs()));
    out
}

/// The SHA-256 a content-addressed store names the file at `path` by, when it is one: an
/// Ollama blob (`blobs/sha256-HEX` or `blobs/sha256:HEX`) or a Hugging Face cache blob
/// (`blobs/HEX`, the target of a snapshot's link), lowercase hex. The stores write a blob
/// under its digest, so a model read from one need not be hashed again to be named.
pub fn blob_sha256(path: &Path) -> Option<String> {
    let path = fs::canonicalize(path).ok()?;
    if path.parent()?.file_name()? != "blobs" {
        return None;
    }
    let name = path.file_name()?.to_str()?;
    let hex = name
        .strip_prefix("sha256-")
        .or_else(|| name.strip_prefix("sha256:"))
        .unwrap_or(name);
    (hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
        .then(|| hex.to_ascii_lowercase())
}

/// The id a server names the model of a store argument by (`ollama:NAME:TAG`: `NAME:TAG`,
/// or `NAME` for the tag `latest`),
/// `None` for an argument that names no Ollama model.
pub fn ollama_id(arg: &str) -> Option<String> {
    let name = arg.strip_prefix(OLLAMA_PREFIX)?;
    OllamaName::parse(name).ok().map(|n| n.id())
}

/// Whether `arg` names a model in a store by prefix (`ollama:`, `lmstudio:`, `hf:`).
pub fn has_store_prefix(arg: &str) -> bool {
    [OLLAMA_PREFIX, LMSTUDIO_PREFIX, hub::HF_PREFIX]
        .iter()
        .any(|p| arg.starts_with(p))
}
