//! A slow, plain reference forward pass of a tiny model, as an oracle for engine tests.
//!
//! It follows the transformers implementation of Llama / Qwen2 on the HF-layout weights of
//! [`TinyModel::weights`], in `f64` with naive loops: token embedding; per layer RMSNorm
//! (`x / sqrt(mean(x²) + eps) * w`), q/k/v projections (+ biases for Qwen2), rotate-half RoPE
//! (`inv_freq[i] = theta^(-2i/head_dim)`, the first and second halves of each head form the
//! pairs), causal grouped-query attention scaled by `1/sqrt(head_dim)`, output projection and
//! residual; RMSNorm, SwiGLU FFN (`down(silu(gate(x)) * up(x))`) and residual; final RMSNorm
//! and the output head (the embedding when tied). For Gemma 3 it follows `Gemma3ForCausalLM`:
//! embeddings times `sqrt(hidden)`, RMSNorm scaling by `(1 + w)`, q/k RMSNorm per head before
//! RoPE, local layers (see [`crate::TinyModelSpec::is_local_layer`]) with their own RoPE base
//! and a sliding window (`t - u < sliding_window`), the attention output and the FFN output
//! each RMSNormed before their residual add, a pre-FFN norm, and `gelu` (tanh approximation)
//! in place of SiLU; scale `1/sqrt(head_dim)`. Qwen3 is Qwen2 without biases and with the
//! q/k RMSNorm per head before RoPE (plain `w` scaling). Llama 3.1 RoPE scaling divides
//! each pair's inverse frequency by its factor ([`crate::Llama3Rope::freq_factors`]). It
//! has been checked against llama.cpp
//! running the GGUF written by [`TinyModel::write_gguf`] (F32 weights, F32 KV cache, no flash
//! attention: logits agree to about 1e-6).

use crate::tiny_model::{Arch, TinyModel, Weight};

/// RMSNorm; `offset` is 1 for Gemma's `(1 + w)` weights, 0 otherwise.
fn rms_norm(x: &[f64], w: &Weight, eps: f64, offset: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let s = 1.0 / (ms + eps).sqrt();
    x.iter()
        .zip(&w.data)
        .map(|(v, g)| v * s * (offset + *g as f64))
        .collect()
}

/// GELU, tanh approximation (`gelu_pytorch_tanh`).
fn gelu_tanh(x: f64) -> f64 {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
}

/// `y = W x (+ b)` for an HF `[out, in]` weight.
fn linear(x: &[f64], w: &Weight, b: Option<&Weight>) -> Vec<f64> {
    let (out, inp) = (w.shape[0], w.shape[1]);
    (0..out)
        .map(|o| {
            let row = &w.data[o * inp..(o + 1) * inp];
            let mut acc: f64 = row.iter().zip(x).map(|(a, b)| *a as f64 * b).sum();
            if let Some(b) = b {
                acc += b.data[o] as f64;
            }
            acc
        })
        .collect()
}

/// Rotate-half RoPE on one head vector at position `pos`; `factors` divide each pair's
/// inverse frequency.
fn rope(v: &mut [f64], pos: usize, theta: f64, factors: Option<&[f32]>) {
    let hd = v.len();
    let half = hd / 2;
    for i in 0..half {
        let f = factors.map_or(1.0, |f| f[i] as f64);
        let inv = theta.powf(-((2 * i) as f64) / hd as f64) / f;
        let (s, c) = (pos as f64 * inv).sin_cos();
        let (a, b) = (v[i], v[i + half]);
        v[i] = a * c - b * s;
        v[i + half] = b * c + a * s;
    }
}

impl TinyModel {
    /// Logits (vocab_size values) at every position of `ids`, from a plain `f64` forward pass
    /// over [`TinyModel::weights`]; see the module docs for the exact semantics.
    ///
    /// Panics if an id is not below `vocab_size` or `ids` is longer than the context.
    pub fn reference_logits(&self, ids: &[u32]) -> Vec<Vec<f32>> {
        self.forward(ids, false)
    }

    /// [`TinyModel::reference_logits`] of an engine that stores its KV cache in f16 (as
    /// llama.cpp does by default, and shoal does): every key (after RoPE) and value is
    /// rounded to f32 and then to the nearest f16 before attention reads it; everything else
    /// stays f64.
    pub fn reference_logits_f16_kv(&self, ids: &[u32]) -> Vec<Vec<f32>> {
        self.forward(ids, true)
    }

