//! The byte layouts of the weight types the kernels read (ggml's, as stored in GGUF) and the
//! two 8-bit formats activations are quantized to once per step: [`BlockQ8`] (32 values, for
//! the 32-value weight blocks, and for IQ4_XS, whose 32-value sub-blocks each have a scale)
//! and [`BlockQ8K`] (256 values with 16-value sums, for the K-quants and the grid i-quants). Quantizing an activation rounds its scale through f16 the way ggml does, so
//! the integer work matches llama.cpp's.

/// Values per block of the 32-value types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0).
pub const QK: usize = 32;
/// Values per super-block of the K-quants.
pub const QK_K: usize = 256;

/// A weight matrix's element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightType {
    /// 32-bit float.
    F32,
    /// 16-bit IEEE float.
    F16,
    /// bfloat16: an f32's top 16 bits.
    Bf16,
    /// 4-bit, one f16 scale per 32.
    Q4_0,
    /// 4-bit, f16 scale and minimum per 32.
    Q4_1,
    /// 5-bit, one f16 scale per 32.
    Q5_0,
    /// 5-bit, f16 scale and minimum per 32.
    Q5_1,
    /// 8-bit, one f16 scale per 32.
    Q8_0,
    /// 4-bit K-quant: 256 values, 6-bit scales and minimums per 32.
    Q4K,
    /// 5-bit K-quant.
    Q5K,
    /// 6-bit K-quant: 256 values, 8-bit scales per 16.
    Q6K,
    /// 2-bit K-quant: 256 values, 4-bit scales and minimums per 16.
    Q2K,
    /// 3-bit K-quant: 256 values, 6-bit scales per 16.
    Q3K,
    /// 4-bit non-linear (IQ4_NL): 32 values, an f16 scale and 4-bit indices into
    /// [`IQ4_VALUES`].
    Iq4Nl,
    /// IQ4_XS: 256 values, an f16 scale, a 6-bit scale per 32 and 4-bit indices into
    /// [`IQ4_VALUES`].
    Iq4Xs,
    /// MXFP4: 32 FP4 (E2M1) values sharing one power-of-two (E8M0) scale.
    Mxfp4,
    /// IQ1_S: 256 values, groups of eight on a 2048-point grid of -1, 0, 1, shifted by ±1/8,
    /// a 3-bit scale per 32 (see [`super::iquants`] for this and the other grid i-quants).
    Iq1S,
    /// IQ1_M: as IQ1_S with a shift per eight and a 3-bit scale per 16.
    Iq1M,
    /// IQ2_XXS: 256 values, groups of eight on a 256-point grid, signs, a scale per 32.
    Iq2Xxs,
    /// IQ2_XS: a 512-point grid, a scale per 16.
    Iq2Xs,
    /// IQ2_S: a 1024-point grid, explicit signs, a scale per 16.
    Iq2S,
    /// IQ3_XXS: groups of four on a 256-point grid, signs, a scale per 32.
    Iq3Xxs,
    /// IQ3_S: groups of four on a 512-point grid, explicit signs, a scale per 32.
    Iq3S,
}

/// The sixteen values an IQ4_NL or IQ4_XS code stands for (before its scale): the format's
/// non-uniform grid, denser near zero where most weights lie, as ggml defines it
/// (`kvalues_iq4nl`). Data of the format, not derived.
pub const IQ4_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// The sixteen FP4 (E2M1) values of the OCP Microscaling format, doubled so that they are
/// integers: code `c` is sign bit 3, a two-bit exponent (bits 1-2, bias 1) and one mantissa
/// bit, so `0, 0.5, 1, 1.5, 2, 3, 4, 6` and their negatives become `0, 1, 2, 3, 4, 6, 8,
/// 12`; [`e8m0_half`] halves the block scale to make up for it. Derived from the format.
pub const MXFP4_VALUES: [i8; 16] = mxfp4_values();

