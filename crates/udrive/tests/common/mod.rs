//! Shared setup for udrive's integration tests: in-process controllers on temp
//! sockets, drivers connected to them, raw SQE helpers, status checks, a seeded RNG
//! and a "bystander" controller with a well-behaved client doing verified I/O.
#![allow(dead_code, unused_imports)]

pub mod serve;
pub mod served;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use initiator::cmd::{opc, PSDT_SGL};
use initiator::{Completion, DataMode, DmaBuf, DriverOpts, IoOp, NvmeDriver, QueuePair, Sqe};
use udrive::config::ControllerConfig;
use udrive::device::NvmeDevice;
use udrive::nsspec::NsSpec;

pub use test_support::{wait_until, Rng, T};

/// An IOVA no test ever maps (the driver pool lives at 0x1_0000_0000).
pub const UNMAPPED: u64 = 0x7_0000_0000;

/// One engine (one unpinned reactor) per test process: the machine has 2 cores and
/// every reactor with queues busy-polls.
pub fn engine() -> Arc<engine::Engine> {
    static E: OnceLock<Arc<engine::Engine>> = OnceLock::new();
    E.get_or_init(|| engine::Engine::start(&[None]).expect("start engine"))
        .clone()
}

/// A controller on its own socket in a temp dir; stopped on drop.
pub struct TestDev {
    dev: Option<NvmeDevice>,
    pub sock: PathBuf,
    pub cntlid: u16,
    _dir: tempfile::TempDir,
}

impl TestDev {
    /// `name` becomes the socket file stem, so the serial is `UD-<name>`.
    pub fn start(name: &str, ns: &[&str]) -> TestDev {
        Self::start_with(name, ns, |_| {})
    }

    /// Like [`TestDev::start`], with the configuration adjusted by `tune`.
    pub fn start_with(
        name: &str,
        ns: &[&str],
        tune: impl FnOnce(&mut ControllerConfig),
    ) -> TestDev {
        Self::start_on(&engine(), name, ns, tune)
    }

    /// Like [`TestDev::start_with`], on reactor 0 of `engine` (a test that reads
    /// reactor statistics needs a reactor of its own).
    pub fn start_on(
        engine: &Arc<engine::Engine>,
        name: &str,
        ns: &[&str],
        tune: impl FnOnce(&mut ControllerConfig),
    ) -> TestDev {
        static CNTLID: AtomicU16 = AtomicU16::new(1);
        let dir = tempfile::tempdir().expect("temp dir");
        let sock = dir.path().join(format!("{name}.sock"));
        let specs: Vec<NsSpec> = ns.iter().map(|s| s.parse().expect("ns spec")).collect();
        let mut cfg = ControllerConfig::new(sock.clone(), specs);
        tune(&mut cfg);
        let devs = udrive::backends::open_all(std::slice::from_ref(&cfg))
            .expect("open backends")
            .remove(0);
        let cntlid = CNTLID.fetch_add(1, Ordering::Relaxed);
        let dev = NvmeDevice::start(&cfg, devs, cntlid, engine, 1).expect("start device");
        TestDev {
            dev: Some(dev),
            sock,
            cntlid,
            _dir: dir,
        }
    }

    /// Several controllers whose backends are opened together, as `udrive serve`
    /// does with a config file: namespaces on one file share one opened disk, and
    /// overlapping writable slices are refused.
    pub fn start_all(ctrls: &[(&str, &[&str])]) -> Vec<TestDev> {
        static CNTLID: AtomicU16 = AtomicU16::new(1000);
        let dirs: Vec<tempfile::TempDir> = ctrls
            .iter()
            .map(|_| tempfile::tempdir().expect("temp dir"))
            .collect();
        let cfgs: Vec<ControllerConfig> = ctrls
            .iter()
            .zip(&dirs)
            .map(|((name, ns), dir)| {
                let specs = ns.iter().map(|s| s.parse().expect("ns spec")).collect();
                ControllerConfig::new(dir.path().join(format!("{name}.sock")), specs)
            })
            .collect();
        let backends = udrive::backends::open_all(&cfgs).expect("open backends");
        cfgs.iter()
            .zip(backends)
            .zip(dirs)
            .map(|((cfg, devs), dir)| {
                let cntlid = CNTLID.fetch_add(1, Ordering::Relaxed);
                let dev = NvmeDevice::start(cfg, devs, cntlid, &engine(), 1).expect("start device");
                TestDev {
                    dev: Some(dev),
                    sock: cfg.socket.clone(),
                    cntlid,
                    _dir: dir,
                }
            })
            .collect()
    }

