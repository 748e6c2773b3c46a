//! x86-64 kernels over the tiled layout of [`super::tiled`]: eight weight rows against `N`
//! activation rows per call, one block column at a time. Each 32-byte code vector holds four
//! codes of each of the eight rows; it meets four activations broadcast to every lane, so
//! lane `r` accumulates row `r`'s dot product with no horizontal reduction. Codes are
//! unsigned (nibbles, 5-bit values, or Q8_0 shifted by 128 under VNNI); the offset is taken
//! back exactly with the activation block's integer sum. IQ4_NL's and MXFP4's nibbles are
//! looked up in their grid of sixteen signed values and from there go the way of Q8_0's
//! codes (IQ4_XS's too, with a scale per 32-value sub-block). Written once, compiled for
//! AVX2 and for AVX-512 VNNI (+BW, whose byte masks set the 5th bits in one instruction);
//! Q2_K and Q3_K for AVX2 only ([`k23_avx2`]: at AVX-512 they run in `x86_wide`).
//! Callers must have checked the CPU features and that every activation row has a block per
//! block column of the tile row.

#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;

use super::each_tile;
use super::formats::{BlockQ8, BlockQ8K, IQ4_VALUES, MXFP4_VALUES};
use super::prefetch::Prefetch;
use super::tiled::kinds::{
    block_bytes, has_high_bit, has_min, is_grid, offsets, IQ4_NL, MXFP4, Q4_0, Q5_0, Q8_0,
};
use super::tiled::{k_offsets, TILE_ROWS};

/// Asks for `lines` cache lines from `dist + 64 * lines * part` bytes past `t` into L1, and
/// for as many from `l2` bytes instead of `dist` into L2 where `l2` is not 0.
#[inline]
#[target_feature(enable = "sse")]
unsafe fn prefetch_lines(t: *const u8, dist: usize, l2: usize, lines: usize, part: usize) {
    let from = t.wrapping_add(dist + 64 * lines * part);
    for l in 0..lines {
        _mm_prefetch::<_MM_HINT_T0>(from.wrapping_add(64 * l) as *const i8);
    }
    if l2 != 0 {
        let from = t.wrapping_add(l2 + 64 * lines * part);
        for l in 0..lines {
            _mm_prefetch::<_MM_HINT_T1>(from.wrapping_add(64 * l) as *const i8);
        }
    }
}

/// Quarter `part` (0..4) of the lines `pf.k` bytes past the `len`-byte block at `t`: the
/// K-quant kernels (blocks of 672 to 1680 bytes, 11 to 27 lines) spread their prefetches
/// over the block's work, a few lines at a time. Asked for all at once, a
/// Q6_K block's 27 lines are more misses than the core keeps in flight, the last ones are
/// dropped, and the loop stalls on them (at the first loads of each block's codes). A
/// quarter is a whole number of lines (`len` is a constant, so the loop unrolls); the last
/// may reach a line or two into the block after, which is read next anyway.
#[inline]
#[target_feature(enable = "sse")]
pub(super) unsafe fn prefetch_quarter(t: *const u8, len: usize, part: usize, pf: Prefetch) {
    prefetch_lines(t, pf.k, pf.l2, len.div_ceil(4 * 64), part);
}

/// Half `half` (0 or 1) of [`prefetch_quarter`]'s lines: the first half of them, or the
/// rest. The Q4_K and Q5_K kernels ask for the first half before they read a quarter's
/// codes and the rest between its two sub-blocks' products, so the requests are spread
/// over the quarter's work instead of leaving together. The Q6_K kernel gains nothing from
/// the same spread over its four groups of code vectors, so it asks for a quarter at once.
#[inline]
#[target_feature(enable = "sse")]
unsafe fn prefetch_quarter_half(t: *const u8, len: usize, part: usize, half: usize, pf: Prefetch) {
    let lines = len.div_ceil(4 * 64);
    let (first, count) = if half == 0 {
        (0, lines / 2)
    } else {
        (lines / 2, lines - lines / 2)
    };
    prefetch_lines(
        t.wrapping_add(64 * (lines * part + first)),
        pf.k,
        pf.l2,
        count,
        0,
    );
}

/// Asks for the cache lines `pf.block` bytes past the `len`-byte block at `t` (and `pf.l2`
/// past it into L2): the kernels read one long stream, and the hardware prefetcher alone
/// loses pace at page boundaries. A prefetch never faults, even past the end.
#[inline]
#[target_feature(enable = "sse")]
pub(super) unsafe fn prefetch_block(t: *const u8, len: usize, pf: Prefetch) {
    prefetch_lines(t, pf.block, pf.l2, len.div_ceil(64), 0);
}

/// VNNI: `acc + sums of four u8 x i8 products` in one instruction, exact.
#[inline]
#[target_feature(enable = "avx2,avx512vl,avx512vnni")]
unsafe fn dot_vnni(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(acc, u, s)
}

/// `p`, through an empty `asm!` LLVM cannot see through. [`run_dot`]'s activation pointer
/// goes through it so that LLVM keeps it as a base register of its own: left to itself, it
/// folds it and the weight pointer into one shared index, and the 32-value loops run slower
/// so (see there). The K-quant loops run slower with their activation pointers through it,
/// so they do without.
#[inline(always)]
fn opaque<T>(p: *const T) -> *const T {
    let mut addr = p as usize;
    // SAFETY: the empty template reads and writes only `addr`'s register.
    unsafe {
        core::arch::asm!("/* {0} */", inout(reg) addr, options(pure, nomem, nostack, preserves_flags))
    };
    addr as *const T
}

/// The low nibbles (vectors 0-3) and high nibbles (4-7) of the four quant vectors at `qs`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn nibbles(qs: *const u8) -> [__m256i; 8] {
    let m4 = _mm256_set1_epi8(0x0F);
    let mut q = [_mm256_setzero_si256(); 8];
    for g in 0..4 {
        let v = _mm256_loadu_si256(qs.add(32 * g) as *const __m256i);
        q[g] = _mm256_and_si256(v, m4);
        q[g + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    }
    q
}

/// The values of nibble codes `q` on the grid of `KIND` (IQ4_NL or MXFP4), signed: one
/// `vpshufb` per code vector looks up all 32 codes in the 16-byte table.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn grid_values<const KIND: u8>(q: [__m256i; 8]) -> [__m256i; 8] {
    let values = if KIND == MXFP4 {
        &MXFP4_VALUES
    } else {
        &IQ4_VALUES
    };
    let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(values.as_ptr() as *const __m128i));
    q.map(|v| _mm256_shuffle_epi8(table, v))
}

