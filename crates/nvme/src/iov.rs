//! A fixed-capacity iovec of guest memory slices built without heap allocation.
//! One [`Iov`] can also hold the iovecs of several commands one after the other (a
//! batch is parsed before it is submitted, see `io/poll.rs`); each command still gets
//! at most [`MAX_IOV`] segments.
//!
//! When the map has mirrors of unshared client memory (`guest_mem::MemoryMap::
//! has_remote`), the iovec also keeps each command's guest ranges (IOVA, length),
//! which the caller fetches before the device reads them or pushes after it wrote
//! them (docs/decisions/0020-dma-messages.md). Otherwise nothing is recorded.

use guest_mem::{Access, DmaSlice, MemoryMap};
use smallvec::SmallVec;

use crate::status::Status;

pub(crate) const PAGE: u64 = 4096;
/// Enough for the largest MDTS we accept (2^7 pages) plus an unaligned first page.
pub(crate) const MAX_IOV: usize = 130;
pub(crate) const MAX_MDTS: u8 = 7;
/// Segments one [`Iov`] holds for all its commands. `SmallVec` (inline, never
/// spilled: pushes stop at the per-command limit, which stays below this) so that
/// making an `Iov` does not write its 4 KiB of storage, which a plain array must.
const POOL: usize = 256;

/// MDTS we advertise and enforce: the configured value capped by the iovec size
/// (0, "unlimited" in the spec, becomes the cap too).
pub(crate) fn effective_mdts(cfg: u8) -> u8 {
    if cfg == 0 {
        MAX_MDTS
    } else {
        cfg.min(MAX_MDTS)
    }
}

/// A guest range as (IOVA, length).
pub(crate) type Run = (u64, u64);

pub(crate) struct Iov<'a> {
    segs: SmallVec<[DmaSlice<'a>; POOL]>,
    /// Guest ranges of every command held, with a map that has mirrors only.
    runs: SmallVec<[Run; 8]>,
    /// First run of the current command.
    runs_first: usize,
    /// First segment of the current command.
    first: usize,
    /// Segment count at which the current command overflows.
    limit: usize,
    total: u64,
    run_start: u64,
    run_len: u64,
    /// Status reported when the array overflows (SGL: too many descriptors).
    overflow: Status,
}

