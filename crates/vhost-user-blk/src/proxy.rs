//! A message relay between the front end and vhost-user-backend's handler that
//! answers GET_INFLIGHT_FD, SET_INFLIGHT_FD and SET_BACKEND_REQ_FD itself, and
//! notes the protocol features the front end acknowledges.
//!
//! Why: vhost-user-backend 0.24 replies "not supported" to the inflight messages,
//! and the backend request channel it keeps (vhost 0.18's `Backend`) has no way to
//! send the configuration change message an online resize needs. Its handler
//! type is crate-private (neither constructible nor wrappable), so the only ways to
//! add them are forking the crate, reimplementing its whole handler, or standing in
//! front of it. Relaying keeps every other message on the crate's code; it costs a
//! thread hop on control messages only (the rings are shared memory and kicks are
//! eventfds, neither passes through here).

use std::fs::File;
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use crate::backend::Conn;
use crate::inflight::Region;

const HDR: usize = 12;
/// Larger than any message we relay (a memory table of 8 regions, a 256-byte
/// config, a 32-region log); anything bigger ends the connection.
const MAX_BODY: usize = 64 * 1024;
const MAX_FDS: usize = 32;
const SET_MEM_TABLE: u32 = 5;
const SET_PROTOCOL_FEATURES: u32 = 16;
const SET_BACKEND_REQ_FD: u32 = 21;
const GET_INFLIGHT_FD: u32 = 31;
const ADD_MEM_REG: u32 = 37;
const SET_INFLIGHT_FD: u32 = 32;
const F_VERSION: u32 = 0x1;
const F_REPLY: u32 = 0x4;
const F_NEED_REPLY: u32 = 0x8;
/// `VhostUserInflight`: mmap_size u64, mmap_offset u64, num_queues u16, queue_size
/// u16 (C layout: 24 bytes with padding; 20 carry data).
const INFLIGHT_LEN: usize = 24;
const INFLIGHT_MIN: usize = 20;

struct Msg {
    hdr: [u8; HDR],
    body: Vec<u8>,
    files: Vec<File>,
}

impl Msg {
    fn request(&self) -> u32 {
        u32::from_le_bytes([self.hdr[0], self.hdr[1], self.hdr[2], self.hdr[3]])
    }
    fn flags(&self) -> u32 {
        u32::from_le_bytes([self.hdr[4], self.hdr[5], self.hdr[6], self.hdr[7]])
    }
}

fn bad(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.to_string())
}

/// Reads one message with its file descriptors (which ride on its first bytes).
fn recv(sock: &UnixStream, buf: &mut Vec<u8>) -> io::Result<Option<Msg>> {
    let mut hdr = [0u8; HDR];
    let mut fds = [-1 as RawFd; MAX_FDS];
    let mut iov = [libc::iovec {
        iov_base: hdr.as_mut_ptr().cast(),
        iov_len: HDR,
    }];
    // SAFETY: the iovec points at `hdr`, which lives across the call and is HDR
    // bytes long; `fds` has room for MAX_FDS descriptors.
    let (n, nfds) = unsafe { sock.recv_with_fds(&mut iov, &mut fds) }
        .map_err(|e| io::Error::from_raw_os_error(e.errno()))?;
    // SAFETY: the kernel installed these `nfds` descriptors for us; we own them now.
    let files: Vec<File> = fds[..nfds.min(MAX_FDS)]
        .iter()
        .map(|&fd| unsafe { File::from_raw_fd(fd) })
        .collect();
    if n == 0 {
        return Ok(None);
    }
    // The rest of the message must follow within the deadline (a front end that
    // trickles bytes would hold this relay, and the device, for ever).
    let deadline = Instant::now() + sockfile::message_deadline();
    read_exact_by(sock, &mut hdr[n..], deadline)?;
    let size = u32::from_le_bytes([hdr[8], hdr[9], hdr[10], hdr[11]]) as usize;
    if size > MAX_BODY {
        return Err(bad("vhost-user message larger than any request we know"));
    }
    buf.clear();
    buf.resize(size, 0);
    let r = read_exact_by(sock, buf, deadline);
    // Between messages the front end may idle as long as it likes.
    sock.set_read_timeout(None)?;
    r?;
    Ok(Some(Msg {
        hdr,
        body: std::mem::take(buf),
        files,
    }))
}

/// `read_exact` that gives up at `deadline`.
fn read_exact_by(sock: &UnixStream, mut buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    while !buf.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "vhost-user message not complete within the deadline (slow sender)",
            ));
        }
        sock.set_read_timeout(Some(left))?;
        match (&*sock).read(buf) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn send(sock: &Mutex<UnixStream>, hdr: &[u8], body: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let s = sock.lock().unwrap_or_else(|e| e.into_inner());
    let mut all = Vec::with_capacity(hdr.len() + body.len());
    all.extend_from_slice(hdr);
    all.extend_from_slice(body);
    let n = if fds.is_empty() {
        0
    } else {
        s.send_with_fds(&[&all[..]], fds)
            .map_err(|e| io::Error::from_raw_os_error(e.errno()))?
    };
    (&*s).write_all(&all[n..])
}

