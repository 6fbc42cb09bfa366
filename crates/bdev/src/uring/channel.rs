//! The per-thread io_uring channel.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use io_uring::register::Restriction;
use io_uring::{opcode, squeue, types, IoUring};

use super::sys::{self, AlignedBuf, Iovecs};
use crate::{in_range, BlockInfo, IoChannel, IoOp, IoRequest, IoStatus};

/// Ring entries per channel (SQ; the CQ has twice as many).
const ENTRIES: u32 = 256;
/// Guest buffers whose base or length is not a multiple of this are bounced
/// under O_DIRECT.
const MEM_ALIGN: usize = 512;
/// Bounce buffers up to this size stay with their slot for reuse.
pub(super) const KEEP_BOUNCE: usize = 1 << 20;
/// Size of the zero buffer used by the synchronous write-zeroes fallback.
const ZERO_CHUNK: usize = 256 << 10;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Read,
    Write,
    Fsync,
    ZeroRange,
    Punch,
}

struct Slot {
    tag: u64,
    kind: Kind,
    /// Current file offset and bytes still to transfer (advance on short I/O).
    offset: u64,
    remaining: u64,
    fua: bool,
    /// What the kernel reads/writes now: guest iovecs, or the bounce buffer.
    iov: Iovecs,
    /// Bounced read: where the data goes when it completes.
    guest: Iovecs,
    bounce: Option<AlignedBuf>,
    bounced: bool,
    /// Original length (bounce copy-out).
    len: u64,
}

impl Slot {
    fn new() -> Slot {
        Slot {
            tag: 0,
            kind: Kind::Read,
            offset: 0,
            remaining: 0,
            fua: false,
            iov: Iovecs(Vec::with_capacity(8)),
            guest: Iovecs(Vec::new()),
            bounce: None,
            bounced: false,
            len: 0,
        }
    }
}

/// The ring is set up with IORING_SETUP_COOP_TASKRUN | TASKRUN_FLAG where the
/// kernel has them (5.19+): finished I/O waits as task work without an IPI to the
/// busy-polling reactor, and `poll` enters the kernel only when the ring flags
/// pending task work. Measured against the default (IPI) setup and an unregistered
/// descriptor in docs/decisions/0004-uring-backend.md.
///
/// The ring starts disabled, gets `file` as its only registered file and then
/// restrictions (IORING_REGISTER_RESTRICTIONS) before it is enabled: only the
/// operations [`UringChannel::sqe`] builds, only on the registered file, no
/// further registrations. io_uring's operations bypass seccomp, so a thread that
/// may submit to this ring can still only read, write, sync and allocate the
/// backend's own file (docs/security.md).
fn new_ring(file: &File) -> io::Result<(IoUring, bool)> {
    let build = |coop: bool| {
        let mut b = IoUring::builder();
        b.setup_r_disabled();
        if coop {
            b.setup_coop_taskrun().setup_taskrun_flag();
        }
        b.build(ENTRIES)
    };
    let (ring, coop) = match build(true) {
        Ok(r) => (r, true),
        Err(_) => (build(false)?, false),
    };
    let s = ring.submitter();
    s.register_files(&[file.as_raw_fd()])?;
    let mut allowed: Vec<Restriction> = [
        opcode::Read::CODE,
        opcode::Readv::CODE,
        opcode::Write::CODE,
        opcode::Writev::CODE,
        opcode::Fsync::CODE,
        opcode::Fallocate::CODE,
    ]
    .into_iter()
    .map(Restriction::sqe_op)
    .collect();
    allowed.push(Restriction::sqe_flags_required(
        squeue::Flags::FIXED_FILE.bits(),
    ));
    s.register_restrictions(&mut allowed)?;
    s.register_enable_rings()?;
    Ok((ring, coop))
}

/// What a completion (CQE or synchronous result) means for its slot.
enum Step {
    Done(IoStatus),
    /// Short transfer or EINTR/EAGAIN: issue the rest again.
    Again,
}

