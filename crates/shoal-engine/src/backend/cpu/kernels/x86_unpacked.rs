//! The batched AVX-512 VNNI kernel of the grid i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S,
//! IQ3_XXS, IQ3_S): sixteen weight rows, unpacked once per batch into bytes
//! ([`super::iquants::unpacked`]), against `N` activation rows per super-block. A 64-byte
//! vector holds four values of each of the sixteen rows and meets four activations broadcast
//! to every lane, so one `vpdpbusd` adds 64 products into the rows' own lanes. The values are
//! stored 128 above themselves (unsigned operands); the kernel takes `128` times the
//! activations' sum back through the chain's seed, from the block's sums of sixteen. Each
//! 32-value group (or 16-value half, for the types with a scale per 16) is summed exactly in
//! 32 bits, multiplied by its integer scale and added up over the super-block in 32 bits
//! (exact: below 2^27 in magnitude), then scaled once in f32. [`unpack`] decodes each row's
//! 32 values of a group into one 256-bit vector (IQ1_S, IQ1_M, IQ2_XXS and IQ3_S with gathers
//! from their grids, the other types in scalars, [`unpack_row`]) and turns sixteen rows'
//! vectors into the eight interleaved ones with a transpose in registers. Callers must have
//! checked AVX-512 F/BW/VL/VNNI. The same path at eight rows for AVX2 ([`narrow`]) keeps the
//! values signed and multiplies their magnitudes by the activations carrying their signs.

#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;

use super::formats::{BlockQ8K, WeightType, QK_K};
use super::iq_grids::{IQ2XXS_GRID, IQ3S_GRID};
use super::iquants::unpacked::{BYTES, D, QS, SC};
use super::iquants::{signs_of, unpack_row, Lattice, IQ1_EIGHTHS, UNPACKED_ROWS};
use super::x86_wide::bcast;

/// The 64-byte value vector `v` of the unpacked block at `u`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn values(u: *const u8, v: usize) -> __m512i {
    _mm512_loadu_si512(u.add(QS + 64 * v) as *const __m512i)
}

/// The sixteen rows' scales of half `h`, one per 32-bit lane.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn scales(u: *const u8, h: usize) -> __m512i {
    _mm512_cvtepi8_epi32(_mm_loadu_si128(u.add(SC + 16 * h) as *const __m128i))
}

/// `seed` plus the dot products of value vectors `q` (`K` of them, from value `4 K i` of the
/// block on) with the activations from `y[at..]`, in two chains of `vpdpbusd` so that one
/// chain's latency does not hold the other.
#[inline]
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn dots<const K: usize>(seed: __m512i, q: &[__m512i; K], y: *const i8) -> __m512i {
    let mut pp = [seed, _mm512_setzero_si512()];
    for k in 0..K {
        pp[k & 1] = _mm512_dpbusd_epi32(pp[k & 1], q[k], bcast(y, 4 * k));
    }
    _mm512_add_epi32(pp[0], pp[1])
}

