//! The portable kernels: integer dot products in plain Rust, for CPUs without the SIMD
//! extensions the fast paths need (and the baseline those are measured against). Each takes
//! one weight row (whole blocks) and `N` quantized activation rows and returns `N` dot
//! products; the integer part of every block is exact, only the f32 accumulation rounds.

use super::formats::{
    bf16_at, e8m0_half, f16_at, iq4xs_scale, k3_scales, k4_scales, BlockQ8, BlockQ8K, WeightType,
    IQ4_VALUES, MXFP4_VALUES, QK, QK_K,
};
use super::iquants;

/// Q4_0 · Q8.
pub fn q4_0<const N: usize>(w: &[u8], a: [&[BlockQ8]; N]) -> [f32; N] {
    let mut out = [0f32; N];
    for (i, b) in w.chunks_exact(18).enumerate() {
        let d = f16_at(b, 0);
        for (o, a) in out.iter_mut().zip(a) {
            let y = &a[i];
            let mut s = 0i32;
            for l in 0..QK / 2 {
                s += ((b[2 + l] & 0xF) as i32 - 8) * y.qs[l] as i32;
                s += ((b[2 + l] >> 4) as i32 - 8) * y.qs[l + 16] as i32;
            }
            *o += d * y.d * s as f32;
        }
    }
    out
}

/// Q4_1 · Q8.
pub fn q4_1<const N: usize>(w: &[u8], a: [&[BlockQ8]; N]) -> [f32; N] {
    let mut out = [0f32; N];
    for (i, b) in w.chunks_exact(20).enumerate() {
        let (d, m) = (f16_at(b, 0), f16_at(b, 2));
        for (o, a) in out.iter_mut().zip(a) {
            let y = &a[i];
            let mut s = 0i32;
            for l in 0..QK / 2 {
                s += (b[4 + l] & 0xF) as i32 * y.qs[l] as i32;
                s += (b[4 + l] >> 4) as i32 * y.qs[l + 16] as i32;
            }
            *o += d * y.d * s as f32 + m * y.s;
        }
    }
    out
}

/// The 5th bits of a Q5 block, as `(low half, high half)` per nibble index.
#[inline]
fn q5_high(qh: u32, l: usize) -> (u8, u8) {
    (
        (((qh >> l) & 1) << 4) as u8,
        (((qh >> (l + 16)) & 1) << 4) as u8,
    )
}

/// Q5_0 · Q8.
pub fn q5_0<const N: usize>(w: &[u8], a: [&[BlockQ8]; N]) -> [f32; N] {
    let mut out = [0f32; N];
    for (i, b) in w.chunks_exact(22).enumerate() {
        let d = f16_at(b, 0);
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        for (o, a) in out.iter_mut().zip(a) {
            let y = &a[i];
            let mut s = 0i32;
            for l in 0..QK / 2 {
                let (h0, h1) = q5_high(qh, l);
                s += (((b[6 + l] & 0xF) | h0) as i32 - 16) * y.qs[l] as i32;
                s += (((b[6 + l] >> 4) | h1) as i32 - 16) * y.qs[l + 16] as i32;
            }
            *o += d * y.d * s as f32;
        }
    }
    out
}

/// Q5_1 · Q8.
pub fn q5_1<const N: usize>(w: &[u8], a: [&[BlockQ8]; N]) -> [f32; N] {
    let mut out = [0f32; N];
    for (i, b) in w.chunks_exact(24).enumerate() {
        let (d, m) = (f16_at(b, 0), f16_at(b, 2));
        let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        for (o, a) in out.iter_mut().zip(a) {
            let y = &a[i];
            let mut s = 0i32;
            for l in 0..QK / 2 {
                let (h0, h1) = q5_high(qh, l);
                s += ((b[8 + l] & 0xF) | h0) as i32 * y.qs[l] as i32;
                s += ((b[8 + l] >> 4) | h1) as i32 * y.qs[l + 16] as i32;
            }
            *o += d * y.d * s as f32 + m * y.s;
        }
    }
    out
}

/// The integer dot product of 32 codes `qs` (nibbles indexing `values`, laid out as Q4_0's)
/// with activation block `y`.
#[inline]
fn lut_dot(values: &[i8; 16], qs: &[u8], y: &BlockQ8) -> i32 {
    let mut s = 0i32;
    for l in 0..QK / 2 {
        s += values[(qs[l] & 0xF) as usize] as i32 * y.qs[l] as i32;
        s += values[(qs[l] >> 4) as usize] as i32 * y.qs[l + 16] as i32;
    }
    s
}

