use std::io;
use std::sync::Arc;

use guest_mem::MappedRegion;

use crate::{in_range, BlockDevice, BlockInfo, IoChannel, IoOp, IoRequest, IoStatus};

/// Data kept in anonymous memory (reserved lazily, so a big disk costs only what is
/// written). Volatile: gone when udrive exits.
pub struct RamDisk {
    info: BlockInfo,
    mem: Arc<MappedRegion>,
}

pub(crate) fn sized_info(size: u64, block_size: u32) -> io::Result<BlockInfo> {
    if block_size != 512 && block_size != 4096 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("block size {block_size} is not 512 or 4096"),
        ));
    }
    if size == 0 || !size.is_multiple_of(u64::from(block_size)) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("size {size} is not a non-zero multiple of the block size {block_size}"),
        ));
    }
    Ok(BlockInfo {
        block_size,
        num_blocks: size / u64::from(block_size),
        volatile: true,
        write_cache: false,
        read_only: false,
        discard: true,
        write_zeroes: true,
        discard_zeroes: true,
    })
}

impl RamDisk {
    pub fn new(size: u64, block_size: u32) -> io::Result<Self> {
        let info = sized_info(size, block_size)?;
        let mem = Arc::new(MappedRegion::anonymous(0, size)?);
        Ok(RamDisk { info, mem })
    }

    /// A RAM disk in transparent huge pages where the kernel has them (`hugepages=on`):
    /// random 4 KiB I/O on a large disk costs no page walk (with 4 KiB pages a 1 GiB
    /// disk misses the TLB on nearly every request). The price: memory is taken in
    /// 2 MiB extents, and the first write to each extent zeroes 2 MiB, possibly after
    /// compacting memory (milliseconds), see docs/decisions/0017-spdk-client.md.
    pub fn with_huge_pages(size: u64, block_size: u32) -> io::Result<Self> {
        let disk = RamDisk::new(size, block_size)?;
        disk.mem.advise_hugepages();
        Ok(disk)
    }
}

impl BlockDevice for RamDisk {
    fn describe(&self) -> String {
        format!("ram:{}", self.info.size_bytes())
    }
    fn info(&self) -> &BlockInfo {
        &self.info
    }
    fn channel(&self) -> io::Result<Box<dyn IoChannel>> {
        Ok(Box::new(RamChannel {
            mem: self.mem.clone(),
            size: self.info.size_bytes(),
        }))
    }
    /// Shrinks or grows back within the memory reserved at creation (growing beyond
    /// it would mean a new mapping and a copy under I/O).
    fn resize(&self, bytes: u64) -> io::Result<Arc<dyn BlockDevice>> {
        let info = self.info.resized(bytes)?;
        if bytes > self.mem.len() {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!(
                    "a ram disk cannot grow beyond the {} bytes it was created with",
                    self.mem.len()
                ),
            ));
        }
        Ok(Arc::new(RamDisk {
            info,
            mem: self.mem.clone(),
        }))
    }
    /// Memory has no alignment: any block size, erased by discarding the pages.
    fn format_support(&self) -> crate::FormatSupport {
        crate::FormatSupport::Exclusive {
            min_block_size: 512,
        }
    }
}

struct RamChannel {
    mem: Arc<MappedRegion>,
    /// The device's size (the region may be larger after a shrink).
    size: u64,
}

impl RamChannel {
    fn transfer(&self, req: &IoRequest<'_>) -> IoStatus {
        // Checked before copying: buffers longer than `len` must not reach past the range.
        let total: u64 = req.iov.iter().map(|b| b.len() as u64).sum();
        if total != req.len {
            return IoStatus::Invalid;
        }
        let mut off = req.offset;
        for buf in req.iov {
            let Some(disk) = self.mem.slice(off, buf.len()) else {
                return IoStatus::OutOfRange;
            };
            let copied = match req.op {
                IoOp::Read => disk.copy_to(buf),
                _ => buf.copy_to(&disk),
            };
            if copied.is_err() {
                return IoStatus::Invalid;
            }
            off += buf.len() as u64;
        }
        IoStatus::Ok
    }
}

