//! What the placement planner needs to know of a model, read from its file's headers
//! without loading weights: its shape and the stored bytes of every block, the embedding
//! and the head ([`model_profile`]), by the architecture's tensor table.

use shoal_planner::{ModelProfile, MoeSpec};

use crate::arch::{self, Role};
use crate::weights::WeightSource;
use crate::{EngineError, ModelConfig};

fn lcm(a: usize, b: usize) -> usize {
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    if a == 0 || b == 0 {
        return a.max(b);
    }
    a / gcd(a, b) * b
}

/// The profile of model `name` (config `cfg`) from its weights' sizes as stored: every
/// tensor its architecture's table names that the file holds.
///
/// # Errors
/// When a required tensor is missing.
pub fn model_profile(
    name: &str,
    cfg: &ModelConfig,
    src: &dyn WeightSource,
) -> Result<ModelProfile, EngineError> {
    let spec = arch::spec(cfg.arch);
    let elems = |t: &str| -> Result<u64, EngineError> {
        Ok(src.shape(t)?.iter().map(|&d| d as u64).product())
    };
    let mut layer_bytes = Vec::with_capacity(cfg.n_layer);
    let mut expert_bytes = vec![0u64; cfg.n_layer];
    let mut params = 0u64;
    let (mut ffn_block, mut attn_block, mut expert_block) = (1usize, 1usize, 1usize);
    for (l, experts) in expert_bytes.iter_mut().enumerate() {
        let mut bytes = 0;
        for (t, name) in spec.layer_names(l) {
            if src.contains(&name) {
                let stored = src.stored_bytes(&name)?;
                bytes += stored;
                params += elems(&name)?;
                if t.role.is_routed_expert() {
                    *experts += stored;
                }
                match t.role {
                    Role::FfnDown => ffn_block = lcm(ffn_block, src.block_len(&name)?),
                    Role::FfnDownExps => expert_block = lcm(expert_block, src.block_len(&name)?),
                    Role::AttnOut => attn_block = lcm(attn_block, src.block_len(&name)?),
                    _ => {}
                }
            }
        }
        layer_bytes.push(bytes);
    }
    let name_of = |role: Role| spec.model_tensor(role).map(|t| t.gguf);
    let embed = name_of(Role::TokenEmbd).unwrap_or("token_embd.weight");
    let embedding_bytes = src.stored_bytes(embed)?;
    params += elems(embed)?;
    let head = name_of(Role::Output).filter(|n| src.contains(n));
    let head_bytes = match head {
        Some(h) => {
            params += elems(h)?;
            src.stored_bytes(h)?
        }
        None => embedding_bytes,
    };
    Ok(ModelProfile {
        name: name.into(),
        n_layers: cfg.n_layer,
        hidden: cfg.hidden,
        n_heads: cfg.n_head,
        n_kv_heads: cfg.n_kv_head,
        head_dim: cfg.head_dim,
        ffn: cfg.ffn,
        vocab: cfg.vocab,
        params,
        layer_bytes,
        embedding_bytes,
        head_bytes,
        tied_embeddings: head.is_none(),
        kv_bytes_per_token_per_layer: cfg.kv_bytes_per_token_per_layer(),
        quant_block: u32::try_from(ffn_block).unwrap_or(u32::MAX),
        attn_quant_block: (attn_block != ffn_block)
            .then(|| u32::try_from(attn_block).unwrap_or(u32::MAX)),
        experts: cfg.moe.as_ref().map(|m| MoeSpec {
            n_experts: u32::try_from(m.n_expert).unwrap_or(u32::MAX),
            active_experts: u32::try_from(m.n_expert_used).unwrap_or(u32::MAX),
            expert_bytes_per_layer: expert_bytes,
            expert_ffn: m.expert_ffn,
            expert_block: u32::try_from(expert_block).unwrap_or(u32::MAX),
        }),
    })
}