/// 32-value grid blocks (`bytes` long: a scale, `scale` reads it, then 16 code bytes) · Q8.
fn grid32<const N: usize>(
    w: &[u8],
    a: [&[BlockQ8]; N],
    bytes: usize,
    values: &[i8; 16],
    scale: fn(&[u8]) -> f32,
) -> [f32; N] {
    let mut out = [0f32; N];
    for (i, b) in w.chunks_exact(bytes).enumerate() {
        let d = scale(b);
        for (o, a) in out.iter_mut().zip(a) {
            let y = &a[i];
            *o += d * y.d * lut_dot(values, &b[bytes - 16..], y) as f32;
        }
    }
    out
}

/// IQ4_NL · Q8.
pub fn iq4nl<const N: usize>(w: &[u8], a: [&[BlockQ8]; N]) -> [f32; N] {
    grid32(w, a, 18, &IQ4_VALUES, |b| f16_at(b, 0))
}

/// MXFP4 · Q8.
pub fn mxfp4<const N: usize>(w: &[u8], a: [&[BlockQ8]; N]) -> [f32; N] {
    grid32(w, a, 17, &MXFP4_VALUES, |b| e8m0_half(b[0]))
}

/// IQ4_XS · Q8: each 32-value sub-block against its own activation block.
pub fn iq4xs<const N: usize>(w: &[u8], a: [&[BlockQ8]; N]) -> [f32; N] {
    let mut out = [0f32; N];
    for (i, b) in w.chunks_exact(136).enumerate() {
        let d = f16_at(b, 0);
        for (o, a) in out.iter_mut().zip(a) {
            for ib in 0..8 {
                let y = &a[8 * i + ib];
                let qs = &b[8 + 16 * ib..8 + 16 * ib + 16];
                let s = lut_dot(&IQ4_VALUES, qs, y) * iq4xs_scale(b, ib);
                *o += d * y.d * s as f32;
            }
        }
    }
    out
}

/// A grid i-quant ([`super::iquants`]) · Q8K: each block decoded once to small integers and
/// per-16 scales, then an exact integer sum per 16 values for every activation row.
fn iq<const N: usize>(ty: WeightType, w: &[u8], a: [&[BlockQ8K]; N]) -> [f32; N] {
    let mut out = [0f32; N];
    let mut vals = [0i8; QK_K];
    let mut scales = [0f32; 16];
    for (i, b) in w.chunks_exact(ty.block_bytes()).enumerate() {
        iquants::decode(ty, b, &mut vals, &mut scales);
        for (o, a) in out.iter_mut().zip(a) {
            let y = &a[i];
            let mut sum = 0f32;
            for (g, s) in scales.iter().enumerate() {
                let isum: i32 = vals[16 * g..16 * g + 16]
                    .iter()
                    .zip(&y.qs[16 * g..16 * g + 16])
                    .map(|(&v, &q)| v as i32 * q as i32)
                    .sum();
                sum += s * isum as f32;
            }
            *o += y.d * sum;
        }
    }
    out
}

/// IQ1_S · Q8K.
pub fn iq1s<const N: usize>(w: &[u8], a: [&[BlockQ8K]; N]) -> [f32; N] {
    iq(WeightType::Iq1S, w, a)
}

/// IQ1_M · Q8K.
pub fn iq1m<const N: usize>(w: &[u8], a: [&[BlockQ8K]; N]) -> [f32; N] {
    iq(WeightType::Iq1M, w, a)
}

/// IQ2_XXS · Q8K.
pub fn iq2xxs<const N: usize>(w: &[u8], a: [&[BlockQ8K]; N]) -> [f32; N] {
    iq(WeightType::Iq2Xxs, w, a)
}

/// IQ2_XS · Q8K.
pub fn iq2xs<const N: usize>(w: &[u8], a: [&[BlockQ8K]; N]) -> [f32; N] {
    iq(WeightType::Iq2Xs, w, a)
}

/// IQ2_S · Q8K.
pub fn iq2s<const N: usize>(w: &[u8], a: [&[BlockQ8K]; N]) -> [f32; N] {
    iq(WeightType::Iq2S, w, a)
}

/// IQ3_XXS · Q8K.
pub fn iq3xxs<const N: usize>(w: &[u8], a: [&[BlockQ8K]; N]) -> [f32; N] {
    iq(WeightType::Iq3Xxs, w, a)
}