    pub fn ctrl(&self) -> &nvme::Controller {
        &self.dev.as_ref().expect("device running").ctrl
    }

    /// What `get_devices` reports for this controller.
    pub fn json(&self) -> serde_json::Value {
        use udrive::frontend::FrontEnd;
        self.dev.as_ref().expect("device running").json()
    }

    pub fn connect(&self) -> NvmeDriver {
        self.connect_with(opts())
    }

    pub fn connect_with(&self, o: DriverOpts) -> NvmeDriver {
        NvmeDriver::connect(&self.sock, o).expect("connect driver")
    }

    /// A new client brings the controller up and does verified I/O.
    pub fn check_fresh_client(&self, seed: u64) {
        let d = self.connect();
        check_io(&d, seed);
    }
}

impl Drop for TestDev {
    fn drop(&mut self) {
        if let Some(d) = self.dev.take() {
            d.stop();
        }
    }
}

/// Driver options for tests: small pool, 8 I/O queues, admin timeout short enough
/// that a wedged controller fails a test instead of hanging it.
pub fn opts() -> DriverOpts {
    DriverOpts {
        pool_bytes: 16 << 20,
        io_queues: 8,
        admin_timeout: Duration::from_secs(5),
        ..Default::default()
    }
}

/// Submits a raw SQE, rings, waits; the completion whatever its status.
pub fn raw(qp: &mut QueuePair, sqe: Sqe) -> Completion {
    let cid = qp.submit(sqe).expect("submit");
    qp.ring().expect("ring");
    qp.wait(cid, T).expect("completion")
}

/// Read/Write/Flush/Write Zeroes through the driver's PRP/SGL builder.
pub fn io(
    qp: &mut QueuePair,
    op: IoOp,
    nsid: u32,
    slba: u64,
    nlb: u32,
    buf: Option<&DmaBuf>,
    mode: DataMode,
) -> Completion {
    let cid = qp
        .submit_io(op, nsid, slba, nlb, buf, mode)
        .expect("submit_io");
    qp.ring().expect("ring");
    qp.wait(cid, T).expect("completion")
}

#[track_caller]
pub fn assert_ok(c: &Completion, what: &str) {
    assert!(c.status.is_ok(), "{what}: status {}", c.status);
}

/// Checks SCT/SC of a completion.
#[track_caller]
pub fn assert_status(c: &Completion, sct: u8, sc: u8, what: &str) {
    assert_eq!(
        (c.status.sct, c.status.sc),
        (sct, sc),
        "{what}: got {}, want sct={sct:#x} sc={sc:#04x}",
        c.status
    );
}

/// Read/Write SQE with explicit PRP1/PRP2.
pub fn rw_prp(op: u8, nsid: u32, slba: u64, nlb: u32, prp1: u64, prp2: u64) -> Sqe {
    let mut s = Sqe::rw(op, nsid, slba, nlb);
    s.dptr = [prp1, prp2];
    s
}

/// Read/Write SQE whose SGL1 is `desc`.
pub fn rw_sgl(op: u8, nsid: u32, slba: u64, nlb: u32, desc: [u8; 16]) -> Sqe {
    let mut s = Sqe::rw(op, nsid, slba, nlb);
    s.dptr = [
        u64::from_le_bytes(desc[..8].try_into().expect("8 bytes")),
        u64::from_le_bytes(desc[8..].try_into().expect("8 bytes")),
    ];
    s.flags |= PSDT_SGL;
    s
}

pub fn sgl_data(addr: u64, len: u32) -> [u8; 16] {
    initiator::dptr::sgl_desc(addr, len, initiator::dptr::SGL_DATA_BLOCK)
}
pub fn sgl_segment(addr: u64, count: u32) -> [u8; 16] {
    initiator::dptr::sgl_desc(addr, count * 16, initiator::dptr::SGL_SEGMENT)
}
pub fn sgl_last(addr: u64, count: u32) -> [u8; 16] {
    initiator::dptr::sgl_desc(addr, count * 16, initiator::dptr::SGL_LAST_SEGMENT)
}

/// Writes u64 little-endian entries (PRP list) at `off` of `buf`.
pub fn put_u64s(buf: &DmaBuf, off: usize, v: &[u64]) {
    let b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    buf.write(off, &b).expect("list fits");
}

