//! Unit tests of the tokenizer on small hand-made vocabularies: BPE and SentencePiece
//! merging, special-token cutting, decoding and streaming, and hostile metadata.

use proptest::prelude::*;

use super::*;
use crate::gguf::{MetaArray, MetaValue, Metadata};

fn s(v: &str) -> MetaValue {
    MetaValue::String(v.into())
}

fn strs(v: &[&str]) -> MetaValue {
    MetaValue::Array(MetaArray::String(v.iter().map(|x| x.to_string()).collect()))
}

fn md(entries: Vec<(&str, MetaValue)>) -> Metadata {
    Metadata::from_entries(
        "test.gguf",
        entries
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
    )
}

/// A byte-level BPE vocabulary: the 256 byte characters, a few merges, and special tokens.
fn bpe_entries() -> Vec<(&'static str, MetaValue)> {
    let chars = unicode::byte_to_char_table();
    let mut tokens: Vec<String> = chars.iter().map(|c| c.to_string()).collect();
    let mut types = vec![1i32; 256];
    for (t, ty) in [
        ("Ġt", 1),
        ("he", 1),
        ("Ġthe", 1),
        ("ll", 1),
        ("llo", 1),
        ("<|endoftext|>", 3),
        ("<|im_start|>", 3),
        ("<|im_end|>", 3),
        ("<tool>", 4),
    ] {
        tokens.push(t.into());
        types.push(ty);
    }
    let tokens: Vec<&str> = tokens.iter().map(String::as_str).collect();
    vec![
        ("tokenizer.ggml.model", s("gpt2")),
        ("tokenizer.ggml.pre", s("qwen2")),
        ("tokenizer.ggml.tokens", strs(&tokens)),
        (
            "tokenizer.ggml.token_type",
            MetaValue::Array(MetaArray::I32(types)),
        ),
        (
            "tokenizer.ggml.merges",
            strs(&["Ġ t", "h e", "Ġt he", "l l", "ll o"]),
        ),
        ("tokenizer.ggml.eos_token_id", MetaValue::U32(263)),
        ("tokenizer.ggml.bos_token_id", MetaValue::U32(261)),
    ]
}

fn bpe() -> Tokenizer {
    Tokenizer::from_gguf(&md(bpe_entries())).expect("bpe tokenizer")
}

fn with(
    mut entries: Vec<(&'static str, MetaValue)>,
    key: &'static str,
    v: Option<MetaValue>,
) -> Metadata {
    entries.retain(|(k, _)| *k != key);
    if let Some(v) = v {
        entries.push((key, v));
    }
    md(entries)
}

/// A SentencePiece vocabulary with byte fallback.
fn spm_entries() -> Vec<(&'static str, MetaValue)> {
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut types = vec![2i32, 3, 3];
    let mut scores = vec![0f32; 3];
    for b in 0..256 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
        scores.push(0.0);
    }
    for (t, sc) in [
        ("▁", -1.0),
        ("h", -2.0),
        ("e", -2.0),
        ("l", -2.0),
        ("o", -2.0),
        ("▁h", -3.0),
        ("he", -1.5),
        ("ll", -1.0),
        ("▁he", -2.5),
        ("llo", -2.0),
        ("▁hello", -4.0),
    ] {
        tokens.push(t.into());
        types.push(1);
        scores.push(sc);
    }
    let tokens: Vec<&str> = tokens.iter().map(String::as_str).collect();
    vec![
        ("tokenizer.ggml.model", s("llama")),
        ("tokenizer.ggml.tokens", strs(&tokens)),
        (
            "tokenizer.ggml.token_type",
            MetaValue::Array(MetaArray::I32(types)),
        ),
        (
            "tokenizer.ggml.scores",
            MetaValue::Array(MetaArray::F32(scores)),
        ),
    ]
}

fn spm() -> Tokenizer {
    Tokenizer::from_gguf(&md(spm_entries())).expect("spm tokenizer")
}

#[test]
fn shareable_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
    assert_send_sync::<StreamDecoder>();
}

