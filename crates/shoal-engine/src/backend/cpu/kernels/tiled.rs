//! The interleaved layout the SIMD kernels read the 32-value block types in. Eight rows form
//! a tile; for each block column a tile stores the eight scales together (f16, or MXFP4's
//! E8M0 bytes; then the eight minimums, for Q4_1 and Q5_1), 32 more bytes for Q5_0 and Q5_1
//! (their codes' top bits, as [`HighBits`] says), and the quant bytes interleaved four at a
//! time: byte `4 r + j` of group vector `g` is byte `4 g + j` of row `r` (of its codes, for
//! Q5 in [`HighBits::Whole`]). One 32-byte load then holds four codes of each of eight rows,
//! so a single 8-bit dot-product instruction against four broadcast activations
//! yields eight row sums at once: no horizontal reductions, one scale conversion per eight
//! rows. A tile is exactly eight blocks' bytes, so repacking costs no memory; the last tile
//! of a ragged matrix is padded with zero rows.
//!
//! The K-quants tile the same way per 256-value super-block: the eight rows' f16 scales
//! together, the sub-block scales of Q4_K/Q5_K unpacked from 6 bits to one byte each
//! (`[sub-block][row]`, 32 bytes more per tile: 2.8% for Q4_K), Q6_K's 8-bit scales regrouped
//! `[sub-block][row]`, and every quant array (nibbles, Q5_K's 5th bits, Q6_K's low nibbles
//! and high bit pairs, or its whole codes as [`HighBits::Whole`] says) interleaved four bytes
//! per row as above.
//!
//! IQ4_XS tiles per super-block too: the eight rows' f16 scales, the sub-block scales as
//! signed bytes `[sub-block][row]` (64 bytes where the file packs 48: 1.5% more), and each
//! 32-value sub-block's codes interleaved as a Q4_0 tile's, so its kernels are IQ4_NL's
//! eight times over with a scale per sub-block.
//!
//! Q2_K and Q3_K keep the same interleave for AVX2 and NEON, so group vector `(n, g)` of
//! their 2-bit codes holds, in bits `2 k`, the codes of values `128 n + 32 k + 4 g .. + 4` of
//! each row; their 16-value sub-blocks `2 j` and `2 j + 1` (`j = 4 n + k`) are then groups
//! 0-3 and 4-7 of quarter `(n, k)`. For AVX-512 they interleave eight bytes per row
//! ([`HighBits::Wide`]): a 64-byte vector holds eight codes of each row, so one tile fills
//! 512-bit vectors and its block is read as one stream (two tiles side by side, as the
//! batched kernels of the other types run, read two streams, which memory serves slower),
//! and each sub-block is two such vectors. Their sub-block scales are stored in pairs: byte `16 j + 2 r + i` is
//! row `r`'s scale of sub-block `2 j + i`, so one widening load gives each row's two scales
//! as the two 16-bit halves of its 32-bit lane, the operand of one 16-bit multiply-add over
//! both sub-blocks' sums. Q2_K's scale bytes are the file's (scale and minimum nibbles): the
//! tile is the file's bytes in another order. Q3_K's 6-bit scales are unpacked to one signed
//! byte each, their offset of 32 taken off (3.6% more bytes), and its codes are kept whole
//! ([`q3k_pack`]: eight code vectors in three group vectors), which takes 17 to 19
//! instructions per eight code vectors to unpack where the file's bit planes take about 40.

use super::formats::WeightType;

/// Rows per tile.
pub const TILE_ROWS: usize = 8;

/// How a tile block stores the high bits of Q5_0, Q5_1 and Q6_K codes (in the same bytes
/// either way). A code vector is a 32-byte vector of codes a kernel builds: byte `i` of it
/// is a code of row `i / 4`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HighBits {
    /// Q5: the quant bytes as in the file (nibbles of vectors `m` and `m + 4` in group
    /// vector `m`), and one 32-bit mask of fifth bits per code vector (`k` of 8): bit `i` of
    /// mask `k` is the 5th bit of byte `i` of vector `k`. AVX-512 uses a mask as a byte-mask
    /// register as it is; NEON expands it. Q6_K (NEON): nibbles and 2-bit pairs as in the
    /// file, interleaved.
    Masks,
    /// Codes kept whole, for AVX2 (no byte masks), and for Q6_K under AVX-512 too. Q5: byte
    /// `i` of group vector `m` (0..4) holds vector `m`'s code in bits 0-4 and the low three
    /// bits of vector `m + 4`'s code in bits 5-7; byte `i` of the 32 other bytes holds the
    /// top two bits of vector `m + 4`'s code in bits `2 m` and `2 m + 1`. Vectors 0-3 then
    /// cost one `and` each and vectors 4-7 five instructions, 24 in all, where nibbles and
    /// bit planes cost 35. Q6_K: of the three vectors that held one group's low nibbles
    /// twice and its 2-bit pairs, byte `i` of vector `k` (0..3) holds the group's code `k`
    /// whole in bits 0-5, and in bits 6-7 two bits of code 3 (bits 4-5, 2-3 and 0-1 of it
    /// for `k` = 0, 1, 2): 11 instructions for the four code vectors where nibbles and pairs
    /// take 17.
    Whole,
    /// AVX-512, for Q2_K and Q3_K: their codes interleaved eight bytes per row instead of
    /// four (byte `8 r + j` of a 64-byte group vector is byte `8 g + j` of row `r`'s codes),
    /// so one 512-bit load holds eight codes of each of the eight rows, and eight consecutive
    /// activations broadcast as one 64-bit value meet them. Other types read it as
    /// [`HighBits::Masks`].
    Wide,
}