/// Retries of one inline request before it fails (a file that keeps returning
/// EINTR/EAGAIN or short transfers must not hold the reactor forever).
const INLINE_RETRIES: u32 = 1024;

pub(super) struct UringChannel {
    /// Unused by the inline engine (nothing is ever pushed, so `poll` finds nothing).
    ring: IoUring,
    /// Inline engine: every request is done synchronously inside `submit`.
    inline: bool,
    /// COOP_TASKRUN is in effect.
    coop: bool,
    file: Arc<File>,
    size: u64,
    /// Offsets and lengths must be multiples of this (the disk's I/O alignment,
    /// which may be below the block size it presents).
    align: u64,
    read_only: bool,
    direct: bool,
    slots: Vec<Slot>,
    free: Vec<u32>,
    /// Slots whose SQE did not fit in the SQ (or would overflow the CQ).
    backlog: VecDeque<u32>,
    /// SQEs pushed since the last `ring.submit()`.
    queued: bool,
    /// SQEs pushed whose CQE has not been reaped.
    inflight: usize,
    cqes: Vec<(u64, i32)>,
    zeroes: Option<AlignedBuf>,
}

impl UringChannel {
    pub(super) fn new(
        file: Arc<File>,
        info: &BlockInfo,
        align: u32,
        direct: bool,
        inline: bool,
    ) -> io::Result<Self> {
        let (ring, coop) = new_ring(&file)?;
        let n = ENTRIES as usize;
        Ok(UringChannel {
            ring,
            inline,
            coop,
            file,
            size: info.size_bytes(),
            align: u64::from(align),
            read_only: info.read_only,
            direct,
            slots: (0..n).map(|_| Slot::new()).collect(),
            free: (0..n as u32).rev().collect(),
            backlog: VecDeque::with_capacity(n),
            queued: false,
            inflight: 0,
            cqes: Vec::with_capacity(2 * n),
            zeroes: None,
        })
    }

