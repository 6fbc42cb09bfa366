//! Live handover of a connected front end to a device in another process (issue 15,
//! docs/decisions/0024-vhost-user-handover.md).
//!
//! The relay (`proxy.rs`) keeps a [`Journal`] of the connection as its messages pass:
//! the state-setting requests, reduced to the latest that matters per request and
//! vring, with copies of their file descriptors. A handover exports it as a
//! [`HandoverState`] (serde, versioned; descriptors replaced by indices into a list
//! of fds passed beside it), and the new device replays it to its own
//! vhost-user-backend handler ([`replay_messages`]) before relaying the real socket
//! from where the old device stopped reading it.
//!
//! The state crosses a process boundary and is checked like client input:
//! [`ConnRecord::validate`] bounds every count, size and index, and every fd index
//! must be used exactly once.

use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;

use serde::{Deserialize, Serialize};

/// Format of [`HandoverState`]; a device refuses any other.
pub const HANDOVER_VERSION: u32 = 1;

// vhost-user front-end request codes.
pub(crate) const GET_FEATURES: u32 = 1;
pub(crate) const SET_FEATURES: u32 = 2;
pub(crate) const SET_OWNER: u32 = 3;
pub(crate) const RESET_OWNER: u32 = 4;
pub(crate) const SET_MEM_TABLE: u32 = 5;
const SET_LOG_BASE: u32 = 6;
const SET_LOG_FD: u32 = 7;
pub(crate) const SET_VRING_NUM: u32 = 8;
pub(crate) const SET_VRING_ADDR: u32 = 9;
pub(crate) const SET_VRING_BASE: u32 = 10;
pub(crate) const GET_VRING_BASE: u32 = 11;
pub(crate) const SET_VRING_KICK: u32 = 12;
pub(crate) const SET_VRING_CALL: u32 = 13;
pub(crate) const SET_VRING_ERR: u32 = 14;
pub(crate) const GET_PROTOCOL_FEATURES: u32 = 15;
pub(crate) const SET_PROTOCOL_FEATURES: u32 = 16;
pub(crate) const SET_VRING_ENABLE: u32 = 18;
pub(crate) const SET_BACKEND_REQ_FD: u32 = 21;
const IOTLB_MSG: u32 = 22;
const SET_VRING_ENDIAN: u32 = 23;
pub(crate) const SET_CONFIG: u32 = 25;
pub(crate) const SET_INFLIGHT_FD: u32 = 32;
const GPU_SET_SOCKET: u32 = 33;
const RESET_DEVICE: u32 = 34;
pub(crate) const ADD_MEM_REG: u32 = 37;
pub(crate) const REM_MEM_REG: u32 = 38;
const SET_STATUS: u32 = 39;
const SET_DEVICE_STATE_FD: u32 = 42;

/// VHOST_USER_F_PROTOCOL_FEATURES (virtio feature bit 30).
pub(crate) const F_PROTOCOL_FEATURES: u64 = 1 << 30;
/// VHOST_USER_PROTOCOL_F_REPLY_ACK.
pub(crate) const PF_REPLY_ACK: u64 = 1 << 3;
/// Bit of a SET_VRING_KICK/CALL/ERR payload: no descriptor attached.
const VRING_NOFD: u64 = 0x100;
const REGION_LEN: usize = 32;
const VRING_ADDR_LEN: usize = 40;
const INFLIGHT_LEN: usize = 24;

/// Bounds on an imported state (the handler and the relay enforce the same on the
/// live socket: 509 memory slots in vhost-user-backend, 8 regions in a
/// SET_MEM_TABLE, a 256-byte config space of which one byte is writable).
const MAX_REGIONS: usize = 512;
const MAX_TABLE_REGIONS: usize = 8;
const MAX_CONFIG_WRITES: usize = 16;
const MAX_CONFIG_LEN: usize = 256;
/// The split ring's largest size.
const MAX_QUEUE_SIZE: u32 = 32768;

/// What a device exports to hand its front end over to another device.
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
    /// The connected front end, if one is.
    pub connection: Option<ConnectionState>,
}

/// A connected front end: its socket and what it has set up so far.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ConnectionState {
    /// Index in the fd list of the front end's socket.
    pub front_fd: usize,
    /// Its setup; each vring's `base` is the index the old device stopped at.
    pub record: ConnRecord<usize>,
}