/// Adds to `acc[j][r]` row `r`'s dot product with activation block `a[j]`, for the sixteen
/// rows of the unpacked super-block column `u` (rows past the live ones add 0). `PER_32`: the
/// type has one scale per 32 values (both halves' scales are equal), so a group's eight
/// value vectors form one chain.
///
/// # Safety
/// The CPU has AVX-512 F/BW/VNNI; `u` is at least [`BYTES`] long.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub unsafe fn block_dot<const N: usize, const PER_32: bool>(
    u: &[u8],
    a: [&BlockQ8K; N],
    acc: &mut [[f32; UNPACKED_ROWS]; N],
) {
    debug_assert!(u.len() >= BYTES);
    let u = u.as_ptr();
    let mut isum = [_mm512_setzero_si512(); N];
    for g in 0..8 {
        if PER_32 {
            let q: [__m512i; 8] = core::array::from_fn(|k| values(u, 8 * g + k));
            let sc = scales(u, 2 * g);
            for j in 0..N {
                let y = a[j];
                let sum = y.bsums[2 * g] as i32 + y.bsums[2 * g + 1] as i32;
                let p = dots::<8>(_mm512_set1_epi32(-128 * sum), &q, y.qs.as_ptr().add(32 * g));
                isum[j] = _mm512_add_epi32(isum[j], _mm512_mullo_epi32(p, sc));
            }
        } else {
            for h in 2 * g..2 * g + 2 {
                let q: [__m512i; 4] = core::array::from_fn(|k| values(u, 4 * h + k));
                let sc = scales(u, h);
                for j in 0..N {
                    let y = a[j];
                    let p = dots::<4>(
                        _mm512_set1_epi32(-128 * y.bsums[h] as i32),
                        &q,
                        y.qs.as_ptr().add(16 * h),
                    );
                    isum[j] = _mm512_add_epi32(isum[j], _mm512_mullo_epi32(p, sc));
                }
            }
        }
    }
    let d = _mm512_loadu_ps(u.add(D) as *const f32);
    for j in 0..N {
        let o = acc[j].as_mut_ptr();
        let unit = _mm512_mul_ps(d, _mm512_set1_ps(a[j].d));
        let v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[j]), unit, _mm512_loadu_ps(o));
        _mm512_storeu_ps(o, v);
    }
}

/// Unpacks one super-block of each of `blocks` (at most [`UNPACKED_ROWS`], each a whole block
/// of `L`) into `out`, as [`super::iquants::unpack`] does (the same bytes).
///
/// # Safety
/// The CPU has AVX-512 F/BW/VL.
///
/// # Panics
/// When there are more blocks than rows, a block is short, or `out` is.
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl")]
pub unsafe fn unpack<L: Lattice>(blocks: &[&[u8]], out: &mut [u8]) {
    assert!(blocks.len() <= UNPACKED_ROWS && out.len() >= BYTES);
    let bb = L::TYPE.block_bytes();
    assert!(blocks.iter().all(|b| b.len() >= bb));
    let o = out.as_mut_ptr();
    let top = _mm256_set1_epi8(0x80u8 as i8);
    // IQ1_S, IQ1_M, IQ2_XXS and IQ3_S decode in vectors, group by group (`iq1_group`,
    // `iq2xxs_group`, `iq3s_group`); the other types a row at a time in scalars, out of line
    let vectors = matches!(
        L::TYPE,
        WeightType::Iq1S | WeightType::Iq1M | WeightType::Iq2Xxs | WeightType::Iq3S
    );
    let mut units = [0f32; UNPACKED_ROWS];
    let mut scales = [[0i8; 16]; UNPACKED_ROWS];
    let mut values = [[0x8080_8080_8080_8080u64; QK_K / 8]; UNPACKED_ROWS];
    for (r, &b) in blocks.iter().enumerate() {
        units[r] = L::FACTOR * L::d(b);
        if !vectors {
            unpack_row::<L>(b, &mut values[r], &mut scales[r]);
        }
    }
    _mm512_storeu_ps(o.add(D) as *mut f32, _mm512_loadu_ps(units.as_ptr()));
    for g in 0..8 {
        // a loop, not `array::from_fn`: a closure does not take this function's target
        // features, so the decoders would not be inlined into it
        let mut rows = [top; UNPACKED_ROWS];
        for (r, row) in rows.iter_mut().enumerate() {
            *row = match blocks.get(r) {
                Some(b) if vectors => {
                    let (v, s) = match L::TYPE {
                        WeightType::Iq3S => iq3s_group(b.as_ptr(), g),
                        WeightType::Iq2Xxs => iq2xxs_group(b.as_ptr(), g),
                        _ => iq1_group(L::TYPE, b.as_ptr(), g),
                    };
                    scales[r][2 * g] = s[0];
                    scales[r][2 * g + 1] = s[1];
                    _mm256_xor_si256(v, top)
                }
                _ => _mm256_loadu_si256(values[r].as_ptr().add(4 * g) as *const __m256i),
            };
        }
        for (k, v) in transpose(&rows).into_iter().enumerate() {
            _mm512_storeu_si512(o.add(QS + 64 * (8 * g + k)) as *mut __m512i, v);
        }
    }
    // the scales, [row][half] here, go [half][row]: a 16 x 16 byte transpose, by scalars
    for h in 0..16 {
        for (r, s) in scales.iter().enumerate() {
            *o.add(SC + 16 * h + r) = s[h] as u8;
        }
    }
}

