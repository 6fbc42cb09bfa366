//! A fake vfio-user NVMe controller for tests: just enough protocol (VERSION,
//! GET_INFO, REGION_INFO with a sparse doorbell area and its fd, REGION_READ/WRITE,
//! DMA_MAP/UNMAP, IRQs, RESET) and just enough NVMe (bring-up, Identify, queues,
//! Read/Write with real PRP and SGL walking over a RAM disk).
#![allow(dead_code)]

pub mod ctrl;

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use guest_mem::{MappedRegion, Prot, SharedMem};
use vfio_user::proto::{self, Command, Header};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;
use zerocopy::IntoBytes;

pub use ctrl::Ctrl;

pub const BAR0_SIZE: u64 = 0x4000;
pub const DB_AREA: (u64, u64) = (0x1000, 0x1000);

#[derive(Clone, Debug)]
pub struct Logged {
    pub cmd: u16,
    pub flags: u32,
    pub payload: Vec<u8>,
    pub nfds: usize,
}

#[derive(Clone)]
pub struct FakeOpts {
    pub max_msg_fds: u32,
    pub max_data_xfer: u32,
    pub sparse_mmap: bool,
    pub sgl: bool,
}

impl Default for FakeOpts {
    fn default() -> Self {
        FakeOpts {
            max_msg_fds: 4,
            max_data_xfer: 64 << 10,
            sparse_mmap: true,
            sgl: true,
        }
    }
}

pub struct Fake {
    pub ctrl: Arc<Mutex<Ctrl>>,
    pub log: Arc<Mutex<Vec<Logged>>>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Drop for Fake {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Starts the fake on one end of a socketpair and returns the other end.
pub fn start(opts: FakeOpts) -> (Fake, UnixStream) {
    let (a, b) = UnixStream::pair().unwrap();
    let bar = Arc::new(SharedMem::new("fake-bar0", BAR0_SIZE).unwrap());
    let ctrl = Arc::new(Mutex::new(Ctrl::new(bar.clone(), opts.sgl)));
    let log = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    {
        let (ctrl, stop) = (ctrl.clone(), stop.clone());
        // Polls the shared doorbell page, as a reactor would.
        threads.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Acquire) {
                ctrl.lock().unwrap().process();
                std::thread::sleep(Duration::from_micros(50));
            }
        }));
    }
    {
        let (ctrl, log) = (ctrl.clone(), log.clone());
        threads.push(std::thread::spawn(move || serve(b, bar, ctrl, log, opts)));
    }
    (
        Fake {
            ctrl,
            log,
            stop,
            threads,
        },
        a,
    )
}

fn recv_msg(s: &mut UnixStream) -> Option<(Header, Vec<u8>, Vec<File>)> {
    let mut hb = [0u8; 16];
    let mut raw = [-1 as RawFd; 16];
    let mut iov = [libc::iovec {
        iov_base: hb.as_mut_ptr().cast(),
        iov_len: 16,
    }];
    // SAFETY: the iovec points at `hb`, which lives across the call.
    let (n, nfds) = unsafe { s.recv_with_fds(&mut iov, &mut raw) }.ok()?;
    // SAFETY: the kernel installed these fds for us.
    let files: Vec<File> = raw[..nfds]
        .iter()
        .map(|fd| unsafe { File::from_raw_fd(*fd) })
        .collect();
    if n == 0 {
        return None;
    }
    s.read_exact(&mut hb[n..]).ok()?;
    let h: Header = proto::parse(&hb)?;
    let mut p = vec![0u8; (h.msg_size as usize).checked_sub(16)?];
    s.read_exact(&mut p).ok()?;
    Some((h, p, files))
}

fn reply(s: &mut UnixStream, req: &Header, payload: &[u8], fds: &[RawFd]) {
    let h = Header::reply_to(req, payload.len());
    let mut m = h.as_bytes().to_vec();
    m.extend_from_slice(payload);
    if fds.is_empty() {
        let _ = s.write_all(&m);
    } else {
        let _ = s.send_with_fds(&[&m[..]], fds);
    }
}

fn err(s: &mut UnixStream, req: &Header, errno: i32) {
    let _ = s.write_all(Header::error_reply(req, errno).as_bytes());
}

