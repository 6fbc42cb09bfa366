//! What a connection leaves with a keeper so that another process can take the client
//! over if this one dies (`udrive serve --supervise`, docs/decisions/0021-supervise.md)
//! or hands it over (docs/decisions/0022-live-handover.md). The records and the
//! keeper are `lifecycle`'s; this module names what a vfio-user connection keeps.
//!
//! Per connection, under the server's prefix:
//!
//! | key            | bytes                     | fds                        |
//! |----------------|---------------------------|----------------------------|
//! | `conn`         | [`ConnRecord`] (JSON)     | the connected socket       |
//! | `pci`          | config space image        | —                          |
//! | `dma/<iova>`   | [`DmaRecord`] (JSON)      | the region's file, if any  |
//! | `irq/<i>/<v>`  | —                         | the eventfd of vector `v`  |
//!
//! Records go out as the client changes its state (control path only: VERSION,
//! DMA_MAP/UNMAP, SET_IRQS, config writes, region queries) and all of them are
//! dropped when the client leaves. A new process hands them back to
//! [`crate::VfioUserServer::restore`].

use serde::{Deserialize, Serialize};

pub(crate) use lifecycle::keep::parse_json;
pub(crate) use lifecycle::{KeepHandle, Kept, KeptRecords};

#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct ConnRecord {
    /// Largest data count the client takes per message (from its VERSION).
    pub client_max_xfer: u32,
    /// The client was given BAR0's mmap areas (it writes doorbells into the page).
    pub bar_mmap: bool,
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct DmaRecord {
    pub addr: u64,
    pub size: u64,
    pub offset: u64,
    pub flags: u32,
}

pub(crate) const CONN: &str = "conn";
pub(crate) const PCI: &str = "pci";

pub(crate) fn dma_key(iova: u64) -> String {
    format!("dma/{iova:016x}")
}

pub(crate) fn irq_key(index: u32, vector: usize) -> String {
    format!("irq/{index}/{vector:04}")
}

pub(crate) fn irq_prefix(index: u32) -> String {
    format!("irq/{index}/")
}
