//! Writer claims: what keeps a second writer off a disk that two devices have
//! open at once — the source and the destination of a live migration, in one
//! process or two, on one host or two (shared storage). Only the device that holds
//! the claim writes; the other takes it when the first lets go.
//!
//! * [`RangeClaim`] — a file or block device: an open-file-description lock
//!   (`F_OFD_SETLK`, write) on the byte range the device serves, on a descriptor of
//!   its own, so two devices conflict even inside one process and disjoint slices
//!   of one file do not. Advisory, like QEMU's image locking: it keeps udrive
//!   devices (and other lock-aware programs) apart. The descriptor is opened when
//!   the claim is made, not when it is taken: a device's own thread takes it, and
//!   that thread's system-call filter lets it open files read-only only.
//! * [`DiskClaim`] — a backend whose claim is its own ([`BlockDevice::pause`] and
//!   [`BlockDevice::resume`]): an RBD image's exclusive lock.

use std::fmt::Debug;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::Arc;

use crate::BlockDevice;

/// What keeps a second writer off a disk while a device writes it. Another device
/// (in any process) that holds the claim makes [`WriterClaim::take`] fail.
pub trait WriterClaim: Send + Sync + Debug {
    /// Takes the claim; idempotent.
    fn take(&self) -> io::Result<()>;
    /// Gives it up; idempotent.
    fn release(&self) -> io::Result<()>;
}

/// A write lock on bytes `[offset, offset + len)` of a file (`len` 0: to the end,
/// however far it grows).
#[derive(Debug)]
pub struct RangeClaim {
    path: PathBuf,
    offset: u64,
    len: u64,
    /// Opened for writing (a write lock needs it); never read or written through.
    /// Setting or clearing a lock it already has or has not is a no-op, so
    /// `take` and `release` are idempotent without state of their own.
    fd: File,
}

impl RangeClaim {
    /// Opens `path` for the lock; takes nothing yet.
    pub fn new(path: PathBuf, offset: u64, len: u64) -> io::Result<RangeClaim> {
        let fd = OpenOptions::new().read(true).write(true).open(&path)?;
        Ok(RangeClaim {
            path,
            offset,
            len,
            fd,
        })
    }

    fn set_lock(&self, kind: libc::c_int) -> io::Result<()> {
        let too_far = || io::Error::new(io::ErrorKind::InvalidInput, "range beyond off_t");
        let fl = libc::flock {
            l_type: kind as libc::c_short,
            l_whence: libc::SEEK_SET as libc::c_short,
            l_start: libc::off_t::try_from(self.offset).map_err(|_| too_far())?,
            l_len: libc::off_t::try_from(self.len).map_err(|_| too_far())?,
            l_pid: 0,
        };
        nix::fcntl::fcntl(self.fd.as_raw_fd(), nix::fcntl::FcntlArg::F_OFD_SETLK(&fl))
            .map(|_| ())
            .map_err(|e| match e {
                nix::errno::Errno::EAGAIN | nix::errno::Errno::EACCES => io::Error::new(
                    io::ErrorKind::ResourceBusy,
                    format!(
                        "bytes {}+{} of {} are claimed by another writer (another udrive \
                         device or process serving the same range)",
                        self.offset,
                        self.len,
                        self.path.display()
                    ),
                ),
                e => io::Error::from(e),
            })
    }
}

impl WriterClaim for RangeClaim {
    fn take(&self) -> io::Result<()> {
        // The lock belongs to this claim's open file description, so it
        // conflicts with every other one, this process's included.
        self.set_lock(libc::F_WRLCK)
    }

    fn release(&self) -> io::Result<()> {
        self.set_lock(libc::F_UNLCK)
    }
}

/// The claim a backend keeps itself: [`BlockDevice::resume`] takes it (breaking
/// no one's), [`BlockDevice::pause`] gives it up.
pub struct DiskClaim(pub Arc<dyn BlockDevice>);

impl Debug for DiskClaim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DiskClaim({})", self.0.describe())
    }
}

impl WriterClaim for DiskClaim {
    fn take(&self) -> io::Result<()> {
        self.0.resume(&[])
    }
    fn release(&self) -> io::Result<()> {
        self.0.pause()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_writer_per_range_even_in_one_process() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("disk.img");
        File::create(&p).unwrap().set_len(1 << 20).unwrap();
        let a = RangeClaim::new(p.clone(), 0, 0).unwrap();
        let b = RangeClaim::new(p.clone(), 4096, 4096).unwrap();
        let c = RangeClaim::new(p.clone(), 0, 4096).unwrap();
        let d = RangeClaim::new(p.clone(), 4096, 4096).unwrap();
        a.take().unwrap();
        a.take().unwrap();
        let e = b.take().unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ResourceBusy);
        a.release().unwrap();
        // Disjoint ranges do not conflict.
        b.take().unwrap();
        c.take().unwrap();
        assert_eq!(d.take().unwrap_err().kind(), io::ErrorKind::ResourceBusy);
        b.release().unwrap();
        d.take().unwrap();
        assert!(a.take().is_err());
    }
}
