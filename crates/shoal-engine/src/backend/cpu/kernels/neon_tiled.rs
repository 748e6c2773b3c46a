//! AArch64 kernels over the tiled layout of [`super::tiled`], the NEON counterpart of
//! `x86_tiled`: eight weight rows against `N` activation rows per call, one block column at
//! a time. A tile's 32-byte code vector is two 16-byte NEON vectors, rows 0-3 and rows 4-7,
//! each holding four codes per row; against four activations copied to every lane, lane `r`
//! of an 8-bit dot product accumulates row `r`'s sum with no horizontal reduction. The
//! kernels run the two halves of a tile one after the other, so each half's codes, scales
//! and sums fit the 32 vector registers. Codes are signed bytes (nibbles, 5- and 6-bit
//! values, Q8_0 as stored, IQ4_NL's, IQ4_XS's and MXFP4's grid values looked up with `tbl`),
//! so unlike x86 no offset needs taking back for Q8_0.
//!
//! Written once, compiled for two levels: `neon`, where the 8-bit dot product is two
//! widening multiplies and two pairwise adds (every arm64 CPU: Cortex-A53/A72, the
//! Raspberry Pi 3 and 4), and `neondot`, one `sdot` instruction (Armv8.2 `dotprod`: Apple
//! M1 on, Graviton 2 on, Cortex-A76 on, the Raspberry Pi 5). Both give the same integer
//! sums. `sdot` and the f16 scale conversion (`fcvtl`) are written as inline assembly: their
//! Rust intrinsics are not stable yet. No software prefetch: arm64 cores' stream prefetchers
//! follow the kernels' one forward stream. Callers must have checked the CPU features and
//! that every activation row has a block per block column of the tile row.

#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::aarch64::*;
use std::arch::asm;

use super::each_tile;
use super::formats::{e8m0_half, BlockQ8, BlockQ8K, IQ4_VALUES, MXFP4_VALUES};
use super::tiled::kinds::{
    block_bytes, has_high_bit, has_min, is_grid, offsets, IQ4_NL, MXFP4, Q4_0, Q5_0, Q8_0,
};
use super::tiled::{k_offsets, TILE_ROWS};

/// Rows in one half of a tile (one 128-bit vector of i32 or f32 lanes).
const HALF: usize = TILE_ROWS / 2;

/// The one-row run kernels of one level of this module, over its `tile_dot`, `tile_q45k`,
/// `tile_q6k`, `tile_q2k` and `tile_q3k` compiled for `$features`: whole tiles `w` (each `tile_bytes` long) against one
/// activation row, tile `i`'s eight results to `out[8 i..8 i + 8]`. One call per range of
/// tiles, the one-tile kernel inlined: no call, result copy and bounds arithmetic per tile,
/// which a decode would otherwise pay on every tile of every matrix.
macro_rules! run_kernels {
    ($features:literal) => {
        /// [`tile_dot`] over whole tiles, one activation row (see `run_kernels`).
        ///
        /// # Safety
        /// As [`tile_dot`]; `out` has room for eight values per tile.
        #[target_feature(enable = $features)]
        pub unsafe fn run_dot<const KIND: u8>(
            w: &[u8],
            tile_bytes: usize,
            a: &[BlockQ8],
            out: *mut f32,
        ) {
            each_tile(w, tile_bytes, out, |t| {
                let [o] = tile_dot::<1, KIND>(t, [a]);
                o
            })
        }

        /// [`run_dot`] for IQ4_XS.
        ///
        /// # Safety
        /// As [`tile_iq4xs`]; `out` has room for eight values per tile.
        #[target_feature(enable = $features)]
        pub unsafe fn run_iq4xs(w: &[u8], tile_bytes: usize, a: &[BlockQ8], out: *mut f32) {
            each_tile(w, tile_bytes, out, |t| {
                let [o] = tile_iq4xs::<1>(t, [a]);
                o
            })
        }

        /// [`run_dot`] for Q4_K (`HIGH` false) and Q5_K (`HIGH` true).
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
            each_tile(w, tile_bytes, out, |t| {
                let [o] = tile_q45k::<1, HIGH>(t, [a]);
                o
            })
        }

        /// [`run_dot`] for Q6_K.
        ///
        /// # Safety
        /// As [`tile_q6k`]; `out` has room for eight values per tile.
        #[target_feature(enable = $features)]
        pub unsafe fn run_q6k(w: &[u8], tile_bytes: usize, a: &[BlockQ8K], out: *mut f32) {
            each_tile(w, tile_bytes, out, |t| {
                let [o] = tile_q6k::<1>(t, [a]);
                o
            })
        }

        /// [`run_dot`] for Q2_K.
        ///
        /// # Safety
        /// As [`tile_q2k`]; `out` has room for eight values per tile.
        #[target_feature(enable = $features)]
        pub unsafe fn run_q2k(w: &[u8], tile_bytes: usize, a: &[BlockQ8K], out: *mut f32) {
            each_tile(w, tile_bytes, out, |t| {
                let [o] = tile_q2k::<1>(t, [a]);
                o
            })
        }

        /// [`run_dot`] for Q3_K.
        ///
        /// # Safety
        /// As [`tile_q3k`]; `out` has room for eight values per tile.
        #[target_feature(enable = $features)]
        pub unsafe fn run_q3k(w: &[u8], tile_bytes: usize, a: &[BlockQ8K], out: *mut f32) {
            each_tile(w, tile_bytes, out, |t| {
                let [o] = tile_q3k::<1>(t, [a]);
                o
            })
        }
    };
}

