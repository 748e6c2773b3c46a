//! AVX-512 kernels in 512-bit vectors. Most run two adjacent 8-row tiles at once (16 rows per
//! instruction), for batched products (prefill) where arithmetic, not memory, is the limit;
//! the layout is the tiled one of [`super::tiled`], each 512-bit code vector the same
//! 32-byte group of both tiles. Q2_K and Q3_K, whose few bits per value make even decode a
//! matter of arithmetic on 256-bit vectors, have a layout of their own at this level
//! ([`super::tiled::HighBits::Wide`], eight codes of each row per 64 bytes), so one tile
//! fills 512-bit vectors and a product reads one stream: their kernels here take one tile,
//! for decode and batches alike. Callers must have checked AVX-512 F/BW/VL/VNNI and that
//! every activation row has a super-block per tile block.

#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;

use super::each_tile;
use super::formats::{BlockQ8, BlockQ8K, IQ4_VALUES, MXFP4_VALUES};
use super::prefetch::Prefetch;
use super::tiled::kinds::{
    block_bytes, has_high_bit, has_min, is_grid, offsets, MXFP4, Q4_0, Q5_0, Q8_0,
};
use super::tiled::{k_offsets, TILE_ROWS};
use super::x86_tiled::prefetch_quarter;

/// Rows of a tile pair.
pub const PAIR_ROWS: usize = 2 * TILE_ROWS;

/// The same 32 bytes of both tiles as one 512-bit vector.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn ld2(t0: *const u8, t1: *const u8, off: usize) -> __m512i {
    _mm512_inserti64x4::<1>(
        _mm512_castsi256_si512(_mm256_loadu_si256(t0.add(off) as *const __m256i)),
        _mm256_loadu_si256(t1.add(off) as *const __m256i),
    )
}

/// Eight f16 of each tile at `off`, as 16 f32.
#[inline]
#[target_feature(enable = "avx512f,f16c")]
unsafe fn f16x16(t0: *const u8, t1: *const u8, off: usize) -> __m512 {
    let h = _mm256_set_m128i(
        _mm_loadu_si128(t1.add(off) as *const __m128i),
        _mm_loadu_si128(t0.add(off) as *const __m128i),
    );
    _mm512_cvtph_ps(h)
}

/// Eight bytes of each tile at `off` (one per row), tile 0's first, in one vector.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn bytes8x2(t0: *const u8, t1: *const u8, off: usize) -> __m128i {
    _mm_unpacklo_epi64(
        _mm_loadl_epi64(t0.add(off) as *const __m128i),
        _mm_loadl_epi64(t1.add(off) as *const __m128i),
    )
}

/// Eight MXFP4 scale bytes (E8M0) of each tile at `off` as 16 f32 halves, `2^(e - 128)`,
/// as [`super::formats::e8m0_half`] computes them (the two smallest subnormal).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn e8m0x16(t0: *const u8, t1: *const u8, off: usize) -> __m512 {
    let b = bytes8x2(t0, t1, off);
    let e = _mm512_cvtepu8_epi32(b);
    let normal = _mm512_slli_epi32::<23>(_mm512_sub_epi32(e, _mm512_set1_epi32(1)));
    let subnormal = _mm512_sllv_epi32(_mm512_set1_epi32(0x0020_0000), e);
    let small = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
    _mm512_castsi512_ps(_mm512_mask_blend_epi32(small, normal, subnormal))
}

/// The sixteen values of `kind`'s grid (IQ4_NL/IQ4_XS or MXFP4) in every 128-bit lane, a
/// `vpshufb` table.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn grid_table(kind: u8) -> __m512i {
    let values = if kind == MXFP4 {
        &MXFP4_VALUES
    } else {
        &IQ4_VALUES
    };
    _mm512_broadcast_i32x4(_mm_loadu_si128(values.as_ptr() as *const __m128i))
}

/// Eight bytes of each tile at `off` (one per row), as 16 f32.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn u8x16_ps(t0: *const u8, t1: *const u8, off: usize) -> __m512 {
    let b = bytes8x2(t0, t1, off);
    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b))
}

/// Two sub-blocks' per-row bytes of each tile at `off` (`[0..8]`, `[8..16]`) as 16-bit
/// `(first, second)` pairs per row, rows of tile 0 then tile 1.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pairs16x2(t0: *const u8, t1: *const u8, off: usize) -> __m512i {
    let pair = |t: *const u8| {
        _mm_unpacklo_epi8(
            _mm_loadl_epi64(t.add(off) as *const __m128i),
            _mm_loadl_epi64(t.add(off + 8) as *const __m128i),
        )
    };
    _mm512_cvtepu8_epi16(_mm256_set_m128i(pair(t1), pair(t0)))
}

