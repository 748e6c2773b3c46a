// Attention of one sequence's rows over its cache (layout as in kv.wgsl): one workgroup per
// (row, query head). Keys are read in tiles of 64, one per thread; the softmax runs online
// (a running maximum and sum), and each thread accumulates up to four of the head's
// dimensions of the weighted values. With `sinks` set, each head's sink logit (gpt-oss)
// joins the softmax without a value: the running maximum and sum start from it.
struct Params {
    n_head: u32, first_head: u32, first_kv: u32, group: u32,
    head_dim: u32, cap: u32, window: u32, scale: f32,
    row0: u32, start: u32, sinks: u32,
}
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> kc: array<u32>;
@group(0) @binding(3) var<storage, read> vc: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read> sink: array<f32>;

const NEG: f32 = -3.0e38;
var<workgroup> qs: array<f32, 256>;
var<workgroup> sc: array<f32, 64>;

@compute @workgroup_size(64)
fn attend(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let i = g.x;
    let h = g.y;
    let hd = p.head_dim;
    let half = hd / 2u;
    let row = p.row0 + i;
    let pos = p.start + i;
    let kvh = (p.first_head + h) / p.group - p.first_kv;
    var first = 0u;
    if (p.window > 0u && pos + 1u > p.window) {
        first = pos + 1u - p.window;
    }
    let qo = row * p.n_head * hd + h * hd;
    for (var d = l; d < hd; d += 64u) {
        qs[d] = q[qo + d];
    }
    workgroupBarrier();
    var m = NEG;
    var total = 0.0;
    if (p.sinks != 0u) {
        m = sink[h];
        total = 1.0;
    }
    var acc = array<f32, 4>(0.0, 0.0, 0.0, 0.0);
    let kbase = kvh * p.cap;
    for (var t0 = first; t0 <= pos; t0 += 64u) {
        let j = t0 + l;
        var s = NEG;
        if (j <= pos) {
            let ko = (kbase + j) * half;
            var dot = 0.0;
            for (var w = 0u; w < half; w++) {
                let kv2 = unpack2x16float(kc[ko + w]);
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
        for (var c = 0u; c < 4u; c++) {
            acc[c] *= corr;
        }
        let last = min(pos - t0 + 1u, 64u);
        for (var k = 0u; k < last; k++) {
            let pk = exp(sc[k] - tm);
            total += pk;
            let vo = (kbase + t0 + k) * half;
            for (var c = 0u; c < 4u; c++) {
                let d = l + 64u * c;
                if (d < hd) {
                    let pair = unpack2x16float(vc[vo + d / 2u]);
                    acc[c] += pk * select(pair.x, pair.y, (d & 1u) == 1u);
                }
            }
        }
        m = tm;
        workgroupBarrier();
    }
    for (var c = 0u; c < 4u; c++) {
        let d = l + 64u * c;
        if (d < hd) {
            out[qo + d] = acc[c] / total;
        }
    }
}
