//! x86-64 kernels for the weights that stay in the row layout: float weights (F32, F16,
//! BF16), one weight row against `N` activation rows with 8-wide FMA, F16 widened by F16C,
//! BF16 by a shift. Written once and compiled for both x86 levels by [`x86_kernels!`]. The
//! grid i-quants have their row kernels in `x86_grid`, the other quantized types the tiled
//! kernels of `x86_tiled`. Also the activations' quantization and the attention helpers.
//! Callers must have checked the CPU features.

#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;

use half::f16;

use super::formats::{round_f16, BlockQ8, BlockQ8K, QK, QK_K};

/// Horizontal sum of eight f32 lanes.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn hsum_ps(v: __m256) -> f32 {
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

/// The body of a float-weight kernel: `k` weights (eight at a time from `$load(i)`, the
/// rest one by one from `$scalar(l)`) against the `N` activation rows `$a`. One activation
/// row keeps four accumulators, so four FMA chains run at once and the loop is bound by
/// loads, not by the FMA latency; four rows keep one each (16 accumulators would not fit
/// AVX2's registers). The closures are expanded in place, inside the caller's features.
macro_rules! float_rows {
    ($k:expr, $a:expr, |$i:ident| $load:expr, |$l:ident| $scalar:expr) => {{
        let k = $k;
        let a = $a;
        const CHAINS: usize = 4;
        let chains = if N == 1 { CHAINS } else { 1 };
        let mut acc = [[_mm256_setzero_ps(); CHAINS]; N];
        let mut at = 0;
        while at + 8 * chains <= k {
            for c in 0..chains {
                let $i = at + 8 * c;
                let x = $load;
                for j in 0..N {
                    let y = _mm256_loadu_ps(a[j].as_ptr().add($i));
                    acc[j][c] = _mm256_fmadd_ps(x, y, acc[j][c]);
                }
            }
            at += 8 * chains;
        }
        while at + 8 <= k {
            let $i = at;
            let x = $load;
            for j in 0..N {
                acc[j][0] = _mm256_fmadd_ps(x, _mm256_loadu_ps(a[j].as_ptr().add($i)), acc[j][0]);
            }
            at += 8;
        }
        let mut out = [0f32; N];
        for j in 0..N {
            let s = _mm256_add_ps(
                _mm256_add_ps(acc[j][0], acc[j][1]),
                _mm256_add_ps(acc[j][2], acc[j][3]),
            );
            out[j] = hsum_ps(s);
            for $l in at..k {
                out[j] += $scalar * *a[j].get_unchecked($l);
            }
        }
        out
    }};
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
                let wp = w.as_ptr() as *const f32;
                float_rows!(w.len() / 4, a, |i| _mm256_loadu_ps(wp.add(i)), |l| wp
                    .add(l)
                    .read_unaligned())
            }

            /// F16 weights · f32 activations.
            ///
            /// # Safety
            /// The CPU has the features; each activation row is at least `w.len() / 2` long.
            #[target_feature(enable = $features)]
            pub unsafe fn f16w<const N: usize>(w: &[u8], a: [&[f32]; N]) -> [f32; N] {
                let wp = w.as_ptr();
                float_rows!(
                    w.len() / 2,
                    a,
                    |i| _mm256_cvtph_ps(_mm_loadu_si128(wp.add(2 * i) as *const __m128i)),
                    |l| f16_at(wp.add(2 * l))
                )
            }

            /// BF16 weights · f32 activations: each weight widened to 32 bits and shifted
            /// into an f32's top half.
            ///
            /// # Safety
            /// The CPU has the features; each activation row is at least `w.len() / 2` long.
            #[target_feature(enable = $features)]
            pub unsafe fn bf16w<const N: usize>(w: &[u8], a: [&[f32]; N]) -> [f32; N] {
                let wp = w.as_ptr();
                float_rows!(
                    w.len() / 2,
                    a,
                    |i| {
                        let h = _mm_loadu_si128(wp.add(2 * i) as *const __m128i);
                        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
                    },
                    |l| {
                        let bits = (wp.add(2 * l) as *const u16).read_unaligned();
                        f32::from_bits((bits as u32) << 16)
                    }
                )
            }
        }
    };
}

