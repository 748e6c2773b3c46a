//! Everything about model files that does not need a tensor library: the GGUF reader with
//! sliced reads, tokenizers (from GGUF metadata or `tokenizer.json`), chat templates, the
//! catalog of demo models, resolving a user's MODEL argument to files, the stores other tools
//! keep models in (Ollama, LM Studio, the Hugging Face cache) and naming a hub repository's
//! GGUF model by its quant tag. The engine turns
//! what this crate reads into tensors.

pub mod catalog;
pub mod chat_template;
pub mod gguf;
pub mod hub;
pub mod source;
pub mod stores;
mod template_list;
pub mod tokenizer;
