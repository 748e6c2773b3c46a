//! The gated feed-forward's elementwise step, `act(gate) * up`, in one pass over plain
//! slices, split across the pool when long, with the vectorized exponential of
//! `kernels::math`. Through candle (three tensor ops, the C library's scalar `expf`) it took
//! 2.5% of a qwen05 decode step (`shoal bench --profile`), 50 µs per layer for 4,864 values.

use rayon::prelude::*;

use crate::config::Activation;
use crate::kernels;

/// Values per parallel chunk (below this the step runs on the calling thread).
const CHUNK: usize = 4 * 1024;

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
}