    fn forward(&self, ids: &[u32], f16_kv: bool) -> Vec<Vec<f32>> {
        let s = self.spec();
        assert!(
            ids.len() <= s.context_length,
            "sequence longer than context"
        );
        let w = |n: &str| {
            self.weight(n)
                .unwrap_or_else(|| panic!("missing weight {n}"))
        };
        let eps = s.rms_eps as f64;
        let gemma = s.arch == Arch::Gemma3;
        let factors = s
            .llama3_rope
            .map(|r| r.freq_factors(s.rope_theta as f64, s.head_dim));
        let off = if gemma { 1.0 } else { 0.0 };
        let norm = |x: &[f64], name: &str| rms_norm(x, w(name), eps, off);
        let (hd, nh, nkv) = (s.head_dim, s.n_head, s.n_kv_head);
        let group = nh / nkv;
        let emb = w("model.embed_tokens.weight");
        let h = s.hidden_size;
        let mut xs: Vec<Vec<f64>> = ids
            .iter()
            .map(|&t| {
                let t = t as usize;
                assert!(t < s.vocab_size, "token id {t} out of range");
                let scale = if gemma { (h as f64).sqrt() } else { 1.0 };
                emb.data[t * h..(t + 1) * h]
                    .iter()
                    .map(|v| *v as f64 * scale)
                    .collect()
            })
            .collect();
        for l in 0..s.n_layers {
            let p = format!("model.layers.{l}");
            let local = s.is_local_layer(l);
            let theta = if local {
                s.rope_local_theta as f64
            } else {
                s.rope_theta as f64
            };
            let bias = |n: &str| self.weight(&format!("{p}.self_attn.{n}_proj.bias"));
            let mut qs = Vec::new();
            let mut ks = Vec::new();
            let mut vs = Vec::new();
            for (pos, x) in xs.iter().enumerate() {
                let hn = norm(x, &format!("{p}.input_layernorm.weight"));
                let mut q = linear(&hn, w(&format!("{p}.self_attn.q_proj.weight")), bias("q"));
                let mut k = linear(&hn, w(&format!("{p}.self_attn.k_proj.weight")), bias("k"));
                let v = linear(&hn, w(&format!("{p}.self_attn.v_proj.weight")), bias("v"));
                for (v, norm_name) in [(&mut q, "q_norm"), (&mut k, "k_norm")] {
                    for head in v.chunks_mut(hd) {
                        if s.arch.has_qk_norm() {
                            let n = norm(head, &format!("{p}.self_attn.{norm_name}.weight"));
                            head.copy_from_slice(&n);
                        }
                        rope(head, pos, theta, factors.as_deref());
                    }
                }
                let store = |x: Vec<f64>| -> Vec<f64> {
                    if f16_kv {
                        x.iter()
                            .map(|&a| half::f16::from_f32(a as f32).to_f64())
                            .collect()
                    } else {
                        x
                    }
                };
                qs.push(q);
                ks.push(store(k));
                vs.push(store(v));
            }
            let scale = 1.0 / (hd as f64).sqrt();
            for t in 0..xs.len() {
                let mut attn = vec![0.0f64; nh * hd];
                for head in 0..nh {
                    let kvh = head / group;
                    let q = &qs[t][head * hd..(head + 1) * hd];
                    let first = if local {
                        (t + 1).saturating_sub(s.sliding_window)
                    } else {
                        0
                    };
                    let scores: Vec<f64> = (first..=t)
                        .map(|u| {
                            let k = &ks[u][kvh * hd..(kvh + 1) * hd];
                            q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() * scale
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for (i, eu) in e.iter().enumerate() {
                        let v = &vs[first + i][kvh * hd..(kvh + 1) * hd];
                        for d in 0..hd {
                            attn[head * hd + d] += eu / z * v[d];
                        }
                    }
                }
                let mut o = linear(&attn, w(&format!("{p}.self_attn.o_proj.weight")), None);
                if gemma {
                    o = norm(&o, &format!("{p}.post_attention_layernorm.weight"));
                }
                for (x, o) in xs[t].iter_mut().zip(o) {
                    *x += o;
                }
                let ffn_norm = if gemma {
                    "pre_feedforward_layernorm"
                } else {
                    "post_attention_layernorm"
                };
                let hn = norm(&xs[t], &format!("{p}.{ffn_norm}.weight"));
                let g = linear(&hn, w(&format!("{p}.mlp.gate_proj.weight")), None);
                let u = linear(&hn, w(&format!("{p}.mlp.up_proj.weight")), None);
                let act: Vec<f64> = g
                    .iter()
                    .zip(&u)
                    .map(|(g, u)| {
                        if gemma {
                            gelu_tanh(*g) * u
                        } else {
                            g / (1.0 + (-g).exp()) * u
                        }
                    })
                    .collect();
                let mut d = linear(&act, w(&format!("{p}.mlp.down_proj.weight")), None);
                if gemma {
                    d = norm(&d, &format!("{p}.post_feedforward_layernorm.weight"));
                }
                for (x, d) in xs[t].iter_mut().zip(d) {
                    *x += d;
                }
            }
        }
        let head = self
            .weight("lm_head.weight")
            .unwrap_or_else(|| w("model.embed_tokens.weight"));
        xs.iter()
            .map(|x| {
                let hn = norm(x, "model.norm.weight");
                linear(&hn, head, None)
                    .into_iter()
                    .map(|v| v as f32)
                    .collect()
            })
            .collect()
    }
}
