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
//! - `Q2_K`: 256 values in 16 sub-blocks of 16; 16 bytes each holding a sub-block's 4-bit
//!   scale `sc` (low nibble) and minimum `m` (high nibble), 64 bytes of 2-bit codes (byte
//!   `32 n + l` holds values `128 n + 32 k + l` in bits `2 k`), `d: f16`, `dmin: f16`;
//!   value = `d*sc * q - dmin*m`.
//! - `Q3_K`: 256 values in 16 sub-blocks of 16; 32 bytes `hmask` (bit `v / 32` of byte
//!   `v % 32` is the third bit of value `v`'s code), 64 bytes of low 2-bit codes laid out as
//!   `Q2_K`'s, 12 bytes packing sixteen 6-bit scales stored plus 32 (scale `j`'s low four
//!   bits in nibble `j / 8` of byte `j % 8`, its top two in bits `2 (j / 4)` of byte
//!   `8 + j % 4`), `d: f16`; value = `d * (scale - 32) * (q - 4)`.
//!
//! The `Q4_K` and `Q6_K` quantizers here are simple (min/max per sub-block, no search), so
//! they are less accurate than ggml's, but they write valid blocks. `Q2_K` and `Q3_K` follow
//! ggml's reference quantizers (`quantize_row_q2_K_ref`, `quantize_row_q3_K_ref`: a search
//! for each sub-block's scale, then the scales quantized and the codes chosen again against
//! them), since at two or three bits a plain min/max scheme loses too much. The dequantizers
//! are exact.

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
/// Bytes in one `Q2_K` block (16 scale bytes, 64 code bytes, d, dmin).
pub const Q2_K_BLOCK_BYTES: usize = QK_K / 16 + QK_K / 4 + 4;
/// Bytes in one `Q3_K` block (hmask, 64 code bytes, 12 scale bytes, d).
pub const Q3_K_BLOCK_BYTES: usize = QK_K / 8 + QK_K / 4 + 12 + 2;

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
    /// 2-bit K-quant, super-blocks of 256, id 10.
    Q2_K,
    /// 3-bit K-quant, super-blocks of 256, id 11.
    Q3_K,
    /// 4-bit K-quant, super-blocks of 256, id 12.
    Q4_K,
    /// 6-bit K-quant, super-blocks of 256, id 14.
    Q6_K,
    /// bfloat16, id 30.
    BF16,
    /// 4-bit non-linear grid, blocks of 32, id 20.
    IQ4_NL,
    /// 4-bit non-linear grid, super-blocks of 256 with 6-bit sub-block scales, id 23.
    IQ4_XS,
    /// FP4 (E2M1) values with an E8M0 scale per 32, id 39.
    MXFP4,
}

