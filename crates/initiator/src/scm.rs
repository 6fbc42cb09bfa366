//! The one place that receives file descriptors from the socket.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use vmm_sys_util::sock_ctrl_msg::ScmSocket;

/// Receives up to `buf.len()` bytes plus any fds attached to them; fds are
/// appended to `fds` as owned handles so they are closed if the caller drops them.
pub(crate) fn recv_with_fds(
    sock: &UnixStream,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
) -> io::Result<usize> {
    let mut raw: [RawFd; vfio_user::proto::MAX_MSG_FDS as usize] =
        [-1; vfio_user::proto::MAX_MSG_FDS as usize];
    let mut iov = [libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    }];
    // SAFETY: the iovec describes `buf`, which we borrow mutably for the call, so the
    // kernel may write arbitrary bytes into it.
    let (n, nfds) = unsafe { sock.recv_with_fds(&mut iov, &mut raw) }.map_err(io::Error::from)?;
    for &fd in raw.iter().take(nfds.min(raw.len())) {
        if fd >= 0 {
            // SAFETY: recvmsg installed these fds for us and nobody else owns them.
            fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
        }
    }
    Ok(n)
}

/// vmm-sys-util's EventFd predates `AsFd`; borrow its fd for sending.
pub(crate) fn borrow_eventfd(e: &vmm_sys_util::eventfd::EventFd) -> std::os::fd::BorrowedFd<'_> {
    use std::os::fd::AsRawFd;
    // SAFETY: the fd is owned by `e`, which the returned borrow cannot outlive.
    unsafe { std::os::fd::BorrowedFd::borrow_raw(e.as_raw_fd()) }
}
