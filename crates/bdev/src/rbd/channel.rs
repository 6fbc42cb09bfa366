//! One reactor's path to an RBD image: preallocated request slots, completions
//! from librbd's threads through the channel's [`Sink`].

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::Arc;
use std::time::Duration;

use super::aio::{Aio, IoVecs, Sink};
use super::ffi::Image;
use crate::{in_range, Armed, BlockInfo, IoChannel, IoOp, IoRequest, IoStatus};

/// Requests one channel has in flight at most. librbd queues without bound, so
/// this only sizes the slot table; [`IoChannel::room`] keeps a reserve of
/// [`RESERVE`] for commands that need several requests.
const SLOTS: u32 = 1024;
const RESERVE: usize = 64;

struct Slot {
    tag: u64,
    op: IoOp,
    /// A FUA write whose flush is still to be issued.
    fua: bool,
    iov: IoVecs,
}

pub struct RbdChannel {
    image: Arc<Image>,
    sink: Arc<Sink>,
    size: u64,
    read_only: bool,
    slots: Vec<Slot>,
    free: Vec<u32>,
    inflight: usize,
}

impl RbdChannel {
    pub fn new(image: Arc<Image>, info: &BlockInfo) -> io::Result<RbdChannel> {
        Ok(RbdChannel {
            image,
            sink: Sink::new(SLOTS)?,
            size: info.size_bytes(),
            read_only: info.read_only,
            slots: (0..SLOTS)
                .map(|_| Slot {
                    tag: 0,
                    op: IoOp::Flush,
                    fua: false,
                    iov: IoVecs::default(),
                })
                .collect(),
            free: (0..SLOTS).rev().collect(),
            inflight: 0,
        })
    }

    /// Issues slot `i`'s request; on refusal the slot is free again.
    fn start(&mut self, i: u32, offset: u64, len: u64) -> Result<(), IoStatus> {
        let slot = &self.slots[i as usize];
        let op = match slot.op {
            IoOp::Read => Aio::Readv(slot.iov.as_slice(), offset),
            IoOp::Write => Aio::Writev(slot.iov.as_slice(), offset),
            IoOp::Flush => Aio::Flush,
            IoOp::Discard => Aio::Discard(offset, len),
            IoOp::WriteZeroes => match usize::try_from(len) {
                Ok(len) => Aio::WriteZeroes(offset, len),
                Err(_) => return Err(IoStatus::Invalid),
            },
        };
        // SAFETY: the slot's iovec array stays untouched until its completion is
        // popped in `poll` (the slot is not free meanwhile), and the buffers it
        // points to stay valid until the request's completion is reported (the
        // backend contract, crate::BlockDevice); `Drop` waits for every request.
        match unsafe { self.image.submit(&self.sink, i, op) } {
            Ok(()) => {
                self.inflight += 1;
                Ok(())
            }
            Err(e) => {
                tracing::warn!(errno = e.errno(), "rbd: {e}");
                Err(status(slot.op, -i64::from(e.errno().unwrap_or(libc::EIO))))
            }
        }
    }
}

/// A librbd result for `op`.
fn status(op: IoOp, ret: i64) -> IoStatus {
    if ret >= 0 {
        return IoStatus::Ok;
    }
    match i32::try_from(-ret).unwrap_or(libc::EIO) {
        libc::EROFS => IoStatus::ReadOnly,
        libc::ENOSPC | libc::EDQUOT => IoStatus::NoSpace,
        libc::EINVAL => IoStatus::Invalid,
        libc::EOPNOTSUPP => IoStatus::Unsupported,
        _ if op == IoOp::Read => IoStatus::ReadError,
        _ => IoStatus::IoError,
    }
}

impl IoChannel for RbdChannel {
    fn submit(&mut self, tag: u64, req: &IoRequest<'_>) -> Option<IoStatus> {
        if req.op != IoOp::Flush && !in_range(req.offset, req.len, self.size) {
            return Some(IoStatus::OutOfRange);
        }
        if self.read_only && req.op != IoOp::Read && req.op != IoOp::Flush {
            return Some(IoStatus::ReadOnly);
        }
        if matches!(req.op, IoOp::Read | IoOp::Write) {
            let total: u64 = req.iov.iter().map(|b| b.len() as u64).sum();
            if total != req.len || req.iov.len() > i32::MAX as usize {
                return Some(IoStatus::Invalid);
            }
        }
        let Some(i) = self.free.pop() else {
            // Only when a front end ignores `room` by more than the reserve.
            tracing::warn!("rbd: {SLOTS} requests in flight on one channel; failing one");
            return Some(IoStatus::IoError);
        };
        let slot = &mut self.slots[i as usize];
        slot.tag = tag;
        slot.op = req.op;
        slot.fua = req.fua && req.op == IoOp::Write;
        slot.iov.set(req.iov);
        match self.start(i, req.offset, req.len) {
            Ok(()) => None,
            Err(st) => {
                self.slots[i as usize].iov.clear();
                self.free.push(i);
                Some(st)
            }
        }
    }

    fn poll(&mut self, done: &mut dyn FnMut(u64, IoStatus)) -> usize {
        let mut n = 0;
        while let Some((i, ret)) = self.sink.pop() {
            self.inflight -= 1;
            let Some(slot) = self.slots.get_mut(i as usize) else {
                continue;
            };
            if slot.fua && ret >= 0 {
                // The write is in; make it durable before reporting it.
                slot.fua = false;
                slot.op = IoOp::Flush;
                slot.iov.clear();
                match self.start(i, 0, 0) {
                    Ok(()) => continue,
                    Err(st) => {
                        let tag = self.slots[i as usize].tag;
                        self.free.push(i);
                        done(tag, st);
                        n += 1;
                        continue;
                    }
                }
            }
            slot.iov.clear();
            let (tag, op) = (slot.tag, slot.op);
            self.free.push(i);
            done(tag, status(op, ret));
            n += 1;
        }
        n
    }

    fn room(&self) -> usize {
        self.free.len().saturating_sub(RESERVE)
    }

    fn arm_notifier(&mut self) -> Armed {
        if self.sink.arm() {
            Armed::Fd
        } else {
            Armed::Ready
        }
    }

    fn notifier(&self) -> Option<BorrowedFd<'_>> {
        Some(self.sink.fd())
    }

    /// Every request is a round trip to an OSD.
    fn slow_completions(&self) -> bool {
        true
    }
}

impl RbdChannel {
    /// Drops the completions waiting in the sink; whether none is in flight now.
    fn forget_done(&mut self) -> bool {
        while self.sink.pop().is_some() {
            self.inflight -= 1;
        }
        self.inflight == 0
    }
}

impl Drop for RbdChannel {
    fn drop(&mut self) {
        // librbd may still write into the buffers of requests in flight; their
        // completions are not reported (the contract), but we must outlive them.
        let pause = Duration::from_millis(1);
        if engine::wait_until(Duration::from_secs(5), pause, || self.forget_done()) {
            return;
        }
        tracing::warn!(
            "rbd: waiting for {} requests before closing a channel (fd {})",
            self.inflight,
            self.sink.fd().as_raw_fd()
        );
        engine::wait_until(Duration::MAX, pause, || self.forget_done());
    }
}
