//! The tiny byte-level BPE tokenizer every test model carries, in GGUF and HF forms.
//!
//! Ids `0..256` are the 256 GPT-2 byte symbols (`bytes_to_unicode` order: the printable bytes
//! `!`..`~`, `¡`..`¬`, `®`..`ÿ` map to themselves, the other 68 bytes to U+0100 upwards, so a
//! space is `Ġ` and a newline `Ċ`); then one token per merge in [`MERGES`] order (merge rank =
//! position); then the special tokens `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`. In GGUF
//! the list is padded with `[PADn]` tokens (type unused) up to the model's vocabulary size, as
//! llama.cpp's converter does. BOS is `<|endoftext|>`, EOS `<|im_end|>`; no BOS is added.
//!
//! The same vocabulary and merges are written as `tokenizer.json` (a `BPE` model with a
//! byte-level pre-tokenizer and decoder; the pre-tokenizer matches llama.cpp's `smollm` or
//! `qwen2` pre-tokenizer type) so that HF `tokenizers` and a GGUF tokenizer give the same ids.

use serde_json::{json, Map, Value};

/// `<|endoftext|>`: BOS and padding.
pub const ENDOFTEXT: &str = "<|endoftext|>";
/// `<|im_start|>`: starts a ChatML turn.
pub const IM_START: &str = "<|im_start|>";
/// `<|im_end|>`: ends a ChatML turn; the EOS token.
pub const IM_END: &str = "<|im_end|>";
/// The special tokens, in id order, after the merged tokens.
pub const SPECIALS: [&str; 3] = [ENDOFTEXT, IM_START, IM_END];

/// GGUF token type: normal.
pub const TOKEN_TYPE_NORMAL: i32 = 1;
/// GGUF token type: control (special).
pub const TOKEN_TYPE_CONTROL: i32 = 3;
/// GGUF token type: unused (padding).
pub const TOKEN_TYPE_UNUSED: i32 = 5;

/// The merges, rank order, written with byte symbols (`Ġ` = space, `Ċ` = newline).
pub const MERGES: &[(&str, &str)] = &[
    ("Ġ", "t"),
    ("h", "e"),
    ("i", "n"),
    ("Ġ", "a"),
    ("Ġt", "he"),
    ("r", "e"),
    ("o", "n"),
    ("e", "r"),
    ("Ġ", "c"),
    ("a", "t"),
    ("Ġc", "at"),
    ("t", "he"),
    ("Ġ", "s"),
    ("Ġ", "w"),
    ("o", "u"),
    ("e", "n"),
    ("i", "s"),
    ("Ġ", "o"),
    ("in", "g"),
    ("Ġ", "d"),
    ("o", "g"),
    ("Ġd", "og"),
    ("Ġs", "at"),
    ("Ġ", "on"),
    ("Ġ", "m"),
    ("Ġm", "at"),
    ("n", "d"),
    ("Ġa", "nd"),
    ("Ġ", "he"),
    ("l", "l"),
    ("he", "ll"),
    ("hell", "o"),
    ("Ġ", "hello"),
    ("Ġ", "is"),
    ("Ġ", "Ġ"),
    ("Ċ", "Ċ"),
    ("u", "s"),
    ("Ġ", "i"),
];

/// The chat template (ChatML) written to GGUF and `tokenizer_config.json`.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Pre-tokenizer regex of Qwen2's `tokenizer.json` (llama.cpp pre type `qwen2`).
pub const QWEN2_PRETOKENIZER_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Which pre-tokenizer the tokenizer uses (it follows the architecture).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreTokenizer {
    /// SmolLM's: digits split one by one, then GPT-2's byte-level regex (GGUF pre `smollm`).
    Smollm,
    /// Qwen2's split regex, then byte-level without regex (GGUF pre `qwen2`).
    Qwen2,
}

impl PreTokenizer {
    /// The value of `tokenizer.ggml.pre`.
    pub fn gguf_name(self) -> &'static str {
        match self {
            PreTokenizer::Smollm => "smollm",
            PreTokenizer::Qwen2 => "qwen2",
        }
    }
}

/// The GPT-2 byte → symbol table: `table[b]` is the character standing for byte `b`.
pub fn bytes_to_unicode() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
        table[b as usize] = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(256 + n).expect("valid code point");
            n += 1;
            c
        };
    }
    table
}

/// Bytes in GPT-2's id order: the printable ones first, then the others.
fn byte_order() -> Vec<u8> {
    let table = bytes_to_unicode();
    let mut bytes: Vec<u8> = (0..=255u8).collect();
    bytes.sort_by_key(|b| table[*b as usize] as u32);
    bytes
}

/// The tiny tokenizer's vocabulary and merges (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct TinyTokenizer {
    tokens: Vec<String>,
    token_types: Vec<i32>,
    merges: Vec<(String, String)>,
}

