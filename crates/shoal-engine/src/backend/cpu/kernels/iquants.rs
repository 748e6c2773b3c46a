//! The grid i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S): 256-value
//! super-blocks whose groups of eight (or four) values are points of a lattice
//! ([`super::iq_grids`]), with signs and small per-16 or per-32 scales. [`decode`] turns one
//! block into 256 small integers and 16 scales (value `i` is `scales[i / 16] * vals[i]`), the
//! form both the reference dequantization and the portable dot product read, so the integer
//! part of a dot product is exact. Every type is also read group by group ([`Lattice`]:
//! magnitudes, sign masks and integer scales of 32 values; IQ1's values in eighths), which is
//! what the batched x86 path unpacks, what the x86 and NEON row kernels of the types but IQ1's
//! multiply with, and what [`decode`] builds on for those types.
//!
//! Layouts, as ggml stores them (`d` an f16; every multi-byte field little-endian):
//! - IQ2_XXS (66 bytes): `d`, then per 32 values two u32: four grid indices (bytes) and
//!   four 7-bit sign codes with a 4-bit scale on top; the scale is `d (0.5 + s) / 4`.
//! - IQ2_XS (74): `d`, 32 u16 (9-bit grid index, 7-bit sign code), 8 bytes of two 4-bit
//!   scales (one per 16 values).
//! - IQ2_S (82): `d`, 32 index bytes, 32 sign bytes, 8 bytes holding the indices' top two
//!   bits, 8 scale bytes as IQ2_XS's.
//! - IQ3_XXS (98): `d`, 64 index bytes (four-value points), then per 32 values a u32 of four
//!   sign codes and a 4-bit scale (`d (0.5 + s) / 2`).
//! - IQ3_S (110): `d`, 64 index bytes, 8 bytes of the indices' ninth bits, 32 sign bytes, 4
//!   bytes of two 4-bit scales (`d (1 + 2 s)`, one per 32 values).
//! - IQ1_S (50): `d`, 32 index bytes, then per 32 values a u16: three more bits of each of
//!   its four indices, a 3-bit scale (`d (2 s + 1)`) and the sign of a shift of 1/8 added to
//!   every value.
//! - IQ1_M (56): 32 index bytes, 16 bytes of three index bits and a shift sign per group of
//!   eight, 8 bytes of 3-bit scales per 16 values whose top nibbles together are `d`.
//!
//! A 7-bit sign code stands for eight signs, the eighth making the count of minus signs even
//! ([`signs_of`]). IQ1's shift of ±1/8 is kept exact by decoding its values in eighths.

use super::formats::{f16_at, WeightType, QK_K};
use super::iq_grids::{IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID};

/// The eight signs (bit `j` set: value `j` is negative) of 7-bit sign code `code`: its seven
/// bits, and an eighth that makes the number of set bits even.
#[inline]
pub const fn signs_of(code: u32) -> u8 {
    let c = (code & 127) as u8;
    c | (((c.count_ones() & 1) as u8) << 7)
}

/// For each sign byte, a mask with byte `j` all ones where bit `j` is set.
static SIGN_MASKS: [u64; 256] = sign_masks();

/// For each 7-bit sign code, the mask of its eight signs ([`signs_of`]).
static EVEN_SIGN_MASKS: [u64; 128] = even_sign_masks();

const fn even_sign_masks() -> [u64; 128] {
    let all = sign_masks();
    let mut t = [0u64; 128];
    let mut c = 0;
    while c < 128 {
        t[c] = all[signs_of(c as u32) as usize];
        c += 1;
    }
    t
}

const fn sign_masks() -> [u64; 256] {
    let mut t = [0u64; 256];
    let mut s = 0;
    while s < 256 {
        let mut j = 0;
        while j < 8 {
            if s >> j & 1 == 1 {
                t[s] |= 0xFF << (8 * j);
            }
            j += 1;
        }
        s += 1;
    }
    t
}

