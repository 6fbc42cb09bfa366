//! vfio-user: the wire format ([`proto`]) and a server that exposes one emulated PCI
//! device per socket ([`VfioUserServer`]).
//!
//! Server layout: `server` (sockets, the hub thread, per-connection threads, accept
//! policy) → `conn` (framing checks
//! and command dispatch, via `msg`/`sock`) → `device` (regions, reset, disconnect)
//! → `pci` (config space), `irqs` (eventfds, MSI-X table/PBA), `dma` (memory map).
//! Client memory mapped without a file descriptor is mirrored and moved with our
//! own DMA_READ/DMA_WRITE requests (`remote`, docs/decisions/0020-dma-messages.md).
//! GET_REGION_IO_FDS, dirty-page tracking and migration are not implemented; see
//! `docs/decisions/0001-vfio-user-server.md`.

mod conn;
mod device;
mod dma;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
mod irqs;
mod keep;
mod msg;
pub mod pci;
pub mod proto;
mod remote;
mod server;

pub use device::{BarSpec, MsixSpec, PciBackend, PciDeviceSpec};
pub use irqs::Irqs;
pub use pci::PciIds;
pub use remote::{DmaMessageCounts, DmaMessageStats};
pub use server::{ServerConfig, VfioUserServer, DEFAULT_DMA_REPLY_TIMEOUT};
