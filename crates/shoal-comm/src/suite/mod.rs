//! The crate's test suite beyond unit tests: every transport under every collective, failure
//! behaviour (dead, silent and misbehaving peers), transport specifics (shared-memory
//! joining, TCP mesh setup, link emulation) and a property test of random sizes. Ranks run
//! as threads of the test process; this file holds the helpers that build worlds and run
//! one closure per rank.

mod collectives;
mod failures;
mod props;
mod transports;

use std::sync::Arc;

use crate::{mem_mesh, shm_mesh_local, tcp_mesh_local, EmulatedLink, LinkSpec, Transport};

/// The transports under test.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Kind {
    Mem,
    Tcp,
    Shm,
    /// In-process links slowed to 20 µs latency and 10 Gbit/s.
    Emulated,
}

pub(crate) const KINDS: [Kind; 4] = [Kind::Mem, Kind::Tcp, Kind::Shm, Kind::Emulated];

/// A world of `n` ranks over `kind`.
pub(crate) fn world(kind: Kind, n: usize) -> Vec<Arc<dyn Transport>> {
    fn arcs<T: Transport + 'static>(v: Vec<T>) -> Vec<Arc<dyn Transport>> {
        v.into_iter()
            .map(|t| Arc::new(t) as Arc<dyn Transport>)
            .collect()
    }
    match kind {
        Kind::Mem => arcs(mem_mesh(n)),
        Kind::Tcp => arcs(tcp_mesh_local(n).expect("loopback mesh")),
        // Small rings so large messages stream through in pieces.
        Kind::Shm => arcs(shm_mesh_local(n, 64 << 10).expect("shm mesh")),
        Kind::Emulated => arcs(
            mem_mesh(n)
                .into_iter()
                .map(|t| EmulatedLink::new(t, LinkSpec::new(20.0, 10.0)))
                .collect(),
        ),
    }
}

/// Runs `f(rank, transport)` on one thread per rank; returns the results in rank order.
pub(crate) fn on_ranks<R: Send>(
    ts: &[Arc<dyn Transport>],
    f: impl Fn(usize, &Arc<dyn Transport>) -> R + Sync,
) -> Vec<R> {
    std::thread::scope(|s| {
        let handles: Vec<_> = ts
            .iter()
            .enumerate()
            .map(|(r, t)| {
                let f = &f;
                s.spawn(move || f(r, t))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}

/// Deterministic inputs of rank `rank` with magnitudes spread so summation order matters.
pub(crate) fn inputs(rank: usize, len: usize, seed: u64) -> Vec<f32> {
    let mut x = seed ^ (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let m = (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            let e = ((x >> 8) % 24) as i32 - 12;
            m * 2f32.powi(e)
        })
        .collect()
}

/// The plain sum `((x0 + x1) + x2) + ...` in the given order.
pub(crate) fn ordered_sum(xs: &[Vec<f32>]) -> Vec<f32> {
    let mut acc = xs[0].clone();
    for x in &xs[1..] {
        for (a, b) in acc.iter_mut().zip(x) {
            *a += *b;
        }
    }
    acc
}

/// Bit patterns, for exact comparison (NaN-safe, -0.0 distinct).
pub(crate) fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}