/// Where the parts of a block live, in the file's block and in the tile.
struct Parts {
    /// Offset of the minimum in a block (types with a minimum).
    m: Option<usize>,
    /// Offset of the 32 fifth bits in a block (Q5 types).
    qh: Option<usize>,
    /// Offset of the quant bytes in a block.
    qs: usize,
    /// Quant bytes per block (16 nibble-packed, 32 for Q8_0).
    qs_len: usize,
}

fn parts(ty: WeightType) -> Option<Parts> {
    let (m, qh, qs, qs_len) = match ty {
        WeightType::Q4_0 => (None, None, 2, 16),
        WeightType::Q4_1 => (Some(2), None, 4, 16),
        WeightType::Q5_0 => (None, Some(2), 6, 16),
        WeightType::Q5_1 => (Some(2), Some(4), 8, 16),
        WeightType::Q8_0 => (None, None, 2, 32),
        WeightType::Iq4Nl => (None, None, 2, 16),
        WeightType::Mxfp4 => (None, None, 1, 16),
        _ => return None,
    };
    Some(Parts { m, qh, qs, qs_len })
}

/// Whether `ty` has a tiled layout.
pub fn is_tiled_type(ty: WeightType) -> bool {
    parts(ty).is_some() || is_k(ty)
}

/// Whether `ty` tiles by 256-value super-blocks: the K-quants and IQ4_XS.
fn is_k(ty: WeightType) -> bool {
    matches!(
        ty,
        WeightType::Q2K | WeightType::Q3K | WeightType::Q4K | WeightType::Q5K | WeightType::Q6K
    ) || ty == WeightType::Iq4Xs
}

/// Bytes of one tile block (eight rows, one block column).
pub fn tile_block_bytes(ty: WeightType) -> usize {
    match ty {
        WeightType::Q4K => 32 + 128 + 1024,
        WeightType::Q5K => 32 + 128 + 256 + 1024,
        WeightType::Q3K => 16 + 128 + 768,
        WeightType::Iq4Xs => k_offsets::QSX + 1024,
        _ => ty.block_bytes() * TILE_ROWS,
    }
}

/// K-quant tile offsets: scales `[sub][row]` (after the f16 fields), then the interleaved
/// 5th-bit plane (Q5_K), then the interleaved nibbles.
pub mod k_offsets {
    /// Q4_K/Q5_K: `d[8]` at 0, `dmin[8]` at 16, scales at 32, minimums at 96.
    pub const SC: usize = 32;
    /// See [`SC`].
    pub const MN: usize = 96;
    /// Q5_K 5th bits.
    pub const QH5: usize = 160;
    /// Q4_K nibbles.
    pub const QS4: usize = 160;
    /// Q5_K nibbles.
    pub const QS5: usize = 416;
    /// Q6_K: `d[8]` at 0, scales `[16][8]` at 16, low nibbles at 144, high pairs at 1168.
    pub const SC6: usize = 16;
    /// See [`SC6`].
    pub const QL6: usize = 144;
    /// See [`SC6`].
    pub const QH6: usize = 1168;
    /// Q2_K: `d[8]` at 0, `dmin[8]` at 16, scale bytes in pairs `[8][8][2]` at 32, codes
    /// at 160.
    pub const SC2: usize = 32;
    /// See [`SC2`].
    pub const QS2: usize = 160;
    /// Q3_K: `d[8]` at 0, signed scales in pairs `[8][8][2]` at 16, whole codes at 144
    /// (units of three group vectors, see [`super::q3k_positions`]).
    pub const SC3: usize = 16;
    /// See [`SC3`].
    pub const QS3: usize = 144;
    /// IQ4_XS: `d[8]` at 0, the sub-block scales unpacked to signed bytes `[8][8]` at 16
    /// (offset of 32 taken off), then each 32-value sub-block's codes as a Q4_0 tile holds
    /// its block's (128 bytes apiece) at 80.
    pub const SCX: usize = 16;
    /// See [`SCX`].
    pub const QSX: usize = 80;
}

/// Codes for the 32-value types as the tile kernels' const parameter (a const generic cannot
/// be a [`WeightType`]), and what those kernels know of each type at compile time.
pub mod kinds {
    use super::{WeightType, TILE_ROWS};

    /// Q4_0.
    pub const Q4_0: u8 = 0;
    /// Q4_1.
    pub const Q4_1: u8 = 1;
    /// Q5_0.
    pub const Q5_0: u8 = 2;
    /// Q5_1.
    pub const Q5_1: u8 = 3;
    /// Q8_0.
    pub const Q8_0: u8 = 4;
    /// IQ4_NL.
    pub const IQ4_NL: u8 = 5;
    /// MXFP4.
    pub const MXFP4: u8 = 6;

    /// The weight type of code `kind`.
    pub const fn weight_type(kind: u8) -> WeightType {
        match kind {
            Q4_0 => WeightType::Q4_0,
            Q4_1 => WeightType::Q4_1,
            Q5_0 => WeightType::Q5_0,
            Q5_1 => WeightType::Q5_1,
            IQ4_NL => WeightType::Iq4Nl,
            MXFP4 => WeightType::Mxfp4,
            _ => WeightType::Q8_0,
        }
    }