impl Default for TinyTokenizer {
    fn default() -> Self {
        Self::new()
    }
}

impl TinyTokenizer {
    /// The tokenizer (it is fixed: every tiny model uses the same one).
    pub fn new() -> Self {
        let table = bytes_to_unicode();
        let mut tokens: Vec<String> = byte_order()
            .into_iter()
            .map(|b| table[b as usize].to_string())
            .collect();
        let mut merges = Vec::new();
        for (a, b) in MERGES {
            let merged = format!("{a}{b}");
            merges.push((a.to_string(), b.to_string()));
            tokens.push(merged);
        }
        let mut token_types = vec![TOKEN_TYPE_NORMAL; tokens.len()];
        for s in SPECIALS {
            tokens.push(s.to_string());
            token_types.push(TOKEN_TYPE_CONTROL);
        }
        TinyTokenizer {
            tokens,
            token_types,
            merges,
        }
    }

    /// Number of real tokens (bytes + merges + specials), without GGUF padding.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Never true; present for API symmetry with `len`.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Tokens by id, as byte-level strings.
    pub fn tokens(&self) -> &[String] {
        &self.tokens
    }

    /// GGUF token types by id (1 normal, 3 control).
    pub fn token_types(&self) -> &[i32] {
        &self.token_types
    }

    /// Merges in rank order.
    pub fn merges(&self) -> &[(String, String)] {
        &self.merges
    }

