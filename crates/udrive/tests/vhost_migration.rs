//! Dirty-page logging of a vhost-user-blk device, driven by a fake front end as
//! QEMU drives it during a live migration: SET_LOG_BASE with a shared log, then
//! VHOST_F_LOG_ALL and SET_VRING_ADDR with VHOST_VRING_F_LOG. The device must set
//! the bits of exactly the guest pages it wrote (read data, status bytes, the used
//! ring), have them all set when GET_VRING_BASE answers, and survive logs that are
//! too small, shrunk, repeated or sent without the features that allow them; the
//! bystander device never notices.

mod common;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::{engine, wait_until, T};
use guest_mem::SharedMem;
use test_support::held::{HeldDisk, HeldGate};
use test_support::vhost_fe::*;
use test_support::wait::poll_until;
use vhost::vhost_user::message::{
    VhostUserHeaderFlag, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::vhost_user::VhostUserFrontend;
use vhost::{VhostBackend, VhostUserDirtyLogRegion, VringConfigData};
use vhost_user_blk::{BlkDeviceOptions, PollMode, VhostUserBlk};

const DISK: u64 = 4 << 20;
const PAGE: u64 = 4096;
/// VHOST_VRING_F_LOG.
const VRING_F_LOG: u32 = 1;
/// The log's bytes: a bit per page of [`MEM`].
const LOG_BYTES: u64 = MEM / PAGE / 8;

fn start(sock: &Path, disk: Arc<dyn bdev::BlockDevice>) -> VhostUserBlk {
    let opts = BlkDeviceOptions {
        poll: PollMode::Adaptive,
        ..Default::default()
    };
    VhostUserBlk::start(sock, disk, opts, &engine(), &[0]).unwrap()
}

fn ram() -> Arc<dyn bdev::BlockDevice> {
    Arc::new(bdev::RamDisk::new(DISK, 512).unwrap())
}

fn held() -> (Arc<dyn bdev::BlockDevice>, Arc<HeldGate>) {
    let (d, g) = HeldDisk::new(DISK, 512).unwrap();
    (Arc::new(d), g)
}

/// A front end that may log: LOG_SHMFD negotiated (with CONFIG), and an answer
/// asked for every message, as QEMU does with REPLY_ACK: each call returns once
/// the device applied it.
fn connect(sock: &Path) -> FakeFrontend {
    let r = FakeFrontend::connect_with(
        sock,
        Connect {
            protocol: VhostUserProtocolFeatures::CONFIG
                | VhostUserProtocolFeatures::LOG_SHMFD
                | VhostUserProtocolFeatures::REPLY_ACK,
            ..Connect::new(GuestRam::sealed(MEM))
        },
    );
    r.fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
    r
}

/// A device on `disk` in a directory of its own, and a front end that may log.
fn device(disk: Arc<dyn bdev::BlockDevice>) -> (tempfile::TempDir, VhostUserBlk, FakeFrontend) {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("dev.sock");
    let dev = start(&sock, disk);
    let r = connect(&sock);
    (dir, dev, r)
}

/// A dirty log the front end shares: a memfd, or a plain file it can shrink.
struct Log {
    file: File,
    bytes: u64,
}

impl Log {
    fn memfd(bytes: u64) -> Log {
        let m = SharedMem::new("dirty-log", bytes).unwrap();
        Log {
            file: File::from(m.fd().try_clone_to_owned().unwrap()),
            bytes,
        }
    }

    fn plain(bytes: u64) -> Log {
        let file = tempfile::tempfile().unwrap();
        file.set_len(bytes).unwrap();
        Log { file, bytes }
    }

    /// SET_LOG_BASE with this log (`claimed`: the size the message says).
    fn send(&self, r: &FakeFrontend, claimed: u64) -> vhost::Result<()> {
        let region = VhostUserDirtyLogRegion {
            mmap_size: claimed,
            mmap_offset: 0,
            mmap_handle: self.file.as_raw_fd(),
        };
        r.fe.set_log_base(0, Some(region))
    }

    /// The pages whose bits are set.
    fn pages(&self) -> Vec<u64> {
        use std::os::unix::fs::FileExt;
        let mut b = vec![0u8; self.bytes as usize];
        self.file.read_exact_at(&mut b, 0).unwrap();
        (0..self.bytes * 8)
            .filter(|p| b[(p / 8) as usize] & (1 << (p % 8)) != 0)
            .collect()
    }

    /// What the VMM does when it harvests the log.
    fn clear(&self) {
        use std::os::unix::fs::FileExt;
        self.file
            .write_all_at(&vec![0u8; self.bytes as usize], 0)
            .unwrap();
    }
}

fn page(gpa: u64) -> u64 {
    gpa / PAGE
}

/// The virtio features the fake front end negotiates, with LOG_ALL or without.
fn set_log_all(r: &FakeFrontend, on: bool) {
    // VIRTIO_F_VERSION_1 and PROTOCOL_FEATURES, as `negotiate` acknowledged.
    let mut f = (1u64 << 32) | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
    if on {
        f |= VhostUserVirtioFeatures::LOG_ALL.bits();
    }
    r.fe.set_features(f).unwrap();
}

/// SET_VRING_ADDR again with VHOST_VRING_F_LOG: the used ring is logged at its
/// guest address (QEMU does this once logging starts).
fn log_used_ring(r: &FakeFrontend) {
    let base = r.base();
    let addrs = VringConfigData {
        queue_max_size: QSIZE,
        queue_size: QSIZE,
        flags: VRING_F_LOG,
        desc_table_addr: base,
        used_ring_addr: base + USED,
        avail_ring_addr: base + AVAIL,
        log_addr: Some(USED),
    };
    r.fe.set_vring_addr(0, &addrs).unwrap();
}

/// What QEMU does when a migration starts: log, LOG_ALL, logged rings.
fn start_logging(r: &FakeFrontend, log: &Log) {
    log.send(r, log.bytes).unwrap();
    set_log_all(r, true);
    log_used_ring(r);
}

/// Reads `len` bytes at sector 0 into [`DATA`]; the status.
fn read(r: &mut FakeFrontend, len: u32) -> u8 {
    r.header(T_IN, 0);
    r.request(&[(HDR, 16, false), (DATA, len, true), (STATUS, 1, true)])
}

fn write(r: &mut FakeFrontend, len: u32) -> u8 {
    r.header(T_OUT, 0);
    r.request(&[(HDR, 16, false), (DATA, len, false), (STATUS, 1, true)])
}

/// Waits until the log holds `want` (the used ring is marked just after the
/// used index moves), then checks that it holds nothing else.
#[track_caller]
fn expect_pages(log: &Log, want: &[u64]) {
    poll_until(T, || want.iter().all(|p| log.pages().contains(p)));
    assert_eq!(log.pages(), want, "pages marked in the dirty log");
}

/// A device nobody attacks, checked around each hostile case.
struct Bystander {
    _dev: VhostUserBlk,
    r: FakeFrontend,
}

impl Bystander {
    fn start(dir: &Path) -> Bystander {
        let sock = dir.join("bystander.sock");
        let dev = start(&sock, ram());
        Bystander {
            _dev: dev,
            r: connect(&sock),
        }
    }

    #[track_caller]
    fn check(&mut self) {
        self.r.put(DATA, &[0x5a; 512]);
        assert_eq!(write(&mut self.r, 512), 0);
        self.r.put(DATA, &[0; 512]);
        assert_eq!(read(&mut self.r, 512), 0);
        assert!(self.r.get(DATA, 512).iter().all(|b| *b == 0x5a));
    }
}

#[test]
fn reads_mark_exactly_the_pages_they_wrote() {
    let (_dir, _dev, mut r) = device(ram());
    let log = Log::memfd(LOG_BYTES);
    // Before logging starts nothing is marked.
    assert_eq!(read(&mut r, 8192), 0);
    start_logging(&r, &log);
    log.clear();
    // Two pages of data, the status byte's page and the used ring's.
    assert_eq!(read(&mut r, 8192), 0);
    expect_pages(
        &log,
        &[page(USED), page(DATA), page(DATA) + 1, page(STATUS)],
    );
    // A write's data goes the other way: only status and used ring.
    log.clear();
    assert_eq!(write(&mut r, 4096), 0);
    expect_pages(&log, &[page(USED), page(STATUS)]);
    // LOG_ALL off: nothing marked any more.
    set_log_all(&r, false);
    log.clear();
    assert_eq!(read(&mut r, 4096), 0);
    assert_eq!(log.pages(), Vec::<u64>::new());
}

#[test]
fn a_log_without_log_all_marks_nothing_until_log_all() {
    let (_dir, _dev, mut r) = device(ram());
    let log = Log::memfd(LOG_BYTES);
    // QEMU sends the log before LOG_ALL: accepted, and nothing is marked yet.
    log.send(&r, LOG_BYTES).unwrap();
    log_used_ring(&r);
    assert_eq!(read(&mut r, 4096), 0);
    assert_eq!(log.pages(), Vec::<u64>::new());
    set_log_all(&r, true);
    assert_eq!(read(&mut r, 4096), 0);
    expect_pages(&log, &[page(USED), page(DATA), page(STATUS)]);
}

#[test]
fn a_repeated_log_base_replaces_the_log() {
    let (_dir, _dev, mut r) = device(ram());
    let (a, b) = (Log::memfd(LOG_BYTES), Log::memfd(4 * LOG_BYTES));
    start_logging(&r, &a);
    assert_eq!(read(&mut r, 4096), 0);
    expect_pages(&a, &[page(USED), page(DATA), page(STATUS)]);
    // A bigger log (QEMU resizes it as memory grows): the old one is not
    // marked once SET_LOG_BASE has answered.
    b.send(&r, b.bytes).unwrap();
    a.clear();
    assert_eq!(read(&mut r, 4096), 0);
    expect_pages(&b, &[page(USED), page(DATA), page(STATUS)]);
    assert_eq!(a.pages(), Vec::<u64>::new());
}

/// Whether the device ended `r`'s connection (its next request fails).
fn disconnected(r: &FakeFrontend) -> bool {
    poll_until(T, || r.fe.get_features().is_err())
}

#[test]
fn hostile_logs_end_that_connection_only() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("victim.sock");
    let _dev = start(&sock, ram());
    let mut by = Bystander::start(dir.path());
    by.check();

    // A log with fewer bits than the memory table has pages.
    let r = connect(&sock);
    let small = Log::memfd(LOG_BYTES / 2);
    assert!(small.send(&r, small.bytes).is_err());
    assert!(disconnected(&r));
    by.check();

    // A log that claims more bytes than its file holds.
    let r = connect(&sock);
    let short = Log::memfd(PAGE);
    assert!(short.send(&r, 2 * PAGE).is_err());
    assert!(disconnected(&r));
    by.check();

    // An empty log, and one larger than any guest needs.
    let r = connect(&sock);
    assert!(short.send(&r, 0).is_err());
    assert!(disconnected(&r));
    let r = connect(&sock);
    assert!(short.send(&r, 1 << 40).is_err());
    assert!(disconnected(&r));
    by.check();

    // SET_LOG_BASE without LOG_SHMFD negotiated: the library refuses it.
    let r = FakeFrontend::connect(&sock);
    let log = Log::memfd(LOG_BYTES);
    let _ = log.send(&r, LOG_BYTES);
    assert!(disconnected(&r));
    by.check();

    // A log file shrunk after SET_LOG_BASE: the first mark faults, the SIGBUS
    // guard catches it and the connection ends.
    let mut r = connect(&sock);
    let log = Log::plain(PAGE);
    start_logging(&r, &log);
    assert_eq!(read(&mut r, 4096), 0);
    log.file.set_len(0).unwrap();
    r.header(T_IN, 0);
    r.push(&[(HDR, 16, false), (DATA, 4096, true), (STATUS, 1, true)]);
    assert!(disconnected(&r));
    by.check();

    // The next front end of the victim is served as usual.
    let mut r = connect(&sock);
    assert_eq!(read(&mut r, 512), 0);
    by.check();
}

