
// The root mean square (with eps) of the `width` values of `x` from `base`: every thread of
// the 256-thread workgroup calls it and gets it. Appended to `norm.wgsl` and
// `norm_in_place.wgsl`, which declare `p` and `x`.
var<workgroup> part: array<f32, 256>;

fn row_rms(base: u32, l: u32) -> f32 {
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
    // every thread has read the sum before any writes the row
    workgroupBarrier();
    return m;
}
