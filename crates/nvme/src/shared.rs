//! What reactors share with the control path of one controller: the doorbell page,
//! the fatal flag, interrupts, the error log and the settings queue groups read on
//! every poll. A leaf of the crate: the control path (`ctrl.rs`) and the queue
//! groups (`io/`) both depend on it, it depends on neither.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use engine::{PollMode, Waker};
use guest_mem::SharedMem;

use crate::log::{ErrorEntry, ErrorLog};
use crate::{InterruptSink, DOORBELL_OFFSET};

/// What reactors share with the control path; read-mostly.
pub(crate) struct Shared {
    pub doorbells: SharedMem,
    /// Set by a queue that saw a hostile doorbell or lost its ring: CSTS.CFS.
    pub fatal: AtomicBool,
    pub irqs: Arc<dyn InterruptSink>,
    pub errors: Mutex<ErrorLog>,
    /// Volatile Write Cache enable (Set Features 06h).
    pub wce: AtomicBool,
    pub mdts_bytes: u64,
    /// Trace switch of all this controller's queues.
    pub trace: Arc<trace::TraceControl>,
    /// Budget of the controller's guest-triggerable log lines.
    pub log: trace::LogLimiter,
    /// How queue groups wait for work ([`PollMode`] as u8), switchable at run time.
    pub poll: engine::AtomicPollMode,
    /// Spin time of an idle `adaptive` group before it sleeps.
    pub idle: Duration,
    /// The connected client got the doorbell page as an mmap area: its doorbell
    /// writes land silently, so nothing can wake a sleeping group and every mode
    /// polls busily until it reconnects.
    pub mapped: AtomicBool,
    /// Interrupt Coalescing (Feature 08h) as the host set it: threshold (0's based)
    /// in bits 0-7, time in 100 µs units in bits 8-15; 0: off.
    pub coalescing: AtomicU32,
    /// Interrupt Vector Configuration (Feature 09h): Coalescing Disable per vector.
    pub no_coalesce: Vec<AtomicBool>,
    /// Each existing I/O queue's doorbell by index (`2 * qid + is_cq`): its size,
    /// and for SQs the reactor of the owning group, which a doorbell written by
    /// message wakes.
    pub db_targets: Mutex<Vec<Option<DbTarget>>>,
}

/// What a doorbell written by message concerns (see `Shared::rang`).
#[derive(Clone)]
pub(crate) struct DbTarget {
    pub size: u16,
    pub waker: Option<Waker>,
}

impl Shared {
    /// Publishes the interrupt features to the queue groups: Interrupt Coalescing
    /// (Feature 08h) and each vector's Coalescing Disable (09h).
    pub fn publish_interrupt_features(&self, coalescing: u32, no_coalesce: &[bool]) {
        self.coalescing
            .store(coalescing & 0xffff, Ordering::Relaxed);
        for (a, cd) in self.no_coalesce.iter().zip(no_coalesce) {
            a.store(*cd, Ordering::Relaxed);
        }
    }

    /// Coalescing for `vector`: (completions per interrupt, longest delay), or
    /// `None` when every batch signals.
    pub fn coalescing_for(&self, vector: u16) -> Option<(u32, Duration)> {
        let c = self.coalescing.load(Ordering::Relaxed);
        let (thr, time) = (c & 0xff, (c >> 8) & 0xff);
        let off = self
            .no_coalesce
            .get(usize::from(vector))
            .is_none_or(|cd| cd.load(Ordering::Relaxed));
        // Vector 0 is the admin queue's, which is never coalesced (NVMe 1.4 §5.21.1.8).
        (c != 0 && time != 0 && vector != 0 && !off)
            .then(|| (thr + 1, Duration::from_micros(100 * u64::from(time))))
    }

    pub fn poll_mode(&self) -> PollMode {
        self.poll.load()
    }

    pub fn set_poll_mode(&self, mode: PollMode) {
        self.poll.store(mode);
    }

    /// How long an idle group spins before it may sleep; `None`: never.
    pub fn sleep_after(&self) -> Option<Duration> {
        if self.mapped.load(Ordering::Relaxed) {
            return None;
        }
        match self.poll_mode() {
            PollMode::Busy => None,
            PollMode::Adaptive => Some(self.idle),
            PollMode::Event => Some(Duration::ZERO),
        }
    }

    /// Wakes every reactor that owns one of this controller's groups.
    pub fn wake_all(&self) {
        let targets = self.db_targets.lock().unwrap_or_else(|e| e.into_inner());
        for w in targets.iter().flatten().filter_map(|t| t.waker.as_ref()) {
            w.wake();
        }
    }

    /// A doorbell arrived by message (it is in the page already). A value beyond
    /// the queue is fatal at once (a sleeping group would not see it); an SQ tail
    /// wakes the group's reactor. CQ head doorbells wake nobody: groups never wait
    /// for CQ space while idle (they fetch only what the CQ can take).
    pub(crate) fn rang(&self, off: u64, v: u32) {
        let idx = ((off - DOORBELL_OFFSET) / 4) as usize;
        let targets = self.db_targets.lock().unwrap_or_else(|e| e.into_inner());
        let Some(Some(t)) = targets.get(idx) else {
            drop(targets);
            // What a guest migrated without its controller's state does (QEMU's
            // vfio-user client migrates none and does not refuse): say so where
            // the operator looks, not only in the guest's I/O timeouts.
            trace::limited!(
                self.log,
                warn,
                queue = idx / 2,
                value = v,
                "doorbell of a queue this controller does not have: the guest's driver \
                 uses queues this controller did not create (a VM live-migrated with an \
                 NVMe controller over vfio-user, which carries no controller state: see \
                 docs/attach.md; or a server that lost the state) until it resets the \
                 controller, or it writes doorbells of queues it deleted"
            );
            return;
        };
        if v >= u32::from(t.size) {
            let what = if idx % 2 == 1 { "CQ head" } else { "SQ tail" };
            self.set_fatal(&format!(
                "{what} doorbell of queue {} beyond queue size ({v} >= {})",
                idx / 2,
                t.size
            ));
            return;
        }
        if let Some(w) = &t.waker {
            w.wake();
        }
    }

    /// Registers a group's queues, its CQ and its SQs as `(qid, size)` (`waker`:
    /// the group's reactor, `None` while parked) or, with `gone`, forgets them.
    pub(crate) fn set_db_targets(
        &self,
        cq: (u16, u16),
        sqs: impl Iterator<Item = (u16, u16)>,
        waker: Option<Waker>,
        gone: bool,
    ) {
        let mut targets = self.db_targets.lock().unwrap_or_else(|e| e.into_inner());
        let mut put = |qid: u16, cq: bool, t: DbTarget| {
            if let Some(e) = targets.get_mut(usize::from(qid) * 2 + usize::from(cq)) {
                *e = (!gone).then_some(t);
            }
        };
        let (qid, size) = cq;
        put(qid, true, DbTarget { size, waker: None });
        for (qid, size) in sqs {
            let t = DbTarget {
                size,
                waker: waker.clone(),
            };
            put(qid, false, t);
        }
    }

    pub fn set_fatal(&self, why: &str) {
        if !self.fatal.swap(true, Ordering::AcqRel) {
            trace::limited!(self.log, warn, "nvme: controller fatal status: {why}");
        }
    }

    pub fn record_error(&self, e: ErrorEntry) {
        self.errors
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .record(e);
    }

    pub(crate) fn clear_doorbells(&self) {
        if let Some(s) = self.doorbells.slice(DOORBELL_OFFSET, 0x1000) {
            s.fill(0);
        }
    }
}