/// Eight magnitudes (the bytes of `grid`, each 1 to 127) negated where the bytes of the
/// mask `m` are all ones, written to `out` (eight long). Bytewise in one u64: a negated byte
/// is `(g ^ 0xFF) + 1`, which never carries into the next byte since `g` is at least 1.
#[inline]
fn signed(grid: u64, m: u64, out: &mut [i8]) {
    let v = (grid ^ m).wrapping_add(m & 0x0101_0101_0101_0101);
    let bytes = v.to_le_bytes().map(|b| b as i8);
    out[..8].copy_from_slice(&bytes);
}

#[inline]
fn u16_at(b: &[u8], at: usize) -> u32 {
    u16::from_le_bytes([b[at], b[at + 1]]) as u32
}

#[inline]
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// One 32-value group of a grid i-quant block (IQ1's values in eighths): four grid
/// points of eight magnitudes (1 to 127, as the bytes of a u64, value 0 lowest), a mask per
/// point with byte `j` all ones where value `j` is negative, and the odd integer scales
/// (at most 31) of the group's two halves of 16 values: value `i` is
/// `FACTOR d scales[i / 16] (±mags)`.
#[derive(Debug, Clone, Copy)]
pub struct Group {
    /// The magnitudes, eight values a word.
    pub mags: [u64; 4],
    /// The sign masks, eight values a word.
    pub minus: [u64; 4],
    /// The scales of values 0-15 and 16-31.
    pub scales: [i32; 2],
}

/// A lattice i-quant: how its blocks read as eight [`Group`]s. The kernels read blocks
/// group by group through this (inlined into each kernel, so the type is known there).
pub trait Lattice {
    /// The type.
    const TYPE: WeightType;
    /// A block's unit, as a fraction of its `d`.
    const FACTOR: f32;
    /// Whether both halves of every group share one scale (a scale per 32 values).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    const PER_32: bool;
    /// Block `b`'s `d`.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    #[inline(always)]
    fn d(b: &[u8]) -> f32 {
        f16_at(b, 0)
    }
    /// Group `g` (0..8) of block `b`.
    fn group(b: &[u8], g: usize) -> Group;
}

/// IQ1_S, its values in eighths (the shift of ±1/8 added), so its unit is `d / 8`.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub struct Iq1S;
/// IQ1_M, as IQ1_S.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub struct Iq1M;
/// IQ2_XXS.
pub struct Iq2Xxs;
/// IQ2_XS.
pub struct Iq2Xs;
/// IQ2_S.
pub struct Iq2S;
/// IQ3_XXS.
pub struct Iq3Xxs;
/// IQ3_S.
pub struct Iq3S;

/// The sign mask of 7-bit sign code `code` (its low seven bits), with the eighth sign that
/// makes the count of minus signs even ([`signs_of`]).
#[inline(always)]
fn code_mask(code: u32) -> u64 {
    EVEN_SIGN_MASKS[(code & 127) as usize]
}

impl Lattice for Iq2Xxs {
    const TYPE: WeightType = WeightType::Iq2Xxs;
    const PER_32: bool = true;
    // d (0.5 + s) / 4 = d / 8 (2 s + 1)
    const FACTOR: f32 = 0.125;
    #[inline(always)]
    fn group(b: &[u8], g: usize) -> Group {
        let at = 2 + 8 * g;
        let aux = u32_at(b, at + 4);
        let s = 2 * (aux >> 28) as i32 + 1;
        Group {
            mags: std::array::from_fn(|l| IQ2XXS_GRID[b[at + l] as usize]),
            minus: std::array::from_fn(|l| code_mask(aux >> (7 * l))),
            scales: [s, s],
        }
    }
}

impl Lattice for Iq2Xs {
    const TYPE: WeightType = WeightType::Iq2Xs;
    const PER_32: bool = false;
    const FACTOR: f32 = 0.125;
    #[inline(always)]
    fn group(b: &[u8], g: usize) -> Group {
        let sc = b[66 + g] as i32;
        let q: [u32; 4] = std::array::from_fn(|l| u16_at(b, 2 + 2 * (4 * g + l)));
        Group {
            mags: std::array::from_fn(|l| IQ2XS_GRID[(q[l] & 511) as usize]),
            minus: std::array::from_fn(|l| code_mask(q[l] >> 9)),
            scales: [2 * (sc & 0xF) + 1, 2 * (sc >> 4) + 1],
        }
    }
}

