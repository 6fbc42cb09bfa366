//! File descriptors over Unix sockets: `recvmsg`/`sendmsg` with SCM_RIGHTS, `poll`
//! and `accept` (std accepts stream sockets only). The only `unsafe` of this crate;
//! the transports (vfio-user), the initiator, the supervisor and the handover
//! channel all use these, and everything above them works on byte slices and
//! `OwnedFd`s.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// Most descriptors one message carries (vfio-user's limit, which this matches).
pub const MAX_MSG_FDS: usize = 16;

/// Control buffer for `MAX_MSG_FDS` descriptors (u64 keeps cmsghdr alignment). Sized
/// so that a peer sending more gets MSG_CTRUNC and the kernel closes the excess.
const CMSG_WORDS: usize = 16;

fn cmsg_space(nfds: usize) -> usize {
    // SAFETY: CMSG_SPACE only does arithmetic.
    unsafe { libc::CMSG_SPACE((nfds * std::mem::size_of::<RawFd>()) as u32) as usize }
}

/// One `recvmsg` into `buf`. Received descriptors are appended to `fds` (close-on-exec);
/// returns bytes read (0 = EOF) and whether control data was truncated.
pub fn recv(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
) -> io::Result<(usize, bool)> {
    let mut cbuf = [0u64; CMSG_WORDS];
    let space = cmsg_space(MAX_MSG_FDS).min(std::mem::size_of_val(&cbuf));
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: msghdr is plain data; zeroed is a valid "empty" value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: iov points into `buf` and control into `cbuf`, both live and writable for
    // the lengths given; the kernel writes at most those lengths.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: msg was filled by a successful recvmsg; the CMSG_* walk stays inside
    // msg_controllen, and each SCM_RIGHTS payload holds fds the kernel just installed
    // in our table, which nobody else owns yet.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                let bytes = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                for i in 0..bytes / std::mem::size_of::<RawFd>() {
                    let fd = std::ptr::read_unaligned(data.add(i));
                    if fd >= 0 {
                        fds.push(OwnedFd::from_raw_fd(fd));
                    }
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok((n as usize, msg.msg_flags & libc::MSG_CTRUNC != 0))
}

/// One `sendmsg` of `parts` (fds attached to the first byte). Returns bytes sent.
/// MSG_NOSIGNAL: a vanished client must not kill the process with SIGPIPE.
pub fn send(sock: BorrowedFd<'_>, parts: &[&[u8]], fds: &[BorrowedFd<'_>]) -> io::Result<usize> {
    let mut iov: Vec<libc::iovec> = parts
        .iter()
        .filter(|p| !p.is_empty())
        .map(|p| libc::iovec {
            iov_base: p.as_ptr() as *mut libc::c_void,
            iov_len: p.len(),
        })
        .collect();
    let mut cbuf = [0u64; CMSG_WORDS];
    // SAFETY: see recv; zeroed msghdr is valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len() as _;
    let nfds = fds.len().min(MAX_MSG_FDS);
    if nfds > 0 {
        let space = cmsg_space(nfds);
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: the control buffer is `space` bytes (≤ sizeof cbuf since nfds ≤
        // MAX_MSG_FDS), so the first header and its data fit.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN((nfds * std::mem::size_of::<RawFd>()) as u32) as _;
            let data = libc::CMSG_DATA(c).cast::<RawFd>();
            for (i, fd) in fds.iter().take(nfds).enumerate() {
                std::ptr::write_unaligned(data.add(i), fd.as_raw_fd());
            }
        }
    }
    // SAFETY: iovecs point to live slices in `parts`; control as set up above. The
    // kernel only reads them.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Waits until one of `fds` is readable (or hung up); returns which ones.
pub fn poll_in(fds: &[BorrowedFd<'_>], timeout_ms: i32) -> io::Result<Vec<bool>> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|f| libc::pollfd {
            fd: f.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    loop {
        // SAFETY: pfds is a live, correctly sized array of pollfd.
        let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as _, timeout_ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        return Ok(pfds.iter().map(|p| p.revents != 0).collect());
    }
}

/// accept(2) on a listening Unix socket of any type (std's `UnixListener` is for
/// SOCK_STREAM only; a handover channel is SOCK_SEQPACKET). Close-on-exec.
pub fn accept(listener: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    // SAFETY: accept4 with null address pointers only reads the fd; the result is
    // checked.
    let fd = unsafe {
        libc::accept4(
            listener.as_raw_fd(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            libc::SOCK_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor accept4 just installed, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}