x86_kernels!(avx2, "avx2,fma,f16c");
x86_kernels!(avx512vnni, "avx2,fma,f16c,avx512vl,avx512vnni");

/// XOR of all 32-byte lanes of `buf` (its length a multiple of 128), read the way the
/// one-row kernels read weights (32-byte loads, software prefetch into L1 `ahead` bytes
/// ahead and into L2 `l2` bytes ahead, each left out when 0): the memory bandwidth probe
/// behind every decode ceiling shoal prints.
///
/// # Safety
/// The CPU has AVX2.
#[target_feature(enable = "avx2")]
pub unsafe fn stream_checksum(buf: &[u8], ahead: usize, l2: usize) -> u64 {
    let p = buf.as_ptr();
    let mut acc = [_mm256_setzero_si256(); 4];
    let mut i = 0;
    while i + 128 <= buf.len() {
        if ahead > 0 {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(i + ahead) as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(i + ahead + 64) as *const i8);
        }
        if l2 > 0 {
            _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(i + l2) as *const i8);
            _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(i + l2 + 64) as *const i8);
        }
        for (k, a) in acc.iter_mut().enumerate() {
            *a = _mm256_xor_si256(*a, _mm256_loadu_si256(p.add(i + 32 * k) as *const __m256i));
        }
        i += 128;
    }
    let x = _mm256_xor_si256(
        _mm256_xor_si256(acc[0], acc[1]),
        _mm256_xor_si256(acc[2], acc[3]),
    );
    let mut lanes = [0u64; 4];
    _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, x);
    lanes.iter().fold(0, |a, &b| a ^ b)
}

/// How far ahead [`lane_maxima`] asks for its values, in values (2 KiB).
const ARGMAX_AHEAD: usize = 512;

/// Per lane `k` of eight, the largest of `xs[k]`, `xs[k + 8]`, ... (an ordered compare:
/// NaN never wins) and the first index where it was reached; minus infinity at index 0 when
/// no value is larger. Four running maxima per lane, each over every fourth vector, so the
/// compare-and-blend chains overlap (a single chain waits about six cycles per eight
/// values on the compare and blend before it); they are merged at the end, the smaller
/// index winning a tie, which keeps the first index where the lane's maximum is reached.
///
/// # Safety
/// The CPU has AVX2; `xs.len()` is a multiple of 8 below 2^32.
#[target_feature(enable = "avx2")]
pub unsafe fn lane_maxima(xs: &[f32]) -> ([f32; 8], [u32; 8]) {
    const CHAINS: usize = 4;
    let p = xs.as_ptr();
    let mut best = [_mm256_set1_ps(f32::NEG_INFINITY); CHAINS];
    let mut at = [_mm256_setzero_si256(); CHAINS];
    let mut idx: [__m256i; CHAINS] = core::array::from_fn(|c| {
        _mm256_add_epi32(
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            _mm256_set1_epi32(8 * c as i32),
        )
    });
    let step = _mm256_set1_epi32(8 * CHAINS as i32);
    let mut i = 0;
    while i + 8 * CHAINS <= xs.len() {
        // the logits were just written by every thread of the step: half of them lie in
        // another core's cache, and asking ahead keeps several of those lines in flight
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(i + ARGMAX_AHEAD) as *const i8);
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(i + ARGMAX_AHEAD + 16) as *const i8);
        for c in 0..CHAINS {
            let v = _mm256_loadu_ps(p.add(i + 8 * c));
            let gt = _mm256_cmp_ps::<_CMP_GT_OQ>(v, best[c]);
            best[c] = _mm256_blendv_ps(best[c], v, gt);
            at[c] = _mm256_blendv_epi8(at[c], idx[c], _mm256_castps_si256(gt));
            idx[c] = _mm256_add_epi32(idx[c], step);
        }
        i += 8 * CHAINS;
    }
    // the last few vectors on the first chain (their indices follow on from its own)
    let mut tail = _mm256_add_epi32(
        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        _mm256_set1_epi32(i as i32),
    );
    while i + 8 <= xs.len() {
        let v = _mm256_loadu_ps(p.add(i));
        let gt = _mm256_cmp_ps::<_CMP_GT_OQ>(v, best[0]);
        best[0] = _mm256_blendv_ps(best[0], v, gt);
        at[0] = _mm256_blendv_epi8(at[0], tail, _mm256_castps_si256(gt));
        tail = _mm256_add_epi32(tail, _mm256_set1_epi32(8));
        i += 8;
    }
    let (mut b, mut a) = ([[0f32; 8]; CHAINS], [[0u32; 8]; CHAINS]);
    for c in 0..CHAINS {
        _mm256_storeu_ps(b[c].as_mut_ptr(), best[c]);
        _mm256_storeu_si256(a[c].as_mut_ptr() as *mut __m256i, at[c]);
    }
    let (mut bb, mut aa) = (b[0], a[0]);
    for c in 1..CHAINS {
        for k in 0..8 {
            if b[c][k] > bb[k] || (b[c][k] == bb[k] && a[c][k] < aa[k]) {
                (bb[k], aa[k]) = (b[c][k], a[c][k]);
            }
        }
    }
    (bb, aa)
}