/// The state a front end set on a connection, as the handler holds it: the
/// latest value per request and vring. `F` is a file descriptor: a `File` while
/// recorded, an index into the fd list in a [`HandoverState`].
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ConnRecord<F> {
    /// GET_FEATURES was asked (vhost-user-backend turns REPLY_ACK on only after it).
    pub got_features: bool,
    /// SET_OWNER (since the last RESET_OWNER).
    pub owner: bool,
    /// SET_FEATURES.
    pub features: Option<u64>,
    /// SET_PROTOCOL_FEATURES.
    pub protocol_features: Option<u64>,
    /// The memory table was changed with ADD_MEM_REG/REM_MEM_REG (replayed that way).
    pub mem_slots: bool,
    /// The current memory table.
    pub mem: Vec<MemRegion<F>>,
    /// SET_INFLIGHT_FD (answered by the relay).
    pub inflight: Option<InflightArea<F>>,
    /// SET_BACKEND_REQ_FD (answered by the relay).
    pub backend_req: Option<F>,
    /// SET_CONFIG writes, the latest per offset and size, in order.
    pub config: Vec<ConfigWrite>,
    /// Per vring, in queue order.
    pub vrings: Vec<VringRecord<F>>,
}

impl<F> Default for ConnRecord<F> {
    fn default() -> Self {
        ConnRecord {
            got_features: false,
            owner: false,
            features: None,
            protocol_features: None,
            mem_slots: false,
            mem: Vec::new(),
            inflight: None,
            backend_req: None,
            config: Vec::new(),
            vrings: Vec::new(),
        }
    }
}

/// One memory region (`VhostUserMemoryRegion`) and its file.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct MemRegion<F> {
    pub guest_phys_addr: u64,
    pub memory_size: u64,
    pub userspace_addr: u64,
    pub mmap_offset: u64,
    pub fd: F,
}

/// The inflight area (`VhostUserInflight`) and its file.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct InflightArea<F> {
    pub mmap_size: u64,
    pub mmap_offset: u64,
    pub num_queues: u16,
    pub queue_size: u16,
    pub fd: F,
}

/// One SET_CONFIG.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ConfigWrite {
    pub offset: u32,
    pub flags: u32,
    pub data: Vec<u8>,
}

/// SET_VRING_ADDR's payload.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct VringAddr {
    pub flags: u32,
    pub desc: u64,
    pub used: u64,
    pub avail: u64,
    pub log: u64,
}

/// An eventfd argument: a descriptor, or none (the NOFD bit: polling).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub enum EventArg<F> {
    Fd(F),
    NoFd,
}

/// One vring's setup.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct VringRecord<F> {
    pub num: Option<u32>,
    pub addr: Option<VringAddr>,
    /// SET_VRING_BASE; in an export, where the old device stopped taking chains.
    pub base: Option<u32>,
    pub kick: Option<EventArg<F>>,
    pub call: Option<EventArg<F>>,
    pub err: Option<EventArg<F>>,
    /// SET_VRING_ENABLE (or SET_FEATURES without PROTOCOL_FEATURES).
    pub enabled: bool,
    /// Started: a kick descriptor arrived since the last GET_VRING_BASE.
    pub ready: bool,
}

impl<F> Default for VringRecord<F> {
    fn default() -> Self {
        VringRecord {
            num: None,
            addr: None,
            base: None,
            kick: None,
            call: None,
            err: None,
            enabled: false,
            ready: false,
        }
    }
}

impl<F> VringRecord<F> {
    /// Whether vhost-user-backend polls its kick eventfd now (started and enabled).
    pub fn kicked(&self) -> bool {
        self.ready && self.enabled && matches!(self.kick, Some(EventArg::Fd(_)))
    }
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

fn u32_at(b: &[u8], o: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(o..o + 4)?.try_into().ok()?))
}

fn u64_at(b: &[u8], o: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(o..o + 8)?.try_into().ok()?))
}

fn region_at<F>(b: &[u8], o: usize, fd: F) -> Option<MemRegion<F>> {
    Some(MemRegion {
        guest_phys_addr: u64_at(b, o)?,
        memory_size: u64_at(b, o + 8)?,
        userspace_addr: u64_at(b, o + 16)?,
        mmap_offset: u64_at(b, o + 24)?,
        fd,
    })
}

fn put_region<F>(out: &mut Vec<u8>, r: &MemRegion<F>) {
    for v in [
        r.guest_phys_addr,
        r.memory_size,
        r.userspace_addr,
        r.mmap_offset,
    ] {
        out.extend_from_slice(&v.to_le_bytes());
    }
}

/// The relay's record of one connection: [`ConnRecord`] with its descriptors, and
/// why it cannot be handed over, if it cannot.
#[derive(Debug)]
pub(crate) struct Journal {
    pub rec: ConnRecord<File>,
    /// A request we cannot reproduce was seen (or a descriptor could not be kept).
    pub unsupported: Option<String>,
}

impl Journal {
    pub fn new(num_queues: usize) -> Journal {
        let mut rec = ConnRecord::default();
        rec.vrings.resize_with(num_queues, VringRecord::default);
        Journal {
            rec,
            unsupported: None,
        }
    }

