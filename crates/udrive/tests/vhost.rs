//! vhost-user-blk devices with libblkio as the client: the workload generator across
//! queues with verification, then flush, discard, write zeroes and bad requests.

use std::mem::MaybeUninit;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};
use initiator::workload::{self, Rw, WorkloadConfig};
use udrive::blkio_target::BlkioTarget;
use udrive::vhost_device::{self, VhostBlkConfig};
use vhost_user_blk::VhostUserBlk;

fn engine() -> Arc<engine::Engine> {
    static E: OnceLock<Arc<engine::Engine>> = OnceLock::new();
    E.get_or_init(|| engine::Engine::start(&[None]).expect("start engine"))
        .clone()
}

struct Dev {
    dev: Option<VhostUserBlk>,
    sock: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Dev {
    fn drop(&mut self) {
        if let Some(d) = self.dev.take() {
            d.stop();
        }
    }
}

fn start(disk: &str, queues: u16, poll: &str) -> Dev {
    start_in(tempfile::tempdir().unwrap(), disk, queues, poll)
}

fn start_in(dir: tempfile::TempDir, disk: &str, queues: u16, poll: &str) -> Dev {
    let sock = dir.path().join("blk.sock");
    let mut cfg = VhostBlkConfig::new(sock.clone(), disk.parse().unwrap());
    cfg.queues = queues;
    cfg.poll = poll.into();
    let c = udrive::config::Config {
        cpus: "0".into(),
        controllers: vec![],
        vhost_user_blk: vec![cfg],
    };
    c.validate().unwrap();
    let (_, disks) = vhost_device::open_backends(&c).unwrap();
    let dev = vhost_device::start_all(&c, disks, &engine(), 1)
        .unwrap()
        .remove(0);
    Dev {
        dev: Some(dev),
        sock,
        _dir: dir,
    }
}

fn run(sock: &Path, rw: Rw, jobs: u32, qd: u32) -> workload::Report {
    let cfg = WorkloadConfig {
        rw,
        bs: 4096,
        qd,
        jobs,
        time: Duration::from_millis(500),
        verify: true,
        ..Default::default()
    };
    let t = BlkioTarget::connect(sock, jobs, qd, 4096).expect("connect libblkio");
    workload::run(&t, &cfg).expect("workload")
}

#[test]
fn verified_io_across_queues() {
    for poll in ["busy", "event"] {
        let d = start("ram:16M", 2, poll);
        let r = run(&d.sock, Rw::RandRw { read_pct: 50 }, 2, 8);
        assert!(r.ios > 0, "{poll}: no I/O done");
        assert_eq!((r.errors, r.verify_errors), (0, 0), "{poll}");
        // A second client after the first disconnected.
        let r = run(&d.sock, Rw::RandRead, 1, 4);
        assert_eq!((r.errors, r.verify_errors), (0, 0), "{poll}");
        assert_eq!(d.dev.as_ref().unwrap().connections(), 2);
    }
}

/// A raw libblkio session with one queue and one 64 KiB buffer.
struct Session {
    q: Blkioq,
    region: MemoryRegion,
    b: Blkio,
    comps: Vec<MaybeUninit<Completion>>,
}

impl Session {
    fn open(sock: &Path) -> Session {
        Self::open_with(sock, false)
    }

    fn open_with(sock: &Path, read_only: bool) -> Session {
        let mut b = Blkio::new("virtio-blk-vhost-user").unwrap();
        b.set_str("path", sock.to_str().unwrap()).unwrap();
        b.set_bool("read-only", read_only).unwrap();
        b.connect().unwrap();
        b.set_i32("num-queues", 1).unwrap();
        let mut s = b.start().unwrap();
        let region = b.alloc_mem_region(64 << 10).unwrap();
        b.map_mem_region(&region).unwrap();
        Session {
            q: s.queues.remove(0),
            region,
            b,
            comps: (0..4).map(|_| MaybeUninit::uninit()).collect(),
        }
    }

    fn buf(&self) -> *mut u8 {
        self.region.addr as *mut u8
    }

    fn fill(&self, byte: u8, len: usize) {
        assert!(len <= self.region.len);
        // SAFETY: the region is mapped read/write for the session's lifetime.
        unsafe { std::ptr::write_bytes(self.buf(), byte, len) };
    }

    fn bytes(&self, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        // SAFETY: as above; no request is in flight when this is called.
        unsafe { std::ptr::copy_nonoverlapping(self.buf(), v.as_mut_ptr(), len) };
        v
    }

    /// Waits for the one outstanding request; its `ret` (0 or -errno).
    fn wait(&mut self) -> i32 {
        let mut t = Duration::from_secs(10);
        let n = self
            .q
            .do_io(&mut self.comps, 1, Some(&mut t), None)
            .expect("do_io");
        assert_eq!(n, 1, "request did not complete");
        // SAFETY: do_io initialised one completion.
        unsafe { self.comps[0].assume_init_ref() }.ret
    }

