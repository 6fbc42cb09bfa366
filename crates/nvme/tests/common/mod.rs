//! A fake host: guest memory, register accesses, admin and I/O queues.
#![allow(dead_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bdev::{BlockDevice, RamDisk};
use engine::{Engine, Placement, Placer};
use guest_mem::{DmaSpace, MappedRegion};
use nvme::{Controller, ControllerConfig, InterruptSink};

pub const BASE: u64 = 0x10_0000;
pub const MEM_SIZE: u64 = 32 << 20;
pub const PAGE: u64 = 4096;

pub struct Irqs(pub Vec<AtomicU64>);
impl InterruptSink for Irqs {
    fn signal(&self, vector: u16) {
        if let Some(c) = self.0.get(usize::from(vector)) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cqe {
    pub dw0: u32,
    pub sq_head: u16,
    pub sqid: u16,
    pub cid: u16,
    /// Status field without phase: SC bits 7:0, SCT 10:8, DNR 14.
    pub status: u16,
}
impl Cqe {
    pub fn sc(&self) -> u8 {
        self.status as u8
    }
    pub fn sct(&self) -> u8 {
        ((self.status >> 8) & 7) as u8
    }
    pub fn ok(&self) -> bool {
        self.status & 0x7ff == 0
    }
    /// (sct, sc)
    pub fn code(&self) -> (u8, u8) {
        (self.sct(), self.sc())
    }
}

#[derive(Default, Clone, Copy)]
pub struct Q {
    pub sq: u64,
    pub cq: u64,
    pub size: u16,
    pub cq_size: u16,
    /// CQ this SQ posts to.
    pub cqid: u16,
    pub tail: u16,
    pub head: u16,
    pub phase: bool,
}

pub struct Host {
    pub ctrl: Controller,
    pub mem: Arc<DmaSpace>,
    pub region: Arc<MappedRegion>,
    pub irqs: Arc<Irqs>,
    pub engine: Arc<Engine>,
    next: u64,
    pub admin: Q,
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

/// BAR0 offset of the doorbells (stride 4: CAP.DSTRD 0).
const DOORBELLS: u64 = 0x1000;

/// Byte offset of queue `qid`'s SQ tail (or, with `cq`, CQ head) doorbell among the
/// doorbells, and in a shadow doorbell buffer.
fn db_index(qid: u16, cq: bool) -> u64 {
    (u64::from(qid) * 2 + u64::from(cq)) * 4
}

/// Polls `f` until it holds; fails the test with `what` after 10 s.
pub fn wait_until(what: &str, f: impl Fn() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(10), "{what}");
        std::thread::sleep(Duration::from_micros(200));
    }
}

pub fn sqe(opcode: u8, nsid: u32) -> [u32; 16] {
    let mut s = [0u32; 16];
    s[0] = u32::from(opcode);
    s[1] = nsid;
    s
}

pub fn set_prp(s: &mut [u32; 16], prp1: u64, prp2: u64) {
    s[6] = prp1 as u32;
    s[7] = (prp1 >> 32) as u32;
    s[8] = prp2 as u32;
    s[9] = (prp2 >> 32) as u32;
}

pub fn sgl_desc(addr: u64, len: u32, kind: u8) -> [u8; 16] {
    let mut d = [0u8; 16];
    d[..8].copy_from_slice(&addr.to_le_bytes());
    d[8..12].copy_from_slice(&len.to_le_bytes());
    d[15] = kind << 4;
    d
}

pub fn set_sgl(s: &mut [u32; 16], d: [u8; 16]) {
    s[0] |= 1 << 14;
    for i in 0..4 {
        s[6 + i] = u32::from_le_bytes([d[i * 4], d[i * 4 + 1], d[i * 4 + 2], d[i * 4 + 3]]);
    }
}

/// Read/Write command (op 1 = write, 2 = read).
pub fn rw(op: u8, nsid: u32, slba: u64, nlb: u16, prp1: u64, prp2: u64) -> [u32; 16] {
    let mut s = sqe(op, nsid);
    set_prp(&mut s, prp1, prp2);
    s[10] = slba as u32;
    s[11] = (slba >> 32) as u32;
    s[12] = u32::from(nlb.wrapping_sub(1));
    s
}

impl Host {
    pub fn new() -> Host {
        let disk: Arc<dyn BlockDevice> = Arc::new(RamDisk::new(64 << 20, 512).unwrap());
        Host::with(ControllerConfig::default(), vec![disk])
    }

