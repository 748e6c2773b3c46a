// Rows of `width` values: out[i] = x[which[i]] (`select_rows`).
struct Params { width: u32, n: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> which: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn select_rows(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let i = g.y;
    let c = g.x * 64u + l;
    if (i >= p.n || c >= p.width) {
        return;
    }
    out[i * p.width + c] = x[which[i] * p.width + c];
}
