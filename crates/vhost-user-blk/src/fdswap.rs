//! Points the fd of vhost's `BackendReqHandler` at another socket: the one
//! place where a restored connection's library state meets the front end's socket
//! (see `state::prime`).

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;

/// Makes `target`'s fd number refer to `sock`'s socket (atomically, closing what
/// it referred to before).
pub(crate) fn replace(target: &impl AsRawFd, sock: &UnixStream) -> io::Result<()> {
    let (from, to) = (sock.as_raw_fd(), target.as_raw_fd());
    // SAFETY: both fds are open and owned by live objects borrowed here. dup3 only
    // swaps what `to` refers to; its owner (the library's stream) keeps owning the
    // number, now a duplicate of `sock`, and closes it as before.
    let r = unsafe { libc::dup3(from, to, libc::O_CLOEXEC) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