    fn keep(&mut self, files: &[File]) -> Option<File> {
        match files.first().map(File::try_clone) {
            Some(Ok(f)) => Some(f),
            Some(Err(e)) => {
                self.unsupported = Some(format!("cannot keep a copy of a descriptor: {e}"));
                None
            }
            None => None,
        }
    }

    fn vring(&mut self, index: u64) -> Option<&mut VringRecord<File>> {
        self.rec.vrings.get_mut(usize::try_from(index).ok()?)
    }

    /// Notes a request the handler (or the relay, for SET_INFLIGHT_FD and
    /// SET_BACKEND_REQ_FD) accepted, mirroring what vhost-user-backend 0.24 does
    /// with it. Malformed bodies are skipped: the handler ends such a connection.
    pub fn record(&mut self, req: u32, body: &[u8], files: &[File]) {
        match req {
            GET_FEATURES => self.rec.got_features = true,
            SET_OWNER => self.rec.owner = true,
            RESET_OWNER => {
                self.rec.owner = false;
                self.rec.features = None;
                self.rec.protocol_features = None;
            }
            SET_FEATURES => {
                if let Some(v) = u64_at(body, 0) {
                    self.rec.features = Some(v);
                    if v & F_PROTOCOL_FEATURES == 0 {
                        for r in &mut self.rec.vrings {
                            r.enabled = true;
                        }
                    }
                }
            }
            SET_PROTOCOL_FEATURES => {
                if let Some(v) = u64_at(body, 0) {
                    self.rec.protocol_features = Some(v);
                }
            }
            SET_MEM_TABLE => {
                let n = u32_at(body, 0).unwrap_or(0) as usize;
                let mut mem = Vec::with_capacity(n.min(MAX_TABLE_REGIONS));
                for (i, f) in files.iter().enumerate().take(n) {
                    let Some(fd) = self.keep(std::slice::from_ref(f)) else {
                        return;
                    };
                    match region_at(body, 8 + i * REGION_LEN, fd) {
                        Some(r) => mem.push(r),
                        None => return,
                    }
                }
                self.rec.mem = mem;
                self.rec.mem_slots = false;
            }
            ADD_MEM_REG => {
                if let Some(fd) = self.keep(files) {
                    if let Some(r) = region_at(body, 8, fd) {
                        self.rec.mem.push(r);
                        self.rec.mem_slots = true;
                    }
                }
            }
            REM_MEM_REG => {
                if let Some(r) = region_at(body, 8, ()) {
                    self.rec
                        .mem
                        .retain(|m| m.guest_phys_addr != r.guest_phys_addr);
                    self.rec.mem_slots = true;
                }
            }
            SET_VRING_NUM | SET_VRING_BASE | SET_VRING_ENABLE | GET_VRING_BASE => {
                let (Some(i), Some(v)) = (u32_at(body, 0), u32_at(body, 4)) else {
                    return;
                };
                let Some(r) = self.vring(u64::from(i)) else {
                    return;
                };
                match req {
                    SET_VRING_NUM => r.num = Some(v),
                    SET_VRING_BASE => r.base = Some(v),
                    SET_VRING_ENABLE => r.enabled = v == 1,
                    _ => {
                        // Stops the ring; vhost-user-backend drops kick and call.
                        r.ready = false;
                        r.kick = None;
                        r.call = None;
                    }
                }
            }
            SET_VRING_ADDR => {
                let (Some(i), Some(flags), Some(desc), Some(used), Some(avail), Some(log)) = (
                    u32_at(body, 0),
                    u32_at(body, 4),
                    u64_at(body, 8),
                    u64_at(body, 16),
                    u64_at(body, 24),
                    u64_at(body, 32),
                ) else {
                    return;
                };
                if let Some(r) = self.vring(u64::from(i)) {
                    r.addr = Some(VringAddr {
                        flags,
                        desc,
                        used,
                        avail,
                        log,
                    });
                }
            }
            SET_VRING_KICK | SET_VRING_CALL | SET_VRING_ERR => {
                let Some(v) = u64_at(body, 0) else {
                    return;
                };
                let arg = if v & VRING_NOFD != 0 {
                    EventArg::NoFd
                } else {
                    match self.keep(files) {
                        Some(f) => EventArg::Fd(f),
                        None => return,
                    }
                };
                let Some(r) = self.vring(v & 0xff) else {
                    return;
                };
                match req {
                    SET_VRING_KICK => r.kick = Some(arg),
                    SET_VRING_CALL => r.call = Some(arg),
                    _ => r.err = Some(arg),
                }
                // vhost-user-backend starts a ring once it has a kick eventfd.
                if req != SET_VRING_ERR && matches!(r.kick, Some(EventArg::Fd(_))) {
                    r.ready = true;
                }
            }
            SET_CONFIG => {
                let (Some(offset), Some(size), Some(flags)) =
                    (u32_at(body, 0), u32_at(body, 4), u32_at(body, 8))
                else {
                    return;
                };
                let Some(data) = body.get(12..12 + size as usize) else {
                    return;
                };
                self.rec
                    .config
                    .retain(|c| !(c.offset == offset && c.data.len() == data.len()));
                if self.rec.config.len() >= MAX_CONFIG_WRITES {
                    self.unsupported = Some("too many distinct config space writes".into());
                    return;
                }
                self.rec.config.push(ConfigWrite {
                    offset,
                    flags,
                    data: data.to_vec(),
                });
            }
            SET_INFLIGHT_FD => {
                let (Some(mmap_size), Some(mmap_offset), Some(q)) =
                    (u64_at(body, 0), u64_at(body, 8), u32_at(body, 16))
                else {
                    return;
                };
                self.rec.inflight = self.keep(files).map(|fd| InflightArea {
                    mmap_size,
                    mmap_offset,
                    num_queues: (q & 0xffff) as u16,
                    queue_size: (q >> 16) as u16,
                    fd,
                });
            }
            SET_BACKEND_REQ_FD => self.rec.backend_req = self.keep(files),
            SET_LOG_BASE
            | SET_LOG_FD
            | IOTLB_MSG
            | SET_VRING_ENDIAN
            | GPU_SET_SOCKET
            | RESET_DEVICE
            | SET_STATUS
            | SET_DEVICE_STATE_FD
            | 28..=30 => {
                // Not offered (dirty logging, IOMMU, status, device state,
                // postcopy): we do not know how to reproduce them.
                self.unsupported = Some(format!(
                    "the front end sent vhost-user request {req}, which a handover cannot reproduce"
                ));
            }
            _ => {}
        }
    }

