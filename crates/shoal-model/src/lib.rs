//! Everything about model files that does not need a tensor library: the GGUF reader with
//! sliced reads, tokenizers (from GGUF metadata or `tokenizer.json`), chat templates, the
//! catalog of demo models, and resolving a user's MODEL argument to files. The engine turns
//! what this crate reads into tensors.

pub mod catalog;
pub mod chat_template;
pub mod gguf;
pub mod source;
mod template_list;
pub mod tokenizer;
