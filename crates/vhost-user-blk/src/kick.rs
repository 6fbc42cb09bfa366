//! The kick watcher: one small thread per connection that sleeps on the kick
//! eventfds of the running vrings and wakes the reactor of a kicked queue (a
//! reactor in adaptive or event mode sleeps; a busy one sees the ring anyway).
//!
//! The eventfds are registered edge-triggered and never read: an eventfd reports
//! every write as a new edge, so no kick is lost, and the counter's value means
//! nothing to us (it would take 2^64 kicks to fill). Not reading them keeps the
//! path free of locks (the fds belong to the handler, which replaces them) and
//! lets a device in another process watch the same eventfds during a handover
//! without stealing kicks from it. An event that arrives for an fd the handler has
//! just removed only causes one spurious wake.

use std::io;
use std::os::fd::{AsRawFd, RawFd};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

/// Event data of the exit eventfd (queue indices are below it).
const EXIT: u64 = u64::MAX;

pub(crate) struct Kicks {
    epoll: Epoll,
    exit: EventFd,
}

impl Kicks {
    pub fn new() -> io::Result<Kicks> {
        let epoll = Epoll::new()?;
        let exit = EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)?;
        epoll.ctl(
            ControlOperation::Add,
            exit.as_raw_fd(),
            EpollEvent::new(EventSet::IN, EXIT),
        )?;
        Ok(Kicks { epoll, exit })
    }

    /// Watches (or stops watching) queue `index`'s kick eventfd `fd`.
    pub fn set(&self, fd: RawFd, index: usize, on: bool) -> io::Result<()> {
        let ev = EpollEvent::new(EventSet::IN | EventSet::EDGE_TRIGGERED, index as u64);
        let op = if on {
            ControlOperation::Add
        } else {
            ControlOperation::Delete
        };
        match self.epoll.ctl(op, fd, ev) {
            Err(e) if on && e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
            Err(e) if !on && e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
            r => r,
        }
    }

    /// The thread's loop: calls `wake` with the index of each kicked queue until
    /// [`stop`](Self::stop).
    pub fn run(&self, wake: impl Fn(usize)) {
        let mut events = [EpollEvent::default(); 16];
        loop {
            let n = match self.epoll.wait(-1, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::error!(error = %e, "the vhost-user kick watcher stopped; queues in event mode sleep until polled");
                    return;
                }
            };
            for ev in &events[..n] {
                if ev.data() == EXIT {
                    return;
                }
                if let Ok(i) = usize::try_from(ev.data()) {
                    wake(i);
                }
            }
        }
    }

    pub fn stop(&self) {
        let _ = self.exit.write(1);
    }
}