impl GgmlType {
    /// Every type this module can quantize.
    pub const ALL: [GgmlType; 13] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::BF16,
        GgmlType::IQ4_NL,
        GgmlType::IQ4_XS,
        GgmlType::MXFP4,
    ];

    /// The id GGUF stores for this type (`enum ggml_type`).
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q8_0 => 8,
            GgmlType::Q2_K => 10,
            GgmlType::Q3_K => 11,
            GgmlType::Q4_K => 12,
            GgmlType::Q6_K => 14,
            GgmlType::BF16 => 30,
            GgmlType::IQ4_NL => 20,
            GgmlType::IQ4_XS => 23,
            GgmlType::MXFP4 => 39,
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
            GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q8_0
            | GgmlType::IQ4_NL
            | GgmlType::MXFP4 => QK,
            GgmlType::Q2_K
            | GgmlType::Q3_K
            | GgmlType::Q4_K
            | GgmlType::Q6_K
            | GgmlType::IQ4_XS => QK_K,
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
            GgmlType::Q2_K => Q2_K_BLOCK_BYTES,
            GgmlType::Q3_K => Q3_K_BLOCK_BYTES,
            GgmlType::Q4_K => Q4_K_BLOCK_BYTES,
            GgmlType::Q6_K => Q6_K_BLOCK_BYTES,
            GgmlType::IQ4_NL => 2 + QK / 2,
            GgmlType::IQ4_XS => 2 + 2 + 4 + QK_K / 2,
            GgmlType::MXFP4 => 1 + QK / 2,
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
            GgmlType::Q2_K => "q2_K",
            GgmlType::Q3_K => "q3_K",
            GgmlType::Q4_K => "q4_K",
            GgmlType::Q6_K => "q6_K",
            GgmlType::BF16 => "bf16",
            GgmlType::IQ4_NL => "iq4_nl",
            GgmlType::IQ4_XS => "iq4_xs",
            GgmlType::MXFP4 => "mxfp4",
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
        GgmlType::Q2_K => quantize_q2_k(x)?,
        GgmlType::Q3_K => quantize_q3_k(x)?,
        GgmlType::Q4_K => quantize_q4_k(x)?,
        GgmlType::Q6_K => quantize_q6_k(x)?,
        GgmlType::IQ4_NL => quantize_iq4_nl(x)?,
        GgmlType::IQ4_XS => quantize_iq4_xs(x)?,
        GgmlType::MXFP4 => quantize_mxfp4(x)?,
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
        GgmlType::Q2_K => dequantize_q2_k(bytes)?,
        GgmlType::Q3_K => dequantize_q3_k(bytes)?,
        GgmlType::Q4_K => dequantize_q4_k(bytes)?,
        GgmlType::Q6_K => dequantize_q6_k(bytes)?,
        GgmlType::IQ4_NL => dequantize_iq4_nl(bytes)?,
        GgmlType::IQ4_XS => dequantize_iq4_xs(bytes)?,
        GgmlType::MXFP4 => dequantize_mxfp4(bytes)?,
    })
}

/// The grid of IQ4_NL and IQ4_XS codes, as ggml defines it (`kvalues_iq4nl`).
pub const IQ4_GRID: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// The value of FP4 (E2M1) code `c`, from the OCP Microscaling format's definition: bit 3 is
/// the sign, bits 1-2 an exponent biased by 1, bit 0 the mantissa; exponent 0 is subnormal.
pub fn e2m1(c: u8) -> f64 {
    let (e, m) = (i32::from((c >> 1) & 3), f64::from(c & 1));
    let mag = if e == 0 {
        m * 0.5
    } else {
        2f64.powi(e - 1) * (1.0 + m / 2.0)
    };
    if c & 8 != 0 {
        -mag
    } else {
        mag
    }
}

/// The index of the grid value nearest `v` (the first of two equally near).
fn nearest_point(grid: impl Iterator<Item = f64>, v: f64) -> u8 {
    let mut best = (0u8, f64::INFINITY);
    for (i, g) in grid.enumerate() {
        let e = (g - v).abs();
        if e < best.1 {
            best = (i as u8, e);
        }
    }
    best.0
}

/// 32 values as 16 bytes of codes (value `j` in the low nibble of byte `j`, `j + 16` in the
/// high one), each the index of the nearest of `grid` to `x / d` (0 when `d` is 0).
fn lut_codes(x: &[f32], d: f64, grid: &[f64; 16]) -> [u8; 16] {
    let code = |v: f32| {
        let v = if d == 0.0 { 0.0 } else { f64::from(v) / d };
        nearest_point(grid.iter().copied(), v)
    };
    std::array::from_fn(|j| code(x[j]) | (code(x[j + 16]) << 4))
}

/// [`IQ4_GRID`] as f64.
fn iq4_grid() -> [f64; 16] {
    IQ4_GRID.map(f64::from)
}

/// 32 codes back to values: `d * grid[code]`, in f64.
fn lut_values(qs: &[u8], d: f64, grid: impl Fn(u8) -> f64) -> Vec<f32> {
    let low = qs.iter().map(|b| (d * grid(b & 0xF)) as f32);
    let high = qs.iter().map(|b| (d * grid(b >> 4)) as f32);
    low.chain(high).collect()
}

/// The value of largest magnitude in `x`, with its sign.
fn signed_max(x: &[f32]) -> f32 {
    x.iter()
        .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m })
}