/// IQ3_S · Q8K.
pub fn iq3s<const N: usize>(w: &[u8], a: [&[BlockQ8K]; N]) -> [f32; N] {
    iq(WeightType::Iq3S, w, a)
}

/// Q8_0 · Q8.
pub fn q8_0<const N: usize>(w: &[u8], a: [&[BlockQ8]; N]) -> [f32; N] {
    let mut out = [0f32; N];
    for (i, b) in w.chunks_exact(34).enumerate() {
        let d = f16_at(b, 0);
        for (o, a) in out.iter_mut().zip(a) {
            let y = &a[i];
            let s: i32 = b[2..34]
                .iter()
                .zip(&y.qs)
                .map(|(&q, &y)| q as i8 as i32 * y as i32)
                .sum();
            *o += d * y.d * s as f32;
        }
    }
    out
}

/// `sum over sub-blocks j of mins[j] * (bsums[2j] + bsums[2j + 1])`.
#[inline]
fn k4_min_sum(mn: &[u8; 8], bsums: &[i16; 16]) -> i32 {
    (0..8)
        .map(|j| mn[j] as i32 * (bsums[2 * j] as i32 + bsums[2 * j + 1] as i32))
        .sum()
}

/// Q4_K (`HIGH` false) or Q5_K (`HIGH` true: a 5th bit per value from `qh`) · Q8K.
pub fn q45k<const N: usize, const HIGH: bool>(w: &[u8], a: [&[BlockQ8K]; N]) -> [f32; N] {
    let (bb, qs_at) = if HIGH { (176, 48) } else { (144, 16) };
    let mut out = [0f32; N];
    for (i, b) in w.chunks_exact(bb).enumerate() {
        let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
        let (sc, mn) = k4_scales(&b[4..16]);
        let qh = &b[16..48]; // read only when HIGH
        let qs = &b[qs_at..qs_at + 128];
        for (o, a) in out.iter_mut().zip(a) {
            let y = &a[i];
            let mut s = 0i32;
            for c in 0..4 {
                let (mut lo, mut hi) = (0i32, 0i32);
                for l in 0..32 {
                    let q = qs[32 * c + l];
                    let (h0, h1) = if HIGH {
                        (
                            ((qh[l] >> (2 * c)) & 1) << 4,
                            ((qh[l] >> (2 * c + 1)) & 1) << 4,
                        )
                    } else {
                        (0, 0)
                    };
                    lo += ((q & 0xF) | h0) as i32 * y.qs[64 * c + l] as i32;
                    hi += ((q >> 4) | h1) as i32 * y.qs[64 * c + 32 + l] as i32;
                }
                s += lo * sc[2 * c] as i32 + hi * sc[2 * c + 1] as i32;
            }
            *o += d * y.d * s as f32 - dmin * y.d * k4_min_sum(&mn, &y.bsums) as f32;
        }
    }
    out
}

/// Q6_K · Q8K.
pub fn q6k<const N: usize>(w: &[u8], a: [&[BlockQ8K]; N]) -> [f32; N] {
    let mut out = [0f32; N];
    for (i, b) in w.chunks_exact(210).enumerate() {
        let d = f16_at(b, 208);
        let sc = &b[192..208];
        for (o, a) in out.iter_mut().zip(a) {
            let y = &a[i];
            let mut s = 0i32;
            for n in 0..2 {
                let ql = &b[64 * n..64 * n + 64];
                let qh = &b[128 + 32 * n..160 + 32 * n];
                let ys = &y.qs[128 * n..128 * n + 128];
                let mut sub = [0i32; 8];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
                    let q2 = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
                    let q3 = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                    let q4 = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                    sub[is] += q1 as i32 * ys[l] as i32;
                    sub[is + 2] += q2 as i32 * ys[l + 32] as i32;
                    sub[is + 4] += q3 as i32 * ys[l + 64] as i32;
                    sub[is + 6] += q4 as i32 * ys[l + 96] as i32;
                }
                for (k, v) in sub.iter().enumerate() {
                    s += sc[8 * n + k] as i8 as i32 * v;
                }
            }
            // every value carries an offset of -32: subtract 32 * sum(scale * 16-sum)
            let off: i32 = (0..16)
                .map(|k| sc[k] as i8 as i32 * y.bsums[k] as i32)
                .sum();
            *o += d * y.d * (s - 32 * off) as f32;
        }
    }
    out
}

