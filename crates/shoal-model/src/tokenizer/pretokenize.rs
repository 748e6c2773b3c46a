//! Pre-tokenizers for byte-level BPE: the text is cut into words before merges run, by a list
//! of steps applied in turn, each step cutting every piece of the previous one further (a
//! regex match becomes a piece, and so does the text between two matches).
//!
//! The step lists follow llama.cpp's choice for each `tokenizer.ggml.pre` value. The common
//! regexes (GPT-2, Llama 3, Qwen2, Qwen3.5, Kimi K2's, GPT-4o's) are hand-written scanners
//! that reproduce llama.cpp's own scanners (or, for GPT-4o's, its regex engine's reading of
//! the regex), including where those differ from the regex they stand for (a lookahead never
//! looks past the end of the current piece). The other steps are ordinary regexes run on
//! each piece.

use super::unicode::{self, Flags, LETTER, MARK, NUMBER, WHITESPACE};
use super::TokenizerError;

/// A hand-written scanner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scanner {
    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
    Gpt2,
    /// `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
    Llama3,
    /// As [`Scanner::Llama3`] with single digits (`\p{N}`).
    Qwen2,
    /// As [`Scanner::Qwen2`] with marks joining letter runs (`[\p{L}\p{M}]+`).
    Qwen35,
    /// Kimi K2's, as llama.cpp scans it: `\p{Han}+`, then as [`Scanner::Llama3`] but with
    /// Han characters out of the letter runs and the contractions only as a letter run's
    /// suffix (`[^\r\n\p{L}\p{N}]?[\p{L}--\p{Han}]+('s|'t|'re|'ve|'m|'ll|'d)?`, case-blind).
    /// The tokenizer's own regex also splits a letter run where lower case turns to upper;
    /// llama.cpp does not, and neither does this.
    KimiK2,
    /// GPT-4o's (o200k: gpt-oss, Llama 4), as llama.cpp runs it:
    /// `[^\r\n\p{L}\p{N}]?U*L+C?|[^\r\n\p{L}\p{N}]?U+L*C?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+`
    /// with `U` a letter other than `a`-`z`, `L` a letter other than `A`-`Z` (llama.cpp's
    /// reading of the tokenizer's upper- and lower-case classes: a letter outside ASCII is
    /// both, and marks join no word) and `C` a contraction (`'s`, `'t`, `'re`, `'ve`, `'m`,
    /// `'ll`, `'d`, case-blind).
    Gpt4o,
    /// `[^\n]+|[\n]+`
    Newlines,
}

#[derive(Debug, Clone)]
enum Step {
    Scan(Scanner),
    Regex(fancy_regex::Regex),
}

/// The pre-tokenizer types this crate implements, named after llama.cpp's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreType {
    /// No or `default` pre-tokenizer in the file.
    Default,
    /// GPT-2 and the many vocabularies that copy its regex.
    Gpt2,
    /// Llama 3 (`llama-bpe`), DBRX, Smaug.
    Llama3,
    /// Qwen2 / Qwen2.5, StableLM2 and others sharing the regex.
    Qwen2,
    /// Qwen3.5.
    Qwen35,
    /// StarCoder, Refact, Command-R, SmolLM and others: digits split, then GPT-2.
    StarCoder,
    /// Falcon.
    Falcon,
    /// DeepSeek LLM.
    DeepSeekLlm,
    /// DeepSeek Coder.
    DeepSeekCoder,
    /// Gemma 4: SentencePiece-style BPE over raw UTF-8, split only at newlines.
    Gemma4,
    /// Kimi K2 (`kimi-k2`).
    KimiK2,
    /// GPT-4o's o200k (`gpt-4o`, `llama4`, `minimax-m2`): gpt-oss.
    Gpt4o,
}

/// What a `tokenizer.ggml.pre` value implies besides its regexes.
#[derive(Debug, Clone, Copy)]
pub struct PreInfo {
    /// The pre-tokenizer.
    pub pre: PreType,
    /// A word that is itself a token is emitted whole, without running merges.
    pub ignore_merges: bool,
    /// Default for adding BOS when the file does not say.
    pub add_bos: bool,
}

