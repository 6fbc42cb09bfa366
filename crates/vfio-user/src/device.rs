//! The PCI device as the protocol sees it: regions (config space, BAR0 with the
//! emulated MSI-X table/PBA), and what reset and disconnect do to it.

use std::io;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use guest_mem::DmaSpace;
use zerocopy::IntoBytes;

use crate::irqs::Irqs;
use crate::pci::{ConfigSpace, PciIds, CONFIG_SIZE, MSIX_CAP, MSIX_CTRL_FUNC_MASK};
use crate::proto::*;

/// BAR0 of the device: a 64-bit memory BAR.
#[derive(Debug)]
pub struct BarSpec {
    /// Power of two, at least 4 KiB.
    pub size: u64,
    /// Backing memfd for the mmap-able parts (e.g. the doorbell page). None: no mmap.
    pub mmap_fd: Option<OwnedFd>,
    /// Where BAR offset 0 lies in `mmap_fd`.
    pub fd_offset: u64,
    /// Mmap-able areas (BAR offsets). Empty with an fd = the whole BAR, which is
    /// refused when the MSI-X table lives in BAR0 (the client would bypass it).
    pub sparse: Vec<SparseArea>,
}

#[derive(Clone, Copy, Debug)]
pub struct MsixSpec {
    pub vectors: u16,
    pub table_bar: u8,
    pub table_offset: u32,
    pub pba_bar: u8,
    pub pba_offset: u32,
}

#[derive(Debug)]
pub struct PciDeviceSpec {
    pub ids: PciIds,
    pub bar0: BarSpec,
    pub msix: MsixSpec,
}

/// The device model behind BAR0 (e.g. the NVMe controller).
pub trait PciBackend: Send + Sync {
    /// Reads BAR `bar` at `offset`; the range is inside the BAR and outside the MSI-X
    /// table and PBA.
    fn bar_read(&self, bar: u32, offset: u64, data: &mut [u8]);
    fn bar_write(&self, bar: u32, offset: u64, data: &[u8]);
    /// DEVICE_RESET from the client.
    fn reset(&self);
    /// The client disconnected; its DMA mappings are dropped right after this returns.
    fn client_gone(&self);
    /// Whether to offer the client BAR `bar`'s mmap areas now (asked on each region
    /// query). A model that must see every write to them (to wake a sleeping
    /// poller) answers `false`: the client then traps the accesses and sends them
    /// as messages.
    fn offer_mmap(&self, _bar: u32) -> bool {
        true
    }
    /// The client maps memory without a file descriptor (`writable`: the device
    /// may write it, as guest RAM; QEMU also maps its ROMs read-only this way).
    /// The server mirrors it and keeps the mirror in step with DMA_READ/DMA_WRITE
    /// only when the model asks (`guest_mem::MemoryMap::fetch`/`push`). A model
    /// that does answers `Ok` (and keeps whatever waits for the client off threads
    /// other clients need); the default refuses with an errno for the reply.
    fn dma_messages(&self, _writable: bool) -> Result<(), i32> {
        Err(libc::ENOTSUP)
    }
    /// This process took over a client that an earlier one served (its memory,
    /// interrupts and config space are back; whatever the model kept in memory is
    /// not). `bar_mmap`: the client has BAR0's mmap areas mapped.
    fn restored(&self, _bar_mmap: bool) {}
}

fn invalid(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg.to_string())
}

