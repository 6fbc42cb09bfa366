//! The one place that turns guest addresses into host pointers for the bdev layer.

use std::sync::Arc;

use guest_mem::DmaSlice;
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

/// Guest memory as the vhost-user handler maps it (vm-memory, no dirty bitmap).
pub type Mem = GuestMemoryMmap<()>;

/// A window of `len` bytes of guest memory at `addr`, or `None` when the range is not
/// inside one mapped region.
///
/// The slice is `'static` as far as the borrow checker knows; what really keeps it
/// valid is `mem`: the caller stores a clone of that `Arc` next to the slice (in the
/// request slot) and drops both together, so the mapping outlives every use even when
/// the front end replaces the memory table meanwhile.
pub(crate) fn window(mem: &Arc<Mem>, addr: u64, len: u32) -> Option<DmaSlice<'static>> {
    let vs = mem.get_slice(GuestAddress(addr), len as usize).ok()?;
    let ptr = vs.ptr_guard_mut().as_ptr();
    // SAFETY: `get_slice` checked that `addr..addr+len` lies in one mapped region of
    // `mem`; that region stays mapped while any clone of `mem` lives, and the slot
    // that holds this slice holds such a clone (see above). DmaSlice only copies and
    // uses atomics, so a guest writing concurrently is not UB.
    Some(unsafe { DmaSlice::from_raw_parts(ptr, len as usize) })
}
