//! [`RamDisk`]: a volatile disk in anonymous memory, and its channel (`channel.rs`),
//! which copies a batch's requests while the next one's data is on its way.

mod channel;
#[cfg(test)]
mod tests;

use std::io;
use std::sync::Arc;

use guest_mem::MappedRegion;

use crate::{BlockDevice, BlockInfo, GeometryError, IoChannel};
use channel::RamChannel;

/// Why a RAM (or null) disk cannot be made or resized.
#[derive(Debug, thiserror::Error)]
pub enum RamError {
    #[error(transparent)]
    Geometry(#[from] GeometryError),
    #[error("cannot reserve {bytes} bytes of memory")]
    Memory {
        bytes: u64,
        #[source]
        source: io::Error,
    },
    /// The disk's mappings do not cover a byte they should: a bug, not an input.
    #[error("no mapping of the ram disk holds byte {offset}")]
    Unmapped { offset: u64 },
}

impl From<RamError> for io::Error {
    fn from(e: RamError) -> io::Error {
        let kind = match &e {
            RamError::Geometry(_) => io::ErrorKind::InvalidInput,
            RamError::Memory { source, .. } => source.kind(),
            RamError::Unmapped { .. } => io::ErrorKind::Other,
        };
        io::Error::new(kind, e)
    }
}

/// Data kept in anonymous memory (reserved lazily, so a big disk costs only what is
/// written). Volatile: gone when udrive exits.
///
/// The memory is one mapping per extent: the one made at creation, plus one for
/// each growth beyond what the mappings cover ([`BlockDevice::resize`]). Growing
/// maps only the new bytes, so the data stays where it is (no copy under I/O) and
/// every handle of the disk shares it.
pub struct RamDisk {
    info: BlockInfo,
    extents: Arc<[Extent]>,
    /// `hugepages=on`: extents added later are advised too.
    huge: bool,
}

/// Bytes `[start, start + mem.len())` of the disk. Extents are in disk order and
/// adjacent; the last may reach past the disk's size (after a shrink).
#[derive(Clone)]
struct Extent {
    start: u64,
    mem: Arc<MappedRegion>,
}

impl Extent {
    fn end(&self) -> u64 {
        self.start + self.mem.len()
    }
}

/// The extent holding disk byte `at`.
fn extent_at(extents: &[Extent], at: u64) -> Option<&Extent> {
    extents.iter().find(|e| e.start <= at && at < e.end())
}

pub(crate) fn sized_info(size: u64, block_size: u32) -> Result<BlockInfo, GeometryError> {
    GeometryError::check_block_size(block_size)?;
    GeometryError::check_size(size, u64::from(block_size))?;
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

/// `bytes` of fresh anonymous memory.
fn reserve(bytes: u64) -> Result<MappedRegion, RamError> {
    MappedRegion::anonymous(0, bytes).map_err(|source| RamError::Memory { bytes, source })
}

impl RamDisk {
    pub fn new(size: u64, block_size: u32) -> Result<Self, RamError> {
        let info = sized_info(size, block_size)?;
        let mem = Arc::new(reserve(size)?);
        Ok(RamDisk {
            info,
            extents: Arc::new([Extent { start: 0, mem }]),
            huge: false,
        })
    }

    /// A RAM disk in transparent huge pages where the kernel has them (`hugepages=on`):
    /// random 4 KiB I/O on a large disk costs no page walk (with 4 KiB pages a 1 GiB
    /// disk misses the TLB on nearly every request). The price: memory is taken in
    /// 2 MiB extents, and the first write to each extent zeroes 2 MiB, possibly after
    /// compacting memory (milliseconds), see docs/decisions/0017-spdk-client.md.
    pub fn with_huge_pages(size: u64, block_size: u32) -> Result<Self, RamError> {
        let mut disk = RamDisk::new(size, block_size)?;
        disk.huge = true;
        for e in disk.extents.iter() {
            e.mem.advise_hugepages();
        }
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
        Ok(Box::new(RamChannel::new(
            self.extents.clone(),
            self.info.size_bytes(),
        )))
    }
    /// Shrinking returns the memory past the new end (it reads back as zeroes if
    /// the disk grows again); growing maps only the bytes beyond the existing
    /// mappings. The data below the smaller of the two sizes is kept.
    fn resize(&self, bytes: u64) -> io::Result<Arc<dyn BlockDevice>> {
        Ok(Arc::new(self.resized(bytes)?))
    }
    /// Memory has no alignment: any block size, erased by discarding the pages.
    fn format_support(&self) -> crate::FormatSupport {
        crate::FormatSupport::Exclusive {
            min_block_size: 512,
        }
    }
}

impl RamDisk {
    /// [`BlockDevice::resize`], typed.
    fn resized(&self, bytes: u64) -> Result<RamDisk, RamError> {
        let info = self.info.resized(bytes)?;
        let size = self.info.size_bytes();
        let mut extents: Vec<Extent> = self
            .extents
            .iter()
            .filter(|e| e.start < bytes)
            .cloned()
            .collect();
        let Some(last) = extents.last().cloned() else {
            return Err(RamError::Unmapped { offset: 0 });
        };
        // Bytes of the last mapping that the new size leaves out (a shrink), or that
        // it shows again after an earlier shrink: zero pages either way.
        let (from, to) = if bytes < size {
            (bytes, last.end())
        } else {
            (size, bytes.min(last.end()))
        };
        if to > from {
            last.mem
                .discard(from - last.start, to - from)
                .ok_or(RamError::Unmapped { offset: from })?;
        }
        if bytes > last.end() {
            let mem = reserve(bytes - last.end())?;
            if self.huge {
                mem.advise_hugepages();
            }
            extents.push(Extent {
                start: last.end(),
                mem: Arc::new(mem),
            });
        }
        Ok(RamDisk {
            info,
            extents: extents.into(),
            huge: self.huge,
        })
    }
}