    /// The code of a 32-value type.
    ///
    /// # Panics
    /// When `ty` is not one of them.
    pub fn of(ty: WeightType) -> u8 {
        match ty {
            WeightType::Q4_0 => Q4_0,
            WeightType::Q4_1 => Q4_1,
            WeightType::Q5_0 => Q5_0,
            WeightType::Q5_1 => Q5_1,
            WeightType::Q8_0 => Q8_0,
            WeightType::Iq4Nl => IQ4_NL,
            WeightType::Mxfp4 => MXFP4,
            other => panic!("{other:?} is not a 32-value tiled type"),
        }
    }

    /// Bytes of one row's block in the file.
    pub const fn block_bytes(kind: u8) -> usize {
        weight_type(kind).block_bytes()
    }

    /// Whether blocks carry a minimum (Q4_1, Q5_1).
    pub const fn has_min(kind: u8) -> bool {
        matches!(kind, Q4_1 | Q5_1)
    }

    /// Whether blocks carry 5th bits (Q5_0, Q5_1).
    pub const fn has_high_bit(kind: u8) -> bool {
        matches!(kind, Q5_0 | Q5_1)
    }

    /// Whether codes index a grid of sixteen values (IQ4_NL, MXFP4).
    pub const fn is_grid(kind: u8) -> bool {
        matches!(kind, IQ4_NL | MXFP4)
    }

    /// Bytes of a block's scale: an f16, or MXFP4's E8M0 byte.
    pub const fn scale_bytes(kind: u8) -> usize {
        if kind == MXFP4 {
            1
        } else {
            2
        }
    }

    /// `(minimums, masks, quants)` offsets in a tile block (as [`super::tile_offsets`]).
    pub const fn offsets(kind: u8) -> (usize, usize, usize) {
        let m = scale_bytes(kind) * TILE_ROWS;
        let masks = m + if has_min(kind) { 2 * TILE_ROWS } else { 0 };
        let qs = masks + if has_high_bit(kind) { 32 } else { 0 };
        (m, masks, qs)
    }
}

/// Interleaves `n` bytes of `src` (one row's array) into `dst` (the tile's array) as row `r`:
/// byte `j` of row group `g` goes to `32 g + 4 r + j`.
fn interleave(dst: &mut [u8], src: &[u8], r: usize) {
    interleave_by(dst, src, r, 4);
}

/// [`interleave`] `w` bytes per row: byte `j` of row group `g` goes to `8 w g + w r + j`.
fn interleave_by(dst: &mut [u8], src: &[u8], r: usize, w: usize) {
    for (g, run) in src.chunks_exact(w).enumerate() {
        dst[8 * w * g + w * r..][..w].copy_from_slice(run);
    }
}

/// The inverse of [`interleave`].
fn deinterleave(src: &[u8], dst: &mut [u8], r: usize) {
    deinterleave_by(src, dst, r, 4);
}

/// The inverse of [`interleave_by`].
fn deinterleave_by(src: &[u8], dst: &mut [u8], r: usize, w: usize) {
    for (g, run) in dst.chunks_exact_mut(w).enumerate() {
        run.copy_from_slice(&src[8 * w * g + w * r..][..w]);
    }
}

/// Bytes per row in a Q2_K or Q3_K group vector under `bits`: 8 for [`HighBits::Wide`], else 4.
fn k23_width(bits: HighBits) -> usize {
    if bits == HighBits::Wide {
        8
    } else {
        4
    }
}

