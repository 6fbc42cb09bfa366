//! Error Information log and the counters behind SMART / stats.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};

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

/// Per-queue-group counters. Each group is polled by one thread at a time, so
/// updates are plain load+store (no locked RMW on the hot path).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub flushes: AtomicU64,
    pub other: AtomicU64,
    pub errors: AtomicU64,
    pub bytes_read: AtomicU64,
    pub bytes_written: AtomicU64,
    pub shadow_reads: AtomicU64,
}

pub(crate) fn bump(a: &AtomicU64, n: u64) {
    a.store(a.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
}

/// Plain snapshot of [`Counters`], also used to keep totals of deleted groups.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Totals {
    pub reads: u64,
    pub writes: u64,
    pub flushes: u64,
    pub other: u64,
    pub errors: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub shadow_reads: u64,
}

impl Totals {
    pub fn add(&mut self, c: &Counters) {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        self.reads = self.reads.wrapping_add(l(&c.reads));
        self.writes = self.writes.wrapping_add(l(&c.writes));
        self.flushes = self.flushes.wrapping_add(l(&c.flushes));
        self.other = self.other.wrapping_add(l(&c.other));
        self.errors = self.errors.wrapping_add(l(&c.errors));
        self.bytes_read = self.bytes_read.wrapping_add(l(&c.bytes_read));
        self.bytes_written = self.bytes_written.wrapping_add(l(&c.bytes_written));
        self.shadow_reads = self.shadow_reads.wrapping_add(l(&c.shadow_reads));
    }
}

/// SMART / Health Information log page (512 bytes).
pub(crate) fn smart_page(t: &Totals, error_count: u64, temp_k: u16) -> Vec<u8> {
    let mut b = vec![0u8; 512];
    let units = |bytes: u64| u128::from(bytes.div_ceil(512_000));
    b[1..3].copy_from_slice(&temp_k.to_le_bytes());
    b[3] = 100; // available spare
    b[4] = 10; // available spare threshold
    b[32..48].copy_from_slice(&units(t.bytes_read).to_le_bytes());
    b[48..64].copy_from_slice(&units(t.bytes_written).to_le_bytes());
    b[64..80].copy_from_slice(&u128::from(t.reads).to_le_bytes());
    b[80..96].copy_from_slice(&u128::from(t.writes).to_le_bytes());
    b[112..128].copy_from_slice(&1u128.to_le_bytes()); // power cycles
    b[176..192].copy_from_slice(&u128::from(error_count).to_le_bytes());
    b[200..202].copy_from_slice(&temp_k.to_le_bytes());
    b
}
