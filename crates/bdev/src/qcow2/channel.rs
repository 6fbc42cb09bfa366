//! A qcow2 image's per-reactor channel. A read or write whose clusters are all
//! allocated (and contiguous in the file) is looked up without the image's lock
//! in L2 tables the channel keeps, and goes to the image file through the
//! reactor's io_uring at the translated offset with the caller's buffers: no
//! copy, no allocation. A read the image leaves wholly to a raw backing file
//! goes the same way to that file's ring; reads of zeroes are answered at once.
//! Everything else (allocation, qcow2 backing files, mixed or compressed or
//! partial clusters, Write Zeroes, Discard, Flush) is the slow path:
//! synchronous, under the image's lock, through the channel's two cluster-sized
//! buffers.
//!
//! A live snapshot or a commit's pivot replaces the disk's image (`Active`):
//! before each request the channel compares the disk's epoch with its own
//! and, when it moved, opens rings on the new image's files; the old rings
//! retire and are polled until what they hold completes.

use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use guest_mem::DmaSlice;

use super::backing::Backing;
use super::image::Image;
use super::live::Active;
use super::meta::{Quiet, IDLE};
use super::tables::{classify_at, Cluster, L2Table};
use crate::crypt::{copy_in, copy_out};
use crate::{in_range, Armed, IoChannel, IoOp, IoRequest, IoStatus};

/// L2 tables a channel keeps (direct mapped by L1 index).
const LOCAL: usize = 8;

pub(super) struct Qcow2Channel {
    /// First: dropped (waiting for what it has in flight) before the rest.
    data: Box<dyn IoChannel>,
    /// A raw backing file's ring: reads of a range the image leaves to it go
    /// there whole, asynchronously.
    backing: Option<Box<dyn IoChannel>>,
    /// Requests in flight on `backing` (while any are, the channel cannot
    /// sleep on `data`'s notifier alone).
    backing_inflight: usize,
    /// Requests in flight on `data`.
    data_inflight: usize,
    /// Rings on images the disk no longer serves, with what they hold.
    retired: Vec<(Box<dyn IoChannel>, usize)>,
    active: Arc<Active>,
    epoch: u64,
    image: Arc<Image>,
    local: [Option<(usize, Arc<L2Table>)>; LOCAL],
    generation: u64,
    size: u64,
    read_only: bool,
    /// The image's L2 entries are extended (subclusters).
    ext: bool,
    /// A cluster of guest data, and a cluster for what surrounds it.
    piece: Vec<u8>,
    scratch: Vec<u8>,
    /// What this channel publishes for the reuse of freed clusters (after
    /// `data`: dropped once nothing is in flight), and whether it says `IDLE`.
    quiet: Arc<Quiet>,
    idle: bool,
}

/// What a request's clusters say, looked up without the lock.
enum Fast {
    /// All in the file, contiguous, from this host offset.
    Host(u64),
    /// All read as zeroes.
    Zeroes,
    /// All in the raw backing file, at the same offset.
    Backing,
    Slow,
}

fn status(e: &io::Error, read: bool) -> IoStatus {
    match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => IoStatus::NoSpace,
        _ if read => IoStatus::ReadError,
        _ => IoStatus::IoError,
    }
}

impl Qcow2Channel {
    pub(super) fn new(active: Arc<Active>, size: u64) -> io::Result<Qcow2Channel> {
        let (image, epoch, (data, backing)) = active.attach()?;
        let cs = image.cs() as usize;
        Ok(Qcow2Channel {
            data,
            backing,
            backing_inflight: 0,
            data_inflight: 0,
            retired: Vec::new(),
            active,
            epoch,
            read_only: image.read_only,
            ext: image.header.extended_l2(),
            generation: image.generation.load(Ordering::Acquire),
            image,
            local: Default::default(),
            size,
            piece: vec![0; cs],
            scratch: vec![0; cs],
            quiet: Arc::new(Quiet::new(IDLE)),
            idle: true,
        }
        .registered())
    }

    /// Makes the image wait for this channel before it reuses a freed cluster.
    fn registered(self) -> Qcow2Channel {
        self.image.meta().register(&self.quiet);
        self
    }