/// Packs eight 6-bit scales and minimums back into a Q4_K/Q5_K 12-byte field.
fn pack_k4_scales(sc: &[u8; 8], mn: &[u8; 8]) -> [u8; 12] {
    let mut q = [0u8; 12];
    for j in 0..4 {
        q[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        q[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
        q[j + 8] = (sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4);
    }
    q
}

/// Code `v` (0..256) of a Q6_K block `src`, 0..64 (before the offset of 32).
fn q6k_code(src: &[u8], v: usize) -> u8 {
    let (n, quarter, l) = (v / 128, v % 128 / 32, v % 32);
    let ql = src[64 * n + l + 32 * (quarter % 2)];
    let low = if quarter < 2 { ql & 0xF } else { ql >> 4 };
    let high = (src[128 + 32 * n + l] >> (2 * quarter)) & 3;
    low | (high << 4)
}

/// Sets code `v` (0..256) of a Q6_K block `dst` whose quant bytes start zeroed: the inverse
/// of [`q6k_code`].
fn put_q6k_code(dst: &mut [u8], v: usize, code: u8) {
    let (n, quarter, l) = (v / 128, v % 128 / 32, v % 32);
    let nibble = code & 0xF;
    dst[64 * n + l + 32 * (quarter % 2)] |= if quarter < 2 { nibble } else { nibble << 4 };
    dst[128 + 32 * n + l] |= (code >> 4) << (2 * quarter);
}

/// Every Q6_K group `(n, g)` (half, group of four values) and byte `j` of a row's four in
/// it: group vector `k` holds value `128 n + 32 k + 4 g + j`.
fn q6k_groups() -> impl Iterator<Item = (usize, usize, usize)> {
    (0..2).flat_map(|n| (0..8).flat_map(move |g| (0..4).map(move |j| (n, g, j))))
}

/// Where byte `j` (0..4) of row `r` of Q6_K group `(n, g)`'s whole-code vector `k` (0..3)
/// lives in a tile block: the places of its low nibbles (`k` 0, 1) and pairs (`k` 2).
fn q6k_whole_at(n: usize, g: usize, k: usize, r: usize, j: usize) -> usize {
    use k_offsets::*;
    let at = match k {
        0 => QL6 + 512 * n,
        1 => QL6 + 512 * n + 256,
        _ => QH6 + 256 * n,
    };
    at + 32 * g + 4 * r + j
}

/// The three bytes holding codes `c[0..8]` (3 bits each) of one position of a Q3_K tile's
/// unit ([`q3k_positions`]), one from each of its three group vectors: code 0, 2, 4 in bits 0-2 of bytes 0, 1, 2, codes 1, 3, 5 in their bits 3-5,
/// code 6's low two bits in bits 6-7 of byte 0 and code 7's in those of byte 1, the top
/// bits of codes 6 and 7 in bits 6 and 7 of byte 2.
pub fn q3k_pack(c: [u8; 8]) -> [u8; 3] {
    [
        c[0] | (c[1] << 3) | ((c[6] & 3) << 6),
        c[2] | (c[3] << 3) | ((c[7] & 3) << 6),
        c[4] | (c[5] << 3) | ((c[6] >> 2) << 6) | ((c[7] >> 2) << 7),
    ]
}

/// The inverse of [`q3k_pack`].
pub fn q3k_unpack(b: [u8; 3]) -> [u8; 8] {
    [
        b[0] & 7,
        (b[0] >> 3) & 7,
        b[1] & 7,
        (b[1] >> 3) & 7,
        b[2] & 7,
        (b[2] >> 3) & 7,
        (b[0] >> 6) | (((b[2] >> 6) & 1) << 2),
        (b[1] >> 6) | ((b[2] >> 7) << 2),
    ]
}

/// Every unit `u` of a Q3_K tile block's codes and byte `j` of a row's `w` in a group, `w`
/// being [`k23_width`]: a unit is three group vectors holding eight code vectors, `w` codes
/// of each row apiece (a quarter `(n, k)` of 32 values for `w` 4, two quarters for `w` 8);
/// code vector `g` of unit `u` holds values `8 w u + w g ..` ([`q3k_value`]).
fn q3k_positions(w: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..32 / w).flat_map(move |u| (0..w).map(move |j| (u, j)))
}

/// Value of code `g` (0..8) at position `j` of unit `u`, `w` bytes per row.
fn q3k_value(w: usize, u: usize, j: usize, g: usize) -> usize {
    8 * w * u + w * g + j
}

/// Where byte `m` (0..3) of row `r`'s position `j` of unit `u` lives in a Q3_K tile block,
/// `w` bytes per row.
fn q3k_at(w: usize, u: usize, m: usize, r: usize, j: usize) -> usize {
    k_offsets::QS3 + 24 * w * u + 8 * w * m + w * r + j
}

fn tile_k_block(ty: WeightType, src: &[u8], dst: &mut [u8], r: usize, bits: HighBits) {
    use super::formats::{k2_code, k3_high, k3_scales};
    use k_offsets::*;
    match ty {
        WeightType::Q2K => {
            dst[2 * r..2 * r + 2].copy_from_slice(&src[80..82]);
            dst[16 + 2 * r..16 + 2 * r + 2].copy_from_slice(&src[82..84]);
            for j in 0..8 {
                dst[SC2 + 16 * j + 2 * r..][..2].copy_from_slice(&src[2 * j..2 * j + 2]);
            }
            interleave_by(&mut dst[QS2..QS2 + 512], &src[16..80], r, k23_width(bits));
        }
        WeightType::Q3K => {
            dst[2 * r..2 * r + 2].copy_from_slice(&src[108..110]);
            let sc = k3_scales(&src[96..108]);
            for j in 0..8 {
                dst[SC3 + 16 * j + 2 * r] = sc[2 * j] as u8;
                dst[SC3 + 16 * j + 2 * r + 1] = sc[2 * j + 1] as u8;
            }
            let w = k23_width(bits);
            for (u, j) in q3k_positions(w) {
                let codes = std::array::from_fn(|g| {
                    let v = q3k_value(w, u, j, g);
                    k2_code(&src[32..96], v) | (k3_high(&src[..32], v) << 2)
                });
                for (m, byte) in q3k_pack(codes).into_iter().enumerate() {
                    dst[q3k_at(w, u, m, r, j)] = byte;
                }
            }
        }
        WeightType::Q6K => {
            dst[2 * r..2 * r + 2].copy_from_slice(&src[208..210]);
            for s in 0..16 {
                dst[SC6 + 8 * s + r] = src[192 + s];
            }
            if bits == HighBits::Whole {
                for (n, g, j) in q6k_groups() {
                    let code = |k: usize| q6k_code(src, 128 * n + 32 * k + 4 * g + j);
                    let c3 = code(3);
                    for (k, piece) in [(0, c3 >> 4), (1, (c3 >> 2) & 3), (2, c3 & 3)] {
                        dst[q6k_whole_at(n, g, k, r, j)] = code(k) | (piece << 6);
                    }
                }
                return;
            }
            interleave(&mut dst[QL6..QL6 + 1024], &src[0..128], r);
            interleave(&mut dst[QH6..QH6 + 512], &src[128..192], r);
        }
        WeightType::Iq4Xs => {
            dst[2 * r..2 * r + 2].copy_from_slice(&src[0..2]);
            for ib in 0..8 {
                dst[SCX + 8 * ib + r] = super::formats::iq4xs_scale(src, ib) as i8 as u8;
                let codes = &src[8 + 16 * ib..8 + 16 * ib + 16];
                interleave(&mut dst[QSX + 128 * ib..QSX + 128 * (ib + 1)], codes, r);
            }
        }
        _ => {
            dst[2 * r..2 * r + 2].copy_from_slice(&src[0..2]);
            dst[16 + 2 * r..16 + 2 * r + 2].copy_from_slice(&src[2..4]);
            let (sc, mn) = super::formats::k4_scales(&src[4..16]);
            for s in 0..8 {
                dst[SC + 8 * s + r] = sc[s];
                dst[MN + 8 * s + r] = mn[s];
            }
            if ty == WeightType::Q5K {
                interleave(&mut dst[QH5..QH5 + 256], &src[16..48], r);
                interleave(&mut dst[QS5..QS5 + 1024], &src[48..176], r);
            } else {
                interleave(&mut dst[QS4..QS4 + 1024], &src[16..144], r);
            }
        }
    }
}

fn untile_k_block(ty: WeightType, src: &[u8], dst: &mut [u8], r: usize, bits: HighBits) {
    use k_offsets::*;
    match ty {
        WeightType::Q2K => {
            dst[80..82].copy_from_slice(&src[2 * r..2 * r + 2]);
            dst[82..84].copy_from_slice(&src[16 + 2 * r..16 + 2 * r + 2]);
            for j in 0..8 {
                dst[2 * j..2 * j + 2].copy_from_slice(&src[SC2 + 16 * j + 2 * r..][..2]);
            }
            deinterleave_by(&src[QS2..QS2 + 512], &mut dst[16..80], r, k23_width(bits));
        }
        WeightType::Q3K => {
            dst[108..110].copy_from_slice(&src[2 * r..2 * r + 2]);
            // the scales back to 6 bits with their offset, packed as the file packs them
            let scales = &mut dst[96..108];
            for s in 0..16 {
                let at = SC3 + 16 * (s / 2) + 2 * r + s % 2;
                let v = (src[at] as i8 as i32 + 32) as u8;
                scales[s % 8] |= (v & 0xF) << (4 * (s / 8));
                scales[8 + s % 4] |= (v >> 4) << (2 * (s / 4));
            }
            let w = k23_width(bits);
            for (u, j) in q3k_positions(w) {
                let bytes = std::array::from_fn(|m| src[q3k_at(w, u, m, r, j)]);
                for (g, code) in q3k_unpack(bytes).into_iter().enumerate() {
                    let v = q3k_value(w, u, j, g);
                    let (n, k, l) = (v / 128, v % 128 / 32, v % 32);
                    dst[32 + 32 * n + l] |= (code & 3) << (2 * k);
                    dst[l] |= (code >> 2) << (v / 32);
                }
            }
        }
        WeightType::Q6K => {
            dst[208..210].copy_from_slice(&src[2 * r..2 * r + 2]);
            for s in 0..16 {
                dst[192 + s] = src[SC6 + 8 * s + r];
            }
            if bits == HighBits::Whole {
                for (n, g, j) in q6k_groups() {
                    let byte = |k: usize| src[q6k_whole_at(n, g, k, r, j)];
                    let c3 = ((byte(0) >> 6) << 4) | ((byte(1) >> 6) << 2) | (byte(2) >> 6);
                    for k in 0..4 {
                        let code = if k == 3 { c3 } else { byte(k) & 0x3F };
                        put_q6k_code(dst, 128 * n + 32 * k + 4 * g + j, code);
                    }
                }
                return;
            }
            deinterleave(&src[QL6..QL6 + 1024], &mut dst[0..128], r);
            deinterleave(&src[QH6..QH6 + 512], &mut dst[128..192], r);
        }
        WeightType::Iq4Xs => {
            dst[0..2].copy_from_slice(&src[2 * r..2 * r + 2]);
            let mut high = 0u16;
            for ib in 0..8 {
                let ls = (src[SCX + 8 * ib + r] as i8 as i32 + 32) as u8;
                high |= ((ls >> 4) as u16) << (2 * ib);
                dst[4 + ib / 2] |= (ls & 0xF) << (4 * (ib % 2));
                let codes = &mut dst[8 + 16 * ib..8 + 16 * ib + 16];
                deinterleave(&src[QSX + 128 * ib..QSX + 128 * (ib + 1)], codes, r);
            }
            dst[2..4].copy_from_slice(&high.to_le_bytes());
        }
        _ => {
            dst[0..2].copy_from_slice(&src[2 * r..2 * r + 2]);
            dst[2..4].copy_from_slice(&src[16 + 2 * r..16 + 2 * r + 2]);
            let (mut sc, mut mn) = ([0u8; 8], [0u8; 8]);
            for s in 0..8 {
                sc[s] = src[SC + 8 * s + r];
                mn[s] = src[MN + 8 * s + r];
            }
            dst[4..16].copy_from_slice(&pack_k4_scales(&sc, &mn));
            if ty == WeightType::Q5K {
                deinterleave(&src[QH5..QH5 + 256], &mut dst[16..48], r);
                deinterleave(&src[QS5..QS5 + 1024], &mut dst[48..176], r);
            } else {
                deinterleave(&src[QS4..QS4 + 1024], &mut dst[16..144], r);
            }
        }
    }
}

/// Offsets inside one tile block: `(minimums, masks, quants)`.
pub fn tile_offsets(ty: WeightType) -> (usize, usize, usize) {
    kinds::offsets(kinds::of(ty))
}

/// Bytes of `rows` rows of `blocks` blocks once tiled (a ragged last tile is padded).
pub fn tiled_len(ty: WeightType, rows: usize, blocks: usize) -> usize {
    rows.div_ceil(TILE_ROWS) * blocks * tile_block_bytes(ty)
}

/// Repacks `rows` rows of `blocks` blocks (`data`, row-major file layout) into tiles in
/// `out` ([`tiled_len`] long, zeroed: a ragged last tile's padding rows are left as they
/// are), the high bits of Q5_0, Q5_1 and Q6_K codes as `bits` says.
pub fn tile(
    ty: WeightType,
    rows: usize,
    blocks: usize,
    data: &[u8],
    bits: HighBits,
    out: &mut [u8],
) {
    assert_eq!(out.len(), tiled_len(ty, rows, blocks), "tile output length");
    if is_k(ty) {
        let (bb, tb) = (ty.block_bytes(), tile_block_bytes(ty));
        for (row, src_row) in data.chunks_exact(blocks * bb).enumerate().take(rows) {
            let (tile, r) = (row / TILE_ROWS, row % TILE_ROWS);
            for (b, src) in src_row.chunks_exact(bb).enumerate() {
                tile_k_block(ty, src, &mut out[(tile * blocks + b) * tb..][..tb], r, bits);
            }
        }
        return;
    }
    let p = parts(ty).expect("tiled type");
    let bb = ty.block_bytes();
    let tb = bb * TILE_ROWS;
    let (m_off, mask_off, qs_off) = tile_offsets(ty);
    let sb = kinds::scale_bytes(kinds::of(ty));
    for (row, src_row) in data.chunks_exact(blocks * bb).enumerate().take(rows) {
        let (tile, r) = (row / TILE_ROWS, row % TILE_ROWS);
        for (b, src) in src_row.chunks_exact(bb).enumerate() {
            let dst = &mut out[(tile * blocks + b) * tb..][..tb];
            dst[sb * r..sb * (r + 1)].copy_from_slice(&src[0..sb]);
            if let Some(m) = p.m {
                dst[m_off + 2 * r..m_off + 2 * r + 2].copy_from_slice(&src[m..m + 2]);
            }
            let qs = &src[p.qs..p.qs + p.qs_len];
            if let Some(qh) = p.qh {
                let h = u32::from_le_bytes([src[qh], src[qh + 1], src[qh + 2], src[qh + 3]]);
                // this row's codes of vector k: bytes 4r..4r+4 of it, codes 4k..4k+4
                let code = |c: usize| {
                    let nibble = if c < 16 { qs[c] & 0xF } else { qs[c - 16] >> 4 };
                    nibble | ((((h >> c) & 1) as u8) << 4)
                };
                for k in 0..8 {
                    for j in 0..4 {
                        let c = 4 * k + j;
                        match bits {
                            HighBits::Masks | HighBits::Wide => {
                                let at = mask_off + 4 * k + r / 2;
                                dst[at] |= (((h >> c) & 1) as u8) << (4 * (r % 2) + j);
                                if k < 4 {
                                    dst[qs_off + 32 * k + 4 * r + j] = qs[c];
                                }
                            }
                            HighBits::Whole if k < 4 => {
                                dst[qs_off + 32 * k + 4 * r + j] |= code(c);
                            }
                            HighBits::Whole => {
                                let m = k - 4;
                                dst[qs_off + 32 * m + 4 * r + j] |= (code(c) & 7) << 5;
                                dst[mask_off + 4 * r + j] |= (code(c) >> 3) << (2 * m);
                            }
                        }
                    }
                }
                continue;
            }
            for g in 0..p.qs_len / 4 {
                let at = qs_off + 32 * g + 4 * r;
                dst[at..at + 4].copy_from_slice(&qs[4 * g..4 * g + 4]);
            }
        }
    }
}

/// Row `row` of a tiled matrix (high bits as `bits` says) back in the file's block layout.
pub fn untile_row(
    ty: WeightType,
    blocks: usize,
    tiled: &[u8],
    row: usize,
    bits: HighBits,
) -> Vec<u8> {
    if is_k(ty) {
        let (bb, tb) = (ty.block_bytes(), tile_block_bytes(ty));
        let (tile, r) = (row / TILE_ROWS, row % TILE_ROWS);
        let mut out = vec![0u8; blocks * bb];
        for (b, dst) in out.chunks_exact_mut(bb).enumerate() {
            untile_k_block(ty, &tiled[(tile * blocks + b) * tb..][..tb], dst, r, bits);
        }
        return out;
    }
    let p = parts(ty).expect("tiled type");
    let bb = ty.block_bytes();
    let tb = bb * TILE_ROWS;
    let (tile, r) = (row / TILE_ROWS, row % TILE_ROWS);
    let (m_off, mask_off, qs_off) = tile_offsets(ty);
    let sb = kinds::scale_bytes(kinds::of(ty));
    let mut out = vec![0u8; blocks * bb];
    for (b, dst) in out.chunks_exact_mut(bb).enumerate() {
        let src = &tiled[(tile * blocks + b) * tb..][..tb];
        dst[0..sb].copy_from_slice(&src[sb * r..sb * (r + 1)]);
        if let Some(m) = p.m {
            dst[m..m + 2].copy_from_slice(&src[m_off + 2 * r..m_off + 2 * r + 2]);
        }
        let qs = &mut dst[p.qs..p.qs + p.qs_len];
        if let Some(qh) = p.qh {
            let mut h = 0u32;
            for k in 0..8 {
                for j in 0..4 {
                    let c = 4 * k + j;
                    let code = match bits {
                        HighBits::Masks | HighBits::Wide => {
                            let nibble = src[qs_off + 32 * (k % 4) + 4 * r + j];
                            let nibble = if k < 4 { nibble & 0xF } else { nibble >> 4 };
                            let bit = src[mask_off + 4 * k + r / 2] >> (4 * (r % 2) + j);
                            nibble | ((bit & 1) << 4)
                        }
                        HighBits::Whole if k < 4 => src[qs_off + 32 * k + 4 * r + j] & 0x1F,
                        HighBits::Whole => {
                            let m = k - 4;
                            let low = src[qs_off + 32 * m + 4 * r + j] >> 5;
                            let top = (src[mask_off + 4 * r + j] >> (2 * m)) & 3;
                            low | (top << 3)
                        }
                    };
                    if c < 16 {
                        qs[c] |= code & 0xF;
                    } else {
                        qs[c - 16] |= (code & 0xF) << 4;
                    }
                    h |= u32::from(code >> 4) << c;
                }
            }
            dst[qh..qh + 4].copy_from_slice(&h.to_le_bytes());
            continue;
        }
        for g in 0..p.qs_len / 4 {
            let at = qs_off + 32 * g + 4 * r;
            qs[4 * g..4 * g + 4].copy_from_slice(&src[at..at + 4]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiled(ty: WeightType, rows: usize, blocks: usize, data: &[u8], bits: HighBits) -> Vec<u8> {
        let mut t = vec![0; tiled_len(ty, rows, blocks)];
        tile(ty, rows, blocks, data, bits, &mut t);
        t
    }

    #[test]
    fn tiling_round_trips_every_row() {
        for bits in [HighBits::Masks, HighBits::Whole, HighBits::Wide] {
            for ty in WeightType::ALL.into_iter().filter(|t| is_tiled_type(*t)) {
                let (rows, blocks) = (11, 3);
                let data: Vec<u8> = (0..rows * blocks * ty.block_bytes())
                    .map(|i| (i * 131 % 251) as u8)
                    .collect();
                let t = tiled(ty, rows, blocks, &data, bits);
                assert_eq!(t.len(), 2 * blocks * tile_block_bytes(ty));
                let rb = blocks * ty.block_bytes();
                for r in 0..rows {
                    assert_eq!(
                        untile_row(ty, blocks, &t, r, bits),
                        data[r * rb..(r + 1) * rb],
                        "{ty:?} {bits:?} row {r}"
                    );
                }
                // the padding rows stand for zeros; their bytes are zero but for Q3_K's
                // and IQ4_XS's scales, whose zero in the tile is 32 in the file
                let pad = untile_row(ty, blocks, &t, 15, bits);
                let mut values = vec![1f32; blocks * ty.block_elems()];
                super::super::reference::dequantize_row(ty, &pad, &mut values);
                assert!(values.iter().all(|&v| v == 0.0), "{ty:?} {bits:?} padding");
                if !matches!(ty, WeightType::Q3K | WeightType::Iq4Xs) {
                    assert!(pad.iter().all(|&b| b == 0), "{ty:?} {bits:?} padding bytes");
                }
            }
        }
    }

    /// The code vectors a kernel builds from one tile block, as the docs of [`HighBits`]
    /// say to build them.
    fn code_vectors(t: &[u8], bits: HighBits) -> [[u8; 32]; 8] {
        let (_, at, qs) = tile_offsets(WeightType::Q5_0);
        std::array::from_fn(|k| {
            std::array::from_fn(|i| match bits {
                HighBits::Masks | HighBits::Wide => {
                    let byte = t[qs + 32 * (k % 4) + i];
                    let nibble = if k < 4 { byte & 0xF } else { byte >> 4 };
                    let mask =
                        u32::from_le_bytes(t[at + 4 * k..at + 4 * k + 4].try_into().unwrap());
                    nibble | ((((mask >> i) & 1) as u8) << 4)
                }
                HighBits::Whole if k < 4 => t[qs + 32 * k + i] & 0x1F,
                HighBits::Whole => {
                    let m = k - 4;
                    (t[qs + 32 * m + i] >> 5) | (((t[at + i] >> (2 * m)) & 3) << 3)
                }
            })
        })
    }

    /// Both layouts give every code: byte `i` of vector `k` is code `4 k + i % 4` of row
    /// `i / 4`, its low four bits from the file's nibble and the fifth from `qh`.
    #[test]
    fn both_fifth_bit_layouts_give_the_files_codes() {
        let (rows, blocks) = (8, 1);
        let data: Vec<u8> = (0..rows * 22).map(|i| (i * 97 % 253) as u8).collect();
        for bits in [HighBits::Masks, HighBits::Whole] {
            let vectors = code_vectors(&tiled(WeightType::Q5_0, rows, blocks, &data, bits), bits);
            for (k, vector) in vectors.iter().enumerate() {
                for (i, &code) in vector.iter().enumerate() {
                    let (row, c) = (&data[22 * (i / 4)..22 * (i / 4 + 1)], 4 * k + i % 4);
                    let h = u32::from_le_bytes(row[2..6].try_into().unwrap());
                    let nibble = if c < 16 {
                        row[6 + c] & 0xF
                    } else {
                        row[6 + c - 16] >> 4
                    };
                    let want = nibble | ((((h >> c) & 1) as u8) << 4);
                    assert_eq!(code, want, "{bits:?} vector {k} byte {i}");
                }
            }
        }
    }

    /// Q2_K's code vectors as the module documents them, `w` bytes per row (4, or 8 under
    /// [`HighBits::Wide`]): bits `2 k` of byte `i` of group vector `(n, g)` (`32 w` bytes
    /// each, `32 / w` per half) are value `128 n + 32 k + w g + i % w` of row `i / w`; the
    /// scale bytes of sub-blocks `2 j`, `2 j + 1` of row `r` at `16 j + 2 r`.
    #[test]
    fn q2k_codes_and_scale_pairs_are_the_files() {
        use crate::backend::cpu::kernels::formats::k2_code;
        let data: Vec<u8> = (0..8 * 84).map(|i| (i * 89 % 251) as u8).collect();
        for (bits, w) in [
            (HighBits::Whole, 4),
            (HighBits::Masks, 4),
            (HighBits::Wide, 8),
        ] {
            let t = tiled(WeightType::Q2K, 8, 1, &data, bits);
            for (n, g, k, i) in (0..2).flat_map(|n| {
                (0..32 / w).flat_map(move |g| {
                    (0..4).flat_map(move |k| (0..8 * w).map(move |i| (n, g, k, i)))
                })
            }) {
                let at = k_offsets::QS2 + 256 * n + 8 * w * g + i;
                let code = (t[at] >> (2 * k)) & 3;
                let row = &data[84 * (i / w)..84 * (i / w + 1)];
                let want = k2_code(&row[16..80], 128 * n + 32 * k + w * g + i % w);
                assert_eq!(code, want, "{bits:?} n {n} g {g} k {k} byte {i}");
            }
            for (j, r, h) in
                (0..8).flat_map(|j| (0..8).flat_map(move |r| (0..2).map(move |h| (j, r, h))))
            {
                assert_eq!(
                    t[k_offsets::SC2 + 16 * j + 2 * r + h],
                    data[84 * r + 2 * j + h]
                );
            }
        }
    }

    /// Q3_K's whole codes as the module documents them, `w` bytes per row: code `g` of
    /// unit `u`, unpacked from its three bytes at position `i` of the unit's three group
    /// vectors ([`q3k_unpack`]), is value `8 w u + w g + i % w` of row `i / w`; its
    /// scales, signed, in pairs.
    #[test]
    fn q3k_whole_codes_and_scales_are_the_files() {
        use crate::backend::cpu::kernels::formats::{k2_code, k3_high, k3_scales};
        let data: Vec<u8> = (0..8 * 110).map(|i| (i * 97 % 253) as u8).collect();
        for (bits, w) in [
            (HighBits::Whole, 4),
            (HighBits::Masks, 4),
            (HighBits::Wide, 8),
        ] {
            let t = tiled(WeightType::Q3K, 8, 1, &data, bits);
            for (u, i) in (0..32 / w).flat_map(|u| (0..8 * w).map(move |i| (u, i))) {
                let at = k_offsets::QS3 + 24 * w * u + i;
                let codes = q3k_unpack([t[at], t[at + 8 * w], t[at + 16 * w]]);
                let row = &data[110 * (i / w)..110 * (i / w + 1)];
                for (g, &code) in codes.iter().enumerate() {
                    let v = 8 * w * u + w * g + i % w;
                    let want = k2_code(&row[32..96], v) | (k3_high(&row[..32], v) << 2);
                    assert_eq!(code, want, "{bits:?} unit {u} code {g} byte {i}");
                }
            }
            for r in 0..8 {
                let sc = k3_scales(&data[110 * r + 96..110 * r + 108]);
                for s in 0..16 {
                    let got = t[k_offsets::SC3 + 16 * (s / 2) + 2 * r + s % 2] as i8;
                    assert_eq!(got, sc[s], "row {r} scale {s}");
                }
            }
        }
    }

    /// Every code in every slot of [`q3k_pack`] comes back whole, whatever its neighbours.
    #[test]
    fn q3k_packing_round_trips() {
        for slot in 0..8 {
            for code in 0..8u8 {
                for other in 0..8u8 {
                    let mut c = [other; 8];
                    c[slot] = code;
                    assert_eq!(q3k_unpack(q3k_pack(c)), c, "slot {slot} code {code}");
                }
            }
        }
    }

    /// Q6_K's whole codes as [`HighBits::Whole`] documents them: group `(n, g)`'s vector `k`
    /// holds value `128 n + 32 k + 4 g + i % 4` of row `i / 4` in byte `i`.
    #[test]
    fn q6k_whole_codes_are_the_files_codes() {
        let (rows, blocks) = (8, 1);
        let data: Vec<u8> = (0..rows * 210).map(|i| (i * 89 % 251) as u8).collect();
        let t = tiled(WeightType::Q6K, rows, blocks, &data, HighBits::Whole);
        for (n, g, i) in
            (0..2).flat_map(|n| (0..8).flat_map(move |g| (0..32).map(move |i| (n, g, i))))
        {
            let byte = |k: usize| t[q6k_whole_at(n, g, k, 0, 0) + i];
            let codes = [
                byte(0) & 0x3F,
                byte(1) & 0x3F,
                byte(2) & 0x3F,
                ((byte(0) >> 6) << 4) | ((byte(1) >> 6) << 2) | (byte(2) >> 6),
            ];
            let row = &data[210 * (i / 4)..210 * (i / 4 + 1)];
            for (k, &code) in codes.iter().enumerate() {
                let want = q6k_code(row, 128 * n + 32 * k + 4 * g + i % 4);
                assert_eq!(code, want, "n {n} g {g} k {k} byte {i}");
            }
        }
    }
}
