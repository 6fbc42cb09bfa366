//! Handing a running NVMe controller over to another one under a client
//! that keeps doing verified I/O on its existing queues: quiesce, save, JSON,
//! restore into a second controller over the same guest memory and doorbell page,
//! switch the transport, shut the old one down. The client must not notice more
//! than a pause: no reset, no request lost or completed twice, every byte right.
//!
//! The transport is a vfio-user server whose device model is a switch: during a
//! handover it holds the client's messages (as a real handover stops reading the
//! client's socket in the old process and starts in the new one after restoring).

mod common;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use bdev::BlockDevice;
use engine::PollMode;
use guest_mem::{DmaSpace, SharedMem};
use initiator::{DataMode, DmaBuf, DriverOpts, IoOp, NvmeDriver, QpairOpts, QueuePair};
use vfio_user::proto::SparseArea;
use vfio_user::{BarSpec, Irqs, MsixSpec, PciBackend, PciDeviceSpec, PciIds, VfioUserServer};

use common::Rng;

const BLOCK: usize = 4096;
const QD: usize = 32;
const QUEUES: usize = 4;
/// Blocks each command slot cycles through (write, read back, verify, next).
const BLOCKS_PER_SLOT: u64 = 4;

/// The device model behind the socket: the controller serving now.
struct Switch(RwLock<nvme::Controller>);

impl Switch {
    fn cur(&self) -> std::sync::RwLockReadGuard<'_, nvme::Controller> {
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

struct IrqSink(Arc<Irqs>);

impl nvme::InterruptSink for IrqSink {
    fn signal(&self, vector: u16) {
        self.0.signal(vector);
    }
}

/// One controller slot on a socket, and what a successor needs to be created.
struct Rig {
    server: Option<VfioUserServer>,
    switch: Arc<Switch>,
    mem: Arc<DmaSpace>,
    irqs: Arc<Irqs>,
    cfg: nvme::ControllerConfig,
    namespaces: Mutex<Vec<Option<Arc<dyn BlockDevice>>>>,
    sock: PathBuf,
    _dir: tempfile::TempDir,
}

fn ram(bytes: u64) -> Arc<dyn BlockDevice> {
    Arc::new(bdev::RamDisk::new(bytes, 512).expect("ram disk"))
}

impl Rig {
    fn start(poll: PollMode) -> Rig {
        Self::start_with(poll, ram(16 << 20))
    }

