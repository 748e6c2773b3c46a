//! Every operation of the GPU backend against the CPU backend's, on random inputs of
//! awkward sizes (widths that are not multiples of the workgroups, several sequences at
//! different positions, grouped and windowed heads, both RoPE pairings with YaRN and
//! frequency factors, experts some rows share and some nobody holds).
//!
//! Tolerances: both compute in f32 from the same f32 weights, in different orders of
//! summation, and both round keys and values to f16 in the cache; outputs are O(1). The
//! elementwise steps agree within 1e-5 of the largest magnitude, the products and
//! attention within 1e-4 (sums of up to a few hundred terms, and an f16 rounding that a
//! last-bit difference can move).

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Tensor;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::Gpu;
use crate::backend::cpu::Cpu;
use crate::backend::{Backend, Heads, HeldExpert, KvLayout, Rope, Routes, StepRows, YarnRope};
use crate::config::{Activation, RopeStyle};
use crate::weights::{Slice, WeightSource};
use crate::EngineError;

/// The GPU, or `None` (after saying so) where this machine has none and neither CI nor
/// `SHOAL_REQUIRE_GPU=1` demands one.
fn gpu() -> Option<Gpu> {
    if super::adapters::adapters().is_empty() {
        let msg = "no GPU adapter found: skipping the GPU operation tests";
        if std::env::var("SHOAL_REQUIRE_GPU").as_deref() == Ok("1") || shoal_testkit::in_ci() {
            panic!("{msg}");
        }
        println!("{msg}");
        return None;
    }
    Some(Gpu::open(0).unwrap())
}

/// f32 matrices by name, as a weight source.
#[derive(Default)]
struct Mem(HashMap<String, (Vec<usize>, Vec<f32>)>);

impl Mem {
    fn add(&mut self, name: &str, rows: usize, cols: usize, rng: &mut StdRng) {
        let v = random(rows * cols, rng);
        self.0.insert(name.into(), (vec![rows, cols], v));
    }
}

impl WeightSource for Mem {
    fn describe(&self) -> String {
        "test matrices".into()
    }
    fn contains(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }
    fn shape(&self, name: &str) -> Result<Vec<usize>, EngineError> {
        Ok(self.0[name].0.clone())
    }
    fn load(&self, name: &str, _slice: &Slice) -> Result<QTensor, EngineError> {
        let (shape, v) = &self.0[name];
        let t = Tensor::from_slice(v, &shape[..], &candle_core::Device::Cpu).unwrap();
        Ok(QTensor::quantize(&t, GgmlDType::F32).unwrap())
    }
}

fn random(n: usize, rng: &mut StdRng) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// Largest |a - b| over the largest |b| (or 1).
fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths");
    let scale = b.iter().fold(1f32, |m, v| m.max(v.abs()));
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
        / scale
}

fn host(g: &Gpu, x: &super::GpuAct) -> Vec<f32> {
    g.host(x).unwrap().into_owned()
}

#[test]
fn elementwise_steps_match_the_cpu() {
    let Some(g) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(1);
    for width in [1, 7, 64, 257, 896] {
        for rows in [1, 3, 5] {
            let (x, a, w, b) = (
                random(rows * width, &mut rng),
                random(rows * width, &mut rng),
                random(width, &mut rng),
                random(width, &mut rng),
            );
            let (gw, cw) = (g.vector(w.clone()), Cpu.vector(w.clone()));
            let (gx, ga) = (g.upload(x.clone()), g.upload(a.clone()));
            let label = format!("{rows} rows of {width}");
            // rms_norm
            let (mut go, mut co) = (super::GpuAct::default(), Vec::new());
            g.rms_norm(&gx, &gw, 1e-5, &mut go);
            Cpu.rms_norm(&x, &cw, 1e-5, &mut co);
            assert!(rel_diff(&host(&g, &go), &co) < 1e-5, "rms_norm {label}");
            // in place
            let mut gi = g.upload(x.clone());
            let mut ci = x.clone();
            g.rms_norm_in_place(&mut gi, &gw, 1e-6);
            Cpu.rms_norm_in_place(&mut ci, &cw, 1e-6);
            assert!(
                rel_diff(&host(&g, &gi), &ci) < 1e-5,
                "rms_norm_in_place {label}"
            );
            // residual add and norm
            let (mut gx2, mut cx2) = (g.upload(x.clone()), x.clone());
            g.add_rms_norm(&mut gx2, &ga, &gw, 1e-5, &mut go);
            Cpu.add_rms_norm(&mut cx2, &a, &cw, 1e-5, &mut co);
            assert!(rel_diff(&host(&g, &gx2), &cx2) < 1e-6, "add {label}");
            assert!(rel_diff(&host(&g, &go), &co) < 1e-5, "add_rms_norm {label}");
            // bias
            let (mut gy, mut cy) = (g.upload(x.clone()), x.clone());
            g.add_bias(&mut gy, &g.vector(b.clone()));
            Cpu.add_bias(&mut cy, &b);
            assert!(rel_diff(&host(&g, &gy), &cy) < 1e-6, "add_bias {label}");
            // rows picked
            let which: Vec<usize> = (0..rows).rev().chain([0]).collect();
            let (mut gs, mut cs) = (super::GpuAct::default(), Vec::new());
            g.select_rows(&gx, width, &which, &mut gs);
            Cpu.select_rows(&x, width, &which, &mut cs);
            assert_eq!(host(&g, &gs), cs, "select_rows {label}");
        }
    }
}

