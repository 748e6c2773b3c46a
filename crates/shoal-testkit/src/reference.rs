//! A slow, plain reference forward pass of a tiny model, as an oracle for engine tests.
//!
//! For the dense architectures it follows the transformers implementation of Llama / Qwen2
//! on the HF-layout weights of [`TinyModel::weights`], in `f64` with naive loops: token
//! embedding; per layer RMSNorm
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
//! q/k RMSNorm per head before RoPE (plain `w` scaling). GLM-4.5 (`glm4moe`) is Qwen2's
//! biased attention with Qwen3's q/k norms, its rotate-half RoPE on the first `rope_dims`
//! dimensions of each head only (`inv_freq[i] = theta^(-2i/rope_dims)`), and DeepSeek V3's
//! routing below; its prediction layer runs only in [`TinyModel::reference_mtp_logits`]. gpt-oss is Qwen2's biased attention plus
//! an output bias, a sink logit per head in each softmax, its even layers attending only
//! within the sliding window, rotate-half RoPE with YaRN ([`crate::YarnRope::angle`], both
//! q and k scaled by `1 + 0.1 ln(factor)` as ggml scales the cosine and sine) on every layer,
//! and its own experts (below). Llama 3.1 RoPE scaling divides
//! each pair's inverse frequency by its factor ([`crate::Llama3Rope::freq_factors`]). It
//! has been checked against llama.cpp
//! running the GGUF written by [`TinyModel::write_gguf`] (F32 weights, F32 KV cache, no flash
//! attention: logits agree to about 1e-6).
//!
//! Mixture-of-experts layers follow llama.cpp's `build_moe_ffn` on the GGUF's settings: the
//! router's logits over the FFN-normed input, the experts and weights [`crate::route`]
//! chooses, each chosen expert's SwiGLU FFN (`down_e(silu(gate_e(x)) * up_e(x))`) times its
//! weight, summed, plus DeepSeek's shared experts (one SwiGLU FFN, unweighted); DeepSeek's
//! first `leading_dense` layers keep a dense FFN. Qwen3 MoE keeps Qwen3's attention and
//! Mixtral Llama's. gpt-oss's router has a bias, and each expert is
//! `down(swiglu_oai(gate(x) + b_g, up(x) + b_u)) + b_d` with `swiglu_oai(g, u) = min(g, 7)
//! sigmoid(1.702 min(g, 7)) (clamp(u, -7, 7) + 1)` (llama.cpp's constants).
//!
//! DeepSeek's multi-head latent attention follows llama.cpp's `deepseek2` graph: the query is
//! `attn_q` of the normed input, or `attn_q_b(rmsnorm(attn_q_a(x)))` with a query rank; each
//! head's last `rope_dim` dimensions are rotated. `attn_kv_a_mqa` gives the latent (its
//! first `kv_lora_rank` values, RMS-normed by `attn_kv_a_norm`) and one rotated key part
//! shared by every head (the remaining `rope_dim`). RoPE rotates adjacent pairs `(2i, 2i +
//! 1)` (llama.cpp's `LLAMA_ROPE_TYPE_NORM` for `deepseek2`; Hugging Face's DeepSeek code
//! de-interleaves q and k before rotating halves, which is the same thing on the same
//! weights), at `pos * theta^(-2i/rope_dim)`, or at [`crate::YarnRope::angle`] with YaRN. The
//! reference computes the expanded form (Hugging Face's): per head, keys `[k_b[h]ᵀ c,
//! k_pe]` and values `v_b[h] c` from the latent `c`, scores `q · k` times `1/sqrt(nope_dim +
//! rope_dim)` (times [`crate::YarnRope::attention_factor`] with YaRN), softmax, and `o_proj`
//! of the heads' weighted values. llama.cpp computes the absorbed form (`k_b[h] q_nope`
//! against the latent, `v_b` applied after the weighted sum of latents), which is the same
//! arithmetic regrouped.

use crate::moe::{route, route_margin, route_scale_margin, MlaSpec, MoeNames, MoeSpec, YarnRope};
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

