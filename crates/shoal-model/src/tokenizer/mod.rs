//! Tokenizers built from GGUF metadata (`tokenizer.ggml.*`) that give the same token ids as
//! llama.cpp, or from a Hugging Face `tokenizer.json` through the `tokenizers` crate.
//!
//! Two GGUF models are implemented: byte-level BPE (`gpt2`, with the pre-tokenizer named by
//! `tokenizer.ggml.pre`, see [`pretokenize`]) and SentencePiece-style merging by score
//! (`llama`, used by Llama 2 and Gemma 3), plus Gemma 4's SentencePiece-style BPE. Encoding
//! first cuts special tokens out of the text the way llama.cpp does (longest token first,
//! honouring lstrip/rstrip), then runs the model on the text between them. Token
//! attributes, the end-of-generation set and special-token defaults follow llama.cpp's
//! loader, including its detection of end-of-turn and fill-in-the-middle tokens by text.
//!
//! Decoding turns each token into its bytes ([`Tokenizer::token_bytes`]), which
//! [`StreamDecoder`] assembles into complete UTF-8 text one token at a time.
//!
//! Nothing here panics on a hostile file: every problem found while loading is a
//! [`TokenizerError`], and encoding or decoding never fails on odd input.

mod bpe;
mod hf;
pub mod pretokenize;
mod spm;
mod stream;
pub mod unicode;
mod vocab;

use std::borrow::Cow;
use std::path::Path;

use ahash::AHashSet;

use crate::gguf::{GgufError, MetaArray, MetaValue, Metadata};
pub use pretokenize::{PreType, SUPPORTED_PRE};
pub use stream::StreamDecoder;
use vocab::Vocab;

/// Token attributes (llama.cpp's `llama_token_attr` bits).
pub mod attr {
    /// No attribute: the token decodes to nothing.
    pub const UNDEFINED: u16 = 0;
    /// The unknown token.
    pub const UNKNOWN: u16 = 1;
    /// A placeholder never produced.
    pub const UNUSED: u16 = 1 << 1;
    /// An ordinary piece.
    pub const NORMAL: u16 = 1 << 2;
    /// A control token (BOS, EOS, turn markers); cut out of text only when parsing specials.
    pub const CONTROL: u16 = 1 << 3;
    /// A user-defined (added) token; always cut out of text verbatim.
    pub const USER_DEFINED: u16 = 1 << 4;
    /// A byte token `<0xNN>`.
    pub const BYTE: u16 = 1 << 5;
    /// Whitespace before the token is dropped when it is cut out of text.
    pub const LSTRIP: u16 = 1 << 7;
    /// Whitespace after the token is dropped when it is cut out of text.
    pub const RSTRIP: u16 = 1 << 8;
}

/// What can go wrong building a tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A metadata value is missing or of the wrong type.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// The tokenizer model is not one this crate implements.
    #[error("tokenizer model {model:?} is not supported (supported: {supported})")]
    UnsupportedModel {
        /// The value of `tokenizer.ggml.model`.
        model: String,
        /// The values that are supported.
        supported: String,
    },
    /// The pre-tokenizer is not one this crate implements.
    #[error(
        "pre-tokenizer {pre:?} (tokenizer.ggml.pre) is not supported (supported: {supported})"
    )]
    UnsupportedPre {
        /// The value of `tokenizer.ggml.pre`.
        pre: String,
        /// The values that are supported.
        supported: String,
    },
    /// The vocabulary has no tokens.
    #[error("the vocabulary (tokenizer.ggml.tokens) is empty")]
    EmptyVocab,
    /// A per-token array is shorter than the vocabulary.
    #[error("`{key}` has {len} entries for {n_tokens} tokens")]
    TooShort {
        /// The metadata key.
        key: String,
        /// Its length.
        len: usize,
        /// The vocabulary size.
        n_tokens: usize,
    },
    /// A merge rule cannot be used.
    #[error("merge #{index} {merge:?} (tokenizer.ggml.merges) {problem}")]
    BadMerge {
        /// Position in the merge list.
        index: usize,
        /// The rule.
        merge: String,
        /// What is wrong with it.
        problem: String,
    },
    /// A special token id is outside the vocabulary.
    #[error("`{key}` = {id} is outside the vocabulary of {n_tokens} tokens")]
    SpecialOutOfRange {
        /// The metadata key.
        key: String,
        /// The id found.
        id: i64,
        /// The vocabulary size.
        n_tokens: usize,
    },
    /// A `tokenizer.json` or its `tokenizer_config.json` could not be used.
    #[error("{path}: {problem}")]
    Json {
        /// The file.
        path: String,
        /// What is wrong.
        problem: String,
    },
    /// Encoding through the `tokenizers` crate failed.
    #[error("tokenizer.json encoding failed: {0}")]
    Encode(String),
    /// Anything else about the tokenizer that is impossible.
    #[error("invalid tokenizer: {0}")]
    Invalid(String),
}

