//! The compute pool's threads held together for decode steps ([`step`]), so the matrix
//! products of a step are split between threads that are already awake. A decode step runs
//! a few hundred short parallel loops with short serial stretches between them; rayon puts
//! an idle worker to sleep within microseconds, and waking it again can take longer than a
//! whole loop (the woken worker starting after the caller has done every job alone, and
//! the caller then sleeping on the join and being woken as late).
//! Within a step, the other workers instead run a helper that spins until the caller
//! publishes a loop ([`for_each`]) and takes indices from it as the caller does. Outside a
//! step, [`for_each`] is rayon's parallel loop.
//!
//! Helpers also outlive their step by up to [`LINGER`], spinning, so that the caller's next
//! step (the next token, after sampling) finds them awake: spawning a helper wakes a
//! sleeping worker, which costs the caller time every token and brings the helper late.

use std::cell::{Cell, RefCell};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long helpers keep spinning after a step ends, for the caller's next step. Between
/// two decode steps lie sampling and the hand-over of a token, tens of microseconds; a
/// helper left over after the last step spins this long for nothing.
pub const LINGER: Duration = Duration::from_millis(1);

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

/// What the caller and the helpers of one caller's steps share. Kept by the caller's thread
/// between its steps (see [`OWN`]), so helpers can linger on it.
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
    /// A step of this team is running.
    running: AtomicBool,
    /// Helpers spawned for this team that have not left: queued, helping, or lingering.
    enlisted: AtomicUsize,
    /// When the last step ended, in nanoseconds since [`since_start`]'s origin.
    ended: AtomicU64,
    /// Lingering helpers leave now ([`release`]).
    released: AtomicBool,
}

/// A step with helpers is running somewhere in the process. One at a time: a helper is a
/// rayon task that spins until its step ends, and a worker waiting inside a rayon join
/// may pick one up; with two teams, the helper of one could sit inside a join of the
/// other's caller and each wait for the other. Alone, a team's helpers are tasks its caller
/// pushed, so a thread that takes work from the caller takes a helper first, and no thread
/// helps while holding half of the caller's join. Later steps run without helpers until it
/// ends, and a lingering helper of another team leaves as soon as a step holds this. Holds
/// the running team's address (0: none).
static TEAM_RUNNING: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// The team of the step this thread is running, if any.
    static CURRENT: Cell<*const Team> = const { Cell::new(std::ptr::null()) };
    /// The team this thread's steps use, kept between them.
    static OWN: RefCell<Option<Arc<Team>>> = const { RefCell::new(None) };
}

