//! Requests from the server to the client: DMA_READ and DMA_WRITE for client memory
//! mapped without a file descriptor (docs/decisions/0020-dma-messages.md).
//!
//! One [`Port`] per connection, made at the first DMA_MAP without an fd; it is the
//! [`guest_mem::RemoteDma`] of that client's mirror regions. Any thread may call
//! [`guest_mem::RemoteDma::transfer`] (`transfer.rs`): the controller's queue
//! groups on their reactor, the admin path on whatever thread runs it. The client's
//! replies and its own requests share the socket, so **whoever waits for a reply
//! reads the socket when nobody else does** (the "reader"): replies go to their
//! waiters by message id, the client's requests are queued for the connection's
//! thread, which serves them in order ([`Port::next_request`]). Therefore a waiter
//! never depends on the connection's thread, which may itself be blocked (on a lock
//! a waiter holds, on readers it is resetting), and the connection's thread never
//! waits for a reply.
//!
//! Every wait is bounded: no reply within the port's timeout fails the transfer
//! (its reader then sees a Data Transfer Error or a fatal controller), and the ids
//! it gave up on are not reused until their late replies arrive. Transfers are
//! split at the negotiated `max_data_xfer_size`, and at most [`WINDOW`] bytes are in
//! flight so that neither side's socket buffer can fill while the other waits.
//!
//! Wire layout: see [`DmaWire`]; the first transfer of a connection sends a
//! zero-length DMA_WRITE to learn which one the client speaks.

use std::collections::{HashMap, HashSet, VecDeque};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use std::io::{Read, Write};

use guest_mem::RemoteError;

use crate::msg::{self, Msg, ReadError};
use crate::proto::{Command, DmaWire};

mod transfer;

/// Bytes of DMA_WRITE data sent and not yet acknowledged per transfer.
const WINDOW: usize = 192 * 1024;
/// Largest DMA_READ we ask for, and the most DMA_READ data whose replies may be on
/// their way at once. QEMU's client writes its replies to a non-blocking socket and
/// takes a partial write for a whole one (hw/vfio-user/proxy.c, 10.1-11.1), which
/// leaves the stream torn for good; so its replies must always fit its socket send
/// buffer (212 992 bytes by default, `net.core.wmem_default`), with room for its own
/// requests: two 32 KiB replies in flight do, whatever else is queued.
const READ_PIECE: usize = 32 * 1024;
const READ_WINDOW: usize = 64 * 1024;
/// How long a reader sits in `poll` before it looks at pauses and closes again.
const SLICE: Duration = Duration::from_millis(5);
/// Client requests a reader may queue (bytes) before it stops reading until the
/// connection's thread takes them: a client flooding requests while we wait for
/// its replies gets a timeout, not our memory.
const MAX_QUEUED_BYTES: usize = 8 << 20;
/// Ids given up on (their replies may still come) before the client counts as
/// broken.
const MAX_ABANDONED: usize = 4096;
/// Why a port closed when a waiter read the client's orderly close.
const CLIENT_CLOSED: &str = "the client closed the connection";

/// What the transfers of one device cost and how they went (cumulative over
/// connections).
#[derive(Debug, Default)]
pub struct DmaMessageStats {
    /// DMA_READ / DMA_WRITE requests sent.
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub bytes_read: AtomicU64,
    pub bytes_written: AtomicU64,
    /// Transfers that got no reply in time.
    pub timeouts: AtomicU64,
    /// Replies that did not match their request, or error replies.
    pub bad_replies: AtomicU64,
    /// Replies to nothing we asked (or gave up on).
    pub unexpected_replies: AtomicU64,
}

/// A snapshot of [`DmaMessageStats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct DmaMessageCounts {
    pub reads: u64,
    pub writes: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub timeouts: u64,
    pub bad_replies: u64,
    pub unexpected_replies: u64,
}

impl DmaMessageStats {
    pub fn snapshot(&self) -> DmaMessageCounts {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DmaMessageCounts {
            reads: l(&self.reads),
            writes: l(&self.writes),
            bytes_read: l(&self.bytes_read),
            bytes_written: l(&self.bytes_written),
            timeouts: l(&self.timeouts),
            bad_replies: l(&self.bad_replies),
            unexpected_replies: l(&self.unexpected_replies),
        }
    }
}

struct Pending {
    /// The reply, once a reader routed it here.
    reply: Option<Msg>,
}

