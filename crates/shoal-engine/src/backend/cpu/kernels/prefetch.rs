//! How far ahead of the weights being read the x86 decode kernels ask for cache lines
//! ([`Prefetch`]). The best distance is a property of the CPU, not of the code: the 8 KiB
//! the K-quant kernels run best at on an AMD EPYC (Zen 3) is far too long for an Intel Xeon
//! (AVX-512, AMX). So the distances are chosen per CPU vendor at first use, and `shoal
//! bench kernels --prefetch` sets others to measure a new machine with.
//!
//! Each line is asked for twice where the maker's entry says so: into L1 a short distance
//! ahead, and into L2 (`prefetcht1`) farther ahead. One request per line keeps too few
//! lines in flight for one core to stream at the memory's pace; the L2 requests add more
//! without the L1 fill buffers they would wait on as L1 requests.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Software prefetch distances of the x86 one-activation-row kernels, in bytes past the
/// block being read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prefetch {
    /// For the 32-value types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; tile blocks of 144-272 bytes).
    pub block: usize,
    /// For the K-quants (tile blocks of 672-1680 bytes, prefetched a quarter at a time).
    pub k: usize,
    /// Of the second request for each line, into L2, for every type (0: none).
    pub l2: usize,
}

/// Not chosen yet.
const UNSET: usize = usize::MAX;
static BLOCK: AtomicUsize = AtomicUsize::new(UNSET);
static K: AtomicUsize = AtomicUsize::new(UNSET);
static L2: AtomicUsize = AtomicUsize::new(UNSET);

impl Prefetch {
    /// The distances that ran fastest on this CPU's vendor, of those tried.
    ///
    /// - AMD (and Hygon, its licensee): 2 KiB and 8 KiB into L1, none into L2 (not tried
    ///   there). On an EPYC (Zen 3) the K-quants run faster the farther ahead up to 8 KiB,
    ///   and the 32-value types gain nothing past 2 KiB.
    /// - Everyone else (chosen on Intel): 1.5 KiB for both into L1, and 4 KiB into L2. On a
    ///   Xeon with AVX-512 and a large L3, shorter L1 distances slow the K-quants and longer
    ///   ones slow every type; the L2 request brings the one-row products closer to the
    ///   machine's read bandwidth, most at 4 KiB, and loses from 6 KiB on.
    pub fn for_this_cpu() -> Prefetch {
        let [amd, other] = Prefetch::KNOWN;
        if vendor_is_amd() {
            amd
        } else {
            other
        }
    }

    /// The distances chosen for some maker: AMD's, then everyone else's (see
    /// [`Prefetch::for_this_cpu`]).
    pub const KNOWN: [Prefetch; 2] = [
        Prefetch {
            block: 2048,
            k: 8192,
            l2: 0,
        },
        Prefetch {
            block: 1536,
            k: 1536,
            l2: 4096,
        },
    ];

    /// The distances the kernels use now: those [`Prefetch::set`] last, or else
    /// [`Prefetch::for_this_cpu`].
    pub fn current() -> Prefetch {
        let [block, k, l2] = [&BLOCK, &K, &L2].map(|a| a.load(Ordering::Relaxed));
        if block == UNSET || k == UNSET || l2 == UNSET {
            let p = Prefetch::for_this_cpu();
            p.set();
            return p;
        }
        Prefetch { block, k, l2 }
    }

    /// Makes the kernels of this process use these distances from their next call on (to
    /// measure others; results do not depend on them).
    pub fn set(self) {
        BLOCK.store(self.block.min(UNSET - 1), Ordering::Relaxed);
        K.store(self.k.min(UNSET - 1), Ordering::Relaxed);
        L2.store(self.l2.min(UNSET - 1), Ordering::Relaxed);
    }

    /// The distances for a kernel over `rows` activation rows: [`Prefetch::current`] for
    /// one row (decode, bound by memory), none for more (their products are bound by
    /// arithmetic, and the kernels ask for nothing then).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) fn for_rows(rows: usize) -> Prefetch {
        if rows == 1 {
            Prefetch::current()
        } else {
            Prefetch {
                block: 0,
                k: 0,
                l2: 0,
            }
        }
    }
}

/// Whether CPUID names AMD or Hygon as the maker.
fn vendor_is_amd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let r = std::arch::x86_64::__cpuid(0);
        let mut name = [0u8; 12];
        name[..4].copy_from_slice(&r.ebx.to_le_bytes());
        name[4..8].copy_from_slice(&r.edx.to_le_bytes());
        name[8..].copy_from_slice(&r.ecx.to_le_bytes());
        &name == b"AuthenticAMD" || &name == b"HygonGenuine"
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distances_are_chosen_once_and_can_be_set() {
        let chosen = Prefetch::current();
        assert_eq!(chosen, Prefetch::for_this_cpu());
        assert!(chosen.block > 0 && chosen.k > 0);
        let other = Prefetch {
            block: 64,
            k: 4096,
            l2: 0,
        };
        other.set();
        assert_eq!(Prefetch::current(), other);
        chosen.set();
        assert_eq!(Prefetch::current(), chosen);
    }
}
