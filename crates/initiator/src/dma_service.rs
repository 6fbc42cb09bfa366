//! The initiator's side of memory it does not share: it maps DMA memory without a
//! file descriptor (as QEMU does with guest RAM that is not fd-backed) and answers
//! the server's DMA_READ/DMA_WRITE requests from it.
//!
//! The server may send a request at any time, including while we wait for a reply
//! of our own, so once the service runs it owns the socket's read side: one thread
//! reads every message, answers DMA requests from the registered memory, and hands
//! replies to [`crate::VfioUserClient`]'s requests through a channel. Writes of
//! whole messages are serialized with the client's by a shared lock.
//!
//! For hostile tests the service can misbehave on purpose ([`DmaServeMode`]).

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;

use guest_mem::{DmaSlice, SharedMem};
use rand::{Rng, SeedableRng};
use vfio_user::proto::{self, Command, DmaWire, Header, HEADER_SIZE};
use zerocopy::IntoBytes;

use crate::client::{write_msg, Reply};
use crate::scm;

/// How the service answers DMA requests. The misbehaving modes apply to requests
/// that touch [`DmaServeCtl::set_target`]'s range if one is set (the rest are
/// answered correctly), else to all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DmaServeMode {
    /// Correct replies.
    Normal,
    /// Reads requests and never answers them.
    Silent,
    /// Answers every request with an error (errno).
    Refuse(i32),
    /// Answers with replies that do not match their request: wrong length, wrong
    /// address, a payload where none belongs.
    Garble,
    /// Before each correct answer, sends this many replies to requests the server
    /// never made (unknown ids, junk sizes).
    Flood(u16),
}

/// What the service counts.
#[derive(Debug, Default)]
pub struct DmaServeStats {
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub bytes_read: AtomicU64,
    pub bytes_written: AtomicU64,
    /// Requests refused because they reached outside the registered memory.
    pub out_of_bounds: AtomicU64,
    /// The largest data count one request asked for.
    pub max_count: AtomicU64,
}

/// The service's controls, shared with whoever owns the client.
#[derive(Debug)]
pub struct DmaServeCtl {
    mode: Mutex<DmaServeMode>,
    target: Mutex<Option<(u64, u64)>>,
    wire: DmaWire,
    regions: RwLock<Vec<(u64, Arc<SharedMem>)>>,
    pub stats: DmaServeStats,
}

impl DmaServeCtl {
    pub fn set_mode(&self, m: DmaServeMode) {
        *self.mode.lock().unwrap_or_else(|e| e.into_inner()) = m;
    }

    pub fn mode(&self) -> DmaServeMode {
        *self.mode.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Misbehave only for requests touching `[iova, iova+len)` (`None`: all).
    pub fn set_target(&self, range: Option<(u64, u64)>) {
        *self.target.lock().unwrap_or_else(|e| e.into_inner()) = range;
    }

    /// The mode for a request of `count` bytes at `addr`.
    fn mode_for(&self, addr: u64, count: u32) -> DmaServeMode {
        let mode = self.mode();
        let target = *self.target.lock().unwrap_or_else(|e| e.into_inner());
        match target {
            Some((start, len))
                if addr >= start.saturating_add(len)
                    || addr.saturating_add(u64::from(count.max(1))) <= start =>
            {
                DmaServeMode::Normal
            }
            _ => mode,
        }
    }

    pub fn wire(&self) -> DmaWire {
        self.wire
    }

    /// Serves `mem` at IOVA `iova` from now on.
    pub fn add_region(&self, iova: u64, mem: Arc<SharedMem>) {
        self.regions
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .push((iova, mem));
    }

    /// Stops serving the region at `iova`.
    pub fn remove_region(&self, iova: u64) {
        self.regions
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|(i, _)| *i != iova);
    }

