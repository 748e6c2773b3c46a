//! The compute pool's threads held together for one decode step ([`step`]), so the matrix
//! products of the step are split between threads that are already awake. A decode step
//! runs a few hundred parallel loops of 10-400 µs each with short serial stretches between
//! them; rayon puts an idle worker to sleep within microseconds, and waking it again cost
//! 80-100 µs on a 2-vCPU VM (logged per job: the woken worker often started after the
//! caller had done every job alone, and the caller then slept on the join and was woken as
//! late). Within a step, the other workers instead run a helper that spins until the caller
//! publishes a loop ([`for_each`]), takes indices from it as the caller does, and leaves
//! when the step ends. Outside a step, [`for_each`] is rayon's parallel loop.

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

/// A published loop: its body, its length and its number.
#[derive(Clone, Copy)]
struct Job {
    body: *const (dyn Fn(usize) + Sync + 'static),
    n: usize,
    epoch: u32,
}

// SAFETY: `body` points at a `Sync` closure, and it is only called while its loop is
// running (see `Team::run`).
unsafe impl Send for Job {}

/// What the caller and the helpers of one step share.
struct Team {
    /// The loop now published (read once per loop by each helper).
    job: Mutex<Option<Job>>,
    /// The next index to take, with the loop's number in the upper 32 bits: a helper still
    /// holding an older loop can take nothing from a newer one.
    next: AtomicU64,
    /// Indices of the current loop done.
    finished: AtomicUsize,
    /// A body panicked in the current loop.
    panicked: AtomicBool,
    /// The step is over: helpers leave.
    over: AtomicBool,
}

/// A step with helpers is running somewhere in the process. One at a time: a helper is a
/// rayon task that spins until its step ends, and a worker waiting inside a rayon join
/// may pick one up; with two teams, the helper of one could sit inside a join of the
/// other's caller and each wait for the other. Alone, a team's helpers are the oldest
/// tasks its caller pushed, so a thread that takes work from the caller takes a helper
/// first, and no thread helps while holding half of the caller's join. Later steps run
/// without helpers until it ends.
static TEAM_RUNNING: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// The team of the step this thread is running, if any.
    static CURRENT: Cell<*const Team> = const { Cell::new(std::ptr::null()) };
}

impl Team {
    /// Takes and runs indices of loop `job` until none is left (or a newer loop is out).
    fn work(&self, job: Job) {
        loop {
            let v = self.next.load(Ordering::Acquire);
            let (epoch, i) = ((v >> 32) as u32, (v & 0xFFFF_FFFF) as usize);
            if epoch != job.epoch || i >= job.n {
                return;
            }
            if self
                .next
                .compare_exchange_weak(v, v + 1, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                continue;
            }
            // SAFETY: index `i` of this loop was taken, so the loop is still running: the
            // caller does not return from `run` (and the closure outlives it) until every
            // taken index is finished.
            let body = unsafe { &*job.body };
            if catch_unwind(AssertUnwindSafe(|| body(i))).is_err() {
                self.panicked.store(true, Ordering::Release);
            }
            self.finished.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Runs `body` for every index below `n` on the caller and the helpers, and returns
    /// when all are done.
    fn run(&self, n: usize, body: &(dyn Fn(usize) + Sync)) {
        // only the caller writes the loop number; helpers change the index below it
        let epoch = ((self.next.load(Ordering::Acquire) >> 32) as u32).wrapping_add(1);
        // SAFETY: only the lifetime is erased; the pointer is called only for indices taken
        // while this loop runs, and this function waits for all of them below.
        let body: *const (dyn Fn(usize) + Sync + 'static) =
            unsafe { std::mem::transmute(body as *const (dyn Fn(usize) + Sync)) };
        *self.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(Job { body, n, epoch });
        self.finished.store(0, Ordering::Release);
        self.next.store(u64::from(epoch) << 32, Ordering::Release);
        self.work(Job { body, n, epoch });
        while self.finished.load(Ordering::Acquire) < n {
            std::hint::spin_loop();
        }
        if self.panicked.swap(false, Ordering::AcqRel) {
            panic!("a parallel loop of the decode step panicked");
        }
    }

    /// A helper's life: wait (spinning) for each new loop and work on it, until the step is
    /// over.
    fn help(&self) {
        let mut seen = 0u32;
        loop {
            let epoch = (self.next.load(Ordering::Acquire) >> 32) as u32;
            if epoch != seen {
                seen = epoch;
                let job = *self.job.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(job) = job {
                    self.work(job);
                }
                continue;
            }
            if self.over.load(Ordering::Acquire) {
                return;
            }
            std::hint::spin_loop();
        }
    }
}

/// Runs `f` (on a pool thread, with several in the pool) as one step whose [`for_each`]
/// loops are shared with the pool's other threads, kept spinning until `f` returns. With
/// one thread, inside a step already, or while another step has the team, it just runs
/// `f` (its loops then go to rayon).
pub fn step<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    let team = Team {
        job: Mutex::new(None),
        next: AtomicU64::new(0),
        finished: AtomicUsize::new(0),
        panicked: AtomicBool::new(false),
        over: AtomicBool::new(false),
    };
    let team = &team;
    rayon::scope(|s| {
        let helpers = rayon::current_num_threads().saturating_sub(1);
        if helpers == 0
            || !CURRENT.with(|c| c.get().is_null())
            || TEAM_RUNNING
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
        {
            return f();
        }
        for _ in 0..helpers {
            s.spawn(move |_| {
                // the caller itself may pick this up while it waits in a rayon join of its
                // own: then there is nobody to help
                if !CURRENT.with(|c| std::ptr::eq(c.get(), team)) {
                    team.help();
                }
            });
        }
        /// Ends the step however `f` leaves (a panic included), so the helpers return
        /// and the scope can close.
        struct End<'a>(&'a Team);
        impl Drop for End<'_> {
            fn drop(&mut self) {
                CURRENT.with(|c| c.set(std::ptr::null()));
                self.0.over.store(true, Ordering::Release);
                TEAM_RUNNING.store(false, Ordering::Release);
            }
        }
        CURRENT.with(|c| c.set(team));
        let _end = End(team);
        f()
    })
}

