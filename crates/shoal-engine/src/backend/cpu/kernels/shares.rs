//! Contiguous shares of a parallel loop's units, one per thread, balanced at the end by
//! stealing ([`Shares`]). Two threads streaming halves of a matrix from memory do not
//! finish together: their speeds differ by a few percent, and by chance, not by core (the
//! sign flips from token to token), so with fixed halves the faster thread would wait at
//! every loop's end for the other. Here a thread takes its share from the front, half of
//! what is left at a time, and a thread with nothing left takes the back half of the
//! largest share still open. A thread thus streams one run of memory from start to end, and
//! a steal costs one cold start where it saves more.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

/// One share: `start` in the low 32 bits, `end` in the high 32, on a cache line of its own
/// (its owner takes from it a few times per loop, others once at most).
#[repr(align(128))]
struct Share(AtomicU64);

fn pack(r: Range<usize>) -> u64 {
    (r.end as u64) << 32 | r.start as u64
}

fn unpack(v: u64) -> Range<usize> {
    (v & 0xFFFF_FFFF) as usize..(v >> 32) as usize
}

/// The shares of `0..n` (see the module). Units are taken in multiples of `step` (whole tile
/// pairs, where a loop needs them) except at `n`.
pub(super) struct Shares {
    shares: Vec<Share>,
    /// The fewest units a thread takes from its own share at once.
    grain: usize,
    /// The fewest units left in a share for another thread to take half of them.
    steal: usize,
    step: usize,
}

impl Shares {
    /// `parts` shares of `0..n` (below 2^32), taken at least `grain` units at a time and
    /// stolen from while `steal` units are left.
    pub(super) fn new(n: usize, parts: usize, grain: usize, steal: usize, step: usize) -> Self {
        let step = step.max(1);
        let cut = |p: usize| (n * p / parts.max(1)).next_multiple_of(step).min(n);
        Shares {
            shares: (0..parts.max(1))
                .map(|p| Share(AtomicU64::new(pack(cut(p)..cut(p + 1)))))
                .collect(),
            grain: grain.max(step),
            steal: steal.max(2 * step),
            step,
        }
    }

    /// The shares there are: one per participant.
    pub(super) fn parts(&self) -> usize {
        self.shares.len()
    }

    /// Works as participant `me`: `body` over runs of its own share, then of what it takes
    /// from others, until nothing worth taking is left. Every unit goes to exactly one call
    /// of `body` across all participants (units taken are never given back).
    pub(super) fn work(&self, me: usize, body: &(dyn Fn(Range<usize>) + Sync)) {
        let Some(own) = self.shares.get(me) else {
            return;
        };
        loop {
            let v = own.0.load(Ordering::Acquire);
            let r = unpack(v);
            if r.start < r.end {
                let take = ((r.end - r.start) / 2).max(self.grain);
                let to = (r.start + take).next_multiple_of(self.step).min(r.end);
                if own
                    .0
                    .compare_exchange_weak(v, pack(to..r.end), Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    body(r.start..to);
                }
                continue;
            }
            // the back half of the largest share left, which becomes the own share (only
            // its owner takes from the front of a share, and the own one is empty, so only
            // this thread writes it now)
            let Some((victim, v)) = self
                .shares
                .iter()
                .map(|s| (s, s.0.load(Ordering::Acquire)))
                .max_by_key(|&(_, v)| unpack(v).len())
            else {
                return;
            };
            let r = unpack(v);
            if r.len() < self.steal {
                return;
            }
            let mid = (r.start + r.len() / 2)
                .next_multiple_of(self.step)
                .min(r.end);
            if victim
                .0
                .compare_exchange(v, pack(r.start..mid), Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                own.0.store(pack(mid..r.end), Ordering::Release);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn every_unit_once_whoever_works_and_however_slowly() {
        for (n, parts, grain, steal, step) in [
            (0, 2, 1, 2, 1),
            (1, 2, 1, 2, 1),
            (1000, 2, 8, 32, 2),
            (999, 3, 5, 20, 1),
            (64, 4, 1, 2, 2),
            (10_000, 2, 64, 256, 2),
        ] {
            let shares = Shares::new(n, parts, grain, steal, step);
            assert_eq!(shares.parts(), parts);
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            let calls = AtomicUsize::new(0);
            let body = |r: Range<usize>| {
                // every run but the last starts and ends on a step
                assert!(r.start.is_multiple_of(step), "{r:?}");
                assert!(r.end.is_multiple_of(step) || r.end == n, "{r:?}");
                calls.fetch_add(1, Ordering::Relaxed);
                for h in &hits[r] {
                    h.fetch_add(1, Ordering::Relaxed);
                }
            };
            // participant 0 is slow, so the others steal from it
            std::thread::scope(|s| {
                for me in 0..parts {
                    let (shares, body) = (&shares, &body);
                    s.spawn(move || {
                        shares.work(me, &|r| {
                            if me == 0 {
                                std::thread::sleep(std::time::Duration::from_micros(50));
                            }
                            body(r)
                        })
                    });
                }
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "n {n}, {parts} parts: every unit once"
            );
            // one thread running every participant in turn (as the caller does when the
            // helper is late) does everything
            let alone = Shares::new(n, parts, grain, steal, step);
            let seen = AtomicUsize::new(0);
            for me in (0..parts).rev() {
                alone.work(me, &|r| {
                    seen.fetch_add(r.len(), Ordering::Relaxed);
                });
            }
            assert_eq!(seen.load(Ordering::Relaxed), n);
            // a participant beyond the shares does nothing
            alone.work(parts, &|_| panic!("no share"));
        }
    }
}
