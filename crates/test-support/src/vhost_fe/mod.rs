//! A fake vhost-user front end: a VMM and its guest driver in one, for tests of
//! vhost-user-blk devices.
//!
//! It speaks the control protocol through rust-vmm's `vhost` `Frontend` (so the
//! messages are what QEMU sends), and drives one split virtqueue of [`QSIZE`]
//! entries that it lays out itself in guest RAM it shares with the device (a sealed
//! memfd or a plain file it can shrink). It writes descriptors, avail entries and
//! kicks by hand, so a test can also write what no real driver would: loops,
//! descriptors outside memory, avail jumps, requests left queued over a disconnect.
//!
//! What it models: feature and protocol-feature negotiation, SET_MEM_TABLE with one
//! region at guest address 0, one queue (SET_VRING_*), the inflight area
//! (GET/SET_INFLIGHT_FD), reconnecting to rings that already hold requests, and the
//! driver's side of notification suppression (NO_NOTIFY, EVENT_IDX's avail_event).
//! What it does not: more than one queue, packed rings, indirect descriptors, the
//! config space beyond what the `vhost` crate's calls return, interrupts (the call
//! eventfd is there; tests poll the used ring).
//!
//! Guest RAM layout ([`MEM`] bytes): descriptor table at 0, avail ring at [`AVAIL`],
//! used ring at [`USED`], a request header at [`HDR`], data at [`DATA`] and a status
//! byte at [`STATUS`]; [`STATUSES`] holds one status byte per request for tests
//! that keep many in flight.

mod ram;
mod ring;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;

use vhost::vhost_user::message::{
    VhostUserInflight, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use vmm_sys_util::eventfd::EventFd;

pub use ram::GuestRam;

pub const QSIZE: u16 = 32;
pub const MEM: u64 = 1 << 20;
pub const AVAIL: u64 = 0x1000;
pub const USED: u64 = 0x2000;
pub const HDR: u64 = 0x4000;
pub const DATA: u64 = 0x5000;
pub const STATUS: u64 = 0x8000;
/// Per-request status bytes for tests with many requests in flight (past their
/// data buffers).
pub const STATUSES: u64 = 0x2_0000;
/// Descriptor flags (VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_WRITE).
pub const NEXT: u16 = 1;
pub const WRITE: u16 = 2;
/// Request types (VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT).
pub const T_IN: u32 = 0;
pub const T_OUT: u32 = 1;
/// VIRTIO_RING_F_EVENT_IDX as a feature bit.
pub const EVENT_IDX: u64 = 1 << VIRTIO_RING_F_EVENT_IDX;

/// How [`FakeFrontend::connect_with`] sets the device up.
pub struct Connect<'a> {
    pub mem: GuestRam,
    /// Rings already hold requests: `(vring base, avail index)` to start from (what
    /// QEMU does after a backend disconnect: the used index), instead of zeroing
    /// the rings.
    pub resume: Option<(u16, u16)>,
    /// An inflight area to hand the device (SET_INFLIGHT_FD) before the rings start;
    /// INFLIGHT_SHMFD is negotiated with it.
    pub inflight: Option<&'a File>,
    /// Protocol features to negotiate (the device must offer them).
    pub protocol: VhostUserProtocolFeatures,
    /// Virtio feature bits beyond VERSION_1 and PROTOCOL_FEATURES (e.g.
    /// [`EVENT_IDX`]; [`FakeFrontend::push_polite`] then follows avail_event).
    pub virtio: u64,
}

impl Connect<'_> {
    /// Fresh rings in `mem`, CONFIG negotiated, nothing else.
    pub fn new(mem: impl Into<GuestRam>) -> Connect<'static> {
        Connect {
            mem: mem.into(),
            resume: None,
            inflight: None,
            protocol: VhostUserProtocolFeatures::CONFIG,
            virtio: 0,
        }
    }
}

/// A connected front end with one queue in its own guest RAM.
pub struct FakeFrontend {
    pub fe: Frontend,
    pub mem: GuestRam,
    /// The next descriptor [`FakeFrontend::push`] uses.
    pub next_desc: u16,
    /// The driver's avail index.
    pub avail: u16,
    pub kick: EventFd,
    pub call: EventFd,
    /// VIRTIO_RING_F_EVENT_IDX was negotiated.
    pub event_idx: bool,
}

impl FakeFrontend {
    /// Connects with a fresh sealed memfd as guest RAM and fresh rings.
    pub fn connect(sock: &Path) -> FakeFrontend {
        Self::connect_with(sock, Connect::new(GuestRam::sealed(MEM)))
    }