/// Eight MXFP4 scale bytes (E8M0, one per row) at `p` as f32 halves, `2^(e - 128)`, the
/// way [`super::formats::e8m0_half`] computes them: the exponent field `e - 1` where that
/// is normal (`e >= 2`), else the subnormal `2^21 << e`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn e8m0_halves(p: *const u8) -> __m256 {
    let e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
    let normal = _mm256_slli_epi32::<23>(_mm256_sub_epi32(e, _mm256_set1_epi32(1)));
    let subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x0020_0000), e);
    let small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    _mm256_castsi256_ps(_mm256_blendv_epi8(normal, subnormal, small))
}

/// AVX2: the eight vectors of 5-bit codes of a Q5_0/Q5_1 tile block whose quant bytes are
/// at `qs` and top bits at `top` ([`super::tiled::HighBits::Whole`]). Vector `m + 4`'s low
/// bits are masked before the 16-bit shift, so nothing crosses from the neighbouring byte;
/// its top bits are masked after theirs, so what crosses lands outside bits 3-4.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn codes5_avx2(qs: *const u8, top: *const u8) -> [__m256i; 8] {
    let h = _mm256_loadu_si256(top as *const __m256i);
    let at3 = [
        _mm256_slli_epi16::<3>(h),
        _mm256_slli_epi16::<1>(h),
        _mm256_srli_epi16::<1>(h),
        _mm256_srli_epi16::<3>(h),
    ];
    let (low5, high3, top2) = (
        _mm256_set1_epi8(0x1F),
        _mm256_set1_epi8(0xE0u8 as i8),
        _mm256_set1_epi8(0x18),
    );
    let mut q = [_mm256_setzero_si256(); 8];
    for (m, hm) in at3.into_iter().enumerate() {
        let v = _mm256_loadu_si256(qs.add(32 * m) as *const __m256i);
        q[m] = _mm256_and_si256(v, low5);
        q[m + 4] = _mm256_or_si256(
            _mm256_srli_epi16::<5>(_mm256_and_si256(v, high3)),
            _mm256_and_si256(hm, top2),
        );
    }
    q
}

/// AVX-512 BW: the same from nibbles and the fifth-bit masks at `masks`
/// ([`super::tiled::HighBits::Masks`]), each a byte-mask register: a zero-masked move
/// makes each code's 16, and one ternary-logic op takes the nibble and adds that bit. Two
/// vector instructions per code vector where a masked add of the nibbles takes three (LLVM
/// emits `_mm256_mask_add_epi8` as an `or` and a masked move after the `and`). The same
/// codes bit for bit.
#[inline]
#[target_feature(enable = "avx2,avx512vl,avx512bw")]
unsafe fn codes5_bw(qs: *const u8, masks: *const u8) -> [__m256i; 8] {
    let (m4, c16) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x10));
    let mut q = [_mm256_setzero_si256(); 8];
    for g in 0..4 {
        let v = _mm256_loadu_si256(qs.add(32 * g) as *const __m256i);
        let fifth = |k: usize| {
            _mm256_maskz_mov_epi8((masks.add(4 * k) as *const u32).read_unaligned(), c16)
        };
        // (nibble & 0x0F) | fifth bit: table 0xEC is `(a & c) | b`
        q[g] = _mm256_ternarylogic_epi32::<0xEC>(v, fifth(g), m4);
        q[g + 4] = _mm256_ternarylogic_epi32::<0xEC>(_mm256_srli_epi16(v, 4), fifth(g + 4), m4);
    }
    q
}

/// Q6_K code vectors `k` = 0..4 of group `(n, g)` of the tile block at `t` (values
/// `128 n + 32 k + 4 g .. + 4` of each row), from codes kept whole
/// ([`super::tiled::HighBits::Whole`], both x86 levels): codes 0-2 are one `and` each; code
/// 3's three pieces sit in bits 6-7 of the three vectors, and each is masked before the
/// 16-bit shifts that gather them, so nothing crosses between bytes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q6_codes_whole(t: *const u8, n: usize, g: usize) -> [__m256i; 4] {
    use k_offsets::*;
    let (low6, top2) = (_mm256_set1_epi8(0x3F), _mm256_set1_epi8(0xC0u8 as i8));
    let ld = |at: usize| _mm256_loadu_si256(t.add(at) as *const __m256i);
    let a = [
        ld(QL6 + 512 * n + 32 * g),
        ld(QL6 + 512 * n + 256 + 32 * g),
        ld(QH6 + 256 * n + 32 * g),
    ];
    let mut c3 = _mm256_and_si256(a[2], top2);
    c3 = _mm256_or_si256(_mm256_srli_epi16(c3, 2), _mm256_and_si256(a[1], top2));
    c3 = _mm256_or_si256(_mm256_srli_epi16(c3, 2), _mm256_and_si256(a[0], top2));
    [
        _mm256_and_si256(a[0], low6),
        _mm256_and_si256(a[1], low6),
        _mm256_and_si256(a[2], low6),
        _mm256_srli_epi16(c3, 2),
    ]
}

/// AVX2 has no exact u8 x i8 product for signed Q8_0 codes: keep them signed and move the
/// sign onto the activation.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q8_prep_avx2(q: __m256i) -> __m256i {
    q
}

/// The (unsigned, signed) operands of a Q8_0 code vector and its activations.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q8_pair_avx2(q: __m256i, y: __m256i) -> (__m256i, __m256i) {
    (_mm256_sign_epi8(q, q), _mm256_sign_epi8(y, q))
}

/// VNNI: shift Q8_0 codes to unsigned (`q + 128`); the kernel subtracts `128 * sum(y)`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q8_prep_vnni(q: __m256i) -> __m256i {
    _mm256_xor_si256(q, _mm256_set1_epi8(0x80u8 as i8))
}

#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q8_pair_vnni(q: __m256i, y: __m256i) -> (__m256i, __m256i) {
    (q, y)
}

/// Sum over `k` of the u8 x i8 dot products of `u[k]` and `s[k]` in each 32-bit lane,
/// with `w` as the weight of each 16-bit pair sum (ones for a plain sum, a row's scale in
/// both halves of its lane for a scaled one). `vpmaddubsw` gives 16-bit pair sums and
/// `vpmaddwd` widens them. On an AVX2 core these kernels are bound by their count of vector
/// instructions (llvm-mca for Zen 3: all four vector pipes busy), so the pair sums of `G`
/// vectors are first added in 16 bits and widened once, and a scale rides on that widening.
/// Exact while `G` times the largest pair sum stays below 2^15: activations lie within
/// +-127 and a pair sum within 254 times the largest code, so 4-bit codes take `G` = 8,
/// 5-bit 4, 6-bit 2, and the sign-moved Q8_0 codes 1.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn widened<const K: usize, const G: usize>(
    seed: __m256i,
    u: &[__m256i; K],
    s: &[__m256i; K],
    w: __m256i,
) -> __m256i {
    let mut acc = seed;
    for c in 0..K / G {
        let mut p = _mm256_maddubs_epi16(u[c * G], s[c * G]);
        for g in 1..G {
            p = _mm256_add_epi16(p, _mm256_maddubs_epi16(u[c * G + g], s[c * G + g]));
        }
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, w));
    }
    acc
}

