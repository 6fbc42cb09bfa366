use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{bounded, unbounded, Receiver, Sender};

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

/// A set of reactors.
pub struct Engine {
    reactors: Vec<std::sync::Mutex<ReactorHandle>>,
    next_id: AtomicU64,
}

impl Engine {
    /// Starts one reactor per entry of `cpus`, pinned to it (`None`: not pinned).
    pub fn start(cpus: &[Option<usize>]) -> Result<Arc<Engine>, EngineError> {
        let mut reactors = Vec::new();
        for (index, cpu) in cpus.iter().copied().enumerate() {
            let (tx, rx) = unbounded();
            let pending = Arc::new(AtomicBool::new(false));
            let stats = Arc::new(ReactorStats::default());
            let (p2, s2) = (pending.clone(), stats.clone());
            let thread = std::thread::Builder::new()
                .name(format!("reactor{index}"))
                .spawn(move || run_reactor(index, cpu, rx, p2, s2))
                .map_err(EngineError::Spawn)?;
            reactors.push(std::sync::Mutex::new(ReactorHandle {
                tx,
                pending,
                stats,
                cpu,
                thread: Some(thread),
            }));
        }
        Ok(Arc::new(Engine {
            reactors,
            next_id: AtomicU64::new(1),
        }))
    }

    pub fn num_reactors(&self) -> usize {
        self.reactors.len()
    }

    /// The CPU reactor `i` is pinned to.
    pub fn cpu_of(&self, i: usize) -> Option<usize> {
        self.reactors.get(i).and_then(|r| lock(r).cpu)
    }

    pub fn stats(&self, i: usize) -> Option<Arc<ReactorStats>> {
        self.reactors.get(i).map(|r| lock(r).stats.clone())
    }

    fn send(&self, reactor: usize, msg: Msg) -> Result<(), EngineError> {
        let r = self
            .reactors
            .get(reactor)
            .ok_or(EngineError::NoSuchReactor(reactor, self.reactors.len()))?;
        let r = lock(r);
        r.tx.send(msg).map_err(|_| EngineError::Stopped(reactor))?;
        r.pending.store(true, Ordering::Release);
        Ok(())
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

    /// Stops all reactors and joins them; their pollers are dropped.
    pub fn shutdown(&self) {
        for r in &self.reactors {
            let mut r = lock(r);
            let _ = r.tx.send(Msg::Stop);
            r.pending.store(true, Ordering::Release);
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

fn run_reactor(
    index: usize,
    cpu: Option<usize>,
    rx: Receiver<Msg>,
    pending: Arc<AtomicBool>,
    stats: Arc<ReactorStats>,
) {
    ON_REACTOR.with(|c| c.set(true));
    if let Some(cpu) = cpu {
        pin(cpu);
    }
    let mut ctx = ReactorCtx { index };
    let mut pollers: Vec<(u64, Box<dyn Poller>)> = Vec::new();
    let (mut iters, mut busy, mut work) = (0u64, 0u64, 0u64);
    loop {
        if pending.load(Ordering::Acquire) || pollers.is_empty() {
            pending.store(false, Ordering::Relaxed);
            // With nothing to poll, sleep on the channel instead of spinning.
            let first = if pollers.is_empty() {
                rx.recv_timeout(Duration::from_millis(100)).ok()
            } else {
                None
            };
            for msg in first.into_iter().chain(rx.try_iter()) {
                match msg {
                    Msg::Add(id, p) => pollers.push((id, p)),
                    Msg::Remove(id, reply) => {
                        let p = pollers
                            .iter()
                            .position(|(i, _)| *i == id)
                            .map(|at| pollers.swap_remove(at).1);
                        let _ = reply.send(p);
                    }
                    Msg::Run(job) => job(&mut ctx),
                    Msg::Stop => return,
                }
            }
        }
        let mut done = 0;
        for (_, p) in pollers.iter_mut() {
            done += p.poll();
        }
        iters += 1;
        if done > 0 {
            busy += 1;
            work += done as u64;
        }
        if iters & 0xfff == 0 {
            stats.iterations.store(iters, Ordering::Relaxed);
            stats.busy_iterations.store(busy, Ordering::Relaxed);
            stats.work_items.store(work, Ordering::Relaxed);
            stats.cpu_ns.store(thread_cpu_ns(), Ordering::Relaxed);
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
}
