//! udrive's wiring: configuration, devices, and the `serve`/`perf` commands. The
//! binary (`main.rs`) is a thin CLI over this library so integration tests can start
//! devices in-process.

pub mod backends;
pub mod blkio_target;
pub mod config;
pub mod device;
pub mod nsspec;
pub mod perf;
pub mod serve;
pub mod size;
pub mod vhost_device;
