//! shoal's own CPU matrix kernels: a weight matrix kept in its file's quantization
//! ([`QuantMatrix`]) times a batch of f32 activation rows. Activations are quantized once per
//! call to 8 bits ([`formats`]), then every weight row meets every activation row through an
//! integer dot product: one activation row at a time for decode, four at a time for prefill
//! (each weight block decoded once per four tokens; the grid i-quants, whose blocks cost
//! more to decode than to multiply, unpack sixteen (AVX-512 VNNI) or eight (AVX2) rows' blocks
//! to bytes once per batch, `x86_unpacked`). For SIMD the quantized types are repacked at load into
//! tiles of eight interleaved rows (`tiled`), so one instruction serves eight rows. Rows
//! (tiles) are split across the compute pool.
//!
//! The instruction set is chosen at run time ([`Isa`]): AVX-512 VNNI, AVX2, NEON with or
//! without the 8-bit dot product, or portable Rust, so one binary runs at full speed on any
//! x86-64 or arm64 machine without `-C target-cpu=native`. `SHOAL_KERNELS` caps the choice
//! (`portable|avx2|avx512vnni` on x86-64, `portable|neon|neondot` on arm64; for comparisons
//! and tests). `unsafe` lives only in the intrinsics modules (`x86`, `x86_tiled`,
//! `x86_wide`, `x86_unpacked`, `x86_grid`, `neon`, `neon_tiled`), in `buffer`'s chunks shared by several
//! buffers, and in this module's calls into them and its output pointer, each with a
//! `SAFETY` line.

mod buffer;
pub mod formats;
mod gate_pair;
mod iq_grids;
pub mod iquants;
pub mod math;
#[cfg(target_arch = "aarch64")]
mod neon;
#[cfg(target_arch = "aarch64")]
mod neon_tiled;
mod portable;
mod prefetch;
pub mod reference;
mod shares;
pub mod team;
mod tiled;
#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
mod x86_grid;
#[cfg(target_arch = "x86_64")]
mod x86_tiled;
#[cfg(target_arch = "x86_64")]
mod x86_unpacked;
#[cfg(target_arch = "x86_64")]
mod x86_wide;

use std::cell::RefCell;
use std::ops::Range;
use std::sync::OnceLock;

use half::f16;

pub use buffer::WeightBuffer;
pub use formats::{ActFormat, BlockQ8, BlockQ8K, WeightType, QK, QK_K};
pub use gate_pair::GatePair;
pub use prefetch::Prefetch;

/// Quantizes activations `x` (a multiple of 32 long) to [`BlockQ8`], with SIMD where the CPU
/// has it (the result is the same bit for bit).
pub fn quantize_q8(x: &[f32], out: &mut [BlockQ8]) {
    assert_eq!(x.len(), out.len() * QK, "quantize_q8 lengths");
    #[cfg(target_arch = "x86_64")]
    if Isa::detected() >= Isa::Avx2 {
        // SAFETY: AVX2 was detected; the lengths were checked.
        unsafe { x86::quantize_q8(x, out) };
        return;
    }
    formats::quantize_q8(x, out)
}

/// Quantizes activations `x` (a multiple of 256 long) to [`BlockQ8K`], as [`quantize_q8`].
pub fn quantize_q8k(x: &[f32], out: &mut [BlockQ8K]) {
    assert_eq!(x.len(), out.len() * QK_K, "quantize_q8k lengths");
    #[cfg(target_arch = "x86_64")]
    if Isa::detected() >= Isa::Avx2 {
        // SAFETY: AVX2 was detected; the lengths were checked.
        unsafe { x86::quantize_q8k(x, out) };
        return;
    }
    formats::quantize_q8k(x, out)
}

/// Values worth quantizing on several threads (below, one thread: a fork costs more than
/// it saves).
const PARALLEL_QUANTIZE: usize = 8 * 1024;

/// Quantizes activations `x` into blocks `out` with `q`, split across the pool in runs of
/// blocks when there are many values (every block is quantized on its own, so any split on
/// block boundaries gives the same blocks).
fn quantize_rows<B: Send>(x: &[f32], out: &mut [B], q: fn(&[f32], &mut [B])) {
    let per = x.len() / out.len().max(1);
    if x.len() < PARALLEL_QUANTIZE || rayon::current_num_threads() <= 1 {
        q(x, out);
        return;
    }
    use rayon::prelude::*;
    let blocks = (PARALLEL_QUANTIZE / 4 / per).max(1);
    out.par_chunks_mut(blocks)
        .zip(x.par_chunks(blocks * per))
        .for_each(|(o, xs)| q(xs, o));
}

/// An instruction-set level the kernels are compiled for. Levels compare within one
/// architecture (a higher level can run everything a lower one can); [`Isa::levels`] lists
/// this architecture's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Plain Rust, any CPU.
    Portable,
    /// AArch64 Advanced SIMD (every arm64 CPU): 8-bit products widened to 16 bits, and f16
    /// scales converted by `fcvtl`.
    Neon,
    /// AArch64 Advanced SIMD with the 8-bit dot product (`sdot`, Armv8.2 `dotprod`).
    NeonDot,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// x86-64 AVX-512 VL + BW + VNNI (on 256-bit vectors) on top of AVX2.
    Avx512Vnni,
}

impl Isa {
    /// This architecture's levels, lowest first.
    pub fn levels() -> &'static [Isa] {
        if cfg!(target_arch = "x86_64") {
            &[Isa::Portable, Isa::Avx2, Isa::Avx512Vnni]
        } else if cfg!(target_arch = "aarch64") {
            &[Isa::Portable, Isa::Neon, Isa::NeonDot]
        } else {
            &[Isa::Portable]
        }
    }

    /// The best level this CPU supports.
    pub fn detected() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c");
            let vnni = std::arch::is_x86_feature_detected!("avx512vl")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vnni");
            if avx2 && vnni {
                return Isa::Avx512Vnni;
            }
            if avx2 {
                return Isa::Avx2;
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            if std::arch::is_aarch64_feature_detected!("dotprod") {
                return Isa::NeonDot;
            }
            // Advanced SIMD is part of every AArch64 CPU that runs Linux, macOS or Windows.
            if std::arch::is_aarch64_feature_detected!("neon") {
                return Isa::Neon;
            }
        }
        Isa::Portable
    }

    /// Every level this CPU can run, lowest first.
    pub fn available() -> Vec<Isa> {
        let best = Isa::detected();
        Isa::levels()
            .iter()
            .copied()
            .filter(|i| *i <= best)
            .collect()
    }

    /// Whether this CPU can run the level.
    pub fn runs_here(self) -> bool {
        Isa::levels().contains(&self) && self <= Isa::detected()
    }

    /// The name `SHOAL_KERNELS` takes.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Neon => "neon",
            Isa::NeonDot => "neondot",
            Isa::Avx2 => "avx2",
            Isa::Avx512Vnni => "avx512vnni",
        }
    }

    /// The level named `s` (as [`Isa::name`] gives), of any architecture.
    pub fn from_name(s: &str) -> Option<Isa> {
        [
            Isa::Portable,
            Isa::Neon,
            Isa::NeonDot,
            Isa::Avx2,
            Isa::Avx512Vnni,
        ]
        .into_iter()
        .find(|i| i.name() == s.trim())
    }

    /// This architecture's level names, for messages.
    fn names() -> String {
        let names: Vec<&str> = Isa::levels().iter().map(|i| i.name()).collect();
        names.join(", ")
    }
}

/// The level every [`QuantMatrix::matmul`] uses: the detected one, capped by
/// `SHOAL_KERNELS` when that is set.
pub fn active_isa() -> Isa {
    static ACTIVE: OnceLock<Isa> = OnceLock::new();
    *ACTIVE.get_or_init(|| {
        let best = Isa::detected();
        match std::env::var("SHOAL_KERNELS") {
            Err(_) => best,
            Ok(v) => match Isa::from_name(&v) {
                Some(want) if want.runs_here() => want,
                Some(want) => {
                    tracing::warn!(
                        "SHOAL_KERNELS={} is not supported by this CPU; using {}",
                        want.name(),
                        best.name()
                    );
                    best
                }
                None => {
                    tracing::warn!(
                        "SHOAL_KERNELS={v:?} is not one of {}; using {}",
                        Isa::names(),
                        best.name()
                    );
                    best
                }
            },
        }
    })
}

/// A checksum of `buf` that reads every byte the way the weight kernels stream weights,
/// prefetching into L1 `ahead` bytes ahead and into L2 `l2` bytes ahead where the CPU has
/// AVX2 (0: no such request): the read-bandwidth probe (`shoal bench` divides bytes by its
/// time, and takes the best over no prefetch and the distances the kernels use).
pub fn stream_checksum(buf: &[u8], ahead: usize, l2: usize) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if Isa::detected() >= Isa::Avx2 {
        let whole = buf.len() / 128 * 128;
        // SAFETY: AVX2 was detected.
        let head = unsafe { x86::stream_checksum(&buf[..whole], ahead, l2) };
        return buf[whole..].iter().fold(head, |a, &b| a ^ b as u64);
    }
    let _ = (ahead, l2);
    buf.chunks(8).fold(0u64, |a, c| {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        a ^ u64::from_le_bytes(w)
    })
}

