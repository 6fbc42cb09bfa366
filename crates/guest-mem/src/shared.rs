use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use crate::region::{MappedRegion, Prot};
use crate::slice::DmaSlice;

/// Memory we create as a memfd and map, so that a peer process can map the same pages
/// from the fd (BAR0's doorbell page; an initiator's DMA pool).
#[derive(Debug)]
pub struct SharedMem {
    fd: OwnedFd,
    map: MappedRegion,
}

impl SharedMem {
    /// A zero-filled memfd of `len` bytes (rounded up to pages), mapped read-write,
    /// and sealed so that the peer we hand it to can neither shrink it (which would
    /// SIGBUS our accesses) nor grow it, nor lift the seals.
    pub fn new(name: &str, len: u64) -> io::Result<Self> {
        let page = crate::page_size() as u64;
        let len = len
            .checked_add(page - 1)
            .map(|l| l / page * page)
            .filter(|l| *l > 0)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "bad shared memory size"))?;
        let cname = CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: memfd_create with a valid NUL-terminated name; result checked.
        let raw = unsafe {
            libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: raw is a fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let flen = libc::off_t::try_from(len)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "size too large"))?;
        // SAFETY: valid fd; plain syscall.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), flen) } < 0 {
            return Err(io::Error::last_os_error());
        }
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: fcntl on our own fd with an integer argument.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
            return Err(io::Error::last_os_error());
        }
        let map = MappedRegion::map_fd(fd.as_fd(), 0, 0, len, Prot::RW)?;
        Ok(SharedMem { fd, map })
    }

    /// Maps a memfd that [`SharedMem::new`] made in an earlier process (handed over
    /// by a supervisor, so that a peer that mapped it keeps seeing the same pages).
    /// It must still be `len` bytes and sealed against resizing, or it is refused.
    pub fn adopt(fd: OwnedFd, len: u64) -> io::Result<Self> {
        let bad = |why: &str| io::Error::new(io::ErrorKind::InvalidData, why.to_string());
        // SAFETY: F_GET_SEALS on an fd we own; integer result checked.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 {
            return Err(io::Error::last_os_error());
        }
        let want = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
        if seals & want != want {
            return Err(bad("shared memory is not sealed against resizing"));
        }
        let size = std::fs::File::from(fd.try_clone()?).metadata()?.len();
        if size != len || len == 0 || !len.is_multiple_of(crate::page_size() as u64) {
            return Err(bad("shared memory has the wrong size"));
        }
        let map = MappedRegion::map_fd(fd.as_fd(), 0, 0, len, Prot::RW)?;
        Ok(SharedMem { fd, map })
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    pub fn len(&self) -> u64 {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Window at byte offset `off`.
    pub fn slice(&self, off: u64, len: usize) -> Option<DmaSlice<'_>> {
        self.map.slice(off, len)
    }

    /// The whole mapping.
    pub fn all(&self) -> DmaSlice<'_> {
        // The mapping is never empty (len is rounded up to at least one page).
        self.map
            .slice(0, self.map.len() as usize)
            .expect("whole mapping is in bounds")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hints take any offset or length (the NVMe poller passes a host-controlled SQ
    /// head): none may fault or change a byte.
    #[test]
    fn prefetch_hints_take_any_offset_and_move_nothing() {
        let a = SharedMem::new("t", 8192).unwrap();
        let s = a.all();
        s.fill(5);
        let w = s.sub(4096, 64).unwrap();
        for off in [0, 63, 64, 4095, 4096, 8191, 8192, 1 << 40, usize::MAX] {
            s.prefetch_line(off);
            w.prefetch_line(off);
            s.prefetch(off);
            w.prefetch(off);
        }
        let mut b = vec![0u8; 8192];
        s.read_into(0, &mut b).unwrap();
        assert!(b.iter().all(|&x| x == 5));
    }

    #[test]
    fn two_mappings_see_the_same_bytes() {
        let a = SharedMem::new("t", 100).unwrap();
        assert_eq!(a.len(), crate::page_size() as u64);
        let b = MappedRegion::map_fd(a.fd(), 0, 0, a.len(), Prot::RW).unwrap();
        a.all().store_u32(8, 0xdead_beef).unwrap();
        assert_eq!(b.slice(8, 4).unwrap().load_u32(0), Some(0xdead_beef));
    }

    #[test]
    fn the_peer_cannot_resize_or_unseal() {
        let a = SharedMem::new("t", 8192).unwrap();
        // A peer gets the same file through the fd it was sent; try as it would.
        let fd = a.fd().as_raw_fd();
        // SAFETY: plain syscalls on our own fd.
        unsafe {
            assert!(libc::ftruncate(fd, 0) < 0, "shrink refused");
            assert!(libc::ftruncate(fd, 1 << 20) < 0, "grow refused");
            assert!(libc::fcntl(fd, libc::F_ADD_SEALS, 0) < 0, "seals sealed");
        }
        assert_eq!(a.all().load_u32(4096), Some(0));
    }

    #[test]
    fn an_adopted_memfd_keeps_its_bytes_and_must_match() {
        let a = SharedMem::new("t", 8192).unwrap();
        a.all().store_u32(4096, 7).unwrap();
        let b = SharedMem::adopt(a.fd().try_clone_to_owned().unwrap(), 8192).unwrap();
        assert_eq!(b.all().load_u32(4096), Some(7));
        assert!(SharedMem::adopt(a.fd().try_clone_to_owned().unwrap(), 4096).is_err());
        let f = tempfile_fd();
        assert!(SharedMem::adopt(f, 8192).is_err(), "unsealed file refused");
    }

    fn tempfile_fd() -> OwnedFd {
        let name = CString::new("unsealed").unwrap();
        // SAFETY: memfd_create with a valid name; result checked.
        let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0);
        // SAFETY: a fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: plain syscall on our fd.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), 8192) }, 0);
        fd
    }
}
