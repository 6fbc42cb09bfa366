//! A hand-driven vhost-user front end (rust-vmm's `vhost` Frontend) that builds its
//! own rings in a memfd and sends what a buggy or malicious VMM might: descriptors
//! outside memory, loops, wrong directions, requests past the end, an avail index
//! jump, memory-table changes under load and a disconnect with requests queued. The
//! device answers with error statuses or stops the queue, the process stays up, and
//! another device (and the next client of this one) keep working.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{engine, wait_until, T};
use guest_mem::SharedMem;
use std::os::fd::AsRawFd;
use test_support::blkio::blkio_round;
use test_support::vhost_fe::*;
use udrive::vhost_device::{self, VhostBlkConfig};
use vhost::vhost_user::message::{
    VhostUserInflight, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::VhostBackend;
use vhost_user_blk::VhostUserBlk;
use vmm_sys_util::eventfd::EventFd;

const DISK: u64 = 4 << 20;

fn start(dir: &Path, name: &str) -> VhostUserBlk {
    start_on(dir, name, &format!("ram:{DISK}"))
}

fn start_on(dir: &Path, name: &str, disk: &str) -> VhostUserBlk {
    let cfg = VhostBlkConfig::new(dir.join(name), disk.parse().unwrap());
    vhost_device::open_and_start(&cfg, &engine(), 1).unwrap()
}

#[test]
fn hostile_front_end() {
    let dir = tempfile::tempdir().unwrap();
    let victim = start(dir.path(), "victim.sock");
    let bystander = start(dir.path(), "bystander.sock");
    let vs = dir.path().join("victim.sock");
    let bs = dir.path().join("bystander.sock");

    let mut r = FakeFrontend::connect(&vs);
    let hdr = (HDR, 16, false);
    let st = (STATUS, 1, true);

    // A good write and read back.
    r.put(DATA, &[0x42; 512]);
    r.header(T_OUT, 3);
    assert_eq!(r.request(&[hdr, (DATA, 512, false), st]), 0);
    r.put(DATA, &[0; 512]);
    r.header(T_IN, 3);
    assert_eq!(r.request(&[hdr, (DATA, 512, true), st]), 0);
    assert!(r.get(DATA, 512).iter().all(|b| *b == 0x42));

    // Data outside guest memory, wrong direction, past the end, odd length.
    assert_eq!(r.request(&[hdr, (MEM - 256, 512, true), st]), 1);
    assert_eq!(
        r.request(&[hdr, (DATA, 512, true), (DATA, 16, false), st]),
        1
    );
    r.header(T_IN, DISK / 512);
    assert_eq!(r.request(&[hdr, (DATA, 512, true), st]), 1);
    r.header(T_OUT, 0);
    assert_eq!(r.request(&[hdr, (DATA, 100, false), st]), 1);
    // Unknown type.
    r.header(77, 0);
    assert_eq!(r.request(&[hdr, st]), 2);

    // A descriptor loop: 0 -> 1 -> 0 -> ...; it completes (no status) and nothing hangs.
    r.header(T_IN, 0);
    r.desc(0, HDR, 16, NEXT, 1);
    r.desc(1, DATA, 512, NEXT | WRITE, 0);
    let n = r.used_idx().wrapping_add(1);
    r.publish(0);
    r.next_desc = 2;
    assert!(r.wait_used(n), "looping chain not returned");

    // Memory table replaced while requests keep coming.
    for i in 0..20u8 {
        r.put(DATA, &[i; 512]);
        r.header(T_OUT, 8);
        assert_eq!(r.request(&[hdr, (DATA, 512, false), st]), 0);
        r.set_mem_table();
    }
    r.header(T_IN, 8);
    assert_eq!(r.request(&[hdr, (DATA, 512, true), st]), 0);
    assert!(r.get(DATA, 512).iter().all(|b| *b == 19));

    // The avail index jumps by more than the queue size: the queue stops.
    let used = r.used_idx();
    r.put(AVAIL + 2, &(r.avail.wrapping_add(QSIZE + 3)).to_le_bytes());
    r.kick.write(1).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(r.used_idx(), used, "nothing taken from a corrupt ring");

    // Meanwhile the other device works.
    blkio_round(&bs, 0x11);

    // A device reset (GET_VRING_BASE, then the rings set up again) revives the queue.
    r.fe.get_vring_base(0).unwrap();
    r.start_vring();
    r.header(T_IN, 8);
    assert_eq!(r.request(&[hdr, (DATA, 512, true), st]), 0);
    assert!(r.get(DATA, 512).iter().all(|b| *b == 19));

    drop(r);

    // A new client queues requests and vanishes without waiting for them.
    let mut r2 = FakeFrontend::connect(&vs);
    r2.header(T_OUT, 16);
    for _ in 0..5 {
        r2.push(&[hdr, (DATA, 512, false), st]);
    }
    drop(r2);

    // The victim takes the next client; the bystander still works.
    blkio_round(&vs, 0x22);
    blkio_round(&bs, 0x33);
    assert!(victim.connections() >= 2);
    victim.stop();
    bystander.stop();
}

/// The front end goes away with writes in flight on an io_uring file backend and
/// comes back (same guest memory) the way QEMU does after a disconnect: SET_VRING_BASE
/// with the used index. Every request is completed exactly once across the two
/// connections, because the device completed everything it had taken before letting
/// go of the first connection.
#[test]
fn reconnect_completes_each_request_once() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk.img");
    std::fs::File::create(&img).unwrap().set_len(DISK).unwrap();
    let dev = start_on(dir.path(), "r.sock", &format!("file:{}", img.display()));
    let sock = dir.path().join("r.sock");
    let n: u16 = 12;

    let mut r = FakeFrontend::connect(&sock);
    for i in 0..n {
        let hdr_at = r.stage_write(u64::from(i));
        // Three descriptors per request: five fit in the table at once, so request i
        // reuses the descriptors of request i - 5 once that one completed.
        if i >= 5 {
            assert!(r.wait_used(i - 4));
        }
        r.next_desc = (i % 5) * 3;
        r.push(&[
            (hdr_at, 16, false),
            (DATA + 4096 * u64::from(i), 4096, false),
            (STATUSES + u64::from(i), 1, true),
        ]);
    }
    let FakeFrontend { fe, mem, .. } = r;
    drop(fe);
    // QEMU restarts the ring at the used index it sees once the backend is gone:
    // wait until the device let go of the connection, which it does after finishing
    // what it took (a fixed wait raced with those completions under load).
    let used_idx = || {
        let mut b = [0u8; 2];
        mem.all().read_into((USED + 2) as usize, &mut b).unwrap();
        u16::from_le_bytes(b)
    };
    wait_until("the device to let go after completing", T, || {
        dev.disconnections() >= 1 && used_idx() > 0
    });
    let used_now = used_idx();
    let r2 = FakeFrontend::connect_with(
        &sock,
        Connect {
            resume: Some((used_now, n)),
            ..Connect::new(mem)
        },
    );
    r2.kick.write(1).unwrap();
    assert!(
        r2.wait_used(n),
        "not every request completed after reconnect"
    );
    // A request completed twice would push the used index past n.
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(r2.used_idx(), n, "a request was completed twice");
    for i in 0..n {
        assert_eq!(
            r2.get(STATUSES + u64::from(i), 1)[0],
            0,
            "request {i} status"
        );
    }
    drop(r2);
    dev.stop();
    let data = std::fs::read(&img).unwrap();
    for i in 0..usize::from(n) {
        let at = i * 4096;
        assert!(
            data[at..at + 4096].iter().all(|b| *b == i as u8 + 1),
            "block {i}"
        );
    }
}

