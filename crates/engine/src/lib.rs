//! The engine: reactor threads, one per configured CPU, each pinned and busy-polling
//! the [`Poller`]s it owns. A poller (an NVMe queue group, a virtqueue) belongs to
//! exactly one reactor, so its state needs no locks. Control work reaches reactors
//! as messages, applied between poll iterations.

mod cpus;
mod placement;
mod reactor;

pub use cpus::parse_cpu_list;
pub use placement::{Placement, Placer};
pub use reactor::{Engine, EngineError, PollerId, ReactorStats};

/// Something a reactor polls: one call does a bounded amount of work and says how
/// much (0 means it found nothing to do).
pub trait Poller: Send {
    fn poll(&mut self) -> usize;
}
