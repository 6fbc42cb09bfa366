//! The fake front end's guest RAM: what QEMU's memory backends hand a vhost-user
//! device.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd};

use guest_mem::{DmaSlice, MappedRegion, Prot, SharedMem};

/// A test guest's RAM: a sealed memfd (QEMU's `memory-backend-memfd`) or a plain
/// file the guest's VMM can shrink under the device (`memory-backend-file`).
pub enum GuestRam {
    Sealed(SharedMem),
    File(File, MappedRegion),
}

impl From<SharedMem> for GuestRam {
    fn from(m: SharedMem) -> GuestRam {
        GuestRam::Sealed(m)
    }
}

impl GuestRam {
    /// A sealed memfd of `len` bytes.
    pub fn sealed(len: u64) -> GuestRam {
        GuestRam::Sealed(SharedMem::new("fake-guest-ram", len).expect("guest memfd"))
    }

    /// An unlinked plain file of `len` bytes, mapped here.
    pub fn file(len: u64) -> GuestRam {
        let f = tempfile::tempfile().expect("guest RAM file");
        f.set_len(len).expect("size guest RAM file");
        let map = MappedRegion::map_fd(f.as_fd(), 0, 0, len, Prot::RW).expect("map guest RAM");
        GuestRam::File(f, map)
    }

    pub fn all(&self) -> DmaSlice<'_> {
        match self {
            GuestRam::Sealed(m) => m.all(),
            GuestRam::File(_, map) => map
                .slice(0, usize::try_from(map.len()).expect("RAM fits"))
                .expect("whole map"),
        }
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        match self {
            GuestRam::Sealed(m) => m.fd(),
            GuestRam::File(f, _) => f.as_fd(),
        }
    }

    /// The plain file behind this RAM (to shrink it), if it is one.
    pub fn file_handle(&self) -> Option<&File> {
        match self {
            GuestRam::Sealed(_) => None,
            GuestRam::File(f, _) => Some(f),
        }
    }
}