/// `tokenizer.ggml.pre` values accepted, for error messages.
pub const SUPPORTED_PRE: &[&str] = &[
    "default",
    "gpt-2",
    "phi-2",
    "mpt",
    "olmo",
    "jais",
    "trillion",
    "granite-docling",
    "jina-es",
    "jina-de",
    "jina-v2-es",
    "jina-v2-de",
    "gigachat",
    "a.x-4.0",
    "mellum",
    "modern-bert",
    "exaone4",
    "llama3",
    "llama-v3",
    "llama-bpe",
    "glm4",
    "glm5",
    "chatglm-bpe",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
    "jina-v5-nano",
    "dbrx",
    "smaug-bpe",
    "qwen2",
    "deepseek-r1-qwen",
    "kormo",
    "f2llmv2",
    "megrez",
    "stablelm2",
    "hunyuan",
    "solar-open",
    "grok-2",
    "qwen35",
    "starcoder",
    "refact",
    "command-r",
    "smollm",
    "codeshell",
    "exaone",
    "minerva-7b",
    "mellum2",
    "falcon",
    "deepseek-llm",
    "deepseek-coder",
    "kimi-k2",
    "gpt-4o",
    "llama4",
    "kanana2",
    "talkie",
    "minimax-m2",
];

/// Maps a `tokenizer.ggml.pre` value (absent = default) to its pre-tokenizer.
///
/// # Errors
/// [`TokenizerError::UnsupportedPre`] for a value this crate does not implement.
pub fn pre_info(pre: Option<&str>) -> Result<PreInfo, TokenizerError> {
    let info = |pre, ignore_merges, add_bos| PreInfo {
        pre,
        ignore_merges,
        add_bos,
    };
    let name = pre.unwrap_or("");
    Ok(match name {
        "" | "default" => info(PreType::Default, false, false),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" => info(PreType::Llama3, true, true),
        "dbrx" | "smaug-bpe" => info(PreType::Llama3, false, false),
        // GLM-4 and later: Llama 3's regex, with no BOS (llama.cpp's CHATGLM4)
        "glm4" | "glm5" => info(PreType::Llama3, true, false),
        "chatglm-bpe" => info(PreType::Llama3, false, false),
        "deepseek-llm" => info(PreType::DeepSeekLlm, false, false),
        "deepseek-coder" => info(PreType::DeepSeekCoder, false, false),
        "falcon" => info(PreType::Falcon, false, false),
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de"
        | "a.x-4.0" | "mellum" | "modern-bert" | "exaone4" | "mpt" | "olmo" | "jais"
        | "trillion" | "granite-docling" => info(PreType::Gpt2, false, false),
        "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone" | "minerva-7b"
        | "mellum2" => info(PreType::StarCoder, false, false),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" | "stablelm2" | "hunyuan"
        | "solar-open" | "grok-2" => info(PreType::Qwen2, false, false),
        "qwen35" => info(PreType::Qwen35, false, false),
        "gemma4" => info(PreType::Gemma4, false, true),
        "kimi-k2" => info(PreType::KimiK2, false, false),
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => {
            info(PreType::Gpt4o, false, false)
        }
        other => {
            return Err(TokenizerError::UnsupportedPre {
                pre: other.to_string(),
                supported: SUPPORTED_PRE.join(", "),
            })
        }
    })
}

/// Cuts text into words for BPE.
#[derive(Debug, Clone)]
pub struct PreTokenizer {
    steps: Vec<Step>,
}

