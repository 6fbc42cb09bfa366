//! DMA_MAP / DMA_UNMAP on the device's [`DmaSpace`]. An unmap of shared memory
//! returns only after every reactor has dropped the old snapshot, so no in-flight
//! I/O touches memory the client is about to reuse. Memory the client did not share
//! (a mirror, reached by DMA_READ/DMA_WRITE) is marked gone instead and the unmap
//! answered at once: nothing of the client's is mapped here, and a waiting reader
//! may be waiting for the very client that now waits for our answer.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use guest_mem::{DmaSpace, MappedRegion, MemError, MemoryMap, Prot, RemoteDma};

use crate::proto::{DmaMap, DmaUnmap, DMA_READ, DMA_WRITE, UNMAP_ALL, UNMAP_GET_DIRTY_BITMAP};

/// Advertised in VERSION as `max_dma_maps`. QEMU maps a few dozen regions; the
/// bound keeps one client from filling the process-wide table of guarded client
/// mappings (`guest_mem::MAX_GUARDED_RANGES`) that every other client needs too.
pub(crate) const MAX_DMA_MAPS: u32 = 1024;
const RELEASE_TIMEOUT: Duration = Duration::from_secs(2);
/// Address space one client's mirrors may take (they are sparse: only what
/// transfers touch costs memory, but the reservation is address space of the whole
/// process).
const MAX_MIRROR_BYTES: u64 = 1 << 40;

fn prot_of(flags: u32) -> Result<Prot, i32> {
    if flags & !(DMA_READ | DMA_WRITE) != 0 || flags == 0 {
        return Err(libc::EINVAL);
    }
    Ok(Prot {
        read: flags & DMA_READ != 0,
        write: flags & DMA_WRITE != 0,
    })
}

/// The protection a DMA_MAP asks for, once its flags and range are valid.
fn map_prot(req: &DmaMap) -> Result<Prot, i32> {
    if req.size == 0 || req.addr.checked_add(req.size).is_none() {
        return Err(libc::EINVAL);
    }
    prot_of(req.flags)
}

/// Adds a region to the client's map: at most [`MAX_DMA_MAPS`] regions, and mirrors
/// (regions that are not shared) within [`MAX_MIRROR_BYTES`] in all.
fn insert(mem: &DmaSpace, region: MappedRegion) -> Result<(), i32> {
    let region = Arc::new(region);
    let old = mem.update(|m| {
        if m.regions().len() >= MAX_DMA_MAPS as usize {
            return Err(libc::ENOSPC);
        }
        if region.is_remote() {
            let total: u64 = m
                .regions()
                .iter()
                .filter(|r| r.is_remote())
                .map(|r| r.len())
                .sum();
            if total.saturating_add(region.len()) > MAX_MIRROR_BYTES {
                return Err(libc::ENOSPC);
            }
        }
        m.with_region(region).map_err(|e| match e {
            MemError::Overlap { .. } => libc::EEXIST,
            _ => libc::EINVAL,
        })
    })?;
    // Nothing was removed, so readers of the old snapshot are harmless.
    drop(old);
    Ok(())
}

/// DMA_MAP without a file descriptor: a mirror of the range whose bytes move
/// through `port` (docs/decisions/0020-dma-messages.md).
pub(crate) fn map_mirror(
    mem: &DmaSpace,
    req: &DmaMap,
    port: Arc<dyn RemoteDma>,
    log: &trace::LogLimiter,
) -> Result<(), i32> {
    let prot = map_prot(req)?;
    let region = MappedRegion::mirror(req.addr, req.size, prot, port).map_err(|e| {
        trace::limited!(
            log,
            warn,
            "vfio-user: DMA_MAP of {:#x}+{:#x} without a file descriptor refused: {e}",
            req.addr,
            req.size
        );
        e.raw_os_error().unwrap_or(libc::EINVAL)
    })?;
    insert(mem, region)
}