pub(crate) fn validate(spec: &PciDeviceSpec, irqs: &Irqs) -> io::Result<()> {
    let bar = &spec.bar0;
    if !bar.size.is_power_of_two() || bar.size < 4096 {
        return Err(invalid("BAR0 size must be a power of two >= 4096"));
    }
    let m = &spec.msix;
    if m.vectors == 0 || m.vectors > 2048 || irqs.msix_vectors() != m.vectors {
        return Err(invalid("MSI-X vectors must be 1..=2048 and match the Irqs"));
    }
    if m.table_bar != 0 || m.pba_bar != 0 {
        return Err(invalid("MSI-X table and PBA must live in BAR0"));
    }
    let table = (u64::from(m.table_offset), irqs.table_len());
    let pba = (u64::from(m.pba_offset), irqs.pba_len());
    let overlap = |a: (u64, u64), b: (u64, u64)| a.0 < b.0 + b.1 && b.0 < a.0 + a.1;
    if !m.table_offset.is_multiple_of(8) || !m.pba_offset.is_multiple_of(8) || overlap(table, pba) {
        return Err(invalid(
            "MSI-X table/PBA offsets must be 8-aligned and disjoint",
        ));
    }
    if table.0 + table.1 > bar.size || pba.0 + pba.1 > bar.size {
        return Err(invalid("MSI-X table/PBA outside BAR0"));
    }
    if bar.mmap_fd.is_some() {
        if bar.sparse.is_empty() {
            return Err(invalid(
                "BAR0 with an fd needs sparse areas (MSI-X table is in BAR0)",
            ));
        }
        let page = guest_mem::page_size() as u64;
        for a in &bar.sparse {
            let end = a
                .offset
                .checked_add(a.size)
                .ok_or_else(|| invalid("sparse overflow"))?;
            if a.size == 0 || end > bar.size || !a.offset.is_multiple_of(page) {
                return Err(invalid("sparse area empty, unaligned or outside BAR0"));
            }
            if overlap((a.offset, a.size), table) || overlap((a.offset, a.size), pba) {
                return Err(invalid("sparse area covers the MSI-X table or PBA"));
            }
        }
        if !bar.fd_offset.is_multiple_of(page) {
            return Err(invalid("BAR0 fd_offset must be page aligned"));
        }
    } else if !bar.sparse.is_empty() {
        return Err(invalid("sparse areas need an mmap fd"));
    }
    Ok(())
}

pub(crate) struct Device {
    pub spec: PciDeviceSpec,
    pub config: ConfigSpace,
    pub backend: Arc<dyn PciBackend>,
    pub irqs: Arc<Irqs>,
    pub mem: Arc<DmaSpace>,
    /// Budget of the log lines its client can trigger.
    pub log: trace::LogLimiter,
}

enum Bar0Target {
    Table(usize),
    Pba(usize),
    Backend,
}

impl Device {
    /// The DEVICE_GET_REGION_INFO reply payload for `index`, given the client's argsz,
    /// and whether BAR0's fd goes with it.
    pub fn region_info(&self, index: u32, argsz: u32) -> Result<(Vec<u8>, bool), i32> {
        let base = std::mem::size_of::<RegionInfo>();
        let mut info = RegionInfo {
            argsz: base as u32,
            index,
            ..RegionInfo::default()
        };
        let mut caps = Vec::new();
        match index {
            PCI_BAR0_REGION => {
                let bar = &self.spec.bar0;
                info.size = bar.size;
                info.flags = REGION_READ | REGION_WRITE;
                if bar.mmap_fd.is_some() && self.backend.offer_mmap(0) {
                    info.flags |= REGION_MMAP | REGION_CAPS;
                    info.offset = bar.fd_offset;
                    let hdr = CapHeader {
                        id: REGION_CAP_SPARSE_MMAP,
                        version: 1,
                        next: 0,
                    };
                    let sparse = SparseMmapHeader {
                        nr_areas: bar.sparse.len() as u32,
                        reserved: 0,
                    };
                    caps.extend_from_slice(hdr.as_bytes());
                    caps.extend_from_slice(sparse.as_bytes());
                    for a in &bar.sparse {
                        caps.extend_from_slice(a.as_bytes());
                    }
                }
            }
            PCI_CONFIG_REGION => {
                info.size = CONFIG_SIZE as u64;
                info.flags = REGION_READ | REGION_WRITE;
            }
            i if i < PCI_NUM_REGIONS => {}
            _ => return Err(libc::EINVAL),
        }
        let needed = (base + caps.len()) as u32;
        info.argsz = needed;
        if !caps.is_empty() {
            // QEMU's client refuses CAPS with cap_offset 0, even in the short reply.
            info.cap_offset = base as u32;
        }
        if argsz < needed {
            // Like the kernel: report the size needed, no capability data, no fd.
            return Ok((info.as_bytes().to_vec(), false));
        }
        let mut out = info.as_bytes().to_vec();
        out.extend_from_slice(&caps);
        Ok((out, info.flags & REGION_MMAP != 0))
    }