/// Which algorithm turns text into tokens.
#[derive(Debug)]
enum Model {
    /// BPE with a pre-tokenizer (`gpt2`, `gemma4`).
    Bpe {
        bpe: Box<bpe::Bpe>,
        pre: pretokenize::PreTokenizer,
    },
    /// SentencePiece merging by score (`llama`).
    Spm { byte_tokens: Box<[u32; 256]> },
    /// A `tokenizer.json` run by the `tokenizers` crate.
    Hf(Box<hf::HfModel>),
}

/// Well-known special token ids.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpecialIds {
    /// Beginning of sequence.
    pub bos: Option<u32>,
    /// End of sequence.
    pub eos: Option<u32>,
    /// End of turn.
    pub eot: Option<u32>,
    /// End of message (tool call).
    pub eom: Option<u32>,
    /// Unknown.
    pub unk: Option<u32>,
    /// Separator.
    pub sep: Option<u32>,
    /// Padding.
    pub pad: Option<u32>,
    /// Mask.
    pub mask: Option<u32>,
    /// Fill-in-the-middle prefix.
    pub fim_pre: Option<u32>,
    /// Fill-in-the-middle suffix.
    pub fim_suf: Option<u32>,
    /// Fill-in-the-middle middle.
    pub fim_mid: Option<u32>,
    /// Fill-in-the-middle padding.
    pub fim_pad: Option<u32>,
    /// Fill-in-the-middle repository name.
    pub fim_rep: Option<u32>,
    /// Fill-in-the-middle file separator.
    pub fim_sep: Option<u32>,
}

/// A tokenizer: text to token ids and back.
pub struct Tokenizer {
    vocab: Vocab,
    attrs: Vec<u16>,
    scores: Vec<f32>,
    /// Decoded bytes of every token, back to back; token `i` is `pieces[offsets[i]..offsets[i+1]]`.
    pieces: Vec<u8>,
    offsets: Vec<u32>,
    model: Model,
    ids: SpecialIds,
    eog: AHashSet<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    escape_whitespace: bool,
    /// Tokens cut out of text before the model runs: control, user-defined and unknown
    /// tokens, longest first.
    special_order: Vec<u32>,
    /// Finds which of `special_order` occur in a text at all.
    special_finder: Option<aho_corasick::AhoCorasick>,
    /// Description for logs: model and pre-tokenizer.
    kind: String,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("kind", &self.kind)
            .field("vocab_size", &self.vocab.len())
            .field("ids", &self.ids)
            .field("add_bos", &self.add_bos)
            .field("add_eos", &self.add_eos)
            .finish_non_exhaustive()
    }
}

/// Texts llama.cpp takes for an end-of-turn token when the file names none.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];
const EOM_TEXTS: &[&str] = &["<|eom_id|>"];
const FIM_PRE_TEXTS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
];
const FIM_SUF_TEXTS: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
];
const FIM_MID_TEXTS: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
];
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP_TEXTS: &[&str] = &[
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
];
const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];
/// Texts llama.cpp counts as end of generation.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// GGUF tokenizer models this crate implements.
pub const SUPPORTED_MODELS: &[&str] = &["gpt2", "llama", "gemma4"];

/// Everything a tokenizer is built from, whatever the source.
struct Parts {
    vocab: Vocab,
    scores: Vec<f32>,
    attrs: Vec<u16>,
    ids: SpecialIds,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    escape_whitespace: bool,
    /// Lower-cased `general.name`, `tokenizer.ggml.pre`, `general.architecture`: llama.cpp
    /// sets a few token attributes by model name.
    name: String,
    pre_name: String,
    arch: String,
    /// Pieces are byte-level (GPT-2) characters rather than `▁`-escaped text.
    byte_level: bool,
}

