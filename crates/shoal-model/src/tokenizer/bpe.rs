//! Byte-pair encoding as llama.cpp runs it: each word (from the pre-tokenizer) starts as one
//! symbol per byte (byte-level BPE, each byte shown as GPT-2's printable character) or per
//! UTF-8 character (SentencePiece-style BPE), and the adjacent pair with the lowest merge
//! rank is merged until no pair has a rank; ties go to the leftmost pair.
//!
//! Symbols carry vocabulary ids rather than strings: merge operands must be tokens of the
//! vocabulary, so the merge table is keyed by two ids and says which id the merge makes.
//! A priority queue keeps a word of n bytes at O(n log n). A symbol left that is no token
//! (a merge result missing from the vocabulary, or a character the vocabulary lacks)
//! falls back to one token per byte, where the vocabulary has one.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use ahash::AHashMap;

use super::vocab::Vocab;

use super::unicode;
use super::TokenizerError;

/// A symbol that is no vocabulary token.
const NONE: u32 = u32::MAX;

/// The merge table and how words become initial symbols.
#[derive(Debug, Clone)]
pub(crate) struct Bpe {
    /// `(left << 32) | right` -> (rank, merged symbol or [`NONE`]).
    merges: AHashMap<u64, (u32, u32)>,
    /// Byte-level: symbol of each byte's printable character.
    byte_syms: [u32; 256],
    /// Token standing for one raw byte when a symbol must be spelled out.
    byte_fallback: [u32; 256],
    /// Words are byte-level encoded (GPT-2 style) rather than raw UTF-8.
    byte_encode: bool,
    /// A word that is itself a token is emitted whole.
    ignore_merges: bool,
    /// Gemma 4: a run of newlines that is a token is emitted whole.
    newline_runs: bool,
    n_vocab: u32,
}

/// Per-call scratch space, so words do not allocate.
#[derive(Default)]
pub(crate) struct Scratch {
    syms: Vec<Symbol>,
    heap: BinaryHeap<Reverse<(u64, u32, u32, u32)>>,
    encoded: String,
}

#[derive(Clone, Copy)]
struct Symbol {
    sym: u32,
    start: u32,
    end: u32,
    prev: u32,
    next: u32,
}

impl Bpe {
    /// Builds the merge table from `"left right"` strings, ranked by position.
    ///
    /// # Errors
    /// When a merge has no separating space or names a piece that is not a token.
    pub(crate) fn new(
        index: &Vocab,
        merges: &[String],
        byte_encode: bool,
        ignore_merges: bool,
        newline_runs: bool,
    ) -> Result<Self, TokenizerError> {
        let n_vocab = index.len();
        let n_vocab = u32::try_from(n_vocab)
            .ok()
            .filter(|&n| n < NONE)
            .ok_or_else(|| {
                TokenizerError::Invalid(format!("vocabulary of {n_vocab} tokens is too large"))
            })?;
        let mut table = AHashMap::with_capacity(merges.len());
        let mut joined = String::new();
        for (rank, merge) in merges.iter().enumerate() {
            // The split is at the first space after the first byte, so a piece may start with one.
            let pos = merge
                .as_bytes()
                .iter()
                .skip(1)
                .position(|&b| b == b' ')
                .map(|p| p + 1);
            let Some(pos) = pos else {
                return Err(TokenizerError::BadMerge {
                    index: rank,
                    merge: merge.clone(),
                    problem: "has no space separating two pieces".into(),
                });
            };
            let (left, right) = (&merge[..pos], &merge[pos + 1..]);
            let lookup = |piece: &str| {
                index.get(piece).ok_or_else(|| TokenizerError::BadMerge {
                    index: rank,
                    merge: merge.clone(),
                    problem: format!("piece {piece:?} is not a token of the vocabulary"),
                })
            };
            let (l, r) = (lookup(left)?, lookup(right)?);
            joined.clear();
            joined.push_str(left);
            joined.push_str(right);
            let result = index.get(&joined).unwrap_or(NONE);
            let rank = u32::try_from(rank).unwrap_or(u32::MAX);
            table.entry(key(l, r)).or_insert((rank, result));
        }

        let mut byte_syms = [NONE; 256];
        let mut byte_fallback = [NONE; 256];
        let chars = unicode::byte_to_char_table();
        let mut buf = [0u8; 4];
        for b in 0..256usize {
            let c = chars[b];
            byte_syms[b] = index.get(c.encode_utf8(&mut buf)).unwrap_or(NONE);
            byte_fallback[b] = if byte_encode {
                // llama.cpp looks each byte of the symbol's text up alone; only a printable
                // ASCII character is one byte long, so only those bytes come back.
                if c.is_ascii() {
                    byte_syms[b]
                } else {
                    NONE
                }
            } else {
                index.get(&format!("<0x{b:02X}>")).unwrap_or(NONE)
            };
        }
        Ok(Bpe {
            merges: table,
            byte_syms,
            byte_fallback,
            byte_encode,
            ignore_merges,
            newline_runs,
            n_vocab,
        })
    }

