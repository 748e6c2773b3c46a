// RMSNorm of every row of `width` values in place. One workgroup per row.
struct Params { width: u32, eps: f32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;

var<workgroup> part: array<f32, 256>;

@compute @workgroup_size(256)
fn rms_norm_in_place(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let base = (g.x + g.y * 65535u) * p.width;
    var s = 0.0;
    for (var i = l; i < p.width; i += 256u) {
        let v = x[base + i];
        s += v * v;
    }
    part[l] = s;
    workgroupBarrier();
    for (var k = 128u; k > 0u; k >>= 1u) {
        if (l < k) {
            part[l] += part[l + k];
        }
        workgroupBarrier();
    }
    let m = sqrt(part[0] / f32(p.width) + p.eps);
    workgroupBarrier();
    for (var i = l; i < p.width; i += 256u) {
        x[base + i] = x[base + i] / m * w[i];
    }
}
