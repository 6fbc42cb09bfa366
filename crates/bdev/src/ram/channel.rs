//! A RAM disk's channel: every request is a copy on the calling thread, so the
//! channel's work is memory latency. It hides what it can
//! (docs/decisions/0027-prefetch-next-copy.md, 0033-backend-batches.md,
//! 0047-prefetch-write-destination.md): the next request of a batch, its disk
//! bytes and a write's buffers, is loaded while the current one is copied, and the
//! announced first request of a batch starts its page walk before it arrives.

use std::sync::Arc;

use guest_mem::{DmaSlice, MappedRegion};

use super::{extent_at, Extent};
use crate::{in_range, Batch, IoChannel, IoOp, IoRequest, IoStatus};

/// Bytes of the next request loaded during a copy: two 4 KiB blocks. Copying one
/// 4 KiB block takes about as long as loading one from DRAM, so more would
/// arrive after the copy that wants them, and evict what it needs.
const PREFETCH_MAX: usize = 8192;

/// Bytes of an announced read ([`IoChannel::announce`]) loaded at once: two
/// cache lines start the page walk and the DRAM access, and the copy streams the
/// rest (measured against none, one, four and 64 lines: docs/decisions/
/// 0027-prefetch-next-copy.md, "The first command's own lines").
const PREFETCH_NOW: usize = 128;

pub(super) struct RamChannel {
    extents: Arc<[Extent]>,
    /// The device's size (the mappings may reach past it after a shrink).
    size: u64,
    /// Disk offset of the read whose first lines [`IoChannel::announce`]
    /// requested: the rest of its first blocks are requested right before its
    /// copy.
    announced: Option<u64>,
}

impl RamChannel {
    pub(super) fn new(extents: Arc<[Extent]>, size: u64) -> RamChannel {
        RamChannel {
            extents,
            size,
            announced: None,
        }
    }

    /// Calls `f(mapping, offset in it, offset in the range, length)` for each piece
    /// of `[off, off + len)` that one extent holds (one piece unless the disk grew
    /// and the range straddles two mappings). `false` if a piece is missing or `f`
    /// refused it.
    fn pieces(
        &self,
        off: u64,
        len: u64,
        mut f: impl FnMut(&MappedRegion, u64, u64, u64) -> bool,
    ) -> bool {
        let mut done = 0u64;
        while done < len {
            let at = off + done;
            let Some(e) = extent_at(&self.extents, at) else {
                return false;
            };
            let n = (len - done).min(e.end() - at);
            if !f(&e.mem, at - e.start, done, n) {
                return false;
            }
            done += n;
        }
        true
    }

    /// Prepares `next`, the request after the one about to be copied: its first
    /// blocks on the disk are returned, to be loaded during that copy (a read's
    /// source, a write's destination: a store to a line that is not cached waits
    /// for it as a load does); a write's buffers (the client's) are requested at
    /// once (docs/decisions/0047-prefetch-write-destination.md).
    fn ahead(&self, next: &IoRequest<'_>) -> Option<(u64, u64)> {
        if next.op == IoOp::Write {
            let mut left = PREFETCH_MAX;
            for buf in next.iov {
                buf.prefetch(left);
                left = left.saturating_sub(buf.len());
                if left == 0 {
                    break;
                }
            }
        }
        let copies = matches!(next.op, IoOp::Read | IoOp::Write);
        (copies && in_range(next.offset, next.len, self.size))
            .then(|| (next.offset, next.len.min(PREFETCH_MAX as u64)))
    }

    /// Executes `req`; `next` is what [`RamChannel::ahead`] returned for the
    /// request after it, if any.
    fn execute(&mut self, req: &IoRequest<'_>, next: Option<(u64, u64)>) -> IoStatus {
        let announced = self.announced.take() == Some(req.offset);
        // Loading its own bytes during its copy would be useless.
        let next = next.filter(|&(at, _)| at != req.offset);
        if req.op != IoOp::Flush && !in_range(req.offset, req.len, self.size) {
            return IoStatus::OutOfRange;
        }
        match req.op {
            IoOp::Read | IoOp::Write => self.transfer(req, next, announced),
            IoOp::Flush => IoStatus::Ok,
            IoOp::WriteZeroes | IoOp::Discard => {
                if self.pieces(req.offset, req.len, |mem, at, _, n| {
                    mem.discard(at, n).is_some()
                }) {
                    IoStatus::Ok
                } else {
                    IoStatus::OutOfRange
                }
            }
        }
    }

