//! Resolving a user's MODEL argument to files on disk. Wherever shoal takes a MODEL it accepts,
//! in this order: a path to a GGUF file (a `.gguf` name or a file starting with the GGUF
//! magic), a path to a Hugging Face model folder (holding `config.json`, `*.safetensors`,
//! single or sharded with `model.safetensors.index.json`, and `tokenizer.json`), a path to a
//! Hugging Face cache repo folder (`models--org--name`, resolved to the snapshot its
//! `refs/main` names), a Hugging Face repo id `org/name` (optionally `org/name@revision`)
//! found in the local Hugging Face cache, a GGUF model of a cached repo by its quant tag
//! (`hf:org/name[@revision][:QUANT]`, as `shoal models pull` names it; see [`crate::hub`]),
//! a model in Ollama's store (`ollama:NAME[:TAG]`) or LM Studio's folder
//! (`lmstudio:PUBLISHER/REPO/FILE.gguf` or a name; see [`crate::stores`]), or a catalog key
//! fetched with `shoal models fetch KEY`. Nothing here downloads; a model that is not on
//! disk yet is an error saying how to get it.

use std::collections::BTreeSet;
use std::fs;
use std::io::{self, Read};
use std::path::{Component, Path, PathBuf};

use crate::catalog::{self, Catalog, CatalogError};
use crate::hub::{self, BadRef, HfRef, PickError};
use crate::stores::{self, LMSTUDIO_PREFIX, OLLAMA_PREFIX};

/// The first four bytes of every GGUF file.
pub const GGUF_MAGIC: &[u8; 4] = b"GGUF";
/// Index of a sharded safetensors checkpoint.
pub const SAFETENSORS_INDEX: &str = "model.safetensors.index.json";

/// Where a model's weights are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// One GGUF file (weights, hyperparameters and tokenizer in one).
    Gguf(PathBuf),
    /// A Hugging Face model folder: `config.json`, `*.safetensors`, `tokenizer.json`.
    HfFolder(PathBuf),
}

/// Why a MODEL argument could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("empty MODEL argument; {ACCEPTED}")]
    Empty,

    #[error(
        "no file or folder `{arg}`, and it is not a catalog key; {ACCEPTED}; catalog keys: {keys}"
    )]
    NotFound { arg: String, keys: String },

    #[error(
        "`{arg}` is neither an existing path nor a catalog key, and the Hugging Face cache \
         {cache} has no {repo_dir}; copy the repo into that cache (no hub is reached from \
         here), pass its folder path, or use a catalog key: {keys}"
    )]
    HfNotCached {
        arg: String,
        cache: PathBuf,
        repo_dir: String,
        keys: String,
    },

    #[error("model `{key}` is in the catalog but not fetched yet; run: shoal models fetch {key}")]
    NotFetched { key: String },

    #[error(
        "{path} is not a model file: it neither ends in .gguf nor starts with the GGUF magic; \
         pass a GGUF file or a Hugging Face model folder"
    )]
    NotModelFile { path: PathBuf },

    #[error(
        "folder {path} is not a model: it has no config.json (Hugging Face folder) and \
         {gguf_note}; pass a GGUF file or a folder with config.json"
    )]
    NotModelFolder { path: PathBuf, gguf_note: String },

    #[error("folder {path} holds several GGUF files ({files}); pass the one you mean as a path")]
    AmbiguousGguf { path: PathBuf, files: String },

    #[error(
        "Hugging Face cache repo {repo} has no usable snapshot: {problem}; \
         re-download it or pass the snapshot folder as a path"
    )]
    NoSnapshot { repo: PathBuf, problem: String },

    #[error(
        "{path} is a dangling link (its blob is missing: an interrupted download?); \
         re-download the model"
    )]
    DanglingLink { path: PathBuf },

    #[error(
        "Hugging Face folder {path} has no *.safetensors weights (and no {SAFETENSORS_INDEX}); \
         this loader reads safetensors only"
    )]
    NoSafetensors { path: PathBuf },

    #[error("bad {path}: {problem}; the checkpoint index is corrupt, re-download the model")]
    BadIndex { path: PathBuf, problem: String },

    #[error("{index} names shard {shard} which is missing from {dir}; the download is incomplete")]
    MissingShard {
        index: PathBuf,
        shard: String,
        dir: PathBuf,
    },

    #[error("{action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error(transparent)]
    Catalog(#[from] CatalogError),

    #[error("`{arg}` is not a store model name: {problem}")]
    BadStoreName { arg: String, problem: String },

    #[error("no {store} models folder at {dir}; {hint}")]
    NoStore {
        store: &'static str,
        dir: PathBuf,
        hint: String,
    },

    #[error("the {store} models in {dir} include no `{name}` ({hint}); it holds: {held}")]
    NotInStore {
        store: &'static str,
        name: String,
        dir: PathBuf,
        held: String,
        hint: String,
    },

    #[error("`{name}` names several models: {matches}; give one of these")]
    AmbiguousInStore { name: String, matches: String },

    #[error("{path}: {problem}")]
    BadStoreEntry { path: PathBuf, problem: String },

    #[error("{manifest} names blob {blob}, which is missing; {hint}")]
    MissingBlob {
        blob: PathBuf,
        manifest: PathBuf,
        hint: String,
    },

    #[error(transparent)]
    BadHfRef(#[from] BadRef),

    #[error(
        "`{arg}` is not in the Hugging Face cache {cache} (no {repo_dir}); run: shoal models \
         pull {arg}"
    )]
    HfNotPulled {
        arg: String,
        cache: PathBuf,
        repo_dir: String,
    },

    #[error("`{arg}` has no usable snapshot in the Hugging Face cache ({problem}); run: shoal models pull {arg}")]
    HfNoSnapshot { arg: String, problem: String },

    #[error("`{arg}`: the cached snapshot {snapshot} does not give one model: {source}; run: shoal models pull {arg}")]
    HfPick {
        arg: String,
        snapshot: PathBuf,
        #[source]
        source: PickError,
    },
}

