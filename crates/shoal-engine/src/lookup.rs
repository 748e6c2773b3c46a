//! Prompt lookup: drafts for speculative decoding taken from a sequence's own context, no
//! second model. The last few tokens (an n-gram, longest first) are looked for earlier in
//! the context, and the tokens that followed their most recent earlier occurrence are the
//! draft. Where those run into the context's end, the draft goes on as the text repeats
//! with that period: a run of one token, or a line written over and over, drafts as many
//! tokens as asked. Code edits, summaries and answers that quote their input repeat long runs
//! of it, so the model then confirms several tokens in one step (the scheduler checks every
//! drafted token against the model's own choice, so the output is unchanged).

/// The longest n-gram looked for.
pub const MAX_NGRAM: usize = 4;
/// The shortest.
pub const MIN_NGRAM: usize = 2;

/// Up to `max` tokens that followed the most recent earlier occurrence of `context`'s last
/// n-gram (n from [`MAX_NGRAM`] down to [`MIN_NGRAM`]), past the context's end as the text
/// repeats from that occurrence on; empty when none occurs.
pub fn draft(context: &[u32], max: usize) -> Vec<u32> {
    if max == 0 {
        return Vec::new();
    }
    for n in (MIN_NGRAM..=MAX_NGRAM).rev() {
        if context.len() <= n {
            continue;
        }
        let tail = &context[context.len() - n..];
        if let Some(start) = (0..context.len() - n)
            .rev()
            .find(|&s| &context[s..s + n] == tail)
        {
            // past the context's end the draft copies itself: the text from `from` on
            // repeats with the period of its length
            let from = start + n;
            let period = context.len() - from;
            return (0..max).map(|i| context[from + i % period]).collect();
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafts_what_followed_the_last_ngram_before() {
        // "a b c d e ... a b c" -> "d e"
        let ctx = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3];
        assert_eq!(draft(&ctx, 2), vec![4, 5]);
        assert_eq!(draft(&ctx, 7), vec![4, 5, 9, 9, 1, 2, 3]);
        // past the end, the text repeats from that occurrence on
        assert_eq!(draft(&ctx, 10), vec![4, 5, 9, 9, 1, 2, 3, 4, 5, 9]);
        // the most recent occurrence wins
        let ctx = [1, 2, 7, 1, 2, 8, 1, 2];
        assert_eq!(draft(&ctx, 1), vec![8]);
        // longer n-grams first: [5, 1, 2] matches where [1, 2] alone would pick the later one
        let ctx = [5, 1, 2, 6, 0, 1, 2, 7, 5, 1, 2];
        assert_eq!(draft(&ctx, 1), vec![6]);
        // nothing repeats, too short, or nothing asked
        assert!(draft(&[1, 2, 3, 4], 4).is_empty());
        // a run of one token goes on as far as asked, a repeated pair as pairs
        assert_eq!(draft(&[8, 7, 7, 7], 5), vec![7; 5]);
        assert_eq!(draft(&[1, 2, 1, 2], 5), vec![1, 2, 1, 2, 1]);
        assert!(draft(&[1, 1], 4).is_empty());
        assert!(draft(&ctx, 0).is_empty());
    }
}