/// Lanes of [`argmax`]'s first pass.
const ARGMAX_LANES: usize = 8;

/// Index of the largest value (the first one on ties; NaN never wins; 0 when nothing beats
/// minus infinity), for greedy decoding.
///
/// A first pass keeps eight running maxima, each with the index where it was first reached
/// (AVX2: one compare and two blends per eight logits, in four independent chains, see
/// `x86::lane_maxima`); the lanes and the last few values are then reduced in order. A
/// single running maximum would be a compare-and-branch chain per logit, several times
/// slower over a vocabulary.
pub fn argmax(xs: &[f32]) -> usize {
    // lane indices are u32, as wide as the values; a vocabulary never nears 2^32, and past
    // it the plain loop below takes everything
    let whole = if xs.len() < u32::MAX as usize {
        xs.len() / ARGMAX_LANES * ARGMAX_LANES
    } else {
        0
    };
    let (best, at) = lane_maxima(&xs[..whole]);
    let mut win = 0;
    for k in 1..ARGMAX_LANES {
        if best[k] > best[win] || (best[k] == best[win] && at[k] < at[win]) {
            win = k;
        }
    }
    let (mut best, mut at) = (best[win], at[win] as usize);
    for (i, &x) in xs[whole..].iter().enumerate() {
        if x > best {
            best = x;
            at = whole + i;
        }
    }
    at
}

/// Per lane `k`, the largest of `xs[k]`, `xs[k + 8]`, ... and its first index (minus
/// infinity at 0 when none is larger); `xs.len()` is a multiple of 8 below 2^32.
fn lane_maxima(xs: &[f32]) -> ([f32; ARGMAX_LANES], [u32; ARGMAX_LANES]) {
    #[cfg(target_arch = "x86_64")]
    if active_isa() >= Isa::Avx2 {
        // SAFETY: AVX2 is part of the level; the length is whole vectors.
        return unsafe { x86::lane_maxima(xs) };
    }
    portable_lane_maxima(xs)
}

/// [`lane_maxima`] without SIMD (and the reference for the SIMD one).
fn portable_lane_maxima(xs: &[f32]) -> ([f32; ARGMAX_LANES], [u32; ARGMAX_LANES]) {
    let mut best = [f32::NEG_INFINITY; ARGMAX_LANES];
    let mut at = [0u32; ARGMAX_LANES];
    for (c, chunk) in xs.chunks_exact(ARGMAX_LANES).enumerate() {
        for k in 0..ARGMAX_LANES {
            if chunk[k] > best[k] {
                best[k] = chunk[k];
                at[k] = (c * ARGMAX_LANES + k) as u32;
            }
        }
    }
    (best, at)
}

/// Attention scores: `out[j] = scale * q . rows[j]`, `rows` being `out.len()` rows of
/// `q.len()` f16 keys (the KV cache); SIMD where the CPU has it.
///
/// # Panics
/// When `rows` is too short.
pub fn scores(q: &[f32], rows: &[f16], scale: f32, out: &mut [f32]) {
    assert!(rows.len() >= out.len() * q.len(), "scores: rows too short");
    #[cfg(target_arch = "x86_64")]
    if active_isa() >= Isa::Avx2 {
        // SAFETY: AVX2, FMA and F16C are part of the level; lengths checked.
        unsafe { x86::scores(q, rows, scale, out) };
        return;
    }
    for (j, o) in out.iter_mut().enumerate() {
        let r = &rows[j * q.len()..(j + 1) * q.len()];
        *o = q.iter().zip(r).map(|(a, b)| a * b.to_f32()).sum::<f32>() * scale;
    }
}

/// `out[i] = act(gate[i]) * up[i]` ([`math::gated`]), 8-wide where the CPU has AVX2.
///
/// # Panics
/// When the slices differ in length.
pub fn gated(act: crate::config::Activation, gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(
        gate.len() == out.len() && up.len() == out.len(),
        "gated lengths"
    );
    #[cfg(target_arch = "x86_64")]
    if active_isa() >= Isa::Avx2 {
        // SAFETY: AVX2 and FMA are part of the level.
        unsafe { x86::gated(act, gate, up, out) };
        return;
    }
    math::gated(act, gate, up, out)
}

/// `out = act(gate) * up` over tile pairs: `pairs` holds eight gate values, then the same
/// eight features' up values, and so on (a [`GatePair`]'s product), `out` one value per
/// feature. The same values as [`gated`] over the separated halves.
///
/// # Panics
/// When `pairs` is not twice as long as `out`, or not a whole number of tile pairs.
pub fn gated_pairs(act: crate::config::Activation, pairs: &[f32], out: &mut [f32]) {
    assert!(
        pairs.len() == 2 * out.len() && out.len().is_multiple_of(tiled::TILE_ROWS),
        "gated_pairs lengths: {} values into {}",
        pairs.len(),
        out.len()
    );
    #[cfg(target_arch = "x86_64")]
    if active_isa() >= Isa::Avx2 {
        // SAFETY: AVX2 and FMA are part of the level; the lengths were checked.
        unsafe { x86::gated_pairs(act, pairs, out) };
        return;
    }
    const R: usize = tiled::TILE_ROWS;
    for (p, o) in pairs.chunks_exact(2 * R).zip(out.chunks_exact_mut(R)) {
        math::gated(act, &p[..R], &p[R..], o);
    }
}

/// Asks for the cache lines of `data` to be brought into L2 (x86: `prefetcht1`; nothing on
/// other CPUs), for data that a decode step reads soon after the weight stream pushed it out
/// of every cache: the KV cache of a layer, wanted by its attention once the q/k/v product
/// is done.
pub fn prefetch_l2<T>(data: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        let bytes = std::mem::size_of_val(data);
        let p = data.as_ptr().cast::<i8>();
        for off in (0..bytes).step_by(64) {
            // SAFETY: a prefetch has no effect on the program's state and never faults; the
            // address lies inside `data` anyway.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(p.add(off))
            };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}

/// Softmax in place ([`math::softmax`]), 8-wide where the CPU has AVX2.
pub fn softmax(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if active_isa() >= Isa::Avx2 {
        // SAFETY: AVX2 and FMA are part of the level.
        unsafe { x86::softmax(x) };
        return;
    }
    math::softmax(x)
}

/// Softmax in place with a sink: `sink` joins the softmax as one more logit whose weight
/// is dropped, so the weights of `x` sum to less than one (gpt-oss's attention sinks).
pub fn softmax_with_sink(x: &mut [f32], sink: f32) {
    let max = x.iter().fold(sink, |a, &b| a.max(b));
    let mut sum = math::exp(sink - max);
    for v in x.iter_mut() {
        *v = math::exp(*v - max);
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// Sampling weights ([`math::softmax_weights`]): `out[i] = e^((logits[i] - max) *
/// inv_temp)`, 0 for non-finite logits; returns their sum. 8-wide where the CPU has AVX2.
///
/// # Panics
/// When the slices differ in length.
pub fn softmax_weights(logits: &[f32], max: f32, inv_temp: f32, out: &mut [f32]) -> f32 {
    assert_eq!(logits.len(), out.len(), "softmax_weights lengths");
    #[cfg(target_arch = "x86_64")]
    if active_isa() >= Isa::Avx2 {
        // SAFETY: AVX2 and FMA are part of the level.
        return unsafe { x86::softmax_weights(logits, max, inv_temp, out) };
    }
    math::softmax_weights(logits, max, inv_temp, out)
}

/// `dst[i] = src[i]` rounded to the nearest f16 (what the KV cache stores); F16C where the
/// CPU has it, bit for bit the same as `half::f16::from_f32`.
///
/// # Panics
/// When the slices differ in length.
pub fn to_f16(src: &[f32], dst: &mut [f16]) {
    assert_eq!(src.len(), dst.len(), "to_f16 lengths");
    #[cfg(target_arch = "x86_64")]
    if active_isa() >= Isa::Avx2 {
        // SAFETY: AVX2 and F16C are part of the level; lengths checked.
        unsafe { x86::to_f16(src, dst) };
        return;
    }
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = f16::from_f32(s);
    }
}

/// `out += sum over j of w[j] * rows[j]`, `rows` being `w.len()` rows of `out.len()` f16
/// values (the KV cache), added in row order (so summing the rows in consecutive blocks
/// gives the same bits as one call); SIMD where the CPU has it.
///
/// # Panics
/// When `rows` is too short.
pub fn weighted_sum(w: &[f32], rows: &[f16], out: &mut [f32]) {
    assert!(
        rows.len() >= w.len() * out.len(),
        "weighted_sum: rows too short"
    );
    #[cfg(target_arch = "x86_64")]
    if active_isa() >= Isa::Avx2 {
        // SAFETY: AVX2, FMA and F16C are part of the level; lengths checked.
        unsafe { x86::weighted_sum(w, rows, out) };
        return;
    }
    let hd = out.len();
    for (j, &wj) in w.iter().enumerate() {
        for (o, v) in out.iter_mut().zip(&rows[j * hd..(j + 1) * hd]) {
            *o += wj * v.to_f32();
        }
    }
}

/// A shape or instruction-set mistake in a kernel call.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// The bytes do not make the claimed matrix.
    #[error("{ty:?} matrix {rows}x{cols}: {problem}")]
    Matrix {
        /// Element type.
        ty: WeightType,
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
        /// What is wrong.
        problem: String,
    },
    /// Input or output lengths that do not fit the matrix.
    #[error("matmul with a {rows}x{cols} matrix: {problem}")]
    Shape {
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
        /// What is wrong.
        problem: String,
    },
    /// A level this CPU cannot run.
    #[error("this CPU cannot run the {0:?} kernels")]
    Isa(Isa),
}

