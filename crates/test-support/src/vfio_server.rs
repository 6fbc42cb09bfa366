//! A vfio-user server on a temp socket in front of a fake PCI device, for tests of
//! the server itself (crates/vfio-user) without an NVMe controller behind it.
//!
//! [`FakeBackend`] is BAR0 as plain bytes: reads return what was written (the first
//! 4 KiB), every write is logged, resets and client departures are counted. It has
//! no device semantics at all: an NVMe controller behind a server is what
//! `crate::nvme_host` (no socket) and udrive's own tests cover. [`Fixture`] starts a
//! `VfioUserServer` for a backend with BAR0 of [`BAR_SIZE`] bytes whose doorbell
//! page is a sparse mmap area, and [`VECTORS`] MSI-X vectors in BAR0 ([`TABLE`],
//! [`PBA`]); clients talk to it with [`crate::vfio_client::RawClient`].

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use guest_mem::{DmaSpace, SharedMem};
use vfio_user::proto::SparseArea;
use vfio_user::{
    BarSpec, Irqs, MsixSpec, PciBackend, PciDeviceSpec, PciIds, ServerConfig, VfioUserServer,
};

use crate::vfio_client::RawClient;
use crate::wait::{wait_until, T};

pub const BAR_SIZE: u64 = 0x4000;
pub const DOORBELLS: u64 = 0x1000;
pub const TABLE: u32 = 0x2000;
pub const PBA: u32 = 0x3000;
pub const VECTORS: u16 = 4;

/// BAR0 as plain bytes, with every write logged.
#[derive(Default)]
pub struct FakeBackend {
    pub regs: Mutex<Vec<u8>>,
    pub writes: Mutex<Vec<(u64, Vec<u8>)>>,
    pub resets: AtomicUsize,
    pub gone: AtomicUsize,
}

impl PciBackend for FakeBackend {
    fn bar_read(&self, _bar: u32, offset: u64, data: &mut [u8]) {
        let r = self.regs.lock().unwrap_or_else(|p| p.into_inner());
        let o = offset as usize;
        if let Some(s) = r.get(o..o + data.len()) {
            data.copy_from_slice(s);
        }
    }
    fn bar_write(&self, _bar: u32, offset: u64, data: &[u8]) {
        let mut r = self.regs.lock().unwrap_or_else(|p| p.into_inner());
        let o = offset as usize;
        if let Some(s) = r.get_mut(o..o + data.len()) {
            s.copy_from_slice(data);
        }
        self.writes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((offset, data.to_vec()));
    }
    fn reset(&self) {
        self.resets.fetch_add(1, Ordering::SeqCst);
    }
    fn client_gone(&self) {
        self.gone.fetch_add(1, Ordering::SeqCst);
    }
}

/// The PCI device the fixture's server presents, BAR0 backed by `bar_mem`.
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
            mmap_fd: Some(bar_mem.fd().try_clone_to_owned().expect("dup BAR fd")),
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

/// A server on a temp socket for `backend`; stopped on drop.
pub struct Fixture<B: PciBackend + 'static = FakeBackend> {
    _dir: tempfile::TempDir,
    pub path: std::path::PathBuf,
    pub server: Option<VfioUserServer>,
    pub backend: Arc<B>,
    pub mem: Arc<DmaSpace>,
    pub irqs: Arc<Irqs>,
    pub bar_mem: SharedMem,
}

impl Fixture<FakeBackend> {
    /// A server for a [`FakeBackend`] with 4 KiB of registers.
    pub fn new() -> Fixture {
        let backend = FakeBackend {
            regs: Mutex::new(vec![0; 0x1000]),
            ..Default::default()
        };
        Fixture::start(|_| backend, vfio_user::DEFAULT_DMA_REPLY_TIMEOUT)
    }

    /// Waits until the server has processed `n` disconnects (client_gone calls).
    #[track_caller]
    pub fn wait_gone(&self, n: usize) {
        wait_until("client_gone", T, || {
            self.backend.gone.load(Ordering::SeqCst) >= n
        });
    }
}

impl Default for Fixture<FakeBackend> {
    fn default() -> Self {
        Fixture::new()
    }
}

impl<B: PciBackend + 'static> Fixture<B> {
    /// A server for the backend `make` builds on the server's DMA space; the
    /// server waits `dma_reply_timeout` for a client's reply to its DMA messages.
    pub fn start(make: impl FnOnce(&Arc<DmaSpace>) -> B, dma_reply_timeout: Duration) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("dev.sock");
        let bar_mem = SharedMem::new("bar0", BAR_SIZE).expect("BAR0 memfd");
        let spec = spec(&bar_mem);
        let mem = DmaSpace::new();
        let backend = Arc::new(make(&mem));
        let irqs = VfioUserServer::irqs_for(&spec);
        let config = ServerConfig {
            access: Default::default(),
            socket: path.clone(),
            name: "test".into(),
            dma_reply_timeout,
            keep: None,
            listener: None,
            start_paused: false,
        };
        let server =
            VfioUserServer::start(config, spec, backend.clone(), mem.clone(), irqs.clone())
                .expect("start server");
        Fixture {
            _dir: dir,
            path,
            server: Some(server),
            backend,
            mem,
            irqs,
            bar_mem,
        }
    }

    /// A raw client connected to the server.
    pub fn raw(&self) -> RawClient {
        RawClient::connect(&self.path)
    }
}

impl<B: PciBackend + 'static> Drop for Fixture<B> {
    fn drop(&mut self) {
        if let Some(s) = self.server.take() {
            s.stop();
        }
    }
}