    /// Before a request: a channel that published `IDLE` retracts it before
    /// it reads an L2 entry (sequentially consistent: an allocation either
    /// sees the retraction or this channel sees the discard's generation).
    /// Only the first request after the channel ran empty pays for it.
    #[inline]
    fn busy(&mut self) {
        if self.idle {
            self.idle = false;
            self.quiet.swap(self.generation + 1, Ordering::SeqCst);
        }
    }

    /// Nothing in flight on the image's ring: every request translated so far
    /// is done, and later ones read entries at least as new as `generation`.
    fn publish_quiet(&mut self) {
        if self.data_inflight == 0 && !self.idle {
            self.quiet.store(self.generation + 1, Ordering::SeqCst);
        }
    }

    /// Moves to the image the disk serves now, on rings made for it off the
    /// reactor; the old rings retire with what they hold.
    fn switch(&mut self) -> io::Result<()> {
        let Some((image, epoch, (data, backing))) = self.active.take() else {
            return Err(io::Error::other("no rings were made for the new image"));
        };
        let old = std::mem::replace(&mut self.data, data);
        if self.data_inflight > 0 {
            self.retired.push((old, self.data_inflight));
        }
        if let Some(old) = std::mem::replace(&mut self.backing, backing) {
            if self.backing_inflight > 0 {
                self.retired.push((old, self.backing_inflight));
            }
        }
        (self.data_inflight, self.backing_inflight) = (0, 0);
        let cs = image.cs() as usize;
        if self.piece.len() != cs {
            (self.piece, self.scratch) = (vec![0; cs], vec![0; cs]);
        }
        self.local = Default::default();
        self.generation = image.generation.load(Ordering::SeqCst);
        self.ext = image.header.extended_l2();
        // What it published was in the old image's generations; nothing is in
        // flight on the new image's ring yet.
        self.quiet.store(self.generation + 1, Ordering::SeqCst);
        self.idle = false;
        image.meta().register(&self.quiet);
        self.image = image;
        self.epoch = epoch;
        Ok(())
    }

    /// The slot of `local` holding the L2 table of `l1i`: one the channel
    /// keeps, else fetched from the image's cache (under its lock, read from the
    /// file on a miss) and kept. `Ok(None)`: the image has no table there;
    /// `Err`: loading it failed (the slow path reports why). A hit costs no
    /// reference count: the fast path borrows the table from the slot.
    fn table(&mut self, l1i: usize) -> Result<Option<usize>, ()> {
        // Sequentially consistent for the reuse of freed clusters (`busy`);
        // a plain load on x86 and an acquire load on Arm all the same.
        let g = self.image.generation.load(Ordering::SeqCst);
        if g != self.generation {
            self.local = Default::default();
            self.generation = g;
        }
        let slot = l1i % LOCAL;
        if matches!(&self.local[slot], Some((i, _)) if *i == l1i) {
            return Ok(Some(slot));
        }
        let Some(t) = self.image.meta().l2(l1i).map_err(|_| ())? else {
            return Ok(None);
        };
        self.local[slot] = Some((l1i, t));
        Ok(Some(slot))
    }

    /// Looks `req`'s clusters up without the image's lock.
    fn lookup(&mut self, req: &IoRequest<'_>) -> Fast {
        let cs = self.image.cs();
        let first = req.offset / cs;
        let last = (req.offset + req.len - 1) / cs;
        let (l1i, l2i) = self.image.split(first);
        if self.image.split(last).0 != l1i {
            return Fast::Slow;
        }
        let no_backing = self.image.backing.is_none();
        let slot = match self.table(l1i) {
            Ok(Some(slot)) => slot,
            Ok(None) if no_backing && req.op == IoOp::Read => return Fast::Zeroes,
            Ok(None) if req.op == IoOp::Read && self.in_raw_backing(req) => return Fast::Backing,
            _ => return Fast::Slow,
        };
        let Some((_, t)) = &self.local[slot] else {
            return Fast::Slow;
        };
        let limit = self.image.limit.load(Ordering::Acquire);
        let write = req.op == IoOp::Write;
        if write && self.image.writes_slow.load(Ordering::Acquire) {
            return Fast::Slow;
        }
        let n = (last - first) as usize;
        let ext = self.ext;
        let at = |i| classify_at(t, i, ext, cs, limit);
        match at(l2i) {
            Cluster::Data { host, copied } if copied || !write => {
                let contiguous = (1..=n).all(|k| {
                    let want = host + k as u64 * cs;
                    matches!(at(l2i + k),
                        Cluster::Data { host: h, copied } if h == want && (copied || !write))
                });
                if contiguous {
                    Fast::Host(host + req.offset % cs)
                } else {
                    Fast::Slow
                }
            }
            Cluster::Unallocated if !write && self.in_raw_backing(req) => {
                let unallocated = (0..=n).all(|k| at(l2i + k) == Cluster::Unallocated);
                if unallocated {
                    Fast::Backing
                } else {
                    Fast::Slow
                }
            }
            Cluster::Zero { .. } | Cluster::Unallocated if !write => {
                let zero = |i| match at(i) {
                    Cluster::Zero { .. } => true,
                    Cluster::Unallocated => no_backing,
                    _ => false,
                };
                if (0..=n).all(|k| zero(l2i + k)) {
                    Fast::Zeroes
                } else {
                    Fast::Slow
                }
            }
            _ => Fast::Slow,
        }
    }

