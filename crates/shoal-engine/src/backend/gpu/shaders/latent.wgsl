// Multi-head latent attention over one sequence's cache of latents (f16 pairs per word,
// [position][dims / 2]): one workgroup per (row of the sequence, head). Query row
// h * n + row0 + i of `q` (rows of `dims`) attends over the latents of positions 0 ..= pos
// as keys and as values, into the same row of `out`. Keys in tiles of 64, an online
// softmax, each thread accumulating up to 16 of the dimensions.
struct Params { dims: u32, n: u32, row0: u32, start: u32, scale: f32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> cache: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

const NEG: f32 = -3.0e38;
var<workgroup> qs: array<f32, 1024>;
var<workgroup> sc: array<f32, 64>;

@compute @workgroup_size(64)
fn latent_attend(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let i = g.x;
    let h = g.y;
    let half = p.dims / 2u;
    let pos = p.start + i;
    let qo = (h * p.n + p.row0 + i) * p.dims;
    for (var d = l; d < p.dims; d += 64u) {
        qs[d] = q[qo + d];
    }
    workgroupBarrier();
    var m = NEG;
    var total = 0.0;
    var acc: array<f32, 16>;
    for (var c = 0u; c < 16u; c++) {
        acc[c] = 0.0;
    }
    for (var t0 = 0u; t0 <= pos; t0 += 64u) {
        let j = t0 + l;
        var s = NEG;
        if (j <= pos) {
            let ko = j * half;
            var dot = 0.0;
            for (var w = 0u; w < half; w++) {
                let kv2 = unpack2x16float(cache[ko + w]);
                dot += qs[2u * w] * kv2.x + qs[2u * w + 1u] * kv2.y;
            }
            s = dot * p.scale;
        }
        sc[l] = s;
        workgroupBarrier();
        var tm = m;
        for (var k = 0u; k < 64u; k++) {
            tm = max(tm, sc[k]);
        }
        let corr = exp(m - tm);
        total *= corr;
        for (var c = 0u; c < 16u; c++) {
            acc[c] *= corr;
        }
        let last = min(pos - t0 + 1u, 64u);
        for (var k = 0u; k < last; k++) {
            let pk = exp(sc[k] - tm);
            total += pk;
            let vo = (t0 + k) * half;
            for (var c = 0u; c < 16u; c++) {
                let d = l + 64u * c;
                if (d < p.dims) {
                    let pair = unpack2x16float(cache[vo + d / 2u]);
                    acc[c] += pk * select(pair.x, pair.y, (d & 1u) == 1u);
                }
            }
        }
        m = tm;
        workgroupBarrier();
    }
    for (var c = 0u; c < 16u; c++) {
        let d = l + 64u * c;
        if (d < p.dims) {
            out[qo + d] = acc[c] / total;
        }
    }
}