/// Nanoseconds since the first call.
fn since_start() -> u64 {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    ORIGIN.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

impl Team {
    fn new() -> Self {
        Team {
            job: Mutex::new(None),
            next: AtomicU64::new(0),
            finished: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            running: AtomicBool::new(false),
            enlisted: AtomicUsize::new(0),
            ended: AtomicU64::new(0),
            released: AtomicBool::new(false),
        }
    }

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

    /// Whether a helper with no step to help should leave: released, another team's step
    /// holds the pool, or [`LINGER`] has passed since the last step ended.
    fn linger_over(&self) -> bool {
        let holder = TEAM_RUNNING.load(Ordering::Acquire);
        self.released.load(Ordering::Acquire)
            || (holder != 0 && holder != self as *const Team as usize)
            || since_start().saturating_sub(self.ended.load(Ordering::Acquire))
                > LINGER.as_nanos() as u64
    }

    /// A helper's life: wait (spinning) for each new loop and work on it, through this
    /// team's steps, until no step has run for [`LINGER`].
    fn help(&self) {
        #[cfg(test)]
        let _helping = tests::Helping::start();
        // none seen yet: a helper that arrives during a loop joins it
        let mut seen = None;
        loop {
            let epoch = (self.next.load(Ordering::Acquire) >> 32) as u32;
            if seen != Some(epoch) {
                seen = Some(epoch);
                let job = *self.job.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(job) = job {
                    self.work(job);
                }
                continue;
            }
            if self.running.load(Ordering::Acquire) {
                std::hint::spin_loop();
                continue;
            }
            if self.linger_over() {
                self.enlisted.fetch_sub(1, Ordering::SeqCst);
                // a step that began meanwhile may have counted this helper as present
                // (both sides order their store before their load: see `step`)
                if self.running.load(Ordering::SeqCst) {
                    self.enlisted.fetch_add(1, Ordering::SeqCst);
                    continue;
                }
                return;
            }
            // lingering holds a pool thread: let the pool's other work run on it meanwhile
            rayon::yield_now();
        }
    }
}

/// Runs `f` (on a pool thread, with several in the pool) as one step whose [`for_each`]
/// loops are shared with the pool's other threads, kept spinning until `f` returns and for
/// [`LINGER`] after. With one thread, inside a step already, or while another step has the
/// team, it just runs `f` (its loops then go to rayon).
pub fn step<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| {
        let helpers = rayon::current_num_threads().saturating_sub(1);
        if helpers == 0 || !CURRENT.with(|c| c.get().is_null()) {
            return f();
        }
        let team = OWN.with(|o| {
            o.borrow_mut()
                .get_or_insert_with(|| Arc::new(Team::new()))
                .clone()
        });
        if TEAM_RUNNING
            .compare_exchange(
                0,
                Arc::as_ptr(&team) as usize,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_err()
        {
            return f();
        }
        team.released.store(false, Ordering::Release);
        team.running.store(true, Ordering::SeqCst);
        // helpers still lingering from the last step need no new spawn (a leaving one
        // either is counted out here, or sees `running` and stays: see `Team::help`)
        let present = team.enlisted.load(Ordering::SeqCst);
        for _ in present..helpers {
            #[cfg(test)]
            tests::SPAWNED.with(|n| n.set(n.get() + 1));
            team.enlisted.fetch_add(1, Ordering::SeqCst);
            let t = team.clone();
            rayon::spawn(move || {
                // the caller itself may pick this up while it waits in a rayon join of its
                // own: then there is nobody to help
                if CURRENT.with(|c| std::ptr::eq(c.get(), &*t)) {
                    t.enlisted.fetch_sub(1, Ordering::SeqCst);
                } else {
                    t.help();
                }
            });
        }
        /// Ends the step however `f` leaves (a panic included); the helpers linger.
        struct End<'a>(&'a Team);
        impl Drop for End<'_> {
            fn drop(&mut self) {
                CURRENT.with(|c| c.set(std::ptr::null()));
                self.0.ended.store(since_start(), Ordering::Release);
                self.0.running.store(false, Ordering::Release);
                TEAM_RUNNING.store(0, Ordering::Release);
            }
        }
        CURRENT.with(|c| c.set(&*team));
        let _end = End(&team);
        f()
    })
}

/// Sends this thread's lingering helpers away, for work that needs the whole pool (a
/// prefill's rayon loops would otherwise find a thread spinning for up to [`LINGER`]).
pub fn release() {
    OWN.with(|o| {
        if let Some(t) = &*o.borrow() {
            t.released.store(true, Ordering::Release);
        }
    });
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

/// Test support: a rayon pool of `threads` threads.
#[cfg(test)]
pub(crate) fn test_pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("a test's thread pool")
}