/// A `rows x cols` weight matrix in its storage type, laid out for the instruction-set level
/// it was built for: rows contiguous (the file's layout), or tiles of eight interleaved rows
/// ([`tiled`]) for the SIMD kernels of the 32-value block types.
#[derive(Clone)]
pub struct QuantMatrix {
    ty: WeightType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    isa: Isa,
    tiled: bool,
    data: WeightBuffer,
}

impl std::fmt::Debug for QuantMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "QuantMatrix({:?}, {}x{})", self.ty, self.rows, self.cols)
    }
}

type Kern<A, const N: usize> = unsafe fn(&[u8], [&[A]; N]) -> [f32; N];

/// The one- and four-row kernels of one weight type at one level.
struct KernPair<A: 'static> {
    one: Kern<A, 1>,
    four: Kern<A, 4>,
    /// Where the type has one, a kernel over sixteen activation rows: for types whose blocks
    /// cost more to read than to multiply (the grid i-quants), each block is read once per
    /// sixteen rows.
    sixteen: Option<Kern<A, 16>>,
}

macro_rules! pick {
    ($isa:expr, $f:ident) => {
        match $isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => KernPair {
                one: x86::avx512vnni::$f::<1>,
                four: x86::avx512vnni::$f::<4>,
                sixteen: None,
            },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => KernPair {
                one: x86::avx2::$f::<1>,
                four: x86::avx2::$f::<4>,
                sixteen: None,
            },
            _ => portable!($f),
        }
    };
}

/// As [`pick!`] (on arm64 too), with the level's sixteen-row kernel: the grid i-quants, whose
/// x86 kernels live in `x86_grid`.
macro_rules! pick_sixteen {
    ($isa:expr, $f:ident) => {
        match $isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => KernPair {
                one: x86_grid::avx512vnni::$f::<1>,
                four: x86_grid::avx512vnni::$f::<4>,
                sixteen: Some(x86_grid::avx512vnni::$f::<16>),
            },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => KernPair {
                one: x86_grid::avx2::$f::<1>,
                four: x86_grid::avx2::$f::<4>,
                sixteen: Some(x86_grid::avx2::$f::<16>),
            },
            #[cfg(target_arch = "aarch64")]
            Isa::NeonDot => KernPair {
                one: neon::neondot::$f::<1>,
                four: neon::neondot::$f::<4>,
                sixteen: Some(neon::neondot::$f::<16>),
            },
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => KernPair {
                one: neon::neon::$f::<1>,
                four: neon::neon::$f::<4>,
                sixteen: Some(neon::neon::$f::<16>),
            },
            _ => portable!($f),
        }
    };
}

macro_rules! portable {
    ($f:ident) => {
        KernPair {
            one: portable::$f::<1>,
            four: portable::$f::<4>,
            sixteen: None,
        }
    };
}

type TileKern<A, const N: usize> = unsafe fn(&[u8], [&[A]; N]) -> [[f32; tiled::TILE_ROWS]; N];

type PairKern<A, const N: usize> =
    unsafe fn(&[u8], &[u8], [&[A]; N], bool) -> [[f32; 2 * tiled::TILE_ROWS]; N];

/// Whole tiles (the second argument: bytes per tile) against one activation row, each
/// tile's rows to the next eight values at the pointer.
type RunKern<A> = unsafe fn(&[u8], usize, &[A], *mut f32);

/// The one- and four-row tiled kernels of one weight type at one level, `one` over a range
/// of whole tiles in one call (`run`, for decode), and where the level has one, a four-row
/// kernel over two tiles at once (512-bit vectors, for prefill).
struct TilePair<A: 'static> {
    one: TileKern<A, 1>,
    four: TileKern<A, 4>,
    run: RunKern<A>,
    pair_four: Option<PairKern<A, 4>>,
    /// The same over eight activation rows (each weight block decoded once per eight).
    pair_eight: Option<PairKern<A, 8>>,
    /// The same over sixteen (IQ4_XS, whose codes cost a table lookup to decode).
    pair_sixteen: Option<PairKern<A, 16>>,
}

impl<A: 'static> TilePair<A> {
    /// A one- and a four-row kernel and the run of the one-row kernel, no pair kernels.
    fn new(one: TileKern<A, 1>, four: TileKern<A, 4>, run: RunKern<A>) -> Self {
        TilePair {
            one,
            four,
            run,
            pair_four: None,
            pair_eight: None,
            pair_sixteen: None,
        }
    }
}