/// Largest |x| of 32 values at `p`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn amax32(p: *const f32) -> f32 {
    let sign = _mm256_set1_ps(-0.0);
    let mut m = _mm256_setzero_ps();
    for k in 0..4 {
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(p.add(8 * k))));
    }
    let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)))
}

/// `round_ties_even(x * s)` of eight values at `p`, as i32 lanes: the conversion rounds in
/// the MXCSR's mode, which Rust leaves at its default, to nearest with ties to even.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn scale_round(p: *const f32, s: __m256) -> __m256i {
    _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p), s))
}

/// Packs four vectors of eight i32 (each in -128..=127) into 32 bytes, in order.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn pack32(v: [__m256i; 4], out: *mut i8) {
    let a = _mm256_packs_epi32(v[0], v[1]);
    let b = _mm256_packs_epi32(v[2], v[3]);
    let c = _mm256_packs_epi16(a, b);
    // the packs interleave 128-bit lanes: restore element order
    let c = _mm256_permutevar8x32_epi32(c, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(out as *mut __m256i, c);
}

/// Sum of eight i32 lanes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn hsum_epi32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
    _mm_cvtsi128_si32(s)
}

/// [`super::formats::quantize_q8`] with AVX2, bit for bit.
///
/// # Safety
/// The CPU has AVX2; `x.len() == 32 * out.len()`.
#[target_feature(enable = "avx2")]
pub unsafe fn quantize_q8(x: &[f32], out: &mut [BlockQ8]) {
    for (i, b) in out.iter_mut().enumerate() {
        let p = x.as_ptr().add(i * QK);
        let amax = amax32(p);
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
        let v: [__m256i; 4] = core::array::from_fn(|k| scale_round(p.add(8 * k), id));
        pack32(v, b.qs.as_mut_ptr());
        let sum = hsum_epi32(_mm256_add_epi32(
            _mm256_add_epi32(v[0], v[1]),
            _mm256_add_epi32(v[2], v[3]),
        ));
        b.d = round_f16(d);
        b.s = round_f16(d * sum as f32);
        b.sum = sum;
    }
}

