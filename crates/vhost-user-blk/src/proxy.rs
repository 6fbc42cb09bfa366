//! A message relay between the front end and vhost-user-backend's handler that
//! answers GET_INFLIGHT_FD, SET_INFLIGHT_FD and SET_BACKEND_REQ_FD itself, and
//! notes the protocol features the front end acknowledges.
//!
//! For a live handover (docs/decisions/0024-vhost-user-handover.md) it also keeps
//! the connection's journal, parks between two messages when the device asks
//! ([`RelayCtl`]), and replays a journal to a fresh handler ([`Relay::replay`]).
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
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use crate::backend::Conn;
use crate::handover::{
    Replay, ReplyAck, ADD_MEM_REG, GET_PROTOCOL_FEATURES, SET_BACKEND_REQ_FD, SET_INFLIGHT_FD,
    SET_MEM_TABLE, SET_PROTOCOL_FEATURES, SET_VRING_ENABLE,
};
use crate::inflight::Region;

const HDR: usize = 12;
/// Larger than any message we relay (a memory table of 8 regions, a 256-byte
/// config, a 32-region log); anything bigger ends the connection.
const MAX_BODY: usize = 64 * 1024;
const MAX_FDS: usize = 32;
const GET_INFLIGHT_FD: u32 = 31;
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
                    conn.journal()
                        .record(SET_INFLIGHT_FD, &msg.body, &msg.files);
                    true
                }
                Err(e) => {
                    trace::limited!(conn.log, warn, error = %e, "SET_INFLIGHT_FD refused; requests in flight at a crash will not be recovered");
                    *conn.inflight.lock().unwrap_or_else(|e| e.into_inner()) = None;
                    conn.journal().rec.inflight = None;
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
            if res.is_ok() {
                conn.journal()
                    .record(SET_BACKEND_REQ_FD, &msg.body, &msg.files);
            }
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

/// What the device asks of a connection's relay (see [`RelayCtl`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cmd {
    Run,
    /// Stop reading the front end at a message boundary, by this time.
    Park(Instant),
    /// Let go of the front end without shutting its socket down: a device in
    /// another process serves it now.
    Release,
    /// Parked from the start (a resumed device until it is let run).
    Hold,
}

/// Where a relay is.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Phase {
    Running,
    /// Not reading the front end; the handler has answered everything relayed.
    Parked,
    /// A park request failed (the relay runs on).
    Failed(String),
    /// The connection is over (or released).
    Ended,
}

struct RelaySt {
    cmd: Cmd,
    phase: Phase,
    /// GET_PROTOCOL_FEATURES replies the up thread has seen.
    gpf_seen: u64,
    /// GET_PROTOCOL_FEATURES requests sent to the handler, in order: whether each is
    /// our own probe (its reply is swallowed) or the front end's.
    gpf_order: std::collections::VecDeque<bool>,
    /// Our probes' positions among them.
    probe_at: u64,
}

/// How the device steers a connection's relay for a handover: park it (stop
/// reading the front end at a message boundary, wait until the handler has
/// answered what was relayed, and disable the rings' kicks in the handler), resume
/// it, or release the front end to another process. Control path only.
pub(crate) struct RelayCtl {
    evt: EventFd,
    st: Mutex<RelaySt>,
    cv: Condvar,
    /// The front end's socket belongs to another device now (or may, while parked):
    /// nothing here shuts it down.
    frozen: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl RelayCtl {
    pub fn new() -> io::Result<RelayCtl> {
        Ok(RelayCtl {
            evt: EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)?,
            st: Mutex::new(RelaySt {
                cmd: Cmd::Run,
                phase: Phase::Running,
                gpf_seen: 0,
                gpf_order: Default::default(),
                probe_at: 0,
            }),
            cv: Condvar::new(),
            frozen: AtomicBool::new(false),
        })
    }

    /// Whether the front end's socket must be left alone (parked or released).
    pub fn frozen(&self) -> bool {
        self.frozen.load(Ordering::Acquire)
    }

