//! Plain, obviously-correct code the fast kernels are checked against: dequantizing a row of
//! any weight type to f32 (also how the embedding table is read), and a dot product in f64 of
//! dequantized weights with dequantized activations.

use super::formats::{
    bf16_at, e8m0_half, f16_at, iq4xs_scale, k2_code, k3_high, k3_scales, k4_scale_min, WeightType,
    IQ4_VALUES, MXFP4_VALUES, QK, QK_K,
};
#[cfg(test)]
use super::formats::{BlockQ8, BlockQ8K};
use super::iquants;

/// Dequantizes one row (`bytes` holds whole blocks) into `out` (one value per element).
///
/// # Panics
/// When `bytes` and `out` disagree in length (callers check shapes first).
pub fn dequantize_row(ty: WeightType, bytes: &[u8], out: &mut [f32]) {
    let bb = ty.block_bytes();
    let be = ty.block_elems();
    assert_eq!(bytes.len() / bb * be, out.len(), "row length");
    for (b, o) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(be)) {
        dequantize_block(ty, b, o);
    }
}

fn dequantize_block(ty: WeightType, b: &[u8], o: &mut [f32]) {
    match ty {
        WeightType::F32 => o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        WeightType::F16 => o[0] = f16_at(b, 0),
        WeightType::Bf16 => o[0] = bf16_at(b, 0),
        WeightType::Q4_0 => {
            let d = f16_at(b, 0);
            for i in 0..QK / 2 {
                o[i] = ((b[2 + i] & 0xF) as i32 - 8) as f32 * d;
                o[i + 16] = ((b[2 + i] >> 4) as i32 - 8) as f32 * d;
            }
        }
        WeightType::Q4_1 => {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            for i in 0..QK / 2 {
                o[i] = (b[4 + i] & 0xF) as f32 * d + m;
                o[i + 16] = (b[4 + i] >> 4) as f32 * d + m;
            }
        }
        WeightType::Q5_0 => {
            let d = f16_at(b, 0);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            for i in 0..QK / 2 {
                let h0 = ((qh >> i) & 1) << 4;
                let h1 = ((qh >> (i + 16)) & 1) << 4;
                o[i] = (((b[6 + i] & 0xF) as u32 | h0) as i32 - 16) as f32 * d;
                o[i + 16] = (((b[6 + i] >> 4) as u32 | h1) as i32 - 16) as f32 * d;
            }
        }
        WeightType::Q5_1 => {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
            for i in 0..QK / 2 {
                let h0 = ((qh >> i) & 1) << 4;
                let h1 = ((qh >> (i + 16)) & 1) << 4;
                o[i] = ((b[8 + i] & 0xF) as u32 | h0) as f32 * d + m;
                o[i + 16] = ((b[8 + i] >> 4) as u32 | h1) as f32 * d + m;
            }
        }
        WeightType::Q8_0 => {
            let d = f16_at(b, 0);
            for i in 0..QK {
                o[i] = b[2 + i] as i8 as f32 * d;
            }
        }
        WeightType::Q4K => {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let scales = &b[4..16];
            let qs = &b[16..144];
            for c in 0..4 {
                let (sc0, m0) = k4_scale_min(2 * c, scales);
                let (sc1, m1) = k4_scale_min(2 * c + 1, scales);
                for l in 0..32 {
                    let q = qs[32 * c + l];
                    o[64 * c + l] = d * sc0 as f32 * (q & 0xF) as f32 - dmin * m0 as f32;
                    o[64 * c + 32 + l] = d * sc1 as f32 * (q >> 4) as f32 - dmin * m1 as f32;
                }
            }
        }
        WeightType::Q5K => {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let scales = &b[4..16];
            let qh = &b[16..48];
            let qs = &b[48..176];
            for c in 0..4 {
                let (sc0, m0) = k4_scale_min(2 * c, scales);
                let (sc1, m1) = k4_scale_min(2 * c + 1, scales);
                for l in 0..32 {
                    let q = qs[32 * c + l];
                    let h0 = ((qh[l] >> (2 * c)) & 1) << 4;
                    let h1 = ((qh[l] >> (2 * c + 1)) & 1) << 4;
                    o[64 * c + l] = d * sc0 as f32 * ((q & 0xF) | h0) as f32 - dmin * m0 as f32;
                    o[64 * c + 32 + l] = d * sc1 as f32 * ((q >> 4) | h1) as f32 - dmin * m1 as f32;
                }
            }
        }
        WeightType::Q6K => {
            let d = f16_at(b, 208);
            for n in 0..2 {
                let ql = &b[64 * n..64 * n + 64];
                let qh = &b[128 + 32 * n..128 + 32 * n + 32];
                let sc = &b[192 + 8 * n..192 + 8 * n + 8];
                let o = &mut o[128 * n..128 * n + 128];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                    let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                    o[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                    o[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                    o[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                    o[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                }
            }
        }
        WeightType::Q2K => {
            // scales[16] (scale | minimum << 4 per 16 values), qs[64], d, dmin
            let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
            for (v, o) in o.iter_mut().enumerate() {
                let sc = b[v / 16];
                let dl = d * (sc & 0xF) as f32;
                let ml = dmin * (sc >> 4) as f32;
                *o = dl * k2_code(&b[16..80], v) as f32 - ml;
            }
        }
        WeightType::Iq4Nl => lut_block(&IQ4_VALUES, f16_at(b, 0), &b[2..18], o),
        WeightType::Mxfp4 => lut_block(&MXFP4_VALUES, e8m0_half(b[0]), &b[1..17], o),
        WeightType::Iq4Xs => {
            // d, scales_h, scales_l[4], then 16 code bytes per 32-value sub-block
            let d = f16_at(b, 0);
            for ib in 0..8 {
                let dl = d * iq4xs_scale(b, ib) as f32;
                let qs = &b[8 + 16 * ib..8 + 16 * ib + 16];
                lut_block(&IQ4_VALUES, dl, qs, &mut o[32 * ib..32 * ib + 32]);
            }
        }
        WeightType::Iq1S
        | WeightType::Iq1M
        | WeightType::Iq2Xxs
        | WeightType::Iq2Xs
        | WeightType::Iq2S
        | WeightType::Iq3Xxs
        | WeightType::Iq3S => {
            let mut vals = [0i8; QK_K];
            let mut scales = [0f32; 16];
            iquants::decode(ty, b, &mut vals, &mut scales);
            for (i, o) in o.iter_mut().enumerate() {
                *o = scales[i / 16] * vals[i] as f32;
            }
        }
        WeightType::Q3K => {
            // hmask[32], qs[64], scales[12], d; codes 0..8 stand for -4..4
            let d = f16_at(b, 108);
            let sc = k3_scales(&b[96..108]);
            for (v, o) in o.iter_mut().enumerate() {
                let q = k2_code(&b[32..96], v) | (k3_high(&b[..32], v) << 2);
                *o = d * sc[v / 16] as f32 * (q as i32 - 4) as f32;
            }
        }
    }
}

/// 32 values whose 4-bit codes `qs` (value `j` in the low nibble of byte `j`, value `j + 16`
/// in its high nibble) index `values`, times `d`.
fn lut_block(values: &[i8; 16], d: f32, qs: &[u8], o: &mut [f32]) {
    for i in 0..QK / 2 {
        o[i] = d * values[(qs[i] & 0xF) as usize] as f32;
        o[i + 16] = d * values[(qs[i] >> 4) as usize] as f32;
    }
}

#[cfg(test)]
/// The values a [`BlockQ8`] row stands for.
pub fn dequantize_q8(blocks: &[BlockQ8]) -> Vec<f32> {
    blocks
        .iter()
        .flat_map(|b| b.qs.iter().map(move |&q| b.d * q as f32))
        .collect()
}

#[cfg(test)]
/// The values a [`BlockQ8K`] row stands for.
pub fn dequantize_q8k(blocks: &[BlockQ8K]) -> Vec<f32> {
    blocks
        .iter()
        .flat_map(|b| b.qs.iter().map(move |&q| b.d * q as f32))
        .collect()
}

#[cfg(test)]
/// `sum(w[i] * a[i])` in f64, with the weights of row `bytes` dequantized; also returns
/// `sum(|w[i] * a[i]|)`, the scale a float tolerance is relative to.
pub fn dot_f64(ty: WeightType, bytes: &[u8], a: &[f32]) -> (f64, f64) {
    let mut w = vec![0f32; a.len()];
    dequantize_row(ty, bytes, &mut w);
    w.iter().zip(a).fold((0f64, 0f64), |(s, m), (&w, &a)| {
        let p = w as f64 * a as f64;
        (s + p, m + p.abs())
    })
}

fn put_f16(b: &mut [u8], at: usize, v: f32) {
    b[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
}

/// `rows` rows of `blocks` random blocks of type `ty` with sane scales (random bytes, then
/// every f16 field set to a small finite value): test and benchmark data.
pub fn synthetic_matrix(ty: WeightType, rows: usize, blocks: usize, seed: u64) -> Vec<u8> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let bb = ty.block_bytes();
    let mut data = vec![0u8; rows * blocks * bb];
    rng.fill(&mut data[..]);
    for b in data.chunks_exact_mut(bb) {
        match ty {
            WeightType::F32 => b.copy_from_slice(&rng.random_range(-1f32..1.0).to_le_bytes()),
            WeightType::F16 => put_f16(b, 0, rng.random_range(-1f32..1.0)),
            WeightType::Bf16 => b.copy_from_slice(
                &half::bf16::from_f32(rng.random_range(-1f32..1.0))
                    .to_bits()
                    .to_le_bytes(),
            ),
            WeightType::Q4_0 | WeightType::Q5_0 | WeightType::Q8_0 => {
                put_f16(b, 0, rng.random_range(0.001f32..0.1))
            }
            WeightType::Q4_1 | WeightType::Q5_1 | WeightType::Q4K | WeightType::Q5K => {
                put_f16(b, 0, rng.random_range(0.001f32..0.1));
                put_f16(b, 2, rng.random_range(-0.1f32..0.1));
            }
            WeightType::Q6K => put_f16(b, 208, rng.random_range(0.001f32..0.05)),
            WeightType::Q2K => {
                put_f16(b, 80, rng.random_range(0.001f32..0.1));
                put_f16(b, 82, rng.random_range(-0.1f32..0.1));
            }
            WeightType::Q3K => put_f16(b, 108, rng.random_range(0.001f32..0.05)),
            WeightType::Iq4Nl => put_f16(b, 0, rng.random_range(0.0001f32..0.001)),
            WeightType::Iq4Xs => put_f16(b, 0, rng.random_range(0.00001f32..0.0001)),
            // scales 2^-12 .. 2^-4 (bytes 116..124), as trained weights have
            WeightType::Mxfp4 => b[0] = rng.random_range(116u8..124),
            // the grid i-quants' values run to tens of `d` (IQ1: units of `d`)
            WeightType::Iq2Xxs
            | WeightType::Iq2Xs
            | WeightType::Iq2S
            | WeightType::Iq3Xxs
            | WeightType::Iq3S => put_f16(b, 0, rng.random_range(0.0002f32..0.002)),
            WeightType::Iq1S => put_f16(b, 0, rng.random_range(0.002f32..0.02)),
            WeightType::Iq1M => {
                // `d`'s four nibbles are the top nibbles of the four scale words (bytes 48..56)
                let bits = half::f16::from_f32(rng.random_range(0.002f32..0.02)).to_bits();
                for k in 0..4 {
                    let at = 49 + 2 * k;
                    b[at] = (b[at] & 0x0F) | ((((bits >> (4 * k)) & 0xF) as u8) << 4);
                }
            }
        }
    }
    data
}