#[test]
fn a_memory_table_the_log_does_not_cover_is_refused() {
    let (_dir, _dev, mut r) = device(ram());
    let log = Log::memfd(LOG_BYTES);
    start_logging(&r, &log);
    // A table that grows past the log's end is refused while the log is set; the
    // old table stays in use.
    let region = vhost::VhostUserMemoryRegionInfo {
        guest_phys_addr: 0,
        memory_size: MEM,
        userspace_addr: r.base(),
        mmap_offset: 0,
        mmap_handle: r.mem.fd().as_raw_fd(),
    };
    let far = vhost::VhostUserMemoryRegionInfo {
        guest_phys_addr: 64 * MEM,
        ..region
    };
    assert!(r.fe.set_mem_table(&[region, far]).is_err());
    assert_eq!(read(&mut r, 4096), 0);
    expect_pages(&log, &[page(USED), page(DATA), page(STATUS)]);
}

#[test]
fn get_vring_base_answers_after_in_flight_reads_are_marked() {
    let (disk, gate) = held();
    let (_dir, _dev, mut r) = device(disk);
    let log = Log::memfd(LOG_BYTES);
    start_logging(&r, &log);
    // A read the backend holds.
    r.header(T_IN, 0);
    let used = r.used_idx();
    r.push(&[(HDR, 16, false), (DATA, 4096, true), (STATUS, 1, true)]);
    wait_until("the backend takes the read", T, || gate.submitted() == 1);
    // The switch-over: GET_VRING_BASE from another thread, as it blocks.
    let fe = r.fe.clone();
    let stop = std::thread::spawn(move || fe.get_vring_base(0));
    // It does not answer while the read is held (nor is the read's data marked:
    // the used ring's flags may be) ...
    std::thread::sleep(Duration::from_millis(200));
    let early = stop.is_finished();
    let marked = log.pages();
    gate.open();
    assert!(!early, "GET_VRING_BASE answered with a read in flight");
    assert!(!marked.contains(&page(DATA)) && !marked.contains(&page(STATUS)));
    // ... and once it completes, the answer comes with every page marked.
    let base = stop.join().unwrap().unwrap();
    assert_eq!(base, u32::from(r.avail));
    assert_eq!(r.used_idx(), used.wrapping_add(1));
    assert_eq!(
        log.pages(),
        vec![page(USED), page(DATA), page(STATUS)],
        "pages marked when GET_VRING_BASE answered"
    );
}

