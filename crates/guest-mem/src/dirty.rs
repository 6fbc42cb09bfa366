//! A dirty-page log that a VMM shares with us during live migration: one bit per
//! 4 KiB page of guest-physical memory, bit `p % 8` of byte `p / 8` for page `p`
//! (the vhost-user "Migration" layout, which libvhost-user and the kernel's vhost
//! use too). The VMM harvests it while the guest runs (QEMU swaps each 64-bit word
//! with zero) and sends the pages whose bits were set again.
//!
//! Whoever writes guest memory behind the VMM's back — a backend's DMA into read
//! buffers, the used ring — sets the bits of the pages it wrote *after* writing
//! them: a bit set earlier could be harvested before the data lands, and the page
//! would be sent stale. Bits are set with a release read-modify-write, pairing with
//! the VMM's atomic swap, so the VMM that sees a bit sees the data.
//!
//! The log is a file the VMM hands over; like guest memory it may be shrunk under
//! us, so it is mapped under the SIGBUS guard (`fault.rs`) and a fault tells the
//! owner through its [`FaultSignal`].

use std::io;
use std::os::fd::BorrowedFd;
use std::sync::Arc;

use crate::fault::FaultSignal;
use crate::region::{MappedRegion, Prot};

/// The guest-physical bytes one bit of the log stands for.
pub const LOG_PAGE: u64 = 4096;

/// A mapped dirty-page log.
#[derive(Debug)]
pub struct DirtyLog {
    map: MappedRegion,
}

impl DirtyLog {
    /// Maps `size` bytes of the log file `fd` at `offset` (page aligned), refusing a
    /// file shorter than that; `signal` is raised if the file shrinks later.
    pub fn map(
        fd: BorrowedFd<'_>,
        offset: u64,
        size: u64,
        signal: &Arc<FaultSignal>,
    ) -> io::Result<DirtyLog> {
        let map = MappedRegion::map_fd_watched(fd, offset, 0, size, Prot::RW, signal)?;
        Ok(DirtyLog { map })
    }

    /// The log's size in bytes.
    pub fn bytes(&self) -> u64 {
        self.map.len()
    }

    /// One past the last guest-physical address the log has a bit for.
    pub fn covers(&self) -> u64 {
        self.map.len().saturating_mul(8 * LOG_PAGE)
    }

    /// Marks the pages of `[gpa, gpa + len)` dirty. Pages past the end of the log
    /// are not marked: callers check up front that the log covers the memory
    /// they write ([`DirtyLog::covers`]).
    #[inline]
    pub fn mark(&self, gpa: u64, len: u64) {
        if len == 0 {
            return;
        }
        let first = gpa / LOG_PAGE;
        let last = gpa.saturating_add(len - 1) / LOG_PAGE;
        let all = self.map.slice(0, self.map.len() as usize);
        let Some(all) = all else { return };
        for byte in first / 8..=last / 8 {
            let lo = if byte == first / 8 { first % 8 } else { 0 };
            let hi = if byte == last / 8 { last % 8 } else { 7 };
            let mask = (0xffu8 << lo) & (0xffu8 >> (7 - hi));
            let Ok(off) = usize::try_from(byte) else {
                return;
            };
            if all.fetch_or_u8(off, mask).is_none() {
                return;
            }
        }
    }

    /// Whether the page holding `gpa` is marked (tests, diagnostics).
    pub fn is_marked(&self, gpa: u64) -> bool {
        let page = gpa / LOG_PAGE;
        usize::try_from(page / 8)
            .ok()
            .and_then(|off| self.map.slice(0, self.map.len() as usize)?.load_u8(off))
            .is_some_and(|b| b & (1 << (page % 8)) != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SharedMem;

    fn log(bytes: u64) -> (SharedMem, DirtyLog) {
        let file = SharedMem::new("dirty-test", bytes).unwrap();
        let signal = FaultSignal::new().unwrap();
        let log = DirtyLog::map(file.fd(), 0, bytes, &signal).unwrap();
        (file, log)
    }

    fn bits(file: &SharedMem) -> Vec<u8> {
        let mut b = vec![0u8; file.len() as usize];
        file.all().read_into(0, &mut b).unwrap();
        b
    }

    #[test]
    fn marks_every_page_a_range_touches() {
        let (file, log) = log(4096);
        assert_eq!(log.covers(), 4096 * 8 * LOG_PAGE);
        // One byte in page 3; 4097 bytes from the end of page 5 touch 5, 6 and 7.
        log.mark(3 * LOG_PAGE + 17, 1);
        log.mark(6 * LOG_PAGE - 1, LOG_PAGE + 2);
        assert_eq!(bits(&file)[0], 0b1110_1000);
        // Across bytes: pages 14..=17.
        log.mark(14 * LOG_PAGE, 4 * LOG_PAGE);
        assert_eq!(&bits(&file)[1..3], &[0b1100_0000, 0b0000_0011]);
        // A long range sets whole bytes.
        log.mark(64 * LOG_PAGE, 64 * LOG_PAGE);
        assert!(bits(&file)[8..16].iter().all(|&b| b == 0xff));
        assert!(log.is_marked(3 * LOG_PAGE) && !log.is_marked(4 * LOG_PAGE));
        // Nothing for an empty range; nothing (and no fault) past the end.
        log.mark(2 * LOG_PAGE, 0);
        log.mark(log.covers() - 1, u64::MAX);
        log.mark(u64::MAX - 10, 100);
        let b = bits(&file);
        assert_eq!(b[0] & 0b100, 0);
        assert_eq!(b[4095], 0x80);
    }

    #[test]
    fn a_log_file_shorter_than_claimed_is_refused() {
        let file = SharedMem::new("dirty-short", 4096).unwrap();
        let signal = FaultSignal::new().unwrap();
        assert!(DirtyLog::map(file.fd(), 0, 8192, &signal).is_err());
        assert!(DirtyLog::map(file.fd(), 100, 4096, &signal).is_err());
    }
}
