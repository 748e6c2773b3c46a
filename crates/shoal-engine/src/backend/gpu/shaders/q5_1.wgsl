// Q5_1: 32 values in 24 bytes: f16 scale d, f16 minimum m, 4 bytes qh (bit i: the fifth
// bit of value i), then 16 bytes of low 4-bit codes (value i in the low nibble of byte i,
// value i + 16 in its high nibble); value = code * d + m.
const BLOCK_ELEMS: u32 = 32u;
const BLOCK_BYTES: u32 = 24u;

fn block_value(base: u32, i: u32) -> f32 {
    let lo = (byte_at(base + 8u + (i & 15u)) >> ((i >> 4u) * 4u)) & 0xfu;
    let hi = ((u32_at(base + 4u) >> i) & 1u) << 4u;
    return f32(lo | hi) * f16_at(base) + f16_at(base + 2u);
}

fn block_dot(base: u32, xo: u32) -> f32 {
    let qh = u32_at(base + 4u);
    var s = 0.0;
    var sx = 0.0;
    for (var j = 0u; j < 4u; j++) {
        let q = u32_at(base + 8u + 4u * j);
        for (var k = 0u; k < 4u; k++) {
            let b = q >> (8u * k);
            let l = 4u * j + k;
            let h0 = ((qh >> l) & 1u) << 4u;
            let h1 = ((qh >> (l + 16u)) & 1u) << 4u;
            let a = x[xo + l];
            let c = x[xo + l + 16u];
            s += f32((b & 0xfu) | h0) * a + f32(((b >> 4u) & 0xfu) | h1) * c;
            sx += a + c;
        }
    }
    return s * f16_at(base) + sx * f16_at(base + 2u);
}
