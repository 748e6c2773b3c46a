// Q4_K: 256 values in 144 bytes: f16 d, f16 dmin, 12 bytes of eight packed 6-bit
// (scale, minimum) pairs, then 128 bytes of 4-bit codes: byte 32 c + l holds value
// 64 c + l (low nibble, sub-block 2 c) and 64 c + 32 + l (high nibble, sub-block 2 c + 1);
// value = d * scale * code - dmin * minimum.
const BLOCK_ELEMS: u32 = 256u;
const BLOCK_BYTES: u32 = 144u;

fn block_value(base: u32, i: u32) -> f32 {
    let c = i >> 6u;
    let hi = (i >> 5u) & 1u;
    let sm = k_scale_min(base + 4u, 2u * c + hi);
    let q = (byte_at(base + 16u + 32u * c + (i & 31u)) >> (4u * hi)) & 0xfu;
    return f16_at(base) * sm.x * f32(q) - f16_at(base + 2u) * sm.y;
}

fn block_dot(base: u32, xo: u32) -> f32 {
    let d = f16_at(base);
    let dmin = f16_at(base + 2u);
    var acc = 0.0;
    for (var c = 0u; c < 4u; c++) {
        let sm0 = k_scale_min(base + 4u, 2u * c);
        let sm1 = k_scale_min(base + 4u, 2u * c + 1u);
        var s0 = 0.0;
        var s1 = 0.0;
        var x0 = 0.0;
        var x1 = 0.0;
        for (var j = 0u; j < 8u; j++) {
            let q = u32_at(base + 16u + 32u * c + 4u * j);
            for (var k = 0u; k < 4u; k++) {
                let b = q >> (8u * k);
                let xi = xo + 64u * c + 4u * j + k;
                let a = x[xi];
                let e = x[xi + 32u];
                s0 += f32(b & 0xfu) * a;
                s1 += f32((b >> 4u) & 0xfu) * e;
                x0 += a;
                x1 += e;
            }
        }
        acc += d * sm0.x * s0 - dmin * sm0.y * x0 + d * sm1.x * s1 - dmin * sm1.y * x1;
    }
    return acc;
}
