//! [`HeldDisk`]: a stand-in for a network backend in tests of the front ends'
//! polling: a RAM disk whose completions are slow (held until the test releases
//! them) and announced on a socket the reactor can sleep on, as librbd's are.

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::{Armed, BlockDevice, BlockInfo, IoChannel, IoRequest, IoStatus, RamDisk};

/// The test's side of a [`HeldDisk`]: how many requests it took, and the release
/// of their completions.
pub struct HeldGate {
    released: AtomicUsize,
    submitted: AtomicUsize,
    bell: Mutex<UnixStream>,
}

impl HeldGate {
    /// Requests the disk's channel has taken.
    pub fn submitted(&self) -> usize {
        self.submitted.load(Ordering::SeqCst)
    }

    /// Lets `n` more completions go (oldest first) and wakes a sleeping reactor.
    pub fn release(&self, n: usize) {
        self.released.fetch_add(n, Ordering::SeqCst);
        let mut bell = self.bell.lock().unwrap_or_else(|p| p.into_inner());
        // The channel drains the socket on every poll; a full buffer already wakes it.
        let _ = bell.write(&[1]);
    }
}

/// A RAM disk with held completions; it has one channel (one queue, one reactor).
pub struct HeldDisk {
    ram: RamDisk,
    gate: Arc<HeldGate>,
    wake: Mutex<Option<UnixStream>>,
}

impl HeldDisk {
    /// A disk of `size` bytes in `block_size` blocks, and the gate that releases
    /// its completions.
    pub fn new(size: u64, block_size: u32) -> io::Result<(HeldDisk, Arc<HeldGate>)> {
        let (bell, wake) = UnixStream::pair()?;
        bell.set_nonblocking(true)?;
        wake.set_nonblocking(true)?;
        let gate = Arc::new(HeldGate {
            released: AtomicUsize::new(0),
            submitted: AtomicUsize::new(0),
            bell: Mutex::new(bell),
        });
        let disk = HeldDisk {
            ram: RamDisk::new(size, block_size)?,
            gate: gate.clone(),
            wake: Mutex::new(Some(wake)),
        };
        Ok((disk, gate))
    }
}

impl BlockDevice for HeldDisk {
    fn describe(&self) -> String {
        "held".into()
    }

    fn info(&self) -> &BlockInfo {
        self.ram.info()
    }

    fn channel(&self) -> io::Result<Box<dyn IoChannel>> {
        let wake = self
            .wake
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or_else(|| io::Error::other("a held disk has one channel"))?;
        Ok(Box::new(HeldChannel {
            inner: self.ram.channel()?,
            gate: self.gate.clone(),
            held: Vec::new(),
            delivered: 0,
            wake,
        }))
    }
}

struct HeldChannel {
    inner: Box<dyn IoChannel>,
    gate: Arc<HeldGate>,
    held: Vec<(u64, IoStatus)>,
    delivered: usize,
    wake: UnixStream,
}

impl HeldChannel {
    fn releasable(&self) -> usize {
        let released = self.gate.released.load(Ordering::SeqCst);
        released.saturating_sub(self.delivered).min(self.held.len())
    }
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
        let n = self.releasable();
        for (tag, st) in self.held.drain(..n) {
            done(tag, st);
        }
        self.delivered += n;
        n
    }

    fn arm_notifier(&mut self) -> Armed {
        if self.releasable() > 0 {
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