/// Rotate-half RoPE on one head vector at position `pos`: pair `(i, i + half)` turns by
/// `pos * theta^(-2i/len)` divided by `factors[i]` where given, or with YaRN (gpt-oss, llama.cpp's
/// NeoX rotation) by [`YarnRope::angle`], both values then scaled by `1 + 0.1 ln(factor)` (the
/// magnitude ggml's `rope_yarn` gives the cosine and sine).
fn rope(v: &mut [f64], pos: usize, theta: f64, factors: Option<&[f32]>, yarn: Option<&YarnRope>) {
    let hd = v.len();
    let half = hd / 2;
    let m = yarn.map_or(1.0, |y| 1.0 + 0.1 * f64::from(y.factor).ln());
    for i in 0..half {
        let angle = match yarn {
            Some(y) => y.angle(pos, i, hd, theta),
            None => {
                let f = factors.map_or(1.0, |f| f[i] as f64);
                pos as f64 * theta.powf(-((2 * i) as f64) / hd as f64) / f
            }
        };
        let (s, c) = angle.sin_cos();
        let (a, b) = (v[i], v[i + half]);
        v[i] = (a * c - b * s) * m;
        v[i + half] = (b * c + a * s) * m;
    }
}

/// Rotates adjacent pairs `(v[2i], v[2i + 1])` of `v` for position `pos`: by `pos *
/// theta^(-2i/len)`, or by YaRN's angle for that pair.
fn rope_adjacent(v: &mut [f64], pos: usize, theta: f64, yarn: Option<&YarnRope>) {
    let n = v.len();
    for i in 0..n / 2 {
        let angle = match yarn {
            Some(y) => y.angle(pos, i, n, theta),
            None => pos as f64 * theta.powf(-((2 * i) as f64) / n as f64),
        };
        let (s, c) = angle.sin_cos();
        let (a, b) = (v[2 * i], v[2 * i + 1]);
        v[2 * i] = a * c - b * s;
        v[2 * i + 1] = b * c + a * s;
    }
}

/// What a forward pass records of its routing, per position: the smallest margins (plain
/// and under a common scale of the router's logits) and the experts of each MoE layer.
struct Probe {
    margins: Vec<[f64; 2]>,
    routes: Vec<Vec<Vec<usize>>>,
}

impl Probe {
    fn new(positions: usize) -> Self {
        Probe {
            margins: vec![[f64::INFINITY; 2]; positions],
            routes: vec![Vec::new(); positions],
        }
    }
}

/// Softmax of attention scores.
fn softmax(scores: &[f64]) -> Vec<f64> {
    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
    let z: f64 = e.iter().sum();
    e.iter().map(|e| e / z).collect()
}

/// Softmax of attention scores with a sink logit: `sink` joins the softmax and its weight is
/// dropped (gpt-oss).
fn softmax_with_sink(scores: &[f64], sink: f64) -> Vec<f64> {
    let m = scores.iter().cloned().fold(sink, f64::max);
    let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
    let z: f64 = e.iter().sum::<f64>() + (sink - m).exp();
    e.iter().map(|e| e / z).collect()
}

/// gpt-oss's expert: `down(swiglu_oai(gate(x) + b_g, up(x) + b_u)) + b_d`, with
/// `swiglu_oai(g, u) = min(g, 7) sigmoid(1.702 min(g, 7)) (clamp(u, -7, 7) + 1)`.
fn swiglu_oai_expert(x: &[f64], w: [&Weight; 3], b: [&Weight; 3]) -> Vec<f64> {
    let g = linear(x, w[0], Some(b[0]));
    let u = linear(x, w[1], Some(b[1]));
    let act: Vec<f64> = g
        .iter()
        .zip(&u)
        .map(|(&g, &u)| {
            let c = g.min(7.0);
            c / (1.0 + (-1.702 * c).exp()) * (u.clamp(-7.0, 7.0) + 1.0)
        })
        .collect();
    linear(&act, w[2], Some(b[2]))
}