const fn mxfp4_values() -> [i8; 16] {
    let mut v = [0i8; 16];
    let mut c = 0;
    while c < 16 {
        let (e, m) = ((c >> 1) & 3, (c & 1) as i8);
        // twice the magnitude: subnormal (e = 0) is m * 0.5, else 2^(e-1) * (1 + m / 2)
        let twice = if e == 0 { m } else { (2 + m) << (e - 1) };
        v[c] = if c & 8 != 0 { -twice } else { twice };
        c += 1;
    }
    v
}

/// Half the value of an E8M0 scale byte (`2^(e - 127)`, here `2^(e - 128)`), as an f32:
/// exact for every byte (the two smallest are subnormal).
#[inline]
pub fn e8m0_half(e: u8) -> f32 {
    if e < 2 {
        f32::from_bits(0x0020_0000 << e)
    } else {
        f32::from_bits((e as u32 - 1) << 23)
    }
}

/// The signed 6-bit scale (`-32..32`) of sub-block `ib` (0..8) of an IQ4_XS block `b`: four
/// low bits from `scales_l` (bytes 4-8), two high bits from `scales_h` (bytes 2-4).
#[inline]
pub fn iq4xs_scale(b: &[u8], ib: usize) -> i32 {
    let high = u16::from_le_bytes([b[2], b[3]]);
    let low = (b[4 + ib / 2] >> (4 * (ib % 2))) & 0xF;
    (low as i32 | ((((high >> (2 * ib)) & 3) as i32) << 4)) - 32
}

/// What an activation row is turned into before it meets a weight row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActFormat {
    /// Plain f32 (float weights).
    F32,
    /// [`BlockQ8`] per 32 values.
    Q8,
    /// [`BlockQ8K`] per 256 values.
    Q8K,
}

impl WeightType {
    /// Values per block.
    pub fn block_elems(self) -> usize {
        match self {
            WeightType::F32 | WeightType::F16 | WeightType::Bf16 => 1,
            WeightType::Q4_0
            | WeightType::Q4_1
            | WeightType::Q5_0
            | WeightType::Q5_1
            | WeightType::Q8_0
            | WeightType::Iq4Nl
            | WeightType::Mxfp4 => QK,
            WeightType::Q2K
            | WeightType::Q3K
            | WeightType::Q4K
            | WeightType::Q5K
            | WeightType::Q6K
            | WeightType::Iq4Xs
            | WeightType::Iq1S
            | WeightType::Iq1M
            | WeightType::Iq2Xxs
            | WeightType::Iq2Xs
            | WeightType::Iq2S
            | WeightType::Iq3Xxs
            | WeightType::Iq3S => QK_K,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            WeightType::F32 => 4,
            WeightType::F16 | WeightType::Bf16 => 2,
            WeightType::Q4_0 => 18,
            WeightType::Q4_1 => 20,
            WeightType::Q5_0 => 22,
            WeightType::Q5_1 => 24,
            WeightType::Q8_0 => 34,
            WeightType::Q4K => 144,
            WeightType::Q5K => 176,
            WeightType::Q6K => 210,
            WeightType::Q2K => 84,
            WeightType::Q3K => 110,
            WeightType::Iq4Nl => 18,
            WeightType::Iq4Xs => 136,
            WeightType::Mxfp4 => 17,
            WeightType::Iq1S => 50,
            WeightType::Iq1M => 56,
            WeightType::Iq2Xxs => 66,
            WeightType::Iq2Xs => 74,
            WeightType::Iq2S => 82,
            WeightType::Iq3Xxs => 98,
            WeightType::Iq3S => 110,
        }
    }

    /// The activation format this type's dot product takes.
    pub fn act_format(self) -> ActFormat {
        match self {
            WeightType::F32 | WeightType::F16 | WeightType::Bf16 => ActFormat::F32,
            WeightType::Q4_0
            | WeightType::Q4_1
            | WeightType::Q5_0
            | WeightType::Q5_1
            | WeightType::Q8_0
            | WeightType::Iq4Nl
            | WeightType::Iq4Xs
            | WeightType::Mxfp4 => ActFormat::Q8,
            WeightType::Q2K
            | WeightType::Q3K
            | WeightType::Q4K
            | WeightType::Q5K
            | WeightType::Q6K
            | WeightType::Iq1S
            | WeightType::Iq1M
            | WeightType::Iq2Xxs
            | WeightType::Iq2Xs
            | WeightType::Iq2S
            | WeightType::Iq3Xxs
            | WeightType::Iq3S => ActFormat::Q8K,
        }
    }