impl Lattice for Iq2S {
    const TYPE: WeightType = WeightType::Iq2S;
    const PER_32: bool = false;
    const FACTOR: f32 = 0.125;
    #[inline(always)]
    fn group(b: &[u8], g: usize) -> Group {
        let sc = b[74 + g] as i32;
        let high = b[66 + g] as usize;
        Group {
            mags: std::array::from_fn(|l| {
                IQ2S_GRID[b[2 + 4 * g + l] as usize | ((high << (8 - 2 * l)) & 0x300)]
            }),
            minus: std::array::from_fn(|l| SIGN_MASKS[b[34 + 4 * g + l] as usize]),
            scales: [2 * (sc & 0xF) + 1, 2 * (sc >> 4) + 1],
        }
    }
}

impl Lattice for Iq3Xxs {
    const TYPE: WeightType = WeightType::Iq3Xxs;
    const PER_32: bool = true;
    // d (0.5 + s) / 2 = d / 4 (2 s + 1)
    const FACTOR: f32 = 0.25;
    #[inline(always)]
    fn group(b: &[u8], g: usize) -> Group {
        let aux = u32_at(b, 66 + 4 * g);
        let s = 2 * (aux >> 28) as i32 + 1;
        Group {
            mags: std::array::from_fn(|l| {
                let q = 2 + 8 * g + 2 * l;
                IQ3XXS_GRID[b[q] as usize] as u64 | (IQ3XXS_GRID[b[q + 1] as usize] as u64) << 32
            }),
            minus: std::array::from_fn(|l| code_mask(aux >> (7 * l))),
            scales: [s, s],
        }
    }
}

impl Lattice for Iq3S {
    const TYPE: WeightType = WeightType::Iq3S;
    const PER_32: bool = true;
    // d (1 + 2 s)
    const FACTOR: f32 = 1.0;
    #[inline(always)]
    fn group(b: &[u8], g: usize) -> Group {
        let sc = (b[106 + g / 2] >> (4 * (g % 2))) & 0xF;
        let s = 2 * sc as i32 + 1;
        let qh = b[66 + g] as usize;
        Group {
            mags: std::array::from_fn(|l| {
                let q = 2 + 8 * g + 2 * l;
                let i1 = b[q] as usize | ((qh << (8 - 2 * l)) & 256);
                let i2 = b[q + 1] as usize | ((qh << (7 - 2 * l)) & 256);
                IQ3S_GRID[i1] as u64 | (IQ3S_GRID[i2] as u64) << 32
            }),
            minus: std::array::from_fn(|l| SIGN_MASKS[b[74 + 4 * g + l] as usize]),
            scales: [s, s],
        }
    }
}

/// The unpacked form of one super-block column of [`UNPACKED_ROWS`] rows of a lattice type,
/// which the batched x86 kernel reads (`x86_unpacked`): every value as a byte, so a batch of
/// activation rows meets each weight value with one 8-bit multiply-add instead of rebuilding
/// it from grid indices and sign codes once per activation row. Built once per super-block
/// column per batch (a few kilobytes, in L1) and then read by every activation row. Offsets
/// in bytes:
/// - [`D`](unpacked::D): each row's unit, `FACTOR d`, as sixteen f32 (exact: `FACTOR` is a
///   power of two).
/// - [`SC`](unpacked::SC): the odd integer scales per 16 values as signed bytes, byte
///   `16 h + r` for half `h` (0..16) of row `r`.
/// - [`QS`](unpacked::QS): the values, plus 128 (as unsigned bytes, the operand form of an
///   unsigned-by-signed 8-bit product), interleaved four per row: byte `64 v + 4 r + j` is
///   value `4 v + j` of row `r`, so one 64-byte vector holds four values of every row.
///
/// Rows past the live ones are zero (units, scales and values).
#[cfg(target_arch = "x86_64")]
pub mod unpacked {
    /// The rows' units.
    pub const D: usize = 0;
    /// The scales.
    pub const SC: usize = 64;
    /// The values.
    pub const QS: usize = SC + 16 * super::UNPACKED_ROWS;
    /// Bytes of one unpacked super-block column.
    pub const BYTES: usize = QS + super::QK_K * super::UNPACKED_ROWS;
}