const ACCEPTED: &str = "MODEL may be a GGUF file, a Hugging Face model folder (config.json + \
     *.safetensors + tokenizer.json), a Hugging Face cache repo folder (models--org--name), \
     a repo id org/name present in the local Hugging Face cache, hf:org/name:QUANT (pulled \
     with `shoal models pull`), ollama:NAME[:TAG] (Ollama's store), \
     lmstudio:PUBLISHER/REPO/FILE.gguf or lmstudio:NAME (LM Studio's models folder), or a \
     catalog key";

/// Short alias for results of this module.
pub type Result<T> = std::result::Result<T, ResolveError>;

fn io_err<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> ResolveError + 'a {
    move |source| ResolveError::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

impl ModelSource {
    /// The GGUF file or the model folder.
    pub fn path(&self) -> &Path {
        match self {
            ModelSource::Gguf(p) | ModelSource::HfFolder(p) => p,
        }
    }

    /// `config.json` of a Hugging Face folder; `None` for GGUF.
    pub fn config_json(&self) -> Option<PathBuf> {
        match self {
            ModelSource::HfFolder(d) => Some(d.join("config.json")),
            ModelSource::Gguf(_) => None,
        }
    }

    /// `tokenizer.json` of a Hugging Face folder if it exists; `None` for GGUF (whose
    /// tokenizer is in its metadata).
    pub fn tokenizer_json(&self) -> Option<PathBuf> {
        match self {
            ModelSource::HfFolder(d) => Some(d.join("tokenizer.json")).filter(|p| p.is_file()),
            ModelSource::Gguf(_) => None,
        }
    }

    /// The safetensors files of a Hugging Face folder, in a stable order: the shards named by
    /// `model.safetensors.index.json` if present (each checked to exist), else
    /// `model.safetensors`, else every `*.safetensors` in the folder, sorted by name. Empty for
    /// a GGUF source.
    pub fn safetensors_files(&self) -> Result<Vec<PathBuf>> {
        let dir = match self {
            ModelSource::Gguf(_) => return Ok(Vec::new()),
            ModelSource::HfFolder(d) => d,
        };
        let index = dir.join(SAFETENSORS_INDEX);
        if exists_or_dangling(&index)? {
            return shards_from_index(dir, &index);
        }
        let single = dir.join("model.safetensors");
        if exists_or_dangling(&single)? {
            return Ok(vec![single]);
        }
        let mut files = Vec::new();
        for e in fs::read_dir(dir).map_err(io_err("listing", dir))? {
            let e = e.map_err(io_err("listing", dir))?;
            let p = e.path();
            if p.extension().is_some_and(|x| x == "safetensors") && exists_or_dangling(&p)? {
                files.push(p);
            }
        }
        if files.is_empty() {
            return Err(ResolveError::NoSafetensors { path: dir.clone() });
        }
        files.sort();
        Ok(files)
    }
}