/// The grids the vector decoders gather from.
static IQ2XXS: &[u64; 256] = &IQ2XXS_GRID;
static IQ3S: &[u32; 512] = &IQ3S_GRID;
static IQ1: &[[u64; 2048]; 2] = &IQ1_EIGHTHS;

/// The sign byte of each 7-bit sign code ([`signs_of`]).
static EVEN_SIGNS: [u8; 128] = {
    let mut t = [0u8; 128];
    let mut c = 0;
    while c < 128 {
        t[c] = signs_of(c as u32);
        c += 1;
    }
    t
};

/// Group `g` of the IQ3_S block at `b`: its 32 signed values (bytes, in order) and their
/// scale, as [`super::iquants::Iq3S`] reads them: the eight 9-bit grid indices (the ninth
/// bits from the group's high-bit byte) gathered at once, and the four sign bytes as one
/// byte mask.
#[inline]
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl")]
unsafe fn iq3s_group(b: *const u8, g: usize) -> (__m256i, [i8; 2]) {
    let low = _mm256_cvtepu8_epi32(_mm_loadl_epi64(b.add(2 + 8 * g) as *const __m128i));
    // point p's ninth bit is bit p of the byte: moved to bit 8
    let qh = _mm256_set1_epi32(*b.add(66 + g) as i32);
    let shifted = _mm256_sllv_epi32(qh, _mm256_setr_epi32(8, 7, 6, 5, 4, 3, 2, 1));
    let idx = _mm256_or_si256(low, _mm256_and_si256(shifted, _mm256_set1_epi32(256)));
    let mags = _mm256_i32gather_epi32::<4>(IQ3S.as_ptr() as *const i32, idx);
    let signs = (b.add(74 + 4 * g) as *const u32).read_unaligned();
    let v = _mm256_mask_sub_epi8(mags, signs, _mm256_setzero_si256(), mags);
    let sc = (*b.add(106 + g / 2) >> (4 * (g % 2))) & 0xF;
    let s = (2 * sc + 1) as i8;
    (v, [s, s])
}

/// Group `g` of the IQ2_XXS block at `b`, as [`iq3s_group`]: four 8-value grid points
/// gathered at once, the four 7-bit sign codes' bytes (with their parity sign) as one mask.
#[inline]
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl")]
unsafe fn iq2xxs_group(b: *const u8, g: usize) -> (__m256i, [i8; 2]) {
    let at = 2 + 8 * g;
    let idx = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(
        (b.add(at) as *const i32).read_unaligned(),
    ));
    let mags = _mm256_i32gather_epi64::<8>(IQ2XXS.as_ptr() as *const i64, idx);
    let aux = (b.add(at + 4) as *const u32).read_unaligned();
    let mut signs = 0u32;
    for l in 0..4 {
        signs |= (EVEN_SIGNS[((aux >> (7 * l)) & 127) as usize] as u32) << (8 * l);
    }
    let v = _mm256_mask_sub_epi8(mags, signs, _mm256_setzero_si256(), mags);
    let s = (2 * (aux >> 28) + 1) as i8;
    (v, [s, s])
}