impl<'a> Iov<'a> {
    /// Inlined into the caller so the value is built where it stays: a call returns
    /// it through a temporary that is then moved, a 4 KiB `memcpy` on every poll of
    /// every queue group (measured: 23 % of a reactor's time with deep RBD queues).
    #[inline(always)]
    pub fn new() -> Iov<'a> {
        Iov {
            segs: SmallVec::new(),
            runs: SmallVec::new(),
            runs_first: 0,
            first: 0,
            limit: MAX_IOV,
            total: 0,
            run_start: 0,
            run_len: 0,
            overflow: Status::INVALID_SGL_COUNT,
        }
    }

    /// Appends guest range `[addr, addr+len)`, merging it with the previous range when
    /// it continues it (PRP pages of one physically contiguous buffer).
    pub fn add(
        &mut self,
        map: &'a MemoryMap,
        addr: u64,
        len: u64,
        access: Access,
    ) -> Result<(), Status> {
        if len == 0 {
            return Ok(());
        }
        addr.checked_add(len).ok_or(Status::DATA_TRANSFER_ERROR)?;
        if self.run_len > 0 && self.run_start.checked_add(self.run_len) == Some(addr) {
            self.run_len = self
                .run_len
                .checked_add(len)
                .ok_or(Status::DATA_TRANSFER_ERROR)?;
            return Ok(());
        }
        self.flush(map, access)?;
        self.run_start = addr;
        self.run_len = len;
        Ok(())
    }

    /// Closes the pending range; call once after the last `add`.
    pub fn finish(&mut self, map: &'a MemoryMap, access: Access) -> Result<(), Status> {
        self.flush(map, access)
    }

    fn flush(&mut self, map: &'a MemoryMap, access: Access) -> Result<(), Status> {
        if self.run_len == 0 {
            return Ok(());
        }
        let (start, len) = (self.run_start, self.run_len);
        self.run_len = 0;
        if map.has_remote() {
            self.runs.push((start, len));
        }
        let ulen = usize::try_from(len).map_err(|_| Status::DATA_TRANSFER_ERROR)?;
        if let Ok(s) = map.translate(start, ulen, access) {
            return self.push(s, len);
        }
        // A merged run may straddle two adjacent regions: retry page by page.
        let end = start.checked_add(len).ok_or(Status::DATA_TRANSFER_ERROR)?;
        let mut a = start;
        while a < end {
            let chunk = (end - a).min(PAGE - (a % PAGE));
            let s = map
                .translate(a, chunk as usize, access)
                .map_err(|_| Status::DATA_TRANSFER_ERROR)?;
            self.push(s, chunk)?;
            a += chunk;
        }
        Ok(())
    }

    fn push(&mut self, s: DmaSlice<'a>, len: u64) -> Result<(), Status> {
        if self.segs.len() >= self.limit {
            return Err(self.overflow);
        }
        self.segs.push(s);
        self.total = self.total.saturating_add(len);
        Ok(())
    }

    /// Whether another command fits after the ones held (each may need
    /// [`MAX_IOV`] segments).
    pub fn has_room(&self) -> bool {
        self.segs.len() + MAX_IOV <= POOL
    }

    /// Starts the next command's segments after the ones held. Call only when
    /// [`Iov::has_room`]; a failed walk may leave segments behind, which is harmless
    /// (they are not in any command's range).
    pub fn next_command(&mut self) {
        self.first = self.segs.len();
        self.runs_first = self.runs.len();
        self.limit = self.first + MAX_IOV;
        self.total = 0;
        self.run_len = 0;
        self.overflow = Status::INVALID_SGL_COUNT;
    }

    /// Forgets every command's segments.
    pub fn clear(&mut self) {
        self.segs.clear();
        self.runs.clear();
        self.next_command();
    }

    /// Where the current command's guest ranges are, for [`Iov::runs_of`] (empty
    /// unless the map has mirrors).
    pub fn run_range(&self) -> (u16, u16) {
        let clamp = |n: usize| u16::try_from(n).unwrap_or(u16::MAX);
        (clamp(self.runs_first), clamp(self.runs.len()))
    }

    /// A command's guest ranges by its [`Iov::run_range`].
    pub fn runs_of(&self, (start, end): (u16, u16)) -> &[Run] {
        self.runs
            .get(usize::from(start)..usize::from(end))
            .unwrap_or(&[])
    }

    /// The current command's guest ranges.
    pub fn runs(&self) -> &[Run] {
        self.runs.get(self.runs_first..).unwrap_or(&[])
    }

    /// Where the current command's segments are, for [`Iov::segments`].
    pub fn range(&self) -> (u16, u16) {
        // Both are at most POOL.
        (self.first as u16, self.segs.len() as u16)
    }

    /// A command's segments by its [`Iov::range`].
    pub fn segments(&self, (start, end): (u16, u16)) -> &[DmaSlice<'a>] {
        self.segs
            .get(usize::from(start)..usize::from(end))
            .unwrap_or(&[])
    }

    /// The current command's segments.
    pub fn slices(&self) -> &[DmaSlice<'a>] {
        self.segs.get(self.first..).unwrap_or(&[])
    }

    /// Copies `data` into the buffers in order (short buffers truncate).
    pub fn copy_out(&self, data: &[u8]) {
        let mut off = 0usize;
        for s in self.slices() {
            let Some(chunk) = data.get(off..off.saturating_add(s.len()).min(data.len())) else {
                return;
            };
            let _ = s.write_from(0, chunk);
            off += chunk.len();
        }
    }

    /// Fills `buf` from the buffers in order.
    pub fn copy_in(&self, buf: &mut [u8]) {
        let mut off = 0usize;
        for s in self.slices() {
            let end = off.saturating_add(s.len()).min(buf.len());
            let Some(chunk) = buf.get_mut(off..end) else {
                return;
            };
            let _ = s.read_into(0, chunk);
            off = end;
        }
    }
}