/// `down(act(gate(x)) * up(x))` with `act` SiLU, or GELU (tanh) when `gelu`.
fn swiglu(x: &[f64], gate: &Weight, up: &Weight, down: &Weight, gelu: bool) -> Vec<f64> {
    let g = linear(x, gate, None);
    let u = linear(x, up, None);
    let act: Vec<f64> = g
        .iter()
        .zip(&u)
        .map(|(g, u)| {
            if gelu {
                gelu_tanh(*g) * u
            } else {
                g / (1.0 + (-g).exp()) * u
            }
        })
        .collect();
    linear(&act, down, None)
}

/// Expert `e`'s matrix of a stacked `[n_expert, out, in]` weight.
fn expert(w: &Weight, e: usize) -> Weight {
    let size = w.shape[1] * w.shape[2];
    Weight {
        shape: w.shape[1..].to_vec(),
        data: w.data[e * size..(e + 1) * size].to_vec(),
    }
}

/// Expert `e`'s row of a stacked `[n_expert, n]` bias.
fn expert_bias(w: &Weight, e: usize) -> Weight {
    let n = w.shape[1];
    Weight {
        shape: vec![n],
        data: w.data[e * n..(e + 1) * n].to_vec(),
    }
}

/// What the KV cache gives back for `x`: `x` itself, or with `f16` each value rounded to
/// f32 and then to the nearest f16.
fn kv_store(x: Vec<f64>, f16: bool) -> Vec<f64> {
    if f16 {
        x.iter()
            .map(|&a| half::f16::from_f32(a as f32).to_f64())
            .collect()
    } else {
        x
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
    /// stays f64. With latent attention (DeepSeek) the cache holds what llama.cpp's holds, the
    /// normed latent and the rotated shared key part: those two are rounded, and each head's
    /// keys and values are expanded from the rounded latent.
    pub fn reference_logits_f16_kv(&self, ids: &[u32]) -> Vec<Vec<f32>> {
        self.forward(ids, true)
    }

    /// How close each position of `ids` is to choosing other experts: the smallest
    /// [`crate::route_margin`] over the model's MoE layers (infinite for a dense model).
    /// An engine whose arithmetic moves the router's scores by more than this at a position
    /// may route that position differently from the reference.
    pub fn reference_route_margins(&self, ids: &[u32]) -> Vec<f64> {
        let mut probe = Probe::new(ids.len());
        self.forward_with(ids, false, Some(&mut probe));
        probe.margins.iter().map(|m| m[0]).collect()
    }

    /// How far each position of `ids` is from choosing other experts when the router's
    /// logits are all scaled by one factor: the smallest [`crate::moe::route_scale_margin`]
    /// over the model's MoE layers (infinite for a dense model).
    pub fn reference_route_scale_margins(&self, ids: &[u32]) -> Vec<f64> {
        let mut probe = Probe::new(ids.len());
        self.forward_with(ids, false, Some(&mut probe));
        probe.margins.iter().map(|m| m[1]).collect()
    }

    /// The experts each position of `ids` is routed to: per position, per MoE layer (in
    /// layer order), the chosen experts' ids in ascending order (empty for a dense model).
    pub fn reference_routes(&self, ids: &[u32]) -> Vec<Vec<Vec<usize>>> {
        let mut probe = Probe::new(ids.len());
        self.forward_with(ids, false, Some(&mut probe));
        probe.routes
    }

    /// Logits of the model's first multi-token-prediction layer (`nextn`, GLM-4.5) over
    /// `ids` with the KV cache in f16 (as [`TinyModel::reference_logits_f16_kv`]): row `i`
    /// (for `i` below `ids.len() - 1`) predicts the token at `i + 2` from the model's output
    /// hidden state at `i` (after its final norm) and the token at `i + 1`. Then `chained`
    /// further rows go on past `ids`: each takes the row before it's greedy choice as its
    /// token and that row's output (before the head's norm) as its hidden state, and row `i`
    /// still predicts the token at `i + 2`. The layer: the embedding of the token (zeroed at
    /// position 0) RMS-normed by `enorm` and the hidden state by `hnorm`, concatenated
    /// (embedding first) and projected by `eh_proj`, the block of layer `n_layers` over
    /// those rows (attention over its own earlier rows), `shared_head.norm` and the output
    /// head. Panics without the layer.
    pub fn reference_mtp_logits(&self, ids: &[u32], chained: usize) -> Vec<Vec<f32>> {
        let s = self.spec();
        assert!(s.nextn_layers > 0, "the model has no prediction layer");
        assert!(ids.len() >= 2, "prediction needs two tokens");
        let (h, l) = (s.hidden_size, s.n_layers);
        let eps = s.rms_eps as f64;
        let p = format!("model.layers.{l}");
        let emb = self.w("model.embed_tokens.weight");
        let head = self.weight("lm_head.weight").unwrap_or(emb);
        let embed = |t: u32| -> Vec<f64> {
            emb.data[t as usize * h..(t as usize + 1) * h]
                .iter()
                .map(|&v| f64::from(v))
                .collect()
        };
        // the model's hidden states, after its final norm
        let mut xs: Vec<Vec<f64>> = ids.iter().map(|&t| embed(t)).collect();
        for layer in 0..l {
            self.layer(layer, &mut xs, true, None);
        }
        let mut hidden: Vec<Vec<f64>> = xs
            .iter()
            .map(|x| rms_norm(x, self.w("model.norm.weight"), eps, 0.0))
            .collect();
        hidden.pop();
        let mut next: Vec<u32> = ids[1..].to_vec();
        let join = |pos: usize, t: u32, hid: &[f64]| -> Vec<f64> {
            let e = if pos == 0 { vec![0.0; h] } else { embed(t) };
            let mut cat = rms_norm(&e, self.w(&format!("{p}.enorm.weight")), eps, 0.0);
            cat.extend(rms_norm(
                hid,
                self.w(&format!("{p}.hnorm.weight")),
                eps,
                0.0,
            ));
            linear(&cat, self.w(&format!("{p}.eh_proj.weight")), None)
        };
        let logits_of = |x: &[f64]| -> Vec<f32> {
            let hn = rms_norm(x, self.w(&format!("{p}.shared_head.norm.weight")), eps, 0.0);
            linear(&hn, head, None)
                .into_iter()
                .map(|v| v as f32)
                .collect()
        };
        // each chained row reruns the layer over every row so far (its attention is causal,
        // so the earlier rows' outputs do not change)
        loop {
            let mut rows: Vec<Vec<f64>> = next
                .iter()
                .zip(&hidden)
                .enumerate()
                .map(|(pos, (&t, hid))| join(pos, t, hid))
                .collect();
            self.layer(l, &mut rows, true, None);
            let logits: Vec<Vec<f32>> = rows.iter().map(|x| logits_of(x)).collect();
            if next.len() == ids.len() - 1 + chained {
                return logits;
            }
            let last = logits.last().expect("a row");
            let choice = last
                .iter()
                .enumerate()
                .fold(0, |best, (i, &v)| if v > last[best] { i } else { best });
            next.push(choice as u32);
            hidden.push(rows.last().expect("a row").clone());
        }
    }

    fn forward(&self, ids: &[u32], f16_kv: bool) -> Vec<Vec<f32>> {
        self.forward_with(ids, f16_kv, None)
    }

    /// The forward pass; with `probe`, each position's margins are lowered to its routing
    /// margins in every MoE layer, and its chosen experts recorded.
    fn forward_with(
        &self,
        ids: &[u32],
        f16_kv: bool,
        mut probe: Option<&mut Probe>,
    ) -> Vec<Vec<f32>> {
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
        let off = if gemma { 1.0 } else { 0.0 };
        let norm = |x: &[f64], name: &str| rms_norm(x, w(name), eps, off);
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
            self.layer(l, &mut xs, f16_kv, probe.as_deref_mut());
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

    /// Layer `l` over the residual stream `xs` (a row per position), in place; with
    /// `probe`, as [`TinyModel::forward_with`] says.
    fn layer(&self, l: usize, xs: &mut [Vec<f64>], f16_kv: bool, mut probe: Option<&mut Probe>) {
        let s = self.spec();
        let w = |n: &str| {
            self.weight(n)
                .unwrap_or_else(|| panic!("missing weight {n}"))
        };
        let eps = s.rms_eps as f64;
        let gemma = s.arch == Arch::Gemma3;
        let off = if gemma { 1.0 } else { 0.0 };
        let norm = |x: &[f64], name: &str| rms_norm(x, w(name), eps, off);
        let p = format!("model.layers.{l}");
        let attn = match &s.mla {
            Some(mla) => self.mla_attention(l, xs, mla, f16_kv),
            None => self.attention(l, xs, f16_kv),
        };
        for (t, o) in attn.into_iter().enumerate() {
            for (x, o) in xs[t].iter_mut().zip(o) {
                *x += o;
            }
            let ffn_norm = if gemma {
                "pre_feedforward_layernorm"
            } else {
                "post_attention_layernorm"
            };
            let hn = norm(&xs[t], &format!("{p}.{ffn_norm}.weight"));
            let d = match &s.moe {
                Some(moe) if s.is_moe_layer(l) => {
                    let (d, margin, chosen) = self.moe_ffn(&p, &hn, moe, probe.is_some());
                    if let Some(probe) = probe.as_deref_mut() {
                        probe.routes[t].push(chosen);
                        let m = &mut probe.margins;
                        m[t] = [m[t][0].min(margin[0]), m[t][1].min(margin[1])];
                    }
                    d
                }
                _ => {
                    let mut d = swiglu(
                        &hn,
                        w(&format!("{p}.mlp.gate_proj.weight")),
                        w(&format!("{p}.mlp.up_proj.weight")),
                        w(&format!("{p}.mlp.down_proj.weight")),
                        gemma,
                    );
                    if gemma {
                        d = norm(&d, &format!("{p}.post_feedforward_layernorm.weight"));
                    }
                    d
                }
            };
            for (x, d) in xs[t].iter_mut().zip(d) {
                *x += d;
            }
        }
    }

    /// The weight named `n`; panics when the model lacks it.
    fn w(&self, n: &str) -> &Weight {
        self.weight(n)
            .unwrap_or_else(|| panic!("missing weight {n}"))
    }

    /// Layer `l`'s attention output (after `o_proj`, and Gemma's post-attention norm) at every
    /// position of `xs`, the layer's input.
    fn attention(&self, l: usize, xs: &[Vec<f64>], f16_kv: bool) -> Vec<Vec<f64>> {
        let s = self.spec();
        let p = format!("model.layers.{l}");
        let eps = s.rms_eps as f64;
        let gemma = s.arch == Arch::Gemma3;
        let off = if gemma { 1.0 } else { 0.0 };
        let norm = |x: &[f64], name: &str| rms_norm(x, self.w(name), eps, off);
        let factors = s
            .llama3_rope
            .map(|r| r.freq_factors(s.rope_theta as f64, s.head_dim));
        let (hd, nh, nkv) = (s.head_dim, s.n_head, s.n_kv_head);
        let group = nh / nkv;
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
            let mut q = linear(
                &hn,
                self.w(&format!("{p}.self_attn.q_proj.weight")),
                bias("q"),
            );
            let mut k = linear(
                &hn,
                self.w(&format!("{p}.self_attn.k_proj.weight")),
                bias("k"),
            );
            let v = linear(
                &hn,
                self.w(&format!("{p}.self_attn.v_proj.weight")),
                bias("v"),
            );
            for (v, norm_name) in [(&mut q, "q_norm"), (&mut k, "k_norm")] {
                for head in v.chunks_mut(hd) {
                    if s.arch.has_qk_norm() {
                        let n = norm(head, &format!("{p}.self_attn.{norm_name}.weight"));
                        head.copy_from_slice(&n);
                    }
                    let turned = if s.rope_dims > 0 { s.rope_dims } else { hd };
                    rope(
                        &mut head[..turned],
                        pos,
                        theta,
                        factors.as_deref(),
                        s.yarn.as_ref(),
                    );
                }
            }
            qs.push(q);
            ks.push(kv_store(k, f16_kv));
            vs.push(kv_store(v, f16_kv));
        }
        let scale = 1.0 / (hd as f64).sqrt();
        let sinks = self.weight(&format!("{p}.self_attn.sinks"));
        (0..xs.len())
            .map(|t| {
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
                    let weights = match sinks {
                        Some(sk) => softmax_with_sink(&scores, f64::from(sk.data[head])),
                        None => softmax(&scores),
                    };
                    for (i, a) in weights.iter().enumerate() {
                        let v = &vs[first + i][kvh * hd..(kvh + 1) * hd];
                        for d in 0..hd {
                            attn[head * hd + d] += a * v[d];
                        }
                    }
                }
                let mut o = linear(
                    &attn,
                    self.w(&format!("{p}.self_attn.o_proj.weight")),
                    bias("o"),
                );
                if gemma {
                    o = norm(&o, &format!("{p}.post_attention_layernorm.weight"));
                }
                o
            })
            .collect()
    }

    /// Layer `l`'s multi-head latent attention output (after `o_proj`) at every position of
    /// `xs`, in the expanded form; see the module docs.
    fn mla_attention(
        &self,
        l: usize,
        xs: &[Vec<f64>],
        mla: &MlaSpec,
        f16_kv: bool,
    ) -> Vec<Vec<f64>> {
        let s = self.spec();
        let p = format!("model.layers.{l}");
        let eps = s.rms_eps as f64;
        let norm = |x: &[f64], name: &str| rms_norm(x, self.w(&format!("{p}.{name}")), eps, 0.0);
        let theta = s.rope_theta as f64;
        let (nh, rank, dk, nope, dv) = (
            s.n_head,
            mla.kv_lora_rank,
            mla.qk_dim(),
            mla.nope_dim,
            mla.v_dim,
        );
        let k_b = self.w(&format!("{p}.self_attn.k_b_proj.weight"));
        let v_b = self.w(&format!("{p}.self_attn.v_b_proj.weight"));
        let mut qs = Vec::new();
        let mut k_pes = Vec::new();
        let mut k_nopes = Vec::new();
        let mut vs = Vec::new();
        for (pos, x) in xs.iter().enumerate() {
            let hn = norm(x, "input_layernorm.weight");
            let mut q = if mla.q_lora_rank == 0 {
                linear(&hn, self.w(&format!("{p}.self_attn.q_proj.weight")), None)
            } else {
                let qa = linear(&hn, self.w(&format!("{p}.self_attn.q_a_proj.weight")), None);
                let qa = norm(&qa, "self_attn.q_a_layernorm.weight");
                linear(&qa, self.w(&format!("{p}.self_attn.q_b_proj.weight")), None)
            };
            for head in q.chunks_mut(dk) {
                rope_adjacent(&mut head[nope..], pos, theta, s.yarn.as_ref());
            }
            let kv = linear(
                &hn,
                self.w(&format!("{p}.self_attn.kv_a_proj_with_mqa.weight")),
                None,
            );
            let c = norm(&kv[..rank], "self_attn.kv_a_layernorm.weight");
            let mut k_pe = kv[rank..].to_vec();
            rope_adjacent(&mut k_pe, pos, theta, s.yarn.as_ref());
            // the cache holds the latent and the rotated key; keys and values come from it
            let c = kv_store(c, f16_kv);
            let mut k_nope = vec![0.0f64; nh * nope];
            let mut v = vec![0.0f64; nh * dv];
            for hh in 0..nh {
                for (r, cr) in c.iter().enumerate() {
                    let row = &k_b.data[(hh * rank + r) * nope..(hh * rank + r + 1) * nope];
                    for (d, kb) in row.iter().enumerate() {
                        k_nope[hh * nope + d] += *kb as f64 * cr;
                    }
                }
                for j in 0..dv {
                    let row = &v_b.data[(hh * dv + j) * rank..(hh * dv + j + 1) * rank];
                    v[hh * dv + j] = row.iter().zip(&c).map(|(a, b)| *a as f64 * b).sum();
                }
            }
            qs.push(q);
            k_pes.push(kv_store(k_pe, f16_kv));
            k_nopes.push(k_nope);
            vs.push(v);
        }
        let yarn = s.yarn.as_ref().map_or(1.0, YarnRope::attention_factor);
        let scale = yarn / (dk as f64).sqrt();
        (0..xs.len())
            .map(|t| {
                let mut attn = vec![0.0f64; nh * dv];
                for hh in 0..nh {
                    let q = &qs[t][hh * dk..(hh + 1) * dk];
                    let scores: Vec<f64> = (0..=t)
                        .map(|u| {
                            let k_nope = &k_nopes[u][hh * nope..(hh + 1) * nope];
                            let dot_nope: f64 =
                                q[..nope].iter().zip(k_nope).map(|(a, b)| a * b).sum();
                            let dot_pe: f64 =
                                q[nope..].iter().zip(&k_pes[u]).map(|(a, b)| a * b).sum();
                            (dot_nope + dot_pe) * scale
                        })
                        .collect();
                    for (u, a) in softmax(&scores).iter().enumerate() {
                        let v = &vs[u][hh * dv..(hh + 1) * dv];
                        for d in 0..dv {
                            attn[hh * dv + d] += a * v[d];
                        }
                    }
                }
                linear(&attn, self.w(&format!("{p}.self_attn.o_proj.weight")), None)
            })
            .collect()
    }

    /// The mixture-of-experts FFN of layer prefix `p` on the normed input `hn`: the routed
    /// experts' SwiGLU outputs weighted as [`crate::route`] says, plus the shared experts';
    /// and the routing's [`crate::route_margin`].
    /// Layer `p`'s routed (and shared) experts on the normed input `hn`: their output, with
    /// `margins` the routing margins, and the chosen experts in ascending order.
    fn moe_ffn(
        &self,
        p: &str,
        hn: &[f64],
        moe: &MoeSpec,
        margins: bool,
    ) -> (Vec<f64>, [f64; 2], Vec<usize>) {
        let s = self.spec();
        let names = MoeNames::of(s.arch, p);
        let logits = linear(
            hn,
            self.w(&names.router),
            self.weight(&format!("{p}.mlp.gate.bias")),
        );
        let bias = moe
            .probs_bias
            .then(|| self.w(&format!("{p}.mlp.gate.e_score_correction_bias")));
        let (gate, up, down) = (self.w(&names.gate), self.w(&names.up), self.w(&names.down));
        let bias = bias.map(|b| b.data.as_slice());
        let margin = if margins {
            [
                route_margin(&logits, moe, bias),
                route_scale_margin(&logits, moe, bias),
            ]
        } else {
            [f64::INFINITY; 2]
        };
        let mut out = vec![0.0f64; hn.len()];
        let routed = route(&logits, moe, bias);
        let mut chosen: Vec<usize> = routed.iter().map(|r| r.0).collect();
        chosen.sort_unstable();
        let oss = s.arch == Arch::GptOss;
        for (e, weight) in routed {
            let (g, u, dn) = (expert(gate, e), expert(up, e), expert(down, e));
            let d = if oss {
                let b = |n: &str| expert_bias(self.w(&format!("{p}.mlp.experts.{n}_proj.bias")), e);
                let (bg, bu, bd) = (b("gate"), b("up"), b("down"));
                swiglu_oai_expert(hn, [&g, &u, &dn], [&bg, &bu, &bd])
            } else {
                swiglu(hn, &g, &u, &dn, false)
            };
            for (o, d) in out.iter_mut().zip(d) {
                *o += weight * d;
            }
        }
        if moe.n_shared_expert > 0 {
            let sp = format!("{p}.mlp.shared_experts");
            let d = swiglu(
                hn,
                self.w(&format!("{sp}.gate_proj.weight")),
                self.w(&format!("{sp}.up_proj.weight")),
                self.w(&format!("{sp}.down_proj.weight")),
                false,
            );
            for (o, d) in out.iter_mut().zip(d) {
                *o += d;
            }
        }
        (out, margin, chosen)
    }
}
