//! A hand-driven vhost-user front end (rust-vmm's `vhost` Frontend) that builds its
//! own rings in a memfd and sends what a buggy or malicious VMM might: descriptors
//! outside memory, loops, wrong directions, requests past the end, an avail index
//! jump, memory-table changes under load and a disconnect with requests queued. The
//! device answers with error statuses or stops the queue, the process stays up, and
//! another device (and the next client of this one) keep working.

use std::path::Path;
use std::sync::atomic::{fence, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use blkio::{Blkio, ReqFlags};
use guest_mem::SharedMem;
use std::os::fd::AsRawFd;
use udrive::vhost_device::{self, VhostBlkConfig};
use vhost::vhost_user::message::{
    VhostUserInflight, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vhost_user_blk::VhostUserBlk;
use vmm_sys_util::eventfd::EventFd;

const QSIZE: u16 = 16;
const MEM: u64 = 1 << 20;
const AVAIL: u64 = 0x1000;
const USED: u64 = 0x2000;
const HDR: u64 = 0x4000;
const DATA: u64 = 0x5000;
const STATUS: u64 = 0x8000;
/// Per-request status bytes for the reconnect test (past its data buffers).
const STATUSES: u64 = 0x2_0000;
const NEXT: u16 = 1;
const WRITE: u16 = 2;
const T_IN: u32 = 0;
const T_OUT: u32 = 1;
const DISK: u64 = 4 << 20;

fn engine() -> Arc<engine::Engine> {
    static E: OnceLock<Arc<engine::Engine>> = OnceLock::new();
    E.get_or_init(|| engine::Engine::start(&[None]).expect("start engine"))
        .clone()
}

fn start(dir: &Path, name: &str) -> VhostUserBlk {
    start_on(dir, name, &format!("ram:{DISK}"))
}

fn start_on(dir: &Path, name: &str, disk: &str) -> VhostUserBlk {
    let cfg = VhostBlkConfig::new(dir.join(name), disk.parse().unwrap());
    vhost_device::open_and_start(&cfg, &engine(), 1).unwrap()
}

/// A test guest's RAM: a sealed memfd (QEMU's memory-backend-memfd) or a plain
/// file that the guest's VMM can shrink (memory-backend-file).
enum GuestRam {
    Sealed(SharedMem),
    File(std::fs::File, guest_mem::MappedRegion),
}

impl From<SharedMem> for GuestRam {
    fn from(m: SharedMem) -> GuestRam {
        GuestRam::Sealed(m)
    }
}

impl GuestRam {
    fn file(len: u64) -> GuestRam {
        use std::os::fd::AsFd;
        let f = tempfile::tempfile().unwrap();
        f.set_len(len).unwrap();
        let map =
            guest_mem::MappedRegion::map_fd(f.as_fd(), 0, 0, len, guest_mem::Prot::RW).unwrap();
        GuestRam::File(f, map)
    }

    fn all(&self) -> guest_mem::DmaSlice<'_> {
        match self {
            GuestRam::Sealed(m) => m.all(),
            GuestRam::File(_, map) => map.slice(0, map.len() as usize).unwrap(),
        }
    }

    fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        match self {
            GuestRam::Sealed(m) => m.fd(),
            GuestRam::File(f, _) => f.as_fd(),
        }
    }
}

struct Raw {
    fe: Frontend,
    mem: GuestRam,
    next_desc: u16,
    avail: u16,
    _kick: EventFd,
    _call: EventFd,
}

impl Raw {
    fn connect(sock: &Path) -> Raw {
        let mem = SharedMem::new("hostile-guest", MEM).unwrap();
        Self::connect_with(sock, mem, None)
    }

    /// Connects with guest memory `mem`. `resume`: rings already hold requests; start
    /// at this avail index (what QEMU does after a backend disconnect: the used index)
    /// instead of zeroing the rings.
    fn connect_with(sock: &Path, mem: impl Into<GuestRam>, resume: Option<(u16, u16)>) -> Raw {
        Self::connect_log(sock, mem, resume, None)
    }

