//! Fetching the part of a model file a rank reads from the nodes that hold it. A model is
//! one file or a split set's parts, read as if laid end to end. Each source sends a
//! [`Manifest`] (the SHA-256 of every 4 MiB chunk, each file's size and header, each
//! tensor's byte range), computed in the same pass as the whole file's SHA-256, so a source
//! whose copy no longer matches the model's SHA-256 sends none and stops offering it. The
//! rank fetches the chunks holding the headers first, computes from them the byte ranges
//! its share reads exactly as the executor will cut the model, and fetches the chunks of
//! those ranges into sparse files of the full sizes (`DATA_DIR/models/SHA.gguf`, or
//! `SHA-0000i-of-0000n.gguf` for a set), from the sources in turn, checking each against the
//! manifest: a chunk that fails its check (or does not arrive) is fetched from the next
//! source, and the source that failed is asked for no more. The verified chunks are listed
//! beside them (`SHA.chunks`), so an interrupted fetch resumes; a node that ends up with
//! every chunk checks the whole model and offers it like any other.
//!
//! Before the slice's chunks are fetched, the disk must have room for the ones not yet here
//! (and a margin): a fetch that would not fit fails before it starts, naming what it needs
//! and what is free. A chunk is written only once it passed its check, and listed as done
//! only once written and synced, so a fetch cut by a full disk leaves nothing half-written
//! taken as whole.

use std::collections::BTreeSet;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use shoal_cluster::instances::Instance;
use shoal_cluster::node::MAX_FETCH_BYTES;
use shoal_engine::shard::Layout;
use shoal_model::gguf::GgufFile;

use crate::models::{sha256_parts, ModelFile};
use crate::protocol::ControlRequest;
use crate::report::RankState;
use crate::Driver;

/// Bytes per fetched and verified chunk.
pub(crate) const CHUNK: u64 = 4 << 20;

/// The chunk list a source sends before a fetch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    size: u64,
    chunk: u64,
    /// SHA-256 of each chunk, hex.
    hashes: Vec<String>,
    /// Where the (first) file's tensor data starts.
    data_offset: u64,
    /// Each tensor's absolute byte range.
    tensors: Vec<(String, u64, u64)>,
    /// The size of each file of a split set, in order (empty: one file).
    #[serde(default)]
    parts: Vec<u64>,
    /// Each file's header, as an absolute byte range (empty: the first `data_offset`
    /// bytes).
    #[serde(default)]
    headers: Vec<(u64, u64)>,
}

impl Manifest {
    /// Whether it describes a file at all (what node `src` sent is untrusted).
    fn check(&self, src: &str) -> anyhow::Result<()> {
        let sizes = self.part_sizes();
        if self.chunk != CHUNK
            || self.hashes.len() as u64 != self.size.div_ceil(CHUNK)
            || sizes.iter().sum::<u64>() != self.size
            || sizes.len() > 99_999
            || self
                .header_ranges()
                .iter()
                .any(|r| r.start > r.end || r.end > self.size)
        {
            bail!("node {src} sent a manifest that does not describe its file");
        }
        Ok(())
    }

    /// The sizes of the model's files, in order.
    fn part_sizes(&self) -> Vec<u64> {
        if self.parts.is_empty() {
            vec![self.size]
        } else {
            self.parts.clone()
        }
    }

    /// The byte ranges of the files' headers.
    fn header_ranges(&self) -> Vec<std::ops::Range<u64>> {
        if self.headers.is_empty() {
            std::iter::once(0..self.data_offset).collect()
        } else {
            self.headers.iter().map(|&(a, b)| a..b).collect()
        }
    }
}

/// Sparse copies of a model's files being written, read as if laid end to end.
struct SparseFiles {
    /// Each file, where it starts, and its size.
    files: Vec<(std::fs::File, u64, u64)>,
}

impl SparseFiles {
    /// Opens (creating them where missing) the files at `paths` and makes each its size;
    /// whether any had another size before (its contents are then unknown).
    fn open(paths: &[PathBuf], sizes: &[u64]) -> anyhow::Result<(Self, bool)> {
        let mut files = Vec::with_capacity(paths.len());
        let mut start = 0;
        let mut resized = false;
        for (p, &size) in paths.iter().zip(sizes) {
            let f = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .read(true)
                .write(true)
                .open(p)
                .with_context(|| format!("opening {}", p.display()))?;
            if f.metadata()?.len() != size {
                f.set_len(size)?;
                resized = true;
            }
            files.push((f, start, size));
            start += size;
        }
        Ok((SparseFiles { files }, resized))
    }