/// True if `p` exists (following links); an error if it is a link whose target is missing.
fn exists_or_dangling(p: &Path) -> Result<bool> {
    match fs::metadata(p) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            if fs::symlink_metadata(p).is_ok() {
                Err(ResolveError::DanglingLink {
                    path: p.to_path_buf(),
                })
            } else {
                Ok(false)
            }
        }
        Err(e) => Err(io_err("reading metadata of", p)(e)),
    }
}

fn shards_from_index(dir: &Path, index: &Path) -> Result<Vec<PathBuf>> {
    let bad = |problem: String| ResolveError::BadIndex {
        path: index.to_path_buf(),
        problem,
    };
    let text = fs::read_to_string(index).map_err(io_err("reading", index))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("not JSON ({e})")))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("no `weight_map` object".to_string()))?;
    let mut names = BTreeSet::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(format!("weight_map[{tensor:?}] is not a string")))?;
        let mut comps = Path::new(file).components();
        let plain = matches!(
            (comps.next(), comps.next()),
            (Some(Component::Normal(_)), None)
        );
        if !plain {
            return Err(bad(format!(
                "shard name {file:?} is not a plain file name in the folder"
            )));
        }
        names.insert(file.to_string());
    }
    if names.is_empty() {
        return Err(bad("`weight_map` is empty".to_string()));
    }
    let mut files = Vec::with_capacity(names.len());
    for name in names {
        let p = dir.join(&name);
        if !exists_or_dangling(&p)? {
            return Err(ResolveError::MissingShard {
                index: index.to_path_buf(),
                shard: name,
                dir: dir.to_path_buf(),
            });
        }
        files.push(p);
    }
    Ok(files)
}

/// Where to look besides the file system.
#[derive(Debug, Clone, Default)]
pub struct ResolveContext {
    /// The Hugging Face hub cache (the folder holding `models--org--name`), if known.
    pub hf_cache: Option<PathBuf>,
    /// The model catalog, if a models folder is known.
    pub catalog: Option<Catalog>,
    /// Ollama's store (holding `manifests/` and `blobs/`), if known.
    pub ollama: Option<PathBuf>,
    /// LM Studio's models folders, searched in order.
    pub lmstudio: Vec<PathBuf>,
}

impl ResolveContext {
    /// From the environment: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
    /// `~/.cache/huggingface/hub`; the catalog in [`catalog::models_dir`]; the stores of
    /// [`stores::ollama_dir`] and [`stores::lmstudio_dirs`].
    pub fn from_env() -> ResolveContext {
        ResolveContext {
            hf_cache: hf_cache_dir(),
            catalog: Catalog::open_default().ok(),
            ollama: stores::ollama_dir(),
            lmstudio: stores::lmstudio_dirs(),
        }
    }
}

/// The Hugging Face hub cache folder as the `huggingface_hub` library finds it.
pub fn hf_cache_dir() -> Option<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    if let Some(p) = var("HF_HUB_CACHE") {
        return Some(PathBuf::from(p));
    }
    if let Some(p) = var("HF_HOME") {
        return Some(PathBuf::from(p).join("hub"));
    }
    var("HOME").map(|h| PathBuf::from(h).join(".cache/huggingface/hub"))
}

/// Resolves a MODEL argument using the environment (see the module docs for the order).
pub fn resolve(arg: &str) -> Result<ModelSource> {
    resolve_with(arg, &ResolveContext::from_env())
}

