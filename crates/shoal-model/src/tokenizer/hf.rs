//! A Hugging Face `tokenizer.json` run by the `tokenizers` crate, for models that come as
//! safetensors folders rather than GGUF. Encoding is the crate's; the vocabulary, token
//! kinds and decoding are read from the JSON so that [`super::Tokenizer`] treats both
//! sources alike. BOS/EOS and whether to add them come from `tokenizer_config.json` beside
//! the file, when there is one.

use std::path::Path;

use serde_json::Value;

use super::{attr, SpecialIds, TokenizerError};

/// The two encoders: one cuts special tokens out of text, the other treats them as text.
pub(crate) struct HfModel {
    parse_special: tokenizers::Tokenizer,
    no_special: tokenizers::Tokenizer,
}

impl std::fmt::Debug for HfModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfModel").finish_non_exhaustive()
    }
}

impl HfModel {
    pub(crate) fn encode(
        &self,
        text: &str,
        parse_special: bool,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        let tok = if parse_special {
            &self.parse_special
        } else {
            &self.no_special
        };
        let enc = tok
            .encode(text, false)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        out.extend_from_slice(enc.get_ids());
        Ok(())
    }
}

/// What a `tokenizer.json` gives the common tokenizer.
pub(crate) struct HfParts {
    pub texts: Vec<String>,
    pub attrs: Vec<u16>,
    pub ids: SpecialIds,
    pub add_bos: bool,
    pub add_eos: bool,
    pub byte_level: bool,
}

pub(crate) struct Loaded {
    pub model: HfModel,
    pub parts: HfParts,
}

/// Most tokens accepted (ids must fit comfortably in `u32`).
const MAX_TOKENS: usize = 1 << 24;

fn json_err(path: &Path, problem: impl Into<String>) -> TokenizerError {
    TokenizerError::Json {
        path: path.display().to_string(),
        problem: problem.into(),
    }
}

pub(crate) fn load(path: &Path) -> Result<Loaded, TokenizerError> {
    let bytes =
        std::fs::read(path).map_err(|e| json_err(path, format!("cannot read the file: {e}")))?;
    let json: Value =
        serde_json::from_slice(&bytes).map_err(|e| json_err(path, format!("not JSON: {e}")))?;
    let tok = tokenizers::Tokenizer::from_bytes(&bytes)
        .map_err(|e| json_err(path, format!("not a tokenizer: {e}")))?;

    let vocab = tok.get_vocab(true);
    let n = vocab.values().map(|&id| id as usize + 1).max().unwrap_or(0);
    if n == 0 {
        return Err(TokenizerError::EmptyVocab);
    }
    if n > MAX_TOKENS {
        return Err(json_err(path, format!("token id {} is too large", n - 1)));
    }
    let mut texts = vec![String::new(); n];
    let mut attrs = vec![attr::UNDEFINED; n];
    for (text, &id) in &vocab {
        texts[id as usize] = text.clone();
        attrs[id as usize] = attr::NORMAL;
    }
    let byte_fallback = json
        .pointer("/model/byte_fallback")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    if byte_fallback {
        for (text, a) in texts.iter().zip(attrs.iter_mut()) {
            if super::parse_byte_token(text).is_some() {
                *a = attr::BYTE;
            }
        }
    }
    if let Some(added) = json.get("added_tokens").and_then(Value::as_array) {
        for t in added {
            let Some(id) = t
                .get("id")
                .and_then(Value::as_u64)
                .map(|x| x as usize)
                .filter(|&x| x < n)
            else {
                continue;
            };
            let special = t.get("special").and_then(Value::as_bool).unwrap_or(false);
            let mut a = if special {
                attr::CONTROL
            } else {
                attr::USER_DEFINED
            };
            if t.get("lstrip").and_then(Value::as_bool).unwrap_or(false) {
                a |= attr::LSTRIP;
            }
            if t.get("rstrip").and_then(Value::as_bool).unwrap_or(false) {
                a |= attr::RSTRIP;
            }
            attrs[id] = a;
        }
    }
    let byte_level = json.get("decoder").is_some_and(has_byte_level);

    // tokenizer_config.json beside the file.
    let mut ids = SpecialIds::default();
    let (mut add_bos, mut add_eos) = (false, false);
    if let Some(cfg_path) = path
        .parent()
        .map(|d| d.join("tokenizer_config.json"))
        .filter(|p| p.is_file())
    {
        let cfg_bytes = std::fs::read(&cfg_path)
            .map_err(|e| json_err(&cfg_path, format!("cannot read the file: {e}")))?;
        let cfg: Value = serde_json::from_slice(&cfg_bytes)
            .map_err(|e| json_err(&cfg_path, format!("not JSON: {e}")))?;
        let token_of = |key: &str| -> Option<u32> {
            let v = cfg.get(key)?;
            let text = v
                .as_str()
                .or_else(|| v.get("content").and_then(Value::as_str))?;
            vocab.get(text).copied()
        };
        ids.bos = token_of("bos_token");
        ids.eos = token_of("eos_token");
        ids.unk = token_of("unk_token");
        ids.pad = token_of("pad_token");
        add_bos = cfg
            .get("add_bos_token")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        add_eos = cfg
            .get("add_eos_token")
            .and_then(Value::as_bool)
            .unwrap_or(false);
    }

    let mut no_special = tok.clone();
    no_special.set_encode_special_tokens(true);
    Ok(Loaded {
        model: HfModel {
            parse_special: tok,
            no_special,
        },
        parts: HfParts {
            texts,
            attrs,
            ids,
            add_bos,
            add_eos,
            byte_level,
        },
    })
}

/// Whether a decoder (possibly a `Sequence`) decodes byte-level pieces.
fn has_byte_level(decoder: &Value) -> bool {
    match decoder.get("type").and_then(Value::as_str) {
        Some("ByteLevel") => true,
        Some("Sequence") => decoder
            .get("decoders")
            .and_then(Value::as_array)
            .is_some_and(|ds| ds.iter().any(has_byte_level)),
        _ => false,
    }
}
