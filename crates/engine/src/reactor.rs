use std::cell::Cell;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, unbounded, Receiver, Sender};
use nix::poll::{PollFd, PollFlags};
use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::time::TimeSpec;
use smallvec::SmallVec;

use crate::Poller;

/// Identifies a poller on its reactor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PollerId {
    pub reactor: usize,
    id: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("reactor {0} does not exist (the engine has {1})")]
    NoSuchReactor(usize, usize),
    #[error("reactor {0} has stopped")]
    Stopped(usize),
    #[error("a reactor thread cannot wait on a reactor")]
    OnReactor,
    #[error("cannot start reactor thread: {0}")]
    Spawn(std::io::Error),
}

type Job = Box<dyn FnOnce(&mut ReactorCtx) + Send>;

enum Msg {
    Add(u64, Box<dyn Poller>),
    Remove(u64, Sender<Option<Box<dyn Poller>>>),
    Run(Job),
    Stop,
}

/// Counters a reactor publishes (relaxed, refreshed every few thousand iterations).
#[derive(Debug, Default)]
pub struct ReactorStats {
    pub iterations: AtomicU64,
    pub busy_iterations: AtomicU64,
    pub work_items: AtomicU64,
    /// CPU time of the reactor thread (CLOCK_THREAD_CPUTIME_ID), in ns.
    pub cpu_ns: AtomicU64,
    /// Sleeps the reactor began because every poller agreed (counted as each
    /// begins).
    pub sleeps: AtomicU64,
    /// Sleeps that lasted the longest allowed time (500 ms) without a wake-up:
    /// normal for an idle reactor; under load, the sign of a lost wake-up.
    pub sleep_timeouts: AtomicU64,
}

/// CPU time this thread has used. A syscall, so the reactor reads it only when it
/// publishes its counters.
fn thread_cpu_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID)
        .map(|t| (t.tv_sec() as u64).saturating_mul(1_000_000_000) + t.tv_nsec() as u64)
        .unwrap_or(0)
}

struct ReactorHandle {
    tx: Sender<Msg>,
    pending: Arc<AtomicBool>,
    sleeping: Arc<AtomicBool>,
    bell: Arc<EventFd>,
    stats: Arc<ReactorStats>,
    cpu: Option<usize>,
    thread: Option<JoinHandle<()>>,
}

/// What jobs sent with [`Engine::run_on`] can touch on the reactor.
pub struct ReactorCtx {
    pub index: usize,
}

thread_local! {
    static ON_REACTOR: Cell<bool> = const { Cell::new(false) };
}

/// Wakes a sleeping reactor (see [`crate::Poller::prepare_sleep`]). Cheap when the
/// reactor is awake: one atomic swap, no message.
#[derive(Clone)]
pub struct Waker {
    sleeping: Arc<AtomicBool>,
    bell: Arc<EventFd>,
}

impl Waker {
    pub fn wake(&self) {
        if self.sleeping.swap(false, Ordering::SeqCst) {
            ring(&self.bell);
        }
    }
}

/// Makes the reactor's eventfd readable (ends a sleep in `poll`). The counter cannot
/// overflow: the reactor drains it after every sleep.
fn ring(bell: &EventFd) {
    let _ = bell.write(1);
}

fn new_bell() -> std::io::Result<EventFd> {
    EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)
        .map_err(std::io::Error::from)
}

/// A set of reactors. It can grow ([`Engine::add_reactor`]) for devices that want
/// reactors of their own; such a reactor may be stopped again
/// ([`Engine::stop_reactor`]), which frees its slot for the next one.
pub struct Engine {
    /// `None`: a stopped reactor's slot.
    reactors: RwLock<Vec<std::sync::Mutex<Option<ReactorHandle>>>>,
    next_id: AtomicU64,
}

impl Engine {
    /// Starts one reactor per entry of `cpus`, pinned to it (`None`: not pinned).
    pub fn start(cpus: &[Option<usize>]) -> Result<Arc<Engine>, EngineError> {
        let engine = Engine {
            reactors: RwLock::new(Vec::new()),
            next_id: AtomicU64::new(1),
        };
        for cpu in cpus {
            engine.add_reactor(*cpu)?;
        }
        Ok(Arc::new(engine))
    }

