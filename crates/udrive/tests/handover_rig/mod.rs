//! The rig of the NVMe controller handover tests (handover_state.rs,
//! handover_refusals.rs): a vfio-user server whose device model is a switch.
//! During a handover it holds the client's messages (as a real handover stops
//! reading the client's socket in the old process and starts in the new one after
//! restoring); and a client doing verified I/O on several queues meanwhile.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use bdev::BlockDevice;
use engine::PollMode;
use guest_mem::{DmaSpace, SharedMem};
use initiator::{DataMode, DmaBuf, DriverOpts, IoOp, NvmeDriver, QpairOpts, QueuePair};
use test_support::pattern::fill_block;
use test_support::Rng;
use vfio_user::proto::SparseArea;
use vfio_user::{BarSpec, Irqs, MsixSpec, PciBackend, PciDeviceSpec, PciIds, VfioUserServer};

pub const BLOCK: usize = 4096;
pub const QD: usize = 32;
pub const QUEUES: usize = 4;
/// Blocks each command slot cycles through (write, read back, verify, next).
pub const BLOCKS_PER_SLOT: u64 = 4;

/// The device model behind the socket: the controller serving now.
pub struct Switch(pub RwLock<nvme::Controller>);

impl Switch {
    pub fn cur(&self) -> std::sync::RwLockReadGuard<'_, nvme::Controller> {
        self.0.read().unwrap_or_else(|e| e.into_inner())
    }
}

impl PciBackend for Switch {
    fn bar_read(&self, bar: u32, offset: u64, data: &mut [u8]) {
        if bar == 0 {
            self.cur().bar0_read(offset, data);
        } else {
            data.fill(0);
        }
    }
    fn bar_write(&self, bar: u32, offset: u64, data: &[u8]) {
        if bar == 0 {
            self.cur().bar0_write(offset, data);
        }
    }
    fn reset(&self) {
        self.cur().reset();
    }
    fn client_gone(&self) {
        self.cur().client_gone();
    }
    fn offer_mmap(&self, bar: u32) -> bool {
        bar == 0 && self.cur().offer_doorbell_mmap()
    }
    fn dma_messages(&self, writable: bool) -> Result<(), i32> {
        self.cur().use_dma_messages(writable)
    }
}

pub struct IrqSink(Arc<Irqs>);

impl nvme::InterruptSink for IrqSink {
    fn signal(&self, vector: u16) {
        self.0.signal(vector);
    }
}

/// One controller slot on a socket, and what a successor needs to be created.
pub struct Rig {
    pub server: Option<VfioUserServer>,
    pub switch: Arc<Switch>,
    pub mem: Arc<DmaSpace>,
    pub irqs: Arc<Irqs>,
    pub cfg: nvme::ControllerConfig,
    pub namespaces: Mutex<Vec<Option<Arc<dyn BlockDevice>>>>,
    pub sock: PathBuf,
    pub _dir: tempfile::TempDir,
}

pub fn ram(bytes: u64) -> Arc<dyn BlockDevice> {
    Arc::new(bdev::RamDisk::new(bytes, 512).expect("ram disk"))
}

impl Rig {
    pub fn start(poll: PollMode) -> Rig {
        Self::start_with(poll, ram(16 << 20))
    }

    /// With `ns` as namespace 1.
    pub fn start_with(poll: PollMode, ns: Arc<dyn BlockDevice>) -> Rig {
        let dir = tempfile::tempdir().expect("temp dir");
        let sock = dir.path().join("handover.sock");
        let cfg = nvme::ControllerConfig {
            max_io_queues: 8,
            msix_vectors: 9,
            poll,
            ..Default::default()
        };
        let mem = DmaSpace::try_new().expect("dma space");
        let irqs = Irqs::new(cfg.msix_vectors);
        let namespaces = vec![Some(ns)];
        let ctrl = Self::controller(&cfg, &namespaces, &mem, &irqs, None);
        let bar0 = nvme::bar0_layout(cfg.msix_vectors);
        let spec = PciDeviceSpec {
            ids: PciIds {
                vendor: nvme::VENDOR_ID,
                device: 0x0dd1,
                subsystem_vendor: nvme::VENDOR_ID,
                subsystem: 0x0dd1,
                class_code: 0x01_08_02,
                revision: 1,
            },
            bar0: BarSpec {
                size: bar0.size,
                mmap_fd: Some(ctrl.doorbells().fd().try_clone_to_owned().expect("dup")),
                fd_offset: 0,
                sparse: vec![SparseArea {
                    offset: nvme::DOORBELL_OFFSET,
                    size: 0x1000,
                }],
            },
            msix: MsixSpec {
                vectors: cfg.msix_vectors,
                table_bar: 0,
                table_offset: bar0.msix_table as u32,
                pba_bar: 0,
                pba_offset: bar0.msix_pba as u32,
            },
        };
        let switch = Arc::new(Switch(RwLock::new(ctrl)));
        let server = VfioUserServer::start(
            vfio_user::ServerConfig {
                socket: sock.clone(),
                access: Default::default(),
                name: "handover".into(),
                dma_reply_timeout: vfio_user::DEFAULT_DMA_REPLY_TIMEOUT,
                keep: None,
                listener: None,
                start_paused: false,
            },
            spec,
            switch.clone(),
            mem.clone(),
            irqs.clone(),
        )
        .expect("vfio-user server");
        Rig {
            server: Some(server),
            switch,
            mem,
            irqs,
            cfg,
            namespaces: Mutex::new(namespaces),
            sock,
            _dir: dir,
        }
    }

