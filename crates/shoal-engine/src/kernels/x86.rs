//! x86-64 kernels for the row layout (the K-quants and float weights; the 32-value block
//! types use the tiled kernels of `x86_tiled`), written once and compiled twice by
//! [`x86_kernels!`]: for AVX2 (with FMA and F16C), and for AVX-512 VNNI on 256-bit vectors,
//! where `vpdpwssd` fuses the scale multiply-add. Each function computes one weight row
//! against `N` activation rows, decoding every weight block once for all `N`. Callers must have checked the CPU features (see
//! [`super::Isa`]) and that each activation row has a block for every weight block.
//!
//! The integer work of a block is exact; 8-bit products are summed in pairs into 16 bits only
//! where the operands cannot overflow (|weight| <= 63 against |activation| <= 128, or
//! |weight| <= 127 against |activation| <= 127).

#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;

use super::formats::BlockQ8K;

/// Horizontal sum of eight f32 lanes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn hsum_ps(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// The f16 at `p` (unaligned), as f32.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn f16_at(p: *const u8) -> f32 {
    let bits = (p as *const u16).read_unaligned();
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

#[inline]
#[target_feature(enable = "avx2")]
unsafe fn load(p: *const i8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

/// `acc + sum of pairs of (u8 x i8 products) x scale`, scale an i16 per 16-value half.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn scaled_dot_avx2(acc: __m256i, u: __m256i, s: __m256i, scale: __m256i) -> __m256i {
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scale))
}

/// As [`scaled_dot_avx2`], with the multiply-add of VNNI.
#[inline]
#[target_feature(enable = "avx2,avx512vl,avx512vnni")]
unsafe fn scaled_dot_vnni(acc: __m256i, u: __m256i, s: __m256i, scale: __m256i) -> __m256i {
    _mm256_dpwssd_epi32(acc, _mm256_maddubs_epi16(u, s), scale)
}

