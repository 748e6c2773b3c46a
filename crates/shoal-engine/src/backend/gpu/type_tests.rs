//! The GPU block decoders of every weight type (`shaders/<type>.wgsl`) against candle's
//! dequantization of the same bytes: products over awkward shapes (a row, a few rows, one
//! to five blocks, activation row counts around the kernel's groups of four), row gathers
//! (one id outside the matrix), and a matrix cut into many buffers.
//!
//! Each test opens its own device on the first adapter, so a shader that fails validation
//! fails its own type's test only (wgpu's first error stays with the device it hit).

use std::borrow::Cow;
use std::sync::OnceLock;

use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::Device;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use shoal_model::gguf::GgmlType;

use super::adapters;
use super::context::GpuContext;
use super::matrix::GpuMatrix;
use super::GpuAct;

/// Matrix rows tried.
const ROWS: [usize; 4] = [1, 7, 33, 67];
/// Activation rows tried.
const TS: [usize; 5] = [1, 3, 4, 5, 9];

/// The candle type that dequantizes `ty`'s blocks.
fn candle_type(ty: GgmlType) -> GgmlDType {
    match ty {
        GgmlType::F32 => GgmlDType::F32,
        GgmlType::F16 => GgmlDType::F16,
        GgmlType::BF16 => GgmlDType::BF16,
        GgmlType::Q4_0 => GgmlDType::Q4_0,
        GgmlType::Q4_1 => GgmlDType::Q4_1,
        GgmlType::Q5_0 => GgmlDType::Q5_0,
        GgmlType::Q5_1 => GgmlDType::Q5_1,
        GgmlType::Q8_0 => GgmlDType::Q8_0,
        GgmlType::Q2_K => GgmlDType::Q2K,
        GgmlType::Q3_K => GgmlDType::Q3K,
        GgmlType::Q4_K => GgmlDType::Q4K,
        GgmlType::Q5_K => GgmlDType::Q5K,
        GgmlType::Q6_K => GgmlDType::Q6K,
        other => panic!("no GPU decoder test for {other:?}"),
    }
}

/// A device of its own on the first adapter, or `None` (after saying so) where this
/// machine has no adapter and `SHOAL_REQUIRE_GPU=1` does not demand one.
fn device() -> Option<GpuContext> {
    if adapters::adapters().is_empty() {
        let msg = "no GPU adapter found: skipping the GPU weight-type tests";
        if std::env::var("SHOAL_REQUIRE_GPU").as_deref() == Ok("1") || shoal_testkit::in_ci() {
            panic!("{msg} (SHOAL_REQUIRE_GPU=1)");
        }
        println!("{msg}");
        return None;
    }
    // the adapters in `adapters`' order (real GPUs first), from an instance of our own
    static FOUND: OnceLock<(wgpu::Instance, Vec<wgpu::Adapter>)> = OnceLock::new();
    let (_, all) = FOUND.get_or_init(|| {
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
        desc.backends = wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12;
        let instance = wgpu::Instance::new(desc);
        let mut all = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::all()));
        all.sort_by_key(|a| a.get_info().device_type == wgpu::DeviceType::Cpu);
        (instance, all)
    });
    let adapter = all.first().expect("the adapter `adapters` listed");
    Some(GpuContext::open(adapter).expect("opening the first GPU adapter"))
}

fn put_f16(b: &mut [u8], at: usize, v: f32) {
    b[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
}

/// `rows` rows of `blocks` random blocks of `ty`: random code bytes, every f16 field a
/// finite value of at most 0.05 in magnitude; float types random values in [-1, 1).
fn random_blocks(ty: GgmlType, rows: usize, blocks: usize, rng: &mut StdRng) -> Vec<u8> {
    let bb = ty.block_bytes();
    let mut data = vec![0u8; rows * blocks * bb];
    rng.fill(&mut data[..]);
    let halves: &[usize] = match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q6_K => &[208],
        _ => &[],
    };
    for b in data.chunks_exact_mut(bb) {
        let v = rng.random_range(-1f32..1.0);
        match ty {
            GgmlType::F32 => b.copy_from_slice(&v.to_le_bytes()),
            GgmlType::F16 => b.copy_from_slice(&half::f16::from_f32(v).to_le_bytes()),
            GgmlType::BF16 => b.copy_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
            // an E8M0 scale of 2^-9 .. 2^3
            GgmlType::MXFP4 => b[0] = rng.random_range(118..=130),
            _ => {
                for &at in halves {
                    put_f16(b, at, rng.random_range(-1f32..1.0) * 0.05);
                }
            }
        }
    }
    data
}

/// candle's dequantization of `rows` rows of `cols` values of `ty` in `bytes` (the test
/// kit's, written from the format, for MXFP4, which candle does not read).
fn reference(ty: GgmlType, rows: usize, cols: usize, bytes: &[u8]) -> Vec<f32> {
    if ty == GgmlType::MXFP4 {
        use shoal_testkit::quants::{dequantize, GgmlType as Kit};
        return dequantize(Kit::MXFP4, bytes, rows * cols).expect("test kit dequantize");
    }
    let storage = QStorage::from_data(Cow::Borrowed(bytes), &Device::Cpu, candle_type(ty))
        .expect("candle storage");
    QTensor::new(storage, (rows, cols))
        .expect("candle tensor")
        .dequantize(&Device::Cpu)
        .expect("candle dequantize")
        .flatten_all()
        .expect("flatten")
        .to_vec1::<f32>()
        .expect("to_vec1")
}

