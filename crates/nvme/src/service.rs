//! One thread serves the admin housekeeping of every controller in the process:
//! it polls the admin doorbells of controllers whose client mapped the doorbell
//! page (their writes land silently in memory) and runs every controller's Keep
//! Alive Timer. Doorbells that arrive by message are handled on the thread that
//! received them (`Inner::write32`), so one controller's slow admin command does
//! not delay another's. With no mapped client the thread parks until the next
//! Keep Alive deadline or a kick.

use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::thread::Thread;
use std::time::{Duration, Instant};

use std::sync::atomic::Ordering;

use crate::ctrl::Inner;

struct Service {
    ctrls: Mutex<Vec<Weak<Inner>>>,
    thread: Thread,
}

static SERVICE: OnceLock<Service> = OnceLock::new();

/// First and longest sleep while polling mapped admin doorbells. Backing off from
/// 150 µs to 5 ms keeps an idle controller's wake-ups, which preempt busy-polling
/// reactors and initiators on a small host, at ~200/s instead of ~6700/s, while an
/// admin command after a long idle period waits at most 5 ms (drivers allow
/// seconds). Measured: disk QD1 added mean latency 13 µs → 1–7 µs (docs/benchmarks.md).
const IDLE_SLEEP: (Duration, Duration) = (Duration::from_micros(150), Duration::from_millis(5));

/// Longest park with nothing to poll (a safety net: every event that needs the
/// thread kicks it).
const PARK: Duration = Duration::from_secs(1);

/// Adds a controller (started on first use).
pub(crate) fn register(inner: &Arc<Inner>) -> std::io::Result<()> {
    let s = match SERVICE.get() {
        Some(s) => s,
        None => {
            // Two racing first registrations may both spawn; the loser's thread
            // finds no service of its own and exits.
            let t = sandbox::spawn(sandbox::Role::NvmeAdmin, "nvme-admin".into(), run)?;
            let _ = SERVICE.set(Service {
                ctrls: Mutex::new(Vec::new()),
                thread: t.thread().clone(),
            });
            SERVICE
                .get()
                .ok_or_else(|| std::io::Error::other("admin service missing"))?
        }
    };
    lock(&s.ctrls).push(Arc::downgrade(inner));
    s.thread.unpark();
    Ok(())
}

/// Makes the service look again (a client mapped its doorbells, a mode changed).
pub(crate) fn kick() {
    if let Some(s) = SERVICE.get() {
        s.thread.unpark();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// For a controller whose client's memory moves by messages: runs its admin pass on
/// a thread of the controller's if it has work. Returns 1 if it asked for one.
fn spawn_admin_pass(inner: &Arc<Inner>) -> usize {
    if !inner.admin_pending(&inner.lock()) || inner.admin_running.load(Ordering::Acquire) {
        return 0;
    }
    inner.admin_elsewhere();
    1
}

fn run() {
    // Wait until `register` published the service (a loser of a start race exits).
    let me = std::thread::current().id();
    let s = loop {
        match SERVICE.get() {
            Some(s) if s.thread.id() == me => break s,
            Some(_) => return,
            None => std::thread::park_timeout(Duration::from_millis(1)),
        }
    };
    let mut last_work = Instant::now();
    let mut idle_sleep = IDLE_SLEEP.0;
    loop {
        let ctrls: Vec<Arc<Inner>> = {
            let mut list = lock(&s.ctrls);
            list.retain(|w| w.strong_count() > 0);
            list.iter().filter_map(Weak::upgrade).collect()
        };
        let now = Instant::now();
        let (mut work, mut mapped, mut timer) = (0usize, false, None::<Instant>);
        for inner in &ctrls {
            if inner.stop.load(Ordering::Acquire) {
                continue;
            }
            let m = inner.shared.mapped.load(Ordering::Acquire);
            if m && inner.messages.load(Ordering::Acquire) {
                // Its admin pass may wait for the client's replies: never here,
                // where every controller's admin work runs.
                work += spawn_admin_pass(inner);
                if let Some(t) = inner.lock().keep_alive {
                    timer = Some(timer.map_or(t, |x| x.min(t)));
                }
                mapped = true;
                continue;
            }
            let mut st = inner.lock();
            if m || st.keep_alive.is_some_and(|t| now > t) {
                // Shared by every controller: never wait for one client here (its
                // read-only unshared memory, if any, fails such a command at once).
                let _no_waits = guest_mem::no_remote_waits();
                work += inner.admin_poll(&mut st);
            }
            if let Some(t) = st.keep_alive {
                timer = Some(timer.map_or(t, |x| x.min(t)));
            }
            mapped |= m;
        }
        drop(ctrls);
        if work > 0 {
            last_work = Instant::now();
            idle_sleep = IDLE_SLEEP.0;
        }
        let until_timer = timer.map_or(PARK, |t| {
            t.saturating_duration_since(Instant::now()) + Duration::from_millis(1)
        });
        if !mapped {
            std::thread::park_timeout(until_timer.min(PARK));
        } else if last_work.elapsed() < Duration::from_millis(2) {
            // A driver's init issues admin commands back to back.
            std::thread::yield_now();
        } else {
            std::thread::park_timeout(idle_sleep.min(until_timer));
            idle_sleep = (idle_sleep * 2).min(IDLE_SLEEP.1);
        }
    }
}
