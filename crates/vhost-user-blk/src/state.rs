//! Live handover of a connected front end to a device in another process
//! (docs/decisions/0024-vhost-user-handover.md, 0032-vhost-user-seam.md).
//!
//! The handler owns the connection's state, so [`save`] writes it down as it is
//! ([`HandoverState`]: serde, versioned; fds replaced by indices into a list passed
//! beside it) and [`restore`] builds a handler from it directly. The state crosses
//! a process boundary and is checked like client input: counts, sizes and indices
//! are bounded, every fd index is used exactly once, and each started vring's index
//! must match the used ring in guest memory.

use std::fs::File;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use vhost::vhost_user::message::{FrontendReq, VhostUserInflight, VhostUserLog, VhostUserU64};
use vhost::vhost_user::BackendReqHandler;
use virtio_queue::QueueT;
use vm_memory::{ByteValued, GuestAddressSpace};

use crate::conn::{lock, Shared, VringAddr};
use crate::error::StateError;
use crate::handler::{ConfigWrite, Handler, MAX_CONFIG_WRITES};
use crate::memory::{self, Mapping, MAX_MEM_SLOTS};
use crate::serve::Established;

/// Format of [`HandoverState`] a device saves.
pub const HANDOVER_VERSION: u32 = 3;
/// The oldest format a device restores: 2 has no dirty-page log and no writer
/// flag (it predates live migration; its device was the writer). A device that
/// reads only 2 refuses 3, so a migrating VM is never handed to a device that
/// would stop logging.
pub const MIN_HANDOVER_VERSION: u32 = 2;

/// The split ring's largest size.
const MAX_QUEUE_SIZE: u16 = 32768;
const MAX_CONFIG_LEN: usize = 256;

/// What a paused device saves to hand its front end over to another device.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct HandoverState {
    /// [`HANDOVER_VERSION`].
    pub version: u32,
    /// The device's virtqueues and their largest size: the new device must offer
    /// the same (the front end negotiated them).
    pub num_queues: u16,
    pub queue_size: u16,
    /// The capacity the front end read from the config space.
    pub capacity_bytes: u64,
    /// Index in the fd list of the listening socket.
    pub listener_fd: usize,
    /// The device is its disk's writer (holds the writer claim when it runs); not
    /// when its VM migrated away, or it receives one that has not started here.
    #[serde(default = "writer_by_default")]
    pub writer: bool,
    /// The connected front end, if one is.
    pub connection: Option<ConnectionState>,
}

/// A connected front end: its socket and what it set up, as the handler holds it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ConnectionState {
    /// Index in the fd list of the front end's socket.
    pub front_fd: usize,
    /// SET_OWNER.
    pub owner: bool,
    /// SET_FEATURES.
    pub features: Option<u64>,
    /// SET_PROTOCOL_FEATURES.
    pub protocol_features: Option<u64>,
    /// The memory table.
    pub mem: Vec<MemRegion>,
    /// SET_INFLIGHT_FD.
    pub inflight: Option<InflightArea>,
    /// SET_LOG_BASE (the front end migrates the VM).
    #[serde(default)]
    pub log: Option<DirtyLogArea>,
    /// Index of the backend request channel (SET_BACKEND_REQ_FD).
    pub backend_req: Option<usize>,
    /// SET_CONFIG writes, the latest per offset and size, in order.
    pub config: Vec<ConfigWrite>,
    /// Per vring, in queue order.
    pub vrings: Vec<VringRecord>,
}

/// One memory region (`VhostUserMemoryRegion`) and the index of its file.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct MemRegion {
    pub guest_phys_addr: u64,
    pub memory_size: u64,
    pub userspace_addr: u64,
    pub mmap_offset: u64,
    pub fd: usize,
}

/// The inflight area (`VhostUserInflight`) and the index of its file.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct InflightArea {
    pub mmap_size: u64,
    pub mmap_offset: u64,
    pub num_queues: u16,
    pub queue_size: u16,
    pub fd: usize,
}

/// The dirty-page log (`VhostUserLog`) and the index of its file.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct DirtyLogArea {
    pub mmap_size: u64,
    pub mmap_offset: u64,
    pub fd: usize,
}

fn writer_by_default() -> bool {
    true
}

/// One vring.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct VringRecord {
    pub num: u16,
    pub addr: Option<VringAddr>,
    /// Where the device stopped taking chains (nothing is in flight: also the
    /// used index).
    pub base: u16,
    /// Indices of the kick, call and err eventfds.
    pub kick: Option<usize>,
    pub call: Option<usize>,
    pub err: Option<usize>,
    pub enabled: bool,
    /// Started (a kick eventfd arrived since the last GET_VRING_BASE).
    pub started: bool,
}