/// Four activations at `p + at` broadcast to every 32-bit lane.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn bcast(p: *const i8, at: usize) -> __m512i {
    _mm512_set1_epi32((p.add(at) as *const i32).read_unaligned())
}

/// While block `b` of a pair is read, asks for the cache lines of the next pair's blocks
/// `2b` and `2b + 1` (`tb` bytes each), so by the end of this pair the whole next one is
/// on its way. Tiles lie back to back, so the next pair starts at `next`, right after the
/// second tile. The pair kernels take `prefetch` to do this on their first group of
/// activation rows only: later groups find the pair in the cache. Without it a batched
/// decode step stalls on the first read of every pair. A prefetch never faults, even past
/// the end.
#[inline]
#[target_feature(enable = "sse")]
unsafe fn prefetch_next_pair(next: *const u8, b: usize, tb: usize) {
    let from = 2 * b * tb;
    let mut off = from - from % 64;
    while off < from + 2 * tb {
        _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(off) as *const i8);
        off += 64;
    }
}

/// The 32-value block types (`KIND` as in [`super::x86_tiled`]): tiles `w0` and `w1` (the
/// same number of tile blocks) against `N` activation rows; `out[j][r]` is row `r` of the
/// pair (tile 0's rows first) against activation row `j`. The same arithmetic as
/// `x86_tiled::tile_dot`, with every instruction serving sixteen rows instead of eight.
///
/// # Safety
/// The CPU has AVX-512 F/BW/VL/VNNI, F16C; `w0` and `w1` are whole tile blocks of `KIND`,
/// equally long; every activation row has at least as many blocks.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn tile2_dot<const N: usize, const KIND: u8>(
    w0: &[u8],
    w1: &[u8],
    a: [&[BlockQ8]; N],
    prefetch: bool,
) -> [[f32; PAIR_ROWS]; N] {
    let tb = block_bytes(KIND) * TILE_ROWS;
    let (m_off, mask_off, qs_off) = offsets(KIND);
    let m4 = _mm512_set1_epi8(0x0F);
    let c16 = _mm512_set1_epi8(0x10);
    let flip = _mm512_set1_epi8(0x80u8 as i8);
    // unsigned codes carry this offset; Q8_0 and the grid values are shifted by 128 to
    // make them unsigned
    let offset: i32 = match KIND {
        Q4_0 => 8,
        Q5_0 => 16,
        _ if KIND == Q8_0 || is_grid(KIND) => 128,
        _ => 0,
    };
    let table = grid_table(KIND);
    let mut acc = [_mm512_setzero_ps(); N];
    let next = w1.as_ptr().wrapping_add(w1.len());
    for b in 0..w0.len() / tb {
        let (t0, t1) = (w0.as_ptr().add(b * tb), w1.as_ptr().add(b * tb));
        if prefetch {
            prefetch_next_pair(next, b, tb);
        }
        let d = if KIND == MXFP4 {
            e8m0x16(t0, t1, 0)
        } else {
            f16x16(t0, t1, 0)
        };
        let m = if has_min(KIND) {
            f16x16(t0, t1, m_off)
        } else {
            _mm512_setzero_ps()
        };
        let mut q = [_mm512_setzero_si512(); 8];
        if KIND == Q8_0 {
            for (k, qk) in q.iter_mut().enumerate() {
                *qk = _mm512_xor_si512(ld2(t0, t1, qs_off + 32 * k), flip);
            }
        } else {
            for g in 0..4 {
                let v = ld2(t0, t1, qs_off + 32 * g);
                q[g] = _mm512_and_si512(v, m4);
                q[g + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4);
            }
            if has_high_bit(KIND) {
                for (k, qk) in q.iter_mut().enumerate() {
                    let lo = (t0.add(mask_off + 4 * k) as *const u32).read_unaligned() as u64;
                    let hi = (t1.add(mask_off + 4 * k) as *const u32).read_unaligned() as u64;
                    *qk = _mm512_mask_add_epi8(*qk, lo | (hi << 32), *qk, c16);
                }
            }
            if is_grid(KIND) {
                for qk in q.iter_mut() {
                    *qk = _mm512_xor_si512(_mm512_shuffle_epi8(table, *qk), flip);
                }
            }
        }
        for j in 0..N {
            let y = a[j].get_unchecked(b);
            let yp = y.qs.as_ptr();
            let mut pp = [_mm512_setzero_si512(); 2];
            for (k, qk) in q.iter().enumerate() {
                pp[k & 1] = _mm512_dpbusd_epi32(pp[k & 1], *qk, bcast(yp, 4 * k));
            }
            let mut p = _mm512_add_epi32(pp[0], pp[1]);
            if offset != 0 {
                p = _mm512_sub_epi32(p, _mm512_set1_epi32(offset * y.sum));
            }
            acc[j] = _mm512_fmadd_ps(
                _mm512_mul_ps(d, _mm512_set1_ps(y.d)),
                _mm512_cvtepi32_ps(p),
                acc[j],
            );
            if has_min(KIND) {
                acc[j] = _mm512_fmadd_ps(m, _mm512_set1_ps(y.s), acc[j]);
            }
        }
    }
    let mut out = [[0f32; PAIR_ROWS]; N];
    for j in 0..N {
        _mm512_storeu_ps(out[j].as_mut_ptr(), acc[j]);
    }
    out
}