    /// Every type, for tests and benchmarks.
    pub const ALL: [WeightType; 23] = [
        WeightType::F32,
        WeightType::F16,
        WeightType::Bf16,
        WeightType::Q4_0,
        WeightType::Q4_1,
        WeightType::Q5_0,
        WeightType::Q5_1,
        WeightType::Q8_0,
        WeightType::Q4K,
        WeightType::Q5K,
        WeightType::Q6K,
        WeightType::Q2K,
        WeightType::Q3K,
        WeightType::Iq4Nl,
        WeightType::Iq4Xs,
        WeightType::Mxfp4,
        WeightType::Iq1S,
        WeightType::Iq1M,
        WeightType::Iq2Xxs,
        WeightType::Iq2Xs,
        WeightType::Iq2S,
        WeightType::Iq3Xxs,
        WeightType::Iq3S,
    ];
}

/// 32 activations as 8-bit integers: value `i` is `d * qs[i]`; `s` is `d * sum(qs)`
/// (rounded through f16, as ggml's Q8_1), used by the types with a minimum.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ8 {
    /// Scale.
    pub d: f32,
    /// `d * sum(qs)`.
    pub s: f32,
    /// `sum(qs)`, exact, for the offset of unsigned weight codes.
    pub sum: i32,
    /// Quantized values.
    pub qs: [i8; QK],
}

impl Default for BlockQ8 {
    fn default() -> Self {
        BlockQ8 {
            d: 0.0,
            s: 0.0,
            sum: 0,
            qs: [0; QK],
        }
    }
}

/// 256 activations as 8-bit integers with the sum of each 16, for the K-quants.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ8K {
    /// Scale.
    pub d: f32,
    /// Quantized values.
    pub qs: [i8; QK_K],
    /// `sum(qs[16 j .. 16 j + 16])`.
    pub bsums: [i16; QK_K / 16],
    /// `sum(qs[32 j .. 32 j + 32])`: two of them side by side are one 32-bit load for the
    /// Q4_K/Q5_K kernels' minimums.
    pub sums32: [i16; QK_K / 32],
}

impl Default for BlockQ8K {
    fn default() -> Self {
        BlockQ8K {
            d: 0.0,
            qs: [0; QK_K],
            bsums: [0; QK_K / 16],
            sums32: [0; QK_K / 32],
        }
    }
}

/// The bfloat16 stored little-endian at `b[at..at + 2]`, as f32 (exact).
#[inline]
pub fn bf16_at(b: &[u8], at: usize) -> f32 {
    f32::from_bits((u16::from_le_bytes([b[at], b[at + 1]]) as u32) << 16)
}

/// Rounds through f16 and back.
#[inline]
pub fn round_f16(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// The f16 stored little-endian at `b[at..at + 2]`, as f32.
#[inline]
pub fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// Quantizes `x` (a multiple of 32 long) into `out` (one block per 32).
pub fn quantize_q8(x: &[f32], out: &mut [BlockQ8]) {
    debug_assert_eq!(x.len(), out.len() * QK);
    for (xs, b) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in b.qs.iter_mut().zip(xs) {
            let r = (v * id).round_ties_even() as i32;
            *q = r as i8;
            sum += r;
        }
        b.d = round_f16(d);
        b.s = round_f16(d * sum as f32);
        b.sum = sum;
    }
}

/// Quantizes `x` (a multiple of 256 long) into `out` (one block per 256), as ggml's
/// `quantize_row_q8_K`: the value of largest magnitude maps to -127.
pub fn quantize_q8k(x: &[f32], out: &mut [BlockQ8K]) {
    debug_assert_eq!(x.len(), out.len() * QK_K);
    for (xs, b) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        let (mut amax, mut max) = (0f32, 0f32);
        for &v in xs {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            *b = BlockQ8K::default();
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in b.qs.iter_mut().zip(xs) {
            *q = ((iscale * v).round_ties_even() as i32).min(127) as i8;
        }
        for (s, qs) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
            *s = qs.iter().map(|&q| q as i16).sum();
        }
        for (j, s) in b.sums32.iter_mut().enumerate() {
            *s = b.bsums[2 * j] + b.bsums[2 * j + 1];
        }
        b.d = 1.0 / iscale;
    }
}

