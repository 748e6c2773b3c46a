//! The clock that emulated links stamp messages with: `CLOCK_MONOTONIC` in nanoseconds, read
//! with `clock_gettime(2)`. Every process on one host reads the same monotonic clock, so a
//! timestamp taken by a sender in one process means the same instant to a receiver in
//! another; across hosts the values are unrelated, which is why link emulation needs all
//! ranks on one host.

use std::time::Duration;

/// Nanoseconds of `CLOCK_MONOTONIC` (time since an unspecified point, shared by all
/// processes of the host).
#[must_use]
pub(crate) fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec and CLOCK_MONOTONIC is always supported on
    // the platforms libc targets here; the call writes only into `ts`.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    debug_assert_eq!(rc, 0);
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

/// Below this much time left, waiting spins instead of sleeping (sleeps overshoot).
const SPIN_NS: u64 = 50_000;

/// Waits until `monotonic_ns() >= until`: sleeps while far, spins the last ~50 µs.
pub(crate) fn wait_until_ns(until: u64) {
    loop {
        let now = monotonic_ns();
        if now >= until {
            return;
        }
        let left = until - now;
        if left > SPIN_NS {
            std::thread::sleep(Duration::from_nanos(left - SPIN_NS));
        } else {
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn monotonic_and_waits() {
        let a = monotonic_ns();
        wait_until_ns(a + 200_000);
        let b = monotonic_ns();
        assert!(b >= a + 200_000);
    }
}