    /// Parks the relay by `deadline`. Fails if the connection is over, the rings
    /// cannot be stopped, or the handler does not answer in time; the relay then
    /// runs on as before.
    pub fn park(&self, deadline: Instant) -> io::Result<()> {
        let mut st = lock(&self.st);
        if st.phase == Phase::Parked {
            // Still parked (a resume that timed out, or a resumed device not let
            // run yet): it stays parked, with the rings it disabled.
            if st.cmd == Cmd::Run {
                st.cmd = Cmd::Park(deadline);
            }
            return Ok(());
        }
        if st.phase == Phase::Ended {
            return Err(io::Error::new(
                io::ErrorKind::NotConnected,
                "the connection ended",
            ));
        }
        st.cmd = Cmd::Park(deadline);
        st.phase = Phase::Running;
        let _ = self.evt.write(1);
        loop {
            match &st.phase {
                Phase::Parked => return Ok(()),
                Phase::Failed(e) => {
                    let e = e.clone();
                    st.cmd = Cmd::Run;
                    st.phase = Phase::Running;
                    return Err(io::Error::other(e));
                }
                Phase::Ended => {
                    return Err(io::Error::new(
                        io::ErrorKind::NotConnected,
                        "the connection ended",
                    ))
                }
                Phase::Running => {}
            }
            // The relay's own wait for the handler ends at the same deadline; allow
            // it a moment to report.
            let left =
                (deadline + Duration::from_millis(100)).saturating_duration_since(Instant::now());
            if left.is_zero() {
                st.cmd = Cmd::Run;
                let _ = self.evt.write(1);
                self.cv.notify_all();
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the vhost-user relay did not stop in time",
                ));
            }
            st = self
                .cv
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Makes a relay that has not run yet start parked: it reads nothing from the
    /// front end until [`resume`](Self::resume)d, and leaves it alone if released.
    pub fn hold_at_start(&self) {
        let mut st = lock(&self.st);
        st.cmd = Cmd::Hold;
        st.phase = Phase::Parked;
        self.frozen.store(true, Ordering::Release);
    }

    /// Lets a parked relay run on (a failed handover, or a resumed device let
    /// run); returns once it does (bounded), so that a park right after cannot
    /// mistake the old parked state for a new one.
    pub fn resume(&self) {
        let mut st = lock(&self.st);
        if st.cmd == Cmd::Release {
            return;
        }
        st.cmd = Cmd::Run;
        self.cv.notify_all();
        let _ = self.evt.write(1);
        let until = Instant::now() + RESUME_WAIT;
        while st.phase == Phase::Parked && st.cmd == Cmd::Run {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            st = self
                .cv
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Ends the relay without touching the front end's socket.
    pub fn release(&self) {
        self.frozen.store(true, Ordering::Release);
        lock(&self.st).cmd = Cmd::Release;
        self.cv.notify_all();
        let _ = self.evt.write(1);
    }

    fn set_phase(&self, p: Phase) {
        lock(&self.st).phase = p;
        self.cv.notify_all();
    }
}

/// A message header for a request of ours.
fn req_hdr(request: u32, flags: u32, size: usize) -> [u8; HDR] {
    let mut h = [0u8; HDR];
    h[0..4].copy_from_slice(&request.to_le_bytes());
    h[4..8].copy_from_slice(&flags.to_le_bytes());
    h[8..12].copy_from_slice(&(size as u32).to_le_bytes());
    h
}

fn vring_state(index: u32, num: u32) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[0..4].copy_from_slice(&index.to_le_bytes());
    b[4..8].copy_from_slice(&num.to_le_bytes());
    b
}

/// How long `RelayCtl::resume` waits for the relay to run again.
const RESUME_WAIT: Duration = Duration::from_secs(5);
/// How long the replay waits for each answer of the new handler.
const REPLAY_REPLY: Duration = Duration::from_secs(5);
/// How long a resumed device waits for the handler to hand over its started vrings.
const REPLAY_VRINGS: Duration = Duration::from_secs(5);

/// A relay between one front end and vhost-user-backend's handler.
pub(crate) struct Relay {
    front: UnixStream,
    back: UnixStream,
    conn: Arc<Conn>,
}

impl Relay {
    pub fn new(front: UnixStream, back: UnixStream, conn: Arc<Conn>) -> Relay {
        Relay { front, back, conn }
    }

