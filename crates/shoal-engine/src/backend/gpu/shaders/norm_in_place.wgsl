// RMSNorm of every row of `width` values in place. One workgroup per row (`row_rms` from
// norm_rms.wgsl).
struct Params { width: u32, eps: f32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;

@compute @workgroup_size(256)
fn rms_norm_in_place(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let base = (g.x + g.y * 65535u) * p.width;
    let m = row_rms(base, l);
    for (var i = l; i < p.width; i += 256u) {
        x[base + i] = x[base + i] / m * w[i];
    }
}