fn reply_hdr(request: u32, size: usize) -> [u8; HDR] {
    let mut h = [0u8; HDR];
    h[0..4].copy_from_slice(&request.to_le_bytes());
    h[4..8].copy_from_slice(&(F_VERSION | F_REPLY).to_le_bytes());
    h[8..12].copy_from_slice(&(size as u32).to_le_bytes());
    h
}

struct InflightMsg {
    mmap_size: u64,
    mmap_offset: u64,
    num_queues: u16,
    queue_size: u16,
}

fn parse_inflight(body: &[u8]) -> io::Result<InflightMsg> {
    if body.len() < INFLIGHT_MIN {
        return Err(bad("short inflight message"));
    }
    let u64_at = |o: usize| u64::from_le_bytes(body[o..o + 8].try_into().unwrap_or_default());
    let u16_at = |o: usize| u16::from_le_bytes(body[o..o + 2].try_into().unwrap_or_default());
    Ok(InflightMsg {
        mmap_size: u64_at(0),
        mmap_offset: u64_at(8),
        num_queues: u16_at(16),
        queue_size: u16_at(18),
    })
}

fn encode_inflight(m: &InflightMsg) -> [u8; INFLIGHT_LEN] {
    let mut b = [0u8; INFLIGHT_LEN];
    b[0..8].copy_from_slice(&m.mmap_size.to_le_bytes());
    b[8..16].copy_from_slice(&m.mmap_offset.to_le_bytes());
    b[16..18].copy_from_slice(&m.num_queues.to_le_bytes());
    b[18..20].copy_from_slice(&m.queue_size.to_le_bytes());
    b
}

/// Answers an inflight message; other messages are returned for relaying.
fn handle(msg: Msg, front: &Mutex<UnixStream>, conn: &Conn) -> io::Result<Option<Msg>> {
    match msg.request() {
        GET_INFLIGHT_FD => {
            let req = parse_inflight(&msg.body)?;
            match Region::allocate(req.num_queues, req.queue_size) {
                Ok((mem, size)) => {
                    let out = InflightMsg {
                        mmap_size: size,
                        mmap_offset: 0,
                        ..req
                    };
                    let fd = mem.fd().as_raw_fd();
                    send(
                        front,
                        &reply_hdr(GET_INFLIGHT_FD, INFLIGHT_LEN),
                        &encode_inflight(&out),
                        &[fd],
                    )?;
                }
                Err(e) => {
                    // The protocol has no error reply here: an empty area (size 0,
                    // no fd) tells the front end we cannot track.
                    trace::limited!(conn.log, warn, error = %e, "GET_INFLIGHT_FD refused");
                    let out = InflightMsg {
                        mmap_size: 0,
                        mmap_offset: 0,
                        ..req
                    };
                    send(
                        front,
                        &reply_hdr(GET_INFLIGHT_FD, INFLIGHT_LEN),
                        &encode_inflight(&out),
                        &[],
                    )?;
                }
            }
            Ok(None)
        }
        SET_INFLIGHT_FD => {
            let req = parse_inflight(&msg.body)?;
            let res = match msg.files.first() {
                Some(f) => Region::map(
                    f,
                    (req.mmap_size, req.mmap_offset),
                    req.num_queues,
                    req.queue_size,
                    &conn.guarded.signal,
                ),
                None => Err(bad("SET_INFLIGHT_FD without a file descriptor")),
            };
            let ok = match res {
                Ok(region) => {
                    *conn.inflight.lock().unwrap_or_else(|e| e.into_inner()) = Some(region);
                    true
                }
                Err(e) => {
                    trace::limited!(conn.log, warn, error = %e, "SET_INFLIGHT_FD refused; requests in flight at a crash will not be recovered");
                    *conn.inflight.lock().unwrap_or_else(|e| e.into_inner()) = None;
                    false
                }
            };
            if msg.flags() & F_NEED_REPLY != 0 {
                let v: u64 = if ok { 0 } else { 1 };
                send(front, &reply_hdr(SET_INFLIGHT_FD, 8), &v.to_le_bytes(), &[])?;
            }
            Ok(None)
        }
        SET_PROTOCOL_FEATURES => {
            // Relayed; the handler checks them against what we offer. Only bits we
            // offer count for us too.
            if let Some(b) = msg.body.get(0..8) {
                let v = u64::from_le_bytes(b.try_into().unwrap_or_default());
                conn.protocol.store(v, std::sync::atomic::Ordering::Release);
            }
            Ok(Some(msg))
        }
        SET_BACKEND_REQ_FD => {
            let res = backend_channel(&msg, conn);
            if let Err(e) = &res {
                trace::limited!(conn.log, warn, error = %e, "SET_BACKEND_REQ_FD refused; a resize will not be announced to this front end");
            }
            if msg.flags() & F_NEED_REPLY != 0 {
                let v: u64 = if res.is_ok() { 0 } else { 1 };
                send(
                    front,
                    &reply_hdr(SET_BACKEND_REQ_FD, 8),
                    &v.to_le_bytes(),
                    &[],
                )?;
            }
            Ok(None)
        }
        SET_MEM_TABLE | ADD_MEM_REG => match check_mem_files(&msg) {
            Ok(()) => Ok(Some(msg)),
            Err(e) => {
                trace::limited!(conn.log, warn, error = %e, "vhost-user memory region refused");
                if msg.flags() & F_NEED_REPLY == 0 {
                    // The front end expects no answer and would go on with memory we
                    // do not have: end the connection instead.
                    return Err(e);
                }
                let v: u64 = 1;
                send(front, &reply_hdr(msg.request(), 8), &v.to_le_bytes(), &[])?;
                Ok(None)
            }
        },
        _ => Ok(Some(msg)),
    }
}

