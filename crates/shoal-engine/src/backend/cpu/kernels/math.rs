//! Elementwise math written so loops over it vectorize: an exponential without calls or
//! branches, the activations built on it, and a softmax. Each is `#[inline(always)]`, so the
//! `x86` wrappers compiled for AVX2 get 8-wide code from the same source, and the portable
//! callers get what the baseline target allows. The C library's `expf` is a scalar call per
//! value, which keeps any loop around it from vectorizing.

use crate::config::Activation;

/// `e^x` to within 2 units in the last place, without calls or branches so loops over it
/// vectorize: `x = n ln 2 + r` with `|r| <= ln 2 / 2`, Cephes' degree-6 polynomial for
/// `e^r`, and `2^n` built in the exponent bits. Inputs are clamped to where `e^x` is a
/// normal f32 (below about -87.3 the result is about 2^-126 rather than a denormal or 0).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer in any SIMD width
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.3, 88.3);
    let m = x * LOG2E + ROUND;
    let n = m - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let er = p * r * r + r + 1.0;
    // m's low mantissa bits hold 2^22 + n: adding the bias and shifting the rest out leaves
    // the exponent field of 2^n (integer ops only, which vectorize everywhere)
    er * f32::from_bits(m.to_bits().wrapping_add(127) << 23)
}

/// SiLU, `x * sigmoid(x)`.
#[inline(always)]
fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// GELU with the tanh approximation, `x (1 + tanh y) / 2` with `y = sqrt(2/pi) (x +
/// 0.044715 x^3)`, computed as `x / (1 + e^{-2y})` (the same function; no cancellation
/// where `tanh y` is near -1).
#[inline(always)]
fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let y = SQRT_2_OVER_PI * x * (1.0 + 0.044_715 * x * x);
    x / (1.0 + exp(-2.0 * y))
}

/// `out[i] = act(gate[i]) * up[i]` over equally long slices.
#[inline(always)]
pub fn gated(act: Activation, gate: &[f32], up: &[f32], out: &mut [f32]) {
    match act {
        Activation::Silu => {
            for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                *o = silu(g) * u;
            }
        }
        Activation::GeluTanh => {
            for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                *o = gelu_tanh(g) * u;
            }
        }
        Activation::SwigluOai => {
            for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                *o = swiglu_oai(g, u);
            }
        }
    }
}

/// gpt-oss's clamped SwiGLU of one gate and up value (ggml's `swiglu_oai` with the alpha
/// and limit llama.cpp's graph gives it).
#[inline(always)]
fn swiglu_oai(g: f32, u: f32) -> f32 {
    const ALPHA: f32 = 1.702;
    const LIMIT: f32 = 7.0;
    let g = g.min(LIMIT);
    let u = u.clamp(-LIMIT, LIMIT);
    g / (1.0 + exp(-ALPHA * g)) * (u + 1.0)
}

/// Softmax in place: `x[i] = e^(x[i] - max) / sum`.
#[inline(always)]
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    // eight partial sums, so the adds vectorize (a single running sum is a serial chain)
    let mut sums = [0f32; 8];
    let mut chunks = x.chunks_exact_mut(8);
    for c in &mut chunks {
        for (s, v) in sums.iter_mut().zip(c.iter_mut()) {
            *v = exp(*v - max);
            *s += *v;
        }
    }
    for (s, v) in sums.iter_mut().zip(chunks.into_remainder()) {
        *v = exp(*v - max);
        *s += *v;
    }
    let sum: f32 = sums.iter().sum();
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// `out[i] = e^((logits[i] - max) * inv_temp)` for finite logits and 0 for the rest (a
/// masked token can never be drawn); returns the sum of `out`.
#[inline(always)]
pub fn softmax_weights(logits: &[f32], max: f32, inv_temp: f32, out: &mut [f32]) -> f32 {
    let mut sums = [0f32; 8];
    for (lc, oc) in logits.chunks(8).zip(out.chunks_mut(8)) {
        for ((s, o), &l) in sums.iter_mut().zip(oc.iter_mut()).zip(lc) {
            let e = exp((l - max) * inv_temp);
            *o = if l.is_finite() { e } else { 0.0 };
            *s += *o;
        }
    }
    sums.iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            worst = worst.max((got - want).abs() / want);
            x += 0.0137;
        }
        assert!(worst < 2.5e-7, "relative error {worst}");
        assert!(exp(-1000.0) > 0.0 && exp(-1000.0) < 1e-37);
        assert!(exp(1000.0).is_finite());
    }

    #[test]
    fn softmax_matches_f64() {
        for n in [1usize, 7, 8, 9, 33, 200] {
            let x: Vec<f32> = (0..n).map(|i| ((i * 37 % 17) as f32 - 8.0) * 1.3).collect();
            let mut got = x.clone();
            softmax(&mut got);
            let m = x
                .iter()
                .cloned()
                .fold(f64::NEG_INFINITY, |a, b| a.max(b as f64));
            let e: Vec<f64> = x.iter().map(|&v| (v as f64 - m).exp()).collect();
            let s: f64 = e.iter().sum();
            for (g, w) in got.iter().zip(&e) {
                assert!((*g as f64 - w / s).abs() < 1e-6, "n {n}: {g} vs {}", w / s);
            }
        }
    }
}