    /// Whether `req` lies inside a raw backing file this channel has a ring on.
    fn in_raw_backing(&self, req: &IoRequest<'_>) -> bool {
        match &self.image.backing {
            Some(Backing::Raw { len, .. }) => {
                self.backing.is_some() && req.offset + req.len <= *len
            }
            _ => false,
        }
    }

    fn read_write(&mut self, tag: u64, req: &IoRequest<'_>) -> Option<IoStatus> {
        let total: u64 = req.iov.iter().map(|s| s.len() as u64).sum();
        if total != req.len || !req.offset.is_multiple_of(512) || !req.len.is_multiple_of(512) {
            return Some(IoStatus::Invalid);
        }
        if req.len == 0 {
            return Some(IoStatus::Ok);
        }
        match self.lookup(req) {
            Fast::Host(host) => {
                let st = self.data.submit(
                    tag,
                    &IoRequest {
                        offset: host,
                        ..*req
                    },
                );
                self.data_inflight += usize::from(st.is_none());
                st
            }
            Fast::Zeroes => Some(fill_zeroes(req.iov)),
            Fast::Backing => match self.backing.as_mut().map(|b| b.submit(tag, req)) {
                Some(None) => {
                    self.backing_inflight += 1;
                    None
                }
                Some(st) => st,
                None => Some(self.slow(req)),
            },
            Fast::Slow => Some(self.slow(req)),
        }
    }

    /// A read or write a cluster at a time, synchronously.
    fn slow(&mut self, req: &IoRequest<'_>) -> IoStatus {
        self.publish_quiet();
        let cs = self.image.cs();
        let write = req.op == IoOp::Write;
        let mut pos = 0u64;
        while pos < req.len {
            let off = req.offset + pos;
            let n = (cs - off % cs).min(req.len - pos) as usize;
            let p = pos as usize;
            let r = if write {
                match copy_out(req.iov, p, &mut self.piece[..n]) {
                    Some(()) => self
                        .image
                        .write_sync(off, &self.piece[..n], &mut self.scratch),
                    None => return IoStatus::Invalid,
                }
            } else {
                self.image
                    .read_sync(off, &mut self.piece[..n])
                    .and_then(|()| {
                        copy_in(req.iov, p, &self.piece[..n])
                            .ok_or(io::ErrorKind::InvalidInput.into())
                    })
            };
            if let Err(e) = r {
                tracing::debug!(path = %self.image.path.display(), offset = off, "qcow2: {e}");
                return status(&e, !write);
            }
            pos += n as u64;
        }
        if write && req.fua {
            if let Err(e) = self.image.flush() {
                return status(&e, false);
            }
        }
        IoStatus::Ok
    }