#[test]
fn bpe_merges_by_rank() {
    let t = bpe();
    let id = |p: &str| t.token_id(p).expect(p);
    assert_eq!(
        t.encode("the hello", false, false).unwrap(),
        vec![id("t"), id("he"), id("Ġ"), id("he"), id("llo")]
    );
    assert_eq!(t.encode(" the", false, false).unwrap(), vec![id("Ġthe")]);
    assert_eq!(
        t.decode(&t.encode("the hello", false, false).unwrap(), false),
        "the hello"
    );
}

#[test]
fn bpe_special_tokens_cut_only_when_parsing() {
    let t = bpe();
    let im_start = t.token_id("<|im_start|>").unwrap();
    let tool = t.token_id("<tool>").unwrap();
    let parsed = t.encode("<|im_start|>x<tool>", false, true).unwrap();
    assert_eq!(parsed[0], im_start);
    assert_eq!(*parsed.last().unwrap(), tool);
    let unparsed = t.encode("<|im_start|>x<tool>", false, false).unwrap();
    assert!(
        !unparsed.contains(&im_start),
        "control tokens are text without parse_special"
    );
    assert_eq!(
        *unparsed.last().unwrap(),
        tool,
        "user-defined tokens are always cut"
    );
    assert_eq!(t.decode(&unparsed, false), "<|im_start|>x<tool>");
    assert_eq!(
        t.decode(&parsed, true),
        "x<tool>",
        "skip_special drops control tokens only"
    );
}

#[test]
fn bpe_eog_and_specials() {
    let t = bpe();
    let end = t.token_id("<|im_end|>").unwrap();
    let eot = t.token_id("<|endoftext|>").unwrap();
    assert!(t.is_eog(end) && t.is_eog(eot));
    assert!(!t.is_eog(t.token_id("<|im_start|>").unwrap()));
    assert_eq!(t.eos_id(), Some(263));
    assert!(!t.add_bos(), "qwen2 pre does not add BOS by default");
    assert_eq!(t.encode("", true, true).unwrap(), Vec::<u32>::new());
}

#[test]
fn add_bos_from_metadata() {
    let t = Tokenizer::from_gguf(&with(
        bpe_entries(),
        "tokenizer.ggml.add_bos_token",
        Some(MetaValue::Bool(true)),
    ))
    .unwrap();
    assert!(t.add_bos());
    assert_eq!(t.encode("x", true, false).unwrap()[0], 261);
    assert_eq!(t.encode("x", false, false).unwrap().len(), 1);
}

#[test]
fn lstrip_rstrip_drop_whitespace() {
    let mut t = bpe();
    let tool = t.token_id("<tool>").unwrap();
    t.attrs[tool as usize] |= attr::LSTRIP | attr::RSTRIP;
    let ids = t.encode("a  <tool>\n b", false, false).unwrap();
    assert_eq!(t.decode(&ids, false), "a<tool>b");
}

#[test]
fn spm_merges_by_score_with_prefix_space() {
    let t = spm();
    let id = |p: &str| t.token_id(p).expect(p);
    assert!(t.add_bos());
    assert_eq!(
        t.encode("hello", true, false).unwrap(),
        vec![1, id("▁hello")]
    );
    // Byte fallback for characters outside the vocabulary.
    let ids = t.encode("h€", false, false).unwrap();
    assert_eq!(
        ids,
        vec![id("▁h"), id("<0xE2>"), id("<0x82>"), id("<0xAC>")]
    );
    // llama.cpp's decode: a leading space is removed unless a BOS was skipped.
    assert_eq!(t.decode(&ids, false), "h€");
    assert_eq!(t.decode(&[1, id("▁hello")], true), " hello");
    assert_eq!(t.decode(&[1, id("▁hello")], false), "<s> hello");
}

#[test]
fn spm_text_after_special_gets_prefix_space() {
    let t = spm();
    let ids = t.encode("</s>hello", false, true).unwrap();
    assert_eq!(ids, vec![2, t.token_id("▁hello").unwrap()]);
}

