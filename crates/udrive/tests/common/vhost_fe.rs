//! A hand-driven vhost-user front end (rust-vmm's `vhost` Frontend) that builds its
//! own rings in guest memory it shares (a sealed memfd or a plain file it can
//! shrink), and a libblkio client doing verified I/O. Both work against in-process
//! devices and against a `udrive serve` child.

use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

use blkio::{Blkio, BlkioStartOutcome, MemoryRegion, ReqFlags};
use guest_mem::SharedMem;
use vhost::vhost_user::message::{
    VhostUserInflight, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vmm_sys_util::eventfd::EventFd;

pub const QSIZE: u16 = 32;
pub const MEM: u64 = 1 << 20;
pub const AVAIL: u64 = 0x1000;
pub const USED: u64 = 0x2000;
pub const HDR: u64 = 0x4000;
pub const DATA: u64 = 0x5000;
pub const STATUS: u64 = 0x8000;
/// Per-request status bytes for the reconnect test (past its data buffers).
pub const STATUSES: u64 = 0x2_0000;
pub const NEXT: u16 = 1;
pub const WRITE: u16 = 2;
pub const T_IN: u32 = 0;
pub const T_OUT: u32 = 1;

/// A test guest's RAM: a sealed memfd (QEMU's memory-backend-memfd) or a plain
/// file that the guest's VMM can shrink (memory-backend-file).
pub enum GuestRam {
    Sealed(SharedMem),
    File(std::fs::File, guest_mem::MappedRegion),
}

impl From<SharedMem> for GuestRam {
    fn from(m: SharedMem) -> GuestRam {
        GuestRam::Sealed(m)
    }
}

impl GuestRam {
    pub fn file(len: u64) -> GuestRam {
        use std::os::fd::AsFd;
        let f = tempfile::tempfile().unwrap();
        f.set_len(len).unwrap();
        let map =
            guest_mem::MappedRegion::map_fd(f.as_fd(), 0, 0, len, guest_mem::Prot::RW).unwrap();
        GuestRam::File(f, map)
    }

    pub fn all(&self) -> guest_mem::DmaSlice<'_> {
        match self {
            GuestRam::Sealed(m) => m.all(),
            GuestRam::File(_, map) => map.slice(0, map.len() as usize).unwrap(),
        }
    }

    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        match self {
            GuestRam::Sealed(m) => m.fd(),
            GuestRam::File(f, _) => f.as_fd(),
        }
    }
}

pub struct Raw {
    pub fe: Frontend,
    pub mem: GuestRam,
    pub next_desc: u16,
    pub avail: u16,
    pub kick: EventFd,
    pub call: EventFd,
    /// VIRTIO_RING_F_EVENT_IDX was negotiated.
    pub event_idx: bool,
}

impl Raw {
    pub fn connect(sock: &Path) -> Raw {
        let mem = SharedMem::new("hostile-guest", MEM).unwrap();
        Self::connect_with(sock, mem, None)
    }

    /// Connects with guest memory `mem`. `resume`: rings already hold requests; start
    /// at this avail index (what QEMU does after a backend disconnect: the used index)
    /// instead of zeroing the rings.
    pub fn connect_with(sock: &Path, mem: impl Into<GuestRam>, resume: Option<(u16, u16)>) -> Raw {
        Self::connect_log(sock, mem, resume, None)
    }

    /// As `connect_with`; with `log`, negotiates INFLIGHT_SHMFD and hands the
    /// device that inflight area (SET_INFLIGHT_FD) before the rings start.
    pub fn connect_log(
        sock: &Path,
        mem: impl Into<GuestRam>,
        resume: Option<(u16, u16)>,
        log: Option<&std::fs::File>,
    ) -> Raw {
        Self::connect_features(sock, mem, resume, log, VhostUserProtocolFeatures::CONFIG)
    }

    /// As `connect_log`, negotiating the protocol features `want_pf` (plus
    /// INFLIGHT_SHMFD with `log`).
    pub fn connect_features(
        sock: &Path,
        mem: impl Into<GuestRam>,
        resume: Option<(u16, u16)>,
        log: Option<&std::fs::File>,
        want_pf: VhostUserProtocolFeatures,
    ) -> Raw {
        Self::connect_virtio(sock, mem, resume, log, want_pf, 0)
    }

