//! A gated feed-forward's gate and up projections held as one matrix, [`GatePair`], whose
//! eight-row tiles alternate: gate rows `8i..8i + 8`, then up rows `8i..8i + 8`. One product
//! of it gives both projections of the same features side by side, so the thread that
//! computed a run of tiles applies the activation to it straight away, from its own cache.
//! With gate and up as two matrices, each thread's share holds gate or up values only, and
//! the activation runs after the parallel loop on one thread, reading the other thread's
//! half across cores. The tiles are the same bytes in another order, so the pair costs no
//! memory and no kernel of its own.

use super::{tiled::TILE_ROWS, KernelError, QuantMatrix, WeightBuffer};
use crate::config::Activation;

/// Gate and up projections interleaved by tile (see the module).
#[derive(Debug, Clone)]
pub struct GatePair {
    m: QuantMatrix,
}

impl GatePair {
    /// The pair of `gate` and `up`, or `None` where they cannot pair: different types,
    /// levels or shapes, a row count that is not a whole number of tiles, or a layout that
    /// is not tiled (the portable kernels, f16 and f32 weights).
    pub fn new(gate: &QuantMatrix, up: &QuantMatrix) -> Option<Self> {
        let same = gate.ty == up.ty
            && gate.isa == up.isa
            && gate.cols == up.cols
            && gate.rows == up.rows
            && gate.tiled
            && up.tiled;
        if !same || gate.rows == 0 || !gate.rows.is_multiple_of(TILE_ROWS) {
            return None;
        }
        // a tile is a contiguous run of bytes in the tiled layout
        let group = gate.data.len() / (gate.rows / TILE_ROWS);
        let mut data = WeightBuffer::zeroed(2 * gate.data.len());
        for ((dst, g), u) in data
            .chunks_exact_mut(2 * group)
            .zip(gate.data.chunks_exact(group))
            .zip(up.data.chunks_exact(group))
        {
            dst[..group].copy_from_slice(g);
            dst[group..].copy_from_slice(u);
        }
        Some(GatePair {
            m: QuantMatrix {
                rows: 2 * gate.rows,
                data,
                ..*gate
            },
        })
    }

    /// Features (rows of gate, and of up).
    #[cfg(test)]
    pub fn features(&self) -> usize {
        self.m.rows / 2
    }

    /// Columns (input features).
    #[cfg(test)]
    pub fn cols(&self) -> usize {
        self.m.cols
    }

    #[cfg(test)]
    /// [`GatePair::gated_products_into`] into a new vector.
    ///
    /// # Errors
    /// When `x` is not a whole number of rows.
    pub fn gated_products(&self, x: &[f32], act: Activation) -> Result<Vec<f32>, KernelError> {
        let mut h = Vec::new();
        self.gated_products_into(x, act, None, &mut h)?;
        Ok(h)
    }