    pub fn controller(
        cfg: &nvme::ControllerConfig,
        namespaces: &[Option<Arc<dyn BlockDevice>>],
        mem: &Arc<DmaSpace>,
        irqs: &Arc<Irqs>,
        doorbells: Option<SharedMem>,
    ) -> nvme::Controller {
        nvme::Controller::with_doorbells(
            cfg.clone(),
            namespaces.to_vec(),
            crate::common::engine(),
            engine::Placer::new(engine::Placement::RoundRobin, 0, 1),
            mem.clone(),
            Arc::new(IrqSink(irqs.clone())),
            doorbells,
        )
        .expect("controller")
    }

    /// A fresh controller as another process would create it: same configuration
    /// and namespaces, same memory, the doorbell page adopted from its fd.
    pub fn successor(&self, cur: &nvme::Controller) -> nvme::Controller {
        let fd = cur.doorbells().fd().try_clone_to_owned().expect("dup");
        let page = SharedMem::adopt(fd, nvme::DOORBELL_PAGE_LEN).expect("adopt doorbells");
        let ns = self.namespaces.lock().unwrap().clone();
        Self::controller(&self.cfg, &ns, &self.mem, &self.irqs, Some(page))
    }

    pub fn ctrl(&self) -> nvme::Controller {
        self.switch.cur().clone()
    }

    pub fn connect(&self, o: DriverOpts) -> NvmeDriver {
        NvmeDriver::connect(&self.sock, o).expect("connect driver")
    }

    /// One handover, with the client's messages held meanwhile. Returns how long
    /// the client's transport was held.
    pub fn handover(&self) -> Duration {
        self.handover_with_pause(Duration::ZERO)
    }

    /// A handover that stays paused for `pause` before saving.
    pub fn handover_with_pause(&self, pause: Duration) -> Duration {
        let t = Instant::now();
        let mut cur = self.switch.0.write().unwrap();
        cur.pause(Duration::from_secs(5)).expect("pause");
        std::thread::sleep(pause);
        let st = cur.save().expect("save state");
        let json = serde_json::to_string(&st).expect("to JSON");
        let st: nvme::ControllerState = serde_json::from_str(&json).expect("from JSON");
        let next = self.successor(&cur);
        next.restore(st).expect("restore state");
        let old = std::mem::replace(&mut *cur, next);
        drop(cur);
        let held = t.elapsed();
        old.shutdown();
        held
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        if let Some(s) = self.server.take() {
            s.stop();
        }
        self.ctrl().shutdown();
    }
}

/// One command slot: owns `BLOCKS_PER_SLOT` blocks, writes one, reads it back,
/// verifies, moves on.
pub struct Slot {
    pub buf: DmaBuf,
    pub first: u64,
    pub lba: u64,
    pub gen: u64,
    pub reading: bool,
}

/// What a workload did.
#[derive(Debug, Default)]
pub struct Done {
    pub writes: u64,
    pub reads: u64,
}