/// [`super::formats::quantize_q8k`] with AVX2, bit for bit. One pass finds the block's
/// largest magnitude (one horizontal reduction per block, not one per 32 values), a vector
/// compare finds the first value of that magnitude, and the 16-value sums come from one
/// transpose-and-add tree per 128 values instead of a horizontal sum each.
///
/// # Safety
/// The CPU has AVX2; `x.len() == 256 * out.len()`.
#[target_feature(enable = "avx2")]
pub unsafe fn quantize_q8k(x: &[f32], out: &mut [BlockQ8K]) {
    let sign = _mm256_set1_ps(-0.0);
    for (i, b) in out.iter_mut().enumerate() {
        let p = x.as_ptr().add(i * QK_K);
        // four running maxima, so the max chain does not wait on itself
        let mut ms = [_mm256_setzero_ps(); 4];
        for k in 0..QK_K / 32 {
            for (j, m) in ms.iter_mut().enumerate() {
                let v = _mm256_loadu_ps(p.add(32 * k + 8 * j));
                *m = _mm256_max_ps(*m, _mm256_andnot_ps(sign, v));
            }
        }
        let m = _mm256_max_ps(_mm256_max_ps(ms[0], ms[1]), _mm256_max_ps(ms[2], ms[3]));
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
        if amax == 0.0 {
            *b = BlockQ8K::default();
            continue;
        }
        // the first value of that magnitude, as the scalar scan finds it
        let av = _mm256_set1_ps(amax);
        let mut max = amax;
        for k in 0..QK_K / 8 {
            let v = _mm256_loadu_ps(p.add(8 * k));
            let eq = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(_mm256_andnot_ps(sign, v), av));
            if eq != 0 {
                max = *p.add(8 * k + eq.trailing_zeros() as usize);
                break;
            }
        }
        let iscale = -127.0 / max;
        let s = _mm256_set1_ps(iscale);
        let top = _mm256_set1_epi32(127);
        for k4 in 0..QK_K / 128 {
            // eight runs of 16 values: their sums, lane r of `sums` holding run r
            let mut runs = [_mm256_setzero_si256(); 8];
            for k in 0..4 {
                let q = p.add(128 * k4 + 32 * k);
                let v: [__m256i; 4] =
                    core::array::from_fn(|j| _mm256_min_epi32(scale_round(q.add(8 * j), s), top));
                pack32(v, b.qs.as_mut_ptr().add(128 * k4 + 32 * k));
                runs[2 * k] = _mm256_add_epi32(v[0], v[1]);
                runs[2 * k + 1] = _mm256_add_epi32(v[2], v[3]);
            }
            let sums = sum8_epi32(runs);
            let mut lanes = [0i32; 8];
            _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, sums);
            for (s, &l) in b.bsums[8 * k4..8 * k4 + 8].iter_mut().zip(&lanes) {
                *s = l as i16;
            }
            for r in 0..4 {
                b.sums32[4 * k4 + r] = b.bsums[8 * k4 + 2 * r] + b.bsums[8 * k4 + 2 * r + 1];
            }
        }
        b.d = 1.0 / iscale;
    }
}

/// Lane `r` of the result is the sum of the eight lanes of `v[r]`: a transpose-and-add
/// tree, the integer twin of [`sum8`].
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn sum8_epi32(v: [__m256i; 8]) -> __m256i {
    let a0 = _mm256_hadd_epi32(v[0], v[1]);
    let a1 = _mm256_hadd_epi32(v[2], v[3]);
    let a2 = _mm256_hadd_epi32(v[4], v[5]);
    let a3 = _mm256_hadd_epi32(v[6], v[7]);
    let b0 = _mm256_hadd_epi32(a0, a1);
    let b1 = _mm256_hadd_epi32(a2, a3);
    // b0 lanes: low half [v0 v1 v2 v3] of the low 128 bits, then the same of the high
    _mm256_add_epi32(
        _mm256_permute2x128_si256::<0x20>(b0, b1),
        _mm256_permute2x128_si256::<0x31>(b0, b1),
    )
}