/// [`resolve`] with explicit places to look.
pub fn resolve_with(arg: &str, ctx: &ResolveContext) -> Result<ModelSource> {
    if arg.trim().is_empty() {
        return Err(ResolveError::Empty);
    }
    let path = Path::new(arg);
    if fs::symlink_metadata(path).is_ok() {
        return resolve_path(path);
    }

    if let Some(name) = arg.strip_prefix(OLLAMA_PREFIX) {
        let root = ctx.ollama.as_ref().ok_or_else(|| ResolveError::NoStore {
            store: "Ollama",
            dir: PathBuf::from("~/.ollama/models"),
            hint: format!("set {} to Ollama's models folder", stores::OLLAMA_ENV),
        })?;
        return stores::ollama_resolve(root, name).map(ModelSource::Gguf);
    }
    if let Some(name) = arg.strip_prefix(LMSTUDIO_PREFIX) {
        return stores::lmstudio_resolve(&ctx.lmstudio, name).map(ModelSource::Gguf);
    }
    if arg.starts_with(hub::HF_PREFIX) {
        return resolve_hf_ref(arg, ctx);
    }

    let keys = catalog::keys().join(", ");
    if let Some((repo, revision)) = parse_repo_id(arg) {
        if let Some(cache) = &ctx.hf_cache {
            let repo_dir = format!("models--{}", repo.replace('/', "--"));
            let full = cache.join(&repo_dir);
            if full.is_dir() {
                let snap = snapshot_dir(&full, revision)?;
                return resolve_folder(&snap);
            }
            return Err(ResolveError::HfNotCached {
                arg: arg.to_string(),
                cache: cache.clone(),
                repo_dir,
                keys,
            });
        }
    }

    if catalog::entry(arg).is_some() {
        let cat = match &ctx.catalog {
            Some(c) => c.clone(),
            None => Catalog::open_default()?,
        };
        return match cat.cached_path(arg)? {
            Some(p) => Ok(ModelSource::Gguf(p)),
            None => Err(ResolveError::NotFetched {
                key: arg.to_string(),
            }),
        };
    }

    Err(ResolveError::NotFound {
        arg: arg.to_string(),
        keys,
    })
}

/// `hf:org/name[@revision][:QUANT]` in the Hugging Face cache: the GGUF model the quant tag
/// names in the snapshot (with no tag, its only GGUF model, else the snapshot as a folder).
fn resolve_hf_ref(arg: &str, ctx: &ResolveContext) -> Result<ModelSource> {
    let r = HfRef::parse(arg)?;
    let cache = ctx.hf_cache.clone().unwrap_or_default();
    let repo_dir = cache.join(r.cache_dir_name());
    if !repo_dir.is_dir() {
        return Err(ResolveError::HfNotPulled {
            arg: arg.to_string(),
            cache,
            repo_dir: r.cache_dir_name(),
        });
    }
    let snap =
        snapshot_dir(&repo_dir, Some(&r.revision)).map_err(|e| ResolveError::HfNoSnapshot {
            arg: arg.to_string(),
            problem: e.to_string(),
        })?;
    let files = hub::relative_files(&snap);
    let models = hub::gguf_models(&files);
    if models.is_empty() && r.quant.is_none() {
        return resolve_folder(&snap);
    }
    match hub::pick(&models, r.quant.as_deref()) {
        Ok(m) => Ok(ModelSource::Gguf(snap.join(m.first()))),
        Err(source) => Err(ResolveError::HfPick {
            arg: arg.to_string(),
            snapshot: snap,
            source,
        }),
    }
}

/// The snapshot folder of a Hugging Face cache repo (see [`snapshot_dir`]), for listings.
pub(crate) fn snapshot_of(repo: &Path, revision: Option<&str>) -> Result<PathBuf> {
    snapshot_dir(repo, revision)
}

