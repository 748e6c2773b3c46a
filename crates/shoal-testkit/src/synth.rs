//! Synthetic GGUF files with the exact shapes and quantization mix of real models (mostly
//! mixtures of experts), for benchmarks.
//!
//! No mixture-of-experts weights exist on these machines, yet how fast an engine decodes a
//! model depends almost only on the bytes it reads per token: which tensors there are, their
//! shapes and their types. [`SynthPlan`] lays out a GGUF file with a real model's
//! hyperparameters, tensor names and shapes (llama.cpp's current converter layout) and a
//! `Q4_K_M`-like type per tensor, and writes it with random weights. llama.cpp and shoal load
//! such a file like the real model and read the same bytes per token, so their speed figures
//! are real; **the text they generate is meaningless** (random weights, and a tiny byte-level
//! BPE tokenizer padded with filler tokens up to the model's vocabulary size). Do not use
//! these files for anything that looks at the output.
//!
//! # Shapes
//!
//! [`shapes`] lists them ([`shape`] finds one by name or alias):
//!
//! | name | architecture | layers | model |
//! | --- | --- | --- | --- |
//! | `qwen3-30b-a3b-24l` (alias `qwen3-30b-a3b`) | `qwen3moe` | 24 of 48 | Qwen3-30B-A3B |
//! | `qwen3-30b-a3b-12l` | `qwen3moe` | 12 of 48 | Qwen3-30B-A3B |
//! | `deepseek-v2-lite` | `deepseek2` | 27 of 27 | DeepSeek-V2-Lite |
//! | `mixtral-8x7b-8l` (alias `mixtral-8x7b`) | `llama` + experts | 8 of 32 | Mixtral-8x7B |
//! | `gpt-oss-120b-4l` (alias `gpt-oss-120b`) | `gpt-oss` | 4 of 36 | gpt-oss-120b |
//! | `glm-4.5-air-4l` (alias `glm-4.5-air`) | `glm4moe` | 4 of 46, and its prediction layer | GLM-4.5-Air |
//! | `mistral-7b-8l-iq1_s`, `-iq2_xxs`, `-iq3_s`, `-iq4_xs` | `llama` (dense) | 8 of 32 | Mistral-7B |
//!
//! A shape with fewer layers than its model is simply shallower: `block_count` says so, and
//! `general.name` names the depth. Each layer has the full model's sizes.
//!
//! # Quantization mix ("Q4_K_M-like")
//!
//! Types follow llama.cpp's `llama_tensor_get_type` for `LLAMA_FTYPE_MOSTLY_Q4_K_M`
//! (`src/llama-quant.cpp`), applied to a source file whose 1-D tensors, norms and router
//! (`ffn_gate_inp`) are F32 (which the converter writes and `llama-quantize` keeps) and whose
//! other weights are 16-bit (which it quantizes): the default is `Q4_K`; `output.weight` is
//! `Q6_K`; `attn_v` (counted in llama.cpp's order, by layer) and every `ffn_down*` (layer
//! parsed from the name when there are experts) get `Q6_K` in the "use more bits" layers
//! (`i < n/8 || i >= 7n/8 || (i - n/8) % 3 == 2`, `n` = the file's `block_count`); with exactly
//! 8 experts `attn_v` and `attn_k` are `Q8_0` and `attn_output` is `Q5_K`; a tensor whose row
//! length is not a multiple of 256 falls back from `Q4_K` to `Q5_0`, from `Q5_K` to `Q5_1` and
//! from `Q6_K` to `Q8_0` (then to F16 if not a multiple of 32). What each shape gets:
//!
//! - `qwen3-30b-a3b-24l`: F32 norms (incl. per-head q/k norms) and routers; `Q4_K`
//!   `token_embd`, `attn_q`, `attn_k`, `attn_output`, `ffn_gate_exps`, `ffn_up_exps`; `attn_v`
//!   and `ffn_down_exps` `Q6_K` in layers 0-2, 5, 8, 11, 14, 17, 20-23 and `Q4_K` elsewhere;
//!   `output` `Q6_K`. `qwen3-30b-a3b-12l` (about 5 GB, for moving a large model around a
//!   cluster) is its first twelve layers, its "more bits" layers 0, 3, 6, 9, 10 and 11.
//! - `deepseek-v2-lite`: F32 norms and routers; `Q4_K` `token_embd`, `attn_q`,
//!   `attn_kv_a_mqa`, `attn_v_b` (rows of 512), `attn_output`, `ffn_gate`/`ffn_up` (dense layer
//!   0), `ffn_{gate,up}_exps`, `ffn_{gate,up}_shexp`; `attn_k_b` (rows of 128) `Q5_0`;
//!   `ffn_down_shexp` (rows of 2816) `Q6_K` in the "more bits" layers 1-2, 5, 8, 11, 14, 17,
//!   20, 23-26 and `Q4_K` elsewhere; `ffn_down` of the dense layer 0 (rows of 10944) and
//!   `ffn_down_exps` (rows of 1408) are not whole super-blocks, so `Q8_0` (from `Q6_K`) in
//!   those layers and `Q5_0` (from `Q4_K`) elsewhere; `output` `Q6_K`.
//! - `mixtral-8x7b-8l`: F32 norms and routers; `attn_k`, `attn_v` `Q8_0`; `attn_output`
//!   `Q5_K`; `Q4_K` `token_embd`, `attn_q`, `ffn_gate_exps`, `ffn_up_exps`; `ffn_down_exps`
//!   `Q6_K` in layers 0, 3, 6, 7 and `Q4_K` elsewhere; `output` `Q6_K`.
//!
//! - `gpt-oss-120b-4l` is not `Q4_K_M`-like but as the published MXFP4 files are assumed to
//!   be: routed experts MXFP4; the attention projections, `token_embd` and `output` `Q8_0`;
//!   norms, sinks, the router and every bias F32.
//! - The `mistral-7b-8l-*` files are as `llama-quantize --pure` writes them: every matrix
//!   (`token_embd` and `output` too) of the named type, norms F32. They measure the i-quant
//!   kernels alone; a published file of those types mixes in K-quants.
//!
//! Where this differs from a real `Q4_K_M` file of the full model: the layer-dependent rules
//! use the synthetic file's depth (as `llama-quantize` would on that shallower file), so the
//! `Q6_K` layers of a reduced shape are not the first layers' choices in the full model. Rules
//! that name model sizes (`LLM_TYPE_70B`) or other file types never apply to these shapes and
//! are not implemented; no imatrix, no `--pure`, no per-tensor overrides.
//!
//! # Values
//!
//! Weights are random but valid and well scaled: K-quant, IQ4_XS and 32-value blocks get random
//! quants with small f16 scales chosen so the dequantized weights have mean about 0 and
//! standard deviation [`WEIGHT_STD`] (sub-block scales random in a narrow band; `Q6_K` and
//! `Q5_0` scales with random signs, as ggml's can have, so their quants' half-step bias
//! cancels); the grid i-quants random lattice points, signs and scales
//! ([`crate::iquants`]); routers and
//! other float weights are uniform with that deviation, norms uniform in `1 ± 0.05`. With
//! every input normalized, each projection gives values of order 1, so logits stay finite and
//! each token's router picks experts roughly uniformly at random. A [`SplitMix64`] seeded from
//! the shape's seed and the tensor's name makes every file bit-for-bit reproducible.
//!
//! # Writing
//!
//! The files are 6 to 11 GB, so nothing but the header and one chunk ([`CHUNK_BYTES`]) of one
//! tensor is ever in memory: [`SynthPlan::new`] computes the whole header (metadata encoded by
//! [`GgufWriter`], then the tensor infos with offsets aligned to 32, GGUF v3) and
//! [`SynthPlan::write`] streams each tensor's blocks through a `BufWriter` into `PATH.tmp`,
//! syncs it and renames it to `PATH`, so an interrupted run never leaves a complete-looking
//! file (the `.tmp` is removed on error).
//!
//! [`SynthPlan::active_bytes_per_token`] is the figure the files exist for: every block tensor
//! (routed experts at `used / count` of their size) plus the output head, the way shoal's
//! `weight_bytes_per_token` counts it (the embedding row and the final norm are ignored).
//! The `synth-gguf` binary writes a shape (`synth-gguf SHAPE OUT.gguf`, `--list`, `--info
//! SHAPE`); `bench/synth.sh SHAPE` writes one into the model cache once and prints its path.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use half::f16;

use crate::gguf_writer::{GgufValue, GgufWriter, GGUF_DEFAULT_ALIGNMENT};
use crate::iquants::GridIquant;
use crate::quants::IQ4_GRID;
use crate::rng::SplitMix64;
use crate::tokenizer::{PreTokenizer, TinyTokenizer, CHATML_TEMPLATE};
use crate::TestkitError;

/// Standard deviation of the dequantized weights.
pub const WEIGHT_STD: f32 = 0.02;
/// Norm weights are uniform in `1 ± NORM_SPREAD`.
pub const NORM_SPREAD: f32 = 0.05;
/// Bytes generated at a time (about; a whole number of blocks).
pub const CHUNK_BYTES: usize = 4 << 20;
/// `general.file_type` of `Q4_K_M` (`LLAMA_FTYPE_MOSTLY_Q4_K_M`).
pub const FILE_TYPE_Q4_K_M: u32 = 15;
/// `general.file_type` of gpt-oss's MXFP4 files (`LLAMA_FTYPE_MOSTLY_MXFP4_MOE`).
pub const FILE_TYPE_MXFP4_MOE: u32 = 38;

/// Standard deviation of a uniform integer in `0..n`: `sqrt((n² - 1) / 12)`.
fn uniform_int_std(n: f32) -> f32 {
    ((n * n - 1.0) / 12.0).sqrt()
}

/// A tensor type these files use, with its GGUF id and block layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[allow(non_camel_case_types)] // ggml's names
pub enum SynthType {
    /// 32-bit float, id 0.
    F32,
    /// IEEE half, id 1 (only as the last fallback; no shape here needs it).
    F16,
    /// 5-bit, one f16 scale per 32 values, id 6.
    Q5_0,
    /// 5-bit, f16 scale and minimum per 32 values, id 7.
    Q5_1,
    /// 8-bit, one f16 scale per 32 values, id 8.
    Q8_0,
    /// 4-bit K-quant, id 12.
    Q4_K,
    /// 5-bit K-quant, id 13.
    Q5_K,
    /// 6-bit K-quant, id 14.
    Q6_K,
    /// 4-bit E2M1 values with one E8M0 scale per 32 (gpt-oss's experts), id 39.
    MXFP4,
    /// 1.56-bit grid i-quant (eight-value points of -1, 0, 1 with a shift), id 19.
    IQ1_S,
    /// 2.06-bit grid i-quant (eight-value lattice points, sign codes), id 16.
    IQ2_XXS,
    /// 3.44-bit grid i-quant (four-value lattice points, sign bytes), id 21.
    IQ3_S,
    /// 4.25-bit non-linear codes with a 6-bit scale per 32 values, id 23.
    IQ4_XS,
}

