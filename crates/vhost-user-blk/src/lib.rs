//! vhost-user-blk: udrive's handler of rust-vmm's public vhost-user seam (vhost's
//! `VhostUserBackendReqHandlerMut`, served by its `BackendReqHandler`) in front of
//! the virtio-blk model; engine reactors poll the virtqueues
//! (docs/decisions/0032-vhost-user-seam.md).
//!
//! Threads: one serve thread per device (accepts one front end at a time and runs
//! its connection loop: message deadline, parsing by vhost, our handler), one
//! kick-watcher thread per connection (it only wakes sleeping reactors), and the
//! reactors, which own the queues: they pop, submit, complete and signal the call
//! eventfd. See docs/decisions/0006-virtio-blk-on-reactors.md.
//!
//! Lifecycle: [`VhostUserBlk::pause`], [`VhostUserBlk::resume`],
//! [`VhostUserBlk::save`] and [`VhostUserBlk::restore`] hand a connected front end
//! over to a device in another process (docs/decisions/0024-vhost-user-handover.md).

mod channel;
mod conn;
mod device;
mod error;
mod fd_limit;
mod fdswap;
mod guarded;
mod handler;
mod inflight;
mod kick;
mod memory;
mod migration;
mod poller;
mod serve;
mod state;
mod stats;
mod sync;

pub use conn::{ConfigNotice, VringAddr};
pub use device::{BlkDeviceOptions, VhostUserBlk};
pub use engine::PollMode;
pub use error::{Error, Result, StateError};
pub use handler::ConfigWrite;
pub use inflight::InflightError;
pub use memory::MemError;
pub use migration::{ClaimError, LogError, MigrationOptions, WriterClaim};
pub use state::{
    ConnectionState, DirtyLogArea, HandoverState, InflightArea, MemRegion, VringRecord,
    HANDOVER_VERSION, MIN_HANDOVER_VERSION,
};
pub use virtio_blk::{DeviceOptions, DISK_NSID};