/// The 6-bit scale and minimum of sub-block `j` (0..8) of a Q4_K or Q5_K super-block, from
/// its 12 packed bytes.
#[inline]
pub fn k4_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Code `v` (0..256) of the 64 bytes `qs` of 2-bit codes of a Q2_K or Q3_K super-block (Q3_K's
/// low two bits): byte `32 n + l` holds the codes of values `128 n + 32 k + l` in bits
/// `2 k` and `2 k + 1`.
#[inline]
pub fn k2_code(qs: &[u8], v: usize) -> u8 {
    let (n, k, l) = (v / 128, v % 128 / 32, v % 32);
    (qs[32 * n + l] >> (2 * k)) & 3
}

/// The third bit of code `v` (0..256) of a Q3_K super-block, from its 32 bytes `hmask`: bit
/// `v / 32` of byte `v % 32`.
#[inline]
pub fn k3_high(hmask: &[u8], v: usize) -> u8 {
    (hmask[v % 32] >> (v / 32)) & 1
}

/// The sixteen 6-bit scales of a Q3_K super-block from their 12 packed bytes, less the
/// offset of 32 they are stored with (so -32..=31): scale `j` has its low four bits in the
/// low (`j < 8`) or high nibble of byte `j % 8`, and its top two in bits `2 (j / 4)` of byte
/// `8 + j % 4`.
#[inline]
pub fn k3_scales(q: &[u8]) -> [i8; 16] {
    std::array::from_fn(|j| {
        let low = if j < 8 { q[j] & 0xF } else { q[j - 8] >> 4 };
        let high = (q[8 + j % 4] >> (2 * (j / 4))) & 3;
        (low | (high << 4)) as i8 - 32
    })
}

/// All eight scale/minimum pairs of a Q4_K or Q5_K super-block.
#[inline]
pub fn k4_scales(q: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut mn) = ([0u8; 8], [0u8; 8]);
    for j in 0..8 {
        (sc[j], mn[j]) = k4_scale_min(j, q);
    }
    (sc, mn)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_round_trip_within_half_a_step() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.37)
            .collect();
        let mut b = vec![BlockQ8::default(); 2];
        quantize_q8(&x, &mut b);
        for (i, v) in x.iter().enumerate() {
            let blk = &b[i / QK];
            let back = blk.d * blk.qs[i % QK] as f32;
            assert!((back - v).abs() <= blk.d * 0.5 + 1e-3, "{i}: {v} vs {back}");
        }
        let sum: i32 = b[0].qs.iter().map(|&q| q as i32).sum();
        assert!((b[0].s - b[0].d * sum as f32).abs() <= b[0].s.abs() * 1e-3 + 1e-3);
    }

    #[test]
    fn q8k_sums_and_extreme_value() {
        let x: Vec<f32> = (0..256).map(|i| (i as f32 - 100.0) * 0.01).collect();
        let mut b = [BlockQ8K::default()];
        quantize_q8k(&x, &mut b);
        // the largest magnitude (1.55, positive) maps to -127 under a negative scale
        assert_eq!(b[0].qs[255], -127);
        assert!((b[0].d * -127.0 - 1.55).abs() < 1e-6);
        for j in 0..16 {
            let s: i16 = b[0].qs[j * 16..j * 16 + 16].iter().map(|&q| q as i16).sum();
            assert_eq!(b[0].bsums[j], s);
        }
        for j in 0..8 {
            let s: i16 = b[0].qs[j * 32..j * 32 + 32].iter().map(|&q| q as i16).sum();
            assert_eq!(b[0].sums32[j], s);
        }
        let mut z = [BlockQ8K::default()];
        quantize_q8k(&[0.0; 256], &mut z);
        assert_eq!(z[0].d, 0.0);
    }
}
