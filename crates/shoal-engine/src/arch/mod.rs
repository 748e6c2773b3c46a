//! One module per architecture, each the same shape: a table of the tensors it has (GGUF
//! name, Hugging Face name, role, required or optional) and readers of its hyperparameters
//! from a GGUF file's metadata and, where supported, from a Hugging Face `config.json`,
//! into one [`ModelConfig`]. Everything that names tensors reads the tables: the network's
//! loader (`crate::network`), the safetensors mapper (`crate::weights`), the shard planner
//! (`crate::shard`), the planner's model profile (`crate::planning`) and the cluster's slice
//! fetch ([`layer_of`]). The blocks themselves are shared, switched by the config's fields
//! and by which tensors a file holds.
//!
//! Adding an architecture is one module here (its table and config readers), one entry in
//! [`ARCHS`], and its writer in the test kit.

pub mod deepseek2;
pub mod gemma3;
pub mod glm4moe;
pub mod gpt_oss;
pub mod llama;
pub mod qwen2;
pub mod qwen3;
pub mod qwen3moe;

use shoal_model::gguf::Metadata;

use crate::config::{Arch, Gating, ModelConfig, MoeConfig, YarnConfig};
use crate::EngineError;

/// What a tensor is for. Layer roles name one tensor of every block (`blk.N.…` in GGUF);
/// the others name one tensor of the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Token embedding table `[vocab, hidden]`.
    TokenEmbd,
    /// Final norm before the output head.
    OutputNorm,
    /// Output head `[vocab, hidden]` (absent when tied to the embedding).
    Output,
    /// Per-pair RoPE frequency divisors (Llama 3.1 scaling), `head_dim / 2` values.
    RopeFreqs,
    /// Norm before attention.
    AttnNorm,
    /// Query projection.
    AttnQ,
    /// Key projection.
    AttnK,
    /// Value projection.
    AttnV,
    /// Query bias.
    AttnQBias,
    /// Key bias.
    AttnKBias,
    /// Value bias.
    AttnVBias,
    /// Per-head norm of queries.
    AttnQNorm,
    /// Per-head norm of keys.
    AttnKNorm,
    /// Attention output projection.
    AttnOut,
    /// Attention output bias.
    AttnOutBias,
    /// A learned logit per query head that joins every softmax of its scores without a
    /// value (gpt-oss's attention sinks), `[n_head]`.
    AttnSinks,
    /// Norm of the attention output, before its residual add.
    PostAttnNorm,
    /// Norm before the feed-forward block.
    FfnNorm,
    /// Feed-forward gate projection.
    FfnGate,
    /// Feed-forward up projection.
    FfnUp,
    /// Feed-forward down projection.
    FfnDown,
    /// Norm of the feed-forward output, before its residual add.
    PostFfnNorm,
    /// Router of a mixture of experts, `[n_expert, hidden]`.
    FfnGateInp,
    /// The router's bias, `[n_expert]`.
    FfnGateInpBias,
    /// Gate projections of every routed expert, `[n_expert, expert_ffn, hidden]`.
    FfnGateExps,
    /// Up projections of every routed expert.
    FfnUpExps,
    /// Down projections of every routed expert, `[n_expert, hidden, expert_ffn]`.
    FfnDownExps,
    /// Gate and up projections of every routed expert in one tensor (converters that fuse
    /// them), `[n_expert, 2 expert_ffn, hidden]`: each expert's gate rows, then its up rows.
    FfnGateUpExps,
    /// Per-expert bias added to the router's probabilities for selection only (DeepSeek V3).
    FfnExpProbsBias,
    /// Biases of every routed expert's gate projection, `[n_expert, expert_ffn]`.
    FfnGateExpsBias,
    /// Biases of every routed expert's up projection, `[n_expert, expert_ffn]`.
    FfnUpExpsBias,
    /// Biases of every routed expert's down projection, `[n_expert, hidden]`.
    FfnDownExpsBias,
    /// Gate projection of the shared experts.
    FfnGateShexp,
    /// Up projection of the shared experts.
    FfnUpShexp,
    /// Down projection of the shared experts.
    FfnDownShexp,
    /// Query compression (MLA with a query rank).
    AttnQA,
    /// Norm of the compressed query.
    AttnQANorm,
    /// Query decompression into heads.
    AttnQB,
    /// The key/value latent and the shared rope key, `[kv_lora_rank + rope_dims, hidden]`.
    AttnKvAMqa,
    /// Norm of the key/value latent.
    AttnKvANorm,
    /// Per-head keys from the latent, `[n_head, kv_lora_rank, nope_dims]` (absorbed into the
    /// query).
    AttnKB,
    /// Per-head values from the latent, `[n_head, v_dims, kv_lora_rank]`.
    AttnVB,
    /// Keys and values from the latent in one matrix (older MLA files), `[n_head *
    /// (nope_dims + v_dims), kv_lora_rank]`.
    AttnKvB,
}