    fn ring_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.ring.as_fd()
    }

    fn sqe(&self, idx: u32) -> squeue::Entry {
        let s = &self.slots[idx as usize];
        let fd = types::Fixed(0);
        let flags = if s.fua { libc::RWF_DSYNC } else { 0 };
        let one = s.iov.0.len() == 1;
        let v = &s.iov.0;
        let e = match s.kind {
            Kind::Read if one => opcode::Read::new(fd, v[0].iov_base.cast(), clamp(v[0].iov_len))
                .offset(s.offset)
                .build(),
            Kind::Read => opcode::Readv::new(fd, v.as_ptr(), v.len() as u32)
                .offset(s.offset)
                .build(),
            Kind::Write if one => {
                opcode::Write::new(fd, v[0].iov_base.cast_const().cast(), clamp(v[0].iov_len))
                    .offset(s.offset)
                    .rw_flags(flags)
                    .build()
            }
            Kind::Write => opcode::Writev::new(fd, v.as_ptr(), v.len() as u32)
                .offset(s.offset)
                .rw_flags(flags)
                .build(),
            Kind::Fsync => opcode::Fsync::new(fd)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
            Kind::ZeroRange => opcode::Fallocate::new(fd, s.remaining)
                .offset(s.offset)
                .mode(libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE)
                .build(),
            Kind::Punch => opcode::Fallocate::new(fd, s.remaining)
                .offset(s.offset)
                .mode(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE)
                .build(),
        };
        e.user_data(u64::from(idx))
    }

    /// Puts slot `idx` on the SQ, or on the backlog if the SQ (or CQ budget) is full.
    fn enqueue(&mut self, idx: u32) {
        if !self.backlog.is_empty() || !self.try_push(idx) {
            self.backlog.push_back(idx);
        }
    }

    fn try_push(&mut self, idx: u32) -> bool {
        if self.inflight >= 2 * ENTRIES as usize {
            return false;
        }
        let e = self.sqe(idx);
        if !sys::push(&mut self.ring, &e) {
            return false;
        }
        self.inflight += 1;
        self.queued = true;
        true
    }

    fn drain_backlog(&mut self) {
        while let Some(&idx) = self.backlog.front() {
            if !self.try_push(idx) {
                break;
            }
            self.backlog.pop_front();
        }
    }

    fn alloc(&mut self) -> u32 {
        match self.free.pop() {
            Some(i) => i,
            None => {
                self.slots.push(Slot::new());
                (self.slots.len() - 1) as u32
            }
        }
    }

    fn release(&mut self, idx: u32) {
        let s = &mut self.slots[idx as usize];
        s.iov.0.clear();
        s.guest.0.clear();
        if s.bounce.as_ref().is_some_and(|b| b.len() > KEEP_BOUNCE) {
            s.bounce = None;
        }
        self.free.push(idx);
    }

    fn start_rw(&mut self, tag: u64, req: &IoRequest<'_>) -> Option<IoStatus> {
        let total: u64 = req.iov.iter().map(|b| b.len() as u64).sum();
        if total != req.len {
            return Some(IoStatus::Invalid);
        }
        if !req.offset.is_multiple_of(self.align) || !req.len.is_multiple_of(self.align) {
            return Some(IoStatus::Invalid);
        }
        if req.len == 0 {
            return Some(IoStatus::Ok);
        }
        let bounce = self.direct
            && req.iov.iter().any(|b| {
                !(b.as_ptr() as usize).is_multiple_of(MEM_ALIGN)
                    || !b.len().is_multiple_of(MEM_ALIGN)
            });
        let write = req.op == IoOp::Write;
        let idx = self.alloc();
        let s = &mut self.slots[idx as usize];
        s.tag = tag;
        s.kind = if write { Kind::Write } else { Kind::Read };
        s.offset = req.offset;
        s.remaining = req.len;
        s.len = req.len;
        s.fua = write && req.fua;
        s.bounced = bounce;
        s.iov.0.clear();
        s.guest.0.clear();
        if bounce {
            let len = req.len as usize;
            if s.bounce.as_ref().is_none_or(|b| b.len() < len) {
                s.bounce = Some(AlignedBuf::new(len));
            }
            let b = s.bounce.as_mut().expect("bounce");
            if write {
                let dst = b.as_mut_slice();
                let mut pos = 0;
                for seg in req.iov {
                    // Cannot fail: the segment is read whole into a slice of its length.
                    let _ = seg.read_into(0, &mut dst[pos..pos + seg.len()]);
                    pos += seg.len();
                }
            } else {
                s.guest.0.extend(req.iov.iter().map(|b| b.as_iovec()));
            }
            s.iov.0.push(libc::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: len,
            });
        } else {
            s.iov.0.extend(req.iov.iter().map(|b| b.as_iovec()));
        }
        self.dispatch(idx)
    }

    /// Hands a prepared slot to the ring, or runs it now with the inline engine.
    fn dispatch(&mut self, idx: u32) -> Option<IoStatus> {
        if !self.inline {
            self.enqueue(idx);
            return None;
        }
        for _ in 0..INLINE_RETRIES {
            let res = self.run_sync(idx);
            if let Step::Done(st) = self.complete(idx, res) {
                self.release(idx);
                return Some(st);
            }
        }
        self.release(idx);
        Some(IoStatus::IoError)
    }

    /// The slot's operation as one synchronous system call; the result is what the
    /// CQE would have carried.
    fn run_sync(&self, idx: u32) -> i32 {
        let s = &self.slots[idx as usize];
        match s.kind {
            Kind::Read | Kind::Write => {
                let flags = if s.fua { libc::RWF_DSYNC } else { 0 };
                sys::rw_sync(&self.file, s.kind == Kind::Write, &s.iov.0, s.offset, flags)
            }
            Kind::Fsync => match self.file.sync_data() {
                Ok(()) => 0,
                Err(e) => -e.raw_os_error().unwrap_or(libc::EIO),
            },
            Kind::ZeroRange => sys::fallocate(
                &self.file,
                libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
                s.offset,
                s.remaining,
            ),
            Kind::Punch => sys::fallocate(
                &self.file,
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                s.offset,
                s.remaining,
            ),
        }
    }

    fn start_simple(&mut self, tag: u64, kind: Kind, req: &IoRequest<'_>) -> Option<IoStatus> {
        if kind != Kind::Fsync && req.len == 0 {
            return Some(IoStatus::Ok);
        }
        let idx = self.alloc();
        let s = &mut self.slots[idx as usize];
        s.tag = tag;
        s.kind = kind;
        s.offset = req.offset;
        s.remaining = req.len;
        s.len = req.len;
        s.fua = false;
        s.bounced = false;
        self.dispatch(idx)
    }

    /// Synchronous fallback when FALLOC_FL_ZERO_RANGE is not supported.
    fn write_zeroes_sync(&mut self, mut off: u64, mut len: u64) -> IoStatus {
        let z = self
            .zeroes
            .get_or_insert_with(|| AlignedBuf::new(ZERO_CHUNK));
        let zs = z.as_mut_slice();
        while len > 0 {
            let n = len.min(zs.len() as u64) as usize;
            match self.file.write_at(&zs[..n], off) {
                Ok(0) => return IoStatus::IoError,
                Ok(w) => {
                    off += w as u64;
                    len -= w as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return map_errno(e.raw_os_error().unwrap_or(libc::EIO), false),
            }
        }
        IoStatus::Ok
    }

    /// Handles one result: the final status, or `Again` with the slot advanced past
    /// what was transferred.
    fn complete(&mut self, idx: u32, res: i32) -> Step {
        let s = &mut self.slots[idx as usize];
        let read = s.kind == Kind::Read;
        if res < 0 {
            let errno = -res;
            return match (s.kind, errno) {
                (_, libc::EINTR | libc::EAGAIN) => Step::Again,
                (Kind::ZeroRange, libc::EOPNOTSUPP | libc::EINVAL) => {
                    let (off, len) = (s.offset, s.remaining);
                    Step::Done(self.write_zeroes_sync(off, len))
                }
                (Kind::Punch, libc::EOPNOTSUPP) => Step::Done(IoStatus::Ok),
                _ => Step::Done(map_errno(errno, read)),
            };
        }
        if !matches!(s.kind, Kind::Read | Kind::Write) {
            return Step::Done(IoStatus::Ok);
        }
        let n = res as u64;
        if n >= s.remaining {
            if read && s.bounced {
                if let Some(b) = &s.bounce {
                    sys::copy_to_iovecs(b, &s.guest.0);
                }
            }
            return Step::Done(IoStatus::Ok);
        }
        if n == 0 {
            // EOF inside the device: the backing file shrank under us.
            return Step::Done(if read {
                IoStatus::ReadError
            } else {
                IoStatus::IoError
            });
        }
        s.offset += n;
        s.remaining -= n;
        advance(&mut s.iov.0, n as usize);
        Step::Again
    }
}

