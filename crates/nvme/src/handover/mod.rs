//! Handing a running controller over to another process: pause it, save the
//! runtime state as a serializable value, restore it into a fresh controller that
//! sees the same guest memory, doorbell page and namespaces. The guest sees a
//! pause: no reset, no error, no lost or repeated completion.
//!
//! **Pause** runs on the control path only; the I/O hot path is unchanged (not
//! even a flag load). Every queue group is taken off its reactor the way queue
//! creation and namespace changes do it (`Engine::remove_poller` returns once the
//! reactor let go between two polls), so nothing more is fetched from that moment.
//! The control path then finishes what the groups hold: it polls their backend
//! channels, posts the completions and signals the interrupts
//! (`QueueGroup::settle`), bounded by the caller's timeout; a group's CQ always
//! has room for what it has in flight (a group fetches only what its CQ can take).
//! The settled groups stay parked off their reactors (`Inner::place_group` parks
//! every group while `State::paused`). The admin queue stops fetching
//! (`Inner::admin_poll`); outstanding Asynchronous Event Requests stay outstanding
//! and their CIDs move to the new controller, which completes them. A Format NVM in
//! progress is waited for (within the timeout). The Keep Alive Timer stops and
//! restarts in full on `resume` or `restore`: the pause is not the host's.
//!
//! **Doorbells** written meanwhile land in the shared doorbell page (mapped by the
//! client or stored there by the transport) or the shadow doorbell buffer in guest
//! memory; the new controller's groups poll both first thing when placed, and its
//! admin queue is polled once at the end of `restore`. The transport must
//! not hand the old controller any message after `save`: a register write
//! there would be lost (the orchestrator stops reading the client's socket before
//! pausing and the new process reads it after restoring).
//!
//! **After a successful save** the old controller must not clear the doorbell page
//! (now the new controller's) when it is reset or shut down: `handed_over` keeps it
//! from doing so until `resume` (rollback).
//!
//! **Refused:** clients whose memory moves by DMA messages
//! (docs/decisions/0020-dma-messages.md): their queue groups and admin passes wait
//! for the client's replies, and mirrored SQ entries fetched ahead (`IoSq::synced`)
//! would have to move too. `pause` and `save` say so.
//!
//! The state is validated on restore like guest input: every queue id, size, base,
//! vector and index is checked against this controller's configuration and the
//! current memory map before anything changes, so a corrupt or hostile state is an
//! error, never a panic, and leaves the controller fresh.
//!
//! Here: pause and resume. `state.rs` holds the state's types and the errors,
//! `save.rs` reads a paused controller into a state, `restore.rs` checks one in
//! stages and puts it in place.

// Client-supplied numbers are parsed here (and in the submodules): no silent
// truncation.
#![deny(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss
)]

mod restore;
mod save;
mod state;

pub use state::{
    AdminQueueState, ControllerState, CountersState, CqState, ErrorEntryState, ErrorLogState,
    FeaturesState, NamespaceState, PauseError, RegsState, RestoreError, SaveError, ShadowState,
    SqState, StateLimits, STATE_VERSION,
};

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::ctrl::{Inner, State};

impl Inner {
    fn limits(&self) -> StateLimits {
        StateLimits {
            max_io_queues: self.cfg.max_io_queues,
            max_queue_entries: self.cfg.max_queue_entries,
            msix_vectors: self.cfg.msix_vectors,
            max_namespaces: self.cfg.max_namespaces,
        }
    }

    /// An admin pass where this controller's admin passes run (see `write32`).
    fn admin_kick(&self, st: &mut State) {
        if self.messages.load(Ordering::Acquire) {
            self.admin_elsewhere();
        } else {
            self.admin_poll(st);
        }
        crate::service::kick();
    }

    /// See [`crate::Controller::pause`].
    pub(crate) fn pause(&self, timeout: Duration) -> Result<(), PauseError> {
        let start = Instant::now();
        let mut st = self.lock();
        if self.messages.load(Ordering::Acquire) {
            return Err(PauseError::DmaMessages);
        }
        if st.paused {
            return Ok(());
        }
        st.paused = true;
        st.keep_alive = None;
        // A Format NVM completes when its erase ends (on its own thread, which
        // needs the lock to finish).
        // Paused, nothing is fetched, so no new one can start meanwhile.
        if st.format.is_some() {
            drop(st);
            let left = timeout.saturating_sub(start.elapsed());
            let done = engine::wait_until(left, Duration::from_millis(1), || {
                self.lock().format.is_none()
            });
            st = self.lock();
            if !done {
                self.resume_locked(&mut st);
                return Err(PauseError::FormatInProgress(timeout));
            }
        }
        // Admin commands that finished meanwhile are posted (nothing is fetched).
        if st.admin.is_some() {
            self.admin_poll(&mut st);
        }
        let ids: Vec<u16> = st.groups.keys().copied().collect();
        let mut taken = Vec::with_capacity(ids.len());
        for cqid in ids {
            if let Some(g) = self.take_group(&mut st, cqid) {
                taken.push(g);
            }
        }
        // From here on nothing is fetched: finish what the groups hold.
        let left = timeout.saturating_sub(start.elapsed());
        let mut idle = vec![false; taken.len()];
        let done = engine::wait_until(left, Duration::from_micros(20), || {
            for (g, idle) in taken.iter_mut().zip(idle.iter_mut()) {
                if !*idle {
                    *idle = g.settle();
                }
            }
            idle.iter().all(|i| *i)
        });
        let requests: u64 = taken.iter().map(|g| u64::from(g.out.inflight)).sum();
        // Parked while paused, back on their reactors otherwise.
        for g in taken {
            let cqid = g.out.cq.qid;
            if let Err(s) = self.place_group(&mut st, g) {
                tracing::error!(cqid, status = ?s, "nvme: queue group lost in a pause");
            }
        }
        if !done {
            self.resume_locked(&mut st);
            return Err(PauseError::Timeout { requests, timeout });
        }
        trace::limited!(
            self.shared.log,
            info,
            cntlid = self.cfg.cntlid,
            took_us = u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX),
            "nvme: controller paused"
        );
        Ok(())
    }

    /// Back to running after a pause: groups on their reactors, the Keep Alive
    /// Timer restarted, admin commands rung meanwhile fetched.
    fn resume_locked(&self, st: &mut State) {
        st.paused = false;
        self.handed_over.store(false, Ordering::Release);
        let ids: Vec<u16> = st.groups.keys().copied().collect();
        for cqid in ids {
            if let Some(g) = self.take_group(st, cqid) {
                if let Err(s) = self.place_group(st, g) {
                    tracing::error!(cqid, status = ?s, "nvme: queue group lost resuming");
                }
            }
        }
        if st.admin.is_some() {
            st.restart_keep_alive();
            self.admin_kick(st);
        }
    }

    /// See [`crate::Controller::resume`].
    pub(crate) fn resume(&self) {
        let mut st = self.lock();
        if st.paused {
            self.resume_locked(&mut st);
        }
    }
}
