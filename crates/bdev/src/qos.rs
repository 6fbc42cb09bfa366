//! [`QosDisk`]: IOPS and bandwidth limits for one namespace.
//!
//! Limits are per namespace but channels are per reactor, so the buckets live in the
//! [`QosDisk`] and are shared by all its channels, lock-free: each limit is one
//! `AtomicU64` holding a GCRA "theoretical arrival time" in nanoseconds of a
//! monotonic clock (equivalent to a token bucket). A request is admitted when every
//! bucket it is subject to has `tat <= now + burst`; it is then charged on each of
//! them (`tat = max(tat, now) + cost`, a `fetch_update` CAS loop). Checking and
//! charging are two steps, so channels racing on the same instant can overshoot by
//! at most one request each; the long-run rate is exact.
//!
//! Limits can change at run time ([`QosDisk::set_limits`]): each rate is an atomic
//! (0 = unlimited) read per request, and an `active` flag lets a disk without any
//! limit pass requests straight through (one relaxed load, no clock read), so every
//! namespace can be wrapped at open and limited later.
//!
//! Burst: [`BURST`] (100 ms) worth of the rate, and always at least one request (an
//! idle bucket admits any single request, however large). Credit beyond the burst is
//! not banked: a namespace idle for a minute still gets only 100 ms worth at once.
//!
//! Which buckets apply: `iops` to every request; `read_iops`/`read_bw` to Read;
//! `write_iops`/`write_bw` to Write, WriteZeroes and Discard. Bandwidth counts the
//! bytes of Read and Write only (WriteZeroes/Discard/Flush move no data); Flush is
//! charged on `iops` only.
//!
//! Throttled requests wait in a per-channel FIFO and are retried, in order, from
//! [`IoChannel::poll`] (never by spinning in `submit`); a new request queues behind
//! waiting ones. An adaptive reactor with nothing else to do sleeps until the first
//! of them can go ([`IoChannel::wake_by`], at most [`QOS_MAX_NAP`] at a time) rather
//! than polling for tokens. The FIFO holds [`QOS_QUEUE_DEPTH`] requests (4096, the
//! largest queue a device model gives one channel), so it cannot fill up in
//! practice; if it does, `submit` returns [`IoStatus::IoError`]. Each waiting request
//! keeps its own copy of the buffer list (the caller's iovec array is only valid
//! during `submit`); slots are allocated on first use and reused, so a warmed-up
//! channel does not allocate. Requests still queued when a channel is dropped never
//! complete. Each namespace has its own `QosDisk`, so a throttled one delays no
//! other.

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use guest_mem::HeldIov;

use crate::{
    submit_each, Batch, BlockDevice, ChannelWrapper, DeviceWrapper, IoChannel, IoOp, IoRequest,
    IoStatus,
};

/// How much of a rate may be spent at once.
pub const BURST: Duration = Duration::from_millis(100);
/// Requests one channel may hold back.
pub const QOS_QUEUE_DEPTH: usize = 4096;
/// The longest a reactor sleeps while this channel holds requests back, however far
/// their tokens are: a limit raised at run time reaches them within this.
pub const QOS_MAX_NAP: Duration = Duration::from_millis(10);

/// Monotonic nanoseconds; injectable for tests.
pub type QosClock = Arc<dyn Fn() -> u64 + Send + Sync>;

/// Per-namespace limits; `None` = unlimited. Rates are per second.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QosLimits {
    pub iops: Option<u64>,
    pub read_iops: Option<u64>,
    pub write_iops: Option<u64>,
    pub bw_bytes: Option<u64>,
    pub read_bw: Option<u64>,
    pub write_bw: Option<u64>,
}

/// One limit. `rate` 0 means unlimited; it can change at any time (set_limits).
struct Bucket {
    rate: AtomicU64,
    tat: AtomicU64,
}

impl Bucket {
    fn new(rate: Option<u64>) -> Bucket {
        Bucket {
            rate: AtomicU64::new(rate.unwrap_or(0)),
            tat: AtomicU64::new(0),
        }
    }
    fn rate(&self) -> Option<u64> {
        Some(self.rate.load(Ordering::Relaxed)).filter(|r| *r > 0)
    }
    fn ready(&self, now: u64) -> bool {
        self.rate.load(Ordering::Relaxed) == 0
            || self.tat.load(Ordering::Acquire) <= now.saturating_add(BURST.as_nanos() as u64)
    }
    fn charge(&self, now: u64, units: u64) {
        let rate = self.rate.load(Ordering::Relaxed);
        if units == 0 || rate == 0 {
            return;
        }
        let cost = (u128::from(units) * 1_000_000_000).div_ceil(u128::from(rate));
        let cost = u64::try_from(cost).unwrap_or(u64::MAX);
        let _ = self
            .tat
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |tat| {
                Some(tat.max(now).saturating_add(cost))
            });
    }
}