fn clamp(len: usize) -> u32 {
    len.min(i32::MAX as usize & !4095) as u32
}

/// Drops the first `n` bytes from an iovec list.
fn advance(iov: &mut Vec<libc::iovec>, mut n: usize) {
    let mut skip = 0;
    for v in iov.iter_mut() {
        if n >= v.iov_len {
            n -= v.iov_len;
            skip += 1;
        } else {
            v.iov_base = v.iov_base.cast::<u8>().wrapping_add(n).cast();
            v.iov_len -= n;
            break;
        }
    }
    iov.drain(..skip);
}

fn map_errno(errno: i32, read: bool) -> IoStatus {
    match errno {
        libc::EIO if read => IoStatus::ReadError,
        libc::ENOSPC | libc::EDQUOT => IoStatus::NoSpace,
        libc::EROFS => IoStatus::ReadOnly,
        _ => IoStatus::IoError,
    }
}

impl IoChannel for UringChannel {
    fn submit(&mut self, tag: u64, req: &IoRequest<'_>) -> Option<IoStatus> {
        if req.op != IoOp::Flush && !in_range(req.offset, req.len, self.size) {
            return Some(IoStatus::OutOfRange);
        }
        if self.read_only && !matches!(req.op, IoOp::Read | IoOp::Flush) {
            return Some(IoStatus::ReadOnly);
        }
        match req.op {
            IoOp::Read | IoOp::Write => self.start_rw(tag, req),
            IoOp::Flush => self.start_simple(tag, Kind::Fsync, req),
            IoOp::WriteZeroes => self.start_simple(tag, Kind::ZeroRange, req),
            IoOp::Discard => self.start_simple(tag, Kind::Punch, req),
        }
    }