/// `org/name` or `org/name@revision` with plain name characters.
fn parse_repo_id(arg: &str) -> Option<(&str, Option<&str>)> {
    let (repo, rev) = match arg.split_once('@') {
        Some((r, v)) if !v.is_empty() => (r, Some(v)),
        Some(_) => return None,
        None => (arg, None),
    };
    let (org, name) = repo.split_once('/')?;
    let ok = |s: &str| {
        !s.is_empty()
            && !s.starts_with('.')
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    (ok(org) && ok(name)).then_some((repo, rev))
}

fn resolve_path(path: &Path) -> Result<ModelSource> {
    let meta = match fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(ResolveError::DanglingLink {
                path: path.to_path_buf(),
            })
        }
        Err(e) => return Err(io_err("reading metadata of", path)(e)),
    };
    if meta.is_dir() {
        let is_cache_repo = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("models--"))
            && (path.join("snapshots").is_dir() || path.join("refs").is_dir());
        if is_cache_repo && !path.join("config.json").exists() {
            let snap = snapshot_dir(path, None)?;
            return resolve_folder(&snap);
        }
        return resolve_folder(path);
    }
    if is_gguf_file(path)? {
        return Ok(ModelSource::Gguf(path.to_path_buf()));
    }
    Err(ResolveError::NotModelFile {
        path: path.to_path_buf(),
    })
}

fn is_gguf_file(path: &Path) -> Result<bool> {
    if path
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        return Ok(true);
    }
    let mut f = fs::File::open(path).map_err(io_err("opening", path))?;
    let mut magic = [0u8; 4];
    let mut n = 0;
    while n < 4 {
        match f.read(&mut magic[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_err("reading", path)(e)),
        }
    }
    Ok(n == 4 && &magic == GGUF_MAGIC)
}

/// A folder: Hugging Face layout if it has config.json, else its single GGUF file.
fn resolve_folder(dir: &Path) -> Result<ModelSource> {
    let config = dir.join("config.json");
    if exists_or_dangling(&config)? {
        return Ok(ModelSource::HfFolder(dir.to_path_buf()));
    }
    let mut ggufs = Vec::new();
    for e in fs::read_dir(dir).map_err(io_err("listing", dir))? {
        let e = e.map_err(io_err("listing", dir))?;
        let p = e.path();
        if p.extension()
            .and_then(|x| x.to_str())
            .is_some_and(|x| x.eq_ignore_ascii_case("gguf"))
            && p.is_file()
        {
            ggufs.push(p);
        }
    }
    ggufs.sort();
    // the parts of one split set are one model, given by any of its parts (the loader finds
    // the others, and says which is missing)
    let sets: Vec<Option<(&str, usize)>> = ggufs
        .iter()
        .map(|p| {
            let name = p.file_name()?.to_str()?;
            crate::gguf::set::parse_name(name).map(|(prefix, _, count)| (prefix, count))
        })
        .collect();
    if let Some(Some(first)) = sets.first() {
        if sets.iter().all(|s| s.as_ref() == Some(first)) {
            return Ok(ModelSource::Gguf(ggufs[0].clone()));
        }
    }
    match ggufs.len() {
        1 => Ok(ModelSource::Gguf(ggufs.remove(0))),
        0 => Err(ResolveError::NotModelFolder {
            path: dir.to_path_buf(),
            gguf_note: "no .gguf file".to_string(),
        }),
        _ => Err(ResolveError::AmbiguousGguf {
            path: dir.to_path_buf(),
            files: ggufs
                .iter()
                .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                .collect::<Vec<_>>()
                .join(", "),
        }),
    }
}

