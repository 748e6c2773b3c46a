//! Unicode facts the pre-tokenizers need: the general category of a code point folded into
//! the classes `\p{L}`, `\p{N}`, `\p{P}`, `\p{S}`, `\p{M}`, `\p{Z}`, `\p{C}` (and "unassigned"),
//! the `White_Space` set, and GPT-2's byte-to-character table for byte-level BPE.
//!
//! The category table is built once from the Unicode tables inside `regex-syntax` (Unicode
//! 16.0). llama.cpp's table is generated from an older UCD (15.x), so code points assigned
//! in 16.0 count as letters/symbols here and as unassigned there; nothing else differs.

use std::sync::OnceLock;

/// Category bits of one code point. Exactly one of the category bits is set for an
/// assigned code point; none for an unassigned one. [`WHITESPACE`] is independent.
pub type Flags = u8;
/// `\p{N}`: decimal, letter and other numbers.
pub const NUMBER: Flags = 1;
/// `\p{L}`: letters of every kind.
pub const LETTER: Flags = 1 << 1;
/// `\p{Z}`: separators.
pub const SEPARATOR: Flags = 1 << 2;
/// `\p{M}`: combining marks.
pub const MARK: Flags = 1 << 3;
/// `\p{P}`: punctuation.
pub const PUNCTUATION: Flags = 1 << 4;
/// `\p{S}`: symbols.
pub const SYMBOL: Flags = 1 << 5;
/// `\p{C}` less unassigned: control, format, private use.
pub const CONTROL: Flags = 1 << 6;
/// The Unicode `White_Space` property (`\s`).
pub const WHITESPACE: Flags = 1 << 7;

const MAX_CODEPOINT: usize = 0x11_0000;

/// Code points with the `White_Space` property.
const WHITE_SPACE: &[u32] = &[
    0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680, 0x2000, 0x2001, 0x2002, 0x2003, 0x2004,
    0x2005, 0x2006, 0x2007, 0x2008, 0x2009, 0x200A, 0x2028, 0x2029, 0x202F, 0x205F, 0x3000,
];

fn table() -> &'static [Flags] {
    static TABLE: OnceLock<Vec<Flags>> = OnceLock::new();
    TABLE.get_or_init(build_table)
}

/// Ranges of one `\p{..}` class, read from regex-syntax's Unicode tables.
fn class_ranges(pattern: &str) -> Vec<(u32, u32)> {
    use regex_syntax::hir::{Class, HirKind};
    let Ok(hir) = regex_syntax::Parser::new().parse(pattern) else {
        return Vec::new();
    };
    match hir.kind() {
        HirKind::Class(Class::Unicode(class)) => class
            .ranges()
            .iter()
            .map(|r| (r.start() as u32, r.end() as u32))
            .collect(),
        _ => Vec::new(),
    }
}

fn build_table() -> Vec<Flags> {
    let mut flags = vec![0u8; MAX_CODEPOINT];
    let classes: [(&str, Flags); 9] = [
        (r"\p{L}", LETTER),
        (r"\p{N}", NUMBER),
        (r"\p{Z}", SEPARATOR),
        (r"\p{M}", MARK),
        (r"\p{P}", PUNCTUATION),
        (r"\p{S}", SYMBOL),
        (r"\p{Cc}", CONTROL),
        (r"\p{Cf}", CONTROL),
        (r"\p{Co}", CONTROL),
    ];
    for (pattern, bit) in classes {
        for (lo, hi) in class_ranges(pattern) {
            let hi = (hi as usize).min(MAX_CODEPOINT - 1);
            for slot in flags.iter_mut().take(hi + 1).skip(lo as usize) {
                *slot = bit;
            }
        }
    }
    // Surrogates (Cs) are control in the UCD; `char` never holds one, but keep the table true.
    for slot in flags.iter_mut().take(0xE000).skip(0xD800) {
        *slot = CONTROL;
    }
    for &cp in WHITE_SPACE {
        flags[cp as usize] |= WHITESPACE;
    }
    flags
}