/// IQ4_XS: tiles `w0` and `w1` (the same number of tile blocks) against `N` activation rows
/// (eight [`BlockQ8`] per super-block), as `x86_tiled`'s `tile_iq4xs` with every
/// instruction serving sixteen rows.
///
/// # Safety
/// The CPU has AVX-512 F/BW/VL/VNNI, F16C; `w0` and `w1` are whole IQ4_XS tile blocks,
/// equally long; every activation row has eight blocks per tile block.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn tile2_iq4xs<const N: usize>(
    w0: &[u8],
    w1: &[u8],
    a: [&[BlockQ8]; N],
    prefetch: bool,
) -> [[f32; PAIR_ROWS]; N] {
    use k_offsets::{QSX, SCX};
    let tb = QSX + 1024;
    let m4 = _mm512_set1_epi8(0x0F);
    let flip = _mm512_set1_epi8(0x80u8 as i8);
    let table = grid_table(super::tiled::kinds::IQ4_NL);
    let mut acc = [_mm512_setzero_ps(); N];
    let next = w1.as_ptr().wrapping_add(w1.len());
    for b in 0..w0.len() / tb {
        let (t0, t1) = (w0.as_ptr().add(b * tb), w1.as_ptr().add(b * tb));
        if prefetch {
            prefetch_next_pair(next, b, tb);
        }
        let d = f16x16(t0, t1, 0);
        for ib in 0..8 {
            let mut q = [_mm512_setzero_si512(); 8];
            for g in 0..4 {
                let v = ld2(t0, t1, QSX + 128 * ib + 32 * g);
                let (lo, hi) = (
                    _mm512_and_si512(v, m4),
                    _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4),
                );
                q[g] = _mm512_xor_si512(_mm512_shuffle_epi8(table, lo), flip);
                q[g + 4] = _mm512_xor_si512(_mm512_shuffle_epi8(table, hi), flip);
            }
            // the rows' `d` times the sub-block scales, once for every activation row (exact
            // in f32: a 6-bit integer times an f16), as `x86_tiled`'s kernels apply them
            let sd = _mm512_mul_ps(
                d,
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes8x2(t0, t1, SCX + 8 * ib))),
            );
            for j in 0..N {
                let y = a[j].get_unchecked(8 * b + ib);
                let yp = y.qs.as_ptr();
                let mut pp = [_mm512_setzero_si512(); 2];
                for (k, qk) in q.iter().enumerate() {
                    pp[k & 1] = _mm512_dpbusd_epi32(pp[k & 1], *qk, bcast(yp, 4 * k));
                }
                let p = _mm512_sub_epi32(
                    _mm512_add_epi32(pp[0], pp[1]),
                    _mm512_set1_epi32(128 * y.sum),
                );
                acc[j] = _mm512_fmadd_ps(
                    _mm512_mul_ps(sd, _mm512_set1_ps(y.d)),
                    _mm512_cvtepi32_ps(p),
                    acc[j],
                );
            }
        }
    }
    let mut out = [[0f32; PAIR_ROWS]; N];
    for j in 0..N {
        _mm512_storeu_ps(out[j].as_mut_ptr(), acc[j]);
    }
    out
}