#[test]
fn stream_holds_partial_characters() {
    let t = spm();
    let ids = t.encode("h€🦙", false, false).unwrap();
    let mut d = StreamDecoder::new(true);
    let mut outs = Vec::new();
    for &id in &ids {
        outs.push(d.push(&t, id));
    }
    // Nothing half-done is ever returned.
    assert_eq!(outs.concat(), " h€🦙");
    assert!(outs
        .iter()
        .all(|o| std::str::from_utf8(o.as_bytes()).is_ok()));
    assert_eq!(outs[1], "", "first byte of € is held back");
    assert_eq!(d.finish(), "");
    // An unfinished character at the end of the stream becomes U+FFFD.
    let mut d = StreamDecoder::new(true);
    assert_eq!(d.push(&t, t.token_id("<0xE2>").unwrap()), "");
    assert_eq!(d.pending(), &[0xE2]);
    assert_eq!(d.finish(), "\u{FFFD}");
    // Invalid bytes are replaced as from_utf8_lossy does.
    let bad = [t.token_id("<0xFF>").unwrap(), t.token_id("h").unwrap()];
    let mut d = StreamDecoder::new(true);
    assert_eq!(d.push_all(&t, &bad), "\u{FFFD}h");
    assert_eq!(t.decode(&bad, true), "\u{FFFD}h");
}

#[test]
fn token_bytes_of_every_kind() {
    let b = bpe();
    assert_eq!(b.token_bytes(b.token_id("Ġthe").unwrap()), b" the");
    assert_eq!(
        b.token_bytes(b.token_id("<|im_end|>").unwrap()),
        b"<|im_end|>"
    );
    assert_eq!(b.token_bytes(u32::MAX), b"");
    let s = spm();
    assert_eq!(s.token_bytes(s.token_id("▁hello").unwrap()), b" hello");
    assert_eq!(s.token_bytes(s.token_id("<0x0A>").unwrap()), b"\n");
    assert_eq!(s.decode(&[u32::MAX, 7, 1 << 30], false), "\u{4}");
}

#[test]
fn hostile_metadata_is_an_error() {
    let cases: Vec<(&str, Metadata)> = vec![
        (
            "tokens missing",
            with(bpe_entries(), "tokenizer.ggml.tokens", None),
        ),
        (
            "tokens not strings",
            with(
                bpe_entries(),
                "tokenizer.ggml.tokens",
                Some(MetaValue::Array(MetaArray::U32(vec![1, 2]))),
            ),
        ),
        (
            "empty vocab",
            with(bpe_entries(), "tokenizer.ggml.tokens", Some(strs(&[]))),
        ),
        (
            "merges missing",
            with(bpe_entries(), "tokenizer.ggml.merges", None),
        ),
        (
            "merge of unknown tokens",
            with(
                bpe_entries(),
                "tokenizer.ggml.merges",
                Some(strs(&["Ġ t", "qq zz"])),
            ),
        ),
        (
            "merge without space",
            with(bpe_entries(), "tokenizer.ggml.merges", Some(strs(&["ab"]))),
        ),
        (
            "bos out of range",
            with(
                bpe_entries(),
                "tokenizer.ggml.bos_token_id",
                Some(MetaValue::U32(1_000_000)),
            ),
        ),
        (
            "eos negative",
            with(
                bpe_entries(),
                "tokenizer.ggml.eos_token_id",
                Some(MetaValue::I32(-1)),
            ),
        ),
        (
            "eos not an integer",
            with(bpe_entries(), "tokenizer.ggml.eos_token_id", Some(s("2"))),
        ),
        (
            "token types short",
            with(
                bpe_entries(),
                "tokenizer.ggml.token_type",
                Some(MetaValue::Array(MetaArray::I32(vec![1; 3]))),
            ),
        ),
        (
            "unknown model",
            with(
                bpe_entries(),
                "tokenizer.ggml.model",
                Some(s("wordpiece-ish")),
            ),
        ),
        (
            "model missing",
            with(bpe_entries(), "tokenizer.ggml.model", None),
        ),
        (
            "unknown pre",
            with(bpe_entries(), "tokenizer.ggml.pre", Some(s("klingon"))),
        ),
        (
            "scores short",
            with(
                spm_entries(),
                "tokenizer.ggml.scores",
                Some(MetaValue::Array(MetaArray::F32(vec![0.0; 4]))),
            ),
        ),
        (
            "scores strings",
            with(spm_entries(), "tokenizer.ggml.scores", Some(strs(&["x"]))),
        ),
        (
            "add_bos not bool",
            with(
                spm_entries(),
                "tokenizer.ggml.add_bos_token",
                Some(MetaValue::U8(1)),
            ),
        ),
    ];
    for (what, m) in cases {
        match Tokenizer::from_gguf(&m) {
            Ok(_) => panic!("{what}: accepted"),
            Err(e) => assert!(!e.to_string().is_empty(), "{what}"),
        }
    }
    let e = Tokenizer::from_gguf(&with(
        bpe_entries(),
        "tokenizer.ggml.pre",
        Some(s("klingon")),
    ))
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("klingon") && e.contains("qwen2") && e.contains("llama-bpe"),
        "{e}"
    );
}

