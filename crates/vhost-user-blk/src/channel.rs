//! The socket work around vhost's `BackendReqHandler`: the per-message deadline,
//! the backend request channel (SET_BACKEND_REQ_FD) and the configuration change
//! message sent on it.
//!
//! Why SET_BACKEND_REQ_FD is answered here and not by the library: vhost 0.18
//! hands the channel to the handler as its `Backend` type, which keeps the socket
//! private and cannot send VHOST_USER_BACKEND_CONFIG_CHANGE_MSG (its
//! `handle_config_change` is the trait's "not implemented" default), nor give the
//! socket back for a handover. So the connection loop looks at each message's
//! header before the library reads it, and takes this one message itself.
//!
//! The deadline: the library reads a message with blocking reads, so a front end
//! that trickled bytes would hold the serve thread (and with it a pause) for ever.
//! The loop waits, bounded, until the whole message is queued on the socket
//! ([`wait_whole`]); the library then reads it without blocking.

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use vhost::vhost_user::message::{
    BackendReq, FrontendReq, VhostUserHeaderFlag, VhostUserProtocolFeatures, VhostUserU64,
    MAX_MSG_SIZE,
};
use vm_memory::ByteValued;
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use crate::conn::{lock, ConfigNotice, Conn};

/// A message header: request, flags, payload size (vhost keeps its header type
/// to itself).
const HDR: usize = 12;
/// The protocol version, in the flags.
const VERSION: u32 = 0x1;

#[derive(Clone, Copy, Debug)]
pub(crate) struct Hdr {
    pub request: u32,
    pub flags: u32,
    pub size: u32,
}

impl Hdr {
    pub fn new(request: impl Into<u32>, flags: u32, size: usize) -> Hdr {
        Hdr {
            request: request.into(),
            flags: flags | VERSION,
            size: u32::try_from(size).unwrap_or(u32::MAX),
        }
    }

    fn parse(b: &[u8; HDR]) -> Hdr {
        let at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        Hdr {
            request: at(0),
            flags: at(4),
            size: at(8),
        }
    }

    pub fn encode(&self) -> [u8; HDR] {
        let mut b = [0u8; HDR];
        b[0..4].copy_from_slice(&self.request.to_le_bytes());
        b[4..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..12].copy_from_slice(&self.size.to_le_bytes());
        b
    }

    pub fn code(&self) -> Option<FrontendReq> {
        FrontendReq::try_from(self.request).ok()
    }

    pub fn need_reply(&self) -> bool {
        self.flags & VhostUserHeaderFlag::NEED_REPLY.bits() != 0
    }

    pub fn size(&self) -> usize {
        self.size as usize
    }
}
/// More than any message carries (the library takes at most 32).
const MAX_FDS: usize = 32;