// DeepSeek LLM's classes. Non-ASCII characters are written as escapes: some of these code
// points (U+1FD3, U+2126, ...) have canonical equivalents that editors silently normalize,
// which would break the ranges.
const DEEPSEEK_LLM_LETTERS: &str = "\\s?[A-Za-z\u{B5}\u{C0}-\u{D6}\u{D8}-\u{F6}\u{F8}-\u{1BA}\u{1BC}-\u{1BF}\u{1C4}-\u{293}\u{295}-\u{2AF}\u{370}-\u{373}\u{376}\u{377}\u{37B}-\u{37D}\u{37F}\u{386}\u{388}-\u{38A}\u{38C}\u{38E}-\u{3A1}\u{3A3}-\u{3F5}\u{3F7}-\u{481}\u{48A}-\u{52F}\u{531}-\u{556}\u{10A0}-\u{10C5}\u{13A0}-\u{13F5}\u{13F8}-\u{13FD}\u{1C90}-\u{1CBA}\u{1CBD}-\u{1CBF}\u{1D00}-\u{1D2B}\u{1D6B}-\u{1D77}\u{1D79}-\u{1D9A}\u{1E00}-\u{1F15}\u{1F18}-\u{1F1D}\u{1F20}-\u{1F45}\u{1F48}-\u{1F4D}\u{1F50}-\u{1F57}\u{1F59}\u{1F5B}\u{1F5D}\u{1F5F}-\u{1F7D}\u{1F80}-\u{1FB4}\u{1FB6}-\u{1FBC}\u{1FBE}\u{1FC2}-\u{1FC4}\u{1FC6}-\u{1FCC}\u{1FD0}-\u{1FD3}\u{1FD6}-\u{1FDB}\u{1FE0}-\u{1FEC}\u{1FF2}-\u{1FF4}\u{1FF6}-\u{1FFC}\u{2102}\u{2107}\u{210A}-\u{2113}\u{2115}\u{2119}-\u{211D}\u{2124}\u{2126}\u{2128}\u{212A}-\u{212D}\u{212F}-\u{2134}\u{2139}\u{213C}-\u{213F}\u{2145}-\u{2149}\u{214E}\u{2183}\u{2184}\u{2C00}-\u{2C7B}\u{2C7E}-\u{2CE4}\u{2CEB}-\u{2CEE}\u{2CF2}\u{2CF3}\u{A640}-\u{A66D}\u{A680}-\u{A69B}\u{A722}-\u{A76F}\u{A771}-\u{A787}\u{A78B}-\u{A78E}\u{AB70}-\u{ABBF}\u{FB00}-\u{FB06}\u{FB13}-\u{FB17}\u{FF21}-\u{FF3A}\u{FF41}-\u{FF5A}\u{10400}-\u{1044F}\u{104B0}-\u{104D3}\u{104D8}-\u{104FB}\u{10C80}-\u{10CB2}\u{10CC0}-\u{10CF2}\u{118A0}-\u{118DF}\u{1E900}-\u{1E943}]+";

const DEEPSEEK_LLM_PUNCT: &str =
    "\\s?[!-/:-~\u{FF01}-\u{FF0F}\u{FF1A}-\u{FF5E}\u{2018}-\u{201F}\u{3000}-\u{3002}]+";
const CJK: &str = "[\u{4E00}-\u{9FA5}\u{800}-\u{4E00}\u{AC00}-\u{D7FF}]+";

impl PreTokenizer {
    /// The pre-tokenizer for `pre`.
    ///
    /// # Errors
    /// When a regex does not compile (a bug, reported rather than panicking).
    pub fn new(pre: PreType) -> Result<Self, TokenizerError> {
        use Scanner::*;
        let scan = |s| Ok(Step::Scan(s));
        let re = |p: &str| {
            fancy_regex::Regex::new(p).map(Step::Regex).map_err(|e| {
                TokenizerError::Invalid(format!("pre-tokenizer regex {p:?} does not compile: {e}"))
            })
        };
        let steps: Vec<Result<Step, TokenizerError>> = match pre {
            PreType::Default => {
                vec![
                    re(r"[\p{P}\$\+<=>\^~\|]+"),
                    scan(Gpt2),
                    re(r"\p{N}+"),
                    re("[0-9][0-9][0-9]"),
                ]
            }
            PreType::Gpt2 => vec![scan(Gpt2)],
            PreType::Llama3 => vec![scan(Llama3)],
            PreType::Qwen2 => vec![scan(Qwen2)],
            PreType::Qwen35 => vec![scan(Qwen35)],
            PreType::StarCoder => vec![re(r"\p{N}"), scan(Gpt2)],
            PreType::Falcon => vec![
                re(r"[\p{P}\$\+<=>\^~\|`]+"),
                scan(Gpt2),
                re("[0-9][0-9][0-9]"),
            ],
            PreType::DeepSeekLlm => vec![
                re("[\r\n]"),
                re(DEEPSEEK_LLM_LETTERS),
                re(DEEPSEEK_LLM_PUNCT),
                re("\\s+$"),
                re(CJK),
                re(r"\p{N}+"),
            ],
            PreType::DeepSeekCoder => vec![
                re("[\r\n]"),
                re(r"\s?\p{L}+"),
                re(r"\s?\p{P}+"),
                re(CJK),
                re(r"\p{N}"),
            ],
            PreType::Gemma4 => vec![scan(Newlines)],
            PreType::KimiK2 => vec![scan(KimiK2)],
            PreType::Gpt4o => vec![scan(Gpt4o)],
        };
        Ok(PreTokenizer {
            steps: steps.into_iter().collect::<Result<_, _>>()?,
        })
    }