struct State {
    next_id: u16,
    pending: HashMap<u16, Pending>,
    /// Ids whose waiters gave up; not reused until their reply shows up.
    abandoned: HashSet<u16>,
    /// Client requests a waiter read, for the connection's thread.
    queued: VecDeque<Msg>,
    queued_bytes: usize,
    /// Someone is reading the socket.
    reading: bool,
    closed: Option<&'static str>,
    wire: Option<DmaWire>,
    probing: bool,
    paused: u32,
}

pub(crate) struct Port {
    sock: UnixStream,
    send: Mutex<()>,
    st: Mutex<State>,
    cv: Condvar,
    /// Readable while requests wait in `queued` (or the port closed): the
    /// connection's thread (or the hub) polls it with the socket.
    bell: (UnixStream, UnixStream),
    max_xfer: u32,
    timeout: Duration,
    stats: std::sync::Arc<DmaMessageStats>,
    log: trace::LogLimiter,
    /// The last message headers through the port, for the log when the stream
    /// breaks.
    recent: Mutex<Recent>,
}

impl std::fmt::Debug for Port {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Port")
            .field("max_xfer", &self.max_xfer)
            .finish()
    }
}

/// The last headers through a port ('>' sent, '<' read) and where the next goes.
type Recent = (usize, [Option<(char, crate::proto::Header)>; 16]);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Port {
    /// A port over `sock` (a clone of the connection's socket). `max_xfer` is the
    /// largest data count per message both sides accept.
    pub fn new(
        sock: UnixStream,
        max_xfer: u32,
        timeout: Duration,
        stats: std::sync::Arc<DmaMessageStats>,
    ) -> std::io::Result<Port> {
        let (tx, rx) = UnixStream::pair()?;
        tx.set_nonblocking(true)?;
        rx.set_nonblocking(true)?;
        Ok(Port {
            sock,
            send: Mutex::new(()),
            st: Mutex::new(State {
                next_id: 0,
                pending: HashMap::new(),
                abandoned: HashSet::new(),
                queued: VecDeque::new(),
                queued_bytes: 0,
                reading: false,
                closed: None,
                wire: None,
                probing: false,
                paused: 0,
            }),
            cv: Condvar::new(),
            bell: (tx, rx),
            // A client that claims less than this gets it anyway: no real one does,
            // and 0 would never finish.
            max_xfer: max_xfer.max(512),
            timeout,
            stats,
            log: trace::LogLimiter::new(),
            recent: Mutex::new((0, [None; 16])),
        })
    }

    fn note(&self, dir: char, h: &crate::proto::Header) {
        let mut r = lock(&self.recent);
        let i = r.0 % r.1.len();
        r.1[i] = Some((dir, *h));
        r.0 = r.0.wrapping_add(1);
    }

    /// Logs the last headers (oldest first) with why the stream broke.
    fn dump(&self, why: &str) {
        let r = lock(&self.recent);
        let n = r.1.len();
        let lines: Vec<String> = (0..n)
            .filter_map(|k| r.1[(r.0 + k) % n])
            .map(|(d, h)| {
                format!(
                    "{d} id={} cmd={} size={} flags={:#x}",
                    h.msg_id, h.cmd, h.msg_size, h.flags
                )
            })
            .collect();
        tracing::warn!(
            "vfio-user: DMA port: {why}; last messages: {}",
            lines.join("; ")
        );
    }

    /// What the connection's thread polls besides the socket.
    pub fn bell(&self) -> BorrowedFd<'_> {
        self.bell.1.as_fd()
    }

    fn ring(&self) {
        let _ = (&self.bell.0).write(&[1]);
    }

    fn drain_bell(&self) {
        let mut buf = [0u8; 64];
        while matches!((&self.bell.1).read(&mut buf), Ok(n) if n > 0) {}
    }

    /// Serializes whole messages on the socket (replies of the connection's thread
    /// and requests of waiters).
    pub fn send_lock(&self) -> MutexGuard<'_, ()> {
        lock(&self.send)
    }

    /// The connection ended (or failed): every waiter gives up, and the connection's
    /// thread learns it from [`Port::next_request`].
    pub fn close(&self, why: &'static str) {
        let mut st = lock(&self.st);
        if st.closed.is_none() {
            st.closed = Some(why);
        }
        drop(st);
        self.cv.notify_all();
        self.ring();
    }

    /// For the connection's thread: the next client request, read by it or queued
    /// by a waiter; `None` when there is none right now (poll the socket and the
    /// bell again). Replies it reads on the way go to their waiters.
    pub fn next_request(&self) -> Result<Option<Msg>, ReadError> {
        self.drain_bell();
        loop {
            let mut st = lock(&self.st);
            if let Some(m) = st.queued.pop_front() {
                st.queued_bytes = st.queued_bytes.saturating_sub(m.payload.len());
                if !st.queued.is_empty() {
                    self.ring();
                }
                return Ok(Some(m));
            }
            if let Some(why) = st.closed {
                // An orderly close a waiter read is just the client leaving.
                return Err(if why == CLIENT_CLOSED {
                    ReadError::Eof
                } else {
                    ReadError::Framing(None, why)
                });
            }
            if st.reading {
                // A waiter is reading; it queues what is for us and rings the bell.
                let _ = self.cv.wait_timeout(st, Duration::from_millis(1));
                return Ok(None);
            }
            if !lifecycle::fdpass::poll_in(&[self.sock.as_fd()], 0)
                .map_err(ReadError::Io)?
                .first()
                .copied()
                .unwrap_or(false)
            {
                return Ok(None);
            }
            st.reading = true;
            drop(st);
            let r = self.read_logged();
            let mut st = lock(&self.st);
            st.reading = false;
            self.cv.notify_all();
            match r {
                Ok(m) if m.hdr.is_reply() => {
                    self.route_reply(&mut st, m);
                }
                Ok(m) => return Ok(Some(m)),
                Err(e) => {
                    st.closed.get_or_insert("the connection failed");
                    return Err(e);
                }
            }
        }
    }

    /// Reads one message off the socket, noting its header in the message log (and
    /// dumping what a framing error left unread).
    fn read_logged(&self) -> Result<Msg, ReadError> {
        let r = msg::read_msg(&self.sock);
        match &r {
            Ok(m) => self.note('<', &m.hdr),
            Err(ReadError::Framing(h, why)) => {
                if let Some((h, _)) = h {
                    self.note('<', h);
                }
                self.dump(why);
            }
            _ => {}
        }
        r
    }

    /// Hands a reply the connection's thread (or a waiter) read to its waiter.
    fn route_reply(&self, st: &mut State, m: Msg) {
        let id = m.hdr.msg_id;
        if let Some(p) = st.pending.get_mut(&id).filter(|p| p.reply.is_none()) {
            p.reply = Some(m);
            self.cv.notify_all();
        } else if st.abandoned.remove(&id) {
            // A late answer to something we gave up on.
        } else {
            self.stats
                .unexpected_replies
                .fetch_add(1, Ordering::Relaxed);
            trace::limited!(
                self.log,
                warn,
                "vfio-user: the client sent a reply to no request of ours (id {id}, cmd {})",
                m.hdr.cmd
            );
        }
    }

    /// A reader's turn: waits up to `wait` for a message and routes it.
    fn read_one(&self, wait: Duration) -> Result<(), &'static str> {
        {
            let st = lock(&self.st);
            if st.queued_bytes > MAX_QUEUED_BYTES {
                // The connection's thread has not taken the client's requests: do not
                // read more of them.
                drop(st);
                std::thread::sleep(wait.min(SLICE));
                return Ok(());
            }
        }
        let ms = i32::try_from(wait.as_millis()).unwrap_or(i32::MAX).max(1);
        match lifecycle::fdpass::poll_in(&[self.sock.as_fd()], ms) {
            Ok(r) if r.first().copied().unwrap_or(false) => {}
            Ok(_) => return Ok(()),
            Err(_) => return Err("poll on the connection failed"),
        }
        let r = self.read_logged();
        match r {
            Ok(m) => {
                let mut st = lock(&self.st);
                if m.hdr.is_reply() {
                    self.route_reply(&mut st, m);
                } else {
                    st.queued_bytes += m.payload.len();
                    st.queued.push_back(m);
                    drop(st);
                    self.ring();
                }
                Ok(())
            }
            Err(ReadError::Eof) => Err(CLIENT_CLOSED),
            Err(ReadError::Io(_)) => Err("the connection failed"),
            Err(ReadError::Framing(_, why)) => Err(why),
        }
    }

    /// Sends one request; its id is registered before the first byte leaves.
    fn send_request(&self, cmd: Command, parts: &[&[u8]]) -> Result<u16, RemoteError> {
        let id = {
            let mut st = lock(&self.st);
            if st.closed.is_some() {
                return Err(RemoteError::Closed);
            }
            if st.paused > 0 {
                return Err(RemoteError::Paused);
            }
            let mut id = st.next_id;
            let mut tries = 0u32;
            while st.pending.contains_key(&id) || st.abandoned.contains(&id) {
                id = id.wrapping_add(1);
                tries += 1;
                if tries > u32::from(u16::MAX) {
                    return Err(RemoteError::Closed);
                }
            }
            st.next_id = id.wrapping_add(1);
            st.pending.insert(id, Pending { reply: None });
            id
        };
        let sent = {
            let _g = self.send_lock();
            msg::send_command(&self.sock, id, cmd, parts)
        };
        if let Ok(h) = &sent {
            self.note('>', h);
        }
        if sent.is_err() {
            lock(&self.st).pending.remove(&id);
            self.close("sending to the client failed");
            return Err(RemoteError::Closed);
        }
        Ok(id)
    }

    /// Waits until some of `ids` have replies (returned, removed from `pending`),
    /// reading the socket meanwhile if nobody else does.
    fn wait_any(&self, ids: &[u16], deadline: Instant) -> Result<Vec<(u16, Msg)>, RemoteError> {
        let mut st = lock(&self.st);
        loop {
            let mut got = Vec::new();
            for id in ids {
                if st.pending.get(id).is_some_and(|p| p.reply.is_some()) {
                    if let Some(m) = st.pending.remove(id).and_then(|p| p.reply) {
                        got.push((*id, m));
                    }
                }
            }
            if !got.is_empty() {
                return Ok(got);
            }
            if st.closed.is_some() {
                return Err(RemoteError::Closed);
            }
            if st.paused > 0 {
                return Err(RemoteError::Paused);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(RemoteError::Timeout);
            }
            let wait = (deadline - now).min(SLICE);
            if st.reading {
                st = self
                    .cv
                    .wait_timeout(st, wait)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            } else {
                st.reading = true;
                drop(st);
                let r = self.read_one(wait);
                st = lock(&self.st);
                st.reading = false;
                self.cv.notify_all();
                if let Err(why) = r {
                    st.closed.get_or_insert(why);
                    drop(st);
                    self.ring();
                    st = lock(&self.st);
                }
            }
        }
    }

    /// Gives up on `ids`: their late replies are dropped, and the ids not reused
    /// until then.
    fn abandon(&self, ids: &[u16]) {
        let mut st = lock(&self.st);
        for id in ids {
            if st.pending.remove(id).is_some() {
                st.abandoned.insert(*id);
            }
        }
        if st.abandoned.len() > MAX_ABANDONED {
            st.closed
                .get_or_insert("the client leaves our requests unanswered");
            drop(st);
            self.cv.notify_all();
            self.ring();
        }
    }

    /// The client's layout, probed with a zero-length DMA_WRITE at `addr` on first
    /// use (one prober; the others wait for its answer).
    fn layout(&self, addr: u64) -> Result<DmaWire, RemoteError> {
        let deadline = Instant::now() + self.timeout;
        {
            let mut st = lock(&self.st);
            loop {
                if let Some(w) = st.wire {
                    return Ok(w);
                }
                if st.closed.is_some() {
                    return Err(RemoteError::Closed);
                }
                if st.paused > 0 {
                    return Err(RemoteError::Paused);
                }
                if !st.probing {
                    st.probing = true;
                    break;
                }
                if Instant::now() >= deadline {
                    return Err(RemoteError::Timeout);
                }
                st = self
                    .cv
                    .wait_timeout(st, SLICE)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
        let head = DmaWire::Spec.write_request_head(addr, 0).0;
        let r = self
            .send_request(Command::DmaWrite, &[&head])
            .and_then(|id| match self.wait_any(&[id], deadline) {
                Ok(mut v) => Ok(v.pop().map(|(_, m)| m)),
                Err(e) => {
                    self.abandon(&[id]);
                    Err(e)
                }
            });
        let mut st = lock(&self.st);
        st.probing = false;
        let r = match r {
            Ok(Some(m)) => {
                let w = DmaWire::from_probe_reply(m.hdr.is_error(), &m.payload);
                st.wire = Some(w);
                trace::limited!(
                    self.log,
                    info,
                    "vfio-user: the client's DMA message layout is {}",
                    match w {
                        DmaWire::Qemu => "QEMU's (4-byte count, data at offset 12)",
                        DmaWire::Spec => "the protocol document's",
                    }
                );
                Ok(w)
            }
            Ok(None) => Err(RemoteError::BadReply),
            Err(e) => Err(e),
        };
        drop(st);
        self.cv.notify_all();
        r
    }
}

impl Drop for Port {
    fn drop(&mut self) {
        self.close("the connection ended");
    }
}
