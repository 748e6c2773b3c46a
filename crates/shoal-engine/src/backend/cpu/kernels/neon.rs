//! AArch64 kernels for the grid i-quants, which stay in the row layout: the NEON counterpart
//! of the kernels in `x86.rs`. Per 32 values of a lattice type (IQ2_XXS, IQ2_XS,
//! IQ2_S, IQ3_XXS, IQ3_S), the four grid points' magnitudes ([`iquants::Lattice`], at most
//! 62) as two byte vectors, their sign masks negating the activations (`(q ^ m) - m`; `q`
//! is never -128), 8-bit dot products (four products summed per 32-bit lane) times each
//! 16-value half's integer scale, a block's groups summed in 32 bits (at most
//! 8 x 2 x 31 x 4 x 62 x 127 a lane), then one f32 product a block with its unit and the
//! row's `d`. IQ1_S and IQ1_M decode a block once ([`iquants::decode`]) and take 8-bit dot
//! products of its values (signed: no sign trick needed). Compiled for `neon` and `neondot`
//! with their dot products from `neon_tiled`. Callers must have checked the CPU features
//! and that every activation row has a block per block of the weight row.

#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::aarch64::*;

use super::formats::{f16_at, BlockQ8K, WeightType, QK_K};
use super::iquants::{self, Lattice};
use super::neon_tiled::{dot_neon, dot_sdot};

/// Eight bytes of `lo` then eight of `hi`, as one vector.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn bytes2(lo: u64, hi: u64) -> int8x16_t {
    vcombine_s8(vcreate_s8(lo), vcreate_s8(hi))
}

macro_rules! neon_row_kernels {
    ($name:ident, $features:literal, $dot:ident) => {
        /// Kernels for one arm64 level.
        pub mod $name {
            use super::*;

            /// A lattice i-quant · Q8K (see the module).
            ///
            /// # Safety
            /// The CPU has the features; each activation row holds a block per block of `w`.
            #[target_feature(enable = $features)]
            unsafe fn lattice<L: Lattice, const N: usize>(
                w: &[u8],
                a: [&[BlockQ8K]; N],
            ) -> [f32; N] {
                let mut acc = [vdupq_n_f32(0.0); N];
                for (i, b) in w.chunks_exact(L::TYPE.block_bytes()).enumerate() {
                    let rows: [&BlockQ8K; N] = core::array::from_fn(|j| a[j].get_unchecked(i));
                    let mut sums = [vdupq_n_s32(0); N];
                    for g in 0..QK_K / 32 {
                        let group = L::group(b, g);
                        let [m0, m1, m2, m3] = group.mags;
                        let mags = [bytes2(m0, m1), bytes2(m2, m3)];
                        let [s0, s1, s2, s3] = group.minus;
                        let minus = [bytes2(s0, s1), bytes2(s2, s3)];
                        for j in 0..N {
                            let qs = rows[j].qs.as_ptr().add(32 * g);
                            for h in 0..2 {
                                let q = vld1q_s8(qs.add(16 * h));
                                let q = vsubq_s8(veorq_s8(q, minus[h]), minus[h]);
                                let d = $dot(vdupq_n_s32(0), mags[h], q);
                                sums[j] = vmlaq_n_s32(sums[j], d, group.scales[h]);
                            }
                        }
                    }
                    let unit = L::FACTOR * f16_at(b, 0);
                    for j in 0..N {
                        acc[j] = vmlaq_n_f32(acc[j], vcvtq_f32_s32(sums[j]), unit * rows[j].d);
                    }
                }
                core::array::from_fn(|j| vaddvq_f32(acc[j]))
            }

            /// IQ1_S or IQ1_M · Q8K: each block decoded once ([`iquants::decode`], values
            /// in eighths, at most 9) to 256 small integers and 16 scales, then per 16
            /// values and activation row one 8-bit dot product, scaled in f32 by the
            /// group's scale and the row's `d`.
            ///
            /// # Safety
            /// The CPU has the features; each activation row holds a block per block of `w`.
            #[target_feature(enable = $features)]
            unsafe fn iq1<const N: usize>(
                ty: WeightType,
                w: &[u8],
                a: [&[BlockQ8K]; N],
            ) -> [f32; N] {
                let mut vals = [0i8; QK_K];
                let mut scales = [0f32; 16];
                let mut acc = [vdupq_n_f32(0.0); N];
                for (i, b) in w.chunks_exact(ty.block_bytes()).enumerate() {
                    iquants::decode(ty, b, &mut vals, &mut scales);
                    let rows: [&BlockQ8K; N] = core::array::from_fn(|j| a[j].get_unchecked(i));
                    for (g, &s) in scales.iter().enumerate() {
                        let v = vld1q_s8(vals.as_ptr().add(16 * g));
                        for j in 0..N {
                            let q = vld1q_s8(rows[j].qs.as_ptr().add(16 * g));
                            let d = $dot(vdupq_n_s32(0), v, q);
                            acc[j] = vmlaq_n_f32(acc[j], vcvtq_f32_s32(d), s * rows[j].d);
                        }
                    }
                }
                core::array::from_fn(|j| vaddvq_f32(acc[j]))
            }

            /// IQ1_S · Q8K.
            ///
            /// # Safety
            /// The CPU has the features; each activation row holds a block per block of `w`.
            #[target_feature(enable = $features)]
            pub unsafe fn iq1s<const N: usize>(w: &[u8], a: [&[BlockQ8K]; N]) -> [f32; N] {
                iq1::<N>(WeightType::Iq1S, w, a)
            }

            /// IQ1_M · Q8K.
            ///
            /// # Safety
            /// The CPU has the features; each activation row holds a block per block of `w`.
            #[target_feature(enable = $features)]
            pub unsafe fn iq1m<const N: usize>(w: &[u8], a: [&[BlockQ8K]; N]) -> [f32; N] {
                iq1::<N>(WeightType::Iq1M, w, a)
            }

            lattice_kernels! {
                $features;
                iq2xxs: Iq2Xxs, "IQ2_XXS";
                iq2xs: Iq2Xs, "IQ2_XS";
                iq2s: Iq2S, "IQ2_S";
                iq3xxs: Iq3Xxs, "IQ3_XXS";
                iq3s: Iq3S, "IQ3_S";
            }
        }
    };
}

/// One kernel per lattice type, each the level's `lattice` for its type (inside
/// `neon_row_kernels!`, so each has the level's features).
macro_rules! lattice_kernels {
    ($features:literal; $($f:ident: $ty:ident, $name:literal;)*) => {$(
        #[doc = concat!($name, " · Q8K.")]
        ///
        /// # Safety
        /// The CPU has the features; each activation row holds a block per block of `w`.
        #[target_feature(enable = $features)]
        pub unsafe fn $f<const N: usize>(w: &[u8], a: [&[BlockQ8K]; N]) -> [f32; N] {
            lattice::<iquants::$ty, N>(w, a)
        }
    )*};
}

neon_row_kernels!(neon, "neon", dot_neon);
neon_row_kernels!(neondot, "neon,dotprod", dot_sdot);
