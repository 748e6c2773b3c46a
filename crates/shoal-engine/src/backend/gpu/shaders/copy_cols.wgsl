// Columns of rows copied: out[(row0_out + i) * so + col_out + c] = x[(row0_in + i) * si + col_in + c]
// for i < rows, c < width (a part of each row taken out, or put into place).
struct Params {
    rows: u32, width: u32, si: u32, col_in: u32,
    so: u32, col_out: u32, row0_in: u32, row0_out: u32,
}
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn copy_cols(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let i = g.y + g.z * 32768u;
    let c = g.x * 64u + l;
    if (i >= p.rows || c >= p.width) {
        return;
    }
    out[(p.row0_out + i) * p.so + p.col_out + c] = x[(p.row0_in + i) * p.si + p.col_in + c];
}
