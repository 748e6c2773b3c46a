//! An opt-in per-operation time profile of the forward pass: each part of a step (matrix
//! products by role, attention, norms, ...) adds its wall time to a global counter while
//! profiling is on, apart by where in the step it ran (outside the blocks, a dense block, a
//! mixture-of-experts block). Off, a scope costs one relaxed atomic load. `shoal bench
//! --profile` prints the table; `shoal bench --calibrate` turns the parts into the planner's
//! measured costs.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
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

impl Op {
    /// Whether the op's time is spent reading weights (a matrix product), as opposed to
    /// work of a size that does not depend on the weights.
    pub fn reads_weights(self) -> bool {
        matches!(
            self,
            Op::Qkv | Op::AttnOut | Op::GateUp | Op::Down | Op::Router | Op::Head
        )
    }
}

/// Where in a step an op ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum Part {
    /// Outside the blocks: embedding, final norm and head.
    Outside,
    /// A block with a dense feed-forward.
    DenseLayer,
    /// A block with a mixture of experts.
    MoeLayer,
}

const PARTS: usize = 3;
const OPS: usize = Op::ALL.len();

static ENABLED: AtomicBool = AtomicBool::new(false);
static PART: AtomicUsize = AtomicUsize::new(Part::Outside as usize);
static NANOS: [[AtomicU64; OPS]; PARTS] = [const { [const { AtomicU64::new(0) }; OPS] }; PARTS];

/// Whether profiling is on.
#[inline]
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Counts the ops from here on under `part` (the forward pass calls it around each block).
#[inline]
pub fn enter(part: Part) {
    PART.store(part as usize, Ordering::Relaxed);
}

/// Turns profiling on or off (counters keep their values).
pub fn enable(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Zeroes the counters.
pub fn reset() {
    for n in NANOS.iter().flatten() {
        n.store(0, Ordering::Relaxed);
    }
}

/// Seconds spent in each op since the last reset, wherever it ran.
pub fn snapshot() -> Vec<(Op, f64)> {
    Op::ALL
        .iter()
        .map(|&op| {
            let nanos: u64 = NANOS
                .iter()
                .map(|part| part[op as usize].load(Ordering::Relaxed))
                .sum();
            (op, nanos as f64 * 1e-9)
        })
        .collect()
}

/// Seconds spent in each op in `part` since the last reset.
pub fn snapshot_of(part: Part) -> Vec<(Op, f64)> {
    Op::ALL
        .iter()
        .map(|&op| {
            let nanos = NANOS[part as usize][op as usize].load(Ordering::Relaxed);
            (op, nanos as f64 * 1e-9)
        })
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
            let part = PART.load(Ordering::Relaxed);
            NANOS[part][self.op as usize]
                .fetch_add(s.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
    }
}