    /// `act(x G^T + b_g) * (x U^T + b_u)` into `h`, the biases `bias = (b_g, b_u)` where
    /// given: `x` holds `t` rows of [`GatePair::cols`] values, `h` becomes `t` rows of
    /// [`GatePair::features`] values (its capacity is kept from call to call). The biases and
    /// the activation run inside the product's parallel loop, each job over the features it
    /// has just computed; the pair's own output goes to a scratch buffer of the calling thread.
    ///
    /// # Errors
    /// When `x` is not a whole number of rows, or a bias is not one value per feature.
    pub fn gated_products_into(
        &self,
        x: &[f32],
        act: Activation,
        bias: Option<(&[f32], &[f32])>,
        h: &mut Vec<f32>,
    ) -> Result<(), KernelError> {
        let (n, cols) = (self.m.rows, self.m.cols);
        if !x.len().is_multiple_of(cols) {
            return Err(KernelError::Shape {
                rows: n,
                cols,
                problem: format!("{} inputs to a gate/up pair", x.len()),
            });
        }
        if let Some((g, u)) = bias {
            if g.len() != n / 2 || u.len() != n / 2 {
                return Err(KernelError::Shape {
                    rows: n,
                    cols,
                    problem: format!(
                        "biases of {} and {} values for {} features",
                        g.len(),
                        u.len(),
                        n / 2
                    ),
                });
            }
        }
        let t = x.len() / cols;
        let half = n / 2;
        h.clear();
        if t == 0 {
            return Ok(());
        }
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        {
            use super::{gated_pairs, OutPtr};
            use std::cell::RefCell;
            use std::ops::Range;
            thread_local! {
                static PAIRS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
            }
            // taken out while the product runs: a thread waiting in its parallel loop may
            // run another product's job, which then finds an empty buffer of its own
            let mut y = PAIRS.with(|p| std::mem::take(&mut *p.borrow_mut()));
            {
                y.clear();
                y.reserve(t * n);
                let yp = OutPtr(y.spare_capacity_mut().as_mut_ptr().cast::<f32>());
                h.reserve(t * half);
                let hp = OutPtr(h.spare_capacity_mut().as_mut_ptr().cast::<f32>());
                let after = |_: usize, tiles: Range<usize>| {
                    let rows = tiles.start * TILE_ROWS..tiles.end * TILE_ROWS;
                    for tok in 0..t {
                        // SAFETY: the job that ran `tiles` has just written these rows of
                        // token `tok` (inside `y`'s t * n capacity) on this thread; `after`
                        // runs over whole tile pairs (`rows` starts on a multiple of 16), so
                        // its features `rows / 2` lie inside `h` (t * half capacity), and no
                        // other job's tiles map to them.
                        let (ys, hs) = unsafe {
                            (
                                std::slice::from_raw_parts(
                                    yp.get().add(tok * n + rows.start),
                                    rows.len(),
                                ),
                                std::slice::from_raw_parts_mut(
                                    hp.get().add(tok * half + rows.start / 2),
                                    rows.len() / 2,
                                ),
                            )
                        };
                        match bias {
                            Some(b) => biased_gated_pairs(act, ys, rows.start / 2, b, hs),
                            None => gated_pairs(act, ys, hs),
                        }
                    }
                };
                QuantMatrix::shared_tiled(&[&self.m], x, t, &[yp], Some(&after));
            }
            PAIRS.with(|p| *p.borrow_mut() = y);
            // SAFETY: `after` ran over every tile pair of the matrix (the jobs cover its
            // tiles), and each run wrote all of its features for every token: all t * half
            // values of `h`.
            unsafe { h.set_len(t * half) };
            Ok(())
        }
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        {
            h.resize(t * half, 0.0);
            let mut y = vec![0f32; t * n];
            self.m.matmul(x, &mut y)?;
            for (ys, hs) in y.chunks_exact(n).zip(h.chunks_exact_mut(half)) {
                match bias {
                    Some(b) => biased_gated_pairs(act, ys, 0, b, hs),
                    None => super::gated_pairs(act, ys, hs),
                }
            }
            Ok(())
        }
    }
}

/// [`super::gated_pairs`] of a pair's products `ys` (whole tile pairs: eight gate values,
/// then the same eight features' up values) with the gate and up biases `(g, u)` added
/// first, into `hs`; the pair's first feature is `first`. `ys` is left as it is.
fn biased_gated_pairs(
    act: Activation,
    ys: &[f32],
    first: usize,
    (g, u): (&[f32], &[f32]),
    hs: &mut [f32],
) {
    let mut pair = [0f32; 2 * TILE_ROWS];
    for (j, (p, h)) in ys
        .chunks_exact(2 * TILE_ROWS)
        .zip(hs.chunks_exact_mut(TILE_ROWS))
        .enumerate()
    {
        let f = first + j * TILE_ROWS;
        for i in 0..TILE_ROWS {
            pair[i] = p[i] + g[f + i];
            pair[TILE_ROWS + i] = p[TILE_ROWS + i] + u[f + i];
        }
        super::gated_pairs(act, &pair, h);
    }
}
