//! [`FaultDisk`]: error and latency injection for tests.
//!
//! * A request fails if its op is selected by [`FaultConfig::ops`] and either its
//!   byte range overlaps one of [`FaultConfig::error_lbas`] or a per-channel
//!   xorshift RNG fires with probability [`FaultConfig::error_rate`]. Failed
//!   requests never reach the inner device: reads end in [`IoStatus::ReadError`],
//!   everything else in [`IoStatus::IoError`].
//! * Latency: the request is **executed at once** on the inner channel and only its
//!   *completion is withheld* until `submit time + latency`; it is then reported
//!   from [`IoChannel::poll`]. Injected errors are delayed the same way. With a zero
//!   latency the wrapper adds nothing (inner completions pass straight through).
//!
//! The pending table is preallocated (`PENDING_CAPACITY` entries) per channel;
//! beyond that it grows (test-only code; no allocation in the usual case).

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::slice::overlaps;
use crate::{BlockDevice, ChannelWrapper, DeviceWrapper, IoChannel, IoOp, IoRequest, IoStatus};

const PENDING_CAPACITY: usize = 4096;

/// Which requests faults apply to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultOps {
    Read,
    /// Write, WriteZeroes and Discard.
    Write,
    /// Every op, Flush included.
    All,
}

impl FaultOps {
    fn matches(self, op: IoOp) -> bool {
        match self {
            FaultOps::Read => op == IoOp::Read,
            FaultOps::Write => matches!(op, IoOp::Write | IoOp::WriteZeroes | IoOp::Discard),
            FaultOps::All => true,
        }
    }
}

#[derive(Clone, Debug)]
pub struct FaultConfig {
    /// Byte ranges `(start, len)`; a selected request touching one fails.
    pub error_lbas: Vec<(u64, u64)>,
    /// Fraction (0..=1) of selected requests that fail at random.
    pub error_rate: f64,
    pub ops: FaultOps,
    /// Added to every request's completion.
    pub latency: Duration,
    /// RNG seed; each channel derives its own stream from it (deterministic in
    /// channel-creation order).
    pub seed: u64,
}

impl Default for FaultConfig {
    fn default() -> Self {
        FaultConfig {
            error_lbas: Vec::new(),
            error_rate: 0.0,
            ops: FaultOps::All,
            latency: Duration::ZERO,
            seed: 1,
        }
    }
}

/// A [`FaultConfig`] that cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FaultError {
    #[error("error_rate {0} is not within 0..=1")]
    ErrorRate(f64),
}

impl From<FaultError> for io::Error {
    fn from(e: FaultError) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidInput, e)
    }
}

pub struct FaultDisk {
    inner: Arc<dyn BlockDevice>,
    config: Arc<FaultConfig>,
    channels: AtomicU64,
}

impl FaultDisk {
    pub fn new(inner: Arc<dyn BlockDevice>, config: FaultConfig) -> Result<FaultDisk, FaultError> {
        if !(0.0..=1.0).contains(&config.error_rate) {
            return Err(FaultError::ErrorRate(config.error_rate));
        }
        Ok(FaultDisk {
            inner,
            config: Arc::new(config),
            channels: AtomicU64::new(0),
        })
    }
}

impl DeviceWrapper for FaultDisk {
    fn inner(&self) -> &dyn BlockDevice {
        &*self.inner
    }
    fn kind(&self) -> &'static str {
        "fault"
    }
    fn rewrap(&self, inner: Arc<dyn BlockDevice>) -> io::Result<Arc<dyn BlockDevice>> {
        Ok(Arc::new(FaultDisk {
            inner,
            config: self.config.clone(),
            channels: AtomicU64::new(self.channels.load(Ordering::Relaxed)),
        }))
    }
    fn channel(&self) -> io::Result<Box<dyn IoChannel>> {
        let n = self.channels.fetch_add(1, Ordering::Relaxed);
        let mut state = self.config.seed ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        if state == 0 {
            state = 0x2545_F491_4F6C_DD1D;
        }
        // error_rate * 2^64 as an integer threshold; 1.0 saturates to "always".
        let threshold = if self.config.error_rate >= 1.0 {
            u64::MAX
        } else {
            (self.config.error_rate * 18_446_744_073_709_551_616.0) as u64
        };
        Ok(Box::new(FaultChannel {
            inner: self.inner.channel()?,
            config: self.config.clone(),
            rng: state,
            threshold,
            pending: Vec::with_capacity(PENDING_CAPACITY),
        }))
    }
}

