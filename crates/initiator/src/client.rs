//! A vfio-user client: one socket, synchronous request/reply. With memory mapped
//! without a file descriptor, a service thread also answers the server's
//! DMA_READ/DMA_WRITE requests (`dma_service.rs`) and hands us our replies.

use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vfio_user::proto::{self, Command, Header, HEADER_SIZE};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;
use zerocopy::IntoBytes;

use crate::dma_service::{DmaServeCtl, Service};
use crate::error::{proto_err, Error, Result};
use crate::scm;

/// One message from the server.
#[derive(Debug)]
pub struct Reply {
    pub header: Header,
    pub payload: Vec<u8>,
    pub fds: Vec<OwnedFd>,
}

/// A region as the server describes it, with its mmap-able parts.
#[derive(Debug)]
pub struct RegionInfo {
    pub index: u32,
    pub flags: u32,
    pub size: u64,
    /// Offset into `fd` at which the region starts.
    pub offset: u64,
    pub sparse_areas: Vec<proto::SparseArea>,
    pub fd: Option<OwnedFd>,
}

/// Largest reply payload we accept; protects against a server that claims huge sizes.
const MAX_REPLY: usize = proto::MAX_MSG_SIZE as usize;
/// Caps on what we believe about a server's region description.
const MAX_SPARSE_AREAS: u32 = 1024;
const MAX_REGION_INFO: u32 = 64 * 1024;

pub struct VfioUserClient {
    sock: UnixStream,
    next_id: u16,
    max_msg_fds: u32,
    max_data_xfer: u32,
    server_caps: proto::Capabilities,
    tx: Vec<u8>,
    rx: Vec<u8>,
    rx_fds: Vec<OwnedFd>,
    /// Whole messages go out under this lock (the DMA service writes too).
    write_lock: Arc<Mutex<()>>,
    /// How long a reply may take (also the socket's read timeout).
    timeout: Option<Duration>,
    /// Answers the server's DMA requests and owns the socket's read side, once
    /// memory was mapped without an fd.
    service: Option<Service>,
}

impl std::fmt::Debug for VfioUserClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VfioUserClient")
            .field("next_id", &self.next_id)
            .field("server_caps", &self.server_caps)
            .finish()
    }
}

impl VfioUserClient {
    /// Connects and negotiates the protocol version.
    pub fn connect(path: impl AsRef<Path>) -> Result<Self> {
        Self::from_stream(UnixStream::connect(path)?)
    }

    /// Connects, telling the server we take at most `max_data_xfer` bytes of data
    /// per message (it must split its DMA_READ/DMA_WRITE accordingly).
    pub fn connect_with_xfer(path: impl AsRef<Path>, max_data_xfer: u32) -> Result<Self> {
        Self::negotiated(UnixStream::connect(path)?, max_data_xfer)
    }

    /// Negotiates over an already connected socket (tests use socketpairs).
    pub fn from_stream(sock: UnixStream) -> Result<Self> {
        Self::negotiated(sock, proto::MAX_DATA_XFER)
    }

    fn negotiated(sock: UnixStream, our_max_xfer: u32) -> Result<Self> {
        // A silent server must become an error, not a hang.
        sock.set_read_timeout(Some(Duration::from_secs(30)))?;
        let mut c = VfioUserClient {
            sock,
            next_id: 0,
            max_msg_fds: 1,
            max_data_xfer: proto::MAX_DATA_XFER,
            server_caps: proto::Capabilities {
                max_msg_fds: 1,
                max_data_xfer_size: proto::MAX_DATA_XFER,
                pgsizes: None,
                max_dma_maps: None,
            },
            tx: Vec::with_capacity(4096),
            rx: Vec::with_capacity(4096),
            rx_fds: Vec::with_capacity(proto::MAX_MSG_FDS as usize),
            write_lock: Arc::new(Mutex::new(())),
            timeout: Some(Duration::from_secs(30)),
            service: None,
        };
        c.negotiate(our_max_xfer)?;
        Ok(c)
    }

    pub fn set_timeout(&mut self, t: Option<Duration>) -> Result<()> {
        self.timeout = t;
        Ok(self.sock.set_read_timeout(t)?)
    }