struct Buckets {
    /// Some limit is set; when clear, requests pass straight through (no clock read).
    active: AtomicBool,
    iops: Bucket,
    read_iops: Bucket,
    write_iops: Bucket,
    bw: Bucket,
    read_bw: Bucket,
    write_bw: Bucket,
}

impl Buckets {
    fn set(&self, l: QosLimits) {
        self.iops.rate.store(l.iops.unwrap_or(0), Ordering::Relaxed);
        self.read_iops
            .rate
            .store(l.read_iops.unwrap_or(0), Ordering::Relaxed);
        self.write_iops
            .rate
            .store(l.write_iops.unwrap_or(0), Ordering::Relaxed);
        self.bw
            .rate
            .store(l.bw_bytes.unwrap_or(0), Ordering::Relaxed);
        self.read_bw
            .rate
            .store(l.read_bw.unwrap_or(0), Ordering::Relaxed);
        self.write_bw
            .rate
            .store(l.write_bw.unwrap_or(0), Ordering::Relaxed);
        self.active
            .store(l != QosLimits::default(), Ordering::Release);
    }

    fn limits(&self) -> QosLimits {
        QosLimits {
            iops: self.iops.rate(),
            read_iops: self.read_iops.rate(),
            write_iops: self.write_iops.rate(),
            bw_bytes: self.bw.rate(),
            read_bw: self.read_bw.rate(),
            write_bw: self.write_bw.rate(),
        }
    }

    /// The buckets `op` is subject to, as (bucket, units) pairs.
    fn for_op(&self, op: IoOp, len: u64) -> [(Option<&Bucket>, u64); 4] {
        let bytes = if matches!(op, IoOp::Read | IoOp::Write) {
            len
        } else {
            0
        };
        let (cls_iops, cls_bw) = match op {
            IoOp::Read => (Some(&self.read_iops), Some(&self.read_bw)),
            IoOp::Write | IoOp::WriteZeroes | IoOp::Discard => {
                (Some(&self.write_iops), Some(&self.write_bw))
            }
            IoOp::Flush => (None, None),
        };
        [
            (Some(&self.iops), 1),
            (cls_iops, 1),
            (Some(&self.bw), bytes),
            (cls_bw, bytes),
        ]
    }

    /// When (clock nanoseconds) every bucket `op` is subject to will admit it.
    fn admit_at(&self, op: IoOp, len: u64) -> u64 {
        let burst = BURST.as_nanos() as u64;
        self.for_op(op, len)
            .iter()
            .filter_map(|(b, units)| b.filter(|b| *units > 0 && b.rate().is_some()))
            .map(|b| b.tat.load(Ordering::Acquire).saturating_sub(burst))
            .max()
            .unwrap_or(0)
    }

    fn try_admit(&self, op: IoOp, len: u64, now: u64) -> bool {
        let set = self.for_op(op, len);
        let ready = set
            .iter()
            .all(|(b, units)| b.is_none_or(|b| *units == 0 || b.ready(now)));
        if ready {
            for (b, units) in set {
                if let Some(b) = b {
                    b.charge(now, units);
                }
            }
        }
        ready
    }
}

/// Limits a [`QosDisk`] cannot have.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QosError {
    #[error("QoS limits must be positive (or unset): {0:?}")]
    ZeroLimit(QosLimits),
}

impl From<QosError> for io::Error {
    fn from(e: QosError) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidInput, e)
    }
}

pub struct QosDisk {
    inner: Arc<dyn BlockDevice>,
    buckets: Arc<Buckets>,
    clock: QosClock,
}

impl QosDisk {
    pub fn new(inner: Arc<dyn BlockDevice>, limits: QosLimits) -> Result<QosDisk, QosError> {
        let base = Instant::now();
        Self::with_clock(
            inner,
            limits,
            Arc::new(move || base.elapsed().as_nanos() as u64),
        )
    }