    /// Rebuilds a handed-over connection's state in the (fresh) handler: each
    /// request goes through the same checks and journal as a live one, with
    /// NEED_REPLY wherever an answer is available, and every answer must be a
    /// success. Then checks each started vring against guest memory: its index must
    /// be the used index there (the old device completed everything it took).
    pub fn replay(&self, msgs: Vec<Replay>, bases: &[Option<u32>]) -> io::Result<()> {
        let (sink_w, sink_r) = UnixStream::pair()?;
        let sink_w = Mutex::new(sink_w);
        let back_w = Mutex::new(self.back.try_clone()?);
        let mut acks = ReplyAck::new();
        let mut buf = Vec::new();
        for m in msgs {
            let local = matches!(m.req, SET_INFLIGHT_FD | SET_BACKEND_REQ_FD);
            let acked = acks.on(m.req, &m.body);
            let flags = if local || acked {
                F_VERSION | F_NEED_REPLY
            } else {
                F_VERSION
            };
            let req = m.req;
            let msg = Msg {
                hdr: req_hdr(req, flags, m.body.len()),
                body: m.body,
                files: m.files,
            };
            let expect = match handle(msg, &sink_w, &self.conn)? {
                Some(msg) => {
                    self.conn.journal().record(req, &msg.body, &msg.files);
                    let fds: Vec<RawFd> = msg.files.iter().map(|f| f.as_raw_fd()).collect();
                    send(&back_w, &msg.hdr, &msg.body, &fds)?;
                    let replies = acked || req == crate::handover::GET_FEATURES;
                    replies.then_some(&self.back)
                }
                None => (flags & F_NEED_REPLY != 0).then_some(&sink_r),
            };
            if let Some(sock) = expect {
                let r = recv_reply(sock, &mut buf)?;
                if r.request() != req {
                    return Err(bad("the handler answered another request"));
                }
                if req != crate::handover::GET_FEATURES
                    && r.body.get(0..8) != Some(&0u64.to_le_bytes()[..])
                {
                    return Err(io::Error::other(format!(
                        "replaying vhost-user request {req} failed"
                    )));
                }
                buf = r.body;
            }
        }
        // Everything is applied once this is answered (the handler serves in order).
        send(
            &back_w,
            &req_hdr(GET_PROTOCOL_FEATURES, F_VERSION, 0),
            &[],
            &[],
        )?;
        let r = recv_reply(&self.back, &mut buf)?;
        if r.request() != GET_PROTOCOL_FEATURES {
            return Err(bad("the handler answered another request"));
        }
        self.check_vrings(bases)
    }