/// AVX2: `seed + sum_k dot(u[k], s[k])` per 32-bit lane (see [`widened`] for `G`).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn dots_avx2<const K: usize, const G: usize>(
    seed: __m256i,
    u: &[__m256i; K],
    s: &[__m256i; K],
) -> __m256i {
    widened::<K, G>(seed, u, s, _mm256_set1_epi16(1))
}

/// AVX2: `f + scale * sum_k dot(u[k], s[k])` per lane, the scale applied in the widening
/// multiply-add (`si`: each row's scale in both 16-bit halves of its lane, from
/// [`scales_avx2`]); exact in i32 and in the conversion (below 2^24 for every K-quant).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn scaled_avx2<const K: usize, const G: usize>(
    f: __m256,
    u: &[__m256i; K],
    s: &[__m256i; K],
    _sf: __m256,
    si: __m256i,
) -> __m256 {
    let zero = _mm256_setzero_si256();
    _mm256_add_ps(f, _mm256_cvtepi32_ps(widened::<K, G>(zero, u, s, si)))
}

/// Eight per-row scales (i32 lanes) as [`scaled_avx2`] wants them.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn scales_avx2(x: __m256i) -> __m256i {
    _mm256_or_si256(
        _mm256_and_si256(x, _mm256_set1_epi32(0xFFFF)),
        _mm256_slli_epi32(x, 16),
    )
}

/// VNNI: `seed + sum_k dot(u[k], s[k])` in two chains of `vpdpbusd`, the first starting
/// from `seed` (exact; `G` is unused).
#[inline]
#[target_feature(enable = "avx2,avx512vl,avx512vnni")]
unsafe fn dots_vnni<const K: usize, const G: usize>(
    seed: __m256i,
    u: &[__m256i; K],
    s: &[__m256i; K],
) -> __m256i {
    let mut pp = [seed, _mm256_setzero_si256()];
    for k in 0..K {
        pp[k & 1] = dot_vnni(pp[k & 1], u[k], s[k]);
    }
    _mm256_add_epi32(pp[0], pp[1])
}

/// VNNI: `f + sf * sum_k dot(u[k], s[k])`, the scale applied in f32.
#[inline]
#[target_feature(enable = "avx2,fma,avx512vl,avx512vnni")]
unsafe fn scaled_vnni<const K: usize, const G: usize>(
    f: __m256,
    u: &[__m256i; K],
    s: &[__m256i; K],
    sf: __m256,
    _si: __m256i,
) -> __m256 {
    let zero = _mm256_setzero_si256();
    _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots_vnni::<K, G>(zero, u, s)), sf, f)
}

/// VNNI needs no integer form of the scales.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn scales_vnni(x: __m256i) -> __m256i {
    x
}

/// `vpshufb` indices of lane 0 that copy its low 16-bit half (bytes 0, 1) into both halves.
const DUP_LOW16: i32 = 0x0100_0100;
/// The same for the high half (bytes 2, 3).
const DUP_HIGH16: i32 = 0x0302_0302;

/// `w`'s low (`HIGH` false) or high 16-bit half of each 32-bit lane in both halves (the
/// indices of lane `i` are lane 0's plus `4 i`, within each 128-bit half).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn dup16<const HIGH: bool>(w: __m256i) -> __m256i {
    let base = if HIGH { DUP_HIGH16 } else { DUP_LOW16 };
    let step = 0x0404_0404;
    let idx = _mm256_setr_epi32(
        base,
        base + step,
        base + 2 * step,
        base + 3 * step,
        base,
        base + step,
        base + 2 * step,
        base + 3 * step,
    );
    _mm256_shuffle_epi8(w, idx)
}

/// `acc` plus, per row (32-bit lane), `wa * sum_{g<4} dot(u[g], s[g]) + wb *
/// sum_{g>=4} dot(u[g], s[g])`, `wa` and `wb` being the low and high 16-bit halves of the
/// row's lane of `w`: two 16-value sub-blocks (four code vectors each) and their scales.
/// Each sub-block's pair sums are added in 16 bits and widened by the multiply-add that
/// applies its scale; exact while the codes stay below 16 (four pair sums of codes up to 15
/// against +-127 are within 2^15).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn pair_avx2(acc: __m256i, u: &[__m256i; 8], s: &[__m256i; 8], w: __m256i) -> __m256i {
    let sums = |g0: usize| {
        let mut p = _mm256_maddubs_epi16(u[g0], s[g0]);
        for g in g0 + 1..g0 + 4 {
            p = _mm256_add_epi16(p, _mm256_maddubs_epi16(u[g], s[g]));
        }
        p
    };
    let a = _mm256_madd_epi16(sums(0), dup16::<false>(w));
    let b = _mm256_madd_epi16(sums(4), dup16::<true>(w));
    _mm256_add_epi32(acc, _mm256_add_epi32(a, b))
}

/// AVX2: `acc + madd(x, y)` (16-bit pairs multiplied and added into 32-bit lanes).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn madd_avx2(acc: __m256i, x: __m256i, y: __m256i) -> __m256i {
    _mm256_add_epi32(acc, _mm256_madd_epi16(x, y))
}

/// AVX2: the eight code vectors (0..8) of a Q3_K tile quarter from its three vectors of
/// whole codes at `p` ([`super::tiled::q3k_pack`]). The 16-bit shifts carry bits across
/// bytes; each result is masked after its shift, so only the wanted bits stay.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q3_codes_avx2(p: *const u8) -> [__m256i; 8] {
    let ld = |at: usize| _mm256_loadu_si256(p.add(at) as *const __m256i);
    let (a, b, c) = (ld(0), ld(32), ld(64));
    let (m3, m4, m7) = (
        _mm256_set1_epi8(3),
        _mm256_set1_epi8(4),
        _mm256_set1_epi8(7),
    );
    let and = _mm256_and_si256;
    [
        and(a, m7),
        and(_mm256_srli_epi16::<3>(a), m7),
        and(b, m7),
        and(_mm256_srli_epi16::<3>(b), m7),
        and(c, m7),
        and(_mm256_srli_epi16::<3>(c), m7),
        _mm256_or_si256(
            and(_mm256_srli_epi16::<6>(a), m3),
            and(_mm256_srli_epi16::<4>(c), m4),
        ),
        _mm256_or_si256(
            and(_mm256_srli_epi16::<6>(b), m3),
            and(_mm256_srli_epi16::<5>(c), m4),
        ),
    ]
}