/// The snapshot folder of a cache repo: `revision` (a ref name or a commit hash) or `main`;
/// with no `refs/main`, the only snapshot if there is exactly one.
fn snapshot_dir(repo: &Path, revision: Option<&str>) -> Result<PathBuf> {
    let no_snap = |problem: String| ResolveError::NoSnapshot {
        repo: repo.to_path_buf(),
        problem,
    };
    let snapshots = repo.join("snapshots");
    let rev = revision.unwrap_or("main");
    if rev.contains("..") || rev.starts_with('/') {
        return Err(no_snap(format!("bad revision {rev:?}")));
    }
    let ref_file = repo.join("refs").join(rev);
    if ref_file.is_file() {
        let hash = fs::read_to_string(&ref_file).map_err(io_err("reading", &ref_file))?;
        let hash = hash.trim();
        if hash.is_empty() || hash.contains('/') || hash.contains("..") {
            return Err(no_snap(format!(
                "{} holds {hash:?}, not a commit hash",
                ref_file.display()
            )));
        }
        let snap = snapshots.join(hash);
        if snap.is_dir() {
            return Ok(snap);
        }
        return Err(no_snap(format!(
            "{} names commit {hash} but {} is missing",
            ref_file.display(),
            snap.display()
        )));
    }
    if revision.is_some() {
        let snap = snapshots.join(rev);
        if !rev.contains('/') && snap.is_dir() {
            return Ok(snap);
        }
        return Err(no_snap(format!("no ref or snapshot named {rev:?}")));
    }
    let mut snaps = Vec::new();
    if let Ok(rd) = fs::read_dir(&snapshots) {
        for e in rd.flatten() {
            if e.path().is_dir() {
                snaps.push(e.path());
            }
        }
    }
    match snaps.len() {
        1 => Ok(snaps.remove(0)),
        0 => Err(no_snap("no refs/main and no snapshots".to_string())),
        n => Err(no_snap(format!(
            "no refs/main and {n} snapshots; pass org/name@COMMIT"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn ctx(hf: &Path, models: &Path) -> ResolveContext {
        ResolveContext {
            hf_cache: Some(hf.to_path_buf()),
            catalog: Some(Catalog::new(models)),
            ..ResolveContext::default()
        }
    }

    /// A Hugging Face cache repo the way `huggingface_hub` lays it out: blobs named by hash,
    /// a snapshot folder of relative symlinks into blobs, refs/main holding the commit.
    fn hf_repo(cache: &Path, repo: &str, commit: &str, files: &[(&str, &[u8])]) -> PathBuf {
        let dir = cache.join(format!("models--{}", repo.replace('/', "--")));
        let snap = dir.join("snapshots").join(commit);
        fs::create_dir_all(dir.join("blobs")).unwrap();
        fs::create_dir_all(dir.join("refs")).unwrap();
        fs::create_dir_all(&snap).unwrap();
        fs::write(dir.join("refs/main"), commit).unwrap();
        for (k, (name, data)) in files.iter().enumerate() {
            let blob = format!("blob{k:04}");
            fs::write(dir.join("blobs").join(&blob), data).unwrap();
            symlink(format!("../../blobs/{blob}"), snap.join(name)).unwrap();
        }
        dir
    }

    const SHARDED_INDEX: &str = r#"{"metadata": {"total_size": 8},
        "weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                       "b.weight": "model-00002-of-00002.safetensors",
                       "c.weight": "model-00001-of-00002.safetensors"}}"#;

    #[test]
    fn gguf_by_extension_or_magic() {
        let tmp = tempfile::tempdir().unwrap();
        let c = ctx(tmp.path(), tmp.path());
        let a = tmp.path().join("m.GGUF");
        fs::write(&a, b"whatever").unwrap();
        assert_eq!(
            resolve_with(a.to_str().unwrap(), &c).unwrap(),
            ModelSource::Gguf(a.clone())
        );
        let b = tmp.path().join("model.bin");
        fs::write(&b, b"GGUF\x03\0\0\0").unwrap();
        assert_eq!(
            resolve_with(b.to_str().unwrap(), &c).unwrap(),
            ModelSource::Gguf(b.clone())
        );
        let bad = tmp.path().join("notes.txt");
        fs::write(&bad, b"GG").unwrap();
        let err = resolve_with(bad.to_str().unwrap(), &c).unwrap_err();
        assert!(matches!(err, ResolveError::NotModelFile { .. }), "{err}");
        assert!(ModelSource::Gguf(a).safetensors_files().unwrap().is_empty());
    }

    #[test]
    fn hf_folder_single_and_glob() {
        let tmp = tempfile::tempdir().unwrap();
        let c = ctx(tmp.path(), tmp.path());
        let d = tmp.path().join("tiny");
        fs::create_dir(&d).unwrap();
        fs::write(d.join("config.json"), "{}").unwrap();
        fs::write(d.join("tokenizer.json"), "{}").unwrap();
        let src = resolve_with(d.to_str().unwrap(), &c).unwrap();
        assert_eq!(src, ModelSource::HfFolder(d.clone()));
        assert_eq!(src.config_json(), Some(d.join("config.json")));
        assert_eq!(src.tokenizer_json(), Some(d.join("tokenizer.json")));
        let err = src.safetensors_files().unwrap_err();
        assert!(matches!(err, ResolveError::NoSafetensors { .. }), "{err}");

        fs::write(d.join("b.safetensors"), b"x").unwrap();
        fs::write(d.join("a.safetensors"), b"x").unwrap();
        assert_eq!(
            src.safetensors_files().unwrap(),
            [d.join("a.safetensors"), d.join("b.safetensors")]
        );
        fs::write(d.join("model.safetensors"), b"x").unwrap();
        assert_eq!(
            src.safetensors_files().unwrap(),
            [d.join("model.safetensors")]
        );
    }

    #[test]
    fn sharded_index_is_read_deduplicated_and_checked() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        fs::write(d.join("config.json"), "{}").unwrap();
        fs::write(d.join(SAFETENSORS_INDEX), SHARDED_INDEX).unwrap();
        fs::write(d.join("model-00001-of-00002.safetensors"), b"x").unwrap();
        let src = ModelSource::HfFolder(d.to_path_buf());
        let err = src.safetensors_files().unwrap_err();
        assert!(
            matches!(&err, ResolveError::MissingShard { shard, .. } if shard == "model-00002-of-00002.safetensors"),
            "{err}"
        );
        fs::write(d.join("model-00002-of-00002.safetensors"), b"x").unwrap();
        assert_eq!(
            src.safetensors_files().unwrap(),
            [
                d.join("model-00001-of-00002.safetensors"),
                d.join("model-00002-of-00002.safetensors")
            ]
        );
    }

    #[test]
    fn bad_index_json_is_an_error_not_a_panic() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        let src = ModelSource::HfFolder(d.to_path_buf());
        for bad in [
            "{not json",
            "[]",
            r#"{"weight_map": 3}"#,
            r#"{"weight_map": {}}"#,
            r#"{"weight_map": {"a": 1}}"#,
            r#"{"weight_map": {"a": "../../etc/passwd"}}"#,
            r#"{"weight_map": {"a": "/abs.safetensors"}}"#,
            r#"{"weight_map": {"a": "sub/x.safetensors"}}"#,
        ] {
            fs::write(d.join(SAFETENSORS_INDEX), bad).unwrap();
            let err = src.safetensors_files().unwrap_err();
            assert!(matches!(err, ResolveError::BadIndex { .. }), "{bad}: {err}");
        }
    }

    #[test]
    fn hf_cache_repo_by_id_by_folder_and_by_revision() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = tmp.path().join("hub");
        let commit = "0123456789abcdef0123456789abcdef01234567";
        let repo = hf_repo(
            &cache,
            "Org/Tiny-Model",
            commit,
            &[
                ("config.json", b"{}"),
                ("tokenizer.json", b"{}"),
                (SAFETENSORS_INDEX, SHARDED_INDEX.as_bytes()),
                ("model-00001-of-00002.safetensors", b"x"),
                ("model-00002-of-00002.safetensors", b"y"),
            ],
        );
        let snap = repo.join("snapshots").join(commit);
        let c = ctx(&cache, tmp.path());

        let src = resolve_with("Org/Tiny-Model", &c).unwrap();
        assert_eq!(src, ModelSource::HfFolder(snap.clone()));
        let files = src.safetensors_files().unwrap();
        assert_eq!(files.len(), 2);
        assert_eq!(fs::read(&files[1]).unwrap(), b"y"); // through the symlink
        assert!(fs::symlink_metadata(&files[1]).unwrap().is_symlink());

        assert_eq!(resolve_with(repo.to_str().unwrap(), &c).unwrap(), src);
        assert_eq!(
            resolve_with(&format!("Org/Tiny-Model@{commit}"), &c).unwrap(),
            src
        );
        let err = resolve_with("Org/Tiny-Model@v9", &c).unwrap_err();
        assert!(matches!(err, ResolveError::NoSnapshot { .. }), "{err}");

        // refs/main pointing at a missing snapshot.
        fs::write(repo.join("refs/main"), "feedface").unwrap();
        let err = resolve_with("Org/Tiny-Model", &c).unwrap_err();
        assert!(err.to_string().contains("feedface"), "{err}");
        // No refs/main, a single snapshot: use it.
        fs::remove_file(repo.join("refs/main")).unwrap();
        assert_eq!(resolve_with("Org/Tiny-Model", &c).unwrap(), src);
    }

    #[test]
    fn hf_cache_gguf_repo_and_dangling_blob() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = tmp.path().join("hub");
        let repo = hf_repo(
            &cache,
            "org/one-GGUF",
            "c0ffee",
            &[("model-Q4_K_M.gguf", b"GGUF....")],
        );
        let c = ctx(&cache, tmp.path());
        assert_eq!(
            resolve_with("org/one-GGUF", &c).unwrap(),
            ModelSource::Gguf(repo.join("snapshots/c0ffee/model-Q4_K_M.gguf"))
        );

        let repo = hf_repo(
            &cache,
            "org/broken",
            "abc",
            &[("config.json", b"{}"), ("model.safetensors", b"x")],
        );
        fs::remove_file(repo.join("blobs/blob0001")).unwrap();
        let src = resolve_with("org/broken", &c).unwrap();
        let err = src.safetensors_files().unwrap_err();
        assert!(matches!(err, ResolveError::DanglingLink { .. }), "{err}");

        let repo = hf_repo(
            &cache,
            "org/two-GGUF",
            "abc",
            &[("a.gguf", b"GGUF"), ("b.gguf", b"GGUF")],
        );
        let err = resolve_with("org/two-GGUF", &c).unwrap_err();
        assert!(matches!(err, ResolveError::AmbiguousGguf { .. }), "{err}");
        assert!(err.to_string().contains("a.gguf, b.gguf"), "{err}");
        let _ = repo;
    }

    #[test]
    fn unknown_repo_id_and_unknown_name_explain_the_accepted_forms() {
        let tmp = tempfile::tempdir().unwrap();
        let c = ctx(&tmp.path().join("hub"), tmp.path());
        let err = resolve_with("nobody/nothing", &c).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, ResolveError::HfNotCached { .. }), "{msg}");
        assert!(msg.contains("models--nobody--nothing"), "{msg}");
        assert!(msg.contains("qwen05"), "{msg}");

        let err = resolve_with("llama-9000", &c).unwrap_err().to_string();
        assert!(
            err.contains("GGUF file") && err.contains("smollm2"),
            "{err}"
        );
        let err = resolve_with("./missing/file.gguf", &c).unwrap_err();
        assert!(matches!(err, ResolveError::NotFound { .. }), "{err}");
        assert!(matches!(resolve_with("  ", &c), Err(ResolveError::Empty)));

        let empty = tmp.path().join("empty");
        fs::create_dir(&empty).unwrap();
        let err = resolve_with(empty.to_str().unwrap(), &c).unwrap_err();
        assert!(matches!(err, ResolveError::NotModelFolder { .. }), "{err}");
    }

    #[test]
    fn catalog_keys_resolve_only_when_fetched() {
        let tmp = tempfile::tempdir().unwrap();
        let models = tmp.path().join("models");
        let c = ctx(tmp.path(), &models);
        let err = resolve_with("qwen05", &c).unwrap_err();
        assert!(matches!(err, ResolveError::NotFetched { .. }), "{err}");
        assert!(
            err.to_string().contains("run: shoal models fetch qwen05"),
            "{err}"
        );
        // Present but wrong: a clear error, not a GGUF path.
        fs::create_dir_all(&models).unwrap();
        let entry = catalog::entry("qwen05").unwrap();
        fs::write(models.join(entry.file_name), b"junk").unwrap();
        let err = resolve_with("qwen05", &c).unwrap_err().to_string();
        assert!(err.contains("shoal models fetch qwen05"), "{err}");
    }

    #[test]
    fn repo_id_parsing() {
        assert_eq!(parse_repo_id("a/b"), Some(("a/b", None)));
        assert_eq!(parse_repo_id("a/b.c@main"), Some(("a/b.c", Some("main"))));
        assert_eq!(parse_repo_id("a/b/c"), None);
        assert_eq!(parse_repo_id("/b"), None);
        assert_eq!(parse_repo_id("./b"), None);
        assert_eq!(parse_repo_id("a/b@"), None);
        assert_eq!(parse_repo_id("qwen05"), None);
    }
}