/// Whether this thread runs a step with helpers, so its [`for_each`] loops go to a team
/// that is already awake rather than to rayon.
pub fn in_step() -> bool {
    CURRENT.with(|c| !c.get().is_null())
}

/// `body(i)` for every `i` below `n`, in parallel: on the current step's team when this
/// thread runs one, else on rayon's pool.
pub fn for_each(n: usize, body: impl Fn(usize) + Sync) {
    let team = CURRENT.with(|c| c.get());
    // a team's indices are 32 bits wide
    if team.is_null() || n > u32::MAX as usize {
        use rayon::prelude::*;
        (0..n).into_par_iter().for_each(&body);
        return;
    }
    // SAFETY: CURRENT is set only while `step` holds the team on its stack (cleared by
    // `End` before the team goes), and only on the thread running that step.
    unsafe { &*team }.run(n, &body);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn every_index_runs_once_in_and_out_of_a_step() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        pool.install(|| {
            for in_step in [false, true] {
                let run = || {
                    for n in [0, 1, 2, 7, 64, 1000] {
                        let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                        for_each(n, |i| {
                            hits[i].fetch_add(1, Ordering::Relaxed);
                        });
                        assert!(
                            hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                            "n {n}, in a step: {in_step}"
                        );
                    }
                };
                if in_step {
                    step(run);
                } else {
                    run();
                }
            }
        });
    }

    #[test]
    fn in_step_says_whether_loops_go_to_a_team() {
        assert!(!in_step());
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        assert!(!one.install(|| step(in_step)), "one thread has no helpers");
        let two = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        // other tests of this process may hold the one team for a moment
        let formed = (0..400).any(|_| {
            let inside = two.install(|| step(|| (in_step(), step(in_step))));
            assert_eq!(
                inside.1, inside.0,
                "a nested step's loops go to the outer team"
            );
            inside.0 || {
                std::thread::sleep(std::time::Duration::from_millis(5));
                false
            }
        });
        assert!(formed, "no team formed in 400 tries");
        assert!(!in_step());
    }

    #[test]
    fn steps_nest_and_run_beside_each_other() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let total = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| {
                    pool.install(|| {
                        for _ in 0..50 {
                            step(|| {
                                for_each(16, |_| {
                                    total.fetch_add(1, Ordering::Relaxed);
                                });
                                step(|| {
                                    for_each(4, |_| {
                                        total.fetch_add(1, Ordering::Relaxed);
                                    })
                                });
                            });
                        }
                    })
                });
            }
        });
        assert_eq!(total.load(Ordering::Relaxed), 3 * 50 * 20);
    }

    #[test]
    fn a_panicking_body_fails_the_loop_and_ends_the_step() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let r = pool.install(|| {
            std::panic::catch_unwind(|| {
                step(|| {
                    for_each(8, |i| {
                        if i == 5 {
                            panic!("index 5");
                        }
                    })
                })
            })
        });
        assert!(r.is_err());
        // the pool still works afterwards
        let n = AtomicUsize::new(0);
        pool.install(|| {
            step(|| {
                for_each(10, |_| {
                    n.fetch_add(1, Ordering::Relaxed);
                })
            })
        });
        assert_eq!(n.load(Ordering::Relaxed), 10);
    }
}