/// Uploads a random `rows` x `cols` matrix of `ty` and checks its products with random
/// activations of every row count in [`TS`], and a gather, against candle.
fn check_matrix(ctx: &GpuContext, ty: GgmlType, rows: usize, cols: usize, rng: &mut StdRng) {
    let bytes = random_blocks(ty, rows, cols / ty.block_len(), rng);
    let w = reference(ty, rows, cols, &bytes);
    assert_eq!(w.len(), rows * cols);
    let m = GpuMatrix::from_bytes(ctx, "test", ty, rows, cols, &bytes).expect("upload");
    for t in TS {
        let x: Vec<f32> = (0..t * cols)
            .map(|_| rng.random_range(-1f32..1.0))
            .collect();
        let xa = GpuAct::from_host(ctx, &x);
        let mut y = GpuAct::default();
        m.matmul(ctx, &xa, &mut y).expect("matmul");
        let got = y.to_host(ctx).expect("matmul read back");
        assert_eq!(
            got.len(),
            t * rows,
            "{ty:?} {rows}x{cols} t={t}: output length"
        );
        for i in 0..t {
            let xi = &x[i * cols..(i + 1) * cols];
            for r in 0..rows {
                let (dot, mag) = w[r * cols..(r + 1) * cols].iter().zip(xi).fold(
                    (0f64, 0f64),
                    |(s, m), (&w, &x)| {
                        let p = w as f64 * x as f64;
                        (s + p, m + p.abs())
                    },
                );
                let g = got[i * rows + r] as f64;
                assert!(
                    (g - dot).abs() <= 1e-4 * mag + 1e-6,
                    "{ty:?} {rows}x{cols} t={t}: y[{i}][{r}] = {g}, expected {dot} \
                     (sum |w x| = {mag})"
                );
            }
        }
    }
    // rows by id: the last, the first, one just outside (zeros), the middle
    let ids = [rows as u32 - 1, 0, rows as u32, rows as u32 / 2];
    let mut out = GpuAct::default();
    m.gather(ctx, &ids, 0.5, &mut out);
    let got = out.to_host(ctx).expect("gather read back");
    assert_eq!(
        got.len(),
        ids.len() * cols,
        "{ty:?} {rows}x{cols}: gather length"
    );
    let wmax = w.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (i, &id) in ids.iter().enumerate() {
        for c in 0..cols {
            let want = if (id as usize) < rows {
                0.5 * w[id as usize * cols + c]
            } else {
                0.0
            };
            let g = got[i * cols + c];
            assert!(
                (g - want).abs() <= 1e-6 * (want.abs() + wmax),
                "{ty:?} {rows}x{cols}: gather row {id} value {c} = {g}, expected {want}"
            );
        }
    }
}

/// Every shape of [`ROWS`] by one, two and five blocks (float types also 17 columns).
fn check_type(ty: GgmlType) {
    let Some(ctx) = device() else { return };
    let mut rng =
        StdRng::seed_from_u64(0x5eed ^ (ty.block_bytes() as u64) ^ ((ty.block_len() as u64) << 16));
    let mut cols: Vec<usize> = [1, 2, 5].iter().map(|b| b * ty.block_len()).collect();
    if ty.block_len() == 1 {
        cols.push(17);
    }
    for rows in ROWS {
        for &c in &cols {
            check_matrix(&ctx, ty, rows, c, &mut rng);
        }
    }
}

macro_rules! type_tests {
    ($($name:ident: $ty:ident,)*) => {$(
        #[test]
        fn $name() {
            check_type(GgmlType::$ty);
        }
    )*};
}

type_tests! {
    decodes_f32: F32,
    decodes_f16: F16,
    decodes_bf16: BF16,
    decodes_q4_0: Q4_0,
    decodes_q4_1: Q4_1,
    decodes_q5_0: Q5_0,
    decodes_q5_1: Q5_1,
    decodes_q8_0: Q8_0,
    decodes_q2_k: Q2_K,
    decodes_q3_k: Q3_K,
    decodes_q4_k: Q4_K,
    decodes_q5_k: Q5_K,
    decodes_q6_k: Q6_K,
    decodes_mxfp4: MXFP4,
}

/// A matrix whose rows do not fit one binding (the device's limit lowered to a few rows'
/// bytes) is cut into chunks; products and gathers across them still match.
#[test]
fn chunked_matrices_match() {
    let Some(mut ctx) = device() else { return };
    let mut rng = StdRng::seed_from_u64(0xc4a7);
    for (ty, cols) in [
        (GgmlType::F16, 7),
        (GgmlType::Q4_0, 32),
        (GgmlType::Q3_K, 256),
        (GgmlType::Q6_K, 512),
    ] {
        let row_bytes = cols / ty.block_len() * ty.block_bytes();
        // five rows per buffer (67 rows: 14 chunks, the last of two rows)
        ctx.limits.max_storage_buffer_binding_size = (5 * row_bytes + 1) as _;
        check_matrix(&ctx, ty, 67, cols, &mut rng);
    }
}
