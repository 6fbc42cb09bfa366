use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};

/// How a device's queues are spread over reactors.
#[derive(Debug, Default)]
pub enum Placement {
    /// Queue i goes to reactor (start + i) mod N.
    #[default]
    RoundRobin,
    /// Every queue of the device on one reactor: the classic single-thread baseline.
    Single,
}

impl FromStr for Placement {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "round-robin" => Ok(Placement::RoundRobin),
            "single" => Ok(Placement::Single),
            _ => Err(format!(
                "unknown placement `{s}` (expected round-robin or single)"
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
            Placement::RoundRobin => (self.start + qid) % self.reactors,
        }
    }

    /// Next reactor in turn, for callers without a queue number.
    pub fn next(&self) -> usize {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        self.reactor_for(i)
    }
}
