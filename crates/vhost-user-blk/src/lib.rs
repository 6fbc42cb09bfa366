//! vhost-user-blk: rust-vmm's `vhost-user-backend` speaks the protocol (socket,
//! memory table, vring setup); the virtio-blk model does the requests; engine
//! reactors poll the virtqueues.
//!
//! Threads: one accept/message thread per device (vhost-user-backend's), one
//! kick-watcher thread per connection (its vring worker, which only wakes sleeping
//! reactors), and the reactors, which own the queues: they pop, submit, complete and
//! signal the call eventfd. See docs/decisions/0006-virtio-blk-on-reactors.md.

mod backend;
mod device;
mod fd_limit;
mod guarded;
mod handover;
mod inflight;
mod poller;
mod proxy;
mod stats;

pub use backend::ConfigNotice;
pub use device::{BlkDeviceOptions, VhostUserBlk};
pub use engine::PollMode;
pub use handover::{
    ConfigWrite, ConnRecord, ConnectionState, EventArg, HandoverState, InflightArea, MemRegion,
    VringAddr, VringRecord, HANDOVER_VERSION,
};
pub use virtio_blk::{DeviceOptions, DISK_NSID};