/// Keeps `QD` commands in flight on each queue pair until `stop`, then waits for
/// all of them. Panics on a completion it did not expect (lost track, or a second
/// completion of one command), an error status, wrong data, or no progress for
/// 10 s (a lost command).
pub fn verified_io(
    qps: &mut [QueuePair],
    stop: &AtomicBool,
    progress: &AtomicU64,
    seed: u64,
) -> Done {
    let mut rng = Rng::new(seed);
    let mut slots: Vec<Vec<Slot>> = Vec::new();
    for (q, qp) in qps.iter_mut().enumerate() {
        let mut v = Vec::new();
        for i in 0..QD {
            let first = ((q * QD + i) as u64) * BLOCKS_PER_SLOT;
            v.push(Slot {
                buf: qp.alloc_buf(BLOCK).expect("buffer"),
                first,
                lba: first,
                gen: rng.next_u64() >> 40,
                reading: false,
            });
        }
        slots.push(v);
    }
    let mut inflight: Vec<HashMap<u16, usize>> = vec![HashMap::new(); qps.len()];
    let mut data = vec![0u8; BLOCK];
    let mut got = vec![0u8; BLOCK];
    let mut done = Done::default();
    let mut comps = Vec::with_capacity(64);
    let mut last = Instant::now();
    let nlb = (BLOCK / 512) as u32;
    loop {
        let stopping = stop.load(Ordering::Relaxed);
        for (q, qp) in qps.iter_mut().enumerate() {
            if !stopping {
                for (i, s) in slots[q].iter_mut().enumerate() {
                    if inflight[q].values().any(|&k| k == i) {
                        continue;
                    }
                    let op = if s.reading {
                        s.buf.fill(0xee);
                        IoOp::Read
                    } else {
                        fill_block(&mut data, s.gen, s.lba);
                        s.buf.write(0, &data).unwrap();
                        IoOp::Write
                    };
                    let cid = qp
                        .submit_io(op, 1, s.lba * nlb as u64, nlb, Some(&s.buf), DataMode::Prp)
                        .expect("submit");
                    assert!(inflight[q].insert(cid, i).is_none(), "CID {cid} reused");
                }
                qp.ring().expect("ring");
            }
            comps.clear();
            qp.poll_into(64, &mut comps).expect("poll");
            for c in &comps {
                let Some(i) = inflight[q].remove(&c.cid) else {
                    panic!(
                        "queue {}: completion of CID {} that is not in flight (twice?)",
                        qp.qid(),
                        c.cid
                    );
                };
                assert!(c.status.is_ok(), "queue {}: status {}", qp.qid(), c.status);
                let s = &mut slots[q][i];
                if s.reading {
                    s.buf.read(0, &mut got).unwrap();
                    fill_block(&mut data, s.gen, s.lba);
                    assert!(
                        got == data,
                        "queue {} block {}: wrong data",
                        qp.qid(),
                        s.lba
                    );
                    done.reads += 1;
                    s.lba = s.first + (s.lba + 1 - s.first) % BLOCKS_PER_SLOT;
                    s.gen += 1;
                } else {
                    done.writes += 1;
                }
                s.reading = !s.reading;
                last = Instant::now();
                progress.fetch_add(1, Ordering::Relaxed);
            }
        }
        let left: usize = inflight.iter().map(HashMap::len).sum();
        if stopping && left == 0 {
            return done;
        }
        assert!(
            last.elapsed() < Duration::from_secs(10),
            "no completion for 10 s with {left} commands in flight (lost?)"
        );
        if comps.is_empty() {
            std::thread::yield_now();
        }
    }
}

pub fn qpairs(d: &NvmeDriver) -> Vec<QueuePair> {
    (0..QUEUES)
        .map(|_| {
            d.create_qpair_with(QpairOpts {
                depth: 64,
                interrupts: true,
                data_bytes: (QD * BLOCK) as u64,
                ..Default::default()
            })
            .expect("queue pair")
        })
        .collect()
}

pub fn opts(shadow: Option<bool>) -> DriverOpts {
    DriverOpts {
        shadow_doorbells: shadow,
        ..crate::common::opts()
    }
}

/// `rounds` handovers while the client does verified I/O on `QUEUES` queues.
pub fn handovers_under_io(rig: &Rig, d: &NvmeDriver, rounds: usize, seed: u64) {
    let mut qps = qpairs(d);
    let stop = AtomicBool::new(false);
    let progress = AtomicU64::new(0);
    let mut rng = Rng::new(seed);
    let (done, held) = std::thread::scope(|s| {
        let io = s.spawn(|| verified_io(&mut qps, &stop, &progress, seed));
        let mut held = Duration::ZERO;
        for _ in 0..rounds {
            // Let I/O run (and make progress) between two handovers.
            let p = progress.load(Ordering::Relaxed);
            let until = Instant::now() + Duration::from_millis(rng.range(2, 15));
            while Instant::now() < until || progress.load(Ordering::Relaxed) < p + 64 {
                assert!(!io.is_finished(), "the I/O thread stopped");
                std::thread::sleep(Duration::from_millis(1));
            }
            held = held.max(rig.handover());
        }
        std::thread::sleep(Duration::from_millis(20));
        stop.store(true, Ordering::Relaxed);
        (io.join().expect("I/O thread"), held)
    });
    eprintln!("{rounds} handovers: {done:?}, longest hold {held:?}");
    assert!(done.reads > 0 && done.writes > 0);
    let st = rig.ctrl().stats();
    assert!(!st.fatal, "controller fatal after handovers");
    assert_eq!(st.io_errors, 0);
    // The counters moved over: everything this client did is counted.
    assert!(st.reads >= done.reads && st.writes >= done.writes, "{st:?}");
    // The queues are the client's own: delete them cleanly.
    for qp in qps {
        d.delete_qpair(qp).expect("delete queue pair");
    }
}
