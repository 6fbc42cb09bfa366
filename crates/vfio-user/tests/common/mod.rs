//! Shared test fixture: a fake device model, a server on a temp socket, and a raw
//! protocol client that can send anything.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use guest_mem::{DmaSpace, SharedMem};
use vfio_user::proto::{self, *};
use vfio_user::*;
use vmm_sys_util::sock_ctrl_msg::ScmSocket;
use zerocopy::IntoBytes;

pub const BAR_SIZE: u64 = 0x4000;
pub const DOORBELLS: u64 = 0x1000;
pub const TABLE: u32 = 0x2000;
pub const PBA: u32 = 0x3000;
pub const VECTORS: u16 = 4;

#[derive(Default)]
pub struct FakeBackend {
    pub regs: Mutex<Vec<u8>>,
    pub writes: Mutex<Vec<(u64, Vec<u8>)>>,
    pub resets: AtomicUsize,
    pub gone: AtomicUsize,
}

impl PciBackend for FakeBackend {
    fn bar_read(&self, _bar: u32, offset: u64, data: &mut [u8]) {
        let r = self.regs.lock().unwrap();
        let o = offset as usize;
        if let Some(s) = r.get(o..o + data.len()) {
            data.copy_from_slice(s);
        }
    }
    fn bar_write(&self, _bar: u32, offset: u64, data: &[u8]) {
        let mut r = self.regs.lock().unwrap();
        let o = offset as usize;
        if let Some(s) = r.get_mut(o..o + data.len()) {
            s.copy_from_slice(data);
        }
        self.writes.lock().unwrap().push((offset, data.to_vec()));
    }
    fn reset(&self) {
        self.resets.fetch_add(1, Ordering::SeqCst);
    }
    fn client_gone(&self) {
        self.gone.fetch_add(1, Ordering::SeqCst);
    }
}

pub struct Fixture {
    pub dir: PathBuf,
    pub path: PathBuf,
    pub server: Option<VfioUserServer>,
    pub backend: Arc<FakeBackend>,
    pub mem: Arc<DmaSpace>,
    pub irqs: Arc<Irqs>,
    pub bar_mem: SharedMem,
}

pub fn spec(bar_mem: &SharedMem) -> PciDeviceSpec {
    PciDeviceSpec {
        ids: PciIds {
            vendor: 0x1b36,
            device: 0x0010,
            subsystem_vendor: 0x1af4,
            subsystem: 0x1100,
            class_code: 0x010802,
            revision: 2,
        },
        bar0: BarSpec {
            size: BAR_SIZE,
            mmap_fd: Some(bar_mem.fd().try_clone_to_owned().unwrap()),
            fd_offset: 0,
            sparse: vec![SparseArea {
                offset: DOORBELLS,
                size: 0x1000,
            }],
        },
        msix: MsixSpec {
            vectors: VECTORS,
            table_bar: 0,
            table_offset: TABLE,
            pba_bar: 0,
            pba_offset: PBA,
        },
    }
}

static N: AtomicUsize = AtomicUsize::new(0);

