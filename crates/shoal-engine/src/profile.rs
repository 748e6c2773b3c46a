//! An opt-in per-operation time profile of the forward pass: each part of a step (matrix
//! products by role, attention, norms, ...) adds its wall time to a global counter while
//! profiling is on. Off, a scope costs one relaxed atomic load. `shoal bench --profile`
//! prints the table.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// The parts of a step the profile tells apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum Op {
    /// Token embedding lookup.
    Embed,
    /// RMS norms.
    Norm,
    /// q, k, v projections.
    Qkv,
    /// RoPE, q/k norms and head reshapes.
    Rope,
    /// Scores, mask, softmax and the weighted sum over the KV cache (and its append).
    Attention,
    /// Attention output projection (and its all-reduce).
    AttnOut,
    /// Gate and up projections.
    GateUp,
    /// Activation and gating product, where gate and up are two matrices (a gate/up pair
    /// applies it inside its product, counted under `GateUp`).
    Activation,
    /// Down projection (and its all-reduce).
    Down,
    /// A mixture of experts' router product and routing.
    Router,
    /// Gathering rows routed to each expert and adding their outputs back.
    Experts,
    /// Residual additions.
    Residual,
    /// Final norm and output head.
    Head,
}

impl Op {
    /// Every op, in table order.
    pub const ALL: [Op; 13] = [
        Op::Embed,
        Op::Norm,
        Op::Qkv,
        Op::Rope,
        Op::Attention,
        Op::AttnOut,
        Op::GateUp,
        Op::Activation,
        Op::Down,
        Op::Router,
        Op::Experts,
        Op::Residual,
        Op::Head,
    ];

    /// Its name in the table.
    pub fn name(self) -> &'static str {
        match self {
            Op::Embed => "embedding",
            Op::Norm => "rms norm",
            Op::Qkv => "q/k/v matmul",
            Op::Rope => "rope + reshapes",
            Op::Attention => "attention",
            Op::AttnOut => "attn out matmul",
            Op::GateUp => "gate/up matmul",
            Op::Activation => "activation",
            Op::Down => "down matmul",
            Op::Router => "router",
            Op::Experts => "expert gather/scatter",
            Op::Residual => "residual",
            Op::Head => "output head",
        }
    }
}

static ENABLED: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; Op::ALL.len()] = [const { AtomicU64::new(0) }; Op::ALL.len()];

/// Turns profiling on or off (counters keep their values).
pub fn enable(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Zeroes the counters.
pub fn reset() {
    for n in &NANOS {
        n.store(0, Ordering::Relaxed);
    }
}

/// Seconds spent in each op since the last reset.
pub fn snapshot() -> Vec<(Op, f64)> {
    Op::ALL
        .iter()
        .map(|&op| (op, NANOS[op as usize].load(Ordering::Relaxed) as f64 * 1e-9))
        .collect()
}

/// Adds the time until it is dropped to `op` (when profiling is on).
pub struct Scope {
    op: Op,
    start: Option<Instant>,
}

/// Starts timing `op`.
#[inline]
pub fn scope(op: Op) -> Scope {
    let start = ENABLED.load(Ordering::Relaxed).then(Instant::now);
    Scope { op, start }
}

impl Drop for Scope {
    fn drop(&mut self) {
        if let Some(s) = self.start {
            NANOS[self.op as usize].fetch_add(s.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
    }
}
