use std::sync::Arc;

use crate::region::MappedRegion;
use crate::remote::{RemoteDir, RemoteDma, RemoteError, RemoteOp};
use crate::slice::DmaSlice;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MemError {
    #[error("address {addr:#x}+{len:#x} is not inside one mapped region")]
    Unmapped { addr: u64, len: u64 },
    #[error("address {addr:#x} is mapped without {what} permission")]
    Permission { addr: u64, what: &'static str },
    #[error("region {iova:#x}+{len:#x} overlaps an existing mapping")]
    Overlap { iova: u64, len: u64 },
    #[error("transfer of {addr:#x}+{len:#x} with the client failed")]
    Remote {
        addr: u64,
        len: u64,
        #[source]
        source: RemoteError,
    },
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
    /// Some region is a mirror (`remote.rs`): fetch/push may have work to do.
    remote: bool,
    /// The mirrors' IOVA spans (first, last), for a quick "not mirrored" answer:
    /// a client that shares its RAM may still map small regions without an fd
    /// (QEMU's ROMs), and the ranges readers touch must not pay for those.
    remote_spans: Vec<(u64, u64)>,
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
        Ok(MemoryMap::from_regions(regions))
    }

    fn from_regions(regions: Vec<Arc<MappedRegion>>) -> MemoryMap {
        let remote_spans: Vec<(u64, u64)> = regions
            .iter()
            .filter(|r| r.is_remote())
            .map(|r| (r.iova(), r.last()))
            .collect();
        MemoryMap {
            regions,
            remote: !remote_spans.is_empty(),
            remote_spans,
        }
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
        (MemoryMap::from_regions(keep), removed)
    }

    /// The region exactly matching `iova`/`len`, if any.
    pub fn find_exact(&self, iova: u64, len: u64) -> Option<&Arc<MappedRegion>> {
        self.regions
            .iter()
            .find(|r| r.iova() == iova && r.len() == len)
    }

    /// Whether some region is a mirror of unshared client memory. When not, every
    /// [`MemoryMap::fetch`] and [`MemoryMap::push`] returns at once.
    #[inline]
    pub fn has_remote(&self) -> bool {
        self.remote
    }

    /// Whether `addr` lies in a mirror region.
    pub fn is_remote(&self, addr: u64) -> bool {
        self.touches_remote(addr, 1)
    }

    /// Whether `[addr, addr+len)` overlaps a mirror region (a few compares).
    #[inline]
    pub fn touches_remote(&self, addr: u64, len: u64) -> bool {
        if !self.remote || len == 0 {
            return false;
        }
        let last = addr.saturating_add(len - 1);
        self.remote_spans
            .iter()
            .any(|&(first, end)| first <= last && addr <= end)
    }

    /// Whether any of `ranges` overlaps a mirror region.
    #[inline]
    pub fn any_remote(&self, ranges: &[(u64, u64)]) -> bool {
        self.remote && ranges.iter().any(|&(a, l)| self.touches_remote(a, l))
    }

    /// Brings the mirror copies of `ranges` (IOVA, length) up to date with the
    /// client's memory, before the reader looks at them. Parts in shared regions
    /// need nothing. All ranges travel in one batch (one round trip).
    #[inline]
    pub fn fetch(&self, ranges: &[(u64, u64)]) -> Result<(), MemError> {
        if !self.any_remote(ranges) {
            return Ok(());
        }
        self.sync(RemoteDir::FromClient, ranges)
    }

    /// Sends what the reader wrote into the mirror copies of `ranges` to the
    /// client (data before the completion that announces it, a completion before
    /// its interrupt). Parts in shared regions need nothing.
    #[inline]
    pub fn push(&self, ranges: &[(u64, u64)]) -> Result<(), MemError> {
        if !self.any_remote(ranges) {
            return Ok(());
        }
        self.sync(RemoteDir::ToClient, ranges)
    }

    #[cold]
    fn sync(&self, dir: RemoteDir, ranges: &[(u64, u64)]) -> Result<(), MemError> {
        let mut ops: Vec<(Arc<dyn RemoteDma>, RemoteOp<'_>)> = Vec::new();
        // Which input range each op came from, for the error.
        let mut origin: Vec<usize> = Vec::new();
        for (i, &(addr, len)) in ranges.iter().enumerate() {
            let unmapped = MemError::Unmapped { addr, len };
            let end = addr.checked_add(len).ok_or(unmapped.clone())?;
            let mut a = addr;
            while a < end {
                let r = self.region_for(a).ok_or(unmapped.clone())?;
                let piece = (end - a).min(r.last() - a + 1);
                if let Some(port) = r.remote() {
                    let (what, ok) = match dir {
                        RemoteDir::FromClient => ("read", r.prot().read),
                        RemoteDir::ToClient => ("write", r.prot().write),
                    };
                    if !ok {
                        return Err(MemError::Permission { addr: a, what });
                    }
                    if r.is_gone() {
                        return Err(MemError::Remote {
                            addr,
                            len,
                            source: RemoteError::Unmapped,
                        });
                    }
                    let n = usize::try_from(piece).map_err(|_| unmapped.clone())?;
                    let buf = r.slice(a - r.iova(), n).ok_or(unmapped.clone())?;
                    ops.push((
                        port.clone(),
                        RemoteOp {
                            iova: a,
                            buf,
                            dir,
                            result: Ok(()),
                        },
                    ));
                    origin.push(i);
                }
                a += piece;
            }
        }
        if ops.is_empty() {
            return Ok(());
        }
        crate::remote::run(&mut ops);
        for ((_, op), i) in ops.iter().zip(origin) {
            if let Err(source) = op.result {
                let (addr, len) = ranges[i];
                return Err(MemError::Remote { addr, len, source });
            }
        }
        Ok(())
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

    /// A client whose memory is a vector at IOVA `base`.
    #[derive(Debug)]
    struct FakeClient {
        base: u64,
        mem: std::sync::Mutex<Vec<u8>>,
        batches: std::sync::atomic::AtomicUsize,
    }

    impl RemoteDma for FakeClient {
        fn transfer(&self, ops: &mut [RemoteOp<'_>]) {
            self.batches
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let mut mem = self.mem.lock().unwrap();
            for op in ops {
                let off = (op.iova - self.base) as usize;
                let r = &mut mem[off..off + op.buf.len()];
                op.result = match op.dir {
                    RemoteDir::FromClient => op.buf.write_from(0, r),
                    RemoteDir::ToClient => op.buf.read_into(0, r),
                }
                .map_err(|_| RemoteError::BadReply);
            }
        }
        fn set_paused(&self, _: bool) {}
    }

    #[test]
    fn mirrors_move_bytes_only_when_asked() {
        let client = Arc::new(FakeClient {
            base: 0x20000,
            mem: std::sync::Mutex::new((0..0x2000).map(|i| i as u8).collect()),
            batches: Default::default(),
        });
        let m = map();
        assert!(!m.has_remote());
        assert!(m.fetch(&[(0x10000, 16)]).is_ok(), "no-op without mirrors");
        let port: Arc<dyn RemoteDma> = client.clone();
        let mirror = MappedRegion::mirror(0x20000, 0x2000, crate::Prot::RW, port).unwrap();
        let m = m.with_region(Arc::new(mirror)).unwrap();
        assert!(m.has_remote() && m.is_remote(0x21000) && !m.is_remote(0x10000));
        let s = m.translate(0x20100, 4, Access::Read).unwrap();
        assert_eq!(s.read_obj::<[u8; 4]>(0).unwrap(), [0; 4], "not fetched yet");
        // Two ranges (one partly in a shared region) go in one batch.
        m.fetch(&[(0x20100, 4), (0x13ff0, 0x10)]).unwrap();
        assert_eq!(client.batches.load(std::sync::atomic::Ordering::Relaxed), 1);
        assert_eq!(s.read_obj::<[u8; 4]>(0).unwrap(), [0, 1, 2, 3]);
        s.write_from(0, &[9, 9]).unwrap();
        m.push(&[(0x20100, 2)]).unwrap();
        assert_eq!(&client.mem.lock().unwrap()[0x100..0x104], &[9, 9, 2, 3]);
        // Outside every mirror: nothing to move (translating it is what refuses it).
        assert!(m.fetch(&[(0x22000, 1)]).is_ok());
        // Partly past a mirror's end: refused before anything moves.
        assert!(matches!(
            m.fetch(&[(0x21fff, 2)]),
            Err(MemError::Unmapped { .. })
        ));
        assert_eq!(client.batches.load(std::sync::atomic::Ordering::Relaxed), 2);
        // An unmapped mirror refuses transfers from old snapshots.
        m.regions()[2].set_gone();
        assert!(matches!(
            m.push(&[(0x20100, 1)]),
            Err(MemError::Remote {
                source: RemoteError::Unmapped,
                ..
            })
        ));
    }
}