    fn check_vrings(&self, bases: &[Option<u32>]) -> io::Result<()> {
        use vhost_user_backend::VringT;
        let kicked = self.conn.journal().rec.vrings.iter().any(|v| v.kicked());
        if !kicked {
            return Ok(());
        }
        // The handler's worker hands them over once a started ring is registered.
        let got = engine::wait_until(REPLAY_VRINGS, Duration::from_micros(200), || {
            lock(&self.conn.vrings).is_some()
        });
        if !got {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the handler did not start the replayed vrings",
            ));
        }
        let vrings = lock(&self.conn.vrings).clone().unwrap_or_default();
        let ready: Vec<bool> = self
            .conn
            .journal()
            .rec
            .vrings
            .iter()
            .map(|v| v.ready)
            .collect();
        for (i, v) in vrings.iter().enumerate() {
            if !ready.get(i).copied().unwrap_or(false) {
                continue;
            }
            let base = bases.get(i).copied().flatten().unwrap_or(0);
            let used = v
                .queue_used_idx()
                .map_err(|e| io::Error::other(format!("vring {i}: used ring unreadable: {e}")))?;
            if u32::from(used) != base {
                return Err(bad(&format!(
                    "vring {i}: handed over at index {base}, but its used ring is at {used} \
                     (requests would be lost or done twice)"
                )));
            }
        }
        Ok(())
    }

    /// Relays until either side hangs up (then shuts both down) or the device
    /// releases the front end to another process (then leaves it alone).
    pub fn run(self) -> io::Result<()> {
        let Relay { front, back, conn } = self;
        let front_w = Arc::new(Mutex::new(front.try_clone()?));
        let back_r = back.try_clone()?;
        let (fw, fr, c2) = (front_w.clone(), front.try_clone()?, conn.clone());
        // Backend replies carry no descriptors (GET_INFLIGHT_FD's is ours; we do not
        // offer the device-state messages whose replies would).
        let up = std::thread::Builder::new()
            .name("vhost-blk-relay".into())
            .spawn(move || {
                let ctl = &c2.relay;
                let mut buf = Vec::new();
                while let Ok(Some(m)) = recv(&back_r, &mut buf) {
                    if m.request() == GET_PROTOCOL_FEATURES {
                        let mut st = lock(&ctl.st);
                        st.gpf_seen += 1;
                        if st.gpf_order.pop_front() == Some(true) {
                            ctl.cv.notify_all();
                            buf = m.body;
                            continue;
                        }
                    }
                    if send(&fw, &m.hdr, &m.body, &[]).is_err() {
                        break;
                    }
                    buf = m.body;
                }
                if !ctl.frozen() {
                    let _ = fr.shutdown(Shutdown::Both);
                }
                let _ = back_r.shutdown(Shutdown::Both);
            })?;
        let back_w = Mutex::new(back.try_clone()?);
        let released = relay_loop(&front, &front_w, &back_w, &conn).unwrap_or(false);
        let _ = back.shutdown(Shutdown::Both);
        if !released && !conn.relay.frozen() {
            let _ = front.shutdown(Shutdown::Both);
        }
        let _ = up.join();
        conn.relay.set_phase(Phase::Ended);
        Ok(())
    }
}

/// Reads one answer of the handler (or of the relay's own handling), bounded.
fn recv_reply(sock: &UnixStream, buf: &mut Vec<u8>) -> io::Result<Msg> {
    sock.set_read_timeout(Some(REPLAY_REPLY))?;
    let r = recv(sock, buf);
    let _ = sock.set_read_timeout(None);
    match r? {
        Some(m) if m.flags() & F_REPLY != 0 => Ok(m),
        Some(_) => Err(bad("a request where an answer was expected")),
        None => Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the vhost-user handler hung up while the state was replayed",
        )),
    }
}