/// The one- and four-row kernels and the run kernel of tile-kernel module `$m` (one
/// instruction-set level of `x86_tiled` or `neon_tiled`) for the 32-value type `$ty`.
macro_rules! tiles_32 {
    (@kind $kind:ident, $($m:ident)::+) => {
        TilePair::new(
            $($m)::+::tile_dot::<1, $kind>,
            $($m)::+::tile_dot::<4, $kind>,
            $($m)::+::run_dot::<$kind>,
        )
    };
    ($ty:expr, $($m:ident)::+) => {{
        use tiled::kinds::{IQ4_NL, MXFP4, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
        match $ty {
            WeightType::Iq4Nl => tiles_32!(@kind IQ4_NL, $($m)::+),
            WeightType::Mxfp4 => tiles_32!(@kind MXFP4, $($m)::+),
            WeightType::Q4_0 => tiles_32!(@kind Q4_0, $($m)::+),
            WeightType::Q4_1 => tiles_32!(@kind Q4_1, $($m)::+),
            WeightType::Q5_0 => tiles_32!(@kind Q5_0, $($m)::+),
            WeightType::Q5_1 => tiles_32!(@kind Q5_1, $($m)::+),
            _ => tiles_32!(@kind Q8_0, $($m)::+),
        }
    }};
}

/// As [`tiles_32`] for the K-quants.
macro_rules! tiles_k {
    ($ty:expr, $($m:ident)::+) => {
        match $ty {
            WeightType::Q4K => TilePair::new(
                $($m)::+::tile_q45k::<1, false>,
                $($m)::+::tile_q45k::<4, false>,
                $($m)::+::run_q45k::<false>,
            ),
            WeightType::Q5K => TilePair::new(
                $($m)::+::tile_q45k::<1, true>,
                $($m)::+::tile_q45k::<4, true>,
                $($m)::+::run_q45k::<true>,
            ),
            _ => TilePair::new(
                $($m)::+::tile_q6k::<1>,
                $($m)::+::tile_q6k::<4>,
                $($m)::+::run_q6k,
            ),
        }
    };
}

/// As [`tiles_k`] for Q2_K and Q3_K (`$ty`, one of them) in module `$m`.
macro_rules! tiles_k23 {
    ($ty:expr, $($m:ident)::+) => {
        if $ty == WeightType::Q3K {
            TilePair::new(
                $($m)::+::tile_q3k::<1>,
                $($m)::+::tile_q3k::<4>,
                $($m)::+::run_q3k,
            )
        } else {
            TilePair::new(
                $($m)::+::tile_q2k::<1>,
                $($m)::+::tile_q2k::<4>,
                $($m)::+::run_q2k,
            )
        }
    };
}

#[cfg(target_arch = "x86_64")]
fn tile_kernels_k(ty: WeightType, isa: Isa) -> TilePair<BlockQ8K> {
    let k23 = matches!(ty, WeightType::Q2K | WeightType::Q3K);
    match isa {
        // one tile fills 512-bit vectors on their layout (`tiled::HighBits::Wide`): no pairs
        Isa::Avx512Vnni if k23 => tiles_k23!(ty, x86_wide),
        _ if k23 => tiles_k23!(ty, x86_tiled::k23_avx2),
        Isa::Avx512Vnni => {
            let mut k = tiles_k!(ty, x86_tiled::avx512vnni);
            k.pair_four = match ty {
                WeightType::Q4K => Some(x86_wide::tile2_q45k::<4, false>),
                WeightType::Q5K => Some(x86_wide::tile2_q45k::<4, true>),
                _ => Some(x86_wide::tile2_q6k::<4>),
            };
            k
        }
        _ => tiles_k!(ty, x86_tiled::avx2),
    }
}

#[cfg(target_arch = "x86_64")]
fn tile_kernels(ty: WeightType, isa: Isa) -> TilePair<BlockQ8> {
    use tiled::kinds::{IQ4_NL, MXFP4, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
    match isa {
        Isa::Avx512Vnni if ty == WeightType::Iq4Xs => TilePair {
            pair_four: Some(x86_wide::tile2_iq4xs::<4>),
            pair_eight: Some(x86_wide::tile2_iq4xs::<8>),
            pair_sixteen: Some(x86_wide::tile2_iq4xs::<16>),
            ..TilePair::new(
                x86_tiled::avx512vnni::tile_iq4xs::<1>,
                x86_tiled::avx512vnni::tile_iq4xs::<4>,
                x86_tiled::avx512vnni::run_iq4xs,
            )
        },
        _ if ty == WeightType::Iq4Xs => TilePair {
            pair_four: Some(x86_tiled::avx2::tiles2_iq4xs::<4>),
            pair_eight: Some(x86_tiled::avx2::tiles2_iq4xs::<8>),
            ..TilePair::new(
                x86_tiled::avx2::tile_iq4xs::<1>,
                x86_tiled::avx2::tile_iq4xs::<4>,
                x86_tiled::avx2::run_iq4xs,
            )
        },
        Isa::Avx512Vnni => {
            let mut k = tiles_32!(ty, x86_tiled::avx512vnni);
            k.pair_four = Some(match ty {
                WeightType::Iq4Nl => x86_wide::tile2_dot::<4, IQ4_NL>,
                WeightType::Mxfp4 => x86_wide::tile2_dot::<4, MXFP4>,
                WeightType::Q4_0 => x86_wide::tile2_dot::<4, Q4_0>,
                WeightType::Q4_1 => x86_wide::tile2_dot::<4, Q4_1>,
                WeightType::Q5_0 => x86_wide::tile2_dot::<4, Q5_0>,
                WeightType::Q5_1 => x86_wide::tile2_dot::<4, Q5_1>,
                _ => x86_wide::tile2_dot::<4, Q8_0>,
            });
            k.pair_eight = Some(match ty {
                WeightType::Iq4Nl => x86_wide::tile2_dot::<8, IQ4_NL>,
                WeightType::Mxfp4 => x86_wide::tile2_dot::<8, MXFP4>,
                WeightType::Q4_0 => x86_wide::tile2_dot::<8, Q4_0>,
                WeightType::Q4_1 => x86_wide::tile2_dot::<8, Q4_1>,
                WeightType::Q5_0 => x86_wide::tile2_dot::<8, Q5_0>,
                WeightType::Q5_1 => x86_wide::tile2_dot::<8, Q5_1>,
                _ => x86_wide::tile2_dot::<8, Q8_0>,
            });
            k
        }
        _ => tiles_32!(ty, x86_tiled::avx2),
    }
}

#[cfg(target_arch = "aarch64")]
fn tile_kernels_k(ty: WeightType, isa: Isa) -> TilePair<BlockQ8K> {
    let k23 = matches!(ty, WeightType::Q2K | WeightType::Q3K);
    match isa {
        Isa::NeonDot if k23 => tiles_k23!(ty, neon_tiled::neondot),
        _ if k23 => tiles_k23!(ty, neon_tiled::neon),
        Isa::NeonDot => tiles_k!(ty, neon_tiled::neondot),
        _ => tiles_k!(ty, neon_tiled::neon),
    }
}

#[cfg(target_arch = "aarch64")]
fn tile_kernels(ty: WeightType, isa: Isa) -> TilePair<BlockQ8> {
    match isa {
        Isa::NeonDot if ty == WeightType::Iq4Xs => TilePair::new(
            neon_tiled::neondot::tile_iq4xs::<1>,
            neon_tiled::neondot::tile_iq4xs::<4>,
            neon_tiled::neondot::run_iq4xs,
        ),
        _ if ty == WeightType::Iq4Xs => TilePair::new(
            neon_tiled::neon::tile_iq4xs::<1>,
            neon_tiled::neon::tile_iq4xs::<4>,
            neon_tiled::neon::run_iq4xs,
        ),
        Isa::NeonDot => tiles_32!(ty, neon_tiled::neondot),
        _ => tiles_32!(ty, neon_tiled::neon),
    }
}

thread_local! {
    static SCRATCH_Q8: RefCell<Vec<BlockQ8>> = const { RefCell::new(Vec::new()) };
    static SCRATCH_Q8K: RefCell<Vec<BlockQ8K>> = const { RefCell::new(Vec::new()) };
    /// An unpacked super-block column and the sums of a row group (see [`Unpacked`]; the
    /// AVX2 form uses the first eight of each row's sixteen).
    #[cfg(target_arch = "x86_64")]
    static SCRATCH_UNPACKED: RefCell<(Vec<u8>, Vec<[f32; iquants::UNPACKED_ROWS]>)> =
        const { RefCell::new((Vec::new(), Vec::new())) };
}

/// The output matrix, written by several threads at disjoint positions.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: the driver hands each row range to one thread only; positions never overlap.
unsafe impl Send for OutPtr {}
// SAFETY: as above; the pointer is only written through, at disjoint positions.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The pointer (a method, so a closure captures the `Sync` wrapper, not its field).
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Writes the first `live` of a tile's (or a pair of tiles') `R` row results to `dst`. A
/// whole tile is a copy of a constant `R` values (vector moves); a loop over `live` values
/// would compile to a call of libc's `memcpy` per tile.
///
/// # Safety
/// `dst` is valid for `live` (at most `R`) writes that no other thread makes.
#[inline]
unsafe fn store_rows<const R: usize>(dst: *mut f32, vals: &[f32; R], live: usize) {
    if live == R {
        // SAFETY: the caller's; the source holds `R` values.
        unsafe { std::ptr::copy_nonoverlapping(vals.as_ptr(), dst, R) };
    } else {
        for (i, &v) in vals[..live.min(R)].iter().enumerate() {
            // SAFETY: the caller's; i < live.
            unsafe { *dst.add(i) = v };
        }
    }
}

/// The loop of the one-row run kernels (`x86_tiled` and `neon_tiled`): `tile` over each
/// whole tile of `w` (`tile_bytes` long), tile `i`'s eight results to `out[8 i..8 i + 8]`.
/// Inlined into each kernel, so `tile` runs with that kernel's CPU features.
///
/// # Safety
/// `out` is valid for eight writes per tile of `w` that no other thread makes.
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "aarch64")),
    allow(dead_code)
)]
#[inline(always)]
unsafe fn each_tile(
    w: &[u8],
    tile_bytes: usize,
    out: *mut f32,
    mut tile: impl FnMut(&[u8]) -> [f32; tiled::TILE_ROWS],
) {
    for (i, t) in w.chunks_exact(tile_bytes).enumerate() {
        let vals = tile(t);
        // SAFETY: the caller's; tile i's eight values start at 8 i.
        unsafe {
            out.add(tiled::TILE_ROWS * i)
                .cast::<[f32; tiled::TILE_ROWS]>()
                .write_unaligned(vals)
        };
    }
}

/// One pair of adjacent tiles being multiplied: their weights and where their rows land.
struct PairAt<'a> {
    w0: &'a [u8],
    w1: &'a [u8],
    /// The pair's first output row.
    r0: usize,
    /// Rows of the pair inside the matrix (the last pair may be short).
    live: usize,
    /// Rows of the matrix (the output's row stride).
    n: usize,
    out: OutPtr,
}

impl PairAt<'_> {
    /// Runs `kern` over activation rows `tok..t` in whole groups of `N`; returns the first
    /// row left for a smaller kernel.
    fn run<'b, A: 'b, const N: usize>(
        &self,
        kern: PairKern<A, N>,
        mut tok: usize,
        t: usize,
        act: &impl Fn(usize) -> &'b [A],
    ) -> usize {
        while tok + N <= t {
            let a: [&[A]; N] = std::array::from_fn(|j| act(tok + j));
            // The first group of rows prefetches the next pair; later ones find this pair
            // in the cache.
            // SAFETY: pair kernels are only offered at a level `with_isa` checked this CPU
            // has; both tiles of a pair have the same block count, and every activation row
            // has a block per tile block.
            let o = unsafe { kern(self.w0, self.w1, a, tok == 0) };
            for (j, vals) in o.iter().enumerate() {
                // SAFETY: tok + j < t and r0 + live <= n: inside `y` (t * n long); only this
                // thread writes these rows.
                unsafe {
                    store_rows(
                        self.out.0.add((tok + j) * self.n + self.r0),
                        vals,
                        self.live,
                    )
                };
            }
            tok += N;
        }
        tok
    }
}

impl QuantMatrix {
    /// Wraps `data`: `rows` rows of `cols` values in type `ty`, in the file's layout, for
    /// the [`active_isa`].
    ///
    /// # Errors
    /// When `cols` is not a whole number of blocks or `data` has the wrong length.
    pub fn new(
        ty: WeightType,
        rows: usize,
        cols: usize,
        data: Vec<u8>,
    ) -> Result<Self, KernelError> {
        Self::with_isa(active_isa(), ty, rows, cols, data)
    }