    /// Writes `bytes` at absolute offset `at`, across files where they cross.
    fn write_at(&mut self, mut at: u64, mut bytes: &[u8]) -> anyhow::Result<()> {
        for (f, start, size) in &mut self.files {
            if bytes.is_empty() {
                break;
            }
            if at < *start || at >= *start + *size {
                continue;
            }
            let take = ((*start + *size - at) as usize).min(bytes.len());
            f.seek(SeekFrom::Start(at - *start))?;
            f.write_all(&bytes[..take])
                .map_err(|e| match e.raw_os_error() {
                    Some(code) if code == rustix::io::Errno::NOSPC.raw_os_error() => {
                        anyhow::Error::new(NoRoom(format!(
                            "the disk of the data directory filled up while fetching the model \
                             ({e}); free space there or start the node with --data-dir on a \
                             disk with room"
                        )))
                    }
                    _ => anyhow::anyhow!("writing the fetched model: {e}"),
                })?;
            bytes = &bytes[take..];
            at += take as u64;
        }
        anyhow::ensure!(bytes.is_empty(), "bytes past the model's end");
        Ok(())
    }

    fn sync(&self) -> anyhow::Result<()> {
        for (f, _, _) in &self.files {
            f.sync_data()?;
        }
        Ok(())
    }
}

/// Room kept free beyond a fetch's chunks (the chunk list, the filesystem's own needs).
const DISK_MARGIN: u64 = 64 << 20;

/// Bytes this process may still write on the filesystem holding `dir`.
fn free_bytes(dir: &Path) -> anyhow::Result<u64> {
    let s = rustix::fs::statvfs(dir)
        .with_context(|| format!("reading the free space of {}", dir.display()))?;
    Ok(s.f_bavail.saturating_mul(s.f_frsize))
}

/// Whether `needed` more bytes (and [`DISK_MARGIN`]) fit in the `free` bytes of `dir`'s disk;
/// the error says what is needed, what is free and what to do.
fn room_for(needed: u64, free: u64, dir: &Path) -> anyhow::Result<()> {
    if needed.saturating_add(DISK_MARGIN) > free {
        return Err(anyhow::Error::new(NoRoom(format!(
            "fetching this rank's slice of the model needs {:.2} GB more on the disk of {} (and \
             a margin of {} MiB), but only {:.2} GB is free there; free space on that disk or \
             start the node with --data-dir on a disk with room",
            needed as f64 / 1e9,
            dir.display(),
            DISK_MARGIN >> 20,
            free as f64 / 1e9
        ))));
    }
    Ok(())
}

/// A fetch that failed for want of room on this node's disk (before it started, or when the
/// disk filled up during it): the coordinator places the instance without this node.
#[derive(Debug)]
pub(crate) struct NoRoom(String);

impl std::fmt::Display for NoRoom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NoRoom {}

/// Where the sparse copy of model `sha` of `parts` files goes in `dir`.
fn local_paths(dir: &Path, sha: &str, parts: usize) -> Vec<PathBuf> {
    if parts <= 1 {
        return vec![dir.join(format!("{sha}.gguf"))];
    }
    (0..parts)
        .map(|i| dir.join(shoal_model::gguf::set::part_name(sha, i, parts)))
        .collect()
}

/// A sparse copy of a model being fetched chunk by chunk.
struct ChunkFetch {
    /// Chunks written and verified.
    done: BTreeSet<u64>,
    /// The sparse files.
    files: SparseFiles,
    /// Where `done` is kept between attempts.
    done_path: PathBuf,
    /// The nodes fetched from, in turn (one that failed is left out).
    sources: Vec<String>,
    /// The source of the next chunk.
    turn: usize,
    /// The file's SHA-256.
    sha: String,
}

/// The chunks holding `ranges` of a file of `size` bytes.
fn chunks_of(ranges: &[std::ops::Range<u64>], size: u64) -> BTreeSet<u64> {
    let mut chunks = BTreeSet::new();
    for r in ranges {
        let end = r.end.min(size);
        if r.start < end {
            chunks.extend(r.start / CHUNK..end.div_ceil(CHUNK));
        }
    }
    chunks
}