pub(crate) fn map(
    mem: &DmaSpace,
    req: &DmaMap,
    fd: OwnedFd,
    log: &trace::LogLimiter,
) -> Result<(), i32> {
    let prot = map_prot(req)?;
    // Refuses a range past the end of a regular file (its pages would SIGBUS), and
    // confines a SIGBUS from the file shrinking later to this client (see
    // guest_mem's fault.rs; the server thread polls the signal).
    let region = MappedRegion::map_fd_watched(
        fd.as_fd(),
        req.offset,
        req.addr,
        req.size,
        prot,
        mem.fault_signal(),
    )
    .map_err(|e| {
        trace::limited!(
            log,
            warn,
            "vfio-user: DMA_MAP of {:#x}+{:#x} (file offset {:#x}) refused: {e}",
            req.addr,
            req.size,
            req.offset
        );
        e.raw_os_error().unwrap_or(libc::EINVAL)
    })?;
    insert(mem, region)
}

/// Returns the IOVAs of the regions removed (`None`: all of them).
pub(crate) fn unmap(mem: &DmaSpace, req: &DmaUnmap) -> Result<Option<Vec<u64>>, i32> {
    if req.flags & UNMAP_GET_DIRTY_BITMAP != 0 {
        return Err(libc::ENOTSUP);
    }
    if req.flags & !UNMAP_ALL != 0 {
        return Err(libc::EINVAL);
    }
    if req.flags & UNMAP_ALL != 0 {
        if req.addr != 0 || req.size != 0 {
            return Err(libc::EINVAL);
        }
        unmap_all(mem);
        return Ok(None);
    }
    if req.size == 0 {
        return Err(libc::EINVAL);
    }
    let end = req.addr.checked_add(req.size).ok_or(libc::EINVAL)?;
    let old = mem.update(|m| {
        // A range may cover several whole mappings, but never split one.
        let partial = m.regions().iter().any(|r| {
            let overlaps = r.iova() < end && req.addr <= r.last();
            let inside = r.iova() >= req.addr && r.last() < end;
            overlaps && !inside
        });
        if partial {
            return Err(libc::EINVAL);
        }
        match m.without_range(req.addr, req.size) {
            (_, 0) => Err(libc::ENOENT),
            (next, _) => Ok(next),
        }
    })?;
    let removed = |r: &MappedRegion| r.iova() >= req.addr && r.last() < end;
    let iovas = old
        .regions()
        .iter()
        .filter(|r| removed(r))
        .map(|r| r.iova())
        .collect();
    release(mem, old, removed);
    Ok(Some(iovas))
}

pub(crate) fn unmap_all(mem: &DmaSpace) {
    if let Ok(old) = mem.update(|_| Ok::<_, ()>(MemoryMap::new())) {
        release(mem, old, |_| true);
    }
    mem.set_remote(None);
}

/// Lets go of `removed` regions of snapshot `old`: mirrors are marked gone (no
/// transfer reaches the client's memory from now on); shared mappings are waited
/// for, with the client's transfers paused meanwhile so that no reader holding the
/// old snapshot waits for a reply while we wait for it.
fn release(mem: &DmaSpace, old: Arc<MemoryMap>, removed: impl Fn(&MappedRegion) -> bool) {
    let mut shared = false;
    for r in old.regions().iter().filter(|r| removed(r)) {
        if r.is_remote() {
            r.set_gone();
        } else {
            shared = true;
        }
    }
    if shared {
        let _paused = mem.pause_remote();
        wait(old);
    }
}

fn wait(old: Arc<MemoryMap>) {
    if !DmaSpace::wait_released(old, RELEASE_TIMEOUT) {
        // Memory stays mapped until the stuck reader lets go, so this is a delay, not
        // a use-after-unmap; but the client may now reuse pages we still write.
        tracing::warn!(
            "DMA unmap: a reader still holds the old memory map after {RELEASE_TIMEOUT:?}"
        );
    }
}
