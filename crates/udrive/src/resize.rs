//! Online resize of an attached disk (the `resize` RPC, docs/decisions/0018-online-resize.md).
//!
//! The server finds the device; the device (`FrontEnd::resize`) checks the request
//! here ([`check`]), asks its disk's QoS wrapper for a resized handle — which asks
//! the backend (`bdev::BlockDevice::resize`), so every backend kind that can change
//! size gets online resize without code here — switches its queues to it and tells
//! the guest. Nothing in this path knows backend kinds.

use crate::nsspec::NsSpec;

/// What the operator asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResizeRequest {
    /// The new size in bytes.
    pub bytes: u64,
    /// Allows a size below the current one (the data past the new end is lost).
    pub shrink: bool,
}

/// What a resize did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resized {
    pub old_bytes: u64,
    pub new_bytes: u64,
    /// The size the guest addresses the disk in (an NVMe namespace's current LBA
    /// size, the virtio-blk block size).
    pub block_size: u32,
    /// The guest's driver was told (NVMe Namespace Attribute Changed event,
    /// virtio-blk configuration change).
    pub notified: bool,
    /// How it was told, or why it was not.
    pub notice: String,
}

/// Why a resize was refused. Nothing changed, except where [`ResizeError::Failed`]
/// says otherwise.
#[derive(Debug, thiserror::Error)]
pub enum ResizeError {
    /// The size itself is wrong (RPC: invalid params).
    #[error("size {bytes} is not a non-zero multiple of the block size {block_size} of {who}")]
    BadSize {
        who: String,
        bytes: u64,
        block_size: u32,
    },
    #[error(
        "{who} is a slice (offset=/size=) of a backend other disks may use: its extent is what \
         keeps them apart and changes only in the configuration"
    )]
    Slice { who: String },
    #[error(
        "{who} is `shared`: a window on a backend other disks write too, whose data lies \
         around it; it keeps its size"
    )]
    Shared { who: String },
    #[error("{who} is read-only: it keeps its size")]
    ReadOnly { who: String },
    #[error(
        "{who} would shrink from {from} to {to} bytes, losing the data past {to}; \
         pass \"shrink\": true to do that"
    )]
    Shrink { who: String, from: u64, to: u64 },
    /// No such device or disk, or the device or backend refused or failed.
    #[error("{0:#}")]
    Failed(anyhow::Error),
}

impl From<anyhow::Error> for ResizeError {
    fn from(e: anyhow::Error) -> ResizeError {
        ResizeError::Failed(e)
    }
}

/// The checks every front end makes before touching the backend: `spec` is the
/// disk's configuration, `now` its size in bytes, `block_size` the unit the guest
/// addresses it in.
pub fn check(
    who: &str,
    spec: &NsSpec,
    now: u64,
    block_size: u32,
    req: &ResizeRequest,
) -> Result<(), ResizeError> {
    let who = who.to_string();
    let bs = u64::from(block_size.max(512));
    if req.bytes == 0 || !req.bytes.is_multiple_of(bs) {
        return Err(ResizeError::BadSize {
            who,
            bytes: req.bytes,
            block_size,
        });
    }
    if spec.slice.is_some() {
        return Err(ResizeError::Slice { who });
    }
    if spec.shared {
        return Err(ResizeError::Shared { who });
    }
    if spec.read_only {
        return Err(ResizeError::ReadOnly { who });
    }
    if req.bytes < now && !req.shrink {
        return Err(ResizeError::Shrink {
            who,
            from: now,
            to: req.bytes,
        });
    }
    Ok(())
}

/// The answer when the size asked is the size it has: nothing to change or tell.
pub fn unchanged(bytes: u64, block_size: u32) -> Resized {
    Resized {
        old_bytes: bytes,
        new_bytes: bytes,
        block_size,
        notified: false,
        notice: "the disk already has this size; nothing changed".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(s: &str) -> NsSpec {
        s.parse().unwrap()
    }

    #[test]
    fn checks() {
        let ok = |s: &str, now, bytes, shrink| {
            check("d", &spec(s), now, 512, &ResizeRequest { bytes, shrink })
        };
        assert!(ok("ram:1G", 1 << 30, 2 << 30, false).is_ok());
        assert!(ok("ram:1G", 1 << 30, 1 << 29, true).is_ok());
        assert!(matches!(
            ok("ram:1G", 1 << 30, 1 << 29, false),
            Err(ResizeError::Shrink { .. })
        ));
        assert!(matches!(
            ok("ram:1G", 1 << 30, 0, false),
            Err(ResizeError::BadSize { .. })
        ));
        assert!(matches!(
            ok("ram:1G", 1 << 30, 1000, false),
            Err(ResizeError::BadSize { .. })
        ));
        assert!(matches!(
            ok("file:/x,offset=1M,size=1M", 1 << 20, 2 << 20, false),
            Err(ResizeError::Slice { .. })
        ));
        assert!(matches!(
            ok("file:/x,shared", 1 << 20, 2 << 20, false),
            Err(ResizeError::Shared { .. })
        ));
        assert!(matches!(
            ok("file:/x,ro", 1 << 20, 2 << 20, false),
            Err(ResizeError::ReadOnly { .. })
        ));
        let e = check(
            "d",
            &spec("ram:1G,bs=4096"),
            1 << 30,
            4096,
            &ResizeRequest {
                bytes: (1 << 30) + 512,
                shrink: false,
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("block size 4096"), "{e}");
    }
}
