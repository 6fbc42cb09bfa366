use std::sync::Arc;

use crate::region::MappedRegion;
use crate::slice::DmaSlice;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MemError {
    #[error("address {addr:#x}+{len:#x} is not inside one mapped region")]
    Unmapped { addr: u64, len: u64 },
    #[error("address {addr:#x} is mapped without {what} permission")]
    Permission { addr: u64, what: &'static str },
    #[error("region {iova:#x}+{len:#x} overlaps an existing mapping")]
    Overlap { iova: u64, len: u64 },
}

/// Direction of a DMA access, checked against the region's protection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// The device reads guest memory (guest → device, e.g. a write command's data).
    Read,
    /// The device writes guest memory (e.g. a read command's data, a CQ entry).
    Write,
}

/// Immutable snapshot of a client's DMA regions, sorted by IOVA, non-overlapping.
#[derive(Debug, Default, Clone)]
pub struct MemoryMap {
    regions: Vec<Arc<MappedRegion>>,
}

impl MemoryMap {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn regions(&self) -> &[Arc<MappedRegion>] {
        &self.regions
    }

    /// A new snapshot with `region` added. Overlap with an existing region is refused.
    pub fn with_region(&self, region: Arc<MappedRegion>) -> Result<MemoryMap, MemError> {
        let overlaps = self
            .regions
            .iter()
            .any(|r| r.iova() <= region.last() && region.iova() <= r.last());
        if overlaps {
            return Err(MemError::Overlap {
                iova: region.iova(),
                len: region.len(),
            });
        }
        let mut regions = self.regions.clone();
        let at = regions.partition_point(|r| r.iova() < region.iova());
        regions.insert(at, region);
        Ok(MemoryMap { regions })
    }

    /// A new snapshot without the regions that lie entirely inside `[iova, iova+len)`;
    /// returns it and how many regions were removed.
    pub fn without_range(&self, iova: u64, len: u64) -> (MemoryMap, usize) {
        let end = iova.saturating_add(len);
        let keep: Vec<_> = self
            .regions
            .iter()
            .filter(|r| !(r.iova() >= iova && r.last() < end))
            .cloned()
            .collect();
        let removed = self.regions.len() - keep.len();
        (MemoryMap { regions: keep }, removed)
    }

    /// The region exactly matching `iova`/`len`, if any.
    pub fn find_exact(&self, iova: u64, len: u64) -> Option<&Arc<MappedRegion>> {
        self.regions
            .iter()
            .find(|r| r.iova() == iova && r.len() == len)
    }

    fn region_for(&self, addr: u64) -> Option<&MappedRegion> {
        let i = self.regions.partition_point(|r| r.iova() <= addr);
        let r = self.regions.get(i.checked_sub(1)?)?;
        (addr <= r.last()).then_some(r.as_ref())
    }

    /// Translates `[addr, addr+len)` for an access in direction `access`. The range must
    /// lie inside one region (client regions are rarely adjacent, and a command that
    /// spans two would be split by the caller at page boundaries anyway).
    pub fn translate(
        &self,
        addr: u64,
        len: usize,
        access: Access,
    ) -> Result<DmaSlice<'_>, MemError> {
        let unmapped = MemError::Unmapped {
            addr,
            len: len as u64,
        };
        let r = self.region_for(addr).ok_or(unmapped.clone())?;
        let prot = r.prot();
        match access {
            Access::Read if !prot.read => return Err(MemError::Permission { addr, what: "read" }),
            Access::Write if !prot.write => {
                return Err(MemError::Permission {
                    addr,
                    what: "write",
                })
            }
            _ => {}
        }
        r.slice(addr - r.iova(), len).ok_or(unmapped)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map() -> MemoryMap {
        let m = MemoryMap::new();
        let m = m
            .with_region(Arc::new(MappedRegion::anonymous(0x10000, 0x4000).unwrap()))
            .unwrap();
        m.with_region(Arc::new(MappedRegion::anonymous(0x1000, 0x1000).unwrap()))
            .unwrap()
    }

    #[test]
    fn translate_bounds() {
        let m = map();
        assert!(m.translate(0x10000, 0x4000, Access::Read).is_ok());
        assert!(m.translate(0x13fff, 1, Access::Write).is_ok());
        assert!(m.translate(0x13fff, 2, Access::Read).is_err());
        assert!(m.translate(0x0fff, 1, Access::Read).is_err());
        assert!(m.translate(0x2000, 1, Access::Read).is_err());
        assert!(m.translate(u64::MAX, usize::MAX, Access::Read).is_err());
        assert!(m.translate(0x1800, 0x800, Access::Read).is_ok());
    }

    #[test]
    fn overlap_refused_and_removal() {
        let m = map();
        let r = Arc::new(MappedRegion::anonymous(0x13000, 0x2000).unwrap());
        assert!(matches!(m.with_region(r), Err(MemError::Overlap { .. })));
        let (m2, n) = m.without_range(0x10000, 0x4000);
        assert_eq!(n, 1);
        assert!(m2.translate(0x10000, 1, Access::Read).is_err());
        assert!(
            m.translate(0x10000, 1, Access::Read).is_ok(),
            "old snapshot unchanged"
        );
        let (m3, n) = m.without_range(0, u64::MAX);
        assert_eq!(n, 2);
        assert!(m3.regions().is_empty());
    }

    #[test]
    fn copy_roundtrip() {
        let m = map();
        let s = m.translate(0x10010, 8, Access::Write).unwrap();
        s.write_from(0, &[1, 2, 3, 4, 5, 6, 7, 8]).unwrap();
        let mut b = [0u8; 4];
        s.read_into(4, &mut b).unwrap();
        assert_eq!(b, [5, 6, 7, 8]);
        assert!(s.read_into(6, &mut b).is_err());
        assert_eq!(s.load_u32(4), Some(u32::from_ne_bytes([5, 6, 7, 8])));
        assert_eq!(s.load_u32(5), None, "misaligned");
    }
}
