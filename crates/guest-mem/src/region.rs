use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::fault::{FaultGuard, FaultSignal};
use crate::remote::RemoteDma;
use crate::slice::DmaSlice;

/// Access rights a client granted on a region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prot {
    pub read: bool,
    pub write: bool,
}

impl Prot {
    pub const RW: Prot = Prot {
        read: true,
        write: true,
    };

    fn to_mmap(self) -> libc::c_int {
        let mut p = libc::PROT_NONE;
        if self.read {
            p |= libc::PROT_READ;
        }
        if self.write {
            p |= libc::PROT_WRITE;
        }
        p
    }
}

/// One contiguous mapping of client memory at I/O virtual address `iova`.
/// Unmapped when the last `Arc` to it is dropped.
#[derive(Debug)]
pub struct MappedRegion {
    iova: u64,
    len: usize,
    host: NonNull<u8>,
    prot: Prot,
    /// Client files can shrink under the mapping; see `fault.rs`.
    guard: Option<FaultGuard>,
    /// A mirror of client memory that is not shared: its bytes move through this
    /// port (see `remote.rs`). `None`: the mapping *is* the client's memory.
    remote: Option<Arc<dyn RemoteDma>>,
    /// The client unmapped this mirror: no transfer may reach its memory any more,
    /// even from readers still holding an old snapshot.
    gone: AtomicBool,
}

// SAFETY: the region is a plain memory mapping; the pointer stays valid until drop and
// all access goes through `DmaSlice`, which copies bytes or uses atomics.
unsafe impl Send for MappedRegion {}
// SAFETY: see above; shared references only hand out `DmaSlice`s.
unsafe impl Sync for MappedRegion {}

impl MappedRegion {
    /// Maps `len` bytes of `fd` at `fd_offset` (MAP_SHARED) to represent IOVA `iova`.
    /// A SIGBUS from the file shrinking later is confined to this mapping (it turns
    /// into zero pages); use [`MappedRegion::map_fd_watched`] to learn of it.
    pub fn map_fd(
        fd: BorrowedFd<'_>,
        fd_offset: u64,
        iova: u64,
        len: u64,
        prot: Prot,
    ) -> io::Result<Self> {
        Self::map_fd_watched(fd, fd_offset, iova, len, prot, &FaultSignal::new()?)
    }

    /// [`MappedRegion::map_fd`], raising `signal` if the file shrinks under the
    /// mapping. A regular file (memfd, hugetlbfs, /dev/shm) must hold the whole range.
    pub fn map_fd_watched(
        fd: BorrowedFd<'_>,
        fd_offset: u64,
        iova: u64,
        len: u64,
        prot: Prot,
        signal: &Arc<FaultSignal>,
    ) -> io::Result<Self> {
        let len = check_range(iova, len)?;
        if !fd_offset.is_multiple_of(crate::page_size() as u64) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("fd offset {fd_offset:#x} is not page aligned"),
            ));
        }
        check_file_holds(fd, fd_offset, len as u64)?;
        let off = libc::off_t::try_from(fd_offset)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "fd offset too large"))?;
        // SAFETY: a fresh mapping chosen by the kernel (addr NULL) aliases no Rust object;
        // the result is checked before use.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot.to_mmap(),
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                off,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let mut region = Self::from_raw(iova, len, p, prot);
        // SAFETY: the range is the mapping just made; `Drop` drops the guard before
        // unmapping it.
        region.guard = Some(unsafe { crate::fault::guard_range(p.cast(), len, signal) }?);
        Ok(region)
    }

    /// Anonymous private memory at `iova`: for tests and fake guests.
    pub fn anonymous(iova: u64, len: u64) -> io::Result<Self> {
        let len = check_range(iova, len)?;
        // SAFETY: fresh anonymous mapping, no aliasing; checked before use.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Self::from_raw(iova, len, p, Prot::RW))
    }

    /// A mirror of client memory the client does not share (no fd): private,
    /// sparse anonymous memory of `len` bytes standing for IOVA `iova`, whose
    /// contents move to and from the client through `port` when a reader asks
    /// ([`crate::MemoryMap::fetch`], [`crate::MemoryMap::push`]). Pages cost memory
    /// only once a transfer touched them.
    pub fn mirror(iova: u64, len: u64, prot: Prot, port: Arc<dyn RemoteDma>) -> io::Result<Self> {
        let mut r = Self::anonymous(iova, len)?;
        r.prot = prot;
        r.remote = Some(port);
        Ok(r)
    }

    fn from_raw(iova: u64, len: usize, p: *mut libc::c_void, prot: Prot) -> Self {
        MappedRegion {
            iova,
            len,
            // mmap never returns NULL on success for a NULL hint.
            host: NonNull::new(p.cast()).unwrap_or(NonNull::dangling()),
            prot,
            guard: None,
            remote: None,
            gone: AtomicBool::new(false),
        }
    }

    /// The port of a mirror region (`None`: shared memory).
    pub fn remote(&self) -> Option<&Arc<dyn RemoteDma>> {
        self.remote.as_ref()
    }

    pub fn is_remote(&self) -> bool {
        self.remote.is_some()
    }

    /// Marks a mirror as unmapped by the client: later transfers to it fail
    /// (readers of older snapshots included).
    pub fn set_gone(&self) {
        self.gone.store(true, Ordering::Release);
    }

    pub fn is_gone(&self) -> bool {
        self.gone.load(Ordering::Acquire)
    }

    pub fn iova(&self) -> u64 {
        self.iova
    }
    pub fn len(&self) -> u64 {
        self.len as u64
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn prot(&self) -> Prot {
        self.prot
    }
    /// Last IOVA covered (inclusive).
    pub fn last(&self) -> u64 {
        self.iova + (self.len as u64 - 1)
    }

    /// Window at region offset `off` of `len` bytes, or `None` if out of bounds.
    pub fn slice(&self, off: u64, len: usize) -> Option<DmaSlice<'_>> {
        let off = usize::try_from(off).ok()?;
        let end = off.checked_add(len)?;
        if end > self.len {
            return None;
        }
        // SAFETY: off+len is within the mapping, which lives as long as `self`.
        Some(unsafe { DmaSlice::from_raw(self.host.as_ptr().add(off), len) })
    }
}

