use std::io;

use crate::cmd::Status;

/// Everything the initiator can fail with. A misbehaving server shows up here as
/// `Protocol`/`Remote`/`Timeout`, never as a panic.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
    #[error("server disconnected")]
    Disconnected,
    #[error("server replied with an error to command {cmd}: errno {errno}")]
    Remote { cmd: u16, errno: i32 },
    #[error("protocol violation: {0}")]
    Protocol(String),
    #[error("timed out: {0}")]
    Timeout(&'static str),
    #[error("NVMe command failed: {0}")]
    Nvme(Status),
    #[error("invalid argument: {0}")]
    Invalid(String),
    #[error("out of resources: {0}")]
    NoResources(&'static str),
    #[error("queue pair is stale (controller was reset or the queue deleted)")]
    Stale,
}

pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn proto_err(msg: impl Into<String>) -> Error {
    Error::Protocol(msg.into())
}
