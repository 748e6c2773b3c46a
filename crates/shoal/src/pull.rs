//! `shoal models pull hf:ORG/REPO[@REVISION][:QUANT]`: downloads a GGUF model from a Hugging
//! Face-style hub into the Hugging Face cache, laid out as the hub's own tools lay it out
//! (`models--ORG--REPO/blobs/SHA256`, `snapshots/COMMIT/FILE` linking to the blob,
//! `refs/REVISION` holding the commit), so that those tools, and `shoal run
//! hf:ORG/REPO:QUANT`, find it. The hub is `--hub URL`, else `$HF_ENDPOINT`; there is no
//! built-in default, so nothing is reached that was not named. `$HF_TOKEN`, when set, is sent
//! as a bearer token (never to a host a redirect leads to).
//!
//! The repository's listing (`/api/models/ORG/REPO/revision/REV?blobs=true`) gives the
//! commit and every file with its LFS sha256 and size; the quant tag picks one GGUF file or
//! a whole split set ([`shoal_model::hub::pick`]). Each file downloads from
//! `/ORG/REPO/resolve/COMMIT/FILE` (following redirects) into `blobs/SHA256.incomplete`; a
//! download cut part way resumes from what is on disk with a `Range` request (an answer whose
//! `Content-Range` starts elsewhere starts the file over), a few times in the same run and
//! again when the command is run again (after a Ctrl-C too). A complete file is hashed whole;
//! one whose sha256 is not the listing's is deleted and refused, and only a verified file is
//! renamed to its blob and linked. Connecting, waiting for an
//! answer and every read time out, so a dead hub is an error, never a hang.

use std::fs::{self, File, OpenOptions};
use std::io::{IsTerminal, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::Value;
use sha2::{Digest, Sha256};
use shoal_model::hub::{gguf_models, pick, HfRef};

/// Environment variable naming the hub's base URL (the hub's own tools read it too).
pub const ENDPOINT_ENV: &str = "HF_ENDPOINT";
/// Environment variable holding an access token for private or gated repositories.
pub const TOKEN_ENV: &str = "HF_TOKEN";
/// Tries per file in one run: the first and the resumptions after a cut.
const TRIES: usize = 4;

/// One file to download, as the listing gives it.
struct Wanted {
    name: String,
    sha256: String,
    size: u64,
}

/// What `pull` did.
pub struct Pulled {
    /// The file to open (a split set's first part), in the snapshot.
    pub path: PathBuf,
    /// The name that loads it.
    pub name: String,
}

/// The hub's base URL: `hub`, else `$HF_ENDPOINT`.
fn endpoint(hub: Option<&str>) -> anyhow::Result<String> {
    let url = match hub {
        Some(h) => h.to_string(),
        None => std::env::var(ENDPOINT_ENV).unwrap_or_default(),
    };
    let url = url.trim().trim_end_matches('/').to_string();
    if url.is_empty() {
        bail!(
            "no hub to pull from: set {ENDPOINT_ENV} to the hub's base URL (or a mirror's), or \
             pass --hub URL; shoal has no default hub"
        );
    }
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        bail!("the hub URL {url:?} is not an http:// or https:// URL");
    }
    Ok(url)
}

