//! Errors of the RBD backend's control path.

use std::io;

use crate::GeometryError;

/// Why an RBD operation failed.
#[derive(Debug, thiserror::Error)]
pub enum RbdError {
    /// A librados/librbd call failed with an errno; `hint` says what an operator
    /// can do about it, where the errno has a usual cause.
    #[error("{what}{}", hint.as_ref().map(|h| format!(" ({h})")).unwrap_or_default())]
    Call {
        what: String,
        hint: Option<String>,
        #[source]
        errno: io::Error,
    },
    #[error("{value:?} contains a NUL byte")]
    Nul { value: String },
    #[error("image {image} cannot be served with this block size")]
    Geometry {
        image: String,
        #[source]
        source: GeometryError,
    },
    #[error("image {image} is {size} bytes, smaller than one {block_size}-byte block")]
    TooSmall {
        image: String,
        size: u64,
        block_size: u32,
    },
    #[error("{device} is read-only")]
    ReadOnly { device: String },
    /// An operation on a device failed (`device` as it describes itself).
    #[error("{device}")]
    Device {
        device: String,
        #[source]
        source: Box<RbdError>,
    },
    #[error("no request slot {0}")]
    NoSlot(u32),
    #[error("cannot create a channel's completion notifier")]
    Notifier(#[source] io::Error),
    #[error("cannot confine librbd's threads to their CPUs")]
    Affinity(#[source] io::Error),
}

impl RbdError {
    /// A failed librados/librbd call: `ret` is its negative errno.
    pub(super) fn call(ret: i64, what: String) -> RbdError {
        let errno = i32::try_from(-ret).unwrap_or(libc::EIO);
        RbdError::Call {
            what,
            hint: None,
            errno: io::Error::from_raw_os_error(errno),
        }
    }

    /// The errno a failed call returned (through any device context).
    pub fn errno(&self) -> Option<i32> {
        match self {
            RbdError::Call { errno, .. } => errno.raw_os_error(),
            RbdError::Device { source, .. } => source.errno(),
            _ => None,
        }
    }

    /// Adds what `hint` says about this error's errno, if anything.
    pub(super) fn hinted(mut self, hint: impl Fn(i32) -> Option<String>) -> RbdError {
        if let RbdError::Call { errno, hint: h, .. } = &mut self {
            if let Some(text) = errno.raw_os_error().and_then(hint) {
                *h = Some(text);
            }
        }
        self
    }

    fn kind(&self) -> io::ErrorKind {
        match self {
            RbdError::Call { errno, .. } => errno.kind(),
            RbdError::Nul { .. }
            | RbdError::Geometry { .. }
            | RbdError::TooSmall { .. }
            | RbdError::NoSlot(_) => io::ErrorKind::InvalidInput,
            RbdError::ReadOnly { .. } => io::ErrorKind::PermissionDenied,
            RbdError::Device { source, .. } => source.kind(),
            RbdError::Notifier(e) | RbdError::Affinity(e) => e.kind(),
        }
    }
}

impl From<RbdError> for io::Error {
    fn from(e: RbdError) -> io::Error {
        io::Error::new(e.kind(), e)
    }
}
