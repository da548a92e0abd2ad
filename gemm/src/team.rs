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
//! Two kinds of job. [`Team::run`] is SPMD, as in BLIS: every member runs the same closure
//! with its [`Member`] id and meets the others at [`Member::barrier`]. [`Team::run_items`] hands
//! out numbered items, each to the next member that asks, and returns as soon as every item has
//! run: a member whose core was taken by another process (a busy machine: the scheduler can
//! hold a woken thread off for a whole time slice) arrives to find the items taken and is not
//! waited for, so a late member costs its share of the work, not the whole call
//! (`docs/KERNELS.md`, "A busy machine"). One job runs at a time (`Team::run` holds a lock
//! for the call); jobs never call back into their own team.
//!
//! Waiting threads spin without `sched_yield`: on Linux's EEVDF scheduler a yield moves the
//! yielder's deadline back by a slice, so a thread that yields in a tight loop soon hands its
//! core to any runnable process, a `nice 19` one included, for a whole slice.

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

/// The job of one call, run by every member that enters it, with its id. The lifetime is
/// erased; see the SAFETY note in [`Team::launch`].
type Job = &'static (dyn Fn(usize) + Sync);

/// The payload of the panic a member raises at a barrier when another member has panicked (so
/// that no member waits for ever); the caller re-raises the original panic instead.
struct Aborted;

/// State shared by the caller and the workers.
struct Shared {
    /// Bumped (under `job`'s lock) to start a job; workers compare it with the last they saw.
    epoch: AtomicU64,
    /// The current job with its epoch; `None` between jobs and once the caller has closed it.
    /// A worker enters a job only under this lock, counting itself in `inside`.
    job: Mutex<(u64, Option<Job>)>,
    /// Workers that entered the current job and have not left it.
    inside: AtomicUsize,
    /// The job's progress (members finished for [`Team::run`], items run for
    /// [`Team::run_items`]) and the count that completes it.
    progress: AtomicUsize,
    target: AtomicUsize,
    /// Idle workers park here; `parked` counts them (Dekker-style with `epoch`: see `start`).
    park: Mutex<()>,
    wake: Condvar,
    parked: AtomicUsize,
    /// A caller waiting (for `progress`, then `inside`) parks here once it has spun for [`SPIN`].
    done: Mutex<()>,
    done_cv: Condvar,
    caller_parked: AtomicBool,
    /// The first panic of a member during the current job, re-raised by the caller; `aborted`
    /// is set once it is recorded, and ends every barrier wait and item loop of the job.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    aborted: AtomicBool,
    /// The job's barrier: members arrived, and the generation (bumped by the last to arrive).
    arrived: AtomicUsize,
    generation: AtomicUsize,
    shutdown: AtomicBool,
}

impl Shared {
    /// Wakes the caller if it parked waiting for the job's progress or for members to leave.
    fn poke_caller(&self) {
        if self.caller_parked.load(SeqCst) {
            let _g = lock(&self.done);
            self.done_cv.notify_all();
        }
    }

    /// Counts one unit of the job's progress.
    fn advance(&self) {
        if self.progress.fetch_add(1, SeqCst) + 1 == self.target.load(SeqCst) {
            self.poke_caller();
        }
    }

    /// Records a member's panic (not the [`Aborted`] echo of another's) and stops the job.
    fn record_panic(&self, p: Box<dyn Any + Send>) {
        if !p.is::<Aborted>() {
            lock(&self.panic).get_or_insert(p);
        }
        self.aborted.store(true, SeqCst);
        self.poke_caller();
    }
}