    /// With `ns` as namespace 1.
    fn start_with(poll: PollMode, ns: Arc<dyn BlockDevice>) -> Rig {
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

    fn controller(
        cfg: &nvme::ControllerConfig,
        namespaces: &[Option<Arc<dyn BlockDevice>>],
        mem: &Arc<DmaSpace>,
        irqs: &Arc<Irqs>,
        doorbells: Option<SharedMem>,
    ) -> nvme::Controller {
        nvme::Controller::with_doorbells(
            cfg.clone(),
            namespaces.to_vec(),
            common::engine(),
            engine::Placer::new(engine::Placement::RoundRobin, 0, 1),
            mem.clone(),
            Arc::new(IrqSink(irqs.clone())),
            doorbells,
        )
        .expect("controller")
    }

    /// A fresh controller as another process would create it: same configuration
    /// and namespaces, same memory, the doorbell page adopted from its fd.
    fn successor(&self, cur: &nvme::Controller) -> nvme::Controller {
        let fd = cur.doorbells().fd().try_clone_to_owned().expect("dup");
        let page = SharedMem::adopt(fd, nvme::DOORBELL_PAGE_LEN).expect("adopt doorbells");
        let ns = self.namespaces.lock().unwrap().clone();
        Self::controller(&self.cfg, &ns, &self.mem, &self.irqs, Some(page))
    }

    fn ctrl(&self) -> nvme::Controller {
        self.switch.cur().clone()
    }

    fn connect(&self, o: DriverOpts) -> NvmeDriver {
        NvmeDriver::connect(&self.sock, o).expect("connect driver")
    }

    /// One handover, with the client's messages held meanwhile. Returns how long
    /// the client's transport was held.
    fn handover(&self) -> Duration {
        self.handover_with_pause(Duration::ZERO)
    }

    /// A handover that stays quiesced for `pause` before saving.
    fn handover_with_pause(&self, pause: Duration) -> Duration {
        let t = Instant::now();
        let mut cur = self.switch.0.write().unwrap();
        cur.quiesce(Duration::from_secs(5)).expect("quiesce");
        std::thread::sleep(pause);
        let st = cur.save_state().expect("save state");
        let json = serde_json::to_string(&st).expect("to JSON");
        let st: nvme::ControllerState = serde_json::from_str(&json).expect("from JSON");
        let next = self.successor(&cur);
        next.restore_state(st).expect("restore state");
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

/// Block `lba`'s contents in generation `gen`.
fn pattern(gen: u64, lba: u64, out: &mut [u8]) {
    let mut x = (gen << 32) ^ lba ^ 0x9e37_79b9_7f4a_7c15;
    for w in out.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        w.copy_from_slice(&x.to_le_bytes());
    }
}

/// One command slot: owns `BLOCKS_PER_SLOT` blocks, writes one, reads it back,
/// verifies, moves on.
struct Slot {
    buf: DmaBuf,
    first: u64,
    lba: u64,
    gen: u64,
    reading: bool,
}

/// What a workload did.
#[derive(Debug, Default)]
struct Done {
    writes: u64,
    reads: u64,
}

/// Keeps `QD` commands in flight on each queue pair until `stop`, then waits for
/// all of them. Panics on a completion it did not expect (lost track, or a second
/// completion of one command), an error status, wrong data, or no progress for
/// 10 s (a lost command).
fn verified_io(qps: &mut [QueuePair], stop: &AtomicBool, progress: &AtomicU64, seed: u64) -> Done {
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
                        pattern(s.gen, s.lba, &mut data);
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
                    pattern(s.gen, s.lba, &mut data);
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

fn qpairs(d: &NvmeDriver) -> Vec<QueuePair> {
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

fn opts(shadow: Option<bool>) -> DriverOpts {
    DriverOpts {
        shadow_doorbells: shadow,
        ..common::opts()
    }
}

/// `rounds` handovers while the client does verified I/O on `QUEUES` queues.
fn handovers_under_io(rig: &Rig, d: &NvmeDriver, rounds: usize, seed: u64) {
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

#[test]
fn handovers_busy_mapped_doorbells() {
    let rig = Rig::start(PollMode::Busy);
    let d = rig.connect(opts(Some(false)));
    assert!(d.doorbells_mapped());
    assert!(!d.shadow_doorbells());
    handovers_under_io(&rig, &d, 50, 1);
}

#[test]
fn handovers_busy_shadow_doorbells() {
    let rig = Rig::start(PollMode::Busy);
    let d = rig.connect(opts(Some(true)));
    assert!(d.shadow_doorbells());
    handovers_under_io(&rig, &d, 50, 2);
    assert!(rig.ctrl().stats().doorbell_buffer_configured);
}

/// Doorbells by message and shadow doorbells (as a Linux guest drives `adaptive`);
/// an Asynchronous Event Request posted to the first controller is completed by
/// the last one.
#[test]
fn handovers_adaptive_with_outstanding_aer() {
    let rig = Rig::start(PollMode::Adaptive);
    let mut d = rig.connect(opts(None));
    assert!(!d.doorbells_mapped());
    assert!(d.shadow_doorbells());
    d.enable_ns_events().expect("enable namespace events");
    handovers_under_io(&rig, &d, 50, 3);
    // A namespace arrives: the AER the client posted long ago reports it.
    let ns2 = ram(1 << 20);
    rig.namespaces.lock().unwrap().push(Some(ns2.clone()));
    rig.ctrl().add_namespace(2, ns2).expect("add namespace");
    rig.handover();
    let ev = d.wait_event(Duration::from_secs(5)).expect("event");
    assert!(ev.is_namespace_change(), "{ev:?}");
    // The Changed Namespace List moved over too.
    assert_eq!(d.rescan_namespaces().expect("rescan"), vec![2]);
    handovers_under_io(&rig, &d, 5, 4);
}

/// Every doorbell a message (no shadow doorbells) and groups that sleep whenever
/// idle: a restored group must still be woken by the next doorbell.
#[test]
fn handovers_event_mode_every_doorbell_a_message() {
    let rig = Rig::start(PollMode::Event);
    let d = rig.connect(opts(Some(false)));
    assert!(!d.doorbells_mapped());
    assert!(!d.shadow_doorbells());
    handovers_under_io(&rig, &d, 50, 5);
    // Idle, then one command at a time: each must wake a sleeping group.
    std::thread::sleep(Duration::from_millis(50));
    let mut qp = d.create_qpair(8, false).expect("queue pair");
    for i in 0..20 {
        rig.handover();
        std::thread::sleep(Duration::from_millis(2));
        common::qp_still_works(&mut qp, 2000 + i, i);
    }
}

/// Quiesce and unquiesce (and a save that is rolled back) under I/O: nothing is
/// fetched while quiesced, and everything goes on afterwards.
#[test]
fn quiesce_rollback_under_io() {
    let rig = Rig::start(PollMode::Busy);
    let d = rig.connect(opts(Some(false)));
    let mut qps = qpairs(&d);
    let stop = AtomicBool::new(false);
    let progress = AtomicU64::new(0);
    let done = std::thread::scope(|s| {
        let io = s.spawn(|| verified_io(&mut qps, &stop, &progress, 7));
        for i in 0..20 {
            let p = progress.load(Ordering::Relaxed);
            while progress.load(Ordering::Relaxed) < p + 200 {
                assert!(!io.is_finished(), "the I/O thread stopped");
                std::thread::sleep(Duration::from_millis(1));
            }
            let ctrl = rig.ctrl();
            ctrl.quiesce(Duration::from_secs(5)).expect("quiesce");
            // Completions posted by the quiesce may still reach the client; the
            // controller's own counters must not move.
            let before = ctrl.stats();
            std::thread::sleep(Duration::from_millis(5));
            if i % 2 == 1 {
                let st = ctrl.save_state().expect("save");
                assert_eq!(st.sqs.len(), QUEUES);
            }
            let after = ctrl.stats();
            assert_eq!(
                (before.reads, before.writes),
                (after.reads, after.writes),
                "commands ran while quiesced"
            );
            ctrl.unquiesce();
        }
        stop.store(true, Ordering::Relaxed);
        io.join().expect("I/O thread")
    });
    assert!(done.reads > 0);
    assert!(!rig.ctrl().stats().fatal);
}

/// A refused handover leaves the old controller serving: quiesce refuses a
/// controller whose client's memory moves by DMA messages, save refuses one
/// that is not quiesced.
#[test]
fn refusals() {
    let rig = Rig::start(PollMode::Busy);
    let d = rig.connect(opts(Some(false)));
    let ctrl = rig.ctrl();
    assert!(matches!(
        ctrl.save_state(),
        Err(nvme::SaveError::NotQuiesced)
    ));
    // Restoring into a controller that is running is refused.
    ctrl.quiesce(Duration::from_secs(1)).unwrap();
    let st = ctrl.save_state().unwrap();
    assert!(matches!(
        ctrl.restore_state(st.clone()),
        Err(nvme::RestoreError::NotFresh)
    ));
    ctrl.unquiesce();
    common::check_io(&d, 11);

    // A client whose memory moves by DMA messages cannot be handed over (yet).
    let rig = Rig::start(PollMode::Adaptive);
    let d = rig.connect(DriverOpts {
        dma_messages: true,
        ..opts(None)
    });
    let ctrl = rig.ctrl();
    assert!(ctrl.dma_messages());
    assert!(matches!(
        ctrl.quiesce(Duration::from_secs(1)),
        Err(nvme::QuiesceError::DmaMessages)
    ));
    common::check_io(&d, 13);
}

/// Corrupt and hostile states: each is refused with an error (no panic), and the
/// controller that refused them is still fresh and takes the good state after.
#[test]
fn hostile_states_are_refused() {
    let rig = Rig::start(PollMode::Busy);
    let d = rig.connect(opts(Some(true)));
    let mut qp = d.create_qpair(16, true).expect("queue pair");
    common::qp_still_works(&mut qp, 10, 1);
    let mut qp2 = d.create_qpair(16, false).expect("queue pair");
    let cur = rig.ctrl();
    cur.quiesce(Duration::from_secs(1)).unwrap();
    let good = serde_json::to_value(cur.save_state().unwrap()).unwrap();
    let next = rig.successor(&cur);

    use nvme::RestoreError as E;
    use serde_json::json;
    type Check = fn(&E) -> bool;
    type Change = Box<dyn Fn(&mut serde_json::Value)>;
    let invalid: Check = |e| matches!(e, E::Invalid(_));
    let unmapped: Check = |e| matches!(e, E::Unmapped { .. });
    let config: Check = |e| matches!(e, E::Config(_));
    let cases: Vec<(&str, Change, Check)> = vec![
        (
            "unknown version",
            Box::new(|v| v["version"] = json!(2)),
            |e| matches!(e, E::Version(2)),
        ),
        (
            "CQ id 0",
            Box::new(|v| v["cqs"][0]["qid"] = json!(0)),
            invalid,
        ),
        (
            "CQ id too big",
            Box::new(|v| v["cqs"][0]["qid"] = json!(500)),
            invalid,
        ),
        (
            "CQ size 0",
            Box::new(|v| v["cqs"][0]["size"] = json!(0)),
            invalid,
        ),
        (
            "CQ too big",
            Box::new(|v| v["cqs"][0]["size"] = json!(65535)),
            invalid,
        ),
        (
            "SQ size 0",
            Box::new(|v| v["sqs"][0]["size"] = json!(0)),
            invalid,
        ),
        (
            "CQ base unaligned",
            Box::new(|v| {
                let b = v["cqs"][0]["base"].as_u64().unwrap();
                v["cqs"][0]["base"] = json!(b + 8);
            }),
            invalid,
        ),
        (
            "SQ unmapped",
            Box::new(|v| v["sqs"][0]["base"] = json!(common::UNMAPPED)),
            unmapped,
        ),
        (
            "CQ vector",
            Box::new(|v| v["cqs"][0]["vector"] = json!(9)),
            invalid,
        ),
        (
            "CQ tail",
            Box::new(|v| v["cqs"][0]["tail"] = json!(16)),
            invalid,
        ),
        (
            "SQ head",
            Box::new(|v| v["sqs"][0]["head"] = json!(65535)),
            invalid,
        ),
        (
            "SQ on no CQ",
            Box::new(|v| v["sqs"][0]["cqid"] = json!(7)),
            invalid,
        ),
        (
            "SQ repeated",
            Box::new(|v| {
                let q = v["sqs"][1]["qid"].clone();
                v["sqs"][0]["qid"] = q;
            }),
            invalid,
        ),
        (
            "admin SQ head",
            Box::new(|v| v["admin"]["sq_head"] = json!(4095)),
            invalid,
        ),
        (
            "AQA",
            Box::new(|v| v["regs"]["aqa"] = json!(u32::MAX)),
            invalid,
        ),
        (
            "CC",
            Box::new(|v| v["regs"]["cc"] = json!(0x460071)),
            invalid,
        ),
        (
            "ASQ unaligned",
            Box::new(|v| v["regs"]["asq"] = json!(0x1000_0010u64)),
            invalid,
        ),
        (
            "ACQ unmapped",
            Box::new(|v| v["regs"]["acq"] = json!(common::UNMAPPED)),
            unmapped,
        ),
        (
            "shadow unmapped",
            Box::new(|v| v["shadow"]["doorbells"] = json!(common::UNMAPPED)),
            unmapped,
        ),
        (
            "vector config",
            Box::new(|v| v["features"]["no_coalesce"] = json!([])),
            invalid,
        ),
        (
            "queues granted",
            Box::new(|v| v["features"]["queues"] = json!(0xffff_ffffu32)),
            config,
        ),
        (
            "AERs",
            Box::new(|v| v["aer_cids"] = json!([1, 2, 3, 4, 5, 6])),
            invalid,
        ),
        (
            "changed NSID",
            Box::new(|v| v["changed_ns"] = json!([0])),
            invalid,
        ),
        (
            "namespaces",
            Box::new(|v| v["namespaces"] = json!([])),
            config,
        ),
        (
            "LBA size",
            Box::new(|v| v["namespaces"][0]["block_size"] = json!(12345)),
            |e| matches!(e, E::Namespace { .. }),
        ),
        (
            "limits",
            Box::new(|v| v["limits"]["max_io_queues"] = json!(3)),
            config,
        ),
        (
            "queues without admin",
            Box::new(|v| v["admin"] = serde_json::Value::Null),
            invalid,
        ),
    ];
    for (what, change, expect) in &cases {
        let mut v = good.clone();
        change(&mut v);
        let st: nvme::ControllerState = serde_json::from_value(v).expect(what);
        match next.restore_state(st) {
            Err(e) => assert!(expect(&e), "{what}: unexpected error {e}"),
            Ok(()) => panic!("{what}: hostile state accepted"),
        }
    }
    // What serde refuses never gets that far.
    for change in [
        json!({"extra": 1}),
        json!({"cqs": "x"}),
        json!({"cqs": [{"qid": -1}]}),
        json!({"version": null}),
    ] {
        let mut v = good.clone();
        for (k, x) in change.as_object().unwrap() {
            v[k] = x.clone();
        }
        assert!(serde_json::from_value::<nvme::ControllerState>(v).is_err());
    }
    // Still fresh: the good state goes in, and the client goes on.
    let st: nvme::ControllerState = serde_json::from_value(good).unwrap();
    next.restore_state(st).expect("restore the good state");
    {
        let mut w = rig.switch.0.write().unwrap();
        let old = std::mem::replace(&mut *w, next);
        drop(w);
        old.shutdown();
    }
    common::qp_still_works(&mut qp, 20, 2);
    common::qp_still_works(&mut qp2, 30, 3);
    common::check_io(&d, 12);
}

/// The state is plain JSON with a version.
#[test]
fn state_is_versioned_json() {
    let rig = Rig::start(PollMode::Adaptive);
    let d = rig.connect(opts(None));
    let _qp = d.create_qpair(32, true).expect("queue pair");
    let ctrl = rig.ctrl();
    ctrl.quiesce(Duration::from_secs(1)).unwrap();
    let st = ctrl.save_state().unwrap();
    ctrl.unquiesce();
    assert_eq!(st.version, nvme::STATE_VERSION);
    let v = serde_json::to_value(&st).unwrap();
    for k in [
        "regs",
        "admin",
        "cqs",
        "sqs",
        "features",
        "shadow",
        "aer_cids",
        "error_log",
    ] {
        assert!(v.get(k).is_some(), "{k} missing");
    }
    assert_eq!(st.cqs.len(), 1);
    assert_eq!((st.cqs[0].size, st.sqs[0].size), (32, 32));
    assert!(st.shadow.is_some());
    assert!(!st.doorbells_mapped);
    let back: nvme::ControllerState =
        serde_json::from_str(&serde_json::to_string(&st).unwrap()).expect("round trip");
    assert_eq!(back, st);
}

/// The Keep Alive Timer stops during the pause (a pause longer than KATO is no
/// timeout) and moves over: without Keep Alive commands the last controller still
/// fails after KATO.
#[test]
fn keep_alive_timer_moves_over() {
    use initiator::cmd::opc;
    use initiator::Sqe;
    let rig = Rig::start(PollMode::Busy);
    let d = rig.connect(opts(Some(false)));
    let ok = |sqe: Sqe, what: &str| {
        let c = d.admin(sqe).expect(what);
        assert!(c.status.is_ok(), "{what}: {}", c.status);
    };
    ok(Sqe::set_features(0x0f, 300), "set KATO 300 ms");
    for _ in 0..3 {
        ok(Sqe::new(opc::KEEP_ALIVE), "keep alive");
        rig.handover_with_pause(Duration::from_millis(450));
        ok(Sqe::new(opc::KEEP_ALIVE), "keep alive after a long pause");
        assert!(!rig.ctrl().stats().fatal);
    }
    common::wait_until("keep alive timeout", Duration::from_secs(5), || {
        rig.ctrl().stats().fatal
    });
}

/// Requests slower than the quiesce timeout: the quiesce fails and the controller
/// runs on (they complete, once); with time enough, the quiesce returns only when
/// their completions are posted.
#[test]
fn quiesce_waits_for_the_backend_or_times_out() {
    let slow = bdev::FaultDisk::new(
        ram(16 << 20),
        bdev::FaultConfig {
            latency: Duration::from_millis(200),
            ..Default::default()
        },
    )
    .expect("fault disk");
    let rig = Rig::start_with(PollMode::Busy, Arc::new(slow));
    let d = rig.connect(opts(Some(false)));
    let mut qp = d.create_qpair(16, true).expect("queue pair");
    let bufs: Vec<DmaBuf> = (0..8).map(|_| qp.alloc_buf(BLOCK).unwrap()).collect();
    let submit = |qp: &mut QueuePair| -> Vec<u16> {
        let cids = bufs
            .iter()
            .enumerate()
            .map(|(i, b)| {
                b.fill(i as u8 + 1);
                qp.submit_io(IoOp::Write, 1, i as u64 * 8, 8, Some(b), DataMode::Prp)
                    .unwrap()
            })
            .collect();
        qp.ring().unwrap();
        // Fetched by the (busy) group.
        std::thread::sleep(Duration::from_millis(20));
        cids
    };
    let ctrl = rig.ctrl();
    let cids = submit(&mut qp);
    match ctrl.quiesce(Duration::from_millis(30)) {
        Err(nvme::QuiesceError::Timeout { requests, .. }) => assert_eq!(requests, 8),
        other => panic!("quiesce with slow requests: {other:?}"),
    }
    for cid in cids {
        let c = qp.wait(cid, Duration::from_secs(5)).expect("completion");
        assert!(c.status.is_ok());
    }
    assert!(qp.poll(16).unwrap().is_empty(), "a completion came twice");
    let cids = submit(&mut qp);
    ctrl.quiesce(Duration::from_secs(5)).expect("quiesce");
    // Posted before the quiesce returned.
    for cid in cids {
        let c = qp
            .try_take(cid)
            .unwrap()
            .expect("completion posted by the quiesce");
        assert!(c.status.is_ok());
    }
    ctrl.unquiesce();
    rig.handover();
    common::qp_still_works(&mut qp, 100, 1);
    assert!(!rig.ctrl().stats().fatal);
}