    /// The vrings whose kicks the handler polls now, to be disabled while the device
    /// is quiesced (so that only one process reads each kick eventfd). Fails if
    /// they cannot be: SET_VRING_ENABLE needs PROTOCOL_FEATURES.
    pub fn kicked_vrings(&self) -> io::Result<Vec<u32>> {
        let kicked: Vec<u32> = (0u32..)
            .zip(&self.rec.vrings)
            .filter(|(_, r)| r.kicked())
            .map(|(i, _)| i)
            .collect();
        let pf = self
            .rec
            .features
            .is_some_and(|f| f & F_PROTOCOL_FEATURES != 0);
        if !kicked.is_empty() && !pf {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "the front end did not negotiate VHOST_USER_F_PROTOCOL_FEATURES: its running \
                 vrings cannot be disabled for a handover",
            ));
        }
        Ok(kicked)
    }
}

impl<F> ConnRecord<F> {
    /// The same record with each descriptor mapped by `f`, in field order.
    pub fn map_fds<G>(self, f: &mut dyn FnMut(F) -> io::Result<G>) -> io::Result<ConnRecord<G>> {
        let mut ev = |a: Option<EventArg<F>>| -> io::Result<Option<EventArg<G>>> {
            Ok(match a {
                Some(EventArg::Fd(x)) => Some(EventArg::Fd(f(x)?)),
                Some(EventArg::NoFd) => Some(EventArg::NoFd),
                None => None,
            })
        };
        let mut vrings = Vec::with_capacity(self.vrings.len());
        for v in self.vrings {
            vrings.push(VringRecord {
                num: v.num,
                addr: v.addr,
                base: v.base,
                kick: ev(v.kick)?,
                call: ev(v.call)?,
                err: ev(v.err)?,
                enabled: v.enabled,
                ready: v.ready,
            });
        }
        let mut mem = Vec::with_capacity(self.mem.len());
        for r in self.mem {
            mem.push(MemRegion {
                guest_phys_addr: r.guest_phys_addr,
                memory_size: r.memory_size,
                userspace_addr: r.userspace_addr,
                mmap_offset: r.mmap_offset,
                fd: f(r.fd)?,
            });
        }
        let inflight = match self.inflight {
            Some(a) => Some(InflightArea {
                mmap_size: a.mmap_size,
                mmap_offset: a.mmap_offset,
                num_queues: a.num_queues,
                queue_size: a.queue_size,
                fd: f(a.fd)?,
            }),
            None => None,
        };
        let backend_req = match self.backend_req {
            Some(x) => Some(f(x)?),
            None => None,
        };
        Ok(ConnRecord {
            got_features: self.got_features,
            owner: self.owner,
            features: self.features,
            protocol_features: self.protocol_features,
            mem_slots: self.mem_slots,
            mem,
            inflight,
            backend_req,
            config: self.config,
            vrings,
        })
    }
}