impl Role {
    /// Whether the tensor is a matrix that a decode step multiplies by (as opposed to a
    /// norm, a bias or a table of factors).
    pub fn is_matrix(self) -> bool {
        matches!(
            self,
            Role::Output
                | Role::AttnQ
                | Role::AttnK
                | Role::AttnV
                | Role::AttnOut
                | Role::FfnGate
                | Role::FfnUp
                | Role::FfnDown
                | Role::FfnGateInp
                | Role::FfnGateExps
                | Role::FfnUpExps
                | Role::FfnDownExps
                | Role::FfnGateUpExps
                | Role::FfnGateShexp
                | Role::FfnUpShexp
                | Role::FfnDownShexp
                | Role::AttnQA
                | Role::AttnQB
                | Role::AttnKvAMqa
                | Role::AttnKB
                | Role::AttnVB
                | Role::AttnKvB
        )
    }

    /// Whether the tensor holds every routed expert, their matrices or their biases (a
    /// decode step reads only the chosen experts' part of it).
    pub fn is_routed_expert(self) -> bool {
        matches!(
            self,
            Role::FfnGateExps
                | Role::FfnUpExps
                | Role::FfnDownExps
                | Role::FfnGateUpExps
                | Role::FfnGateExpsBias
                | Role::FfnUpExpsBias
                | Role::FfnDownExpsBias
        )
    }
}

/// Whether a model of the architecture must have a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// Loading fails without it.
    Required,
    /// Used when the file has it.
    Optional,
}

/// One tensor of an architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorSpec {
    /// What it is for.
    pub role: Role,
    /// Its GGUF name: the whole name for a model tensor, the part after `blk.N.` for a
    /// layer tensor.
    pub gguf: &'static str,
    /// Its Hugging Face name, the same way (after `model.layers.N.` for a layer tensor);
    /// empty when checkpoints do not store it.
    pub hf: &'static str,
    /// Whether it must be present.
    pub need: Need,
}

/// Shorthand for the tables: a tensor that must be present.
pub(crate) const fn required(role: Role, gguf: &'static str, hf: &'static str) -> TensorSpec {
    TensorSpec {
        role,
        gguf,
        hf,
        need: Need::Required,
    }
}

/// Shorthand for the tables: a tensor used when present.
pub(crate) const fn optional(role: Role, gguf: &'static str, hf: &'static str) -> TensorSpec {
    TensorSpec {
        role,
        gguf,
        hf,
        need: Need::Optional,
    }
}

/// The model tensors of every decoder here: embedding, final norm, and an output head
/// unless it is tied to the embedding.
pub(crate) const DECODER_TENSORS: [TensorSpec; 3] = [
    required(
        Role::TokenEmbd,
        "token_embd.weight",
        "model.embed_tokens.weight",
    ),
    required(Role::OutputNorm, "output_norm.weight", "model.norm.weight"),
    optional(Role::Output, "output.weight", "lm_head.weight"),
];

