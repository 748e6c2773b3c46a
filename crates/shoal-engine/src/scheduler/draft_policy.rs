//! How many drafted tokens a speculative step checks. A step of more rows costs more (on a
//! CPU of few cores nearly a one-row step per drafted row), so drafting pays only where the
//! drafts are taken. The scheduler measures what a decode step costs by its number of rows
//! ([`StepCosts`]) and each sequence keeps how often a drafted token was taken at each
//! position of its drafts ([`Acceptance`]); each step then checks the draft lengths that
//! promise the most tokens per unit of time ([`choose`]), none where drafts keep missing.
//! Prompt lookup costs nothing to draft, so every step's lookup draft is scored against the
//! tokens that follow even when it is not checked ([`Shadows`]): a sequence whose text starts
//! repeating again is seen at once. A draft model's drafts cost its steps; a sequence that
//! stopped checking them tries one drafted token now and then ([`Probe`]).

/// Weight an older observation keeps against a new one (about the last 20 drafts count).
const DECAY: f32 = 0.95;
/// A position's prior is the estimate of the position before it (the first one's: taken
/// half the time), worth a fifth of an observation: a position always taken is soon counted
/// as nearly sure, and one never reached (a draft model's drafts are checked only as far as
/// they were made) is taken to go as the one before it, so longer drafts get tried.
const PRIOR_WEIGHT: f64 = 0.2;
/// A step cost's weight against a new measurement of it.
const COST_KEEP: f64 = 0.7;
/// What a row adds to a step, as a fraction of a one-row step, before any step of more
/// rows was measured: low, so that the first drafts are checked and measured.
const UNMEASURED_ROW: f64 = 0.05;

/// Measured seconds of a decode step by its number of rows (every sequence's next token and
/// drafted tokens together), an exponential average per row count.
#[derive(Debug, Default, Clone)]
pub(crate) struct StepCosts {
    /// `by_rows[n]`: the average of steps of `n` rows, if one ran.
    by_rows: Vec<Option<f64>>,
}

impl StepCosts {
    /// Records a step of `rows` rows that took `seconds`.
    pub(crate) fn record(&mut self, rows: usize, seconds: f64) {
        if rows == 0 || !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        if self.by_rows.len() <= rows {
            self.by_rows.resize(rows + 1, None);
        }
        let slot = &mut self.by_rows[rows];
        *slot = Some(match *slot {
            Some(old) => COST_KEEP * old + (1.0 - COST_KEEP) * seconds,
            None => seconds,
        });
    }

    /// The cost of a step of `rows` rows: measured, or interpolated between the nearest
    /// measured row counts; past the last measured, that one's cost plus a small cost per
    /// row, and short of the first, that one's share by rows, so that what was never tried
    /// looks cheap enough to be tried once.
    pub(crate) fn cost(&self, rows: usize) -> f64 {
        let measured = |n: usize| self.by_rows.get(n).copied().flatten();
        if let Some(c) = measured(rows) {
            return c;
        }
        let below = (1..rows.min(self.by_rows.len()))
            .rev()
            .find_map(|n| measured(n).map(|c| (n, c)));
        let above = (rows + 1..self.by_rows.len()).find_map(|n| measured(n).map(|c| (n, c)));
        match (below, above) {
            (Some((lo, a)), Some((hi, b))) => a + (b - a) * (rows - lo) as f64 / (hi - lo) as f64,
            (Some((lo, a)), None) => a * (1.0 + UNMEASURED_ROW * (rows - lo) as f64),
            (None, Some((hi, b))) => b * rows as f64 / hi as f64,
            (None, None) => 1.0 + UNMEASURED_ROW * rows.saturating_sub(1) as f64,
        }
    }
}

/// How often a sequence's drafted tokens were taken, position by position: `p(j)` is the
/// chance that the `j`-th drafted token is taken when the ones before it were.
#[derive(Debug, Clone, Default)]
pub(crate) struct Acceptance {
    /// Per position: (times reached, times taken), decayed.
    seen: Vec<(f32, f32)>,
}

