//! What the inflight log (vhost-user INFLIGHT_SHMFD) costs per request on the queue
//! worker's hot path: one null-disk 4 KiB read per `process` call on a fake guest
//! ring, with and without a log, rounds alternated. libblkio does not negotiate the
//! log, so `udrive perf --vhost-user` cannot show this; QEMU does.
//!
//! `cargo run --release -p virtio-blk --example inflight_cost [ROUNDS] [REQS]`

use std::sync::Arc;
use std::time::Instant;

use bdev::{BlockDevice, NullDisk};
use virtio_blk::{
    queue_region_size, BlkConfig, DeviceOptions, InflightMem, InflightQueue, Mem, QueueWorker,
};
use virtio_queue::desc::{split::Descriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::Queue;
use vm_memory::{Bytes, GuestAddress};

const QSIZE: u16 = 256;
const HDR: u64 = 0x4_0000;
const DATA: u64 = 0x5_0000;
const STATUS: u64 = 0x6_0000;

fn run(log: bool, reqs: u32) -> f64 {
    let mem = Arc::new(Mem::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap());
    let disk = NullDisk::new(1 << 30, 512).unwrap();
    let opts = DeviceOptions {
        queue_size: QSIZE,
        ..Default::default()
    };
    let cfg = Arc::new(BlkConfig::new(opts, disk.info().clone()));
    let m = MockSplitQueue::new(&*mem, QSIZE);
    let mut q = m.create_queue::<Queue>().unwrap();
    let avail = m.avail_addr().0;
    drop(m);
    let mut w = QueueWorker::new(cfg, disk.channel().unwrap());
    if log {
        let shm = guest_mem::SharedMem::new("bench", queue_region_size(QSIZE) as u64).unwrap();
        let l = InflightQueue::new(Arc::new(InflightMem::Own(shm)), 0, QSIZE).unwrap();
        w.set_inflight(Some(l));
        w.recover(&mut q, &mem);
    }
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&0u32.to_le_bytes());
    mem.write_slice(&h, GuestAddress(HDR)).unwrap();
    let d = |a, l, f, n| RawDescriptor::from(Descriptor::new(a, l, f, n));
    mem.write_obj(d(HDR, 16, 1, 1), GuestAddress(0)).unwrap();
    mem.write_obj(d(DATA, 4096, 1 | 2, 2), GuestAddress(16))
        .unwrap();
    mem.write_obj(d(STATUS, 1, 2, 0), GuestAddress(32)).unwrap();
    let t = Instant::now();
    for i in 0..reqs {
        let i = i as u16;
        mem.write_obj(0u16, GuestAddress(avail + 4 + 2 * u64::from(i % QSIZE)))
            .unwrap();
        mem.write_obj(i.wrapping_add(1), GuestAddress(avail + 2))
            .unwrap();
        w.process(&mut q, &mem, true);
    }
    t.elapsed().as_nanos() as f64 / f64::from(reqs)
}

fn main() {
    let mut a = std::env::args().skip(1);
    let rounds: u32 = a.next().and_then(|s| s.parse().ok()).unwrap_or(5);
    let reqs: u32 = a.next().and_then(|s| s.parse().ok()).unwrap_or(2_000_000);
    let (mut off, mut on) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        off.push(run(false, reqs));
        on.push(run(true, reqs));
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    let (a, b) = (med(&mut off), med(&mut on));
    println!("ns per request (median of {rounds} rounds of {reqs}): log off {a:.1}, log on {b:.1}, cost {:.1}", b - a);
}