/// `s` with every byte outside the URL-safe set and `/` percent-encoded.
fn encode_path(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A plain relative file path of a repository: no empty, `.` or `..` pieces, no leading `/`.
fn plain_file(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with('/')
        && name.len() <= 512
        && name
            .split('/')
            .all(|p| !p.is_empty() && p != "." && p != ".." && !p.contains('\\'))
}

struct Hub {
    agent: ureq::Agent,
    base: String,
    token: Option<String>,
}

impl Hub {
    fn new(base: String) -> Hub {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_connect(Some(Duration::from_secs(30)))
            .timeout_recv_response(Some(Duration::from_secs(60)))
            .timeout_per_read(Some(Duration::from_secs(60)))
            .user_agent(concat!("shoal/", env!("CARGO_PKG_VERSION")))
            .build()
            .into();
        let token = std::env::var(TOKEN_ENV)
            .ok()
            .filter(|t| !t.trim().is_empty());
        Hub { agent, base, token }
    }

    fn get(
        &self,
        url: &str,
        range_from: u64,
    ) -> Result<ureq::http::Response<ureq::Body>, ureq::Error> {
        let mut req = self.agent.get(url);
        if let Some(t) = &self.token {
            req = req.header("Authorization", &format!("Bearer {}", t.trim()));
        }
        if range_from > 0 {
            req = req.header("Range", &format!("bytes={range_from}-"));
        }
        req.call()
    }

    /// The commit `r`'s revision names and the files there.
    fn listing(&self, r: &HfRef) -> anyhow::Result<(String, Vec<Value>)> {
        let url = format!(
            "{}/api/models/{}/revision/{}?blobs=true",
            self.base,
            encode_path(&r.repo),
            encode_path(&r.revision)
        );
        let mut resp = self
            .get(&url, 0)
            .with_context(|| format!("cannot reach the hub at {} ({url})", self.base))?;
        let status = resp.status().as_u16();
        let text = resp
            .body_mut()
            .read_to_string()
            .with_context(|| format!("reading the listing of {} from {url}", r.repo))?;
        match status {
            200 => {}
            401 | 403 | 404 => bail!(
                "the hub at {} has no repository {} at revision {} (answer {status}: {}); check \
                 the name, or for a private or gated repository set {TOKEN_ENV}",
                self.base,
                r.repo,
                r.revision,
                text.chars().take(200).collect::<String>()
            ),
            s => bail!(
                "the hub at {} answered {s} for the listing of {}: {}",
                self.base,
                r.repo,
                text.chars().take(200).collect::<String>()
            ),
        }
        let v: Value = serde_json::from_str(&text)
            .with_context(|| format!("the hub's listing of {} ({url}) is not JSON", r.repo))?;
        let commit = v["sha"]
            .as_str()
            .filter(|c| (7..=64).contains(&c.len()) && c.bytes().all(|b| b.is_ascii_hexdigit()))
            .with_context(|| {
                format!(
                    "the hub's listing of {} ({url}) has no commit hash `sha`",
                    r.repo
                )
            })?
            .to_string();
        let files = v["siblings"]
            .as_array()
            .with_context(|| format!("the hub's listing of {} ({url}) has no `siblings`", r.repo))?
            .clone();
        Ok((commit, files))
    }
}

/// The listing entry of `name`: its LFS sha256 and size.
fn wanted(files: &[Value], name: &str, repo: &str) -> anyhow::Result<Wanted> {
    let f = files
        .iter()
        .find(|f| f["rfilename"] == name)
        .with_context(|| format!("{repo}: {name} is not in the listing"))?;
    let sha256 = f["lfs"]["sha256"]
        .as_str()
        .filter(|s| s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit()))
        .with_context(|| {
            format!(
                "{repo}: the listing gives no LFS sha256 for {name}, so its download could not \
                 be verified; the hub or mirror does not list LFS metadata (`?blobs=true`)"
            )
        })?
        .to_ascii_lowercase();
    let size = f["lfs"]["size"]
        .as_u64()
        .or_else(|| f["size"].as_u64())
        .with_context(|| format!("{repo}: the listing gives no size for {name}"))?;
    Ok(Wanted {
        name: name.to_string(),
        sha256,
        size,
    })
}

/// Progress on stderr: a rewritten line on a terminal, else a line per tenth.
struct Progress {
    name: String,
    total: u64,
    t0: Instant,
    start: u64,
    last: Instant,
    tty: bool,
    tenth: u64,
}

impl Progress {
    fn new(name: &str, total: u64, start: u64) -> Progress {
        Progress {
            name: name.to_string(),
            total,
            t0: Instant::now(),
            start,
            last: Instant::now(),
            tty: std::io::stderr().is_terminal(),
            tenth: start * 10 / total.max(1),
        }
    }

    fn show(&mut self, done: u64, end: bool) {
        let tenth = done * 10 / self.total.max(1);
        let due = if self.tty {
            self.last.elapsed() >= Duration::from_millis(250)
        } else {
            tenth > self.tenth
        };
        if !due && !end {
            return;
        }
        self.last = Instant::now();
        self.tenth = tenth;
        let secs = self.t0.elapsed().as_secs_f64().max(1e-3);
        let line = format!(
            "  {}: {:.1}/{:.1} MB ({:.0}%), {:.1} MB/s",
            self.name,
            done as f64 / 1e6,
            self.total as f64 / 1e6,
            100.0 * done as f64 / self.total.max(1) as f64,
            (done - self.start.min(done)) as f64 / 1e6 / secs
        );
        let mut err = std::io::stderr().lock();
        if self.tty {
            let _ = write!(err, "\r{line}\x1b[K");
            if end {
                let _ = writeln!(err);
            }
        } else {
            let _ = writeln!(err, "{line}");
        }
    }
}

/// Hashes the first `len` bytes of `f`.
fn hash_prefix(f: &mut File, len: u64) -> std::io::Result<Sha256> {
    let mut h = Sha256::new();
    f.seek(SeekFrom::Start(0))?;
    let mut buf = vec![0u8; 1 << 20];
    let mut left = len;
    while left > 0 {
        let want = left.min(buf.len() as u64) as usize;
        let n = f.read(&mut buf[..want])?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        left -= n as u64;
    }
    Ok(h)
}