    /// As [`QosDisk::new`] with an injected monotonic clock (nanoseconds).
    pub fn with_clock(
        inner: Arc<dyn BlockDevice>,
        limits: QosLimits,
        clock: QosClock,
    ) -> Result<QosDisk, QosError> {
        check_limits(&limits)?;
        let buckets = Arc::new(Buckets {
            active: AtomicBool::new(false),
            iops: Bucket::new(None),
            read_iops: Bucket::new(None),
            write_iops: Bucket::new(None),
            bw: Bucket::new(None),
            read_bw: Bucket::new(None),
            write_bw: Bucket::new(None),
        });
        buckets.set(limits);
        Ok(QosDisk {
            inner,
            buckets,
            clock,
        })
    }

    pub fn limits(&self) -> QosLimits {
        self.buckets.limits()
    }

    /// The same namespace with its backend resized ([`BlockDevice::resize`]); the
    /// limits and their buckets are shared with this handle.
    pub fn resized(&self, bytes: u64) -> io::Result<QosDisk> {
        Ok(self.around(self.inner.resize(bytes)?))
    }

    /// These limits, their buckets and clock, on `inner`.
    fn around(&self, inner: Arc<dyn BlockDevice>) -> QosDisk {
        QosDisk {
            inner,
            buckets: self.buckets.clone(),
            clock: self.clock.clone(),
        }
    }

    /// Changes the limits at run time; every channel sees them at its next request.
    /// `QosLimits::default()` removes all limits. Requests already held back are
    /// admitted under the new limits.
    pub fn set_limits(&self, limits: QosLimits) -> Result<(), QosError> {
        check_limits(&limits)?;
        self.buckets.set(limits);
        Ok(())
    }
}

fn check_limits(limits: &QosLimits) -> Result<(), QosError> {
    let all = [
        limits.iops,
        limits.read_iops,
        limits.write_iops,
        limits.bw_bytes,
        limits.read_bw,
        limits.write_bw,
    ];
    if all.contains(&Some(0)) {
        return Err(QosError::ZeroLimit(*limits));
    }
    Ok(())
}

impl DeviceWrapper for QosDisk {
    fn inner(&self) -> &dyn BlockDevice {
        &*self.inner
    }
    fn kind(&self) -> &'static str {
        "qos"
    }
    /// The limits stay with the resized namespace (their buckets are shared).
    fn rewrap(&self, inner: Arc<dyn BlockDevice>) -> io::Result<Arc<dyn BlockDevice>> {
        Ok(Arc::new(self.around(inner)))
    }
    fn channel(&self) -> io::Result<Box<dyn IoChannel>> {
        Ok(Box::new(QosChannel {
            inner: self.inner.channel()?,
            buckets: self.buckets.clone(),
            clock: self.clock.clone(),
            queue: VecDeque::with_capacity(QOS_QUEUE_DEPTH),
            slots: Vec::with_capacity(QOS_QUEUE_DEPTH),
            free: Vec::with_capacity(QOS_QUEUE_DEPTH),
            inner_busy: 0,
        }))
    }
}

/// A held-back request with its own copy of the buffer list.
struct Slot {
    tag: u64,
    op: IoOp,
    offset: u64,
    len: u64,
    fua: bool,
    /// The request's buffers while it waits (handed to the inner channel's
    /// `submit` and cleared right after).
    iov: HeldIov,
}

struct QosChannel {
    inner: Box<dyn IoChannel>,
    buckets: Arc<Buckets>,
    clock: QosClock,
    /// Slot indices, oldest first.
    queue: VecDeque<usize>,
    slots: Vec<Slot>,
    free: Vec<usize>,
    /// Requests with the inner channel (submitted, not yet completed): while there
    /// are none, only time can release held ones.
    inner_busy: usize,
}

impl QosChannel {
    /// Whether the inner channel's notifier and deadline count: it has requests,
    /// or nothing is held here (see `crate::arm_holding`).
    fn inner_counts(&self) -> bool {
        self.inner_busy > 0 || self.queue.is_empty()
    }