impl SynthType {
    /// The GGUF type id (`enum ggml_type`).
    pub fn id(self) -> u32 {
        match self {
            SynthType::F32 => 0,
            SynthType::F16 => 1,
            SynthType::Q5_0 => 6,
            SynthType::Q5_1 => 7,
            SynthType::Q8_0 => 8,
            SynthType::Q4_K => 12,
            SynthType::Q5_K => 13,
            SynthType::Q6_K => 14,
            SynthType::MXFP4 => 39,
            SynthType::IQ1_S => 19,
            SynthType::IQ2_XXS => 16,
            SynthType::IQ3_S => 21,
            SynthType::IQ4_XS => 23,
        }
    }

    /// Values per block.
    pub fn block_size(self) -> u64 {
        match self {
            SynthType::F32 | SynthType::F16 => 1,
            SynthType::Q5_0 | SynthType::Q5_1 | SynthType::Q8_0 | SynthType::MXFP4 => 32,
            SynthType::Q4_K
            | SynthType::Q5_K
            | SynthType::Q6_K
            | SynthType::IQ1_S
            | SynthType::IQ2_XXS
            | SynthType::IQ3_S
            | SynthType::IQ4_XS => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> u64 {
        match self {
            SynthType::F32 => 4,
            SynthType::F16 => 2,
            SynthType::Q5_0 => 22,
            SynthType::Q5_1 => 24,
            SynthType::Q8_0 => 34,
            SynthType::Q4_K => 144,
            SynthType::Q5_K => 176,
            SynthType::Q6_K => 210,
            SynthType::MXFP4 => 17,
            SynthType::IQ1_S => 50,
            SynthType::IQ2_XXS => 66,
            SynthType::IQ3_S => 110,
            SynthType::IQ4_XS => 136,
        }
    }

    /// ggml's name for the type.
    pub fn name(self) -> &'static str {
        match self {
            SynthType::F32 => "f32",
            SynthType::F16 => "f16",
            SynthType::Q5_0 => "q5_0",
            SynthType::Q5_1 => "q5_1",
            SynthType::Q8_0 => "q8_0",
            SynthType::Q4_K => "q4_K",
            SynthType::Q5_K => "q5_K",
            SynthType::Q6_K => "q6_K",
            SynthType::MXFP4 => "mxfp4",
            SynthType::IQ1_S => "iq1_s",
            SynthType::IQ2_XXS => "iq2_xxs",
            SynthType::IQ3_S => "iq3_s",
            SynthType::IQ4_XS => "iq4_xs",
        }
    }

    /// Bytes of `n` values, or `None` when `n` is not a whole number of blocks.
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        n.is_multiple_of(self.block_size())
            .then(|| n / self.block_size() * self.block_bytes())
    }
}

/// The GGUF architecture of a shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SynthArch {
    /// `qwen3moe`: GQA with per-head q/k RMS norms, routed experts only.
    Qwen3Moe,
    /// `deepseek2`: multi-head latent attention, leading dense layers, routed and shared
    /// experts.
    Deepseek2,
    /// Mixtral: `llama` with `llama.expert_count`.
    Mixtral,
    /// `gpt-oss`: biased attention with a sink per head, alternating sliding-window layers,
    /// YaRN, biased experts in MXFP4.
    GptOss,
    /// `llama` without experts: a dense model (Mistral 7B's shapes).
    Llama,
    /// `glm4moe` (GLM-4.5): biased q/k/v, RoPE on half of each head, a leading dense layer,
    /// sigmoid routing with a selection bias beside a shared expert, and one
    /// multi-token-prediction layer after the others (`nextn.*` tensors).
    Glm4Moe,
}

impl SynthArch {
    /// `general.architecture` and the prefix of the hyperparameter keys.
    pub fn gguf_name(self) -> &'static str {
        match self {
            SynthArch::Qwen3Moe => "qwen3moe",
            SynthArch::Deepseek2 => "deepseek2",
            SynthArch::Mixtral | SynthArch::Llama => "llama",
            SynthArch::GptOss => "gpt-oss",
            SynthArch::Glm4Moe => "glm4moe",
        }
    }

    /// The pre-tokenizer the test kit's tokenizer is written with (as [`crate::Arch`] does).
    pub fn pre_tokenizer(self) -> PreTokenizer {
        match self {
            SynthArch::Qwen3Moe | SynthArch::GptOss | SynthArch::Glm4Moe => PreTokenizer::Qwen2,
            SynthArch::Deepseek2 | SynthArch::Mixtral | SynthArch::Llama => PreTokenizer::Smollm,
        }
    }
}

/// How a shape's tensors are typed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mix {
    /// `llama-quantize`'s `Q4_K_M` rules (see the module docs).
    Q4KM,
    /// gpt-oss's published files: MXFP4 experts, `Q8_0` other matrices.
    Mxfp4Moe,
    /// `llama-quantize --pure`: every matrix of this type (F16 where its rows are not whole
    /// blocks), norms F32.
    Pure(SynthType),
}

impl Mix {
    /// `general.file_type` (llama.cpp's `enum llama_ftype`; a pure K-quant file as its `_S`
    /// type, the one that keeps the type for every matrix but the output).
    pub fn file_type(self) -> u32 {
        match self {
            Mix::Q4KM => FILE_TYPE_Q4_K_M,
            Mix::Mxfp4Moe => FILE_TYPE_MXFP4_MOE,
            Mix::Pure(t) => match t {
                SynthType::F32 => 0,
                SynthType::F16 => 1,
                SynthType::Q5_0 => 8,
                SynthType::Q5_1 => 9,
                SynthType::Q8_0 => 7,
                SynthType::Q4_K => 14,
                SynthType::Q5_K => 16,
                SynthType::Q6_K => 18,
                SynthType::IQ1_S => 24,
                SynthType::IQ2_XXS => 19,
                SynthType::IQ3_S => 26,
                SynthType::IQ4_XS => 30,
                SynthType::MXFP4 => FILE_TYPE_MXFP4_MOE,
            },
        }
    }

    /// How the mix is named in the file's description.
    fn describe(self) -> String {
        match self {
            Mix::Q4KM => "a Q4_K_M-like mix".into(),
            Mix::Mxfp4Moe => "MXFP4 experts".into(),
            Mix::Pure(t) => format!("every matrix {}", t.name()),
        }
    }
}

/// The experts of a shape (a count of 0: a dense model).
#[derive(Debug, Clone, PartialEq)]
pub struct Experts {
    /// Routed experts per layer.
    pub count: usize,
    /// Experts each token uses.
    pub used: usize,
    /// Width of one expert (`expert_feed_forward_length`); `None`: experts are
    /// `feed_forward_length` wide and the key is not written (Mixtral).
    pub ffn: Option<usize>,
    /// Shared experts (`expert_shared_count`, DeepSeek), each as wide as a routed one.
    pub shared: usize,
    /// Leading layers with a dense feed-forward of `feed_forward_length` (DeepSeek).
    pub leading_dense: usize,
    /// `expert_gating_func` (1 softmax, 2 sigmoid) when written.
    pub gating_func: Option<u32>,
    /// `expert_weights_scale` when written.
    pub weights_scale: Option<f32>,
    /// `expert_weights_norm` when written.
    pub weights_norm: Option<bool>,
}

/// Multi-head latent attention sizes (DeepSeek V2 without query compression).
#[derive(Debug, Clone, PartialEq)]
pub struct Mla {
    /// Latent size (`kv_lora_rank`).
    pub kv_lora_rank: usize,
    /// Rotated dimensions of a key/query head (`rope.dimension_count`).
    pub rope_dim: usize,
    /// Unrotated dimensions of a key/query head.
    pub nope_dim: usize,
    /// Value head size.
    pub v_dim: usize,
}

/// YaRN RoPE scaling as DeepSeek's converter writes it.
#[derive(Debug, Clone, PartialEq)]
pub struct Yarn {
    /// `rope.scaling.factor`.
    pub factor: f32,
    /// `rope.scaling.original_context_length`.
    pub original_context: u32,
    /// `rope.scaling.yarn_beta_fast`.
    pub beta_fast: f32,
    /// `rope.scaling.yarn_beta_slow`.
    pub beta_slow: f32,
    /// `rope.scaling.yarn_log_multiplier` (0.1 × `mscale_all_dim`, as the converter writes).
    pub log_multiplier: f32,
}

/// A model shape: the hyperparameters of a real model, at some depth.
#[derive(Debug, Clone, PartialEq)]
pub struct Shape {
    /// Name of the shape (and of its file, `NAME.gguf`).
    pub name: &'static str,
    /// Other names [`shape`] accepts.
    pub aliases: &'static [&'static str],
    /// The real model it copies.
    pub model: &'static str,
    /// GGUF architecture.
    pub arch: SynthArch,
    /// Layers written (`block_count`).
    pub n_layer: usize,
    /// Layers of the real model.
    pub model_layers: usize,
    /// `embedding_length`.
    pub hidden: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (ignored with [`Shape::mla`]: the file says 1).
    pub n_kv_head: usize,
    /// Head size (ignored with [`Shape::mla`]).
    pub head_dim: usize,
    /// `feed_forward_length`: the dense FFN (DeepSeek's leading layers), Mixtral's experts.
    pub ffn: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// `context_length`.
    pub context_length: usize,
    /// `rope.freq_base`.
    pub rope_theta: f32,
    /// `attention.layer_norm_rms_epsilon`.
    pub rms_eps: f32,
    /// The experts.
    pub experts: Experts,
    /// Latent attention, for `deepseek2`.
    pub mla: Option<Mla>,
    /// YaRN scaling, where the model has it.
    pub yarn: Option<Yarn>,
    /// How the tensors are typed.
    pub mix: Mix,
    /// Seed of the random weights.
    pub seed: u64,
}

impl Shape {
    /// Width of one expert.
    pub fn expert_ffn(&self) -> usize {
        self.experts.ffn.unwrap_or(self.ffn)
    }

    /// Multi-token-prediction layers written after the model's (GLM ships one).
    pub fn nextn_layers(&self) -> usize {
        usize::from(self.arch == SynthArch::Glm4Moe)
    }

    /// Layers in the file (`block_count`): the model's and the prediction layers.
    pub fn block_count(&self) -> usize {
        self.n_layer + self.nextn_layers()
    }

    /// Whether layer `l` routes through experts (else it has a dense FFN).
    pub fn is_moe_layer(&self, l: usize) -> bool {
        self.experts.count > 0 && l >= self.experts.leading_dense
    }

    /// `general.name`: the shape and its depth.
    pub fn general_name(&self) -> String {
        format!(
            "synthetic {} ({} layers of {}'s {}, random weights)",
            self.name, self.n_layer, self.model, self.model_layers
        )
    }

