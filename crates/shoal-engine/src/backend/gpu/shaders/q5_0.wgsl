// Q5_0: 32 values in 22 bytes: f16 scale d, 4 bytes qh (bit i: the fifth bit of value i),
// then 16 bytes of low 4-bit codes (value i in the low nibble of byte i, value i + 16 in
// its high nibble); value = (code - 16) * d.
const BLOCK_ELEMS: u32 = 32u;
const BLOCK_BYTES: u32 = 22u;

fn block_value(base: u32, i: u32) -> f32 {
    let lo = (byte_at(base + 6u + (i & 15u)) >> ((i >> 4u) * 4u)) & 0xfu;
    let hi = ((u32_at(base + 2u) >> i) & 1u) << 4u;
    return f32(i32(lo | hi) - 16) * f16_at(base);
}

fn block_dot(base: u32, xo: u32) -> f32 {
    let qh = u32_at(base + 2u);
    var s = 0.0;
    for (var j = 0u; j < 4u; j++) {
        let q = u32_at(base + 6u + 4u * j);
        for (var k = 0u; k < 4u; k++) {
            let b = q >> (8u * k);
            let l = 4u * j + k;
            let h0 = ((qh >> l) & 1u) << 4u;
            let h1 = ((qh >> (l + 16u)) & 1u) << 4u;
            s += f32(i32((b & 0xfu) | h0) - 16) * x[xo + l]
                + f32(i32(((b >> 4u) & 0xfu) | h1) - 16) * x[xo + l + 16u];
        }
    }
    return s * f16_at(base);
}