    fn hold(&mut self, tag: u64, req: &IoRequest<'_>) -> bool {
        let idx = match self.free.pop() {
            Some(i) => i,
            None if self.slots.len() < QOS_QUEUE_DEPTH => {
                self.slots.push(Slot {
                    tag: 0,
                    op: IoOp::Flush,
                    offset: 0,
                    len: 0,
                    fua: false,
                    iov: HeldIov::default(),
                });
                self.slots.len() - 1
            }
            None => return false,
        };
        let slot = &mut self.slots[idx];
        slot.tag = tag;
        slot.op = req.op;
        slot.offset = req.offset;
        slot.len = req.len;
        slot.fua = req.fua;
        // SAFETY: the memory behind the request's buffers stays valid until the
        // request completes (IoChannel::submit contract); the held slices are used
        // only to forward this request in `poll` and cleared right after.
        unsafe { slot.iov.hold(req.iov) };
        self.queue.push_back(idx);
        true
    }
}

impl ChannelWrapper for QosChannel {
    fn inner(&self) -> &dyn IoChannel {
        &*self.inner
    }
    fn inner_mut(&mut self) -> &mut dyn IoChannel {
        &mut *self.inner
    }

    fn submit(&mut self, tag: u64, req: &IoRequest<'_>) -> Option<IoStatus> {
        if self.queue.is_empty()
            && (!self.buckets.active.load(Ordering::Relaxed)
                || self.buckets.try_admit(req.op, req.len, (self.clock)()))
        {
            let st = self.inner.submit(tag, req);
            self.inner_busy += usize::from(st.is_none());
            return st;
        }
        if self.hold(tag, req) {
            None
        } else {
            Some(IoStatus::IoError)
        }
    }

    /// Whole to the backend while no limit is set and nothing is held back (a
    /// batch that starts then passes whole, as a request does); else request by
    /// request, each admitted or held on its own.
    fn submit_batch(&mut self, batch: &mut dyn Batch) -> usize {
        if self.queue.is_empty() && !self.buckets.active.load(Ordering::Relaxed) {
            let n = self.inner.submit_batch(batch);
            self.inner_busy += n;
            return n;
        }
        submit_each(batch, |tag, req| ChannelWrapper::submit(self, tag, req))
    }

    fn poll(&mut self, done: &mut dyn FnMut(u64, IoStatus)) -> usize {
        let mut n = self.inner.poll(done);
        self.inner_busy = self.inner_busy.saturating_sub(n);
        if self.queue.is_empty() {
            return n;
        }
        let now = (self.clock)();
        while let Some(&idx) = self.queue.front() {
            let slot = &mut self.slots[idx];
            if !self.buckets.try_admit(slot.op, slot.len, now) {
                break;
            }
            self.queue.pop_front();
            let req = IoRequest {
                op: slot.op,
                offset: slot.offset,
                len: slot.len,
                iov: slot.iov.slices(),
                fua: slot.fua,
            };
            let res = self.inner.submit(slot.tag, &req);
            slot.iov.clear();
            match res {
                Some(st) => {
                    done(slot.tag, st);
                    n += 1;
                }
                None => self.inner_busy += 1,
            }
            self.free.push(idx);
        }
        n
    }

    fn room(&self) -> usize {
        self.inner
            .room()
            .min(QOS_QUEUE_DEPTH.saturating_sub(self.queue.len()))
    }

    /// Held requests wait for tokens, that is for time to pass
    /// ([`IoChannel::wake_by`]); those with the inner channel for its notifier.
    fn arm_notifier(&mut self) -> crate::Armed {
        let counts = self.inner_counts();
        crate::arm_holding(&mut *self.inner, counts)
    }

    fn notifier(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.inner_counts().then(|| self.inner.notifier()).flatten()
    }

    /// When the oldest held request's tokens are there (it goes first: FIFO), but
    /// no later than [`QOS_MAX_NAP`] from now.
    fn wake_by(&self) -> Option<Instant> {
        let inner = self.inner_counts().then(|| self.inner.wake_by()).flatten();
        let held = self
            .queue
            .front()
            .and_then(|&idx| self.slots.get(idx))
            .map(|s| {
                let wait = self
                    .buckets
                    .admit_at(s.op, s.len)
                    .saturating_sub((self.clock)());
                Instant::now() + Duration::from_nanos(wait).min(QOS_MAX_NAP)
            });
        crate::earliest(held, inner)
    }

    /// While requests wait for tokens a new one takes at least as long (it queues
    /// behind them), often longer than a network round trip: the front end then
    /// naps and defers doorbells as for a remote backend (decisions 0026, 0029),
    /// and the timer ([`IoChannel::wake_by`]) or the inner notifier wakes it.
    fn slow_completions(&self) -> bool {
        !self.queue.is_empty() || self.inner.slow_completions()
    }
}