/// Group `g` of the IQ1_S or IQ1_M (`ty`) block at `b`: its 32 values in eighths (bytes, in
/// order) and its two halves' scales, as [`super::iquants::Iq1S`] and
/// [`super::iquants::Iq1M`] read them: the four grid points gathered at once from the
/// eighths tables (the second table, 2048 entries on, for a shift of -1/8).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn iq1_group(ty: WeightType, b: *const u8, g: usize) -> (__m256i, [i8; 2]) {
    let u16_at = |at: usize| (b.add(at) as *const u16).read_unaligned() as u32;
    let (idx, scales) = if ty == WeightType::Iq1S {
        let qh = u16_at(34 + 2 * g);
        let neg = if qh & 0x8000 != 0 { 2048 } else { 0 };
        let idx: [u32; 4] =
            core::array::from_fn(|l| *b.add(2 + 4 * g + l) as u32 | ((qh >> (3 * l)) & 7) << 8);
        let s = (2 * ((qh >> 12) & 7) + 1) as i8;
        (idx.map(|i| i + neg), [s, s])
    } else {
        let s = u16_at(48 + 2 * (g / 2)) >> (6 * (g % 2));
        let (h0, h1) = (*b.add(32 + 2 * g) as u32, *b.add(33 + 2 * g) as u32);
        let q = 4 * g;
        let neg = |bit: u32| if bit != 0 { 2048 } else { 0 };
        let idx = [
            *b.add(q) as u32 | ((h0 << 8) & 0x700) | neg(h0 & 0x08),
            *b.add(q + 1) as u32 | ((h0 << 4) & 0x700) | neg(h0 & 0x80),
            *b.add(q + 2) as u32 | ((h1 << 8) & 0x700) | neg(h1 & 0x08),
            *b.add(q + 3) as u32 | ((h1 << 4) & 0x700) | neg(h1 & 0x80),
        ];
        (
            idx,
            [(2 * (s & 7) + 1) as i8, (2 * ((s >> 3) & 7) + 1) as i8],
        )
    };
    let idx = _mm_setr_epi32(idx[0] as i32, idx[1] as i32, idx[2] as i32, idx[3] as i32);
    let v = _mm256_i32gather_epi64::<8>(IQ1.as_ptr() as *const i64, idx);
    (v, scales)
}

/// Sixteen rows of eight 32-bit words (`rows[r]`, word `k`) as eight vectors of sixteen
/// (vector `k`, lane `r`): two 8 x 8 transposes side by side, rows 0-7 in the low 256 bits
/// and 8-15 in the high, by 32- and 64-bit interleaves within 128-bit lanes and one
/// two-source permute of 64-bit pairs.
#[inline]
#[target_feature(enable = "avx2,avx512f")]
unsafe fn transpose(rows: &[__m256i; UNPACKED_ROWS]) -> [__m512i; 8] {
    let z: [__m512i; 8] = core::array::from_fn(|i| {
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(rows[i]), rows[i + 8])
    });
    // t[2 i] and t[2 i + 1]: rows 2 i and 2 i + 1 interleaved word by word
    let t: [__m512i; 8] = core::array::from_fn(|i| {
        let (a, b) = (z[i & !1], z[i | 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_epi32(a, b)
        } else {
            _mm512_unpackhi_epi32(a, b)
        }
    });
    // u[4 q + c] (q: rows 0-3 or 4-7 of each half): 128-bit lanes holding words c and c + 4
    // of four rows
    let u: [__m512i; 8] = core::array::from_fn(|i| {
        let (q, c) = (i / 4, i % 4);
        let (a, b) = (t[4 * q + c / 2], t[4 * q + 2 + c / 2]);
        if c % 2 == 0 {
            _mm512_unpacklo_epi64(a, b)
        } else {
            _mm512_unpackhi_epi64(a, b)
        }
    });
    let first = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    let second = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    core::array::from_fn(|k| {
        let (a, b) = (u[k % 4], u[4 + k % 4]);
        _mm512_permutex2var_epi64(a, if k < 4 { first } else { second }, b)
    })
}

