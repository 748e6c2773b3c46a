// Q4_1: 32 values in 20 bytes: f16 scale d, f16 minimum m, then 16 bytes of 4-bit codes
// (value i in the low nibble of byte i, value i + 16 in its high nibble);
// value = code * d + m.
const BLOCK_ELEMS: u32 = 32u;
const BLOCK_BYTES: u32 = 20u;

fn block_value(base: u32, i: u32) -> f32 {
    let q = (byte_at(base + 4u + (i & 15u)) >> ((i >> 4u) * 4u)) & 0xfu;
    return f32(q) * f16_at(base) + f16_at(base + 2u);
}

fn block_dot(base: u32, xo: u32) -> f32 {
    var s = 0.0;
    var sx = 0.0;
    for (var j = 0u; j < 4u; j++) {
        let q = u32_at(base + 4u + 4u * j);
        for (var k = 0u; k < 4u; k++) {
            let b = q >> (8u * k);
            let i = xo + 4u * j + k;
            let a = x[i];
            let c = x[i + 16u];
            s += f32(b & 0xfu) * a + f32((b >> 4u) & 0xfu) * c;
            sx += a + c;
        }
    }
    return s * f16_at(base) + sx * f16_at(base + 2u);
}
