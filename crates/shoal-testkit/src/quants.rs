//! Reference quantizers and dequantizers for the GGML tensor types the test kit writes.
//!
//! Each quantizer follows the block layout ggml uses on disk (little-endian, blocks laid one
//! after another along the innermost dimension) and the arithmetic of ggml's scalar reference
//! routines, so a file written here holds the same bytes llama.cpp's reference quantizer would
//! produce for the same input. The dequantizers turn blocks back into `f32` exactly the way
//! ggml does (`f16` scale widened to `f32`, times the integer quant), so tests can compute the
//! weights a reader must see from the exact bytes in the file.
//!
//! Block layouts:
//! - `Q8_0`: 32 values; `d: f16` (= max|x| / 127), then 32 × `i8` quants; value = `q * d`.
//! - `Q4_0`: 32 values; `d: f16` (= the value of largest magnitude / -8), then 16 bytes of
//!   nibbles: element `j` in the low nibble of byte `j`, element `j + 16` in its high nibble;
//!   value = `(nibble - 8) * d`.
//! - `Q4_1`: 32 values; `d: f16` (= (max - min) / 15), `m: f16` (= min), then 16 bytes of
//!   nibbles laid out as in `Q4_0`; value = `nibble * d + m`.
//! - `Q4_K`: 256 values in 8 sub-blocks of 32; `d: f16`, `dmin: f16`, 12 bytes packing eight
//!   6-bit scales `sc` and mins `m`, then 128 bytes of nibbles (each 32-byte run holds sub-block
//!   `2k` in its low nibbles and `2k + 1` in its high ones); value = `d*sc * q - dmin*m`.
//! - `Q6_K`: 256 values in 16 sub-blocks of 16; 128 bytes of low nibbles `ql`, 64 bytes of
//!   high bit pairs `qh`, 16 × `i8` scales, `d: f16`; value = `d * scale * (q - 32)`.
//!
//! The K-quant quantizers here are simple (min/max per sub-block, no search), so they are less
//! accurate than ggml's, but they write valid blocks and the dequantizers are exact.

use half::{bf16, f16};

use crate::TestkitError;

/// Elements per block of `Q4_0`, `Q4_1` and `Q8_0`.
pub const QK: usize = 32;
/// Bytes in one `Q8_0` block (f16 scale + 32 × i8).
pub const Q8_0_BLOCK_BYTES: usize = 2 + QK;
/// Bytes in one `Q4_0` block (f16 scale + 16 bytes of nibbles).
pub const Q4_0_BLOCK_BYTES: usize = 2 + QK / 2;
/// Bytes in one `Q4_1` block (f16 scale + f16 min + 16 bytes of nibbles).
pub const Q4_1_BLOCK_BYTES: usize = 4 + QK / 2;
/// Elements per super-block of the K-quants.
pub const QK_K: usize = 256;
/// Bytes in one `Q4_K` block (d, dmin, 12 scale bytes, 128 nibble bytes).
pub const Q4_K_BLOCK_BYTES: usize = 4 + 12 + QK_K / 2;
/// Bytes in one `Q6_K` block (ql, qh, 16 scales, d).
pub const Q6_K_BLOCK_BYTES: usize = QK_K / 2 + QK_K / 4 + QK_K / 16 + 2;

/// A GGML tensor type, with the numeric id GGUF stores in a tensor info.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)] // ggml's names
pub enum GgmlType {
    /// 32-bit float, id 0.
    F32,
    /// IEEE half, id 1.
    F16,
    /// 4-bit symmetric blocks of 32, id 2.
    Q4_0,
    /// 4-bit blocks of 32 with a minimum, id 3.
    Q4_1,
    /// 8-bit symmetric blocks of 32, id 8.
    Q8_0,
    /// 4-bit K-quant, super-blocks of 256, id 12.
    Q4_K,
    /// 6-bit K-quant, super-blocks of 256, id 14.
    Q6_K,
    /// bfloat16, id 30.
    BF16,
}

