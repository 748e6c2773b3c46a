//! The CPU backend: activations are plain `f32` vectors, weights are shoal's repacked
//! quantized matrices ([`matrix`]), the KV cache is f16 buffers per layer ([`kv`]), and
//! attention, RoPE and the elementwise steps run on slices ([`attention`], [`rope`],
//! [`elementwise`]). It owns the thread policy: a step of a model held whole runs on the
//! compute pool, a decode step as one `kernels::team` step whose helper threads spin between
//! its products instead of falling asleep and being woken for each.

pub mod attention;
pub mod bench;
pub mod elementwise;
pub mod experts;
mod kernels;
pub mod kv;
pub mod latent;
pub mod matrix;
pub mod rope;

use std::ops::Range;
use std::sync::Mutex;

use shoal_comm::Communicator;

use self::attention::AttentionShape;
use self::experts::CpuExperts;
pub use self::kernels::argmax;
pub(crate) use self::kernels::softmax_weights;
use self::kernels::team;
use self::kv::CpuKv;
use self::matrix::{CpuGateUp, CpuMatrix};
use self::rope::RopeTables;
use super::{Backend, Heads, HeldExpert, KvLayout, LatentLayer, Rope, Routes, StepRows};
use crate::config::Activation;
use crate::weights::{Slice, WeightSource};
use crate::EngineError;

/// The CPU backend (see the module).
#[derive(Debug, Clone, Copy, Default)]
pub struct Cpu;

/// Resizes `v` to `n` values (new ones zero), keeping its capacity.
pub(crate) fn sized(v: &mut Vec<f32>, n: usize) {
    v.resize(n, 0.0);
}

/// Pointers into the parts of a batched decode step that each job owns alone.
struct Parts<T> {
    caches: *mut T,
    out: *mut f32,
}

// SAFETY: job `i` of the loop that shares it touches only cache `i` and row `i` of `out`.
unsafe impl<T: Send> Send for Parts<T> {}
unsafe impl<T: Send> Sync for Parts<T> {}

impl Backend for Cpu {
    type Act = Vec<f32>;
    type Matrix = CpuMatrix;
    type GateUp = CpuGateUp;
    type Vector = Vec<f32>;
    type Kv = CpuKv;
    type Tables = RopeTables;
    type Experts = CpuExperts;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn matrix(
        &self,
        src: &dyn WeightSource,
        name: &str,
        slice: &Slice,
    ) -> Result<CpuMatrix, EngineError> {
        CpuMatrix::load(src, name, slice)
    }

    fn gate_up(&self, gate: CpuMatrix, up: CpuMatrix) -> CpuGateUp {
        CpuGateUp::new(gate, up)
    }

    fn vector(&self, values: Vec<f32>) -> Vec<f32> {
        values
    }

    fn kv(&self, layers: usize, layout: KvLayout, capacity: usize) -> CpuKv {
        CpuKv::new(layers, layout, capacity)
    }

    fn experts(&self, held: Vec<HeldExpert<Cpu>>, n_expert: usize) -> CpuExperts {
        CpuExperts::new(held, n_expert)
    }

