//! Multi-head latent attention (DeepSeek V2/V3) on the GPU, in the absorbed form the CPU
//! backend uses (`backend/cpu/latent.rs`): the cache holds one latent per position (the
//! normed key/value compression and the rotated rope key, f16); each head's query is taken
//! into the latent space by its key matrix, attends over the latents as one shared head
//! (`shaders/latent.wgsl`), and comes back out through its value matrix. The parts of rows
//! are taken out and put into place by one strided copy (`shaders/copy_cols.wgsl`).

use super::context::Bind;
use super::{Gpu, GpuAct, GpuKv, GpuTables};
use crate::backend::{Backend, LatentLayer, Rope, StepRows};
use crate::EngineError;

/// Most values a latent may have (the attention kernel's shared query).
pub(super) const MAX_DIMS: usize = 1024;

/// A strided copy of columns (see `shaders/copy_cols.wgsl`).
struct Cols {
    rows: usize,
    width: usize,
    /// Values per input row, and the first column taken.
    si: usize,
    from: usize,
    /// Values per output row, and the column the part goes to.
    so: usize,
    at: usize,
    /// The first input and output rows.
    row0_in: usize,
    row0_out: usize,
}

impl Gpu {
    fn copy_cols(&self, x: &GpuAct, c: Cols, out: &GpuAct) {
        let pipe = self.kernel(
            "copy_cols",
            "copy_cols",
            include_str!("shaders/copy_cols.wgsl"),
        );
        let rows = c.rows as u32;
        self.ctx.dispatch(
            &pipe,
            &[
                rows,
                c.width as u32,
                c.si as u32,
                c.from as u32,
                c.so as u32,
                c.at as u32,
                c.row0_in as u32,
                c.row0_out as u32,
            ],
            &[Bind::Whole(x.buf()), Bind::Whole(out.buf())],
            [
                (c.width as u32).div_ceil(64),
                rows.min(32768),
                rows.div_ceil(32768),
            ],
        );
    }

