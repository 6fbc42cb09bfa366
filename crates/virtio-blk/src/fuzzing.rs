//! Entry points for the coverage-guided fuzzer (`fuzz/`, cargo feature `fuzzing`).

use std::sync::Arc;

use bdev::{BlockDevice, RamDisk};
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

use crate::{BlkConfig, DeviceOptions, InflightMem, InflightQueue, Mem, QueueWorker};

const QSIZE: u16 = 16;
const DESC: u64 = 0;
const AVAIL: u64 = 0x1000;
const USED: u64 = 0x2000;
const MEM: usize = 0x2_0000;

/// A virtqueue whose descriptor table, avail ring and buffers come from the input
/// (written at guest address 0), processed by the real worker on a RAM disk: chain
/// walking, request parsing, completion. `data[0]` bit 0 turns EVENT_IDX on.
pub fn virtqueue(data: &[u8]) {
    let Ok(mem) = Mem::from_ranges(&[(GuestAddress(0), MEM)]) else {
        return;
    };
    let mem = Arc::new(mem);
    let image = data.get(1..).unwrap_or_default();
    let _ = mem.write_slice(&image[..image.len().min(MEM)], GuestAddress(0));
    let Ok(disk) = RamDisk::new(1 << 20, 512) else {
        return;
    };
    let opts = DeviceOptions {
        queue_size: QSIZE,
        seg_max: 8,
        serial: "fuzz".into(),
        ..Default::default()
    };
    let cfg = Arc::new(BlkConfig::new(opts, disk.info().clone()));
    let Ok(chan) = disk.channel() else { return };
    let mut worker = QueueWorker::new(cfg, chan);
    let Ok(mut q) = Queue::new(QSIZE) else { return };
    q.set_size(QSIZE);
    q.set_desc_table_address(Some(DESC as u32), Some(0));
    q.set_avail_ring_address(Some(AVAIL as u32), Some(0));
    q.set_used_ring_address(Some(USED as u32), Some(0));
    q.set_event_idx(data.first().is_some_and(|b| b & 1 != 0));
    q.set_ready(true);
    for _ in 0..3 {
        let _ = worker.process(&mut q, &mem, true);
    }
}

/// Recovery from a front end's inflight log whose bytes come from the input
/// (`[used idx lo][used idx hi]`, then the log region of one queue).
pub fn inflight_recovery(data: &[u8]) {
    let size = crate::queue_region_size(QSIZE);
    let Ok(map) = guest_mem::MappedRegion::anonymous(0, size as u64) else {
        return;
    };
    let log = data.get(2..).unwrap_or_default();
    if let Some(s) = map.slice(0, log.len().min(size)) {
        let _ = s.write_from(0, &log[..log.len().min(size)]);
    }
    let used = u16::from_le_bytes([
        data.first().copied().unwrap_or(0),
        data.get(1).copied().unwrap_or(0),
    ]);
    let Some(q) = InflightQueue::new(Arc::new(InflightMem::Mapped(map)), 0, QSIZE) else {
        return;
    };
    let mut out = Vec::new();
    let _ = q.recover(used, QSIZE, &mut out);
    assert!(
        out.len() <= usize::from(QSIZE),
        "at most one request per entry"
    );
}
