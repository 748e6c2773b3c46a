//! x86-64 kernels for float weights (F32, F16), which stay in the row layout: one weight row
//! against `N` activation rows with 8-wide FMA, F16 widened by F16C. Written once and
//! compiled for both x86 levels by [`x86_kernels!`]. The quantized types use the tiled kernels
//! of `x86_tiled`. Callers must have checked the CPU features.

#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;

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

macro_rules! x86_kernels {
    ($name:ident, $features:literal) => {
        /// Kernels for one x86 feature level.
        pub mod $name {
            use super::*;

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

x86_kernels!(avx2, "avx2,fma,f16c");
x86_kernels!(avx512vnni, "avx2,fma,f16c,avx512vl,avx512vnni");

/// XOR of all 32-byte lanes of `buf` (its length a multiple of 128), read the way the
/// one-row kernels read weights (32-byte loads, software prefetch ahead): the memory
/// bandwidth probe behind every decode ceiling shoal prints.
///
/// # Safety
/// The CPU has AVX2.
#[target_feature(enable = "avx2")]
pub unsafe fn stream_checksum(buf: &[u8]) -> u64 {
    let p = buf.as_ptr();
    let mut acc = [_mm256_setzero_si256(); 4];
    let mut i = 0;
    while i + 128 <= buf.len() {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(i + 2048) as *const i8);
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(i + 2048 + 64) as *const i8);
        for (k, a) in acc.iter_mut().enumerate() {
            *a = _mm256_xor_si256(*a, _mm256_loadu_si256(p.add(i + 32 * k) as *const __m256i));
        }
        i += 128;
    }
    let x = _mm256_xor_si256(_mm256_xor_si256(acc[0], acc[1]), _mm256_xor_si256(acc[2], acc[3]));
    let mut lanes = [0u64; 4];
    _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, x);
    lanes.iter().fold(0, |a, &b| a ^ b)
}