#[test]
fn products_embeddings_and_gated_activations_match_the_cpu() {
    let Some(g) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(2);
    for (rows, cols) in [(1, 32), (33, 64), (70, 96), (5, 256)] {
        let mut src = Mem::default();
        for name in ["a", "b", "gate", "up"] {
            src.add(name, rows, cols, &mut rng);
        }
        let (ga, gb) = (
            g.matrix(&src, "a", &Slice::Full).unwrap(),
            g.matrix(&src, "b", &Slice::Full).unwrap(),
        );
        let (ca, cb) = (
            Cpu.matrix(&src, "a", &Slice::Full).unwrap(),
            Cpu.matrix(&src, "b", &Slice::Full).unwrap(),
        );
        for t in [1, 3, 7] {
            let x = random(t * cols, &mut rng);
            let gx = g.upload(x.clone());
            let (mut g1, mut g2) = (super::GpuAct::default(), super::GpuAct::default());
            let (mut c1, mut c2) = (Vec::new(), Vec::new());
            g.matmul(&[&ga, &gb], &gx, &mut [&mut g1, &mut g2]).unwrap();
            Cpu.matmul(&[&ca, &cb], &x, &mut [&mut c1, &mut c2])
                .unwrap();
            // F32 weights: both multiply in f32
            assert!(
                rel_diff(&host(&g, &g1), &c1) < 1e-4,
                "matmul {rows}x{cols} t{t}"
            );
            assert!(
                rel_diff(&host(&g, &g2), &c2) < 1e-4,
                "matmul {rows}x{cols} t{t}"
            );
            for act in [
                Activation::Silu,
                Activation::GeluTanh,
                Activation::SwigluOai,
            ] {
                let gp = g.gate_up(
                    g.matrix(&src, "gate", &Slice::Full).unwrap(),
                    g.matrix(&src, "up", &Slice::Full).unwrap(),
                );
                let cp = Cpu.gate_up(
                    Cpu.matrix(&src, "gate", &Slice::Full).unwrap(),
                    Cpu.matrix(&src, "up", &Slice::Full).unwrap(),
                );
                let (mut go, mut co) = (super::GpuAct::default(), Vec::new());
                g.gated(&gp, act, &gx, &mut go).unwrap();
                Cpu.gated(&cp, act, &x, &mut co).unwrap();
                assert!(
                    rel_diff(&host(&g, &go), &co) < 1e-4,
                    "gated {act:?} {rows}x{cols} t{t}"
                );
            }
        }
        // embeddings: rows of the table's range, zeros outside it
        let ids = [0u32, (rows - 1) as u32, rows as u32 + 3, 0];
        let range = 0..rows;
        let (mut ge, mut ce) = (super::GpuAct::default(), Vec::new());
        g.embed(&ga, range.clone(), &ids, 0.5, &mut ge).unwrap();
        Cpu.embed(&ca, range, &ids, 0.5, &mut ce).unwrap();
        assert!(rel_diff(&host(&g, &ge), &ce) < 1e-6, "embed {rows}x{cols}");
    }
}