    /// Starts one more reactor, pinned to `cpu`, and returns its index.
    pub fn add_reactor(&self, cpu: Option<usize>) -> Result<usize, EngineError> {
        let mut reactors = self.reactors.write().unwrap_or_else(|e| e.into_inner());
        let free = reactors.iter().position(|r| lock(r).is_none());
        let index = free.unwrap_or(reactors.len());
        let (tx, rx) = unbounded();
        let pending = Arc::new(AtomicBool::new(false));
        let sleeping = Arc::new(AtomicBool::new(false));
        let bell = Arc::new(new_bell().map_err(EngineError::Spawn)?);
        let stats = Arc::new(ReactorStats::default());
        let shared = Shared {
            pending: pending.clone(),
            sleeping: sleeping.clone(),
            bell: bell.clone(),
            stats: stats.clone(),
        };
        let thread = sandbox::spawn(
            sandbox::Role::Reactor,
            format!("reactor{index}"),
            move || run_reactor(index, cpu, rx, shared),
        )
        .map_err(EngineError::Spawn)?;
        let handle = ReactorHandle {
            tx,
            pending,
            sleeping,
            bell,
            stats,
            cpu,
            thread: Some(thread),
        };
        match free {
            Some(i) => *lock(&reactors[i]) = Some(handle),
            None => reactors.push(std::sync::Mutex::new(Some(handle))),
        }
        Ok(index)
    }

    fn with<R>(&self, i: usize, f: impl FnOnce(&ReactorHandle) -> R) -> Option<R> {
        let reactors = self.reactors.read().unwrap_or_else(|e| e.into_inner());
        reactors.get(i).and_then(|r| lock(r).as_ref().map(f))
    }

    pub fn num_reactors(&self) -> usize {
        self.reactors
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    /// The CPU reactor `i` is pinned to.
    pub fn cpu_of(&self, i: usize) -> Option<usize> {
        self.with(i, |r| r.cpu).flatten()
    }

    pub fn stats(&self, i: usize) -> Option<Arc<ReactorStats>> {
        self.with(i, |r| r.stats.clone())
    }

    /// A handle that wakes reactor `i` when it sleeps.
    pub fn waker(&self, i: usize) -> Option<Waker> {
        self.with(i, |r| Waker {
            sleeping: r.sleeping.clone(),
            bell: r.bell.clone(),
        })
    }

    fn send(&self, reactor: usize, msg: Msg) -> Result<(), EngineError> {
        let n = self.num_reactors();
        self.with(reactor, |r| {
            r.tx.send(msg).map_err(|_| EngineError::Stopped(reactor))?;
            r.pending.store(true, Ordering::Release);
            // A reactor with no pollers waits on its bell without announcing a sleep.
            r.sleeping.store(false, Ordering::SeqCst);
            ring(&r.bell);
            Ok(())
        })
        .unwrap_or(Err(EngineError::NoSuchReactor(reactor, n)))
    }

    /// Hands `poller` to `reactor`; it starts being polled at the next iteration.
    pub fn add_poller(
        &self,
        reactor: usize,
        poller: Box<dyn Poller>,
    ) -> Result<PollerId, EngineError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.send(reactor, Msg::Add(id, poller))?;
        Ok(PollerId { reactor, id })
    }

    /// Takes a poller back; returns once the reactor no longer polls it. Must not be
    /// called from a reactor thread (it would wait on itself).
    pub fn remove_poller(&self, id: PollerId) -> Result<Option<Box<dyn Poller>>, EngineError> {
        if ON_REACTOR.with(Cell::get) {
            return Err(EngineError::OnReactor);
        }
        let (tx, rx) = bounded(1);
        self.send(id.reactor, Msg::Remove(id.id, tx))?;
        rx.recv().map_err(|_| EngineError::Stopped(id.reactor))
    }

