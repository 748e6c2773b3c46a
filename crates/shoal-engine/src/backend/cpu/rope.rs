//! Rotary position embeddings on the CPU: cosine and sine tables for a step's positions,
//! computed the way ggml computes them (in f32, the angle of pair `i` built by repeated
//! multiplication by `base^(-2/head_dim)`, divided by a frequency factor where the model
//! has them, then scaled), so positions match the reference implementation bit for bit
//! where the libm does, YaRN's ramp and magnitude scale included; and the rotation of every
//! head of every row by its row's table.

use crate::backend::{Rope, StepRows};
use crate::config::RopeStyle;

/// What makes two layers' tables the same: base, scale, rotated dimensions, frequency
/// factors (by address) and YaRN's settings (by bits).
pub(crate) type Key = (u64, u64, usize, usize, Option<[u32; 4]>);

/// The key of `rope`'s tables.
pub(crate) fn key(rope: &Rope) -> Key {
    (
        rope.base.to_bits(),
        rope.scale.to_bits(),
        rope.dims,
        rope.freq_factors
            .as_ref()
            .map_or(0, |f| f.as_ptr() as usize),
        rope.yarn
            .map(|y| [y.ext_factor, y.corr_low, y.corr_high, y.mscale].map(f32::to_bits)),
    )
}

/// One kind of layer's table for a step: `(rows, dims / 2)` cosines and sines.
#[derive(Debug, Default)]
struct Table {
    key: Key,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

/// The RoPE tables of one step, made on first use by each kind of layer (a model has at
/// most a few: global, and sliding-window with its own base), kept between steps for
/// their buffers.
#[derive(Debug, Default)]
pub struct RopeTables {
    tables: Vec<Table>,
    used: usize,
}

impl RopeTables {
    /// Forgets the last step's tables (keeps their buffers).
    pub fn reset(&mut self) {
        self.used = 0;
    }

