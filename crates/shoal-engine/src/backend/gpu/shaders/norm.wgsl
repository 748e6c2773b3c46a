// RMSNorm of every row of `width` values: out = x / sqrt(mean(x^2) + eps) * w. One
// workgroup per row (`row_rms` from norm_rms.wgsl).
struct Params { width: u32, eps: f32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(256)
fn rms_norm(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let base = (g.x + g.y * 65535u) * p.width;
    let m = row_rms(base, l);
    for (var i = l; i < p.width; i += 256u) {
        out[base + i] = x[base + i] / m * w[i];
    }
}
