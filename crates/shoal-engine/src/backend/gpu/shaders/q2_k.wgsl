// Q2_K: 256 values in 84 bytes: 16 bytes of per-16-value (scale | minimum << 4), 64 bytes
// of 2-bit codes (byte 32 n + l holds value 128 n + 32 k + l in bits 2 k, 2 k + 1), then
// f16 d and f16 dmin; value = d * scale * code - dmin * minimum.
const BLOCK_ELEMS: u32 = 256u;
const BLOCK_BYTES: u32 = 84u;

fn block_value(base: u32, v: u32) -> f32 {
    let sc = byte_at(base + (v >> 4u));
    let dl = f16_at(base + 80u) * f32(sc & 0xfu);
    let ml = f16_at(base + 82u) * f32(sc >> 4u);
    let q = (byte_at(base + 16u + 32u * (v >> 7u) + (v & 31u)) >> (2u * ((v >> 5u) & 3u))) & 3u;
    return dl * f32(q) - ml;
}

fn block_dot(base: u32, xo: u32) -> f32 {
    let d = f16_at(base + 80u);
    let dmin = f16_at(base + 82u);
    var acc = 0.0;
    // group g: values 16 g .. 16 g + 16, codes in bits 2 k of bytes 32 n + l0 ..
    for (var g = 0u; g < 16u; g++) {
        let sc = byte_at(base + g);
        let off = base + 16u + 32u * (g >> 3u) + 16u * (g & 1u);
        let sh = 2u * ((g >> 1u) & 3u);
        var sq = 0.0;
        var sx = 0.0;
        for (var j = 0u; j < 4u; j++) {
            let q = u32_at(off + 4u * j) >> sh;
            for (var k = 0u; k < 4u; k++) {
                let a = x[xo + 16u * g + 4u * j + k];
                sq += f32((q >> (8u * k)) & 3u) * a;
                sx += a;
            }
        }
        acc += d * f32(sc & 0xfu) * sq - dmin * f32(sc >> 4u) * sx;
    }
    return acc;
}
