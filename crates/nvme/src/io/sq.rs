//! An I/O submission queue as its group holds it: the ring and one preallocated
//! command slot per entry. A leaf: every stage reads and writes slots, none of
//! them is needed to describe one.

use guest_mem::Pin;
use trace::Stamps;

use super::shadow::NO_EI;
use crate::iov::Run;
use crate::queue::SqRing;
use crate::status::Status;

/// One command's state from fetch to completion, preallocated per SQ entry.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Slot {
    pub(super) cid: u16,
    pub(super) opcode: u8,
    /// Backend requests still outstanding (DSM may issue several).
    pub(super) pending: u16,
    pub(super) status: Status,
    pub(super) nsid: u32,
    pub(super) slba: u64,
    pub(super) bytes: u64,
    /// Read/Write, parsed and waiting in a batch: byte offset, FUA and where its
    /// iovec is in the batch's `Iov`.
    pub(super) offset: u64,
    pub(super) fua: bool,
    pub(super) segs: (u16, u16),
    /// Its guest ranges in the batch's `Iov` (with mirrors of unshared memory).
    pub(super) runs: (u16, u16),
    /// Its data lies in unshared client memory: pushed before its completion.
    pub(super) push: bool,
    /// Trace stamps; `kick == 0` when this command is not traced.
    pub(super) stamps: Stamps,
    /// Keeps the memory map this command was translated against while the backend
    /// has it.
    pub(super) pin: Pin,
}

pub(crate) struct IoSq {
    pub ring: SqRing,
    pub(super) slots: Vec<Slot>,
    pub(super) free: Vec<u32>,
    /// EventIdx we last wrote (`NO_EI`: unknown). Written only when it changes: the
    /// driver reads it after every command, and a store per poll would keep its
    /// cache line bouncing between the driver's CPU and ours.
    pub(super) ei: u16,
    /// The most commands this SQ had in flight or newly added at once: what the
    /// driver may put in it again in one go, which bounds the lag EventIdx may have
    /// (`keep_behind`).
    pub(super) peak: u32,
    /// With the ring in unshared client memory: entries up to here (from `head`)
    /// were fetched already.
    pub(super) synced: u16,
    /// Per slot, with mirrors of unshared memory: the guest ranges a command's
    /// data lands in, pushed to the client before its completion (empty, and never
    /// allocated, otherwise).
    pub(super) runs: Vec<Vec<Run>>,
}

impl IoSq {
    #[inline]
    pub(super) fn new(ring: SqRing) -> IoSq {
        let n = u32::from(ring.size);
        IoSq {
            ring,
            slots: vec![Slot::default(); n as usize],
            free: (0..n).rev().collect(),
            ei: NO_EI,
            peak: 0,
            synced: 0,
            runs: Vec::new(),
        }
    }

    /// Keeps command `idx`'s guest data ranges for the push before its
    /// completion (mirrors of unshared client memory only).
    #[inline]
    pub(super) fn keep_runs(&mut self, idx: u32, runs: &[Run]) {
        if self.runs.len() < self.slots.len() {
            self.runs.resize_with(self.slots.len(), Vec::new);
        }
        if let Some(v) = self.runs.get_mut(idx as usize) {
            v.clear();
            v.extend_from_slice(runs);
        }
    }
}