/// Q4_K (`HIGH` false) or Q5_K (`HIGH` true): tiles `w0` and `w1` (the same number of tile
/// blocks) against `N` activation rows; `out[j][r]` is row `r` of the pair (tile 0's rows
/// first) against activation row `j`.
///
/// # Safety
/// The CPU has AVX-512 F/BW/VL/VNNI, F16C; `w0` and `w1` are whole tile blocks of the type,
/// equally long; every activation row has at least as many super-blocks.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn tile2_q45k<const N: usize, const HIGH: bool>(
    w0: &[u8],
    w1: &[u8],
    a: [&[BlockQ8K]; N],
    prefetch: bool,
) -> [[f32; PAIR_ROWS]; N] {
    use k_offsets::*;
    let tb = if HIGH { 1440 } else { 1184 };
    let qs_off = if HIGH { QS5 } else { QS4 };
    let m4 = _mm512_set1_epi8(0x0F);
    let one = _mm512_set1_epi8(1);
    let mut acc = [_mm512_setzero_ps(); N];
    let next = w1.as_ptr().wrapping_add(w1.len());
    for b in 0..w0.len() / tb {
        let (t0, t1) = (w0.as_ptr().add(b * tb), w1.as_ptr().add(b * tb));
        if prefetch {
            prefetch_next_pair(next, b, tb);
        }
        let d = f16x16(t0, t1, 0);
        let dmin = f16x16(t0, t1, 16);
        let mut fsum = [_mm512_setzero_ps(); N];
        let mut msum = [_mm512_setzero_si512(); N];
        for c in 0..4 {
            let mut lo = [_mm512_setzero_si512(); 8];
            let mut hi = [_mm512_setzero_si512(); 8];
            for g in 0..8 {
                let v = ld2(t0, t1, qs_off + 256 * c + 32 * g);
                lo[g] = _mm512_and_si512(v, m4);
                hi[g] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4);
                if HIGH {
                    let h = ld2(t0, t1, QH5 + 32 * g);
                    let hl =
                        _mm512_and_si512(_mm512_srl_epi16(h, _mm_cvtsi32_si128(2 * c as i32)), one);
                    let hh = _mm512_and_si512(
                        _mm512_srl_epi16(h, _mm_cvtsi32_si128(2 * c as i32 + 1)),
                        one,
                    );
                    lo[g] = _mm512_or_si512(lo[g], _mm512_slli_epi16::<4>(hl));
                    hi[g] = _mm512_or_si512(hi[g], _mm512_slli_epi16::<4>(hh));
                }
            }
            let sc_lo = u8x16_ps(t0, t1, SC + 8 * (2 * c));
            let sc_hi = u8x16_ps(t0, t1, SC + 8 * (2 * c + 1));
            for j in 0..N {
                let y = a[j].get_unchecked(b).qs.as_ptr().add(64 * c);
                let mut pl = _mm512_setzero_si512();
                let mut ph = _mm512_setzero_si512();
                for g in 0..8 {
                    pl = _mm512_dpbusd_epi32(pl, lo[g], bcast(y, 4 * g));
                    ph = _mm512_dpbusd_epi32(ph, hi[g], bcast(y, 32 + 4 * g));
                }
                fsum[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pl), sc_lo, fsum[j]);
                fsum[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ph), sc_hi, fsum[j]);
            }
        }
        for s2 in 0..4 {
            let pair = pairs16x2(t0, t1, MN + 16 * s2);
            for j in 0..N {
                let y = a[j].get_unchecked(b);
                let b0 = y.bsums[4 * s2] as i32 + y.bsums[4 * s2 + 1] as i32;
                let b1 = y.bsums[4 * s2 + 2] as i32 + y.bsums[4 * s2 + 3] as i32;
                let bs = _mm512_set1_epi32((b1 << 16) | (b0 & 0xFFFF));
                msum[j] = _mm512_add_epi32(msum[j], _mm512_madd_epi16(pair, bs));
            }
        }
        for j in 0..N {
            let yd = _mm512_set1_ps(a[j].get_unchecked(b).d);
            acc[j] = _mm512_fmadd_ps(_mm512_mul_ps(d, yd), fsum[j], acc[j]);
            acc[j] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, yd), _mm512_cvtepi32_ps(msum[j]), acc[j]);
        }
    }
    let mut out = [[0f32; PAIR_ROWS]; N];
    for j in 0..N {
        _mm512_storeu_ps(out[j].as_mut_ptr(), acc[j]);
    }
    out
}

/// Eight signed bytes of each tile at `off` (one per row), as 16 f32.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn i8x16_ps(t0: *const u8, t1: *const u8, off: usize) -> __m512 {
    let b = bytes8x2(t0, t1, off);
    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))
}

