// BF16: one value per block, 2 bytes: the top 16 bits of an f32.
const BLOCK_ELEMS: u32 = 1u;
const BLOCK_BYTES: u32 = 2u;

fn block_value(base: u32, i: u32) -> f32 {
    return bitcast<f32>(u16_at(base) << 16u);
}

fn block_dot(base: u32, xo: u32) -> f32 {
    return bitcast<f32>(u16_at(base) << 16u) * x[xo];
}
