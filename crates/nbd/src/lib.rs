//! The NBD (Network Block Device) wire protocol, as udrive needs it: a
//! synchronous [`Client`] that a block job writes through to mirror a disk to a
//! remote export, and [`serve`], which runs one server connection over an
//! [`Export`] so that a migration destination can receive a disk.
//!
//! Why not the `nbd` crate of crates.io (rust-nbd 0.3.1): its server serves a
//! `Read + Write + Seek`, answers TRIM and WRITE_ZEROES with errno 38 (not an NBD
//! error value) and passes any other errno through unfiltered; its client only
//! knows `NBD_OPT_EXPORT_NAME`, has no write zeroes and turns error replies into
//! strings. Fixing that would mean rewriting both halves, so this crate is its own.
//!
//! Scope: fixed newstyle handshake, no TLS, simple replies only, one request in
//! flight per connection. No threads and no async: the caller owns the socket's
//! thread (the client runs under a seccomp filter, so it only reads and writes
//! its socket after connecting).
#![forbid(unsafe_code)]
#![deny(missing_docs)]
// Sizes, offsets and lengths come from the peer: narrowing must be explicit.
#![deny(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss
)]

mod client;
mod server;
mod uri;
pub mod wire;

use std::fmt;
use std::io;

pub use client::Client;
pub use server::{serve, Export};
pub use uri::{Address, Uri};

/// Largest READ or WRITE payload the server accepts and the client sends in one
/// request: the protocol's "always acceptable" 32 MiB.
pub const MAX_PAYLOAD: u32 = 32 << 20;

/// The IANA port of NBD.
pub const DEFAULT_PORT: u16 = 10809;

/// A request that the NBD server answered with an error.
///
/// [`Client`] returns it inside an [`io::Error`] whose kind matches the errno;
/// [`errno`] recovers the number.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommandError {
    /// `NBD_CMD_READ`, `NBD_CMD_WRITE`, ...
    pub command: &'static str,
    /// Offset of the refused request.
    pub offset: u64,
    /// Length of the refused request.
    pub length: u64,
    /// The server's error as a host errno (`libc::EIO`, `libc::ENOSPC`, ...).
    pub errno: i32,
}

impl fmt::Display for CommandError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "NBD server failed {} of {} bytes at offset {}: {}",
            self.command,
            self.length,
            self.offset,
            io::Error::from_raw_os_error(self.errno)
        )
    }
}

impl std::error::Error for CommandError {}

impl From<CommandError> for io::Error {
    fn from(e: CommandError) -> io::Error {
        io::Error::new(io::Error::from_raw_os_error(e.errno).kind(), e)
    }
}

/// The errno behind an error of this crate: the OS's own, or the one an NBD
/// server replied with. An [`io::Error`] holds a message or a raw errno, not
/// both, so the client's errors carry a [`CommandError`] and this reads it.
pub fn errno(e: &io::Error) -> Option<i32> {
    e.raw_os_error()
        .or_else(|| e.get_ref()?.downcast_ref::<CommandError>().map(|c| c.errno))
}

/// Host errno for an NBD error value; unknown values count as EINVAL, as the
/// protocol asks of clients.
fn errno_from_nbd(error: u32) -> i32 {
    match error {
        wire::EPERM => libc::EPERM,
        wire::EIO => libc::EIO,
        wire::ENOMEM => libc::ENOMEM,
        wire::ENOSPC => libc::ENOSPC,
        wire::EOVERFLOW => libc::EOVERFLOW,
        wire::ENOTSUP => libc::ENOTSUP,
        wire::ESHUTDOWN => libc::ESHUTDOWN,
        _ => libc::EINVAL,
    }
}

/// NBD error value for an export's failure: its errno where the protocol has
/// one, the quota and file-size errors as ENOSPC (the protocol asks so), and EIO
/// for everything else.
fn nbd_from_io(e: &io::Error) -> u32 {
    match e.raw_os_error() {
        Some(libc::EPERM) => wire::EPERM,
        Some(libc::ENOMEM) => wire::ENOMEM,
        Some(libc::EINVAL) => wire::EINVAL,
        Some(libc::ENOSPC | libc::EDQUOT | libc::EFBIG) => wire::ENOSPC,
        Some(libc::EOVERFLOW) => wire::EOVERFLOW,
        Some(libc::ESHUTDOWN) => wire::ESHUTDOWN,
        _ => wire::EIO,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn export_errors_map_to_nbd_values() {
        let cases = [
            (io::Error::from_raw_os_error(libc::EPERM), wire::EPERM),
            (io::Error::from_raw_os_error(libc::EIO), wire::EIO),
            (io::Error::from_raw_os_error(libc::ENOMEM), wire::ENOMEM),
            (io::Error::from_raw_os_error(libc::EINVAL), wire::EINVAL),
            (io::Error::from_raw_os_error(libc::ENOSPC), wire::ENOSPC),
            (io::Error::from_raw_os_error(libc::EDQUOT), wire::ENOSPC),
            (io::Error::from_raw_os_error(libc::EFBIG), wire::ENOSPC),
            (
                io::Error::from_raw_os_error(libc::EOVERFLOW),
                wire::EOVERFLOW,
            ),
            (
                io::Error::from_raw_os_error(libc::ESHUTDOWN),
                wire::ESHUTDOWN,
            ),
            (io::Error::from_raw_os_error(libc::ENOENT), wire::EIO),
            (io::Error::from_raw_os_error(libc::ENOTSUP), wire::EIO),
            (io::Error::other("no errno"), wire::EIO),
        ];
        for (e, want) in cases {
            assert_eq!(nbd_from_io(&e), want, "{e}");
        }
    }

    #[test]
    fn nbd_values_map_to_errnos_and_unknown_is_einval() {
        for v in [1, 5, 12, 22, 28, 75, 95, 108] {
            assert_eq!(
                nbd_from_io(&io::Error::from_raw_os_error(errno_from_nbd(v))),
                {
                    if v == wire::ENOTSUP {
                        wire::EIO
                    } else {
                        v
                    }
                }
            );
        }
        assert_eq!(errno_from_nbd(0x1234), libc::EINVAL);
    }

    #[test]
    fn command_error_keeps_errno_and_says_where() {
        let e: io::Error = CommandError {
            command: "NBD_CMD_WRITE",
            offset: 4096,
            length: 512,
            errno: libc::ENOSPC,
        }
        .into();
        assert_eq!(errno(&e), Some(libc::ENOSPC));
        assert_eq!(e.kind(), io::ErrorKind::StorageFull);
        let msg = e.to_string();
        assert!(
            msg.contains("NBD_CMD_WRITE") && msg.contains("4096"),
            "{msg}"
        );
        assert_eq!(errno(&io::Error::other("x")), None);
    }
}