/// As [`pairs16x2`], sign-extended (Q6_K's scales are signed).
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pairs16x2_signed(t0: *const u8, t1: *const u8, off: usize) -> __m512i {
    let pair = |t: *const u8| {
        _mm_unpacklo_epi8(
            _mm_loadl_epi64(t.add(off) as *const __m128i),
            _mm_loadl_epi64(t.add(off + 8) as *const __m128i),
        )
    };
    _mm512_cvtepi8_epi16(_mm256_set_m128i(pair(t1), pair(t0)))
}

/// Q6_K, its codes kept whole ([`super::tiled::HighBits::Whole`]): tiles `w0` and `w1`
/// against `N` activation rows, as [`tile2_q45k`].
///
/// # Safety
/// As [`tile2_q45k`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn tile2_q6k<const N: usize>(
    w0: &[u8],
    w1: &[u8],
    a: [&[BlockQ8K]; N],
    prefetch: bool,
) -> [[f32; PAIR_ROWS]; N] {
    use k_offsets::*;
    let tb = 1680;
    let low6 = _mm512_set1_epi8(0x3F);
    let top2 = _mm512_set1_epi8(0xC0u8 as i8);
    let mut acc = [_mm512_setzero_ps(); N];
    let next = w1.as_ptr().wrapping_add(w1.len());
    for b in 0..w0.len() / tb {
        let (t0, t1) = (w0.as_ptr().add(b * tb), w1.as_ptr().add(b * tb));
        if prefetch {
            prefetch_next_pair(next, b, tb);
        }
        let d = f16x16(t0, t1, 0);
        let mut fsum = [_mm512_setzero_ps(); N];
        for n in 0..2 {
            for h in 0..2 {
                // groups 4h..4h+4 of half n: values 4g..4g+4 of each quarter
                let mut q = [[_mm512_setzero_si512(); 4]; 4];
                for (gi, qg) in q.iter_mut().enumerate() {
                    // codes kept whole, as `x86_tiled::q6_codes_whole` reads them
                    let g = 4 * h + gi;
                    let a0 = ld2(t0, t1, QL6 + 512 * n + 32 * g);
                    let a1 = ld2(t0, t1, QL6 + 512 * n + 256 + 32 * g);
                    let a2 = ld2(t0, t1, QH6 + 256 * n + 32 * g);
                    let mut c3 = _mm512_and_si512(a2, top2);
                    c3 = _mm512_or_si512(_mm512_srli_epi16::<2>(c3), _mm512_and_si512(a1, top2));
                    c3 = _mm512_or_si512(_mm512_srli_epi16::<2>(c3), _mm512_and_si512(a0, top2));
                    qg[0] = _mm512_and_si512(a0, low6);
                    qg[1] = _mm512_and_si512(a1, low6);
                    qg[2] = _mm512_and_si512(a2, low6);
                    qg[3] = _mm512_srli_epi16::<2>(c3);
                }
                let sc: [__m512; 4] =
                    core::array::from_fn(|k| i8x16_ps(t0, t1, SC6 + 8 * (8 * n + 2 * k + h)));
                for j in 0..N {
                    let y = a[j].get_unchecked(b).qs.as_ptr().add(128 * n);
                    let mut p = [_mm512_setzero_si512(); 4];
                    for (gi, qg) in q.iter().enumerate() {
                        let g = 4 * h + gi;
                        for k in 0..4 {
                            p[k] = _mm512_dpbusd_epi32(p[k], qg[k], bcast(y, 32 * k + 4 * g));
                        }
                    }
                    for k in 0..4 {
                        fsum[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p[k]), sc[k], fsum[j]);
                    }
                }
            }
        }
        // every code carries an offset of 32: subtract 32 * scale * 16-sum
        let mut off = [_mm512_setzero_si512(); N];
        for s2 in 0..8 {
            let pair = pairs16x2_signed(t0, t1, SC6 + 16 * s2);
            for j in 0..N {
                let y = a[j].get_unchecked(b);
                let (b0, b1) = (y.bsums[2 * s2] as i32, y.bsums[2 * s2 + 1] as i32);
                let bs = _mm512_set1_epi32((b1 << 16) | (b0 & 0xFFFF));
                off[j] = _mm512_add_epi32(off[j], _mm512_madd_epi16(pair, bs));
            }
        }
        for j in 0..N {
            let yd = _mm512_set1_ps(a[j].get_unchecked(b).d);
            let o = _mm512_cvtepi32_ps(_mm512_slli_epi32::<5>(off[j]));
            acc[j] = _mm512_fmadd_ps(_mm512_mul_ps(d, yd), _mm512_sub_ps(fsum[j], o), acc[j]);
        }
    }
    let mut out = [[0f32; PAIR_ROWS]; N];
    for j in 0..N {
        _mm512_storeu_ps(out[j].as_mut_ptr(), acc[j]);
    }
    out
}