impl GgmlType {
    /// Every type this module can quantize.
    pub const ALL: [GgmlType; 8] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::BF16,
    ];

    /// The id GGUF stores for this type (`enum ggml_type`).
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q8_0 => 8,
            GgmlType::Q4_K => 12,
            GgmlType::Q6_K => 14,
            GgmlType::BF16 => 30,
        }
    }

    /// The type with GGUF id `id`, if this module knows it.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        GgmlType::ALL.into_iter().find(|t| t.id() == id)
    }

    /// Elements per block (1 for the float types).
    pub fn block_size(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 => QK,
            GgmlType::Q4_K | GgmlType::Q6_K => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => Q4_0_BLOCK_BYTES,
            GgmlType::Q4_1 => Q4_1_BLOCK_BYTES,
            GgmlType::Q8_0 => Q8_0_BLOCK_BYTES,
            GgmlType::Q4_K => Q4_K_BLOCK_BYTES,
            GgmlType::Q6_K => Q6_K_BLOCK_BYTES,
        }
    }

    /// Bytes taken by `n_elements` values of this type; `None` when `n_elements` is not a
    /// whole number of blocks.
    pub fn bytes_for(self, n_elements: usize) -> Option<usize> {
        if !n_elements.is_multiple_of(self.block_size()) {
            return None;
        }
        Some(n_elements / self.block_size() * self.block_bytes())
    }

    /// The name ggml gives this type (`"q8_0"`, `"f32"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "f32",
            GgmlType::F16 => "f16",
            GgmlType::Q4_0 => "q4_0",
            GgmlType::Q4_1 => "q4_1",
            GgmlType::Q8_0 => "q8_0",
            GgmlType::Q4_K => "q4_K",
            GgmlType::Q6_K => "q6_K",
            GgmlType::BF16 => "bf16",
        }
    }

    /// Whether this is a block-quantized type (not a plain float).
    pub fn is_quantized(self) -> bool {
        self.block_size() > 1
    }
}

fn check_blocks(ty: GgmlType, n: usize) -> Result<(), TestkitError> {
    if !n.is_multiple_of(ty.block_size()) {
        return Err(TestkitError::NotBlockAligned {
            ty: ty.name(),
            n_elements: n,
            block: ty.block_size(),
        });
    }
    Ok(())
}

/// Encodes `x` as `ty`: one run of blocks along `x` (which must be a whole number of blocks).
pub fn quantize(ty: GgmlType, x: &[f32]) -> Result<Vec<u8>, TestkitError> {
    check_blocks(ty, x.len())?;
    Ok(match ty {
        GgmlType::F32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
        GgmlType::F16 => x
            .iter()
            .flat_map(|v| f16::from_f32(*v).to_le_bytes())
            .collect(),
        GgmlType::BF16 => x
            .iter()
            .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
            .collect(),
        GgmlType::Q4_0 => quantize_q4_0(x)?,
        GgmlType::Q4_1 => quantize_q4_1(x)?,
        GgmlType::Q8_0 => quantize_q8_0(x)?,
        GgmlType::Q4_K => quantize_q4_k(x)?,
        GgmlType::Q6_K => quantize_q6_k(x)?,
    })
}

/// Decodes `n_elements` values of type `ty` from `bytes` (which must hold exactly that many).
pub fn dequantize(ty: GgmlType, bytes: &[u8], n_elements: usize) -> Result<Vec<f32>, TestkitError> {
    let want = ty
        .bytes_for(n_elements)
        .ok_or(TestkitError::NotBlockAligned {
            ty: ty.name(),
            n_elements,
            block: ty.block_size(),
        })?;
    if bytes.len() != want {
        return Err(TestkitError::ByteLength {
            ty: ty.name(),
            n_elements,
            expected: want,
            got: bytes.len(),
        });
    }
    Ok(match ty {
        GgmlType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        GgmlType::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        GgmlType::BF16 => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        GgmlType::Q4_0 => dequantize_q4_0(bytes)?,
        GgmlType::Q4_1 => dequantize_q4_1(bytes)?,
        GgmlType::Q8_0 => dequantize_q8_0(bytes)?,
        GgmlType::Q4_K => dequantize_q4_k(bytes)?,
        GgmlType::Q6_K => dequantize_q6_k(bytes)?,
    })
}

