//! Message framing on the connection socket: a header, then `msg_size - 16` payload
//! bytes, with any descriptors the client attached. Sizes are checked before any
//! allocation, so the largest buffer is `MAX_MSG_SIZE`.

// Guest and client numbers are parsed here: no silent truncation.
#![deny(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss
)]

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Instant;

use zerocopy::IntoBytes;

use crate::proto::{self, Header, HEADER_SIZE, MAX_MSG_SIZE};
use lifecycle::fdpass as sock;

pub(crate) struct Msg {
    pub hdr: Header,
    pub payload: Vec<u8>,
    pub fds: Vec<OwnedFd>,
    /// The client sent more descriptors than fit (the kernel closed the rest).
    pub fds_truncated: bool,
}

#[derive(Debug)]
pub(crate) enum ReadError {
    /// Orderly close between messages.
    Eof,
    Io(io::Error),
    /// The stream cannot be delimited any more; if the header was read, the caller
    /// may answer it (with the errno) before disconnecting.
    Framing(Option<(Header, i32)>, &'static str),
}

/// Fills `buf` completely, by `deadline`. `Ok(false)` if EOF came before the first
/// byte.
fn fill(
    s: &UnixStream,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
    trunc: &mut bool,
    deadline: Instant,
) -> Result<bool, ReadError> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        let ms = i32::try_from(left.as_millis()).unwrap_or(i32::MAX);
        if ms == 0 || !sock::poll_in(&[s.as_fd()], ms).map_err(ReadError::Io)?[0] {
            return Err(ReadError::Framing(
                None,
                "message not complete within the deadline (slow sender)",
            ));
        }
        match sock::recv(s.as_fd(), &mut buf[got..], fds) {
            Ok((0, _)) if got == 0 => return Ok(false),
            Ok((0, _)) => return Err(ReadError::Framing(None, "EOF inside a message")),
            Ok((n, t)) => {
                got += n;
                *trunc |= t;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(ReadError::Io(e)),
        }
    }
    Ok(true)
}

pub(crate) fn read_msg(s: &UnixStream) -> Result<Msg, ReadError> {
    let mut fds = Vec::new();
    let mut trunc = false;
    let deadline = Instant::now() + sockfile::message_deadline();
    let mut hb = [0u8; HEADER_SIZE];
    if !fill(s, &mut hb, &mut fds, &mut trunc, deadline)? {
        return Err(ReadError::Eof);
    }
    let hdr: Header = proto::parse(&hb).unwrap_or_default();
    let size = hdr.msg_size as usize;
    if size < HEADER_SIZE {
        return Err(ReadError::Framing(
            Some((hdr, libc::EINVAL)),
            "msg_size below header size",
        ));
    }
    if hdr.msg_size > MAX_MSG_SIZE {
        return Err(ReadError::Framing(
            Some((hdr, libc::E2BIG)),
            "msg_size above MAX_MSG_SIZE",
        ));
    }
    let mut payload = vec![0u8; size - HEADER_SIZE];
    if !payload.is_empty() && !fill(s, &mut payload, &mut fds, &mut trunc, deadline)? {
        return Err(ReadError::Framing(None, "EOF inside a message"));
    }
    Ok(Msg {
        hdr,
        payload,
        fds,
        fds_truncated: trunc,
    })
}

/// Sends a reply to `req` made of `parts` (and `fds` on the first byte).
pub(crate) fn send_reply(
    s: &UnixStream,
    req: &Header,
    parts: &[&[u8]],
    fds: &[BorrowedFd<'_>],
) -> io::Result<()> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let hdr = Header::reply_to(req, len);
    let mut all: Vec<&[u8]> = Vec::with_capacity(parts.len() + 1);
    all.push(hdr.as_bytes());
    all.extend_from_slice(parts);
    send_all(s, &all, fds)
}

/// Sends a command (a request of ours, e.g. DMA_READ) made of `parts`.
pub(crate) fn send_command(
    s: &UnixStream,
    id: u16,
    cmd: proto::Command,
    parts: &[&[u8]],
) -> io::Result<Header> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let hdr = Header::command(id, cmd, len);
    let mut all: Vec<&[u8]> = Vec::with_capacity(parts.len() + 1);
    all.push(hdr.as_bytes());
    all.extend_from_slice(parts);
    send_all(s, &all, &[]).map(|()| hdr)
}

pub(crate) fn send_error(s: &UnixStream, req: &Header, errno: i32) -> io::Result<()> {
    let hdr = Header::error_reply(req, errno);
    send_all(s, &[hdr.as_bytes()], &[])
}

fn send_all(s: &UnixStream, parts: &[&[u8]], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let mut sent = sock::send(s.as_fd(), parts, fds)?;
    // Short sends are rare on a Unix stream; finish without re-sending the fds.
    while sent < total {
        let mut skip = sent;
        let rest: Vec<&[u8]> = parts
            .iter()
            .filter_map(|p| {
                if skip >= p.len() {
                    skip -= p.len();
                    None
                } else {
                    let r = &p[skip..];
                    skip = 0;
                    Some(r)
                }
            })
            .collect();
        match sock::send(s.as_fd(), &rest, &[]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => sent += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
