//! The device driven through a real front end: rust-vmm vhost's `Frontend` over
//! the device socket (and raw bytes for what a well-behaved front end never
//! sends). Rings live in a memfd that the test reads and writes as the guest.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bdev::BlockDevice;
use vhost::vhost_user::message::{
    VhostUserConfigFlags, VhostUserHeaderFlag, VhostUserInflight, VhostUserProtocolFeatures,
    VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vhost_user_blk::{BlkDeviceOptions, HandoverState, PollMode, VhostUserBlk};
use vmm_sys_util::eventfd::EventFd;

const DISK: u64 = 16 << 20;
const MEM: u64 = 1 << 20;
const GPA: u64 = 0x10_0000;
const UADDR: u64 = 0x7f00_0000_0000;
const QSIZE: u16 = 16;
// Guest layout (offsets in the memfd).
const DESC: u64 = 0x0;
const AVAIL: u64 = 0x1000;
const USED: u64 = 0x2000;
const HDR: u64 = 0x3000;
const DATA: u64 = 0x4000;
const STATUS: u64 = 0x5000;

fn engine() -> Arc<engine::Engine> {
    static E: OnceLock<Arc<engine::Engine>> = OnceLock::new();
    E.get_or_init(|| {
        // A short message deadline, read once by the device (before any starts).
        std::env::set_var("UDRIVE_MSG_DEADLINE_MS", "300");
        engine::Engine::start(&[None]).expect("start engine")
    })
    .clone()
}

fn sock(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vublk-seam-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    let _ = std::fs::remove_file(&p);
    p
}

fn disk() -> Arc<dyn BlockDevice> {
    Arc::new(bdev::RamDisk::new(DISK, 512).unwrap())
}

fn opts() -> BlkDeviceOptions {
    let mut o = BlkDeviceOptions {
        poll: PollMode::Adaptive,
        ..Default::default()
    };
    o.device.queue_size = 256;
    o
}

fn start(path: &Path, disk: &Arc<dyn BlockDevice>) -> VhostUserBlk {
    VhostUserBlk::start(path, disk.clone(), opts(), &engine(), &[0]).unwrap()
}

/// A front end with one vring set up on a memfd "guest".
struct Guest {
    fe: Frontend,
    mem: File,
    kick: EventFd,
    _call: EventFd,
    avail: u16,
}

fn memfd(len: u64) -> File {
    let m = guest_mem::SharedMem::new("seam-guest", len).unwrap();
    File::from(m.fd().try_clone_to_owned().unwrap())
}

/// Negotiates everything the device offers (it offers what the tests need:
/// CONFIG, MQ, REPLY_ACK, CONFIGURE_MEM_SLOTS, INFLIGHT_SHMFD, BACKEND_REQ), except
/// LOG_ALL: a front end sets that bit only while it migrates the guest, and the
/// rings then wait for its dirty log.
fn features(fe: &mut Frontend) {
    fe.set_owner().unwrap();
    let f = fe.get_features().unwrap();
    assert!(f & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0);
    fe.set_features(f & !VhostUserVirtioFeatures::LOG_ALL.bits())
        .unwrap();
    let offered = fe.get_protocol_features().unwrap();
    assert!(offered.contains(
        VhostUserProtocolFeatures::INFLIGHT_SHMFD | VhostUserProtocolFeatures::BACKEND_REQ
    ));
    fe.set_protocol_features(offered).unwrap();
    // Ask for an answer to every request, as QEMU does with REPLY_ACK: each call
    // returns once the device applied it.
    fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
}

impl Guest {
    fn connect(path: &Path) -> Guest {
        let mut fe = Frontend::connect(path, 1).unwrap();
        features(&mut fe);
        let mem = memfd(MEM);
        let region = VhostUserMemoryRegionInfo {
            guest_phys_addr: GPA,
            memory_size: MEM,
            userspace_addr: UADDR,
            mmap_offset: 0,
            mmap_handle: mem.as_raw_fd(),
        };
        fe.set_mem_table(&[region]).unwrap();
        Guest {
            fe,
            mem,
            kick: EventFd::new(0).unwrap(),
            _call: EventFd::new(0).unwrap(),
            avail: 0,
        }
    }

    fn start_ring(&mut self) {
        self.set_ring();
        let fe = &mut self.fe;
        fe.set_vring_call(0, &self._call).unwrap();
        fe.set_vring_kick(0, &self.kick).unwrap();
        fe.set_vring_enable(0, true).unwrap();
    }

    /// Size, addresses and base of ring 0: what comes before it starts.
    fn set_ring(&mut self) {
        let fe = &mut self.fe;
        fe.set_vring_num(0, QSIZE).unwrap();
        let cfg = VringConfigData {
            queue_max_size: QSIZE,
            queue_size: QSIZE,
            flags: 0,
            desc_table_addr: UADDR + DESC,
            used_ring_addr: UADDR + USED,
            avail_ring_addr: UADDR + AVAIL,
            log_addr: None,
        };
        fe.set_vring_addr(0, &cfg).unwrap();
        fe.set_vring_base(0, self.avail).unwrap();
    }

    fn put(&self, off: u64, b: &[u8]) {
        self.mem.write_all_at(b, off).unwrap();
    }

    fn used_idx(&self) -> u16 {
        let mut b = [0u8; 2];
        self.mem.read_exact_at(&mut b, USED + 2).unwrap();
        u16::from_le_bytes(b)
    }

    fn desc(&self, i: u16, off: u64, len: u32, write: bool, next: Option<u16>) {
        let mut d = Vec::with_capacity(16);
        d.extend_from_slice(&(GPA + off).to_le_bytes());
        d.extend_from_slice(&len.to_le_bytes());
        let flags = u16::from(next.is_some()) | if write { 2 } else { 0 };
        d.extend_from_slice(&flags.to_le_bytes());
        d.extend_from_slice(&next.unwrap_or(0).to_le_bytes());
        self.put(DESC + 16 * u64::from(i), &d);
    }

    /// One virtio-blk request of 512 bytes at sector 1 (`out`: a write of
    /// `fill`); returns its status.
    fn request(&mut self, out: bool, fill: u8) -> u8 {
        self.post(out, fill);
        self.kick.write(1).unwrap();
        self.completed()
    }

    /// Puts the request on the avail ring, without a kick.
    fn post(&mut self, out: bool, fill: u8) {
        let mut h = Vec::new();
        h.extend_from_slice(&u32::from(out).to_le_bytes());
        h.extend_from_slice(&0u32.to_le_bytes());
        h.extend_from_slice(&1u64.to_le_bytes());
        self.put(HDR, &h);
        self.put(DATA, &[fill; 512]);
        self.put(STATUS, &[0xff]);
        self.desc(0, HDR, 16, false, Some(1));
        self.desc(1, DATA, 512, !out, Some(2));
        self.desc(2, STATUS, 1, true, None);
        let slot = AVAIL + 4 + 2 * u64::from(self.avail % QSIZE);
        self.put(slot, &0u16.to_le_bytes());
        self.avail = self.avail.wrapping_add(1);
        self.put(AVAIL + 2, &self.avail.to_le_bytes());
    }

    /// Waits for every posted request to be used; the last one's status.
    fn completed(&self) -> u8 {
        let want = self.avail;
        assert!(
            engine::wait_until(Duration::from_secs(10), Duration::from_millis(1), || {
                self.used_idx() == want
            }),
            "request not completed"
        );
        let mut s = [0u8; 1];
        self.mem.read_exact_at(&mut s, STATUS).unwrap();
        s[0]
    }

    fn data(&self) -> Vec<u8> {
        let mut b = vec![0u8; 512];
        self.mem.read_exact_at(&mut b, DATA).unwrap();
        b
    }
}

#[test]
fn setup_config_and_io_on_a_ring() {
    let path = sock("setup.sock");
    let d = disk();
    let dev = start(&path, &d);
    let mut g = Guest::connect(&path);
    assert_eq!(g.fe.get_queue_num().unwrap(), 1);
    assert_eq!(g.fe.get_max_mem_slots().unwrap(), 509);
    let (_, cfg) =
        g.fe.get_config(0, 8, VhostUserConfigFlags::WRITABLE, &[0; 8])
            .unwrap();
    assert_eq!(u64::from_le_bytes(cfg.try_into().unwrap()), DISK / 512);
    g.start_ring();
    assert_eq!(g.request(true, 0x5a), 0);
    assert_eq!(g.request(false, 0), 0);
    assert_eq!(g.data(), vec![0x5a; 512]);
    assert!(dev.connected());
    drop(g);
    // A reconnect gets a fresh handler: owning the device again is allowed.
    assert!(engine::wait_until(
        Duration::from_secs(5),
        Duration::from_millis(5),
        || dev.disconnections() == 1
    ));
    let mut g = Guest::connect(&path);
    g.start_ring();
    assert_eq!(g.request(false, 0), 0);
    assert_eq!(g.data(), vec![0x5a; 512]);
    assert_eq!(dev.connections(), 2);
    dev.stop();
}

/// QEMU reconnecting: the ring starts (kick, enable) with a request already
/// on it and before the call fd comes; the request completes with nobody to
/// tell, so the call fd must be signalled once it arrives, or a guest using
/// EVENT_IDX waits for that interrupt forever.
#[test]
fn a_call_fd_sent_after_the_ring_started_is_signalled() {
    let path = sock("late-call.sock");
    let d = disk();
    let dev = start(&path, &d);
    let mut g = Guest::connect(&path);
    g.set_ring();
    g.post(true, 0x3c);
    g.fe.set_vring_kick(0, &g.kick).unwrap();
    g.fe.set_vring_enable(0, true).unwrap();
    assert_eq!(g.completed(), 0);
    let call = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    g.fe.set_vring_call(0, &call).unwrap();
    assert!(
        call.read().is_ok_and(|n| n > 0),
        "the new call fd was not signalled"
    );
    dev.stop();
}

#[test]
fn config_change_reaches_the_front_end_on_resize() {
    let path = sock("resize.sock");
    let d = disk();
    let dev = start(&path, &d);
    let mut g = Guest::connect(&path);
    let (mut mine, theirs) = UnixStream::pair().unwrap();
    mine.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    g.fe.set_backend_request_fd(&theirs).unwrap();
    let bigger = d.resize(DISK * 2).unwrap();
    assert_eq!(
        dev.resize(bigger).unwrap(),
        vhost_user_blk::ConfigNotice::Sent
    );
    let mut hdr = [0u8; 12];
    mine.read_exact(&mut hdr).unwrap();
    assert_eq!(u32::from_le_bytes(hdr[0..4].try_into().unwrap()), 2);
    let (_, cfg) =
        g.fe.get_config(0, 8, VhostUserConfigFlags::WRITABLE, &[0; 8])
            .unwrap();
    assert_eq!(u64::from_le_bytes(cfg.try_into().unwrap()), 2 * DISK / 512);
    dev.stop();
}

/// Raw bytes on the socket: a header (request, flags with version 1 and
/// NEED_REPLY, size) and a body.
fn raw(s: &mut UnixStream, req: u32, body: &[u8]) {
    let mut m = req.to_le_bytes().to_vec();
    m.extend_from_slice(&(1u32 | 8).to_le_bytes());
    m.extend_from_slice(&(body.len() as u32).to_le_bytes());
    m.extend_from_slice(body);
    // The device may hang up before all of it is written.
    let _ = s.write_all(&m);
}

/// Whether the device ended the connection (reads the end of the stream).
fn closed(s: &mut UnixStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut b = [0u8; 64];
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => continue,
            // Hung up with our bytes unread.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

#[test]
fn hostile_messages_end_that_connection_only() {
    let path = sock("hostile.sock");
    let d = disk();
    let dev = start(&path, &d);
    // A header announcing more than any message carries.
    let mut s = UnixStream::connect(&path).unwrap();
    raw(&mut s, 8, &vec![0u8; 8192]);
    assert!(closed(&mut s));
    // A vring index beyond the device.
    let mut s = UnixStream::connect(&path).unwrap();
    let mut body = 99u32.to_le_bytes().to_vec();
    body.extend_from_slice(&16u32.to_le_bytes());
    raw(&mut s, 8, &body);
    assert!(closed(&mut s));
    // A body shorter than the request needs.
    let mut s = UnixStream::connect(&path).unwrap();
    raw(&mut s, 8, &[1, 2, 3]);
    assert!(closed(&mut s));
    // Too many fds on a message that takes one.
    let mut s = UnixStream::connect(&path).unwrap();
    let e = [EventFd::new(0).unwrap(), EventFd::new(0).unwrap()];
    let mut m = 12u32.to_le_bytes().to_vec();
    m.extend_from_slice(&1u32.to_le_bytes());
    m.extend_from_slice(&8u32.to_le_bytes());
    m.extend_from_slice(&0u64.to_le_bytes());
    use vmm_sys_util::sock_ctrl_msg::ScmSocket;
    s.send_with_fds(&[&m[..]], &[e[0].as_raw_fd(), e[1].as_raw_fd()])
        .unwrap();
    assert!(closed(&mut s));
    // A trickling sender: half a header, then nothing.
    let mut s = UnixStream::connect(&path).unwrap();
    s.write_all(&[1, 0, 0, 0, 1, 0]).unwrap();
    assert!(closed(&mut s), "the deadline ends a trickling sender");
    // A memory file shorter than the region claims: refused (and said so).
    let mut fe = Frontend::connect(&path, 1).unwrap();
    features(&mut fe);
    let short = memfd(4096);
    let region = VhostUserMemoryRegionInfo {
        guest_phys_addr: 0,
        memory_size: MEM,
        userspace_addr: UADDR,
        mmap_offset: 0,
        mmap_handle: short.as_raw_fd(),
    };
    assert!(fe.set_mem_table(&[region]).is_err());
    // The refusal left that connection usable.
    assert_eq!(fe.get_queue_num().unwrap(), 1);
    drop(fe);
    // And the device serves the next front end.
    let mut g = Guest::connect(&path);
    g.start_ring();
    assert_eq!(g.request(true, 1), 0);
    dev.stop();
}

#[test]
fn pause_save_restore_round_trip() {
    let path = sock("handover.sock");
    let d = disk();
    let a = start(&path, &d);
    let mut g = Guest::connect(&path);
    let (inflight, area) =
        g.fe.get_inflight_fd(&VhostUserInflight {
            mmap_size: 0,
            mmap_offset: 0,
            num_queues: 1,
            queue_size: QSIZE,
        })
        .unwrap();
    g.fe.set_inflight_fd(&inflight, area.as_raw_fd()).unwrap();
    g.start_ring();
    assert_eq!(g.request(true, 0x77), 0);
    // Save needs a pause.
    assert!(matches!(a.save(), Err(vhost_user_blk::Error::NotPaused)));
    a.pause(Duration::from_secs(5)).unwrap();
    assert!(a.paused());
    let (state, fds): (HandoverState, Vec<OwnedFd>) = a.save().unwrap();
    let c = state.connection.as_ref().unwrap();
    assert!(c.inflight.is_some());
    assert_eq!(c.vrings[0].base, 1);
    assert!(c.vrings[0].started && c.vrings[0].enabled);
    // Across a process boundary it is JSON.
    let json = serde_json::to_string(&state).unwrap();
    let state: HandoverState = serde_json::from_str(&json).unwrap();
    // A corrupt copy is refused, leaving the old device able to go on.
    let mut bad = state.clone();
    bad.connection.as_mut().unwrap().vrings[0].base = 5;
    let dup: Vec<OwnedFd> = fds.iter().map(|f| f.try_clone().unwrap()).collect();
    assert!(matches!(
        VhostUserBlk::restore(&path, d.clone(), opts(), &engine(), &[0], bad, dup),
        Err(vhost_user_blk::Error::State(
            vhost_user_blk::StateError::UsedIndex { .. }
        ))
    ));
    let b = VhostUserBlk::restore(&path, d.clone(), opts(), &engine(), &[0], state, fds).unwrap();
    assert!(b.paused());
    a.stop();
    b.resume();
    // The same front end, same rings, no reconnect.
    assert_eq!(g.request(false, 0), 0);
    assert_eq!(g.data(), vec![0x77; 512]);
    assert_eq!(g.fe.get_queue_num().unwrap(), 1);
    assert_eq!(b.connections(), 1);
    // The inflight area's used index (bytes 14..16 of queue 0's region) follows.
    let mut log = [0u8; 16];
    area.read_exact_at(&mut log, 0).unwrap();
    assert_eq!(u16::from_le_bytes([log[14], log[15]]), 2);
    b.stop();
}
