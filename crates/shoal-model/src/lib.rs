//! Model files for shoal: GGUF and safetensors readers with sliced reads, hyperparameters,
//! tokenizers and chat templates.

pub mod chat_template;