/// Test support: runs `f` in decode steps on `pool`, handing each result and whether its step
/// formed a team to `check`, until one does (other tests of the process may hold the one
/// team for a moment).
///
/// # Panics
/// When no step forms a team in 400 tries.
#[cfg(test)]
pub(crate) fn until_teamed<R: Send>(
    pool: &rayon::ThreadPool,
    f: impl Fn() -> R + Sync,
    mut check: impl FnMut(R, bool),
) {
    for _ in 0..400 {
        let (r, teamed) = pool.install(|| step(|| (f(), in_step())));
        check(r, teamed);
        if teamed {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    panic!("no team formed in 400 tries");
}

#[cfg(test)]
mod tests {
    use super::*;

    thread_local! {
        /// Helpers spawned by the steps this thread ran.
        pub(super) static SPAWNED: Cell<usize> = const { Cell::new(0) };
    }
    /// The tests that count on a team forming run one at a time.
    static SERIAL: Mutex<()> = Mutex::new(());

    fn spawned() -> usize {
        SPAWNED.with(|n| n.get())
    }

    thread_local! {
        /// This thread runs a helper (maybe with other pool work nested in its wait).
        static HELPING: Cell<bool> = const { Cell::new(false) };
    }

    /// Marks the thread as a helper's until dropped.
    pub(super) struct Helping(bool);

    impl Helping {
        pub(super) fn start() -> Self {
            Helping(HELPING.with(|h| h.replace(true)))
        }
    }

    impl Drop for Helping {
        fn drop(&mut self) {
            HELPING.with(|h| h.set(self.0));
        }
    }

    /// The helpers enlisted in this thread's team.
    fn enlisted() -> usize {
        OWN.with(|o| {
            o.borrow()
                .as_ref()
                .map_or(0, |t| t.enlisted.load(Ordering::SeqCst))
        })
    }

    /// Runs steps on a 2-thread pool until one forms a team (other tests of the process may
    /// hold the one team for a moment); returns the helpers spawned meanwhile.
    fn formed_step(pool: &rayon::ThreadPool) -> usize {
        let before = spawned();
        until_teamed(pool, || (), |_, _| {});
        spawned() - before
    }

    #[test]
    fn helpers_linger_for_the_next_step_then_leave() {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let pool = test_pool(2);
        pool.install(|| {
            assert!(formed_step(&pool) <= 1);
            // after a step the helper stays: 100 µs later (a tenth of LINGER) it is still
            // enlisted, with no step running. Another test's step may take the one team
            // meanwhile and send it away, so some tries out of many are asked to show it
            let lingered = (0..200).any(|_| {
                // a step the helper took part in (long enough for one woken from sleep)
                let helped = AtomicUsize::new(0);
                let me = rayon::current_thread_index();
                step(|| {
                    for_each(16, |_| {
                        let t = Instant::now();
                        while t.elapsed() < Duration::from_micros(50) {}
                        if rayon::current_thread_index() != me {
                            helped.fetch_add(1, Ordering::Relaxed);
                        }
                    })
                });
                if helped.load(Ordering::Relaxed) == 0 {
                    return false;
                }
                let t = Instant::now();
                while t.elapsed() < Duration::from_micros(100) {}
                enlisted() == 1
            });
            assert!(lingered, "no helper stayed after its step");
            // steps straight after one another run their loops whole
            for _ in 0..40 {
                let n = AtomicUsize::new(0);
                step(|| {
                    for_each(4, |_| {
                        n.fetch_add(1, Ordering::Relaxed);
                    })
                });
                assert_eq!(n.load(Ordering::Relaxed), 4);
            }
            // then it leaves, by itself after LINGER, or at once when released
            let t0 = Instant::now();
            while enlisted() > 0 {
                assert!(
                    t0.elapsed() < Duration::from_secs(5),
                    "the helper never left"
                );
                std::thread::sleep(LINGER / 4);
            }
            assert!(step(in_step));
            release();
            let t0 = Instant::now();
            while enlisted() > 0 {
                assert!(
                    t0.elapsed() < Duration::from_secs(5),
                    "a released helper stayed"
                );
                std::thread::yield_now();
            }
        });
    }

    #[test]
    fn a_lingering_helper_lets_other_pool_work_run() {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let pool = test_pool(2);
        let (done, formed) = (AtomicBool::new(false), AtomicBool::new(false));
        let (mut tries, mut in_helper) = (0, 0);
        std::thread::scope(|s| {
            s.spawn(|| {
                pool.install(|| {
                    // steps back to back, as decoding runs them, until the other work is done
                    while !done.load(Ordering::Acquire) {
                        if step(|| {
                            for_each(2, |_| std::hint::black_box(()));
                            in_step()
                        }) {
                            formed.store(true, Ordering::Release);
                        }
                    }
                })
            });
            while !formed.load(Ordering::Acquire) {
                std::thread::yield_now();
            }
            // work injected from outside the pool while both threads are taken (the caller
            // and its helper) runs on the helper, between steps. Not every time: while a
            // step of another test holds the team, or after the OS held the caller up for
            // LINGER, the helper has left and its thread is free: the count that has to run
            // on a helper is reached once the other tests are done.
            let t0 = Instant::now();
            while in_helper < 10 && t0.elapsed() < Duration::from_secs(10) {
                tries += 1;
                in_helper += usize::from(pool.install(|| HELPING.with(|h| h.get())));
            }
            done.store(true, Ordering::Release);
        });
        assert!(
            in_helper >= 10,
            "{in_helper} of {tries} jobs ran on a lingering helper"
        );
    }

    #[test]
    fn every_index_runs_once_in_and_out_of_a_step() {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let pool = test_pool(3);
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
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        assert!(!in_step());
        let one = test_pool(1);
        assert!(!one.install(|| step(in_step)), "one thread has no helpers");
        let two = test_pool(2);
        until_teamed(
            &two,
            || step(in_step),
            |nested, teamed| {
                assert_eq!(nested, teamed, "a nested step's loops go to the outer team")
            },
        );
        assert!(!in_step());
    }

    #[test]
    fn steps_nest_and_run_beside_each_other() {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let pool = test_pool(2);
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
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let pool = test_pool(2);
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