/// How long a source may take to send its manifest (the first one reads its whole file).
const MANIFEST_WAIT: Duration = Duration::from_secs(120);

/// `node a`, or `nodes a, b`.
fn nodes_named(nodes: &[String]) -> String {
    match nodes {
        [one] => format!("node {one}"),
        many => format!("nodes {}", many.join(", ")),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Driver {
    /// Asks every node of `sources` for its manifest of file `sha` at once; returns the
    /// first valid one and the sources that sent it (a source that failed, or sent another,
    /// is left out with a warning).
    fn manifests(&self, sources: &[String], sha: &str) -> anyhow::Result<(Manifest, Vec<String>)> {
        let answers: Vec<(String, Result<serde_json::Value, String>)> = self.rt.block_on(async {
            let mut asked = tokio::task::JoinSet::new();
            for (i, src) in sources.iter().enumerate() {
                let (node, src, sha) = (self.node.clone(), src.clone(), sha.to_string());
                asked.spawn(async move {
                    let req = ControlRequest::Manifest { sha256: sha }.to_value();
                    (i, src.clone(), node.ask(&src, req, MANIFEST_WAIT).await)
                });
            }
            let mut got = Vec::new();
            while let Some(r) = asked.join_next().await {
                if let Ok(answer) = r {
                    got.push(answer);
                }
            }
            // in the order the sources were given
            got.sort_by_key(|(i, _, _)| *i);
            got.into_iter().map(|(_, s, a)| (s, a)).collect()
        });
        let mut chosen: Option<Manifest> = None;
        let mut agreeing = Vec::new();
        let mut last = None;
        for (src, answer) in answers {
            let m = answer.map_err(anyhow::Error::msg).and_then(|a| {
                let m: Manifest = serde_json::from_value(a).context("reading the manifest")?;
                m.check(&src)?;
                Ok(m)
            });
            match (m, &chosen) {
                (Ok(m), None) => {
                    chosen = Some(m);
                    agreeing.push(src);
                }
                (Ok(m), Some(c)) if m == *c => agreeing.push(src),
                (Ok(_), Some(_)) => {
                    tracing::warn!(source = %src, "left out: its manifest of {sha} differs from another node's")
                }
                (Err(e), _) => {
                    tracing::warn!(source = %src, "left out: asking for its manifest of {sha} failed: {e:#}");
                    last = Some(e);
                }
            }
        }
        match chosen {
            Some(m) => Ok((m, agreeing)),
            None => Err(last.unwrap_or_else(|| anyhow::anyhow!("no node to fetch {sha} from"))),
        }
    }

    /// Fetches, from the nodes `sources` that hold file `sha`, the chunks rank `rank` of
    /// `inst` reads into a sparse file of the full size: first the header, from which the
    /// rank's share is computed as the executor cuts it, then the byte ranges of that share
    /// (`shard::file_ranges`: every tensor outside the blocks, the blocks of its stage, and
    /// of the routed experts only its own). The chunks are spread over the sources in turn;
    /// a chunk a source fails to send, or sends failing its checksum, is fetched from the
    /// next source, and that source is asked for no more. Chunks already verified by an
    /// earlier attempt are kept.
    pub(crate) fn fetch_slice(
        &self,
        inst: &Instance,
        sources: &[String],
        sha: &str,
        rank: usize,
        stop: &AtomicBool,
    ) -> anyhow::Result<PathBuf> {
        // `sha` names files here: only the hex of a digest
        if sha.len() != 64 || !sha.bytes().all(|b| b.is_ascii_hexdigit()) {
            bail!("{sha:?} is not a sha256");
        }
        let (m, sources) = self.manifests(sources, sha)?;
        let sizes = m.part_sizes();
        let dir = self.cfg.data_dir.join("models");
        std::fs::create_dir_all(&dir)?;
        let paths = local_paths(&dir, sha, sizes.len());
        let path = paths[0].clone();
        let done_path = dir.join(format!("{sha}.chunks"));
        let (files, resized) = SparseFiles::open(&paths, &sizes)?;
        let mut fetch = ChunkFetch {
            done: std::fs::read_to_string(&done_path)
                .ok()
                .and_then(|t| serde_json::from_str(&t).ok())
                .unwrap_or_default(),
            files,
            done_path,
            sources,
            turn: 0,
            sha: sha.to_string(),
        };
        if resized {
            fetch.done.clear();
        }
        let mut header = chunks_of(&m.header_ranges(), m.size);
        header.insert(0);
        self.fetch_chunks(inst, &m, &mut fetch, &header, stop)?;
        let needed = match self.rank_ranges(inst, rank, &path) {
            Ok(ranges) => chunks_of(&ranges, m.size),
            Err(e) => {
                // the stage's whole blocks hold every byte the rank reads
                tracing::warn!(instance = %inst.id, "fetching the stage's whole blocks: {e:#}");
                let stage = inst.placement.tp.max(1);
                let layers = inst
                    .placement
                    .stages
                    .get(rank / stage)
                    .map(|s| s.layers.clone())
                    .context("the rank is outside the placement")?;
                // the layers after the model's are its prediction layers, which a lead
                // drafting with them holds
                let model_layers = inst.placement.stages.last().map_or(0, |s| s.layers.end);
                let predicts = rank == 0 && self.cfg.mtp;
                let mut chunks = header.clone();
                for (name, start, len) in &m.tensors {
                    let wanted = match shoal_engine::arch::layer_of(name) {
                        Some(i) => layers.contains(&i) || (predicts && i >= model_layers),
                        None => true,
                    };
                    if wanted && *len > 0 {
                        let end = start.saturating_add(*len).min(m.size);
                        chunks.extend(start / CHUNK..end.div_ceil(CHUNK));
                    }
                }
                chunks
            }
        };
        let total_bytes: u64 = needed.iter().map(|&c| CHUNK.min(m.size - c * CHUNK)).sum();
        let missing: u64 = needed
            .iter()
            .filter(|c| !fetch.done.contains(c))
            .map(|&c| CHUNK.min(m.size - c * CHUNK))
            .sum();
        room_for(missing, free_bytes(&dir)?, &dir)?;
        tracing::info!(
            instance = %inst.id, sources = ?fetch.sources, chunks = needed.len(),
            mb = total_bytes as f64 / 1e6, file_mb = m.size as f64 / 1e6,
            "fetching this rank's slice of the model"
        );
        let t0 = Instant::now();
        self.fetch_chunks(inst, &m, &mut fetch, &needed, stop)?;
        tracing::info!(instance = %inst.id, secs = t0.elapsed().as_secs_f64(), "fetched");
        if fetch.done.len() == m.hashes.len() {
            // every chunk is here: check the whole model and offer it like a fetched one
            if sha256_parts(&paths)? == sha {
                if let Some(profile) = self.profile(&inst.model) {
                    self.add_file(ModelFile {
                        name: inst.model.clone(),
                        sha256: sha.to_string(),
                        size: m.size,
                        profile,
                        path: path.clone(),
                        parts: paths.clone(),
                    });
                    self.rt.block_on(self.publish_files());
                    tracing::info!(model = %inst.model, "the whole file is here and verified; offering it");
                }
            } else {
                let _ = std::fs::remove_file(&fetch.done_path);
                bail!("the assembled file does not match sha256 {sha}; its chunks will be fetched again");
            }
        }
        Ok(path)
    }

    /// The byte ranges rank `rank` of `inst` reads, from the header of the (sparse) file at
    /// `path`, as the executor will cut the model, and on a lead that drafts with the
    /// model's prediction layer, that layer's ([`shoal_engine::shard::prediction_ranges`]).
    fn rank_ranges(
        &self,
        inst: &Instance,
        rank: usize,
        path: &Path,
    ) -> anyhow::Result<Vec<std::ops::Range<u64>>> {
        let file = GgufFile::open(path)?;
        let cfg = shoal_engine::arch::config_of_file(&file, &path.display().to_string())?;
        let layout = Layout {
            tp: inst.placement.tp,
            pp: inst.placement.pp(),
        };
        let sizes = inst.placement.stage_sizes();
        let src = shoal_engine::weights::GgufWeights::new(file);
        let plans =
            shoal_engine::shard::plan(&cfg, &src, layout, Some(&sizes), inst.placement.experts)?;
        let plan = plans
            .get(rank)
            .context("the rank is outside the placement")?;
        let mut ranges = shoal_engine::shard::file_ranges(&cfg, src.file(), plan);
        if rank == 0 && self.cfg.mtp && cfg.mtp_layers > 0 {
            // the lead drafts with the prediction layer, which it holds beside its share
            ranges.extend(shoal_engine::shard::prediction_ranges(&cfg, src.file()));
            ranges.sort_by_key(|r| r.start);
        }
        Ok(ranges)
    }

    /// Fetches the chunks of `chunks` not yet done, checking each against the manifest,
    /// and reports progress.
    fn fetch_chunks(
        &self,
        inst: &Instance,
        m: &Manifest,
        fetch: &mut ChunkFetch,
        chunks: &BTreeSet<u64>,
        stop: &AtomicBool,
    ) -> anyhow::Result<()> {
        let todo: Vec<u64> = chunks
            .iter()
            .copied()
            .filter(|c| !fetch.done.contains(c))
            .collect();
        for (k, &c) in todo.iter().enumerate() {
            if stop.load(Ordering::Acquire) {
                bail!("stopped while fetching");
            }
            let off = c * CHUNK;
            let len = CHUNK.min(m.size - off);
            debug_assert!(len <= MAX_FETCH_BYTES);
            let bytes = loop {
                let Some(src) = fetch
                    .sources
                    .get(fetch.turn % fetch.sources.len().max(1))
                    .cloned()
                else {
                    bail!("no node is left to fetch chunk {c} of the model from");
                };
                let got = self
                    .rt
                    .block_on(self.node.fetch(&src, &fetch.sha, off, len))
                    .map_err(anyhow::Error::msg)
                    .and_then(|bytes| {
                        let got = hex(&Sha256::digest(&bytes));
                        anyhow::ensure!(
                            got == m.hashes[c as usize],
                            "chunk {c} from node {src} failed its sha256 check (got {got})"
                        );
                        Ok(bytes)
                    });
                match got {
                    Ok(bytes) => {
                        fetch.turn += 1;
                        break bytes;
                    }
                    Err(e) if fetch.sources.len() > 1 => {
                        fetch.sources.retain(|s| *s != src);
                        tracing::warn!(instance = %inst.id, "{e:#}; fetching it and the rest from {:?}", fetch.sources);
                    }
                    Err(e) => return Err(e),
                }
            };
            fetch.files.write_at(off, &bytes)?;
            fetch.done.insert(c);
            if k % 8 == 7 || k + 1 == todo.len() {
                fetch.files.sync()?;
                std::fs::write(&fetch.done_path, serde_json::to_string(&fetch.done)?)?;
                let have = chunks.iter().filter(|c| fetch.done.contains(c)).count();
                self.report(
                    inst,
                    RankState::Loading,
                    Some(format!(
                        "fetched {have}/{} chunks of its slice from {}",
                        chunks.len(),
                        nodes_named(&fetch.sources)
                    )),
                );
            }
        }
        Ok(())
    }

    /// The chunk list of a file this node shares (computed once, in the same pass as the
    /// file's SHA-256: a file that no longer matches the SHA-256 it is offered under is
    /// offered no more, and the asker is told why).
    pub(crate) async fn manifest(&self, sha: &str) -> anyhow::Result<Arc<Manifest>> {
        if let Some(m) = self.manifests.lock().unwrap().get(sha) {
            return Ok(m.clone());
        }
        let file = self
            .files
            .lock()
            .unwrap()
            .get(sha)
            .cloned()
            .with_context(|| format!("this node does not offer a file with sha256 {sha}"))?;
        let m =
            tokio::task::spawn_blocking(move || -> anyhow::Result<Result<Manifest, ModelFile>> {
                let g = GgufFile::open(&file.path)?;
                let tensors = g
                    .tensors()
                    .iter()
                    .filter_map(|t| {
                        let r = g.tensor_range(&t.name).ok()?;
                        Some((t.name.clone(), r.start, r.end - r.start))
                    })
                    .collect();
                let headers: Vec<(u64, u64)> =
                    g.header_ranges().iter().map(|r| (r.start, r.end)).collect();
                let sizes = g.part_sizes();
                let size: u64 = sizes.iter().sum();
                // chunks of the files laid end to end: a chunk may end in one and go on in the
                // next
                let mut hashes = Vec::new();
                let mut whole = Sha256::new();
                let mut chunk = Sha256::new();
                let mut in_chunk = 0u64;
                let mut buf = vec![0u8; 1 << 20];
                for p in g.part_paths() {
                    let mut f = std::fs::File::open(p)?;
                    loop {
                        let want = ((CHUNK - in_chunk) as usize).min(buf.len());
                        let n = f.read(&mut buf[..want])?;
                        if n == 0 {
                            break;
                        }
                        chunk.update(&buf[..n]);
                        whole.update(&buf[..n]);
                        in_chunk += n as u64;
                        if in_chunk == CHUNK {
                            hashes.push(hex(&std::mem::take(&mut chunk).finalize()));
                            in_chunk = 0;
                        }
                    }
                }
                if in_chunk > 0 {
                    hashes.push(hex(&chunk.finalize()));
                }
                anyhow::ensure!(
                    size == file.size,
                    "the model's files changed since they were offered"
                );
                // the chunks' sums vouch for what is sent only if the file is the one offered
                if hex(&whole.finalize()) != file.sha256 {
                    return Ok(Err(file));
                }
                Ok(Ok(Manifest {
                    size,
                    chunk: CHUNK,
                    hashes,
                    data_offset: headers[0].1,
                    tensors,
                    parts: if sizes.len() > 1 { sizes } else { Vec::new() },
                    headers: if headers.len() > 1 {
                        headers
                    } else {
                        Vec::new()
                    },
                }))
            })
            .await??;
        let m = match m {
            Ok(m) => Arc::new(m),
            Err(file) => {
                // changed on disk, or corrupted by it: no longer the model it was offered as
                self.files.lock().unwrap().remove(sha);
                self.node.unshare_file(sha);
                self.publish_files().await;
                tracing::error!(model = %file.name, path = %file.path.display(), "this node's copy of the model no longer matches its sha256; it stops offering it");
                bail!(
                    "this node's copy of {} ({}) no longer matches its sha256 {sha} (the file \
                     changed, or the disk corrupted it); it stops offering it",
                    file.name,
                    file.path.display()
                );
            }
        };
        self.manifests
            .lock()
            .unwrap()
            .insert(sha.to_string(), m.clone());
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SIZE: u64 = 3 * CHUNK + 10;

    /// The chunks of one range of a file of `SIZE` bytes.
    fn one(r: std::ops::Range<u64>) -> Vec<u64> {
        chunks_of(std::slice::from_ref(&r), SIZE)
            .into_iter()
            .collect()
    }

    #[test]
    fn a_fetch_that_would_not_fit_is_refused_with_both_sizes() {
        let dir = Path::new("/data/shoal/models");
        assert!(room_for(100 << 20, 1 << 30, dir).is_ok());
        let e = room_for(1000 << 20, 1 << 30, dir).unwrap_err().to_string();
        assert!(
            e.contains("1.05 GB more") && e.contains("1.07 GB is free") && e.contains("--data-dir"),
            "{e}"
        );
        // the margin counts
        assert!(room_for((1 << 30) - (32 << 20), 1 << 30, dir).is_err());
        // the real figure of a real directory
        assert!(free_bytes(&std::env::temp_dir()).unwrap() > 0);
    }

    #[test]
    fn the_chunks_of_byte_ranges() {
        // within one chunk, across a boundary, exactly one chunk, the last partial chunk
        assert_eq!(one(0..1), [0]);
        assert_eq!(one(CHUNK - 1..CHUNK + 1), [0, 1]);
        assert_eq!(one(CHUNK..2 * CHUNK), [1]);
        assert_eq!(one(3 * CHUNK + 5..SIZE), [3]);
        // a range past the end is cut at it; an empty one holds nothing
        assert_eq!(one(2 * CHUNK..10 * CHUNK), [2, 3]);
        assert!(one(5..5).is_empty());
        assert!(one(SIZE..SIZE + 9).is_empty());
        // several ranges, overlapping
        let several = chunks_of(&[0..10, 5..CHUNK + 3, 3 * CHUNK..3 * CHUNK + 1], SIZE);
        assert_eq!(several, BTreeSet::from([0, 1, 3]));
    }
}