    /// The tensors, in file order: name and dimensions (innermost first).
    pub fn tensors(&self) -> Vec<(String, Vec<u64>)> {
        let u = |x: usize| x as u64;
        let h = u(self.hidden);
        let (e, eff) = (u(self.experts.count), u(self.expert_ffn()));
        let mut t: Vec<(String, Vec<u64>)> =
            vec![("token_embd.weight".into(), vec![h, u(self.vocab)])];
        for l in 0..self.block_count() {
            if self.arch == SynthArch::GptOss {
                self.gpt_oss_layer(l, &mut t);
                continue;
            }
            let glm = self.arch == SynthArch::Glm4Moe;
            let mut add = |part: &str, ne: Vec<u64>| t.push((format!("blk.{l}.{part}.weight"), ne));
            add("attn_norm", vec![h]);
            if let Some(m) = &self.mla {
                let nh = u(self.n_head);
                let (rank, rope, nope, v) =
                    (u(m.kv_lora_rank), u(m.rope_dim), u(m.nope_dim), u(m.v_dim));
                add("attn_q", vec![h, nh * (nope + rope)]);
                add("attn_kv_a_mqa", vec![h, rank + rope]);
                add("attn_kv_a_norm", vec![rank]);
                add("attn_k_b", vec![nope, rank, nh]);
                add("attn_v_b", vec![rank, v, nh]);
                add("attn_output", vec![nh * v, h]);
            } else {
                let (q, kv) = (
                    u(self.n_head * self.head_dim),
                    u(self.n_kv_head * self.head_dim),
                );
                add("attn_q", vec![h, q]);
                add("attn_k", vec![h, kv]);
                add("attn_v", vec![h, kv]);
                if self.arch == SynthArch::Qwen3Moe {
                    add("attn_q_norm", vec![u(self.head_dim)]);
                    add("attn_k_norm", vec![u(self.head_dim)]);
                }
                add("attn_output", vec![q, h]);
                if glm {
                    let mut bias =
                        |part: &str, n: u64| t.push((format!("blk.{l}.{part}.bias"), vec![n]));
                    bias("attn_q", q);
                    bias("attn_k", kv);
                    bias("attn_v", kv);
                }
            }
            let mut add = |part: &str, ne: Vec<u64>| t.push((format!("blk.{l}.{part}.weight"), ne));
            add(
                if glm {
                    "post_attention_norm"
                } else {
                    "ffn_norm"
                },
                vec![h],
            );
            if self.is_moe_layer(l) {
                add("ffn_gate_inp", vec![h, e]);
                if glm {
                    t.push((format!("blk.{l}.exp_probs_b.bias"), vec![e]));
                }
                let mut add =
                    |part: &str, ne: Vec<u64>| t.push((format!("blk.{l}.{part}.weight"), ne));
                add("ffn_gate_exps", vec![h, eff, e]);
                add("ffn_up_exps", vec![h, eff, e]);
                add("ffn_down_exps", vec![eff, h, e]);
                if self.experts.shared > 0 {
                    let s = eff * u(self.experts.shared);
                    add("ffn_gate_shexp", vec![h, s]);
                    add("ffn_up_shexp", vec![h, s]);
                    add("ffn_down_shexp", vec![s, h]);
                }
            } else {
                let f = u(self.ffn);
                add("ffn_gate", vec![h, f]);
                add("ffn_up", vec![h, f]);
                add("ffn_down", vec![f, h]);
            }
            if l >= self.n_layer {
                let mut add =
                    |part: &str, ne: Vec<u64>| t.push((format!("blk.{l}.nextn.{part}.weight"), ne));
                add("eh_proj", vec![2 * h, h]);
                add("enorm", vec![h]);
                add("hnorm", vec![h]);
                add("shared_head_norm", vec![h]);
            }
        }
        t.push(("output_norm.weight".into(), vec![h]));
        t.push(("output.weight".into(), vec![h, u(self.vocab)]));
        t
    }

    /// Layer `l`'s tensors of a gpt-oss file (llama.cpp's converter layout), onto `t`.
    fn gpt_oss_layer(&self, l: usize, t: &mut Vec<(String, Vec<u64>)>) {
        let u = |x: usize| x as u64;
        let h = u(self.hidden);
        let (e, eff) = (u(self.experts.count), u(self.expert_ffn()));
        let (q, kv) = (
            u(self.n_head * self.head_dim),
            u(self.n_kv_head * self.head_dim),
        );
        let mut add = |name: &str, ne: Vec<u64>| t.push((format!("blk.{l}.{name}"), ne));
        add("attn_norm.weight", vec![h]);
        add("attn_q.weight", vec![h, q]);
        add("attn_q.bias", vec![q]);
        add("attn_k.weight", vec![h, kv]);
        add("attn_k.bias", vec![kv]);
        add("attn_v.weight", vec![h, kv]);
        add("attn_v.bias", vec![kv]);
        add("attn_output.weight", vec![q, h]);
        add("attn_output.bias", vec![h]);
        add("attn_sinks.weight", vec![u(self.n_head)]);
        add("post_attention_norm.weight", vec![h]);
        add("ffn_gate_inp.weight", vec![h, e]);
        add("ffn_gate_inp.bias", vec![e]);
        add("ffn_gate_exps.weight", vec![h, eff, e]);
        add("ffn_gate_exps.bias", vec![eff, e]);
        add("ffn_up_exps.weight", vec![h, eff, e]);
        add("ffn_up_exps.bias", vec![eff, e]);
        add("ffn_down_exps.weight", vec![eff, h, e]);
        add("ffn_down_exps.bias", vec![h, e]);
    }
}

/// The types of a gpt-oss file's tensors as the published MXFP4 files hold them (as this
/// module assumes them): routed experts MXFP4, the other matrices `Q8_0`, the router, norms,
/// sinks and every bias F32.
fn gpt_oss_types(tensors: &[(String, Vec<u64>)]) -> Vec<SynthType> {
    tensors
        .iter()
        .map(|(name, ne)| {
            if ne.len() < 2 || name.ends_with(".bias") || name.contains("ffn_gate_inp") {
                SynthType::F32
            } else if name.contains("_exps.") {
                SynthType::MXFP4
            } else {
                SynthType::Q8_0
            }
        })
        .collect()
}

/// `llama-quantize --pure`'s types: `ty` for every tensor it quantizes (F16 where the rows
/// are not whole blocks of `ty`), F32 for the rest.
fn pure_types(ty: SynthType, tensors: &[(String, Vec<u64>)]) -> Vec<SynthType> {
    tensors
        .iter()
        .map(|(name, ne)| {
            if !allows_quantization(name, ne) {
                SynthType::F32
            } else if ne[0].is_multiple_of(ty.block_size()) {
                ty
            } else {
                SynthType::F16
            }
        })
        .collect()
}

/// Qwen3-30B-A3B's first `n_layer` layers.
fn qwen3_30b_a3b(name: &'static str, aliases: &'static [&'static str], n_layer: usize) -> Shape {
    Shape {
        name,
        aliases,
        model: "Qwen3-30B-A3B",
        arch: SynthArch::Qwen3Moe,
        n_layer,
        model_layers: 48,
        hidden: 2048,
        n_head: 32,
        n_kv_head: 4,
        head_dim: 128,
        ffn: 6144,
        vocab: 151_936,
        context_length: 40_960,
        rope_theta: 1e6,
        rms_eps: 1e-6,
        experts: Experts {
            count: 128,
            used: 8,
            ffn: Some(768),
            shared: 0,
            leading_dense: 0,
            gating_func: None,
            weights_scale: None,
            weights_norm: None,
        },
        mla: None,
        yarn: None,
        mix: Mix::Q4KM,
        seed: 0x5157_3330,
    }
}

/// The shapes this module writes (see the module docs).
pub fn shapes() -> Vec<Shape> {
    vec![
        qwen3_30b_a3b("qwen3-30b-a3b-24l", &["qwen3-30b-a3b"], 24),
        qwen3_30b_a3b("qwen3-30b-a3b-12l", &[], 12),
        Shape {
            name: "deepseek-v2-lite",
            aliases: &[],
            model: "DeepSeek-V2-Lite",
            arch: SynthArch::Deepseek2,
            n_layer: 27,
            model_layers: 27,
            hidden: 2048,
            n_head: 16,
            n_kv_head: 16,
            head_dim: 192,
            ffn: 10_944,
            vocab: 102_400,
            context_length: 163_840,
            rope_theta: 10_000.0,
            rms_eps: 1e-6,
            experts: Experts {
                count: 64,
                used: 6,
                ffn: Some(1408),
                shared: 2,
                leading_dense: 1,
                gating_func: Some(1),
                weights_scale: Some(1.0),
                weights_norm: Some(false),
            },
            mla: Some(Mla {
                kv_lora_rank: 512,
                rope_dim: 64,
                nope_dim: 128,
                v_dim: 128,
            }),
            yarn: Some(Yarn {
                factor: 40.0,
                original_context: 4096,
                beta_fast: 32.0,
                beta_slow: 1.0,
                log_multiplier: 0.1 * 0.707,
            }),
            mix: Mix::Q4KM,
            seed: 0x4453_5632,
        },
        Shape {
            name: "mixtral-8x7b-8l",
            aliases: &["mixtral-8x7b"],
            model: "Mixtral-8x7B",
            arch: SynthArch::Mixtral,
            n_layer: 8,
            model_layers: 32,
            hidden: 4096,
            n_head: 32,
            n_kv_head: 8,
            head_dim: 128,
            ffn: 14_336,
            vocab: 32_000,
            context_length: 32_768,
            rope_theta: 1e6,
            rms_eps: 1e-5,
            experts: Experts {
                count: 8,
                used: 2,
                ffn: None,
                shared: 0,
                leading_dense: 0,
                gating_func: None,
                weights_scale: None,
                weights_norm: None,
            },
            mla: None,
            yarn: None,
            mix: Mix::Q4KM,
            seed: 0x4d58_3837,
        },
        Shape {
            name: "gpt-oss-120b-4l",
            aliases: &["gpt-oss-120b"],
            model: "gpt-oss-120b",
            arch: SynthArch::GptOss,
            n_layer: 4,
            model_layers: 36,
            hidden: 2880,
            n_head: 64,
            n_kv_head: 8,
            head_dim: 64,
            ffn: 2880,
            vocab: 201_088,
            context_length: 131_072,
            rope_theta: 150_000.0,
            rms_eps: 1e-5,
            experts: Experts {
                count: 128,
                used: 4,
                ffn: Some(2880),
                shared: 0,
                leading_dense: 0,
                gating_func: None,
                weights_scale: None,
                weights_norm: None,
            },
            mla: None,
            yarn: Some(Yarn {
                factor: 32.0,
                original_context: 4096,
                beta_fast: 32.0,
                beta_slow: 1.0,
                log_multiplier: 0.0,
            }),
            mix: Mix::Mxfp4Moe,
            seed: 0x4f53_5331,
        },
        Shape {
            name: "glm-4.5-air-4l",
            aliases: &["glm-4.5-air"],
            model: "GLM-4.5-Air",
            arch: SynthArch::Glm4Moe,
            n_layer: 4,
            model_layers: 46,
            hidden: 4096,
            n_head: 96,
            n_kv_head: 8,
            head_dim: 128,
            ffn: 10_944,
            vocab: 151_552,
            context_length: 131_072,
            rope_theta: 1e6,
            rms_eps: 1e-5,
            experts: Experts {
                count: 128,
                used: 8,
                ffn: Some(1408),
                shared: 1,
                leading_dense: 1,
                gating_func: Some(2),
                weights_scale: Some(1.0),
                weights_norm: Some(true),
            },
            mla: None,
            yarn: None,
            mix: Mix::Q4KM,
            seed: 0x474c_4d34,
        },
        mistral_7b("mistral-7b-8l-iq1_s", SynthType::IQ1_S, 0x4d37_4931),
        mistral_7b("mistral-7b-8l-iq2_xxs", SynthType::IQ2_XXS, 0x4d37_4932),
        mistral_7b("mistral-7b-8l-iq3_s", SynthType::IQ3_S, 0x4d37_4933),
        mistral_7b("mistral-7b-8l-iq4_xs", SynthType::IQ4_XS, 0x4d37_4934),
    ]
}

/// Mistral 7B's shapes at 8 of its 32 layers, every matrix of type `ty`.
fn mistral_7b(name: &'static str, ty: SynthType, seed: u64) -> Shape {
    Shape {
        name,
        aliases: &[],
        model: "Mistral-7B",
        arch: SynthArch::Llama,
        n_layer: 8,
        model_layers: 32,
        hidden: 4096,
        n_head: 32,
        n_kv_head: 8,
        head_dim: 128,
        ffn: 14_336,
        vocab: 32_000,
        context_length: 32_768,
        rope_theta: 1e6,
        rms_eps: 1e-5,
        experts: Experts {
            count: 0,
            used: 0,
            ffn: None,
            shared: 0,
            leading_dense: 0,
            gating_func: None,
            weights_scale: None,
            weights_norm: None,
        },
        mla: None,
        yarn: None,
        mix: Mix::Pure(ty),
        seed,
    }
}

/// The shape called `name` (or with that alias).
pub fn shape(name: &str) -> Option<Shape> {
    shapes()
        .into_iter()
        .find(|s| s.name == name || s.aliases.contains(&name))
}

// ---------------------------------------------------------------------------------------
// The Q4_K_M mix (llama-quant.cpp)
// ---------------------------------------------------------------------------------------

/// llama-quant.cpp's `tensor_category`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Category {
    TokenEmbd,
    AttentionQ,
    AttentionV,
    AttentionK,
    AttentionQkv,
    AttentionKvB,
    AttentionOutput,
    FfnUp,
    FfnGate,
    FfnDown,
    Output,
    Other,
}

