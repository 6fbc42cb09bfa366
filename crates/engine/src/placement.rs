use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};

/// How a device's queues are spread over reactors.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Placement {
    /// Queue i goes to reactor (start + i) mod N.
    #[default]
    RoundRobin,
    /// Every queue of the device on one reactor: the classic single-thread baseline.
    Single,
    /// One reactor of its own per queue (per guest vCPU), pinned. The engine grows
    /// reactors for it ([`crate::Engine::add_reactor`]); only device kinds that
    /// create their reactors support it.
    Dedicated,
}

impl Placement {
    /// The name the CLI, the config file and the RPC use.
    pub fn as_str(self) -> &'static str {
        match self {
            Placement::RoundRobin => "round-robin",
            Placement::Single => "single",
            Placement::Dedicated => "dedicated",
        }
    }
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Placement {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "round-robin" => Ok(Placement::RoundRobin),
            "single" => Ok(Placement::Single),
            "dedicated" => Ok(Placement::Dedicated),
            _ => Err(format!(
                "unknown placement `{s}` (expected dedicated, round-robin or single)"
            )),
        }
    }
}

/// Picks reactors for one device's queues according to a policy.
#[derive(Debug)]
pub struct Placer {
    policy: Placement,
    start: usize,
    reactors: usize,
    next: AtomicUsize,
}

impl Placer {
    pub fn new(policy: Placement, start: usize, reactors: usize) -> Self {
        Placer {
            policy,
            start,
            reactors: reactors.max(1),
            next: AtomicUsize::new(0),
        }
    }

    /// Reactor for queue `qid` (1-based for I/O queues; 0 is fine too).
    pub fn reactor_for(&self, qid: usize) -> usize {
        match self.policy {
            Placement::Single => self.start % self.reactors,
            // Callers that support Dedicated give the Placer only the reactors they
            // created for the device, one per queue.
            Placement::RoundRobin | Placement::Dedicated => (self.start + qid) % self.reactors,
        }
    }

    /// Next reactor in turn, for callers without a queue number.
    pub fn next(&self) -> usize {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        self.reactor_for(i)
    }
}

/// How a poller waits for work.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PollMode {
    /// Spin all the time: lowest latency, one core per reactor.
    Busy,
    /// Spin for a while after the last work, then sleep until kicked. The default:
    /// as fast as busy under load (README, "Poll modes"), nearly free when idle.
    #[default]
    Adaptive,
    /// Sleep whenever idle.
    Event,
}

/// Requests in flight, all on channels with slow completions, from which an
/// adaptive poller stops spinning through their round trips: with a queue this deep
/// the next completion is never the only thing a guest waits for, and a wake-up per
/// completion costs less CPU than the spin (docs/decisions/0026-deep-queue-naps.md).
pub const DEEP_QUEUE: usize = 4;
/// How long such a poller spins after its last work before it may sleep: long
/// enough to catch the driver's next doorbell after a completion in shared memory.
pub const DEEP_SPIN: std::time::Duration = std::time::Duration::from_micros(30);

/// Requests in flight, all on channels with slow completions, from which a poller
/// that can tell its driver not to ring (NVMe shadow doorbells with EventIdx) sleeps
/// without asking for doorbells and without spinning: the next completion wakes it
/// and it fetches what the driver queued meanwhile. A new command then waits for the
/// next completion (about the round trip ÷ depth), and each one saves a doorbell
/// message and a wake-up (docs/decisions/0029-deferred-doorbells.md).
pub const DEFER_QUEUE: usize = 8;

/// Whether `in_flight` requests that `all_slow` let a poller defer doorbells
/// ([`DEFER_QUEUE`]).
pub fn defers_doorbells(in_flight: usize, all_slow: bool) -> bool {
    in_flight >= DEFER_QUEUE && all_slow
}

/// The spin of a poller whose mode asks for `spin`, with `in_flight` requests that
/// `all_slow` (every one on a channel with slow completions): shortened to
/// [`DEEP_SPIN`] while the queue is at least [`DEEP_QUEUE`] deep.
pub fn adaptive_spin(
    spin: std::time::Duration,
    in_flight: usize,
    all_slow: bool,
) -> std::time::Duration {
    if in_flight >= DEEP_QUEUE && all_slow && spin > DEEP_SPIN {
        DEEP_SPIN
    } else {
        spin
    }
}

impl PollMode {
    /// Spin time after the last work for [`crate::Poller::sleep_after`].
    pub fn sleep_after(self) -> Option<std::time::Duration> {
        match self {
            PollMode::Busy => None,
            PollMode::Adaptive => Some(std::time::Duration::from_micros(200)),
            PollMode::Event => Some(std::time::Duration::ZERO),
        }
    }
}

/// A poll mode that can change at run time, read by pollers on their idle
/// iterations (one relaxed load).
#[derive(Debug)]
pub struct AtomicPollMode(std::sync::atomic::AtomicU8);

impl AtomicPollMode {
    pub fn new(mode: PollMode) -> AtomicPollMode {
        AtomicPollMode(std::sync::atomic::AtomicU8::new(mode as u8))
    }

    pub fn load(&self) -> PollMode {
        match self.0.load(std::sync::atomic::Ordering::Relaxed) {
            x if x == PollMode::Adaptive as u8 => PollMode::Adaptive,
            x if x == PollMode::Event as u8 => PollMode::Event,
            _ => PollMode::Busy,
        }
    }

    pub fn store(&self, mode: PollMode) {
        self.0
            .store(mode as u8, std::sync::atomic::Ordering::Relaxed);
    }
}

impl PollMode {
    /// The name the CLI, the config file and the RPC use.
    pub fn as_str(self) -> &'static str {
        match self {
            PollMode::Busy => "busy",
            PollMode::Adaptive => "adaptive",
            PollMode::Event => "event",
        }
    }
}

impl std::fmt::Display for PollMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PollMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "busy" => Ok(PollMode::Busy),
            "adaptive" => Ok(PollMode::Adaptive),
            "event" => Ok(PollMode::Event),
            _ => Err(format!(
                "unknown poll mode `{s}` (expected busy, adaptive or event)"
            )),
        }
    }
}

#[cfg(test)]
mod spin_tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn only_a_deep_queue_on_slow_channels_shortens_the_spin() {
        let spin = Duration::from_micros(200);
        assert_eq!(adaptive_spin(spin, DEEP_QUEUE, true), DEEP_SPIN);
        assert_eq!(adaptive_spin(spin, 64, true), DEEP_SPIN);
        // QD1..3 keeps the spinning pickup; fast channels always do.
        assert_eq!(adaptive_spin(spin, DEEP_QUEUE - 1, true), spin);
        assert!(defers_doorbells(DEFER_QUEUE, true));
        assert!(!defers_doorbells(DEFER_QUEUE - 1, true));
        assert!(!defers_doorbells(64, false));
        assert_eq!(adaptive_spin(spin, 64, false), spin);
        // Never longer than asked (event mode asks for none).
        assert_eq!(adaptive_spin(Duration::ZERO, 64, true), Duration::ZERO);
        assert_eq!(
            adaptive_spin(Duration::from_micros(10), 64, true),
            Duration::from_micros(10)
        );
    }
}