    /// Starts answering the server's DMA_READ/DMA_WRITE requests (in layout
    /// `wire`) from memory registered with [`VfioUserClient::dma_map_unshared`].
    /// From now on a thread of ours reads the socket. Returns its controls.
    pub fn start_dma_service(&mut self, wire: proto::DmaWire) -> Result<Arc<DmaServeCtl>> {
        if let Some(s) = &self.service {
            return Ok(s.ctl.clone());
        }
        let s = Service::start(&self.sock, self.write_lock.clone(), wire)?;
        let ctl = s.ctl.clone();
        self.service = Some(s);
        Ok(ctl)
    }

    /// The DMA service's controls, if it runs.
    pub fn dma_service(&self) -> Option<Arc<DmaServeCtl>> {
        self.service.as_ref().map(|s| s.ctl.clone())
    }

    /// DMA_MAP of `mem` at `iova` *without* its file descriptor: the server
    /// reaches it only through DMA_READ/DMA_WRITE, which the service answers
    /// (started with the document's layout if it does not run yet).
    pub fn dma_map_unshared(
        &mut self,
        mem: Arc<guest_mem::SharedMem>,
        iova: u64,
        prot: guest_mem::Prot,
    ) -> Result<()> {
        let ctl = self.start_dma_service(proto::DmaWire::Spec)?;
        let size = mem.len();
        ctl.add_region(iova, mem);
        let r = self.dma_map_raw(None, 0, iova, size, prot);
        if r.is_err() {
            ctl.remove_region(iova);
        }
        r
    }

    pub fn server_caps(&self) -> &proto::Capabilities {
        &self.server_caps
    }
    pub fn max_data_xfer(&self) -> u32 {
        self.max_data_xfer
    }
    pub fn max_msg_fds(&self) -> u32 {
        self.max_msg_fds
    }

    fn negotiate(&mut self, our_max_xfer: u32) -> Result<()> {
        let caps = proto::CapabilitiesDoc {
            capabilities: proto::Capabilities {
                max_msg_fds: proto::MAX_MSG_FDS,
                max_data_xfer_size: our_max_xfer,
                pgsizes: None,
                max_dma_maps: None,
            },
        };
        let json = serde_json::to_vec(&caps).map_err(|e| proto_err(e.to_string()))?;
        let mut payload = proto::Version {
            major: proto::VERSION_MAJOR,
            minor: proto::VERSION_MINOR,
        }
        .as_bytes()
        .to_vec();
        payload.extend_from_slice(&json);
        payload.push(0);
        self.request(Command::Version, &payload, &[])?;
        let v: proto::Version =
            proto::parse(&self.rx).ok_or_else(|| proto_err("short VERSION reply"))?;
        if v.major != 0 {
            return Err(proto_err(format!("server speaks {}.{}", v.major, v.minor)));
        }
        let rest = &self.rx[std::mem::size_of::<proto::Version>()..];
        let json = rest.split(|b| *b == 0).next().unwrap_or(&[]);
        if !json.is_empty() {
            let doc: proto::CapabilitiesDoc = serde_json::from_slice(json)
                .map_err(|e| proto_err(format!("bad capabilities JSON: {e}")))?;
            self.server_caps = doc.capabilities;
        }
        self.max_msg_fds = self.server_caps.max_msg_fds.clamp(1, proto::MAX_MSG_FDS);
        // Never send more than either side accepts; 0 would make chunking loop forever.
        self.max_data_xfer = self
            .server_caps
            .max_data_xfer_size
            .clamp(8, proto::MAX_DATA_XFER);
        Ok(())
    }

