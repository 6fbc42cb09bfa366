//! [`Qcow2Disk`]: a qcow2 image (version 3, as QEMU writes it) served on
//! udrive's io_uring file engine (docs/decisions/0038-qcow2.md).
//!
//! Who owns what: the image ([`image`]) is shared by every channel; its
//! metadata (L1, the L2 cache, refcounts, the allocator) sits behind one lock
//! that only the slow path and cache misses take. Each reactor's channel
//! ([`channel`]) keeps the L2 tables it uses and sends reads and writes of
//! allocated clusters to the image file through its own ring, lock-free.

mod backing;
mod channel;
mod compress;
mod create;
mod error;
mod handoff;
mod header;
mod image;
mod live;
mod meta;
mod repair;
mod tables;
mod target;
#[cfg(test)]
mod tests;

pub use backing::MAX_CHAIN as MAX_BACKING_CHAIN;
pub use create::{create_qcow2, CreateOptions};
pub use error::{HeaderError, Qcow2Error};
pub use handoff::Qcow2Claim;
pub use header::Header;
pub use live::{BlockJob, JobKind};
pub use target::RemoteTarget;

/// Parses a header from the first bytes of an image of `file_len` bytes (what
/// the fuzz target drives).
pub fn parse_header(buf: &[u8], file_len: u64) -> Result<Header, HeaderError> {
    Header::parse(buf, file_len)
}

use std::io;
use std::path::Path;
use std::sync::Arc;

use crate::{BlockDevice, BlockInfo, FileEngine, GeometryError, IoChannel};
use image::{Image, OpenOpts};

pub(crate) use crate::uring::punch;

/// The L2 cache's default size: 32 tables of 64 KiB cover 16 GiB of a
/// 64 KiB-cluster image.
pub const DEFAULT_L2_CACHE: u64 = 2 << 20;

/// How to open a [`Qcow2Disk`].
#[derive(Clone, Debug)]
pub struct Qcow2Options {
    pub read_only: bool,
    /// 512 or 4096 (default 512).
    pub block_size: Option<u32>,
    pub engine: FileEngine,
    /// Bytes of L2 tables kept in memory (at least one table).
    pub l2_cache: u64,
    /// The destination of a live migration: another process writes the image
    /// until the disk's [`Qcow2Claim`] is taken (nothing is written or locked
    /// before).
    pub inactive: bool,
    /// QEMU's image locks on the image and its backing chain (default on).
    pub locking: bool,
}

impl Default for Qcow2Options {
    fn default() -> Self {
        Qcow2Options {
            read_only: false,
            block_size: None,
            engine: FileEngine::Auto,
            l2_cache: DEFAULT_L2_CACHE,
            inactive: false,
            locking: true,
        }
    }
}

/// What `get_devices` shows of an image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Qcow2Status {
    /// The image served (another than the spec's after a snapshot or commit).
    pub path: std::path::PathBuf,
    pub virtual_size: u64,
    pub cluster_size: u64,
    /// Bytes the image file holds up to its last allocated cluster.
    pub allocated: u64,
    /// The backing chain, top first (`raw:PATH`, `qcow2:PATH`).
    pub backing_chain: Vec<String>,
}

/// A qcow2 image as a block device.
pub struct Qcow2Disk {
    /// The image served now (a live snapshot or commit replaces it).
    active: Arc<live::Active>,
    /// The image opened by path, as the spec names it.
    opened: std::path::PathBuf,
    l2_cache: u64,
    locking: bool,
    /// Another process writes the image (see [`Qcow2Claim`]).
    handed_off: Arc<std::sync::Mutex<bool>>,
    info: BlockInfo,
}

impl Qcow2Disk {
    /// Opens the image at `path` and its backing chain.
    pub fn open(path: impl AsRef<Path>, o: Qcow2Options) -> Result<Qcow2Disk, Qcow2Error> {
        Qcow2Disk::open_serving(path.as_ref(), path.as_ref(), o)
    }

    /// Opens the image at `active` (and its chain) for a disk whose spec names
    /// `spec`: a successor taking over a disk whose chain changed since the
    /// spec's image was opened (a live snapshot, commit or mirror pivot) serves
    /// the image its predecessor served, and still knows the chain changed.
    pub fn open_serving(
        active: &Path,
        spec: &Path,
        o: Qcow2Options,
    ) -> Result<Qcow2Disk, Qcow2Error> {
        let path = active;
        let bs = o.block_size.unwrap_or(512);
        let geometry = |e: GeometryError| Qcow2Error::Create {
            path: path.to_path_buf(),
            why: e.to_string(),
        };
        GeometryError::check_block_size(bs).map_err(geometry)?;
        let opts = OpenOpts {
            read_only: o.read_only,
            l2_cache: o.l2_cache,
            inactive: o.inactive && !o.read_only,
            locking: o.locking,
        };
        let image = Image::open(path, opts, &mut Vec::new())?;
        let num_blocks = image.header.size / u64::from(bs);
        GeometryError::check_size(num_blocks * u64::from(bs), u64::from(bs)).map_err(geometry)?;
        let info = BlockInfo {
            block_size: bs,
            num_blocks,
            volatile: false,
            write_cache: true,
            read_only: o.read_only,
            discard: true,
            write_zeroes: true,
            // Partial clusters of a discard are left as they are.
            discard_zeroes: false,
        };
        Ok(Qcow2Disk {
            opened: spec.to_path_buf(),
            active: Arc::new(live::Active::new(image, o.engine)),
            l2_cache: o.l2_cache,
            locking: o.locking,
            handed_off: Arc::new(std::sync::Mutex::new(opts.inactive)),
            info,
        })
    }

    pub fn status(&self) -> Qcow2Status {
        let image = self.active.get();
        let mut backing_chain = Vec::new();
        if let Some(b) = &image.backing {
            b.chain(&mut backing_chain);
        }
        Qcow2Status {
            path: image.path.clone(),
            virtual_size: image.header.size,
            cluster_size: image.cs(),
            allocated: image.allocated_bytes(),
            backing_chain,
        }
    }
}

impl BlockDevice for Qcow2Disk {
    fn describe(&self) -> String {
        format!(
            "qcow2:{}:bs={}{}",
            self.opened.display(),
            self.info.block_size,
            if self.info.read_only { ":ro" } else { "" }
        )
    }
    fn info(&self) -> &BlockInfo {
        &self.info
    }
    fn channel(&self) -> io::Result<Box<dyn IoChannel>> {
        Ok(Box::new(channel::Qcow2Channel::new(
            self.active.clone(),
            self.info.size_bytes(),
        )?))
    }
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
    /// A successor process opens the image (and a job's target) again: the
    /// metadata this one holds in memory goes to disk first (the front end has
    /// nothing in flight, a job is held between two steps).
    fn pause(&self) -> io::Result<()> {
        if self.info.read_only {
            return Ok(());
        }
        let image = self.active.get();
        image.flush()?;
        live::flush_target(&image)
    }
}