/// Writes SGL descriptors at `off` of `buf`.
pub fn put_descs(buf: &DmaBuf, off: usize, d: &[[u8; 16]]) {
    let b: Vec<u8> = d.iter().flatten().copied().collect();
    buf.write(off, &b).expect("descriptors fit");
}

/// A good read and write on `qp` (namespace 1, 512-byte blocks assumed at LBA
/// `slba`): proves the queue still works after a rejected command.
#[track_caller]
pub fn qp_still_works(qp: &mut QueuePair, slba: u64, seed: u64) {
    let buf = qp.alloc_buf(4096).expect("buffer");
    let data = Rng::new(seed).bytes(4096);
    buf.write(0, &data).expect("fill");
    assert_ok(
        &io(qp, IoOp::Write, 1, slba, 8, Some(&buf), DataMode::Prp),
        "write after hostile command",
    );
    buf.fill(0);
    assert_ok(
        &io(qp, IoOp::Read, 1, slba, 8, Some(&buf), DataMode::Sgl),
        "read after hostile command",
    );
    let mut back = vec![0u8; 4096];
    buf.read(0, &mut back).expect("read back");
    assert!(back == data, "data mismatch after hostile command");
}

/// Verified writes and reads at random LBAs, PRP and SGL, on a new queue pair.
pub fn check_io(d: &NvmeDriver, seed: u64) {
    let ns = d.namespace(1).expect("namespace 1").clone();
    let bs = u64::from(ns.lba_size);
    let mut qp = d.create_qpair(16, false).expect("create queue pair");
    let buf = qp.alloc_buf(64 << 10).expect("buffer");
    let mut rng = Rng::new(seed);
    for i in 0..8u32 {
        let nlb = rng.range(1, (64 << 10) / bs);
        let slba = rng.below(ns.nsze - nlb + 1);
        let len = (nlb * bs) as usize;
        let b = buf.sub(0, len).expect("sub buffer");
        let data = rng.bytes(len);
        b.write(0, &data).expect("fill");
        let mode = if i.is_multiple_of(2) {
            DataMode::Prp
        } else {
            DataMode::Sgl
        };
        let c = io(&mut qp, IoOp::Write, 1, slba, nlb as u32, Some(&b), mode);
        assert_ok(&c, "check_io write");
        b.fill(0);
        let c = io(&mut qp, IoOp::Read, 1, slba, nlb as u32, Some(&b), mode);
        assert_ok(&c, "check_io read");
        let mut back = vec![0u8; len];
        b.read(0, &mut back).expect("read back");
        assert!(back == data, "check_io: data mismatch at LBA {slba} x{nlb}");
    }
    d.delete_qpair(qp).expect("delete queue pair");
}

/// A sparse file of `len` bytes in a directory on a real disk (the target dir), where
/// O_DIRECT works; removed with the returned directory.
pub fn disk_file(name: &str, len: u64) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("temp dir on disk");
    let p = dir.path().join(name);
    std::fs::File::create(&p)
        .and_then(|f| f.set_len(len))
        .expect("create image file");
    (dir, p)
}

/// `len` bytes of `path` at byte `off`, read directly (not through udrive).
pub fn file_bytes(path: &std::path::Path, off: u64, len: usize) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let mut b = vec![0u8; len];
    std::fs::File::open(path)
        .and_then(|f| f.read_exact_at(&mut b, off))
        .expect("read image file");
    b
}

/// Writes `data` at `slba` (namespace 1, 512-byte blocks) from the start of `buf`
/// and reads it back into the same (cleared) buffer.
#[track_caller]
pub fn write_read(qp: &mut QueuePair, buf: &DmaBuf, slba: u64, data: &[u8], mode: DataMode) {
    let nlb = (data.len() / 512) as u32;
    let buf = buf.sub(0, data.len()).expect("buffer large enough");
    buf.write(0, data).expect("fill");
    assert_ok(
        &io(qp, IoOp::Write, 1, slba, nlb, Some(&buf), mode),
        "write",
    );
    buf.fill(0);
    assert_ok(&io(qp, IoOp::Read, 1, slba, nlb, Some(&buf), mode), "read");
    let mut back = vec![0u8; data.len()];
    buf.read(0, &mut back).expect("read back");
    assert!(back == data, "data mismatch at LBA {slba}");
}

