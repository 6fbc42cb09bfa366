//! [`HeldDisk`]: a backend whose completions wait for the test, a stand-in for a
//! network backend (librbd) in tests of the front ends' polling, and a way to keep
//! requests in flight (format, resize, namespace removal under I/O).
//!
//! It wraps a device that completes inline (a RAM disk by default): requests are
//! done at once by the device underneath, but their completions are held until the test releases
//! them through the [`HeldGate`] — a number at a time, or all of them while the
//! gate is open — and are announced on a socket the reactor can sleep on, as
//! librbd's are. What it does not model: a failing network (every request gets
//! the status the device underneath gave it) or completions out of order (they
//! go oldest first).

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bdev::{Armed, BlockDevice, BlockInfo, FormatSupport, IoChannel, IoRequest, IoStatus, RamDisk};

/// The test's side of a [`HeldDisk`]: how many requests it took, and the release
/// of their completions.
#[derive(Default)]
pub struct HeldGate {
    released: AtomicUsize,
    delivered: AtomicUsize,
    submitted: AtomicUsize,
    open: AtomicBool,
    /// One socket per channel, written to wake a reactor sleeping on the other end.
    bells: Mutex<Vec<UnixStream>>,
}

impl HeldGate {
    /// Requests the disk's channels have taken.
    pub fn submitted(&self) -> usize {
        self.submitted.load(Ordering::SeqCst)
    }

    /// Lets `n` more completions go (oldest first) and wakes a sleeping reactor.
    pub fn release(&self, n: usize) {
        self.released.fetch_add(n, Ordering::SeqCst);
        self.ring();
    }

    /// Lets every completion go, held ones and later ones, until [`HeldGate::close`].
    pub fn open(&self) {
        self.open.store(true, Ordering::SeqCst);
        self.ring();
    }

    /// Holds completions again (from now on, none released).
    pub fn close(&self) {
        self.open.store(false, Ordering::SeqCst);
        let delivered = self.delivered.load(Ordering::SeqCst);
        self.released.store(delivered, Ordering::SeqCst);
    }

    fn ring(&self) {
        let bells = self.bells.lock().unwrap_or_else(|p| p.into_inner());
        for mut bell in bells.iter() {
            // The channel drains its socket on every poll; a full buffer already
            // wakes it.
            let _ = bell.write(&[1]);
        }
    }

    /// Takes up to `want` completions from what the test released.
    fn take(&self, want: usize) -> usize {
        if want == 0 {
            return 0;
        }
        if self.open.load(Ordering::SeqCst) {
            self.delivered.fetch_add(want, Ordering::SeqCst);
            return want;
        }
        let mut d = self.delivered.load(Ordering::SeqCst);
        loop {
            let r = self.released.load(Ordering::SeqCst);
            let n = r.saturating_sub(d).min(want);
            if n == 0 {
                return 0;
            }
            match self
                .delivered
                .compare_exchange(d, d + n, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => return n,
                Err(now) => d = now,
            }
        }
    }

    fn any_released(&self) -> bool {
        self.open.load(Ordering::SeqCst)
            || self.released.load(Ordering::SeqCst) > self.delivered.load(Ordering::SeqCst)
    }
}

/// A device with held completions.
pub struct HeldDisk {
    inner: Arc<dyn BlockDevice>,
    gate: Arc<HeldGate>,
}

impl HeldDisk {
    /// A RAM disk of `size` bytes in `block_size` blocks with held completions, and
    /// the gate that releases them.
    pub fn new(size: u64, block_size: u32) -> io::Result<(HeldDisk, Arc<HeldGate>)> {
        Ok(Self::over(Arc::new(RamDisk::new(size, block_size)?)))
    }

    /// `inner` with held completions, and the gate that releases them.
    pub fn over(inner: Arc<dyn BlockDevice>) -> (HeldDisk, Arc<HeldGate>) {
        let gate = Arc::new(HeldGate::default());
        let disk = HeldDisk {
            inner,
            gate: gate.clone(),
        };
        (disk, gate)
    }
}

impl BlockDevice for HeldDisk {
    fn describe(&self) -> String {
        format!("held:{}", self.inner.describe())
    }

    fn info(&self) -> &BlockInfo {
        self.inner.info()
    }

    fn channel(&self) -> io::Result<Box<dyn IoChannel>> {
        let (bell, wake) = UnixStream::pair()?;
        bell.set_nonblocking(true)?;
        wake.set_nonblocking(true)?;
        self.gate
            .bells
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(bell);
        Ok(Box::new(HeldChannel {
            inner: self.inner.channel()?,
            gate: self.gate.clone(),
            held: Vec::new(),
            wake,
        }))
    }

    /// A new handle over the resized device underneath, whose gate is open: what
    /// the old handle holds stays held.
    fn resize(&self, bytes: u64) -> io::Result<Arc<dyn BlockDevice>> {
        let (disk, gate) = HeldDisk::over(self.inner.resize(bytes)?);
        gate.open();
        Ok(Arc::new(disk))
    }

    fn format_support(&self) -> FormatSupport {
        self.inner.format_support()
    }
}

struct HeldChannel {
    inner: Box<dyn IoChannel>,
    gate: Arc<HeldGate>,
    held: Vec<(u64, IoStatus)>,
    wake: UnixStream,
}

impl IoChannel for HeldChannel {
    fn submit(&mut self, tag: u64, req: &IoRequest<'_>) -> Option<IoStatus> {
        let st = self.inner.submit(tag, req).unwrap_or(IoStatus::IoError);
        self.held.push((tag, st));
        self.gate.submitted.fetch_add(1, Ordering::SeqCst);
        None
    }

    fn poll(&mut self, done: &mut dyn FnMut(u64, IoStatus)) -> usize {
        let mut drain = [0u8; 64];
        while matches!(self.wake.read(&mut drain), Ok(n) if n > 0) {}
        let n = self.gate.take(self.held.len());
        for (tag, st) in self.held.drain(..n) {
            done(tag, st);
        }
        n
    }

    fn arm_notifier(&mut self) -> Armed {
        if !self.held.is_empty() && self.gate.any_released() {
            Armed::Ready
        } else {
            Armed::Fd
        }
    }

    fn notifier(&self) -> Option<BorrowedFd<'_>> {
        Some(self.wake.as_fd())
    }

    fn slow_completions(&self) -> bool {
        true
    }
}
