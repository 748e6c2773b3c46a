//! The interleaved layout the SIMD kernels read the 32-value block types in. Eight rows form
//! a tile; for each block column a tile stores the eight f16 scales together (then the eight
//! minimums, for Q4_1 and Q5_1), 32 more bytes for Q5_0 and Q5_1 (their codes' top bits, as
//! [`HighBits`] says), and the quant bytes interleaved four at a time: byte `4 r + j` of
//! group vector `g` is byte `4 g + j` of row `r` (of its codes, for Q5 in
//! [`HighBits::Whole`]). One 32-byte load then holds four codes of each of
//! eight rows, so a single 8-bit dot-product instruction against four broadcast activations
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
        _ => return None,
    };
    Some(Parts { m, qh, qs, qs_len })
}

/// Whether `ty` has a tiled layout.
pub fn is_tiled_type(ty: WeightType) -> bool {
    parts(ty).is_some() || is_k(ty)
}

fn is_k(ty: WeightType) -> bool {
    matches!(ty, WeightType::Q4K | WeightType::Q5K | WeightType::Q6K)
}

/// Bytes of one tile block (eight rows, one block column).
pub fn tile_block_bytes(ty: WeightType) -> usize {
    match ty {
        WeightType::Q4K => 32 + 128 + 1024,
        WeightType::Q5K => 32 + 128 + 256 + 1024,
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

    /// The weight type of code `kind`.
    pub const fn weight_type(kind: u8) -> WeightType {
        match kind {
            Q4_0 => WeightType::Q4_0,
            Q4_1 => WeightType::Q4_1,
            Q5_0 => WeightType::Q5_0,
            Q5_1 => WeightType::Q5_1,
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

    /// `(minimums, masks, quants)` offsets in a tile block (as [`super::tile_offsets`]).
    pub const fn offsets(kind: u8) -> (usize, usize, usize) {
        let m = 2 * TILE_ROWS;
        let masks = m + if has_min(kind) { 2 * TILE_ROWS } else { 0 };
        let qs = masks + if has_high_bit(kind) { 32 } else { 0 };
        (m, masks, qs)
    }
}

/// Interleaves `n` bytes of `src` (one row's array) into `dst` (the tile's array) as row `r`:
/// byte `j` of row group `g` goes to `32 g + 4 r + j`.
fn interleave(dst: &mut [u8], src: &[u8], r: usize) {
    for (g, four) in src.chunks_exact(4).enumerate() {
        dst[32 * g + 4 * r..32 * g + 4 * r + 4].copy_from_slice(four);
    }
}

/// The inverse of [`interleave`].
fn deinterleave(src: &[u8], dst: &mut [u8], r: usize) {
    for (g, four) in dst.chunks_exact_mut(4).enumerate() {
        four.copy_from_slice(&src[32 * g + 4 * r..32 * g + 4 * r + 4]);
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

fn tile_k_block(ty: WeightType, src: &[u8], dst: &mut [u8], r: usize, bits: HighBits) {
    use k_offsets::*;
    match ty {
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
    for (row, src_row) in data.chunks_exact(blocks * bb).enumerate().take(rows) {
        let (tile, r) = (row / TILE_ROWS, row % TILE_ROWS);
        for (b, src) in src_row.chunks_exact(bb).enumerate() {
            let dst = &mut out[(tile * blocks + b) * tb..][..tb];
            dst[2 * r..2 * r + 2].copy_from_slice(&src[0..2]);
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
                            HighBits::Masks => {
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
    let mut out = vec![0u8; blocks * bb];
    for (b, dst) in out.chunks_exact_mut(bb).enumerate() {
        let src = &tiled[(tile * blocks + b) * tb..][..tb];
        dst[0..2].copy_from_slice(&src[2 * r..2 * r + 2]);
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
                        HighBits::Masks => {
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
        for bits in [HighBits::Masks, HighBits::Whole] {
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
                // the padding rows are zero
                assert!(untile_row(ty, blocks, &t, 15, bits).iter().all(|&b| b == 0));
            }
        }
    }

    /// The code vectors a kernel builds from one tile block, as the docs of [`HighBits`]
    /// say to build them.
    fn code_vectors(t: &[u8], bits: HighBits) -> [[u8; 32]; 8] {
        let (_, at, qs) = tile_offsets(WeightType::Q5_0);
        std::array::from_fn(|k| {
            std::array::from_fn(|i| match bits {
                HighBits::Masks => {
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