    /// Runs `f` on the window `[iova, iova+len)` if one registered region holds it.
    fn with_window<R>(
        &self,
        iova: u64,
        len: usize,
        f: impl FnOnce(DmaSlice<'_>) -> R,
    ) -> Option<R> {
        let regions = self.regions.read().unwrap_or_else(|e| e.into_inner());
        for (base, mem) in regions.iter() {
            let Some(off) = iova.checked_sub(*base) else {
                continue;
            };
            if let Some(s) = mem.slice(off, len) {
                return Some(f(s));
            }
        }
        None
    }
}

pub(crate) struct Service {
    pub replies: Receiver<Reply>,
    pub ctl: Arc<DmaServeCtl>,
    sock: UnixStream,
    thread: Option<JoinHandle<()>>,
}

impl Service {
    pub fn start(
        sock: &UnixStream,
        write_lock: Arc<Mutex<()>>,
        wire: DmaWire,
    ) -> std::io::Result<Service> {
        let rd = sock.try_clone()?;
        let ctl = Arc::new(DmaServeCtl {
            mode: Mutex::new(DmaServeMode::Normal),
            target: Mutex::new(None),
            wire,
            regions: RwLock::new(Vec::new()),
            stats: DmaServeStats::default(),
        });
        let (tx, rx) = std::sync::mpsc::channel();
        let c = ctl.clone();
        let thread = std::thread::Builder::new()
            .name("initiator-dma".into())
            .spawn(move || run(rd, &c, &write_lock, &tx))?;
        Ok(Service {
            replies: rx,
            ctl,
            sock: sock.try_clone()?,
            thread: Some(thread),
        })
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One whole message from `sock`; `None` at EOF or on a broken stream.
fn read_message(sock: &UnixStream) -> Option<Reply> {
    use std::io::Read;
    let mut fds: Vec<OwnedFd> = Vec::new();
    let mut hb = [0u8; HEADER_SIZE];
    let mut got = 0;
    while got < HEADER_SIZE {
        match scm::recv_with_fds(sock, &mut hb[got..], &mut fds) {
            Ok(0) => return None,
            Ok(n) => got += n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) =>
            {
                if got == 0 {
                    continue;
                }
            }
            Err(_) => return None,
        }
    }
    let header: Header = proto::parse(&hb)?;
    let size = header.msg_size as usize;
    if !(HEADER_SIZE..=proto::MAX_MSG_SIZE as usize).contains(&size) {
        return None;
    }
    let mut payload = vec![0u8; size - HEADER_SIZE];
    let mut r = sock;
    let mut done = 0;
    while done < payload.len() {
        match r.read(&mut payload[done..]) {
            Ok(0) => return None,
            Ok(n) => done += n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) => {}
            Err(_) => return None,
        }
    }
    Some(Reply {
        header,
        payload,
        fds,
    })
}

fn send(sock: &UnixStream, lock: &Mutex<()>, bytes: &[u8]) -> bool {
    let _g = lock.lock().unwrap_or_else(|e| e.into_inner());
    write_msg(sock, bytes, &[]).is_ok()
}

fn reply_bytes(req: &Header, payload: &[u8]) -> Vec<u8> {
    let mut v = Header::reply_to(req, payload.len()).as_bytes().to_vec();
    v.extend_from_slice(payload);
    v
}

fn error_bytes(req: &Header, errno: i32) -> Vec<u8> {
    Header::error_reply(req, errno).as_bytes().to_vec()
}

fn run(sock: UnixStream, ctl: &DmaServeCtl, lock: &Mutex<()>, replies: &Sender<Reply>) {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(0x5eed);
    while let Some(m) = read_message(&sock) {
        if m.header.is_reply() {
            if replies.send(m).is_err() {
                return;
            }
            continue;
        }
        let cmd = Command::from_u16(m.header.cmd);
        let write = match cmd {
            Some(Command::DmaRead) => false,
            Some(Command::DmaWrite) => true,
            _ => {
                // Nothing else goes from a server to its client.
                if !m.header.no_reply() && !send(&sock, lock, &error_bytes(&m.header, libc::ENOSYS))
                {
                    return;
                }
                continue;
            }
        };
        let (addr, count) = ctl
            .wire
            .parse_request(&m.payload, write)
            .map_or((0, 0), |(a, c, _)| (a, c));
        let mode = ctl.mode_for(addr, count);
        let out = match mode {
            DmaServeMode::Silent => continue,
            DmaServeMode::Refuse(errno) => error_bytes(&m.header, errno),
            DmaServeMode::Garble => garble(ctl.wire, &m, write, &mut rng),
            DmaServeMode::Normal | DmaServeMode::Flood(_) => {
                if let DmaServeMode::Flood(n) = mode {
                    for _ in 0..n {
                        let junk = junk_reply(&mut rng);
                        if !send(&sock, lock, &junk) {
                            return;
                        }
                    }
                }
                serve(ctl, &m, write)
            }
        };
        if m.header.no_reply() {
            continue;
        }
        if !send(&sock, lock, &out) {
            return;
        }
    }
}

/// The reply to a DMA request, served from the registered memory.
fn serve(ctl: &DmaServeCtl, m: &Reply, write: bool) -> Vec<u8> {
    let w = ctl.wire;
    let Some((addr, count, data)) = w.parse_request(&m.payload, write) else {
        return error_bytes(&m.header, libc::EINVAL);
    };
    let n = count as usize;
    let st = &ctl.stats;
    st.max_count.fetch_max(u64::from(count), Ordering::Relaxed);
    if write {
        let ok = n == 0
            || ctl
                .with_window(addr, n, |s| s.write_from(0, data).is_ok())
                .unwrap_or(false);
        if !ok {
            st.out_of_bounds.fetch_add(1, Ordering::Relaxed);
            return error_bytes(&m.header, libc::EFAULT);
        }
        st.writes.fetch_add(1, Ordering::Relaxed);
        st.bytes_written.fetch_add(n as u64, Ordering::Relaxed);
        reply_bytes(&m.header, &w.write_reply(addr, count))
    } else {
        let mut buf = vec![0u8; n];
        let ok = n == 0
            || ctl
                .with_window(addr, n, |s| s.read_into(0, &mut buf).is_ok())
                .unwrap_or(false);
        if !ok {
            st.out_of_bounds.fetch_add(1, Ordering::Relaxed);
            return error_bytes(&m.header, libc::EFAULT);
        }
        st.reads.fetch_add(1, Ordering::Relaxed);
        st.bytes_read.fetch_add(n as u64, Ordering::Relaxed);
        reply_bytes(&m.header, &w.read_reply(addr, &buf))
    }
}

/// A reply that does not fit its request.
fn garble(w: DmaWire, m: &Reply, write: bool, rng: &mut impl Rng) -> Vec<u8> {
    let (addr, count, _) = w.parse_request(&m.payload, write).unwrap_or((0, 0, &[]));
    match rng.gen_range(0..3) {
        // One byte short (or long).
        0 => {
            let mut p = w.read_reply(addr, &vec![0xa5; count as usize]);
            if p.len() > 1 && rng.gen() {
                p.pop();
            } else {
                p.push(0);
            }
            reply_bytes(&m.header, &p)
        }
        // Another address.
        1 => {
            let p = w.read_reply(addr ^ 0x1000, &vec![0x5a; count as usize]);
            reply_bytes(&m.header, &p)
        }
        // Another command's reply under this id.
        _ => {
            let mut h = Header::reply_to(&m.header, 0);
            h.cmd = Command::RegionRead as u16;
            h.as_bytes().to_vec()
        }
    }
}

fn junk_reply(rng: &mut impl Rng) -> Vec<u8> {
    let len = rng.gen_range(0..4096usize);
    let cmd = if rng.gen() {
        Command::DmaRead
    } else {
        Command::DmaWrite
    };
    let h = Header {
        msg_id: rng.gen(),
        cmd: cmd as u16,
        msg_size: (HEADER_SIZE + len) as u32,
        flags: proto::FLAG_TYPE_REPLY | if rng.gen() { proto::FLAG_ERROR } else { 0 },
        error: rng.gen_range(0..200),
    };
    let mut v = h.as_bytes().to_vec();
    v.extend((0..len).map(|_| rng.gen::<u8>()));
    v
}