fn serve(
    mut s: UnixStream,
    bar: Arc<SharedMem>,
    ctrl: Arc<Mutex<Ctrl>>,
    log: Arc<Mutex<Vec<Logged>>>,
    o: FakeOpts,
) {
    use std::os::fd::AsRawFd;
    while let Some((h, p, files)) = recv_msg(&mut s) {
        log.lock().unwrap().push(Logged {
            cmd: h.cmd,
            flags: h.flags,
            payload: p.clone(),
            nfds: files.len(),
        });
        let Some(cmd) = Command::from_u16(h.cmd) else {
            err(&mut s, &h, libc::ENOSYS);
            continue;
        };
        match cmd {
            Command::Version => {
                let mut r = proto::Version { major: 0, minor: 0 }.as_bytes().to_vec();
                r.extend_from_slice(
                    format!(
                        r#"{{"capabilities":{{"max_msg_fds":{},"max_data_xfer_size":{}}}}}"#,
                        o.max_msg_fds, o.max_data_xfer
                    )
                    .as_bytes(),
                );
                r.push(0);
                reply(&mut s, &h, &r, &[]);
            }
            Command::DeviceGetInfo => {
                let r = proto::DeviceInfo {
                    argsz: 16,
                    flags: proto::DEVICE_FLAGS_PCI | proto::DEVICE_FLAGS_RESET,
                    num_regions: proto::PCI_NUM_REGIONS,
                    num_irqs: proto::PCI_NUM_IRQS,
                };
                reply(&mut s, &h, r.as_bytes(), &[]);
            }
            Command::DeviceGetRegionInfo => {
                let Some(req) = proto::parse::<proto::RegionInfo>(&p) else {
                    err(&mut s, &h, libc::EINVAL);
                    continue;
                };
                let mut ri = proto::RegionInfo {
                    argsz: 32,
                    index: req.index,
                    ..Default::default()
                };
                match req.index {
                    0 => {
                        ri.size = BAR0_SIZE;
                        ri.flags = proto::REGION_READ | proto::REGION_WRITE;
                        if o.sparse_mmap {
                            ri.flags |= proto::REGION_MMAP | proto::REGION_CAPS;
                            ri.argsz = 64;
                            if req.argsz < 64 {
                                reply(&mut s, &h, ri.as_bytes(), &[]);
                                continue;
                            }
                            ri.cap_offset = 32;
                            let mut r = ri.as_bytes().to_vec();
                            r.extend_from_slice(
                                proto::CapHeader {
                                    id: 1,
                                    version: 1,
                                    next: 0,
                                }
                                .as_bytes(),
                            );
                            r.extend_from_slice(
                                proto::SparseMmapHeader {
                                    nr_areas: 1,
                                    reserved: 0,
                                }
                                .as_bytes(),
                            );
                            r.extend_from_slice(
                                proto::SparseArea {
                                    offset: DB_AREA.0,
                                    size: DB_AREA.1,
                                }
                                .as_bytes(),
                            );
                            reply(&mut s, &h, &r, &[bar.fd().as_raw_fd()]);
                            continue;
                        }
                    }
                    7 => {
                        ri.size = 256;
                        ri.flags = proto::REGION_READ | proto::REGION_WRITE;
                    }
                    i if i < proto::PCI_NUM_REGIONS => {}
                    _ => {
                        err(&mut s, &h, libc::EINVAL);
                        continue;
                    }
                }
                reply(&mut s, &h, ri.as_bytes(), &[]);
            }
            Command::RegionRead => {
                let Some(a) = proto::parse::<proto::RegionAccess>(&p) else {
                    err(&mut s, &h, libc::EINVAL);
                    continue;
                };
                if a.count > o.max_data_xfer {
                    err(&mut s, &h, libc::E2BIG);
                    continue;
                }
                let mut data = vec![0u8; a.count as usize];
                if a.region == 0 {
                    ctrl.lock().unwrap().read(a.offset, &mut data);
                }
                let mut r = a.as_bytes().to_vec();
                r.extend_from_slice(&data);
                reply(&mut s, &h, &r, &[]);
            }
            Command::RegionWrite => {
                let Some(a) = proto::parse::<proto::RegionAccess>(&p) else {
                    err(&mut s, &h, libc::EINVAL);
                    continue;
                };
                let data = &p[16..];
                if data.len() != a.count as usize {
                    err(&mut s, &h, libc::EINVAL);
                    continue;
                }
                if a.region == 0 {
                    ctrl.lock().unwrap().write(a.offset, data);
                }
                if !h.no_reply() {
                    reply(&mut s, &h, a.as_bytes(), &[]);
                }
            }
            Command::DmaMap => {
                let (Some(m), Some(f)) = (proto::parse::<proto::DmaMap>(&p), files.first()) else {
                    err(&mut s, &h, libc::EINVAL);
                    continue;
                };
                use std::os::fd::AsFd;
                match MappedRegion::map_fd(f.as_fd(), m.offset, m.addr, m.size, Prot::RW) {
                    Ok(r) => {
                        ctrl.lock().unwrap().mem.push(r);
                        reply(&mut s, &h, &[], &[]);
                    }
                    Err(_) => err(&mut s, &h, libc::EINVAL),
                }
            }
            Command::DmaUnmap => {
                let Some(m) = proto::parse::<proto::DmaUnmap>(&p) else {
                    err(&mut s, &h, libc::EINVAL);
                    continue;
                };
                let mut c = ctrl.lock().unwrap();
                if m.flags & proto::UNMAP_ALL != 0 {
                    c.mem.clear();
                } else {
                    c.mem.retain(|r| !(r.iova() == m.addr && r.len() == m.size));
                }
                reply(&mut s, &h, m.as_bytes(), &[]);
            }
            Command::DeviceGetIrqInfo => {
                let Some(mut i) = proto::parse::<proto::IrqInfo>(&p) else {
                    err(&mut s, &h, libc::EINVAL);
                    continue;
                };
                i.count = if i.index == proto::PCI_MSIX_IRQ {
                    64
                } else {
                    1
                };
                i.flags = proto::IRQ_INFO_EVENTFD;
                reply(&mut s, &h, i.as_bytes(), &[]);
            }
            Command::DeviceSetIrqs => {
                let Some(si) = proto::parse::<proto::SetIrqs>(&p) else {
                    err(&mut s, &h, libc::EINVAL);
                    continue;
                };
                if si.flags & proto::IRQ_SET_DATA_EVENTFD != 0 && files.len() != si.count as usize {
                    err(&mut s, &h, libc::EINVAL);
                    continue;
                }
                let mut c = ctrl.lock().unwrap();
                for (i, f) in files.into_iter().enumerate() {
                    c.set_irq(si.start as usize + i, OwnedFd::from(f));
                }
                reply(&mut s, &h, &[], &[]);
            }
            Command::DeviceReset => {
                ctrl.lock().unwrap().reset();
                reply(&mut s, &h, &[], &[]);
            }
            _ => err(&mut s, &h, libc::ENOSYS),
        }
    }
}
