//! The driver's DMA memory: one memfd mapped by both processes, carved first-fit.

use std::sync::{Arc, Mutex};

use guest_mem::{DmaSlice, SharedMem};

use crate::dptr::PAGE;
use crate::error::{Error, Result};

#[derive(Debug)]
pub(crate) struct Pool {
    pub mem: Arc<SharedMem>,
    pub iova: u64,
    free: Mutex<Vec<(u64, u64)>>,
}

/// A page-aligned piece of the pool, returned on drop.
#[derive(Debug)]
pub(crate) struct Chunk {
    pool: Arc<Pool>,
    pub off: u64,
    pub len: u64,
}

impl Pool {
    pub fn new(mem: Arc<SharedMem>, iova: u64) -> Pool {
        let len = mem.len();
        Pool {
            mem,
            iova,
            free: Mutex::new(vec![(0, len)]),
        }
    }

    pub fn alloc(self: &Arc<Self>, len: u64) -> Result<Chunk> {
        let len = len.max(1).div_ceil(PAGE) * PAGE;
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let i = free
            .iter()
            .position(|(_, l)| *l >= len)
            .ok_or(Error::NoResources("DMA pool exhausted (raise pool size)"))?;
        let (off, l) = free[i];
        if l == len {
            free.remove(i);
        } else {
            free[i] = (off + len, l - len);
        }
        drop(free);
        // Fresh memory for a queue must not carry stale phase bits.
        if let Some(s) = self.mem.slice(off, len as usize) {
            s.fill(0);
        }
        Ok(Chunk {
            pool: self.clone(),
            off,
            len,
        })
    }

    fn release(&self, off: u64, len: u64) {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let i = free.partition_point(|(o, _)| *o < off);
        free.insert(i, (off, len));
        // Coalesce with neighbours so big allocations stay possible.
        if i + 1 < free.len() && free[i].0 + free[i].1 == free[i + 1].0 {
            free[i].1 += free[i + 1].1;
            free.remove(i + 1);
        }
        if i > 0 && free[i - 1].0 + free[i - 1].1 == free[i].0 {
            free[i - 1].1 += free[i].1;
            free.remove(i);
        }
    }
}

impl Chunk {
    pub fn iova(&self) -> u64 {
        self.pool.iova + self.off
    }
    pub fn slice(&self) -> DmaSlice<'_> {
        self.pool
            .mem
            .slice(self.off, self.len as usize)
            .expect("chunk lies inside its pool")
    }
    pub fn mem(&self) -> &Arc<SharedMem> {
        &self.pool.mem
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        self.pool.release(self.off, self.len);
    }
}

/// A data buffer in DMA memory: what the controller sees at `iova()` is what
/// `read`/`write` touch.
#[derive(Debug, Clone)]
pub struct DmaBuf {
    mem: Arc<SharedMem>,
    off: u64,
    iova: u64,
    len: usize,
    _owner: Option<Arc<Chunk>>,
}

impl DmaBuf {
    pub(crate) fn new(
        mem: Arc<SharedMem>,
        off: u64,
        iova: u64,
        len: usize,
        owner: Option<Arc<Chunk>>,
    ) -> DmaBuf {
        DmaBuf {
            mem,
            off,
            iova,
            len,
            _owner: owner,
        }
    }
    pub fn iova(&self) -> u64 {
        self.iova
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn slice(&self) -> DmaSlice<'_> {
        self.mem
            .slice(self.off, self.len)
            .expect("buffer lies inside the pool")
    }
    /// A sub-buffer (e.g. to test unaligned PRP1); `None` if out of bounds.
    pub fn sub(&self, off: usize, len: usize) -> Option<DmaBuf> {
        if off.checked_add(len)? > self.len {
            return None;
        }
        Some(DmaBuf {
            mem: self.mem.clone(),
            off: self.off + off as u64,
            iova: self.iova + off as u64,
            len,
            _owner: self._owner.clone(),
        })
    }
    pub fn write(&self, off: usize, src: &[u8]) -> Result<()> {
        self.slice()
            .write_from(off, src)
            .map_err(|_| Error::Invalid("write past the end of a DmaBuf".into()))
    }
    pub fn read(&self, off: usize, dst: &mut [u8]) -> Result<()> {
        self.slice()
            .read_into(off, dst)
            .map_err(|_| Error::Invalid("read past the end of a DmaBuf".into()))
    }
    pub fn fill(&self, byte: u8) {
        self.slice().fill(byte)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_free_coalesce() {
        let p = Arc::new(Pool::new(
            Arc::new(SharedMem::new("p", 8 * PAGE).unwrap()),
            0x1000_0000,
        ));
        let a = p.alloc(100).unwrap();
        let b = p.alloc(3 * PAGE).unwrap();
        let c = p.alloc(4 * PAGE).unwrap();
        assert_eq!((a.off, b.off, c.off), (0, PAGE, 4 * PAGE));
        assert!(p.alloc(1).is_err());
        drop(b);
        drop(a);
        let d = p.alloc(4 * PAGE).unwrap();
        assert_eq!(d.off, 0);
        assert_eq!(d.iova(), 0x1000_0000);
    }
}
