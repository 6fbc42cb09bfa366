//! What crosses threads: the trace switch (one atomic word the poller reads once per
//! poll) and the snapshot mailbox (a flag the poller checks once per poll; the
//! mutex is only taken when a snapshot was asked for). Readers wait for mailboxes
//! with `frontend_core::collect`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::snapshot::QueueSnapshot;

const ENABLED: u64 = 1 << 63;
const SAMPLE_SHIFT: u32 = 32;
const SAMPLE_MASK: u64 = 0x7fff_ffff;

/// Trace switch shared by all queues of a device: enabled, sample one request in N,
/// and an epoch that changes with every start so queues clear old data.
#[derive(Debug, Default)]
pub struct TraceControl {
    state: AtomicU64,
}

/// Decoded [`TraceControl`] state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceSettings {
    pub enabled: bool,
    /// Trace one request in `sample_every` (1: every request).
    pub sample_every: u32,
    pub epoch: u32,
}

impl TraceSettings {
    pub(crate) fn decode(v: u64) -> TraceSettings {
        TraceSettings {
            enabled: v & ENABLED != 0,
            sample_every: (((v >> SAMPLE_SHIFT) & SAMPLE_MASK) as u32).max(1),
            epoch: v as u32,
        }
    }
}

impl TraceControl {
    /// Starts a new trace: queues drop the layer histograms of the previous one and
    /// trace one request in `sample_every` (0 is taken as 1).
    pub fn start(&self, sample_every: u32) {
        let n = u64::from(sample_every.max(1)) & SAMPLE_MASK;
        let old = self.state.load(Ordering::Relaxed);
        let epoch = (old as u32).wrapping_add(1);
        self.state.store(
            ENABLED | (n << SAMPLE_SHIFT) | u64::from(epoch),
            Ordering::Release,
        );
    }

    /// Stops tracing; the collected histograms stay readable until the next start.
    pub fn stop(&self) {
        self.state.fetch_and(!ENABLED, Ordering::AcqRel);
    }

    pub fn settings(&self) -> TraceSettings {
        TraceSettings::decode(self.state.load(Ordering::Acquire))
    }

    #[inline]
    pub(crate) fn raw(&self) -> u64 {
        self.state.load(Ordering::Relaxed)
    }
}

/// Where a queue's poller leaves a snapshot when asked.
#[derive(Debug, Default)]
pub struct Mailbox {
    want: AtomicBool,
    slot: Mutex<Option<QueueSnapshot>>,
}

impl Mailbox {
    /// Asks the poller for a snapshot at the end of its next poll.
    pub fn request(&self) {
        self.want.store(true, Ordering::Release);
    }

    #[inline]
    pub(crate) fn wanted(&self) -> bool {
        self.want.load(Ordering::Relaxed)
    }

    pub(crate) fn answer(&self, s: QueueSnapshot) {
        *self.slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(s);
        self.want.store(false, Ordering::Release);
    }

    /// The snapshot, once the poller left one.
    pub fn take(&self) -> Option<QueueSnapshot> {
        self.slot.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_stop_epochs() {
        let c = TraceControl::default();
        assert!(!c.settings().enabled);
        c.start(0);
        let s = c.settings();
        assert!(s.enabled);
        assert_eq!(s.sample_every, 1);
        c.stop();
        let t = c.settings();
        assert!(!t.enabled);
        assert_eq!(t.epoch, s.epoch);
        c.start(100);
        let u = c.settings();
        assert_eq!((u.enabled, u.sample_every), (true, 100));
        assert_ne!(u.epoch, s.epoch);
    }
}
