//! Everything about model files that does not need a tensor library: the GGUF reader with
//! sliced reads, safetensors folders with their `config.json`, the hyperparameters both
//! describe, tokenizers (from GGUF metadata or `tokenizer.json`), chat templates, and the
//! catalog of demo models. The engine turns what this crate reads into tensors.

pub mod gguf;