/// The AVX2 form of an unpacked super-block column: eight rows, each row's unit (f32) at
/// [`D`](narrow::D), its scales per 16 values at [`SC`](narrow::SC) (byte `8 h + r`), and its
/// values kept signed at [`QS`](narrow::QS), interleaved four per row (byte `32 v + 4 r + j`
/// is value `4 v + j` of row `r`): AVX2 has only the unsigned-by-signed byte product, so the
/// kernel multiplies the values' magnitudes by the activations carrying the values' signs.
pub mod narrow {
    use super::QK_K;
    /// Rows.
    pub const ROWS: usize = 8;
    /// The rows' units.
    pub const D: usize = 0;
    /// The scales.
    pub const SC: usize = 4 * ROWS;
    /// The values.
    pub const QS: usize = SC + 16 * ROWS;
    /// Bytes of one unpacked super-block column.
    pub const BYTES: usize = QS + QK_K * ROWS;
}

/// As [`unpack`], into the AVX2 form ([`narrow`]): at most eight blocks.
///
/// # Safety
/// The CPU has AVX2.
///
/// # Panics
/// When there are more blocks than rows, a block is short, or `out` is.
#[target_feature(enable = "avx2")]
pub unsafe fn unpack_narrow<L: Lattice>(blocks: &[&[u8]], out: &mut [u8]) {
    use narrow::{D, QS, ROWS, SC};
    assert!(blocks.len() <= ROWS && out.len() >= narrow::BYTES);
    let bb = L::TYPE.block_bytes();
    assert!(blocks.iter().all(|b| b.len() >= bb));
    let o = out.as_mut_ptr();
    let mut units = [0f32; ROWS];
    let mut scales = [[0i8; 16]; ROWS];
    // the values plus 128, as `unpack_row` gives them (a missing row: zeros)
    let mut values = [[0x8080_8080_8080_8080u64; QK_K / 8]; ROWS];
    // IQ1's groups gather in vectors (`iq1_group`), the other types decode in scalars
    let vectors = matches!(L::TYPE, WeightType::Iq1S | WeightType::Iq1M);
    for (r, &b) in blocks.iter().enumerate() {
        units[r] = L::FACTOR * L::d(b);
        if !vectors {
            unpack_row::<L>(b, &mut values[r], &mut scales[r]);
        }
    }
    _mm256_storeu_ps(o.add(D) as *mut f32, _mm256_loadu_ps(units.as_ptr()));
    let top = _mm256_set1_epi8(0x80u8 as i8);
    for g in 0..8 {
        let mut rows = [_mm256_setzero_si256(); ROWS];
        for (r, row) in rows.iter_mut().enumerate() {
            *row = match blocks.get(r) {
                Some(b) if vectors => {
                    let (v, s) = iq1_group(L::TYPE, b.as_ptr(), g);
                    scales[r][2 * g] = s[0];
                    scales[r][2 * g + 1] = s[1];
                    v
                }
                _ => {
                    let v = _mm256_loadu_si256(values[r].as_ptr().add(4 * g) as *const __m256i);
                    _mm256_xor_si256(v, top)
                }
            };
        }
        for (k, v) in transpose_narrow(&rows).into_iter().enumerate() {
            _mm256_storeu_si256(o.add(QS + 32 * (8 * g + k)) as *mut __m256i, v);
        }
    }
    for h in 0..16 {
        for (r, s) in scales.iter().enumerate() {
            *o.add(SC + ROWS * h + r) = s[h] as u8;
        }
    }
}

