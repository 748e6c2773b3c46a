//! The short self-test a node runs at start so the planner knows what it can do: read
//! bandwidth (what decode speed follows) and the batched kernels' throughput (what prefill
//! speed follows), with the node's own thread count. About a second.

use shoal_engine::bench::{Isa, WeightType};

use crate::bench::measure_read_bandwidth_with;
use crate::bench_kernels::{matrix, time_runs};

/// What the self-test measured.
#[derive(Clone, Copy, Debug)]
pub struct SelfTest {
    /// Read bandwidth, GB/s.
    pub mem_bandwidth_gbs: f64,
    /// Q4_0 weights times 32 activation rows, GFLOP/s (two per multiply-add).
    pub compute_gflops: f64,
}

/// Runs the self-test with `threads` threads (the compute pool must already be sized).
///
/// # Errors
/// The test matrix cannot be built (never on a supported CPU).
pub fn run(threads: usize) -> anyhow::Result<SelfTest> {
    // 256 MB is past most caches (not every one: a 2026 server CPU may have 260 MB of
    // L3); best of 3 passes at each prefetch distance.
    let mem_bandwidth_gbs = measure_read_bandwidth_with(threads, 256 << 20, 3);
    const COLS: usize = 2048;
    const BATCH: usize = 32;
    let m = matrix(Isa::detected(), WeightType::Q4_0, 4, COLS)?;
    let x: Vec<f32> = (0..COLS * BATCH)
        .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1)
        .collect();
    let mut y = vec![0f32; m.rows() * BATCH];
    let mut secs = time_runs(5, || Ok(m.matmul(&x, &mut y)?))?;
    secs.sort_by(f64::total_cmp);
    let flops = 2.0 * (m.rows() * COLS * BATCH) as f64;
    Ok(SelfTest {
        mem_bandwidth_gbs,
        compute_gflops: flops / secs[secs.len() / 2] / 1e9,
    })
}
