//! Multi-head latent attention (DeepSeek V2/V3) on the CPU, in the absorbed form: the KV
//! cache holds one latent per position (the normed key/value compression and the rotated
//! rope key, f16, see [`super::kv`]); each head's query is taken into the latent space by
//! its key matrix, attends over the latents as one shared KV head, and its result comes
//! back out through its value matrix. Scores and weighted sums run over whole latents (the
//! rope part of a latent is its key's rope part; the weighted sum's rope part is not
//! used).

use std::cell::RefCell;

use super::kv::CpuKv;
use super::matrix::CpuMatrix;
use super::rope::{self, RopeTables};
use super::{elementwise, sized, Cpu};
use crate::backend::cpu::kernels::{scores, softmax, team, weighted_sum};
use crate::backend::{LatentLayer, Rope, StepRows};
use crate::EngineError;

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// A pointer that parallel jobs write disjoint parts through.
struct Shared(*mut f32);

// SAFETY: every job of the loops that share one writes only its own part.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

/// Rows `rows` of `width` values each from column `from` of `x` (rows of `stride`), into
/// `out`.
fn gather(x: &[f32], stride: usize, from: usize, width: usize, rows: usize, out: &mut Vec<f32>) {
    out.clear();
    for r in 0..rows {
        out.extend_from_slice(&x[r * stride + from..r * stride + from + width]);
    }
}

/// See [`crate::backend::Backend::latent_attention`].
#[allow(clippy::too_many_arguments)]
pub fn attend(
    q: &[f32],
    kv_a: &[f32],
    layer: &LatentLayer<Cpu>,
    kv: &mut [&mut CpuKv],
    cache_layer: usize,
    rows: &StepRows,
    tables: &mut RopeTables,
    out: &mut Vec<f32>,
) -> Result<(), EngineError> {
    let n = rows.len();
    let (r, rd, nd, vd) = (
        layer.kv_lora_rank,
        layer.rope_dims,
        layer.nope_dims,
        layer.v_dims,
    );
    let heads = layer.n_head;
    let qw = nd + rd;
    let dims = r + rd;
    if kv.len() != rows.seqs.len()
        || q.len() != n * heads * qw
        || kv_a.len() != n * dims
        || layer.k_b.len() != heads
        || layer.v_b.len() != heads
    {
        return Err(EngineError::Internal {
            what: format!(
                "latent attention over {n} rows of {} sequences with {} caches, {} query and {} \
                 latent values, {} heads of {qw}",
                rows.seqs.len(),
                kv.len(),
                q.len(),
                kv_a.len(),
                heads
            ),
        });
    }
    let rope_of = |rope: &Rope| Rope {
        head_dim: rd,
        dims: rd,
        ..rope.clone()
    };
    let rope = rope_of(&layer.rope);

    // the step's latents: the compression normed, the rope key rotated
    let mut latents = kv_a.to_vec();
    let mut pe = Vec::with_capacity(n * rd);
    gather(kv_a, dims, r, rd, n, &mut pe);
    rope::rotate(&mut pe, &rope, rows, tables);
    for (i, row) in latents.chunks_exact_mut(dims).enumerate() {
        elementwise::rms_norm_in_place(&mut row[..r], &layer.kv_norm, layer.eps);
        row[r..].copy_from_slice(&pe[i * rd..(i + 1) * rd]);
    }
    for (s, cache) in rows.seqs.iter().zip(kv.iter_mut()) {
        cache.write_latent(
            cache_layer,
            s.start,
            &latents[s.rows.start * dims..s.rows.end * dims],
        )?;
    }

    // the queries in the latent space: per head, rows of [k_b q_nope, rotated q_pe]
    let mut q_pe = Vec::with_capacity(n * heads * rd);
    for row in q.chunks_exact(heads * qw) {
        for h in 0..heads {
            q_pe.extend_from_slice(&row[h * qw + nd..(h + 1) * qw]);
        }
    }
    rope::rotate(&mut q_pe, &rope, rows, tables);
    let mut queries = vec![0f32; heads * n * dims];
    let (mut part, mut absorbed) = (Vec::new(), Vec::new());
    for h in 0..heads {
        gather(q, heads * qw, h * qw, nd, n, &mut part);
        CpuMatrix::products(&[&layer.k_b[h]], &part, &mut [&mut absorbed])?;
        for i in 0..n {
            let dst = &mut queries[(h * n + i) * dims..(h * n + i + 1) * dims];
            dst[..r].copy_from_slice(&absorbed[i * r..(i + 1) * r]);
            dst[r..].copy_from_slice(&q_pe[(i * heads + h) * rd..(i * heads + h + 1) * rd]);
        }
    }

    // attention of every (head, row) over its sequence's latents
    let mut mixed = vec![0f32; heads * n * dims];
    let shared = Shared(mixed.as_mut_ptr());
    let seq_of: Vec<usize> = rows
        .seqs
        .iter()
        .enumerate()
        .flat_map(|(s, seq)| std::iter::repeat_n(s, seq.rows.len()))
        .collect();
    let caches: Vec<&[half::f16]> = kv
        .iter()
        .map(|c| c.latents(cache_layer).expect("written above"))
        .collect();
    let scale = layer.scale;
    team::for_each(heads * n, |j| {
        let shared = &shared;
        let i = j % n;
        let pos = rows.positions[i];
        let cache = &caches[seq_of[i]][..(pos + 1) * dims];
        let qj = &queries[j * dims..(j + 1) * dims];
        // SAFETY: job `j` alone writes part `j` of `mixed` (`heads * n` parts of `dims`).
        let o = unsafe { std::slice::from_raw_parts_mut(shared.0.add(j * dims), dims) };
        SCORES.with(|s| {
            let mut buf = s.borrow_mut();
            buf.resize(pos + 1, 0.0);
            scores(qj, cache, scale, &mut buf[..]);
            softmax(&mut buf[..]);
            weighted_sum(&buf[..], cache, o);
        });
    });

    // each head's result out of the latent space through its value matrix
    out.clear();
    sized(out, n * heads * vd);
    let mut y = Vec::new();
    for h in 0..heads {
        gather(&mixed[h * n * dims..], dims, 0, r, n, &mut part);
        CpuMatrix::products(&[&layer.v_b[h]], &part, &mut [&mut y])?;
        for i in 0..n {
            out[(i * heads + h) * vd..(i * heads + h + 1) * vd]
                .copy_from_slice(&y[i * vd..(i + 1) * vd]);
        }
    }
    Ok(())
}