/// The relay's loop; returns whether it released the front end.
fn relay_loop(
    front: &UnixStream,
    front_w: &Mutex<UnixStream>,
    back_w: &Mutex<UnixStream>,
    conn: &Conn,
) -> io::Result<bool> {
    use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
    const FRONT: u64 = 0;
    const CTL: u64 = 1;
    let ctl = &conn.relay;
    let ep = Epoll::new()?;
    ep.ctl(
        ControlOperation::Add,
        front.as_raw_fd(),
        EpollEvent::new(EventSet::IN, FRONT),
    )?;
    ep.ctl(
        ControlOperation::Add,
        ctl.evt.as_raw_fd(),
        EpollEvent::new(EventSet::IN, CTL),
    )?;
    let mut events = [EpollEvent::default(); 2];
    let mut buf = Vec::new();
    if lock(&ctl.st).phase == Phase::Parked && wait_parked(back_w, conn, &[])? {
        return Ok(true);
    }
    loop {
        let n = match ep.wait(-1, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        let mut front_ready = false;
        for ev in &events[..n] {
            if ev.data() == CTL {
                let _ = ctl.evt.read();
            } else {
                front_ready = true;
            }
        }
        // Commands are looked at between messages only.
        let cmd = lock(&ctl.st).cmd;
        match cmd {
            Cmd::Release => return Ok(true),
            Cmd::Hold => {}
            Cmd::Park(deadline) => {
                if lock(&ctl.st).phase == Phase::Running {
                    if park(back_w, conn, deadline)? {
                        return Ok(true);
                    }
                    continue;
                }
            }
            Cmd::Run => {}
        }
        if !front_ready {
            continue;
        }
        let m = match recv(front, &mut buf) {
            Ok(Some(m)) => m,
            Ok(None) => return Ok(false),
            Err(e) => {
                trace::limited!(conn.log, info, error = %e, "vhost-user front end connection ended");
                return Ok(false);
            }
        };
        let Ok(fwd) = handle(m, front_w, conn) else {
            return Ok(false);
        };
        if let Some(m) = fwd {
            let req = m.request();
            conn.journal().record(req, &m.body, &m.files);
            let fds: Vec<RawFd> = m.files.iter().map(|f| f.as_raw_fd()).collect();
            if req == GET_PROTOCOL_FEATURES {
                lock(&ctl.st).gpf_order.push_back(false);
            }
            if send(back_w, &m.hdr, &m.body, &fds).is_err() {
                return Ok(false);
            }
            buf = m.body;
        }
    }
}

/// Sends SET_VRING_ENABLE(`num`) for each of `vrings` (no reply asked).
fn enable(back_w: &Mutex<UnixStream>, vrings: &[u32], num: u32) -> io::Result<()> {
    for &i in vrings {
        send(
            back_w,
            &req_hdr(SET_VRING_ENABLE, F_VERSION, 8),
            &vring_state(i, num),
            &[],
        )?;
    }
    Ok(())
}

/// Parks the relay (see [`RelayCtl`]) and waits there for the next command;
/// returns whether the front end was released.
fn park(back_w: &Mutex<UnixStream>, conn: &Conn, deadline: Instant) -> io::Result<bool> {
    let ctl = &conn.relay;
    let kicked = match conn.journal().kicked_vrings() {
        Ok(k) => k,
        Err(e) => {
            ctl.set_phase(Phase::Failed(e.to_string()));
            return Ok(false);
        }
    };
    // Only one process may read a kick eventfd (vhost-user-backend's worker ends on
    // a kick another reader took first): the handler stops polling these.
    enable(back_w, &kicked, 0)?;
    let at = {
        let mut st = lock(&ctl.st);
        st.gpf_order.push_back(true);
        st.probe_at = st.gpf_seen + st.gpf_order.len() as u64;
        st.probe_at
    };
    send(
        back_w,
        &req_hdr(GET_PROTOCOL_FEATURES, F_VERSION, 0),
        &[],
        &[],
    )?;
    let mut st = lock(&ctl.st);
    while st.gpf_seen < at && st.cmd == Cmd::Park(deadline) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        st = ctl
            .cv
            .wait_timeout(st, left)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
    if st.gpf_seen < at || st.cmd != Cmd::Park(deadline) {
        let why = if st.gpf_seen < at {
            "the vhost-user handler did not answer in time"
        } else {
            "cancelled"
        };
        st.phase = Phase::Failed(why.into());
        ctl.cv.notify_all();
        drop(st);
        enable(back_w, &kicked, 1)?;
        return Ok(false);
    }
    ctl.frozen.store(true, Ordering::Release);
    st.phase = Phase::Parked;
    ctl.cv.notify_all();
    drop(st);
    wait_parked(back_w, conn, &kicked)
}

/// Waits, parked, for the device's next command: re-enables `kicked` and returns
/// `false` to run on, or returns `true` if the front end was released.
fn wait_parked(back_w: &Mutex<UnixStream>, conn: &Conn, kicked: &[u32]) -> io::Result<bool> {
    let ctl = &conn.relay;
    let mut st = lock(&ctl.st);
    while matches!(st.cmd, Cmd::Park(_) | Cmd::Hold) {
        st = ctl.cv.wait(st).unwrap_or_else(|e| e.into_inner());
    }
    if st.cmd == Cmd::Release {
        return Ok(true);
    }
    enable(back_w, kicked, 1)?;
    ctl.frozen.store(false, Ordering::Release);
    st.phase = Phase::Running;
    ctl.cv.notify_all();
    Ok(false)
}