/// Reads an architecture's hyperparameters from GGUF metadata and the vocabulary size.
pub type GgufConfigReader = fn(&Metadata, usize) -> Result<ModelConfig, EngineError>;

/// Reads an architecture's hyperparameters from a `config.json` (and names the source in
/// errors).
pub type HfConfigReader = fn(&serde_json::Value, &str) -> Result<ModelConfig, EngineError>;

/// An architecture: its names, its tensors and how to read its hyperparameters.
#[derive(Debug)]
pub struct ArchSpec {
    /// The architecture.
    pub arch: Arch,
    /// `general.architecture` of its GGUF files (and the prefix of their keys).
    pub gguf_name: &'static str,
    /// `model_type` values of its Hugging Face checkpoints that load (empty: GGUF only).
    pub hf_model_types: &'static [&'static str],
    /// Tensors of the whole model.
    pub model_tensors: &'static [TensorSpec],
    /// Tensors of every layer.
    pub layer_tensors: &'static [TensorSpec],
    /// Reads the hyperparameters from GGUF metadata and the vocabulary size.
    pub from_gguf: GgufConfigReader,
    /// Reads the hyperparameters from a `config.json` (`None`: not supported).
    pub from_hf: Option<HfConfigReader>,
    /// Whether the GGUF converter permuted the q/k rows of Hugging Face checkpoints (into
    /// interleaved RoPE order), so a safetensors loader must do the same.
    pub permutes_qk: bool,
}

/// Every architecture the engine runs.
pub static ARCHS: [&ArchSpec; 8] = [
    &llama::SPEC,
    &qwen2::SPEC,
    &qwen3::SPEC,
    &gemma3::SPEC,
    &qwen3moe::SPEC,
    &deepseek2::SPEC,
    &glm4moe::SPEC,
    &gpt_oss::SPEC,
];

/// The routed-expert tensors of a mixture-of-experts layer, with llama.cpp's names (optional
/// in a table: a layer holds them or a dense feed-forward).
pub(crate) const EXPERT_TENSORS: [TensorSpec; 5] = [
    optional(Role::FfnGateInp, "ffn_gate_inp.weight", ""),
    optional(Role::FfnGateExps, "ffn_gate_exps.weight", ""),
    optional(Role::FfnUpExps, "ffn_up_exps.weight", ""),
    optional(Role::FfnDownExps, "ffn_down_exps.weight", ""),
    optional(Role::FfnGateUpExps, "ffn_gate_up_exps.weight", ""),
];

/// The spec of `arch`.
pub fn spec(arch: Arch) -> &'static ArchSpec {
    ARCHS
        .iter()
        .copied()
        .find(|s| s.arch == arch)
        .expect("every Arch has a spec in ARCHS")
}

/// The prefix of every layer tensor's GGUF name.
const LAYER_PREFIX: &str = "blk.";

/// The prefix of every layer tensor's Hugging Face name.
const HF_LAYER_PREFIX: &str = "model.layers.";

/// The layer a GGUF tensor name belongs to (`blk.N.…`), or `None` for a model tensor.
pub fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix(LAYER_PREFIX)?
        .split('.')
        .next()?
        .parse()
        .ok()
}

impl ArchSpec {
    /// The model tensor of `role`, if the architecture has one.
    pub fn model_tensor(&self, role: Role) -> Option<&TensorSpec> {
        self.model_tensors.iter().find(|t| t.role == role)
    }

    /// The layer tensor of `role`, if the architecture has one.
    pub fn layer_tensor(&self, role: Role) -> Option<&TensorSpec> {
        self.layer_tensors.iter().find(|t| t.role == role)
    }