/// `dequantize(quantize(x))`: the values a reader sees after `x` is stored as `ty`.
pub fn round_trip(ty: GgmlType, x: &[f32]) -> Result<Vec<f32>, TestkitError> {
    let bytes = quantize(ty, x)?;
    dequantize(ty, &bytes, x.len())
}

/// Quantizes `x` (a multiple of 32 long) to `Q8_0` blocks, as ggml's `quantize_row_q8_0_ref`.
pub fn quantize_q8_0(x: &[f32]) -> Result<Vec<u8>, TestkitError> {
    check_blocks(GgmlType::Q8_0, x.len())?;
    let mut out = Vec::with_capacity(x.len() / QK * Q8_0_BLOCK_BYTES);
    for block in x.chunks_exact(QK) {
        let amax = block.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        for v in block {
            // `as i8` saturates; |v * id| <= 127 up to rounding, so this is `roundf`.
            out.push((v * id).round() as i8 as u8);
        }
    }
    Ok(out)
}

/// Decodes `Q8_0` blocks (34 bytes each) into `f32`.
pub fn dequantize_q8_0(bytes: &[u8]) -> Result<Vec<f32>, TestkitError> {
    check_block_bytes(GgmlType::Q8_0, bytes)?;
    let mut out = Vec::with_capacity(bytes.len() / Q8_0_BLOCK_BYTES * QK);
    for block in bytes.chunks_exact(Q8_0_BLOCK_BYTES) {
        let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
        out.extend(block[2..].iter().map(|q| (*q as i8) as f32 * d));
    }
    Ok(out)
}

/// Quantizes `x` (a multiple of 32 long) to `Q4_0` blocks, as ggml's `quantize_row_q4_0_ref`.
pub fn quantize_q4_0(x: &[f32]) -> Result<Vec<u8>, TestkitError> {
    check_blocks(GgmlType::Q4_0, x.len())?;
    let mut out = Vec::with_capacity(x.len() / QK * Q4_0_BLOCK_BYTES);
    for block in x.chunks_exact(QK) {
        let mut amax = 0.0f32;
        let mut max = 0.0f32;
        for v in block {
            if amax < v.abs() {
                amax = v.abs();
                max = *v;
            }
        }
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        let nib = |v: f32| -> u8 { ((v * id + 8.5) as i8).min(15) as u8 };
        for j in 0..QK / 2 {
            out.push(nib(block[j]) | (nib(block[j + QK / 2]) << 4));
        }
    }
    Ok(out)
}

/// Decodes `Q4_0` blocks (18 bytes each) into `f32`.
pub fn dequantize_q4_0(bytes: &[u8]) -> Result<Vec<f32>, TestkitError> {
    check_block_bytes(GgmlType::Q4_0, bytes)?;
    let mut out = Vec::with_capacity(bytes.len() / Q4_0_BLOCK_BYTES * QK);
    for block in bytes.chunks_exact(Q4_0_BLOCK_BYTES) {
        let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
        let qs = &block[2..];
        out.extend(qs.iter().map(|b| ((b & 0x0F) as i32 - 8) as f32 * d));
        out.extend(qs.iter().map(|b| ((b >> 4) as i32 - 8) as f32 * d));
    }
    Ok(out)
}