    pub fn with(cfg: ControllerConfig, disks: Vec<Arc<dyn BlockDevice>>) -> Host {
        let engine = Engine::start(&[None]).unwrap();
        let placer = Placer::new(Placement::RoundRobin, 0, 1);
        let mem = DmaSpace::new();
        let region = Arc::new(MappedRegion::anonymous(BASE, MEM_SIZE).unwrap());
        mem.update(|m| m.with_region(region.clone())).unwrap();
        let irqs = Arc::new(Irqs(
            (0..usize::from(cfg.msix_vectors))
                .map(|_| AtomicU64::new(0))
                .collect(),
        ));
        let ctrl = Controller::new(
            cfg,
            disks.into_iter().map(Some).collect(),
            engine.clone(),
            placer,
            mem.clone(),
            irqs.clone(),
        )
        .unwrap();
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

    /// Page-aligned guest memory, zeroed.
    pub fn alloc(&mut self, pages: u64) -> u64 {
        let a = self.next;
        self.next += pages * PAGE;
        assert!(self.next <= BASE + MEM_SIZE, "fake guest out of memory");
        self.region
            .slice(a - BASE, (pages * PAGE) as usize)
            .unwrap()
            .fill(0);
        a
    }

    pub fn write_mem(&self, addr: u64, data: &[u8]) {
        self.region
            .slice(addr - BASE, data.len())
            .unwrap()
            .write_from(0, data)
            .unwrap();
    }
    pub fn read_mem(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.region
            .slice(addr - BASE, len)
            .unwrap()
            .read_into(0, &mut v)
            .unwrap();
        v
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

    pub fn wait_csts(&self, mask: u32, want: u32) {
        let t = Instant::now();
        while self.csts() & mask != want {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "CSTS {:#x}",
                self.csts()
            );
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    /// Programs the admin queue (32 entries) and enables the controller.
    pub fn enable(&mut self) {
        let asq = self.alloc(1);
        let acq = self.alloc(1);
        self.admin = Q {
            sq: asq,
            cq: acq,
            size: 32,
            cq_size: 32,
            cqid: 0,
            tail: 0,
            head: 0,
            phase: true,
        };
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

    /// Rings like a client whose doorbells are trapped: each ring is a register
    /// write, which also wakes the poller that owns the queue.
    fn ring(&mut self, qid: u16, cq: bool, v: u16) {
        let idx = db_index(qid, cq);
        if let (Some(db), true) = (self.shadow, qid != 0) {
            let old = u32::from_le_bytes(self.read_mem(db + idx, 4).try_into().unwrap()) as u16;
            self.write_mem(db + idx, &u32::from(v).to_le_bytes());
            std::sync::atomic::fence(Ordering::SeqCst);
            let Some(ei) = self.event_idx else { return };
            let e = u32::from_le_bytes(self.read_mem(ei + idx, 4).try_into().unwrap()) as u16;
            if v.wrapping_sub(e).wrapping_sub(1) >= v.wrapping_sub(old) {
                return;
            }
        }
        self.rung += 1;
        self.ctrl
            .bar0_write(DOORBELLS + idx, &u32::from(v).to_le_bytes());
    }

    /// Rings a raw SQ tail value (for hostile tests).
    pub fn ring_sq_raw(&mut self, qid: u16, v: u16) {
        self.ring(qid, false, v);
    }

    /// Stores a raw CQ head value into the doorbell page, as a client that mapped
    /// the page does (no message: nothing checks it until the controller reads it).
    pub fn store_cq_head_raw(&self, qid: u16, v: u16) {
        let off = usize::try_from(DOORBELLS + db_index(qid, true)).unwrap();
        self.ctrl
            .doorbells()
            .all()
            .store_u32(off, u32::from(v))
            .unwrap();
    }

    /// The phase tag of every entry of the CQ that SQ `qid` posts to, as the
    /// controller left it (without consuming anything).
    pub fn cq_phases(&mut self, qid: u16) -> Vec<bool> {
        let q = *self.q(qid);
        (0..u64::from(q.cq_size))
            .map(|i| self.read_mem(q.cq + i * 16 + 14, 1)[0] & 1 == 1)
            .collect()
    }

    fn q(&mut self, qid: u16) -> &mut Q {
        if qid == 0 {
            &mut self.admin
        } else {
            &mut self.io[usize::from(qid)]
        }
    }

    /// Places a command in queue `qid` and rings the doorbell; returns its CID.
    pub fn submit(&mut self, qid: u16, mut s: [u32; 16]) -> u16 {
        self.cid = self.cid.wrapping_add(1);
        let cid = self.cid;
        s[0] = (s[0] & 0xffff) | (u32::from(cid) << 16);
        let q = *self.q(qid);
        let bytes: Vec<u8> = s.iter().flat_map(|d| d.to_le_bytes()).collect();
        self.write_mem(q.sq + u64::from(q.tail) * 64, &bytes);
        let tail = (q.tail + 1) % q.size;
        self.q(qid).tail = tail;
        self.ring(qid, false, tail);
        cid
    }

    /// Places commands in queue `qid` and rings its doorbell once, so the
    /// controller sees them as one batch; returns their CIDs.
    pub fn submit_batch(&mut self, qid: u16, cmds: &[[u32; 16]]) -> Vec<u16> {
        let mut cids = Vec::new();
        for &c in cmds {
            let mut s = c;
            self.cid = self.cid.wrapping_add(1);
            s[0] = (s[0] & 0xffff) | (u32::from(self.cid) << 16);
            cids.push(self.cid);
            let q = *self.q(qid);
            let bytes: Vec<u8> = s.iter().flat_map(|d| d.to_le_bytes()).collect();
            self.write_mem(q.sq + u64::from(q.tail) * 64, &bytes);
            self.q(qid).tail = (q.tail + 1) % q.size;
        }
        let tail = self.q(qid).tail;
        self.ring(qid, false, tail);
        cids
    }

    /// Next CQE of queue `qid`, if posted.
    pub fn try_reap(&mut self, qid: u16) -> Option<Cqe> {
        let q = *self.q(qid);
        let off = q.cq + u64::from(q.head) * 16;
        let dw3 = self
            .region
            .slice(off - BASE, 16)
            .unwrap()
            .load_u32(12)
            .unwrap();
        if ((dw3 >> 16) & 1 == 1) != q.phase {
            return None;
        }
        let b = self.read_mem(off, 16);
        let d = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let cqe = Cqe {
            dw0: d(0),
            sq_head: d(8) as u16,
            sqid: (d(8) >> 16) as u16,
            cid: dw3 as u16,
            status: ((dw3 >> 17) & 0x7fff) as u16,
        };
        let mut head = q.head + 1;
        let mut phase = q.phase;
        if head == q.cq_size {
            head = 0;
            phase = !phase;
        }
        let qq = self.q(qid);
        qq.head = head;
        qq.phase = phase;
        self.ring(qid, true, head);
        Some(cqe)
    }

    pub fn reap(&mut self, qid: u16) -> Cqe {
        let t = Instant::now();
        loop {
            if let Some(c) = self.try_reap(qid) {
                return c;
            }
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "no completion on queue {qid}"
            );
            std::thread::sleep(Duration::from_micros(20));
        }
    }

    /// Submit and wait for the completion.
    pub fn cmd(&mut self, qid: u16, s: [u32; 16]) -> Cqe {
        let cid = self.submit(qid, s);
        let cq = self.q(qid).cqid;
        let c = self.reap(cq);
        assert_eq!(c.cid, cid);
        c
    }

    pub fn admin(&mut self, s: [u32; 16]) -> Cqe {
        self.cmd(0, s)
    }

    pub fn create_cq(&mut self, qid: u16, size: u16, ien: bool, vector: u16) -> Cqe {
        let cq = self.alloc((u64::from(size) * 16).div_ceil(PAGE));
        let mut s = sqe(0x05, 0);
        set_prp(&mut s, cq, 0);
        s[10] = u32::from(qid) | (u32::from(size.wrapping_sub(1)) << 16);
        s[11] = 1 | (u32::from(ien) << 1) | (u32::from(vector) << 16);
        let c = self.admin(s);
        if c.ok() {
            let q = &mut self.io[usize::from(qid)];
            q.cq = cq;
            q.cq_size = size;
            q.head = 0;
            q.phase = true;
        }
        c
    }

    pub fn create_sq(&mut self, qid: u16, size: u16, cqid: u16) -> Cqe {
        let sq = self.alloc((u64::from(size) * 64).div_ceil(PAGE));
        let mut s = sqe(0x01, 0);
        set_prp(&mut s, sq, 0);
        s[10] = u32::from(qid) | (u32::from(size.wrapping_sub(1)) << 16);
        s[11] = 1 | (u32::from(cqid) << 16);
        let c = self.admin(s);
        if c.ok() {
            let q = &mut self.io[usize::from(qid)];
            q.sq = sq;
            q.size = size;
            q.cqid = cqid;
            q.tail = 0;
        }
        c
    }

    /// Enable + one I/O queue pair (qid 1, 64 entries, vector 1).
    pub fn ready(&mut self, ien: bool) {
        self.enable();
        assert!(self.create_cq(1, 64, ien, 1).ok());
        assert!(self.create_sq(1, 64, 1).ok());
    }

    /// Enables the controller with Doorbell Buffer Config (shadow doorbells and
    /// EventIdx, one page each, as Linux uses them) and one I/O queue pair with
    /// interrupts; returns the EventIdx page's address.
    pub fn ready_with_shadow(&mut self) -> u64 {
        self.enable();
        let db = self.alloc(1);
        let ei = self.alloc(1);
        let mut s = sqe(0x7c, 0);
        set_prp(&mut s, db, ei);
        assert!(self.admin(s).ok());
        self.shadow = Some(db);
        self.event_idx = Some(ei);
        assert!(self.create_cq(1, 64, true, 1).ok());
        assert!(self.create_sq(1, 64, 1).ok());
        ei
    }

    pub fn io(&mut self, s: [u32; 16]) -> Cqe {
        self.cmd(1, s)
    }

    pub fn irq_count(&self, v: usize) -> u64 {
        self.irqs.0[v].load(Ordering::Relaxed)
    }

    /// How often the controller's reactor went to sleep.
    pub fn sleeps(&self) -> u64 {
        self.engine.stats(0).unwrap().sleeps.load(Ordering::Relaxed)
    }

    /// The reactor's poll iterations (published every 4096).
    pub fn reactor_iterations(&self) -> u64 {
        self.engine
            .stats(0)
            .unwrap()
            .iterations
            .load(Ordering::Relaxed)
    }

    /// The EventIdx the controller published for SQ 1 in the shadow doorbell
    /// buffer's EventIdx page at `ei` (from [`Host::ready_with_shadow`]).
    pub fn sq1_event_idx(&self, ei: u64) -> u16 {
        u32::from_le_bytes(self.read_mem(ei + 8, 4).try_into().unwrap()) as u16
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.ctrl.shutdown();
        self.engine.shutdown();
    }
}

/// A RAM disk whose requests complete only while the gate is open (and which may
/// be formatted like the RAM disk).
pub struct Gated {
    pub ram: RamDisk,
    pub open: Arc<std::sync::atomic::AtomicBool>,
}
pub struct GatedChan {
    inner: Box<dyn bdev::IoChannel>,
    open: Arc<std::sync::atomic::AtomicBool>,
    held: Vec<(u64, bdev::IoStatus)>,
}
impl BlockDevice for Gated {
    fn describe(&self) -> String {
        "gated".into()
    }
    fn info(&self) -> &bdev::BlockInfo {
        self.ram.info()
    }
    fn channel(&self) -> std::io::Result<Box<dyn bdev::IoChannel>> {
        Ok(Box::new(GatedChan {
            inner: self.ram.channel()?,
            open: self.open.clone(),
            held: Vec::new(),
        }))
    }
    fn format_support(&self) -> bdev::FormatSupport {
        self.ram.format_support()
    }
}
impl bdev::IoChannel for GatedChan {
    fn submit(&mut self, tag: u64, req: &bdev::IoRequest<'_>) -> Option<bdev::IoStatus> {
        let st = self
            .inner
            .submit(tag, req)
            .unwrap_or(bdev::IoStatus::IoError);
        self.held.push((tag, st));
        None
    }
    fn poll(&mut self, done: &mut dyn FnMut(u64, bdev::IoStatus)) -> usize {
        if !self.open.load(std::sync::atomic::Ordering::Acquire) {
            return 0;
        }
        let n = self.held.len();
        for (t, s) in self.held.drain(..) {
            done(t, s);
        }
        n
    }
}