    /// Sends one command; returns its message id.
    fn send(
        &mut self,
        cmd: u16,
        flags: u32,
        payload: &[u8],
        fds: &[BorrowedFd<'_>],
    ) -> Result<u16> {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        let hdr = Header {
            msg_id: id,
            cmd,
            msg_size: u32::try_from(HEADER_SIZE + payload.len())
                .map_err(|_| Error::Invalid("message too large".into()))?,
            flags: proto::FLAG_TYPE_COMMAND | flags,
            error: 0,
        };
        self.tx.clear();
        self.tx.extend_from_slice(hdr.as_bytes());
        self.tx.extend_from_slice(payload);
        let tx = std::mem::take(&mut self.tx);
        let r = {
            let _g = self.write_lock.lock().unwrap_or_else(|e| e.into_inner());
            write_msg(&self.sock, &tx, fds)
        };
        self.tx = tx;
        r?;
        Ok(id)
    }

    /// Sends arbitrary bytes (need not be a valid message) with fds, for hostile tests.
    pub fn send_raw(&mut self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
        let _g = self.write_lock.lock().unwrap_or_else(|e| e.into_inner());
        write_msg(&self.sock, bytes, fds)
    }

    /// Reads the next message into `rx`/`rx_fds`.
    fn recv_into(&mut self) -> Result<Header> {
        self.rx_fds.clear();
        if let Some(s) = &self.service {
            let m = match self.timeout {
                Some(t) => s.replies.recv_timeout(t).map_err(|e| match e {
                    std::sync::mpsc::RecvTimeoutError::Timeout => {
                        Error::Timeout("waiting for a vfio-user reply")
                    }
                    std::sync::mpsc::RecvTimeoutError::Disconnected => Error::Disconnected,
                })?,
                None => s.replies.recv().map_err(|_| Error::Disconnected)?,
            };
            self.rx.clear();
            self.rx.extend_from_slice(&m.payload);
            self.rx_fds = m.fds;
            return Ok(m.header);
        }
        let mut hb = [0u8; HEADER_SIZE];
        let n = scm::recv_with_fds(&self.sock, &mut hb, &mut self.rx_fds).map_err(map_timeout)?;
        if n == 0 {
            return Err(Error::Disconnected);
        }
        read_full(&mut self.sock, &mut hb[n..])?;
        let hdr: Header = proto::parse(&hb).ok_or_else(|| proto_err("short header"))?;
        let size = hdr.msg_size as usize;
        if !(HEADER_SIZE..=MAX_REPLY).contains(&size) {
            return Err(proto_err(format!("bad msg_size {size}")));
        }
        self.rx.clear();
        self.rx.resize(size - HEADER_SIZE, 0);
        let mut rx = std::mem::take(&mut self.rx);
        let r = read_full(&mut self.sock, &mut rx);
        self.rx = rx;
        r?;
        Ok(hdr)
    }

    /// Reads the next message from the server, whatever it is.
    pub fn recv_reply(&mut self) -> Result<Reply> {
        let header = self.recv_into()?;
        Ok(Reply {
            header,
            payload: self.rx.clone(),
            fds: std::mem::take(&mut self.rx_fds),
        })
    }

    /// Sends a command and waits for its reply; the payload is left in `self.rx`.
    fn request(&mut self, cmd: Command, payload: &[u8], fds: &[BorrowedFd<'_>]) -> Result<Header> {
        let id = self.send(cmd as u16, 0, payload, fds)?;
        loop {
            let hdr = self.recv_into()?;
            if !hdr.is_reply() {
                // Without the DMA service all our memory is fd-backed: the server
                // has no reason to send commands, so refuse them rather than stall.
                tracing::debug!(cmd = hdr.cmd, "server sent a command; refusing");
                let e = Header::error_reply(&hdr, libc::ENOTSUP);
                let _g = self.write_lock.lock().unwrap_or_else(|e| e.into_inner());
                write_msg(&self.sock, e.as_bytes(), &[])?;
                continue;
            }
            if hdr.msg_id != id {
                // A late reply to something we gave up on; drop it.
                tracing::debug!(got = hdr.msg_id, want = id, "skipping unmatched reply");
                continue;
            }
            if hdr.cmd != cmd as u16 {
                return Err(proto_err(format!(
                    "reply to id {id} has cmd {} not {}",
                    hdr.cmd, cmd as u16
                )));
            }
            if hdr.is_error() {
                return Err(Error::Remote {
                    cmd: hdr.cmd,
                    errno: hdr.error as i32,
                });
            }
            return Ok(hdr);
        }
    }

    /// Raw request for tests: any command code and payload; returns the reply.
    pub fn request_raw(
        &mut self,
        cmd: Command,
        payload: &[u8],
        fds: &[BorrowedFd<'_>],
    ) -> Result<Reply> {
        let header = self.request(cmd, payload, fds)?;
        Ok(Reply {
            header,
            payload: self.rx.clone(),
            fds: std::mem::take(&mut self.rx_fds),
        })
    }

    pub fn device_info(&mut self) -> Result<proto::DeviceInfo> {
        let req = proto::DeviceInfo {
            argsz: std::mem::size_of::<proto::DeviceInfo>() as u32,
            ..Default::default()
        };
        self.request(Command::DeviceGetInfo, req.as_bytes(), &[])?;
        proto::parse(&self.rx).ok_or_else(|| proto_err("short DEVICE_GET_INFO reply"))
    }

    pub fn region_info(&mut self, index: u32) -> Result<RegionInfo> {
        let base = std::mem::size_of::<proto::RegionInfo>() as u32;
        let mut argsz = base;
        for _ in 0..2 {
            let req = proto::RegionInfo {
                argsz,
                index,
                ..Default::default()
            };
            self.request(Command::DeviceGetRegionInfo, req.as_bytes(), &[])?;
            let ri: proto::RegionInfo =
                proto::parse(&self.rx).ok_or_else(|| proto_err("short REGION_INFO reply"))?;
            if ri.argsz > argsz && ri.argsz <= MAX_REGION_INFO {
                // Caps did not fit: ask again with what the server says it needs.
                argsz = ri.argsz;
                continue;
            }
            if ri.argsz > argsz {
                return Err(proto_err(format!("region info argsz {} too big", ri.argsz)));
            }
            let sparse_areas = if ri.flags & proto::REGION_CAPS != 0 && ri.cap_offset != 0 {
                parse_caps(&self.rx, ri.cap_offset)?
            } else {
                Vec::new()
            };
            let fd = if self.rx_fds.is_empty() {
                None
            } else {
                Some(self.rx_fds.swap_remove(0))
            };
            return Ok(RegionInfo {
                index: ri.index,
                flags: ri.flags,
                size: ri.size,
                offset: ri.offset,
                sparse_areas,
                fd,
            });
        }
        Err(proto_err("server keeps growing region info argsz"))
    }

    /// Reads `buf.len()` bytes of a region, split into transfers the server accepts.
    pub fn region_read(&mut self, region: u32, offset: u64, buf: &mut [u8]) -> Result<()> {
        let max = self.max_data_xfer as usize;
        let mut done = 0;
        while done < buf.len() {
            let n = (buf.len() - done).min(max);
            let off = offset
                .checked_add(done as u64)
                .ok_or_else(|| Error::Invalid("offset overflows".into()))?;
            let req = proto::RegionAccess {
                offset: off,
                region,
                count: n as u32,
            };
            self.request(Command::RegionRead, req.as_bytes(), &[])?;
            let hs = std::mem::size_of::<proto::RegionAccess>();
            let rep: proto::RegionAccess =
                proto::parse(&self.rx).ok_or_else(|| proto_err("short REGION_READ reply"))?;
            if rep.count as usize != n || self.rx.len() != hs + n {
                return Err(proto_err(format!(
                    "REGION_READ: asked {n} bytes, got count {} with {} data bytes",
                    rep.count,
                    self.rx.len().saturating_sub(hs)
                )));
            }
            buf[done..done + n].copy_from_slice(&self.rx[hs..hs + n]);
            done += n;
        }
        Ok(())
    }

    /// Writes `data` to a region. With `no_reply` the server is asked not to answer,
    /// so errors go unseen but the write costs one message.
    pub fn region_write(
        &mut self,
        region: u32,
        offset: u64,
        data: &[u8],
        no_reply: bool,
    ) -> Result<()> {
        let max = self.max_data_xfer as usize;
        let mut done = 0;
        let mut payload = Vec::new();
        while done < data.len() || (data.is_empty() && done == 0) {
            let n = (data.len() - done).min(max);
            let req = proto::RegionAccess {
                offset: offset.wrapping_add(done as u64),
                region,
                count: n as u32,
            };
            payload.clear();
            payload.extend_from_slice(req.as_bytes());
            payload.extend_from_slice(&data[done..done + n]);
            if no_reply {
                self.send(
                    Command::RegionWrite as u16,
                    proto::FLAG_NO_REPLY,
                    &payload,
                    &[],
                )?;
            } else {
                self.request(Command::RegionWrite, &payload, &[])?;
                if let Some(rep) = proto::parse::<proto::RegionAccess>(&self.rx) {
                    if rep.count as usize != n {
                        return Err(proto_err(format!(
                            "REGION_WRITE: wrote {n}, server says {}",
                            rep.count
                        )));
                    }
                }
            }
            done += n;
            if data.is_empty() {
                break;
            }
        }
        Ok(())
    }

    /// 4-byte register write with a reply, without heap use.
    pub fn region_write_u32(&mut self, region: u32, offset: u64, v: u32) -> Result<()> {
        let p = u32_write(region, offset, v);
        self.request(Command::RegionWrite, &p, &[])?;
        Ok(())
    }

    /// 4-byte posted register write (no reply asked, none awaited), as QEMU sends
    /// trapped BAR writes: the doorbell path when the page is not mapped.
    pub fn region_write_u32_posted(&mut self, region: u32, offset: u64, v: u32) -> Result<()> {
        let p = u32_write(region, offset, v);
        self.send(Command::RegionWrite as u16, proto::FLAG_NO_REPLY, &p, &[])?;
        Ok(())
    }

    pub fn irq_info(&mut self, index: u32) -> Result<proto::IrqInfo> {
        let req = proto::IrqInfo {
            argsz: std::mem::size_of::<proto::IrqInfo>() as u32,
            index,
            ..Default::default()
        };
        self.request(Command::DeviceGetIrqInfo, req.as_bytes(), &[])?;
        proto::parse(&self.rx).ok_or_else(|| proto_err("short GET_IRQ_INFO reply"))
    }

    /// Assigns eventfds to vectors `start..start+fds.len()` of IRQ `index`, in as many
    /// messages as the server's fd limit requires.
    pub fn set_irqs(&mut self, index: u32, start: u32, fds: &[BorrowedFd<'_>]) -> Result<()> {
        for (i, chunk) in fds.chunks(self.max_msg_fds as usize).enumerate() {
            let req = proto::SetIrqs {
                argsz: std::mem::size_of::<proto::SetIrqs>() as u32,
                flags: proto::IRQ_SET_DATA_EVENTFD | proto::IRQ_SET_ACTION_TRIGGER,
                index,
                start: start + (i * self.max_msg_fds as usize) as u32,
                count: chunk.len() as u32,
            };
            self.request(Command::DeviceSetIrqs, req.as_bytes(), chunk)?;
        }
        Ok(())
    }

    /// Disables all vectors of IRQ `index`.
    pub fn disable_irqs(&mut self, index: u32) -> Result<()> {
        let req = proto::SetIrqs {
            argsz: std::mem::size_of::<proto::SetIrqs>() as u32,
            flags: proto::IRQ_SET_DATA_NONE | proto::IRQ_SET_ACTION_TRIGGER,
            index,
            start: 0,
            count: 0,
        };
        self.request(Command::DeviceSetIrqs, req.as_bytes(), &[])?;
        Ok(())
    }

    pub fn dma_map(
        &mut self,
        fd: BorrowedFd<'_>,
        fd_offset: u64,
        iova: u64,
        size: u64,
        prot: guest_mem::Prot,
    ) -> Result<()> {
        self.dma_map_raw(Some(fd), fd_offset, iova, size, prot)
    }

    /// DMA_MAP with or without an fd (without one the server must use DMA
    /// messages, which only [`VfioUserClient::dma_map_unshared`] arranges to answer).
    pub fn dma_map_raw(
        &mut self,
        fd: Option<BorrowedFd<'_>>,
        fd_offset: u64,
        iova: u64,
        size: u64,
        prot: guest_mem::Prot,
    ) -> Result<()> {
        let mut flags = 0;
        if prot.read {
            flags |= proto::DMA_READ;
        }
        if prot.write {
            flags |= proto::DMA_WRITE;
        }
        let req = proto::DmaMap {
            argsz: std::mem::size_of::<proto::DmaMap>() as u32,
            flags,
            offset: fd_offset,
            addr: iova,
            size,
        };
        self.request(Command::DmaMap, req.as_bytes(), fd.as_slice())?;
        Ok(())
    }

    pub fn dma_unmap(&mut self, iova: u64, size: u64) -> Result<()> {
        self.unmap(iova, size, 0)
    }

    pub fn unmap_all(&mut self) -> Result<()> {
        self.unmap(0, 0, proto::UNMAP_ALL)
    }

    fn unmap(&mut self, addr: u64, size: u64, flags: u32) -> Result<()> {
        let req = proto::DmaUnmap {
            argsz: std::mem::size_of::<proto::DmaUnmap>() as u32,
            flags,
            addr,
            size,
        };
        self.request(Command::DmaUnmap, req.as_bytes(), &[])?;
        Ok(())
    }

    pub fn device_reset(&mut self) -> Result<()> {
        self.request(Command::DeviceReset, &[], &[])?;
        Ok(())
    }
}

fn map_timeout(e: std::io::Error) -> Error {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            Error::Timeout("waiting for a vfio-user reply")
        }
        _ => Error::Io(e),
    }
}

fn read_full(sock: &mut UnixStream, buf: &mut [u8]) -> Result<()> {
    sock.read_exact(buf).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            Error::Disconnected
        } else {
            map_timeout(e)
        }
    })
}

