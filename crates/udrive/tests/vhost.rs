//! vhost-user-blk devices with libblkio as the client: the workload generator across
//! queues with verification, then flush, discard, write zeroes and bad requests.

mod common;

use std::mem::MaybeUninit;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use blkio::{Blkio, Completion, ReqFlags};
use common::{engine, polls_on, sleeps_on, wait_until, T};
use frontend_core::Observed;
use initiator::workload::{self, Rw, WorkloadConfig};
use test_support::blkio::{BlkioSession, SESSION_BUF};
use test_support::layers::{assert_latency_in_backend_only, assert_layers_add_up, layer_p50};
use trace::{Breakdown, TOTAL};
use udrive::blkio_target::BlkioTarget;
use udrive::vhost_device::{self, VhostBlkConfig};
use vhost_user_blk::{PollMode, VhostUserBlk};

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
    start_on(&engine(), dir, disk, queues, poll)
}

fn start_on(
    engine: &Arc<engine::Engine>,
    dir: tempfile::TempDir,
    disk: &str,
    queues: u16,
    poll: &str,
) -> Dev {
    let sock = dir.path().join("blk.sock");
    let mut cfg = VhostBlkConfig::new(sock.clone(), disk.parse().unwrap());
    cfg.queues = queues;
    cfg.poll = poll.parse().unwrap();
    let c = udrive::config::Config {
        cpus: "0".into(),
        vhost_user_blk: vec![cfg],
        ..Default::default()
    };
    c.validate().unwrap();
    let dev = vhost_device::open_and_start(&c.vhost_user_blk[0], engine, 1).unwrap();
    Dev {
        dev: Some(dev),
        sock,
        _dir: dir,
    }
}

/// A device on a reactor of its own (shut it down after the device): other tests'
/// busy queues keep the shared one polling.
fn start_alone(disk: &str, queues: u16, poll: &str) -> (Arc<engine::Engine>, Dev) {
    let engine = engine::Engine::start(&[None]).unwrap();
    let d = start_on(&engine, tempfile::tempdir().unwrap(), disk, queues, poll);
    (engine, d)
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

#[test]
fn flush_discard_write_zeroes_and_bad_requests() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(8 << 20)
        .unwrap();
    let d = start_in(dir, &format!("file:{}", img.display()), 1, "busy");
    let mut s = BlkioSession::open(&d.sock).unwrap();
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
    let mut s = BlkioSession::open_with(&d.sock, true, SESSION_BUF).unwrap();
    assert_eq!(s.read(0, 4096), 0);
    assert!(s.bytes(4096).iter().all(|b| *b == 0x3c));
    // libblkio refuses it itself (EBADF), so it never reaches the device; the
    // device's own refusal (IOERR, counted) is in the virtio-blk unit tests.
    assert_eq!(s.write(0, 4096), -libc::EBADF);
    drop(s);
    assert!(std::fs::read(&img).unwrap().iter().all(|b| *b == 0x3c));
    // The counters hold what reached the device.
    let (ops, bytes, errors) = d.totals();
    assert_eq!((ops.read, ops.write, bytes.read), (1, 0, 4096));
    assert!(errors.is_empty(), "{errors:?}");
}