/// Quantizes `x` (a multiple of 32 long) to `Q4_1` blocks, as ggml's `quantize_row_q4_1_ref`.
pub fn quantize_q4_1(x: &[f32]) -> Result<Vec<u8>, TestkitError> {
    check_blocks(GgmlType::Q4_1, x.len())?;
    let mut out = Vec::with_capacity(x.len() / QK * Q4_1_BLOCK_BYTES);
    for block in x.chunks_exact(QK) {
        let mut min = f32::MAX;
        let mut max = -f32::MAX;
        for v in block {
            min = min.min(*v);
            max = max.max(*v);
        }
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
        let nib = |v: f32| -> u8 { (((v - min) * id + 0.5) as i8).min(15) as u8 };
        for j in 0..QK / 2 {
            out.push(nib(block[j]) | (nib(block[j + QK / 2]) << 4));
        }
    }
    Ok(out)
}

/// Decodes `Q4_1` blocks (20 bytes each) into `f32`.
pub fn dequantize_q4_1(bytes: &[u8]) -> Result<Vec<f32>, TestkitError> {
    check_block_bytes(GgmlType::Q4_1, bytes)?;
    let mut out = Vec::with_capacity(bytes.len() / Q4_1_BLOCK_BYTES * QK);
    for block in bytes.chunks_exact(Q4_1_BLOCK_BYTES) {
        let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
        let m = f16::from_le_bytes([block[2], block[3]]).to_f32();
        let qs = &block[4..];
        out.extend(qs.iter().map(|b| (b & 0x0F) as f32 * d + m));
        out.extend(qs.iter().map(|b| (b >> 4) as f32 * d + m));
    }
    Ok(out)
}