/// How one attempt at a file ended.
enum Attempt {
    Done,
    /// Cut part way (after the bytes now on disk); worth resuming.
    Cut(String),
}

/// Downloads `w` into `blob` (through `blob.incomplete`), resuming what is there; checks its
/// sha256.
fn download(hub: &Hub, url: &str, w: &Wanted, blob: &Path) -> anyhow::Result<()> {
    let part = blob.with_extension("incomplete");
    let mut tries = 0;
    loop {
        tries += 1;
        match attempt(hub, url, w, &part)? {
            Attempt::Done => break,
            Attempt::Cut(why) => {
                let have = fs::metadata(&part).map(|m| m.len()).unwrap_or(0);
                if tries >= TRIES {
                    bail!(
                        "downloading {} was cut {tries} times ({why}); {:.1} of {:.1} MB are \
                         kept in {}: run the same command again to resume",
                        w.name,
                        have as f64 / 1e6,
                        w.size as f64 / 1e6,
                        part.display()
                    );
                }
                eprintln!(
                    "  {}: cut at {:.1} MB ({why}); resuming",
                    w.name,
                    have as f64 / 1e6
                );
                std::thread::sleep(Duration::from_millis(500 * tries as u64));
            }
        }
    }
    // verify the whole file once it is complete (a resumed file's first bytes may have come
    // in an earlier run)
    let mut f = File::open(&part).with_context(|| format!("opening {}", part.display()))?;
    let got = format!("{:x}", hash_prefix(&mut f, w.size)?.finalize());
    if got != w.sha256 {
        let _ = fs::remove_file(&part);
        bail!(
            "{}: the downloaded file's sha256 is {got}, but the hub lists {}; the download is \
             corrupt or the hub serves another file than it lists, so it was deleted: run the \
             command again, and if it fails the same way, the hub or mirror is at fault",
            w.name,
            w.sha256
        );
    }
    fs::rename(&part, blob)
        .with_context(|| format!("renaming {} to {}", part.display(), blob.display()))?;
    Ok(())
}

/// One request for the rest of `w` after what `part` holds.
fn attempt(hub: &Hub, url: &str, w: &Wanted, part: &Path) -> anyhow::Result<Attempt> {
    let mut f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(part)
        .with_context(|| format!("opening {}", part.display()))?;
    let mut have = f.metadata()?.len();
    if have > w.size {
        f.set_len(0)?;
        have = 0;
    }
    if have == w.size {
        return Ok(Attempt::Done);
    }
    let resp = match hub.get(url, have) {
        Ok(r) => r,
        Err(e) => return Ok(Attempt::Cut(format!("request failed: {e}"))),
    };
    let status = resp.status().as_u16();
    // a partial answer must start where asked, or its bytes would land in the wrong place
    let range_start = resp
        .headers()
        .get("content-range")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("bytes "))
        .and_then(|v| v.split_once('-'))
        .and_then(|(a, _)| a.trim().parse::<u64>().ok());
    let start = match status {
        206 if range_start == Some(have) => have,
        206 => {
            f.set_len(0)?;
            let got = range_start.map_or("no usable Content-Range".to_string(), |b| {
                format!("bytes from {b}")
            });
            return Ok(Attempt::Cut(format!(
                "asked for the bytes from {have}, the hub answered {got}; starting over"
            )));
        }
        200 => 0,
        416 => {
            // past the end: what is here is too long or the hub's file changed; start over
            f.set_len(0)?;
            return Ok(Attempt::Cut("the hub refused the range".to_string()));
        }
        404 => bail!(
            "the hub has no file {} (answer 404 for {url}); the repository lists it, but it is \
             missing for download",
            w.name
        ),
        401 | 403 => bail!(
            "the hub refused {} (answer {status}); for a private or gated repository set \
             {TOKEN_ENV}",
            w.name
        ),
        s if s >= 500 => return Ok(Attempt::Cut(format!("the hub answered {s}"))),
        s => bail!("the hub answered {s} for {url}"),
    };
    if start == 0 {
        f.set_len(0)?;
    }
    f.seek(SeekFrom::Start(start))?;
    let mut reader = resp.into_body().into_reader();
    let mut progress = Progress::new(&w.name, w.size, start);
    let mut done = start;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = match reader.read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                f.sync_data().ok();
                progress.show(done, true);
                return Ok(Attempt::Cut(e.to_string()));
            }
        };
        if n == 0 {
            break;
        }
        if done + n as u64 > w.size {
            f.set_len(0)?;
            bail!(
                "the hub sent more than the {} bytes it lists for {}; deleted what came",
                w.size,
                w.name
            );
        }
        f.write_all(&buf[..n])
            .with_context(|| format!("writing {} (is the disk full?)", part.display()))?;
        done += n as u64;
        progress.show(done, false);
    }
    f.sync_data().ok();
    progress.show(done, true);
    if done < w.size {
        return Ok(Attempt::Cut(format!(
            "the connection ended after {done} of {} bytes",
            w.size
        )));
    }
    Ok(Attempt::Done)
}

