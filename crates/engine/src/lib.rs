//! The engine: reactor threads, one per configured CPU, each pinned and busy-polling
//! the [`Poller`]s it owns. A poller (an NVMe queue group, a virtqueue) belongs to
//! exactly one reactor, so its state needs no locks. Control work reaches reactors
//! as messages, applied between poll iterations.

#![forbid(unsafe_code)]

mod cpus;
mod placement;
mod reactor;
mod wait;

pub use cpus::{allowed_cpus, check_allowed, format_cpu_list, parse_cpu_list};
pub use placement::{
    adaptive_spin, defers_doorbells, AtomicPollMode, Placement, Placer, PollMode, DEEP_QUEUE,
    DEEP_SPIN, DEFER_QUEUE,
};
pub use reactor::{Engine, EngineError, PollerId, ReactorStats, Waker};
pub use wait::wait_until;

use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

/// Something a reactor polls: one call does a bounded amount of work and says how
/// much (0 means it found nothing to do).
pub trait Poller: Send {
    fn poll(&mut self) -> usize;

    /// How long the reactor should keep spinning after its last work before this
    /// poller lets it sleep; `None` (the default) means never: busy polling. A
    /// reactor sleeps only when every poller it owns agrees.
    fn sleep_after(&self) -> Option<Duration> {
        None
    }

    /// Called just before the reactor sleeps: arm whatever wakes it (enable guest
    /// notifications that end in [`Waker::wake`]) and return `false` if work turned
    /// up meanwhile, which cancels the sleep.
    fn prepare_sleep(&mut self) -> bool {
        false
    }

    /// File descriptors whose readability ends the reactor's sleep, besides its own
    /// waker (e.g. a backend's completion eventfd while requests are in flight).
    /// Asked after every poller agreed to sleep.
    fn wake_fds<'a>(&'a self, _add: &mut dyn FnMut(BorrowedFd<'a>)) {}

    /// The latest instant this poller lets the reactor sleep until, when something
    /// falls due without any fd becoming readable (an interrupt held back for
    /// coalescing); `None` (the default): no limit. Asked after every poller agreed
    /// to sleep; the reactor polls again once it passed.
    fn wake_by(&self) -> Option<Instant> {
        None
    }
}