/// Four f16 values at `p` as f32 (`fcvtl`, exact, Armv8.0).
#[inline]
#[target_feature(enable = "neon")]
unsafe fn f16x4(p: *const u8) -> float32x4_t {
    let h = vld1_u16(p as *const u16);
    let r: float32x4_t;
    // SAFETY: fcvtl only reads and writes the named vector registers.
    asm!(
        "fcvtl {0:v}.4s, {1:v}.4h",
        out(vreg) r,
        in(vreg) h,
        options(pure, nomem, nostack, preserves_flags)
    );
    r
}

/// Four bytes at `p` (one per row), widened to f32, unsigned.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn u8x4_f32(p: *const u8) -> float32x4_t {
    let b = vmovl_u8(vcreate_u8((p as *const u32).read_unaligned() as u64));
    vcvtq_f32_u32(vmovl_u16(vget_low_u16(b)))
}

/// Four bytes at `p` (one per row), widened to f32, signed.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn i8x4_f32(p: *const u8) -> float32x4_t {
    let b = vmovl_s8(vcreate_s8((p as *const u32).read_unaligned() as u64));
    vcvtq_f32_s32(vmovl_s16(vget_low_s16(b)))
}

/// Four bytes at `p` (one per row), widened to i16 lanes 0-3, unsigned or signed.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn bytes4_i16(p: *const u8, signed: bool) -> int16x4_t {
    let w = vcreate_u8((p as *const u32).read_unaligned() as u64);
    if signed {
        vget_low_s16(vmovl_s8(vreinterpret_s8_u8(w)))
    } else {
        vget_low_s16(vreinterpretq_s16_u16(vmovl_u8(w)))
    }
}

/// The four activation bytes at `y + at` in every lane.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn bcast(y: *const i8, at: usize) -> int8x16_t {
    vreinterpretq_s8_s32(vdupq_n_s32((y.add(at) as *const i32).read_unaligned()))
}

#[inline]
#[target_feature(enable = "neon")]
unsafe fn ld(p: *const u8) -> uint8x16_t {
    vld1q_u8(p)
}

/// The grid of `kind` (IQ4_NL or MXFP4) as a `tbl` table: its sixteen signed values.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn grid_table(kind: u8) -> uint8x16_t {
    let values = if kind == MXFP4 {
        &MXFP4_VALUES
    } else {
        &IQ4_VALUES
    };
    vld1q_u8(values.as_ptr() as *const u8)
}