    /// The id of a token given as its byte-level string (`"Ġthe"`, `"<|im_end|>"`).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.tokens
            .iter()
            .position(|t| t == token)
            .map(|i| i as u32)
    }

    /// The id of the token standing for one raw byte.
    pub fn byte_id(&self, byte: u8) -> u32 {
        let c = bytes_to_unicode()[byte as usize].to_string();
        self.token_id(&c).expect("every byte has a token")
    }

    /// BOS id (`<|endoftext|>`).
    pub fn bos_id(&self) -> u32 {
        self.token_id(ENDOFTEXT).expect("special present")
    }

    /// EOS id (`<|im_end|>`).
    pub fn eos_id(&self) -> u32 {
        self.token_id(IM_END).expect("special present")
    }

    /// `<|im_start|>` id.
    pub fn im_start_id(&self) -> u32 {
        self.token_id(IM_START).expect("special present")
    }

    /// Tokens and types padded with `[PADn]` (type unused) to `vocab_size`, as GGUF stores them.
    pub fn gguf_tokens(&self, vocab_size: usize) -> (Vec<String>, Vec<i32>) {
        let mut tokens = self.tokens.clone();
        let mut types = self.token_types.clone();
        for i in tokens.len()..vocab_size {
            tokens.push(format!("[PAD{i}]"));
            types.push(TOKEN_TYPE_UNUSED);
        }
        (tokens, types)
    }

    /// Merges as GGUF stores them: `"a b"`.
    pub fn gguf_merges(&self) -> Vec<String> {
        self.merges
            .iter()
            .map(|(a, b)| format!("{a} {b}"))
            .collect()
    }

    /// `tokenizer.json` in the HF `tokenizers` format.
    pub fn tokenizer_json(&self, pre: PreTokenizer) -> Value {
        let mut vocab = Map::new();
        for (i, t) in self.tokens.iter().enumerate() {
            vocab.insert(t.clone(), json!(i));
        }
        let added: Vec<Value> = SPECIALS
            .iter()
            .map(|s| {
                json!({
                    "id": self.token_id(s),
                    "content": s,
                    "single_word": false,
                    "lstrip": false,
                    "rstrip": false,
                    "normalized": false,
                    "special": true
                })
            })
            .collect();
        let (normalizer, pre_tokenizer) = match pre {
            PreTokenizer::Smollm => (
                Value::Null,
                json!({
                    "type": "Sequence",
                    "pretokenizers": [
                        {"type": "Digits", "individual_digits": true},
                        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}
                    ]
                }),
            ),
            PreTokenizer::Qwen2 => (
                json!({"type": "NFC"}),
                json!({
                    "type": "Sequence",
                    "pretokenizers": [
                        {
                            "type": "Split",
                            "pattern": {"Regex": QWEN2_PRETOKENIZER_REGEX},
                            "behavior": "Isolated",
                            "invert": false
                        },
                        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}
                    ]
                }),
            ),
        };
        json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": normalizer,
            "pre_tokenizer": pre_tokenizer,
            "post_processor": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
            "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
            "model": {
                "type": "BPE",
                "dropout": null,
                "unk_token": null,
                "continuing_subword_prefix": null,
                "end_of_word_suffix": null,
                "fuse_unk": false,
                "byte_fallback": false,
                "ignore_merges": false,
                "vocab": vocab,
                "merges": self.gguf_merges()
            }
        })
    }

    /// `tokenizer_config.json` (chat template, BOS/EOS, no BOS added).
    pub fn tokenizer_config_json(&self, model_max_length: usize) -> Value {
        let mut decoder = Map::new();
        for s in SPECIALS {
            decoder.insert(
                self.token_id(s).expect("special present").to_string(),
                json!({
                    "content": s,
                    "lstrip": false,
                    "normalized": false,
                    "rstrip": false,
                    "single_word": false,
                    "special": true
                }),
            );
        }
        json!({
            "add_bos_token": false,
            "add_eos_token": false,
            "added_tokens_decoder": decoder,
            "additional_special_tokens": [IM_START, IM_END],
            "bos_token": ENDOFTEXT,
            "eos_token": IM_END,
            "pad_token": ENDOFTEXT,
            "unk_token": null,
            "chat_template": CHATML_TEMPLATE,
            "clean_up_tokenization_spaces": false,
            "model_max_length": model_max_length,
            "tokenizer_class": "PreTrainedTokenizerFast"
        })
    }

    /// `special_tokens_map.json`.
    pub fn special_tokens_map_json(&self) -> Value {
        json!({
            "additional_special_tokens": [IM_START, IM_END],
            "bos_token": ENDOFTEXT,
            "eos_token": IM_END,
            "pad_token": ENDOFTEXT
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_is_gpt2s() {
        let t = bytes_to_unicode();
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
        assert_eq!(t[0], 'Ā');
        let mut all: Vec<char> = t.to_vec();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 256);
    }

    #[test]
    fn vocabulary_is_consistent() {
        let tok = TinyTokenizer::new();
        assert_eq!(tok.tokens()[0], "!");
        assert_eq!(tok.byte_id(b'!'), 0);
        assert_eq!(tok.byte_id(b' '), tok.token_id("Ġ").unwrap());
        // every merge joins two tokens that exist and yields a token that exists, after both
        for (a, b) in tok.merges() {
            let ia = tok.token_id(a).unwrap_or_else(|| panic!("{a}"));
            let ib = tok.token_id(b).unwrap_or_else(|| panic!("{b}"));
            let im = tok.token_id(&format!("{a}{b}")).unwrap();
            assert!(im > ia.max(ib) || im < 256, "{a} {b}");
        }
        let mut uniq = tok.tokens().to_vec();
        uniq.sort();
        uniq.dedup();
        assert_eq!(uniq.len(), tok.len());
        assert_eq!(tok.token_id("the"), Some(256 + 11));
        assert_eq!(tok.bos_id() as usize, tok.len() - 3);
        assert_eq!(tok.im_start_id() as usize, tok.len() - 2);
        assert_eq!(tok.eos_id() as usize, tok.len() - 1);
        let (padded, types) = tok.gguf_tokens(320);
        assert_eq!(padded.len(), 320);
        assert_eq!(padded[319], "[PAD319]");
        assert_eq!(types[319], TOKEN_TYPE_UNUSED);
        assert_eq!(types[tok.eos_id() as usize], TOKEN_TYPE_CONTROL);
        assert_eq!(types[5], TOKEN_TYPE_NORMAL);
    }

    fn hf(pre: PreTokenizer) -> tokenizers::Tokenizer {
        let tok = TinyTokenizer::new();
        let s = serde_json::to_string(&tok.tokenizer_json(pre)).unwrap();
        s.parse::<tokenizers::Tokenizer>().unwrap()
    }

    #[test]
    fn hf_tokenizers_encode_expected_ids() {
        let tok = TinyTokenizer::new();
        for pre in [PreTokenizer::Smollm, PreTokenizer::Qwen2] {
            let t = hf(pre);
            let ids = t.encode("the cat", false).unwrap().get_ids().to_vec();
            assert_eq!(
                ids,
                vec![tok.token_id("the").unwrap(), tok.token_id("Ġcat").unwrap()],
                "{pre:?}"
            );
            let ids = t
                .encode("<|im_start|>hello dog<|im_end|>", false)
                .unwrap()
                .get_ids()
                .to_vec();
            assert_eq!(
                ids,
                vec![
                    tok.im_start_id(),
                    tok.token_id("hello").unwrap(),
                    tok.token_id("Ġdog").unwrap(),
                    tok.eos_id()
                ],
                "{pre:?}"
            );
            // digits split one by one with both pre-tokenizers
            let ids = t.encode("42", false).unwrap().get_ids().to_vec();
            assert_eq!(ids, vec![tok.byte_id(b'4'), tok.byte_id(b'2')]);
            // bytes outside ASCII round-trip through the byte symbols
            let text = "héllo ✓\n\nthe sat";
            let enc = t.encode(text, false).unwrap();
            assert_eq!(t.decode(enc.get_ids(), false).unwrap(), text);
            assert_eq!(t.get_vocab_size(true), tok.len());
        }
    }
}