/// The state a crashed udrive leaves behind, written by hand (the rings and the
/// inflight area live in the front end, so this is exactly what a new process
/// finds): four writes taken from the avail ring; the second completed out of order;
/// the fourth's used entry written but its inflight flag not yet cleared (killed in
/// between). A new device must redo the first and the third, in the order they were
/// taken, and nothing else.
#[test]
fn restart_resubmits_inflight_requests_once() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk.img");
    std::fs::File::create(&img).unwrap().set_len(DISK).unwrap();
    let dev = start_on(dir.path(), "i.sock", &format!("file:{}", img.display()));
    let sock = dir.path().join("i.sock");
    let log = get_inflight_area(&sock);

    let mem = SharedMem::new("inflight-guest", MEM).unwrap();
    mem.all().fill(0);
    let r = FakeFrontend {
        fe: Frontend::connect(&sock, 1).unwrap(),
        mem: mem.into(),
        next_desc: 0,
        avail: 0,
        kick: EventFd::new(0).unwrap(),
        call: EventFd::new(0).unwrap(),
        event_idx: false,
    };
    let heads = [0u16, 3, 6, 9];
    for (i, &head) in heads.iter().enumerate() {
        let i = i as u64;
        let hdr_at = r.stage_write(i);
        r.desc(head, hdr_at, 16, NEXT, head + 1);
        r.desc(head + 1, DATA + 4096 * i, 4096, NEXT, head + 2);
        r.desc(head + 2, STATUSES + i, 1, WRITE, 0);
        r.put(AVAIL + 4 + 2 * i, &head.to_le_bytes());
    }
    r.put(AVAIL + 2, &4u16.to_le_bytes());
    // Used ring: head 3 (request 1) then head 9 (request 3); used idx 2.
    r.put(USED + 4, &3u32.to_le_bytes());
    r.put(USED + 8, &1u32.to_le_bytes());
    r.put(USED + 12, &9u32.to_le_bytes());
    r.put(USED + 16, &1u32.to_le_bytes());
    r.put(USED + 2, &2u16.to_le_bytes());
    inflight_header(&log, QSIZE, 9, 1);
    inflight_desc(&log, 0, 1, 1);
    inflight_desc(&log, 3, 0, 2);
    inflight_desc(&log, 6, 1, 3);
    inflight_desc(&log, 9, 1, 4);
    let FakeFrontend { fe, mem, .. } = r;
    drop(fe);

    // QEMU restarts the ring at the used index after a crash.
    let r2 = FakeFrontend::connect_with(
        &sock,
        Connect {
            resume: Some((2, 4)),
            inflight: Some(&log),
            ..Connect::new(mem)
        },
    );
    r2.kick.write(1).unwrap();
    assert!(r2.wait_used(4), "the requests in flight were not redone");
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(r2.used_idx(), 4, "a request was completed twice");
    let used_heads: Vec<u32> = (2..4)
        .map(|k| {
            let b = r2.get(USED + 4 + 8 * k, 4);
            u32::from_le_bytes([b[0], b[1], b[2], b[3]])
        })
        .collect();
    assert_eq!(used_heads, vec![0, 6], "resubmitted in the order taken");
    assert_eq!(r2.get(STATUSES, 1)[0], 0);
    assert_eq!(r2.get(STATUSES + 2, 1)[0], 0);
    assert_eq!(r2.get(STATUSES + 1, 1)[0], 0xff, "completed request redone");
    assert_eq!(r2.get(STATUSES + 3, 1)[0], 0xff, "completed request redone");
    // The log is clean again and follows the ring.
    let mut b = [0u8; 2];
    use std::os::unix::fs::FileExt;
    log.read_exact_at(&mut b, 14).unwrap();
    assert_eq!(u16::from_le_bytes(b), 4);
    for h in heads {
        let mut f = [0u8; 1];
        log.read_exact_at(&mut f, 16 + 16 * u64::from(h)).unwrap();
        assert_eq!(f[0], 0, "head {h} still marked in flight");
    }
    drop(r2);
    dev.stop();
    let data = std::fs::read(&img).unwrap();
    for (i, want) in [(0usize, 1u8), (1, 0), (2, 3), (3, 0)] {
        let at = i * 4096;
        assert!(
            data[at..at + 4096].iter().all(|b| *b == want),
            "block {i}: only the requests in flight are redone"
        );
    }
}