    /// As `connect_features`, negotiating the virtio feature bits `extra` too
    /// (`VIRTIO_RING_F_EVENT_IDX`: [`Raw::push_polite`] then follows avail_event).
    pub fn connect_virtio(
        sock: &Path,
        mem: impl Into<GuestRam>,
        resume: Option<(u16, u16)>,
        log: Option<&std::fs::File>,
        mut want_pf: VhostUserProtocolFeatures,
        extra: u64,
    ) -> Raw {
        let mem = mem.into();
        if log.is_some() {
            want_pf |= VhostUserProtocolFeatures::INFLIGHT_SHMFD;
        }
        let mut fe = negotiate_virtio(sock, want_pf, extra);
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
            kick: EventFd::new(0).unwrap(),
            call: EventFd::new(0).unwrap(),
            event_idx: extra & virtio_blk::features::EVENT_IDX != 0,
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
    pub fn start_vring(&mut self) {
        self.put(0, &[0u8; USED as usize + 4096]);
        self.avail = 0;
        self.next_desc = 0;
        self.setup_vring(0);
    }

    pub fn setup_vring(&mut self, avail_base: u16) {
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
        self.fe.set_vring_call(0, &self.call).unwrap();
        self.fe.set_vring_kick(0, &self.kick).unwrap();
        self.fe.set_vring_enable(0, true).unwrap();
    }

    pub fn base(&self) -> u64 {
        self.mem.all().as_ptr() as u64
    }

    pub fn set_mem_table(&self) {
        let region = VhostUserMemoryRegionInfo {
            guest_phys_addr: 0,
            memory_size: MEM,
            userspace_addr: self.base(),
            mmap_offset: 0,
            mmap_handle: self.mem.fd().as_raw_fd(),
        };
        self.fe.set_mem_table(&[region]).unwrap();
    }

    pub fn put(&self, at: u64, bytes: &[u8]) {
        self.mem.all().write_from(at as usize, bytes).unwrap();
    }

    /// Writes request `i`'s parts into guest memory: an OUT header for sector `i * 8`,
    /// 4 KiB of byte `i + 1` and an unset status byte. Returns the header's address.
    pub fn stage_write(&self, i: u64) -> u64 {
        let hdr_at = HDR + 16 * i;
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&T_OUT.to_le_bytes());
        h[8..16].copy_from_slice(&(i * 8).to_le_bytes());
        self.put(hdr_at, &h);
        self.put(DATA + 4096 * i, &[i as u8 + 1; 4096]);
        self.put(STATUSES + i, &[0xff]);
        hdr_at
    }
    pub fn get(&self, at: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.mem.all().read_into(at as usize, &mut v).unwrap();
        v
    }
    pub fn u16_at(&self, at: u64) -> u16 {
        let b = self.get(at, 2);
        u16::from_le_bytes([b[0], b[1]])
    }

    pub fn header(&self, t: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&t.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.put(HDR, &h);
    }

    pub fn desc(&self, idx: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let mut d = [0u8; 16];
        d[0..8].copy_from_slice(&addr.to_le_bytes());
        d[8..12].copy_from_slice(&len.to_le_bytes());
        d[12..14].copy_from_slice(&flags.to_le_bytes());
        d[14..16].copy_from_slice(&next.to_le_bytes());
        self.put(16 * u64::from(idx), &d);
    }

    /// Links `descs` (addr, len, write) into a chain, publishes it and kicks.
    pub fn push(&mut self, descs: &[(u64, u32, bool)]) {
        let head = self.link(descs);
        self.publish(head);
    }

    /// As [`push`](Self::push), kicking only if the device asked for it (as a
    /// driver does: avail_event with EVENT_IDX, else the used ring's NO_NOTIFY
    /// flag; virtio 1.2, 2.7.10). Returns whether it kicked.
    pub fn push_polite(&mut self, descs: &[(u64, u32, bool)]) -> bool {
        let head = self.link(descs);
        let old = self.avail;
        self.make_avail(head);
        let kick = self.wants_kick(old, self.avail);
        if kick {
            self.kick.write(1).unwrap();
        }
        kick
    }

    /// Whether the device asks to be kicked for the avail index moving `old` →
    /// `new`: it passed avail_event with EVENT_IDX, else NO_NOTIFY is clear.
    pub fn wants_kick(&self, old: u16, new: u16) -> bool {
        if self.event_idx {
            let event = self.avail_event();
            new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(old)
        } else {
            self.used_flags() & 1 == 0
        }
    }

    /// The used ring's flags (bit 0: VRING_USED_F_NO_NOTIFY).
    pub fn used_flags(&self) -> u16 {
        self.u16_at(USED)
    }

    /// The used ring's avail_event (EVENT_IDX): the driver kicks when its avail
    /// index passes it.
    pub fn avail_event(&self) -> u16 {
        self.u16_at(USED + 4 + 8 * u64::from(QSIZE))
    }

    fn link(&mut self, descs: &[(u64, u32, bool)]) -> u16 {
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
        head
    }

    pub fn publish(&mut self, head: u16) {
        self.make_avail(head);
        self.kick.write(1).unwrap();
    }

    fn make_avail(&mut self, head: u16) {
        self.put(
            AVAIL + 4 + 2 * u64::from(self.avail % QSIZE),
            &head.to_le_bytes(),
        );
        self.avail = self.avail.wrapping_add(1);
        fence(Ordering::SeqCst);
        self.put(AVAIL + 2, &self.avail.to_le_bytes());
        fence(Ordering::SeqCst);
    }