/// How often reactor `r` of `e` went to sleep.
pub fn sleeps_on(e: &engine::Engine, r: usize) -> u64 {
    e.stats(r).expect("reactor").sleeps.load(Ordering::Relaxed)
}

/// Reactor `r` of `e`'s poll iterations (published every 4096).
pub fn polls_on(e: &engine::Engine, r: usize) -> u64 {
    e.stats(r)
        .expect("reactor")
        .iterations
        .load(Ordering::Relaxed)
}

/// Waits for CSTS.CFS through the register interface.
pub fn wait_fatal(d: &NvmeDriver) {
    wait_until("CSTS.CFS", T, || {
        d.read_reg32(initiator::regs::CSTS).expect("read CSTS") & initiator::regs::CSTS_CFS != 0
    });
}

/// A second controller with a well-behaved client doing verified I/O for the whole
/// test process, so hostile tests can show the server keeps serving others.
pub struct Bystander {
    _dev: TestDev,
    ops: Arc<AtomicU64>,
    errors: Arc<Mutex<Vec<String>>>,
    _stop: Arc<AtomicBool>,
}

pub fn bystander() -> &'static Bystander {
    static B: OnceLock<Bystander> = OnceLock::new();
    B.get_or_init(|| {
        let dev = TestDev::start("bystander", &["ram:16M"]);
        let d = dev.connect();
        let ops = Arc::new(AtomicU64::new(0));
        let errors = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (o, e, s) = (ops.clone(), errors.clone(), stop.clone());
        std::thread::Builder::new()
            .name("bystander".into())
            .spawn(move || bystander_loop(d, o, e, s))
            .expect("spawn bystander");
        Bystander {
            _dev: dev,
            ops,
            errors,
            _stop: stop,
        }
    })
}

fn bystander_loop(
    d: NvmeDriver,
    ops: Arc<AtomicU64>,
    errors: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
) {
    let fail = |m: String| errors.lock().unwrap_or_else(|e| e.into_inner()).push(m);
    let mut qp = match d.create_qpair(16, false) {
        Ok(q) => q,
        Err(e) => return fail(format!("bystander: create queue pair: {e}")),
    };
    let Ok(buf) = qp.alloc_buf(32 << 10) else {
        return fail("bystander: buffer".into());
    };
    let nsze = d.namespace(1).map_or(0, |n| n.nsze);
    let mut rng = Rng::new(0xb157a);
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let nlb = rng.range(1, 64);
        let slba = rng.below(nsze - nlb + 1);
        let len = (nlb * 512) as usize;
        let Some(b) = buf.sub(0, len) else { break };
        let data = rng.bytes(len);
        let _ = b.write(0, &data);
        let mode = if i.is_multiple_of(2) {
            DataMode::Prp
        } else {
            DataMode::Sgl
        };
        i += 1;
        for op in [IoOp::Write, IoOp::Read] {
            if op == IoOp::Read {
                b.fill(0);
            }
            let r = qp
                .submit_io(op, 1, slba, nlb as u32, Some(&b), mode)
                .and_then(|cid| qp.ring().map(|_| cid))
                .and_then(|cid| qp.wait(cid, T));
            match r {
                Ok(c) if c.status.is_ok() => {}
                Ok(c) => return fail(format!("bystander {op:?} LBA {slba}: {}", c.status)),
                Err(e) => return fail(format!("bystander {op:?} LBA {slba}: {e}")),
            }
        }
        let mut back = vec![0u8; len];
        let _ = b.read(0, &mut back);
        if back != data {
            return fail(format!("bystander: data mismatch at LBA {slba} x{nlb}"));
        }
        ops.fetch_add(1, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(1));
    }
}

impl Bystander {
    /// Asserts the bystander has seen no error and keeps completing verified I/O.
    #[track_caller]
    pub fn check(&self) {
        let start = self.ops.load(Ordering::Relaxed);
        let errs = || {
            self.errors
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
        };
        wait_until("bystander progress", Duration::from_secs(30), || {
            let e = errs();
            assert!(e.is_empty(), "bystander client failed: {e:?}");
            self.ops.load(Ordering::Relaxed) >= start + 5
        });
    }
}

pub use initiator::cmd::opc as op;

/// Convenience: the opcodes tests use most.
pub const READ: u8 = opc::READ;
pub const WRITE: u8 = opc::WRITE;
