// Writes rows of keys and values into one sequence's cache for one layer. The cache holds
// f16 pairs packed in words, laid out [kv head][position][head_dim / 2].
struct Params { kv_heads: u32, head_dim: u32, cap: u32, n: u32, start: u32, row0: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> k: array<f32>;
@group(0) @binding(2) var<storage, read> v: array<f32>;
@group(0) @binding(3) var<storage, read_write> kc: array<u32>;
@group(0) @binding(4) var<storage, read_write> vc: array<u32>;

@compute @workgroup_size(64)
fn write_kv(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let half = p.head_dim / 2u;
    let j = g.x * 64u + l;
    let h = g.y;
    let i = g.z;
    if (j >= half || i >= p.n) {
        return;
    }
    let src = (p.row0 + i) * p.kv_heads * p.head_dim + h * p.head_dim + 2u * j;
    let dst = (h * p.cap + p.start + i) * half + j;
    kc[dst] = pack2x16float(vec2<f32>(k[src], k[src + 1u]));
    vc[dst] = pack2x16float(vec2<f32>(v[src], v[src + 1u]));
}