/// `sum(code * y)` over each 16-value sub-block of a super-block whose 2-bit codes are `qs`
/// (Q2_K's, Q3_K's low bits), plus, with `HIGH`, four times the activations where `high`
/// (Q3_K's third bits) has the code's bit set. Sub-block `8 n + 2 k + h` holds values
/// `128 n + 32 k + 16 h + l` (`l` < 16), whose codes are bits `2 k` of byte
/// `32 n + 16 h + l` and third bits bit `4 n + k` of byte `16 h + l` of `high`.
#[inline(always)]
fn k23_sub_sums<const HIGH: bool>(qs: &[u8], high: &[u8], y: &BlockQ8K) -> [i32; 16] {
    let mut sub = [0i32; 16];
    for n in 0..2 {
        for h in 0..2 {
            // each code byte once, its four codes against four runs of activations
            let mut s = [0i32; 4];
            for l in 16 * h..16 * h + 16 {
                let c = qs[32 * n + l];
                for (k, sk) in s.iter_mut().enumerate() {
                    let mut q = (c >> (2 * k)) & 3;
                    if HIGH {
                        q |= ((high[l] >> (4 * n + k)) & 1) << 2;
                    }
                    *sk += q as i32 * y.qs[128 * n + 32 * k + l] as i32;
                }
            }
            for (k, sk) in s.into_iter().enumerate() {
                sub[8 * n + 2 * k + h] = sk;
            }
        }
    }
    sub
}

/// Q2_K · Q8K: per 16 values a 4-bit scale and a 4-bit minimum (one byte, scale in the low
/// nibble), 2-bit codes; value = `d * scale * code - dmin * minimum`.
pub fn q2k<const N: usize>(w: &[u8], a: [&[BlockQ8K]; N]) -> [f32; N] {
    let mut out = [0f32; N];
    for (i, b) in w.chunks_exact(84).enumerate() {
        let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
        let (sc, qs) = (&b[..16], &b[16..80]);
        for (o, a) in out.iter_mut().zip(a) {
            let y = &a[i];
            let sub = k23_sub_sums::<false>(qs, &[], y);
            let (mut s, mut m) = (0i32, 0i32);
            for j in 0..16 {
                s += (sc[j] & 0xF) as i32 * sub[j];
                m += (sc[j] >> 4) as i32 * y.bsums[j] as i32;
            }
            *o += d * y.d * s as f32 - dmin * y.d * m as f32;
        }
    }
    out
}

/// Q3_K · Q8K: per 16 values a 6-bit scale (less 32), 3-bit codes (two low bits in `qs`, the
/// third in `hmask`); value = `d * scale * (code - 4)`.
pub fn q3k<const N: usize>(w: &[u8], a: [&[BlockQ8K]; N]) -> [f32; N] {
    let mut out = [0f32; N];
    for (i, b) in w.chunks_exact(110).enumerate() {
        let d = f16_at(b, 108);
        let sc = k3_scales(&b[96..108]);
        let (hmask, qs) = (&b[..32], &b[32..96]);
        for (o, a) in out.iter_mut().zip(a) {
            let y = &a[i];
            let sub = k23_sub_sums::<true>(qs, hmask, y);
            // every code carries an offset of 4: subtract 4 * scale * 16-sum
            let s: i32 = (0..16)
                .map(|j| sc[j] as i32 * (sub[j] - 4 * y.bsums[j] as i32))
                .sum();
            *o += d * y.d * s as f32;
        }
    }
    out
}

/// F32 weights · f32 activations.
pub fn f32w<const N: usize>(w: &[u8], a: [&[f32]; N]) -> [f32; N] {
    let mut out = [0f32; N];
    for (o, a) in out.iter_mut().zip(a) {
        *o = w
            .chunks_exact(4)
            .zip(a)
            .map(|(b, &x)| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * x)
            .sum();
    }
    out
}

/// Two-byte float weights (each read by `value`) · f32 activations.
fn half_rows<const N: usize>(w: &[u8], a: [&[f32]; N], value: fn(&[u8], usize) -> f32) -> [f32; N] {
    let mut out = [0f32; N];
    for (o, a) in out.iter_mut().zip(a) {
        *o = w
            .chunks_exact(2)
            .zip(a)
            .map(|(b, &x)| value(b, 0) * x)
            .sum();
    }
    out
}

/// BF16 weights · f32 activations.
pub fn bf16w<const N: usize>(w: &[u8], a: [&[f32]; N]) -> [f32; N] {
    half_rows(w, a, bf16_at)
}

/// F16 weights · f32 activations.
pub fn f16w<const N: usize>(w: &[u8], a: [&[f32]; N]) -> [f32; N] {
    half_rows(w, a, f16_at)
}