/// Keeps the backend request channel the front end hands over: a socket, after
/// BACKEND_REQ was negotiated. Anything else (a pipe, a file) is refused: we would
/// write into it.
fn backend_channel(msg: &Msg, conn: &Conn) -> io::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    let acked = conn.protocol.load(std::sync::atomic::Ordering::Acquire);
    if acked & vhost::vhost_user::message::VhostUserProtocolFeatures::BACKEND_REQ.bits() == 0 {
        return Err(bad("BACKEND_REQ was not negotiated"));
    }
    let [f] = msg.files.as_slice() else {
        return Err(bad("SET_BACKEND_REQ_FD needs exactly one file descriptor"));
    };
    if !f.metadata()?.file_type().is_socket() {
        return Err(bad("the backend request channel is not a socket"));
    }
    let s = UnixStream::from(std::os::fd::OwnedFd::from(f.try_clone()?));
    *conn.backend_req.lock().unwrap_or_else(|e| e.into_inner()) = Some(s);
    Ok(())
}

/// A memory region descriptor: guest address, size, user address, mmap offset.
const REGION_LEN: usize = 32;

/// Refuses regions that lie past the end of their file: vm-memory would map them
/// and the first access there would SIGBUS. (A file shrunk later is caught by the
/// fault guard, see `guarded.rs`.)
fn check_mem_files(msg: &Msg) -> io::Result<()> {
    let (count, table) = match msg.request() {
        SET_MEM_TABLE => {
            let n = msg
                .body
                .get(0..4)
                .ok_or_else(|| bad("short memory table"))?;
            let n = u32::from_le_bytes(n.try_into().unwrap_or_default()) as usize;
            (n, msg.body.get(8..).unwrap_or_default())
        }
        _ => (1, msg.body.get(8..).unwrap_or_default()),
    };
    if count != msg.files.len() || table.len() < count.saturating_mul(REGION_LEN) {
        return Err(bad("memory table does not match its file descriptors"));
    }
    for (i, (f, r)) in msg
        .files
        .iter()
        .zip(table.chunks_exact(REGION_LEN))
        .enumerate()
    {
        let u64_at = |o: usize| u64::from_le_bytes(r[o..o + 8].try_into().unwrap_or_default());
        let (size, offset) = (u64_at(8), u64_at(24));
        let meta = f.metadata()?;
        if meta.is_file() && offset.checked_add(size).is_none_or(|end| end > meta.len()) {
            return Err(bad(&format!(
                "memory region {i}: its file holds {} bytes, fewer than offset {offset:#x} + size {size:#x}",
                meta.len()
            )));
        }
    }
    Ok(())
}

/// Relays until either side hangs up, then shuts both down.
pub(crate) fn run(front: UnixStream, back: UnixStream, conn: Arc<Conn>) -> io::Result<()> {
    let front_w = Arc::new(Mutex::new(front.try_clone()?));
    let back_r = back.try_clone()?;
    let (fw, fr) = (front_w.clone(), front.try_clone()?);
    // Backend replies carry no descriptors (GET_INFLIGHT_FD's is ours; we do not
    // offer the device-state messages whose replies would).
    let up = std::thread::Builder::new()
        .name("vhost-blk-relay".into())
        .spawn(move || {
            let mut buf = Vec::new();
            while let Ok(Some(m)) = recv(&back_r, &mut buf) {
                if send(&fw, &m.hdr, &m.body, &[]).is_err() {
                    break;
                }
                buf = m.body;
            }
            let _ = fr.shutdown(Shutdown::Both);
            let _ = back_r.shutdown(Shutdown::Both);
        })?;
    let back_w = Mutex::new(back.try_clone()?);
    let mut buf = Vec::new();
    loop {
        let m = match recv(&front, &mut buf) {
            Ok(Some(m)) => m,
            Ok(None) => break,
            Err(e) => {
                trace::limited!(conn.log, info, error = %e, "vhost-user front end connection ended");
                break;
            }
        };
        let Ok(fwd) = handle(m, &front_w, &conn) else {
            break;
        };
        if let Some(m) = fwd {
            let fds: Vec<RawFd> = m.files.iter().map(|f| f.as_raw_fd()).collect();
            if send(&back_w, &m.hdr, &m.body, &fds).is_err() {
                break;
            }
            buf = m.body;
        }
    }
    let _ = back.shutdown(Shutdown::Both);
    let _ = front.shutdown(Shutdown::Both);
    let _ = up.join();
    Ok(())
}