impl Tokenizer {
    /// Builds the tokenizer described by a GGUF file's `tokenizer.ggml.*` metadata.
    ///
    /// # Errors
    /// When the tokenizer model or pre-tokenizer is not supported, a required key is missing
    /// or of the wrong type, the vocabulary is empty, a per-token array is too short, a merge
    /// names an unknown token, or the BOS/EOS id is outside the vocabulary.
    pub fn from_gguf(md: &Metadata) -> Result<Self, TokenizerError> {
        let model = md.str("tokenizer.ggml.model")?.to_string();
        let pre_name = md.opt_str("tokenizer.ggml.pre")?.map(str::to_string);
        let (is_bpe, pre_info) = match model.as_str() {
            "gpt2" => (true, Some(pretokenize::pre_info(pre_name.as_deref())?)),
            "gemma4" => (true, Some(pretokenize::pre_info(Some("gemma4"))?)),
            "llama" => (false, None),
            other => {
                return Err(TokenizerError::UnsupportedModel {
                    model: other.to_string(),
                    supported: SUPPORTED_MODELS.join(", "),
                })
            }
        };

        let tokens = md.str_array("tokenizer.ggml.tokens")?;
        let n = tokens.len();
        if n == 0 {
            return Err(TokenizerError::EmptyVocab);
        }
        if n >= u32::MAX as usize - 1 {
            return Err(TokenizerError::Invalid(format!(
                "{n} tokens is more than token ids can hold"
            )));
        }
        let vocab = Vocab::new(tokens.iter().enumerate().map(|(i, t)| {
            if t.is_empty() {
                Cow::Owned(format!("[EMPTY_{i}]"))
            } else {
                Cow::Borrowed(t.as_str())
            }
        }))
        .ok_or_else(|| TokenizerError::Invalid("token texts exceed 4 GiB".into()))?;

        let scores = match md.get("tokenizer.ggml.scores") {
            None => vec![0.0; n],
            Some(MetaValue::Array(a)) => {
                let v = match a {
                    MetaArray::F32(v) => v.clone(),
                    MetaArray::I32(v) => v.iter().map(|&x| x as f32).collect(),
                    _ => md.f32_array("tokenizer.ggml.scores")?,
                };
                if v.len() < n {
                    return Err(TokenizerError::TooShort {
                        key: "tokenizer.ggml.scores".into(),
                        len: v.len(),
                        n_tokens: n,
                    });
                }
                v
            }
            Some(_) => md.f32_array("tokenizer.ggml.scores")?,
        };

        let attrs: Vec<u16> = match md.get("tokenizer.ggml.token_type") {
            None => vec![attr::NORMAL; n],
            Some(_) => {
                let types = md.int_array("tokenizer.ggml.token_type")?;
                if types.len() < n {
                    return Err(TokenizerError::TooShort {
                        key: "tokenizer.ggml.token_type".into(),
                        len: types.len(),
                        n_tokens: n,
                    });
                }
                types[..n].iter().map(|&t| type_to_attr(t)).collect()
            }
        };

        // Defaults by model, then the file's keys.
        let mut ids = SpecialIds::default();
        let mut add_bos;
        let mut add_eos = false;
        let mut add_space_prefix;
        let mut escape_whitespace = false;
        let model_impl;
        if is_bpe {
            let info = pre_info
                .ok_or_else(|| TokenizerError::Invalid("BPE without a pre-tokenizer".into()))?;
            add_bos = info.add_bos;
            add_space_prefix = false;
            let gemma4 = info.pre == PreType::Gemma4;
            escape_whitespace = gemma4;
            let merges = md.str_array("tokenizer.ggml.merges")?;
            let bpe = bpe::Bpe::new(&vocab, merges, !gemma4, info.ignore_merges, gemma4)?;
            model_impl = Model::Bpe {
                bpe: Box::new(bpe),
                pre: pretokenize::PreTokenizer::new(info.pre)?,
            };
        } else {
            ids.bos = Some(1);
            ids.eos = Some(2);
            ids.unk = Some(0);
            add_bos = true;
            add_space_prefix = true;
            model_impl = Model::Spm {
                byte_tokens: Box::new(spm::byte_tokens(&vocab)),
            };
        }
        if let Some(v) = md.opt_bool("tokenizer.ggml.add_space_prefix")? {
            add_space_prefix = v;
        }
        // A default outside the vocabulary is dropped.
        for slot in [&mut ids.bos, &mut ids.eos, &mut ids.unk] {
            if slot.is_some_and(|id| id as usize >= n) {
                *slot = None;
            }
        }
        let read = |key: &str, strict: bool| -> Result<Option<u32>, TokenizerError> {
            let Some(v) = md.get(key) else {
                return Ok(None);
            };
            let Some(id) = v.as_i64() else {
                return Err(GgufError::Metadata {
                    path: md.path.clone(),
                    key: key.into(),
                    problem: format!("expected an integer, found {}", v.type_name()),
                }
                .into());
            };
            match usize::try_from(id).ok().filter(|&i| i < n) {
                Some(i) => Ok(Some(i as u32)),
                None if strict => Err(TokenizerError::SpecialOutOfRange {
                    key: key.into(),
                    id,
                    n_tokens: n,
                }),
                // llama.cpp keeps the default for other special ids out of range.
                None => Ok(None),
            }
        };
        let set = |slot: &mut Option<u32>, key: &str, strict: bool| -> Result<(), TokenizerError> {
            if let Some(id) = read(key, strict)? {
                *slot = Some(id);
            }
            Ok(())
        };
        set(&mut ids.bos, "tokenizer.ggml.bos_token_id", true)?;
        set(&mut ids.eos, "tokenizer.ggml.eos_token_id", true)?;
        set(&mut ids.eot, "tokenizer.ggml.eot_token_id", false)?;
        set(&mut ids.eom, "tokenizer.ggml.eom_token_id", false)?;
        set(&mut ids.unk, "tokenizer.ggml.unknown_token_id", false)?;
        set(&mut ids.sep, "tokenizer.ggml.seperator_token_id", false)?;
        set(&mut ids.pad, "tokenizer.ggml.padding_token_id", false)?;
        set(&mut ids.mask, "tokenizer.ggml.mask_token_id", false)?;
        set(&mut ids.fim_pre, "tokenizer.ggml.fim_pre_token_id", false)?;
        set(&mut ids.fim_suf, "tokenizer.ggml.fim_suf_token_id", false)?;
        set(&mut ids.fim_mid, "tokenizer.ggml.fim_mid_token_id", false)?;
        set(&mut ids.fim_pad, "tokenizer.ggml.fim_pad_token_id", false)?;
        set(&mut ids.fim_rep, "tokenizer.ggml.fim_rep_token_id", false)?;
        set(&mut ids.fim_sep, "tokenizer.ggml.fim_sep_token_id", false)?;
        set(&mut ids.fim_pre, "tokenizer.ggml.prefix_token_id", false)?;
        set(&mut ids.fim_suf, "tokenizer.ggml.suffix_token_id", false)?;
        set(&mut ids.fim_mid, "tokenizer.ggml.middle_token_id", false)?;
        if let Some(v) = md.opt_bool("tokenizer.ggml.add_bos_token")? {
            add_bos = v;
        }
        if let Some(v) = md.opt_bool("tokenizer.ggml.add_eos_token")? {
            add_eos = v;
        }
        if matches!(&model_impl, Model::Bpe { .. }) && model == "gemma4" {
            add_bos = true;
        }

        let kind = format!("{model} (pre {})", pre_name.as_deref().unwrap_or("default"));
        let parts = Parts {
            vocab,
            scores,
            attrs,
            ids,
            add_bos,
            add_eos,
            add_space_prefix,
            escape_whitespace,
            name: md
                .opt_str("general.name")
                .ok()
                .flatten()
                .unwrap_or("")
                .to_lowercase(),
            pre_name: pre_name.unwrap_or_default(),
            arch: md
                .opt_str("general.architecture")
                .ok()
                .flatten()
                .unwrap_or("")
                .to_string(),
            byte_level: is_bpe && model != "gemma4",
        };
        Ok(Self::finish(parts, model_impl, kind))
    }