    fn bar0_target(&self, off: u64, len: usize) -> Result<Bar0Target, i32> {
        let end = off.checked_add(len as u64).ok_or(libc::EINVAL)?;
        if end > self.spec.bar0.size {
            return Err(libc::EINVAL);
        }
        let m = &self.spec.msix;
        let areas = [
            (u64::from(m.table_offset), self.irqs.table_len(), true),
            (u64::from(m.pba_offset), self.irqs.pba_len(), false),
        ];
        for (start, size, is_table) in areas {
            if off >= start && end <= start + size {
                let rel = (off - start) as usize;
                return Ok(if is_table {
                    Bar0Target::Table(rel)
                } else {
                    Bar0Target::Pba(rel)
                });
            }
            if off < start + size && start < end {
                return Err(libc::EINVAL); // straddles the emulated area
            }
        }
        Ok(Bar0Target::Backend)
    }

    pub fn region_read(&self, region: u32, off: u64, data: &mut [u8]) -> Result<(), i32> {
        match region {
            PCI_CONFIG_REGION => self
                .config
                .read(off, data)
                .then_some(())
                .ok_or(libc::EINVAL),
            PCI_BAR0_REGION => {
                match self.bar0_target(off, data.len())? {
                    Bar0Target::Table(rel) => self.irqs.table_read(rel, data),
                    Bar0Target::Pba(rel) => self.irqs.pba_read(rel, data),
                    Bar0Target::Backend => self.backend.bar_read(0, off, data),
                }
                Ok(())
            }
            _ => Err(libc::EINVAL),
        }
    }

    pub fn region_write(&mut self, region: u32, off: u64, data: &[u8]) -> Result<(), i32> {
        match region {
            PCI_CONFIG_REGION => {
                if !self.config.write(off, data) {
                    return Err(libc::EINVAL);
                }
                let ctrl = (MSIX_CAP + 2) as u64;
                if off < ctrl + 2 && ctrl < off + data.len() as u64 {
                    let c = self.config.msix_control();
                    self.irqs.set_function_mask(c & MSIX_CTRL_FUNC_MASK != 0);
                }
                Ok(())
            }
            PCI_BAR0_REGION => {
                match self.bar0_target(off, data.len())? {
                    Bar0Target::Table(rel) => self.irqs.table_write(rel, data),
                    Bar0Target::Pba(_) => {} // read-only
                    Bar0Target::Backend => self.backend.bar_write(0, off, data),
                }
                Ok(())
            }
            _ => Err(libc::EINVAL),
        }
    }

    /// Config space from a kept image; MSI-X function mask as it says.
    pub fn restore_config(&mut self, image: &[u8]) -> Result<(), ()> {
        if !self.config.restore(image) {
            return Err(());
        }
        let c = self.config.msix_control();
        self.irqs.set_function_mask(c & MSIX_CTRL_FUNC_MASK != 0);
        Ok(())
    }

    pub fn reset(&mut self) {
        self.config.reset();
        self.irqs.reset_table();
        self.backend.reset();
    }

    /// Forget everything a client owned; device state (registers, queues' backing
    /// memory in the memfd) stays for the next client.
    pub fn client_gone(&mut self) {
        self.backend.client_gone();
        crate::dma::unmap_all(&self.mem);
        self.irqs.clear_fds();
    }
}