impl ConnRecord<File> {
    /// Duplicates the record's descriptors into `fds` (an export).
    pub fn export(&self, fds: &mut Vec<OwnedFd>) -> io::Result<ConnRecord<usize>> {
        let copy = ConnRecord {
            got_features: self.got_features,
            owner: self.owner,
            features: self.features,
            protocol_features: self.protocol_features,
            mem_slots: self.mem_slots,
            mem: self
                .mem
                .iter()
                .map(|r| MemRegion {
                    guest_phys_addr: r.guest_phys_addr,
                    memory_size: r.memory_size,
                    userspace_addr: r.userspace_addr,
                    mmap_offset: r.mmap_offset,
                    fd: &r.fd,
                })
                .collect(),
            inflight: self.inflight.as_ref().map(|a| InflightArea {
                mmap_size: a.mmap_size,
                mmap_offset: a.mmap_offset,
                num_queues: a.num_queues,
                queue_size: a.queue_size,
                fd: &a.fd,
            }),
            backend_req: self.backend_req.as_ref(),
            config: self.config.clone(),
            vrings: self
                .vrings
                .iter()
                .map(|v| {
                    fn ev(a: &Option<EventArg<File>>) -> Option<EventArg<&File>> {
                        match a {
                            Some(EventArg::Fd(f)) => Some(EventArg::Fd(f)),
                            Some(EventArg::NoFd) => Some(EventArg::NoFd),
                            None => None,
                        }
                    }
                    VringRecord {
                        num: v.num,
                        addr: v.addr.clone(),
                        base: v.base,
                        kick: ev(&v.kick),
                        call: ev(&v.call),
                        err: ev(&v.err),
                        enabled: v.enabled,
                        ready: v.ready,
                    }
                })
                .collect(),
        };
        copy.map_fds(&mut |f: &File| {
            fds.push(OwnedFd::from(f.try_clone()?));
            Ok(fds.len() - 1)
        })
    }
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

    pub fn take(&mut self, i: usize) -> io::Result<File> {
        let n = self.fds.len();
        self.fds
            .get_mut(i)
            .ok_or_else(|| invalid(format!("fd index {i} beyond the {n} fds handed over")))?
            .take()
            .map(File::from)
            .ok_or_else(|| invalid(format!("fd index {i} used twice")))
    }

    /// Fails if an fd was handed over that the state does not use.
    pub fn finish(self) -> io::Result<()> {
        let left = self.fds.iter().filter(|f| f.is_some()).count();
        if left != 0 {
            return Err(invalid(format!(
                "{left} fds handed over that the state does not account for"
            )));
        }
        Ok(())
    }
}

impl ConnRecord<usize> {
    /// Checks an imported record against the device that is to take it over.
    pub fn validate(&self, num_queues: u16, queue_size: u16) -> io::Result<()> {
        if self.vrings.len() != usize::from(num_queues) {
            return Err(invalid(format!(
                "the state has {} vrings, the device {num_queues}",
                self.vrings.len()
            )));
        }
        if self.mem.len() > MAX_REGIONS || (!self.mem_slots && self.mem.len() > MAX_TABLE_REGIONS) {
            return Err(invalid(format!(
                "{} memory regions are more than a front end can set",
                self.mem.len()
            )));
        }
        if self.config.len() > MAX_CONFIG_WRITES
            || self.config.iter().any(|c| c.data.len() > MAX_CONFIG_LEN)
        {
            return Err(invalid("config space writes out of range".into()));
        }
        for (i, v) in self.vrings.iter().enumerate() {
            if let Some(n) = v.num {
                if n == 0 || n > u32::from(queue_size) || n > MAX_QUEUE_SIZE {
                    return Err(invalid(format!(
                        "vring {i}: size {n} out of range (1-{queue_size})"
                    )));
                }
            }
            if let Some(b) = v.base {
                if b > u32::from(u16::MAX) {
                    return Err(invalid(format!("vring {i}: index {b} is not a ring index")));
                }
            }
            if v.ready && !matches!(v.kick, Some(EventArg::Fd(_))) {
                return Err(invalid(format!(
                    "vring {i}: started without a kick eventfd"
                )));
            }
            if v.ready && (v.num.is_none() || v.addr.is_none() || v.base.is_none()) {
                return Err(invalid(format!(
                    "vring {i}: started without a size, addresses or an index"
                )));
            }
        }
        Ok(())
    }
}

/// A message to replay: request, payload, descriptors.
pub(crate) struct Replay {
    pub req: u32,
    pub body: Vec<u8>,
    pub files: Vec<File>,
}

fn msg(req: u32, body: Vec<u8>, files: Vec<File>) -> Replay {
    Replay { req, body, files }
}

fn u64_body(v: u64) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

