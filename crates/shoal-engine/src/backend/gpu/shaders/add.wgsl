// x += a over n values (`add`), or x[r, i] += a[i] for rows of `width` values (`add_bias`).
struct Params { n: u32, width: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> a: array<f32>;

fn index(g: vec3<u32>, l: u32) -> u32 {
    return (g.x + g.y * 65535u) * 256u + l;
}

@compute @workgroup_size(256)
fn add(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let i = index(g, l);
    if (i < p.n) {
        x[i] += a[i];
    }
}

@compute @workgroup_size(256)
fn add_bias(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let i = index(g, l);
    if (i < p.n) {
        x[i] += a[i % p.width];
    }
}
