//! What a connection leaves with a keeper so that another process can take the client
//! over if this one dies (`udrive serve --supervise`, docs/decisions/0021-supervise.md).
//!
//! The keeper (a supervisor process) stores records it does not interpret: a key, a
//! few bytes, and file descriptors. Per connection, under the server's prefix:
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
//! [`crate::VfioUserServer::start`] in [`ServerConfig::resume`](crate::ServerConfig).

use std::collections::BTreeMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// Stores records for the next process. Calls come from protocol threads with the
/// device locked: they must not block for long (a keeper answers nothing).
pub trait Keeper: Send + Sync {
    /// Replaces the record `key` (closing the fds it held before).
    fn put(&self, key: &str, bytes: &[u8], fds: &[BorrowedFd<'_>]);
    /// Drops every record whose key starts with `prefix` (keys that could be a
    /// prefix of another are fixed-width).
    fn remove(&self, prefix: &str);
}

/// A record handed back to a new process.
#[derive(Debug)]
pub struct Kept {
    pub bytes: Vec<u8>,
    pub fds: Vec<OwnedFd>,
}

/// The records of one server's connection, keys relative to its prefix.
pub type KeptRecords = BTreeMap<String, Kept>;

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

/// A connection's handle on the keeper: its prefix and the records it put.
#[derive(Clone)]
pub(crate) struct KeepHandle {
    keeper: Arc<dyn Keeper>,
    prefix: String,
}

impl KeepHandle {
    pub fn new(keeper: Arc<dyn Keeper>, prefix: String) -> KeepHandle {
        KeepHandle { keeper, prefix }
    }

    pub fn put(&self, key: &str, bytes: &[u8], fds: &[BorrowedFd<'_>]) {
        self.keeper
            .put(&format!("{}{key}", self.prefix), bytes, fds);
    }

    pub fn put_json<T: Serialize>(&self, key: &str, v: &T, fds: &[BorrowedFd<'_>]) {
        match serde_json::to_vec(v) {
            Ok(b) => self.put(key, &b, fds),
            Err(e) => tracing::error!("vfio-user: cannot encode kept record {key}: {e}"),
        }
    }

    pub fn remove(&self, prefix: &str) {
        self.keeper.remove(&format!("{}{prefix}", self.prefix));
    }

    /// Everything of the connection.
    pub fn remove_all(&self) {
        self.keeper.remove(&self.prefix);
    }

    pub fn put_fd(&self, key: &str, fd: &impl AsFd) {
        self.put(key, &[], &[fd.as_fd()]);
    }
}

/// Decodes a JSON record; `None` (and a log line) when it does not parse.
pub(crate) fn parse_json<'a, T: Deserialize<'a>>(key: &str, bytes: &'a [u8]) -> Option<T> {
    match serde_json::from_slice(bytes) {
        Ok(v) => Some(v),
        Err(e) => {
            tracing::warn!("vfio-user: ignoring kept record {key}: {e}");
            None
        }
    }
}
