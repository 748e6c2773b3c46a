// Weighted rows added into place: out[rows[i]] += weights[i] * y[i] for rows of `width`
// values (an expert's outputs into the step's rows). The rows are distinct.
struct Params { width: u32, n: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> y: array<f32>;
@group(0) @binding(2) var<storage, read> rows: array<u32>;
@group(0) @binding(3) var<storage, read> weights: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn scatter_add(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let i = g.y;
    let c = g.x * 64u + l;
    if (i >= p.n || c >= p.width) {
        return;
    }
    out[rows[i] * p.width + c] += weights[i] * y[i * p.width + c];
}
