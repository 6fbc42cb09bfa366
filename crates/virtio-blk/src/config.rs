use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use bdev::BlockInfo;
use virtio_bindings::virtio_blk as vb;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

use crate::SECTOR;

/// Feature bits as `u64` masks.
pub mod features {
    use super::*;
    pub const SIZE_MAX: u64 = 1 << vb::VIRTIO_BLK_F_SIZE_MAX;
    pub const SEG_MAX: u64 = 1 << vb::VIRTIO_BLK_F_SEG_MAX;
    pub const RO: u64 = 1 << vb::VIRTIO_BLK_F_RO;
    pub const BLK_SIZE: u64 = 1 << vb::VIRTIO_BLK_F_BLK_SIZE;
    pub const FLUSH: u64 = 1 << vb::VIRTIO_BLK_F_FLUSH;
    pub const TOPOLOGY: u64 = 1 << vb::VIRTIO_BLK_F_TOPOLOGY;
    pub const CONFIG_WCE: u64 = 1 << vb::VIRTIO_BLK_F_CONFIG_WCE;
    pub const MQ: u64 = 1 << vb::VIRTIO_BLK_F_MQ;
    pub const DISCARD: u64 = 1 << vb::VIRTIO_BLK_F_DISCARD;
    pub const WRITE_ZEROES: u64 = 1 << vb::VIRTIO_BLK_F_WRITE_ZEROES;
    pub const INDIRECT_DESC: u64 = 1 << VIRTIO_RING_F_INDIRECT_DESC;
    pub const EVENT_IDX: u64 = 1 << VIRTIO_RING_F_EVENT_IDX;
    pub const VERSION_1: u64 = 1 << VIRTIO_F_VERSION_1;
}

/// What the transport asks of the device.
#[derive(Clone, Debug)]
pub struct DeviceOptions {
    pub num_queues: u16,
    /// Largest queue size the front end may configure (also the request slots per queue).
    pub queue_size: u16,
    /// Data segments per request (config `seg_max`).
    pub seg_max: u32,
    /// Bytes per data segment (config `size_max`).
    pub size_max: u32,
    /// GET_ID answer (at most 20 bytes are used).
    pub serial: String,
}

impl Default for DeviceOptions {
    fn default() -> Self {
        DeviceOptions {
            num_queues: 1,
            queue_size: 256,
            seg_max: 126,
            size_max: 1 << 20,
            serial: "udrive".into(),
        }
    }
}

/// Largest DISCARD / WRITE_ZEROES range in sectors (1 GiB): keeps a single request's
/// backend work bounded.
pub const MAX_DISCARD_SECTORS: u32 = 1 << 21;

/// The device's facts, the one guest-writable field (write cache enable) and its
/// capacity, which an online resize changes (docs/decisions/0018-online-resize.md).
#[derive(Debug)]
pub struct BlkConfig {
    pub opts: DeviceOptions,
    /// The disk's facts when the device started. Its size is the capacity at
    /// start: the config space shows [`BlkConfig::capacity_bytes`], and each queue
    /// checks requests against the disk it serves now (`QueueWorker::set_disk`).
    pub info: BlockInfo,
    /// Capacity in bytes, as the config space reports it.
    capacity: AtomicU64,
    /// Offered feature bits.
    pub features: u64,
    /// `writeback` config field: 1 while the guest lets us cache writes.
    writeback: AtomicBool,
    /// Budget of the device's guest-triggerable log lines (all its queues).
    pub log: trace::LogLimiter,
}

/// Byte offsets in `struct virtio_blk_config`.
mod off {
    pub const CAPACITY: usize = 0;
    pub const SIZE_MAX: usize = 8;
    pub const SEG_MAX: usize = 12;
    pub const BLK_SIZE: usize = 20;
    pub const PHYS_EXP: usize = 24;
    pub const MIN_IO: usize = 26;
    pub const OPT_IO: usize = 28;
    pub const WRITEBACK: usize = 32;
    pub const NUM_QUEUES: usize = 34;
    pub const MAX_DISCARD_SECTORS: usize = 36;
    pub const MAX_DISCARD_SEG: usize = 40;
    pub const DISCARD_ALIGN: usize = 44;
    pub const MAX_WZ_SECTORS: usize = 48;
    pub const MAX_WZ_SEG: usize = 52;
    pub const WZ_MAY_UNMAP: usize = 56;
    /// Through `unused1[3]`; secure erase (not offered) would follow.
    pub const END: usize = 60;
}

impl BlkConfig {
    pub fn new(opts: DeviceOptions, info: BlockInfo) -> Self {
        use features::*;
        let mut f =
            VERSION_1 | EVENT_IDX | INDIRECT_DESC | SEG_MAX | SIZE_MAX | BLK_SIZE | TOPOLOGY | MQ;
        if info.read_only {
            f |= RO;
        }
        // A device without a volatile cache does not offer FLUSH: that is how
        // virtio-blk says "writes are durable when acknowledged".
        if info.write_cache {
            f |= FLUSH | CONFIG_WCE;
        }
        if info.discard && !info.read_only {
            f |= DISCARD;
        }
        if info.write_zeroes && !info.read_only {
            f |= WRITE_ZEROES;
        }
        let writeback = AtomicBool::new(info.write_cache);
        BlkConfig {
            opts,
            capacity: AtomicU64::new(info.size_bytes()),
            info,
            features: f,
            writeback,
            log: trace::LogLimiter::new(),
        }
    }

