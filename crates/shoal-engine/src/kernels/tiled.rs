//! The interleaved layout the SIMD kernels read the 32-value block types in. Eight rows form
//! a tile; for each block column a tile stores the eight f16 scales together (then the eight
//! minimums, for Q4_1 and Q5_1), the 5th bits regrouped as one 32-bit mask per four values
//! (Q5_0, Q5_1), and the quant bytes interleaved four at a time: byte `4 r + j` of group
//! vector `g` is byte `4 g + j` of row `r`. One 32-byte load then holds four codes of each of
//! eight rows, so a single 8-bit dot-product instruction against four broadcast activations
//! yields eight row sums at once: no horizontal reductions, one scale conversion per eight
//! rows. A tile is exactly eight blocks' bytes, so repacking costs no memory; the last tile
//! of a ragged matrix is padded with zero rows.

use super::formats::WeightType;

/// Rows per tile.
pub const TILE_ROWS: usize = 8;

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
    parts(ty).is_some()
}

/// Offsets inside one tile block: `(minimums, masks, quants)`.
pub fn tile_offsets(ty: WeightType) -> (usize, usize, usize) {
    let p = parts(ty).expect("tiled type");
    let m = 2 * TILE_ROWS;
    let masks = m + if p.m.is_some() { 2 * TILE_ROWS } else { 0 };
    let qs = masks + if p.qh.is_some() { 32 } else { 0 };
    (m, masks, qs)
}

/// Repacks `rows` rows of `blocks` blocks (`data`, row-major file layout) into tiles.
pub fn tile(ty: WeightType, rows: usize, blocks: usize, data: &[u8]) -> Vec<u8> {
    let p = parts(ty).expect("tiled type");
    let bb = ty.block_bytes();
    let tb = bb * TILE_ROWS;
    let tiles = rows.div_ceil(TILE_ROWS);
    let (m_off, mask_off, qs_off) = tile_offsets(ty);
    let mut out = vec![0u8; tiles * blocks * tb];
    for (row, src_row) in data.chunks_exact(blocks * bb).enumerate().take(rows) {
        let (tile, r) = (row / TILE_ROWS, row % TILE_ROWS);
        for (b, src) in src_row.chunks_exact(bb).enumerate() {
            let dst = &mut out[(tile * blocks + b) * tb..][..tb];
            dst[2 * r..2 * r + 2].copy_from_slice(&src[0..2]);
            if let Some(m) = p.m {
                dst[m_off + 2 * r..m_off + 2 * r + 2].copy_from_slice(&src[m..m + 2]);
            }
            if let Some(qh) = p.qh {
                let h = u32::from_le_bytes([src[qh], src[qh + 1], src[qh + 2], src[qh + 3]]);
                for k in 0..8 {
                    let at = mask_off + 4 * k;
                    let mut mask =
                        u32::from_le_bytes([dst[at], dst[at + 1], dst[at + 2], dst[at + 3]]);
                    mask |= ((h >> (4 * k)) & 0xF) << (4 * r);
                    dst[at..at + 4].copy_from_slice(&mask.to_le_bytes());
                }
            }
            for g in 0..p.qs_len / 4 {
                let at = qs_off + 32 * g + 4 * r;
                dst[at..at + 4].copy_from_slice(&src[p.qs + 4 * g..p.qs + 4 * g + 4]);
            }
        }
    }
    out
}

/// Row `row` of a tiled matrix back in the file's block layout.
pub fn untile_row(ty: WeightType, blocks: usize, tiled: &[u8], row: usize) -> Vec<u8> {
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
        if let Some(qh) = p.qh {
            let mut h = 0u32;
            for k in 0..8 {
                let at = mask_off + 4 * k;
                let mask = u32::from_le_bytes([src[at], src[at + 1], src[at + 2], src[at + 3]]);
                h |= ((mask >> (4 * r)) & 0xF) << (4 * k);
            }
            dst[qh..qh + 4].copy_from_slice(&h.to_le_bytes());
        }
        for g in 0..p.qs_len / 4 {
            let at = qs_off + 32 * g + 4 * r;
            dst[p.qs + 4 * g..p.qs + 4 * g + 4].copy_from_slice(&src[at..at + 4]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiling_round_trips_every_row() {
        for ty in WeightType::ALL.into_iter().filter(|t| is_tiled_type(*t)) {
            let (rows, blocks) = (11, 3);
            let data: Vec<u8> = (0..rows * blocks * ty.block_bytes())
                .map(|i| (i * 131 % 251) as u8)
                .collect();
            let t = tile(ty, rows, blocks, &data);
            assert_eq!(t.len(), 2 * TILE_ROWS * blocks * ty.block_bytes());
            let rb = blocks * ty.block_bytes();
            for r in 0..rows {
                assert_eq!(
                    untile_row(ty, blocks, &t, r),
                    data[r * rb..(r + 1) * rb],
                    "{ty:?} row {r}"
                );
            }
            // the padding rows are zero
            assert!(untile_row(ty, blocks, &t, 15).iter().all(|&b| b == 0));
        }
    }
}