    /// Builds a tokenizer from a Hugging Face `tokenizer.json`; a `tokenizer_config.json`
    /// beside it supplies the BOS/EOS tokens and whether to add them.
    ///
    /// # Errors
    /// When a file cannot be read or parsed, or the `tokenizers` crate rejects it.
    pub fn from_tokenizer_json(path: &Path) -> Result<Self, TokenizerError> {
        let loaded = hf::load(path)?;
        let hf::Loaded { model, parts: p } = loaded;
        let n = p.texts.len();
        let vocab = Vocab::new(p.texts.iter().enumerate().map(|(i, t)| {
            if t.is_empty() {
                Cow::Owned(format!("[EMPTY_{i}]"))
            } else {
                Cow::Borrowed(t.as_str())
            }
        }))
        .ok_or_else(|| TokenizerError::Invalid("token texts exceed 4 GiB".into()))?;
        let parts = Parts {
            scores: vec![0.0; n],
            vocab,
            attrs: p.attrs,
            ids: p.ids,
            add_bos: p.add_bos,
            add_eos: p.add_eos,
            add_space_prefix: false,
            escape_whitespace: !p.byte_level,
            name: String::new(),
            pre_name: String::new(),
            arch: String::new(),
            byte_level: p.byte_level,
        };
        Ok(Self::finish(
            parts,
            Model::Hf(Box::new(model)),
            format!("tokenizer.json {}", path.display()),
        ))
    }