/// Rows of an unpacked super-block column ([`unpacked`]).
#[cfg(target_arch = "x86_64")]
pub const UNPACKED_ROWS: usize = 16;

/// One row's part of an unpacked super-block column: block `b`'s values plus 128 in order
/// (as the bytes of 32 words) and its scales per 16 values. Kept out of line: inlined into
/// the AVX-512 unpacking, LLVM turns the grid lookups into slower gathers.
#[cfg(target_arch = "x86_64")]
#[inline(never)]
pub fn unpack_row<L: Lattice>(b: &[u8], values: &mut [u64; QK_K / 8], scales: &mut [i8; 16]) {
    const TOP: u64 = 0x8080_8080_8080_8080;
    for g in 0..QK_K / 32 {
        let group = L::group(b, g);
        scales[2 * g] = group.scales[0] as i8;
        scales[2 * g + 1] = group.scales[1] as i8;
        for l in 0..4 {
            let (m, minus) = (group.mags[l], group.minus[l]);
            // negated bytes as in `signed`, then 128 added (the top bit flipped)
            values[4 * g + l] = (m ^ minus).wrapping_add(minus & 0x0101_0101_0101_0101) ^ TOP;
        }
    }
}

/// Unpacks one super-block of each of `blocks` (at most [`UNPACKED_ROWS`], each a whole block
/// of `L`) into `out` ([`unpacked::BYTES`] long) as [`unpacked`] lays it out; rows past
/// `blocks.len()` are zeroed. The definition the x86 unpacking (`x86_unpacked::unpack`) is
/// tested against.
///
/// # Panics
/// When there are more blocks than rows, a block is short, or `out` is.
#[cfg(all(test, target_arch = "x86_64"))]
pub fn unpack<L: Lattice>(blocks: &[&[u8]], out: &mut [u8]) {
    use unpacked::{D, QS, SC};
    assert!(blocks.len() <= UNPACKED_ROWS && out.len() >= unpacked::BYTES);
    out[..QS].fill(0);
    out[QS..unpacked::BYTES].fill(0x80);
    for (r, &b) in blocks.iter().enumerate() {
        let unit = L::FACTOR * L::d(b);
        out[D + 4 * r..D + 4 * r + 4].copy_from_slice(&unit.to_le_bytes());
        let (mut values, mut scales) = ([0u64; QK_K / 8], [0i8; 16]);
        unpack_row::<L>(b, &mut values, &mut scales);
        for (h, s) in scales.into_iter().enumerate() {
            out[SC + 16 * h + r] = s as u8;
        }
        let bytes: Vec<u8> = values.iter().flat_map(|w| w.to_le_bytes()).collect();
        for (v, four) in bytes.chunks_exact(4).enumerate() {
            out[QS + 64 * v + 4 * r..QS + 64 * v + 4 * r + 4].copy_from_slice(four);
        }
    }
}

/// Eight values (bytes of `v`, none of them 0) as their magnitudes and sign mask.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[inline(always)]
fn split_signs(v: u64) -> (u64, u64) {
    const LOW: u64 = 0x0101_0101_0101_0101;
    let minus = ((v >> 7) & LOW) * 0xFF;
    ((v ^ minus).wrapping_add(minus & LOW), minus)
}

impl Lattice for Iq1S {
    const TYPE: WeightType = WeightType::Iq1S;
    const PER_32: bool = true;
    // d (2 s + 1) with the values in eighths
    const FACTOR: f32 = 0.125;
    #[inline(always)]
    fn group(b: &[u8], g: usize) -> Group {
        let qh = u16_at(b, 34 + 2 * g);
        let s = 2 * ((qh >> 12) & 7) as i32 + 1;
        let table = &IQ1_EIGHTHS[usize::from(qh & 0x8000 != 0)];
        let points: [(u64, u64); 4] = std::array::from_fn(|l| {
            split_signs(table[b[2 + 4 * g + l] as usize | (((qh >> (3 * l)) & 7) as usize) << 8])
        });
        Group {
            mags: points.map(|p| p.0),
            minus: points.map(|p| p.1),
            scales: [s, s],
        }
    }
}

