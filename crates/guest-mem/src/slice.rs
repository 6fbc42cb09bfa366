use std::marker::PhantomData;
use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64, AtomicU8, Ordering};

use zerocopy::{FromBytes, Immutable, IntoBytes};

const CACHE_LINE: usize = 64;

/// A bounds-checked window into mapped memory that another party (a guest, a client
/// process) may modify concurrently. It never hands out Rust references to the
/// bytes: data moves by copy, shared words by atomics.
#[derive(Clone, Copy, Debug)]
pub struct DmaSlice<'a> {
    ptr: *mut u8,
    len: usize,
    _life: PhantomData<&'a ()>,
}

// SAFETY: the memory behind a DmaSlice is a shared mapping that is valid for 'a and
// accessed only through copies and atomics, which are fine from any thread.
unsafe impl Send for DmaSlice<'_> {}
// SAFETY: as above.
unsafe impl Sync for DmaSlice<'_> {}

/// Out-of-bounds access on a [`DmaSlice`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutOfBounds;

impl<'a> DmaSlice<'a> {
    /// # Safety
    /// `ptr..ptr+len` must be valid for reads and writes for `'a`.
    pub(crate) unsafe fn from_raw(ptr: *mut u8, len: usize) -> Self {
        DmaSlice {
            ptr,
            len,
            _life: PhantomData,
        }
    }

    /// Rebuilds a window from the raw parts of an existing one ([`DmaSlice::as_ptr`],
    /// [`DmaSlice::len`]), e.g. for a backend wrapper that must keep a request's
    /// buffers beyond the caller's stack frame (the iovec array is borrowed only for
    /// `submit`, the memory it points to stays valid until completion).
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid for reads and writes (by copy) for all of `'a`:
    /// in practice it must come from a `DmaSlice` whose mapping or snapshot is kept
    /// alive until the rebuilt slice is no longer used.
    pub unsafe fn from_raw_parts(ptr: *mut u8, len: usize) -> Self {
        // SAFETY: forwarded to the caller.
        unsafe { DmaSlice::from_raw(ptr, len) }
    }

    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Raw address, for handing to the kernel (io_uring, readv/writev). The caller keeps
    /// the owning snapshot alive until the kernel is done.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// The kernel iovec describing this window.
    pub fn as_iovec(&self) -> libc::iovec {
        libc::iovec {
            iov_base: self.ptr.cast(),
            iov_len: self.len,
        }
    }