macro_rules! tiled_kernels {
    (
        $name:ident,
        $features:literal,
        $dots:ident,
        $scaled:ident,
        $scales:ident,
        $codes5:ident,
        $q8prep:ident,
        $q8pair:ident,
        $q8off:expr
    ) => {
        /// Tiled kernels for one x86 feature level.
        pub mod $name {
            use super::*;

            /// One tile row (`blocks` tile blocks of type `KIND`) against `N` activation
            /// rows: `out[j][r]` is row `r`'s dot product with activation row `j`.
            ///
            /// # Safety
            /// The CPU has the features; `w` is whole tile blocks of `KIND`; every
            /// activation row has at least as many blocks.
            #[inline]
            #[target_feature(enable = $features)]
            pub unsafe fn tile_dot<const N: usize, const KIND: u8>(
                w: &[u8],
                a: [&[BlockQ8]; N],
            ) -> [[f32; TILE_ROWS]; N] {
                let tb = block_bytes(KIND) * TILE_ROWS;
                let pf = Prefetch::for_rows(N);
                let mut acc = [_mm256_setzero_ps(); N];
                for b in 0..w.len() / tb {
                    let t = w.as_ptr().add(b * tb);
                    if N == 1 {
                        prefetch_block(t, tb, pf);
                    }
                    let q = block_codes::<KIND>(t);
                    for j in 0..N {
                        let y = a[j].get_unchecked(b);
                        let seed = _mm256_set1_epi32(offset_part(KIND, y.sum));
                        let p = block_dot::<KIND>(&q, y, seed);
                        acc[j] = block_acc::<KIND>(acc[j], t, y, p);
                    }
                }
                let mut out = [[0f32; TILE_ROWS]; N];
                for j in 0..N {
                    _mm256_storeu_ps(out[j].as_mut_ptr(), acc[j]);
                }
                out
            }

            /// The eight unsigned code vectors of the `KIND` tile block at `t` (see the
            /// module).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn block_codes<const KIND: u8>(t: *const u8) -> [__m256i; 8] {
                let (_, mask_off, qs_off) = offsets(KIND);
                if KIND == Q8_0 {
                    core::array::from_fn(|k| {
                        $q8prep(_mm256_loadu_si256(t.add(qs_off + 32 * k) as *const __m256i))
                    })
                } else if has_high_bit(KIND) {
                    $codes5(t.add(qs_off), t.add(mask_off))
                } else if is_grid(KIND) {
                    grid_values::<KIND>(nibbles(t.add(qs_off))).map(|v| $q8prep(v))
                } else {
                    nibbles(t.add(qs_off))
                }
            }

            /// `seed` plus each row's integer dot product of codes `q` with activation
            /// block `y`.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn block_dot<const KIND: u8>(
                q: &[__m256i; 8],
                y: &BlockQ8,
                seed: __m256i,
            ) -> __m256i {
                let yp = y.qs.as_ptr() as *const i32;
                let ys: [__m256i; 8] =
                    core::array::from_fn(|k| _mm256_set1_epi32(yp.add(k).read_unaligned()));
                if KIND == Q8_0 || is_grid(KIND) {
                    let mut u = *q;
                    let mut v = ys;
                    for k in 0..8 {
                        (u[k], v[k]) = $q8pair(q[k], ys[k]);
                    }
                    $dots::<8, 1>(seed, &u, &v)
                } else if has_high_bit(KIND) {
                    $dots::<8, 4>(seed, q, &ys)
                } else {
                    $dots::<8, 8>(seed, q, &ys)
                }
            }

            /// `acc` plus the tile block at `t`'s row scales times `y`'s times the integer
            /// dot products `p` (and its row minimums times `y`'s sum, for the types with
            /// one).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn block_acc<const KIND: u8>(
                acc: __m256,
                t: *const u8,
                y: &BlockQ8,
                p: __m256i,
            ) -> __m256 {
                let d = if KIND == MXFP4 {
                    e8m0_halves(t)
                } else {
                    _mm256_cvtph_ps(_mm_loadu_si128(t as *const __m128i))
                };
                let acc = _mm256_fmadd_ps(
                    _mm256_mul_ps(d, _mm256_set1_ps(y.d)),
                    _mm256_cvtepi32_ps(p),
                    acc,
                );
                if has_min(KIND) {
                    let (m_off, _, _) = offsets(KIND);
                    let m = _mm256_cvtph_ps(_mm_loadu_si128(t.add(m_off) as *const __m128i));
                    _mm256_fmadd_ps(m, _mm256_set1_ps(y.s), acc)
                } else {
                    acc
                }
            }

            /// How far above their values `kind`'s codes are stored: Q4_0 8, Q5_0 16, Q8_0
            /// and the grid types' values 128 under VNNI, others 0.
            #[inline]
            const fn code_offset(kind: u8) -> i32 {
                match kind {
                    Q4_0 => 8,
                    Q5_0 => 16,
                    Q8_0 | IQ4_NL | MXFP4 => $q8off,
                    _ => 0,
                }
            }

            /// The code offset's part of the dot product with an activation block whose
            /// codes sum to `sum`: `-offset * sum`, wrapping as the i32 lanes do.
            #[inline]
            fn offset_part(kind: u8, sum: i32) -> i32 {
                code_offset(kind).wrapping_mul(sum).wrapping_neg()
            }

            /// [`tile_dot`] over whole tiles `w` (each `tile_bytes` long) against one
            /// activation row, tile `i`'s eight results to `out[8 i..8 i + 8]`: the decode
            /// product's inner loop. Per call, not per block: the prefetch distances are
            /// read, and each activation block's offset part is computed once for every
            /// tile, then read as one broadcast that starts a `vpdpbusd` chain. The weight
            /// and activation pointers step by their own block sizes, the activation one
            /// through [`opaque`]: left alone, LLVM folds both into one index register, and
            /// the loop runs slower so. With the fifth bits' ternary logic ([`codes5_bw`]),
            /// a Q5_0 tile block is about 58 instructions where masked adds make it about
            /// 72. Even streaming from memory, each instruction of these loops counts, so
            /// the fifth-bit masks are loaded rather than made in registers (which takes
            /// more instructions).
            ///
            /// # Safety
            /// As [`tile_dot`]; `tile_bytes` is a whole number of tile blocks, `out` has
            /// room for eight values per tile.
            #[target_feature(enable = $features)]
            pub unsafe fn run_dot<const KIND: u8>(
                w: &[u8],
                tile_bytes: usize,
                a: &[BlockQ8],
                out: *mut f32,
            ) {
                let blocks = tile_bytes / (block_bytes(KIND) * TILE_ROWS);
                let a = &a[..blocks];
                let pf = Prefetch::current();
                const ON_STACK: usize = 1024;
                let mut stack = [core::mem::MaybeUninit::<i32>::uninit(); ON_STACK];
                let heap: Vec<i32>;
                let parts: &[i32] = if code_offset(KIND) == 0 {
                    &[]
                } else if blocks <= ON_STACK {
                    for (p, y) in stack.iter_mut().zip(a) {
                        p.write(offset_part(KIND, y.sum));
                    }
                    // SAFETY: the first `blocks` entries were written just above.
                    core::slice::from_raw_parts(stack.as_ptr() as *const i32, blocks)
                } else {
                    heap = a.iter().map(|y| offset_part(KIND, y.sum)).collect();
                    &heap
                };
                if pf.l2 != 0 {
                    run_dot_with::<KIND, true>(w, tile_bytes, a, parts, pf, out)
                } else {
                    run_dot_with::<KIND, false>(w, tile_bytes, a, parts, pf, out)
                }
            }

            /// [`run_dot`]'s loop, with the second prefetch into L2 (`L2`, at `pf.l2`) or
            /// without, each activation block's offset part in `parts` (empty for the types
            /// without an offset).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn run_dot_with<const KIND: u8, const L2: bool>(
                w: &[u8],
                tile_bytes: usize,
                a: &[BlockQ8],
                parts: &[i32],
                pf: Prefetch,
                out: *mut f32,
            ) {
                let tb = block_bytes(KIND) * TILE_ROWS;
                let lines = tb.div_ceil(64);
                each_tile(w, tile_bytes, out, |tile| {
                    let mut acc = _mm256_setzero_ps();
                    let (mut t, mut y, mut part) = (tile.as_ptr(), a.as_ptr(), parts.as_ptr());
                    for _ in 0..a.len() {
                        prefetch_lines(t, pf.block, if L2 { pf.l2 } else { 0 }, lines, 0);
                        let q = block_codes::<KIND>(t);
                        let seed = if code_offset(KIND) != 0 {
                            let seed = _mm256_set1_epi32(*part);
                            part = part.add(1);
                            seed
                        } else {
                            _mm256_setzero_si256()
                        };
                        let p = block_dot::<KIND>(&q, &*y, seed);
                        acc = block_acc::<KIND>(acc, t, &*y, p);
                        t = t.add(tb);
                        y = opaque(y.add(1));
                    }
                    let mut o = [0f32; TILE_ROWS];
                    _mm256_storeu_ps(o.as_mut_ptr(), acc);
                    o
                })
            }

            /// Eight bytes at `p` (one per row), widened to eight i32 lanes, unsigned.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn u8x8(p: *const u8) -> __m256i {
                _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i))
            }

            /// Eight bytes at `p` (one per row), widened to eight i32 lanes, signed.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn i8x8(p: *const u8) -> __m256i {
                _mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i))
            }

            /// Two sub-blocks' per-row bytes at `p` (`p[0..8]`, `p[8..16]`) as 16-bit pairs
            /// `(first, second)` per row, for `vpmaddwd` against paired activation sums.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn pairs16(p: *const u8, signed: bool) -> __m256i {
                let a = _mm_loadl_epi64(p as *const __m128i);
                let b = _mm_loadl_epi64(p.add(8) as *const __m128i);
                let ab = _mm_unpacklo_epi8(a, b);
                if signed {
                    _mm256_cvtepi8_epi16(ab)
                } else {
                    _mm256_cvtepu8_epi16(ab)
                }
            }

            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn bcast(p: *const i8, at: usize) -> __m256i {
                _mm256_set1_epi32((p.add(at) as *const i32).read_unaligned())
            }

            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn ld(p: *const u8) -> __m256i {
                _mm256_loadu_si256(p as *const __m256i)
            }

            /// IQ4_XS tile row against `N` activation rows (eight [`BlockQ8`] per
            /// super-block): each 32-value sub-block is an IQ4_NL tile block whose row scales
            /// are the super-block's `d` times the sub-block's signed 6-bit scale.
            ///
            /// # Safety
            /// The CPU has the features; `w` is whole IQ4_XS tile blocks; every activation
            /// row has eight blocks per tile block.
            #[inline]
            #[target_feature(enable = $features)]
            pub unsafe fn tile_iq4xs<const N: usize>(
                w: &[u8],
                a: [&[BlockQ8]; N],
            ) -> [[f32; TILE_ROWS]; N] {
                iq4xs_with::<N>(w, a, Prefetch::for_rows(N))
            }

            /// [`tile_iq4xs`] with the prefetch distances `pf` (used when `N` is 1).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn iq4xs_with<const N: usize>(
                w: &[u8],
                a: [&[BlockQ8]; N],
                pf: Prefetch,
            ) -> [[f32; TILE_ROWS]; N] {
                use k_offsets::{QSX, SCX};
                let tb = QSX + 1024;
                let mut acc = [_mm256_setzero_ps(); N];
                for b in 0..w.len() / tb {
                    let t = w.as_ptr().add(b * tb);
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(t as *const __m128i));
                    for ib in 0..8 {
                        if N == 1 && ib % 2 == 0 {
                            prefetch_quarter(t, tb, ib / 2, pf);
                        }
                        let q = grid_values::<IQ4_NL>(nibbles(t.add(QSX + 128 * ib)))
                            .map(|v| $q8prep(v));
                        // the rows' `d` times the sub-block scales, once for every activation
                        // row (each scale times `d` is exact in f32: a 6-bit integer times an
                        // f16)
                        let sd = _mm256_mul_ps(d, _mm256_cvtepi32_ps(i8x8(t.add(SCX + 8 * ib))));
                        for j in 0..N {
                            let y = a[j].get_unchecked(8 * b + ib);
                            let seed = _mm256_set1_epi32(offset_part(IQ4_NL, y.sum));
                            let p = block_dot::<IQ4_NL>(&q, y, seed);
                            acc[j] = _mm256_fmadd_ps(
                                _mm256_mul_ps(sd, _mm256_set1_ps(y.d)),
                                _mm256_cvtepi32_ps(p),
                                acc[j],
                            );
                        }
                    }
                }
                let mut out = [[0f32; TILE_ROWS]; N];
                for j in 0..N {
                    _mm256_storeu_ps(out[j].as_mut_ptr(), acc[j]);
                }
                out
            }

            /// [`tile_iq4xs`] on two tiles, one after the other: the pair form the batched
            /// drive takes, so that AVX2 decodes each sub-block once per eight activation
            /// rows (the 512-bit pair kernels of `x86_wide` need AVX-512).
            ///
            /// # Safety
            /// As [`tile_iq4xs`], for both tiles.
            #[allow(dead_code, reason = "the AVX-512 level takes x86_wide's pair kernels")]
            #[target_feature(enable = $features)]
            pub unsafe fn tiles2_iq4xs<const N: usize>(
                w0: &[u8],
                w1: &[u8],
                a: [&[BlockQ8]; N],
                _prefetch: bool,
            ) -> [[f32; 2 * TILE_ROWS]; N] {
                let r0 = iq4xs_with::<N>(w0, a, Prefetch::for_rows(N));
                let r1 = iq4xs_with::<N>(w1, a, Prefetch::for_rows(N));
                core::array::from_fn(|j| {
                    let mut o = [0f32; 2 * TILE_ROWS];
                    o[..TILE_ROWS].copy_from_slice(&r0[j]);
                    o[TILE_ROWS..].copy_from_slice(&r1[j]);
                    o
                })
            }

            /// [`tile_iq4xs`] over whole tiles against one activation row (decode).
            ///
            /// # Safety
            /// As [`tile_iq4xs`]; `out` has room for eight values per tile.
            #[target_feature(enable = $features)]
            pub unsafe fn run_iq4xs(w: &[u8], tile_bytes: usize, a: &[BlockQ8], out: *mut f32) {
                let pf = Prefetch::current();
                each_tile(w, tile_bytes, out, |t| {
                    let [o] = iq4xs_with::<1>(t, [a], pf);
                    o
                })
            }

            /// Q4_K (`HIGH` false) or Q5_K (`HIGH` true) tile row against `N` rows.
            ///
            /// # Safety
            /// The CPU has the features; `w` is whole tile blocks of the type; every
            /// activation row has at least as many super-blocks.
            #[inline]
            #[target_feature(enable = $features)]
            pub unsafe fn tile_q45k<const N: usize, const HIGH: bool>(
                w: &[u8],
                a: [&[BlockQ8K]; N],
            ) -> [[f32; TILE_ROWS]; N] {
                let pf = Prefetch::for_rows(N);
                q45k_with::<N, HIGH>(w, a, pf)
            }

            /// [`tile_q45k`] with the prefetch distances `pf` (used when `N` is 1).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn q45k_with<const N: usize, const HIGH: bool>(
                w: &[u8],
                a: [&[BlockQ8K]; N],
                pf: Prefetch,
            ) -> [[f32; TILE_ROWS]; N] {
                use k_offsets::*;
                let tb = if HIGH { 1440 } else { 1184 };
                let qs_off = if HIGH { QS5 } else { QS4 };
                let m4 = _mm256_set1_epi8(0x0F);
                let one = _mm256_set1_epi8(1);
                let mut acc = [_mm256_setzero_ps(); N];
                for b in 0..w.len() / tb {
                    let t = w.as_ptr().add(b * tb);
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(t as *const __m128i));
                    let dmin = _mm256_cvtph_ps(_mm_loadu_si128(t.add(16) as *const __m128i));
                    // sums scaled per sub-block, in f32 (exact below 2^24, rounding far
                    // below the tolerance above); d and the activation scale come last
                    let mut fsum = [_mm256_setzero_ps(); N];
                    let mut msum = [_mm256_setzero_si256(); N];
                    for c in 0..4 {
                        // the quarter's lines ahead, asked for in two halves (see
                        // `prefetch_quarter_half`)
                        if N == 1 {
                            prefetch_quarter_half(t, tb, c, 0, pf);
                        }
                        let mut lo = [_mm256_setzero_si256(); 8];
                        let mut hi = [_mm256_setzero_si256(); 8];
                        for g in 0..8 {
                            let v = ld(t.add(qs_off + 1024 / 4 * c + 32 * g));
                            lo[g] = _mm256_and_si256(v, m4);
                            hi[g] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                            if HIGH {
                                let h = ld(t.add(QH5 + 32 * g));
                                let hl = _mm256_and_si256(
                                    _mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * c as i32)),
                                    one,
                                );
                                let hh = _mm256_and_si256(
                                    _mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * c as i32 + 1)),
                                    one,
                                );
                                lo[g] = _mm256_or_si256(lo[g], _mm256_slli_epi16(hl, 4));
                                hi[g] = _mm256_or_si256(hi[g], _mm256_slli_epi16(hh, 4));
                            }
                        }
                        let sc_lo = u8x8(t.add(SC + 8 * (2 * c)));
                        let sc_hi = u8x8(t.add(SC + 8 * (2 * c + 1)));
                        let (sf_lo, si_lo) = (_mm256_cvtepi32_ps(sc_lo), $scales(sc_lo));
                        let (sf_hi, si_hi) = (_mm256_cvtepi32_ps(sc_hi), $scales(sc_hi));
                        for j in 0..N {
                            let y = a[j].get_unchecked(b).qs.as_ptr().add(64 * c);
                            let ylo: [__m256i; 8] = core::array::from_fn(|g| bcast(y, 4 * g));
                            let yhi: [__m256i; 8] = core::array::from_fn(|g| bcast(y, 32 + 4 * g));
                            // 5-bit codes: four vectors per 16-bit sum (see `widened`)
                            fsum[j] = if HIGH {
                                $scaled::<8, 4>(fsum[j], &lo, &ylo, sf_lo, si_lo)
                            } else {
                                $scaled::<8, 8>(fsum[j], &lo, &ylo, sf_lo, si_lo)
                            };
                            if N == 1 {
                                prefetch_quarter_half(t, tb, c, 1, pf);
                            }
                            fsum[j] = if HIGH {
                                $scaled::<8, 4>(fsum[j], &hi, &yhi, sf_hi, si_hi)
                            } else {
                                $scaled::<8, 8>(fsum[j], &hi, &yhi, sf_hi, si_hi)
                            };
                        }
                    }
                    // minimums: per row, sum over sub-blocks of min * activation sum, two
                    // sub-blocks per 16-bit multiply-add
                    for s2 in 0..4 {
                        let pair = pairs16(t.add(MN + 16 * s2), false);
                        for j in 0..N {
                            // the sums of sub-blocks 2 s2 and 2 s2 + 1 as one i32
                            let y = a[j].get_unchecked(b).sums32.as_ptr() as *const i8;
                            let bs = bcast(y, 4 * s2);
                            msum[j] = _mm256_add_epi32(msum[j], _mm256_madd_epi16(pair, bs));
                        }
                    }
                    for j in 0..N {
                        let yd = _mm256_set1_ps(a[j].get_unchecked(b).d);
                        acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(d, yd), fsum[j], acc[j]);
                        acc[j] = _mm256_fnmadd_ps(
                            _mm256_mul_ps(dmin, yd),
                            _mm256_cvtepi32_ps(msum[j]),
                            acc[j],
                        );
                    }
                }
                let mut out = [[0f32; TILE_ROWS]; N];
                for j in 0..N {
                    _mm256_storeu_ps(out[j].as_mut_ptr(), acc[j]);
                }
                out
            }

            /// Q6_K tile row against `N` rows.
            ///
            /// # Safety
            /// As [`tile_q45k`].
            #[inline]
            #[target_feature(enable = $features)]
            pub unsafe fn tile_q6k<const N: usize>(
                w: &[u8],
                a: [&[BlockQ8K]; N],
            ) -> [[f32; TILE_ROWS]; N] {
                let pf = Prefetch::for_rows(N);
                q6k_with::<N>(w, a, pf)
            }

            /// [`tile_q6k`] with the prefetch distances `pf` (used when `N` is 1).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn q6k_with<const N: usize>(
                w: &[u8],
                a: [&[BlockQ8K]; N],
                pf: Prefetch,
            ) -> [[f32; TILE_ROWS]; N] {
                use k_offsets::*;
                let tb = 1680;
                let mut acc = [_mm256_setzero_ps(); N];
                for b in 0..w.len() / tb {
                    let t = w.as_ptr().add(b * tb);
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(t as *const __m128i));
                    let mut fsum = [_mm256_setzero_ps(); N];
                    for n in 0..2 {
                        for h in 0..2 {
                            if N == 1 {
                                prefetch_quarter(t, tb, 2 * n + h, pf);
                            }
                            // groups 4h..4h+4 of half n: values 4g..4g+4 of each quarter
                            let q: [[__m256i; 4]; 4] =
                                core::array::from_fn(|gi| q6_codes_whole(t, n, 4 * h + gi));
                            let sc: [__m256i; 4] = core::array::from_fn(|k| {
                                i8x8(t.add(SC6 + 8 * (8 * n + 2 * k + h)))
                            });
                            for j in 0..N {
                                let y = a[j].get_unchecked(b).qs.as_ptr().add(128 * n);
                                for (k, &sck) in sc.iter().enumerate() {
                                    let u: [__m256i; 4] = core::array::from_fn(|gi| q[gi][k]);
                                    let ys: [__m256i; 4] = core::array::from_fn(|gi| {
                                        bcast(y, 32 * k + 4 * (4 * h + gi))
                                    });
                                    // 6-bit codes: two vectors per 16-bit sum
                                    fsum[j] = $scaled::<4, 2>(
                                        fsum[j],
                                        &u,
                                        &ys,
                                        _mm256_cvtepi32_ps(sck),
                                        $scales(sck),
                                    );
                                }
                            }
                        }
                    }
                    // every code carries an offset of 32: subtract 32 * scale * 16-sum
                    let mut off = [_mm256_setzero_si256(); N];
                    for s2 in 0..8 {
                        let pair = pairs16(t.add(SC6 + 16 * s2), true);
                        for j in 0..N {
                            // the sums of 16-value groups 2 s2 and 2 s2 + 1 as one i32
                            let y = a[j].get_unchecked(b).bsums.as_ptr() as *const i8;
                            let bs = bcast(y, 4 * s2);
                            off[j] = _mm256_add_epi32(off[j], _mm256_madd_epi16(pair, bs));
                        }
                    }
                    for j in 0..N {
                        let yd = _mm256_set1_ps(a[j].get_unchecked(b).d);
                        let o = _mm256_cvtepi32_ps(_mm256_slli_epi32(off[j], 5));
                        acc[j] = _mm256_fmadd_ps(
                            _mm256_mul_ps(d, yd),
                            _mm256_sub_ps(fsum[j], o),
                            acc[j],
                        );
                    }
                }
                let mut out = [[0f32; TILE_ROWS]; N];
                for j in 0..N {
                    _mm256_storeu_ps(out[j].as_mut_ptr(), acc[j]);
                }
                out
            }

            /// [`run_dot`] for Q4_K (`HIGH` false) and Q5_K (`HIGH` true), the prefetch
            /// distances read once per call rather than per quarter block (reading them
            /// in the loop slows the products).
            ///
            /// # Safety
            /// As [`tile_q45k`]; `out` has room for eight values per tile.
            #[target_feature(enable = $features)]
            pub unsafe fn run_q45k<const HIGH: bool>(
                w: &[u8],
                tile_bytes: usize,
                a: &[BlockQ8K],
                out: *mut f32,
            ) {
                let pf = Prefetch::current();
                each_tile(w, tile_bytes, out, |t| {
                    let [o] = q45k_with::<1, HIGH>(t, [a], pf);
                    o
                })
            }

            /// [`run_q45k`] for Q6_K.
            ///
            /// # Safety
            /// As [`tile_q6k`]; `out` has room for eight values per tile.
            #[target_feature(enable = $features)]
            pub unsafe fn run_q6k(w: &[u8], tile_bytes: usize, a: &[BlockQ8K], out: *mut f32) {
                let pf = Prefetch::current();
                each_tile(w, tile_bytes, out, |t| {
                    let [o] = q6k_with::<1>(t, [a], pf);
                    o
                })
            }
        }
    };
}