    fn host<'a>(&self, x: &'a Vec<f32>) -> Result<std::borrow::Cow<'a, [f32]>, EngineError> {
        Ok(std::borrow::Cow::Borrowed(x))
    }

    fn copy_kv(&self, from: &CpuKv, to: &mut CpuKv, positions: usize) -> Result<(), EngineError> {
        to.copy_prefix(from, positions)
    }

    fn upload(&self, host: Vec<f32>) -> Vec<f32> {
        host
    }

    fn download(&self, act: Vec<f32>) -> Result<Vec<f32>, EngineError> {
        Ok(act)
    }

    fn all_reduce(&self, comm: &dyn Communicator, x: &mut Vec<f32>) -> Result<(), EngineError> {
        Ok(comm.all_reduce_sum(x)?)
    }

    fn embed(
        &self,
        table: &CpuMatrix,
        rows: Range<usize>,
        ids: &[u32],
        scale: f32,
        out: &mut Vec<f32>,
    ) -> Result<(), EngineError> {
        let d = table.dims()[1];
        out.clear();
        sized(out, ids.len() * d);
        for (&id, row) in ids.iter().zip(out.chunks_exact_mut(d)) {
            let id = id as usize;
            if rows.contains(&id) {
                table.row(id - rows.start, row)?;
                if scale != 1.0 {
                    for v in row.iter_mut() {
                        *v *= scale;
                    }
                }
            }
        }
        Ok(())
    }

    fn matmul(
        &self,
        mats: &[&CpuMatrix],
        x: &Vec<f32>,
        outs: &mut [&mut Vec<f32>],
    ) -> Result<(), EngineError> {
        CpuMatrix::products(mats, x, outs)
    }

    fn add_bias(&self, y: &mut Vec<f32>, bias: &Vec<f32>) {
        if !bias.is_empty() {
            for row in y.chunks_exact_mut(bias.len()) {
                elementwise::add(row, bias);
            }
        }
    }

    fn gated(
        &self,
        gate_up: &CpuGateUp,
        act: Activation,
        x: &Vec<f32>,
        out: &mut Vec<f32>,
    ) -> Result<(), EngineError> {
        gate_up.gated(act, x, out)
    }

    fn rms_norm(&self, x: &Vec<f32>, w: &Vec<f32>, eps: f32, out: &mut Vec<f32>) {
        sized(out, x.len());
        elementwise::rms_norm(x, w, eps, out);
    }

    fn rms_norm_in_place(&self, x: &mut Vec<f32>, w: &Vec<f32>, eps: f32) {
        elementwise::rms_norm_in_place(x, w, eps);
    }

    fn add_rms_norm(
        &self,
        x: &mut Vec<f32>,
        a: &Vec<f32>,
        w: &Vec<f32>,
        eps: f32,
        out: &mut Vec<f32>,
    ) {
        elementwise::add(x, a);
        self.rms_norm(x, w, eps, out);
    }

    fn add(&self, x: &mut Vec<f32>, a: &Vec<f32>) {
        elementwise::add(x, a);
    }

    fn begin_step(&self, _rows: &StepRows, tables: &mut RopeTables) {
        tables.reset();
    }

    fn rope(&self, x: &mut Vec<f32>, rope: &Rope, rows: &StepRows, tables: &mut RopeTables) {
        rope::rotate(x, rope, rows, tables);
    }

    fn prefetch_kv(&self, kv: &[&mut CpuKv], layer: usize, heads: &Heads, rows: &StepRows) {
        // one row of one sequence: the last token's weights pushed its keys and values out
        // of every cache, and the q/k/v products give time to fetch them again
        if let ([cache], [pos]) = (kv, &rows.positions[..]) {
            if let Some((kc, vc)) = cache.buffers(layer) {
                AttentionShape::new(heads, cache.capacity()).prefetch(*pos, kc, vc);
            }
        }
    }

    fn attention(
        &self,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        kv: &mut [&mut CpuKv],
        layer: usize,
        heads: &Heads,
        rows: &StepRows,
        out: &mut Vec<f32>,
    ) -> Result<(), EngineError> {
        let width = heads.n_head * heads.head_dim;
        let kv_width = heads.n_kv_head * heads.head_dim;
        let n = rows.len();
        if kv.len() != rows.seqs.len()
            || q.len() != n * width
            || k.len() != n * kv_width
            || v.len() != n * kv_width
        {
            return Err(EngineError::Internal {
                what: format!(
                    "attention over {} rows of {} sequences with {} caches, {} queries, {} keys, \
                     {} values ({heads:?})",
                    n,
                    rows.seqs.len(),
                    kv.len(),
                    q.len(),
                    k.len(),
                    v.len()
                ),
            });
        }
        sized(out, n * width);
        if rows.seqs.len() > 1 && rows.is_decode() {
            // Each sequence writes its row and attends over its own cache, all sequences in
            // parallel on the decode step's team (whose helpers spin rather than take
            // rayon's work).
            let parts = Parts {
                caches: kv.as_mut_ptr(),
                out: out.as_mut_ptr(),
            };
            let failed: Mutex<Option<EngineError>> = Mutex::new(None);
            team::for_each(n, |i| {
                let parts = &parts;
                // SAFETY: the loop hands out each index once; job `i` alone touches cache
                // `i` (of `n`) and row `i` of `out` (`n * width` long, sized above).
                let (cache, o) = unsafe {
                    (
                        &mut **parts.caches.add(i),
                        std::slice::from_raw_parts_mut(parts.out.add(i * width), width),
                    )
                };
                let pos = rows.positions[i];
                let row = i * kv_width..(i + 1) * kv_width;
                if let Err(e) = cache.write(layer, pos, &k[row.clone()], &v[row]) {
                    failed
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .get_or_insert(e);
                    return;
                }
                let (kc, vc) = cache.buffers(layer).expect("written above");
                let qi = &q[i * width..(i + 1) * width];
                AttentionShape::new(heads, cache.capacity()).decode(pos, qi, kc, vc, o);
            });
            if let Some(e) = failed.into_inner().unwrap_or_else(|e| e.into_inner()) {
                return Err(e);
            }
            return Ok(());
        }
        for (s, cache) in rows.seqs.iter().zip(kv.iter_mut()) {
            let (r0, r1) = (s.rows.start, s.rows.end);
            cache.write(
                layer,
                s.start,
                &k[r0 * kv_width..r1 * kv_width],
                &v[r0 * kv_width..r1 * kv_width],
            )?;
            let (kc, vc) = cache.buffers(layer).expect("written above");
            let shape = AttentionShape::new(heads, cache.capacity());
            let (qs, o) = (&q[r0 * width..r1 * width], &mut out[r0 * width..r1 * width]);
            if r1 - r0 == 1 {
                shape.decode_parallel(s.start, qs, kc, vc, o);
            } else {
                shape.prefill(s.start, r1 - r0, qs, kc, vc, o);
            }
        }
        Ok(())
    }

    fn moe(
        &self,
        experts: &CpuExperts,
        act: Activation,
        x: &Vec<f32>,
        routes: &Routes,
        out: &mut Vec<f32>,
    ) -> Result<(), EngineError> {
        experts.forward(act, x, routes, out)
    }

    fn latent_attention(
        &self,
        q: &Vec<f32>,
        kv_a: &Vec<f32>,
        layer: &LatentLayer<Cpu>,
        kv: &mut [&mut CpuKv],
        cache_layer: usize,
        rows: &StepRows,
        tables: &mut RopeTables,
        out: &mut Vec<f32>,
    ) -> Result<(), EngineError> {
        latent::attend(q, kv_a, layer, kv, cache_layer, rows, tables, out)
    }

    fn select_rows(&self, x: &Vec<f32>, width: usize, which: &[usize], out: &mut Vec<f32>) {
        out.clear();
        for &r in which {
            out.extend_from_slice(&x[r * width..(r + 1) * width]);
        }
    }

    fn run_step<R: Send>(&self, decode: bool, f: impl FnOnce() -> R + Send) -> R {
        if decode {
            team::step(f)
        } else {
            // a prefill's rayon loops need the whole pool: send away the helpers that
            // linger after a decode step
            team::release();
            rayon::scope(|_| f())
        }
    }
}