    /// Cuts `text` into words, returned as byte ranges of `text`, in order, covering it.
    pub fn split(&self, text: &str) -> Vec<(usize, usize)> {
        let mut pieces = if text.is_empty() {
            Vec::new()
        } else {
            vec![(0, text.len())]
        };
        let mut next = Vec::with_capacity(text.len() / 4 + 1);
        let mut chars: Vec<char> = Vec::new();
        let mut offs: Vec<usize> = Vec::new();
        for step in &self.steps {
            next.clear();
            for &(start, end) in &pieces {
                let piece = &text[start..end];
                match step {
                    Step::Scan(scanner) => {
                        chars.clear();
                        offs.clear();
                        for (i, c) in piece.char_indices() {
                            offs.push(start + i);
                            chars.push(c);
                        }
                        offs.push(end);
                        scan(*scanner, &chars, |a, b| next.push((offs[a], offs[b])));
                    }
                    Step::Regex(re) => {
                        let mut last = 0;
                        for m in re.find_iter(piece) {
                            let Ok(m) = m else { break };
                            if m.start() > last {
                                next.push((start + last, start + m.start()));
                            }
                            if m.end() > m.start() {
                                next.push((start + m.start(), start + m.end()));
                            }
                            last = m.end();
                        }
                        if last < piece.len() {
                            next.push((start + last, end));
                        }
                    }
                }
            }
            std::mem::swap(&mut pieces, &mut next);
        }
        pieces
    }
}

