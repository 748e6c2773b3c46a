//! What the CPU backend offers to be measured on its own, outside a model: `shoal bench
//! kernels`, a node's start-up self-test and `shoal doctor` use it. A [`KernelMatrix`] is
//! one weight matrix of synthetic blocks in the kernels' layout, multiplied as a model's
//! would be; a [`ReadProbe`] streams memory the way the decode kernels read weights, for the
//! ceiling their speed is set against; [`Isa`], [`Prefetch`] and [`WeightType`] name the
//! instruction sets, prefetch distances and weight types the kernels have.

use std::time::Instant;

use super::kernels::{reference::synthetic_matrix, stream_checksum, QuantMatrix, WeightBuffer};
pub use super::kernels::{Isa, Prefetch, WeightType};
use crate::EngineError;

/// A weight matrix of synthetic blocks for measuring one kernel (see the module).
#[derive(Debug)]
pub struct KernelMatrix {
    m: QuantMatrix,
}

impl KernelMatrix {
    /// A matrix of type `ty` with `cols` columns and about `mb` megabytes (at least 8
    /// rows), multiplied with instruction set `isa`.
    ///
    /// # Errors
    /// When `cols` is not a whole number of `ty`'s blocks or this CPU cannot run `isa`.
    pub fn synthetic(
        isa: Isa,
        ty: WeightType,
        mb: usize,
        cols: usize,
    ) -> Result<Self, EngineError> {
        if cols == 0 || !cols.is_multiple_of(ty.block_elems()) {
            return Err(EngineError::InvalidInput {
                what: format!(
                    "{cols} columns are not a whole number of {ty:?} blocks ({} values)",
                    ty.block_elems()
                ),
            });
        }
        let blocks = cols / ty.block_elems();
        let row_bytes = blocks * ty.block_bytes();
        let rows = (mb << 20).div_ceil(row_bytes).max(8);
        let data = synthetic_matrix(ty, rows, blocks, 1);
        let m = QuantMatrix::with_isa(isa, ty, rows, cols, data).map_err(|e| {
            EngineError::InvalidInput {
                what: e.to_string(),
            }
        })?;
        Ok(KernelMatrix { m })
    }

    /// Rows (output features).
    pub fn rows(&self) -> usize {
        self.m.rows()
    }

    /// Bytes of weights (what one product streams).
    pub fn bytes(&self) -> usize {
        self.m.bytes()
    }

    /// `y = x W^T` for every row of `x` (rows of the matrix's columns).
    ///
    /// # Errors
    /// When `x` is not a whole number of rows or `y` is not as long as the product.
    pub fn matmul(&self, x: &[f32], y: &mut [f32]) -> Result<(), EngineError> {
        self.m.matmul(x, y).map_err(|e| EngineError::InvalidInput {
            what: e.to_string(),
        })
    }
}

/// A buffer streamed to measure read bandwidth, kept to probe again without filling (and
/// faulting in) a new one. It is a weight buffer, on the transparent huge pages the weights
/// live on: the ceiling is what reading that memory gives (4 KiB pages read less, and set
/// against that, decode would look closer to the ceiling than it is).
pub struct ReadProbe {
    buf: WeightBuffer,
}

impl ReadProbe {
    /// A probe over `bytes` bytes.
    pub fn new(bytes: usize) -> Self {
        let mut buf = WeightBuffer::zeroed(bytes);
        for (i, b) in buf.iter_mut().enumerate() {
            *b = (i * 31 % 251) as u8;
        }
        ReadProbe { buf }
    }

    /// Read bandwidth in GB/s: `threads` threads stream disjoint parts of the buffer the
    /// way the weight kernels do (32-byte loads), best of `passes` passes with the hardware
    /// prefetchers alone and with each pair of software prefetch distances (into L1, into
    /// L2) the kernels use on some CPU ([`Prefetch::KNOWN`]) or were told to use, so the
    /// ceiling is never what one way of reading alone happened to reach (which way reads
    /// fastest differs between CPUs).
    pub fn best_of(&self, threads: usize, passes: usize) -> f64 {
        let chunk = self.buf.len().div_ceil(threads.max(1)).max(1);
        let mut best = 0.0f64;
        let mut ways = vec![(0, 0)];
        for p in Prefetch::KNOWN.into_iter().chain([Prefetch::current()]) {
            ways.extend([(p.block, p.l2), (p.k, p.l2)]);
        }
        ways.sort_unstable();
        ways.dedup();
        for pass in 0..ways.len() * passes {
            let (ahead, l2) = ways[pass % ways.len()];
            let t0 = Instant::now();
            let total = std::thread::scope(|s| {
                let handles: Vec<_> = self
                    .buf
                    .chunks(chunk)
                    .map(|c| s.spawn(move || stream_checksum(c, ahead, l2)))
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap_or(0))
                    .fold(0u64, |a, b| a ^ b)
            });
            std::hint::black_box(total);
            best = best.max(self.buf.len() as f64 / t0.elapsed().as_secs_f64() / 1e9);
        }
        best
    }
}