    /// Write Zeroes or Discard: whole clusters are flagged as zeroes (a discard
    /// also gives their space back); the partial clusters at the ends are written
    /// with zeroes (Write Zeroes) or left alone (a discard is a hint).
    fn zeroes(&mut self, req: &IoRequest<'_>) -> IoStatus {
        if !req.offset.is_multiple_of(512) || !req.len.is_multiple_of(512) {
            return IoStatus::Invalid;
        }
        let cs = self.image.cs();
        let (start, end) = (req.offset, req.offset + req.len);
        let first = start.div_ceil(cs);
        let last = end / cs;
        let discard = req.op == IoOp::Discard;
        self.publish_quiet();
        let mut r = Ok(());
        if first < last {
            r = self.image.zero_clusters(first, last - first, discard);
        }
        if !discard {
            let ends = if first > last {
                [(start, end), (0, 0)]
            } else {
                [(start, first * cs), (last * cs, end)]
            };
            for (a, b) in ends {
                if a < b && r.is_ok() {
                    self.piece.fill(0);
                    r = self.image.write_sync(
                        a,
                        &self.piece[..(b - a) as usize],
                        &mut self.scratch,
                    );
                }
            }
        }
        if r.is_ok() && req.fua {
            r = self.image.flush();
        }
        r.map_or_else(|e| status(&e, false), |()| IoStatus::Ok)
    }
}

/// Zeroes every buffer of a read.
fn fill_zeroes(iov: &[DmaSlice<'_>]) -> IoStatus {
    static ZERO: [u8; 4096] = [0; 4096];
    for s in iov {
        let mut at = 0;
        while at < s.len() {
            let n = (s.len() - at).min(ZERO.len());
            if s.write_from(at, &ZERO[..n]).is_err() {
                return IoStatus::Invalid;
            }
            at += n;
        }
    }
    IoStatus::Ok
}

impl Drop for Qcow2Channel {
    fn drop(&mut self) {
        self.active.detach();
    }
}

impl IoChannel for Qcow2Channel {
    fn submit(&mut self, tag: u64, req: &IoRequest<'_>) -> Option<IoStatus> {
        self.busy();
        let epoch = self.active.epoch.load(Ordering::Acquire);
        if epoch != self.epoch {
            if let Err(e) = self.switch() {
                tracing::warn!(path = %self.image.path.display(), "qcow2: cannot move to the new image: {e}");
                return Some(status(&e, req.op == IoOp::Read));
            }
        }
        if req.op != IoOp::Flush && !in_range(req.offset, req.len, self.size) {
            return Some(IoStatus::OutOfRange);
        }
        if self.read_only && req.op != IoOp::Read && req.op != IoOp::Flush {
            return Some(IoStatus::ReadOnly);
        }
        match req.op {
            IoOp::Read | IoOp::Write => self.read_write(tag, req),
            IoOp::Flush if self.read_only => Some(IoStatus::Ok),
            IoOp::Flush => Some(
                self.image
                    .flush()
                    .map_or_else(|e| status(&e, false), |()| IoStatus::Ok),
            ),
            IoOp::WriteZeroes | IoOp::Discard if req.len == 0 => Some(IoStatus::Ok),
            IoOp::WriteZeroes | IoOp::Discard => Some(self.zeroes(req)),
        }
    }
    fn poll(&mut self, done: &mut dyn FnMut(u64, IoStatus)) -> usize {
        let mut n = self.data.poll(done);
        self.data_inflight = self.data_inflight.saturating_sub(n);
        if self.data_inflight == 0 && !self.idle {
            // Release: the completions' data is in place before a freed
            // cluster they used may be handed out.
            self.quiet.store(IDLE, Ordering::Release);
            self.idle = true;
        }
        if !self.retired.is_empty() {
            for (ring, held) in &mut self.retired {
                ring.flush();
                let k = ring.poll(done);
                *held = held.saturating_sub(k);
                n += k;
            }
            self.retired.retain(|(_, held)| *held > 0);
        }
        if let Some(b) = &mut self.backing {
            let k = b.poll(done);
            self.backing_inflight = self.backing_inflight.saturating_sub(k);
            n += k;
        }
        n
    }
    fn flush(&mut self) {
        self.data.flush();
        if let Some(b) = &mut self.backing {
            b.flush();
        }
    }
    fn room(&self) -> usize {
        let b = self.backing.as_ref().map_or(usize::MAX, |b| b.room());
        self.data.room().min(b)
    }
    /// One notifier (the image file's ring): with backing reads in flight the
    /// reactor keeps polling.
    fn arm_notifier(&mut self) -> Armed {
        if self.backing_inflight > 0 || !self.retired.is_empty() {
            if let Some(b) = &mut self.backing {
                b.flush();
            }
            return Armed::Unsupported;
        }
        self.data.arm_notifier()
    }
    fn notifier(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.data.notifier()
    }
}