    /// As `connect_with`; with `log`, negotiates INFLIGHT_SHMFD and hands the
    /// device that inflight area (SET_INFLIGHT_FD) before the rings start.
    fn connect_log(
        sock: &Path,
        mem: impl Into<GuestRam>,
        resume: Option<(u16, u16)>,
        log: Option<&std::fs::File>,
    ) -> Raw {
        let mem = mem.into();
        let mut fe = Frontend::connect(sock, 1).expect("connect");
        fe.set_owner().unwrap();
        let f = fe.get_features().unwrap();
        let want = (1u64 << 32) | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        assert_eq!(f & want, want);
        fe.set_features(want).unwrap();
        let pf = fe.get_protocol_features().unwrap();
        let mut want_pf = VhostUserProtocolFeatures::CONFIG;
        if log.is_some() {
            assert!(pf.contains(VhostUserProtocolFeatures::INFLIGHT_SHMFD));
            want_pf |= VhostUserProtocolFeatures::INFLIGHT_SHMFD;
        }
        fe.set_protocol_features(pf & want_pf).unwrap();
        if let Some(f) = log {
            let info = VhostUserInflight {
                mmap_size: f.metadata().unwrap().len(),
                mmap_offset: 0,
                num_queues: 1,
                queue_size: QSIZE,
            };
            fe.set_inflight_fd(&info, f.as_raw_fd()).unwrap();
        }
        let r = Raw {
            fe,
            mem,
            next_desc: 0,
            avail: 0,
            _kick: EventFd::new(0).unwrap(),
            _call: EventFd::new(0).unwrap(),
        };
        r.set_mem_table();
        let mut r = r;
        match resume {
            None => r.start_vring(),
            Some((base, avail)) => {
                r.avail = avail;
                r.setup_vring(base);
            }
        }
        r
    }

    /// SET_VRING_NUM/ADDR/BASE/CALL/KICK/ENABLE on fresh (zeroed) rings.
    fn start_vring(&mut self) {
        self.put(0, &[0u8; USED as usize + 4096]);
        self.avail = 0;
        self.next_desc = 0;
        self.setup_vring(0);
    }

    fn setup_vring(&mut self, avail_base: u16) {
        let base = self.base();
        self.fe.set_vring_num(0, QSIZE).unwrap();
        self.fe
            .set_vring_addr(
                0,
                &VringConfigData {
                    queue_max_size: QSIZE,
                    queue_size: QSIZE,
                    flags: 0,
                    desc_table_addr: base,
                    used_ring_addr: base + USED,
                    avail_ring_addr: base + AVAIL,
                    log_addr: None,
                },
            )
            .unwrap();
        self.fe.set_vring_base(0, avail_base).unwrap();
        self.fe.set_vring_call(0, &self._call).unwrap();
        self.fe.set_vring_kick(0, &self._kick).unwrap();
        self.fe.set_vring_enable(0, true).unwrap();
    }

    fn base(&self) -> u64 {
        self.mem.all().as_ptr() as u64
    }

    fn set_mem_table(&self) {
        let region = VhostUserMemoryRegionInfo {
            guest_phys_addr: 0,
            memory_size: MEM,
            userspace_addr: self.base(),
            mmap_offset: 0,
            mmap_handle: self.mem.fd().as_raw_fd(),
        };
        self.fe.set_mem_table(&[region]).unwrap();
    }

    fn put(&self, at: u64, bytes: &[u8]) {
        self.mem.all().write_from(at as usize, bytes).unwrap();
    }