    fn poll(&mut self, done: &mut dyn FnMut(u64, IoStatus)) -> usize {
        // Cooperative task running: finished I/O waits as task work until we enter
        // the kernel; do so only when the ring says some is pending. (The enter also
        // submits anything queued, which `flush` would do next anyway.)
        if self.coop && self.inflight > 0 && self.ring.submission().taskrun() {
            match self.ring.submit() {
                Ok(_) => self.queued = false,
                Err(e) => tracing::debug!("io_uring enter for task work: {e}"),
            }
        }
        let mut cqes = std::mem::take(&mut self.cqes);
        cqes.extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
        self.inflight -= cqes.len();
        let mut n = 0;
        for &(ud, res) in &cqes {
            let idx = ud as u32;
            match self.complete(idx, res) {
                Step::Done(st) => {
                    let tag = self.slots[idx as usize].tag;
                    self.release(idx);
                    done(tag, st);
                    n += 1;
                }
                Step::Again => self.enqueue(idx),
            }
        }
        cqes.clear();
        self.cqes = cqes;
        self.drain_backlog();
        n
    }

    /// Requests beyond the slots the channel was made with allocate a slot each and
    /// may wait in the backlog: the ring's size is the room.
    fn room(&self) -> usize {
        let in_use = self.slots.len() - self.free.len();
        (ENTRIES as usize).saturating_sub(in_use)
    }

    fn flush(&mut self) {
        self.drain_backlog();
        if self.queued {
            match self.ring.submit() {
                Ok(_) => self.queued = false,
                Err(e) => tracing::debug!("io_uring submit: {e}"),
            }
        }
    }

    /// The ring's own descriptor is the notifier: it polls readable once a CQE is
    /// posted, with no per-completion cost while the reactor is awake (a registered
    /// eventfd would be signalled for every CQE). Under COOP_TASKRUN a completion
    /// first waits as task work; the kernel wakes a task sleeping in `poll` to run
    /// it, which posts the CQE. Work already pending (CQEs, task work, a backlog)
    /// means: poll now.
    fn arm_notifier(&mut self) -> crate::Armed {
        self.flush();
        let cqes_waiting = {
            let mut cq = self.ring.completion();
            cq.sync();
            !cq.is_empty()
        };
        if cqes_waiting
            || !self.backlog.is_empty()
            || (self.coop && self.ring.submission().taskrun())
        {
            crate::Armed::Ready
        } else {
            crate::Armed::Fd
        }
    }

    fn notifier(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        Some(self.ring_fd())
    }
}

impl Drop for UringChannel {
    fn drop(&mut self) {
        // The kernel may still write into slot buffers: wait for every pushed SQE.
        while self.inflight > 0 {
            if self.ring.submit_and_wait(1).is_err() {
                // EINTR and the like: try again; anything else would spin, so stop
                // after reaping what is there (buffers then leak rather than dangle).
                let n = self.ring.completion().count();
                if n == 0 {
                    std::mem::forget(std::mem::take(&mut self.slots));
                    return;
                }
                self.inflight -= n;
                continue;
            }
            self.inflight -= self.ring.completion().count();
        }
    }
}