impl IoChannel for RamChannel {
    fn submit(&mut self, _tag: u64, req: &IoRequest<'_>) -> Option<IoStatus> {
        if req.op != IoOp::Flush && !in_range(req.offset, req.len, self.size) {
            return Some(IoStatus::OutOfRange);
        }
        Some(match req.op {
            IoOp::Read | IoOp::Write => self.transfer(req),
            IoOp::Flush => IoStatus::Ok,
            IoOp::WriteZeroes | IoOp::Discard => match self.mem.discard(req.offset, req.len) {
                Some(()) => IoStatus::Ok,
                None => IoStatus::OutOfRange,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use guest_mem::SharedMem;

    #[test]
    fn write_read_discard() {
        let d = RamDisk::new(1 << 20, 512).unwrap();
        let mut ch = d.channel().unwrap();
        let buf = SharedMem::new("b", 8192).unwrap();
        let s = buf.all();
        s.write_from(0, &[7u8; 8192]).unwrap();
        let iov = [s.sub(0, 4096).unwrap(), s.sub(4096, 4096).unwrap()];
        let w = IoRequest {
            op: IoOp::Write,
            offset: 4096 * 3,
            len: 8192,
            iov: &iov,
            fua: false,
        };
        assert_eq!(ch.submit(1, &w), Some(IoStatus::Ok));
        s.fill(0);
        let r = IoRequest {
            op: IoOp::Read,
            ..w
        };
        assert_eq!(ch.submit(2, &r), Some(IoStatus::Ok));
        let mut b = vec![0u8; 8192];
        s.read_into(0, &mut b).unwrap();
        assert!(b.iter().all(|x| *x == 7));
        let z = IoRequest {
            op: IoOp::Discard,
            offset: 4096 * 3 + 512,
            len: 4096,
            iov: &[],
            fua: false,
        };
        assert_eq!(ch.submit(3, &z), Some(IoStatus::Ok));
        assert_eq!(ch.submit(4, &r), Some(IoStatus::Ok));
        s.read_into(0, &mut b).unwrap();
        assert!(b[..512].iter().all(|x| *x == 7));
        assert!(b[512..4608].iter().all(|x| *x == 0));
        assert!(b[4608..].iter().all(|x| *x == 7));
        let oob = IoRequest {
            offset: (1 << 20) - 4096,
            ..r
        };
        assert_eq!(ch.submit(5, &oob), Some(IoStatus::OutOfRange));
        let wrap = IoRequest {
            offset: u64::MAX - 10,
            ..r
        };
        assert_eq!(ch.submit(6, &wrap), Some(IoStatus::OutOfRange));
    }

    #[test]
    fn huge_pages_disk_reads_back() {
        let d = RamDisk::with_huge_pages(4 << 20, 512).unwrap();
        let mut ch = d.channel().unwrap();
        let buf = SharedMem::new("h", 4096).unwrap();
        let s = buf.all();
        s.fill(9);
        let iov = [s.sub(0, 4096).unwrap()];
        let w = IoRequest {
            op: IoOp::Write,
            offset: (2 << 20) - 2048,
            len: 4096,
            iov: &iov,
            fua: false,
        };
        assert_eq!(ch.submit(1, &w), Some(IoStatus::Ok));
        s.fill(0);
        let r = IoRequest {
            op: IoOp::Read,
            ..w
        };
        assert_eq!(ch.submit(2, &r), Some(IoStatus::Ok));
        let mut b = vec![0u8; 4096];
        s.read_into(0, &mut b).unwrap();
        assert!(b.iter().all(|x| *x == 9));
    }

    #[test]
    fn bad_sizes_refused() {
        assert!(RamDisk::new(0, 512).is_err());
        assert!(RamDisk::new(1000, 512).is_err());
        assert!(RamDisk::new(4096, 1024).is_err());
    }
}