    /// llama.cpp's loader after the vocabulary is read: detect end-of-turn and
    /// fill-in-the-middle tokens by text, build the end-of-generation set, list the special
    /// tokens, and decode every token once.
    fn finish(mut p: Parts, model: Model, kind: String) -> Self {
        let n = p.vocab.len();
        let mut ids = p.ids;

        // The first text of `list` the vocabulary has. llama.cpp takes the first it meets
        // walking its hash map, an order that depends on the hash; the list's own order is
        // repeatable and prefers the specific marker (`<|im_end|>` over `<|endoftext|>`).
        // Only the reported id can differ: every candidate ends generation either way.
        let find = |list: &[&str]| list.iter().find_map(|t| p.vocab.get(t));
        let mut set_control = Vec::new();
        for (slot, list) in [
            (&mut ids.eot, EOT_TEXTS),
            (&mut ids.eom, EOM_TEXTS),
            (&mut ids.fim_pre, FIM_PRE_TEXTS),
            (&mut ids.fim_suf, FIM_SUF_TEXTS),
            (&mut ids.fim_mid, FIM_MID_TEXTS),
            (&mut ids.fim_pad, FIM_PAD_TEXTS),
            (&mut ids.fim_rep, FIM_REP_TEXTS),
            (&mut ids.fim_sep, FIM_SEP_TEXTS),
        ] {
            if slot.is_none() {
                if let Some(id) = find(list) {
                    *slot = Some(id);
                    set_control.push(id);
                }
            }
        }
        for id in set_control {
            p.attrs[id as usize] |= attr::CONTROL;
        }
        // Control tokens named "unused" are unused.
        for id in 0..n as u32 {
            let a = p.attrs[id as usize];
            if a & attr::CONTROL != 0
                && p.vocab.text(id).contains("unused")
                && p.vocab.get(p.vocab.text(id)) == Some(id)
            {
                p.attrs[id as usize] |= attr::UNUSED;
            }
        }

        let mut eog = AHashSet::new();
        for id in [ids.fim_pad, ids.fim_rep, ids.fim_sep]
            .into_iter()
            .flatten()
        {
            eog.insert(id);
        }
        for t in EOG_TEXTS {
            if let Some(id) = p.vocab.get(t) {
                eog.insert(id);
                p.attrs[id as usize] |= attr::CONTROL;
            }
        }
        // gpt-oss: these always render.
        for t in ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"] {
            if let Some(id) = p.vocab.get(t) {
                p.attrs[id as usize] = attr::USER_DEFINED;
            }
        }
        for id in [ids.eos, ids.eot, ids.eom].into_iter().flatten() {
            eog.insert(id);
        }
        let eog_with = |eog: &AHashSet<u32>, text: &str| {
            eog.iter().copied().find(|&id| p.vocab.text(id) == text)
        };
        // o200k_harmony and solar-open: "<|end|>" is not the end when "<|return|>"/"<|call|>" exist.
        if let Some(end) = eog_with(&eog, "<|end|>") {
            let has = |t: &str| eog_with(&eog, t).is_some();
            if (has("<|return|>") && has("<|call|>"))
                || ((has("<|call|>") || has("<|calls|>")) && has("<|flush|>"))
            {
                eog.remove(&end);
                p.attrs[end as usize] = attr::USER_DEFINED;
            }
        }
        // Gemma 4 and PLaMo: "</s>" is an ordinary token.
        if let Some(s) = eog_with(&eog, "</s>") {
            if eog_with(&eog, "<|tool_response>").is_some()
                || eog_with(&eog, "<|plamo:eos|>").is_some()
            {
                eog.remove(&s);
                p.attrs[s as usize] = attr::NORMAL;
            }
        }

