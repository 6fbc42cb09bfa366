//! udrive's wiring: configuration, devices, and the `serve`/`perf`/`rpc` commands, the control plane. The
//! binary (`main.rs`) is a thin CLI over this library so integration tests can start
//! devices in-process.

pub mod backends;
pub mod blkio_target;
pub mod config;
pub mod device;
pub mod file_target;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
pub mod metrics;
pub mod nsspec;
pub mod perf;
pub mod rpc;
pub mod serve;
pub mod server;
pub mod size;
pub mod stats;
pub mod trace_cmd;
pub mod trace_view;
pub mod vhost_device;
