//! The device's read bandwidth, the ceiling of every decode figure on it: a kernel streams
//! a buffer as large as one binding allows (at most 1 GiB), many passes in one submission
//! so the submission's own cost is spread thin, and the best of a few such runs is kept.

use std::time::Instant;

use super::context::{Bind, GpuContext};
use crate::EngineError;

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
    pass(1)?; // warm-up: the pipeline and the pages
    let mut best = 0.0f64;
    for _ in 0..runs.max(1) {
        let secs = pass(passes.max(1))?;
        best = best.max((bytes * passes.max(1)) as f64 / secs / 1e9);
    }
    Ok(best)
}
