// F16: one value per block.
const BLOCK_ELEMS: u32 = 1u;
const BLOCK_BYTES: u32 = 2u;

fn block_value(base: u32, i: u32) -> f32 {
    return f16_at(base);
}

fn block_dot(base: u32, xo: u32) -> f32 {
    return f16_at(base) * x[xo];
}