    /// Copies the request's bytes; with a next read, its first half is loaded
    /// while the first half of these bytes is copied and its second half during
    /// the rest. A burst of prefetches for a whole block fills the core's queue of
    /// outstanding loads, and every load after it (the poller's own bookkeeping
    /// between two copies) waits until the block has arrived: spread over the
    /// copy, the block arrives while the copy runs.
    ///
    /// An announced read gets the rest of its first blocks requested just before
    /// its copy: by then the page walk its first lines started has filled the
    /// TLB, so the burst goes to DRAM at once, and the copy finds many lines on
    /// their way instead of the few its own loads and the hardware prefetcher keep
    /// in flight (4 KiB from DRAM about 20 % faster, measured: docs/decisions/
    /// 0027-prefetch-next-copy.md, "The rest of the first block right before its
    /// copy"). Issued earlier, the burst waits for the walk and stalls the poller's
    /// own loads behind it.
    fn transfer(&self, req: &IoRequest<'_>, next: Option<(u64, u64)>, announced: bool) -> IoStatus {
        // Checked before copying: buffers longer than `len` must not reach past the range.
        let total: u64 = req.iov.iter().map(|b| b.len() as u64).sum();
        if total != req.len {
            return IoStatus::Invalid;
        }
        if announced && req.op == IoOp::Read {
            let rest = req.len.min(PREFETCH_MAX as u64);
            self.prefetch_disk(
                req.offset + PREFETCH_NOW as u64,
                rest.saturating_sub(PREFETCH_NOW as u64),
            );
        }
        let Some((at, len)) = next else {
            return self.copy(req, 0, req.len);
        };
        let (half, mid) = (len / 2, req.len / 2);
        self.prefetch_disk(at, half);
        match self.copy(req, 0, mid) {
            IoStatus::Ok => {}
            st => return st,
        }
        self.prefetch_disk(at + half, len - half);
        self.copy(req, mid, req.len)
    }

    /// Copies bytes `[from, to)` of the request between its buffers and the disk.
    fn copy(&self, req: &IoRequest<'_>, from: u64, to: u64) -> IoStatus {
        let mut pos = 0u64;
        for buf in req.iov {
            let end = pos + buf.len() as u64;
            let (a, b) = (pos.max(from), end.min(to));
            if a < b {
                let st = self.copy_buf(req, buf, a - pos, req.offset + a, b - a);
                if st != IoStatus::Ok {
                    return st;
                }
            }
            pos = end;
            if pos >= to {
                break;
            }
        }
        IoStatus::Ok
    }

    /// Copies `len` bytes at `skip` in `buf` to or from disk offset `off`.
    fn copy_buf(
        &self,
        req: &IoRequest<'_>,
        buf: &DmaSlice<'_>,
        skip: u64,
        off: u64,
        len: u64,
    ) -> IoStatus {
        let mut bad = IoStatus::OutOfRange;
        let copied = self.pieces(off, len, |mem, at, from, n| {
            let (Ok(from), Ok(n)) = (usize::try_from(skip + from), usize::try_from(n)) else {
                return false;
            };
            let Some(disk) = mem.slice(at, n) else {
                return false;
            };
            bad = IoStatus::Invalid;
            let Some(part) = buf.sub(from, n) else {
                return false;
            };
            match req.op {
                IoOp::Read => disk.copy_to(&part),
                _ => part.copy_to(&disk),
            }
            .is_ok()
        });
        if copied {
            IoStatus::Ok
        } else {
            bad
        }
    }

    /// Starts loading disk bytes `[off, off + len)` into the outer caches.
    fn prefetch_disk(&self, off: u64, len: u64) {
        self.pieces(off, len, |mem, at, _, n| {
            let Ok(n) = usize::try_from(n) else {
                return false;
            };
            if let Some(disk) = mem.slice(at, n) {
                disk.prefetch(n);
            }
            true
        });
    }
}

impl IoChannel for RamChannel {
    /// Starts the page walk and the DRAM access of an announced read: its first
    /// lines, not its whole first block (a burst would hold up the caller's own
    /// loads until it has arrived; the rest is requested before the copy).
    /// Writes copy from the client's buffers, not known yet.
    fn announce(&mut self, op: IoOp, offset: u64, len: u64) {
        if op == IoOp::Read && in_range(offset, len, self.size) {
            self.announced = Some(offset);
            self.prefetch_disk(offset, len.min(PREFETCH_NOW as u64));
        }
    }

    fn submit(&mut self, _tag: u64, req: &IoRequest<'_>) -> Option<IoStatus> {
        Some(self.execute(req, None))
    }

    /// Copies the requests in order, each one's successor loading while it is
    /// copied ([`RamChannel::transfer`]); every request finishes inline.
    fn submit_batch(&mut self, batch: &mut dyn Batch) -> usize {
        let mut i = 0;
        while let Some(st) = batch.request(i).map(|(_, req)| {
            let next = batch.request(i + 1).and_then(|(_, n)| self.ahead(&n));
            self.execute(&req, next)
        }) {
            batch.started(i, Some(st));
            i += 1;
        }
        0
    }
}