    pub fn used_idx(&self) -> u16 {
        self.u16_at(USED + 2)
    }

    /// Waits (bounded) until the used index reaches `n` (or passes it).
    pub fn wait_used(&self, n: u16) -> bool {
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
    pub fn request(&mut self, descs: &[(u64, u32, bool)]) -> u8 {
        self.put(STATUS, &[0xff]);
        let n = self.used_idx().wrapping_add(1);
        self.push(descs);
        assert!(self.wait_used(n), "request not completed");
        self.get(STATUS, 1)[0]
    }
}

/// Connects as a front end: owner, VERSION_1 and PROTOCOL_FEATURES, then the
/// protocol features in `want`, which the device must offer.
pub fn negotiate(sock: &Path, want: VhostUserProtocolFeatures) -> Frontend {
    negotiate_virtio(sock, want, 0)
}

/// As [`negotiate`], with the virtio feature bits `extra` too (which the device
/// must offer).
pub fn negotiate_virtio(sock: &Path, want: VhostUserProtocolFeatures, extra: u64) -> Frontend {
    let mut fe = Frontend::connect(sock, 1).expect("connect");
    fe.set_owner().unwrap();
    let f = fe.get_features().unwrap();
    let virtio = (1u64 << 32) | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() | extra;
    assert_eq!(f & virtio, virtio);
    fe.set_features(virtio).unwrap();
    let pf = fe.get_protocol_features().unwrap();
    assert!(
        pf.contains(want),
        "the device offers {pf:?}, not all of {want:?}"
    );
    fe.set_protocol_features(pf & want).unwrap();
    fe
}

/// Asks a device for a fresh inflight area (GET_INFLIGHT_FD), as QEMU does once.
pub fn get_inflight_area(sock: &Path) -> std::fs::File {
    let mut fe = negotiate(sock, VhostUserProtocolFeatures::INFLIGHT_SHMFD);
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

/// A libblkio (virtio-blk-vhost-user) client with one 4 KiB buffer.
pub struct BlkioClient {
    b: Blkio,
    s: Option<BlkioStartOutcome>,
    region: MemoryRegion,
}

impl BlkioClient {
    pub fn connect(sock: &Path) -> Result<BlkioClient, String> {
        let e = |e: blkio::Error| format!("libblkio on {}: {e}", sock.display());
        let mut b = Blkio::new("virtio-blk-vhost-user").map_err(e)?;
        b.set_str("path", sock.to_str().unwrap_or_default())
            .map_err(e)?;
        b.connect().map_err(e)?;
        let s = b.start().map_err(e)?;
        let region = b.alloc_mem_region(4096).map_err(e)?;
        b.map_mem_region(&region).map_err(e)?;
        Ok(BlkioClient {
            b,
            s: Some(s),
            region,
        })
    }

    fn io(&mut self, write: bool, off: u64) -> Result<(), String> {
        let buf = self.region.addr as *mut u8;
        let Some(s) = self.s.as_mut() else {
            return Err("libblkio: not started".into());
        };
        let q = &mut s.queues[0];
        if write {
            q.write(off, buf, 4096, 0, ReqFlags::empty());
        } else {
            q.read(off, buf, 4096, 0, ReqFlags::empty());
        }
        let mut comps = [std::mem::MaybeUninit::uninit()];
        let mut t = Duration::from_secs(10);
        let n = q
            .do_io(&mut comps, 1, Some(&mut t), None)
            .map_err(|e| format!("libblkio {}: {e}", if write { "write" } else { "read" }))?;
        // SAFETY: do_io initialised `n` completions.
        if n != 1 || unsafe { comps[0].assume_init_ref() }.ret != 0 {
            return Err(format!("libblkio request at {off} failed"));
        }
        Ok(())
    }

    /// Writes 4 KiB of `byte` at `off`, reads it back and compares.
    pub fn round(&mut self, off: u64, byte: u8) -> Result<(), String> {
        let buf = self.region.addr as *mut u8;
        // SAFETY: the region is mapped read/write and no request is in flight.
        unsafe { std::ptr::write_bytes(buf, byte, 4096) };
        self.io(true, off)?;
        // SAFETY: as above.
        unsafe { std::ptr::write_bytes(buf, 0, 4096) };
        self.io(false, off)?;
        // SAFETY: as above.
        let back = unsafe { std::slice::from_raw_parts(buf, 4096) };
        if !back.iter().all(|x| *x == byte) {
            return Err(format!("libblkio: data mismatch at {off}"));
        }
        Ok(())
    }
}

impl Drop for BlkioClient {
    fn drop(&mut self) {
        self.s = None;
        self.b.unmap_mem_region(&self.region);
        self.b.free_mem_region(&self.region);
    }
}

/// A libblkio client doing one verified write/read round on `sock`.
pub fn blkio_round(sock: &Path, byte: u8) {
    BlkioClient::connect(sock)
        .and_then(|mut c| c.round(0, byte))
        .unwrap();
}