    /// See [`Backend::latent_attention`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attend_latent(
        &self,
        q: &GpuAct,
        kv_a: &GpuAct,
        layer: &LatentLayer<Gpu>,
        kv: &mut [&mut GpuKv],
        cache_layer: usize,
        rows: &StepRows,
        tables: &mut GpuTables,
        out: &mut GpuAct,
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
            || q.len != n * heads * qw
            || kv_a.len != n * dims
            || layer.k_b.len() != heads
            || layer.v_b.len() != heads
            || dims > MAX_DIMS
            || !dims.is_multiple_of(2)
        {
            return Err(EngineError::Internal {
                what: format!(
                    "GPU latent attention over {n} rows of {} sequences with {} caches, {} query \
                     and {} latent values, {heads} heads of {qw}, latents of {dims}",
                    rows.seqs.len(),
                    kv.len(),
                    q.len,
                    kv_a.len,
                ),
            });
        }
        let rope = Rope {
            head_dim: rd,
            dims: rd,
            ..layer.rope.clone()
        };
        let cols = |rows, width, si, from, so, at| Cols {
            rows,
            width,
            si,
            from,
            so,
            at,
            row0_in: 0,
            row0_out: 0,
        };
        let mut s = [(); 6].map(|()| self.scratch());
        let [comp, normed, pe, latents, part, small] = &mut s;
        let result = (|| {
            // the step's latents: the compression normed, the rope key rotated
            comp.resize(&self.ctx, n * r);
            self.copy_cols(kv_a, cols(n, r, dims, 0, r, 0), comp);
            self.rms_norm(comp, &layer.kv_norm, layer.eps, normed);
            pe.resize(&self.ctx, n * rd);
            self.copy_cols(kv_a, cols(n, rd, dims, r, rd, 0), pe);
            self.rope(pe, &rope, rows, tables);
            latents.resize(&self.ctx, n * dims);
            self.copy_cols(normed, cols(n, r, r, 0, dims, 0), latents);
            self.copy_cols(pe, cols(n, rd, rd, 0, dims, r), latents);
            let write = self.kernel(
                "write_latent",
                "write_latent",
                include_str!("shaders/latent_write.wgsl"),
            );
            for (sq, cache) in rows.seqs.iter().zip(kv.iter()) {
                let count = sq.rows.len();
                if sq.start + count > cache.capacity {
                    return Err(EngineError::InvalidInput {
                        what: format!(
                            "the KV cache holds {} positions; {count} more after {} do not fit",
                            cache.capacity, sq.start
                        ),
                    });
                }
                let (buf, _) =
                    cache
                        .layers
                        .get(cache_layer)
                        .ok_or_else(|| EngineError::Internal {
                            what: format!("no cache for layer {cache_layer}"),
                        })?;
                self.ctx.dispatch(
                    &write,
                    &[
                        dims as u32,
                        count as u32,
                        sq.rows.start as u32,
                        sq.start as u32,
                    ],
                    &[Bind::Whole(latents.buf()), Bind::Whole(buf)],
                    [((dims / 2) as u32).div_ceil(64), count as u32, 1],
                );
            }

            // the queries in the latent space: row h * n + i is [k_b q_nope, rotated q_pe]
            // of head h of row i
            let q_pe = &mut *pe;
            q_pe.resize(&self.ctx, n * heads * rd);
            self.copy_cols(q, cols(n * heads, rd, qw, nd, rd, 0), q_pe);
            self.rope(q_pe, &rope, rows, tables);
            let mut queries = self.scratch();
            queries.resize(&self.ctx, heads * n * dims);
            for h in 0..heads {
                part.resize(&self.ctx, n * nd);
                self.copy_cols(q, cols(n, nd, heads * qw, h * qw, nd, 0), part);
                layer.k_b[h].matmul(&self.ctx, part, small)?;
                self.copy_cols(
                    small,
                    Cols {
                        row0_out: h * n,
                        ..cols(n, r, r, 0, dims, 0)
                    },
                    &queries,
                );
                self.copy_cols(
                    q_pe,
                    Cols {
                        row0_out: h * n,
                        ..cols(n, rd, heads * rd, h * rd, dims, r)
                    },
                    &queries,
                );
            }

            // attention of every (head, row) over its sequence's latents
            let attend = self.kernel(
                "latent_attend",
                "latent_attend",
                include_str!("shaders/latent.wgsl"),
            );
            // (the step's latents are in the cache now: their buffer takes the results)
            let mixed = &mut *latents;
            mixed.resize(&self.ctx, heads * n * dims);
            for (sq, cache) in rows.seqs.iter().zip(kv.iter()) {
                let (buf, _) = &cache.layers[cache_layer];
                self.ctx.dispatch(
                    &attend,
                    &[
                        dims as u32,
                        n as u32,
                        sq.rows.start as u32,
                        sq.start as u32,
                        layer.scale.to_bits(),
                    ],
                    &[
                        Bind::Whole(queries.buf()),
                        Bind::Whole(buf),
                        Bind::Whole(mixed.buf()),
                    ],
                    [sq.rows.len() as u32, heads as u32, 1],
                );
            }
            self.give_back([queries]);

            // each head's result out of the latent space through its value matrix
            out.resize(&self.ctx, n * heads * vd);
            for h in 0..heads {
                part.resize(&self.ctx, n * r);
                self.copy_cols(
                    mixed,
                    Cols {
                        row0_in: h * n,
                        ..cols(n, r, dims, 0, r, 0)
                    },
                    part,
                );
                layer.v_b[h].matmul(&self.ctx, part, small)?;
                self.copy_cols(small, cols(n, vd, vd, 0, heads * vd, h * vd), out);
            }
            Ok(())
        })();
        self.give_back(s);
        result
    }
}