/// Locks `m`, ignoring poisoning (no lock here is held across user code).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Spins until `ready()` or `spin` has passed; returns whether it became ready. No
/// `sched_yield` inside (see the module notes).
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
            inside: AtomicUsize::new(0),
            progress: AtomicUsize::new(0),
            target: AtomicUsize::new(0),
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
        let s = &*self.shared;
        let size = self.size();
        let job = |id: usize| {
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| {
                f(Member {
                    id,
                    size,
                    shared: s,
                })
            })) {
                s.record_panic(p);
            }
            s.advance();
        };
        self.launch(size, &job);
    }

    /// Calls `f(member, item)` once for each item of `0..items`, each item on the next member
    /// that asks for one, in order; returns once every item has run, without waiting for
    /// members that had not started (see the module notes). `member` is the id of the member
    /// running the item (`0..size`), for state a member keeps between its items. A panic in `f`
    /// stops the handing out and is re-raised here.
    pub(crate) fn run_items(&self, items: usize, f: impl Fn(usize, usize) + Sync) {
        if items == 0 {
            return;
        }
        let s = &*self.shared;
        let next = AtomicUsize::new(0);
        let job = |id: usize| {
            let r = catch_unwind(AssertUnwindSafe(|| loop {
                let i = next.fetch_add(1, SeqCst);
                if i >= items || s.aborted.load(SeqCst) {
                    return;
                }
                f(id, i);
                s.advance();
            }));
            if let Err(p) = r {
                s.record_panic(p);
            }
        };
        self.launch(items, &job);
    }

    /// Calls `f` once on each item, on the team's members (see [`Team::run_items`]); items go
    /// in order, each to the next member that is free.
    pub(crate) fn for_each<I: Send>(&self, items: Vec<I>, f: impl Fn(I) + Sync) {
        let n = items.len();
        let slots: Vec<Mutex<Option<I>>> = items.into_iter().map(|i| Mutex::new(Some(i))).collect();
        self.run_items(n, |_, i| {
            if let Some(item) = lock(&slots[i]).take() {
                f(item);
            }
        });
    }

    /// Runs `job` on the members until `target` units of progress are counted (or a member
    /// panicked), closes it to late members, waits for those inside to leave, and re-raises
    /// the first panic.
    fn launch(&self, target: usize, job: &(dyn Fn(usize) + Sync)) {
        let _busy = lock(&self.busy);
        let s = &*self.shared;
        // SAFETY: the erased reference is called only by workers that entered the job under
        // `s.job`'s lock while it held this reference, and each counts itself in `inside`
        // until its call returns. Below, the job is cleared under that lock (no worker enters
        // after that) and this function does not return before `inside` is 0, so no worker
        // reads the reference after `job` dies.
        let job: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(job) };
        s.progress.store(0, SeqCst);
        s.target.store(target, SeqCst);
        self.start(job);
        self.wait(|| s.progress.load(SeqCst) >= target || s.aborted.load(SeqCst));
        lock(&s.job).1 = None;
        self.wait(|| s.inside.load(SeqCst) == 0);
        s.aborted.store(false, SeqCst);
        if let Some(p) = lock(&s.panic).take() {
            resume_unwind(p);
        }
    }

    /// Publishes `job` to the workers and wakes the parked ones.
    fn start(&self, job: Job) {
        let s = &*self.shared;
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

    /// The caller's wait until `ready()`: spin for [`SPIN`], then park until a worker's
    /// progress or exit pokes it.
    fn wait(&self, ready: impl Fn() -> bool) {
        let s = &*self.shared;
        if spin_until(SPIN, &ready) {
            return;
        }
        let mut g = lock(&s.done);
        s.caller_parked.store(true, SeqCst);
        // The same store-then-load as in `start`, against a worker's update and its look at
        // `caller_parked`.
        fence(SeqCst);
        while !ready() {
            g = s.done_cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        s.caller_parked.store(false, SeqCst);
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

/// The loop of the worker that is member `id`: wait for a new epoch (spin, then park), enter
/// the job if it is still open, run it, leave.
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
        let job = {
            let g = lock(&s.job);
            seen = g.0;
            if g.1.is_some() {
                s.inside.fetch_add(1, SeqCst);
            }
            g.1
        };
        let Some(job) = job else {
            continue;
        };
        job(id);
        if s.inside.fetch_sub(1, SeqCst) == 1 {
            s.poke_caller();
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

    /// A member that is held up (here: the one that took item 0 waits until every other
    /// item has run) does not hold up the rest: the others run all its would-be share. A
    /// static split would wait for ever; the wait gives up after ten seconds to fail instead.
    #[test]
    fn running_members_take_the_items_of_a_member_held_up() {
        for size in 2..=3 {
            let t = team(size);
            let ran = AtomicUsize::new(0);
            t.run_items(40, |_, i| {
                if i == 0 {
                    let deadline = Instant::now() + Duration::from_secs(10);
                    while ran.load(SeqCst) < 39 {
                        assert!(Instant::now() < deadline, "the other items never ran");
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
                ran.fetch_add(1, SeqCst);
            });
            assert_eq!(ran.load(SeqCst), 40, "size {size}");
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