    /// As [`QuantMatrix::new`], from borrowed bytes (copied once, or straight into tiles).
    ///
    /// # Errors
    /// As [`QuantMatrix::new`].
    pub fn from_bytes(
        ty: WeightType,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<Self, KernelError> {
        Self::build(active_isa(), ty, rows, cols, data)
    }

    /// As [`QuantMatrix::new`], for a given instruction-set level.
    ///
    /// # Errors
    /// As [`QuantMatrix::new`], and when this CPU cannot run `isa`.
    pub fn with_isa(
        isa: Isa,
        ty: WeightType,
        rows: usize,
        cols: usize,
        data: Vec<u8>,
    ) -> Result<Self, KernelError> {
        Self::build(isa, ty, rows, cols, &data)
    }

    fn build(
        isa: Isa,
        ty: WeightType,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<Self, KernelError> {
        if !isa.runs_here() {
            return Err(KernelError::Isa(isa));
        }
        let bad = |problem: String| KernelError::Matrix {
            ty,
            rows,
            cols,
            problem,
        };
        if cols == 0 || !cols.is_multiple_of(ty.block_elems()) {
            return Err(bad(format!(
                "{cols} columns are not a whole number of {}-value blocks",
                ty.block_elems()
            )));
        }
        let row_bytes = cols / ty.block_elems() * ty.block_bytes();
        let want = rows
            .checked_mul(row_bytes)
            .ok_or_else(|| bad("size overflows".into()))?;
        if data.len() != want {
            return Err(bad(format!(
                "{} bytes of data, expected {want}",
                data.len()
            )));
        }
        let tiled = isa != Isa::Portable && tiled::is_tiled_type(ty);
        let data = if tiled {
            let blocks = cols / ty.block_elems();
            let mut out = WeightBuffer::zeroed(tiled::tiled_len(ty, rows, blocks));
            tiled::tile(ty, rows, blocks, data, high_bits(isa, ty), &mut out);
            out
        } else {
            WeightBuffer::copy_of(data)
        };
        Ok(QuantMatrix {
            ty,
            rows,
            cols,
            row_bytes,
            isa,
            tiled,
            data,
        })
    }

    /// Rows (output features).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns (input features).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes of weight data (with the padding of a ragged last tile).
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// Row `r` in the file's block layout.
    ///
    /// # Panics
    /// When `r` is out of range.
    pub fn row(&self, r: usize) -> std::borrow::Cow<'_, [u8]> {
        assert!(r < self.rows, "row {r} of {}", self.rows);
        if self.tiled {
            let blocks = self.cols / self.ty.block_elems();
            std::borrow::Cow::Owned(tiled::untile_row(
                self.ty,
                blocks,
                &self.data,
                r,
                high_bits(self.isa, self.ty),
            ))
        } else {
            std::borrow::Cow::Borrowed(&self.data[r * self.row_bytes..(r + 1) * self.row_bytes])
        }
    }

    /// Row `r` as f32 values (`out` is `cols` long): the embedding lookup.
    ///
    /// # Errors
    /// When `r` is out of range or `out` has the wrong length.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) -> Result<(), KernelError> {
        if r >= self.rows || out.len() != self.cols {
            return Err(KernelError::Shape {
                rows: self.rows,
                cols: self.cols,
                problem: format!("row {r} into {} values", out.len()),
            });
        }
        reference::dequantize_row(self.ty, &self.row(r), out);
        Ok(())
    }

    /// `y = x W^T`: `x` holds `t` rows of `cols` values, `y` gets `t` rows of `rows` values.
    ///
    /// # Errors
    /// When the lengths do not fit the matrix.
    pub fn matmul(&self, x: &[f32], y: &mut [f32]) -> Result<(), KernelError> {
        let isa = self.isa;
        let t = x.len() / self.cols;
        if !x.len().is_multiple_of(self.cols) || y.len() != t * self.rows {
            return Err(KernelError::Shape {
                rows: self.rows,
                cols: self.cols,
                problem: format!("{} inputs and {} outputs", x.len(), y.len()),
            });
        }
        if t == 0 {
            return Ok(());
        }
        let ty = self.ty;
        match ty.act_format() {
            ActFormat::F32 => {
                let k = match ty {
                    WeightType::F32 => pick!(isa, f32w),
                    WeightType::Bf16 => pick!(isa, bf16w),
                    _ => pick!(isa, f16w),
                };
                self.drive(x, self.cols, t, y, &k);
            }
            ActFormat::Q8 => SCRATCH_Q8.with(|s| {
                let mut acts = std::mem::take(&mut *s.borrow_mut());
                acts.resize(x.len() / QK, BlockQ8::default());
                quantize_rows(x, &mut acts, quantize_q8);
                if self.tiled {
                    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
                    self.drive_tiles(&acts, self.cols / QK, t, y, &tile_kernels(ty, isa));
                } else {
                    let k = match ty {
                        WeightType::Q4_0 => portable!(q4_0),
                        WeightType::Q4_1 => portable!(q4_1),
                        WeightType::Q5_0 => portable!(q5_0),
                        WeightType::Q5_1 => portable!(q5_1),
                        WeightType::Iq4Nl => portable!(iq4nl),
                        WeightType::Iq4Xs => portable!(iq4xs),
                        WeightType::Mxfp4 => portable!(mxfp4),
                        _ => portable!(q8_0),
                    };
                    self.drive(&acts, self.cols / QK, t, y, &k);
                }
                *s.borrow_mut() = acts;
            }),
            ActFormat::Q8K => SCRATCH_Q8K.with(|s| {
                let mut acts = std::mem::take(&mut *s.borrow_mut());
                acts.resize(x.len() / QK_K, BlockQ8K::default());
                quantize_rows(x, &mut acts, quantize_q8k);
                if self.tiled {
                    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
                    self.drive_tiles(&acts, self.cols / QK_K, t, y, &tile_kernels_k(ty, isa));
                } else if !self.batched_iquant(&acts, t, y) {
                    let k = match ty {
                        WeightType::Q4K => KernPair {
                            one: portable::q45k::<1, false>,
                            four: portable::q45k::<4, false>,
                            sixteen: None,
                        },
                        WeightType::Q5K => KernPair {
                            one: portable::q45k::<1, true>,
                            four: portable::q45k::<4, true>,
                            sixteen: None,
                        },
                        WeightType::Q2K => portable!(q2k),
                        WeightType::Q3K => portable!(q3k),
                        WeightType::Iq1S => pick_sixteen!(isa, iq1s),
                        WeightType::Iq1M => pick_sixteen!(isa, iq1m),
                        WeightType::Iq2Xxs => pick_sixteen!(isa, iq2xxs),
                        WeightType::Iq2Xs => pick_sixteen!(isa, iq2xs),
                        WeightType::Iq2S => pick_sixteen!(isa, iq2s),
                        WeightType::Iq3Xxs => pick_sixteen!(isa, iq3xxs),
                        WeightType::Iq3S => pick_sixteen!(isa, iq3s),
                        _ => portable!(q6k),
                    };
                    self.drive(&acts, self.cols / QK_K, t, y, &k);
                }
                *s.borrow_mut() = acts;
            }),
        }
        Ok(())
    }

    /// `ys[i] = x W_i^T` for several matrices with the same column count: the activations
    /// are quantized once, and every matrix's tiles are split across the pool in one
    /// parallel region (q/k/v, gate/up). Matrices the shared path does not cover (float
    /// types, untiled layouts, mixed activation formats) run one by one through
    /// [`QuantMatrix::matmul`]; the results are the same either way.
    ///
    /// # Errors
    /// When the counts or lengths do not fit the matrices.
    pub fn matmul_many(
        mats: &[&QuantMatrix],
        x: &[f32],
        ys: &mut [&mut [f32]],
    ) -> Result<(), KernelError> {
        let Some(first) = mats.first() else {
            return Ok(());
        };
        let bad = |problem: String| KernelError::Shape {
            rows: first.rows,
            cols: first.cols,
            problem,
        };
        if ys.len() != mats.len() {
            return Err(bad(format!(
                "{} outputs for {} matrices",
                ys.len(),
                mats.len()
            )));
        }
        let cols = first.cols;
        let t = x.len() / cols;
        for (m, y) in mats.iter().zip(ys.iter()) {
            if m.cols != cols || !x.len().is_multiple_of(cols) || y.len() != t * m.rows {
                return Err(bad(format!(
                    "a {}x{} matrix with {} inputs and {} outputs",
                    m.rows,
                    m.cols,
                    x.len(),
                    y.len()
                )));
            }
        }
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        if t > 0 && Self::share_activations(mats) {
            let outs: Vec<OutPtr> = ys.iter_mut().map(|y| OutPtr(y.as_mut_ptr())).collect();
            Self::shared_tiled(mats, x, t, &outs, None);
            return Ok(());
        }
        for (m, y) in mats.iter().zip(ys.iter_mut()) {
            m.matmul(x, y)?;
        }
        Ok(())
    }