    /// Connects, negotiates, maps `setup.mem` and starts the queue as `setup` says.
    pub fn connect_with(sock: &Path, setup: Connect<'_>) -> FakeFrontend {
        let mut protocol = setup.protocol;
        if setup.inflight.is_some() {
            protocol |= VhostUserProtocolFeatures::INFLIGHT_SHMFD;
        }
        let mut fe = negotiate_virtio(sock, protocol, setup.virtio);
        if let Some(f) = setup.inflight {
            let info = VhostUserInflight {
                mmap_size: f.metadata().expect("inflight area size").len(),
                mmap_offset: 0,
                num_queues: 1,
                queue_size: QSIZE,
            };
            fe.set_inflight_fd(&info, f.as_raw_fd())
                .expect("SET_INFLIGHT_FD");
        }
        let mut r = FakeFrontend {
            fe,
            mem: setup.mem,
            next_desc: 0,
            avail: 0,
            kick: EventFd::new(0).expect("kick eventfd"),
            call: EventFd::new(0).expect("call eventfd"),
            event_idx: setup.virtio & EVENT_IDX != 0,
        };
        r.set_mem_table();
        match setup.resume {
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

    /// SET_VRING_NUM/ADDR/BASE/CALL/KICK/ENABLE on the rings as they are.
    pub fn setup_vring(&mut self, avail_base: u16) {
        let base = self.base();
        let fe = &mut self.fe;
        fe.set_vring_num(0, QSIZE).expect("SET_VRING_NUM");
        let addrs = VringConfigData {
            queue_max_size: QSIZE,
            queue_size: QSIZE,
            flags: 0,
            desc_table_addr: base,
            used_ring_addr: base + USED,
            avail_ring_addr: base + AVAIL,
            log_addr: None,
        };
        fe.set_vring_addr(0, &addrs).expect("SET_VRING_ADDR");
        fe.set_vring_base(0, avail_base).expect("SET_VRING_BASE");
        fe.set_vring_call(0, &self.call).expect("SET_VRING_CALL");
        fe.set_vring_kick(0, &self.kick).expect("SET_VRING_KICK");
        fe.set_vring_enable(0, true).expect("SET_VRING_ENABLE");
    }

    /// Where guest RAM is mapped here: the front end's "userspace address".
    pub fn base(&self) -> u64 {
        self.mem.all().as_ptr() as u64
    }

    /// SET_MEM_TABLE: all of guest RAM as one region at guest address 0.
    pub fn set_mem_table(&self) {
        let region = VhostUserMemoryRegionInfo {
            guest_phys_addr: 0,
            memory_size: MEM,
            userspace_addr: self.base(),
            mmap_offset: 0,
            mmap_handle: self.mem.fd().as_raw_fd(),
        };
        self.fe.set_mem_table(&[region]).expect("SET_MEM_TABLE");
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
    fe.set_owner().expect("SET_OWNER");
    let f = fe.get_features().expect("GET_FEATURES");
    let virtio =
        (1u64 << VIRTIO_F_VERSION_1) | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() | extra;
    assert_eq!(f & virtio, virtio, "the device offers {f:#x}");
    fe.set_features(virtio).expect("SET_FEATURES");
    let pf = fe.get_protocol_features().expect("GET_PROTOCOL_FEATURES");
    assert!(
        pf.contains(want),
        "the device offers {pf:?}, not all of {want:?}"
    );
    fe.set_protocol_features(pf & want)
        .expect("SET_PROTOCOL_FEATURES");
    fe
}

/// Asks a device for a fresh inflight area (GET_INFLIGHT_FD), as QEMU does once.
pub fn get_inflight_area(sock: &Path) -> File {
    let mut fe = negotiate(sock, VhostUserProtocolFeatures::INFLIGHT_SHMFD);
    let ask = VhostUserInflight {
        mmap_size: 0,
        mmap_offset: 0,
        num_queues: 1,
        queue_size: QSIZE,
    };
    let (info, file) = fe.get_inflight_fd(&ask).expect("GET_INFLIGHT_FD");
    assert_eq!(info.mmap_offset, 0);
    assert!(info.mmap_size >= 16 + 16 * u64::from(QSIZE));
    let len = file.metadata().expect("inflight area size").len();
    assert!(len >= info.mmap_size);
    file
}

/// Writes into an inflight area what a device that died left there (layout:
/// docs/decisions/0005): the queue's header ...
pub fn inflight_header(f: &File, desc_num: u16, last_batch_head: u16, used_idx: u16) {
    inflight_put(f, 8, &1u16.to_le_bytes());
    inflight_put(f, 10, &desc_num.to_le_bytes());
    inflight_put(f, 12, &last_batch_head.to_le_bytes());
    inflight_put(f, 14, &used_idx.to_le_bytes());
}

/// ... and descriptor `head`'s in-flight flag and submission counter.
pub fn inflight_desc(f: &File, head: u16, inflight: u8, counter: u64) {
    let at = 16 + 16 * u64::from(head);
    inflight_put(f, at, &[inflight]);
    inflight_put(f, at + 8, &counter.to_le_bytes());
}

fn inflight_put(f: &File, at: u64, bytes: &[u8]) {
    use std::os::unix::fs::FileExt;
    f.write_all_at(bytes, at).expect("inflight area write");
}
