// RoPE: the first `dims` values of every head of `head_dim` values of every row rotated by
// its row's table (`dims / 2` cosines, then as many sines per row); the rest of each head is
// left as it is. style 0 pairs adjacent values, 1 the two halves of the rotated part.
struct Params { per_row: u32, head_dim: u32, style: u32, rows: u32, dims: u32, pad0: u32, pad1: u32, pad2: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> table: array<f32>;

@compute @workgroup_size(64)
fn rope(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let half = p.dims / 2u;
    let pairs = p.per_row / p.head_dim * half;
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
