//! Guest memory for udrive: the only crate (with `io_uring` buffers later) that
//! turns addresses a client hands us into host pointers.
//!
//! * [`MappedRegion`] — one fd-backed (or anonymous) mapping, unmapped on drop.
//! * [`MemoryMap`] — an immutable snapshot of a client's DMA regions. Changes build a
//!   new snapshot; readers keep using the old one until they drop it, which is what
//!   makes DMA_UNMAP safe against in-flight I/O (see `docs/decisions/0002-memory-snapshots.md`).
//! * [`SharedMem`] — a memfd we create and map ourselves (doorbell page, an
//!   initiator's DMA pool) so another process can map the same pages.
//! * [`DmaSlice`] — a bounds-checked window into any of those, with copy and atomic
//!   accessors. Its lifetime ties it to the snapshot or mapping it came from.
//! * [`DirtyLog`] — a VMM's dirty-page log during live migration: the pages we
//!   write behind its back (DMA into guest buffers) are marked there.
//! * [`HeldIov`] — a request's buffer list kept by a backend wrapper past `submit`.
//! * Mirrors ([`MappedRegion::mirror`], [`RemoteDma`]) — client memory shared
//!   without a file descriptor, kept in step by messages at the points the reader
//!   names ([`MemoryMap::fetch`], [`MemoryMap::push`]); see `remote.rs`.

mod dirty;
mod fault;
mod held;
mod map;
mod pins;
mod region;
mod remote;
mod shared;
mod slice;
mod space;

pub use dirty::{DirtyLog, LOG_PAGE};
pub use fault::{guard_range, repaired_faults, FaultGuard, FaultSignal, MAX_GUARDED_RANGES};
pub use held::HeldIov;
pub use map::{Access, MemError, MemoryMap};
pub use pins::{MemPins, Pin};
pub use region::{MappedRegion, Prot};
pub use remote::{
    no_remote_waits, NoRemoteWaits, RemoteDir, RemoteDma, RemoteError, RemoteOp, RemotePause,
};
pub use shared::SharedMem;
pub use slice::{DmaSlice, OutOfBounds};
pub use space::{DmaSpace, MemView};

/// The host page size (mmap granularity).
pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let v = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if v <= 0 {
        4096
    } else {
        v as usize
    }
}
