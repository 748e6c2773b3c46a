// Reads a buffer once, 16 bytes per load, for the device's read bandwidth: thread i of the
// grid reads words i, i + stride, ... and writes what it read folded into one word (so the
// reads cannot be left out).
struct Params { words: u32, stride: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> out: array<u32>;

@compute @workgroup_size(256)
fn probe(@builtin(global_invocation_id) id: vec3<u32>) {
    var acc = vec4<u32>(0u);
    for (var i = id.x; i < p.words; i += p.stride) {
        acc ^= src[i];
    }
    out[id.x] = acc.x ^ acc.y ^ acc.z ^ acc.w;
}