    /// The GGUF name of layer `layer`'s tensor of `role`.
    pub fn layer_name(&self, role: Role, layer: usize) -> Option<String> {
        self.layer_tensor(role)
            .map(|t| format!("{LAYER_PREFIX}{layer}.{}", t.gguf))
    }

    /// Every tensor of layer `layer` with its GGUF name.
    pub fn layer_names(&self, layer: usize) -> impl Iterator<Item = (&TensorSpec, String)> + '_ {
        self.layer_tensors
            .iter()
            .map(move |t| (t, format!("{LAYER_PREFIX}{layer}.{}", t.gguf)))
    }

    /// The table entry of a GGUF tensor name, and its layer for a layer tensor.
    pub fn entry(&self, gguf: &str) -> Option<(&TensorSpec, Option<usize>)> {
        if let Some(t) = self.model_tensors.iter().find(|t| t.gguf == gguf) {
            return Some((t, None));
        }
        let layer = layer_of(gguf)?;
        let suffix = gguf.strip_prefix(&format!("{LAYER_PREFIX}{layer}."))?;
        let t = self.layer_tensors.iter().find(|t| t.gguf == suffix)?;
        Some((t, Some(layer)))
    }

    /// The Hugging Face name of a GGUF tensor name, where checkpoints store it.
    pub fn hf_name(&self, gguf: &str) -> Option<String> {
        let (t, layer) = self.entry(gguf)?;
        if t.hf.is_empty() {
            return None;
        }
        Some(match layer {
            Some(l) => format!("{HF_LAYER_PREFIX}{l}.{}", t.hf),
            None => t.hf.to_string(),
        })
    }
}

