// Q4_0: 32 values in 18 bytes: f16 scale d, then 16 bytes of 4-bit codes (value i in the
// low nibble of byte i, value i + 16 in its high nibble); value = (code - 8) * d.
const BLOCK_ELEMS: u32 = 32u;
const BLOCK_BYTES: u32 = 18u;

fn block_value(base: u32, i: u32) -> f32 {
    let q = (byte_at(base + 2u + (i & 15u)) >> ((i >> 4u) * 4u)) & 0xfu;
    return f32(i32(q) - 8) * f16_at(base);
}

fn block_dot(base: u32, xo: u32) -> f32 {
    var s = 0.0;
    for (var j = 0u; j < 4u; j++) {
        let q = u32_at(base + 2u + 4u * j);
        for (var k = 0u; k < 4u; k++) {
            let b = q >> (8u * k);
            let i = xo + 4u * j + k;
            s += f32(i32(b & 0xfu) - 8) * x[i] + f32(i32((b >> 4u) & 0xfu) - 8) * x[i + 16u];
        }
    }
    return s * f16_at(base);
}
