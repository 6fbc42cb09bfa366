//! virtio-blk device model on rust-vmm's `virtio-queue`: feature bits and config
//! space ([`BlkConfig`]), and a per-virtqueue [`QueueWorker`] that turns descriptor
//! chains into zero-copy bdev requests and completes them on the used ring.
//!
//! The model knows nothing about sockets: a transport (vhost-user here) owns the
//! `Queue` and the guest memory, and calls [`QueueWorker::process`] from the one
//! thread that owns the queue.

mod chain;
mod config;
mod dirty;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
mod guest;
mod inflight;
mod request;
mod worker;

#[cfg(test)]
mod tests;

pub use config::{features, BlkConfig, DeviceOptions};
pub use guest::Mem;
pub use inflight::{queue_region_size, InflightMem, InflightQueue};
pub use request::VirtioBlk;
pub use worker::{Progress, QueueError, QueueWorker, WorkerStats, DISK_NSID};

/// Size of a virtio-blk sector: request offsets are always in these units.
pub const SECTOR: u64 = 512;
