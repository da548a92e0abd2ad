//! A domain's worker team: persistent threads, pinned in their domain, that run the whole of one
//! GEMM call together while the calling thread waits.
//!
//! Why not a rayon pool: a GEMM of 256³ takes about 230 µs on two Zen 4 cores, and handing it
//! to a rayon pool from outside costs 11–34 µs on the VMs this is developed on (the caller
//! parks on a latch, workers that went to sleep are woken through the kernel, again for each
//! parallel loop inside the call). A team's idle workers spin for [`SPIN`] before they park,
//! so a call that follows another within [`SPIN`] starts without a wake-up, and the members
//! meet at spinning barriers inside the call. The caller does not work as a member (as
//! OpenBLAS's does): an unpinned caller that lands on a pinned member's core halves the speed
//! until the scheduler moves it, longer than a small GEMM lasts (measured: `docs/KERNELS.md`,
//! "Small problems on two threads").
//!
//! A job is SPMD, as in BLIS: every member runs the same closure with its [`Member`] id and
//! meets the others at [`Member::barrier`]. One job runs at a time (`Team::run` holds a lock for
//! the call); jobs never call back into their own team.

use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker (and a waiting caller) spins before it parks: about the cost of a
/// wake-up through the kernel on the VMs measured, so spinning never costs more than twice the
/// best choice made in hindsight; and short enough that a training step's non-GEMM work on the
/// same cores loses at most this much per GEMM call.
pub(crate) const SPIN: Duration = Duration::from_micros(50);

/// The job of one call, run once by every member with its id. The lifetime is erased; see the
/// SAFETY note in [`Team::run`].
type Job = &'static (dyn Fn(usize) + Sync);

/// The payload of the panic a member raises at a barrier when another member has panicked (so
/// that no member waits for ever); the caller re-raises the original panic instead.
struct Aborted;

/// State shared by the caller and the workers.
struct Shared {
    /// Bumped (under `job`'s lock) to start a job; workers compare it with the last they saw.
    epoch: AtomicU64,
    /// The current job with its epoch; `None` between jobs.
    job: Mutex<(u64, Option<Job>)>,
    /// Workers still running the current job.
    remaining: AtomicUsize,
    /// Idle workers park here; `parked` counts them (Dekker-style with `epoch`: see `start`).
    park: Mutex<()>,
    wake: Condvar,
    parked: AtomicUsize,
    /// A caller waiting for `remaining == 0` parks here once it has spun for [`SPIN`].
    done: Mutex<()>,
    done_cv: Condvar,
    caller_parked: AtomicBool,
    /// The first panic of a member during the current job, re-raised by the caller; `aborted`
    /// is set once it is recorded, and ends every barrier wait of the job.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    aborted: AtomicBool,
    /// The job's barrier: members arrived, and the generation (bumped by the last to arrive).
    arrived: AtomicUsize,
    generation: AtomicUsize,
    shutdown: AtomicBool,
}

/// Locks `m`, ignoring poisoning (no lock here is held across user code).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Spins until `ready()` or `spin` has passed; returns whether it became ready.
fn spin_until(spin: Duration, ready: impl Fn() -> bool) -> bool {
    let deadline = Instant::now() + spin;
    loop {
        for _ in 0..64 {
            if ready() {
                return true;
            }
            std::hint::spin_loop();
        }
        if Instant::now() >= deadline {
            return ready();
        }
        // Give the core away if another thread is waiting for it: a member that shares its
        // core with the one it waits for would otherwise hold that one off for the whole spin.
        std::thread::yield_now();
    }
}

/// A team of worker threads, the members of every job.
pub(crate) struct Team {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Held for the whole of one call: one job at a time.
    busy: Mutex<()>,
}

