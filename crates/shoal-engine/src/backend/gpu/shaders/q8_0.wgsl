// Q8_0: 32 values in 34 bytes: f16 scale d, then 32 signed 8-bit codes; value = code * d.
const BLOCK_ELEMS: u32 = 32u;
const BLOCK_BYTES: u32 = 34u;

fn block_value(base: u32, i: u32) -> f32 {
    return f32(bitcast<i32>(byte_at(base + 2u + i) << 24u) >> 24u) * f16_at(base);
}

fn block_dot(base: u32, xo: u32) -> f32 {
    var s = 0.0;
    for (var j = 0u; j < 8u; j++) {
        let q = u32_at(base + 2u + 4u * j);
        for (var k = 0u; k < 4u; k++) {
            let c = bitcast<i32>(q << (24u - 8u * k)) >> 24u;
            s += f32(c) * x[xo + 4u * j + k];
        }
    }
    return s * f16_at(base);
}
