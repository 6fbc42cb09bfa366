//! The inflight log of one split virtqueue (vhost-user INFLIGHT_SHMFD): shared
//! memory the front end keeps across backend restarts, in which we record every
//! chain head we take from the avail ring until its used entry is written. After a
//! crash the next process resubmits exactly the heads still marked.
//!
//! Layout (QEMU docs/interop/vhost-user.rst, "Inflight I/O tracking", split ring),
//! little endian, one region per queue:
//!
//! ```text
//! header (16 B): features u64 | version u16 | desc_num u16 | last_batch_head u16 | used_idx u16
//! desc[i] (16 B): inflight u8 | padding [u8; 5] | next u16 | counter u64
//! ```
//!
//! The front end never interprets the bytes, but it may be hostile: every value read
//! back is range-checked, and a region too small for the queue is refused.

use std::sync::Arc;

use guest_mem::{DmaSlice, MappedRegion, SharedMem};

const HDR: usize = 16;
const DESC: usize = 16;
const OFF_VERSION: usize = 8;
const OFF_DESC_NUM: usize = 10;
const OFF_LAST_BATCH: usize = 12;
const OFF_USED_IDX: usize = 14;
const D_INFLIGHT: usize = 0;
const D_COUNTER: usize = 8;
/// Version we write into a fresh region.
const VERSION: u16 = 1;
/// Queue regions start on cache-line boundaries.
const ALIGN: usize = 64;

/// Bytes one queue of `queue_size` entries needs.
pub fn queue_region_size(queue_size: u16) -> usize {
    (HDR + DESC * usize::from(queue_size)).div_ceil(ALIGN) * ALIGN
}

/// The mapping behind a device's inflight regions: one we created for
/// GET_INFLIGHT_FD, or the fd the front end handed back with SET_INFLIGHT_FD.
#[derive(Debug)]
pub enum InflightMem {
    Own(SharedMem),
    Mapped(MappedRegion),
}

impl InflightMem {
    fn slice(&self, off: u64, len: usize) -> Option<DmaSlice<'_>> {
        match self {
            InflightMem::Own(m) => m.slice(off, len),
            InflightMem::Mapped(m) => m.slice(off, len),
        }
    }

    fn len(&self) -> u64 {
        match self {
            InflightMem::Own(m) => m.len(),
            InflightMem::Mapped(m) => m.len(),
        }
    }
}

/// One queue's region inside an [`InflightMem`].
#[derive(Clone, Debug)]
pub struct InflightQueue {
    mem: Arc<InflightMem>,
    base: u64,
    /// Descriptor slots the region has room for (from its size, not from the
    /// untrusted `desc_num` field).
    cap: u16,
}

impl InflightQueue {
    /// Region of queue `index` when each queue has room for `queue_size` entries;
    /// `None` if the mapping is too small.
    pub fn new(mem: Arc<InflightMem>, index: usize, queue_size: u16) -> Option<Self> {
        let stride = queue_region_size(queue_size) as u64;
        let base = stride.checked_mul(index as u64)?;
        if base.checked_add(stride)? > mem.len() || queue_size == 0 {
            return None;
        }
        Some(InflightQueue {
            mem,
            base,
            cap: queue_size,
        })
    }

    fn region(&self) -> Option<DmaSlice<'_>> {
        self.mem.slice(self.base, queue_region_size(self.cap))
    }

    fn desc_off(&self, head: u16) -> Option<usize> {
        (head < self.cap).then(|| HDR + DESC * usize::from(head))
    }

    /// A chain with head `head` was taken from the avail ring as the
    /// `counter`-th request: the counter first, then the flag that makes it count.
    #[inline]
    pub fn take(&self, head: u16, counter: u64) {
        if let (Some(r), Some(o)) = (self.region(), self.desc_off(head)) {
            let _ = r.store_u64(o + D_COUNTER, counter);
            let _ = r.store_u8(o + D_INFLIGHT, 1);
        }
    }

    /// About to write `head`'s used entry: if we die before [`Self::used`] finishes,
    /// recovery sees the ring's used index ahead of ours and clears this head.
    #[inline]
    pub fn before_used(&self, head: u16) {
        if let Some(r) = self.region() {
            let _ = r.store_u16(OFF_LAST_BATCH, head);
        }
    }

    /// `head`'s used entry is written and the ring's used index is `used_idx`.
    #[inline]
    pub fn used(&self, head: u16, used_idx: u16) {
        if let (Some(r), Some(o)) = (self.region(), self.desc_off(head)) {
            let _ = r.store_u8(o + D_INFLIGHT, 0);
            // Release: the cleared flag is visible before the index that covers it.
            let _ = r.store_u16(OFF_USED_IDX, used_idx);
        }
    }

    /// Brings the log in line with the ring (whose used index is `ring_used`) and
    /// fills `out` with the heads still in flight, oldest first, as
    /// `(counter, head)`; only heads below `queue_size` count. Returns the counter
    /// to continue from.
    pub fn recover(&self, ring_used: u16, queue_size: u16, out: &mut Vec<(u64, u16)>) -> u64 {
        out.clear();
        let Some(r) = self.region() else {
            return 0;
        };
        if r.load_u16(OFF_VERSION) != Some(VERSION) {
            // Fresh (zeroed) region: nothing was ever logged in it.
            let _ = r.store_u16(OFF_DESC_NUM, self.cap);
            let _ = r.store_u16(OFF_USED_IDX, ring_used);
            let _ = r.store_u16(OFF_VERSION, VERSION);
            return 1;
        }
        if r.load_u16(OFF_USED_IDX) != Some(ring_used) {
            // We died between writing a used entry and clearing its flag: that
            // request completed, so it must not be resubmitted.
            if let Some(o) = r.load_u16(OFF_LAST_BATCH).and_then(|h| self.desc_off(h)) {
                let _ = r.store_u8(o + D_INFLIGHT, 0);
            }
            let _ = r.store_u16(OFF_USED_IDX, ring_used);
        }
        let mut next = 1;
        for head in 0..self.cap.min(queue_size) {
            let Some(o) = self.desc_off(head) else { break };
            match r.load_u8(o + D_INFLIGHT) {
                Some(0) | None => continue,
                Some(1) => {}
                Some(_) => {
                    // Not a value we write: forget it rather than trust it.
                    let _ = r.store_u8(o + D_INFLIGHT, 0);
                    continue;
                }
            }
            let c = r.load_u64(o + D_COUNTER).unwrap_or(0);
            next = next.max(c.saturating_add(1));
            if out.len() < out.capacity() {
                out.push((c, head));
            }
        }
        out.sort_unstable();
        next
    }
}