/// `out[j] = scale * sum(q[i] * rows[j * q.len() + i])` for every row of f16 keys (the KV
/// cache), widened by F16C. Eight rows at a time when the head dimension is a multiple of 8:
/// each 8-wide piece of `q` is loaded once for the eight rows, and their eight sums are
/// reduced together in one transpose-and-add tree instead of eight horizontal sums.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `rows` holds `out.len()` rows of `q.len()` values.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn scores(q: &[f32], rows: &[f16], scale: f32, out: &mut [f32]) {
    let hd = q.len();
    let mut j = 0;
    if hd.is_multiple_of(8) {
        let (pq, pr) = (q.as_ptr(), rows.as_ptr());
        let sv = _mm256_set1_ps(scale);
        while j + 8 <= out.len() {
            let base = pr.add(j * hd);
            let mut acc = [_mm256_setzero_ps(); 8];
            let mut c = 0;
            while c < hd {
                let qc = _mm256_loadu_ps(pq.add(c));
                for (r, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(qc, load_f16x8(base.add(r * hd + c)), *a);
                }
                c += 8;
            }
            let s = _mm256_mul_ps(sum8(acc), sv);
            _mm256_storeu_ps(out.as_mut_ptr().add(j), s);
            j += 8;
        }
    }
    for (jj, o) in out.iter_mut().enumerate().skip(j) {
        *o = dot_f16(q, rows.get_unchecked(jj * hd..(jj + 1) * hd)) * scale;
    }
}

/// `dst[i] = src[i]` rounded to the nearest f16 (ties to even, as `half::f16::from_f32`),
/// eight at a time with F16C.
///
/// # Safety
/// The CPU has AVX2 and F16C; `dst` is at least as long as `src`.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn to_f16(src: &[f32], dst: &mut [f16]) {
    let (ps, pd) = (src.as_ptr(), dst.as_mut_ptr());
    let mut i = 0;
    while i + 8 <= src.len() {
        let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(ps.add(i)));
        _mm_storeu_si128(pd.add(i) as *mut __m128i, h);
        i += 8;
    }
    for k in i..src.len() {
        *pd.add(k) = f16::from_f32(*ps.add(k));
    }
}

/// Eight f16 values at `p` (unaligned), widened to f32.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn load_f16x8(p: *const f16) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
}

/// The horizontal sums of eight vectors, as one vector (lane `r` is the sum of `v[r]`).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn sum8(v: [__m256; 8]) -> __m256 {
    let t0 = _mm256_hadd_ps(v[0], v[1]);
    let t1 = _mm256_hadd_ps(v[2], v[3]);
    let t2 = _mm256_hadd_ps(v[4], v[5]);
    let t3 = _mm256_hadd_ps(v[6], v[7]);
    // per 128-bit half: (v0, v1, v2, v3) and (v4, v5, v6, v7) partial sums
    let u0 = _mm256_hadd_ps(t0, t1);
    let u1 = _mm256_hadd_ps(t2, t3);
    let lo = _mm256_permute2f128_ps::<0x20>(u0, u1);
    let hi = _mm256_permute2f128_ps::<0x31>(u0, u1);
    _mm256_add_ps(lo, hi)
}

/// `out += sum over j of w[j] * rows[j]` over f16 rows (the KV cache's values), added in
/// order (the same result as a running `axpy_f16` per row). The output is kept in registers
/// 64 values at a time, so a row costs its loads, widenings and FMAs only.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `rows` holds `w.len()` rows of `out.len()` values.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn weighted_sum(w: &[f32], rows: &[f16], out: &mut [f32]) {
    let hd = out.len();
    let pr = rows.as_ptr();
    let po = out.as_mut_ptr();
    let mut c = 0;
    while c + 64 <= hd {
        let mut acc: [__m256; 8] = core::array::from_fn(|k| _mm256_loadu_ps(po.add(c + 8 * k)));
        for (j, &wj) in w.iter().enumerate() {
            let wv = _mm256_set1_ps(wj);
            let row = pr.add(j * hd + c);
            for (k, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(wv, load_f16x8(row.add(8 * k)), *a);
            }
        }
        for (k, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(po.add(c + 8 * k), *a);
        }
        c += 64;
    }
    if c < hd {
        for (j, &wj) in w.iter().enumerate() {
            axpy_f16(
                &mut out[c..],
                wj,
                rows.get_unchecked(j * hd + c..(j + 1) * hd),
            );
        }
    }
}

