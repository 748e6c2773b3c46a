//! SentencePiece (BPE flavour) as llama.cpp runs it for `tokenizer.ggml.model = "llama"`:
//! the text (spaces already escaped to `▁`) starts as one symbol per UTF-8 character; the
//! adjacent pair whose concatenation is a token with the highest score is merged, ties to
//! the leftmost pair, until no concatenation is a token. A character left that is no token
//! becomes byte tokens `<0xNN>` (or the unknown token where the vocabulary has none).
//!
//! Symbols are byte ranges of the text, so looking a pair up costs no allocation; a
//! priority queue keeps a text of n characters at O(n log n).

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::vocab::Vocab;

const NONE: u32 = u32::MAX;

#[derive(Clone, Copy)]
struct Symbol {
    start: u32,
    end: u32,
    prev: u32,
    next: u32,
}

struct Pair {
    score: f32,
    left: u32,
    right: u32,
    size: u32,
}

impl PartialEq for Pair {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Pair {}
impl PartialOrd for Pair {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Pair {
    /// Highest score first; among equal scores, the leftmost pair first.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

/// Appends the tokens of `text` (already whitespace-escaped).
pub(crate) fn encode(
    index: &Vocab,
    scores: &[f32],
    byte_tokens: &[u32; 256],
    unk: Option<u32>,
    text: &str,
    out: &mut Vec<u32>,
) {
    if text.is_empty() || text.len() >= NONE as usize {
        return;
    }
    let mut syms: Vec<Symbol> = Vec::with_capacity(text.len());
    for (i, c) in text.char_indices() {
        syms.push(Symbol {
            start: i as u32,
            end: (i + c.len_utf8()) as u32,
            prev: NONE,
            next: NONE,
        });
    }
    let n = syms.len() as u32;
    for (i, s) in syms.iter_mut().enumerate() {
        let i = i as u32;
        s.prev = if i == 0 { NONE } else { i - 1 };
        s.next = if i + 1 == n { NONE } else { i + 1 };
    }
    let mut heap = BinaryHeap::new();
    let try_pair = |syms: &[Symbol], heap: &mut BinaryHeap<Pair>, left: u32, right: u32| {
        if left == NONE || right == NONE {
            return;
        }
        let (l, r) = (syms[left as usize], syms[right as usize]);
        let Some(piece) = text.get(l.start as usize..r.end as usize) else {
            return;
        };
        if let Some(id) = index.get(piece) {
            let score = scores.get(id as usize).copied().unwrap_or(0.0);
            heap.push(Pair {
                score,
                left,
                right,
                size: r.end - l.start,
            });
        }
    };
    for i in 1..n {
        try_pair(&syms, &mut heap, i - 1, i);
    }
    while let Some(pair) = heap.pop() {
        let (l, r) = (syms[pair.left as usize], syms[pair.right as usize]);
        // Skip pairs made stale by an earlier merge.
        if l.start == l.end
            || r.start == r.end
            || (l.end - l.start) + (r.end - r.start) != pair.size
        {
            continue;
        }
        syms[pair.left as usize].end = r.end;
        syms[pair.left as usize].next = r.next;
        syms[pair.right as usize].end = syms[pair.right as usize].start;
        if r.next != NONE {
            syms[r.next as usize].prev = pair.left;
        }
        try_pair(&syms, &mut heap, l.prev, pair.left);
        try_pair(&syms, &mut heap, pair.left, r.next);
    }
    let mut i = 0u32;
    while i != NONE {
        let s = syms[i as usize];
        let piece = &text.as_bytes()[s.start as usize..s.end as usize];
        match std::str::from_utf8(piece).ok().and_then(|p| index.get(p)) {
            Some(id) => out.push(id),
            None => {
                for &b in piece {
                    let t = byte_tokens[b as usize];
                    if t != NONE {
                        out.push(t);
                    } else if let Some(unk) = unk {
                        out.push(unk);
                    }
                }
            }
        }
        i = s.next;
    }
}

/// The byte tokens of a SentencePiece vocabulary: `<0xNN>`, else the byte itself as a token.
pub(crate) fn byte_tokens(index: &Vocab) -> [u32; 256] {
    let mut out = [NONE; 256];
    for (b, slot) in out.iter_mut().enumerate() {
        let hex = format!("<0x{b:02X}>");
        *slot = index
            .get(&hex)
            .or_else(|| {
                if b < 0x80 {
                    index.get(char::from(b as u8).encode_utf8(&mut [0; 4]))
                } else {
                    None
                }
            })
            .unwrap_or(NONE);
    }
    out
}