/// Each row's value in both 32-bit lanes of its pair: lane `i` of the result is lane `i / 2`
/// of the eight-lane `x`, as the one-tile kernels on the eight-byte layout
/// ([`super::tiled::HighBits::Wide`]) hold rows (lanes `2 r`, `2 r + 1`: a code vector's
/// first and last four codes of row `r`).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn row_pairs(x: __m256i) -> __m512i {
    let idx = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    _mm512_permutexvar_epi32(idx, _mm512_castsi256_si512(x))
}

/// Eight f32 per row (lane `r`) from sixteen lanes holding each row twice over (lanes `2 r`
/// and `2 r + 1`), the two added.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn fold_rows(x: __m512) -> __m256 {
    let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm256_add_ps(
        _mm512_castps512_ps256(_mm512_permutexvar_ps(even, x)),
        _mm512_castps512_ps256(_mm512_permutexvar_ps(odd, x)),
    )
}

/// The eight activations at `y` in every 64-bit lane: each row's eight codes of a code
/// vector on the eight-byte layout meet them, the first four in its even 32-bit lane.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn bcast8(y: *const i8) -> __m512i {
    _mm512_set1_epi64((y as *const i64).read_unaligned())
}

/// `acc` plus, per 32-bit lane, `wa * (dot(u[0], s[0]) + dot(u[1], s[1])) + wb *
/// (dot(u[2], s[2]) + dot(u[3], s[3]))` (`wa`, `wb` the 16-bit halves of the lane of `w`):
/// two sub-blocks of two code vectors each, their sums (half a sub-block per lane, within
/// +-2^15 for codes below 16) made the halves of each lane and scaled by one `vpdpwssd`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn pair_wide(acc: __m512i, u: &[__m512i; 4], s: &[__m512i; 4], w: __m512i) -> __m512i {
    let a = _mm512_dpbusd_epi32(
        _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0], s[0]),
        u[1],
        s[1],
    );
    let b = _mm512_dpbusd_epi32(
        _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[2], s[2]),
        u[3],
        s[3],
    );
    let halves = _mm512_mask_blend_epi16(0xAAAA_AAAA, a, _mm512_slli_epi32::<16>(b));
    _mm512_dpwssd_epi32(acc, halves, w)
}

/// Q2_K tile row against `N` activation rows, on the eight-byte layout
/// ([`super::tiled::HighBits::Wide`]): the arithmetic of `x86_tiled`'s Q2_K kernel in
/// 512-bit vectors, each holding eight codes of each of the tile's eight rows. Decode (`N`
/// 1) prefetches as the other K-quants do.
///
/// # Safety
/// The CPU has AVX-512 F/BW/VL/VNNI, F16C; `w` is whole Q2_K tile blocks of that layout;
/// every activation row has at least as many super-blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn tile_q2k<const N: usize>(w: &[u8], a: [&[BlockQ8K]; N]) -> [[f32; TILE_ROWS]; N] {
    q2k_with::<N>(w, a, Prefetch::for_rows(N))
}