impl Fixture {
    pub fn new() -> Fixture {
        let dir = std::env::temp_dir().join(format!(
            "vfu-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("dev.sock");
        let bar_mem = SharedMem::new("bar0", BAR_SIZE).unwrap();
        let spec = spec(&bar_mem);
        let backend = Arc::new(FakeBackend {
            regs: Mutex::new(vec![0; 0x1000]),
            ..Default::default()
        });
        let mem = DmaSpace::new();
        let irqs = VfioUserServer::irqs_for(&spec);
        let server = VfioUserServer::start(
            ServerConfig {
                access: Default::default(),
                socket: path.clone(),
                name: "test".into(),
                dma_reply_timeout: vfio_user::DEFAULT_DMA_REPLY_TIMEOUT,
                keep: None,
                listener: None,
                start_paused: false,
            },
            spec,
            backend.clone(),
            mem.clone(),
            irqs.clone(),
        )
        .unwrap();
        Fixture {
            dir,
            path,
            server: Some(server),
            backend,
            mem,
            irqs,
            bar_mem,
        }
    }

    pub fn raw(&self) -> Raw {
        Raw::connect(&self.path)
    }

    /// Waits until the server has processed a disconnect (client_gone count).
    pub fn wait_gone(&self, n: usize) {
        for _ in 0..500 {
            if self.backend.gone.load(Ordering::SeqCst) >= n {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        panic!("client_gone not called");
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        if let Some(s) = self.server.take() {
            s.stop();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A raw protocol client.
pub struct Raw {
    pub s: UnixStream,
    pub id: u16,
}

pub struct Rep {
    pub hdr: Header,
    pub payload: Vec<u8>,
    pub fd: Option<std::fs::File>,
}

impl Raw {
    pub fn connect(path: &std::path::Path) -> Raw {
        let s = UnixStream::connect(path).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        Raw { s, id: 0 }
    }

    pub fn send_raw(&mut self, bytes: &[u8], fds: &[RawFd]) {
        if fds.is_empty() {
            self.s.write_all(bytes).unwrap();
        } else {
            let n = self.s.send_with_fds(&[bytes], fds).unwrap();
            self.s.write_all(&bytes[n..]).unwrap();
        }
    }

    pub fn send(&mut self, cmd: u16, flags: u32, payload: &[u8], fds: &[RawFd]) -> u16 {
        self.id = self.id.wrapping_add(1);
        let h = Header {
            msg_id: self.id,
            cmd,
            msg_size: (HEADER_SIZE + payload.len()) as u32,
            flags,
            error: 0,
        };
        let mut b = h.as_bytes().to_vec();
        b.extend_from_slice(payload);
        self.send_raw(&b, fds);
        self.id
    }

    /// Reads one reply; None on EOF/reset.
    pub fn recv(&mut self) -> Option<Rep> {
        let mut hb = [0u8; HEADER_SIZE];
        let (n, fd) = self.s.recv_with_fd(&mut hb).ok()?;
        if n == 0 {
            return None;
        }
        self.s.read_exact(&mut hb[n..]).ok()?;
        let hdr: Header = proto::parse(&hb).unwrap();
        let mut payload = vec![0u8; hdr.msg_size as usize - HEADER_SIZE];
        self.s.read_exact(&mut payload).ok()?;
        Some(Rep { hdr, payload, fd })
    }

    pub fn call(&mut self, cmd: Command, payload: &[u8], fds: &[RawFd]) -> Rep {
        let id = self.send(cmd as u16, 0, payload, fds);
        let r = self.recv().expect("reply");
        assert_eq!(r.hdr.msg_id, id);
        assert_eq!(r.hdr.cmd, cmd as u16);
        assert!(r.hdr.is_reply());
        r
    }

    pub fn negotiate(&mut self) {
        let mut p = Version { major: 0, minor: 0 }.as_bytes().to_vec();
        p.extend_from_slice(
            br#"{"capabilities":{"max_msg_fds":8,"max_data_xfer_size":1048576,"pgsizes":4096}}"#,
        );
        p.push(0);
        let r = self.call(Command::Version, &p, &[]);
        assert!(!r.hdr.is_error(), "version error {}", r.hdr.error);
    }

    /// Expects an error reply with `errno` to the next call.
    pub fn expect_err(&mut self, cmd: u16, payload: &[u8], fds: &[RawFd], errno: i32) {
        let id = self.send(cmd, 0, payload, fds);
        let r = self.recv().expect("error reply");
        assert_eq!(r.hdr.msg_id, id);
        assert!(r.hdr.is_error(), "cmd {cmd}: expected error, got success");
        assert_eq!(r.hdr.error, errno as u32, "cmd {cmd}");
        assert_eq!(r.hdr.msg_size as usize, HEADER_SIZE);
    }

    pub fn cfg_read32(&mut self, off: u64) -> u32 {
        let a = RegionAccess {
            offset: off,
            region: PCI_CONFIG_REGION,
            count: 4,
        };
        let r = self.call(Command::RegionRead, a.as_bytes(), &[]);
        assert!(!r.hdr.is_error());
        u32::from_le_bytes(r.payload[16..20].try_into().unwrap())
    }

    pub fn region_write(&mut self, region: u32, off: u64, data: &[u8]) {
        let a = RegionAccess {
            offset: off,
            region,
            count: data.len() as u32,
        };
        let mut p = a.as_bytes().to_vec();
        p.extend_from_slice(data);
        let r = self.call(Command::RegionWrite, &p, &[]);
        assert!(!r.hdr.is_error(), "write error {}", r.hdr.error);
        assert_eq!(r.payload, a.as_bytes());
    }

    /// Whether the server closed the connection (EOF within the timeout).
    pub fn is_closed(&mut self) -> bool {
        let mut b = [0u8; 64];
        match self.s.read(&mut b) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => !matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
        }
    }
}

pub fn fd_of(s: &SharedMem) -> RawFd {
    s.fd().as_fd().as_raw_fd()
}
