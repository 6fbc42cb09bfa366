//! Error Information log and the counters behind SMART / stats.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::status::Status;

/// Entries kept (ELPE + 1).
pub(crate) const ERROR_LOG_ENTRIES: usize = 64;

#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ErrorEntry {
    pub count: u64,
    pub sqid: u16,
    pub cid: u16,
    pub status: Status,
    pub lba: u64,
    pub nsid: u32,
}

impl ErrorEntry {
    pub fn to_bytes(self) -> [u8; 64] {
        let mut b = [0u8; 64];
        b[0..8].copy_from_slice(&self.count.to_le_bytes());
        b[8..10].copy_from_slice(&self.sqid.to_le_bytes());
        b[10..12].copy_from_slice(&self.cid.to_le_bytes());
        // Status field: bits 15:1 status, bit 0 phase (reported as 0).
        b[12..14].copy_from_slice(&((self.status.0 & 0x7fff) << 1).to_le_bytes());
        b[14..16].copy_from_slice(&0xffffu16.to_le_bytes());
        b[16..24].copy_from_slice(&self.lba.to_le_bytes());
        b[24..28].copy_from_slice(&self.nsid.to_le_bytes());
        b
    }
}

/// Recent errors, newest last; touched only when a command fails.
#[derive(Debug, Default)]
pub(crate) struct ErrorLog {
    pub count: u64,
    pub ring: VecDeque<ErrorEntry>,
}

impl ErrorLog {
    pub fn record(&mut self, mut e: ErrorEntry) {
        self.count = self.count.wrapping_add(1).max(1);
        e.count = self.count;
        if self.ring.len() >= ERROR_LOG_ENTRIES {
            self.ring.pop_front();
        }
        self.ring.push_back(e);
    }
}

/// What a queue group counts besides requests (those are counted once, by its
/// `trace::QueueRecorder`: see [`GroupCounters`]). Each group is polled by one
/// thread at a time, so updates are plain load+store (no locked RMW on the hot path).
#[derive(Debug, Default)]
pub(crate) struct PcieCounters {
    pub shadow_reads: AtomicU64,
}

/// A queue group's counters as the control path reads them.
#[derive(Debug, Clone)]
pub(crate) struct GroupCounters {
    pub io: Arc<trace::IoCounters>,
    pub pcie: Arc<PcieCounters>,
}

pub(crate) fn bump(a: &AtomicU64, n: u64) {
    a.store(a.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
}

/// Plain snapshot of [`GroupCounters`], also used to keep totals of deleted groups.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Totals {
    pub io: trace::IoTotals,
    pub shadow_reads: u64,
}

impl Totals {
    pub fn add(&mut self, c: &GroupCounters) {
        self.io.add(&c.io.totals());
        self.shadow_reads = self
            .shadow_reads
            .wrapping_add(c.pcie.shadow_reads.load(Ordering::Relaxed));
    }
}

/// SMART / Health Information log page (512 bytes).
pub(crate) fn smart_page(t: &Totals, error_count: u64, temp_k: u16) -> Vec<u8> {
    let mut b = vec![0u8; 512];
    let units = |bytes: u64| u128::from(bytes.div_ceil(512_000));
    b[1..3].copy_from_slice(&temp_k.to_le_bytes());
    b[3] = 100; // available spare
    b[4] = 10; // available spare threshold
    b[32..48].copy_from_slice(&units(t.io.bytes.read).to_le_bytes());
    b[48..64].copy_from_slice(&units(t.io.bytes.write).to_le_bytes());
    b[64..80].copy_from_slice(&u128::from(t.io.ops.read).to_le_bytes());
    b[80..96].copy_from_slice(&u128::from(t.io.ops.write).to_le_bytes());
    b[112..128].copy_from_slice(&1u128.to_le_bytes()); // power cycles
    b[176..192].copy_from_slice(&u128::from(error_count).to_le_bytes());
    b[200..202].copy_from_slice(&temp_k.to_le_bytes());
    b
}