/// Quantizes `x` (a multiple of 32 long) to `IQ4_NL` blocks: an f16 scale `d` (the value of
/// largest magnitude over the grid's end, -127) and 16 bytes of codes, each the nearest grid
/// point (ggml then searches nearby scales; this writes valid, slightly coarser blocks).
pub fn quantize_iq4_nl(x: &[f32]) -> Result<Vec<u8>, TestkitError> {
    check_blocks(GgmlType::IQ4_NL, x.len())?;
    let grid = iq4_grid();
    let mut out = Vec::with_capacity(x.len() / QK * GgmlType::IQ4_NL.block_bytes());
    for block in x.chunks_exact(QK) {
        let d = f16::from_f32(signed_max(block) / -127.0);
        out.extend_from_slice(&d.to_le_bytes());
        out.extend_from_slice(&lut_codes(block, f64::from(d.to_f32()), &grid));
    }
    Ok(out)
}

/// Decodes `IQ4_NL` blocks (18 bytes: f16 `d`, 16 code bytes) in f64.
pub fn dequantize_iq4_nl(bytes: &[u8]) -> Result<Vec<f32>, TestkitError> {
    check_block_bytes(GgmlType::IQ4_NL, bytes)?;
    Ok(bytes
        .chunks_exact(GgmlType::IQ4_NL.block_bytes())
        .flat_map(|b| {
            let d = f64::from(f16::from_le_bytes([b[0], b[1]]).to_f32());
            lut_values(&b[2..], d, |c| f64::from(IQ4_GRID[c as usize]))
        })
        .collect())
}

/// Quantizes `x` (a multiple of 256 long) to `IQ4_XS` blocks: an f16 `d`, the sub-block
/// scales' high bit pairs (`scales_h`, bits `2 ib`), their low nibbles (`scales_l[ib / 2]`,
/// nibble `ib % 2`), then 16 code bytes per 32-value sub-block. Sub-block `ib`'s scale is
/// `d * (ls - 32)` with `ls` six bits; its codes index [`IQ4_GRID`] as IQ4_NL's do.
pub fn quantize_iq4_xs(x: &[f32]) -> Result<Vec<u8>, TestkitError> {
    check_blocks(GgmlType::IQ4_XS, x.len())?;
    let grid = iq4_grid();
    let mut out = Vec::with_capacity(x.len() / QK_K * GgmlType::IQ4_XS.block_bytes());
    for sb in x.chunks_exact(QK_K) {
        let scales: Vec<f32> = sb
            .chunks_exact(QK)
            .map(|b| signed_max(b) / -127.0)
            .collect();
        let widest = signed_max(&scales);
        let d = f16::from_f32(widest / -32.0);
        let df = d.to_f32();
        let ls: Vec<i32> = scales
            .iter()
            .map(|&s| {
                if df == 0.0 {
                    0
                } else {
                    ((s / df).round() as i32).clamp(-32, 31)
                }
            })
            .collect();
        let (mut high, mut low) = (0u16, [0u8; 4]);
        for (ib, &l) in ls.iter().enumerate() {
            let u = (l + 32) as u16;
            high |= (u >> 4) << (2 * ib);
            low[ib / 2] |= ((u & 0xF) as u8) << (4 * (ib % 2));
        }
        out.extend_from_slice(&d.to_le_bytes());
        out.extend_from_slice(&high.to_le_bytes());
        out.extend_from_slice(&low);
        for (b, &l) in sb.chunks_exact(QK).zip(&ls) {
            out.extend_from_slice(&lut_codes(b, f64::from(df) * f64::from(l), &grid));
        }
    }
    Ok(out)
}

/// Decodes `IQ4_XS` blocks (136 bytes) in f64.
pub fn dequantize_iq4_xs(bytes: &[u8]) -> Result<Vec<f32>, TestkitError> {
    check_block_bytes(GgmlType::IQ4_XS, bytes)?;
    let mut out = Vec::with_capacity(bytes.len() / GgmlType::IQ4_XS.block_bytes() * QK_K);
    for b in bytes.chunks_exact(GgmlType::IQ4_XS.block_bytes()) {
        let d = f64::from(f16::from_le_bytes([b[0], b[1]]).to_f32());
        let high = u16::from_le_bytes([b[2], b[3]]);
        for ib in 0..QK_K / QK {
            let low = (b[4 + ib / 2] >> (4 * (ib % 2))) & 0xF;
            let ls = i32::from(low) | (i32::from((high >> (2 * ib)) & 3) << 4);
            let dl = d * f64::from(ls - 32);
            let qs = &b[8 + 16 * ib..8 + 16 * ib + 16];
            out.extend(lut_values(qs, dl, |c| f64::from(IQ4_GRID[c as usize])));
        }
    }
    Ok(out)
}