/// libblkio adds and removes memory regions (ADD/REM_MEM_REGION or SET_MEM_TABLE)
/// on one thread while another keeps verified I/O going on the device.
#[test]
fn memory_table_changes_under_load() {
    let d = start("ram:8M", 1, "busy");
    let mut s = BlkioSession::open(&d.sock).unwrap();
    let BlkioSession { q, region, b, .. } = &mut s;
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

/// A device on `disk` wrapped in a fault injector.
fn start_faulty(disk: Arc<dyn bdev::BlockDevice>, fc: bdev::FaultConfig, queues: u16) -> Dev {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("blk.sock");
    let mut cfg = VhostBlkConfig::new(sock.clone(), "null:1M".parse().unwrap());
    cfg.queues = queues;
    let faulty = Arc::new(bdev::FaultDisk::new(disk, fc).expect("fault disk"));
    let dev = vhost_device::start(&cfg, faulty, 0, &engine(), 1, Default::default()).unwrap();
    Dev {
        dev: Some(dev),
        sock,
        _dir: dir,
    }
}

impl Dev {
    fn blk(&self) -> &VhostUserBlk {
        self.dev.as_ref().expect("running")
    }

    /// The disk's counters summed over the queues.
    fn totals(&self) -> (trace::OpCounts, trace::OpCounts, Vec<(u16, u64)>) {
        let (mut ops, mut bytes) = (trace::OpCounts::default(), trace::OpCounts::default());
        let mut errors = std::collections::BTreeMap::new();
        let qs = self.blk().queue_stats(T);
        assert_eq!(qs.len(), self.blk().num_queues(), "every queue answers");
        for q in &qs {
            for ns in &q.namespaces {
                assert_eq!(ns.nsid, vhost_user_blk::DISK_NSID, "one disk");
                ops.add(&ns.ops);
                bytes.add(&ns.bytes);
                for e in &ns.errors {
                    *errors.entry(e.status).or_default() += e.count;
                }
            }
        }
        (ops, bytes, errors.into_iter().collect())
    }
}

const S_IOERR: u16 = 1;
const S_UNSUPP: u16 = 2;

#[test]
fn counters_match_what_libblkio_issued() {
    let ram: Arc<dyn bdev::BlockDevice> = Arc::new(bdev::RamDisk::new(4 << 20, 512).unwrap());
    let fc = bdev::FaultConfig {
        error_rate: 0.2,
        seed: 5,
        ..Default::default()
    };
    let d = start_faulty(ram, fc, 2);
    let mut s = BlkioSession::open(&d.sock).unwrap();
    let (mut ops, mut bytes) = ([0u64; 2], [0u64; 2]);
    let mut errors = std::collections::BTreeMap::new();
    let mut x = 7u64;
    for round in 0..60u64 {
        // Batches of up to 8 mixed requests; every 10th batch has one past the end,
        // which the device refuses before the backend.
        let reqs: Vec<(bool, u64, usize)> = (0..1 + round % 8)
            .map(|i| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let len = 4096 * (1 + (x >> 40) as usize % 2);
                let off = if round % 10 == 9 && i == 0 {
                    (4 << 20) - 4096
                } else {
                    4096 * ((x >> 20) % 1000)
                };
                ((x >> 33) & 1 == 1, off, len)
            })
            .collect();
        for (&(write, off, len), ret) in reqs.iter().zip(s.batch(&reqs)) {
            if off + len as u64 > 4 << 20 {
                assert_eq!(ret, -libc::EIO, "past the end");
            }
            let op = usize::from(write);
            ops[op] += 1;
            match ret {
                0 => bytes[op] += len as u64,
                r if r == -libc::EIO => *errors.entry(S_IOERR).or_default() += 1u64,
                r if r == -libc::ENOTSUP => *errors.entry(S_UNSUPP).or_default() += 1,
                r => panic!("unexpected completion {r}"),
            }
        }
    }
    drop(s);
    let out_of_range = 6;
    let errs: u64 = errors.values().sum();
    assert!(
        errs > out_of_range + 20,
        "the fault disk injected errors ({errs})"
    );
    let (got_ops, got_bytes, got_errors) = d.totals();
    assert_eq!(
        (got_ops.read, got_ops.write, got_ops.flush, got_ops.other),
        (ops[0], ops[1], 0, 0)
    );
    assert_eq!((got_bytes.read, got_bytes.write), (bytes[0], bytes[1]));
    assert_eq!(got_errors, errors.into_iter().collect::<Vec<_>>());
}

fn traced_run(d: &Dev, qd: u32) -> (Breakdown, workload::Report) {
    d.blk().trace_start(1, T);
    let cfg = WorkloadConfig {
        rw: Rw::RandRw { read_pct: 50 },
        bs: 4096,
        qd,
        time: Duration::from_millis(400),
        ..Default::default()
    };
    let t = BlkioTarget::connect(&d.sock, 1, qd, 4096).expect("connect libblkio");
    let r = workload::run(&t, &cfg).expect("workload");
    drop(t);
    d.blk().trace_stop(T);
    (Breakdown::from_queues(&d.blk().queue_stats(T)), r)
}

/// Far above anything else a request spends on an idle or a busy machine (see
/// `test_support::layers`).
const INJECTED: Duration = Duration::from_millis(20);

#[test]
fn injected_backend_latency_shows_in_the_backend_layer_only() {
    let ram: Arc<dyn bdev::BlockDevice> = Arc::new(bdev::RamDisk::new(8 << 20, 512).unwrap());
    let fc = bdev::FaultConfig {
        latency: INJECTED,
        ..Default::default()
    };
    let d = start_faulty(ram, fc, 1);
    let (server, r) = traced_run(&d, 8);
    assert_eq!(r.errors, 0);
    assert_latency_in_backend_only(&server, INJECTED);
}