fn ropes() -> Vec<Rope> {
    let factors: Arc<[f32]> = (0..8)
        .map(|i| 1.0 + i as f32 * 0.5)
        .collect::<Vec<_>>()
        .into();
    let mut out = Vec::new();
    for style in [RopeStyle::Interleaved, RopeStyle::Halves] {
        out.push(Rope {
            style,
            head_dim: 16,
            dims: 16,
            base: 10_000.0,
            scale: 1.0,
            freq_factors: None,
            yarn: None,
        });
        // GLM-4.5's partial rotation: the first half of each head
        out.push(Rope {
            style,
            head_dim: 16,
            dims: 8,
            base: 10_000.0,
            scale: 1.0,
            freq_factors: None,
            yarn: None,
        });
        out.push(Rope {
            style,
            head_dim: 16,
            dims: 16,
            base: 500_000.0,
            scale: 8.0,
            freq_factors: Some(factors.clone()),
            yarn: Some(YarnRope {
                ext_factor: 1.0,
                corr_low: 2.0,
                corr_high: 6.0,
                mscale: 1.2,
            }),
        });
    }
    out
}

#[test]
fn rope_matches_the_cpu() {
    let Some(g) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(3);
    for rope in ropes() {
        for (counts, starts) in [(vec![1], vec![0]), (vec![3, 1, 2], vec![0, 40, 7000])] {
            let rows = StepRows::new(&counts, &starts);
            let x = random(rows.len() * 3 * rope.head_dim, &mut rng);
            let mut gx = g.upload(x.clone());
            let mut cx = x.clone();
            let (mut gt, mut ct) = (Default::default(), Default::default());
            g.begin_step(&rows, &mut gt);
            Cpu.begin_step(&rows, &mut ct);
            g.rope(&mut gx, &rope, &rows, &mut gt);
            Cpu.rope(&mut cx, &rope, &rows, &mut ct);
            let d = rel_diff(&host(&g, &gx), &cx);
            assert!(d < 1e-5, "{rope:?} {counts:?} at {starts:?}: {d}");
        }
    }
}

#[test]
fn attention_matches_the_cpu() {
    let Some(g) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(4);
    // (query heads, kv heads, head dim, window); a rank's slice of heads where first > 0
    for (n_head, n_kv, hd, window, first) in [
        (4, 4, 16, None, 0),
        (6, 2, 32, None, 0),
        (4, 1, 64, Some(5), 0),
        (2, 1, 16, None, 2),
    ] {
        let group = n_head / n_kv;
        let heads = Heads {
            n_head,
            first_head: first,
            n_kv_head: n_kv,
            first_kv: first / group,
            group,
            head_dim: hd,
            window,
            scale: 1.0 / (hd as f32).sqrt(),
            sinks: None,
        };
        let layout = KvLayout::Heads {
            kv_heads: n_kv,
            head_dim: hd,
        };
        let cap = 80;
        let mut gk: Vec<_> = (0..2).map(|_| g.kv(2, layout, cap)).collect();
        let mut ck: Vec<_> = (0..2).map(|_| Cpu.kv(2, layout, cap)).collect();
        // a prefill of two sequences, a batched decode step of both, then one again
        let mut done = [0usize; 2];
        for counts in [vec![7, 3], vec![1, 1], vec![2, 65]] {
            let rows = StepRows::new(&counts, &done);
            let n = rows.len();
            let (q, k, v) = (
                random(n * n_head * hd, &mut rng),
                random(n * n_kv * hd, &mut rng),
                random(n * n_kv * hd, &mut rng),
            );
            let (gq, gkk, gv) = (
                g.upload(q.clone()),
                g.upload(k.clone()),
                g.upload(v.clone()),
            );
            let (mut go, mut co) = (super::GpuAct::default(), Vec::new());
            for layer in 0..2 {
                let mut grefs: Vec<&mut super::GpuKv> = gk.iter_mut().collect();
                let mut crefs: Vec<&mut _> = ck.iter_mut().collect();
                g.attention(&gq, &gkk, &gv, &mut grefs, layer, &heads, &rows, &mut go)
                    .unwrap();
                Cpu.attention(&q, &k, &v, &mut crefs, layer, &heads, &rows, &mut co)
                    .unwrap();
                let d = rel_diff(&host(&g, &go), &co);
                assert!(
                    d < 1e-4,
                    "{heads:?} {counts:?} after {done:?} layer {layer}: {d}"
                );
            }
            for (d, c) in done.iter_mut().zip(&counts) {
                *d += c;
            }
        }
        // a copied prefix attends as the original does
        let mut gcopy = g.kv(2, layout, cap);
        g.copy_kv(&gk[1], &mut gcopy, done[1]).unwrap();
        let rows = StepRows::new(&[1], &[done[1]]);
        let (q, k, v) = (
            random(n_head * hd, &mut rng),
            random(n_kv * hd, &mut rng),
            random(n_kv * hd, &mut rng),
        );
        let (gq, gkk, gv) = (g.upload(q), g.upload(k), g.upload(v));
        let (mut a, mut b) = (super::GpuAct::default(), super::GpuAct::default());
        g.attention(&gq, &gkk, &gv, &mut [&mut gcopy], 0, &heads, &rows, &mut a)
            .unwrap();
        g.attention(&gq, &gkk, &gv, &mut [&mut gk[1]], 0, &heads, &rows, &mut b)
            .unwrap();
        assert_eq!(host(&g, &a), host(&g, &b), "copy_kv {heads:?}");
    }
}