/// Takes fds out of an imported list by index, each at most once.
pub(crate) struct FdTaker {
    fds: Vec<Option<OwnedFd>>,
}

impl FdTaker {
    pub fn new(fds: Vec<OwnedFd>) -> FdTaker {
        FdTaker {
            fds: fds.into_iter().map(Some).collect(),
        }
    }

    pub fn take(&mut self, index: usize) -> Result<File, StateError> {
        let count = self.fds.len();
        self.fds
            .get_mut(index)
            .ok_or(StateError::FdIndex { index, count })?
            .take()
            .map(File::from)
            .ok_or(StateError::FdTwice(index))
    }

    fn take_opt(&mut self, index: Option<usize>) -> Result<Option<File>, StateError> {
        index.map(|i| self.take(i)).transpose()
    }

    /// Fails if an fd was handed over that the state does not use.
    pub fn finish(self) -> Result<(), StateError> {
        match self.fds.iter().filter(|f| f.is_some()).count() {
            0 => Ok(()),
            left => Err(StateError::FdsLeft(left)),
        }
    }
}

fn push(fds: &mut Vec<OwnedFd>, f: &impl std::os::fd::AsFd) -> std::io::Result<usize> {
    fds.push(f.as_fd().try_clone_to_owned()?);
    Ok(fds.len() - 1)
}

/// Writes down the handler's state, with copies of its fds appended to `fds`.
/// The connection must be parked and its queues paused (nothing in flight).
pub(crate) fn save(
    h: &Handler,
    front: &UnixStream,
    fds: &mut Vec<OwnedFd>,
) -> crate::Result<ConnectionState> {
    let io = crate::error::io("copy a handed-over fd");
    let front_fd = push(fds, front).map_err(io)?;
    let conn = &h.conn;
    let mut mem = Vec::with_capacity(h.table.len());
    for m in &h.table {
        let f = memory::file_of(&conn.mem, m.gpa)
            .map_err(crate::error::io("find a memory region's file"))?;
        mem.push(MemRegion {
            guest_phys_addr: m.gpa,
            memory_size: m.size,
            userspace_addr: m.uaddr,
            mmap_offset: m.offset,
            fd: push(fds, &f).map_err(crate::error::io("copy a handed-over fd"))?,
        });
    }
    let inflight = match &h.inflight {
        Some(r) => Some(InflightArea {
            mmap_size: r.req.mmap_size,
            mmap_offset: r.req.mmap_offset,
            num_queues: r.req.num_queues,
            queue_size: r.req.queue_size,
            fd: push(fds, &r.file).map_err(crate::error::io("copy a handed-over fd"))?,
        }),
        None => None,
    };
    let log = match &h.log {
        Some(l) => Some(DirtyLogArea {
            mmap_size: l.size,
            mmap_offset: l.offset,
            fd: push(fds, &l.file).map_err(crate::error::io("copy a handed-over fd"))?,
        }),
        None => None,
    };
    let backend_req = match lock(&conn.backend_req).as_ref() {
        Some(s) => Some(push(fds, s).map_err(crate::error::io("copy a handed-over fd"))?),
        None => None,
    };
    if h.config_overflow {
        return Err(crate::Error::Unsaveable(
            "too many distinct config space writes",
        ));
    }
    let mut vrings = Vec::with_capacity(conn.vrings.len());
    for v in &conn.vrings {
        let st = lock(v);
        let q = &st.queue;
        if q.ready() && q.next_avail() != q.next_used() {
            return Err(crate::Error::Unsaveable("requests still in flight"));
        }
        let mut fd = |f: &Option<File>| -> crate::Result<Option<usize>> {
            f.as_ref()
                .map(|f| push(fds, f).map_err(crate::error::io("copy a handed-over fd")))
                .transpose()
        };
        vrings.push(VringRecord {
            num: q.size(),
            addr: st.addrs,
            base: q.next_avail(),
            kick: fd(&st.kick)?,
            call: fd(&st.call)?,
            err: fd(&st.err)?,
            enabled: st.enabled,
            started: q.ready(),
        });
    }
    Ok(ConnectionState {
        front_fd,
        owner: h.owned,
        features: h.features,
        protocol_features: h.protocol,
        mem,
        inflight,
        log,
        backend_req,
        config: h.config.clone(),
        vrings,
    })
}

