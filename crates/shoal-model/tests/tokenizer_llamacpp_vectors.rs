//! llama.cpp's tokenizer test vectors: for each vocabulary-only GGUF under
//! `llama.cpp/models/` with `.inp`/`.out` files, every test string must encode to exactly
//! the ids llama.cpp's `test-tokenizer-0` expects (`add_special = false`,
//! `parse_special = false`, as that program calls `common_tokenize`).
//!
//! The llama.cpp source folder is found through `$SHOAL_LLAMACPP_SRC`, else
//! `$SHOAL_HOME/llama.cpp-src`, else `~/.cache/shoal/llama.cpp-src`. When it is missing the
//! test prints a skip line and passes, unless `SHOAL_REQUIRE_TEST_DATA=1`.

use std::path::{Path, PathBuf};

use shoal_model::gguf::GgufFile;
use shoal_model::tokenizer::Tokenizer;

/// The vocabularies this crate claims to tokenize exactly as llama.cpp does.
const CLAIMED: &[&str] = &[
    "gpt-2",
    "llama-bpe",
    "qwen2",
    "qwen35",
    "llama-spm",
    "phi-3",
    "starcoder",
    "refact",
    "command-r",
    "mpt",
    "falcon",
    "deepseek-coder",
    "deepseek-llm",
    "gemma-4",
];

/// The llama.cpp source folder, or `None` (after printing why) when the test should skip.
fn llamacpp_src() -> Option<PathBuf> {
    let dir = if let Some(p) = std::env::var_os("SHOAL_LLAMACPP_SRC") {
        PathBuf::from(p)
    } else if let Some(h) = std::env::var_os("SHOAL_HOME") {
        PathBuf::from(h).join("llama.cpp-src")
    } else {
        PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
            .join(".cache/shoal/llama.cpp-src")
    };
    if dir.join("models").is_dir() {
        return Some(dir);
    }
    if std::env::var("SHOAL_REQUIRE_TEST_DATA").as_deref() == Ok("1") {
        panic!(
            "llama.cpp source folder {} is missing and SHOAL_REQUIRE_TEST_DATA=1",
            dir.display()
        );
    }
    println!(
        "SKIP: llama.cpp source folder {} not found (set SHOAL_LLAMACPP_SRC)",
        dir.display()
    );
    None
}

/// Reads `<vocab>.inp` (strings separated by `\n__ggml_vocab_test__\n`) and `<vocab>.out`
/// (one line of space-separated ids per string).
fn read_vectors(gguf: &Path) -> Vec<(String, Vec<u32>)> {
    let inp = std::fs::read_to_string(format!("{}.inp", gguf.display())).expect("read .inp");
    let out = std::fs::read_to_string(format!("{}.out", gguf.display())).expect("read .out");
    let sep = "\n__ggml_vocab_test__\n";
    let mut strings = Vec::new();
    let mut rest = inp.as_str();
    while !rest.is_empty() {
        match rest.find(sep) {
            Some(i) => {
                strings.push(rest[..i].to_string());
                rest = &rest[i + sep.len()..];
            }
            None => {
                strings.push(rest.to_string());
                break;
            }
        }
    }
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        strings.len(),
        lines.len(),
        "{}: .inp and .out disagree on the number of tests",
        gguf.display()
    );
    strings
        .into_iter()
        .zip(lines)
        .map(|(s, l)| {
            (
                s,
                l.split_whitespace()
                    .map(|t| t.parse().expect("id"))
                    .collect(),
            )
        })
        .collect()
}

/// Runs one vocabulary's vectors; returns (passed, failures described).
fn run_vocab(dir: &Path, name: &str) -> (usize, usize, Vec<String>) {
    let path = dir.join(format!("models/ggml-vocab-{name}.gguf"));
    let file = GgufFile::open(&path).expect("open vocab gguf");
    let t0 = std::time::Instant::now();
    let tok = Tokenizer::from_gguf(file.metadata()).unwrap_or_else(|e| panic!("{name}: {e}"));
    let built = t0.elapsed();
    let vectors = read_vectors(&path);
    let mut failures = Vec::new();
    for (text, want) in &vectors {
        let got = tok.encode(text, false, false).expect("encode");
        if &got != want {
            failures.push(format!(
                "{name}: {text:?}\n   want {want:?}\n    got {got:?}"
            ));
        }
    }
    println!(
        "{name}: {}/{} vectors pass (built in {built:?})",
        vectors.len() - failures.len(),
        vectors.len()
    );
    (vectors.len() - failures.len(), vectors.len(), failures)
}

#[test]
fn llamacpp_vocab_vectors() {
    let Some(dir) = llamacpp_src() else { return };
    let mut all_failures = Vec::new();
    for name in CLAIMED {
        let (_, _, failures) = run_vocab(&dir, name);
        all_failures.extend(failures);
    }
    for f in all_failures.iter().take(40) {
        println!("{f}");
    }
    assert!(
        all_failures.is_empty(),
        "{} vectors fail",
        all_failures.len()
    );
}

/// Real byte-level BPE vocabularies, loaded once.
fn real_bpe() -> &'static [(String, Tokenizer)] {
    static TOKS: std::sync::OnceLock<Vec<(String, Tokenizer)>> = std::sync::OnceLock::new();
    TOKS.get_or_init(|| {
        let Some(dir) = llamacpp_src() else {
            return Vec::new();
        };
        ["gpt-2", "llama-bpe", "qwen2"]
            .iter()
            .map(|name| {
                let file = GgufFile::open(dir.join(format!("models/ggml-vocab-{name}.gguf")))
                    .expect("open");
                (
                    name.to_string(),
                    Tokenizer::from_gguf(file.metadata()).expect("tokenizer"),
                )
            })
            .collect()
    })
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(200))]
    /// Byte-level BPE loses nothing: decode(encode(x)) == x, and streaming agrees.
    #[test]
    fn real_bpe_round_trips(text in proptest::prelude::any::<String>()) {
        for (name, tok) in real_bpe() {
            let ids = tok.encode(&text, false, false).expect("encode");
            proptest::prop_assert_eq!(&tok.decode(&ids, false), &text, "{}", name);
            let mut d = shoal_model::tokenizer::StreamDecoder::new(false);
            let mut streamed = d.push_all(tok, &ids);
            streamed.push_str(&d.finish());
            proptest::prop_assert_eq!(&streamed, &text, "{} stream", name);
        }
    }
}