#[test]
fn odd_but_accepted_metadata_does_not_panic() {
    // Unknown token types, NaN scores, repeated and empty token texts, a vocabulary
    // without byte tokens: encoding anything must still work.
    let m = md(vec![
        ("tokenizer.ggml.model", s("llama")),
        ("tokenizer.ggml.tokens", strs(&["a", "a", "", "▁b", "<s>"])),
        (
            "tokenizer.ggml.token_type",
            MetaValue::Array(MetaArray::I32(vec![99, -5, 1, 1, 3])),
        ),
        (
            "tokenizer.ggml.scores",
            MetaValue::Array(MetaArray::F32(vec![f32::NAN, 1.0, 0.0, f32::INFINITY, 0.0])),
        ),
    ]);
    let t = Tokenizer::from_gguf(&m).expect("accepted");
    assert_eq!(t.bos_id(), Some(1), "default BOS id");
    assert_eq!(t.token_str(2), Some("[EMPTY_2]"));
    for text in ["", "a b", "ß🦙\u{0}", " \n\t"] {
        let ids = t.encode(text, true, true).unwrap();
        let _ = t.decode(&ids, true);
    }
    let m = md(vec![
        ("tokenizer.ggml.model", s("gpt2")),
        ("tokenizer.ggml.tokens", strs(&["x", "y", "xy"])),
        ("tokenizer.ggml.merges", strs(&["x y"])),
    ]);
    let t = Tokenizer::from_gguf(&m).expect("accepted");
    assert_eq!(t.encode("xy", true, true).unwrap(), vec![2]);
    assert_eq!(
        t.encode("zxy", false, false).unwrap(),
        vec![2],
        "bytes without tokens are dropped, as llama.cpp does"
    );
}

#[test]
fn long_words_stay_fast() {
    let t = bpe();
    let word = "l".repeat(200_000);
    let start = std::time::Instant::now();
    let ids = t.encode(&word, false, false).unwrap();
    assert_eq!(ids.len(), 100_000);
    assert!(
        start.elapsed() < std::time::Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
}

proptest! {
    #[test]
    fn bpe_round_trips(text in "\\PC*|[ \t\n\r]{0,8}\\p{L}{0,5}|.*") {
        let t = bpe();
        let ids = t.encode(&text, false, false).unwrap();
        prop_assert_eq!(&t.decode(&ids, false), &text);
        let mut d = StreamDecoder::new(false);
        let mut streamed = String::new();
        for &id in &ids {
            streamed.push_str(&d.push(&t, id));
        }
        streamed.push_str(&d.finish());
        prop_assert_eq!(streamed, text);
    }

    #[test]
    fn spm_round_trips_after_bos(text in "[^\\p{C}\u{2581}]*") {
        let t = spm();
        let ids = t.encode(&text, true, false).unwrap();
        // llama.cpp keeps the prefix space when a BOS is present.
        let want = if text.is_empty() { String::new() } else { format!(" {text}") };
        prop_assert_eq!(t.decode(&ids, true), want);
    }

    #[test]
    fn never_panics(bytes in proptest::collection::vec(any::<u32>(), 0..40), text in ".*") {
        for t in [bpe(), spm()] {
            let _ = t.decode(&bytes, false);
            let mut d = StreamDecoder::new(true);
            let _ = d.push_all(&t, &bytes);
            let _ = t.encode(&text, true, true).unwrap();
        }
    }
}