        let mut special_order: Vec<u32> = (0..n as u32)
            .filter(|&id| {
                p.attrs[id as usize] & (attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN) != 0
            })
            .collect();
        special_order.sort_by(|&a, &b| {
            p.vocab
                .text(b)
                .len()
                .cmp(&p.vocab.text(a).len())
                .then(a.cmp(&b))
        });

        // Attributes llama.cpp sets by model name.
        let set_attr = |attrs: &mut Vec<u16>, vocab: &Vocab, text: &str, bit: u16, on: bool| {
            if let Some(id) = vocab.get(text) {
                let a = &mut attrs[id as usize];
                *a = if on { *a | bit } else { *a & !bit };
            }
        };
        let contains_any = |s: &str, subs: &[&str]| subs.iter().any(|x| s.contains(x));
        if contains_any(
            &p.pre_name,
            &["jina-v2-de", "jina-v2-es", "jina-v2-code", "mmbert"],
        ) || contains_any(&p.arch, &["nomic-bert-moe", "jina-bert-v3"])
        {
            set_attr(&mut p.attrs, &p.vocab, "<mask>", attr::LSTRIP, true);
        } else if contains_any(&p.name, &["phi-3", "phi3"]) {
            for &id in &special_order {
                p.attrs[id as usize] |= attr::RSTRIP;
            }
            set_attr(&mut p.attrs, &p.vocab, "</s>", attr::RSTRIP, true);
            for t in ["<unk>", "<s>", "<|endoftext|>"] {
                set_attr(&mut p.attrs, &p.vocab, t, attr::RSTRIP, false);
            }
        } else if contains_any(&p.name, &["modern-bert"]) {
            set_attr(&mut p.attrs, &p.vocab, "[MASK]", attr::LSTRIP, true);
        }

        let special_finder = if special_order.is_empty() {
            None
        } else {
            aho_corasick::AhoCorasick::builder()
                .match_kind(aho_corasick::MatchKind::Standard)
                .build(special_order.iter().map(|&id| p.vocab.text(id).as_bytes()))
                .ok()
        };

        // Decoded bytes of every token (llama.cpp's token_to_piece with special = true).
        let mut pieces = Vec::with_capacity(n * 6);
        let mut offsets = Vec::with_capacity(n + 1);
        offsets.push(0u32);
        for (text, &a) in p.vocab.texts().zip(&p.attrs) {
            piece_bytes(text, a, p.byte_level, &mut pieces);
            offsets.push(u32::try_from(pieces.len()).unwrap_or(u32::MAX));
        }

