// Q6_K: 256 values in 210 bytes, two halves n of 128 values: ql[128] (low 4 bits: byte
// 64 n + l holds values 128 n + l (low nibble) and 128 n + 64 + l (high nibble), byte
// 64 n + 32 + l values 128 n + 32 + l and 128 n + 96 + l), qh[64] (top 2 bits: byte
// 32 n + l holds those four values' in bits 0-1, 2-3, 4-5, 6-7), sixteen signed 8-bit
// scales (one per 16 values), then f16 d; value = d * scale * (code - 32).
const BLOCK_ELEMS: u32 = 256u;
const BLOCK_BYTES: u32 = 210u;

fn q6k_scale(off: u32) -> f32 {
    return f32(bitcast<i32>(byte_at(off) << 24u) >> 24u);
}

fn block_value(base: u32, i: u32) -> f32 {
    let n = i >> 7u;
    let g = (i >> 5u) & 3u;
    let l = i & 31u;
    let lo = (byte_at(base + 64u * n + 32u * (g & 1u) + l) >> (4u * (g >> 1u))) & 0xfu;
    let hi = (byte_at(base + 128u + 32u * n + l) >> (2u * g)) & 3u;
    let sc = q6k_scale(base + 192u + 8u * n + (l >> 4u) + 2u * g);
    return f16_at(base + 208u) * sc * f32(i32(lo | (hi << 4u)) - 32);
}

fn block_dot(base: u32, xo: u32) -> f32 {
    let d = f16_at(base + 208u);
    var acc = 0.0;
    for (var n = 0u; n < 2u; n++) {
        for (var h = 0u; h < 2u; h++) {
            let sc = base + 192u + 8u * n + h;
            var s0 = 0.0;
            var s1 = 0.0;
            var s2 = 0.0;
            var s3 = 0.0;
            for (var j = 0u; j < 4u; j++) {
                let l = 16u * h + 4u * j;
                let qa = u32_at(base + 64u * n + l);
                let qb = u32_at(base + 64u * n + 32u + l);
                let qh = u32_at(base + 128u + 32u * n + l);
                for (var k = 0u; k < 4u; k++) {
                    let a = qa >> (8u * k);
                    let b = qb >> (8u * k);
                    let c = qh >> (8u * k);
                    let xi = xo + 128u * n + l + k;
                    s0 += f32(i32((a & 0xfu) | ((c & 3u) << 4u)) - 32) * x[xi];
                    s1 += f32(i32((b & 0xfu) | ((c & 0xcu) << 2u)) - 32) * x[xi + 32u];
                    s2 += f32(i32(((a >> 4u) & 0xfu) | (c & 0x30u)) - 32) * x[xi + 64u];
                    s3 += f32(i32(((b >> 4u) & 0xfu) | ((c & 0xc0u) >> 2u)) - 32) * x[xi + 96u];
                }
            }
            acc += d * q6k_scale(sc) * s0 + d * q6k_scale(sc + 2u) * s1
                + d * q6k_scale(sc + 4u) * s2 + d * q6k_scale(sc + 6u) * s3;
        }
    }
    return acc;
}