tiled_kernels!(
    avx2,
    "avx2,fma,f16c",
    dots_avx2,
    scaled_avx2,
    scales_avx2,
    codes5_avx2,
    q8_prep_avx2,
    q8_pair_avx2,
    0
);
tiled_kernels!(
    avx512vnni,
    "avx2,fma,f16c,avx512vl,avx512vnni,avx512bw",
    dots_vnni,
    scaled_vnni,
    scales_vnni,
    codes5_bw,
    q8_prep_vnni,
    q8_pair_vnni,
    128
);

/// Q2_K and Q3_K at the AVX2 level, on the four-byte layout (at AVX-512 they have a layout
/// and kernels of their own in `x86_wide`).
pub mod k23_avx2 {
    use super::*;

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn ld(p: *const u8) -> __m256i {
        _mm256_loadu_si256(p as *const __m256i)
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn bcast(p: *const i8, at: usize) -> __m256i {
        _mm256_set1_epi32((p.add(at) as *const i32).read_unaligned())
    }

    /// Q2_K tile row against `N` rows.
    ///
    /// # Safety
    /// As `avx2::tile_q45k`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn tile_q2k<const N: usize>(w: &[u8], a: [&[BlockQ8K]; N]) -> [[f32; TILE_ROWS]; N] {
        let pf = Prefetch::for_rows(N);
        q2k_with::<N>(w, a, pf)
    }

