// out = act(g) * u over n values; act 0 is SiLU, 1 GELU (tanh approximation), 2 gpt-oss's
// clamped SwiGLU (min(g, 7) sigmoid(1.702 min(g, 7)) (clamp(u, -7, 7) + 1)).
struct Params { n: u32, act: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> gate: array<f32>;
@group(0) @binding(2) var<storage, read> up: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(256)
fn gated(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let i = (g.x + g.y * 65535u) * 256u + l;
    if (i >= p.n) {
        return;
    }
    let x = gate[i];
    if (p.act == 2u) {
        let c = min(x, 7.0);
        out[i] = c / (1.0 + exp(-1.702 * c)) * (clamp(up[i], -7.0, 7.0) + 1.0);
        return;
    }
    var a: f32;
    if (p.act == 0u) {
        a = x / (1.0 + exp(-x));
    } else {
        let y = 0.7978846 * x * (1.0 + 0.044715 * x * x);
        a = x / (1.0 + exp(-2.0 * y));
    }
    out[i] = a * up[i];
}