/// Garbage in the inflight area (heads everywhere, a huge desc_num, descriptor
/// loops, indirect tables pointing outside memory) and areas that are too small
/// must not take the device down.
#[test]
fn hostile_inflight_area() {
    let dir = tempfile::tempdir().unwrap();
    let dev = start(dir.path(), "h.sock");
    let sock = dir.path().join("h.sock");
    let log = get_inflight_area(&sock);
    let len = log.metadata().unwrap().len() as usize;
    let junk: Vec<u8> = (0..len).map(|i| (i * 7 + 1) as u8).collect();
    std::os::unix::fs::FileExt::write_all_at(&log, &junk, 0).unwrap();
    inflight_header(&log, u16::MAX, 0xfff0, 0x1234);
    for h in 0..QSIZE {
        inflight_desc(&log, h, 1, u64::from(h).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    }
    let mem = SharedMem::new("inflight-hostile", MEM).unwrap();
    let r = FakeFrontend {
        fe: Frontend::connect(&sock, 1).unwrap(),
        mem: mem.into(),
        next_desc: 0,
        avail: 0,
        kick: EventFd::new(0).unwrap(),
        call: EventFd::new(0).unwrap(),
        event_idx: false,
    };
    // Every descriptor loops to itself or jumps outside memory / into indirection.
    for i in 0..QSIZE {
        match i % 3 {
            0 => r.desc(i, HDR, 16, NEXT, i),
            1 => r.desc(i, MEM + 4096, 16, 4, 0),
            _ => r.desc(i, 0, 64, 4 | NEXT, (i + 1) % QSIZE),
        }
    }
    let FakeFrontend { fe, mem, .. } = r;
    drop(fe);
    let r2 = FakeFrontend::connect_with(
        &sock,
        Connect {
            resume: Some((0, 0)),
            inflight: Some(&log),
            ..Connect::new(mem)
        },
    );
    r2.kick.write(1).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    drop(r2);
    // An area smaller than it claims is refused (not mapped: touching it would
    // SIGBUS); the connection and the device go on.
    let small = SharedMem::new("inflight-small", 64).unwrap();
    let mut fe = Frontend::connect(&sock, 1).unwrap();
    fe.set_owner().unwrap();
    fe.get_features().unwrap();
    fe.set_features((1u64 << 32) | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits())
        .unwrap();
    let pf = fe.get_protocol_features().unwrap();
    fe.set_protocol_features(
        pf & (VhostUserProtocolFeatures::INFLIGHT_SHMFD | VhostUserProtocolFeatures::REPLY_ACK),
    )
    .unwrap();
    fe.set_hdr_flags(vhost::vhost_user::message::VhostUserHeaderFlag::NEED_REPLY);
    // 64 queues need more than the one page the fd holds.
    let info = VhostUserInflight {
        mmap_size: 1 << 30,
        mmap_offset: 0,
        num_queues: 64,
        queue_size: QSIZE,
    };
    assert!(
        fe.set_inflight_fd(&info, small.fd().as_raw_fd()).is_err(),
        "area larger than its fd accepted"
    );
    assert!(fe.get_features().is_ok(), "connection dropped");
    drop(fe);
    blkio_round(&sock, 0x5a);
    dev.stop();
}

/// Kills a child process on drop (a failing test must not leave a server behind).
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn serve_child(sock: &Path, disk: &str) -> Child {
    let _ = std::fs::remove_file(sock);
    let c = Child(
        std::process::Command::new(env!("CARGO_BIN_EXE_udrive"))
            .arg("serve")
            .arg("--vhost-user-blk")
            .arg(sock)
            .args(["--disk", disk, "--queues", "1"])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn udrive serve"),
    );
    wait_until("udrive serve to come up", Duration::from_secs(30), || {
        std::os::unix::net::UnixStream::connect(sock).is_ok()
    });
    c
}

/// A real crash: `udrive serve` on a throttled file disk (1 IOPS, so requests sit
/// in flight) is SIGKILLed after the first of five writes completed; a new process
/// gets the same inflight area and the rings restarted at the used index, as QEMU
/// does. Every write completes exactly once and lands in the file.
#[test]
fn sigkill_with_requests_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk.img");
    std::fs::File::create(&img).unwrap().set_len(DISK).unwrap();
    let sock = dir.path().join("k.sock");
    // 1 IOPS: after the first write, the next completes a second later, so the
    // kill lands with four in flight however slowly this test runs up to it. (The
    // probe connection of serve_child goes first; the next waits in the backlog.)
    let mut first = serve_child(&sock, &format!("file:{},iops=1", img.display()));
    let log = get_inflight_area(&sock);
    let mem = SharedMem::new("sigkill-guest", MEM).unwrap();
    let mut r = FakeFrontend::connect_with(
        &sock,
        Connect {
            inflight: Some(&log),
            ..Connect::new(mem)
        },
    );
    let n: u16 = 5;
    for i in 0..n {
        let hdr_at = r.stage_write(u64::from(i));
        r.push(&[
            (hdr_at, 16, false),
            (DATA + 4096 * u64::from(i), 4096, false),
            (STATUSES + u64::from(i), 1, true),
        ]);
    }
    assert!(r.wait_used(1), "nothing completed before the kill");
    first.0.kill().unwrap();
    first.0.wait().unwrap();
    let used = r.used_idx();
    assert!(
        used < n,
        "everything completed before the kill; nothing tested"
    );
    // The killed process logged what it had taken and not completed.
    {
        use std::os::unix::fs::FileExt;
        let mut b = [0u8; 2];
        log.read_exact_at(&mut b, 14).unwrap();
        let log_used = u16::from_le_bytes(b);
        let marked = (0..QSIZE)
            .filter(|h| {
                let mut f = [0u8; 1];
                log.read_exact_at(&mut f, 16 + 16 * u64::from(*h)).unwrap();
                f[0] == 1
            })
            .count();
        // Killed between a used entry and its flag: one more marked, index behind.
        assert!(
            (log_used == used && marked == usize::from(n - used))
                || (log_used == used - 1 && marked == usize::from(n - used) + 1),
            "log: used {log_used}, {marked} marked; ring used {used}"
        );
    }
    let FakeFrontend { fe, mem, .. } = r;
    drop(fe);

    let _second = serve_child(&sock, &format!("file:{}", img.display()));
    let r2 = FakeFrontend::connect_with(
        &sock,
        Connect {
            resume: Some((used, n)),
            inflight: Some(&log),
            ..Connect::new(mem)
        },
    );
    r2.kick.write(1).unwrap();
    assert!(r2.wait_used(n), "requests in flight at the kill were lost");
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(r2.used_idx(), n, "a request was completed twice");
    let mut seen: Vec<u32> = (0..u64::from(n))
        .map(|k| {
            let b = r2.get(USED + 4 + 8 * k, 4);
            u32::from_le_bytes([b[0], b[1], b[2], b[3]])
        })
        .collect();
    seen.sort_unstable();
    assert_eq!(seen, vec![0, 3, 6, 9, 12], "each head completed once");
    for i in 0..n {
        assert_eq!(r2.get(STATUSES + u64::from(i), 1)[0], 0, "request {i}");
    }
    drop(r2);
    let data = std::fs::read(&img).unwrap();
    for i in 0..usize::from(n) {
        let at = i * 4096;
        assert!(
            data[at..at + 4096].iter().all(|b| *b == i as u8 + 1),
            "block {i}"
        );
    }
}
