//! Where weight bytes live: [`WeightBuffer`], zeroed memory that asks Linux for transparent
//! huge pages (2 MiB): large buffers in mappings of their own, small ones carved from
//! shared chunks (so a matrix of any size can sit on huge pages). Decode streams every
//! weight once per token, and with 4 KiB pages that is a TLB miss and a page walk every 64
//! cache lines; on 2 MiB pages the walks all but vanish. The request is a hint: where the
//! kernel refuses it (THP off, another OS) the buffer is ordinary anonymous memory and
//! nothing else changes.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};

/// The huge page size the buffer aligns to.
const HUGE_PAGE: usize = 2 << 20;
/// Buffers from this size up get a mapping of their own; smaller ones share arena chunks.
const OWN_MAPPING: usize = 32 << 20;
/// Bytes of one arena chunk.
const CHUNK: usize = 64 << 20;
/// Where buffers start inside a chunk: a cache line.
const ALIGN: usize = 64;

/// A fixed-length, zero-initialized byte buffer, on transparent huge pages where the OS
/// grants them. Buffers below [`OWN_MAPPING`] are carved out of shared 64 MiB chunks, one
/// after the other, so that a model's many small matrices (SmolLM2's are all below 2 MiB,
/// Qwen's attention matrices too) sit on huge pages as well: a matrix in an allocation of
/// its own below 2 MiB would stay on 4 KiB pages and pay their page walks. A chunk is
/// unmapped when the last buffer in it is dropped.
pub struct WeightBuffer {
    storage: Storage,
}

enum Storage {
    /// Empty, or no anonymous mapping could be made.
    Heap(Vec<u8>),
    /// `len` bytes at `start` inside an anonymous mapping one huge page longer, so that
    /// `start` can sit on a huge page boundary.
    Mapped {
        map: memmap2::MmapMut,
        start: usize,
        len: usize,
    },
    /// `len` bytes at `offset` in a shared chunk, which no other buffer overlaps.
    Carved {
        chunk: Arc<Chunk>,
        offset: usize,
        len: usize,
    },
}

/// An arena chunk: [`CHUNK`] bytes from `base`, a huge page boundary inside `map`.
struct Chunk {
    /// Held to unmap the memory when the last buffer goes.
    _map: memmap2::MmapMut,
    base: *mut u8,
}

// SAFETY: the chunk's memory is only reached through the buffers carved from it, each over
// its own range (shared reads through `&WeightBuffer`, writes through `&mut`); the mapping
// itself moves between threads like any `MmapMut`.
unsafe impl Send for Chunk {}
// SAFETY: as above.
unsafe impl Sync for Chunk {}

/// The chunk small buffers are carved from now, and the bytes of it handed out.
static ARENA: Mutex<Option<(Arc<Chunk>, usize)>> = Mutex::new(None);

/// An anonymous mapping with `len` bytes on huge pages from the returned offset (advised
/// `MADV_HUGEPAGE` over that range only, so the slack around it never faults in; a refusal
/// leaves ordinary pages, which are correct too).
fn huge_mapping(len: usize) -> Option<(memmap2::MmapMut, usize)> {
    let map = memmap2::MmapMut::map_anon(len + HUGE_PAGE).ok()?;
    let start = map.as_ptr().align_offset(HUGE_PAGE).min(HUGE_PAGE);
    #[cfg(target_os = "linux")]
    let _ = map.advise_range(memmap2::Advice::HugePage, start, len);
    Some((map, start))
}

/// `len` (below [`OWN_MAPPING`]) fresh zero bytes in the arena; `None` when no chunk could
/// be mapped.
fn carve(len: usize) -> Option<Storage> {
    let mut arena = ARENA.lock().unwrap_or_else(|e| e.into_inner());
    let mut offset = arena
        .as_ref()
        .map_or(CHUNK, |(_, used)| used.next_multiple_of(ALIGN));
    if offset + len > CHUNK {
        let (mut map, start) = huge_mapping(CHUNK)?;
        // SAFETY: `start + CHUNK` is inside the mapping (one huge page longer than CHUNK).
        let base = unsafe { map.as_mut_ptr().add(start) };
        *arena = Some((Arc::new(Chunk { _map: map, base }), 0));
        offset = 0;
    }
    let (chunk, used) = arena.as_mut()?;
    *used = offset + len;
    Some(Storage::Carved {
        chunk: chunk.clone(),
        offset,
        len,
    })
}

