//! One status table per protocol: what a backend result, or a policy refusal,
//! becomes on the wire, and the number the counters file it under.

use std::fmt::Debug;

use bdev::{IoOp, IoStatus};

use crate::policy::Refusal;

/// A front end's protocol, as far as request completion goes. Implemented by a
/// marker type per front end (`nvme::Nvme`, `virtio_blk::VirtioBlk`), so the
/// protocol's status type can be anything (a `u16` field, a status byte).
pub trait Protocol {
    /// What a request completes with on the wire.
    type Status: Copy + Eq + Debug;
    /// Success.
    const OK: Self::Status;
    /// What the backend's result for a request of kind `op` becomes.
    fn from_io(st: IoStatus, op: IoOp) -> Self::Status;
    /// What a request the policy refused before the backend becomes.
    fn refused(r: Refusal) -> Self::Status;
    /// The number the counters file `s` under: 0 for success, and one number per
    /// distinct error (NVMe: `SCT << 8 | SC`; virtio-blk: the status byte).
    fn code(s: Self::Status) -> u16;
}
