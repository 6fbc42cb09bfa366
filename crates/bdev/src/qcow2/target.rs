//! Where a commit or mirror writes (docs/decisions/0041-qcow2-snapshots-and-jobs.md,
//! 0045-mirror-to-another-host.md): a qcow2 image on this host, or an export
//! another server serves (NBD), written synchronously.
//!
//! A guest write is written through under the image's metadata lock. Into an
//! image on this host a failure is the guest's (its write fails, as the image
//! would). Into another host a failure is the job's: the guest's write has
//! reached its own image, so the target stops being written and the job fails
//! at its next look; a network outage never turns into guest I/O errors.

use std::io;
use std::sync::Arc;

/// What a commit or mirror needs of an image on this host (the image's own
/// synchronous writes, which take its metadata lock).
pub(super) trait LocalTarget {
    fn write_sync(&self, offset: u64, data: &[u8], scratch: &mut [u8]) -> io::Result<()>;
    fn zero_clusters(&self, first: u64, count: u64, discard: bool) -> io::Result<()>;
}

/// An export on another host that a mirror writes into (udrive implements it
/// over an NBD client). Calls come under the image's metadata lock, from a
/// reactor (guest writes) or the job's thread (its copy).
pub trait RemoteTarget: Send {
    /// How the operator names it (a URI).
    fn name(&self) -> String;
    /// Its size in bytes.
    fn size(&self) -> u64;
    fn write(&mut self, offset: u64, data: &[u8]) -> io::Result<()>;
    fn write_zeroes(&mut self, offset: u64, len: u64) -> io::Result<()>;
    /// Makes every write before it durable at the target.
    fn flush(&mut self) -> io::Result<()>;
}

/// A commit's base or a mirror's copy.
pub(super) enum Target<I> {
    Image(Arc<I>),
    Remote(Remote),
}

/// A remote target and whether writing through into it failed.
pub(super) struct Remote {
    to: Box<dyn RemoteTarget>,
    /// The guest's virtual size: zeroes of a last partial cluster stop there.
    size: u64,
    failed: Option<String>,
}

/// The target of a running commit or mirror, written through by every guest
/// write.
pub(super) struct Through<I> {
    pub target: Target<I>,
    /// One cluster, for a local target's partial writes.
    pub scratch: Vec<u8>,
}

impl Remote {
    pub(super) fn new(to: Box<dyn RemoteTarget>, size: u64) -> Remote {
        Remote {
            to,
            size,
            failed: None,
        }
    }

    /// A guest write's copy: a failure ends writing through, not the guest's
    /// write.
    fn keep(&mut self, f: impl FnOnce(&mut dyn RemoteTarget) -> io::Result<()>) {
        if self.failed.is_some() {
            return;
        }
        if let Err(e) = f(&mut *self.to) {
            let why = format!("{}: {e}", self.to.name());
            tracing::error!("mirror: writing a guest write through failed, the job fails: {why}");
            self.failed = Some(why);
        }
    }

    fn check(&self) -> io::Result<()> {
        match &self.failed {
            Some(why) => Err(io::Error::other(format!(
                "writing through into the target failed: {why}"
            ))),
            None => Ok(()),
        }
    }

    pub(super) fn flush(&mut self) -> io::Result<()> {
        self.check()?;
        self.to.flush()
    }

    pub(super) fn name(&self) -> String {
        self.to.name()
    }

    /// Guest clusters `first..first+count` as a byte range inside the disk.
    fn clusters(&self, cs: u64, first: u64, count: u64) -> (u64, u64) {
        let start = (first * cs).min(self.size);
        let end = ((first + count) * cs).min(self.size);
        (start, end - start)
    }
}

impl<I: LocalTarget> Through<I> {
    pub(super) fn new(target: Target<I>, cluster_size: u64) -> Through<I> {
        Through {
            target,
            scratch: vec![0; cluster_size as usize],
        }
    }

    /// After a guest write of `data` at `off` into the image.
    pub(super) fn write(&mut self, off: u64, data: &[u8]) -> io::Result<()> {
        match &mut self.target {
            Target::Image(b) => b.write_sync(off, data, &mut self.scratch),
            Target::Remote(r) => {
                r.keep(|to| to.write(off, data));
                Ok(())
            }
        }
    }

    /// After guest clusters `first..first+count` were made zeroes.
    pub(super) fn zero(&mut self, cs: u64, first: u64, count: u64) -> io::Result<()> {
        match &mut self.target {
            Target::Image(b) => b.zero_clusters(first, count, false),
            Target::Remote(r) => {
                let (off, len) = r.clusters(cs, first, count);
                r.keep(|to| to.write_zeroes(off, len));
                Ok(())
            }
        }
    }

    /// The job's copy of guest cluster `c`: `data`, or zeroes. A failure is
    /// the job's.
    pub(super) fn copy(&mut self, cs: u64, c: u64, data: Option<&[u8]>) -> io::Result<()> {
        match (&mut self.target, data) {
            (Target::Image(b), None) => b.zero_clusters(c, 1, false),
            (Target::Image(b), Some(d)) => b.write_sync(c * cs, d, &mut self.scratch),
            (Target::Remote(r), d) => {
                r.check()?;
                let (off, len) = r.clusters(cs, c, 1);
                match d {
                    None => r.to.write_zeroes(off, len),
                    Some(d) => r.to.write(off, &d[..len as usize]),
                }
            }
        }
    }

    /// Whether writing through failed (the job should end).
    pub(super) fn failed(&self) -> io::Result<()> {
        match &self.target {
            Target::Remote(r) => r.check(),
            Target::Image(_) => Ok(()),
        }
    }
}