/// Eight rows of eight 32-bit words as eight vectors of eight (vector `k`, lane `r`): 32-
/// and 64-bit interleaves within 128-bit lanes, then the lanes put together.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn transpose_narrow(rows: &[__m256i; 8]) -> [__m256i; 8] {
    let mut t = [_mm256_setzero_si256(); 8];
    for (i, ti) in t.iter_mut().enumerate() {
        let (a, b) = (rows[i & !1], rows[i | 1]);
        *ti = if i % 2 == 0 {
            _mm256_unpacklo_epi32(a, b)
        } else {
            _mm256_unpackhi_epi32(a, b)
        };
    }
    // u[4 q + c]: its low 128 bits word c of rows 4 q .. 4 q + 4, its high ones word c + 4
    let mut u = [_mm256_setzero_si256(); 8];
    for (i, ui) in u.iter_mut().enumerate() {
        let (q, c) = (i / 4, i % 4);
        let (a, b) = (t[4 * q + c / 2], t[4 * q + 2 + c / 2]);
        *ui = if c % 2 == 0 {
            _mm256_unpacklo_epi64(a, b)
        } else {
            _mm256_unpackhi_epi64(a, b)
        };
    }
    let mut out = [_mm256_setzero_si256(); 8];
    for (k, ok) in out.iter_mut().enumerate() {
        let (a, b) = (u[k % 4], u[4 + k % 4]);
        *ok = if k < 4 {
            _mm256_permute2x128_si256::<0x20>(a, b)
        } else {
            _mm256_permute2x128_si256::<0x31>(a, b)
        };
    }
    out
}

/// The AVX2 [`block_dot`] over the [`narrow`] form (eight rows; `acc`'s first eight lanes):
/// per pair of value vectors, the magnitudes times the activations signed as the values
/// (`vpmaddubsw`, pair sums within 2 x 62 x 128), the two pair sums added in 16 bits (within
/// 2^15) and widened by the multiply-add that applies the half's scale.
///
/// # Safety
/// The CPU has AVX2 and FMA; `u` is at least [`narrow::BYTES`] long.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn block_dot_narrow<const N: usize>(
    u: &[u8],
    a: [&BlockQ8K; N],
    acc: &mut [[f32; UNPACKED_ROWS]; N],
) {
    use narrow::{D, QS, ROWS, SC};
    debug_assert!(u.len() >= narrow::BYTES);
    let u = u.as_ptr();
    let mut isum = [_mm256_setzero_si256(); N];
    for g in 0..8 {
        let mut v = [_mm256_setzero_si256(); 8];
        let mut m = [_mm256_setzero_si256(); 8];
        for k in 0..8 {
            v[k] = _mm256_loadu_si256(u.add(QS + 32 * (8 * g + k)) as *const __m256i);
            m[k] = _mm256_abs_epi8(v[k]);
        }
        let mut w = [_mm256_setzero_si256(); 2];
        for (h, wh) in w.iter_mut().enumerate() {
            let s = _mm256_cvtepi8_epi32(_mm_loadl_epi64(
                u.add(SC + ROWS * (2 * g + h)) as *const __m128i
            ));
            // the row's scale in both 16-bit halves of its lane
            *wh = _mm256_or_si256(
                _mm256_and_si256(s, _mm256_set1_epi32(0xFFFF)),
                _mm256_slli_epi32(s, 16),
            );
        }
        for j in 0..N {
            let y = a[j].qs.as_ptr().add(32 * g);
            let mut s = isum[j];
            for k in (0..8).step_by(2) {
                let y0 = _mm256_set1_epi32((y.add(4 * k) as *const i32).read_unaligned());
                let y1 = _mm256_set1_epi32((y.add(4 * k + 4) as *const i32).read_unaligned());
                let p0 = _mm256_maddubs_epi16(m[k], _mm256_sign_epi8(y0, v[k]));
                let p1 = _mm256_maddubs_epi16(m[k + 1], _mm256_sign_epi8(y1, v[k + 1]));
                let p = _mm256_madd_epi16(_mm256_add_epi16(p0, p1), w[k / 4]);
                s = _mm256_add_epi32(s, p);
            }
            isum[j] = s;
        }
    }
    let d = _mm256_loadu_ps(u.add(D) as *const f32);
    for j in 0..N {
        let o = acc[j].as_mut_ptr();
        let unit = _mm256_mul_ps(d, _mm256_set1_ps(a[j].d));
        let v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[j]), unit, _mm256_loadu_ps(o));
        _mm256_storeu_ps(o, v);
    }
}
