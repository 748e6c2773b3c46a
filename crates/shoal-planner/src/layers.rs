//! Contiguous layer ranges for the stages of a pipeline. Among the splits where every stage
//! fits its nodes' memory, the one with the smallest predicted time per token (the sum of the
//! stages' times, what one sequence waits for), and among equal sums the most balanced one
//! (the smallest slowest stage, which bounds throughput when several sequences keep every
//! stage busy). With identical nodes every split has the same sum, so this is the balanced
//! split, the last stage taking fewer layers for the output head; with unequal nodes the
//! faster ones take more layers. Minimising the slowest stage first instead would make
//! single-sequence predictions worse, and not even monotone in bandwidth (a faster slow node
//! would be handed layers a faster fast node could have run sooner).
//!
//! Dynamic programming over (stage, layers placed so far), O(pp n^2) stage evaluations.

/// Two sums within this relative distance are equal (then balance decides).
const TIE: f64 = 1e-9;

#[derive(Clone, Copy)]
struct Best {
    sum: f64,
    max: f64,
    from: usize,
}

fn better(sum: f64, max: f64, than: &Option<Best>) -> bool {
    match than {
        None => true,
        Some(b) => {
            let tol = TIE * sum.abs().max(b.sum.abs());
            sum < b.sum - tol || (sum <= b.sum + tol && max < b.max)
        }
    }
}

/// Layer counts of `pp` stages over `n` layers: the split of least total `time(s, a, b)`
/// (stage `s` running layers `a..b`), ties broken by the least largest stage time, among
/// splits where `fits(s, a, b)` holds for every stage. `None` when no split fits (or
/// `pp` is 0 or exceeds `n`).
pub fn split_layers(
    n: usize,
    pp: usize,
    time: impl Fn(usize, usize, usize) -> f64,
    fits: impl Fn(usize, usize, usize) -> bool,
) -> Option<Vec<usize>> {
    if pp == 0 || pp > n {
        return None;
    }
    // best[s][i]: stages 0..=s holding layers 0..i
    let mut best: Vec<Vec<Option<Best>>> = vec![vec![None; n + 1]; pp];
    for (i, slot) in best[0].iter_mut().enumerate().take(n - pp + 2).skip(1) {
        if fits(0, 0, i) {
            let t = time(0, 0, i);
            *slot = Some(Best {
                sum: t,
                max: t,
                from: 0,
            });
        }
    }
    for s in 1..pp {
        for i in s + 1..=n - (pp - 1 - s) {
            let mut here = None;
            for (j, prev) in best[s - 1].iter().enumerate().take(i).skip(s) {
                let Some(prev) = *prev else { continue };
                if !fits(s, j, i) {
                    continue;
                }
                let t = time(s, j, i);
                let (sum, max) = (prev.sum + t, prev.max.max(t));
                if better(sum, max, &here) {
                    here = Some(Best { sum, max, from: j });
                }
            }
            best[s][i] = here;
        }
    }
    best[pp - 1][n]?;
    let mut sizes = vec![0; pp];
    let mut end = n;
    for s in (0..pp).rev() {
        let start = best[s][end]?.from;
        sizes[s] = end - start;
        end = start;
    }
    Some(sizes)
}

/// Contiguous ranges from layer counts.
pub fn ranges(sizes: &[usize]) -> Vec<std::ops::Range<usize>> {
    let mut start = 0;
    sizes
        .iter()
        .map(|&k| {
            start += k;
            start - k..start
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_stages_balance_with_the_head_last() {
        // 24 layers of 10, a head of 140 on the last stage, equal speed: 19 + 5 as the
        // executor's own balancing gives
        let time =
            |s: usize, a: usize, b: usize| (b - a) as f64 * 10.0 + if s == 1 { 140.0 } else { 0.0 };
        assert_eq!(split_layers(24, 2, time, |_, _, _| true), Some(vec![19, 5]));
        assert_eq!(
            split_layers(12, 3, |_, a, b| (b - a) as f64, |_, _, _| true),
            Some(vec![4, 4, 4])
        );
    }

    #[test]
    fn faster_stage_takes_more_and_memory_limits_it() {
        // stage 0 twice as fast: it would take every layer it can
        let time = |s: usize, a: usize, b: usize| (b - a) as f64 * if s == 0 { 1.0 } else { 2.0 };
        assert_eq!(split_layers(10, 2, time, |_, _, _| true), Some(vec![9, 1]));
        // but holds at most 6
        let fits = |s: usize, a: usize, b: usize| s != 0 || b - a <= 6;
        assert_eq!(split_layers(10, 2, time, fits), Some(vec![6, 4]));
        // nobody holds more than 3 of 10 in 3 stages
        assert_eq!(split_layers(10, 3, time, |_, a, b| b - a <= 3), None);
        assert_eq!(split_layers(2, 3, time, |_, _, _| true), None);
    }

    #[test]
    fn ranges_are_contiguous() {
        assert_eq!(ranges(&[3, 2, 4]), vec![0..3, 3..5, 5..9]);
    }
}
