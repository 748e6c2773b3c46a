//! The x86 row kernels of the grid i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
//! IQ3_S): one weight row against `N` activation rows, straight from the blocks. What costs
//! in these types is rebuilding 32 values from grid indices, sign codes and scales, not
//! reading memory, so each block is read with as few instructions as its layout allows:
//! - the 7-bit sign codes of a whole block (IQ2_XXS, IQ2_XS, IQ3_XXS) are cut out of their
//!   words in vectors, completed with their parity bit by a nibble table, and spread to one
//!   byte per value by a shuffle, an AND with each byte's bit and a compare; explicit sign
//!   bytes (IQ2_S, IQ3_S) take the shuffle, AND and compare alone; IQ1's points are signed
//!   (in eighths) and give their magnitudes and signs in two instructions;
//! - the odd integer scales of a block are computed once, in a vector;
//! - every grid point is a scalar load from its table (a gather of eight four-value points
//!   runs slower on AMD's cores), the indices scalar loads from the block. These loads are
//!   volatile and each group's sums pass through [`pin`], so that LLVM makes a group's
//!   products before the next group's loads instead of loading all eight groups first and
//!   keeping them on the stack.
//!
//! Per group and activation row: the activations carrying the values' signs
//! (`(q ^ m) - m`; `q` is never -128), unsigned-by-signed 8-bit products with pairs summed
//! to 16 bits (at most 2 x 62 x 127), times the group's scales to 32 bits, a block's groups
//! added in 32 bits (at most 8 x 2 x 31 x 15748 a lane) and one f32 product per block. One
//! row (decode) asks for the weights ahead, as the tiled kernels do. Written once and
//! compiled for both x86 levels by [`grid_kernels!`]. Callers must have checked the CPU
//! features.

#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;

use super::formats::BlockQ8K;
use super::iq_grids::{IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID};
use super::iquants::{self, Lattice, IQ1_EIGHTHS};
use super::prefetch::Prefetch;
use super::x86::hsum_ps;
use super::x86_tiled::prefetch_block;

/// One 32-value group as the products take it: the magnitudes as unsigned bytes, a byte
/// mask of the negative values, and the scales as 16-bit words (values 0-15 scaled by the
/// low 128-bit lane's, 16-31 by the high lane's).
pub struct Group {
    mags: __m256i,
    minus: __m256i,
    scales: __m256i,
}

/// How a grid i-quant's blocks are read by these kernels: what is computed once per block
/// ([`Self::Block`]), then each group from it. Every method is inlined into the kernel, which
/// has the CPU features.
pub trait Grid: Lattice {
    /// What a block's groups share.
    type Block: Copy;
    /// The shared part of the block at `b`.
    ///
    /// # Safety
    /// `b` points at a whole block; the kernel's CPU features are present.
    unsafe fn read_block(b: *const u8) -> Self::Block;
    /// Group `g` (0..8) of the block at `b`.
    ///
    /// # Safety
    /// As [`Self::read_block`], with `k` that block's shared part.
    unsafe fn read_group(b: *const u8, k: &Self::Block, g: usize) -> Group;
}

/// Byte `o` of the 32-byte value vector: `1 << (o % 8)`, the bit of value `o` in its point's
/// sign byte.
#[inline(always)]
unsafe fn value_bits() -> __m256i {
    _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64)
}

/// The mask of negative values from `spread`, whose byte `o` is the sign byte of the grid
/// point value `o` belongs to.
#[inline(always)]
unsafe fn minus_of(spread: __m256i) -> __m256i {
    let bits = value_bits();
    _mm256_cmpeq_epi8(_mm256_and_si256(spread, bits), bits)
}

/// The shuffle that spreads a group's four sign bytes over its 32 values, eight each
/// (points 0 and 1 in the low 128-bit lane, 2 and 3 in the high one), for sign bytes at
/// offsets `at`, `at + step`, `at + 2 step` and `at + 3 step` of each lane of the source.
const fn spread(at: u8, step: u8) -> [u8; 32] {
    let mut t = [0u8; 32];
    let mut o = 0;
    while o < 32 {
        t[o] = at + step * (o / 8) as u8;
        o += 1;
    }
    t
}

