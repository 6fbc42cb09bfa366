//! Receiving file descriptors (through the vfio-user crate's `sock`), and lending an
//! eventfd's descriptor for sending.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;

/// Receives up to `buf.len()` bytes plus any fds attached to them; fds are
/// appended to `fds` as owned handles so they are closed if the caller drops them.
pub(crate) fn recv_with_fds(
    sock: &UnixStream,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
) -> io::Result<usize> {
    lifecycle::fdpass::recv(sock.as_fd(), buf, fds).map(|(n, _truncated)| n)
}

/// vmm-sys-util's EventFd predates `AsFd`; borrow its fd for sending.
pub(crate) fn borrow_eventfd(e: &vmm_sys_util::eventfd::EventFd) -> std::os::fd::BorrowedFd<'_> {
    use std::os::fd::AsRawFd;
    // SAFETY: the fd is owned by `e`, which the returned borrow cannot outlive.
    unsafe { std::os::fd::BorrowedFd::borrow_raw(e.as_raw_fd()) }
}

/// Blocks until `fd` is readable or `timeout` passes; true if readable.
pub(crate) fn wait_readable(
    fd: std::os::fd::BorrowedFd<'_>,
    timeout: std::time::Duration,
) -> io::Result<bool> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let ms = u16::try_from(timeout.as_millis()).unwrap_or(u16::MAX);
    let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
    match poll(&mut fds, PollTimeout::from(ms)) {
        Ok(n) => Ok(n > 0),
        Err(nix::errno::Errno::EINTR) => Ok(false),
        Err(e) => Err(e.into()),
    }
}
