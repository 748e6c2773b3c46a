// F32: one value per block.
const BLOCK_ELEMS: u32 = 1u;
const BLOCK_BYTES: u32 = 4u;

fn block_value(base: u32, i: u32) -> f32 {
    return bitcast<f32>(w[base >> 2u]);
}

fn block_dot(base: u32, xo: u32) -> f32 {
    return bitcast<f32>(w[base >> 2u]) * x[xo];
}