    /// Runs `f` on `reactor` between poll iterations and returns its result.
    pub fn run_on<R: Send + 'static>(
        &self,
        reactor: usize,
        f: impl FnOnce(&mut ReactorCtx) -> R + Send + 'static,
    ) -> Result<R, EngineError> {
        if ON_REACTOR.with(Cell::get) {
            return Err(EngineError::OnReactor);
        }
        let (tx, rx) = bounded(1);
        self.send(
            reactor,
            Msg::Run(Box::new(move |ctx| {
                let _ = tx.send(f(ctx));
            })),
        )?;
        rx.recv().map_err(|_| EngineError::Stopped(reactor))
    }

    /// Stops reactor `i`, joins it and frees its slot (its thread, its eventfd);
    /// its pollers are dropped. For a device that had a reactor of its own and no
    /// longer needs it: nobody may hold a [`PollerId`] or use the index of it any
    /// more, since the next [`Engine::add_reactor`] reuses the slot.
    pub fn stop_reactor(&self, i: usize) {
        if ON_REACTOR.with(Cell::get) {
            return;
        }
        let reactors = self.reactors.read().unwrap_or_else(|e| e.into_inner());
        let Some(slot) = reactors.get(i) else { return };
        let Some(mut r) = lock(slot).take() else {
            return;
        };
        let _ = r.tx.send(Msg::Stop);
        r.pending.store(true, Ordering::Release);
        ring(&r.bell);
        if let Some(t) = r.thread.take() {
            let _ = t.join();
        }
    }

    /// Stops all reactors and joins them; their pollers are dropped.
    pub fn shutdown(&self) {
        let reactors = self.reactors.read().unwrap_or_else(|e| e.into_inner());
        for slot in reactors.iter() {
            let mut guard = lock(slot);
            let Some(r) = guard.as_mut() else { continue };
            let _ = r.tx.send(Msg::Stop);
            r.pending.store(true, Ordering::Release);
            ring(&r.bell);
            if let Some(t) = r.thread.take() {
                let _ = t.join();
            }
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn pin(cpu: usize) {
    let mut set = nix::sched::CpuSet::new();
    if set.set(cpu).is_err()
        || nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).is_err()
    {
        tracing::warn!(cpu, "cannot pin reactor to CPU; running unpinned");
    }
}

struct Shared {
    pending: Arc<AtomicBool>,
    sleeping: Arc<AtomicBool>,
    bell: Arc<EventFd>,
    stats: Arc<ReactorStats>,
}

type Pollers = Vec<(u64, Box<dyn Poller>)>;

/// Applies one control message; false on Stop.
fn handle(msg: Msg, pollers: &mut Pollers, ctx: &mut ReactorCtx) -> bool {
    match msg {
        Msg::Add(id, p) => pollers.push((id, p)),
        Msg::Remove(id, reply) => {
            let p = pollers
                .iter()
                .position(|(i, _)| *i == id)
                .map(|at| pollers.swap_remove(at).1);
            let _ = reply.send(p);
        }
        Msg::Run(job) => job(ctx),
        Msg::Stop => return false,
    }
    true
}

/// The spin time after which every poller lets the reactor sleep, if they all do.
fn sleep_after(pollers: &Pollers) -> Option<Duration> {
    pollers.iter().try_fold(Duration::ZERO, |acc, (_, p)| {
        p.sleep_after().map(|d| acc.max(d))
    })
}

/// Idle iterations between clock reads while spinning before a sleep.
const CLOCK_EVERY: u32 = 64;

/// How long one sleep lasts at most; pollers re-arm after it.
#[cfg(not(test))]
const MAX_SLEEP: Duration = Duration::from_millis(500);
/// Longer than any test waits: a test passes only if the wake-up it checks works.
#[cfg(test)]
const MAX_SLEEP: Duration = Duration::from_secs(60);

/// Sleeps until the bell rings, one of the pollers' wake fds becomes readable,
/// `timeout` passes or the earliest of the pollers' `wake_by` comes; then empties
/// the bell. True if the time ran out.
fn sleep(bell: &EventFd, pollers: &Pollers, timeout: Duration) -> bool {
    let mut fds: SmallVec<[PollFd<'_>; 8]> = SmallVec::new();
    fds.push(PollFd::new(bell.as_fd(), PollFlags::POLLIN));
    let mut by: Option<Instant> = None;
    for (_, p) in pollers {
        p.wake_fds(&mut |fd| fds.push(PollFd::new(fd, PollFlags::POLLIN)));
        by = by.into_iter().chain(p.wake_by()).min();
    }
    // The clock is read only when a poller set a deadline (coalescing's aggregation
    // time is in units of 100 µs, so ppoll's precision and not poll's milliseconds).
    let timeout = by.map_or(timeout, |t| {
        timeout.min(t.saturating_duration_since(Instant::now()))
    });
    let timed_out = matches!(
        nix::poll::ppoll(&mut fds, Some(TimeSpec::from_duration(timeout)), None),
        Ok(0)
    );
    // Most wake-ups come from a backend's notifier: a read of a silent bell would
    // be a wasted syscall per sleep. A ring that lands after the poll returned is
    // drained after the next one (which it ends at once).
    let rung = fds[0]
        .revents()
        .is_some_and(|r| r.contains(PollFlags::POLLIN));
    if rung {
        let _ = bell.read();
    }
    timed_out
}

fn run_reactor(index: usize, cpu: Option<usize>, rx: Receiver<Msg>, sh: Shared) {
    ON_REACTOR.with(|c| c.set(true));
    if let Some(cpu) = cpu {
        pin(cpu);
    }
    let mut ctx = ReactorCtx { index };
    let mut pollers: Pollers = Vec::new();
    let (mut iters, mut busy, mut work, mut sleeps) = (0u64, 0u64, 0u64, 0u64);
    // Some(spin) when every poller may sleep; refreshed on messages and now and then
    // (pollers may change their mode), so busy-only reactors pay nothing per iteration.
    let mut spin: Option<Duration> = None;
    let mut idle_since: Option<Instant> = None;
    let mut idle_iters = 0u32;
    loop {
        if sh.pending.load(Ordering::Acquire) || pollers.is_empty() {
            sh.pending.store(false, Ordering::Relaxed);
            // With nothing to poll, sleep on the bell instead of spinning.
            if pollers.is_empty() && rx.is_empty() {
                let _ = sleep(&sh.bell, &pollers, Duration::from_millis(100));
            }
            for msg in rx.try_iter() {
                if !handle(msg, &mut pollers, &mut ctx) {
                    return;
                }
            }
            spin = sleep_after(&pollers);
        }
        let mut done = 0;
        for (_, p) in pollers.iter_mut() {
            done += p.poll();
        }
        iters += 1;
        if done > 0 {
            busy += 1;
            work += done as u64;
            idle_since = None;
        } else if let Some(spin_for) = spin.filter(|_| !pollers.is_empty()) {
            idle_iters = idle_iters.wrapping_add(1);
            // The clock is read every CLOCK_EVERY idle iterations (each read
            // delays noticing new work by a vDSO call), at once in event mode. Not
            // on the first idle iteration after work: at QD1 that is one read per
            // request, right when the next one arrives. The idle time is counted from
            // the first read, so a sleep comes at most CLOCK_EVERY iterations later.
            let check = spin_for.is_zero() || idle_iters.is_multiple_of(CLOCK_EVERY);
            let now = if check { Some(Instant::now()) } else { None };
            let since = now.map(|n| *idle_since.get_or_insert(n));
            if let (Some(now), Some(since)) = (now, since) {
                if now.duration_since(since) >= spin_for {
                    // Announce the sleep before the pollers re-check their rings, so a
                    // kick that lands after the check finds `sleeping` set and sends Wake.
                    sh.sleeping.store(true, Ordering::SeqCst);
                    let mut all = true;
                    for (_, p) in pollers.iter_mut() {
                        all &= p.prepare_sleep();
                    }
                    if all && !sh.pending.load(Ordering::Acquire) {
                        sleeps += 1;
                        sh.stats.sleeps.store(sleeps, Ordering::Relaxed);
                        if sleep(&sh.bell, &pollers, MAX_SLEEP) {
                            sh.stats.sleep_timeouts.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    sh.sleeping.store(false, Ordering::SeqCst);
                    idle_since = None;
                    // What the pollers wait for changed while we slept (a queue
                    // that was deep may be shallow now: engine::adaptive_spin).
                    spin = sleep_after(&pollers);
                }
            }
        }
        if iters & 0xfff == 0 {
            sh.stats.iterations.store(iters, Ordering::Relaxed);
            sh.stats.busy_iterations.store(busy, Ordering::Relaxed);
            sh.stats.work_items.store(work, Ordering::Relaxed);
            sh.stats.cpu_ns.store(thread_cpu_ns(), Ordering::Relaxed);
            spin = sleep_after(&pollers);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    struct Count(Arc<AtomicUsize>);
    impl Poller for Count {
        fn poll(&mut self) -> usize {
            self.0.fetch_add(1, Ordering::Relaxed);
            0
        }
    }

    #[test]
    fn add_poll_remove() {
        let e = Engine::start(&[None, None]).unwrap();
        let n = Arc::new(AtomicUsize::new(0));
        let id = e.add_poller(1, Box::new(Count(n.clone()))).unwrap();
        while n.load(Ordering::Relaxed) < 1000 {
            std::thread::yield_now();
        }
        assert!(e.remove_poller(id).unwrap().is_some());
        let before = n.load(Ordering::Relaxed);
        assert_eq!(e.run_on(1, |ctx| ctx.index).unwrap(), 1);
        assert_eq!(
            n.load(Ordering::Relaxed),
            before,
            "no polling after removal"
        );
        assert!(e.remove_poller(id).unwrap().is_none());
        assert!(matches!(
            e.add_poller(5, Box::new(Count(n))),
            Err(EngineError::NoSuchReactor(5, 2))
        ));
        e.shutdown();
    }

    #[test]
    fn a_stopped_reactor_frees_its_slot() {
        let e = Engine::start(&[None]).unwrap();
        let r = e.add_reactor(None).unwrap();
        let n = Arc::new(AtomicUsize::new(0));
        let id = e.add_poller(r, Box::new(Count(n.clone()))).unwrap();
        e.stop_reactor(r);
        assert!(e.stats(r).is_none() && e.waker(r).is_none());
        assert!(matches!(
            e.remove_poller(id),
            Err(EngineError::NoSuchReactor(..))
        ));
        assert_eq!(e.add_reactor(None).unwrap(), r, "slot reused");
        assert_eq!(e.num_reactors(), 2);
        assert_eq!(e.run_on(r, |ctx| ctx.index).unwrap(), r);
        e.shutdown();
    }

    struct Sleepy {
        polls: Arc<AtomicUsize>,
        armed: Arc<AtomicUsize>,
        work: Arc<AtomicUsize>,
    }
    impl Poller for Sleepy {
        fn poll(&mut self) -> usize {
            self.polls.fetch_add(1, Ordering::SeqCst);
            self.work.swap(0, Ordering::SeqCst)
        }
        fn sleep_after(&self) -> Option<Duration> {
            Some(Duration::ZERO)
        }
        fn prepare_sleep(&mut self) -> bool {
            self.armed.fetch_add(1, Ordering::SeqCst);
            self.work.load(Ordering::SeqCst) == 0
        }
    }

    fn wait_for(what: &str, f: impl Fn() -> bool) {
        let ok = crate::wait_until(Duration::from_secs(10), Duration::from_millis(1), f);
        assert!(ok, "{what}");
    }

    #[test]
    fn idle_pollers_sleep_until_woken() {
        let e = Engine::start(&[]).unwrap();
        let r = e.add_reactor(None).unwrap();
        assert_eq!(e.num_reactors(), 1);
        let (polls, armed, work) = (
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicUsize::new(0)),
        );
        let p = Sleepy {
            polls: polls.clone(),
            armed: armed.clone(),
            work: work.clone(),
        };
        e.add_poller(r, Box::new(p)).unwrap();
        wait_for("reactor never went to sleep", || {
            armed.load(Ordering::SeqCst) > 0
        });
        std::thread::sleep(Duration::from_millis(50));
        let before = polls.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(50));
        // Asleep: at most the odd periodic re-arm, not a spinning loop.
        assert!(
            polls.load(Ordering::SeqCst) - before < 10,
            "reactor spins while idle"
        );
        work.store(1, Ordering::SeqCst);
        e.waker(r).unwrap().wake();
        wait_for("wake did not reach the poller", || {
            work.load(Ordering::SeqCst) == 0
        });
        e.shutdown();
    }

    /// Sleeps whenever idle; wakes on its own eventfd (a backend's completions).
    struct FdWaiter {
        fd: Arc<EventFd>,
        seen: Arc<AtomicUsize>,
    }
    impl Poller for FdWaiter {
        fn poll(&mut self) -> usize {
            match self.fd.read() {
                Ok(n) => {
                    self.seen.fetch_add(n as usize, Ordering::SeqCst);
                    1
                }
                Err(_) => 0,
            }
        }
        fn sleep_after(&self) -> Option<Duration> {
            Some(Duration::ZERO)
        }
        fn prepare_sleep(&mut self) -> bool {
            true
        }
        fn wake_fds<'a>(&'a self, add: &mut dyn FnMut(std::os::fd::BorrowedFd<'a>)) {
            add(self.fd.as_fd());
        }
    }

    /// One reactor whose only poller sleeps on `fd`; `seen` counts what it read.
    fn fd_waiter() -> (Arc<Engine>, Arc<EventFd>, Arc<AtomicUsize>) {
        let e = Engine::start(&[None]).unwrap();
        let fd = Arc::new(new_bell().unwrap());
        let seen = Arc::new(AtomicUsize::new(0));
        let p = FdWaiter {
            fd: fd.clone(),
            seen: seen.clone(),
        };
        e.add_poller(0, Box::new(p)).unwrap();
        (e, fd, seen)
    }

    /// Wake-ups from the bell and from a poller's fd, in any order, leave nothing
    /// readable behind: afterwards the idle reactor sleeps instead of spinning.
    #[test]
    fn mixed_wakes_leave_the_reactor_asleep() {
        let (e, fd, seen) = fd_waiter();
        let stats = e.stats(0).unwrap();
        let waker = e.waker(0).unwrap();
        for i in 1..=10u64 {
            wait_for("reactor never slept", || {
                stats.sleeps.load(Ordering::Relaxed) >= i
            });
            if i % 2 == 0 {
                waker.wake();
            }
            fd.write(1).unwrap();
            wait_for("completion fd did not wake the reactor", || {
                seen.load(Ordering::SeqCst) as u64 == i
            });
        }
        wait_for("reactor did not sleep again", || {
            stats.sleeps.load(Ordering::Relaxed) > 10
        });
        let settled = stats.sleeps.load(Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(100));
        // A readable bell or fd would end every sleep at once (thousands here).
        assert!(
            stats.sleeps.load(Ordering::Relaxed) <= settled + 2,
            "idle reactor keeps waking: {} sleeps after {settled}",
            stats.sleeps.load(Ordering::Relaxed)
        );
        e.shutdown();
    }

    /// Sets itself a deadline on its first poll (an interrupt held for
    /// coalescing) and counts the polls that find it passed.
    struct Deadline {
        due: Option<Instant>,
        set: bool,
        fired: Arc<AtomicUsize>,
    }
    impl Poller for Deadline {
        fn poll(&mut self) -> usize {
            if !self.set {
                self.set = true;
                self.due = Some(Instant::now() + Duration::from_millis(20));
            }
            match self.due {
                Some(t) if Instant::now() >= t => {
                    self.due = None;
                    self.fired.fetch_add(1, Ordering::SeqCst);
                    1
                }
                _ => 0,
            }
        }
        fn sleep_after(&self) -> Option<Duration> {
            Some(Duration::ZERO)
        }
        fn prepare_sleep(&mut self) -> bool {
            true
        }
        fn wake_by(&self) -> Option<Instant> {
            self.due
        }
    }

    /// Nothing but the time wakes this reactor (its sleeps last up to MAX_SLEEP, a
    /// minute in tests): the poller's `wake_by` must end the sleep.
    #[test]
    fn a_pollers_deadline_ends_the_sleep() {
        let e = Engine::start(&[None]).unwrap();
        let fired = Arc::new(AtomicUsize::new(0));
        let p = Deadline {
            due: None,
            set: false,
            fired: fired.clone(),
        };
        e.add_poller(0, Box::new(p)).unwrap();
        let stats = e.stats(0).unwrap();
        wait_for("the deadline did not wake the reactor", || {
            fired.load(Ordering::SeqCst) == 1
        });
        assert!(stats.sleeps.load(Ordering::Relaxed) >= 1, "it never slept");
        // Past its deadline the poller sets none: the reactor sleeps again, no spin.
        wait_for("reactor did not sleep again", || {
            stats.sleeps.load(Ordering::Relaxed) >= 2
        });
        let settled = stats.sleeps.load(Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(50));
        assert!(stats.sleeps.load(Ordering::Relaxed) <= settled + 1);
        e.shutdown();
    }

    #[test]
    fn a_sleeping_reactor_wakes_on_a_pollers_fd() {
        let (e, fd, seen) = fd_waiter();
        let stats = e.stats(0).unwrap();
        wait_for("reactor never slept", || {
            stats.sleeps.load(Ordering::Relaxed) > 0
        });
        for i in 1..=20u64 {
            fd.write(1).unwrap();
            wait_for("completion fd did not wake the reactor", || {
                seen.load(Ordering::SeqCst) as u64 == i
            });
        }
        e.shutdown();
    }
}