/// Four MXFP4 scale bytes (E8M0, one per row) at `p` as f32 halves, as
/// [`e8m0_half`] computes them.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn e8m0x4(p: *const u8) -> float32x4_t {
    let v: [f32; 4] = std::array::from_fn(|i| e8m0_half(*p.add(i)));
    vld1q_f32(v.as_ptr())
}

/// Plain NEON: `acc + sums of four i8 x i8 products` per lane, exact (a product fits i16).
#[inline]
#[target_feature(enable = "neon")]
pub(super) unsafe fn dot_neon(acc: int32x4_t, q: int8x16_t, y: int8x16_t) -> int32x4_t {
    let lo = vpaddlq_s16(vmull_s8(vget_low_s8(q), vget_low_s8(y)));
    let hi = vpaddlq_s16(vmull_high_s8(q, y));
    vaddq_s32(acc, vpaddq_s32(lo, hi))
}

/// `dotprod`: the same in one `sdot`.
#[inline]
#[target_feature(enable = "neon,dotprod")]
pub(super) unsafe fn dot_sdot(mut acc: int32x4_t, q: int8x16_t, y: int8x16_t) -> int32x4_t {
    // SAFETY: sdot only reads and writes the named vector registers; the caller's level
    // includes dotprod.
    asm!(
        "sdot {0:v}.4s, {1:v}.16b, {2:v}.16b",
        inout(vreg) acc,
        in(vreg) q,
        in(vreg) y,
        options(pure, nomem, nostack, preserves_flags)
    );
    acc
}

/// A half's pair field of a Q2_K/Q3_K tile block at `p` (eight bytes: each of four rows'
/// two sub-block bytes, see [`super::tiled`]) as the rows' first and second bytes in lanes
/// 0-3 of two 16-bit vectors, zero- or sign-extended.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn pair_bytes(p: *const u8, signed: bool) -> (int16x8_t, int16x8_t) {
    let b = vld1_u8(p);
    let x = if signed {
        vmovl_s8(vreinterpret_s8_u8(b))
    } else {
        vreinterpretq_s16_u16(vmovl_u8(b))
    };
    (vuzp1q_s16(x, x), vuzp2q_s16(x, x))
}

/// Lanes 0-3 of `x` widened to i32.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn low_i32(x: int16x8_t) -> int32x4_t {
    vmovl_s16(vget_low_s16(x))
}

/// Bit `i % 8` of byte `i / 8` of `bits` (two bytes) set as 0x10 in byte `i`, or'ed into
/// `q`: the Q5 types' 5th bits for one half of a tile's code vector.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn with_high_bit(q: uint8x16_t, bits: u16) -> uint8x16_t {
    const SELECT: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
    let b = vcombine_u8(vdup_n_u8(bits as u8), vdup_n_u8((bits >> 8) as u8));
    let set = vtstq_u8(b, vld1q_u8(SELECT.as_ptr()));
    vorrq_u8(q, vandq_u8(set, vdupq_n_u8(0x10)))
}