/// `tensor_get_category`: substring tests in llama.cpp's order.
fn category(name: &str) -> Category {
    if name == "output.weight" {
        return Category::Output;
    }
    if name == "token_embd.weight" || name == "per_layer_token_embd.weight" {
        return Category::TokenEmbd;
    }
    let rules: [(&str, Category); 9] = [
        ("attn_qkv.weight", Category::AttentionQkv),
        ("attn_kv_b.weight", Category::AttentionKvB),
        ("attn_v.weight", Category::AttentionV),
        ("attn_k.weight", Category::AttentionK),
        ("attn_q.weight", Category::AttentionQ),
        ("attn_output.weight", Category::AttentionOutput),
        ("ffn_up", Category::FfnUp),
        ("ffn_gate", Category::FfnGate),
        ("ffn_down", Category::FfnDown),
    ];
    rules
        .iter()
        .find(|(s, _)| name.contains(s))
        .map_or(Category::Other, |(_, c)| *c)
}

fn is_attn_v_like(c: Category) -> bool {
    matches!(
        c,
        Category::AttentionV | Category::AttentionQkv | Category::AttentionKvB
    )
}

/// `tensor_allows_quantization` for the names these files have: 2-D or 3-D weights that are
/// not norms or routers.
fn allows_quantization(name: &str, ne: &[u64]) -> bool {
    ne.len() >= 2
        && name.ends_with("weight")
        && !name.contains("_norm.weight")
        && !name.contains("ffn_gate_inp.weight")
}

/// llama-quant.cpp's `use_more_bits`.
pub fn use_more_bits(i_layer: usize, n_layers: usize) -> bool {
    let (i, n) = (i_layer as i64, n_layers as i64);
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// The layer in a `blk.N.` name.
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// `tensor_type_fallback`: a type whose block does not divide the row length `ncols`
/// becomes one with 32-value blocks, then F16.
pub fn fallback(ty: SynthType, ncols: u64) -> SynthType {
    if ncols.is_multiple_of(ty.block_size()) {
        return ty;
    }
    let t = match ty {
        SynthType::Q4_K => SynthType::Q5_0,
        SynthType::Q5_K => SynthType::Q5_1,
        SynthType::Q6_K => SynthType::Q8_0,
        other => other,
    };
    if ncols.is_multiple_of(t.block_size()) {
        t
    } else {
        SynthType::F16
    }
}

/// The `Q4_K_M` type of each tensor of a file with `n_layer` layers and `n_expert` experts
/// (`tensors` as [`Shape::tensors`] gives them), as `llama-quantize` would pick them from a
/// source whose norms and routers are F32: tensors are visited in llama.cpp's order (by
/// layer, then by name) since the `attn_v` rule counts them.
pub fn q4_k_m_types(
    n_layer: usize,
    n_expert: usize,
    tensors: &[(String, Vec<u64>)],
) -> Vec<SynthType> {
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by(|&a, &b| {
        let key = |i: usize| {
            (
                layer_of(&tensors[i].0).map_or(-1, |l| l as i64),
                &tensors[i].0,
            )
        };
        key(a).cmp(&key(b))
    });
    let n_attention_wv = tensors
        .iter()
        .filter(|(n, _)| is_attn_v_like(category(n)))
        .count();
    let tied = !tensors.iter().any(|(n, _)| n == "output.weight");
    let (mut i_attention_wv, mut i_ffn_down) = (0usize, 0usize);
    let mut types = vec![SynthType::F32; tensors.len()];
    for i in order {
        let (name, ne) = &tensors[i];
        if !allows_quantization(name, ne) {
            continue; // stays as the source has it: F32
        }
        let cat = category(name);
        let mut t = SynthType::Q4_K;
        if cat == Category::Output || (tied && cat == Category::TokenEmbd) {
            t = if ne[0].is_multiple_of(t.block_size()) {
                SynthType::Q6_K
            } else {
                SynthType::Q8_0
            };
        } else if cat == Category::TokenEmbd {
            // the default
        } else if is_attn_v_like(cat) {
            if use_more_bits(i_attention_wv, n_attention_wv) {
                t = SynthType::Q6_K;
            }
            if n_expert == 8 {
                t = SynthType::Q8_0;
            }
            i_attention_wv += 1;
        } else if cat == Category::AttentionK {
            if n_expert == 8 {
                t = SynthType::Q8_0;
            }
        } else if cat == Category::FfnDown {
            let layer = if n_expert > 1 {
                layer_of(name).unwrap_or(i_ffn_down)
            } else {
                i_ffn_down
            };
            if use_more_bits(layer, n_layer) {
                t = SynthType::Q6_K;
            }
            i_ffn_down += 1;
        } else if cat == Category::AttentionOutput && n_expert == 8 {
            t = SynthType::Q5_K;
        }
        // attn_q, ffn_gate, ffn_up, other: the default
        types[i] = fallback(t, ne[0]);
    }
    types
}

// ---------------------------------------------------------------------------------------
// The plan: header and tensor layout
// ---------------------------------------------------------------------------------------

/// What a tensor's values are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fill {
    /// A weight matrix: mean 0, deviation [`WEIGHT_STD`].
    Weight,
    /// A norm: uniform in `1 ± NORM_SPREAD`.
    Norm,
}

/// One tensor of the file.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthTensor {
    /// GGUF name.
    pub name: String,
    /// Dimensions, innermost first.
    pub ne: Vec<u64>,
    /// Type.
    pub ty: SynthType,
    /// What its values are.
    pub fill: Fill,
    /// Offset in the data section (a multiple of the alignment).
    pub offset: u64,
    /// Data bytes (without padding).
    pub size: u64,
}

impl SynthTensor {
    /// Values in the tensor.
    pub fn n_elements(&self) -> u64 {
        self.ne.iter().product()
    }

    /// Whether this is a routed expert tensor (`*_exps`), read at `used / count` per token.
    pub fn is_routed_expert(&self) -> bool {
        self.name.contains("_exps.")
    }
}

/// A file laid out: the header bytes and where each tensor goes.
#[derive(Debug, Clone)]
pub struct SynthPlan {
    /// The shape.
    pub shape: Shape,
    /// Everything before the data section: metadata, tensor infos, padding.
    pub header: Vec<u8>,
    /// The tensors in file order.
    pub tensors: Vec<SynthTensor>,
    /// Alignment of the data section and of each tensor.
    pub alignment: u64,
    /// File length.
    pub total_len: u64,
}