#[test]
fn layers_add_up_and_fit_in_what_libblkio_measured() {
    let d = start("null:1G", 1, "busy");
    let (server, r) = traced_run(&d, 1);
    let traced: u64 = ["read", "write"]
        .iter()
        .map(|op| {
            server
                .op(op)
                .and_then(|o| o.row(TOTAL))
                .map_or(0, |r| r.count)
        })
        .sum();
    // Every request was traced (the client counts only those inside its window).
    assert!(traced >= r.ios, "{traced} traced, {} measured", r.ios);
    assert_layers_add_up(&server);
    // The server's part of each request (kick seen -> call signalled) lies inside
    // the client's submit -> completion time, so the server's median over reads and
    // writes is at most the client's: it lies between the two ops' medians, the
    // lower of which must then be at most the client's. Slack for where each side
    // takes its stamps.
    let server_p50 = ["read", "write"]
        .map(|op| layer_p50(&server, op, TOTAL))
        .into_iter()
        .min()
        .unwrap_or(0);
    assert!(
        server_p50 <= r.lat_ns.p50 + 2_000,
        "server p50 {server_p50} ns vs libblkio p50 {} ns\n{server}",
        r.lat_ns.p50
    );
}

#[test]
fn sampling_one_in_n_and_stats_of_sleeping_queues() {
    // Event mode: the reactor sleeps between requests, and stats readers wake it.
    let (engine, d) = start_alone("null:64M", 2, "event");
    let mut s = BlkioSession::open(&d.sock).unwrap();
    let reads = |s: &mut BlkioSession, n: u64| {
        for i in 0..n {
            assert_eq!(s.read(i * 4096, 4096), 0);
        }
    };
    let traced = |d: &Dev| {
        Breakdown::from_queues(&d.blk().queue_stats(T))
            .op("read")
            .and_then(|o| o.row(TOTAL))
            .map_or(0, |r| r.count)
    };
    reads(&mut s, 100);
    assert_eq!(traced(&d), 0, "off: counted, not traced");
    d.blk().trace_start(10, T);
    reads(&mut s, 1000);
    assert_eq!(traced(&d), 100);
    d.blk().trace_start(1, T);
    reads(&mut s, 50);
    d.blk().trace_stop(T);
    reads(&mut s, 50);
    assert_eq!(traced(&d), 50, "a new start clears, a stop stops");
    // Idle, the reactor goes to sleep at once (it did between the reads): readers
    // still get every queue.
    assert!(sleeps_on(&engine, 0) > 0, "the reactor never slept");
    let (ops, bytes, errors) = d.totals();
    assert_eq!(ops.read, 1200);
    assert_eq!(bytes.read, 1200 * 4096);
    assert!(errors.is_empty());
    drop(s);
    drop(d);
    engine.shutdown();
}

/// Reads throttled by QoS wait for tokens, which only time brings: an event-mode
/// queue sleeps until they are due rather than polling for them (it used to spin
/// until the last one was admitted), and each still completes.
#[test]
fn qos_throttled_reads_let_the_reactor_sleep() {
    // 20 IOPS: three reads go at once (the burst), the other three 50 ms apart.
    let (engine, d) = start_alone("ram:1M,iops=20", 1, "event");
    let mut s = BlkioSession::open(&d.sock).unwrap();
    let (polls, slept) = (polls_on(&engine, 0), sleeps_on(&engine, 0));
    let start = std::time::Instant::now();
    for i in 0..6 {
        assert_eq!(s.read(i * 4096, 4096), 0, "read {i}");
    }
    assert!(start.elapsed() >= Duration::from_millis(100), "throttled");
    let (polls, slept) = (polls_on(&engine, 0) - polls, sleeps_on(&engine, 0) - slept);
    // Spinning makes hundreds of thousands of polls in 150 ms (the count is
    // published every 4096); sleeping one per wake-up.
    assert!(
        polls < 20_000,
        "{polls} polls: the reactor spun on held reads"
    );
    assert!(slept >= 3, "slept between the throttled reads");
    drop(s);
    drop(d);
    engine.shutdown();
}

/// The published iteration count of reactor `r` (refreshed every 4096 iterations).
fn reactor_polls(r: usize) -> u64 {
    polls_on(&engine(), r)
}

