//! The RBD backend's I/O path into librbd: asynchronous requests whose
//! completions librbd's threads hand back to the submitting channel through its
//! [`Sink`]. (The control calls are in `ffi.rs`.)

#![allow(non_camel_case_types)]

use std::ffi::{c_int, c_void};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crossbeam_queue::ArrayQueue;

use super::error::RbdError;
use super::ffi::{check, rbd_image_t, Image};

type rbd_completion_t = *mut c_void;
type rbd_callback_t = extern "C" fn(rbd_completion_t, *mut c_void);

#[link(name = "rbd")]
extern "C" {
    fn rbd_aio_create_completion(
        arg: *mut c_void,
        cb: rbd_callback_t,
        c: *mut rbd_completion_t,
    ) -> c_int;
    fn rbd_aio_get_return_value(c: rbd_completion_t) -> isize;
    fn rbd_aio_release(c: rbd_completion_t);
    fn rbd_aio_readv(
        image: rbd_image_t,
        iov: *const libc::iovec,
        iovcnt: c_int,
        off: u64,
        c: rbd_completion_t,
    ) -> c_int;
    fn rbd_aio_writev(
        image: rbd_image_t,
        iov: *const libc::iovec,
        iovcnt: c_int,
        off: u64,
        c: rbd_completion_t,
    ) -> c_int;
    fn rbd_aio_flush(image: rbd_image_t, c: rbd_completion_t) -> c_int;
    fn rbd_aio_discard(image: rbd_image_t, off: u64, len: u64, c: rbd_completion_t) -> c_int;
    fn rbd_aio_write_zeroes(
        image: rbd_image_t,
        off: u64,
        len: usize,
        c: rbd_completion_t,
        zero_flags: c_int,
        op_flags: c_int,
    ) -> c_int;
}

/// Where librbd's threads hand finished requests back to one channel: a bounded
/// lock-free queue of (slot, return value) the channel drains in `poll()` without
/// a syscall, and an eventfd written only while the channel's reactor sleeps.
pub struct Sink {
    done: ArrayQueue<(u32, i64)>,
    /// Set by a reactor about to sleep; the completing thread that clears it
    /// writes `wake`.
    armed: AtomicBool,
    wake: File,
    /// One callback argument per slot, at a stable address inside this Arc.
    slots: Box<[SlotArg]>,
}

struct SlotArg {
    index: u32,
    sink: *const Sink,
}

// SAFETY: `SlotArg::sink` points at the Sink that contains it (inside an Arc that
// each in-flight request keeps alive); it is only read.
unsafe impl Send for SlotArg {}
// SAFETY: as above.
unsafe impl Sync for SlotArg {}

impl Sink {
    pub fn new(slots: u32) -> Result<Arc<Sink>, RbdError> {
        // SAFETY: plain syscall; the result is checked before use.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(RbdError::Notifier(io::Error::last_os_error()));
        }
        // SAFETY: `fd` is a new descriptor that nothing else owns.
        let wake = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        Ok(Arc::new_cyclic(|weak| Sink {
            done: ArrayQueue::new(usize::try_from(slots).unwrap_or(1).max(1)),
            armed: AtomicBool::new(false),
            wake,
            slots: (0..slots)
                .map(|index| SlotArg {
                    index,
                    sink: weak.as_ptr(),
                })
                .collect(),
        }))
    }

    pub fn pop(&self) -> Option<(u32, i64)> {
        self.done.pop()
    }

    /// Before sleeping: returns false if completions are waiting (poll instead).
    pub fn arm(&self) -> bool {
        // Consume an old wake-up so that the fd polls readable only for new ones.
        // Still armed from the last sleep means no completing thread wrote since
        // (it clears the flag before writing): nothing to consume, no syscall.
        if !self.armed.swap(true, Ordering::SeqCst) {
            let _ = (&self.wake).read(&mut [0u8; 8]);
        }
        if self.done.is_empty() {
            true
        } else {
            self.armed.store(false, Ordering::SeqCst);
            false
        }
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.wake.as_fd()
    }

    fn complete(&self, index: u32, ret: i64) {
        // Each slot is in flight at most once and the queue holds one entry per
        // slot, so this push cannot fail.
        let _ = self.done.push((index, ret));
        if self.armed.swap(false, Ordering::SeqCst) {
            let _ = (&self.wake).write(&1u64.to_ne_bytes());
        }
    }
}

extern "C" fn on_complete(c: rbd_completion_t, arg: *mut c_void) {
    // SAFETY: `arg` is the `SlotArg` passed to `rbd_aio_create_completion` by
    // `submit`, inside a Sink kept alive by the strong count `submit` took.
    let slot = unsafe { &*(arg as *const SlotArg) };
    // SAFETY: `c` is this request's live completion; released exactly once here.
    let ret = unsafe {
        let ret = rbd_aio_get_return_value(c);
        rbd_aio_release(c);
        ret
    };
    // SAFETY: the Sink is alive (strong count held for this request).
    let sink = unsafe { &*slot.sink };
    sink.complete(
        slot.index,
        i64::try_from(ret).unwrap_or(-i64::from(libc::EIO)),
    );
    // SAFETY: drops the strong count `submit` took for this request; `slot` and
    // `sink` are not touched after it.
    unsafe { Arc::decrement_strong_count(slot.sink) };
}