/// Bounds a state before anything of it is used.
pub(crate) fn validate(
    c: &ConnectionState,
    num_queues: u16,
    queue_size: u16,
) -> Result<(), StateError> {
    if c.vrings.len() != usize::from(num_queues) {
        return Err(StateError::Range("the number of vrings"));
    }
    if c.mem.len() > MAX_MEM_SLOTS {
        return Err(StateError::Range("the number of memory regions"));
    }
    if c.config.len() > MAX_CONFIG_WRITES || c.config.iter().any(|w| w.data.len() > MAX_CONFIG_LEN)
    {
        return Err(StateError::Range("the config space writes"));
    }
    for (index, v) in c.vrings.iter().enumerate() {
        let bad = |what| Err(StateError::Vring { index, what });
        if v.num == 0 || v.num > queue_size || v.num > MAX_QUEUE_SIZE {
            return bad("size out of range");
        }
        if v.started && (v.kick.is_none() || v.addr.is_none()) {
            return bad("started without a kick eventfd or addresses");
        }
    }
    Ok(())
}

/// Primes vhost's `BackendReqHandler` with the negotiation the front end did
/// (features and protocol features, on which it gates requests and REPLY_ACK):
/// the library keeps them private and has no setter, so they are fed to it as
/// the three messages that set them, over a private socket pair. The handler
/// sees them too (idempotent: the values it saved).
fn prime(est: &mut Established, c: &ConnectionState) -> Result<(), StateError> {
    let (ours, theirs) = UnixStream::pair().map_err(StateError::Io)?;
    let mut req = BackendReqHandler::from_stream(ours, est.handler.clone());
    let mut send = |code: FrontendReq, body: Option<u64>| -> Result<(), StateError> {
        let size = if body.is_some() { 8 } else { 0 };
        let mut msg = crate::channel::Hdr::new(code, 0, size).encode().to_vec();
        if let Some(v) = body {
            msg.extend_from_slice(VhostUserU64::new(v).as_slice());
        }
        (&theirs).write_all(&msg).map_err(StateError::Io)?;
        req.handle_request().map_err(StateError::Negotiation)
    };
    send(FrontendReq::GET_FEATURES, None)?;
    if let Some(p) = c.protocol_features {
        send(FrontendReq::SET_PROTOCOL_FEATURES, Some(p))?;
    }
    if let Some(f) = c.features {
        send(FrontendReq::SET_FEATURES, Some(f))?;
    }
    // The primed library now serves the front end's socket: its fd number takes
    // the front end's socket in place of our end of the pair.
    crate::fdswap::replace(&req, &est.conn.front).map_err(StateError::Io)?;
    est.req = req;
    Ok(())
}

/// Rebuilds a handed-over connection on `shared`'s device: a fresh handler with
/// the saved state installed, checked against guest memory.
pub(crate) fn restore(
    shared: &Arc<Shared>,
    c: ConnectionState,
    taker: &mut FdTaker,
) -> crate::Result<Established> {
    validate(&c, shared.cfg.opts.num_queues, shared.cfg.opts.queue_size)?;
    let front = taker.take(c.front_fd)?;
    let front = crate::channel::stream_socket(OwnedFd::from(front))
        .ok_or(StateError::NotSocket("front end's socket"))?;
    let mut est = Established::new(shared, front).map_err(StateError::Io)?;
    prime(&mut est, &c)?;
    let mut h = lock(&est.handler);
    h.owned = c.owner;
    restore_memory(&mut h, &c, taker)?;
    if let Some(a) = &c.inflight {
        let file = taker.take(a.fd)?;
        let req = VhostUserInflight {
            mmap_size: a.mmap_size,
            mmap_offset: a.mmap_offset,
            num_queues: a.num_queues,
            queue_size: a.queue_size,
        };
        h.install_inflight(&req, file)
            .map_err(StateError::Inflight)?;
    }
    if let Some(l) = &c.log {
        let file = taker.take(l.fd)?;
        let req = VhostUserLog {
            mmap_size: l.mmap_size,
            mmap_offset: l.mmap_offset,
        };
        h.install_log(&req, file).map_err(StateError::Log)?;
    }
    if let Some(i) = c.backend_req {
        let s = crate::channel::stream_socket(OwnedFd::from(taker.take(i)?))
            .ok_or(StateError::NotSocket("backend request channel"))?;
        *lock(&h.conn.backend_req) = Some(s);
    }
    for w in &c.config {
        shared
            .cfg
            .write(w.offset, &w.data)
            .map_err(|_| StateError::Range("a config space write"))?;
    }
    h.config = c.config.clone();
    for (index, v) in c.vrings.iter().enumerate() {
        restore_vring(&h, index, v, taker)?;
    }
    drop(h);
    Ok(est)
}

