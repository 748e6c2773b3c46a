// Q3_K: 256 values in 110 bytes: hmask[32] (bit v / 32 of byte v % 32: the third bit of
// value v), 64 bytes of low 2-bit codes (byte 32 n + l holds value 128 n + 32 k + l in bits
// 2 k, 2 k + 1), 12 bytes of sixteen packed 6-bit scales stored plus 32 (scale j: low four
// bits in the low (j < 8) or high nibble of byte j % 8, top two in bits 2 (j / 4) of byte
// 8 + j % 4), then f16 d; value = d * scale * (code - 4).
const BLOCK_ELEMS: u32 = 256u;
const BLOCK_BYTES: u32 = 110u;

// scale j (0..16) of the block at base, -32..=31
fn q3k_scale(base: u32, j: u32) -> f32 {
    let s = base + 96u;
    let low = (byte_at(s + (j & 7u)) >> (4u * (j >> 3u))) & 0xfu;
    let high = (byte_at(s + 8u + (j & 3u)) >> (2u * (j >> 2u))) & 3u;
    return f32(i32(low | (high << 4u)) - 32);
}

fn block_value(base: u32, v: u32) -> f32 {
    let lo = (byte_at(base + 32u + 32u * (v >> 7u) + (v & 31u)) >> (2u * ((v >> 5u) & 3u))) & 3u;
    let hi = (byte_at(base + (v & 31u)) >> (v >> 5u)) & 1u;
    return f16_at(base + 108u) * q3k_scale(base, v >> 4u) * f32(i32(lo | (hi << 2u)) - 4);
}

fn block_dot(base: u32, xo: u32) -> f32 {
    let d = f16_at(base + 108u);
    var acc = 0.0;
    // group g: values 16 g .. 16 g + 16 = 128 n + 32 k + l0 + (0 .. 16)
    for (var g = 0u; g < 16u; g++) {
        let n = g >> 3u;
        let k = (g >> 1u) & 3u;
        let l0 = 16u * (g & 1u);
        var s = 0.0;
        for (var j = 0u; j < 4u; j++) {
            let q = u32_at(base + 32u + 32u * n + l0 + 4u * j) >> (2u * k);
            let h = u32_at(base + l0 + 4u * j) >> (4u * n + k);
            for (var i = 0u; i < 4u; i++) {
                let c = ((q >> (8u * i)) & 3u) | (((h >> (8u * i)) & 1u) << 2u);
                s += f32(i32(c) - 4) * x[xo + 16u * g + 4u * j + i];
            }
        }
        acc += d * q3k_scale(base, g) * s;
    }
    return acc;
}