impl Team {
    /// Starts `size` workers; worker (member) `i` is named `name(i)` and runs `setup(i)` first
    /// (pinning).
    pub(crate) fn new(
        size: usize,
        name: impl Fn(usize) -> String,
        setup: impl Fn(usize) + Send + Sync + 'static,
    ) -> std::io::Result<Team> {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: Mutex::new((0, None)),
            remaining: AtomicUsize::new(0),
            park: Mutex::new(()),
            wake: Condvar::new(),
            parked: AtomicUsize::new(0),
            done: Mutex::new(()),
            done_cv: Condvar::new(),
            caller_parked: AtomicBool::new(false),
            panic: Mutex::new(None),
            aborted: AtomicBool::new(false),
            arrived: AtomicUsize::new(0),
            generation: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
        });
        let setup = Arc::new(setup);
        let mut team = Team {
            shared: shared.clone(),
            workers: Vec::with_capacity(size),
            busy: Mutex::new(()),
        };
        for i in 0..size {
            let (shared, setup) = (shared.clone(), setup.clone());
            let handle = std::thread::Builder::new().name(name(i)).spawn(move || {
                setup(i);
                worker(&shared, i);
            })?;
            team.workers.push(handle);
        }
        Ok(team)
    }

    /// Number of members (workers).
    pub(crate) fn size(&self) -> usize {
        self.workers.len()
    }

    /// Runs `f` on every member of the team and returns when all have returned. A panic in `f`
    /// ends the other members' barrier waits and is re-raised here once every member has
    /// stopped.
    pub(crate) fn run(&self, f: impl Fn(Member<'_>) + Sync) {
        let _busy = lock(&self.busy);
        let s = &*self.shared;
        let size = self.size();
        let job = |id: usize| {
            let r = catch_unwind(AssertUnwindSafe(|| {
                f(Member {
                    id,
                    size,
                    shared: s,
                })
            }));
            if let Err(p) = r {
                if !p.is::<Aborted>() {
                    lock(&s.panic).get_or_insert(p);
                }
                s.aborted.store(true, SeqCst);
            }
        };
        let job: &(dyn Fn(usize) + Sync) = &job;
        // SAFETY: the erased reference is used only by the workers, each of which calls it once
        // for this job and then decrements `remaining`; `finish` does not return before
        // `remaining` is 0, and it clears the job, so no worker reads the reference after `job`
        // and `f` die.
        let job: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(job) };
        self.start(job);
        self.finish();
        s.aborted.store(false, SeqCst);
        if let Some(p) = lock(&s.panic).take() {
            resume_unwind(p);
        }
    }

    /// Calls `f` once on each item, on the team's members (see [`Team::run`]); items go in
    /// order, each to the next member that is free.
    pub(crate) fn for_each<I: Send>(&self, items: Vec<I>, f: impl Fn(I) + Sync) {
        let queue = Mutex::new(items.into_iter());
        self.run(|_| loop {
            let Some(item) = lock(&queue).next() else {
                return;
            };
            f(item);
        });
    }

    /// Publishes `job` to the workers and wakes the parked ones.
    fn start(&self, job: Job) {
        let s = &*self.shared;
        s.remaining.store(self.workers.len(), SeqCst);
        s.arrived.store(0, SeqCst);
        {
            let mut j = lock(&s.job);
            let e = s.epoch.load(SeqCst) + 1;
            *j = (e, Some(job));
            s.epoch.store(e, SeqCst);
        }
        // A worker counts itself in `parked` before its last look at `epoch` (both SeqCst), so
        // either it sees the new epoch or this load sees it parked. The fence keeps the epoch's
        // store before this load where SeqCst accesses alone do not: QEMU's user-mode AArch64
        // on an x86 host lets the load pass the store-release (a lost wake-up: every thread
        // parked, seen as a hung test under QEMU); on hardware it costs one barrier per job.
        fence(SeqCst);
        if s.parked.load(SeqCst) > 0 {
            let _g = lock(&s.park);
            s.wake.notify_all();
        }
    }

    /// Waits until every worker taking part has finished, then clears the job.
    fn finish(&self) {
        let s = &*self.shared;
        let all_done = || s.remaining.load(SeqCst) == 0;
        if !spin_until(SPIN, all_done) {
            let mut g = lock(&s.done);
            s.caller_parked.store(true, SeqCst);
            // The same store-then-load as in `start`, against a worker's decrement of
            // `remaining` and its look at `caller_parked`.
            fence(SeqCst);
            while !all_done() {
                g = s.done_cv.wait(g).unwrap_or_else(|e| e.into_inner());
            }
            s.caller_parked.store(false, SeqCst);
        }
        lock(&s.job).1 = None;
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        let s = &*self.shared;
        s.shutdown.store(true, SeqCst);
        {
            let _j = lock(&s.job);
            s.epoch.fetch_add(1, SeqCst);
        }
        {
            let _g = lock(&s.park);
            s.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// The loop of the worker that is member `id`: wait for a new epoch (spin, then park), run the
/// job.
fn worker(s: &Shared, id: usize) {
    let mut seen = 0;
    loop {
        let new_epoch = || s.epoch.load(SeqCst) != seen;
        if !spin_until(SPIN, new_epoch) {
            let mut g = lock(&s.park);
            s.parked.fetch_add(1, SeqCst);
            while !new_epoch() {
                g = s.wake.wait(g).unwrap_or_else(|e| e.into_inner());
            }
            s.parked.fetch_sub(1, SeqCst);
        }
        if s.shutdown.load(SeqCst) {
            return;
        }
        let (epoch, job) = *lock(&s.job);
        seen = epoch;
        let Some(job) = job else {
            continue;
        };
        job(id);
        if s.remaining.fetch_sub(1, SeqCst) == 1 && s.caller_parked.load(SeqCst) {
            let _g = lock(&s.done);
            s.done_cv.notify_all();
        }
    }
}

/// One member's view of a running job.
pub(crate) struct Member<'a> {
    /// This member's index, `0..size`.
    pub id: usize,
    /// Number of members.
    pub size: usize,
    shared: &'a Shared,
}

impl Member<'_> {
    /// Waits until every member has called `barrier` as often as this one. Spins for [`SPIN`],
    /// then yields the core until the last member arrives (a barrier inside a GEMM is short, and
    /// yielding keeps oversubscribed runs, such as tests of several domains on two cores,
    /// moving). Panics (with a payload the caller discards) if another member has panicked.
    pub fn barrier(&self) {
        let s = self.shared;
        let generation = s.generation.load(SeqCst);
        if s.arrived.fetch_add(1, SeqCst) + 1 == self.size {
            s.arrived.store(0, SeqCst);
            s.generation.fetch_add(1, SeqCst);
            return;
        }
        let released = || s.generation.load(SeqCst) != generation || s.aborted.load(SeqCst);
        if !spin_until(SPIN, released) {
            while !released() {
                std::thread::yield_now();
            }
        }
        if s.generation.load(SeqCst) == generation {
            resume_unwind(Box::new(Aborted));
        }
    }

    /// This member's share of `0..len` (see [`split_range`]).
    pub fn share(&self, len: usize) -> std::ops::Range<usize> {
        split_range(len, self.size, self.id)
    }
}

