//! A fake vfio-user NVMe controller, to test udrive's initiator against something
//! that is not udrive.
//!
//! Just enough protocol: VERSION, GET_INFO, REGION_INFO (BAR0 with a sparse doorbell
//! area and its fd, optionally none), REGION_READ/WRITE, DMA_MAP/UNMAP with fds,
//! IRQ info and eventfds, RESET. Just enough NVMe: enable/disable, Identify
//! (controller, namespace 1, active list), Set Features (number of queues),
//! creating and deleting I/O queues, and Read/Write/Write Zeroes/Flush on one
//! namespace of [`ctrl::NS_BLOCKS`] 512-byte blocks in RAM, with real PRP and SGL
//! walking. A thread polls the doorbell page as a reactor would; every message and
//! every I/O command is logged for the test to inspect.
//!
//! What it does not model: anything else of NVMe (no Get Log Page, AER, Format,
//! namespaces beyond 1, error recovery: unknown commands get Invalid Opcode),
//! DMA by messages, several clients, or a client that lies (it trusts lengths
//! it was sent as far as not panicking).

pub mod ctrl;
mod dptr;
mod wire;

use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use guest_mem::SharedMem;

pub use ctrl::Ctrl;

pub const BAR0_SIZE: u64 = 0x4000;
/// The doorbell page: (offset, size) in BAR0, mappable from the region's fd.
pub const DB_AREA: (u64, u64) = (0x1000, 0x1000);

/// One message the fake received.
#[derive(Clone, Debug)]
pub struct Logged {
    pub cmd: u16,
    pub flags: u32,
    pub payload: Vec<u8>,
    pub nfds: usize,
}

/// What the fake offers.
#[derive(Clone)]
pub struct FakeOpts {
    pub max_msg_fds: u32,
    pub max_data_xfer: u32,
    /// BAR0's doorbell page as a sparse mmap area (else doorbells come by message).
    pub sparse_mmap: bool,
    /// SGL support in Identify Controller.
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

/// A running fake; its threads stop on drop.
pub struct FakeNvme {
    pub ctrl: Arc<Mutex<Ctrl>>,
    pub log: Arc<Mutex<Vec<Logged>>>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl FakeNvme {
    /// Every message received so far with command `cmd`.
    pub fn logged(&self, cmd: vfio_user::proto::Command) -> Vec<Logged> {
        self.log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|l| l.cmd == cmd as u16)
            .cloned()
            .collect()
    }
}

impl Drop for FakeNvme {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Starts the fake on one end of a socketpair and returns the other end.
pub fn start(opts: FakeOpts) -> (FakeNvme, UnixStream) {
    let (a, b) = UnixStream::pair().expect("socketpair");
    let bar = Arc::new(SharedMem::new("fake-bar0", BAR0_SIZE).expect("BAR0 memfd"));
    let ctrl = Arc::new(Mutex::new(Ctrl::new(bar.clone(), opts.sgl)));
    let log = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    {
        let (ctrl, stop) = (ctrl.clone(), stop.clone());
        // Polls the shared doorbell page, as a reactor would.
        threads.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Acquire) {
                ctrl.lock().unwrap_or_else(|p| p.into_inner()).process();
                std::thread::sleep(Duration::from_micros(50));
            }
        }));
    }
    {
        let server = wire::Server {
            s: b,
            bar,
            ctrl: ctrl.clone(),
            log: log.clone(),
            o: opts,
        };
        threads.push(std::thread::spawn(move || server.serve()));
    }
    let fake = FakeNvme {
        ctrl,
        log,
        stop,
        threads,
    };
    (fake, a)
}