#[test]
fn a_ram_disk_offers_no_migration() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk.img");
    File::create(&img).unwrap().set_len(DISK).unwrap();
    let offered = |disk: &str, name: &str| {
        let cfg =
            udrive::vhost_device::VhostBlkConfig::new(dir.path().join(name), disk.parse().unwrap());
        let _dev = udrive::vhost_device::open_and_start(&cfg, &engine(), 1).unwrap();
        let mut fe = negotiate(&dir.path().join(name), VhostUserProtocolFeatures::CONFIG);
        let f = fe.get_features().unwrap();
        let p = fe.get_protocol_features().unwrap();
        (
            f & VhostUserVirtioFeatures::LOG_ALL.bits() != 0,
            p.contains(VhostUserProtocolFeatures::LOG_SHMFD),
        )
    };
    assert_eq!(offered(&format!("ram:{DISK}"), "ram.sock"), (false, false));
    assert_eq!(
        offered(&format!("file:{}", img.display()), "file.sock"),
        (true, true)
    );
    // Refused up front as the destination of a migration.
    assert!(format!("ram:{DISK},incoming")
        .parse::<udrive::nsspec::NsSpec>()
        .is_err());
}

/// udrive restarts while QEMU migrates: QEMU reconnects with LOG_ALL already in
/// the features, hands the inflight area back and starts the rings, and only then
/// sends SET_LOG_BASE (vhost_dev_start's order). The reads the old process had
/// taken are redone, not before the log is there, and their pages are marked.
#[test]
fn a_restart_while_logging_redoes_reads_into_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("dev.sock");
    let disk = ram();
    let old = start(&sock, disk.clone());
    let area = get_inflight_area(&sock);
    // Two reads the old process took and never completed: heads 0 and 3.
    let r = FakeFrontend {
        fe: vhost::vhost_user::Frontend::connect(&sock, 1).unwrap(),
        mem: GuestRam::sealed(MEM),
        next_desc: 0,
        avail: 0,
        kick: vmm_sys_util::eventfd::EventFd::new(0).unwrap(),
        call: vmm_sys_util::eventfd::EventFd::new(0).unwrap(),
        event_idx: false,
    };
    let reads = [(0u16, DATA), (3, DATA + 2 * PAGE)];
    for (i, &(head, data)) in reads.iter().enumerate() {
        let hdr = HDR + 16 * i as u64;
        r.put(hdr, &T_IN.to_le_bytes());
        r.put(STATUSES + i as u64, &[0xff]);
        r.desc(head, hdr, 16, NEXT, head + 1);
        r.desc(head + 1, data, PAGE as u32, NEXT | WRITE, head + 2);
        r.desc(head + 2, STATUSES + i as u64, 1, WRITE, 0);
        r.put(AVAIL + 4 + 2 * i as u64, &head.to_le_bytes());
        inflight_desc(&area, head, 1, i as u64 + 1);
    }
    r.put(AVAIL + 2, &2u16.to_le_bytes());
    inflight_header(&area, QSIZE, 3, 0);
    let FakeFrontend { fe, mem, .. } = r;
    drop(fe);
    old.stop();

    let _new = start(&sock, disk);
    let r = FakeFrontend::connect_with(
        &sock,
        Connect {
            resume: Some((0, 2)),
            inflight: Some(&area),
            protocol: VhostUserProtocolFeatures::CONFIG
                | VhostUserProtocolFeatures::LOG_SHMFD
                | VhostUserProtocolFeatures::REPLY_ACK,
            virtio: VhostUserVirtioFeatures::LOG_ALL.bits(),
            ..Connect::new(mem)
        },
    );
    r.fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
    r.kick.write(1).unwrap();
    // Redone now, the reads would write guest pages no log records.
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(r.used_idx(), 0, "reads redone before the dirty log came");
    let log = Log::memfd(LOG_BYTES);
    log.send(&r, log.bytes).unwrap();
    log_used_ring(&r);
    assert!(r.wait_used(2), "the reads in flight were not redone");
    assert_eq!(r.get(STATUSES, 2), vec![0, 0]);
    expect_pages(
        &log,
        &[
            page(USED),
            page(DATA),
            page(DATA + 2 * PAGE),
            page(STATUSES),
        ],
    );
}