fn pad_to(n: u64, align: u64) -> u64 {
    n.div_ceil(align) * align
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> TestkitError + '_ {
    move |source| TestkitError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The metadata (hyperparameters under llama.cpp's converter keys, then the tokenizer).
fn metadata(s: &Shape) -> GgufWriter {
    let a = s.arch.gguf_name();
    let k = |key: &str| format!("{a}.{key}");
    let u = |x: usize| x as u32;
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", a)
        .add_kv("general.type", "model")
        .add_kv("general.name", s.general_name())
        .add_kv(
            "general.description",
            format!(
                "Synthetic benchmark file from shoal-testkit: {}'s shapes at {} of {} layers with \
                 {} and random weights. Speed figures are real; generated text is meaningless.",
                s.model,
                s.n_layer,
                s.model_layers,
                s.mix.describe()
            ),
        )
        .add_kv("general.file_type", s.mix.file_type())
        .add_kv("general.quantization_version", 2u32)
        .add_kv(k("block_count"), u(s.block_count()))
        .add_kv(k("context_length"), u(s.context_length))
        .add_kv(k("embedding_length"), u(s.hidden))
        .add_kv(k("feed_forward_length"), u(s.ffn))
        .add_kv(k("attention.head_count"), u(s.n_head))
        .add_kv(
            k("attention.head_count_kv"),
            if s.mla.is_some() { 1 } else { u(s.n_kv_head) },
        )
        .add_kv(k("rope.freq_base"), s.rope_theta)
        .add_kv(k("attention.layer_norm_rms_epsilon"), s.rms_eps)
        .add_kv(k("vocab_size"), u(s.vocab));
    if s.experts.count > 0 {
        w.add_kv(k("expert_count"), u(s.experts.count))
            .add_kv(k("expert_used_count"), u(s.experts.used));
    }
    if let Some(eff) = s.experts.ffn {
        w.add_kv(k("expert_feed_forward_length"), u(eff));
    }
    match &s.mla {
        Some(m) => {
            w.add_kv(k("rope.dimension_count"), u(m.rope_dim))
                .add_kv(k("leading_dense_block_count"), u(s.experts.leading_dense))
                .add_kv(k("attention.kv_lora_rank"), u(m.kv_lora_rank))
                .add_kv(k("attention.key_length"), u(m.kv_lora_rank + m.rope_dim))
                .add_kv(k("attention.value_length"), u(m.kv_lora_rank))
                .add_kv(k("attention.key_length_mla"), u(m.nope_dim + m.rope_dim))
                .add_kv(k("attention.value_length_mla"), u(m.v_dim))
                .add_kv(k("expert_shared_count"), u(s.experts.shared));
        }
        None if s.arch == SynthArch::Glm4Moe => {
            w.add_kv(k("rope.dimension_count"), u(s.head_dim / 2))
                .add_kv(k("attention.key_length"), u(s.head_dim))
                .add_kv(k("attention.value_length"), u(s.head_dim))
                .add_kv(k("leading_dense_block_count"), u(s.experts.leading_dense))
                .add_kv(k("expert_shared_count"), u(s.experts.shared))
                .add_kv(k("nextn_predict_layers"), u(s.nextn_layers()));
        }
        None => {
            w.add_kv(k("rope.dimension_count"), u(s.head_dim));
            if matches!(s.arch, SynthArch::Qwen3Moe | SynthArch::GptOss) {
                w.add_kv(k("attention.key_length"), u(s.head_dim))
                    .add_kv(k("attention.value_length"), u(s.head_dim));
            }
        }
    }
    if let Some(v) = s.experts.weights_scale {
        w.add_kv(k("expert_weights_scale"), v);
    }
    if let Some(v) = s.experts.weights_norm {
        w.add_kv(k("expert_weights_norm"), v);
    }
    if let Some(v) = s.experts.gating_func {
        w.add_kv(k("expert_gating_func"), v);
    }
    if let Some(y) = &s.yarn {
        w.add_kv(k("rope.scaling.type"), "yarn")
            .add_kv(k("rope.scaling.factor"), y.factor)
            .add_kv(
                k("rope.scaling.original_context_length"),
                y.original_context,
            )
            .add_kv(k("rope.scaling.yarn_beta_fast"), y.beta_fast)
            .add_kv(k("rope.scaling.yarn_beta_slow"), y.beta_slow);
        if y.log_multiplier != 0.0 {
            w.add_kv(k("rope.scaling.yarn_log_multiplier"), y.log_multiplier);
        }
    }
    if s.arch == SynthArch::GptOss {
        w.add_kv(k("attention.sliding_window"), 128u32);
    }
    let tok = TinyTokenizer::new();
    let (tokens, types) = tok.gguf_tokens(s.vocab);
    w.add_kv("tokenizer.ggml.model", "gpt2")
        .add_kv("tokenizer.ggml.pre", s.arch.pre_tokenizer().gguf_name())
        .add_kv("tokenizer.ggml.tokens", GgufValue::strings(tokens))
        .add_kv("tokenizer.ggml.token_type", GgufValue::i32s(types))
        .add_kv(
            "tokenizer.ggml.merges",
            GgufValue::strings(tok.gguf_merges()),
        )
        .add_kv("tokenizer.ggml.bos_token_id", tok.bos_id())
        .add_kv("tokenizer.ggml.eos_token_id", tok.eos_id())
        .add_kv("tokenizer.ggml.padding_token_id", tok.bos_id())
        .add_kv("tokenizer.ggml.add_bos_token", false)
        .add_kv("tokenizer.chat_template", CHATML_TEMPLATE);
    w
}

fn push_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

impl SynthPlan {
    /// Lays out `shape`'s file: types, offsets and the header bytes.
    ///
    /// # Errors
    /// When the shape is invalid (too small a vocabulary, zero sizes, or experts without
    /// layers that route through them).
    pub fn new(shape: &Shape) -> Result<SynthPlan, TestkitError> {
        let s = shape;
        let tok_len = TinyTokenizer::new().len();
        let bad = |m: String| Err(TestkitError::InvalidSpec(format!("shape {}: {m}", s.name)));
        if s.vocab < tok_len {
            return bad(format!(
                "vocab {} is below the tokenizer's {tok_len} tokens",
                s.vocab
            ));
        }
        if s.hidden == 0 || s.n_head == 0 || s.n_layer == 0 {
            return bad("hidden, heads and layers must be above 0".into());
        }
        let dense = s.arch == SynthArch::Llama;
        if dense != (s.experts.count == 0) {
            return bad(format!(
                "{} experts in a {} shape",
                s.experts.count,
                if dense { "dense" } else { "mixture-of-experts" }
            ));
        }
        if !dense && (s.experts.used == 0 || s.experts.used > s.experts.count) {
            return bad(format!(
                "uses {} of {} experts",
                s.experts.used, s.experts.count
            ));
        }
        let list = s.tensors();
        let types = match s.mix {
            Mix::Mxfp4Moe => gpt_oss_types(&list),
            Mix::Q4KM => q4_k_m_types(s.block_count(), s.experts.count, &list),
            Mix::Pure(t) => pure_types(t, &list),
        };
        let alignment = u64::from(GGUF_DEFAULT_ALIGNMENT);
        let mut tensors = Vec::with_capacity(list.len());
        let mut rel = 0u64;
        for ((name, ne), ty) in list.into_iter().zip(types) {
            let n: u64 = ne.iter().product();
            let size = ty.bytes_for(n).ok_or_else(|| {
                TestkitError::InvalidSpec(format!(
                    "{name}: {n} values are not whole {} blocks",
                    ty.name()
                ))
            })?;
            // gpt-oss's biases and sinks are 1-D too, but weights
            let fill = if ne.len() == 1 && name.contains("norm") {
                Fill::Norm
            } else {
                Fill::Weight
            };
            tensors.push(SynthTensor {
                name,
                ne,
                ty,
                fill,
                offset: rel,
                size,
            });
            rel = pad_to(rel + size, alignment);
        }

        let mut w = metadata(s);
        w.override_tensor_count(Some(tensors.len() as u64));
        let (bytes, layout) = w.build()?;
        let mut header = bytes[..layout.tensor_infos_start].to_vec();
        for t in &tensors {
            push_str(&mut header, &t.name);
            header.extend_from_slice(&(t.ne.len() as u32).to_le_bytes());
            for d in &t.ne {
                header.extend_from_slice(&d.to_le_bytes());
            }
            header.extend_from_slice(&t.ty.id().to_le_bytes());
            header.extend_from_slice(&t.offset.to_le_bytes());
        }
        header.resize(pad_to(header.len() as u64, alignment) as usize, 0);
        let total_len = header.len() as u64 + rel;
        Ok(SynthPlan {
            shape: s.clone(),
            header,
            tensors,
            alignment,
            total_len,
        })
    }

    /// Byte position of the data section.
    pub fn data_start(&self) -> u64 {
        self.header.len() as u64
    }

    /// Weight bytes read per decoded token: every block tensor, routed experts (`*_exps`) at
    /// `used / count` of their size (rounded down per tensor), plus `output.weight`; the way
    /// shoal's `weight_bytes_per_token` counts.
    pub fn active_bytes_per_token(&self) -> u64 {
        let (used, count) = (
            self.shape.experts.used as u128,
            self.shape.experts.count as u128,
        );
        // the prediction layers are not read to decode a token
        let blocks: u64 = self
            .tensors
            .iter()
            .filter(|t| layer_of(&t.name).is_some_and(|l| l < self.shape.n_layer))
            .map(|t| {
                if t.is_routed_expert() {
                    (u128::from(t.size) * used / count) as u64
                } else {
                    t.size
                }
            })
            .sum();
        let head = self
            .tensors
            .iter()
            .find(|t| t.name == "output.weight")
            .map_or(0, |t| t.size);
        blocks + head
    }

    /// Tensor count and bytes per type.
    pub fn bytes_by_type(&self) -> BTreeMap<SynthType, (usize, u64)> {
        let mut m = BTreeMap::new();
        for t in &self.tensors {
            let e = m.entry(t.ty).or_insert((0, 0));
            e.0 += 1;
            e.1 += t.size;
        }
        m
    }

    /// The mix as lines `role: type (layers)`, one per tensor role and type, e.g.
    /// `ffn_down_exps.weight  q6_K  layers 0-2,5,8`.
    pub fn mix_lines(&self) -> Vec<String> {
        let mut roles: Vec<(String, BTreeMap<SynthType, Vec<usize>>)> = Vec::new();
        for t in &self.tensors {
            let (role, layer) = match layer_of(&t.name) {
                Some(l) => (
                    t.name
                        .split_once('.')
                        .unwrap()
                        .1
                        .split_once('.')
                        .unwrap()
                        .1
                        .to_string(),
                    Some(l),
                ),
                None => (t.name.clone(), None),
            };
            let idx = match roles.iter().position(|(r, _)| *r == role) {
                Some(i) => i,
                None => {
                    roles.push((role, BTreeMap::new()));
                    roles.len() - 1
                }
            };
            let layers = roles[idx].1.entry(t.ty).or_default();
            layers.extend(layer);
        }
        let mut lines = Vec::new();
        for (role, by_type) in roles {
            for (ty, layers) in by_type {
                let where_ = if layers.is_empty() {
                    String::new()
                } else {
                    format!("layers {}", ranges(&layers))
                };
                lines.push(format!("{role:<28} {:<5} {where_}", ty.name()));
            }
        }
        lines
    }

    /// Writes the file to `path` (through `path` + `.tmp`, renamed when complete and synced;
    /// removed on error). `progress(done, total)` is called after each tensor with the bytes
    /// written so far.
    ///
    /// # Errors
    /// When writing fails.
    pub fn write(
        &self,
        path: impl AsRef<Path>,
        mut progress: impl FnMut(u64, u64),
    ) -> Result<(), TestkitError> {
        let path = path.as_ref();
        let tmp = tmp_path(path);
        match self.write_data(&tmp, &mut progress) {
            Ok(()) => std::fs::rename(&tmp, path).map_err(io_err(path)),
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                Err(e)
            }
        }
    }

    fn write_data(
        &self,
        tmp: &Path,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<(), TestkitError> {
        let file = File::create(tmp).map_err(io_err(tmp))?;
        let mut w = BufWriter::with_capacity(8 << 20, file);
        w.write_all(&self.header).map_err(io_err(tmp))?;
        let mut pos = self.data_start();
        let mut buf = Vec::new();
        for t in &self.tensors {
            debug_assert_eq!(pos, self.data_start() + t.offset);
            let mut rng = SplitMix64::new(tensor_seed(self.shape.seed, &t.name));
            let bb = t.ty.block_bytes();
            let chunk_blocks = (CHUNK_BYTES as u64 / bb).max(1);
            let mut left = t.size / bb;
            while left > 0 {
                let nb = left.min(chunk_blocks);
                buf.resize((nb * bb) as usize, 0);
                fill_blocks(t.ty, t.fill, &mut rng, &mut buf);
                w.write_all(&buf).map_err(io_err(tmp))?;
                left -= nb;
            }
            pos += t.size;
            let padded = pad_to(pos, self.alignment);
            w.write_all(&vec![0u8; (padded - pos) as usize])
                .map_err(io_err(tmp))?;
            pos = padded;
            progress(pos, self.total_len);
        }
        debug_assert_eq!(pos, self.total_len);
        let file = w.into_inner().map_err(|e| TestkitError::Io {
            path: tmp.to_path_buf(),
            source: e.into_error(),
        })?;
        file.sync_all().map_err(io_err(tmp))?;
        let len = file.metadata().map_err(io_err(tmp))?.len();
        if len != self.total_len {
            return Err(TestkitError::Io {
                path: tmp.to_path_buf(),
                source: std::io::Error::other(format!(
                    "wrote {len} bytes, expected {}",
                    self.total_len
                )),
            });
        }
        Ok(())
    }
}

/// `PATH.tmp`.
pub fn tmp_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_os_string();
    s.push(".tmp");
    PathBuf::from(s)
}

/// `0-2,5,8,20-23`.
fn ranges(xs: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < xs.len() {
        let mut j = i;
        while j + 1 < xs.len() && xs[j + 1] == xs[j] + 1 {
            j += 1;
        }
        out.push(if j == i {
            xs[i].to_string()
        } else {
            format!("{}-{}", xs[i], xs[j])
        });
        i = j + 1;
    }
    out.join(",")
}

/// Stable per-tensor seed (FNV-1a of the name mixed with the shape's seed).
fn tensor_seed(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

// ---------------------------------------------------------------------------------------
// Random blocks
// ---------------------------------------------------------------------------------------

fn random_bytes(rng: &mut SplitMix64, out: &mut [u8]) {
    let mut chunks = out.chunks_exact_mut(8);
    for c in &mut chunks {
        c.copy_from_slice(&rng.next_u64().to_le_bytes());
    }
    let rest = chunks.into_remainder();
    if !rest.is_empty() {
        let b = rng.next_u64().to_le_bytes();
        let n = rest.len();
        rest.copy_from_slice(&b[..n]);
    }
}

/// Packs eight 6-bit scales and minimums as `Q4_K` and `Q5_K` store them.
fn pack_k4_scales(sc: &[u8; 8], mn: &[u8; 8]) -> [u8; 12] {
    let mut p = [0u8; 12];
    for j in 0..4 {
        p[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        p[j + 4] = (mn[j] & 63) | ((mn[j + 4] >> 4) << 6);
        p[j + 8] = (sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4);
    }
    p
}

/// Sub-block scales of `Q4_K`/`Q5_K`: uniform in `K4_SCALE_LO..K4_SCALE_LO + K4_SCALE_SPAN`.
const K4_SCALE_LO: u8 = 40;
const K4_SCALE_SPAN: u8 = 24;
/// The E8M0 scale byte of every MXFP4 block (scale `2^(e - 127)`).
const MXFP4_SCALE_EXPONENT: u8 = 120;
/// `Q6_K` sub-block scale magnitudes: uniform in `64..128`, random sign.
const Q6_SCALE_LO: u8 = 64;

/// Root mean square of a uniform integer in `lo..lo + span`.
fn uniform_int_rms(lo: f32, span: f32) -> f32 {
    let mean = lo + (span - 1.0) / 2.0;
    (mean * mean + (span * span - 1.0) / 12.0).sqrt()
}

/// Fills `buf` (whole blocks of `ty`) with random values as [`Fill`] says.
fn fill_blocks(ty: SynthType, fill: Fill, rng: &mut SplitMix64, buf: &mut [u8]) {
    let sigma = WEIGHT_STD;
    let h = |x: f32| f16::from_f32(x).to_le_bytes();
    let float = |rng: &mut SplitMix64| -> f32 {
        match fill {
            Fill::Norm => rng.uniform(1.0 - NORM_SPREAD, 1.0 + NORM_SPREAD),
            // uniform with deviation sigma
            Fill::Weight => rng.uniform(-1.0, 1.0) * sigma * 3f32.sqrt(),
        }
    };
    match ty {
        SynthType::F32 => {
            for v in buf.chunks_exact_mut(4) {
                v.copy_from_slice(&float(rng).to_le_bytes());
            }
        }
        SynthType::F16 => {
            for v in buf.chunks_exact_mut(2) {
                v.copy_from_slice(&h(float(rng)));
            }
        }
        SynthType::Q8_0 => {
            // d * q with q uniform in -128..128 (mean -0.5: a bias of 0.7 % of the deviation;
            // ggml's Q8_0 scales are never negative, so neither are these)
            random_bytes(rng, buf);
            let d = h(sigma / uniform_int_std(256.0));
            for block in buf.chunks_exact_mut(34) {
                block[..2].copy_from_slice(&d);
            }
        }
        SynthType::Q5_0 => {
            // d * q with q uniform in -16..16; d of random sign (as ggml's can be) so the
            // half-step bias of q cancels
            random_bytes(rng, buf);
            let d = sigma / uniform_int_std(32.0);
            let (pos, neg) = (h(d), h(-d));
            let mut signs = 0u64;
            for (i, block) in buf.chunks_exact_mut(22).enumerate() {
                if i % 64 == 0 {
                    signs = rng.next_u64();
                }
                let s = if (signs >> (i % 64)) & 1 == 1 {
                    neg
                } else {
                    pos
                };
                block[..2].copy_from_slice(&s);
            }
        }
        SynthType::Q5_1 => {
            // d * q + m with q uniform in 0..32 and m = -15.5 d
            random_bytes(rng, buf);
            let d = sigma / uniform_int_std(32.0);
            let (dd, m) = (h(d), h(-15.5 * d));
            for block in buf.chunks_exact_mut(24) {
                block[..2].copy_from_slice(&dd);
                block[2..4].copy_from_slice(&m);
            }
        }
        SynthType::Q4_K | SynthType::Q5_K => {
            // d*sc * q - dmin*m with m = sc and dmin = d * mean(q): d*sc * (q - mean(q))
            random_bytes(rng, buf);
            let levels = if ty == SynthType::Q4_K { 16.0 } else { 32.0 };
            let rms_sc = uniform_int_rms(f32::from(K4_SCALE_LO), f32::from(K4_SCALE_SPAN));
            let d = sigma / (uniform_int_std(levels) * rms_sc);
            let dmin = d * (levels - 1.0) / 2.0;
            let (dd, dm) = (h(d), h(dmin));
            let bb = ty.block_bytes() as usize;
            for block in buf.chunks_exact_mut(bb) {
                let r = rng.next_u64().to_le_bytes();
                let sc: [u8; 8] = std::array::from_fn(|j| K4_SCALE_LO + r[j] % K4_SCALE_SPAN);
                block[..2].copy_from_slice(&dd);
                block[2..4].copy_from_slice(&dm);
                block[4..16].copy_from_slice(&pack_k4_scales(&sc, &sc));
            }
        }
        SynthType::MXFP4 => {
            // random E2M1 codes (root mean square 2.93) under the scale 2^(120 - 127): a
            // deviation of 0.023
            random_bytes(rng, buf);
            for block in buf.chunks_exact_mut(17) {
                block[0] = MXFP4_SCALE_EXPONENT;
            }
        }
        SynthType::IQ1_S => GridIquant::Iq1S.fill_random(rng, buf),
        SynthType::IQ2_XXS => GridIquant::Iq2Xxs.fill_random(rng, buf),
        SynthType::IQ3_S => GridIquant::Iq3S.fill_random(rng, buf),
        SynthType::IQ4_XS => {
            // d * (ls - 32) * grid[q]: 6-bit scales ls and codes q uniform (random bytes)
            random_bytes(rng, buf);
            let grid_rms = (IQ4_GRID.iter().map(|&g| f32::from(g).powi(2)).sum::<f32>()
                / IQ4_GRID.len() as f32)
                .sqrt();
            let d = h(sigma / (uniform_int_rms(-32.0, 64.0) * grid_rms));
            for block in buf.chunks_exact_mut(136) {
                block[..2].copy_from_slice(&d);
            }
        }
        SynthType::Q6_K => {
            // d * scale * (q - 32), q uniform in 0..64, scales of random sign
            random_bytes(rng, buf);
            let rms_sc = uniform_int_rms(f32::from(Q6_SCALE_LO), 64.0);
            let d = h(sigma / (uniform_int_std(64.0) * rms_sc));
            for block in buf.chunks_exact_mut(210) {
                let (a, b) = (rng.next_u64().to_le_bytes(), rng.next_u64().to_le_bytes());
                let signs = rng.next_u64();
                for j in 0..16 {
                    let r = if j < 8 { a[j] } else { b[j - 8] };
                    let mag = (Q6_SCALE_LO + r % 64) as i8;
                    let s = if (signs >> j) & 1 == 1 { -mag } else { mag };
                    block[192 + j] = s as u8;
                }
                block[208..210].copy_from_slice(&d);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf_writer::parse::parse;
    use crate::quants::{dequantize, GgmlType};

    fn types_of(s: &Shape) -> BTreeMap<String, SynthType> {
        let list = s.tensors();
        let types = q4_k_m_types(s.n_layer, s.experts.count, &list);
        list.into_iter().map(|(n, _)| n).zip(types).collect()
    }

    #[test]
    fn use_more_bits_matches_llama_cpp() {
        // hand-computed from llama-quant.cpp: i < n/8 || i >= 7n/8 || (i - n/8) % 3 == 2
        let pick = |n: usize| -> Vec<usize> { (0..n).filter(|&i| use_more_bits(i, n)).collect() };
        assert_eq!(pick(24), vec![0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]);
        assert_eq!(
            pick(27),
            vec![0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26]
        );
        assert_eq!(pick(8), vec![0, 3, 6, 7]);
        assert_eq!(
            pick(32),
            vec![0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
        );
    }

    #[test]
    fn fallback_matches_llama_cpp() {
        assert_eq!(fallback(SynthType::Q4_K, 1408), SynthType::Q5_0);
        assert_eq!(fallback(SynthType::Q6_K, 10_944), SynthType::Q8_0);
        assert_eq!(fallback(SynthType::Q5_K, 96), SynthType::Q5_1);
        assert_eq!(fallback(SynthType::Q4_K, 2816), SynthType::Q4_K);
        assert_eq!(fallback(SynthType::Q4_K, 100), SynthType::F16);
        assert_eq!(fallback(SynthType::Q8_0, 48), SynthType::F16);
    }

    #[test]
    fn qwen3_mix() {
        let t = types_of(&shape("qwen3-30b-a3b").unwrap());
        use SynthType::*;
        let expect = [
            ("token_embd.weight", Q4_K),
            ("output.weight", Q6_K),
            ("output_norm.weight", F32),
            ("blk.0.attn_v.weight", Q6_K),
            ("blk.3.attn_v.weight", Q4_K),
            ("blk.5.attn_v.weight", Q6_K),
            ("blk.21.attn_v.weight", Q6_K),
            ("blk.4.attn_q.weight", Q4_K),
            ("blk.4.attn_k.weight", Q4_K),
            ("blk.4.attn_output.weight", Q4_K),
            ("blk.4.attn_q_norm.weight", F32),
            ("blk.4.ffn_gate_inp.weight", F32),
            ("blk.4.ffn_gate_exps.weight", Q4_K),
            ("blk.4.ffn_up_exps.weight", Q4_K),
            ("blk.4.ffn_down_exps.weight", Q4_K),
            ("blk.8.ffn_down_exps.weight", Q6_K),
            ("blk.23.ffn_down_exps.weight", Q6_K),
        ];
        for (name, ty) in expect {
            assert_eq!(t[name], ty, "{name}");
        }
    }

    #[test]
    fn deepseek_mix() {
        let t = types_of(&shape("deepseek-v2-lite").unwrap());
        use SynthType::*;
        let expect = [
            ("token_embd.weight", Q4_K),
            ("output.weight", Q6_K),
            ("blk.0.attn_q.weight", Q4_K),
            ("blk.0.attn_kv_a_mqa.weight", Q4_K),
            ("blk.0.attn_kv_a_norm.weight", F32),
            ("blk.0.attn_k_b.weight", Q5_0), // rows of 128
            ("blk.0.attn_v_b.weight", Q4_K), // rows of 512
            ("blk.0.attn_output.weight", Q4_K),
            ("blk.0.ffn_gate.weight", Q4_K),
            ("blk.0.ffn_down.weight", Q8_0), // Q6_K, rows of 10944
            ("blk.1.ffn_gate_inp.weight", F32),
            ("blk.1.ffn_down_exps.weight", Q8_0), // Q6_K, rows of 1408
            ("blk.3.ffn_down_exps.weight", Q5_0), // Q4_K, rows of 1408
            ("blk.3.ffn_gate_exps.weight", Q4_K),
            ("blk.3.ffn_down_shexp.weight", Q4_K), // rows of 2816
            ("blk.5.ffn_down_shexp.weight", Q6_K),
            ("blk.26.ffn_down_shexp.weight", Q6_K),
            ("blk.22.ffn_down_exps.weight", Q5_0),
            ("blk.23.ffn_down_exps.weight", Q8_0),
        ];
        for (name, ty) in expect {
            assert_eq!(t[name], ty, "{name}");
        }
        assert!(!t.contains_key("blk.0.ffn_gate_inp.weight"));
        assert!(!t.contains_key("blk.1.ffn_down.weight"));
    }

    #[test]
    fn mixtral_mix() {
        let t = types_of(&shape("mixtral-8x7b").unwrap());
        use SynthType::*;
        for l in 0..8 {
            assert_eq!(t[&format!("blk.{l}.attn_v.weight")], Q8_0);
            assert_eq!(t[&format!("blk.{l}.attn_k.weight")], Q8_0);
            assert_eq!(t[&format!("blk.{l}.attn_output.weight")], Q5_K);
            assert_eq!(t[&format!("blk.{l}.attn_q.weight")], Q4_K);
            assert_eq!(t[&format!("blk.{l}.ffn_gate_exps.weight")], Q4_K);
            let down = if [0, 3, 6, 7].contains(&l) {
                Q6_K
            } else {
                Q4_K
            };
            assert_eq!(t[&format!("blk.{l}.ffn_down_exps.weight")], down, "{l}");
        }
        assert_eq!(t["output.weight"], Q6_K);
        assert_eq!(t["token_embd.weight"], Q4_K);
    }

    /// The attn_v counter follows llama.cpp's order (by layer, then name), not file order.
    #[test]
    fn attn_v_counter_is_by_layer() {
        let list: Vec<(String, Vec<u64>)> = (0..16)
            .rev()
            .map(|l| (format!("blk.{l}.attn_v.weight"), vec![256, 256]))
            .chain([("output.weight".to_string(), vec![256, 320])])
            .collect();
        let types = q4_k_m_types(16, 1, &list);
        for ((name, _), ty) in list.iter().zip(types) {
            let l = layer_of(name).unwrap_or(0);
            let want = if name == "output.weight" || use_more_bits(l, 16) {
                SynthType::Q6_K
            } else {
                SynthType::Q4_K
            };
            assert_eq!(ty, want, "{name}");
        }
    }

    /// A tiny made-up DeepSeek-like shape with a fallback type in it.
    fn tiny() -> Shape {
        Shape {
            name: "tiny",
            aliases: &[],
            model: "Tiny",
            arch: SynthArch::Deepseek2,
            n_layer: 3,
            model_layers: 4,
            hidden: 256,
            n_head: 2,
            n_kv_head: 2,
            head_dim: 96,
            ffn: 288,
            vocab: 320,
            context_length: 512,
            rope_theta: 10_000.0,
            rms_eps: 1e-6,
            experts: Experts {
                count: 4,
                used: 2,
                ffn: Some(96),
                shared: 1,
                leading_dense: 1,
                gating_func: Some(1),
                weights_scale: Some(1.0),
                weights_norm: Some(false),
            },
            mla: Some(Mla {
                kv_lora_rank: 256,
                rope_dim: 32,
                nope_dim: 64,
                v_dim: 64,
            }),
            yarn: Some(Yarn {
                factor: 4.0,
                original_context: 128,
                beta_fast: 32.0,
                beta_slow: 1.0,
                log_multiplier: 0.0707,
            }),
            mix: Mix::Q4KM,
            seed: 7,
        }
    }

    #[test]
    fn header_offsets_and_sizes() {
        let plan = SynthPlan::new(&tiny()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        let mut calls = 0;
        plan.write(&path, |done, total| {
            calls += 1;
            assert!(done <= total);
        })
        .unwrap();
        assert_eq!(calls, plan.tensors.len());
        assert!(!tmp_path(&path).exists());
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes.len() as u64, plan.total_len);
        let p = parse(&bytes).unwrap();
        assert_eq!(p.version, 3);
        assert_eq!(p.data_start as u64, plan.data_start());
        assert_eq!(p.data_start % 32, 0);
        let kv = |k: &str| p.kvs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        assert_eq!(kv("deepseek2.block_count"), Some(GgufValue::U32(3)));
        assert_eq!(
            kv("deepseek2.attention.key_length"),
            Some(GgufValue::U32(288))
        );
        assert_eq!(
            kv("deepseek2.attention.key_length_mla"),
            Some(GgufValue::U32(96))
        );
        assert_eq!(
            kv("deepseek2.attention.head_count_kv"),
            Some(GgufValue::U32(1))
        );
        assert_eq!(kv("general.file_type"), Some(GgufValue::U32(15)));
        match kv("tokenizer.ggml.tokens") {
            Some(GgufValue::Array(_, items)) => assert_eq!(items.len(), 320),
            other => panic!("{other:?}"),
        }
        // the infos, in order, with offsets aligned and each tensor's bytes before the next
        assert_eq!(p.tensors.len(), plan.tensors.len());
        let mut end = 0u64;
        for ((name, ne, ty, off), t) in p.tensors.iter().zip(&plan.tensors) {
            assert_eq!((name, ne, *ty, *off), (&t.name, &t.ne, t.ty.id(), t.offset));
            assert_eq!(off % 32, 0, "{name}");
            assert!(*off >= end, "{name}");
            assert_eq!(*off, end.div_ceil(32) * 32, "{name}");
            let n: u64 = ne.iter().product();
            assert_eq!(t.size, n / t.ty.block_size() * t.ty.block_bytes());
            end = off + t.size;
        }
        assert_eq!(plan.total_len, plan.data_start() + end.div_ceil(32) * 32);
        // a by-hand size: attn_k_b is {64, 256, 2} -> rows of 64 -> Q5_0, 32768 values
        let kb = plan
            .tensors
            .iter()
            .find(|t| t.name == "blk.1.attn_k_b.weight")
            .unwrap();
        assert_eq!(kb.ty, SynthType::Q5_0);
        assert_eq!(kb.size, 64 * 256 * 2 / 32 * 22);
        // the expert down projection has rows of 96: Q5_0 or (more bits) Q8_0
        let down = |l: usize| {
            plan.tensors
                .iter()
                .find(|t| t.name == format!("blk.{l}.ffn_down_exps.weight"))
                .unwrap()
                .ty
        };
        assert_eq!(down(1), SynthType::Q5_0);
        assert_eq!(down(2), SynthType::Q8_0);
        // writing twice gives the same bytes
        let again = dir.path().join("again.gguf");
        plan.write(&again, |_, _| {}).unwrap();
        assert_eq!(std::fs::read(&again).unwrap(), bytes);
        // every tensor's values are finite and scaled as documented
        for t in &plan.tensors {
            let start = (plan.data_start() + t.offset) as usize;
            let data = &bytes[start..start + t.size as usize];
            let v = decode(t.ty, data);
            assert_eq!(v.len() as u64, t.n_elements(), "{}", t.name);
            assert!(v.iter().all(|x| x.is_finite()), "{}", t.name);
            let n = v.len() as f64;
            let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
            let sd = (v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
            match t.fill {
                Fill::Norm => {
                    assert!((mean - 1.0).abs() < 0.01, "{} mean {mean}", t.name);
                    assert!(v.iter().all(|x| (x - 1.0).abs() <= NORM_SPREAD + 1e-6));
                }
                Fill::Weight => {
                    let s = WEIGHT_STD as f64;
                    assert!(mean.abs() < 0.1 * s, "{} {:?} mean {mean}", t.name, t.ty);
                    assert!((sd / s - 1.0).abs() < 0.1, "{} {:?} sd {sd}", t.name, t.ty);
                }
            }
        }
        let by_type = plan.bytes_by_type();
        assert!(by_type.contains_key(&SynthType::Q6_K));
        assert!(by_type.contains_key(&SynthType::Q5_0));
    }

    /// A tiny gpt-oss-like shape: every tensor kind of the real one, small.
    fn tiny_gpt_oss() -> Shape {
        Shape {
            name: "tiny-gpt-oss",
            arch: SynthArch::GptOss,
            n_layer: 2,
            model_layers: 2,
            hidden: 64,
            n_head: 4,
            n_kv_head: 2,
            head_dim: 32,
            ffn: 64,
            experts: Experts {
                count: 4,
                used: 2,
                ffn: Some(64),
                shared: 0,
                leading_dense: 0,
                gating_func: None,
                weights_scale: None,
                weights_norm: None,
            },
            mla: None,
            yarn: Some(Yarn {
                factor: 32.0,
                original_context: 4096,
                beta_fast: 32.0,
                beta_slow: 1.0,
                log_multiplier: 0.0,
            }),
            mix: Mix::Mxfp4Moe,
            ..tiny()
        }
    }

    /// A dense `--pure` file: every matrix of its type, norms F32, no expert keys, and the
    /// blocks scaled as documented.
    #[test]
    fn pure_dense_files_hold_every_matrix_in_one_type() {
        let shape = Shape {
            name: "tiny-dense",
            arch: SynthArch::Llama,
            n_layer: 2,
            hidden: 256,
            n_head: 4,
            n_kv_head: 2,
            head_dim: 64,
            ffn: 512,
            experts: Experts {
                count: 0,
                used: 0,
                ffn: None,
                shared: 0,
                leading_dense: 0,
                gating_func: None,
                weights_scale: None,
                weights_norm: None,
            },
            mla: None,
            yarn: None,
            mix: Mix::Pure(SynthType::IQ4_XS),
            ..tiny()
        };
        let plan = SynthPlan::new(&shape).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dense.gguf");
        plan.write(&path, |_, _| {}).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let parsed = parse(&bytes).unwrap();
        let kv = |k: &str| {
            parsed
                .kvs
                .iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.clone())
        };
        assert_eq!(kv("general.file_type"), Some(GgufValue::U32(30)));
        assert_eq!(kv("llama.expert_count"), None);
        for t in &plan.tensors {
            let want = if t.ne.len() == 1 {
                SynthType::F32
            } else {
                SynthType::IQ4_XS
            };
            assert_eq!(t.ty, want, "{}", t.name);
            assert!(!t.name.contains("exps"), "{}", t.name);
            if t.ty == SynthType::IQ4_XS {
                let start = (plan.data_start() + t.offset) as usize;
                let v = decode(t.ty, &bytes[start..start + t.size as usize]);
                let n = v.len() as f64;
                let sd = (v.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / n).sqrt();
                assert!(
                    (sd / WEIGHT_STD as f64 - 1.0).abs() < 0.1,
                    "{} sd {sd}",
                    t.name
                );
            }
        }
        assert_eq!(plan.active_bytes_per_token(), {
            let blocks: u64 = plan
                .tensors
                .iter()
                .filter(|t| t.name.starts_with("blk."))
                .map(|t| t.size)
                .sum();
            blocks + plan.tensors.last().unwrap().size
        });
        // a dense shape with experts, and a mixture without, are refused
        let mut bad = shape.clone();
        bad.experts.count = 2;
        assert!(SynthPlan::new(&bad).is_err());
    }

    #[test]
    fn gpt_oss_files_hold_its_tensors_in_its_types() {
        let plan = SynthPlan::new(&tiny_gpt_oss()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("oss.gguf");
        plan.write(&path, |_, _| {}).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let p = parse(&bytes).unwrap();
        let kv = |k: &str| p.kvs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        assert_eq!(
            kv("general.architecture"),
            Some(GgufValue::String("gpt-oss".into()))
        );
        assert_eq!(
            kv("gpt-oss.attention.sliding_window"),
            Some(GgufValue::U32(128))
        );
        assert_eq!(kv("gpt-oss.attention.key_length"), Some(GgufValue::U32(32)));
        assert_eq!(
            kv("gpt-oss.expert_feed_forward_length"),
            Some(GgufValue::U32(64))
        );
        assert_eq!(
            kv("gpt-oss.rope.scaling.type"),
            Some(GgufValue::String("yarn".into()))
        );
        assert_eq!(kv("gpt-oss.rope.scaling.yarn_log_multiplier"), None);
        assert_eq!(
            kv("general.file_type"),
            Some(GgufValue::U32(FILE_TYPE_MXFP4_MOE))
        );
        let ty = |name: &str| plan.tensors.iter().find(|t| t.name == name).unwrap().ty;
        use SynthType::*;
        for (name, want) in [
            ("token_embd.weight", Q8_0),
            ("output.weight", Q8_0),
            ("blk.1.attn_q.weight", Q8_0),
            ("blk.1.attn_q.bias", F32),
            ("blk.1.attn_output.bias", F32),
            ("blk.1.attn_sinks.weight", F32),
            ("blk.1.post_attention_norm.weight", F32),
            ("blk.1.ffn_gate_inp.weight", F32),
            ("blk.1.ffn_gate_inp.bias", F32),
            ("blk.1.ffn_gate_exps.weight", MXFP4),
            ("blk.1.ffn_up_exps.weight", MXFP4),
            ("blk.1.ffn_down_exps.weight", MXFP4),
            ("blk.1.ffn_gate_exps.bias", F32),
            ("blk.1.ffn_down_exps.bias", F32),
        ] {
            assert_eq!(ty(name), want, "{name}");
        }
        // MXFP4 blocks decode to weights of the documented scale; biases are weights
        for t in &plan.tensors {
            let start = (plan.data_start() + t.offset) as usize;
            let v = decode(t.ty, &bytes[start..start + t.size as usize]);
            let n = v.len() as f64;
            let sd = (v.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / n).sqrt();
            if t.fill == Fill::Weight {
                let s = WEIGHT_STD as f64;
                assert!((sd / s - 1.0).abs() < 0.2, "{} {:?} sd {sd}", t.name, t.ty);
            }
        }
    }

    /// Dequantizes with the kit's reference decoders, or by ggml's formulas for the types the
    /// kit has none for.
    fn decode(ty: SynthType, data: &[u8]) -> Vec<f32> {
        let hf = |b: &[u8]| f16::from_le_bytes([b[0], b[1]]).to_f32();
        let n = |bb: usize, per: usize| data.len() / bb * per;
        match ty {
            SynthType::F32 => data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect(),
            SynthType::F16 => data.chunks_exact(2).map(hf).collect(),
            SynthType::Q8_0 => dequantize(GgmlType::Q8_0, data, n(34, 32)).unwrap(),
            SynthType::Q4_K => dequantize(GgmlType::Q4_K, data, n(144, 256)).unwrap(),
            SynthType::Q6_K => dequantize(GgmlType::Q6_K, data, n(210, 256)).unwrap(),
            SynthType::MXFP4 => dequantize(GgmlType::MXFP4, data, n(17, 32)).unwrap(),
            SynthType::IQ4_XS => dequantize(GgmlType::IQ4_XS, data, n(136, 256)).unwrap(),
            SynthType::IQ1_S | SynthType::IQ2_XXS | SynthType::IQ3_S => {
                panic!("the kit has no decoder for {ty:?}; the engine's tests read these blocks")
            }
            SynthType::Q5_0 | SynthType::Q5_1 => {
                let bb = ty.block_bytes() as usize;
                let mut out = Vec::new();
                for b in data.chunks_exact(bb) {
                    let d = hf(b);
                    let (m, rest) = if ty == SynthType::Q5_1 {
                        (hf(&b[2..]), &b[4..])
                    } else {
                        (-16.0 * d, &b[2..])
                    };
                    let qh = u32::from_le_bytes(rest[..4].try_into().unwrap());
                    let qs = &rest[4..];
                    let mut y = [0f32; 32];
                    for j in 0..16 {
                        let lo = (qs[j] & 0xF) as u32 | (((qh >> j) << 4) & 0x10);
                        let hi = (qs[j] >> 4) as u32 | ((qh >> (j + 12)) & 0x10);
                        y[j] = lo as f32 * d + m;
                        y[j + 16] = hi as f32 * d + m;
                    }
                    out.extend_from_slice(&y);
                }
                out
            }
            SynthType::Q5_K => {
                let mut out = Vec::new();
                for b in data.chunks_exact(176) {
                    let (d, dmin) = (hf(b), hf(&b[2..]));
                    let scales = &b[4..16];
                    let (qh, ql) = (&b[16..48], &b[48..]);
                    let sm = |j: usize| -> (f32, f32) {
                        let (s, m) = if j < 4 {
                            (scales[j] & 63, scales[j + 4] & 63)
                        } else {
                            (
                                (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4),
                                (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4),
                            )
                        };
                        (d * s as f32, dmin * m as f32)
                    };
                    let (mut u1, mut u2) = (1u8, 2u8);
                    for g in 0..4 {
                        let q = &ql[g * 32..];
                        let (d1, m1) = sm(2 * g);
                        let (d2, m2) = sm(2 * g + 1);
                        for l in 0..32 {
                            let hb = if qh[l] & u1 != 0 { 16.0 } else { 0.0 };
                            out.push(d1 * ((q[l] & 0xF) as f32 + hb) - m1);
                        }
                        for l in 0..32 {
                            let hb = if qh[l] & u2 != 0 { 16.0 } else { 0.0 };
                            out.push(d2 * ((q[l] >> 4) as f32 + hb) - m2);
                        }
                        u1 <<= 2;
                        u2 <<= 2;
                    }
                }
                out
            }
        }
    }

    /// Every fill, decoded, has the documented mean and deviation (a big sample per type).
    #[test]
    fn block_values_are_scaled() {
        let types = [
            SynthType::F32,
            SynthType::F16,
            SynthType::Q5_0,
            SynthType::Q5_1,
            SynthType::Q8_0,
            SynthType::Q4_K,
            SynthType::Q5_K,
            SynthType::Q6_K,
            SynthType::IQ4_XS,
        ];
        for ty in types {
            let mut rng = SplitMix64::new(ty.id() as u64);
            let mut buf = vec![0u8; (ty.block_bytes() * (1 << 16) / ty.block_size()) as usize];
            fill_blocks(ty, Fill::Weight, &mut rng, &mut buf);
            let v = decode(ty, &buf);
            let n = v.len() as f64;
            let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
            let sd = (v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
            let s = WEIGHT_STD as f64;
            assert!(mean.abs() < 0.02 * s, "{ty:?} mean {mean}");
            assert!((sd / s - 1.0).abs() < 0.03, "{ty:?} sd {sd}");
        }
    }

    #[test]
    fn real_shapes_lay_out() {
        for s in shapes() {
            let plan = SynthPlan::new(&s).unwrap();
            assert_eq!(shape(s.name).unwrap().name, s.name);
            let dense_model = s.experts.count == 0;
            // mixtures of experts: files of 4.5-11 GB, read per token well below that; the
            // dense files are under 2 GB, read whole but for the embedding
            let gb = plan.total_len as f64 / 1e9;
            let sizes = if dense_model { 0.3..2.0 } else { 4.5..12.0 };
            assert!(sizes.contains(&gb), "{} {gb}", s.name);
            let active = plan.active_bytes_per_token();
            if !dense_model {
                assert!(active < plan.total_len / 2, "{}", s.name);
            }
            // the bytes per token by hand: dense parts plus used/count of the experts, of
            // the model's layers (not the prediction layer after them)
            let model_layer = |name: &str| layer_of(name).is_some_and(|l| l < s.n_layer);
            let dense: u64 = plan
                .tensors
                .iter()
                .filter(|t| model_layer(&t.name) && !t.is_routed_expert())
                .map(|t| t.size)
                .sum();
            let experts: u64 = plan
                .tensors
                .iter()
                .filter(|t| model_layer(&t.name) && t.is_routed_expert())
                .map(|t| t.size)
                .sum();
            let head = plan.tensors.last().unwrap();
            assert_eq!(head.name, "output.weight");
            let routed_share = if dense_model {
                0.0
            } else {
                s.experts.used as f64 / s.experts.count as f64
            };
            let want = dense as f64 + experts as f64 * routed_share + head.size as f64;
            assert!(
                (active as f64 - want).abs() < plan.tensors.len() as f64,
                "{}",
                s.name
            );
        }
        assert!(shape("nope").is_none());
        assert_eq!(shape("mixtral-8x7b").unwrap().name, "mixtral-8x7b-8l");
    }

    #[test]
    fn ranges_compress() {
        assert_eq!(ranges(&[0, 1, 2, 5, 8, 20, 21, 22, 23]), "0-2,5,8,20-23");
        assert_eq!(ranges(&[3]), "3");
        assert_eq!(ranges(&[]), "");
    }
}