    fn read(&mut self, off: u64, len: usize) -> i32 {
        self.q.read(off, self.buf(), len, 1, ReqFlags::empty());
        self.wait()
    }
    fn write(&mut self, off: u64, len: usize) -> i32 {
        self.q.write(off, self.buf(), len, 1, ReqFlags::empty());
        self.wait()
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.b.unmap_mem_region(&self.region);
        self.b.free_mem_region(&self.region);
    }
}

#[test]
fn flush_discard_write_zeroes_and_bad_requests() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(8 << 20)
        .unwrap();
    let d = start_in(dir, &format!("file:{}", img.display()), 1, "busy");
    let mut s = Session::open(&d.sock);
    assert_eq!(s.b.get_u64("capacity").unwrap(), 8 << 20);

    s.fill(0xa5, 16384);
    assert_eq!(s.write(0, 16384), 0);
    s.q.flush(2, ReqFlags::empty());
    assert_eq!(s.wait(), 0);
    // The bytes are in the file once the flush completed.
    let on_disk = std::fs::read(&img).unwrap();
    assert!(on_disk[..16384].iter().all(|b| *b == 0xa5));

    s.q.write_zeroes(4096, 4096, 3, ReqFlags::empty());
    assert_eq!(s.wait(), 0);
    s.q.discard(8192, 4096, 4, ReqFlags::empty());
    assert_eq!(s.wait(), 0);
    s.fill(0xff, 16384);
    assert_eq!(s.read(0, 16384), 0);
    let back = s.bytes(16384);
    assert!(back[..4096].iter().all(|b| *b == 0xa5));
    assert!(
        back[4096..12288].iter().all(|b| *b == 0),
        "zeroed and discarded"
    );
    assert!(back[12288..].iter().all(|b| *b == 0xa5));

    // Beyond the end, partly beyond the end: errors, and the device goes on.
    assert_ne!(s.read(8 << 20, 4096), 0);
    assert_ne!(s.write((8 << 20) - 4096, 8192), 0);
    s.q.discard(8 << 20, 4096, 5, ReqFlags::empty());
    assert_ne!(s.wait(), 0);
    assert_eq!(s.read(0, 4096), 0);
}

#[test]
fn read_only_disk_refuses_writes() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("ro.img");
    std::fs::write(&img, vec![0x3cu8; 1 << 20]).unwrap();
    let d = start_in(dir, &format!("file:{},ro", img.display()), 1, "busy");
    // libblkio sees VIRTIO_BLK_F_RO and refuses a read-write session itself (the
    // device's own refusal of writes is covered by the virtio-blk unit tests).
    let mut b = Blkio::new("virtio-blk-vhost-user").unwrap();
    b.set_str("path", d.sock.to_str().unwrap()).unwrap();
    let refused = b.connect().is_err() || b.start().is_err();
    assert!(refused, "read-write session on a read-only device");
    drop(b);
    let mut s = Session::open_with(&d.sock, true);
    assert_eq!(s.read(0, 4096), 0);
    assert!(s.bytes(4096).iter().all(|b| *b == 0x3c));
}

/// libblkio adds and removes memory regions (ADD/REM_MEM_REGION or SET_MEM_TABLE)
/// on one thread while another keeps verified I/O going on the device.
#[test]
fn memory_table_changes_under_load() {
    let d = start("ram:8M", 1, "busy");
    let mut s = Session::open(&d.sock);
    let Session { q, region, b, .. } = &mut s;
    let addr = region.addr;
    let stop = std::sync::atomic::AtomicBool::new(false);
    let stop = &stop;
    let rounds = std::thread::scope(|sc| {
        let io = sc.spawn(move || {
            let buf = addr as *mut u8;
            let mut comps: Vec<MaybeUninit<Completion>> =
                (0..1).map(|_| MaybeUninit::uninit()).collect();
            let mut n = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) || n < 50 {
                let byte = (n % 251) as u8;
                for write in [true, false] {
                    // SAFETY: the region stays mapped for the session; one request at a time.
                    unsafe { std::ptr::write_bytes(buf, if write { byte } else { !byte }, 4096) };
                    let off = u64::from(n % 64) * 4096;
                    if write {
                        q.write(off, buf, 4096, 0, ReqFlags::empty());
                    } else {
                        q.read(off, buf, 4096, 0, ReqFlags::empty());
                    }
                    let mut t = Duration::from_secs(10);
                    assert_eq!(q.do_io(&mut comps, 1, Some(&mut t), None).unwrap(), 1);
                    // SAFETY: do_io initialised one completion.
                    assert_eq!(unsafe { comps[0].assume_init_ref() }.ret, 0);
                }
                // SAFETY: as above.
                let back = unsafe { std::slice::from_raw_parts(buf, 4096) };
                assert!(back.iter().all(|x| *x == byte), "round {n}: data mismatch");
                n += 1;
            }
            n
        });
        for _ in 0..20 {
            let extra = b.alloc_mem_region(1 << 20).unwrap();
            b.map_mem_region(&extra).unwrap();
            b.unmap_mem_region(&extra);
            b.free_mem_region(&extra);
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        io.join().unwrap()
    });
    assert!(rounds >= 50);
}