impl Drop for MappedRegion {
    fn drop(&mut self) {
        // Unregister first: a fault handler must never touch an unmapped range.
        drop(self.guard.take());
        // SAFETY: host/len describe a mapping we created and nothing borrows it any more
        // (every DmaSlice borrows `self`).
        unsafe {
            libc::munmap(self.host.as_ptr().cast(), self.len);
        }
    }
}

/// Pages of a regular file past its end SIGBUS on access: refuse such a mapping up
/// front with a message naming the sizes. Other files (devices) have no usable size.
fn check_file_holds(fd: BorrowedFd<'_>, off: u64, len: u64) -> io::Result<()> {
    // SAFETY: fstat fills a plain struct for a valid fd.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } < 0 {
        return Err(io::Error::last_os_error());
    }
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Ok(());
    }
    let size = st.st_size as u64;
    if off.checked_add(len).is_none_or(|end| end > size) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("the file holds {size} bytes, fewer than offset {off:#x} + length {len:#x}"),
        ));
    }
    Ok(())
}

fn check_range(iova: u64, len: u64) -> io::Result<usize> {
    if len == 0 {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty region"));
    }
    if iova.checked_add(len - 1).is_none() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("region {iova:#x}+{len:#x} wraps the address space"),
        ));
    }
    usize::try_from(len)
        .ok()
        .filter(|l| *l <= isize::MAX as usize)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "region too large"))
}

impl MappedRegion {
    /// Asks the kernel to back this anonymous region with transparent huge pages
    /// (`MADV_HUGEPAGE`; effective when THP is `always` or `madvise`). A random 4 KiB
    /// access to a large region then costs no page walk: with 4 KiB pages a 1 GiB
    /// RAM disk needs 2 MiB of page tables and misses the TLB on nearly every I/O.
    /// The price: memory is reserved in 2 MiB extents as they are first written.
    /// Best effort: the kernel may refuse (no THP), which only loses the speed-up.
    pub fn advise_hugepages(&self) -> bool {
        // SAFETY: the range is exactly our own mapping; MADV_HUGEPAGE changes how the
        // kernel backs it, not its contents or validity.
        unsafe { libc::madvise(self.host.as_ptr().cast(), self.len, libc::MADV_HUGEPAGE) == 0 }
    }

    /// Drops the pages of `[off, off+len)` of a private anonymous region so they read
    /// back as zeroes and stop using memory. Partial pages at the edges are zeroed.
    pub fn discard(&self, off: u64, len: u64) -> Option<()> {
        let s = self.slice(off, usize::try_from(len).ok()?)?;
        let page = crate::page_size() as u64;
        let start = off.div_ceil(page) * page;
        let end = (off + len) / page * page;
        if end > start {
            s.sub(0, (start - off) as usize)?.fill(0);
            s.sub((end - off) as usize, (off + len - end) as usize)?
                .fill(0);
            // SAFETY: [start,end) lies inside our mapping; MADV_DONTNEED on a private
            // anonymous mapping only replaces the pages with zero pages.
            unsafe {
                libc::madvise(
                    self.host.as_ptr().add(start as usize).cast(),
                    (end - start) as usize,
                    libc::MADV_DONTNEED,
                );
            }
        } else {
            s.fill(0);
        }
        Some(())
    }
}
