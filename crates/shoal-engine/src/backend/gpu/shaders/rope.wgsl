// RoPE: every head of `head_dim` values of every row rotated by its row's table (`half`
// cosines, then `half` sines per row). style 0 pairs adjacent values, 1 the two halves.
struct Params { per_row: u32, head_dim: u32, style: u32, rows: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> table: array<f32>;

@compute @workgroup_size(64)
fn rope(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let half = p.head_dim / 2u;
    let pairs = p.per_row / 2u;
    let j = g.x * 64u + l;
    let r = g.y;
    if (j >= pairs || r >= p.rows) {
        return;
    }
    let head = j / half;
    let i = j % half;
    let c = table[r * 2u * half + i];
    let s = table[r * 2u * half + half + i];
    let base = r * p.per_row + head * p.head_dim;
    var ia: u32;
    var ib: u32;
    if (p.style == 0u) {
        ia = base + 2u * i;
        ib = ia + 1u;
    } else {
        ia = base + i;
        ib = ia + half;
    }
    let a = x[ia];
    let b = x[ib];
    x[ia] = a * c - b * s;
    x[ib] = a * s + b * c;
}