/// The names of the architectures [`config_from_gguf`] reads, for error messages.
fn gguf_names() -> String {
    ARCHS
        .iter()
        .map(|s| s.gguf_name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The config of a GGUF file's model: its metadata read by [`config_from_gguf`], with the
/// vocabulary size taken from the token embedding's rows. `source` names the file in errors.
///
/// # Errors
/// When the file lacks `token_embd.weight`, or as [`config_from_gguf`].
pub fn config_of_file(
    file: &shoal_model::gguf::GgufFile,
    source: &str,
) -> Result<ModelConfig, EngineError> {
    let vocab = file
        .tensor("token_embd.weight")?
        .shape()
        .first()
        .copied()
        .unwrap_or(0);
    config_from_gguf(file.metadata(), vocab, source)
}

/// Reads the config of whichever architecture `general.architecture` names.
///
/// # Errors
/// When the architecture is unsupported or its hyperparameters are missing or inconsistent.
pub fn config_from_gguf(
    md: &Metadata,
    vocab: usize,
    source: &str,
) -> Result<ModelConfig, EngineError> {
    let name = md.str("general.architecture")?;
    let spec =
        ARCHS
            .iter()
            .find(|s| s.gguf_name == name)
            .ok_or_else(|| EngineError::Unsupported {
                what: format!(
                    "{source}: architecture `{name}` (supported: {})",
                    gguf_names()
                ),
            })?;
    let cfg = (spec.from_gguf)(md, vocab)?;
    cfg.validate().map_err(|problem| EngineError::Config {
        file: source.into(),
        problem,
    })?;
    Ok(cfg)
}

/// Reads the config from a Hugging Face `config.json` value.
///
/// # Errors
/// When `model_type` is unsupported or a field is missing.
pub fn config_from_hf(json: &serde_json::Value, source: &str) -> Result<ModelConfig, EngineError> {
    let model_type = json
        .get("model_type")
        .and_then(|v| v.as_str())
        .unwrap_or("");
    let found = ARCHS
        .iter()
        .find_map(|s| s.from_hf.filter(|_| s.hf_model_types.contains(&model_type)));
    let Some(read) = found else {
        let supported: Vec<&str> = ARCHS
            .iter()
            .filter(|s| s.from_hf.is_some())
            .flat_map(|s| s.hf_model_types.iter().copied())
            .collect();
        return Err(EngineError::Unsupported {
            what: format!(
                "{source}: safetensors model_type `{model_type}` (supported: {})",
                supported.join(", ")
            ),
        });
    };
    let cfg = read(json, source)?;
    cfg.validate().map_err(|problem| EngineError::Config {
        file: source.into(),
        problem,
    })?;
    Ok(cfg)
}

/// Most elements any single dimension may have; larger values mean a corrupt file.
pub(crate) const DIM_MAX: usize = 1 << 24;

/// The fields every GGUF decoder shares, read under the architecture's key prefix.
pub(crate) fn common_gguf(
    md: &Metadata,
    arch: Arch,
    vocab: usize,
) -> Result<ModelConfig, EngineError> {
    let p = spec(arch).gguf_name;
    let k = |s: &str| format!("{p}.{s}");
    let hidden = md.usize_max(&k("embedding_length"), DIM_MAX)?;
    let n_head = md.usize_max(&k("attention.head_count"), DIM_MAX)?;
    let n_kv_head = md
        .opt_usize_max(&k("attention.head_count_kv"), DIM_MAX)?
        .unwrap_or(n_head);
    let head_dim = match md.opt_usize_max(&k("attention.key_length"), DIM_MAX)? {
        Some(d) => d,
        None if n_head > 0 => hidden / n_head,
        None => 0,
    };
    let rope_theta = md.opt_f64(&k("rope.freq_base"))?.unwrap_or(10_000.0);
    let factor = md.opt_f64(&k("rope.scaling.factor"))?.unwrap_or(1.0);
    let (rope_scale, yarn) = match md.opt_str(&k("rope.scaling.type"))? {
        Some("linear") => (factor, None),
        Some("yarn") => {
            let trained = md
                .opt_usize_max(&k("context_length"), 1 << 24)?
                .unwrap_or(4096);
            (factor, Some(yarn_gguf(md, p, factor as f32, trained)?))
        }
        Some("none") | None => (1.0, None),
        Some(other) => {
            return Err(EngineError::Unsupported {
                what: format!("rope scaling type `{other}` (supported: linear, yarn)"),
            })
        }
    };
    Ok(ModelConfig {
        arch,
        n_layer: md.usize_max(&k("block_count"), DIM_MAX)?,
        mtp_layers: 0,
        load_mtp: false,
        hidden,
        n_head,
        n_kv_head,
        head_dim,
        ffn: md.usize_max(&k("feed_forward_length"), DIM_MAX)?,
        vocab,
        rms_eps: md
            .opt_f64(&k("attention.layer_norm_rms_epsilon"))?
            .unwrap_or(1e-6),
        rope_theta,
        rope_theta_local: rope_theta,
        rope_scale: if rope_scale > 0.0 { rope_scale } else { 1.0 },
        rope_style: crate::config::RopeStyle::Halves,
        rope_dims: None,
        rope_freq_factors: None,
        context_len: md
            .opt_usize_max(&k("context_length"), 1 << 24)?
            .unwrap_or(4096),
        attn_scale: if head_dim > 0 {
            1.0 / (head_dim as f64).sqrt()
        } else {
            1.0
        },
        embed_scale: 1.0,
        activation: crate::config::Activation::Silu,
        sliding_window: None,
        sliding_pattern: 0,
        sliding_rope_scaled: false,
        moe: None,
        mla: None,
        yarn,
    })
}

/// YaRN's settings under key prefix `p` for a scaling `factor` (the original context
/// defaulting to `trained`, the context the file says it was trained for), with the attention factor
/// llama.cpp derives when the file gives no log multiplier: the cosines and sines scaled
/// by `1 + 0.1 ln(factor)` in all (`attn_factor` is that divided by what the rotation adds
/// itself, times the file's `rope.scaling.attn_factor`).
fn yarn_gguf(
    md: &Metadata,
    p: &str,
    factor: f32,
    trained: usize,
) -> Result<YarnConfig, EngineError> {
    let k = |s: &str| format!("{p}.{s}");
    let f = |key: &str, default: f32| -> Result<f32, EngineError> {
        Ok(md.opt_f64(&k(key))?.map_or(default, |v| v as f32))
    };
    let ext = f("rope.scaling.yarn_ext_factor", -1.0)?;
    let mut attn = yarn_mscale(factor, 1.0) / (1.0 + 0.1 * factor.ln());
    attn *= f("rope.scaling.attn_factor", 1.0)?;
    Ok(YarnConfig {
        original_context: md
            .opt_usize_max(&k("rope.scaling.original_context_length"), DIM_MAX)?
            .unwrap_or(trained),
        ext_factor: if ext < 0.0 { 1.0 } else { ext },
        attn_factor: attn,
        beta_fast: f("rope.scaling.yarn_beta_fast", 32.0)?,
        beta_slow: f("rope.scaling.yarn_beta_slow", 1.0)?,
        log_mul: 0.0,
    })
}

/// YaRN's magnitude scale for a scaling `factor` (1 at no scaling).
pub(crate) fn yarn_mscale(factor: f32, mscale: f32) -> f32 {
    if factor <= 1.0 {
        1.0
    } else {
        0.1 * mscale * factor.ln() + 1.0
    }
}

/// The routed experts of an architecture's GGUF metadata, when the file has any
/// (`{arch}.expert_count` above 0); `expert_ffn` when the file gives no
/// `expert_feed_forward_length` (Mixtral's experts are `feed_forward_length` wide).
pub(crate) fn moe_gguf(
    md: &Metadata,
    arch: Arch,
    expert_ffn: usize,
) -> Result<Option<MoeConfig>, EngineError> {
    let p = spec(arch).gguf_name;
    let k = |s: &str| format!("{p}.{s}");
    let n_expert = md.opt_usize_max(&k("expert_count"), DIM_MAX)?.unwrap_or(0);
    if n_expert == 0 {
        return Ok(None);
    }
    let gating = match md.opt_usize_max(&k("expert_gating_func"), DIM_MAX)? {
        None | Some(0) | Some(1) => Gating::Softmax,
        Some(2) => Gating::Sigmoid,
        Some(3) => Gating::SoftmaxWeight,
        Some(other) => {
            return Err(EngineError::Unsupported {
                what: format!("expert gating function {other} (supported: 1 softmax, 2 sigmoid, 3 softmax over the chosen)"),
            })
        }
    };
    let scale = md.opt_f64(&k("expert_weights_scale"))?.unwrap_or(1.0);
    Ok(Some(MoeConfig {
        n_expert,
        n_expert_used: md
            .opt_usize_max(&k("expert_used_count"), DIM_MAX)?
            .unwrap_or(0),
        expert_ffn: md
            .opt_usize_max(&k("expert_feed_forward_length"), DIM_MAX)?
            .unwrap_or(expert_ffn),
        n_shared: md
            .opt_usize_max(&k("expert_shared_count"), DIM_MAX)?
            .unwrap_or(0),
        leading_dense: md
            .opt_usize_max(&k("leading_dense_block_count"), DIM_MAX)?
            .unwrap_or(0),
        gating,
        norm_weights: md.opt_bool(&k("expert_weights_norm"))?.unwrap_or(false),
        weights_scale: if scale == 0.0 { 1.0 } else { scale as f32 },
        groups: md
            .opt_usize_max(&k("expert_group_count"), DIM_MAX)?
            .unwrap_or(1)
            .max(1),
        groups_used: md
            .opt_usize_max(&k("expert_group_used_count"), DIM_MAX)?
            .unwrap_or(1)
            .max(1),
    }))
}

/// The fields every Hugging Face decoder config shares.
pub(crate) fn common_hf(
    json: &serde_json::Value,
    arch: Arch,
    source: &str,
) -> Result<ModelConfig, EngineError> {
    let num = |key: &str| -> Result<usize, EngineError> {
        json.get(key)
            .and_then(|v| v.as_u64())
            .filter(|&v| v as usize <= DIM_MAX)
            .map(|v| v as usize)
            .ok_or_else(|| EngineError::Config {
                file: source.into(),
                problem: format!("`{key}` is missing or not a small integer"),
            })
    };
    let float = |key: &str, default: f64| json.get(key).and_then(|v| v.as_f64()).unwrap_or(default);
    let hidden = num("hidden_size")?;
    let n_head = num("num_attention_heads")?;
    let n_kv_head = num("num_key_value_heads").unwrap_or(n_head);
    let head_dim = num("head_dim").unwrap_or(hidden.checked_div(n_head).unwrap_or(0));
    let rope_theta = float("rope_theta", 10_000.0);
    Ok(ModelConfig {
        arch,
        n_layer: num("num_hidden_layers")?,
        mtp_layers: 0,
        load_mtp: false,
        hidden,
        n_head,
        n_kv_head,
        head_dim,
        ffn: num("intermediate_size")?,
        vocab: num("vocab_size")?,
        rms_eps: float("rms_norm_eps", 1e-6),
        rope_theta,
        rope_theta_local: rope_theta,
        rope_scale: 1.0,
        rope_style: crate::config::RopeStyle::Halves,
        rope_dims: None,
        rope_freq_factors: None,
        context_len: num("max_position_embeddings").unwrap_or(4096),
        attn_scale: if head_dim > 0 {
            1.0 / (head_dim as f64).sqrt()
        } else {
            1.0
        },
        embed_scale: 1.0,
        activation: crate::config::Activation::Silu,
        sliding_window: None,
        sliding_pattern: 0,
        sliding_rope_scaled: false,
        moe: None,
        mla: None,
        yarn: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_tables() {
        let llama = spec(Arch::Llama);
        assert_eq!(
            llama.hf_name("blk.12.attn_q.bias").as_deref(),
            Some("model.layers.12.self_attn.q_proj.bias")
        );
        assert_eq!(
            llama.hf_name("blk.0.ffn_norm.weight").as_deref(),
            Some("model.layers.0.post_attention_layernorm.weight")
        );
        assert_eq!(
            llama.hf_name("output.weight").as_deref(),
            Some("lm_head.weight")
        );
        assert_eq!(
            llama.hf_name("rope_freqs.weight"),
            None,
            "not in checkpoints"
        );
        assert_eq!(llama.hf_name("blk.x"), None);
        assert_eq!(
            llama.hf_name("blk.3.attn_q_norm.weight"),
            None,
            "not a llama tensor"
        );
        assert_eq!(
            spec(Arch::Qwen3)
                .hf_name("blk.3.attn_q_norm.weight")
                .as_deref(),
            Some("model.layers.3.self_attn.q_norm.weight")
        );
        assert_eq!(
            llama.layer_name(Role::FfnDown, 7).as_deref(),
            Some("blk.7.ffn_down.weight")
        );
        assert_eq!(layer_of("blk.12.attn_q.weight"), Some(12));
        assert_eq!(layer_of("token_embd.weight"), None);
        assert_eq!(layer_of("blk.x.attn_q.weight"), None);
    }

    #[test]
    fn every_table_names_each_role_once() {
        for s in ARCHS {
            for tensors in [s.model_tensors, s.layer_tensors] {
                for (i, t) in tensors.iter().enumerate() {
                    assert!(
                        tensors[i + 1..]
                            .iter()
                            .all(|u| u.role != t.role && u.gguf != t.gguf),
                        "{}: {:?} twice",
                        s.gguf_name,
                        t.role
                    );
                }
            }
            assert_eq!(spec(s.arch).gguf_name, s.gguf_name);
        }
    }
}