/// [`spread`] of the codes of word `i % 4` of a [`CodedWords`] lane: `SPREAD_WORD[i % 4]`.
static SPREAD_WORD: [[u8; 32]; 4] = [spread(0, 4), spread(1, 4), spread(2, 4), spread(3, 4)];

/// [`spread`] of four consecutive sign bytes at `4 k`: `SPREAD_RUN[k]`.
static SPREAD_RUN: [[u8; 32]; 4] = [spread(0, 1), spread(4, 1), spread(8, 1), spread(12, 1)];

/// The 32 bytes of `t` as a vector.
#[inline(always)]
unsafe fn load32(t: &[u8; 32]) -> __m256i {
    _mm256_loadu_si256(t.as_ptr() as *const __m256i)
}

/// 7-bit sign codes (one per byte, top bit clear) with their eighth sign set where the
/// count of the seven is odd ([`iquants::signs_of`]): a nibble's parity from a table, for
/// both nibbles.
#[inline(always)]
unsafe fn with_parity(codes: __m256i) -> __m256i {
    const ODD: i8 = -128;
    let table = _mm256_setr_epi8(
        0, ODD, ODD, 0, ODD, 0, 0, ODD, ODD, 0, 0, ODD, 0, ODD, ODD, 0, 0, ODD, ODD, 0, ODD, 0, 0,
        ODD, ODD, 0, 0, ODD, 0, ODD, ODD, 0,
    );
    let nib = _mm256_set1_epi8(0x0F);
    let lo = _mm256_shuffle_epi8(table, _mm256_and_si256(codes, nib));
    let hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16::<4>(codes), nib));
    _mm256_or_si256(codes, _mm256_xor_si256(lo, hi))
}

/// `2 s + 1` for the 4-bit scale fields `s` in the 32-bit lanes, in both 16-bit halves of
/// each lane: the form a 16-bit multiply-add takes per pair.
#[inline(always)]
unsafe fn odd_scales(s: __m256i) -> __m256i {
    let v = _mm256_or_si256(_mm256_slli_epi32::<1>(s), _mm256_set1_epi32(1));
    _mm256_or_si256(v, _mm256_slli_epi32::<16>(v))
}

/// Both 128-bit lanes of `v`, each copied into both lanes of a vector (the in-lane shuffles
/// that spread sign bytes then reach either).
#[inline(always)]
unsafe fn lanes_apart(v: __m256i) -> [__m256i; 2] {
    [
        _mm256_permute2x128_si256::<0x00>(v, v),
        _mm256_permute2x128_si256::<0x11>(v, v),
    ]
}