/// [`tile_q2k`] with the prefetch distances `pf` (used when `N` is 1). Per half `n`, the
/// four group vectors are loaded once; quarter `(n, k)` takes bits `2 k` of them as `code`
/// (k 0, 2) or `4 code` (k 1, 3, whose sums are divided by 4 at the end, exactly).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q2k_with<const N: usize>(
    w: &[u8],
    a: [&[BlockQ8K]; N],
    pf: Prefetch,
) -> [[f32; TILE_ROWS]; N] {
    use k_offsets::*;
    let tb = 672;
    let (m3, m12) = (_mm512_set1_epi8(3), _mm512_set1_epi8(12));
    let m15 = _mm256_set1_epi16(0x0F);
    // lanes 2r, 2r + 1: row r's scaled code sums; lane r: its minimums' part
    let mut acc = [_mm512_setzero_ps(); N];
    let mut acc_min = [_mm256_setzero_ps(); N];
    for b in 0..w.len() / tb {
        let t = w.as_ptr().add(b * tb);
        let d = _mm256_cvtph_ps(_mm_loadu_si128(t as *const __m128i));
        let d2 = _mm512_permutexvar_ps(
            _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
            _mm512_castps256_ps512(d),
        );
        let dmin = _mm256_cvtph_ps(_mm_loadu_si128(t.add(16) as *const __m128i));
        let mut even = [_mm512_setzero_si512(); N];
        let mut odd = [_mm512_setzero_si512(); N];
        let mut mins = [_mm256_setzero_si256(); N];
        for n in 0..2 {
            let mut v: [__m512i; 4] = core::array::from_fn(|g| {
                _mm512_loadu_si512(t.add(QS2 + 256 * n + 64 * g) as *const __m512i)
            });
            for k in 0..4 {
                let q = 4 * n + k;
                if N == 1 && k % 2 == 0 {
                    prefetch_quarter(t, tb, q / 2, pf);
                }
                if k == 2 {
                    v = v.map(|x| _mm512_srli_epi16::<4>(x));
                }
                let u = v.map(|x| _mm512_and_si512(x, if k % 2 == 0 { m3 } else { m12 }));
                // (scale | minimum << 4) of sub-blocks 2q and 2q + 1, per row
                let x =
                    _mm256_cvtepu8_epi16(_mm_loadu_si128(t.add(SC2 + 16 * q) as *const __m128i));
                let sc = row_pairs(_mm256_and_si256(x, m15));
                let mn = _mm256_srli_epi16::<4>(x);
                for j in 0..N {
                    let y = a[j].get_unchecked(b);
                    let yq = y.qs.as_ptr().add(32 * q);
                    let s: [__m512i; 4] = core::array::from_fn(|g| bcast8(yq.add(8 * g)));
                    if k % 2 == 0 {
                        even[j] = pair_wide(even[j], &u, &s, sc);
                    } else {
                        odd[j] = pair_wide(odd[j], &u, &s, sc);
                    }
                    // the 16-value sums of sub-blocks 2q and 2q + 1 as one i32
                    let bs = (y.bsums.as_ptr().add(2 * q) as *const i32).read_unaligned();
                    mins[j] = _mm256_dpwssd_epi32(mins[j], mn, _mm256_set1_epi32(bs));
                }
            }
        }
        for j in 0..N {
            let yd = a[j].get_unchecked(b).d;
            let sum = _mm512_add_epi32(even[j], _mm512_srai_epi32::<2>(odd[j]));
            let dy = _mm512_mul_ps(d2, _mm512_set1_ps(yd));
            acc[j] = _mm512_fmadd_ps(dy, _mm512_cvtepi32_ps(sum), acc[j]);
            let my = _mm256_mul_ps(dmin, _mm256_set1_ps(yd));
            acc_min[j] = _mm256_fnmadd_ps(my, _mm256_cvtepi32_ps(mins[j]), acc_min[j]);
        }
    }
    let mut out = [[0f32; TILE_ROWS]; N];
    for j in 0..N {
        _mm256_storeu_ps(
            out[j].as_mut_ptr(),
            _mm256_add_ps(fold_rows(acc[j]), acc_min[j]),
        );
    }
    out
}

/// The eight code vectors of a Q3_K unit of the eight-byte layout from its three group
/// vectors at `p` (`super::tiled::q3k_pack`), as `x86_tiled::q3_codes_avx2` unpacks them
/// with codes 6 and 7 put together by one ternary-logic op each: their top bit is masked
/// before its shift, so it arrives alone in bit 2, and the op keeps bits 0-1 of the shifted
/// low part and ors the top bit in.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn q3_codes(p: *const u8) -> [__m512i; 8] {
    let ld = |at: usize| _mm512_loadu_si512(p.add(at) as *const __m512i);
    let (a, b, c) = (ld(0), ld(64), ld(128));
    let (m3, m7) = (_mm512_set1_epi8(3), _mm512_set1_epi8(7));
    let and = _mm512_and_si512;
    let top6 = _mm512_srli_epi16::<4>(and(c, _mm512_set1_epi8(0x40)));
    let top7 = _mm512_srli_epi16::<5>(and(c, _mm512_set1_epi8(0x80u8 as i8)));
    [
        and(a, m7),
        and(_mm512_srli_epi16::<3>(a), m7),
        and(b, m7),
        and(_mm512_srli_epi16::<3>(b), m7),
        and(c, m7),
        and(_mm512_srli_epi16::<3>(c), m7),
        // table 0xEC is `(a & c) | b`
        _mm512_ternarylogic_epi32::<0xEC>(_mm512_srli_epi16::<6>(a), top6, m3),
        _mm512_ternarylogic_epi32::<0xEC>(_mm512_srli_epi16::<6>(b), top7, m3),
    ]
}