pub(crate) fn write_msg(sock: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
    let mut sent = 0;
    if !fds.is_empty() {
        let mut raw: [RawFd; proto::MAX_MSG_FDS as usize] = [-1; proto::MAX_MSG_FDS as usize];
        if fds.len() > raw.len() {
            return Err(Error::Invalid(format!("{} fds in one message", fds.len())));
        }
        for (r, f) in raw.iter_mut().zip(fds) {
            *r = f.as_fd().as_raw_fd();
        }
        sent = sock
            .send_with_fds(&[bytes], &raw[..fds.len()])
            .map_err(std::io::Error::from)?;
    }
    // Stream sockets may take a message in pieces; the fds went with the first one.
    (&*sock).write_all(&bytes[sent..])?;
    Ok(())
}

/// Walks the capability chain of a REGION_INFO reply and returns its sparse areas.
fn parse_caps(buf: &[u8], first: u32) -> Result<Vec<proto::SparseArea>> {
    let mut areas = Vec::new();
    let mut off = first as usize;
    let mut hops = 0;
    while off != 0 {
        hops += 1;
        if hops > 16 {
            return Err(proto_err("region capability chain too long or looping"));
        }
        let cap: proto::CapHeader = buf
            .get(off..)
            .and_then(proto::parse)
            .ok_or_else(|| proto_err(format!("capability at {off} out of bounds")))?;
        if cap.id == proto::REGION_CAP_SPARSE_MMAP {
            let h_off = off + std::mem::size_of::<proto::CapHeader>();
            let sh: proto::SparseMmapHeader = buf
                .get(h_off..)
                .and_then(proto::parse)
                .ok_or_else(|| proto_err("short sparse mmap capability"))?;
            if sh.nr_areas > MAX_SPARSE_AREAS {
                return Err(proto_err(format!("{} sparse areas", sh.nr_areas)));
            }
            let mut a_off = h_off + std::mem::size_of::<proto::SparseMmapHeader>();
            for _ in 0..sh.nr_areas {
                let a: proto::SparseArea = buf
                    .get(a_off..)
                    .and_then(proto::parse)
                    .ok_or_else(|| proto_err("sparse area out of bounds"))?;
                areas.push(a);
                a_off += std::mem::size_of::<proto::SparseArea>();
            }
        }
        let next = cap.next as usize;
        if next != 0 && next <= off {
            return Err(proto_err("region capability chain goes backwards"));
        }
        off = next;
    }
    Ok(areas)
}

