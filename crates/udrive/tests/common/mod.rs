//! What udrive's integration tests share that needs udrive's own API: in-process
//! controllers on temp sockets (`TestDev`), the one engine of a test process, and a
//! "bystander" controller with a well-behaved client doing verified I/O. The rest
//! (initiator helpers, SQE builders, fakes) comes from the test-support crate,
//! re-exported here as the tests' prelude.
#![allow(dead_code, unused_imports)]

pub mod bench;
pub mod control;
pub mod rbd;
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

/// A device's part of a process of its own.
pub fn standalone(cfg: &ControllerConfig) -> udrive::process::DeviceLife {
    udrive::process::DeviceLife::standalone(&NvmeDevice::keep_prefix(&cfg.socket))
}

pub use test_support::driver::*;
pub use test_support::nvme_cmd::*;
pub use test_support::reactor::*;
pub use test_support::{wait_until, Rng, T};

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
        let dev = NvmeDevice::start(&cfg, devs, cntlid, engine, 1, standalone(&cfg))
            .expect("start device");
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
                let dev = NvmeDevice::start(cfg, devs, cntlid, &engine(), 1, standalone(cfg))
                    .expect("start device");
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

    /// What the server sent the client as DMA messages so far (read without the
    /// controller's lock, so it answers while a command waits for the client).
    pub fn dma_counts(&self) -> vfio_user::DmaMessageCounts {
        self.dev.as_ref().expect("device running").dma_messages()
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

/// A sparse file of `len` bytes in a directory on a real disk (the target dir), where
/// O_DIRECT works; removed with the returned directory.
pub fn disk_file(name: &str, len: u64) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("temp dir on disk");
    let p = test_support::files::sized_file(dir.path(), name, len);
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
    let v = Verifier {
        seed: 0xb157a,
        max_nlb: 64,
        lbas: u64::MAX,
        pause: Duration::from_millis(1),
    };
    if let Err(e) = verified_io(&d, v, &stop, &ops) {
        errors
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(format!("bystander: {e}"));
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

/// Random writes of 4-64 KiB to namespace 2 (as large as `want`), applied to
/// `want`.
pub fn ns2_writes(qp: &mut QueuePair, buf: &DmaBuf, rng: &mut Rng, want: &mut [u8], n: usize) {
    for _ in 0..n {
        let blocks = rng.range(8, 128);
        let slba = rng.below(want.len() as u64 / 512 - blocks);
        let data = rng.bytes(blocks as usize * 512);
        let b = buf.sub(0, data.len()).unwrap();
        b.write(0, &data).unwrap();
        let c = io(
            qp,
            IoOp::Write,
            2,
            slba,
            blocks as u32,
            Some(&b),
            DataMode::Prp,
        );
        assert_ok(&c, "write");
        let at = slba as usize * 512;
        want[at..at + data.len()].copy_from_slice(&data);
    }
}

/// Namespace 2 (as large as `size`) read whole, 64 KiB at a time through
/// `buf`.
pub fn ns2_read_all(qp: &mut QueuePair, buf: &DmaBuf, size: usize) -> Vec<u8> {
    let step = 64 << 10;
    let mut all = vec![0u8; size];
    for at in (0..size).step_by(step) {
        let c = io(
            qp,
            IoOp::Read,
            2,
            at as u64 / 512,
            128,
            Some(buf),
            DataMode::Prp,
        );
        assert_ok(&c, "read");
        buf.read(0, &mut all[at..at + step]).unwrap();
    }
    all
}