/// Quantizes `x` (a multiple of 256 long) to `Q4_K` blocks with a simple min/max scheme.
pub fn quantize_q4_k(x: &[f32]) -> Result<Vec<u8>, TestkitError> {
    check_blocks(GgmlType::Q4_K, x.len())?;
    let mut out = Vec::with_capacity(x.len() / QK_K * Q4_K_BLOCK_BYTES);
    for block in x.chunks_exact(QK_K) {
        // per sub-block: x ≈ scale * q - minus, q in 0..=15, minus >= 0
        let mut scales = [0f32; 8];
        let mut minus = [0f32; 8];
        for (j, sub) in block.chunks_exact(32).enumerate() {
            let lo = sub.iter().cloned().fold(0f32, f32::min);
            let hi = sub.iter().cloned().fold(0f32, f32::max);
            scales[j] = (hi - lo) / 15.0;
            minus[j] = -lo;
        }
        let d = f16::from_f32(scales.iter().cloned().fold(0f32, f32::max) / 63.0);
        let dmin = f16::from_f32(minus.iter().cloned().fold(0f32, f32::max) / 63.0);
        let (df, dminf) = (d.to_f32(), dmin.to_f32());
        let q6 = |v: f32, s: f32| -> u8 {
            if s > 0.0 {
                (v / s).round().clamp(0.0, 63.0) as u8
            } else {
                0
            }
        };
        let mut sc = [0u8; 8];
        let mut mn = [0u8; 8];
        for j in 0..8 {
            // round the scale up so the largest value still fits in 15 steps
            sc[j] = if df > 0.0 {
                (scales[j] / df).ceil().clamp(0.0, 63.0) as u8
            } else {
                0
            };
            mn[j] = q6(minus[j], dminf);
        }
        let mut packed = [0u8; 12];
        for j in 0..4 {
            packed[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
            packed[j + 4] = (mn[j] & 63) | ((mn[j + 4] >> 4) << 6);
            packed[j + 8] = (sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4);
        }
        let mut q = [0u8; QK_K];
        for (j, sub) in block.chunks_exact(32).enumerate() {
            let step = df * sc[j] as f32;
            let off = dminf * mn[j] as f32;
            for (l, v) in sub.iter().enumerate() {
                q[j * 32 + l] = if step > 0.0 {
                    ((v + off) / step).round().clamp(0.0, 15.0) as u8
                } else {
                    0
                };
            }
        }
        out.extend_from_slice(&d.to_le_bytes());
        out.extend_from_slice(&dmin.to_le_bytes());
        out.extend_from_slice(&packed);
        for pair in 0..4 {
            for l in 0..32 {
                out.push(q[pair * 64 + l] | (q[pair * 64 + 32 + l] << 4));
            }
        }
    }
    Ok(out)
}

/// The 6-bit scale and min of sub-block `j` from the 12 packed bytes of a `Q4_K` block.
fn q4_k_scale_min(j: usize, p: &[u8]) -> (u8, u8) {
    if j < 4 {
        (p[j] & 63, p[j + 4] & 63)
    } else {
        (
            (p[j + 4] & 0xF) | ((p[j - 4] >> 6) << 4),
            (p[j + 4] >> 4) | ((p[j] >> 6) << 4),
        )
    }
}

/// Decodes `Q4_K` blocks (144 bytes each) into `f32`, with ggml's arithmetic.
pub fn dequantize_q4_k(bytes: &[u8]) -> Result<Vec<f32>, TestkitError> {
    check_block_bytes(GgmlType::Q4_K, bytes)?;
    let mut out = Vec::with_capacity(bytes.len() / Q4_K_BLOCK_BYTES * QK_K);
    for block in bytes.chunks_exact(Q4_K_BLOCK_BYTES) {
        let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
        let dmin = f16::from_le_bytes([block[2], block[3]]).to_f32();
        let packed = &block[4..16];
        let qs = &block[16..];
        for pair in 0..4 {
            let run = &qs[pair * 32..(pair + 1) * 32];
            let (sc1, m1) = q4_k_scale_min(2 * pair, packed);
            let (sc2, m2) = q4_k_scale_min(2 * pair + 1, packed);
            let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
            out.extend(run.iter().map(|b| d1 * (b & 0xF) as f32 - m1));
            out.extend(run.iter().map(|b| d2 * (b >> 4) as f32 - m2));
        }
    }
    Ok(out)
}

/// Quantizes `x` (a multiple of 256 long) to `Q6_K` blocks with a simple max-abs scheme.
pub fn quantize_q6_k(x: &[f32]) -> Result<Vec<u8>, TestkitError> {
    check_blocks(GgmlType::Q6_K, x.len())?;
    let mut out = Vec::with_capacity(x.len() / QK_K * Q6_K_BLOCK_BYTES);
    for block in x.chunks_exact(QK_K) {
        let mut sub_scale = [0f32; 16];
        for (s, sub) in block.chunks_exact(16).enumerate() {
            sub_scale[s] = sub.iter().fold(0f32, |a, v| a.max(v.abs())) / 31.0;
        }
        let d = f16::from_f32(sub_scale.iter().cloned().fold(0f32, f32::max) / 127.0);
        let df = d.to_f32();
        let mut scales = [0i8; 16];
        for s in 0..16 {
            scales[s] = if df > 0.0 {
                (sub_scale[s] / df).ceil().clamp(0.0, 127.0) as i8
            } else {
                0
            };
        }
        // biased quants 0..=63 (value q - 32)
        let mut q = [32u8; QK_K];
        for (i, v) in block.iter().enumerate() {
            let step = df * scales[i / 16] as f32;
            if step > 0.0 {
                q[i] = ((v / step).round().clamp(-32.0, 31.0) as i32 + 32) as u8;
            }
        }
        let mut ql = [0u8; QK_K / 2];
        let mut qh = [0u8; QK_K / 4];
        for half in 0..2 {
            let q = &q[half * 128..(half + 1) * 128];
            let ql = &mut ql[half * 64..(half + 1) * 64];
            let qh = &mut qh[half * 32..(half + 1) * 32];
            for l in 0..32 {
                let (a, b, c, e) = (q[l], q[l + 32], q[l + 64], q[l + 96]);
                ql[l] = (a & 0xF) | ((c & 0xF) << 4);
                ql[l + 32] = (b & 0xF) | ((e & 0xF) << 4);
                qh[l] = (a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6);
            }
        }
        out.extend_from_slice(&ql);
        out.extend_from_slice(&qh);
        out.extend(scales.iter().map(|s| *s as u8));
        out.extend_from_slice(&d.to_le_bytes());
    }
    Ok(out)
}

/// Decodes `Q6_K` blocks (210 bytes each) into `f32`, with ggml's arithmetic.
pub fn dequantize_q6_k(bytes: &[u8]) -> Result<Vec<f32>, TestkitError> {
    check_block_bytes(GgmlType::Q6_K, bytes)?;
    let mut out = Vec::with_capacity(bytes.len() / Q6_K_BLOCK_BYTES * QK_K);
    for block in bytes.chunks_exact(Q6_K_BLOCK_BYTES) {
        let ql_all = &block[..128];
        let qh_all = &block[128..192];
        let sc_all = &block[192..208];
        let d = f16::from_le_bytes([block[208], block[209]]).to_f32();
        let mut y = [0f32; QK_K];
        for half in 0..2 {
            let ql = &ql_all[half * 64..];
            let qh = &qh_all[half * 32..];
            let sc = &sc_all[half * 8..];
            let y = &mut y[half * 128..];
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
            }
        }
        out.extend_from_slice(&y);
    }
    Ok(out)
}