impl Acceptance {
    /// Records one checked (or scored) draft: its first `reached` positions were compared
    /// and the first `taken` of them taken (`taken == reached` when all were).
    pub(crate) fn record(&mut self, reached: usize, taken: usize) {
        if reached == 0 {
            return;
        }
        if self.seen.len() < reached {
            self.seen.resize(reached, (0.0, 0.0));
        }
        for (j, (r, t)) in self.seen.iter_mut().enumerate() {
            *r *= DECAY;
            *t *= DECAY;
            if j < reached {
                *r += 1.0;
                if j < taken {
                    *t += 1.0;
                }
            }
        }
    }

    /// The chance that the drafted token at position `j` (from 0) is taken when the ones
    /// before it were.
    #[cfg(test)]
    fn p(&self, j: usize) -> f64 {
        self.chances().nth(j).unwrap_or(0.5)
    }

    /// Each position's chance, from the first on (without end: past the last position
    /// seen, each goes as the one before it).
    fn chances(&self) -> impl Iterator<Item = f64> + '_ {
        let mut prior = 0.5;
        (0..).map(move |j| {
            let (r, t) = self.seen.get(j).copied().unwrap_or((0.0, 0.0));
            prior = (f64::from(t) + PRIOR_WEIGHT * prior) / (f64::from(r) + PRIOR_WEIGHT);
            prior
        })
    }

    /// The chance that the first `n` drafted tokens are all taken.
    pub(crate) fn all_taken(&self, n: usize) -> f64 {
        self.chances().take(n).product()
    }

    /// Tokens a step gives the sequence, expected, when it checks `k` drafted tokens: its
    /// next token and each drafted one taken.
    pub(crate) fn expected_tokens(&self, k: usize) -> f64 {
        let mut total = 1.0;
        let mut all_taken = 1.0;
        for p in self.chances().take(k) {
            all_taken *= p;
            total += all_taken;
        }
        total
    }
}

/// One sequence's part of the choice: what it may draft at most and its record.
pub(crate) struct Candidate<'a> {
    /// Drafted tokens it may check at most this step (its draft's length).
    pub(crate) available: usize,
    pub(crate) acceptance: &'a Acceptance,
}

/// The number of drafted tokens each sequence checks in the next step: the lengths that
/// give the most expected tokens per second, counting the step's cost by its rows and
/// `draft_seconds` per drafted token (a draft model's step; 0 for prompt lookup). Greedy: from
/// no drafts, each round lengthens the one draft that raises the rate most, until none does.
pub(crate) fn choose(
    costs: &StepCosts,
    candidates: &[Candidate],
    draft_seconds: f64,
) -> Vec<usize> {
    let mut k = vec![0usize; candidates.len()];
    let mut tokens: f64 = candidates.len() as f64;
    let mut rows = candidates.len();
    let rate = |tokens: f64, rows: usize, drafted: usize| {
        tokens / (costs.cost(rows) + draft_seconds * drafted as f64).max(f64::MIN_POSITIVE)
    };
    let mut drafted = 0usize;
    let mut best = rate(tokens, rows, drafted);
    loop {
        let mut pick: Option<(usize, usize, f64, f64)> = None;
        for (i, c) in candidates.iter().enumerate() {
            let now = c.acceptance.expected_tokens(k[i]);
            for more in 1..=c.available.saturating_sub(k[i]) {
                let t = tokens - now + c.acceptance.expected_tokens(k[i] + more);
                let r = rate(t, rows + more, drafted + more);
                if r > pick.map_or(best, |p| p.3) {
                    pick = Some((i, more, t, r));
                }
            }
        }
        let Some((i, more, t, r)) = pick else {
            return k;
        };
        k[i] += more;
        tokens = t;
        rows += more;
        drafted += more;
        best = r;
    }
}

/// Drafts made by prompt lookup, waiting to be scored against the tokens that follow them.
#[derive(Debug, Clone, Default)]
pub(crate) struct Shadows {
    /// (index in the generated tokens of the draft's first token, the draft).
    pending: Vec<(usize, Vec<u32>)>,
}