impl WeightBuffer {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> Self {
        let storage = if len == 0 {
            None
        } else if len < OWN_MAPPING {
            carve(len)
        } else {
            huge_mapping(len).map(|(map, start)| Storage::Mapped { map, start, len })
        };
        WeightBuffer {
            storage: storage.unwrap_or_else(|| Storage::Heap(vec![0; len])),
        }
    }

    /// A copy of `bytes`.
    pub fn copy_of(bytes: &[u8]) -> Self {
        let mut b = Self::zeroed(bytes.len());
        b.copy_from_slice(bytes);
        b
    }
}

impl Deref for WeightBuffer {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match &self.storage {
            Storage::Heap(v) => v,
            Storage::Mapped { map, start, len } => &map[*start..*start + *len],
            // SAFETY: `offset + len <= CHUNK` bytes from `base` lie inside the mapping the
            // Arc keeps alive, and no buffer but this one reaches them.
            Storage::Carved { chunk, offset, len } => unsafe {
                std::slice::from_raw_parts(chunk.base.add(*offset), *len)
            },
        }
    }
}

impl DerefMut for WeightBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &mut self.storage {
            Storage::Heap(v) => v,
            Storage::Mapped { map, start, len } => &mut map[*start..*start + *len],
            // SAFETY: as in `deref`; `&mut self` makes this the only access to the range.
            Storage::Carved { chunk, offset, len } => unsafe {
                std::slice::from_raw_parts_mut(chunk.base.add(*offset), *len)
            },
        }
    }
}

impl Clone for WeightBuffer {
    fn clone(&self) -> Self {
        Self::copy_of(self)
    }
}

impl std::fmt::Debug for WeightBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WeightBuffer({} bytes)", self.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_zeroed_writable_and_aligned() {
        for len in [
            0,
            1,
            4095,
            HUGE_PAGE - 1,
            HUGE_PAGE,
            OWN_MAPPING,
            OWN_MAPPING + 17,
        ] {
            let mut b = WeightBuffer::zeroed(len);
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&x| x == 0), "{len} bytes zeroed");
            for (i, x) in b.iter_mut().enumerate() {
                *x = (i % 251) as u8;
            }
            assert!(b.iter().enumerate().all(|(i, &x)| x == (i % 251) as u8));
            let align = if len >= OWN_MAPPING { HUGE_PAGE } else { ALIGN };
            if len > 0 {
                assert_eq!(b.as_ptr() as usize % align, 0, "{len} bytes aligned");
            }
        }
        for len in [5, HUGE_PAGE + 5] {
            let src: Vec<u8> = (0..len).map(|i| (i * 7) as u8).collect();
            assert_eq!(&*WeightBuffer::copy_of(&src), &src[..]);
            assert_eq!(&*WeightBuffer::copy_of(&src).clone(), &src[..]);
        }
    }

    #[test]
    fn carved_buffers_never_overlap_and_outlive_their_neighbours() {
        // more than a chunk in all, from several threads, so some start a new chunk
        let lens: Vec<usize> = (0..40).map(|i| (i * 7919 + 1) % (5 << 20) + 1).collect();
        let bufs: Vec<WeightBuffer> = std::thread::scope(|s| {
            let hs: Vec<_> = lens
                .chunks(10)
                .map(|ls| {
                    s.spawn(move || {
                        ls.iter()
                            .map(|&len| WeightBuffer::zeroed(len))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
        });
        let mut bufs: Vec<WeightBuffer> = bufs
            .into_iter()
            .enumerate()
            .map(|(i, mut b)| {
                b.fill(i as u8 + 1);
                b
            })
            .collect();
        for (i, b) in bufs.iter().enumerate() {
            assert!(
                b.iter().all(|&x| x == i as u8 + 1),
                "buffer {i} kept its bytes"
            );
        }
        // dropping every other buffer leaves the rest readable
        let kept: Vec<(usize, WeightBuffer)> = bufs
            .drain(..)
            .enumerate()
            .filter(|(i, _)| i % 2 == 1)
            .collect();
        let fresh = WeightBuffer::zeroed(1 << 20);
        assert!(fresh.iter().all(|&x| x == 0));
        for (i, b) in &kept {
            assert!(
                b.iter().all(|&x| x == *i as u8 + 1),
                "buffer {i} outlived its neighbours"
            );
        }
    }
}