fn state_body(index: usize, num: u32) -> Vec<u8> {
    let mut b = (index as u32).to_le_bytes().to_vec();
    b.extend_from_slice(&num.to_le_bytes());
    b
}

/// The requests that rebuild `rec` on a fresh handler, in an order it accepts:
/// features, memory, the relay's own channels, config, then each vring (size,
/// addresses, index, call, err, kick — the kick starts it) and its enable state.
pub(crate) fn replay_messages(rec: ConnRecord<File>) -> io::Result<Vec<Replay>> {
    let mut out = Vec::new();
    if rec.got_features {
        out.push(msg(GET_FEATURES, Vec::new(), Vec::new()));
    }
    if let Some(pf) = rec.protocol_features {
        out.push(msg(SET_PROTOCOL_FEATURES, u64_body(pf), Vec::new()));
    }
    if rec.owner {
        out.push(msg(SET_OWNER, Vec::new(), Vec::new()));
    }
    let pf_acked = rec.features.is_some_and(|f| f & F_PROTOCOL_FEATURES != 0);
    if let Some(f) = rec.features {
        out.push(msg(SET_FEATURES, u64_body(f), Vec::new()));
    }
    // What the handler's enable flags are after the messages above.
    let enabled_by_features = rec.features.is_some() && !pf_acked;
    if rec.mem_slots {
        for r in rec.mem {
            let mut b = vec![0u8; 8];
            put_region(&mut b, &r);
            out.push(msg(ADD_MEM_REG, b, vec![r.fd]));
        }
    } else if !rec.mem.is_empty() {
        let mut b = (rec.mem.len() as u32).to_le_bytes().to_vec();
        b.extend_from_slice(&[0u8; 4]);
        let mut files = Vec::with_capacity(rec.mem.len());
        for r in rec.mem {
            put_region(&mut b, &r);
            files.push(r.fd);
        }
        out.push(msg(SET_MEM_TABLE, b, files));
    }
    if let Some(f) = rec.backend_req {
        out.push(msg(SET_BACKEND_REQ_FD, Vec::new(), vec![f]));
    }
    if let Some(a) = rec.inflight {
        let mut b = vec![0u8; INFLIGHT_LEN];
        b[0..8].copy_from_slice(&a.mmap_size.to_le_bytes());
        b[8..16].copy_from_slice(&a.mmap_offset.to_le_bytes());
        b[16..18].copy_from_slice(&a.num_queues.to_le_bytes());
        b[18..20].copy_from_slice(&a.queue_size.to_le_bytes());
        out.push(msg(SET_INFLIGHT_FD, b, vec![a.fd]));
    }
    for c in rec.config {
        let mut b = c.offset.to_le_bytes().to_vec();
        b.extend_from_slice(&(c.data.len() as u32).to_le_bytes());
        b.extend_from_slice(&c.flags.to_le_bytes());
        b.extend_from_slice(&c.data);
        out.push(msg(SET_CONFIG, b, Vec::new()));
    }
    let mut enables = Vec::new();
    for (i, v) in rec.vrings.into_iter().enumerate() {
        if let Some(n) = v.num {
            out.push(msg(SET_VRING_NUM, state_body(i, n), Vec::new()));
        }
        if let Some(a) = v.addr {
            let mut b = Vec::with_capacity(VRING_ADDR_LEN);
            b.extend_from_slice(&(i as u32).to_le_bytes());
            b.extend_from_slice(&a.flags.to_le_bytes());
            for x in [a.desc, a.used, a.avail, a.log] {
                b.extend_from_slice(&x.to_le_bytes());
            }
            out.push(msg(SET_VRING_ADDR, b, Vec::new()));
        }
        if let Some(base) = v.base {
            out.push(msg(SET_VRING_BASE, state_body(i, base), Vec::new()));
        }
        for (req, arg) in [
            (SET_VRING_CALL, v.call),
            (SET_VRING_ERR, v.err),
            (SET_VRING_KICK, v.kick),
        ] {
            match arg {
                Some(EventArg::Fd(f)) => out.push(msg(req, u64_body(i as u64), vec![f])),
                Some(EventArg::NoFd) => {
                    out.push(msg(req, u64_body(i as u64 | VRING_NOFD), Vec::new()))
                }
                None => {}
            }
        }
        if v.enabled != enabled_by_features {
            if !pf_acked {
                return Err(invalid(format!(
                    "vring {i}: its enable state cannot be set without PROTOCOL_FEATURES"
                )));
            }
            enables.push(msg(
                SET_VRING_ENABLE,
                state_body(i, u32::from(v.enabled)),
                Vec::new(),
            ));
        }
    }
    out.extend(enables);
    Ok(out)
}