impl Shadows {
    /// Keeps `draft`, whose first token would be generated token number `at`.
    pub(crate) fn push(&mut self, at: usize, draft: Vec<u32>) {
        if !draft.is_empty() {
            self.pending.push((at, draft));
        }
    }

    /// Scores every kept draft that `generated` now decides (a token differs, or all were
    /// generated) into `acceptance`, and drops it.
    pub(crate) fn score(&mut self, generated: &[u32], acceptance: &mut Acceptance) {
        self.pending.retain(|(at, draft)| {
            let known = generated.get(*at..).unwrap_or(&[]);
            let same = draft.iter().zip(known).take_while(|(a, b)| a == b).count();
            if same == draft.len() {
                acceptance.record(same, same);
                false
            } else if same < known.len() {
                acceptance.record(same + 1, same);
                false
            } else {
                true
            }
        });
    }
}

/// When a sequence that stopped checking its draft model's drafts checks one again: after
/// `wait` steps without, doubling each time a try is not taken.
#[derive(Debug, Clone)]
pub(crate) struct Probe {
    since: usize,
    wait: usize,
    trying: bool,
    /// Tries not taken since a draft was last chosen or taken.
    missed: usize,
}

impl Default for Probe {
    fn default() -> Self {
        Probe {
            since: 0,
            wait: Self::FIRST,
            trying: false,
            missed: 0,
        }
    }
}

impl Probe {
    const FIRST: usize = 8;
    const LAST: usize = 128;
    /// The share of the decoding time tries may take at most, when their cost is known.
    pub(crate) const SHARE: f64 = 0.02;

    /// The drafted tokens to check this step: `chosen`, or one (a try) when `chosen` is none,
    /// one is `available` and the wait is over. A try that costs `try_seconds` (its draft
    /// and the row it adds) waits for enough steps of `step_seconds` that tries take at most
    /// [`Probe::SHARE`] of the time (0 where either is not measured yet).
    pub(crate) fn length(
        &mut self,
        chosen: usize,
        available: usize,
        try_seconds: f64,
        step_seconds: f64,
    ) -> usize {
        if chosen > 0 {
            self.since = 0;
            self.wait = Self::FIRST;
            self.missed = 0;
            return chosen;
        }
        self.since += 1;
        let by_cost = if try_seconds > 0.0 && step_seconds > 0.0 {
            (try_seconds / (Self::SHARE * step_seconds)).ceil().min(1e6) as usize
        } else {
            0
        };
        if self.since >= self.wait.max(by_cost) && available > 0 {
            self.since = 0;
            self.trying = true;
            1
        } else {
            0
        }
    }

    /// The outcome of a checked draft: after a try, taken resets the wait and not taken
    /// doubles it.
    pub(crate) fn checked(&mut self, taken: usize) {
        if std::mem::take(&mut self.trying) {
            self.wait = if taken > 0 {
                Self::FIRST
            } else {
                (self.wait * 2).min(Self::LAST)
            };
            self.missed = if taken > 0 { 0 } else { self.missed + 1 };
        }
    }

