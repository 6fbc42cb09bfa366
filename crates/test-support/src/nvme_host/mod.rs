//! A fake NVMe host: drives `nvme::Controller` directly, with no socket, the way a
//! guest's driver would through a vfio-user server.
//!
//! The host owns fake guest memory (one anonymous region of [`MEM_SIZE`] bytes at
//! guest address [`BASE`], handed out page by page), a one-reactor engine the
//! controller's queues run on, and an interrupt sink that counts per vector. It
//! writes BAR0 registers, builds admin and I/O queues in its memory, places
//! commands ([`crate::nvme_cmd`]) and reaps completions by their phase tag, and
//! rings doorbells as register writes (what a vfio-user REGION_WRITE does), or
//! through a shadow doorbell buffer with EventIdx as Linux does once Doorbell
//! Buffer Config succeeded.
//!
//! What it does not model: the vfio-user protocol and its memory map (see
//! [`crate::vfio_server`] for that side), MSI-X tables (interrupts are counted,
//! not delivered), several hosts on one controller, or a driver's timeouts and
//! retries: a command that never completes fails the test after 5 s.

mod commands;
mod layout;
mod queues;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bdev::{BlockDevice, RamDisk};
use engine::{Engine, Placement, Placer};
use guest_mem::{DmaSpace, MappedRegion};
use nvme::{Controller, ControllerConfig, InterruptSink};

pub use layout::{BASE, DOORBELLS, MEM_SIZE, PAGE, Q};

use crate::reactor::{polls_on, sleep_timeouts_on, sleeps_on};
use crate::wait::wait_until;

/// Asynchronous Event Configuration: Namespace Attribute Notices.
pub const AEC_NS_ATTR: u32 = 1 << 8;

/// Counts the interrupts the controller signals, per vector.
pub struct Irqs(pub Vec<AtomicU64>);

impl Irqs {
    pub fn new(vectors: u16) -> Irqs {
        Irqs((0..vectors).map(|_| AtomicU64::new(0)).collect())
    }
}

impl InterruptSink for Irqs {
    fn signal(&self, vector: u16) {
        if let Some(c) = self.0.get(usize::from(vector)) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }
}

pub struct Host {
    pub ctrl: Controller,
    pub mem: Arc<DmaSpace>,
    pub region: Arc<MappedRegion>,
    pub irqs: Arc<Irqs>,
    pub engine: Arc<Engine>,
    next: u64,
    pub admin: Q,
    /// I/O queues by qid (index 0 unused).
    pub io: Vec<Q>,
    cid: u16,
    /// Shadow doorbell buffer (when configured): doorbells go there only...
    pub shadow: Option<u64>,
    /// ...unless the EventIdx buffer is given too: then they are also rung when the
    /// controller's EventIdx asks for it, as Linux does.
    pub event_idx: Option<u64>,
    /// Doorbells rung as register writes (what a vfio-user message does), not
    /// skipped because of EventIdx.
    pub rung: u64,
}

impl Default for Host {
    fn default() -> Host {
        Host::new()
    }
}

impl Host {
    /// A controller with the default configuration and one 64 MiB RAM namespace.
    pub fn new() -> Host {
        let disk: Arc<dyn BlockDevice> = Arc::new(RamDisk::new(64 << 20, 512).expect("RAM disk"));
        Host::with(ControllerConfig::default(), vec![disk])
    }

    /// A controller with `cfg` and namespaces 1.. on `disks`.
    pub fn with(cfg: ControllerConfig, disks: Vec<Arc<dyn BlockDevice>>) -> Host {
        let engine = Engine::start(&[None]).expect("engine");
        let placer = Placer::new(Placement::RoundRobin, 0, 1);
        let mem = DmaSpace::new();
        let region = Arc::new(MappedRegion::anonymous(BASE, MEM_SIZE).expect("guest memory"));
        mem.update(|m| m.with_region(region.clone()))
            .expect("map guest memory");
        let irqs = Arc::new(Irqs::new(cfg.msix_vectors));
        let ctrl = Controller::new(
            cfg,
            disks.into_iter().map(Some).collect(),
            engine.clone(),
            placer,
            mem.clone(),
            irqs.clone(),
        )
        .expect("controller");
        Host {
            ctrl,
            mem,
            region,
            irqs,
            engine,
            next: BASE,
            admin: Q::default(),
            io: vec![Q::default(); 64],
            cid: 0,
            shadow: None,
            event_idx: None,
            rung: 0,
        }
    }

