//! The worker against a fake guest: rings and buffers in a plain memory map built
//! with virtio-queue's mock helpers, a RAM disk behind.

use std::sync::Arc;

use bdev::{BlockDevice, RamDisk};
use virtio_bindings::virtio_blk as vb;
use virtio_bindings::virtio_ring::{VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::{split::Descriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

use crate::{BlkConfig, DeviceOptions, Mem, QueueError, QueueWorker};

const QSIZE: u16 = 16;
const DISK: u64 = 1 << 20;
const HDR: u64 = 0x4_0000;
const DATA: u64 = 0x5_0000;
const STATUS: u64 = 0x6_0000;
const R: u16 = 0;
const W: u16 = VRING_DESC_F_WRITE as u16;

struct Guest {
    mem: Arc<Mem>,
    queue: Queue,
    worker: QueueWorker,
    /// Next free descriptor and avail slot.
    next_desc: u16,
    avail: u16,
    avail_addr: u64,
    used_addr: u64,
}

fn info(cache: bool) -> bdev::BlockInfo {
    let mut i = RamDisk::new(DISK, 512).unwrap().info().clone();
    i.write_cache = cache;
    i
}

fn guest_with(cfg_info: bdev::BlockInfo, seg_max: u32) -> Guest {
    let mem = Arc::new(Mem::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap());
    let disk = RamDisk::new(DISK, 512).unwrap();
    let opts = DeviceOptions {
        queue_size: QSIZE,
        seg_max,
        serial: "test-serial".into(),
        ..Default::default()
    };
    let cfg = Arc::new(BlkConfig::new(opts, cfg_info));
    // The mock lays the rings out (and zeroes them) once; afterwards the test writes
    // guest memory directly, as a driver would.
    let m = MockSplitQueue::new(&*mem, QSIZE);
    let queue = m.create_queue::<Queue>().unwrap();
    let (avail_addr, used_addr) = (m.avail_addr().0, m.used_addr().0);
    drop(m);
    Guest {
        avail_addr,
        used_addr,
        worker: QueueWorker::new(cfg, disk.channel().unwrap()),
        mem,
        queue,
        next_desc: 0,
        avail: 0,
    }
}

fn guest() -> Guest {
    guest_with(info(false), 8)
}

fn desc(addr: u64, len: u32, flags: u16) -> (u64, u32, u16) {
    (addr, len, flags)
}

impl Guest {
    fn store_desc(&self, idx: u16, d: Descriptor) {
        self.mem
            .write_obj(RawDescriptor::from(d), GuestAddress(16 * u64::from(idx)))
            .unwrap();
    }

    fn set_avail_idx(&self, v: u16) {
        self.mem
            .write_obj(v, GuestAddress(self.avail_addr + 2))
            .unwrap();
    }

    fn header(&self, at: u64, t: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&t.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.mem.write_slice(&h, GuestAddress(at)).unwrap();
    }

    /// Writes a chain of linked descriptors and publishes it; returns the head.
    fn push(&mut self, descs: &[(u64, u32, u16)]) -> u16 {
        if usize::from(self.next_desc) + descs.len() > usize::from(QSIZE) {
            self.next_desc = 0;
        }
        let head = self.next_desc;
        for (i, (addr, len, flags)) in descs.iter().enumerate() {
            let idx = head + i as u16;
            let last = i == descs.len() - 1;
            let f = if last {
                *flags
            } else {
                *flags | VRING_DESC_F_NEXT as u16
            };
            let d = Descriptor::new(*addr, *len, f, if last { 0 } else { idx + 1 });
            self.store_desc(idx, d);
        }
        self.next_desc = (head + descs.len() as u16) % QSIZE;
        self.publish(head);
        head
    }

    fn publish(&mut self, head: u16) {
        let at = self.avail;
        self.avail = at.wrapping_add(1);
        let slot = self.avail_addr + 4 + 2 * u64::from(at % QSIZE);
        self.mem.write_obj(head, GuestAddress(slot)).unwrap();
        self.set_avail_idx(self.avail);
    }

    fn run(&mut self) -> crate::Progress {
        self.worker.process(&mut self.queue, &self.mem, true)
    }

    fn used(&self, i: u16) -> (u32, u32) {
        let at = self.used_addr + 4 + 8 * u64::from(i);
        let id = self.mem.read_obj::<u32>(GuestAddress(at)).unwrap();
        let len = self.mem.read_obj::<u32>(GuestAddress(at + 4)).unwrap();
        (id, len)
    }

    fn used_idx(&self) -> u16 {
        self.mem
            .read_obj::<u16>(GuestAddress(self.used_addr + 2))
            .unwrap()
    }

    fn status(&self) -> u8 {
        self.mem.read_obj::<u8>(GuestAddress(STATUS)).unwrap()
    }

    fn reset_status(&self) {
        self.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
    }

    /// One request with header, optional data, status; returns (status, used len).
    fn request(&mut self, t: u32, sector: u64, data: Option<(u32, u16)>) -> (u8, u32) {
        self.header(HDR, t, sector);
        self.reset_status();
        let mut d = vec![desc(HDR, 16, R)];
        if let Some((len, dir)) = data {
            d.push(desc(DATA, len, dir));
        }
        d.push(desc(STATUS, 1, W));
        let before = self.used_idx();
        let head = self.push(&d);
        self.run();
        assert_eq!(self.used_idx(), before.wrapping_add(1), "one used entry");
        let (id, len) = self.used(before % QSIZE);
        assert_eq!(id, u32::from(head));
        (self.status(), len)
    }
}

const OK: u8 = vb::VIRTIO_BLK_S_OK as u8;
const IOERR: u8 = vb::VIRTIO_BLK_S_IOERR as u8;
const UNSUPP: u8 = vb::VIRTIO_BLK_S_UNSUPP as u8;

#[test]
fn write_then_read_back() {
    let mut g = guest();
    let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
    g.mem.write_slice(&pattern, GuestAddress(DATA)).unwrap();
    assert_eq!(g.request(vb::VIRTIO_BLK_T_OUT, 8, Some((4096, R))), (OK, 1));
    g.mem.write_slice(&[0u8; 4096], GuestAddress(DATA)).unwrap();
    assert_eq!(
        g.request(vb::VIRTIO_BLK_T_IN, 8, Some((4096, W))),
        (OK, 4097)
    );
    let mut back = vec![0u8; 4096];
    g.mem.read_slice(&mut back, GuestAddress(DATA)).unwrap();
    assert_eq!(back, pattern);
    assert_eq!(g.worker.in_flight(), 0);
}

#[test]
fn data_and_status_in_one_descriptor_and_split_header() {
    let mut g = guest();
    g.mem
        .write_slice(&[0xabu8; 512], GuestAddress(DATA))
        .unwrap();
    g.request(vb::VIRTIO_BLK_T_OUT, 0, Some((512, R)));
    // Header split over two descriptors; data and status share one writable buffer.
    g.header(HDR, vb::VIRTIO_BLK_T_IN, 0);
    g.mem.write_obj(0xffu8, GuestAddress(DATA + 512)).unwrap();
    g.push(&[desc(HDR, 4, R), desc(HDR + 4, 12, R), desc(DATA, 513, W)]);
    g.run();
    assert_eq!(g.mem.read_obj::<u8>(GuestAddress(DATA + 512)).unwrap(), OK);
    assert_eq!(g.used(1), (3, 513));
}

#[test]
fn get_id_and_unknown_type() {
    let mut g = guest();
    assert_eq!(
        g.request(vb::VIRTIO_BLK_T_GET_ID, 0, Some((20, W))),
        (OK, 21)
    );
    let mut id = [0u8; 20];
    g.mem.read_slice(&mut id, GuestAddress(DATA)).unwrap();
    assert_eq!(&id[..11], b"test-serial");
    assert_eq!(id[11..], [0u8; 9]);
    assert_eq!(g.request(99, 0, None).0, UNSUPP);
    assert_eq!(g.worker.stats().unsupported, 1);
}

#[test]
fn flush_needs_a_write_cache() {
    let mut g = guest();
    assert_eq!(g.request(vb::VIRTIO_BLK_T_FLUSH, 0, None).0, UNSUPP);
    let mut g = guest_with(info(true), 8);
    assert_eq!(g.request(vb::VIRTIO_BLK_T_FLUSH, 0, None).0, OK);
}

fn range_seg(g: &Guest, sector: u64, num: u32, flags: u32) {
    let mut s = [0u8; 16];
    s[0..8].copy_from_slice(&sector.to_le_bytes());
    s[8..12].copy_from_slice(&num.to_le_bytes());
    s[12..16].copy_from_slice(&flags.to_le_bytes());
    g.mem.write_slice(&s, GuestAddress(DATA)).unwrap();
}

#[test]
fn discard_and_write_zeroes() {
    let mut g = guest();
    g.mem
        .write_slice(&[0x5au8; 4096], GuestAddress(DATA))
        .unwrap();
    assert_eq!(g.request(vb::VIRTIO_BLK_T_OUT, 0, Some((4096, R))).0, OK);

    range_seg(&g, 0, 4, 0);
    assert_eq!(
        g.request(vb::VIRTIO_BLK_T_WRITE_ZEROES, 0, Some((16, R))).0,
        OK
    );
    range_seg(&g, 4, 4, vb::VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP);
    assert_eq!(
        g.request(vb::VIRTIO_BLK_T_WRITE_ZEROES, 0, Some((16, R))).0,
        OK
    );
    assert_eq!(g.request(vb::VIRTIO_BLK_T_IN, 0, Some((4096, W))).0, OK);
    let mut back = vec![1u8; 4096];
    g.mem.read_slice(&mut back, GuestAddress(DATA)).unwrap();
    assert!(back.iter().all(|b| *b == 0));

    range_seg(&g, 0, 8, 0);
    assert_eq!(g.request(vb::VIRTIO_BLK_T_DISCARD, 0, Some((16, R))).0, OK);
    // Discard with the unmap flag, unknown flags, ranges past the end, two segments.
    range_seg(&g, 0, 8, 1);
    assert_eq!(
        g.request(vb::VIRTIO_BLK_T_DISCARD, 0, Some((16, R))).0,
        UNSUPP
    );
    range_seg(&g, 0, 8, 0x80);
    assert_eq!(
        g.request(vb::VIRTIO_BLK_T_WRITE_ZEROES, 0, Some((16, R))).0,
        UNSUPP
    );
    range_seg(&g, DISK / 512 - 1, 2, 0);
    assert_eq!(
        g.request(vb::VIRTIO_BLK_T_DISCARD, 0, Some((16, R))).0,
        IOERR
    );
    range_seg(&g, u64::MAX / 256, 2, 0);
    assert_eq!(
        g.request(vb::VIRTIO_BLK_T_DISCARD, 0, Some((16, R))).0,
        IOERR
    );
    assert_eq!(
        g.request(vb::VIRTIO_BLK_T_DISCARD, 0, Some((32, R))).0,
        IOERR
    );
}

#[test]
fn bad_ranges_and_sizes() {
    let mut g = guest();
    let last = DISK / 512;
    assert_eq!(
        g.request(vb::VIRTIO_BLK_T_IN, last, Some((512, W))).0,
        IOERR
    );
    assert_eq!(
        g.request(vb::VIRTIO_BLK_T_IN, last - 1, Some((1024, W))).0,
        IOERR
    );
    assert_eq!(
        g.request(vb::VIRTIO_BLK_T_OUT, u64::MAX, Some((512, R))).0,
        IOERR
    );
    assert_eq!(g.request(vb::VIRTIO_BLK_T_IN, 0, Some((100, W))).0, IOERR);
    // A read whose buffer is device-readable has no data to fill: zero-length read.
    assert_eq!(g.request(vb::VIRTIO_BLK_T_IN, 0, Some((512, R))).0, OK);
    assert_eq!(g.worker.in_flight(), 0);
}

#[test]
fn read_only_device_refuses_writes() {
    let mut i = info(false);
    i.read_only = true;
    let mut g = guest_with(i, 8);
    assert_eq!(g.request(vb::VIRTIO_BLK_T_OUT, 0, Some((512, R))).0, IOERR);
    range_seg(&g, 0, 1, 0);
    assert_eq!(
        g.request(vb::VIRTIO_BLK_T_DISCARD, 0, Some((16, R))).0,
        UNSUPP
    );
    assert_eq!(g.request(vb::VIRTIO_BLK_T_IN, 0, Some((512, W))).0, OK);
}

#[test]
fn hostile_chains_get_errors_not_panics() {
    let mut g = guest();
    // Data outside guest memory.
    g.header(HDR, vb::VIRTIO_BLK_T_IN, 0);
    g.reset_status();
    g.push(&[
        desc(HDR, 16, R),
        desc(0xffff_0000, 512, W),
        desc(STATUS, 1, W),
    ]);
    g.run();
    assert_eq!(g.status(), IOERR);
    // Readable descriptor after a writable one.
    g.reset_status();
    g.push(&[
        desc(HDR, 16, R),
        desc(DATA, 512, W),
        desc(DATA, 512, R),
        desc(STATUS, 1, W),
    ]);
    g.run();
    assert_eq!(g.status(), IOERR);
    // No writable status: returned with nothing written.
    g.reset_status();
    let head = g.push(&[desc(HDR, 16, R), desc(STATUS, 1, R)]);
    g.run();
    assert_eq!(g.status(), 0xff);
    assert_eq!(g.used(2), (u32::from(head), 0));
    // Header shorter than 16 bytes.
    g.push(&[desc(HDR, 8, R), desc(STATUS, 1, W)]);
    g.run();
    assert_eq!(g.status(), IOERR);
    assert_eq!(g.used_idx(), 4);
    assert!(g.worker.broken().is_none());
}

#[test]
fn looping_and_overlong_chains() {
    let mut g = guest();
    g.header(HDR, vb::VIRTIO_BLK_T_IN, 0);
    // A loop: 0 -> 1 -> 0 ... The chain ends after queue-size descriptors.
    let n = VRING_DESC_F_NEXT as u16;
    g.store_desc(0, Descriptor::new(HDR, 16, n, 1));
    g.store_desc(1, Descriptor::new(STATUS, 1, n | W, 0));
    g.publish(0);
    g.run();
    assert_eq!(g.used_idx(), 1);
    // More descriptors than seg_max allows (8 + 4): error status, no overflow.
    let mut g = guest();
    g.header(HDR, vb::VIRTIO_BLK_T_IN, 0);
    g.reset_status();
    let mut d = vec![desc(HDR, 16, R)];
    d.extend((0..14).map(|i| desc(DATA + i * 512, 512, W)));
    d.push(desc(STATUS, 1, W));
    g.push(&d);
    g.run();
    assert_eq!(g.status(), IOERR);
}

#[test]
fn indirect_chain() {
    let mut g = guest();
    g.mem
        .write_slice(&[0x77u8; 512], GuestAddress(DATA))
        .unwrap();
    g.request(vb::VIRTIO_BLK_T_OUT, 2, Some((512, R)));
    g.mem.write_slice(&[0u8; 512], GuestAddress(DATA)).unwrap();
    g.header(HDR, vb::VIRTIO_BLK_T_IN, 2);
    g.reset_status();
    let table = 0x7_0000u64;
    let n = VRING_DESC_F_NEXT as u16;
    let entries = [
        Descriptor::new(HDR, 16, n, 1),
        Descriptor::new(DATA, 512, n | W, 2),
        Descriptor::new(STATUS, 1, W, 0),
    ];
    for (i, e) in entries.iter().enumerate() {
        g.mem
            .write_obj(RawDescriptor::from(*e), GuestAddress(table + 16 * i as u64))
            .unwrap();
    }
    g.push(&[desc(table, 48, VRING_DESC_F_INDIRECT as u16)]);
    g.run();
    assert_eq!(g.status(), OK);
    assert_eq!(
        g.mem.read_obj::<u8>(GuestAddress(DATA + 511)).unwrap(),
        0x77
    );
}

#[test]
fn avail_index_jump_stops_the_queue() {
    let mut g = guest();
    g.set_avail_idx(QSIZE + 5);
    g.run();
    assert_eq!(g.worker.broken(), Some(QueueError::AvailIndex));
    assert_eq!(g.used_idx(), 0);
    // Further calls do nothing until reset.
    assert_eq!(g.run().work, 0);
    g.worker.reset();
    assert!(g.worker.broken().is_none());
}

#[test]
fn requests_keep_their_memory_snapshot() {
    let mut g = guest();
    let before = Arc::strong_count(&g.mem);
    g.request(vb::VIRTIO_BLK_T_IN, 0, Some((512, W)));
    // Completed inline: the slot let go of the snapshot.
    assert_eq!(Arc::strong_count(&g.mem), before);
    let _ = g.queue.size();
}

fn with_log(g: &mut Guest) -> guest_mem::SharedMem {
    let shm =
        guest_mem::SharedMem::new("test-inflight", crate::queue_region_size(QSIZE) as u64).unwrap();
    // The worker logs into a mapping of the same memfd (as after SET_INFLIGHT_FD).
    let map = guest_mem::MappedRegion::map_fd(
        std::os::fd::AsFd::as_fd(&shm.fd()),
        0,
        0,
        shm.len(),
        guest_mem::Prot::RW,
    )
    .unwrap();
    let log =
        crate::InflightQueue::new(Arc::new(crate::InflightMem::Mapped(map)), 0, QSIZE).unwrap();
    g.worker.set_inflight(Some(log));
    assert_eq!(g.worker.recover(&mut g.queue, &g.mem), 0);
    shm
}

#[test]
fn inflight_log_follows_requests() {
    let mut g = guest();
    let shm = with_log(&mut g);
    let s = shm.all();
    assert_eq!(s.load_u16(8), Some(1), "version written on first start");
    assert_eq!(s.load_u16(10), Some(QSIZE));
    assert_eq!(g.request(vb::VIRTIO_BLK_T_OUT, 0, Some((512, R))), (OK, 1));
    assert_eq!(g.request(vb::VIRTIO_BLK_T_OUT, 1, Some((512, R))), (OK, 1));
    assert_eq!(s.load_u16(14), Some(2), "log used_idx follows the ring");
    assert_eq!(
        s.load_u16(12),
        Some(3),
        "last batch head is the last completed"
    );
    for h in 0..QSIZE {
        assert_eq!(s.load_u8(16 + 16 * usize::from(h)), Some(0), "head {h}");
    }
    // Counters record the order taken (heads 0 and 3).
    assert_eq!(s.load_u64(16 + 8), Some(1));
    assert_eq!(s.load_u64(16 + 16 * 3 + 8), Some(2));
}

#[test]
fn recover_redoes_logged_heads_in_order_and_skips_the_last_batch() {
    let mut g = guest();
    let shm = with_log(&mut g);
    let s = shm.all();
    // Three writes "taken by a previous process": heads 0, 3, 6, taken in the order
    // 6, 0, 3; head 3 completed (used entry written, flag still set: crash between).
    for (i, head) in [0u16, 3, 6].into_iter().enumerate() {
        let hdr = HDR + 16 * i as u64;
        g.header(hdr, vb::VIRTIO_BLK_T_OUT, i as u64);
        g.mem
            .write_slice(&[i as u8 + 1; 512], GuestAddress(DATA + 512 * i as u64))
            .unwrap();
        g.store_desc(
            head,
            Descriptor::new(hdr, 16, VRING_DESC_F_NEXT as u16, head + 1),
        );
        g.store_desc(
            head + 1,
            Descriptor::new(
                DATA + 512 * i as u64,
                512,
                VRING_DESC_F_NEXT as u16,
                head + 2,
            ),
        );
        g.store_desc(head + 2, Descriptor::new(STATUS + i as u64, 1, W, 0));
        g.mem
            .write_obj(0xffu8, GuestAddress(STATUS + i as u64))
            .unwrap();
        g.publish(head);
    }
    let at = g.used_addr + 4;
    g.mem.write_obj(3u32, GuestAddress(at)).unwrap();
    g.mem
        .write_obj(1u16, GuestAddress(g.used_addr + 2))
        .unwrap();
    for (head, counter) in [(6u16, 1u64), (0, 2), (3, 3)] {
        let o = 16 + 16 * usize::from(head);
        s.store_u64(o + 8, counter).unwrap();
        s.store_u8(o, 1).unwrap();
    }
    s.store_u16(12, 3).unwrap();
    s.store_u16(14, 0).unwrap();
    g.queue.set_next_avail(1);
    assert_eq!(g.worker.recover(&mut g.queue, &g.mem), 2);
    g.worker.process(&mut g.queue, &g.mem, true);
    assert_eq!(g.used_idx(), 3);
    assert_eq!(g.used(1).0, 6, "oldest first");
    assert_eq!(g.used(2).0, 0);
    assert_eq!(
        g.queue.next_avail(),
        3,
        "continues after the redone requests"
    );
    let st = |i: u64| g.mem.read_obj::<u8>(GuestAddress(STATUS + i)).unwrap();
    assert_eq!((st(0), st(1), st(2)), (OK, 0xff, OK));
}

#[test]
fn chain_walk_is_bounded() {
    let g = guest();
    let walk = |head| crate::chain::ChainWalk::new(&g.mem, 0, QSIZE, head).count();
    // A loop ends after at most QSIZE descriptors.
    g.store_desc(0, Descriptor::new(HDR, 16, VRING_DESC_F_NEXT as u16, 1));
    g.store_desc(1, Descriptor::new(HDR, 16, VRING_DESC_F_NEXT as u16, 0));
    assert_eq!(walk(0), usize::from(QSIZE));
    // Heads and next indices outside the table end the chain.
    assert_eq!(walk(QSIZE), 0);
    g.store_desc(2, Descriptor::new(HDR, 16, VRING_DESC_F_NEXT as u16, 999));
    assert_eq!(walk(2), 1);
    // Indirect: a table outside memory, a nested indirect, a bad length.
    let ind = VRING_DESC_F_INDIRECT as u16;
    g.store_desc(3, Descriptor::new(0xffff_ffff_0000, 64, ind, 0));
    assert_eq!(walk(3), 0);
    g.store_desc(4, Descriptor::new(DATA, 32, ind, 0));
    g.mem
        .write_obj(
            RawDescriptor::from(Descriptor::new(DATA, 32, ind, 0)),
            GuestAddress(DATA),
        )
        .unwrap();
    assert_eq!(walk(4), 0, "indirect inside indirect");
    g.store_desc(5, Descriptor::new(DATA, 17, ind, 0));
    assert_eq!(walk(5), 0);
    // An indirect table of two descriptors that loop: bounded by its length.
    g.mem
        .write_obj(
            RawDescriptor::from(Descriptor::new(HDR, 16, VRING_DESC_F_NEXT as u16, 1)),
            GuestAddress(DATA),
        )
        .unwrap();
    g.mem
        .write_obj(
            RawDescriptor::from(Descriptor::new(HDR, 16, VRING_DESC_F_NEXT as u16, 0)),
            GuestAddress(DATA + 16),
        )
        .unwrap();
    g.store_desc(6, Descriptor::new(DATA, 32, ind, 0));
    assert_eq!(walk(6), 2);
}

/// A front end maps a buffer (ADD_MEM_REG, acked) and then publishes a request into
/// it. The queue's owner may have loaded its memory snapshot before the mapping; the
/// request must still be translated with the newer one (it used to get IOERR).
#[test]
fn buffer_mapped_after_the_snapshot_was_loaded() {
    use vm_memory::GuestRegionMmap;
    let mut g = guest();
    let base = 0x10_0000u64;
    let region = GuestRegionMmap::from_range(GuestAddress(base), 0x1_0000, None).unwrap();
    let newer = Arc::new(g.mem.insert_region(Arc::new(region)).unwrap());
    let (hdr, data, status) = (base, base + 0x1000, base + 0x2000);
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&vb::VIRTIO_BLK_T_IN.to_le_bytes());
    newer.write_slice(&h, GuestAddress(hdr)).unwrap();
    newer.write_obj(0xffu8, GuestAddress(status)).unwrap();
    let head = g.push(&[desc(hdr, 16, R), desc(data, 4096, W), desc(status, 1, W)]);
    // The snapshot the poller holds predates the mapping.
    let mut mem = g.mem.clone();
    let mut latest = |m: &mut Arc<Mem>| *m = newer.clone();
    for _ in 0..1000 {
        g.worker
            .process_with(&mut g.queue, &mut mem, &mut latest, true);
        if g.used_idx() == 1 {
            break;
        }
    }
    assert_eq!(g.used_idx(), 1);
    assert_eq!(g.used(0), (u32::from(head), 4097));
    assert_eq!(newer.read_obj::<u8>(GuestAddress(status)).unwrap(), OK);
    assert_eq!(g.worker.stats().errors, 0);
}

/// Counters of the disk's namespace in the worker's snapshot.
fn disk_counts(g: &Guest) -> trace::NsSnapshot {
    let s = g.worker.snapshot();
    assert!(
        s.namespaces.iter().all(|n| n.nsid == crate::DISK_NSID),
        "{s:?}"
    );
    s.namespaces
        .into_iter()
        .find(|n| n.nsid == crate::DISK_NSID)
        .expect("disk namespace")
}

fn errors(ns: &trace::NsSnapshot) -> Vec<(u16, u64)> {
    let mut e: Vec<(u16, u64)> = ns.errors.iter().map(|e| (e.status, e.count)).collect();
    e.sort();
    e
}

#[test]
fn counters_by_op_bytes_and_virtio_status() {
    let mut i = info(false);
    i.read_only = true;
    let mut g = guest_with(i, 8);
    let last = DISK / 512;
    // Two good reads, one past the end, a write to the read-only disk, a flush
    // without a write cache and an unknown type.
    assert_eq!(g.request(vb::VIRTIO_BLK_T_IN, 0, Some((4096, W))).0, OK);
    assert_eq!(g.request(vb::VIRTIO_BLK_T_IN, 8, Some((512, W))).0, OK);
    assert_eq!(
        g.request(vb::VIRTIO_BLK_T_IN, last, Some((512, W))).0,
        IOERR
    );
    assert_eq!(g.request(vb::VIRTIO_BLK_T_OUT, 0, Some((512, R))).0, IOERR);
    assert_eq!(g.request(vb::VIRTIO_BLK_T_FLUSH, 0, None).0, UNSUPP);
    assert_eq!(g.request(99, 0, None).0, UNSUPP);
    let ns = disk_counts(&g);
    assert_eq!(
        (ns.ops.read, ns.ops.write, ns.ops.flush, ns.ops.other),
        (3, 1, 1, 1)
    );
    assert_eq!((ns.bytes.read, ns.bytes.write), (4608, 0));
    assert_eq!(
        errors(&ns),
        vec![(u16::from(IOERR), 2), (u16::from(UNSUPP), 2)]
    );
    // Tracing was never started: no layers.
    assert!(ns.layers.is_empty());
    assert_eq!(g.worker.snapshot().inflight, 0);
}

#[test]
fn traced_requests_have_layers_that_add_up() {
    let mut g = guest();
    let ctl = Arc::new(trace::TraceControl::default());
    let disk = RamDisk::new(DISK, 512).unwrap();
    let cfg = Arc::new(BlkConfig::new(
        DeviceOptions {
            queue_size: QSIZE,
            ..Default::default()
        },
        info(false),
    ));
    g.worker = QueueWorker::traced(cfg, disk.channel().unwrap(), 3, ctl.clone());
    for i in 0..10 {
        g.request(vb::VIRTIO_BLK_T_IN, i, Some((512, W)));
    }
    ctl.start(2);
    for i in 0..20 {
        g.request(vb::VIRTIO_BLK_T_IN, i, Some((512, W)));
        g.request(vb::VIRTIO_BLK_T_OUT, i, Some((512, R)));
    }
    // Rejected before the backend: counted, not traced.
    g.request(vb::VIRTIO_BLK_T_IN, DISK / 512, Some((512, W)));
    ctl.stop();
    g.request(vb::VIRTIO_BLK_T_IN, 0, Some((512, W)));
    let s = g.worker.snapshot();
    assert_eq!(s.queue, 3);
    let ns = disk_counts(&g);
    assert_eq!((ns.ops.read, ns.ops.write), (32, 20));
    // One in two of 40 traced requests (reads and writes alternate, so the sample
    // counter picks one op: count the total over both).
    let total: u64 = ns
        .layers
        .iter()
        .map(|l| l.layers.last().expect("total").1.count)
        .sum();
    assert_eq!(total, 20, "{:?}", ns.layers);
    for l in &ns.layers {
        let names: Vec<&str> = l.layers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["queue", "backend", "complete", "notify", "total"]);
        let mean = |h: &trace::HistSnapshot| h.mean;
        let sum: f64 = l.layers[..4].iter().map(|(_, h)| mean(h)).sum();
        let t = mean(&l.layers[4].1);
        assert!((sum - t).abs() <= 0.02 * t + 10.0, "{} vs {t}", sum);
        // Nothing was signalled: the notify layer is 0.
        assert_eq!(l.layers[3].1.max, 0);
    }
}