    /// Writes request `i`'s parts into guest memory: an OUT header for sector `i * 8`,
    /// 4 KiB of byte `i + 1` and an unset status byte. Returns the header's address.
    fn stage_write(&self, i: u64) -> u64 {
        let hdr_at = HDR + 16 * i;
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&T_OUT.to_le_bytes());
        h[8..16].copy_from_slice(&(i * 8).to_le_bytes());
        self.put(hdr_at, &h);
        self.put(DATA + 4096 * i, &[i as u8 + 1; 4096]);
        self.put(STATUSES + i, &[0xff]);
        hdr_at
    }
    fn get(&self, at: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.mem.all().read_into(at as usize, &mut v).unwrap();
        v
    }
    fn u16_at(&self, at: u64) -> u16 {
        let b = self.get(at, 2);
        u16::from_le_bytes([b[0], b[1]])
    }

    fn header(&self, t: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&t.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.put(HDR, &h);
    }

    fn desc(&self, idx: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let mut d = [0u8; 16];
        d[0..8].copy_from_slice(&addr.to_le_bytes());
        d[8..12].copy_from_slice(&len.to_le_bytes());
        d[12..14].copy_from_slice(&flags.to_le_bytes());
        d[14..16].copy_from_slice(&next.to_le_bytes());
        self.put(16 * u64::from(idx), &d);
    }

    /// Links `descs` (addr, len, write) into a chain, publishes it and kicks.
    fn push(&mut self, descs: &[(u64, u32, bool)]) {
        if usize::from(self.next_desc) + descs.len() > usize::from(QSIZE) {
            self.next_desc = 0;
        }
        let head = self.next_desc;
        for (i, (addr, len, w)) in descs.iter().enumerate() {
            let idx = head + i as u16;
            let last = i + 1 == descs.len();
            let flags = if *w { WRITE } else { 0 } | if last { 0 } else { NEXT };
            self.desc(idx, *addr, *len, flags, if last { 0 } else { idx + 1 });
        }
        self.next_desc += descs.len() as u16;
        self.publish(head);
    }

    fn publish(&mut self, head: u16) {
        self.put(
            AVAIL + 4 + 2 * u64::from(self.avail % QSIZE),
            &head.to_le_bytes(),
        );
        self.avail = self.avail.wrapping_add(1);
        fence(Ordering::SeqCst);
        self.put(AVAIL + 2, &self.avail.to_le_bytes());
        fence(Ordering::SeqCst);
        self._kick.write(1).unwrap();
    }

    fn used_idx(&self) -> u16 {
        self.u16_at(USED + 2)
    }

    /// Waits (bounded) until the used index reaches `n` (or passes it).
    fn wait_used(&self, n: u16) -> bool {
        let until = Instant::now() + Duration::from_secs(10);
        while (self.used_idx().wrapping_sub(n) as i16) < 0 {
            if Instant::now() > until {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    /// One request; its status byte.
    fn request(&mut self, descs: &[(u64, u32, bool)]) -> u8 {
        self.put(STATUS, &[0xff]);
        let n = self.used_idx().wrapping_add(1);
        self.push(descs);
        assert!(self.wait_used(n), "request not completed");
        self.get(STATUS, 1)[0]
    }
}

/// A libblkio client doing a verified write/read round on `sock`.
fn blkio_round(sock: &Path, byte: u8) {
    let mut b = Blkio::new("virtio-blk-vhost-user").unwrap();
    b.set_str("path", sock.to_str().unwrap()).unwrap();
    b.connect().unwrap();
    let mut s = b.start().unwrap();
    let region = b.alloc_mem_region(4096).unwrap();
    b.map_mem_region(&region).unwrap();
    let buf = region.addr as *mut u8;
    let q = &mut s.queues[0];
    let mut comps: Vec<_> = (0..1).map(|_| std::mem::MaybeUninit::uninit()).collect();
    let mut io = |q: &mut blkio::Blkioq, write: bool| {
        if write {
            q.write(0, buf, 4096, 0, ReqFlags::empty());
        } else {
            q.read(0, buf, 4096, 0, ReqFlags::empty());
        }
        let mut t = Duration::from_secs(10);
        assert_eq!(q.do_io(&mut comps, 1, Some(&mut t), None).unwrap(), 1);
        // SAFETY: do_io initialised one completion.
        assert_eq!(unsafe { comps[0].assume_init_ref() }.ret, 0);
    };
    // SAFETY: the region is mapped read/write and no request is in flight.
    unsafe { std::ptr::write_bytes(buf, byte, 4096) };
    io(q, true);
    // SAFETY: as above.
    unsafe { std::ptr::write_bytes(buf, 0, 4096) };
    io(q, false);
    // SAFETY: as above.
    let back = unsafe { std::slice::from_raw_parts(buf, 4096) };
    assert!(back.iter().all(|x| *x == byte));
    drop(s);
    b.unmap_mem_region(&region);
    b.free_mem_region(&region);
}

#[test]
fn hostile_front_end() {
    let dir = tempfile::tempdir().unwrap();
    let victim = start(dir.path(), "victim.sock");
    let bystander = start(dir.path(), "bystander.sock");
    let vs = dir.path().join("victim.sock");
    let bs = dir.path().join("bystander.sock");

    let mut r = Raw::connect(&vs);
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
    r._kick.write(1).unwrap();
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
    let mut r2 = Raw::connect(&vs);
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

    let mut r = Raw::connect(&sock);
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
    let Raw { fe, mem, .. } = r;
    drop(fe);
    // QEMU restarts the ring at the used index it sees once the backend is gone.
    let until = Instant::now() + Duration::from_secs(10);
    while dev.connections() < 1 || {
        let mut b = [0u8; 2];
        mem.all().read_into((USED + 2) as usize, &mut b).unwrap();
        u16::from_le_bytes(b) == 0
    } {
        assert!(Instant::now() < until, "nothing completed");
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(50));
    let used_now = {
        let mut b = [0u8; 2];
        mem.all().read_into((USED + 2) as usize, &mut b).unwrap();
        u16::from_le_bytes(b)
    };
    let r2 = Raw::connect_with(&sock, mem, Some((used_now, n)));
    r2._kick.write(1).unwrap();
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

/// Asks a device for a fresh inflight area (GET_INFLIGHT_FD), as QEMU does once.
fn get_inflight_area(sock: &Path) -> std::fs::File {
    let mut fe = Frontend::connect(sock, 1).expect("connect");
    fe.set_owner().unwrap();
    fe.get_features().unwrap();
    let want = (1u64 << 32) | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
    fe.set_features(want).unwrap();
    let pf = fe.get_protocol_features().unwrap();
    assert!(pf.contains(VhostUserProtocolFeatures::INFLIGHT_SHMFD));
    fe.set_protocol_features(pf & VhostUserProtocolFeatures::INFLIGHT_SHMFD)
        .unwrap();
    let ask = VhostUserInflight {
        mmap_size: 0,
        mmap_offset: 0,
        num_queues: 1,
        queue_size: QSIZE,
    };
    let (info, file) = fe.get_inflight_fd(&ask).unwrap();
    assert_eq!(info.mmap_offset, 0);
    assert!(info.mmap_size >= 16 + 16 * u64::from(QSIZE));
    assert!(file.metadata().unwrap().len() >= info.mmap_size);
    file
}

/// Inflight log field writers (layout: docs/decisions/0005).
fn log_put(f: &std::fs::File, at: u64, bytes: &[u8]) {
    use std::os::unix::fs::FileExt;
    f.write_all_at(bytes, at).unwrap();
}
fn log_desc(f: &std::fs::File, head: u16, inflight: u8, counter: u64) {
    let at = 16 + 16 * u64::from(head);
    log_put(f, at, &[inflight]);
    log_put(f, at + 8, &counter.to_le_bytes());
}
fn log_header(f: &std::fs::File, desc_num: u16, last_batch_head: u16, used_idx: u16) {
    log_put(f, 8, &1u16.to_le_bytes());
    log_put(f, 10, &desc_num.to_le_bytes());
    log_put(f, 12, &last_batch_head.to_le_bytes());
    log_put(f, 14, &used_idx.to_le_bytes());
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
    let r = Raw {
        fe: Frontend::connect(&sock, 1).unwrap(),
        mem: mem.into(),
        next_desc: 0,
        avail: 0,
        _kick: EventFd::new(0).unwrap(),
        _call: EventFd::new(0).unwrap(),
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
    log_header(&log, QSIZE, 9, 1);
    log_desc(&log, 0, 1, 1);
    log_desc(&log, 3, 0, 2);
    log_desc(&log, 6, 1, 3);
    log_desc(&log, 9, 1, 4);
    let Raw { fe, mem, .. } = r;
    drop(fe);

    // QEMU restarts the ring at the used index after a crash.
    let r2 = Raw::connect_log(&sock, mem, Some((2, 4)), Some(&log));
    r2._kick.write(1).unwrap();
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
    log_put(&log, 0, &junk);
    log_header(&log, u16::MAX, 0xfff0, 0x1234);
    for h in 0..QSIZE {
        log_desc(&log, h, 1, u64::from(h).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    }
    let mem = SharedMem::new("inflight-hostile", MEM).unwrap();
    let r = Raw {
        fe: Frontend::connect(&sock, 1).unwrap(),
        mem: mem.into(),
        next_desc: 0,
        avail: 0,
        _kick: EventFd::new(0).unwrap(),
        _call: EventFd::new(0).unwrap(),
    };
    // Every descriptor loops to itself or jumps outside memory / into indirection.
    for i in 0..QSIZE {
        match i % 3 {
            0 => r.desc(i, HDR, 16, NEXT, i),
            1 => r.desc(i, MEM + 4096, 16, 4, 0),
            _ => r.desc(i, 0, 64, 4 | NEXT, (i + 1) % QSIZE),
        }
    }
    let Raw { fe, mem, .. } = r;
    drop(fe);
    let r2 = Raw::connect_log(&sock, mem, Some((0, 0)), Some(&log));
    r2._kick.write(1).unwrap();
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
    let until = Instant::now() + Duration::from_secs(30);
    while std::os::unix::net::UnixStream::connect(sock).is_err() {
        assert!(Instant::now() < until, "udrive serve did not come up");
        std::thread::sleep(Duration::from_millis(10));
    }
    c
}

/// A real crash: `udrive serve` on a throttled file disk (5 IOPS, so requests sit
/// in flight) is SIGKILLed after the first of five writes completed; a new process
/// gets the same inflight area and the rings restarted at the used index, as QEMU
/// does. Every write completes exactly once and lands in the file.
#[test]
fn sigkill_with_requests_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk.img");
    std::fs::File::create(&img).unwrap().set_len(DISK).unwrap();
    let sock = dir.path().join("k.sock");
    let mut first = serve_child(&sock, &format!("file:{},iops=5", img.display()));
    // The probe connection above counts as a front end; wait until it is gone.
    std::thread::sleep(Duration::from_millis(50));
    let log = get_inflight_area(&sock);
    let mem = SharedMem::new("sigkill-guest", MEM).unwrap();
    let mut r = Raw::connect_log(&sock, mem, None, Some(&log));
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
    let Raw { fe, mem, .. } = r;
    drop(fe);

    let _second = serve_child(&sock, &format!("file:{}", img.display()));
    std::thread::sleep(Duration::from_millis(50));
    let r2 = Raw::connect_log(&sock, mem, Some((used, n)), Some(&log));
    r2._kick.write(1).unwrap();
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

/// A front end whose guest RAM is a plain file (memory-backend-file): a region
/// larger than its file is refused; shrinking the file under a running queue costs
/// that front end its connection, never the process; the device and a bystander
/// keep serving.
#[test]
fn front_end_shrinks_its_memory_file() {
    let dir = tempfile::tempdir().unwrap();
    let victim = start(dir.path(), "victim.sock");
    let bystander = start(dir.path(), "bystander.sock");
    let vs = dir.path().join("victim.sock");
    let bs = dir.path().join("bystander.sock");

    // 1. A 4 KiB file offered as 1 MiB of guest RAM.
    {
        let small = tempfile::tempfile().unwrap();
        small.set_len(4096).unwrap();
        let ram = GuestRam::file(MEM);
        let mut fe = Frontend::connect(&vs, 1).expect("connect");
        fe.set_owner().unwrap();
        let want = (1u64 << 32) | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        fe.get_features().unwrap();
        fe.set_features(want).unwrap();
        let pf = fe.get_protocol_features().unwrap();
        fe.set_protocol_features(pf & VhostUserProtocolFeatures::REPLY_ACK)
            .unwrap();
        fe.set_hdr_flags(vhost::vhost_user::message::VhostUserHeaderFlag::NEED_REPLY);
        let region = VhostUserMemoryRegionInfo {
            guest_phys_addr: 0,
            memory_size: MEM,
            userspace_addr: ram.all().as_ptr() as u64,
            mmap_offset: 0,
            mmap_handle: small.as_raw_fd(),
        };
        assert!(fe.set_mem_table(&[region]).is_err(), "short file refused");
    }

    // 2. A file shrunk while the queue runs.
    let mut r = Raw::connect_with(&vs, GuestRam::file(MEM), None);
    let hdr = (HDR, 16, false);
    let st = (STATUS, 1, true);
    r.put(DATA, &[0x42; 512]);
    r.header(T_OUT, 3);
    assert_eq!(r.request(&[hdr, (DATA, 512, false), st]), 0);
    let before = guest_mem::repaired_faults();
    if let GuestRam::File(f, _) = &r.mem {
        f.set_len(0).unwrap();
    }
    // Our own next write into the ring faults too (and is repaired in this test
    // process): the kick makes the device read a ring that is no longer there.
    r._kick.write(1).unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    while victim.connected() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        guest_mem::repaired_faults() > before,
        "the fault was repaired"
    );
    assert!(!victim.connected(), "the front end lost its connection");
    drop(r);

    blkio_round(&vs, 0x55);
    blkio_round(&bs, 0x66);
    victim.stop();
    bystander.stop();
}

/// SET_INFLIGHT_FD with the front end's own (unsealed) file, truncated while the
/// queue logs requests in it: that front end loses its connection, the device serves
/// the next one. (The area udrive hands out itself is sealed: it cannot shrink.)
#[test]
fn front_end_shrinks_its_inflight_file() {
    let dir = tempfile::tempdir().unwrap();
    let victim = start(dir.path(), "victim.sock");
    let vs = dir.path().join("victim.sock");
    let sealed = get_inflight_area(&vs);
    assert!(sealed.set_len(0).is_err(), "our inflight memfd is sealed");
    let log = tempfile::tempfile().unwrap();
    log.set_len(sealed.metadata().unwrap().len()).unwrap();
    drop(sealed);

    let mut r = Raw::connect_log(&vs, SharedMem::new("g", MEM).unwrap(), None, Some(&log));
    let hdr = (HDR, 16, false);
    let st = (STATUS, 1, true);
    r.put(DATA, &[0x17; 512]);
    r.header(T_OUT, 1);
    assert_eq!(r.request(&[hdr, (DATA, 512, false), st]), 0);
    let before = guest_mem::repaired_faults();
    log.set_len(0).unwrap();
    r.push(&[hdr, (DATA, 512, false), st]);
    let until = Instant::now() + Duration::from_secs(10);
    while victim.connected() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        guest_mem::repaired_faults() > before,
        "the fault was repaired"
    );
    assert!(!victim.connected(), "the front end lost its connection");
    drop(r);
    blkio_round(&vs, 0x77);
    victim.stop();
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Every vhost-user connection returns its descriptors, however it ends, and so
/// does a device that is started and stopped (RPC add + remove).
#[test]
fn connections_and_devices_return_their_fds() {
    let dir = tempfile::tempdir().unwrap();
    let dev = start(dir.path(), "fds.sock");
    let sock = dir.path().join("fds.sock");
    // Warm up (the engine, the first connection's lazily made state).
    for _ in 0..10 {
        drop(std::os::unix::net::UnixStream::connect(&sock).unwrap());
    }
    blkio_round(&sock, 1);
    // The device takes queued connections one at a time: wait until it caught up.
    let settle = |base: usize| {
        let until = Instant::now() + Duration::from_secs(60);
        while open_fds() > base && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        open_fds()
    };
    std::thread::sleep(Duration::from_millis(100));
    let base = open_fds();
    for _ in 0..10_000 {
        drop(std::os::unix::net::UnixStream::connect(&sock).unwrap());
    }
    let after = settle(base);
    assert!(
        after <= base,
        "10 000 bare connections left {} fds open",
        after - base
    );
    for i in 0..20u8 {
        blkio_round(&sock, i);
    }
    assert!(settle(base) <= base, "20 full sessions left fds open");
    dev.stop();
    std::thread::sleep(Duration::from_millis(100));
    let base = open_fds();
    for i in 0..50 {
        let d = start(dir.path(), &format!("cycle{i}.sock"));
        d.stop();
    }
    assert!(
        settle(base) <= base,
        "50 device add/remove cycles left fds open"
    );
}
