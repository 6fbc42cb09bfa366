//! The crate's errors: what went wrong, with the cause kept as the source.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// Errors of a [`crate::VhostUserBlk`] device's control operations.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The options name no queue, no queue size or no reactor.
    #[error("a vhost-user-blk device needs at least one queue, a queue size and a reactor")]
    BadOptions,
    /// A reactor the device was to use does not exist.
    #[error("no reactor {0}")]
    NoReactor(usize),
    /// Binding the socket failed.
    #[error("cannot listen on {}", path.display())]
    Listen {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// A system call on the device's own resources failed.
    #[error("cannot {what}")]
    Io {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    /// The engine refused to add or remove a queue poller.
    #[error("cannot place queue {queue} on reactor {reactor}")]
    Engine {
        queue: usize,
        reactor: usize,
        #[source]
        source: engine::EngineError,
    },
    /// A queue's poller was not where the device left it.
    #[error("queue {queue} is not on reactor {reactor}")]
    PollerGone { queue: usize, reactor: usize },
    /// The disk (or its resized handle) gave no I/O channel.
    #[error("cannot open an I/O channel on the disk")]
    Channel(#[source] io::Error),
    /// An online resize with another block size.
    #[error("the resized disk has {got}-byte blocks, the device {want}")]
    BlockSize { got: u32, want: u32 },
    /// Requests did not finish within a pause's limit.
    #[error("requests still in flight after {0:?}; the device runs on")]
    PauseTimeout(Duration),
    /// The serve thread did not reach a message boundary within a pause's limit.
    #[error("the vhost-user connection did not stop at a message boundary in time")]
    ParkTimeout,
    /// The device's serve thread is gone.
    #[error("the device has stopped")]
    Stopped,
    /// `save` on a device that runs.
    #[error("save needs a paused device")]
    NotPaused,
    /// The connection set up something a handover cannot carry.
    #[error("the connection cannot be handed over: {0}")]
    Unsaveable(&'static str),
    /// A handed-over state that this device cannot take.
    #[error("handover state refused")]
    State(#[from] StateError),
    /// Another device writes the disk (it holds the disk's writer claim).
    #[error("cannot serve the disk")]
    Claim(#[from] crate::migration::ClaimError),
}

/// Why a handed-over state ([`crate::HandoverState`]) was refused: it crosses a
/// process boundary and is checked like client input.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("handover state version {got} (this device reads up to {want})")]
    Version { got: u32, want: u32 },
    #[error("the front end set up {state_queues} queues of up to {state_size} entries; this device has {dev_queues} of {dev_size}")]
    Geometry {
        state_queues: u16,
        state_size: u16,
        dev_queues: u16,
        dev_size: u16,
    },
    #[error("the front end saw {state} bytes; this disk has {disk}")]
    Capacity { state: u64, disk: u64 },
    #[error("fd index {index} beyond the {count} fds handed over")]
    FdIndex { index: usize, count: usize },
    #[error("fd index {0} used twice")]
    FdTwice(usize),
    #[error("{0} fds handed over that the state does not account for")]
    FdsLeft(usize),
    #[error("the {0} handed over is not a socket")]
    NotSocket(&'static str),
    #[error("{0} is out of range")]
    Range(&'static str),
    #[error("vring {index}: {what}")]
    Vring { index: usize, what: &'static str },
    #[error("vring {index}: handed over at index {base}, but its used ring is at {used} (requests would be lost or done twice)")]
    UsedIndex { index: usize, base: u16, used: u16 },
    #[error("memory region at {gpa:#x} refused")]
    Memory {
        gpa: u64,
        #[source]
        source: crate::memory::MemError,
    },
    #[error("inflight area refused")]
    Inflight(#[source] crate::inflight::InflightError),
    #[error("dirty-page log refused")]
    Log(#[source] crate::migration::LogError),
    #[error("cannot inspect a handed-over fd")]
    Io(#[source] io::Error),
    #[error("the vhost-user library refused the negotiated features")]
    Negotiation(#[source] vhost::vhost_user::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// `Error::Io` for `what`.
pub(crate) fn io(what: &'static str) -> impl FnOnce(io::Error) -> Error {
    move |source| Error::Io { what, source }
}