/// An online resize: the queue switches to the resized handle and checks requests
/// against the new end; the data below stays.
#[test]
fn set_disk_moves_the_end() {
    let mut g = guest();
    let disk = RamDisk::new(DISK, 512).unwrap();
    let (chan, info) = (disk.channel().unwrap(), disk.info().clone());
    assert!(g.worker.set_disk(chan, info).is_ok());
    let end = DISK / 512;
    g.mem
        .write_slice(&[0x3cu8; 4096], GuestAddress(DATA))
        .unwrap();
    assert_eq!(
        g.request(vb::VIRTIO_BLK_T_OUT, end - 8, Some((4096, R))).0,
        OK
    );
    assert_eq!(
        g.request(vb::VIRTIO_BLK_T_OUT, end, Some((4096, R))).0,
        IOERR
    );
    let big = disk.resize(2 * DISK).unwrap();
    assert!(g
        .worker
        .set_disk(big.channel().unwrap(), big.info().clone())
        .is_ok());
    assert_eq!(g.worker.disk_bytes(), 2 * DISK);
    assert_eq!(g.request(vb::VIRTIO_BLK_T_OUT, end, Some((4096, R))).0, OK);
    g.mem.write_slice(&[0u8; 4096], GuestAddress(DATA)).unwrap();
    assert_eq!(
        g.request(vb::VIRTIO_BLK_T_IN, end - 8, Some((4096, W))).0,
        OK
    );
    let mut back = vec![0u8; 4096];
    g.mem.read_slice(&mut back, GuestAddress(DATA)).unwrap();
    assert_eq!(back, vec![0x3c; 4096]);
    assert_eq!(
        g.request(vb::VIRTIO_BLK_T_IN, 2 * end - 7, Some((4096, W)))
            .0,
        IOERR
    );
    let small = big.resize(DISK / 2).unwrap();
    assert!(g
        .worker
        .set_disk(small.channel().unwrap(), small.info().clone())
        .is_ok());
    assert_eq!(
        g.request(vb::VIRTIO_BLK_T_IN, end / 2, Some((512, W))).0,
        IOERR
    );
}

mod batch;