/// Why the connection loop ends a connection at the socket level.
#[derive(Debug, thiserror::Error)]
pub(crate) enum WireError {
    #[error("vhost-user message not complete within {0:?} (slow sender)")]
    Deadline(Duration),
    #[error("socket error")]
    Io(#[source] io::Error),
}

/// Bytes queued on `sock` (SIOCINQ: for a stream socket, all of them).
fn queued(sock: &UnixStream) -> io::Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one c_int through the pointer, which points at `n`;
    // the fd is the open socket `sock` borrows.
    let r = unsafe { libc::ioctl(sock.as_raw_fd(), libc::FIONREAD, &mut n) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(usize::try_from(n).unwrap_or(0))
}

/// The next message's header, if all of it is queued, without taking it.
fn peek_header(sock: &UnixStream) -> io::Result<Option<Hdr>> {
    let mut buf = [0u8; HDR];
    // SAFETY: the buffer is HDR bytes long and lives across the call; MSG_PEEK
    // leaves the bytes (and any fds riding on them) queued.
    let n = unsafe {
        libc::recv(
            sock.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            HDR,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::WouldBlock {
            Ok(None)
        } else {
            Err(e)
        };
    }
    if usize::try_from(n).ok() != Some(HDR) {
        return Ok(None);
    }
    Ok(Some(Hdr::parse(&buf)))
}

/// Waits until the next message is queued whole (header and body), or the
/// front end hung up (then the library reads the end of the stream and reports
/// it), by `deadline` from the first byte. A header that announces more than a
/// message may carry is left to the library, which refuses it.
pub(crate) fn wait_whole(sock: &UnixStream, limit: Duration) -> Result<Option<Hdr>, WireError> {
    let deadline = Instant::now() + limit;
    loop {
        let have = queued(sock).map_err(WireError::Io)?;
        if have >= HDR {
            let hdr = peek_header(sock).map_err(WireError::Io)?;
            match hdr {
                Some(h) if h.size() > MAX_MSG_SIZE => return Ok(Some(h)),
                Some(h) if have >= HDR + h.size() => return Ok(Some(h)),
                _ => {}
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(WireError::Deadline(limit));
        }
        let mut pfd = libc::pollfd {
            fd: sock.as_raw_fd(),
            events: libc::POLLIN | libc::POLLRDHUP,
            revents: 0,
        };
        let ms = libc::c_int::try_from(left.as_millis().max(1)).unwrap_or(libc::c_int::MAX);
        // SAFETY: one pollfd, which lives across the call.
        let r = unsafe { libc::poll(&mut pfd, 1, ms) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(WireError::Io(e));
            }
        }
        if pfd.revents & (libc::POLLHUP | libc::POLLRDHUP | libc::POLLERR) != 0 {
            return Ok(None);
        }
    }
}

/// Takes SET_BACKEND_REQ_FD off the socket (its header was peeked: `hdr`) and
/// keeps the channel; answers when asked to. A channel that cannot be used is
/// refused (and the connection goes on): a resize is then not announced.
pub(crate) fn take_backend_req(sock: &UnixStream, hdr: &Hdr, conn: &Conn) -> io::Result<()> {
    let mut head = [0u8; HDR];
    let mut fds = [-1 as RawFd; MAX_FDS];
    let mut iov = [libc::iovec {
        iov_base: head.as_mut_ptr().cast(),
        iov_len: HDR,
    }];
    // SAFETY: the iovec points at `head`, HDR bytes that live across the call;
    // `fds` has room for MAX_FDS descriptors.
    let (n, nfds) = unsafe { sock.recv_with_fds(&mut iov, &mut fds) }
        .map_err(|e| io::Error::from_raw_os_error(e.errno()))?;
    // SAFETY: the kernel installed these `nfds` descriptors for us; we own them.
    let files: Vec<OwnedFd> = fds[..nfds.min(MAX_FDS)]
        .iter()
        .map(|&fd| unsafe { OwnedFd::from_raw_fd(fd) })
        .collect();
    if n != HDR {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    // The body (none is defined) was queued whole: read and drop it.
    let mut body = vec![0u8; (hdr.size()).min(MAX_MSG_SIZE)];
    (&*sock).read_exact(&mut body)?;
    let res = keep_channel(files, conn);
    if let Err(why) = &res {
        trace::limited!(conn.log, warn, error = %why, "SET_BACKEND_REQ_FD refused; a resize will not be announced to this front end");
    }
    if hdr.need_reply() {
        let reply = Hdr::new(
            FrontendReq::SET_BACKEND_REQ_FD,
            VhostUserHeaderFlag::REPLY.bits(),
            std::mem::size_of::<VhostUserU64>(),
        );
        let v = VhostUserU64::new(u64::from(res.is_err()));
        let mut out = reply.encode().to_vec();
        out.extend_from_slice(v.as_slice());
        (&*sock).write_all(&out)?;
    }
    Ok(())
}

/// Why a backend request channel was refused.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ChannelError {
    #[error("BACKEND_REQ was not negotiated")]
    NotNegotiated,
    #[error("SET_BACKEND_REQ_FD needs exactly one file descriptor, not {0}")]
    FdCount(usize),
    #[error("the backend request channel is not a stream socket")]
    NotSocket,
}

fn keep_channel(mut files: Vec<OwnedFd>, conn: &Conn) -> Result<(), ChannelError> {
    let acked =
        VhostUserProtocolFeatures::from_bits_truncate(conn.protocol.load(Ordering::Acquire));
    if !acked.contains(VhostUserProtocolFeatures::BACKEND_REQ) {
        return Err(ChannelError::NotNegotiated);
    }
    if files.len() != 1 {
        return Err(ChannelError::FdCount(files.len()));
    }
    let fd = files.pop().ok_or(ChannelError::FdCount(0))?;
    let s = stream_socket(fd).ok_or(ChannelError::NotSocket)?;
    *lock(&conn.backend_req) = Some(s);
    Ok(())
}

/// `fd` as a `UnixStream` if it is a stream socket: anything else (a pipe, a
/// file) we would write into.
pub(crate) fn stream_socket(fd: OwnedFd) -> Option<UnixStream> {
    let mut ty: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `ty`, which is that big;
    // the fd is open (owned by `fd`).
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_TYPE,
            std::ptr::addr_of_mut!(ty).cast(),
            &mut len,
        )
    };
    (r == 0 && ty == libc::SOCK_STREAM).then(|| UnixStream::from(fd))
}

impl Conn {
    /// Tells the front end that the config space changed
    /// (VHOST_USER_BACKEND_CONFIG_CHANGE_MSG on the backend request channel); it
    /// then reads the config again (QEMU: GET_CONFIG, then a config interrupt to
    /// the guest). Needs CONFIG and BACKEND_REQ negotiated and the channel handed
    /// over. No reply is asked for, so a front end that does not read its end
    /// cannot hold the caller: the write is bounded by a timeout.
    pub fn config_changed(&self) -> ConfigNotice {
        let need = VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::BACKEND_REQ;
        let acked =
            VhostUserProtocolFeatures::from_bits_truncate(self.protocol.load(Ordering::Acquire));
        if !acked.contains(need) {
            return ConfigNotice::NotNegotiated;
        }
        let mut slot = lock(&self.backend_req);
        let Some(s) = slot.as_ref() else {
            return ConfigNotice::NotNegotiated;
        };
        let msg = Hdr::new(BackendReq::CONFIG_CHANGE_MSG, 0, 0).encode();
        let sent = s
            .set_write_timeout(Some(Duration::from_secs(1)))
            .and_then(|()| (&*s).write_all(&msg));
        match sent {
            Ok(()) => ConfigNotice::Sent,
            Err(e) => {
                // The channel is of no further use.
                *slot = None;
                ConfigNotice::Failed(e.to_string())
            }
        }
    }
}