    /// Number of merges.
    pub(crate) fn n_merges(&self) -> usize {
        self.merges.len()
    }

    /// Appends the tokens of one word.
    pub(crate) fn encode_word(
        &self,
        index: &Vocab,
        word: &str,
        out: &mut Vec<u32>,
        scratch: &mut Scratch,
    ) {
        if word.is_empty() {
            return;
        }
        let Scratch {
            syms,
            heap,
            encoded,
        } = scratch;
        syms.clear();
        heap.clear();
        if self.byte_encode {
            if self.ignore_merges {
                let chars = unicode::byte_to_char_table();
                encoded.clear();
                encoded.extend(word.bytes().map(|b| chars[b as usize]));
                if let Some(id) = index.get(encoded) {
                    out.push(id);
                    return;
                }
            }
            for (i, b) in word.bytes().enumerate() {
                syms.push(Symbol {
                    sym: self.byte_syms[b as usize],
                    start: i as u32,
                    end: i as u32 + 1,
                    prev: NONE,
                    next: NONE,
                });
            }
        } else {
            let whole_word =
                self.ignore_merges || (self.newline_runs && word.bytes().all(|b| b == b'\n'));
            if whole_word {
                if let Some(id) = index.get(word) {
                    out.push(id);
                    return;
                }
            }
            let mut buf = [0u8; 4];
            for (i, c) in word.char_indices() {
                let sym = index.get(c.encode_utf8(&mut buf)).unwrap_or(NONE);
                syms.push(Symbol {
                    sym,
                    start: i as u32,
                    end: (i + c.len_utf8()) as u32,
                    prev: NONE,
                    next: NONE,
                });
            }
        }
        let n = syms.len() as u32;
        for (i, s) in syms.iter_mut().enumerate() {
            let i = i as u32;
            s.prev = if i == 0 { NONE } else { i - 1 };
            s.next = if i + 1 == n { NONE } else { i + 1 };
        }
        for i in 1..n {
            self.push_pair(syms, heap, i - 1, i);
        }
        while let Some(Reverse((rank_left, right, lsym, rsym))) = heap.pop() {
            let left = rank_left as u32;
            let (l, r) = (syms[left as usize], syms[right as usize]);
            // Skip pairs made stale by an earlier merge.
            if l.end == l.start
                || r.end == r.start
                || l.sym != lsym
                || r.sym != rsym
                || l.next != right
            {
                continue;
            }
            let Some(&(_, merged)) = self.merges.get(&key(lsym, rsym)) else {
                continue;
            };
            let next = r.next;
            {
                let ls = &mut syms[left as usize];
                ls.sym = merged;
                ls.end = r.end;
                ls.next = next;
            }
            syms[right as usize].end = syms[right as usize].start;
            if next != NONE {
                syms[next as usize].prev = left;
            }
            if l.prev != NONE {
                self.push_pair(syms, heap, l.prev, left);
            }
            if next != NONE {
                self.push_pair(syms, heap, left, next);
            }
        }
        let mut i = 0u32;
        while i != NONE {
            let s = syms[i as usize];
            if s.sym < self.n_vocab {
                out.push(s.sym);
            } else {
                for &b in &word.as_bytes()[s.start as usize..s.end as usize] {
                    let t = self.byte_fallback[b as usize];
                    if t != NONE {
                        out.push(t);
                    }
                }
            }
            i = s.next;
        }
    }

    fn push_pair(
        &self,
        syms: &[Symbol],
        heap: &mut BinaryHeap<Reverse<(u64, u32, u32, u32)>>,
        left: u32,
        right: u32,
    ) {
        let (l, r) = (syms[left as usize].sym, syms[right as usize].sym);
        if l == NONE || r == NONE {
            return;
        }
        if let Some(&(rank, _)) = self.merges.get(&key(l, r)) {
            heap.push(Reverse((((rank as u64) << 32) | left as u64, right, l, r)));
        }
    }
}

#[inline]
fn key(l: u32, r: u32) -> u64 {
    ((l as u64) << 32) | r as u64
}