    pub fn sub(&self, off: usize, len: usize) -> Option<DmaSlice<'a>> {
        let end = off.checked_add(len)?;
        if end > self.len {
            return None;
        }
        // SAFETY: within our own bounds.
        Some(unsafe { DmaSlice::from_raw(self.ptr.add(off), len) })
    }

    fn check(&self, off: usize, len: usize) -> Result<(), OutOfBounds> {
        match off.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(OutOfBounds),
        }
    }

    /// Copies `dst.len()` bytes from offset `off` out of the window.
    pub fn read_into(&self, off: usize, dst: &mut [u8]) -> Result<(), OutOfBounds> {
        self.check(off, dst.len())?;
        // SAFETY: [off, off+len) is inside the mapping (checked above) and `dst` is a
        // private Rust buffer, so the two cannot overlap. The other side may write the
        // shared bytes while we copy: what we rely on is that the copy lands in private
        // memory the guest cannot reach, and callers validate *that* copy (never the
        // shared bytes), so a concurrent change yields a torn value, not a
        // time-of-check/time-of-use hole. Bytes, unlike references, have no invalid
        // values, so a torn copy is still initialized data.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(off), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copies `src` into the window at offset `off`.
    pub fn write_from(&self, off: usize, src: &[u8]) -> Result<(), OutOfBounds> {
        self.check(off, src.len())?;
        // SAFETY: [off, off+len) is inside the mapping (checked above) and `src` is a
        // private Rust buffer, so they cannot overlap; writing shared memory that the
        // other side may read or write concurrently only gives it torn bytes.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(off), src.len()) };
        Ok(())
    }

    /// Copies this whole window into `dst` (which must have the same length).
    pub fn copy_to(&self, dst: &DmaSlice<'_>) -> Result<(), OutOfBounds> {
        if dst.len != self.len {
            return Err(OutOfBounds);
        }
        // SAFETY: both windows are valid for len bytes; `copy` tolerates overlap.
        unsafe { std::ptr::copy(self.ptr, dst.ptr, self.len) };
        Ok(())
    }

    /// Asks the CPU to start loading the first `max` bytes of this window into its
    /// outer caches (L2/LLC, not L1: a copy that follows streams from there, and a
    /// hint into L1 would evict what the current copy uses). A no-op where the
    /// architecture has no such hint.
    pub fn prefetch(&self, max: usize) {
        #[cfg(target_arch = "x86_64")]
        for off in (0..self.len.min(max)).step_by(CACHE_LINE) {
            self.prefetch_at::<{ std::arch::x86_64::_MM_HINT_T2 }>(off);
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = max;
    }

    /// Asks the CPU to load the cache line holding byte `off` into its nearest cache,
    /// for a read that may follow at once. Nothing if `off` lies outside the window or
    /// the architecture has no such hint.
    pub fn prefetch_line(&self, off: usize) {
        #[cfg(target_arch = "x86_64")]
        self.prefetch_at::<{ std::arch::x86_64::_MM_HINT_T0 }>(off);
        #[cfg(not(target_arch = "x86_64"))]
        let _ = off;
    }

    /// One prefetch instruction with `HINT` for the line holding byte `off`, if it
    /// lies inside the window.
    #[cfg(target_arch = "x86_64")]
    fn prefetch_at<const HINT: i32>(&self, off: usize) {
        if off < self.len {
            // SAFETY: SSE, which the instruction needs, is part of every x86_64 CPU;
            // a prefetch never faults nor moves data into the program, and the
            // address lies inside the window anyway (off < len).
            unsafe {
                std::arch::x86_64::_mm_prefetch::<HINT>(
                    self.ptr.wrapping_add(off).cast_const().cast(),
                )
            };
        }
    }

    /// Fills the whole window with `byte`.
    pub fn fill(&self, byte: u8) {
        // SAFETY: the window is valid for len bytes.
        unsafe { std::ptr::write_bytes(self.ptr, byte, self.len) };
    }

    /// Reads a plain-data value at `off`.
    pub fn read_obj<T: FromBytes + IntoBytes>(&self, off: usize) -> Result<T, OutOfBounds> {
        let mut v = T::new_zeroed();
        self.read_into(off, v.as_mut_bytes())?;
        Ok(v)
    }

    /// Writes a plain-data value at `off`.
    pub fn write_obj<T: IntoBytes + Immutable>(
        &self,
        off: usize,
        v: &T,
    ) -> Result<(), OutOfBounds> {
        self.write_from(off, v.as_bytes())
    }

    fn atomic_u32(&self, off: usize) -> Option<&AtomicU32> {
        if !off.is_multiple_of(4) || self.check(off, 4).is_err() {
            return None;
        }
        // SAFETY: in bounds; `ptr + off` is 4-aligned because mappings are page aligned
        // and every slice start we hand out for atomics is checked here.
        let p = unsafe { self.ptr.add(off) };
        if !(p as usize).is_multiple_of(4) {
            return None;
        }
        // SAFETY: aligned, in bounds, valid for 'a; other parties access it with
        // word-sized stores (doorbells, queue entries), so an atomic view is sound.
        Some(unsafe { AtomicU32::from_ptr(p.cast()) })
    }

    /// Acquire-load of a naturally aligned u32 (doorbells, phase words); `None` if
    /// misaligned or out of bounds.
    pub fn load_u32(&self, off: usize) -> Option<u32> {
        self.atomic_u32(off).map(|a| a.load(Ordering::Acquire))
    }

    /// Release-store of a naturally aligned u32.
    pub fn store_u32(&self, off: usize, v: u32) -> Option<()> {
        self.atomic_u32(off).map(|a| a.store(v, Ordering::Release))
    }

    /// A naturally aligned atomic view of `size_of::<A>()` bytes at `off`.
    fn atomic_at<A>(&self, off: usize) -> Option<*mut A> {
        let n = std::mem::size_of::<A>();
        if self.check(off, n).is_err() {
            return None;
        }
        // SAFETY: in bounds (checked above).
        let p = unsafe { self.ptr.add(off) };
        if !(p as usize).is_multiple_of(n) {
            return None;
        }
        Some(p.cast())
    }

    /// Acquire-load of a u8 shared with another party (flags in shared logs).
    pub fn load_u8(&self, off: usize) -> Option<u8> {
        // SAFETY: aligned and in bounds (atomic_at); shared memory is only accessed
        // through atomics and copies, so an atomic view is sound.
        self.atomic_at::<u8>(off)
            .map(|p| unsafe { AtomicU8::from_ptr(p) }.load(Ordering::Acquire))
    }

    /// Release-store of a u8.
    pub fn store_u8(&self, off: usize, v: u8) -> Option<()> {
        // SAFETY: as in load_u8.
        self.atomic_at::<u8>(off)
            .map(|p| unsafe { AtomicU8::from_ptr(p) }.store(v, Ordering::Release))
    }

    /// Sets the bits of `v` in a shared byte (a release read-modify-write: what this
    /// thread wrote before is visible to whoever sees the bits); the old value.
    pub fn fetch_or_u8(&self, off: usize, v: u8) -> Option<u8> {
        // SAFETY: as in load_u8.
        self.atomic_at::<u8>(off)
            .map(|p| unsafe { AtomicU8::from_ptr(p) }.fetch_or(v, Ordering::Release))
    }

    /// Acquire-load of a naturally aligned u16.
    pub fn load_u16(&self, off: usize) -> Option<u16> {
        // SAFETY: as in load_u8.
        self.atomic_at::<u16>(off)
            .map(|p| unsafe { AtomicU16::from_ptr(p) }.load(Ordering::Acquire))
    }

    /// Release-store of a naturally aligned u16.
    pub fn store_u16(&self, off: usize, v: u16) -> Option<()> {
        // SAFETY: as in load_u8.
        self.atomic_at::<u16>(off)
            .map(|p| unsafe { AtomicU16::from_ptr(p) }.store(v, Ordering::Release))
    }

    /// Acquire-load of a naturally aligned u64.
    pub fn load_u64(&self, off: usize) -> Option<u64> {
        // SAFETY: as in load_u8.
        self.atomic_at::<u64>(off)
            .map(|p| unsafe { AtomicU64::from_ptr(p) }.load(Ordering::Acquire))
    }

    /// Release-store of a naturally aligned u64.
    pub fn store_u64(&self, off: usize, v: u64) -> Option<()> {
        // SAFETY: as in load_u8.
        self.atomic_at::<u64>(off)
            .map(|p| unsafe { AtomicU64::from_ptr(p) }.store(v, Ordering::Release))
    }
}
