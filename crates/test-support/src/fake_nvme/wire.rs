//! The fake controller's side of the vfio-user socket: one handler per command.

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, MutexGuard};

use guest_mem::{MappedRegion, Prot, SharedMem};
use vfio_user::proto::{self, Command, Header};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;
use zerocopy::IntoBytes;

use super::{Ctrl, FakeOpts, Logged, BAR0_SIZE, DB_AREA};
use crate::vfio_client::recv_message;

/// A reply: payload and fds, or an errno.
type Answer = Result<(Vec<u8>, Vec<RawFd>), i32>;

pub(super) struct Server {
    pub s: UnixStream,
    pub bar: Arc<SharedMem>,
    pub ctrl: Arc<Mutex<Ctrl>>,
    pub log: Arc<Mutex<Vec<Logged>>>,
    pub o: FakeOpts,
}

fn ok(payload: &[u8]) -> Answer {
    Ok((payload.to_vec(), Vec::new()))
}

impl Server {
    fn ctrl(&self) -> MutexGuard<'_, Ctrl> {
        self.ctrl.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn serve(mut self) {
        while let Some((h, p, files)) = recv_message(&mut self.s) {
            self.log
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(Logged {
                    cmd: h.cmd,
                    flags: h.flags,
                    payload: p.clone(),
                    nfds: files.len(),
                });
            let answer = match Command::from_u16(h.cmd) {
                Some(cmd) => self.handle(cmd, &p, files),
                None => Err(libc::ENOSYS),
            };
            self.answer(&h, answer);
        }
    }

    fn answer(&mut self, h: &Header, a: Answer) {
        match a {
            // A posted register write (the doorbell path by message) gets no reply.
            Ok(_) if h.no_reply() && h.cmd == Command::RegionWrite as u16 => {}
            Ok((payload, fds)) => {
                let mut m = Header::reply_to(h, payload.len()).as_bytes().to_vec();
                m.extend_from_slice(&payload);
                if fds.is_empty() {
                    let _ = self.s.write_all(&m);
                } else {
                    let _ = self.s.send_with_fds(&[&m[..]], &fds);
                }
            }
            Err(errno) => {
                let _ = self.s.write_all(Header::error_reply(h, errno).as_bytes());
            }
        }
    }

    fn handle(&mut self, cmd: Command, p: &[u8], files: Vec<File>) -> Answer {
        match cmd {
            Command::Version => self.version(),
            Command::DeviceGetInfo => ok(proto::DeviceInfo {
                argsz: 16,
                flags: proto::DEVICE_FLAGS_PCI | proto::DEVICE_FLAGS_RESET,
                num_regions: proto::PCI_NUM_REGIONS,
                num_irqs: proto::PCI_NUM_IRQS,
            }
            .as_bytes()),
            Command::DeviceGetRegionInfo => self.region_info(p),
            Command::RegionRead => self.region_read(p),
            Command::RegionWrite => self.region_write(p),
            Command::DmaMap => self.dma_map(p, files.first()),
            Command::DmaUnmap => self.dma_unmap(p),
            Command::DeviceGetIrqInfo => irq_info(p),
            Command::DeviceSetIrqs => self.set_irqs(p, files),
            Command::DeviceReset => {
                self.ctrl().reset();
                ok(&[])
            }
            _ => Err(libc::ENOSYS),
        }
    }

    fn version(&self) -> Answer {
        let mut r = proto::Version { major: 0, minor: 0 }.as_bytes().to_vec();
        let caps = format!(
            r#"{{"capabilities":{{"max_msg_fds":{},"max_data_xfer_size":{}}}}}"#,
            self.o.max_msg_fds, self.o.max_data_xfer
        );
        r.extend_from_slice(caps.as_bytes());
        r.push(0);
        Ok((r, Vec::new()))
    }

    fn region_info(&self, p: &[u8]) -> Answer {
        let req = proto::parse::<proto::RegionInfo>(p).ok_or(libc::EINVAL)?;
        let mut ri = proto::RegionInfo {
            argsz: 32,
            index: req.index,
            ..Default::default()
        };
        match req.index {
            0 => {
                ri.size = BAR0_SIZE;
                ri.flags = proto::REGION_READ | proto::REGION_WRITE;
                if self.o.sparse_mmap {
                    return Ok(self.bar0_sparse(ri, req.argsz));
                }
            }
            7 => {
                ri.size = 256;
                ri.flags = proto::REGION_READ | proto::REGION_WRITE;
            }
            i if i < proto::PCI_NUM_REGIONS => {}
            _ => return Err(libc::EINVAL),
        }
        ok(ri.as_bytes())
    }