    /// `pages` of page-aligned guest memory, zeroed.
    pub fn alloc(&mut self, pages: u64) -> u64 {
        let a = self.next;
        self.next += pages * PAGE;
        assert!(self.next <= BASE + MEM_SIZE, "fake guest out of memory");
        self.region
            .slice(a - BASE, (pages * PAGE) as usize)
            .expect("in guest memory")
            .fill(0);
        a
    }

    pub fn write_mem(&self, addr: u64, data: &[u8]) {
        self.region
            .slice(addr - BASE, data.len())
            .expect("in guest memory")
            .write_from(0, data)
            .expect("guest write");
    }

    pub fn read_mem(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.region
            .slice(addr - BASE, len)
            .expect("in guest memory")
            .read_into(0, &mut v)
            .expect("guest read");
        v
    }

    fn read_u32(&self, addr: u64) -> u32 {
        u32::from_le_bytes(self.read_mem(addr, 4).try_into().expect("4 bytes"))
    }

    pub fn w32(&self, off: u64, v: u32) {
        self.ctrl.bar0_write(off, &v.to_le_bytes());
    }

    pub fn r32(&self, off: u64) -> u32 {
        let mut b = [0u8; 4];
        self.ctrl.bar0_read(off, &mut b);
        u32::from_le_bytes(b)
    }

    pub fn w64(&self, off: u64, v: u64) {
        self.ctrl.bar0_write(off, &v.to_le_bytes());
    }

    pub fn r64(&self, off: u64) -> u64 {
        let mut b = [0u8; 8];
        self.ctrl.bar0_read(off, &mut b);
        u64::from_le_bytes(b)
    }

    pub fn csts(&self) -> u32 {
        self.r32(0x1c)
    }

    /// Waits until CSTS & `mask` is `want`.
    #[track_caller]
    pub fn wait_csts(&self, mask: u32, want: u32) {
        let what = format!("CSTS & {mask:#x} == {want:#x}");
        wait_until(&what, Duration::from_secs(5), || self.csts() & mask == want);
    }

    /// Programs the admin queue (32 entries) and enables the controller.
    pub fn enable(&mut self) {
        let asq = self.alloc(1);
        let acq = self.alloc(1);
        self.admin = Q::new(asq, acq, 32, 32, 0);
        self.w32(0x24, (31 << 16) | 31);
        self.w64(0x28, asq);
        self.w64(0x30, acq);
        self.w32(0x14, 1 | (6 << 16) | (4 << 20));
        self.wait_csts(1, 1);
    }

    pub fn disable(&mut self) {
        self.w32(0x14, 0);
        self.wait_csts(1, 0);
        self.shadow = None;
        self.event_idx = None;
    }

    pub fn irq_count(&self, v: usize) -> u64 {
        self.irqs.0[v].load(Ordering::Relaxed)
    }

    /// How often the controller's reactor went to sleep.
    pub fn sleeps(&self) -> u64 {
        sleeps_on(&self.engine, 0)
    }

    /// The reactor's sleeps that ran to their time limit (500 ms).
    pub fn sleep_timeouts(&self) -> u64 {
        sleep_timeouts_on(&self.engine, 0)
    }

    /// The reactor's poll iterations (published every 4096).
    pub fn reactor_iterations(&self) -> u64 {
        polls_on(&self.engine, 0)
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.ctrl.shutdown();
        self.engine.shutdown();
    }
}