struct Pending {
    tag: u64,
    deadline: Instant,
    /// `None` while the inner device is still working on it.
    status: Option<IoStatus>,
}

struct FaultChannel {
    inner: Box<dyn IoChannel>,
    config: Arc<FaultConfig>,
    rng: u64,
    threshold: u64,
    pending: Vec<Pending>,
}

impl FaultChannel {
    /// Whether the inner channel's notifier and deadline count: a delayed request
    /// is still with it, or nothing is delayed (see `crate::arm_holding`).
    fn inner_counts(&self) -> bool {
        self.pending.is_empty() || self.pending.iter().any(|p| p.status.is_none())
    }

    fn next_rand(&mut self) -> u64 {
        // xorshift64
        let mut x = self.rng;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng = x;
        x
    }

    fn injected(&mut self, req: &IoRequest<'_>) -> Option<IoStatus> {
        if !self.config.ops.matches(req.op) {
            return None;
        }
        let hit = self
            .config
            .error_lbas
            .iter()
            .any(|r| overlaps(*r, (req.offset, req.len.max(1))));
        let random = self.threshold != 0 && {
            let r = self.next_rand();
            self.threshold == u64::MAX || r < self.threshold
        };
        if hit || random {
            Some(if req.op == IoOp::Read {
                IoStatus::ReadError
            } else {
                IoStatus::IoError
            })
        } else {
            None
        }
    }
}

impl ChannelWrapper for FaultChannel {
    fn inner(&self) -> &dyn IoChannel {
        &*self.inner
    }
    fn inner_mut(&mut self) -> &mut dyn IoChannel {
        &mut *self.inner
    }

    fn submit(&mut self, tag: u64, req: &IoRequest<'_>) -> Option<IoStatus> {
        let status = match self.injected(req) {
            Some(err) => Some(err),
            None => self.inner.submit(tag, req),
        };
        if self.config.latency.is_zero() {
            return status;
        }
        self.pending.push(Pending {
            tag,
            deadline: Instant::now() + self.config.latency,
            status,
        });
        None
    }

    fn poll(&mut self, done: &mut dyn FnMut(u64, IoStatus)) -> usize {
        if self.config.latency.is_zero() {
            return self.inner.poll(done);
        }
        let pending = &mut self.pending;
        self.inner.poll(&mut |tag, st| {
            if let Some(p) = pending
                .iter_mut()
                .find(|p| p.tag == tag && p.status.is_none())
            {
                p.status = Some(st);
            }
        });
        let now = Instant::now();
        let mut n = 0;
        let mut i = 0;
        // Order is preserved among requests that become ready together.
        while i < self.pending.len() {
            let p = &self.pending[i];
            match p.status {
                Some(st) if p.deadline <= now => {
                    let tag = p.tag;
                    self.pending.remove(i);
                    done(tag, st);
                    n += 1;
                }
                _ => i += 1,
            }
        }
        n
    }

    /// Delayed completions wait for their deadline ([`IoChannel::wake_by`]); those
    /// still with the inner channel for its notifier.
    fn arm_notifier(&mut self) -> crate::Armed {
        let counts = self.inner_counts();
        crate::arm_holding(&mut *self.inner, counts)
    }

    fn notifier(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.inner_counts().then(|| self.inner.notifier()).flatten()
    }

    fn wake_by(&self) -> Option<Instant> {
        let due = self
            .pending
            .iter()
            .filter(|p| p.status.is_some())
            .map(|p| p.deadline)
            .min();
        let inner = self.inner_counts().then(|| self.inner.wake_by()).flatten();
        crate::earliest(due, inner)
    }
}
