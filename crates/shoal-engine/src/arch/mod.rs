//! One module per architecture, each the same shape: read that architecture's
//! hyperparameters from a GGUF file's metadata (and, where supported, from a Hugging Face
//! `config.json`) into a [`ModelConfig`]. The blocks themselves are shared
//! (`crate::transformer`), switched by the config's fields.

pub mod gemma3;
pub mod llama;
pub mod qwen2;

use shoal_model::gguf::Metadata;

use crate::config::{Arch, ModelConfig};
use crate::EngineError;

/// Reads the config of whichever architecture `general.architecture` names.
///
/// # Errors
/// When the architecture is unsupported or its hyperparameters are missing or inconsistent.
pub fn config_from_gguf(
    md: &Metadata,
    vocab: usize,
    source: &str,
) -> Result<ModelConfig, EngineError> {
    let arch = md.str("general.architecture")?;
    let cfg = match arch {
        "llama" => llama::from_gguf(md, vocab)?,
        "qwen2" => qwen2::from_gguf(md, vocab)?,
        "gemma3" => gemma3::from_gguf(md, vocab)?,
        other => {
            return Err(EngineError::Unsupported {
                what: format!("{source}: architecture `{other}` (supported: llama, qwen2, gemma3)"),
            })
        }
    };
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
    let cfg = match model_type {
        "llama" | "mistral" => llama::from_hf(json, source)?,
        "qwen2" => qwen2::from_hf(json, source)?,
        other => {
            return Err(EngineError::Unsupported {
                what: format!(
                    "{source}: safetensors model_type `{other}` (supported: llama, mistral, qwen2)"
                ),
            })
        }
    };
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
    let p = arch.name();
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
    let rope_scale = match md.opt_str(&k("rope.scaling.type"))? {
        Some("linear") => md.opt_f64(&k("rope.scaling.factor"))?.unwrap_or(1.0),
        Some("none") | None => 1.0,
        Some(other) => {
            return Err(EngineError::Unsupported {
                what: format!("rope scaling type `{other}` (supported: linear)"),
            })
        }
    };
    Ok(ModelConfig {
        arch,
        n_layer: md.usize_max(&k("block_count"), DIM_MAX)?,
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
        context_len: md
            .opt_usize_max(&k("context_length"), 1 << 24)?
            .unwrap_or(4096),
        tied_embeddings: false,
        qkv_bias: false,
        attn_scale: if head_dim > 0 {
            1.0 / (head_dim as f64).sqrt()
        } else {
            1.0
        },
        embed_scale: 1.0,
        activation: crate::config::Activation::Silu,
        sliding_window: None,
        sliding_pattern: 0,
    })
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
        context_len: num("max_position_embeddings").unwrap_or(4096),
        tied_embeddings: json
            .get("tie_word_embeddings")
            .and_then(|v| v.as_bool())
            .unwrap_or(false),
        qkv_bias: false,
        attn_scale: if head_dim > 0 {
            1.0 / (head_dim as f64).sqrt()
        } else {
            1.0
        },
        embed_scale: 1.0,
        activation: crate::config::Activation::Silu,
        sliding_window: None,
        sliding_pattern: 0,
    })
}
