// MXFP4: 32 values in 17 bytes: an E8M0 scale byte e, then 16 bytes of 4-bit E2M1 codes
// (value i in the low nibble of byte i, value i + 16 in its high nibble); value =
// fp4(code) * 2^(e - 127). The codes are taken doubled, as integers (0, 1, 2, 3, 4, 6, 8, 12
// and their negatives), and the scale halved: 2^(e - 128), built from its bits.
const BLOCK_ELEMS: u32 = 32u;
const BLOCK_BYTES: u32 = 17u;

// twice the E2M1 value of code c: sign bit 3, a two-bit exponent (bits 1-2, bias 1) and
// one mantissa bit
fn fp4_twice(c: u32) -> f32 {
    let e = (c >> 1u) & 3u;
    let m = c & 1u;
    var t = m;
    if (e > 0u) {
        t = (2u + m) << (e - 1u);
    }
    return select(f32(t), -f32(t), (c & 8u) != 0u);
}

// 2^(e - 128) for the block's scale byte (the two smallest bytes are subnormal)
fn half_scale(base: u32) -> f32 {
    let e = byte_at(base);
    if (e < 2u) {
        return bitcast<f32>(0x00200000u << e);
    }
    return bitcast<f32>((e - 1u) << 23u);
}

fn block_value(base: u32, i: u32) -> f32 {
    let q = (byte_at(base + 1u + (i & 15u)) >> ((i >> 4u) * 4u)) & 0xfu;
    return fp4_twice(q) * half_scale(base);
}

fn block_dot(base: u32, xo: u32) -> f32 {
    var s = 0.0;
    for (var j = 0u; j < 4u; j++) {
        let q = u32_at(base + 1u + 4u * j);
        for (var k = 0u; k < 4u; k++) {
            let b = q >> (8u * k);
            let i = xo + 4u * j + k;
            s += fp4_twice(b & 0xfu) * x[i] + fp4_twice((b >> 4u) & 0xfu) * x[i + 16u];
        }
    }
    return s * half_scale(base);
}