macro_rules! neon_kernels {
    ($name:ident, $features:literal, $dot:ident) => {
        /// Tiled kernels for one arm64 feature level.
        pub mod $name {
            use super::*;

            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn dot(acc: int32x4_t, q: uint8x16_t, y: int8x16_t) -> int32x4_t {
                $dot(acc, vreinterpretq_s8_u8(q), y)
            }

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
                let (m_off, mask_off, qs_off) = offsets(KIND);
                let m4 = vdupq_n_u8(0x0F);
                let offset: i32 = match KIND {
                    Q4_0 => 8,
                    Q5_0 => 16,
                    _ => 0,
                };
                let mut acc = [[vdupq_n_f32(0.0); 2]; N];
                for b in 0..w.len() / tb {
                    let t = w.as_ptr().add(b * tb);
                    for hf in 0..2 {
                        let d = if KIND == MXFP4 {
                            e8m0x4(t.add(HALF * hf))
                        } else {
                            f16x4(t.add(2 * HALF * hf))
                        };
                        let m = if has_min(KIND) {
                            f16x4(t.add(m_off + 2 * HALF * hf))
                        } else {
                            vdupq_n_f32(0.0)
                        };
                        let mut q = [vdupq_n_u8(0); 8];
                        if KIND == Q8_0 {
                            for (k, qk) in q.iter_mut().enumerate() {
                                *qk = ld(t.add(qs_off + 32 * k + 16 * hf));
                            }
                        } else {
                            for g in 0..4 {
                                let v = ld(t.add(qs_off + 32 * g + 16 * hf));
                                q[g] = vandq_u8(v, m4);
                                q[g + 4] = vshrq_n_u8::<4>(v);
                            }
                            if has_high_bit(KIND) {
                                for (k, qk) in q.iter_mut().enumerate() {
                                    let mask =
                                        (t.add(mask_off + 4 * k) as *const u32).read_unaligned();
                                    *qk = with_high_bit(*qk, (mask >> (16 * hf)) as u16);
                                }
                            }
                            if is_grid(KIND) {
                                let table = grid_table(KIND);
                                for qk in q.iter_mut() {
                                    *qk = vqtbl1q_u8(table, *qk);
                                }
                            }
                        }
                        for j in 0..N {
                            let y = a[j].get_unchecked(b);
                            let yp = y.qs.as_ptr();
                            let mut pp = [vdupq_n_s32(0); 2];
                            for (k, qk) in q.iter().enumerate() {
                                pp[k & 1] = dot(pp[k & 1], *qk, bcast(yp, 4 * k));
                            }
                            let mut p = vaddq_s32(pp[0], pp[1]);
                            if offset != 0 {
                                p = vsubq_s32(p, vdupq_n_s32(offset * y.sum));
                            }
                            acc[j][hf] =
                                vfmaq_f32(acc[j][hf], vmulq_n_f32(d, y.d), vcvtq_f32_s32(p));
                            if has_min(KIND) {
                                acc[j][hf] = vfmaq_n_f32(acc[j][hf], m, y.s);
                            }
                        }
                    }
                }
                store(acc)
            }

            /// IQ4_XS tile row against `N` activation rows (eight [`BlockQ8`] per
            /// super-block): each 32-value sub-block is an IQ4_NL tile block whose row
            /// scales are the super-block's `d` times the sub-block's signed scale.
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
                use k_offsets::{QSX, SCX};
                let tb = QSX + 1024;
                let m4 = vdupq_n_u8(0x0F);
                let table = grid_table(IQ4_NL);
                let mut acc = [[vdupq_n_f32(0.0); 2]; N];
                for b in 0..w.len() / tb {
                    let t = w.as_ptr().add(b * tb);
                    for hf in 0..2 {
                        let d = f16x4(t.add(2 * HALF * hf));
                        for ib in 0..8 {
                            let qs = t.add(QSX + 128 * ib);
                            let mut q = [vdupq_n_u8(0); 8];
                            for g in 0..4 {
                                let v = ld(qs.add(32 * g + 16 * hf));
                                q[g] = vqtbl1q_u8(table, vandq_u8(v, m4));
                                q[g + 4] = vqtbl1q_u8(table, vshrq_n_u8::<4>(v));
                            }
                            let sp = t.add(SCX + 8 * ib + HALF * hf);
                            let bytes = (sp as *const u32).read_unaligned() as u64;
                            let sc = vmovl_s16(vget_low_s16(vmovl_s8(vcreate_s8(bytes))));
                            for j in 0..N {
                                let y = a[j].get_unchecked(8 * b + ib);
                                let yp = y.qs.as_ptr();
                                let mut pp = [vdupq_n_s32(0); 2];
                                for (k, qk) in q.iter().enumerate() {
                                    pp[k & 1] = dot(pp[k & 1], *qk, bcast(yp, 4 * k));
                                }
                                // the sub-block scale on the integer sum (exact), as the reference
                                // applies it
                                let p = vmulq_s32(vaddq_s32(pp[0], pp[1]), sc);
                                acc[j][hf] =
                                    vfmaq_f32(acc[j][hf], vmulq_n_f32(d, y.d), vcvtq_f32_s32(p));
                            }
                        }
                    }
                }
                store(acc)
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
                use k_offsets::*;
                let tb = if HIGH { 1440 } else { 1184 };
                let qs_off = if HIGH { QS5 } else { QS4 };
                let m4 = vdupq_n_u8(0x0F);
                let one = vdupq_n_u8(1);
                let mut acc = [[vdupq_n_f32(0.0); 2]; N];
                for b in 0..w.len() / tb {
                    let t = w.as_ptr().add(b * tb);
                    for hf in 0..2 {
                        let d = f16x4(t.add(2 * HALF * hf));
                        let dmin = f16x4(t.add(16 + 2 * HALF * hf));
                        // sums scaled per sub-block in f32, as x86_tiled; d and the
                        // activation scale come last
                        let mut fsum = [vdupq_n_f32(0.0); N];
                        for c in 0..4 {
                            let mut lo = [vdupq_n_u8(0); 8];
                            let mut hi = [vdupq_n_u8(0); 8];
                            for g in 0..8 {
                                let v = ld(t.add(qs_off + 1024 / 4 * c + 32 * g + 16 * hf));
                                lo[g] = vandq_u8(v, m4);
                                hi[g] = vshrq_n_u8::<4>(v);
                                if HIGH {
                                    let h = ld(t.add(QH5 + 32 * g + 16 * hf));
                                    let hl = vshlq_u8(h, vdupq_n_s8(-(2 * c as i8)));
                                    let hh = vshlq_u8(h, vdupq_n_s8(-(2 * c as i8 + 1)));
                                    lo[g] = vorrq_u8(lo[g], vshlq_n_u8::<4>(vandq_u8(hl, one)));
                                    hi[g] = vorrq_u8(hi[g], vshlq_n_u8::<4>(vandq_u8(hh, one)));
                                }
                            }
                            let sc_lo = u8x4_f32(t.add(SC + 8 * (2 * c) + HALF * hf));
                            let sc_hi = u8x4_f32(t.add(SC + 8 * (2 * c + 1) + HALF * hf));
                            for j in 0..N {
                                let y = a[j].get_unchecked(b).qs.as_ptr().add(64 * c);
                                let mut pl = [vdupq_n_s32(0); 2];
                                let mut ph = [vdupq_n_s32(0); 2];
                                for g in 0..8 {
                                    pl[g & 1] = dot(pl[g & 1], lo[g], bcast(y, 4 * g));
                                    ph[g & 1] = dot(ph[g & 1], hi[g], bcast(y, 32 + 4 * g));
                                }
                                let pl = vaddq_s32(pl[0], pl[1]);
                                let ph = vaddq_s32(ph[0], ph[1]);
                                fsum[j] = vfmaq_f32(fsum[j], vcvtq_f32_s32(pl), sc_lo);
                                fsum[j] = vfmaq_f32(fsum[j], vcvtq_f32_s32(ph), sc_hi);
                            }
                        }
                        // minimums: per row, sum over sub-blocks of min * activation sum
                        // (a min is below 64 and a 32-value sum below 2^12 in magnitude)
                        for j in 0..N {
                            let y = a[j].get_unchecked(b);
                            let mut msum = vdupq_n_s32(0);
                            for s in 0..8 {
                                let mn = bytes4_i16(t.add(MN + 8 * s + HALF * hf), false);
                                let bs = y.bsums[2 * s] + y.bsums[2 * s + 1];
                                msum = vmlal_n_s16(msum, mn, bs);
                            }
                            let yd = y.d;
                            acc[j][hf] = vfmaq_f32(acc[j][hf], vmulq_n_f32(d, yd), fsum[j]);
                            acc[j][hf] =
                                vfmsq_f32(acc[j][hf], vmulq_n_f32(dmin, yd), vcvtq_f32_s32(msum));
                        }
                    }
                }
                store(acc)
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
                use k_offsets::*;
                let tb = 1680;
                let m4 = vdupq_n_u8(0x0F);
                let m3 = vdupq_n_u8(3);
                let mut acc = [[vdupq_n_f32(0.0); 2]; N];
                for b in 0..w.len() / tb {
                    let t = w.as_ptr().add(b * tb);
                    for hf in 0..2 {
                        let d = f16x4(t.add(2 * HALF * hf));
                        let mut fsum = [vdupq_n_f32(0.0); N];
                        for n in 0..2 {
                            for h in 0..2 {
                                // groups 4h..4h+4 of half n: values 4g..4g+4 of each quarter
                                let mut q = [[vdupq_n_u8(0); 4]; 4];
                                for (gi, qg) in q.iter_mut().enumerate() {
                                    let g = 4 * h + gi;
                                    let l0 = ld(t.add(QL6 + 512 * n + 32 * g + 16 * hf));
                                    let l1 = ld(t.add(QL6 + 512 * n + 256 + 32 * g + 16 * hf));
                                    let hb = ld(t.add(QH6 + 256 * n + 32 * g + 16 * hf));
                                    let h0 = vshlq_n_u8::<4>(vandq_u8(hb, m3));
                                    let h1 = vshlq_n_u8::<4>(vandq_u8(vshrq_n_u8::<2>(hb), m3));
                                    let h2 = vshlq_n_u8::<4>(vandq_u8(vshrq_n_u8::<4>(hb), m3));
                                    let h3 = vshlq_n_u8::<4>(vshrq_n_u8::<6>(hb));
                                    qg[0] = vorrq_u8(vandq_u8(l0, m4), h0);
                                    qg[1] = vorrq_u8(vandq_u8(l1, m4), h1);
                                    qg[2] = vorrq_u8(vshrq_n_u8::<4>(l0), h2);
                                    qg[3] = vorrq_u8(vshrq_n_u8::<4>(l1), h3);
                                }
                                let sc: [float32x4_t; 4] = core::array::from_fn(|k| {
                                    i8x4_f32(t.add(SC6 + 8 * (8 * n + 2 * k + h) + HALF * hf))
                                });
                                for j in 0..N {
                                    let y = a[j].get_unchecked(b).qs.as_ptr().add(128 * n);
                                    let mut p = [vdupq_n_s32(0); 4];
                                    for (gi, qg) in q.iter().enumerate() {
                                        let g = 4 * h + gi;
                                        for k in 0..4 {
                                            p[k] = dot(p[k], qg[k], bcast(y, 32 * k + 4 * g));
                                        }
                                    }
                                    for k in 0..4 {
                                        fsum[j] = vfmaq_f32(fsum[j], vcvtq_f32_s32(p[k]), sc[k]);
                                    }
                                }
                            }
                        }
                        // every code carries an offset of 32: subtract 32 * scale * 16-sum
                        // (a scale is an i8, a 16-value sum below 2^11 in magnitude)
                        for j in 0..N {
                            let y = a[j].get_unchecked(b);
                            let mut off = vdupq_n_s32(0);
                            for s in 0..16 {
                                let sc = bytes4_i16(t.add(SC6 + 8 * s + HALF * hf), true);
                                off = vmlal_n_s16(off, sc, y.bsums[s]);
                            }
                            let o = vcvtq_f32_s32(vshlq_n_s32::<5>(off));
                            acc[j][hf] =
                                vfmaq_f32(acc[j][hf], vmulq_n_f32(d, y.d), vsubq_f32(fsum[j], o));
                        }
                    }
                }
                store(acc)
            }

            /// Q2_K tile row against `N` rows: per quarter `(n, k)` (`q = 4 n + k`) the
            /// codes are bits `2 k` of half `n`'s group vectors; each of its two sub-blocks'
            /// sums meets its scale in a 32-bit multiply-add, the minimums the
            /// activation's 16-value sums.
            ///
            /// # Safety
            /// As [`tile_q45k`].
            #[inline]
            #[target_feature(enable = $features)]
            pub unsafe fn tile_q2k<const N: usize>(
                w: &[u8],
                a: [&[BlockQ8K]; N],
            ) -> [[f32; TILE_ROWS]; N] {
                use k_offsets::*;
                let tb = 672;
                let m3 = vdupq_n_u8(3);
                let m15 = vdupq_n_s16(0x0F);
                let mut acc = [[vdupq_n_f32(0.0); 2]; N];
                for b in 0..w.len() / tb {
                    let t = w.as_ptr().add(b * tb);
                    for hf in 0..2 {
                        let d = f16x4(t.add(2 * HALF * hf));
                        let dmin = f16x4(t.add(16 + 2 * HALF * hf));
                        let mut sums = [vdupq_n_s32(0); N];
                        let mut mins = [vdupq_n_s32(0); N];
                        for q in 0..8 {
                            let (n, k) = (q / 4, q % 4);
                            let u: [uint8x16_t; 8] = core::array::from_fn(|g| {
                                let v = ld(t.add(QS2 + 256 * n + 32 * g + 16 * hf));
                                match k {
                                    0 => vandq_u8(v, m3),
                                    1 => vandq_u8(vshrq_n_u8::<2>(v), m3),
                                    2 => vandq_u8(vshrq_n_u8::<4>(v), m3),
                                    _ => vshrq_n_u8::<6>(v),
                                }
                            });
                            // (scale | minimum << 4) of sub-blocks 2q and 2q + 1
                            let (xa, xb) = pair_bytes(t.add(SC2 + 16 * q + HALF * 2 * hf), false);
                            let (sa, sb) =
                                (low_i32(vandq_s16(xa, m15)), low_i32(vandq_s16(xb, m15)));
                            let ma = vget_low_s16(vshrq_n_s16::<4>(xa));
                            let mb = vget_low_s16(vshrq_n_s16::<4>(xb));
                            for j in 0..N {
                                let y = a[j].get_unchecked(b);
                                let yq = y.qs.as_ptr().add(32 * q);
                                let mut pa = [vdupq_n_s32(0); 2];
                                let mut pb = [vdupq_n_s32(0); 2];
                                for g in 0..4 {
                                    pa[g & 1] = dot(pa[g & 1], u[g], bcast(yq, 4 * g));
                                    pb[g & 1] = dot(pb[g & 1], u[g + 4], bcast(yq, 16 + 4 * g));
                                }
                                sums[j] = vmlaq_s32(sums[j], vaddq_s32(pa[0], pa[1]), sa);
                                sums[j] = vmlaq_s32(sums[j], vaddq_s32(pb[0], pb[1]), sb);
                                mins[j] = vmlal_n_s16(mins[j], ma, y.bsums[2 * q]);
                                mins[j] = vmlal_n_s16(mins[j], mb, y.bsums[2 * q + 1]);
                            }
                        }
                        for j in 0..N {
                            let yd = a[j].get_unchecked(b).d;
                            acc[j][hf] =
                                vfmaq_f32(acc[j][hf], vmulq_n_f32(d, yd), vcvtq_f32_s32(sums[j]));
                            acc[j][hf] = vfmsq_f32(
                                acc[j][hf],
                                vmulq_n_f32(dmin, yd),
                                vcvtq_f32_s32(mins[j]),
                            );
                        }
                    }
                }
                store(acc)
            }

            /// Q3_K tile row against `N` rows: per quarter, eight code vectors of whole
            /// codes (0..8, [`super::super::tiled::q3k_pack`]); the codes' offset of 4 is
            /// taken back with the activation's 16-value sums times the scales.
            ///
            /// # Safety
            /// As [`tile_q45k`].
            #[inline]
            #[target_feature(enable = $features)]
            pub unsafe fn tile_q3k<const N: usize>(
                w: &[u8],
                a: [&[BlockQ8K]; N],
            ) -> [[f32; TILE_ROWS]; N] {
                use k_offsets::*;
                let tb = 912;
                let (m4, m7) = (vdupq_n_u8(4), vdupq_n_u8(7));
                let mut acc = [[vdupq_n_f32(0.0); 2]; N];
                for b in 0..w.len() / tb {
                    let t = w.as_ptr().add(b * tb);
                    for hf in 0..2 {
                        let d = f16x4(t.add(2 * HALF * hf));
                        let mut sums = [vdupq_n_s32(0); N];
                        let mut offs = [vdupq_n_s32(0); N];
                        for q in 0..8 {
                            let p = t.add(QS3 + 96 * q + 16 * hf);
                            let (x, y, z) = (ld(p), ld(p.add(32)), ld(p.add(64)));
                            let u = [
                                vandq_u8(x, m7),
                                vandq_u8(vshrq_n_u8::<3>(x), m7),
                                vandq_u8(y, m7),
                                vandq_u8(vshrq_n_u8::<3>(y), m7),
                                vandq_u8(z, m7),
                                vandq_u8(vshrq_n_u8::<3>(z), m7),
                                vorrq_u8(vshrq_n_u8::<6>(x), vandq_u8(vshrq_n_u8::<4>(z), m4)),
                                vorrq_u8(vshrq_n_u8::<6>(y), vandq_u8(vshrq_n_u8::<5>(z), m4)),
                            ];
                            let (sa, sb) = pair_bytes(t.add(SC3 + 16 * q + HALF * 2 * hf), true);
                            let (sa16, sb16) = (vget_low_s16(sa), vget_low_s16(sb));
                            let (sa, sb) = (low_i32(sa), low_i32(sb));
                            for j in 0..N {
                                let yb = a[j].get_unchecked(b);
                                let yq = yb.qs.as_ptr().add(32 * q);
                                let mut pa = [vdupq_n_s32(0); 2];
                                let mut pb = [vdupq_n_s32(0); 2];
                                for g in 0..4 {
                                    pa[g & 1] = dot(pa[g & 1], u[g], bcast(yq, 4 * g));
                                    pb[g & 1] = dot(pb[g & 1], u[g + 4], bcast(yq, 16 + 4 * g));
                                }
                                sums[j] = vmlaq_s32(sums[j], vaddq_s32(pa[0], pa[1]), sa);
                                sums[j] = vmlaq_s32(sums[j], vaddq_s32(pb[0], pb[1]), sb);
                                offs[j] = vmlal_n_s16(offs[j], sa16, yb.bsums[2 * q]);
                                offs[j] = vmlal_n_s16(offs[j], sb16, yb.bsums[2 * q + 1]);
                            }
                        }
                        for j in 0..N {
                            let yd = a[j].get_unchecked(b).d;
                            let s = vsubq_s32(sums[j], vshlq_n_s32::<2>(offs[j]));
                            acc[j][hf] =
                                vfmaq_f32(acc[j][hf], vmulq_n_f32(d, yd), vcvtq_f32_s32(s));
                        }
                    }
                }
                store(acc)
            }

            /// The two halves of each row's accumulators, as eight outputs.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn store<const N: usize>(acc: [[float32x4_t; 2]; N]) -> [[f32; TILE_ROWS]; N] {
                let mut out = [[0f32; TILE_ROWS]; N];
                for j in 0..N {
                    vst1q_f32(out[j].as_mut_ptr(), acc[j][0]);
                    vst1q_f32(out[j].as_mut_ptr().add(HALF), acc[j][1]);
                }
                out
            }

            // one activation row over a range of tiles, for decode
            run_kernels!($features);
        }
    };
}

neon_kernels!(neon, "neon", dot_neon);
neon_kernels!(neondot, "neon,dotprod", dot_sdot);