#[test]
fn poll_mode_changes_while_io_runs() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("blk.sock");
    let mut cfg = VhostBlkConfig::new(sock.clone(), "ram:16M".parse().unwrap());
    cfg.queues = 2;
    cfg.placement = engine::Placement::Dedicated;
    let d = Dev {
        dev: Some(vhost_device::open_and_start(&cfg, &engine(), 1).unwrap()),
        sock,
        _dir: dir,
    };
    let reactors = d.blk().queue_reactors();
    assert_eq!(reactors.len(), 2);
    assert!(
        reactors.iter().all(|r| *r >= 1),
        "own reactors: {reactors:?}"
    );
    // A libblkio client keeps verified I/O going on both queues while the mode flips.
    let r = std::thread::scope(|sc| {
        let io = sc.spawn(|| {
            let cfg = WorkloadConfig {
                rw: Rw::RandRw { read_pct: 50 },
                bs: 4096,
                qd: 4,
                jobs: 2,
                time: Duration::from_millis(1200),
                verify: true,
                ..Default::default()
            };
            let t = BlkioTarget::connect(&d.sock, 2, 4, 4096).expect("connect libblkio");
            workload::run(&t, &cfg).expect("workload")
        });
        for mode in [
            PollMode::Event,
            PollMode::Adaptive,
            PollMode::Busy,
            PollMode::Event,
            PollMode::Busy,
            PollMode::Adaptive,
            PollMode::Event,
        ] {
            std::thread::sleep(Duration::from_millis(150));
            d.blk().set_poll_mode(mode);
            assert_eq!(d.blk().poll_mode(), mode);
        }
        io.join().unwrap()
    });
    assert!(r.ios > 0);
    assert_eq!((r.errors, r.verify_errors), (0, 0));
    // Idle in event mode: the reactors sleep (their published count stops moving;
    // a spinning reactor publishes every 4096 iterations).
    for &q in &reactors {
        let mut last = reactor_polls(q);
        wait_until("reactor to stop spinning in event mode", T, || {
            std::thread::sleep(Duration::from_millis(200));
            let now = reactor_polls(q);
            std::mem::replace(&mut last, now) == now
        });
    }
    // Busy: they spin again without any I/O to wake them.
    d.blk().set_poll_mode(PollMode::Busy);
    for &q in &reactors {
        let before = reactor_polls(q);
        wait_until("reactor to spin in busy mode", T, || {
            reactor_polls(q) > before + 4096
        });
    }
    // And I/O after the last switch works.
    let r = run(&d.sock, Rw::RandRw { read_pct: 50 }, 2, 4);
    assert_eq!((r.errors, r.verify_errors), (0, 0));
}

#[test]
fn queues_move_between_reactors_while_io_runs() {
    // Event mode: kicks must reach the reactor that owns the queue after each move.
    let d = start("ram:16M", 2, "event");
    let shared = d.blk().queue_reactors();
    assert_eq!(shared, [0, 0]);
    let mut cfg = VhostBlkConfig::new(d.sock.clone(), "ram:16M".parse().unwrap());
    cfg.queues = 2;
    let plans = [
        ("dedicated", true),
        ("single", false),
        ("dedicated", true),
        ("round-robin", false),
    ];
    let mut dev = d;
    let r = std::thread::scope(|sc| {
        let sock = dev.sock.clone();
        let io = sc.spawn(move || {
            let cfg = WorkloadConfig {
                rw: Rw::RandRw { read_pct: 50 },
                bs: 4096,
                qd: 4,
                jobs: 2,
                time: Duration::from_millis(1000),
                verify: true,
                ..Default::default()
            };
            let t = BlkioTarget::connect(&sock, 2, 4, 4096).expect("connect libblkio");
            workload::run(&t, &cfg).expect("workload")
        });
        for (placement, own) in plans {
            std::thread::sleep(Duration::from_millis(150));
            cfg.placement = placement.parse().unwrap();
            let reactors = vhost_device::reactors_for(&cfg, 0, &engine(), 1).unwrap();
            let blk = dev.dev.as_mut().expect("running");
            blk.move_queues(&reactors).unwrap();
            let now = blk.queue_reactors();
            assert_eq!(now, reactors, "{placement}");
            assert_eq!(now.iter().all(|r| *r >= 1), own, "{placement}: {now:?}");
        }
        io.join().unwrap()
    });
    assert!(r.ios > 0);
    assert_eq!((r.errors, r.verify_errors), (0, 0));
    // Counters moved with the queues.
    let (ops, _, errors) = dev.totals();
    assert!(ops.read + ops.write >= r.ios);
    assert!(errors.is_empty());
    assert!(dev.dev.as_mut().unwrap().move_queues(&[]).is_err());
    assert!(dev.dev.as_mut().unwrap().move_queues(&[9999]).is_err());
    assert_eq!(dev.blk().queue_reactors(), [0, 0], "nothing moved on error");
}
