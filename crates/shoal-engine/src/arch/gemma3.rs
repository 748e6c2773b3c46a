//! Gemma 3: per-head RMSNorm on queries and keys, RMSNorms after attention and after the
//! feed-forward block (before each residual add), a GELU-gated feed-forward, embeddings
//! scaled by sqrt(hidden), and sliding-window attention (local RoPE base 10,000) on five of
//! every six layers, global attention on the sixth. GGUF files from llama.cpp's converter
//! already hold the `1 + weight` Gemma norm scale, so the norms are plain RMSNorms here.

use shoal_model::gguf::Metadata;

use super::{common_gguf, DIM_MAX};
use crate::config::{Activation, Arch, ModelConfig, RopeStyle};
use crate::EngineError;

/// RoPE base of the sliding-window layers (not stored in the files).
const LOCAL_ROPE_THETA: f64 = 10_000.0;
/// Every sixth layer attends globally.
const SLIDING_PATTERN: usize = 6;

/// Config from GGUF metadata (`gemma3.*` keys).
///
/// # Errors
/// When a required key is missing or malformed.
pub fn from_gguf(md: &Metadata, vocab: usize) -> Result<ModelConfig, EngineError> {
    let mut c = common_gguf(md, Arch::Gemma3, vocab)?;
    c.rope_style = RopeStyle::Halves;
    c.rope_theta_local = LOCAL_ROPE_THETA;
    c.tied_embeddings = true;
    c.activation = Activation::GeluTanh;
    c.embed_scale = (c.hidden as f64).sqrt();
    c.attn_scale = 1.0 / (c.head_dim as f64).sqrt();
    c.sliding_window = md.opt_usize_max("gemma3.attention.sliding_window", DIM_MAX)?;
    c.sliding_pattern = SLIDING_PATTERN;
    Ok(c)
}