    /// BAR0's info with the sparse mmap capability for the doorbell page and the
    /// BAR's fd (only the size first, if the client's buffer is too small).
    fn bar0_sparse(&self, mut ri: proto::RegionInfo, argsz: u32) -> (Vec<u8>, Vec<RawFd>) {
        ri.flags |= proto::REGION_MMAP | proto::REGION_CAPS;
        ri.argsz = 64;
        if argsz < 64 {
            return (ri.as_bytes().to_vec(), Vec::new());
        }
        ri.cap_offset = 32;
        let mut r = ri.as_bytes().to_vec();
        let cap = proto::CapHeader {
            id: 1,
            version: 1,
            next: 0,
        };
        r.extend_from_slice(cap.as_bytes());
        let sparse = proto::SparseMmapHeader {
            nr_areas: 1,
            reserved: 0,
        };
        r.extend_from_slice(sparse.as_bytes());
        let area = proto::SparseArea {
            offset: DB_AREA.0,
            size: DB_AREA.1,
        };
        r.extend_from_slice(area.as_bytes());
        (r, vec![self.bar.fd().as_raw_fd()])
    }

    fn region_read(&self, p: &[u8]) -> Answer {
        let a = proto::parse::<proto::RegionAccess>(p).ok_or(libc::EINVAL)?;
        if a.count > self.o.max_data_xfer {
            return Err(libc::E2BIG);
        }
        let mut data = vec![0u8; a.count as usize];
        if a.region == 0 {
            self.ctrl().read(a.offset, &mut data);
        }
        let mut r = a.as_bytes().to_vec();
        r.extend_from_slice(&data);
        Ok((r, Vec::new()))
    }

    fn region_write(&self, p: &[u8]) -> Answer {
        let a = proto::parse::<proto::RegionAccess>(p).ok_or(libc::EINVAL)?;
        let data = &p[16..];
        if data.len() != a.count as usize {
            return Err(libc::EINVAL);
        }
        if a.region == 0 {
            self.ctrl().write(a.offset, data);
        }
        ok(a.as_bytes())
    }

    fn dma_map(&self, p: &[u8], f: Option<&File>) -> Answer {
        let (Some(m), Some(f)) = (proto::parse::<proto::DmaMap>(p), f) else {
            return Err(libc::EINVAL);
        };
        let r = MappedRegion::map_fd(f.as_fd(), m.offset, m.addr, m.size, Prot::RW)
            .map_err(|_| libc::EINVAL)?;
        self.ctrl().mem.push(r);
        ok(&[])
    }

    fn dma_unmap(&self, p: &[u8]) -> Answer {
        let m = proto::parse::<proto::DmaUnmap>(p).ok_or(libc::EINVAL)?;
        let mut c = self.ctrl();
        if m.flags & proto::UNMAP_ALL != 0 {
            c.mem.clear();
        } else {
            c.mem.retain(|r| !(r.iova() == m.addr && r.len() == m.size));
        }
        ok(m.as_bytes())
    }

    fn set_irqs(&self, p: &[u8], files: Vec<File>) -> Answer {
        let si = proto::parse::<proto::SetIrqs>(p).ok_or(libc::EINVAL)?;
        if si.flags & proto::IRQ_SET_DATA_EVENTFD != 0 && files.len() != si.count as usize {
            return Err(libc::EINVAL);
        }
        let mut c = self.ctrl();
        for (i, f) in files.into_iter().enumerate() {
            c.set_irq(si.start as usize + i, OwnedFd::from(f));
        }
        ok(&[])
    }
}

fn irq_info(p: &[u8]) -> Answer {
    let mut i = proto::parse::<proto::IrqInfo>(p).ok_or(libc::EINVAL)?;
    i.count = if i.index == proto::PCI_MSIX_IRQ {
        64
    } else {
        1
    };
    i.flags = proto::IRQ_INFO_EVENTFD;
    ok(i.as_bytes())
}
