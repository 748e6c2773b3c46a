// Rows of latents (rows of `dims`) written at positions start .. start + n of the cache.
struct WriteParams { dims: u32, n: u32, row0: u32, start: u32 }
@group(0) @binding(0) var<uniform> wp: WriteParams;
@group(0) @binding(1) var<storage, read> lat: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;

@compute @workgroup_size(64)
fn write_latent(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let half = wp.dims / 2u;
    let j = g.x * 64u + l;
    let i = g.y;
    if (j >= half || i >= wp.n) {
        return;
    }
    let src = (wp.row0 + i) * wp.dims + 2u * j;
    dst[(wp.start + i) * half + j] = pack2x16float(vec2<f32>(lat[src], lat[src + 1u]));
}
