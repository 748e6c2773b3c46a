//! The CPU backend's elementwise steps on plain slices: RMS norms (the mean of squares
//! summed in eight lanes, so it vectorizes), residual adds, and the gated feed-forward's
//! `act(gate) * up` with the vectorized exponential of `kernels::math`. Long inputs are
//! split across the pool.

use rayon::prelude::*;

use crate::backend::cpu::kernels;
use crate::config::Activation;

/// Values per parallel chunk of the gated step (below this it runs on the calling thread).
const CHUNK: usize = 4 * 1024;

/// Values from which a norm's rows are split across the pool.
const NORM_PARALLEL: usize = 64 * 1024;

/// The root mean square of `row` plus `eps`, as an RMS norm divides by it.
fn rms(row: &[f32], eps: f32) -> f32 {
    let mut lanes = [0f32; 8];
    let mut chunks = row.chunks_exact(8);
    for c in &mut chunks {
        for (l, v) in lanes.iter_mut().zip(c) {
            *l += v * v;
        }
    }
    let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
    let sum2 = lanes.iter().sum::<f32>() + tail;
    (sum2 / row.len() as f32 + eps).sqrt()
}

/// Every row of `xs` (rows as long as `w`) normalised into `out` (the same length).
pub fn rms_norm(xs: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    let row = |src: &[f32], dst: &mut [f32]| {
        let m = rms(src, eps);
        for ((d, s), w) in dst.iter_mut().zip(src).zip(w) {
            *d = *s / m * *w;
        }
    };
    if xs.len() >= NORM_PARALLEL {
        xs.par_chunks(n)
            .zip(out.par_chunks_mut(n))
            .for_each(|(s, d)| row(s, d));
    } else {
        for (s, d) in xs.chunks(n).zip(out.chunks_mut(n)) {
            row(s, d);
        }
    }
}

/// [`rms_norm`] in place.
pub fn rms_norm_in_place(xs: &mut [f32], w: &[f32], eps: f32) {
    let n = w.len();
    let row = |x: &mut [f32]| {
        let m = rms(x, eps);
        for (x, w) in x.iter_mut().zip(w) {
            *x = *x / m * *w;
        }
    };
    if xs.len() >= NORM_PARALLEL {
        xs.par_chunks_mut(n).for_each(row);
    } else {
        xs.chunks_mut(n).for_each(row);
    }
}

/// `x += a`.
pub fn add(x: &mut [f32], a: &[f32]) {
    for (x, a) in x.iter_mut().zip(a) {
        *x += a;
    }
}

/// `x += w * a`.
pub fn add_scaled(x: &mut [f32], a: &[f32], w: f32) {
    for (x, a) in x.iter_mut().zip(a) {
        *x += w * a;
    }
}

/// `out[i] = act(gate[i]) * up[i]`.
///
/// # Panics
/// When the slices differ in length.
pub fn gated(act: Activation, gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(
        gate.len() == up.len() && up.len() == out.len(),
        "gated activation: slices of {}, {} and {} values",
        gate.len(),
        up.len(),
        out.len()
    );
    let run = |g: &[f32], u: &[f32], o: &mut [f32]| kernels::gated(act, g, u, o);
    if out.len() <= CHUNK {
        run(gate, up, out);
    } else {
        out.par_chunks_mut(CHUNK)
            .zip(gate.par_chunks(CHUNK).zip(up.par_chunks(CHUNK)))
            .for_each(|(o, (g, u))| run(g, u, o));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    /// The values candle's ops give, to a few units in the last place of the larger of the
    /// value and 1, over a range that covers both tails (where candle's GELU loses digits
    /// to cancellation and ours does not).
    #[test]
    fn matches_candle() {
        let n = 40_000;
        let g: Vec<f32> = (0..n).map(|i| (i as f32 - n as f32 / 2.0) * 7e-4).collect();
        let u: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 1000) as f32 / 300.0 - 1.5)
            .collect();
        let gt = Tensor::from_vec(g.clone(), n, &Device::Cpu).unwrap();
        let ut = Tensor::from_vec(u.clone(), n, &Device::Cpu).unwrap();
        for act in [Activation::Silu, Activation::GeluTanh] {
            let want: Vec<f32> = match act {
                Activation::Silu => candle_nn::ops::silu(&gt).unwrap(),
                Activation::GeluTanh => gt.gelu().unwrap(),
                Activation::SwigluOai => unreachable!("checked on its own below"),
            }
            .mul(&ut)
            .unwrap()
            .to_vec1()
            .unwrap();
            let mut got = vec![0f32; n];
            gated(act, &g, &u, &mut got);
            let worst = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs() / b.abs().max(1.0))
                .fold(0f32, f32::max);
            assert!(worst < 2e-6, "{act:?}: relative difference {worst}");
        }
    }

    /// gpt-oss's clamped SwiGLU against its formula in f64, across both clamps.
    #[test]
    fn swiglu_oai_clamps_gate_above_and_up_on_both_sides() {
        let g: Vec<f32> = (0..400).map(|i| (i as f32 - 200.0) * 0.06).collect();
        let u: Vec<f32> = (0..400).map(|i| (i as f32 - 150.0) * -0.05).collect();
        let mut got = vec![0f32; g.len()];
        gated(Activation::SwigluOai, &g, &u, &mut got);
        for ((&g, &u), &got) in g.iter().zip(&u).zip(&got) {
            let c = f64::from(g).min(7.0);
            let want = c / (1.0 + (-1.702 * c).exp()) * (f64::from(u).clamp(-7.0, 7.0) + 1.0);
            assert!(
                (f64::from(got) - want).abs() <= 2e-6 * want.abs().max(1.0),
                "g {g} u {u}: {got} against {want}"
            );
        }
    }
}