/// [`super::math::exp`] on eight lanes, with FMA (so within a unit in the last place of the
/// portable version, not bit for bit).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp8(x: __m256) -> __m256 {
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(-87.3)),
        _mm256_set1_ps(88.3),
    );
    let round = _mm256_set1_ps(12_582_912.0);
    let m = _mm256_fmadd_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E), round);
    let n = _mm256_sub_ps(m, round);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm256_set1_ps(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let er = _mm256_add_ps(
        _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r),
        _mm256_set1_ps(1.0),
    );
    let pow2 = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_castps_si256(m),
        _mm256_set1_epi32(127),
    ));
    _mm256_mul_ps(er, _mm256_castsi256_ps(pow2))
}

/// `act(g) * u` on eight lanes: `g / (1 + e^(-z)) * u`, with `z = g` for SiLU and `2y` for
/// GELU-tanh.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn gated8(act: crate::config::Activation, g: __m256, u: __m256) -> __m256 {
    use crate::config::Activation;
    let one = _mm256_set1_ps(1.0);
    let z = match act {
        // handled by the callers (`gated`, `gated_pairs`) before they come here
        Activation::Silu | Activation::SwigluOai => g,
        Activation::GeluTanh => {
            let x2 = _mm256_mul_ps(g, g);
            let inner = _mm256_fmadd_ps(_mm256_set1_ps(0.044_715), x2, one);
            _mm256_mul_ps(_mm256_set1_ps(2.0 * 0.797_884_6), _mm256_mul_ps(g, inner))
        }
    };
    let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), z));
    _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u)
}

/// [`super::math::gated`] with [`exp8`].
///
/// # Safety
/// The CPU has AVX2 and FMA; the slices are equally long.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn gated(act: crate::config::Activation, gate: &[f32], up: &[f32], out: &mut [f32]) {
    if act == crate::config::Activation::SwigluOai {
        // its clamps have no 8-wide form here; the portable loop vectorizes on its own
        return super::math::gated(act, gate, up, out);
    }
    let n = out.len() / 8 * 8;
    let mut i = 0;
    while i < n {
        let g = _mm256_loadu_ps(gate.as_ptr().add(i));
        let u = _mm256_loadu_ps(up.as_ptr().add(i));
        _mm256_storeu_ps(out.as_mut_ptr().add(i), gated8(act, g, u));
        i += 8;
    }
    super::math::gated(act, &gate[n..], &up[n..], &mut out[n..]);
}

/// [`super::gated_pairs`]: eight gate values then their eight up values, and so on, into
/// eight outputs each, as [`gated`] computes them.
///
/// # Safety
/// The CPU has AVX2 and FMA; `pairs.len() == 2 * out.len()`, a multiple of 16.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn gated_pairs(act: crate::config::Activation, pairs: &[f32], out: &mut [f32]) {
    if act == crate::config::Activation::SwigluOai {
        for (p, o) in pairs.chunks_exact(16).zip(out.chunks_exact_mut(8)) {
            super::math::gated(act, &p[..8], &p[8..], o);
        }
        return;
    }
    for (p, o) in out.chunks_exact_mut(8).enumerate() {
        let g = _mm256_loadu_ps(pairs.as_ptr().add(16 * p));
        let u = _mm256_loadu_ps(pairs.as_ptr().add(16 * p + 8));
        _mm256_storeu_ps(o.as_mut_ptr(), gated8(act, g, u));
    }
}