/// Quantizes `x` (a multiple of 32 long) to `MXFP4` blocks: one E8M0 byte `e` (the scale is
/// `2^(e - 127)`, chosen as ggml's reference does: `floor(log2(amax)) - 2`, so the largest
/// value lands near the top of the FP4 range), then 16 bytes of FP4 codes, each the nearest
/// E2M1 value to `x / scale`.
pub fn quantize_mxfp4(x: &[f32]) -> Result<Vec<u8>, TestkitError> {
    check_blocks(GgmlType::MXFP4, x.len())?;
    let grid: [f64; 16] = std::array::from_fn(|c| e2m1(c as u8));
    let mut out = Vec::with_capacity(x.len() / QK * GgmlType::MXFP4.block_bytes());
    for block in x.chunks_exact(QK) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let e = if amax > 0.0 {
            (amax.log2().floor() as i32 - 2 + 127).clamp(0, 254) as u8
        } else {
            0
        };
        out.push(e);
        out.extend_from_slice(&lut_codes(block, 2f64.powi(i32::from(e) - 127), &grid));
    }
    Ok(out)
}

/// Decodes `MXFP4` blocks (17 bytes: E8M0 scale, 16 code bytes) in f64.
pub fn dequantize_mxfp4(bytes: &[u8]) -> Result<Vec<f32>, TestkitError> {
    check_block_bytes(GgmlType::MXFP4, bytes)?;
    Ok(bytes
        .chunks_exact(GgmlType::MXFP4.block_bytes())
        .flat_map(|b| lut_values(&b[1..], 2f64.powi(i32::from(b[0]) - 127), e2m1))
        .collect())
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

/// ggml's `nearest_int`: `v` rounded to the nearest integer, ties to even (its trick of adding
/// 1.5 * 2^23 rounds in the FPU's default mode).
fn nearest(v: f32) -> i32 {
    v.round_ties_even() as i32
}

/// Below this largest magnitude a sub-block counts as all zeros (ggml's `GROUP_MAX_EPS`).
const GROUP_MAX_EPS: f32 = 1e-15;

/// Codes `0..=nmax` for `x` as `scale * code - min` (`min >= 0` returned beside the scale),
/// as ggml's `make_qkx2_quants` with `use_mad`: a first fit from the range, then `nstep + 1`
/// trial inverse scales `(rmin + rdelta * i + nmax) / range`, each refit by weighted least
/// squares (scale and offset, or the scale alone when the offset would come out positive)
/// and kept when its weighted absolute error is the smallest so far.
#[allow(clippy::too_many_arguments)]
fn fit_scale_min(
    x: &[f32],
    w: &[f32],
    nmax: i32,
    codes: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (f32, f32) {
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = w[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..x.len() {
        min = min.min(x[i]);
        max = max.max(x[i]);
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        codes.iter_mut().for_each(|c| *c = 0);
        return (0.0, -min);
    }
    let error = |codes: &[u8], scale: f32, min: f32| -> f32 {
        x.iter()
            .zip(w)
            .zip(codes)
            .map(|((&x, &w), &l)| w * (scale * l as f32 + min - x).abs())
            .sum()
    };
    let quantize = |iscale: f32, min: f32, out: &mut [u8]| {
        for (o, &x) in out.iter_mut().zip(x) {
            *o = nearest(iscale * (x - min)).clamp(0, nmax) as u8;
        }
    };
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    quantize(iscale, min, codes);
    let mut best = error(codes, scale, min);
    let mut trial = vec![0u8; x.len()];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        quantize(iscale, min, &mut trial);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for ((&l, &x), &w) in trial.iter().zip(x).zip(w) {
            let l = l as f32;
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * x;
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let e = error(&trial, this_scale, this_min);
            if e < best {
                codes.copy_from_slice(&trial);
                best = e;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Signed codes `-nmax..nmax` (returned plus `nmax`) and a scale for `x`, as ggml's
/// `make_q3_quants` with `do_rmse`: codes from the value of largest magnitude, then up to
/// five passes that move single codes where that raises `(sum w x l)^2 / sum w l^2`
/// (weights `x^2`), the scale being the least-squares one.
fn fit_symmetric(x: &[f32], nmax: i32, codes: &mut [i8]) -> f32 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        codes.iter_mut().for_each(|c| *c = 0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for (c, &v) in codes.iter_mut().zip(x) {
        let l = nearest(iscale * v).clamp(-nmax, nmax - 1);
        *c = l as i8;
        let w = v * v;
        sumlx += w * v * l as f32;
        suml2 += w * (l * l) as f32;
    }
    for _ in 0..5 {
        let mut changed = false;
        for (c, &v) in codes.iter_mut().zip(x) {
            let w = v * v;
            let l = *c as i32;
            let mut slx = sumlx - w * v * l as f32;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * (l * l) as f32;
                let new_l = nearest(v * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != l {
                    slx += w * v * new_l as f32;
                    sl2 += w * (new_l * new_l) as f32;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        *c = new_l as i8;
                        sumlx = slx;
                        suml2 = sl2;
                        changed = true;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    for c in codes.iter_mut() {
        *c += nmax as i8;
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// 256 2-bit codes packed as `Q2_K` and `Q3_K` keep them: byte `32 n + l` holds codes
/// `128 n + 32 k + l` in bits `2 k`.
fn pack_2bit(codes: &[u8; QK_K]) -> [u8; QK_K / 4] {
    std::array::from_fn(|b| {
        let (n, l) = (b / 32, b % 32);
        (0..4).fold(0u8, |acc, k| {
            acc | ((codes[128 * n + 32 * k + l] & 3) << (2 * k))
        })
    })
}

/// Code `v` of the 2-bit codes `qs` ([`pack_2bit`]'s layout).
fn code_2bit(qs: &[u8], v: usize) -> u8 {
    let (n, k, l) = (v / 128, v % 128 / 32, v % 32);
    (qs[32 * n + l] >> (2 * k)) & 3
}

/// Quantizes `x` (a multiple of 256 long) to `Q2_K` blocks, as ggml's
/// `quantize_row_q2_K_ref`: each sub-block's scale and minimum fitted to its values weighted
/// by magnitude ([`fit_scale_min`]), both quantized to 4 bits against the largest of them,
/// and the codes chosen again against the quantized pair.
pub fn quantize_q2_k(x: &[f32]) -> Result<Vec<u8>, TestkitError> {
    check_blocks(GgmlType::Q2_K, x.len())?;
    let mut out = Vec::with_capacity(x.len() / QK_K * Q2_K_BLOCK_BYTES);
    for block in x.chunks_exact(QK_K) {
        let mut codes = [0u8; QK_K];
        let mut scales = [0f32; 16];
        let mut mins = [0f32; 16];
        for (j, sub) in block.chunks_exact(16).enumerate() {
            let w: Vec<f32> = sub.iter().map(|v| v.abs()).collect();
            (scales[j], mins[j]) =
                fit_scale_min(sub, &w, 3, &mut codes[16 * j..16 * j + 16], -0.5, 0.1, 15);
        }
        let max_scale = scales.iter().cloned().fold(0f32, f32::max);
        let max_min = mins.iter().cloned().fold(0f32, f32::max);
        let mut sc = [0u8; 16];
        let mut d = f16::ZERO;
        if max_scale > 0.0 {
            let iscale = 15.0 / max_scale;
            for j in 0..16 {
                sc[j] = nearest(iscale * scales[j]).clamp(0, 15) as u8;
            }
            d = f16::from_f32(max_scale / 15.0);
        }
        let mut dmin = f16::ZERO;
        if max_min > 0.0 {
            let iscale = 15.0 / max_min;
            for j in 0..16 {
                sc[j] |= (nearest(iscale * mins[j]).clamp(0, 15) as u8) << 4;
            }
            dmin = f16::from_f32(max_min / 15.0);
        }
        for (j, sub) in block.chunks_exact(16).enumerate() {
            let step = d.to_f32() * (sc[j] & 0xF) as f32;
            if step == 0.0 {
                continue;
            }
            let dm = dmin.to_f32() * (sc[j] >> 4) as f32;
            for (c, &v) in codes[16 * j..16 * j + 16].iter_mut().zip(sub) {
                *c = nearest((v + dm) / step).clamp(0, 3) as u8;
            }
        }
        out.extend_from_slice(&sc);
        out.extend_from_slice(&pack_2bit(&codes));
        out.extend_from_slice(&d.to_le_bytes());
        out.extend_from_slice(&dmin.to_le_bytes());
    }
    Ok(out)
}

/// Decodes `Q2_K` blocks (84 bytes each) into `f32`, with ggml's arithmetic.
pub fn dequantize_q2_k(bytes: &[u8]) -> Result<Vec<f32>, TestkitError> {
    check_block_bytes(GgmlType::Q2_K, bytes)?;
    let mut out = Vec::with_capacity(bytes.len() / Q2_K_BLOCK_BYTES * QK_K);
    for block in bytes.chunks_exact(Q2_K_BLOCK_BYTES) {
        let d = f16::from_le_bytes([block[80], block[81]]).to_f32();
        let dmin = f16::from_le_bytes([block[82], block[83]]).to_f32();
        let qs = &block[16..80];
        out.extend((0..QK_K).map(|v| {
            let sc = block[v / 16];
            let (dl, ml) = (d * (sc & 0xF) as f32, dmin * (sc >> 4) as f32);
            dl * code_2bit(qs, v) as f32 - ml
        }));
    }
    Ok(out)
}

/// The sixteen scales of a `Q3_K` block from its 12 packed bytes, as stored (0..64, the
/// scale plus 32).
fn q3_k_scales(p: &[u8]) -> [u8; 16] {
    std::array::from_fn(|j| {
        let low = if j < 8 { p[j] & 0xF } else { p[j - 8] >> 4 };
        low | (((p[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)
    })
}

/// Quantizes `x` (a multiple of 256 long) to `Q3_K` blocks, as ggml's
/// `quantize_row_q3_K_ref`: each sub-block's scale fitted ([`fit_symmetric`]), the scales
/// quantized to 6 bits against the one of largest magnitude, and the codes chosen again
/// against the quantized scales.
pub fn quantize_q3_k(x: &[f32]) -> Result<Vec<u8>, TestkitError> {
    check_blocks(GgmlType::Q3_K, x.len())?;
    let mut out = Vec::with_capacity(x.len() / QK_K * Q3_K_BLOCK_BYTES);
    for block in x.chunks_exact(QK_K) {
        let mut codes = [0i8; QK_K];
        let mut scales = [0f32; 16];
        let (mut amax, mut max_scale) = (0f32, 0f32);
        for (j, sub) in block.chunks_exact(16).enumerate() {
            scales[j] = fit_symmetric(sub, 4, &mut codes[16 * j..16 * j + 16]);
            if scales[j].abs() > amax {
                amax = scales[j].abs();
                max_scale = scales[j];
            }
        }
        let mut packed = [0u8; 12];
        let mut d = f16::ZERO;
        if max_scale != 0.0 {
            let iscale = -32.0 / max_scale;
            for j in 0..16 {
                let l = (nearest(iscale * scales[j]).clamp(-32, 31) + 32) as u8;
                if j < 8 {
                    packed[j] = l & 0xF;
                } else {
                    packed[j - 8] |= (l & 0xF) << 4;
                }
                packed[8 + j % 4] |= (l >> 4) << (2 * (j / 4));
            }
            d = f16::from_f32(1.0 / iscale);
        }
        let stored = q3_k_scales(&packed);
        for (j, sub) in block.chunks_exact(16).enumerate() {
            let step = d.to_f32() * (stored[j] as i32 - 32) as f32;
            if step == 0.0 {
                continue;
            }
            for (c, &v) in codes[16 * j..16 * j + 16].iter_mut().zip(sub) {
                *c = (nearest(v / step).clamp(-4, 3) + 4) as i8;
            }
        }
        // codes 0..8: the third bit to hmask, the low two to qs
        let mut hmask = [0u8; QK_K / 8];
        let mut low = [0u8; QK_K];
        for (v, &c) in codes.iter().enumerate() {
            let c = c as u8;
            if c > 3 {
                hmask[v % 32] |= 1 << (v / 32);
            }
            low[v] = c & 3;
        }
        out.extend_from_slice(&hmask);
        out.extend_from_slice(&pack_2bit(&low));
        out.extend_from_slice(&packed);
        out.extend_from_slice(&d.to_le_bytes());
    }
    Ok(out)
}

/// Decodes `Q3_K` blocks (110 bytes each) into `f32`, with ggml's arithmetic.
pub fn dequantize_q3_k(bytes: &[u8]) -> Result<Vec<f32>, TestkitError> {
    check_block_bytes(GgmlType::Q3_K, bytes)?;
    let mut out = Vec::with_capacity(bytes.len() / Q3_K_BLOCK_BYTES * QK_K);
    for block in bytes.chunks_exact(Q3_K_BLOCK_BYTES) {
        let d = f16::from_le_bytes([block[108], block[109]]).to_f32();
        let (hmask, qs) = (&block[..32], &block[32..96]);
        let scales = q3_k_scales(&block[96..108]);
        out.extend((0..QK_K).map(|v| {
            let dl = d * (scales[v / 16] as i32 - 32) as f32;
            let high = (hmask[v % 32] >> (v / 32)) & 1;
            dl * (code_2bit(qs, v) as i32 - if high == 1 { 0 } else { 4 }) as f32
        }));
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
        assert_eq!(ids, vec![0, 1, 2, 3, 8, 10, 11, 12, 14, 30, 20, 23, 39]);
        assert_eq!(GgmlType::IQ4_NL.bytes_for(64), Some(36));
        assert_eq!(GgmlType::IQ4_XS.bytes_for(512), Some(272));
        assert_eq!(GgmlType::MXFP4.bytes_for(64), Some(34));
        assert_eq!(GgmlType::Q2_K.bytes_for(512), Some(168));
        assert_eq!(GgmlType::Q3_K.bytes_for(256), Some(110));
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

    /// Q2_K and Q3_K keep Gaussian weights close: the round trip's RMS error against the
    /// values' RMS stays below what 2 and 3 bits allow with a fitted scale per 16 values
    /// (ggml's quantizers give about 0.33 and 0.17 on such data), and every value within
    /// its sub-block's range.
    #[test]
    fn q2_k_and_q3_k_round_trip_closely() {
        for seed in 0..10 {
            let x = random_vec(300 + seed, QK_K * 4, 0.05);
            for (t, most) in [(GgmlType::Q2_K, 0.40f32), (GgmlType::Q3_K, 0.22)] {
                let y = round_trip(t, &x).unwrap();
                let err: f32 = x.iter().zip(&y).map(|(a, b)| (a - b) * (a - b)).sum();
                let all: f32 = x.iter().map(|a| a * a).sum();
                let rel = (err / all).sqrt();
                assert!(rel < most, "{t:?} seed {seed}: relative RMS error {rel}");
                for (xs, ys) in x.chunks(16).zip(y.chunks(16)) {
                    let lo = xs.iter().cloned().fold(0f32, f32::min);
                    let hi = xs.iter().cloned().fold(0f32, f32::max);
                    let slack = (hi - lo) * 0.6;
                    for b in ys {
                        assert!(
                            *b >= lo - slack && *b <= hi + slack,
                            "{t:?}: {b} outside {lo}..{hi}"
                        );
                    }
                }
            }
        }
    }

    /// Values a Q2_K or Q3_K block holds exactly come back from a round trip: codes from
    /// scrambled bytes, dequantized, quantized again (to the same values, not necessarily the
    /// same bytes: Q3_K's scales may change sign with `d`).
    #[test]
    fn q2_k_and_q3_k_representable_values_come_back() {
        // sub-block j: the codes 0..=3 and back, scale j + 1 (Q2_K: minimum 0 over a d of
        // 1/16 keeps every value a short binary fraction)
        let mut b2 = vec![0u8; Q2_K_BLOCK_BYTES];
        for (j, sc) in b2[..16].iter_mut().enumerate() {
            *sc = (j as u8 % 15) + 1;
        }
        for (i, q) in b2[16..80].iter_mut().enumerate() {
            *q = (i as u8).wrapping_mul(0x1B);
        }
        b2[80..82].copy_from_slice(&f16::from_f32(1.0 / 16.0).to_le_bytes());
        let x = dequantize_q2_k(&b2).unwrap();
        assert_eq!(dequantize_q2_k(&quantize_q2_k(&x).unwrap()).unwrap(), x);
        let mut b3 = vec![0u8; Q3_K_BLOCK_BYTES];
        for (i, q) in b3[..96].iter_mut().enumerate() {
            *q = (i as u8).wrapping_mul(0x2D) ^ 0x5A;
        }
        // the first value of each sub-block is code 0 (-4, the largest magnitude), so the
        // quantizer finds the scale again (its search starts from that value)
        for v in (0..QK_K).step_by(16) {
            let (n, k, l) = (v / 128, v % 128 / 32, v % 32);
            b3[32 + 32 * n + l] &= !(3 << (2 * k));
            b3[l] &= !(1 << (v / 32));
        }
        // every scale 16, stored as 48 (low nibble 0, top bits 3)
        b3[96..104].fill(0x00);
        b3[104..108].fill(0xFF);
        b3[108..110].copy_from_slice(&f16::from_f32(0.25).to_le_bytes());
        let x = dequantize_q3_k(&b3).unwrap();
        assert!(
            x.iter()
                .all(|v| (v / 4.0).fract() == 0.0 && v.abs() <= 16.0),
            "{x:?}"
        );
        assert_eq!(dequantize_q3_k(&quantize_q3_k(&x).unwrap()).unwrap(), x);
    }

    /// The field layouts the module documents, on hand-made blocks.
    #[test]
    fn q2_k_and_q3_k_known_blocks() {
        let mut b2 = vec![0u8; Q2_K_BLOCK_BYTES];
        b2[3] = 0x25; // sub-block 3 (values 48..64): scale 5, minimum 2
        b2[16 + 32 + 17] = 0b10_01_11_00; // values 128+17, +32, +64, +96: codes 0, 3, 1, 2
        b2[80..82].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b2[82..84].copy_from_slice(&f16::from_f32(0.25).to_le_bytes());
        let y = dequantize_q2_k(&b2).unwrap();
        assert_eq!(y[48], -0.5); // code 0: -dmin * 2
        assert_eq!(y[0], 0.0);
        // sub-blocks of 145, 177, 209, 241 (9, 11, 13, 15) have scale and minimum 0
        assert_eq!(&[y[145], y[177], y[209], y[241]], &[0.0; 4]);
        b2[9] = 0x01;
        b2[11] = 0x01;
        b2[13] = 0x01;
        b2[15] = 0x01;
        let y = dequantize_q2_k(&b2).unwrap();
        assert_eq!(&[y[145], y[177], y[209], y[241]], &[0.0, 1.5, 0.5, 1.0]);
        let mut b3 = vec![0u8; Q3_K_BLOCK_BYTES];
        // scale 5 (low nibble 5 of byte 5, top bits 0... + 32): sub-block 5 stored 37
        b3[96 + 5] = 0x05;
        b3[96 + 8 + 1] = 0b10 << 2; // sub-block 5 = j 5: byte 8 + 1, bits 2-3
        b3[108..110].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
        // value 80 (sub-block 5; n 0, k 2, l 16): low code 3, third bit set: 7 - 4 = 3
        b3[32 + 16] = 3 << 4;
        b3[16] = 1 << 2;
        let y = dequantize_q3_k(&b3).unwrap();
        assert_eq!(y[80], 5.0 * 3.0);
        // value 81: code 0, no third bit: -4
        assert_eq!(y[81], 5.0 * -4.0);
        // sub-block 0: stored 0, scale -32; code 0 stands for -4
        assert_eq!(y[0], 128.0);
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