/// REGION_WRITE payload of one u32.
fn u32_write(region: u32, offset: u64, v: u32) -> [u8; 20] {
    let mut p = [0u8; 20];
    p[..16].copy_from_slice(
        proto::RegionAccess {
            offset,
            region,
            count: 4,
        }
        .as_bytes(),
    );
    p[16..].copy_from_slice(&v.to_le_bytes());
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_parse_and_reject_bad_chains() {
        let mut buf = vec![0u8; 32];
        buf.extend_from_slice(
            proto::CapHeader {
                id: 1,
                version: 1,
                next: 0,
            }
            .as_bytes(),
        );
        buf.extend_from_slice(
            proto::SparseMmapHeader {
                nr_areas: 2,
                reserved: 0,
            }
            .as_bytes(),
        );
        buf.extend_from_slice(
            proto::SparseArea {
                offset: 0x1000,
                size: 0x1000,
            }
            .as_bytes(),
        );
        buf.extend_from_slice(
            proto::SparseArea {
                offset: 0x3000,
                size: 0x2000,
            }
            .as_bytes(),
        );
        let a = parse_caps(&buf, 32).unwrap();
        assert_eq!(a.len(), 2);
        assert_eq!(a[1].offset, 0x3000);
        // Truncated area list.
        assert!(parse_caps(&buf[..buf.len() - 1], 32).is_err());
        // Self loop.
        let mut lp = buf.clone();
        lp[32 + 4..32 + 8].copy_from_slice(&32u32.to_le_bytes());
        assert!(parse_caps(&lp, 32).is_err());
        // Out of bounds first cap.
        assert!(parse_caps(&buf, 4000).is_err());
    }
}