    /// Tries not taken in a row since drafts last paid.
    pub(crate) fn missed(&self) -> usize {
        self.missed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A CPU-like cost: a one-row step 1.0, each further row 0.6 of one.
    fn cpu_costs(max_rows: usize) -> StepCosts {
        let mut c = StepCosts::default();
        for n in 1..=max_rows {
            c.record(n, 1.0 + 0.6 * (n - 1) as f64);
        }
        c
    }

    fn taken_ratio(p: f32, n: usize) -> Acceptance {
        let mut a = Acceptance::default();
        for i in 0..n {
            // a draft of 8 positions whose first token is taken with chance p
            let first = (i as f32 + 0.5) / n as f32 <= p;
            if first {
                a.record(8, 8);
            } else {
                a.record(1, 0);
            }
        }
        a
    }

    #[test]
    fn all_taken_is_the_chance_of_every_position_in_turn() {
        assert!(
            (Acceptance::default().all_taken(2) - 0.25).abs() < 1e-9,
            "priors: a half each"
        );
        assert!((Acceptance::default().all_taken(0) - 1.0).abs() < 1e-12);
        let sure = taken_ratio(1.0, 40);
        assert!(sure.all_taken(8) > 0.9, "{}", sure.all_taken(8));
        let half = taken_ratio(0.5, 40);
        let p = half.p(0) * half.p(1) * half.p(2);
        assert!((half.all_taken(3) - p).abs() < 1e-12);
        // the chance falls with each position, and equals the difference of expected tokens
        assert!(half.all_taken(4) <= half.all_taken(3));
        let d = half.expected_tokens(3) - half.expected_tokens(2);
        assert!((half.all_taken(3) - d).abs() < 1e-12);
    }

    #[test]
    fn step_costs_interpolate_and_look_cheap_where_unmeasured() {
        let mut c = StepCosts::default();
        assert!(
            (c.cost(9) - 1.4).abs() < 1e-9,
            "nothing measured: cheap rows"
        );
        c.record(1, 0.010);
        assert!(c.cost(9) > 0.010 && c.cost(9) < 0.015);
        c.record(9, 0.060);
        assert!((c.cost(5) - 0.035).abs() < 1e-9, "{}", c.cost(5));
        c.record(9, 0.030);
        assert!((c.cost(9) - (0.7 * 0.060 + 0.3 * 0.030)).abs() < 1e-9);
        // short of the first measured: its share by rows
        let mut wide = StepCosts::default();
        wide.record(9, 0.090);
        assert!((wide.cost(3) - 0.030).abs() < 1e-9);
        // no steps of 0 rows, no nonsense times
        c.record(0, 5.0);
        c.record(3, f64::NAN);
        assert!(c.cost(3) < 0.05);
    }

    #[test]
    fn acceptance_learns_per_position_and_forgets() {
        let mut a = Acceptance::default();
        assert!((a.p(0) - 0.5).abs() < 1e-9 && (a.expected_tokens(2) - 1.75).abs() < 1e-9);
        for _ in 0..30 {
            // the first 3 drafted tokens taken, the 4th not
            a.record(4, 3);
        }
        assert!(a.p(0) > 0.95 && a.p(2) > 0.95 && a.p(3) < 0.05, "{a:?}");
        assert!(a.expected_tokens(8) < 4.0 && a.expected_tokens(3) > 3.8);
        for _ in 0..60 {
            a.record(1, 0);
        }
        assert!(a.p(0) < 0.06, "it forgets: {}", a.p(0));
        // positions never reached go as the last one reached: a draft always taken whole
        // at length 1 promises more at length 4
        let mut one = Acceptance::default();
        for _ in 0..20 {
            one.record(1, 1);
        }
        assert!(one.p(3) > 0.95 && one.expected_tokens(4) > 4.5, "{one:?}");
    }

    #[test]
    fn drafts_that_miss_are_not_checked_where_rows_cost() {
        let costs = cpu_costs(9);
        // most first tokens missed: no drafts
        let missing = taken_ratio(0.2, 40);
        let k = choose(
            &costs,
            &[Candidate {
                available: 8,
                acceptance: &missing,
            }],
            0.0,
        );
        assert_eq!(k, vec![0]);
        // nearly every draft taken whole: the whole draft
        let taken = taken_ratio(1.0, 40);
        let k = choose(
            &costs,
            &[Candidate {
                available: 8,
                acceptance: &taken,
            }],
            0.0,
        );
        assert!(k[0] >= 6, "{k:?}");
        // rows that cost little (a GPU, a memory-bound step): a fair chance is worth it
        let mut cheap = StepCosts::default();
        for n in 1..=9 {
            cheap.record(n, 1.0 + 0.02 * (n - 1) as f64);
        }
        let half = taken_ratio(0.5, 40);
        let k = choose(
            &cheap,
            &[Candidate {
                available: 8,
                acceptance: &half,
            }],
            0.0,
        );
        assert!(k[0] >= 1, "{k:?}");
        // a draft model's own cost counts: with each drafted token as dear as a step, none
        let k = choose(
            &cheap,
            &[Candidate {
                available: 8,
                acceptance: &taken,
            }],
            1.0,
        );
        assert!(k[0] <= 2, "{k:?}");
    }

    #[test]
    fn several_sequences_draft_where_it_pays() {
        let costs = cpu_costs(20);
        let (good, bad) = (taken_ratio(1.0, 40), taken_ratio(0.0, 40));
        let k = choose(
            &costs,
            &[
                Candidate {
                    available: 6,
                    acceptance: &bad,
                },
                Candidate {
                    available: 6,
                    acceptance: &good,
                },
                Candidate {
                    available: 0,
                    acceptance: &good,
                },
            ],
            0.0,
        );
        assert!(k[0] == 0 && k[1] >= 4 && k[2] == 0, "{k:?}");
    }

    #[test]
    fn shadow_drafts_are_scored_once_decided() {
        let mut a = Acceptance::default();
        let mut s = Shadows::default();
        s.push(2, vec![7, 8, 9]);
        s.push(3, vec![8, 5]);
        s.push(3, Vec::new());
        s.score(&[1, 2, 7], &mut a);
        assert_eq!(s.pending.len(), 2, "nothing decided yet");
        s.score(&[1, 2, 7, 8, 9], &mut a);
        // [7, 8, 9] all taken; [8, 5] against [8, 9]: reached 2, took 1
        assert!(s.pending.is_empty());
        assert!(a.p(0) > 0.7 && a.p(1) < 0.6 && a.p(2) > 0.7, "{a:?}");
        // a draft that agrees so far waits for the rest
        s.push(5, vec![4, 4]);
        s.score(&[1, 2, 7, 8, 9, 4], &mut a);
        assert_eq!(s.pending.len(), 1);
    }

    #[test]
    fn probes_back_off_while_not_taken() {
        let mut p = Probe::default();
        assert!((0..7).all(|_| p.length(0, 4, 0.0, 1.0) == 0));
        assert_eq!(p.length(0, 4, 0.0, 1.0), 1, "the eighth step tries one");
        p.checked(0);
        assert!(
            (0..15).all(|_| p.length(0, 4, 0.0, 1.0) == 0),
            "then waits twice as long"
        );
        assert_eq!(p.length(0, 0, 0.0, 1.0), 0, "nothing to try");
        assert_eq!(p.length(0, 4, 0.0, 1.0), 1);
        p.checked(1);
        assert!((0..7).all(|_| p.length(0, 4, 0.0, 1.0) == 0));
        assert_eq!(
            p.length(3, 4, 0.0, 1.0),
            3,
            "a chosen length goes as chosen"
        );
        assert!((0..7).all(|_| p.length(0, 4, 0.0, 1.0) == 0));
        assert_eq!(p.length(0, 4, 0.0, 1.0), 1);
    }

    #[test]
    fn a_costly_try_waits_until_tries_take_a_small_share() {
        let mut p = Probe::default();
        // a try costing 1.5 steps: at most 2% of the time goes to tries, one in 75 steps
        assert!((0..74).all(|_| p.length(0, 4, 1.5, 1.0) == 0));
        assert_eq!(p.length(0, 4, 1.5, 1.0), 1, "the 75th step tries one");
        p.checked(0);
        // the doubled wait (16) is shorter than what the cost asks
        assert!((0..74).all(|_| p.length(0, 4, 1.5, 1.0) == 0));
        assert_eq!(p.length(0, 4, 1.5, 1.0), 1);
        // a cheap try keeps the doubling wait
        p.checked(0);
        assert!((0..31).all(|_| p.length(0, 4, 0.01, 1.0) == 0));
        assert_eq!(p.length(0, 4, 0.01, 1.0), 1);
    }
}