/// Points `snapshot/name` at `blob` by a relative link (replacing what was there).
fn link(snapshot: &Path, name: &str, blob: &Path) -> anyhow::Result<()> {
    let at = snapshot.join(name);
    let parent = at.parent().unwrap_or(snapshot);
    fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    // snapshots/COMMIT/[DIR/...]NAME -> ../../[../...]blobs/SHA
    let ups = 2 + name.matches('/').count();
    let target = PathBuf::from("../".repeat(ups))
        .join("blobs")
        .join(blob.file_name().unwrap_or_default());
    match fs::symlink_metadata(&at) {
        Ok(_) => fs::remove_file(&at).with_context(|| format!("replacing {}", at.display()))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("reading {}", at.display())),
    }
    std::os::unix::fs::symlink(&target, &at)
        .with_context(|| format!("linking {} to {}", at.display(), target.display()))
}

/// Pulls `arg` (`hf:ORG/REPO[@REVISION][:QUANT]`) from `hub` (else `$HF_ENDPOINT`) into the
/// Hugging Face cache.
pub fn pull(arg: &str, hub: Option<&str>) -> anyhow::Result<Pulled> {
    let r = HfRef::parse(arg)?;
    let cache = shoal_model::source::hf_cache_dir().context(
        "cannot tell where the Hugging Face cache is: set HF_HUB_CACHE (or HF_HOME, or HOME)",
    )?;
    let hub = Hub::new(endpoint(hub)?);
    let (commit, listing) = hub.listing(&r)?;
    let names: Vec<String> = listing
        .iter()
        .filter_map(|f| f["rfilename"].as_str())
        .filter(|n| plain_file(n))
        .map(str::to_string)
        .collect();
    let models = gguf_models(&names);
    let model = pick(&models, r.quant.as_deref())
        .map_err(|e| anyhow::anyhow!("{} at {} (commit {commit}): {e}", r.repo, hub.base))?;
    let files: Vec<Wanted> = model
        .files()
        .iter()
        .map(|n| wanted(&listing, n, &r.repo))
        .collect::<anyhow::Result<_>>()?;
    let repo_dir = cache.join(r.cache_dir_name());
    let blobs = repo_dir.join("blobs");
    let snapshot = repo_dir.join("snapshots").join(&commit);
    fs::create_dir_all(&blobs).with_context(|| format!("creating {}", blobs.display()))?;
    let total: u64 = files.iter().map(|w| w.size).sum();
    eprintln!(
        "{}: {} file(s), {:.1} MB, from {} (commit {commit})",
        r.display(),
        files.len(),
        total as f64 / 1e6,
        hub.base
    );
    for w in &files {
        let blob = blobs.join(&w.sha256);
        let here = fs::metadata(&blob).map(|m| m.len()).ok();
        if here == Some(w.size) {
            eprintln!("  {}: already in the cache", w.name);
        } else {
            let url = format!(
                "{}/{}/resolve/{commit}/{}",
                hub.base,
                encode_path(&r.repo),
                encode_path(&w.name)
            );
            download(&hub, &url, w, &blob)?;
        }
        link(&snapshot, &w.name, &blob)?;
    }
    if r.revision != commit {
        let refs = repo_dir.join("refs");
        fs::create_dir_all(&refs).with_context(|| format!("creating {}", refs.display()))?;
        fs::write(refs.join(&r.revision), &commit)
            .with_context(|| format!("writing {}", refs.join(&r.revision).display()))?;
    }
    let name = match (&r.quant, model.quant()) {
        (Some(_), _) => r.display(),
        (None, Some(q)) => HfRef {
            quant: Some(q),
            ..r.clone()
        }
        .display(),
        (None, None) => r.display(),
    };
    Ok(Pulled {
        path: snapshot.join(model.first()),
        name,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_encoded_and_checked() {
        assert_eq!(encode_path("org/M v1+x.gguf"), "org/M%20v1%2Bx.gguf");
        assert!(plain_file("Q4/m.gguf"));
        for bad in ["", "/etc/x", "a/../b", "a//b", "./a", "a\\b"] {
            assert!(!plain_file(bad), "{bad}");
        }
    }

    #[test]
    fn the_hub_must_be_named() {
        assert!(endpoint(Some("ftp://x")).is_err());
        assert_eq!(endpoint(Some("http://h:1/")).unwrap(), "http://h:1");
    }
}