/// Runs a scanner over one piece (`chars`), reporting each word as a range of char indices.
fn scan(kind: Scanner, chars: &[char], mut emit: impl FnMut(usize, usize)) {
    let n = chars.len();
    if kind == Scanner::Newlines {
        let mut pos = 0;
        while pos < n {
            let nl = chars[pos] == '\n';
            let start = pos;
            while pos < n && (chars[pos] == '\n') == nl {
                pos += 1;
            }
            emit(start, pos);
        }
        return;
    }
    // Flags of the char at `i`, or `None` past the end of the piece (where lookaheads stop).
    let fl = |i: usize| -> Option<Flags> { chars.get(i).map(|&c| unicode::flags(c)) };
    let has = |f: Option<Flags>, mask: Flags| f.is_some_and(|f| f & mask != 0);
    let is_crlf = |c: char| c == '\r' || c == '\n';
    // Letter runs take marks too in Qwen3.5.
    let letter_mask = if kind == Scanner::Qwen35 {
        LETTER | MARK
    } else {
        LETTER
    };
    let other_mask = if kind == Scanner::Qwen35 {
        WHITESPACE | LETTER | MARK | NUMBER
    } else {
        WHITESPACE | LETTER | NUMBER
    };
    let case_insensitive = kind != Scanner::Gpt2;

    let mut start = 0;
    let mut pos = 0;
    macro_rules! word {
        ($end:expr) => {{
            pos = $end;
            if pos > start {
                emit(start, pos);
            }
            start = pos;
            continue;
        }};
    }
    while pos < n {
        let c = chars[pos];
        let f = unicode::flags(c);

        if kind == Scanner::KimiK2 {
            // `\p{Han}+`
            if unicode::is_han(c) {
                let mut p = pos + 1;
                while p < n && unicode::is_han(chars[p]) {
                    p += 1;
                }
                word!(p);
            }
            // `[^\r\n\p{L}\p{N}]?[\p{L}--\p{Han}]+` and a contraction after it
            let letter = |i: usize| has(fl(i), LETTER) && !unicode::is_han(chars[i]);
            let leading = !(is_crlf(c) || f & (LETTER | NUMBER) != 0);
            if letter(pos) || (leading && letter(pos + 1)) {
                let mut p = pos + usize::from(leading);
                while letter(p) {
                    p += 1;
                }
                if p + 1 < n && chars[p] == '\'' {
                    let c1 = chars[p + 1].to_ascii_lowercase();
                    if matches!(c1, 's' | 't' | 'm' | 'd') {
                        p += 2;
                    } else if p + 2 < n
                        && matches!(
                            (c1, chars[p + 2].to_ascii_lowercase()),
                            ('r', 'e') | ('v', 'e') | ('l', 'l')
                        )
                    {
                        p += 3;
                    }
                }
                word!(p);
            }
        }

        if kind == Scanner::Gpt4o {
            if let Some(end) = gpt4o_word(chars, pos) {
                word!(end);
            }
        }

        // Contractions: 's 't 're 've 'm 'll 'd
        if c == '\'' && pos + 1 < n && !matches!(kind, Scanner::KimiK2 | Scanner::Gpt4o) {
            let low = |c: char| {
                if case_insensitive {
                    c.to_ascii_lowercase()
                } else {
                    c
                }
            };
            let c1 = low(chars[pos + 1]);
            if matches!(c1, 's' | 't' | 'm' | 'd') {
                word!(pos + 2);
            }
            if pos + 2 < n {
                let c2 = low(chars[pos + 2]);
                if matches!((c1, c2), ('r', 'e') | ('v', 'e') | ('l', 'l')) {
                    word!(pos + 3);
                }
            }
        }

        if kind == Scanner::Gpt2 {
            let f2 = if c == ' ' { fl(pos + 1) } else { Some(f) };
            // ` ?\p{L}+` and ` ?\p{N}+`
            if has(f2, LETTER) {
                let mut p = pos + usize::from(c == ' ');
                while has(fl(p), LETTER) {
                    p += 1;
                }
                word!(p);
            }
            if has(f2, NUMBER) {
                let mut p = pos + usize::from(c == ' ');
                while has(fl(p), NUMBER) {
                    p += 1;
                }
                word!(p);
            }
            // ` ?[^\s\p{L}\p{N}]+`
            if f2.is_some_and(|f2| f2 & other_mask == 0) {
                let mut p = pos + usize::from(c == ' ');
                while fl(p).is_some_and(|f| f & other_mask == 0) {
                    p += 1;
                }
                word!(p);
            }
        } else {
            // `[^\r\n\p{L}\p{N}]?\p{L}+` (Kimi K2's and GPT-4o's letter runs are matched
            // above)
            if !(matches!(kind, Scanner::KimiK2 | Scanner::Gpt4o) || is_crlf(c) || f & NUMBER != 0)
                && (f & letter_mask != 0 || has(fl(pos + 1), letter_mask))
            {
                let mut p = pos + 1;
                while has(fl(p), letter_mask) {
                    p += 1;
                }
                word!(p);
            }
            // `\p{N}{1,3}` (Llama 3) or `\p{N}`
            if f & NUMBER != 0 {
                if matches!(kind, Scanner::Llama3 | Scanner::KimiK2 | Scanner::Gpt4o) {
                    let mut p = pos;
                    let mut group = pos;
                    while has(fl(p), NUMBER) {
                        p += 1;
                        if p - group >= 3 {
                            emit(group, p);
                            group = p;
                        }
                    }
                    start = group;
                    word!(p);
                }
                word!(pos + 1);
            }
            // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
            let f2 = if c == ' ' { fl(pos + 1) } else { Some(f) };
            if f2.unwrap_or(0) & other_mask == 0 {
                let mut p = pos + usize::from(c == ' ');
                while fl(p).is_some_and(|f| f & other_mask == 0) {
                    p += 1;
                }
                while p < n && (is_crlf(chars[p]) || (kind == Scanner::Gpt4o && chars[p] == '/')) {
                    p += 1;
                }
                word!(p);
            }
        }

        // Whitespace runs.
        let mut count = 0;
        let mut after_last_crlf = None;
        while has(fl(pos + count), WHITESPACE) {
            if kind != Scanner::Gpt2 && is_crlf(chars[pos + count]) {
                after_last_crlf = Some(pos + count + 1);
            }
            count += 1;
        }
        // `\s*[\r\n]+`
        if let Some(p) = after_last_crlf {
            word!(p);
        }
        // `\s+(?!\S)`: leave the last blank to the word that follows.
        if count > 1 && pos + count < n {
            word!(pos + count - 1);
        }
        // `\s+`
        if count > 0 {
            word!(pos + count);
        }
        // Nothing matched: one char alone.
        word!(pos + 1);
    }
}