#[test]
fn experts_match_the_cpu() {
    let Some(g) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(5);
    let (d, f, n_expert) = (48, 32, 6);
    let mut src = Mem::default();
    for e in 0..n_expert {
        src.add(&format!("g{e}"), f, d, &mut rng);
        src.add(&format!("u{e}"), f, d, &mut rng);
        src.add(&format!("d{e}"), d, f, &mut rng);
    }
    // this rank holds experts 0, 2, 3 and 5
    let held = [0, 2, 3, 5];
    let ge = g.experts(
        held.iter()
            .map(|&e| {
                let m = |n: String| g.matrix(&src, &n, &Slice::Full).unwrap();
                HeldExpert {
                    id: e,
                    gate_up: g.gate_up(m(format!("g{e}")), m(format!("u{e}"))),
                    down: m(format!("d{e}")),
                    bias: None,
                }
            })
            .collect(),
        n_expert,
    );
    let ce = Cpu.experts(
        held.iter()
            .map(|&e| {
                let m = |n: String| Cpu.matrix(&src, &n, &Slice::Full).unwrap();
                HeldExpert {
                    id: e,
                    gate_up: Cpu.gate_up(m(format!("g{e}")), m(format!("u{e}"))),
                    down: m(format!("d{e}")),
                    bias: None,
                }
            })
            .collect(),
        n_expert,
    );
    for rows in [1, 5] {
        let k = 2;
        let mut routes = Routes {
            k,
            ..Default::default()
        };
        for r in 0..rows {
            routes
                .experts
                .extend([(r % n_expert) as u32, ((r + 1) % n_expert) as u32]);
            routes.weights.extend([0.7, 0.3]);
        }
        let x = random(rows * d, &mut rng);
        let (mut go, mut co) = (super::GpuAct::default(), Vec::new());
        for act in [
            Activation::Silu,
            Activation::GeluTanh,
            Activation::SwigluOai,
        ] {
            g.moe(&ge, act, &g.upload(x.clone()), &routes, &mut go)
                .unwrap();
            Cpu.moe(&ce, act, &x, &routes, &mut co).unwrap();
            let diff = rel_diff(&host(&g, &go), &co);
            assert!(diff < 1e-4, "{rows} rows {act:?}: {diff}");
        }
    }
}

/// The probes give finite, positive figures (what they measure is a speed; its size is the
/// device's, not a test's business), and the throughput probe's product is the backend's
/// own: it fails the way a model's load would where it cannot run.
#[test]
fn the_probes_measure_bandwidth_and_throughput() {
    let Some(g) = gpu() else { return };
    let bw = super::probe::read_bandwidth(&g.ctx, 1, 1).unwrap();
    let flops = super::probe::matmul_gflops(&g.ctx, 1, 1).unwrap();
    eprintln!("{}: {bw:.1} GB/s, {flops:.1} GFLOP/s", g.describe());
    assert!(bw.is_finite() && bw > 0.0, "{bw}");
    assert!(flops.is_finite() && flops > 0.0, "{flops}");
}
