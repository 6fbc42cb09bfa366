//! A namespace as the controller holds it, and the constants its changes use. A
//! leaf of the crate: the control path (`namespaces.rs`, `ctrl.rs`), Identify and
//! the queue groups all read it.

use std::any::Any;
use std::sync::Arc;

use bdev::{BlockDevice, BlockInfo};

/// Async event: type Notice (2), info Namespace Attribute Changed (0), log page 04h.
pub(crate) const EVENT_NS_CHANGED: u32 = 0x02 | (0x04 << 16);
/// Asynchronous Event Configuration bit that enables namespace attribute notices.
pub(crate) const AEC_NS_ATTR: u32 = 1 << 8;

/// Why a namespace change was refused.
#[derive(Debug, thiserror::Error)]
pub enum NsError {
    #[error("namespace ID {0} is out of range (1..={1})")]
    OutOfRange(u32, u32),
    #[error("namespace {0} already exists")]
    Exists(u32),
    #[error("namespace {0} does not exist")]
    NotFound(u32),
    #[error("namespace block size {0} is not a power of two in 512..=65536")]
    BlockSize(u32),
    #[error("cannot open an I/O channel on the backend: {0}")]
    Channel(std::io::Error),
    #[error("a Format NVM is erasing namespace {0}; change its size when the format has ended")]
    Formatting(u32),
    #[error("size {bytes} is not a non-zero multiple of the namespace's LBA size {block_size}")]
    Size { bytes: u64, block_size: u32 },
    #[error("the backend cannot take the new size: {0}")]
    Backend(std::io::Error),
    #[error("all {0} namespace IDs are in use")]
    Full(u32),
}

/// What the host was told of a namespace change ([`crate::Controller::resize_namespace`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NsNotice {
    /// A Namespace Attribute Changed event is posted (or queued for the host's next
    /// Asynchronous Event Request); the NSID is in the Changed Namespace List.
    Event,
    /// An earlier event is not acknowledged yet: the host has still to read the
    /// Changed Namespace List, which now lists this NSID too.
    Pending,
    /// The host did not enable Namespace Attribute Notices: it sees the change
    /// when it identifies the namespace again.
    Disabled,
    /// The controller is not enabled (no host, or one that reset it): the host
    /// identifies the namespaces when it enables it.
    NotReady,
}

/// What the controller's owner keeps with a namespace and the controller never
/// looks at (udrive: how it was specified and its QoS handle), so that the
/// controller's namespace table is the only one.
#[derive(Clone)]
pub struct NsLabel(Arc<dyn Any + Send + Sync>);

impl NsLabel {
    pub fn new<T: Any + Send + Sync>(v: T) -> NsLabel {
        NsLabel(Arc::new(v))
    }

    /// The label as the `T` it was made from.
    pub fn get<T: Any>(&self) -> Option<&T> {
        self.0.downcast_ref()
    }
}

impl Default for NsLabel {
    fn default() -> NsLabel {
        NsLabel::new(())
    }
}

impl std::fmt::Debug for NsLabel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NsLabel")
    }
}

/// A namespace as its owner hands it to the controller: the backend and a label.
#[derive(Clone)]
pub struct Namespace {
    pub dev: Arc<dyn BlockDevice>,
    pub label: NsLabel,
}

impl Namespace {
    pub fn new(dev: Arc<dyn BlockDevice>, label: NsLabel) -> Namespace {
        Namespace { dev, label }
    }
}

/// A backend alone is a namespace without a label.
impl<D: BlockDevice + 'static> From<Arc<D>> for Namespace {
    fn from(dev: Arc<D>) -> Namespace {
        Namespace::new(dev, NsLabel::default())
    }
}

impl From<Arc<dyn BlockDevice>> for Namespace {
    fn from(dev: Arc<dyn BlockDevice>) -> Namespace {
        Namespace::new(dev, NsLabel::default())
    }
}

/// An active namespace as the controller's table shows it.
#[derive(Clone)]
pub struct NsView {
    pub nsid: u32,
    /// Its backend's facts in the current LBA format (after a Format NVM the block
    /// size and count are the host's, not the backend's).
    pub info: BlockInfo,
    pub label: NsLabel,
    /// Its backend.
    pub dev: Arc<dyn BlockDevice>,
}

/// An active namespace: its backend and what the host sees of it.
#[derive(Clone)]
pub(crate) struct Ns {
    pub dev: Arc<dyn BlockDevice>,
    pub label: NsLabel,
    /// The backend's facts in the current LBA format: after a Format NVM the block
    /// size and count differ from `dev.info()` (the backend addresses bytes).
    pub info: BlockInfo,
    /// A Format NVM is erasing it: its I/O commands get Format In Progress.
    pub formatting: bool,
}

impl Ns {
    pub fn new(ns: Namespace) -> Ns {
        Ns {
            info: ns.dev.info().clone(),
            dev: ns.dev,
            label: ns.label,
            formatting: false,
        }
    }

    pub fn view(&self, nsid: u32) -> NsView {
        NsView {
            nsid,
            info: self.info.clone(),
            label: self.label.clone(),
            dev: self.dev.clone(),
        }
    }

    pub fn namespace(self) -> Namespace {
        Namespace::new(self.dev, self.label)
    }
}

pub(crate) fn check_block_size(dev: &dyn BlockDevice) -> Result<(), NsError> {
    let bs = dev.info().block_size;
    if !bs.is_power_of_two() || !(512..=65536).contains(&bs) {
        return Err(NsError::BlockSize(bs));
    }
    Ok(())
}