fn check_block_bytes(ty: GgmlType, bytes: &[u8]) -> Result<(), TestkitError> {
    if !bytes.len().is_multiple_of(ty.block_bytes()) {
        return Err(TestkitError::ByteLength {
            ty: ty.name(),
            n_elements: bytes.len() / ty.block_bytes() * ty.block_size(),
            expected: bytes.len() / ty.block_bytes() * ty.block_bytes(),
            got: bytes.len(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    fn random_vec(seed: u64, n: usize, scale: f32) -> Vec<f32> {
        let mut rng = SplitMix64::new(seed);
        (0..n).map(|_| rng.normal() * scale).collect()
    }

    #[test]
    fn type_ids_match_ggml() {
        let ids: Vec<u32> = GgmlType::ALL.iter().map(|t| t.id()).collect();
        assert_eq!(ids, vec![0, 1, 2, 3, 8, 12, 14, 30]);
        assert_eq!(GgmlType::Q4_K.bytes_for(512), Some(288));
        assert_eq!(GgmlType::Q6_K.bytes_for(256), Some(210));
        assert_eq!(GgmlType::Q6_K.bytes_for(128), None);
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
        }
        assert_eq!(GgmlType::from_id(7), None);
        assert_eq!(GgmlType::Q8_0.bytes_for(64), Some(68));
        assert_eq!(GgmlType::Q4_0.bytes_for(64), Some(36));
        assert_eq!(GgmlType::Q4_1.bytes_for(32), Some(20));
        assert_eq!(GgmlType::Q4_0.bytes_for(33), None);
    }

    #[test]
    fn q8_0_known_block() {
        // max |x| = 127 gives d = 1 exactly, so quants are round(x).
        let mut x = [0.0f32; 32];
        x[0] = 127.0;
        x[1] = -127.0;
        x[2] = 1.4;
        x[3] = 1.5; // roundf rounds half away from zero
        x[4] = -2.5;
        x[5] = 0.49;
        let b = quantize_q8_0(&x).unwrap();
        assert_eq!(b.len(), 34);
        assert_eq!(&b[0..2], &f16::from_f32(1.0).to_le_bytes());
        assert_eq!(b[2] as i8, 127);
        assert_eq!(b[3] as i8, -127);
        assert_eq!(b[4] as i8, 1);
        assert_eq!(b[5] as i8, 2);
        assert_eq!(b[6] as i8, -3);
        assert_eq!(b[7] as i8, 0);
        let y = dequantize_q8_0(&b).unwrap();
        assert_eq!(&y[..6], &[127.0, -127.0, 1.0, 2.0, -3.0, 0.0]);
    }

    #[test]
    fn q4_0_known_block() {
        // largest magnitude is -8 → d = 1; q = min(15, trunc(x + 8.5)).
        let mut x = [0.0f32; 32];
        x[0] = -8.0; // q 0
        x[1] = 7.0; // q 15
        x[2] = 7.9; // trunc(16.4) = 16 → clamped 15
        x[16] = 3.0; // q 11, high nibble of byte 0
        x[17] = -0.6; // trunc(7.9) = 7
        let b = quantize_q4_0(&x).unwrap();
        assert_eq!(b.len(), 18);
        assert_eq!(&b[0..2], &f16::from_f32(1.0).to_le_bytes());
        assert_eq!(b[2], 11 << 4);
        assert_eq!(b[3], 15 | (7 << 4));
        assert_eq!(b[4], 15 | (8 << 4));
        let y = dequantize_q4_0(&b).unwrap();
        assert_eq!(y[0], -8.0);
        assert_eq!(y[1], 7.0);
        assert_eq!(y[2], 7.0);
        assert_eq!(y[16], 3.0);
        assert_eq!(y[17], -1.0);
        assert_eq!(y[3], 0.0);
        // positive largest magnitude gives a negative scale.
        let mut x = [0.0f32; 32];
        x[5] = 16.0;
        x[6] = -4.0;
        let b = quantize_q4_0(&x).unwrap();
        assert_eq!(f16::from_le_bytes([b[0], b[1]]).to_f32(), -2.0);
        let y = dequantize_q4_0(&b).unwrap();
        assert_eq!(y[5], 16.0);
        assert_eq!(y[6], -4.0);
    }

    #[test]
    fn q4_1_known_block() {
        let mut x = [0.0f32; 32];
        for (i, v) in x.iter_mut().enumerate() {
            *v = (i % 16) as f32 - 5.0; // min -5, max 10, d = 1
        }
        let b = quantize_q4_1(&x).unwrap();
        assert_eq!(f16::from_le_bytes([b[0], b[1]]).to_f32(), 1.0);
        assert_eq!(f16::from_le_bytes([b[2], b[3]]).to_f32(), -5.0);
        assert_eq!(dequantize_q4_1(&b).unwrap(), x.to_vec());
    }

    #[test]
    fn k_quants_round_trip_within_bounds() {
        for seed in 0..10 {
            let x = random_vec(200 + seed, QK_K * 3, 0.1);
            for (t, steps) in [(GgmlType::Q4_K, 15.0f32), (GgmlType::Q6_K, 31.0)] {
                let y = round_trip(t, &x).unwrap();
                let sub = if t == GgmlType::Q4_K { 32 } else { 16 };
                for (xs, ys) in x.chunks(sub).zip(y.chunks(sub)) {
                    let lo = xs.iter().cloned().fold(0f32, f32::min);
                    let hi = xs.iter().cloned().fold(0f32, f32::max);
                    let range = if t == GgmlType::Q4_K {
                        hi - lo
                    } else {
                        2.0 * hi.max(-lo)
                    };
                    // half a step, plus the scale's 6/8-bit rounding (one step at most)
                    let bound = range / steps * 1.5 + 1e-6;
                    for (a, b) in xs.iter().zip(ys) {
                        assert!((a - b).abs() <= bound, "{t:?}: {a} vs {b} (bound {bound})");
                    }
                }
            }
        }
    }

    #[test]
    fn q4_k_scale_packing_round_trips() {
        // sub-block j holds constant value j+1 → scales differ per sub-block, mins 0
        let x: Vec<f32> = (0..QK_K).map(|i| (i / 32 + 1) as f32).collect();
        let y = round_trip(GgmlType::Q4_K, &x).unwrap();
        // within half a step of sub-block j: step <= (j+1)/15 + d, d = (8/15)/63
        for (i, (a, b)) in x.iter().zip(&y).enumerate() {
            let half_step = (((i / 32 + 1) as f32) / 15.0 + 8.0 / 15.0 / 63.0) / 2.0;
            assert!((a - b).abs() <= half_step, "{a} vs {b}");
        }
        let x: Vec<f32> = (0..QK_K).map(|i| -((i / 16) as f32) * 0.5).collect();
        let y = round_trip(GgmlType::Q6_K, &x).unwrap();
        // within half a step of sub-block s: step <= (s/2)/31 + d, d = (7.5/31)/127
        for (i, (a, b)) in x.iter().zip(&y).enumerate() {
            let half_step = (((i / 16) as f32 * 0.5) / 31.0 + 7.5 / 31.0 / 127.0) / 2.0;
            assert!((a - b).abs() <= half_step, "{a} vs {b}");
        }
    }

    #[test]
    fn zero_block_is_all_zero() {
        let x = [0.0f32; 256];
        for t in GgmlType::ALL {
            assert_eq!(round_trip(t, &x).unwrap(), x.to_vec(), "{t:?}");
        }
    }

    #[test]
    fn round_trip_error_bounds() {
        for seed in 0..20 {
            let x = random_vec(seed, 32 * 16, 0.1);
            for block in 0..16 {
                let xb = &x[block * 32..(block + 1) * 32];
                let amax = xb.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                let min = xb.iter().cloned().fold(f32::MAX, f32::min);
                let max = xb.iter().cloned().fold(-f32::MAX, f32::max);
                // f16 rounding of the scale adds a relative 2^-11 on each value.
                let f16_slack = amax * 1.0e-3;
                let q8 = round_trip(GgmlType::Q8_0, xb).unwrap();
                let q4 = round_trip(GgmlType::Q4_0, xb).unwrap();
                let q41 = round_trip(GgmlType::Q4_1, xb).unwrap();
                for j in 0..32 {
                    let e8 = (q8[j] - xb[j]).abs();
                    assert!(e8 <= amax / 127.0 / 2.0 + f16_slack, "q8_0 {e8}");
                    let e4 = (q4[j] - xb[j]).abs();
                    // step amax/8; clamping at +7 can cost a full step.
                    assert!(e4 <= amax / 8.0 + f16_slack, "q4_0 {e4}");
                    let e41 = (q41[j] - xb[j]).abs();
                    let slack41 = (max - min) * 1.0e-3 + min.abs() * 1.0e-3;
                    assert!(e41 <= (max - min) / 15.0 / 2.0 + slack41, "q4_1 {e41}");
                }
            }
        }
    }

    #[test]
    fn requantizing_dequantized_values_is_exact() {
        for seed in 0..20 {
            let x = random_vec(100 + seed, 32 * 8, 0.05);
            for t in [GgmlType::Q8_0, GgmlType::Q4_0] {
                let b = quantize(t, &x).unwrap();
                let y = dequantize(t, &b, x.len()).unwrap();
                assert_eq!(quantize(t, &y).unwrap(), b, "{t:?} seed {seed}");
            }
        }
    }

    #[test]
    fn float_types_round_trip() {
        let x = random_vec(7, 64, 1.0);
        assert_eq!(round_trip(GgmlType::F32, &x).unwrap(), x);
        let h = round_trip(GgmlType::F16, &x).unwrap();
        let b = round_trip(GgmlType::BF16, &x).unwrap();
        for j in 0..x.len() {
            assert!((h[j] - x[j]).abs() <= x[j].abs() * 1.0e-3 + 1e-7);
            assert!((b[j] - x[j]).abs() <= x[j].abs() * 8.0e-3 + 1e-7);
        }
    }

    #[test]
    fn misaligned_input_is_an_error() {
        assert!(quantize_q8_0(&[0.0; 33]).is_err());
        assert!(quantize_q4_0(&[0.0; 31]).is_err());
        assert!(dequantize_q8_0(&[0; 35]).is_err());
        assert!(dequantize(GgmlType::Q4_0, &[0; 18], 64).is_err());
    }
}
