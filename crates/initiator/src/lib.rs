//! udrive's initiator: a userspace NVMe driver that reaches a controller over
//! vfio-user ([`NvmeDriver`], [`QueuePair`]), the raw protocol client under it
//! ([`VfioUserClient`]), and the workload generator behind `udrive perf`
//! ([`workload`]).
//!
//! All shared memory goes through `guest-mem`; the only `unsafe` is in `scm`
//! (receiving fds, borrowing an eventfd's fd).

pub mod client;
pub mod cmd;
pub mod dma_service;
mod doorbell;
pub mod dptr;
mod error;
pub mod identify;
pub mod nvme;
mod pool;
pub mod qpair;
pub mod regs;
mod scm;
pub mod workload;

pub use client::{RegionInfo, Reply, VfioUserClient};
pub use cmd::{Completion, Cqe, Sqe, Status};
pub use dma_service::{DmaServeCtl, DmaServeMode};
pub use error::{Error, Result};
pub use identify::{ControllerInfo, Namespace};
pub use nvme::{AsyncEvent, DriverOpts, NvmeDriver};
pub use pool::DmaBuf;
pub use qpair::{DataMode, IoOp, QpairOpts, QueuePair};
pub use workload::{run, IoTarget, JobQueue, Report, Rw, WorkloadConfig};
