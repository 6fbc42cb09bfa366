//! Client memory that is not shared: the client maps a DMA region without a file
//! descriptor and moves its bytes only when asked (vfio-user DMA_READ/DMA_WRITE).
//!
//! Such a region is a *mirror*: a private, sparse anonymous mapping of the region's
//! size that readers translate into exactly as they translate a shared mapping
//! ([`crate::MemoryMap::translate`] gives slices of the mirror). What makes the
//! mirror right is the reader, at the points its device protocol defines: before it
//! reads bytes the client wrote it fetches them ([`crate::MemoryMap::fetch`]), after
//! it wrote bytes the client must see it pushes them ([`crate::MemoryMap::push`]).
//! For shared regions both are no-ops, and a map without mirrors answers them with
//! one branch, so the fast path pays nothing.
//!
//! This crate knows nothing of sockets: the transport implements [`RemoteDma`].

use std::fmt;
use std::sync::Arc;

use crate::slice::DmaSlice;

/// Which way a transfer moves bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RemoteDir {
    /// Client memory into the mirror (the device reads guest memory).
    FromClient,
    /// Mirror into client memory (the device writes guest memory).
    ToClient,
}

/// Why a transfer with the client failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RemoteError {
    #[error("the client refused the transfer (errno {0})")]
    Refused(i32),
    #[error("the client's reply does not match the request")]
    BadReply,
    #[error("the client did not answer in time")]
    Timeout,
    #[error("the client is gone")]
    Closed,
    #[error("transfers are suspended while the device is reset")]
    Paused,
    #[error("the region was unmapped")]
    Unmapped,
    #[error("this thread serves other clients and does not wait for this one")]
    NotHere,
}

/// One transfer between client memory at `iova` and the local window `buf`.
#[derive(Debug)]
pub struct RemoteOp<'a> {
    pub iova: u64,
    pub buf: DmaSlice<'a>,
    pub dir: RemoteDir,
    pub result: Result<(), RemoteError>,
}

/// Moves bytes between a client's memory and local buffers on request. One per
/// client connection; shared by every mirror region of that client.
pub trait RemoteDma: Send + Sync + fmt::Debug {
    /// Performs every op, storing each one's outcome in it. Implementations send all
    /// requests before they wait for replies (one round trip for the batch) and
    /// return only when every op has its answer or failed: a bounded wait.
    fn transfer(&self, ops: &mut [RemoteOp<'_>]);

    /// While paused (counted: every `true` needs its `false`), transfers fail at
    /// once with [`RemoteError::Paused`] and those waiting give up. The control
    /// path pauses the client's transfers while it waits for readers it is about
    /// to reset, so that none of them waits for a reply meanwhile.
    fn set_paused(&self, paused: bool);
}

thread_local! {
    static NO_WAITS: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// While the guard lives, transfers on this thread fail at once with
/// [`RemoteError::NotHere`] instead of waiting for a client: for threads that serve
/// several clients (shared reactors), where one client's silence must not stall
/// the others. Nests.
#[must_use]
pub struct NoRemoteWaits(());

/// See [`NoRemoteWaits`].
pub fn no_remote_waits() -> NoRemoteWaits {
    NO_WAITS.with(|c| c.set(c.get() + 1));
    NoRemoteWaits(())
}

impl Drop for NoRemoteWaits {
    fn drop(&mut self) {
        NO_WAITS.with(|c| c.set(c.get().saturating_sub(1)));
    }
}

/// Runs `ops` on their ports, grouping ops of the same port into one batch.
pub(crate) fn run(ops: &mut [(Arc<dyn RemoteDma>, RemoteOp<'_>)]) {
    if NO_WAITS.with(|c| c.get()) > 0 {
        for (_, op) in ops.iter_mut() {
            op.result = Err(RemoteError::NotHere);
        }
        return;
    }
    let mut start = 0;
    while start < ops.len() {
        let port = ops[start].0.clone();
        // Regions of one client share one port; different ports come in runs.
        let mut end = start + 1;
        while end < ops.len() && Arc::ptr_eq(&ops[end].0, &port) {
            end += 1;
        }
        let mut batch: Vec<RemoteOp<'_>> = ops[start..end]
            .iter_mut()
            .map(|(_, op)| RemoteOp {
                iova: op.iova,
                buf: op.buf,
                dir: op.dir,
                result: Ok(()),
            })
            .collect();
        port.transfer(&mut batch);
        for ((_, op), done) in ops[start..end].iter_mut().zip(batch) {
            op.result = done.result;
        }
        start = end;
    }
}

/// Pauses the client's transfers while it lives (see [`RemoteDma::set_paused`]).
#[derive(Debug)]
pub struct RemotePause {
    port: Option<Arc<dyn RemoteDma>>,
}

impl RemotePause {
    pub(crate) fn new(port: Option<Arc<dyn RemoteDma>>) -> RemotePause {
        if let Some(p) = &port {
            p.set_paused(true);
        }
        RemotePause { port }
    }
}

impl Drop for RemotePause {
    fn drop(&mut self) {
        if let Some(p) = &self.port {
            p.set_paused(false);
        }
    }
}
