//! GET_INFLIGHT_FD / SET_INFLIGHT_FD: the shared memory in which each queue logs
//! the requests it took (layout in `virtio_blk::InflightQueue`).

use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::sync::Arc;

use guest_mem::{FaultSignal, MappedRegion, Prot, SharedMem};
use virtio_blk::{queue_region_size, InflightMem, InflightQueue};

/// Bounds on what a front end may ask for (QEMU: num-queues ≤ 1024, queue sizes
/// ≤ 1024; the split ring allows 32768).
const MAX_QUEUES: u16 = 1024;
const MAX_QUEUE_SIZE: u16 = 32768;

/// A device's inflight area: `num_queues` regions of `queue_size` entries each.
#[derive(Clone, Debug)]
pub(crate) struct Region {
    mem: Arc<InflightMem>,
    queue_size: u16,
}

/// Why an inflight area was refused.
#[derive(Debug, thiserror::Error)]
pub enum InflightError {
    #[error("inflight area for {num_queues} queues of {queue_size} entries is out of range")]
    Geometry { num_queues: u16, queue_size: u16 },
    #[error("inflight area of {have} bytes is smaller than the {need} that {num_queues} queues of {queue_size} entries need")]
    TooSmall {
        have: u64,
        need: u64,
        num_queues: u16,
        queue_size: u16,
    },
    #[error("cannot create the inflight area")]
    Create(#[source] io::Error),
    #[error("cannot map the inflight area at offset {offset:#x}")]
    Map {
        offset: u64,
        #[source]
        source: io::Error,
    },
}

fn area_size(num_queues: u16, queue_size: u16) -> Result<u64, InflightError> {
    if num_queues == 0 || num_queues > MAX_QUEUES || queue_size == 0 || queue_size > MAX_QUEUE_SIZE
    {
        return Err(InflightError::Geometry {
            num_queues,
            queue_size,
        });
    }
    Ok(u64::from(num_queues) * queue_region_size(queue_size) as u64)
}

impl Region {
    /// A fresh, zeroed area for GET_INFLIGHT_FD: returns the memfd to hand out and
    /// its size.
    pub fn allocate(num_queues: u16, queue_size: u16) -> Result<(SharedMem, u64), InflightError> {
        let size = area_size(num_queues, queue_size)?;
        let mem = SharedMem::new("udrive-vhost-inflight", size).map_err(InflightError::Create)?;
        Ok((mem, size))
    }

    /// Maps the area a front end handed back with SET_INFLIGHT_FD; `signal` is
    /// raised if the front end shrinks the file afterwards.
    pub fn map(
        file: &File,
        req: (u64, u64),
        num_queues: u16,
        queue_size: u16,
        signal: &Arc<FaultSignal>,
    ) -> Result<Region, InflightError> {
        let (mmap_size, mmap_offset) = req;
        let need = area_size(num_queues, queue_size)?;
        if mmap_size < need {
            return Err(InflightError::TooSmall {
                have: mmap_size,
                need,
                num_queues,
                queue_size,
            });
        }
        // Refuses an area past the end of the file (its pages would SIGBUS).
        let map =
            MappedRegion::map_fd_watched(file.as_fd(), mmap_offset, 0, need, Prot::RW, signal)
                .map_err(|source| InflightError::Map {
                    offset: mmap_offset,
                    source,
                })?;
        Ok(Region {
            mem: Arc::new(InflightMem::Mapped(map)),
            queue_size,
        })
    }

    /// Queue `index`'s log, if the area has one.
    pub fn queue(&self, index: usize) -> Option<InflightQueue> {
        InflightQueue::new(self.mem.clone(), index, self.queue_size)
    }
}
