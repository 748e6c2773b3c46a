//! The hand-written pre-tokenizer scanners against llama.cpp's own, word for word: each
//! test string is split by shoal and by the oracle's `--split` mode (llama.cpp's
//! `unicode_regex_split`, which runs the scanner llama.cpp keeps for that pre-tokenizer).
//! The strings are this file's own (Han beside other scripts, contractions in every case,
//! digits, marks, whitespace and newlines) and, where the llama.cpp source folder is at hand,
//! every string of its tokenizer test vectors (`models/*.inp`).
//!
//! Needs the oracle (`SHOAL_LLAMA_LOGITS_BIN`, see `scripts/build-llama-oracle.sh`); without
//! it the test prints a skip line, and fails under CI.

use std::path::PathBuf;

use shoal_model::tokenizer::pretokenize::PreTokenizer;
use shoal_model::tokenizer::PreType;
use shoal_testkit::{llama_pretokenize, require_oracle};

/// Strings that take each branch of the scanners.
const OWN: &[&str] = &[
    "Hello世界 don't I'M 12345\n\n x",
    "中文和English混在一起，還有日本語のひらがなとカタカナ",
    "你好world你好 world 你好123",
    "한국어 텍스트와 中文",
    "It's, they're; we've: I'd I'll YOU'LL SHE'S 'tis 's",
    "camelCaseWord XMLHttpRequest iPhone ABCdef",
    "Привет мир! Ёжик's",
    "café naïve résumé e\u{301} a\u{300}b",
    "  leading spaces and trailing   ",
    "tabs\tand\r\nCRLF\r\n\r\n lines\n",
    "emoji 😀😀 and symbols ©®™ ++ -- ==> <=",
    "1234567890 ١٢٣٤ ½ Ⅻ",
    "a'b a' 'a '' x'S",
    "(中)[文]{字}",
    "𠀀𠀁 CJK Ext B, 豈 compat, 㐀 Ext A",
    "fn main() {\n    println!(\"hi\");\n}\n",
    "",
    " ",
    "\n",
    "ÉCOLE École éCOLE ÀBC ABCé HTTPServer McDonald's DON'T Don'T ÜBERgroß",
    "x!\n/ a?/\r\n// b.\n\n/ /path/to/file",
    "ΑΘΗΝΑ Αθήνα СССР ǅungla ǈ ᾈ ʰmod",
];

/// llama.cpp's test vectors, when its source folder is here.
fn vector_strings() -> Vec<String> {
    let dir = std::env::var_os("SHOAL_LLAMACPP_SRC")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("SHOAL_HOME").map(|h| PathBuf::from(h).join("llama.cpp-src")))
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/shoal/llama.cpp-src")
        })
        .join("models");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        println!(
            "(no llama.cpp test vectors in {}: own strings only)",
            dir.display()
        );
        return Vec::new();
    };
    let mut out = Vec::new();
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "inp"))
        .collect();
    files.sort();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap_or_default();
        out.extend(
            text.split("\n__ggml_vocab_test__\n")
                .filter(|s| !s.contains('\0'))
                .map(str::to_string),
        );
    }
    out
}

/// shoal's words for `text`.
fn ours(pre: &PreTokenizer, text: &str) -> Vec<String> {
    pre.split(text)
        .into_iter()
        .map(|(a, b)| text[a..b].to_string())
        .collect()
}

#[test]
fn scanners_split_as_llama_cpp_does() {
    let Some(bin) = require_oracle("scanners_split_as_llama_cpp_does") else {
        return;
    };
    let mut texts: Vec<String> = OWN.iter().map(|s| s.to_string()).collect();
    texts.extend(vector_strings());
    let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
    // each pre-tokenizer with a hand-written scanner, by the first expression llama.cpp
    // lists for it
    let cases = [
        (PreType::KimiK2, "\\p{Han}+"),
        (
            PreType::Llama3,
            "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
        ),
        (
            PreType::Qwen2,
            "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
        ),
        // llama.cpp runs this one through its regex engine (no scanner of its own)
        (
            PreType::Gpt4o,
            "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
        ),
    ];
    // the strings tell the scanners apart: Llama 3's differs from Kimi K2's on some
    let kimi = llama_pretokenize(&bin, cases[0].1, &texts).unwrap();
    let llama3 = PreTokenizer::new(PreType::Llama3).unwrap();
    let apart = texts
        .iter()
        .zip(&kimi)
        .filter(|(t, want)| &ours(&llama3, t) != *want)
        .count();
    println!("Llama 3's scanner splits {apart} strings unlike llama.cpp's Kimi K2 scanner");
    assert!(apart > 0, "the strings do not tell Llama 3 from Kimi K2");
    for (pre, regex) in cases {
        let want = llama_pretokenize(&bin, regex, &texts).unwrap();
        let p = PreTokenizer::new(pre).unwrap();
        let mut differ = Vec::new();
        for (text, want) in texts.iter().zip(&want) {
            let got = ours(&p, text);
            if &got != want {
                differ.push(format!(
                    "{text:?}:\n  shoal     {got:?}\n  llama.cpp {want:?}"
                ));
            }
        }
        println!("{pre:?}: {} strings, {} differ", texts.len(), differ.len());
        assert!(
            differ.is_empty(),
            "{pre:?} splits {} of {} strings unlike llama.cpp:\n{}",
            differ.len(),
            texts.len(),
            differ.join("\n")
        );
    }
}