    /// The table of `rope` for `positions`.
    fn get(&mut self, rope: &Rope, positions: &[usize]) -> &Table {
        let key = key(rope);
        if let Some(i) = self.tables[..self.used].iter().position(|t| t.key == key) {
            return &self.tables[i];
        }
        if self.used == self.tables.len() {
            self.tables.push(Table::default());
        }
        let t = &mut self.tables[self.used];
        self.used += 1;
        t.key = key;
        fill(rope, positions, &mut t.cos, &mut t.sin);
        t
    }
}

/// Cosines and sines of `rope` at `positions`, `(positions, dims / 2)`: pair `i`'s
/// angle interpolated by the scale, or with YaRN mixed with the extrapolated angle by a
/// ramp over the pairs, and both scaled by YaRN's magnitude.
pub(crate) fn fill(rope: &Rope, positions: &[usize], cos: &mut Vec<f32>, sin: &mut Vec<f32>) {
    let half = rope.dims / 2;
    let theta_scale = (rope.base as f32).powf(-2.0 / rope.dims as f32);
    let freq_scale = (1.0 / rope.scale) as f32;
    cos.clear();
    sin.clear();
    for &p in positions {
        let mut theta = p as f32;
        for i in 0..half {
            let extrapolated = match &rope.freq_factors {
                Some(f) => theta / f[i],
                None => theta,
            };
            let interpolated = freq_scale * extrapolated;
            let (a, m) = match &rope.yarn {
                Some(y) => {
                    let ramp = (i as f32 - y.corr_low) / (y.corr_high - y.corr_low).max(0.001);
                    let mix = (1.0 - ramp.clamp(0.0, 1.0)) * y.ext_factor;
                    (interpolated * (1.0 - mix) + extrapolated * mix, y.mscale)
                }
                None => (interpolated, 1.0),
            };
            cos.push(a.cos() * m);
            sin.push(a.sin() * m);
            theta *= theta_scale;
        }
    }
}

/// Rotates every head of every row of `x` (rows laid out `(heads, head_dim)`) by its row's
/// position: the head's first `dims` values, the rest left as they are.
pub fn rotate(x: &mut [f32], rope: &Rope, rows: &StepRows, tables: &mut RopeTables) {
    let n = rows.len();
    if n == 0 || x.is_empty() {
        return;
    }
    let table = tables.get(rope, &rows.positions);
    let (hd, half) = (rope.head_dim, rope.dims / 2);
    let per_row = x.len() / n;
    for (r, row) in x.chunks_exact_mut(per_row).enumerate() {
        let (c, s) = (
            &table.cos[r * half..(r + 1) * half],
            &table.sin[r * half..(r + 1) * half],
        );
        for head in row.chunks_exact_mut(hd) {
            let head = &mut head[..2 * half];
            match rope.style {
                RopeStyle::Interleaved => {
                    for (i, pair) in head.chunks_exact_mut(2).enumerate() {
                        let (a, b) = (pair[0], pair[1]);
                        pair[0] = a * c[i] - b * s[i];
                        pair[1] = a * s[i] + b * c[i];
                    }
                }
                RopeStyle::Halves => {
                    let (lo, hi) = head.split_at_mut(half);
                    for i in 0..half {
                        let (a, b) = (lo[i], hi[i]);
                        lo[i] = a * c[i] - b * s[i];
                        hi[i] = a * s[i] + b * c[i];
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn rope(style: RopeStyle, factors: Option<Vec<f32>>) -> Rope {
        Rope {
            style,
            head_dim: 8,
            dims: 8,
            base: 10_000.0,
            scale: 1.0,
            freq_factors: factors.map(Arc::from),
            yarn: None,
        }
    }

    #[test]
    fn position_zero_is_identity() {
        let mut tables = RopeTables::default();
        let rows = StepRows::new(&[1], &[0]);
        let x: Vec<f32> = (0..16).map(|i| i as f32 - 3.5).collect();
        for style in [RopeStyle::Interleaved, RopeStyle::Halves] {
            let mut y = x.clone();
            tables.reset();
            rotate(&mut y, &rope(style, None), &rows, &mut tables);
            assert_eq!(y, x);
        }
    }

    #[test]
    fn rotation_keeps_pair_norms_and_follows_each_rows_position() {
        // two sequences: positions 5, 6 and 2
        let rows = StepRows::new(&[2, 1], &[5, 2]);
        let x: Vec<f32> = (0..3 * 8).map(|i| (i as f32 * 0.37).sin()).collect();
        for style in [RopeStyle::Interleaved, RopeStyle::Halves] {
            let r = rope(style, Some(vec![1.0, 2.0, 8.0, 8.0]));
            let mut y = x.clone();
            let mut tables = RopeTables::default();
            rotate(&mut y, &r, &rows, &mut tables);
            let pairs = |v: &[f32]| -> Vec<(f32, f32)> {
                match style {
                    RopeStyle::Interleaved => v.chunks(2).map(|p| (p[0], p[1])).collect(),
                    RopeStyle::Halves => (0..4).map(|i| (v[i], v[i + 4])).collect(),
                }
            };
            for row in 0..3 {
                let pos = rows.positions[row] as f64;
                let (a, b) = (
                    pairs(&x[row * 8..row * 8 + 8]),
                    pairs(&y[row * 8..row * 8 + 8]),
                );
                for (i, ((x0, x1), (y0, y1))) in a.iter().zip(&b).enumerate() {
                    let f = [1.0, 2.0, 8.0, 8.0][i];
                    let angle = pos * 10_000f64.powf(-2.0 * i as f64 / 8.0) / f;
                    let (c, s) = (angle.cos(), angle.sin());
                    let want0 = *x0 as f64 * c - *x1 as f64 * s;
                    let want1 = *x0 as f64 * s + *x1 as f64 * c;
                    assert!((*y0 as f64 - want0).abs() < 1e-5, "{style:?} {row} {i}");
                    assert!((*y1 as f64 - want1).abs() < 1e-5, "{style:?} {row} {i}");
                }
            }
        }
    }

    #[test]
    fn a_partial_rotation_turns_the_first_dims_as_a_head_of_that_size_and_keeps_the_rest() {
        let rows = StepRows::new(&[2], &[3]);
        for style in [RopeStyle::Interleaved, RopeStyle::Halves] {
            // heads of 12 with their first 8 rotated, against heads of 8 rotated whole
            let x: Vec<f32> = (0..2 * 2 * 12).map(|i| (i as f32 * 0.61).cos()).collect();
            let mut partial = x.clone();
            let r = Rope {
                head_dim: 12,
                dims: 8,
                ..rope(style, None)
            };
            rotate(&mut partial, &r, &rows, &mut RopeTables::default());
            let mut firsts: Vec<f32> = x.chunks(12).flat_map(|h| h[..8].to_vec()).collect();
            rotate(
                &mut firsts,
                &rope(style, None),
                &rows,
                &mut RopeTables::default(),
            );
            for (h, (got, want)) in partial.chunks(12).zip(firsts.chunks(8)).enumerate() {
                assert_eq!(&got[..8], want, "{style:?} head {h}");
                assert_eq!(&got[8..], &x[h * 12 + 8..h * 12 + 12], "{style:?} head {h}");
            }
        }
    }

    #[test]
    fn yarn_mixes_interpolation_and_extrapolation_by_the_ramp() {
        use crate::backend::YarnRope;
        use crate::config::YarnConfig;
        let cfg = YarnConfig {
            original_context: 64,
            ext_factor: 1.0,
            attn_factor: 0.9,
            beta_fast: 32.0,
            beta_slow: 1.0,
            log_mul: 0.0,
        };
        let (dims, base, scale) = (16usize, 10_000.0f64, 8.0f64);
        let yarn = YarnRope::new(&cfg, dims, base, scale);
        // the ramp runs over some pairs, not all or none
        assert!(yarn.corr_low >= 0.0 && yarn.corr_high <= (dims - 1) as f32);
        assert!(yarn.corr_low < yarn.corr_high, "{yarn:?}");
        let r = Rope {
            style: RopeStyle::Interleaved,
            head_dim: dims,
            dims,
            base,
            scale,
            freq_factors: None,
            yarn: Some(yarn),
        };
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        fill(&r, &[0, 5, 300], &mut cos, &mut sin);
        let mscale = 0.9 * (1.0 + 0.1 * scale.ln());
        for (row, pos) in [0usize, 5, 300].into_iter().enumerate() {
            for i in 0..dims / 2 {
                let extrap = pos as f64 * base.powf(-2.0 * i as f64 / dims as f64);
                let interp = extrap / scale;
                let y = (i as f64 - f64::from(yarn.corr_low))
                    / f64::from(yarn.corr_high - yarn.corr_low).max(0.001);
                let mix = 1.0 - y.clamp(0.0, 1.0);
                let angle = interp * (1.0 - mix) + extrap * mix;
                let at = row * dims / 2 + i;
                let tol = 1e-4 * (1.0 + angle.abs());
                assert!(
                    (f64::from(cos[at]) - angle.cos() * mscale).abs() < tol,
                    "{pos} {i}"
                );
                assert!(
                    (f64::from(sin[at]) - angle.sin() * mscale).abs() < tol,
                    "{pos} {i}"
                );
            }
        }
        // the first pairs extrapolate (rotate as without scaling), the last interpolate
        let plain = |i: usize| 300.0 * base.powf(-2.0 * i as f64 / dims as f64);
        assert!((f64::from(cos[2 * dims / 2]) / mscale - plain(0).cos()).abs() < 1e-3);
        let last = dims / 2 - 1;
        let want = (plain(last) / scale).cos();
        assert!((f64::from(cos[2 * dims / 2 + last]) / mscale - want).abs() < 1e-3);
    }
}