impl Lattice for Iq1M {
    const TYPE: WeightType = WeightType::Iq1M;
    const PER_32: bool = false;
    const FACTOR: f32 = 0.125;
    #[inline(always)]
    fn d(b: &[u8]) -> f32 {
        let sc = [u16_at(b, 48), u16_at(b, 50), u16_at(b, 52), u16_at(b, 54)];
        let bits =
            (sc[0] >> 12) | ((sc[1] >> 8) & 0xF0) | ((sc[2] >> 4) & 0xF00) | (sc[3] & 0xF000);
        half::f16::from_bits(bits as u16).to_f32()
    }
    #[inline(always)]
    fn group(b: &[u8], g: usize) -> Group {
        let s = u16_at(b, 48 + 2 * (g / 2)) >> (6 * (g % 2));
        let (h0, h1) = (b[32 + 2 * g] as usize, b[33 + 2 * g] as usize);
        let q = 4 * g;
        let points = [
            (b[q] as usize | ((h0 << 8) & 0x700), h0 & 0x08),
            (b[q + 1] as usize | ((h0 << 4) & 0x700), h0 & 0x80),
            (b[q + 2] as usize | ((h1 << 8) & 0x700), h1 & 0x08),
            (b[q + 3] as usize | ((h1 << 4) & 0x700), h1 & 0x80),
        ]
        .map(|(index, negative)| split_signs(IQ1_EIGHTHS[usize::from(negative != 0)][index]));
        Group {
            mags: points.map(|p| p.0),
            minus: points.map(|p| p.1),
            scales: [2 * (s & 7) as i32 + 1, 2 * ((s >> 3) & 7) as i32 + 1],
        }
    }
}

/// Decodes a lattice type's block `b` into `vals` and `scales`.
fn decode_lattice<L: Lattice>(b: &[u8], vals: &mut [i8; QK_K], scales: &mut [f32; 16]) {
    let unit = L::FACTOR * f16_at(b, 0);
    for g in 0..QK_K / 32 {
        let group = L::group(b, g);
        for h in 0..2 {
            scales[2 * g + h] = unit * group.scales[h] as f32;
        }
        for l in 0..4 {
            let o = 32 * g + 8 * l;
            signed(group.mags[l], group.minus[l], &mut vals[o..o + 8]);
        }
    }
}