/// Whether vhost-user-backend's handler answers `req` with NEED_REPLY set, given
/// what it has seen: acks need REPLY_ACK negotiated and the features read once.
pub(crate) struct ReplyAck {
    got_features: bool,
    protocol: u64,
}

impl ReplyAck {
    pub fn new() -> ReplyAck {
        ReplyAck {
            got_features: false,
            protocol: 0,
        }
    }

    /// Notes `req` (with `body`) as the handler will have processed it, and says
    /// whether it will ack it.
    pub fn on(&mut self, req: u32, body: &[u8]) -> bool {
        match req {
            GET_FEATURES => self.got_features = true,
            SET_PROTOCOL_FEATURES => self.protocol = u64_at(body, 0).unwrap_or(0),
            _ => {}
        }
        self.got_features && self.protocol & PF_REPLY_ACK != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file() -> File {
        File::open("/dev/null").unwrap()
    }

    fn state(i: u32, n: u32) -> Vec<u8> {
        let mut b = i.to_le_bytes().to_vec();
        b.extend_from_slice(&n.to_le_bytes());
        b
    }

    fn region(gpa: u64, size: u64) -> Vec<u8> {
        let mut b = Vec::new();
        for v in [gpa, size, 0x7f00_0000_0000 + gpa, 0] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b
    }

    /// A front end's usual setup of two vrings, as QEMU sends it.
    fn set_up(j: &mut Journal) {
        j.record(GET_FEATURES, &[], &[]);
        j.record(SET_OWNER, &[], &[]);
        j.record(
            SET_FEATURES,
            &((1u64 << 32) | F_PROTOCOL_FEATURES).to_le_bytes(),
            &[],
        );
        j.record(SET_PROTOCOL_FEATURES, &PF_REPLY_ACK.to_le_bytes(), &[]);
        let mut t = 1u32.to_le_bytes().to_vec();
        t.extend_from_slice(&[0; 4]);
        t.extend_from_slice(&region(0, 1 << 20));
        j.record(SET_MEM_TABLE, &t, &[file()]);
        for i in 0..2u32 {
            j.record(SET_VRING_NUM, &state(i, 128), &[]);
            let mut a = i.to_le_bytes().to_vec();
            a.extend_from_slice(&[0; 4]);
            for v in [0x1000u64, 0x2000, 0x3000, 0] {
                a.extend_from_slice(&v.to_le_bytes());
            }
            j.record(SET_VRING_ADDR, &a, &[]);
            j.record(SET_VRING_BASE, &state(i, 0), &[]);
            j.record(SET_VRING_CALL, &u64::from(i).to_le_bytes(), &[file()]);
            j.record(SET_VRING_KICK, &u64::from(i).to_le_bytes(), &[file()]);
            j.record(SET_VRING_ENABLE, &state(i, 1), &[]);
        }
    }

    #[test]
    fn journal_mirrors_the_handler() {
        let mut j = Journal::new(2);
        set_up(&mut j);
        assert!(j.rec.vrings.iter().all(|v| v.kicked()));
        assert_eq!(j.kicked_vrings().unwrap(), vec![0, 1]);
        // GET_VRING_BASE stops a ring and drops its kick and call.
        j.record(GET_VRING_BASE, &state(1, 0), &[]);
        let v = &j.rec.vrings[1];
        assert!(!v.ready && v.kick.is_none() && v.call.is_none() && v.base == Some(0));
        assert_eq!(j.kicked_vrings().unwrap(), vec![0]);
        // Indices beyond the device are not recorded (the handler refuses them).
        j.record(SET_VRING_NUM, &state(7, 16), &[]);
        j.record(SET_VRING_KICK, &7u64.to_le_bytes(), &[file()]);
        assert_eq!(j.rec.vrings.len(), 2);
        // Memory slots: add, remove.
        let mut add = vec![0u8; 8];
        add.extend_from_slice(&region(1 << 30, 4096));
        j.record(ADD_MEM_REG, &add, &[file()]);
        assert_eq!(j.rec.mem.len(), 2);
        j.record(REM_MEM_REG, &add, &[]);
        assert_eq!(j.rec.mem.len(), 1);
        assert!(j.rec.mem_slots);
        // Config writes: the latest per offset and size.
        for v in [0u8, 1] {
            let mut c = 32u32.to_le_bytes().to_vec();
            c.extend_from_slice(&1u32.to_le_bytes());
            c.extend_from_slice(&0u32.to_le_bytes());
            c.push(v);
            j.record(SET_CONFIG, &c, &[]);
        }
        assert_eq!(j.rec.config.len(), 1);
        assert_eq!(j.rec.config[0].data, vec![1]);
        // Short bodies are skipped, not a panic.
        for req in 0..64 {
            j.record(req, &[1, 2, 3], &[]);
        }
        // Requests we cannot reproduce make the connection unexportable.
        assert!(j.unsupported.is_some());
        // Without PROTOCOL_FEATURES the rings are enabled and cannot be stopped.
        let mut j = Journal::new(1);
        j.record(SET_FEATURES, &(1u64 << 32).to_le_bytes(), &[]);
        assert!(j.rec.vrings[0].enabled);
        j.record(SET_VRING_KICK, &0u64.to_le_bytes(), &[file()]);
        j.rec.vrings[0].ready = true;
        assert!(j.kicked_vrings().is_err());
    }

    #[test]
    fn replay_rebuilds_the_setup_in_order() {
        let mut j = Journal::new(2);
        set_up(&mut j);
        let mut fds = Vec::new();
        let mut exported = j.rec.export(&mut fds).unwrap();
        assert_eq!(fds.len(), 5);
        exported.vrings[0].base = Some(77);
        exported.validate(2, 256).unwrap();
        // Through JSON, as between processes.
        let json = serde_json::to_string(&exported).unwrap();
        let back: ConnRecord<usize> = serde_json::from_str(&json).unwrap();
        assert_eq!(back, exported);
        let mut taker = FdTaker::new(fds);
        let rec = back.map_fds(&mut |i| taker.take(i)).unwrap();
        taker.finish().unwrap();
        let msgs = replay_messages(rec).unwrap();
        let reqs: Vec<u32> = msgs.iter().map(|m| m.req).collect();
        assert_eq!(
            reqs,
            vec![
                GET_FEATURES,
                SET_PROTOCOL_FEATURES,
                SET_OWNER,
                SET_FEATURES,
                SET_MEM_TABLE,
                SET_VRING_NUM,
                SET_VRING_ADDR,
                SET_VRING_BASE,
                SET_VRING_CALL,
                SET_VRING_KICK,
                SET_VRING_NUM,
                SET_VRING_ADDR,
                SET_VRING_BASE,
                SET_VRING_CALL,
                SET_VRING_KICK,
                SET_VRING_ENABLE,
                SET_VRING_ENABLE,
            ]
        );
        assert_eq!(msgs[7].body, state(0, 77));
        assert_eq!(msgs[4].files.len(), 1);
        // The replayed journal equals the original.
        let mut again = Journal::new(2);
        let mut acks = ReplyAck::new();
        let mut acked = Vec::new();
        for m in &msgs {
            acked.push(acks.on(m.req, &m.body));
            again.record(m.req, &m.body, &m.files);
        }
        // REPLY_ACK is on from SET_PROTOCOL_FEATURES on (features were read first).
        assert_eq!(&acked[..3], &[false, true, true]);
        let mut f2 = Vec::new();
        let mut r2 = again.rec.export(&mut f2).unwrap();
        r2.vrings[0].base = Some(77);
        assert_eq!(r2, exported);
    }

    #[test]
    fn hostile_records_are_refused() {
        let mut j = Journal::new(1);
        j.record(SET_VRING_NUM, &state(0, 64), &[]);
        let mut fds = Vec::new();
        let good = j.rec.export(&mut fds).unwrap();
        let bad = |f: &dyn Fn(&mut ConnRecord<usize>)| {
            let mut r = good.clone();
            f(&mut r);
            r.validate(1, 256).is_err()
        };
        assert!(bad(&|r| r.vrings[0].num = Some(0)));
        assert!(bad(&|r| r.vrings[0].num = Some(257)));
        assert!(bad(&|r| r.vrings[0].base = Some(1 << 16)));
        assert!(bad(&|r| r.vrings.clear()));
        assert!(bad(&|r| r.vrings[0].ready = true));
        assert!(bad(&|r| r.config = vec![
            ConfigWrite {
                offset: 0,
                flags: 0,
                data: vec![0; 300]
            };
            1
        ]));
        assert!(bad(&|r| {
            r.mem = (0..9)
                .map(|i| MemRegion {
                    guest_phys_addr: i,
                    memory_size: 1,
                    userspace_addr: 0,
                    mmap_offset: 0,
                    fd: 0,
                })
                .collect()
        }));
        // Fd indices: out of range, twice, left over.
        let mut t = FdTaker::new(vec![OwnedFd::from(file())]);
        assert!(t.take(1).is_err());
        assert!(t.take(0).is_ok());
        assert!(t.take(0).is_err());
        t.finish().unwrap();
        let t = FdTaker::new(vec![OwnedFd::from(file())]);
        assert!(t.finish().is_err());
        // Enable state that cannot be replayed without PROTOCOL_FEATURES.
        let mut r: ConnRecord<File> = ConnRecord::default();
        r.vrings.push(VringRecord {
            enabled: true,
            ..Default::default()
        });
        assert!(replay_messages(r).is_err());
    }
}
