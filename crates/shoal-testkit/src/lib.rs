//! Test kit for shoal: synthetic tiny models written as real files.
//!
//! [`TinyModelSpec`] describes a small random Llama (optionally with Llama 3.1 RoPE scaling),
//! Qwen2, Qwen3 or Gemma 3 model, or a mixture-of-experts Qwen3 MoE, DeepSeek V2/V3 (latent
//! attention, YaRN; [`moe`]) or Mixtral model (seeded, so the same spec always gives the same
//! numbers). [`TinyModel`] writes it both as a GGUF file with llama.cpp's tensor names and
//! metadata ([`TinyModel::write_gguf`]) and, for the dense ones, as a Hugging Face folder
//! (`config.json`, `model.safetensors`, `tokenizer.json`, ...;
//! [`TinyModel::write_safetensors_dir`], or in the Hub cache layout with
//! [`TinyModel::write_hf_cache`]), and the two represent the same weights. [`GgufWriter`] is
//! the underlying GGUF writer, which can also produce deliberately broken files, and
//! [`quants`] holds reference quantizers and dequantizers for the block formats.
//! [`TinyModel::reference_logits`] is a plain `f64` forward pass to test engines against.
//! [`synth`] streams GGUF files of real models' shapes with random weights, for benchmarks.
//! [`stores`] lays models out as Ollama and LM Studio keep them, and [`hub`] serves a
//! Hugging Face-style hub on loopback for download tests.
//!
//! `scripts/` holds two independent checkers: `hf_reference.py` (a numpy forward pass of the
//! HF folder) and `llama_logits.cpp`, llama.cpp as a teacher-forced oracle for a GGUF file
//! (built by `scripts/build-llama-oracle.sh`; [`oracle`] runs it and compares logits with
//! it). Tests that need an outside tool skip with a printed line when it is missing, except
//! under CI (`CI=true`), where they fail instead ([`skip_or_fail`]).

pub mod gguf_writer;
pub mod hub;
pub mod iquants;
pub mod moe;
pub mod oracle;
pub mod quants;
pub mod reference;
pub mod rng;
pub mod stores;
pub mod synth;
pub mod tiny_model;
pub mod tokenizer;

use std::path::PathBuf;

pub use gguf_writer::{
    GgufLayout, GgufTensor, GgufValue, GgufValueType, GgufWriter, TensorPlacement,
    GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUF_VERSION,
};
pub use moe::{
    route, route_margin, route_scale_margin, ExpertGating, MlaSpec, MoeFault, MoeSpec, YarnRope,
};
pub use oracle::{
    compare_teacher_forced, llama_pretokenize, oracle_bin, require_oracle, run_llama_oracle,
    run_llama_oracle_with, Comparison, OracleCache, OracleInput, OracleRun, Tolerance,
};
pub use quants::{
    dequantize, dequantize_q4_0, dequantize_q4_1, dequantize_q8_0, quantize, quantize_q4_0,
    quantize_q4_1, quantize_q8_0, round_trip, GgmlType,
};
pub use tiny_model::{Arch, Llama3Rope, SafetensorsDtype, TinyModel, TinyModelSpec, Weight};
pub use tokenizer::TinyTokenizer;

/// Whether this run is CI: the environment variable `CI` is `true`.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// Reports that `test` cannot run because `why` (a missing tool, and how to get it): prints
/// a skip line, or under CI ([`in_ci`]) panics, since CI must run every check.
pub fn skip_or_fail(test: &str, why: &str) {
    if in_ci() {
        panic!("{test}: {why}; CI (CI=true) does not skip tests");
    }
    eprintln!("skipped: {test}: {why}");
}

/// Everything that can go wrong while building or writing test files.
#[derive(Debug, thiserror::Error)]
pub enum TestkitError {
    /// Reading or writing a file failed.
    #[error("I/O error at {path}: {source}")]
    Io {
        /// The file or folder involved.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A quantized type was asked to hold a count that is not a whole number of blocks.
    #[error("{ty}: {n_elements} elements is not a whole number of {block}-element blocks (make the row length a multiple of {block})")]
    NotBlockAligned {
        /// Type name.
        ty: &'static str,
        /// Elements asked for.
        n_elements: usize,
        /// Block size of the type.
        block: usize,
    },
    /// Encoded bytes have the wrong length for the element count.
    #[error("{ty}: {n_elements} elements take {expected} bytes, got {got}")]
    ByteLength {
        /// Type name.
        ty: &'static str,
        /// Elements.
        n_elements: usize,
        /// Bytes expected.
        expected: usize,
        /// Bytes given.
        got: usize,
    },
    /// A tensor's data does not match its shape.
    #[error("tensor {name}: shape ne={ne:?} does not hold {got} values")]
    ShapeMismatch {
        /// Tensor name.
        name: String,
        /// Dimensions, innermost first.
        ne: Vec<u64>,
        /// Values given.
        got: usize,
    },
    /// An array value holds an element of another type than it declares.
    #[error("metadata {key}: array of {elem:?} holds a {found:?} at index {index}")]
    ArrayElementType {
        /// Metadata key.
        key: String,
        /// Declared element type.
        elem: GgufValueType,
        /// Type found.
        found: GgufValueType,
        /// Index of the element.
        index: usize,
    },
    /// The alignment is not a non-zero power of two.
    #[error("alignment {0} is not a non-zero power of two")]
    BadAlignment(u64),
    /// The safetensors crate refused the tensors.
    #[error("safetensors: {0}")]
    Safetensors(String),
    /// A model spec that cannot be built; the message says which field.
    #[error("invalid tiny model spec: {0}")]
    InvalidSpec(String),
}

#[cfg(test)]
mod model_tests;
