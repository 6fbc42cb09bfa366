//! What a queue writes into guest memory, told to a dirty-page log while the VMM
//! migrates the guest (vhost-user VHOST_F_LOG_ALL).
//!
//! Read data reaches guest buffers without passing through vm-memory (io_uring,
//! librbd and the RAM copy write straight into the slot's `DmaSlice`s), so no
//! vm-memory bitmap sees it: the pages are marked here, when the request completes
//! and before its used entry is published. A slot's slices are host addresses
//! inside its own memory snapshot (`Slot::mem`), which maps them back to
//! guest-physical addresses.

use guest_mem::{DirtyLog, DmaSlice};
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress};

use crate::guest::Mem;
use crate::request::Slot;

/// The guest-physical address of `s`'s first byte in `mem`, if `s` lies in it.
fn gpa_of(mem: &Mem, s: &DmaSlice<'_>) -> Option<u64> {
    let p = s.as_ptr() as usize;
    mem.iter().find_map(|r| {
        let base = r.get_host_address(MemoryRegionAddress(0)).ok()? as usize;
        let off = p.checked_sub(base)?;
        (off < r.len() as usize).then(|| r.start_addr().0 + off as u64)
    })
}

fn mark(log: &DirtyLog, mem: &Mem, s: &DmaSlice<'_>) {
    if let Some(gpa) = gpa_of(mem, s) {
        log.mark(gpa, s.len() as u64);
    }
}

/// Marks what the device wrote for `slot`: its data (reads, GET_ID) and its status
/// byte. Called once the backend is done with the buffers.
pub(crate) fn log_slot(log: &DirtyLog, slot: &Slot) {
    let Some(mem) = &slot.mem else { return };
    if slot.into_guest {
        for s in &slot.data {
            mark(log, mem, s);
        }
    }
    if let Some(s) = &slot.status {
        mark(log, mem, s);
    }
}