/// Decodes one block `b` of i-quant type `ty` into `vals` and `scales` (value `i` is
/// `scales[i / 16] * vals[i]`).
///
/// # Panics
/// When `ty` is not an i-quant of this module or `b` is shorter than its block.
pub fn decode(ty: WeightType, b: &[u8], vals: &mut [i8; QK_K], scales: &mut [f32; 16]) {
    match ty {
        WeightType::Iq2Xxs => decode_lattice::<Iq2Xxs>(b, vals, scales),
        WeightType::Iq2Xs => decode_lattice::<Iq2Xs>(b, vals, scales),
        WeightType::Iq2S => decode_lattice::<Iq2S>(b, vals, scales),
        WeightType::Iq3Xxs => decode_lattice::<Iq3Xxs>(b, vals, scales),
        WeightType::Iq3S => decode_lattice::<Iq3S>(b, vals, scales),
        WeightType::Iq1S => {
            let d = f16_at(b, 0);
            for ib in 0..8 {
                let qh = u16_at(b, 34 + 2 * ib);
                // in eighths: the grid's -1, 0, 1 become -8, 0, 8, the shift is -1 or 1
                let s = d * (2 * ((qh >> 12) & 7) + 1) as f32 / 8.0;
                scales[2 * ib] = s;
                scales[2 * ib + 1] = s;
                let negative = qh & 0x8000 != 0;
                for l in 0..4 {
                    let index =
                        b[2 + 4 * ib + l] as usize | ((((qh >> (3 * l)) & 7) as usize) << 8);
                    let o = 32 * ib + 8 * l;
                    eighths(index, negative, &mut vals[o..o + 8]);
                }
            }
        }
        WeightType::Iq1M => {
            let sc = [u16_at(b, 48), u16_at(b, 50), u16_at(b, 52), u16_at(b, 54)];
            let bits =
                (sc[0] >> 12) | ((sc[1] >> 8) & 0xF0) | ((sc[2] >> 4) & 0xF00) | (sc[3] & 0xF000);
            let d = half::f16::from_bits(bits as u16).to_f32();
            for ib in 0..8 {
                let s = sc[ib / 2] >> (6 * (ib % 2));
                scales[2 * ib] = d * (2 * (s & 7) + 1) as f32 / 8.0;
                scales[2 * ib + 1] = d * (2 * ((s >> 3) & 7) + 1) as f32 / 8.0;
                let (h0, h1) = (b[32 + 2 * ib] as usize, b[32 + 2 * ib + 1] as usize);
                let q = 4 * ib;
                let groups = [
                    (b[q] as usize | ((h0 << 8) & 0x700), h0 & 0x08),
                    (b[q + 1] as usize | ((h0 << 4) & 0x700), h0 & 0x80),
                    (b[q + 2] as usize | ((h1 << 8) & 0x700), h1 & 0x08),
                    (b[q + 3] as usize | ((h1 << 4) & 0x700), h1 & 0x80),
                ];
                for (l, (index, negative)) in groups.into_iter().enumerate() {
                    let o = 32 * ib + 8 * l;
                    eighths(index, negative != 0, &mut vals[o..o + 8]);
                }
            }
        }
        other => panic!("{other:?} is not a grid i-quant"),
    }
}

/// IQ1's grid points in eighths with the shift added: `[+1/8, -1/8]` tables, each point's
/// eight values `8 g ± 1` as bytes of one u64 (derived from [`IQ1S_GRID`]).
pub(super) static IQ1_EIGHTHS: [[u64; 2048]; 2] = [eighths_table(1), eighths_table(-1)];

const fn eighths_table(shift: i8) -> [u64; 2048] {
    let mut t = [0u64; 2048];
    let mut i = 0;
    while i < 2048 {
        let mut j = 0;
        while j < 8 {
            let g = (IQ1S_GRID[i] >> (8 * j)) as u8 as i8;
            t[i] |= ((8 * g + shift) as u8 as u64) << (8 * j);
            j += 1;
        }
        i += 1;
    }
    t
}

/// IQ1's eight values of grid point `index` with a shift of `+1/8` (or `-1/8` when
/// `negative`), in eighths, written to `out`.
#[inline]
fn eighths(index: usize, negative: bool, out: &mut [i8]) {
    let v = IQ1_EIGHTHS[usize::from(negative)][index];
    for (o, b) in out.iter_mut().zip(v.to_le_bytes()) {
        *o = b as i8;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signs_negate_exactly_the_marked_bytes() {
        let grid = u64::from_le_bytes([1, 8, 25, 43, 62, 127, 4, 15]);
        for signs in 0..=255u8 {
            let mut out = [0i8; 8];
            signed(grid, SIGN_MASKS[signs as usize], &mut out);
            for (j, (&o, g)) in out.iter().zip(grid.to_le_bytes()).enumerate() {
                let want = if signs >> j & 1 == 1 {
                    -(g as i8)
                } else {
                    g as i8
                };
                assert_eq!(o, want, "signs {signs:#010b} byte {j}");
            }
        }
    }

    #[test]
    fn sign_codes_keep_an_even_count_of_minus_signs() {
        for code in 0..128u32 {
            let s = signs_of(code);
            assert_eq!(s & 127, code as u8);
            assert_eq!(s.count_ones() % 2, 0, "{code}");
            assert_eq!(code_mask(code), SIGN_MASKS[s as usize], "{code}");
        }
        // ggml's ksigns_iq2xs begins 0, 129, 130, 3, 132, 5, 6, 135
        assert_eq!(
            (0..8).map(signs_of).collect::<Vec<_>>(),
            [0, 129, 130, 3, 132, 5, 6, 135]
        );
    }
}