        Tokenizer {
            vocab: p.vocab,
            attrs: p.attrs,
            scores: p.scores,
            pieces,
            offsets,
            model,
            ids,
            eog,
            add_bos: p.add_bos,
            add_eos: p.add_eos,
            add_space_prefix: p.add_space_prefix,
            escape_whitespace: p.escape_whitespace,
            special_order,
            special_finder,
            kind,
        }
    }

    /// Turns text into token ids, as llama.cpp's `llama_tokenize` does.
    ///
    /// `add_special` adds BOS (and EOS) where the model asks for them; `parse_special`
    /// turns the text of control tokens (`<|im_start|>`) into those tokens. User-defined
    /// tokens are always matched verbatim.
    ///
    /// # Errors
    /// Only for a `tokenizer.json` tokenizer, when the `tokenizers` crate fails.
    pub fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            if let Some(bos) = self.ids.bos {
                out.push(bos);
            }
        }
        if let Model::Hf(hf) = &self.model {
            hf.encode(text, parse_special, &mut out)?;
        } else {
            let frags = self.partition(text, parse_special);
            match &self.model {
                Model::Bpe { bpe, pre } => {
                    let mut scratch = bpe::Scratch::default();
                    let mut escaped;
                    for frag in frags {
                        match frag {
                            Frag::Token(id) => out.push(id),
                            Frag::Text(a, b) => {
                                let mut piece = &text[a..b];
                                if self.escape_whitespace {
                                    escaped = piece.replace(' ', "▁");
                                    piece = &escaped;
                                }
                                for (s, e) in pre.split(piece) {
                                    bpe.encode_word(
                                        &self.vocab,
                                        &piece[s..e],
                                        &mut out,
                                        &mut scratch,
                                    );
                                }
                            }
                        }
                    }
                }
                Model::Spm { byte_tokens } => {
                    let mut prev_special = true;
                    let mut buf = String::new();
                    for frag in frags {
                        match frag {
                            Frag::Token(id) => {
                                out.push(id);
                                prev_special = true;
                            }
                            Frag::Text(a, b) => {
                                buf.clear();
                                if self.add_space_prefix && prev_special {
                                    buf.push('▁');
                                }
                                for c in text[a..b].chars() {
                                    buf.push(if c == ' ' { '▁' } else { c });
                                }
                                spm::encode(
                                    &self.vocab,
                                    &self.scores,
                                    byte_tokens,
                                    self.ids.unk,
                                    &buf,
                                    &mut out,
                                );
                                prev_special = false;
                            }
                        }
                    }
                }
                Model::Hf(_) => {}
            }
        }
        if add_special && self.add_eos {
            if let Some(eos) = self.ids.eos {
                out.push(eos);
            }
        }
        Ok(out)
    }

    /// Cuts special tokens out of `text` the way llama.cpp does: for each special token,
    /// longest first, every occurrence in the text not yet cut becomes that token, with
    /// whitespace dropped beside it where the token has lstrip/rstrip.
    fn partition(&self, text: &str, parse_special: bool) -> Vec<Frag> {
        let mut frags = Vec::new();
        if text.is_empty() {
            return frags;
        }
        frags.push(Frag::Text(0, text.len()));
        let Some(finder) = &self.special_finder else {
            return frags;
        };
        // Which special tokens occur at all (positions in `special_order`).
        let mut present: Vec<usize> = finder
            .find_overlapping_iter(text)
            .map(|m| m.pattern().as_usize())
            .collect();
        if present.is_empty() {
            return frags;
        }
        present.sort_unstable();
        present.dedup();
        let is_space = |b: u8| matches!(b, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r');
        let bytes = text.as_bytes();
        let mut next = Vec::new();
        for pos in present {
            let Some(&id) = self.special_order.get(pos) else {
                continue;
            };
            let a = self.attrs[id as usize];
            if !parse_special && a & (attr::CONTROL | attr::UNKNOWN) != 0 {
                continue;
            }
            let pat = self.vocab.text(id);
            if pat.is_empty() {
                continue;
            }
            next.clear();
            for frag in frags.drain(..) {
                let Frag::Text(mut start, end) = frag else {
                    next.push(frag);
                    continue;
                };
                while let Some(found) = text[start..end].find(pat) {
                    let m = start + found;
                    let mut left_end = m;
                    if a & attr::LSTRIP != 0 {
                        while left_end > start && is_space(bytes[left_end - 1]) {
                            left_end -= 1;
                        }
                    }
                    if left_end > start {
                        next.push(Frag::Text(start, left_end));
                    }
                    next.push(Frag::Token(id));
                    start = m + pat.len();
                    if a & attr::RSTRIP != 0 {
                        while start < end && is_space(bytes[start]) {
                            start += 1;
                        }
                    }
                }
                if start < end {
                    next.push(Frag::Text(start, end));
                }
            }
            std::mem::swap(&mut frags, &mut next);
        }
        frags
    }

    /// Turns token ids back into text (llama.cpp's `llama_detokenize` without its
    /// "clean up spaces" pass, so that byte-level BPE round-trips exactly).
    ///
    /// With `skip_special`, control and unknown tokens give no text, and a leading BOS /
    /// trailing EOS that encoding would have added are dropped. Where the model adds a
    /// space prefix, one leading space of the first token is removed unless a BOS was
    /// dropped (as llama.cpp does). Ids outside the vocabulary are ignored.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        let mut ids = ids;
        let mut remove_space = self.add_space_prefix;
        if let (true, true, Some((&first, rest))) = (skip_special, self.add_bos, ids.split_first())
        {
            if Some(first) == self.ids.bos {
                remove_space = false;
                ids = rest;
            }
        }
        if let (true, true, Some((&last, rest))) = (skip_special, self.add_eos, ids.split_last()) {
            if Some(last) == self.ids.eos {
                ids = rest;
            }
        }
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            let mut piece = self.piece(id, skip_special);
            if remove_space {
                if let Some(rest) = piece.strip_prefix(b" ") {
                    piece = rest;
                }
                remove_space = false;
            }
            out.extend_from_slice(piece);
        }
        match String::from_utf8(out) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        }
    }

    /// The bytes token `id` stands for: a byte-level piece decoded to its bytes, `▁` turned
    /// into a space, a byte token `<0xNN>` into its byte, a special token into its text.
    /// Empty for an id outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        let i = id as usize;
        match (self.offsets.get(i), self.offsets.get(i + 1)) {
            (Some(&a), Some(&b)) => self.pieces.get(a as usize..b as usize).unwrap_or(&[]),
            _ => &[],
        }
    }

    /// [`Tokenizer::token_bytes`], or nothing for a control/unknown token when `skip_special`.
    pub(crate) fn piece(&self, id: u32, skip_special: bool) -> &[u8] {
        if skip_special && self.is_special(id) {
            return &[];
        }
        self.token_bytes(id)
    }

    /// Whether `id` is a control or unknown token (what `skip_special` leaves out).
    pub fn is_special(&self, id: u32) -> bool {
        self.attrs
            .get(id as usize)
            .is_some_and(|a| a & (attr::CONTROL | attr::UNKNOWN) != 0)
    }

    /// The attribute bits of `id` (see [`attr`]), if it is in the vocabulary.
    pub fn token_attr(&self, id: u32) -> Option<u16> {
        self.attrs.get(id as usize).copied()
    }

    /// The score of `id` (SentencePiece log-probability; 0 where the file has none).
    pub fn token_score(&self, id: u32) -> Option<f32> {
        self.scores.get(id as usize).copied()
    }

    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    /// The beginning-of-sequence token.
    pub fn bos_id(&self) -> Option<u32> {
        self.ids.bos
    }

    /// The end-of-sequence token.
    pub fn eos_id(&self) -> Option<u32> {
        self.ids.eos
    }

    /// All well-known special ids.
    pub fn special_ids(&self) -> &SpecialIds {
        &self.ids
    }

    /// Whether generation stops at `id` (EOS, end of turn, `<|im_end|>`, ...), as llama.cpp decides.
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    /// The end-of-generation tokens, sorted.
    pub fn eog_ids(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.eog.iter().copied().collect();
        v.sort_unstable();
        v
    }

    /// The id of the token whose text is exactly `piece` (as stored in the vocabulary).
    pub fn token_id(&self, piece: &str) -> Option<u32> {
        self.vocab.get(piece)
    }

    /// The vocabulary text of `id` (byte-level or `▁`-escaped, as stored).
    pub fn token_str(&self, id: u32) -> Option<&str> {
        ((id as usize) < self.vocab.len()).then(|| self.vocab.text(id))
    }

    /// Whether encoding with `add_special` starts with BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos && self.ids.bos.is_some()
    }

    /// Whether encoding with `add_special` ends with EOS.
    pub fn add_eos(&self) -> bool {
        self.add_eos && self.ids.eos.is_some()
    }

    /// Model and pre-tokenizer, for logs.
    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// Number of BPE merges (0 for other models).
    pub fn n_merges(&self) -> usize {
        match &self.model {
            Model::Bpe { bpe, .. } => bpe.n_merges(),
            _ => 0,
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Frag {
    Text(usize, usize),
    Token(u32),
}

/// GGUF `token_type` to attribute bits.
fn type_to_attr(t: i64) -> u16 {
    match t {
        1 => attr::NORMAL,
        2 => attr::UNKNOWN,
        3 => attr::CONTROL,
        4 => attr::USER_DEFINED,
        5 => attr::UNUSED,
        6 => attr::BYTE,
        _ => attr::UNDEFINED,
    }
}

/// Appends the bytes of one token (llama.cpp's `token_to_piece` with special = true).
fn piece_bytes(text: &str, a: u16, byte_level: bool, out: &mut Vec<u8>) {
    if a & (attr::UNKNOWN | attr::CONTROL | attr::USER_DEFINED) != 0 {
        out.extend_from_slice(text.as_bytes());
    } else if a & attr::NORMAL != 0 {
        if byte_level {
            let mut buf = [0u8; 4];
            for c in text.chars() {
                match unicode::char_to_byte(c) {
                    Some(b) => out.push(b),
                    None => out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes()),
                }
            }
        } else {
            for c in text.chars() {
                if c == '▁' {
                    out.push(b' ');
                } else {
                    let mut buf = [0u8; 4];
                    out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                }
            }
        }
    } else if a & attr::BYTE != 0 {
        if let Some(b) = parse_byte_token(text) {
            out.push(b);
        }
    }
}

/// The byte of a `<0xNN>` token.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

#[cfg(test)]
mod tests;