    #[cfg(test)]
    /// [`QuantMatrix::matmul_many`] into new vectors, one per matrix (`t` rows of its row
    /// count each). Where the shared tiled path runs, the vectors are not zeroed first: the
    /// kernels write every value (zeroing an output head's logits would be a pass over
    /// hundreds of kilobytes per token).
    ///
    /// # Errors
    /// As [`QuantMatrix::matmul_many`].
    pub fn products(mats: &[&QuantMatrix], x: &[f32]) -> Result<Vec<Vec<f32>>, KernelError> {
        let Some(first) = mats.first() else {
            return Ok(Vec::new());
        };
        let t = x.len() / first.cols;
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        if t > 0
            && x.len().is_multiple_of(first.cols)
            && mats.iter().all(|m| m.cols == first.cols)
            && Self::share_activations(mats)
        {
            let mut ys: Vec<Vec<f32>> = mats
                .iter()
                .map(|m| Vec::with_capacity(t * m.rows))
                .collect();
            let outs: Vec<OutPtr> = ys
                .iter_mut()
                .map(|y| OutPtr(y.spare_capacity_mut().as_mut_ptr().cast::<f32>()))
                .collect();
            Self::shared_tiled(mats, x, t, &outs, None);
            for (y, m) in ys.iter_mut().zip(mats) {
                // SAFETY: `shared_tiled` wrote all `t * rows` values of every output: each
                // tile range writes its rows for every token, and the ranges cover the rows.
                unsafe { y.set_len(t * m.rows) };
            }
            return Ok(ys);
        }
        let mut ys: Vec<Vec<f32>> = mats.iter().map(|m| vec![0f32; t * m.rows]).collect();
        let mut outs: Vec<&mut [f32]> = ys.iter_mut().map(|y| &mut y[..]).collect();
        Self::matmul_many(mats, x, &mut outs)?;
        Ok(ys)
    }

    /// [`QuantMatrix::products`] into the caller's vectors, resized to `t` rows of each
    /// matrix's row count; their capacity is kept from step to step. Where the shared tiled
    /// path runs, values past a vector's old length are not zeroed first: the kernels write
    /// every value.
    ///
    /// # Errors
    /// As [`QuantMatrix::matmul_many`].
    pub fn products_into(
        mats: &[&QuantMatrix],
        x: &[f32],
        outs: &mut [&mut Vec<f32>],
    ) -> Result<(), KernelError> {
        let Some(first) = mats.first() else {
            return Ok(());
        };
        let t = x.len() / first.cols;
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        if t > 0
            && outs.len() == mats.len()
            && x.len().is_multiple_of(first.cols)
            && mats.iter().all(|m| m.cols == first.cols)
            && Self::share_activations(mats)
        {
            let ptrs: Vec<OutPtr> = outs
                .iter_mut()
                .zip(mats)
                .map(|(y, m)| {
                    y.clear();
                    y.reserve(t * m.rows);
                    OutPtr(y.spare_capacity_mut().as_mut_ptr().cast::<f32>())
                })
                .collect();
            Self::shared_tiled(mats, x, t, &ptrs, None);
            for (y, m) in outs.iter_mut().zip(mats) {
                // SAFETY: `shared_tiled` wrote all `t * rows` values of every output: each
                // tile range writes its rows for every token, and the ranges cover the rows.
                unsafe { y.set_len(t * m.rows) };
            }
            return Ok(());
        }
        for (y, m) in outs.iter_mut().zip(mats) {
            y.resize(t * m.rows, 0.0);
        }
        let mut slices: Vec<&mut [f32]> = outs.iter_mut().map(|y| &mut y[..]).collect();
        Self::matmul_many(mats, x, &mut slices)
    }

    /// The shared tiled path of [`QuantMatrix::matmul_many`]: quantizes `x` (`t` rows) once
    /// and runs every matrix's tiles in one parallel region into `outs` (room for `t` rows of
    /// each matrix's row count), and `after` over each job's tiles once the job has written
    /// them (see [`drive_many`]). Callers have checked the shapes and
    /// [`QuantMatrix::share_activations`].
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    fn shared_tiled(
        mats: &[&QuantMatrix],
        x: &[f32],
        t: usize,
        outs: &[OutPtr],
        after: Option<&AfterJob<'_>>,
    ) {
        let cols = mats[0].cols;
        match mats[0].ty.act_format() {
            ActFormat::Q8 => SCRATCH_Q8.with(|s| {
                let mut acts = std::mem::take(&mut *s.borrow_mut());
                acts.resize(x.len() / QK, BlockQ8::default());
                quantize_rows(x, &mut acts, quantize_q8);
                let ks: Vec<_> = mats.iter().map(|m| tile_kernels(m.ty, m.isa)).collect();
                drive_many(mats, &ks, outs, &acts, cols / QK, t, after);
                *s.borrow_mut() = acts;
            }),
            _ => SCRATCH_Q8K.with(|s| {
                let mut acts = std::mem::take(&mut *s.borrow_mut());
                acts.resize(x.len() / QK_K, BlockQ8K::default());
                quantize_rows(x, &mut acts, quantize_q8k);
                let ks: Vec<_> = mats.iter().map(|m| tile_kernels_k(m.ty, m.isa)).collect();
                drive_many(mats, &ks, outs, &acts, cols / QK_K, t, after);
                *s.borrow_mut() = acts;
            }),
        }
    }

    /// Runs kernel pair `k` over every (row, token) pair; `acts` holds `t` rows of
    /// `per_row` activation blocks. Rows are split across the compute pool.
    fn drive<A: Sync>(&self, acts: &[A], per_row: usize, t: usize, y: &mut [f32], k: &KernPair<A>) {
        debug_assert_eq!(acts.len(), per_row * t);
        debug_assert_eq!(y.len(), t * self.rows);
        let out = OutPtr(y.as_mut_ptr());
        let threads = rayon::current_num_threads();
        if threads <= 1 || self.rows < 16 {
            self.drive_rows(0..self.rows, acts, per_row, t, out, k);
            return;
        }
        let chunks = (threads * 4).min(self.rows.div_ceil(8));
        let per_chunk = self.rows.div_ceil(chunks);
        team::for_each(chunks, |c| {
            let rows = c * per_chunk..((c + 1) * per_chunk).min(self.rows);
            if !rows.is_empty() {
                self.drive_rows(rows, acts, per_row, t, out, k);
            }
        });
    }

    fn drive_rows<A>(
        &self,
        rows: Range<usize>,
        acts: &[A],
        per_row: usize,
        t: usize,
        out: OutPtr,
        k: &KernPair<A>,
    ) {
        let n = self.rows;
        let act = |tok: usize| &acts[tok * per_row..(tok + 1) * per_row];
        for r in rows {
            let w = &self.data[r * self.row_bytes..(r + 1) * self.row_bytes];
            let mut tok = 0;
            if let Some(sixteen) = k.sixteen {
                while tok + 16 <= t {
                    // SAFETY: as for the four-row kernel below.
                    let o = unsafe { sixteen(w, std::array::from_fn(|j| act(tok + j))) };
                    for (j, v) in o.into_iter().enumerate() {
                        // SAFETY: as below.
                        unsafe { *out.0.add((tok + j) * n + r) = v };
                    }
                    tok += 16;
                }
            }
            while tok + 4 <= t {
                // SAFETY: `matmul_with` checked this CPU runs the kernel's level; `w` is whole
                // blocks and every activation row has `per_row` blocks (or values), as many as
                // `w` has.
                let o =
                    unsafe { (k.four)(w, [act(tok), act(tok + 1), act(tok + 2), act(tok + 3)]) };
                for (j, v) in o.into_iter().enumerate() {
                    // SAFETY: (tok + j) < t and r < n, so the position is inside `y`
                    // (t * n long); only this thread writes row r.
                    unsafe { *out.0.add((tok + j) * n + r) = v };
                }
                tok += 4;
            }
            while tok < t {
                // SAFETY: as above.
                let [v] = unsafe { (k.one)(w, [act(tok)]) };
                // SAFETY: as above.
                unsafe { *out.0.add(tok * n + r) = v };
                tok += 1;
            }
        }
    }
}

/// Activation rows from which a grid i-quant's product unpacks its weights once per batch
/// ([`Unpacked`]); fewer rows read the blocks directly.
#[cfg(target_arch = "x86_64")]
const UNPACK_FROM_ROWS: usize = 16;

#[cfg(target_arch = "x86_64")]
type UnpackedKern<const N: usize> =
    unsafe fn(&[u8], [&BlockQ8K; N], &mut [[f32; iquants::UNPACKED_ROWS]; N]);

/// The batched path of a grid i-quant (x86-64): its unpacker and the kernels over eight,
/// four and one activation rows (`x86_unpacked`), sixteen weight rows at a time with AVX-512
/// VNNI, eight with AVX2. For each group of weight rows, each super-block column is unpacked
/// once and every activation row of the batch meets it there.
#[cfg(target_arch = "x86_64")]
struct Unpacked {
    /// Weight rows per group.
    rows: usize,
    /// Bytes of one unpacked super-block column.
    bytes: usize,
    unpack: unsafe fn(&[&[u8]], &mut [u8]),
    eight: UnpackedKern<8>,
    four: UnpackedKern<4>,
    one: UnpackedKern<1>,
}