    /// [`tile_q2k`] with the prefetch distances `pf` (used when `N` is 1). Per
    /// quarter `(n, k)` (`q = 4 n + k`), the eight code vectors are bits `2 k` of
    /// the eight group vectors of half `n`, taken as `code` (k 0, 2) or `4 code`
    /// (k 1, 3: one `and` each, the shift by 2 left out); the odd quarters' sums are
    /// kept apart and divided by 4 at the end, exactly. The two sub-blocks' scales
    /// meet their sums in one multiply-add ([`pair_avx2`]), their
    /// minimums the activation's 16-value sums in another.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q2k_with<const N: usize>(
        w: &[u8],
        a: [&[BlockQ8K]; N],
        pf: Prefetch,
    ) -> [[f32; TILE_ROWS]; N] {
        use k_offsets::*;
        let tb = 672;
        let (m3, m12) = (_mm256_set1_epi8(3), _mm256_set1_epi8(12));
        let m15 = _mm256_set1_epi16(0x0F);
        let mut acc = [_mm256_setzero_ps(); N];
        for b in 0..w.len() / tb {
            let t = w.as_ptr().add(b * tb);
            let d = _mm256_cvtph_ps(_mm_loadu_si128(t as *const __m128i));
            let dmin = _mm256_cvtph_ps(_mm_loadu_si128(t.add(16) as *const __m128i));
            // per activation row: the even quarters' scaled sums, the odd ones'
            // (four times theirs), the minimums times the 16-value sums
            let mut even = [_mm256_setzero_si256(); N];
            let mut odd = [_mm256_setzero_si256(); N];
            let mut mins = [_mm256_setzero_si256(); N];
            for q in 0..8 {
                let (n, k) = (q / 4, q % 4);
                if N == 1 && k % 2 == 0 {
                    prefetch_quarter(t, tb, q / 2, pf);
                }
                let u: [__m256i; 8] = core::array::from_fn(|g| {
                    let v = ld(t.add(QS2 + 256 * n + 32 * g));
                    let v = if k < 2 { v } else { _mm256_srli_epi16::<4>(v) };
                    _mm256_and_si256(v, if k % 2 == 0 { m3 } else { m12 })
                });
                // (scale | minimum << 4) of sub-blocks 2q and 2q + 1, per row
                let x =
                    _mm256_cvtepu8_epi16(_mm_loadu_si128(t.add(SC2 + 16 * q) as *const __m128i));
                let (sc, mn) = (_mm256_and_si256(x, m15), _mm256_srli_epi16::<4>(x));
                for j in 0..N {
                    let y = a[j].get_unchecked(b);
                    let yq = y.qs.as_ptr().add(32 * q);
                    let s: [__m256i; 8] = core::array::from_fn(|g| bcast(yq, 4 * g));
                    if k % 2 == 0 {
                        even[j] = pair_avx2(even[j], &u, &s, sc);
                    } else {
                        odd[j] = pair_avx2(odd[j], &u, &s, sc);
                    }
                    // the 16-value sums of sub-blocks 2q and 2q + 1 as one i32
                    let bs = bcast(y.bsums.as_ptr() as *const i8, 4 * q);
                    mins[j] = madd_avx2(mins[j], mn, bs);
                }
            }
            for j in 0..N {
                let yd = _mm256_set1_ps(a[j].get_unchecked(b).d);
                let sum = _mm256_add_epi32(even[j], _mm256_srai_epi32::<2>(odd[j]));
                acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(d, yd), _mm256_cvtepi32_ps(sum), acc[j]);
                acc[j] =
                    _mm256_fnmadd_ps(_mm256_mul_ps(dmin, yd), _mm256_cvtepi32_ps(mins[j]), acc[j]);
            }
        }
        let mut out = [[0f32; TILE_ROWS]; N];
        for j in 0..N {
            _mm256_storeu_ps(out[j].as_mut_ptr(), acc[j]);
        }
        out
    }

    /// Q3_K tile row against `N` rows.
    ///
    /// # Safety
    /// As `avx2::tile_q45k`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn tile_q3k<const N: usize>(w: &[u8], a: [&[BlockQ8K]; N]) -> [[f32; TILE_ROWS]; N] {
        let pf = Prefetch::for_rows(N);
        q3k_with::<N>(w, a, pf)
    }

    /// [`tile_q3k`] with the prefetch distances `pf` (used when `N` is 1): per
    /// quarter, eight code vectors of whole codes (0..8), two sub-blocks scaled in
    /// one multiply-add; the codes' offset of 4 is taken back with the
    /// activation's 16-value sums times the scales.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q3k_with<const N: usize>(
        w: &[u8],
        a: [&[BlockQ8K]; N],
        pf: Prefetch,
    ) -> [[f32; TILE_ROWS]; N] {
        use k_offsets::*;
        let tb = 912;
        let mut acc = [_mm256_setzero_ps(); N];
        for b in 0..w.len() / tb {
            let t = w.as_ptr().add(b * tb);
            let d = _mm256_cvtph_ps(_mm_loadu_si128(t as *const __m128i));
            let mut sums = [_mm256_setzero_si256(); N];
            let mut offs = [_mm256_setzero_si256(); N];
            for q in 0..8 {
                if N == 1 && q % 2 == 0 {
                    prefetch_quarter(t, tb, q / 2, pf);
                }
                let u = q3_codes_avx2(t.add(QS3 + 96 * q));
                // the signed scales of sub-blocks 2q and 2q + 1, per row
                let sc =
                    _mm256_cvtepi8_epi16(_mm_loadu_si128(t.add(SC3 + 16 * q) as *const __m128i));
                for j in 0..N {
                    let y = a[j].get_unchecked(b);
                    let yq = y.qs.as_ptr().add(32 * q);
                    let s: [__m256i; 8] = core::array::from_fn(|g| bcast(yq, 4 * g));
                    sums[j] = pair_avx2(sums[j], &u, &s, sc);
                    let bs = bcast(y.bsums.as_ptr() as *const i8, 4 * q);
                    offs[j] = madd_avx2(offs[j], sc, bs);
                }
            }
            for j in 0..N {
                let yd = _mm256_set1_ps(a[j].get_unchecked(b).d);
                let sum = _mm256_sub_epi32(sums[j], _mm256_slli_epi32::<2>(offs[j]));
                acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(d, yd), _mm256_cvtepi32_ps(sum), acc[j]);
            }
        }
        let mut out = [[0f32; TILE_ROWS]; N];
        for j in 0..N {
            _mm256_storeu_ps(out[j].as_mut_ptr(), acc[j]);
        }
        out
    }

    /// [`tile_q2k`] over whole tiles, one activation row (decode), as `avx2::run_q45k`.
    ///
    /// # Safety
    /// As [`tile_q2k`]; `out` has room for eight values per tile.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn run_q2k(w: &[u8], tile_bytes: usize, a: &[BlockQ8K], out: *mut f32) {
        let pf = Prefetch::current();
        each_tile(w, tile_bytes, out, |t| {
            let [o] = q2k_with::<1>(t, [a], pf);
            o
        })
    }

    /// [`run_q2k`] for Q3_K.
    ///
    /// # Safety
    /// As [`tile_q3k`]; `out` has room for eight values per tile.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn run_q3k(w: &[u8], tile_bytes: usize, a: &[BlockQ8K], out: *mut f32) {
        let pf = Prefetch::current();
        each_tile(w, tile_bytes, out, |t| {
            let [o] = q3k_with::<1>(t, [a], pf);
            o
        })
    }
}