/// Q3_K tile row against `N` activation rows, on the eight-byte layout, as [`tile_q2k`]:
/// per unit (two quarters), eight code vectors of whole codes (0..8), each quarter's two
/// sub-blocks scaled in one multiply-add; the codes' offset of 4 is taken back with the
/// activation's 16-value sums times the scales.
///
/// # Safety
/// As [`tile_q2k`], for Q3_K.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn tile_q3k<const N: usize>(w: &[u8], a: [&[BlockQ8K]; N]) -> [[f32; TILE_ROWS]; N] {
    q3k_with::<N>(w, a, Prefetch::for_rows(N))
}

/// [`tile_q3k`] with the prefetch distances `pf` (used when `N` is 1).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q3k_with<const N: usize>(
    w: &[u8],
    a: [&[BlockQ8K]; N],
    pf: Prefetch,
) -> [[f32; TILE_ROWS]; N] {
    use k_offsets::*;
    let tb = 912;
    // lanes 2r, 2r + 1: row r's scaled code sums; lane r: its offsets' part
    let mut acc = [_mm512_setzero_ps(); N];
    let mut acc_off = [_mm256_setzero_ps(); N];
    for b in 0..w.len() / tb {
        let t = w.as_ptr().add(b * tb);
        let d = _mm256_cvtph_ps(_mm_loadu_si128(t as *const __m128i));
        let d2 = _mm512_permutexvar_ps(
            _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
            _mm512_castps256_ps512(d),
        );
        let mut sums = [_mm512_setzero_si512(); N];
        let mut offs = [_mm256_setzero_si256(); N];
        for unit in 0..4 {
            if N == 1 {
                prefetch_quarter(t, tb, unit, pf);
            }
            let codes = q3_codes(t.add(QS3 + 192 * unit));
            for h in 0..2 {
                let q = 2 * unit + h;
                let u: [__m512i; 4] = core::array::from_fn(|g| codes[4 * h + g]);
                // the signed scales of sub-blocks 2q and 2q + 1, per row
                let x =
                    _mm256_cvtepi8_epi16(_mm_loadu_si128(t.add(SC3 + 16 * q) as *const __m128i));
                let sc = row_pairs(x);
                for j in 0..N {
                    let y = a[j].get_unchecked(b);
                    let yq = y.qs.as_ptr().add(32 * q);
                    let s: [__m512i; 4] = core::array::from_fn(|g| bcast8(yq.add(8 * g)));
                    sums[j] = pair_wide(sums[j], &u, &s, sc);
                    let bs = (y.bsums.as_ptr().add(2 * q) as *const i32).read_unaligned();
                    offs[j] = _mm256_dpwssd_epi32(offs[j], x, _mm256_set1_epi32(bs));
                }
            }
        }
        for j in 0..N {
            let yd = a[j].get_unchecked(b).d;
            let dy = _mm512_mul_ps(d2, _mm512_set1_ps(yd));
            acc[j] = _mm512_fmadd_ps(dy, _mm512_cvtepi32_ps(sums[j]), acc[j]);
            let o = _mm256_cvtepi32_ps(_mm256_slli_epi32::<2>(offs[j]));
            acc_off[j] = _mm256_fnmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(yd)), o, acc_off[j]);
        }
    }
    let mut out = [[0f32; TILE_ROWS]; N];
    for j in 0..N {
        _mm256_storeu_ps(
            out[j].as_mut_ptr(),
            _mm256_add_ps(fold_rows(acc[j]), acc_off[j]),
        );
    }
    out
}

/// [`tile_q2k`] over whole tiles `w` (each `tile_bytes` long) against one activation row,
/// tile `i`'s eight results to `out[8 i..8 i + 8]` (decode), the prefetch distances read
/// once per call.
///
/// # Safety
/// As [`tile_q2k`]; `out` has room for eight values per tile.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
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
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn run_q3k(w: &[u8], tile_bytes: usize, a: &[BlockQ8K], out: *mut f32) {
    let pf = Prefetch::current();
    each_tile(w, tile_bytes, out, |t| {
        let [o] = q3k_with::<1>(t, [a], pf);
        o
    })
}
