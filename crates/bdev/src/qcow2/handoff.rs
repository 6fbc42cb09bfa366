//! Handing a qcow2 image from one process to another while a VM moves between
//! them (a live migration on shared storage), as QEMU inactivates and
//! activates its images: both processes have the image open, but its metadata
//! is cached in the one that writes it, so the writer puts it on disk and
//! stops, and the other reads it again before it writes.
//!
//! The disk's [`Qcow2Claim`] is its writer claim: taking it (the VM starts
//! here) takes QEMU's write locks on the image and, if another process wrote
//! it since, reads its tables again; releasing it (the VM left) writes the
//! metadata back and lets the locks go. A destination's disk opens with
//! nothing written or locked ([`super::Qcow2Options::inactive`]).
//!
//! A block job on the disk stops between two steps while the image is handed
//! off, and its target (a commit's base, a mirror's copy) is written back and
//! its locks let go with the image, so that the other process can open the
//! chain. If the image comes back, a commit or mirror copies again from the
//! start: what the guest wrote in the other process did not reach its target.

use std::fmt;
use std::io;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};

use super::live::{self, Active};
use super::Qcow2Disk;
use crate::image_lock::Perms;
use crate::WriterClaim;

/// The writer claim of a [`Qcow2Disk`] (see the module's text).
pub struct Qcow2Claim {
    active: Arc<Active>,
    handed_off: Arc<Mutex<bool>>,
    read_only: bool,
}

impl Qcow2Disk {
    /// The disk's writer claim, for a device that may hand its VM to another
    /// process.
    pub fn claim(&self) -> Qcow2Claim {
        Qcow2Claim {
            active: self.active.clone(),
            handed_off: self.handed_off.clone(),
            read_only: self.info.read_only,
        }
    }
}

impl Qcow2Claim {
    fn state(&self) -> MutexGuard<'_, bool> {
        self.handed_off.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl fmt::Debug for Qcow2Claim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Qcow2Claim({})", self.active.get().path.display())
    }
}

impl WriterClaim for Qcow2Claim {
    fn take(&self) -> io::Result<()> {
        if self.read_only {
            return Ok(());
        }
        let mut handed_off = self.state();
        let image = self.active.get();
        image.set_lock(Perms::QCOW2_WRITER)?;
        if *handed_off {
            let taken = live::take_target(&image).and_then(|()| Ok(image.reload()?));
            if let Err(e) = taken {
                let _ = live::release_target(&image);
                let _ = image.set_lock(Perms::NONE);
                return Err(e);
            }
            image.takeovers.fetch_add(1, Ordering::AcqRel);
            image.handed_off.store(false, Ordering::Release);
            tracing::info!(path = %image.path.display(), "qcow2: took the image over; its metadata was read again");
            *handed_off = false;
        }
        Ok(())
    }

    fn release(&self) -> io::Result<()> {
        if self.read_only {
            return Ok(());
        }
        let mut handed_off = self.state();
        if *handed_off {
            return Ok(());
        }
        let image = self.active.get();
        {
            // Under the metadata lock: a block job's step in progress ends
            // first, and the next one waits until the image comes back.
            let _meta = image.meta();
            image.handed_off.store(true, Ordering::Release);
        }
        let released = image
            .flush()
            .and_then(|()| live::release_target(&image))
            .and_then(|()| image.set_lock(Perms::NONE));
        if let Err(e) = released {
            let _ = live::take_target(&image);
            image.handed_off.store(false, Ordering::Release);
            return Err(e);
        }
        *handed_off = true;
        Ok(())
    }
}