    pub fn capacity_bytes(&self) -> u64 {
        self.capacity.load(Ordering::Acquire)
    }

    /// The capacity the config space reports from now on (after the queues serve
    /// a disk of that size; the transport then tells the driver the config changed).
    pub fn set_capacity(&self, bytes: u64) {
        self.capacity.store(bytes, Ordering::Release);
    }

    /// Whether completed writes may still sit in a volatile cache.
    pub fn writeback(&self) -> bool {
        self.writeback.load(Ordering::Relaxed)
    }

    /// The config space bytes.
    pub fn bytes(&self) -> [u8; off::END] {
        let mut b = [0u8; off::END];
        let mut put = |at: usize, v: &[u8]| b[at..at + v.len()].copy_from_slice(v);
        let sectors_per_block = (self.info.block_size as u64 / SECTOR).max(1) as u32;
        put(
            off::CAPACITY,
            &(self.capacity_bytes() / SECTOR).to_le_bytes(),
        );
        put(off::SIZE_MAX, &self.opts.size_max.to_le_bytes());
        put(off::SEG_MAX, &self.opts.seg_max.to_le_bytes());
        put(off::BLK_SIZE, &self.info.block_size.to_le_bytes());
        put(off::PHYS_EXP, &[0]);
        put(off::MIN_IO, &1u16.to_le_bytes());
        put(off::OPT_IO, &0u32.to_le_bytes());
        put(off::WRITEBACK, &[u8::from(self.writeback())]);
        put(off::NUM_QUEUES, &self.opts.num_queues.to_le_bytes());
        put(off::MAX_DISCARD_SECTORS, &MAX_DISCARD_SECTORS.to_le_bytes());
        put(off::MAX_DISCARD_SEG, &1u32.to_le_bytes());
        put(off::DISCARD_ALIGN, &sectors_per_block.to_le_bytes());
        put(off::MAX_WZ_SECTORS, &MAX_DISCARD_SECTORS.to_le_bytes());
        put(off::MAX_WZ_SEG, &1u32.to_le_bytes());
        put(off::WZ_MAY_UNMAP, &[u8::from(self.info.discard_zeroes)]);
        b
    }

    /// `size` bytes of config space from `offset`; bytes past our layout read as zero.
    pub fn read(&self, offset: u32, size: u32) -> Vec<u8> {
        let all = self.bytes();
        let size = (size as usize).min(4096);
        let mut out = vec![0u8; size];
        let start = offset as usize;
        if start < all.len() {
            let n = (all.len() - start).min(size);
            out[..n].copy_from_slice(&all[start..start + n]);
        }
        out
    }

    /// A guest config write. Only `writeback` is writable (with CONFIG_WCE);
    /// anything else is refused.
    pub fn write(&self, offset: u32, data: &[u8]) -> Result<(), String> {
        if offset as usize == off::WRITEBACK
            && data.len() == 1
            && self.features & features::CONFIG_WCE != 0
        {
            self.writeback.store(data[0] != 0, Ordering::Relaxed);
            return Ok(());
        }
        Err(format!(
            "config write of {} bytes at offset {offset} refused: only writeback (offset 32, 1 byte) is writable",
            data.len()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(cache: bool) -> BlockInfo {
        BlockInfo {
            block_size: 4096,
            num_blocks: 256,
            volatile: true,
            write_cache: cache,
            read_only: false,
            discard: true,
            write_zeroes: true,
            discard_zeroes: true,
        }
    }

    #[test]
    fn layout_and_features() {
        let opts = DeviceOptions {
            num_queues: 3,
            ..Default::default()
        };
        let c = BlkConfig::new(opts, info(true));
        let b = c.read(0, 60);
        assert_eq!(u64::from_le_bytes(b[0..8].try_into().unwrap()), 2048);
        assert_eq!(u32::from_le_bytes(b[20..24].try_into().unwrap()), 4096);
        assert_eq!(u16::from_le_bytes(b[34..36].try_into().unwrap()), 3);
        assert_eq!(b[32], 1);
        assert_ne!(c.features & features::FLUSH, 0);
        assert_ne!(c.features & features::DISCARD, 0);
        assert_eq!(c.features & features::RO, 0);
        c.write(32, &[0]).unwrap();
        assert_eq!(c.read(32, 1), vec![0]);
        assert!(c.write(0, &[0; 8]).is_err());
        assert_eq!(c.read(100, 4), vec![0; 4]);
        assert_eq!(c.read(58, 4), vec![0; 4]);
        c.set_capacity(3 << 20);
        let b = c.read(0, 8);
        assert_eq!(u64::from_le_bytes(b[..8].try_into().unwrap()), 6144);

        let nc = BlkConfig::new(DeviceOptions::default(), info(false));
        assert_eq!(nc.features & (features::FLUSH | features::CONFIG_WCE), 0);
        assert!(nc.write(32, &[1]).is_err());
    }
}