/// One asynchronous librbd request.
pub enum Aio<'a> {
    Readv(&'a [libc::iovec], u64),
    Writev(&'a [libc::iovec], u64),
    Flush,
    Discard(u64, u64),
    WriteZeroes(u64, usize),
}

impl Image {
    /// Starts `op`; its completion reaches `sink` as slot `slot`.
    ///
    /// # Safety
    /// For reads and writes, the iovec array and the memory it points to must stay
    /// valid until the completion for `slot` has been popped from `sink` (librbd
    /// keeps the array's address for a read until it completes). `slot` must be
    /// below the sink's slot count and not in flight.
    pub unsafe fn submit(&self, sink: &Arc<Sink>, slot: u32, op: Aio<'_>) -> Result<(), RbdError> {
        let Some(arg) = sink.slots.get(usize::try_from(slot).unwrap_or(usize::MAX)) else {
            return Err(RbdError::NoSlot(slot));
        };
        let mut c: rbd_completion_t = ptr::null_mut();
        // SAFETY: `arg` lives inside the Sink, which stays alive for the callback
        // through the strong count taken below.
        let ret = unsafe {
            rbd_aio_create_completion(arg as *const SlotArg as *mut c_void, on_complete, &mut c)
        };
        check(ret, || "cannot create a librbd completion".into())?;
        // The callback drops this count; it may run before the aio call returns.
        // SAFETY: `arg.sink` is the pointer of a live Arc<Sink> (the caller's).
        unsafe { Arc::increment_strong_count(arg.sink) };
        let count = |iov: &[libc::iovec]| c_int::try_from(iov.len()).unwrap_or(c_int::MAX);
        // SAFETY: live image and completion; buffers valid until completion per
        // this function's contract.
        let ret = unsafe {
            match op {
                Aio::Readv(iov, off) => rbd_aio_readv(self.raw, iov.as_ptr(), count(iov), off, c),
                Aio::Writev(iov, off) => rbd_aio_writev(self.raw, iov.as_ptr(), count(iov), off, c),
                Aio::Flush => rbd_aio_flush(self.raw, c),
                Aio::Discard(off, len) => rbd_aio_discard(self.raw, off, len, c),
                Aio::WriteZeroes(off, len) => rbd_aio_write_zeroes(self.raw, off, len, c, 0, 0),
            }
        };
        if ret < 0 {
            // Not queued: the callback will not run.
            // SAFETY: the completion was never handed to librbd's I/O path; the
            // count taken above is ours to drop.
            unsafe {
                rbd_aio_release(c);
                Arc::decrement_strong_count(arg.sink);
            }
            return Err(RbdError::call(
                i64::from(ret),
                "librbd refused the request".into(),
            ));
        }
        Ok(())
    }
}

/// A request's buffer list as the iovec array librbd reads (and, for a read, keeps
/// until completion). One per request slot, reused: allocation-free once its
/// capacity has grown to the longest list.
#[derive(Default)]
pub struct IoVecs(Vec<libc::iovec>);

// SAFETY: the raw pointers are addresses of the caller's request buffers, used
// only by librbd for a request submitted from the owning channel's thread.
unsafe impl Send for IoVecs {}

impl IoVecs {
    pub fn set(&mut self, iov: &[guest_mem::DmaSlice<'_>]) {
        self.0.clear();
        self.0.extend(iov.iter().map(|s| libc::iovec {
            iov_base: s.as_ptr().cast(),
            iov_len: s.len(),
        }));
    }

    pub fn as_slice(&self) -> &[libc::iovec] {
        &self.0
    }

    pub fn clear(&mut self) {
        self.0.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn readable(sink: &Sink) -> bool {
        let mut fds = [libc::pollfd {
            fd: std::os::fd::AsRawFd::as_raw_fd(&sink.fd()),
            events: libc::POLLIN,
            revents: 0,
        }];
        // SAFETY: one valid pollfd, no timeout.
        unsafe { libc::poll(fds.as_mut_ptr(), 1, 0) == 1 }
    }

    /// The notifier is readable exactly when an armed sink got a completion, and
    /// each wake-up is consumed by the next arm (whether or not that arm reads).
    #[test]
    fn the_notifier_fires_once_per_armed_sleep() {
        let sink = Sink::new(4).unwrap();
        sink.complete(0, 0);
        assert!(!readable(&sink), "unarmed: no wake-up");
        assert!(!sink.arm(), "a completion is waiting: poll instead");
        assert_eq!(sink.pop(), Some((0, 0)));
        for round in 0..3 {
            assert!(sink.arm(), "round {round}: nothing waiting");
            assert!(!readable(&sink), "round {round}: stale wake-up");
            sink.complete(1, -5);
            assert!(readable(&sink), "round {round}: armed sink not woken");
            sink.complete(2, 0);
            assert_eq!(sink.pop(), Some((1, -5)));
            assert_eq!(sink.pop(), Some((2, 0)));
        }
        // Re-armed without a completion in between (the reactor woke for another
        // reason): still quiet, and the next completion still wakes it.
        assert!(sink.arm());
        assert!(sink.arm());
        assert!(!readable(&sink));
        sink.complete(3, 0);
        assert!(readable(&sink));
    }
}