fn restore_memory(
    h: &mut Handler,
    c: &ConnectionState,
    taker: &mut FdTaker,
) -> Result<(), StateError> {
    let mut table = Vec::with_capacity(c.mem.len());
    let mut files = Vec::with_capacity(c.mem.len());
    for r in &c.mem {
        table.push(Mapping {
            gpa: r.guest_phys_addr,
            size: r.memory_size,
            uaddr: r.userspace_addr,
            offset: r.mmap_offset,
        });
        files.push(taker.take(r.fd)?);
    }
    if !table.is_empty() {
        let gpa = table[0].gpa;
        memory::set_table(&h.conn.mem, &h.conn.guarded, &table, files)
            .map_err(|source| StateError::Memory { gpa, source })?;
    }
    h.table = table;
    Ok(())
}

fn restore_vring(
    h: &Handler,
    index: usize,
    v: &VringRecord,
    taker: &mut FdTaker,
) -> Result<(), StateError> {
    let bad = |what| StateError::Vring { index, what };
    let index32 = u32::try_from(index).map_err(|_| bad("index"))?;
    if let Some(a) = v.addr {
        h.set_addrs(index32, a)
            .map_err(|_| bad("addresses outside the memory table"))?;
    }
    let kick = taker.take_opt(v.kick)?;
    let call = taker.take_opt(v.call)?;
    let err = taker.take_opt(v.err)?;
    let mut st = lock(&h.conn.vrings[index]);
    st.queue.set_size(v.num);
    st.queue.set_next_avail(v.base);
    st.kick = kick;
    st.call = call;
    st.err = err;
    st.enabled = v.enabled;
    if v.started {
        // Nothing was in flight: the guest's used ring is where the old device
        // stopped taking chains.
        let mem = h.conn.mem.memory();
        let used = st
            .queue
            .used_idx(&*mem, Ordering::Acquire)
            .map_err(|_| bad("used ring unreadable"))?
            .0;
        if used != v.base {
            return Err(StateError::UsedIndex {
                index,
                base: v.base,
                used,
            });
        }
        st.queue.set_next_used(used);
        // `is_valid` looks at a ready queue only.
        st.queue.set_ready(true);
        if !st.queue.is_valid(&*mem) {
            st.queue.set_ready(false);
            return Err(bad("rings outside guest memory"));
        }
    }
    h.update_kick(index, &st)
        .map_err(|_| bad("cannot watch its kick eventfd"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fd() -> OwnedFd {
        OwnedFd::from(File::open("/dev/null").unwrap())
    }

    fn vring() -> VringRecord {
        VringRecord {
            num: 128,
            addr: Some(VringAddr::default()),
            base: 0,
            kick: Some(1),
            call: None,
            err: None,
            enabled: true,
            started: true,
        }
    }

    fn conn() -> ConnectionState {
        ConnectionState {
            front_fd: 0,
            owner: true,
            features: Some(1 << 30),
            protocol_features: Some(0),
            mem: Vec::new(),
            inflight: None,
            log: None,
            backend_req: None,
            config: Vec::new(),
            vrings: vec![vring()],
        }
    }

    #[test]
    fn fd_indices_are_used_once_and_all() {
        let mut t = FdTaker::new(vec![fd()]);
        assert!(matches!(
            t.take(1),
            Err(StateError::FdIndex { index: 1, count: 1 })
        ));
        assert!(t.take(0).is_ok());
        assert!(matches!(t.take(0), Err(StateError::FdTwice(0))));
        t.finish().unwrap();
        assert!(matches!(
            FdTaker::new(vec![fd()]).finish(),
            Err(StateError::FdsLeft(1))
        ));
    }

    #[test]
    fn hostile_states_are_bounded() {
        validate(&conn(), 1, 256).unwrap();
        let refused = |f: &dyn Fn(&mut ConnectionState)| {
            let mut c = conn();
            f(&mut c);
            validate(&c, 1, 256).is_err()
        };
        assert!(refused(&|c| c.vrings[0].num = 0));
        assert!(refused(&|c| c.vrings[0].num = 512));
        assert!(refused(&|c| c.vrings.push(vring())));
        assert!(refused(&|c| c.vrings[0].kick = None));
        assert!(refused(&|c| c.vrings[0].addr = None));
        assert!(refused(&|c| c.config = vec![
            ConfigWrite {
                offset: 0,
                flags: 0,
                data: vec![0; 300]
            };
            1
        ]));
        assert!(refused(&|c| {
            c.mem = (0..=MAX_MEM_SLOTS as u64)
                .map(|i| MemRegion {
                    guest_phys_addr: i << 20,
                    memory_size: 1 << 20,
                    userspace_addr: 0,
                    mmap_offset: 0,
                    fd: 0,
                })
                .collect()
        }));
    }
}
