//! udrive's wiring: configuration, devices, and the `serve`/`perf`/`rpc` commands, the control plane. The
//! binary (`main.rs`) is a thin CLI over this library so integration tests can start
//! devices in-process.

pub mod backends;
#[cfg(feature = "tools")]
pub mod bdev_target;
#[cfg(feature = "tools")]
pub mod blkio_target;
pub mod config;
pub mod device;
pub mod framing;
pub mod frontend;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
pub mod handover;
pub mod json;
pub mod kinds;
pub mod metrics;
pub mod nsspec;
#[cfg(feature = "tools")]
pub mod perf;
pub mod process;
pub mod resize;
pub mod rpc;
pub mod rpc_client;
pub mod serde_str;
pub mod serve;
pub mod server;
pub mod size;
pub mod stats;
pub mod supervise;
#[cfg(feature = "tools")]
pub mod trace_cmd;
#[cfg(feature = "tools")]
pub mod trace_view;
pub mod vhost_device;