/// The flags of `c`.
#[inline]
pub fn flags(c: char) -> Flags {
    table().get(c as usize).copied().unwrap_or(0)
}

/// Whether `c` is a letter (`\p{L}`).
#[inline]
pub fn is_letter(c: char) -> bool {
    flags(c) & LETTER != 0
}

/// Whether `c` is a Han character, by the blocks llama.cpp's Kimi K2 pre-tokenizer counts:
/// the CJK Unified Ideographs and their extensions A to F, and the CJK Compatibility
/// Ideographs and their supplement.
pub fn is_han(c: char) -> bool {
    matches!(
        c as u32,
        0x4E00..=0x9FFF
            | 0x3400..=0x4DBF
            | 0x20000..=0x2A6DF
            | 0x2A700..=0x2EBEF
            | 0xF900..=0xFAFF
            | 0x2F800..=0x2FA1F
    )
}

/// Whether `c` is a number (`\p{N}`).
#[inline]
pub fn is_number(c: char) -> bool {
    flags(c) & NUMBER != 0
}

/// Whether `c` has the `White_Space` property.
#[inline]
pub fn is_whitespace(c: char) -> bool {
    flags(c) & WHITESPACE != 0
}

/// GPT-2's reversible map from bytes to printable characters: printable Latin-1 bytes map
/// to themselves, the other 68 bytes to U+0100.. in byte order.
pub fn byte_to_char_table() -> &'static [char; 256] {
    static TABLE: OnceLock<[char; 256]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut out = ['\0'; 256];
        let mut next = 256u32;
        for (b, slot) in out.iter_mut().enumerate() {
            let printable = (0x21..=0x7E).contains(&b)
                || (0xA1..=0xAC).contains(&b)
                || (0xAE..=0xFF).contains(&b);
            let cp = if printable {
                b as u32
            } else {
                let cp = next;
                next += 1;
                cp
            };
            *slot = char::from_u32(cp).unwrap_or('\u{FFFD}');
        }
        out
    })
}

/// The byte a byte-level character stands for, if it is one of the 256.
#[inline]
pub fn char_to_byte(c: char) -> Option<u8> {
    let cp = c as u32;
    match cp {
        0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF => Some(cp as u8),
        0x100..=0x143 => {
            // The 68 non-printable bytes, in increasing order.
            let idx = (cp - 0x100) as usize;
            non_printable_bytes().get(idx).copied()
        }
        _ => None,
    }
}

fn non_printable_bytes() -> &'static [u8] {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES.get_or_init(|| {
        (0u16..256)
            .map(|b| b as u8)
            .filter(|&b| {
                !((0x21..=0x7E).contains(&b)
                    || (0xA1..=0xAC).contains(&b)
                    || (0xAE..=0xFF).contains(&b))
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn categories() {
        assert_eq!(flags('a'), LETTER);
        assert_eq!(flags('Ω'), LETTER);
        assert_eq!(flags('7'), NUMBER);
        assert_eq!(flags('½'), NUMBER);
        assert_eq!(flags(' '), SEPARATOR | WHITESPACE);
        assert_eq!(flags('\n'), CONTROL | WHITESPACE);
        assert_eq!(flags('!'), PUNCTUATION);
        assert_eq!(flags('$'), SYMBOL);
        assert_eq!(flags('\u{301}'), MARK);
        assert_eq!(flags('\u{378}'), 0, "unassigned");
        assert_eq!(flags('\u{E000}'), CONTROL, "private use");
        assert_eq!(flags('\u{3000}'), SEPARATOR | WHITESPACE);
    }

    #[test]
    fn byte_table_round_trips() {
        let t = byte_to_char_table();
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(t[b as usize]), Some(b));
        }
        assert_eq!(char_to_byte('€'), None);
    }
}
