//! Every `unsafe` of the uring backend: aligned bounce buffers, raw iovec copies,
//! block-device ioctls and pushing SQEs that point at memory we keep alive.

use std::alloc::{self, Layout};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

use io_uring::{squeue, IoUring};

/// Alignment of bounce buffers (enough for any logical block size we accept).
pub(super) const ALIGN: usize = 4096;

/// A zero-initialised heap buffer aligned to [`ALIGN`], for O_DIRECT.
pub(super) struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: AlignedBuf exclusively owns its allocation; nothing is thread-bound.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// `len` is rounded up to a multiple of [`ALIGN`] (at least one page).
    pub(super) fn new(len: usize) -> AlignedBuf {
        let len = len.max(1).next_multiple_of(ALIGN);
        let layout = Layout::from_size_align(len, ALIGN).expect("bounce layout");
        // SAFETY: layout has a non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            alloc::handle_alloc_error(layout);
        }
        AlignedBuf { ptr, len }
    }
    pub(super) fn len(&self) -> usize {
        self.len
    }
    pub(super) fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr
    }
    pub(super) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: ptr is a live allocation of len initialised bytes owned by self,
        // borrowed mutably through &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with exactly this layout.
        unsafe { alloc::dealloc(self.ptr, Layout::from_size_align_unchecked(self.len, ALIGN)) }
    }
}

/// Copies of a request's iovecs, kept while the I/O is in flight.
#[derive(Default)]
pub(super) struct Iovecs(pub(super) Vec<libc::iovec>);

// SAFETY: the pointers refer to guest memory that the caller (device model) keeps
// mapped until completion; the channel using them belongs to one thread at a time.
unsafe impl Send for Iovecs {}

/// Copies `src[..total]` into guest buffers described by `dst` (a bounce read's
/// completion).
pub(super) fn copy_to_iovecs(src: &AlignedBuf, dst: &[libc::iovec]) {
    let mut pos = 0usize;
    for v in dst {
        let n = v.iov_len.min(src.len - pos);
        // SAFETY: `dst` are copies of DmaSlice iovecs whose memory the device model
        // keeps alive until we report completion (the IoChannel contract); `src` has
        // at least `pos + n` bytes; guest memory never overlaps our heap buffer.
        unsafe { std::ptr::copy_nonoverlapping(src.ptr.add(pos), v.iov_base.cast::<u8>(), n) };
        pos += n;
    }
}

/// Queues `sqe` on the ring's submission queue; false when it is full.
///
/// # Safety contract (upheld by the channel)
/// Every buffer/iovec pointer inside `sqe` lives in a slot that is not reused or
/// dropped until its completion has been reaped (the channel drains the ring on drop).
pub(super) fn push(ring: &mut IoUring, sqe: &squeue::Entry) -> bool {
    // SAFETY: see the contract above.
    unsafe { ring.submission().push(sqe).is_ok() }
}

const BLKSSZGET: libc::c_ulong = 0x1268; // _IO(0x12, 104)
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272; // _IOR(0x12, 114, u64)

/// (size in bytes, logical block size) of a block device.
pub(super) fn blkdev_geometry(f: &File) -> io::Result<(u64, u32)> {
    let mut size: u64 = 0;
    let mut lbs: libc::c_int = 0;
    // SAFETY: both ioctls write one integer of the given type through the pointer.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), BLKGETSIZE64 as _, &mut size as *mut u64) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), BLKSSZGET as _, &mut lbs as *mut libc::c_int) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((size, lbs as u32))
}

/// One synchronous `preadv2`/`pwritev2` at `offset` (the inline engine): bytes
/// transferred, or a negative errno as io_uring would report it.
///
/// # Safety contract (upheld by the channel)
/// `iov` are copies of DmaSlice iovecs (guest memory kept mapped until the request
/// completes, which for the inline engine is before `submit` returns) or point at a
/// slot's bounce buffer.
pub(super) fn rw_sync(f: &File, write: bool, iov: &[libc::iovec], offset: u64, flags: i32) -> i32 {
    let fd = f.as_raw_fd();
    let cnt = iov.len().min(libc::c_int::MAX as usize) as libc::c_int;
    let off = offset.min(i64::MAX as u64) as libc::off_t;
    // SAFETY: see the contract above; the kernel only accesses `iov[..cnt]` and the
    // memory they describe, for the duration of the call.
    let r = unsafe {
        if write {
            libc::pwritev2(fd, iov.as_ptr(), cnt, off, flags)
        } else {
            libc::preadv2(fd, iov.as_ptr(), cnt, off, flags)
        }
    };
    if r < 0 {
        -io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO)
    } else {
        r.min(i32::MAX as isize) as i32
    }
}

/// `fallocate(mode)` on `[offset, offset + len)`: 0 or a negative errno.
pub(crate) fn fallocate(f: &File, mode: i32, offset: u64, len: u64) -> i32 {
    // SAFETY: fallocate takes only integers; a bad range is an errno, not UB.
    let r = unsafe {
        libc::fallocate(
            f.as_raw_fd(),
            mode,
            offset.min(i64::MAX as u64) as libc::off_t,
            len.min(i64::MAX as u64) as libc::off_t,
        )
    };
    if r < 0 {
        -io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO)
    } else {
        0
    }
}

/// Would io_uring hand this file's reads to a kernel worker thread? It does for
/// files without non-blocking read support (FMODE_NOWAIT), which a one-byte
/// `preadv2(RWF_NOWAIT)` reveals as EOPNOTSUPP (a zero-length read returns before
/// the flag is checked). O_DIRECT files need an aligned buffer for the probe.
pub(super) fn reads_punted(f: &File) -> bool {
    let buf = AlignedBuf::new(ALIGN);
    let iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: ALIGN,
    };
    // SAFETY: one iovec over a live buffer of ALIGN bytes we own.
    let r = unsafe { libc::preadv2(f.as_raw_fd(), &iov, 1, 0, libc::RWF_NOWAIT) };
    r < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EOPNOTSUPP)
}

/// Is the file on a memory filesystem (tmpfs, ramfs, hugetlbfs), where I/O is a
/// copy that never waits for a device?
pub(super) fn memory_backed(f: &File) -> bool {
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    const RAMFS_MAGIC: i64 = 0x8584_58f6;
    const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;
    let mut st = std::mem::MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: fstatfs fills the statfs struct it is given; it is only read on success.
    let r = unsafe { libc::fstatfs(f.as_raw_fd(), st.as_mut_ptr()) };
    if r < 0 {
        return false;
    }
    // SAFETY: fstatfs succeeded, so the struct is initialised.
    // f_type is i64 here but not on every target.
    #[allow(clippy::unnecessary_cast)]
    let t = unsafe { st.assume_init() }.f_type as i64;
    matches!(t, TMPFS_MAGIC | RAMFS_MAGIC | HUGETLBFS_MAGIC)
}