/// Part `i` of `0..len` cut into `parts` nearly equal contiguous ranges, in order.
pub(crate) fn split_range(len: usize, parts: usize, i: usize) -> std::ops::Range<usize> {
    let (q, r) = (len / parts, len % parts);
    let start = i * q + i.min(r);
    start..start + q + usize::from(i < r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    fn team(size: usize) -> Team {
        Team::new(size, |i| format!("test-team-{i}"), |_| {}).unwrap()
    }

    #[test]
    fn every_item_runs_once() {
        for size in 1..=3 {
            let t = team(size);
            {
                for n in [0, 1, 2, 7, 100] {
                    let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                    t.for_each((0..n).collect(), |i| {
                        hits[i].fetch_add(1, SeqCst);
                    });
                    assert!(
                        hits.iter().all(|h| h.load(SeqCst) == 1),
                        "size {size} n {n}"
                    );
                }
            }
        }
    }

    #[test]
    fn items_may_borrow_mutably_and_disjointly() {
        let t = team(2);
        let mut data = vec![0u32; 64];
        let chunks: Vec<(usize, &mut [u32])> = data.chunks_mut(10).enumerate().collect();
        t.for_each(chunks, |(i, c)| c.fill(i as u32 + 1));
        let want: Vec<u32> = (0..64).map(|j| j / 10 + 1).collect();
        assert_eq!(data, want);
    }

    #[test]
    fn parked_workers_wake_for_the_next_job() {
        let t = team(2);
        let count = AtomicUsize::new(0);
        for _ in 0..3 {
            // Longer than SPIN: both workers park between the jobs.
            std::thread::sleep(SPIN * 4);
            t.for_each(vec![(); 8], |()| {
                count.fetch_add(1, SeqCst);
            });
        }
        assert_eq!(count.load(SeqCst), 24);
    }

    #[test]
    fn a_panic_in_an_item_reaches_the_caller_and_the_team_survives() {
        let t = team(2);
        for _ in 0..2 {
            let r = catch_unwind(AssertUnwindSafe(|| {
                t.for_each((0..10).collect(), |i: usize| {
                    assert_ne!(i, 5, "item five");
                })
            }));
            let msg = r.expect_err("the panic is re-raised");
            let text = msg.downcast_ref::<String>().cloned().unwrap_or_default();
            assert!(text.contains("item five"), "{text}");
            let count = AtomicUsize::new(0);
            t.for_each(vec![(); 5], |()| {
                count.fetch_add(1, SeqCst);
            });
            assert_eq!(count.load(SeqCst), 5);
        }
    }

    #[test]
    fn barriers_separate_phases() {
        for size in 1..=4 {
            let t = team(size);
            let count = AtomicUsize::new(0);
            t.run(|m| {
                assert_eq!(m.size, size);
                for phase in 1..=20 {
                    count.fetch_add(1, SeqCst);
                    m.barrier();
                    assert_eq!(count.load(SeqCst), phase * size, "member {}", m.id);
                    m.barrier();
                }
            });
        }
    }

    #[test]
    fn a_panic_before_a_barrier_releases_the_others() {
        let t = team(3);
        for _ in 0..2 {
            let r = catch_unwind(AssertUnwindSafe(|| {
                t.run(|m| {
                    m.barrier();
                    assert_ne!(m.id, 2, "member two gives up");
                    m.barrier();
                })
            }));
            let msg = r.expect_err("the panic is re-raised");
            let text = msg.downcast_ref::<String>().cloned().unwrap_or_default();
            assert!(text.contains("member two"), "{text}");
            let count = AtomicUsize::new(0);
            t.run(|m| {
                m.barrier();
                count.fetch_add(1, SeqCst);
            });
            assert_eq!(count.load(SeqCst), 3);
        }
    }

    #[test]
    fn shares_cover_in_order() {
        for len in 0..20 {
            for parts in 1..6 {
                let mut next = 0;
                for i in 0..parts {
                    let r = split_range(len, parts, i);
                    assert_eq!(r.start, next);
                    assert!(r.len() <= len / parts + 1);
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn concurrent_callers_take_turns() {
        let t = team(2);
        let count = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| {
                    for _ in 0..50 {
                        t.for_each(vec![(); 4], |()| {
                            count.fetch_add(1, SeqCst);
                        });
                    }
                });
            }
        });
        assert_eq!(count.load(SeqCst), 600);
    }
}
