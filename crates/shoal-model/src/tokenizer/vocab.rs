//! The vocabulary: every token's text in one buffer, and a hash index from text to id that
//! borrows those texts instead of copying them. A 262,144-token vocabulary is two
//! allocations and one pass to build.

use hashbrown::HashTable;

/// Token texts and the text-to-id index. When a text repeats, the index keeps the last id
/// (as llama.cpp's map does).
pub(crate) struct Vocab {
    buf: String,
    /// Token `i` is `buf[offs[i]..offs[i + 1]]`.
    offs: Vec<u32>,
    table: HashTable<u32>,
    state: ahash::RandomState,
}

impl Vocab {
    /// Builds the vocabulary; `None` when the texts do not fit 4 GiB.
    pub(crate) fn new<S: AsRef<str>>(texts: impl ExactSizeIterator<Item = S>) -> Option<Self> {
        let n = texts.len();
        let mut buf = String::new();
        let mut offs = Vec::with_capacity(n + 1);
        offs.push(0u32);
        for t in texts {
            buf.push_str(t.as_ref());
            offs.push(u32::try_from(buf.len()).ok()?);
        }
        let mut v = Vocab {
            buf,
            offs,
            table: HashTable::with_capacity(n),
            state: ahash::RandomState::new(),
        };
        for id in 0..n as u32 {
            v.insert(id);
        }
        Some(v)
    }

    fn insert(&mut self, id: u32) {
        let Vocab {
            buf,
            offs,
            table,
            state,
        } = self;
        let text_of = |i: u32| &buf[offs[i as usize] as usize..offs[i as usize + 1] as usize];
        let text = text_of(id);
        let hash = state.hash_one(text);
        match table.entry(
            hash,
            |&other| text_of(other) == text,
            |&other| state.hash_one(text_of(other)),
        ) {
            hashbrown::hash_table::Entry::Occupied(mut e) => *e.get_mut() = id,
            hashbrown::hash_table::Entry::Vacant(e) => {
                e.insert(id);
            }
        }
    }

    /// Number of tokens.
    pub(crate) fn len(&self) -> usize {
        self.offs.len() - 1
    }

    /// The text of `id` (empty outside the vocabulary).
    pub(crate) fn text(&self, id: u32) -> &str {
        let i = id as usize;
        match (self.offs.get(i), self.offs.get(i + 1)) {
            (Some(&a), Some(&b)) => self.buf.get(a as usize..b as usize).unwrap_or(""),
            _ => "",
        }
    }

    /// The id whose text is `text`.
    pub(crate) fn get(&self, text: &str) -> Option<u32> {
        let hash = self.state.hash_one(text);
        self.table.find(hash, |&id| self.text(id) == text).copied()
    }

    /// All texts in id order.
    pub(crate) fn texts(&self) -> impl Iterator<Item = &str> + '_ {
        (0..self.len() as u32).map(|id| self.text(id))
    }
}