/// The end of GPT-4o's letter word at `pos` (see [`Scanner::Gpt4o`]): an optional leading
/// char that is no letter, number or line break, then `U*L+` as a backtracking matcher takes
/// it (the longest run of `U`, then `L`s; where the run is followed by no `L`, up to its last
/// char that is also an `L`), else `U+`; then a contraction. `None` when no letter follows.
fn gpt4o_word(chars: &[char], pos: usize) -> Option<usize> {
    let n = chars.len();
    let letter = |i: usize| i < n && unicode::flags(chars[i]) & LETTER != 0;
    let upper = |i: usize| letter(i) && !chars[i].is_ascii_lowercase();
    let lower = |i: usize| letter(i) && !chars[i].is_ascii_uppercase();
    let c = chars[pos];
    let lead = !(c == '\r' || c == '\n' || unicode::flags(c) & (LETTER | NUMBER) != 0);
    let s = pos + usize::from(lead);
    if !letter(s) {
        return None;
    }
    let mut k = s;
    while upper(k) {
        k += 1;
    }
    let mut end = if lower(k) {
        let mut e = k;
        while lower(e) {
            e += 1;
        }
        e
    } else {
        // give back the run's tail down to its last char that is also an `L` (else `U+`)
        (s..k).rev().find(|&j| lower(j)).map_or(k, |j| j + 1)
    };
    if end + 1 < n && chars[end] == '\'' {
        let c1 = chars[end + 1].to_ascii_lowercase();
        if matches!(c1, 's' | 't' | 'm' | 'd') {
            end += 2;
        } else if end + 2 < n
            && matches!(
                (c1, chars[end + 2].to_ascii_lowercase()),
                ('r', 'e') | ('v', 'e') | ('l', 'l')
            )
        {
            end += 3;
        }
    }
    Some(end)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(pre: PreType, text: &str) -> Vec<String> {
        let p = PreTokenizer::new(pre).expect("regexes compile");
        p.split(text)
            .into_iter()
            .map(|(a, b)| text[a..b].to_string())
            .collect()
    }

    #[test]
    fn gpt2_words() {
        assert_eq!(
            words(PreType::Gpt2, "Hello world's  end!!\n"),
            ["Hello", " world", "'s", " ", " end", "!!", "\n"]
        );
        assert_eq!(words(PreType::Gpt2, "a   b"), ["a", "  ", " b"]);
    }

    #[test]
    fn glm_files_split_as_llama3_without_a_bos_and_with_whole_words_first() {
        for pre in ["glm4", "glm5"] {
            let info = pre_info(Some(pre)).unwrap();
            assert_eq!(info.pre, PreType::Llama3, "{pre}");
            assert!(info.ignore_merges && !info.add_bos, "{pre}");
        }
        let chatglm = pre_info(Some("chatglm-bpe")).unwrap();
        assert_eq!(chatglm.pre, PreType::Llama3);
        assert!(!chatglm.ignore_merges && !chatglm.add_bos);
    }

    #[test]
    fn kimi_k2_keeps_han_apart_and_contractions_on_their_word() {
        assert_eq!(
            words(PreType::KimiK2, "Hello世界 don't I'M 12345\n\n x"),
            ["Hello", "世界", " don't", " I'M", " ", "123", "45", "\n\n", " x"]
        );
        assert_eq!(words(PreType::KimiK2, " 中文abc"), [" ", "中文", "abc"]);
        assert_eq!(pre_info(Some("kimi-k2")).unwrap().pre, PreType::KimiK2);
    }

    #[test]
    fn llama3_digits_and_newlines() {
        assert_eq!(
            words(PreType::Llama3, "1234567 x\n\n y"),
            ["123", "456", "7", " x", "\n\n", " y"]
        );
        assert_eq!(words(PreType::Llama3, "I'M ok"), ["I", "'M", " ok"]);
    }

    #[test]
    fn qwen2_single_digits() {
        assert_eq!(
            words(PreType::Qwen2, "12345 ab"),
            ["1", "2", "3", "4", "5", " ab"]
        );
    }

    #[test]
    fn starcoder_digits_then_gpt2() {
        assert_eq!(
            words(PreType::StarCoder, "x 123"),
            ["x", " ", "1", "2", "3"]
        );
    }

    #[test]
    fn covers_text_exactly() {
        for pre in [
            PreType::Default,
            PreType::Gpt2,
            PreType::Llama3,
            PreType::Qwen2,
            PreType::Qwen35,
            PreType::DeepSeekLlm,
        ] {
            let text = "Tab\t\t  x ‘q’ 〇 ١٢٣ 🦙\r\n\n end  ";
            assert_eq!(words(pre, text).concat(), text, "{pre:?}");
        }
    }
}