#[cfg(target_arch = "x86_64")]
impl Unpacked {
    /// The batched path of `ty` at `isa`, where there is one.
    fn kernels(ty: WeightType, isa: Isa) -> Option<Unpacked> {
        use iquants::Lattice;
        macro_rules! of {
            ($l:ty) => {
                match isa {
                    Isa::Avx512Vnni => Unpacked {
                        rows: iquants::UNPACKED_ROWS,
                        bytes: iquants::unpacked::BYTES,
                        unpack: x86_unpacked::unpack::<$l>,
                        eight: x86_unpacked::block_dot::<8, { <$l as Lattice>::PER_32 }>,
                        four: x86_unpacked::block_dot::<4, { <$l as Lattice>::PER_32 }>,
                        one: x86_unpacked::block_dot::<1, { <$l as Lattice>::PER_32 }>,
                    },
                    _ => Unpacked {
                        rows: x86_unpacked::narrow::ROWS,
                        bytes: x86_unpacked::narrow::BYTES,
                        unpack: x86_unpacked::unpack_narrow::<$l>,
                        eight: x86_unpacked::block_dot_narrow::<8>,
                        four: x86_unpacked::block_dot_narrow::<4>,
                        one: x86_unpacked::block_dot_narrow::<1>,
                    },
                }
            };
        }
        if !matches!(isa, Isa::Avx512Vnni | Isa::Avx2) {
            return None;
        }
        Some(match ty {
            WeightType::Iq1S => of!(iquants::Iq1S),
            WeightType::Iq1M => of!(iquants::Iq1M),
            WeightType::Iq2Xxs => of!(iquants::Iq2Xxs),
            WeightType::Iq2Xs => of!(iquants::Iq2Xs),
            WeightType::Iq2S => of!(iquants::Iq2S),
            WeightType::Iq3Xxs => of!(iquants::Iq3Xxs),
            WeightType::Iq3S => of!(iquants::Iq3S),
            _ => return None,
        })
    }
}

impl QuantMatrix {
    /// Runs `y = x W^T` (`acts`: `t` rows of quantized activations) through the batched path
    /// of a grid i-quant where this matrix and batch have one ([`Unpacked`]); false where
    /// not, and nothing was written.
    fn batched_iquant(&self, acts: &[BlockQ8K], t: usize, y: &mut [f32]) -> bool {
        #[cfg(target_arch = "x86_64")]
        if t >= UNPACK_FROM_ROWS {
            if let Some(k) = Unpacked::kernels(self.ty, self.isa) {
                self.drive_unpacked(acts, t, y, &k);
                return true;
            }
        }
        let _ = (acts, t, y);
        false
    }

    /// `y = x W^T` through the batched path `k` (`acts`: `t` rows of quantized activations):
    /// groups of weight rows split across the compute pool.
    #[cfg(target_arch = "x86_64")]
    fn drive_unpacked(&self, acts: &[BlockQ8K], t: usize, y: &mut [f32], k: &Unpacked) {
        debug_assert_eq!(y.len(), t * self.rows);
        let out = OutPtr(y.as_mut_ptr());
        let groups = self.rows.div_ceil(k.rows);
        let threads = rayon::current_num_threads();
        if threads <= 1 || groups < 2 {
            for g in 0..groups {
                self.unpacked_group(g, acts, t, out, k);
            }
            return;
        }
        let chunks = (threads * 4).min(groups);
        let per_chunk = groups.div_ceil(chunks);
        team::for_each(chunks, |c| {
            for g in c * per_chunk..((c + 1) * per_chunk).min(groups) {
                self.unpacked_group(g, acts, t, out, k);
            }
        });
    }

    /// Row group `g` (`k.rows` rows, or what is left) against all `t` activation rows: per
    /// super-block column, one unpacking and then every activation row, eight at a time.
    #[cfg(target_arch = "x86_64")]
    fn unpacked_group(&self, g: usize, acts: &[BlockQ8K], t: usize, out: OutPtr, k: &Unpacked) {
        const ROWS: usize = iquants::UNPACKED_ROWS;
        let per_row = self.cols / QK_K;
        let bb = self.ty.block_bytes();
        let r0 = g * k.rows;
        let live = k.rows.min(self.rows - r0);
        SCRATCH_UNPACKED.with(|s| {
            let mut s = s.borrow_mut();
            let (block, sums) = &mut *s;
            block.resize(k.bytes, 0);
            sums.clear();
            sums.resize(t, [0.0; ROWS]);
            for b in 0..per_row {
                // the rows' blocks two columns on, into L2 while this column is multiplied
                if b + 2 < per_row {
                    for r in r0..r0 + live {
                        let at = r * self.row_bytes + (b + 2) * bb;
                        prefetch_l2(&self.data[at..at + bb]);
                    }
                }
                let blocks: [&[u8]; ROWS] = std::array::from_fn(|i| {
                    let at = (r0 + i.min(live - 1)) * self.row_bytes + b * bb;
                    &self.data[at..at + bb]
                });
                // SAFETY: `kernels` offers the unpacker and kernels of a level `with_isa`
                // checked this CPU runs; `block` is `k.bytes` long, their unpacked size.
                unsafe { (k.unpack)(&blocks[..live], block) };
                let act = |tok: usize| &acts[tok * per_row + b];
                let mut tok = 0;
                macro_rules! run {
                    ($n:literal, $kern:expr) => {
                        while t - tok >= $n {
                            let rows: [&BlockQ8K; $n] = std::array::from_fn(|j| act(tok + j));
                            let sums: &mut [[f32; ROWS]; $n] =
                                (&mut sums[tok..tok + $n]).try_into().expect("n rows");
                            // SAFETY: as for the unpacker above.
                            unsafe { $kern(block, rows, sums) };
                            tok += $n;
                        }
                    };
                }
                run!(8, k.eight);
                run!(4, k.four);
                run!(1, k.one);
            }
            for (tok, vals) in sums.iter().enumerate() {
                // SAFETY: tok < t and r0 + live <= rows: inside `y` (t * rows long); only
                // this job writes rows r0..r0 + live.
                unsafe { store_rows(out.get().add(tok * self.rows + r0), vals, live) };
            }
        });
    }
}

impl QuantMatrix {
    /// As [`QuantMatrix::drive`] for the tiled layout: the units of work are tiles of eight
    /// rows.
    fn drive_tiles<A: Sync>(
        &self,
        acts: &[A],
        per_row: usize,
        t: usize,
        y: &mut [f32],
        k: &TilePair<A>,
    ) {
        debug_assert_eq!(acts.len(), per_row * t);
        debug_assert_eq!(y.len(), t * self.rows);
        let out = OutPtr(y.as_mut_ptr());
        drive_many(
            &[self],
            std::slice::from_ref(k),
            &[out],
            acts,
            per_row,
            t,
            None,
        );
    }

    /// Whether `mats` can share one quantization of their activations: all tiled, for one
    /// level, with one quantized activation format.
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    fn share_activations(mats: &[&QuantMatrix]) -> bool {
        let format = mats[0].ty.act_format();
        format != ActFormat::F32
            && mats
                .iter()
                .all(|m| m.tiled && m.isa == mats[0].isa && m.ty.act_format() == format)
    }

    fn tiles(&self) -> usize {
        self.rows.div_ceil(tiled::TILE_ROWS)
    }

    /// The tile ranges of about `chunks` jobs for the pool's threads; one range when
    /// `chunks` is 1 or the matrix is small. With `even`, every range but the last starts
    /// and ends on an even tile.
    fn tile_chunks(&self, chunks: usize, even: bool) -> Vec<Range<usize>> {
        let tiles = self.tiles();
        if chunks <= 1 || tiles < 4 {
            return std::iter::once(0..tiles).collect();
        }
        let chunks = chunks.min(tiles);
        let mut per_chunk = tiles.div_ceil(chunks);
        if even {
            per_chunk += per_chunk % 2;
        }
        (0..tiles.div_ceil(per_chunk))
            .map(|c| c * per_chunk..((c + 1) * per_chunk).min(tiles))
            .collect()
    }

