// Matrix products straight from a weight type's stored blocks: y[t, first_row + r] =
// sum_c W[r, c] x[t, c] for rows r of one chunk of the matrix. The weight type's file
// (prepended to this one) defines BLOCK_ELEMS, BLOCK_BYTES, `block_dot(base, xo)` (the dot
// of the block at byte `base` with x[xo ..]) and `block_value(base, i)` (element i of the
// block at byte `base`); `byte_at`, `u16_at` and `f16_at` read the packed bytes.

struct Params {
    rows: u32,        // rows of this chunk
    cols: u32,        // columns (values per row)
    t: u32,           // activation rows
    row_bytes: u32,   // bytes of one stored row
    blocks: u32,      // blocks per row
    first_row: u32,   // the chunk's first row in the output
    out_stride: u32,  // values per output row (rows of the whole matrix)
    scale: f32,       // gather: the factor values are multiplied by
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

fn byte_at(off: u32) -> u32 {
    return (w[off >> 2u] >> ((off & 3u) * 8u)) & 0xffu;
}

// the 16 bits at `off` (an even byte offset)
fn u16_at(off: u32) -> u32 {
    let word = w[off >> 2u];
    return select(word & 0xffffu, word >> 16u, (off & 2u) != 0u);
}

fn f16_at(off: u32) -> f32 {
    return unpack2x16float(u16_at(off)).x;
}

// the 32 bits at `off` (a byte offset that need not be aligned)
fn u32_at(off: u32) -> u32 {
    let sh = (off & 3u) * 8u;
    let lo = w[off >> 2u];
    if (sh == 0u) {
        return lo;
    }
    let hi = w[(off >> 2u) + 1u];
    return (lo >> sh) | (hi << (32u - sh));
}

// (scale, minimum) of sub-block j (0..8) of a Q4_K or Q5_K block, from the 12 bytes of
// packed 6-bit pairs at s
fn k_scale_min(s: u32, j: u32) -> vec2<f32> {
    if (j < 4u) {
        return vec2<f32>(f32(byte_at(s + j) & 63u), f32(byte_at(s + j + 4u) & 63u));
    }
    let a = byte_at(s + j + 4u);
    return vec2<f32>(
        f32((a & 0xfu) | ((byte_at(s + j - 4u) >> 6u) << 4u)),
        f32((a >> 4u) | ((byte_at(s + j) >> 6u) << 4u)),
    );
}

const WG: u32 = 64u;
// activation rows per workgroup (the backend builds a second pipeline with more, for
// products over many rows: each weight row is then read fewer times)
const TB: u32 = 4u;
var<workgroup> part: array<f32, TB * WG>;

// one workgroup per (matrix row, group of TB activation rows)
@compute @workgroup_size(64)
fn matmul(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_id) l: vec3<u32>) {
    let r = g.x + g.y * 65535u;
    let t0 = g.z * TB;
    var acc: array<f32, TB>;
    if (r < p.rows) {
        for (var b = l.x; b < p.blocks; b += WG) {
            let base = r * p.row_bytes + b * BLOCK_BYTES;
            for (var k = 0u; k < TB; k++) {
                if (t0 + k < p.t) {
                    acc[k] += block_dot(base, (t0 + k) * p.cols + b * BLOCK_ELEMS);
                }
            }
        }
    }
    for (var k = 0u; k < TB; k++) {
        part[k * WG + l.x] = acc[k];
    }
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (l.x < s) {
            for (var k = 0u; k < TB; k++) {
                part[k * WG + l.x] += part[k * WG + l.x + s];
            }
        }
        workgroupBarrier();
    }
    if (l.x == 0u && r < p.rows) {
        for (var k = 0u; k < TB; k++) {
            if (t0 + k < p.t) {
                y[(t0 + k) * p.out_stride + p.first_row + r] = part[k * WG];
            }
        }
    }
}

// Rows of the matrix as values: for each i < t, output row i is stored row ids[i] (as u32
// bits in x) minus first_row, times `scale`, where that row is in this chunk. One
// workgroup per (output row, 64 values).
@compute @workgroup_size(64)
fn gather(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_id) l: vec3<u32>) {
    let i = g.y;
    let c = g.x * WG + l.x;
    if (i >= p.t || c >= p.cols) {
        return;
    }
    let id = bitcast<u32>(x[i]);
    if (id < p.first_row || id - p.first_row >= p.rows) {
        return;
    }
    let r = id - p.first_row;
    let b = c / BLOCK_ELEMS;
    y[i * p.cols + c] = p.scale * block_value(r * p.row_bytes + b * BLOCK_BYTES, c % BLOCK_ELEMS);
}