/// `2 s + 1` for the 4-bit fields `s` at bits `4 i` of each 32-bit lane `i` of `v`.
#[inline(always)]
unsafe fn odd_nibbles(v: __m256i) -> __m256i {
    let s = _mm256_and_si256(
        _mm256_srlv_epi32(v, _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
        _mm256_set1_epi32(15),
    );
    odd_scales(s)
}

/// The 32-bit lane `i` of `v` in every lane.
#[inline(always)]
unsafe fn lane(v: __m256i, i: usize) -> __m256i {
    _mm256_permutevar8x32_epi32(v, _mm256_set1_epi32(i as i32))
}

/// Four eight-value points of `grid` as one vector, point `l` from index `idx(l)`.
#[inline(always)]
unsafe fn points8(grid: &[u64], idx: impl Fn(usize) -> usize) -> __m256i {
    let grid = grid.as_ptr();
    let p = |l: usize| grid.add(idx(l)).read_volatile() as i64;
    _mm256_set_epi64x(p(3), p(2), p(1), p(0))
}

/// Eight four-value points of `grid` as one vector, point `l` from index `idx(l)` (scalar
/// loads: a gather of eight runs slower on AMD's cores).
#[inline(always)]
unsafe fn points4(grid: &[u32], idx: impl Fn(usize) -> usize) -> __m256i {
    let grid = grid.as_ptr();
    let p = |l: usize| grid.add(idx(l)).read_volatile() as i32;
    _mm256_setr_epi32(p(0), p(1), p(2), p(3), p(4), p(5), p(6), p(7))
}

/// Byte `at` of the block at `b`, read where the code says (a volatile read, which LLVM
/// keeps in order with [`pin`]).
#[inline(always)]
unsafe fn byte(b: *const u8, at: usize) -> usize {
    b.add(at).read_volatile() as usize
}

/// The little-endian 16-bit word at byte `at` of the block at `b`, read as [`byte`] reads
/// (one volatile read of two bytes: it need not be aligned).
#[inline(always)]
unsafe fn word(b: *const u8, at: usize) -> usize {
    u16::from_le_bytes((b.add(at) as *const [u8; 2]).read_volatile()) as usize
}

/// The sign codes and scales of a block's eight coded 32-bit words (IQ2_XXS, IQ3_XXS), each
/// a group's four 7-bit codes under a 4-bit scale on top, as [`coded_words`] reads them:
/// the codes as sign bytes, the words of lane `h` in both 128-bit lanes of `signs[h]`, byte
/// `4 l + i % 4` the sign byte of code `l` of word `i`; word `i`'s odd scale in both 16-bit
/// halves of `scales[i]`.
#[derive(Clone, Copy)]
pub struct CodedWords {
    signs: [__m256i; 2],
    scales: [i32; 8],
}

/// [`CodedWords`] of the eight words in the 32-bit lanes of `aux`.
#[inline(always)]
unsafe fn coded_words(aux: __m256i) -> CodedWords {
    let m7 = _mm256_set1_epi32(127);
    let c0 = _mm256_and_si256(aux, m7);
    let c1 = _mm256_and_si256(_mm256_srli_epi32::<7>(aux), m7);
    let c2 = _mm256_and_si256(_mm256_srli_epi32::<14>(aux), m7);
    let c3 = _mm256_and_si256(_mm256_srli_epi32::<21>(aux), m7);
    let codes = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
    let signs = with_parity(codes);
    let s = _mm256_srli_epi32::<28>(aux);
    CodedWords {
        signs: lanes_apart(signs),
        scales: {
            let mut t = [0i32; 8];
            _mm256_storeu_si256(t.as_mut_ptr() as *mut __m256i, odd_scales(s));
            t
        },
    }
}

impl CodedWords {
    /// The minus mask and scales of the group in word `i`.
    #[inline(always)]
    unsafe fn group(&self, i: usize) -> (__m256i, __m256i) {
        let spread = _mm256_shuffle_epi8(self.signs[i / 4], load32(&SPREAD_WORD[i % 4]));
        (minus_of(spread), _mm256_set1_epi32(self.scales[i]))
    }
}

impl Grid for iquants::Iq2Xxs {
    type Block = CodedWords;
    #[inline(always)]
    unsafe fn read_block(b: *const u8) -> CodedWords {
        // per group two words: four index bytes, then the coded word
        let lo = _mm256_castsi256_ps(_mm256_loadu_si256(b.add(2) as *const __m256i));
        let hi = _mm256_castsi256_ps(_mm256_loadu_si256(b.add(34) as *const __m256i));
        // odd words: groups 0, 1, 4, 5 in the low lane, 2, 3, 6, 7 in the high one
        coded_words(_mm256_castps_si256(_mm256_shuffle_ps::<0xDD>(lo, hi)))
    }
    #[inline(always)]
    unsafe fn read_group(b: *const u8, k: &CodedWords, g: usize) -> Group {
        const WORD: [usize; 8] = [0, 1, 4, 5, 2, 3, 6, 7];
        let (minus, scales) = k.group(WORD[g]);
        Group {
            mags: points8(&IQ2XXS_GRID, |l| byte(b, 2 + 8 * g + l)),
            minus,
            scales,
        }
    }
}

impl Grid for iquants::Iq3Xxs {
    type Block = CodedWords;
    #[inline(always)]
    unsafe fn read_block(b: *const u8) -> CodedWords {
        coded_words(_mm256_loadu_si256(b.add(66) as *const __m256i))
    }
    #[inline(always)]
    unsafe fn read_group(b: *const u8, k: &CodedWords, g: usize) -> Group {
        let (minus, scales) = k.group(g);
        Group {
            mags: points4(&IQ3XXS_GRID, |l| byte(b, 2 + 8 * g + l)),
            minus,
            scales,
        }
    }
}

/// IQ2_XS's block: its 32 sign codes as sign bytes (group `g`'s four at byte offset
/// `4 (g % 2) + 8 (g / 4)` of lane `g / 2 % 2`, in both lanes of `signs[g / 2 % 2]`), and the
/// odd scales of each group's halves (lane `g` of `low` and of `high`).
#[derive(Clone, Copy)]
pub struct XsBlock {
    signs: [__m256i; 2],
    low: __m256i,
    high: __m256i,
}

/// The odd scales of two 4-bit fields per byte (IQ2_XS, IQ2_S): of the eight bytes at `p`,
/// the low fields' and the high fields', byte `g` in 32-bit lane `g`.
#[inline(always)]
unsafe fn half_scales(p: *const u8) -> (__m256i, __m256i) {
    let v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
    (
        odd_scales(_mm256_and_si256(v, _mm256_set1_epi32(15))),
        odd_scales(_mm256_srli_epi32::<4>(v)),
    )
}

/// Group `g`'s scales from [`half_scales`]: values 0-15 by the low field, 16-31 by the high.
#[inline(always)]
unsafe fn halves(low: __m256i, high: __m256i, g: usize) -> __m256i {
    _mm256_blend_epi32::<0xF0>(lane(low, g), lane(high, g))
}

impl Grid for iquants::Iq2Xs {
    type Block = XsBlock;
    #[inline(always)]
    unsafe fn read_block(b: *const u8) -> XsBlock {
        let lo = _mm256_loadu_si256(b.add(2) as *const __m256i);
        let hi = _mm256_loadu_si256(b.add(34) as *const __m256i);
        // each word's top seven bits; words 0-7 and 16-23 in the low lane, 8-15 and 24-31
        // in the high one
        let codes = _mm256_packus_epi16(_mm256_srli_epi16::<9>(lo), _mm256_srli_epi16::<9>(hi));
        let signs = with_parity(codes);
        let (low, high) = half_scales(b.add(66));
        XsBlock {
            signs: lanes_apart(signs),
            low,
            high,
        }
    }
    #[inline(always)]
    unsafe fn read_group(b: *const u8, k: &XsBlock, g: usize) -> Group {
        let run = g % 2 + 2 * (g / 4);
        let spread = _mm256_shuffle_epi8(k.signs[g / 2 % 2], load32(&SPREAD_RUN[run]));
        // the group's four words in one read
        let q = (b.add(2 + 8 * g) as *const u64).read_unaligned() as usize;
        Group {
            mags: points8(&IQ2XS_GRID, |l| (q >> (16 * l)) & 511),
            minus: minus_of(spread),
            scales: halves(k.low, k.high, g),
        }
    }
}

/// IQ2_S's and IQ3_S's block: the odd scales of its groups (IQ3_S: lane `g` of `low`) or of
/// their halves (IQ2_S: lane `g` of `low` and of `high`).
#[derive(Clone, Copy)]
pub struct Scales {
    low: __m256i,
    high: __m256i,
}

/// The mask of negative values of the four explicit sign bytes at `p`.
#[inline(always)]
unsafe fn sign_bytes(p: *const u8) -> __m256i {
    let s = _mm256_set1_epi32((p as *const i32).read_unaligned());
    minus_of(_mm256_shuffle_epi8(s, load32(&SPREAD_RUN[0])))
}

impl Grid for iquants::Iq2S {
    type Block = Scales;
    #[inline(always)]
    unsafe fn read_block(b: *const u8) -> Scales {
        let (low, high) = half_scales(b.add(74));
        Scales { low, high }
    }
    #[inline(always)]
    unsafe fn read_group(b: *const u8, k: &Scales, g: usize) -> Group {
        let top = byte(b, 66 + g);
        Group {
            mags: points8(&IQ2S_GRID, |l| {
                byte(b, 2 + 4 * g + l) | ((top << (8 - 2 * l)) & 0x300)
            }),
            minus: sign_bytes(b.add(34 + 4 * g)),
            scales: halves(k.low, k.high, g),
        }
    }
}

impl Grid for iquants::Iq3S {
    type Block = Scales;
    #[inline(always)]
    unsafe fn read_block(b: *const u8) -> Scales {
        let low = odd_nibbles(_mm256_set1_epi32(
            (b.add(106) as *const i32).read_unaligned(),
        ));
        Scales { low, high: low }
    }
    #[inline(always)]
    unsafe fn read_group(b: *const u8, k: &Scales, g: usize) -> Group {
        // index `l`'s ninth bit is bit `l` of the group's byte
        let top = byte(b, 66 + g);
        Group {
            mags: points4(&IQ3S_GRID, |l| {
                byte(b, 2 + 8 * g + l) | ((top << (8 - l)) & 256)
            }),
            minus: sign_bytes(b.add(74 + 4 * g)),
            scales: lane(k.low, g),
        }
    }
}

/// IQ1's points in eighths, signed (the shift's sign picks the table): their magnitudes
/// and signs apart.
#[inline(always)]
unsafe fn eighths(idx: impl Fn(usize) -> usize) -> (__m256i, __m256i) {
    let v = points8(IQ1_EIGHTHS.as_flattened(), idx);
    (
        _mm256_abs_epi8(v),
        _mm256_cmpgt_epi8(_mm256_setzero_si256(), v),
    )
}

impl Grid for iquants::Iq1S {
    type Block = ();
    #[inline(always)]
    unsafe fn read_block(_: *const u8) {}
    #[inline(always)]
    unsafe fn read_group(b: *const u8, _: &(), g: usize) -> Group {
        let qh = word(b, 34 + 2 * g);
        // the shift's sign, then each point's three more index bits
        let table = (qh >> 15) << 11;
        let (mags, minus) =
            eighths(|l| table | byte(b, 2 + 4 * g + l) | ((qh >> (3 * l)) & 7) << 8);
        Group {
            mags,
            minus,
            scales: _mm256_set1_epi16(2 * ((qh >> 12) & 7) as i16 + 1),
        }
    }
}

impl Grid for iquants::Iq1M {
    type Block = ();
    #[inline(always)]
    unsafe fn read_block(_: *const u8) {}
    #[inline(always)]
    unsafe fn read_group(b: *const u8, _: &(), g: usize) -> Group {
        let s = word(b, 48 + 2 * (g / 2)) >> (6 * (g % 2));
        let h = [byte(b, 32 + 2 * g), byte(b, 33 + 2 * g)];
        // per point three more index bits and the shift's sign, from a nibble of `h`
        let (mags, minus) = eighths(|l| {
            let n = h[l / 2] >> (4 * (l % 2));
            ((n & 8) << 8) | byte(b, 4 * g + l) | (n & 7) << 8
        });
        Group {
            mags,
            minus,
            scales: _mm256_set_m128i(
                _mm_set1_epi16(2 * ((s >> 3) & 7) as i16 + 1),
                _mm_set1_epi16(2 * (s & 7) as i16 + 1),
            ),
        }
    }
}

/// Group `g` of the block at `b` times each activation row, added to the row's sums.
///
/// # Safety
/// As [`Grid::read_group`]; each row holds the block's activations.
#[inline(always)]
unsafe fn add_group<L: Grid, const N: usize>(
    b: *const u8,
    shared: &L::Block,
    g: usize,
    rows: &[&BlockQ8K; N],
    sums: &mut [__m256i; N],
) {
    let group = L::read_group(b, shared, g);
    for j in 0..N {
        let q = _mm256_loadu_si256(rows[j].qs.as_ptr().add(32 * g) as *const __m256i);
        let q = _mm256_sub_epi8(_mm256_xor_si256(q, group.minus), group.minus);
        let pairs = _mm256_maddubs_epi16(group.mags, q);
        sums[j] = _mm256_add_epi32(sums[j], _mm256_madd_epi16(pairs, group.scales));
        pin(&mut sums[j]);
    }
}

/// Marks `v` as computed here: an `asm!` that takes it in a register and that LLVM keeps in
/// order with the grid's volatile loads, so a group's products are made before the next
/// group's loads. Left to itself, LLVM makes all eight groups' loads first, runs out of
/// registers, keeps them on the stack and runs slower so.
#[inline]
#[target_feature(enable = "avx")]
unsafe fn pin(v: &mut __m256i) {
    core::arch::asm!(
        "/* {0} */",
        inout(ymm_reg) * v,
        options(nomem, nostack, preserves_flags)
    );
}

/// Kernels for one x86 feature level.
macro_rules! grid_kernels {
    ($name:ident, $features:literal) => {
        /// The grid kernels compiled for one feature level.
        pub mod $name {
            use super::*;

            /// A grid i-quant ([`Grid`]) · Q8K, `N` activation rows. One row (decode) asks
            /// for the weights ahead, as the tiled kernels do.
            ///
            /// # Safety
            /// The CPU has the features; each activation row holds a block per block of `w`.
            #[target_feature(enable = $features)]
            pub unsafe fn grid<L: Grid, const N: usize>(w: &[u8], a: [&[BlockQ8K]; N]) -> [f32; N] {
                let mut acc = [_mm256_setzero_ps(); N];
                let bb = L::TYPE.block_bytes();
                let pf = Prefetch::for_rows(N);
                for (i, block) in w.chunks_exact(bb).enumerate() {
                    let b = block.as_ptr();
                    if N == 1 {
                        prefetch_block(b, bb, pf);
                    }
                    let rows: [&BlockQ8K; N] = core::array::from_fn(|j| a[j].get_unchecked(i));
                    let shared = L::read_block(b);
                    let mut sums = [_mm256_setzero_si256(); N];
                    // the groups written out, so that their offsets and tables are constants
                    add_group::<L, N>(b, &shared, 0, &rows, &mut sums);
                    add_group::<L, N>(b, &shared, 1, &rows, &mut sums);
                    add_group::<L, N>(b, &shared, 2, &rows, &mut sums);
                    add_group::<L, N>(b, &shared, 3, &rows, &mut sums);
                    add_group::<L, N>(b, &shared, 4, &rows, &mut sums);
                    add_group::<L, N>(b, &shared, 5, &rows, &mut sums);
                    add_group::<L, N>(b, &shared, 6, &rows, &mut sums);
                    add_group::<L, N>(b, &shared, 7, &rows, &mut sums);
                    let unit = L::FACTOR * L::d(block);
                    for j in 0..N {
                        let d = _mm256_set1_ps(unit * rows[j].d);
                        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[j]), d, acc[j]);
                    }
                }
                core::array::from_fn(|j| hsum_ps(acc[j]))
            }

            by_type! {
                $features;
                iq1s: iquants::Iq1S;
                iq1m: iquants::Iq1M;
                iq2xxs: iquants::Iq2Xxs;
                iq2xs: iquants::Iq2Xs;
                iq2s: iquants::Iq2S;
                iq3xxs: iquants::Iq3Xxs;
                iq3s: iquants::Iq3S;
            }
        }
    };
}

/// One kernel per type (inside `grid_kernels!`, so each has the level's features): [`grid`]
/// with the type's reader, under the name `pick_sixteen!` takes.
macro_rules! by_type {
    ($features:literal; $($f:ident: $l:ty;)*) => {$(
        /// The type's `grid` kernel.
        ///
        /// # Safety
        /// As `grid`.
        #[target_feature(enable = $features)]
        pub unsafe fn $f<const N: usize>(w: &[u8], a: [&[BlockQ8K]; N]) -> [f32; N] {
            grid::<$l, N>(w, a)
        }
    )*};
}

grid_kernels!(avx2, "avx2,fma,f16c");
grid_kernels!(avx512vnni, "avx2,fma,f16c,avx512vl,avx512vnni");