    fn drive_tile_range<A>(
        &self,
        tiles: Range<usize>,
        acts: &[A],
        per_row: usize,
        t: usize,
        out: OutPtr,
        k: &TilePair<A>,
    ) {
        let n = self.rows;
        let tile_bytes = self.cols / self.ty.block_elems() * tiled::tile_block_bytes(self.ty);
        let act = |tok: usize| &acts[tok * per_row..(tok + 1) * per_row];
        let mut tiles = tiles;
        if let (Some(pair), true) = (k.pair_four, t >= 4) {
            // two tiles at a time for the whole token groups; the rest below
            while tiles.len() >= 2 {
                let tile = tiles.start;
                let w0 = &self.data[tile * tile_bytes..(tile + 1) * tile_bytes];
                let w1 = &self.data[(tile + 1) * tile_bytes..(tile + 2) * tile_bytes];
                let r0 = tile * tiled::TILE_ROWS;
                let live = (n - r0).min(2 * tiled::TILE_ROWS);
                let mut tok = 0;
                let pair_at = PairAt {
                    w0,
                    w1,
                    r0,
                    live,
                    n,
                    out,
                };
                if let Some(pair16) = k.pair_sixteen {
                    tok = pair_at.run(pair16, tok, t, &act);
                }
                if let Some(pair8) = k.pair_eight {
                    tok = pair_at.run(pair8, tok, t, &act);
                }
                tok = pair_at.run(pair, tok, t, &act);
                for tile in [tile, tile + 1] {
                    self.tile_tokens(tile, tok..t, acts, per_row, out, k);
                }
                tiles.start += 2;
            }
        }
        if t == 1 {
            // the whole tiles in one call; a short last tile below
            let whole = tiles.start..tiles.end.min(n / tiled::TILE_ROWS).max(tiles.start);
            let w = &self.data[whole.start * tile_bytes..whole.end * tile_bytes];
            // SAFETY: as `tile_tokens`; the tiles are whole, so their rows, eight per tile
            // from row `whole.start * 8`, lie inside `y` (one row of n values), and only
            // this thread writes them.
            unsafe {
                (k.run)(
                    w,
                    tile_bytes,
                    act(0),
                    out.0.add(whole.start * tiled::TILE_ROWS),
                )
            };
            tiles.start = whole.end;
        }
        for tile in tiles {
            self.tile_tokens(tile, 0..t, acts, per_row, out, k);
        }
    }

    /// Tokens `toks` of one tile, four at a time, then one at a time.
    fn tile_tokens<A>(
        &self,
        tile: usize,
        toks: Range<usize>,
        acts: &[A],
        per_row: usize,
        out: OutPtr,
        k: &TilePair<A>,
    ) {
        let n = self.rows;
        let tile_bytes = self.cols / self.ty.block_elems() * tiled::tile_block_bytes(self.ty);
        let act = |tok: usize| &acts[tok * per_row..(tok + 1) * per_row];
        let t = toks.end;
        let w = &self.data[tile * tile_bytes..(tile + 1) * tile_bytes];
        let r0 = tile * tiled::TILE_ROWS;
        let live = (n - r0).min(tiled::TILE_ROWS);
        let mut tok = toks.start;
        let write = |tok: usize, vals: &[f32; tiled::TILE_ROWS]| {
            // SAFETY: tok < t and r0 + live <= n, so the rows are inside `y` (t * n long);
            // only this thread writes the rows of this tile.
            unsafe { store_rows(out.0.add(tok * n + r0), vals, live) };
        };
        while tok + 4 <= t {
            // SAFETY: the matrix was tiled for `self.isa`, which `with_isa` checked this
            // CPU runs; `w` is whole tile blocks and each activation row has `per_row`
            // blocks, one per block column.
            let o = unsafe { (k.four)(w, [act(tok), act(tok + 1), act(tok + 2), act(tok + 3)]) };
            for (j, vals) in o.iter().enumerate() {
                write(tok + j, vals);
            }
            tok += 4;
        }
        while tok < t {
            // SAFETY: as above.
            let [vals] = unsafe { (k.one)(w, [act(tok)]) };
            write(tok, &vals);
            tok += 1;
        }
    }
}

/// The layout of the high bits of `ty`'s codes (Q5 and Q6_K) that the tile kernels of `isa`
/// read. AVX-512 sets Q5's fifth bits with byte masks, but builds Q6_K codes from whole
/// codes as AVX2 does: 11 instructions per four code vectors where the file's nibbles and
/// pairs take 17. Q2_K and Q3_K interleave eight bytes per row for AVX-512 (one tile then
/// fills its vectors), four elsewhere.
fn high_bits(isa: Isa, ty: WeightType) -> tiled::HighBits {
    match (isa, ty) {
        (Isa::Avx2, _) | (Isa::Avx512Vnni, WeightType::Q6K) => tiled::HighBits::Whole,
        (Isa::Avx512Vnni, WeightType::Q2K | WeightType::Q3K) => tiled::HighBits::Wide,
        _ => tiled::HighBits::Masks,
    }
}

/// Bytes per thread from which a decode step's product is split into [`shares::Shares`].
/// Two threads' speeds differ by a few percent, so the wait at a loop's end grows with the
/// loop, and a steal costs a cold start: below this size the faster thread's wait is too
/// short to win back with a steal; at an output head's size it is many times a steal.
const STEAL_BYTES: usize = 8 << 20;
/// The fewest bytes a thread takes from its share at once in [`stolen_shares`]; four times
/// as many left are worth taking half of.
const GRAIN_BYTES: usize = 64 << 10;

/// [`drive_many`] for one token in a decode step's team, over [`shares::Shares`] of the
/// matrices' tiles (one after another as one run of units), when they hold
/// [`STEAL_BYTES`] or more; false (nothing done) otherwise.
fn stolen_shares<A: Sync>(
    mats: &[&QuantMatrix],
    ks: &[TilePair<A>],
    outs: &[OutPtr],
    acts: &[A],
    per_row: usize,
    after: Option<&AfterJob<'_>>,
) -> bool {
    let threads = rayon::current_num_threads();
    let bytes: usize = mats.iter().map(|m| m.bytes()).sum();
    if bytes / threads < STEAL_BYTES {
        return false;
    }
    let starts: Vec<usize> = mats
        .iter()
        .scan(0, |at, m| {
            let s = *at;
            *at += m.tiles();
            Some(s)
        })
        .collect();
    let total: usize = mats.iter().map(|m| m.tiles()).sum();
    // `after` wants whole tile pairs of each matrix: units in pairs, each matrix starting
    // on one
    let step = if after.is_some() { 2 } else { 1 };
    if total > u32::MAX as usize || starts.iter().any(|s| s % step != 0) {
        return false;
    }
    let tile_bytes = mats
        .iter()
        .map(|m| m.bytes() / m.tiles().max(1))
        .max()
        .unwrap_or(1)
        .max(1);
    let grain = (GRAIN_BYTES / tile_bytes).max(1);
    let shares = shares::Shares::new(total, threads, grain, 4 * grain, step);
    let body = |r: Range<usize>| {
        for (i, m) in mats.iter().enumerate() {
            let (lo, hi) = (r.start.max(starts[i]), r.end.min(starts[i] + m.tiles()));
            if lo < hi {
                let local = lo - starts[i]..hi - starts[i];
                m.drive_tile_range(local.clone(), acts, per_row, 1, outs[i], &ks[i]);
                if let Some(after) = after {
                    after(i, local);
                }
            }
        }
    };
    team::for_each(shares.parts(), |me| shares.work(me, &body));
    true
}

/// What runs after each job of [`drive_many`]: the matrix's index and the job's tiles, whose
/// rows the job has just written (for every token).
type AfterJob<'a> = dyn Fn(usize, Range<usize>) + Sync + 'a;

/// [`QuantMatrix::drive_tiles`] for several matrices sharing quantized activations `acts`,
/// matrix `i` with kernels `ks[i]` into output `outs[i]`, in one parallel region; `after`
/// (when given) runs on the same thread after each job, over ranges of whole tile pairs.
fn drive_many<A: Sync>(
    mats: &[&QuantMatrix],
    ks: &[TilePair<A>],
    outs: &[OutPtr],
    acts: &[A],
    per_row: usize,
    t: usize,
    after: Option<&AfterJob<'_>>,
) {
    let threads = rayon::current_num_threads();
    if t == 1
        && threads > 1
        && team::in_step()
        && stolen_shares(mats, ks, outs, acts, per_row, after)
    {
        return;
    }
    // Jobs per thread for the whole region, shared among the matrices by their tiles (four
    // per thread per matrix made SmolLM2's q/k/v 24 jobs, k's and v's of three tiles each).
    // Four on rayon, so a thread that wakes late is not left with a quarter of the work.
    // One in a decode step's team, whose helpers are already spinning: a thread that moves
    // on to a job elsewhere in memory restarts its stream (one-row products read in a
    // permuted order stream markedly slower than in memory order).
    let per_thread = if t == 1 && team::in_step() { 1 } else { 4 };
    let total: usize = mats.iter().map(|m| m.tiles()).sum();
    let jobs: Vec<(usize, Range<usize>)> = mats
        .iter()
        .enumerate()
        .flat_map(|(i, m)| {
            let chunks = if threads <= 1 {
                1
            } else {
                (threads * per_thread * m.tiles()).div_ceil(total.max(1))
            };
            // whole pairs per job: for `after`, and for the pair kernels (an odd tile left
            // in every job would run at half width)
            let even = after.is_some() || (ks[i].pair_four.is_some() && t >= 4);
            m.tile_chunks(chunks, even).into_iter().map(move |r| (i, r))
        })
        .collect();
    let run = |(i, r): (usize, Range<usize>)| {
        mats[i].drive_tile_range(r.clone(), acts, per_row, t, outs[i], &ks[i]);
        if let Some(after) = after {
            after(i, r);
        }
    };
    if threads <= 1 || jobs.len() <= 1 {
        jobs.into_iter().for_each(run);
        return;
    }
    team::for_each(jobs.len(), |j| run(jobs[j].clone()));
}

#[cfg(test)]
mod tests;