/// [`super::math::softmax_weights`] with [`exp8`].
///
/// # Safety
/// The CPU has AVX2 and FMA; the slices are equally long.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn softmax_weights(logits: &[f32], max: f32, inv_temp: f32, out: &mut [f32]) -> f32 {
    let n = out.len() / 8 * 8;
    let (mv, tv) = (_mm256_set1_ps(max), _mm256_set1_ps(inv_temp));
    let inf = _mm256_set1_ps(f32::INFINITY);
    let mut sum = _mm256_setzero_ps();
    let mut i = 0;
    while i < n {
        let l = _mm256_loadu_ps(logits.as_ptr().add(i));
        let e = exp8(_mm256_mul_ps(_mm256_sub_ps(l, mv), tv));
        // finite: |l| < inf (false for NaN and both infinities)
        let abs = _mm256_andnot_ps(_mm256_set1_ps(-0.0), l);
        let finite = _mm256_cmp_ps::<_CMP_LT_OQ>(abs, inf);
        let e = _mm256_and_ps(e, finite);
        _mm256_storeu_ps(out.as_mut_ptr().add(i), e);
        sum = _mm256_add_ps(sum, e);
        i += 8;
    }
    hsum_ps(sum) + super::math::softmax_weights(&logits[n..], max, inv_temp, &mut out[n..])
}

/// [`super::math::softmax`] with [`exp8`].
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn softmax(x: &mut [f32]) {
    let n = x.len() / 8 * 8;
    let p = x.as_mut_ptr();
    let mut mv = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut i = 0;
    while i < n {
        mv = _mm256_max_ps(mv, _mm256_loadu_ps(p.add(i)));
        i += 8;
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), mv);
    let max = lanes
        .iter()
        .chain(&x[n..])
        .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let m = _mm256_set1_ps(max);
    let mut sum = _mm256_setzero_ps();
    i = 0;
    while i < n {
        let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), m));
        _mm256_storeu_ps(p.add(i), e);
        sum = _mm256_add_ps(sum, e);
        i += 8;
    }
    let mut total = hsum_ps(sum);
    for v in &mut x[n..] {
        *v = super::math::exp(*v - max);
        total += *v;
    }
    let t = _mm256_set1_ps(total);
    i = 0;
    while i < n {
        _mm256_storeu_ps(p.add(i), _mm256_div_ps(_mm256_loadu_ps(p.add(i)), t));
        i += 8;
    }
    for v in &mut x[n..] {
        *v /= total;
    }
}

/// `sum(a[i] * b[i])` over `a.len()` values, `b` in f16 (at least as long).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f16(a: &[f32], b: &[f16]) -> f32 {
    let n = a.len();
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 2];
    let mut i = 0;
    while i + 16 <= n {
        acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), load_f16x8(pb.add(i)), acc[0]);
        acc[1] = _mm256_fmadd_ps(
            _mm256_loadu_ps(pa.add(i + 8)),
            load_f16x8(pb.add(i + 8)),
            acc[1],
        );
        i += 16;
    }
    let mut s = hsum_ps(_mm256_add_ps(acc[0], acc[1]));
    while i < n {
        s += *pa.add(i) * (*pb.add(i)).to_f32();
        i += 1;
    }
    s
}

/// `y += w * x` over `y.len()` values, `x` in f16 (at least as long).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy_f16(y: &mut [f32], w: f32, x: &[f16]) {
    let n = y.len();
    let (py, px) = (y.as_mut_ptr(), x.as_ptr());
    let wv = _mm256_set1_ps(w);
    let mut i = 0;
    while i + 8 <= n {
        let v = _mm256_fmadd_ps(wv, load_f16x8(px.add(i)), _mm256_loadu_ps(py.add(i)));
        _mm256_storeu_ps(py.add(i), v);
        i += 8;
    }
    while i < n {
        *py.add(i) += w * (*px.add(i)).to_f32();
        i += 1;
    }
}
