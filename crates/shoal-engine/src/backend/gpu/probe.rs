//! The device's read bandwidth, the ceiling of every decode figure on it: a kernel streams
//! a buffer as large as one binding allows (at most 1 GiB), many passes in one submission
//! so the submission's own cost is spread thin (fewer on a slow device), and the best of a
//! few such runs is kept.
//! And its throughput on prefill's work: the backend's own product of an F16 matrix with a
//! batch of activation rows, timed the same way.

use std::time::Instant;

use shoal_model::gguf::GgmlType;

use super::context::{Bind, GpuContext};
use super::matrix::GpuMatrix;
use super::GpuAct;
use crate::EngineError;

/// The F16 matrix of the throughput probe: `MATRIX x MATRIX` (32 MiB).
const MATRIX: usize = 4096;

/// Activation rows per product of the throughput probe (a prefill chunk's share).
const ROWS: usize = 64;

/// GFLOP/s of the backend's matrix product on `ctx`'s device: the best of `runs` runs of
/// `passes` products of an F16 `MATRIX x MATRIX` matrix with `ROWS` rows.
///
/// # Errors
/// When the device fails.
pub(super) fn matmul_gflops(
    ctx: &GpuContext,
    passes: usize,
    runs: usize,
) -> Result<f64, EngineError> {
    // small values of both signs: no overflow, nothing the hardware shortcuts
    let bytes: Vec<u8> = (0..MATRIX * MATRIX)
        .flat_map(|i| half::f16::from_f32(((i * 7919 % 201) as f32 - 100.0) * 1e-4).to_le_bytes())
        .collect();
    let w = GpuMatrix::from_bytes(ctx, "probe", GgmlType::F16, MATRIX, MATRIX, &bytes)?;
    let x: Vec<f32> = (0..ROWS * MATRIX).map(|i| (i % 13) as f32 * 0.01).collect();
    let x = GpuAct::from_host(ctx, &x);
    let mut y = GpuAct::default();
    let pass = |n: usize, y: &mut GpuAct| -> Result<f64, EngineError> {
        let t0 = Instant::now();
        for _ in 0..n {
            w.matmul(ctx, &x, y)?;
        }
        y.to_host(ctx)?;
        Ok(t0.elapsed().as_secs_f64())
    };
    let flop = 2.0 * (ROWS * MATRIX * MATRIX) as f64;
    best_rate(|n| pass(n, &mut y), flop / 1e9, passes, runs)
}

/// The best rate of `runs` runs of `passes` passes of `work` units each (`pass(n)` times
/// `n` passes), after one warm-up pass (the pipeline and the pages). A slow device (a
/// software one) gets fewer: passes enough for about [`RUN_SECS`] a run, and one run
/// where a pass takes longer than that.
fn best_rate(
    mut pass: impl FnMut(usize) -> Result<f64, EngineError>,
    work: f64,
    passes: usize,
    runs: usize,
) -> Result<f64, EngineError> {
    let first = pass(1)?.max(1e-9);
    let passes = ((RUN_SECS / first) as usize).clamp(1, passes.max(1));
    let runs = if first > RUN_SECS { 1 } else { runs.max(1) };
    let mut best = 0.0f64;
    for _ in 0..runs {
        let secs = pass(passes)?;
        best = best.max(work * passes as f64 / secs);
    }
    Ok(best)
}

/// Seconds a probe's run aims at.
const RUN_SECS: f64 = 0.25;

/// Workgroups of the probe: enough to fill any current GPU.
const GROUPS: u32 = 4096;

/// Read bandwidth of `ctx`'s device, GB/s: the best of `runs` runs of `passes` passes.
///
/// # Errors
/// When the device fails.
pub(super) fn read_bandwidth(
    ctx: &GpuContext,
    passes: usize,
    runs: usize,
) -> Result<f64, EngineError> {
    let limit = ctx
        .limits
        .max_storage_buffer_binding_size
        .min(ctx.limits.max_buffer_size)
        .min(1 << 30);
    let bytes = (limit / 16 * 16) as usize;
    let words = (bytes / 16) as u32;
    let src = ctx.buffer(bytes, "probe");
    ctx.fill_zero(&src, bytes);
    let out = ctx.buffer(GROUPS as usize * 256 * 4, "probe out");
    let pipe = ctx.pipeline("probe", "probe", || {
        include_str!("shaders/probe.wgsl").to_string()
    });
    let pass = |n: usize| -> Result<f64, EngineError> {
        let t0 = Instant::now();
        for _ in 0..n {
            ctx.dispatch(
                &pipe,
                &[words, GROUPS * 256],
                &[Bind::Whole(&src), Bind::Whole(&out)],
                [GROUPS, 1, 1],
            );
        }
        ctx.read(&out, 4)?;
        Ok(t0.elapsed().as_secs_f64())
    };
    best_rate(pass, bytes as f64 / 1e9, passes, runs)
}
