//! Fetching the part of a model file a rank reads from a node that holds it. The source
//! sends a [`Manifest`] (the SHA-256 of every 4 MiB chunk and each tensor's byte range); the
//! rank fetches the chunks holding the header first, computes from it the byte ranges its
//! share reads exactly as the executor will cut the model, and fetches the chunks of those
//! ranges into a sparse file of the full size (`DATA_DIR/models/SHA.gguf`), checking each
//! against the manifest. The verified chunks are listed beside it (`SHA.chunks`), so an
//! interrupted fetch resumes; a node that ends up with every chunk checks the whole file and
//! offers it like any other.

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

use crate::models::{sha256_file, ModelFile};
use crate::protocol::ControlRequest;
use crate::report::RankState;
use crate::Driver;

/// Bytes per fetched and verified chunk.
pub(crate) const CHUNK: u64 = 4 << 20;

/// The chunk list a source sends before a fetch.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    size: u64,
    chunk: u64,
    /// SHA-256 of each chunk, hex.
    hashes: Vec<String>,
    /// Where the tensor data starts.
    data_offset: u64,
    /// Each tensor's absolute byte range.
    tensors: Vec<(String, u64, u64)>,
}

/// A sparse copy of a model file being fetched chunk by chunk.
struct ChunkFetch {
    /// Chunks written and verified.
    done: BTreeSet<u64>,
    /// The sparse file.
    file: std::fs::File,
    /// Where `done` is kept between attempts.
    done_path: PathBuf,
    /// The node fetched from.
    src: String,
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

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Driver {
    /// Fetches, from node `src`, the chunks of file `sha` that rank `rank` of `inst` reads
    /// into a sparse file of the full size: first the header, from which the rank's share is
    /// computed as the executor cuts it, then the byte ranges of that share
    /// (`shard::file_ranges`: every tensor outside the blocks, the blocks of its stage, and
    /// of the routed experts only its own). Chunks already verified by an earlier attempt
    /// are kept.
    pub(crate) fn fetch_slice(
        &self,
        inst: &Instance,
        src: &str,
        sha: &str,
        rank: usize,
        stop: &AtomicBool,
    ) -> anyhow::Result<PathBuf> {
        let answer = self
            .rt
            .block_on(
                self.node.ask(
                    src,
                    ControlRequest::Manifest {
                        sha256: sha.to_string(),
                    }
                    .to_value(),
                    Duration::from_secs(120),
                ),
            )
            .map_err(anyhow::Error::msg)?;
        let m: Manifest = serde_json::from_value(answer).context("reading the manifest")?;
        if m.chunk != CHUNK || m.hashes.len() as u64 != m.size.div_ceil(CHUNK) {
            bail!("node {src} sent a manifest that does not describe its file");
        }
        let dir = self.cfg.data_dir.join("models");
        std::fs::create_dir_all(&dir)?;
        let path = dir.join(format!("{sha}.gguf"));
        let done_path = dir.join(format!("{sha}.chunks"));
        let mut fetch = ChunkFetch {
            done: std::fs::read_to_string(&done_path)
                .ok()
                .and_then(|t| serde_json::from_str(&t).ok())
                .unwrap_or_default(),
            file: std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .read(true)
                .write(true)
                .open(&path)
                .with_context(|| format!("opening {}", path.display()))?,
            done_path,
            src: src.to_string(),
            sha: sha.to_string(),
        };
        if fetch.file.metadata()?.len() != m.size {
            fetch.file.set_len(m.size)?;
            fetch.done.clear();
        }
        let header: BTreeSet<u64> = (0..m.data_offset.min(m.size).div_ceil(CHUNK).max(1)).collect();
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
                let mut chunks = header.clone();
                for (name, start, len) in &m.tensors {
                    let wanted = match shoal_engine::arch::layer_of(name) {
                        Some(i) => layers.contains(&i),
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
        tracing::info!(
            instance = %inst.id, source = %src, chunks = needed.len(),
            mb = total_bytes as f64 / 1e6, file_mb = m.size as f64 / 1e6,
            "fetching this rank's slice of the model"
        );
        let t0 = Instant::now();
        self.fetch_chunks(inst, &m, &mut fetch, &needed, stop)?;
        tracing::info!(instance = %inst.id, secs = t0.elapsed().as_secs_f64(), "fetched");
        if fetch.done.len() == m.hashes.len() {
            // every chunk is here: check the whole file and offer it like a fetched model
            if sha256_file(&path)? == sha {
                if let Some(profile) = self.profile(&inst.model) {
                    self.add_file(ModelFile {
                        name: inst.model.clone(),
                        sha256: sha.to_string(),
                        size: m.size,
                        profile,
                        path: path.clone(),
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
    /// `path`, as the executor will cut the model.
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
        Ok(shoal_engine::shard::file_ranges(&cfg, src.file(), plan))
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
            let bytes = self
                .rt
                .block_on(self.node.fetch(&fetch.src, &fetch.sha, off, len))
                .map_err(anyhow::Error::msg)?;
            let got = hex(&Sha256::digest(&bytes));
            if got != m.hashes[c as usize] {
                bail!(
                    "chunk {c} from node {} failed its sha256 check (got {got})",
                    fetch.src
                );
            }
            fetch.file.seek(SeekFrom::Start(off))?;
            fetch.file.write_all(&bytes)?;
            fetch.done.insert(c);
            if k % 8 == 7 || k + 1 == todo.len() {
                fetch.file.sync_data()?;
                std::fs::write(&fetch.done_path, serde_json::to_string(&fetch.done)?)?;
                let have = chunks.iter().filter(|c| fetch.done.contains(c)).count();
                self.report(
                    inst,
                    RankState::Loading,
                    Some(format!(
                        "fetched {have}/{} chunks of its slice from node {}",
                        chunks.len(),
                        fetch.src
                    )),
                );
            }
        }
        Ok(())
    }

    /// The chunk list of a file this node shares (computed once).
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
        let m = tokio::task::spawn_blocking(move || -> anyhow::Result<Manifest> {
            let g = GgufFile::open(&file.path)?;
            let h = g.header();
            let tensors = h
                .tensors
                .iter()
                .map(|t| (t.name.clone(), h.data_offset + t.offset, t.size))
                .collect();
            let mut f = std::fs::File::open(&file.path)?;
            let mut hashes = Vec::new();
            let mut buf = vec![0u8; CHUNK as usize];
            let mut left = file.size;
            while left > 0 {
                let n = CHUNK.min(left) as usize;
                f.read_exact(&mut buf[..n])?;
                hashes.push(hex(&Sha256::digest(&buf[..n])));
                left -= n as u64;
            }
            Ok(Manifest {
                size: file.size,
                chunk: CHUNK,
                hashes,
                data_offset: h.data_offset,
                tensors,
            })
        })
        .await??;
        let m = Arc::new(m);
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