macro_rules! x86_kernels {
    ($name:ident, $features:literal, $scaled:ident) => {
        /// Kernels for one x86 feature level.
        pub mod $name {
            use super::*;

            /// Q4_K · Q8K.
            ///
            /// # Safety
            /// The CPU has the features; `w` is whole 144-byte super-blocks; every
            /// [`BlockQ8K`] activation row has at least as many super-blocks.
            #[target_feature(enable = $features)]
            pub unsafe fn q4k<const N: usize>(w: &[u8], a: [&[BlockQ8K]; N]) -> [f32; N] {
                let mut acc = [_mm256_setzero_ps(); N];
                let mut mins = [0f32; N];
                let m4 = _mm256_set1_epi8(0x0F);
                for i in 0..w.len() / 144 {
                    let blk = w.get_unchecked(i * 144..i * 144 + 144);
                    let b = blk.as_ptr();
                    let (d, dmin) = (f16_at(b), f16_at(b.add(2)));
                    let (sc, mn) = crate::kernels::formats::k4_scales(&blk[4..16]);
                    let mut isum = [_mm256_setzero_si256(); N];
                    for c in 0..4 {
                        let q = _mm256_loadu_si256(b.add(16 + 32 * c) as *const __m256i);
                        let lo = _mm256_and_si256(q, m4);
                        let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                        let s_lo = _mm256_set1_epi16(sc[2 * c] as i16);
                        let s_hi = _mm256_set1_epi16(sc[2 * c + 1] as i16);
                        for j in 0..N {
                            let y = a[j].get_unchecked(i).qs.as_ptr().add(64 * c);
                            isum[j] = $scaled(isum[j], lo, load(y), s_lo);
                            isum[j] = $scaled(isum[j], hi, load(y.add(32)), s_hi);
                        }
                    }
                    for j in 0..N {
                        let y = a[j].get_unchecked(i);
                        acc[j] = _mm256_fmadd_ps(
                            _mm256_set1_ps(d * y.d),
                            _mm256_cvtepi32_ps(isum[j]),
                            acc[j],
                        );
                        let mut ms = 0i32;
                        for k in 0..8 {
                            ms +=
                                mn[k] as i32 * (y.bsums[2 * k] as i32 + y.bsums[2 * k + 1] as i32);
                        }
                        mins[j] += dmin * y.d * ms as f32;
                    }
                }
                let mut out = [0f32; N];
                for j in 0..N {
                    out[j] = hsum_ps(acc[j]) - mins[j];
                }
                out
            }

            /// Q5_K · Q8K.
            ///
            /// # Safety
            /// The CPU has the features; `w` is whole 176-byte super-blocks; every
            /// [`BlockQ8K`] activation row has at least as many super-blocks.
            #[target_feature(enable = $features)]
            pub unsafe fn q5k<const N: usize>(w: &[u8], a: [&[BlockQ8K]; N]) -> [f32; N] {
                let mut acc = [_mm256_setzero_ps(); N];
                let mut mins = [0f32; N];
                let m4 = _mm256_set1_epi8(0x0F);
                let one = _mm256_set1_epi8(1);
                for i in 0..w.len() / 176 {
                    let blk = w.get_unchecked(i * 176..i * 176 + 176);
                    let b = blk.as_ptr();
                    let (d, dmin) = (f16_at(b), f16_at(b.add(2)));
                    let (sc, mn) = crate::kernels::formats::k4_scales(&blk[4..16]);
                    let hbits = _mm256_loadu_si256(b.add(16) as *const __m256i);
                    let mut isum = [_mm256_setzero_si256(); N];
                    for c in 0..4 {
                        let q = _mm256_loadu_si256(b.add(48 + 32 * c) as *const __m256i);
                        let h_lo = _mm256_and_si256(
                            _mm256_srl_epi16(hbits, _mm_cvtsi32_si128(2 * c as i32)),
                            one,
                        );
                        let h_hi = _mm256_and_si256(
                            _mm256_srl_epi16(hbits, _mm_cvtsi32_si128(2 * c as i32 + 1)),
                            one,
                        );
                        let lo =
                            _mm256_or_si256(_mm256_and_si256(q, m4), _mm256_slli_epi16(h_lo, 4));
                        let hi = _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16(q, 4), m4),
                            _mm256_slli_epi16(h_hi, 4),
                        );
                        let s_lo = _mm256_set1_epi16(sc[2 * c] as i16);
                        let s_hi = _mm256_set1_epi16(sc[2 * c + 1] as i16);
                        for j in 0..N {
                            let y = a[j].get_unchecked(i).qs.as_ptr().add(64 * c);
                            isum[j] = $scaled(isum[j], lo, load(y), s_lo);
                            isum[j] = $scaled(isum[j], hi, load(y.add(32)), s_hi);
                        }
                    }
                    for j in 0..N {
                        let y = a[j].get_unchecked(i);
                        acc[j] = _mm256_fmadd_ps(
                            _mm256_set1_ps(d * y.d),
                            _mm256_cvtepi32_ps(isum[j]),
                            acc[j],
                        );
                        let mut ms = 0i32;
                        for k in 0..8 {
                            ms +=
                                mn[k] as i32 * (y.bsums[2 * k] as i32 + y.bsums[2 * k + 1] as i32);
                        }
                        mins[j] += dmin * y.d * ms as f32;
                    }
                }
                let mut out = [0f32; N];
                for j in 0..N {
                    out[j] = hsum_ps(acc[j]) - mins[j];
                }
                out
            }

            /// Q6_K · Q8K.
            ///
            /// # Safety
            /// The CPU has the features; `w` is whole 210-byte super-blocks; every
            /// [`BlockQ8K`] activation row has at least as many super-blocks.
            #[target_feature(enable = $features)]
            pub unsafe fn q6k<const N: usize>(w: &[u8], a: [&[BlockQ8K]; N]) -> [f32; N] {
                let mut acc = [_mm256_setzero_ps(); N];
                let mut offs = [0f32; N];
                let m4 = _mm256_set1_epi8(0x0F);
                let m3 = _mm256_set1_epi8(3);
                for i in 0..w.len() / 210 {
                    let b = w.as_ptr().add(i * 210);
                    let d = f16_at(b.add(208));
                    let sc = b.add(192) as *const i8;
                    let mut isum = [_mm256_setzero_si256(); N];
                    for n in 0..2 {
                        let ql0 = _mm256_loadu_si256(b.add(64 * n) as *const __m256i);
                        let ql1 = _mm256_loadu_si256(b.add(64 * n + 32) as *const __m256i);
                        let h = _mm256_loadu_si256(b.add(128 + 32 * n) as *const __m256i);
                        // the two high bits of value group g sit at bits 2g, 2g + 1 of `h`
                        let h0 = _mm256_slli_epi16(_mm256_and_si256(h, m3), 4);
                        let h1 =
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m3), 4);
                        let h2 =
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m3), 4);
                        let h3 =
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m3), 4);
                        let q = [
                            _mm256_or_si256(_mm256_and_si256(ql0, m4), h0),
                            _mm256_or_si256(_mm256_and_si256(ql1, m4), h1),
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), h2),
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4), h3),
                        ];
                        let mut s = [_mm256_setzero_si256(); 4];
                        for (k, sv) in s.iter_mut().enumerate() {
                            let s0 = *sc.add(8 * n + 2 * k) as i16;
                            let s1 = *sc.add(8 * n + 2 * k + 1) as i16;
                            *sv = _mm256_set_m128i(_mm_set1_epi16(s1), _mm_set1_epi16(s0));
                        }
                        for j in 0..N {
                            let y = a[j].get_unchecked(i).qs.as_ptr().add(128 * n);
                            for k in 0..4 {
                                isum[j] = $scaled(isum[j], q[k], load(y.add(32 * k)), s[k]);
                            }
                        }
                    }
                    for j in 0..N {
                        let y = a[j].get_unchecked(i);
                        acc[j] = _mm256_fmadd_ps(
                            _mm256_set1_ps(d * y.d),
                            _mm256_cvtepi32_ps(isum[j]),
                            acc[j],
                        );
                        let mut o = 0i32;
                        for k in 0..16 {
                            o += *sc.add(k) as i32 * y.bsums[k] as i32;
                        }
                        offs[j] += d * y.d * (32 * o) as f32;
                    }
                }
                let mut out = [0f32; N];
                for j in 0..N {
                    out[j] = hsum_ps(acc[j]) - offs[j];
                }
                out
            }

            /// F32 weights · f32 activations.
            ///
            /// # Safety
            /// The CPU has the features; each activation row is at least `w.len() / 4` long.
            #[target_feature(enable = $features)]
            pub unsafe fn f32w<const N: usize>(w: &[u8], a: [&[f32]; N]) -> [f32; N] {
                let k = w.len() / 4;
                let wp = w.as_ptr() as *const f32;
                let mut acc = [_mm256_setzero_ps(); N];
                let mut i = 0;
                while i + 8 <= k {
                    let x = _mm256_loadu_ps(wp.add(i));
                    for j in 0..N {
                        acc[j] = _mm256_fmadd_ps(x, _mm256_loadu_ps(a[j].as_ptr().add(i)), acc[j]);
                    }
                    i += 8;
                }
                let mut out = [0f32; N];
                for j in 0..N {
                    out[j] = hsum_ps(acc[j]);
                    for l in i..k {
                        out[j] += wp.add(l).read_unaligned() * *a[j].get_unchecked(l);
                    }
                }
                out
            }

            /// F16 weights · f32 activations.
            ///
            /// # Safety
            /// The CPU has the features; each activation row is at least `w.len() / 2` long.
            #[target_feature(enable = $features)]
            pub unsafe fn f16w<const N: usize>(w: &[u8], a: [&[f32]; N]) -> [f32; N] {
                let k = w.len() / 2;
                let wp = w.as_ptr();
                let mut acc = [_mm256_setzero_ps(); N];
                let mut i = 0;
                while i + 8 <= k {
                    let x = _mm256_cvtph_ps(_mm_loadu_si128(wp.add(2 * i) as *const __m128i));
                    for j in 0..N {
                        acc[j] = _mm256_fmadd_ps(x, _mm256_loadu_ps(a[j].as_ptr().add(i)), acc[j]);
                    }
                    i += 8;
                }
                let mut out = [0f32; N];
                for j in 0..N {
                    out[j] = hsum_ps(acc[j]);
                    for l in i..k {
                        out[j] += f16_at(wp.add(2 * l)) * *a[j].get_unchecked(l);
                    }
                }
                out
            }
        }
    };
}

x86_kernels!(avx2, "avx2,fma,f16c", scaled_dot_avx2);
x86_kernels!(
    avx512vnni,
    "avx2,fma,f16c,avx512vl,avx512vnni",
    scaled_dot_vnni
);
